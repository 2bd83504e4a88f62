//===- DescribePlan.cpp - A plan's header, layers, stages and warnings ---===//
#include "compiler/schedule/ScheduleKind.h"
#include "driver/CompileParts.h"
#include "driver/InspectReport.h"
#include "passes/GenerationRoles.h"
#include "passes/GenerationStreams.h"
#include "passes/LowerSchedule.h"
#include "passes/PredictStep.h"
#include "passes/StagePrograms.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {
namespace {

plan::TensorRef tensorRef(const Graph &graph, int id, Precision precision) {
  const Value &v = graph.values[id];
  plan::TensorRef t;
  t.set_name(v.name);
  // dtype is the value's own; bytes are what the link carries at the plan's
  // precision (bytesAt: bf16 plans move float32 activations as bf16).
  t.set_dtype(dtypeName(v.type).str());
  for (int64_t d : v.shape)
    t.add_shape(d);
  t.set_bytes(static_cast<int64_t>(bytesAt(graph, id, precision)));
  return t;
}

/// Sets \p out's time_f_s, time_i_s and time_w_s to \p time's F, I and W.
template <typename Proto> void setPhaseTimes(Proto &out, const std::array<double, 3> &time) {
  out.set_time_f_s(time[Forward]);
  out.set_time_i_s(time[BackwardInput]);
  out.set_time_w_s(time[BackwardWeight]);
}

} // namespace

bool overMemoryLimit(const plan::Rank &r) {
  return r.memory_limit_bytes() > 0 && r.peak_memory_bytes() > r.memory_limit_bytes();
}

bool fitsMemory(const plan::Plan &plan) {
  return std::none_of(plan.ranks().begin(), plan.ranks().end(), overMemoryLimit);
}

void indexCuts(Prepared &prepared, Precision precision) {
  const LayerGraph &layers = prepared.layers;
  const Graph &graph = prepared.graph;
  // Only gradients the backward program computes cross back.
  const std::set<std::string> *flowingPtr = prepared.backward ? &prepared.flowing : nullptr;
  size_t cuts = layers.layers.empty() ? 0 : layers.layers.size() - 1;
  prepared.cutTensors.assign(cuts, {});
  prepared.cutGradients.assign(cuts, {});
  // crossingAfter's order: the crossings', at every cut each spans.
  for (const CrossingTensor &c : layers.crossings) {
    plan::TensorRef tensor = tensorRef(graph, c.value, precision);
    bool gradient = sendsGradient(graph, c.value, flowingPtr);
    for (int l = std::max(c.fromLayer, 0); l < c.toLayer && l < static_cast<int>(cuts); ++l) {
      prepared.cutTensors[l].push_back(tensor);
      prepared.cutGradients[l].push_back(gradient);
    }
  }
}

TrainingSetup trainingSetup(const CompileOptions &options, const Setup &setup, int replicas) {
  TrainingSetup training;
  training.training = options.training;
  training.optimizer = options.optimizer;
  training.mixedPrecision = setup.precision == Precision::BF16;
  training.autocast = options.autocast;
  training.recompute = options.recompute;
  training.optimizerShards = options.shardOptimizer ? replicas : 1;
  return training;
}

BalanceOptions balanceOptions(const CompileOptions &options, const Setup &setup,
                              const Prepared &prepared, const PipelineShape &shape) {
  BalanceOptions balance;
  balance.shape = shape;
  balance.training = trainingSetup(options, setup, shape.dataParallel());
  balance.rankCosts = prepared.rankCosts;
  // One rank's costs serve every stage (--parallel auto prepares once per T
  // and microbatch size, for any P).
  if (balance.rankCosts.size() == 1)
    balance.rankCosts.assign(shape.stages(), prepared.rankCosts[0]);
  balance.rankHardware = setup.hardware;
  balance.memoryLimit = setup.limits;
  balance.method = StringSwitch<BalanceMethod>(options.balance)
                       .Case("time", BalanceMethod::Time)
                       .Case("params", BalanceMethod::Params)
                       .Case("uniform", BalanceMethod::Uniform)
                       .Default(BalanceMethod::Layout);
  if (balance.method == BalanceMethod::Layout)
    balance.layout = options.balance;
  balance.lowering = [&options, shape, &setup, &prepared](const StagePlan &stagePlan) {
    return loweringInputs(options, shape, setup, prepared, stagePlan);
  };
  return balance;
}

