//===- ModelGenerators.cpp - Synthetic ONNX model generators --------------===//
//
// A small GraphBuilder appends nodes, Constant nodes and pseudo-random
// initializers to an onnx::GraphProto with torch-style names; one function per
// family lays out the architecture on top of it. writeModel serializes
// straight to a file stream, optionally moving big initializers to a side
// file.
//
//===----------------------------------------------------------------------===//

#include "models/ModelGenerators.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/MathExtras.h"
#include "llvm/Support/Path.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec::models {
namespace {

/// Dimension placeholder for the batch size in value infos and shapes.
constexpr int64_t kBatch = -1;

constexpr int32_t kFloat = onnx::TensorProto::FLOAT;
constexpr int32_t kInt64 = onnx::TensorProto::INT64;

Error makeError(const Twine &msg) { return createStringError(inconvertibleErrorCode(), msg); }

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

/// Converts to IEEE half, rounding to nearest; overflow saturates to inf.
uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  uint16_t sign = (x >> 16) & 0x8000;
  int32_t exp = int32_t((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (exp >= 31)
    return sign | 0x7c00;
  if (exp <= 0) { // Subnormal half (or zero).
    if (exp < -10)
      return sign;
    return sign | uint16_t((mant | 0x800000) >> (14 - exp));
  }
  uint16_t h = sign | uint16_t(exp << 10) | uint16_t(mant >> 13);
  return (mant & 0x1000) ? h + 1 : h; // A carry into the exponent is right.
}

onnx::AttributeProto attrInt(StringRef name, int64_t value) {
  onnx::AttributeProto a;
  a.set_name(name.str());
  a.set_type(onnx::AttributeProto::INT);
  a.set_i(value);
  return a;
}

onnx::AttributeProto attrFloat(StringRef name, float value) {
  onnx::AttributeProto a;
  a.set_name(name.str());
  a.set_type(onnx::AttributeProto::FLOAT);
  a.set_f(value);
  return a;
}

onnx::AttributeProto attrInts(StringRef name, ArrayRef<int64_t> values) {
  onnx::AttributeProto a;
  a.set_name(name.str());
  a.set_type(onnx::AttributeProto::INTS);
  for (int64_t v : values)
    a.add_ints(v);
  return a;
}

onnx::AttributeProto attrString(StringRef name, StringRef value) {
  onnx::AttributeProto a;
  a.set_name(name.str());
  a.set_type(onnx::AttributeProto::STRING);
  a.set_s(value.str());
  return a;
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

/// A torch module: its export scope ("/transformer/h.0") and its parameter
/// prefix ("transformer.h.0").
struct Mod {
  std::string scope;
  std::string paramPrefix;

  Mod child(const Twine &name) const {
    std::string n = name.str();
    return {scope + "/" + n, paramPrefix.empty() ? n : paramPrefix + "." + n};
  }
  std::string param(StringRef leaf) const { return paramPrefix + "." + leaf.str(); }
};

/// How a weight is filled: ~N(0, 0.02), or 1 + N(0, 0.02) for norm scales
/// and batch-norm variances.
enum class Init { Normal, One };

/// Appends nodes, constants, initializers and graph inputs/outputs to a graph
/// with torch-style names.
class GraphBuilder {
public:
  GraphBuilder(onnx::GraphProto &graph, const GeneratorOptions &opts)
      : graph(graph), options(opts) {}

  const GeneratorOptions &opts() const { return options; }

  /// Adds a node named "<Scope>/<OpType>" (then "_1", "_2", ... as torch
  /// does) and returns its outputs "<name>_output_<i>"; \p outName, when
  /// given, names the first output instead.
  std::vector<std::string> addNodeN(StringRef opType, StringRef scope, ArrayRef<std::string> inputs,
                                    unsigned numOutputs, ArrayRef<onnx::AttributeProto> attrs = {},
                                    StringRef outName = "") {
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

  /// Single-output addNodeN.
  std::string addNode(StringRef opType, StringRef scope, ArrayRef<std::string> inputs,
                      ArrayRef<onnx::AttributeProto> attrs = {}, StringRef outName = "") {
    return addNodeN(opType, scope, inputs, 1, attrs, outName)[0];
  }

  /// Adds a Constant node holding \p tensor.
  std::string constant(StringRef scope, onnx::TensorProto tensor) {
    onnx::AttributeProto a;
    a.set_name("value");
    a.set_type(onnx::AttributeProto::TENSOR);
    *a.mutable_t() = std::move(tensor);
    return addNode("Constant", scope, {}, {a});
  }

  /// Adds an int64 Constant of shape \p dims (a scalar when empty).
  std::string constInts(StringRef scope, ArrayRef<int64_t> dims, ArrayRef<int64_t> values) {
    onnx::TensorProto t;
    t.set_data_type(kInt64);
    for (int64_t d : dims)
      t.add_dims(d);
    for (int64_t v : values)
      t.add_int64_data(v);
    return constant(scope, std::move(t));
  }

  /// Adds a 1-D int64 Constant.
  std::string constVector(StringRef scope, ArrayRef<int64_t> values) {
    return constInts(scope, {int64_t(values.size())}, values);
  }

  /// Adds a scalar float Constant.
  std::string constFloat(StringRef scope, float value) {
    onnx::TensorProto t;
    t.set_data_type(kFloat);
    t.add_float_data(value);
    return constant(scope, std::move(t));
  }

  /// Adds a pseudo-random float weight and returns the value to consume: the
  /// initializer itself, or with fp16Weights the output of its Cast to float.
  /// Each weight is seeded from the options' seed and its own name.
  std::string addWeight(StringRef name, ArrayRef<int64_t> dims, Init kind = Init::Normal) {
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

  /// With lightWeights: a ConstantOfShape fill named \p name instead of an
  /// initializer, as ONNX's "light" test models store their weights.
  std::string addFill(StringRef name, ArrayRef<int64_t> dims, int32_t elemType, float value) {
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

  /// Adds a float32 initializer with fixed contents (masks, rotary tables).
  std::string addBuffer(StringRef name, ArrayRef<int64_t> dims, ArrayRef<float> values) {
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

  /// Adds a BOOL initializer with fixed contents, one byte (0 or 1) each.
  std::string addBoolBuffer(StringRef name, ArrayRef<int64_t> dims, ArrayRef<uint8_t> values) {
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

  /// Declares a graph input; kBatch in \p dims is the batch dimension.
  void addInput(StringRef name, int32_t elemType, ArrayRef<int64_t> dims) {
    fillValueInfo(*graph.add_input(), name, elemType, dims);
  }

  /// Declares a graph output; kBatch in \p dims is the batch dimension.
  void addOutput(StringRef name, int32_t elemType, ArrayRef<int64_t> dims) {
    fillValueInfo(*graph.add_output(), name, elemType, dims);
  }

  /// Returns an int64 shape [batch, Rest...] for a Reshape. With a symbolic
  /// batch it is read from dimension 0 of \p like as torch does (Shape,
  /// Gather, Unsqueeze, Concat); otherwise it is a Constant.
  std::string batchShape(StringRef scope, const std::string &like, ArrayRef<int64_t> rest) {
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

  /// The shared [1, 1, seq, seq] additive causal mask (0 on and below the
  /// diagonal, float lowest above), created on first use.
  std::string causalMask() {
    if (causalMaskName.empty()) {
      int64_t s = options.seq;
      std::vector<float> values(s * s, 0.0f);
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = i + 1; j < s; ++j)
          values[i * s + j] = std::numeric_limits<float>::lowest();
      causalMaskName = addBuffer("causal_mask", {1, 1, s, s}, values);
    }
    return causalMaskName;
  }

private:
  std::string uniqueName(std::string base) {
    unsigned &count = nameCounts[base];
    if (count++ == 0)
      return base;
    return base + "_" + std::to_string(count - 1);
  }

  void fillValueInfo(onnx::ValueInfoProto &vi, StringRef name, int32_t elemType,
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

  onnx::GraphProto &graph;
  const GeneratorOptions &options;
  StringMap<unsigned> nameCounts;
  std::string causalMaskName;
};

//===----------------------------------------------------------------------===//
// Layers shared by the families
//===----------------------------------------------------------------------===//

/// x @ W (+ b) with W [In, Out] named "<module>.weight".
std::string linear(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                   bool bias, StringRef outName = "") {
  std::string w = g.addWeight(m.param("weight"), {in, out});
  std::string y = g.addNode("MatMul", m.scope, {x, w}, {}, bias ? StringRef() : outName);
  if (!bias)
    return y;
  std::string b = g.addWeight(m.param("bias"), {out});
  return g.addNode("Add", m.scope, {b, y}, {}, outName);
}

/// torch.nn.Linear on a 2-D input: Gemm(x, W [Out, In], b, transB=1).
std::string gemm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                 StringRef outName = "") {
  std::string w = g.addWeight(m.param("weight"), {out, in});
  std::string b = g.addWeight(m.param("bias"), {out});
  return g.addNode("Gemm", m.scope, {x, w, b},
                   {attrFloat("alpha", 1.0f), attrFloat("beta", 1.0f), attrInt("transB", 1)},
                   outName);
}

/// LayerNorm over the last axis: the LayerNormalization op from opset 17,
/// the torch decomposition below.
std::string layerNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width,
                      float eps) {
  std::string w = g.addWeight(m.param("weight"), {width}, Init::One);
  std::string b = g.addWeight(m.param("bias"), {width});
  if (g.opts().opset >= 17)
    return g.addNode("LayerNormalization", m.scope, {x, w, b},
                     {attrInt("axis", -1), attrFloat("epsilon", eps)});
  const StringRef s = m.scope;
  auto mean = [&](const std::string &in) {
    return g.addNode("ReduceMean", s, {in}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  };
  std::string centered = g.addNode("Sub", s, {x, mean(x)});
  std::string two = g.constFloat(s, 2.0f);
  std::string var = mean(g.addNode("Pow", s, {centered, two}));
  std::string epsC = g.constFloat(s, eps);
  std::string stdDev = g.addNode("Sqrt", s, {g.addNode("Add", s, {var, epsC})});
  std::string norm = g.addNode("Div", s, {centered, stdDev});
  return g.addNode("Add", s, {g.addNode("Mul", s, {norm, w}), b});
}

/// Llama RMSNorm: w * (x * 1 / sqrt(mean(x^2) + eps)).
std::string rmsNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width, float eps) {
  std::string w = g.addWeight(m.param("weight"), {width}, Init::One);
  const StringRef s = m.scope;
  std::string two = g.constFloat(s, 2.0f);
  std::string sq = g.addNode("Pow", s, {x, two});
  std::string var =
      g.addNode("ReduceMean", s, {sq}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  std::string epsC = g.constFloat(s, eps);
  std::string stdDev = g.addNode("Sqrt", s, {g.addNode("Add", s, {var, epsC})});
  std::string inv = g.addNode("Reciprocal", s, {stdDev});
  return g.addNode("Mul", s, {w, g.addNode("Mul", s, {x, inv})});
}

/// Exact GELU as torch exports it: x * (1 + erf(x / sqrt(2))) * 0.5.
std::string gelu(GraphBuilder &g, StringRef scope, const std::string &x) {
  std::string sqrt2 = g.constFloat(scope, float(M_SQRT2));
  std::string erf = g.addNode("Erf", scope, {g.addNode("Div", scope, {x, sqrt2})});
  std::string one = g.constFloat(scope, 1.0f);
  std::string sum = g.addNode("Add", scope, {erf, one});
  std::string prod = g.addNode("Mul", scope, {x, sum});
  std::string half = g.constFloat(scope, 0.5f);
  return g.addNode("Mul", scope, {prod, half});
}

/// [B, S, Heads * Dim] -> Reshape [B, S, Heads, Dim] -> Transpose(Perm).
std::string splitHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                       int64_t dim, ArrayRef<int64_t> perm) {
  std::string shape = g.batchShape(scope, x, {g.opts().seq, heads, dim});
  std::string r = g.addNode("Reshape", scope, {x, shape});
  return g.addNode("Transpose", scope, {r}, {attrInts("perm", perm)});
}

/// softmax(Q K^T / sqrt(Dim) + Mask) V with Q, V [B, H, S, Dim] and
/// KT [B, H, Dim, S]; returns the heads merged back to [B, S, H * Dim].
std::string attention(GraphBuilder &g, StringRef scope, const std::string &q, const std::string &kt,
                      const std::string &v, const std::string &mask, int64_t heads, int64_t dim) {
  std::string scores = g.addNode("MatMul", scope, {q, kt});
  std::string scale = g.constFloat(scope, std::sqrt(float(dim)));
  scores = g.addNode("Div", scope, {scores, scale});
  scores = g.addNode("Add", scope, {scores, mask});
  std::string probs = g.addNode("Softmax", scope, {scores}, {attrInt("axis", -1)});
  std::string ctx = g.addNode("MatMul", scope, {probs, v});
  ctx = g.addNode("Transpose", scope, {ctx}, {attrInts("perm", {0, 2, 1, 3})});
  std::string shape = g.batchShape(scope, ctx, {g.opts().seq, heads * dim});
  return g.addNode("Reshape", scope, {ctx, shape});
}

/// SoftmaxCrossEntropyLoss (mean, ignore_index -100) as the "loss" output.
void crossEntropy(GraphBuilder &g, const std::string &logits, const std::string &labels) {
  g.addNode("SoftmaxCrossEntropyLoss", "/loss_fct", {logits, labels},
            {attrInt("ignore_index", -100), attrString("reduction", "mean")}, "loss");
  g.addOutput("loss", kFloat, {});
}

/// The LM head producing "logits" [B, S, V] (and the loss): MatMul with its
/// own weight, or with the Transpose of the token embedding when tied.
void lmHead(GraphBuilder &g, const std::string &x, const std::string &embedding, int64_t width) {
  const GeneratorOptions &o = g.opts();
  Mod head = Mod().child("lm_head");
  std::string w = o.tiedEmbeddings
                      ? g.addNode("Transpose", head.scope, {embedding}, {attrInts("perm", {1, 0})})
                      : g.addWeight(head.param("weight"), {width, int64_t(o.vocab)});
  g.addNode("MatMul", head.scope, {x, w}, {}, "logits");
  g.addOutput("logits", kFloat, {kBatch, o.seq, o.vocab});
  if (!o.withLoss)
    return;
  g.addInput("labels", kInt64, {kBatch, o.seq});
  std::string logitShape = g.constVector("", {-1, o.vocab});
  std::string flat = g.addNode("Reshape", "", {"logits", logitShape});
  std::string labelShape = g.constVector("", {-1});
  std::string flatLabels = g.addNode("Reshape", "", {"labels", labelShape});
  crossEntropy(g, flat, flatLabels);
}

/// Position ids 0..seq-1 as an int64 [1, seq] Constant.
std::string positionIds(GraphBuilder &g, StringRef scope) {
  std::vector<int64_t> ids(g.opts().seq);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = i;
  return g.constInts(scope, {1, g.opts().seq}, ids);
}

//===----------------------------------------------------------------------===//
// Families
//===----------------------------------------------------------------------===//

/// x.size(Index) as torch traces it: Shape -> Gather(Constant Index), an
/// int64 scalar.
std::string sizeOf(GraphBuilder &g, StringRef scope, const std::string &x, int64_t index) {
  std::string shape = g.addNode("Shape", scope, {x});
  std::string i = g.constInts(scope, {}, {index});
  return g.addNode("Gather", scope, {shape, i}, {attrInt("axis", 0)});
}

/// The Reshape target (x.size(0), x.size(1)) + Tail for x [B, S, ...]. With
/// a symbolic batch both sizes are read with sizeOf and unsqueezed to [1],
/// then concatenated with the Constant Tail; with a static batch torch folds
/// it all into one Constant.
std::string batchSeqShape(GraphBuilder &g, StringRef scope, const std::string &x,
                          ArrayRef<int64_t> tail) {
  const GeneratorOptions &o = g.opts();
  if (o.batch > 0) {
    std::vector<int64_t> shape{o.batch, o.seq};
    shape.insert(shape.end(), tail.begin(), tail.end());
    return g.constVector(scope, shape);
  }
  std::string batch = sizeOf(g, scope, x, 0);
  std::string seq = sizeOf(g, scope, x, 1);
  auto unsqueeze = [&](const std::string &scalar) {
    std::string axes = g.constVector(scope, {0});
    return g.addNode("Unsqueeze", scope, {scalar, axes});
  };
  std::string b = unsqueeze(batch);
  std::string s = unsqueeze(seq);
  std::string t = g.constVector(scope, tail);
  return g.addNode("Concat", scope, {b, s, t}, {attrInt("axis", 0)});
}

/// HF Conv1D (weight [In, Out], bias [Out]) on x [B, S, In]:
///   size_out = x.size()[:-1] + (Out,)
///   x = addmm(bias, x.view(-1, In), weight).view(size_out)
/// exported as a Reshape to the Constant [-1, In], MatMul + Add and a Reshape
/// to size_out: Shape -> Slice(0, -1) -> Concat([Out]) with a symbolic
/// batch, a Constant with a static one.
std::string conv1d(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out) {
  const GeneratorOptions &o = g.opts();
  const StringRef s = m.scope;
  std::string sizeOut;
  if (o.batch > 0) {
    sizeOut = g.constVector(s, {o.batch, o.seq, out});
  } else {
    std::string shape = g.addNode("Shape", s, {x});
    std::string starts = g.constVector(s, {0});
    std::string ends = g.constVector(s, {-1});
    std::string axes = g.constVector(s, {0});
    std::string leading = g.addNode("Slice", s, {shape, starts, ends, axes});
    std::string nf = g.constVector(s, {out});
    sizeOut = g.addNode("Concat", s, {leading, nf}, {attrInt("axis", 0)});
  }
  std::string flatShape = g.constVector(s, {-1, in});
  std::string flat = g.addNode("Reshape", s, {x, flatShape});
  std::string y = linear(g, m, flat, in, out, /*bias=*/true);
  return g.addNode("Reshape", s, {y, sizeOut});
}

/// HF gelu_new, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))),
/// one node per torch operator.
std::string geluNew(GraphBuilder &g, StringRef scope, const std::string &x) {
  std::string half = g.constFloat(scope, 0.5f);
  std::string halfX = g.addNode("Mul", scope, {half, x});
  std::string three = g.constFloat(scope, 3.0f);
  std::string cube = g.addNode("Pow", scope, {x, three});
  std::string coeff = g.constFloat(scope, 0.044715f);
  std::string inner = g.addNode("Mul", scope, {coeff, cube});
  inner = g.addNode("Add", scope, {x, inner});
  std::string scale = g.constFloat(scope, float(std::sqrt(2.0 / M_PI)));
  inner = g.addNode("Mul", scope, {scale, inner});
  std::string tanh = g.addNode("Tanh", scope, {inner});
  std::string one = g.constFloat(scope, 1.0f);
  std::string onePlus = g.addNode("Add", scope, {one, tanh});
  return g.addNode("Mul", scope, {halfX, onePlus});
}

/// GPT2Attention._split_heads: x [B, S, H * D] viewed as
/// x.size()[:-1] + (H, D), then permuted (0, 2, 1, 3) to [B, H, S, D].
std::string gptSplitHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                          int64_t dim) {
  std::string shape = batchSeqShape(g, scope, x, {heads, dim});
  std::string r = g.addNode("Reshape", scope, {x, shape});
  return g.addNode("Transpose", scope, {r}, {attrInts("perm", {0, 2, 1, 3})});
}

/// GPT2Attention._merge_heads: x [B, H, S, D] permuted (0, 2, 1, 3), then
/// viewed as x.size()[:-2] + (H * D,).
std::string gptMergeHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                          int64_t dim) {
  std::string t = g.addNode("Transpose", scope, {x}, {attrInts("perm", {0, 2, 1, 3})});
  std::string shape = batchSeqShape(g, scope, t, {heads * dim});
  return g.addNode("Reshape", scope, {t, shape});
}

/// GPT2Attention on x [B, S, E]: c_attn, Split into query, key and value,
/// heads split, softmax(where(Mask, q k^T / sqrt(D), float_min)) v, heads
/// merged, c_proj. \p mask is the bool [1, 1, S, S] causal buffer.
std::string gptAttention(GraphBuilder &g, const Mod &attn, const std::string &x,
                         const std::string &mask, int64_t e, int64_t heads) {
  int64_t d = e / heads;
  const StringRef s = attn.scope;
  std::string qkv = conv1d(g, attn.child("c_attn"), x, e, 3 * e);
  std::string sizes = g.constVector(s, {e, e, e});
  std::vector<std::string> parts = g.addNodeN("Split", s, {qkv, sizes}, 3, {attrInt("axis", 2)});
  std::string q = gptSplitHeads(g, s, parts[0], heads, d);
  std::string k = gptSplitHeads(g, s, parts[1], heads, d);
  std::string v = gptSplitHeads(g, s, parts[2], heads, d);
  // _attn: matmul(query, key.transpose(-1, -2)) / sqrt(D), causal where.
  std::string kt = g.addNode("Transpose", s, {k}, {attrInts("perm", {0, 1, 3, 2})});
  std::string scores = g.addNode("MatMul", s, {q, kt});
  std::string scale = g.constFloat(s, std::sqrt(float(d)));
  scores = g.addNode("Div", s, {scores, scale});
  std::string maskValue = g.constFloat(s, std::numeric_limits<float>::lowest());
  scores = g.addNode("Where", s, {mask, scores, maskValue});
  std::string probs = g.addNode("Softmax", s, {scores}, {attrInt("axis", -1)});
  std::string ctx = g.addNode("MatMul", s, {probs, v});
  ctx = gptMergeHeads(g, s, ctx, heads, d);
  return conv1d(g, attn.child("c_proj"), ctx, e, e);
}

/// GPT-2 as torch.onnx.export traces HF's GPT2LMHeadModel: pre-LN blocks of
/// GPT2Attention and a gelu_new MLP, every projection a Conv1D; HF module
/// and parameter names.
void buildGpt(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, s = o.seq;
  int64_t f = o.ffn ? o.ffn : 4 * e;
  g.addInput("input_ids", kInt64, {kBatch, s});
  Mod t = Mod().child("transformer");
  std::string wte = g.addWeight("transformer.wte.weight", {o.vocab, e});
  std::string x = g.addNode("Gather", t.child("wte").scope, {wte, "input_ids"});
  std::string pos = positionIds(g, t.scope);
  std::string wpe = g.addWeight("transformer.wpe.weight", {s, e});
  std::string p = g.addNode("Gather", t.child("wpe").scope, {wpe, pos});
  x = g.addNode("Add", t.scope, {x, p});
  // GPT2Attention's `bias` buffer (true on and below the diagonal), one copy
  // shared by all blocks.
  std::vector<uint8_t> causal(s * s, 0);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j <= i; ++j)
      causal[i * s + j] = 1;
  std::string mask = g.addBoolBuffer("causal_mask", {1, 1, s, s}, causal);
  for (int l = 0; l < o.layers; ++l) {
    Mod block = t.child("h." + Twine(l));
    Mod mlp = block.child("mlp");
    std::string hn = layerNorm(g, block.child("ln_1"), x, e, 1e-5f);
    std::string a = gptAttention(g, block.child("attn"), hn, mask, e, o.heads);
    x = g.addNode("Add", block.scope, {a, x});
    hn = layerNorm(g, block.child("ln_2"), x, e, 1e-5f);
    std::string m = conv1d(g, mlp.child("c_fc"), hn, e, f);
    m = geluNew(g, mlp.child("act").scope, m);
    m = conv1d(g, mlp.child("c_proj"), m, f, e);
    x = g.addNode("Add", block.scope, {x, m});
  }
  x = layerNorm(g, t.child("ln_f"), x, e, 1e-5f);
  lmHead(g, x, wte, e);
}

/// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
std::string rotary(GraphBuilder &g, StringRef scope, const std::string &x, const std::string &cos,
                   const std::string &sin, int64_t dim) {
  auto slice = [&](int64_t begin, int64_t end) {
    std::string starts = g.constVector(scope, {begin});
    std::string ends = g.constVector(scope, {end});
    std::string axes = g.constVector(scope, {3});
    std::string steps = g.constVector(scope, {1});
    return g.addNode("Slice", scope, {x, starts, ends, axes, steps});
  };
  std::string x1 = slice(0, dim / 2);
  std::string x2 = slice(dim / 2, std::numeric_limits<int64_t>::max());
  std::string neg = g.addNode("Neg", scope, {x2});
  std::string rot = g.addNode("Concat", scope, {neg, x1}, {attrInt("axis", -1)});
  std::string a = g.addNode("Mul", scope, {x, cos});
  std::string b = g.addNode("Mul", scope, {rot, sin});
  return g.addNode("Add", scope, {a, b});
}

/// repeat_kv: [B, KV, S, D] -> [B, KV * Rep, S, D].
std::string repeatKv(GraphBuilder &g, StringRef scope, const std::string &x, int64_t kvHeads,
                     int64_t rep, int64_t dim) {
  std::string axes = g.constVector(scope, {2});
  std::string u = g.addNode("Unsqueeze", scope, {x, axes});
  std::string reps = g.constVector(scope, {1, 1, rep, 1, 1});
  std::string ex = g.addNode("Expand", scope, {u, reps});
  std::string shape = g.batchShape(scope, ex, {kvHeads * rep, g.opts().seq, dim});
  return g.addNode("Reshape", scope, {ex, shape});
}

/// Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.
void buildLlama(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, h = o.heads, kv = o.kvHeads ? o.kvHeads : h;
  int64_t d = e / h, s = o.seq;
  int64_t f = o.ffn ? o.ffn : alignTo(8 * e / 3, 8);
  g.addInput("input_ids", kInt64, {kBatch, s});
  Mod m = Mod().child("model");
  std::string emb = g.addWeight("model.embed_tokens.weight", {o.vocab, e});
  std::string x = g.addNode("Gather", m.child("embed_tokens").scope, {emb, "input_ids"});
  // cos/sin of position * 10000^(-2i/D), both halves repeated as HF does.
  std::vector<float> cosTable(s * d), sinTable(s * d);
  for (int64_t p = 0; p < s; ++p)
    for (int64_t i = 0; i < d; ++i) {
      double freq = std::pow(10000.0, -double(2 * (i % (d / 2))) / d);
      cosTable[p * d + i] = std::cos(p * freq);
      sinTable[p * d + i] = std::sin(p * freq);
    }
  std::string cosT = g.addBuffer("model.rotary_emb.cos_cached", {s, d}, cosTable);
  std::string sinT = g.addBuffer("model.rotary_emb.sin_cached", {s, d}, sinTable);
  std::string mask = g.causalMask();
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = m.child("layers." + Twine(l));
    Mod attn = layer.child("self_attn"), mlp = layer.child("mlp");
    const std::string &attnScope = attn.scope;
    std::string hn = rmsNorm(g, layer.child("input_layernorm"), x, e, 1e-6f);
    std::string q = linear(g, attn.child("q_proj"), hn, e, h * d, false);
    std::string k = linear(g, attn.child("k_proj"), hn, e, kv * d, false);
    std::string v = linear(g, attn.child("v_proj"), hn, e, kv * d, false);
    q = splitHeads(g, attnScope, q, h, d, {0, 2, 1, 3});
    k = splitHeads(g, attnScope, k, kv, d, {0, 2, 1, 3});
    v = splitHeads(g, attnScope, v, kv, d, {0, 2, 1, 3});
    q = rotary(g, attnScope, q, cosT, sinT, d);
    k = rotary(g, attnScope, k, cosT, sinT, d);
    if (kv != h) {
      k = repeatKv(g, attnScope, k, kv, h / kv, d);
      v = repeatKv(g, attnScope, v, kv, h / kv, d);
    }
    std::string kt = g.addNode("Transpose", attnScope, {k}, {attrInts("perm", {0, 1, 3, 2})});
    std::string a = attention(g, attnScope, q, kt, v, mask, h, d);
    a = linear(g, attn.child("o_proj"), a, h * d, e, false);
    x = g.addNode("Add", layer.scope, {x, a});
    hn = rmsNorm(g, layer.child("post_attention_layernorm"), x, e, 1e-6f);
    std::string gate = linear(g, mlp.child("gate_proj"), hn, e, f, false);
    std::string actScope = mlp.child("act_fn").scope;
    std::string sig = g.addNode("Sigmoid", actScope, {gate});
    std::string act = g.addNode("Mul", actScope, {gate, sig});
    std::string up = linear(g, mlp.child("up_proj"), hn, e, f, false);
    std::string prod = g.addNode("Mul", mlp.scope, {act, up});
    std::string down = linear(g, mlp.child("down_proj"), prod, f, e, false);
    x = g.addNode("Add", layer.scope, {x, down});
  }
  x = rmsNorm(g, m.child("norm"), x, e, 1e-6f);
  lmHead(g, x, emb, e);
}

/// BERT encoder with pooler and a 2-class sequence classifier.
void buildBert(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, h = o.heads, d = e / h, s = o.seq;
  int64_t f = o.ffn ? o.ffn : 4 * e;
  g.addInput("input_ids", kInt64, {kBatch, s});
  g.addInput("attention_mask", kInt64, {kBatch, s});
  Mod bert = Mod().child("bert"), emb = bert.child("embeddings");

  Mod word = emb.child("word_embeddings");
  std::string x = g.addNode("Gather", word.scope,
                            {g.addWeight(word.param("weight"), {o.vocab, e}), "input_ids"});
  Mod tokType = emb.child("token_type_embeddings");
  std::string tokIds = g.constInts(emb.scope, {1, s}, std::vector<int64_t>(s, 0));
  std::string tokW = g.addWeight(tokType.param("weight"), {2, e});
  x = g.addNode("Add", emb.scope, {x, g.addNode("Gather", tokType.scope, {tokW, tokIds})});
  Mod posEmb = emb.child("position_embeddings");
  std::string posIds = positionIds(g, emb.scope);
  std::string posW = g.addWeight(posEmb.param("weight"), {s, e});
  x = g.addNode("Add", emb.scope, {x, g.addNode("Gather", posEmb.scope, {posW, posIds})});
  x = layerNorm(g, emb.child("LayerNorm"), x, e, 1e-12f);

  // Extended mask (1 - mask[:, None, None, :]) * float_min: [B, 1, 1, S].
  std::string axes = g.constVector(bert.scope, {1, 2});
  std::string mask = g.addNode("Unsqueeze", bert.scope, {"attention_mask", axes});
  mask = g.addNode("Cast", bert.scope, {mask}, {attrInt("to", kFloat)});
  std::string one = g.constFloat(bert.scope, 1.0f);
  mask = g.addNode("Sub", bert.scope, {one, mask});
  std::string min = g.constFloat(bert.scope, std::numeric_limits<float>::lowest());
  mask = g.addNode("Mul", bert.scope, {mask, min});

  Mod encoder = bert.child("encoder");
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = encoder.child("layer." + Twine(l));
    Mod self = layer.child("attention").child("self");
    Mod attnOut = layer.child("attention").child("output");
    Mod inter = layer.child("intermediate"), out = layer.child("output");
    std::string q = linear(g, self.child("query"), x, e, e, true);
    std::string k = linear(g, self.child("key"), x, e, e, true);
    std::string v = linear(g, self.child("value"), x, e, e, true);
    q = splitHeads(g, self.scope, q, h, d, {0, 2, 1, 3});
    std::string kt = splitHeads(g, self.scope, k, h, d, {0, 2, 3, 1});
    v = splitHeads(g, self.scope, v, h, d, {0, 2, 1, 3});
    std::string a = attention(g, self.scope, q, kt, v, mask, h, d);
    a = linear(g, attnOut.child("dense"), a, e, e, true);
    a = g.addNode("Add", attnOut.scope, {a, x});
    a = layerNorm(g, attnOut.child("LayerNorm"), a, e, 1e-12f);
    std::string i = linear(g, inter.child("dense"), a, e, f, true);
    i = gelu(g, inter.child("intermediate_act_fn").scope, i);
    std::string r = linear(g, out.child("dense"), i, f, e, true);
    r = g.addNode("Add", out.scope, {r, a});
    x = layerNorm(g, out.child("LayerNorm"), r, e, 1e-12f);
  }

  Mod pooler = bert.child("pooler");
  std::string zero = g.constInts(pooler.scope, {}, {0});
  std::string first = g.addNode("Gather", pooler.scope, {x, zero}, {attrInt("axis", 1)});
  std::string p = linear(g, pooler.child("dense"), first, e, e, true);
  p = g.addNode("Tanh", pooler.child("activation").scope, {p});
  linear(g, Mod().child("classifier"), p, e, 2, true, "logits");
  g.addOutput("logits", kFloat, {kBatch, 2});
  if (o.withLoss) {
    g.addInput("labels", kInt64, {kBatch});
    crossEntropy(g, "logits", "labels");
  }
}

/// input_proj, `layers` x (Gemm + Relu), head; MSE loss.
void buildMlp(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t in = o.vocab, e = o.hidden;
  g.addInput("x", kFloat, {kBatch, in});
  Mod root;
  std::string x = gemm(g, root.child("input_proj"), "x", in, e);
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = root.child("layers." + Twine(l));
    x = gemm(g, layer.child("linear"), x, e, e);
    x = g.addNode("Relu", layer.child("act").scope, {x});
  }
  gemm(g, root.child("head"), x, e, in, "y");
  g.addOutput("y", kFloat, {kBatch, in});
  if (!o.withLoss)
    return;
  g.addInput("labels", kFloat, {kBatch, in});
  std::string diff = g.addNode("Sub", "/loss_fn", {"y", "labels"});
  std::string sq = g.addNode("Mul", "/loss_fn", {diff, diff});
  g.addNode("ReduceMean", "/loss_fn", {sq}, {attrInt("keepdims", 0)}, "loss");
  g.addOutput("loss", kFloat, {});
}

/// Bias-free square Conv with weight [Out, In, K, K].
std::string conv(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                 int64_t k, int64_t stride, int64_t pad) {
  std::string w = g.addWeight(m.param("weight"), {out, in, k, k});
  return g.addNode("Conv", m.scope, {x, w},
                   {attrInts("dilations", {1, 1}), attrInt("group", 1),
                    attrInts("kernel_shape", {k, k}), attrInts("pads", {pad, pad, pad, pad}),
                    attrInts("strides", {stride, stride})});
}

/// Eval-mode BatchNorm2d.
std::string batchNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t channels) {
  std::string scale = g.addWeight(m.param("weight"), {channels}, Init::One);
  std::string bias = g.addWeight(m.param("bias"), {channels});
  std::string mean = g.addWeight(m.param("running_mean"), {channels});
  std::string var = g.addWeight(m.param("running_var"), {channels}, Init::One);
  return g.addNode("BatchNormalization", m.scope, {x, scale, bias, mean, var},
                   {attrFloat("epsilon", 1e-5f), attrFloat("momentum", 0.9f)});
}

