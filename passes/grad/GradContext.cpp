//===- GradContext.cpp - What a gradient rule sees and emits -------------===//
#include "passes/grad/GradContext.h"
#include "passes/grad/GradRules.h"
#include "support/Diagnostics.h"
#include "support/Float16.h"

#include "support/Attributes.h"

#include "llvm/ADT/Twine.h"

#include <algorithm>
#include <cassert>

using namespace llvm;

namespace pipec::grad {

GradContext::GradContext(const Graph &graph, Backward &result, const std::vector<bool> &needsGrad)
    : graph(graph), result(result), needsGrad(needsGrad) {}

void GradContext::sinkFor(int id) {
  bool crossing = static_cast<size_t>(id) < crossingDerived.size() && crossingDerived[id];
  sink = val(id).kind == ValueKind::Weight && !crossing ? &result.weightGrad[layerIndex]
                                                        : &result.inputGrad[layerIndex];
}

int GradContext::transposedWeight(size_t i) const {
  int id = current->inputs[i];
  int p = id >= 0 ? val(id).producer : -1;
  if (p < 0 || static_cast<size_t>(p) >= opLayers.size() || opLayers[p] != layerIndex)
    return -1;
  const Op &t = graph.ops[p];
  if (t.dead || !t.is(OpId::Transpose) || t.inputs.size() != 1 || t.inputs[0] < 0)
    return -1;
  const Value &w = val(t.inputs[0]);
  if (w.kind != ValueKind::Weight || w.producer >= 0 || w.shape.size() != 2)
    return -1;
  std::optional<std::vector<int64_t>> perm = attrInts(graph.node(t), "perm");
  if (perm && *perm != std::vector<int64_t>{1, 0})
    return -1;
  return t.inputs[0];
}

const std::string &GradContext::transposedWeightName(size_t i) const {
  assert(transposedWeight(i) >= 0);
  return graph.node(graph.ops[val(current->inputs[i]).producer]).input(0);
}

onnx::NodeProto &GradContext::emit(StringRef opType, ArrayRef<std::string> inputs,
                                   StringRef domain) {
  onnx::NodeProto &node = sink->emplace_back();
  node.set_op_type(opType.str());
  node.set_name("bwd/" + std::to_string(counter) + "/" + opType.str());
  if (!domain.empty())
    node.set_domain(domain.str());
  for (const std::string &in : inputs)
    node.add_input(in);
  node.add_output(fresh());
  return node;
}

void GradContext::setInt(onnx::NodeProto &node, StringRef name, int64_t v) {
  setAttrInt(node, name, v);
}

void GradContext::setFloat(onnx::NodeProto &node, StringRef name, float v) {
  setAttrFloat(node, name, v);
}

void GradContext::setString(onnx::NodeProto &node, StringRef name, StringRef v) {
  setAttrString(node, name, v);
}

void GradContext::setInts(onnx::NodeProto &node, StringRef name, ArrayRef<int64_t> v) {
  setAttrInts(node, name, v);
}

std::string GradContext::constInts(ArrayRef<int64_t> values) {
  onnx::NodeProto &node = emit("Constant", {});
  auto *a = node.add_attribute();
  a->set_name("value");
  a->set_type(onnx::AttributeProto::TENSOR);
  auto *t = a->mutable_t();
  t->set_data_type(onnx::TensorProto::INT64);
  t->add_dims(static_cast<int64_t>(values.size()));
  for (int64_t v : values)
    t->add_int64_data(v);
  return out(node);
}

std::string GradContext::constScalar(double value, DType type) {
  onnx::NodeProto &node = emit("Constant", {});
  auto *a = node.add_attribute();
  a->set_name("value");
  a->set_type(onnx::AttributeProto::TENSOR);
  auto *t = a->mutable_t();
  t->set_data_type(static_cast<int32_t>(type));
  // ONNX keeps float16 and bfloat16 values as their bits in int32_data.
  if (type == DType::F64)
    t->add_double_data(value);
  else if (type == DType::BF16)
    t->add_int32_data(floatToBFloat16(static_cast<float>(value)));
  else if (type == DType::F16)
    t->add_int32_data(floatToHalf(static_cast<float>(value)));
  else
    t->add_float_data(static_cast<float>(value));
  return out(node);
}

std::string GradContext::unary(StringRef opType, const std::string &x, StringRef domain) {
  return out(emit(opType, {x}, domain));
}

std::string GradContext::binary(StringRef opType, const std::string &a, const std::string &b,
                                StringRef domain) {
  return out(emit(opType, {a, b}, domain));
}

std::string GradContext::sumTo(const std::string &grad, const std::vector<int64_t> &gradShape,
                               const std::vector<int64_t> &shape) {
  if (gradShape == shape)
    return grad;
  onnx::NodeProto &node = emit("SumTo", {grad}, "pipec");
  setInts(node, "shape", shape);
  return out(node);
}

std::string GradContext::reshape(const std::string &x, ArrayRef<int64_t> shape) {
  return binary("Reshape", x, constInts(shape));
}

std::string GradContext::transposeLast2(const std::string &x, size_t rank) {
  std::vector<int64_t> perm;
  for (size_t i = 0; i < rank; ++i)
    perm.push_back(static_cast<int64_t>(i));
  std::swap(perm[rank - 1], perm[rank - 2]);
  onnx::NodeProto &node = emit("Transpose", {x});
  setInts(node, "perm", perm);
  return out(node);
}

std::string GradContext::sumToChannels(const std::string &grad,
                                       const std::vector<int64_t> &gradShape) {
  std::vector<int64_t> kept(gradShape.size(), 1);
  kept[1] = gradShape[1];
  return reshape(sumTo(grad, gradShape, kept), {gradShape[1]});
}

std::string GradContext::channelsFirst(const std::string &x, int64_t channels, size_t rank) {
  std::vector<int64_t> shape(rank - 1, 1);
  shape[0] = channels;
  return reshape(x, shape);
}

void GradContext::addContribution(int id, std::string name) {
  // Which output of the last node \p name is (a node may make several
  // inputs' gradients: fused attention's dQ, dKt and dV).
  int output = -1;
  if (!sink->empty() && StringRef(name).startswith("bwd:"))
    for (int k = 0; k < sink->back().output_size(); ++k)
      if (sink->back().output(k) == name)
        output = k;
  if (output < 0) {
    name = unary("Identity", name);
    output = 0;
  }
  std::string label = "grad:" + val(id).name + "#" + std::to_string(contribs[id].size());
  sink->back().set_output(output, label);
  contribs[id].push_back({sink, sink->size() - 1, output});
  contribLayers[id].push_back(layerIndex);
}

void GradContext::updateRunning(size_t i, std::string statistic, float momentum) {
  result.runningStats.push_back({val(current->inputs[i]).name, std::move(statistic), momentum,
                                 layerIndex, currentNode->name()});
}

void GradContext::finalize(int id) {
  auto it = contribs.find(id);
  if (it == contribs.end() || finalGrad.count(id))
    return;
  std::string name = "grad:" + val(id).name;
  if (it->second.size() == 1) {
    Contribution c = it->second.front();
    (*c.list)[c.index].set_output(c.output, name);
  } else {
    std::vector<std::string> parts;
    for (const Contribution &c : it->second)
      parts.push_back((*c.list)[c.index].output(c.output));
    emit("Sum", parts).set_output(0, name);
  }
  finalGrad[id] = name;
}

std::string GradContext::gradientOf(int id) const {
  auto it = finalGrad.find(id);
  return it == finalGrad.end() ? std::string() : it->second;
}

void GradContext::beginOp(const Op &op, const GradRule &rule, const OpDef *def) {
  current = &op;
  currentRule = &rule;
  currentDef = def;
  currentNode = &graph.node(op);
}

bool GradContext::wants(size_t i) const {
  const Op &op = *current;
  return i < op.inputs.size() && op.inputs[i] >= 0 && needsGrad[op.inputs[i]] &&
         currentRule->carries(i);
}

Error GradContext::forEachWanted(function_ref<Error(size_t)> f) {
  for (size_t i = 0; i < current->inputs.size(); ++i)
    if (wants(i)) {
      sinkFor(current->inputs[i]);
      if (Error err = f(i))
        return err;
    }
  return Error::success();
}

Error GradContext::ifDataWanted(function_ref<Error()> f) {
  return forEachWanted([&](size_t i) { return i == 0 ? f() : Error::success(); });
}

std::optional<std::vector<int64_t>> GradContext::constantInput(size_t i) const {
  const Op &op = *current;
  if (i >= op.inputs.size() || op.inputs[i] < 0 || !val(op.inputs[i]).constant)
    return std::nullopt;
  const auto &c = *val(op.inputs[i]).constant;
  std::vector<int64_t> v;
  for (int64_t e = 0; e < c.numElements(); ++e)
    v.push_back(c.intAt(e));
  return v;
}

std::string GradContext::dyOf(size_t k) const {
  return current->outputs[k] < 0 ? std::string() : gradientOf(current->outputs[k]);
}

Error GradContext::error(const Twine &what) const {
  std::string name = current->name;
  if (name.empty() && !current->outputs.empty() && current->outputs[0] >= 0)
    name = val(current->outputs[0]).name;
  return nodeError(name, current->opType, what);
}

Expected<WindowAttrs> GradContext::windowAttrs(size_t rank) const {
  const onnx::NodeProto &node = *currentNode;
  Expected<WindowAttrs> w = readWindowAttrs(
      static_cast<int64_t>(rank), [&](StringRef name) { return attrInts(node, name); },
      [&](StringRef name) { return attrString(node, name, ""); });
  if (!w)
    return error(toString(w.takeError()));
  return w;
}

Error GradContext::setWindowAttrs(onnx::NodeProto &g, ArrayRef<int64_t> kernel,
                                  ArrayRef<int64_t> xShape, ArrayRef<int64_t> yShape) {
  size_t rank = kernel.size();
  if (rank < 1 || rank > 3 || xShape.size() != rank + 2 || yShape.size() != rank + 2)
    return error("gradient with " + Twine(int64_t(xShape.size()) - 2) +
                 " spatial dimensions is not implemented (1 to 3 are)");
  Expected<WindowAttrs> w = windowAttrs(rank);
  if (!w)
    return w.takeError();
  if (w->same())
    for (size_t d = 0; d < rank; ++d) {
      int64_t extent = (kernel[d] - 1) * w->dilations[d] + 1;
      int64_t total =
          std::max<int64_t>(0, (yShape[d + 2] - 1) * w->strides[d] + extent - xShape[d + 2]);
      std::tie(w->pads[d], w->pads[rank + d]) = w->samePads(total);
    }
  setInts(g, "kernel_shape", kernel);
  setInts(g, "strides", w->strides);
  setInts(g, "dilations", w->dilations);
  setInts(g, "pads", w->pads);
  return Error::success();
}

} // namespace pipec::grad
