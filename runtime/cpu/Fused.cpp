//===- Fused.cpp - Fused element-wise nodes ------------------------------===//
#include "runtime/cpu/Fused.h"
#include "runtime/cpu/GradKernels.h"
#include "runtime/cpu/Kernels.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cstring>
#include <map>

using namespace llvm;

namespace pipec::cpu {

namespace k = cuda::kernels;

namespace {

Error fusedError(const onnx::NodeProto &node, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s", nodeLabel(node).c_str(),
                           FusedOpType.data(), why.str().c_str());
}

/// The fused step of \p node, or nullopt if it has none.
std::optional<k::FusedOp> stepOf(const onnx::NodeProto &node, int64_t opset) {
  if (node.output_size() != 1)
    return std::nullopt;
  k::FusedOp step;
  if (node.domain() == "pipec") {
    std::optional<k::Pointwise> op = pointwiseOpOf(node);
    if (!op || node.input_size() != 2)
      return std::nullopt;
    step.kind = k::FusedKind::Pointwise;
    step.op = static_cast<int>(*op);
    return step;
  }
  // Before opset 7, binary ops broadcast only with an attribute.
  if ((!node.domain().empty() && node.domain() != "ai.onnx") || opset < 7)
    return std::nullopt;
  StringRef t = node.op_type();
  // Sum of two or more: its additions left to right, as its own kernel
  // (fusedSteps counts them).
  if (t == "Sum" && node.input_size() >= 2 && node.input_size() <= k::MaxFusedInputs &&
      node.attribute_size() == 0) {
    step.kind = k::FusedKind::Binary;
    step.op = static_cast<int>(k::Binary::Add);
    return step;
  }
  if (std::optional<k::Binary> op = binaryOpOf(t)) {
    if (k::isComparison(*op) || node.input_size() != 2 || node.attribute_size() != 0)
      return std::nullopt;
    step.kind = k::FusedKind::Binary;
    step.op = static_cast<int>(*op);
    return step;
  }
  std::optional<k::Unary> op = unaryOpOf(node, &step.alpha);
  // Attributes other than the ones unaryOpOf reads change what an op does.
  bool ownAttributes = t == "Gelu" || t == "LeakyRelu" || node.attribute_size() == 0;
  if (!op || node.input_size() != 1 || !ownAttributes)
    return std::nullopt;
  step.kind = k::FusedKind::Unary;
  step.op = static_cast<int>(*op);
  return step;
}

const onnx::GraphProto *bodyOf(const onnx::NodeProto &node) {
  const onnx::AttributeProto *body = findAttr(node, "body");
  return body && body->has_g() ? &body->g() : nullptr;
}

template <typename F>
void each(float *__restrict__ d, const float *__restrict__ a, const float *__restrict__ b,
          int64_t n, F f) {
  for (int64_t j = 0; j < n; ++j)
    d[j] = f(a[j], b[j]);
}

/// d = op(a, b) over a block, the op fixed at compile time so that each
/// loop is tight.
template <k::Unary U>
void unaryBlock(float *__restrict__ d, const float *__restrict__ a, int64_t n, float alpha) {
  for (int64_t j = 0; j < n; ++j)
    d[j] = k::unaryValue(U, a[j], alpha);
}

template <k::Pointwise P>
void pointwiseBlock(float *__restrict__ d, const float *__restrict__ a, const float *__restrict__ b,
                    int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    d[j] = a[j] * static_cast<float>(k::pointwiseFactor(P, static_cast<double>(b[j])));
}

void stepBlock(const k::FusedOp &s, float *d, const float *a, const float *b, int64_t n) {
  switch (s.kind) {
  case k::FusedKind::Unary:
    switch (static_cast<k::Unary>(s.op)) {
#define PIPEC_UNARY(U)                                                                             \
  case k::Unary::U:                                                                                \
    return unaryBlock<k::Unary::U>(d, a, n, s.alpha);
      PIPEC_UNARY(Relu)
      PIPEC_UNARY(Tanh)
      PIPEC_UNARY(Sigmoid)
      PIPEC_UNARY(Erf)
      PIPEC_UNARY(Sqrt)
      PIPEC_UNARY(Exp)
      PIPEC_UNARY(Log)
      PIPEC_UNARY(Neg)
      PIPEC_UNARY(Reciprocal)
      PIPEC_UNARY(Abs)
      PIPEC_UNARY(GeluErf)
      PIPEC_UNARY(GeluTanh)
      PIPEC_UNARY(LeakyRelu)
#undef PIPEC_UNARY
    }
    return;
  case k::FusedKind::Binary:
    switch (static_cast<k::Binary>(s.op)) {
    case k::Binary::Add:
      return each(d, a, b, n, [](float x, float y) { return x + y; });
    case k::Binary::Sub:
      return each(d, a, b, n, [](float x, float y) { return x - y; });
    case k::Binary::Mul:
      return each(d, a, b, n, [](float x, float y) { return x * y; });
    case k::Binary::Div:
      return each(d, a, b, n, [](float x, float y) { return x / y; });
    default:
      return each(d, a, b, n, [&](float x, float y) {
        return k::arithmeticValue<float>(static_cast<k::Binary>(s.op), x, y);
      });
    }
  case k::FusedKind::Pointwise:
    switch (static_cast<k::Pointwise>(s.op)) {
#define PIPEC_POINTWISE(P)                                                                         \
  case k::Pointwise::P:                                                                            \
    return pointwiseBlock<k::Pointwise::P>(d, a, b, n);
      PIPEC_POINTWISE(ReluGrad)
      PIPEC_POINTWISE(TanhGrad)
      PIPEC_POINTWISE(SigmoidGrad)
      PIPEC_POINTWISE(ErfGrad)
      PIPEC_POINTWISE(GeluErfGrad)
      PIPEC_POINTWISE(GeluTanhGrad)
#undef PIPEC_POINTWISE
    }
    return;
  }
}

/// out[j] = data[offset of element start + j of operand k], j < n: the
/// offset computed once, then stepped along the innermost dimension with a
/// carry, instead of a division per element.
void gather(const k::FusedMap &map, int k, const float *data, int64_t start, int64_t n,
            float *out) {
  if (map.rank == 0) {
    std::fill_n(out, n, data[map.base[k]]);
    return;
  }
  int64_t index[k::MaxRank];
  int64_t rest = start;
  for (int d = map.rank - 1; d > 0; --d) {
    index[d] = rest % map.shape[d];
    rest /= map.shape[d];
  }
  index[0] = rest;
  int64_t offset = k::offsetOf(map, k, start);
  int inner = map.rank - 1;
  const int64_t *strides = map.strides[k];
  for (int64_t j = 0; j < n; ++j) {
    out[j] = data[offset];
    offset += strides[inner];
    if (++index[inner] < map.shape[inner])
      continue;
    for (int d = inner; d > 0 && index[d] == map.shape[d]; --d) {
      offset += strides[d - 1] - index[d] * strides[d];
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

/// runFusedBody on the CPU kernels.
Expected<std::vector<Tensor>> runBodyOnCpu(const onnx::NodeProto &node, int64_t opset,
                                           ArrayRef<const Tensor *> inputs) {
  return runFusedBody(node, inputs, [&](const onnx::NodeProto &step, ArrayRef<const Tensor *> in) {
    return runAnyOp(step, opset, in);
  });
}

} // namespace

std::optional<k::Unary> unaryOpOf(const onnx::NodeProto &node, float *alpha) {
  StringRef t = node.op_type();
  if (t == "Gelu") {
    std::string approximate = attrString(node, "approximate", "none");
    if (approximate == "none")
      return k::Unary::GeluErf;
    if (approximate == "tanh")
      return k::Unary::GeluTanh;
    return std::nullopt;
  }
  if (t == "LeakyRelu") {
    *alpha = attrFloat(node, "alpha", 0.01f);
    return k::Unary::LeakyRelu;
  }
  static const std::pair<StringLiteral, k::Unary> ops[] = {
      {"Relu", k::Unary::Relu}, {"Tanh", k::Unary::Tanh}, {"Sigmoid", k::Unary::Sigmoid},
      {"Erf", k::Unary::Erf},   {"Sqrt", k::Unary::Sqrt}, {"Exp", k::Unary::Exp},
      {"Log", k::Unary::Log},   {"Neg", k::Unary::Neg},   {"Reciprocal", k::Unary::Reciprocal},
      {"Abs", k::Unary::Abs}};
  for (const auto &[name, op] : ops)
    if (t == name)
      return op;
  return std::nullopt;
}

std::optional<k::Binary> binaryOpOf(StringRef opType) {
  static const std::pair<StringLiteral, k::Binary> ops[] = {
      {"Add", k::Binary::Add},   {"Sub", k::Binary::Sub},        {"Mul", k::Binary::Mul},
      {"Div", k::Binary::Div},   {"Pow", k::Binary::Pow},        {"Equal", k::Binary::Equal},
      {"Less", k::Binary::Less}, {"Greater", k::Binary::Greater}};
  for (const auto &[name, op] : ops)
    if (opType == name)
      return op;
  return std::nullopt;
}

std::optional<k::Pointwise> pointwiseOpOf(const onnx::NodeProto &node) {
  StringRef t = node.op_type();
  if (t == "ReluGrad")
    return k::Pointwise::ReluGrad;
  if (t == "TanhGrad")
    return k::Pointwise::TanhGrad;
  if (t == "SigmoidGrad")
    return k::Pointwise::SigmoidGrad;
  if (t == "ErfGrad")
    return k::Pointwise::ErfGrad;
  if (t != "GeluGrad")
    return std::nullopt;
  std::string approximate = attrString(node, "approximate", "none");
  if (approximate == "none")
    return k::Pointwise::GeluErfGrad;
  if (approximate == "tanh")
    return k::Pointwise::GeluTanhGrad;
  return std::nullopt;
}

int fusedSteps(const onnx::NodeProto &node) {
  return node.op_type() == "Sum" ? std::max(1, node.input_size() - 1) : 1;
}

bool isFusable(const onnx::NodeProto &node, int64_t opset) {
  return stepOf(node, opset).has_value();
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
  const onnx::GraphProto *body = bodyOf(node);
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
    std::optional<k::FusedOp> step = stepOf(n, opset);
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
    if (!t || t->elemType() != ElemType::Float)
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
      auto next = broadcastShapes(*shape, inputs[i]->shape());
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
  const onnx::GraphProto *body = bodyOf(node);
  if (!body)
    return fusedError(node, "no body graph");
  std::map<std::string, Tensor> values;
  for (int i = 0; i < node.input_size() && i < static_cast<int>(inputs.size()); ++i)
    if (inputs[i])
      values[node.input(i)] = *inputs[i];
  std::vector<const Tensor *> args;
  for (const onnx::NodeProto &n : body->node()) {
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

Expected<std::vector<Tensor>> runFused(const onnx::NodeProto &node, int64_t opset,
                                       ArrayRef<const Tensor *> inputs) {
  auto kernel = compileFused(node, opset);
  if (!kernel)
    return kernel.takeError();
  std::optional<std::vector<int64_t>> shape = fusedShape(*kernel, inputs);
  k::FusedMap map;
  if (!shape || !makeFusedMap(*shape, inputs, map))
    return runBodyOnCpu(node, opset, inputs);
  const k::FusedProgram &p = kernel->program;
  std::vector<Tensor> outputs;
  for (int o = 0; o < p.outputs; ++o)
    outputs.emplace_back(ElemType::Float, *shape);
  int64_t total = numElementsOf(*shape);
  // An input read at consecutive offsets over the whole output is used in
  // place; any other (broadcast) one is gathered into its register block.
  // A single element (a scalar constant) fills its block once.
  enum class Read { InPlace, Scalar, Gather };
  std::vector<Read> reads;
  for (const Tensor *t : inputs)
    reads.push_back(t->shape() == *shape    ? Read::InPlace
                    : t->numElements() == 1 ? Read::Scalar
                                            : Read::Gather);
  constexpr int64_t Block = 256;
  alignas(64) float scratch[k::MaxFusedRegisters][Block];
  const float *src[k::MaxFusedRegisters] = {};
  float *dst[k::MaxFusedRegisters] = {};
  for (int64_t start = 0; start < total; start += Block) {
    int64_t n = std::min(Block, total - start);
    for (int i = 0; i < p.inputs; ++i) {
      const float *data = inputs[i]->data<float>();
      src[i] = scratch[i];
      if (reads[i] == Read::InPlace)
        src[i] = data + start;
      else if (reads[i] == Read::Scalar && start == 0)
        std::fill_n(scratch[i], Block, data[0]);
      else if (reads[i] == Read::Gather)
        gather(map, i, data, start, n, scratch[i]);
    }
    // A step that makes an output writes it straight into the output.
    for (int s = 0; s < p.ops; ++s)
      dst[p.inputs + s] = scratch[p.inputs + s];
    for (int o = 0; o < p.outputs; ++o)
      dst[p.outputRegister[o]] = outputs[o].data<float>() + start;
    for (int s = 0; s < p.ops; ++s) {
      const k::FusedOp &step = p.code[s];
      int r = p.inputs + s;
      stepBlock(step, dst[r], src[step.a], src[step.b], n);
      src[r] = dst[r];
    }
    // Two outputs of one register: the second is a copy.
    for (int o = 0; o < p.outputs; ++o)
      if (outputs[o].data<float>() + start != src[p.outputRegister[o]])
        std::memcpy(outputs[o].data<float>() + start, src[p.outputRegister[o]], n * sizeof(float));
  }
  return outputs;
}

std::optional<int64_t> epilogueBias(const onnx::NodeProto &node, ArrayRef<const Tensor *> inputs) {
  const onnx::GraphProto *body = bodyOf(node);
  if (!body || body->node_size() != 2 || body->node(0).op_type() != "MatMul" ||
      body->node(1).op_type() != "Add" || inputs.size() != 3)
    return std::nullopt;
  const Tensor *a = inputs[0], *b = inputs[1], *bias = inputs[2];
  for (const Tensor *t : {a, b, bias})
    if (!t || t->elemType() != ElemType::Float)
      return std::nullopt;
  if (a->rank() < 2 || b->rank() != 2 || a->dim(-1) != b->dim(0) || bias->rank() < 1 ||
      bias->rank() > a->rank())
    return std::nullopt;
  int64_t n = b->dim(1);
  if (bias->dim(-1) != n || bias->numElements() != n)
    return std::nullopt;
  return n;
}

Expected<std::vector<Tensor>> runMatMulBias(const onnx::NodeProto &node, int64_t opset,
                                            ArrayRef<const Tensor *> inputs) {
  std::optional<int64_t> n = epilogueBias(node, inputs);
  if (!n)
    return runBodyOnCpu(node, opset, inputs);
  auto product = runOp(bodyOf(node)->node(0), opset, {inputs[0], inputs[1]});
  if (!product)
    return product.takeError();
  // Float addition commutes exactly: the same bits as the Add, either way
  // round.
  Tensor &y = product->front();
  float *out = y.data<float>();
  const float *bias = inputs[2]->data<float>();
  for (int64_t row = 0, rows = y.numElements() / std::max<int64_t>(*n, 1); row < rows; ++row)
    for (int64_t j = 0; j < *n; ++j)
      out[row * *n + j] += bias[j];
  return std::move(*product);
}

} // namespace pipec::cpu
