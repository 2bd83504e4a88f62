//===- CudaKernels.cu - The CUDA backend's device kernels ----------------===//
//
// Three kernel shapes run every body of KernelBodies.h: forEach (a
// grid-stride loop over elements), forEachRowWarp (a warp per row, lanes
// combining with shuffles) and forEachRowSerial (a thread per row: rows
// whose elements are strided, where neighbouring threads then read
// neighbouring memory). Each launcher wraps its body in a small functor and
// picks the kernel; the functors carry their parameters by value.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/CudaKernels.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace pipec::cuda {
namespace {

constexpr int Threads = 256;
constexpr int WarpSize = 32;
/// Grid-stride loops cap the grid here (far above what fills an H200).
constexpr int64_t MaxBlocks = 1 << 16;

int blocksFor(int64_t threads) {
  return static_cast<int>(std::clamp<int64_t>((threads + Threads - 1) / Threads, 1, MaxBlocks));
}

template <typename F> __global__ void forEach(int64_t n, F f) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    f(i);
}

/// The lanes of one warp; every lane calls each reduction.
struct WarpLanes : StridedLanes<WarpLanes> {
  __device__ int lane() const { return threadIdx.x & (WarpSize - 1); }
  __device__ int count() const { return WarpSize; }
  __device__ double sum(double v) const {
    for (int offset = WarpSize / 2; offset > 0; offset /= 2)
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
  __device__ float max(float v) const {
    for (int offset = WarpSize / 2; offset > 0; offset /= 2)
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
  }
};

/// Rows are assigned per warp, so the loop condition is uniform in a warp
/// and every lane reaches every shuffle.
template <typename F> __global__ void forEachRowWarp(int64_t rows, F f) {
  int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / WarpSize;
  int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / WarpSize;
  WarpLanes lanes;
  for (int64_t row = warp; row < rows; row += warps)
    f(lanes, row);
}

template <typename F> __global__ void forEachRowSerial(int64_t rows, F f) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  SerialLanes lanes;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < rows;
       row += stride)
    f(lanes, row);
}

/// Clears a status an earlier call left behind (cudaErrorNotReady from an
/// event query is one), so that the check after a launch reports the
/// launch's own failure. A sticky device error survives and is reported.
void clearStaleError() { cudaGetLastError(); }

template <typename F> cudaError_t launch(int64_t n, const F &f, cudaStream_t stream) {
  if (n <= 0)
    return cudaSuccess;
  clearStaleError();
  forEach<<<blocksFor(n), Threads, 0, stream>>>(n, f);
  return cudaGetLastError();
}

/// A warp per row when the row is contiguous, else a thread per row.
template <typename F>
cudaError_t launchRows(int64_t rows, bool contiguous, const F &f, cudaStream_t stream) {
  if (rows <= 0)
    return cudaSuccess;
  clearStaleError();
  if (contiguous)
    forEachRowWarp<<<blocksFor(rows * WarpSize), Threads, 0, stream>>>(rows, f);
  else
    forEachRowSerial<<<blocksFor(rows), Threads, 0, stream>>>(rows, f);
  return cudaGetLastError();
}

/// One warp for a whole-tensor reduction of a few thousand elements.
template <typename F> cudaError_t launchOneWarp(const F &f, cudaStream_t stream) {
  clearStaleError();
  forEachRowWarp<<<1, WarpSize, 0, stream>>>(1, f);
  return cudaGetLastError();
}

/// Calls f(T{}) with the unsigned type of \p bytes bytes.
template <typename F> cudaError_t bySize(int bytes, F &&f) {
  switch (bytes) {
  case 1:
    return f(uint8_t{});
  case 2:
    return f(uint16_t{});
  case 4:
    return f(uint32_t{});
  case 8:
    return f(uint64_t{});
  default:
    return cudaErrorInvalidValue;
  }
}

/// Calls f(T{}) with the C++ type of \p type.
template <typename F> cudaError_t byScalar(Scalar type, F &&f) {
  switch (type) {
  case Scalar::F32:
    return f(float{});
  case Scalar::F64:
    return f(double{});
  case Scalar::I64:
    return f(int64_t{});
  case Scalar::I32:
    return f(int32_t{});
  case Scalar::Bool:
    return f(bool{});
  }
  return cudaErrorInvalidValue;
}

