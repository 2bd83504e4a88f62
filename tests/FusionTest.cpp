//===- FusionTest.cpp - Fused element-wise nodes and the fusion pass -----===//
//
// The fused kernel against its body run node by node (the CPU kernels), on
// broadcast shapes, for every op it fuses; the fallback for integer inputs
// and for an output smaller than the others; bodies it refuses; and the
// pass: what it groups, which values stay visible, and what it must not
// move past a reader. The executor-level check (a fused run equals an
// unfused one) is in ExecutorTest.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include "ops/OpRegistry.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Fusion.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>

using namespace pipec;
using cpu::Tensor;
using pipec::DType;

namespace {

constexpr int64_t testOpset = 17;

void setString(onnx::NodeProto &n, const std::string &name, const std::string &value) {
  onnx::AttributeProto *a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::STRING);
  a->set_s(value);
}

void setFloat(onnx::NodeProto &n, const std::string &name, float value) {
  onnx::AttributeProto *a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(value);
}

Tensor randomTensor(std::vector<int64_t> shape, uint32_t seed, float lo = -2, float hi = 2) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Tensor t(DType::F32, std::move(shape));
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<float>()[i] = dist(rng);
  return t;
}

std::vector<Tensor> unfused(const onnx::NodeProto &fused, const std::vector<const Tensor *> &in) {
  auto outs = runFusedBody(fused, in, [](const onnx::NodeProto &n, auto args) {
    return cpu::runOp(n, testOpset, args);
  });
  EXPECT_TRUE(static_cast<bool>(outs)) << (outs ? "" : llvm::toString(outs.takeError()));
  return outs ? std::move(*outs) : std::vector<Tensor>{};
}

std::vector<Tensor> fused(const onnx::NodeProto &node, const std::vector<const Tensor *> &in) {
  auto outs = cpu::runOp(node, testOpset, in);
  EXPECT_TRUE(static_cast<bool>(outs)) << (outs ? "" : llvm::toString(outs.takeError()));
  return outs ? std::move(*outs) : std::vector<Tensor>{};
}

/// Whether the fused kernel itself (not its body, the fallback) takes
/// \p in: else a comparison with the body compares the body with itself.
bool kernelTakes(const onnx::NodeProto &node, const std::vector<const Tensor *> &in) {
  auto kernel = compileFused(node, testOpset);
  EXPECT_TRUE(static_cast<bool>(kernel)) << (kernel ? "" : llvm::toString(kernel.takeError()));
  return kernel && fusedShape(*kernel, in).has_value();
}

/// Largest |a - b| over all outputs; the shapes must match.
double worstDifference(const std::vector<Tensor> &a, const std::vector<Tensor> &b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t o = 0; o < a.size() && o < b.size(); ++o) {
    EXPECT_EQ(a[o].shape(), b[o].shape()) << "output " << o;
    if (a[o].shape() != b[o].shape())
      return INFINITY;
    for (int64_t i = 0; i < a[o].numElements(); ++i)
      worst = std::max(worst, std::abs(a[o].getDouble(i) - b[o].getDouble(i)));
  }
  return worst;
}

/// A GELU (tanh form, as GPT-2 exports it) on x + bias, its backward
/// factors, and a Sum: 13 steps over a [3, 37, 24] x, a [24] bias and
/// scalar constants.
struct GeluCase {
  Tensor x = randomTensor({3, 37, 24}, 1), bias = randomTensor({24}, 2),
         dy = randomTensor({3, 37, 24}, 4);
  Tensor half = Tensor::scalar(0.5f), c = Tensor::scalar(0.044715f),
         root = Tensor::scalar(0.7978845608f), one = Tensor::scalar(1.0f),
         three = Tensor::scalar(3.0f);
  onnx::NodeProto fusedNode;
  std::vector<const Tensor *> inputs;

  GeluCase() {
    std::vector<onnx::NodeProto> body = {
        test::makeNode("Add", {"x", "bias"}, "h"),  test::makeNode("Mul", {"half", "h"}, "a"),
        test::makeNode("Pow", {"h", "three"}, "p"), test::makeNode("Mul", {"c", "p"}, "b"),
        test::makeNode("Add", {"h", "b"}, "s"),     test::makeNode("Mul", {"root", "s"}, "u"),
        test::makeNode("Tanh", {"u"}, "t"),         test::makeNode("Add", {"one", "t"}, "e"),
        test::makeNode("Mul", {"a", "e"}, "y"),     test::unaryGrad("Tanh", "dy", "t", "g"),
        test::makeNode("Div", {"g", "three"}, "q"), test::makeNode("Sum", {"y", "q", "h"}, "z"),
    };
    std::vector<const onnx::NodeProto *> pointers;
    for (const onnx::NodeProto &n : body)
      pointers.push_back(&n);
    fusedNode =
        makeFusedNode("gelu", pointers, {"x", "bias", "half", "three", "c", "root", "one", "dy"},
                      {"y", "t", "z"});
    inputs = {&x, &bias, &half, &three, &c, &root, &one, &dy};
  }
};

TEST(FusedKernel, MatchesItsBodyOnBroadcasts) {
  GeluCase g;
  auto kernel = compileFused(g.fusedNode, testOpset);
  ASSERT_TRUE(static_cast<bool>(kernel)) << llvm::toString(kernel.takeError());
  EXPECT_EQ(kernel->program.ops, 13); // 12 nodes, the Sum of three taking two
  auto shape = fusedShape(*kernel, g.inputs);
  ASSERT_TRUE(shape.has_value());
  EXPECT_EQ(*shape, (std::vector<int64_t>{3, 37, 24}));
  std::vector<Tensor> a = fused(g.fusedNode, g.inputs), b = unfused(g.fusedNode, g.inputs);
  ASSERT_EQ(a.size(), 3u);
  // Each op computed as its own kernel computes it: the same bits.
  EXPECT_EQ(worstDifference(a, b), 0.0);
}

