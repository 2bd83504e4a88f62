//===- Differentiate.cpp - Gradient rules and the I / W split -----------===//
//
// One walk over the layers from last to first and, inside a layer, over its
// ops in reverse topological order. By the time an op is reached every user
// of its outputs has been visited, so the outputs' gradients are complete:
// they are summed (if there are several contributions) and the op's rule
// emits the contributions to its inputs' gradients.
//
//===----------------------------------------------------------------------===//
#include "passes/Differentiate.h"

#include "support/Attributes.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/Twine.h"

#include <algorithm>

using namespace llvm;

namespace pipec {
namespace {

Error nodeError(const Graph &graph, const Op &op, const Twine &what) {
  std::string name = op.name;
  if (name.empty() && !op.outputs.empty() && op.outputs[0] >= 0)
    name = graph.values[op.outputs[0]].name;
  return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s", name.c_str(),
                           op.opType.c_str(), what.str().c_str());
}

/// False for operands that get no gradient by definition:
/// BatchNormalization's running mean and variance are statistics, not
/// parameters, and nothing flows back into them.
bool carriesGradient(const Op &op, size_t input) {
  return !(op.opType == "BatchNormalization" && input >= 3);
}

/// Where one gradient contribution was written, so that a lone
/// contribution can be renamed to the canonical "grad:V".
struct Contribution {
  std::vector<onnx::NodeProto> *list;
  size_t index;
};

class Differentiator {
public:
  Differentiator(const Graph &graph, const LayerGraph &layers, bool graphInputGrads)
      : graph(graph), layers(layers), graphInputGrads(graphInputGrads) {}