//===----------------------------------------------------------------------===//
// Functors: one per body
//===----------------------------------------------------------------------===//

struct UnaryFn {
  ElemOp op;
  ElemParams params;
  const float *x;
  float *y;
  __device__ void operator()(int64_t i) const { unaryElement(i, op, params, x, y); }
};

/// A unary row of logical types (Not), bool to bool, by its own math.
template <typename M> struct LogicalUnaryFn {
  const bool *x;
  bool *y;
  __device__ void operator()(int64_t i) const { y[i] = M::value(x[i], ElemParams{}); }
};

template <typename M, int Arity>
cudaError_t launchLogicalUnaryOf(const bool *x, bool *y, int64_t n, cudaStream_t stream) {
  if constexpr (Arity == 1 && M::types == ElemTypes::Logical)
    return launch(n, LogicalUnaryFn<M>{x, y}, stream);
  else
    return cudaErrorInvalidValue;
}

template <typename T> struct ArithmeticFn {
  ElemOp op;
  IndexMap map;
  const T *a, *b;
  T *out;
  __device__ void operator()(int64_t i) const { arithmeticElement<T>(i, op, map, a, b, out); }
};

template <typename T> struct CompareFn {
  ElemOp op;
  IndexMap map;
  const T *a, *b;
  bool *out;
  __device__ void operator()(int64_t i) const { compareElement<T>(i, op, map, a, b, out); }
};

template <typename T> struct WhereFn {
  IndexMap map;
  const bool *cond;
  const T *x, *y;
  T *out;
  __device__ void operator()(int64_t i) const { whereElement<T>(i, map, cond, x, y, out); }
};

template <typename T> struct CopyFn {
  IndexMap map;
  const T *in;
  T *out;
  __device__ void operator()(int64_t i) const { copyElement<T>(i, map, in, out); }
};

template <typename From, typename To> struct CastFn {
  const From *in;
  To *out;
  __device__ void operator()(int64_t i) const { castElement<From, To>(i, in, out); }
};

template <typename T> struct FillFn {
  T value;
  T *out;
  __device__ void operator()(int64_t i) const { fillElement<T>(i, value, out); }
};

template <typename T> struct AddFn {
  const T *a, *b;
  T *out;
  __device__ void operator()(int64_t i) const { addElement<T>(i, a, b, out); }
};

struct GradientFn {
  ElemOp op;
  ElemParams params;
  const float *dy, *a;
  float *dx;
  __device__ void operator()(int64_t i) const { gradientElement(i, op, params, dy, a, dx); }
};

struct FusedFn {
  FusedProgram program;
  FusedMap map;
  const float *in[MaxFusedInputs];
  float *out[MaxFusedOutputs];
  __device__ void operator()(int64_t i) const { fusedElement(i, program, map, in, out); }
};

template <typename T, typename I> struct GatherFn {
  GatherParams p;
  const T *data;
  const I *indices;
  T *out;
  int *flag;
  __device__ void operator()(int64_t i) const {
    gatherElement<T, I>(i, p, data, indices, out, flag);
  }
};

template <typename I> struct GatherGradFn {
  GatherParams p;
  const float *dy;
  const I *indices;
  float *dx;
  int *flag;
  __device__ void operator()(int64_t i) const {
    gatherGradElement<float, I>(i, p, dy, indices, dx, flag);
  }
};

struct ReducePartialFn {
  ReducePlan plan;
  const float *in;
  double *partial;
  __device__ void operator()(int64_t t) const { reducePartialElement<float>(t, plan, in, partial); }
};

struct ReduceFinishFn {
  int64_t outputs, chunks;
  const double *partial;
  double divisor;
  float *out;
  __device__ void operator()(int64_t o) const {
    reduceFinishElement<float>(o, outputs, chunks, partial, divisor, out);
  }
};