void describeRun(plan::Plan &plan, StringRef modelPath, const CompileOptions &options,
                 const Setup &setup, const Prepared &prepared, const BalanceOptions &balance,
                 const StagePlan &stagePlan) {
  const PipelineShape &shape = balance.shape;
  const Graph &graph = prepared.graph;
  plan.set_format_version(PlanFormatVersion);
  auto *model = plan.mutable_model();
  model->set_path(modelPath.str());
  model->set_xxh3(prepared.xxh3);
  model->set_nodes(prepared.fileNodes);
  // The model's parameters, whole: a split weight's pieces on every
  // tensor-parallel rank (stages and layers count one rank's).
  int64_t params = prepared.layers.totalParams();
  for (const auto &[name, shard] : graph.shards)
    if (int id = graph.findValue(name); id >= 0)
      params += (shard.parts - 1) * graph.values[id].numElements();
  model->set_params(params);
  auto *info = plan.mutable_schedule();
  info->set_name(scheduleName(shape.schedule()).str());
  info->set_stages(shape.stages());
  info->set_virtual_stages(shape.virtualStages());
  info->set_microbatches(shape.microbatches());
  info->set_mode(options.training ? "train" : "infer");
  info->set_data_parallel(shape.dataParallel());
  info->set_tensor_parallel(options.tensorParallel);
  info->set_sequence_parallel(graph.sequenceParallel && options.tensorParallel > 1);
  for (const std::string &name : graph.sequenceGrads)
    plan.add_sequence_grads(name);
  for (const auto &[name, shard] : graph.shards) {
    // A folded tie's head that tie-weights replaced is read no more.
    if (int id = graph.findValue(name); id < 0 || graph.values[id].users.empty())
      continue;
    plan::WeightShard *w = plan.add_weight_shards();
    w->set_weight(name);
    w->set_axis(shard.axis);
    w->set_parts(shard.parts);
    w->set_stride(shard.stride);
  }
  info->set_global_batch(shape.globalBatch());
  info->set_microbatch_size(shape.microbatchSize());
  for (const HardwareSpec &hw : setup.hardware)
    *plan.add_hardware() = hardwareInfo(hw, setup.precision == Precision::BF16);
  auto *training = plan.mutable_training();
  training->set_precision(precisionName(setup.precision).str());
  training->set_optimizer(optimizerName(options.optimizer).str());
  bool recomputes = std::any_of(stagePlan.chunks.begin(), stagePlan.chunks.end(),
                                [](const ChunkPlan &c) { return c.recomputes(); });
  training->set_recompute(recomputes);
  training->set_recompute_mode(recomputeName(options.recompute).str());
  training->set_shard_optimizer(options.shardOptimizer);
  training->set_bytes_per_param(bytesPerParam(balance.training));
  plan.set_balance_method(balanceMethodName(balance.method).str());
  plan.set_layout(stagePlan.layout);
  for (int id : graph.inputs) {
    const Value &v = graph.values[id];
    std::string dims;
    for (size_t d = 0; d < v.shape.size(); ++d)
      dims += (d ? "," : "") + std::to_string(v.shape[d]);
    (*plan.mutable_input_shapes())[v.name] = dims;
  }
}

void describeLayers(plan::Plan &plan, const CompileOptions &options, const Prepared &prepared) {
  const CostTable &first = *prepared.rankCosts[0];
  for (size_t l = 0; l < prepared.layers.layers.size(); ++l) {
    const LayerCost &lc = first.layers[l];
    auto *li = plan.add_layers();
    li->set_index(static_cast<int>(l));
    li->set_name(lc.name);
    li->set_kind(layerKindName(lc.kind).str());
    li->set_params(lc.params);
    li->set_flops_f(lc.flops[Forward]);
    setPhaseTimes(*li, lc.time);
    li->set_activation_bytes(lc.activationBytes);
    li->set_boundary_bytes(lc.boundaryBytes);
    li->set_measured(lc.measured);
    li->set_tp_comm_s(lc.tpCommTime);
    if (prepared.backward) {
      li->set_backward_input_ops(static_cast<int>(prepared.backward->inputGrad[l].size()));
      li->set_backward_weight_ops(static_cast<int>(prepared.backward->weightGrad[l].size()));
    }
  }
  if (options.training) {
    if (prepared.backward)
      plan.set_loss(prepared.lossText);
    else
      plan.add_warnings("no backward program yet: " + prepared.backwardError +
                        " (the plan's timing stands; running it needs the gradients)");
  }
}

