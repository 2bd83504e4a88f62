//===- PassPipeline.cpp - The pipeline of named passes --------------------===//
#include "driver/PassPipeline.h"
#include "passes/EliminateDead.h"
#include "passes/FoldConstants.h"
#include "passes/FuseAttention.h"
#include "passes/GroupLayers.h"
#include "passes/InferShapes.h"
#include "passes/ShardTensors.h"
#include "plan/PlanFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cassert>
#include <chrono>
#include <optional>

using namespace llvm;

namespace pipec {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

} // namespace

std::vector<std::string> passNames() {
  std::vector<std::string> names;
#define PIPEC_IMPORT(NAME, FUNCTION, SHOWS, COUNTS) names.push_back(NAME);
#define PIPEC_GRAPH_PASS(NAME, FUNCTION, SHOWS, COUNTS) names.push_back(NAME);
#define PIPEC_LOWERING(NAME, FUNCTION, SHOWS, COUNTS) names.push_back(NAME);
#include "passes/Passes.def"
  return names;
}

std::string passTable() {
  std::string table =
      "| NN | pass | `--print-after` shows | `--stats` counts |\n|---|---|---|---|\n";
  int index = 0;
  auto row = [&](StringRef name, StringRef shows, StringRef counts) {
    table += formatv("| {0:2} | {1} | {2} | {3} |\n", index++, name, shows, counts).str();
  };
#define PIPEC_IMPORT(NAME, FUNCTION, SHOWS, COUNTS) row(NAME, SHOWS, COUNTS);
#define PIPEC_GRAPH_PASS(NAME, FUNCTION, SHOWS, COUNTS) row(NAME, SHOWS, COUNTS);
#define PIPEC_LOWERING(NAME, FUNCTION, SHOWS, COUNTS) row(NAME, SHOWS, COUNTS);
#include "passes/Passes.def"
  return table;
}

std::vector<std::string> inspectPasses() {
  std::vector<std::string> names = passNames();
  names.erase(std::find(names.begin(), names.end(), "group-layers") + 1, names.end());
  return names;
}

Error checkPrintAfter(ArrayRef<std::string> printAfter, ArrayRef<std::string> runs) {
  std::vector<std::string> all = passNames();
  for (const std::string &name : printAfter) {
    if (name == "all" || is_contained(runs, name))
      continue;
    if (is_contained(all, name))
      return createStringError(inconvertibleErrorCode(),
                               "--print-after %s: this command runs %s (or all); %s runs under "
                               "compile",
                               name.c_str(), join(runs, ", ").c_str(), name.c_str());
    return createStringError(inconvertibleErrorCode(),
                             "--print-after %s: expected all or a pass: %s", name.c_str(),
                             join(all, ", ").c_str());
  }
  return Error::success();
}

PassRunner::PassRunner(PipelineOptions options) : opts(std::move(options)), names(passNames()) {}

PassRunner PassRunner::quiet() const {
  PipelineOptions options;
  options.verify = opts.verify;
  options.log = opts.log;
  return PassRunner(std::move(options));
}

bool PassRunner::shows() const {
  return opts.stats || !opts.printAfter.empty() || !opts.dumpDir.empty();
}

int PassRunner::advance(StringRef name) {
  auto it = llvm::find(names, name);
  assert(it != names.end() && "a pass missing from Passes.def");
  int index = static_cast<int>(it - names.begin());
  assert(index > last && "passes run in Passes.def order");
  last = index;
  return index;
}

bool PassRunner::wantsPrint(StringRef name) const {
  return llvm::any_of(opts.printAfter,
                      [&](const std::string &p) { return p == name || p == "all"; });
}

raw_ostream &PassRunner::log() const { return opts.log ? *opts.log : errs(); }

