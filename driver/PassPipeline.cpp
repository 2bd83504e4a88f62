//===- PassPipeline.cpp - Import, run the graph passes, group layers ------===//
#include "driver/PassPipeline.h"
#include "passes/EliminateDead.h"
#include "passes/FoldConstants.h"
#include "passes/GroupLayers.h"
#include "passes/InferShapes.h"
#include "runtime/plan/PlanFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <chrono>

using namespace llvm;

namespace pipec {
namespace {

raw_ostream &logOf(const PipelineOptions &options) { return options.log ? *options.log : errs(); }

bool wantsPrint(const PipelineOptions &options, StringRef pass) {
  for (const auto &name : options.printAfter)
    if (name == pass || name == "all")
      return true;
  return false;
}

Error dump(const PipelineOptions &options, int index, StringRef pass,
           function_ref<void(raw_ostream &)> print) {
  if (wantsPrint(options, pass)) {
    raw_ostream &os = logOf(options);
    os << "// -----// IR after " << pass << " //----- //\n";
    print(os);
  }
  if (options.dumpDir.empty())
    return Error::success();
  if (std::error_code ec = sys::fs::create_directories(options.dumpDir))
    return createStringError(ec, "--dump-dir %s: %s", options.dumpDir.c_str(),
                             ec.message().c_str());
  SmallString<256> file(options.dumpDir);
  sys::path::append(file, formatv("{0:2}-{1}.txt", index, pass).str());
  std::string text;
  raw_string_ostream os(text);
  print(os);
  return writeFileAtomically(file, os.str());
}

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

} // namespace

std::vector<std::string> passNames() {
  std::vector<std::string> names;
#define PIPEC_GRAPH_PASS(NAME, CLASS) names.push_back(NAME);
#define PIPEC_LOWERING(NAME, FUNCTION) names.push_back(NAME);
#include "passes/Passes.def"
  return names;
}

Error runGraphPasses(Graph &graph, const PipelineOptions &options) {
  int index = 1;
  auto runOne = [&](StringRef name, auto pass) -> Error {
    auto start = Clock::now();
    int before = graph.liveOpCount();
    auto changed = pass.run(graph);
    if (!changed)
      return changed.takeError();
    if (options.verify)
      if (Error err = verifyGraph(graph, /*requireShapes=*/true))
        return createStringError(inconvertibleErrorCode(), "after %s: %s", name.str().c_str(),
                                 toString(std::move(err)).c_str());
    if (options.stats)
      logOf(options) << formatv("stats: {0,-16} {1,8:f3} ms  ops {2} -> {3}{4}\n", name,
                                secondsSince(start) * 1e3, before, graph.liveOpCount(),
                                *changed ? "" : "  (no change)");
    return dump(options, index++, name, [&](raw_ostream &os) { printGraph(graph, os); });
  };
#define PIPEC_GRAPH_PASS(NAME, CLASS)                                                              \
  if (Error err = runOne(NAME, CLASS()))                                                           \
    return err;
#include "passes/Passes.def"
  return Error::success();
}

std::vector<std::string> printablePasses() {
  std::vector<std::string> names = {"import"};
#define PIPEC_GRAPH_PASS(NAME, CLASS) names.push_back(NAME);
#include "passes/Passes.def"
  names.push_back("group-layers");
  return names;
}

Expected<Graph> loadGraph(StringRef path, const ImportOptions &importOptions,
                          const PipelineOptions &options) {
  std::vector<std::string> printable = printablePasses();
  for (const std::string &name : options.printAfter)
    if (name != "all" && llvm::find(printable, name) == printable.end())
      return createStringError(inconvertibleErrorCode(),
                               "--print-after %s: the passes that print are %s, or all",
                               name.c_str(), join(printable, ", ").c_str());
  auto start = Clock::now();
  auto graph = importOnnx(path, importOptions);
  if (!graph)
    return graph.takeError();
  if (options.stats)
    logOf(options) << formatv("stats: {0,-16} {1,8:f3} ms  ops {2}\n", "import",
                              secondsSince(start) * 1e3, graph->liveOpCount());
  if (Error err = dump(options, 0, "import", [&](raw_ostream &os) { printGraph(*graph, os); }))
    return err;
  if (Error err = runGraphPasses(*graph, options))
    return err;
  return graph;
}

Expected<LayerGraph> buildLayerGraph(const Graph &graph, const PipelineOptions &options) {
  auto start = Clock::now();
  auto layers = groupLayers(graph);
  if (!layers)
    return layers.takeError();
  if (options.stats)
    logOf(options) << formatv("stats: {0,-16} {1,8:f3} ms  layers {2} ({3})\n", "group-layers",
                              secondsSince(start) * 1e3, layers->layers.size(),
                              groupingMethodName(layers->method));
  auto names = passNames();
  int index =
      static_cast<int>(std::find(names.begin(), names.end(), "group-layers") - names.begin()) + 1;
  if (Error err = dump(options, index, "group-layers", [&](raw_ostream &os) { layers->print(os); }))
    return err;
  return layers;
}

} // namespace pipec
