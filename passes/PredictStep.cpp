//===- PredictStep.cpp - The step time of a partition, by simulation ----===//
#include "passes/PredictStep.h"
#include "compiler/sim/Simulator.h"
#include "passes/PlanMemory.h"
#include "plan/PlanFile.h"

#include "llvm/Support/FormatVariadic.h"

#include <array>
#include <cmath>
#include <limits>

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
      ar.reduce = plan::Instruction::DATA_PARALLEL;
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

namespace {

/// What simulatePlan charges to move \p bytes from rank \p from to rank \p to.
double linkTime(const std::vector<plan::HardwareInfo> &hardware, int from, int to, int64_t bytes) {
  return transferSeconds(hardware[std::min<size_t>(from, hardware.size() - 1)], from, to, bytes);
}

/// The step simulatePlan predicts for the programs lower-schedule makes of a
/// schedule and lowering inputs, computed on plain arrays without building
/// them. The simulator's semantics reduce to a data flow over each rank's
/// compute actions: an action starts when its rank is free and the tensors
/// it receives have arrived; a transfer starts when both its SEND (after
/// the producing action) and its RECV are posted, and lower-schedule posts a
/// RECV at the start of the action it was moved to (orderReceives: the
/// least natural position among the later sends of the same channel). LOAD
/// and FREE take no time; the all-reduces and the optimizer step follow the
/// last action. Every sum and maximum is the simulator's, so the result is
/// the same double; StepPredictorTest checks it against lowerAndSimulate.
class StreamTimer {
public:
  StreamTimer(const Schedule &schedule, const LoweringInputs &in, const StagePlan &stagePlan,
              const std::vector<plan::HardwareInfo> &hardware, int dataParallel)
      : schedule(schedule), in(in), stagePlan(stagePlan), hardware(hardware),
        dataParallel(dataParallel), P(schedule.stages), K(schedule.stages * schedule.virtualStages),
        M(schedule.microbatches) {
    for (int k = 0; k < K; ++k)
      stageRank.push_back(rankOfChunk(schedule.kind, P, schedule.virtualStages, k));
  }

  Expected<double> run();
  /// The simulator's bubble for the \p step run() returned: one minus the
  /// ranks' compute time over P times the step.
  double bubbleFraction(double step) const;

private:
  /// One compute action with what it waits for and what it sends.
  struct Block {
    int needKey = -1, sendKey = -1;
    double recompute = -1; ///< the RECOMPUTE before it, when there is one
    double duration = 0;
  };

  int rankOf(int stage) const { return stageRank[stage]; }
  /// Transfers are keyed by (boundary, microbatch, gradient).
  int keyOf(int boundary, int mb, bool grad) const { return (boundary * M + mb) * 2 + grad; }
  Error makeBlocks();
  Error placeReceives();
  Expected<bool> advance(int r);
  double allReduceTime(int r, const LoweringInputs::AllReduce &ar) const;

  const Schedule &schedule;
  const LoweringInputs &in;
  const StagePlan &stagePlan;
  const std::vector<plan::HardwareInfo> &hardware;
  int dataParallel, P, K, M;
  /// Per stage (global chunk): its rank.
  std::vector<int> stageRank;