/// torchvision ResNet v1.5 with bottleneck blocks.
void buildResnet(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t c = o.hidden, s = o.seq;
  g.addInput("images", kFloat, {kBatch, 3, s, s});
  Mod root;
  std::string x = conv(g, root.child("conv1"), "images", 3, c, 7, 2, 3);
  x = batchNorm(g, root.child("bn1"), x, c);
  x = g.addNode("Relu", "/relu", {x});
  x = g.addNode("MaxPool", "/maxpool", {x},
                {attrInt("ceil_mode", 0), attrInts("kernel_shape", {3, 3}),
                 attrInts("pads", {1, 1, 1, 1}), attrInts("strides", {2, 2})});
  int blocks[4] = {3, 4, 6, 3};
  if (o.layers != 16)
    for (int stage = 0; stage < 4; ++stage)
      blocks[stage] = o.layers / 4 + (stage < o.layers % 4 ? 1 : 0);
  int64_t in = c;
  for (int stage = 0; stage < 4; ++stage) {
    int64_t planes = c << stage, out = planes * 4;
    std::string layer = "layer" + std::to_string(stage + 1);
    for (int b = 0; b < blocks[stage]; ++b) {
      std::string name = layer + "." + std::to_string(b);
      Mod block{"/" + layer + "/" + name, name};
      int64_t stride = (b == 0 && stage > 0) ? 2 : 1;
      std::string y = conv(g, block.child("conv1"), x, in, planes, 1, 1, 0);
      y = batchNorm(g, block.child("bn1"), y, planes);
      y = g.addNode("Relu", block.child("relu").scope, {y});
      y = conv(g, block.child("conv2"), y, planes, planes, 3, stride, 1);
      y = batchNorm(g, block.child("bn2"), y, planes);
      y = g.addNode("Relu", block.child("relu_1").scope, {y});
      y = conv(g, block.child("conv3"), y, planes, out, 1, 1, 0);
      y = batchNorm(g, block.child("bn3"), y, out);
      std::string identity = x;
      if (b == 0) {
        Mod ds = block.child("downsample");
        Mod dsConv{ds.scope + "/downsample.0", ds.paramPrefix + ".0"};
        Mod dsNorm{ds.scope + "/downsample.1", ds.paramPrefix + ".1"};
        identity = conv(g, dsConv, x, in, out, 1, stride, 0);
        identity = batchNorm(g, dsNorm, identity, out);
      }
      x = g.addNode("Add", block.scope, {y, identity});
      x = g.addNode("Relu", block.child("relu_2").scope, {x});
      in = out;
    }
  }
  x = g.addNode("GlobalAveragePool", "/avgpool", {x});
  x = g.addNode("Flatten", "", {x}, {attrInt("axis", 1)});
  gemm(g, root.child("fc"), x, in, o.vocab, "logits");
  g.addOutput("logits", kFloat, {kBatch, o.vocab});
  if (o.withLoss) {
    g.addInput("labels", kInt64, {kBatch});
    crossEntropy(g, "logits", "labels");
  }
}

