//===- GroupLayers.h - group-layers: from an op DAG to a chain of layers ===//
//
// Orders the ops and cuts them into layers. The evidence, in order:
//  1. module paths in node names (torch `/model/layers.3/mlp/...`, keras
//     `bert/encoder/layer_11/...`) or, where nodes are unnamed, in the names
//     of the weights they read (`gpu_0/res2_0_branch2a_w_0`): the numbered
//     path prefix with the most instances that covers the model's ops gives
//     the blocks;
//  2. repeated structure: the longest run of a repeating sequence of op
//     types gives the blocks;
//  3. cut analysis alone: the positions where the fewest bytes are live.
// Within the room the evidence leaves, each boundary goes where the fewest
// bytes cross (cut analysis), so that a boundary carries the hidden state and
// not three projections of it. Ops before the first block form the embedding
// (or a stem), ops after the last the head, and a trailing loss its own layer
// (with the Casts only it reads: the logits widened for it).
// Ops that only compute constants join the first layer that reads them.
//
// Before:  124 ops: /model/embed_tokens/Gather, /model/layers.0/..., ...,
//          /model/layers.1/..., /model/norm/..., /lm_head/MatMul
// After:   layer 0 "embedding", 1 "/model/layers.0", 2 "/model/layers.1",
//          3 "head", with the hidden state crossing each boundary
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GROUPLAYERS_H
#define PIPEC_PASSES_GROUPLAYERS_H

#include "compiler/ir/LayerGraph.h"

namespace pipec {

/// Groups \p graph (after infer-shapes) into layers. The result refers to
/// \p graph, which must outlive it.
llvm::Expected<LayerGraph> groupLayers(const Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_GROUPLAYERS_H
