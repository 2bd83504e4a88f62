//===- KernelBodiesTest.cpp - The device's kernel bodies on the host -----===//
//
// The per-element functions of runtime/kernels (the bodies every CUDA kernel
// loops around) run here on the host, one lane per row, against the CPU
// kernels: the index math, broadcasting, reductions, row algorithms and
// fused programs are checked on every machine, GPU or not. The element-wise
// cases come from the registry: every op with element math.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include "ops/OpRegistry.h"
#include "runtime/core/Backend.h"
#include "runtime/core/OpContext.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/Window.h"
#include "runtime/kernels/KernelBodies.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

using namespace pipec;
using namespace pipec::test;
namespace k = kernels;

namespace {

TEST(GpuKernelBodies, IndexMapMergesContiguousDimensions) {
  k::IndexMap map;
  Shape shape{2, 3, 4};
  ASSERT_TRUE(k::makeIndexMap(shape, {k::contiguousStrides(shape)}, map));
  EXPECT_EQ(map.rank, 1);
  EXPECT_EQ(map.shape[0], 24);
  // [3, 1] broadcast to [2, 3, 4]: dimension 0 and 2 read with stride 0.
  ASSERT_TRUE(k::makeIndexMap(shape, {k::broadcastStrides(Shape{3, 1}, shape)}, map));
  for (int64_t i = 0; i < 24; ++i)
    EXPECT_EQ(k::offsetOf(map, 0, i), (i / 4) % 3) << "index " << i;
  // A transpose keeps both dimensions.
  ASSERT_TRUE(k::makeIndexMap({4, 6}, {{1, 4}}, map));
  EXPECT_EQ(map.rank, 2);
  EXPECT_EQ(k::offsetOf(map, 0, 7), 1 * 1 + 1 * 4);
  // Too many dimensions after merging.
  Shape deep(9, 2);
  Shape odd(9, 0);
  for (size_t d = 0; d < odd.size(); ++d)
    odd[d] = int64_t(1) << (2 * d); // never contiguous
  EXPECT_FALSE(k::makeIndexMap(deep, {odd}, map));
}

/// The element-wise rows of the registry whose math maps floats to floats,
/// of \p arity inputs.
std::vector<const OpDef *> floatMathOps(int arity) {
  std::vector<const OpDef *> ops;
  for (const OpDef &def : allOps())
    if (def.elem && def.minInputs == arity && k::isFloatMath(*def.elem))
      ops.push_back(&def);
  return ops;
}

/// Every binary float op's body over broadcast operands against its CPU
/// kernel.
TEST(GpuKernelBodies, BroadcastArithmeticMatchesCpu) {
  const std::pair<Shape, Shape> shapes[] = {
      {{2, 3, 4}, {4}}, {{2, 1, 4}, {3, 1}}, {{1}, {5, 2}}, {{2, 3}, {2, 3}}, {{}, {3}}};
  std::vector<const OpDef *> ops = floatMathOps(2);
  ASSERT_GE(ops.size(), 5u);
  for (const auto &[aShape, bShape] : shapes)
    for (const OpDef *def : ops) {
      Tensor a = floats(aShape, 0.5f, 2), b = floats(bShape, 0.5f, 2);
      Tensor expected = runCpu(NodeBuilder(def->name.str(), 2), {a, b})[0];
      k::IndexMap map;
      ASSERT_TRUE(k::makeIndexMap(expected.shape(),
                                  {k::broadcastStrides(aShape, expected.shape()),
                                   k::broadcastStrides(bShape, expected.shape())},
                                  map));
      Tensor actual(DType::F32, expected.shape());
      for (int64_t i = 0; i < actual.numElements(); ++i)
        k::arithmeticElement<float>(i, *def->elem, map, a.data<float>(), b.data<float>(),
                                    actual.data<float>());
      EXPECT_TRUE(close(actual, expected, 0, 0))
          << def->name.str() << " " << cpu::shapeString(aShape) << " " << cpu::shapeString(bShape);
    }
}

TEST(GpuKernelBodies, WhereAndComparisonsMatchCpu) {
  Tensor cond = bools({2, 1, 4}), x = floats({3, 4}), y = floats({});
  Tensor expected = runCpu(NodeBuilder("Where", 3), {cond, x, y})[0];
  k::IndexMap map;
  llvm::ArrayRef<int64_t> shape = expected.shape();
  ASSERT_TRUE(k::makeIndexMap(shape,
                              {k::broadcastStrides(cond.shape(), shape),
                               k::broadcastStrides(x.shape(), shape),
                               k::broadcastStrides(y.shape(), shape)},
                              map));
  Tensor actual(DType::F32, shape);
  for (int64_t i = 0; i < actual.numElements(); ++i)
    k::whereElement<uint32_t>(i, map, cond.data<bool>(), static_cast<const uint32_t *>(x.rawData()),
                              static_cast<const uint32_t *>(y.rawData()),
                              static_cast<uint32_t *>(actual.rawData()));
  EXPECT_TRUE(close(actual, expected));

  Tensor a = int64s({3, 4}, 0, 2), b = int64s({4}, 0, 2);
  Tensor equal = runCpu(NodeBuilder("Equal", 2), {a, b})[0];
  ASSERT_TRUE(k::makeIndexMap(equal.shape(),
                              {k::broadcastStrides(a.shape(), equal.shape()),
                               k::broadcastStrides(b.shape(), equal.shape())},
                              map));
  Tensor got(DType::Bool, equal.shape());
  for (int64_t i = 0; i < got.numElements(); ++i)
    k::compareElement<int64_t>(i, ElemOp::Equal, map, a.data<int64_t>(), b.data<int64_t>(),
                               got.data<bool>());
  EXPECT_TRUE(close(got, equal));
}

/// A strided read of \p x as the backend sets it up: a transpose, a slice
/// or a broadcast.
Tensor stridedRead(const Tensor &x, const Shape &shape, const Shape &strides, int64_t base) {
  k::IndexMap map;
  EXPECT_TRUE(k::makeIndexMap(shape, {strides}, map, {base}));
  Tensor out(x.elemType(), shape);
  for (int64_t i = 0; i < out.numElements(); ++i)
    k::copyElement<uint32_t>(i, map, static_cast<const uint32_t *>(x.rawData()),
                             static_cast<uint32_t *>(out.rawData()));
  return out;
}

TEST(GpuKernelBodies, StridedCopiesMatchCpu) {
  Tensor x = floats({2, 3, 4, 5});
  Shape in = k::contiguousStrides(x.shape());
  for (const Shape &perm : {Shape{0, 1, 3, 2}, Shape{3, 0, 2, 1}, Shape{1, 0, 2, 3}}) {
    Shape shape(4), strides(4);
    for (int d = 0; d < 4; ++d) {
      shape[d] = x.dim(perm[d]);
      strides[d] = in[perm[d]];
    }
    EXPECT_TRUE(close(stridedRead(x, shape, strides, 0),
                      runCpu(NodeBuilder("Transpose", 1).ints("perm", perm), {x})[0]))
        << cpu::shapeString(perm);
  }
  // Slice [1:3] on axis 1 and [4:0:-2] on axis 3.
  Tensor expected =
      runCpu(NodeBuilder("Slice", 5), {x, int64s({2}, {1, 4}), int64s({2}, {3, 0}),
                                       int64s({2}, {1, -1}), int64s({2}, {1, -2})})[0];
  EXPECT_TRUE(
      close(stridedRead(x, {2, 2, 4, 2}, {in[0], in[1], in[2], -2 * in[3]}, 1 * in[1] + 4 * in[3]),
            expected));
  Tensor small = floats({3, 1});
  EXPECT_TRUE(
      close(stridedRead(small, {2, 3, 4}, k::broadcastStrides(Shape{3, 1}, Shape{2, 3, 4}), 0),
            runCpu(NodeBuilder("Expand", 2), {small, int64s({3}, {2, 3, 4})})[0]));
}

/// Both reduction passes, with few threads so that every output has several
/// chunks, against ReduceSum.
TEST(GpuKernelBodies, ReductionsMatchCpu) {
  Tensor x = floats({6, 70, 9});
  for (const Shape &axes : {Shape{0}, Shape{1}, Shape{2}, Shape{0, 2}, Shape{1, 2}, Shape{0, 1, 2}})
    for (int64_t threads : {int64_t(1) << 17, int64_t(16)}) {
      std::vector<bool> reduced(3, false);
      for (int64_t a : axes)
        reduced[a] = true;
      k::ReducePlan plan;
      ASSERT_TRUE(k::makeReducePlan(x.shape(), reduced, plan, threads));
      std::vector<double> partial(plan.outputs * plan.chunks);
      for (int64_t t = 0; t < plan.outputs * plan.chunks; ++t)
        k::reducePartialElement<float>(t, plan, x.data<float>(), partial.data());
      Tensor expected = runCpu(NodeBuilder("ReduceSum", 2).i("keepdims", 1),
                               {x, int64s({(int64_t)axes.size()}, axes)})[0];
      Tensor actual(DType::F32, expected.shape());
      for (int64_t o = 0; o < plan.outputs; ++o)
        k::reduceFinishElement<float>(o, plan.outputs, plan.chunks, partial.data(), 1.0,
                                      actual.data<float>());
      EXPECT_TRUE(close(actual, expected))
          << "axes " << cpu::shapeString(axes) << ", " << plan.chunks << " chunks"
          << (plan.interleaved ? ", interleaved" : "");
    }
}

TEST(GpuKernelBodies, SoftmaxRowsMatchCpu) {
  k::SerialLanes lanes;
  Tensor x = floats({3, 5, 4}, -4, 4);
  for (int64_t axis : {0, 1, 2})
    for (bool logarithm : {false, true}) {
      Tensor expected =
          runCpu(NodeBuilder(logarithm ? "LogSoftmax" : "Softmax", 1).i("axis", axis), {x})[0];
      k::RowLayout layout{
          cpu::numElementsOf(llvm::ArrayRef<int64_t>(x.shape()).take_front(axis)), x.dim(axis),
          cpu::numElementsOf(llvm::ArrayRef<int64_t>(x.shape()).drop_front(axis + 1))};
      Tensor actual(DType::F32, x.shape());
      for (int64_t r = 0; r < k::rowCount(layout); ++r)
        k::softmaxRow(lanes, r, layout, x.data<float>(), actual.data<float>(), logarithm);
      EXPECT_TRUE(close(actual, expected)) << "axis " << axis;

      Tensor dy = floats(x.shape());
      Tensor grad =
          runCpu(NodeBuilder("SoftmaxGrad", 2, 1, "pipec").i("axis", axis), {dy, expected})[0];
      Tensor got(DType::F32, x.shape());
      for (int64_t r = 0; r < k::rowCount(layout); ++r)
        k::softmaxGradRow<float>(lanes, r, layout, dy.data<float>(), expected.data<float>(),
                                 got.data<float>());
      if (!logarithm) {
        EXPECT_TRUE(close(got, grad)) << "axis " << axis;
      }
    }
}

TEST(GpuKernelBodies, LayerNormRowsMatchCpu) {
  k::SerialLanes lanes;
  Tensor x = floats({4, 3, 8}, -2, 3), scale = floats({3, 8}), bias = floats({3, 8});
  auto expected = runCpu(NodeBuilder("LayerNormalization", 3, 3).i("axis", 1).f("epsilon", 1e-3f),
                         {x, scale, bias});
  int64_t rows = 4, size = 24;
  Tensor y(DType::F32, x.shape()), mean(DType::F32, {4, 1, 1}), invStd(DType::F32, {4, 1, 1});
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormRow<float>(lanes, r, size, 1e-3f, x.data<float>(), scale.data<float>(),
                           bias.data<float>(), y.data<float>(), mean.data<float>(),
                           invStd.data<float>());
  EXPECT_TRUE(close(y, expected[0]));
  EXPECT_TRUE(close(mean, expected[1]));
  EXPECT_TRUE(close(invStd, expected[2]));

  Tensor dy = floats(x.shape());
  Tensor dx =
      runCpu(NodeBuilder("LayerNormGradInput", 3, 1, "pipec").i("axis", 1).f("epsilon", 1e-3f),
             {dy, x, scale})[0];
  Tensor gotDx(DType::F32, x.shape());
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormGradInputRow<float>(lanes, r, size, 1e-3f, dy.data<float>(), x.data<float>(),
                                    scale.data<float>(), gotDx.data<float>());
  EXPECT_TRUE(close(gotDx, dx));

  Tensor dScale = runCpu(NodeBuilder("LayerNormGradWeight", 2, 1, "pipec")
                             .i("axis", 1)
                             .f("epsilon", 1e-3f)
                             .ints("shape", {3, 8}),
                         {dy, x})[0];
  std::vector<float> mu(rows), rstd(rows);
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormStatsRow<float>(lanes, r, size, 1e-3f, x.data<float>(), mu.data(), rstd.data());
  int64_t chunks = 3, chunkLength = 2; // rows 0-1, 2-3, none
  std::vector<double> partial(size * chunks);
  for (int64_t t = 0; t < size * chunks; ++t)
    k::layerNormGradWeightPartial<float>(t, rows, size, chunkLength, dy.data<float>(),
                                         x.data<float>(), mu.data(), rstd.data(), partial.data());
  Tensor gotScale(DType::F32, {3, 8});
  for (int64_t o = 0; o < size; ++o)
    k::reduceFinishElement<float>(o, size, chunks, partial.data(), 1.0, gotScale.data<float>());
  EXPECT_TRUE(close(gotScale, dScale));
}

TEST(GpuKernelBodies, CrossEntropyRowsMatchCpu) {
  k::SerialLanes lanes;
  for (const Shape &shape : {Shape{6, 10}, Shape{2, 5, 3}})
    for (const char *reduction : {"mean", "sum", "none"})
      for (bool ignore : {false, true}) {
        Tensor scores = floats(shape, -3, 3);
        Shape labelShape{shape[0]};
        labelShape.insert(labelShape.end(), shape.begin() + 2, shape.end());
        Tensor labels = int64s(labelShape, 0, shape[1] - 1);
        labels.data<int64_t>()[1] = 2;
        NodeBuilder node("SoftmaxCrossEntropyLoss", 2, 2);
        node.s("reduction", reduction);
        if (ignore)
          node.i("ignore_index", 2);
        auto expected = runCpu(node, {scores, labels});
        k::CrossEntropyParams p;
        p.reduction = std::string(reduction) == "none"  ? 0
                      : std::string(reduction) == "sum" ? 1
                                                        : 2;
        p.hasIgnore = ignore;
        p.ignoreIndex = 2;
        k::RowLayout layout{shape[0], shape[1],
                            cpu::numElementsOf(llvm::ArrayRef<int64_t>(shape).drop_front(2))};
        int64_t positions = k::rowCount(layout);
        Tensor logProb(DType::F32, shape), losses(DType::F32, labelShape);
        std::vector<float> valid(positions);
        int flag = 0;
        for (int64_t r = 0; r < positions; ++r)
          k::crossEntropyRow(lanes, r, layout, p, scores.data<float>(), labels.data<int64_t>(),
                             logProb.data<float>(), losses.data<float>(), valid.data(), &flag);
        EXPECT_EQ(flag, 0);
        EXPECT_TRUE(close(logProb, expected[1]));
        if (p.reduction == 0) {
          EXPECT_TRUE(close(losses, expected[0]));
        } else {
          Tensor loss(DType::F32, {});
          k::crossEntropyFinish(lanes, positions, p.reduction == 2, losses.data<float>(),
                                valid.data(), loss.data<float>());
          EXPECT_TRUE(close(loss, expected[0])) << reduction << (ignore ? " ignoring" : "");

          NodeBuilder gradNode("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec");
          gradNode.s("reduction", reduction);
          if (ignore)
            gradNode.i("ignore_index", 2);
          Tensor dLoss = Tensor::scalar(0.75f);
          Tensor dx = runCpu(gradNode, {dLoss, scores, labels})[0];
          double count = 0;
          k::labelCount(lanes, positions, p, labels.data<int64_t>(), &count);
          Tensor got(DType::F32, shape);
          for (int64_t r = 0; r < positions; ++r)
            k::crossEntropyGradRow(lanes, r, layout, p, dLoss.data<float>(), &count,
                                   scores.data<float>(), labels.data<int64_t>(), got.data<float>(),
                                   &flag);
          EXPECT_TRUE(close(got, dx)) << reduction << (ignore ? " ignoring" : "");
        }
      }
}

/// Whether \p a and \p b hold the same bits.
::testing::AssertionResult sameBits(const Tensor &a, const Tensor &b) {
  if (a.shape() != b.shape() || a.elemType() != b.elemType())
    return ::testing::AssertionFailure() << a.describe() << " against " << b.describe();
  if (std::memcmp(a.rawData(), b.rawData(), a.numElements() * cpu::storageSize(a.elemType())))
    return ::testing::AssertionFailure() << "the bits differ";
  return ::testing::AssertionSuccess();
}

/// The CPU kernels are loops around the bodies, not copies of them: each
/// row kernel's output is the body's in the CPU's configuration
/// (VectorLanes, double element arithmetic), bit for bit, on rows long
/// enough to take the vector lanes and their tails.
TEST(GpuKernelBodies, CpuKernelsRunTheBodies) {
  cpu::VectorLanes lanes;
  int64_t rows = 3, size = 37;
  Tensor x = floats({rows, size}, -4, 4), dy = floats({rows, size}), scale = floats({size}),
         bias = floats({size});
  k::RowLayout layout{rows, size, 1};
  for (bool logarithm : {false, true}) {
    Tensor y = runCpu(NodeBuilder(logarithm ? "LogSoftmax" : "Softmax", 1), {x})[0];
    Tensor got(DType::F32, x.shape());
    for (int64_t r = 0; r < rows; ++r)
      k::softmaxRow(lanes, r, layout, x.data<float>(), got.data<float>(), logarithm);
    EXPECT_TRUE(sameBits(got, y)) << (logarithm ? "LogSoftmax" : "Softmax");
  }
  Tensor probs = runCpu(NodeBuilder("Softmax", 1), {x})[0];
  Tensor dx = runCpu(NodeBuilder("SoftmaxGrad", 2, 1, "pipec").i("axis", 1), {dy, probs})[0];
  Tensor gotDx(DType::F32, x.shape());
  for (int64_t r = 0; r < rows; ++r)
    k::softmaxGradRow<double>(lanes, r, layout, dy.data<float>(), probs.data<float>(),
                              gotDx.data<float>());
  EXPECT_TRUE(sameBits(gotDx, dx)) << "SoftmaxGrad";

  Tensor norm = runCpu(NodeBuilder("LayerNormalization", 3).i("axis", 1).f("epsilon", 1e-3f),
                       {x, scale, bias})[0];
  Tensor gotNorm(DType::F32, x.shape());
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormRow<double>(lanes, r, size, double(1e-3f), x.data<float>(), scale.data<float>(),
                            bias.data<float>(), gotNorm.data<float>(),
                            static_cast<double *>(nullptr), static_cast<double *>(nullptr));
  EXPECT_TRUE(sameBits(gotNorm, norm)) << "LayerNormalization";

  Tensor labels = int64s({rows}, {3, 0, 36});
  Tensor dScores =
      runCpu(NodeBuilder("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec").s("reduction", "mean"),
             {Tensor::scalar(0.75f), x, labels})[0];
  k::CrossEntropyParams p;
  double count = double(rows);
  float dLoss = 0.75f;
  int flag = 0;
  Tensor gotScores(DType::F32, x.shape());
  for (int64_t r = 0; r < rows; ++r)
    k::crossEntropyGradRow(lanes, r, layout, p, &dLoss, &count, x.data<float>(),
                           labels.data<int64_t>(), gotScores.data<float>(), &flag);
  EXPECT_TRUE(sameBits(gotScores, dScores)) << "SoftmaxCrossEntropyLossGrad";
}

TEST(GpuKernelBodies, GatherAndItsGradientMatchCpu) {
  Tensor data = floats({3, 5, 2});
  Tensor indices = int64s({2, 2}, {4, -1, 0, 4});
  for (int64_t axis : {0, 1}) {
    Tensor idx = axis == 0 ? int64s({2, 2}, {2, -1, 0, 2}) : indices;
    Tensor expected = runCpu(NodeBuilder("Gather", 2).i("axis", axis), {data, idx})[0];
    k::GatherParams p;
    p.outer = axis == 0 ? 1 : 3;
    p.size = data.dim(axis);
    p.inner = axis == 0 ? 10 : 2;
    p.count = 4;
    Tensor actual(DType::F32, expected.shape());
    int flag = 0;
    for (int64_t o = 0; o < actual.numElements(); ++o)
      k::gatherElement<uint32_t, int64_t>(o, p, static_cast<const uint32_t *>(data.rawData()),
                                          idx.data<int64_t>(),
                                          static_cast<uint32_t *>(actual.rawData()), &flag);
    EXPECT_EQ(flag, 0);
    EXPECT_TRUE(close(actual, expected)) << "axis " << axis;

    Tensor dy = floats(expected.shape());
    Tensor dData =
        runCpu(NodeBuilder("GatherGrad", 2, 1, "pipec").i("axis", axis).ints("shape", data.shape()),
               {dy, idx})[0];
    Tensor got(DType::F32, data.shape());
    for (int64_t i = 0; i < dy.numElements(); ++i)
      k::gatherGradElement<float, int64_t>(i, p, dy.data<float>(), idx.data<int64_t>(),
                                           got.data<float>(), &flag);
    EXPECT_EQ(flag, 0);
    EXPECT_TRUE(close(got, dData)) << "axis " << axis;
  }
  // Out of range: flagged, and a zero instead of a wild read.
  k::GatherParams p{1, 5, 1, 2};
  int64_t bad = 7;
  float out[2] = {1, 1};
  int flag = 0;
  k::gatherElement<float, int64_t>(0, p, data.data<float>(), &bad, out, &flag);
  EXPECT_EQ(flag, 1);
  EXPECT_EQ(out[0], 0.0f);
}

/// True if \p t holds a NaN (an input outside the op's domain).
bool hasNan(const Tensor &t) {
  for (int64_t i = 0; i < t.numElements(); ++i)
    if (std::isnan(t.data<float>()[i]))
      return true;
  return false;
}

/// Every unary float op's body, and its gradient's (UnaryGrad), against
/// the CPU kernels, bit for bit: one math for both. Inputs in (0.25, 0.9)
/// and (1.1, 3) cover every op's domain.
TEST(GpuKernelBodies, UnaryPointwiseAndCastsMatchCpu) {
  std::vector<const OpDef *> ops = floatMathOps(1);
  ASSERT_GE(ops.size(), 30u);
  Tensor dy = floats({64});
  int compared = 0;
  for (const OpDef *def : ops)
    for (auto [lo, hi] : {std::pair<float, float>{0.25f, 0.9f}, {1.1f, 3.0f}, {-3.0f, -0.2f}}) {
      Tensor in = floats({64}, lo, hi);
      onnx::NodeProto node = NodeBuilder(def->name.str(), 1);
      Tensor expected = runCpu(node, {in})[0];
      if (hasNan(expected))
        continue;
      // The attributes' defaults, read as the kernels read them.
      auto read = OpContext(node, 17, {}).elemParams(*def->elem);
      ASSERT_TRUE(!!read) << llvm::toString(read.takeError());
      k::ElemParams params = *read;
      Tensor actual(DType::F32, in.shape());
      for (int64_t i = 0; i < in.numElements(); ++i)
        k::unaryElement(i, *def->elem, params, in.data<float>(), actual.data<float>());
      EXPECT_TRUE(close(actual, expected, 0, 0)) << def->name.str();
      if (k::elemGradFrom(*def->elem) == k::GradFrom::None)
        continue;
      const Tensor &a = k::elemGradFrom(*def->elem) == k::GradFrom::Output ? expected : in;
      Tensor grad =
          runCpu(NodeBuilder("UnaryGrad", 2, 1, "pipec").s("op", def->name.str()), {dy, a})[0];
      Tensor got(DType::F32, in.shape());
      for (int64_t i = 0; i < in.numElements(); ++i)
        k::gradientElement(i, *def->elem, params, dy.data<float>(), a.data<float>(),
                           got.data<float>());
      EXPECT_TRUE(close(got, grad, 0, 0)) << def->name.str() << " gradient";
      ++compared;
    }
  EXPECT_GE(compared, 40);
  Tensor odd = Tensor::fromValues<float>({6}, {1.7f, -2.5f, NAN, 1e30f, -1e30f, 0.0f});
  Tensor expected = castTo(odd, DType::I64);
  Tensor actual(DType::I64, {6});
  for (int64_t i = 0; i < 6; ++i)
    k::castElement<float, int64_t>(i, odd.data<float>(), actual.data<int64_t>());
  EXPECT_TRUE(close(actual, expected));
  Tensor flags(DType::Bool, {6});
  for (int64_t i = 0; i < 6; ++i)
    k::castElement<float, bool>(i, odd.data<float>(), flags.data<bool>());
  EXPECT_TRUE(close(flags, castTo(odd, DType::Bool)));
}

TEST(GpuKernelBodies, OptimizerMatchesCpuBackend) {
  for (int kind : {0, 1, 2}) {
    Tensor w = floats({50}), wRef = w.clone();
    Tensor m(DType::F32, {50}), v(DType::F32, {50}), mRef = m.clone(), vRef = v.clone();
    for (int step = 0; step < 3; ++step) {
      Tensor g = floats({50});
      rt::OptimizerUpdate u = optimizerUpdate(kind, step);
      referenceUpdate(u, wRef, g, mRef, vRef);
      k::OptimizerParams p = rt::optimizerParams(u);
      Tensor wOut(DType::F32, {50}), mOut(DType::F32, {50}), vOut(DType::F32, {50});
      for (int64_t i = 0; i < 50; ++i)
        k::optimizerElement<float>(i, p, w.data<float>(), g.data<float>(), m.data<float>(),
                                   v.data<float>(), wOut.data<float>(), mOut.data<float>(),
                                   vOut.data<float>());
      w = wOut;
      if (kind >= 1)
        m = mOut;
      if (kind == 2)
        v = vOut;
    }
    EXPECT_TRUE(close(w, wRef, 1e-6, 1e-6)) << "kind " << kind;
    // SGD keeps no moments; momentum one, AdamW two.
    if (kind >= 1) {
      EXPECT_TRUE(close(m, mRef, 1e-6, 1e-7)) << "kind " << kind;
    }
    if (kind == 2) {
      EXPECT_TRUE(close(v, vRef, 1e-6, 1e-9)) << "kind " << kind;
    }
  }
}

/// Row-major C = op(A) op(B) + beta C, summed in double: the host stand-in
/// for the backend's cuBLAS calls.
void hostGemm(bool transA, bool transB, int64_t m, int64_t n, int64_t kk, const float *a,
              int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < kk; ++p)
        acc += double(transA ? a[p * lda + i] : a[i * lda + p]) *
               double(transB ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = static_cast<float>(acc + double(beta) * c[i * ldc + j]);
    }
}

