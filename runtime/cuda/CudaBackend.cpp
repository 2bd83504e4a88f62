//===- CudaBackend.cpp - The CUDA implementation of rt::Backend -------------===//
//
// Creating the backend; memory, transfers and device-side checks; the op
// table built from ops/Ops.def and the host fallback; the GEMM, reduction
// and copy building blocks the op methods share; the factory.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/CudaOps.h"

#include <algorithm>

using namespace llvm;

namespace pipec::cuda {

Expected<std::unique_ptr<CudaBackend>> CudaBackend::create(int device, bool bf16,
                                                           std::unique_ptr<rt::Backend> host) {
  auto devices = listDevices();
  if (!devices)
    return createStringError(inconvertibleErrorCode(), "no CUDA device: %s",
                             toString(devices.takeError()).c_str());
  if (devices->empty())
    return createStringError(inconvertibleErrorCode(),
                             "no CUDA device: this machine has none (or no driver)");
  int count = static_cast<int>(devices->size());
  if (device < 0 || device >= count)
    return createStringError(inconvertibleErrorCode(),
                             "no CUDA device: cuda:%d is out of range (this machine has %d: "
                             "cuda:0..cuda:%d)",
                             device, count, count - 1);
  if (!host)
    return createStringError(inconvertibleErrorCode(), "cuda:%d: no host backend", device);
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device, bf16, std::move(host)));
  if (Error err = backend->init())
    return createStringError(inconvertibleErrorCode(), "cuda:%d: %s", device,
                             toString(std::move(err)).c_str());
  return backend;
}

Error CudaBackend::init() {
  if (Error err = enter())
    return err;
  PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PIPEC_CUDA_TRY(cublasCreate(&blas));
  PIPEC_CUDA_TRY(cublasSetStream(blas, stream));
  // Plain fp32 unless bf16 is asked for: no TF32 behind the user's back.
  PIPEC_CUDA_TRY(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
  PIPEC_CUDA_TRY(cublasLtCreate(&lt));
  pool = DevicePool::create(device);
  PIPEC_TRY_ASSIGN(block, pool->allocate(MaxChecks * sizeof(int)));
  flagBlock = block;
  flags = static_cast<int *>(flagBlock.get());
  PIPEC_CUDA_TRY(cudaMemsetAsync(flags, 0, MaxChecks * sizeof(int), stream));
  void *pinned = nullptr;
  if (cudaHostAlloc(&pinned, StagingBytes, cudaHostAllocDefault) == cudaSuccess)
    staging = static_cast<char *>(pinned);
  else
    cudaGetLastError(); // uploads go synchronous instead
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  return Error::success();
}

CudaBackend::~CudaBackend() {
  // Errors cannot be returned from here; a sticky device error shows in
  // whatever ran last.
  if (cudaSetDevice(device) != cudaSuccess)
    return;
  if (stream)
    cudaStreamSynchronize(stream);
  retireHolds(true);
  heldNow.clear();
  for (const Staged &s : staged)
    cudaEventDestroy(s.done);
  for (cudaEvent_t e : spareEvents)
    cudaEventDestroy(e);
  if (staging)
    cudaFreeHost(staging);
  if (blas)
    cublasDestroy(blas);
  ltPlans.clear();
  if (lt)
    cublasLtDestroy(lt);
  ltWorkspace.reset();
  flagBlock.reset();
  constants.clear();
  if (stream)
    cudaStreamDestroy(stream);
  cudaGetLastError();
}

//===----------------------------------------------------------------------===//
// Memory and transfers
//===----------------------------------------------------------------------===//

Expected<Tensor> CudaBackend::allocate(DType type, Shape shape) {
  size_t bytes = static_cast<size_t>(product(shape)) * cpu::storageSize(type);
  ++counted.allocations;
  PIPEC_TRY_ASSIGN(block, pool->allocate(bytes));
  return Tensor::onDevice(type, std::move(shape), std::move(block), device);
}

Error CudaBackend::uploadInto(void *dst, const void *src, size_t bytes) {
  if (bytes == 0)
    return Error::success();
  if (!staging) {
    PIPEC_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    ++counted.hostSyncs;
    PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
    return Error::success();
  }
  // Through the ring in pieces of half of it: one piece is copied while the
  // next is staged, and no upload waits for the whole stream.
  constexpr size_t Piece = StagingBytes / 2;
  for (size_t offset = 0; offset < bytes; offset += Piece)
    if (Error err = stage(static_cast<char *>(dst) + offset,
                          static_cast<const char *>(src) + offset, std::min(Piece, bytes - offset)))
      return err;
  return Error::success();
}

Error CudaBackend::stage(void *dst, const void *src, size_t bytes) {
  size_t size = (bytes + 255) / 256 * 256;
  // A ring of pinned memory: earlier copies out of the region this one
  // takes must be done (events complete in stream order, so waiting for the
  // last overlapping one covers the others).
  if (stagingHead + size > StagingBytes)
    stagingHead = 0;
  std::optional<size_t> lastOverlap;
  for (size_t i = 0; i < staged.size(); ++i)
    if (staged[i].offset < stagingHead + size && stagingHead < staged[i].offset + staged[i].size)
      lastOverlap = i;
  if (lastOverlap) {
    PIPEC_CUDA_TRY(cudaEventSynchronize(staged[*lastOverlap].done));
    for (size_t i = 0; i <= *lastOverlap; ++i) {
      spareEvents.push_back(staged.front().done);
      staged.pop_front();
    }
  }
  std::memcpy(staging + stagingHead, src, bytes);
  PIPEC_CUDA_TRY(
      cudaMemcpyAsync(dst, staging + stagingHead, bytes, cudaMemcpyHostToDevice, stream));
  PIPEC_TRY_ASSIGN(done, newEvent());
  PIPEC_CUDA_TRY(cudaEventRecord(done, stream));
  staged.push_back({stagingHead, size, done});
  stagingHead += size;
  return Error::success();
}

Expected<Tensor> CudaBackend::upload(const Tensor &host) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(out, onDevice(host));
  if (Error err = commitHolds())
    return err;
  return out;
}