  /// Per boundary and direction (0 activations, 1 gradients): the longest
  /// of its tensors' transfers, or -1 when nothing crosses.
  std::vector<std::array<double, 2>> crossing;
  /// Per rank, its blocks at offset[r] .. offset[r + 1] of blocks.
  std::vector<Block> blocks;
  std::vector<int> offset;
  /// Per key: the block (rank-local) that needs it and the one whose start
  /// posts its RECV; when its SEND was posted (NaN before).
  std::vector<int> natural, recvAt;
  std::vector<double> sendPost;
  /// Per rank: the next block, the clock, when each block started, when
  /// its last send ends, the latest arrival and the compute time (summed in
  /// the simulator's order: a RECOMPUTE, then its backward).
  std::vector<int> pc;
  std::vector<double> clock, blockStart, sendsDone, lastArrival, busy;
};

Error StreamTimer::makeBlocks() {
  if (static_cast<int>(in.sendTensors.size()) != K || static_cast<int>(in.hasGradient.size()) != K)
    return createStringError(inconvertibleErrorCode(),
                             "lower-schedule: boundary tensors for %d stages are needed", K);
  crossing.assign(K, {-1.0, -1.0});
  for (int s = 0; s + 1 < K; ++s) {
    int from = rankOf(s), to = rankOf(s + 1);
    if (from == to)
      continue;
    for (size_t t = 0; t < in.sendTensors[s].size(); ++t) {
      int64_t bytes = in.sendTensors[s][t].bytes();
      crossing[s][0] = std::max(crossing[s][0], linkTime(hardware, from, to, bytes));
      if (in.hasGradient[s][t])
        crossing[s][1] = std::max(crossing[s][1], linkTime(hardware, to, from, bytes));
    }
  }
  offset.assign(1, 0);
  natural.assign(static_cast<size_t>(K) * M * 2, -1);
  for (int r = 0; r < P; ++r) {
    for (const Action &a : schedule.ranks[r]) {
      int s = a.stage, m = a.microbatch;
      if (s < 0 || s >= K || m < 0 || m >= M || rankOf(s) != r)
        return createStringError(inconvertibleErrorCode(),
                                 "lower-schedule: rank %d was given action %s", r,
                                 formatAction(a).c_str());
      const ChunkPlan &c = stagePlan.chunks[s];
      Block b;
      bool hasNext = s + 1 < K && rankOf(s + 1) != r, hasPrev = s > 0 && rankOf(s - 1) != r;
      switch (a.kind) {
      case ActionKind::F:
        b.duration = c.time[Forward];
        if (hasPrev && crossing[s - 1][0] >= 0)
          b.needKey = keyOf(s - 1, m, false);
        if (hasNext && crossing[s][0] >= 0)
          b.sendKey = keyOf(s, m, false);
        break;
      case ActionKind::B:
      case ActionKind::I:
        b.duration = a.kind == ActionKind::B ? c.time[BackwardInput] + c.time[BackwardWeight]
                                             : c.time[BackwardInput];
        if (in.recompute)
          b.recompute = c.time[Forward];
        if (hasNext && crossing[s][1] >= 0)
          b.needKey = keyOf(s, m, true);
        if (hasPrev && crossing[s - 1][1] >= 0)
          b.sendKey = keyOf(s - 1, m, true);
        break;
      case ActionKind::W:
        b.duration = c.time[BackwardWeight];
        break;
      }
      if (b.needKey >= 0)
        natural[b.needKey] = static_cast<int>(blocks.size()) - offset[r];
      blocks.push_back(b);
    }
    offset.push_back(static_cast<int>(blocks.size()));
  }
  return Error::success();
}

/// lower-schedule's orderReceives: on each channel, a RECV is posted at the
/// least natural position of its own and every later send's.
Error StreamTimer::placeReceives() {
  recvAt.assign(natural.size(), -1);
  std::vector<int> least(P);
  for (int src = 0; src < P; ++src) {
    std::fill(least.begin(), least.end(), std::numeric_limits<int>::max());
    for (int b = offset[src + 1] - 1; b >= offset[src]; --b) {
      int key = blocks[b].sendKey;
      if (key < 0)
        continue;
      int boundary = key / 2 / M;
      int dst = key % 2 ? rankOf(boundary) : rankOf(boundary + 1);
      if (natural[key] < 0)
        return createStringError(inconvertibleErrorCode(),
                                 "lower-schedule: rank %d never receives a tensor rank %d sends",
                                 dst, src);
      least[dst] = std::min(least[dst], natural[key]);
      recvAt[key] = least[dst];
    }
  }
  return Error::success();
}

/// Runs rank \p r's actions until one waits for a send not yet posted;
/// returns whether it moved.
Expected<bool> StreamTimer::advance(int r) {
  bool moved = false;
  for (; pc[r] < offset[r + 1] - offset[r]; ++pc[r]) {
    const Block &b = blocks[offset[r] + pc[r]];
    blockStart[offset[r] + pc[r]] = clock[r];
    double ready = 0;
    if (b.needKey >= 0) {
      if (std::isnan(sendPost[b.needKey]))
        return moved;
      int boundary = b.needKey / 2 / M;
      bool grad = b.needKey % 2;
      int sender = grad ? rankOf(boundary + 1) : rankOf(boundary);
      double start = std::max(sendPost[b.needKey], blockStart[offset[r] + recvAt[b.needKey]]);
      double arrival = start + crossing[boundary][grad];
      sendsDone[sender] = std::max(sendsDone[sender], arrival);
      lastArrival[r] = std::max(lastArrival[r], arrival);
      ready = std::max(ready, arrival);
    }
    if (b.recompute >= 0) {
      clock[r] = clock[r] + b.recompute;
      busy[r] += b.recompute;
    }
    clock[r] = std::max(clock[r], ready) + b.duration;
    busy[r] += b.duration;
    if (b.sendKey >= 0)
      sendPost[b.sendKey] = clock[r];
    moved = true;
  }
  return moved;
}

double StreamTimer::allReduceTime(int r, const LoweringInputs::AllReduce &ar) const {
  if (ar.reduce == plan::Instruction::DATA_PARALLEL)
    return ringAllReduceSeconds(dataParallel, ar.bytes, [&](int64_t b) {
      return interNodeStepSeconds(hardware[std::min<size_t>(r, hardware.size() - 1)], b);
    });
  // The step is asked for only with two ranks or more.
  return ringAllReduceSeconds(static_cast<int>(ar.ranks.size()), ar.bytes, [&](int64_t b) {
    return linkTime(hardware, r, ar.ranks[0] == r ? ar.ranks[1] : ar.ranks[0], b);
  });
}

Expected<double> StreamTimer::run() {
  if (static_cast<int>(stagePlan.chunks.size()) != K || hardware.empty())
    return createStringError(inconvertibleErrorCode(),
                             "predict-step: the plan has %zu chunks, the schedule %d",
                             stagePlan.chunks.size(), K);
  if (Error err = makeBlocks())
    return err;
  if (Error err = placeReceives())
    return err;
  sendPost.assign(natural.size(), std::numeric_limits<double>::quiet_NaN());
  pc.assign(P, 0);
  clock.assign(P, 0);
  sendsDone.assign(P, 0);
  lastArrival.assign(P, 0);
  busy.assign(P, 0);
  blockStart.assign(blocks.size(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      auto moved = advance(r);
      if (!moved)
        return moved.takeError();
      progress |= *moved;
    }
  }
  for (int r = 0; r < P; ++r)
    if (pc[r] < offset[r + 1] - offset[r])
      return createStringError(inconvertibleErrorCode(),
                               "deadlock under blocking point-to-point semantics: rank %d waits "
                               "before action %s",
                               r, formatAction(schedule.ranks[r][pc[r]]).c_str());
  if (in.training) {
    for (const LoweringInputs::AllReduce &ar : in.allReduces) {
      double start = 0;
      for (int r : ar.ranks)
        if (r < 0 || r >= P)
          return createStringError(inconvertibleErrorCode(), "all-reduce %s names rank %d",
                                   allReduceGroupName(ar.reduce, ar.tiedWeight).c_str(), r);
        else
          start = std::max(start, clock[r]);
      for (int r : ar.ranks)
        clock[r] = start + allReduceTime(r, ar);
    }
    for (int r = 0; r < P; ++r) {
      const plan::HardwareInfo &hw = hardware[std::min<size_t>(r, hardware.size() - 1)];
      double optimizer = r < static_cast<int>(stagePlan.ranks.size())
                             ? optimizerSeconds(hw, stagePlan.ranks[r].weightBytes)
                             : 0.0;
      clock[r] = std::max(clock[r], lastArrival[r]) + optimizer;
    }
  }
  double step = 0;
  for (int r = 0; r < P; ++r)
    step = std::max(step, std::max(clock[r], sendsDone[r]));
  return step;
}

double StreamTimer::bubbleFraction(double step) const {
  double total = 0;
  for (int r = 0; r < P; ++r)
    total += busy[r];
  return step > 0 ? std::max(0.0, 1 - total / (P * step)) : 0;
}

/// plan-memory's peak of live activation bytes on each rank of the programs
/// lower-schedule makes of \p schedule, without building them. A FORWARD
/// allocates the activations its stage keeps (only its input with
/// recompute), a RECOMPUTE the rebuilt ones; a B, or the W after an I,
/// frees both; in inference a forward's are freed once sent. Each
/// allocation and free is an instruction of its own, so the peak is the
/// running maximum in program order. The buffers lower-schedule refuses
/// (freed but never allocated, or never freed) are an error here too.
Expected<std::vector<int64_t>> peakActivations(const Schedule &schedule, const LoweringInputs &in) {
  int ranks = schedule.stages, chunks = ranks * schedule.virtualStages;
  int microbatches = schedule.microbatches;
  if (static_cast<int>(in.activationBytes.size()) != chunks ||
      static_cast<int>(in.inputBytes.size()) != chunks)
    return createStringError(inconvertibleErrorCode(),
                             "lower-schedule: activation sizes for %d stages are needed", chunks);
  std::vector<char> live(static_cast<size_t>(chunks) * microbatches * 2, 0);
  std::vector<int64_t> peaks;
  for (int r = 0; r < ranks; ++r) {
    int64_t now = 0, peak = 0;
    int open = 0;
    // A kept set: (stage, microbatch) and whether it is the rebuilt one.
    auto change = [&](int s, int m, bool rebuilt, bool allocate) {
      char &held = live[(static_cast<size_t>(s) * microbatches + m) * 2 + rebuilt];
      if (held == allocate)
        return false;
      held = allocate;
      int64_t bytes = rebuilt || !in.recompute ? in.activationBytes[s] : in.inputBytes[s];
      now += allocate ? bytes : -bytes;
      open += allocate ? 1 : -1;
      peak = std::max(peak, now);
      return true;
    };
    for (const Action &a : schedule.ranks[r]) {
      int s = a.stage, m = a.microbatch;
      if (s < 0 || s >= chunks || m < 0 || m >= microbatches)
        return createStringError(inconvertibleErrorCode(),
                                 "lower-schedule: rank %d was given action %s", r,
                                 formatAction(a).c_str());
      bool ok = true;
      switch (a.kind) {
      case ActionKind::F:
        ok = change(s, m, false, true) && (in.training || change(s, m, false, false));
        break;
      case ActionKind::B:
        ok = (!in.recompute || (change(s, m, true, true) && change(s, m, true, false))) &&
             change(s, m, false, false);
        break;
      case ActionKind::I:
        ok = !in.recompute || change(s, m, true, true);
        break;
      case ActionKind::W:
        ok = (!in.recompute || change(s, m, true, false)) && change(s, m, false, false);
        break;
      }
      if (!ok)
        return createStringError(inconvertibleErrorCode(),
                                 "lower-schedule: rank %d: action %s allocates activations "
                                 "it holds, or frees some it does not",
                                 r, formatAction(a).c_str());
    }
    if (open != 0)
      return createStringError(inconvertibleErrorCode(),
                               "lower-schedule: rank %d never frees some activations (no "
                               "backward in its schedule)",
                               r);
    peaks.push_back(peak);
  }
  return peaks;
}

} // namespace

