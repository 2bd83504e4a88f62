//===- SearchParallel.cpp - --parallel auto: T, P, D and M for a cluster -===//
#include "driver/SearchParallel.h"
#include "driver/CompileParts.h"
#include "driver/InspectReport.h"
#include "driver/Report.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"
#include "support/Parallel.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/BuryPointer.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <thread>

using namespace llvm;

namespace pipec {
namespace {

/// One (T, P, D, b) layout, with the best schedule judged for it or why it
/// has none.
struct Layout {
  int tp = 1, stages = 1, dp = 1, microbatches = 1;
  int64_t size = 1; ///< samples per microbatch
  /// The fastest schedule that fits, else the one closest to fitting.
  std::optional<ScheduleKind> kind;
  int virtualStages = 1;
  double step = 0, mfu = 0;
  int64_t peak = 0, limit = 0;
  bool fits = false, pruned = false;
  std::string why; ///< pruned or no plan: the reason

  std::string name() const {
    std::string text = formatv("T={0} P={1} D={2}", tp, stages, dp).str();
    if (!pruned)
      text += formatv(" M={0}x{1}", microbatches, size).str();
    return text;
  }
  std::string scheduleText() const {
    return formatv("{0} V={1}", scheduleName(*kind), virtualStages).str();
  }
  /// How far over its limit the closest schedule's peak is (0 when it fits).
  double overBy() const { return limit > 0 && peak > limit ? double(peak) / limit : 0; }
};

std::vector<int> divisorsOf(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0)
      out.push_back(d);
  return out;
}

class ParallelSearch {
public:
  ParallelSearch(StringRef modelPath, const CompileOptions &options, Setup setup, int perNode,
                 const PipelineOptions &pipeline)
      : modelPath(modelPath), options(options), setup(std::move(setup)), perNode(perNode),
        quiet(PassRunner(pipeline).quiet()) {}
  ~ParallelSearch() {
    if (options.disableFree)
      for (auto &[key, prepared] : cache)
        BuryPointer(std::move(prepared));
  }

  /// Judges every layout; errors only for what ends the search.
  Error run();
  /// The best layout that fits, or null.
  const Layout *winner() const;
  /// The plan's parallel_search lines after the first: every layout, the
  /// fitting by step, then the rest by how close they came.
  std::vector<std::string> lines() const;
  /// The first line, once the chosen plan is built: the choice, with the
  /// plan's predicted step and MFU (after select-recompute priced the nodes
  /// it reruns), and what the search judged in \p seconds.
  std::function<std::string(const plan::Plan &)> headlineFor(double seconds) const;
  /// Why nothing fits: the layout that came closest.
  std::string nothingFits() const;

private:
  /// Balances and simulates \p layout under each schedule through \p runner;
  /// returns how many schedules it judged. Reads the search's state only, so
  /// layouts are judged on threads of their own.
  int judgeLayout(Layout &layout, const Prepared &prepared, PassRunner &runner) const;
  /// Prepares the front half of each (T, microbatch size) of \p keys that
  /// is not prepared yet, on as many threads as the process may use cores
  /// (onEveryCore), into `cache` or, with why, `failed`.
  void prepareAll(const std::vector<std::pair<int, int64_t>> &keys);
  std::vector<std::pair<ScheduleKind, int>> schedules() const;

