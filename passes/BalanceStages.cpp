//===- BalanceStages.cpp - balance-stages ---------------------------------===//
#include "passes/BalanceStages.h"
#include "compiler/schedule/Schedule.h"
#include "passes/PredictStep.h"
#include "support/EnumNames.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<BalanceMethod> balanceMethodNames[] = {{BalanceMethod::Time, "time"},
                                                          {BalanceMethod::Params, "params"},
                                                          {BalanceMethod::Uniform, "uniform"},
                                                          {BalanceMethod::Layout, "layout"}};

} // namespace

StringRef balanceMethodName(BalanceMethod method) {
  return nameOf(balanceMethodNames, method, "time");
}

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// Everything a chunk's cost needs, as prefix sums over layers.
class ChunkCosts {
public:
  ChunkCosts(const LayerGraph &lg, const BalanceOptions &options)
      : lg(lg), options(options), layers(static_cast<int>(lg.layers.size())),
        chunks(options.shape.chunks()) {
    for (int k = 0; k < chunks; ++k)
      chunkRank.push_back(options.shape.rankOfChunk(k));
    // One prefix table per distinct cost table.
    for (const CostTable *table : options.rankCosts) {
      if (tableIndex.count(table))
        continue;
      tableIndex[table] = static_cast<int>(prefix.size());
      std::array<std::vector<double>, 3> p;
      for (auto &v : p)
        v.assign(layers + 1, 0);
      for (int l = 0; l < layers; ++l)
        for (int k = 0; k < 3; ++k)
          p[k][l + 1] = p[k][l] + (passCounts(k) ? table->layers[l].time[k] : 0);
      prefix.push_back(std::move(p));
    }
    const CostTable &first = *options.rankCosts.front();
    params.assign(layers + 1, 0);
    activations.assign(layers + 1, 0);
    derived.assign(layers + 1, 0);
    workingMax.emplace_back();
    for (int l = 0; l < layers; ++l) {
      params[l + 1] = params[l] + lg.layers[l].params;
      activations[l + 1] = activations[l] + first.layers[l].activationBytes;
      derived[l + 1] = derived[l] + first.layers[l].derivedWeightBytes;
      workingMax[0].push_back(first.layers[l].workingBytes);
    }
    for (size_t p = 1; (size_t(1) << p) <= size_t(layers); ++p) {
      const std::vector<int64_t> &half = workingMax[p - 1];
      std::vector<int64_t> level;
      for (size_t i = 0; i + (size_t(1) << p) <= size_t(layers); ++i)
        level.push_back(std::max(half[i], half[i + (size_t(1) << (p - 1))]));
      workingMax.push_back(std::move(level));
    }
    for (auto &[w, users] : lg.sharedWeights())
      shared.push_back({lg.graph->values[w].numElements(), users});
    // What each chunk holds at its peak, counted on the orders the schedule
    // will run (F until B, or until W for a split backward).
    int ranks = options.shape.stages();
    held.assign(chunks, static_cast<int64_t>(options.shape.microbatches()));
    rebuiltHeld.assign(chunks, 1);
    Schedule schedule = generateSchedule(options.shape);
    for (int r = 0; r < ranks; ++r) {
      std::vector<int64_t> perChunk = peakHeldPerChunk(schedule, r);
      std::vector<int64_t> rebuilt = peakRebuiltPerChunk(schedule, r);
      for (int k = 0; k < chunks; ++k)
        if (rankOf(k) == r && static_cast<size_t>(k / ranks) < perChunk.size()) {
          held[k] = perChunk[k / ranks];
          rebuiltHeld[k] = rebuilt[k / ranks];
        }
    }
    // The DPs ask for chunk times O(K L^2) times: each chunk's rank, prefix
    // table and send time at every cut, looked up once; and a bound on any
    // chunk's memory, so that fits() looks at none when its limit is above.
    int64_t maxBoundary = 0;
    for (const CostTable *table : options.rankCosts)
      for (const LayerCost &layer : table->layers)
        maxBoundary = std::max(maxBoundary, layer.boundaryBytes);
    bool recomputes = options.training.recompute != Recompute::None && options.training.training;
    for (int k = 0; k < chunks; ++k) {
      int64_t perChunk = options.training.training ? held[k] : 1, kept, bound;
      // Saturated: a bound that overflows only ever sends fits() to memory().
      int64_t rebuilt = 0;
      if (__builtin_mul_overflow(perChunk, recomputes ? maxBoundary : activations[layers], &kept) ||
          __builtin_mul_overflow(recomputes ? rebuiltHeld[k] : 0, activations[layers], &rebuilt) ||
          __builtin_mul_overflow(params[layers], bytesPerParam(options.training), &bound) ||
          __builtin_add_overflow(bound, derived[layers], &bound) ||
          __builtin_add_overflow(bound, kept, &bound) ||
          __builtin_add_overflow(bound, rebuilt, &bound) ||
          __builtin_add_overflow(bound, working(0, layers), &bound))
        bound = std::numeric_limits<int64_t>::max();
      memoryBound.push_back(bound);
    }
    for (int k = 0; k < chunks; ++k) {
      chunkPrefix.push_back(&prefix[tableIndex.at(options.rankCosts[chunkRank[k]])]);
      std::vector<double> sends(layers + 1, 0);
      for (int j = 1; j < layers; ++j)
        sends[j] = sendTime(k, j);
      chunkSend.push_back(std::move(sends));
    }
  }

