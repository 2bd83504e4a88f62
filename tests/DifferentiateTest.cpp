//===- DifferentiateTest.cpp - Gradient rules against finite differences ===//
//
// One tiny float64 graph per rule (GradientCheck.h): differentiate, then the
// backward program's gradients against finite differences of the loss.
// The end-to-end models are in DifferentiateModelsTest.cpp.
//
//===----------------------------------------------------------------------===//
#include "tests/GradientCheck.h"

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"

using namespace pipec;
using namespace pipec::test;

namespace {

TEST(Differentiate, MatMul2D) { checkModel(binaryModel("MatMul", {3, 4}, {4, 5})); }

TEST(Differentiate, MatMulBatchedWith2DWeight) {
  checkModel(binaryModel("MatMul", {2, 3, 4}, {4, 5}));
}

TEST(Differentiate, MatMulBatchedBothAndBroadcast) {
  checkModel(binaryModel("MatMul", {2, 3, 4}, {2, 4, 5}));
  checkModel(binaryModel("MatMul", {3, 4}, {2, 4, 5}));
  checkModel(binaryModel("MatMul", {2, 4, 5}, {3, 4}, /*swap=*/true));
}

TEST(Differentiate, MatMulByTransposedWeightReadsTheWeight) {
  // torch's Linear: y = x Transpose(w), w [out, in]. The backward reads w
  // itself; w's gradient is one GEMM when the MatMul is the Transpose's only
  // reader, so no Transpose is made at all. A second reader (here maybe in
  // another layer) keeps the transposed gradient and its Transpose back.
  for (bool twoReaders : {false, true}) {
    SCOPED_TRACE(twoReaders ? "two readers" : "one reader");
    GraphBuilder b;
    b.input("x", kDouble, {2, 3, 4});
    doubleWeight(b, "w", {5, 4});
    setIntsAttr(b.node("Transpose", {"w"}, {"t"}, "tr"), "perm", {1, 0});
    b.node("MatMul", {"x", "t"}, {twoReaders ? "y0" : "y"}, "mm");
    if (twoReaders) {
      b.node("MatMul", {"x", "t"}, {"y1"}, "mm2");
      b.node("Mul", {"y0", "y1"}, {"y"}, "mul");
    }
    b.output("y", kDouble);
    checkModel(b);
    auto d = build(b.serialize(), Check{}.loss, /*inputGrads=*/true);
    ASSERT_TRUE(d);
    int transposes = 0, readsT = 0;
    for (const auto *lists : {&d->backward.inputGrad, &d->backward.weightGrad})
      for (const std::vector<onnx::NodeProto> &list : *lists)
        for (const onnx::NodeProto &node : list) {
          transposes += node.op_type() == "Transpose";
          readsT += std::count(node.input().begin(), node.input().end(), "t");
        }
    if (twoReaders) {
      EXPECT_EQ(transposes, 1); // t's gradient, transposed back
    } else {
      EXPECT_EQ(readsT, 0) << "the backward reads the transposed copy";
      EXPECT_EQ(transposes, 0);
    }
  }
}

TEST(Differentiate, Gemm) {
  for (int transA = 0; transA < 2; ++transA)
    for (int transB = 0; transB < 2; ++transB) {
      GraphBuilder b;
      b.input("a", kDouble, transA ? std::vector<int64_t>{4, 3} : std::vector<int64_t>{3, 4});
      doubleWeight(b, "w", transB ? std::vector<int64_t>{5, 4} : std::vector<int64_t>{4, 5});
      doubleWeight(b, "c", {5});
      auto &n = b.node("Gemm", {"a", "w", "c"}, {"y"}, "gemm");
      auto *a = n.add_attribute();
      a->set_name("transA"), a->set_type(onnx::AttributeProto::INT), a->set_i(transA);
      a = n.add_attribute();
      a->set_name("transB"), a->set_type(onnx::AttributeProto::INT), a->set_i(transB);
      a = n.add_attribute();
      a->set_name("alpha"), a->set_type(onnx::AttributeProto::FLOAT), a->set_f(0.5f);
      a = n.add_attribute();
      a->set_name("beta"), a->set_type(onnx::AttributeProto::FLOAT), a->set_f(2.0f);
      b.output("y", kDouble);
      SCOPED_TRACE("transA " + std::to_string(transA) + " transB " + std::to_string(transB));
      checkModel(b);
    }
}

/// Einsum(x, w) [equation], x a float64 input, w a float64 weight.
GraphBuilder einsumModel(const std::string &equation, const std::vector<int64_t> &xDims,
                         const std::vector<int64_t> &wDims) {
  GraphBuilder b = binaryModel("Einsum", xDims, wDims);
  setStringAttr(*b.graph().mutable_node(0), "equation", equation);
  return b;
}

TEST(Differentiate, EinsumOfTwoOperands) {
  struct Case {
    const char *equation;
    std::vector<int64_t> x, w;
  };
  const Case cases[] = {
      {"bij,bjk->bik", {2, 3, 4}, {2, 4, 5}},
      // The mixture of experts of user_moe.onnx: experts, then the gates.
      {"bsd,edf->bsef", {2, 3, 4}, {3, 4, 5}},
      {"bsef,efd->bsed", {2, 3, 2, 4}, {2, 4, 3}},
      {"bsed,bse->bsd", {2, 3, 2, 4}, {2, 3, 2}},
      {"ij,j->i", {3, 4}, {4}},
      // w's j of size 1 broadcasts: summed back for w, expanded for x.
      {"ij,j->i", {3, 4}, {1}},
      // '...' written out; x's second batch dimension broadcasts.
      {"...ij,...jk->...ik", {2, 1, 2, 3}, {2, 3, 3, 2}},
      {"bhqd,bhkd->bhqk", {2, 2, 3, 4}, {2, 2, 5, 4}},
      {"i,j->ij", {3}, {4}},
      // k is summed in w alone: its gradient is expanded along k.
      {"ij,jk->i", {3, 4}, {4, 5}},
      // The implicit output: the letters seen once, "ik".
      {"ij,jk", {3, 4}, {4, 5}},
      {"ij,ij->", {3, 4}, {3, 4}},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.equation);
    checkModel(einsumModel(c.equation, c.x, c.w));
  }
}