Expected<double> StepPredictor::operator()(const StagePlan &stagePlan) const {
  if (!schedule)
    return createStringError(inconvertibleErrorCode(), "%s", scheduleError.c_str());
  LoweringInputs inputs =
      options.lowering ? options.lowering(stagePlan) : defaultLoweringInputs(stagePlan, options);
  return StreamTimer(*schedule, inputs, stagePlan, hardware, options.dataParallel).run();
}

Expected<StepPrediction> StepPredictor::predict(const StagePlan &stagePlan) const {
  if (!schedule)
    return createStringError(inconvertibleErrorCode(), "%s", scheduleError.c_str());
  LoweringInputs inputs =
      options.lowering ? options.lowering(stagePlan) : defaultLoweringInputs(stagePlan, options);
  StreamTimer timer(*schedule, inputs, stagePlan, hardware, options.dataParallel);
  auto step = timer.run();
  if (!step)
    return step.takeError();
  auto peaks = peakActivations(*schedule, inputs);
  if (!peaks)
    return peaks.takeError();
  StepPrediction out;
  out.step = *step;
  out.bubbleFraction = timer.bubbleFraction(*step);
  for (size_t r = 0; r < peaks->size(); ++r)
    out.peakMemory.push_back((r < stagePlan.ranks.size() ? stagePlan.ranks[r].weightBytes : 0) +
                             (*peaks)[r]);
  return out;
}

Expected<StepPrediction> StepPredictor::lowerAndSimulate(const StagePlan &stagePlan) const {
  if (!schedule)
    return createStringError(inconvertibleErrorCode(), "%s", scheduleError.c_str());
  LoweringInputs inputs =
      options.lowering ? options.lowering(stagePlan) : defaultLoweringInputs(stagePlan, options);
  auto programs = lowerSchedule(*schedule, inputs);
  if (!programs)
    return programs.takeError();
  planMemory(*programs);
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
  StepPrediction out;
  out.step = simulated->stepTime;
  out.bubbleFraction = simulated->bubbleFraction;
  out.peakMemory = std::move(simulated->peakMemory);
  return out;
}

} // namespace pipec
