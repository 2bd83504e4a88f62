//===- NumericKernelsTest.cpp - The numeric and quantization kernels -----===//
//
// Cases ONNX's node tests leave open for IsInf, Mod, the bitwise ops, the
// normalizations (GroupNormalization 18's per-group scale, RMSNormalization
// with a broadcast scale, LpNormalization of a zero column, LRN of even size
// on 3-D input), Det with pivoting, and the quantization family (per-axis
// ties and saturation, blocks that do not divide the axis, per-channel
// QLinearConv, per-row MatMulInteger zero points); and the errors that
// malformed nodes get. Expected values come from onnxruntime 1.32 (CPU
// provider), from ONNX 1.23's reference evaluator or from numpy 2.4, as each
// test says; none from pipec.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace pipec;
using namespace pipec::test;

namespace {

/// The error \p node gets, or "no error".
std::string errorOf(const onnx::NodeProto &node, const std::vector<Tensor> &inputs, int64_t opset) {
  auto out = cpu::runOp(node, opset, pointers(inputs));
  if (out)
    return "no error";
  return llvm::toString(out.takeError());
}

template <typename T> std::vector<T> valuesOf(const Tensor &t) {
  return std::vector<T>(t.data<T>(), t.data<T>() + t.numElements());
}

//===----------------------------------------------------------------------===//
// Element-wise: IsInf, Mod, bitwise
//===----------------------------------------------------------------------===//

// onnxruntime 1.32, IsInf-20 on float64 [inf, -inf, nan, 1].
TEST(NumericKernels, IsInfDetectsOnlyTheSignsAsked) {
  double inf = std::numeric_limits<double>::infinity();
  Tensor x = Tensor::fromValues<double>({4}, {inf, -inf, std::nan(""), 1});
  auto none =
      runCpu(NodeBuilder("IsInf", 1).i("detect_positive", 0).i("detect_negative", 0), {x}, 20);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_EQ(valuesOf<bool>(none[0]), (std::vector<bool>{false, false, false, false}));
  auto negative = runCpu(NodeBuilder("IsInf", 1).i("detect_positive", 0), {x}, 20);
  ASSERT_EQ(negative.size(), 1u);
  EXPECT_EQ(valuesOf<bool>(negative[0]), (std::vector<bool>{false, true, false, false}));
}

// onnxruntime 1.32, Mod-13 on int8 (numpy's np.mod and np.fmod agree).
TEST(NumericKernels, ModOfInt8FollowsTheDivisorOrTheDividend) {
  Tensor a = castTo(int64s({5}, {-128, -7, 7, -128, 5}), DType::I8);
  Tensor b = castTo(int64s({5}, {-1, 3, -3, 3, -128}), DType::I8);
  auto floor = runCpu(NodeBuilder("Mod", 2).i("fmod", 0), {a, b}, 13);
  ASSERT_EQ(floor.size(), 1u);
  EXPECT_EQ(valuesOf<int8_t>(floor[0]), (std::vector<int8_t>{0, 2, -2, 1, -123}));
  auto trunc = runCpu(NodeBuilder("Mod", 2).i("fmod", 1), {a, b}, 13);
  ASSERT_EQ(trunc.size(), 1u);
  EXPECT_EQ(valuesOf<int8_t>(trunc[0]), (std::vector<int8_t>{0, -1, 1, -2, 5}));
}

// onnxruntime 1.32, Mod-13 fmod=1 on float32 with a broadcast divisor:
// the remainder keeps the dividend's sign, zeros included.
TEST(NumericKernels, FmodOfFloatsKeepsTheDividendsSign) {
  Tensor a = Tensor::fromValues<float>({2, 2}, {5.5f, -5.5f, 0.0f, -0.0f});
  Tensor b = Tensor::fromValues<float>({2}, {2, -2});
  auto y = runCpu(NodeBuilder("Mod", 2).i("fmod", 1), {a, b}, 13);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], Tensor::fromValues<float>({2, 2}, {1.5f, -1.5f, 0, 0})));
  EXPECT_TRUE(std::signbit(y[0].data<float>()[3]));
  EXPECT_FALSE(std::signbit(y[0].data<float>()[2]));
}

TEST(NumericKernels, IntegerModByZeroAndBadFmodAreErrors) {
  Tensor a = int64s({2}, {3, 4}), zero = int64s({2}, {1, 0});
  EXPECT_NE(errorOf(NodeBuilder("Mod", 2), {a, zero}, 13), "no error");
  EXPECT_NE(errorOf(NodeBuilder("Mod", 2).i("fmod", 2), {a, a}, 13), "no error");
}

