//===- Graph.cpp - The imported op graph ----------------------------------===//
#include "compiler/ir/Graph.h"
#include "support/FillTensor.h"
#include "support/Float16.h"

#include "onnx/onnx_pb.h"

#include <google/protobuf/arena.h>

#include "llvm/Support/FormatVariadic.h"

#include <cstring>

using namespace llvm;

namespace pipec {

int64_t ConstTensor::numElements() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

int64_t ConstTensor::intAt(int64_t i) const {
  return isFloat() ? static_cast<int64_t>(floats[i]) : ints[i];
}

double ConstTensor::floatAt(int64_t i) const {
  return isFloat() ? floats[i] : static_cast<double>(ints[i]);
}

std::optional<int64_t> bindSymbolicDim(const ShapeBindings &bindings, StringRef name,
                                       size_t position) {
  auto given = bindings.dims.find(name.str());
  if (given != bindings.dims.end())
    return given->second;
  std::string lower = name.lower();
  StringRef l(lower);
  if (l.contains("total") && (l.contains("seq") || l.contains("len")))
    return bindings.past + bindings.seq;
  if (l.contains("past"))
    return bindings.past;
  if (l.contains("batch") || l == "n" || l == "b" || (l.empty() && position == 0))
    return bindings.batch;
  if (l.contains("seq") || l.contains("len") || l.contains("token") || l.contains("time"))
    return bindings.seq;
  return std::nullopt;
}

bool looksLikeParameter(DType type, int64_t elements) {
  if (isFloatDType(type))
    return elements > 1;
  if (type == DType::I8 || type == DType::U8)
    return elements > 1024;
  return false;
}

int64_t Value::numElements() const {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

int64_t Value::byteSize() const {
  if (!shapeKnown)
    return 0;
  return numElements() * dtypeSize(type);
}

Graph::Graph() = default;
Graph::~Graph() = default;
Graph::Graph(Graph &&) noexcept = default;
Graph &Graph::operator=(Graph &&) noexcept = default;

const onnx::NodeProto &Graph::node(const Op &op) const { return model->graph().node(op.nodeIndex); }

void Op::setType(StringRef newDomain, StringRef type) {
  opType = type.str();
  domain = newDomain == "ai.onnx" ? "" : newDomain.str();
  def = lookupOp(domain, opType);
}

int64_t Graph::opsetFor(StringRef domain) const {
  if (domain == "ai.onnx")
    domain = "";
  auto it = opsets.find(domain.str());
  return it == opsets.end() ? 0 : it->second;
}

int Graph::addValue(StringRef name, ValueKind kind) {
  int id = static_cast<int>(values.size());
  Value value;
  value.name = name.str();
  value.kind = kind;
  values.push_back(std::move(value));
  if (!name.empty())
    valueIds[name] = id;
  return id;
}

int Graph::findValue(StringRef name) const {
  auto it = valueIds.find(name);
  return it == valueIds.end() ? -1 : it->second;
}

Expected<ArrayRef<uint8_t>> Graph::storageBytes(const Value &value) const {
  if (!value.storage)
    return createStringError(inconvertibleErrorCode(), "%s: value '%s' has no stored bytes",
                             path.c_str(), value.name.c_str());
  const WeightRef &ref = *value.storage;
  const MemoryBuffer &buffer = *files[ref.file];
  return ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(buffer.getBufferStart()) + ref.offset,
                           ref.length);
}

namespace {

template <typename T> void appendInts(ConstTensor &out, const uint8_t *bytes, int64_t n) {
  out.ints.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, bytes + i * sizeof(T), sizeof(T));
    out.ints[i] = static_cast<int64_t>(v);
  }
}

template <typename T> void appendFloats(ConstTensor &out, const uint8_t *bytes, int64_t n) {
  out.floats.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, bytes + i * sizeof(T), sizeof(T));
    out.floats[i] = static_cast<double>(v);
  }
}

Error decodeRaw(ConstTensor &out, ArrayRef<uint8_t> raw) {
  int64_t n = out.numElements();
  int64_t size = dtypeSize(out.type);
  if (size == 0 || static_cast<int64_t>(raw.size()) != n * size)
    return createStringError(inconvertibleErrorCode(),
                             "holds %zu bytes, expected %lld elements of %s", raw.size(),
                             static_cast<long long>(n), dtypeName(out.type).str().c_str());
  const uint8_t *p = raw.data();
  switch (out.type) {
  case DType::F32:
    appendFloats<float>(out, p, n);
    break;
  case DType::F64:
    appendFloats<double>(out, p, n);
    break;
  case DType::F16:
  case DType::BF16: {
    out.floats.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, p + 2 * i, 2);
      out.floats[i] = out.type == DType::F16 ? halfToFloat(bits) : bfloat16ToFloat(bits);
    }
    break;
  }
  case DType::I8:
    appendInts<int8_t>(out, p, n);
    break;
  case DType::U8:
  case DType::Bool:
    appendInts<uint8_t>(out, p, n);
    break;
  case DType::I16:
    appendInts<int16_t>(out, p, n);
    break;
  case DType::U16:
    appendInts<uint16_t>(out, p, n);
    break;
  case DType::I32:
    appendInts<int32_t>(out, p, n);
    break;
  case DType::U32:
    appendInts<uint32_t>(out, p, n);
    break;
  case DType::I64:
    appendInts<int64_t>(out, p, n);
    break;
  case DType::U64:
    appendInts<uint64_t>(out, p, n);
    break;
  default:
    return createStringError(inconvertibleErrorCode(), "has type %s that cannot be read",
                             dtypeName(out.type).str().c_str());
  }
  return Error::success();
}

