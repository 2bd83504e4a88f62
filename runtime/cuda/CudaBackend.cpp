//===- CudaBackend.cpp - The CUDA implementation of rt::Backend ----------===//
//
// Layout: the node view (attributes, errors naming the node); the backend
// class with its memory, transfers and device-side checks; the op table and
// one method per op family (views, data movement, elementwise, GEMMs, rows,
// reductions, losses, gradients, convolution and pooling); the executor's
// own operations (sums, optimizer); the factory.
//
// An op method returns the node's outputs, or nullopt when the node is
// outside what the device kernels do (an element type, attribute or shape
// they do not handle, or a malformed node): run() then falls back to the
// CPU kernels, which also word the error for a malformed node exactly as
// the CPU backend does.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/CudaBackend.h"
#include "support/Attributes.h"

#include "ops/OpRegistry.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/core/OpContext.h"
#include "runtime/cuda/CudaKernels.h"
#include "runtime/cuda/CudaStatus.h"
#include "runtime/cuda/Devices.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <numeric>
#include <tuple>

using namespace llvm;

/// Declares Var as the value of an Expected, or returns its error.
#define PIPEC_TRY_ASSIGN(Var, Expr)                                                                \
  auto Var##OrError = (Expr);                                                                      \
  if (!Var##OrError)                                                                               \
    return Var##OrError.takeError();                                                               \
  auto &Var = *Var##OrError

namespace pipec::cuda {
namespace {

using cpu::ElemType;
using cpu::Tensor;
using Shape = std::vector<int64_t>;
using Outputs = std::vector<Tensor>;
/// An op's outputs, nullopt to fall back to the CPU, or an error.
using Result = Expected<std::optional<Outputs>>;
namespace k = kernels;

/// Integer tensors up to this many elements that are computed from host
/// tensors stay on the host: shapes, axes, small index lists.
constexpr int64_t HostIntLimit = 4096;
/// Device-side checks (index and label ranges) pending until the next sync.
constexpr size_t MaxChecks = 1024;
/// Pinned staging for uploads; larger uploads are synchronous.
constexpr size_t StagingBytes = size_t(8) << 20;
/// Constant outputs kept on the device, per node, up to this size.
constexpr size_t ConstantCacheBytes = size_t(1) << 20;

bool isIntegral(ElemType type) { return cpu::isInteger(type) || type == ElemType::Bool; }

std::optional<k::Scalar> scalarOf(ElemType type) {
  switch (type) {
  case ElemType::Float:
    return k::Scalar::F32;
  case ElemType::Double:
    return k::Scalar::F64;
  case ElemType::Int64:
    return k::Scalar::I64;
  case ElemType::Int32:
    return k::Scalar::I32;
  case ElemType::Bool:
    return k::Scalar::Bool;
  default:
    return std::nullopt;
  }
}

int elemBytes(const Tensor &t) { return static_cast<int>(cpu::storageSize(t.elemType())); }

bool isFloat(const Tensor *t) { return t && t->elemType() == ElemType::Float; }

int64_t product(ArrayRef<int64_t> dims) { return cpu::numElementsOf(dims); }

bool fitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

//===----------------------------------------------------------------------===//
// Node view
//===----------------------------------------------------------------------===//

/// One node under evaluation: inputs, attributes, and errors that name it.
/// A node on this backend: the OpContext every backend's kernels see, plus
/// its device for errors and a null-for-missing input accessor.
class NodeView : public OpContext {
public:
  NodeView(const onnx::NodeProto &node, int64_t opset, ArrayRef<const Tensor *> inputs, int device)
      : OpContext(node, opset, inputs, lookupOp(node.domain(), node.op_type(), opset)),
        device(device) {}

  /// Input \p i, or null when omitted.
  const Tensor *in(size_t i) const { return optInput(i); }
  /// \p axis in [-rank, rank) made non-negative, or nullopt.
  static std::optional<int64_t> axisIn(int64_t axis, int64_t rank) {
    if (axis < -rank || axis >= rank)
      return std::nullopt;
    return axis < 0 ? axis + rank : axis;
  }

  /// \p err prefixed with the node and the device.
  Error wrap(Error err) const {
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s) on cuda:%d: %s",
                             nodeLabel(node).c_str(), node.op_type().c_str(), device,
                             toString(std::move(err)).c_str());
  }

private:
  int device;
};

//===----------------------------------------------------------------------===//
// The backend
//===----------------------------------------------------------------------===//

class CudaBackend final : public rt::Backend {
public:
  static Expected<std::unique_ptr<CudaBackend>> create(int device, bool bf16,
                                                       std::unique_ptr<rt::Backend> host);
  ~CudaBackend() override;

  std::string name() const override { return "cuda:" + std::to_string(device); }
  Expected<Outputs> run(const onnx::NodeProto &node, int64_t opset,
                        ArrayRef<const Tensor *> inputs) override;
  Expected<Tensor> upload(const Tensor &host) override;
  Expected<Tensor> download(const Tensor &tensor) override;
  Expected<Tensor> zeros(ElemType type, ArrayRef<int64_t> shape) override;
  Expected<Tensor> sum(ArrayRef<const Tensor *> terms) override;
  Error addInto(Tensor &accumulator, const Tensor &term) override;
  Expected<double> sumOfSquares(ArrayRef<const Tensor *> tensors, double scale) override;
  Error optimize(const rt::OptimizerUpdate &update, Tensor &w, const Tensor &g, Tensor &m,
                 Tensor &v) override;
  Error reserve(int64_t bytes) override;
  Error synchronize() override;
  std::map<std::string, int64_t> fallbackOps() const override { return fallbacks; }

  DevicePool::Stats poolStats() const { return pool->stats(); }

private:
  CudaBackend(int device, bool bf16, std::unique_ptr<rt::Backend> host)
      : device(device), bf16(bf16), host(std::move(host)) {}
  Error init();
  /// Makes the device current for the calling thread.
  Error enter() {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    return Error::success();
  }

  // Memory and transfers.
  Expected<Tensor> allocate(ElemType type, Shape shape);
  Expected<std::shared_ptr<void>> scratch(size_t bytes) { return pool->allocate(bytes); }
  /// \p t on this device: itself, an upload, or a copy from another device.
  Expected<Tensor> onDevice(const Tensor &t);
  Error uploadInto(void *dst, const void *src, size_t bytes);
  /// One piece of an upload (at most StagingBytes) through the pinned ring.
  Error stage(void *dst, const void *src, size_t bytes);
  /// The values of a small integer tensor (downloaded if need be).
  Expected<Shape> hostInts(const Tensor &t);
  /// Input \p i's integers, else attribute \p name's, else nullopt.
  Expected<std::optional<Shape>> intsFromInputOrAttr(const NodeView &n, size_t i, StringRef name);

  // Device-side checks.
  int *checkSlot(const NodeView &n, StringRef what);
  Error verifyChecks();

  // Tensors of other pools (another rank's backend, NCCL's buffers) that this
  // stream reads stay referenced until an event recorded after the reads has
  // completed: their owner reuses the memory in its own stream's order, not
  // this one's.
  Expected<cudaEvent_t> newEvent();
  /// Records an event for the foreign tensors used since the last call.
  Error commitHolds();
  /// Drops the committed holds whose events have completed (all of them,
  /// after a sync). Holds of the op being queued stay.
  void retireHolds(bool all);

  // Dispatch.
  Expected<Outputs> dispatch(const NodeView &n);
  Result runDevice(const NodeView &n);
  /// \p n on the CPU kernels with host \p inputs: small integer outputs
  /// stay on the host (shape arithmetic), the others go to the device.
  Expected<Outputs> runOnHost(const NodeView &n, ArrayRef<const Tensor *> inputs);
  Expected<Outputs> runConstant(const NodeView &n);
  Expected<Outputs> runFallback(const NodeView &n);
  bool isHostShapeMath(const NodeView &n) const;

  // Op families.
  Result identity(const NodeView &n);
  Result view(const NodeView &n);
  Result shapeOf(const NodeView &n);
  Result constantOfShape(const NodeView &n);
  Result transpose(const NodeView &n);
  Result expand(const NodeView &n);
  Result slice(const NodeView &n);
  Result concat(const NodeView &n);
  Result split(const NodeView &n);
  Result gather(const NodeView &n);
  Result where(const NodeView &n);
  Result cast(const NodeView &n);
  Result elementwise(const NodeView &n);
  Result unary(const NodeView &n, ElemOp op);
  Result binary(const NodeView &n, ElemOp op);
  Result variadicSum(const NodeView &n);
  Result matMul(const NodeView &n);
  Result gemmOp(const NodeView &n);
  Result softmax(const NodeView &n);
  Result layerNorm(const NodeView &n);
  Result reduce(const NodeView &n);
  Result crossEntropy(const NodeView &n);
  Result sumTo(const NodeView &n);
  Result unaryGrad(const NodeView &n);
  /// No device kernel: the host runs it.
  Result none(const NodeView &) { return std::nullopt; }
  Result runBody(const NodeView &n);
  Result fused(const NodeView &n);
  Result matMulBias(const NodeView &n);
  Result softmaxGrad(const NodeView &n);
  Result gatherGrad(const NodeView &n);
  Result layerNormGradInput(const NodeView &n);
  Result layerNormGradWeight(const NodeView &n);
  Result crossEntropyGrad(const NodeView &n);
  Result conv(const NodeView &n);
  Result convGradInput(const NodeView &n);
  Result convGradWeight(const NodeView &n);
  Result windowPool(const NodeView &n);
  Result poolGrad(const NodeView &n);
  Result globalAveragePool(const NodeView &n);
  Result batchNorm(const NodeView &n);
  Result batchNormGradWeight(const NodeView &n);

  // Building blocks.
  /// out = in read through \p strides (one per output dimension) from
  /// \p base: transposes, slices, broadcasts. False: too many dimensions.
  Expected<bool> stridedCopy(const Tensor &in, const Shape &outShape, const Shape &strides,
                             int64_t base, Tensor &out);
  /// \p t broadcast to \p shape as a new tensor (or \p t when it has it).
  Expected<std::optional<Tensor>> broadcastTo(const Tensor &t, const Shape &shape);
  /// Row-major C = alpha op(A) op(B) + beta C on float, \p batch times with
  /// the given element strides; bf16 tensor cores when the backend has them.
  Error gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
             int64_t lda, int64_t strideA, const float *b, int64_t ldb, int64_t strideB, float beta,
             float *c, int64_t ldc, int64_t strideC, int64_t batch);
  /// gemm for every (image n < \p count, group g < \p groups), operand X at
  /// X + n * xN + g * xG: strided batches over the longer of the two.
  Error gemmGrid(bool transA, bool transB, int64_t m, int64_t n, int64_t k, const float *a,
                 int64_t lda, int64_t aN, int64_t aG, const float *b, int64_t ldb, int64_t bN,
                 int64_t bG, float beta, float *c, int64_t ldc, int64_t cN, int64_t cG,
                 int64_t count, int64_t groups);
  /// Row-major C[m, n] = A[m, k] B[k, n] + bias[n], the bias added in
  /// cuBLASLt's epilogue; false when cuBLASLt offers no algorithm for it.
  Expected<bool> gemmBias(int64_t m, int64_t n, int64_t k, const float *a, const float *b,
                          const float *bias, float *c);
  /// A float sum of \p x over the dimensions marked \p reduced, into \p out
  /// (its element count is the kept dimensions' product), times \p scale.
  Expected<bool> reduceInto(const Tensor &x, const std::vector<bool> &reduced, double scale,
                            Tensor &out);

  int device;
  bool bf16;
  /// Runs what this device does not: shape arithmetic, constants and the
  /// ops without a device kernel (the CPU backend).
  std::unique_ptr<rt::Backend> host;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  /// cuBLASLt's workspace (allocated on first use).
  static constexpr size_t LtWorkspaceBytes = size_t(32) << 20;
  std::shared_ptr<void> ltWorkspace;
  /// A bias-epilogue GEMM of one shape: descriptors and the algorithm
  /// cuBLASLt's heuristic chose (found: it offered one).
  struct LtPlan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t bLayout = nullptr, aLayout = nullptr, cLayout = nullptr;
    cublasLtMatmulAlgo_t algo = {};
    bool found = false;
    ~LtPlan();
  };
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<LtPlan>> ltPlans;
  Expected<const LtPlan *> ltPlan(int64_t m, int64_t n, int64_t k);
  std::shared_ptr<DevicePool> pool;

  std::shared_ptr<void> flagBlock;
  int *flags = nullptr;
  std::vector<std::string> pendingChecks;

  struct Staged {
    size_t offset, size;
    cudaEvent_t done;
  };
  char *staging = nullptr;
  size_t stagingHead = 0;
  std::deque<Staged> staged;
  std::vector<cudaEvent_t> spareEvents;

  struct Held {
    cudaEvent_t done;
    std::vector<Tensor> tensors;
  };
  std::vector<Tensor> heldNow;
  std::deque<Held> held;

  std::map<std::string, Outputs> constants;
  size_t constantBytes = 0;
  std::map<std::string, int64_t> fallbacks;
};

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

