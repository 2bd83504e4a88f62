//===- GradRules.h - The gradient rules of Ops.def's GRAD column ---------===//
//
// One rule per GRAD token of ops/Ops.def, defined by family:
//   ElementwiseGrads.cpp  unary, add, sub, mul, div, pow, maxMin, sum, clip,
//                         where
//   ShapeGrads.cpp        identity, cast, reshape, transpose, expand,
//                         concat, split, slice, gather, resize
//   LinearGrads.cpp       matMul, gemm
//   NormGrads.cpp         reduceSumMean, softmax, softmaxCrossEntropyLoss,
//                         layerNormalization, batchNormalization,
//                         rmsNormalization, instanceNormalization,
//                         groupNormalization
//   ConvGrads.cpp         conv, convTranspose, pool, globalAveragePool
//   IndexingGrads.cpp     trilu, cumSum, gatherElements, gatherND, scatterND,
//                         scatterElements, topK, pad
//   EinsumGrads.cpp       einsum
//   AttentionGrads.cpp    scaledDotProductAttention
// and two that are not rules: `none` (no gradient flows through the op)
// and `missing` (the op is differentiable but pipec has no rule: an error
// naming the node). An op without a row of Ops.def is `missing`.
//
// A rule runs once per op whose output gradient is needed and some of whose
// inputs want one; it emits their contributions through the GradContext.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GRAD_GRADRULES_H
#define PIPEC_PASSES_GRAD_GRADRULES_H

#include "passes/grad/GradContext.h"

namespace pipec::grad {

/// Every input carries a gradient (the default of GradRule::carries).
inline bool everyInput(size_t) { return true; }

struct GradRule {
  /// Emits the contributions of ctx.op() to the gradients of its wanted
  /// inputs.
  llvm::Error (*apply)(GradContext &ctx);
  /// False for the inputs that get no gradient by definition, whatever
  /// they are computed from (BatchNormalization's running statistics).
  bool (*carries)(size_t input) = everyInput;
  /// The rule reads the gradient of every output (Split); the others read
  /// output 0's only, and differentiate refuses a gradient of another.
  bool allOutputs = false;
  /// For ops that keep running statistics (BatchNormalization in training
  /// mode): emits, into the op's layer's W list, each microbatch's
  /// statistic of every running buffer and records it with
  /// GradContext::updateRunning. Runs for every such op, whether or not a
  /// gradient flows through it; null for the others.
  llvm::Error (*statistics)(GradContext &ctx) = nullptr;
};

/// The rule of row \p def of Ops.def; `missing` for null.
const GradRule &gradRuleOf(const OpDef *def);

/// The rule of a gather (Gather, GatherElements, GatherND): only the data,
/// input 0, gets a gradient, pipec op \p gradOp of dY and the indices with
/// the forward node's int attribute \p attr (0 where absent) and the
/// data's shape as attribute 'shape'. Defined in IndexingGrads.cpp.
llvm::Error gatheredDataGrad(GradContext &ctx, llvm::StringRef gradOp, llvm::StringRef attr);

namespace rules {
extern const GradRule none, missing;
// ElementwiseGrads.cpp
extern const GradRule unary, add, sub, mul, div, pow, maxMin, sum, clip, where;
// ShapeGrads.cpp
extern const GradRule identity, cast, reshape, transpose, expand, concat, split, slice, gather,
    resize, tpCopy, tpAllReduce, tpGather, tpAllGather, tpGatherCopy, tpReduceScatter, tpScatter;
// LinearGrads.cpp
extern const GradRule matMul, gemm;
// NormGrads.cpp
extern const GradRule reduceSumMean, softmax, softmaxCrossEntropyLoss, tpSoftmaxCrossEntropyLoss,
    layerNormalization, batchNormalization, rmsNormalization, instanceNormalization,
    groupNormalization;
// ConvGrads.cpp
extern const GradRule conv, convTranspose, pool, globalAveragePool;
// IndexingGrads.cpp
extern const GradRule trilu, cumSum, gatherElements, gatherND, scatterND, scatterElements, topK,
    pad;
// EinsumGrads.cpp
extern const GradRule einsum;
// AttentionGrads.cpp
extern const GradRule scaledDotProductAttention;
} // namespace rules

} // namespace pipec::grad

#endif // PIPEC_PASSES_GRAD_GRADRULES_H
