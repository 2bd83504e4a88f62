//===- CpuKernelsTest.cpp - Hand-checked cases for the CPU kernels ------===//
//
// Cases the ONNX node tests do not pin down: MatMul batch broadcasting, Conv
// with groups, asymmetric pads, strides and dilations against a naive loop,
// Softmax's opset-dependent axis rule, LayerNormalization and
// SoftmaxCrossEntropyLoss numbers worked out by hand, Gelu, attribute-vs-input
// forms across opsets, half-precision storage, TensorProto round trips, and
// the errors for an unsupported op and mismatched element types. The
// onnxruntime contrib ops are ContribKernelsTest's.
//
//===----------------------------------------------------------------------===//
#include "CpuKernelTestUtil.h"
#include "KernelTestUtil.h"
#include "ops/OpRegistry.h"
#include "runtime/cpu/Kernels.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

using namespace pipec::cpu;
using namespace pipec::test::kernels;

namespace {

//===----------------------------------------------------------------------===//
// MatMul and Gemm
//===----------------------------------------------------------------------===//

TEST(CpuKernels, MatMulBroadcastsBatchDimensions) {
  // A [2,1,2,3] x B [3,3,2]: batch [2,1] and [3] broadcast to [2,3].
  Tensor a = randomTensor({2, 1, 2, 3}, 1), b = randomTensor({3, 3, 2}, 2);
  auto out = run(NodeBuilder("MatMul", 2), {&a, &b});
  ASSERT_EQ(out.size(), 1u);
  ASSERT_EQ(out[0].shape(), (std::vector<int64_t>{2, 3, 2, 2}));
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t r = 0; r < 2; ++r)
        for (int64_t c = 0; c < 2; ++c) {
          double sum = 0;
          for (int64_t p = 0; p < 3; ++p)
            sum += a.data<float>()[(i * 2 + r) * 3 + p] * b.data<float>()[(j * 3 + p) * 2 + c];
          EXPECT_NEAR(out[0].data<float>()[((i * 3 + j) * 2 + r) * 2 + c], sum, 1e-5);
        }
}

TEST(CpuKernels, MatMulVectorOperandsLoseTheirDimension) {
  Tensor m = Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor v = Tensor::fromValues<float>({3}, {1, 0, -1});
  Tensor w = Tensor::fromValues<float>({2}, {1, 1});
  auto mv = run(NodeBuilder("MatMul", 2), {&m, &v});
  expectClose(mv[0], Tensor::fromValues<float>({2}, {-2, -2}));
  auto wm = run(NodeBuilder("MatMul", 2), {&w, &m});
  expectClose(wm[0], Tensor::fromValues<float>({3}, {5, 7, 9}));
}

