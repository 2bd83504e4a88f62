//===- InferShapesTest.cpp - infer-shapes, fold-constants, eliminate-dead ===//
#include "TestUtil.h"

#include "models/ModelGenerators.h"
#include "passes/EliminateDead.h"
#include "passes/FoldConstants.h"
#include "passes/InferShapes.h"

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

int countOps(const Graph &graph, llvm::StringRef type) {
  int n = 0;
  for (const Op &op : graph.ops)
    n += !op.dead && op.opType == type;
  return n;
}

/// The subgraph torch writes for x.view(x.size(0), 4, -1).
GraphBuilder torchViewModel() {
  GraphBuilder b(13);
  b.input("x", 1, {-1, 16}, {"batch"});
  b.node("Shape", {"x"}, {"s"});
  b.ints("zero", {0});
  b.node("Gather", {"s", "zero"}, {"b"});
  b.ints("rest", {4, -1});
  b.node("Concat", {"b", "rest"}, {"target"}).add_attribute()->set_name("axis");
  b.node("Reshape", {"x", "target"}, {"y"}, "/model/view/Reshape");
  b.output("y");
  return b;
}

TEST(InferShapes, FoldsTorchShapeArithmetic) {
  GraphBuilder b = torchViewModel();
  auto &concat = b.graph().mutable_node()->at(2);
  concat.mutable_attribute(0)->set_i(0);
  concat.mutable_attribute(0)->set_type(onnx::AttributeProto::INT);
  ImportOptions options;
  options.bindings.batch = 3;
  auto graph = importOnnxBuffer(llvm::MemoryBuffer::getMemBufferCopy(b.serialize()), "view.onnx",
                                ".", options);
  ASSERT_TRUE(!!graph) << toString(graph.takeError());

  auto changed = inferShapes(*graph);
  ASSERT_TRUE(!!changed) << toString(changed.takeError());
  EXPECT_TRUE(*changed);
  const Value &target = graph->values[graph->findValue("target")];
  ASSERT_NE(target.constant, nullptr);
  EXPECT_EQ(target.constant->ints, (std::vector<int64_t>{3, 4, -1}));
  EXPECT_EQ(graph->values[graph->findValue("y")].shape, (std::vector<int64_t>{3, 4, 4}));

  // fold-constants removes what became constant, eliminate-dead has nothing left.
  auto folded = foldConstants(*graph);
  ASSERT_TRUE(!!folded);
  EXPECT_TRUE(*folded);
  EXPECT_EQ(graph->liveOpCount(), 1);
  EXPECT_EQ(graph->ops[0].opType, "Reshape");
  auto dead = eliminateDead(*graph);
  ASSERT_TRUE(!!dead);
  EXPECT_FALSE(*dead) << "no-change twin: nothing is dead after folding";

  // Running infer-shapes again changes nothing.
  changed = inferShapes(*graph);
  ASSERT_TRUE(!!changed);
  EXPECT_FALSE(*changed);
}

TEST(InferShapes, EliminatesOpsNoOutputNeeds) {
  GraphBuilder b;
  b.input("x", 1, {2});
  b.node("Neg", {"x"}, {"unused"}, "dead");
  b.node("Relu", {"x"}, {"y"}, "live");
  b.output("y");
  auto graph = importOnnxBuffer(llvm::MemoryBuffer::getMemBufferCopy(b.serialize()), "m.onnx", ".");
  ASSERT_TRUE(!!graph);
  ASSERT_TRUE(!!inferShapes(*graph));
  auto changed = eliminateDead(*graph);
  ASSERT_TRUE(!!changed);
  EXPECT_TRUE(*changed);
  ASSERT_EQ(graph->ops.size(), 1u);
  EXPECT_EQ(graph->ops[0].name, "live");
}

TEST(InferShapes, FoldsRangeConstantOfShapeExpandAndOldOpsetAttributes) {
  GraphBuilder b(9);
  b.input("x", 1, {-1, 6}, {"seq"});
  b.node("Shape", {"x"}, {"s"});
  auto &slice = b.node("Slice", {"s"}, {"first"}); // opset 9: starts/ends are attributes
  auto attr = [&](onnx::NodeProto &n, const char *name, std::vector<int64_t> v) {
    auto *a = n.add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INTS);
    for (int64_t x : v)
      a->add_ints(x);
  };
  attr(slice, "starts", {0});
  attr(slice, "ends", {1});
  auto &sq = b.node("Squeeze", {"first"}, {"n"});
  attr(sq, "axes", {0});
  b.node("Cast", {"n"}, {"nf"}).add_attribute()->set_name("to");
  b.graph().mutable_node(3)->mutable_attribute(0)->set_type(onnx::AttributeProto::INT);
  b.graph().mutable_node(3)->mutable_attribute(0)->set_i(1);
  auto &fill = b.node("ConstantOfShape", {"s"}, {"ones"});
  auto *value = fill.add_attribute();
  value->set_name("value");
  value->set_type(onnx::AttributeProto::TENSOR);
  value->mutable_t()->set_data_type(onnx::TensorProto::FLOAT);
  value->mutable_t()->add_dims(1);
  value->mutable_t()->add_float_data(2.0f);
  b.node("Mul", {"x", "ones"}, {"y"});
  b.output("y");
  ImportOptions options;
  options.bindings.seq = 5;
  auto graph = importBytes(b.serialize(), options);
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(countOps(*graph, "Shape"), 0);
  EXPECT_EQ(countOps(*graph, "ConstantOfShape"), 0);
  const Value &ones = graph->values[graph->findValue("ones")];
  ASSERT_NE(ones.constant, nullptr);
  EXPECT_EQ(ones.shape, (std::vector<int64_t>{5, 6}));
  EXPECT_DOUBLE_EQ(ones.constant->floats[29], 2.0);
  EXPECT_EQ(graph->values[graph->outputs[0]].shape, (std::vector<int64_t>{5, 6}));
}

