//===- CostModelTest.cpp - F / I / W costs and the roofline -------------===//
#include "TestUtil.h"

#include "compiler/cost/CostModel.h"
#include "passes/GroupLayers.h"

#include <array>
#include <fstream>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

const Op &opNamed(const Graph &g, llvm::StringRef name) {
  for (const Op &op : g.ops)
    if (op.name == name)
      return op;
  ADD_FAILURE() << "no op " << name.str();
  return g.ops.front();
}

TEST(CostModel, GemmRulesSplitInputAndWeightGradients) {
  GraphBuilder b;
  b.input("x", 1, {8, 16});
  b.input("y", 1, {16, 4});
  b.weight("w", {16, 32});
  b.node("MatMul", {"x", "w"}, {"h"}, "with_weight");
  b.node("MatMul", {"x", "y"}, {"z"}, "two_activations");
  b.output("h");
  b.output("z");
  auto g = importBytes(b.serialize());
  ASSERT_TRUE(!!g) << toString(g.takeError());
  OpCost c = opCost(*g, opNamed(*g, "with_weight"), Precision::FP32);
  double gemm = 2.0 * 8 * 16 * 32;
  EXPECT_DOUBLE_EQ(c.flops[Forward], gemm);
  EXPECT_DOUBLE_EQ(c.flops[BackwardInput], gemm);  // dX = dY W^T
  EXPECT_DOUBLE_EQ(c.flops[BackwardWeight], gemm); // dW = X^T dY
  // Bytes: x (512 B) + w (2 KiB) + h (1 KiB) in fp32, half of it in bf16.
  EXPECT_DOUBLE_EQ(c.bytes[Forward], 8 * 16 * 4 + 16 * 32 * 4 + 8 * 32 * 4);
  EXPECT_DOUBLE_EQ(opCost(*g, opNamed(*g, "with_weight"), Precision::BF16).bytes[Forward],
                   c.bytes[Forward] / 2);
  OpCost a = opCost(*g, opNamed(*g, "two_activations"), Precision::FP32);
  EXPECT_DOUBLE_EQ(a.flops[Forward], 2.0 * 8 * 16 * 4);
  EXPECT_DOUBLE_EQ(a.flops[BackwardInput], 2 * a.flops[Forward]);
  EXPECT_DOUBLE_EQ(a.flops[BackwardWeight], 0);
  EXPECT_FALSE(c.defaulted);
  // The GEMM calls each pass makes: dX and dW for a weight; dA and dB for two
  // activations.
  EXPECT_EQ(c.gemms, (std::array<double, 3>{1, 1, 1}));
  EXPECT_EQ(a.gemms, (std::array<double, 3>{1, 2, 0}));
}