Expected<Tensor> CudaBackend::allocate(ElemType type, Shape shape) {
  size_t bytes = static_cast<size_t>(product(shape)) * cpu::storageSize(type);
  PIPEC_TRY_ASSIGN(block, pool->allocate(bytes));
  return Tensor::onDevice(type, std::move(shape), std::move(block), device);
}

Error CudaBackend::uploadInto(void *dst, const void *src, size_t bytes) {
  if (bytes == 0)
    return Error::success();
  if (!staging) {
    PIPEC_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
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
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  retireHolds(true);
  if (Error err = verifyChecks())
    return err;
  return host;
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

Expected<Tensor> CudaBackend::zeros(ElemType type, ArrayRef<int64_t> shape) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(out, allocate(type, shape.vec()));
  if (out.byteSize() > 0)
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
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
  if (defaultDomain && n.op() == "Constant")
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
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, DEVICE, FLAGS)  \
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
                                       double scale, Tensor &out) {
  k::ReducePlan plan;
  if (!k::makeReducePlan(x.shape(), reduced, plan))
    return false;
  if (plan.outputs == 0)
    return true;
  PIPEC_TRY_ASSIGN(partial,
                   scratch(static_cast<size_t>(plan.outputs * plan.chunks) * sizeof(double)));
  PIPEC_CUDA_TRY(launchReduce(plan, static_cast<const float *>(x.rawData()),
                              static_cast<double *>(partial.get()), scale,
                              static_cast<float *>(out.rawData()), stream));
  return true;
}

//===----------------------------------------------------------------------===//
// Views and shapes
//===----------------------------------------------------------------------===//

Result CudaBackend::identity(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  return Outputs{dev};
}

/// Reshape, Flatten, Squeeze and Unsqueeze: the new shape as the CPU kernels
/// compute it, over the input's memory.
Result CudaBackend::view(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  const Shape &in = x->shape();
  int64_t rank = x->rank();
  Shape shape;
  StringRef op = n.op();
  if (op == "Reshape") {
    PIPEC_TRY_ASSIGN(requested, intsFromInputOrAttr(n, 1, "shape"));
    if (!requested)
      return std::nullopt;
    bool allowZero = n.attrInt("allowzero", 0);
    int64_t inferred = -1;
    for (size_t i = 0; i < requested->size(); ++i) {
      int64_t d = (*requested)[i];
      if (d == -1) {
        if (inferred >= 0)
          return std::nullopt;
        inferred = static_cast<int64_t>(i);
        shape.push_back(1);
      } else if (d == 0 && !allowZero) {
        if (static_cast<int64_t>(i) >= rank)
          return std::nullopt;
        shape.push_back(in[i]);
      } else if (d < 0) {
        return std::nullopt;
      } else {
        shape.push_back(d);
      }
    }
    if (inferred >= 0) {
      int64_t known = product(shape);
      if (known == 0 || x->numElements() % known != 0)
        return std::nullopt;
      shape[inferred] = x->numElements() / known;
    }
  } else if (op == "Flatten") {
    int64_t axis = n.attrInt("axis", 1);
    if (axis < 0)
      axis += rank;
    if (axis < 0 || axis > rank)
      return std::nullopt;
    shape = {product(ArrayRef<int64_t>(in).take_front(axis)),
             product(ArrayRef<int64_t>(in).drop_front(axis))};
  } else if (op == "Squeeze") {
    PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
    std::vector<bool> drop(rank, false);
    if (!axes) {
      for (int64_t i = 0; i < rank; ++i)
        drop[i] = in[i] == 1;
    } else {
      for (int64_t a : *axes) {
        auto axis = NodeView::axisIn(a, rank);
        if (!axis || in[*axis] != 1)
          return std::nullopt;
        drop[*axis] = true;
      }
    }
    for (int64_t i = 0; i < rank; ++i)
      if (!drop[i])
        shape.push_back(in[i]);
  } else { // Unsqueeze
    PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
    if (!axes)
      return std::nullopt;
    int64_t outRank = rank + static_cast<int64_t>(axes->size());
    std::vector<bool> inserted(outRank, false);
    for (int64_t a : *axes) {
      auto axis = NodeView::axisIn(a, outRank);
      if (!axis || inserted[*axis])
        return std::nullopt;
      inserted[*axis] = true;
    }
    int64_t next = 0;
    for (int64_t i = 0; i < outRank; ++i)
      shape.push_back(inserted[i] ? 1 : in[next++]);
  }
  if (product(shape) != x->numElements())
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  return Outputs{dev.reshaped(shape)};
}

/// Shape and Size: host int64, as the CPU kernels make them.
Result CudaBackend::shapeOf(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  if (n.op() == "Size")
    return Outputs{Tensor::scalar<int64_t>(x->numElements())};
  int64_t rank = x->rank();
  int64_t start = n.attrInt("start", 0), end = n.attrInt("end", rank);
  if (start < 0)
    start += rank;
  if (end < 0)
    end += rank;
  start = std::clamp<int64_t>(start, 0, rank);
  end = std::clamp<int64_t>(end, 0, rank);
  Shape dims(x->shape().begin() + start, x->shape().begin() + std::max(start, end));
  return Outputs{Tensor::fromValues<int64_t>({static_cast<int64_t>(dims.size())}, dims)};
}