TEST(FusedKernel, GeluInOneLoopMatchesItsSteps) {
  // The eight nodes of GPT-2's GELU, read whole, run as one loop; written
  // either way round, and with constants other than GPT-2's, the same bits
  // as node by node. Wide values, so that tanh's both forms and its
  // saturation are taken.
  Tensor x = randomTensor({6, 700}, 41, -12.0f, 12.0f);
  Tensor half = Tensor::scalar(0.5f), c = Tensor::scalar(0.044715f),
         root = Tensor::scalar(0.7978845608f), one = Tensor::scalar(1.0f),
         three = Tensor::scalar(3.0f), two = Tensor::scalar(2.0f);
  auto gelu = [&](bool swapped, const std::string &exponent) {
    auto node = [&](const char *op, std::string a, std::string b, const char *out) {
      return swapped ? test::makeNode(op, {b, a}, out) : test::makeNode(op, {a, b}, out);
    };
    return std::vector<onnx::NodeProto>{
        node("Mul", "x", "half", "a"), test::makeNode("Pow", {"x", exponent}, "p"),
        node("Mul", "p", "c", "b"),    node("Add", "x", "b", "s"),
        node("Mul", "s", "root", "u"), test::makeNode("Tanh", {"u"}, "t"),
        node("Add", "t", "one", "e"),  node("Mul", "a", "e", "y")};
  };
  for (bool swapped : {false, true})
    for (const char *exponent : {"three", "two"}) {
      std::vector<onnx::NodeProto> body = gelu(swapped, exponent);
      std::vector<const onnx::NodeProto *> pointers;
      for (const onnx::NodeProto &n : body)
        pointers.push_back(&n);
      onnx::NodeProto f =
          makeFusedNode("gelu", pointers, {"x", "half", exponent, "c", "root", "one"}, {"y"});
      std::vector<const Tensor *> in = {&x, &half, exponent == std::string("three") ? &three : &two,
                                        &c, &root, &one};
      ASSERT_TRUE(kernelTakes(f, in));
      std::vector<Tensor> a = fused(f, in), b = unfused(f, in);
      EXPECT_EQ(worstDifference(a, b), 0.0) << "swapped " << swapped << ", " << exponent;
      // And it is a GELU: 0.5 x (1 + tanh(...)) to float precision.
      if (exponent == std::string("three"))
        for (int64_t i = 0; i < x.numElements(); i += 97) {
          double v = x.getDouble(i);
          double want = 0.5 * v * (1 + std::tanh(0.7978845608 * (v + 0.044715 * v * v * v)));
          EXPECT_NEAR(a[0].getDouble(i), want, 1e-5 * std::max(1.0, std::abs(want)));
        }
    }
}

TEST(FusedKernel, BroadcastsAlongEveryAxisMatch) {
  // Inputs broadcast along the middle, the outer and the inner axes; 1000
  // elements, so that blocks start inside rows.
  Tensor x = randomTensor({4, 10, 25}, 31), column = randomTensor({10, 1}, 32),
         plane = randomTensor({4, 1, 25}, 33), row = randomTensor({1, 10, 25}, 34);
  onnx::NodeProto add = test::makeNode("Add", {"x", "column"}, "s"),
                  mul = test::makeNode("Mul", {"s", "plane"}, "m"),
                  sub = test::makeNode("Sub", {"row", "m"}, "y");
  onnx::NodeProto f =
      makeFusedNode("axes", {&add, &mul, &sub}, {"x", "column", "plane", "row"}, {"y"});
  std::vector<const Tensor *> in = {&x, &column, &plane, &row};
  ASSERT_TRUE(kernelTakes(f, in));
  EXPECT_EQ(worstDifference(fused(f, in), unfused(f, in)), 0.0);
  // The same with x broadcast too: the output is [4, 10, 25] from the others.
  Tensor small = randomTensor({25}, 35);
  onnx::NodeProto add2 = test::makeNode("Add", {"small", "column"}, "s");
  onnx::NodeProto f2 =
      makeFusedNode("axes2", {&add2, &mul, &sub}, {"small", "column", "plane", "row"}, {"y"});
  std::vector<const Tensor *> in2 = {&small, &column, &plane, &row};
  ASSERT_TRUE(kernelTakes(f2, in2));
  EXPECT_EQ(worstDifference(fused(f2, in2), unfused(f2, in2)), 0.0);
}

/// Every unary float op of the registry, and its gradient (UnaryGrad),
/// fused and not: the same bits. Non-default attributes where an op has
/// them.
TEST(FusedKernel, EveryUnaryAndPointwiseOpMatches) {
  Tensor x = randomTensor({5, 130}, 11, 0.1f, 0.9f), dy = randomTensor({5, 130}, 12);
  int checked = 0;
  for (const OpDef &def : allOps()) {
    if (!def.elem || def.minInputs != 1 || !kernels::isFloatMath(*def.elem))
      continue;
    for (bool grad : {false, true}) {
      if (grad && kernels::elemGradFrom(*def.elem) == kernels::GradFrom::None)
        continue;
      onnx::NodeProto step = grad ? test::makeNode("UnaryGrad", {"dy", "x"}, "y", "pipec")
                                  : test::makeNode(def.name.str(), {"x"}, "y");
      if (grad)
        setString(step, "op", def.name.str());
      if (def.id == OpId::Gelu)
        setString(step, "approximate", "tanh");
      if (def.id == OpId::LeakyRelu || def.id == OpId::Elu)
        setFloat(step, "alpha", 0.2f);
      ASSERT_TRUE(isFusable(step, testOpset)) << def.name.str() << (grad ? " gradient" : "");
      // y, then y * x so that the node has two steps.
      onnx::NodeProto then = test::makeNode("Mul", {"y", "x"}, "z");
      onnx::NodeProto f = makeFusedNode(
          "f", {&step, &then},
          grad ? std::vector<std::string>{"dy", "x"} : std::vector<std::string>{"x"}, {"z"});
      std::vector<const Tensor *> in =
          grad ? std::vector<const Tensor *>{&dy, &x} : std::vector<const Tensor *>{&x};
      ASSERT_TRUE(kernelTakes(f, in)) << def.name.str();
      EXPECT_EQ(worstDifference(fused(f, in), unfused(f, in)), 0.0)
          << def.name.str() << (grad ? " gradient" : "");
      ++checked;
    }
  }
  EXPECT_GE(checked, 60);
}

