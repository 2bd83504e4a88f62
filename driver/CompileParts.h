//===- CompileParts.h - What `pipec compile`'s files share --------------===//
//
// The driver's own types for one compile (not an interface of pipec): the
// resolved setup, the front half of the pipeline for one microbatch size,
// the schedule a plan is built for, and the functions that describe a plan
// (DescribePlan.cpp) for Compile.cpp, which runs the passes.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_COMPILEPARTS_H
#define PIPEC_DRIVER_COMPILEPARTS_H

#include "driver/Compile.h"
#include "passes/BalanceStages.h"
#include "passes/Differentiate.h"
#include "passes/GroupLayers.h"
#include "passes/LowerSchedule.h"
#include "passes/SearchSchedules.h"
#include "passes/TieWeights.h"
#include "passes/TrainParams.h"

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace pipec {

/// What one microbatch size needs, shared by the schedules tried for it.
struct Prepared {
  Graph graph;
  std::string xxh3; ///< of the model file
  /// The model file's nodes, counted at import (later passes may add some).
  int fileNodes = 0;
  /// Train mode: the backward program, or why there is none.
  std::optional<Backward> backward;
  /// The values whose gradients the backward computes (valuesWithGradients),
  /// once: balancing asks per candidate partition.
  std::set<std::string> flowing;
  std::string lossText, backwardError;
  LayerGraph layers;
  /// Train mode: what tie-weights found and rewrote.
  TieReport ties;
  /// Train mode with --params: the parameters train-params made weights of.
  std::vector<ParamRewrite> paramRewrites;
  /// Train mode with --params: the weight that trains as each parameter
  /// held by one weight, or made one by train-params.
  std::map<std::string, std::string> paramWeights;
  /// Train mode with --params: the float initializers that hold no tensor of
  /// the checkpoint, which do not train.
  std::vector<std::string> unheld;
  /// Train mode: a sentence per padding row held back (--pad-row, config).
  std::vector<std::string> paddingNotes;
  /// The weights several layers read (LayerGraph::sharedWeights), once, for
  /// the same reason.
  std::vector<std::pair<int, std::vector<int>>> sharedWeights;
  /// Per layer l but the last: the tensors that cross the cut after it, as
  /// the plan sends them, and whether each carries a gradient back (see
  /// indexCuts).
  std::vector<std::vector<plan::TensorRef>> cutTensors;
  std::vector<std::vector<bool>> cutGradients;
  std::map<std::string, CostTable> tables;
  std::vector<const CostTable *> rankCosts;
};

struct Setup {
  std::vector<HardwareSpec> hardware;
  std::vector<int64_t> limits;
  Precision precision = Precision::BF16;
};

/// Each rank's hardware spec (--hardware, one name or one per stage), the
/// precision and the memory limits. Errors name the flag.
llvm::Expected<Setup> resolveSetup(const CompileOptions &options);

/// import, the graph passes, group-layers, tie-weights (train mode), the
/// costs on each rank's hardware (an analysis), then differentiate: the
/// front half for microbatches of \p microbatchSize samples. \p knownHash:
/// the model file's, when a compile has hashed it already.
llvm::Expected<std::unique_ptr<Prepared>> prepare(llvm::StringRef modelPath,
                                                  const CompileOptions &options, PassRunner &runner,
                                                  const Setup &setup, int64_t microbatchSize,
                                                  llvm::StringRef knownHash = "");

/// A configuration that is compared, never written (the other balancing
/// methods beside the plan written, --schedule auto's candidates,
/// --parallel auto's): balanced, with the step, bubble and memory peaks
/// simulatePlan would give its lowered plan, predicted by the same engine in
/// lower-schedule's array form (StepPredictor::predict).
llvm::Expected<Judged> judge(const CompileOptions &options, const Setup &setup,
                             const Prepared &prepared, const PipelineShape &shape,
                             PassRunner &runner);

/// A rank whose peak memory is over its limit (none when the limit is 0).
bool overMemoryLimit(const plan::Rank &rank);
/// Whether every rank of \p plan fits its memory limit.
bool fitsMemory(const plan::Plan &plan);

/// Fills \p prepared's cutTensors and cutGradients (LayerGraph::crossingAfter
/// and sendsGradient at each cut, once: balancing asks for the lowering
/// inputs of every candidate partition). Needs the backward program's
/// flowing values, in train mode.
void indexCuts(Prepared &prepared, Precision precision);

/// How \p options train on \p setup's ranks with \p replicas data-parallel
/// replicas: what the memory model and the gradient all-reduces count.
TrainingSetup trainingSetup(const CompileOptions &options, const Setup &setup, int replicas);

/// What balance-stages needs for \p shape; options.balance names a method
/// or gives a layout. The result refers to \p options, \p setup and
/// \p prepared.
BalanceOptions balanceOptions(const CompileOptions &options, const Setup &setup,
                              const Prepared &prepared, const PipelineShape &shape);

/// What lower-schedule needs: each stage's boundary tensors and sizes, and
/// the gradient all-reduces, of weights shared by several ranks and over
/// data-parallel replicas. balance-stages asks for it per candidate
/// partition, so that it times the plan that will be compiled.
LoweringInputs loweringInputs(const CompileOptions &options, const PipelineShape &shape,
                              const Setup &setup, const Prepared &prepared,
                              const StagePlan &stagePlan);

/// The plan's header: the model, the schedule, the hardware, how it trains,
/// how it was balanced and the graph's input shapes.
void describeRun(plan::Plan &plan, llvm::StringRef modelPath, const CompileOptions &options,
                 const Setup &setup, const Prepared &prepared, const BalanceOptions &balance,
                 const StagePlan &stagePlan);

/// Each layer's costs on the first rank's hardware; in train mode the loss,
/// or a warning that there is no backward program.
void describeLayers(plan::Plan &plan, const CompileOptions &options, const Prepared &prepared);

/// The stages and ranks as balance-stages placed them.
void describeStages(plan::Plan &plan, const LayerGraph &layers, const StagePlan &stagePlan);

/// The graph's warnings, the ops the cost model defaulted, and the ranks over
/// their memory limit.
void addWarnings(plan::Plan &plan, const Graph &graph, const CostTable &first);

/// --mode generate: the roles of the model's inputs and outputs, the stage
/// that holds each cache, and each rank's cache bytes (every group's).
llvm::Error describeGeneration(plan::Plan &plan, const Graph &graph, int64_t maxLength);
/// \p plan (a decode step) with the prefill of --prompt-length tokens: the
/// same model compiled for S tokens and a past of max_length - S, in the
/// decode step's layout, its loop's start proved against \p plan's rounds.
llvm::Expected<plan::Plan> withPrefill(plan::Plan plan, llvm::StringRef modelPath,
                                       const CompileOptions &options);
/// --mode generate (\p maxLength > 0), before fuse: a stage keeps each cache's appended
/// positions (plan::Generation::Cache::appended) in place of its present,
/// which attention may then read as the past and those where they lie.
llvm::Error keepAppendedPositions(plan::Plan &plan, const Graph &graph, int64_t maxLength);

/// --mode generate: the groups of rows in flight (--microbatches, or the
/// compile's choice for \p setup's hardware), and why.
std::pair<int, std::string> generationGroups(const CompileOptions &options, const Setup &setup);

/// train-params (driver/ParamSteps.cpp): with --params in train mode, each
/// parameter the exporter folded trains as itself, and a float initializer
/// that holds no parameter of a Constant node does not train.
llvm::Error trainParamsStep(Prepared &out, const CompileOptions &options, PassRunner &runner);

/// Fills out.graph.paddingRows from --pad-row and the config.json beside
/// --params (train mode).
llvm::Error choosePaddingRows(Prepared &out, const CompileOptions &options);

/// autocast (driver/ParamSteps.cpp; train mode with --autocast): bf16
/// activations where torch.autocast keeps them.
llvm::Error autocastStep(Prepared &out, const CompileOptions &options, PassRunner &runner);

} // namespace pipec

#endif // PIPEC_DRIVER_COMPILEPARTS_H
