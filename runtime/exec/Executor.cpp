//===- Executor.cpp - One rank's instruction stream ----------------------===//
//
// RankExecutor (RankExecutor.h) loads a rank's weights and runs its
// instructions (Executor.h lists them) for one step at a time: the stage
// programs' nodes on the backend, boundary tensors handed over locally or
// posted on the Comm, gradients accumulated and all-reduced.
//
//===----------------------------------------------------------------------===//
#include "plan/PlanFile.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/TensorShards.h"

#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <csignal>
#include <cstdlib>

using namespace llvm;

namespace pipec::rt {

namespace {

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace

Error rankError(int rank, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "rank %d: %s", rank, why.str().c_str());
}

Fault parseFault(StringRef text) {
  Fault f;
  SmallVector<StringRef, 4> parts;
  text.split(parts, ',', -1, false);
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

Error RankExecutor::load(const std::map<std::string, cpu::Tensor> *reuse) {
  std::set<std::string> names;
  for (const plan::Stage &stage : s.plan->stages())
    if (stage.rank() == rank)
      for (const std::string &w : stageProgram(stage.index()).weights())
        names.insert(w);
  for (const std::string &name : names) {
    if (reuse && !s.trainable.count(name))
      if (auto shared = reuse->find(name); shared != reuse->end()) {
        weights[name] = shared->second;
        continue;
      }
    auto it = s.weightProtos.find(name);
    if (it == s.weightProtos.end())
      return rankError(global, formatv("the plan lists no weight '{0}'", name));
    auto init = s.initWeights.find(name);
    auto tensor = init != s.initWeights.end() ? Expected<cpu::Tensor>(init->second.clone())
                                              : cpu::fromTensorProto(*it->second, s.modelDir);
    if (!tensor)
      return rankError(global, "loading weights: " + toString(tensor.takeError()));
    if (auto shard = s.shards.find(name); shard != s.shards.end()) {
      auto piece = shardPiece(*tensor, *shard->second, tp);
      if (!piece)
        return rankError(global,
                         formatv("loading weight '{0}': {1}", name, toString(piece.takeError())));
      tensor = std::move(*piece);
    }
    bool half = tensor->elemType() == cpu::DType::F16 || tensor->elemType() == cpu::DType::BF16;
    if (s.trainable.count(name)) {
      if (tensor->elemType() != cpu::DType::F32 && tensor->elemType() != cpu::DType::F64 && !half)
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
      if (s.shardOptimizer) {
        // Sharded: the master of this replica's shard alone.
        int64_t shard = ceilDiv(tensor->numElements(), s.dp);
        copy = be.slice(*copy, replica * shard, shard);
        if (!copy)
          return copy.takeError();
      }
      master[name] = std::move(*copy);
    }
    weights[name] = std::move(*placed);
  }
  for (const plan::Buffer &b : program.buffers())
    if (b.alloc_at() >= 0 && b.alloc_at() < program.instructions_size() &&
        program.instructions(b.alloc_at()).op() == Ins::FORWARD)
      bufferOwner[b.index()] = {b.stage(), b.microbatch()};
  for (const Ins &ins : program.instructions())
    if (ins.op() == Ins::ALLREDUCE && ins.reduce() == Ins::TIED_WEIGHT && ins.ranks_size() > 0)
      tiedOwner[ins.tied_weight()] = *std::min_element(ins.ranks().begin(), ins.ranks().end());
  for (int k = 0; k < s.K; ++k) {
    if (!local(k))
      continue;
    const plan::StageProgram &sp = stageProgram(k);
    for (const plan::RunningStat &r : sp.running_stats()) {
      auto w = weights.find(r.buffer());
      if (w == weights.end() || !cpu::isFloating(w->second.elemType()))
        return rankError(global, formatv("stage {0}: running statistic '{1}' is not a float "
                                         "weight the stage reads",
                                         k, r.buffer()));
      if (!runningHere.emplace(r.buffer(), r.momentum()).second || s.trainable.count(r.buffer()))
        return rankError(global,
                         formatv("stage {0}: '{1}' is updated twice in a step", k, r.buffer()));
    }
    keepSets[k] = std::set<std::string>(sp.keep().begin(), sp.keep().end());
    if (sp.recompute_size() > 0)
      keptWhenRecomputing[k] = std::set<std::string>(sp.keep_when_recomputing().begin(),
                                                     sp.keep_when_recomputing().end());
    if (Error err = runLoadNodes(k, /*inStep=*/false))
      return err;
  }
  return Error::success();
}

Error RankExecutor::runLoadNodes(int stage, bool inStep) {
  // The plan's fold-weights pass chose them: nodes of weights alone.
  for (const onnx::NodeProto &node : stageProgram(stage).load_nodes()) {
    std::vector<const cpu::Tensor *> inputs;
    for (const std::string &name : node.input()) {
      auto w = name.empty() ? weights.end() : weights.find(name);
      if (!name.empty() && w == weights.end())
        return rankError(global, formatv("stage {0}: load node '{1}' ({2}) reads '{3}', which "
                                         "is no weight",
                                         stage, cpu::nodeLabel(node), node.op_type(), name));
      inputs.push_back(name.empty() ? nullptr : &w->second);
    }
    auto started = Clock::now();
    auto outs = be.run(node, s.plan->opset(), inputs);
    if (!outs)
      return rankError(global,
                       formatv("stage {0}: folding node '{1}' ({2}) of weights: {3}", stage,
                               cpu::nodeLabel(node), node.op_type(), toString(outs.takeError())));
    if (inStep) {
      double seconds = std::chrono::duration<double>(Clock::now() - started).count();
      kernelSeconds += seconds;
      ++nodesRun;
      if (profile)
        profile->node(node, inputs, *outs, seconds);
    }
    for (int o = 0; o < node.output_size() && o < static_cast<int>(outs->size()); ++o)
      if (!node.output(o).empty())
        weights[node.output(o)] = std::move((*outs)[o]);
  }
  return Error::success();
}

Error RankExecutor::runForward(int stage, Env &values) {
  return runNodes(stageProgram(stage).forward(), values, stage, 0, "forward",
                  &dropsFor(stage, NodeListKind::Forward));
}

const std::vector<PreparedNode> &
RankExecutor::prepare(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                      const std::vector<std::vector<std::string>> *dropAfter) {
  auto [it, added] = preparedLists.try_emplace({&nodes, dropAfter});
  PreparedList &list = it->second;
  if (!added)
    return list.nodes();
  std::vector<int> inputs, outputs, drops;
  std::vector<const cpu::Tensor *> nodeWeights;
  for (int index = 0; index < nodes.size(); ++index) {
    const onnx::NodeProto &node = nodes.Get(index);
    const OpDef *def = lookupOp(node.domain(), node.op_type(), s.plan->opset());
    inputs.clear(), outputs.clear(), drops.clear(), nodeWeights.clear();
    for (const std::string &name : node.input()) {
      inputs.push_back(name.empty() ? -1 : names.slotOf(name));
      auto w = name.empty() ? weights.end() : weights.find(name);
      nodeWeights.push_back(w == weights.end() ? nullptr : &w->second);
    }
    for (const std::string &name : node.output())
      outputs.push_back(name.empty() ? -1 : names.slotOf(name));
    if (dropAfter)
      for (const std::string &name : (*dropAfter)[index])
        drops.push_back(names.slotOf(name));
    bool runs = def && (def->hasCpuKernel || def->has(Collective));
    list.add(node, runs ? def : nullptr, inputs, nodeWeights, outputs, drops);
  }
  list.seal();
  return list.nodes();
}

Error RankExecutor::runNodes(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                             Env &values, int stage, int mb, StringRef phase,
                             const std::vector<std::vector<std::string>> *dropAfter,
                             function_ref<Error(int)> afterNode,
                             function_ref<Expected<bool>(int, NodeInputs)> instead) {
  const std::vector<PreparedNode> &prepared = prepare(nodes, dropAfter);
  std::vector<const cpu::Tensor *> inputs;
  int index = -1;
  auto dropAfterLast = llvm::make_scope_exit([&] {
    if (index >= 0)
      for (int slot : prepared[index].drops)
        values.clear(slot);
  });
  // One clock read per node: each node's time runs from the end of the one
  // before, its dispatch included.
  auto last = Clock::now();
  auto lap = [&](const onnx::NodeProto &node, ArrayRef<cpu::Tensor> outputs) {
    auto now = Clock::now();
    double seconds = std::chrono::duration<double>(now - last).count();
    kernelSeconds += seconds;
    last = now;
    ++nodesRun;
    if (profile)
      profile->node(node, inputs, outputs, seconds);
  };
  for (const PreparedNode &p : prepared) {
    ++index;
    if (index > 0)
      for (int slot : prepared[index - 1].drops)
        values.clear(slot);
    const onnx::NodeProto &node = *p.node;
    inputs.clear();
    for (size_t i = 0; i < p.inputs.size(); ++i) {
      if (p.inputs[i] < 0) {
        inputs.push_back(nullptr);
        continue;
      }
      if (const cpu::Tensor *t = values.at(p.inputs[i])) {
        inputs.push_back(t);
        continue;
      }
      const cpu::Tensor *w = p.weights[i];
      if (!w) {
        auto found = weights.find(node.input(static_cast<int>(i)));
        if (found == weights.end())
          return rankError(global, formatv("stage {0} microbatch {1} {2}: node '{3}' ({4}) reads "
                                           "'{5}', which is missing",
                                           stage, mb, phase, cpu::nodeLabel(node), node.op_type(),
                                           node.input(static_cast<int>(i))));
        w = &found->second;
      }
      inputs.push_back(w);
    }
    // Over the stage's tensor-parallel ranks: the executor, which holds
    // their Comm, runs it in the backend's place.
    bool collective = p.def && p.def->has(Collective) && !p.def->hasCpuKernel;
    if (instead && !collective) {
      Expected<bool> done = instead(index, inputs);
      if (!done)
        return done.takeError();
      if (*done) {
        lap(node, {});
        continue;
      }
    }
    auto outs = [&]() -> Expected<std::vector<cpu::Tensor>> {
      try {
        if (collective)
          return runCollective(node, *p.def, inputs);
        return be.run(node, p.def, p.attrs, s.plan->opset(), inputs);
      } catch (const cpu::AllocationFailure &failure) {
        return createStringError(inconvertibleErrorCode(),
                                 "'%s' needs %lld bytes (%s, made by %s node '%s'); out of memory",
                                 node.output_size() ? node.output(0).c_str() : "",
                                 static_cast<long long>(failure.bytes), failure.shape.c_str(),
                                 node.op_type().c_str(), cpu::nodeLabel(node).c_str());
      }
    }();
    lap(node, outs ? ArrayRef<cpu::Tensor>(*outs) : ArrayRef<cpu::Tensor>());
    if (!outs)
      return rankError(global, formatv("stage {0} microbatch {1} {2}: {3}", stage, mb, phase,
                                       toString(outs.takeError())));
    for (size_t o = 0; o < p.outputs.size() && o < outs->size(); ++o)
      if (p.outputs[o] >= 0)
        values.put(p.outputs[o]) = std::move((*outs)[o]);
    if (afterNode) {
      if (Error err = afterNode(index))
        return err;
      last = Clock::now(); // its work (adding gradient terms) is not the next node's
    }
  }
  return Error::success();
}

Error RankExecutor::loadInputs(int stage, int mb, int t) {
  Env &values = env(stage, mb);
  for (const std::string &name : stageProgram(stage).loads()) {
    if (values.count(name))
      continue;
    auto tensor =
        (evaluating ? s.evalData : s.data)->microbatch(name, firstSample(s, t, replica, mb));
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
      env(stageField, mb)[receivedGradName(name)] = std::move(*tensor);
    else
      env(stageField + 1, mb)[name] = std::move(*tensor);
    it = pending.erase(it);
  }
  return Error::success();
}

void RankExecutor::prune(Env &values, const std::set<std::string> &keep) {
  // Gradients already handed over by the next stage on this rank (ZB-V and
  // DualPipeV run it before a RECOMPUTE here) are backward's inputs too.
  values.clearIf(
      [&](const std::string &name) { return !keep.count(name) && !isReceivedGradName(name); });
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
  if (again) {
    // The values FORWARD dropped, rebuilt from those it kept.
    if (sp.rerun_size() > 0)
      if (Error err = runNodes(sp.rerun(), values, stage, mb, "recompute"))
        return err;
    prune(values, keepSets[stage]);
    return Error::success();
  }
  for (const std::string &name : sp.recv())
    if (!values.count(name))
      return rankError(global, formatv("stage {0} microbatch {1}: boundary tensor '{2}' never "
                                       "arrived",
                                       stage, mb, name));
  if (Error err = runNodes(sp.forward(), values, stage, mb, "forward",
                           &dropsFor(stage, NodeListKind::Forward)))
    return err;
  bool last = stage + 1 == s.K;
  if (last && s.training) {
    const cpu::Tensor *loss = values.find(s.plan->loss_value());
    if (!loss || loss->numElements() != 1)
      return rankError(global, formatv("stage {0} microbatch {1}: no scalar loss '{2}'", stage, mb,
                                       s.plan->loss_value()));
    cpu::Tensor count;
    if (const std::string &name = s.plan->loss_count_value(); !name.empty()) {
      const cpu::Tensor *counted = values.find(name);
      if (!counted || counted->numElements() != 1)
        return rankError(global, formatv("stage {0} microbatch {1}: no scalar label count '{2}'",
                                         stage, mb, name));
      count = *counted;
    }
    // The tensor-parallel ranks compute one loss: the first counts it.
    if (tp == 0)
      pendingLosses.push_back({*loss, std::move(count), t, mb});
  }
  if (!s.training && s.options.keepOutputs && tp == 0)
    for (const std::string &name : sp.outputs())
      if (const cpu::Tensor *out = values.find(name)) {
        auto host = be.download(*out);
        if (!host)
          return host.takeError();
        outputs[name][firstSample(s, t, replica, mb)] = std::move(*host);
      }
  for (const std::string &name : sp.send()) {
    const cpu::Tensor *sent = values.find(name);
    if (!sent)
      return rankError(global, formatv("stage {0} microbatch {1}: '{2}' to send was not computed",
                                       stage, mb, name));
    if (local(stage + 1))
      env(stage + 1, mb)[name] = *sent;
    else
      outbox[{false, stage, mb, name}] = *sent;
  }
  if (s.training) {
    auto kept = keptWhenRecomputing.find(stage);
    prune(values, kept != keptWhenRecomputing.end() ? kept->second : keepSets[stage]);
  }
  return Error::success();
}

Expected<const cpu::Tensor *> RankExecutor::gradientTerm(const Env &values, const std::string &term,
                                                         StringRef kind, const std::string &value,
                                                         int stage, int mb) {
  const cpu::Tensor *found = values.find(term);
  if (!found)
    return rankError(global,
                     formatv("stage {0} microbatch {1}: gradient term '{2}' of {3}'{4}' was not "
                             "computed",
                             stage, mb, term, kind, value));
  return found;
}

Error RankExecutor::backwardInput(int stage, int mb) {
  const plan::StageProgram &sp = stageProgram(stage);
  if (Error err = collect(true, stage, mb))
    return err;
  Env &values = env(stage, mb);
  if (Error err = runNodes(sp.backward_input(), values, stage, mb, "backward-input",
                           &dropsFor(stage, NodeListKind::BackwardInput)))
    return err;
  for (const plan::GradSum &g : sp.input_grads()) {
    std::vector<const cpu::Tensor *> terms;
    for (const std::string &term : g.terms()) {
      Expected<const cpu::Tensor *> t = gradientTerm(values, term, "", g.value(), stage, mb);
      if (!t)
        return t.takeError();
      if (!terms.empty() && (*t)->shape() != terms[0]->shape())
        return rankError(global, formatv("stage {0}: gradient terms of '{1}' differ in shape",
                                         stage, g.value()));
      terms.push_back(*t);
    }
    const cpu::Tensor *v = values.find(g.value());
    if (terms.empty() && !v)
      return rankError(global, formatv("stage {0}: no value '{1}' to shape its zero gradient",
                                       stage, g.value()));
    Expected<cpu::Tensor> made =
        terms.empty() ? be.zeros(v->elemType(), v->shape()) : be.sum(terms);
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
  const AddSchedule &adds = addsFor(stage);
  // A node whose output is a term nothing else in the list reads adds into
  // an accumulator that already holds a term, where the backend can, without
  // making the term (a weight gradient's GEMM with beta = 1).
  std::set<std::string> addedInPlace;
  auto intoAccumulator = [&](int index, NodeInputs inputs) -> Expected<bool> {
    const onnx::NodeProto &node = sp.backward_weight(index);
    auto found = adds.find(index);
    if (node.output_size() != 1 || found == adds.end())
      return false;
    for (const auto &[weight, term] : found->second) {
      cpu::Tensor &acc = grads.at(weight);
      if (term != node.output(0) || acc.isNull())
        continue;
      Expected<bool> done = be.runInto(node, s.plan->opset(), inputs, acc);
      if (!done)
        return rankError(global, formatv("stage {0}: accumulating '{1}': {2}", stage, term,
                                         toString(done.takeError())));
      if (*done)
        addedInPlace.insert(term);
      return *done;
    }
    return false;
  };
  auto addTerms = [&](int index) -> Error {
    auto found = adds.find(index);
    if (found == adds.end())
      return Error::success();
    for (const auto &[weight, term] : found->second) {
      if (addedInPlace.count(term))
        continue;
      Expected<const cpu::Tensor *> t = gradientTerm(values, term, "weight ", weight, stage, mb);
      if (!t)
        return t.takeError();
      // Element types are the backend's to reconcile (a float32 accumulator
      // takes float16 terms).
      const cpu::Tensor &w = weights.at(weight);
      if ((*t)->numElements() != w.numElements())
        return rankError(global, formatv("stage {0}: gradient '{1}' is {2}, weight '{3}' is {4}",
                                         stage, term, (*t)->describe(), weight, w.describe()));
      if (Error err = accumulate(grads.at(weight), weight, values, term, **t))
        return rankError(global, formatv("stage {0}: accumulating '{1}': {2}", stage, term,
                                         toString(std::move(err))));
      values.erase(term);
    }
    return Error::success();
  };
  if (Error err = addTerms(-1))
    return err;
  if (Error err =
          runNodes(sp.backward_weight(), values, stage, mb, "backward-weight",
                   &dropsFor(stage, NodeListKind::BackwardWeight), addTerms, intoAccumulator))
    return err;
  for (const plan::RunningStat &r : sp.running_stats()) {
    cpu::Tensor &acc = statisticSums[r.buffer()];
    Expected<const cpu::Tensor *> t =
        gradientTerm(values, r.statistic(), "running statistic ", r.buffer(), stage, mb);
    if (!t)
      return t.takeError();
    if ((*t)->numElements() != acc.numElements())
      return rankError(global,
                       formatv("stage {0}: statistic '{1}' is {2}, buffer '{3}' is {4}", stage,
                               r.statistic(), (*t)->describe(), r.buffer(), acc.describe()));
    if (Error err = be.addInto(acc, **t))
      return rankError(global, formatv("stage {0}: accumulating '{1}': {2}", stage, r.statistic(),
                                       toString(std::move(err))));
  }
  return Error::success();
}

std::vector<int> RankExecutor::replicaGroup() const {
  std::vector<int> group;
  for (int d = 0; d < s.dp; ++d)
    group.push_back(s.grid.global(d, rank, tp));
  return group;
}

int64_t RankExecutor::shardElements(const std::string &name) const {
  return ceilDiv(weights.at(name).numElements(), s.dp);
}

Error RankExecutor::allReduce(const Ins &ins) {
  if (Error err = fillUnsetGradients())
    return err;
  std::vector<int> group;
  // The sums to reduce: gradients, and with the replicas' group the running
  // statistics too.
  std::vector<cpu::Tensor *> sums;
  if (ins.reduce() == Ins::DATA_PARALLEL) {
    group = replicaGroup();
    for (const std::string &n : trainableHere)
      sums.push_back(&grads[n]);
    for (auto &entry : statisticSums)
      sums.push_back(&entry.second);
  } else if (ins.reduce() == Ins::TIED_WEIGHT) {
    for (int r : ins.ranks())
      group.push_back(peerGlobal(r));
    if (grads.count(ins.tied_weight()))
      sums.push_back(&grads[ins.tied_weight()]);
  } else {
    return rankError(global, formatv("unknown all-reduce group '{0}'", ins.group()));
  }
  std::sort(group.begin(), group.end());
  return sumOver(group, sums);
}

Error RankExecutor::sumOver(const std::vector<int> &group, const std::vector<cpu::Tensor *> &sums) {
  std::vector<cpu::Tensor> tensors;
  bool onDevice = comm.deviceSums();
  for (cpu::Tensor *sum : sums) {
    if (onDevice) {
      tensors.push_back(*sum);
      continue;
    }
    auto host = be.download(*sum);
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
  for (size_t i = 0; i < sums.size(); ++i) {
    auto placed = be.upload(tensors[i]);
    if (!placed)
      return placed.takeError();
    *sums[i] = std::move(*placed);
  }
  return Error::success();
}

Error RankExecutor::overReplicas(std::vector<cpu::Tensor> &tensors,
                                 Error (Comm::*collective)(ArrayRef<int>,
                                                           MutableArrayRef<cpu::Tensor>)) {
  bool onDevice = comm.deviceSums();
  if (!onDevice)
    for (cpu::Tensor &t : tensors) {
      auto host = be.download(t);
      if (!host)
        return host.takeError();
      t = std::move(*host);
    }
  // A device collective reads on the transport's stream: the compute stream
  // must have finished writing.
  if (onDevice)
    if (Error err = be.synchronize())
      return err;
  if (Error err = (comm.*collective)(replicaGroup(), tensors))
    return err;
  for (cpu::Tensor &t : tensors) {
    auto placed = be.upload(t);
    if (!placed)
      return placed.takeError();
    t = std::move(*placed);
  }
  return Error::success();
}

Error RankExecutor::reduceScatter(const Ins &ins) {
  if (ins.reduce() != Ins::DATA_PARALLEL || !s.shardOptimizer)
    return rankError(global, formatv("a reduce-scatter of group '{0}' in a run whose optimizer is "
                                     "not sharded over replicas",
                                     ins.group()));
  if (Error err = fillUnsetGradients())
    return err;
  // Each gradient, flat and padded to whole shards; every replica keeps the
  // sum of its own.
  std::vector<cpu::Tensor> padded;
  for (const std::string &name : trainableHere) {
    auto flat = be.slice(grads[name], 0, shardElements(name) * s.dp);
    if (!flat)
      return flat.takeError();
    padded.push_back(std::move(*flat));
  }
  if (Error err = overReplicas(padded, &Comm::reduceScatter))
    return err;
  for (size_t i = 0; i < trainableHere.size(); ++i)
    grads[trainableHere[i]] = std::move(padded[i]);
  // The running statistics are small: summed whole, as without sharding.
  std::vector<cpu::Tensor *> statistics;
  for (auto &entry : statisticSums)
    statistics.push_back(&entry.second);
  return sumOver(replicaGroup(), statistics);
}

Error RankExecutor::allGather(const Ins &ins) {
  if (ins.reduce() != Ins::DATA_PARALLEL || !s.shardOptimizer)
    return rankError(global, formatv("an all-gather of group '{0}' in a run whose optimizer is "
                                     "not sharded over replicas",
                                     ins.group()));
  std::vector<cpu::Tensor> shards;
  for (const std::string &name : trainableHere) {
    auto it = updatedShards.find(name);
    if (it == updatedShards.end())
      return rankError(global, formatv("ALL_GATHER before the optimizer step updated '{0}'", name));
    shards.push_back(std::move(it->second));
  }
  updatedShards.clear();
  if (Error err = overReplicas(shards, &Comm::allGather))
    return err;
  for (size_t i = 0; i < trainableHere.size(); ++i) {
    cpu::Tensor &w = weights[trainableHere[i]];
    auto whole = be.slice(shards[i], 0, w.numElements());
    if (!whole)
      return whole.takeError();
    w = whole->reshaped(w.shape());
  }
  return Error::success();
}

Expected<std::map<std::string, cpu::Tensor>> RankExecutor::trainedWeights() {
  std::map<std::string, cpu::Tensor> out;
  for (const std::string &name : trainableHere) {
    if (auto joined = joinedWeights.find(name); joined != joinedWeights.end()) {
      out.emplace(name, joined->second);
      continue;
    }
    auto host = be.download(weights[name]);
    if (!host)
      return host.takeError();
    out.emplace(name, std::move(*host));
  }
  for (const auto &entry : runningHere) {
    auto host = be.download(weights[entry.first]);
    if (!host)
      return host.takeError();
    out.emplace(entry.first, std::move(*host));
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

Error RankExecutor::zeroAccumulators() {
  grads.clear();
  for (const std::string &name : trainableHere)
    grads[name] = cpu::Tensor();
  statisticSums.clear();
  for (const auto &entry : runningHere) {
    const cpu::Tensor &buffer = weights[entry.first];
    bool half = buffer.elemType() == cpu::DType::F16 || buffer.elemType() == cpu::DType::BF16;
    auto zero = be.zeros(half ? cpu::DType::F32 : buffer.elemType(), buffer.shape());
    if (!zero)
      return zero.takeError();
    statisticSums[entry.first] = std::move(*zero);
  }
  return Error::success();
}

Error RankExecutor::fillUnsetGradients() {
  for (auto &[name, acc] : grads) {
    if (!acc.isNull())
      continue;
    // Half weights accumulate their gradients in float32, like their master.
    const cpu::Tensor &w = weights.at(name);
    auto zero = be.zeros(master.count(name) ? cpu::DType::F32 : w.elemType(), w.shape());
    if (!zero)
      return zero.takeError();
    acc = std::move(*zero);
  }
  return Error::success();
}

Error RankExecutor::accumulate(cpu::Tensor &acc, const std::string &weight, Env &values,
                               const std::string &name, const cpu::Tensor &term) {
  if (acc.isNull()) {
    const cpu::Tensor &w = weights.at(weight);
    cpu::DType type = master.count(weight) ? cpu::DType::F32 : w.elemType();
    cpu::Tensor *held = values.find(name);
    if (term.elemType() == type && term.device() == w.device() && held == &term &&
        term.numElements() == w.numElements()) {
      cpu::Tensor taken = std::move(*held);
      values.erase(name);
      if (taken.ownsBuffer()) {
        acc = taken.reshaped(w.shape());
        return Error::success();
      }
      auto zero = be.zeros(type, w.shape());
      if (!zero)
        return zero.takeError();
      acc = std::move(*zero);
      return be.addInto(acc, taken);
    }
    auto zero = be.zeros(type, w.shape());
    if (!zero)
      return zero.takeError();
    acc = std::move(*zero);
  }
  return be.addInto(acc, term);
}

Error RankExecutor::send(const Ins &ins, int i) {
  auto key = std::make_tuple(ins.grad(), ins.stage(), ins.microbatch(), ins.tensor().name());
  auto it = outbox.find(key);
  if (it == outbox.end())
    return rankError(global, formatv("step {0}: nothing to send for '{1}' (stage {2} "
                                     "microbatch {3})",
                                     i, ins.tensor().name(), ins.stage(), ins.microbatch()));
  auto message = forComm(it->second);
  if (!message)
    return message.takeError();
  Error err = comm.send(peerGlobal(ins.peer()), *message);
  outbox.erase(it);
  return err;
}

Error RankExecutor::postRecv(const Ins &ins) {
  auto type = elemTypeOfName(ins.tensor().dtype());
  if (!type)
    return type.takeError();
  std::vector<int64_t> shape(ins.tensor().shape().begin(), ins.tensor().shape().end());
  auto handle = comm.postRecv(peerGlobal(ins.peer()), *type, std::move(shape));
  if (!handle)
    return handle.takeError();
  pending[{ins.grad(), ins.stage(), ins.microbatch(), ins.tensor().name()}] = *handle;
  return Error::success();
}

Error RankExecutor::execute(const Ins &ins, int i, int t, char &category) {
  int stage = ins.stage(), mb = ins.microbatch();
  category = 0;
  switch (ins.op()) {
  case Ins::LOAD:
    return loadInputs(stage, mb, t);
  case Ins::FORWARD:
    category = 'F';
    return forward(stage, mb, t, false);
  case Ins::RECOMPUTE:
    category = 'R';
    return forward(stage, mb, t, true);
  case Ins::BACKWARD_INPUT:
    category = 'I';
    return backwardInput(stage, mb);
  case Ins::BACKWARD_WEIGHT:
    category = 'W';
    return backwardWeight(stage, mb);
  case Ins::BACKWARD:
    category = 'B';
    if (Error err = backwardInput(stage, mb))
      return err;
    return backwardWeight(stage, mb);
  case Ins::SEND:
    return send(ins, i);
  case Ins::RECV:
    return postRecv(ins);
  case Ins::ALLREDUCE:
    category = 'C';
    return allReduce(ins);
  case Ins::OPTIMIZER_STEP:
    category = 'O';
    return optimizerStep(t);
  case Ins::REDUCE_SCATTER:
    category = 'C';
    return reduceScatter(ins);
  case Ins::ALL_GATHER:
    category = 'C';
    return allGather(ins);
  case Ins::FREE:
    if (auto it = bufferOwner.find(ins.buffer()); it != bufferOwner.end())
      if (auto owner = envs.find(it->second); owner != envs.end())
        owner->second.reset();
    return Error::success();
  default:
    return rankError(global, formatv("unknown instruction {0}", static_cast<int>(ins.op())));
  }
}

void RankExecutor::record(const Ins &ins, char category, double started, double waited) {
  // A compute first waits for its receives (traced on the comm track); its
  // own event starts when they are in.
  double begin = started + waited;
  double duration = wallNow() - started - waited;
  if (category != 'C')
    busy += duration;
  if (!tracing)
    return;
  std::string name = category == 'C' ? std::string(collectiveOf(ins.op())->name) + " " + ins.group()
                     : category == 'O'
                         ? std::string("optimizer")
                         : formatv("{0}{1}{2}", ins.stage(), category, ins.microbatch()).str();
  events.push_back({name, category, global, begin, duration});
}

Error RankExecutor::settleLosses() {
  if (pendingLosses.empty())
    return Error::success();
  std::vector<const cpu::Tensor *> read;
  for (const PendingLoss &p : pendingLosses) {
    read.push_back(&p.loss);
    if (!p.count.isNull())
      read.push_back(&p.count);
  }
  auto host = be.downloadAll(read);
  if (!host)
    return host.takeError();
  size_t next = 0;
  for (const PendingLoss &p : pendingLosses) {
    double loss = (*host)[next++].getDouble(0);
    // A token-mean loss weighs each microbatch by the labels it counts; one
    // that counts none adds nothing (its mean is 0/0).
    double count = !p.count.isNull() ? (*host)[next++].getDouble(0) : 1;
    // A NaN or infinite loss would poison every weight at the optimizer
    // step: the run stops here, before any rank updates or saves.
    if (!std::isfinite(loss) && count > 0) {
      pendingLosses.clear();
      return rankError(global,
                       formatv("step {0} microbatch {1}: the loss is {2}; stopped before "
                               "the optimizer step, nothing saved",
                               p.step + 1, p.microbatch, std::isnan(loss) ? "NaN" : "infinite"));
    }
    if (count > 0)
      lossSum += loss * count;
    lossCount += count;
  }
  pendingLosses.clear();
  return Error::success();
}

Error RankExecutor::step(int t, double &stepLossSum, double &stepLossCount) {
  lossSum = lossCount = 0;
  pendingLosses.clear();
  if (Error err = zeroAccumulators())
    return err;
  if (Error err = runStream(program.instructions(), t))
    return err;
  if (Error err = settleLosses())
    return err;
  stepLossSum = lossSum;
  stepLossCount = lossCount;
  return Error::success();
}

Error RankExecutor::evaluate(int batch, double &batchLossSum, double &batchLossCount) {
  if (!s.evalData)
    return rankError(global, "no evaluation data");
  if (program.evaluation_size() == 0)
    return rankError(global, "the plan has no evaluation stream; recompile the model");
  lossSum = lossCount = 0;
  pendingLosses.clear();
  evaluating = true;
  Error err = runStream(program.evaluation(), batch);
  evaluating = false;
  if (err)
    return err;
  if (Error settled = settleLosses())
    return settled;
  batchLossSum = lossSum;
  batchLossCount = lossCount;
  return Error::success();
}

Error RankExecutor::runStream(const google::protobuf::RepeatedPtrField<Ins> &stream, int t) {
  if (loadNodesStale) {
    for (int k = 0; k < s.K; ++k)
      if (local(k))
        if (Error err = runLoadNodes(k, /*inStep=*/true))
          return err;
    loadNodesStale = false;
  }
  auto isComm = [&](int i) {
    if (i < 0 || i >= stream.size())
      return false;
    Ins::Op op = stream.Get(i).op();
    return op == Ins::SEND || op == Ins::RECV;
  };
  for (int i = 0; i < stream.size(); ++i) {
    const Ins &ins = stream.Get(i);
    if (!evaluating && s.fault.rank == global && s.fault.step == t && s.fault.at == i) {
      if (s.fault.kind == "kill")
        std::raise(SIGKILL);
      return rankError(global, formatv("injected fault at step {0} instruction {1}", t, i));
    }
    // Consecutive sends and receives form one group.
    if (isComm(i) && !isComm(i - 1))
      if (Error err = comm.groupStart())
        return err;
    double started = wallNow();
    double waitedBefore = waitSeconds;
    char category = 0;
    if (Error err = execute(ins, i, t, category))
      return err;
    instructionSeconds += wallNow() - started;
    if (isComm(i) && !isComm(i + 1))
      if (Error err = comm.groupEnd())
        return err;
    ++instructions;
    // An evaluation's forwards are not the step's compute.
    if (category && !evaluating)
      record(ins, category, started, waitSeconds - waitedBefore);
  }
  if (Error err = comm.flush())
    return err;
  if (!pending.empty())
    return rankError(global, formatv("{0} receive(s) posted but never used", pending.size()));
  for (auto &kept : envs)
    kept.second.reset();
  outbox.clear();
  return Error::success();
}

} // namespace pipec::rt