  StringRef modelPath;
  const CompileOptions &options;
  Setup setup;
  int perNode;
  PassRunner quiet;
  /// The front half at each (T, microbatch size), prepared once; or why
  /// that T cannot split the model.
  std::map<std::pair<int, int64_t>, std::unique_ptr<Prepared>> cache;
  std::map<std::pair<int, int64_t>, std::string> failed;
  std::string hash; ///< the model file's, once the first front half read it
  std::vector<Layout> layouts;
  /// T that cannot split the model: the reason, one line each.
  std::vector<std::string> refused;
  int skippedBatch = 0;
  int judged = 0;
};

std::vector<std::pair<ScheduleKind, int>> ParallelSearch::schedules() const {
  std::vector<std::pair<ScheduleKind, int>> out;
  if (!options.autoSchedule) {
    int v = options.virtualStages > 0 ? options.virtualStages
                                      : traitsOf(options.schedule).defaultVirtualStages;
    out.push_back({options.schedule, v});
    return out;
  }
  for (const ScheduleTraits &row : scheduleTable())
    if (row.autoCandidate)
      out.push_back({row.kind, row.defaultVirtualStages});
  return out;
}

int ParallelSearch::judgeLayout(Layout &layout, const Prepared &prepared,
                                PassRunner &runner) const {
  CompileOptions at = options;
  at.tensorParallel = layout.tp;
  at.sequenceParallel = options.sequenceParallel && layout.tp > 1;
  at.stages = layout.stages;
  at.dataParallel = layout.dp;
  at.microbatches = layout.microbatches;
  Setup ranks = setup;
  ranks.hardware.assign(layout.stages, setup.hardware[0]);
  ranks.limits.assign(layout.stages, setup.limits[0]);
  int count = 0;
  const HardwareSpec &hw = setup.hardware[0];
  double peakFlops = hw.peakFlops(setup.precision == Precision::BF16);
  // Why no schedule has a plan: balancing's reason (memory) before a
  // schedule's refusal of the shape.
  std::string balanceError, shapeError;
  for (auto [kind, v] : schedules()) {
    auto shape =
        PipelineShape::make(kind, layout.stages, v, layout.microbatches, layout.size, layout.dp);
    if (!shape) {
      shapeError = toString(shape.takeError());
      continue;
    }
    auto made = judge(at, ranks, prepared, *shape, runner);
    ++count;
    if (!made) {
      balanceError = toString(made.takeError());
      continue;
    }
    const Judged &j = *made;
    int over = j.overRank();
    int64_t peak = 0, limit = 0;
    for (size_t r = 0; r < j.stagePlan.ranks.size(); ++r)
      if (j.prediction.peakMemory[r] >= peak) {
        peak = j.prediction.peakMemory[r];
        limit = j.stagePlan.ranks[r].memoryLimit;
      }
    bool fits = over < 0;
    double step = j.prediction.step;
    // Better: fits and faster; or neither fits and this one is closer.
    bool better = !layout.kind || (fits && (!layout.fits || step < layout.step)) ||
                  (!fits && !layout.fits && peak < layout.peak);
    if (!better)
      continue;
    double forward = 0;
    for (const ChunkPlan &c : j.stagePlan.chunks)
      forward += c.flopsForward;
    double flops =
        modelFlopsPerStep(forward, layout.microbatches, layout.dp, layout.tp, options.training);
    layout.kind = kind;
    layout.virtualStages = v;
    layout.step = step;
    layout.fits = fits;
    layout.peak = peak;
    layout.limit = limit;
    layout.mfu = step > 0 && peakFlops > 0 ? flops / (step * options.parallel.gpus * peakFlops) : 0;
  }
  if (!layout.kind)
    layout.why = "no plan: " + (balanceError.empty() ? shapeError : balanceError);
  return count;
}

/// Runs \p body(i) for i in [0, n) on as many threads as this process may
/// use cores (the calling one among them), each taking the next i when it
/// is done with one, with its own runner copied from \p quiet.
void onEveryCore(size_t n, const PassRunner &quiet,
                 const std::function<void(size_t, PassRunner &)> &body) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    PassRunner runner = quiet.quiet();
    for (size_t i = next++; i < n; i = next++)
      body(i, runner);
  };
  size_t threads = std::min<size_t>(n, static_cast<size_t>(allowedCpuCount()));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t)
    pool.emplace_back(work);
  work();
  for (std::thread &t : pool)
    t.join();
}

