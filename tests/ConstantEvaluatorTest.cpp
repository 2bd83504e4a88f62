//===- ConstantEvaluatorTest.cpp - The element math of constant folding --===//
//
// evaluateOp on the element-wise cases where folding keeps its own math
// rather than math/ElementMath.h's (NaN in Max and Min, the sign
// of Abs(-0)) and on integer division, whose semantics folding defines:
// truncation, a refused zero divisor, Mod with the divisor's sign.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "passes/ConstantEvaluator.h"

#include <cmath>
#include <limits>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

/// A vector of F32 \p values.
ConstTensor floats(std::vector<double> values) {
  int64_t n = static_cast<int64_t>(values.size());
  return ConstTensor{DType::F32, {n}, {}, std::move(values)};
}

/// A vector of I64 \p values.
ConstTensor ints(std::vector<int64_t> values) {
  int64_t n = static_cast<int64_t>(values.size());
  return ConstTensor{DType::I64, {n}, std::move(values), {}};
}

/// Evaluates one \p type node over \p inputs, all of ONNX element type
/// \p elemType, in a graph of opset 17.
llvm::Expected<ConstTensor> evaluate(const std::string &type, int elemType,
                                     const std::vector<ConstTensor> &inputs) {
  GraphBuilder b(17);
  std::vector<std::string> names;
  for (size_t i = 0; i < inputs.size(); ++i) {
    names.push_back("x" + std::to_string(i));
    b.input(names.back(), elemType, inputs[i].shape);
  }
  b.node(type, names, {"y"});
  b.output("y", elemType);
  auto graph = importOnnxBuffer(llvm::MemoryBuffer::getMemBufferCopy(b.serialize()), "one.onnx",
                                ".", ImportOptions());
  if (!graph)
    return graph.takeError();
  EXPECT_TRUE(isEvaluable(*graph, graph->ops.at(0))) << type;
  std::vector<const ConstTensor *> pointers;
  for (const ConstTensor &t : inputs)
    pointers.push_back(&t);
  auto out = evaluateOp(*graph, graph->ops.at(0), pointers, 1 << 20);
  if (!out)
    return out.takeError();
  if (!*out)
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "the result is too large");
  return std::move((**out).at(0));
}

TEST(ConstantEvaluator, MaxAndMinGiveTheFirstOperandWhenEitherIsNan) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  auto max = evaluate("Max", onnx::TensorProto::FLOAT, {floats({nan, 1.0}), floats({1.0, nan})});
  ASSERT_TRUE(!!max) << toString(max.takeError());
  EXPECT_TRUE(std::isnan(max->floats[0]));
  EXPECT_EQ(max->floats[1], 1.0);
  auto min = evaluate("Min", onnx::TensorProto::FLOAT, {floats({nan, 1.0}), floats({1.0, nan})});
  ASSERT_TRUE(!!min) << toString(min.takeError());
  EXPECT_TRUE(std::isnan(min->floats[0]));
  EXPECT_EQ(min->floats[1], 1.0);
  // Without NaN, both are the ordinary maximum and minimum.
  auto plain = evaluate("Max", onnx::TensorProto::INT64, {ints({-3, 5}), ints({2, -7})});
  ASSERT_TRUE(!!plain) << toString(plain.takeError());
  EXPECT_EQ(plain->ints, (std::vector<int64_t>{2, 5}));
}

TEST(ConstantEvaluator, AbsClearsTheSignOfZero) {
  auto abs = evaluate("Abs", onnx::TensorProto::FLOAT, {floats({-0.0, -2.5})});
  ASSERT_TRUE(!!abs) << toString(abs.takeError());
  EXPECT_FALSE(std::signbit(abs->floats[0]));
  EXPECT_EQ(abs->floats[1], 2.5);
}

TEST(ConstantEvaluator, IntegerDivisionTruncatesAndRefusesZero) {
  auto div = evaluate("Div", onnx::TensorProto::INT64, {ints({7, -7, 7}), ints({2, 2, -2})});
  ASSERT_TRUE(!!div) << toString(div.takeError());
  EXPECT_EQ(div->ints, (std::vector<int64_t>{3, -3, -3}));
  auto mod = evaluate("Mod", onnx::TensorProto::INT64, {ints({7, -7, 7}), ints({-2, 2, 2})});
  ASSERT_TRUE(!!mod) << toString(mod.takeError());
  EXPECT_EQ(mod->ints, (std::vector<int64_t>{-1, 1, 1})) << "the divisor's sign";
  for (const char *type : {"Div", "Mod"}) {
    auto zero = evaluate(type, onnx::TensorProto::INT64, {ints({1, 2}), ints({1, 0})});
    ASSERT_FALSE(!!zero) << type;
    EXPECT_NE(toString(zero.takeError()).find("integer division by zero"), std::string::npos);
  }
}

} // namespace
