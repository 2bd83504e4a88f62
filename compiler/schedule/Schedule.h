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

#include "compiler/schedule/PipelineShape.h"

#include <cstdint>
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

/// Generates the schedule of a checked shape.
Schedule generateSchedule(const PipelineShape &shape);

/// Checks the shape (PipelineShape::make: the reason when the schedule does
/// not accept (P, V, M)), then generates it.
llvm::Expected<Schedule> generateSchedule(ScheduleKind kind, int stages, int virtualStages,
                                          int microbatches);

/// Per local chunk of \p rank (chunk c of a rank is the c-th of its stages
/// in increasing order): the most microbatches whose activations that chunk
/// holds at once, from its F until the pass that frees them: B, or W for a
/// split backward (an I frees nothing; W still reads the layer inputs).
std::vector<int64_t> peakHeldPerChunk(const Schedule &schedule, int rank);

/// As peakHeldPerChunk, for the activations a recomputing chunk rebuilds:
/// held from its backward (B, or I: the RECOMPUTE runs just before) until
/// the pass that frees them (B, or W). Under 1F1B one at a time; a
/// zero-bubble schedule that delays W holds several.
std::vector<int64_t> peakRebuiltPerChunk(const Schedule &schedule, int rank);

/// The memory model's count for rank \p rank before a plan exists: the
/// per-chunk peaks of peakHeldPerChunk for the generated schedule, summed
/// (an upper bound of what the rank holds at once, and its value when
/// V = 1). For example, with V = 1: GPipe M; 1F1B min(M, P - r); ZB-H2
/// min(M, 2P - 1) on every rank; forward-only 1. Shapes the schedule
/// rejects count V M.
int64_t inFlightActivations(ScheduleKind kind, int stages, int virtualStages, int microbatches,
                            int rank);

/// "2I5".
std::string formatAction(const Action &action);
/// Parses "2I5"; used by tests and the report.
llvm::Expected<Action> parseAction(llvm::StringRef text);
char actionKindLetter(ActionKind kind);

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_SCHEDULE_H