TEST(CpuKernels, MatMulSharedWeightAndIntegers) {
  // [2,2,2] x [2,1]: one weight for the whole batch (folded into one GEMM).
  Tensor a = Tensor::fromValues<int64_t>({2, 2, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  Tensor b = Tensor::fromValues<int64_t>({2, 1}, {10, 1});
  auto out = run(NodeBuilder("MatMul", 2), {&a, &b});
  expectClose(out[0], Tensor::fromValues<int64_t>({2, 2, 1}, {12, 34, 56, 78}));
  Tensor af = randomTensor({2, 4, 3}, 3), bf = randomTensor({3, 5}, 4);
  auto folded = run(NodeBuilder("MatMul", 2), {&af, &bf});
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t c = 0; c < 5; ++c) {
      double sum = 0;
      for (int64_t p = 0; p < 3; ++p)
        sum += af.data<float>()[i * 3 + p] * bf.data<float>()[p * 5 + c];
      EXPECT_NEAR(folded[0].data<float>()[i * 5 + c], sum, 1e-5);
    }
}

TEST(CpuKernels, GemmTransposesScalesAndBroadcastsC) {
  Tensor a = Tensor::fromValues<float>({3, 2}, {1, 4, 2, 5, 3, 6}); // A^T = [[1,2,3],[4,5,6]]
  Tensor b = Tensor::fromValues<float>({2, 3}, {1, 0, 1, 0, 1, 0}); // B^T = [[1,0],[0,1],[1,0]]
  Tensor c = Tensor::fromValues<float>({2}, {10, 20});
  auto out = run(NodeBuilder("Gemm", 3)
                     .attr("transA", int64_t(1))
                     .attr("transB", int64_t(1))
                     .attr("alpha", 2.0f)
                     .attr("beta", 0.5f),
                 {&a, &b, &c});
  // A^T B^T = [[4, 2], [10, 5]]; times 2 plus 0.5 * [10, 20].
  expectClose(out[0], Tensor::fromValues<float>({2, 2}, {13, 14, 25, 20}));
}

// A node the executor runs again keeps what its kernel parsed of its
// attributes (OpContext::parsed, one ParsedAttrs per prepared node): each
// run gives the node's own numbers, and another node with its own
// ParsedAttrs reads its own attributes, not the first node's.
TEST(CpuKernels, GemmKeepsItsParsedAttributesPerNode) {
  Tensor a = Tensor::fromValues<float>({2, 2}, {1, 2, 3, 4});
  Tensor b = Tensor::fromValues<float>({2, 2}, {1, 0, 1, 1}); // B^T = [[1, 1], [0, 1]]
  Tensor c = Tensor::fromValues<float>({2}, {10, 20});
  NodeBuilder scaled =
      NodeBuilder("Gemm", 3).attr("transB", int64_t(1)).attr("alpha", 2.0f).attr("beta", 0.5f);
  NodeBuilder plain("Gemm", 3);
  pipec::ParsedAttrs scaledKept, plainKept;
  for (int runs = 0; runs < 2; ++runs) {
    // A B^T = [[1, 3], [3, 7]]: times 2, plus 0.5 * [10, 20].
    auto out = runOp(scaled.node, 17, {&a, &b, &c}, nullptr, &scaledKept);
    ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
    expectClose((*out)[0], Tensor::fromValues<float>({2, 2}, {7, 16, 11, 24}));
    // A B = [[3, 2], [7, 4]], plus [10, 20].
    out = runOp(plain.node, 17, {&a, &b, &c}, nullptr, &plainKept);
    ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
    expectClose((*out)[0], Tensor::fromValues<float>({2, 2}, {13, 22, 17, 24}));
  }
}

TEST(CpuKernels, ParsedReadsOnceWhereTheNodeKeepsIt) {
  NodeBuilder node = NodeBuilder("Gemm", 2).attr("alpha", 3.0f);
  int reads = 0;
  auto alpha = [&](const pipec::OpContext &ctx) {
    return ctx.parsed<float>([&] {
      ++reads;
      return ctx.attrFloat("alpha", 1.0f);
    });
  };
  pipec::ParsedAttrs kept;
  pipec::OpContext withKept(node.node, 17, {}, nullptr, &kept), without(node.node, 17, {});
  EXPECT_EQ(alpha(withKept), 3.0f);
  EXPECT_EQ(alpha(withKept), 3.0f);
  EXPECT_EQ(reads, 1);
  EXPECT_EQ(alpha(without), 3.0f);
  EXPECT_EQ(alpha(without), 3.0f);
  EXPECT_EQ(reads, 3);
}

//===----------------------------------------------------------------------===//
// Conv
//===----------------------------------------------------------------------===//

/// Direct 2-D convolution, the definition written out.
Tensor naiveConv2d(const Tensor &x, const Tensor &w, const Tensor &bias, int64_t group,
                   std::array<int64_t, 2> stride, std::array<int64_t, 4> pads,
                   std::array<int64_t, 2> dilation) {
  int64_t n = x.dim(0), c = x.dim(1), h = x.dim(2), wd = x.dim(3);
  int64_t m = w.dim(0), cg = w.dim(1), kh = w.dim(2), kw = w.dim(3);
  int64_t oh = (h + pads[0] + pads[2] - dilation[0] * (kh - 1) - 1) / stride[0] + 1;
  int64_t ow = (wd + pads[1] + pads[3] - dilation[1] * (kw - 1) - 1) / stride[1] + 1;
  Tensor y(DType::F32, {n, m, oh, ow});
  for (int64_t b = 0; b < n; ++b)
    for (int64_t f = 0; f < m; ++f) {
      int64_t g = f / (m / group);
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          double sum = bias.data<float>()[f];
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t p = 0; p < kh; ++p)
              for (int64_t q = 0; q < kw; ++q) {
                int64_t yy = i * stride[0] - pads[0] + p * dilation[0];
                int64_t xx = j * stride[1] - pads[1] + q * dilation[1];
                if (yy < 0 || yy >= h || xx < 0 || xx >= wd)
                  continue;
                sum += x.data<float>()[((b * c + g * cg + ci) * h + yy) * wd + xx] *
                       w.data<float>()[((f * cg + ci) * kh + p) * kw + q];
              }
          y.data<float>()[((b * m + f) * oh + i) * ow + j] = static_cast<float>(sum);
        }
    }
  return y;
}