TEST(FusedKernel, IntegerInputsRunTheBodyNodeByNode) {
  Tensor a = Tensor::fromValues<int64_t>({2, 2}, {1, 2, 3, 4});
  Tensor b = Tensor::fromValues<int64_t>({2}, {10, 20});
  onnx::NodeProto add = test::makeNode("Add", {"a", "b"}, "s"),
                  mul = test::makeNode("Mul", {"s", "a"}, "m");
  onnx::NodeProto f = makeFusedNode("ints", {&add, &mul}, {"a", "b"}, {"m"});
  auto kernel = compileFused(f, testOpset);
  ASSERT_TRUE(static_cast<bool>(kernel));
  EXPECT_FALSE(fusedShape(*kernel, {&a, &b}).has_value());
  std::vector<Tensor> out = fused(f, {&a, &b});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].elemType(), DType::I64);
  EXPECT_EQ(out[0].toInt64Vector(), (std::vector<int64_t>{11, 44, 39, 96}));
}

TEST(FusedKernel, AnOutputSmallerThanTheOthersRunsTheBody) {
  // t = Tanh(bias) is [4]; y = x * t is [3, 4]: t cannot be written at
  // y's shape, so the body runs node by node and t keeps its shape.
  Tensor x = randomTensor({3, 4}, 5), bias = randomTensor({4}, 6);
  onnx::NodeProto tanh = test::makeNode("Tanh", {"bias"}, "t"),
                  mul = test::makeNode("Mul", {"x", "t"}, "y");
  onnx::NodeProto f = makeFusedNode("small", {&tanh, &mul}, {"x", "bias"}, {"t", "y"});
  auto kernel = compileFused(f, testOpset);
  ASSERT_TRUE(static_cast<bool>(kernel));
  EXPECT_FALSE(fusedShape(*kernel, {&x, &bias}).has_value());
  std::vector<Tensor> out = fused(f, {&x, &bias});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{4}));
  EXPECT_EQ(out[1].shape(), (std::vector<int64_t>{3, 4}));
  EXPECT_FLOAT_EQ(out[1].data<float>()[5], x.data<float>()[5] * std::tanh(bias.data<float>()[1]));
}

TEST(FusedKernel, BadBodiesAreRefusedByName) {
  onnx::NodeProto tanh = test::makeNode("Tanh", {"missing"}, "t");
  onnx::NodeProto f = makeFusedNode("bad", {&tanh}, {"x"}, {"t"});
  auto kernel = compileFused(f, testOpset);
  ASSERT_FALSE(static_cast<bool>(kernel));
  std::string why = llvm::toString(kernel.takeError());
  EXPECT_NE(why.find("'missing'"), std::string::npos) << why;
  EXPECT_NE(why.find("bad"), std::string::npos) << why;

  onnx::NodeProto matmul = test::makeNode("MatMul", {"x", "x"}, "m");
  f = makeFusedNode("notfusable", {&matmul}, {"x"}, {"m"});
  kernel = compileFused(f, testOpset);
  ASSERT_FALSE(static_cast<bool>(kernel));
  why = llvm::toString(kernel.takeError());
  EXPECT_NE(why.find("MatMul"), std::string::npos) << why;

  onnx::NodeProto add = test::makeNode("Add", {"x", "x"}, "s");
  f = makeFusedNode("noout", {&add}, {"x"}, {"nowhere"});
  kernel = compileFused(f, testOpset);
  ASSERT_FALSE(static_cast<bool>(kernel));
  EXPECT_NE(llvm::toString(kernel.takeError()).find("'nowhere'"), std::string::npos);
}

TEST(MatMulBias, AddsTheBiasInPlaceWithTheAddsBits) {
  Tensor a = randomTensor({2, 5, 7}, 21), b = randomTensor({7, 6}, 22),
         bias = randomTensor({6}, 23), rows = randomTensor({5, 6}, 24);
  onnx::NodeProto mm = test::makeNode("MatMul", {"a", "b"}, "m"),
                  add = test::makeNode("Add", {"bias", "m"}, "y");
  onnx::NodeProto f = makeFusedNode("linear", {&mm, &add}, {"a", "b", "bias"}, {"y"});
  f.set_op_type(MatMulBiasOpType.str());
  EXPECT_EQ(epilogueBias(f, {&a, &b, &bias}), 6);
  std::vector<Tensor> got = fused(f, {&a, &b, &bias});
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].shape(), (std::vector<int64_t>{2, 5, 6}));
  EXPECT_EQ(worstDifference(got, unfused(f, {&a, &b, &bias})), 0.0);
  // y = a b + addend, element by element; row r of a [2 x 5, 7] view.
  auto product = [&](int64_t r, int64_t j) {
    float dot = 0;
    for (int64_t kk = 0; kk < 7; ++kk)
      dot += a.data<float>()[r * 7 + kk] * b.data<float>()[kk * 6 + j];
    return dot;
  };
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t j = 0; j < 6; ++j)
      EXPECT_NEAR(got[0].data<float>()[r * 6 + j], product(r, j) + bias.data<float>()[j], 1e-5)
          << r << " " << j;
  // A [5, 6] addend is no epilogue: the two nodes run, broadcasting it over
  // the batch of 2.
  EXPECT_FALSE(epilogueBias(f, {&a, &b, &rows}).has_value());
  std::vector<Tensor> plain = fused(f, {&a, &b, &rows});
  ASSERT_EQ(plain.size(), 1u);
  ASSERT_EQ(plain[0].shape(), (std::vector<int64_t>{2, 5, 6}));
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t j = 0; j < 6; ++j)
      EXPECT_NEAR(plain[0].data<float>()[r * 6 + j],
                  product(r, j) + rows.data<float>()[(r % 5) * 6 + j], 1e-5)
          << r << " " << j;
}