// numpy 2.4: np.bitwise_and and np.invert on int16.
TEST(NumericKernels, BitwiseOpsBroadcastAndRefuseFloats) {
  Tensor a = castTo(int64s({3}, {0x0F0F, -1, 12345}), DType::I16);
  Tensor b = castTo(int64s({1}, {0x00FF}), DType::I16);
  auto y = runCpu(NodeBuilder("BitwiseAnd", 2), {a, b}, 18);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(valuesOf<int16_t>(y[0]), (std::vector<int16_t>{15, 255, 57}));
  auto n = runCpu(NodeBuilder("BitwiseNot", 1), {a}, 18);
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(valuesOf<int16_t>(n[0]), (std::vector<int16_t>{-3856, 0, -12346}));
  Tensor f = floats({3});
  EXPECT_NE(errorOf(NodeBuilder("BitwiseOr", 2), {f, f}, 18), "no error");
  EXPECT_NE(errorOf(NodeBuilder("BitShift", 2).s("direction", "UP"), {a, a}, 11), "no error");
  EXPECT_NE(errorOf(NodeBuilder("IsNaN", 1), {a}, 13), "no error");
}

//===----------------------------------------------------------------------===//
// Normalizations and Det
//===----------------------------------------------------------------------===//

/// [2, 4, 3]: 0.25 i - 2.5, with element [1, 2, 1] set to 7.
Tensor normInput() {
  Tensor x(DType::F32, {2, 4, 3});
  for (int64_t i = 0; i < 24; ++i)
    x.data<float>()[i] = 0.25f * static_cast<float>(i) - 2.5f;
  x.data<float>()[(1 * 4 + 2) * 3 + 1] = 7;
  return x;
}

// onnxruntime 1.32, GroupNormalization-18 (scale and bias one per group),
// num_groups 2, epsilon 1e-3.
TEST(NumericKernels, GroupNormalization18ScalesPerGroup) {
  Tensor scale = Tensor::fromValues<float>({2}, {0.5f, -1.5f});
  Tensor bias = Tensor::fromValues<float>({2}, {0.25f, 1});
  auto node = NodeBuilder("GroupNormalization", 3).i("num_groups", 2).f("epsilon", 1e-3f);
  auto y = runCpu(node, {normInput(), scale, bias}, 18);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(
      y[0], Tensor::fromValues<float>(
                {2, 4, 3}, {-0.479925573f, -0.18795532f, 0.104014888f,  0.395985126f,  0.68795532f,
                            0.979925573f,  3.18977737f,  2.31386638f,   1.4379555f,    0.562044501f,
                            -0.313866377f, -1.18977737f, -0.479925811f, -0.187955469f, 0.104014844f,
                            0.395985156f,  0.687955499f, 0.979925811f,  2.2877083f,    -2.25714397f,
                            1.8332231f,    1.60598040f,  1.37873781f,   1.15149522f})));
  // Opset 21 wants one scale per channel: [2] no longer fits 4 channels.
  EXPECT_NE(errorOf(node, {normInput(), scale, bias}, 21), "no error");
  EXPECT_NE(errorOf(NodeBuilder("GroupNormalization", 3).i("num_groups", 3),
                    {normInput(), scale, bias}, 18),
            "no error");
}

// onnxruntime 1.32, RMSNormalization-23, axis 1, epsilon 1e-2, scale
// [1, 3] broadcast over the normalized [4, 3].
TEST(NumericKernels, RmsNormalizationBroadcastsItsScale) {
  Tensor scale = Tensor::fromValues<float>({1, 3}, {1, 2, -0.5f});
  auto y = runCpu(NodeBuilder("RMSNormalization", 2).i("axis", 1).f("epsilon", 1e-2f),
                  {normInput(), scale}, 23);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(
      close(y[0], Tensor::fromValues<float>(
                      {2, 4, 3},
                      {-1.75881243f,  -3.16586256f,   0.703525007f, -1.23116875f, -2.11057496f,
                       0.439703107f,  -0.703525007f,  -1.05528748f, 0.175881252f, -0.175881252f,
                       0.0f,          -0.0879406258f, 0.177534223f, 0.532602668f, -0.177534223f,
                       0.443835557f,  1.06520534f,    -0.31068489f, 0.71013689f,  4.97095823f,
                       -0.443835557f, 0.976438224f,   2.13041067f,  -0.576986194f})));
}

