//===- StagePasses.h - The passes over the stage programs ----------------===//
//
// The last rows of Passes.def, run on the stage programs once they are cut,
// so that the plan is the program `pipec run` executes and `pipec report`
// shows it:
//   fuse              element-wise chains, bias adds, transposed weights
//                     and attention become fused nodes
//                     (runtime/exec/Fusion.h); the plan's `fusion` counts
//                     them. Skipped with --no-fuse, and for --mode
//                     generate, whose decode step runs as written.
//   fold-weights      nodes of weights alone run once at load and, in
//                     training, after each optimizer step
//                     (passes/FoldWeights.h)
//   select-recompute  training with recompute: the nodes RECOMPUTE reruns
//                     (passes/SelectRecompute.h)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_STAGEPASSES_H
#define PIPEC_DRIVER_STAGEPASSES_H

#include "compiler/ir/Graph.h"
#include "driver/PassPipeline.h"
#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <string>

namespace pipec {

/// Runs the fuse pass on \p plan's stage programs through \p runner, a
/// generation plan's decode step too, and prices what it made: each
/// stage's times less what its fused nodes save (bytes of the values
/// between their nodes at the memory bandwidth, and launches; \p graph
/// sizes the values), the step simulated again. It is skipped when \p fuse
/// is false (--no-fuse).
llvm::Error fuseStagePrograms(plan::Plan &plan, const Graph &graph, bool fuse, PassRunner &runner);

/// Runs fold-weights and select-recompute (training) on
/// \p plan's stage programs through \p runner.
llvm::Error foldAndSelectRecompute(plan::Plan &plan, PassRunner &runner);

/// Says through \p runner that the three passes do not run, because \p why.
llvm::Error skipStagePasses(llvm::StringRef why, PassRunner &runner);

/// "N element-wise nodes into K kernels, B bias adds, ...".
std::string describeFusion(const plan::Fusion &fusion);

/// One line per fused node of \p plan's stage programs: stage, op, the node's
/// outputs and the ops it replaces (--print-after fuse).
void printFusedNodes(const plan::Plan &plan, llvm::raw_ostream &os);

/// One line per stage program: its fused nodes by op, and how many nodes
/// they replace (`pipec report`).
void printFusionByStage(const plan::Plan &plan, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_DRIVER_STAGEPASSES_H
