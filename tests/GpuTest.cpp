//===- GpuTest.cpp - The CUDA backend against the CPU kernels -----------===//
//
// Three layers:
//  - GpuKernelBodies: the per-element functions of KernelBodies.h run on the
//    host (one lane per row) against the CPU kernels. They need no device,
//    so the index math, broadcasting, reductions and row algorithms are
//    checked on every machine.
//  - CudaOp: every device kernel through the CUDA backend against the CPU
//    kernel on random data (the same NodeProto through cpu::runOp and
//    the backend), and that it did not fall back. The CPU half runs
//    everywhere, so a malformed case fails here too; the device half skips
//    without a device.
//  - CudaBackend: bf16 GEMMs, the optimizer, sums, the memory pool,
//    fallbacks, host shape arithmetic and errors found on the device.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include "ops/OpRegistry.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/cuda/CudaBackend.h"
#include "runtime/cuda/Devices.h"
#include "runtime/kernels/KernelBodies.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

using namespace pipec;
using cpu::Tensor;
using pipec::DType;
using Shape = std::vector<int64_t>;
namespace k = kernels;
using namespace pipec::test;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

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
  auto backend = cuda::createCudaBackend(missing, false, rt::makeCpuBackend());
  ASSERT_FALSE(!!backend);
  std::string message = llvm::toString(backend.takeError());
  EXPECT_NE(message.find("no CUDA device"), std::string::npos) << message;
  std::string error;
  EXPECT_EQ(pipecMakeCudaBackend(missing, false, rt::makeCpuBackend().release(), &error), nullptr);
  EXPECT_NE(error.find("no CUDA device"), std::string::npos) << error;
}

//===----------------------------------------------------------------------===//
// Kernel bodies on the host
//===----------------------------------------------------------------------===//

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

/// The cases, group by group; each group appends to \p cases.
class CaseList {
public:
  void add(std::string name, onnx::NodeProto node, std::vector<Tensor> inputs, int64_t opset = 17,
           double atol = 1e-5) {
    cases.push_back({std::move(name), std::move(node), std::move(inputs), opset, 1e-4, atol});
  }
  std::vector<OpCase> cases;
};

