//===- FusePass.h - The fuse pass: the plan holds the fused nodes --------===//
//
// Passes.def's "fuse": each stage program's element-wise chains, bias adds,
// transposed weights and attention become fused nodes
// (runtime/exec/Fusion.h) in the plan, so the plan is the program `pipec
// run` executes and `pipec report` shows it. The plan's `fusion` counts what
// was made. Skipped with --no-fuse, and for --mode generate, whose decode
// step `pipec generate` runs as written.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_FUSEPASS_H
#define PIPEC_DRIVER_FUSEPASS_H

#include "driver/PassPipeline.h"
#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <string>

namespace pipec {

/// Runs the fuse pass on \p plan's stage programs through \p runner. It is
/// skipped when \p fuse is false (--no-fuse) and for a \p generation plan.
llvm::Error fuseStagePrograms(plan::Plan &plan, bool fuse, bool generation, PassRunner &runner);

/// "N element-wise nodes into K kernels, B bias adds, ...".
std::string describeFusion(const plan::Fusion &fusion);

/// One line per fused node of \p plan's stage programs: stage, op, the node's
/// outputs and the ops it replaces (--print-after fuse).
void printFusedNodes(const plan::Plan &plan, llvm::raw_ostream &os);

/// One line per stage program: its fused nodes by op, and how many nodes
/// they replace (`pipec report`).
void printFusionByStage(const plan::Plan &plan, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_DRIVER_FUSEPASS_H
