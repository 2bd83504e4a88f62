//===- Compile.cpp - `pipec compile`: a model to a plan -------------------===//
#include "compiler/Compile.h"
#include "passes/BalanceStages.h"
#include "passes/GroupLayers.h"
#include "runtime/plan/PlanFile.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/SHA256.h"

#include <map>

using namespace llvm;

namespace pipec {
namespace {

Error flagError(const Twine &message) {
  return createStringError(inconvertibleErrorCode(), "%s", message.str().c_str());
}

/// One entry per rank from a single value or a comma-separated list.
Expected<std::vector<std::string>> perRank(StringRef flag, StringRef value, int ranks) {
  SmallVector<StringRef, 8> parts;
  value.split(parts, ',');
  std::vector<std::string> out;
  for (StringRef p : parts)
    out.push_back(p.trim().str());
  if (out.size() == 1)
    out.assign(ranks, out[0]);
  if (static_cast<int>(out.size()) != ranks)
    return flagError(
        formatv("--{0} {1}: give one value, or one per rank ({2})", flag, value, ranks));
  return out;
}

void fillHardware(const HardwareSpec &hw, bool bf16, plan::HardwareInfo &out) {
  out.set_name(hw.name);
  out.set_peak_flops(hw.peakFlops(bf16));
  out.set_memory_bandwidth(hw.memoryBandwidth);
  out.set_memory_bytes(hw.memoryBytes);
  out.set_launch_overhead_s(hw.launchOverhead);
  auto link = [](const LinkSpec &l, plan::LinkInfo &o) {
    o.set_name(l.name);
    o.set_bandwidth(l.bandwidth);
    o.set_latency_s(l.latency);
  };
  link(hw.intraNode, *out.mutable_intra_node());
  link(hw.interNode, *out.mutable_inter_node());
  out.set_devices_per_node(hw.devicesPerNode);
  out.set_source(hw.source);
}

} // namespace

Expected<plan::Plan> compileModel(StringRef modelPath, const CompileOptions &options,
                                  const PipelineOptions &pipeline) {
  int P = options.stages, V = options.virtualStages;
  if (P < 1)
    return flagError("--stages must be at least 1");
  if (V < 1)
    return flagError("--virtual-stages must be at least 1");
  int M = options.microbatches > 0 ? options.microbatches : 4 * P;
  ScheduleKind schedule = options.training ? options.schedule : ScheduleKind::ForwardOnly;
  if (Error err = checkScheduleShape(schedule, P, V, M))
    return err;
  int64_t microbatchSize = 1;
  if (options.globalBatch > 0) {
    if (options.globalBatch % M != 0)
      return flagError(
          formatv("--batch {0} does not divide into {1} microbatches", options.globalBatch, M));
    microbatchSize = options.globalBatch / M;
  }
  ImportOptions importOptions = options.import;
  importOptions.bindings.batch = microbatchSize;

  // Hardware per rank.
  auto names = perRank("hardware", options.hardware, P);
  if (!names)
    return names.takeError();
  std::vector<HardwareSpec> hardware;
  for (const std::string &name : *names) {
    auto hw = resolveHardware(name);
    if (!hw)
      return hw.takeError();
    hardware.push_back(*hw);
  }
  std::string precisionText = options.precision;
  if (precisionText.empty())
    precisionText = hardware[0].name == "cpu" ? "fp32" : "bf16";
  auto precision = parsePrecision(precisionText);
  if (!precision)
    return precision.takeError();
  std::vector<int64_t> limits;
  if (options.memoryLimit.empty()) {
    for (const HardwareSpec &hw : hardware)
      limits.push_back(hw.memoryBytes);
  } else {
    auto values = perRank("memory-limit", options.memoryLimit, P);
    if (!values)
      return values.takeError();
    for (const std::string &v : *values) {
      if (v == "none") {
        limits.push_back(0);
        continue;
      }
      auto bytes = parseByteSize(v, "memory-limit");
      if (!bytes)
        return bytes.takeError();
      limits.push_back(*bytes);
    }
  }

  auto graph = loadGraph(modelPath, importOptions, pipeline);
  if (!graph)
    return graph.takeError();
  auto layers = buildLayerGraph(*graph, pipeline);
  if (!layers)
    return layers.takeError();

  // One cost table per distinct hardware.
  std::map<std::string, CostTable> tables;
  std::vector<const CostTable *> rankCosts;
  for (const HardwareSpec &hw : hardware) {
    auto [it, inserted] = tables.try_emplace(hw.name);
    if (inserted) {
      it->second = computeCosts(*layers, hw, *precision);
      if (!options.costs.empty())
        if (Error err = applyMeasuredCosts(it->second, options.costs))
          return err;
    }
  }
  for (const HardwareSpec &hw : hardware)
    rankCosts.push_back(&tables.at(hw.name));

  BalanceOptions balance;
  balance.stages = P;
  balance.virtualStages = V;
  balance.microbatches = M;
  balance.schedule = schedule;
  balance.training.training = options.training;
  balance.training.optimizer = options.optimizer;
  balance.training.mixedPrecision = *precision == Precision::BF16;
  balance.training.recompute = options.recompute;
  balance.rankCosts = rankCosts;
  balance.rankHardware = hardware;
  balance.memoryLimit = limits;
  StringRef method = options.balance;
  if (method == "time")
    balance.method = BalanceMethod::Time;
  else if (method == "params")
    balance.method = BalanceMethod::Params;
  else if (method == "uniform")
    balance.method = BalanceMethod::Uniform;
  else {
    balance.method = BalanceMethod::Layout;
    balance.layout = options.balance;
  }
  auto stagePlan = balanceStages(*layers, balance);
  if (!stagePlan)
    return stagePlan.takeError();

  plan::Plan plan;
  plan.set_format_version(PlanFormatVersion);
  auto *model = plan.mutable_model();
  model->set_path(modelPath.str());
  const MemoryBuffer &file = *graph->files[0];
  model->set_sha256(
      toHex(SHA256::hash(ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(file.getBufferStart()),
                                           file.getBufferSize())),
            /*LowerCase=*/true));
  model->set_nodes(graph->model->graph().node_size());
  model->set_params(layers->totalParams());
  auto *info = plan.mutable_schedule();
  info->set_name(scheduleName(schedule).str());
  info->set_stages(P);
  info->set_virtual_stages(V);
  info->set_microbatches(M);
  info->set_mode(options.training ? "train" : "infer");
  info->set_data_parallel(options.dataParallel);
  info->set_global_batch(microbatchSize * M);
  info->set_microbatch_size(microbatchSize);
  for (const HardwareSpec &hw : hardware)
    fillHardware(hw, *precision == Precision::BF16, *plan.add_hardware());
  auto *training = plan.mutable_training();
  training->set_precision(precisionName(*precision).str());
  training->set_optimizer(optimizerName(options.optimizer).str());
  training->set_recompute(options.recompute);
  training->set_bytes_per_param(bytesPerParam(balance.training));
  plan.set_balance_method(balanceMethodName(balance.method).str());
  plan.set_layout(stagePlan->layout);
  for (int id : graph->inputs) {
    const Value &v = graph->values[id];
    std::string dims;
    for (size_t d = 0; d < v.shape.size(); ++d)
      dims += (d ? "," : "") + std::to_string(v.shape[d]);
    (*plan.mutable_input_shapes())[v.name] = dims;
  }
  const CostTable &first = *rankCosts[0];
  for (size_t l = 0; l < layers->layers.size(); ++l) {
    const LayerCost &lc = first.layers[l];
    auto *li = plan.add_layers();
    li->set_index(static_cast<int>(l));
    li->set_name(lc.name);
    li->set_kind(layerKindName(lc.kind).str());
    li->set_params(lc.params);
    li->set_flops_f(lc.flops[Forward]);
    li->set_time_f_s(lc.time[Forward]);
    li->set_time_i_s(lc.time[BackwardInput]);
    li->set_time_w_s(lc.time[BackwardWeight]);
    li->set_activation_bytes(lc.activationBytes);
    li->set_boundary_bytes(lc.boundaryBytes);
    li->set_measured(lc.measured);
  }
  for (const ChunkPlan &c : stagePlan->chunks) {
    auto *s = plan.add_stages();
    s->set_index(c.index);
    s->set_rank(c.rank);
    s->set_chunk(c.chunkOnRank);
    s->set_first_layer(c.firstLayer);
    s->set_last_layer(c.lastLayer);
    for (int l = c.firstLayer; l <= c.lastLayer; ++l)
      s->add_layers(layers->layers[l].name);
    s->set_params(c.params);
    s->set_flops_f(c.flopsForward);
    s->set_time_f_s(c.time[Forward]);
    s->set_time_i_s(c.time[BackwardInput]);
    s->set_time_w_s(c.time[BackwardWeight]);
    s->set_comm_s(c.commTime);
    s->set_memory_peak_bytes(stagePlan->ranks[c.rank].peakMemory);
    s->set_boundary_bytes(c.boundaryBytes);
    s->set_activation_bytes(c.activationBytes);
  }
  for (const RankPlan &r : stagePlan->ranks) {
    auto *rank = plan.add_ranks();
    rank->set_index(r.index);
    rank->set_hardware(r.hardware);
    rank->set_memory_limit_bytes(r.memoryLimit);
    rank->set_peak_memory_bytes(r.peakMemory);
    rank->set_weight_bytes(r.weightBytes);
    rank->set_activation_bytes(r.activationBytes);
    rank->set_busy_s(r.busy);
    rank->set_idle_s(std::max(0.0, stagePlan->stepTime - r.busy));
  }
  auto *predicted = plan.mutable_predicted();
  predicted->set_step_time_s(stagePlan->stepTime);
  predicted->set_bubble_fraction(stagePlan->bubbleFraction);
  predicted->set_bottleneck_s(stagePlan->bottleneck);
  predicted->set_imbalance(stagePlan->imbalance);

