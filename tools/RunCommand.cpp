//===- RunCommand.cpp - `pipec run` ---------------------------------------===//
//
// Runs a plan: trains or infers on ranks as threads of this process, or as
// MPI processes. Feeds synthetic data, per-input datasets or a token file;
// evaluates, logs throughput and MFU, writes metrics, TensorBoard scalars,
// checkpoints and weights.
//
//===----------------------------------------------------------------------===//
#include "driver/CpuKernels.h"
#include "driver/PlanVerify.h"
#include "driver/Report.h"
#include "driver/StagePasses.h"
#include "plan/PlanFile.h"
#include "runtime/comm/Comm.h"
#include "runtime/exec/Executor.h"
#include "support/Diagnostics.h"
#include "tools/CliSupport.h"
#include "tools/TensorBoard.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>

using namespace llvm;

namespace pipec::cli {

namespace {

cl::SubCommand RunCmd("run", "Run a plan: train or infer on CPU ranks (threads or MPI processes)");

cl::opt<std::string> RunPlan(cl::Positional, cl::desc("PLAN"), cl::Required, cl::sub(RunCmd));
cl::opt<int> RunSteps("steps", cl::desc("Training (or inference) steps"), cl::init(1),
                      cl::sub(RunCmd));
cl::opt<std::string> RunBackend("backend", cl::desc("cpu or cuda"), cl::init("cpu"),
                                cl::sub(RunCmd));
cl::opt<std::string> RunComm("comm",
                             cl::desc("local (ranks as threads), mpi (one process per rank, "
                                      "under mpirun) or nccl; default: mpi under mpirun, else "
                                      "local"),
                             cl::sub(RunCmd));
cl::opt<uint64_t> RunSeed("seed",
                          cl::desc("Seed of the synthetic data, and of a token file's order"),
                          cl::init(1), cl::sub(RunCmd));
cl::opt<std::string> RunData("data",
                             cl::desc("A directory of NAME.npy or NAME.pb per input, or a file "
                                      "of token ids (a flat .bin, a Megatron .bin beside its "
                                      ".idx, or a .npy) cut into windows of the plan's sequence "
                                      "length plus one, in a seeded order"),
                             cl::value_desc("DIR|FILE"), cl::sub(RunCmd));
cl::opt<int64_t> RunSeqLen("seq-len",
                           cl::desc("A token file's window: the plan's sequence length (checked)"),
                           cl::init(0), cl::sub(RunCmd));
cl::opt<std::string> RunTokenType("token-type",
                                  cl::desc("A flat .bin's token ids: uint16 (the default) or "
                                           "uint32"),
                                  cl::init("uint16"), cl::sub(RunCmd));
cl::opt<std::string> RunEvalData("eval-data",
                                 cl::desc("Evaluation set, read in order: a token file or a "
                                          "directory, as --data"),
                                 cl::value_desc("DIR|FILE"), cl::sub(RunCmd));
cl::opt<int> RunEvalEvery("eval-every", cl::desc("Evaluate after every N steps"),
                          cl::value_desc("N"), cl::init(0), cl::sub(RunCmd));
cl::opt<int> RunEvalSteps("eval-steps",
                          cl::desc("Batches per evaluation (default: the whole set once)"),
                          cl::value_desc("K"), cl::init(0), cl::sub(RunCmd));
cl::opt<std::string> RunTensorBoard("tensorboard",
                                    cl::desc("Write each step's scalars as TensorBoard event "
                                             "files in DIR"),
                                    cl::value_desc("DIR"), cl::sub(RunCmd));
cl::opt<bool> RunAllowNonfinite("allow-nonfinite",
                                cl::desc("Feed NaN and infinities in --data floats, and go "
                                         "on when an update leaves a weight infinite or NaN "
                                         "(both refused by default, naming what)"),
                                cl::sub(RunCmd));
cl::opt<std::string> RunModel("model", cl::desc("The model file (default: the plan's path)"),
                              cl::value_desc("FILE"), cl::sub(RunCmd));
cl::opt<std::string> RunOptimizer("optimizer",
                                  cl::desc("sgd, momentum or adamw (default: the plan's)"),
                                  cl::sub(RunCmd));
cl::opt<double> RunLr("lr", cl::desc("Learning rate (default 1e-3 adamw, 1e-2 sgd; 0 freezes)"),
                      cl::init(0), cl::sub(RunCmd));
cl::opt<double> RunMomentum("momentum", cl::desc("SGD momentum"), cl::init(0.9), cl::sub(RunCmd));
cl::opt<std::string> RunLrSchedule("lr-schedule",
                                   cl::desc("constant, linear or cosine (decay to 0 over the "
                                            "run's steps)"),
                                   cl::init("constant"), cl::sub(RunCmd));
cl::opt<int> RunWarmup("warmup", cl::desc("Steps of linear learning-rate warm-up"), cl::init(0),
                       cl::sub(RunCmd));
cl::opt<double> RunClip("clip-grad-norm",
                        cl::desc("Scale gradients down to this global norm (0: off)"), cl::init(0),
                        cl::sub(RunCmd));
cl::opt<double> RunWeightDecay("weight-decay", cl::desc("Decoupled weight decay"), cl::init(0),
                               cl::sub(RunCmd));
cl::opt<std::string> RunSave("save-weights",
                             cl::desc("Write the trained model: OUT.onnx, or OUT.safetensors "
                                      "under the checkpoint's names (a plan compiled with "
                                      "--params); a regular file, /dev/null discards"),
                             cl::value_desc("OUT"), cl::sub(RunCmd));
cl::opt<std::string> RunInit("init",
                             cl::desc("Start from this checkpoint's weights (.safetensors, an "
                                      ".index.json or their folder; a plan compiled with "
                                      "--params)"),
                             cl::value_desc("CKPT"), cl::sub(RunCmd));
cl::opt<std::string> RunCheckpoint("checkpoint", cl::desc("Write atomic checkpoints to DIR"),
                                   cl::value_desc("DIR"), cl::sub(RunCmd));
cl::opt<int> RunCheckpointEvery("checkpoint-every", cl::desc("Steps between checkpoints"),
                                cl::init(1), cl::sub(RunCmd));
cl::opt<bool> RunResume("resume", cl::desc("Continue from --checkpoint DIR's latest checkpoint"),
                        cl::sub(RunCmd));
cl::opt<bool> RunResumeIfExists("resume-if-exists",
                                cl::desc("Continue from --checkpoint DIR's newest intact "
                                         "checkpoint if there is one, else start fresh"),
                                cl::sub(RunCmd));
cl::opt<int> RunKeepCheckpoints("keep-checkpoints",
                                cl::desc("Keep the newest N checkpoints, delete older ones"),
                                cl::value_desc("N"), cl::sub(RunCmd));
cl::opt<std::string> RunOutputs("outputs", cl::desc("Inference: write graph outputs to DIR"),
                                cl::value_desc("DIR"), cl::sub(RunCmd));
cl::opt<std::string> RunOutputFormat("output-format", cl::desc("npy or pb"), cl::init("npy"),
                                     cl::sub(RunCmd));
cl::opt<std::string> RunMetrics("metrics",
                                cl::desc("Write a JSON line per step: loss (full precision), "
                                         "eval_loss, lr, tokens/s, TFLOP/s, MFU (a regular "
                                         "file; /dev/null discards)"),
                                cl::value_desc("FILE"), cl::sub(RunCmd));
cl::opt<std::string> RunTrace("trace",
                              cl::desc("Write the measured timeline (Chrome trace; a regular "
                                       "file, /dev/null discards)"),
                              cl::value_desc("FILE"), cl::sub(RunCmd));
cl::opt<std::string> RunProfile("profile",
                                cl::desc("Profile the last step (the ones before warm up): per "
                                         "rank, nodes by op class with their time, FLOP/s and "
                                         "GB/s, and the backend's launches, host waits, bytes "
                                         "back to the host and allocations (JSON)"),
                                cl::value_desc("FILE"), cl::sub(RunCmd));
cl::opt<double> RunTimeout("timeout",
                           cl::desc("Seconds a rank may wait without progress before failing"),
                           cl::init(120), cl::sub(RunCmd));
cl::opt<bool> RunQuiet("quiet", cl::desc("No progress lines"), cl::sub(RunCmd));
// Plans hold their fused nodes (format 4): fusion is chosen at compile.
cl::opt<bool> RunNoFuse("no-fuse", cl::Hidden, cl::sub(RunCmd));
cl::opt<std::string> RunPrecision("precision",
                                  cl::desc("cuda: fp32, or bf16 tensor-core GEMMs with fp32 "
                                           "weights (default: the plan's)"),
                                  cl::sub(RunCmd));
cl::opt<int> RunRanksPerDevice("ranks-per-device",
                               cl::desc("cuda: ranks sharing one GPU (rank r uses GPU "
                                        "r / N); lets one GPU run a whole pipeline"),
                               cl::init(1), cl::sub(RunCmd));
cl::opt<int> RunThreadsPerRank("threads-per-rank",
                               cl::desc("BLAS threads of each rank (default: the node's cores "
                                        "divided by its ranks)"),
                               cl::init(0), cl::sub(RunCmd));

/// A step's scalars by the names --metrics and --tensorboard give them:
/// loss, eval_loss, lr, grad_norm, seconds, samples_per_s, tokens_per_s,
/// tflops and mfu, each where the run has it.
std::vector<std::pair<std::string, double>> stepScalars(const plan::Plan &plan,
                                                        const rt::StepRecord &record) {
  std::vector<std::pair<std::string, double>> scalars;
  bool train = plan.schedule().mode() == "train";
  if (train)
    scalars.emplace_back("loss", record.loss);
  if (record.evalLoss)
    scalars.emplace_back("eval_loss", *record.evalLoss);
  if (train)
    scalars.emplace_back("lr", record.lr);
  if (record.gradNorm >= 0)
    scalars.emplace_back("grad_norm", record.gradNorm);
  scalars.emplace_back("seconds", record.seconds);
  rt::StepRates rates = rt::stepRates(plan, record.seconds);
  scalars.emplace_back("samples_per_s", rates.samplesPerSecond);
  if (rates.tokensPerSecond > 0)
    scalars.emplace_back("tokens_per_s", rates.tokensPerSecond);
  if (rates.flopsPerSecond > 0)
    scalars.emplace_back("tflops", rates.flopsPerSecond / 1e12);
  if (rates.mfu > 0)
    scalars.emplace_back("mfu", rates.mfu);
  return scalars;
}

/// {"step": 1, "loss": 5.54, ...}: the step's scalars, full precision.
std::string metricsLine(const plan::Plan &plan, const rt::StepRecord &record) {
  std::string line = formatv("{{\"step\": {0}", record.step).str();
  for (const auto &[name, value] : stepScalars(plan, record))
    line += formatv(", \"{0}\": {1}", name, format("%.17g", value)).str();
  return line + "}\n";
}

/// The lines after a run: what ran against the prediction, where, and what
/// it wrote.
void printRunSummary(const plan::Plan &plan, const rt::RunResult &result, StringRef comm,
                     StringRef boardFile) {
  bool train = plan.schedule().mode() == "train";
  int ranks = RankGrid::of(plan).ranks();
  // A resumed run whose checkpoint is already at --steps runs none.
  int done = std::max(0, RunSteps - result.firstStep);
  double perStep = result.seconds / std::max(1, done);
  outs() << formatv("{0} {1} step(s) of {2} on {3} rank(s) ({4}): {5} per step, predicted {6}",
                    train ? "trained" : "ran", done, plan.schedule().name(), ranks, comm,
                    formatSeconds(perStep), formatSeconds(plan.predicted().step_time_s()));
  // Nodes that the device backend handed to the CPU, over all steps and ranks.
  if (RunBackend != "cpu") {
    int64_t total = 0;
    std::string byOp;
    for (const auto &[op, count] : result.fallbacks) {
      total += count;
      byOp += formatv("{0}{1} {2}", byOp.empty() ? "" : ", ", op, count).str();
    }
    outs() << formatv("; CPU fallbacks: {0}",
                      total == 0 ? std::string("none")
                                 : formatv("{0} node run(s) ({1})", total, byOp).str());
  }
  outs() << "\n";
  if (!result.history.empty()) {
    // The steps' own time: evaluations and checkpoints are not steps.
    double stepSeconds = 0;
    for (const rt::StepRecord &record : result.history)
      stepSeconds += record.seconds;
    stepSeconds /= static_cast<double>(result.history.size());
    outs() << "throughput over the steps (evaluation and checkpoints aside): "
           << rt::formatRates(plan, stepSeconds, RunBackend) << "\n";
  }
  // The last evaluation, whichever step ran it.
  auto evaluated = std::find_if(result.history.rbegin(), result.history.rend(),
                                [](const rt::StepRecord &r) { return r.evalLoss.has_value(); });
  if (evaluated != result.history.rend())
    outs() << formatv("eval loss after step {0}: {1:f4}\n", evaluated->step, *evaluated->evalLoss);
  if (!result.rankNodes.empty())
    outs() << "nodes: " << formatRankNodes(result.rankNodes) << "\n";
  if (RunBackend == "cpu" && !result.blas.empty())
    outs() << formatv("cpu: {0}, {1} thread(s) per rank\n", result.blas, result.threadsPerRank);
  if (!result.peakResidentBytes.empty())
    outs() << formatMemory(plan, result.peakResidentBytes, result.loadResidentBytes) << "\n";
  if (std::string device = formatDeviceMemory(plan, result.devicePeakBytes); !device.empty())
    outs() << device << "\n";
  if (plan.has_fusion())
    outs() << "fused by compile: " << describeFusion(plan.fusion()) << "\n";
  if (RunBackend == "cpu" && done > 0)
    outs() << recheckCpuCalibration(plan, RunPlan, perStep, result.threadsPerRank);
  if (!RunSave.empty())
    outs() << "wrote " << RunSave << "\n";
  if (!RunOutputs.empty())
    outs() << "wrote " << result.outputs.size() << " output(s) to " << RunOutputs << "\n";
  for (const std::string &written :
       {RunTrace.getValue(), RunMetrics.getValue(), RunProfile.getValue()})
    outs() << (written.empty() ? "" : "wrote " + written + "\n");
  if (!boardFile.empty())
    outs() << "wrote " << boardFile << "\n";
}

/// Why --profile cannot run as given, if it cannot.
std::optional<std::string> profileRefusal(bool underMpi) {
  if (RunProfile.empty())
    return std::nullopt;
  if (underMpi)
    return std::string("--profile: profiles the ranks of one process (threads, "
                       "--ranks-per-device on a GPU); under mpirun each process holds one rank");
  if (RunSteps < 2)
    return std::string("--profile: profiles the last step after the first warms up; give "
                       "--steps 2 or more");
  return std::nullopt;
}

} // namespace

bool runCommandGiven() { return bool(RunCmd); }

int runRun() {
  if (RunNoFuse)
    return badUsage("--no-fuse is a compile option: the plan holds its fused nodes; compile it "
                    "with --no-fuse");
  bool underMpi = launchedByMpi();
  std::string comm = RunComm.empty() ? (underMpi ? "mpi" : "local") : RunComm.getValue();
  if (comm != "local" && comm != "mpi" && comm != "nccl")
    return badUsage("--comm " + comm + ": expected local, mpi or nccl");
  if (RunBackend != "cpu" && RunBackend != "cuda")
    return badUsage("--backend " + RunBackend + ": expected cpu or cuda");
  if (comm == "nccl" && RunBackend != "cuda")
    return badUsage("--comm nccl moves device memory; it needs --backend cuda");
  if (comm == "nccl" && !underMpi)
    return reportError(createStringError(inconvertibleErrorCode(),
                                         "--comm nccl: start one process per rank with mpirun "
                                         "(NCCL is bootstrapped over MPI)"));
  if (comm == "nccl" && RunRanksPerDevice > 1)
    return badUsage("--comm nccl takes one GPU per rank (NCCL refuses two ranks of one "
                    "communicator on one device); share a GPU with --comm local");
  if (!RunPrecision.empty() && RunPrecision != "fp32" && RunPrecision != "bf16")
    return badUsage("--precision " + RunPrecision + ": expected fp32 or bf16");
  if (RunOutputFormat != "npy" && RunOutputFormat != "pb")
    return badUsage("--output-format " + RunOutputFormat + ": expected npy or pb");
  if (RunResume && RunCheckpoint.empty())
    return badUsage("--resume needs --checkpoint DIR");
  if (RunResumeIfExists && RunCheckpoint.empty())
    return badUsage("--resume-if-exists needs --checkpoint DIR");
  if (RunResume && RunResumeIfExists)
    return badUsage("--resume and --resume-if-exists exclude each other: --resume insists on "
                    "the latest checkpoint, --resume-if-exists takes the newest intact one");
  if (RunKeepCheckpoints.getNumOccurrences() && RunCheckpoint.empty())
    return badUsage("--keep-checkpoints needs --checkpoint DIR");
  if (!RunInit.empty() && !StringRef(RunInit).endswith(".safetensors") &&
      !StringRef(RunInit).endswith(".index.json") && !sys::fs::is_directory(RunInit))
    return badUsage("--init " + RunInit +
                    ": expected a .safetensors checkpoint, a sharded "
                    "checkpoint's .index.json, or their folder");
  if (RunEvalEvery.getNumOccurrences() && RunEvalData.empty())
    return badUsage("--eval-every needs --eval-data FILE|DIR");
  if (RunEvalSteps.getNumOccurrences() && RunEvalData.empty())
    return badUsage("--eval-steps needs --eval-data FILE|DIR");
  if (!RunEvalData.empty() && RunEvalEvery <= 0)
    return badUsage("--eval-data needs --eval-every N (N >= 1)");
  if (RunTokenType != "uint16" && RunTokenType != "uint32")
    return badUsage("--token-type " + RunTokenType + ": expected uint16 or uint32");
  if (!RunTensorBoard.empty() && sys::fs::exists(RunTensorBoard) &&
      !sys::fs::is_directory(RunTensorBoard))
    return badUsage("--tensorboard " + RunTensorBoard + ": not a directory");
  for (auto [flag, path] : {std::pair<StringRef, StringRef>{"--save-weights", RunSave},
                            {"--metrics", RunMetrics},
                            {"--trace", RunTrace},
                            {"--profile", RunProfile}})
    if (Error err = checkNotAnInput(flag, path, {RunPlan, RunModel, RunInit}))
      return reportError(std::move(err));
  rt::RunOptions options = runOptionsFromEnvironment();
  options.steps = RunSteps;
  options.seed = RunSeed;
  options.dataDir = RunData;
  options.seqLen = RunSeqLen;
  options.tokenType = RunTokenType;
  options.evalData = RunEvalData;
  options.evalEvery = RunEvalEvery;
  options.evalSteps = RunEvalSteps;
  options.allowNonfinite = RunAllowNonfinite;
  options.modelPath = RunModel;
  options.planDir = sys::path::parent_path(RunPlan).str();
  if (!RunOptimizer.empty()) {
    auto optimizer = parseOptimizer(RunOptimizer);
    if (!optimizer)
      return reportError(optimizer.takeError());
    options.optimizer = *optimizer;
  }
  if (RunLr.getNumOccurrences())
    options.lr = RunLr;
  options.momentum = RunMomentum;
  options.weightDecay = RunWeightDecay;
  options.lrSchedule = RunLrSchedule;
  options.warmup = RunWarmup;
  options.clipGradNorm = RunClip;
  options.saveWeights = RunSave;
  options.initPath = RunInit;
  options.checkpointDir = RunCheckpoint;
  options.checkpointEvery = RunCheckpointEvery;
  options.resume = RunResume;
  options.resumeIfExists = RunResumeIfExists;
  if (RunKeepCheckpoints.getNumOccurrences())
    options.keepCheckpoints = RunKeepCheckpoints;
  options.outputsDir = RunOutputs;
  options.keepOutputs = !RunOutputs.empty();
  options.outputsAsPb = RunOutputFormat == "pb";
  options.tracePath = RunTrace;
  options.profilePath = RunProfile;
  if (std::optional<std::string> why = profileRefusal(underMpi))
    return badUsage(*why);
  options.timeoutSeconds = RunTimeout;
  options.progress = !RunQuiet;
  options.log = &outs();
  options.backend = RunBackend;
  options.precision = RunPrecision;
  options.ranksPerDevice = RunRanksPerDevice;
  if (RunThreadsPerRank.getNumOccurrences())
    options.threadsPerRank = RunThreadsPerRank;
  options.comm = comm == "nccl" ? "nccl" : "mpi";
  // Flags first: a malformed value is reported before any file is read.
  if (Error err = rt::checkRunOptions(options))
    return reportError(std::move(err));
  auto plan = readVerifiedPlan(RunPlan);
  if (!plan)
    return reportError(plan.takeError());
  if (Error err = checkNotAnInput("--save-weights", RunSave, {plan->model().path()}))
    return reportError(std::move(err));
  // TensorBoard follows the run: rank 0 writes each step as it ends.
  std::unique_ptr<TensorBoardWriter> board;
  Error boardError = Error::success();
  if (!RunTensorBoard.empty())
    options.onStep = [&](const rt::StepRecord &record) {
      if (boardError)
        return;
      if (!board) {
        auto opened = TensorBoardWriter::open(RunTensorBoard);
        if (!opened) {
          boardError = opened.takeError();
          return;
        }
        board = std::move(*opened);
      }
      boardError = board->write(record.step, stepScalars(*plan, record));
    };
  auto result = comm == "local" ? rt::runLocal(*plan, options) : rt::runMpi(*plan, options);
  if (!result) {
    consumeError(std::move(boardError));
    return reportError(result.takeError());
  }
  if (boardError)
    return reportError(std::move(boardError));
  if (result->primary)
    for (const std::string &warning : result->warnings)
      errs() << "pipec: warning: " << warning << "\n";
  if (!RunMetrics.empty() && result->primary) {
    std::string lines;
    for (const rt::StepRecord &record : result->history)
      lines += metricsLine(*plan, record);
    if (Error err = writeFileAtomically(RunMetrics, lines))
      return reportError(std::move(err));
  }
  if (!RunQuiet && result->primary)
    printRunSummary(*plan, *result, comm, board ? board->path() : std::string());
  return 0;
}

} // namespace pipec::cli
