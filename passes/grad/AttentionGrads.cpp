//===- AttentionGrads.cpp - The gradient of fused attention ---------------===//
//
// pipec.ScaledDotProductAttention (ops/Attention.h) differentiates into one
// ScaledDotProductAttentionGrad per list its wanted inputs' gradients go to
// (the I list for Q, Kt and V made from activations): it recomputes the
// scores from Q and Kt and the forward's log-sum-exp, so that the backward
// reads neither the scores nor the probabilities. Its step tensors (masks)
// take no gradient: fuse-attention fuses none that would.
//
//===----------------------------------------------------------------------===//
#include "ops/Attention.h"
#include "passes/grad/GradRules.h"

#include <map>

using namespace llvm;

namespace pipec::grad {
namespace {

Error scaledDotProductAttentionGrad(GradContext &ctx) {
  namespace a = attention;
  const onnx::NodeProto &node = ctx.node();
  if (node.output_size() <= a::LogSumExp || node.output(a::LogSumExp).empty())
    return ctx.error("the gradient needs the forward's log-sum-exp output");
  // Per list, the gradient node made for it: its outputs dQ, dKt, dV.
  std::map<const std::vector<onnx::NodeProto> *, std::vector<std::string>> made;
  return ctx.forEachWanted([&](size_t i) -> Error {
    std::vector<std::string> &outs = made[&ctx.currentList()];
    if (outs.empty()) {
      std::vector<std::string> inputs = {ctx.dy(),         ctx.in(a::Query),
                                         ctx.in(a::KeysT), ctx.in(a::Values),
                                         ctx.y(),          node.output(a::LogSumExp)};
      for (int t = a::FirstTensor; t < node.input_size(); ++t)
        inputs.push_back(node.input(t));
      onnx::NodeProto &g = ctx.emit(a::GradOpType, inputs, "pipec");
      for (const onnx::AttributeProto &attr : node.attribute())
        *g.add_attribute() = attr;
      outs = {GradContext::out(g), GradContext::out(g) + ".keys", GradContext::out(g) + ".values"};
      g.add_output(outs[1]);
      g.add_output(outs[2]);
    }
    ctx.contribute(i, outs[i]);
    return Error::success();
  });
}

/// Q, Kt and V; never the masks.
bool queryKeysValues(size_t input) { return input < attention::FirstTensor; }

} // namespace

namespace rules {
const GradRule scaledDotProductAttention{&scaledDotProductAttentionGrad, &queryKeysValues};
} // namespace rules

} // namespace pipec::grad
