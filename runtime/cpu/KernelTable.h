//===- KernelTable.h - Every CPU kernel that Ops.def's CPU column names ---===//
//
// The kernels of runtime/cpu, declared for the one table that maps each
// row of ops/Ops.def to its CPU kernel (Kernels.cpp). Each takes the node
// through an OpContext whose required inputs the table has checked, and
// returns one tensor per output. Internal to runtime/cpu.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_KERNELTABLE_H
#define PIPEC_RUNTIME_CPU_KERNELTABLE_H

#include "runtime/core/OpContext.h"

#include "llvm/Support/Error.h"

#include <vector>

namespace pipec::cpu {

using KernelResult = llvm::Expected<std::vector<Tensor>>;

enum class ReduceKind { Sum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare };

/// No CPU kernel: an UnsupportedError that names the op.
KernelResult none(const OpContext &ctx);

// Element-wise (ElementwiseKernels.{h,cpp}; the math ones are templates
// there).
KernelResult cast(const OpContext &ctx);
KernelResult castLike(const OpContext &ctx);
KernelResult clip(const OpContext &ctx);
KernelResult mean(const OpContext &ctx);
KernelResult prelu(const OpContext &ctx);
KernelResult where(const OpContext &ctx);

// Data movement (MovementKernels.cpp).
KernelResult concat(const OpContext &ctx);
KernelResult constant(const OpContext &ctx);
KernelResult constantOfShape(const OpContext &ctx);
KernelResult dropout(const OpContext &ctx);
KernelResult expand(const OpContext &ctx);
KernelResult flatten(const OpContext &ctx);
KernelResult gather(const OpContext &ctx);
KernelResult identity(const OpContext &ctx);
KernelResult range(const OpContext &ctx);
KernelResult reshape(const OpContext &ctx);
KernelResult shapeOp(const OpContext &ctx);
KernelResult size(const OpContext &ctx);
KernelResult slice(const OpContext &ctx);
KernelResult split(const OpContext &ctx);
KernelResult squeeze(const OpContext &ctx);
KernelResult tile(const OpContext &ctx);
KernelResult transposeOp(const OpContext &ctx);
KernelResult unsqueeze(const OpContext &ctx);

// Indexing, scattering, padding and scans (IndexingKernels.cpp).
KernelResult cumProd(const OpContext &ctx);
KernelResult cumSum(const OpContext &ctx);
KernelResult gatherElements(const OpContext &ctx);
KernelResult gatherND(const OpContext &ctx);
KernelResult pad(const OpContext &ctx);
KernelResult scatterElements(const OpContext &ctx);
KernelResult scatterND(const OpContext &ctx);
KernelResult topK(const OpContext &ctx);
KernelResult trilu(const OpContext &ctx);

// If, Loop and Scan: a subgraph interpreter (ControlFlowKernels.cpp).
KernelResult ifOp(const OpContext &ctx);
KernelResult loop(const OpContext &ctx);
KernelResult scan(const OpContext &ctx);

// Einsum (EinsumKernels.cpp).
KernelResult einsum(const OpContext &ctx);

// Products, convolution, pooling (MatrixKernels.cpp).
KernelResult conv(const OpContext &ctx);
KernelResult gemmOp(const OpContext &ctx);
KernelResult matMul(const OpContext &ctx);
template <bool IsMax> KernelResult globalPool(const OpContext &ctx);
template <bool IsMax> KernelResult pool(const OpContext &ctx);

// Softmax, normalization, reductions, losses (NormKernels.cpp).
KernelResult batchNormalization(const OpContext &ctx);
KernelResult layerNormalization(const OpContext &ctx);
KernelResult negativeLogLikelihoodLoss(const OpContext &ctx);
KernelResult softmaxCrossEntropy(const OpContext &ctx);
template <bool IsMax> KernelResult argExtreme(const OpContext &ctx);
template <ReduceKind Kind> KernelResult reduce(const OpContext &ctx);
template <bool Logarithm> KernelResult softmax(const OpContext &ctx);

// Normalizations, LpPool, Det, SwiGLU, BitCast (NumericKernels.cpp).
KernelResult bitCast(const OpContext &ctx);
KernelResult det(const OpContext &ctx);
KernelResult groupNormalization(const OpContext &ctx);
KernelResult instanceNormalization(const OpContext &ctx);
KernelResult lpNormalization(const OpContext &ctx);
KernelResult lpPool(const OpContext &ctx);
KernelResult lrn(const OpContext &ctx);
KernelResult rmsNormalization(const OpContext &ctx);
KernelResult swiGlu(const OpContext &ctx);

// Quantization and integer products (QuantKernels.cpp).
KernelResult convInteger(const OpContext &ctx);
KernelResult dequantizeLinear(const OpContext &ctx);
KernelResult dynamicQuantizeLinear(const OpContext &ctx);
KernelResult matMulInteger(const OpContext &ctx);
KernelResult qLinearConv(const OpContext &ctx);
KernelResult qLinearMatMul(const OpContext &ctx);
KernelResult quantizeLinear(const OpContext &ctx);

// Resampling (ResizeKernels.cpp, GridKernels.cpp).
KernelResult affineGrid(const OpContext &ctx);
KernelResult gridSample(const OpContext &ctx);
KernelResult resize(const OpContext &ctx);
KernelResult resizeGrad(const OpContext &ctx);
KernelResult upsample(const OpContext &ctx);

// Transposed, folded and deformable convolution, unpooling
// (SpatialKernels.cpp); detection heads (DetectionKernels.cpp).
KernelResult col2Im(const OpContext &ctx);
KernelResult convTranspose(const OpContext &ctx);
KernelResult deformConv(const OpContext &ctx);
KernelResult maxUnpool(const OpContext &ctx);
KernelResult nonMaxSuppression(const OpContext &ctx);
KernelResult roiAlign(const OpContext &ctx);

// Transformer ops of the default domain (AttentionKernels.cpp).
KernelResult causalConvWithState(const OpContext &ctx);
KernelResult linearAttention(const OpContext &ctx);
KernelResult onnxAttention(const OpContext &ctx);
KernelResult onnxRotaryEmbedding(const OpContext &ctx);

// onnxruntime's contrib ops (ContribKernels.cpp).
KernelResult attention(const OpContext &ctx);
KernelResult embedLayerNormalization(const OpContext &ctx);
KernelResult fastGelu(const OpContext &ctx);
KernelResult groupQueryAttention(const OpContext &ctx); // GroupQueryAttention.cpp
KernelResult multiHeadAttention(const OpContext &ctx);
KernelResult rotaryEmbedding(const OpContext &ctx);
KernelResult simplifiedLayerNormalization(const OpContext &ctx);
template <bool Simplified> KernelResult skipLayerNormalization(const OpContext &ctx);

// pipec's gradient ops (GradKernels.cpp).
KernelResult averagePoolGrad(const OpContext &ctx);
KernelResult batchNormGradWeight(const OpContext &ctx);
KernelResult convGradInput(const OpContext &ctx);
KernelResult convGradWeight(const OpContext &ctx);
KernelResult crossEntropyGrad(const OpContext &ctx);
KernelResult gatherElementsGrad(const OpContext &ctx); // IndexingKernels.cpp
KernelResult gatherGrad(const OpContext &ctx);
KernelResult gatherNDGrad(const OpContext &ctx); // IndexingKernels.cpp
KernelResult layerNormGradInput(const OpContext &ctx);
KernelResult layerNormGradWeight(const OpContext &ctx);
KernelResult maxPoolGrad(const OpContext &ctx);
KernelResult softmaxGrad(const OpContext &ctx);
KernelResult sumTo(const OpContext &ctx);
KernelResult unaryGrad(const OpContext &ctx);

// Fused nodes (Fused.cpp).
KernelResult fused(const OpContext &ctx);
KernelResult matMulBias(const OpContext &ctx);
KernelResult matMulTransposed(const OpContext &ctx);
KernelResult softmaxAttention(const OpContext &ctx);
// Fused attention in training and its gradient (ScaledAttention.cpp).
KernelResult scaledDotProductAttention(const OpContext &ctx);
KernelResult scaledDotProductAttentionGrad(const OpContext &ctx);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_KERNELTABLE_H