TEST(GpuKernelBodies, ConvAndItsGradientsMatchCpu) {
  const WindowCase cases[] = {
      {{2, 4, 7, 6}, {3, 3}, {2, 1}, {1, 2}, {1, 0, 2, 1}, 2},
      {{3, 3, 5, 5}, {2, 3}, {1, 1}, {1, 1}, {0, 1, 1, 0}, 1},
      {{2, 6, 4, 4}, {1, 1}, {1, 1}, {1, 1}, {0, 0, 0, 0}, 3}, // identity columns
      {{2, 2, 9}, {3}, {2}, {2}, {1, 1}, 1},                   // 1-D
  };
  for (const WindowCase &c : cases) {
    int64_t batch = c.x[0], channels = c.x[1], maps = 2 * c.group, gc = channels / c.group;
    Shape wShape{maps, gc};
    wShape.insert(wShape.end(), c.kernel.begin(), c.kernel.end());
    Tensor x = floats(c.x), weight = floats(wShape), bias = floats({maps});
    NodeBuilder convNode("Conv", 3);
    withWindow(convNode, c).i("group", c.group);
    Tensor expected = runCpu(convNode, {x, weight, bias})[0];

    k::Im2colParams p;
    ASSERT_TRUE(
        k::makeConvWindow(spatial(c.x), c.kernel, c.strides, c.dilations, c.pads, false, p.w));
    p.images = batch * c.group, p.channels = gc, p.group = c.group;
    int64_t rows = p.rows(), cols = p.w.outSize(), gm = maps / c.group;
    ASSERT_EQ(expected.numElements(), batch * maps * cols);
    std::vector<float> columns(p.images * rows * cols);
    for (int64_t t = 0; t < int64_t(columns.size()); ++t)
      k::im2colElement(t, p, x.data<float>(), columns.data());
    Tensor y(DType::F32, expected.shape());
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t g = 0; g < c.group; ++g)
        hostGemm(false, false, gm, cols, rows, weight.data<float>() + g * gm * rows, rows,
                 columns.data() + (n * c.group + g) * rows * cols, cols, 0.0f,
                 y.data<float>() + (n * maps + g * gm) * cols, cols);
    for (int64_t i = 0; i < y.numElements(); ++i)
      k::biasElement(i, maps, cols, bias.data<float>(), y.data<float>());
    EXPECT_TRUE(close(y, expected)) << "Conv over " << cpu::shapeString(c.x);

    Tensor dy = floats(expected.shape());
    NodeBuilder gradInput("ConvGradInput", 2, 1, "pipec");
    withWindow(gradInput, c).i("group", c.group).ints("shape", c.x);
    Tensor dxExpected = runCpu(gradInput, {dy, weight})[0];
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t g = 0; g < c.group; ++g)
        hostGemm(true, false, rows, cols, gm, weight.data<float>() + g * gm * rows, rows,
                 dy.data<float>() + (n * maps + g * gm) * cols, cols, 0.0f,
                 columns.data() + (n * c.group + g) * rows * cols, cols);
    Tensor dx(DType::F32, c.x);
    for (int64_t i = 0; i < dx.numElements(); ++i)
      k::col2imElement(i, p, columns.data(), dx.data<float>());
    EXPECT_TRUE(close(dx, dxExpected)) << "ConvGradInput over " << cpu::shapeString(c.x);

    NodeBuilder gradWeight("ConvGradWeight", 2, 1, "pipec");
    withWindow(gradWeight, c).i("group", c.group).ints("shape", wShape);
    Tensor dwExpected = runCpu(gradWeight, {dy, x})[0];
    p.batchInner = true;
    for (int64_t t = 0; t < int64_t(columns.size()); ++t)
      k::im2colElement(t, p, x.data<float>(), columns.data());
    // dY as [group, gm, batch, cols], as the backend's copy lays it out.
    std::vector<float> gradT(batch * maps * cols);
    for (int64_t g = 0; g < c.group; ++g)
      for (int64_t m = 0; m < gm; ++m)
        for (int64_t n = 0; n < batch; ++n)
          for (int64_t o = 0; o < cols; ++o)
            gradT[((g * gm + m) * batch + n) * cols + o] =
                dy.data<float>()[(n * maps + g * gm + m) * cols + o];
    Tensor dw(DType::F32, wShape);
    int64_t depth = batch * cols;
    for (int64_t g = 0; g < c.group; ++g)
      hostGemm(false, true, gm, rows, depth, gradT.data() + g * gm * depth, depth,
               columns.data() + g * rows * depth, depth, 0.0f, dw.data<float>() + g * gm * rows,
               rows);
    EXPECT_TRUE(close(dw, dwExpected)) << "ConvGradWeight over " << cpu::shapeString(c.x);
  }
}

