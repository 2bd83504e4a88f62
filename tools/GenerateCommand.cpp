//===- GenerateCommand.cpp - `pipec generate` ----------------------------===//
//
// Tokens after prompts with a plan compiled by --mode generate
// (runtime/exec/Generate.h): threads of this process, or one MPI process
// per rank.
//
//===----------------------------------------------------------------------===//
#include "driver/PlanVerify.h"
#include "driver/Report.h"
#include "runtime/comm/Comm.h"
#include "runtime/exec/Data.h"
#include "runtime/exec/Generate.h"
#include "tools/CliSupport.h"

#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <utility>

using namespace llvm;

namespace pipec::cli {

namespace {

cl::SubCommand GenerateCmd("generate",
                           "Generate tokens after prompts with a plan compiled by --mode generate");

cl::opt<std::string> GenPlan(cl::Positional, cl::desc("PLAN"), cl::Required, cl::sub(GenerateCmd));
cl::opt<std::string> GenPrompts("prompts", cl::desc("Prompts: int64 token ids [N, S] (.npy)"),
                                cl::value_desc("FILE"), cl::Required, cl::sub(GenerateCmd));
cl::opt<int64_t> GenNewTokens("max-new-tokens", cl::desc("Tokens to generate after each prompt"),
                              cl::init(16), cl::sub(GenerateCmd));
cl::opt<bool> GenGreedy("greedy", cl::desc("Pick the most likely token (the default)"),
                        cl::sub(GenerateCmd));
cl::opt<double> GenTemperature("temperature", cl::desc("Sample, at this temperature"),
                               cl::init(1.0), cl::sub(GenerateCmd));
cl::opt<int64_t> GenTopK("top-k", cl::desc("Sample among the K most likely tokens (0: all)"),
                         cl::init(0), cl::sub(GenerateCmd));
cl::opt<double> GenTopP("top-p", cl::desc("Sample among the most likely tokens of mass P"),
                        cl::init(1.0), cl::sub(GenerateCmd));
cl::opt<uint64_t> GenSeed("seed", cl::desc("Seed of the samples"), cl::init(0),
                          cl::sub(GenerateCmd));
cl::opt<int64_t> GenEos("eos", cl::desc("End-of-sequence token id: a row ends at it"), cl::init(-1),
                        cl::sub(GenerateCmd));
cl::opt<std::string> GenOutput("o",
                               cl::desc("Write the generated ids here (.npy, int64 [N, "
                                        "max-new-tokens])"),
                               cl::value_desc("FILE"), cl::sub(GenerateCmd));
cl::opt<std::string> GenTrace("trace", cl::desc("Write the measured timeline (Chrome trace)"),
                              cl::value_desc("FILE"), cl::sub(GenerateCmd));
cl::opt<std::string> GenModel("model", cl::desc("The model file (default: the plan's path)"),
                              cl::value_desc("FILE"), cl::sub(GenerateCmd));
cl::opt<int> GenThreadsPerRank("threads-per-rank", cl::desc("Loop threads per rank"),
                               cl::sub(GenerateCmd));
cl::opt<std::string> GenComm("comm",
                             cl::desc("local (threads) or mpi (one process per rank; the default "
                                      "under mpirun)"),
                             cl::sub(GenerateCmd));
cl::opt<std::string> GenBackend("backend", cl::desc("cpu or cuda"), cl::init("cpu"),
                                cl::sub(GenerateCmd));
cl::opt<int>
    GenRanksPerDevice("ranks-per-device",
                      cl::desc("CUDA: ranks sharing one device (rank r uses device r / N)"),
                      cl::init(1), cl::sub(GenerateCmd));
cl::opt<double> GenTimeout("timeout", cl::desc("Seconds a rank may wait without progress"),
                           cl::init(120), cl::sub(GenerateCmd));

} // namespace

bool generateCommandGiven() { return bool(GenerateCmd); }

int runGenerate() {
  bool sampling = GenTemperature.getNumOccurrences() || GenTopK.getNumOccurrences() ||
                  GenTopP.getNumOccurrences() || GenSeed.getNumOccurrences();
  if (GenGreedy && sampling)
    return badUsage("--greedy and --temperature, --top-k, --top-p or --seed exclude each other");
  for (auto [flag, path] :
       {std::pair<StringRef, StringRef>{"-o", GenOutput}, {"--trace", GenTrace}})
    if (Error err = checkNotAnInput(flag, path, {GenPlan, GenPrompts, GenModel}))
      return reportError(std::move(err));
  rt::GenerateOptions options;
  options.run.modelPath = GenModel;
  options.run.planDir = sys::path::parent_path(GenPlan).str();
  options.run.timeoutSeconds = GenTimeout;
  if (GenBackend != "cpu" && GenBackend != "cuda")
    return badUsage("--backend " + GenBackend + ": expected cpu or cuda");
  if (GenRanksPerDevice < 1)
    return badUsage("--ranks-per-device " + Twine(GenRanksPerDevice) + ": must be at least 1");
  options.run.backend = GenBackend;
  options.run.ranksPerDevice = GenRanksPerDevice;
  if (GenThreadsPerRank.getNumOccurrences())
    options.run.threadsPerRank = GenThreadsPerRank;
  options.maxNewTokens = GenNewTokens;
  options.tracePath = GenTrace;
  options.greedy = !sampling;
  options.temperature = GenTemperature;
  options.topK = GenTopK;
  options.topP = GenTopP;
  options.seed = GenSeed;
  if (GenEos.getNumOccurrences())
    options.eos = GenEos;
  auto plan = readVerifiedPlan(GenPlan);
  if (!plan)
    return reportError(plan.takeError());
  auto prompts = rt::readNpy(GenPrompts);
  if (!prompts)
    return reportError(prompts.takeError());
  std::string comm = GenComm.empty() ? (launchedByMpi() ? "mpi" : "local") : GenComm.getValue();
  if (comm != "local" && comm != "mpi")
    return badUsage("--comm " + comm + ": expected local or mpi");
  auto result = comm == "local" ? rt::generateLocal(*plan, options, *prompts)
                                : rt::generateMpi(*plan, options, *prompts);
  if (!result)
    return reportError(result.takeError());
  if (!result->primary)
    return 0;
  if (!GenOutput.empty())
    if (Error err = rt::writeNpy(result->tokens, GenOutput))
      return reportError(std::move(err));
  outs() << formatv(
      "generated {0} token(s) after {1} prompt(s) on {2} rank(s), {3} group(s) of "
      "{4}: {5:f1} tokens/s; first token after {6}, then {7} per token\n",
      result->generated, prompts->dim(0), plan->schedule().stages(), plan->generation().groups(),
      plan->schedule().microbatch_size(), result->generated / std::max(result->seconds, 1e-9),
      formatSeconds(result->firstTokenSeconds), formatSeconds(result->perTokenSeconds));
  if (GenBackend == "cpu")
    outs() << formatv("cpu: {0}, {1} thread(s) per rank\n", result->blas, result->threadsPerRank);
  if (!GenOutput.empty())
    outs() << "wrote " << GenOutput << "\n";
  if (!GenTrace.empty())
    outs() << "wrote " << GenTrace << "\n";
  return 0;
}

} // namespace pipec::cli
