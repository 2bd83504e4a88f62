//===- FoldWeights.h - Nodes of weights alone run once per weight update -===//
//
// A step would compute again, every microbatch, the forward nodes that read
// weights alone: a tied LM head's Transpose of a 50k-row table, a scale
// folded into a weight, autocast's bf16 copy of a weight. This pass moves
// them from each stage program's forward to its load_nodes, which `pipec
// run` and `pipec generate` run when they load the weights and, in
// training, again after every optimizer step, holding the outputs as
// weights: one copy a step, as torch.autocast's weight cast cache and
// Megatron-LM's bf16 parameters beside float32 masters. The backward reads
// that copy instead of one kept per microbatch, so the moved outputs leave
// the stage's keep and recompute lists. A node whose output leaves the
// stage (sent, or a graph output), one that draws random numbers (Dropout),
// a collective over the tensor-parallel ranks (which the executor runs in
// step with the other ranks), one of no Ops.def row, and one without inputs
// stay.
//
// Before:  forward: t = Transpose(wte); logits = MatMul(h, t)
//          keep: [t, h]
// After:   load_nodes: t = Transpose(wte)
//          forward: logits = MatMul(h, t)
//          keep: [h]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_FOLDWEIGHTS_H
#define PIPEC_PASSES_FOLDWEIGHTS_H

#include "plan/plan.pb.h"

#include <cstdint>

namespace pipec {

/// Moves the weight-only forward nodes of \p sp (at default-domain \p opset)
/// to its load_nodes, and their outputs out of its keep and recompute lists;
/// returns how many moved.
int64_t foldWeightNodes(plan::StageProgram &sp, int64_t opset);

} // namespace pipec

#endif // PIPEC_PASSES_FOLDWEIGHTS_H
