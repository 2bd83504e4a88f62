//===- CliSupport.cpp - What pipec's commands share ----------------------===//
#include "tools/CliSupport.h"
#include "driver/InspectReport.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/WithColor.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdlib>

using namespace llvm;

namespace pipec::cli {

bool launchedByMpi() {
  for (const char *var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(var))
      return true;
  return false;
}

rt::RunOptions runOptionsFromEnvironment() {
  rt::RunOptions options;
  if (const char *fault = std::getenv("PIPEC_FAULT"))
    options.fault = rt::parseFault(fault);
  return options;
}

int reportError(Error err) {
  int code = exitInput;
  std::string text;
  handleAllErrors(
      std::move(err),
      [&](const UsageError &e) {
        code = exitUsage;
        text += (text.empty() ? "" : "; ") + e.message();
      },
      [&](const ErrorInfoBase &e) { text += (text.empty() ? "" : "; ") + e.message(); });
  WithColor::error(errs(), "pipec") << text << "\n";
  return code;
}

int badUsage(const Twine &what) { return reportError(usageError(what)); }

Error checkNotAnInput(StringRef flag, StringRef output, ArrayRef<StringRef> inputs) {
  if (output.empty())
    return Error::success();
  if (Error err = checkOutputPath(output))
    return err;
  for (StringRef input : inputs)
    if (!input.empty() && (output == input || sys::fs::equivalent(output, input)))
      return usageError(flag + " " + output + ": is an input of this command; write elsewhere");
  return Error::success();
}

/// Which node each rank ran on, in runs: "node0 ranks 0-1, node1 ranks 2-4".
std::string formatRankNodes(const std::vector<std::string> &nodes) {
  std::string where;
  for (size_t r = 0; r < nodes.size();) {
    size_t end = r;
    while (end + 1 < nodes.size() && nodes[end + 1] == nodes[r])
      ++end;
    where += formatv("{0}{1} rank{2} {3}", where.empty() ? "" : ", ", nodes[r], end > r ? "s" : "",
                     end > r ? formatv("{0}-{1}", r, end).str() : std::to_string(r))
                 .str();
    r = end + 1;
  }
  return where;
}

/// The measured peak resident set of the steps beside the plan's prediction
/// for the same ranks: "memory: peak resident 3.2 GiB in the steps for the
/// process (2 ranks), plan predicted 2.9 GiB for their tensors; 1.9 GiB
/// while loading", or per rank under MPI. The plan counts tensors; a process
/// adds its code, libraries and allocator slack.
std::string formatMemory(const plan::Plan &plan, const std::vector<int64_t> &resident,
                         const std::vector<int64_t> &loading) {
  if (plan.ranks_size() == 0 || resident.empty())
    return "memory: not measured";
  int stages = plan.ranks_size();
  int processes = static_cast<int>(resident.size());
  RankGrid grid = RankGrid::of(plan);
  int ranks = grid.ranks();
  auto predicted = [&](int rank) {
    return plan.ranks(grid.pipelineRankOf(rank) % stages).peak_memory_bytes();
  };
  if (processes == 1) {
    int64_t sum = 0;
    for (int g = 0; g < ranks; ++g)
      sum += predicted(g);
    return formatv("memory: peak resident {0} in the steps for the process ({1} rank(s)), plan "
                   "predicted {2} for their tensors; {3} while loading",
                   humanCount(resident[0], true), ranks, humanCount(sum, true),
                   humanCount(loading.empty() ? 0 : loading[0], true));
  }
  std::string measured, model, loaded;
  for (int g = 0; g < processes; ++g) {
    measured += (g ? " / " : "") + humanCount(resident[g], true);
    model += (g ? " / " : "") + humanCount(predicted(g), true);
    loaded += (g ? " / " : "") + humanCount(g < int(loading.size()) ? loading[g] : 0, true);
  }
  return formatv("memory: peak resident per rank {0} in the steps, plan predicted {1} for their "
                 "tensors; {2} while loading",
                 measured, model, loaded);
}

std::string formatDeviceMemory(const plan::Plan &plan, const std::map<int, int64_t> &peaks) {
  std::string out;
  for (const auto &[rank, bytes] : peaks) {
    if (rank < 0 || rank >= plan.ranks_size())
      continue;
    int64_t predicted = plan.ranks(rank).peak_memory_bytes();
    out += formatv("{0}rank {1} peak {2}, plan {3} ({4}x)", out.empty() ? "" : "; ", rank,
                   humanCount(bytes, true), humanCount(predicted, true),
                   format("%.2f", predicted > 0 ? double(bytes) / double(predicted) : 0.0))
               .str();
  }
  return out.empty() ? out : "device memory: " + out;
}

} // namespace pipec::cli
