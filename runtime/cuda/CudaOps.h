//===- CudaOps.h - The CUDA backend's class, shared by its files ---------===//
//
// The CudaBackend class (runtime/cuda/CudaBackend.h is its public face) and
// the NodeView its op methods take; internal to runtime/cuda. The methods
// live in CudaBackend.cpp (memory, transfers, dispatch, building blocks),
// CudaTensorOps.cpp (views, data movement, element-wise), CudaMathOps.cpp
// (GEMMs, rows, reductions, losses, gradients) and CudaConvOps.cpp
// (convolution, pooling, batch normalization, the executor's sums and
// optimizer).
//
// An op method returns the node's outputs, or nullopt when the node is
// outside what the device kernels do (an element type, attribute or shape
// they do not handle, or a malformed node): run() then hands it to the host
// backend, which also words the error for a malformed node exactly as the
// CPU backend does.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDAOPS_H
#define PIPEC_RUNTIME_CUDA_CUDAOPS_H

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

/// Declares Var as the value of an Expected, or returns its error.
#define PIPEC_TRY_ASSIGN(Var, Expr)                                                                \
  auto Var##OrError = (Expr);                                                                      \
  if (!Var##OrError)                                                                               \
    return Var##OrError.takeError();                                                               \
  auto &Var = *Var##OrError

namespace pipec::cuda {

using llvm::ArrayRef;
using llvm::consumeError;
using llvm::createStringError;
using llvm::Error;
using llvm::Expected;
using llvm::formatv;
using llvm::inconvertibleErrorCode;
using llvm::StringRef;
using llvm::toString;
using llvm::Twine;

using cpu::Tensor;
using pipec::DType;
using Shape = std::vector<int64_t>;
using Outputs = std::vector<Tensor>;
/// An op's outputs, nullopt to fall back to the CPU, or an error.
using Result = Expected<std::optional<Outputs>>;
namespace k = kernels;

/// Integer tensors up to this many elements that are computed from host
/// tensors stay on the host: shapes, axes, small index lists.
inline constexpr int64_t HostIntLimit = 4096;
/// Device-side checks (index and label ranges) pending until the next sync.
inline constexpr size_t MaxChecks = 1024;
/// Pinned staging for uploads; larger uploads are synchronous.
inline constexpr size_t StagingBytes = size_t(8) << 20;
/// Constant outputs kept on the device, per node, up to this size.
inline constexpr size_t ConstantCacheBytes = size_t(1) << 20;

inline bool isIntegral(DType type) { return cpu::isInteger(type) || type == DType::Bool; }

inline std::optional<k::Scalar> scalarOf(DType type) {
  switch (type) {
  case DType::F32:
    return k::Scalar::F32;
  case DType::F64:
    return k::Scalar::F64;
  case DType::I64:
    return k::Scalar::I64;
  case DType::I32:
    return k::Scalar::I32;
  case DType::Bool:
    return k::Scalar::Bool;
  default:
    return std::nullopt;
  }
}

inline int elemBytes(const Tensor &t) { return static_cast<int>(cpu::storageSize(t.elemType())); }

inline bool isFloat(const Tensor *t) { return t && t->elemType() == DType::F32; }

inline int64_t product(ArrayRef<int64_t> dims) { return cpu::numElementsOf(dims); }

inline bool fitsInt(int64_t v) { return v >= 0 && v <= INT_MAX; }

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
  using rt::Backend::run; // with the op's row: looks it up by name, as this one does
  Expected<Outputs> run(const onnx::NodeProto &node, int64_t opset,
                        ArrayRef<const Tensor *> inputs) override;
  Expected<Tensor> upload(const Tensor &host) override;
  Expected<Tensor> download(const Tensor &tensor) override;
  /// Every copy queued on the stream, then one wait.
  Expected<std::vector<Tensor>> downloadAll(ArrayRef<const Tensor *> tensors) override;
  Expected<Tensor> zeros(DType type, ArrayRef<int64_t> shape) override;
  Expected<Tensor> slice(const Tensor &t, int64_t begin, int64_t count) override;
  Expected<Tensor> sum(ArrayRef<const Tensor *> terms) override;
  Error addInto(Tensor &accumulator, const Tensor &term) override;
  Expected<double> sumOfSquares(ArrayRef<const Tensor *> tensors, double scale) override;
  Expected<Tensor> optimize(const rt::OptimizerUpdate &update,
                            ArrayRef<rt::OptimizerSlot> slots) override;
  Error reserve(int64_t bytes) override;
  Error synchronize() override;
  std::map<std::string, int64_t> fallbackOps() const override { return fallbacks; }
  int64_t devicePeakBytes() const override { return pool ? pool->stats().peakInUse : 0; }
  /// Nodes dispatched, the host's stream waits, the bytes copied back and
  /// the pool's allocations (run --profile).
  rt::BackendCounters counters() const override { return counted; }

  DevicePool::Stats poolStats() const { return pool->stats(); }
  int64_t biasEpilogueGemms() const { return epilogueGemms; }

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
  Expected<Tensor> allocate(DType type, Shape shape);
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
  /// The Transpose and the MatMul of its body, on the device (as before
  /// the host fused them).
  Result matMulTransposed(const NodeView &n) { return runBody(n); }
  Result softmaxAttention(const NodeView &n) { return runBody(n); }
  /// Fused attention in training and its gradient (ops/Attention.h): the
  /// ops of its body (runtime/core/AttentionBody.h) on this backend.
  Result runAttentionBody(const NodeView &n);
  Result scaledDotProductAttention(const NodeView &n) { return runAttentionBody(n); }
  Result scaledDotProductAttentionGrad(const NodeView &n) { return runAttentionBody(n); }
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
  /// (its element count is the kept dimensions' product), divided by
  /// \p divisor.
  Expected<bool> reduceInto(const Tensor &x, const std::vector<bool> &reduced, double divisor,
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
  /// GEMMs that ran with the bias epilogue.
  int64_t epilogueGemms = 0;
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
  rt::BackendCounters counted;
};

} // namespace pipec::cuda

#endif // PIPEC_RUNTIME_CUDA_CUDAOPS_H
