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

Error makeError(const Twine &Msg) { return createStringError(inconvertibleErrorCode(), Msg); }

/// splitmix64: tiny, fast and good enough for weights.
class Rng {
public:
  explicit Rng(uint64_t Seed) : State(Seed) {}

  uint64_t next() {
    uint64_t Z = (State += 0x9e3779b97f4a7c15ULL);
    Z = (Z ^ (Z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    Z = (Z ^ (Z >> 27)) * 0x94d049bb133111ebULL;
    return Z ^ (Z >> 31);
  }

  /// Approximately N(0, Std): the sum of four 16-bit uniforms (Irwin-Hall),
  /// centered and scaled by its standard deviation 65536 / sqrt(3).
  float normal(float Std) {
    uint64_t R = next();
    int64_t Sum = int64_t(R & 0xffff) + int64_t((R >> 16) & 0xffff) + int64_t((R >> 32) & 0xffff) +
                  int64_t(R >> 48);
    return float(Sum - 131070) * (Std / 37837.23f);
  }

private:
  uint64_t State;
};

uint64_t hashName(StringRef Name) {
  uint64_t H = 0xcbf29ce484222325ULL; // FNV-1a
  for (unsigned char C : Name)
    H = (H ^ C) * 0x100000001b3ULL;
  return H;
}

/// Converts to IEEE half, rounding to nearest; overflow saturates to inf.
uint16_t floatToHalf(float F) {
  uint32_t X;
  std::memcpy(&X, &F, sizeof(X));
  uint16_t Sign = (X >> 16) & 0x8000;
  int32_t Exp = int32_t((X >> 23) & 0xff) - 127 + 15;
  uint32_t Mant = X & 0x7fffff;
  if (Exp >= 31)
    return Sign | 0x7c00;
  if (Exp <= 0) { // Subnormal half (or zero).
    if (Exp < -10)
      return Sign;
    return Sign | uint16_t((Mant | 0x800000) >> (14 - Exp));
  }
  uint16_t H = Sign | uint16_t(Exp << 10) | uint16_t(Mant >> 13);
  return (Mant & 0x1000) ? H + 1 : H; // A carry into the exponent is right.
}

onnx::AttributeProto attrInt(StringRef Name, int64_t Value) {
  onnx::AttributeProto A;
  A.set_name(Name.str());
  A.set_type(onnx::AttributeProto::INT);
  A.set_i(Value);
  return A;
}

onnx::AttributeProto attrFloat(StringRef Name, float Value) {
  onnx::AttributeProto A;
  A.set_name(Name.str());
  A.set_type(onnx::AttributeProto::FLOAT);
  A.set_f(Value);
  return A;
}

onnx::AttributeProto attrInts(StringRef Name, ArrayRef<int64_t> Values) {
  onnx::AttributeProto A;
  A.set_name(Name.str());
  A.set_type(onnx::AttributeProto::INTS);
  for (int64_t V : Values)
    A.add_ints(V);
  return A;
}

onnx::AttributeProto attrString(StringRef Name, StringRef Value) {
  onnx::AttributeProto A;
  A.set_name(Name.str());
  A.set_type(onnx::AttributeProto::STRING);
  A.set_s(Value.str());
  return A;
}

/// Appends \p Count values Base + ~N(0, 0.02), each converted by \p Convert,
/// to \p Raw (little-endian, as is every host we build on).
template <typename T, typename ConvertFn>
void appendRandom(std::string &Raw, int64_t Count, Rng &R, float Base, ConvertFn Convert) {
  constexpr int64_t Chunk = 4096;
  T Buf[Chunk];
  Raw.reserve(Count * sizeof(T));
  for (int64_t I = 0; I < Count; I += Chunk) {
    int64_t N = std::min(Chunk, Count - I);
    for (int64_t J = 0; J < N; ++J)
      Buf[J] = Convert(Base + R.normal(0.02f));
    Raw.append(reinterpret_cast<const char *>(Buf), N * sizeof(T));
  }
}

/// A torch module: its export scope ("/transformer/h.0") and its parameter
/// prefix ("transformer.h.0").
struct Mod {
  std::string Scope;
  std::string Param;

  Mod child(const Twine &Name) const {
    std::string N = Name.str();
    return {Scope + "/" + N, Param.empty() ? N : Param + "." + N};
  }
  std::string param(StringRef Leaf) const { return Param + "." + Leaf.str(); }
};

/// How a weight is filled: ~N(0, 0.02), or 1 + N(0, 0.02) for norm scales
/// and batch-norm variances.
enum class Init { Normal, One };

/// Appends nodes, constants, initializers and graph inputs/outputs to a graph
/// with torch-style names.
class GraphBuilder {
public:
  GraphBuilder(onnx::GraphProto &Graph, const GeneratorOptions &Opts) : Graph(Graph), Opts(Opts) {}

  const GeneratorOptions &opts() const { return Opts; }

  /// Adds a node named "<Scope>/<OpType>" (then "_1", "_2", ... as torch
  /// does) and returns its outputs "<name>_output_<i>"; \p OutName, when
  /// given, names the first output instead.
  std::vector<std::string> addNodeN(StringRef OpType, StringRef Scope, ArrayRef<std::string> Inputs,
                                    unsigned NumOutputs, ArrayRef<onnx::AttributeProto> Attrs = {},
                                    StringRef OutName = "") {
    std::string Name = uniqueName((Scope + "/" + OpType).str());
    onnx::NodeProto *N = Graph.add_node();
    N->set_name(Name);
    N->set_op_type(OpType.str());
    for (const std::string &In : Inputs)
      N->add_input(In);
    std::vector<std::string> Outs;
    for (unsigned I = 0; I < NumOutputs; ++I) {
      Outs.push_back(I == 0 && !OutName.empty() ? OutName.str()
                                                : Name + "_output_" + std::to_string(I));
      N->add_output(Outs.back());
    }
    for (const onnx::AttributeProto &A : Attrs)
      *N->add_attribute() = A;
    return Outs;
  }

  /// Single-output addNodeN.
  std::string addNode(StringRef OpType, StringRef Scope, ArrayRef<std::string> Inputs,
                      ArrayRef<onnx::AttributeProto> Attrs = {}, StringRef OutName = "") {
    return addNodeN(OpType, Scope, Inputs, 1, Attrs, OutName)[0];
  }

  /// Adds a Constant node holding \p Tensor.
  std::string constant(StringRef Scope, onnx::TensorProto Tensor) {
    onnx::AttributeProto A;
    A.set_name("value");
    A.set_type(onnx::AttributeProto::TENSOR);
    *A.mutable_t() = std::move(Tensor);
    return addNode("Constant", Scope, {}, {A});
  }

  /// Adds an int64 Constant of shape \p Dims (a scalar when empty).
  std::string constInts(StringRef Scope, ArrayRef<int64_t> Dims, ArrayRef<int64_t> Values) {
    onnx::TensorProto T;
    T.set_data_type(kInt64);
    for (int64_t D : Dims)
      T.add_dims(D);
    for (int64_t V : Values)
      T.add_int64_data(V);
    return constant(Scope, std::move(T));
  }

  /// Adds a 1-D int64 Constant.
  std::string constVector(StringRef Scope, ArrayRef<int64_t> Values) {
    return constInts(Scope, {int64_t(Values.size())}, Values);
  }

  /// Adds a scalar float Constant.
  std::string constFloat(StringRef Scope, float Value) {
    onnx::TensorProto T;
    T.set_data_type(kFloat);
    T.add_float_data(Value);
    return constant(Scope, std::move(T));
  }

  /// Adds a pseudo-random float weight and returns the value to consume: the
  /// initializer itself, or with fp16Weights the output of its Cast to float.
  /// Each weight is seeded from the options' seed and its own name.
  std::string addWeight(StringRef Name, ArrayRef<int64_t> Dims, Init Kind = Init::Normal) {
    if (Opts.lightWeights)
      return addFill(Name, Dims, kFloat, Kind == Init::One ? 1.0f : 0.02f);
    onnx::TensorProto *T = Graph.add_initializer();
    T->set_name(Name.str());
    int64_t Count = 1;
    for (int64_t D : Dims) {
      T->add_dims(D);
      Count *= D;
    }
    Rng R(Rng(Opts.seed).next() ^ hashName(Name));
    float Base = Kind == Init::One ? 1.0f : 0.0f;
    std::string &Raw = *T->mutable_raw_data();
    if (!Opts.fp16Weights) {
      T->set_data_type(kFloat);
      appendRandom<float>(Raw, Count, R, Base, [](float F) { return F; });
      return Name.str();
    }
    T->set_data_type(onnx::TensorProto::FLOAT16);
    appendRandom<uint16_t>(Raw, Count, R, Base, floatToHalf);
    return addNode("Cast", ("/" + Name).str(), {Name.str()}, {attrInt("to", kFloat)});
  }

  /// With lightWeights: a ConstantOfShape fill named \p Name instead of an
  /// initializer, as ONNX's "light" test models store their weights.
  std::string addFill(StringRef Name, ArrayRef<int64_t> Dims, int32_t ElemType, float Value) {
    std::string Shape = constVector(("/" + Name).str(), Dims);
    onnx::AttributeProto A;
    A.set_name("value");
    A.set_type(onnx::AttributeProto::TENSOR);
    onnx::TensorProto *T = A.mutable_t();
    T->set_data_type(ElemType);
    T->add_dims(1);
    if (ElemType == kFloat)
      T->add_float_data(Value);
    else
      T->add_int32_data(static_cast<int32_t>(Value));
    return addNode("ConstantOfShape", ("/" + Name).str(), {Shape}, {A}, Name);
  }

  /// Adds a float32 initializer with fixed contents (masks, rotary tables).
  std::string addBuffer(StringRef Name, ArrayRef<int64_t> Dims, ArrayRef<float> Values) {
    if (Opts.lightWeights)
      return addFill(Name, Dims, kFloat, 0.0f);
    onnx::TensorProto *T = Graph.add_initializer();
    T->set_name(Name.str());
    T->set_data_type(kFloat);
    for (int64_t D : Dims)
      T->add_dims(D);
    T->set_raw_data(Values.data(), Values.size() * sizeof(float));
    return Name.str();
  }

  /// Adds a BOOL initializer with fixed contents, one byte (0 or 1) each.
  std::string addBoolBuffer(StringRef Name, ArrayRef<int64_t> Dims, ArrayRef<uint8_t> Values) {
    if (Opts.lightWeights)
      return addFill(Name, Dims, onnx::TensorProto::BOOL, 1.0f);
    onnx::TensorProto *T = Graph.add_initializer();
    T->set_name(Name.str());
    T->set_data_type(onnx::TensorProto::BOOL);
    for (int64_t D : Dims)
      T->add_dims(D);
    T->set_raw_data(Values.data(), Values.size());
    return Name.str();
  }

  /// Declares a graph input; kBatch in \p Dims is the batch dimension.
  void addInput(StringRef Name, int32_t ElemType, ArrayRef<int64_t> Dims) {
    fillValueInfo(*Graph.add_input(), Name, ElemType, Dims);
  }

  /// Declares a graph output; kBatch in \p Dims is the batch dimension.
  void addOutput(StringRef Name, int32_t ElemType, ArrayRef<int64_t> Dims) {
    fillValueInfo(*Graph.add_output(), Name, ElemType, Dims);
  }

  /// Returns an int64 shape [batch, Rest...] for a Reshape. With a symbolic
  /// batch it is read from dimension 0 of \p Like as torch does (Shape,
  /// Gather, Unsqueeze, Concat); otherwise it is a Constant.
  std::string batchShape(StringRef Scope, const std::string &Like, ArrayRef<int64_t> Rest) {
    if (Opts.batch > 0) {
      std::vector<int64_t> Shape{Opts.batch};
      Shape.insert(Shape.end(), Rest.begin(), Rest.end());
      return constVector(Scope, Shape);
    }
    std::string Shape = addNode("Shape", Scope, {Like});
    std::string Zero = constInts(Scope, {}, {0});
    std::string Dim = addNode("Gather", Scope, {Shape, Zero}, {attrInt("axis", 0)});
    std::string Axes = constVector(Scope, {0});
    std::string Unsq = addNode("Unsqueeze", Scope, {Dim, Axes});
    std::string Tail = constVector(Scope, Rest);
    return addNode("Concat", Scope, {Unsq, Tail}, {attrInt("axis", 0)});
  }

  /// The shared [1, 1, seq, seq] additive causal mask (0 on and below the
  /// diagonal, float lowest above), created on first use.
  std::string causalMask() {
    if (CausalMask.empty()) {
      int64_t S = Opts.seq;
      std::vector<float> Values(S * S, 0.0f);
      for (int64_t I = 0; I < S; ++I)
        for (int64_t J = I + 1; J < S; ++J)
          Values[I * S + J] = std::numeric_limits<float>::lowest();
      CausalMask = addBuffer("causal_mask", {1, 1, S, S}, Values);
    }
    return CausalMask;
  }

private:
  std::string uniqueName(std::string Base) {
    unsigned &Count = NameCounts[Base];
    if (Count++ == 0)
      return Base;
    return Base + "_" + std::to_string(Count - 1);
  }

  void fillValueInfo(onnx::ValueInfoProto &VI, StringRef Name, int32_t ElemType,
                     ArrayRef<int64_t> Dims) {
    VI.set_name(Name.str());
    auto *Tensor = VI.mutable_type()->mutable_tensor_type();
    Tensor->set_elem_type(ElemType);
    auto *Shape = Tensor->mutable_shape();
    for (int64_t D : Dims) {
      auto *Dim = Shape->add_dim();
      if (D != kBatch)
        Dim->set_dim_value(D);
      else if (Opts.batch > 0)
        Dim->set_dim_value(Opts.batch);
      else
        Dim->set_dim_param("batch");
    }
  }

  onnx::GraphProto &Graph;
  const GeneratorOptions &Opts;
  StringMap<unsigned> NameCounts;
  std::string CausalMask;
};

//===----------------------------------------------------------------------===//
// Layers shared by the families
//===----------------------------------------------------------------------===//

/// x @ W (+ b) with W [In, Out] named "<module>.weight".
std::string linear(GraphBuilder &G, const Mod &M, const std::string &X, int64_t In, int64_t Out,
                   bool Bias, StringRef OutName = "") {
  std::string W = G.addWeight(M.param("weight"), {In, Out});
  std::string Y = G.addNode("MatMul", M.Scope, {X, W}, {}, Bias ? StringRef() : OutName);
  if (!Bias)
    return Y;
  std::string B = G.addWeight(M.param("bias"), {Out});
  return G.addNode("Add", M.Scope, {B, Y}, {}, OutName);
}

/// torch.nn.Linear on a 2-D input: Gemm(x, W [Out, In], b, transB=1).
std::string gemm(GraphBuilder &G, const Mod &M, const std::string &X, int64_t In, int64_t Out,
                 StringRef OutName = "") {
  std::string W = G.addWeight(M.param("weight"), {Out, In});
  std::string B = G.addWeight(M.param("bias"), {Out});
  return G.addNode("Gemm", M.Scope, {X, W, B},
                   {attrFloat("alpha", 1.0f), attrFloat("beta", 1.0f), attrInt("transB", 1)},
                   OutName);
}

/// LayerNorm over the last axis: the LayerNormalization op from opset 17,
/// the torch decomposition below.
std::string layerNorm(GraphBuilder &G, const Mod &M, const std::string &X, int64_t Width,
                      float Eps) {
  std::string W = G.addWeight(M.param("weight"), {Width}, Init::One);
  std::string B = G.addWeight(M.param("bias"), {Width});
  if (G.opts().opset >= 17)
    return G.addNode("LayerNormalization", M.Scope, {X, W, B},
                     {attrInt("axis", -1), attrFloat("epsilon", Eps)});
  const StringRef S = M.Scope;
  auto Mean = [&](const std::string &In) {
    return G.addNode("ReduceMean", S, {In}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  };
  std::string Centered = G.addNode("Sub", S, {X, Mean(X)});
  std::string Two = G.constFloat(S, 2.0f);
  std::string Var = Mean(G.addNode("Pow", S, {Centered, Two}));
  std::string EpsC = G.constFloat(S, Eps);
  std::string Std = G.addNode("Sqrt", S, {G.addNode("Add", S, {Var, EpsC})});
  std::string Norm = G.addNode("Div", S, {Centered, Std});
  return G.addNode("Add", S, {G.addNode("Mul", S, {Norm, W}), B});
}

/// Llama RMSNorm: w * (x * 1 / sqrt(mean(x^2) + eps)).
std::string rmsNorm(GraphBuilder &G, const Mod &M, const std::string &X, int64_t Width, float Eps) {
  std::string W = G.addWeight(M.param("weight"), {Width}, Init::One);
  const StringRef S = M.Scope;
  std::string Two = G.constFloat(S, 2.0f);
  std::string Sq = G.addNode("Pow", S, {X, Two});
  std::string Var =
      G.addNode("ReduceMean", S, {Sq}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  std::string EpsC = G.constFloat(S, Eps);
  std::string Std = G.addNode("Sqrt", S, {G.addNode("Add", S, {Var, EpsC})});
  std::string Inv = G.addNode("Reciprocal", S, {Std});
  return G.addNode("Mul", S, {W, G.addNode("Mul", S, {X, Inv})});
}

/// Exact GELU as torch exports it: x * (1 + erf(x / sqrt(2))) * 0.5.
std::string gelu(GraphBuilder &G, StringRef Scope, const std::string &X) {
  std::string Sqrt2 = G.constFloat(Scope, float(M_SQRT2));
  std::string Erf = G.addNode("Erf", Scope, {G.addNode("Div", Scope, {X, Sqrt2})});
  std::string One = G.constFloat(Scope, 1.0f);
  std::string Sum = G.addNode("Add", Scope, {Erf, One});
  std::string Prod = G.addNode("Mul", Scope, {X, Sum});
  std::string Half = G.constFloat(Scope, 0.5f);
  return G.addNode("Mul", Scope, {Prod, Half});
}

/// [B, S, Heads * Dim] -> Reshape [B, S, Heads, Dim] -> Transpose(Perm).
std::string splitHeads(GraphBuilder &G, StringRef Scope, const std::string &X, int64_t Heads,
                       int64_t Dim, ArrayRef<int64_t> Perm) {
  std::string Shape = G.batchShape(Scope, X, {G.opts().seq, Heads, Dim});
  std::string R = G.addNode("Reshape", Scope, {X, Shape});
  return G.addNode("Transpose", Scope, {R}, {attrInts("perm", Perm)});
}

/// softmax(Q K^T / sqrt(Dim) + Mask) V with Q, V [B, H, S, Dim] and
/// KT [B, H, Dim, S]; returns the heads merged back to [B, S, H * Dim].
std::string attention(GraphBuilder &G, StringRef Scope, const std::string &Q, const std::string &KT,
                      const std::string &V, const std::string &Mask, int64_t Heads, int64_t Dim) {
  std::string Scores = G.addNode("MatMul", Scope, {Q, KT});
  std::string Scale = G.constFloat(Scope, std::sqrt(float(Dim)));
  Scores = G.addNode("Div", Scope, {Scores, Scale});
  Scores = G.addNode("Add", Scope, {Scores, Mask});
  std::string Probs = G.addNode("Softmax", Scope, {Scores}, {attrInt("axis", -1)});
  std::string Ctx = G.addNode("MatMul", Scope, {Probs, V});
  Ctx = G.addNode("Transpose", Scope, {Ctx}, {attrInts("perm", {0, 2, 1, 3})});
  std::string Shape = G.batchShape(Scope, Ctx, {G.opts().seq, Heads * Dim});
  return G.addNode("Reshape", Scope, {Ctx, Shape});
}

/// SoftmaxCrossEntropyLoss (mean, ignore_index -100) as the "loss" output.
void crossEntropy(GraphBuilder &G, const std::string &Logits, const std::string &Labels) {
  G.addNode("SoftmaxCrossEntropyLoss", "/loss_fct", {Logits, Labels},
            {attrInt("ignore_index", -100), attrString("reduction", "mean")}, "loss");
  G.addOutput("loss", kFloat, {});
}

/// The LM head producing "logits" [B, S, V] (and the loss): MatMul with its
/// own weight, or with the Transpose of the token embedding when tied.
void lmHead(GraphBuilder &G, const std::string &X, const std::string &Embedding, int64_t Width) {
  const GeneratorOptions &O = G.opts();
  Mod Head = Mod().child("lm_head");
  std::string W = O.tiedEmbeddings
                      ? G.addNode("Transpose", Head.Scope, {Embedding}, {attrInts("perm", {1, 0})})
                      : G.addWeight(Head.param("weight"), {Width, int64_t(O.vocab)});
  G.addNode("MatMul", Head.Scope, {X, W}, {}, "logits");
  G.addOutput("logits", kFloat, {kBatch, O.seq, O.vocab});
  if (!O.withLoss)
    return;
  G.addInput("labels", kInt64, {kBatch, O.seq});
  std::string LogitShape = G.constVector("", {-1, O.vocab});
  std::string Flat = G.addNode("Reshape", "", {"logits", LogitShape});
  std::string LabelShape = G.constVector("", {-1});
  std::string FlatLabels = G.addNode("Reshape", "", {"labels", LabelShape});
  crossEntropy(G, Flat, FlatLabels);
}

/// Position ids 0..seq-1 as an int64 [1, seq] Constant.
std::string positionIds(GraphBuilder &G, StringRef Scope) {
  std::vector<int64_t> Ids(G.opts().seq);
  for (size_t I = 0; I < Ids.size(); ++I)
    Ids[I] = I;
  return G.constInts(Scope, {1, G.opts().seq}, Ids);
}

//===----------------------------------------------------------------------===//
// Families
//===----------------------------------------------------------------------===//

/// x.size(Index) as torch traces it: Shape -> Gather(Constant Index), an
/// int64 scalar.
std::string sizeOf(GraphBuilder &G, StringRef Scope, const std::string &X, int64_t Index) {
  std::string Shape = G.addNode("Shape", Scope, {X});
  std::string I = G.constInts(Scope, {}, {Index});
  return G.addNode("Gather", Scope, {Shape, I}, {attrInt("axis", 0)});
}

/// The Reshape target (x.size(0), x.size(1)) + Tail for x [B, S, ...]. With
/// a symbolic batch both sizes are read with sizeOf and unsqueezed to [1],
/// then concatenated with the Constant Tail; with a static batch torch folds
/// it all into one Constant.
std::string batchSeqShape(GraphBuilder &G, StringRef Scope, const std::string &X,
                          ArrayRef<int64_t> Tail) {
  const GeneratorOptions &O = G.opts();
  if (O.batch > 0) {
    std::vector<int64_t> Shape{O.batch, O.seq};
    Shape.insert(Shape.end(), Tail.begin(), Tail.end());
    return G.constVector(Scope, Shape);
  }
  std::string Batch = sizeOf(G, Scope, X, 0);
  std::string Seq = sizeOf(G, Scope, X, 1);
  auto Unsqueeze = [&](const std::string &Scalar) {
    std::string Axes = G.constVector(Scope, {0});
    return G.addNode("Unsqueeze", Scope, {Scalar, Axes});
  };
  std::string B = Unsqueeze(Batch);
  std::string S = Unsqueeze(Seq);
  std::string T = G.constVector(Scope, Tail);
  return G.addNode("Concat", Scope, {B, S, T}, {attrInt("axis", 0)});
}

/// HF Conv1D (weight [In, Out], bias [Out]) on x [B, S, In]:
///   size_out = x.size()[:-1] + (Out,)
///   x = addmm(bias, x.view(-1, In), weight).view(size_out)
/// exported as a Reshape to the Constant [-1, In], MatMul + Add and a Reshape
/// to size_out: Shape -> Slice(0, -1) -> Concat([Out]) with a symbolic
/// batch, a Constant with a static one.
std::string conv1d(GraphBuilder &G, const Mod &M, const std::string &X, int64_t In, int64_t Out) {
  const GeneratorOptions &O = G.opts();
  const StringRef S = M.Scope;
  std::string SizeOut;
  if (O.batch > 0) {
    SizeOut = G.constVector(S, {O.batch, O.seq, Out});
  } else {
    std::string Shape = G.addNode("Shape", S, {X});
    std::string Starts = G.constVector(S, {0});
    std::string Ends = G.constVector(S, {-1});
    std::string Axes = G.constVector(S, {0});
    std::string Leading = G.addNode("Slice", S, {Shape, Starts, Ends, Axes});
    std::string Nf = G.constVector(S, {Out});
    SizeOut = G.addNode("Concat", S, {Leading, Nf}, {attrInt("axis", 0)});
  }
  std::string FlatShape = G.constVector(S, {-1, In});
  std::string Flat = G.addNode("Reshape", S, {X, FlatShape});
  std::string Y = linear(G, M, Flat, In, Out, /*Bias=*/true);
  return G.addNode("Reshape", S, {Y, SizeOut});
}

/// HF gelu_new, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))),
/// one node per torch operator.
std::string geluNew(GraphBuilder &G, StringRef Scope, const std::string &X) {
  std::string Half = G.constFloat(Scope, 0.5f);
  std::string HalfX = G.addNode("Mul", Scope, {Half, X});
  std::string Three = G.constFloat(Scope, 3.0f);
  std::string Cube = G.addNode("Pow", Scope, {X, Three});
  std::string Coeff = G.constFloat(Scope, 0.044715f);
  std::string Inner = G.addNode("Mul", Scope, {Coeff, Cube});
  Inner = G.addNode("Add", Scope, {X, Inner});
  std::string Scale = G.constFloat(Scope, float(std::sqrt(2.0 / M_PI)));
  Inner = G.addNode("Mul", Scope, {Scale, Inner});
  std::string Tanh = G.addNode("Tanh", Scope, {Inner});
  std::string One = G.constFloat(Scope, 1.0f);
  std::string OnePlus = G.addNode("Add", Scope, {One, Tanh});
  return G.addNode("Mul", Scope, {HalfX, OnePlus});
}

/// GPT2Attention._split_heads: x [B, S, H * D] viewed as
/// x.size()[:-1] + (H, D), then permuted (0, 2, 1, 3) to [B, H, S, D].
std::string gptSplitHeads(GraphBuilder &G, StringRef Scope, const std::string &X, int64_t Heads,
                          int64_t Dim) {
  std::string Shape = batchSeqShape(G, Scope, X, {Heads, Dim});
  std::string R = G.addNode("Reshape", Scope, {X, Shape});
  return G.addNode("Transpose", Scope, {R}, {attrInts("perm", {0, 2, 1, 3})});
}

/// GPT2Attention._merge_heads: x [B, H, S, D] permuted (0, 2, 1, 3), then
/// viewed as x.size()[:-2] + (H * D,).
std::string gptMergeHeads(GraphBuilder &G, StringRef Scope, const std::string &X, int64_t Heads,
                          int64_t Dim) {
  std::string T = G.addNode("Transpose", Scope, {X}, {attrInts("perm", {0, 2, 1, 3})});
  std::string Shape = batchSeqShape(G, Scope, T, {Heads * Dim});
  return G.addNode("Reshape", Scope, {T, Shape});
}

/// GPT2Attention on x [B, S, E]: c_attn, Split into query, key and value,
/// heads split, softmax(where(Mask, q k^T / sqrt(D), float_min)) v, heads
/// merged, c_proj. \p Mask is the bool [1, 1, S, S] causal buffer.
std::string gptAttention(GraphBuilder &G, const Mod &Attn, const std::string &X,
                         const std::string &Mask, int64_t E, int64_t Heads) {
  int64_t D = E / Heads;
  const StringRef S = Attn.Scope;
  std::string Qkv = conv1d(G, Attn.child("c_attn"), X, E, 3 * E);
  std::string Sizes = G.constVector(S, {E, E, E});
  std::vector<std::string> Parts = G.addNodeN("Split", S, {Qkv, Sizes}, 3, {attrInt("axis", 2)});
  std::string Q = gptSplitHeads(G, S, Parts[0], Heads, D);
  std::string K = gptSplitHeads(G, S, Parts[1], Heads, D);
  std::string V = gptSplitHeads(G, S, Parts[2], Heads, D);
  // _attn: matmul(query, key.transpose(-1, -2)) / sqrt(D), causal where.
  std::string KT = G.addNode("Transpose", S, {K}, {attrInts("perm", {0, 1, 3, 2})});
  std::string Scores = G.addNode("MatMul", S, {Q, KT});
  std::string Scale = G.constFloat(S, std::sqrt(float(D)));
  Scores = G.addNode("Div", S, {Scores, Scale});
  std::string MaskValue = G.constFloat(S, std::numeric_limits<float>::lowest());
  Scores = G.addNode("Where", S, {Mask, Scores, MaskValue});
  std::string Probs = G.addNode("Softmax", S, {Scores}, {attrInt("axis", -1)});
  std::string Ctx = G.addNode("MatMul", S, {Probs, V});
  Ctx = gptMergeHeads(G, S, Ctx, Heads, D);
  return conv1d(G, Attn.child("c_proj"), Ctx, E, E);
}

/// GPT-2 as torch.onnx.export traces HF's GPT2LMHeadModel: pre-LN blocks of
/// GPT2Attention and a gelu_new MLP, every projection a Conv1D; HF module
/// and parameter names.
void buildGpt(GraphBuilder &G) {
  const GeneratorOptions &O = G.opts();
  int64_t E = O.hidden, S = O.seq;
  int64_t F = O.ffn ? O.ffn : 4 * E;
  G.addInput("input_ids", kInt64, {kBatch, S});
  Mod T = Mod().child("transformer");
  std::string Wte = G.addWeight("transformer.wte.weight", {O.vocab, E});
  std::string X = G.addNode("Gather", T.child("wte").Scope, {Wte, "input_ids"});
  std::string Pos = positionIds(G, T.Scope);
  std::string Wpe = G.addWeight("transformer.wpe.weight", {S, E});
  std::string P = G.addNode("Gather", T.child("wpe").Scope, {Wpe, Pos});
  X = G.addNode("Add", T.Scope, {X, P});
  // GPT2Attention's `bias` buffer (true on and below the diagonal), one copy
  // shared by all blocks.
  std::vector<uint8_t> Causal(S * S, 0);
  for (int64_t I = 0; I < S; ++I)
    for (int64_t J = 0; J <= I; ++J)
      Causal[I * S + J] = 1;
  std::string Mask = G.addBoolBuffer("causal_mask", {1, 1, S, S}, Causal);
  for (int L = 0; L < O.layers; ++L) {
    Mod Block = T.child("h." + Twine(L));
    Mod Mlp = Block.child("mlp");
    std::string Hn = layerNorm(G, Block.child("ln_1"), X, E, 1e-5f);
    std::string A = gptAttention(G, Block.child("attn"), Hn, Mask, E, O.heads);
    X = G.addNode("Add", Block.Scope, {A, X});
    Hn = layerNorm(G, Block.child("ln_2"), X, E, 1e-5f);
    std::string M = conv1d(G, Mlp.child("c_fc"), Hn, E, F);
    M = geluNew(G, Mlp.child("act").Scope, M);
    M = conv1d(G, Mlp.child("c_proj"), M, F, E);
    X = G.addNode("Add", Block.Scope, {X, M});
  }
  X = layerNorm(G, T.child("ln_f"), X, E, 1e-5f);
  lmHead(G, X, Wte, E);
}

/// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
std::string rotary(GraphBuilder &G, StringRef Scope, const std::string &X, const std::string &Cos,
                   const std::string &Sin, int64_t Dim) {
  auto Slice = [&](int64_t Begin, int64_t End) {
    std::string Starts = G.constVector(Scope, {Begin});
    std::string Ends = G.constVector(Scope, {End});
    std::string Axes = G.constVector(Scope, {3});
    std::string Steps = G.constVector(Scope, {1});
    return G.addNode("Slice", Scope, {X, Starts, Ends, Axes, Steps});
  };
  std::string X1 = Slice(0, Dim / 2);
  std::string X2 = Slice(Dim / 2, std::numeric_limits<int64_t>::max());
  std::string Neg = G.addNode("Neg", Scope, {X2});
  std::string Rot = G.addNode("Concat", Scope, {Neg, X1}, {attrInt("axis", -1)});
  std::string A = G.addNode("Mul", Scope, {X, Cos});
  std::string B = G.addNode("Mul", Scope, {Rot, Sin});
  return G.addNode("Add", Scope, {A, B});
}

/// repeat_kv: [B, KV, S, D] -> [B, KV * Rep, S, D].
std::string repeatKv(GraphBuilder &G, StringRef Scope, const std::string &X, int64_t KvHeads,
                     int64_t Rep, int64_t Dim) {
  std::string Axes = G.constVector(Scope, {2});
  std::string U = G.addNode("Unsqueeze", Scope, {X, Axes});
  std::string Reps = G.constVector(Scope, {1, 1, Rep, 1, 1});
  std::string Ex = G.addNode("Expand", Scope, {U, Reps});
  std::string Shape = G.batchShape(Scope, Ex, {KvHeads * Rep, G.opts().seq, Dim});
  return G.addNode("Reshape", Scope, {Ex, Shape});
}

/// Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.
void buildLlama(GraphBuilder &G) {
  const GeneratorOptions &O = G.opts();
  int64_t E = O.hidden, H = O.heads, KV = O.kvHeads ? O.kvHeads : H;
  int64_t D = E / H, S = O.seq;
  int64_t F = O.ffn ? O.ffn : alignTo(8 * E / 3, 8);
  G.addInput("input_ids", kInt64, {kBatch, S});
  Mod M = Mod().child("model");
  std::string Emb = G.addWeight("model.embed_tokens.weight", {O.vocab, E});
  std::string X = G.addNode("Gather", M.child("embed_tokens").Scope, {Emb, "input_ids"});
  // cos/sin of position * 10000^(-2i/D), both halves repeated as HF does.
  std::vector<float> Cos(S * D), Sin(S * D);
  for (int64_t P = 0; P < S; ++P)
    for (int64_t I = 0; I < D; ++I) {
      double Freq = std::pow(10000.0, -double(2 * (I % (D / 2))) / D);
      Cos[P * D + I] = std::cos(P * Freq);
      Sin[P * D + I] = std::sin(P * Freq);
    }
  std::string CosT = G.addBuffer("model.rotary_emb.cos_cached", {S, D}, Cos);
  std::string SinT = G.addBuffer("model.rotary_emb.sin_cached", {S, D}, Sin);
  std::string Mask = G.causalMask();
  for (int L = 0; L < O.layers; ++L) {
    Mod Layer = M.child("layers." + Twine(L));
    Mod Attn = Layer.child("self_attn"), Mlp = Layer.child("mlp");
    const std::string &AS = Attn.Scope;
    std::string Hn = rmsNorm(G, Layer.child("input_layernorm"), X, E, 1e-6f);
    std::string Q = linear(G, Attn.child("q_proj"), Hn, E, H * D, false);
    std::string K = linear(G, Attn.child("k_proj"), Hn, E, KV * D, false);
    std::string V = linear(G, Attn.child("v_proj"), Hn, E, KV * D, false);
    Q = splitHeads(G, AS, Q, H, D, {0, 2, 1, 3});
    K = splitHeads(G, AS, K, KV, D, {0, 2, 1, 3});
    V = splitHeads(G, AS, V, KV, D, {0, 2, 1, 3});
    Q = rotary(G, AS, Q, CosT, SinT, D);
    K = rotary(G, AS, K, CosT, SinT, D);
    if (KV != H) {
      K = repeatKv(G, AS, K, KV, H / KV, D);
      V = repeatKv(G, AS, V, KV, H / KV, D);
    }
    std::string KT = G.addNode("Transpose", AS, {K}, {attrInts("perm", {0, 1, 3, 2})});
    std::string A = attention(G, AS, Q, KT, V, Mask, H, D);
    A = linear(G, Attn.child("o_proj"), A, H * D, E, false);
    X = G.addNode("Add", Layer.Scope, {X, A});
    Hn = rmsNorm(G, Layer.child("post_attention_layernorm"), X, E, 1e-6f);
    std::string Gate = linear(G, Mlp.child("gate_proj"), Hn, E, F, false);
    std::string ActScope = Mlp.child("act_fn").Scope;
    std::string Sig = G.addNode("Sigmoid", ActScope, {Gate});
    std::string Act = G.addNode("Mul", ActScope, {Gate, Sig});
    std::string Up = linear(G, Mlp.child("up_proj"), Hn, E, F, false);
    std::string Prod = G.addNode("Mul", Mlp.Scope, {Act, Up});
    std::string Down = linear(G, Mlp.child("down_proj"), Prod, F, E, false);
    X = G.addNode("Add", Layer.Scope, {X, Down});
  }
  X = rmsNorm(G, M.child("norm"), X, E, 1e-6f);
  lmHead(G, X, Emb, E);
}

/// BERT encoder with pooler and a 2-class sequence classifier.
void buildBert(GraphBuilder &G) {
  const GeneratorOptions &O = G.opts();
  int64_t E = O.hidden, H = O.heads, D = E / H, S = O.seq;
  int64_t F = O.ffn ? O.ffn : 4 * E;
  G.addInput("input_ids", kInt64, {kBatch, S});
  G.addInput("attention_mask", kInt64, {kBatch, S});
  Mod Bert = Mod().child("bert"), Emb = Bert.child("embeddings");

  Mod Word = Emb.child("word_embeddings");
  std::string X = G.addNode("Gather", Word.Scope,
                            {G.addWeight(Word.param("weight"), {O.vocab, E}), "input_ids"});
  Mod TokType = Emb.child("token_type_embeddings");
  std::string TokIds = G.constInts(Emb.Scope, {1, S}, std::vector<int64_t>(S, 0));
  std::string TokW = G.addWeight(TokType.param("weight"), {2, E});
  X = G.addNode("Add", Emb.Scope, {X, G.addNode("Gather", TokType.Scope, {TokW, TokIds})});
  Mod PosEmb = Emb.child("position_embeddings");
  std::string PosIds = positionIds(G, Emb.Scope);
  std::string PosW = G.addWeight(PosEmb.param("weight"), {S, E});
  X = G.addNode("Add", Emb.Scope, {X, G.addNode("Gather", PosEmb.Scope, {PosW, PosIds})});
  X = layerNorm(G, Emb.child("LayerNorm"), X, E, 1e-12f);

  // Extended mask (1 - mask[:, None, None, :]) * float_min: [B, 1, 1, S].
  std::string Axes = G.constVector(Bert.Scope, {1, 2});
  std::string Mask = G.addNode("Unsqueeze", Bert.Scope, {"attention_mask", Axes});
  Mask = G.addNode("Cast", Bert.Scope, {Mask}, {attrInt("to", kFloat)});
  std::string One = G.constFloat(Bert.Scope, 1.0f);
  Mask = G.addNode("Sub", Bert.Scope, {One, Mask});
  std::string Min = G.constFloat(Bert.Scope, std::numeric_limits<float>::lowest());
  Mask = G.addNode("Mul", Bert.Scope, {Mask, Min});

  Mod Encoder = Bert.child("encoder");
  for (int L = 0; L < O.layers; ++L) {
    Mod Layer = Encoder.child("layer." + Twine(L));
    Mod Self = Layer.child("attention").child("self");
    Mod AttnOut = Layer.child("attention").child("output");
    Mod Inter = Layer.child("intermediate"), Out = Layer.child("output");
    std::string Q = linear(G, Self.child("query"), X, E, E, true);
    std::string K = linear(G, Self.child("key"), X, E, E, true);
    std::string V = linear(G, Self.child("value"), X, E, E, true);
    Q = splitHeads(G, Self.Scope, Q, H, D, {0, 2, 1, 3});
    std::string KT = splitHeads(G, Self.Scope, K, H, D, {0, 2, 3, 1});
    V = splitHeads(G, Self.Scope, V, H, D, {0, 2, 1, 3});
    std::string A = attention(G, Self.Scope, Q, KT, V, Mask, H, D);
    A = linear(G, AttnOut.child("dense"), A, E, E, true);
    A = G.addNode("Add", AttnOut.Scope, {A, X});
    A = layerNorm(G, AttnOut.child("LayerNorm"), A, E, 1e-12f);
    std::string I = linear(G, Inter.child("dense"), A, E, F, true);
    I = gelu(G, Inter.child("intermediate_act_fn").Scope, I);
    std::string R = linear(G, Out.child("dense"), I, F, E, true);
    R = G.addNode("Add", Out.Scope, {R, A});
    X = layerNorm(G, Out.child("LayerNorm"), R, E, 1e-12f);
  }

  Mod Pooler = Bert.child("pooler");
  std::string Zero = G.constInts(Pooler.Scope, {}, {0});
  std::string First = G.addNode("Gather", Pooler.Scope, {X, Zero}, {attrInt("axis", 1)});
  std::string P = linear(G, Pooler.child("dense"), First, E, E, true);
  P = G.addNode("Tanh", Pooler.child("activation").Scope, {P});
  linear(G, Mod().child("classifier"), P, E, 2, true, "logits");
  G.addOutput("logits", kFloat, {kBatch, 2});
  if (O.withLoss) {
    G.addInput("labels", kInt64, {kBatch});
    crossEntropy(G, "logits", "labels");
  }
}

/// input_proj, `layers` x (Gemm + Relu), head; MSE loss.
void buildMlp(GraphBuilder &G) {
  const GeneratorOptions &O = G.opts();
  int64_t In = O.vocab, E = O.hidden;
  G.addInput("x", kFloat, {kBatch, In});
  Mod Root;
  std::string X = gemm(G, Root.child("input_proj"), "x", In, E);
  for (int L = 0; L < O.layers; ++L) {
    Mod Layer = Root.child("layers." + Twine(L));
    X = gemm(G, Layer.child("linear"), X, E, E);
    X = G.addNode("Relu", Layer.child("act").Scope, {X});
  }
  gemm(G, Root.child("head"), X, E, In, "y");
  G.addOutput("y", kFloat, {kBatch, In});
  if (!O.withLoss)
    return;
  G.addInput("labels", kFloat, {kBatch, In});
  std::string Diff = G.addNode("Sub", "/loss_fn", {"y", "labels"});
  std::string Sq = G.addNode("Mul", "/loss_fn", {Diff, Diff});
  G.addNode("ReduceMean", "/loss_fn", {Sq}, {attrInt("keepdims", 0)}, "loss");
  G.addOutput("loss", kFloat, {});
}

/// Bias-free square Conv with weight [Out, In, K, K].
std::string conv(GraphBuilder &G, const Mod &M, const std::string &X, int64_t In, int64_t Out,
                 int64_t K, int64_t Stride, int64_t Pad) {
  std::string W = G.addWeight(M.param("weight"), {Out, In, K, K});
  return G.addNode("Conv", M.Scope, {X, W},
                   {attrInts("dilations", {1, 1}), attrInt("group", 1),
                    attrInts("kernel_shape", {K, K}), attrInts("pads", {Pad, Pad, Pad, Pad}),
                    attrInts("strides", {Stride, Stride})});
}

/// Eval-mode BatchNorm2d.
std::string batchNorm(GraphBuilder &G, const Mod &M, const std::string &X, int64_t Channels) {
  std::string Scale = G.addWeight(M.param("weight"), {Channels}, Init::One);
  std::string Bias = G.addWeight(M.param("bias"), {Channels});
  std::string Mean = G.addWeight(M.param("running_mean"), {Channels});
  std::string Var = G.addWeight(M.param("running_var"), {Channels}, Init::One);
  return G.addNode("BatchNormalization", M.Scope, {X, Scale, Bias, Mean, Var},
                   {attrFloat("epsilon", 1e-5f), attrFloat("momentum", 0.9f)});
}

/// torchvision ResNet v1.5 with bottleneck blocks.
void buildResnet(GraphBuilder &G) {
  const GeneratorOptions &O = G.opts();
  int64_t C = O.hidden, S = O.seq;
  G.addInput("images", kFloat, {kBatch, 3, S, S});
  Mod Root;
  std::string X = conv(G, Root.child("conv1"), "images", 3, C, 7, 2, 3);
  X = batchNorm(G, Root.child("bn1"), X, C);
  X = G.addNode("Relu", "/relu", {X});
  X = G.addNode("MaxPool", "/maxpool", {X},
                {attrInt("ceil_mode", 0), attrInts("kernel_shape", {3, 3}),
                 attrInts("pads", {1, 1, 1, 1}), attrInts("strides", {2, 2})});
  int Blocks[4] = {3, 4, 6, 3};
  if (O.layers != 16)
    for (int Stage = 0; Stage < 4; ++Stage)
      Blocks[Stage] = O.layers / 4 + (Stage < O.layers % 4 ? 1 : 0);
  int64_t In = C;
  for (int Stage = 0; Stage < 4; ++Stage) {
    int64_t Planes = C << Stage, Out = Planes * 4;
    std::string Layer = "layer" + std::to_string(Stage + 1);
    for (int B = 0; B < Blocks[Stage]; ++B) {
      std::string Name = Layer + "." + std::to_string(B);
      Mod Block{"/" + Layer + "/" + Name, Name};
      int64_t Stride = (B == 0 && Stage > 0) ? 2 : 1;
      std::string Y = conv(G, Block.child("conv1"), X, In, Planes, 1, 1, 0);
      Y = batchNorm(G, Block.child("bn1"), Y, Planes);
      Y = G.addNode("Relu", Block.child("relu").Scope, {Y});
      Y = conv(G, Block.child("conv2"), Y, Planes, Planes, 3, Stride, 1);
      Y = batchNorm(G, Block.child("bn2"), Y, Planes);
      Y = G.addNode("Relu", Block.child("relu_1").Scope, {Y});
      Y = conv(G, Block.child("conv3"), Y, Planes, Out, 1, 1, 0);
      Y = batchNorm(G, Block.child("bn3"), Y, Out);
      std::string Identity = X;
      if (B == 0) {
        Mod Ds = Block.child("downsample");
        Mod DsConv{Ds.Scope + "/downsample.0", Ds.Param + ".0"};
        Mod DsNorm{Ds.Scope + "/downsample.1", Ds.Param + ".1"};
        Identity = conv(G, DsConv, X, In, Out, 1, Stride, 0);
        Identity = batchNorm(G, DsNorm, Identity, Out);
      }
      X = G.addNode("Add", Block.Scope, {Y, Identity});
      X = G.addNode("Relu", Block.child("relu_2").Scope, {X});
      In = Out;
    }
  }
  X = G.addNode("GlobalAveragePool", "/avgpool", {X});
  X = G.addNode("Flatten", "", {X}, {attrInt("axis", 1)});
  gemm(G, Root.child("fc"), X, In, O.vocab, "logits");
  G.addOutput("logits", kFloat, {kBatch, O.vocab});
  if (O.withLoss) {
    G.addInput("labels", kInt64, {kBatch});
    crossEntropy(G, "logits", "labels");
  }
}

Error validate(const GeneratorOptions &O) {
  if (O.opset < 13 || O.opset > 17)
    return makeError("unsupported opset " + Twine(O.opset) + " (supported: 13..17)");
  if (O.layers < 1 || O.hidden < 1 || O.heads < 1 || O.vocab < 1 || O.seq < 1)
    return makeError("layers, hidden, heads, vocab and seq must be positive");
  if (O.batch < 0 || O.ffn < 0 || O.kvHeads < 0)
    return makeError("batch, ffn and kvHeads must not be negative");
  bool Transformer =
      O.family == Family::Gpt || O.family == Family::Llama || O.family == Family::Bert;
  if (Transformer && O.hidden % O.heads != 0)
    return makeError("hidden (" + Twine(O.hidden) + ") must be divisible by heads (" +
                     Twine(O.heads) + ")");
  if (O.family == Family::Llama) {
    int KV = O.kvHeads ? O.kvHeads : O.heads;
    if (O.heads % KV != 0)
      return makeError("heads (" + Twine(O.heads) + ") must be divisible by kvHeads (" + Twine(KV) +
                       ")");
    if ((O.hidden / O.heads) % 2 != 0)
      return makeError("llama head dimension (" + Twine(O.hidden / O.heads) +
                       ") must be even for rotary embeddings");
  }
  return Error::success();
}

/// Copies \p From into \p To except the graph's initializers.
void copyAllButInitializers(const onnx::ModelProto &From, onnx::ModelProto &To) {
  To.set_ir_version(From.ir_version());
  *To.mutable_opset_import() = From.opset_import();
  To.set_producer_name(From.producer_name());
  To.set_producer_version(From.producer_version());
  To.set_domain(From.domain());
  To.set_model_version(From.model_version());
  To.set_doc_string(From.doc_string());
  *To.mutable_metadata_props() = From.metadata_props();
  *To.mutable_training_info() = From.training_info();
  *To.mutable_functions() = From.functions();
  const onnx::GraphProto &FG = From.graph();
  onnx::GraphProto &TG = *To.mutable_graph();
  *TG.mutable_node() = FG.node();
  TG.set_name(FG.name());
  *TG.mutable_sparse_initializer() = FG.sparse_initializer();
  TG.set_doc_string(FG.doc_string());
  *TG.mutable_input() = FG.input();
  *TG.mutable_output() = FG.output();
  *TG.mutable_value_info() = FG.value_info();
  *TG.mutable_quantization_annotation() = FG.quantization_annotation();
}

std::string errnoText() { return std::strerror(errno); }

/// Serializes \p Model to \p Path through a buffered file stream.
Error writeProto(const onnx::ModelProto &Model, StringRef Path) {
  size_t Size = Model.ByteSizeLong();
  if (Size > size_t(INT_MAX))
    return makeError("cannot write '" + Path + "': the model would take " + Twine(Size) +
                     " bytes, over protobuf's 2 GiB limit; use external data");
  std::ofstream OS(Path.str(), std::ios::binary | std::ios::trunc);
  if (!OS)
    return makeError("cannot open '" + Path + "' for writing: " + errnoText());
  bool Ok;
  {
    google::protobuf::io::OstreamOutputStream ZeroCopy(&OS, 1 << 20);
    google::protobuf::io::CodedOutputStream Coded(&ZeroCopy);
    Coded.SetSerializationDeterministic(true);
    Model.SerializeWithCachedSizes(&Coded);
    Ok = !Coded.HadError();
  }
  OS.close();
  if (!Ok || !OS)
    return makeError("failed writing '" + Path + "': " + errnoText());
  return Error::success();
}

} // namespace

Expected<Family> parseFamily(StringRef Name) {
  static const std::pair<StringRef, Family> Names[] = {{"gpt", Family::Gpt},
                                                       {"llama", Family::Llama},
                                                       {"bert", Family::Bert},
                                                       {"mlp", Family::Mlp},
                                                       {"resnet", Family::Resnet}};
  for (const auto &[Text, F] : Names)
    if (Name.equals_insensitive(Text))
      return F;
  return makeError("unknown model family '" + Name +
                   "' (expected gpt, llama, bert, mlp or resnet)");
}

StringRef familyName(Family F) {
  switch (F) {
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

Expected<onnx::ModelProto> generateModel(const GeneratorOptions &Opts) {
  if (Error E = validate(Opts))
    return E;
  try {
    onnx::ModelProto Model;
    Model.set_ir_version(8);
    Model.set_producer_name("pipec");
    Model.set_producer_version("0.1");
    onnx::OperatorSetIdProto *Opset = Model.add_opset_import();
    Opset->set_domain("");
    Opset->set_version(Opts.opset);
    onnx::GraphProto *Graph = Model.mutable_graph();
    Graph->set_name("main_graph");
    GraphBuilder G(*Graph, Opts);
    switch (Opts.family) {
    case Family::Gpt:
      buildGpt(G);
      break;
    case Family::Llama:
      buildLlama(G);
      break;
    case Family::Bert:
      buildBert(G);
      break;
    case Family::Mlp:
      buildMlp(G);
      break;
    case Family::Resnet:
      buildResnet(G);
      break;
    }
    return Model;
  } catch (const std::exception &E) {
    return makeError(Twine("model generation failed: ") + E.what());
  }
}

Error writeModel(const onnx::ModelProto &Model, StringRef Path, bool ExternalData,
                 uint64_t ExternalThreshold) {
  try {
    if (!ExternalData)
      return writeProto(Model, Path);

    std::string DataPath = (Path + ".data").str();
    std::string Location = sys::path::filename(DataPath).str();
    std::ofstream Data(DataPath, std::ios::binary | std::ios::trunc);
    if (!Data)
      return makeError("cannot open '" + DataPath + "' for writing: " + errnoText());

    onnx::ModelProto Out;
    copyAllButInitializers(Model, Out);
    uint64_t Offset = 0;
    static const char Zeros[64] = {};
    for (const onnx::TensorProto &Init : Model.graph().initializer()) {
      onnx::TensorProto *T = Out.mutable_graph()->add_initializer();
      if (Init.data_location() == onnx::TensorProto::EXTERNAL ||
          Init.raw_data().size() < ExternalThreshold) {
        *T = Init;
        continue;
      }
      T->set_name(Init.name());
      T->set_data_type(Init.data_type());
      *T->mutable_dims() = Init.dims();
      if (Init.has_doc_string())
        T->set_doc_string(Init.doc_string());
      uint64_t Aligned = alignTo(Offset, 64);
      Data.write(Zeros, Aligned - Offset);
      const std::string &Raw = Init.raw_data();
      Data.write(Raw.data(), Raw.size());
      T->set_data_location(onnx::TensorProto::EXTERNAL);
      auto AddEntry = [&](StringRef Key, const std::string &Value) {
        onnx::StringStringEntryProto *E = T->add_external_data();
        E->set_key(Key.str());
        E->set_value(Value);
      };
      AddEntry("location", Location);
      AddEntry("offset", std::to_string(Aligned));
      AddEntry("length", std::to_string(Raw.size()));
      Offset = Aligned + Raw.size();
    }
    Data.close();
    if (!Data)
      return makeError("failed writing '" + DataPath + "': " + errnoText());
    return writeProto(Out, Path);
  } catch (const std::exception &E) {
    return makeError("cannot write '" + Path + "': " + E.what());
  }
}

} // namespace pipec::models
