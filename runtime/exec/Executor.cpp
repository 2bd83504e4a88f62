//===- Executor.cpp - Runs a plan: one executor per rank -----------------===//
#include "runtime/exec/Executor.h"
#include "runtime/comm/Comm.h"
#include "runtime/core/Backend.h"
#include "runtime/cpu/GradKernels.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Data.h"
#include "runtime/exec/Fusion.h"
#include "runtime/exec/ModelIO.h"
#include "runtime/plan/PlanFile.h"
#include "support/ChromeTrace.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <malloc.h>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <unordered_map>

using namespace llvm;

namespace pipec::rt {

namespace {

using Clock = std::chrono::steady_clock;

/// Seconds since the epoch: trace times that processes on one host share.
double wallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
using Ins = plan::Instruction;
using Env = std::unordered_map<std::string, cpu::Tensor>;

Error rankError(int rank, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "rank %d: %s", rank, why.str().c_str());
}

using OptimizerKind = OptimizerUpdate::Kind;

struct Fault {
  int rank = -1, step = -1, at = -1;
  std::string kind;
};

Fault parseFault() {
  Fault f;
  const char *text = std::getenv("PIPEC_FAULT");
  if (!text)
    return f;
  SmallVector<StringRef, 4> parts;
  StringRef(text).split(parts, ',');
  for (StringRef p : parts) {
    auto [key, value] = p.split('=');
    if (key == "rank")
      value.getAsInteger(10, f.rank);
    else if (key == "step")
      value.getAsInteger(10, f.step);
    else if (key == "at")
      value.getAsInteger(10, f.at);
    else if (key == "kind")
      f.kind = value.str();
  }
  return f;
}

/// What all ranks of a run share (read-only once made).
struct Shared {
  const plan::Plan *plan = nullptr;
  RunOptions options;
  std::string modelPath, modelDir;
  std::shared_ptr<DataSource> data;
  int P = 1, dp = 1, K = 1, M = 1;
  int64_t globalBatch = 1, microbatchSize = 1;
  bool training = true, recompute = false;
  std::vector<int> rankOfStage;
  std::map<std::string, const onnx::TensorProto *> weightProtos;
  std::set<std::string> trainable;
  OptimizerKind optimizer = OptimizerKind::AdamW;
  double lr = 1e-3;
  Fault fault;
  /// The plan's stage programs as this run executes them (fused unless
  /// --no-fuse).
  std::vector<plan::StageProgram> programs;
  FusionStats fusion;
};

/// Microbatch \p mb's first sample at step \p step on replica \p replica.
int64_t firstSample(const Shared &s, int step, int replica, int mb) {
  return static_cast<int64_t>(step) * s.globalBatch +
         (static_cast<int64_t>(replica) * s.M + mb) * s.microbatchSize;
}

class RankExecutor {
public:
  RankExecutor(const Shared &shared, Comm &comm, Backend &backend)
      : s(shared), comm(comm), be(backend), global(comm.rank()), replica(global / shared.P),
        rank(global % shared.P), program(shared.plan->programs(rank)) {}

  Error load();
  Error step(int t, double &lossSum, double &lossCount);
  Error saveCheckpoint(StringRef file, int nextStep);
  Error loadCheckpoint(StringRef file, int &nextStep);

  int globalRank() const { return global; }
  /// Host copies of this rank's trainable weights.
  Expected<std::map<std::string, cpu::Tensor>> trainedWeights();
  int replicaIndex() const { return replica; }
  std::map<std::string, cpu::Tensor> weights; ///< this rank's weights and constants
  std::map<std::string, cpu::Tensor> lastGrads;
  std::map<std::string, std::map<int64_t, cpu::Tensor>> outputs;
  std::vector<TraceEvent> events;
  double busy = 0;
  int64_t instructions = 0;
  /// Time inside the backend's node kernels, time in whole instructions
  /// (excluding waits for messages), and nodes run.
  double kernelSeconds = 0, instructionSeconds = 0;
  int64_t nodesRun = 0;
  /// The last step's learning rate and (with clipping) gradient norm.
  double lastLr = 0, lastGradNorm = -1;
  /// Seconds spent waiting for messages inside compute instructions.
  double waitSeconds = 0;

private:
  const plan::StageProgram &stageProgram(int stage) const { return s.programs[stage]; }
  bool local(int stage) const { return stage >= 0 && stage < s.K && s.rankOfStage[stage] == rank; }
  int peerGlobal(int pipelineRank) const { return replica * s.P + pipelineRank; }
  Env &env(int stage, int mb) { return envs[{stage, mb}]; }
  Error runNodes(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes, Env &values,
                 int stage, int mb, StringRef phase);
  Error loadInputs(int stage, int mb, int t);
  Error collect(bool grad, int stageField, int mb);
  Error forward(int stage, int mb, int t, bool again);
  Error backwardInput(int stage, int mb);
  Error backwardWeight(int stage, int mb);
  Error allReduce(const Ins &ins);
  Error optimizerStep(int t);
  void prune(Env &values, const std::set<std::string> &keep);
  /// \p t as the Comm takes it: device tensors stay when it moves them.
  Expected<cpu::Tensor> forComm(const cpu::Tensor &t);