struct SoftmaxFn {
  RowLayout layout;
  const float *x;
  float *y;
  bool logarithm;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    softmaxRow(lanes, row, layout, x, y, logarithm);
  }
};

struct SoftmaxGradFn {
  RowLayout layout;
  const float *dy, *y;
  float *dx;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    softmaxGradRow<float>(lanes, row, layout, dy, y, dx);
  }
};

struct LayerNormFn {
  int64_t size;
  float epsilon;
  const float *x, *gamma, *beta;
  float *y, *mean, *invStd;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    layerNormRow<float>(lanes, row, size, epsilon, x, gamma, beta, y, mean, invStd);
  }
};

struct LayerNormGradInputFn {
  int64_t size;
  float epsilon;
  const float *dy, *x, *scale;
  float *dx;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    layerNormGradInputRow<float>(lanes, row, size, epsilon, dy, x, scale, dx);
  }
};

struct LayerNormStatsFn {
  int64_t size;
  float epsilon;
  const float *x;
  float *mean, *rstd;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    layerNormStatsRow<float>(lanes, row, size, epsilon, x, mean, rstd);
  }
};

struct LayerNormGradWeightFn {
  int64_t rows, size, chunkLength;
  const float *dy, *x, *mean, *rstd;
  double *partial;
  __device__ void operator()(int64_t t) const {
    layerNormGradWeightPartial<float>(t, rows, size, chunkLength, dy, x, mean, rstd, partial);
  }
};

struct CrossEntropyFn {
  RowLayout layout;
  CrossEntropyParams p;
  const float *scores;
  const int64_t *labels;
  float *logProb, *losses, *valid;
  int *flag;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    crossEntropyRow(lanes, row, layout, p, scores, labels, logProb, losses, valid, flag);
  }
};

struct CrossEntropyFinishFn {
  int64_t positions;
  bool mean;
  const float *losses, *valid;
  float *out;
  template <typename L> __device__ void operator()(const L &lanes, int64_t) const {
    crossEntropyFinish(lanes, positions, mean, losses, valid, out);
  }
};

struct LabelCountFn {
  int64_t positions;
  CrossEntropyParams p;
  const int64_t *labels;
  double *count;
  template <typename L> __device__ void operator()(const L &lanes, int64_t) const {
    labelCount(lanes, positions, p, labels, count);
  }
};

struct CrossEntropyGradFn {
  RowLayout layout;
  CrossEntropyParams p;
  const float *dLoss;
  const double *count;
  const float *scores;
  const int64_t *labels;
  float *dx;
  int *flag;
  template <typename L> __device__ void operator()(const L &lanes, int64_t row) const {
    crossEntropyGradRow(lanes, row, layout, p, dLoss, count, scores, labels, dx, flag);
  }
};

struct Im2colFn {
  Im2colParams p;
  const float *image;
  float *columns;
  __device__ void operator()(int64_t t) const { im2colElement(t, p, image, columns); }
};

struct Col2imFn {
  Im2colParams p;
  const float *columns;
  float *image;
  __device__ void operator()(int64_t i) const { col2imElement(i, p, columns, image); }
};

struct BiasFn {
  int64_t maps, size;
  const float *bias;
  float *y;
  __device__ void operator()(int64_t i) const { biasElement(i, maps, size, bias, y); }
};

struct PoolFn {
  PoolParams p;
  const float *x;
  float *y;
  __device__ void operator()(int64_t t) const { poolElement(t, p, x, y); }
};

struct PoolGradFn {
  PoolParams p;
  const float *dy, *x;
  float *dx;
  __device__ void operator()(int64_t i) const { poolGradElement(i, p, dy, x, dx); }
};

struct BatchNormFn {
  int64_t channels, spatial;
  double epsilon;
  const float *x, *scale, *bias, *mean, *var;
  float *y;
  __device__ void operator()(int64_t i) const {
    batchNormElement(i, channels, spatial, epsilon, x, scale, bias, mean, var, y);
  }
};

struct BatchNormGradWeightFn {
  int64_t channels, batch, spatial, chunks;
  const float *dy, *x, *mean;
  double *partial;
  __device__ void operator()(int64_t t) const {
    batchNormGradWeightPartial(t, channels, batch, spatial, chunks, dy, x, mean, partial);
  }
};