/// \p t's element at \p index, as a double.
double at(const Tensor &t, std::initializer_list<int64_t> index) {
  int64_t flat = 0, d = 0;
  for (int64_t i : index)
    flat = flat * t.shape()[d++] + i;
  return double(t.data<float>()[flat]);
}

/// Expects \p out at \p row (its indices but the last, which runs over
/// \p width) to be attention computed in double: the softmax of
/// score(j) over \p positions, weighting value(j, e).
void expectAttention(const Tensor &out, std::vector<int64_t> row, int64_t positions, int64_t width,
                     const std::function<double(int64_t)> &score,
                     const std::function<double(int64_t, int64_t)> &value) {
  std::vector<double> p(positions);
  double sum = 0;
  for (int64_t j = 0; j < positions; ++j)
    sum += p[j] = std::exp(score(j));
  for (int64_t e = 0; e < width; ++e) {
    double want = 0;
    for (int64_t j = 0; j < positions; ++j)
      want += p[j] / sum * value(j, e);
    int64_t flat = 0, d = 0;
    for (int64_t i : row)
      flat = flat * out.shape()[d++] + i;
    EXPECT_NEAR(out.data<float>()[flat * width + e], want, 1e-5) << e;
  }
}

/// The SoftmaxAttention node that replaces \p body, reading \p inputs
/// (AttentionInput's order) and making "o".
onnx::NodeProto attentionOver(const std::vector<onnx::NodeProto> &body,
                              const std::vector<std::string> &inputs) {
  std::vector<const onnx::NodeProto *> pointers;
  for (const onnx::NodeProto &n : body)
    pointers.push_back(&n);
  onnx::NodeProto f = makeFusedNode("attn", pointers, inputs, {"o"});
  f.set_op_type(SoftmaxAttentionOpType.str());
  return f;
}

/// \p f's one output on \p in, of \p shape and equal bit for bit to its
/// body's, into \p out; a fatal failure otherwise.
void runFused(const onnx::NodeProto &f, const std::vector<const Tensor *> &in,
              const std::vector<int64_t> &shape, Tensor &out) {
  std::vector<Tensor> got = fused(f, in);
  ASSERT_EQ(got.size(), 1u);
  std::vector<int64_t> gotShape(got[0].shape().begin(), got[0].shape().end());
  ASSERT_EQ(gotShape, shape);
  EXPECT_EQ(worstDifference(got, unfused(f, in)), 0.0);
  out = std::move(got[0]);
}

/// torch's scaled_dot_product_attention written out, with its mask and
/// NaN guard: o = MatMul(Where(IsNaN(p), c, p), v), p = Softmax(q k + m).
std::vector<onnx::NodeProto> attentionNodes() {
  return {test::makeNode("MatMul", {"q", "k"}, "s"),     test::makeNode("Add", {"s", "m"}, "z"),
          test::makeNode("Softmax", {"z"}, "p"),         test::makeNode("IsNaN", {"p"}, "n"),
          test::makeNode("Where", {"n", "c", "p"}, "w"), test::makeNode("MatMul", {"w", "v"}, "o")};
}

TEST(SoftmaxAttention, MatchesItsBodyBitForBit) {
  Tensor q = randomTensor({2, 3, 5, 4}, 51), k = randomTensor({2, 3, 4, 7}, 52),
         v = randomTensor({2, 3, 7, 6}, 53), c = Tensor::scalar(0.0f);
  // A causal mask shared by the heads; batch 1's first query sees nothing
  // (a padded row): its softmax is NaN, which the guard makes 0.
  Tensor m = Tensor::uninitialized(DType::F32, {2, 1, 5, 7});
  const float minusInf = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t j = 0; j < 7; ++j)
        m.data<float>()[(b * 5 + i) * 7 + j] = (j > i + 2 || (b == 1 && i == 0)) ? minusInf : 0.0f;
  onnx::NodeProto f = attentionOver(attentionNodes(), {"q", "k", "v", "m", "c"});
  std::vector<const Tensor *> in = {&q, &k, &v, &m, &c};
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(runFused(f, in, {2, 3, 5, 6}, got));
  // Against attention computed in double: head (1, 2), query 3.
  expectAttention(
      got, {1, 2, 3}, 7, 6,
      [&](int64_t j) {
        double score = j > 5 ? -INFINITY : 0.0;
        for (int64_t kk = 0; kk < 4; ++kk)
          score += at(q, {1, 2, 3, kk}) * at(k, {1, 2, kk, j});
        return score;
      },
      [&](int64_t j, int64_t e) {
        return at(v, {1, 2, j, e});
      });
  // The padded query's output is all zeros.
  for (int64_t e = 0; e < 6; ++e)
    EXPECT_EQ(at(got, {1, 0, 0, e}), 0.0);
  // Without mask and guard: the three nodes.
  onnx::NodeProto s = test::makeNode("MatMul", {"q", "k"}, "s"),
                  sm = test::makeNode("Softmax", {"s"}, "p"),
                  o = test::makeNode("MatMul", {"p", "v"}, "o");
  onnx::NodeProto plain = makeFusedNode("attn", {&s, &sm, &o}, {"q", "k", "v", "", ""}, {"o"});
  plain.set_op_type(SoftmaxAttentionOpType.str());
  std::vector<const Tensor *> in3 = {&q, &k, &v, nullptr, nullptr};
  EXPECT_EQ(worstDifference(fused(plain, in3), unfused(plain, in3)), 0.0);
}

