//===- IndexingKernelsTest.cpp - Edge cases of the indexing kernels -------===//
//
// What ONNX's node tests leave out for GatherND, ScatterElements, ScatterND,
// Pad, CumSum, Trilu and Einsum: batch_dims 2, max and min with repeated
// indices on integers, reflect and wrap pads longer than the dimension,
// negative pads with edge mode, int32 wrap-around, float16 partial sums,
// Einsum's broadcast ellipsis, diagonals, implicit outputs and three
// operands; TopK's order of ties and NaN, on integers and along the first
// axis; the errors for malformed nodes and forms of older opsets; and
// Transpose's register blocks against a plain loop.
//
// Expected values come from onnxruntime 1.23's CPU provider, or from
// ONNX's reference evaluator / numpy where noted (the oracles venv of
// tools/oracles.sh), not from pipec.
//
//===----------------------------------------------------------------------===//
#include "tests/KernelTestUtil.h"

#include <array>
#include <cstring>
#include <limits>

using namespace pipec;
using namespace pipec::test;

namespace {

/// The error message of running \p node, or "no error".
std::string errorOf(const onnx::NodeProto &node, const std::vector<Tensor> &inputs,
                    int64_t opset = 18) {
  auto out = cpu::runOp(node, opset, pointers(inputs));
  return out ? "no error" : llvm::toString(out.takeError());
}

Tensor f32(const Shape &shape, std::vector<float> v) {
  return Tensor::fromValues<float>(shape, llvm::ArrayRef<float>(v));
}

Tensor i64(const Shape &shape, std::vector<int64_t> v) {
  return Tensor::fromValues<int64_t>(shape, llvm::ArrayRef<int64_t>(v));
}

Tensor i32(const Shape &shape, std::vector<int32_t> v) {
  return Tensor::fromValues<int32_t>(shape, llvm::ArrayRef<int32_t>(v));
}

std::vector<float> iota(int64_t n, float scale = 1, float shift = 0) {
  std::vector<float> v;
  for (int64_t i = 0; i < n; ++i)
    v.push_back(static_cast<float>(i) / scale + shift);
  return v;
}

// The last two dimensions swapped, through 8 x 8 register blocks and the
// scalar edges: every element lands where a plain loop puts it, float and
// int32 alike (moved, never computed on: NaN payloads too).
TEST(IndexingKernels, TransposeLastTwoInBlocks) {
  for (auto [batch, rows, cols] :
       {std::array<int64_t, 3>{3, 37, 45}, {2, 64, 128}, {1, 8, 8}, {4, 5, 70}, {1, 130, 9}}) {
    std::vector<int32_t> values(batch * rows * cols);
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = int32_t(i * 2654435761u);
    Tensor ints = Tensor::fromValues<int32_t>({batch, rows, cols}, values, DType::I32);
    std::vector<float> floats(values.size());
    std::memcpy(floats.data(), values.data(), values.size() * 4);
    Tensor fl = Tensor::fromValues<float>({batch, rows, cols}, floats);
    Tensor ti = cpu::transpose(ints, {0, 2, 1}), tf = cpu::transpose(fl, {0, 2, 1});
    ASSERT_EQ(ti.shape(), (std::vector<int64_t>{batch, cols, rows}));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          int64_t from = (b * rows + i) * cols + j, to = (b * cols + j) * rows + i;
          ASSERT_EQ(ti.data<int32_t>()[to], values[from]) << b << " " << i << " " << j;
          ASSERT_EQ(std::memcmp(tf.data<float>() + to, floats.data() + from, 4), 0);
        }
  }
}

