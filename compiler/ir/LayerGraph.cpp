//===- LayerGraph.cpp - A model as a chain of layers ----------------------===//
#include "compiler/ir/LayerGraph.h"
#include "support/EnumNames.h"

#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<LayerKind> layerKindNames[] = {
    {LayerKind::Embedding, "embedding"}, {LayerKind::Block, "block"}, {LayerKind::Head, "head"},
    {LayerKind::Loss, "loss"},           {LayerKind::Other, "other"},
};

constexpr EnumName<GroupingMethod> groupingMethodNames[] = {
    {GroupingMethod::ModulePath, "module-path"},
    {GroupingMethod::RepeatedStructure, "repeated-structure"},
    {GroupingMethod::CutAnalysis, "cut-analysis"}};

} // namespace

StringRef layerKindName(LayerKind kind) { return nameOf(layerKindNames, kind, "other"); }

StringRef groupingMethodName(GroupingMethod method) {
  return nameOf(groupingMethodNames, method, "cut-analysis");
}

std::vector<int> LayerGraph::crossingAfter(size_t i) const {
  std::vector<int> out;
  for (const CrossingTensor &c : crossings)
    if (c.fromLayer <= static_cast<int>(i) && c.toLayer > static_cast<int>(i))
      out.push_back(c.value);
  return out;
}

int64_t LayerGraph::boundaryBytes(size_t i) const {
  int64_t bytes = 0;
  for (int id : crossingAfter(i))
    bytes += graph->values[id].byteSize();
  return bytes;
}

std::vector<std::pair<int, std::vector<int>>> LayerGraph::sharedWeights() const {
  std::map<int, std::vector<int>> users;
  for (size_t l = 0; l < layers.size(); ++l)
    for (int w : layers[l].weights)
      users[w].push_back(static_cast<int>(l));
  std::vector<std::pair<int, std::vector<int>>> out;
  for (auto &[w, ls] : users)
    if (ls.size() > 1)
      out.emplace_back(w, ls);
  return out;
}

int64_t LayerGraph::totalParams() const {
  int64_t total = 0;
  std::vector<bool> seen(graph->values.size(), false);
  for (const Layer &layer : layers)
    for (int w : layer.weights)
      if (!seen[w]) {
        seen[w] = true;
        total += graph->values[w].numElements();
      }
  return total;
}

void LayerGraph::print(raw_ostream &os) const {
  os << formatv("layergraph layers={0} method={1} params={2}\n", layers.size(),
                groupingMethodName(method), totalParams());
  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer &layer = layers[l];
    os << formatv("layer {0} \"{1}\" kind={2} ops={3} params={4} flops={5} act_bytes={6}\n", l,
                  layer.name, layerKindName(layer.kind), layer.ops.size(), layer.params,
                  layer.flopsForward, layer.activationBytes);
    // Op types in order of first appearance, with counts: compact and stable.
    std::vector<std::pair<std::string, int>> types;
    for (int op : layer.ops) {
      const std::string &t = graph->ops[op].opType;
      auto it = std::find_if(types.begin(), types.end(), [&](auto &p) { return p.first == t; });
      if (it == types.end())
        types.emplace_back(t, 1);
      else
        ++it->second;
    }
    os << "  ops:";
    for (auto &[t, n] : types)
      os << " " << t << "x" << n;
    os << "\n";
    for (int w : layer.weights) {
      const Value &v = graph->values[w];
      os << formatv("  weight {0} {1}{2}\n", v.name, dtypeName(v.type), formatShape(v.shape));
    }
    if (l + 1 < layers.size()) {
      os << formatv("  boundary {0}->{1} bytes={2}\n", l, l + 1, boundaryBytes(l));
      for (int id : crossingAfter(l)) {
        const Value &v = graph->values[id];
        os << formatv("    {0} {1}{2}\n", v.name, dtypeName(v.type), formatShape(v.shape));
      }
    }
  }
  for (auto &[w, ls] : sharedWeights()) {
    os << "shared " << graph->values[w].name << " layers=";
    for (size_t i = 0; i < ls.size(); ++i)
      os << (i ? "," : "") << ls[i];
    os << "\n";
  }
}

Error LayerGraph::verify() const {
  auto fail = [&](size_t layer, const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s: layer %zu ('%s'): %s",
                             graph->path.c_str(), layer, layers[layer].name.c_str(),
                             why.str().c_str());
  };
  if (layers.empty())
    return createStringError(inconvertibleErrorCode(), "%s: the layer graph is empty",
                             graph->path.c_str());
  std::vector<int> layerOf(graph->ops.size(), -1);
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].ops.empty())
      return fail(l, "has no ops");
    for (int op : layers[l].ops) {
      if (op < 0 || op >= static_cast<int>(graph->ops.size()))
        return fail(l, formatv("refers to op #{0}, which does not exist", op));
      if (layerOf[op] >= 0)
        return fail(l, formatv("{0} is also in layer {1}", describeOp(*graph, graph->ops[op]),
                               layerOf[op]));
      layerOf[op] = static_cast<int>(l);
    }
  }
  for (size_t i = 0; i < graph->ops.size(); ++i) {
    const Op &op = graph->ops[i];
    if (op.dead)
      continue;
    if (layerOf[i] < 0)
      return createStringError(inconvertibleErrorCode(), "%s: %s belongs to no layer",
                               graph->path.c_str(), describeOp(*graph, op).c_str());
    for (int in : op.inputs) {
      if (in < 0 || graph->values[in].producer < 0)
        continue;
      int from = layerOf[graph->values[in].producer];
      if (from > layerOf[i])
        return fail(layerOf[i], formatv("{0} reads '{1}' from the later layer {2}",
                                        describeOp(*graph, op), graph->values[in].name, from));
    }
  }
  for (const CrossingTensor &c : crossings)
    if (c.fromLayer >= c.toLayer)
      return fail(c.fromLayer, formatv("tensor '{0}' is listed as crossing but stays inside it",
                                       graph->values[c.value].name));
  return Error::success();
}

} // namespace pipec
