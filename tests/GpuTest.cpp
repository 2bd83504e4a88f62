//===- GpuTest.cpp - The CUDA backend against the CPU kernels -----------===//
//
// Three layers:
//  - GpuKernelBodies: the per-element functions of KernelBodies.h run on the
//    host (one lane per row) against the CPU kernels. They need no device,
//    so the index math, broadcasting, reductions and row algorithms are
//    checked on every machine.
//  - CudaOp: every device kernel through the CUDA backend against the CPU
//    kernel on random data (the same NodeProto through cpu::runAnyOp and
//    the backend), and that it did not fall back. The CPU half runs
//    everywhere, so a malformed case fails here too; the device half skips
//    without a device.
//  - CudaBackend: bf16 GEMMs, the optimizer, sums, the memory pool,
//    fallbacks, host shape arithmetic and errors found on the device.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include "runtime/cpu/Fused.h"
#include "runtime/cpu/GradKernels.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/cuda/CudaBackend.h"
#include "runtime/cuda/Devices.h"
#include "runtime/kernels/KernelBodies.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

using namespace pipec;
using cpu::ElemType;
using cpu::Tensor;
using Shape = std::vector<int64_t>;
namespace k = cuda::kernels;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

/// A node with inputs "in0".. and outputs "out0".. (an empty name where
/// an input or output is omitted).
class NodeBuilder {
public:
  NodeBuilder(const std::string &op, int inputs, int outputs = 1, const std::string &domain = "") {
    node.set_op_type(op);
    node.set_name(op);
    node.set_domain(domain);
    for (int i = 0; i < inputs; ++i)
      node.add_input("in" + std::to_string(i));
    for (int i = 0; i < outputs; ++i)
      node.add_output("out" + std::to_string(i));
  }
  NodeBuilder &i(const std::string &name, int64_t v) {
    auto *a = add(name, onnx::AttributeProto::INT);
    a->set_i(v);
    return *this;
  }
  NodeBuilder &f(const std::string &name, float v) {
    auto *a = add(name, onnx::AttributeProto::FLOAT);
    a->set_f(v);
    return *this;
  }
  NodeBuilder &s(const std::string &name, const std::string &v) {
    auto *a = add(name, onnx::AttributeProto::STRING);
    a->set_s(v);
    return *this;
  }
  NodeBuilder &ints(const std::string &name, const Shape &v) {
    auto *a = add(name, onnx::AttributeProto::INTS);
    for (int64_t x : v)
      a->add_ints(x);
    return *this;
  }
  NodeBuilder &t(const std::string &name, const Tensor &v) {
    auto *a = add(name, onnx::AttributeProto::TENSOR);
    *a->mutable_t() = cpu::toTensorProto(v);
    return *this;
  }
  NodeBuilder &omitInput(int index) {
    node.set_input(index, "");
    return *this;
  }
  operator onnx::NodeProto() const { return node; }

private:
  onnx::AttributeProto *add(const std::string &name, onnx::AttributeProto::AttributeType type) {
    auto *a = node.add_attribute();
    a->set_name(name);
    a->set_type(type);
    return a;
  }
  onnx::NodeProto node;
};

std::mt19937 &rng() {
  static std::mt19937 generator(1234);
  return generator;
}

Tensor floats(const Shape &shape, float lo = -1, float hi = 1) {
  Tensor t(ElemType::Float, shape);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<float>()[i] = dist(rng());
  return t;
}

Tensor int64s(const Shape &shape, int64_t lo, int64_t hi) {
  Tensor t(ElemType::Int64, shape);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<int64_t>()[i] = dist(rng());
  return t;
}

Tensor int64s(const Shape &shape, const std::vector<int64_t> &values) {
  return Tensor::fromValues<int64_t>(shape, values);
}

Tensor bools(const Shape &shape) {
  Tensor t(ElemType::Bool, shape);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<bool>()[i] = rng()() % 2;
  return t;
}

/// \p t with element type \p type (converted as Cast does).
Tensor castTo(const Tensor &t, ElemType type) {
  auto out = cpu::runOp(NodeBuilder("Cast", 1).i("to", static_cast<int64_t>(type)), 17, {&t});
  EXPECT_TRUE(!!out) << llvm::toString(out.takeError());
  return (*out)[0];
}

std::vector<const Tensor *> pointers(const std::vector<Tensor> &tensors) {
  std::vector<const Tensor *> result;
  for (const Tensor &t : tensors)
    result.push_back(t.isNull() ? nullptr : &t);
  return result;
}

std::vector<Tensor> runCpu(const onnx::NodeProto &node, const std::vector<Tensor> &inputs,
                           int64_t opset = 17) {
  auto out = cpu::runAnyOp(node, opset, pointers(inputs));
  EXPECT_TRUE(!!out) << llvm::toString(out.takeError());
  return out ? *out : std::vector<Tensor>();
}