Result CudaBackend::constantOfShape(const NodeView &n) {
  const Tensor *shapeInput = n.in(0);
  if (!shapeInput || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(shape, hostInts(*shapeInput));
  if (llvm::any_of(shape, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  Tensor value = Tensor::scalar(0.0f);
  if (const auto *a = n.attr("value")) {
    auto given = cpu::fromTensorProto(a->t());
    if (!given) {
      consumeError(given.takeError());
      return std::nullopt;
    }
    if (given->numElements() != 1)
      return std::nullopt;
    value = *given;
  }
  PIPEC_TRY_ASSIGN(out, allocate(value.elemType(), shape));
  uint64_t pattern = 0;
  std::memcpy(&pattern, value.rawData(), value.byteSize());
  if (out.numElements() > 0) {
    if (pattern == 0)
      PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    else
      PIPEC_CUDA_TRY(launchFill(elemBytes(out), pattern, out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Data movement
//===----------------------------------------------------------------------===//

Result CudaBackend::transpose(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  int64_t rank = x->rank();
  Shape perm(rank);
  if (std::optional<Shape> given = n.attrInts("perm")) {
    perm = *given;
    Shape sorted = perm;
    llvm::sort(sorted);
    if (static_cast<int64_t>(sorted.size()) != rank)
      return std::nullopt;
    for (int64_t i = 0; i < rank; ++i)
      if (sorted[i] != i)
        return std::nullopt;
  } else {
    for (int64_t i = 0; i < rank; ++i)
      perm[i] = rank - 1 - i;
  }
  Shape inStrides = k::contiguousStrides(x->shape()), outShape(rank), strides(rank);
  for (int64_t i = 0; i < rank; ++i) {
    outShape[i] = x->dim(perm[i]);
    strides[i] = inStrides[perm[i]];
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done, stridedCopy(dev, outShape, strides, 0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

Result CudaBackend::expand(const NodeView &n) {
  const Tensor *x = n.in(0), *shapeInput = n.in(1);
  if (!x || !shapeInput || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(requested, hostInts(*shapeInput));
  if (llvm::any_of(requested, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  auto shape = cpu::broadcastShapes(x->shape(), requested);
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done,
                   stridedCopy(dev, *shape, k::broadcastStrides(dev.shape(), *shape), 0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// Slice with any steps, as the CPU kernel clamps them.
Result CudaBackend::slice(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(starts, intsFromInputOrAttr(n, 1, "starts"));
  PIPEC_TRY_ASSIGN(ends, intsFromInputOrAttr(n, 2, "ends"));
  PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 3, "axes"));
  PIPEC_TRY_ASSIGN(steps, intsFromInputOrAttr(n, 4, "steps"));
  if (!starts || !ends)
    return std::nullopt;
  size_t count = starts->size();
  if (!axes) {
    axes.emplace(count);
    std::iota(axes->begin(), axes->end(), 0);
  }
  if (!steps)
    steps.emplace(count, 1);
  if (ends->size() != count || axes->size() != count || steps->size() != count)
    return std::nullopt;
  Shape shape = x->shape(), inStrides = k::contiguousStrides(x->shape()), strides = inStrides;
  int64_t base = 0;
  std::vector<bool> seen(x->rank(), false);
  for (size_t i = 0; i < count; ++i) {
    auto axis = NodeView::axisIn((*axes)[i], x->rank());
    if (!axis || seen[*axis])
      return std::nullopt;
    seen[*axis] = true;
    int64_t dim = x->dim(*axis);
    int64_t step = std::max((*steps)[i], -std::numeric_limits<int64_t>::max());
    if (step == 0)
      return std::nullopt;
    int64_t begin = (*starts)[i], end = (*ends)[i];
    if (begin < 0)
      begin += dim;
    if (end < 0)
      end += dim;
    // Lengths as 1 + (span - 1) / |step|: a step near INT64_MAX (an
    // exporter's "to the end") must not overflow.
    int64_t length = 0;
    if (step > 0) {
      begin = std::clamp<int64_t>(begin, 0, dim);
      end = std::clamp<int64_t>(end, 0, dim);
      length = end > begin ? 1 + (end - begin - 1) / step : 0;
    } else if (dim > 0) { // clamping to [0, dim - 1] needs an element
      begin = std::clamp<int64_t>(begin, 0, dim - 1);
      end = std::clamp<int64_t>(end, -1, dim - 1);
      length = begin > end ? 1 + (begin - end - 1) / -step : 0;
    }
    shape[*axis] = length;
    // Only a second element steps (then |step| < dim: no overflow).
    strides[*axis] = length > 1 ? inStrides[*axis] * step : inStrides[*axis];
    if (length > 0)
      base += begin * inStrides[*axis];
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done, stridedCopy(dev, shape, strides, base, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// Concat: one 2-D copy per input (rows = the dimensions before the axis).
Result CudaBackend::concat(const NodeView &n) {
  const Tensor *first = n.in(0);
  if (!first || n.numOutputs() != 1 || first->rank() == 0)
    return std::nullopt;
  const auto *axisAttr = n.attr("axis");
  if (!axisAttr && n.opset >= 4)
    return std::nullopt;
  auto axis = NodeView::axisIn(axisAttr ? axisAttr->i() : 1, first->rank());
  if (!axis)
    return std::nullopt;
  Shape shape = first->shape();
  shape[*axis] = 0;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    const Tensor *t = n.in(i);
    if (!t || t->elemType() != first->elemType() || t->rank() != first->rank())
      return std::nullopt;
    for (int64_t d = 0; d < t->rank(); ++d)
      if (d != *axis && t->dim(d) != first->dim(d))
        return std::nullopt;
    shape[*axis] += t->dim(*axis);
  }
  PIPEC_TRY_ASSIGN(out, allocate(first->elemType(), shape));
  size_t elem = cpu::storageSize(first->elemType());
  int64_t outer = product(ArrayRef<int64_t>(shape).take_front(*axis));
  int64_t inner = product(ArrayRef<int64_t>(shape).drop_front(*axis + 1));
  size_t pitch = static_cast<size_t>(shape[*axis] * inner) * elem;
  size_t offset = 0;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    PIPEC_TRY_ASSIGN(t, onDevice(*n.in(i)));
    size_t width = static_cast<size_t>(t.dim(*axis) * inner) * elem;
    if (width > 0 && outer > 0)
      PIPEC_CUDA_TRY(cudaMemcpy2DAsync(static_cast<char *>(out.rawData()) + offset, pitch,
                                       t.rawData(), width, width, static_cast<size_t>(outer),
                                       cudaMemcpyDeviceToDevice, stream));
    offset += width;
  }
  return Outputs{out};
}

Result CudaBackend::split(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || x->rank() == 0)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), x->rank());
  if (!axis)
    return std::nullopt;
  int64_t dim = x->dim(*axis);
  int64_t parts = static_cast<int64_t>(n.numOutputs());
  PIPEC_TRY_ASSIGN(sizes, intsFromInputOrAttr(n, 1, "split"));
  if (!sizes) {
    if (const auto *numOutputs = n.attr("num_outputs"))
      parts = numOutputs->i();
    if (parts <= 0)
      return std::nullopt;
    int64_t chunk = (dim + parts - 1) / parts;
    if (!n.attr("num_outputs") && dim % parts != 0)
      return std::nullopt;
    sizes.emplace();
    for (int64_t i = 0; i < parts; ++i)
      sizes->push_back(std::max<int64_t>(0, std::min(chunk, dim - i * chunk)));
  }
  if (static_cast<int64_t>(sizes->size()) != parts ||
      std::accumulate(sizes->begin(), sizes->end(), int64_t(0)) != dim ||
      llvm::any_of(*sizes, [](int64_t s) { return s < 0; }))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  size_t elem = cpu::storageSize(x->elemType());
  int64_t outer = product(ArrayRef<int64_t>(x->shape()).take_front(*axis));
  int64_t inner = product(ArrayRef<int64_t>(x->shape()).drop_front(*axis + 1));
  size_t pitch = static_cast<size_t>(dim * inner) * elem;
  Outputs outputs;
  int64_t begin = 0;
  for (int64_t size : *sizes) {
    Shape shape = x->shape();
    shape[*axis] = size;
    PIPEC_TRY_ASSIGN(part, allocate(x->elemType(), shape));
    size_t width = static_cast<size_t>(size * inner) * elem;
    if (width > 0 && outer > 0)
      PIPEC_CUDA_TRY(cudaMemcpy2DAsync(
          part.rawData(), width,
          static_cast<const char *>(dev.rawData()) + static_cast<size_t>(begin * inner) * elem,
          pitch, width, static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream));
    begin += size;
    outputs.push_back(part);
  }
  return outputs;
}

Result CudaBackend::gather(const NodeView &n) {
  const Tensor *data = n.in(0), *indices = n.in(1);
  if (!data || !indices || n.numOutputs() != 1 || data->rank() == 0)
    return std::nullopt;
  ElemType indexType = indices->elemType();
  if (indexType != ElemType::Int64 && indexType != ElemType::Int32)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), data->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> dataShape = data->shape();
  k::GatherParams p;
  p.outer = product(dataShape.take_front(*axis));
  p.size = dataShape[*axis];
  p.inner = product(dataShape.drop_front(*axis + 1));
  p.count = indices->numElements();
  if (p.size == 0 && p.count > 0)
    return std::nullopt; // every index is out of range: the CPU words it
  Shape shape(dataShape.begin(), dataShape.begin() + *axis);
  shape.insert(shape.end(), indices->shape().begin(), indices->shape().end());
  shape.insert(shape.end(), dataShape.begin() + *axis + 1, dataShape.end());
  PIPEC_TRY_ASSIGN(d, onDevice(*data));
  PIPEC_TRY_ASSIGN(idx, onDevice(*indices));
  PIPEC_TRY_ASSIGN(out, allocate(data->elemType(), shape));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchGather(
        elemBytes(out), indexType == ElemType::Int32, p, d.rawData(), idx.rawData(), out.rawData(),
        checkSlot(
            n,
            formatv("an index is out of range for dimension {0} of size {1}", *axis, p.size).str()),
        stream));
  return Outputs{out};
}

Result CudaBackend::where(const NodeView &n) {
  const Tensor *cond = n.in(0), *x = n.in(1), *y = n.in(2);
  if (!cond || !x || !y || n.numOutputs() != 1 || cond->elemType() != ElemType::Bool ||
      x->elemType() != y->elemType())
    return std::nullopt;
  auto partial = cpu::broadcastShapes(cond->shape(), x->shape());
  if (!partial) {
    consumeError(partial.takeError());
    return std::nullopt;
  }
  auto shape = cpu::broadcastShapes(*partial, y->shape());
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  k::IndexMap map;
  if (!k::makeIndexMap(*shape,
                       {k::broadcastStrides(cond->shape(), *shape),
                        k::broadcastStrides(x->shape(), *shape),
                        k::broadcastStrides(y->shape(), *shape)},
                       map))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(c, onDevice(*cond));
  PIPEC_TRY_ASSIGN(a, onDevice(*x));
  PIPEC_TRY_ASSIGN(b, onDevice(*y));
  PIPEC_TRY_ASSIGN(out, allocate(x->elemType(), *shape));
  PIPEC_CUDA_TRY(launchWhere(elemBytes(out), map, static_cast<const bool *>(c.rawData()),
                             a.rawData(), b.rawData(), out.rawData(), out.numElements(), stream));
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Elementwise
//===----------------------------------------------------------------------===//

/// Cast between float, double, int64, int32 and bool. Half types are read
/// as the floats they are stored as; casts to them round and fall back.
Result CudaBackend::cast(const NodeView &n) {
  const Tensor *x = n.in(0);
  const auto *to = n.attr("to");
  if (!x || !to || n.numOutputs() != 1)
    return std::nullopt;
  auto toType = cpu::elemTypeFromOnnx(static_cast<int32_t>(to->i()));
  if (!toType) {
    consumeError(toType.takeError());
    return std::nullopt;
  }
  ElemType fromType = x->elemType();
  if (fromType == ElemType::Float16 || fromType == ElemType::BFloat16)
    fromType = ElemType::Float;
  auto from = scalarOf(fromType), target = scalarOf(*toType);
  if (!from || !target)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(*toType, x->shape()));
  if (*from == *target) {
    if (out.byteSize() > 0)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(out.rawData(), dev.rawData(), out.byteSize(),
                                     cudaMemcpyDeviceToDevice, stream));
  } else {
    PIPEC_CUDA_TRY(
        launchCast(*from, *target, dev.rawData(), out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

/// The element-wise rows of Ops.def: their math (ElementMath.h) by code.
Result CudaBackend::elementwise(const NodeView &n) {
  ElemOp op = *n.def->elem;
  return n.def->minInputs == 1 ? unary(n, op) : binary(n, op);
}

/// Unary float math on float32.
Result CudaBackend::unary(const NodeView &n, ElemOp op) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || n.numOutputs() != 1 || !k::isFloatMath(op))
    return std::nullopt;
  auto params = n.elemParams(op);
  if (!params) {
    // The CPU kernel words the error.
    consumeError(params.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, x->shape()));
  PIPEC_CUDA_TRY(launchUnary(op, *params, static_cast<const float *>(dev.rawData()),
                             static_cast<float *>(out.rawData()), out.numElements(), stream));
  return Outputs{out};
}

/// Arithmetic on float32, and on int64 for ops that never divide;
/// comparisons on any of the device types (bool for Equal), numpy
/// broadcasting. Logical ops run on the host.
Result CudaBackend::binary(const NodeView &n, ElemOp op) {
  const Tensor *a = n.in(0), *b = n.in(1);
  if (!a || !b || n.numOutputs() != 1 || a->elemType() != b->elemType())
    return std::nullopt;
  if (n.opset < 7 && n.attrInt("broadcast", 0))
    return std::nullopt;
  auto type = scalarOf(a->elemType());
  if (!type)
    return std::nullopt;
  bool comparison = k::isComparison(op);
  if (comparison) {
    if (*type == k::Scalar::Bool && k::elemTypes(op) != k::ElemTypes::CompareAny)
      return std::nullopt;
  } else if (!k::isFloatMath(op)) {
    return std::nullopt;
  } else if (*type != k::Scalar::F32 &&
             (*type != k::Scalar::I64 || k::elemTypes(op) == k::ElemTypes::Float ||
              k::elemDivides(op))) {
    return std::nullopt;
  }
  auto shape = cpu::broadcastShapes(a->shape(), b->shape());
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  k::IndexMap map;
  if (!k::makeIndexMap(
          *shape,
          {k::broadcastStrides(a->shape(), *shape), k::broadcastStrides(b->shape(), *shape)}, map))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  PIPEC_TRY_ASSIGN(out, allocate(comparison ? ElemType::Bool : a->elemType(), *shape));
  PIPEC_CUDA_TRY(launchBinary(op, *type, map, da.rawData(), db.rawData(), out.rawData(),
                              out.numElements(), stream));
  return Outputs{out};
}

/// Sum of any number of float inputs, broadcast: added one at a time into
/// the output.
Result CudaBackend::variadicSum(const NodeView &n) {
  if (n.numInputs() == 0 || n.numOutputs() != 1)
    return std::nullopt;
  Shape shape;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    const Tensor *t = n.in(i);
    if (!isFloat(t))
      return std::nullopt;
    auto next = cpu::broadcastShapes(i == 0 ? t->shape() : shape, t->shape());
    if (!next) {
      consumeError(next.takeError());
      return std::nullopt;
    }
    shape = *next;
  }
  if (n.numInputs() == 1)
    return identity(n);
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, shape));
  PIPEC_TRY_ASSIGN(first, onDevice(*n.in(0)));
  for (size_t i = 1; i < n.numInputs(); ++i) {
    // The first addition reads input 0; the later ones read the output
    // itself, each element where it is written.
    const Tensor &left = i == 1 ? first : out;
    k::IndexMap map;
    if (!k::makeIndexMap(shape,
                         {k::broadcastStrides(left.shape(), shape),
                          k::broadcastStrides(n.in(i)->shape(), shape)},
                         map))
      return std::nullopt;
    PIPEC_TRY_ASSIGN(right, onDevice(*n.in(i)));
    PIPEC_CUDA_TRY(launchBinary(ElemOp::Add, k::Scalar::F32, map, left.rawData(), right.rawData(),
                                out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Matrix products
//===----------------------------------------------------------------------===//

/// MatMul with numpy semantics on cuBLAS: one GEMM when a single weight
/// matrix serves the whole batch, else a strided batch (a broadcast batch
/// operand is read with stride 0 or, for partial broadcasts, expanded).
Result CudaBackend::matMul(const NodeView &n) {
  const Tensor *a = n.in(0), *b = n.in(1);
  if (!isFloat(a) || !isFloat(b) || n.numOutputs() != 1 || a->rank() == 0 || b->rank() == 0)
    return std::nullopt;
  Shape aShape = a->shape(), bShape = b->shape();
  if (a->rank() == 1)
    aShape.insert(aShape.begin(), 1);
  if (b->rank() == 1)
    bShape.push_back(1);
  int64_t m = aShape[aShape.size() - 2], k = aShape.back(), nn = bShape.back();
  if (bShape[bShape.size() - 2] != k)
    return std::nullopt;
  Shape aBatch(aShape.begin(), aShape.end() - 2), bBatch(bShape.begin(), bShape.end() - 2);
  auto batch = cpu::broadcastShapes(aBatch, bBatch);
  if (!batch) {
    consumeError(batch.takeError());
    return std::nullopt;
  }
  Shape outShape = *batch, finalShape = *batch;
  outShape.push_back(m);
  outShape.push_back(nn);
  if (a->rank() > 1)
    finalShape.push_back(m);
  if (b->rank() > 1)
    finalShape.push_back(nn);
  int64_t count = product(*batch);
  bool folded = product(bBatch) == 1 && aBatch == *batch;
  if (!fitsInt(folded ? count * m : m) || !fitsInt(nn) || !fitsInt(k) || !fitsInt(count))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, outShape));
  if (out.numElements() == 0)
    return Outputs{out.reshaped(finalShape)};
  if (k == 0) {
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    return Outputs{out.reshaped(finalShape)};
  }
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  float *c = static_cast<float *>(out.rawData());
  if (folded) {
    if (Error err =
            gemm(false, false, count * m, nn, k, 1.0f, static_cast<const float *>(da.rawData()), k,
                 0, static_cast<const float *>(db.rawData()), nn, 0, 0.0f, c, nn, 0, 1))
      return err;
    return Outputs{out.reshaped(finalShape)};
  }
  // Each operand: its own batch (stride of one matrix), one matrix for all
  // (stride 0), or a partial broadcast expanded to the full batch.
  auto operand = [&](const Tensor &t, const Shape &tBatch, int64_t rows,
                     int64_t cols) -> Expected<std::optional<std::pair<Tensor, int64_t>>> {
    Shape padded(batch->size() - tBatch.size(), 1);
    padded.insert(padded.end(), tBatch.begin(), tBatch.end());
    if (padded == *batch)
      return std::optional<std::pair<Tensor, int64_t>>({t, rows * cols});
    if (product(tBatch) == 1)
      return std::optional<std::pair<Tensor, int64_t>>({t, 0});
    Shape full = *batch, own = tBatch;
    full.push_back(rows);
    full.push_back(cols);
    own.push_back(rows);
    own.push_back(cols);
    PIPEC_TRY_ASSIGN(expanded, broadcastTo(t.reshaped(own), full));
    if (!expanded)
      return std::optional<std::pair<Tensor, int64_t>>();
    return std::optional<std::pair<Tensor, int64_t>>({*expanded, rows * cols});
  };
  PIPEC_TRY_ASSIGN(left, operand(da, aBatch, m, k));
  PIPEC_TRY_ASSIGN(right, operand(db, bBatch, k, nn));
  if (!left || !right)
    return std::nullopt;
  if (Error err =
          gemm(false, false, m, nn, k, 1.0f, static_cast<const float *>(left->first.rawData()), k,
               left->second, static_cast<const float *>(right->first.rawData()), nn, right->second,
               0.0f, c, nn, m * nn, count))
    return err;
  return Outputs{out.reshaped(finalShape)};
}

/// Gemm: Y = alpha op(A) op(B) + beta C, C broadcast into Y first.
Result CudaBackend::gemmOp(const NodeView &n) {
  const Tensor *a = n.in(0), *b = n.in(1), *c = n.in(2);
  if (!isFloat(a) || !isFloat(b) || n.numOutputs() != 1 || a->rank() != 2 || b->rank() != 2)
    return std::nullopt;
  bool transA = n.attrInt("transA", 0), transB = n.attrInt("transB", 0);
  int64_t m = transA ? a->dim(1) : a->dim(0), k = transA ? a->dim(0) : a->dim(1);
  int64_t kb = transB ? b->dim(1) : b->dim(0), nn = transB ? b->dim(0) : b->dim(1);
  if (k != kb || k == 0 || !fitsInt(m) || !fitsInt(nn) || !fitsInt(k))
    return std::nullopt;
  Shape outShape{m, nn};
  if (c) {
    if (!isFloat(c))
      return std::nullopt;
    auto shape = cpu::broadcastShapes(c->shape(), outShape);
    if (!shape || *shape != outShape) {
      consumeError(shape.takeError());
      return std::nullopt;
    }
  }
  float alpha = n.attrFloat("alpha", 1.0f), beta = c ? n.attrFloat("beta", 1.0f) : 0.0f;
  Tensor y;
  if (c) {
    PIPEC_TRY_ASSIGN(dc, onDevice(*c));
    PIPEC_TRY_ASSIGN(done,
                     stridedCopy(dc, outShape, k::broadcastStrides(dc.shape(), outShape), 0, y));
    if (!done)
      return std::nullopt;
  } else {
    PIPEC_TRY_ASSIGN(fresh, allocate(ElemType::Float, outShape));
    y = fresh;
  }
  if (y.numElements() == 0)
    return Outputs{y};
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  if (Error err = gemm(transA, transB, m, nn, k, alpha, static_cast<const float *>(da.rawData()),
                       a->dim(1), 0, static_cast<const float *>(db.rawData()), b->dim(1), 0, beta,
                       static_cast<float *>(y.rawData()), nn, 0, 1))
    return err;
  return Outputs{y};
}

//===----------------------------------------------------------------------===//
// Rows: softmax and layer normalization
//===----------------------------------------------------------------------===//

/// Softmax and LogSoftmax: along one axis from opset 13, over the flattened
/// trailing dimensions before.
Result CudaBackend::softmax(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || n.numOutputs() != 1 || x->rank() == 0)
    return std::nullopt;
  bool singleAxis = n.opset >= 13;
  auto axis = NodeView::axisIn(n.attrInt("axis", singleAxis ? -1 : 1), x->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> shape = x->shape();
  k::RowLayout layout{product(shape.take_front(*axis)), shape[*axis],
                      product(shape.drop_front(*axis + 1))};
  if (!singleAxis)
    layout = {layout.outer, layout.size * layout.inner, 1};
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, x->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchSoftmax(layout, static_cast<const float *>(dev.rawData()),
                                 static_cast<float *>(out.rawData()), n.op() == "LogSoftmax",
                                 stream));
  return Outputs{out};
}

/// LayerNormalization (stash_type float): Y, and Mean and InvStdDev when
/// the node has those outputs.
Result CudaBackend::layerNorm(const NodeView &n) {
  const Tensor *x = n.in(0), *scale = n.in(1), *bias = n.in(2);
  if (!isFloat(x) || !isFloat(scale) || (bias && !isFloat(bias)) || n.numOutputs() > 3)
    return std::nullopt;
  if (n.attrInt("stash_type", 1) != 1)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), x->rank());
  if (!axis)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  Shape normShape(x->shape().begin() + *axis, x->shape().end());
  int64_t rows = product(ArrayRef<int64_t>(x->shape()).take_front(*axis));
  int64_t size = product(normShape);
  // Scale and bias broadcast to the normalized shape.
  std::optional<Tensor> gamma, beta;
  for (const Tensor *t : {scale, bias}) {
    if (!t)
      continue;
    auto shape = cpu::broadcastShapes(t->shape(), normShape);
    if (!shape || *shape != normShape) {
      consumeError(shape.takeError());
      return std::nullopt;
    }
    PIPEC_TRY_ASSIGN(dev, onDevice(*t));
    PIPEC_TRY_ASSIGN(
        full,
        broadcastTo(dev.reshaped(t->numElements() == size ? normShape : t->shape()), normShape));
    if (!full)
      return std::nullopt;
    (t == scale ? gamma : beta) = *full;
  }
  PIPEC_TRY_ASSIGN(dx, onDevice(*x));
  PIPEC_TRY_ASSIGN(y, allocate(ElemType::Float, x->shape()));
  Shape statShape = x->shape();
  std::fill(statShape.begin() + *axis, statShape.end(), 1);
  Outputs outputs{y};
  for (size_t i = 1; i < n.numOutputs(); ++i) {
    PIPEC_TRY_ASSIGN(stat, allocate(ElemType::Float, statShape));
    outputs.push_back(stat);
  }
  auto statData = [&](size_t i) {
    return i < outputs.size() ? static_cast<float *>(outputs[i].rawData()) : nullptr;
  };
  if (rows > 0 && size > 0)
    PIPEC_CUDA_TRY(launchLayerNorm(rows, size, epsilon, static_cast<const float *>(dx.rawData()),
                                   static_cast<const float *>(gamma->rawData()),
                                   beta ? static_cast<const float *>(beta->rawData()) : nullptr,
                                   static_cast<float *>(y.rawData()), statData(1), statData(2),
                                   stream));
  return outputs;
}

//===----------------------------------------------------------------------===//
// Reductions and losses
//===----------------------------------------------------------------------===//

/// ReduceSum and ReduceMean on floats: axes from the input or attribute,
/// none meaning all (or nothing, with noop_with_empty_axes).
Result CudaBackend::reduce(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
  bool keepDims = n.attrInt("keepdims", 1);
  int64_t rank = x->rank();
  if (!axes || axes->empty()) {
    if (n.attrInt("noop_with_empty_axes", 0))
      return identity(n);
    axes.emplace(rank);
    std::iota(axes->begin(), axes->end(), 0);
  }
  std::vector<bool> reduced(rank, false);
  for (int64_t a : *axes) {
    auto axis = NodeView::axisIn(a, rank);
    if (!axis)
      return std::nullopt;
    reduced[*axis] = true;
  }
  Shape outShape;
  int64_t count = 1;
  for (int64_t i = 0; i < rank; ++i) {
    if (reduced[i])
      count *= x->dim(i);
    if (!reduced[i])
      outShape.push_back(x->dim(i));
    else if (keepDims)
      outShape.push_back(1);
  }
  double scale = 1;
  if (n.op() == "ReduceMean")
    scale = count ? 1.0 / static_cast<double>(count) : std::nan("");
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, outShape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, scale, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// The labels of a cross-entropy over \p scores [N, C, d...]: int64 of
/// [N, d...] (exact shape or, for the gradient, element count).
bool labelsFit(const Tensor &scores, const Tensor &labels, bool exactShape) {
  if (labels.elemType() != ElemType::Int64)
    return false;
  Shape shape{scores.dim(0)};
  shape.insert(shape.end(), scores.shape().begin() + 2, scores.shape().end());
  return exactShape ? labels.shape() == shape : labels.numElements() == product(shape);
}

Result CudaBackend::crossEntropy(const NodeView &n) {
  const Tensor *scores = n.in(0), *labels = n.in(1);
  if (!isFloat(scores) || !labels || n.in(2) || n.numOutputs() > 2 || scores->rank() < 2 ||
      !labelsFit(*scores, *labels, true))
    return std::nullopt;
  std::string reductionName = n.attrString("reduction", "mean");
  k::CrossEntropyParams p;
  if (reductionName == "none")
    p.reduction = 0;
  else if (reductionName == "sum")
    p.reduction = 1;
  else if (reductionName == "mean")
    p.reduction = 2;
  else
    return std::nullopt;
  if (const auto *ignore = n.attr("ignore_index")) {
    p.hasIgnore = true;
    p.ignoreIndex = ignore->i();
  }
  ArrayRef<int64_t> shape = scores->shape();
  k::RowLayout layout{shape[0], shape[1], product(shape.drop_front(2))};
  int64_t positions = k::rowCount(layout);
  if (positions > 0 && layout.size == 0)
    return std::nullopt; // every label is out of range: the CPU words it
  PIPEC_TRY_ASSIGN(s, onDevice(*scores));
  PIPEC_TRY_ASSIGN(l, onDevice(*labels));
  PIPEC_TRY_ASSIGN(losses, allocate(ElemType::Float, labels->shape()));
  PIPEC_TRY_ASSIGN(valid, scratch(static_cast<size_t>(positions) * sizeof(float)));
  Tensor loss = losses;
  if (p.reduction != 0) {
    PIPEC_TRY_ASSIGN(scalar, allocate(ElemType::Float, {}));
    loss = scalar;
  }
  Outputs outputs{loss};
  float *logProb = nullptr;
  if (n.numOutputs() == 2) {
    PIPEC_TRY_ASSIGN(lp, allocate(ElemType::Float, scores->shape()));
    outputs.push_back(lp);
    logProb = static_cast<float *>(lp.rawData());
  }
  if (positions == 0) {
    // No labels: the sum is 0 and the mean 0 / 0.
    if (p.reduction != 0)
      PIPEC_CUDA_TRY(launchFill(4, p.reduction == 2 ? 0x7fc00000u : 0u, loss.rawData(), 1, stream));
    return outputs;
  }
  PIPEC_CUDA_TRY(launchCrossEntropy(
      layout, p, static_cast<const float *>(s.rawData()), static_cast<const int64_t *>(l.rawData()),
      logProb, static_cast<float *>(losses.rawData()), static_cast<float *>(valid.get()),
      static_cast<float *>(loss.rawData()),
      checkSlot(n, formatv("a label is out of range for {0} classes", layout.size).str()), stream));
  return outputs;
}

//===----------------------------------------------------------------------===//
// Gradient ops of domain pipec
//===----------------------------------------------------------------------===//

Result CudaBackend::sumTo(const NodeView &n) {
  const Tensor *dy = n.in(0);
  std::optional<Shape> shape = n.attrInts("shape");
  if (!isFloat(dy) || !shape || n.numOutputs() != 1 ||
      shape->size() > static_cast<size_t>(dy->rank()))
    return std::nullopt;
  auto b = cpu::broadcastShapes(*shape, dy->shape());
  if (!b || *b != dy->shape()) {
    consumeError(b.takeError());
    return std::nullopt;
  }
  if (*shape == dy->shape())
    return identity(n);
  size_t lead = dy->shape().size() - shape->size();
  std::vector<bool> reduced(dy->rank());
  for (int64_t d = 0; d < dy->rank(); ++d) {
    int64_t target = static_cast<size_t>(d) < lead ? 1 : (*shape)[d - lead];
    reduced[d] = target == 1 && dy->dim(d) != 1;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*dy));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, *shape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, 1.0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// UnaryGrad: dY times the derivative of the op it names (ElementMath.h).
Result CudaBackend::unaryGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *a = n.in(1);
  if (!isFloat(dy) || !isFloat(a) || dy->shape() != a->shape() || n.numOutputs() != 1)
    return std::nullopt;
  // ReluGrad and the other earlier spellings name the op without "Grad".
  std::string name = n.op() == "UnaryGrad" ? n.attrString("op", "") : n.op().drop_back(4).str();
  const OpDef *forward = lookupOp("", name);
  if (!forward || !forward->elem || forward->minInputs != 1)
    return std::nullopt;
  auto params = n.elemParams(*forward->elem);
  if (!params) {
    consumeError(params.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(x, onDevice(*a));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, dy->shape()));
  PIPEC_CUDA_TRY(launchGradient(*forward->elem, *params, static_cast<const float *>(d.rawData()),
                                static_cast<const float *>(x.rawData()),
                                static_cast<float *>(out.rawData()), out.numElements(), stream));
  return Outputs{out};
}

/// The body of a fused node (runtime/core/FusedProgram.h) node by node on this
/// backend: for inputs its kernel does not take.
Result CudaBackend::runBody(const NodeView &n) {
  auto outputs = runFusedBody(n.node, n.allInputs(),
                              [&](const onnx::NodeProto &step, ArrayRef<const Tensor *> in) {
                                return dispatch(NodeView(step, n.opset, in, device));
                              });
  if (!outputs)
    return outputs.takeError();
  return std::move(*outputs);
}

/// A fused element-wise node (runtime/core/FusedProgram.h) as one kernel; its body
/// node by node on this backend when the kernel does not take the inputs
/// (not all float32, or an output smaller than the others).
Result CudaBackend::fused(const NodeView &n) {
  auto kernel = compileFused(n.node, n.opset);
  if (!kernel)
    return kernel.takeError();
  ArrayRef<const Tensor *> inputs = n.allInputs();
  std::optional<Shape> shape = fusedShape(*kernel, inputs);
  k::FusedMap map;
  if (!shape || !makeFusedMap(*shape, inputs, map))
    return runBody(n);
  const k::FusedProgram &p = kernel->program;
  std::vector<Tensor> devices;
  const float *in[k::MaxFusedInputs] = {};
  for (int i = 0; i < p.inputs; ++i) {
    PIPEC_TRY_ASSIGN(d, onDevice(*inputs[i]));
    devices.push_back(d);
    in[i] = static_cast<const float *>(devices.back().rawData());
  }
  Outputs outputs;
  float *out[k::MaxFusedOutputs] = {};
  for (int o = 0; o < p.outputs; ++o) {
    PIPEC_TRY_ASSIGN(t, allocate(ElemType::Float, *shape));
    outputs.push_back(t);
    out[o] = static_cast<float *>(outputs.back().rawData());
  }
  int64_t count = product(*shape);
  if (count > 0)
    PIPEC_CUDA_TRY(launchFused(p, map, in, out, count, stream));
  return outputs;
}

/// A MatMul and its bias Add (runtime/core/FusedProgram.h) as one cuBLASLt GEMM with
/// a bias epilogue; the two nodes as they are for other shapes or types,
/// or when cuBLASLt has no algorithm.
Result CudaBackend::matMulBias(const NodeView &n) {
  ArrayRef<const Tensor *> inputs = n.allInputs();
  std::optional<int64_t> nn = epilogueBias(n.node, inputs);
  if (!nn)
    return runBody(n);
  const Tensor &a = *inputs[0];
  int64_t k = a.dim(-1), m = a.numElements() / std::max<int64_t>(k, 1);
  if (m == 0 || k == 0 || *nn == 0 || !fitsInt(m) || !fitsInt(k) || !fitsInt(*nn))
    return runBody(n);
  Shape shape = a.shape();
  shape.back() = *nn;
  PIPEC_TRY_ASSIGN(da, onDevice(a));
  PIPEC_TRY_ASSIGN(db, onDevice(*inputs[1]));
  PIPEC_TRY_ASSIGN(dbias, onDevice(*inputs[2]));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, shape));
  PIPEC_TRY_ASSIGN(done, gemmBias(m, *nn, k, static_cast<const float *>(da.rawData()),
                                  static_cast<const float *>(db.rawData()),
                                  static_cast<const float *>(dbias.rawData()),
                                  static_cast<float *>(out.rawData())));
  if (!done)
    return runBody(n);
  return Outputs{out};
}

Result CudaBackend::softmaxGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *y = n.in(1);
  if (!isFloat(dy) || !isFloat(y) || dy->shape() != y->shape() || n.numOutputs() != 1 ||
      y->rank() == 0)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), y->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> shape = y->shape();
  k::RowLayout layout{product(shape.take_front(*axis)), shape[*axis],
                      product(shape.drop_front(*axis + 1))};
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(yy, onDevice(*y));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, y->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchSoftmaxGrad(layout, static_cast<const float *>(d.rawData()),
                                     static_cast<const float *>(yy.rawData()),
                                     static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::gatherGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *indices = n.in(1);
  std::optional<Shape> shape = n.attrInts("shape");
  if (!isFloat(dy) || !indices || !shape || shape->empty() || n.numOutputs() != 1)
    return std::nullopt;
  ElemType indexType = indices->elemType();
  if (indexType != ElemType::Int64 && indexType != ElemType::Int32)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), static_cast<int64_t>(shape->size()));
  if (!axis || llvm::any_of(*shape, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  k::GatherParams p;
  p.outer = product(ArrayRef<int64_t>(*shape).take_front(*axis));
  p.size = (*shape)[*axis];
  p.inner = product(ArrayRef<int64_t>(*shape).drop_front(*axis + 1));
  p.count = indices->numElements();
  if (dy->numElements() != p.outer * p.count * p.inner || (p.size == 0 && p.count > 0))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(idx, onDevice(*indices));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, *shape));
  if (out.byteSize() > 0)
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
  if (dy->numElements() > 0)
    PIPEC_CUDA_TRY(launchGatherGrad(
        indexType == ElemType::Int32, p, static_cast<const float *>(d.rawData()), idx.rawData(),
        static_cast<float *>(out.rawData()),
        checkSlot(n, formatv("an index is out of range [0, {0})", p.size).str()), stream));
  return Outputs{out};
}

/// The rows of a LayerNorm gradient: [rows, width] split at the axis.
std::optional<std::pair<int64_t, int64_t>> layerNormRows(const NodeView &n, const Tensor &x) {
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), x.rank());
  if (!axis)
    return std::nullopt;
  return std::make_pair(product(ArrayRef<int64_t>(x.shape()).take_front(*axis)),
                        product(ArrayRef<int64_t>(x.shape()).drop_front(*axis)));
}

