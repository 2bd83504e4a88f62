//===- CudaKernels.h - Launchers of the CUDA backend's device kernels ----===//
//
// Host functions that queue one kernel (or a short fixed sequence) on a
// stream and return the launch status; they never synchronize. Pointers are
// device memory of the stream's device, sized by the caller; outputs never
// alias inputs unless a launcher says so. The math of every kernel is in
// runtime/kernels (ElementMath.h, Elementwise.h, KernelBodies.h); these only
// choose grid sizes and element types. GEMMs are
// not here: the backend calls cuBLAS itself.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDAKERNELS_H
#define PIPEC_RUNTIME_CUDA_CUDAKERNELS_H

#include "runtime/kernels/KernelBodies.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace pipec::cuda {

using namespace pipec::kernels;

/// y = op(x) on n floats (y may be x), for an op whose math maps floats to
/// floats.
cudaError_t launchUnary(ElemOp op, const ElemParams &params, const float *x, float *y, int64_t n,
                        cudaStream_t stream);

/// y = op(x) on n bools, for a unary row of logical types (Not).
cudaError_t launchLogicalUnary(ElemOp op, const bool *x, bool *y, int64_t n, cudaStream_t stream);

/// out[i] = op(a[.], b[.]) for the n elements of map's output. Arithmetic
/// for F32 and, for ops that never divide, I64; comparisons for every
/// Scalar, writing bool.
cudaError_t launchBinary(ElemOp op, Scalar type, const IndexMap &map, const void *a, const void *b,
                         void *out, int64_t n, cudaStream_t stream);

/// out[i] = cond ? x : y over a three-operand map; elements of 1, 2, 4 or 8
/// bytes.
cudaError_t launchWhere(int elemBytes, const IndexMap &map, const bool *cond, const void *x,
                        const void *y, void *out, int64_t n, cudaStream_t stream);

/// out[i] = in[offsetOf(map, 0, i)]: transposes, slices and broadcasts of
/// elements of 1, 2, 4 or 8 bytes.
cudaError_t launchCopy(int elemBytes, const IndexMap &map, const void *in, void *out, int64_t n,
                       cudaStream_t stream);

/// Converts n elements between F32, F64, I64, I32 and Bool.
cudaError_t launchCast(Scalar from, Scalar to, const void *in, void *out, int64_t n,
                       cudaStream_t stream);

/// Sets n elements of \p elemBytes (1, 2, 4 or 8) to the low bytes of
/// \p pattern.
cudaError_t launchFill(int elemBytes, uint64_t pattern, void *out, int64_t n, cudaStream_t stream);

/// out = a + b on n elements of F32 or F64 (out may be a or b).
cudaError_t launchAdd(Scalar type, const void *a, const void *b, void *out, int64_t n,
                      cudaStream_t stream);

/// dx = dy * derivative of unary op at a, on n floats (UnaryGrad).
cudaError_t launchGradient(ElemOp op, const ElemParams &params, const float *dy, const float *a,
                           float *dx, int64_t n, cudaStream_t stream);

/// *total += sum over i < n of (scale x[i])^2 (float or double x), in
/// double: one partial sum per block, added atomically.
cudaError_t launchSumSquares(Scalar type, const void *x, int64_t n, double scale, double *total,
                             cudaStream_t stream);

/// A fused element-wise program (kernels/Elementwise.h) over n output elements:
/// program.inputs input pointers read through map, program.outputs outputs.
cudaError_t launchFused(const FusedProgram &program, const FusedMap &map, const float *const *in,
                        float *const *out, int64_t n, cudaStream_t stream);

/// Gather of elements of 1, 2, 4 or 8 bytes with int64 (or int32) indices;
/// bad indices set *flag.
cudaError_t launchGather(int elemBytes, bool int32Indices, const GatherParams &p, const void *data,
                         const void *indices, void *out, int *flag, cudaStream_t stream);

/// Scatter-adds dy into dx, which the caller has zeroed.
cudaError_t launchGatherGrad(bool int32Indices, const GatherParams &p, const float *dy,
                             const void *indices, float *dx, int *flag, cudaStream_t stream);

/// Both passes of \p plan over floats: \p partial holds plan.outputs *
/// plan.chunks doubles; out gets plan.outputs floats divided by \p divisor.
cudaError_t launchReduce(const ReducePlan &plan, const float *in, double *partial, double divisor,
                         float *out, cudaStream_t stream);

cudaError_t launchSoftmax(const RowLayout &layout, const float *x, float *y, bool logarithm,
                          cudaStream_t stream);

cudaError_t launchSoftmaxGrad(const RowLayout &layout, const float *dy, const float *y, float *dx,
                              cudaStream_t stream);

