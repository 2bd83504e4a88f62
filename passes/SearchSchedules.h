//===- SearchSchedules.h - --schedule auto: the fastest schedule that fits -===//
//
// --schedule auto tries every row of Schedules.def marked for it, at the
// row's V, for each microbatch count (the one --microbatches gives, else P,
// 2P, 4P and 8P), and keeps the candidate with the least predicted step
// among those whose every rank fits its memory limit; the first such in
// that order wins a tie. Each candidate is judged, balanced and its step,
// bubble and memory peaks predicted (StepPredictor::predict), without
// building its plan. The driver judges a shape, since preparing the model
// for a microbatch size is its part; the search decides which shapes, and
// which wins.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_SEARCHSCHEDULES_H
#define PIPEC_PASSES_SEARCHSCHEDULES_H

#include "passes/PredictStep.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

/// A configuration that is compared, never written: its partition and the
/// step, bubble and memory peaks predicted for it.
struct Judged {
  StagePlan stagePlan;
  StepPrediction prediction;

  /// The first rank over its memory limit, or -1 (a position in
  /// stagePlan.ranks and prediction.peakMemory, as in the plan).
  int overRank() const;
};

/// What judging one checked shape gave: the shape with its samples per
/// microbatch, and its judged partition, or why it has none.
struct Judgement {
  PipelineShape shape;
  std::optional<Judged> judged;
  std::string error; ///< no plan: its reason, as the candidate shows it
};

/// Judges a shape the search checked. An error ends the search.
using JudgeShape = std::function<llvm::Expected<Judgement>(const PipelineShape &shape)>;

/// One schedule the search tried, and what became of it.
struct ScheduleCandidate {
  std::string name; ///< "zbv V=2 M=8"
  std::optional<PipelineShape> shape;
  std::optional<Judged> judged;
  std::string error; ///< why it has no plan ("not accepted: ...", "lost: no plan: ...")

  bool fits() const { return judged && judged->overRank() < 0; }
};

struct ScheduleSearch {
  std::vector<ScheduleCandidate> tried;
  /// In tried: the fastest candidate that fits; -1 when none does.
  int best = -1;
};

/// --schedule auto on \p stages ranks of \p dataParallel replicas, at
/// \p microbatches (0: P, 2P, 4P and 8P).
llvm::Expected<ScheduleSearch> searchSchedules(int stages, int microbatches, int dataParallel,
                                               const JudgeShape &judge);

} // namespace pipec

#endif // PIPEC_PASSES_SEARCHSCHEDULES_H
