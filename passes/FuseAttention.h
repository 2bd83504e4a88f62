//===- FuseAttention.h - fuse-attention: attention as one node in training ===//
//
// In a training compile, replaces each attention an exporter wrote out
// (torch.onnx's decomposition of scaled_dot_product_attention, an eager
// model's matmul-softmax-matmul) by one pipec.ScaledDotProductAttention
// (ops/Attention.h), whose gradient rule recomputes the scores: the step
// keeps Q, K^T, V, O and one float per row instead of the [.., m, n]
// scores and probabilities, and the memory model counts it so.
//
// Matched: S = MatMul(Q, Kt), then any of Mul or Div by a float scalar,
// Add of a tensor that takes no gradient (a mask), Where(bool, S, c) or
// Where(bool, c, S), in any order; Softmax over the last axis (opset 13 or
// later); torch's NaN guard Where(IsNaN(P), c, P); Casts to float32 of a
// float32; O = MatMul(P, V). Every value between is float32, has the
// scores' shape, is read by the next node alone (P by the guard's two) and
// is no graph output; Q, Kt and V have the same leading dimensions.
// Grouped-query attention: where K and V reach the products through
// repeat_kv (Unsqueeze at 2, Expand, Reshape merging the key/value heads
// and their repeats, with the batch too in torch.onnx's dynamo export; for
// K a swap of its last two axes and a scalar scale after), the node reads
// the heads before the repeat, K as a new Transpose, with `groups` the
// repeats and the scale as its first step: the step keeps 1 / groups of
// the repeated K and V, and the repeats are not computed. A mask
// computed from a trained weight (T5's relative position bias) keeps its
// nodes: its gradient needs the scores' gradient whole.
//
// Not run in inference (the fuse pass makes SoftmaxAttention there, which
// also reads a KV cache) nor with --attention unfused.
//
// Before:  S = MatMul(Q, Kt); Z = Add(S, mask); P = Softmax(Z, axis=-1);
//          W = Where(IsNaN(P), 0, P); O = MatMul(W, V)
// After:   O, O.logsumexp = pipec.ScaledDotProductAttention(Q, Kt, V, mask,
//              steps=[Add], scalars=[0], guarded=1, guard=0)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_FUSEATTENTION_H
#define PIPEC_PASSES_FUSEATTENTION_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Returns whether any attention was fused.
llvm::Expected<bool> fuseAttention(Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_FUSEATTENTION_H
