//===- Executor.h - Runs a plan: one executor per rank -------------------===//
//
// Each rank interprets its instruction stream (Plan.programs[rank]) with the
// stage programs (Plan.stage_programs) on the CPU kernels:
//
//   LOAD            the stage's graph inputs for the microbatch (Data.h)
//   FORWARD         the stage's forward nodes; then the loss (last stage);
//                   keeps what backward reads (StageProgram.keep)
//   RECOMPUTE       the forward nodes that rebuild what FORWARD dropped (the
//                   stage program's `recompute` values)
//   BACKWARD_INPUT  backward_input, then each received tensor's gradient
//   BACKWARD_WEIGHT backward_weight, then adds weight_grads into the rank's
//                   gradient accumulators
//   BACKWARD        both
//   SEND / RECV     posted on the Comm in stream order; a compute waits for
//                   the receives it reads
//   ALLREDUCE       sums the gradients of a group: "dp" over the replicas of
//                   this pipeline rank, "tied:W" over the ranks holding W
//   REDUCE_SCATTER  with a sharded optimizer, in place of the "dp"
//                   ALLREDUCE: each replica keeps its 1/dp shard of every
//                   gradient's sum
//   OPTIMIZER_STEP  gradients averaged over microbatches and replicas, then
//                   SGD (with momentum) or AdamW (sharded: on this
//                   replica's shard of each weight and its state)
//   ALL_GATHER      the replicas' updated shards make the whole weights
//   FREE            drops a microbatch's activations
//
// Boundary tensors between two stages on the same rank (interleaved and
// V-shaped schedules) are handed over directly. After every step all ranks
// sum the loss (which also makes the step a barrier for checkpoints).
//
// Fault injection for tests: RunOptions::fault (`pipec run` reads it from
// PIPEC_FAULT="rank=R,step=S,at=I,kind=K") makes
// global rank R, at instruction I of step S, fail with an error (K=error) or
// kill its process with SIGKILL (K=kill).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_EXECUTOR_H
#define PIPEC_RUNTIME_EXEC_EXECUTOR_H

#include "plan/plan.pb.h"
#include "runtime/core/Tensor.h"
#include "support/Optimizer.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace pipec::rt {

/// Where a test injects a fault (above); rank -1: nowhere.
struct Fault {
  int rank = -1, step = -1, at = -1;
  std::string kind;
};

/// The fault "rank=R,step=S,at=I,kind=K" names; the tool reads the text from
/// PIPEC_FAULT.
Fault parseFault(llvm::StringRef text);

/// One step of a run, as rank 0 saw it.
struct StepRecord {
  int step = 0; ///< from 1
  /// The mean loss (train), the step's wall time (without evaluation or
  /// checkpoints), its learning rate and, with clipping, gradient norm.
  double loss = 0, seconds = 0, lr = 0, gradNorm = -1;
  /// The evaluation's mean loss after this step, when one ran.
  std::optional<double> evalLoss;
};