void ParallelSearch::prepareAll(const std::vector<std::pair<int, int64_t>> &keys) {
  std::vector<std::pair<int, int64_t>> missing;
  for (const auto &key : keys)
    if (!cache.count(key) && !failed.count(key) &&
        std::find(missing.begin(), missing.end(), key) == missing.end())
      missing.push_back(key);
  if (missing.empty())
    return;
  auto prepareOne = [&](std::pair<int, int64_t> key, PassRunner &runner, StringRef hash) {
    CompileOptions at = options;
    at.tensorParallel = key.first;
    at.sequenceParallel = options.sequenceParallel && key.first > 1;
    return prepare(modelPath, at, runner, setup, key.second, hash);
  };
  auto keep = [&](std::pair<int, int64_t> key, Expected<std::unique_ptr<Prepared>> made) {
    if (made)
      cache[key] = std::move(*made);
    else
      failed[key] = toString(made.takeError());
  };
  // The first front half hashes the model file, and any setup done on first
  // use runs on one thread; the others reuse its hash.
  size_t from = 0;
  if (hash.empty()) {
    PassRunner runner = quiet.quiet();
    auto made = prepareOne(missing[0], runner, "");
    if (made)
      hash = (*made)->xxh3;
    keep(missing[0], std::move(made));
    from = 1;
  }
  std::vector<std::optional<Expected<std::unique_ptr<Prepared>>>> made(missing.size());
  onEveryCore(missing.size() - from, quiet, [&](size_t i, PassRunner &runner) {
    made[from + i].emplace(prepareOne(missing[from + i], runner, hash));
  });
  for (size_t i = from; i < missing.size(); ++i)
    keep(missing[i], std::move(*made[i]));
}

Error ParallelSearch::run() {
  const int gpus = options.parallel.gpus;
  const int64_t batch = options.globalBatch;
  std::vector<int64_t> sizes = {1, 2, 4};
  TrainingSetup training = trainingSetup(options, setup, 1);
  // Every T's front half for microbatches of one sample (its layers and
  // parameters bound the layouts), then those of the other sizes the
  // layouts ask for, each prepared once and on threads of their own.
  std::vector<int> tps;
  for (int tp : divisorsOf(perNode))
    if (gpus % tp == 0 && (!options.parallel.fixedTp || tp == options.tensorParallel))
      tps.push_back(tp);
  std::vector<std::pair<int, int64_t>> firsts;
  for (int tp : tps)
    firsts.push_back({tp, 1});
  prepareAll(firsts);
  // The layouts to judge and the front half of each.
  std::vector<std::pair<size_t, std::pair<int, int64_t>>> pending;
  for (int tp : tps) {
    if (auto why = failed.find({tp, 1}); why != failed.end()) {
      refused.push_back(formatv("T={0}: {1}", tp, why->second).str());
      continue;
    }
    const Prepared &first = *cache.at({tp, 1});
    int layers = static_cast<int>(first.layers.layers.size());
    int64_t params = first.layers.totalParams();
    for (int stages : divisorsOf(gpus / tp)) {
      int dp = gpus / (tp * stages);
      if (stages > layers || (options.parallel.fixedStages && stages != options.stages) ||
          (options.parallel.fixedDp && dp != options.dataParallel))
        continue;
      if (batch % dp != 0) {
        ++skippedBatch;
        continue;
      }
      Layout base;
      base.tp = tp;
      base.stages = stages;
      base.dp = dp;
      // Memory first: some rank holds at least 1/P of one tensor-parallel
      // rank's weights with their state, whatever the partition.
      training = trainingSetup(options, setup, dp);
      int64_t share = weightStateBytes(params, training) / stages;
      int64_t limit = setup.limits[0];
      if (limit > 0 && share > limit) {
        base.pruned = true;
        base.peak = share;
        base.limit = limit;
        base.why = formatv("pruned: weights with their gradients and optimizer state alone "
                           "average {0} a rank, over its {1}",
                           humanCount(share, true), humanCount(limit, true))
                       .str();
        layouts.push_back(base);
        continue;
      }
      for (int64_t size : sizes) {
        int64_t perReplica = batch / dp;
        if (perReplica % size != 0)
          continue;
        int64_t microbatches = perReplica / size;
        if (options.parallel.fixedMicrobatches) {
          if (perReplica % options.microbatches != 0 || perReplica / options.microbatches != size)
            continue;
        } else if (size > 1 && microbatches < stages) {
          continue; // fewer microbatches than stages: the bubble grows
        }
        Layout layout = base;
        layout.size = size;
        layout.microbatches = static_cast<int>(microbatches);
        layouts.push_back(std::move(layout));
        pending.push_back({layouts.size() - 1, {tp, size}});
      }
    }
  }
  std::vector<std::pair<int, int64_t>> keys;
  for (const auto &p : pending)
    keys.push_back(p.second);
  prepareAll(keys);
  for (const auto &p : pending)
    if (auto why = failed.find(p.second); why != failed.end())
      return createStringError(inconvertibleErrorCode(), why->second);
  std::atomic<int> count{0};
  onEveryCore(pending.size(), quiet, [&](size_t i, PassRunner &runner) {
    count += judgeLayout(layouts[pending[i].first], *cache.at(pending[i].second), runner);
  });
  judged += count;
  return Error::success();
}

