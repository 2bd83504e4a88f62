//===- SearchParallel.h - --parallel auto: T, P, D and M for a cluster ---===//
//
// `pipec compile --parallel auto --gpus N [--gpus-per-node G] --batch B`
// chooses how N devices run a model: T tensor-parallel ranks inside a node
// (T divides G), P pipeline stages, D = N / (T P) data-parallel replicas,
// M microbatches of b samples (B = D M b), and the schedule with its V.
//
// For each T the front half is prepared once per microbatch size b in
// {1, 2, 4} (import, shard-tensors at T, group-layers, differentiate, the
// costs). Then each (T, P, D, b):
//   1. is pruned on memory first, before any balancing: some rank of the P
//      holds at least 1/P of one tensor-parallel rank's weights, gradients
//      and optimizer state (divided over D with --shard-optimizer), so when
//      that share is over the memory limit every partition is;
//   2. is judged for each schedule --schedule names (auto, the default
//      here: every row Schedules.def marks for it, at its V) as
//      --schedule auto judges: balance-stages' exact search, then the step
//      and memory peaks the simulator's engine predicts (StepPredictor).
// The winner is the least predicted step among the candidates whose every
// rank fits its memory. It is compiled as `--tp T --stages P --dp D
// --microbatches M --schedule S --virtual-stages V` compiles, so the plan is
// the one those flags give; its parallel_search says what was tried, what
// pruned each candidate and why each lost. Those of --tp, --stages, --dp and
// --microbatches given beside --parallel auto stay fixed.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_SEARCHPARALLEL_H
#define PIPEC_DRIVER_SEARCHPARALLEL_H

#include "driver/Compile.h"

namespace pipec {

/// --parallel auto for \p options.parallel.gpus devices. Errors: no global
/// batch, a hardware or memory limit given per rank, and no candidate that
/// fits (the error names the one that came closest and by how much).
llvm::Expected<plan::Plan> searchParallel(llvm::StringRef modelPath, const CompileOptions &options,
                                          const PipelineOptions &pipeline);

} // namespace pipec

#endif // PIPEC_DRIVER_SEARCHPARALLEL_H
