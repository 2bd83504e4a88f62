//===- CpuKernelTestUtil.h - Running one CPU kernel in a test ------------===//
//
// What CpuKernelsTest and ContribKernelsTest share: a node builder with
// typed attributes, running a node on the CPU kernels, random tensors and a
// closeness check.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_CPUKERNELTESTUTIL_H
#define PIPEC_TESTS_CPUKERNELTESTUTIL_H

#include "KernelTestUtil.h"
#include "runtime/cpu/Kernels.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace pipec::test::kernels {

using cpu::Tensor;

/// test::NodeBuilder with the node named "<op>_node" and attr() overloaded
/// on the attribute's type.
class NodeBuilder : public pipec::test::NodeBuilder {
public:
  NodeBuilder(const std::string &op, int inputs, int outputs = 1, const std::string &domain = "")
      : pipec::test::NodeBuilder(op, inputs, outputs, domain) {
    node.set_name(op + "_node");
  }
  NodeBuilder &attr(const std::string &name, int64_t value) {
    i(name, value);
    return *this;
  }
  NodeBuilder &attr(const std::string &name, float value) {
    f(name, value);
    return *this;
  }
  NodeBuilder &attr(const std::string &name, const char *value) {
    s(name, value);
    return *this;
  }
  NodeBuilder &attr(const std::string &name, std::vector<int64_t> values) {
    ints(name, values);
    return *this;
  }
  NodeBuilder &name(const std::string &name) {
    node.set_name(name);
    return *this;
  }
};

/// Runs \p node and returns its outputs, failing the test on an error.
inline std::vector<Tensor> run(const NodeBuilder &builder, std::vector<const Tensor *> inputs,
                               int64_t opset = 17) {
  auto outputs = runOp(builder.node, opset, inputs);
  if (!outputs) {
    ADD_FAILURE() << llvm::toString(outputs.takeError());
    return {};
  }
  return *outputs;
}

/// The error message runOp gives for \p node.
inline std::string errorOf(const NodeBuilder &builder, std::vector<const Tensor *> inputs,
                           int64_t opset = 17) {
  auto outputs = runOp(builder.node, opset, inputs);
  if (outputs)
    return "no error";
  return llvm::toString(outputs.takeError());
}

inline Tensor randomTensor(std::vector<int64_t> shape, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  Tensor t(DType::F32, std::move(shape));
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.data<float>()[i] = dist(rng);
  return t;
}

inline void expectClose(const Tensor &actual, const Tensor &expected, double rtol = 1e-5,
                        double atol = 1e-6) {
  std::string why;
  EXPECT_TRUE(allClose(actual, expected, rtol, atol, &why)) << why;
}

} // namespace pipec::test::kernels

#endif // PIPEC_TESTS_CPUKERNELTESTUTIL_H