TEST(Differentiate, EinsumOfOneAndThreeOperands) {
  for (const char *equation : {"ij->ji", "ij->j", "ij->", "ij"}) {
    SCOPED_TRACE(equation);
    GraphBuilder b = unaryModel("Einsum");
    setStringAttr(*b.graph().mutable_node(1), "equation", equation);
    checkModel(b);
  }
  GraphBuilder three = einsumModel("ij,jk,k->i", {3, 4}, {4, 5});
  doubleWeight(three, "v", {5});
  three.graph().mutable_node(0)->add_input("v");
  checkModel(three);
  // One value as both operands: the two contributions add up.
  GraphBuilder twice = unaryModel("Einsum");
  twice.graph().mutable_node(1)->add_input("h");
  setStringAttr(*twice.graph().mutable_node(1), "equation", "ij,kj->ik");
  checkModel(twice);
}

TEST(Differentiate, EinsumDiagonalIsRefused) {
  GraphBuilder b = einsumModel("i,ii->i", {3}, {3, 3});
  EXPECT_NE(differentiateError(b).find("repeated label (a diagonal)"), std::string::npos)
      << differentiateError(b);
}

TEST(Differentiate, ElementwiseBroadcasting) {
  Check positive;
  positive.lo = 0.5, positive.hi = 1.5;
  for (const char *op : {"Add", "Sub", "Mul", "Div"}) {
    SCOPED_TRACE(op);
    checkModel(binaryModel(op, {2, 3, 4}, {3, 1}), positive);
    checkModel(binaryModel(op, {2, 3, 4}, {4}, /*swap=*/true), positive);
    checkModel(binaryModel(op, {3, 4}, {3, 4}), positive);
  }
}

TEST(Differentiate, Activations) {
  for (const char *op : {"Relu", "Tanh", "Sigmoid", "Erf", "Neg", "Identity"}) {
    SCOPED_TRACE(op);
    checkModel(unaryModel(op));
  }
}

TEST(Differentiate, GeluUnaryGradKernel) {
  // Gelu is an opset-20 op, past what the importer takes: the kernel is
  // checked against finite differences of the forward kernel instead.
  for (const char *approximate : {"none", "tanh"}) {
    onnx::NodeProto gelu, grad;
    gelu.set_op_type("Gelu");
    grad.set_op_type("UnaryGrad");
    grad.set_domain("pipec");
    auto *op = grad.add_attribute();
    op->set_name("op"), op->set_type(onnx::AttributeProto::STRING), op->set_s("Gelu");
    gelu.add_input("x"), gelu.add_output("y");
    grad.add_input("dy"), grad.add_input("x"), grad.add_output("dx");
    for (onnx::NodeProto *n : {&gelu, &grad}) {
      auto *a = n->add_attribute();
      a->set_name("approximate"), a->set_type(onnx::AttributeProto::STRING), a->set_s(approximate);
    }
    std::vector<double> xs{-2.5, -1.0, -0.3, 0.0, 0.4, 1.2, 3.0};
    const double eps = 1e-6;
    Tensor x = Tensor::fromValues<double>({7}, xs), ones(DType::F64, {7});
    for (int i = 0; i < 7; ++i)
      ones.setDouble(i, 1.0);
    Tensor plus = x.clone(), minus = x.clone();
    for (int i = 0; i < 7; ++i) {
      plus.setDouble(i, xs[i] + eps);
      minus.setDouble(i, xs[i] - eps);
    }
    auto yPlus = cpu::runOp(gelu, 20, {&plus});
    auto yMinus = cpu::runOp(gelu, 20, {&minus});
    auto dx = cpu::runOp(grad, 20, {&ones, &x});
    ASSERT_TRUE(bool(yPlus)) << llvm::toString(yPlus.takeError());
    ASSERT_TRUE(bool(yMinus)) << llvm::toString(yMinus.takeError());
    ASSERT_TRUE(bool(dx)) << llvm::toString(dx.takeError());
    for (int i = 0; i < 7; ++i) {
      double fd = ((*yPlus)[0].getDouble(i) - (*yMinus)[0].getDouble(i)) / (2 * eps);
      EXPECT_NEAR((*dx)[0].getDouble(i), fd, 1e-6) << approximate << " at " << xs[i];
    }
  }
}

TEST(Differentiate, GradKernelErrors) {
  onnx::NodeProto node;
  node.set_name("g");
  node.set_domain("pipec");
  node.set_op_type("SumTo");
  node.add_input("dy");
  node.add_output("dx");
  auto *a = node.add_attribute();
  a->set_name("shape"), a->set_type(onnx::AttributeProto::INTS), a->add_ints(3);
  Tensor dy(DType::F32, {2, 4});
  auto bad = cpu::runOp(node, 17, {&dy});
  ASSERT_FALSE(bool(bad));
  EXPECT_EQ(llvm::toString(bad.takeError()).rfind("node 'g' (SumTo)", 0), 0u);
  node.set_op_type("NoSuchGrad");
  auto unknown = cpu::runOp(node, 17, {&dy});
  ASSERT_FALSE(bool(unknown));
  EXPECT_NE(llvm::toString(unknown.takeError()).find("NoSuchGrad"), std::string::npos);
}