  const Shared &s;
  Comm &comm;
  Backend &be;
  int global, replica, rank;
  const plan::RankProgram &program;
  std::map<std::pair<int, int>, Env> envs;
  std::map<std::tuple<bool, int, int, std::string>, cpu::Tensor> outbox;
  std::map<std::tuple<bool, int, int, std::string>, int> pending;
  std::map<std::string, cpu::Tensor> grads, moment1, moment2;
  /// float32 master copies of trained float16 / bfloat16 weights.
  std::map<std::string, cpu::Tensor> master;
  /// \p t converted to ONNX element type \p to by the backend's Cast.
  Expected<cpu::Tensor> castTo(const cpu::Tensor &t, int to);
  std::vector<std::string> trainableHere;
  std::map<int, std::set<std::string>> keepSets, inputSets;
  /// Buffer -> (stage, microbatch) of the FORWARD that fills it: what FREE
  /// drops.
  std::map<int, std::pair<int, int>> bufferOwner;
  /// Whether the run writes a trace (events are kept only then).
  bool tracing = !s.options.tracePath.empty();
  /// Tied weight -> the lowest pipeline rank holding it.
  std::map<std::string, int> tiedOwner;
  double lossSum = 0, lossCount = 0;
};

Error RankExecutor::load() {
  std::set<std::string> names;
  for (const plan::Stage &stage : s.plan->stages())
    if (stage.rank() == rank)
      for (const std::string &w : stageProgram(stage.index()).weights())
        names.insert(w);
  for (const std::string &name : names) {
    auto it = s.weightProtos.find(name);
    if (it == s.weightProtos.end())
      return rankError(global, formatv("the plan lists no weight '{0}'", name));
    auto tensor = cpu::fromTensorProto(*it->second, s.modelDir);
    if (!tensor)
      return rankError(global, "loading weights: " + toString(tensor.takeError()));
    bool half = tensor->elemType() == cpu::ElemType::Float16 ||
                tensor->elemType() == cpu::ElemType::BFloat16;
    if (s.trainable.count(name)) {
      if (tensor->elemType() != cpu::ElemType::Float &&
          tensor->elemType() != cpu::ElemType::Double && !half)
        return rankError(global, formatv("weight '{0}' is {1}; training needs float weights", name,
                                         cpu::elemTypeName(tensor->elemType())));
      trainableHere.push_back(name);
    }
    auto placed = be.upload(*tensor);
    if (!placed)
      return rankError(global, "loading weights: " + toString(placed.takeError()));
    if (half && s.trainable.count(name)) {
      // Half weights train through a float32 master copy: the optimizer
      // updates it, the model computes with its rounding.
      auto copy = castTo(*placed, onnx::TensorProto::FLOAT);
      if (!copy)
        return copy.takeError();
      master[name] = std::move(*copy);
    }
    weights[name] = std::move(*placed);
  }
  for (const plan::Buffer &b : program.buffers())
    if (b.alloc_at() >= 0 && b.alloc_at() < program.instructions_size() &&
        program.instructions(b.alloc_at()).op() == Ins::FORWARD)
      bufferOwner[b.index()] = {b.stage(), b.microbatch()};
  for (const Ins &ins : program.instructions())
    if (ins.op() == Ins::ALLREDUCE && StringRef(ins.group()).startswith("tied:") &&
        ins.ranks_size() > 0)
      tiedOwner[ins.group().substr(5)] = *std::min_element(ins.ranks().begin(), ins.ranks().end());
  for (int k = 0; k < s.K; ++k) {
    if (!local(k))
      continue;
    const plan::StageProgram &sp = stageProgram(k);
    keepSets[k] = std::set<std::string>(sp.keep().begin(), sp.keep().end());
    std::set<std::string> inputs(sp.recv().begin(), sp.recv().end());
    inputs.insert(sp.loads().begin(), sp.loads().end());
    inputSets[k] = std::move(inputs);
  }
  return Error::success();
}

Error RankExecutor::runNodes(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                             Env &values, int stage, int mb, StringRef phase) {
  std::vector<const cpu::Tensor *> inputs;
  for (const onnx::NodeProto &node : nodes) {
    inputs.clear();
    for (const std::string &name : node.input()) {
      if (name.empty()) {
        inputs.push_back(nullptr);
        continue;
      }
      auto it = values.find(name);
      if (it != values.end()) {
        inputs.push_back(&it->second);
        continue;
      }
      auto w = weights.find(name);
      if (w == weights.end())
        return rankError(global,
                         formatv("stage {0} microbatch {1} {2}: node '{3}' ({4}) reads "
                                 "'{5}', which is missing",
                                 stage, mb, phase, cpu::nodeLabel(node), node.op_type(), name));
      inputs.push_back(&w->second);
    }
    auto kernelStart = Clock::now();
    auto outs = be.run(node, s.plan->opset(), inputs);
    kernelSeconds += std::chrono::duration<double>(Clock::now() - kernelStart).count();
    ++nodesRun;
    if (!outs)
      return rankError(global, formatv("stage {0} microbatch {1} {2}: {3}", stage, mb, phase,
                                       toString(outs.takeError())));
    for (int o = 0; o < node.output_size() && o < static_cast<int>(outs->size()); ++o)
      if (!node.output(o).empty())
        values[node.output(o)] = std::move((*outs)[o]);
  }
  return Error::success();
}

Error RankExecutor::loadInputs(int stage, int mb, int t) {
  Env &values = env(stage, mb);
  for (const std::string &name : stageProgram(stage).loads()) {
    if (values.count(name))
      continue;
    auto tensor = s.data->microbatch(name, firstSample(s, t, replica, mb));
    if (!tensor)
      return rankError(global, toString(tensor.takeError()));
    auto placed = be.upload(*tensor);
    if (!placed)
      return placed.takeError();
    values[name] = std::move(*placed);
  }
  return Error::success();
}

Error RankExecutor::collect(bool grad, int stageField, int mb) {
  for (auto it = pending.begin(); it != pending.end();) {
    auto &[g, st, m, name] = it->first;
    if (g != grad || st != stageField || m != mb) {
      ++it;
      continue;
    }
    double start = wallNow();
    auto tensor = comm.wait(it->second);
    if (!tensor)
      return tensor.takeError();
    double waited = wallNow() - start;
    waitSeconds += waited;
    if (tracing && waited > 1e-5)
      events.push_back(
          {formatv("recv {0} {1}", grad ? "grad" : "act", name).str(), 'C', global, start, waited});
    if (grad)
      env(stageField, mb)["grad-next:" + name] = std::move(*tensor);
    else
      env(stageField + 1, mb)[name] = std::move(*tensor);
    it = pending.erase(it);
  }
  return Error::success();
}

void RankExecutor::prune(Env &values, const std::set<std::string> &keep) {
  // Gradients already handed over by the next stage on this rank (ZB-V and
  // DualPipeV run it before a RECOMPUTE here) are backward's inputs too.
  for (auto it = values.begin(); it != values.end();)
    if (keep.count(it->first) || StringRef(it->first).startswith("grad-next:"))
      ++it;
    else
      it = values.erase(it);
}

Error RankExecutor::forward(int stage, int mb, int t, bool again) {
  const plan::StageProgram &sp = stageProgram(stage);
  if (!again) {
    if (Error err = loadInputs(stage, mb, t))
      return err;
    if (Error err = collect(false, stage - 1, mb))
      return err;
  }
  Env &values = env(stage, mb);
  for (const std::string &name : sp.recv())
    if (!values.count(name))
      return rankError(global, formatv("stage {0} microbatch {1}: boundary tensor '{2}' never "
                                       "arrived",
                                       stage, mb, name));
  if (Error err = runNodes(sp.forward(), values, stage, mb, again ? "recompute" : "forward"))
    return err;
  if (again) {
    prune(values, keepSets[stage]);
    return Error::success();
  }
  bool last = stage + 1 == s.K;
  if (last && s.training) {
    auto it = values.find(s.plan->loss_value());
    if (it == values.end() || it->second.numElements() != 1)
      return rankError(global, formatv("stage {0} microbatch {1}: no scalar loss '{2}'", stage, mb,
                                       s.plan->loss_value()));
    auto host = be.download(it->second);
    if (!host)
      return host.takeError();
    lossSum += host->getDouble(0);
    lossCount += 1;
  }
  if (!s.training)
    for (const std::string &name : sp.outputs())
      if (auto it = values.find(name); it != values.end()) {
        auto host = be.download(it->second);
        if (!host)
          return host.takeError();
        outputs[name][firstSample(s, t, replica, mb)] = std::move(*host);
      }
  for (const std::string &name : sp.send()) {
    auto it = values.find(name);
    if (it == values.end())
      return rankError(global, formatv("stage {0} microbatch {1}: '{2}' to send was not computed",
                                       stage, mb, name));
    if (local(stage + 1))
      env(stage + 1, mb)[name] = it->second;
    else
      outbox[{false, stage, mb, name}] = it->second;
  }
  if (s.training)
    prune(values, s.recompute ? inputSets[stage] : keepSets[stage]);
  return Error::success();
}

Error RankExecutor::backwardInput(int stage, int mb) {
  const plan::StageProgram &sp = stageProgram(stage);
  if (Error err = collect(true, stage, mb))
    return err;
  Env &values = env(stage, mb);
  if (Error err = runNodes(sp.backward_input(), values, stage, mb, "backward-input"))
    return err;
  for (const plan::GradSum &g : sp.input_grads()) {
    std::vector<const cpu::Tensor *> terms;
    for (const std::string &term : g.terms()) {
      auto it = values.find(term);
      if (it == values.end())
        return rankError(global, formatv("stage {0} microbatch {1}: gradient term '{2}' of '{3}' "
                                         "was not computed",
                                         stage, mb, term, g.value()));
      if (!terms.empty() && it->second.shape() != terms[0]->shape())
        return rankError(global, formatv("stage {0}: gradient terms of '{1}' differ in shape",
                                         stage, g.value()));
      terms.push_back(&it->second);
    }
    auto v = values.find(g.value());
    if (terms.empty() && v == values.end())
      return rankError(global, formatv("stage {0}: no value '{1}' to shape its zero gradient",
                                       stage, g.value()));
    Expected<cpu::Tensor> made =
        terms.empty() ? be.zeros(v->second.elemType(), v->second.shape()) : be.sum(terms);
    if (!made)
      return rankError(global, formatv("stage {0}: the gradient of '{1}': {2}", stage, g.value(),
                                       toString(made.takeError())));
    cpu::Tensor total = std::move(*made);
    if (local(stage - 1))
      env(stage - 1, mb)["grad-next:" + g.value()] = std::move(total);
    else
      outbox[{true, stage - 1, mb, g.value()}] = std::move(total);
  }
  return Error::success();
}

Error RankExecutor::backwardWeight(int stage, int mb) {
  const plan::StageProgram &sp = stageProgram(stage);
  Env &values = env(stage, mb);
  if (Error err = runNodes(sp.backward_weight(), values, stage, mb, "backward-weight"))
    return err;
  for (const plan::GradSum &g : sp.weight_grads()) {
    auto acc = grads.find(g.value());
    if (acc == grads.end())
      continue; // not trained (e.g. a buffer)
    for (const std::string &term : g.terms()) {
      auto it = values.find(term);
      if (it == values.end())
        return rankError(global, formatv("stage {0} microbatch {1}: gradient term '{2}' of weight "
                                         "'{3}' was not computed",
                                         stage, mb, term, g.value()));
      // Element types are the backend's to reconcile (a float32 accumulator
      // takes float16 terms).
      if (it->second.numElements() != acc->second.numElements())
        return rankError(global,
                         formatv("stage {0}: gradient '{1}' is {2}, weight '{3}' is {4}", stage,
                                 term, it->second.describe(), g.value(), acc->second.describe()));
      if (Error err = be.addInto(acc->second, it->second))
        return rankError(global, formatv("stage {0}: accumulating '{1}': {2}", stage, term,
                                         toString(std::move(err))));
    }
  }
  return Error::success();
}

Error RankExecutor::allReduce(const Ins &ins) {
  std::vector<int> group;
  std::vector<std::string> names;
  if (ins.group() == "dp") {
    for (int d = 0; d < s.dp; ++d)
      group.push_back(d * s.P + rank);
    names = trainableHere;
  } else if (StringRef(ins.group()).startswith("tied:")) {
    for (int r : ins.ranks())
      group.push_back(peerGlobal(r));
    std::string w = ins.group().substr(5);
    if (grads.count(w))
      names.push_back(w);
  } else {
    return rankError(global, formatv("unknown all-reduce group '{0}'", ins.group()));
  }
  std::sort(group.begin(), group.end());
  std::vector<cpu::Tensor> tensors;
  bool onDevice = comm.deviceSums();
  for (const std::string &n : names) {
    if (onDevice) {
      tensors.push_back(grads[n]);
      continue;
    }
    auto host = be.download(grads[n]);
    if (!host)
      return host.takeError();
    // The transports sum into fresh tensors: no copy is needed here.
    tensors.push_back(std::move(*host));
  }
  // A device sum reads the accumulators on the transport's stream: the
  // compute stream must have finished writing them.
  if (onDevice)
    if (Error err = be.synchronize())
      return err;
  if (Error err = comm.sum(group, tensors))
    return err;
  for (size_t i = 0; i < names.size(); ++i) {
    auto placed = be.upload(tensors[i]);
    if (!placed)
      return placed.takeError();
    grads[names[i]] = std::move(*placed);
  }
  return Error::success();
}

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

Error RankExecutor::optimizerStep(int t) {
  const RunOptions &o = s.options;
  OptimizerUpdate u;
  u.kind = s.optimizer;
  u.lr = scheduledLr(s, t);
  lastLr = u.lr;
  u.momentum = o.momentum;
  u.weightDecay = o.weightDecay;
  u.beta1 = o.beta1;
  u.beta2 = o.beta2;
  u.epsilon = o.epsilon;
  u.gradScale = 1.0 / (static_cast<double>(s.M) * s.dp);
  u.step = t;
  if (o.clipGradNorm > 0) {
    // Every rank adds the squares of the weights it counts: a tied weight on
    // the lowest of its ranks, replicas' (identical) gradients on replica 0.
    // The backend sums where the gradients are: one number leaves a device.
    double squares[1] = {0};
    if (replica == 0) {
      std::vector<const cpu::Tensor *> counted;
      for (const std::string &name : trainableHere)
        if (auto owner = tiedOwner.find(name); owner == tiedOwner.end() || owner->second == rank)
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
  for (const std::string &name : trainableHere) {
    cpu::Tensor &g = grads[name];
    if (s.options.collectWeights) {
      auto host = be.download(g);
      if (!host)
        return host.takeError();
      cpu::Tensor scaled = host->clone();
      for (int64_t i = 0; i < scaled.numElements(); ++i)
        scaled.setDouble(i, scaled.getDouble(i) * u.gradScale);
      lastGrads[name] = std::move(scaled);
    }
    auto m = master.find(name);
    cpu::Tensor &target = m != master.end() ? m->second : weights[name];
    if (Error err = be.optimize(u, target, g, moment1[name], moment2[name]))
      return rankError(global, formatv("updating '{0}': {1}", name, toString(std::move(err))));
    if (m != master.end()) {
      int type = weights[name].elemType() == cpu::ElemType::Float16 ? onnx::TensorProto::FLOAT16
                                                                    : onnx::TensorProto::BFLOAT16;
      auto rounded = castTo(m->second, type);
      if (!rounded)
        return rounded.takeError();
      weights[name] = std::move(*rounded);
    }
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

Expected<std::map<std::string, cpu::Tensor>> RankExecutor::trainedWeights() {
  std::map<std::string, cpu::Tensor> out;
  for (const std::string &name : trainableHere) {
    auto host = be.download(weights[name]);
    if (!host)
      return host.takeError();
    out.emplace(name, std::move(*host));
  }
  return out;
}

Expected<cpu::Tensor> RankExecutor::forComm(const cpu::Tensor &t) {
  if (t.onHost())
    return t;
  if (comm.devicePointToPoint()) {
    // The receiver reads it on its own stream: the data must be complete.
    if (Error err = be.synchronize())
      return err;
    return t;
  }
  return be.download(t);
}

Error RankExecutor::step(int t, double &stepLossSum, double &stepLossCount) {
  lossSum = lossCount = 0;
  grads.clear();
  for (const std::string &name : trainableHere) {
    // Half weights accumulate their gradients in float32, like their master.
    auto zero = be.zeros(master.count(name) ? cpu::ElemType::Float : weights[name].elemType(),
                         weights[name].shape());
    if (!zero)
      return zero.takeError();
    grads[name] = std::move(*zero);
  }
  for (int i = 0; i < program.instructions_size(); ++i) {
    const Ins &ins = program.instructions(i);
    if (s.fault.rank == global && s.fault.step == t && s.fault.at == i) {
      if (s.fault.kind == "kill")
        std::raise(SIGKILL);
      return rankError(global, formatv("injected fault at step {0} instruction {1}", t, i));
    }
    int stage = ins.stage(), mb = ins.microbatch();
    bool isComm = ins.op() == Ins::SEND || ins.op() == Ins::RECV;
    bool prevComm = i > 0 && (program.instructions(i - 1).op() == Ins::SEND ||
                              program.instructions(i - 1).op() == Ins::RECV);
    if (isComm && !prevComm)
      if (Error err = comm.groupStart())
        return err;
    double started = wallNow();
    double waitedBefore = waitSeconds;
    char category = 0;
    Error err = Error::success();
    switch (ins.op()) {
    case Ins::LOAD:
      err = loadInputs(stage, mb, t);
      break;
    case Ins::FORWARD:
      category = 'F';
      err = forward(stage, mb, t, false);
      break;
    case Ins::RECOMPUTE:
      category = 'R';
      err = forward(stage, mb, t, true);
      break;
    case Ins::BACKWARD_INPUT:
      category = 'I';
      err = backwardInput(stage, mb);
      break;
    case Ins::BACKWARD_WEIGHT:
      category = 'W';
      err = backwardWeight(stage, mb);
      break;
    case Ins::BACKWARD:
      category = 'B';
      err = backwardInput(stage, mb);
      if (!err)
        err = backwardWeight(stage, mb);
      break;
    case Ins::SEND: {
      auto key = std::make_tuple(ins.grad(), stage, mb, ins.tensor().name());
      auto it = outbox.find(key);
      if (it == outbox.end()) {
        err = rankError(global, formatv("step {0}: nothing to send for '{1}' (stage {2} "
                                        "microbatch {3})",
                                        i, ins.tensor().name(), stage, mb));
        break;
      }
      auto message = forComm(it->second);
      if (!message) {
        err = message.takeError();
        break;
      }
      err = comm.send(peerGlobal(ins.peer()), *message);
      outbox.erase(it);
      break;
    }
    case Ins::RECV: {
      auto type = elemTypeOfName(ins.tensor().dtype());
      if (!type) {
        err = type.takeError();
        break;
      }
      std::vector<int64_t> shape(ins.tensor().shape().begin(), ins.tensor().shape().end());
      auto handle = comm.postRecv(peerGlobal(ins.peer()), *type, std::move(shape));
      if (!handle) {
        err = handle.takeError();
        break;
      }
      pending[{ins.grad(), stage, mb, ins.tensor().name()}] = *handle;
      break;
    }
    case Ins::ALLREDUCE:
      category = 'C';
      err = allReduce(ins);
      break;
    case Ins::OPTIMIZER_STEP:
      category = 'O';
      err = optimizerStep(t);
      break;
    case Ins::FREE:
      if (auto it = bufferOwner.find(ins.buffer()); it != bufferOwner.end())
        envs.erase(it->second);
      break;
    default:
      err = rankError(global, formatv("unknown instruction {0}", static_cast<int>(ins.op())));
    }
    if (err)
      return err;
    instructionSeconds += wallNow() - started;
    bool nextComm =
        i + 1 < program.instructions_size() && (program.instructions(i + 1).op() == Ins::SEND ||
                                                program.instructions(i + 1).op() == Ins::RECV);
    if (isComm && !nextComm)
      if (Error err = comm.groupEnd())
        return err;
    ++instructions;
    if (category) {
      // A compute first waits for its receives (traced on the comm track);
      // its own event starts when they are in.
      double waited = waitSeconds - waitedBefore;
      double begin = started + waited;
      double duration = wallNow() - started - waited;
      if (category != 'C')
        busy += duration;
      if (tracing) {
        std::string name = category == 'C'   ? "allreduce " + ins.group()
                           : category == 'O' ? std::string("optimizer")
                                             : formatv("{0}{1}{2}", stage, category, mb).str();
        events.push_back({name, category, global, begin, duration});
      }
    }
  }
  if (Error err = comm.flush())
    return err;
  if (!pending.empty())
    return rankError(global, formatv("{0} receive(s) posted but never used", pending.size()));
  envs.clear();
  outbox.clear();
  stepLossSum = lossSum;
  stepLossCount = lossCount;
  return Error::success();
}

//===--------------------------------------------------------------------===//
// Checkpoints: one file per rank, a GraphProto of tensors "w:NAME",
// "m:NAME", "v:NAME", with doc_string "step=N".
//===--------------------------------------------------------------------===//

Error RankExecutor::saveCheckpoint(StringRef file, int nextStep) {
  onnx::GraphProto g;
  g.set_name("pipec checkpoint");
  g.set_doc_string(formatv("step={0}", nextStep).str());
  auto add = [&](const cpu::Tensor &t, const std::string &name) -> Error {
    auto host = be.download(t);
    if (!host)
      return host.takeError();
    *g.add_initializer() = cpu::toTensorProto(*host, name);
    return Error::success();
  };
  for (const std::string &name : trainableHere) {
    if (Error err = add(weights.at(name), "w:" + name))
      return err;
    if (auto it = master.find(name); it != master.end())
      if (Error err = add(it->second, "p:" + name))
        return err;
    if (auto it = moment1.find(name); it != moment1.end() && !it->second.isNull())
      if (Error err = add(it->second, "m:" + name))
        return err;
    if (auto it = moment2.find(name); it != moment2.end() && !it->second.isNull())
      if (Error err = add(it->second, "v:" + name))
        return err;
  }
  std::string bytes;
  if (!g.SerializeToString(&bytes))
    return rankError(global, "checkpoint: cannot serialize (over 2 GiB?)");
  return writeFileAtomically(file, bytes);
}

Error RankExecutor::loadCheckpoint(StringRef file, int &nextStep) {
  auto buffer = MemoryBuffer::getFile(file, false, false);
  if (!buffer)
    return rankError(global, formatv("checkpoint {0}: {1}", file, buffer.getError().message()));
  onnx::GraphProto g;
  if (!g.ParseFromArray((*buffer)->getBufferStart(),
                        static_cast<int>((*buffer)->getBufferSize())) ||
      !StringRef(g.doc_string()).startswith("step="))
    return rankError(global, formatv("checkpoint {0} is not a pipec checkpoint", file));
  if (StringRef(g.doc_string()).drop_front(5).getAsInteger(10, nextStep))
    return rankError(global, formatv("checkpoint {0}: bad step", file));
  std::set<std::string> seen;
  for (const onnx::TensorProto &t : g.initializer()) {
    auto host = cpu::fromTensorProto(t);
    if (!host)
      return rankError(global, formatv("checkpoint {0}: {1}", file, toString(host.takeError())));
    auto tensor = be.upload(*host);
    if (!tensor)
      return tensor.takeError();
    StringRef name = t.name();
    std::string weight = name.drop_front(2).str();
    if (!weights.count(weight))
      return rankError(global, formatv("checkpoint {0} holds '{1}', which this rank does not own; "
                                       "was it written for another plan?",
                                       file, weight));
    if (name.startswith("w:")) {
      if (tensor->shape() != weights[weight].shape())
        return rankError(global, formatv("checkpoint {0}: '{1}' has shape {2}, the model {3}", file,
                                         weight, cpu::shapeString(tensor->shape()),
                                         cpu::shapeString(weights[weight].shape())));
      weights[weight] = std::move(*tensor);
      seen.insert(weight);
    } else if (name.startswith("p:")) {
      master[weight] = std::move(*tensor);
    } else if (name.startswith("m:")) {
      moment1[weight] = std::move(*tensor);
    } else if (name.startswith("v:")) {
      moment2[weight] = std::move(*tensor);
    }
  }
  for (const std::string &name : trainableHere)
    if (!seen.count(name))
      return rankError(global, formatv("checkpoint {0} lacks weight '{1}'", file, name));
  return Error::success();
}

std::string checkpointFile(StringRef dir, int nextStep, int global) {
  SmallString<256> path(dir);
  sys::path::append(path, formatv("step-{0}", nextStep).str(),
                    formatv("rank-{0}.ckpt", global).str());
  return std::string(path);
}

Expected<int> latestCheckpoint(StringRef dir) {
  SmallString<256> latest(dir);
  sys::path::append(latest, "latest");
  auto buffer = MemoryBuffer::getFile(latest);
  if (!buffer)
    return createStringError(inconvertibleErrorCode(), "--resume: %s: %s", latest.c_str(),
                             buffer.getError().message().c_str());
  int step = 0;
  StringRef text = (*buffer)->getBuffer().trim();
  if (!text.consume_front("step-") || text.getAsInteger(10, step))
    return createStringError(inconvertibleErrorCode(), "--resume: %s does not name a step",
                             latest.c_str());
  return step;
}

//===--------------------------------------------------------------------===//
// The run
//===--------------------------------------------------------------------===//

Expected<std::unique_ptr<Shared>> makeShared(const plan::Plan &plan, const RunOptions &options) {
  auto model = checkPlanModel(plan, options);
  if (!model)
    return model.takeError();
  auto s = std::make_unique<Shared>();
  s->plan = &plan;
  s->options = options;
  s->modelPath = *model;
  s->modelDir = sys::path::parent_path(*model).str();
  s->P = plan.schedule().stages();
  s->dp = std::max(1, plan.schedule().data_parallel());
  s->K = plan.stages_size();
  s->M = plan.schedule().microbatches();
  s->microbatchSize = std::max<int64_t>(1, plan.schedule().microbatch_size());
  s->globalBatch = s->microbatchSize * s->M * s->dp;
  s->training = plan.schedule().mode() == "train";
  s->recompute = plan.training().recompute();
  for (const plan::Stage &stage : plan.stages())
    s->rankOfStage.push_back(stage.rank());
  for (const onnx::TensorProto &w : plan.weights())
    s->weightProtos[w.name()] = &w;
  s->trainable.insert(plan.trainable().begin(), plan.trainable().end());
  std::string opt = options.optimizer.empty() ? plan.training().optimizer() : options.optimizer;
  if (opt == "adam" || opt == "adamw")
    s->optimizer = OptimizerKind::AdamW;
  else if (opt == "sgd")
    s->optimizer = OptimizerKind::Sgd;
  else if (opt == "momentum")
    s->optimizer = OptimizerKind::Momentum;
  else
    return createStringError(inconvertibleErrorCode(),
                             "--optimizer %s: expected sgd, momentum or adamw", opt.c_str());
  s->lr = options.lr > 0 ? options.lr : (s->optimizer == OptimizerKind::AdamW ? 1e-3 : 1e-2);
  if (options.lrSchedule != "constant" && options.lrSchedule != "linear" &&
      options.lrSchedule != "cosine")
    return createStringError(inconvertibleErrorCode(),
                             "--lr-schedule %s: expected constant, linear or cosine",
                             options.lrSchedule.c_str());
  auto data = DataSource::open(plan, options.dataDir, options.seed);
  if (!data)
    return data.takeError();
  s->data = std::move(*data);
  s->fault = parseFault();
  if (plan.programs_size() != s->P)
    return createStringError(inconvertibleErrorCode(), "the plan has %d programs for %d ranks",
                             plan.programs_size(), s->P);
  s->programs.assign(plan.stage_programs().begin(), plan.stage_programs().end());
  if (options.fuse)
    for (plan::StageProgram &program : s->programs) {
      FusionStats stats = fuseStageProgram(program, plan.opset(), plan.loss_value());
      s->fusion.groups += stats.groups;
      s->fusion.nodes += stats.nodes;
      s->fusion.matMulBias += stats.matMulBias;
    }
  return s;
}

/// The all-reduce groups of the run, in one order on every rank.
std::vector<std::vector<int>> sumGroups(const Shared &s) {
  std::vector<std::vector<int>> groups;
  for (int d = 0; d < s.dp; ++d)
    for (const plan::RankProgram &p : s.plan->programs())
      for (const Ins &ins : p.instructions())
        if (ins.op() == Ins::ALLREDUCE && StringRef(ins.group()).startswith("tied:")) {
          std::vector<int> g;
          for (int r : ins.ranks())
            g.push_back(d * s.P + r);
          std::sort(g.begin(), g.end());
          groups.push_back(g);
        }
  if (s.dp > 1)
    for (int r = 0; r < s.P; ++r) {
      std::vector<int> g;
      for (int d = 0; d < s.dp; ++d)
        g.push_back(d * s.P + r);
      groups.push_back(g);
    }
  std::vector<int> all;
  for (int r = 0; r < s.P * s.dp; ++r)
    all.push_back(r);
  groups.push_back(all);
  return groups;
}

std::string formatDuration(double seconds) {
  int total = static_cast<int>(std::lround(seconds));
  return formatv("{0}:{1:2}:{2:2}", total / 3600, (total / 60) % 60, total % 60).str();
}

/// One rank's whole run: load, resume, steps, checkpoints. Rank 0 prints.
Error runRank(const Shared &s, Comm &comm, RankExecutor &ex, RunResult &result) {
  if (Error err = comm.prepareGroups(sumGroups(s)))
    return err;
  if (Error err = ex.load())
    return err;
  int first = 0;
  const RunOptions &o = s.options;
  if (o.resume) {
    auto latest = latestCheckpoint(o.checkpointDir);
    if (!latest)
      return latest.takeError();
    if (Error err =
            ex.loadCheckpoint(checkpointFile(o.checkpointDir, *latest, ex.globalRank()), first))
      return err;
  }
  result.firstStep = first;
  result.fusedGroups = s.fusion.groups;
  result.fusedNodes = s.fusion.nodes;
  result.fusedMatMulBias = s.fusion.matMulBias;
  auto started = Clock::now();
  for (int t = first; t < o.steps; ++t) {
    double sum = 0, count = 0;
    if (Error err = ex.step(t, sum, count))
      return err;
    double totals[2] = {sum, count};
    if (Error err = comm.sumAll(totals))
      return err;
    double loss = totals[1] > 0 ? totals[0] / totals[1] : 0;
    if (comm.rank() == 0)
      result.losses.push_back(loss);
    if (!o.checkpointDir.empty() &&
        ((t + 1) % std::max(1, o.checkpointEvery) == 0 || t + 1 == o.steps)) {
      std::string file = checkpointFile(o.checkpointDir, t + 1, ex.globalRank());
      if (std::error_code ec = sys::fs::create_directories(sys::path::parent_path(file)))
        return rankError(ex.globalRank(), formatv("checkpoint {0}: {1}", file, ec.message()));
      if (Error err = ex.saveCheckpoint(file, t + 1))
        return err;
      double none[1] = {0};
      if (Error err = comm.sumAll(none)) // every rank's file is written
        return err;
      if (comm.rank() == 0) {
        SmallString<256> latest(o.checkpointDir);
        sys::path::append(latest, "latest");
        if (Error err = writeFileAtomically(latest, formatv("step-{0}\n", t + 1).str()))
          return err;
      }
    }
    if (comm.rank() == 0 && o.progress && o.log) {
      double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
      int done = t + 1 - first;
      double rate = elapsed > 0 ? done * s.globalBatch / elapsed : 0;
      double eta = done > 0 ? elapsed / done * (o.steps - t - 1) : 0;
      *o.log << formatv("step {0}/{1}", t + 1, o.steps);
      if (s.training)
        *o.log << formatv("  loss {0:f4}", loss);
      if (s.training && (o.lrSchedule != "constant" || o.warmup > 0))
        *o.log << formatv("  lr {0:e2}", ex.lastLr);
      if (s.training && ex.lastGradNorm >= 0)
        *o.log << formatv("  grad-norm {0:f3}", ex.lastGradNorm);
      *o.log << formatv("  {0:f1} samples/s  ETA {1}\n", rate, formatDuration(eta));
      o.log->flush();
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return Error::success();
}

Error writeTrace(StringRef path, const std::vector<TraceEvent> &events, int ranks) {
  double origin = events.empty() ? 0 : events.front().start;
  for (const TraceEvent &e : events)
    origin = std::min(origin, e.start);
  std::vector<int> all(std::max(0, ranks));
  std::iota(all.begin(), all.end(), 0);
  std::string text;
  raw_string_ostream os(text);
  printChromeTrace(os, all, events, origin);
  return writeFileAtomically(path, os.str());
}

std::string serializeEvents(const std::vector<TraceEvent> &events) {
  std::string out;
  for (const TraceEvent &e : events)
    out += formatv("{0}\t{1}\t{2}\t{3:e}\t{4:e}\n", e.rank, e.category, e.name, e.start, e.duration)
               .str();
  return out;
}

void parseEvents(StringRef text, std::vector<TraceEvent> &events) {
  SmallVector<StringRef, 0> lines;
  text.split(lines, '\n', -1, false);
  for (StringRef line : lines) {
    SmallVector<StringRef, 5> f;
    line.split(f, '\t');
    if (f.size() != 5)
      continue;
    TraceEvent e;
    f[0].getAsInteger(10, e.rank);
    e.category = f[1].empty() ? '?' : f[1][0];
    e.name = f[2].str();
    f[3].getAsDouble(e.start);
    f[4].getAsDouble(e.duration);
    events.push_back(e);
  }
}

/// Concatenates per-microbatch outputs in sample order, along each output's
/// batch axis (Plan.output_batch_axes; dimension 0 in plans without them).
/// An output without a batch dimension (axis -1, or a scalar) keeps the last
/// microbatch's value: the one of the highest-numbered samples.
Error assembleOutputs(const plan::Plan &plan,
                      const std::map<std::string, std::map<int64_t, cpu::Tensor>> &parts,
                      RunResult &result) {
  std::map<std::string, int> axes;
  for (int i = 0; i < plan.outputs_size(); ++i)
    axes[plan.outputs(i).name()] =
        i < plan.output_batch_axes_size() ? plan.output_batch_axes(i) : 0;
  for (const auto &[name, pieces] : parts) {
    if (pieces.empty())
      continue;
    auto known = axes.find(name);
    int axis = known == axes.end() ? 0 : known->second;
    const cpu::Tensor &first = pieces.begin()->second;
    if (axis < 0 || first.rank() == 0) {
      result.outputs[name] = pieces.rbegin()->second;
      continue;
    }
    std::vector<int64_t> shape = first.shape();
    for (const auto &[start, t] : pieces) {
      std::vector<int64_t> other = t.shape();
      if (axis >= first.rank() || t.rank() != first.rank() || t.elemType() != first.elemType() ||
          !std::equal(shape.begin(), shape.begin() + axis, other.begin()) ||
          !std::equal(shape.begin() + axis + 1, shape.end(), other.begin() + axis + 1))
        return createStringError(inconvertibleErrorCode(),
                                 "output '%s': microbatch pieces %s and %s do not stack along "
                                 "dimension %d",
                                 name.c_str(), first.describe().c_str(), t.describe().c_str(),
                                 axis);
    }
    shape[axis] = 0;
    for (const auto &[start, t] : pieces)
      shape[axis] += t.dim(axis);
    cpu::Tensor all(first.elemType(), shape);
    // [outer, batch, inner]: each piece fills its slice of every outer row.
    int64_t outer = cpu::numElementsOf(ArrayRef<int64_t>(shape).take_front(axis));
    size_t inner =
        static_cast<size_t>(cpu::numElementsOf(ArrayRef<int64_t>(shape).drop_front(axis + 1))) *
        cpu::storageSize(first.elemType());
    size_t outRow = static_cast<size_t>(shape[axis]) * inner, at = 0;
    for (const auto &[start, t] : pieces) {
      size_t pieceRow = static_cast<size_t>(t.dim(axis)) * inner;
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(static_cast<char *>(all.rawData()) + o * outRow + at,
                    static_cast<const char *>(t.rawData()) + o * pieceRow, pieceRow);
      at += pieceRow;
    }
    result.outputs[name] = std::move(all);
  }
  return Error::success();
}

Error writeOutputs(const RunOptions &o, const RunResult &result) {
  if (o.outputsDir.empty())
    return Error::success();
  if (std::error_code ec = sys::fs::create_directories(o.outputsDir))
    return createStringError(ec, "--outputs %s: %s", o.outputsDir.c_str(), ec.message().c_str());
  for (const auto &[name, tensor] : result.outputs) {
    SmallString<256> path(o.outputsDir);
    sys::path::append(path, safeFileName(name) + (o.outputsAsPb ? ".pb" : ".npy"));
    if (o.outputsAsPb) {
      std::string bytes;
      cpu::toTensorProto(tensor, name).SerializeToString(&bytes);
      if (Error err = writeFileAtomically(path, bytes))
        return err;
    } else if (Error err = writeNpy(tensor, path)) {
      return err;
    }
  }
  return Error::success();
}

} // namespace

Expected<std::string> checkPlanModel(const plan::Plan &plan, const RunOptions &options) {
  if (plan.stage_programs_size() == 0) {
    for (const std::string &w : plan.warnings()) {
      if (StringRef(w).startswith("the plan cannot be run"))
        return createStringError(inconvertibleErrorCode(), "%s", w.c_str());
      if (StringRef(w).startswith("no backward program yet: "))
        return createStringError(
            inconvertibleErrorCode(),
            "the plan cannot train: %s; compile with --mode infer to "
            "run it forward",
            StringRef(w).drop_front(25).split(" (the plan").first.str().c_str());
    }
    return createStringError(inconvertibleErrorCode(),
                             "the plan has no stage programs (compiled by an older pipec?)");
  }
  std::string path = options.modelPath.empty() ? plan.model().path() : options.modelPath;
  if (!sys::fs::exists(path) && options.modelPath.empty() && sys::path::is_relative(path) &&
      !options.planDir.empty()) {
    SmallString<256> beside(options.planDir);
    sys::path::append(beside, path);
    if (sys::fs::exists(beside))
      path = std::string(beside);
  }
  auto file = MemoryBuffer::getFile(path, false, false);
  if (!file)
    return createStringError(inconvertibleErrorCode(),
                             "%s: cannot read the plan's model: %s (pass --model FILE)",
                             path.c_str(), file.getError().message().c_str());
  std::string hash = sha256Hex((*file)->getBuffer());
  if (hash != plan.model().sha256())
    return createStringError(inconvertibleErrorCode(),
                             "%s: sha256 %s differs from the plan's model (%s, sha256 %s); "
                             "recompile the plan for this model",
                             path.c_str(), hash.substr(0, 12).c_str(), plan.model().path().c_str(),
                             plan.model().sha256().substr(0, 12).c_str());
  return path;
}

namespace {

/// The backend of one rank: the CPU, or CUDA device \p device.
Expected<std::unique_ptr<Backend>> makeBackend(const Shared &s, int device, int pipelineRank) {
  if (s.options.backend == "cpu")
    return makeCpuBackend();
  if (s.options.backend != "cuda")
    return createStringError(inconvertibleErrorCode(), "--backend %s: expected cpu or cuda",
                             s.options.backend.c_str());
  std::string precision =
      s.options.precision.empty() ? s.plan->training().precision() : s.options.precision;
  auto backend = makeCudaBackend(device, precision == "bf16");
  if (!backend)
    return backend.takeError();
  if (Error err = (*backend)->reserve(s.plan->ranks(pipelineRank).peak_memory_bytes()))
    return err;
  return backend;
}

} // namespace

/// Keeps freed tensor memory in the heap: a step frees and reallocates the
/// same large activations over and over, and returning them to the kernel
/// each time costs a page fault per page on the next touch.
void keepFreedMemory() {
  static bool done = false;
  if (done)
    return;
  done = true;
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

/// What the reporting process does with every rank's results: the graph
/// outputs in sample order (written with --outputs), the trained model
/// (--save-weights), the trace (--trace), the weights (collectWeights).
Error finishRun(const Shared &s,
                const std::map<std::string, std::map<int64_t, cpu::Tensor>> &outputs,
                std::map<std::string, cpu::Tensor> trained, const std::vector<TraceEvent> &events,
                RunResult &result) {
  const RunOptions &options = s.options;
  if (Error err = assembleOutputs(*s.plan, outputs, result))
    return err;
  if (Error err = writeOutputs(options, result))
    return err;
  if (!options.saveWeights.empty())
    if (Error err = saveTrainedModel(s.modelPath, trained, options.saveWeights))
      return err;
  if (!options.tracePath.empty())
    if (Error err = writeTrace(options.tracePath, events, s.P * s.dp))
      return err;
  if (options.collectWeights)
    result.weights = std::move(trained);
  return Error::success();
}

Expected<RunResult> runLocal(const plan::Plan &plan, const RunOptions &options) {
  keepFreedMemory();
  auto shared = makeShared(plan, options);
  if (!shared)
    return shared.takeError();
  Shared &s = **shared;
  int ranks = s.P * s.dp;
  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  cpu::setBlasThreads(static_cast<int>(cores) / ranks);
  LocalWorld world(ranks, options.timeoutSeconds);
  std::vector<std::unique_ptr<Comm>> comms;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<RankExecutor>> executors;
  for (int r = 0; r < ranks; ++r) {
    auto backend = makeBackend(s, r / std::max(1, options.ranksPerDevice), r % s.P);
    if (!backend)
      return backend.takeError();
    backends.push_back(std::move(*backend));
    comms.push_back(world.comm(r));
    executors.push_back(std::make_unique<RankExecutor>(s, *comms.back(), *backends.back()));
  }
  std::vector<RunResult> results(ranks);
  std::vector<std::string> errors(ranks);
  std::mutex errorMutex;
  int firstFailed = -1;
  auto body = [&](int r) {
    if (Error err = runRank(s, *comms[r], *executors[r], results[r])) {
      std::string text = toString(std::move(err));
      {
        std::lock_guard<std::mutex> lock(errorMutex);
        if (firstFailed < 0)
          firstFailed = r;
      }
      errors[r] = text;
      comms[r]->fail(text);
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < ranks; ++r)
    threads.emplace_back(body, r);
  body(0);
  for (std::thread &t : threads)
    t.join();
  if (firstFailed >= 0)
    return createStringError(inconvertibleErrorCode(), "%s", errors[firstFailed].c_str());

  RunResult result = std::move(results[0]);
  for (const auto &ex : executors) {
    result.busySeconds.push_back(ex->busy / std::max(1, options.steps - result.firstStep));
    result.instructions += ex->instructions;
    result.nodes += ex->nodesRun;
    result.kernelSeconds += ex->kernelSeconds;
    result.instructionSeconds += ex->instructionSeconds - ex->waitSeconds;
  }
  // Replica 0 holds every weight; tied copies are identical.
  std::map<std::string, std::map<int64_t, cpu::Tensor>> outputs;
  std::map<std::string, cpu::Tensor> trained;
  for (const auto &ex : executors) {
    for (const auto &[name, parts] : ex->outputs)
      outputs[name].insert(parts.begin(), parts.end());
    if (ex->replicaIndex() != 0)
      continue;
    auto weights = ex->trainedWeights();
    if (!weights)
      return weights.takeError();
    for (auto &[name, w] : *weights)
      trained.emplace(name, std::move(w));
    if (options.collectWeights)
      for (const auto &[name, g] : ex->lastGrads)
        result.gradients.emplace(name, g);
  }
  std::vector<TraceEvent> events;
  for (const auto &ex : executors)
    events.insert(events.end(), ex->events.begin(), ex->events.end());
  if (Error err = finishRun(s, outputs, std::move(trained), events, result))
    return err;
  return result;
}

Expected<RunResult> runMpi(const plan::Plan &plan, const RunOptions &options) {
  keepFreedMemory();
  auto comm = makeMpiComm(options.timeoutSeconds);
  if (!comm)
    return comm.takeError();
  auto shared = makeShared(plan, options);
  if (!shared) {
    Error err = shared.takeError();
    std::string text = toString(std::move(err));
    (*comm)->fail(text);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  }
  Shared &s = **shared;
  if ((*comm)->size() != s.P * s.dp) {
    std::string text = formatv("the plan has {0} pipeline ranks x {1} replicas = {2} ranks; "
                               "mpirun started {3} (use mpirun -np {2})",
                               s.P, s.dp, s.P * s.dp, (*comm)->size())
                           .str();
    if ((*comm)->rank() == 0)
      (*comm)->fail(text);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  }
  // Processes on one node share its cores.
  if (const char *local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) {
    int perNode = std::max(1, std::atoi(local));
    unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    cpu::setBlasThreads(static_cast<int>(cores) / perNode);
  }
  int localRank = 0;
  if (const char *lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"))
    localRank = std::atoi(lr);
  else if (const char *lr = std::getenv("SLURM_LOCALID"))
    localRank = std::atoi(lr);
  auto backend =
      makeBackend(s, localRank / std::max(1, options.ranksPerDevice), (*comm)->rank() % s.P);
  if (!backend) {
    std::string text = toString(backend.takeError());
    (*comm)->fail(text);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  }
  std::unique_ptr<Comm> transport = std::move(*comm);
  if (options.comm == "nccl") {
    auto nccl = makeNcclComm(std::move(transport), localRank / std::max(1, options.ranksPerDevice),
                             options.timeoutSeconds);
    if (!nccl)
      return nccl.takeError();
    transport = std::move(*nccl);
  }
  comm = std::move(transport);
  RankExecutor ex(s, **comm, **backend);
  RunResult result;
  result.primary = (*comm)->rank() == 0;
  auto fail = [&](Error err) -> Error {
    std::string text = toString(std::move(err));
    (*comm)->fail(text);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  };
  if (Error err = runRank(s, **comm, ex, result))
    return fail(std::move(err));
  result.instructions = ex.instructions;
  result.busySeconds = {ex.busy / std::max(1, options.steps - result.firstStep)};
  // Inference outputs and trained weights go to rank 0.
  bool wantWeights = !options.saveWeights.empty() || options.collectWeights;
  onnx::GraphProto mine;
  if (wantWeights && ex.replicaIndex() == 0) {
    auto weights = ex.trainedWeights();
    if (!weights)
      return fail(weights.takeError());
    for (const auto &[name, w] : *weights)
      *mine.add_initializer() = cpu::toTensorProto(w, name);
  }
  for (const auto &[name, parts] : ex.outputs)
    for (const auto &[start, t] : parts) {
      onnx::TensorProto p = cpu::toTensorProto(t, name);
      p.set_doc_string(std::to_string(start));
      *mine.add_initializer() = std::move(p);
    }
  if (!options.tracePath.empty())
    mine.set_doc_string(serializeEvents(ex.events));
  std::string bytes;
  mine.SerializeToString(&bytes);
  auto all = (*comm)->gather(bytes);
  if (!all)
    return fail(all.takeError());
  if ((*comm)->rank() != 0)
    return result;
  std::map<std::string, cpu::Tensor> trained;
  std::map<std::string, std::map<int64_t, cpu::Tensor>> outputs;
  std::vector<TraceEvent> events;
  for (const std::string &b : *all) {
    onnx::GraphProto g;
    if (!g.ParseFromString(b))
      return fail(rankError(0, "a rank's results did not parse"));
    parseEvents(g.doc_string(), events);
    for (const onnx::TensorProto &t : g.initializer()) {
      auto tensor = cpu::fromTensorProto(t);
      if (!tensor)
        return fail(tensor.takeError());
      if (!t.doc_string().empty()) {
        int64_t start = 0;
        StringRef(t.doc_string()).getAsInteger(10, start);
        outputs[t.name()][start] = std::move(*tensor);
      } else {
        trained.emplace(t.name(), std::move(*tensor));
      }
    }
  }
  if (Error err = finishRun(s, outputs, std::move(trained), events, result))
    return fail(std::move(err));
  return result;
}

} // namespace pipec::rt