Expected<Tensor> CudaBackend::onDevice(const Tensor &t) {
  if (t.device() == device) {
    if (t.byteSize() > 0 && !pool->owns(t.rawData()))
      heldNow.push_back(t);
    return t;
  }
  PIPEC_TRY_ASSIGN(out, allocate(t.elemType(), t.shape()));
  if (t.onHost()) {
    if (Error err = uploadInto(out.rawData(), t.rawData(), t.byteSize()))
      return err;
  } else if (t.byteSize() > 0) {
    PIPEC_CUDA_TRY(
        cudaMemcpyPeerAsync(out.rawData(), device, t.rawData(), t.device(), t.byteSize(), stream));
    // The copy is still queued when the caller drops its handle; the other
    // device's pool must not hand the memory out before it has run.
    heldNow.push_back(t);
  }
  return out;
}

Expected<Tensor> CudaBackend::download(const Tensor &tensor) {
  if (tensor.onHost())
    return tensor;
  if (Error err = enter())
    return err;
  Tensor host(tensor.elemType(), tensor.shape());
  if (tensor.byteSize() > 0)
    PIPEC_CUDA_TRY(cudaMemcpyAsync(host.rawData(), tensor.rawData(), tensor.byteSize(),
                                   cudaMemcpyDefault, stream));
  ++counted.hostSyncs;
  counted.deviceToHostBytes += static_cast<int64_t>(tensor.byteSize());
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  retireHolds(true);
  if (Error err = verifyChecks())
    return err;
  return host;
}

Expected<std::vector<Tensor>> CudaBackend::downloadAll(ArrayRef<const Tensor *> tensors) {
  if (Error err = enter())
    return err;
  std::vector<Tensor> out;
  bool queued = false;
  for (const Tensor *t : tensors) {
    if (t->onHost()) {
      out.push_back(*t);
      continue;
    }
    Tensor host(t->elemType(), t->shape());
    if (t->byteSize() > 0)
      PIPEC_CUDA_TRY(
          cudaMemcpyAsync(host.rawData(), t->rawData(), t->byteSize(), cudaMemcpyDefault, stream));
    counted.deviceToHostBytes += static_cast<int64_t>(t->byteSize());
    out.push_back(std::move(host));
    queued = true;
  }
  if (!queued)
    return out;
  ++counted.hostSyncs;
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  retireHolds(true);
  if (Error err = verifyChecks())
    return err;
  return out;
}

Expected<Shape> CudaBackend::hostInts(const Tensor &t) {
  if (t.onHost())
    return t.toInt64Vector();
  PIPEC_TRY_ASSIGN(host, download(t));
  return host.toInt64Vector();
}