TEST(CpuKernels, ConvWithGroupsPadsStridesDilationsMatchesNaiveLoop) {
  Tensor x = randomTensor({2, 4, 7, 6}, 5), w = randomTensor({6, 2, 3, 2}, 6);
  Tensor bias = randomTensor({6}, 7);
  auto out = run(NodeBuilder("Conv", 3)
                     .attr("group", int64_t(2))
                     .attr("pads", std::vector<int64_t>{1, 0, 2, 1})
                     .attr("strides", std::vector<int64_t>{2, 1})
                     .attr("dilations", std::vector<int64_t>{1, 2}),
                 {&x, &w, &bias});
  Tensor expected = naiveConv2d(x, w, bias, 2, {2, 1}, {1, 0, 2, 1}, {1, 2});
  ASSERT_EQ(out[0].shape(), expected.shape());
  expectClose(out[0], expected, 1e-5, 1e-5);
}

TEST(CpuKernels, DepthwiseAndPointwiseConv) {
  Tensor x = randomTensor({1, 3, 5, 5}, 8), zeros3(DType::F32, {3});
  Tensor depthwise = randomTensor({3, 1, 3, 3}, 9);
  auto dw = run(NodeBuilder("Conv", 2).attr("group", int64_t(3)).attr("auto_pad", "SAME_UPPER"),
                {&x, &depthwise});
  expectClose(dw[0], naiveConv2d(x, depthwise, zeros3, 3, {1, 1}, {1, 1, 1, 1}, {1, 1}), 1e-5,
              1e-5);
  Tensor pointwise = randomTensor({2, 3, 1, 1}, 10), zeros2(DType::F32, {2});
  auto pw = run(NodeBuilder("Conv", 2), {&x, &pointwise});
  expectClose(pw[0], naiveConv2d(x, pointwise, zeros2, 1, {1, 1}, {0, 0, 0, 0}, {1, 1}), 1e-5,
              1e-5);
}

TEST(CpuKernels, Conv1dIsConv2dWithHeightOne) {
  Tensor x = randomTensor({2, 2, 9}, 11), w = randomTensor({3, 2, 3}, 12);
  Tensor bias = randomTensor({3}, 13);
  auto out = run(NodeBuilder("Conv", 3)
                     .attr("pads", std::vector<int64_t>{2, 1})
                     .attr("strides", std::vector<int64_t>{2}),
                 {&x, &w, &bias});
  Tensor expected = naiveConv2d(x.reshaped({2, 2, 1, 9}), w.reshaped({3, 2, 1, 3}), bias, 1, {1, 2},
                                {0, 2, 0, 1}, {1, 1});
  expectClose(out[0], expected.reshaped({2, 3, expected.dim(3)}), 1e-5, 1e-5);
}

//===----------------------------------------------------------------------===//
// Softmax, LayerNormalization, losses, activations
//===----------------------------------------------------------------------===//

TEST(CpuKernels, SoftmaxAxisRuleDependsOnOpset) {
  // ln 1, ln 3, ln 1, ln 3 on [2,2]: along axis 0 every column is {1, 1}.
  float l3 = std::log(3.0f);
  Tensor x = Tensor::fromValues<float>({2, 2}, {0, l3, 0, l3});
  auto axis0 = run(NodeBuilder("Softmax", 1).attr("axis", int64_t(0)), {&x}, 13);
  expectClose(axis0[0], Tensor::fromValues<float>({2, 2}, {0.5f, 0.5f, 0.5f, 0.5f}));
  auto last = run(NodeBuilder("Softmax", 1), {&x}, 13);
  expectClose(last[0], Tensor::fromValues<float>({2, 2}, {0.25f, 0.75f, 0.25f, 0.75f}));
  // Opset 11 flattens at axis 0: one softmax over all four values.
  auto flat = run(NodeBuilder("Softmax", 1).attr("axis", int64_t(0)), {&x}, 11);
  expectClose(flat[0], Tensor::fromValues<float>({2, 2}, {0.125f, 0.375f, 0.125f, 0.375f}));
  auto logFlat = run(NodeBuilder("LogSoftmax", 1).attr("axis", int64_t(0)), {&x}, 11);
  expectClose(logFlat[0], Tensor::fromValues<float>({2, 2}, {std::log(0.125f), std::log(0.375f),
                                                             std::log(0.125f), std::log(0.375f)}));
}

