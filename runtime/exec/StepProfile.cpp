//===- StepProfile.cpp - run --profile: where one step's time went ------===//
#include "runtime/exec/StepProfile.h"
#include "plan/PlanFile.h"
#include "support/Attributes.h"

#include "llvm/Support/JSON.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <vector>

using namespace llvm;

namespace pipec::rt {

double nodeFlops(const onnx::NodeProto &node, ArrayRef<const cpu::Tensor *> inputs,
                 ArrayRef<cpu::Tensor> outputs) {
  double elements = 0;
  for (const cpu::Tensor &t : outputs)
    elements += static_cast<double>(t.numElements());
  StringRef type = node.op_type();
  bool product = type == "MatMul" || type == "Gemm" || type.startswith("MatMul");
  if (!product || inputs.empty() || !inputs[0] || inputs[0]->rank() < 1 || outputs.empty())
    return elements;
  // 2 M N K: the output's elements times the contracted length of A.
  const cpu::Tensor &a = *inputs[0];
  bool transA = type == "Gemm" && attrInt(node, "transA", 0) != 0;
  int64_t k = transA && a.rank() >= 2 ? a.dim(a.rank() - 2) : a.dim(a.rank() - 1);
  return 2.0 * static_cast<double>(outputs[0].numElements()) * static_cast<double>(k);
}

void RankProfile::node(const onnx::NodeProto &node, ArrayRef<const cpu::Tensor *> inputs,
                       ArrayRef<cpu::Tensor> outputs, double seconds) {
  ClassTotals &c = classes[node.op_type()];
  ++c.nodes;
  c.seconds += seconds;
  c.flops += nodeFlops(node, inputs, outputs);
  for (const cpu::Tensor *t : inputs)
    if (t)
      c.bytes += static_cast<double>(t->byteSize());
  for (const cpu::Tensor &t : outputs)
    c.bytes += static_cast<double>(t.byteSize());
  nodeSeconds += seconds;
}

Error writeProfile(StringRef path, StringRef backend, int step, ArrayRef<RankProfile> ranks) {
  std::string text;
  raw_string_ostream os(text);
  json::OStream j(os, 2);
  auto rate = [](double amount, double seconds) { return seconds > 0 ? amount / seconds : 0.0; };
  j.object([&] {
    j.attribute("backend", backend);
    j.attribute("step", step);
    j.attributeArray("ranks", [&] {
      for (const RankProfile &r : ranks)
        j.object([&] {
          j.attribute("rank", r.rank);
          j.attribute("step_s", r.stepSeconds);
          j.attribute("nodes_s", r.nodeSeconds);
          j.attribute("other_s", std::max(0.0, r.stepSeconds - r.nodeSeconds));
          j.attribute("launches", r.counters.launches);
          j.attribute("host_syncs", r.counters.hostSyncs);
          j.attribute("d2h_bytes", r.counters.deviceToHostBytes);
          j.attribute("allocations", r.counters.allocations);
          std::vector<std::pair<std::string, ClassTotals>> order(r.classes.begin(),
                                                                 r.classes.end());
          std::stable_sort(order.begin(), order.end(), [](const auto &a, const auto &b) {
            return a.second.seconds > b.second.seconds;
          });
          j.attributeArray("classes", [&] {
            for (const auto &entry : order)
              j.object([&] {
                const ClassTotals &c = entry.second;
                const std::string &op = entry.first;
                j.attribute("op", op);
                j.attribute("nodes", c.nodes);
                j.attribute("seconds", c.seconds);
                j.attribute("share_of_nodes", r.nodeSeconds > 0 ? c.seconds / r.nodeSeconds : 0);
                j.attribute("share_of_step", r.stepSeconds > 0 ? c.seconds / r.stepSeconds : 0);
                j.attribute("gflops", c.flops / 1e9);
                j.attribute("gbytes", c.bytes / 1e9);
                j.attribute("gflop_per_s", rate(c.flops / 1e9, c.seconds));
                j.attribute("gb_per_s", rate(c.bytes / 1e9, c.seconds));
              });
          });
        });
    });
  });
  os << "\n";
  if (Error err = writeFileAtomically(path, os.str()))
    return createStringError(inconvertibleErrorCode(), "--profile %s: %s", path.str().c_str(),
                             toString(std::move(err)).c_str());
  return Error::success();
}

} // namespace pipec::rt