  int layerCount() const { return layers; }
  int chunkCount() const { return chunks; }

  int rankOf(int chunk) const { return chunkRank[chunk]; }

  /// Parameters of layers [i, j), a shared weight counted once.
  int64_t paramsOf(int i, int j) const {
    int64_t n = params[j] - params[i];
    for (const auto &[elems, users] : shared) {
      int inside = 0;
      for (int u : users)
        inside += u >= i && u < j;
      if (inside > 1)
        n -= elems * (inside - 1);
    }
    return n;
  }

  double computeTime(int chunk, int i, int j, int pass) const {
    const auto &p = *chunkPrefix[chunk];
    return p[pass][j] - p[pass][i];
  }

  /// Sending the tensors that cross the cut at j, and their gradients back.
  double commTime(int chunk, int j) const {
    if (j <= 0 || j >= layers || chunk + 1 >= chunks)
      return 0;
    return chunkSend[chunk][j];
  }

  double time(int chunk, int i, int j) const {
    if (i >= j)
      return 0;
    return computeTime(chunk, i, j, 0) + computeTime(chunk, i, j, 1) + computeTime(chunk, i, j, 2) +
           commTime(chunk, j);
  }

  /// Bytes chunk [i, j) adds to its rank: parameters with their state and
  /// the activations of the microbatches it holds at its peak, and what
  /// its largest layer holds beyond them while it runs (working). A rank's
  /// memory is the sum over its chunks (their working bytes too, which is
  /// conservative with V > 1: they never run at once). With --recompute auto, the least it
  /// can take (every layer recomputing): whether a partition can fit.
  int64_t memory(int chunk, int i, int j) const {
    bool recomputes = options.training.recompute != Recompute::None;
    return memoryWith(chunk, i, j, recomputes ? j - i : 0);
  }

  /// memory(), with the first \p recomputed layers of the chunk recomputing
  /// their activations in the backward: each microbatch in flight keeps the
  /// chunk's input and the other layers' activations, and the recomputed
  /// activations are rebuilt for the microbatches between their backward
  /// and the pass that frees them (one at a time under 1F1B).
  int64_t memoryWith(int chunk, int i, int j, int recomputed) const {
    if (i >= j)
      return 0;
    int rank = rankOf(chunk);
    int64_t perChunk = held[chunk];
    int64_t act = activations[j] - activations[i];
    int64_t kept = act, rebuilt = 0;
    if (!options.training.training) {
      perChunk = 1;
    } else if (recomputed > 0) {
      int64_t input = i > 0 ? options.rankCosts[rank]->layers[i - 1].boundaryBytes : 0;
      rebuilt = activations[i + recomputed] - activations[i];
      kept = input + act - rebuilt;
    }
    return weightBytesOf(i, j) + perChunk * kept + rebuiltHeld[chunk] * rebuilt + working(i, j);
  }

  /// What layers [i, j) hold whatever the microbatches in flight: their
  /// weights and state, and the weights they derive once a step.
  int64_t weightBytesOf(int i, int j) const {
    return weightStateBytes(paramsOf(i, j), options.training) + derived[j] - derived[i];
  }

  /// The most any of layers [i, j) holds beyond its kept activations while
  /// it runs (LayerCost::workingBytes); 0 for none.
  int64_t working(int i, int j) const {
    if (i >= j)
      return 0;
    int p = 0;
    while ((2 << p) <= j - i)
      ++p;
    return std::max(workingMax[p][i], workingMax[p][j - (1 << p)]);
  }

