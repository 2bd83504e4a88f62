//===- ActivationMemoryTest.cpp - What a layer keeps and holds while it runs ===//
#include "TestUtil.h"

#include "passes/ActivationMemory.h"

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

/// x[8,16] -> h = MatMul(x, w1[16,32]) -> r = Relu(h) -> y = MatMul(r, w2[32,4])
/// -> out = ReduceSum(y): a scalar the user named "out".
GroupedGraph twoLinearLayers() {
  GraphBuilder b;
  b.input("x", 1, {8, 16});
  b.weight("w1", {16, 32});
  b.weight("w2", {32, 4});
  b.node("MatMul", {"x", "w1"}, {"h"}, "mm1");
  b.node("Relu", {"h"}, {"r"}, "relu");
  b.node("MatMul", {"r", "w2"}, {"y"}, "mm2");
  auto &sum = b.node("ReduceSum", {"y"}, {"out"}, "sum");
  auto *keep = sum.add_attribute();
  keep->set_name("keepdims");
  keep->set_type(onnx::AttributeProto::INT);
  keep->set_i(0);
  b.output("out");
  return groupGraph(importBytes(b.serialize()));
}

int64_t total(const CostTable &table, int64_t LayerCost::*field) {
  int64_t sum = 0;
  for (const LayerCost &layer : table.layers)
    sum += layer.*field;
  return sum;
}

int64_t most(const CostTable &table, int64_t LayerCost::*field) {
  int64_t m = 0;
  for (const LayerCost &layer : table.layers)
    m = std::max(m, layer.*field);
  return m;
}

TEST(ActivationMemory, TrainingKeepsWhatTheBackwardReads) {
  GroupedGraph g = twoLinearLayers();
  // Two layers: the products and the Relu, then the sum (the loss).
  ASSERT_EQ(g.layers.layers.size(), 2u);
  auto backward = differentiate(*g.graph, g.layers, {LossSpec::Kind::ModelOutput, "out", ""});
  ASSERT_TRUE(bool(backward)) << toString(backward.takeError());
  CostTable table = computeCosts(g.layers, HardwareSpec{}, Precision::FP32);
  // Before: every value the forward makes (h, r: 1 KiB each; y 128 B; out 4 B).
  EXPECT_EQ(total(table, &LayerCost::activationBytes), 1024 + 1024 + 128 + 4);
  countActivationMemory(table, g.layers, &*backward);
  // Relu's gradient reads h; w2's gradient reads r. y and out are not read.
  EXPECT_EQ(total(table, &LayerCost::activationBytes), 1024 + 1024);
  // The first layer's forward holds y (128 B) beyond them, the second's y
  // and out. The first's backward, from its last op: grad:y with w2's term
  // (512 B) and grad:r, grad:r and grad:h at the Relu, then grad:h (1 KiB)
  // with w1's term (2 KiB) at the first MatMul: 3 KiB.
  EXPECT_EQ(most(table, &LayerCost::workingBytes), 1024 + 2048);
}

TEST(ActivationMemory, InferenceKeepsNothingAndHoldsTheLiveValues) {
  GroupedGraph g = twoLinearLayers();
  ASSERT_EQ(g.layers.layers.size(), 2u);
  CostTable table = computeCosts(g.layers, HardwareSpec{}, Precision::FP32);
  countActivationMemory(table, g.layers, nullptr);
  EXPECT_EQ(total(table, &LayerCost::activationBytes), 0);
  // h and r are live together at the Relu; y replaces h after it.
  EXPECT_EQ(most(table, &LayerCost::workingBytes), 1024 + 1024);
  // bf16 halves the float activations.
  CostTable half = computeCosts(g.layers, HardwareSpec{}, Precision::BF16);
  countActivationMemory(half, g.layers, nullptr);
  EXPECT_EQ(most(half, &LayerCost::workingBytes), 1024);
}

} // namespace
