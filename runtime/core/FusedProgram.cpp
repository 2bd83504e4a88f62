//===- FusedProgram.cpp - Fused element-wise nodes, compiled for a kernel -===//
#include "runtime/core/FusedProgram.h"
#include "ops/OpRegistry.h"
#include "runtime/core/OpContext.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <map>

using namespace llvm;

namespace pipec {

namespace k = kernels;
using cpu::Tensor;
using pipec::DType;

namespace {

Error fusedError(const onnx::NodeProto &node, const Twine &why) {
  return nodeError(nodeLabel(node), FusedOpType, why);
}

/// Reads a node's attributes for the element math and remembers which it
/// asked for: an attribute the math never reads changes what the op does.
class RecordingReader final : public k::ParamReader {
public:
  explicit RecordingReader(const onnx::NodeProto &node) : node(node) {}
  int64_t attrInt(const char *name, int64_t otherwise) const override {
    asked.insert(name);
    return pipec::attrInt(node, name, otherwise);
  }
  float attrFloat(const char *name, float otherwise) const override {
    asked.insert(name);
    return pipec::attrFloat(node, name, otherwise);
  }
  std::string attrString(const char *name, const char *otherwise) const override {
    asked.insert(name);
    return pipec::attrString(node, name, otherwise);
  }
  /// True if every attribute of the node was read (or is \p also).
  bool readAll(StringRef also = "") const {
    for (const onnx::AttributeProto &a : node.attribute())
      if (!asked.contains(a.name()) && a.name() != also)
        return false;
    return true;
  }

private:
  const onnx::NodeProto &node;
  mutable StringSet<> asked;
};

/// The element-wise row a gradient node differentiates: UnaryGrad's "op".
const OpDef *forwardOf(const onnx::NodeProto &node) {
  return lookupOp("", attrString(node, "op", ""));
}

} // namespace

std::optional<k::FusedOp> fusedStepOf(const onnx::NodeProto &node, int64_t opset) {
  const OpDef *def = lookupOp(node.domain(), node.op_type(), opset);
  if (!def || node.output_size() != 1)
    return std::nullopt;
  k::FusedOp step;
  const OpDef *math = def;
  if (def->id == OpId::UnaryGrad) {
    math = forwardOf(node);
    step.gradient = true;
    if (!math || !math->elem || math->minInputs != 1 || node.input_size() != 2)
      return std::nullopt;
  } else if (def->id == OpId::Sum) {
    // A Sum of two or more: its additions left to right, as its own kernel
    // (fusedSteps counts them).
    if (node.input_size() < 2 || node.input_size() > k::MaxFusedInputs ||
        node.attribute_size() != 0 || opset < 7)
      return std::nullopt;
    step.op = ElemOp::Add;
    return step;
  } else {
    // Before opset 7, binary ops broadcast only with an attribute.
    if (!def->elem || node.input_size() != def->minInputs || opset < 7)
      return std::nullopt;
  }
  if (!math->elem || !k::isFloatMath(*math->elem))
    return std::nullopt;
  step.op = *math->elem;
  RecordingReader reader(node);
  if (!k::readElemParams(step.op, reader, step.params).empty() ||
      !reader.readAll(step.gradient ? "op" : ""))
    return std::nullopt;
  return step;
}

bool isFusable(const onnx::NodeProto &node, int64_t opset) {
  return fusedStepOf(node, opset).has_value();
}

int fusedSteps(const onnx::NodeProto &node) {
  return isOp(node, OpId::Sum) ? std::max(1, node.input_size() - 1) : 1;
}

const onnx::GraphProto *fusedBodyOf(const onnx::NodeProto &node) {
  const onnx::AttributeProto *body = findAttr(node, "body");
  return body && body->has_g() ? &body->g() : nullptr;
}

onnx::NodeProto makeFusedNode(const std::string &name, ArrayRef<const onnx::NodeProto *> body,
                              ArrayRef<std::string> inputs, ArrayRef<std::string> outputs) {
  onnx::NodeProto fused;
  fused.set_name(name);
  fused.set_domain(FusedDomain.str());
  fused.set_op_type(FusedOpType.str());
  for (const std::string &in : inputs)
    fused.add_input(in);
  for (const std::string &out : outputs)
    fused.add_output(out);
  onnx::AttributeProto *attr = fused.add_attribute();
  attr->set_name("body");
  attr->set_type(onnx::AttributeProto::GRAPH);
  onnx::GraphProto *graph = attr->mutable_g();
  graph->set_name(name);
  for (const onnx::NodeProto *node : body)
    *graph->add_node() = *node;
  return fused;
}

Expected<FusedKernel> compileFused(const onnx::NodeProto &node, int64_t opset) {
  const onnx::GraphProto *body = fusedBodyOf(node);
  if (!body)
    return fusedError(node, "no body graph");
  if (node.input_size() > k::MaxFusedInputs || node.output_size() < 1 ||
      node.output_size() > k::MaxFusedOutputs)
    return fusedError(node, formatv("{0} inputs and {1} outputs: over the limits ({2}, {3})",
                                    node.input_size(), node.output_size(), k::MaxFusedInputs,
                                    k::MaxFusedOutputs));
  FusedKernel kernel;
  k::FusedProgram &p = kernel.program;
  p.inputs = node.input_size();
  StringMap<int> reg;
  std::vector<uint32_t> deps;
  for (int i = 0; i < node.input_size(); ++i) {
    reg[node.input(i)] = i;
    deps.push_back(1u << i);
  }
  for (const onnx::NodeProto &n : body->node()) {
    std::optional<k::FusedOp> step = fusedStepOf(n, opset);
    if (!step)
      return fusedError(node,
                        formatv("step '{0}' ({1}) cannot be fused", nodeLabel(n), n.op_type()));
    std::vector<int> operands;
    uint32_t mask = 0;
    for (int i = 0; i < n.input_size(); ++i) {
      auto it = reg.find(n.input(i));
      if (it == reg.end())
        return fusedError(node, formatv("step '{0}' reads '{1}', which is not made before it",
                                        nodeLabel(n), n.input(i)));
      operands.push_back(it->second);
      mask |= deps[it->second];
    }
    if (p.ops + fusedSteps(n) > k::MaxFusedOps)
      return fusedError(node, formatv("over {0} steps", k::MaxFusedOps));
    // One step per op; a Sum adds its inputs left to right, each addition
    // reading the one before.
    int acc = operands[0];
    for (size_t i = operands.size() > 1 ? 1 : 0; i < std::max<size_t>(operands.size(), 1); ++i) {
      step->a = acc;
      step->b = operands[i];
      acc = p.inputs + p.ops;
      p.code[p.ops++] = *step;
      deps.push_back(mask);
    }
    reg[n.output(0)] = acc;
  }
  p.outputs = node.output_size();
  for (int o = 0; o < node.output_size(); ++o) {
    auto it = reg.find(node.output(o));
    if (it == reg.end() || it->second < p.inputs)
      return fusedError(node, formatv("output '{0}' is not made by a step", node.output(o)));
    p.outputRegister[o] = it->second;
    kernel.dependsOn[o] = deps[it->second];
  }
  return kernel;
}

std::optional<std::vector<int64_t>> fusedShape(const FusedKernel &kernel,
                                               ArrayRef<const Tensor *> inputs) {
  if (static_cast<int>(inputs.size()) != kernel.program.inputs || inputs.empty())
    return std::nullopt;
  for (const Tensor *t : inputs)
    if (!t || t->elemType() != DType::F32)
      return std::nullopt;
  auto broadcastOf = [&](uint32_t mask) -> std::optional<std::vector<int64_t>> {
    std::optional<std::vector<int64_t>> shape;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!(mask & (1u << i)))
        continue;
      if (!shape) {
        shape = inputs[i]->shape();
        continue;
      }
      auto next = cpu::broadcastShapes(*shape, inputs[i]->shape());
      if (!next) {
        consumeError(next.takeError());
        return std::nullopt;
      }
      shape = std::move(*next);
    }
    return shape;
  };
  auto full = broadcastOf((1u << inputs.size()) - 1);
  if (!full)
    return std::nullopt;
  for (int o = 0; o < kernel.program.outputs; ++o)
    if (broadcastOf(kernel.dependsOn[o]) != full)
      return std::nullopt;
  return full;
}

