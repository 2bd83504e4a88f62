//===- PredictStep.h - The step time of a partition, by simulation ------===//
//
// balance-stages judges a partition by the step the compiled plan would be
// predicted to take: the schedule's compute actions lowered by
// lower-schedule (LowerSchedule.h) with the boundary tensors and gradient
// all-reduces the driver would give them, run by the event simulator
// (compiler/sim) with the partition's stage times, links and optimizer step.
// That is what `pipec compile` reports as a plan's predicted step, so a
// partition chosen by this number is the fastest the report can show.
//
// The schedule is generated once per predictor. A prediction does not build
// the plan's instruction streams: it follows the schedule's actions in the
// order lower-schedule would emit them, with the receives where
// lower-schedule posts them, on plain arrays, and gives the same double the
// simulator gives for the lowered plan (lowerAndSimulate, the reference the
// tests hold it to). At P = 64, M = 256 that is about 33,000 actions, a few
// milliseconds, where lowering and simulating take about half a second.
//
// A plan that is only compared (the other balancing methods beside the plan
// written, --schedule auto's candidates) needs more of the simulation than
// the step: its bubble and each rank's memory peak, which plan-memory gives
// the lowered buffers. predict() follows the same actions for those, with
// the buffers' allocations and frees where lower-schedule puts them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_PREDICTSTEP_H
#define PIPEC_PASSES_PREDICTSTEP_H

#include "passes/BalanceStages.h"
#include "passes/LowerSchedule.h"

#include <optional>

namespace pipec {

/// What the plan says about \p hardware (the simulator reads its links,
/// memory bandwidth and devices per node).
plan::HardwareInfo hardwareInfo(const HardwareSpec &hardware, bool bf16);

/// Lowering inputs for \p plan when the driver gives none: one tensor per
/// boundary of the cost table's boundary bytes, carrying its gradient back,
/// and a data-parallel all-reduce per rank when options.dataParallel > 1.
LoweringInputs defaultLoweringInputs(const StagePlan &plan, const BalanceOptions &options);

/// What simulatePlan says of a partition's plan that a comparison reads.
struct StepPrediction {
  double step = 0;
  double bubbleFraction = 0;
  /// Per rank: its weights and state plus plan-memory's peak of live
  /// activation bytes (SimulationResult::peakMemory).
  std::vector<int64_t> peakMemory;
};

/// Predicts step times of partitions for one BalanceOptions (which must
/// outlive it).
class StepPredictor {
public:
  explicit StepPredictor(const BalanceOptions &options);

  /// The simulated step of \p plan's chunks (times, ranks, parameters and
  /// boundaries as balance-stages filled them). Errors come from lowering or
  /// simulation (a schedule the options do not accept).
  llvm::Expected<double> operator()(const StagePlan &plan) const;

  /// The step, bubble and memory peaks of \p plan's chunks, the same
  /// numbers as lowerAndSimulate. Errors: those of operator(), and buffers
  /// lower-schedule would refuse (freed twice, or never).
  llvm::Expected<StepPrediction> predict(const StagePlan &plan) const;

  /// The same by the long way: lower-schedule's programs in a plan skeleton,
  /// given their memory plan (PlanMemory.h) and run by simulatePlan. For
  /// tests, and the errors of what predict() refuses.
  llvm::Expected<StepPrediction> lowerAndSimulate(const StagePlan &plan) const;

private:
  const BalanceOptions &options;
  std::optional<Schedule> schedule;
  std::string scheduleError;
  std::vector<plan::HardwareInfo> hardware;
};

} // namespace pipec

#endif // PIPEC_PASSES_PREDICTSTEP_H