  /// How many of each chunk's first layers recompute, for the partition at
  /// \p cuts: none or all as the flag says; with auto, per rank, the fewest
  /// that fit its limit, layer by layer where a layer frees the most bytes
  /// per second of forward it costs again (every layer where nothing fits).
  std::vector<int> recomputedLayers(const std::vector<int> &cuts) const {
    std::vector<int> count(chunks, 0);
    for (int k = 0; k < chunks; ++k)
      if (options.training.training && options.training.recompute == Recompute::All)
        count[k] = cuts[k + 1] - cuts[k];
    if (!options.training.training || options.training.recompute != Recompute::Auto)
      return count;
    auto bytes = [&](int k) { return memoryWith(k, cuts[k], cuts[k + 1], count[k]); };
    for (int r = 0; r < options.shape.stages(); ++r) {
      int64_t limit = options.memoryLimit[r];
      if (limit <= 0)
        continue;
      int64_t sum = 0;
      for (int k = 0; k < chunks; ++k)
        sum += rankOf(k) == r ? bytes(k) : 0;
      while (sum > limit) {
        int best = -1;
        double bestRate = 0;
        int64_t bestFreed = 0;
        for (int k = 0; k < chunks; ++k) {
          int i = cuts[k], j = cuts[k + 1];
          if (rankOf(k) != r || count[k] >= j - i)
            continue;
          int64_t freed = bytes(k) - memoryWith(k, i, j, count[k] + 1);
          double again = computeTime(k, i + count[k], i + count[k] + 1, 0);
          double rate = static_cast<double>(freed) / std::max(again, 1e-12);
          if (best < 0 || rate > bestRate)
            best = k, bestRate = rate, bestFreed = freed;
        }
        if (best < 0)
          break;
        // The first layer recomputed only starts to pay once the next ones
        // do (the chunk's input is kept): take it whatever it frees.
        ++count[best];
        sum -= bestFreed;
      }
      if (sum > limit) // nothing fits: as --recompute all, for the error
        for (int k = 0; k < chunks; ++k)
          if (rankOf(k) == r)
            count[k] = cuts[k + 1] - cuts[k];
    }
    return count;
  }

  /// Whether chunk [i, j) fits what chunk \p chunk may take (capOf).
  bool fits(int chunk, int i, int j) const {
    int64_t cap = capOf(chunk);
    return memoryBound[chunk] <= cap || memory(chunk, i, j) <= cap;
  }

  /// What one chunk may take while partitioning: its rank's whole limit, or
  /// an even share of it once evenShares is set (see rankFits).
  int64_t capOf(int chunk) const {
    int64_t limit = options.memoryLimit[rankOf(chunk)];
    if (limit <= 0)
      return std::numeric_limits<int64_t>::max();
    return evenShares ? limit / options.shape.virtualStages() : limit;
  }

  /// Whether every rank's chunks of \p cuts, summed, fit its limit: the test
  /// a partition has to pass. The DP bounds one chunk at a time, so with
  /// V > 1 it is run against the whole limit first and, if the sum then
  /// overruns, again with each chunk held to an even share.
  bool rankFits(const std::vector<int> &cuts) const {
    std::vector<int64_t> sum(options.shape.stages(), 0);
    for (int k = 0; k < chunks; ++k)
      sum[rankOf(k)] += memory(k, cuts[k], cuts[k + 1]);
    for (int r = 0; r < options.shape.stages(); ++r)
      if (options.memoryLimit[r] > 0 && sum[r] > options.memoryLimit[r])
        return false;
    return true;
  }

  bool evenShares = false;

private:
  bool passCounts(int pass) const { return options.training.training || pass == 0; }
  /// commTime, computed.
  double sendTime(int chunk, int j) const {
    if (j <= 0 || j >= layers || chunk + 1 >= chunks)
      return 0;
    int from = rankOf(chunk), to = rankOf(chunk + 1);
    if (from == to)
      return 0;
    const HardwareSpec &hw = options.rankHardware[from];
    bool sameNode = from / std::max(1, hw.devicesPerNode) == to / std::max(1, hw.devicesPerNode);
    const LinkSpec &link = sameNode ? hw.intraNode : hw.interNode;
    int64_t bytes = options.rankCosts[from]->layers[j - 1].boundaryBytes;
    return link.transferTime(bytes) * (options.training.training ? 2 : 1);
  }

  const LayerGraph &lg;
  const BalanceOptions &options;
  int layers, chunks;
  std::map<const CostTable *, int> tableIndex;
  std::vector<std::array<std::vector<double>, 3>> prefix;
  std::vector<int64_t> params, activations;
  /// Prefix sums of the layers' derivedWeightBytes.
  std::vector<int64_t> derived;
  /// workingMax[p][i]: the most working bytes of layers [i, i + 2^p).
  std::vector<std::vector<int64_t>> workingMax;
  std::vector<std::pair<int64_t, std::vector<int>>> shared;
  /// Per global chunk: microbatches of activations held at the peak, and of
  /// recomputed activations (peakRebuiltPerChunk).
  std::vector<int64_t> held, rebuiltHeld;
  /// Per global chunk: at least memory(chunk, i, j) for any i < j (every
  /// layer's parameters and activations, the largest boundary).
  std::vector<int64_t> memoryBound;
  /// Per global chunk: its rank, its rank's prefix table, and commTime at
  /// each cut.
  std::vector<int> chunkRank;
  std::vector<const std::array<std::vector<double>, 3> *> chunkPrefix;
  std::vector<std::vector<double>> chunkSend;
};

/// Whether a chunk fits memory, for the DPs: chunk k of layers [i, j)
/// against ChunkCosts::fits, or always when no costs are given.
struct ChunkFits {
  const ChunkCosts *costs = nullptr;
  bool operator()(int k, int i, int j) const { return !costs || costs->fits(k, i, j); }
};