struct BatchNormGradWeightFinishFn {
  int64_t chunks;
  double epsilon;
  const double *partial;
  const float *var;
  float *out;
  __device__ void operator()(int64_t c) const {
    batchNormGradWeightFinish(c, chunks, epsilon, partial, var, out);
  }
};

} // namespace

//===----------------------------------------------------------------------===//
// Launchers
//===----------------------------------------------------------------------===//

cudaError_t launchUnary(ElemOp op, const ElemParams &params, const float *x, float *y, int64_t n,
                        cudaStream_t stream) {
  if (!isFloatMath(op))
    return cudaErrorInvalidValue;
  return launch(n, UnaryFn{op, params, x, y}, stream);
}

cudaError_t launchLogicalUnary(ElemOp op, const bool *x, bool *y, int64_t n, cudaStream_t stream) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return launchLogicalUnaryOf<elem::ID, ARITY>(x, y, n, stream);
#include "ops/Ops.def"
  }
  return cudaErrorInvalidValue;
}

cudaError_t launchBinary(ElemOp op, Scalar type, const IndexMap &map, const void *a, const void *b,
                         void *out, int64_t n, cudaStream_t stream) {
  if (isComparison(op))
    return byScalar(type, [&](auto tag) {
      using T = decltype(tag);
      return launch(n,
                    CompareFn<T>{op, map, static_cast<const T *>(a), static_cast<const T *>(b),
                                 static_cast<bool *>(out)},
                    stream);
    });
  if (!isFloatMath(op))
    return cudaErrorInvalidValue;
  bool floatOnly = elemTypes(op) == ElemTypes::Float || elemDivides(op);
  if (type == Scalar::F32)
    return launch(n,
                  ArithmeticFn<float>{op, map, static_cast<const float *>(a),
                                      static_cast<const float *>(b), static_cast<float *>(out)},
                  stream);
  if (type == Scalar::I64 && !floatOnly)
    return launch(n,
                  ArithmeticFn<int64_t>{op, map, static_cast<const int64_t *>(a),
                                        static_cast<const int64_t *>(b),
                                        static_cast<int64_t *>(out)},
                  stream);
  return cudaErrorInvalidValue;
}

cudaError_t launchWhere(int elemBytes, const IndexMap &map, const bool *cond, const void *x,
                        const void *y, void *out, int64_t n, cudaStream_t stream) {
  return bySize(elemBytes, [&](auto tag) {
    using T = decltype(tag);
    return launch(n,
                  WhereFn<T>{map, cond, static_cast<const T *>(x), static_cast<const T *>(y),
                             static_cast<T *>(out)},
                  stream);
  });
}

cudaError_t launchCopy(int elemBytes, const IndexMap &map, const void *in, void *out, int64_t n,
                       cudaStream_t stream) {
  return bySize(elemBytes, [&](auto tag) {
    using T = decltype(tag);
    return launch(n, CopyFn<T>{map, static_cast<const T *>(in), static_cast<T *>(out)}, stream);
  });
}

cudaError_t launchCast(Scalar from, Scalar to, const void *in, void *out, int64_t n,
                       cudaStream_t stream) {
  return byScalar(from, [&](auto fromTag) {
    using From = decltype(fromTag);
    return byScalar(to, [&](auto toTag) {
      using To = decltype(toTag);
      return launch(n, CastFn<From, To>{static_cast<const From *>(in), static_cast<To *>(out)},
                    stream);
    });
  });
}

cudaError_t launchFill(int elemBytes, uint64_t pattern, void *out, int64_t n, cudaStream_t stream) {
  return bySize(elemBytes, [&](auto tag) {
    using T = decltype(tag);
    return launch(n, FillFn<T>{static_cast<T>(pattern), static_cast<T *>(out)}, stream);
  });
}