Expected<std::optional<Shape>> CudaBackend::intsFromInputOrAttr(const NodeView &n, size_t i,
                                                                StringRef name) {
  if (const Tensor *t = n.in(i)) {
    PIPEC_TRY_ASSIGN(values, hostInts(*t));
    return std::optional<Shape>(values);
  }
  return n.attrInts(name);
}

Expected<Tensor> CudaBackend::zeros(DType type, ArrayRef<int64_t> shape) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(out, allocate(type, shape.vec()));
  if (out.byteSize() > 0)
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
  return out;
}

Expected<Tensor> CudaBackend::slice(const Tensor &t, int64_t begin, int64_t count) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(in, onDevice(t));
  PIPEC_TRY_ASSIGN(out, allocate(in.elemType(), {count}));
  size_t width = cpu::storageSize(in.elemType());
  int64_t copied = std::clamp<int64_t>(in.numElements() - begin, 0, count);
  if (copied > 0)
    PIPEC_CUDA_TRY(cudaMemcpyAsync(out.rawData(),
                                   static_cast<const char *>(in.rawData()) + begin * width,
                                   copied * width, cudaMemcpyDeviceToDevice, stream));
  if (copied < count)
    PIPEC_CUDA_TRY(cudaMemsetAsync(static_cast<char *>(out.rawData()) + copied * width, 0,
                                   (count - copied) * width, stream));
  return out;
}

Error CudaBackend::reserve(int64_t bytes) {
  if (Error err = enter())
    return err;
  return pool->reserve(bytes > 0 ? static_cast<size_t>(bytes) : 0);
}

Error CudaBackend::synchronize() {
  if (Error err = enter())
    return err;
  if (Error err = commitHolds())
    return err;
  ++counted.hostSyncs;
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  retireHolds(true);
  return verifyChecks();
}

Expected<cudaEvent_t> CudaBackend::newEvent() {
  cudaEvent_t event;
  if (spareEvents.empty()) {
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  } else {
    event = spareEvents.back();
    spareEvents.pop_back();
  }
  return event;
}

Error CudaBackend::commitHolds() {
  if (heldNow.empty())
    return Error::success();
  PIPEC_TRY_ASSIGN(done, newEvent());
  PIPEC_CUDA_TRY(cudaEventRecord(done, stream));
  held.push_back({done, std::move(heldNow)});
  heldNow.clear();
  return Error::success();
}

void CudaBackend::retireHolds(bool all) {
  while (!held.empty()) {
    if (!all && cudaEventQuery(held.front().done) != cudaSuccess) {
      // cudaErrorNotReady is also left as the thread's last error, which the
      // next kernel launch (or cuBLAS) would take for its own failure. A
      // device error stays sticky and is reported by the next call.
      cudaGetLastError();
      break;
    }
    spareEvents.push_back(held.front().done);
    held.pop_front();
  }
}

//===----------------------------------------------------------------------===//
// Device-side checks
//===----------------------------------------------------------------------===//

int *CudaBackend::checkSlot(const NodeView &n, StringRef what) {
  // run() verifies before the list can fill, so a slot is always free.
  assert(pendingChecks.size() < MaxChecks && "device checks not verified in time");
  pendingChecks.push_back(formatv("node '{0}' ({1}): {2}", nodeLabel(n.node), n.op(), what).str());
  return flags + pendingChecks.size() - 1;
}

Error CudaBackend::verifyChecks() {
  if (pendingChecks.empty())
    return Error::success();
  std::vector<int> found(pendingChecks.size());
  PIPEC_CUDA_TRY(cudaMemcpyAsync(found.data(), flags, found.size() * sizeof(int),
                                 cudaMemcpyDeviceToHost, stream));
  PIPEC_CUDA_TRY(cudaMemsetAsync(flags, 0, found.size() * sizeof(int), stream));
  ++counted.hostSyncs;
  counted.deviceToHostBytes += static_cast<int64_t>(found.size() * sizeof(int));
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  std::vector<std::string> checks = std::move(pendingChecks);
  pendingChecks.clear();
  for (size_t i = 0; i < found.size(); ++i)
    if (found[i])
      return createStringError(inconvertibleErrorCode(), "%s (found on cuda:%d)", checks[i].c_str(),
                               device);
  return Error::success();
}

//===----------------------------------------------------------------------===//
// Dispatch
//===----------------------------------------------------------------------===//

