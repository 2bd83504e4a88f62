//===- PredictStep.cpp - The step time of a partition, by simulation ----===//
#include "passes/PredictStep.h"
#include "compiler/sim/Simulator.h"
#include "passes/PlanMemory.h"
#include "plan/PlanFile.h"

#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {

plan::HardwareInfo hardwareInfo(const HardwareSpec &hw, bool bf16) {
  plan::HardwareInfo out;
  out.set_name(hw.name);
  out.set_peak_flops(hw.peakFlops(bf16));
  out.set_memory_bandwidth(hw.memoryBandwidth);
  out.set_memory_bytes(hw.memoryBytes);
  out.set_launch_overhead_s(hw.launchOverhead);
  out.set_gemm_overhead_s(hw.gemmOverhead);
  out.set_sum_compute_and_memory(hw.sumsComputeAndMemory);
  auto link = [](const LinkSpec &l, plan::LinkInfo &o) {
    o.set_name(l.name);
    o.set_bandwidth(l.bandwidth);
    o.set_latency_s(l.latency);
  };
  link(hw.intraNode, *out.mutable_intra_node());
  link(hw.interNode, *out.mutable_inter_node());
  out.set_devices_per_node(hw.devicesPerNode);
  out.set_source(hw.source);
  return out;
}

LoweringInputs defaultLoweringInputs(const StagePlan &plan, const BalanceOptions &options) {
  LoweringInputs in;
  in.training = options.training.training;
  for (const ChunkPlan &c : plan.chunks) {
    // A chunk recomputes the layers balance-stages chose (all of them for
    // --recompute).
    bool all = options.training.recompute == Recompute::All;
    in.recompute.push_back(options.training.training && (c.recomputes() || all));
    in.rebuiltBytes.push_back(c.recomputes() ? c.rebuiltBytes : c.activationBytes);
    std::vector<plan::TensorRef> tensors;
    if (c.boundaryBytes > 0) {
      plan::TensorRef t;
      t.set_name(formatv("boundary.{0}", c.index).str());
      t.set_dtype("uint8");
      t.add_shape(c.boundaryBytes);
      t.set_bytes(c.boundaryBytes);
      tensors.push_back(t);
    }
    in.hasGradient.emplace_back(tensors.size(), true);
    in.sendTensors.push_back(std::move(tensors));
    in.activationBytes.push_back(c.activationBytes);
    in.workingBytes.push_back(c.workingBytes);
    in.inputBytes.push_back(c.index > 0 ? plan.chunks[c.index - 1].boundaryBytes : 0);
  }
  in.collectives =
      dataParallelCollectives(plan, options.shape, gradientBytesPerParam(options.training),
                              options.training.optimizerShards > 1);
  return in;
}

std::vector<LoweringInputs::Collective> dataParallelCollectives(const StagePlan &plan,
                                                                const PipelineShape &shape,
                                                                int64_t gradientBytes, bool shard) {
  std::vector<LoweringInputs::Collective> out;
  if (shape.dataParallel() <= 1)
    return out;
  auto ops = shard ? std::vector{plan::Instruction::REDUCE_SCATTER, plan::Instruction::ALL_GATHER}
                   : std::vector{plan::Instruction::ALLREDUCE};
  for (plan::Instruction::Op op : ops)
    for (int r = 0; r < shape.stages(); ++r) {
      LoweringInputs::Collective c;
      c.op = op;
      c.reduce = plan::Instruction::DATA_PARALLEL;
      c.ranks = {r};
      for (const ChunkPlan &chunk : plan.chunks)
        if (chunk.rank == r)
          c.bytes += chunk.params * gradientBytes;
      out.push_back(c);
    }
  return out;
}

StepPredictor::StepPredictor(const BalanceOptions &options)
    : options(options), schedule(generateSchedule(options.shape)) {
  for (const HardwareSpec &hw : options.rankHardware)
    hardware.push_back(hardwareInfo(hw, options.training.mixedPrecision));
}

Expected<StepPrediction> StepPredictor::simulate(const StagePlan &stagePlan, bool peaks) const {
  int chunks = options.shape.chunks();
  if (static_cast<int>(stagePlan.chunks.size()) != chunks || hardware.empty())
    return createStringError(inconvertibleErrorCode(),
                             "predict-step: the plan has %zu chunks, the schedule %d",
                             stagePlan.chunks.size(), chunks);
  // A search's candidates differ in sizes, seldom in the structure of their
  // streams: the last lowering is reused when only sizes differ.
  LoweringInputs inputs =
      options.lowering ? options.lowering(stagePlan) : defaultLoweringInputs(stagePlan, options);
  if (!last || !resizeLowered(last->lowered, inputs)) {
    last.reset();
    auto fresh = lowerStreams(schedule, inputs);
    if (!fresh)
      return fresh.takeError();
    last.emplace(Lowered{std::move(*fresh), {}});
  }
  // The streams point into the inputs they were lowered or resized for.
  last->inputs = std::move(inputs);
  const LoweredStreams *lowered = &last->lowered;
  // The numbers the compiled plan would carry (its stages' times, its
  // ranks' weights, its hardware), charged as simulatePlan charges them.
  StepCosts costs;
  for (const ChunkPlan &c : stagePlan.chunks) {
    costs.stageTimes.push_back({c.time[Forward], c.time[BackwardInput], c.time[BackwardWeight]});
    costs.recomputeTimes.push_back(c.recomputes() ? c.recomputeTime : c.time[Forward]);
  }
  for (const RankPlan &r : stagePlan.ranks)
    costs.weightBytes.push_back(r.weightBytes);
  costs.hardware = hardware;
  costs.dataParallel = options.shape.dataParallel();
  auto simulated = runStreams(lowered->streams, streamCosts(costs), nullptr, false, true);
  if (!simulated)
    return simulated.takeError();
  StepPrediction out;
  out.step = simulated->stepTime;
  out.bubbleFraction = simulated->bubbleFraction;
  if (peaks)
    for (size_t r = 0; r < lowered->buffers.size(); ++r)
      out.peakMemory.push_back((r < stagePlan.ranks.size() ? stagePlan.ranks[r].weightBytes : 0) +
                               planSlots(lowered->buffers[r]).peak + lowered->workingBytes[r]);
  return out;
}

Expected<double> StepPredictor::operator()(const StagePlan &stagePlan) const {
  auto predicted = simulate(stagePlan, false);
  if (!predicted)
    return predicted.takeError();
  return predicted->step;
}

Expected<StepPrediction> StepPredictor::predict(const StagePlan &stagePlan) const {
  return simulate(stagePlan, true);
}

} // namespace pipec