/// The keys as torch's decomposition reads them over a KV cache: merged to
/// three axes, the last two swapped, split back, scaled; then attention.
std::vector<onnx::NodeProto> keyChainAttentionNodes() {
  onnx::NodeProto swap = test::makeNode("Transpose", {"km"}, "kt3");
  auto *perm = swap.add_attribute();
  perm->set_name("perm");
  perm->set_type(onnx::AttributeProto::INTS);
  for (int64_t axis : {0, 2, 1})
    perm->add_ints(axis);
  std::vector<onnx::NodeProto> nodes = {test::makeNode("Reshape", {"key", "merged"}, "km"), swap,
                                        test::makeNode("Reshape", {"kt3", "split"}, "kt"),
                                        test::makeNode("Mul", {"kt", "scale"}, "k")};
  for (const onnx::NodeProto &n : attentionNodes())
    nodes.push_back(n);
  return nodes;
}

TEST(SoftmaxAttention, TransposesAndScalesTheKeysAsTheirChainDoes) {
  // Keys [2, 3, 7, 4] (a cache of 7 positions): the product reads
  // 0.5 * their transpose, [2, 3, 4, 7].
  Tensor q = randomTensor({2, 3, 5, 4}, 61), key = randomTensor({2, 3, 7, 4}, 62),
         v = randomTensor({2, 3, 7, 6}, 63), c = Tensor::scalar(0.0f), scale = Tensor::scalar(0.5f),
         m = randomTensor({2, 1, 5, 7}, 64);
  Tensor merged = Tensor::fromValues<int64_t>({3}, {-1, 7, 4}),
         split = Tensor::fromValues<int64_t>({4}, {2, 3, 4, 7});
  onnx::NodeProto f = attentionOver(keyChainAttentionNodes(),
                                    {"q", "key", "v", "m", "c", "scale", "merged", "split"});
  std::vector<const Tensor *> in = {&q, &key, &v, &m, &c, &scale, &merged, &split};
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(runFused(f, in, {2, 3, 5, 6}, got));
  // Against attention in double: head (1, 2), query 3.
  expectAttention(
      got, {1, 2, 3}, 7, 6,
      [&](int64_t j) {
        double score = at(m, {1, 0, 3, j});
        for (int64_t kk = 0; kk < 4; ++kk)
          score += at(q, {1, 2, 3, kk}) * 0.5 * at(key, {1, 2, j, kk});
        return score;
      },
      [&](int64_t j, int64_t e) {
        return at(v, {1, 2, j, e});
      });
  // A scale per key position rather than one: the body's nodes, still
  // equal to them.
  Tensor perKey = randomTensor({1, 7}, 65);
  std::vector<const Tensor *> each = {&q, &key, &v, &m, &c, &perKey, &merged, &split};
  EXPECT_EQ(worstDifference(fused(f, each), unfused(f, each)), 0.0);
}

/// Grouped-query attention as torch exports it: 2 key and value heads, each
/// repeated for 2 query heads (repeat_kv), then the key chain and attention.
std::vector<onnx::NodeProto> groupedAttentionNodes() {
  std::vector<onnx::NodeProto> nodes = {test::makeNode("Unsqueeze", {"kx", "axes"}, "ku"),
                                        test::makeNode("Expand", {"ku", "kwide"}, "ke"),
                                        test::makeNode("Reshape", {"ke", "kheads"}, "key"),
                                        test::makeNode("Unsqueeze", {"vx", "axes"}, "vu"),
                                        test::makeNode("Expand", {"vu", "vwide"}, "ve"),
                                        test::makeNode("Reshape", {"ve", "vheads"}, "v")};
  for (const onnx::NodeProto &n : keyChainAttentionNodes())
    nodes.push_back(n);
  return nodes;
}

TEST(SoftmaxAttention, ReadsEachSharedHeadForTheHeadsThatShareIt) {
  // 4 query heads over 2 key and value heads: heads 2 and 3 read head 1.
  Tensor q = randomTensor({2, 4, 5, 4}, 71), kx = randomTensor({2, 2, 7, 4}, 72),
         vx = randomTensor({2, 2, 7, 6}, 73), c = Tensor::scalar(0.0f),
         scale = Tensor::scalar(0.5f), m = randomTensor({2, 1, 5, 7}, 74);
  Tensor axes = Tensor::fromValues<int64_t>({1}, {2}),
         kwide = Tensor::fromValues<int64_t>({5}, {2, 2, 2, 7, 4}),
         kheads = Tensor::fromValues<int64_t>({4}, {2, 4, 7, 4}),
         vwide = Tensor::fromValues<int64_t>({5}, {2, 2, 2, 7, 6}),
         vheads = Tensor::fromValues<int64_t>({4}, {2, 4, 7, 6}),
         merged = Tensor::fromValues<int64_t>({3}, {-1, 7, 4}),
         split = Tensor::fromValues<int64_t>({4}, {2, 4, 4, 7});
  onnx::NodeProto f = attentionOver(groupedAttentionNodes(),
                                    {"q", "kx", "vx", "m", "c", "scale", "merged", "split", "axes",
                                     "kwide", "kheads", "axes", "vwide", "vheads"});
  std::vector<const Tensor *> in = {&q,     &kx,   &vx,    &m,      &c,    &scale, &merged,
                                    &split, &axes, &kwide, &kheads, &axes, &vwide, &vheads};
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(runFused(f, in, {2, 4, 5, 6}, got));
  // Against attention in double: batch 1, head 3 (key and value head 1),
  // query 2.
  expectAttention(
      got, {1, 3, 2}, 7, 6,
      [&](int64_t j) {
        double score = at(m, {1, 0, 2, j});
        for (int64_t kk = 0; kk < 4; ++kk)
          score += at(q, {1, 3, 2, kk}) * 0.5 * at(kx, {1, 1, j, kk});
        return score;
      },
      [&](int64_t j, int64_t e) {
        return at(vx, {1, 1, j, e});
      });
  // A repeat along another axis (the new axis before the heads): the body's
  // nodes, still equal to them.
  Tensor before = Tensor::fromValues<int64_t>({1}, {1}),
         kwideBefore = Tensor::fromValues<int64_t>({5}, {2, 2, 2, 7, 4}),
         vwideBefore = Tensor::fromValues<int64_t>({5}, {2, 2, 2, 7, 6});
  std::vector<const Tensor *> other = {&q,      &kx,     &vx,          &m,      &c,
                                       &scale,  &merged, &split,       &before, &kwideBefore,
                                       &kheads, &before, &vwideBefore, &vheads};
  EXPECT_EQ(worstDifference(fused(f, other), unfused(f, other)), 0.0);
}