Error decodeTyped(ConstTensor &out, const onnx::TensorProto &tensor) {
  int64_t n = out.numElements();
  auto mismatch = [&](int64_t have) {
    return createStringError(inconvertibleErrorCode(), "holds %lld elements, its shape says %lld",
                             static_cast<long long>(have), static_cast<long long>(n));
  };
  if (isNarrowIntegerDType(out.type)) {
    if (tensor.int32_data_size() != n)
      return mismatch(tensor.int32_data_size());
    out.ints.assign(tensor.int32_data().begin(), tensor.int32_data().end());
    return Error::success();
  }
  switch (out.type) {
  case DType::F32:
    if (tensor.float_data_size() != n)
      return mismatch(tensor.float_data_size());
    out.floats.assign(tensor.float_data().begin(), tensor.float_data().end());
    return Error::success();
  case DType::F64:
    if (tensor.double_data_size() != n)
      return mismatch(tensor.double_data_size());
    out.floats.assign(tensor.double_data().begin(), tensor.double_data().end());
    return Error::success();
  case DType::F16:
  case DType::BF16:
    if (tensor.int32_data_size() != n)
      return mismatch(tensor.int32_data_size());
    out.floats.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      auto bits = static_cast<uint16_t>(tensor.int32_data(i));
      out.floats[i] = out.type == DType::F16 ? halfToFloat(bits) : bfloat16ToFloat(bits);
    }
    return Error::success();
  case DType::I64:
    if (tensor.int64_data_size() != n)
      return mismatch(tensor.int64_data_size());
    out.ints.assign(tensor.int64_data().begin(), tensor.int64_data().end());
    return Error::success();
  case DType::U32:
  case DType::U64:
    if (tensor.uint64_data_size() != n)
      return mismatch(tensor.uint64_data_size());
    out.ints.assign(tensor.uint64_data().begin(), tensor.uint64_data().end());
    return Error::success();
  default:
    return createStringError(inconvertibleErrorCode(), "has type %s that cannot be read",
                             dtypeName(out.type).str().c_str());
  }
}

} // namespace

Expected<std::shared_ptr<const ConstTensor>> Graph::readConstant(int valueId,
                                                                 int64_t maxElements) const {
  const Value &value = values[valueId];
  if (value.constant)
    return value.constant;
  auto fail = [&](Error err) {
    return createStringError(inconvertibleErrorCode(), "%s: tensor '%s' %s", path.c_str(),
                             value.name.c_str(), toString(std::move(err)).c_str());
  };
  if (!value.shapeKnown || value.numElements() > maxElements)
    return fail(createStringError(inconvertibleErrorCode(), "is too large to read"));
  auto out = std::make_shared<ConstTensor>();
  out->type = value.type;
  out->shape = value.shape;
  if (value.storage) {
    auto bytes = storageBytes(value);
    if (!bytes)
      return bytes.takeError();
    if (Error err = decodeRaw(*out, *bytes))
      return fail(std::move(err));
    return std::shared_ptr<const ConstTensor>(std::move(out));
  }
  if (value.tensorIndex < 0)
    return fail(createStringError(inconvertibleErrorCode(), "is not known at compile time"));
  const onnx::TensorProto &tensor =
      value.tensorIndex < model->graph().initializer_size()
          ? model->graph().initializer(value.tensorIndex)
          : *constantTensors[value.tensorIndex - model->graph().initializer_size()];
  // A weight a model stores as a fill holds one value for the whole shape.
  bool fill = tensor.doc_string() == fillTensorDoc;
  if (fill)
    out->shape = {1};
  Error err =
      tensor.has_raw_data()
          ? decodeRaw(*out,
                      ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(tensor.raw_data().data()),
                                        tensor.raw_data().size()))
          : decodeTyped(*out, tensor);
  if (err)
    return fail(std::move(err));
  if (fill) {
    out->shape = value.shape;
    if (!out->floats.empty())
      out->floats.assign(value.numElements(), out->floats[0]);
    if (!out->ints.empty())
      out->ints.assign(value.numElements(), out->ints[0]);
  }
  return std::shared_ptr<const ConstTensor>(std::move(out));
}

void Graph::rebuildUses() {
  for (Value &value : values) {
    value.users.clear();
    if (value.producer >= 0)
      value.producer = -1;
  }
  for (int i = 0, e = static_cast<int>(ops.size()); i < e; ++i) {
    if (ops[i].dead)
      continue;
    for (int in : ops[i].inputs)
      if (in >= 0)
        values[in].users.push_back(i);
    for (int in : ops[i].captures)
      values[in].users.push_back(i);
    for (int out : ops[i].outputs)
      if (out >= 0)
        values[out].producer = i;
  }
}