void elementwiseCases(CaseList &list) {
  // Every unary float op of the registry, on inputs inside its domain; and
  // a few more shapes and attributes below.
  for (const OpDef &def : allOps()) {
    if (!def.elem || def.minInputs != 1 || !kernels::isFloatMath(*def.elem))
      continue;
    Tensor in = floats({7, 33}, 0.25f, 0.9f);
    auto probe = cpu::runOp(NodeBuilder(def.name.str(), 1), 17, {&in});
    if (!probe || std::isnan(probe->front().data<float>()[0]))
      in = floats({7, 33}, 1.1f, 3.0f);
    if (probe)
      list.add("Any" + def.name.str(), NodeBuilder(def.name.str(), 1), {in}, 20);
    else
      llvm::consumeError(probe.takeError());
  }
  for (const char *op : {"Relu", "Tanh", "Sigmoid", "Erf", "Exp", "Neg", "Abs", "Identity"})
    list.add(op, NodeBuilder(op, 1), {floats({7, 33}, -3, 3)});
  for (const char *op : {"Sqrt", "Log", "Reciprocal"})
    list.add(op, NodeBuilder(op, 1), {floats({7, 33}, 0.25f, 4)});
  list.add("GeluErf", NodeBuilder("Gelu", 1), {floats({300}, -4, 4)});
  list.add("GeluTanh", NodeBuilder("Gelu", 1).s("approximate", "tanh"), {floats({300}, -4, 4)});
  list.add("LeakyRelu", NodeBuilder("LeakyRelu", 1).f("alpha", 0.2f), {floats({300})});
  list.add("AddLarge", NodeBuilder("Add", 2), {floats({1000, 300}), floats({300})});
  list.add("FusedGelu", fusedGelu(), fusedGeluInputs(512, 768));
  // The bias in cuBLASLt's epilogue; a [rows, n] addend runs the two nodes.
  list.add("MatMulBiasEpilogue", matMulBias(),
           {floats({4, 96, 128}), floats({128, 384}), floats({384})});
  list.add("MatMulBiasOddSizes", matMulBias(), {floats({7, 33}), floats({33, 5}), floats({1, 5})});
  list.add("MatMulBiasNotAnEpilogue", matMulBias(),
           {floats({7, 33}), floats({33, 5}), floats({7, 5})});
  list.add("AddBroadcast", NodeBuilder("Add", 2), {floats({2, 1, 4}), floats({3, 1})});
  list.add("SubBroadcast", NodeBuilder("Sub", 2), {floats({2, 3, 4}), floats({4})});
  list.add("MulScalar", NodeBuilder("Mul", 2), {floats({5, 6}), floats({})});
  list.add("Div", NodeBuilder("Div", 2), {floats({5, 6}), floats({5, 6}, 0.5f, 2)});
  list.add("PowSquare", NodeBuilder("Pow", 2), {floats({40}), Tensor::scalar(2.0f)});
  list.add("PowTensor", NodeBuilder("Pow", 2), {floats({4, 10}, 0.5f, 2), floats({10}, -1, 2)});
  list.add("AddInt64", NodeBuilder("Add", 2), {int64s({30, 4}, -9, 9), int64s({4}, -9, 9)});
  list.add("MulInt64", NodeBuilder("Mul", 2), {int64s({30, 4}, -9, 9), int64s({30, 1}, -9, 9)});
  list.add("EqualInt64", NodeBuilder("Equal", 2), {int64s({30, 4}, 0, 2), int64s({4}, 0, 2)});
  Tensor a = floats({20});
  Tensor b = a.clone();
  for (int i = 0; i < 20; i += 3)
    b.data<float>()[i] += 1;
  list.add("EqualFloat", NodeBuilder("Equal", 2), {a, b});
  list.add("Less", NodeBuilder("Less", 2), {floats({4, 5}), floats({5})});
  list.add("Greater", NodeBuilder("Greater", 2), {floats({4, 5}), floats({4, 1})});
  list.add("Not", NodeBuilder("Not", 1), {bools({40})});
  list.add("Where", NodeBuilder("Where", 3), {bools({2, 1, 4}), floats({3, 4}), floats({})});
  list.add("WhereInt64", NodeBuilder("Where", 3),
           {bools({50}), int64s({50}, 0, 9), int64s({1}, 0, 9)});
  list.add("Sum", NodeBuilder("Sum", 3), {floats({3, 4}), floats({4}), floats({2, 3, 4})});
  list.add("CastFloatToInt64", NodeBuilder("Cast", 1).i("to", 7), {floats({30}, -50, 50)});
  list.add("CastInt64ToFloat", NodeBuilder("Cast", 1).i("to", 1), {int64s({30}, -50, 50)});
  list.add("CastFloatToBool", NodeBuilder("Cast", 1).i("to", 9),
           {Tensor::fromValues<float>({4}, {0, 1, -2, 0})});
  list.add("CastBoolToFloat", NodeBuilder("Cast", 1).i("to", 1), {bools({40})});
  list.add("CastInt64ToInt32", NodeBuilder("Cast", 1).i("to", 6), {int64s({40}, -99, 99)});
  list.add("CastFloatToDouble", NodeBuilder("Cast", 1).i("to", 11), {floats({9})});
}

