//===- GroupLayers.cpp - group-layers -------------------------------------===//
#include "passes/GroupLayers.h"
#include "compiler/cost/OpCosts.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <map>
#include <optional>
#include <queue>
#include <set>

using namespace llvm;

namespace pipec {
namespace {

/// Most layers cut analysis alone produces; adjacent segments are merged
/// beyond that.
constexpr size_t maxCutLayers = 64;

bool isRuntimeOp(const Graph &graph, const Op &op) {
  for (int id : op.outputs)
    if (id >= 0 && graph.values[id].kind == ValueKind::Activation)
      return true;
  return false;
}

bool isPath(StringRef name) { return name.contains('/') || name.contains('.'); }

/// A layer of the chain before ops are attached: a name, a kind and the
/// positions [begin, end) of its runtime ops in the chosen order.
struct Segment {
  std::string name;
  LayerKind kind = LayerKind::Other;
  size_t begin = 0, end = 0;
};

/// The repeated blocks that module paths name: the pattern of their numbered
/// prefix ("/model/layers.#") and its instances in block order.
struct BlockPattern {
  std::string pattern;
  std::vector<std::string> instances;
};

/// How the ops of a model sit among its blocks.
struct BlockAnchors {
  /// Per op: the block (1-based) its path names, or -1.
  std::vector<int> anchor;
  /// Per op: whether it has a path that names no block (the embedding or
  /// the head).
  std::vector<bool> named;
};

class Grouper {
public:
  explicit Grouper(const Graph &graph) : graph(graph) {
    for (size_t i = 0; i < graph.ops.size(); ++i)
      if (!graph.ops[i].dead && isRuntimeOp(graph, graph.ops[i]))
        runtime.push_back(static_cast<int>(i));
  }

  Expected<LayerGraph> run();

private:
  const Graph &graph;
  /// Runtime op indices in graph (topological) order.
  std::vector<int> runtime;

  std::string pathOf(const Op &op) const;
  std::string sourceWeightName(int value, int depth = 0) const;
  std::vector<int64_t> liveBytes(const std::vector<int> &order) const;
  static size_t bestCut(const std::vector<int64_t> &live, size_t lo, size_t hi, bool latest);

  bool byModulePath(std::vector<int> &order, std::vector<Segment> &segments) const;
  // The steps of byModulePath.
  /// The numbered path prefix that names the blocks, in \p paths (per op);
  /// none when the names do not repeat or cover too few ops.
  std::optional<BlockPattern> blockPattern(const std::vector<std::string> &paths) const;
  /// Each op's block, as its path in \p paths names it.
  BlockAnchors blockAnchors(const std::vector<std::string> &paths,
                            const BlockPattern &blocks) const;
  /// The runtime ops in \p order, block by block; \p key gets each op's
  /// layer. False when the ops do not form a DAG.
  bool orderByBlock(const BlockAnchors &anchors, int blocks, std::vector<int> &order,
                    std::vector<int> &key) const;
  /// The first position of each layer after the first (blocks + 1 cuts), at
  /// the least live bytes between the anchors on either side; none when the
  /// blocks interleave.
  std::optional<std::vector<size_t>> blockCuts(const std::vector<int> &order,
                                               const BlockAnchors &anchors,
                                               const std::vector<int> &key, int blocks) const;

