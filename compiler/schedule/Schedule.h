//===- Schedule.h - Per-rank compute orders of pipeline schedules -------===//
//
// A schedule is data: for each rank, the ordered compute actions it runs in
// one training step. Generators are pure functions of (kind, P, V, M); they
// emit compute actions only. lower-schedule adds the communication.
//
// An action is <stage><kind><microbatch>, e.g. "2I5": stage is the global
// chunk index (rank r's chunks are r, r + P, ... when looped, r and 2P-1-r
// in a V), kind is F (forward), B (full backward), I (backward for inputs)
// or W (backward for weights).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SCHEDULE_SCHEDULE_H
#define PIPEC_COMPILER_SCHEDULE_SCHEDULE_H

#include "compiler/schedule/ScheduleKind.h"

#include <string>
#include <vector>

namespace pipec {

enum class ActionKind { F, B, I, W };

struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::F;
  int microbatch = 0;
  bool operator==(const Action &o) const {
    return stage == o.stage && kind == o.kind && microbatch == o.microbatch;
  }
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;        ///< P: ranks
  int virtualStages = 1; ///< V: chunks per rank
  int microbatches = 1;  ///< M
  /// ranks[r]: rank r's actions in execution order.
  std::vector<std::vector<Action>> ranks;
};

/// Generates the schedule; rejects (P, V, M) the schedule does not accept,
/// as checkScheduleShape does, with the reason.
llvm::Expected<Schedule> generateSchedule(ScheduleKind kind, int stages, int virtualStages,
                                          int microbatches);

/// "2I5".
std::string formatAction(const Action &action);
/// Parses "2I5"; used by tests and the report.
llvm::Expected<Action> parseAction(llvm::StringRef text);
char actionKindLetter(ActionKind kind);

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_SCHEDULE_H