TEST(CpuKernels, LayerNormalizationNumbers) {
  // Rows [1,2,3] and [4,6,8]: means 2 and 6, variances 2/3 and 8/3, so the
  // normalized rows are both [-sqrt(1.5), 0, sqrt(1.5)].
  Tensor x = Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 6, 8});
  Tensor scale = Tensor::fromValues<float>({3}, {1, 2, 0.5f});
  Tensor bias = Tensor::fromValues<float>({3}, {0, 1, -1});
  auto out =
      run(NodeBuilder("LayerNormalization", 3, 3).attr("epsilon", 0.0f), {&x, &scale, &bias});
  ASSERT_EQ(out.size(), 3u);
  float r = std::sqrt(1.5f);
  expectClose(out[0],
              Tensor::fromValues<float>({2, 3}, {-r, 1, 0.5f * r - 1, -r, 1, 0.5f * r - 1}));
  expectClose(out[1], Tensor::fromValues<float>({2, 1}, {2, 6}));
  expectClose(out[2], Tensor::fromValues<float>({2, 1}, {r, std::sqrt(3.0f / 8)}));
}

TEST(CpuKernels, LayerNormalizationOverTwoAxesWithoutBias) {
  Tensor x = Tensor::fromValues<float>({1, 2, 2}, {0, 2, 4, 6}); // mean 3, var 5
  Tensor scale = Tensor::fromValues<float>({2, 2}, {1, 1, 1, 1});
  auto out =
      run(NodeBuilder("LayerNormalization", 2).attr("axis", int64_t(1)).attr("epsilon", 0.0f),
          {&x, &scale});
  float s = 1 / std::sqrt(5.0f);
  expectClose(out[0], Tensor::fromValues<float>({1, 2, 2}, {-3 * s, -s, s, 3 * s}));
}

TEST(CpuKernels, SoftmaxCrossEntropyLossWithIgnoreIndex) {
  // Row 0: logits [0, ln 3], label 0: p = 1/4, loss ln 4.
  // Row 1: logits [0, 0],    label 1: p = 1/2, loss ln 2.
  // Row 2: label -100 is ignored.
  float l3 = std::log(3.0f), ln2 = std::log(2.0f);
  Tensor scores = Tensor::fromValues<float>({3, 2}, {0, l3, 0, 0, 5, -5});
  Tensor labels = Tensor::fromValues<int64_t>({3}, {0, 1, -100});
  auto mean = run(NodeBuilder("SoftmaxCrossEntropyLoss", 2, 2).attr("ignore_index", int64_t(-100)),
                  {&scores, &labels}, 13);
  expectClose(mean[0], Tensor::scalar(1.5f * ln2));
  EXPECT_NEAR(mean[1].data<float>()[0], std::log(0.25f), 1e-6); // log_prob output
  auto none = run(NodeBuilder("SoftmaxCrossEntropyLoss", 2)
                      .attr("ignore_index", int64_t(-100))
                      .attr("reduction", "none"),
                  {&scores, &labels}, 13);
  expectClose(none[0], Tensor::fromValues<float>({3}, {2 * ln2, ln2, 0}));
  // Class weights [1, 3]: the mean divides by the weight of the kept labels.
  Tensor weights = Tensor::fromValues<float>({2}, {1, 3});
  auto weighted = run(NodeBuilder("SoftmaxCrossEntropyLoss", 3).attr("ignore_index", int64_t(-100)),
                      {&scores, &labels, &weights}, 13);
  expectClose(weighted[0], Tensor::scalar(5 * ln2 / 4));
  auto sum = run(NodeBuilder("SoftmaxCrossEntropyLoss", 3)
                     .attr("ignore_index", int64_t(-100))
                     .attr("reduction", "sum"),
                 {&scores, &labels, &weights}, 13);
  expectClose(sum[0], Tensor::scalar(5 * ln2));
}

TEST(CpuKernels, SoftmaxCrossEntropyLossRejectsOutOfRangeLabels) {
  Tensor scores = Tensor::fromValues<float>({1, 2}, {0, 0});
  Tensor labels = Tensor::fromValues<int64_t>({1}, {2});
  EXPECT_EQ(errorOf(NodeBuilder("SoftmaxCrossEntropyLoss", 2).name("loss"), {&scores, &labels}),
            "node 'loss' (SoftmaxCrossEntropyLoss): label 2 is out of range for 2 classes");
}

TEST(CpuKernels, GeluExactAndTanh) {
  Tensor x = Tensor::fromValues<float>({3}, {-1, 0, 2});
  auto exact = run(NodeBuilder("Gelu", 1), {&x}, 20);
  // 0.5 x (1 + erf(x / sqrt 2)).
  expectClose(exact[0], Tensor::fromValues<float>({3}, {-0.158655254f, 0, 1.95449974f}));
  auto tanh = run(NodeBuilder("Gelu", 1).attr("approximate", "tanh"), {&x}, 20);
  expectClose(tanh[0], Tensor::fromValues<float>({3}, {-0.158808009f, 0, 1.95459769f}));
}

