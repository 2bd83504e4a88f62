//===- OpFlops.h - Forward FLOPs of one op ------------------------------===//
//
// Counts multiply and add as two FLOPs (a GEMM of M x K by K x N is 2MNK).
// Elementwise ops count one FLOP per output element, transcendental ones a
// few; data movement (Reshape, Transpose, Gather, Concat) counts zero. The
// full cost model (backward, bytes moved, time) builds on these counts.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_OPFLOPS_H
#define PIPEC_COMPILER_COST_OPFLOPS_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Forward FLOPs of \p op; precondition: shapes are inferred.
int64_t forwardFlops(const Graph &graph, const Op &op);

/// True if the op moves data only (its FLOP count is zero by definition).
bool isDataMovementOp(const Op &op);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_OPFLOPS_H