struct RunOptions {
  int steps = 1;
  /// A fault to inject (tests).
  Fault fault;
  uint64_t seed = 1;
  /// A directory of per-input .npy / .pb datasets, or a file of token ids
  /// (TokenStream); empty: synthetic.
  std::string dataDir;
  /// A raw token file's element type (uint16 or uint32); --seq-len, 0 or
  /// the plan's sequence length.
  std::string tokenType = "uint16";
  int64_t seqLen = 0;
  /// Evaluation: the forward of evalSteps batches of evalData (a token file
  /// or a directory, read in order) every evalEvery steps (0: never);
  /// evalSteps 0: every whole batch of the set.
  std::string evalData;
  int evalEvery = 0;
  int evalSteps = 0;
  /// Feed NaN and infinities in --data floats rather than refuse them.
  bool allowNonfinite = false;
  /// Overrides Plan.model.path; a relative plan path is tried against the
  /// current directory, then against \p planDir.
  std::string modelPath;
  std::string planDir;
  /// The optimizer; unset: the plan's.
  std::optional<Optimizer> optimizer;
  /// Learning rate; unset: 1e-3 for adamw, 1e-2 otherwise. 0 is a rate
  /// of zero: the weights do not move.
  std::optional<double> lr;
  double momentum = 0.9;
  double weightDecay = 0;
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
  /// Learning-rate schedule over the run's steps: constant, linear or
  /// cosine decay to 0, after `warmup` steps of linear warm-up from 0.
  std::string lrSchedule = "constant";
  int warmup = 0;
  /// Scale the step's gradient down to this global norm (all weights of all
  /// ranks, each counted once) when it is larger; 0: no clipping.
  double clipGradNorm = 0;
  /// Atomic checkpoints every checkpointEvery steps, in checkpointDir.
  std::string checkpointDir;
  int checkpointEvery = 1;
  /// Continue from checkpointDir's latest checkpoint, which must be intact.
  bool resume = false;
  /// Continue from checkpointDir's newest intact checkpoint if there is
  /// one, else start fresh: a preempted job reruns its own command line.
  bool resumeIfExists = false;
  /// After each checkpoint, delete all but the newest N; unset: keep all.
  std::optional<int> keepCheckpoints;
  /// Write the trained model here: ONNX, or, for a name ending in
  /// .safetensors, the checkpoint's parameters through the plan's ParamMap.
  std::string saveWeights;
  /// Start from this checkpoint's weights (.safetensors, through the plan's
  /// ParamMap) in place of the model file's.
  std::string initPath;
  /// Inference: write the graph outputs here as NAME.npy (or .pb).
  std::string outputsDir;
  /// Inference: keep every step's graph outputs for RunResult::outputs (and
  /// outputsDir). Off, a step's outputs are dropped once computed: a run that
  /// writes none holds no step's outputs past its end.
  bool keepOutputs = true;
  bool outputsAsPb = false;
  /// Write the measured timeline (Chrome trace, the simulator's format).
  std::string tracePath;
  /// Write the last step's profile (StepProfile.h): nodes by op class and
  /// the backend's counters, per rank.
  std::string profilePath;
  /// Called on rank 0 after each step, with its record (evalLoss set on
  /// the steps that evaluated).
  std::function<void(const StepRecord &)> onStep;
  /// Print a progress line per step on \p log (rank 0).
  bool progress = false;
  llvm::raw_ostream *log = nullptr;
  /// A rank waiting this long without progress fails instead of hanging.
  double timeoutSeconds = 120;
  /// Keep the trained weights and last gradients in the result (tests).
  bool collectWeights = false;
  /// cpu or cuda.
  std::string backend = "cpu";
  /// fp32 or bf16 (CUDA GEMMs); empty: the plan's.
  std::string precision;
  /// CUDA: ranks sharing one device (rank r uses device r / ranksPerDevice).
  int ranksPerDevice = 1;
  /// BLAS threads of each rank (--threads-per-rank); unset: the node's
  /// cores divided by the ranks on it, at least 1.
  std::optional<int> threadsPerRank;
  /// runMpi's transport: mpi (host tensors) or nccl (device tensors).
  std::string comm = "mpi";
};

/// What a step's time makes of the plan's work: samples/s, tokens/s (0 for
/// a plan that feeds no token ids), model FLOP/s and MFU against the peak
/// of all the run's ranks (0 when unknown).
struct StepRates {
  double samplesPerSecond = 0, tokensPerSecond = 0, flopsPerSecond = 0, mfu = 0;
};
StepRates stepRates(const plan::Plan &plan, double seconds);
/// "8.1k tokens/s  0.52 TFLOP/s  MFU 3.4% (of the calibrated CPU peak)", or
/// samples/s for a plan that feeds no token ids. The MFU says whose peak:
/// the calibrated CPU's, or the plan's hardware spec by name (and, run on
/// the \p backend "cpu", that it is not this CPU's).
std::string formatRates(const plan::Plan &plan, double seconds, llvm::StringRef backend);

