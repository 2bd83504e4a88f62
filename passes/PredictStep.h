//===- PredictStep.h - The step time of a partition, by simulation ------===//
//
// balance-stages judges a partition by the step the compiled plan would be
// predicted to take, and --schedule auto judges its candidates the same way:
// the schedule's compute actions lowered by lower-schedule (LowerSchedule.h)
// with the boundary tensors and gradient all-reduces the driver would give
// them, run by the simulator's engine (compiler/sim, runStreams) with the
// partition's stage times, links and optimizer step. That is the engine
// `pipec compile` predicts the written plan's step with, and `pipec
// simulate` runs, so a partition chosen by this number is the fastest the
// report can show. Candidates stay in lower-schedule's array form
// (lowerStreams): no protobuf is built for a plan that is only compared.
//
// The schedule is generated once per predictor. At P = 64, M = 256 a
// prediction lowers and runs about 115,000 instructions.
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
/// and a data-parallel all-reduce per rank when the shape has replicas.
LoweringInputs defaultLoweringInputs(const StagePlan &plan, const BalanceOptions &options);

/// The data-parallel collectives of \p plan, of each rank's chunks'
/// parameters at \p gradientBytes each, over its replicas: one gradient
/// all-reduce per rank, or with \p shard (--shard-optimizer) a
/// reduce-scatter of the gradients per rank and an all-gather of the
/// updated weights per rank; none with one replica.
std::vector<LoweringInputs::Collective> dataParallelCollectives(const StagePlan &plan,
                                                                const PipelineShape &shape,
                                                                int64_t gradientBytes, bool shard);

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
  /// simulation (buffers or boundaries lower-schedule refuses).
  llvm::Expected<double> operator()(const StagePlan &plan) const;

  /// The step, bubble and memory peaks of \p plan's chunks (each rank's
  /// weights and state plus plan-memory's peak of its lowered buffers).
  /// Errors: those of operator(), and buffers lower-schedule refuses (freed
  /// twice, or never).
  llvm::Expected<StepPrediction> predict(const StagePlan &plan) const;

private:
  llvm::Expected<StepPrediction> simulate(const StagePlan &plan, bool peaks) const;

  const BalanceOptions &options;
  Schedule schedule;
  std::vector<plan::HardwareInfo> hardware;
  /// The last candidate's lowering, and the inputs its streams point into.
  struct Lowered {
    LoweredStreams lowered;
    LoweringInputs inputs;
  };
  mutable std::optional<Lowered> last;
};

} // namespace pipec

#endif // PIPEC_PASSES_PREDICTSTEP_H
