//===- VerifyDataflow.h - Every value a stage reads is delivered ---------===//
//
// verify-program's second half, run once the stage programs are cut: the
// instruction streams are known to match and not to deadlock
// (verifyProgram); this proves that the data reaches the programs. Every
// value a stage's forward nodes read is computed earlier on the stage,
// loaded, a weight, or received; every received value is one the previous
// stage sends; and on every rank, each forward that needs a value from
// another rank has a RECV of it before it. A plan that fails this is refused
// at compile time rather than at `pipec run`.
//
// Before:  stage 1 reads /layers.0/rotary_table, made on stage 0 and not in
//          stage 0's send list
// After:   verify-program: stage 1: forward node 'mul' (Mul) reads
//          '/layers.0/rotary_table', which no instruction delivers to it
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_VERIFYDATAFLOW_H
#define PIPEC_PASSES_VERIFYDATAFLOW_H

#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"

namespace pipec {

/// Checks \p plan's stage programs against its instruction streams; an
/// error naming the stage, node and value, or the rank and instruction.
llvm::Error verifyDataflow(const plan::Plan &plan);

/// Every node of \p plan's stage programs (and of their subgraphs) has a
/// kernel to run it; an error naming the stage, node and op.
llvm::Error verifyKernels(const plan::Plan &plan);

} // namespace pipec

#endif // PIPEC_PASSES_VERIFYDATAFLOW_H