/// col2im's two forms: the device's gather (col2imElement, one image
/// element a thread) and the CPU's scatter (cpu::col2im over
/// col2imAddRun) add each element's column entries in the same order.
TEST(GpuKernelBodies, Col2imScatterEqualsTheGather) {
  const WindowCase cases[] = {
      {{2, 4, 7, 6}, {3, 3}, {2, 1}, {1, 2}, {1, 0, 2, 1}, 1},
      {{1, 3, 5, 5}, {2, 3}, {1, 1}, {1, 1}, {0, 1, 1, 0}, 1},
      {{1, 2, 4, 5, 6}, {2, 2, 3}, {2, 1, 2}, {1, 2, 1}, {1, 0, 1, 0, 1, 2}, 1}, // 3-D
      {{2, 2, 9}, {3}, {2}, {2}, {1, 1}, 1},                                     // 1-D
  };
  for (const WindowCase &c : cases) {
    k::Im2colParams p;
    ASSERT_TRUE(
        k::makeConvWindow(spatial(c.x), c.kernel, c.strides, c.dilations, c.pads, false, p.w));
    p.channels = c.x[0] * c.x[1];
    Tensor columns = floats({p.rows(), p.w.outSize()});
    Tensor gathered(DType::F32, c.x), scattered(DType::F32, c.x);
    for (int64_t i = 0; i < gathered.numElements(); ++i)
      k::col2imElement(i, p, columns.data<float>(), gathered.data<float>());
    cpu::col2im(columns.data<float>(), p.channels, p.w, scattered.data<float>());
    EXPECT_TRUE(sameBits(scattered, gathered)) << "over " << cpu::shapeString(c.x);
  }
}

