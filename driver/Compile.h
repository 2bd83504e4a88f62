//===- Compile.h - `pipec compile`: a model to a plan -------------------===//
//
// Every pass of passes/Passes.def through one PassRunner: import, the graph
// passes and group-layers (PassPipeline.h), then, with the cost model per
// rank's hardware as an analysis, differentiate (train mode),
// balance-stages, lower-schedule, plan-memory and verify-program; then the
// simulated figures, the time / params / uniform balancings side by side for
// the report, and the stage programs, fused (StagePasses.h). The runner shows the passes of the
// returned plan only: the balancings it compares and the candidates of
// --schedule auto run quietly.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_COMPILE_H
#define PIPEC_DRIVER_COMPILE_H

#include "compiler/cost/CostModel.h"
#include "compiler/cost/MemoryModel.h"
#include "compiler/schedule/ScheduleKind.h"
#include "driver/PassPipeline.h"
#include "passes/Differentiate.h"
#include "plan/plan.pb.h"

namespace pipec {

struct CompileOptions {
  ImportOptions import;
  int stages = 4;
  /// 0: the schedule's own V (Schedules.def's DEFAULT_V).
  int virtualStages = 0;
  /// 0: four per stage.
  int microbatches = 0;
  /// Global batch; 0: each microbatch holds the batch a model of fixed shapes
  /// was exported with, else one sample.
  int64_t globalBatch = 0;
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  /// --schedule auto: simulate schedules, V and M, keep the fastest that fits.
  bool autoSchedule = false;
  /// A name or JSON file, or a comma-separated list with one per rank.
  std::string hardware = "h100";
  /// time, params, uniform, or a layout string.
  std::string balance = "time";
  /// Bytes per rank, or a comma-separated list; empty: the device memory.
  std::string memoryLimit;
  bool training = true;
  /// Train mode: --loss, --loss-fn and --labels (passes/Differentiate.h's
  /// chooseLoss).
  LossOptions loss;
  /// Empty: bf16 on GPUs, fp32 on CPUs.
  std::string precision;
  Optimizer optimizer = Optimizer::AdamW;
  /// --recompute none|all|auto: which layers recompute their activations.
  Recompute recompute = Recompute::None;
  /// --shard-optimizer: the data-parallel replicas divide the optimizer
  /// state (ZeRO-1): REDUCE_SCATTER, OPTIMIZER_STEP on a shard, ALL_GATHER.
  bool shardOptimizer = false;
  /// A measured cost table (JSON) overriding the roofline.
  std::string costs;
  int dataParallel = 1;
  /// --tp T: each stage's matrix products split over T ranks
  /// (shard-tensors).
  int tensorParallel = 1;
  /// --sequence-parallel: norms and residuals split on the sequence over the
  /// T ranks (passes/SequenceParallel.h).
  bool sequenceParallel = false;
  /// --parallel auto --gpus N: compile chooses T, P, D, M and the schedule
  /// for N devices (driver/SearchParallel.h). Those of --tp, --stages, --dp
  /// and --microbatches given beside it stay fixed.
  struct ParallelSearch {
    int gpus = 0;        ///< 0: no search; the flags fix T, P, D and M
    int gpusPerNode = 0; ///< 0: the hardware's devices per node
    bool fixedTp = false, fixedStages = false, fixedDp = false, fixedMicrobatches = false;
  } parallel;
  /// Weights (a regular expression over their names) the optimizer leaves
  /// alone.
  std::string freeze;
  /// --untie: initializers to train as separate copies per layer, or the
  /// folded tie heads to keep apart (passes/TieWeights.h).
  std::vector<std::string> untie;
  bool untieAll = false;
  /// --timing-only: a model pipec cannot train or run still gets a plan, for
  /// its report and simulation alone; its warnings say why it cannot run.
  /// Otherwise such a model is an error: a plan compile writes, runs.
  bool timingOnly = false;
  /// The fuse pass: false (--no-fuse) keeps every node its own kernel.
  bool fuse = true;
  /// fuse-attention: false (--attention unfused) trains attention as the
  /// exporter's nodes, its scores kept for the backward.
  bool fuseAttention = true;
  /// --autocast: with --precision bf16, a training compile stores its
  /// activations in bf16 as torch.autocast would (passes/Autocast.h).
  bool autocast = false;
  /// --params: the model's own tensors (.safetensors). Initializers the
  /// exporter merged from several of them train as one copy each
  /// (driver/MapParams.h); the plan's param_map is filled after compiling.
  std::string params;
  /// --pad-row NAME=ROW: embedding rows that take no gradient (torch's
  /// padding_idx), by weight or --params parameter name.
  std::vector<std::pair<std::string, int64_t>> padRows;
  /// The process ends right after this compile (`pipec compile`): what it
  /// prepared (graph, layers, backward program) is left to exit, not freed
  /// node by node (as clang's -disable-free).
  bool disableFree = false;
  /// --mode generate --max-length L: the plan is one decode step of a
  /// decoder with its KV cache, rows of L tokens (passes/GenerationRoles.h);
  /// 0 for train and infer.
  int64_t maxLength = 0;
  /// --prompt-length S (with maxLength): also compile the prefill of
  /// S-token prompts, in the decode step's stage layout (Generation.prefill).
  int64_t promptLength = 0;
  /// The ranks of this machine that compute at once, among which the `cpu`
  /// spec shares its cores; 0: every rank (stages x dp). A generation plan
  /// sets it for its groups in flight, its prefill alike.
  int computingRanks = 0;
};

/// Compiles \p modelPath into a plan, showing its passes as \p pipeline
/// asks. Errors name the flag (a --print-after name that is not a pass among
/// them), file, layer or stage at fault.
llvm::Expected<plan::Plan> compileModel(llvm::StringRef modelPath, const CompileOptions &options,
                                        const PipelineOptions &pipeline);

} // namespace pipec

#endif // PIPEC_DRIVER_COMPILE_H