/// The least bottleneck of a contiguous partition of L layers into K
/// non-empty chunks: the largest cost(k, i, j) made as small as fits(k, i, j)
/// allows (infinity when nothing fits). cost(k, i, j) must not decrease as
/// a chunk grows to the left (i smaller); fits may be anything. The DPs
/// take the cost as a template argument: they call it O(K L^2) times.
template <typename ChunkCost>
double leastBottleneck(int layers, int chunks, const ChunkCost &cost, const ChunkFits &fits) {
  std::vector<std::vector<double>> best(chunks, std::vector<double>(layers + 1, inf));
  for (int j = 1; j <= layers - (chunks - 1); ++j)
    if (fits(0, 0, j))
      best[0][j] = cost(0, 0, j);
  for (int k = 1; k < chunks; ++k)
    for (int j = k + 1; j <= layers - (chunks - 1 - k); ++j)
      for (int i = j - 1; i >= k; --i) {
        double c = cost(k, i, j);
        if (c >= best[k][j])
          break; // cost only grows as the chunk grows to the left
        if (!fits(k, i, j))
          continue; // memory need not be monotone (recompute keeps the input)
        best[k][j] = std::min(best[k][j], std::max(best[k - 1][i], c));
      }
  return best[chunks - 1][layers];
}

/// The most even partition (least sum of squared costs) whose every chunk
/// costs at most \p limit: its K + 1 cut positions, or an empty vector when
/// none is.
template <typename ChunkCost>
std::vector<int> mostEven(int layers, int chunks, const ChunkCost &cost, const ChunkFits &fits,
                          double limit) {
  std::vector<std::vector<double>> squares(chunks, std::vector<double>(layers + 1, inf));
  std::vector<std::vector<int>> from(chunks, std::vector<int>(layers + 1, -1));
  // Row k - 1 is finite only at [lo, hi]: the chunk before may end nowhere
  // else, so i starts at hi (where the cost is at least that of any later
  // i, all of which would add nothing) and stops at lo.
  int lo = layers + 1, hi = -1;
  for (int j = 1; j <= layers - (chunks - 1); ++j)
    if (fits(0, 0, j) && cost(0, 0, j) <= limit) {
      squares[0][j] = cost(0, 0, j) * cost(0, 0, j), from[0][j] = 0;
      lo = std::min(lo, j), hi = std::max(hi, j);
    }
  for (int k = 1; k < chunks; ++k) {
    int rowLo = layers + 1, rowHi = -1;
    for (int j = std::max(k + 1, lo + 1); j <= layers - (chunks - 1 - k); ++j) {
      for (int i = std::min(j - 1, hi); i >= std::max(k, lo); --i) {
        double c = cost(k, i, j);
        // The cost only grows as the chunk grows to the left: once its
        // square alone reaches the best sum, no i further left does better.
        if (c > limit || c * c >= squares[k][j])
          break;
        if (!fits(k, i, j))
          continue;
        double s = squares[k - 1][i] + c * c;
        if (s < squares[k][j])
          squares[k][j] = s, from[k][j] = i;
      }
      if (squares[k][j] < inf)
        rowLo = std::min(rowLo, j), rowHi = std::max(rowHi, j);
    }
    lo = rowLo, hi = rowHi;
  }
  if (squares[chunks - 1][layers] == inf)
    return {};
  std::vector<int> cuts(chunks + 1, 0);
  cuts[chunks] = layers;
  for (int k = chunks - 1; k > 0; --k)
    cuts[k] = from[k][cuts[k + 1]];
  return cuts;
}

/// Exact min-max partition: the least bottleneck, then the most even
/// partition that reaches it. Empty when nothing fits.
template <typename ChunkCost>
std::vector<int> partition(int layers, int chunks, const ChunkCost &cost, const ChunkFits &fits) {
  double bottleneck = leastBottleneck(layers, chunks, cost, fits);
  if (bottleneck == inf)
    return {};
  return mostEven(layers, chunks, cost, fits, bottleneck * (1 + 1e-12) + 1e-300);
}