Error validate(const GeneratorOptions &o) {
  if (o.opset < 13 || o.opset > 17)
    return makeError("unsupported opset " + Twine(o.opset) + " (supported: 13..17)");
  if (o.layers < 1 || o.hidden < 1 || o.heads < 1 || o.vocab < 1 || o.seq < 1)
    return makeError("layers, hidden, heads, vocab and seq must be positive");
  if (o.batch < 0 || o.ffn < 0 || o.kvHeads < 0)
    return makeError("batch, ffn and kvHeads must not be negative");
  bool transformer =
      o.family == Family::Gpt || o.family == Family::Llama || o.family == Family::Bert;
  if (transformer && o.hidden % o.heads != 0)
    return makeError("hidden (" + Twine(o.hidden) + ") must be divisible by heads (" +
                     Twine(o.heads) + ")");
  if (o.family == Family::Llama) {
    int kv = o.kvHeads ? o.kvHeads : o.heads;
    if (o.heads % kv != 0)
      return makeError("heads (" + Twine(o.heads) + ") must be divisible by kvHeads (" + Twine(kv) +
                       ")");
    if ((o.hidden / o.heads) % 2 != 0)
      return makeError("llama head dimension (" + Twine(o.hidden / o.heads) +
                       ") must be even for rotary embeddings");
  }
  return Error::success();
}