  bool byRepeatedStructure(std::vector<Segment> &segments) const;
  void byCutAnalysis(std::vector<Segment> &segments) const;
  void splitLargeEnds(const std::vector<int> &order, std::vector<Segment> &segments) const;
  Expected<LayerGraph> build(const std::vector<int> &order, std::vector<Segment> segments,
                             GroupingMethod method) const;
};

std::string Grouper::sourceWeightName(int value, int depth) const {
  const Value &v = graph.values[value];
  if (v.kind != ValueKind::Weight && v.kind != ValueKind::Constant)
    return "";
  if (v.kind == ValueKind::Weight && isPath(v.name))
    return v.name;
  if (v.producer < 0 || depth > 8)
    return "";
  for (int in : graph.ops[v.producer].inputs)
    if (in >= 0) {
      std::string name = sourceWeightName(in, depth + 1);
      if (!name.empty())
        return name;
    }
  return "";
}

std::string Grouper::pathOf(const Op &op) const {
  if (!op.scope.empty())
    return op.scope;
  for (int in : op.inputs)
    if (in >= 0) {
      std::string name = sourceWeightName(in);
      if (!name.empty())
        return name;
    }
  return "";
}

std::vector<int64_t> Grouper::liveBytes(const std::vector<int> &order) const {
  // live[t] = bytes of run-time values made before position t and read at or
  // after it. Graph inputs count from their first reader on.
  size_t n = order.size();
  std::vector<int> position(graph.ops.size(), -1);
  for (size_t p = 0; p < n; ++p)
    position[order[p]] = static_cast<int>(p);
  std::vector<int64_t> diff(n + 2, 0);
  for (size_t id = 0; id < graph.values.size(); ++id) {
    const Value &v = graph.values[id];
    if (v.kind != ValueKind::Activation && v.kind != ValueKind::Input)
      continue;
    int first = INT32_MAX, last = -1;
    for (int user : v.users) {
      int p = position[user];
      if (p < 0)
        continue;
      first = std::min(first, p);
      last = std::max(last, p);
    }
    int def = v.producer >= 0 ? position[v.producer] : first;
    if (def < 0 || last <= def)
      continue;
    diff[def + 1] += v.byteSize();
    diff[last + 1] -= v.byteSize();
  }
  std::vector<int64_t> live(n + 1, 0);
  int64_t running = 0;
  for (size_t t = 0; t <= n; ++t) {
    running += diff[t];
    live[t] = running;
  }
  return live;
}

size_t Grouper::bestCut(const std::vector<int64_t> &live, size_t lo, size_t hi, bool latest) {
  size_t best = lo;
  for (size_t t = lo; t <= hi; ++t)
    if (live[t] < live[best] || (latest && live[t] == live[best]))
      best = t;
  return best;
}

/// The numbered prefixes of a path: for "/model/layers.3/mlp/fc1/MatMul",
/// ("/model/layers.#", "/model/layers.3") and ("/model/layers.#/mlp/fc#",
/// ...). A digit run counts when a separator or the end follows it.
void numberedPrefixes(StringRef path, SmallVectorImpl<std::pair<std::string, std::string>> &out) {
  std::string pattern;
  for (size_t i = 0; i < path.size();) {
    if (!isDigit(path[i])) {
      pattern += path[i++];
      continue;
    }
    size_t j = i;
    while (j < path.size() && isDigit(path[j]))
      ++j;
    pattern += '#';
    bool boundary = j == path.size() || StringRef("/._:-").contains(path[j]);
    if (boundary)
      out.emplace_back(pattern, path.substr(0, j).str());
    i = j;
  }
}

std::vector<int64_t> numbersIn(StringRef key) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < key.size();) {
    if (!isDigit(key[i])) {
      ++i;
      continue;
    }
    int64_t n = 0;
    while (i < key.size() && isDigit(key[i]))
      n = n * 10 + (key[i++] - '0');
    out.push_back(n);
  }
  return out;
}

std::optional<BlockPattern> Grouper::blockPattern(const std::vector<std::string> &paths) const {
  // pattern -> instance -> op count
  StringMap<StringMap<int>> patterns;
  SmallVector<std::pair<std::string, std::string>, 8> prefixes;
  for (int op : runtime) {
    prefixes.clear();
    numberedPrefixes(paths[op], prefixes);
    for (auto &[pattern, instance] : prefixes)
      ++patterns[pattern][instance];
  }
  // Pick the pattern: at least two real instances, at least 1.5 ops each on
  // average (not per-op names like "MatMul_3"), and among those that cover nearly the most ops, the
  // one with the most instances ("/layer#/layer#.#" over "/layer#"); on a tie the more specific
  // path, which names the block itself.
  struct Candidate {
    std::string pattern;
    std::vector<std::string> instances;
    size_t covered = 0;
  };
  std::vector<Candidate> candidates;
  for (auto &entry : patterns) {
    std::vector<int> counts;
    for (auto &inst : entry.second)
      counts.push_back(inst.second);
    std::sort(counts.begin(), counts.end());
    int median = counts[counts.size() / 2];
    Candidate c;
    c.pattern = entry.first().str();
    for (auto &inst : entry.second)
      if (inst.second * 4 >= median) { // tiny instances (a final norm) are not blocks
        c.instances.push_back(inst.first().str());
        c.covered += inst.second;
      }
    if (c.instances.empty() || 2 * c.covered < 3 * c.instances.size()) // per-op names
      continue;
    candidates.push_back(std::move(c));
  }
  // A one-block model names one instance; take it only when nothing repeats.
  bool anyRepeats = false;
  for (auto &c : candidates)
    anyRepeats |= c.instances.size() >= 2;
  if (anyRepeats)
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                    [](const Candidate &c) { return c.instances.size() < 2; }),
                     candidates.end());
  if (candidates.empty())
    return std::nullopt;
  size_t maxCovered = 0;
  for (auto &c : candidates)
    maxCovered = std::max(maxCovered, c.covered);
  if (maxCovered * 10 < runtime.size()) // names too sparse to trust
    return std::nullopt;
  const Candidate *best = nullptr;
  for (auto &c : candidates) {
    if (c.covered * 10 < maxCovered * 9)
      continue;
    if (!best || c.instances.size() > best->instances.size() ||
        (c.instances.size() == best->instances.size() &&
         (c.pattern.size() > best->pattern.size() ||
          (c.pattern.size() == best->pattern.size() && c.pattern < best->pattern))))
      best = &c;
  }
  BlockPattern out{best->pattern, best->instances};
  std::sort(out.instances.begin(), out.instances.end(),
            [](const std::string &a, const std::string &b) {
              auto na = numbersIn(a), nb = numbersIn(b);
              return na != nb ? na < nb : a < b;
            });
  return out;
}