  // What balancing bought: the other methods on the same inputs.
  for (BalanceMethod alt : {BalanceMethod::Time, BalanceMethod::Params, BalanceMethod::Uniform}) {
    auto *a = plan.add_alternatives();
    a->set_method(balanceMethodName(alt).str());
    BalanceOptions altOptions = balance;
    altOptions.method = alt;
    auto altPlan = alt == balance.method ? Expected<StagePlan>(*stagePlan)
                                         : balanceStages(*layers, altOptions);
    if (!altPlan) {
      a->set_error(toString(altPlan.takeError()));
      continue;
    }
    a->set_layout(altPlan->layout);
    a->set_step_time_s(altPlan->stepTime);
    a->set_bottleneck_s(altPlan->bottleneck);
    a->set_imbalance(altPlan->imbalance);
    a->set_fits_memory(altPlan->fitsMemory);
  }

  for (const std::string &w : graph->warnings)
    plan.add_warnings(w);
  if (!first.defaultedOpTypes.empty())
    plan.add_warnings("ops costed by the default rule (F = one FLOP per output element, I = F, "
                      "W = 0): " +
                      join(first.defaultedOpTypes, ", "));
  for (auto &[w, users] : layers->sharedWeights()) {
    std::set<int> ranks;
    for (int l : users)
      for (const ChunkPlan &c : stagePlan->chunks)
        if (l >= c.firstLayer && l <= c.lastLayer)
          ranks.insert(c.rank);
    if (ranks.size() > 1)
      plan.add_warnings(formatv("weight '{0}' is shared by {1} ranks: each keeps a copy and "
                                "their gradients are all-reduced",
                                graph->values[w].name, ranks.size())
                            .str());
  }
  return plan;
}

} // namespace pipec