/// Copies \p from into \p to except the graph's initializers.
void copyAllButInitializers(const onnx::ModelProto &from, onnx::ModelProto &to) {
  to.set_ir_version(from.ir_version());
  *to.mutable_opset_import() = from.opset_import();
  to.set_producer_name(from.producer_name());
  to.set_producer_version(from.producer_version());
  to.set_domain(from.domain());
  to.set_model_version(from.model_version());
  to.set_doc_string(from.doc_string());
  *to.mutable_metadata_props() = from.metadata_props();
  *to.mutable_training_info() = from.training_info();
  *to.mutable_functions() = from.functions();
  const onnx::GraphProto &fg = from.graph();
  onnx::GraphProto &tg = *to.mutable_graph();
  *tg.mutable_node() = fg.node();
  tg.set_name(fg.name());
  *tg.mutable_sparse_initializer() = fg.sparse_initializer();
  tg.set_doc_string(fg.doc_string());
  *tg.mutable_input() = fg.input();
  *tg.mutable_output() = fg.output();
  *tg.mutable_value_info() = fg.value_info();
  *tg.mutable_quantization_annotation() = fg.quantization_annotation();
}

std::string errnoText() { return std::strerror(errno); }

/// Serializes \p model to \p path through a buffered file stream.
Error writeProto(const onnx::ModelProto &model, StringRef path) {
  size_t size = model.ByteSizeLong();
  if (size > size_t(INT_MAX))
    return makeError("cannot write '" + path + "': the model would take " + Twine(size) +
                     " bytes, over protobuf's 2 GiB limit; use external data");
  std::ofstream os(path.str(), std::ios::binary | std::ios::trunc);
  if (!os)
    return makeError("cannot open '" + path + "' for writing: " + errnoText());
  bool ok;
  {
    google::protobuf::io::OstreamOutputStream zeroCopy(&os, 1 << 20);
    google::protobuf::io::CodedOutputStream coded(&zeroCopy);
    coded.SetSerializationDeterministic(true);
    model.SerializeWithCachedSizes(&coded);
    ok = !coded.HadError();
  }
  os.close();
  if (!ok || !os)
    return makeError("failed writing '" + path + "': " + errnoText());
  return Error::success();
}

} // namespace

