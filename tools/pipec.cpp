//===- pipec.cpp - The pipec command line -------------------------------===//
//
//   pipec inspect MODEL [--format text|json]   layers, params, FLOPs, cuts
//   pipec model FAMILY --layers N ... -o FILE   generate a model
//
// Exit codes: 0 success, 1 bad input or a failed step (the message names
// the file, node or layer), 2 bad usage (unknown command or flag).
//
//===----------------------------------------------------------------------===//
#include "compiler/sim/Simulator.h"
#include "driver/Compile.h"
#include "driver/CpuKernels.h"
#include "driver/HtmlReport.h"
#include "driver/InspectReport.h"
#include "driver/MapParams.h"
#include "driver/PassPipeline.h"
#include "driver/PlanVerify.h"
#include "driver/Profile.h"
#include "driver/Report.h"
#include "driver/StagePasses.h"
#include "models/ModelGenerators.h"
#include "plan/PlanFile.h"
#include "runtime/comm/Comm.h"
#include "runtime/cpu/FewRowGemm.h"
#include "runtime/exec/Executor.h"
#include "support/Blas.h"
#include "support/Diagnostics.h"
#include "tools/CliSupport.h"
#include "tools/Versions.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/BuryPointer.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/ConvertUTF.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Regex.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdio>
#include <cstring>
#include <list>
#include <optional>
#include <unistd.h>

using namespace llvm;
using namespace pipec;
using namespace pipec::cli;