Error memoryError(const LayerGraph &lg, const ChunkCosts &costs, bool recomputes) {
  // A single layer that cannot fit anywhere is the clearest answer.
  for (int l = 0; l < costs.layerCount(); ++l) {
    bool fitsSomewhere = false;
    for (int k = 0; k < costs.chunkCount() && !fitsSomewhere; ++k)
      fitsSomewhere = costs.memory(k, l, l + 1) <= costs.capOf(k);
    if (!fitsSomewhere)
      return createStringError(inconvertibleErrorCode(),
                               "layer %d ('%s') alone needs %lld bytes, more than any stage's "
                               "memory limit allows",
                               l, lg.layers[l].name.c_str(),
                               static_cast<long long>(costs.memory(0, l, l + 1)));
  }
  // Otherwise the stage that overflows most in the memory-blind optimum.
  auto cuts = partition(
      costs.layerCount(), costs.chunkCount(),
      [&](int k, int i, int j) { return costs.time(k, i, j); }, ChunkFits());
  int worst = 0;
  double worstRatio = 0;
  for (int k = 0; k < costs.chunkCount(); ++k) {
    double ratio = static_cast<double>(costs.memory(k, cuts[k], cuts[k + 1])) /
                   static_cast<double>(costs.capOf(k));
    if (ratio > worstRatio)
      worstRatio = ratio, worst = k;
  }
  return createStringError(
      inconvertibleErrorCode(),
      "no partition into %d stages fits the memory limits: stage %d (rank %d, layers %d..%d) "
      "needs %lld bytes against a limit of %lld%s; raise --memory-limit, add stages%s",
      costs.chunkCount(), worst, costs.rankOf(worst), cuts[worst], cuts[worst + 1] - 1,
      static_cast<long long>(costs.memory(worst, cuts[worst], cuts[worst + 1])),
      static_cast<long long>(costs.capOf(worst)), recomputes ? " with every layer recomputing" : "",
      recomputes ? "" : ", or turn on --recompute (auto: only where needed)");
}

} // namespace

namespace {

/// \p text with "(...)*N" and "x*N" expanded into plain text; errors come
/// from \p fail.
Expected<std::string> expandRepeats(StringRef text, function_ref<Error(const Twine &)> fail) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    std::string unit;
    if (text[i] == '(') {
      int depth = 0;
      size_t j = i;
      for (; j < text.size(); ++j) {
        depth += text[j] == '(' ? 1 : text[j] == ')' ? -1 : 0;
        if (depth == 0)
          break;
      }
      if (j == text.size())
        return fail("unbalanced parenthesis");
      auto inner = expandRepeats(text.slice(i + 1, j), fail);
      if (!inner)
        return inner.takeError();
      unit = *inner;
      i = j + 1;
    } else {
      unit = std::string(1, text[i]);
      ++i;
    }
    if (i < text.size() && text[i] == '*') {
      size_t j = ++i;
      while (j < text.size() && isDigit(text[j]))
        ++j;
      unsigned n;
      if (text.slice(i, j).getAsInteger(10, n))
        return fail(formatv("expected a count after '*' at offset {0}", i));
      std::string repeated;
      for (unsigned r = 0; r < n; ++r)
        repeated += unit;
      unit = repeated;
      i = j;
    }
    out += unit;
  }
  return out;
}

} // namespace

Expected<std::vector<std::pair<int, int>>> parseLayout(StringRef layout, const LayerGraph &lg,
                                                       int chunks) {
  auto fail = [&](const Twine &why) -> Error {
    return createStringError(inconvertibleErrorCode(), "--balance %s: %s", layout.str().c_str(),
                             why.str().c_str());
  };
  auto expanded = expandRepeats(layout, fail);
  if (!expanded)
    return expanded.takeError();
  SmallVector<StringRef, 16> stages;
  StringRef(*expanded).split(stages, '|');
  if (static_cast<int>(stages.size()) != chunks)
    return fail(formatv("has {0} stages, the plan has {1} (stages x virtual stages)", stages.size(),
                        chunks));
  int layers = static_cast<int>(lg.layers.size());
  int firstBlock = layers, lastBlock = -1;
  for (int l = 0; l < layers; ++l)
    if (lg.layers[l].kind == LayerKind::Block)
      firstBlock = std::min(firstBlock, l), lastBlock = std::max(lastBlock, l);
  std::vector<std::pair<int, int>> ranges;
  int next = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    int begin = next;
    for (char c : stages[s]) {
      if (c == ',' || c == ' ')
        continue;
      auto expect = [&](bool ok, const char *what) -> Error {
        if (ok)
          return Error::success();
        std::string at = next < layers
                             ? formatv("layer {0} ('{1}', {2})", next, lg.layers[next].name,
                                       layerKindName(lg.layers[next].kind))
                                   .str()
                             : std::string("the end of the model");
        return fail(formatv("stage {0}: '{1}' wants {2}, but the next is {3}", s, c, what, at));
      };
      switch (c) {
      case 'E':
        if (Error err = expect(next == 0 && firstBlock > 0, "the layers before the first block"))
          return err;
        next = std::min(firstBlock, layers);
        break;
      case 't':
        if (Error err =
                expect(next < layers && lg.layers[next].kind == LayerKind::Block, "a block"))
          return err;
        ++next;
        break;
      case 'L':
        if (Error err =
                expect(next == lastBlock + 1 && next < layers, "the layers after the last block"))
          return err;
        next = layers;
        break;
      case 'o':
        if (Error err = expect(next < layers, "a layer"))
          return err;
        ++next;
        break;
      default:
        return fail(
            formatv("stage {0}: unknown token '{1}' (use E, t, L, o, *N, (...), | and ,)", s, c));
      }
    }
    ranges.emplace_back(begin, next - 1);
  }
  if (next != layers)
    return fail(formatv("covers {0} of the model's {1} layers", next, layers));
  return ranges;
}

