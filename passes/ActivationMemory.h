//===- ActivationMemory.h - What a layer holds while it runs ------------===//
//
// The runtime drops every value after its last reader and keeps, from a
// training forward, only what the backward reads (RankExecutor::dropsFor,
// docs/PLAN_FORMAT.md). The memory model follows it, per layer of a cost
// table:
//  - activationBytes: the bytes of the forward values the layer makes that
//    any backward node reads (the stage program's `keep`); none in inference.
//    Each microbatch in flight holds them.
//  - workingBytes: the most its run holds at once beyond that, one
//    microbatch at a time. Forward: each value it makes that is not kept,
//    from its producer to its last reader in the layer (to the layer's end
//    when a later layer or the graph's outputs read it), with the inputs
//    from earlier layers that are not kept. Backward, walked from the last
//    op to the first: the gradient of each value, from the backward of its
//    last reader (before the layer's, when a later layer reads it) to that
//    of its producer, one copy per reader whose contribution waits for the
//    sum, and each weight-gradient term at its op. The backward's own
//    temporaries have no static shape at compile time; the gradients of the
//    forward values stand for them.
//  - derivedWeightBytes: the weights the layer derives from float weights
//    (autocast's bf16 copies, a tied head's Transpose). The fold-weights
//    pass makes them once per optimizer step, so the stage holds one copy
//    whatever the microbatches in flight.
// A rank then holds its weights and their state, its derived weights, the
// kept bytes of the microbatches in flight, and its chunks' working bytes.
//
// Before: layer 1: Z = MatMul(H, W2); S = Softmax(Z); loss = CE(S, labels)
//         (activationBytes = |Z| + |S| + |loss|, workingBytes = 0)
// After:  activationBytes = |S| (SoftmaxGrad reads S; nothing reads Z)
//         workingBytes = max(|Z| forward, |grad:S| + |grad:Z| + |W2| backward)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_ACTIVATIONMEMORY_H
#define PIPEC_PASSES_ACTIVATIONMEMORY_H

#include "compiler/cost/CostModel.h"
#include "passes/Differentiate.h"

namespace pipec {

/// Sets every layer's activationBytes, workingBytes and derivedWeightBytes
/// in \p table (made by
/// computeCosts for \p layers) at the table's precision. \p backward is the
/// differentiated program; null in inference.
void countActivationMemory(CostTable &table, const LayerGraph &layers, const Backward *backward);

} // namespace pipec

#endif // PIPEC_PASSES_ACTIVATIONMEMORY_H
