//===- ActivationMemory.cpp - What a layer holds while it runs ----------===//
#include "passes/ActivationMemory.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringRef.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec {

namespace {

/// What the backward program reads and which forward values it
/// differentiates, by name.
struct BackwardReads {
  std::set<std::string> read;
  std::set<std::string> withGradient;
};

/// "grad:V" and its contributions "grad:V#K" -> "V"; "" for other names.
StringRef gradientOf(StringRef name) {
  if (!name.consume_front("grad:"))
    return "";
  size_t hash = name.rfind('#');
  if (hash != StringRef::npos && hash + 1 < name.size() &&
      all_of(name.drop_front(hash + 1), isDigit))
    return name.take_front(hash);
  return name;
}

BackwardReads backwardReads(const Backward &backward) {
  BackwardReads out;
  for (const auto *lists : {&backward.inputGrad, &backward.weightGrad})
    for (const auto &nodes : *lists)
      for (const onnx::NodeProto &node : nodes) {
        for (const std::string &in : node.input())
          out.read.insert(in);
        for (const std::string &o : node.output())
          if (StringRef v = gradientOf(o); !v.empty())
            out.withGradient.insert(v.str());
      }
  return out;
}

/// Bytes live at each of a layer's n op positions; the peak of intervals.
class LiveBytes {
public:
  explicit LiveBytes(int n) : delta(n + 2, 0) {}
  /// \p bytes live from position \p from to \p to, both included.
  void add(int from, int to, int64_t bytes) {
    delta[from] += bytes;
    delta[to + 1] -= bytes;
  }
  int64_t peak() const {
    int64_t live = 0, most = 0;
    for (int64_t d : delta)
      most = std::max(most, live += d);
    return most;
  }

private:
  std::vector<int64_t> delta;
};

} // namespace

void countActivationMemory(CostTable &table, const LayerGraph &lg, const Backward *backward) {
  const Graph &graph = *lg.graph;
  std::vector<int> layerOf(graph.ops.size(), -1), posOf(graph.ops.size(), -1);
  for (size_t l = 0; l < lg.layers.size(); ++l)
    for (size_t i = 0; i < lg.layers[l].ops.size(); ++i) {
      layerOf[lg.layers[l].ops[i]] = static_cast<int>(l);
      posOf[lg.layers[l].ops[i]] = static_cast<int>(i);
    }
  BackwardReads reads = backward ? backwardReads(*backward) : BackwardReads{};
  auto bytesOf = [&](int id) { return static_cast<int64_t>(bytesAt(graph, id, table.precision)); };
  auto kept = [&](int id) { return reads.read.count(graph.values[id].name) > 0; };
  for (size_t l = 0; l < lg.layers.size() && l < table.layers.size(); ++l) {
    const Layer &layer = lg.layers[l];
    int n = static_cast<int>(layer.ops.size());
    // Where each reader of a value runs in this layer; n for one elsewhere
    // (a later layer, the loss, the graph's outputs).
    auto readers = [&](int id) {
      std::vector<int> at;
      for (int u : graph.values[id].users)
        at.push_back(layerOf[u] == static_cast<int>(l) ? posOf[u] : n);
      if (graph.values[id].isGraphOutput)
        at.push_back(n);
      return at;
    };
    LayerCost &lc = table.layers[l];
    lc.activationBytes = 0;
    lc.derivedWeightBytes = 0;
    LiveBytes forward(n), gradients(n);
    std::set<int> inputs; // activations of earlier layers this layer reads
    for (int i = 0; i < n; ++i) {
      const Op &op = graph.ops[layer.ops[i]];
      for (int in : op.inputs)
        if (in >= 0 && graph.values[in].kind == ValueKind::Activation &&
            graph.values[in].producer >= 0 && layerOf[graph.values[in].producer] != int(l))
          inputs.insert(in);
      for (int out : op.outputs) {
        if (out < 0)
          continue;
        bool derived = graph.isDerivedWeight(out);
        if (!derived && graph.values[out].kind != ValueKind::Activation)
          continue;
        std::vector<int> at = readers(out);
        if (derived)
          lc.derivedWeightBytes += bytesOf(out);
        else if (backward && kept(out))
          lc.activationBytes += bytesOf(out);
        else
          forward.add(i, std::max(i, at.empty() ? i : *std::max_element(at.begin(), at.end())),
                      bytesOf(out));
        // Its gradient: a copy per reader, from the reader's backward to
        // the producer's.
        if (backward && reads.withGradient.count(graph.values[out].name))
          for (int r : at)
            gradients.add(i, std::max(i, r), bytesOf(out));
      }
      for (int in : op.inputs)
        if (backward && in >= 0 && graph.values[in].kind == ValueKind::Weight &&
            backward->weightGrads.count(graph.values[in].name))
          gradients.add(i, i, bytesOf(in));
    }
    for (int in : inputs) {
      std::vector<int> at = readers(in);
      int last = 0;
      for (int r : at)
        last = std::max(last, r == n ? 0 : r);
      if (!(backward && kept(in)))
        forward.add(0, last, bytesOf(in));
      // The gradient sent back to the earlier layer lives to the end of
      // this layer's backward.
      if (backward && reads.withGradient.count(graph.values[in].name))
        for (int r : at)
          if (r < n)
            gradients.add(0, r, bytesOf(in));
    }
    lc.workingBytes = std::max(forward.peak(), gradients.peak());
  }
}

} // namespace pipec