BlockAnchors Grouper::blockAnchors(const std::vector<std::string> &paths,
                                   const BlockPattern &blocks) const {
  StringMap<int> blockOf;
  for (size_t i = 0; i < blocks.instances.size(); ++i)
    blockOf[blocks.instances[i]] = static_cast<int>(i) + 1;
  BlockAnchors out;
  out.anchor.assign(graph.ops.size(), -1);
  out.named.assign(graph.ops.size(), false);
  SmallVector<std::pair<std::string, std::string>, 8> prefixes;
  for (int op : runtime) {
    prefixes.clear();
    numberedPrefixes(paths[op], prefixes);
    for (auto &[pattern, instance] : prefixes)
      if (pattern == blocks.pattern) {
        auto it = blockOf.find(instance);
        if (it != blockOf.end())
          out.anchor[op] = it->second;
      }
    out.named[op] = out.anchor[op] < 0 && !paths[op].empty();
  }
  return out;
}

bool Grouper::orderByBlock(const BlockAnchors &anchors, int blocks, std::vector<int> &order,
                           std::vector<int> &key) const {
  const std::vector<int> &anchor = anchors.anchor;
  int post = blocks + 1;
  key.assign(graph.ops.size(), 0);
  std::vector<int> pending(graph.ops.size(), 0);
  std::vector<bool> isRuntime(graph.ops.size(), false);
  for (int op : runtime)
    isRuntime[op] = true;
  for (int op : runtime)
    for (int in : graph.ops[op].inputs)
      if (in >= 0 && graph.values[in].producer >= 0 && isRuntime[graph.values[in].producer])
        ++pending[op];
  using Item = std::pair<int, int>; // (key, op index)
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> ready;
  auto keyOf = [&](int op) {
    if (anchor[op] >= 0)
      return anchor[op];
    int lo = 0;
    for (int in : graph.ops[op].inputs)
      if (in >= 0 && graph.values[in].producer >= 0 && isRuntime[graph.values[in].producer])
        lo = std::max(lo, key[graph.values[in].producer]);
    if (anchors.named[op] && lo == blocks)
      return post;
    return lo;
  };
  for (int op : runtime)
    if (pending[op] == 0)
      ready.emplace(key[op] = keyOf(op), op);
  order.clear();
  while (!ready.empty()) {
    int op = ready.top().second;
    ready.pop();
    order.push_back(op);
    for (int out : graph.ops[op].outputs) {
      if (out < 0)
        continue;
      for (int user : graph.values[out].users)
        if (isRuntime[user] && --pending[user] == 0)
          ready.emplace(key[user] = keyOf(user), user);
    }
  }
  return order.size() == runtime.size();
}

