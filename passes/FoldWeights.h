//===- FoldWeights.h - Nodes of weights alone run once, at load ----------===//
//
// An inference step would compute again, every step, the forward nodes that
// read weights alone: a tied LM head's Transpose of a 50k-row table, a scale
// folded into a weight. This pass moves them from each stage program's
// forward to its load_nodes, which `pipec run` and `pipec generate` run once
// when they load the weights, holding the outputs as weights. A node whose
// output leaves the stage (sent, or a graph output), one that draws random
// numbers (Dropout), one of no Ops.def row, and one without inputs stay.
// Training keeps them: its weights change every step.
//
// Before:  forward: t = Transpose(wte); logits = MatMul(h, t)
// After:   load_nodes: t = Transpose(wte)
//          forward: logits = MatMul(h, t)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_FOLDWEIGHTS_H
#define PIPEC_PASSES_FOLDWEIGHTS_H

#include "plan/plan.pb.h"

#include <cstdint>

namespace pipec {

/// Moves the weight-only forward nodes of \p sp (at default-domain \p opset)
/// to its load_nodes; returns how many moved.
int64_t foldWeightNodes(plan::StageProgram &sp, int64_t opset);

} // namespace pipec

#endif // PIPEC_PASSES_FOLDWEIGHTS_H