TEST(Differentiate, Sum) {
  GraphBuilder b = binaryModel("Sum", {2, 3, 4}, {3, 1});
  b.graph().mutable_node(0)->add_input("x");
  checkModel(b);
}

TEST(Differentiate, SqrtReciprocalExpLogPow) {
  Check positive;
  positive.lo = 0.5, positive.hi = 1.5;
  for (const char *op : {"Sqrt", "Reciprocal", "Exp", "Log"}) {
    SCOPED_TRACE(op);
    checkModel(unaryModel(op), positive);
  }
  GraphBuilder b = unaryModel("Identity");
  doubleScalar(b, "three", 3.0);
  b.graph().mutable_node(1)->set_op_type("Pow");
  b.graph().mutable_node(1)->add_input("three");
  checkModel(b, positive);
}

TEST(Differentiate, ReduceMeanAndSum) {
  for (int keepdims = 0; keepdims < 2; ++keepdims) {
    GraphBuilder b = unaryModel("Identity");
    auto &n = *b.graph().mutable_node(1);
    n.set_op_type("ReduceMean");
    auto *a = n.add_attribute();
    a->set_name("axes"), a->set_type(onnx::AttributeProto::INTS), a->add_ints(-1);
    a = n.add_attribute();
    a->set_name("keepdims"), a->set_type(onnx::AttributeProto::INT), a->set_i(keepdims);
    checkModel(b);
  }
  GraphBuilder b = unaryModel("Identity");
  b.ints("axes", {0});
  b.graph().mutable_node(1)->set_op_type("ReduceSum");
  b.graph().mutable_node(1)->add_input("axes");
  checkModel(b);
}

TEST(Differentiate, Softmax) {
  for (int axis : {-1, 0}) {
    GraphBuilder b = unaryModel("Softmax");
    auto *a = b.graph().mutable_node(1)->add_attribute();
    a->set_name("axis"), a->set_type(onnx::AttributeProto::INT), a->set_i(axis);
    checkModel(b);
  }
}

TEST(Differentiate, ShapeOps) {
  {
    GraphBuilder b = unaryModel("Transpose");
    auto *a = b.graph().mutable_node(1)->add_attribute();
    a->set_name("perm"), a->set_type(onnx::AttributeProto::INTS), a->add_ints(1), a->add_ints(0);
    checkModel(b);
  }
  {
    GraphBuilder b = unaryModel("Reshape");
    b.ints("shape", {2, 6});
    b.graph().mutable_node(1)->add_input("shape");
    checkModel(b);
  }
  {
    GraphBuilder b = unaryModel("Unsqueeze");
    b.ints("axes", {1});
    b.graph().mutable_node(1)->add_input("axes");
    checkModel(b);
  }
  {
    GraphBuilder b = unaryModel("Cast");
    auto *a = b.graph().mutable_node(1)->add_attribute();
    a->set_name("to"), a->set_type(onnx::AttributeProto::INT), a->set_i(kDouble);
    checkModel(b);
  }
}

TEST(Differentiate, LayerNormalization) {
  for (int axis : {-1, 1})
    for (bool bias : {true, false}) {
      GraphBuilder b;
      b.input("x", kDouble, {2, 3, 4});
      doubleWeight(b, "scale", axis == -1 ? std::vector<int64_t>{4} : std::vector<int64_t>{3, 4});
      std::vector<std::string> inputs{"x", "scale"};
      if (bias) {
        doubleWeight(b, "bias", axis == -1 ? std::vector<int64_t>{4} : std::vector<int64_t>{3, 4});
        inputs.push_back("bias");
      }
      auto &n = b.node("LayerNormalization", inputs, {"y"}, "ln");
      setIntAttr(n, "axis", axis);
      b.output("y", kDouble);
      SCOPED_TRACE("axis " + std::to_string(axis) + (bias ? " with bias" : ""));
      checkModel(b);
    }
}

TEST(Differentiate, RmsNormalization) {
  for (int axis : {-1, 1})
    for (const std::vector<int64_t> &scale : {std::vector<int64_t>{4}, {1, 4}, {3, 4}}) {
      if (axis == -1 && scale.size() > 1)
        continue;
      GraphBuilder b(23);
      b.input("x", kDouble, {2, 3, 4});
      doubleWeight(b, "scale", scale);
      auto &n = b.node("RMSNormalization", {"x", "scale"}, {"y"}, "rms");
      setIntAttr(n, "axis", axis);
      setFloatAttr(n, "epsilon", 1e-3f);
      b.output("y", kDouble);
      SCOPED_TRACE("axis " + std::to_string(axis) + ", scale rank " + std::to_string(scale.size()));
      checkModel(b);
    }
}

TEST(Differentiate, InstanceAndGroupNormalization) {
  for (const std::vector<int64_t> &dims : {std::vector<int64_t>{2, 4, 3}, {2, 4, 2, 3}}) {
    SCOPED_TRACE("rank " + std::to_string(dims.size()));
    {
      GraphBuilder b;
      b.input("x", kDouble, dims);
      doubleWeight(b, "scale", {4});
      doubleWeight(b, "bias", {4});
      auto &n = b.node("InstanceNormalization", {"x", "scale", "bias"}, {"y"}, "in");
      setFloatAttr(n, "epsilon", 1e-3f);
      b.output("y", kDouble);
      SCOPED_TRACE("InstanceNormalization");
      checkModel(b);
    }
    // Opset 18 takes scale and bias per group, 21 per channel.
    for (int opset : {18, 21}) {
      GraphBuilder b(opset);
      b.input("x", kDouble, dims);
      std::vector<int64_t> params{opset == 18 ? 2 : 4};
      doubleWeight(b, "scale", params);
      doubleWeight(b, "bias", params);
      auto &n = b.node("GroupNormalization", {"x", "scale", "bias"}, {"y"}, "gn");
      setIntAttr(n, "num_groups", 2);
      setFloatAttr(n, "epsilon", 1e-3f);
      b.output("y", kDouble);
      SCOPED_TRACE("GroupNormalization-" + std::to_string(opset));
      checkModel(b);
    }
  }
}