Result CudaBackend::layerNormGradInput(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1), *scale = n.in(2);
  if (!isFloat(dy) || !isFloat(x) || !isFloat(scale) || dy->shape() != x->shape() ||
      n.numOutputs() != 1)
    return std::nullopt;
  auto rows = layerNormRows(n, *x);
  if (!rows || scale->numElements() != rows->second)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xx, onDevice(*x));
  PIPEC_TRY_ASSIGN(s, onDevice(*scale));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, x->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchLayerNormGradInput(
        rows->first, rows->second, epsilon, static_cast<const float *>(d.rawData()),
        static_cast<const float *>(xx.rawData()), static_cast<const float *>(s.rawData()),
        static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::layerNormGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1);
  if (!isFloat(dy) || !isFloat(x) || dy->shape() != x->shape() || n.numOutputs() != 1)
    return std::nullopt;
  auto rows = layerNormRows(n, *x);
  if (!rows)
    return std::nullopt;
  auto [count, width] = *rows;
  Shape shape = n.attrInts("shape").value_or(Shape{width});
  if (product(shape) != width)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xx, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, shape));
  if (width == 0)
    return Outputs{out};
  if (count == 0) {
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    return Outputs{out};
  }
  int64_t chunks = layerNormGradWeightChunks(count, width);
  PIPEC_TRY_ASSIGN(stats, scratch(2 * static_cast<size_t>(count) * sizeof(float)));
  PIPEC_TRY_ASSIGN(partial, scratch(static_cast<size_t>(width * chunks) * sizeof(double)));
  float *mean = static_cast<float *>(stats.get());
  PIPEC_CUDA_TRY(launchLayerNormGradWeight(
      count, width, epsilon, static_cast<const float *>(d.rawData()),
      static_cast<const float *>(xx.rawData()), mean, mean + count,
      static_cast<double *>(partial.get()), chunks, static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::crossEntropyGrad(const NodeView &n) {
  const Tensor *dLoss = n.in(0), *scores = n.in(1), *labels = n.in(2);
  if (!isFloat(dLoss) || !isFloat(scores) || !labels || dLoss->numElements() != 1 ||
      scores->rank() < 2 || !labelsFit(*scores, *labels, false) || n.numOutputs() != 1)
    return std::nullopt;
  k::CrossEntropyParams p;
  p.reduction = n.attrString("reduction", "mean") == "sum" ? 1 : 2;
  if (const auto *ignore = n.attr("ignore_index")) {
    p.hasIgnore = true;
    p.ignoreIndex = ignore->i();
  }
  ArrayRef<int64_t> shape = scores->shape();
  k::RowLayout layout{shape[0], shape[1], product(shape.drop_front(2))};
  PIPEC_TRY_ASSIGN(dl, onDevice(*dLoss));
  PIPEC_TRY_ASSIGN(s, onDevice(*scores));
  PIPEC_TRY_ASSIGN(l, onDevice(*labels));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, scores->shape()));
  if (out.numElements() == 0)
    return Outputs{out};
  PIPEC_TRY_ASSIGN(count, scratch(sizeof(double)));
  PIPEC_CUDA_TRY(launchCrossEntropyGrad(
      layout, p, static_cast<const float *>(dl.rawData()), static_cast<const float *>(s.rawData()),
      static_cast<const int64_t *>(l.rawData()), static_cast<double *>(count.get()),
      static_cast<float *>(out.rawData()),
      checkSlot(n, formatv("a label is out of range [0, {0})", layout.size).str()), stream));
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Convolution, pooling and batch normalization
//===----------------------------------------------------------------------===//

/// Im2col columns of one batch chunk stay under this size (one image's at
/// least).
constexpr int64_t ConvColumnBytes = int64_t(256) << 20;

Shape spatialOf(ArrayRef<int64_t> shape) { return Shape(shape.begin() + 2, shape.end()); }

/// \p shape's first two dimensions, then the window's output sizes.
Shape windowOutShape(int64_t batch, int64_t channels, const k::ConvWindow &w, size_t rank) {
  Shape shape{batch, channels};
  for (size_t i = 0; i < rank; ++i)
    shape.push_back(w.out[3 - rank + i]);
  return shape;
}

/// The strides, dilations and pads of a window op over \p rank spatial
/// dimensions, defaults as the CPU kernels'. For a forward op auto_pad VALID
/// zeroes the pads; SAME_UPPER and SAME_LOWER give nullopt (the CPU kernels
/// compute them). Gradients have explicit pads.
struct WindowAttrs {
  Shape strides, dilations, pads;
};

std::optional<WindowAttrs> windowAttrs(const NodeView &n, size_t rank, bool forward) {
  WindowAttrs a{n.attrInts("strides").value_or(Shape(rank, 1)),
                n.attrInts("dilations").value_or(Shape(rank, 1)),
                n.attrInts("pads").value_or(Shape(2 * rank, 0))};
  if (forward) {
    std::string autoPad = n.attrString("auto_pad", "NOTSET");
    if (autoPad == "VALID" && a.pads.size() == 2 * rank)
      a.pads.assign(2 * rank, 0);
    else if (autoPad != "NOTSET")
      return std::nullopt;
  }
  return a;
}

/// Images per im2col chunk for images of \p imageFloats column floats.
int64_t convChunk(int64_t imageFloats, int64_t batch) {
  int64_t fit = ConvColumnBytes / std::max<int64_t>(imageFloats * int64_t(sizeof(float)), 1);
  return std::clamp<int64_t>(fit, 1, std::max<int64_t>(batch, 1));
}

/// Conv's operands: X [N, C, in...], W [M, C / group, kernel...] and its
/// window, as the forward op and both gradients see them.
struct ConvGeometry {
  int64_t batch, channels, maps, group;
  k::ConvWindow w;
  int64_t gc() const { return channels / group; }
  int64_t gm() const { return maps / group; }
  int64_t rows() const { return gc() * w.kernelSize(); }
  int64_t cols() const { return w.outSize(); }
};

/// The geometry of a 1-D to 3-D Conv of X \p x and W \p weight; with
/// \p out (dY's shape, for a gradient) the output sizes are given. Nullopt
/// for what the device does not handle or a malformed node (nonempty
/// tensors only).
std::optional<ConvGeometry> convGeometry(const NodeView &n, ArrayRef<int64_t> x,
                                         ArrayRef<int64_t> weight, const Shape *out) {
  if (x.size() < 3 || x.size() > 5 || weight.size() != x.size() || product(x) == 0 ||
      product(weight) == 0)
    return std::nullopt;
  ConvGeometry g{x[0], x[1], weight[0], n.attrInt("group", 1), {}};
  if (g.group < 1 || g.channels % g.group != 0 || g.maps % g.group != 0 ||
      weight[1] != g.channels / g.group)
    return std::nullopt;
  Shape kernel = spatialOf(weight);
  if (auto given = n.attrInts("kernel_shape"); given && *given != kernel)
    return std::nullopt;
  size_t rank = kernel.size();
  auto attrs = windowAttrs(n, rank, !out);
  if (!attrs)
    return std::nullopt;
  if (out) {
    if (out->size() != x.size() || (*out)[0] != g.batch || (*out)[1] != g.maps ||
        !k::makeGradWindow(spatialOf(x), kernel, attrs->strides, attrs->dilations, attrs->pads,
                           spatialOf(*out), g.w))
      return std::nullopt;
  } else if (!k::makeConvWindow(spatialOf(x), kernel, attrs->strides, attrs->dilations, attrs->pads,
                                false, g.w)) {
    return std::nullopt;
  }
  if (g.w.outSize() == 0 || !fitsInt(g.rows()) || !fitsInt(g.cols()) || !fitsInt(g.gm()) ||
      !fitsInt(g.w.inSize()))
    return std::nullopt;
  return g;
}

Result CudaBackend::conv(const NodeView &n) {
  const Tensor *x = n.in(0), *weight = n.in(1), *bias = n.in(2);
  if (!isFloat(x) || !isFloat(weight) || (n.in(2) && !isFloat(bias)) || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, x->shape(), weight->shape(), nullptr);
  if (!geometry || (bias && (bias->rank() != 1 || bias->dim(0) != geometry->maps)))
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize();
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(wd, onDevice(*weight));
  PIPEC_TRY_ASSIGN(y,
                   allocate(ElemType::Float, windowOutShape(g.batch, g.maps, g.w, x->rank() - 2)));
  const float *image = static_cast<const float *>(xd.rawData());
  const float *w = static_cast<const float *>(wd.rawData());
  float *out = static_cast<float *>(y.rawData());
  bool identity = g.w.isIdentity();
  int64_t chunk = identity ? g.batch : convChunk(g.group * rows * cols, g.batch);
  std::shared_ptr<void> columnBlock;
  if (!identity) {
    PIPEC_TRY_ASSIGN(block,
                     scratch(static_cast<size_t>(chunk * g.group * rows * cols) * sizeof(float)));
    columnBlock = block;
  }
  float *columns = static_cast<float *>(columnBlock.get());
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    int64_t count = std::min(chunk, g.batch - n0);
    const float *source = image + n0 * g.channels * inSize;
    int64_t sourceN = g.channels * inSize, sourceG = g.gc() * inSize;
    if (!identity) {
      k::Im2colParams p;
      p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
      PIPEC_CUDA_TRY(launchIm2col(p, source, columns, stream));
      source = columns, sourceN = g.group * rows * cols, sourceG = rows * cols;
    }
    // Y_(n, g) = W_g [gm, rows] x columns_(n, g) [rows, cols].
    if (Error err = gemmGrid(false, false, g.gm(), cols, rows, w, rows, 0, g.gm() * rows, source,
                             cols, sourceN, sourceG, 0.0f, out + n0 * g.maps * cols, cols,
                             g.maps * cols, g.gm() * cols, count, g.group))
      return err;
  }
  if (bias) {
    PIPEC_TRY_ASSIGN(b, onDevice(*bias));
    PIPEC_CUDA_TRY(launchBias(y.numElements(), g.maps, cols,
                              static_cast<const float *>(b.rawData()), out, stream));
  }
  return Outputs{y};
}