Error PassRunner::show(int index, StringRef name, function_ref<void(raw_ostream &)> print) const {
  if (wantsPrint(name)) {
    raw_ostream &os = log();
    os << "// -----// IR after " << name << " //----- //\n";
    print(os);
  }
  if (opts.dumpDir.empty())
    return Error::success();
  if (std::error_code ec = sys::fs::create_directories(opts.dumpDir))
    return createStringError(ec, "--dump-dir %s: %s", opts.dumpDir.c_str(), ec.message().c_str());
  SmallString<256> file(opts.dumpDir);
  sys::path::append(file, formatv("{0:2}-{1}.txt", index, name).str());
  std::string text;
  raw_string_ostream os(text);
  print(os);
  return writeFileAtomically(file, os.str());
}

Error PassRunner::run(StringRef name, function_ref<Error()> body,
                      function_ref<std::string()> summary,
                      function_ref<void(raw_ostream &)> print) {
  int index = advance(name);
  auto start = Clock::now();
  if (Error err = body())
    return err;
  if (opts.stats)
    log() << formatv("stats: {0,-16} {1,8:f3} ms  {2}\n", name, secondsSince(start) * 1e3,
                     summary());
  return show(index, name, print);
}

Error PassRunner::skip(StringRef name, StringRef why) {
  int index = advance(name);
  if (opts.stats)
    log() << formatv("stats: {0,-16} {1,11}  not run: {2}\n", name, "", why);
  return show(index, name, [&](raw_ostream &os) { os << "// not run: " << why << "\n"; });
}

Error runGraphPasses(Graph &graph, PassRunner &runner) {
  auto runOne = [&](StringRef name, Expected<bool> (*pass)(Graph &)) -> Error {
    int before = graph.liveOpCount();
    bool changed = false;
    return runner.run(
        name,
        [&]() -> Error {
          auto result = pass(graph);
          if (!result)
            return result.takeError();
          changed = *result;
          if (runner.options().verify)
            if (Error err = verifyGraph(graph, /*requireShapes=*/true))
              return createStringError(inconvertibleErrorCode(), "after %s: %s", name.str().c_str(),
                                       toString(std::move(err)).c_str());
          return Error::success();
        },
        [&] {
          return formatv("ops {0} -> {1}{2}", before, graph.liveOpCount(),
                         changed ? "" : "  (no change)")
              .str();
        },
        [&](raw_ostream &os) { printGraph(graph, os); });
  };
#define PIPEC_GRAPH_PASS(NAME, FUNCTION, SHOWS, COUNTS)                                            \
  if (Error err = runOne(NAME, FUNCTION))                                                          \
    return err;
#include "passes/Passes.def"
  return Error::success();
}

Error runGraphPasses(Graph &graph, const PipelineOptions &options) {
  PassRunner runner(options);
  return runGraphPasses(graph, runner);
}

Expected<Graph> loadGraph(StringRef path, const ImportOptions &importOptions, PassRunner &runner) {
  std::optional<Graph> graph;
  Error err = runner.run(
      "import",
      [&]() -> Error {
        auto imported = importOnnx(path, importOptions);
        if (!imported)
          return imported.takeError();
        graph.emplace(std::move(*imported));
        return Error::success();
      },
      [&] { return formatv("ops {0}", graph->liveOpCount()).str(); },
      [&](raw_ostream &os) { printGraph(*graph, os); });
  if (err)
    return err;
  if (Error passErr = runGraphPasses(*graph, runner))
    return passErr;
  return std::move(*graph);
}

Expected<Graph> loadGraph(StringRef path, const ImportOptions &importOptions,
                          const PipelineOptions &options) {
  PassRunner runner(options);
  return loadGraph(path, importOptions, runner);
}

Expected<LayerGraph> buildLayerGraph(const Graph &graph, PassRunner &runner) {
  std::optional<LayerGraph> layers;
  Error err = runner.run(
      "group-layers",
      [&]() -> Error {
        auto grouped = groupLayers(graph);
        if (!grouped)
          return grouped.takeError();
        layers.emplace(std::move(*grouped));
        return Error::success();
      },
      [&] {
        return formatv("layers {0} ({1})", layers->layers.size(),
                       groupingMethodName(layers->method))
            .str();
      },
      [&](raw_ostream &os) { layers->print(os); });
  if (err)
    return err;
  return std::move(*layers);
}

} // namespace pipec