namespace {

cl::SubCommand InspectCmd("inspect", "Show a model's layers, params, FLOPs and cut points");
cl::SubCommand ModelCmd("model", "Generate a GPT, Llama, BERT, MLP or ResNet model as ONNX");
cl::SubCommand CompileCmd("compile", "Partition a model into pipeline stages and write a plan");
cl::SubCommand ReportCmd("report", "Show a plan's partition report");
cl::SubCommand SimulateCmd("simulate", "Simulate a plan's instruction streams; write a trace");
cl::SubCommand ProfileCmd("profile",
                          "Measure each layer's F, I and W time on this CPU: a cost table for "
                          "compile --costs");
cl::SubCommand SchedulesCmd("schedules",
                            "List the pipeline schedules: the V and M each takes, when to use it");

cl::OptionCategory ShapeCat("Shape binding");
cl::OptionCategory DebugCat("Pass debugging");

// inspect
cl::opt<std::string> InspectModel(cl::Positional, cl::desc("MODEL.onnx"), cl::Required,
                                  cl::sub(InspectCmd));
cl::opt<std::string> InspectFormat("format", cl::desc("Output format: text or json"),
                                   cl::init("text"), cl::sub(InspectCmd));
cl::opt<std::string> InspectOutput("o", cl::desc("Write to FILE instead of stdout"),
                                   cl::value_desc("FILE"), cl::sub(InspectCmd));
cl::list<std::string> InputShapes("input-shape",
                                  cl::desc("Bind an input's shape: NAME=D0,D1,.. (repeatable)"),
                                  cl::value_desc("NAME=D0,D1,.."), cl::cat(ShapeCat),
                                  cl::sub(InspectCmd), cl::sub(CompileCmd), cl::sub(ProfileCmd));
cl::list<std::string> Dims("dim", cl::desc("Bind a named symbolic dimension: NAME=V (repeatable)"),
                           cl::value_desc("NAME=V"), cl::cat(ShapeCat), cl::sub(InspectCmd),
                           cl::sub(CompileCmd), cl::sub(ProfileCmd));
cl::opt<int64_t> Batch("batch", cl::desc("Value of batch-like symbolic dims"), cl::init(1),
                       cl::cat(ShapeCat), cl::sub(InspectCmd));
cl::opt<int64_t> Seq("seq", cl::desc("Value of sequence-like symbolic dims"), cl::init(128),
                     cl::cat(ShapeCat), cl::sub(InspectCmd), cl::sub(CompileCmd),
                     cl::sub(ProfileCmd));
cl::opt<int64_t> Past("past", cl::desc("Value of past-length symbolic dims"), cl::init(0),
                      cl::cat(ShapeCat), cl::sub(InspectCmd), cl::sub(CompileCmd));
cl::list<std::string> PrintAfter("print-after",
                                 cl::desc("Print the IR after the named pass (or 'all')"),
                                 cl::CommaSeparated, cl::cat(DebugCat), cl::sub(InspectCmd),
                                 cl::sub(CompileCmd));
cl::opt<std::string> DumpDir("dump-dir", cl::desc("Write the IR after every pass to DIR"),
                             cl::value_desc("DIR"), cl::cat(DebugCat), cl::sub(InspectCmd),
                             cl::sub(CompileCmd));
cl::opt<bool> Stats("stats", cl::desc("Print each pass's time and the size of its IR"),
                    cl::cat(DebugCat), cl::sub(InspectCmd), cl::sub(CompileCmd));

// compile
cl::OptionCategory CompileCat("Compile");
cl::opt<std::string> CompileModel(cl::Positional, cl::desc("MODEL.onnx"), cl::Required,
                                  cl::sub(CompileCmd));
cl::opt<std::string> CompileOutput("o", cl::desc("Plan file to write"), cl::value_desc("PLAN"),
                                   cl::init("model.plan"), cl::sub(CompileCmd));
cl::opt<int> Stages("stages", cl::desc("Pipeline stages P (ranks)"), cl::init(4),
                    cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> VirtualStages("virtual-stages",
                           cl::desc("Chunks per rank V (default: the schedule's, 1 or 2)"),
                           cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> Microbatches(
    "microbatches",
    cl::desc("Microbatches M per step (default 4P; --mode generate: groups in flight, chosen)"),
    cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int64_t> GlobalBatch("batch",
                             cl::desc("Global batch per step (default: the batch a model "
                                      "of fixed shapes holds per microbatch, else one "
                                      "sample)"),
                             cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
// The names come from Schedules.def's rows (cl::desc keeps a reference).
const std::string scheduleHelp = scheduleNamesForHelp();
cl::opt<std::string> Schedule("schedule", cl::desc(scheduleHelp), cl::init("1f1b"),
                              cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Hardware("hardware",
                              cl::desc("h100|h200|a100|cpu|FILE.json, or one per rank: h100,a100"),
                              cl::init("h100"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Balance("balance", cl::desc("time|params|uniform|LAYOUT (e.g. E,t*7|t*8,L)"),
                             cl::init("time"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> MemoryLimit("memory-limit",
                                 cl::desc("Bytes per rank (80GB, 64GiB, none), or one per rank"),
                                 cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Mode("mode", cl::desc("train|infer|generate"), cl::init("train"),
                          cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int64_t> MaxLength("max-length",
                           cl::desc("--mode generate: tokens a row holds, prompt and generated"),
                           cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int64_t> PromptLength("prompt-length",
                              cl::desc("--mode generate: also compile the prefill of prompts of "
                                       "this many tokens (one pass)"),
                              cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int64_t> Slots("slots",
                       cl::desc("--mode generate: rows decoded at once, over all groups "
                                "(default: one per group, or per stage)"),
                       cl::init(0), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Precision("precision", cl::desc("fp32|bf16 (default bf16 on GPUs)"),
                               cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> OptimizerFlag("optimizer", cl::desc("sgd|momentum|adamw"), cl::init("adamw"),
                                   cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Recompute("recompute",
                               cl::desc("none|all|auto: which layers recompute their activations "
                                        "in the backward (alone: all; auto: per stage, the fewest "
                                        "that fit --memory-limit)"),
                               cl::ValueOptional, cl::value_desc("MODE"), cl::cat(CompileCat),
                               cl::sub(CompileCmd));
cl::opt<bool> ShardOptimizer("shard-optimizer",
                             cl::desc("With --dp N: each replica keeps and updates 1/N of the "
                                      "optimizer state (ZeRO-1)"),
                             cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Freeze("freeze",
                            cl::desc("Weights not to train: a regular expression over their "
                                     "names"),
                            cl::value_desc("REGEX"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<bool> TimingOnly("timing-only",
                         cl::desc("Write the plan for its report and simulation alone, even when "
                                  "pipec cannot train or run the model (its warnings say why)"),
                         cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<bool> NoFuse("no-fuse",
                     cl::desc("Keep each node its own kernel: no fused element-wise chains, "
                              "bias adds, transposed weights or attention"),
                     cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string>
    AttentionMode("attention",
                  cl::desc("How training runs attention: fused (one node whose gradient recomputes "
                           "the scores, the default) or unfused (the exporter's nodes, the scores "
                           "kept for the backward)"),
                  cl::init("fused"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<bool> Autocast("autocast",
                       cl::desc("With --precision bf16 in training: activations in bf16 where "
                                "torch.autocast keeps them (products bf16; softmax, norms, losses "
                                "float32), weights float32"),
                       cl::cat(CompileCat), cl::sub(CompileCmd));
cl::list<std::string> Untie("untie",
                            cl::desc("Train a shared initializer as one copy per layer that reads "
                                     "it, or keep a folded tie apart; all: every initializer the "
                                     "exporter shared (repeatable, or a comma list)"),
                            cl::value_desc("NAME|all"), cl::CommaSeparated, cl::cat(CompileCat),
                            cl::sub(CompileCmd));
cl::opt<std::string> Costs("costs", cl::desc("Measured per-layer costs (JSON) over the roofline"),
                           cl::value_desc("FILE"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> DataParallel("dp", cl::desc("Data-parallel replicas"), cl::init(1),
                          cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> TensorParallel("tp",
                            cl::desc("Tensor-parallel ranks per stage: each stage's matrix "
                                     "products split over T ranks of a node (Megatron's split)"),
                            cl::init(1), cl::value_desc("T"), cl::cat(CompileCat),
                            cl::sub(CompileCmd));
cl::opt<bool> SequenceParallel("sequence-parallel",
                               cl::desc("With --tp: norms and residuals split on the sequence "
                                        "over the T ranks (Megatron's sequence parallelism)"),
                               cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Parallel("parallel",
                              cl::desc("auto: choose T, P, D, M and the schedule for --gpus "
                                       "devices (those of --tp, --stages, --dp and "
                                       "--microbatches given stay fixed)"),
                              cl::value_desc("auto"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> Gpus("gpus", cl::desc("--parallel auto: the devices to plan for"), cl::init(0),
                  cl::value_desc("N"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<int> GpusPerNode("gpus-per-node",
                         cl::desc("--parallel auto: devices per node, the most a "
                                  "tensor-parallel group spans (default: the hardware's)"),
                         cl::init(0), cl::value_desc("G"), cl::cat(CompileCat),
                         cl::sub(CompileCmd));
cl::opt<std::string> Emit("emit", cl::desc("Plan encoding: binary|text|json"), cl::init("binary"),
                          cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> LossOutput("loss",
                                cl::desc("Train against this output (default: the one float "
                                         "scalar output that depends on the weights)"),
                                cl::value_desc("NAME"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> LossFn("loss-fn",
                            cl::desc("Add a loss over a non-scalar output: cross-entropy|mse "
                                     "(with --labels)"),
                            cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string> Labels("labels", cl::desc("The graph input an added loss (--loss-fn) reads"),
                            cl::value_desc("INPUT"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<std::string>
    Params("params",
           cl::desc("The model's own tensors (.safetensors, a sharded "
                    "checkpoint's .index.json, or their folder, as "
                    "save_pretrained writes them): map each weight to its parameter, for run "
                    "--init and --save-weights OUT.safetensors"),
           cl::value_desc("CKPT"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::list<std::string> PadRow("pad-row",
                             cl::desc("An embedding's padding row, which takes no gradient "
                                      "(torch's padding_idx): a weight or a --params parameter, "
                                      "and the row (repeatable). With --params, a config.json "
                                      "beside the checkpoint gives pad_token_id's"),
                             cl::value_desc("NAME=ROW"), cl::cat(CompileCat), cl::sub(CompileCmd));
cl::opt<bool> CompileReport("report", cl::desc("Print the partition report"), cl::cat(CompileCat),
                            cl::sub(CompileCmd));

// report
cl::opt<std::string> ReportPlan(cl::Positional, cl::desc("PLAN"), cl::Required, cl::sub(ReportCmd));
cl::opt<std::string> ReportFormat("format", cl::desc("Output format: text, json or html"),
                                  cl::init("text"), cl::sub(ReportCmd));
cl::opt<std::string> ReportTrace("trace",
                                 cl::desc("A measured trace (pipec run --trace): compare its last "
                                          "step with the prediction"),
                                 cl::value_desc("FILE"), cl::sub(ReportCmd));
cl::opt<std::string> ReportOutput("o", cl::desc("Write to FILE instead of stdout"),
                                  cl::value_desc("FILE"), cl::sub(ReportCmd));
cl::opt<std::string> ReportMetrics("metrics",
                                   cl::desc("A run's metrics (pipec run --metrics): html draws "
                                            "the loss, eval loss, lr and tokens/s curves, text "
                                            "sums them up"),
                                   cl::value_desc("FILE"), cl::sub(ReportCmd));

// simulate
cl::opt<std::string> SimulatePlan(cl::Positional, cl::desc("PLAN"), cl::Required,
                                  cl::sub(SimulateCmd));
cl::opt<std::string> TraceFile("trace", cl::desc("Write a Chrome/Perfetto trace (JSON)"),
                               cl::value_desc("FILE"), cl::sub(SimulateCmd));
cl::opt<int> TimelineWidth("width", cl::desc("Columns of the text timeline"), cl::init(100),
                           cl::sub(SimulateCmd));

// profile
cl::opt<std::string> ProfileModel(cl::Positional, cl::desc("MODEL.onnx"), cl::Required,
                                  cl::sub(ProfileCmd));
cl::opt<std::string> ProfileOutput("o", cl::desc("The cost table (JSON)"), cl::value_desc("FILE"),
                                   cl::Required, cl::sub(ProfileCmd));
cl::opt<int64_t> ProfileBatch("batch", cl::desc("Samples per microbatch"), cl::init(1),
                              cl::sub(ProfileCmd));
cl::opt<int> ProfileSteps("steps", cl::desc("Measured steps (after one warm-up)"), cl::init(3),
                          cl::sub(ProfileCmd));

// model
cl::opt<std::string> ModelFamily(cl::Positional, cl::desc("gpt|llama|bert|mlp|resnet"),
                                 cl::Required, cl::sub(ModelCmd));
cl::opt<std::string> ModelOutput("o", cl::desc("Output .onnx file"), cl::value_desc("FILE"),
                                 cl::Required, cl::sub(ModelCmd));
cl::opt<int> ModelLayers("layers", cl::desc("Blocks (resnet: bottleneck blocks, 16 = ResNet-50)"),
                         cl::init(2), cl::sub(ModelCmd));
cl::opt<int> ModelHidden("hidden", cl::desc("Model width"), cl::init(64), cl::sub(ModelCmd));
cl::opt<int> ModelHeads("heads", cl::desc("Attention heads"), cl::init(4), cl::sub(ModelCmd));
cl::opt<int> ModelKvHeads("kv-heads", cl::desc("Llama key/value heads (0 = heads)"), cl::init(0),
                          cl::sub(ModelCmd));
cl::opt<int> ModelFfn("ffn", cl::desc("Feed-forward width (0 = family default)"), cl::init(0),
                      cl::sub(ModelCmd));
cl::opt<int> ModelVocab("vocab", cl::desc("Vocabulary (mlp: features, resnet: classes)"),
                        cl::init(1000), cl::sub(ModelCmd));
cl::opt<int> ModelSeq("seq", cl::desc("Sequence length (resnet: image size)"), cl::init(16),
                      cl::sub(ModelCmd));
cl::opt<int> ModelBatch("batch", cl::desc("Static batch (0 = symbolic 'batch')"), cl::init(0),
                        cl::sub(ModelCmd));
cl::opt<int> ModelOpset("opset", cl::desc("ONNX opset, 13..17"), cl::init(17), cl::sub(ModelCmd));
cl::opt<bool> ModelTied("tied", cl::desc("Tie the LM head to the token embedding"),
                        cl::sub(ModelCmd));
cl::opt<bool> ModelLoss("loss", cl::desc("Add a labels input and a loss output"),
                        cl::sub(ModelCmd));
cl::opt<bool> ModelExternal("external-data", cl::desc("Store weights in FILE.data"),
                            cl::sub(ModelCmd));
cl::opt<bool> ModelFp16("fp16", cl::desc("Store weights as float16"), cl::sub(ModelCmd));
cl::opt<bool> ModelLight("light",
                         cl::desc("Weights as ConstantOfShape fills: structure without bytes"),
                         cl::sub(ModelCmd));
cl::opt<uint64_t> ModelSeed("seed", cl::desc("Weight seed"), cl::init(1), cl::sub(ModelCmd));

Expected<ImportOptions> importOptionsFromFlags() {
  ImportOptions options;
  auto bad = [](StringRef flag, StringRef value, StringRef want) {
    return usageError("--" + flag + " " + value + ": expected " + want);
  };
  for (const std::string &spec : InputShapes) {
    auto [name, dims] = StringRef(spec).split('=');
    if (name.empty() || dims.empty())
      return bad("input-shape", spec, "NAME=D0,D1,..");
    std::vector<int64_t> shape;
    SmallVector<StringRef, 8> parts;
    dims.split(parts, ',');
    for (StringRef part : parts) {
      int64_t d;
      if (part.trim().getAsInteger(10, d) || d < 0)
        return bad("input-shape", spec, "non-negative integer dimensions");
      shape.push_back(d);
    }
    options.bindings.inputShapes[name.str()] = shape;
  }
  for (const std::string &spec : Dims) {
    auto [name, text] = StringRef(spec).split('=');
    int64_t v;
    if (name.empty() || text.getAsInteger(10, v) || v < 0)
      return bad("dim", spec, "NAME=V with a non-negative integer V");
    options.bindings.dims[name.str()] = v;
  }
  if (Batch < 1 || Seq < 1 || Past < 0)
    return usageError("--batch and --seq must be at least 1, --past at least 0");
  options.bindings.batch = Batch;
  options.bindings.seq = Seq;
  options.bindings.past = Past;
  return options;
}

/// The pass-debugging flags for a command that runs \p passes; a
/// --print-after name it does not run is reported as bad usage.
std::optional<PipelineOptions> pipelineOptionsFromFlags(ArrayRef<std::string> passes) {
  PipelineOptions pipeline;
  pipeline.printAfter.assign(PrintAfter.begin(), PrintAfter.end());
  pipeline.dumpDir = DumpDir;
  pipeline.stats = Stats;
  if (Error err = checkPrintAfter(pipeline.printAfter, passes)) {
    reportError(std::move(err));
    return std::nullopt;
  }
  return pipeline;
}

/// Where a command's output goes: stdout, or a file written atomically
/// once the command has produced all of it (a failed write is an error
/// naming the file, and leaves no partial file).
class Output {
public:
  explicit Output(std::string path) : path(std::move(path)), buffer(text) {}
  raw_ostream &stream() {
    if (path.empty())
      return outs();
    return buffer;
  }
  Error finish() {
    if (path.empty())
      return Error::success();
    buffer.flush();
    return writeFileAtomically(path, text);
  }

private:
  std::string path, text;
  raw_string_ostream buffer;
};

int runInspect() {
  if (InspectFormat != "text" && InspectFormat != "json")
    return badUsage("--format " + InspectFormat + ": expected text or json");
  if (Error err = checkNotAnInput("-o", InspectOutput, {InspectModel}))
    return reportError(std::move(err));
  auto importOptions = importOptionsFromFlags();
  if (!importOptions)
    return reportError(importOptions.takeError());
  auto pipeline = pipelineOptionsFromFlags(inspectPasses());
  if (!pipeline)
    return exitUsage;
  PassRunner runner(*pipeline);
  auto graph = loadGraph(InspectModel, *importOptions, runner);
  if (!graph)
    return reportError(graph.takeError());
  auto layers = buildLayerGraph(*graph, runner);
  if (!layers)
    return reportError(layers.takeError());
  Output out(InspectOutput);
  InspectReport report = makeInspectReport(*graph, *layers);
  if (InspectFormat == "json")
    printInspectJson(report, *graph, *layers, out.stream());
  else
    printInspectText(report, *graph, *layers, out.stream());
  if (Error err = out.finish())
    return reportError(std::move(err));
  // Freeing a 100k-node graph node by node takes a tenth of a second and the
  // process ends here: exit without unwinding, leaving the memory to the OS.
  outs().flush();
  std::exit(0);
}

/// --parallel auto, --gpus and --gpus-per-node into \p options: the search
/// for a cluster, which keeps the layout flags given. An exit code when they
/// are misused.
std::optional<int> parallelFromFlags(CompileOptions &options) {
  if (!Parallel.getNumOccurrences()) {
    if (Gpus.getNumOccurrences() || GpusPerNode.getNumOccurrences())
      return badUsage("--gpus and --gpus-per-node: only --parallel auto plans for a cluster");
    return std::nullopt;
  }
  if (Parallel != "auto")
    return badUsage("--parallel " + Parallel + ": expected auto");
  if (!Gpus.getNumOccurrences())
    return badUsage("--parallel auto: give --gpus N, the devices to plan for");
  if (Gpus < 1)
    return badUsage("--gpus " + Twine(Gpus) + ": must be at least 1");
  if (GpusPerNode.getNumOccurrences() && GpusPerNode < 1)
    return badUsage("--gpus-per-node " + Twine(GpusPerNode) + ": must be at least 1");
  options.parallel.gpus = Gpus;
  options.parallel.gpusPerNode = GpusPerNode;
  options.parallel.fixedTp = TensorParallel.getNumOccurrences() > 0;
  options.parallel.fixedStages = Stages.getNumOccurrences() > 0;
  options.parallel.fixedDp = DataParallel.getNumOccurrences() > 0;
  options.parallel.fixedMicrobatches = Microbatches.getNumOccurrences() > 0;
  // The schedule is searched with the layout unless one is given.
  if (!Schedule.getNumOccurrences())
    options.autoSchedule = true;
  return std::nullopt;
}

/// --pad-row NAME=ROW (repeatable) into \p options; an exit code when one is
/// malformed or the mode has no gradients.
std::optional<int> padRowsFromFlags(CompileOptions &options) {
  for (const std::string &spec : PadRow) {
    auto [name, row] = StringRef(spec).rsplit('=');
    int64_t index = -1;
    if (name.empty() || row.getAsInteger(10, index) || index < 0)
      return badUsage("--pad-row " + spec + ": expected NAME=ROW, ROW a row index");
    if (Mode != "train")
      return badUsage("--pad-row: only training (--mode train) has gradients to hold back");
    options.padRows.push_back({name.str(), index});
  }
  return std::nullopt;
}

int runCompile() {
  auto importOptions = importOptionsFromFlags();
  if (!importOptions)
    return reportError(importOptions.takeError());
  auto encoding = parsePlanEncoding(Emit);
  if (!encoding)
    return reportError(encoding.takeError());
  if (Error err = checkNotAnInput("-o", CompileOutput, {CompileModel, Costs, Hardware}))
    return reportError(std::move(err));
  // Given, a count is used as given: 0 or less is refused, never the default.
  if (VirtualStages.getNumOccurrences() && VirtualStages < 1)
    return badUsage("--virtual-stages " + Twine(VirtualStages) + ": must be at least 1");
  if (Microbatches.getNumOccurrences() && Microbatches < 1)
    return badUsage("--microbatches " + Twine(Microbatches) + ": must be at least 1");
  if (GlobalBatch.getNumOccurrences() && GlobalBatch < 1)
    return badUsage("--batch " + Twine(GlobalBatch) + ": must be at least 1");
  CompileOptions options;
  options.import = *importOptions;
  options.stages = Stages;
  options.virtualStages = VirtualStages;
  options.microbatches = Microbatches;
  options.globalBatch = GlobalBatch;
  if (Mode != "train" && Mode != "infer" && Mode != "generate")
    return badUsage("--mode " + Mode + ": expected train, infer or generate");
  options.training = Mode == "train";
  if (Mode == "generate") {
    // One decode step: a token per row, the cache max-length - 1 long; M
    // groups of rows (by default the compile chooses, see
    // generationGroups), by default one row per stage.
    if (MaxLength < 2)
      return badUsage("--mode generate needs --max-length L of at least 2: the tokens a row "
                      "holds, prompt and generated");
    if (Slots.getNumOccurrences() && Slots < 1)
      return badUsage("--slots " + Twine(Slots) + ": must be at least 1");
    if (GlobalBatch.getNumOccurrences())
      return badUsage("--mode generate: the rows are --slots, not --batch");
    if (PromptLength.getNumOccurrences() && PromptLength < 1)
      return badUsage("--prompt-length " + Twine(PromptLength) + ": must be at least 1");
    options.maxLength = MaxLength;
    options.promptLength = PromptLength;
    options.import.bindings.seq = 1;
    options.import.bindings.past = MaxLength - 1;
    options.globalBatch = Slots.getNumOccurrences()          ? Slots
                          : Microbatches.getNumOccurrences() ? Microbatches
                                                             : Stages;
  } else if (MaxLength.getNumOccurrences() || Slots.getNumOccurrences() ||
             PromptLength.getNumOccurrences()) {
    return badUsage("--max-length, --slots and --prompt-length: only --mode generate decodes");
  }
  if (!options.training &&
      (LossOutput.getNumOccurrences() || LossFn.getNumOccurrences() || Labels.getNumOccurrences()))
    return badUsage("--loss, --loss-fn and --labels: only training (--mode train) has a loss");
  options.loss.output = LossOutput;
  options.loss.labels = Labels;
  if (LossFn == "cross-entropy")
    options.loss.addedLoss = LossSpec::Kind::SoftmaxCrossEntropy;
  else if (LossFn == "mse")
    options.loss.addedLoss = LossSpec::Kind::Mse;
  else if (LossFn.getNumOccurrences())
    return badUsage("--loss-fn " + LossFn + ": expected cross-entropy or mse");
  if (std::optional<int> bad = parallelFromFlags(options))
    return *bad;
  if (Schedule == "auto") {
    options.autoSchedule = true;
  } else {
    auto schedule = parseSchedule(Schedule);
    if (!schedule)
      return badUsage(toString(schedule.takeError()));
    options.schedule = *schedule;
  }
  options.hardware = Hardware;
  options.balance = Balance;
  options.memoryLimit = MemoryLimit;
  options.precision = Precision;
  auto optimizer = parseOptimizer(OptimizerFlag);
  if (!optimizer)
    return reportError(optimizer.takeError());
  options.optimizer = *optimizer;
  if (Recompute.getNumOccurrences()) {
    auto recompute = parseRecompute(Recompute.empty() ? "all" : StringRef(Recompute));
    if (!recompute)
      return reportError(recompute.takeError());
    options.recompute = *recompute;
  }
  if (!Freeze.empty()) {
    std::string why;
    if (!Regex(Freeze).isValid(why))
      return badUsage("--freeze " + Freeze + ": " + why);
    options.freeze = Freeze;
  }
  options.timingOnly = TimingOnly;
  options.fuse = !NoFuse;
  if (AttentionMode != "fused" && AttentionMode != "unfused")
    return badUsage("--attention " + AttentionMode + ": expected fused or unfused");
  options.fuseAttention = AttentionMode == "fused";
  options.autocast = Autocast;
  for (const std::string &name : Untie) {
    if (name.empty())
      return badUsage("--untie: expected NAME or all, got an empty name");
    if (name == "all")
      options.untieAll = true;
    else
      options.untie.push_back(name);
  }
  if (!Untie.empty() && Mode != "train")
    return badUsage("--untie: only training (--mode train) has weights to untie");
  options.costs = Costs;
  options.dataParallel = DataParallel;
  options.tensorParallel = TensorParallel;
  options.sequenceParallel = SequenceParallel;
  options.shardOptimizer = ShardOptimizer;
  if (ShardOptimizer && Mode == "infer")
    return badUsage("--shard-optimizer: an inference plan has no optimizer state to shard");
  options.disableFree = true; // the process ends after the plan is written
  auto pipeline = pipelineOptionsFromFlags(passNames());
  if (!pipeline)
    return exitUsage;
  options.params = Params;
  if (std::optional<int> bad = padRowsFromFlags(options))
    return *bad;
  auto plan = compileModel(CompileModel, options, *pipeline);
  if (!plan)
    return reportError(plan.takeError());
  if (!Params.empty()) {
    if (plan->weights().empty())
      return reportError(createStringError(inconvertibleErrorCode(),
                                           "--params: the plan holds no weights to map "
                                           "(compiled with --timing-only?)"));
    auto summary = mapParams(*plan, Params);
    if (!summary)
      return reportError(summary.takeError());
    outs() << formatv("params: {0} of {1} parameters of {2} held by weights ({3} folded), {4} "
                      "tied aliases\n",
                      summary->placed, summary->params, Params, summary->folded, summary->aliases);
    for (const std::string &line : summary->problems)
      outs() << "  warning: " << line << "\n";
  }
  sealPlan(*plan);
  if (Error err = writePlan(*plan, CompileOutput, *encoding))
    return reportError(std::move(err));
  if (CompileReport)
    printReportText(*plan, outs());
  if (!plan->loss().empty())
    outs() << "trains against " << plan->loss() << "\n";
  outs() << "wrote " << CompileOutput << "  (layout " << plan->layout() << ")\n";
  // The process ends here: freeing a large plan message by message takes
  // longer than its encoding (as clang's -disable-free, leave it to exit).
  BuryPointer(std::make_unique<plan::Plan>(std::move(*plan)));
  return 0;
}

int runReport() {
  if (ReportFormat != "text" && ReportFormat != "json" && ReportFormat != "html")
    return badUsage("--format " + ReportFormat + ": expected text, json or html");
  if (!ReportMetrics.empty() && ReportFormat == "json")
    return badUsage("--metrics: html draws the run's curves and text sums them up; json reports "
                    "the plan only (the metrics file is JSON lines already)");
  if (Error err = checkNotAnInput("-o", ReportOutput, {ReportPlan, ReportTrace, ReportMetrics}))
    return reportError(std::move(err));
  auto plan = readVerifiedPlan(ReportPlan);
  if (!plan)
    return reportError(plan.takeError());
  std::vector<MetricsPoint> curves;
  if (!ReportMetrics.empty()) {
    auto read = readMetrics(ReportMetrics);
    if (!read)
      return reportError(read.takeError());
    curves = std::move(*read);
  }
  Output out(ReportOutput);
  raw_ostream *os = &out.stream();
  std::optional<SimulationResult> measured;
  if (!ReportTrace.empty()) {
    auto read = readMeasuredTrace(ReportTrace, RankGrid::of(*plan).ranks());
    if (!read)
      return reportError(read.takeError());
    measured = std::move(*read);
  }
  if (ReportFormat == "json")
    printReportJson(*plan, *os);
  else if (ReportFormat == "html")
    printReportHtml(*plan, *os, measured ? &*measured : nullptr, curves);
  else
    printReportText(*plan, *os);
  if (!curves.empty() && ReportFormat == "text")
    *os << "\n" << summarizeMetrics(curves);
  if (measured && ReportFormat == "text") {
    double predicted = plan->predicted().step_time_s();
    *os << formatv("\nmeasured (last step of {0}): step {1} against {2} predicted ({3:f1}x), "
                   "bubble {4:f1}%\n",
                   ReportTrace, formatSeconds(measured->stepTime), formatSeconds(predicted),
                   predicted > 0 ? measured->stepTime / predicted : 0.0,
                   100 * measured->bubbleFraction);
    for (size_t r = 0; r < measured->busy.size(); ++r) {
      double p = r < static_cast<size_t>(plan->ranks_size()) ? plan->ranks(r).busy_s() : 0;
      *os << formatv("  rank {0}: compute {1} measured, {2} predicted\n", r,
                     formatSeconds(measured->busy[r]), formatSeconds(p));
    }
  }
  if (Error err = out.finish())
    return reportError(std::move(err));
  return 0;
}

int runSimulate() {
  if (TimelineWidth < 20)
    return badUsage("--width " + Twine(TimelineWidth) + ": must be at least 20 columns");
  if (Error err = checkNotAnInput("--trace", TraceFile, {SimulatePlan}))
    return reportError(std::move(err));
  auto plan = readVerifiedPlan(SimulatePlan);
  if (!plan)
    return reportError(plan.takeError());
  auto result = simulatePlan(*plan);
  if (!result)
    return reportError(result.takeError());
  if (!TraceFile.empty()) {
    Output trace(TraceFile);
    writeChromeTrace(*result, trace.stream());
    if (Error err = trace.finish())
      return reportError(std::move(err));
  }
  outs() << formatv("{0} P={1} V={2} M={3}: step {4}, bubble {5:f1}%\n", plan->schedule().name(),
                    plan->schedule().stages(), plan->schedule().virtual_stages(),
                    plan->schedule().microbatches(), formatSeconds(result->stepTime),
                    100 * result->bubbleFraction);
  for (size_t r = 0; r < result->busy.size(); ++r)
    outs() << formatv("  rank {0}: busy {1}, idle {2}, peak memory {3}\n", r,
                      formatSeconds(result->busy[r]), formatSeconds(result->idle[r]),
                      humanCount(result->peakMemory[r], true));
  outs() << "\n"
         << formatTimeline(*result, plan->schedule().stages(), TimelineWidth.getValue()) << "  "
         << timelineLegend() << "\n";
  if (!TraceFile.empty())
    outs() << "wrote " << TraceFile << "\n";
  return 0;
}

int runProfile() {
  auto importOptions = importOptionsFromFlags();
  if (!importOptions)
    return reportError(importOptions.takeError());
  if (ProfileBatch < 1 || ProfileSteps < 1)
    return badUsage("--batch and --steps must be at least 1");
  if (Error err = checkNotAnInput("-o", ProfileOutput, {ProfileModel}))
    return reportError(std::move(err));
  ProfileOptions options;
  options.import = *importOptions;
  options.microbatchSize = ProfileBatch;
  options.steps = ProfileSteps;
  std::string text;
  raw_string_ostream os(text);
  if (Error err = profileModel(ProfileModel, options, os))
    return reportError(std::move(err));
  if (Error err = writeFileAtomically(ProfileOutput, os.str()))
    return reportError(std::move(err));
  outs() << "wrote " << ProfileOutput << " (compile with --costs " << ProfileOutput << ")\n";
  return 0;
}

int runModel() {
  auto family = models::parseFamily(ModelFamily);
  if (!family)
    return badUsage(toString(family.takeError()));
  models::GeneratorOptions options(*family, ModelLayers, ModelHidden, ModelVocab, ModelSeq,
                                   ModelHeads);
  options.kvHeads = ModelKvHeads;
  options.ffn = ModelFfn;
  options.batch = ModelBatch;
  options.opset = ModelOpset;
  options.tiedEmbeddings = ModelTied;
  options.withLoss = ModelLoss;
  options.seed = ModelSeed;
  options.fp16Weights = ModelFp16;
  options.lightWeights = ModelLight;
  // The generator refuses only what its flags asked for.
  auto model = models::generateModel(options);
  if (!model)
    return badUsage(toString(model.takeError()));
  if (Error err = models::writeModel(*model, ModelOutput, ModelExternal))
    return reportError(std::move(err));
  outs() << "wrote " << ModelOutput << " (" << model->graph().node_size() << " nodes, "
         << model->graph().initializer_size() << " initializers)\n";
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  InitLLVM init(argc, argv);
  applyMachineEnvironment();
  // Paths go into plans, reports and traces as UTF-8 text (protobuf's
  // strings must be UTF-8): one that is not is refused before anything is
  // written, rather than written into a plan no reader can parse.
  for (int i = 1; i < argc; ++i) {
    const auto *begin = reinterpret_cast<const UTF8 *>(argv[i]);
    if (!isLegalUTF8String(&begin, begin + std::strlen(argv[i])))
      return badUsage("argument " + Twine(i) +
                      " is not valid UTF-8; pipec records paths as "
                      "UTF-8 text");
  }
  // --recompute takes an optional value: "--recompute auto" is read as
  // "--recompute=auto", as a user types it.
  std::vector<char *> args(argv, argv + argc);
  for (size_t i = 1; i + 1 < args.size(); ++i)
    if (StringRef(args[i]) == "--recompute" &&
        is_contained(ArrayRef<StringRef>{"none", "all", "auto"}, StringRef(args[i + 1]))) {
      static std::list<std::string> merged; // outlives the parse; never moves
      merged.push_back("--recompute=" + std::string(args[i + 1]));
      args[i] = merged.back().data();
      args.erase(args.begin() + i + 1);
    }
  argc = static_cast<int>(args.size());
  argv = args.data();
  // The linked LLVM libraries register their code-generation options in the
  // general category: only pipec's own, and help and version, are shown.
  cl::HideUnrelatedOptions({&ShapeCat, &DebugCat, &CompileCat});
  cl::SetVersionPrinter([](raw_ostream &os) { printVersions(os); });
  // llvm::cl writes some of its messages to stderr itself rather than to
  // the stream it is given: both are caught, to be printed in one form.
  std::string errors;
  raw_string_ostream errorStream(errors);
  std::FILE *caught = std::tmpfile();
  int savedErr = caught ? dup(2) : -1;
  if (savedErr >= 0)
    dup2(fileno(caught), 2);
  bool parsed = cl::ParseCommandLineOptions(
      argc, argv,
      "pipec: compile ONNX models into pipeline-parallel plans\n\n"
      "  pipec inspect MODEL.onnx [--format text|json]\n"
      "  pipec compile MODEL.onnx -o MODEL.plan [--stages P] ...\n"
      "  pipec report MODEL.plan [--format text|json|html] [--trace run.json]\n"
      "  pipec simulate MODEL.plan [--trace trace.json]\n"
      "  pipec run MODEL.plan [--steps N] [--data DIR|FILE] [--eval-data ...] ...\n"
      "  pipec profile MODEL.onnx -o costs.json [--batch B]\n"
      "  mpirun -np P pipec run MODEL.plan --comm mpi\n"
      "  pipec model gpt|llama|bert|mlp|resnet [options] -o FILE\n"
      "  pipec schedules                       the pipeline schedules, as a table\n\n"
      "Exit codes: 0 ok, 1 bad input or failed step, 2 bad usage.\n",
      &errorStream);
  errs().flush();
  if (savedErr >= 0) {
    dup2(savedErr, 2);
    close(savedErr);
    std::rewind(caught);
    std::string direct;
    char chunk[4096];
    for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, caught)) > 0;)
      direct.append(chunk, n);
    errorStream.flush();
    errors = direct + errors;
  }
  if (caught)
    std::fclose(caught);
  if (parsed && !errors.empty())
    errs() << errors;
  if (!parsed) {
    errorStream.flush();
    // llvm::cl's own messages ("pipec: Unknown command line argument ...")
    // in the one form every error has: one "pipec: error: " line.
    SmallVector<StringRef, 4> lines;
    StringRef(errors).split(lines, '\n', -1, /*KeepEmpty=*/false);
    std::string text;
    for (StringRef line : lines) {
      line = line.trim();
      if (line.consume_front("pipec: "))
        line.consume_front("error: ");
      if (!line.empty())
        text += (text.empty() ? "" : " ") + line.str();
    }
    return badUsage(text);
  }
  if (Error err = blas::check())
    return badUsage(toString(std::move(err)));
  (void)cpu::fewRowChoice(); // measured now, on a quiet thread, as the BLAS is
  if (InspectCmd)
    return runInspect();
  if (ModelCmd)
    return runModel();
  if (CompileCmd)
    return runCompile();
  if (ReportCmd)
    return runReport();
  if (SimulateCmd)
    return runSimulate();
  if (runCommandGiven())
    return runRun();
  if (generateCommandGiven())
    return runGenerate();
  if (ProfileCmd)
    return runProfile();
  if (SchedulesCmd) {
    outs() << scheduleTableMarkdown();
    return 0;
  }
  return badUsage("no command given; try 'pipec --help'");
}