cudaError_t launchAdd(Scalar type, const void *a, const void *b, void *out, int64_t n,
                      cudaStream_t stream) {
  if (type == Scalar::F32)
    return launch(n,
                  AddFn<float>{static_cast<const float *>(a), static_cast<const float *>(b),
                               static_cast<float *>(out)},
                  stream);
  if (type == Scalar::F64)
    return launch(n,
                  AddFn<double>{static_cast<const double *>(a), static_cast<const double *>(b),
                                static_cast<double *>(out)},
                  stream);
  return cudaErrorInvalidValue;
}

cudaError_t launchGradient(ElemOp op, const ElemParams &params, const float *dy, const float *a,
                           float *dx, int64_t n, cudaStream_t stream) {
  return launch(n, GradientFn{op, params, dy, a, dx}, stream);
}

/// Adds the block's sum of every thread's \p s into \p total; every
/// thread of the block calls it.
__device__ void addBlockSum(double s, double *total) {
  __shared__ double warps[Threads / WarpSize];
  WarpLanes lanes;
  s = lanes.sum(s);
  int warp = threadIdx.x / WarpSize;
  if (lanes.lane() == 0)
    warps[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lanes.lane() < static_cast<int>(blockDim.x / WarpSize) ? warps[lanes.lane()] : 0.0;
    s = lanes.sum(s);
    if (lanes.lane() == 0)
      atomicAdd(total, s);
  }
}

template <typename T>
__global__ void sumSquaresKernel(const T *x, int64_t n, double scale, double *total) {
  double s = 0;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    double g = static_cast<double>(x[i]) * scale;
    s += g * g;
  }
  addBlockSum(s, total);
}

cudaError_t launchSumSquares(Scalar type, const void *x, int64_t n, double scale, double *total,
                             cudaStream_t stream) {
  if (n == 0)
    return cudaSuccess;
  int blocks = static_cast<int>(std::min<int64_t>(blocksFor(n), 1024));
  if (type == Scalar::F64)
    sumSquaresKernel<<<blocks, Threads, 0, stream>>>(static_cast<const double *>(x), n, scale,
                                                     total);
  else
    sumSquaresKernel<<<blocks, Threads, 0, stream>>>(static_cast<const float *>(x), n, scale,
                                                     total);
  return cudaGetLastError();
}

cudaError_t launchFused(const FusedProgram &program, const FusedMap &map, const float *const *in,
                        float *const *out, int64_t n, cudaStream_t stream) {
  FusedFn f{program, map, {}, {}};
  for (int k = 0; k < program.inputs && k < MaxFusedInputs; ++k)
    f.in[k] = in[k];
  for (int o = 0; o < program.outputs && o < MaxFusedOutputs; ++o)
    f.out[o] = out[o];
  return launch(n, f, stream);
}

cudaError_t launchGather(int elemBytes, bool int32Indices, const GatherParams &p, const void *data,
                         const void *indices, void *out, int *flag, cudaStream_t stream) {
  int64_t n = p.outer * p.count * p.inner;
  return bySize(elemBytes, [&](auto tag) {
    using T = decltype(tag);
    if (int32Indices)
      return launch(n,
                    GatherFn<T, int32_t>{p, static_cast<const T *>(data),
                                         static_cast<const int32_t *>(indices),
                                         static_cast<T *>(out), flag},
                    stream);
    return launch(n,
                  GatherFn<T, int64_t>{p, static_cast<const T *>(data),
                                       static_cast<const int64_t *>(indices), static_cast<T *>(out),
                                       flag},
                  stream);
  });
}

cudaError_t launchGatherGrad(bool int32Indices, const GatherParams &p, const float *dy,
                             const void *indices, float *dx, int *flag, cudaStream_t stream) {
  int64_t n = p.outer * p.count * p.inner;
  if (int32Indices)
    return launch(n, GatherGradFn<int32_t>{p, dy, static_cast<const int32_t *>(indices), dx, flag},
                  stream);
  return launch(n, GatherGradFn<int64_t>{p, dy, static_cast<const int64_t *>(indices), dx, flag},
                stream);
}

cudaError_t launchReduce(const ReducePlan &plan, const float *in, double *partial, double divisor,
                         float *out, cudaStream_t stream) {
  if (cudaError_t e =
          launch(plan.outputs * plan.chunks, ReducePartialFn{plan, in, partial}, stream))
    return e;
  return launch(plan.outputs, ReduceFinishFn{plan.outputs, plan.chunks, partial, divisor, out},
                stream);
}