// onnxruntime 1.32, LpNormalization-1, p 1 along axis 0: a zero column
// stays zero.
TEST(NumericKernels, LpNormalizationOfAZeroColumnIsZero) {
  Tensor x = Tensor::fromValues<float>({2, 3}, {1, 0, -3, 3, 0, 4});
  auto y = runCpu(NodeBuilder("LpNormalization", 1).i("axis", 0).i("p", 1), {x}, 1);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(
      y[0], Tensor::fromValues<float>({2, 3}, {0.25f, 0, -0.428571433f, 0.75f, 0, 0.571428597f})));
}

// numpy 2.4 by ONNX's LRN formula (onnxruntime refuses an even size): size
// 4 sums channels c-1 .. c+2, on [1, 5, 2].
TEST(NumericKernels, LrnOfEvenSizeOnThreeDimensions) {
  Tensor x(DType::F32, {1, 5, 2});
  for (int64_t i = 0; i < 10; ++i)
    x.data<float>()[i] = 0.3f * static_cast<float>(i) - 1;
  auto y = runCpu(NodeBuilder("LRN", 1).i("size", 4).f("alpha", 0.01f).f("beta", 0.5f).f("bias", 2),
                  {x}, 13);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], Tensor::fromValues<float>(
                              {1, 5, 2}, {-0.706577063f, -0.494742870f, -0.282517999f,
                                          -0.0706241876f, 0.141174555f, 0.352593869f, 0.564754426f,
                                          0.775711417f, 0.988344848f, 1.19901299f})));
}

// numpy 2.4 np.linalg.det: a matrix that needs a row exchange, and a
// singular one.
TEST(NumericKernels, DetPivotsAndSeesSingularMatrices) {
  Tensor x =
      Tensor::fromValues<double>({2, 3, 3}, {0, 2, 1, 1, 0, 0, 3, 1, 2, 1, 2, 3, 2, 4, 6, 0, 1, 1});
  auto y = runCpu(NodeBuilder("Det", 1), {x}, 11);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], Tensor::fromValues<double>({2}, {-3, 0}), 1e-12, 1e-12));
  EXPECT_NE(errorOf(NodeBuilder("Det", 1), {floats({2, 3})}, 11), "no error");
}

//===----------------------------------------------------------------------===//
// Quantization
//===----------------------------------------------------------------------===//

// onnxruntime 1.32, QuantizeLinear-13 to int8 along axis 0: ties to even
// before the zero point is added, then saturation.
TEST(NumericKernels, QuantizeLinearPerAxisRoundsThenSaturates) {
  Tensor x = Tensor::fromValues<float>({2, 4}, {0.5f, 1.5f, 2.5f, -2.5f, 300, -300, 0.25f, -0.75f});
  Tensor scale = Tensor::fromValues<float>({2}, {1, 0.5f});
  Tensor zero = castTo(int64s({2}, {0, -1}), DType::I8);
  auto y = runCpu(NodeBuilder("QuantizeLinear", 3).i("axis", 0), {x, scale, zero}, 13);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(valuesOf<int8_t>(y[0]), (std::vector<int8_t>{0, 2, 2, -2, 127, -128, -1, -3}));
  Tensor wrong = Tensor::fromValues<float>({3}, {1, 1, 1});
  EXPECT_NE(errorOf(NodeBuilder("QuantizeLinear", 3).i("axis", 0), {x, wrong, zero}, 13),
            "no error");
}

// onnxruntime 1.32 and ONNX 1.23's reference agree: block_size 3 over 4
// columns leaves a last block of one.
TEST(NumericKernels, BlockedQuantizationWithARemainderBlock) {
  Tensor scale = Tensor::fromValues<float>({2, 2}, {0.5f, 2, 1, 0.25f});
  Tensor x = Tensor::fromValues<float>({2, 4}, {1, 2, 3, 4, -1, -2, -3, -4});
  Tensor zero16 = castTo(int64s({2, 2}, {1, -2, 0, 3}), DType::I16);
  auto q = runCpu(NodeBuilder("QuantizeLinear", 3).i("axis", 1).i("block_size", 3),
                  {x, scale, zero16}, 21);
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(valuesOf<int16_t>(q[0]), (std::vector<int16_t>{3, 5, 7, 0, -1, -2, -3, -13}));
  Tensor data = castTo(int64s({2, 4}, {10, 20, 30, 40, -5, 0, 5, 7}), DType::I8);
  Tensor zero8 = castTo(int64s({2, 2}, {1, 2, 0, -3}), DType::I8);
  auto d = runCpu(NodeBuilder("DequantizeLinear", 3).i("axis", 1).i("block_size", 3),
                  {data, scale, zero8}, 21);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_TRUE(
      close(d[0], Tensor::fromValues<float>({2, 4}, {4.5f, 9.5f, 14.5f, 76, -5, 0, 5, 2.5f})));
}

