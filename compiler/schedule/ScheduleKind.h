//===- ScheduleKind.h - Pipeline schedules and their placements ---------===//
//
// The schedules pipec knows, how chunks are placed on ranks, and how many
// microbatches of activations each rank holds at its peak. The generators
// that produce per-rank action orders live beside this file; these facts are
// what the cost model and balance-stages need before a schedule exists.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H
#define PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace pipec {

enum class ScheduleKind { GPipe, OneFOneB, Interleaved, ZBH1, ZBH2, ZBV, DualPipeV, ForwardOnly };

/// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev",
/// "forward"; the error lists the names.
llvm::Expected<ScheduleKind> parseSchedule(llvm::StringRef name);
llvm::StringRef scheduleName(ScheduleKind kind);

/// V-shaped placement (ZB-V, DualPipeV): rank r holds chunks r and 2P-1-r.
bool isVShaped(ScheduleKind kind);
/// True when backward is split into I (inputs) and W (weights).
bool splitsBackward(ScheduleKind kind);

/// The rank that runs global chunk \p chunk of P x V chunks: chunk mod P for
/// looped placement, the V shape for ZB-V and DualPipeV.
int rankOfChunk(ScheduleKind kind, int stages, int virtualStages, int chunk);

/// Checks (P, V, M) against what the schedule accepts, as PyTorch's
/// torch.distributed.pipelining and DualPipe do; the error says why.
llvm::Error checkScheduleShape(ScheduleKind kind, int stages, int virtualStages, int microbatches);

/// Microbatches of one chunk's activations that rank \p rank keeps alive at
/// its peak, summed over its chunks, as the generated orders hold them:
///   GPipe M; 1F1B and ZB-H1 min(M, P - r); ZB-H2 min(M, 2(P - r) - 1);
///   interleaved 1F1B min(V M, (V - 1) n + 2 (P - 1 - r) + 1) with n = M / R
///   microbatches per round (PyTorch's warm-up count plus the one in steady
///   state); ZB-V min(V M, 2P), the same bytes as 1F1B's P full stages
///   (Qi et al., 2024); DualPipeV min(V M, 2P + 1), within DeepSeek's P + 1
///   full stages; forward-only 1.
int64_t inFlightActivations(ScheduleKind kind, int stages, int virtualStages, int microbatches,
                            int rank);

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H