TEST(Differentiate, WhereExpandDropoutSqueeze) {
  {
    GraphBuilder b;
    b.input("c", onnx::TensorProto::BOOL, {3, 1});
    b.input("x", kDouble, {3, 4});
    doubleWeight(b, "w", {4});
    b.node("Where", {"c", "x", "w"}, {"y"}, "where");
    b.output("y", kDouble);
    Check check;
    check.feeds["c"] = Tensor::fromValues<bool>({3, 1}, {true, false, true});
    checkModel(b, check);
  }
  {
    GraphBuilder b = unaryModel("Expand");
    b.ints("shape", {2, 3, 4});
    b.graph().mutable_node(1)->add_input("shape");
    checkModel(b);
  }
  checkModel(unaryModel("Dropout"));
  {
    GraphBuilder b = unaryModel("Unsqueeze");
    b.ints("axes", {0});
    b.graph().mutable_node(1)->add_input("axes");
    b.graph().mutable_node(1)->set_output(0, "u");
    b.node("Squeeze", {"u", "axes"}, {"y"}, "squeeze");
    checkModel(b);
  }
}

TEST(Differentiate, ConcatSplitSlice) {
  {
    GraphBuilder b;
    b.input("x", kDouble, {3, 2});
    doubleWeight(b, "w", {3, 4});
    auto &n = b.node("Concat", {"x", "w", "x"}, {"y"}, "concat");
    setIntAttr(n, "axis", 1);
    b.output("y", kDouble);
    checkModel(b);
  }
  {
    // Only two of the three parts reach the loss: the third gets zeros.
    GraphBuilder b = unaryModel("Split");
    b.ints("split", {1, 2, 1});
    auto &n = *b.graph().mutable_node(1);
    n.add_input("split");
    n.set_output(0, "p0");
    n.add_output("p1");
    n.add_output("p2");
    setIntAttr(n, "axis", 1);
    b.node("Mul", {"p0", "p2"}, {"y"}, "mul2");
    checkModel(b);
  }
  {
    GraphBuilder b = unaryModel("Slice");
    b.ints("starts", {1, -3});
    b.ints("ends", {100, 3});
    b.ints("axes", {0, 1});
    auto &n = *b.graph().mutable_node(1);
    for (const char *in : {"starts", "ends", "axes"})
      n.add_input(in);
    checkModel(b);
  }
}

TEST(Differentiate, GatherOnEmbedding) {
  GraphBuilder b;
  b.input("ids", kInt64, {2, 3});
  doubleWeight(b, "emb", {6, 4});
  b.node("Gather", {"emb", "ids"}, {"h"}, "gather");
  b.node("Tanh", {"h"}, {"y"}, "tanh");
  b.output("y", kDouble);
  Check check;
  check.feeds["ids"] = Tensor::fromValues<int64_t>({2, 3}, {0, 5, 2, 2, -1, 3});
  checkModel(b, check);
}

TEST(Differentiate, ConvGradKernelErrors) {
  // dY [1, 3, 4, 4] cannot come from X [1, 2, 4, 4] and an unpadded 3x3 W.
  onnx::NodeProto node;
  node.set_name("c");
  node.set_domain("pipec");
  node.set_op_type("ConvGradInput");
  node.add_input("dy"), node.add_input("w"), node.add_output("dx");
  setIntsAttr(node, "shape", {1, 2, 4, 4});
  Tensor dy(DType::F32, {1, 3, 4, 4}), w(DType::F32, {3, 2, 3, 3});
  auto bad = cpu::runOp(node, 17, {&dy, &w});
  ASSERT_FALSE(bool(bad));
  EXPECT_EQ(llvm::toString(bad.takeError()),
            "node 'c' (ConvGradInput): output size 4 does not fit input size 4 in spatial "
            "dimension 0");
  node.set_op_type("MaxPoolGrad");
  auto noKernel = cpu::runOp(node, 17, {&dy, &dy});
  ASSERT_FALSE(bool(noKernel));
  EXPECT_EQ(llvm::toString(noKernel.takeError()),
            "node 'c' (MaxPoolGrad): missing attribute 'kernel_shape'");
}

TEST(Differentiate, AbsClipMaxMin) {
  checkModel(unaryModel("Abs"));
  for (bool lower : {true, false}) {
    // Bounds as inputs; without a lower one min is omitted by an empty name.
    GraphBuilder b = unaryModel("Clip");
    doubleScalar(b, "lo", -0.2);
    doubleScalar(b, "hi", 0.3);
    auto &n = *b.graph().mutable_node(1);
    n.add_input(lower ? "lo" : "");
    n.add_input("hi");
    SCOPED_TRACE(lower ? "min and max" : "max only");
    checkModel(b);
  }
  {
    // Opset 10: bounds as attributes.
    GraphBuilder b(10);
    b.input("x", kDouble, {3, 4});
    doubleWeight(b, "w", {4});
    b.node("Mul", {"x", "w"}, {"h"}, "mul");
    auto &n = b.node("Clip", {"h"}, {"y"}, "clip");
    setFloatAttr(n, "min", -0.25f);
    setFloatAttr(n, "max", 0.5f);
    b.output("y", kDouble);
    SCOPED_TRACE("opset 10");
    checkModel(b);
  }
  for (const char *op : {"Max", "Min"}) {
    SCOPED_TRACE(op);
    checkModel(binaryModel(op, {2, 3, 4}, {3, 1}));
    checkModel(binaryModel(op, {3, 4}, {3, 4}, /*swap=*/true));
    // Three operands, x twice: where the two tie, the first takes dY.
    GraphBuilder b = binaryModel(op, {3, 4}, {4});
    b.graph().mutable_node(0)->add_input("x");
    checkModel(b);
  }
}

