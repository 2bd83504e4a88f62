//===- ShardTensors.h - shard-tensors: tensor parallelism by structure ---===//
//
// With `--tp T`, splits the matrix products of each stage over T ranks the
// way Megatron-LM does (Shoeybi et al., 2019), found by structure in any
// export and with its own names:
//  - the products that read one replicated activation with a 2-D weight
//    (attention's Q, K and V, or a fused QKV; the MLP's up and gate) split
//    their weights' columns: each rank computes its heads, its part of the
//    hidden width;
//  - what follows carries the split, op by op, through the rules of Ops.def's
//    SHARD column (element-wise math, reshapes into and out of heads,
//    transposes, the attention products, softmax, rotary halves, repeated
//    key/value heads);
//  - the product that contracts the split axis with a weight (attention's
//    output projection, the MLP's down projection) splits that weight's rows
//    and makes a partial sum on every rank;
//  - the vocabulary: an embedding's lookup splits its table's rows
//    (TpGather), a head its columns, its cross-entropy then
//    vocabulary-parallel (TpSoftmaxCrossEntropyLoss); a tied head and its
//    table split alike or not at all (a folded tie too, which tie-weights
//    reties piece by piece); a split graph output is gathered whole under
//    its own name (TpAllGather).
// The pass reads the replicated activation through TpCopy (identity; its
// gradient sums the ranks') and the partial sums through TpAllReduce (sums
// the ranks'; its gradient is the identity): Megatron's f and g. A region
// that meets an op without a rule for its split or a value read twice in
// two layouts stays replicated (a warning says where); an axis of heads
// that does not divide over T is an error naming its node.
//
// The Graph is then one rank's: split weights and values have their pieces'
// shapes (inferred again), reshape targets and split sizes are rewritten,
// and Graph::shards says how each split weight is cut from the model's
// tensor. FLOPs, weights and activations downstream are one rank's.
//
// Before (T = 2): q = MatMul(x, Wq[64, 64]); r = Reshape(q, [2, 16, 4, 16])
//                 ... o = MatMul(a[2, 16, 64], Wo[64, 64]); y = Add(o, b)
// After:          x' = TpCopy(x); q = MatMul(x', Wq[64, 32]);
//                 r = Reshape(q, [2, 16, 2, 16]) ... o = MatMul(a[2, 16, 32],
//                 Wo[32, 64]); o' = TpAllReduce(o); y = Add(o', b)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_SHARDTENSORS_H
#define PIPEC_PASSES_SHARDTENSORS_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Splits \p graph over its tensorParallel ranks; returns whether it changed
/// it (never with T = 1).
llvm::Expected<bool> shardTensors(Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_SHARDTENSORS_H