std::optional<std::vector<size_t>> Grouper::blockCuts(const std::vector<int> &order,
                                                      const BlockAnchors &anchors,
                                                      const std::vector<int> &key,
                                                      int blocks) const {
  size_t n = order.size();
  int post = blocks + 1;
  // The room for each boundary lies between the anchors on either side.
  std::vector<int> firstAnchor(post + 1, INT32_MAX), lastAnchor(post + 1, -1);
  for (size_t p = 0; p < n; ++p) {
    int op = order[p];
    int anchor = anchors.anchor[op];
    int layer = anchor >= 0 ? anchor : (anchors.named[op] ? key[op] : -1);
    if (layer < 0 || (anchor < 0 && layer != 0 && layer != post))
      continue;
    firstAnchor[layer] = std::min(firstAnchor[layer], static_cast<int>(p));
    lastAnchor[layer] = std::max(lastAnchor[layer], static_cast<int>(p));
  }
  std::vector<int64_t> live = liveBytes(order);
  std::vector<size_t> cuts; // cuts[j]: first position of layer j + 1
  size_t previous = 0;
  for (int j = 0; j <= blocks; ++j) {
    size_t lo = previous, hi = n;
    for (int l = 0; l <= j; ++l)
      if (lastAnchor[l] >= 0)
        lo = std::max(lo, static_cast<size_t>(lastAnchor[l]) + 1);
    for (int l = j + 1; l <= post; ++l)
      if (firstAnchor[l] != INT32_MAX)
        hi = std::min(hi, static_cast<size_t>(firstAnchor[l]));
    if (lo > hi)
      return std::nullopt; // the blocks interleave: names do not describe a chain
    size_t cut = bestCut(live, lo, hi, /*latest=*/j != blocks);
    cuts.push_back(cut);
    previous = cut;
  }
  return cuts;
}

bool Grouper::byModulePath(std::vector<int> &order, std::vector<Segment> &segments) const {
  std::vector<std::string> paths(graph.ops.size());
  for (int op : runtime)
    paths[op] = pathOf(graph.ops[op]);
  std::optional<BlockPattern> pattern = blockPattern(paths);
  if (!pattern)
    return false;
  int blocks = static_cast<int>(pattern->instances.size());
  // Anchors: ops whose path names their block; named ops outside every
  // block anchor the embedding or the head.
  BlockAnchors anchors = blockAnchors(paths, *pattern);
  // Order the ops block by block: Kahn's algorithm keyed by (layer, file
  // position), where an op outside the blocks takes the latest layer among
  // its inputs' producers.
  std::vector<int> key;
  if (!orderByBlock(anchors, blocks, order, key))
    return false;
  std::optional<std::vector<size_t>> cuts = blockCuts(order, anchors, key, blocks);
  if (!cuts)
    return false;
  size_t n = order.size();
  segments.clear();
  segments.push_back({"", LayerKind::Other, 0, (*cuts)[0]});
  for (int b = 1; b <= blocks; ++b) {
    std::string name = pattern->instances[b - 1];
    segments.push_back({name, LayerKind::Block, (*cuts)[b - 1], (*cuts)[b]});
  }
  segments.push_back({"head", LayerKind::Head, (*cuts)[blocks], n});
  return true;
}