/// A float initializer of \p values.
void floats(GraphBuilder &b, const std::string &name, const std::vector<float> &values) {
  auto *t = b.graph().add_initializer();
  t->set_name(name);
  t->set_data_type(onnx::TensorProto::FLOAT);
  t->add_dims(static_cast<int64_t>(values.size()));
  for (float v : values)
    t->add_float_data(v);
}

void setInt(onnx::NodeProto &node, const char *name, int64_t value) {
  auto *a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

/// x: f32[n, 3, h, w] with the spatial dimensions symbolic, bound to
/// [1, 3, 5, 7] when imported with shapeArithmeticOptions().
GraphBuilder shapeArithmeticModel(int opset) {
  GraphBuilder b(opset);
  b.input("x", 1, {-1, 3, -1, -1}, {"n", "h", "w"});
  b.node("Shape", {"x"}, {"s"});
  b.output("y");
  return b;
}

ImportOptions shapeArithmeticOptions() {
  ImportOptions options;
  options.bindings.inputShapes["x"] = {1, 3, 5, 7};
  return options;
}

TEST(InferShapes, ResizeSizesFromShapeArithmetic) {
  // sizes = Concat(Shape(x)[0:2], Shape(x)[2:4] * 2), as exporters write an
  // upsampling to twice the input; opset 18's axes take the spatial pair alone.
  for (bool axes : {false, true}) {
    GraphBuilder b = shapeArithmeticModel(axes ? 18 : 13);
    b.ints("nc_index", {0, 1});
    b.ints("hw_index", {2, 3});
    b.ints("two", {2});
    b.node("Gather", {"s", "hw_index"}, {"hw"});
    b.node("Mul", {"hw", "two"}, {"hw2"});
    if (axes) {
      auto &resize = b.node("Resize", {"x", "", "", "hw2"}, {"y"}, "up");
      auto *a = resize.add_attribute();
      a->set_name("axes");
      a->set_type(onnx::AttributeProto::INTS);
      a->add_ints(-2);
      a->add_ints(-1);
    } else {
      b.node("Gather", {"s", "nc_index"}, {"nc"});
      setInt(b.node("Concat", {"nc", "hw2"}, {"sizes"}), "axis", 0);
      b.node("Resize", {"x", "", "", "sizes"}, {"y"}, "up");
    }
    auto graph = importBytes(b.serialize(), shapeArithmeticOptions());
    ASSERT_TRUE(!!graph) << toString(graph.takeError());
    const Value &y = graph->values[graph->findValue("y")];
    EXPECT_TRUE(y.shapeKnown);
    EXPECT_EQ(y.shape, (std::vector<int64_t>{1, 3, 10, 14})) << "axes " << axes;
    EXPECT_EQ(graph->liveOpCount(), 1) << "the shape arithmetic folds away";
  }
}

TEST(InferShapes, ResizeScalesFromShapeArithmeticAndFloatInitializers) {
  // scales = Concat([1, 1], Div(hw, hw) * [1.5, 2]): the float initializers
  // look like weights, yet read only as Resize's scales they are constants.
  // Old opsets give no differentiation categories; the newest Resize's do.
  for (int opset : {11, 13, 19}) {
    GraphBuilder b = shapeArithmeticModel(opset);
    b.ints("hw_index", {2, 3});
    floats(b, "ones", {1, 1});
    floats(b, "factors", {1.5f, 2});
    b.node("Gather", {"s", "hw_index"}, {"hw"});
    setInt(b.node("Cast", {"hw"}, {"hwf"}), "to", onnx::TensorProto::FLOAT);
    b.node("Div", {"hwf", "hwf"}, {"unit"});
    b.node("Mul", {"factors", "unit"}, {"hw_scales"});
    setInt(b.node("Concat", {"ones", "hw_scales"}, {"scales"}), "axis", 0);
    b.node("Resize", {"x", "", "scales"}, {"y"}, "up");
    auto graph = importBytes(b.serialize(), shapeArithmeticOptions());
    ASSERT_TRUE(!!graph) << toString(graph.takeError());
    const Value &y = graph->values[graph->findValue("y")];
    EXPECT_TRUE(y.shapeKnown);
    // floor(5 * 1.5) = 7, 7 * 2 = 14.
    EXPECT_EQ(y.shape, (std::vector<int64_t>{1, 3, 7, 14})) << "opset " << opset;
    const Value &scales = graph->values[graph->findValue("scales")];
    ASSERT_NE(scales.constant, nullptr);
    EXPECT_EQ(scales.kind, ValueKind::Constant);
    EXPECT_EQ(scales.constant->floats, (std::vector<double>{1, 1, 1.5, 2}));
    EXPECT_EQ(graph->liveOpCount(), 1);
    EXPECT_EQ(graph->parameterCount(), 0);
  }
}

TEST(InferShapes, ScalesAlsoComputedOnStayComputed) {
  // No-change twin: the same scales also feed an output, through which a
  // gradient would reach the weight 'factors'. Resize still gets its static
  // shape, but nothing that reads 'factors' becomes a constant.
  GraphBuilder b = shapeArithmeticModel(13);
  floats(b, "ones", {1, 1});
  floats(b, "factors", {1.5f, 2});
  setInt(b.node("Concat", {"ones", "factors"}, {"scales"}), "axis", 0);
  b.node("Resize", {"x", "", "scales"}, {"y"}, "up");
  b.node("Identity", {"scales"}, {"scales_out"});
  b.output("scales_out");
  auto graph = importBytes(b.serialize(), shapeArithmeticOptions());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(graph->values[graph->findValue("y")].shape, (std::vector<int64_t>{1, 3, 7, 14}));
  const Value &scales = graph->values[graph->findValue("scales")];
  EXPECT_EQ(scales.constant, nullptr);
  EXPECT_EQ(scales.kind, ValueKind::Weight);
  EXPECT_EQ(countOps(*graph, "Concat"), 1);
}

TEST(InferShapes, GeneratedModelsEndFullyStatic) {
  for (auto family : {models::Family::Gpt, models::Family::Llama, models::Family::Bert,
                      models::Family::Mlp, models::Family::Resnet}) {
    models::GeneratorOptions options;
    options.family = family;
    options.layers = 2;
    options.seq = family == models::Family::Resnet ? 32 : 16;
    options.batch = 0; // symbolic, as torch exports with dynamic_axes
    auto graph = importGenerated(options, /*batch=*/2);
    ASSERT_TRUE(!!graph) << toString(graph.takeError());
    EXPECT_EQ(countOps(*graph, "Shape"), 0) << models::familyName(family).str();
    for (const Op &op : graph->ops)
      for (int out : op.outputs)
        if (out >= 0) {
          EXPECT_TRUE(graph->values[out].shapeKnown) << describeOp(*graph, op);
          for (int64_t d : graph->values[out].shape)
            EXPECT_GE(d, 0) << describeOp(*graph, op);
        }
    const Value &out = graph->values[graph->outputs[0]];
    EXPECT_EQ(out.shape.front(), 2) << models::familyName(family).str();
  }
}

TEST(InferShapes, TopKReadsItsConstantK) {
  // K as an initializer (opset 10 on) and as a Constant node's output.
  for (bool node : {false, true}) {
    GraphBuilder b(18);
    b.input("x", 1, {3, 5});
    if (node) {
      onnx::TensorProto k = b.ints("k", {2});
      b.graph().mutable_initializer()->RemoveLast();
      auto *value = b.node("Constant", {}, {"k"}).add_attribute();
      value->set_name("value");
      value->set_type(onnx::AttributeProto::TENSOR);
      *value->mutable_t() = k;
    } else {
      b.ints("k", {2});
    }
    b.node("TopK", {"x", "k"}, {"values", "indices"}, "topk");
    b.output("values");
    b.output("indices", 7);
    auto graph = importBytes(b.serialize());
    ASSERT_TRUE(!!graph) << toString(graph.takeError());
    const Value &values = graph->values[graph->findValue("values")];
    const Value &indices = graph->values[graph->findValue("indices")];
    EXPECT_TRUE(values.shapeKnown && indices.shapeKnown);
    EXPECT_EQ(values.shape, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(indices.shape, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(indices.type, DType::I64);
  }
}

TEST(InferShapes, DataDependentShapeIsAClearError) {
  GraphBuilder b;
  b.input("x", 1, {4});
  b.node("NonZero", {"x"}, {"nz"}, "/model/nonzero");
  b.output("nz", 7);
  std::string err;
  auto graph = importBytes(b.serialize());
  ASSERT_FALSE(!!graph);
  err = toString(graph.takeError());
  EXPECT_NE(err.find("node '/model/nonzero' (NonZero)"), std::string::npos) << err;
  EXPECT_NE(err.find("static shape"), std::string::npos) << err;
}

} // namespace
