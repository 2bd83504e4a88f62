//===- ScheduleKind.h - Pipeline schedules and their placements ---------===//
//
// The schedules pipec knows, one row each in Schedules.def: how chunks are
// placed on ranks, which (P, V, M) each accepts, and the other facts of its
// row. The generators that produce per-rank action orders, and the
// activations those orders hold, live in Schedule.h.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H
#define PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>

namespace pipec {

enum class ScheduleKind {
#define PIPEC_SCHEDULE(ID, ...) ID,
#include "compiler/schedule/Schedules.def"
};

/// How a schedule's chunks sit on ranks.
enum class Placement {
  Looped, ///< chunk c on rank c mod P
  VShape, ///< rank r holds chunks r and 2P - 1 - r
};

/// The V a schedule takes.
enum class VirtualRule { One, TwoOrMore, Two };

/// What a schedule's backward is.
enum class BackwardKind {
  Full,  ///< one B per microbatch and chunk
  Split, ///< I (inputs) and W (weights), run apart
  None,  ///< forward only
};

/// A schedule's rule on the microbatch count M.
enum class MicrobatchRule { Any, AtLeastStages, EqualRounds, AtLeastTwiceStages };

/// The closed form of a schedule's step time: a test oracle for the
/// simulator (tests/ClosedForms.h); pipec times steps by simulation alone.
enum class StepForm { Flush, Looped, ZeroBubbleH1, ZeroBubble, DualPipe, Forward };

/// One row of Schedules.def.
struct ScheduleTraits {
  ScheduleKind kind;
  llvm::StringRef name;  ///< --schedule NAME
  llvm::StringRef title; ///< how errors name it
  Placement placement;
  VirtualRule virtualRule;
  int defaultVirtualStages;
  BackwardKind backward;
  MicrobatchRule microbatches;
  bool autoCandidate; ///< tried by --schedule auto
  StepForm step;
  llvm::StringRef accepts, use;
};

/// Every row, in Schedules.def's order.
llvm::ArrayRef<ScheduleTraits> scheduleTable();
const ScheduleTraits &traitsOf(ScheduleKind kind);

/// "gpipe", "1f1b", ... (the rows' names); the error lists them.
llvm::Expected<ScheduleKind> parseSchedule(llvm::StringRef name);
llvm::StringRef scheduleName(ScheduleKind kind);
/// "gpipe|1f1b|...|auto": the names of the rows that train, and auto, for
/// --schedule's help.
std::string scheduleNamesForHelp();

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

/// The rows as a Markdown table (schedule, V, accepts, when to use it), with
/// the row of `--schedule auto` last: what `pipec schedules` prints and the
/// guide shows.
std::string scheduleTableMarkdown();

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_SCHEDULEKIND_H