::testing::AssertionResult close(const Tensor &actual, const Tensor &expected, double rtol = 1e-4,
                                 double atol = 1e-5) {
  std::string why;
  if (cpu::allClose(actual, expected, rtol, atol, &why))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

bool haveDevice() {
  auto devices = cuda::listDevices();
  return devices && !devices->empty();
}

//===----------------------------------------------------------------------===//
// Libraries and devices
//===----------------------------------------------------------------------===//

TEST(Gpu, LibrariesLinkAndReportVersions) {
  auto v = cuda::libraryVersions();
  ASSERT_TRUE(!!v) << llvm::toString(v.takeError());
  EXPECT_GE(v->runtime, 12000);
  EXPECT_GE(v->cublas, 120000);
  EXPECT_GE(v->nccl, 21800);
}

TEST(Gpu, KernelRunsOnEveryDevice) {
  auto devices = cuda::listDevices();
  ASSERT_TRUE(!!devices) << llvm::toString(devices.takeError());
  if (devices->empty())
    GTEST_SKIP() << "no CUDA device";
  for (const auto &d : *devices) {
    EXPECT_GT(d.memoryBytes, 0u);
    llvm::Error err = cuda::selfTest(d.index);
    EXPECT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
  }
}

TEST(Gpu, MissingDeviceIsAClearError) {
  auto devices = cuda::listDevices();
  ASSERT_TRUE(!!devices) << llvm::toString(devices.takeError());
  int missing = static_cast<int>(devices->size()); // one past the last
  auto backend = cuda::createCudaBackend(missing, false);
  ASSERT_FALSE(!!backend);
  std::string message = llvm::toString(backend.takeError());
  EXPECT_NE(message.find("no CUDA device"), std::string::npos) << message;
  std::string error;
  EXPECT_EQ(pipecMakeCudaBackend(missing, false, &error), nullptr);
  EXPECT_NE(error.find("no CUDA device"), std::string::npos) << error;
}

//===----------------------------------------------------------------------===//
// Kernel bodies on the host
//===----------------------------------------------------------------------===//

TEST(GpuKernelBodies, IndexMapMergesContiguousDimensions) {
  k::IndexMap map;
  Shape shape{2, 3, 4};
  ASSERT_TRUE(k::makeIndexMap(shape, {k::contiguousStrides(shape)}, map));
  EXPECT_EQ(map.rank, 1);
  EXPECT_EQ(map.shape[0], 24);
  // [3, 1] broadcast to [2, 3, 4]: dimension 0 and 2 read with stride 0.
  ASSERT_TRUE(k::makeIndexMap(shape, {k::broadcastStrides({3, 1}, shape)}, map));
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

/// The elementwise bodies over broadcast operands against the CPU kernels.
TEST(GpuKernelBodies, BroadcastArithmeticMatchesCpu) {
  const std::pair<Shape, Shape> shapes[] = {
      {{2, 3, 4}, {4}}, {{2, 1, 4}, {3, 1}}, {{1}, {5, 2}}, {{2, 3}, {2, 3}}, {{}, {3}}};
  const std::pair<const char *, k::Binary> ops[] = {{"Add", k::Binary::Add},
                                                    {"Sub", k::Binary::Sub},
                                                    {"Mul", k::Binary::Mul},
                                                    {"Div", k::Binary::Div},
                                                    {"Pow", k::Binary::Pow}};
  for (const auto &[aShape, bShape] : shapes)
    for (const auto &[name, op] : ops) {
      Tensor a = floats(aShape, 0.5f, 2), b = floats(bShape, 0.5f, 2);
      Tensor expected = runCpu(NodeBuilder(name, 2), {a, b})[0];
      k::IndexMap map;
      ASSERT_TRUE(k::makeIndexMap(expected.shape(),
                                  {k::broadcastStrides(aShape, expected.shape()),
                                   k::broadcastStrides(bShape, expected.shape())},
                                  map));
      Tensor actual(ElemType::Float, expected.shape());
      for (int64_t i = 0; i < actual.numElements(); ++i)
        k::arithmeticElement<float>(i, op, map, a.data<float>(), b.data<float>(),
                                    actual.data<float>());
      EXPECT_TRUE(close(actual, expected))
          << name << " " << cpu::shapeString(aShape) << " " << cpu::shapeString(bShape);
    }
}

TEST(GpuKernelBodies, WhereAndComparisonsMatchCpu) {
  Tensor cond = bools({2, 1, 4}), x = floats({3, 4}), y = floats({});
  Tensor expected = runCpu(NodeBuilder("Where", 3), {cond, x, y})[0];
  k::IndexMap map;
  const Shape &shape = expected.shape();
  ASSERT_TRUE(k::makeIndexMap(shape,
                              {k::broadcastStrides(cond.shape(), shape),
                               k::broadcastStrides(x.shape(), shape),
                               k::broadcastStrides(y.shape(), shape)},
                              map));
  Tensor actual(ElemType::Float, shape);
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
  Tensor got(ElemType::Bool, equal.shape());
  for (int64_t i = 0; i < got.numElements(); ++i)
    k::compareElement<int64_t>(i, k::Binary::Equal, map, a.data<int64_t>(), b.data<int64_t>(),
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
  EXPECT_TRUE(close(stridedRead(small, {2, 3, 4}, k::broadcastStrides({3, 1}, {2, 3, 4}), 0),
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
      Tensor actual(ElemType::Float, expected.shape());
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
      Tensor actual(ElemType::Float, x.shape());
      for (int64_t r = 0; r < k::rowCount(layout); ++r)
        k::softmaxRow(lanes, r, layout, x.data<float>(), actual.data<float>(), logarithm);
      EXPECT_TRUE(close(actual, expected)) << "axis " << axis;

      Tensor dy = floats(x.shape());
      Tensor grad =
          runCpu(NodeBuilder("SoftmaxGrad", 2, 1, "pipec").i("axis", axis), {dy, expected})[0];
      Tensor got(ElemType::Float, x.shape());
      for (int64_t r = 0; r < k::rowCount(layout); ++r)
        k::softmaxGradRow(lanes, r, layout, dy.data<float>(), expected.data<float>(),
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
  Tensor y(ElemType::Float, x.shape()), mean(ElemType::Float, {4, 1, 1}),
      invStd(ElemType::Float, {4, 1, 1});
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormRow(lanes, r, size, 1e-3f, x.data<float>(), scale.data<float>(), bias.data<float>(),
                    y.data<float>(), mean.data<float>(), invStd.data<float>());
  EXPECT_TRUE(close(y, expected[0]));
  EXPECT_TRUE(close(mean, expected[1]));
  EXPECT_TRUE(close(invStd, expected[2]));

  Tensor dy = floats(x.shape());
  Tensor dx =
      runCpu(NodeBuilder("LayerNormGradInput", 3, 1, "pipec").i("axis", 1).f("epsilon", 1e-3f),
             {dy, x, scale})[0];
  Tensor gotDx(ElemType::Float, x.shape());
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormGradInputRow(lanes, r, size, 1e-3f, dy.data<float>(), x.data<float>(),
                             scale.data<float>(), gotDx.data<float>());
  EXPECT_TRUE(close(gotDx, dx));

  Tensor dScale = runCpu(NodeBuilder("LayerNormGradWeight", 2, 1, "pipec")
                             .i("axis", 1)
                             .f("epsilon", 1e-3f)
                             .ints("shape", {3, 8}),
                         {dy, x})[0];
  std::vector<float> mu(rows), rstd(rows);
  for (int64_t r = 0; r < rows; ++r)
    k::layerNormStatsRow(lanes, r, size, 1e-3f, x.data<float>(), mu.data(), rstd.data());
  int64_t chunks = 3, chunkLength = 2; // rows 0-1, 2-3, none
  std::vector<double> partial(size * chunks);
  for (int64_t t = 0; t < size * chunks; ++t)
    k::layerNormGradWeightPartial(t, rows, size, chunkLength, dy.data<float>(), x.data<float>(),
                                  mu.data(), rstd.data(), partial.data());
  Tensor gotScale(ElemType::Float, {3, 8});
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
        Tensor logProb(ElemType::Float, shape), losses(ElemType::Float, labelShape);
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
          Tensor loss(ElemType::Float, {});
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
          Tensor got(ElemType::Float, shape);
          for (int64_t r = 0; r < positions; ++r)
            k::crossEntropyGradRow(lanes, r, layout, p, dLoss.data<float>(), &count,
                                   scores.data<float>(), labels.data<int64_t>(), got.data<float>(),
                                   &flag);
          EXPECT_TRUE(close(got, dx)) << reduction << (ignore ? " ignoring" : "");
        }
      }
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
    Tensor actual(ElemType::Float, expected.shape());
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
    Tensor got(ElemType::Float, data.shape());
    for (int64_t i = 0; i < dy.numElements(); ++i)
      k::gatherGradElement<int64_t>(i, p, dy.data<float>(), idx.data<int64_t>(), got.data<float>(),
                                    &flag);
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

TEST(GpuKernelBodies, UnaryPointwiseAndCastsMatchCpu) {
  Tensor x = floats({64}, -3, 3), positive = floats({64}, 0.25f, 4);
  const std::tuple<const char *, k::Unary, bool> unaryOps[] = {
      {"Relu", k::Unary::Relu, false},
      {"Tanh", k::Unary::Tanh, false},
      {"Sigmoid", k::Unary::Sigmoid, false},
      {"Erf", k::Unary::Erf, false},
      {"Sqrt", k::Unary::Sqrt, true},
      {"Exp", k::Unary::Exp, false},
      {"Log", k::Unary::Log, true},
      {"Neg", k::Unary::Neg, false},
      {"Reciprocal", k::Unary::Reciprocal, true},
      {"Abs", k::Unary::Abs, false},
      {"Gelu", k::Unary::GeluErf, false}};
  for (const auto &[name, op, needsPositive] : unaryOps) {
    const Tensor &in = needsPositive ? positive : x;
    Tensor expected = runCpu(NodeBuilder(name, 1), {in})[0];
    Tensor actual(ElemType::Float, in.shape());
    for (int64_t i = 0; i < in.numElements(); ++i)
      k::unaryElement(i, op, 0, in.data<float>(), actual.data<float>());
    EXPECT_TRUE(close(actual, expected)) << name;
  }
  const std::tuple<const char *, k::Pointwise, const char *> gradOps[] = {
      {"ReluGrad", k::Pointwise::ReluGrad, ""},
      {"TanhGrad", k::Pointwise::TanhGrad, ""},
      {"SigmoidGrad", k::Pointwise::SigmoidGrad, ""},
      {"ErfGrad", k::Pointwise::ErfGrad, ""},
      {"GeluGrad", k::Pointwise::GeluErfGrad, "none"},
      {"GeluGrad", k::Pointwise::GeluTanhGrad, "tanh"}};
  Tensor dy = floats({64});
  for (const auto &[name, op, approximate] : gradOps) {
    NodeBuilder node(name, 2, 1, "pipec");
    if (*approximate)
      node.s("approximate", approximate);
    Tensor expected = runCpu(node, {dy, x})[0];
    Tensor actual(ElemType::Float, x.shape());
    for (int64_t i = 0; i < x.numElements(); ++i)
      k::pointwiseElement(i, op, dy.data<float>(), x.data<float>(), actual.data<float>());
    EXPECT_TRUE(close(actual, expected)) << name << " " << approximate;
  }
  Tensor odd = Tensor::fromValues<float>({6}, {1.7f, -2.5f, NAN, 1e30f, -1e30f, 0.0f});
  Tensor expected = castTo(odd, ElemType::Int64);
  Tensor actual(ElemType::Int64, {6});
  for (int64_t i = 0; i < 6; ++i)
    k::castElement<float, int64_t>(i, odd.data<float>(), actual.data<int64_t>());
  EXPECT_TRUE(close(actual, expected));
  Tensor flags(ElemType::Bool, {6});
  for (int64_t i = 0; i < 6; ++i)
    k::castElement<float, bool>(i, odd.data<float>(), flags.data<bool>());
  EXPECT_TRUE(close(flags, castTo(odd, ElemType::Bool)));
}

/// The reference for the device's update: the CPU backend's own
/// (runtime/core/CpuBackend.cpp), on host tensors, at \p step.
void referenceUpdate(const k::OptimizerParams &p, int step, Tensor &w, const Tensor &g, Tensor &m,
                     Tensor &v) {
  using Kind = rt::OptimizerUpdate::Kind;
  rt::OptimizerUpdate u;
  u.kind = p.kind == 0 ? Kind::Sgd : p.kind == 1 ? Kind::Momentum : Kind::AdamW;
  u.lr = p.lr;
  u.momentum = p.momentum;
  u.weightDecay = p.weightDecay;
  u.beta1 = p.beta1;
  u.beta2 = p.beta2;
  u.epsilon = p.epsilon;
  u.gradScale = p.gradScale;
  u.step = step;
  llvm::Error err = rt::makeCpuBackend()->optimize(u, w, g, m, v);
  ASSERT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
}

k::OptimizerParams optimizerParams(int kind, int step) {
  k::OptimizerParams p;
  p.kind = kind;
  p.lr = kind == 2 ? 1e-3 : 1e-2;
  p.momentum = 0.9;
  p.weightDecay = 0.01;
  p.beta1 = 0.9;
  p.beta2 = 0.999;
  p.epsilon = 1e-8;
  p.gradScale = 0.25;
  p.c1 = 1 - std::pow(p.beta1, step + 1);
  p.c2 = 1 - std::pow(p.beta2, step + 1);
  return p;
}

TEST(GpuKernelBodies, OptimizerMatchesCpuBackend) {
  for (int kind : {0, 1, 2}) {
    Tensor w = floats({50}), wRef = w.clone();
    Tensor m(ElemType::Float, {50}), v(ElemType::Float, {50}), mRef = m.clone(), vRef = v.clone();
    for (int step = 0; step < 3; ++step) {
      Tensor g = floats({50});
      k::OptimizerParams p = optimizerParams(kind, step);
      referenceUpdate(p, step, wRef, g, mRef, vRef);
      Tensor wOut(ElemType::Float, {50}), mOut(ElemType::Float, {50}), vOut(ElemType::Float, {50});
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

TEST(GpuKernelBodies, PoolSizeClasses) {
  size_t previous = 0;
  for (size_t bytes : {size_t(0), size_t(1), size_t(512), size_t(513), size_t(100000),
                       size_t(1) << 20, (size_t(1) << 20) + 1, size_t(3) << 24, size_t(1) << 30}) {
    size_t size = cuda::DevicePool::sizeClass(bytes);
    EXPECT_GE(size, bytes);
    EXPECT_GE(size, previous);
    EXPECT_EQ(size % 512, 0u);
    if (bytes > (size_t(1) << 20)) {
      EXPECT_LE(size, bytes + bytes / 4) << bytes;
    }
    previous = size;
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

/// A window op's attributes, for the CPU nodes and the kernel bodies.
struct WindowCase {
  Shape x, kernel, strides, dilations, pads;
  int64_t group = 1;
};

NodeBuilder &withWindow(NodeBuilder &b, const WindowCase &c, bool dilations = true) {
  b.ints("kernel_shape", c.kernel).ints("strides", c.strides).ints("pads", c.pads);
  if (dilations)
    b.ints("dilations", c.dilations);
  return b;
}

Shape spatial(const Shape &shape) { return Shape(shape.begin() + 2, shape.end()); }

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
    Tensor y(ElemType::Float, expected.shape());
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
    Tensor dx(ElemType::Float, c.x);
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
    Tensor dw(ElemType::Float, wShape);
    int64_t depth = batch * cols;
    for (int64_t g = 0; g < c.group; ++g)
      hostGemm(false, true, gm, rows, depth, gradT.data() + g * gm * depth, depth,
               columns.data() + g * rows * depth, depth, 0.0f, dw.data<float>() + g * gm * rows,
               rows);
    EXPECT_TRUE(close(dw, dwExpected)) << "ConvGradWeight over " << cpu::shapeString(c.x);
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
      Tensor y(ElemType::Float, expected.shape());
      ASSERT_EQ(y.numElements(), wc.x[0] * wc.x[1] * p.w.outSize());
      for (int64_t t = 0; t < y.numElements(); ++t)
        k::poolElement(t, p, x.data<float>(), y.data<float>());
      std::string what = std::string(isMax ? "Max" : "Average") + " over " +
                         cpu::shapeString(wc.x) + (c.ceilMode ? ", ceil" : "") +
                         (c.includePad ? ", pads counted" : "");
      EXPECT_TRUE(close(y, expected)) << what;

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
      Tensor dx(ElemType::Float, wc.x);
      for (int64_t i = 0; i < dx.numElements(); ++i)
        k::poolGradElement(i, p, dy.data<float>(), x.data<float>(), dx.data<float>());
      EXPECT_TRUE(close(dx, dxExpected)) << what << " (gradient)";
    }
}

TEST(GpuKernelBodies, BatchNormMatchesCpu) {
  Tensor x = floats({3, 4, 5, 2}, -2, 3), scale = floats({4}), bias = floats({4}),
         mean = floats({4}), var = floats({4}, 0.5f, 2);
  Tensor expected = runCpu(NodeBuilder("BatchNormalization", 5).f("epsilon", 1e-3f),
                           {x, scale, bias, mean, var})[0];
  Tensor y(ElemType::Float, x.shape());
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
    Tensor got(ElemType::Float, {4});
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
  Tensor actual(ElemType::Float, expected.shape());
  for (int64_t o = 0; o < plan.outputs; ++o)
    k::reduceFinishElement<float>(o, plan.outputs, plan.chunks, partial.data(), 1.0 / 42,
                                  actual.data<float>());
  EXPECT_TRUE(close(actual, expected));
}

//===----------------------------------------------------------------------===//
// Fused element-wise programs
//===----------------------------------------------------------------------===//

/// GPT-2's GELU on x + bias with its tanh kept, a TanhGrad and a Sum: x is
/// in0 [rows, cols], bias in1 [cols], scalars in2 (0.5), in3 (3), in4
/// (0.044715), in5 (sqrt(2/pi)), in6 (1), dY in7 [rows, cols]; outputs
/// out0 (the GELU), out1 (tanh), out2 (the sum).
onnx::NodeProto fusedGelu() {
  std::vector<onnx::NodeProto> body = {test::makeNode("Add", {"in0", "in1"}, "h"),
                                       test::makeNode("Mul", {"in2", "h"}, "a"),
                                       test::makeNode("Pow", {"h", "in3"}, "p"),
                                       test::makeNode("Mul", {"in4", "p"}, "b"),
                                       test::makeNode("Add", {"h", "b"}, "s"),
                                       test::makeNode("Mul", {"in5", "s"}, "u"),
                                       test::makeNode("Tanh", {"u"}, "out1"),
                                       test::makeNode("Add", {"in6", "out1"}, "e"),
                                       test::makeNode("Mul", {"a", "e"}, "out0"),
                                       test::makeNode("TanhGrad", {"in7", "out1"}, "g", "pipec"),
                                       test::makeNode("Sum", {"out0", "g", "h"}, "out2")};
  std::vector<const onnx::NodeProto *> pointers;
  for (const onnx::NodeProto &n : body)
    pointers.push_back(&n);
  return cpu::makeFusedNode("gelu", pointers,
                            {"in0", "in1", "in2", "in3", "in4", "in5", "in6", "in7"},
                            {"out0", "out1", "out2"});
}

/// MatMul(in0, in1) + in2 as the fusion pass makes it.
onnx::NodeProto matMulBias() {
  onnx::NodeProto mm = test::makeNode("MatMul", {"in0", "in1"}, "m"),
                  add = test::makeNode("Add", {"in2", "m"}, "out0");
  onnx::NodeProto f = cpu::makeFusedNode("linear", {&mm, &add}, {"in0", "in1", "in2"}, {"out0"});
  f.set_op_type(cpu::MatMulBiasOpType.str());
  return f;
}

std::vector<Tensor> fusedGeluInputs(int64_t rows, int64_t cols) {
  return {floats({rows, cols}, -3, 3), floats({cols}),
          Tensor::scalar(0.5f),        Tensor::scalar(3.0f),
          Tensor::scalar(0.044715f),   Tensor::scalar(0.7978845608f),
          Tensor::scalar(1.0f),        floats({rows, cols})};
}

// The device loop body on the host, element by element, against the CPU
// kernel of the fused node (itself checked against the unfused body in
// FusionTest).
TEST(GpuKernelBodies, FusedProgramMatchesCpu) {
  onnx::NodeProto node = fusedGelu();
  std::vector<Tensor> inputs = fusedGeluInputs(9, 40);
  std::vector<const Tensor *> in = pointers(inputs);
  auto kernel = cpu::compileFused(node, 17);
  ASSERT_TRUE(!!kernel) << llvm::toString(kernel.takeError());
  auto shape = cpu::fusedShape(*kernel, in);
  ASSERT_TRUE(shape.has_value());
  k::FusedMap map;
  ASSERT_TRUE(cpu::makeFusedMap(*shape, in, map));
  // Three tensors, not three handles of one.
  std::vector<Tensor> outs;
  for (int o = 0; o < 3; ++o)
    outs.emplace_back(ElemType::Float, *shape);
  const float *src[k::MaxFusedInputs] = {};
  for (size_t i = 0; i < inputs.size(); ++i)
    src[i] = inputs[i].data<float>();
  float *dst[k::MaxFusedOutputs] = {outs[0].data<float>(), outs[1].data<float>(),
                                    outs[2].data<float>()};
  for (int64_t i = 0; i < outs[0].numElements(); ++i)
    k::fusedElement(i, kernel->program, map, src, dst);
  auto expected = cpu::runFused(node, 17, in);
  ASSERT_TRUE(!!expected) << llvm::toString(expected.takeError());
  for (size_t o = 0; o < outs.size(); ++o)
    for (int64_t i = 0; i < outs[o].numElements(); ++i)
      ASSERT_EQ(outs[o].data<float>()[i], (*expected)[o].data<float>()[i]) << o << " " << i;
}

//===----------------------------------------------------------------------===//
// Every device kernel through the backend
//===----------------------------------------------------------------------===//

struct OpCase {
  std::string name;
  onnx::NodeProto node;
  std::vector<Tensor> inputs;
  int64_t opset = 17;
  double rtol = 1e-4, atol = 1e-5;
};

/// Test listings show the case's name, not its bytes.
void PrintTo(const OpCase &c, std::ostream *os) { *os << c.name; }

std::vector<OpCase> opCases() {
  std::vector<OpCase> cases;
  auto add = [&](std::string name, onnx::NodeProto node, std::vector<Tensor> inputs,
                 int64_t opset = 17, double atol = 1e-5) {
    cases.push_back({std::move(name), std::move(node), std::move(inputs), opset, 1e-4, atol});
  };
  // Elementwise.
  for (const char *op : {"Relu", "Tanh", "Sigmoid", "Erf", "Exp", "Neg", "Abs", "Identity"})
    add(op, NodeBuilder(op, 1), {floats({7, 33}, -3, 3)});
  for (const char *op : {"Sqrt", "Log", "Reciprocal"})
    add(op, NodeBuilder(op, 1), {floats({7, 33}, 0.25f, 4)});
  add("GeluErf", NodeBuilder("Gelu", 1), {floats({300}, -4, 4)});
  add("GeluTanh", NodeBuilder("Gelu", 1).s("approximate", "tanh"), {floats({300}, -4, 4)});
  add("LeakyRelu", NodeBuilder("LeakyRelu", 1).f("alpha", 0.2f), {floats({300})});
  add("AddLarge", NodeBuilder("Add", 2), {floats({1000, 300}), floats({300})});
  add("FusedGelu", fusedGelu(), fusedGeluInputs(512, 768));
  // The bias in cuBLASLt's epilogue; a [rows, n] addend runs the two nodes.
  add("MatMulBiasEpilogue", matMulBias(),
      {floats({4, 96, 128}), floats({128, 384}), floats({384})});
  add("MatMulBiasOddSizes", matMulBias(), {floats({7, 33}), floats({33, 5}), floats({1, 5})});
  add("MatMulBiasNotAnEpilogue", matMulBias(), {floats({7, 33}), floats({33, 5}), floats({7, 5})});
  add("AddBroadcast", NodeBuilder("Add", 2), {floats({2, 1, 4}), floats({3, 1})});
  add("SubBroadcast", NodeBuilder("Sub", 2), {floats({2, 3, 4}), floats({4})});
  add("MulScalar", NodeBuilder("Mul", 2), {floats({5, 6}), floats({})});
  add("Div", NodeBuilder("Div", 2), {floats({5, 6}), floats({5, 6}, 0.5f, 2)});
  add("PowSquare", NodeBuilder("Pow", 2), {floats({40}), Tensor::scalar(2.0f)});
  add("PowTensor", NodeBuilder("Pow", 2), {floats({4, 10}, 0.5f, 2), floats({10}, -1, 2)});
  add("AddInt64", NodeBuilder("Add", 2), {int64s({30, 4}, -9, 9), int64s({4}, -9, 9)});
  add("MulInt64", NodeBuilder("Mul", 2), {int64s({30, 4}, -9, 9), int64s({30, 1}, -9, 9)});
  add("EqualInt64", NodeBuilder("Equal", 2), {int64s({30, 4}, 0, 2), int64s({4}, 0, 2)});
  Tensor a = floats({20});
  Tensor b = a.clone();
  for (int i = 0; i < 20; i += 3)
    b.data<float>()[i] += 1;
  add("EqualFloat", NodeBuilder("Equal", 2), {a, b});
  add("Less", NodeBuilder("Less", 2), {floats({4, 5}), floats({5})});
  add("Greater", NodeBuilder("Greater", 2), {floats({4, 5}), floats({4, 1})});
  add("Where", NodeBuilder("Where", 3), {bools({2, 1, 4}), floats({3, 4}), floats({})});
  add("WhereInt64", NodeBuilder("Where", 3), {bools({50}), int64s({50}, 0, 9), int64s({1}, 0, 9)});
  add("Sum", NodeBuilder("Sum", 3), {floats({3, 4}), floats({4}), floats({2, 3, 4})});
  add("CastFloatToInt64", NodeBuilder("Cast", 1).i("to", 7), {floats({30}, -50, 50)});
  add("CastInt64ToFloat", NodeBuilder("Cast", 1).i("to", 1), {int64s({30}, -50, 50)});
  add("CastFloatToBool", NodeBuilder("Cast", 1).i("to", 9),
      {Tensor::fromValues<float>({4}, {0, 1, -2, 0})});
  add("CastBoolToFloat", NodeBuilder("Cast", 1).i("to", 1), {bools({40})});
  add("CastInt64ToInt32", NodeBuilder("Cast", 1).i("to", 6), {int64s({40}, -99, 99)});
  add("CastFloatToDouble", NodeBuilder("Cast", 1).i("to", 11), {floats({9})});
  // Matrix products.
  add("MatMul2D", NodeBuilder("MatMul", 2), {floats({4, 8}), floats({8, 5})});
  add("MatMulFolded", NodeBuilder("MatMul", 2), {floats({2, 3, 4, 8}), floats({8, 5})});
  add("MatMulBatched", NodeBuilder("MatMul", 2), {floats({2, 3, 4, 8}), floats({2, 3, 8, 5})});
  add("MatMulPartialBroadcast", NodeBuilder("MatMul", 2),
      {floats({2, 1, 4, 8}), floats({3, 8, 5})});
  add("MatMulLeftShared", NodeBuilder("MatMul", 2), {floats({4, 8}), floats({2, 8, 5})});
  add("MatMulVectorLeft", NodeBuilder("MatMul", 2), {floats({8}), floats({2, 8, 5})});
  add("MatMulVectorRight", NodeBuilder("MatMul", 2), {floats({2, 4, 8}), floats({8})});
  // k = 256 products summed in another order than OpenBLAS's: outputs near 0
  // differ by up to ~k * 2^-24 in absolute terms.
  add("MatMulLarge", NodeBuilder("MatMul", 2), {floats({8, 64, 256}), floats({256, 384})}, 17,
      2e-5);
  add("Gemm", NodeBuilder("Gemm", 3), {floats({4, 8}), floats({8, 5}), floats({5})});
  add("GemmTransposed",
      NodeBuilder("Gemm", 3).i("transA", 1).i("transB", 1).f("alpha", 0.5f).f("beta", 2),
      {floats({8, 4}), floats({5, 8}), floats({4, 5})});
  add("GemmTransB", NodeBuilder("Gemm", 3).i("transB", 1),
      {floats({4, 8}), floats({5, 8}), floats({1, 1})});
  add("GemmNoBias", NodeBuilder("Gemm", 2).i("transA", 1), {floats({8, 4}), floats({8, 5})});
  // Rows.
  add("Softmax", NodeBuilder("Softmax", 1), {floats({128, 2000}, -5, 5)});
  add("SoftmaxMiddleAxis", NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 5, 3})});
  add("SoftmaxOpset11", NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 3, 4})}, 11);
  add("LogSoftmax", NodeBuilder("LogSoftmax", 1), {floats({6, 9})});
  add("LayerNorm", NodeBuilder("LayerNormalization", 3, 3).f("epsilon", 1e-5f),
      {floats({4, 6, 256}), floats({256}), floats({256})});
  add("LayerNormAxis1", NodeBuilder("LayerNormalization", 2).i("axis", 1),
      {floats({4, 6, 8}, 1, 3), floats({6, 8})});
  // Data movement.
  add("Transpose", NodeBuilder("Transpose", 1).ints("perm", {2, 0, 1}), {floats({2, 3, 4})});
  add("TransposeLastTwo", NodeBuilder("Transpose", 1).ints("perm", {0, 1, 3, 2}),
      {floats({2, 4, 64, 32})});
  add("TransposeDefault", NodeBuilder("Transpose", 1), {floats({3, 5})});
  add("Reshape", NodeBuilder("Reshape", 2), {floats({2, 3, 4}), int64s({2}, {-1, 4})});
  add("ReshapeZero", NodeBuilder("Reshape", 2), {floats({2, 3, 4}), int64s({3}, {0, 4, 3})});
  add("Flatten", NodeBuilder("Flatten", 1).i("axis", 2), {floats({2, 3, 4})});
  add("Squeeze", NodeBuilder("Squeeze", 2), {floats({2, 1, 4}), int64s({1}, {1})});
  add("Unsqueeze", NodeBuilder("Unsqueeze", 2), {floats({2, 4}), int64s({2}, {0, -1})});
  add("Expand", NodeBuilder("Expand", 2), {floats({3, 1}), int64s({3}, {2, 3, 4})});
  add("Concat", NodeBuilder("Concat", 3).i("axis", 1),
      {floats({2, 3, 4}), floats({2, 1, 4}), floats({2, 2, 4})});
  add("ConcatLast", NodeBuilder("Concat", 2).i("axis", -1),
      {int64s({20, 3}, 0, 9), int64s({20, 2}, 0, 9)});
  add("Split", NodeBuilder("Split", 2, 2).i("axis", 1), {floats({2, 3, 4}), int64s({2}, {1, 2})});
  add("SplitEqual", NodeBuilder("Split", 1, 3).i("axis", -1), {floats({2, 9})});
  add("Slice", NodeBuilder("Slice", 5),
      {floats({4, 6, 5}), int64s({2}, {1, -1}), int64s({2}, {3, 0}), int64s({2}, {0, 2}),
       int64s({2}, {1, -2})});
  add("Gather", NodeBuilder("Gather", 2), {floats({10, 4}), int64s({2, 3}, {0, 9, -1, 3, 3, -10})});
  add("GatherAxis1", NodeBuilder("Gather", 2).i("axis", 1),
      {floats({3, 5, 2}), int64s({4}, {4, 0, -2, 1})});
  add("GatherInt32Indices", NodeBuilder("Gather", 2),
      {floats({6, 3}), castTo(int64s({4}, {5, 0, -1, 2}), ElemType::Int32)});
  add("GatherEmbedding", NodeBuilder("Gather", 2), {floats({2000, 256}), int64s({8, 64}, 0, 1999)});
  // Reductions and losses.
  add("ReduceSum", NodeBuilder("ReduceSum", 2).i("keepdims", 0),
      {floats({3, 4, 5}), int64s({1}, {1})});
  add("ReduceSumAll", NodeBuilder("ReduceSum", 1), {floats({64, 300})});
  add("ReduceMeanRows", NodeBuilder("ReduceMean", 1).ints("axes", {1}), {floats({64, 3000})});
  add("ReduceMeanColumns", NodeBuilder("ReduceMean", 1).ints("axes", {0, 2}),
      {floats({300, 4, 7})});
  add("CrossEntropyMean", NodeBuilder("SoftmaxCrossEntropyLoss", 2, 2),
      {floats({512, 2000}, -4, 4), int64s({512}, 0, 1999)});
  add("CrossEntropySum", NodeBuilder("SoftmaxCrossEntropyLoss", 2).s("reduction", "sum"),
      {floats({6, 10}), int64s({6}, 0, 9)});
  add("CrossEntropyNone",
      NodeBuilder("SoftmaxCrossEntropyLoss", 2).s("reduction", "none").i("ignore_index", 2),
      {floats({2, 5, 3}), int64s({2, 3}, {2, 0, 4, 1, 2, 3})});
  add("CrossEntropyIgnore", NodeBuilder("SoftmaxCrossEntropyLoss", 2).i("ignore_index", 3),
      {floats({8, 5}), int64s({8}, {3, 0, 4, 3, 1, 2, 3, 0})});
  // Gradients of domain pipec.
  add("SumToLast", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {4}), {floats({2, 3, 4})});
  add("SumToMiddle", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {3, 1}),
      {floats({2, 3, 4})});
  add("SumToBias", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {256}),
      {floats({8, 64, 256})});
  add("SumToScalar", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {}), {floats({40, 50})});
  for (const char *op : {"ReluGrad", "TanhGrad", "SigmoidGrad", "ErfGrad", "GeluGrad"})
    add(op, NodeBuilder(op, 2, 1, "pipec"), {floats({9, 40}), floats({9, 40}, -3, 3)});
  add("GeluGradTanh", NodeBuilder("GeluGrad", 2, 1, "pipec").s("approximate", "tanh"),
      {floats({300}), floats({300}, -3, 3)});
  Tensor y = runCpu(NodeBuilder("Softmax", 1), {floats({16, 50})})[0];
  add("SoftmaxGrad", NodeBuilder("SoftmaxGrad", 2, 1, "pipec"), {floats({16, 50}), y});
  Tensor yMiddle = runCpu(NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 5, 3})})[0];
  add("SoftmaxGradMiddleAxis", NodeBuilder("SoftmaxGrad", 2, 1, "pipec").i("axis", 1),
      {floats({2, 5, 3}), yMiddle});
  add("GatherGrad", NodeBuilder("GatherGrad", 2, 1, "pipec").ints("shape", {10, 4}),
      {floats({2, 3, 4}), int64s({2, 3}, {0, 9, -1, 3, 3, -10})});
  add("GatherGradAxis1",
      NodeBuilder("GatherGrad", 2, 1, "pipec").i("axis", 1).ints("shape", {3, 5, 2}),
      {floats({3, 4, 2}), int64s({4}, {4, 0, -1, 4})});
  add("GatherGradEmbedding", NodeBuilder("GatherGrad", 2, 1, "pipec").ints("shape", {2000, 256}),
      {floats({8, 64, 256}), int64s({8, 64}, 0, 99)}); // many repeats: the atomics collide
  add("LayerNormGradInput", NodeBuilder("LayerNormGradInput", 3, 1, "pipec"),
      {floats({4, 6, 256}), floats({4, 6, 256}, -2, 3), floats({256})});
  add("LayerNormGradWeight", NodeBuilder("LayerNormGradWeight", 2, 1, "pipec").ints("shape", {256}),
      {floats({8, 64, 256}), floats({8, 64, 256}, -2, 3)});
  add("LayerNormGradWeightAxis1",
      NodeBuilder("LayerNormGradWeight", 2, 1, "pipec").i("axis", 1).ints("shape", {6, 8}),
      {floats({4, 6, 8}), floats({4, 6, 8})});
  add("CrossEntropyGradMean", NodeBuilder("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec"),
      {Tensor::scalar(1.0f), floats({512, 2000}, -4, 4), int64s({512}, 0, 1999)});
  add("CrossEntropyGradSumIgnore",
      NodeBuilder("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec")
          .s("reduction", "sum")
          .i("ignore_index", 1),
      {Tensor::scalar(0.5f), floats({2, 4, 3}), int64s({2, 3}, {1, 0, 3, 2, 1, 1})});
  // Convolution, pooling and batch normalization. Conv's GEMMs sum k =
  // channels * taps products in cuBLAS's order.
  auto convCase = [&](std::string name, const WindowCase &c, int64_t maps, bool bias, double atol) {
    Shape wShape{maps, c.x[1] / c.group};
    wShape.insert(wShape.end(), c.kernel.begin(), c.kernel.end());
    NodeBuilder forward("Conv", bias ? 3 : 2);
    withWindow(forward, c).i("group", c.group);
    std::vector<Tensor> inputs{floats(c.x), floats(wShape)};
    if (bias)
      inputs.push_back(floats({maps}));
    Tensor y = runCpu(forward, inputs)[0];
    add(name, forward, inputs, 17, atol);
    NodeBuilder gradInput("ConvGradInput", 2, 1, "pipec");
    withWindow(gradInput, c).i("group", c.group).ints("shape", c.x);
    add(name + "GradInput", gradInput, {floats(y.shape()), inputs[1]}, 17, atol);
    NodeBuilder gradWeight("ConvGradWeight", 2, 1, "pipec");
    withWindow(gradWeight, c).i("group", c.group).ints("shape", wShape);
    add(name + "GradWeight", gradWeight, {floats(y.shape()), inputs[0]}, 17, atol);
  };
  convCase("Conv3x3", {{4, 16, 14, 14}, {3, 3}, {1, 1}, {1, 1}, {1, 1, 1, 1}}, 32, true, 1e-4);
  convCase("ConvStridedDilated", {{2, 6, 11, 9}, {3, 2}, {2, 1}, {2, 1}, {1, 0, 2, 1}, 2}, 4, false,
           1e-4);
  convCase("ConvPointwise", {{3, 32, 8, 8}, {1, 1}, {1, 1}, {1, 1}, {0, 0, 0, 0}}, 48, true, 1e-4);
  convCase("ConvDepthwise", {{2, 8, 10, 10}, {3, 3}, {1, 1}, {1, 1}, {1, 1, 1, 1}, 8}, 8, true,
           1e-4);
  convCase("Conv1D", {{2, 4, 20}, {5}, {2}, {1}, {2, 2}}, 6, true, 1e-4);
  add("ConvValid", NodeBuilder("Conv", 2).s("auto_pad", "VALID"),
      {floats({2, 3, 9, 9}), floats({5, 3, 3, 3})});
  auto poolCase = [&](std::string name, const WindowCase &c, bool ceilMode, bool includePad) {
    for (bool isMax : {true, false}) {
      std::string op = isMax ? "MaxPool" : "AveragePool";
      NodeBuilder forward(op, 1);
      withWindow(forward, c, isMax).i("ceil_mode", ceilMode).i("count_include_pad", includePad);
      Tensor x = floats(c.x);
      Tensor y = runCpu(forward, {x})[0];
      add(op + name, forward, {x});
      NodeBuilder backward(op + "Grad", isMax ? 2 : 1, 1, "pipec");
      withWindow(backward, c, isMax).i("count_include_pad", includePad);
      if (isMax)
        add(op + "Grad" + name, backward, {floats(y.shape()), x});
      else
        add(op + "Grad" + name, backward.ints("shape", c.x), {floats(y.shape())});
    }
  };
  poolCase("3x3Ceil", {{4, 8, 15, 15}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, true, false);
  poolCase("3x3IncludePad", {{2, 4, 9, 10}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, false, true);
  poolCase("2x2", {{2, 16, 32, 32}, {2, 2}, {2, 2}, {1, 1}, {0, 0, 0, 0}}, false, false);
  add("GlobalAveragePool", NodeBuilder("GlobalAveragePool", 1), {floats({4, 64, 7, 7})});
  add("BatchNormalization", NodeBuilder("BatchNormalization", 5).f("epsilon", 1e-3f),
      {floats({4, 16, 9, 9}), floats({16}), floats({16}), floats({16}), floats({16}, 0.5f, 2)});
  add("BatchNormGradWeight", NodeBuilder("BatchNormGradWeight", 4, 1, "pipec"),
      {floats({8, 16, 12, 12}), floats({8, 16, 12, 12}), floats({16}), floats({16}, 0.5f, 2)});
  return cases;
}

class CudaOp : public ::testing::TestWithParam<OpCase> {};

TEST_P(CudaOp, MatchesCpu) {
  const OpCase &c = GetParam();
  // The reference runs everywhere: a case the CPU rejects is a broken test.
  std::vector<Tensor> expected = runCpu(c.node, c.inputs, c.opset);
  ASSERT_FALSE(expected.empty());
  if (!haveDevice())
    GTEST_SKIP() << "no CUDA device";
  auto backend = cuda::createCudaBackend(0, false);
  ASSERT_TRUE(!!backend) << llvm::toString(backend.takeError());
  auto &be = **backend;
  // Inputs as the executor hands them over: uploaded, except small integer
  // ones (shapes, axes, up to 16 elements here), which stay on the host.
  std::vector<Tensor> inputs;
  for (const Tensor &t : c.inputs) {
    bool small =
        (cpu::isInteger(t.elemType()) || t.elemType() == ElemType::Bool) && t.numElements() <= 16;
    auto in = small ? llvm::Expected<Tensor>(t) : be.upload(t);
    ASSERT_TRUE(!!in) << llvm::toString(in.takeError());
    inputs.push_back(*in);
  }
  auto actual = be.run(c.node, c.opset, pointers(inputs));
  ASSERT_TRUE(!!actual) << llvm::toString(actual.takeError());
  ASSERT_EQ(actual->size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    auto host = be.download((*actual)[i]);
    ASSERT_TRUE(!!host) << llvm::toString(host.takeError());
    EXPECT_TRUE(close(*host, expected[i], c.rtol, c.atol)) << "output " << i;
  }
  llvm::Error err = be.synchronize();
  EXPECT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
  EXPECT_TRUE(be.fallbackOps().empty()) << c.node.op_type() << " fell back to the CPU";
}

INSTANTIATE_TEST_SUITE_P(AllKernels, CudaOp, ::testing::ValuesIn(opCases()),
                         [](const ::testing::TestParamInfo<OpCase> &info) {
                           return info.param.name;
                         });

//===----------------------------------------------------------------------===//
// The backend's own operations
//===----------------------------------------------------------------------===//

class CudaBackendTest : public ::testing::Test {
protected:
  void SetUp() override {
    if (!haveDevice())
      GTEST_SKIP() << "no CUDA device";
    auto made = cuda::createCudaBackend(0, false);
    ASSERT_TRUE(!!made) << llvm::toString(made.takeError());
    backend = std::move(*made);
  }
  Tensor up(const Tensor &t) {
    auto d = backend->upload(t);
    EXPECT_TRUE(!!d) << llvm::toString(d.takeError());
    return d ? *d : Tensor();
  }
  Tensor down(const Tensor &t) {
    auto h = backend->download(t);
    EXPECT_TRUE(!!h) << llvm::toString(h.takeError());
    return h ? *h : Tensor();
  }
  std::unique_ptr<rt::Backend> backend;
};

TEST_F(CudaBackendTest, Bf16GemmIsCloseToFp32) {
  auto made = cuda::createCudaBackend(0, true);
  ASSERT_TRUE(!!made) << llvm::toString(made.takeError());
  rt::Backend &bf16 = **made;
  // Positive operands: no cancellation, so the relative error stays near
  // bf16's 2^-9 per product.
  Tensor a = floats({64, 256}, 0, 1), b = floats({256, 128}, 0, 1);
  Tensor expected = runCpu(NodeBuilder("MatMul", 2), {a, b})[0];
  auto da = bf16.upload(a), db = bf16.upload(b);
  ASSERT_TRUE(da && db);
  auto out = bf16.run(NodeBuilder("MatMul", 2), 17, {&*da, &*db});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  auto host = bf16.download((*out)[0]);
  ASSERT_TRUE(!!host) << llvm::toString(host.takeError());
  EXPECT_TRUE(close(*host, expected, 1e-2, 1e-2));
  Tensor bias = floats({128});
  auto dbias = bf16.upload(bias);
  auto gemm = bf16.run(NodeBuilder("Gemm", 3), 17, {&*da, &*db, &*dbias});
  ASSERT_TRUE(!!gemm) << llvm::toString(gemm.takeError());
  auto gemmHost = bf16.download((*gemm)[0]);
  ASSERT_TRUE(!!gemmHost);
  EXPECT_TRUE(close(*gemmHost, runCpu(NodeBuilder("Gemm", 3), {a, b, bias})[0], 1e-2, 1e-2));
}

TEST_F(CudaBackendTest, OptimizerMatchesCpuBackend) {
  using Kind = rt::OptimizerUpdate::Kind;
  const std::pair<Kind, int> kinds[] = {{Kind::Sgd, 0}, {Kind::Momentum, 1}, {Kind::AdamW, 2}};
  for (const auto &[kind, code] : kinds) {
    Tensor w = floats({1000}), wRef = w.clone();
    Tensor mRef(ElemType::Float, {1000}), vRef(ElemType::Float, {1000});
    Tensor dw = up(w), m, v;
    for (int step = 0; step < 3; ++step) {
      Tensor g = floats({1000});
      k::OptimizerParams p = optimizerParams(code, step);
      referenceUpdate(p, step, wRef, g, mRef, vRef);
      rt::OptimizerUpdate u;
      u.kind = kind;
      u.lr = p.lr;
      u.momentum = p.momentum;
      u.weightDecay = p.weightDecay;
      u.beta1 = p.beta1;
      u.beta2 = p.beta2;
      u.epsilon = p.epsilon;
      u.gradScale = p.gradScale;
      u.step = step;
      Tensor before = dw;
      llvm::Error err = backend->optimize(u, dw, up(g), m, v);
      ASSERT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
      EXPECT_NE(dw.rawData(), before.rawData())
          << "the weight must be a new tensor, not written in place";
    }
    EXPECT_TRUE(close(down(dw), wRef, 1e-6, 1e-6)) << "kind " << code;
    if (code >= 1) {
      EXPECT_TRUE(close(down(m), mRef, 1e-6, 1e-6)) << "kind " << code;
    }
    if (code == 2) {
      EXPECT_TRUE(close(down(v), vRef, 1e-6, 1e-6)) << "kind " << code;
    }
  }
}

TEST_F(CudaBackendTest, SumsAccumulateAndZeros) {
  Tensor a = floats({3, 70}), b = floats({3, 70}), c = floats({3, 70});
  Tensor da = up(a), db = up(b);
  auto total = backend->sum({&da, &db, &c}); // a host term is uploaded
  ASSERT_TRUE(!!total) << llvm::toString(total.takeError());
  Tensor expected = runCpu(NodeBuilder("Sum", 3), {a, b, c})[0];
  EXPECT_TRUE(close(down(*total), expected));
  auto acc = backend->zeros(ElemType::Float, {3, 70});
  ASSERT_TRUE(!!acc);
  EXPECT_TRUE(close(down(*acc), Tensor(ElemType::Float, {3, 70})));
  for (const Tensor *t : {&da, &db, &c}) {
    llvm::Error err = backend->addInto(*acc, *t);
    ASSERT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
  }
  EXPECT_TRUE(close(down(*acc), expected));
  llvm::Error err = backend->addInto(*acc, up(floats({5})));
  EXPECT_TRUE(static_cast<bool>(err));
  llvm::consumeError(std::move(err));
}

TEST_F(CudaBackendTest, PoolReusesFreedMemory) {
  auto first = backend->zeros(ElemType::Float, {1 << 20});
  ASSERT_TRUE(!!first);
  void *address = first->rawData();
  *first = Tensor(); // back to the pool
  auto before = cuda::poolStats(*backend);
  ASSERT_TRUE(before.has_value());
  auto second = backend->zeros(ElemType::Float, {1 << 20});
  ASSERT_TRUE(!!second);
  auto after = cuda::poolStats(*backend);
  EXPECT_EQ(second->rawData(), address);
  EXPECT_EQ(after->deviceAllocations, before->deviceAllocations);
  EXPECT_EQ(after->hits, before->hits + 1);
  // A tensor outliving its backend keeps the pool (and its memory) alive.
  Tensor survivor = *second;
  backend.reset();
  EXPECT_EQ(survivor.rawData(), address);
}

/// Rank \p reader's backend reads a tensor of rank \p owner's (two ranks of
/// a local run, on one device or two): the owner's pool must not hand the
/// memory out again until the reader's queued work is done, even after
/// every other handle is gone. Addresses show it: the pool reuses a freed
/// block of the same size class at once.
void checkForeignTensorIsHeld(int ownerDevice, int readerDevice) {
  auto owner = cuda::createCudaBackend(ownerDevice, false);
  auto reader = cuda::createCudaBackend(readerDevice, false);
  ASSERT_TRUE(owner && reader);
  Tensor x = floats({1 << 16});
  Tensor shared;
  {
    auto made = (*owner)->upload(x);
    ASSERT_TRUE(!!made) << llvm::toString(made.takeError());
    shared = std::move(*made);
  }
  void *address = shared.rawData();
  llvm::Error synced = (*owner)->synchronize(); // as before a send
  ASSERT_FALSE(static_cast<bool>(synced)) << llvm::toString(std::move(synced));
  auto negated = (*reader)->run(NodeBuilder("Neg", 1), 17, {&shared});
  ASSERT_TRUE(!!negated) << llvm::toString(negated.takeError());
  shared = Tensor(); // the owner's last handle
  auto during = (*owner)->zeros(ElemType::Float, {1 << 16});
  ASSERT_TRUE(!!during);
  EXPECT_NE(during->rawData(), address) << "reused while the reader may still read it";
  auto host = (*reader)->download((*negated)[0]); // retires the reader's holds
  ASSERT_TRUE(!!host) << llvm::toString(host.takeError());
  Tensor expected = runCpu(NodeBuilder("Neg", 1), {x})[0];
  EXPECT_TRUE(close(*host, expected));
  auto after = (*owner)->zeros(ElemType::Float, {1 << 16});
  ASSERT_TRUE(!!after);
  EXPECT_EQ(after->rawData(), address) << "the reader's hold was never released";
}

TEST_F(CudaBackendTest, TensorsOfAnotherBackendOnTheDeviceAreHeld) {
  checkForeignTensorIsHeld(0, 0);
}

TEST_F(CudaBackendTest, TensorsOfAnotherDeviceAreHeldWhileCopied) {
  auto devices = cuda::listDevices();
  if (!devices || devices->size() < 2)
    GTEST_SKIP() << "needs two CUDA devices";
  checkForeignTensorIsHeld(0, 1);
}

TEST_F(CudaBackendTest, ViewsShareMemory) {
  Tensor x = up(floats({2, 3, 4}));
  Tensor shape = int64s({2}, {6, 4});
  auto out = backend->run(NodeBuilder("Reshape", 2), 17, {&x, &shape});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  EXPECT_EQ((*out)[0].rawData(), x.rawData());
  EXPECT_EQ((*out)[0].shape(), (Shape{6, 4}));
  EXPECT_FALSE((*out)[0].onHost());
}

TEST_F(CudaBackendTest, ShapeArithmeticStaysOnTheHost) {
  Tensor x = up(floats({2, 3, 4}));
  auto shape = backend->run(NodeBuilder("Shape", 1), 17, {&x});
  ASSERT_TRUE(!!shape) << llvm::toString(shape.takeError());
  ASSERT_TRUE((*shape)[0].onHost());
  Tensor index = Tensor::scalar<int64_t>(1);
  auto dim = backend->run(NodeBuilder("Gather", 2), 17, {&(*shape)[0], &index});
  ASSERT_TRUE(!!dim) << llvm::toString(dim.takeError());
  EXPECT_TRUE((*dim)[0].onHost());
  EXPECT_EQ((*dim)[0].getInt64(0), 3);
  EXPECT_TRUE(backend->fallbackOps().empty());
}

// Uploads larger than the pinned ring go through it in pieces: the bytes
// arrive in order, also while another upload is in flight.
TEST_F(CudaBackendTest, LargeUploadsRoundTrip) {
  Tensor big = floats({5 << 20}), small = floats({1000});
  Tensor dBig = up(big), dSmall = up(small), again = up(big);
  EXPECT_TRUE(close(down(dBig), big, 0, 0));
  EXPECT_TRUE(close(down(dSmall), small, 0, 0));
  EXPECT_TRUE(close(down(again), big, 0, 0));
}

TEST_F(CudaBackendTest, SumOfSquaresMatchesCpuBackend) {
  // Large enough for many blocks; a double tensor and an empty one too.
  Tensor big = floats({1 << 20}, -2, 2), small = floats({37}), none(ElemType::Float, {0});
  Tensor wide(ElemType::Double, {1000});
  for (int64_t i = 0; i < wide.numElements(); ++i)
    wide.setDouble(i, std::sin(static_cast<double>(i)));
  auto cpuBackend = rt::makeCpuBackend();
  auto expected = cpuBackend->sumOfSquares({&big, &small, &none, &wide}, 0.25);
  ASSERT_TRUE(!!expected) << llvm::toString(expected.takeError());
  Tensor dBig = up(big), dSmall = up(small), dWide = up(wide);
  auto actual = backend->sumOfSquares({&dBig, &dSmall, &none, &dWide}, 0.25);
  ASSERT_TRUE(!!actual) << llvm::toString(actual.takeError());
  EXPECT_NEAR(*actual, *expected, 1e-12 * *expected);
}

TEST_F(CudaBackendTest, FusedNodesOfIntegersRunTheirBodyOnTheDevice) {
  onnx::NodeProto add = test::makeNode("Add", {"in0", "in1"}, "s"),
                  mul = test::makeNode("Mul", {"s", "in0"}, "out0");
  onnx::NodeProto fused = cpu::makeFusedNode("ints", {&add, &mul}, {"in0", "in1"}, {"out0"});
  Tensor a = up(int64s({64, 3}, -50, 50)), b = up(int64s({3}, -5, 5));
  auto out = backend->run(fused, 17, {&a, &b});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  ASSERT_EQ(out->size(), 1u);
  EXPECT_FALSE((*out)[0].onHost());
  Tensor expected = runCpu(fused, {down(a), down(b)})[0];
  EXPECT_EQ(down((*out)[0]).toInt64Vector(), expected.toInt64Vector());
  EXPECT_TRUE(backend->fallbackOps().empty());
}

TEST_F(CudaBackendTest, OpsWithoutKernelsFallBackAndAreCounted) {
  // Conv's SAME_* padding is computed by the CPU kernels only.
  Tensor x = floats({1, 2, 6, 6}), w = floats({3, 2, 3, 3});
  onnx::NodeProto conv = NodeBuilder("Conv", 2).s("auto_pad", "SAME_UPPER");
  Tensor expected = runCpu(conv, {x, w})[0];
  Tensor dx = up(x), dw = up(w);
  auto out = backend->run(conv, 17, {&dx, &dw});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  EXPECT_FALSE((*out)[0].onHost());
  EXPECT_TRUE(close(down((*out)[0]), expected));
  EXPECT_EQ(backend->fallbackOps(), (std::map<std::string, int64_t>{{"Conv", 1}}));
}

TEST_F(CudaBackendTest, BadIndicesAreReportedNamingTheNode) {
  Tensor data = up(floats({4, 3}));
  Tensor indices = up(int64s({2}, {1, 4}));
  onnx::NodeProto gather = NodeBuilder("Gather", 2);
  auto out = backend->run(gather, 17, {&data, &indices});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  llvm::Error err = backend->synchronize();
  ASSERT_TRUE(static_cast<bool>(err));
  std::string message = llvm::toString(std::move(err));
  EXPECT_NE(message.find("node 'Gather' (Gather)"), std::string::npos) << message;
  // Reported once; the backend goes on.
  llvm::Error again = backend->synchronize();
  EXPECT_FALSE(static_cast<bool>(again)) << llvm::toString(std::move(again));
}

TEST_F(CudaBackendTest, MalformedNodesGiveTheCpuError) {
  Tensor a = up(floats({2, 3})), b = up(floats({4, 5}));
  auto out = backend->run(NodeBuilder("MatMul", 2), 17, {&a, &b});
  ASSERT_FALSE(!!out);
  std::string message = llvm::toString(out.takeError());
  EXPECT_NE(message.find("node 'MatMul' (MatMul): inner dimensions differ"), std::string::npos)
      << message;
}

} // namespace