void productCases(CaseList &list) {
  // Matrix products.
  list.add("MatMul2D", NodeBuilder("MatMul", 2), {floats({4, 8}), floats({8, 5})});
  list.add("MatMulFolded", NodeBuilder("MatMul", 2), {floats({2, 3, 4, 8}), floats({8, 5})});
  list.add("MatMulBatched", NodeBuilder("MatMul", 2), {floats({2, 3, 4, 8}), floats({2, 3, 8, 5})});
  list.add("MatMulPartialBroadcast", NodeBuilder("MatMul", 2),
           {floats({2, 1, 4, 8}), floats({3, 8, 5})});
  list.add("MatMulLeftShared", NodeBuilder("MatMul", 2), {floats({4, 8}), floats({2, 8, 5})});
  list.add("MatMulVectorLeft", NodeBuilder("MatMul", 2), {floats({8}), floats({2, 8, 5})});
  list.add("MatMulVectorRight", NodeBuilder("MatMul", 2), {floats({2, 4, 8}), floats({8})});
  // k = 256 products summed in another order than OpenBLAS's: outputs near 0
  // differ by up to ~k * 2^-24 in absolute terms.
  list.add("MatMulLarge", NodeBuilder("MatMul", 2), {floats({8, 64, 256}), floats({256, 384})}, 17,
           2e-5);
  list.add("Gemm", NodeBuilder("Gemm", 3), {floats({4, 8}), floats({8, 5}), floats({5})});
  list.add("GemmTransposed",
           NodeBuilder("Gemm", 3).i("transA", 1).i("transB", 1).f("alpha", 0.5f).f("beta", 2),
           {floats({8, 4}), floats({5, 8}), floats({4, 5})});
  list.add("GemmTransB", NodeBuilder("Gemm", 3).i("transB", 1),
           {floats({4, 8}), floats({5, 8}), floats({1, 1})});
  list.add("GemmNoBias", NodeBuilder("Gemm", 2).i("transA", 1), {floats({8, 4}), floats({8, 5})});
}

void rowCases(CaseList &list) {
  // Rows.
  list.add("Softmax", NodeBuilder("Softmax", 1), {floats({128, 2000}, -5, 5)});
  list.add("SoftmaxMiddleAxis", NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 5, 3})});
  list.add("SoftmaxOpset11", NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 3, 4})}, 11);
  list.add("LogSoftmax", NodeBuilder("LogSoftmax", 1), {floats({6, 9})});
  list.add("LayerNorm", NodeBuilder("LayerNormalization", 3, 3).f("epsilon", 1e-5f),
           {floats({4, 6, 256}), floats({256}), floats({256})});
  list.add("LayerNormAxis1", NodeBuilder("LayerNormalization", 2).i("axis", 1),
           {floats({4, 6, 8}, 1, 3), floats({6, 8})});
}

void movementCases(CaseList &list) {
  // Data movement.
  list.add("Transpose", NodeBuilder("Transpose", 1).ints("perm", {2, 0, 1}), {floats({2, 3, 4})});
  list.add("TransposeLastTwo", NodeBuilder("Transpose", 1).ints("perm", {0, 1, 3, 2}),
           {floats({2, 4, 64, 32})});
  list.add("TransposeDefault", NodeBuilder("Transpose", 1), {floats({3, 5})});
  list.add("Reshape", NodeBuilder("Reshape", 2), {floats({2, 3, 4}), int64s({2}, {-1, 4})});
  list.add("ReshapeZero", NodeBuilder("Reshape", 2), {floats({2, 3, 4}), int64s({3}, {0, 4, 3})});
  list.add("Flatten", NodeBuilder("Flatten", 1).i("axis", 2), {floats({2, 3, 4})});
  list.add("Squeeze", NodeBuilder("Squeeze", 2), {floats({2, 1, 4}), int64s({1}, {1})});
  list.add("Unsqueeze", NodeBuilder("Unsqueeze", 2), {floats({2, 4}), int64s({2}, {0, -1})});
  list.add("Expand", NodeBuilder("Expand", 2), {floats({3, 1}), int64s({3}, {2, 3, 4})});
  list.add("Concat", NodeBuilder("Concat", 3).i("axis", 1),
           {floats({2, 3, 4}), floats({2, 1, 4}), floats({2, 2, 4})});
  list.add("ConcatLast", NodeBuilder("Concat", 2).i("axis", -1),
           {int64s({20, 3}, 0, 9), int64s({20, 2}, 0, 9)});
  list.add("Split", NodeBuilder("Split", 2, 2).i("axis", 1),
           {floats({2, 3, 4}), int64s({2}, {1, 2})});
  list.add("SplitEqual", NodeBuilder("Split", 1, 3).i("axis", -1), {floats({2, 9})});
  list.add("Slice", NodeBuilder("Slice", 5),
           {floats({4, 6, 5}), int64s({2}, {1, -1}), int64s({2}, {3, 0}), int64s({2}, {0, 2}),
            int64s({2}, {1, -2})});
  list.add("Gather", NodeBuilder("Gather", 2),
           {floats({10, 4}), int64s({2, 3}, {0, 9, -1, 3, 3, -10})});
  list.add("GatherAxis1", NodeBuilder("Gather", 2).i("axis", 1),
           {floats({3, 5, 2}), int64s({4}, {4, 0, -2, 1})});
  list.add("GatherInt32Indices", NodeBuilder("Gather", 2),
           {floats({6, 3}), castTo(int64s({4}, {5, 0, -1, 2}), DType::I32)});
  list.add("GatherEmbedding", NodeBuilder("Gather", 2),
           {floats({2000, 256}), int64s({8, 64}, 0, 1999)});
}