bool Grouper::byRepeatedStructure(std::vector<Segment> &segments) const {
  size_t n = runtime.size();
  if (n < 4)
    return false;
  // Intern op types.
  StringMap<int> typeIds;
  std::vector<int> seq(n);
  for (size_t p = 0; p < n; ++p) {
    const Op &op = graph.ops[runtime[p]];
    seq[p] = typeIds.try_emplace(op.domain + ":" + op.opType, typeIds.size()).first->second;
  }
  // Candidate periods: the most common gap between occurrences of each type.
  std::vector<int> lastSeen(typeIds.size(), -1);
  std::vector<std::map<size_t, int>> gaps(typeIds.size());
  for (size_t p = 0; p < n; ++p) {
    if (lastSeen[seq[p]] >= 0)
      ++gaps[seq[p]][p - lastSeen[seq[p]]];
    lastSeen[seq[p]] = static_cast<int>(p);
  }
  std::set<size_t> periods;
  for (auto &g : gaps) {
    size_t best = 0;
    int bestCount = 0;
    for (auto &[gap, count] : g)
      if (count > bestCount)
        best = gap, bestCount = count;
    if (best >= 2 && best <= n / 2)
      periods.insert(best);
  }
  size_t bestK = 0, bestStart = 0, bestLength = 0, bestCovered = 0;
  for (size_t k : periods) {
    size_t run = 0;
    for (size_t i = 0; i + k < n; ++i) {
      run = seq[i] == seq[i + k] ? run + 1 : 0;
      if (run == 0)
        continue;
      size_t length = run + k; // ops in the periodic stretch ending at i + k
      size_t covered = (length / k) * k;
      if (length / k >= 2 && (covered > bestCovered || (covered == bestCovered && k < bestK))) {
        bestK = k, bestStart = i + 1 - run, bestLength = length, bestCovered = covered;
      }
    }
  }
  if (!bestK || bestCovered * 4 < n)
    return false;
  // Align block boundaries with the fewest live bytes per cut, then the most
  // whole blocks. Cuts at the ends of the graph are free and would pull the
  // phase, so they do not count.
  // A stretch that starts `phase` ops early (ops before the first block that
  // happen to match) ends `phase` ops early too: the last cut may lie that
  // far past it.
  std::vector<int64_t> live = liveBytes(runtime);
  auto lastCut = [&](size_t phase) { return std::min(bestStart + bestLength + phase, n - 1); };
  size_t bestPhase = 0, bestCuts = 0;
  int64_t bestCost = INT64_MAX;
  for (size_t phase = 0; phase < bestK; ++phase) {
    int64_t cost = 0;
    size_t cuts = 0;
    for (size_t t = bestStart + phase; t <= lastCut(phase); t += bestK)
      cost += live[t], ++cuts;
    if (cuts == 0)
      continue;
    // cost / cuts < bestCost / bestCuts, in integers.
    bool cheaper = bestCuts == 0 ||
                   static_cast<__int128>(cost) * bestCuts < static_cast<__int128>(bestCost) * cuts;
    bool same = bestCuts != 0 &&
                static_cast<__int128>(cost) * bestCuts == static_cast<__int128>(bestCost) * cuts;
    if (cheaper || (same && cuts > bestCuts))
      bestCost = cost, bestPhase = phase, bestCuts = cuts;
  }
  std::vector<size_t> cuts;
  for (size_t t = bestStart + bestPhase; t <= lastCut(bestPhase); t += bestK)
    cuts.push_back(t);
  if (cuts.size() < 3)
    return false;
  segments.clear();
  segments.push_back({"", LayerKind::Other, 0, cuts.front()});
  for (size_t b = 0; b + 1 < cuts.size(); ++b)
    segments.push_back({formatv("block.{0}", b).str(), LayerKind::Block, cuts[b], cuts[b + 1]});
  segments.push_back({"head", LayerKind::Head, cuts.back(), n});
  return true;
}

void Grouper::byCutAnalysis(std::vector<Segment> &segments) const {
  size_t n = runtime.size();
  std::vector<int64_t> live = liveBytes(runtime);
  int64_t minLive = INT64_MAX;
  for (size_t t = 1; t < n; ++t)
    minLive = std::min(minLive, live[t]);
  std::vector<size_t> cuts = {0};
  for (size_t t = 1; t < n; ++t)
    if (live[t] == minLive)
      cuts.push_back(t);
  cuts.push_back(n);
  // Merge into at most maxCutLayers segments of similar op counts.
  size_t target = (n + maxCutLayers - 1) / maxCutLayers;
  std::vector<size_t> kept = {0};
  for (size_t i = 1; i + 1 < cuts.size(); ++i)
    if (cuts[i] - kept.back() >= target)
      kept.push_back(cuts[i]);
  kept.push_back(n);
  segments.clear();
  for (size_t i = 0; i + 1 < kept.size(); ++i)
    segments.push_back({formatv("segment.{0}", i).str(), LayerKind::Other, kept[i], kept[i + 1]});
}

void Grouper::splitLargeEnds(const std::vector<int> &order, std::vector<Segment> &segments) const {
  // A stem or head much larger than a block (MobileNet's first and last
  // stages) is split where the fewest bytes are live, into pieces about the
  // size of a block, so that balancing has room to move.
  std::vector<size_t> blockSizes;
  for (const Segment &s : segments)
    if (s.kind == LayerKind::Block)
      blockSizes.push_back(s.end - s.begin);
  if (blockSizes.empty())
    return;
  std::sort(blockSizes.begin(), blockSizes.end());
  size_t target = std::max<size_t>(2, blockSizes[blockSizes.size() / 2]);
  std::vector<int64_t> live = liveBytes(order);
  std::vector<Segment> out;
  for (size_t i = 0; i < segments.size(); ++i) {
    Segment s = segments[i];
    bool isEnd = (i == 0 || i + 1 == segments.size()) && s.kind != LayerKind::Block;
    if (!isEnd || s.end - s.begin <= 2 * target) {
      out.push_back(s);
      continue;
    }
    std::vector<size_t> cuts = {s.begin};
    while (s.end - cuts.back() > target + target / 2) {
      size_t lo = cuts.back() + target / 2,
             hi = std::min(cuts.back() + target + target / 2, s.end - target / 2);
      cuts.push_back(bestCut(live, lo, std::max(lo, hi), /*latest=*/false));
    }
    cuts.push_back(s.end);
    std::string base = s.name.empty() ? "stem" : s.name;
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      Segment piece = s;
      piece.begin = cuts[c];
      piece.end = cuts[c + 1];
      bool keepsKind = i == 0 ? c == 0 : c + 2 == cuts.size();
      piece.kind = keepsKind ? s.kind : LayerKind::Other;
      piece.name = (i == 0 && c == 0) ? s.name : formatv("{0}.{1}", base, c).str();
      out.push_back(piece);
    }
  }
  segments = std::move(out);
}