void printStagePlan(const StagePlan &plan, raw_ostream &os) {
  os << formatv("stageplan method={0} layout=\"{1}\" chunks={2} ranks={3}\n",
                balanceMethodName(plan.method), plan.layout, plan.chunks.size(), plan.ranks.size());
  os << formatv("  bottleneck={0:e3}s least-bottleneck={1:e3}s simulated-step={2:e3}s "
                "imbalance={3:f4} fits-memory={4} candidates={5}\n",
                plan.bottleneck, plan.leastBottleneck, plan.simulatedStep, plan.imbalance,
                plan.fitsMemory ? "yes" : "no", plan.candidatesSimulated);
  for (const ChunkPlan &c : plan.chunks)
    os << formatv("chunk {0} rank {1}.{2} layers {3}..{4} params={5} F={6:e3}s I={7:e3}s "
                  "W={8:e3}s send={9:e3}s act_bytes={10} boundary_bytes={11}\n",
                  c.index, c.rank, c.chunkOnRank, c.firstLayer, c.lastLayer, c.params,
                  c.time[Forward], c.time[BackwardInput], c.time[BackwardWeight], c.commTime,
                  c.activationBytes, c.boundaryBytes);
  for (const RankPlan &r : plan.ranks)
    os << formatv("rank {0} hardware={1} limit={2} weights={3} activations={4} peak={5} "
                  "busy={6:e3}s\n",
                  r.index, r.hardware, r.memoryLimit, r.weightBytes, r.activationBytes,
                  r.peakMemory, r.busy);
}

std::string formatLayout(const LayerGraph &lg, const StagePlan &plan) {
  int layers = static_cast<int>(lg.layers.size());
  int firstBlock = layers, lastBlock = -1;
  for (int l = 0; l < layers; ++l)
    if (lg.layers[l].kind == LayerKind::Block)
      firstBlock = std::min(firstBlock, l), lastBlock = std::max(lastBlock, l);
  std::string out;
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    const ChunkPlan &c = plan.chunks[k];
    if (k)
      out += "|";
    std::vector<std::string> items;
    int l = c.firstLayer;
    while (l <= c.lastLayer) {
      if (l == 0 && firstBlock > 0 && firstBlock <= layers && c.lastLayer >= firstBlock - 1) {
        items.push_back("E");
        l = firstBlock;
      } else if (l == lastBlock + 1 && c.lastLayer == layers - 1 && lastBlock >= 0) {
        items.push_back("L");
        l = layers;
      } else if (lg.layers[l].kind == LayerKind::Block) {
        int run = 0;
        while (l <= c.lastLayer && lg.layers[l].kind == LayerKind::Block)
          ++run, ++l;
        items.push_back(run == 1 ? "t" : formatv("t*{0}", run).str());
      } else {
        items.push_back("o");
        ++l;
      }
    }
    out += join(items, ",");
  }
  return out;
}