/// A decode step over a KV cache as torch exports it: the past keys and
/// values and this step's, joined on the sequence axis (\p axis), then the
/// key chain and attention.
std::vector<onnx::NodeProto> cachedAttentionNodes(int64_t axis) {
  std::vector<onnx::NodeProto> nodes = {test::makeNode("Concat", {"kpast", "knew"}, "key"),
                                        test::makeNode("Concat", {"vpast", "vnew"}, "v")};
  for (onnx::NodeProto &n : nodes) {
    auto *a = n.add_attribute();
    a->set_name("axis");
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(axis);
  }
  for (const onnx::NodeProto &n : keyChainAttentionNodes())
    nodes.push_back(n);
  return nodes;
}

TEST(SoftmaxAttention, ReadsThePastAndTheAppendedPositionsWhereTheyLie) {
  // 6 past positions and 1 appended, of 3 heads.
  Tensor q = randomTensor({2, 3, 1, 4}, 81), kpast = randomTensor({2, 3, 6, 4}, 82),
         knew = randomTensor({2, 3, 1, 4}, 83), vpast = randomTensor({2, 3, 6, 5}, 84),
         vnew = randomTensor({2, 3, 1, 5}, 85), c = Tensor::scalar(0.0f),
         scale = Tensor::scalar(0.5f), m = randomTensor({2, 1, 1, 7}, 86);
  Tensor merged = Tensor::fromValues<int64_t>({3}, {-1, 7, 4}),
         split = Tensor::fromValues<int64_t>({4}, {2, 3, 4, 7});
  onnx::NodeProto f =
      attentionOver(cachedAttentionNodes(-2), {"q", "kpast", "vpast", "m", "c", "scale", "merged",
                                               "split", "", "", "", "", "", "", "knew", "vnew"});
  std::vector<const Tensor *> in = {&q,      &kpast,  &vpast,  &m,      &c,      &scale,
                                    &merged, &split,  nullptr, nullptr, nullptr, nullptr,
                                    nullptr, nullptr, &knew,   &vnew};
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(runFused(f, in, {2, 3, 1, 5}, got));
  // Against attention in double: batch 1, head 2; position 6 is the
  // appended one.
  expectAttention(
      got, {1, 2, 0}, 7, 5,
      [&](int64_t j) {
        double score = at(m, {1, 0, 0, j});
        for (int64_t kk = 0; kk < 4; ++kk)
          score += at(q, {1, 2, 0, kk}) * 0.5 *
                   (j < 6 ? at(kpast, {1, 2, j, kk}) : at(knew, {1, 2, 0, kk}));
        return score;
      },
      [&](int64_t j, int64_t e) {
        return j < 6 ? at(vpast, {1, 2, j, e}) : at(vnew, {1, 2, 0, e});
      });
}

TEST(MatMulTransposed, ReadsTheWeightTransposed) {
  // y = a Transpose(w): one GEMM reading w [6, 7] transposed, equal to the
  // two nodes it replaces; a 1-D a runs the body.
  Tensor a = randomTensor({2, 5, 7}, 31), w = randomTensor({6, 7}, 32), v = randomTensor({7}, 33);
  onnx::NodeProto tr = test::makeNode("Transpose", {"w"}, "t"),
                  mm = test::makeNode("MatMul", {"a", "t"}, "y");
  auto *perm = tr.add_attribute();
  perm->set_name("perm");
  perm->set_type(onnx::AttributeProto::INTS);
  perm->add_ints(1);
  perm->add_ints(0);
  onnx::NodeProto f = makeFusedNode("linear", {&tr, &mm}, {"a", "w"}, {"y"});
  f.set_op_type(MatMulTransposedOpType.str());
  std::vector<Tensor> got = fused(f, {&a, &w});
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].shape(), (std::vector<int64_t>{2, 5, 6}));
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t j = 0; j < 6; ++j) {
      float dot = 0;
      for (int64_t kk = 0; kk < 7; ++kk)
        dot += a.data<float>()[r * 7 + kk] * w.data<float>()[j * 7 + kk];
      EXPECT_NEAR(got[0].data<float>()[r * 6 + j], dot, 1e-5) << r << " " << j;
    }
  EXPECT_LE(worstDifference(got, unfused(f, {&a, &w})), 1e-5);
  std::vector<Tensor> vector = fused(f, {&v, &w});
  ASSERT_EQ(vector.size(), 1u);
  EXPECT_EQ(vector[0].shape(), (std::vector<int64_t>{6}));
  EXPECT_EQ(worstDifference(vector, unfused(f, {&v, &w})), 0.0);
}

//===----------------------------------------------------------------------===//
// The pass
//===----------------------------------------------------------------------===//

std::vector<std::string> opsOf(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes) {
  std::vector<std::string> ops;
  for (const onnx::NodeProto &n : nodes)
    ops.push_back(n.op_type());
  return ops;
}

const onnx::NodeProto *findFused(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes) {
  for (const onnx::NodeProto &n : nodes)
    if (n.op_type() == FusedOpType)
      return &n;
  return nullptr;
}