// The reference: onnxruntime 1.32 (CPUExecutionProvider) on a Mish-18 node,
// at inputs spanning the saturation regions of softplus.
TEST(CpuKernels, MishMatchesOnnxReference) {
  Tensor x = Tensor::fromValues<float>({9}, {-10, -2.5f, -1, -0.1f, 0, 0.3f, 1, 2.5f, 10});
  auto y = run(NodeBuilder("Mish", 1), {&x}, 18);
  expectClose(y[0], Tensor::fromValues<float>({9}, {-0.000453988934f, -0.196816191f, -0.30340144f,
                                                    -0.0567885749f, 0, 0.20800139f, 0.865098476f,
                                                    2.47139239f, 10}));
}

//===----------------------------------------------------------------------===//
// Attributes that became inputs
//===----------------------------------------------------------------------===//

TEST(CpuKernels, AxesFromAttributeOrInputByOpset) {
  Tensor x = Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor axes = Tensor::fromValues<int64_t>({1}, {0});
  auto v11 = run(NodeBuilder("Unsqueeze", 1).attr("axes", std::vector<int64_t>{0, -1}), {&x}, 11);
  EXPECT_EQ(v11[0].shape(), (std::vector<int64_t>{1, 2, 3, 1}));
  auto v13 = run(NodeBuilder("Unsqueeze", 2), {&x, &axes}, 13);
  EXPECT_EQ(v13[0].shape(), (std::vector<int64_t>{1, 2, 3}));
  auto sum11 = run(NodeBuilder("ReduceSum", 1).attr("axes", std::vector<int64_t>{0}), {&x}, 11);
  expectClose(sum11[0], Tensor::fromValues<float>({1, 3}, {5, 7, 9}));
  auto sum13 = run(NodeBuilder("ReduceSum", 2).attr("keepdims", int64_t(0)), {&x, &axes}, 13);
  expectClose(sum13[0], Tensor::fromValues<float>({3}, {5, 7, 9}));
  auto split11 = run(
      NodeBuilder("Split", 1, 2).attr("axis", int64_t(1)).attr("split", std::vector<int64_t>{1, 2}),
      {&x}, 11);
  expectClose(split11[1], Tensor::fromValues<float>({2, 2}, {2, 3, 5, 6}));
  Tensor sizes = Tensor::fromValues<int64_t>({2}, {2, 1});
  auto split13 = run(NodeBuilder("Split", 2, 2).attr("axis", int64_t(1)), {&x, &sizes}, 13);
  expectClose(split13[0], Tensor::fromValues<float>({2, 2}, {1, 2, 4, 5}));
}

TEST(CpuKernels, LegacyBroadcastAlignsAtAxisBeforeOpset7) {
  Tensor a(DType::F32, {2, 3, 2});
  Tensor b = Tensor::fromValues<float>({3}, {1, 2, 3});
  auto out = run(NodeBuilder("Add", 2).attr("broadcast", int64_t(1)).attr("axis", int64_t(1)),
                 {&a, &b}, 6);
  expectClose(out[0], Tensor::fromValues<float>({2, 3, 2}, {1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3}));
}

TEST(CpuKernels, ClipBoundsFromAttributesBeforeOpset11) {
  Tensor x = Tensor::fromValues<float>({4}, {-2, -0.5f, 0.5f, 2});
  auto v6 = run(NodeBuilder("Clip", 1).attr("min", -1.0f).attr("max", 1.0f), {&x}, 6);
  expectClose(v6[0], Tensor::fromValues<float>({4}, {-1, -0.5f, 0.5f, 1}));
  Tensor lo = Tensor::scalar(0.0f);
  auto v13 = run(NodeBuilder("Clip", 2), {&x, &lo}, 13);
  expectClose(v13[0], Tensor::fromValues<float>({4}, {0, 0, 0.5f, 2}));
}

