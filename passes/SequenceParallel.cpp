//===- SequenceParallel.cpp - --sequence-parallel: the rest split on tokens -===//
#include "passes/SequenceParallel.h"
#include "passes/ShardRegion.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"

#include <climits>

using namespace llvm;

namespace pipec {
namespace {

using namespace shard;

/// The token ids [B, S] a vocabulary lookup reads from the graph's inputs.
struct Tokens {
  int op = -1;
  int64_t batch = 0, seq = 0;
};

std::optional<Tokens> findTokens(const Graph &graph) {
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead || !(op.is(OpId::TpGather) || op.is(OpId::Gather)) || op.inputs.size() < 2 ||
        op.inputs[0] < 0 || op.inputs[1] < 0)
      continue;
    const Value &ids = graph.values[op.inputs[1]];
    // The ids a graph input holds, perhaps reshaped or cast on the way
    // (torch's GPT-2 views them as [-1, S]).
    int root = op.inputs[1];
    while (graph.values[root].producer >= 0) {
      const Op &p = graph.ops[graph.values[root].producer];
      if (!p.def || !p.def->has(OpFlags::SameElements) || p.inputs.empty() || p.inputs[0] < 0)
        break;
      root = p.inputs[0];
    }
    if (graph.values[root].kind == ValueKind::Input && ids.shape.size() == 2 &&
        !isFloatDType(ids.type) && graph.values[op.inputs[0]].kind == ValueKind::Weight)
      return Tokens{o, ids.shape[0], ids.shape[1]};
  }
  return std::nullopt;
}

/// Where \p v holds the tokens: [B, S, ...] on axis 1, [B * S, ...] on axis
/// 0 as B blocks; replicated otherwise.
Layout sequenceLayout(const Value &v, const Tokens &t) {
  const std::vector<int64_t> &s = v.shape;
  if (s.size() >= 3 && s[0] == t.batch && s[1] == t.seq)
    return {1, 1};
  if (s.size() == 2 && s[0] == t.batch * t.seq)
    return {0, t.batch};
  return {};
}

/// The initializer \p id is read from, through ops of one input (a Cast, a
/// Transpose), or -1.
int rootWeight(const Graph &graph, int id) {
  while (id >= 0 && graph.values[id].producer >= 0) {
    const Op &p = graph.ops[graph.values[id].producer];
    if (p.inputs.size() != 1)
      return -1;
    id = p.inputs[0];
  }
  return id >= 0 && graph.values[id].kind == ValueKind::Weight ? id : -1;
}

/// The sequence region of one graph, grown op by op in order.
struct Growth {
  Region region;
  /// TpAllReduce ops whose sums become reduce-scatters, with their layout.
  std::vector<std::pair<int, Layout>> reduceScatters;
  /// TpCopy ops reading the tokens: all-gathered instead.
  std::vector<int> gatherCopies;
  /// The ops that read split values and carry the split.
  std::set<int> carried;
  /// Ops no rule carries the split through, and the split values they read
  /// whole.
  std::vector<std::pair<int, int>> wholeReads;
};

/// Grows the region from the sums and lookups on the tokens of \p t.
Expected<Growth> grow(Graph &graph, const Tokens &t, const std::set<int> &tensorSplit) {
  Growth g{Region(graph, graph.tensorParallel), {}, {}, {}, {}};
  Region &r = g.region;
  r.scatterReplicated = true;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead || op.outputs.empty() || op.outputs[0] < 0)
      continue;
    int out = op.outputs[0];
    Layout l = sequenceLayout(graph.values[out], t);
    if (!l.split())
      continue;
    if (op.is(OpId::TpAllReduce)) {
      r.layouts[out] = l;
      g.reduceScatters.push_back({o, l});
    } else if (op.is(OpId::TpGather)) {
      // The lookup's sum: every rank's whole, cut where it is read.
      r.layouts[out] = l;
      r.scatters.push_back({out, l});
    }
  }
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead || none_of(op.inputs, [&](int id) { return r.of(id).split(); }))
      continue;
    if (op.is(OpId::TpCopy)) {
      g.gatherCopies.push_back(o);
      continue;
    }
    // An op of a split product's region, or a collective, reads the tokens
    // whole; so does one whose rule refuses them.
    bool tensorRegion = (op.def && op.def->has(OpFlags::Collective)) ||
                        any_of(op.inputs, [&](int id) { return tensorSplit.count(id) > 0; });
    std::map<int, Layout> layouts = r.layouts;
    size_t edits = r.edits.size(), scatters = r.scatters.size();
    Expected<bool> done = false;
    if (!tensorRegion && op.def && op.captures.empty())
      done = shardRules[static_cast<size_t>(op.def->id)](r, op, o);
    if (!done)
      return done.takeError();
    if (*done) {
      g.carried.insert(o);
      // Weights read beside the tokens train on this rank's alone.
      for (int id : op.inputs)
        if (id >= 0 && !r.of(id).split())
          if (int w = rootWeight(graph, id); w >= 0)
            graph.sequenceGrads.insert(graph.values[w].name);
      continue;
    }
    r.layouts = std::move(layouts);
    r.edits.resize(edits);
    r.scatters.resize(scatters);
    for (int id : op.inputs)
      if (id >= 0 && r.of(id).split())
        g.wholeReads.push_back({o, id});
  }
  return g;
}