Result CudaBackend::convGradInput(const NodeView &n) {
  const Tensor *dy = n.in(0), *weight = n.in(1);
  auto xShape = n.attrInts("shape");
  if (!isFloat(dy) || !isFloat(weight) || !xShape || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, *xShape, weight->shape(), &dy->shape());
  if (!geometry)
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize();
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(wd, onDevice(*weight));
  PIPEC_TRY_ASSIGN(dx, allocate(ElemType::Float, *xShape));
  const float *grad = static_cast<const float *>(dyd.rawData());
  const float *w = static_cast<const float *>(wd.rawData());
  float *image = static_cast<float *>(dx.rawData());
  bool identity = g.w.isIdentity();
  int64_t chunk = identity ? g.batch : convChunk(g.group * rows * cols, g.batch);
  std::shared_ptr<void> columnBlock;
  if (!identity) {
    PIPEC_TRY_ASSIGN(block,
                     scratch(static_cast<size_t>(chunk * g.group * rows * cols) * sizeof(float)));
    columnBlock = block;
  }
  float *columns = static_cast<float *>(columnBlock.get());
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    int64_t count = std::min(chunk, g.batch - n0);
    float *target = image + n0 * g.channels * inSize;
    int64_t targetN = g.channels * inSize, targetG = g.gc() * inSize;
    if (!identity)
      target = columns, targetN = g.group * rows * cols, targetG = rows * cols;
    // columns_(n, g) = W_g^T [rows, gm] x dY_(n, g) [gm, cols].
    if (Error err = gemmGrid(true, false, rows, cols, g.gm(), w, rows, 0, g.gm() * rows,
                             grad + n0 * g.maps * cols, cols, g.maps * cols, g.gm() * cols, 0.0f,
                             target, cols, targetN, targetG, count, g.group))
      return err;
    if (!identity) {
      k::Im2colParams p;
      p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
      PIPEC_CUDA_TRY(launchCol2im(p, columns, image + n0 * g.channels * inSize, stream));
    }
  }
  return Outputs{dx};
}