void reductionCases(CaseList &list) {
  // Reductions and losses.
  list.add("ReduceSum", NodeBuilder("ReduceSum", 2).i("keepdims", 0),
           {floats({3, 4, 5}), int64s({1}, {1})});
  list.add("ReduceSumAll", NodeBuilder("ReduceSum", 1), {floats({64, 300})});
  list.add("ReduceMeanRows", NodeBuilder("ReduceMean", 1).ints("axes", {1}), {floats({64, 3000})});
  list.add("ReduceMeanColumns", NodeBuilder("ReduceMean", 1).ints("axes", {0, 2}),
           {floats({300, 4, 7})});
  list.add("CrossEntropyMean", NodeBuilder("SoftmaxCrossEntropyLoss", 2, 2),
           {floats({512, 2000}, -4, 4), int64s({512}, 0, 1999)});
  list.add("CrossEntropySum", NodeBuilder("SoftmaxCrossEntropyLoss", 2).s("reduction", "sum"),
           {floats({6, 10}), int64s({6}, 0, 9)});
  list.add("CrossEntropyNone",
           NodeBuilder("SoftmaxCrossEntropyLoss", 2).s("reduction", "none").i("ignore_index", 2),
           {floats({2, 5, 3}), int64s({2, 3}, {2, 0, 4, 1, 2, 3})});
  list.add("CrossEntropyIgnore", NodeBuilder("SoftmaxCrossEntropyLoss", 2).i("ignore_index", 3),
           {floats({8, 5}), int64s({8}, {3, 0, 4, 3, 1, 2, 3, 0})});
}

void gradientCases(CaseList &list) {
  // Gradients of domain pipec.
  list.add("SumToLast", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {4}),
           {floats({2, 3, 4})});
  list.add("SumToMiddle", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {3, 1}),
           {floats({2, 3, 4})});
  list.add("SumToBias", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {256}),
           {floats({8, 64, 256})});
  list.add("SumToScalar", NodeBuilder("SumTo", 1, 1, "pipec").ints("shape", {}),
           {floats({40, 50})});
  for (const char *op : {"Relu", "Tanh", "Sigmoid", "Erf", "Gelu", "Sin", "Softplus"})
    list.add(std::string(op) + "UnaryGrad", NodeBuilder("UnaryGrad", 2, 1, "pipec").s("op", op),
             {floats({9, 40}), floats({9, 40}, -3, 3)});
  list.add("GeluTanhUnaryGrad",
           NodeBuilder("UnaryGrad", 2, 1, "pipec").s("op", "Gelu").s("approximate", "tanh"),
           {floats({300}), floats({300}, -3, 3)});
  Tensor y = runCpu(NodeBuilder("Softmax", 1), {floats({16, 50})})[0];
  list.add("SoftmaxGrad", NodeBuilder("SoftmaxGrad", 2, 1, "pipec"), {floats({16, 50}), y});
  Tensor yMiddle = runCpu(NodeBuilder("Softmax", 1).i("axis", 1), {floats({2, 5, 3})})[0];
  list.add("SoftmaxGradMiddleAxis", NodeBuilder("SoftmaxGrad", 2, 1, "pipec").i("axis", 1),
           {floats({2, 5, 3}), yMiddle});
  list.add("GatherGrad", NodeBuilder("GatherGrad", 2, 1, "pipec").ints("shape", {10, 4}),
           {floats({2, 3, 4}), int64s({2, 3}, {0, 9, -1, 3, 3, -10})});
  list.add("GatherGradAxis1",
           NodeBuilder("GatherGrad", 2, 1, "pipec").i("axis", 1).ints("shape", {3, 5, 2}),
           {floats({3, 4, 2}), int64s({4}, {4, 0, -1, 4})});
  list.add("GatherGradEmbedding",
           NodeBuilder("GatherGrad", 2, 1, "pipec").ints("shape", {2000, 256}),
           {floats({8, 64, 256}), int64s({8, 64}, 0, 99)}); // many repeats: the atomics collide
  list.add("LayerNormGradInput", NodeBuilder("LayerNormGradInput", 3, 1, "pipec"),
           {floats({4, 6, 256}), floats({4, 6, 256}, -2, 3), floats({256})});
  list.add("LayerNormGradWeight",
           NodeBuilder("LayerNormGradWeight", 2, 1, "pipec").ints("shape", {256}),
           {floats({8, 64, 256}), floats({8, 64, 256}, -2, 3)});
  list.add("LayerNormGradWeightAxis1",
           NodeBuilder("LayerNormGradWeight", 2, 1, "pipec").i("axis", 1).ints("shape", {6, 8}),
           {floats({4, 6, 8}), floats({4, 6, 8})});
  list.add("CrossEntropyGradMean", NodeBuilder("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec"),
           {Tensor::scalar(1.0f), floats({512, 2000}, -4, 4), int64s({512}, 0, 1999)});
  list.add("CrossEntropyGradSumIgnore",
           NodeBuilder("SoftmaxCrossEntropyLossGrad", 3, 1, "pipec")
               .s("reduction", "sum")
               .i("ignore_index", 1),
           {Tensor::scalar(0.5f), floats({2, 4, 3}), int64s({2, 3}, {1, 0, 3, 2, 1, 1})});
}

