//===- Optimizer.cpp - OPTIMIZER_STEP: a rank's weight update ------------===//
//
// The step's learning rate (constant, linear or cosine decay after a linear
// warm-up), gradient clipping by the global norm over all ranks, and the
// update of each trained weight by the backend: SGD, momentum or AdamW.
// Float16 and bfloat16 weights train through float32 master copies. Then
// the running statistics (BatchNormalization's) take the step's batches.
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/RankExecutor.h"
#include "runtime/kernels/KernelBodies.h"

#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>

using namespace llvm;

namespace pipec::rt {

namespace {

/// The learning rate of step \p t under the run's schedule.
double scheduledLr(const Shared &s, int t) {
  const RunOptions &o = s.options;
  double lr = s.lr;
  if (o.warmup > 0 && t < o.warmup)
    return lr * (t + 1) / o.warmup;
  int decaySteps = o.steps - o.warmup;
  double progress = decaySteps > 0 ? std::clamp(double(t - o.warmup) / decaySteps, 0.0, 1.0) : 0.0;
  if (o.lrSchedule == "linear")
    return lr * (1 - progress);
  if (o.lrSchedule == "cosine")
    return lr * 0.5 * (1 + std::cos(M_PI * progress));
  return lr;
}

/// The update of step \p t, but for the gradient's scale and clipping.
OptimizerUpdate stepUpdate(const Shared &s, int t) {
  const RunOptions &o = s.options;
  OptimizerUpdate u;
  u.kind = s.optimizer;
  u.lr = scheduledLr(s, t);
  u.momentum = o.momentum;
  u.weightDecay = o.weightDecay;
  u.beta1 = o.beta1;
  u.beta2 = o.beta2;
  u.epsilon = o.epsilon;
  u.step = t;
  return u;
}

} // namespace

double untrainedFactor(const Shared &s) {
  // Every update is linear in a weight whose gradient is zero: replay the
  // steps on a weight of 1, through the kernel the backends run.
  double w = 1, m = 0, v = 0, g = 0;
  for (int t = 0; t < s.options.steps; ++t) {
    kernels::OptimizerParams p = optimizerParams(stepUpdate(s, t));
    double wOut = w, mOut = m, vOut = v;
    kernels::optimizerElement<double>(0, p, &w, &g, &m, &v, &wOut, &mOut, &vOut);
    w = wOut;
    m = mOut;
    v = vOut;
  }
  return w;
}

Error RankExecutor::optimizerStep(int t) {
  loadNodesStale = true;
  // The step's losses and label counts, read with one wait.
  if (Error err = settleLosses())
    return err;
  if (Error err = fillUnsetGradients())
    return err;
  if (Error err = sumSequenceGrads())
    return err;
  const RunOptions &o = s.options;
  OptimizerUpdate u = stepUpdate(s, t);
  lastLr = u.lr;
  u.gradScale = 1.0 / (static_cast<double>(s.M) * s.dp);
  if (!s.plan->loss_count_value().empty()) {
    // Token-mean: the gradients hold each microbatch's loss summed over its
    // labels; divide by the labels counted on every replica's last stage.
    double counted[1] = {lossCount};
    if (Error err = comm.sumAll(counted))
      return err;
    u.gradScale = counted[0] > 0 ? 1.0 / counted[0] : 0.0;
  }
  if (o.clipGradNorm > 0) {
    // Every rank adds the squares of the weights it counts: a tied weight on
    // the lowest of its ranks, replicas' (identical) gradients on replica 0,
    // or with a sharded optimizer each replica its shard (padded with
    // zeros). The backend sums where the gradients are: one number leaves a
    // device.
    double squares[1] = {0};
    if (replica == 0 || s.shardOptimizer) {
      std::vector<const cpu::Tensor *> counted;
      // The tensor-parallel ranks count their pieces of a split weight, and
      // the first of them the (identical) gradients of the rest.
      for (const std::string &name : trainableHere)
        if (auto owner = tiedOwner.find(name);
            (owner == tiedOwner.end() || owner->second == rank) &&
            (tp == 0 || s.shards.count(name)))
          counted.push_back(&grads[name]);
      auto sum = be.sumOfSquares(counted, u.gradScale);
      if (!sum)
        return rankError(global, "the gradient norm: " + toString(sum.takeError()));
      squares[0] = *sum;
    }
    if (Error err = comm.sumAll(squares))
      return err;
    lastGradNorm = std::sqrt(squares[0]);
    if (lastGradNorm > o.clipGradNorm)
      u.gradScale *= o.clipGradNorm / (lastGradNorm + 1e-6);
  }
  if (s.options.collectWeights)
    if (Error err = collectGradients(u.gradScale))
      return err;
  // Every weight this rank trains, in one multi-tensor update: its master
  // copy where it has one, its shard when the optimizer is sharded.
  std::vector<cpu::Tensor> shards(trainableHere.size());
  std::vector<OptimizerSlot> slots;
  for (size_t i = 0; i < trainableHere.size(); ++i) {
    const std::string &name = trainableHere[i];
    auto center = s.decayCenters.find(name);
    auto m = master.find(name);
    // Sharded, a float32 weight's update starts from its shard.
    if (s.shardOptimizer && m == master.end()) {
      int64_t elements = shardElements(name);
      auto sliced = be.slice(weights[name], replica * elements, elements);
      if (!sliced)
        return sliced.takeError();
      shards[i] = std::move(*sliced);
    }
    OptimizerSlot slot;
    slot.w = m != master.end() ? &m->second : s.shardOptimizer ? &shards[i] : &weights[name];
    slot.g = &grads[name];
    slot.m = &moment1[name];
    slot.v = &moment2[name];
    slot.decayCenter = center == s.decayCenters.end() ? 0.0 : center->second;
    slot.name = name;
    slots.push_back(slot);
  }
  auto squares = be.optimize(u, slots);
  if (!squares)
    return rankError(global,
                     formatv("step {0}, the optimizer: {1}", t + 1, toString(squares.takeError())));
  for (size_t i = 0; i < trainableHere.size(); ++i) {
    const std::string &name = trainableHere[i];
    cpu::Tensor updated = *slots[i].w;
    if (auto m = master.find(name); m != master.end()) {
      int type = weights[name].elemType() == cpu::DType::F16 ? onnx::TensorProto::FLOAT16
                                                             : onnx::TensorProto::BFLOAT16;
      auto rounded = castTo(m->second, type);
      if (!rounded)
        return rounded.takeError();
      updated = std::move(*rounded);
    }
    // Sharded, ALL_GATHER makes the weight of every replica's update.
    if (s.shardOptimizer)
      updatedShards[name] = std::move(updated);
    else
      weights[name] = std::move(updated);
  }
  if (!o.allowNonfinite && !slots.empty())
    if (Error err = checkFinite(*squares, slots, t, u))
      return err;
  return updateRunningStats();
}

Error RankExecutor::checkFinite(const cpu::Tensor &squares, ArrayRef<OptimizerSlot> slots, int t,
                                const OptimizerUpdate &u) {
  // A weight (or Adam's second moment) the update left infinite or NaN
  // poisons every later step and the saved model: stop, naming it. The
  // update summed their squares where they are (finite exactly when each
  // is: a float's square is far inside double's range), and that one
  // number leaves the device; only a step that fails looks for the first
  // culprit, in the order of the update.
  const cpu::Tensor *total[] = {&squares};
  auto read = be.downloadAll(total);
  if (!read)
    return read.takeError();
  if (std::isfinite((*read)[0].getDouble(0)))
    return Error::success();
  for (size_t i = 0; i < slots.size(); ++i)
    for (bool weight : {true, false}) {
      const cpu::Tensor *one[] = {weight ? slots[i].w : slots[i].v};
      if (one[0]->isNull())
        continue;
      auto sum = be.sumOfSquares(one, 1.0);
      if (!sum)
        return sum.takeError();
      if (!std::isfinite(*sum))
        return rankError(
            global, formatv("step {0}: the update left {1} '{2}' infinite or NaN (lr {3}, "
                            "weight decay {4}); lower --lr, or pass --allow-nonfinite to go on",
                            t + 1, weight ? "weight" : "the optimizer state of", trainableHere[i],
                            format("%g", u.lr), format("%g", u.weightDecay)));
    }
  return rankError(global, formatv("step {0}: the update left a weight infinite or NaN", t + 1));
}

Error RankExecutor::collectGradients(double scale) {
  for (const std::string &name : trainableHere) {
    cpu::Tensor g = grads[name];
    if (s.shardOptimizer) {
      // The whole gradient from the replicas' shards.
      std::vector<cpu::Tensor> one = {g};
      if (Error err = overReplicas(one, &Comm::allGather))
        return err;
      const cpu::Tensor &w = weights[name];
      auto whole = be.slice(one[0], 0, w.numElements());
      if (!whole)
        return whole.takeError();
      g = whole->reshaped(w.shape());
    }
    auto host = be.download(g);
    if (!host)
      return host.takeError();
    cpu::Tensor scaled = host->clone();
    for (int64_t i = 0; i < scaled.numElements(); ++i)
      scaled.setDouble(i, scaled.getDouble(i) * scale);
    lastGrads[name] = std::move(scaled);
  }
  return Error::success();
}

Error RankExecutor::updateRunningStats() {
  // Every microbatch of every replica saw a batch: the statistic is their
  // mean (the replicas' sums arrived with the gradients' all-reduce).
  double count = static_cast<double>(s.M) * s.dp;
  for (const auto &[name, momentum] : runningHere) {
    auto buffer = be.download(weights[name]);
    auto sum = be.download(statisticSums[name]);
    if (!buffer)
      return buffer.takeError();
    if (!sum)
      return sum.takeError();
    cpu::Tensor updated = buffer->clone();
    for (int64_t i = 0; i < updated.numElements(); ++i)
      updated.setDouble(i, momentum * buffer->getDouble(i) +
                               (1.0 - momentum) * sum->getDouble(i) / count);
    auto placed = be.upload(updated);
    if (!placed)
      return placed.takeError();
    weights[name] = std::move(*placed);
  }
  return Error::success();
}

Expected<cpu::Tensor> RankExecutor::castTo(const cpu::Tensor &t, int to) {
  onnx::NodeProto cast;
  cast.set_op_type("Cast");
  cast.set_name("pipec:master-cast");
  cast.add_input("x");
  cast.add_output("y");
  auto *a = cast.add_attribute();
  a->set_name("to");
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(to);
  const cpu::Tensor *in[] = {&t};
  auto out = be.run(cast, 13, in);
  if (!out)
    return out.takeError();
  return std::move((*out)[0]);
}

} // namespace pipec::rt