TEST(CostModel, ConvEmbeddingNormAndDefaults) {
  GraphBuilder b;
  b.input("img", 1, {1, 3, 8, 8});
  b.weight("k", {4, 3, 3, 3});
  auto &conv = b.node("Conv", {"img", "k"}, {"c"}, "conv");
  auto *pads = conv.add_attribute();
  pads->set_name("pads");
  pads->set_type(onnx::AttributeProto::INTS);
  for (int i = 0; i < 4; ++i)
    pads->add_ints(1);
  b.input("ids", 7, {2, 5});
  b.weight("table", {10, 6});
  b.node("Gather", {"table", "ids"}, {"e"}, "embed");
  b.weight("gamma", {6});
  b.weight("beta", {6});
  b.node("LayerNormalization", {"e", "gamma", "beta"}, {"n"}, "norm");
  b.node("Celu", {"n"}, {"odd"}, "unusual");
  b.output("c");
  b.output("odd");
  auto g = importBytes(b.serialize());
  ASSERT_TRUE(!!g) << toString(g.takeError());
  OpCost conv1 = opCost(*g, opNamed(*g, "conv"), Precision::FP32);
  double f = 2.0 * (1 * 4 * 8 * 8) * (3 * 3 * 3);
  EXPECT_DOUBLE_EQ(conv1.flops[Forward], f);
  EXPECT_DOUBLE_EQ(conv1.flops[BackwardInput], f);
  EXPECT_DOUBLE_EQ(conv1.flops[BackwardWeight], f);
  OpCost embed = opCost(*g, opNamed(*g, "embed"), Precision::FP32);
  EXPECT_DOUBLE_EQ(embed.flops[Forward], 0);
  EXPECT_DOUBLE_EQ(embed.flops[BackwardInput], 0);
  EXPECT_DOUBLE_EQ(embed.flops[BackwardWeight], 2 * 5 * 6); // scatter-add of the output
  OpCost norm = opCost(*g, opNamed(*g, "norm"), Precision::FP32);
  EXPECT_DOUBLE_EQ(norm.flops[Forward], 8 * 60);
  EXPECT_DOUBLE_EQ(norm.flops[BackwardInput], norm.flops[Forward]);
  EXPECT_DOUBLE_EQ(norm.flops[BackwardWeight], 60);
  OpCost odd = opCost(*g, opNamed(*g, "unusual"), Precision::FP32);
  EXPECT_TRUE(odd.defaulted);
  EXPECT_DOUBLE_EQ(odd.flops[Forward], 60);
  EXPECT_DOUBLE_EQ(odd.flops[BackwardInput], 60);
  EXPECT_DOUBLE_EQ(odd.flops[BackwardWeight], 0);
}

