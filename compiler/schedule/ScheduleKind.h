//===- ScheduleKind.h - Pipeline schedules and their placements ---------===//
//
// The schedules pipec knows, how chunks are placed on ranks and which
// (P, V, M) each accepts. The generators that produce per-rank action orders,
// and the activations those orders hold, live in Schedule.h.
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

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H