struct RunResult {
  /// Every step run (rank 0).
  std::vector<StepRecord> history;
  /// Mean loss per step run (train): the history's.
  std::vector<double> losses() const {
    std::vector<double> out;
    for (const StepRecord &record : history)
      out.push_back(record.loss);
    return out;
  }
  int firstStep = 0;
  /// Lines the run warns about (corrupt checkpoints --resume-if-exists
  /// skipped), without the "pipec: warning: " prefix.
  std::vector<std::string> warnings;
  /// Trained weights (collectWeights; rank 0 of an MPI run).
  std::map<std::string, cpu::Tensor> weights;
  /// Every copy of every trained weight, on every rank of every replica
  /// (collectWeights; local runs): a tied weight has one per rank that
  /// holds it, a data-parallel run one per replica. All copies of a weight
  /// must agree.
  struct WeightCopy {
    std::string name;
    int rank = 0, replica = 0; ///< pipeline rank, data-parallel replica
    cpu::Tensor value;
  };
  std::vector<WeightCopy> weightCopies;
  /// The last step's gradients, averaged as the optimizer saw them, before
  /// the update (collectWeights; local runs).
  std::map<std::string, cpu::Tensor> gradients;
  /// Inference outputs, all samples of the run in order (local runs).
  std::map<std::string, cpu::Tensor> outputs;
  double seconds = 0;
  /// Mean measured compute time per step, per global rank (local runs).
  std::vector<double> busySeconds;
  int64_t instructions = 0;
  /// Summed over ranks (local runs): nodes run, seconds inside node kernels,
  /// and seconds inside instructions less waits for messages. Their
  /// difference over the instructions is the executor's own overhead.
  int64_t nodes = 0;
  double kernelSeconds = 0, instructionSeconds = 0;
  /// The peak resident set of each process of the run, in rank order, in
  /// its steps and while its weights loaded: one for a local run (its ranks
  /// share it), one per rank under MPI.
  std::vector<int64_t> peakResidentBytes, loadResidentBytes;
  /// On a device: per pipeline rank, the most memory one of its ranks'
  /// tensors held at once (empty on the CPU, and for ranks of other
  /// processes under MPI).
  std::map<int, int64_t> devicePeakBytes;
  /// Nodes run on the host instead of the device, by op, summed over the
  /// steps and every rank (Backend::fallbackOps); empty on the CPU backend.
  std::map<std::string, int64_t> fallbacks;
  /// Under MPI, the node each global rank ran on.
  std::vector<std::string> rankNodes;
  /// The BLAS and the CPU kernel it chose ("OpenBLAS 0.3.34 SkylakeX"), and
  /// the threads each rank gave it.
  std::string blas;
  int threadsPerRank = 1;
  /// Whether this process reports for the run (local, or MPI rank 0).
  bool primary = true;
};

/// Runs \p plan with every rank (pipeline ranks x data-parallel replicas) as
/// a thread of this process.
llvm::Expected<RunResult> runLocal(const plan::Plan &plan, const RunOptions &options);

/// Runs this process's rank of \p plan under MPI (mpirun -np P*dp).
llvm::Expected<RunResult> runMpi(const plan::Plan &plan, const RunOptions &options);

/// Checks the numbers and names of \p options against their ranges
/// (steps >= 1, lr >= 0 and finite, momentum in [0, 1), ...): a UsageError
/// naming the flag, else success. runLocal and runMpi call it first.
llvm::Error checkRunOptions(const RunOptions &options);

/// Checks that \p plan can be run: it has stage programs, its model file
/// exists and has the plan's xxh3. Returns the model's path.
llvm::Expected<std::string> checkPlanModel(const plan::Plan &plan, const RunOptions &options);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_EXECUTOR_H
