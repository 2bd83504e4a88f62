//===- KernelTestUtil.h - Node builders for the runtime's kernel tests ---===//
//
// Header-only: node builders, random tensors and the CPU reference that the
// kernel tests share. The runtime tests link the runtime libraries and never
// the compiler (TestUtil.h brings the compiler's).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_KERNELTESTUTIL_H
#define PIPEC_TESTS_KERNELTESTUTIL_H

#include "runtime/core/Backend.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/core/Tensor.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/kernels/KernelBodies.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace pipec::test {

/// A node of one output named \p output (and named after it), reading
/// \p inputs.
inline onnx::NodeProto makeNode(const std::string &op, const std::vector<std::string> &inputs,
                                const std::string &output, const std::string &domain = "") {
  onnx::NodeProto n;
  n.set_op_type(op);
  n.set_domain(domain);
  n.set_name(output);
  for (const std::string &in : inputs)
    n.add_input(in);
  n.add_output(output);
  return n;
}

/// UnaryGrad of \p op: \p output = \p dy times op's derivative at \p a.
inline onnx::NodeProto unaryGrad(const std::string &op, const std::string &dy, const std::string &a,
                                 const std::string &output) {
  onnx::NodeProto n = makeNode("UnaryGrad", {dy, a}, output, "pipec");
  auto *attr = n.add_attribute();
  attr->set_name("op");
  attr->set_type(onnx::AttributeProto::STRING);
  attr->set_s(op);
  return n;
}

using cpu::Tensor;
using pipec::DType;
using Shape = std::vector<int64_t>;

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
  onnx::NodeProto node;

private:
  onnx::AttributeProto *add(const std::string &name, onnx::AttributeProto::AttributeType type) {
    auto *a = node.add_attribute();
    a->set_name(name);
    a->set_type(type);
    return a;
  }
};

inline std::mt19937 &rng() {
  static std::mt19937 generator(1234);
  return generator;
}

inline Tensor floats(const Shape &shape, float lo = -1, float hi = 1) {
  Tensor t(DType::F32, shape);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<float>()[i] = dist(rng());
  return t;
}

inline Tensor int64s(const Shape &shape, int64_t lo, int64_t hi) {
  Tensor t(DType::I64, shape);
  std::uniform_int_distribution<int64_t> dist(lo, hi);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<int64_t>()[i] = dist(rng());
  return t;
}

inline Tensor int64s(const Shape &shape, const std::vector<int64_t> &values) {
  return Tensor::fromValues<int64_t>(shape, values);
}

inline Tensor bools(const Shape &shape) {
  Tensor t(DType::Bool, shape);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<bool>()[i] = rng()() % 2;
  return t;
}

/// \p t with element type \p type (converted as Cast does).
inline Tensor castTo(const Tensor &t, DType type) {
  auto out = cpu::runOp(NodeBuilder("Cast", 1).i("to", static_cast<int64_t>(type)), 17, {&t});
  EXPECT_TRUE(!!out) << llvm::toString(out.takeError());
  return (*out)[0];
}

inline std::vector<const Tensor *> pointers(const std::vector<Tensor> &tensors) {
  std::vector<const Tensor *> result;
  for (const Tensor &t : tensors)
    result.push_back(t.isNull() ? nullptr : &t);
  return result;
}

inline std::vector<Tensor> runCpu(const onnx::NodeProto &node, const std::vector<Tensor> &inputs,
                                  int64_t opset = 17) {
  auto out = cpu::runOp(node, opset, pointers(inputs));
  EXPECT_TRUE(!!out) << llvm::toString(out.takeError());
  return out ? *out : std::vector<Tensor>();
}

inline ::testing::AssertionResult close(const Tensor &actual, const Tensor &expected,
                                        double rtol = 1e-4, double atol = 1e-5) {
  std::string why;
  if (cpu::allClose(actual, expected, rtol, atol, &why))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << why;
}