Result CudaBackend::convGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1);
  auto wShape = n.attrInts("shape");
  if (!isFloat(dy) || !isFloat(x) || !wShape || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, x->shape(), *wShape, &dy->shape());
  if (!geometry)
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize(), gm = g.gm();
  // One GEMM per group sums a chunk's images: K = count * cols.
  int64_t chunk = std::min(convChunk(g.group * rows * cols, g.batch), INT_MAX / cols);
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(dw, allocate(ElemType::Float, *wShape));
  PIPEC_TRY_ASSIGN(columnBlock,
                   scratch(static_cast<size_t>(chunk * g.group * rows * cols) * sizeof(float)));
  PIPEC_TRY_ASSIGN(gradBlock, scratch(static_cast<size_t>(chunk * g.maps * cols) * sizeof(float)));
  const float *grad = static_cast<const float *>(dyd.rawData());
  const float *image = static_cast<const float *>(xd.rawData());
  float *columns = static_cast<float *>(columnBlock.get());
  float *gradT = static_cast<float *>(gradBlock.get());
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    int64_t count = std::min(chunk, g.batch - n0);
    // dY of the chunk as [group, gm, count, cols].
    k::IndexMap map;
    if (!k::makeIndexMap({g.group, gm, count, cols}, {{gm * cols, cols, g.maps * cols, 1}}, map,
                         {n0 * g.maps * cols}))
      return std::nullopt;
    PIPEC_CUDA_TRY(launchCopy(4, map, grad, gradT, count * g.maps * cols, stream));
    k::Im2colParams p;
    p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
    p.batchInner = true;
    PIPEC_CUDA_TRY(launchIm2col(p, image + n0 * g.channels * inSize, columns, stream));
    // dW_g += dY_g [gm, count * cols] x columns_g^T [count * cols, rows].
    int64_t depth = count * cols;
    if (Error err = gemm(false, true, gm, rows, depth, 1.0f, gradT, depth, gm * depth, columns,
                         depth, rows * depth, n0 == 0 ? 0.0f : 1.0f,
                         static_cast<float *>(dw.rawData()), rows, gm * rows, g.group))
      return err;
  }
  return Outputs{dw};
}