TEST(CpuKernels, SliceWithNegativeStepsAndStartsFromAttributes) {
  Tensor x = Tensor::fromValues<int64_t>({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  Tensor starts = Tensor::fromValues<int64_t>({1}, {-1});
  Tensor ends = Tensor::fromValues<int64_t>({1}, {INT64_MIN});
  Tensor axes = Tensor::fromValues<int64_t>({1}, {1});
  Tensor steps = Tensor::fromValues<int64_t>({1}, {-2});
  auto reversed = run(NodeBuilder("Slice", 5), {&x, &starts, &ends, &axes, &steps}, 13);
  expectClose(reversed[0], Tensor::fromValues<int64_t>({2, 2}, {3, 1, 7, 5}));
  auto v9 = run(NodeBuilder("Slice", 1)
                    .attr("starts", std::vector<int64_t>{1, 1})
                    .attr("ends", std::vector<int64_t>{2, 1000}),
                {&x}, 9);
  expectClose(v9[0], Tensor::fromValues<int64_t>({1, 3}, {5, 6, 7}));
  // An empty dimension read backwards, and a step too large to add to.
  Tensor empty(DType::F32, {0, 3});
  Tensor zero = Tensor::fromValues<int64_t>({1}, {0});
  Tensor back = Tensor::fromValues<int64_t>({1}, {-1});
  auto none = run(NodeBuilder("Slice", 5), {&empty, &back, &ends, &zero, &back}, 13);
  EXPECT_EQ(none[0].shape(), (std::vector<int64_t>{0, 3}));
  Tensor huge = Tensor::fromValues<int64_t>({1}, {INT64_MAX});
  Tensor begin0 = Tensor::fromValues<int64_t>({1}, {0});
  Tensor endMax = Tensor::fromValues<int64_t>({1}, {INT64_MAX});
  auto first = run(NodeBuilder("Slice", 5), {&x, &begin0, &endMax, &axes, &huge}, 13);
  expectClose(first[0], Tensor::fromValues<int64_t>({2, 1}, {0, 4}));
}

TEST(CpuKernels, ReshapeZeroCopiesUnlessAllowZero) {
  Tensor x(DType::F32, {2, 0, 3});
  Tensor shape = Tensor::fromValues<int64_t>({2}, {0, -1});
  auto copied = run(NodeBuilder("Reshape", 2), {&x, &shape}, 14);
  EXPECT_EQ(copied[0].shape(), (std::vector<int64_t>{2, 0}));
  Tensor y(DType::F32, {2, 3});
  Tensor zero = Tensor::fromValues<int64_t>({2}, {0, 3});
  auto kept = run(NodeBuilder("Reshape", 2), {&y, &zero}, 14);
  EXPECT_EQ(kept[0].shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(
      errorOf(NodeBuilder("Reshape", 2).attr("allowzero", int64_t(1)).name("r"), {&y, &zero}, 14),
      "node 'r' (Reshape): cannot reshape float[2,3] to [0,3]");
}

//===----------------------------------------------------------------------===//
// Tensors
//===----------------------------------------------------------------------===//

TEST(CpuTensor, HalfTypesAreStoredAsRoundedFloats) {
  Tensor h = Tensor::fromValues<float>({3}, {1.0f / 3, 65519.0f, 1e-8f}, DType::F16);
  EXPECT_EQ(h.data<float>()[0], 0.333251953125f); // nearest binary16
  EXPECT_TRUE(std::isinf(Tensor::scalar(65520.0f, DType::F16).data<float>()[0]));
  EXPECT_EQ(h.data<float>()[1], 65504.0f);
  EXPECT_EQ(h.data<float>()[2], 0.0f);
  onnx::TensorProto proto = toTensorProto(h, "h");
  EXPECT_EQ(proto.raw_data().size(), 6u);
  auto back = fromTensorProto(proto);
  ASSERT_TRUE(static_cast<bool>(back)) << llvm::toString(back.takeError());
  expectClose(*back, h, 0, 0);
  EXPECT_EQ(floatToBFloat16(1.00390625f), 0x3f80); // a tie rounds to even
  EXPECT_EQ(floatToBFloat16(1.01171875f), 0x3f82);
}

TEST(CpuTensor, CopiesShareStorageAndCloneDoesNot) {
  Tensor a = Tensor::fromValues<float>({2}, {1, 2});
  Tensor shared = a, deep = a.clone();
  a.data<float>()[0] = 5;
  EXPECT_EQ(shared.data<float>()[0], 5);
  EXPECT_EQ(deep.data<float>()[0], 1);
}

TEST(CpuTensor, ReadsTypedFieldsAndExternalData) {
  onnx::TensorProto ints;
  ints.set_name("ints");
  ints.set_data_type(onnx::TensorProto::INT32);
  ints.add_dims(2);
  ints.add_int32_data(-3);
  ints.add_int32_data(7);
  auto t = fromTensorProto(ints);
  ASSERT_TRUE(static_cast<bool>(t)) << llvm::toString(t.takeError());
  expectClose(*t, Tensor::fromValues<int32_t>({2}, {-3, 7}));

  ints.add_int32_data(9);
  EXPECT_EQ(llvm::toString(fromTensorProto(ints).takeError()),
            "tensor 'ints': 3 values for shape [2]");

  std::filesystem::path dir = std::filesystem::path(PIPEC_BINARY_DIR) / "CpuTensorTest";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "weights.bin", std::ios::binary);
    float values[] = {9, 1.5f, -2};
    out.write("pad!", 4);
    out.write(reinterpret_cast<const char *>(values), sizeof(values));
  }
  onnx::TensorProto external;
  external.set_name("w");
  external.set_data_type(onnx::TensorProto::FLOAT);
  external.add_dims(2);
  external.set_data_location(onnx::TensorProto::EXTERNAL);
  for (auto [key, value] : {std::pair<const char *, const char *>{"location", "weights.bin"},
                            {"offset", "8"},
                            {"length", "8"}}) {
    auto *entry = external.add_external_data();
    entry->set_key(key);
    entry->set_value(value);
  }
  auto w = fromTensorProto(external, dir.string());
  ASSERT_TRUE(static_cast<bool>(w)) << llvm::toString(w.takeError());
  expectClose(*w, Tensor::fromValues<float>({2}, {1.5f, -2}));

  onnx::TensorProto strings;
  strings.set_name("s");
  strings.set_data_type(onnx::TensorProto::STRING);
  EXPECT_EQ(llvm::toString(fromTensorProto(strings).takeError()),
            "tensor 's': element type STRING is not supported by the CPU runtime");
}

TEST(CpuTensor, SumToShapeUndoesBroadcasting) {
  Tensor grad = Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  expectClose(sumToShape(grad, {3}), Tensor::fromValues<float>({3}, {5, 7, 9}));
  expectClose(sumToShape(grad, {2, 1}), Tensor::fromValues<float>({2, 1}, {6, 15}));
  expectClose(sumToShape(grad, {}), Tensor::scalar(21.0f));
}

//===----------------------------------------------------------------------===//
// Errors
//===----------------------------------------------------------------------===//

TEST(CpuKernels, UnsupportedOpIsACleanError) {
  Tensor x = Tensor::scalar(1.0f);
  auto outputs = runOp(NodeBuilder("FancyOp", 1).name("fancy").node, 17, {&x});
  ASSERT_FALSE(static_cast<bool>(outputs));
  bool unsupported = false;
  std::string message;
  llvm::handleAllErrors(outputs.takeError(), [&](const UnsupportedError &e) {
    unsupported = true;
    message = e.message();
  });
  EXPECT_TRUE(unsupported);
  EXPECT_EQ(message, "node 'fancy' (FancyOp): no CPU kernel for op FancyOp");
  EXPECT_FALSE(isSupported("FancyOp"));
  EXPECT_TRUE(isSupported("MatMul"));
  EXPECT_FALSE(isSupported("MatMul", "com.microsoft"));

  // Unnamed nodes are named by their first output.
  NodeBuilder unnamed("FancyOp", 1);
  unnamed.node.clear_name();
  EXPECT_EQ(errorOf(unnamed, {&x}), "node 'out0' (FancyOp): no CPU kernel for op FancyOp");
}

TEST(CpuKernels, ElementTypeMismatchIsAnError) {
  Tensor f = Tensor::fromValues<float>({2}, {1, 2});
  Tensor i = Tensor::fromValues<int64_t>({2}, {1, 2});
  EXPECT_EQ(errorOf(NodeBuilder("Add", 2).name("add1"), {&f, &i}),
            "node 'add1' (Add): input element types differ: input 0 is float, input 1 is int64");
  EXPECT_EQ(errorOf(NodeBuilder("Exp", 1).name("e"), {&i}),
            "node 'e' (Exp): element type int64 of input 0");
}

TEST(CpuKernels, MalformedInputsAreErrorsNotCrashes) {
  Tensor a = Tensor::fromValues<int32_t>({2}, {4, 2}),
         zero = Tensor::fromValues<int32_t>({2}, {1, 0});
  EXPECT_EQ(errorOf(NodeBuilder("Div", 2).name("d"), {&a, &zero}),
            "node 'd' (Div): integer division by zero");
  Tensor m = randomTensor({2, 3}, 14), n = randomTensor({2, 3}, 15);
  EXPECT_EQ(errorOf(NodeBuilder("MatMul", 2).name("mm"), {&m, &n}),
            "node 'mm' (MatMul): inner dimensions differ: float[2,3] x float[2,3]");
  Tensor data = randomTensor({3}, 16), index = Tensor::fromValues<int64_t>({1}, {3});
  EXPECT_EQ(errorOf(NodeBuilder("Gather", 2).name("g"), {&data, &index}),
            "node 'g' (Gather): index 3 is out of range for dimension 0 of size 3");
  EXPECT_EQ(errorOf(NodeBuilder("Add", 2).name("a"), {&m}),
            "node 'a' (Add): missing required input 1");
  Tensor b = randomTensor({4}, 17);
  EXPECT_EQ(errorOf(NodeBuilder("Add", 2).name("a"), {&m, &b}),
            "node 'a' (Add): shapes [2,3] and [4] do not broadcast");
  // INT_MIN / -1 traps on x86 unless handled; it wraps like numpy.
  Tensor lowest = Tensor::scalar<int32_t>(INT32_MIN), minusOne = Tensor::scalar<int32_t>(-1);
  auto wrapped = run(NodeBuilder("Div", 2), {&lowest, &minusOne});
  EXPECT_EQ(wrapped[0].data<int32_t>()[0], INT32_MIN);
}

/// Every kernel, fed inputs of the wrong types, shapes and counts and odd
/// attributes, returns a value or an error: it never crashes or asserts.
TEST(CpuKernels, EveryOpSurvivesOddInputs) {
  std::vector<std::function<void(NodeBuilder &)>> attributeSets = {
      [](NodeBuilder &) {},
      [](NodeBuilder &b) {
        b.attr("axis", int64_t(-1)).attr("keepdims", int64_t(0));
        b.attr("select_last_index", int64_t(1));
      },
      [](NodeBuilder &b) { b.attr("axis", int64_t(9)).attr("group", int64_t(3)); },
      [](NodeBuilder &b) {
        b.attr("kernel_shape", std::vector<int64_t>{2, 2});
        b.attr("strides", std::vector<int64_t>{2, 2});
        b.attr("pads", std::vector<int64_t>{1, 1, 1, 1}).attr("ceil_mode", int64_t(1));
        b.attr("group", int64_t(2));
      },
      [](NodeBuilder &b) {
        b.attr("perm", std::vector<int64_t>{1, 0}).attr("axes", std::vector<int64_t>{0});
        b.attr("split", std::vector<int64_t>{1, 1}).attr("starts", std::vector<int64_t>{0});
        b.attr("ends", std::vector<int64_t>{-1}).attr("pads", std::vector<int64_t>{-1, 0});
      },
      [](NodeBuilder &b) {
        b.attr("to", int64_t(16)).attr("reduction", "sum").attr("ignore_index", int64_t(0));
        b.attr("approximate", "tanh").attr("auto_pad", "SAME_LOWER");
        b.attr("kernel_shape", std::vector<int64_t>{3});
      },
      // The contrib ops' attributes.
      [](NodeBuilder &b) {
        b.attr("num_heads", int64_t(1)).attr("unidirectional", int64_t(1));
        b.attr("interleaved", int64_t(1)).attr("scale", 0.5f);
      },
      [](NodeBuilder &b) {
        b.attr("num_heads", int64_t(3)).attr("rotary_embedding_dim", int64_t(-2));
        b.attr("qkv_hidden_sizes", std::vector<int64_t>{-1, 2, 2});
      },
  };
  std::vector<Tensor> candidates = {
      randomTensor({2, 3}, 18),
      Tensor::fromValues<int64_t>({3}, {1, 0, -1}),
      Tensor::fromValues<bool>({2}, {true, false}),
      Tensor::scalar(0.5f),
      Tensor(DType::F32, {0}),
      Tensor::fromValues<int32_t>({2, 3}, {0, 1, 2, 3, 4, 5}),
      Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 5, 6}, DType::F16),
      randomTensor({1, 2, 3, 3}, 19),
  };
  // Every op the registry gives a CPU kernel, pipec's own included.
  std::vector<std::pair<std::string, std::string>> ops;
  for (const pipec::OpDef &def : pipec::allOps())
    if (def.hasCpuKernel)
      ops.emplace_back(def.domainName().str(), def.name.str());
  int runs = 0, ran = 0;
  for (const auto &[domain, op] : ops) {
    for (size_t n = 0; n <= 5; ++n) {
      size_t combos = n == 0 ? 1 : candidates.size() * (n == 1 ? 1 : candidates.size());
      for (size_t c = 0; c < combos; ++c) {
        std::vector<const Tensor *> inputs;
        for (size_t i = 0; i < n; ++i)
          inputs.push_back(&candidates[i == 0 ? c % candidates.size() : c / candidates.size()]);
        for (const auto &setAttributes : attributeSets)
          for (int outputs = 1; outputs <= 3; outputs += 2) {
            NodeBuilder node(op, static_cast<int>(n), outputs);
            node.node.set_domain(domain);
            setAttributes(node);
            for (int64_t opset : {9, 17}) {
              auto result = runOp(node.node, opset, inputs);
              if (result)
                ++ran;
              else
                llvm::consumeError(result.takeError());
              ++runs;
            }
          }
      }
    }
  }
  // Both sides were reached: kernels ran on what they accept and refused
  // the rest, with errors rather than crashes.
  EXPECT_GT(runs, 1000);
  EXPECT_GT(ran, 100);
  EXPECT_GT(runs - ran, 100);
}

} // namespace
