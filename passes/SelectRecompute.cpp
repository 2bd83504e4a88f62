//===- SelectRecompute.cpp - What RECOMPUTE reruns ------------------------===//
#include "passes/SelectRecompute.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace pipec {

int64_t selectRecompute(plan::StageProgram &sp) {
  sp.clear_rerun();
  sp.clear_keep_when_recomputing();
  if (sp.recompute_size() == 0)
    return 0;
  std::map<std::string, int> producer;
  for (int i = 0; i < sp.forward_size(); ++i)
    for (const std::string &out : sp.forward(i).output())
      if (!out.empty())
        producer[out] = i;
  std::set<std::string> weights(sp.weights().begin(), sp.weights().end());
  for (const onnx::NodeProto &node : sp.load_nodes())
    weights.insert(node.output().begin(), node.output().end());
  std::set<std::string> dropped(sp.recompute().begin(), sp.recompute().end()), kept;
  for (const std::string &v : sp.keep())
    if (!dropped.count(v))
      kept.insert(v);
  // From the dropped values back to what stays: the values kept, the
  // weights, and the stage's inputs (kept for the rerun).
  std::vector<bool> rerun(sp.forward_size(), false);
  std::vector<std::string> work(dropped.begin(), dropped.end());
  std::set<std::string> seen = dropped;
  while (!work.empty()) {
    std::string v = std::move(work.back());
    work.pop_back();
    auto made = producer.find(v);
    if (made == producer.end()) {
      kept.insert(v); // an input: nothing rebuilds it
      continue;
    }
    if (rerun[made->second])
      continue;
    rerun[made->second] = true;
    for (const std::string &in : sp.forward(made->second).input()) {
      if (in.empty() || kept.count(in) || weights.count(in))
        continue;
      if (!producer.count(in))
        kept.insert(in);
      else if (seen.insert(in).second)
        work.push_back(in);
    }
  }
  int64_t count = 0;
  for (int i = 0; i < sp.forward_size(); ++i)
    if (rerun[i]) {
      *sp.add_rerun() = sp.forward(i);
      ++count;
    }
  for (const std::string &v : kept)
    sp.add_keep_when_recomputing(v);
  return count;
}

} // namespace pipec
