//===- Lifetimes.cpp - When a rank drops its values and adds its gradients ===//
//
// Per stage and node list, computed once: each value's last reader, after
// which the executor drops it (dropsFor), and the node after which each
// weight-gradient term is added into its accumulator (addsFor). What the
// contract keeps is docs/PLAN_FORMAT.md's.
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/RankExecutor.h"

#include <map>
#include <set>
#include <string>

using namespace llvm;

namespace pipec::rt {

const RankExecutor::DropSchedule &RankExecutor::dropsFor(int stage, NodeListKind list) {
  auto found = dropSchedules.find({stage, list});
  if (found != dropSchedules.end())
    return found->second;
  const plan::StageProgram &sp = stageProgram(stage);
  std::set<std::string> live;
  auto keep = [&](const auto &names) { live.insert(names.begin(), names.end()); };
  auto keepTerms = [&](const auto &sums) {
    for (const plan::GradSum &g : sums)
      keep(g.terms());
  };
  for (const plan::RunningStat &r : sp.running_stats())
    live.insert(r.statistic());
  const google::protobuf::RepeatedPtrField<onnx::NodeProto> *nodes = nullptr;
  switch (list) {
  case NodeListKind::Forward: {
    nodes = &sp.forward();
    keep(sp.send());
    keep(sp.outputs());
    if (s.training) {
      auto recomputing = keptWhenRecomputing.find(stage);
      keep(recomputing != keptWhenRecomputing.end() ? recomputing->second : keepSets[stage]);
      live.insert(s.plan->loss_value());
      live.insert(s.plan->loss_count_value());
    }
    break;
  }
  case NodeListKind::BackwardInput:
    nodes = &sp.backward_input();
    for (const onnx::NodeProto &node : sp.backward_weight())
      keep(node.input());
    for (const plan::GradSum &g : sp.input_grads())
      live.insert(g.value()); // shapes a zero gradient
    keepTerms(sp.input_grads());
    keepTerms(sp.weight_grads());
    break;
  case NodeListKind::BackwardWeight:
    nodes = &sp.backward_weight();
    keepTerms(sp.weight_grads());
    break;
  }
  std::map<std::string, int> last;
  for (int i = 0; i < nodes->size(); ++i)
    for (const std::string &name : (*nodes)[i].input())
      if (!name.empty())
        last[name] = i;
  DropSchedule after(nodes->size());
  for (const auto &[name, i] : last)
    if (!live.count(name))
      after[i].push_back(name);
  return dropSchedules.emplace(std::make_pair(stage, list), std::move(after)).first->second;
}

const RankExecutor::AddSchedule &RankExecutor::addsFor(int stage) {
  auto found = addSchedules.find(stage);
  if (found != addSchedules.end())
    return found->second;
  const plan::StageProgram &sp = stageProgram(stage);
  std::map<std::string, int> last; // made or read last by that node of the list
  for (int i = 0; i < sp.backward_weight_size(); ++i) {
    for (const std::string &name : sp.backward_weight(i).input())
      last[name] = i;
    for (const std::string &name : sp.backward_weight(i).output())
      last[name] = i;
  }
  AddSchedule adds;
  for (const plan::GradSum &g : sp.weight_grads())
    if (grads.count(g.value())) // else not trained (e.g. a buffer)
      for (const std::string &term : g.terms()) {
        auto at = last.find(term);
        adds[at == last.end() ? -1 : at->second].emplace_back(g.value(), term);
      }
  return addSchedules.emplace(stage, std::move(adds)).first->second;
}

} // namespace pipec::rt