/// Checks the gradients of one \p op node (Conv, ConvTranspose) of X \p x
/// and W \p w, with a bias of \p biasSize (0: none) and the integer-list
/// attributes that are not empty.
void checkWindowOp(const std::string &op, const std::string &name, const std::vector<int64_t> &x,
                   const std::vector<int64_t> &w, int64_t biasSize,
                   const std::vector<std::pair<std::string, std::vector<int64_t>>> &lists,
                   int64_t group, const std::string &autoPad) {
  GraphBuilder b;
  b.input("x", kDouble, x);
  doubleWeight(b, "w", w);
  std::vector<std::string> inputs{"x", "w"};
  if (biasSize > 0) {
    doubleWeight(b, "b", {biasSize});
    inputs.push_back("b");
  }
  auto &n = b.node(op, inputs, {"y"}, "window");
  for (const auto &[attr, values] : lists)
    if (!values.empty())
      setIntsAttr(n, attr, values);
  if (group != 1)
    setIntAttr(n, "group", group);
  if (!autoPad.empty())
    setStringAttr(n, "auto_pad", autoPad);
  b.output("y", kDouble);
  SCOPED_TRACE(name);
  checkModel(b);
}

/// A Conv case: attributes left empty are omitted.
struct ConvCase {
  std::string name;
  std::vector<int64_t> x, w, strides, pads, dilations = {};
  int64_t group = 1;
  std::string autoPad = "";
  bool bias = false;
};

TEST(Differentiate, Conv) {
  const ConvCase cases[] = {
      {"3x3 pad 1 bias", {2, 3, 5, 5}, {4, 3, 3, 3}, {}, {1, 1, 1, 1}, {}, 1, "", true},
      {"stride 2 asymmetric pads", {1, 2, 6, 5}, {3, 2, 3, 2}, {2, 2}, {0, 1, 1, 0}, {}, 1, ""},
      {"dilation 2", {1, 2, 7, 7}, {2, 2, 3, 3}, {}, {1, 1, 1, 1}, {2, 2}, 1, ""},
      {"group 2 stride 2 bias", {2, 4, 5, 5}, {6, 2, 3, 3}, {2, 2}, {1, 1, 1, 1}, {}, 2, "", true},
      {"depthwise", {1, 3, 4, 4}, {3, 1, 3, 3}, {}, {1, 1, 1, 1}, {}, 3, ""},
      {"1x1 bias", {2, 3, 4, 4}, {5, 3, 1, 1}, {}, {}, {}, 1, "", true},
      {"1x1 stride 2", {1, 3, 5, 5}, {2, 3, 1, 1}, {2, 2}, {}, {}, 1, ""},
      {"SAME_UPPER", {1, 2, 5, 5}, {2, 2, 2, 2}, {2, 2}, {}, {}, 1, "SAME_UPPER"},
      {"SAME_LOWER", {1, 2, 5, 6}, {2, 2, 2, 3}, {2, 2}, {}, {}, 1, "SAME_LOWER"},
      {"VALID bias", {1, 2, 5, 5}, {2, 2, 3, 3}, {2, 1}, {}, {}, 1, "VALID", true},
      {"1-D bias", {2, 3, 7}, {4, 3, 3}, {2}, {1, 0}, {}, 1, "", true},
      {"3-D bias",
       {1, 2, 3, 4, 4},
       {2, 2, 2, 3, 3},
       {1, 2, 1},
       {1, 1, 1, 0, 0, 1},
       {},
       1,
       "",
       true},
  };
  for (const ConvCase &c : cases)
    checkWindowOp("Conv", c.name, c.x, c.w, c.bias ? c.w[0] : 0,
                  {{"strides", c.strides}, {"pads", c.pads}, {"dilations", c.dilations}}, c.group,
                  c.autoPad);
}

/// A ConvTranspose case: attributes left empty are omitted.
struct ConvTransposeCase {
  std::string name;
  std::vector<int64_t> x, w, strides, pads, dilations = {}, outputPadding = {}, outputShape = {};
  int64_t group = 1;
  std::string autoPad = "";
  bool bias = false;
};

TEST(Differentiate, ConvTranspose) {
  const ConvTransposeCase cases[] = {
      {"3x3 pad 1 bias", {2, 3, 4, 4}, {3, 2, 3, 3}, {}, {1, 1, 1, 1}, {}, {}, {}, 1, "", true},
      {"stride 2 output_padding", {1, 2, 3, 3}, {2, 3, 3, 2}, {2, 2}, {1, 0, 0, 1}, {}, {1, 1}},
      {"dilation 2 group 2 bias", {1, 4, 3, 3}, {4, 1, 2, 2}, {}, {}, {2, 2}, {}, {}, 2, "", true},
      {"output_shape", {1, 2, 3, 3}, {2, 2, 3, 3}, {2, 2}, {}, {}, {}, {5, 6}},
      {"SAME_UPPER", {1, 2, 3, 3}, {2, 2, 3, 3}, {2, 2}, {}, {}, {}, {}, 1, "SAME_UPPER"},
      {"1-D stride 3 bias", {2, 2, 4}, {2, 3, 4}, {3}, {1, 2}, {}, {}, {}, 1, "", true},
  };
  for (const ConvTransposeCase &c : cases)
    checkWindowOp("ConvTranspose", c.name, c.x, c.w, c.bias ? c.w[1] * c.group : 0,
                  {{"strides", c.strides},
                   {"pads", c.pads},
                   {"dilations", c.dilations},
                   {"output_padding", c.outputPadding},
                   {"output_shape", c.outputShape}},
                  c.group, c.autoPad);
}

