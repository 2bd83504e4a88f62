//===- InferShapes.cpp - infer-shapes: a static shape for every value -----===//
#include "passes/InferShapes.h"
#include "passes/ConstantEvaluator.h"
#include "passes/ContribShapes.h"
#include "support/Attributes.h"

#include "onnx/defs/schema.h"
#include "onnx/shape_inference/implementation.h"

#include "llvm/Support/FormatVariadic.h"

#include <deque>
#include <unordered_map>

using namespace llvm;

namespace pipec {
namespace {

class ShapeInferer {
public:
  explicit ShapeInferer(Graph &graph) : graph(graph) {
    for (const auto &info : graph.model->graph().value_info())
      declared[info.name()] = &info;
    for (const auto &info : graph.model->graph().output())
      declared[info.name()] = &info;
  }

  Expected<bool> run();

private:
  Graph &graph;
  StringMap<const onnx::ValueInfoProto *> declared;
  /// evaluate()'s results by value id, null where it failed.
  std::unordered_map<int, std::shared_ptr<const ConstTensor>> evaluated;

  template <typename... Ts> Error fail(const Op &op, const char *fmt, Ts &&...args) {
    return createStringError(inconvertibleErrorCode(), "%s: %s: %s", graph.path.c_str(),
                             describeOp(graph, op).c_str(),
                             formatv(fmt, std::forward<Ts>(args)...).str().c_str());
  }
  /// What the symbolic dimensions were bound to, and the tables of the model
  /// (2-D initializers that Gather reads rows of, such as position
  /// embeddings) with fewer rows than a bound dimension: a shape that
  /// fails after binding often means a binding the model cannot take.
  std::string bindingHint() const;