void describeStages(plan::Plan &plan, const LayerGraph &layers, const StagePlan &stagePlan) {
  for (const ChunkPlan &c : stagePlan.chunks) {
    auto *s = plan.add_stages();
    s->set_index(c.index);
    s->set_rank(c.rank);
    s->set_chunk(c.chunkOnRank);
    s->set_first_layer(c.firstLayer);
    s->set_last_layer(c.lastLayer);
    for (int l = c.firstLayer; l <= c.lastLayer; ++l)
      s->add_layers(layers.layers[l].name);
    s->set_params(c.params);
    s->set_flops_f(c.flopsForward);
    setPhaseTimes(*s, c.time);
    s->set_comm_s(c.commTime);
    s->set_boundary_bytes(c.boundaryBytes);
    s->set_activation_bytes(c.activationBytes);
    s->set_recomputed_layers(c.recomputedLayers);
    s->set_time_r_s(c.recomputeTime);
  }
  for (const RankPlan &r : stagePlan.ranks) {
    auto *rank = plan.add_ranks();
    rank->set_index(r.index);
    rank->set_hardware(r.hardware);
    rank->set_memory_limit_bytes(r.memoryLimit);
    rank->set_peak_memory_bytes(r.peakMemory);
    rank->set_model_peak_bytes(r.peakMemory);
    rank->set_weight_bytes(r.weightBytes);
    rank->set_optimizer_bytes(r.optimizerBytes);
    rank->set_activation_bytes(r.activationBytes);
  }
}

LoweringInputs loweringInputs(const CompileOptions &options, const PipelineShape &shape,
                              const Setup &setup, const Prepared &prepared,
                              const StagePlan &stagePlan) {
  const LayerGraph &layers = prepared.layers;
  const Graph &graph = prepared.graph;
  LoweringInputs lowering;
  lowering.training = options.training;
  for (const ChunkPlan &c : stagePlan.chunks) {
    lowering.recompute.push_back(c.recomputes());
    lowering.rebuiltBytes.push_back(c.rebuiltBytes);
    bool last = c.index + 1 == static_cast<int>(stagePlan.chunks.size());
    if (!last && !c.empty() && c.lastLayer + 1 < static_cast<int>(layers.layers.size())) {
      lowering.sendTensors.push_back(prepared.cutTensors[c.lastLayer]);
      lowering.hasGradient.push_back(prepared.cutGradients[c.lastLayer]);
    } else {
      lowering.sendTensors.emplace_back();
      lowering.hasGradient.emplace_back();
    }
    lowering.activationBytes.push_back(c.activationBytes);
    lowering.workingBytes.push_back(c.workingBytes);
    int64_t input = 0;
    if (c.index > 0) {
      const ChunkPlan &prev = stagePlan.chunks[c.index - 1];
      input = prev.boundaryBytes;
    }
    lowering.inputBytes.push_back(input);
  }
  int64_t gradBytes = gradientBytesPerParam(trainingSetup(options, setup, shape.dataParallel()));
  for (auto &[w, users] : prepared.sharedWeights) {
    std::set<int> ranks;
    for (int l : users)
      for (const ChunkPlan &c : stagePlan.chunks)
        if (l >= c.firstLayer && l <= c.lastLayer)
          ranks.insert(c.rank);
    if (ranks.size() < 2)
      continue;
    LoweringInputs::Collective ar;
    ar.reduce = plan::Instruction::TIED_WEIGHT;
    ar.tiedWeight = graph.values[w].name;
    ar.ranks.assign(ranks.begin(), ranks.end());
    ar.bytes = graph.values[w].numElements() * gradBytes;
    lowering.collectives.push_back(ar);
  }
  for (LoweringInputs::Collective &ar :
       dataParallelCollectives(stagePlan, shape, gradBytes, options.shardOptimizer))
    lowering.collectives.push_back(std::move(ar));
  return lowering;
}

void addWarnings(plan::Plan &plan, const Graph &graph, const CostTable &first) {
  for (const std::string &w : graph.warnings)
    plan.add_warnings(w);
  if (!first.defaultedOpTypes.empty())
    plan.add_warnings("ops costed by the default rule (F = one FLOP per output element, I = F, "
                      "W = 0): " +
                      join(first.defaultedOpTypes, ", "));
  for (const plan::Rank &r : plan.ranks())
    if (overMemoryLimit(r))
      plan.add_warnings(formatv("rank {0} needs {1}, over its limit of {2}", r.index(),
                                humanCount(r.peak_memory_bytes(), true),
                                humanCount(r.memory_limit_bytes(), true))
                            .str());
}

Error keepAppendedPositions(plan::Plan &plan, const Graph &graph, int64_t maxLength) {
  if (maxLength <= 0) // not a generation plan
    return Error::success();
  auto roles = findGenerationRoles(graph, maxLength);
  if (!roles)
    return roles.takeError();
  for (const plan::Generation::Cache &cache : roles->cache()) {
    if (cache.appended().empty())
      continue;
    for (plan::StageProgram &sp : *plan.mutable_stage_programs())
      for (std::string &out : *sp.mutable_outputs())
        if (out == cache.present())
          out = cache.appended();
  }
  return Error::success();
}