void convolutionCases(CaseList &list) {
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
    list.add(name, forward, inputs, 17, atol);
    NodeBuilder gradInput("ConvGradInput", 2, 1, "pipec");
    withWindow(gradInput, c).i("group", c.group).ints("shape", c.x);
    list.add(name + "GradInput", gradInput, {floats(y.shape()), inputs[1]}, 17, atol);
    NodeBuilder gradWeight("ConvGradWeight", 2, 1, "pipec");
    withWindow(gradWeight, c).i("group", c.group).ints("shape", wShape);
    list.add(name + "GradWeight", gradWeight, {floats(y.shape()), inputs[0]}, 17, atol);
  };
  convCase("Conv3x3", {{4, 16, 14, 14}, {3, 3}, {1, 1}, {1, 1}, {1, 1, 1, 1}}, 32, true, 1e-4);
  convCase("ConvStridedDilated", {{2, 6, 11, 9}, {3, 2}, {2, 1}, {2, 1}, {1, 0, 2, 1}, 2}, 4, false,
           1e-4);
  convCase("ConvPointwise", {{3, 32, 8, 8}, {1, 1}, {1, 1}, {1, 1}, {0, 0, 0, 0}}, 48, true, 1e-4);
  convCase("ConvDepthwise", {{2, 8, 10, 10}, {3, 3}, {1, 1}, {1, 1}, {1, 1, 1, 1}, 8}, 8, true,
           1e-4);
  convCase("Conv1D", {{2, 4, 20}, {5}, {2}, {1}, {2, 2}}, 6, true, 1e-4);
  list.add("ConvValid", NodeBuilder("Conv", 2).s("auto_pad", "VALID"),
           {floats({2, 3, 9, 9}), floats({5, 3, 3, 3})});
  auto poolCase = [&](std::string name, const WindowCase &c, bool ceilMode, bool includePad) {
    for (bool isMax : {true, false}) {
      std::string op = isMax ? "MaxPool" : "AveragePool";
      NodeBuilder forward(op, 1);
      withWindow(forward, c, isMax).i("ceil_mode", ceilMode).i("count_include_pad", includePad);
      Tensor x = floats(c.x);
      Tensor y = runCpu(forward, {x})[0];
      list.add(op + name, forward, {x});
      NodeBuilder backward(op + "Grad", isMax ? 2 : 1, 1, "pipec");
      withWindow(backward, c, isMax).i("count_include_pad", includePad);
      if (isMax)
        list.add(op + "Grad" + name, backward, {floats(y.shape()), x});
      else
        list.add(op + "Grad" + name, backward.ints("shape", c.x), {floats(y.shape())});
    }
  };
  poolCase("3x3Ceil", {{4, 8, 15, 15}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, true, false);
  poolCase("3x3IncludePad", {{2, 4, 9, 10}, {3, 3}, {2, 2}, {1, 1}, {1, 1, 1, 1}}, false, true);
  poolCase("2x2", {{2, 16, 32, 32}, {2, 2}, {2, 2}, {1, 1}, {0, 0, 0, 0}}, false, false);
  list.add("GlobalAveragePool", NodeBuilder("GlobalAveragePool", 1), {floats({4, 64, 7, 7})});
  list.add(
      "BatchNormalization", NodeBuilder("BatchNormalization", 5).f("epsilon", 1e-3f),
      {floats({4, 16, 9, 9}), floats({16}), floats({16}), floats({16}), floats({16}, 0.5f, 2)});
  list.add("BatchNormGradWeight", NodeBuilder("BatchNormGradWeight", 4, 1, "pipec"),
           {floats({8, 16, 12, 12}), floats({8, 16, 12, 12}), floats({16}), floats({16}, 0.5f, 2)});
}