  Expected<Backward> run(const LossSpec &loss);

private:
  // --- emitting nodes into the current list ---
  std::string fresh() { return "bwd:" + std::to_string(counter++); }
  onnx::NodeProto &emit(StringRef opType, ArrayRef<std::string> inputs, StringRef domain = "") {
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
  static std::string out(const onnx::NodeProto &node) { return node.output(0); }
  static void setInt(onnx::NodeProto &node, StringRef name, int64_t v) {
    auto *a = node.add_attribute();
    a->set_name(name.str());
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(v);
  }
  static void setFloat(onnx::NodeProto &node, StringRef name, float v) {
    auto *a = node.add_attribute();
    a->set_name(name.str());
    a->set_type(onnx::AttributeProto::FLOAT);
    a->set_f(v);
  }
  static void setString(onnx::NodeProto &node, StringRef name, StringRef v) {
    auto *a = node.add_attribute();
    a->set_name(name.str());
    a->set_type(onnx::AttributeProto::STRING);
    a->set_s(v.str());
  }
  static void setInts(onnx::NodeProto &node, StringRef name, ArrayRef<int64_t> v) {
    auto *a = node.add_attribute();
    a->set_name(name.str());
    a->set_type(onnx::AttributeProto::INTS);
    for (int64_t x : v)
      a->add_ints(x);
  }
  std::string constInts(ArrayRef<int64_t> values) {
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
  /// A scalar of element type \p type (float or double).
  std::string constScalar(double value, DType type) {
    onnx::NodeProto &node = emit("Constant", {});
    auto *a = node.add_attribute();
    a->set_name("value");
    a->set_type(onnx::AttributeProto::TENSOR);
    auto *t = a->mutable_t();
    t->set_data_type(static_cast<int32_t>(type));
    if (type == DType::F64)
      t->add_double_data(value);
    else
      t->add_float_data(static_cast<float>(value));
    return out(node);
  }
  std::string unary(StringRef opType, const std::string &x, StringRef domain = "") {
    return out(emit(opType, {x}, domain));
  }
  std::string binary(StringRef opType, const std::string &a, const std::string &b,
                     StringRef domain = "") {
    return out(emit(opType, {a, b}, domain));
  }
  /// \p grad reduced to \p shape when it was broadcast; as is otherwise.
  std::string sumTo(const std::string &grad, const std::vector<int64_t> &gradShape,
                    const std::vector<int64_t> &shape) {
    if (gradShape == shape)
      return grad;
    onnx::NodeProto &node = emit("SumTo", {grad}, "pipec");
    setInts(node, "shape", shape);
    return out(node);
  }
  std::string reshape(const std::string &x, ArrayRef<int64_t> shape) {
    return binary("Reshape", x, constInts(shape));
  }
  /// Swaps the last two dimensions of a rank-\p rank value.
  std::string transposeLast2(const std::string &x, size_t rank) {
    std::vector<int64_t> perm;
    for (size_t i = 0; i < rank; ++i)
      perm.push_back(static_cast<int64_t>(i));
    std::swap(perm[rank - 1], perm[rank - 2]);
    onnx::NodeProto &node = emit("Transpose", {x});
    setInts(node, "perm", perm);
    return out(node);
  }
  /// \p grad [N, C, d...] summed to the per-channel [C]: the gradient of a
  /// per-channel bias.
  std::string sumToChannels(const std::string &grad, const std::vector<int64_t> &gradShape) {
    std::vector<int64_t> kept(gradShape.size(), 1);
    kept[1] = gradShape[1];
    return reshape(sumTo(grad, gradShape, kept), {gradShape[1]});
  }
  /// A per-channel [C] value reshaped to [C, 1, ...] so that it broadcasts
  /// over a rank-\p rank value [N, C, d...].
  std::string channelsFirst(const std::string &x, int64_t channels, size_t rank) {
    std::vector<int64_t> shape(rank - 1, 1);
    shape[0] = channels;
    return reshape(x, shape);
  }
  Error setWindowAttrs(onnx::NodeProto &g, const Op &op, ArrayRef<int64_t> kernel,
                       ArrayRef<int64_t> xShape, ArrayRef<int64_t> yShape);

  // --- gradient bookkeeping ---
  const Value &val(int id) const { return graph.values[id]; }
  bool isWeightSide(int id) const { return val(id).kind == ValueKind::Weight; }
  /// Selects the list a contribution to value \p id goes to in the current
  /// layer.
  void sinkFor(int id) {
    sink = isWeightSide(id) ? &result.weightGrad[layer] : &result.inputGrad[layer];
  }
  /// Records \p name (made by the last nodes emitted) as a contribution to
  /// value \p id; emits an Identity when \p name is not a fresh node output
  /// (e.g. the output gradient passed through unchanged).
  void contribute(int id, std::string name) {
    if (sink->empty() || sink->back().output(0) != name || !StringRef(name).startswith("bwd:"))
      name = unary("Identity", name);
    std::string label = "grad:" + val(id).name + "#" + std::to_string(contribs[id].size());
    sink->back().set_output(0, label);
    contribs[id].push_back({sink, sink->size() - 1});
    contribLayers[id].push_back(layer);
  }
  /// Sums the contributions to \p id into "grad:NAME" in the current sink.
  void finalize(int id) {
    auto it = contribs.find(id);
    if (it == contribs.end() || finalGrad.count(id))
      return;
    std::string name = "grad:" + val(id).name;
    if (it->second.size() == 1) {
      Contribution c = it->second.front();
      (*c.list)[c.index].set_output(0, name);
    } else {
      std::vector<std::string> parts;
      for (const Contribution &c : it->second)
        parts.push_back((*c.list)[c.index].output(0));
      emit("Sum", parts).set_output(0, name);
    }
    finalGrad[id] = name;
  }

  Error seedLoss(const LossSpec &loss);
  Error differentiateOp(const Op &op);

  const Graph &graph;
  const LayerGraph &layers;
  bool graphInputGrads;
  Backward result;
  std::vector<onnx::NodeProto> *sink = nullptr;
  int layer = 0;
  int counter = 0;
  std::vector<bool> needsGrad;
  std::map<int, std::vector<Contribution>> contribs;
  std::map<int, std::vector<int>> contribLayers;
  std::map<int, std::string> finalGrad;
  std::vector<int> layerOfOp;
};

Error Differentiator::seedLoss(const LossSpec &loss) {
  std::string outName = loss.output;
  if (outName.empty()) {
    if (loss.kind == LossSpec::Kind::ModelOutput)
      outName = "loss";
    else if (!graph.outputs.empty())
      outName = val(graph.outputs.front()).name;
  }
  int id = graph.findValue(outName);
  if (id < 0)
    return createStringError(inconvertibleErrorCode(), "loss: no value named '%s'",
                             outName.c_str());
  const Value &y = val(id);
  if (!isFloatDType(y.type) || !y.shapeKnown)
    return createStringError(inconvertibleErrorCode(),
                             "loss: '%s' must be a float value of known shape", outName.c_str());
  if (!needsGrad[id])
    return createStringError(inconvertibleErrorCode(), "loss: '%s' does not depend on a weight",
                             outName.c_str());
  layer = y.producer >= 0 ? layerOfOp[y.producer] : 0;
  sinkFor(id);
  switch (loss.kind) {
  case LossSpec::Kind::ModelOutput:
    if (y.numElements() != 1)
      return createStringError(inconvertibleErrorCode(), "loss: '%s' is not a scalar (%s)",
                               outName.c_str(), formatShape(y.shape).c_str());
    result.lossValue = outName;
    contribute(id, y.shape.empty() ? constScalar(1.0, y.type)
                                   : reshape(constScalar(1.0, y.type), y.shape));
    return Error::success();
  case LossSpec::Kind::Mse: {
    // Forward: loss = ReduceMean((y - labels)^2) over all elements.
    std::vector<onnx::NodeProto> *saved = sink;
    sink = &result.lossForward;
    std::string diff = binary("Sub", outName, loss.labels);
    std::string sq = binary("Mul", diff, diff);
    onnx::NodeProto &mean = emit("ReduceMean", {sq});
    setInt(mean, "keepdims", 0);
    mean.set_output(0, "pipec:loss");
    sink = saved;
    result.lossValue = "pipec:loss";
    // dy = 2 (y - labels) / N.
    std::string d = binary("Sub", outName, loss.labels);
    contribute(id, binary("Mul", d, constScalar(2.0 / double(y.numElements()), y.type)));
    return Error::success();
  }
  case LossSpec::Kind::SoftmaxCrossEntropy: {
    std::vector<onnx::NodeProto> *saved = sink;
    sink = &result.lossForward;
    onnx::NodeProto &ce = emit("SoftmaxCrossEntropyLoss", {outName, loss.labels});
    setString(ce, "reduction", "mean");
    ce.set_output(0, "pipec:loss");
    sink = saved;
    result.lossValue = "pipec:loss";
    onnx::NodeProto &grad = emit("SoftmaxCrossEntropyLossGrad",
                                 {constScalar(1.0, y.type), outName, loss.labels}, "pipec");
    setString(grad, "reduction", "mean");
    contribute(id, out(grad));
    return Error::success();
  }
  }
  llvm_unreachable("unknown loss kind");
}

/// Axes of a reduction, from the attribute (older opsets) or the constant
/// second input; normalised to be non-negative. Empty means all axes.
Expected<std::vector<int64_t>> reduceAxes(const Graph &graph, const Op &op, size_t rank) {
  std::vector<int64_t> axes;
  if (auto attr = attrInts(graph.node(op), "axes")) {
    axes = *attr;
  } else if (op.inputs.size() > 1 && op.inputs[1] >= 0) {
    const Value &a = graph.values[op.inputs[1]];
    if (!a.constant)
      return nodeError(graph, op, "axes must be a compile-time constant");
    for (int64_t i = 0; i < a.constant->numElements(); ++i)
      axes.push_back(a.constant->intAt(i));
  }
  for (int64_t &a : axes)
    if (a < 0)
      a += static_cast<int64_t>(rank);
  return axes;
}

/// Sets kernel_shape, strides, dilations and explicit pads on \p g, the
/// gradient node of the Conv or pool \p op whose input has shape \p xShape
/// and output \p yShape. auto_pad is resolved here as the forward kernels
/// resolve it, so the gradient kernels only know explicit pads.
Error Differentiator::setWindowAttrs(onnx::NodeProto &g, const Op &op, ArrayRef<int64_t> kernel,
                                     ArrayRef<int64_t> xShape, ArrayRef<int64_t> yShape) {
  const onnx::NodeProto &node = graph.node(op);
  size_t rank = kernel.size();
  if (rank < 1 || rank > 3 || xShape.size() != rank + 2 || yShape.size() != rank + 2)
    return nodeError(graph, op,
                     "gradient with " + Twine(int64_t(xShape.size()) - 2) +
                         " spatial dimensions is not implemented (1 to 3 are)");
  std::vector<int64_t> strides = attrInts(node, "strides").value_or(std::vector<int64_t>(rank, 1));
  std::vector<int64_t> dilations =
      attrInts(node, "dilations").value_or(std::vector<int64_t>(rank, 1));
  std::vector<int64_t> pads = attrInts(node, "pads").value_or(std::vector<int64_t>(2 * rank, 0));
  if (strides.size() != rank || dilations.size() != rank || pads.size() != 2 * rank)
    return nodeError(graph, op, "strides, dilations or pads do not match the spatial rank");
  std::string autoPad = attrString(node, "auto_pad", "NOTSET");
  if (autoPad == "VALID") {
    std::fill(pads.begin(), pads.end(), 0);
  } else if (autoPad == "SAME_UPPER" || autoPad == "SAME_LOWER") {
    for (size_t d = 0; d < rank; ++d) {
      int64_t extent = (kernel[d] - 1) * dilations[d] + 1;
      int64_t total =
          std::max<int64_t>(0, (yShape[d + 2] - 1) * strides[d] + extent - xShape[d + 2]);
      pads[d] = autoPad == "SAME_UPPER" ? total / 2 : total - total / 2;
      pads[rank + d] = total - pads[d];
    }
  } else if (autoPad != "NOTSET") {
    return nodeError(graph, op, "unknown auto_pad '" + autoPad + "'");
  }
  setInts(g, "kernel_shape", kernel);
  setInts(g, "strides", strides);
  setInts(g, "dilations", dilations);
  setInts(g, "pads", pads);
  return Error::success();
}

Error Differentiator::differentiateOp(const Op &op) {
  const onnx::NodeProto &node = graph.node(op);
  // Output gradients, complete now: the op's users have all been visited.
  bool anyGrad = false;
  for (int o : op.outputs) {
    if (o < 0)
      continue;
    sinkFor(o);
    finalize(o);
    anyGrad |= finalGrad.count(o) > 0;
  }
  auto wants = [&](size_t i) {
    return i < op.inputs.size() && op.inputs[i] >= 0 && needsGrad[op.inputs[i]] &&
           carriesGradient(op, i);
  };
  bool anyWanted = false;
  for (size_t i = 0; i < op.inputs.size(); ++i)
    anyWanted |= wants(i);
  if (!anyGrad || !anyWanted)
    return Error::success();

  // Forward values are read under the names the node uses: a folded
  // constant's Value may carry no name of its own.
  auto in = [&](size_t i) -> const std::string & { return node.input(static_cast<int>(i)); };
  auto shapeOf = [&](size_t i) -> const std::vector<int64_t> & { return val(op.inputs[i]).shape; };
  DType type = val(op.outputs[0]).type;
  for (int i : op.inputs)
    if (i >= 0 && needsGrad[i] && !val(i).shapeKnown)
      return nodeError(graph, op, "input '" + val(i).name + "' has no static shape");
  const std::string &y = node.output(0);
  const std::vector<int64_t> &yShape = val(op.outputs[0]).shape;
  // The gradient of output k, or "" when nothing downstream needs it.
  auto dyOf = [&](size_t k) -> std::string {
    auto it = op.outputs[k] < 0 ? finalGrad.end() : finalGrad.find(op.outputs[k]);
    return it == finalGrad.end() ? std::string() : it->second;
  };
  // Every rule but Split's differentiates through output 0 only.
  if (op.opType != "Split")
    for (size_t k = 1; k < op.outputs.size(); ++k)
      if (!dyOf(k).empty())
        return nodeError(graph, op, "gradient through output " + Twine(k) + " is not implemented");
  std::string dy = dyOf(0);
  if (dy.empty() && op.opType != "Split")
    return Error::success();
  const std::string &t = op.opType;
  auto forEachWanted = [&](auto &&f) -> Error {
    for (size_t i = 0; i < op.inputs.size(); ++i)
      if (wants(i)) {
        sinkFor(op.inputs[i]);
        if (Error err = f(i))
          return err;
      }
    return Error::success();
  };

  // Data movement: the gradient is dY moved back into X's layout.
  if (t == "Identity" || t == "Dropout")
    return forEachWanted([&](size_t i) {
      if (i == 0)
        contribute(op.inputs[0], dy);
      return Error::success();
    });
  if (t == "Cast")
    return forEachWanted([&](size_t) {
      onnx::NodeProto &cast = emit("Cast", {dy});
      setInt(cast, "to", static_cast<int64_t>(val(op.inputs[0]).type));
      contribute(op.inputs[0], out(cast));
      return Error::success();
    });
  if (t == "Reshape" || t == "Squeeze" || t == "Unsqueeze" || t == "Flatten")
    return forEachWanted([&](size_t i) {
      if (i == 0)
        contribute(op.inputs[0], reshape(dy, shapeOf(0)));
      return Error::success();
    });
  if (t == "Neg")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], unary("Neg", dy));
      return Error::success();
    });
  // Elementwise arithmetic with numpy broadcasting: SumTo undoes it.
  if (t == "Add" || t == "Sub")
    return forEachWanted([&](size_t i) {
      std::string g = (t == "Sub" && i == 1) ? unary("Neg", dy) : dy;
      contribute(op.inputs[i], sumTo(g, yShape, shapeOf(i)));
      return Error::success();
    });
  if (t == "Mul")
    return forEachWanted([&](size_t i) {
      std::string g = binary("Mul", dy, in(1 - i));
      contribute(op.inputs[i], sumTo(g, yShape, shapeOf(i)));
      return Error::success();
    });
  if (t == "Div")
    return forEachWanted([&](size_t i) {
      // d/da (a / b) = 1 / b; d/db (a / b) = -(a / b) / b = -y / b.
      std::string g = i == 0 ? binary("Div", dy, in(1))
                             : unary("Neg", binary("Div", binary("Mul", dy, y), in(1)));
      contribute(op.inputs[i], sumTo(g, yShape, shapeOf(i)));
      return Error::success();
    });
  // Activations and unary math.
  if (t == "Relu" || t == "Erf")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], binary(t + "Grad", dy, in(0), "pipec"));
      return Error::success();
    });
  if (t == "Gelu")
    return forEachWanted([&](size_t) {
      onnx::NodeProto &g = emit("GeluGrad", {dy, in(0)}, "pipec");
      setString(g, "approximate", attrString(node, "approximate", "none"));
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  if (t == "Abs")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], binary("Mul", dy, unary("Sign", in(0))));
      return Error::success();
    });
  if (t == "Clip")
    return forEachWanted([&](size_t i) -> Error {
      // Inside [min, max] (bounds included) Y equals X and dY passes.
      if (i != 0)
        return nodeError(graph, op, "gradient for the bounds min / max is not implemented");
      std::string inside = binary("Equal", in(0), y);
      contribute(op.inputs[0], out(emit("Where", {inside, dy, constScalar(0.0, type)})));
      return Error::success();
    });
  if (t == "Max" || t == "Min")
    return forEachWanted([&](size_t i) {
      // dY goes to the first operand that equals Y (ties are not split).
      std::string zero = constScalar(0.0, type);
      std::string g = out(emit("Where", {binary("Equal", in(i), y), dy, zero}));
      for (size_t k = 0; k < i; ++k)
        g = out(emit("Where", {binary("Equal", in(k), y), zero, g}));
      contribute(op.inputs[i], sumTo(g, yShape, shapeOf(i)));
      return Error::success();
    });
  if (t == "Sum")
    return forEachWanted([&](size_t i) {
      contribute(op.inputs[i], sumTo(dy, yShape, shapeOf(i)));
      return Error::success();
    });
  if (t == "Tanh" || t == "Sigmoid")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], binary(t + "Grad", dy, y, "pipec"));
      return Error::success();
    });
  if (t == "Reciprocal")
    return forEachWanted([&](size_t) {
      // d (1 / x) = -1 / x^2 = -y^2.
      contribute(op.inputs[0], unary("Neg", binary("Mul", dy, binary("Mul", y, y))));
      return Error::success();
    });
  if (t == "Exp")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], binary("Mul", dy, y));
      return Error::success();
    });
  if (t == "Log")
    return forEachWanted([&](size_t) {
      contribute(op.inputs[0], binary("Div", dy, in(0)));
      return Error::success();
    });
  if (t == "Sqrt")
    return forEachWanted([&](size_t) {
      // d sqrt(x) = 0.5 / sqrt(x).
      contribute(op.inputs[0], binary("Div", binary("Mul", dy, constScalar(0.5, type)), y));
      return Error::success();
    });
  if (t == "Pow")
    return forEachWanted([&](size_t i) -> Error {
      const Value &e = val(op.inputs[1]);
      if (i == 1 || !e.constant || e.constant->numElements() != 1)
        return nodeError(graph, op, "gradient only for a constant scalar exponent");
      double c = e.constant->floatAt(0);
      std::string g = binary("Pow", in(0), constScalar(c - 1.0, type));
      g = binary("Mul", binary("Mul", g, constScalar(c, type)), dy);
      contribute(op.inputs[0], g);
      return Error::success();
    });
  if (t == "Transpose")
    return forEachWanted([&](size_t) {
      size_t rank = shapeOf(0).size();
      std::vector<int64_t> perm;
      if (auto p = attrInts(node, "perm"))
        perm = *p;
      else
        for (size_t k = 0; k < rank; ++k)
          perm.push_back(static_cast<int64_t>(rank - 1 - k));
      std::vector<int64_t> inverse(rank);
      for (size_t k = 0; k < rank; ++k)
        inverse[perm[k]] = static_cast<int64_t>(k);
      onnx::NodeProto &tr = emit("Transpose", {dy});
      setInts(tr, "perm", inverse);
      contribute(op.inputs[0], out(tr));
      return Error::success();
    });
  // Reductions and normalisations.
  if (t == "ReduceMean" || t == "ReduceSum")
    return forEachWanted([&](size_t i) -> Error {
      if (i != 0)
        return Error::success();
      const std::vector<int64_t> &xShape = shapeOf(0);
      auto axes = reduceAxes(graph, op, xShape.size());
      if (!axes)
        return axes.takeError();
      if (axes->empty() && !(t == "ReduceSum" && attrInt(node, "noop_with_empty_axes", 0)))
        for (size_t k = 0; k < xShape.size(); ++k)
          axes->push_back(static_cast<int64_t>(k));
      std::vector<int64_t> kept = xShape;
      int64_t count = 1;
      for (int64_t a : *axes) {
        count *= xShape[a];
        kept[a] = 1;
      }
      std::string g = binary("Expand", reshape(dy, kept), constInts(xShape));
      if (t == "ReduceMean")
        g = binary("Mul", g, constScalar(1.0 / double(count), type));
      contribute(op.inputs[0], g);
      return Error::success();
    });
  if (t == "Softmax")
    return forEachWanted([&](size_t) -> Error {
      int64_t axis = attrInt(node, "axis", graph.opsetFor("") >= 13 ? -1 : 1);
      if (graph.opsetFor("") < 13 && axis != static_cast<int64_t>(yShape.size()) - 1 && axis != -1)
        return nodeError(graph, op, "gradient of pre-13 Softmax needs the last axis");
      onnx::NodeProto &g = emit("SoftmaxGrad", {dy, y}, "pipec");
      setInt(g, "axis", axis);
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  // Linear algebra: products with the other operand, transposed.
  if (t == "MatMul")
    return forEachWanted([&](size_t i) -> Error {
      const std::vector<int64_t> &a = shapeOf(0), &b = shapeOf(1);
      if (a.size() < 2 || b.size() < 2)
        return nodeError(graph, op, "gradient of a 1-D MatMul operand is not implemented");
      if (i == 0 && b.size() == 2) {
        // dA = dY B^T as one GEMM over the folded batch rows: the BLAS reads B
        // transposed, so no transposed copy of the weight is made.
        int64_t n = yShape.back();
        onnx::NodeProto &g = emit("Gemm", {reshape(dy, {-1, n}), in(1)});
        setInt(g, "transB", 1);
        std::vector<int64_t> gShape = yShape;
        gShape.back() = a.back();
        contribute(op.inputs[0], sumTo(reshape(out(g), gShape), gShape, a));
      } else if (i == 0) {
        // dA = dY B^T, summed over broadcast batch dimensions.
        std::string g = binary("MatMul", dy, transposeLast2(in(1), b.size()));
        std::vector<int64_t> gShape = yShape;
        gShape.back() = a.back();
        contribute(op.inputs[0], sumTo(g, gShape, a));
      } else if (b.size() == 2) {
        // dB = A^T dY with every batch dimension folded into the rows.
        int64_t k = a.back(), n = yShape.back();
        std::string a2 = reshape(in(0), {-1, k});
        std::string dy2 = reshape(dy, {-1, n});
        onnx::NodeProto &g = emit("Gemm", {a2, dy2});
        setInt(g, "transA", 1);
        contribute(op.inputs[1], out(g));
      } else {
        std::string g = binary("MatMul", transposeLast2(in(0), a.size()), dy);
        std::vector<int64_t> gShape = yShape;
        gShape[gShape.size() - 2] = a.back();
        contribute(op.inputs[1], sumTo(g, gShape, b));
      }
      return Error::success();
    });
  if (t == "Gemm")
    return forEachWanted([&](size_t i) {
      float alpha = attrFloat(node, "alpha", 1.0f), beta = attrFloat(node, "beta", 1.0f);
      bool ta = attrInt(node, "transA", 0) != 0, tb = attrInt(node, "transB", 0) != 0;
      onnx::NodeProto *g = nullptr;
      if (i == 0) {
        // d op(A) = alpha dY op(B)^T.
        g = ta ? &emit("Gemm", {in(1), dy}) : &emit("Gemm", {dy, in(1)});
        setInt(*g, "transA", ta ? tb : 0);
        setInt(*g, "transB", ta ? 1 : !tb);
      } else if (i == 1) {
        // d op(B) = alpha op(A)^T dY.
        g = tb ? &emit("Gemm", {dy, in(0)}) : &emit("Gemm", {in(0), dy});
        setInt(*g, "transA", tb ? 1 : !ta);
        setInt(*g, "transB", tb ? ta : 0);
      } else {
        std::string s = beta == 1.0f ? dy : binary("Mul", dy, constScalar(beta, type));
        contribute(op.inputs[2], sumTo(s, yShape, shapeOf(2)));
        return Error::success();
      }
      setFloat(*g, "alpha", alpha);
      contribute(op.inputs[i], out(*g));
      return Error::success();
    });
  // Embedding lookup and losses.
  if (t == "Gather")
    return forEachWanted([&](size_t i) -> Error {
      if (i != 0)
        return Error::success();
      onnx::NodeProto &g = emit("GatherGrad", {dy, in(1)}, "pipec");
      setInt(g, "axis", attrInt(node, "axis", 0));
      setInts(g, "shape", shapeOf(0));
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  if (t == "SoftmaxCrossEntropyLoss")
    return forEachWanted([&](size_t i) -> Error {
      if (i != 0)
        return Error::success();
      if (op.inputs.size() > 2 && op.inputs[2] >= 0)
        return nodeError(graph, op, "gradient with class weights is not implemented");
      std::string reduction = attrString(node, "reduction", "mean");
      if (reduction == "none")
        return nodeError(graph, op, "gradient of reduction 'none' is not implemented");
      onnx::NodeProto &g = emit("SoftmaxCrossEntropyLossGrad", {dy, in(0), in(1)}, "pipec");
      setString(g, "reduction", reduction);
      if (const auto *ii = findAttr(node, "ignore_index"))
        setInt(g, "ignore_index", ii->i());
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  if (t == "LayerNormalization")
    return forEachWanted([&](size_t i) -> Error {
      int64_t axis = attrInt(node, "axis", -1);
      float epsilon = attrFloat(node, "epsilon", 1e-5f);
      if (i == 0 || i == 1) {
        bool input = i == 0;
        onnx::NodeProto &g = input ? emit("LayerNormGradInput", {dy, in(0), in(1)}, "pipec")
                                   : emit("LayerNormGradWeight", {dy, in(0)}, "pipec");
        setInt(g, "axis", axis);
        setFloat(g, "epsilon", epsilon);
        if (!input)
          setInts(g, "shape", shapeOf(1));
        contribute(op.inputs[i], out(g));
      } else {
        contribute(op.inputs[2], sumTo(dy, yShape, shapeOf(2)));
      }
      return Error::success();
    });
  // Convolution, pooling and batch normalisation ([N, C, d1..] layouts).
  if (t == "Conv")
    return forEachWanted([&](size_t i) -> Error {
      const std::vector<int64_t> &xShape = shapeOf(0), &wShape = shapeOf(1);
      if (i == 2) {
        contribute(op.inputs[2], sumToChannels(dy, yShape));
        return Error::success();
      }
      // dX scatters W^T dY back through col2im; dW is dY times X's im2col
      // columns, transposed.
      onnx::NodeProto &g = i == 0 ? emit("ConvGradInput", {dy, in(1)}, "pipec")
                                  : emit("ConvGradWeight", {dy, in(0)}, "pipec");
      std::vector<int64_t> kernel(wShape.begin() + std::min<size_t>(2, wShape.size()),
                                  wShape.end());
      if (Error err = setWindowAttrs(g, op, kernel, xShape, yShape))
        return err;
      setInt(g, "group", attrInt(node, "group", 1));
      setInts(g, "shape", i == 0 ? xShape : wShape);
      contribute(op.inputs[i], out(g));
      return Error::success();
    });
  if (t == "MaxPool" || t == "AveragePool" || t == "GlobalMaxPool")
    return forEachWanted([&](size_t) -> Error {
      const std::vector<int64_t> &xShape = shapeOf(0);
      std::vector<int64_t> kernel;
      if (t == "GlobalMaxPool")
        kernel.assign(xShape.begin() + std::min<size_t>(2, xShape.size()), xShape.end());
      else if (auto k = attrInts(node, "kernel_shape"))
        kernel = *k;
      else
        return nodeError(graph, op, "missing attribute 'kernel_shape'");
      bool isMax = t != "AveragePool";
      onnx::NodeProto &g = isMax ? emit("MaxPoolGrad", {dy, in(0)}, "pipec")
                                 : emit("AveragePoolGrad", {dy}, "pipec");
      if (Error err = setWindowAttrs(g, op, kernel, xShape, yShape))
        return err;
      if (!isMax) {
        setInt(g, "count_include_pad", attrInt(node, "count_include_pad", 0));
        setInts(g, "shape", xShape);
      }
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  if (t == "GlobalAveragePool")
    return forEachWanted([&](size_t) {
      const std::vector<int64_t> &xShape = shapeOf(0);
      int64_t size = 1;
      for (size_t d = 2; d < xShape.size(); ++d)
        size *= xShape[d];
      std::string g = binary("Expand", dy, constInts(xShape));
      contribute(op.inputs[0], binary("Mul", g, constScalar(1.0 / double(size), type)));
      return Error::success();
    });
  if (t == "BatchNormalization")
    return forEachWanted([&](size_t i) -> Error {
      // Inference form: Y = Scale (X - Mean) / sqrt(Var + epsilon) + B, the
      // running statistics being constants (carriesGradient).
      if (graph.opsetFor("") >= 14 && attrInt(node, "training_mode", 0))
        return nodeError(graph, op,
                         "gradient of training-mode BatchNormalization is not "
                         "implemented (only inference mode is)");
      if (op.inputs.size() < 5 || llvm::is_contained(op.inputs, -1))
        return nodeError(graph, op, "expects 5 inputs");
      const std::vector<int64_t> &xShape = shapeOf(0);
      for (size_t k = 1; k < 5; ++k)
        if (val(op.inputs[k]).type != type)
          return nodeError(graph, op,
                           "gradient with parameters of another element type than X is not "
                           "implemented");
      float epsilon = attrFloat(node, "epsilon", 1e-5f);
      if (i == 0) {
        // dX = dY Scale / sqrt(Var + epsilon), per channel.
        std::string rstd = unary("Sqrt", binary("Add", in(4), constScalar(epsilon, type)));
        std::string factor = channelsFirst(binary("Div", in(1), rstd), xShape[1], xShape.size());
        contribute(op.inputs[0], binary("Mul", dy, factor));
      } else if (i == 1) {
        onnx::NodeProto &g = emit("BatchNormGradWeight", {dy, in(0), in(3), in(4)}, "pipec");
        setFloat(g, "epsilon", epsilon);
        contribute(op.inputs[1], out(g));
      } else {
        contribute(op.inputs[2], sumToChannels(dy, yShape));
      }
      return Error::success();
    });
  // Broadcasting, selection and slicing.
  if (t == "Expand")
    return forEachWanted([&](size_t i) {
      if (i == 0)
        contribute(op.inputs[0], sumTo(dy, yShape, shapeOf(0)));
      return Error::success();
    });
  if (t == "Where")
    return forEachWanted([&](size_t i) {
      if (i == 0)
        return Error::success();
      std::string zero = constScalar(0.0, type);
      std::string g =
          i == 1 ? out(emit("Where", {in(0), dy, zero})) : out(emit("Where", {in(0), zero, dy}));
      contribute(op.inputs[i], sumTo(g, yShape, shapeOf(i)));
      return Error::success();
    });
  if (t == "Concat")
    return forEachWanted([&](size_t i) {
      int64_t axis = attrInt(node, "axis", 0);
      if (axis < 0)
        axis += static_cast<int64_t>(yShape.size());
      int64_t start = 0;
      for (size_t k = 0; k < i; ++k)
        start += shapeOf(k)[axis];
      std::string g =
          out(emit("Slice", {dy, constInts({start}), constInts({start + shapeOf(i)[axis]}),
                             constInts({axis})}));
      contribute(op.inputs[i], g);
      return Error::success();
    });
  if (t == "Split")
    return forEachWanted([&](size_t i) {
      if (i != 0)
        return Error::success();
      int64_t axis = attrInt(node, "axis", 0);
      if (axis < 0)
        axis += static_cast<int64_t>(shapeOf(0).size());
      std::vector<std::string> parts;
      for (size_t k = 0; k < op.outputs.size(); ++k) {
        std::string part = dyOf(k);
        if (part.empty()) {
          const std::vector<int64_t> &shape = val(op.outputs[k]).shape;
          part = binary("Expand", constScalar(0.0, type), constInts(shape));
        }
        parts.push_back(part);
      }
      onnx::NodeProto &g = emit("Concat", parts);
      setInt(g, "axis", axis);
      contribute(op.inputs[0], out(g));
      return Error::success();
    });
  if (t == "Slice")
    return forEachWanted([&](size_t i) -> Error {
      if (i != 0)
        return Error::success();
      // Step-1 slices only: the gradient pads dY back with zeros.
      const std::vector<int64_t> &xShape = shapeOf(0);
      size_t rank = xShape.size();
      auto constant = [&](size_t k) -> std::vector<int64_t> {
        std::vector<int64_t> v;
        if (k < op.inputs.size() && op.inputs[k] >= 0 && val(op.inputs[k]).constant)
          for (int64_t e = 0; e < val(op.inputs[k]).constant->numElements(); ++e)
            v.push_back(val(op.inputs[k]).constant->intAt(e));
        return v;
      };
      std::vector<int64_t> starts = constant(1), axes = constant(3), steps = constant(4);
      if (graph.opsetFor("") < 10) {
        starts = attrInts(node, "starts").value_or(std::vector<int64_t>{});
        axes = attrInts(node, "axes").value_or(std::vector<int64_t>{});
      }
      if (starts.empty() && !xShape.empty())
        return nodeError(graph, op, "gradient needs constant starts");
      for (int64_t s : steps)
        if (s != 1)
          return nodeError(graph, op, "gradient of a slice with step != 1 is not implemented");
      if (axes.empty())
        for (size_t k = 0; k < starts.size(); ++k)
          axes.push_back(static_cast<int64_t>(k));
      // Zeros are concatenated before and after dY along each sliced axis
      // (the CPU backend has no Pad), growing it back to X's shape.
      std::string g = dy;
      std::vector<int64_t> shape = yShape;
      for (size_t k = 0; k < axes.size(); ++k) {
        int64_t a = axes[k] < 0 ? axes[k] + static_cast<int64_t>(rank) : axes[k];
        int64_t dim = xShape[a];
        int64_t s = std::clamp<int64_t>(starts[k] < 0 ? starts[k] + dim : starts[k], 0, dim);
        int64_t before = s, after = dim - s - shape[a];
        if (before == 0 && after == 0)
          continue;
        std::vector<std::string> parts;
        for (int64_t width : {before, int64_t(-1), after}) {
          if (width == 0)
            continue;
          if (width < 0) {
            parts.push_back(g);
            continue;
          }
          std::vector<int64_t> zeroShape = shape;
          zeroShape[a] = width;
          parts.push_back(binary("Expand", constScalar(0.0, type), constInts(zeroShape)));
        }
        onnx::NodeProto &cat = emit("Concat", parts);
        setInt(cat, "axis", a);
        g = out(cat);
        shape[a] = dim;
      }
      contribute(op.inputs[0], g);
      return Error::success();
    });
  return nodeError(graph, op, "no gradient rule");
}

Expected<Backward> Differentiator::run(const LossSpec &loss) {
  size_t numLayers = layers.layers.size();
  result.inputGrad.resize(numLayers);
  result.weightGrad.resize(numLayers);
  layerOfOp.assign(graph.ops.size(), 0);
  for (size_t l = 0; l < numLayers; ++l)
    for (int op : layers.layers[l].ops)
      layerOfOp[op] = static_cast<int>(l);

  // Which values carry a gradient: float values computed from a trainable
  // weight (an initializer) or, if asked, from a float graph input.
  needsGrad.assign(graph.values.size(), false);
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    bool trainable = value.kind == ValueKind::Weight && value.producer < 0;
    bool input = graphInputGrads && value.kind == ValueKind::Input;
    needsGrad[v] = isFloatDType(value.type) && (trainable || input);
  }
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    bool any = false;
    for (size_t i = 0; i < op.inputs.size(); ++i)
      any |= op.inputs[i] >= 0 && needsGrad[op.inputs[i]] && carriesGradient(op, i);
    for (int o : op.outputs)
      if (o >= 0 && any && isFloatDType(val(o).type) && val(o).kind != ValueKind::Constant)
        needsGrad[o] = true;
  }

  if (Error err = seedLoss(loss))
    return err;
  for (int l = static_cast<int>(numLayers) - 1; l >= 0; --l) {
    layer = l;
    const std::vector<int> &ops = layers.layers[l].ops;
    for (auto it = ops.rbegin(); it != ops.rend(); ++it)
      if (Error err = differentiateOp(graph.ops[*it]))
        return err;
  }
  // Leaves: trainable weights and graph inputs, summed in the lowest layer
  // that contributed.
  for (const auto &[id, list] : contribs) {
    const Value &value = val(id);
    if (value.producer >= 0)
      continue;
    layer = *std::min_element(contribLayers[id].begin(), contribLayers[id].end());
    sinkFor(id);
    finalize(id);
    if (value.kind == ValueKind::Weight)
      result.weightGrads[value.name] = finalGrad[id];
    else
      result.inputGrads[value.name] = finalGrad[id];
  }
  return std::move(result);
}

} // namespace

Expected<Backward> differentiate(const Graph &graph, const LayerGraph &layers, const LossSpec &loss,
                                 bool graphInputGrads) {
  Differentiator d(graph, layers, graphInputGrads);
  return d.run(loss);
}

} // namespace pipec