  /// The kind of an output computed at compile time: a parameter when it
  /// derives from one or is a fill (the weights of models exported without
  /// their values are ConstantOfShape fills), a constant otherwise.
  ValueKind derivedKind(const Op &op, const Value &out) const {
    if (!looksLikeParameter(out.type, out.numElements()))
      return ValueKind::Constant;
    if (op.is(OpId::ConstantOfShape))
      return ValueKind::Weight;
    for (int id : op.inputs)
      if (id >= 0 && graph.values[id].kind == ValueKind::Weight)
        return ValueKind::Weight;
    return ValueKind::Constant;
  }
  /// The value of input \p id when it is a small compile-time constant.
  std::shared_ptr<const ConstTensor> knownValue(int id);
  /// The value of compile-time value \p id (a Constant or a Weight, or
  /// computed from those alone), evaluated through its producers; null when
  /// it reads run-time data, is too large or an op of the way does not
  /// fold. Results are memoized in `evaluated`, not stored in the graph:
  /// a weight stays a weight for the ops that compute with it.
  std::shared_ptr<const ConstTensor> evaluate(int id);
  /// The value of input \p i of \p op that shape inference may read: a
  /// constant, or for an input ONNX does not mark differentiable (the
  /// scales of Resize, the shape of Reshape) any compile-time value. Such a
  /// value that no op reads differentiably becomes a constant of the graph.
  std::shared_ptr<const ConstTensor> shapeData(const Op &op, size_t i);
  /// Whether every read of value \p id is at an input ONNX marks not
  /// differentiable.
  bool readOnlyAsShapeData(int id) const;
  Expected<bool> tryFold(Op &op);
  /// ONNX's inference of \p op's output types, given the data of its
  /// constant inputs, and with \p withShapeData that of every input
  /// shapeData() gives; std::nullopt when a dimension stays unknown.
  Expected<std::optional<std::vector<TensorType>>> onnxInference(Op &op, bool withShapeData);
  std::optional<TensorType> declaredType(const Value &value);
  /// Conv and ConvTranspose: the input's channels against the weight's
  /// (ONNX's inference does not compare them; a mismatch would reach run).
  Error checkConvChannels(const Op &op);
  Error inferOp(Op &op);
};

std::shared_ptr<const ConstTensor> ShapeInferer::knownValue(int id) {
  Value &value = graph.values[id];
  if (value.constant)
    return value.constant;
  if (value.kind != ValueKind::Constant || value.producer >= 0 || !value.shapeKnown ||
      value.numElements() > MaxFoldElements)
    return nullptr;
  auto read = graph.readConstant(id, MaxFoldElements);
  if (!read) {
    consumeError(read.takeError());
    return nullptr;
  }
  value.constant = *read;
  return value.constant;
}

/// ONNX's differentiation category of input \p i of \p op. Schemas before
/// the categories were written (Resize-11, Reshape-5) say Unknown; the op's
/// newest schema then answers for the input of the same name.
onnx::OpSchema::DifferentiationCategory inputCategory(const Graph &graph, const Op &op, size_t i) {
  auto categoryIn = [&](const onnx::OpSchema *schema, const std::string *name) {
    const auto &formals = schema->inputs();
    if (formals.empty())
      return std::pair(onnx::OpSchema::Unknown, std::string());
    const onnx::OpSchema::FormalParameter *formal = nullptr;
    if (name) {
      for (const auto &f : formals)
        if (f.GetName() == *name)
          formal = &f;
    } else {
      formal = &formals[std::min(i, formals.size() - 1)];
      if (i >= formals.size() && formal->GetOption() != onnx::OpSchema::Variadic)
        formal = nullptr;
    }
    if (!formal)
      return std::pair(onnx::OpSchema::Unknown, std::string());
    return std::pair(formal->GetDifferentiationCategory(), formal->GetName());
  };
  int64_t opset = graph.opsetFor(op.domain);
  const onnx::OpSchema *schema =
      onnx::OpSchemaRegistry::Schema(op.opType, static_cast<int>(opset ? opset : 1), op.domain);
  if (!schema)
    return onnx::OpSchema::Unknown;
  auto [category, name] = categoryIn(schema, nullptr);
  if (category != onnx::OpSchema::Unknown || name.empty())
    return category;
  const onnx::OpSchema *newest = onnx::OpSchemaRegistry::Schema(op.opType, op.domain);
  if (!newest || newest == schema)
    return category;
  return categoryIn(newest, &name).first;
}

std::shared_ptr<const ConstTensor> ShapeInferer::evaluate(int id) {
  Value &value = graph.values[id];
  if (value.constant)
    return value.constant;
  if ((value.kind != ValueKind::Constant && value.kind != ValueKind::Weight) || !value.shapeKnown ||
      value.numElements() > MaxFoldElements)
    return nullptr;
  if (auto it = evaluated.find(id); it != evaluated.end())
    return it->second;
  std::shared_ptr<const ConstTensor> result;
  if (value.producer < 0) {
    auto read = graph.readConstant(id, MaxFoldElements);
    if (read)
      result = *read;
    else
      consumeError(read.takeError());
  } else if (const Op &op = graph.ops[value.producer];
             !op.dead && op.outputs.size() == 1 && isEvaluable(graph, op)) {
    std::vector<std::shared_ptr<const ConstTensor>> held;
    std::vector<const ConstTensor *> inputs;
    bool known = true;
    for (int in : op.inputs) {
      held.push_back(in < 0 ? nullptr : evaluate(in));
      known &= in < 0 || held.back();
      inputs.push_back(held.back().get());
    }
    if (known) {
      auto out = evaluateOp(graph, op, inputs, MaxFoldElements);
      if (!out)
        consumeError(out.takeError());
      else if (*out && (*out)->size() == 1)
        result = std::make_shared<const ConstTensor>(std::move((**out)[0]));
    }
  }
  evaluated[id] = result;
  return result;
}

bool ShapeInferer::readOnlyAsShapeData(int id) const {
  const Value &value = graph.values[id];
  if (value.isGraphOutput || value.users.empty())
    return false;
  for (int user : value.users) {
    const Op &op = graph.ops[user];
    if (op.dead)
      continue;
    for (size_t i = 0; i < op.inputs.size(); ++i)
      if (op.inputs[i] == id && inputCategory(graph, op, i) != onnx::OpSchema::NonDifferentiable)
        return false;
    if (is_contained(op.captures, id))
      return false;
  }
  return true;
}

std::shared_ptr<const ConstTensor> ShapeInferer::shapeData(const Op &op, size_t i) {
  int id = op.inputs[i];
  if (auto known = knownValue(id))
    return known;
  if (inputCategory(graph, op, i) == onnx::OpSchema::Differentiable)
    return nullptr;
  auto value = evaluate(id);
  if (value && readOnlyAsShapeData(id)) {
    Value &v = graph.values[id];
    v.constant = value;
    v.kind = ValueKind::Constant;
  }
  return value;
}

Expected<bool> ShapeInferer::tryFold(Op &op) {
  ConstTensor folded;
  if (op.is(OpId::Shape) || op.is(OpId::Size)) {
    if (op.inputs.empty() || op.inputs[0] < 0)
      return fail(op, "has no input");
    const Value &in = graph.values[op.inputs[0]];
    folded.type = DType::I64;
    if (op.is(OpId::Size)) {
      folded.ints = {in.numElements()};
    } else {
      int64_t rank = static_cast<int64_t>(in.shape.size());
      int64_t start = 0, end = rank;
      for (const auto &attr : graph.node(op).attribute()) {
        if (attr.name() == "start")
          start = attr.i();
        if (attr.name() == "end")
          end = attr.i();
      }
      start = std::clamp<int64_t>(start < 0 ? start + rank : start, 0, rank);
      end = std::clamp<int64_t>(end < 0 ? end + rank : end, 0, rank);
      for (int64_t d = start; d < end; ++d)
        folded.ints.push_back(in.shape[d]);
      folded.shape = {static_cast<int64_t>(folded.ints.size())};
    }
  } else {
    if (!isEvaluable(graph, op))
      return false;
    std::vector<std::shared_ptr<const ConstTensor>> held;
    std::vector<const ConstTensor *> inputs;
    for (int id : op.inputs) {
      if (id < 0) {
        inputs.push_back(nullptr);
        continue;
      }
      auto value = knownValue(id);
      if (!value)
        return false;
      inputs.push_back(value.get());
      held.push_back(std::move(value));
    }
    auto result = evaluateOp(graph, op, inputs, MaxFoldElements);
    if (!result)
      return result.takeError();
    if (!*result)
      return false;
    if ((*result)->size() != 1 || op.outputs.size() != 1 || op.outputs[0] < 0)
      return false;
    folded = std::move((**result)[0]);
  }
  Value &out = graph.values[op.outputs[0]];
  out.type = folded.type;
  out.shape = folded.shape;
  out.shapeKnown = true;
  out.kind = derivedKind(op, out);
  out.constant = std::make_shared<const ConstTensor>(std::move(folded));
  return true;
}

/// Writes \p t as ONNX typed data; false for half types, whose values ONNX's
/// inference cannot read from typed fields (it is then given no data).
bool fillTensorProto(const ConstTensor &t, onnx::TensorProto &proto) {
  if (t.type == DType::F16 || t.type == DType::BF16)
    return false;
  proto.set_data_type(static_cast<int32_t>(t.type));
  for (int64_t d : t.shape)
    proto.add_dims(d);
  int64_t n = t.numElements();
  switch (t.type) {
  case DType::F32:
    for (int64_t i = 0; i < n; ++i)
      proto.add_float_data(static_cast<float>(t.floats[i]));
    break;
  case DType::F64:
    for (int64_t i = 0; i < n; ++i)
      proto.add_double_data(t.floats[i]);
    break;
  case DType::I64:
    for (int64_t i = 0; i < n; ++i)
      proto.add_int64_data(t.ints[i]);
    break;
  case DType::U32:
  case DType::U64:
    for (int64_t i = 0; i < n; ++i)
      proto.add_uint64_data(static_cast<uint64_t>(t.ints[i]));
    break;
  default:
    for (int64_t i = 0; i < n; ++i)
      proto.add_int32_data(static_cast<int32_t>(t.ints[i]));
  }
  return true;
}

std::string ShapeInferer::bindingHint() const {
  if (graph.boundDims.empty())
    return "";
  std::string hint = " (the inputs' symbolic dimensions were bound: ";
  int64_t largest = 0;
  for (const auto &[name, value] : graph.boundDims) {
    hint += formatv("{0}{1}={2}", &name == &graph.boundDims.front().first ? "" : ", ", name, value)
                .str();
    largest = std::max(largest, value);
  }
  for (const Op &op : graph.ops) {
    if (op.dead || !op.is(OpId::Gather) || op.inputs.empty() || op.inputs[0] < 0)
      continue;
    const Value &table = graph.values[op.inputs[0]];
    if (table.producer >= 0 || table.kind != ValueKind::Weight || table.shape.size() != 2 ||
        table.shape[0] >= largest)
      continue;
    hint += formatv("; the table '{0}' has {1} rows: a dimension it indexes (such as --seq) "
                    "fits up to {1}",
                    table.name, table.shape[0])
                .str();
    break;
  }
  return hint + ")";
}

Expected<std::optional<std::vector<TensorType>>> ShapeInferer::onnxInference(Op &op,
                                                                             bool withShapeData) {
  int64_t opset = graph.opsetFor(op.domain);
  const onnx::OpSchema *schema =
      onnx::OpSchemaRegistry::Schema(op.opType, static_cast<int>(opset ? opset : 1), op.domain);
  if (!schema || !schema->has_type_and_shape_inference_function())
    return std::nullopt;
  onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(op.nodeIndex);
  std::deque<onnx::TypeProto> types;
  std::deque<onnx::TensorProto> data;
  std::unordered_map<std::string, onnx::TypeProto *> typesByName;
  std::unordered_map<std::string, const onnx::TensorProto *> dataByName;
  std::unordered_map<std::string, const onnx::SparseTensorProto *> sparseByName;
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    if (op.inputs[i] < 0)
      continue;
    const Value &value = graph.values[op.inputs[i]];
    onnx::TypeProto &type = types.emplace_back();
    auto *tensor = type.mutable_tensor_type();
    tensor->set_elem_type(static_cast<int32_t>(value.type));
    auto *shape = tensor->mutable_shape();
    for (int64_t d : value.shape)
      shape->add_dim()->set_dim_value(d);
    typesByName[node.input(static_cast<int>(i))] = &type;
    if (auto known = withShapeData ? shapeData(op, i) : knownValue(op.inputs[i])) {
      onnx::TensorProto proto;
      if (!fillTensorProto(*known, proto))
        continue;
      proto.set_name(node.input(static_cast<int>(i)));
      dataByName[node.input(static_cast<int>(i))] = &data.emplace_back(std::move(proto));
    }
  }
  onnx::shape_inference::InferenceContextImpl context(node, typesByName, dataByName, sparseByName,
                                                      onnx::ShapeInferenceOptions{});
  try {
    schema->GetTypeAndShapeInferenceFunction()(context);
  } catch (const std::exception &e) {
    StringRef what(e.what());
    // ONNX cannot see into subgraphs here; let the declared types answer.
    if (what.contains("GraphProto attribute inferencing"))
      return std::nullopt;
    return fail(op, "shape inference failed: {0}{1}", what.trim(), bindingHint());
  }
  std::vector<TensorType> out(op.outputs.size());
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    const onnx::TypeProto *type = context.getOutputType(i);
    if (!type->has_tensor_type() || !type->tensor_type().has_shape())
      return std::nullopt;
    out[i].type = static_cast<DType>(type->tensor_type().elem_type());
    for (const auto &dim : type->tensor_type().shape().dim()) {
      if (!dim.has_dim_value())
        return std::nullopt;
      out[i].shape.push_back(dim.dim_value());
    }
  }
  return std::optional<std::vector<TensorType>>(std::move(out));
}