Expected<Family> parseFamily(StringRef name) {
  static const std::pair<StringRef, Family> names[] = {{"gpt", Family::Gpt},
                                                       {"llama", Family::Llama},
                                                       {"bert", Family::Bert},
                                                       {"mlp", Family::Mlp},
                                                       {"resnet", Family::Resnet}};
  for (const auto &[Text, F] : names)
    if (name.equals_insensitive(Text))
      return F;
  return makeError("unknown model family '" + name +
                   "' (expected gpt, llama, bert, mlp or resnet)");
}

StringRef familyName(Family f) {
  switch (f) {
  case Family::Gpt:
    return "gpt";
  case Family::Llama:
    return "llama";
  case Family::Bert:
    return "bert";
  case Family::Mlp:
    return "mlp";
  case Family::Resnet:
    return "resnet";
  }
  llvm_unreachable("unknown family");
}

Expected<onnx::ModelProto> generateModel(const GeneratorOptions &opts) {
  if (Error e = validate(opts))
    return e;
  try {
    onnx::ModelProto model;
    model.set_ir_version(8);
    model.set_producer_name("pipec");
    model.set_producer_version("0.1");
    onnx::OperatorSetIdProto *opset = model.add_opset_import();
    opset->set_domain("");
    opset->set_version(opts.opset);
    onnx::GraphProto *graph = model.mutable_graph();
    graph->set_name("main_graph");
    GraphBuilder g(*graph, opts);
    switch (opts.family) {
    case Family::Gpt:
      buildGpt(g);
      break;
    case Family::Llama:
      buildLlama(g);
      break;
    case Family::Bert:
      buildBert(g);
      break;
    case Family::Mlp:
      buildMlp(g);
      break;
    case Family::Resnet:
      buildResnet(g);
      break;
    }
    return model;
  } catch (const std::exception &e) {
    return makeError(Twine("model generation failed: ") + e.what());
  }
}