bool isLossOp(const Graph &graph, const Op &op) {
  if (op.is(OpId::SoftmaxCrossEntropyLoss) || op.is(OpId::NegativeLogLikelihoodLoss))
    return true;
  for (int in : op.inputs) {
    if (in < 0)
      continue;
    std::string name = StringRef(graph.values[in].name).lower();
    if (graph.values[in].kind == ValueKind::Input &&
        (StringRef(name).contains("label") || StringRef(name).contains("target")))
      return true;
  }
  return false;
}

bool hasEmbeddingLookup(const Graph &graph, const std::vector<int> &ops) {
  for (int op : ops) {
    const Op &o = graph.ops[op];
    if (o.is(OpId::MsEmbedLayerNormalization))
      return true;
    if ((o.is(OpId::Gather) || o.is(OpId::TpGather)) && !o.inputs.empty() && o.inputs[0] >= 0 &&
        graph.values[o.inputs[0]].kind == ValueKind::Weight)
      return true;
  }
  return false;
}

Expected<LayerGraph> Grouper::build(const std::vector<int> &order, std::vector<Segment> segments,
                                    GroupingMethod method) const {
  // Split a trailing loss off the head.
  if (!segments.empty() && segments.back().kind == LayerKind::Head) {
    Segment &head = segments.back();
    size_t lossBegin = head.end;
    std::vector<bool> inLoss(graph.ops.size(), false);
    for (size_t p = head.begin; p < head.end; ++p) {
      const Op &op = graph.ops[order[p]];
      bool loss = isLossOp(graph, op);
      for (int in : op.inputs)
        loss |= in >= 0 && graph.values[in].producer >= 0 && inLoss[graph.values[in].producer];
      inLoss[order[p]] = loss;
    }
    // A Cast that only the loss reads (the logits widened to float32 for
    // it: autocast's, or a model's own `.float()`) computes the loss too:
    // the head sends the narrow logits, and the loss keeps them.
    auto castForLoss = [&](const Op &op) {
      if (!op.is(OpId::Cast) || op.outputs.size() != 1 || op.outputs[0] < 0)
        return false;
      const Value &out = graph.values[op.outputs[0]];
      return !out.isGraphOutput && !out.users.empty() &&
             llvm::all_of(out.users, [&](int u) { return inLoss[u]; });
    };
    while (lossBegin > head.begin &&
           (inLoss[order[lossBegin - 1]] || castForLoss(graph.ops[order[lossBegin - 1]]))) {
      inLoss[order[lossBegin - 1]] = true;
      --lossBegin;
    }
    if (lossBegin < head.end) {
      Segment loss{"loss", LayerKind::Loss, lossBegin, head.end};
      head.end = lossBegin;
      segments.push_back(loss);
    }
  }
  LayerGraph lg;
  lg.graph = &graph;
  lg.method = method;
  std::vector<int> layerOf(graph.ops.size(), -1);
  for (const Segment &s : segments) {
    if (s.begin == s.end)
      continue;
    Layer layer;
    layer.name = s.name;
    layer.kind = s.kind;
    for (size_t p = s.begin; p < s.end; ++p) {
      layer.ops.push_back(order[p]);
      layerOf[order[p]] = static_cast<int>(lg.layers.size());
    }
    lg.layers.push_back(std::move(layer));
  }
  if (lg.layers.empty())
    return createStringError(inconvertibleErrorCode(), "%s: the model has no run-time ops",
                             graph.path.c_str());
  // Name and classify the first layer when it precedes the blocks.
  Layer &first = lg.layers.front();
  if (first.name.empty()) {
    bool embedding = hasEmbeddingLookup(graph, first.ops);
    first.kind = embedding ? LayerKind::Embedding : LayerKind::Other;
    first.name = embedding ? "embedding" : "stem";
  }
  // Ops that compute constants join the first layer that reads their result.
  int last = static_cast<int>(lg.layers.size()) - 1;
  for (size_t i = graph.ops.size(); i-- > 0;) {
    const Op &op = graph.ops[i];
    if (op.dead || layerOf[i] >= 0)
      continue;
    int layer = INT32_MAX;
    for (int out : op.outputs) {
      if (out < 0)
        continue;
      for (int user : graph.values[out].users)
        if (layerOf[user] >= 0)
          layer = std::min(layer, layerOf[user]);
      if (graph.values[out].isGraphOutput)
        layer = std::min(layer, last);
    }
    layerOf[i] = layer == INT32_MAX ? last : layer;
  }
  for (auto &layer : lg.layers)
    layer.ops.clear();
  for (size_t i = 0; i < graph.ops.size(); ++i)
    if (!graph.ops[i].dead)
      lg.layers[layerOf[i]].ops.push_back(static_cast<int>(i));

  // Statistics: weights, FLOPs, activation bytes.
  auto isSourceWeight = [&](int id) {
    const Value &v = graph.values[id];
    if (v.kind != ValueKind::Weight)
      return false;
    if (v.producer < 0)
      return true;
    for (int in : graph.ops[v.producer].inputs)
      if (in >= 0 && graph.values[in].kind == ValueKind::Weight)
        return false;
    return true;
  };
  for (Layer &layer : lg.layers) {
    std::set<int> weights;
    for (int op : layer.ops) {
      const Op &o = graph.ops[op];
      layer.flopsForward += forwardFlops(graph, o);
      for (int in : o.inputs)
        if (in >= 0 && isSourceWeight(in))
          weights.insert(in);
      for (int out : o.outputs) {
        if (out < 0)
          continue;
        if (isSourceWeight(out))
          weights.insert(out);
        if (graph.values[out].kind == ValueKind::Activation)
          layer.activationBytes += graph.values[out].byteSize();
      }
    }
    layer.weights.assign(weights.begin(), weights.end());
    std::sort(layer.weights.begin(), layer.weights.end(),
              [&](int a, int b) { return graph.values[a].name < graph.values[b].name; });
    for (int w : layer.weights)
      layer.params += graph.values[w].numElements();
  }
  // Tensors crossing boundaries: run-time values, graph inputs, and values
  // computed from weights alone that later layers read (rotary tables that
  // an exporter computes once, in the first block): each is sent through
  // every stage in between.
  for (size_t id = 0; id < graph.values.size(); ++id) {
    const Value &v = graph.values[id];
    bool derived = v.kind == ValueKind::Weight && v.producer >= 0;
    if (v.kind != ValueKind::Activation && v.kind != ValueKind::Input && !derived)
      continue;
    int from = v.producer >= 0 ? layerOf[v.producer] : INT32_MAX, to = -1;
    for (int user : v.users) {
      if (layerOf[user] < 0)
        continue;
      to = std::max(to, layerOf[user]);
      if (v.producer < 0)
        from = std::min(from, layerOf[user]);
    }
    if (to > from && from != INT32_MAX)
      lg.crossings.push_back({static_cast<int>(id), from, to});
  }
  if (Error err = lg.verify())
    return err;
  return lg;
}

Expected<LayerGraph> Grouper::run() {
  if (runtime.empty())
    return createStringError(inconvertibleErrorCode(), "%s: the model has no run-time ops",
                             graph.path.c_str());
  std::vector<int> order;
  std::vector<Segment> segments;
  if (byModulePath(order, segments)) {
    splitLargeEnds(order, segments);
    return build(order, std::move(segments), GroupingMethod::ModulePath);
  }
  if (byRepeatedStructure(segments)) {
    splitLargeEnds(runtime, segments);
    return build(runtime, std::move(segments), GroupingMethod::RepeatedStructure);
  }
  byCutAnalysis(segments);
  return build(runtime, std::move(segments), GroupingMethod::CutAnalysis);
}

} // namespace

Expected<LayerGraph> groupLayers(const Graph &graph) { return Grouper(graph).run(); }

} // namespace pipec