std::optional<TensorType> ShapeInferer::declaredType(const Value &value) {
  auto it = declared.find(value.name);
  if (it == declared.end() || !it->second->type().has_tensor_type())
    return std::nullopt;
  const auto &tensor = it->second->type().tensor_type();
  if (!tensor.has_shape() || !isKnownDType(tensor.elem_type()))
    return std::nullopt;
  TensorType out;
  out.type = static_cast<DType>(tensor.elem_type());
  for (int i = 0; i < tensor.shape().dim_size(); ++i) {
    const auto &dim = tensor.shape().dim(i);
    if (dim.has_dim_value()) {
      out.shape.push_back(dim.dim_value());
      continue;
    }
    auto bound = bindSymbolicDim(graph.bindings, dim.dim_param(), i);
    if (!bound)
      return std::nullopt;
    out.shape.push_back(*bound);
  }
  return out;
}

Error ShapeInferer::checkConvChannels(const Op &op) {
  bool conv = op.is(OpId::Conv), transpose = op.is(OpId::ConvTranspose);
  if (!(conv || transpose) || op.inputs.size() < 2 || op.inputs[0] < 0 || op.inputs[1] < 0)
    return Error::success();
  const Value &x = graph.values[op.inputs[0]], &w = graph.values[op.inputs[1]];
  if (x.shape.size() < 2 || w.shape.size() < 2)
    return Error::success();
  int64_t group = attrInt(graph.node(op), "group", 1);
  if (group < 1)
    return fail(op, "group {0} must be at least 1", group);
  // Conv's W is [M, C/group, k...]; ConvTranspose's [C, M/group, k...].
  int64_t channels = conv ? w.shape[1] * group : w.shape[0];
  if (x.shape[1] != channels)
    return fail(op, "input '{0}' has {1} channels, the weight '{2}' {3} expects {4}", x.name,
                x.shape[1], w.name, formatShape(w.shape), channels);
  if (conv && w.shape[0] % group != 0)
    return fail(op, "the weight '{0}' has {1} output channels, not a multiple of group {2}", w.name,
                w.shape[0], group);
  return Error::success();
}