/// A Resize case to sizes (an int64 initializer; float initializers are
/// randomized by the checks).
struct ResizeCase {
  std::string name;
  std::vector<int64_t> x, sizes;
  std::vector<std::pair<std::string, std::string>> attrs;
  int64_t antialias = 0;
};

TEST(Differentiate, Resize) {
  const ResizeCase cases[] = {
      {"nearest", {1, 2, 3, 4}, {1, 2, 7, 5}, {{"mode", "nearest"}}},
      {"nearest asymmetric floor down",
       {1, 1, 5, 6},
       {1, 1, 3, 4},
       {{"mode", "nearest"},
        {"coordinate_transformation_mode", "asymmetric"},
        {"nearest_mode", "floor"}}},
      {"linear half_pixel", {2, 2, 3, 4}, {2, 2, 5, 7}, {{"mode", "linear"}}},
      {"linear align_corners",
       {1, 2, 4},
       {1, 2, 7},
       {{"mode", "linear"}, {"coordinate_transformation_mode", "align_corners"}}},
      {"cubic exclude_outside",
       {1, 1, 4, 5},
       {1, 1, 6, 3},
       {{"mode", "cubic"}, {"exclude_outside", "1"}}},
      {"linear antialias down", {1, 1, 6, 7}, {1, 1, 4, 3}, {{"mode", "linear"}}, 1},
  };
  for (const ResizeCase &c : cases) {
    GraphBuilder b(18);
    b.input("x", kDouble, c.x);
    b.ints("sizes", c.sizes);
    auto &n = b.node("Resize", {"x", "", "", "sizes"}, {"y"}, "resize");
    for (const auto &[name, value] : c.attrs) {
      if (name == "exclude_outside")
        setIntAttr(n, name, std::stoll(value));
      else
        setStringAttr(n, name, value);
    }
    if (c.antialias)
      setIntAttr(n, "antialias", c.antialias);
    b.output("y", kDouble);
    SCOPED_TRACE(c.name);
    checkModel(b);
  }
}

/// A MaxPool or AveragePool case: attributes left empty are omitted.
struct PoolCase {
  std::string op;
  std::vector<int64_t> x, kernel, strides, pads, dilations = {};
  int64_t ceilMode = 0, countIncludePad = 0;
  std::string autoPad = "";
};

TEST(Differentiate, Pools) {
  const PoolCase cases[] = {
      // Overlapping windows.
      {"MaxPool", {2, 2, 7, 7}, {3, 3}, {2, 2}, {1, 1, 1, 1}},
      {"MaxPool", {1, 2, 5, 5}, {3, 3}, {1, 1}, {}},
      {"MaxPool", {1, 2, 5, 5}, {2, 2}, {2, 2}, {}, {}, /*ceilMode=*/1},
      {"MaxPool", {1, 1, 6, 6}, {3, 3}, {2, 2}, {1, 1, 1, 1}, {}, 1},
      {"MaxPool", {1, 2, 6, 6}, {2, 2}, {1, 1}, {}, {2, 2}},
      {"MaxPool", {1, 2, 6, 6}, {3, 3}, {2, 2}, {}, {}, 0, 0, "SAME_UPPER"},
      {"MaxPool", {2, 3, 9}, {3}, {2}, {1, 1}},
      {"MaxPool", {1, 1, 4, 4, 4}, {2, 2, 2}, {2, 2, 2}, {}},
      {"AveragePool", {2, 2, 7, 7}, {3, 3}, {2, 2}, {1, 1, 1, 1}},
      {"AveragePool", {2, 2, 7, 7}, {3, 3}, {2, 2}, {1, 1, 1, 1}, {}, 0, /*countIncludePad=*/1},
      {"AveragePool", {1, 2, 5, 5}, {2, 2}, {2, 2}, {}, {}, 1, 1},
      {"AveragePool", {1, 1, 6, 6}, {3, 3}, {2, 2}, {1, 1, 1, 1}, {}, 1, 1},
      {"AveragePool", {1, 2, 4, 4}, {2, 2}, {1, 1}, {}, {}, 0, 0, "SAME_LOWER"},
      {"AveragePool", {2, 3, 6}, {3}, {1}, {1, 1}, {}, 0, 1},
  };
  for (const PoolCase &c : cases) {
    GraphBuilder b;
    b.input("x", kDouble, c.x);
    auto &n = b.node(c.op, {"x"}, {"y"}, "pool");
    for (const auto &[name, values] :
         {std::pair("kernel_shape", c.kernel), std::pair("strides", c.strides),
          std::pair("pads", c.pads), std::pair("dilations", c.dilations)})
      if (!values.empty())
        setIntsAttr(n, name, values);
    if (c.ceilMode)
      setIntAttr(n, "ceil_mode", 1);
    if (c.countIncludePad)
      setIntAttr(n, "count_include_pad", 1);
    if (!c.autoPad.empty())
      setStringAttr(n, "auto_pad", c.autoPad);
    b.output("y", kDouble);
    SCOPED_TRACE(c.op + " x " + ::testing::PrintToString(c.x) + " kernel " +
                 ::testing::PrintToString(c.kernel) + " ceil " + std::to_string(c.ceilMode) +
                 " include pad " + std::to_string(c.countIncludePad) + " " + c.autoPad);
    checkModel(b);
  }
}