const Layout *ParallelSearch::winner() const {
  const Layout *best = nullptr;
  for (const Layout &l : layouts)
    if (l.fits && (!best || l.step < best->step))
      best = &l;
  return best;
}

std::string ParallelSearch::nothingFits() const {
  const Layout *closest = nullptr;
  for (const Layout &l : layouts)
    if (l.limit > 0 &&
        (!closest || double(l.peak) / l.limit < double(closest->peak) / closest->limit))
      closest = &l;
  std::string text = formatv("--parallel auto: no layout of {0} devices fits the memory limit",
                             options.parallel.gpus)
                         .str();
  if (closest)
    text += formatv("; the closest, {0}{1}, needs {2} a rank of {3}", closest->name(),
                    closest->kind ? " " + closest->scheduleText() : std::string(),
                    humanCount(closest->peak, true), humanCount(closest->limit, true))
                .str();
  if (!refused.empty())
    text += "; " + join(refused, "; ");
  return text;
}

std::function<std::string(const plan::Plan &)> ParallelSearch::headlineFor(double seconds) const {
  const Layout *best = winner();
  int fitting = 0, pruned = 0;
  for (const Layout &l : layouts) {
    fitting += l.fits;
    pruned += l.pruned;
  }
  std::string choice = best->name() + " " + best->scheduleText();
  std::string tail = formatv("the least judged step of the {0} layouts that fit ({1} layouts, "
                             "{2} pruned on memory before balancing, {3} schedules judged, "
                             "{4:f1} s)",
                             fitting, layouts.size(), pruned, judged, seconds)
                         .str();
  std::string devices =
      formatv("{0} devices in nodes of {1}", options.parallel.gpus, perNode).str();
  double judgedStep = best->step;
  return [=](const plan::Plan &plan) {
    double step = plan.predicted().step_time_s();
    double peak = peakFlopsOfRun(plan);
    double mfu = step > 0 && peak > 0 ? modelFlopsPerStep(plan) / (step * peak) : 0;
    return formatv("chose {0} for {1}: step {2} (judged {3}, before select-recompute priced the "
                   "nodes it reruns), predicted MFU {4:f1}%; {5}",
                   choice, devices, formatSeconds(step), formatSeconds(judgedStep), 100 * mfu, tail)
        .str();
  };
}