TEST(FusionPass, GroupsAChainAndKeepsWhatOthersRead) {
  plan::StageProgram p;
  *p.add_forward() = test::makeNode("MatMul", {"in", "w"}, "m");
  *p.add_forward() = test::makeNode("Add", {"m", "bias"}, "h");
  *p.add_forward() = test::makeNode("Mul", {"h", "half"}, "a");
  *p.add_forward() = test::makeNode("Tanh", {"h"}, "t");
  *p.add_forward() = test::makeNode("Add", {"t", "one"}, "e");
  *p.add_forward() = test::makeNode("Mul", {"a", "e"}, "y");
  *p.add_forward() = test::makeNode("MatMul", {"y", "w2"}, "out");
  p.add_keep("t");   // backward reads it
  p.add_send("out"); // the next stage does
  *p.add_backward_input() = test::makeNode("Mul", {"grad:y", "a"}, "grad:e");
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  // The first MatMul takes its bias Add; the second has no Add after it.
  EXPECT_EQ(stats.matMulBias, 1);
  EXPECT_EQ(stats.groups, 1);
  EXPECT_EQ(stats.nodes, 4);
  EXPECT_EQ(opsOf(p.forward()),
            (std::vector<std::string>{MatMulBiasOpType.str(), FusedOpType.str(), "MatMul"}));
  const onnx::NodeProto &mb = p.forward(0);
  EXPECT_EQ(std::vector<std::string>(mb.input().begin(), mb.input().end()),
            (std::vector<std::string>{"in", "w", "bias"}));
  EXPECT_EQ(mb.output(0), "h");
  const onnx::NodeProto *f = findFused(p.forward());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(std::vector<std::string>(f->input().begin(), f->input().end()),
            (std::vector<std::string>{"h", "half", "one"}));
  // a: read by backward; t: kept; y: read by the MatMul after. e is
  // internal.
  EXPECT_EQ(std::vector<std::string>(f->output().begin(), f->output().end()),
            (std::vector<std::string>{"a", "t", "y"}));
  // A single node (backward's Mul) stays as it is.
  EXPECT_EQ(opsOf(p.backward_input()), (std::vector<std::string>{"Mul"}));
}

TEST(FusionPass, AnAddOfTwoProductsTakesOneOfThem) {
  // A parallel attention and MLP block (Falcon, GPT-J): the two branches'
  // products meet in one Add. It takes one MatMul as its bias's partner;
  // the other MatMul stays, and its product reaches the fused node.
  plan::StageProgram p;
  *p.add_forward() = test::makeNode("MatMul", {"x", "wa"}, "attn");
  *p.add_forward() = test::makeNode("MatMul", {"x", "wm"}, "mlp");
  *p.add_forward() = test::makeNode("Add", {"attn", "mlp"}, "y");
  p.add_send("y");
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.matMulBias, 1);
  ASSERT_EQ(opsOf(p.forward()), (std::vector<std::string>{"MatMul", MatMulBiasOpType.str()}));
  EXPECT_EQ(p.forward(0).output(0), "mlp");
  const onnx::NodeProto &mb = p.forward(1);
  EXPECT_EQ(std::vector<std::string>(mb.input().begin(), mb.input().end()),
            (std::vector<std::string>{"x", "wa", "mlp"}));
  EXPECT_EQ(mb.output(0), "y");
}

TEST(FusionPass, AttentionBecomesOneNodeUnlessItsProbabilitiesAreRead) {
  plan::StageProgram p;
  for (const onnx::NodeProto &n : attentionNodes())
    *p.add_forward() = n;
  p.add_send("o");
  plan::StageProgram kept = p;
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.softmaxAttention, 1);
  ASSERT_EQ(opsOf(p.forward()), (std::vector<std::string>{SoftmaxAttentionOpType.str()}));
  const onnx::NodeProto &a = p.forward(0);
  EXPECT_EQ(std::vector<std::string>(a.input().begin(), a.input().end()),
            (std::vector<std::string>{"q", "k", "v", "m", "c"}));
  EXPECT_EQ(fusedBodyOf(a)->node_size(), 6);
  // Training keeps the probabilities for backward: nothing fuses into the
  // attention then (the product and its mask still make a MatMulBias).
  kept.add_keep("p");
  rt::FusionStats keptStats = rt::fuseStageProgram(kept, testOpset);
  EXPECT_EQ(keptStats.softmaxAttention, 0);
  EXPECT_EQ(keptStats.matMulBias, 1);
}

TEST(FusionPass, AttentionTakesTheKeyChainNothingElseReads) {
  plan::StageProgram p;
  for (const onnx::NodeProto &n : keyChainAttentionNodes())
    *p.add_forward() = n;
  p.add_send("o");
  plan::StageProgram kept = p;
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.softmaxAttention, 1);
  ASSERT_EQ(opsOf(p.forward()), (std::vector<std::string>{SoftmaxAttentionOpType.str()}));
  const onnx::NodeProto &a = p.forward(0);
  EXPECT_EQ(std::vector<std::string>(a.input().begin(), a.input().end()),
            (std::vector<std::string>{"q", "key", "v", "m", "c", "scale", "merged", "split"}));
  EXPECT_EQ(fusedBodyOf(a)->node_size(), 10);
  // The scaled keys read elsewhere too: the chain stays, attention fuses
  // from the product on.
  kept.add_send("k");
  rt::FusionStats keptStats = rt::fuseStageProgram(kept, testOpset);
  EXPECT_EQ(keptStats.softmaxAttention, 1);
  ASSERT_EQ(kept.forward_size(), 5);
  const onnx::NodeProto &b = kept.forward(kept.forward_size() - 1);
  EXPECT_EQ(std::vector<std::string>(b.input().begin(), b.input().end()),
            (std::vector<std::string>{"q", "k", "v", "m", "c"}));
}