Result CudaBackend::windowPool(const NodeView &n) {
  const Tensor *x = n.in(0);
  auto kernel = n.attrInts("kernel_shape");
  if (!isFloat(x) || !kernel || x->rank() < 3 || x->rank() > 5 || n.wantsOutput(1) ||
      x->numElements() == 0)
    return std::nullopt;
  auto attrs = windowAttrs(n, kernel->size(), true);
  k::PoolParams p;
  if (!attrs || !k::makeConvWindow(spatialOf(x->shape()), *kernel, attrs->strides, attrs->dilations,
                                   attrs->pads, n.attrInt("ceil_mode", 0), p.w))
    return std::nullopt;
  p.isMax = n.op() == "MaxPool";
  p.includePad = n.attrInt("count_include_pad", 0);
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(
      y, allocate(ElemType::Float, windowOutShape(x->dim(0), x->dim(1), p.w, x->rank() - 2)));
  PIPEC_CUDA_TRY(launchPool(p, x->dim(0) * x->dim(1), static_cast<const float *>(xd.rawData()),
                            static_cast<float *>(y.rawData()), stream));
  return Outputs{y};
}

/// MaxPoolGrad (dY, X) and AveragePoolGrad (dY; X's shape as attribute).
Result CudaBackend::poolGrad(const NodeView &n) {
  bool isMax = n.op() == "MaxPoolGrad";
  const Tensor *dy = n.in(0), *x = isMax ? n.in(1) : nullptr;
  auto kernel = n.attrInts("kernel_shape");
  std::optional<Shape> xShape = isMax && isFloat(x) ? x->shape() : n.attrInts("shape");
  if (!isFloat(dy) || (isMax && !isFloat(x)) || !kernel || !xShape || n.numOutputs() != 1 ||
      dy->rank() < 3 || dy->rank() > 5 || xShape->size() != size_t(dy->rank()) ||
      (*xShape)[0] != dy->dim(0) || (*xShape)[1] != dy->dim(1) || product(*xShape) == 0 ||
      dy->numElements() == 0)
    return std::nullopt;
  auto attrs = windowAttrs(n, kernel->size(), false);
  k::PoolParams p;
  if (!attrs || !k::makeGradWindow(spatialOf(*xShape), *kernel, attrs->strides, attrs->dilations,
                                   attrs->pads, spatialOf(dy->shape()), p.w))
    return std::nullopt;
  p.isMax = isMax;
  p.includePad = n.attrInt("count_include_pad", 0);
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  Tensor xd;
  if (isMax) {
    PIPEC_TRY_ASSIGN(dev, onDevice(*x));
    xd = dev;
  }
  PIPEC_TRY_ASSIGN(dx, allocate(ElemType::Float, *xShape));
  PIPEC_CUDA_TRY(launchPoolGrad(p, dy->dim(0) * dy->dim(1),
                                static_cast<const float *>(dyd.rawData()),
                                isMax ? static_cast<const float *>(xd.rawData()) : nullptr,
                                static_cast<float *>(dx.rawData()), stream));
  return Outputs{dx};
}