Error writeModel(const onnx::ModelProto &model, StringRef path, bool externalData,
                 uint64_t externalThreshold) {
  try {
    if (!externalData)
      return writeProto(model, path);

    std::string dataPath = (path + ".data").str();
    std::string location = sys::path::filename(dataPath).str();
    std::ofstream data(dataPath, std::ios::binary | std::ios::trunc);
    if (!data)
      return makeError("cannot open '" + dataPath + "' for writing: " + errnoText());

    onnx::ModelProto out;
    copyAllButInitializers(model, out);
    uint64_t offset = 0;
    static const char zeros[64] = {};
    for (const onnx::TensorProto &init : model.graph().initializer()) {
      onnx::TensorProto *t = out.mutable_graph()->add_initializer();
      if (init.data_location() == onnx::TensorProto::EXTERNAL ||
          init.raw_data().size() < externalThreshold) {
        *t = init;
        continue;
      }
      t->set_name(init.name());
      t->set_data_type(init.data_type());
      *t->mutable_dims() = init.dims();
      if (init.has_doc_string())
        t->set_doc_string(init.doc_string());
      uint64_t aligned = alignTo(offset, 64);
      data.write(zeros, aligned - offset);
      const std::string &raw = init.raw_data();
      data.write(raw.data(), raw.size());
      t->set_data_location(onnx::TensorProto::EXTERNAL);
      auto addEntry = [&](StringRef key, const std::string &value) {
        onnx::StringStringEntryProto *e = t->add_external_data();
        e->set_key(key.str());
        e->set_value(value);
      };
      addEntry("location", location);
      addEntry("offset", std::to_string(aligned));
      addEntry("length", std::to_string(raw.size()));
      offset = aligned + raw.size();
    }
    data.close();
    if (!data)
      return makeError("failed writing '" + dataPath + "': " + errnoText());
    return writeProto(out, path);
  } catch (const std::exception &e) {
    return makeError("cannot write '" + path + "': " + e.what());
  }
}

} // namespace pipec::models