TEST(Differentiate, GlobalPools) {
  for (const char *op : {"GlobalAveragePool", "GlobalMaxPool"})
    for (const std::vector<int64_t> &dims : {std::vector<int64_t>{2, 3, 4, 5}, {2, 3, 5}}) {
      // y = pool(x * w), w per channel.
      GraphBuilder b;
      b.input("x", kDouble, dims);
      std::vector<int64_t> wDims(dims.size() - 1, 1);
      wDims[0] = dims[1];
      doubleWeight(b, "w", wDims);
      b.node("Mul", {"x", "w"}, {"h"}, "mul");
      b.node(op, {"h"}, {"y"}, "pool");
      b.output("y", kDouble);
      SCOPED_TRACE(std::string(op) + " rank " + std::to_string(dims.size()));
      checkModel(b);
    }
}

/// y = BatchNormalization "bn" of input x of \p dims, its scale, bias, mean
/// and var weights of dims[1] channels; in training mode, with the running
/// statistics' outputs, when \p training. Returns the node.
onnx::NodeProto &batchNormModel(GraphBuilder &b, const std::vector<int64_t> &dims, bool training) {
  b.input("x", kDouble, dims);
  for (const char *name : {"scale", "bias", "mean", "var"})
    doubleWeight(b, name, {dims[1]});
  std::vector<std::string> outputs = {"y"};
  if (training)
    outputs = {"y", "new_mean", "new_var"};
  onnx::NodeProto &n =
      b.node("BatchNormalization", {"x", "scale", "bias", "mean", "var"}, outputs, "bn");
  if (training)
    setIntAttr(n, "training_mode", 1);
  b.output("y", kDouble);
  return n;
}

TEST(Differentiate, BatchNormalizationInference) {
  for (const std::vector<int64_t> &dims : {std::vector<int64_t>{2, 3, 4, 4}, {4, 3}}) {
    GraphBuilder b;
    setFloatAttr(batchNormModel(b, dims, /*training=*/false), "epsilon", 1e-3f);
    SCOPED_TRACE("rank " + std::to_string(dims.size()));
    auto d = build(b.serialize(), Check().loss, /*inputGrads=*/true);
    ASSERT_TRUE(d);
    // The statistics have no gradient (checkFiniteDifferences expects so).
    EXPECT_GT(checkFiniteDifferences(*d, Check()), 0);
    EXPECT_EQ(d->backward.weightGrads.size(), 2u);
    EXPECT_TRUE(d->backward.weightGrads.count("scale"));
    EXPECT_TRUE(d->backward.weightGrads.count("bias"));
  }
}

TEST(Differentiate, BatchNormalizationTraining) {
  // The batch's statistics normalize: dX goes through the mean and variance
  // too. Checked against central differences of the forward kernel.
  for (const std::vector<int64_t> &dims : {std::vector<int64_t>{3, 2, 3, 2}, {5, 3}}) {
    GraphBuilder b(15);
    onnx::NodeProto &n = batchNormModel(b, dims, /*training=*/true);
    setFloatAttr(n, "epsilon", 1e-3f);
    setFloatAttr(n, "momentum", 0.8f);
    SCOPED_TRACE("rank " + std::to_string(dims.size()));
    auto d = build(b.serialize(), Check().loss, /*inputGrads=*/true);
    ASSERT_TRUE(d);
    EXPECT_GT(checkFiniteDifferences(*d, Check()), 0);
    EXPECT_EQ(d->backward.weightGrads.size(), 2u);
    // The running statistics get no gradient; each microbatch's batch mean
    // and unbiased variance update them, with the node's momentum.
    ASSERT_EQ(d->backward.runningStats.size(), 2u);
    EXPECT_EQ(d->backward.runningStats[0].buffer, "mean");
    EXPECT_EQ(d->backward.runningStats[1].buffer, "var");
    EXPECT_FLOAT_EQ(d->backward.runningStats[1].momentum, 0.8f);
  }
}

TEST(Differentiate, TrainingBatchNormalizationNeedsTwoValuesPerChannel) {
  GraphBuilder b(15);
  batchNormModel(b, {1, 3}, /*training=*/true);
  EXPECT_EQ(differentiateError(b),
            "node 'bn' (BatchNormalization): training needs more than one value per channel; a "
            "microbatch has 1");
}

TEST(Differentiate, SharedRunningStatisticIsRefused) {
  // Two training-mode BatchNormalizations reading one running mean (an
  // exporter shares equal tensors): each must keep its own.
  GraphBuilder b(15);
  b.input("x", kDouble, {4, 3});
  for (const char *name : {"scale", "bias", "mean", "var", "var2"})
    doubleWeight(b, name, {3});
  for (int k : {1, 2}) {
    std::string in = k == 1 ? "x" : "y1", out = "y" + std::to_string(k);
    auto &n = b.node("BatchNormalization", {in, "scale", "bias", "mean", k == 1 ? "var" : "var2"},
                     {out, out + "_mean", out + "_var"}, "bn" + std::to_string(k));
    setIntAttr(n, "training_mode", 1);
  }
  b.output("y2", kDouble);
  EXPECT_EQ(differentiateError(b),
            "initializer 'mean' is the running statistic of BatchNormalization nodes 'bn1' and "
            "'bn2'; each needs its own (an exporter shared equal tensors: pass --untie mean)");
}

TEST(Differentiate, SoftmaxCrossEntropy) {
  // As a loss spec on the model's output, and as the model's own loss op.
  GraphBuilder b = binaryModel("MatMul", {4, 3}, {3, 5});
  Check check;
  check.feeds["labels"] = Tensor::fromValues<int64_t>({4}, {0, 4, 2, 2});
  check.loss = {LossSpec::Kind::SoftmaxCrossEntropy, "", "labels"};
  checkModel(b, check);

  b.input("labels", kInt64, {4});
  auto &n = b.node("SoftmaxCrossEntropyLoss", {"y", "labels"}, {"loss"}, "ce");
  auto *a = n.add_attribute();
  a->set_name("ignore_index"), a->set_type(onnx::AttributeProto::INT), a->set_i(2);
  b.output("loss", kDouble);
  check.loss = {LossSpec::Kind::ModelOutput, "loss", ""};
  checkModel(b, check);
}