Expected<Outputs> CudaBackend::run(const onnx::NodeProto &node, int64_t opset,
                                   ArrayRef<const Tensor *> inputs) {
  if (Error err = enter())
    return err;
  if (pendingChecks.size() + 1 >= MaxChecks)
    if (Error err = verifyChecks())
      return err;
  retireHolds(false);
  ++counted.launches;
  Expected<Outputs> outputs = dispatch(NodeView(node, opset, inputs, device));
  Error holds = commitHolds();
  if (!outputs) {
    consumeError(std::move(holds));
    return outputs.takeError();
  }
  if (holds)
    return holds;
  return outputs;
}

Expected<Outputs> CudaBackend::dispatch(const NodeView &n) {
  const onnx::NodeProto &node = n.node;
  bool defaultDomain = node.domain().empty() || node.domain() == "ai.onnx";
  if (n.is(OpId::Constant))
    return runConstant(n);
  if (defaultDomain && isHostShapeMath(n))
    return runOnHost(n, n.allInputs());
  Result result = runDevice(n);
  if (!result)
    return n.wrap(result.takeError());
  if (*result)
    return std::move(**result);
  return runFallback(n);
}

bool CudaBackend::isHostShapeMath(const NodeView &n) const {
  if (n.numInputs() == 0)
    return false;
  for (const Tensor *t : n.allInputs())
    if (t && (!t->onHost() || !isIntegral(t->elemType()) || t->numElements() > HostIntLimit))
      return false;
  return true;
}

Expected<Outputs> CudaBackend::runOnHost(const NodeView &n, ArrayRef<const Tensor *> inputs) {
  auto outputs = host->run(n.node, n.opset, inputs);
  if (!outputs)
    return outputs.takeError();
  for (Tensor &t : *outputs) {
    if (t.isNull() || (isIntegral(t.elemType()) && t.numElements() <= HostIntLimit))
      continue;
    PIPEC_TRY_ASSIGN(uploaded, onDevice(t));
    t = uploaded;
  }
  return std::move(*outputs);
}

Expected<Outputs> CudaBackend::runConstant(const NodeView &n) {
  // Keyed by the whole node: the executor runs the same nodes every
  // microbatch, so their values are uploaded once.
  std::string key = n.node.SerializeAsString();
  if (auto it = constants.find(key); it != constants.end())
    return it->second;
  auto outputs = runOnHost(n, n.allInputs());
  if (!outputs)
    return outputs.takeError();
  size_t bytes = 0;
  for (const Tensor &t : *outputs)
    bytes += t.isNull() ? 0 : t.byteSize();
  if (bytes <= ConstantCacheBytes) {
    if (constantBytes + bytes > 64 * ConstantCacheBytes) {
      constants.clear();
      constantBytes = 0;
    }
    constants.emplace(std::move(key), *outputs);
    constantBytes += bytes;
  }
  return std::move(*outputs);
}

Expected<Outputs> CudaBackend::runFallback(const NodeView &n) {
  std::vector<Tensor> hosts(n.numInputs());
  std::vector<const Tensor *> pointers(n.numInputs(), nullptr);
  for (size_t i = 0; i < n.numInputs(); ++i) {
    const Tensor *t = n.allInputs()[i];
    if (!t || t->isNull() || t->onHost()) {
      pointers[i] = t;
      continue;
    }
    PIPEC_TRY_ASSIGN(host, download(*t));
    hosts[i] = host;
    pointers[i] = &hosts[i];
  }
  auto outputs = runOnHost(n, pointers);
  if (outputs)
    ++fallbacks[n.op().str()];
  return outputs;
}

Result CudaBackend::runDevice(const NodeView &n) {
  using Method = Result (CudaBackend::*)(const NodeView &);
  // The device kernel of each row of ops/Ops.def, by OpId.
  // clang-format off
  static const Method table[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, DEVICE, ...)    \
      &CudaBackend::DEVICE,
#define PIPEC_ELEMENTWISE(ID, ...) &CudaBackend::elementwise,
#include "ops/Ops.def"
  };
  // clang-format on
  if (!n.def)
    return std::nullopt;
  return (this->*table[static_cast<size_t>(n.def->id)])(n);
}

//===----------------------------------------------------------------------===//
// Building blocks
//===----------------------------------------------------------------------===//