std::vector<std::string> ParallelSearch::lines() const {
  const Layout *best = winner();
  std::vector<const Layout *> order;
  for (const Layout &l : layouts)
    order.push_back(&l);
  // The fitting by step, then the rest by how close they came.
  std::stable_sort(order.begin(), order.end(), [](const Layout *a, const Layout *b) {
    if (a->fits != b->fits)
      return a->fits;
    if (a->fits)
      return a->step < b->step;
    return a->overBy() < b->overBy();
  });
  std::vector<std::string> out;
  if (skippedBatch > 0)
    out.push_back(formatv("{0} layouts left out: their replicas D do not divide --batch {1}",
                          skippedBatch, options.globalBatch)
                      .str());
  for (const std::string &line : refused)
    out.push_back(line);
  for (const Layout *l : order) {
    std::string line = l->name() + ": ";
    if (!l->kind) {
      out.push_back(line + l->why);
      continue;
    }
    line += formatv("{0}: step {1}, MFU {2:f1}%, peak {3} a rank{4}", l->scheduleText(),
                    formatSeconds(l->step), 100 * l->mfu, humanCount(l->peak, true),
                    l->limit > 0 ? " of " + humanCount(l->limit, true) : std::string())
                .str();
    if (l == best)
      line += ": chosen";
    else if (!l->fits)
      line += "; lost: no schedule fits the memory limit";
    else
      line += formatv("; lost: slower by {0:f1}%", 100 * (l->step / best->step - 1)).str();
    out.push_back(line);
  }
  return out;
}

} // namespace

Expected<plan::Plan> searchParallel(StringRef modelPath, const CompileOptions &options,
                                    const PipelineOptions &pipeline) {
  const int gpus = options.parallel.gpus;
  if (options.globalBatch <= 0)
    return usageError("--parallel auto: give --batch, the samples of a step, which the search "
                      "divides over the replicas and microbatches");
  if (options.maxLength > 0)
    return usageError("--parallel auto: generation (--mode generate) is not searched; give "
                      "--stages");
  if (StringRef(options.hardware).contains(',') || StringRef(options.memoryLimit).contains(','))
    return usageError("--parallel auto: give one --hardware and one --memory-limit for every "
                      "device, not one per rank");
  // Every candidate has N ranks computing (for a `cpu` spec's share of the
  // cores): one setup serves them all, repeated per stage.
  CompileOptions one = options;
  one.stages = 1;
  one.tensorParallel = 1;
  one.dataParallel = gpus;
  auto setup = resolveSetup(one);
  if (!setup)
    return setup.takeError();
  int nodeSize = std::max(1, setup->hardware[0].devicesPerNode);
  int perNode = options.parallel.gpusPerNode > 0 ? options.parallel.gpusPerNode : nodeSize;
  if (perNode > nodeSize)
    return usageError(formatv("--gpus-per-node {0}: the hardware {1} has nodes of {2} devices",
                              perNode, setup->hardware[0].name, nodeSize));
  if (options.parallel.fixedTp && perNode % options.tensorParallel != 0)
    return usageError(formatv("--tp {0}: does not divide a node of {1} devices",
                              options.tensorParallel, perNode));
  auto started = std::chrono::steady_clock::now();
  std::optional<ParallelSearch> search;
  search.emplace(modelPath, options, std::move(*setup), perNode, pipeline);
  if (Error err = search->run())
    return err;
  const Layout *best = search->winner();
  if (!best)
    return usageError(search->nothingFits());
  CompileOptions chosen = options;
  chosen.parallel.gpus = 0;
  chosen.tensorParallel = best->tp;
  chosen.sequenceParallel = options.sequenceParallel && best->tp > 1;
  chosen.stages = best->stages;
  chosen.dataParallel = best->dp;
  chosen.microbatches = best->microbatches;
  chosen.schedule = *best->kind;
  chosen.virtualStages = best->virtualStages;
  chosen.autoSchedule = false;
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // Every line but the first, which says what the chosen plan predicts; the
  // candidates' front halves are freed before that plan is built.
  std::vector<std::string> lines = search->lines();
  std::function<std::string(const plan::Plan &)> headline = search->headlineFor(seconds);
  search.reset();
  auto plan = compileModel(modelPath, chosen, pipeline);
  if (!plan)
    return plan.takeError();
  plan->add_parallel_search(headline(*plan));
  for (std::string &line : lines)
    plan->add_parallel_search(std::move(line));
  return plan;
}

} // namespace pipec