TEST(Differentiate, SharedValueAccumulates) {
  // x feeds two paths and w is read twice: both gradients are sums.
  GraphBuilder b;
  b.input("x", kDouble, {3, 4});
  doubleWeight(b, "w", {4, 4});
  b.node("MatMul", {"x", "w"}, {"h"}, "mm1");
  b.node("Tanh", {"h"}, {"t"}, "tanh");
  b.node("MatMul", {"t", "w"}, {"u"}, "mm2");
  b.node("Mul", {"u", "x"}, {"y"}, "mul");
  b.output("y", kDouble);
  checkModel(b);
}

TEST(Differentiate, UnaryOpsOfTheRegistry) {
  // Every unary op whose gradient rule is the generic one differentiates
  // through its math's derivative (ElementMath.h) with no rule of its own.
  // Inputs x * w in (0.09, 0.81), inside every op's domain and away from
  // kinks; (1.21, 2.25) for an op undefined there (Acosh).
  int checked = 0;
  for (const OpDef &def : allOps()) {
    if (!def.elem || def.minInputs != 1 || def.grad != GradKind::Rule ||
        def.domain != OpDomain::Onnx)
      continue;
    SCOPED_TRACE(def.name.str());
    Check check;
    check.lo = 0.3, check.hi = 0.9;
    if (std::isnan(kernels::elemValue(*def.elem, 0.5f, 0, kernels::ElemParams())))
      check.lo = 1.1, check.hi = 1.5;
    checkModel(unaryModel(def.name.str(), std::max(17, def.since)), check);
    ++checked;
  }
  EXPECT_GE(checked, 30);
  // The attributes reach the gradient kernel.
  GraphBuilder leaky = unaryModel("LeakyRelu");
  setFloatAttr(*leaky.graph().mutable_node(1), "alpha", 0.3f);
  checkModel(leaky);
  GraphBuilder elu = unaryModel("Elu");
  setFloatAttr(*elu.graph().mutable_node(1), "alpha", 0.7f);
  checkModel(elu);
  GraphBuilder hard = unaryModel("HardSigmoid");
  setFloatAttr(*hard.graph().mutable_node(1), "alpha", 0.3f);
  setFloatAttr(*hard.graph().mutable_node(1), "beta", 0.4f);
  checkModel(hard);
}

/// The UnaryGrad node of \p d's backward program (the only one expected).
const onnx::NodeProto *unaryGradNode(const Differentiated &d) {
  const onnx::NodeProto *found = nullptr;
  for (const auto *lists : {&d.backward.inputGrad, &d.backward.weightGrad})
    for (const auto &list : *lists)
      for (const onnx::NodeProto &node : list)
        if (node.op_type() == "UnaryGrad") {
          EXPECT_EQ(found, nullptr) << "two UnaryGrad nodes";
          EXPECT_EQ(node.domain(), "pipec");
          found = &node;
        }
  return found;
}

TEST(Differentiate, UnaryGradReadsXOrYAsTheMathSays) {
  // LeakyRelu's derivative reads X and takes alpha; Tanh's reads Y.
  GraphBuilder leaky = unaryModel("LeakyRelu");
  setFloatAttr(*leaky.graph().mutable_node(1), "alpha", 0.3f);
  auto d = build(leaky.serialize(), {LossSpec::Kind::Mse, "", "labels"}, false);
  ASSERT_TRUE(d);
  const onnx::NodeProto *g = unaryGradNode(*d);
  ASSERT_NE(g, nullptr);
  ASSERT_EQ(g->input_size(), 2);
  EXPECT_EQ(g->input(1), "h");
  EXPECT_EQ(attrString(*g, "op", ""), "LeakyRelu");
  EXPECT_EQ(attrFloat(*g, "alpha", 0), 0.3f);

  auto t = build(unaryModel("Tanh").serialize(), {LossSpec::Kind::Mse, "", "labels"}, false);
  ASSERT_TRUE(t);
  g = unaryGradNode(*t);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->input(1), "y");
  EXPECT_EQ(attrString(*g, "op", ""), "Tanh");
}

TEST(Differentiate, ZeroDerivativeOpsPassNoGradient) {
  // y = op(h) + h: the gradient flows through the sum only (Floor, Ceil,
  // Round and Sign are flat almost everywhere).
  for (const char *op : {"Floor", "Ceil", "Round", "Sign"}) {
    SCOPED_TRACE(op);
    GraphBuilder b = unaryModel(op);
    b.graph().mutable_node(1)->set_output(0, "f");
    b.node("Add", {"f", "h"}, {"y"}, "add");
    checkModel(b);
  }
}

TEST(Differentiate, NoRuleNamesTheNode) {
  EXPECT_EQ(differentiateError(unaryModel("LogSoftmax")),
            "node 'n' (LogSoftmax): no gradient rule");
}

TEST(Differentiate, BadLossSpecs) {
  GraphBuilder b = binaryModel("MatMul", {3, 4}, {4, 5});
  EXPECT_EQ(differentiateError(b, {LossSpec::Kind::ModelOutput, "y", ""}),
            "loss: 'y' is not a scalar ([3,5])");
  EXPECT_EQ(differentiateError(b, {LossSpec::Kind::ModelOutput, "", ""}),
            "loss: no value named ''");
}

} // namespace
