//===- FoldWeights.cpp - Nodes of weights alone run once per update ------===//
#include "passes/FoldWeights.h"
#include "ops/OpRegistry.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringSet.h"

using namespace llvm;

namespace pipec {

int64_t foldWeightNodes(plan::StageProgram &sp, int64_t opset) {
  StringSet<> leaving, weights;
  for (const auto *list : {&sp.send(), &sp.outputs()})
    for (const std::string &name : *list)
      leaving.insert(name);
  for (const std::string &name : sp.weights())
    weights.insert(name);
  google::protobuf::RepeatedPtrField<onnx::NodeProto> forward;
  int64_t moved = 0;
  for (onnx::NodeProto &node : *sp.mutable_forward()) {
    const OpDef *def = lookupOp(node.domain(), node.op_type(), opset);
    bool fold = def && !def->has(Random) && !def->has(Collective) && node.input_size() > 0 &&
                none_of(node.output(), [&](const std::string &o) { return leaving.contains(o); }) &&
                all_of(node.input(),
                       [&](const std::string &in) { return in.empty() || weights.contains(in); });
    if (!fold) {
      *forward.Add() = std::move(node);
      continue;
    }
    for (const std::string &out : node.output())
      if (!out.empty())
        weights.insert(out);
    *sp.add_load_nodes() = std::move(node);
    ++moved;
  }
  sp.mutable_forward()->Swap(&forward);
  // What the backward read of them it now reads from the weights.
  for (auto *list : {sp.mutable_keep(), sp.mutable_recompute()}) {
    google::protobuf::RepeatedPtrField<std::string> rest;
    for (std::string &name : *list)
      if (!weights.contains(name))
        *rest.Add() = std::move(name);
    list->Swap(&rest);
  }
  return moved;
}

} // namespace pipec