Expected<bool> CudaBackend::stridedCopy(const Tensor &in, const Shape &outShape,
                                        const Shape &strides, int64_t base, Tensor &out) {
  k::IndexMap map;
  if (!k::makeIndexMap(outShape, {strides}, map, {base}))
    return false;
  PIPEC_TRY_ASSIGN(result, allocate(in.elemType(), outShape));
  PIPEC_CUDA_TRY(
      launchCopy(elemBytes(in), map, in.rawData(), result.rawData(), result.numElements(), stream));
  out = result;
  return true;
}

Expected<std::optional<Tensor>> CudaBackend::broadcastTo(const Tensor &t, const Shape &shape) {
  if (t.shape() == shape)
    return std::optional<Tensor>(t);
  Tensor out;
  PIPEC_TRY_ASSIGN(done, stridedCopy(t, shape, k::broadcastStrides(t.shape(), shape), 0, out));
  if (!done)
    return std::optional<Tensor>();
  return std::optional<Tensor>(out);
}

Error CudaBackend::gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, int64_t strideA, const float *b, int64_t ldb,
                        int64_t strideB, float beta, float *c, int64_t ldc, int64_t strideC,
                        int64_t batch) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS
  // gets B first, and n and m swapped.
  cublasOperation_t opA = transA ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opB = transB ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
  int in = static_cast<int>(n), im = static_cast<int>(m), ik = static_cast<int>(k);
  int ilda = static_cast<int>(std::max<int64_t>(lda, 1));
  int ildb = static_cast<int>(std::max<int64_t>(ldb, 1));
  int ildc = static_cast<int>(std::max<int64_t>(ldc, 1));
  if (batch == 1) {
    PIPEC_CUDA_TRY(cublasGemmEx(blas, opB, opA, in, im, ik, &alpha, b, CUDA_R_32F, ildb, a,
                                CUDA_R_32F, ilda, &beta, c, CUDA_R_32F, ildc, compute,
                                CUBLAS_GEMM_DEFAULT));
  } else {
    PIPEC_CUDA_TRY(cublasGemmStridedBatchedEx(blas, opB, opA, in, im, ik, &alpha, b, CUDA_R_32F,
                                              ildb, strideB, a, CUDA_R_32F, ilda, strideA, &beta, c,
                                              CUDA_R_32F, ildc, strideC, static_cast<int>(batch),
                                              compute, CUBLAS_GEMM_DEFAULT));
  }
  return Error::success();
}

CudaBackend::LtPlan::~LtPlan() {
  for (cublasLtMatrixLayout_t layout : {bLayout, aLayout, cLayout})
    if (layout)
      cublasLtMatrixLayoutDestroy(layout);
  if (op)
    cublasLtMatmulDescDestroy(op);
}

Expected<const CudaBackend::LtPlan *> CudaBackend::ltPlan(int64_t m, int64_t n, int64_t k) {
  auto &slot = ltPlans[{m, n, k}];
  if (slot)
    return slot.get();
  auto plan = std::make_unique<LtPlan>();
  // Row-major C = A B + bias is column-major C^T[n, m] = B^T[n, k] A^T[k, m]
  // + bias, the bias one value per row of C^T: cuBLASLt's BIAS epilogue.
  cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F;
  PIPEC_CUDA_TRY(cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F));
  cublasOperation_t none = CUBLAS_OP_N;
  PIPEC_CUDA_TRY(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &none, sizeof(none)));
  PIPEC_CUDA_TRY(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  PIPEC_CUDA_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                sizeof(epilogue)));
  PIPEC_CUDA_TRY(cublasLtMatrixLayoutCreate(&plan->bLayout, CUDA_R_32F, n, k, n));
  PIPEC_CUDA_TRY(cublasLtMatrixLayoutCreate(&plan->aLayout, CUDA_R_32F, k, m, k));
  PIPEC_CUDA_TRY(cublasLtMatrixLayoutCreate(&plan->cLayout, CUDA_R_32F, n, m, n));
  cublasLtMatmulPreference_t preference = nullptr;
  PIPEC_CUDA_TRY(cublasLtMatmulPreferenceCreate(&preference));
  size_t workspace = LtWorkspaceBytes;
  cublasLtMatmulHeuristicResult_t found = {};
  int count = 0;
  bool asked = cublasLtMatmulPreferenceSetAttribute(
                   preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                   sizeof(workspace)) == CUBLAS_STATUS_SUCCESS &&
               cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->bLayout, plan->aLayout,
                                              plan->cLayout, plan->cLayout, preference, 1, &found,
                                              &count) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulPreferenceDestroy(preference);
  plan->found = asked && count > 0;
  plan->algo = found.algo;
  slot = std::move(plan);
  return slot.get();
}

