//===- DifferentiateIndexingTest.cpp - Indexing gradients, numerically ---===//
//
// The rules of passes/grad/IndexingGrads.cpp against finite differences
// (GradientCheck.h): Trilu, Pad in constant mode (inputs with axes and
// crops, the constant's own gradient, and the attribute form of opset 9), Slice with steps 2, 3
// and negative ones, GatherElements and
// GatherND with repeated indices, ScatterND and ScatterElements for data and updates, TopK
// largest and smallest along either axis, and CumSum in every direction.
//
//===----------------------------------------------------------------------===//
#include "tests/GradientCheck.h"

using namespace pipec;
using namespace pipec::test;

namespace {

/// h = x * w, x [3, 4] a float64 input, w [4] a weight; then \p op reads h
/// (and whatever the caller adds) into y.
GraphBuilder scaledInput(int opset = 18) {
  GraphBuilder b(opset);
  b.input("x", kDouble, {3, 4});
  doubleWeight(b, "w", {4});
  b.node("Mul", {"x", "w"}, {"h"}, "mul");
  b.output("y", kDouble);
  return b;
}

/// A 0-D int64 constant.
void intScalar(GraphBuilder &b, const std::string &name, int64_t value) {
  b.ints(name, {value}).clear_dims();
}

TEST(DifferentiateIndexing, Trilu) {
  for (int upper : {0, 1}) {
    GraphBuilder b = scaledInput();
    intScalar(b, "k", upper ? 1 : -1);
    setIntAttr(b.node("Trilu", {"h", "k"}, {"y"}, "trilu"), "upper", upper);
    checkModel(b);
  }
}

TEST(DifferentiateIndexing, PadConstant) {
  {
    // Opset 18: axes, a negative one, and a crop; the constant is an input
    // and gets its gradient too.
    GraphBuilder b = scaledInput(18);
    b.ints("pads", {1, -1, 0, 2});
    b.input("value", kDouble, {});
    b.ints("axes", {0, -1});
    b.node("Pad", {"h", "pads", "value", "axes"}, {"y"}, "pad");
    checkModel(b);
  }
  {
    // Opset 11, no crop: the gradient is a Slice.
    GraphBuilder b = scaledInput(11);
    b.ints("pads", {0, 2, 1, 1});
    b.node("Pad", {"h", "pads"}, {"y"}, "pad");
    checkModel(b);
  }
  {
    // Opset 9: pads are an attribute.
    GraphBuilder b = scaledInput(9);
    setIntsAttr(b.node("Pad", {"h"}, {"y"}, "pad"), "pads", {2, 0, 0, 1});
    checkModel(b);
  }
}

TEST(DifferentiateIndexing, SliceWithAnyStep) {
  // (starts, ends, axes, steps) over h [3, 4]: every other column, every
  // third from 1, reversed, reversed by 2 from the last, both axes at once,
  // and a reversal that starts past the end (clamped).
  const std::vector<std::vector<std::vector<int64_t>>> cases = {
      {{0}, {4}, {1}, {2}},
      {{1}, {4}, {1}, {3}},
      {{-1}, {INT64_MIN}, {1}, {-1}},
      {{3}, {-5}, {-1}, {-2}},
      {{2, 0}, {-4, 4}, {0, 1}, {-1, 2}},
      {{9}, {0}, {0}, {-1}},
  };
  for (const auto &c : cases) {
    GraphBuilder b = scaledInput();
    b.ints("starts", c[0]);
    b.ints("ends", c[1]);
    b.ints("axes", c[2]);
    b.ints("steps", c[3]);
    b.node("Slice", {"h", "starts", "ends", "axes", "steps"}, {"y"}, "slice");
    checkModel(b);
  }
}

TEST(DifferentiateIndexing, GatherElementsAddsRepeatedIndices) {
  for (int axis : {0, 1}) {
    GraphBuilder b = scaledInput();
    b.input("ids", kInt64, {2, 4});
    setIntAttr(b.node("GatherElements", {"h", "ids"}, {"y"}, "gather"), "axis", axis);
    Check check;
    check.feeds["ids"] = Tensor::fromValues<int64_t>({2, 4}, {0, 2, -1, 1, 0, 0, 1, -3});
    checkModel(b, check);
  }
}

TEST(DifferentiateIndexing, GatherNDAddsRepeatedTuples) {
  for (int batch : {0, 1}) {
    GraphBuilder b;
    doubleWeight(b, "table", {3, 2, 4});
    b.input("ids", kInt64, {3, 2, 1});
    setIntAttr(b.node("GatherND", {"table", "ids"}, {"y"}, "gather"), "batch_dims", batch);
    b.output("y", kDouble);
    Check check;
    check.feeds["ids"] = Tensor::fromValues<int64_t>({3, 2, 1}, {1, 1, 0, -1, batch ? 1 : 2, 0});
    checkModel(b, check);
  }
}

TEST(DifferentiateIndexing, ScatterNDDataAndUpdates) {
  for (const char *reduction : {"none", "add"}) {
    GraphBuilder b(18);
    doubleWeight(b, "data", {4, 3});
    doubleWeight(b, "updates", {2, 3});
    b.input("ids", kInt64, {2, 1});
    auto &n = b.node("ScatterND", {"data", "ids", "updates"}, {"y"}, "scatter");
    auto *a = n.add_attribute();
    a->set_name("reduction");
    a->set_type(onnx::AttributeProto::STRING);
    a->set_s(reduction);
    b.output("y", kDouble);
    Check check;
    check.feeds["ids"] = Tensor::fromValues<int64_t>({2, 1}, {2, -4});
    checkModel(b, check);
  }
}

TEST(DifferentiateIndexing, ScatterElementsDataAndUpdates) {
  for (const char *reduction : {"none", "add"})
    for (int axis : {0, 1}) {
      GraphBuilder b(18);
      doubleWeight(b, "data", {4, 3});
      doubleWeight(b, "updates", {2, 3});
      b.input("ids", kInt64, {2, 3});
      auto &n = b.node("ScatterElements", {"data", "ids", "updates"}, {"y"}, "scatter");
      setStringAttr(n, "reduction", reduction);
      setIntAttr(n, "axis", axis);
      b.output("y", kDouble);
      Check check;
      // Distinct along either axis: reduction none keeps no overwritten update.
      check.feeds["ids"] = Tensor::fromValues<int64_t>({2, 3}, {0, 2, 1, 1, -3, 2});
      SCOPED_TRACE(std::string(reduction) + " axis " + std::to_string(axis));
      checkModel(b, check);
    }
}

TEST(DifferentiateIndexing, TopKScattersIntoTheChosen) {
  for (int largest : {0, 1})
    for (int axis : {0, -1}) {
      GraphBuilder b = scaledInput();
      b.ints("k", {2});
      auto &n = b.node("TopK", {"h", "k"}, {"y", "indices"}, "topk");
      setIntAttr(n, "largest", largest);
      setIntAttr(n, "axis", axis);
      SCOPED_TRACE("largest " + std::to_string(largest) + " axis " + std::to_string(axis));
      checkModel(b);
    }
  // Opset 1's attribute k, and the indices read by the rest of the graph.
  GraphBuilder b = scaledInput(9);
  setIntAttr(b.node("TopK", {"h"}, {"top", "indices"}, "topk"), "k", 3);
  setIntAttr(b.node("Cast", {"indices"}, {"order"}, "cast"), "to", kDouble);
  b.node("Mul", {"top", "order"}, {"y"}, "weigh");
  checkModel(b);
}

TEST(DifferentiateIndexing, CumSumEveryDirection) {
  for (int exclusive : {0, 1})
    for (int reverse : {0, 1}) {
      GraphBuilder b = scaledInput();
      intScalar(b, "axis", reverse ? -1 : 0);
      auto &n = b.node("CumSum", {"h", "axis"}, {"y"}, "cumsum");
      setIntAttr(n, "exclusive", exclusive);
      setIntAttr(n, "reverse", reverse);
      checkModel(b);
    }
}

} // namespace
