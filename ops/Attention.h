//===- Attention.h - pipec.ScaledDotProductAttention and its gradient ----===//
//
// Attention's two products and softmax as one node in training, made by
// fuse-attention (passes/FuseAttention.h) from the nodes an exporter writes
// scaled_dot_product_attention out as, so that the backward keeps Q, K^T,
// V, O and a row statistic instead of the [.., m, n] probabilities:
//
//   O, L = ScaledDotProductAttention(Q, Kt, V, T_1, .., T_t)
//     S = Q Kt                          Q [.., m, k], Kt [.., k, n]
//     S = step_1(S), .., step_s(S)      the score steps below, in order
//     P = softmax(S) over the last axis
//     P = P where P is not NaN, else `guard`   (only when `guarded` is 1)
//     O = P V                           V [.., n, d], O [.., m, d]
//     L = log(sum(exp(S))) over the last axis, [.., m, 1]: on a row that
//         every step masked to -inf, -inf (the CPU's kernel) or NaN (the
//         body of runtime/core/AttentionBody.h); its P is NaN either way
//
//   dQ, dKt, dV = ScaledDotProductAttentionGrad(dO, Q, Kt, V, O, L,
//                                               T_1, .., T_t)
//     with the forward node's attributes; P = exp(S - L) from the recomputed
//     S, dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)) (0 on a row
//     whose P is NaN), back through the steps, dQ = dS Kt^T, dKt = Q^T dS.
//
// Q, Kt and V have the same leading (batch, head) dimensions, but for
// grouped-query attention (`groups` > 1): Kt's and V's last leading
// dimension (the heads) is Q's / groups, and Q's head h reads their head
// h / groups (as Llama's repeat_kv repeats them); the gradient sums a
// key/value head's dKt and dV over its group. Every tensor T broadcasts to
// the scores [.., m, n]. Float32 (or the bf16 of an autocast plan, O and
// the gradients in their inputs' type, L float32); T of a Keep or Drop
// step is bool.
//
// Attributes: steps (ints, ScoreStep per step), scalars (floats, one per
// step: the Scale's or Divide's c, the Keep's or Drop's fill; 0 for Add),
// guarded (int), guard (float), groups (int, 1 when absent). A step that reads a tensor reads the
// next of T_1, .., T_t.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_ATTENTION_H
#define PIPEC_OPS_ATTENTION_H

#include "llvm/ADT/StringRef.h"

#include <cstdint>

namespace pipec::attention {

inline constexpr llvm::StringLiteral OpType = "ScaledDotProductAttention";
inline constexpr llvm::StringLiteral GradOpType = "ScaledDotProductAttentionGrad";

/// The forward node's inputs; its step tensors follow from FirstTensor.
enum Input : int { Query, KeysT, Values, FirstTensor };
/// The forward node's outputs.
enum Output : int { Out, LogSumExp };
/// The gradient node's inputs; its step tensors follow from GradFirstTensor.
enum GradInput : int {
  GradOut,
  GradQuery,
  GradKeysT,
  GradValues,
  GradForwardOut,
  GradLogSumExp,
  GradFirstTensor
};

/// One step of the scores between the product and the softmax.
enum class ScoreStep : int64_t {
  Scale,  ///< S * c (Mul by a scalar)
  Divide, ///< S / c (Div by a scalar)
  Add,    ///< S + T (an additive mask or bias)
  Keep,   ///< T ? S : c (Where(T, S, c): a causal mask)
  Drop,   ///< T ? c : S (Where(T, c, S): masked_fill); the last
};
inline constexpr int64_t ScoreSteps = static_cast<int64_t>(ScoreStep::Drop) + 1;

/// Whether \p step reads the next step tensor.
inline bool readsTensor(ScoreStep step) { return step >= ScoreStep::Add; }

} // namespace pipec::attention

#endif // PIPEC_OPS_ATTENTION_H