bool makeFusedMap(const std::vector<int64_t> &shape, ArrayRef<const Tensor *> inputs,
                  k::FusedMap &map) {
  std::vector<std::vector<int64_t>> strides;
  for (const Tensor *t : inputs)
    strides.push_back(k::broadcastStrides(t->shape(), shape));
  return k::makeIndexMap(shape, strides, map);
}

Expected<std::vector<Tensor>> runFusedBody(
    const onnx::NodeProto &node, ArrayRef<const Tensor *> inputs,
    function_ref<Expected<std::vector<Tensor>>(const onnx::NodeProto &, ArrayRef<const Tensor *>)>
        run) {
  const onnx::GraphProto *body = fusedBodyOf(node);
  if (!body)
    return fusedError(node, "no body graph");
  return runBodyGraph(*body, node, inputs, run);
}

Expected<std::vector<Tensor>> runBodyGraph(
    const onnx::GraphProto &body, const onnx::NodeProto &node, ArrayRef<const Tensor *> inputs,
    function_ref<Expected<std::vector<Tensor>>(const onnx::NodeProto &, ArrayRef<const Tensor *>)>
        run) {
  std::map<std::string, Tensor> values;
  for (int i = 0; i < node.input_size() && i < static_cast<int>(inputs.size()); ++i)
    if (inputs[i])
      values[node.input(i)] = *inputs[i];
  std::vector<const Tensor *> args;
  for (const onnx::NodeProto &n : body.node()) {
    args.clear();
    for (const std::string &name : n.input()) {
      auto it = values.find(name);
      if (it == values.end())
        return fusedError(node, formatv("step '{0}' reads '{1}', which is not made before it",
                                        nodeLabel(n), name));
      args.push_back(&it->second);
    }
    auto outs = run(n, args);
    if (!outs)
      return outs.takeError();
    for (int o = 0; o < n.output_size() && o < static_cast<int>(outs->size()); ++o)
      values[n.output(o)] = std::move((*outs)[o]);
  }
  std::vector<Tensor> results;
  for (const std::string &name : node.output()) {
    auto it = values.find(name);
    if (it == values.end())
      return fusedError(node, formatv("output '{0}' is not made by a step", name));
    results.push_back(std::move(it->second));
  }
  return results;
}

std::optional<int64_t> epilogueBias(const onnx::NodeProto &node, ArrayRef<const Tensor *> inputs) {
  const onnx::GraphProto *body = fusedBodyOf(node);
  if (!body || body->node_size() != 2 || !isOp(body->node(0), OpId::MatMul) ||
      !isOp(body->node(1), OpId::Add) || inputs.size() != 3)
    return std::nullopt;
  const Tensor *a = inputs[0], *b = inputs[1], *bias = inputs[2];
  for (const Tensor *t : {a, b, bias})
    if (!t || t->elemType() != DType::F32)
      return std::nullopt;
  if (a->rank() < 2 || b->rank() != 2 || a->dim(-1) != b->dim(0) || bias->rank() < 1 ||
      bias->rank() > a->rank())
    return std::nullopt;
  int64_t n = b->dim(1);
  if (bias->dim(-1) != n || bias->numElements() != n)
    return std::nullopt;
  return n;
}

} // namespace pipec