TEST(GpuKernelBodies, PoolsAndTheirGradientsMatchCpu) {
  struct PoolCase {
    WindowCase window;
    bool ceilMode, includePad;
  };
  const PoolCase cases[] = {
      {{{2, 3, 7, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, true, false},
      {{{2, 3, 7, 8}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, true, true},
      {{{1, 2, 6, 6}, {2, 2}, {2, 2}, {1, 1}, {0, 0, 0, 0}}, false, false},
      {{{1, 2, 9, 7}, {2, 3}, {1, 2}, {2, 1}, {1, 0, 0, 2}}, false, true},
      {{{2, 2, 11}, {3}, {2}, {1}, {1, 1}}, true, true}, // 1-D
  };
  for (const PoolCase &c : cases)
    for (bool isMax : {true, false}) {
      const WindowCase &wc = c.window;
      // AveragePool has dilations only from opset 19; the CPU kernels read
      // them for both.
      bool dilated = wc.dilations != Shape(wc.dilations.size(), 1);
      if (!isMax && dilated)
        continue;
      Tensor x = floats(wc.x);
      NodeBuilder forward(isMax ? "MaxPool" : "AveragePool", 1);
      withWindow(forward, wc).i("ceil_mode", c.ceilMode).i("count_include_pad", c.includePad);
      Tensor expected = runCpu(forward, {x})[0];
      k::PoolParams p;
      ASSERT_TRUE(k::makeConvWindow(spatial(wc.x), wc.kernel, wc.strides, wc.dilations, wc.pads,
                                    c.ceilMode, p.w));
      p.isMax = isMax, p.includePad = c.includePad;
      Tensor y(DType::F32, expected.shape());
      ASSERT_EQ(y.numElements(), wc.x[0] * wc.x[1] * p.w.outSize());
      for (int64_t t = 0; t < y.numElements(); ++t)
        k::poolElement(t, p, x.data<float>(), y.data<float>());
      std::string what = std::string(isMax ? "Max" : "Average") + " over " +
                         cpu::shapeString(wc.x) + (c.ceilMode ? ", ceil" : "") +
                         (c.includePad ? ", pads counted" : "");
      // The CPU kernel loops around the same body: the same bits.
      EXPECT_TRUE(sameBits(y, expected)) << what;

      Tensor dy = floats(expected.shape());
      NodeBuilder backward(isMax ? "MaxPoolGrad" : "AveragePoolGrad", isMax ? 2 : 1, 1, "pipec");
      withWindow(backward, wc).i("count_include_pad", c.includePad);
      if (!isMax)
        backward.ints("shape", wc.x);
      Tensor dxExpected = isMax ? runCpu(backward, {dy, x})[0] : runCpu(backward, {dy})[0];
      k::ConvWindow w;
      ASSERT_TRUE(k::makeGradWindow(spatial(wc.x), wc.kernel, wc.strides, wc.dilations, wc.pads,
                                    spatial(dy.shape()), w));
      p.w = w;
      Tensor dx(DType::F32, wc.x);
      for (int64_t i = 0; i < dx.numElements(); ++i)
        k::poolGradElement(i, p, dy.data<float>(), x.data<float>(), dx.data<float>());
      // The CPU's scatter (MaxPoolGrad) and gather (AveragePoolGrad) add
      // each element's terms in the body's order: the same bits.
      EXPECT_TRUE(sameBits(dx, dxExpected)) << what << " (gradient)";
    }
}

TEST(GpuKernelBodies, BatchNormMatchesCpu) {
  Tensor x = floats({3, 4, 5, 2}, -2, 3), scale = floats({4}), bias = floats({4}),
         mean = floats({4}), var = floats({4}, 0.5f, 2);
  Tensor expected = runCpu(NodeBuilder("BatchNormalization", 5).f("epsilon", 1e-3f),
                           {x, scale, bias, mean, var})[0];
  Tensor y(DType::F32, x.shape());
  for (int64_t i = 0; i < y.numElements(); ++i)
    k::batchNormElement(i, 4, 10, 1e-3f, x.data<float>(), scale.data<float>(), bias.data<float>(),
                        mean.data<float>(), var.data<float>(), y.data<float>());
  EXPECT_TRUE(close(y, expected));

  Tensor dy = floats(x.shape());
  Tensor dScale = runCpu(NodeBuilder("BatchNormGradWeight", 4, 1, "pipec").f("epsilon", 1e-3f),
                         {dy, x, mean, var})[0];
  for (int64_t chunks : {1, 4, 30}) {
    std::vector<double> partial(4 * chunks);
    for (int64_t t = 0; t < 4 * chunks; ++t)
      k::batchNormGradWeightPartial(t, 4, 3, 10, chunks, dy.data<float>(), x.data<float>(),
                                    mean.data<float>(), partial.data());
    Tensor got(DType::F32, {4});
    for (int64_t c = 0; c < 4; ++c)
      k::batchNormGradWeightFinish(c, chunks, 1e-3f, partial.data(), var.data<float>(),
                                   got.data<float>());
    EXPECT_TRUE(close(got, dScale)) << chunks << " chunks";
  }
}

TEST(GpuKernelBodies, GlobalAveragePoolMatchesCpu) {
  Tensor x = floats({3, 5, 6, 7});
  Tensor expected = runCpu(NodeBuilder("GlobalAveragePool", 1), {x})[0];
  k::ReducePlan plan;
  ASSERT_TRUE(k::makeReducePlan(x.shape(), {false, false, true, true}, plan));
  std::vector<double> partial(plan.outputs * plan.chunks);
  for (int64_t t = 0; t < plan.outputs * plan.chunks; ++t)
    k::reducePartialElement<float>(t, plan, x.data<float>(), partial.data());
  Tensor actual(DType::F32, expected.shape());
  for (int64_t o = 0; o < plan.outputs; ++o)
    k::reduceFinishElement<float>(o, plan.outputs, plan.chunks, partial.data(), 42.0,
                                  actual.data<float>());
  EXPECT_TRUE(close(actual, expected));
}

//===----------------------------------------------------------------------===//
// Fused element-wise programs
//===----------------------------------------------------------------------===//

// The device loop body on the host, element by element, against the CPU
// kernel of the fused node (itself checked against the unfused body in
// FusionTest).
TEST(GpuKernelBodies, FusedProgramMatchesCpu) {
  onnx::NodeProto node = fusedGelu();
  std::vector<Tensor> inputs = fusedGeluInputs(9, 40);
  std::vector<const Tensor *> in = pointers(inputs);
  auto kernel = compileFused(node, 17);
  ASSERT_TRUE(!!kernel) << llvm::toString(kernel.takeError());
  auto shape = fusedShape(*kernel, in);
  ASSERT_TRUE(shape.has_value());
  k::FusedMap map;
  ASSERT_TRUE(makeFusedMap(*shape, in, map));
  // Three tensors, not three handles of one.
  std::vector<Tensor> outs;
  for (int o = 0; o < 3; ++o)
    outs.emplace_back(DType::F32, *shape);
  const float *src[k::MaxFusedInputs] = {};
  for (size_t i = 0; i < inputs.size(); ++i)
    src[i] = inputs[i].data<float>();
  float *dst[k::MaxFusedOutputs] = {outs[0].data<float>(), outs[1].data<float>(),
                                    outs[2].data<float>()};
  for (int64_t i = 0; i < outs[0].numElements(); ++i)
    k::fusedElement(i, kernel->program, map, src, dst);
  auto expected = cpu::runOp(node, 17, in);
  ASSERT_TRUE(!!expected) << llvm::toString(expected.takeError());
  for (size_t o = 0; o < outs.size(); ++o)
    for (int64_t i = 0; i < outs[o].numElements(); ++i)
      ASSERT_EQ(outs[o].data<float>()[i], (*expected)[o].data<float>()[i]) << o << " " << i;
}

} // namespace
