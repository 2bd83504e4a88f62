//===- PredictStep.cpp - The step time of a partition, by simulation ----===//
#include "passes/PredictStep.h"
#include "compiler/sim/Simulator.h"

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
  in.recompute = options.training.recompute;
  for (const ChunkPlan &c : plan.chunks) {
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
    in.inputBytes.push_back(c.index > 0 ? plan.chunks[c.index - 1].boundaryBytes : 0);
  }
  int64_t gradBytes = options.training.mixedPrecision ? 2 : 4;
  if (options.dataParallel > 1)
    for (int r = 0; r < options.stages; ++r) {
      LoweringInputs::AllReduce ar;
      ar.group = "dp";
      ar.ranks = {r};
      for (const ChunkPlan &c : plan.chunks)
        if (c.rank == r)
          ar.bytes += c.params * gradBytes;
      in.allReduces.push_back(ar);
    }
  return in;
}

StepPredictor::StepPredictor(const BalanceOptions &options) : options(options) {
  auto generated = generateSchedule(options.schedule, options.stages, options.virtualStages,
                                    options.microbatches);
  if (generated)
    schedule = std::move(*generated);
  else
    scheduleError = toString(generated.takeError());
  for (const HardwareSpec &hw : options.rankHardware)
    hardware.push_back(hardwareInfo(hw, options.training.mixedPrecision));
}

Expected<double> StepPredictor::operator()(const StagePlan &stagePlan) const {
  if (!schedule)
    return createStringError(inconvertibleErrorCode(), "%s", scheduleError.c_str());
  LoweringInputs inputs =
      options.lowering ? options.lowering(stagePlan) : defaultLoweringInputs(stagePlan, options);
  auto programs = lowerSchedule(*schedule, inputs);
  if (!programs)
    return programs.takeError();
  // The parts of a plan the simulator reads, as the driver fills them.
  plan::Plan skeleton;
  for (const plan::HardwareInfo &hw : hardware)
    *skeleton.add_hardware() = hw;
  skeleton.mutable_schedule()->set_data_parallel(options.dataParallel);
  for (const ChunkPlan &c : stagePlan.chunks) {
    plan::Stage *s = skeleton.add_stages();
    s->set_index(c.index);
    s->set_rank(c.rank);
    s->set_time_f_s(c.time[Forward]);
    s->set_time_i_s(c.time[BackwardInput]);
    s->set_time_w_s(c.time[BackwardWeight]);
  }
  for (const RankPlan &r : stagePlan.ranks)
    skeleton.add_ranks()->set_weight_bytes(r.weightBytes);
  for (plan::RankProgram &p : *programs)
    *skeleton.add_programs() = std::move(p);
  auto simulated = simulatePlan(skeleton);
  if (!simulated)
    return simulated.takeError();
  return simulated->stepTime;
}

} // namespace pipec
