//===- OpFlops.cpp - Forward FLOPs of one op ------------------------------===//
#include "compiler/cost/OpFlops.h"
#include "support/Attributes.h"

#include "llvm/ADT/StringSet.h"

using namespace llvm;

namespace pipec {
namespace {

int64_t elements(const Graph &graph, int id) {
  return id >= 0 && graph.values[id].shapeKnown ? graph.values[id].numElements() : 0;
}

int64_t outputElements(const Graph &graph, const Op &op) {
  int64_t n = 0;
  for (int id : op.outputs)
    n += elements(graph, id);
  return n;
}

const std::vector<int64_t> &shapeOf(const Graph &graph, const Op &op, size_t input) {
  static const std::vector<int64_t> empty;
  if (input >= op.inputs.size() || op.inputs[input] < 0)
    return empty;
  return graph.values[op.inputs[input]].shape;
}

} // namespace

bool isDataMovementOp(const Op &op) {
  static const StringSet<> movement = {
      "Reshape", "Transpose",      "Gather",    "Concat",   "Split",           "Slice",
      "Squeeze", "Unsqueeze",      "Flatten",   "Identity", "Expand",          "Tile",
      "Cast",    "Shape",          "Size",      "Pad",      "ConstantOfShape", "Constant",
      "Dropout", "GatherElements", "ScatterND", "Range",    "DepthToSpace",    "SpaceToDepth"};
  return movement.contains(op.opType);
}

int64_t forwardFlops(const Graph &graph, const Op &op) {
  StringRef type = op.opType;
  int64_t out = outputElements(graph, op);
  if (isDataMovementOp(op))
    return 0;
  if (type == "MatMul" || type == "MatMulInteger" || type == "FusedMatMul") {
    // Output elements times the contracted dimension, times two.
    const auto &a = shapeOf(graph, op, 0);
    int64_t k = a.empty() ? 1 : a.back();
    return 2 * elements(graph, op.outputs[0]) * k;
  }
  if (type == "Gemm") {
    const auto &a = shapeOf(graph, op, 0);
    bool transA = attrInt(graph.node(op), "transA", 0) != 0;
    int64_t k = a.size() == 2 ? (transA ? a[0] : a[1]) : 1;
    int64_t flops = 2 * elements(graph, op.outputs[0]) * k;
    if (op.inputs.size() > 2 && op.inputs[2] >= 0)
      flops += elements(graph, op.outputs[0]);
    return flops;
  }
  if (type == "Conv" || type == "ConvTranspose") {
    const auto &w = shapeOf(graph, op, 1);
    int64_t kernel = 1; // Cin/groups * prod(kernel) for Conv
    for (size_t i = 1; i < w.size(); ++i)
      kernel *= w[i];
    if (type == "ConvTranspose") {
      int64_t inElems = elements(graph, op.inputs[0]);
      int64_t cout = w.size() > 1 ? w[1] * attrInt(graph.node(op), "group", 1) : 1;
      int64_t spatial = 1;
      for (size_t i = 2; i < w.size(); ++i)
        spatial *= w[i];
      return 2 * inElems * cout * spatial /
             std::max<int64_t>(1, attrInt(graph.node(op), "group", 1));
    }
    return 2 * elements(graph, op.outputs[0]) * kernel;
  }
  if (type == "Attention" || type == "MultiHeadAttention" || type == "GroupQueryAttention") {
    // Q K^T and P V: 4 * B * heads * S * T * head_dim; plus the fused input
    // projection for com.microsoft.Attention.
    const auto &x = shapeOf(graph, op, 0);
    if (x.size() != 3)
      return out;
    int64_t batch = x[0], seq = x[1], width = x[2];
    int64_t total = seq;
    if (op.outputs.size() > 1 && op.outputs[1] >= 0) {
      const auto &present = graph.values[op.outputs[1]].shape;
      if (present.size() >= 2)
        total = present[present.size() - 2];
    }
    int64_t attnWidth = elements(graph, op.outputs[0]) / std::max<int64_t>(1, batch * seq);
    int64_t flops = 4 * batch * seq * total * attnWidth + 5 * batch * seq * total;
    if (type == "Attention") {
      const auto &w = shapeOf(graph, op, 1);
      if (w.size() == 2)
        flops += 2 * batch * seq * width * w[1];
    }
    return flops;
  }
  if (type == "Softmax" || type == "LogSoftmax")
    return 5 * out;
  if (type == "LayerNormalization" || type == "SkipLayerNormalization" ||
      type == "EmbedLayerNormalization")
    return 8 * elements(graph, op.outputs[0]);
  if (type == "SimplifiedLayerNormalization" || type == "SkipSimplifiedLayerNormalization")
    return 6 * elements(graph, op.outputs[0]);
  if (type == "BatchNormalization" || type == "InstanceNormalization" ||
      type == "GroupNormalization")
    return 4 * elements(graph, op.outputs[0]);
  if (type == "Erf" || type == "Tanh" || type == "Sigmoid" || type == "Exp" || type == "Log" ||
      type == "Gelu" || type == "FastGelu" || type == "BiasGelu" || type == "QuickGelu" ||
      type == "Sqrt" || type == "Reciprocal" || type == "Pow" || type == "HardSigmoid" ||
      type == "HardSwish" || type == "Softplus" || type == "Elu" || type == "Selu")
    return 4 * out;
  if (type == "RotaryEmbedding")
    return 3 * out;
  if (type.startswith("Reduce") || type == "GlobalAveragePool" || type == "GlobalMaxPool" ||
      type == "ArgMax" || type == "ArgMin") {
    int64_t in = 0;
    for (int id : op.inputs)
      in = std::max(in, elements(graph, id));
    return in;
  }
  if (type == "MaxPool" || type == "AveragePool" || type == "LpPool") {
    auto kernel = attrInts(graph.node(op), "kernel_shape").value_or(std::vector<int64_t>{});
    int64_t k = 1;
    for (int64_t d : kernel)
      k *= d;
    return out * k;
  }
  if (type == "SoftmaxCrossEntropyLoss" || type == "NegativeLogLikelihoodLoss") {
    int64_t in = elements(graph, op.inputs[0]);
    return type == "SoftmaxCrossEntropyLoss" ? 6 * in : in;
  }
  if (type == "Sum" || type == "Mean" || type == "Max" || type == "Min")
    return out * std::max<int64_t>(1, static_cast<int64_t>(op.inputs.size()) - 1);
  if (type == "If" || type == "Loop" || type == "Scan")
    return out; // opaque: see the report's warning
  return out;
}

} // namespace pipec
