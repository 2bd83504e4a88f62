//===- SelectRecompute.h - What RECOMPUTE reruns, decided at compile -----===//
//
// A stage that recomputes drops its `recompute` values after FORWARD and
// rebuilds them before its backward. This pass walks from those values back
// through the forward nodes that make them to what stays: values FORWARD
// keeps, weights and load_nodes' outputs, and the stage's inputs. It writes
// the nodes to rerun (in forward order) to the stage program's `rerun`, and
// what FORWARD keeps in their stead to `keep_when_recomputing`: the rest of
// keep and the values the rerun reads that nothing on the stage makes.
//
// Before:  keep [h1, a1, h2], recompute [a1, h2];
//          forward: a1 = Relu(h1); h2 = MatMul(a1, w)
// After:   rerun: a1 = Relu(h1); h2 = MatMul(a1, w)
//          keep_when_recomputing [h1]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_SELECTRECOMPUTE_H
#define PIPEC_PASSES_SELECTRECOMPUTE_H

#include "plan/plan.pb.h"

#include <cstdint>

namespace pipec {

/// Fills \p sp's rerun and keep_when_recomputing from its recompute list;
/// returns the number of nodes to rerun (0 without recompute).
int64_t selectRecompute(plan::StageProgram &sp);

} // namespace pipec

#endif // PIPEC_PASSES_SELECTRECOMPUTE_H