Error ShapeInferer::inferOp(Op &op) {
  for (int id : op.inputs)
    if (id >= 0 && !graph.values[id].shapeKnown)
      return fail(op, "input '{0}' has no shape", graph.values[id].name);
  auto folded = tryFold(op);
  if (!folded)
    return folded.takeError();
  if (*folded)
    return Error::success();
  if (Error err = checkConvChannels(op))
    return err;

  auto types = inferContribShapes(graph, op);
  if (!types)
    return types.takeError();
  if (!*types) {
    types = onnxInference(op, /*withShapeData=*/false);
    if (!types)
      return types.takeError();
  }
  // A shape that depends on data computed from weights (Resize's scales
  // from a float initializer): evaluate that data and ask again.
  if (!*types) {
    types = onnxInference(op, /*withShapeData=*/true);
    if (!types)
      return types.takeError();
  }
  bool compileTime = !op.inputs.empty();
  for (int id : op.inputs)
    if (id >= 0 && graph.values[id].kind != ValueKind::Constant &&
        graph.values[id].kind != ValueKind::Weight)
      compileTime = false;
  for (int id : op.captures)
    if (graph.values[id].kind != ValueKind::Constant && graph.values[id].kind != ValueKind::Weight)
      compileTime = false;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    if (op.outputs[i] < 0)
      continue;
    Value &out = graph.values[op.outputs[i]];
    std::optional<TensorType> type;
    if (*types && i < (*types)->size())
      type = (**types)[i];
    if (!type)
      type = declaredType(out);
    if (!type) {
      bool known =
          graph.opsetFor(op.domain) > 0 &&
          onnx::OpSchemaRegistry::Schema(op.opType, static_cast<int>(graph.opsetFor(op.domain)),
                                         op.domain) != nullptr;
      if (!known)
        return fail(op,
                    "cannot infer the shape of output '{0}': no shape rule for this op "
                    "and the model declares no static type for it",
                    out.name);
      return fail(op,
                  "cannot infer a static shape for output '{0}' (it depends on run-time "
                  "data, or an input shape is not bound; see --input-shape and --dim)",
                  out.name);
    }
    for (int64_t d : type->shape)
      if (d < 0)
        return fail(op, "inferred a negative dimension for output '{0}'", out.name);
    out.type = type->type;
    out.shape = type->shape;
    out.shapeKnown = true;
    if (compileTime)
      out.kind = derivedKind(op, out);
  }
  return Error::success();
}

Expected<bool> ShapeInferer::run() {
  bool changed = false;
  for (Op &op : graph.ops) {
    if (op.dead)
      continue;
    bool allKnown = true;
    for (int id : op.outputs)
      allKnown &= id < 0 || graph.values[id].shapeKnown;
    if (allKnown && !op.outputs.empty())
      continue;
    try {
      if (Error err = inferOp(op))
        return err;
    } catch (const std::exception &e) {
      return fail(op, "shape inference failed: {0}{1}", StringRef(e.what()).trim(), bindingHint());
    }
    changed = true;
  }
  for (int id : graph.outputs)
    if (!graph.values[id].shapeKnown)
      return createStringError(inconvertibleErrorCode(), "%s: graph output '%s' has no shape",
                               graph.path.c_str(), graph.values[id].name.c_str());
  return changed;
}

} // namespace

Expected<bool> inferShapes(Graph &graph) { return ShapeInferer(graph).run(); }

} // namespace pipec