void Graph::compact() {
  std::vector<Op> live;
  live.reserve(ops.size());
  for (Op &op : ops)
    if (!op.dead)
      live.push_back(std::move(op));
  ops = std::move(live);
  rebuildUses();
}

bool Graph::isDerivedWeight(int id) const {
  const Value &v = values[id];
  if (v.kind != ValueKind::Weight || v.producer < 0)
    return false;
  return llvm::any_of(ops[v.producer].inputs,
                      [&](int in) { return in >= 0 && isFloatDType(values[in].type); });
}

bool Graph::isFillWeight(int id) const {
  const Value &v = values[id];
  int initializers = model ? model->graph().initializer_size() : 0;
  return v.producer < 0 && v.tensorIndex >= initializers &&
         v.tensorIndex - initializers < static_cast<int>(constantTensors.size()) &&
         constantTensors[v.tensorIndex - initializers]->doc_string() == fillTensorDoc;
}

int64_t Graph::parameterCount() const {
  // Count stored weights (a light model's fills among them: fold-constants
  // made them weights), and weights computed from constants alone; not
  // weights derived from other weights (a transposed tied embedding is the
  // same parameter).
  int64_t total = 0;
  for (const Value &value : values) {
    if (value.kind != ValueKind::Weight || value.users.empty() || !value.shapeKnown)
      continue;
    bool derivedFromWeight = false;
    if (value.producer >= 0)
      for (int in : ops[value.producer].inputs)
        derivedFromWeight |= in >= 0 && values[in].kind == ValueKind::Weight;
    if (!derivedFromWeight)
      total += value.numElements();
  }
  return total;
}

int Graph::liveOpCount() const {
  int n = 0;
  for (const Op &op : ops)
    n += op.dead ? 0 : 1;
  return n;
}

std::string describeOp(const Graph &graph, const Op &op) {
  std::string name = op.name;
  if (name.empty()) {
    for (int out : op.outputs)
      if (out >= 0) {
        name = "<output " + graph.values[out].name + ">";
        break;
      }
  }
  std::string type = op.domain.empty() ? op.opType : op.domain + "." + op.opType;
  return formatv("node '{0}' ({1})", name, type).str();
}

std::string formatShape(const std::vector<int64_t> &shape, bool known) {
  if (!known)
    return "[?]";
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i)
      out += ",";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

} // namespace pipec

namespace pipec {

void printGraph(const Graph &graph, raw_ostream &os) {
  os << formatv("graph ops={0} params={1}\n", graph.liveOpCount(), graph.parameterCount());
  auto valueText = [&](int id) -> std::string {
    if (id < 0)
      return "_";
    const Value &v = graph.values[id];
    return formatv("%{0}:{1}{2}", v.name, dtypeName(v.type), formatShape(v.shape, v.shapeKnown))
        .str();
  };
  for (int id : graph.inputs)
    os << "  input " << valueText(id) << "\n";
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    os << "  ";
    for (size_t i = 0; i < op.outputs.size(); ++i)
      os << (i ? ", " : "") << valueText(op.outputs[i]);
    os << " = " << (op.domain.empty() ? "" : op.domain + ".") << op.opType << "(";
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      os << (i ? ", " : "");
      if (op.inputs[i] < 0)
        os << "_";
      else
        os << "%" << graph.values[op.inputs[i]].name;
    }
    os << ")";
    if (!op.name.empty())
      os << "  // " << op.name;
    os << "\n";
  }
  for (int id : graph.outputs)
    os << "  output " << valueText(id) << "\n";
}

Error verifyGraph(const Graph &graph, bool requireShapes) {
  auto fail = [&](const Op &op, const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s: verifier: %s: %s", graph.path.c_str(),
                             describeOp(graph, op).c_str(), why.str().c_str());
  };
  std::vector<bool> defined(graph.values.size(), false);
  for (size_t id = 0; id < graph.values.size(); ++id)
    defined[id] = graph.values[id].producer < 0;
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    for (int in : op.inputs) {
      if (in < 0)
        continue;
      if (in >= static_cast<int>(graph.values.size()))
        return fail(op, "reads a value that does not exist");
      if (!defined[in])
        return fail(op, formatv("reads '{0}' before it is defined", graph.values[in].name));
      if (requireShapes && !graph.values[in].shapeKnown)
        return fail(op, formatv("input '{0}' has no shape", graph.values[in].name));
    }
    for (int out : op.outputs) {
      if (out < 0)
        continue;
      if (defined[out] && graph.values[out].producer != &op - graph.ops.data())
        return fail(op, formatv("defines '{0}' a second time", graph.values[out].name));
      defined[out] = true;
      if (requireShapes && !graph.values[out].shapeKnown)
        return fail(op, formatv("output '{0}' has no shape", graph.values[out].name));
    }
  }
  return Error::success();
}

} // namespace pipec
