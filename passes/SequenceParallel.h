//===- SequenceParallel.h - --sequence-parallel: the rest split on tokens -===//
//
// With --sequence-parallel, after shard-tensors has split the matrix
// products over T ranks, what it left replicated between them (the residual
// stream, the norms and the element-wise math on it) is split on the
// sequence over the same T ranks, as Megatron-LM does (Korthikanti et al.,
// "Reducing Activation Recomputation in Large Transformer Models", 2022):
//  - a row-split product's sum becomes a reduce-scatter to each rank's
//    tokens (TpReduceScatter, whose gradient all-gathers);
//  - the activation the column-split products read (TpCopy) is all-gathered
//    from the ranks' tokens instead (TpGatherCopy, whose gradient
//    reduce-scatters the ranks' partial gradients);
//  - a replicated value that meets the tokens (the vocabulary lookup's sum,
//    a position embedding) is cut to this rank's tokens where it is read
//    (TpScatter, whose gradient all-gathers);
//  - an op no SHARD rule carries the tokens through (a pooler reading one
//    token) reads them gathered whole (TpAllGather) and computes replicated;
//  - the weights the split ops read (a norm's scale, a bias added after the
//    sum) see this rank's tokens alone: Graph::sequenceGrads lists them, and
//    a run sums their gradients over the T ranks before the optimizer.
// The sequence axis is found by structure: the token ids [B, S] a
// vocabulary lookup reads give B and S; a value [B, S, ...] splits axis 1,
// one of [B * S, ...] axis 0 as B blocks. A sequence that does not divide
// over T is an error naming the lookup.
//
// Before (T = 2): s = TpAllReduce(o[2, 16, 64]); h = Add(x, s);
//                 n = LayerNormalization(h, g, b); c = TpCopy(n)
// After:          s = TpReduceScatter(o)[2, 8, 64]; h = Add(x[2, 8, 64], s);
//                 n = LayerNormalization(h, g, b); c = TpGatherCopy(n)[2, 16, 64]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_SEQUENCEPARALLEL_H
#define PIPEC_PASSES_SEQUENCEPARALLEL_H

#include "compiler/ir/Graph.h"

#include <set>

namespace pipec {

/// Splits the sequence of \p graph (shard-tensors' output, its ops in order,
/// uses rebuilt) as above. \p splitValues holds the values shard-tensors
/// split, whose ops read the tokens whole; the values split on the sequence
/// join it, and all their shapes are then inferred again.
llvm::Error splitSequence(Graph &graph, std::set<int> &splitValues);

} // namespace pipec

#endif // PIPEC_PASSES_SEQUENCEPARALLEL_H