Result CudaBackend::globalAveragePool(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || x->rank() < 3 || n.numOutputs() != 1)
    return std::nullopt;
  int64_t size = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  if (size == 0)
    return std::nullopt;
  Shape outShape = x->shape();
  std::fill(outShape.begin() + 2, outShape.end(), 1);
  std::vector<bool> reduced(x->rank(), true);
  reduced[0] = reduced[1] = false;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, outShape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, 1.0 / static_cast<double>(size), out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// BatchNormalization in inference mode.
Result CudaBackend::batchNorm(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || x->rank() < 2 || n.numOutputs() < 1)
    return std::nullopt;
  if ((n.opset < 9 && n.attrInt("spatial", 1) == 0) ||
      (n.opset >= 14 && n.attrInt("training_mode", 0)))
    return std::nullopt;
  for (size_t i = 1; i <= 4; ++i)
    if (n.wantsOutput(i))
      return std::nullopt;
  int64_t channels = x->dim(1);
  std::vector<Tensor> params;
  for (size_t i = 1; i <= 4; ++i) {
    const Tensor *t = n.in(i);
    if (!isFloat(t) || t->rank() != 1 || t->dim(0) != channels)
      return std::nullopt;
    PIPEC_TRY_ASSIGN(dev, onDevice(*t));
    params.push_back(dev);
  }
  int64_t spatial = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  double epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(y, allocate(ElemType::Float, x->shape()));
  auto param = [&](size_t i) { return static_cast<const float *>(params[i].rawData()); };
  PIPEC_CUDA_TRY(launchBatchNorm(x->dim(0), channels, spatial, epsilon,
                                 static_cast<const float *>(xd.rawData()), param(0), param(1),
                                 param(2), param(3), static_cast<float *>(y.rawData()), stream));
  return Outputs{y};
}

Result CudaBackend::batchNormGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1), *mean = n.in(2), *var = n.in(3);
  if (!isFloat(dy) || !isFloat(x) || !isFloat(mean) || !isFloat(var) || dy->shape() != x->shape() ||
      x->rank() < 2 || n.numOutputs() != 1)
    return std::nullopt;
  int64_t channels = x->dim(1);
  for (const Tensor *t : {mean, var})
    if (t->rank() != 1 || t->dim(0) != channels)
      return std::nullopt;
  double epsilon = n.attr("epsilon") ? n.attr("epsilon")->f() : 1e-5;
  int64_t batch = x->dim(0), spatial = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(md, onDevice(*mean));
  PIPEC_TRY_ASSIGN(vd, onDevice(*var));
  PIPEC_TRY_ASSIGN(out, allocate(ElemType::Float, {channels}));
  if (channels == 0)
    return Outputs{out};
  int64_t chunks = batchNormGradWeightChunks(channels, batch * spatial);
  PIPEC_TRY_ASSIGN(partial, scratch(static_cast<size_t>(channels * chunks) * sizeof(double)));
  PIPEC_CUDA_TRY(launchBatchNormGradWeight(
      batch, channels, spatial, epsilon, static_cast<const float *>(dyd.rawData()),
      static_cast<const float *>(xd.rawData()), static_cast<const float *>(md.rawData()),
      static_cast<const float *>(vd.rawData()), static_cast<double *>(partial.get()), chunks,
      static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// The executor's own operations
//===----------------------------------------------------------------------===//

Expected<Tensor> CudaBackend::sum(ArrayRef<const Tensor *> terms) {
  if (Error err = enter())
    return err;
  if (terms.empty())
    return createStringError(inconvertibleErrorCode(), "cuda:%d: a sum of no terms", device);
  const Tensor &first = *terms[0];
  if (first.elemType() == ElemType::Float16 || first.elemType() == ElemType::BFloat16) {
    // Half gradient terms (rare: half activations with several consumers)
    // are added on the host, where the sum rounds to the half type as the
    // CPU backend's does.
    PIPEC_TRY_ASSIGN(total, download(first));
    total = total.clone();
    for (const Tensor *t : terms.drop_front()) {
      if (t->elemType() != first.elemType() || t->numElements() != first.numElements())
        return createStringError(inconvertibleErrorCode(), "cuda:%d: adding %s to %s", device,
                                 t->describe().c_str(), first.describe().c_str());
      PIPEC_TRY_ASSIGN(term, download(*t));
      float *acc = static_cast<float *>(total.rawData());
      const float *add = static_cast<const float *>(term.rawData());
      for (int64_t i = 0; i < total.numElements(); ++i)
        acc[i] += add[i];
      total.roundToElemType();
    }
    return onDevice(total);
  }
  auto type = scalarOf(first.elemType());
  if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64))
    return createStringError(inconvertibleErrorCode(), "cuda:%d: summing %s: float or double only",
                             device, first.describe().c_str());
  for (const Tensor *t : terms)
    if (t->elemType() != first.elemType() || t->numElements() != first.numElements())
      return createStringError(inconvertibleErrorCode(), "cuda:%d: adding %s to %s", device,
                               t->describe().c_str(), first.describe().c_str());
  PIPEC_TRY_ASSIGN(out, allocate(first.elemType(), first.shape()));
  PIPEC_TRY_ASSIGN(a, onDevice(first));
  if (terms.size() == 1) {
    if (out.byteSize() > 0)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(out.rawData(), a.rawData(), out.byteSize(),
                                     cudaMemcpyDeviceToDevice, stream));
  }
  for (size_t i = 1; i < terms.size(); ++i) {
    PIPEC_TRY_ASSIGN(b, onDevice(*terms[i]));
    PIPEC_CUDA_TRY(launchAdd(*type, i == 1 ? a.rawData() : out.rawData(), b.rawData(),
                             out.rawData(), out.numElements(), stream));
  }
  if (Error err = commitHolds())
    return err;
  return out;
}

Error CudaBackend::addInto(Tensor &accumulator, const Tensor &term) {
  if (Error err = enter())
    return err;
  if (accumulator.device() != device)
    return createStringError(inconvertibleErrorCode(),
                             "cuda:%d: the accumulator %s is not this device's", device,
                             accumulator.describe().c_str());
  auto type = scalarOf(accumulator.elemType());
  // A float32 accumulator takes float16 / bfloat16 terms: they are stored
  // as float (the CPU backend's rule).
  bool sameStorage =
      term.elemType() == accumulator.elemType() ||
      (accumulator.elemType() == ElemType::Float && cpu::storedAs<float>(term.elemType()));
  if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64) || !sameStorage ||
      term.numElements() != accumulator.numElements())
    return createStringError(inconvertibleErrorCode(),
                             "cuda:%d: adding %s into %s (float or double of one size only)",
                             device, term.describe().c_str(), accumulator.describe().c_str());
  PIPEC_TRY_ASSIGN(t, onDevice(term));
  PIPEC_CUDA_TRY(launchAdd(*type, accumulator.rawData(), t.rawData(), accumulator.rawData(),
                           accumulator.numElements(), stream));
  return commitHolds();
}

Expected<double> CudaBackend::sumOfSquares(ArrayRef<const Tensor *> tensors, double scale) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(block, pool->allocate(sizeof(double)));
  double *total = static_cast<double *>(block.get());
  PIPEC_CUDA_TRY(cudaMemsetAsync(total, 0, sizeof(double), stream));
  for (const Tensor *t : tensors) {
    auto type = scalarOf(t->elemType());
    if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64))
      return createStringError(inconvertibleErrorCode(),
                               "cuda:%d: the norm of %s: float or double only", device,
                               t->describe().c_str());
    PIPEC_TRY_ASSIGN(d, onDevice(*t));
    PIPEC_CUDA_TRY(launchSumSquares(*type, d.rawData(), d.numElements(), scale, total, stream));
  }
  double result = 0;
  PIPEC_CUDA_TRY(cudaMemcpyAsync(&result, total, sizeof(double), cudaMemcpyDeviceToHost, stream));
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  if (Error err = commitHolds())
    return err;
  return result;
}

Error CudaBackend::optimize(const rt::OptimizerUpdate &u, Tensor &w, const Tensor &g, Tensor &m,
                            Tensor &v) {
  using Kind = rt::OptimizerUpdate::Kind;
  if (Error err = enter())
    return err;
  auto type = scalarOf(w.elemType());
  if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64))
    return createStringError(inconvertibleErrorCode(),
                             "cuda:%d: training %s: float or double weights only", device,
                             w.describe().c_str());
  if (g.elemType() != w.elemType() || g.numElements() != w.numElements())
    return createStringError(inconvertibleErrorCode(), "cuda:%d: gradient %s for weight %s", device,
                             g.describe().c_str(), w.describe().c_str());
  k::OptimizerParams p;
  p.kind = u.kind == Kind::Sgd ? 0 : u.kind == Kind::Momentum ? 1 : 2;
  p.lr = u.lr;
  p.momentum = u.momentum;
  p.weightDecay = u.weightDecay;
  p.beta1 = u.beta1;
  p.beta2 = u.beta2;
  p.epsilon = u.epsilon;
  p.gradScale = u.gradScale;
  p.c1 = 1 - std::pow(u.beta1, u.step + 1);
  p.c2 = 1 - std::pow(u.beta2, u.step + 1);
  PIPEC_TRY_ASSIGN(dw, onDevice(w));
  PIPEC_TRY_ASSIGN(dg, onDevice(g));
  // The moments this kind needs: zero at first, replaced every step.
  auto moment = [&](Tensor &t) -> Expected<Tensor> {
    if (t.isNull())
      return zeros(w.elemType(), w.shape());
    return onDevice(t);
  };
  Tensor dm, dv, wOut, mOut, vOut;
  PIPEC_TRY_ASSIGN(newW, allocate(w.elemType(), w.shape()));
  wOut = newW;
  if (p.kind >= 1) {
    PIPEC_TRY_ASSIGN(mm, moment(m));
    PIPEC_TRY_ASSIGN(newM, allocate(w.elemType(), w.shape()));
    dm = mm;
    mOut = newM;
  }
  if (p.kind == 2) {
    PIPEC_TRY_ASSIGN(vv, moment(v));
    PIPEC_TRY_ASSIGN(newV, allocate(w.elemType(), w.shape()));
    dv = vv;
    vOut = newV;
  }
  PIPEC_CUDA_TRY(launchOptimizer(*type, p, dw.rawData(), dg.rawData(), dm.rawData(), dv.rawData(),
                                 wOut.rawData(), mOut.rawData(), vOut.rawData(), w.numElements(),
                                 stream));
  w = wOut;
  if (p.kind >= 1)
    m = mOut;
  if (p.kind == 2)
    v = vOut;
  return commitHolds();
}

} // namespace

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
