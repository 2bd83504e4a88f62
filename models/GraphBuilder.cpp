//===- GraphBuilder.cpp - ONNX graphs with torch-style names -------------===//
#include "models/GraphBuilder.h"
#include "support/Float16.h"

#include <cstring>
#include <limits>

using namespace llvm;

namespace pipec::models {
namespace {

/// splitmix64: tiny, fast and good enough for weights.
class Rng {
public:
  explicit Rng(uint64_t seed) : state(seed) {}

  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Approximately N(0, stdDev): the sum of four 16-bit uniforms (Irwin-Hall),
  /// centered and scaled by its standard deviation 65536 / sqrt(3).
  float normal(float stdDev) {
    uint64_t r = next();
    int64_t sum = int64_t(r & 0xffff) + int64_t((r >> 16) & 0xffff) + int64_t((r >> 32) & 0xffff) +
                  int64_t(r >> 48);
    return float(sum - 131070) * (stdDev / 37837.23f);
  }

private:
  uint64_t state;
};

uint64_t hashName(StringRef name) {
  uint64_t h = 0xcbf29ce484222325ULL; // FNV-1a
  for (unsigned char c : name)
    h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

/// Appends \p count values base + ~N(0, 0.02), each converted by \p convert,
/// to \p raw (little-endian, as is every host we build on).
template <typename T, typename ConvertFn>
void appendRandom(std::string &raw, int64_t count, Rng &r, float base, ConvertFn convert) {
  constexpr int64_t chunk = 4096;
  T buf[chunk];
  raw.reserve(count * sizeof(T));
  for (int64_t i = 0; i < count; i += chunk) {
    int64_t n = std::min(chunk, count - i);
    for (int64_t j = 0; j < n; ++j)
      buf[j] = convert(base + r.normal(0.02f));
    raw.append(reinterpret_cast<const char *>(buf), n * sizeof(T));
  }
}

/// An attribute named \p name of \p type, its value unset.
onnx::AttributeProto namedAttr(StringRef name, onnx::AttributeProto::AttributeType type) {
  onnx::AttributeProto a;
  a.set_name(name.str());
  a.set_type(type);
  return a;
}

} // namespace

onnx::AttributeProto attrInt(StringRef name, int64_t value) {
  onnx::AttributeProto a = namedAttr(name, onnx::AttributeProto::INT);
  a.set_i(value);
  return a;
}

onnx::AttributeProto attrFloat(StringRef name, float value) {
  onnx::AttributeProto a = namedAttr(name, onnx::AttributeProto::FLOAT);
  a.set_f(value);
  return a;
}

onnx::AttributeProto attrInts(StringRef name, ArrayRef<int64_t> values) {
  onnx::AttributeProto a = namedAttr(name, onnx::AttributeProto::INTS);
  for (int64_t v : values)
    a.add_ints(v);
  return a;
}

onnx::AttributeProto attrString(StringRef name, StringRef value) {
  onnx::AttributeProto a = namedAttr(name, onnx::AttributeProto::STRING);
  a.set_s(value.str());
  return a;
}

std::vector<std::string> GraphBuilder::addNodeN(StringRef opType, StringRef scope,
                                                ArrayRef<std::string> inputs, unsigned numOutputs,
                                                ArrayRef<onnx::AttributeProto> attrs,
                                                StringRef outName) {
  std::string name = uniqueName((scope + "/" + opType).str());
  onnx::NodeProto *n = graph.add_node();
  n->set_name(name);
  n->set_op_type(opType.str());
  for (const std::string &in : inputs)
    n->add_input(in);
  std::vector<std::string> outs;
  for (unsigned i = 0; i < numOutputs; ++i) {
    outs.push_back(i == 0 && !outName.empty() ? outName.str()
                                              : name + "_output_" + std::to_string(i));
    n->add_output(outs.back());
  }
  for (const onnx::AttributeProto &a : attrs)
    *n->add_attribute() = a;
  return outs;
}

std::string GraphBuilder::constant(StringRef scope, onnx::TensorProto tensor) {
  onnx::AttributeProto a;
  a.set_name("value");
  a.set_type(onnx::AttributeProto::TENSOR);
  *a.mutable_t() = std::move(tensor);
  return addNode("Constant", scope, {}, {a});
}

std::string GraphBuilder::constInts(StringRef scope, ArrayRef<int64_t> dims,
                                    ArrayRef<int64_t> values) {
  onnx::TensorProto t;
  t.set_data_type(kInt64);
  for (int64_t d : dims)
    t.add_dims(d);
  for (int64_t v : values)
    t.add_int64_data(v);
  return constant(scope, std::move(t));
}

std::string GraphBuilder::constFloat(StringRef scope, float value) {
  onnx::TensorProto t;
  t.set_data_type(kFloat);
  t.add_float_data(value);
  return constant(scope, std::move(t));
}

std::string GraphBuilder::addWeight(StringRef name, ArrayRef<int64_t> dims, Init kind) {
  if (options.lightWeights)
    return addFill(name, dims, kFloat, kind == Init::One ? 1.0f : 0.02f);
  onnx::TensorProto *t = graph.add_initializer();
  t->set_name(name.str());
  int64_t count = 1;
  for (int64_t d : dims) {
    t->add_dims(d);
    count *= d;
  }
  Rng r(Rng(options.seed).next() ^ hashName(name));
  float base = kind == Init::One ? 1.0f : 0.0f;
  std::string &raw = *t->mutable_raw_data();
  if (!options.fp16Weights) {
    t->set_data_type(kFloat);
    appendRandom<float>(raw, count, r, base, [](float f) { return f; });
    return name.str();
  }
  t->set_data_type(onnx::TensorProto::FLOAT16);
  appendRandom<uint16_t>(raw, count, r, base, floatToHalf);
  return addNode("Cast", ("/" + name).str(), {name.str()}, {attrInt("to", kFloat)});
}

std::string GraphBuilder::addFill(StringRef name, ArrayRef<int64_t> dims, int32_t elemType,
                                  float value) {
  std::string shape = constVector(("/" + name).str(), dims);
  onnx::AttributeProto a;
  a.set_name("value");
  a.set_type(onnx::AttributeProto::TENSOR);
  onnx::TensorProto *t = a.mutable_t();
  t->set_data_type(elemType);
  t->add_dims(1);
  if (elemType == kFloat)
    t->add_float_data(value);
  else
    t->add_int32_data(static_cast<int32_t>(value));
  return addNode("ConstantOfShape", ("/" + name).str(), {shape}, {a}, name);
}

std::string GraphBuilder::addBuffer(StringRef name, ArrayRef<int64_t> dims,
                                    ArrayRef<float> values) {
  if (options.lightWeights)
    return addFill(name, dims, kFloat, 0.0f);
  onnx::TensorProto *t = graph.add_initializer();
  t->set_name(name.str());
  t->set_data_type(kFloat);
  for (int64_t d : dims)
    t->add_dims(d);
  t->set_raw_data(values.data(), values.size() * sizeof(float));
  return name.str();
}

std::string GraphBuilder::addBoolBuffer(StringRef name, ArrayRef<int64_t> dims,
                                        ArrayRef<uint8_t> values) {
  if (options.lightWeights)
    return addFill(name, dims, onnx::TensorProto::BOOL, 1.0f);
  onnx::TensorProto *t = graph.add_initializer();
  t->set_name(name.str());
  t->set_data_type(onnx::TensorProto::BOOL);
  for (int64_t d : dims)
    t->add_dims(d);
  t->set_raw_data(values.data(), values.size());
  return name.str();
}

void GraphBuilder::addInput(StringRef name, int32_t elemType, ArrayRef<int64_t> dims) {
  fillValueInfo(*graph.add_input(), name, elemType, dims);
}

void GraphBuilder::addOutput(StringRef name, int32_t elemType, ArrayRef<int64_t> dims) {
  fillValueInfo(*graph.add_output(), name, elemType, dims);
}

std::string GraphBuilder::batchShape(StringRef scope, const std::string &like,
                                     ArrayRef<int64_t> rest) {
  if (options.batch > 0) {
    std::vector<int64_t> shape{options.batch};
    shape.insert(shape.end(), rest.begin(), rest.end());
    return constVector(scope, shape);
  }
  std::string shape = addNode("Shape", scope, {like});
  std::string zero = constInts(scope, {}, {0});
  std::string dim = addNode("Gather", scope, {shape, zero}, {attrInt("axis", 0)});
  std::string axes = constVector(scope, {0});
  std::string unsq = addNode("Unsqueeze", scope, {dim, axes});
  std::string tail = constVector(scope, rest);
  return addNode("Concat", scope, {unsq, tail}, {attrInt("axis", 0)});
}

std::string GraphBuilder::causalMask() {
  if (causalMaskName.empty()) {
    // A bool buffer (true on and below the diagonal) chooses between 0 and
    // the lowest float: Where's condition carries no gradient, so the mask
    // is not trained.
    int64_t s = options.seq;
    std::vector<uint8_t> keep(s * s, 0);
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j <= i; ++j)
        keep[i * s + j] = 1;
    std::string allowed = addBoolBuffer("causal_mask", {1, 1, s, s}, keep);
    causalMaskName =
        addNode("Where", "/model/causal_mask",
                {allowed, constFloat("/model/causal_mask", 0.0f),
                 constFloat("/model/causal_mask", std::numeric_limits<float>::lowest())});
  }
  return causalMaskName;
}

std::string GraphBuilder::uniqueName(std::string base) {
  unsigned &count = nameCounts[base];
  if (count++ == 0)
    return base;
  return base + "_" + std::to_string(count - 1);
}

void GraphBuilder::fillValueInfo(onnx::ValueInfoProto &vi, StringRef name, int32_t elemType,
                                 ArrayRef<int64_t> dims) {
  vi.set_name(name.str());
  auto *tensor = vi.mutable_type()->mutable_tensor_type();
  tensor->set_elem_type(elemType);
  auto *shape = tensor->mutable_shape();
  for (int64_t d : dims) {
    auto *dim = shape->add_dim();
    if (d != kBatch)
      dim->set_dim_value(d);
    else if (options.batch > 0)
      dim->set_dim_value(options.batch);
    else
      dim->set_dim_param("batch");
  }
}

} // namespace pipec::models