cudaError_t launchSoftmax(const RowLayout &layout, const float *x, float *y, bool logarithm,
                          cudaStream_t stream) {
  return launchRows(rowCount(layout), layout.inner == 1, SoftmaxFn{layout, x, y, logarithm},
                    stream);
}

cudaError_t launchSoftmaxGrad(const RowLayout &layout, const float *dy, const float *y, float *dx,
                              cudaStream_t stream) {
  return launchRows(rowCount(layout), layout.inner == 1, SoftmaxGradFn{layout, dy, y, dx}, stream);
}

cudaError_t launchLayerNorm(int64_t rows, int64_t size, float epsilon, const float *x,
                            const float *gamma, const float *beta, float *y, float *mean,
                            float *invStd, cudaStream_t stream) {
  return launchRows(rows, true, LayerNormFn{size, epsilon, x, gamma, beta, y, mean, invStd},
                    stream);
}

cudaError_t launchLayerNormGradInput(int64_t rows, int64_t size, float epsilon, const float *dy,
                                     const float *x, const float *scale, float *dx,
                                     cudaStream_t stream) {
  return launchRows(rows, true, LayerNormGradInputFn{size, epsilon, dy, x, scale, dx}, stream);
}

int64_t layerNormGradWeightChunks(int64_t rows, int64_t size) {
  int64_t wanted = size > 0 ? (int64_t(1) << 17) / size : 1;
  return std::clamp<int64_t>(std::min(wanted, (rows + 31) / 32), 1, std::max<int64_t>(rows, 1));
}

cudaError_t launchLayerNormGradWeight(int64_t rows, int64_t size, float epsilon, const float *dy,
                                      const float *x, float *mean, float *rstd, double *partial,
                                      int64_t chunks, float *dScale, cudaStream_t stream) {
  if (cudaError_t e =
          launchRows(rows, true, LayerNormStatsFn{size, epsilon, x, mean, rstd}, stream))
    return e;
  int64_t chunkLength = (rows + chunks - 1) / chunks;
  if (cudaError_t e = launch(
          size * chunks, LayerNormGradWeightFn{rows, size, chunkLength, dy, x, mean, rstd, partial},
          stream))
    return e;
  return launch(size, ReduceFinishFn{size, chunks, partial, 1.0, dScale}, stream);
}

cudaError_t launchCrossEntropy(const RowLayout &layout, const CrossEntropyParams &p,
                               const float *scores, const int64_t *labels, float *logProb,
                               float *losses, float *valid, float *out, int *flag,
                               cudaStream_t stream) {
  int64_t rows = rowCount(layout);
  if (cudaError_t e = launchRows(
          rows, layout.inner == 1,
          CrossEntropyFn{layout, p, scores, labels, logProb, losses, valid, flag}, stream))
    return e;
  if (p.reduction == 0)
    return cudaSuccess;
  return launchOneWarp(CrossEntropyFinishFn{rows, p.reduction == 2, losses, valid, out}, stream);
}

cudaError_t launchCrossEntropyGrad(const RowLayout &layout, const CrossEntropyParams &p,
                                   const float *dLoss, const float *scores, const int64_t *labels,
                                   double *count, float *dx, int *flag, cudaStream_t stream) {
  int64_t rows = rowCount(layout);
  if (cudaError_t e = launchOneWarp(LabelCountFn{rows, p, labels, count}, stream))
    return e;
  return launchRows(rows, layout.inner == 1,
                    CrossEntropyGradFn{layout, p, dLoss, count, scores, labels, dx, flag}, stream);
}

cudaError_t launchIm2col(const Im2colParams &p, const float *image, float *columns,
                         cudaStream_t stream) {
  return launch(p.images * p.rows() * p.w.outSize(), Im2colFn{p, image, columns}, stream);
}