/// --mode generate: the roles of the model's inputs and outputs, the stage
/// that holds each cache, and each rank's cache bytes (every group's).
Error describeGeneration(plan::Plan &plan, const Graph &graph, int64_t maxLength) {
  auto roles = findGenerationRoles(graph, maxLength);
  if (!roles)
    return roles.takeError();
  int groups = plan.schedule().microbatches();
  roles->set_groups(groups);
  roles->set_slots(plan.schedule().global_batch());
  for (plan::Generation::Cache &cache : *roles->mutable_cache()) {
    cache.set_bytes(graph.values[graph.findValue(cache.past())].byteSize());
    for (const plan::StageProgram &sp : plan.stage_programs())
      if (llvm::is_contained(sp.loads(), cache.past()))
        cache.set_stage(sp.stage());
    int rank = plan.stages(cache.stage()).rank();
    plan::Rank *r = plan.mutable_ranks(rank);
    r->set_cache_bytes(r->cache_bytes() + cache.bytes() * groups);
  }
  // The cache lives beside the step's working set for the whole run: both
  // peaks hold it (the step's own count of its past inputs stays, a group's
  // cache that the pass reads).
  for (plan::Rank &r : *plan.mutable_ranks()) {
    if (r.cache_bytes() == 0)
      continue;
    r.set_peak_memory_bytes(r.peak_memory_bytes() + r.cache_bytes());
    if (r.model_peak_bytes() > 0)
      r.set_model_peak_bytes(r.model_peak_bytes() + r.cache_bytes());
    if (overMemoryLimit(r))
      plan.add_warnings(formatv("rank {0} needs {1} with its KV cache of {2}, over its limit of "
                                "{3}: lower --slots or --max-length",
                                r.index(), humanCount(r.peak_memory_bytes(), true),
                                humanCount(r.cache_bytes(), true),
                                humanCount(r.memory_limit_bytes(), true))
                            .str());
  }
  *plan.mutable_generation() = std::move(*roles);
  addGenerationStreams(plan);
  std::vector<plan::RankProgram> programs(plan.programs().begin(), plan.programs().end());
  auto kind = parseSchedule(plan.schedule().name());
  if (!kind)
    return kind.takeError();
  return verifyGenerationStreams(programs, programs, groups, *kind);
}

Expected<plan::Plan> withPrefill(plan::Plan plan, StringRef modelPath,
                                 const CompileOptions &options) {
  int64_t length = options.promptLength, maxLength = options.maxLength;
  if (length >= maxLength)
    return usageError(formatv("--prompt-length {0}: leaves no position of --max-length {1} to "
                              "generate",
                              length, maxLength));
  CompileOptions prefill = options;
  prefill.maxLength = 0;
  prefill.promptLength = 0;
  prefill.import.bindings.seq = length;
  prefill.import.bindings.past = maxLength - length;
  prefill.balance = plan.layout();
  auto made = compileModel(modelPath, prefill, PipelineOptions());
  if (!made)
    return made.takeError();
  addGenerationStreams(*made);
  std::vector<plan::RankProgram> starts(made->programs().begin(), made->programs().end()),
      programs(plan.programs().begin(), plan.programs().end());
  auto kind = parseSchedule(plan.schedule().name());
  if (!kind)
    return kind.takeError();
  if (Error err = verifyGenerationStreams(starts, programs, plan.schedule().microbatches(), *kind))
    return createStringError(inconvertibleErrorCode(), "the prefill's %s",
                             toString(std::move(err)).c_str());
  plan::Generation *g = plan.mutable_generation();
  g->set_prefill_length(length);
  *g->mutable_prefill() = std::move(*made);
  return plan;
}

/// --mode generate: the groups of rows in flight, and why. Stages on
/// devices of their own keep the pipe full with a group per stage (the most
/// up to that which divide the slots). Stages that are ranks of this
/// machine's CPU share its cores and its memory bandwidth: a decode step
/// streams every weight of a stage once per group, so groups of fewer rows
/// add weight traffic and save no time. They take turns on one group of all
/// the slots instead, each on all the cores (runtime/exec/Generate.h).
std::pair<int, std::string> generationGroups(const CompileOptions &options, const Setup &setup) {
  if (options.microbatches > 0)
    return {options.microbatches, formatv("--microbatches {0}", options.microbatches).str()};
  if (options.stages == 1)
    return {1, "one stage"};
  if (llvm::all_of(setup.hardware, [](const HardwareSpec &h) { return h.sharesHostCores; }))
    return {1, formatv("the {0} stages are ranks of this machine's CPU and share its cores: they "
                       "take turns on one group, each on all the cores, which streams each "
                       "weight once per token (a group of fewer rows streams it again)",
                       options.stages)
                   .str()};
  int64_t slots = options.globalBatch / std::max(1, options.dataParallel);
  int groups = options.stages;
  while (groups > 1 && slots % groups != 0)
    --groups;
  return {groups,
          groups == options.stages
              ? std::string("one per stage, which keeps the pipe full")
              : formatv("the most up to one per stage that divide the {0} slots", slots).str()};
}

} // namespace pipec