/// GPT-2's GELU on x + bias with its tanh kept, Tanh's UnaryGrad and a Sum: x is
/// in0 [rows, cols], bias in1 [cols], scalars in2 (0.5), in3 (3), in4
/// (0.044715), in5 (sqrt(2/pi)), in6 (1), dY in7 [rows, cols]; outputs
/// out0 (the GELU), out1 (tanh), out2 (the sum).
inline onnx::NodeProto fusedGelu() {
  std::vector<onnx::NodeProto> body = {makeNode("Add", {"in0", "in1"}, "h"),
                                       makeNode("Mul", {"in2", "h"}, "a"),
                                       makeNode("Pow", {"h", "in3"}, "p"),
                                       makeNode("Mul", {"in4", "p"}, "b"),
                                       makeNode("Add", {"h", "b"}, "s"),
                                       makeNode("Mul", {"in5", "s"}, "u"),
                                       makeNode("Tanh", {"u"}, "out1"),
                                       makeNode("Add", {"in6", "out1"}, "e"),
                                       makeNode("Mul", {"a", "e"}, "out0"),
                                       unaryGrad("Tanh", "in7", "out1", "g"),
                                       makeNode("Sum", {"out0", "g", "h"}, "out2")};
  std::vector<const onnx::NodeProto *> pointers;
  for (const onnx::NodeProto &n : body)
    pointers.push_back(&n);
  return makeFusedNode("gelu", pointers, {"in0", "in1", "in2", "in3", "in4", "in5", "in6", "in7"},
                       {"out0", "out1", "out2"});
}

/// MatMul(in0, in1) + in2 as the fusion pass makes it.
inline onnx::NodeProto matMulBias() {
  onnx::NodeProto mm = makeNode("MatMul", {"in0", "in1"}, "m"),
                  add = makeNode("Add", {"in2", "m"}, "out0");
  onnx::NodeProto f = makeFusedNode("linear", {&mm, &add}, {"in0", "in1", "in2"}, {"out0"});
  f.set_op_type(MatMulBiasOpType.str());
  return f;
}

inline std::vector<Tensor> fusedGeluInputs(int64_t rows, int64_t cols) {
  return {floats({rows, cols}, -3, 3), floats({cols}),
          Tensor::scalar(0.5f),        Tensor::scalar(3.0f),
          Tensor::scalar(0.044715f),   Tensor::scalar(0.7978845608f),
          Tensor::scalar(1.0f),        floats({rows, cols})};
}
/// The reference for the device's update: the CPU backend's own
/// (runtime/core/CpuBackend.cpp), on host tensors.
inline void referenceUpdate(const rt::OptimizerUpdate &u, Tensor &w, const Tensor &g, Tensor &m,
                            Tensor &v) {
  rt::OptimizerSlot slot{&w, &g, &m, &v, u.decayCenter};
  auto squares = rt::makeCpuBackend()->optimize(u, {slot});
  ASSERT_TRUE(static_cast<bool>(squares)) << llvm::toString(squares.takeError());
}

/// Step \p step of optimizer \p kind (0 SGD, 1 momentum, 2 AdamW), with
/// weight decay and a gradient scale.
inline rt::OptimizerUpdate optimizerUpdate(int kind, int step) {
  using Kind = rt::OptimizerUpdate::Kind;
  rt::OptimizerUpdate u;
  u.kind = kind == 0 ? Kind::SGD : kind == 1 ? Kind::Momentum : Kind::AdamW;
  u.lr = kind == 2 ? 1e-3 : 1e-2;
  u.momentum = 0.9;
  u.weightDecay = 0.01;
  u.beta1 = 0.9;
  u.beta2 = 0.999;
  u.epsilon = 1e-8;
  u.gradScale = 0.25;
  u.step = step;
  return u;
}

/// A window op's attributes, for the CPU nodes and the kernel bodies.
struct WindowCase {
  Shape x, kernel, strides, dilations, pads;
  int64_t group = 1;
};

inline NodeBuilder &withWindow(NodeBuilder &b, const WindowCase &c, bool dilations = true) {
  b.ints("kernel_shape", c.kernel).ints("strides", c.strides).ints("pads", c.pads);
  if (dilations)
    b.ints("dilations", c.dilations);
  return b;
}

inline Shape spatial(const Shape &shape) { return Shape(shape.begin() + 2, shape.end()); }

} // namespace pipec::test

#endif // PIPEC_TESTS_KERNELTESTUTIL_H