cudaError_t launchCol2im(const Im2colParams &p, const float *columns, float *image,
                         cudaStream_t stream) {
  return launch(p.images * p.channels * p.w.inSize(), Col2imFn{p, columns, image}, stream);
}

cudaError_t launchBias(int64_t n, int64_t maps, int64_t size, const float *bias, float *y,
                       cudaStream_t stream) {
  return launch(n, BiasFn{maps, size, bias, y}, stream);
}

cudaError_t launchPool(const PoolParams &p, int64_t planes, const float *x, float *y,
                       cudaStream_t stream) {
  return launch(planes * p.w.outSize(), PoolFn{p, x, y}, stream);
}

cudaError_t launchPoolGrad(const PoolParams &p, int64_t planes, const float *dy, const float *x,
                           float *dx, cudaStream_t stream) {
  return launch(planes * p.w.inSize(), PoolGradFn{p, dy, x, dx}, stream);
}

cudaError_t launchBatchNorm(int64_t batch, int64_t channels, int64_t spatial, double epsilon,
                            const float *x, const float *scale, const float *bias,
                            const float *mean, const float *var, float *y, cudaStream_t stream) {
  return launch(batch * channels * spatial,
                BatchNormFn{channels, spatial, epsilon, x, scale, bias, mean, var, y}, stream);
}

int64_t batchNormGradWeightChunks(int64_t channels, int64_t count) {
  int64_t wanted = channels > 0 ? (int64_t(1) << 17) / channels : 1;
  return std::clamp<int64_t>(std::min(wanted, (count + 255) / 256), 1, std::max<int64_t>(count, 1));
}

cudaError_t launchBatchNormGradWeight(int64_t batch, int64_t channels, int64_t spatial,
                                      double epsilon, const float *dy, const float *x,
                                      const float *mean, const float *var, double *partial,
                                      int64_t chunks, float *dScale, cudaStream_t stream) {
  if (cudaError_t e = launch(
          channels * chunks,
          BatchNormGradWeightFn{channels, batch, spatial, chunks, dy, x, mean, partial}, stream))
    return e;
  return launch(channels, BatchNormGradWeightFinishFn{chunks, epsilon, partial, var, dScale},
                stream);
}

/// Block (x, s) updates a stride of slot s, then adds its squares.
template <typename T>
__global__ void optimizerKernel(OptimizerParams p, OptimizerTable table, double *squares) {
  int s = blockIdx.y;
  p.decayCenter = table.decayCenter[s];
  const T *w = static_cast<const T *>(table.w[s]), *g = static_cast<const T *>(table.g[s]);
  const T *m = static_cast<const T *>(table.m[s]), *v = static_cast<const T *>(table.v[s]);
  T *wOut = static_cast<T *>(table.wOut[s]), *mOut = static_cast<T *>(table.mOut[s]);
  T *vOut = static_cast<T *>(table.vOut[s]);
  double sum = 0;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < table.n[s];
       i += stride) {
    optimizerElement<T>(i, p, w, g, m, v, wOut, mOut, vOut);
    double wi = static_cast<double>(wOut[i]);
    sum += wi * wi;
    if (vOut) {
      double vi = static_cast<double>(vOut[i]);
      sum += vi * vi;
    }
  }
  addBlockSum(sum, squares);
}

cudaError_t launchOptimizer(Scalar type, const OptimizerParams &p, const OptimizerTable &table,
                            double *squares, cudaStream_t stream) {
  if (table.count <= 0)
    return cudaSuccess;
  if (table.count > OptimizerTable::Slots)
    return cudaErrorInvalidValue;
  int64_t most = 0;
  for (int s = 0; s < table.count; ++s)
    most = std::max(most, table.n[s]);
  // Enough blocks per slot to fill the device with one large tensor; the
  // grid-stride loop covers the rest.
  dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocksFor(most), 512)),
            static_cast<unsigned>(table.count));
  clearStaleError();
  if (type == Scalar::F32)
    optimizerKernel<float><<<grid, Threads, 0, stream>>>(p, table, squares);
  else if (type == Scalar::F64)
    optimizerKernel<double><<<grid, Threads, 0, stream>>>(p, table, squares);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

} // namespace pipec::cuda