TEST(IndexingKernels, GatherNDWithTwoBatchDimensions) {
  Tensor data = f32({2, 2, 3, 2}, iota(24));
  Tensor indices = i64({2, 2, 2, 1}, {1, 0, 2, 1, 0, 2, 1, 1});
  auto out = runCpu(NodeBuilder("GatherND", 2).i("batch_dims", 2), {data, indices});
  ASSERT_EQ(out.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(
      close(out[0], f32({2, 2, 2, 2}, {2, 3, 0, 1, 10, 11, 8, 9, 12, 13, 16, 17, 20, 21, 20, 21})));
}

TEST(IndexingKernels, ScatterElementsMaxAndMinWithRepeatedIndices) {
  Tensor data = i32({2, 3}, {1, 5, 3, 4, 2, 6});
  Tensor updates = i32({2, 3}, {7, -1, 2, 9, 8, 0});
  auto max = runCpu(NodeBuilder("ScatterElements", 3).i("axis", 0).s("reduction", "max"),
                    {data, i64({2, 3}, {1, 1, 0, 1, -1, 0}), updates}, 18);
  auto min = runCpu(NodeBuilder("ScatterElements", 3).i("axis", 1).s("reduction", "min"),
                    {data, i64({2, 3}, {1, 1, 1, 0, 0, 2}), updates}, 18);
  ASSERT_EQ(max.size(), 1u);
  ASSERT_EQ(min.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(close(max[0], i32({2, 3}, {1, 5, 3, 9, 8, 6})));
  EXPECT_TRUE(close(min[0], i32({2, 3}, {1, -1, 3, 4, 2, 0})));
}

TEST(IndexingKernels, ScatterNDReductionsCombineRepeatedTuples) {
  Tensor data = f32({2, 2, 2}, iota(8, 1, 1));
  Tensor indices = i64({3, 2}, {1, 0, 1, 0, 0, -1});
  Tensor updates = f32({3, 2}, {2, 3, 4, 5, -1, 0.5f});
  auto mul = runCpu(NodeBuilder("ScatterND", 3).s("reduction", "mul"), {data, indices, updates});
  auto add = runCpu(NodeBuilder("ScatterND", 3).s("reduction", "add"), {data, indices, updates});
  ASSERT_EQ(mul.size(), 1u);
  ASSERT_EQ(add.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(close(mul[0], f32({2, 2, 2}, {1, 2, -3, 2, 40, 90, 7, 8})));
  EXPECT_TRUE(close(add[0], f32({2, 2, 2}, {1, 2, 2, 4.5f, 11, 14, 7, 8})));
}

TEST(IndexingKernels, PadReflectAndWrapBeyondTheDimension) {
  Tensor x = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  auto reflect = runCpu(NodeBuilder("Pad", 2).s("mode", "reflect"), {x, i64({4}, {0, 5, 1, 4})});
  auto wrap = runCpu(NodeBuilder("Pad", 2).s("mode", "wrap"), {x, i64({4}, {1, 4, 2, -1})}, 19);
  ASSERT_EQ(reflect.size(), 1u);
  ASSERT_EQ(wrap.size(), 1u);
  // ONNX's reference evaluator (numpy's pad; onnxruntime refuses reflect
  // pads this long).
  EXPECT_TRUE(
      close(reflect[0], f32({3, 12}, {2, 1, 2, 3, 2, 1, 2, 3, 2, 1, 2, 3, 5, 4, 5, 6, 5, 4,
                                      5, 6, 5, 4, 5, 6, 2, 1, 2, 3, 2, 1, 2, 3, 2, 1, 2, 3})));
  // onnxruntime.
  EXPECT_TRUE(close(wrap[0], f32({5, 6}, {4, 5, 4, 5, 4, 5, 1, 2, 1, 2, 1, 2, 4, 5, 4,
                                          5, 4, 5, 1, 2, 1, 2, 1, 2, 4, 5, 4, 5, 4, 5})));
}

TEST(IndexingKernels, PadNegativePadsCrop) {
  Tensor x = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  auto edge = runCpu(NodeBuilder("Pad", 2).s("mode", "edge"), {x, i64({4}, {0, -1, 1, 2})});
  auto constant =
      runCpu(NodeBuilder("Pad", 3), {x, i64({4}, {-1, 2, 0, -1}), Tensor::scalar(7.5f)});
  // Opset 18's axes input, negative.
  auto axes = runCpu(NodeBuilder("Pad", 4),
                     {x, i64({2}, {2, 1}), Tensor::scalar(-1.0f), i64({1}, {-1})}, 18);
  ASSERT_EQ(edge.size(), 1u);
  ASSERT_EQ(constant.size(), 1u);
  ASSERT_EQ(axes.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(close(edge[0], f32({3, 4}, {2, 3, 3, 3, 5, 6, 6, 6, 5, 6, 6, 6})));
  EXPECT_TRUE(close(constant[0], f32({1, 4}, {7.5f, 7.5f, 4, 5})));
  EXPECT_TRUE(close(axes[0], f32({2, 6}, {-1, -1, 1, 2, 3, -1, -1, -1, 4, 5, 6, -1})));
}

TEST(IndexingKernels, PadOpset2TakesAttributes) {
  Tensor x = Tensor::fromValues<double>({2, 2}, {1, 2, 3, 4});
  auto out = runCpu(NodeBuilder("Pad", 1).ints("pads", {1, 0, 0, 1}).f("value", 9), {x}, 2);
  ASSERT_EQ(out.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(close(out[0], Tensor::fromValues<double>({3, 3}, {9, 9, 9, 1, 2, 9, 3, 4, 9})));
}

TEST(IndexingKernels, CumSumFloat16RoundsEachPartialSum) {
  Tensor x = Tensor::fromValues<float>({2, 4}, {0.1f, 0.2f, 0.3f, 1000, 1.5f, 2.5f, -3.5f, 0.001f},
                                       DType::F16);
  auto out =
      runCpu(NodeBuilder("CumSum", 2).i("exclusive", 1).i("reverse", 1), {x, i64({}, {1})}, 14);
  ASSERT_EQ(out.size(), 1u);
  // ONNX's reference evaluator: numpy rounds every partial sum to float16
  // (onnxruntime adds in float and gets -0.9990234375 for element 4).
  Tensor expected = Tensor::fromValues<float>(
      {2, 4}, {1000.5f, 1000.5f, 1000, 0, -0.998046875f, -3.498046875f, 0.0010004043579101562f, 0},
      DType::F16);
  EXPECT_TRUE(close(out[0], expected, 0, 0));
}

TEST(IndexingKernels, CumSumInt32Wraps) {
  auto out = runCpu(NodeBuilder("CumSum", 2), {i32({3}, {2147483647, 1, 5}), i32({}, {-1})}, 14);
  ASSERT_EQ(out.size(), 1u);
  // ONNX's reference evaluator (numpy's cumsum).
  EXPECT_TRUE(close(out[0], i32({3}, {2147483647, -2147483647 - 1, -2147483643})));
}

TEST(IndexingKernels, TriluDiagonalOffsets) {
  Tensor x = i64({3, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  auto lower = runCpu(NodeBuilder("Trilu", 2).i("upper", 0), {x, i64({}, {-1})}, 14);
  auto upper = runCpu(NodeBuilder("Trilu", 2), {x, i64({}, {2})}, 14);
  ASSERT_EQ(lower.size(), 1u);
  ASSERT_EQ(upper.size(), 1u);
  // onnxruntime.
  EXPECT_TRUE(close(lower[0], i64({3, 4}, {0, 0, 0, 0, 5, 0, 0, 0, 9, 10, 0, 0})));
  EXPECT_TRUE(close(upper[0], i64({3, 4}, {0, 0, 3, 4, 0, 0, 0, 8, 0, 0, 0, 0})));
}

TEST(IndexingKernels, EinsumBroadcastsTheEllipsis) {
  Tensor a = f32({2, 1, 2, 3}, iota(12, 4)), b = f32({3, 3, 2}, iota(18, 3, -2));
  auto out = runCpu(NodeBuilder("Einsum", 2).s("equation", "...ij,...jk->...ik"), {a, b}, 12);
  ASSERT_EQ(out.size(), 1u);
  // numpy's einsum.
  EXPECT_TRUE(close(
      out[0], f32({2, 3, 2, 2},
                  {-0.6666666f, -0.4166667f, -3.6666665f, -2.6666667f, 0.8333333f, 1.0833334f,
                   2.3333333f,  3.3333335f,  2.3333335f,  2.5833333f,  8.333334f,  9.333333f,
                   -6.666666f,  -4.916667f,  -9.666666f,  -7.166667f,  3.8333333f, 5.5833335f,
                   5.3333335f,  7.833333f,   14.333334f,  16.083332f,  20.333332f, 22.833332f})));
}

TEST(IndexingKernels, EinsumDiagonalsAndImplicitOutputs) {
  Tensor m = f32({3, 3}, iota(9));
  Tensor v = f32({3}, {1, 2, 3}), w = f32({3}, {4, -5, 6});
  Tensor c = Tensor::fromValues<double>({2, 3}, {0, 1, 2, 3, 4, 5});
  std::vector<double> dValues;
  for (int i = 0; i < 12; ++i)
    dValues.push_back(i - 5);
  Tensor d = Tensor::fromValues<double>({3, 4}, llvm::ArrayRef<double>(dValues));
  Tensor e = Tensor::fromValues<double>({4}, {1, 0, -1, 2});
  Tensor t = Tensor(DType::I32, {2, 3, 4});
  for (int i = 0; i < 24; ++i)
    t.data<int32_t>()[i] = i;
  auto einsum = [](const char *equation, std::vector<Tensor> inputs) {
    auto out = runCpu(
        NodeBuilder("Einsum", static_cast<int>(inputs.size())).s("equation", equation), inputs, 12);
    return out.empty() ? Tensor() : out[0];
  };
  // numpy's einsum.
  EXPECT_TRUE(close(einsum("ii->i", {m}), f32({3}, {0, 4, 8})));
  EXPECT_TRUE(close(einsum("ii", {m}), f32({}, {12})));
  EXPECT_TRUE(close(einsum("i,i", {v, w}), f32({}, {12})));
  EXPECT_TRUE(close(einsum("ij,jk", {c, d}),
                    Tensor::fromValues<double>({2, 4}, {5, 8, 11, 14, -4, 8, 20, 32})));
  EXPECT_TRUE(close(einsum("ijk->ki", {t}), i32({4, 2}, {12, 48, 15, 51, 18, 54, 21, 57})));
  EXPECT_TRUE(close(einsum("...ii", {f32({2, 3, 3}, iota(18))}), f32({2}, {12, 39})));
  EXPECT_TRUE(close(einsum("ij,jk,k->i", {c, d, e}), Tensor::fromValues<double>({2}, {22, 40})));
}

TEST(IndexingKernels, TopKTiesTakeTheLowerIndexFirst) {
  auto topK = [](const Tensor &x, int64_t k, int64_t largest, int64_t axis = -1) {
    return runCpu(NodeBuilder("TopK", 2, 2).i("largest", largest).i("axis", axis),
                  {x, i64({1}, {k})}, 11);
  };
  // onnxruntime.
  auto largest = topK(f32({4}, {3, 1, 3, 2}), 2, 1);
  ASSERT_EQ(largest.size(), 2u);
  EXPECT_TRUE(close(largest[0], f32({2}, {3, 3})));
  EXPECT_TRUE(close(largest[1], i64({2}, {0, 2})));
  auto smallest = topK(f32({4}, {3, 1, 3, 2}), 2, 0);
  ASSERT_EQ(smallest.size(), 2u);
  EXPECT_TRUE(close(smallest[0], f32({2}, {1, 2})));
  EXPECT_TRUE(close(smallest[1], i64({2}, {1, 3})));
  // NaN ranks above every number, for largest and smallest alike.
  float nan = std::numeric_limits<float>::quiet_NaN();
  auto nanLargest = topK(f32({4}, {1, nan, 3, nan}), 3, 1);
  ASSERT_EQ(nanLargest.size(), 2u);
  EXPECT_TRUE(std::isnan(nanLargest[0].getDouble(0)) && std::isnan(nanLargest[0].getDouble(1)));
  EXPECT_EQ(nanLargest[0].getDouble(2), 3);
  EXPECT_TRUE(close(nanLargest[1], i64({3}, {1, 3, 2})));
  auto nanSmallest = topK(f32({4}, {1, nan, 3, nan}), 3, 0);
  ASSERT_EQ(nanSmallest.size(), 2u);
  EXPECT_TRUE(close(nanSmallest[1], i64({3}, {0, 2, 1})));
  // Along the first axis, on integers.
  auto columns = topK(i32({2, 3}, {3, 1, 3, 2, 5, 3}), 1, 1, 0);
  ASSERT_EQ(columns.size(), 2u);
  EXPECT_TRUE(close(columns[0], i32({1, 3}, {3, 5, 3})));
  EXPECT_TRUE(close(columns[1], i64({1, 3}, {0, 1, 0})));
  auto rows = topK(i64({2, 3}, {3, 1, 3, 2, 5, 1}), 2, 0, 1);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(close(rows[0], i64({2, 2}, {1, 3, 1, 2})));
  EXPECT_TRUE(close(rows[1], i64({2, 2}, {1, 0, 2, 0})));
  // Opset 1: k is an attribute, largest is the only order.
  auto attr = runCpu(NodeBuilder("TopK", 1, 2).i("k", 1), {f32({2, 2}, {1, 4, 3, 2})}, 9);
  ASSERT_EQ(attr.size(), 2u);
  EXPECT_TRUE(close(attr[0], f32({2, 1}, {4, 3})));
  EXPECT_TRUE(close(attr[1], i64({2, 1}, {1, 0})));
}

TEST(IndexingKernels, MalformedNodesFail) {
  Tensor x = f32({2, 3}, iota(6));
  EXPECT_NE(errorOf(NodeBuilder("GatherElements", 2), {x, i64({1, 3}, {0, 2, 1})}).find("index 2"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("GatherND", 2), {x, i64({1, 3}, {0, 0, 0})}).find("do not fit"),
            std::string::npos);
  // max and min arrived in opset 18, add and mul in 16; Scatter has none.
  EXPECT_NE(errorOf(NodeBuilder("ScatterElements", 3).s("reduction", "max"),
                    {x, i64({1, 1}, {0}), f32({1, 1}, {1})}, 16)
                .find("needs opset 18"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("ScatterND", 3).s("reduction", "add"),
                    {x, i64({1, 1}, {0}), f32({1, 3}, {1, 2, 3})}, 13)
                .find("needs opset 16"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("ScatterND", 3), {x, i64({1, 1}, {0}), f32({1, 2}, {1, 2})})
                .find("must have shape"),
            std::string::npos);
  // wrap arrived in opset 19.
  EXPECT_NE(errorOf(NodeBuilder("Pad", 2).s("mode", "wrap"), {x, i64({4}, {1, 1, 1, 1})})
                .find("unknown mode"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("Pad", 2), {x, i64({4}, {0, -4, 0, 0})}).find("crop more"),
            std::string::npos);
  EXPECT_NE(
      errorOf(NodeBuilder("Einsum", 2).s("equation", "ij,jk->iq"), {x, f32({3, 2}, iota(6))}, 12)
          .find("no input"),
      std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("Einsum", 1).s("equation", "ijk"), {x}, 12).find("does not fit"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("TopK", 2, 2), {x, i64({1}, {4})}, 11).find("out of range"),
            std::string::npos);
  EXPECT_NE(errorOf(NodeBuilder("TopK", 2, 2), {x, i64({2}, {1, 1})}, 11).find("one element"),
            std::string::npos);
}

} // namespace