/// Rows of \p size contiguous elements; beta, mean and invStd may be null.
cudaError_t launchLayerNorm(int64_t rows, int64_t size, float epsilon, const float *x,
                            const float *gamma, const float *beta, float *y, float *mean,
                            float *invStd, cudaStream_t stream);

cudaError_t launchLayerNormGradInput(int64_t rows, int64_t size, float epsilon, const float *dy,
                                     const float *x, const float *scale, float *dx,
                                     cudaStream_t stream);

/// Scratch sizes for launchLayerNormGradWeight: \p chunks row chunks.
int64_t layerNormGradWeightChunks(int64_t rows, int64_t size);

/// dScale (size floats) from dy and x (rows x size); mean and rstd hold
/// rows floats, partial size * chunks doubles (chunks from
/// layerNormGradWeightChunks).
cudaError_t launchLayerNormGradWeight(int64_t rows, int64_t size, float epsilon, const float *dy,
                                      const float *x, float *mean, float *rstd, double *partial,
                                      int64_t chunks, float *dScale, cudaStream_t stream);

/// SoftmaxCrossEntropyLoss: per-position losses and valid flags (rowCount
/// floats each), logProb if not null, and for reduction sum or mean the
/// scalar \p out.
cudaError_t launchCrossEntropy(const RowLayout &layout, const CrossEntropyParams &p,
                               const float *scores, const int64_t *labels, float *logProb,
                               float *losses, float *valid, float *out, int *flag,
                               cudaStream_t stream);

/// SoftmaxCrossEntropyLossGrad; \p count is one double of scratch.
cudaError_t launchCrossEntropyGrad(const RowLayout &layout, const CrossEntropyParams &p,
                                   const float *dLoss, const float *scores, const int64_t *labels,
                                   double *count, float *dx, int *flag, cudaStream_t stream);

/// Unfolds p.images images into columns (layout as Im2colParams says).
cudaError_t launchIm2col(const Im2colParams &p, const float *image, float *columns,
                         cudaStream_t stream);

/// The adjoint of launchIm2col (columns [images, rows, outSize]): writes
/// every element of the images.
cudaError_t launchCol2im(const Im2colParams &p, const float *columns, float *image,
                         cudaStream_t stream);

/// y [batch, maps, size] (n elements) += bias per map.
cudaError_t launchBias(int64_t n, int64_t maps, int64_t size, const float *bias, float *y,
                       cudaStream_t stream);

/// MaxPool or AveragePool of \p planes planes.
cudaError_t launchPool(const PoolParams &p, int64_t planes, const float *x, float *y,
                       cudaStream_t stream);

/// MaxPoolGrad (x is the forward input) or AveragePoolGrad (x unused) of
/// \p planes planes; writes every element of dx.
cudaError_t launchPoolGrad(const PoolParams &p, int64_t planes, const float *dy, const float *x,
                           float *dx, cudaStream_t stream);

/// BatchNormalization in inference mode of X [batch, channels, spatial].
cudaError_t launchBatchNorm(int64_t batch, int64_t channels, int64_t spatial, double epsilon,
                            const float *x, const float *scale, const float *bias,
                            const float *mean, const float *var, float *y, cudaStream_t stream);

/// Chunks per channel for launchBatchNormGradWeight's partial sums.
int64_t batchNormGradWeightChunks(int64_t channels, int64_t count);

/// BatchNormGradWeight: dScale (channels floats); \p partial holds
/// channels * chunks doubles.
cudaError_t launchBatchNormGradWeight(int64_t batch, int64_t channels, int64_t spatial,
                                      double epsilon, const float *dy, const float *x,
                                      const float *mean, const float *var, double *partial,
                                      int64_t chunks, float *dScale, cudaStream_t stream);

/// The tensors of one multi-tensor optimizer launch, passed by value as
/// the kernel's argument (under its 4 KiB limit), so nothing is uploaded.
/// Slot s updates n[s] elements; its outputs may be its inputs.
struct OptimizerTable {
  static constexpr int Slots = 32;
  int count = 0;
  const void *w[Slots], *g[Slots], *m[Slots], *v[Slots];
  void *wOut[Slots], *mOut[Slots], *vOut[Slots];
  int64_t n[Slots];
  double decayCenter[Slots];
};

/// One optimizer update of every slot of \p table (F32 or F64, all of
/// \p type), adding the squares of the new weights and second moments
/// into \p squares (one double).
cudaError_t launchOptimizer(Scalar type, const OptimizerParams &p, const OptimizerTable &table,
                            double *squares, cudaStream_t stream);

} // namespace pipec::cuda

#endif // PIPEC_RUNTIME_CUDA_CUDAKERNELS_H