namespace {

/// The StagePlan of the partition at \p cuts: each chunk's layers, times,
/// parameters and bytes, each rank's memory; its step is simulated (StepPredictor).
StagePlan describePlan(const LayerGraph &lg, const BalanceOptions &options, const ChunkCosts &costs,
                       const std::vector<int> &cuts) {
  int chunks = costs.chunkCount(), layers = costs.layerCount();
  StagePlan plan;
  plan.method = options.method;
  std::vector<int> chunksSeen(options.shape.stages(), 0);
  std::vector<int> recomputed = costs.recomputedLayers(cuts);
  for (int k = 0; k < chunks; ++k) {
    ChunkPlan c;
    c.index = k;
    c.rank = costs.rankOf(k);
    c.chunkOnRank = chunksSeen[c.rank]++;
    int i = cuts[k], j = cuts[k + 1];
    c.firstLayer = i;
    c.lastLayer = j - 1;
    for (int p = 0; p < 3; ++p)
      c.time[p] = costs.computeTime(k, i, j, p);
    c.commTime = i < j ? costs.commTime(k, j) : 0;
    c.params = costs.paramsOf(i, j);
    const CostTable &table = *options.rankCosts[c.rank];
    for (int l = i; l < j; ++l) {
      c.flopsForward += table.layers[l].flops[Forward];
      c.activationBytes += table.layers[l].activationBytes;
    }
    c.boundaryBytes = j > 0 && j < layers && k + 1 < chunks ? table.layers[j - 1].boundaryBytes : 0;
    c.workingBytes = costs.working(i, j);
    c.recomputedLayers = recomputed[k];
    for (int l = i; l < i + recomputed[k]; ++l)
      c.rebuiltBytes += table.layers[l].activationBytes;
    c.recomputeTime = costs.computeTime(k, i, i + recomputed[k], 0);
    plan.chunks.push_back(c);
  }
  plan.layout = formatLayout(lg, plan);
  double sum = 0;
  for (const ChunkPlan &c : plan.chunks) {
    plan.bottleneck = std::max(plan.bottleneck, c.totalTime());
    sum += c.totalTime();
  }
  plan.imbalance = sum > 0 ? plan.bottleneck / (sum / chunks) : 1;
  for (int r = 0; r < options.shape.stages(); ++r) {
    RankPlan rank;
    rank.index = r;
    rank.hardware = options.rankHardware[r].name;
    rank.memoryLimit = options.memoryLimit[r];
    plan.ranks.push_back(rank);
  }
  for (int k = 0; k < chunks; ++k) {
    const ChunkPlan &c = plan.chunks[k];
    RankPlan &rank = plan.ranks[c.rank];
    int64_t total = costs.memoryWith(k, cuts[k], cuts[k + 1], c.recomputedLayers);
    int64_t weights = costs.weightBytesOf(cuts[k], cuts[k + 1]);
    rank.weightBytes += weights;
    rank.optimizerBytes += optimizerStateBytes(c.params, options.training);
    rank.activationBytes += total - weights;
    rank.peakMemory += total;
    rank.busy += options.shape.microbatches() *
                 (options.training.training ? c.totalTime() : c.time[0] + c.commTime);
  }
  for (const RankPlan &rank : plan.ranks)
    if (rank.memoryLimit > 0 && rank.peakMemory > rank.memoryLimit)
      plan.fitsMemory = false;
  return plan;
}

/// `time`: the partition that fits memory with the least simulated step.
/// Candidates: the most even partition under each bottleneck of the Pareto
/// front between \p leastCuts (the min-max optimum) and the most even
/// partition of all, sampled evenly when there are more bottlenecks than a
/// quarter of options.maxCandidates; the params and uniform layouts; then
/// steepest descent over moves of one layer across one boundary.
class FastestPartition {
public:
  FastestPartition(const LayerGraph &lg, const BalanceOptions &options, const ChunkCosts &costs,
                   const ChunkFits &fits)
      : lg(lg), options(options), costs(costs), fits(fits), predict(options),
        layers(costs.layerCount()), chunks(costs.chunkCount()) {}

  Expected<std::vector<int>> run(const std::vector<int> &leastCuts, double least);
  int simulated() const { return static_cast<int>(seen.size()); }
  double bestStep() const { return best; }

private:
  /// The simulated step of \p cuts (infinity when it does not fit memory or
  /// the candidate budget is spent); the first error is kept in \p failure.
  double judge(const std::vector<int> &cuts);
  void consider(const std::vector<int> &cuts) {
    if (cuts.empty())
      return;
    double step = judge(cuts);
    if (step < best * (1 - 1e-12))
      best = step, bestCuts = cuts;
  }
  std::vector<double> paretoBottlenecks(double least, double most) const;

  const LayerGraph &lg;
  const BalanceOptions &options;
  const ChunkCosts &costs;
  const ChunkFits &fits;
  StepPredictor predict;
  int layers, chunks;
  std::map<std::vector<int>, double> seen;
  std::optional<Error> failure;
  double best = inf;
  std::vector<int> bestCuts;
};

double FastestPartition::judge(const std::vector<int> &cuts) {
  if (auto it = seen.find(cuts); it != seen.end())
    return it->second;
  if (!costs.rankFits(cuts) || simulated() >= options.maxCandidates)
    return inf;
  auto step = predict(describePlan(lg, options, costs, cuts));
  double value = inf;
  if (step)
    value = *step;
  else if (!failure)
    failure = step.takeError();
  else
    consumeError(step.takeError());
  seen[cuts] = value;
  return value;
}

std::vector<double> FastestPartition::paretoBottlenecks(double least, double most) const {
  // Every chunk cost between the two is a bottleneck some partition may
  // reach; the sampled ones keep both ends.
  std::vector<double> values;
  for (int k = 0; k < chunks; ++k)
    for (int j = k + 1; j <= layers - (chunks - 1 - k); ++j)
      for (int i = k == 0 ? 0 : j - 1; i >= k; --i) {
        double c = costs.time(k, i, j);
        if (c > most)
          break;
        if (c >= least && fits(k, i, j))
          values.push_back(c);
      }
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end(),
                           [](double a, double b) { return b <= a * (1 + 1e-12); }),
               values.end());
  size_t cap = static_cast<size_t>(std::max(2, options.maxCandidates / 4));
  if (values.size() <= cap)
    return values;
  std::vector<double> sampled;
  for (size_t t = 0; t < cap; ++t)
    sampled.push_back(values[t * (values.size() - 1) / (cap - 1)]);
  return sampled;
}

