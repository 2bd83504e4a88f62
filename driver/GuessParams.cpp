//===- GuessParams.cpp - The parameters the graph's structure shows -------===//
//
// Without a --params checkpoint, what train-params and tie-weights take for
// the user's parameters (driver/MapParams.h's guessMergedSplits and
// guessParamFolds): a value of one number read by several modules is the
// exporter's merge of one parameter per module; equal initializers that one
// module reads are its one parameter, exported once per call; copies along
// an axis are one parameter broadcast.
//
//===----------------------------------------------------------------------===//
#include "driver/MapParams.h"
#include "driver/ParamMatch.h"
#include "passes/Differentiate.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <map>
#include <set>

using namespace llvm;

namespace pipec {

using namespace params;

Expected<std::map<std::string, std::vector<ParamSplit>>> guessMergedSplits(const Graph &graph) {
  std::map<std::string, std::vector<ParamSplit>> splits;
  std::map<std::string, std::vector<Reader>> readers = readersOf(*graph.model, graph.fileNodes);
  // Only the values of weights that several modules (or unnamed nodes) read.
  auto weights = graphWeights(graph, [&](const Value &v) {
    auto it = readers.find(v.name);
    std::set<std::string> modules;
    for (const Reader &r : it == readers.end() ? std::vector<Reader>() : it->second)
      modules.insert(r.scope.empty() ? std::to_string(r.node) : r.scope);
    return modules.size() >= 2;
  });
  if (!weights)
    return weights.takeError();
  std::vector<bool> data = dataWeights(graph);
  for (const Weight &w : *weights) {
    int id = graph.findValue(w.name);
    auto it = readers.find(w.name);
    if (data[id] || w.value.numElements() < 2 || !oneValue(w.value) || it == readers.end())
      continue;
    std::vector<ParamSplit> mine; // one per module, in the order of their first reads
    for (const Reader &r : it->second) {
      std::string module =
          r.scope.empty() ? formatv("node {0} input {1}", r.node, r.input).str() : r.scope;
      auto at = find_if(mine, [&](const ParamSplit &p) { return p.param == module; });
      if (at == mine.end()) {
        std::string copy = r.scope.empty() ? std::to_string(mine.size() + 1) : module;
        mine.push_back({module, w.name + "." + copy, {}, /*guessed=*/true});
        at = mine.end() - 1;
      }
      at->readers.push_back({r.node, r.input});
    }
    if (mine.size() >= 2)
      splits[w.name] = std::move(mine);
  }
  return splits;
}

namespace {

/// The largest weight looked at for copies along an axis (4 Mi elements).
constexpr int64_t kMaxBroadcastElements = int64_t(1) << 22;

/// \p t with every axis along which it holds equal copies (all its slices
/// alike) cut to its first slice, of size 1.
cpu::Tensor broadcastCore(const cpu::Tensor &t) {
  cpu::Tensor core = t;
  std::vector<int64_t> shape = t.shape();
  for (size_t axis = 0; axis < shape.size(); ++axis) {
    if (shape[axis] < 2)
      continue;
    int64_t outer = 1, inner = 1;
    for (size_t a = 0; a < axis; ++a)
      outer *= shape[a];
    for (size_t a = axis + 1; a < shape.size(); ++a)
      inner *= shape[a];
    int64_t n = shape[axis];
    bool copies = true;
    for (int64_t o = 0; o < outer && copies; ++o)
      for (int64_t i = 1; i < n && copies; ++i)
        for (int64_t k = 0; k < inner && copies; ++k)
          copies = core.getDouble((o * n + i) * inner + k) == core.getDouble(o * n * inner + k);
    if (!copies)
      continue;
    std::vector<int64_t> cut = shape;
    cut[axis] = 1;
    cpu::Tensor first(core.elemType(), cut);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t k = 0; k < inner; ++k)
        first.setDouble(o * inner + k, core.getDouble(o * n * inner + k));
    core = std::move(first);
    shape = std::move(cut);
  }
  return core;
}

} // namespace

Expected<std::vector<ParamFold>> guessParamFolds(const Graph &graph,
                                                 const std::set<std::string> &decided) {
  std::map<std::string, std::vector<Reader>> readers = readersOf(*graph.model, graph.fileNodes);
  auto moduleOf = [&](const std::string &name) -> std::string {
    std::set<std::string> modules;
    for (const Reader &r : readers[name])
      modules.insert(r.scope);
    return modules.size() == 1 ? *modules.begin() : "";
  };
  // The values read: of weights that share their module and element count
  // with another (a merge's candidates), and of those small enough to be a
  // broadcast's copies; a large model's other weights are never read.
  std::map<std::pair<std::string, int64_t>, int> peers;
  for (const Value &v : graph.values)
    if (v.kind == ValueKind::Weight && v.producer < 0 && !v.users.empty())
      if (std::string module = moduleOf(v.name); !module.empty())
        ++peers[{module, v.numElements()}];
  auto weights = graphWeights(graph, [&](const Value &v) {
    std::string module = moduleOf(v.name);
    return v.numElements() <= kMaxBroadcastElements ||
           (!module.empty() && peers[{module, v.numElements()}] >= 2);
  });
  if (!weights)
    return weights.takeError();
  std::vector<bool> data = dataWeights(graph);
  struct Group {
    std::string first, module;
    Param param;
    std::vector<plan::ParamPlace> places;
  };
  std::vector<Group> groups;
  std::multimap<uint64_t, size_t> byPrint; // fingerprint of the core -> group
  for (const Weight &w : *weights) {
    if (w.value.numElements() < 2 || oneValue(w.value) || decided.count(w.name))
      continue;
    std::string module = moduleOf(w.name); // the one module that reads it, or ""
    cpu::Tensor core =
        w.value.numElements() <= kMaxBroadcastElements ? broadcastCore(w.value) : w.value;
    // Data of one entry per sample that holds equal entries is a parameter
    // broadcast over the batch (a token type row expanded to [B, S, H]);
    // a mask's fill is never one.
    bool overBatch = w.value.shape()[0] > 1 && core.shape()[0] == 1;
    for (int64_t i = 0; i < w.value.numElements() && overBatch; ++i)
      overBatch = std::isfinite(w.value.getDouble(i)) && std::abs(w.value.getDouble(i)) < 1e30;
    if (data[graph.findValue(w.name)] && !overBatch)
      continue;
    uint64_t print = fingerprint(core);
    bool placed = false;
    for (auto [it, end] = byPrint.equal_range(print); it != end && !placed && !module.empty();
         ++it) {
      Group &g = groups[it->second];
      if (g.module != module)
        continue;
      std::vector<plan::ParamPlace> found = findPlaces(w, g.param);
      if (!found.empty()) {
        g.places.push_back(std::move(found.front()));
        placed = true;
      }
    }
    if (placed)
      continue;
    Group g{w.name, module, Param(), {}};
    g.param.value = std::move(core);
    std::vector<plan::ParamPlace> found = findPlaces(w, g.param);
    if (found.empty())
      continue;
    g.places.push_back(std::move(found.front()));
    byPrint.insert({print, groups.size()});
    groups.push_back(std::move(g));
  }
  std::vector<ParamFold> folds;
  for (Group &g : groups) {
    bool broadcast = any_of(g.places.front().steps(),
                            [](const plan::ParamStep &s) { return s.has_broadcast(); });
    if (g.places.size() < 2 && !broadcast)
      continue;
    folds.push_back({g.first, constantOf(g.param.value, g.param.value.elemType()),
                     std::move(g.places), /*guessed=*/true});
  }
  return folds;
}

} // namespace pipec