TEST(CostModel, RooflineTimesAndMeasuredOverrides) {
  GraphBuilder b;
  b.input("x", 1, {64, 256});
  b.weight("w", {256, 256});
  b.node("MatMul", {"x", "w"}, {"h"}, "/layers.0/MatMul");
  b.node("Relu", {"h"}, {"r"}, "/layers.0/Relu");
  b.weight("w2", {256, 256});
  b.node("MatMul", {"r", "w2"}, {"y"}, "/layers.1/MatMul");
  b.output("y");
  auto g = importBytes(b.serialize());
  ASSERT_TRUE(!!g);
  auto lg = groupLayers(*g);
  ASSERT_TRUE(!!lg) << toString(lg.takeError());
  HardwareSpec hw;
  hw.name = "test";
  hw.peakFlopsF32 = 1e9;
  hw.peakFlopsBf16 = 4e9;
  hw.memoryBandwidth = 1e8;
  hw.launchOverhead = 1e-6;
  CostTable table = computeCosts(*lg, hw, Precision::FP32);
  ASSERT_EQ(table.layers.size(), 2u);
  const LayerCost &last = table.layers.back();
  double flops = 2.0 * 64 * 256 * 256;
  double bytes = (64 * 256 + 256 * 256 + 64 * 256) * 4.0;
  double expected = std::max(flops / 1e9, bytes / 1e8) + 1e-6;
  EXPECT_DOUBLE_EQ(last.time[Forward], expected);
  // W also adds the microbatch's gradient into the accumulator: three
  // float32 passes over the weight, one op.
  double accumulate = 3 * 256 * 256 * 4.0 / 1e8 + 1e-6;
  EXPECT_DOUBLE_EQ(last.time[BackwardWeight], expected + accumulate);

  // A CPU rank's spec: arithmetic and traffic add up, and each GEMM call
  // costs gemmOverhead more.
  HardwareSpec cpu = hw;
  cpu.sumsComputeAndMemory = true;
  cpu.gemmOverhead = 3e-5;
  CostTable serial = computeCosts(*lg, cpu, Precision::FP32);
  double gemm = flops / 1e9 + bytes / 1e8 + 1e-6 + 3e-5;
  ASSERT_GT(flops / 1e9, 3e-5); // the per-call cost is not capped here
  EXPECT_DOUBLE_EQ(serial.layers.back().time[Forward], gemm);
  EXPECT_DOUBLE_EQ(serial.layers.back().time[BackwardInput], gemm);
  EXPECT_DOUBLE_EQ(serial.layers.back().time[BackwardWeight], gemm + accumulate);
  // On the CPU's own ranks the weight-gradient GEMM adds into the
  // accumulator (beta = 1): no pass of its own.
  HardwareSpec shared = cpu;
  shared.sharesHostCores = true;
  EXPECT_DOUBLE_EQ(computeCosts(*lg, shared, Precision::FP32).layers.back().time[BackwardWeight],
                   gemm);
  // Ops that are not matrix products run at the vector rate where it is set
  // (the first layer's Relu: one FLOP per element, reading and writing them).
  cpu.vectorFlops = 1e7;
  CostTable vector = computeCosts(*lg, cpu, Precision::FP32);
  double relu = 64 * 256 / 1e7 + 2 * 64 * 256 * 4.0 / 1e8 + 1e-6;
  EXPECT_DOUBLE_EQ(vector.layers[0].time[Forward], gemm + relu);
  EXPECT_DOUBLE_EQ(vector.layers.back().time[Forward], gemm);
  // A product cheaper than the per-call cost pays its arithmetic's time again.
  cpu.gemmOverhead = 1.0;
  CostTable capped = computeCosts(*lg, cpu, Precision::FP32);
  EXPECT_DOUBLE_EQ(capped.layers.back().time[Forward], 2 * flops / 1e9 + bytes / 1e8 + 1e-6);

  TempDir dir;
  {
    std::ofstream out(dir.path("costs.json"));
    out << R"({"format_version": 1, "hardware": "test", "layers": [)"
        << R"({"name": ")" << table.layers[0].name
        << R"(", "forward_s": 0.5, "backward_input_s": 0.25, "backward_weight_s": 0.125}]})";
  }
  ASSERT_FALSE(static_cast<bool>(applyMeasuredCosts(table, dir.path("costs.json"))));
  EXPECT_DOUBLE_EQ(table.layers[0].time[Forward], 0.5);
  EXPECT_DOUBLE_EQ(table.layers[0].time[BackwardWeight], 0.125);
  EXPECT_TRUE(table.layers[0].measured);
  EXPECT_FALSE(table.layers[1].measured);

  // Round trip through the writer: every layer, the roofline one too (given
  // a time of its own, so that a dropped layer cannot pass as read back).
  table.layers[1].time[Forward] = 0.75;
  {
    std::string text;
    llvm::raw_string_ostream os(text);
    writeCostTable(table, os);
    os.flush();
    std::ofstream(dir.path("round.json")) << text;
  }
  CostTable again = computeCosts(*lg, hw, Precision::FP32);
  ASSERT_FALSE(static_cast<bool>(applyMeasuredCosts(again, dir.path("round.json"))));
  EXPECT_DOUBLE_EQ(again.layers[0].time[BackwardInput], 0.25);
  EXPECT_DOUBLE_EQ(again.layers[1].time[Forward], 0.75);
  EXPECT_TRUE(again.layers[0].measured);
  EXPECT_TRUE(again.layers[1].measured);

  std::ofstream(dir.path("bad.json"))
      << R"({"format_version": 1, "layers": [{"name": "nope", "forward_s": 1,
            "backward_input_s": 1, "backward_weight_s": 1}]})";
  llvm::Error err = applyMeasuredCosts(table, dir.path("bad.json"));
  ASSERT_TRUE(!!err);
  std::string text = toString(std::move(err));
  EXPECT_NE(text.find("bad.json: layer 'nope' is not a layer of this model"), std::string::npos)
      << text;

  // Times measured on another kind of device are refused, naming both.
  std::ofstream(dir.path("other.json"))
      << R"({"format_version": 1, "hardware": "h100", "layers": []})";
  err = applyMeasuredCosts(table, dir.path("other.json"));
  ASSERT_TRUE(!!err);
  text = toString(std::move(err));
  EXPECT_NE(text.find("other.json: measured on 'h100', but these costs are for 'test'"),
            std::string::npos)
      << text;
}

} // namespace