Expected<std::vector<int>> FastestPartition::run(const std::vector<int> &leastCuts, double least) {
  auto time = [&](int k, int i, int j) { return costs.time(k, i, j); };
  consider(leastCuts);
  std::vector<int> even = mostEven(layers, chunks, time, fits, inf);
  double most = least;
  for (int k = 0; !even.empty() && k < chunks; ++k)
    most = std::max(most, costs.time(k, even[k], even[k + 1]));
  for (double bottleneck : paretoBottlenecks(least, most))
    consider(mostEven(layers, chunks, time, fits, bottleneck * (1 + 1e-12) + 1e-300));
  consider(even);
  // The other methods' layouts, so that `time` is never slower than them.
  consider(partition(
      layers, chunks, [&](int, int i, int j) { return static_cast<double>(costs.paramsOf(i, j)); },
      fits));
  std::vector<int> uniform{0};
  for (int k = 0; k < chunks; ++k)
    uniform.push_back(uniform.back() + layers / chunks + (k < layers % chunks ? 1 : 0));
  consider(uniform);
  // Steepest descent: one layer across one boundary, while the step shrinks.
  while (!bestCuts.empty() && simulated() < options.maxCandidates) {
    std::vector<int> from = bestCuts;
    for (int k = 1; k < chunks; ++k)
      for (int d : {-1, 1}) {
        std::vector<int> moved = from;
        moved[k] += d;
        if (moved[k] > moved[k - 1] && moved[k] < moved[k + 1])
          consider(moved);
      }
    if (bestCuts == from)
      break;
  }
  if (bestCuts.empty() && failure)
    return std::move(*failure);
  if (failure)
    consumeError(std::move(*failure));
  return bestCuts.empty() ? leastCuts : bestCuts;
}

} // namespace

Expected<StagePlan> balanceStages(const LayerGraph &lg, const BalanceOptions &options) {
  int stages = options.shape.stages(), chunks = options.shape.chunks();
  int layers = static_cast<int>(lg.layers.size());
  if (static_cast<int>(options.rankCosts.size()) != stages ||
      static_cast<int>(options.rankHardware.size()) != stages ||
      static_cast<int>(options.memoryLimit.size()) != stages)
    return createStringError(inconvertibleErrorCode(),
                             "balance-stages: need a cost table, hardware and memory limit per "
                             "rank (%d ranks)",
                             stages);
  ChunkCosts costs(lg, options);
  std::vector<int> cuts;
  double least = 0;
  int simulated = 0;
  if (options.method == BalanceMethod::Layout) {
    auto ranges = parseLayout(options.layout, lg, chunks);
    if (!ranges)
      return ranges.takeError();
    cuts.push_back(0);
    for (auto &[first, last] : *ranges)
      cuts.push_back(last + 1);
  } else {
    if (layers < chunks)
      return createStringError(
          inconvertibleErrorCode(),
          "cannot split %d layers into %d stages without leaving a stage empty; use fewer "
          "--stages or --virtual-stages, or a --balance layout with empty stages",
          layers, chunks);
    ChunkFits fits{&costs};
    auto time = [&](int k, int i, int j) { return costs.time(k, i, j); };
    auto split = [&] {
      if (options.method == BalanceMethod::Params)
        return partition(
            layers, chunks,
            [&](int, int i, int j) { return static_cast<double>(costs.paramsOf(i, j)); }, fits);
      return partition(layers, chunks, time, fits);
    };
    if (options.method == BalanceMethod::Uniform) {
      cuts.push_back(0);
      for (int k = 0; k < chunks; ++k)
        cuts.push_back(cuts.back() + layers / chunks + (k < layers % chunks ? 1 : 0));
    } else {
      cuts = split();
      if (!cuts.empty() && !costs.rankFits(cuts) && options.shape.virtualStages() > 1) {
        costs.evenShares = true;
        cuts = split();
      }
      if (!cuts.empty() && !costs.rankFits(cuts))
        cuts.clear();
    }
    if (cuts.empty())
      return memoryError(lg, costs, options.training.recompute != Recompute::None);
    if (options.method == BalanceMethod::Time) {
      least = leastBottleneck(layers, chunks, time, fits);
      FastestPartition search(lg, options, costs, fits);
      auto fastest = search.run(cuts, least);
      if (!fastest)
        return fastest.takeError();
      cuts = std::move(*fastest);
      simulated = search.simulated();
    }
  }

  StagePlan plan = describePlan(lg, options, costs, cuts);
  plan.leastBottleneck = least;
  plan.candidatesSimulated = simulated;
  if (auto step = StepPredictor(options)(plan))
    plan.simulatedStep = *step;
  else
    consumeError(step.takeError()); // a hand-made layout the lowering refuses
  if (!plan.fitsMemory && options.method == BalanceMethod::Layout) {
    for (const RankPlan &rank : plan.ranks)
      if (rank.memoryLimit > 0 && rank.peakMemory > rank.memoryLimit)
        return createStringError(
            inconvertibleErrorCode(), "layout %s: rank %d needs %lld bytes against a limit of %lld",
            plan.layout.c_str(), rank.index, static_cast<long long>(rank.peakMemory),
            static_cast<long long>(rank.memoryLimit));
  }
  return plan;
}

} // namespace pipec