/// Sets \p op's type to \p type (a pipec collective) with \p layout's axis
/// and blocks.
void retype(Graph &graph, int o, StringRef type, Layout layout) {
  Op &op = graph.ops[o];
  op.setType("pipec", type);
  onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(op.nodeIndex);
  node.set_op_type(type.str());
  node.set_domain("pipec");
  setLayoutAttrs(graph, op, layout);
}

} // namespace

Error splitSequence(Graph &graph, std::set<int> &splitValues) {
  int parts = graph.tensorParallel;
  std::optional<Tokens> tokens = findTokens(graph);
  if (!tokens)
    return createStringError(inconvertibleErrorCode(),
                             "%s: --sequence-parallel: no vocabulary lookup reads token ids "
                             "[batch, sequence] from the graph's inputs, so the sequence axis is "
                             "unknown; compile without --sequence-parallel",
                             graph.path.c_str());
  if (tokens->seq % parts != 0) {
    const Op &lookup = graph.ops[tokens->op];
    return createStringError(inconvertibleErrorCode(),
                             "%s: node '%s' (%s): its sequences of %lld tokens do not divide "
                             "over --tp %d (--sequence-parallel); compile another --seq",
                             graph.path.c_str(), lookup.name.c_str(), lookup.opType.c_str(),
                             static_cast<long long>(tokens->seq), parts);
  }
  std::set<int> tensorSplit = splitValues;
  auto grown = grow(graph, *tokens, tensorSplit);
  if (!grown)
    return grown.takeError();
  Growth &g = *grown;
  Region &r = g.region;
  // What was cut where it is read keeps its whole shape at its source.
  std::map<int, Layout> sources;
  for (auto &[id, l] : r.scatters) {
    sources[id] = l;
    r.layouts.erase(id);
  }
  std::map<int, Layout> layouts = r.layouts;
  applySplits(graph, r, splitValues);
  std::map<int, std::vector<Op>> before;
  for (auto &[id, l] : sources) {
    std::vector<std::pair<int, int>> reads;
    int first = INT_MAX;
    for (auto [o, slot] : readsOf(graph, id))
      if (g.carried.count(o)) {
        reads.push_back({o, slot});
        first = std::min(first, o);
      }
    if (reads.empty())
      continue;
    Op cut = collectiveOp(graph, "TpScatter", id, graph.ops[first].scope);
    setLayoutAttrs(graph, cut, l);
    graph.values[cut.outputs[0]].shape[l.axis] /= parts;
    for (auto [o, slot] : reads)
      rewire(graph, o, slot, cut.outputs[0]);
    before[first].push_back(std::move(cut));
  }
  std::map<int, int> whole;
  for (auto [o, id] : g.wholeReads) {
    if (sources.count(id))
      continue; // it reads the source, whole
    if (!whole.count(id)) {
      Op gather = collectiveOp(graph, "TpAllGather", id, graph.ops[o].scope);
      setLayoutAttrs(graph, gather, layouts.at(id));
      graph.values[gather.outputs[0]].shape[layouts.at(id).axis] *= parts;
      whole[id] = gather.outputs[0];
      before[o].push_back(std::move(gather));
    }
    for (auto [reader, slot] : readsOf(graph, id))
      if (reader == o)
        rewire(graph, o, slot, whole[id]);
  }
  for (auto [o, l] : g.reduceScatters)
    retype(graph, o, "TpReduceScatter", l);
  for (int o : g.gatherCopies)
    if (!sources.count(graph.ops[o].inputs[0]))
      retype(graph, o, "TpGatherCopy", layouts.at(graph.ops[o].inputs[0]));
  for (int id : std::vector<int>(graph.outputs))
    if (auto l = layouts.find(id); l != layouts.end())
      gatherOutput(graph, id, l->second, parts, before);
  insertOps(graph, before);
  return Error::success();
}

} // namespace pipec