std::vector<OpCase> opCases() {
  CaseList list;
  elementwiseCases(list);
  productCases(list);
  rowCases(list);
  movementCases(list);
  reductionCases(list);
  gradientCases(list);
  convolutionCases(list);
  return std::move(list.cases);
}

class CudaOp : public ::testing::TestWithParam<OpCase> {};

TEST_P(CudaOp, MatchesCpu) {
  const OpCase &c = GetParam();
  // The reference runs everywhere: a case the CPU rejects is a broken test.
  std::vector<Tensor> expected = runCpu(c.node, c.inputs, c.opset);
  ASSERT_FALSE(expected.empty());
  if (!haveDevice())
    GTEST_SKIP() << "no CUDA device";
  auto backend = cuda::createCudaBackend(0, false, rt::makeCpuBackend());
  ASSERT_TRUE(!!backend) << llvm::toString(backend.takeError());
  auto &be = **backend;
  // Inputs as the executor hands them over: uploaded, except small integer
  // ones (shapes, axes, up to 16 elements here), which stay on the host.
  std::vector<Tensor> inputs;
  for (const Tensor &t : c.inputs) {
    bool small =
        (cpu::isInteger(t.elemType()) || t.elemType() == DType::Bool) && t.numElements() <= 16;
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
    auto made = cuda::createCudaBackend(0, false, rt::makeCpuBackend());
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
  auto made = cuda::createCudaBackend(0, true, rt::makeCpuBackend());
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

// The fused MatMul + bias of a bf16 run (the benchmark's linear layers): one
// cuBLASLt GEMM with the BIAS epilogue and bf16 compute, against the fp32
// CPU kernels. The operands are positive, so the relative error stays near
// bf16's 2^-9 per product; a bias added twice or not at all is off by the
// bias itself (0.5 to 1.5 against values near 32).
TEST_F(CudaBackendTest, Bf16MatMulBiasRunsInTheEpilogue) {
  auto made = cuda::createCudaBackend(0, true, rt::makeCpuBackend());
  ASSERT_TRUE(!!made) << llvm::toString(made.takeError());
  rt::Backend &bf16 = **made;
  Tensor a = floats({4, 96, 128}, 0, 1), b = floats({128, 384}, 0, 1),
         bias = floats({384}, 0.5f, 1.5f);
  Tensor expected = runCpu(matMulBias(), {a, b, bias})[0];
  auto da = bf16.upload(a), db = bf16.upload(b), dbias = bf16.upload(bias);
  ASSERT_TRUE(da && db && dbias);
  auto out = bf16.run(matMulBias(), 17, {&*da, &*db, &*dbias});
  ASSERT_TRUE(!!out) << llvm::toString(out.takeError());
  auto host = bf16.download((*out)[0]);
  ASSERT_TRUE(!!host) << llvm::toString(host.takeError());
  ASSERT_EQ(host->shape(), (Shape{4, 96, 384}));
  EXPECT_TRUE(close(*host, expected, 1e-2, 1e-2));
  EXPECT_EQ(cuda::biasEpilogueGemms(bf16), 1) << "the bias was not added in cuBLASLt's epilogue";
  EXPECT_TRUE(bf16.fallbackOps().empty());
}

// The most memory the rank's tensors held at once: two uploads alive
// together count both, and dropping them does not lower the peak.
TEST_F(CudaBackendTest, DevicePeakCountsWhatWasHeldAtOnce) {
  int64_t before = backend->devicePeakBytes();
  {
    Tensor a = up(floats({1 << 20})), b = up(floats({1 << 20}));
    EXPECT_GE(backend->devicePeakBytes(), before + 2 * (int64_t(4) << 20));
  }
  int64_t peak = backend->devicePeakBytes();
  Tensor c = up(floats({1 << 10}));
  EXPECT_EQ(backend->devicePeakBytes(), peak);
  EXPECT_EQ(rt::makeCpuBackend()->devicePeakBytes(), 0);
}

TEST_F(CudaBackendTest, OptimizerMatchesCpuBackend) {
  for (int code : {0, 1, 2}) { // SGD, momentum, AdamW
    Tensor w = floats({1000}), wRef = w.clone();
    Tensor mRef(DType::F32, {1000}), vRef(DType::F32, {1000});
    Tensor dw = up(w), m, v;
    for (int step = 0; step < 3; ++step) {
      Tensor g = floats({1000});
      rt::OptimizerUpdate u = optimizerUpdate(code, step);
      referenceUpdate(u, wRef, g, mRef, vRef);
      // A weight something else still holds is replaced; one the backend
      // holds alone is written in place.
      bool shared = step == 1;
      Tensor before = shared ? dw : Tensor();
      const void *address = dw.rawData();
      Tensor dg = up(g);
      rt::OptimizerSlot slot{&dw, &dg, &m, &v, u.decayCenter};
      auto squares = backend->optimize(u, {slot});
      ASSERT_TRUE(static_cast<bool>(squares)) << llvm::toString(squares.takeError());
      if (shared)
        EXPECT_NE(dw.rawData(), address) << "a weight held elsewhere must not be written";
      else
        EXPECT_EQ(dw.rawData(), address)
            << "a weight held by the backend alone is updated in place";
      double expected = 0;
      for (const Tensor *t : {&wRef, &vRef})
        if (code == 2 || t == &wRef)
          for (int64_t i = 0; i < t->numElements(); ++i)
            expected += t->getDouble(i) * t->getDouble(i);
      EXPECT_NEAR(down(*squares).getDouble(0), expected, 1e-9 * expected) << "kind " << code;
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
  auto acc = backend->zeros(DType::F32, {3, 70});
  ASSERT_TRUE(!!acc);
  EXPECT_TRUE(close(down(*acc), Tensor(DType::F32, {3, 70})));
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
  auto first = backend->zeros(DType::F32, {1 << 20});
  ASSERT_TRUE(!!first);
  void *address = first->rawData();
  *first = Tensor(); // back to the pool
  auto before = cuda::poolStats(*backend);
  ASSERT_TRUE(before.has_value());
  auto second = backend->zeros(DType::F32, {1 << 20});
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
  auto owner = cuda::createCudaBackend(ownerDevice, false, rt::makeCpuBackend());
  auto reader = cuda::createCudaBackend(readerDevice, false, rt::makeCpuBackend());
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
  auto during = (*owner)->zeros(DType::F32, {1 << 16});
  ASSERT_TRUE(!!during);
  EXPECT_NE(during->rawData(), address) << "reused while the reader may still read it";
  auto host = (*reader)->download((*negated)[0]); // retires the reader's holds
  ASSERT_TRUE(!!host) << llvm::toString(host.takeError());
  Tensor expected = runCpu(NodeBuilder("Neg", 1), {x})[0];
  EXPECT_TRUE(close(*host, expected));
  auto after = (*owner)->zeros(DType::F32, {1 << 16});
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
  Tensor big = floats({1 << 20}, -2, 2), small = floats({37}), none(DType::F32, {0});
  Tensor wide(DType::F64, {1000});
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
  onnx::NodeProto fused = makeFusedNode("ints", {&add, &mul}, {"in0", "in1"}, {"out0"});
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