TEST(FusionPass, AttentionTakesTheGroupedQueryRepeats) {
  plan::StageProgram p;
  for (const onnx::NodeProto &n : groupedAttentionNodes())
    *p.add_forward() = n;
  p.add_send("o");
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.softmaxAttention, 1);
  ASSERT_EQ(opsOf(p.forward()), (std::vector<std::string>{SoftmaxAttentionOpType.str()}));
  const onnx::NodeProto &a = p.forward(0);
  EXPECT_EQ(std::vector<std::string>(a.input().begin(), a.input().end()),
            (std::vector<std::string>{"q", "kx", "vx", "m", "c", "scale", "merged", "split", "axes",
                                      "kwide", "kheads", "axes", "vwide", "vheads"}));
  EXPECT_EQ(fusedBodyOf(a)->node_size(), 16);
}

TEST(FusionPass, AttentionTakesTheCacheConcatNothingElseReads) {
  plan::StageProgram p;
  for (const onnx::NodeProto &n : cachedAttentionNodes(-2))
    *p.add_forward() = n;
  p.add_send("o");
  p.add_outputs("knew"); // a generation stage keeps the appended positions
  p.add_outputs("vnew");
  plan::StageProgram kept = p;
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.softmaxAttention, 1);
  ASSERT_EQ(opsOf(p.forward()), (std::vector<std::string>{SoftmaxAttentionOpType.str()}));
  const onnx::NodeProto &a = p.forward(0);
  EXPECT_EQ(std::vector<std::string>(a.input().begin(), a.input().end()),
            (std::vector<std::string>{"q", "kpast", "vpast", "m", "c", "scale", "merged", "split",
                                      "", "", "", "", "", "", "knew", "vnew"}));
  EXPECT_EQ(fusedBodyOf(a)->node_size(), 12);
  // A stage that keeps the present: the Concats stay, and make it.
  kept.add_outputs("key");
  kept.add_outputs("v");
  rt::FusionStats keptStats = rt::fuseStageProgram(kept, testOpset);
  EXPECT_EQ(keptStats.softmaxAttention, 1);
  ASSERT_EQ(kept.forward_size(), 3);
  EXPECT_EQ(kept.forward(0).op_type(), "Concat");
  EXPECT_EQ(kept.forward(1).op_type(), "Concat");
}

TEST(FusionPass, AMatMulTakesTheTransposeOnlyItReads) {
  // torch's Linear without bias: the Transpose of w only the MatMul reads
  // goes into it. The Transpose of v, also read by the backward, stays.
  plan::StageProgram p;
  for (const char *w : {"w", "v"}) {
    onnx::NodeProto tr = test::makeNode("Transpose", {w}, std::string(w) + "t");
    auto *perm = tr.add_attribute();
    perm->set_name("perm");
    perm->set_type(onnx::AttributeProto::INTS);
    perm->add_ints(1);
    perm->add_ints(0);
    *p.add_forward() = tr;
  }
  *p.add_forward() = test::makeNode("MatMul", {"x", "wt"}, "h");
  *p.add_forward() = test::makeNode("MatMul", {"h", "vt"}, "y");
  p.add_send("y");
  *p.add_backward_input() = test::makeNode("MatMul", {"grad:y", "vt"}, "grad:h");
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.matMulTransposed, 1);
  ASSERT_EQ(opsOf(p.forward()),
            (std::vector<std::string>{"Transpose", MatMulTransposedOpType.str(), "MatMul"}));
  const onnx::NodeProto &mt = p.forward(1);
  EXPECT_EQ(std::vector<std::string>(mt.input().begin(), mt.input().end()),
            (std::vector<std::string>{"x", "w"}));
  EXPECT_EQ(mt.output(0), "h");
}

TEST(FusionPass, NeverMovesAValuePastItsReader) {
  // t = Tanh(x) is read by the Softmax at position 1; fusing it with Exp at
  // position 2 would make t only after the Softmax needs it.
  plan::StageProgram p;
  *p.add_forward() = test::makeNode("Tanh", {"x"}, "t");
  *p.add_forward() = test::makeNode("Softmax", {"t"}, "m");
  *p.add_forward() = test::makeNode("Exp", {"t"}, "e");
  *p.add_forward() = test::makeNode("Add", {"e", "m"}, "y");
  p.add_send("y");
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  // Exp and Add fuse (both after the Softmax); Tanh stays before it.
  EXPECT_EQ(stats.groups, 1);
  EXPECT_EQ(opsOf(p.forward()), (std::vector<std::string>{"Tanh", "Softmax", FusedOpType.str()}));
  const onnx::NodeProto *f = findFused(p.forward());
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(std::vector<std::string>(f->output().begin(), f->output().end()),
            (std::vector<std::string>{"y"}));
}

TEST(FusionPass, RespectsTheLimitsAndOldOpsets) {
  // A chain of 40 additions of distinct inputs: no group over 8 inputs or 16
  // steps.
  plan::StageProgram p;
  std::string last = "x0";
  for (int i = 1; i <= 40; ++i) {
    std::string out = "s" + std::to_string(i);
    *p.add_forward() = test::makeNode("Add", {last, "x" + std::to_string(i)}, out);
    last = out;
  }
  p.add_send(last);
  plan::StageProgram old = p;
  rt::FusionStats stats = rt::fuseStageProgram(p, testOpset);
  EXPECT_EQ(stats.nodes, 40);
  EXPECT_GE(stats.groups, 6); // at most 7 additions (8 inputs) a group
  for (const onnx::NodeProto &n : p.forward()) {
    EXPECT_LE(n.input_size(), 8);
    auto kernel = compileFused(n, testOpset);
    EXPECT_TRUE(static_cast<bool>(kernel)) << llvm::toString(kernel.takeError());
  }
  // Before opset 7 binary ops broadcast only by attribute: nothing fuses.
  EXPECT_EQ(rt::fuseStageProgram(old, 6).groups, 0);
}

} // namespace