// onnxruntime 1.32 and ONNX 1.23's reference agree: QLinearConv-10 with
// w_scale per output channel, a bias and asymmetric pads.
TEST(NumericKernels, QLinearConvScalesPerOutputChannel) {
  Tensor x = castTo(int64s({1, 1, 3, 3}, {10, 20, 30, 40, 50, 60, 70, 80, 90}), DType::U8);
  Tensor w = castTo(int64s({2, 1, 2, 2}, {1, 2, 3, 4, -1, 0, 2, -3}), DType::I8);
  std::vector<Tensor> inputs = {x,
                                Tensor::scalar(0.1f),
                                castTo(Tensor::scalar(int64_t(5)), DType::U8),
                                w,
                                Tensor::fromValues<float>({2}, {0.2f, 0.05f}),
                                castTo(int64s({2}, {0, 0}), DType::I8),
                                Tensor::scalar(0.7f),
                                castTo(Tensor::scalar(int64_t(100)), DType::U8),
                                Tensor::fromValues<int32_t>({2}, {7, -300})};
  auto y = runCpu(NodeBuilder("QLinearConv", 9).ints("pads", {1, 0, 0, 1}), inputs, 10);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(valuesOf<uint8_t>(y[0]),
            (std::vector<uint8_t>{102, 104, 102, 109, 112, 106, 118, 121, 109, 98, 98, 98, 97, 97,
                                  98, 97, 97, 99}));
}

// numpy 2.4 by the spec's per-row reading of a 1-D a_zero_point
// (onnxruntime takes only a scalar there).
TEST(NumericKernels, MatMulIntegerZeroPointPerRowOfA) {
  Tensor a = castTo(int64s({2, 3}, {1, 2, 3, 4, 5, 6}), DType::U8);
  Tensor b = castTo(int64s({3, 2}, {1, 0, 2, 1, 3, 250}), DType::U8);
  Tensor za = castTo(int64s({2}, {1, 2}), DType::U8);
  Tensor zb = castTo(int64s({2}, {0, 128}), DType::U8);
  auto y = runCpu(NodeBuilder("MatMulInteger", 4), {a, b, za, zb}, 10);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(valuesOf<int32_t>(y[0]), (std::vector<int32_t>{8, 117, 20, -149}));
}

} // namespace

// Sums over trailing axes run row by row on the loop threads, each row in
// double as the other axes are: every output is its elements' double sum
// rounded once to float (a float accumulator misses by a few ulp).
TEST(NumericKernels, TrailingAxisSumsAreTheirDoubleSumRoundedOnce) {
  Tensor x(DType::F32, {3, 37, 129});
  for (int64_t i = 0; i < x.numElements(); ++i)
    x.data<float>()[i] = float((i * 7919) % 2003) * 1e-3f - 1.0f + 1e-7f * float(i % 11);
  struct Case {
    const char *op;
    std::vector<int64_t> axes;
    bool squares;
  };
  for (const Case &c : {Case{"ReduceMean", {2}, false}, Case{"ReduceSum", {1, 2}, false},
                        Case{"ReduceSumSquare", {-1}, true}, Case{"ReduceMean", {1}, false}}) {
    auto y = runCpu(NodeBuilder(c.op, 1).ints("axes", c.axes), {x}, 17);
    ASSERT_EQ(y.size(), 1u) << c.op;
    bool middle = c.axes == std::vector<int64_t>{1};
    int64_t rows = c.axes.size() == 2 ? 3 : (middle ? 3 * 129 : 3 * 37);
    int64_t n = x.numElements() / rows;
    ASSERT_EQ(y[0].numElements(), rows) << c.op;
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        // The middle axis: element j of output (b, w) is x[b, j, w].
        int64_t at = middle ? (r / 129) * 37 * 129 + j * 129 + r % 129 : r * n + j;
        double v = x.data<float>()[at];
        sum += c.squares ? v * v : v;
      }
      float want = float(std::string(c.op) == "ReduceMean" ? sum / n : sum);
      ASSERT_EQ(y[0].data<float>()[r], want) << c.op << " output " << r;
    }
  }
}