Expected<bool> CudaBackend::gemmBias(int64_t m, int64_t n, int64_t k, const float *a,
                                     const float *b, const float *bias, float *c) {
  // One descriptor set and algorithm per shape, found once: a model's
  // linear layers repeat a few shapes every microbatch.
  PIPEC_TRY_ASSIGN(plan, ltPlan(m, n, k));
  if (!plan->found)
    return false;
  if (!ltWorkspace) {
    PIPEC_TRY_ASSIGN(block, pool->allocate(LtWorkspaceBytes));
    ltWorkspace = block;
  }
  PIPEC_CUDA_TRY(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
  float alpha = 1, beta = 0;
  PIPEC_CUDA_TRY(cublasLtMatmul(lt, plan->op, &alpha, b, plan->bLayout, a, plan->aLayout, &beta, c,
                                plan->cLayout, c, plan->cLayout, &plan->algo, ltWorkspace.get(),
                                LtWorkspaceBytes, stream));
  ++epilogueGemms;
  return true;
}

Error CudaBackend::gemmGrid(bool transA, bool transB, int64_t m, int64_t n, int64_t k,
                            const float *a, int64_t lda, int64_t aN, int64_t aG, const float *b,
                            int64_t ldb, int64_t bN, int64_t bG, float beta, float *c, int64_t ldc,
                            int64_t cN, int64_t cG, int64_t count, int64_t groups) {
  if (count >= groups) {
    for (int64_t g = 0; g < groups; ++g)
      if (Error err = gemm(transA, transB, m, n, k, 1.0f, a + g * aG, lda, aN, b + g * bG, ldb, bN,
                           beta, c + g * cG, ldc, cN, count))
        return err;
    return Error::success();
  }
  for (int64_t i = 0; i < count; ++i)
    if (Error err = gemm(transA, transB, m, n, k, 1.0f, a + i * aN, lda, aG, b + i * bN, ldb, bG,
                         beta, c + i * cN, ldc, cG, groups))
      return err;
  return Error::success();
}

Expected<bool> CudaBackend::reduceInto(const Tensor &x, const std::vector<bool> &reduced,
                                       double divisor, Tensor &out) {
  k::ReducePlan plan;
  if (!k::makeReducePlan(x.shape(), reduced, plan))
    return false;
  if (plan.outputs == 0)
    return true;
  PIPEC_TRY_ASSIGN(partial,
                   scratch(static_cast<size_t>(plan.outputs * plan.chunks) * sizeof(double)));
  PIPEC_CUDA_TRY(launchReduce(plan, static_cast<const float *>(x.rawData()),
                              static_cast<double *>(partial.get()), divisor,
                              static_cast<float *>(out.rawData()), stream));
  return true;
}

//===----------------------------------------------------------------------===//
// Factory
//===----------------------------------------------------------------------===//

Expected<std::unique_ptr<rt::Backend>> createCudaBackend(int device, bool bf16,
                                                         std::unique_ptr<rt::Backend> host) {
  auto backend = CudaBackend::create(device, bf16, std::move(host));
  if (!backend)
    return backend.takeError();
  return std::unique_ptr<rt::Backend>(std::move(*backend));
}

std::optional<DevicePool::Stats> poolStats(const rt::Backend &backend) {
  if (const auto *cuda = dynamic_cast<const CudaBackend *>(&backend))
    return cuda->poolStats();
  return std::nullopt;
}

std::optional<int64_t> biasEpilogueGemms(const rt::Backend &backend) {
  if (const auto *cuda = dynamic_cast<const CudaBackend *>(&backend))
    return cuda->biasEpilogueGemms();
  return std::nullopt;
}

} // namespace pipec::cuda

extern "C" __attribute__((visibility("default"))) pipec::rt::Backend *
pipecMakeCudaBackend(int device, bool bf16, pipec::rt::Backend *host, std::string *error) {
  auto backend =
      pipec::cuda::createCudaBackend(device, bf16, std::unique_ptr<pipec::rt::Backend>(host));
  if (!backend) {
    std::string message = llvm::toString(backend.takeError());
    if (error)
      *error = message;
    return nullptr;
  }
  return backend->release();
}
