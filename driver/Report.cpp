//===- Report.cpp - `pipec report`: the partition report of a plan --------===//
#include "driver/Report.h"
#include "compiler/sim/Simulator.h"
#include "driver/InspectReport.h"
#include "driver/StagePasses.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"

using namespace llvm;

namespace pipec {

std::string formatSeconds(double s) {
  if (s >= 1)
    return formatv("{0:f2} s", s).str();
  if (s >= 1e-3)
    return formatv("{0:f2} ms", s * 1e3).str();
  return formatv("{0:f1} us", s * 1e6).str();
}

namespace {

std::string layerRange(const plan::Stage &s) {
  if (s.first_layer() > s.last_layer())
    return "(empty)";
  std::string names = s.layers(0);
  if (s.layers_size() > 1)
    names += " .. " + s.layers(s.layers_size() - 1);
  return formatv("{0}-{1} {2}", s.first_layer(), s.last_layer(), names).str();
}

double layerTime(const plan::LayerInfo &l) { return l.time_f_s() + l.time_i_s() + l.time_w_s(); }

double stageTime(const plan::Stage &s) { return s.time_f_s() + s.time_i_s() + s.time_w_s(); }

} // namespace

std::vector<std::string> explainEdgeStages(const plan::Plan &plan) {
  std::vector<std::string> lines;
  int stages = plan.stages_size();
  if (stages < 2 || plan.layers_size() == 0)
    return lines;
  auto blocksOf = [&](const plan::Stage &s) {
    int n = 0;
    for (int l = s.first_layer(); l <= s.last_layer() && l < plan.layers_size(); ++l)
      n += plan.layers(l).kind() == "block";
    return n;
  };
  double blockTime = 0;
  int blocks = 0;
  for (const auto &l : plan.layers())
    if (l.kind() == "block")
      blockTime += layerTime(l), ++blocks;
  if (blocks == 0)
    return lines;
  blockTime /= blocks;
  int most = 0;
  double slowest = 0;
  for (const auto &s : plan.stages()) {
    most = std::max(most, blocksOf(s));
    slowest = std::max(slowest, stageTime(s));
  }
  int64_t perParam = plan.training().bytes_per_param();
  lines.push_back(formatv("a block costs {0} per microbatch (F + I + W); the fullest stage holds "
                          "{1} blocks, the slowest takes {2}",
                          formatSeconds(blockTime), most, formatSeconds(slowest))
                      .str());
  for (int k : {0, stages - 1}) {
    const plan::Stage &s = plan.stages(k);
    std::vector<std::string> extras;
    int64_t extraParams = 0;
    for (int l = s.first_layer(); l <= s.last_layer() && l < plan.layers_size(); ++l) {
      const plan::LayerInfo &layer = plan.layers(l);
      if (layer.kind() == "block")
        continue;
      extraParams += layer.params();
      extras.push_back(formatv("{0} '{1}' {2} ({3:f2} blocks' worth, {4} params)", layer.kind(),
                               layer.name(), formatSeconds(layerTime(layer)),
                               layerTime(layer) / blockTime, humanCount(layer.params()))
                           .str());
    }
    std::string why =
        extras.empty() ? std::string("no embedding, head or loss") : "also " + join(extras, ", ");
    int fewer = most - blocksOf(s);
    lines.push_back(
        formatv("stage {0} (rank {1}): {2} blocks{3}, {4} in all: {5}", k, s.rank(), blocksOf(s),
                fewer > 0 ? formatv(" ({0} fewer than the fullest)", fewer).str() : std::string(),
                formatSeconds(stageTime(s)), why)
            .str());
    if (s.rank() >= plan.ranks_size())
      continue;
    const plan::Rank &r = plan.ranks(s.rank());
    std::string limit = r.memory_limit_bytes() > 0
                            ? " of " + humanCount(r.memory_limit_bytes(), true)
                            : std::string();
    int64_t held = r.peak_memory_bytes() - r.weight_bytes();
    int64_t working = s.rank() < plan.programs_size() ? plan.programs(s.rank()).working_bytes() : 0;
    std::string inFlight;
    if (s.activation_bytes() > 0 && plan.schedule().virtual_stages() <= 1)
      inFlight =
          formatv(" ({0:f1} microbatches of {1}{2})",
                  static_cast<double>(held - working) / static_cast<double>(s.activation_bytes()),
                  humanCount(s.activation_bytes(), true),
                  working > 0 ? ", and " + humanCount(working, true) + " while a layer runs"
                              : std::string())
              .str();
    std::string shard =
        plan.training().shard_optimizer()
            ? formatv(", the optimizer state {0} of it (1/{1} of the whole)",
                      humanCount(r.optimizer_bytes(), true), plan.schedule().data_parallel())
                  .str()
            : std::string();
    lines.push_back(
        formatv("  rank {0} memory: peak {1}{2}; weights with gradients and optimizer state {3} "
                "({4} of it for the non-block layers at {5} bytes per parameter{8}), activations "
                "held {6}{7}",
                r.index(), humanCount(r.peak_memory_bytes(), true), limit,
                humanCount(r.weight_bytes(), true), humanCount(extraParams * perParam, true),
                perParam, humanCount(held, true), inFlight, shard)
            .str());
  }
  if (plan.balance_method() == "time")
    lines.push_back("the time method keeps the layout with the least simulated step: an edge "
                    "stage gives up blocks where its embedding, head and loss would otherwise "
                    "lengthen the step, or its memory would overrun the limit");
  return lines;
}

namespace {

/// What --parallel auto and --schedule auto tried, each a section of lines.
void printSearches(const plan::Plan &plan, raw_ostream &os) {
  if (plan.parallel_search_size()) {
    os << "\nparallel search (--parallel auto)\n";
    for (const auto &line : plan.parallel_search())
      os << "  " << line << "\n";
  }
  if (plan.schedule_search_size()) {
    os << "\nschedule search\n";
    for (const auto &line : plan.schedule_search())
      os << "  " << line << "\n";
  }
}

} // namespace

void printReportText(const plan::Plan &plan, raw_ostream &os) {
  const auto &sched = plan.schedule();
  os << formatv("model     {0}  ({1} params, xxh3 {2})\n", plan.model().path(),
                humanCount(plan.model().params()), plan.model().xxh3().substr(0, 16));
  std::string hw = plan.hardware_size() ? plan.hardware(0).name() : "?";
  for (int r = 1; r < plan.hardware_size(); ++r)
    if (plan.hardware(r).name() != plan.hardware(0).name())
      hw = "mixed";
  os << formatv("schedule  {0}  P={1} V={2} M={3}{7}  {4}, microbatch {5}, global batch {6}\n",
                sched.name(), sched.stages(), sched.virtual_stages(), sched.microbatches(),
                sched.mode(), sched.microbatch_size(), sched.global_batch(),
                sched.tensor_parallel() > 1
                    ? formatv(" T={0} ({1} weights split{2})", sched.tensor_parallel(),
                              plan.weight_shards_size(),
                              sched.sequence_parallel() ? ", sequence parallel" : "")
                          .str()
                    : std::string());
  std::string sharded = plan.training().shard_optimizer()
                            ? formatv(" sharded over {0} replicas", sched.data_parallel()).str()
                            : std::string();
  os << formatv("hardware  {0}  precision {1}  optimizer {2}{3}{4}\n", hw,
                plan.training().precision(), plan.training().optimizer(), sharded,
                plan.training().recompute() ? "  recompute" : "");
  if (!plan.loss().empty())
    os << "loss      " << plan.loss() << "\n";
  os << formatv("balance   {0}\nlayout    {1}\n\n", plan.balance_method(), plan.layout());
  size_t width = 24;
  for (const auto &s : plan.stages())
    width = std::max(width, layerRange(s).size());
  width = std::min<size_t>(width, 60);
  os << formatv("{0,5} {1,4} {2,5}  {3}  {4,9} {5,10} {6,10} {7,10} {8,10} {9,10} {10,21}\n",
                "stage", "rank", "chunk", left_justify("layers", width), "params", "fwd FLOPs", "F",
                "I", "W", "send/mb", "peak memory / limit");
  for (const auto &s : plan.stages()) {
    std::string range = layerRange(s);
    if (range.size() > width)
      range = range.substr(0, width - 3) + "...";
    const auto &rank = plan.ranks(s.rank());
    std::string memory =
        formatv("{0} / {1}", humanCount(rank.peak_memory_bytes(), true),
                rank.memory_limit_bytes() > 0 ? humanCount(rank.memory_limit_bytes(), true)
                                              : std::string("-"))
            .str();
    os << formatv("{0,5} {1,4} {2,5}  {3}  {4,9} {5,10} {6,10} {7,10} {8,10} {9,10} {10,21}\n",
                  s.index(), s.rank(), s.chunk(), left_justify(range, width),
                  humanCount(s.params()), humanCount(static_cast<int64_t>(s.flops_f())),
                  formatSeconds(s.time_f_s()), formatSeconds(s.time_i_s()),
                  formatSeconds(s.time_w_s()), humanCount(s.boundary_bytes(), true), memory);
  }
  if (sched.tensor_parallel() > 1) {
    // What the tensor-parallel sums cost each layer (within F and I above).
    os << formatv("\ntensor parallel: {0} ranks per stage; each layer's sums over them per "
                  "microbatch (ring all-reduce on the intra-node link, within F and I)\n",
                  sched.tensor_parallel());
    for (const plan::LayerInfo &l : plan.layers())
      if (l.tp_comm_s() > 0)
        os << formatv("  {0,-28} {1,10}  ({2:f1}% of its time)\n", l.name(),
                      formatSeconds(l.tp_comm_s()),
                      layerTime(l) > 0 ? 100 * l.tp_comm_s() / layerTime(l) : 0.0);
  }
  if (plan.training().recompute()) {
    // Which layers recompute, per stage: all of them, or (auto) the fewest
    // first ones that fit the rank's limit.
    os << formatv("\nrecompute ({0}): activations rebuilt in the backward\n",
                  plan.training().recompute_mode().empty() ? std::string("all")
                                                           : plan.training().recompute_mode());
    for (const auto &s : plan.stages()) {
      int layers = s.last_layer() - s.first_layer() + 1;
      os << formatv("  stage {0} (rank {1}): {2}\n", s.index(), s.rank(),
                    s.recomputed_layers() == 0 ? std::string("keeps every layer's activations")
                    : s.recomputed_layers() >= layers
                        ? formatv("all {0} layers recompute, {1} per microbatch", layers,
                                  formatSeconds(s.time_r_s()))
                              .str()
                        : formatv("its first {0} of {1} layers recompute, {2} per microbatch",
                                  s.recomputed_layers(), layers, formatSeconds(s.time_r_s()))
                              .str());
    }
  }
  if (plan.has_fusion())
    printFusionByStage(plan, os);
  if (plan.has_generation()) {
    // The token loop: one decode step per stage program, each rank's cache.
    const plan::Generation &g = plan.generation();
    os << formatv("\ngeneration: rows of {0} tokens, {1} slot(s) in {2} group(s) of {3}; a step "
                  "decodes one token of a group (the predicted step: one of every group)\n",
                  g.max_length(), g.slots(), g.groups(), plan.schedule().microbatch_size());
    if (!g.groups_reason().empty())
      os << "  groups: " << g.groups_reason() << "\n";
    std::string positions =
        g.positions().empty() ? std::string("from the mask") : "'" + g.positions() + "'";
    os << formatv("  inputs: tokens '{0}', positions {1}, mask '{2}'; logits '{3}' over {4} "
                  "ids; cache {5}\n",
                  g.tokens(), positions, g.mask(), g.logits(), g.vocab(),
                  g.cache_size() > 0 && g.cache(0).in_place()
                      ? "written at each row's position (GroupQueryAttention)"
                      : "appended (Concat)");
    for (const auto &rank : plan.ranks()) {
      int entries = 0;
      for (const auto &c : g.cache())
        entries += plan.stages(c.stage()).rank() == rank.index();
      os << formatv("  rank {0}: KV cache {1} ({2} tensors x {3} group{4}), written in place\n",
                    rank.index(), humanCount(rank.cache_bytes(), true), entries, g.groups(),
                    g.groups() == 1 ? "" : "s");
    }
  }
  const auto &p = plan.predicted();
  os << formatv("\npredicted step {0} (simulated), bubble {1:f1}%, slowest stage {2} per "
                "microbatch, imbalance {3:f3} (slowest / mean)\n",
                formatSeconds(p.step_time_s()), 100 * p.bubble_fraction(),
                formatSeconds(p.bottleneck_s()), p.imbalance());
  std::vector<std::string> edges = explainEdgeStages(plan);
  if (!edges.empty()) {
    os << "\nfirst and last stages (embedding, head, loss and memory)\n";
    for (const std::string &line : edges)
      os << "  " << line << "\n";
  }
  if (plan.programs_size()) {
    if (auto sim = simulatePlan(plan)) {
      os << "\ntimeline (simulated; " << timelineLegend() << ")\n";
      os << formatTimeline(*sim, plan.schedule().stages(), 96);
    } else {
      os << "\ntimeline: " << toString(sim.takeError()) << "\n";
    }
  }
  printSearches(plan, os);
  if (plan.alternatives_size()) {
    os << "\nbalancing  predicted step  slowest stage  imbalance  layout\n";
    for (const auto &a : plan.alternatives()) {
      bool chosen = a.method() == plan.balance_method();
      if (!a.error().empty()) {
        os << formatv("{0,-9}{1}  no plan: {2}\n", a.method(), chosen ? "*" : " ", a.error());
        continue;
      }
      os << formatv("{0,-9}{1}  {2,14}  {3,13}  {4,9:f3}  {5}{6}\n", a.method(), chosen ? "*" : " ",
                    formatSeconds(a.step_time_s()), formatSeconds(a.bottleneck_s()), a.imbalance(),
                    a.layout(), a.fits_memory() ? "" : "  (over the memory limit)");
    }
  }
  if (plan.warnings_size()) {
    os << "\nwarnings\n";
    for (const auto &w : plan.warnings())
      os << "  - " << w << "\n";
  }
}

void printReportJson(const plan::Plan &plan, raw_ostream &os) {
  json::OStream j(os, 2);
  const auto &sched = plan.schedule();
  j.object([&] {
    j.attribute("format_version", ReportFormatVersion);
    j.attributeObject("model", [&] {
      j.attribute("path", plan.model().path());
      j.attribute("xxh3", plan.model().xxh3());
      j.attribute("params", plan.model().params());
    });
    j.attributeObject("schedule", [&] {
      j.attribute("name", sched.name());
      j.attribute("stages", sched.stages());
      j.attribute("virtual_stages", sched.virtual_stages());
      j.attribute("microbatches", sched.microbatches());
      j.attribute("mode", sched.mode());
      j.attribute("tensor_parallel", std::max(1, sched.tensor_parallel()));
      j.attribute("data_parallel", std::max(1, sched.data_parallel()));
      j.attribute("sequence_parallel", sched.sequence_parallel());
    });
    if (plan.parallel_search_size())
      j.attributeArray("parallel_search", [&] {
        for (const std::string &line : plan.parallel_search())
          j.value(line);
      });
    j.attribute("balance_method", plan.balance_method());
    j.attribute("layout", plan.layout());
    j.attributeArray("stages", [&] {
      for (const auto &s : plan.stages())
        j.object([&] {
          j.attribute("index", s.index());
          j.attribute("rank", s.rank());
          j.attribute("chunk", s.chunk());
          j.attribute("first_layer", s.first_layer());
          j.attribute("last_layer", s.last_layer());
          j.attributeArray("layers", [&] {
            for (const auto &name : s.layers())
              j.value(name);
          });
          j.attribute("params", s.params());
          j.attribute("flops_fwd", s.flops_f());
          j.attribute("time_f_s", s.time_f_s());
          j.attribute("time_i_s", s.time_i_s());
          j.attribute("time_w_s", s.time_w_s());
          j.attribute("comm_s", s.comm_s());
          j.attribute("boundary_bytes", s.boundary_bytes());
          j.attribute("memory_peak_bytes", s.memory_peak_bytes());
        });
    });
    j.attributeArray("ranks", [&] {
      for (const auto &r : plan.ranks())
        j.object([&] {
          j.attribute("index", r.index());
          j.attribute("hardware", r.hardware());
          const plan::RankProgram *program =
              r.index() < plan.programs_size() ? &plan.programs(r.index()) : nullptr;
          j.attributeArray("actions", [&] {
            if (program)
              for (const auto &a : program->actions())
                j.value(a);
          });
          j.attribute("instructions",
                      program ? static_cast<int64_t>(program->instructions_size()) : 0);
          j.attribute("busy_s", r.busy_s());
          j.attribute("idle_s", r.idle_s());
          j.attribute("peak_memory_bytes", r.peak_memory_bytes());
          j.attribute("memory_limit_bytes", r.memory_limit_bytes());
        });
    });
    if (!plan.loss().empty())
      j.attribute("loss", plan.loss());
    if (plan.has_fusion())
      j.attributeObject("fusion", [&] {
        const plan::Fusion &f = plan.fusion();
        j.attribute("groups", f.groups());
        j.attribute("nodes", f.nodes());
        j.attribute("mat_mul_bias", f.mat_mul_bias());
        j.attribute("mat_mul_transposed", f.mat_mul_transposed());
        j.attribute("softmax_attention", f.softmax_attention());
      });
    j.attributeObject("predicted", [&] {
      j.attribute("step_time_s", plan.predicted().step_time_s());
      j.attribute("bubble_fraction", plan.predicted().bubble_fraction());
      j.attribute("bottleneck_s", plan.predicted().bottleneck_s());
      j.attribute("imbalance", plan.predicted().imbalance());
    });
    j.attributeArray("balance_comparison", [&] {
      for (const auto &a : plan.alternatives())
        j.object([&] {
          j.attribute("method", a.method());
          if (!a.error().empty()) {
            j.attribute("error", a.error());
            return;
          }
          j.attribute("layout", a.layout());
          j.attribute("step_time_s", a.step_time_s());
          j.attribute("bottleneck_s", a.bottleneck_s());
          j.attribute("imbalance", a.imbalance());
          j.attribute("fits_memory", a.fits_memory());
        });
    });
    j.attributeArray("warnings", [&] {
      for (const auto &w : plan.warnings())
        j.value(w);
    });
  });
  os << "\n";
}

} // namespace pipec
