//===- GradientCheck.h - Gradient rules against finite differences ------===//
//
// The machinery of the differentiate tests: tiny float64 graphs, an
// interpreter that evaluates a graph and its backward program with the CPU
// kernels (layers last to first, I then W), and a check that compares every
// weight and graph-input gradient against double-sided finite differences
// of the loss.
//
// Tolerances: the rule graphs are float64 (eps 1e-6, |g - fd| <= 1e-6 +
// 1e-5 |fd|); the generated models are float32 (eps 1e-3 on the
// weights, |g - fd| <= 2e-3 + 2e-2 |fd|, sampled elements). In models with
// ReLU or MaxPool, elements whose one-sided differences disagree, a kink,
// are skipped.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_GRADIENTCHECK_H
#define PIPEC_TESTS_GRADIENTCHECK_H

#include "passes/Differentiate.h"
#include "passes/GroupLayers.h"
#include "runtime/cpu/Kernels.h"
#include "support/Attributes.h"
#include "tests/TestUtil.h"

#include <gtest/gtest.h>

#include <random>

namespace pipec::test {

using cpu::Tensor;
using pipec::DType;

inline constexpr int kFloat = onnx::TensorProto::FLOAT;
inline constexpr int kDouble = onnx::TensorProto::DOUBLE;
inline constexpr int kInt64 = onnx::TensorProto::INT64;

inline Tensor toTensor(const ConstTensor &c) {
  Tensor t(static_cast<DType>(c.type), c.shape);
  for (int64_t i = 0; i < c.numElements(); ++i) {
    if (t.elemType() == DType::I64)
      t.data<int64_t>()[i] = c.intAt(i); // INT64_MAX slice ends survive
    else
      t.setDouble(i, c.isFloat() ? c.floatAt(i) : double(c.intAt(i)));
  }
  return t;
}

/// Evaluates a graph and its backward program with the CPU kernels.
class Interpreter {
public:
  Interpreter(const Graph &graph, const Backward &backward) : graph(graph), backward(backward) {}

  /// Runs forward and the loss; \p feeds holds inputs and overridden weights.
  /// Returns what the backward differentiates: the loss, times the number of
  /// labels it counts when it is a mean over counted labels (the runtime
  /// divides by the step's count).
  double forward(const std::map<std::string, Tensor> &feeds) {
    env = feeds;
    for (const Op &op : graph.ops)
      if (!op.dead)
        run(graph.node(op));
    for (const onnx::NodeProto &node : backward.lossForward)
      run(node);
    double loss = get(backward.lossValue).getDouble(0);
    if (!backward.lossCountValue.empty())
      loss *= get(backward.lossCountValue).getDouble(0);
    return loss;
  }
  /// Runs the backward lists after forward().
  void runBackward() {
    for (size_t l = backward.inputGrad.size(); l-- > 0;) {
      for (const onnx::NodeProto &node : backward.inputGrad[l])
        run(node);
      for (const onnx::NodeProto &node : backward.weightGrad[l])
        run(node);
    }
  }
  Tensor get(const std::string &name) {
    auto it = env.find(name);
    if (it != env.end())
      return it->second;
    int id = graph.findValue(name);
    if (id < 0) {
      ADD_FAILURE() << "no value '" << name << "'";
      return Tensor(DType::F32, {});
    }
    auto c = graph.readConstant(id, 1 << 24);
    if (!c) {
      ADD_FAILURE() << llvm::toString(c.takeError());
      return Tensor(DType::F32, {});
    }
    return env[name] = toTensor(**c);
  }

private:
  void run(const onnx::NodeProto &node) {
    std::vector<Tensor> held;
    held.reserve(node.input_size());
    std::vector<const Tensor *> inputs;
    for (const std::string &name : node.input()) {
      if (name.empty()) {
        inputs.push_back(nullptr);
        continue;
      }
      held.push_back(get(name));
      inputs.push_back(&held.back());
    }
    auto outs = cpu::runOp(node, graph.opsetFor(""), inputs);
    if (!outs) {
      std::string names;
      for (size_t k = 0; k < inputs.size(); ++k)
        names += " " + node.input(k) + ":" + (inputs[k] ? inputs[k]->describe() : "null");
      ADD_FAILURE() << llvm::toString(outs.takeError()) << " (inputs" << names << ")";
      return;
    }
    for (int k = 0; k < node.output_size(); ++k)
      if (!node.output(k).empty() && k < static_cast<int>(outs->size()))
        env[node.output(k)] = (*outs)[k];
  }

  const Graph &graph;
  const Backward &backward;
  std::map<std::string, Tensor> env;
};

inline Tensor randomTensor(DType type, const std::vector<int64_t> &shape, std::mt19937 &rng,
                           double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Tensor t(type, shape);
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.setDouble(i, dist(rng));
  return t;
}

struct Check {
  LossSpec loss = {LossSpec::Kind::Mse, "", "labels"};
  /// Range of the random weights and float inputs.
  double lo = -1.0, hi = 1.0;
  double eps = 1e-6, rtol = 1e-5, atol = 1e-6;
  /// Elements checked per tensor (at random); all if the tensor is smaller.
  int samples = 1000;
  /// Fixed feeds (integer inputs such as indices and labels).
  std::map<std::string, Tensor> feeds;
  unsigned seed = 7;
  /// Skip elements where the loss has a kink (see checkFiniteDifferences).
  bool skipKinks = false;
};

struct Differentiated {
  Graph graph;
  LayerGraph layers;
  Backward backward;
};

/// Imports the model and differentiates it; gtest failure on an error.
inline std::unique_ptr<Differentiated> build(const std::string &bytes, const LossSpec &loss,
                                             bool inputGrads, const ImportOptions &options = {}) {
  auto graph = importBytes(bytes, options);
  if (!graph) {
    ADD_FAILURE() << llvm::toString(graph.takeError());
    return nullptr;
  }
  auto result = std::make_unique<Differentiated>(Differentiated{std::move(*graph), {}, {}});
  auto layers = groupLayers(result->graph);
  if (!layers) {
    ADD_FAILURE() << llvm::toString(layers.takeError());
    return nullptr;
  }
  result->layers = std::move(*layers);
  auto backward = differentiate(result->graph, result->layers, loss, inputGrads);
  if (!backward) {
    ADD_FAILURE() << llvm::toString(backward.takeError());
    return nullptr;
  }
  result->backward = std::move(*backward);
  return result;
}

/// The error differentiate gives for the model \p b against \p loss (MSE
/// against "labels" by default), or "no error"; import and grouping must
/// succeed.
inline std::string differentiateError(const GraphBuilder &b,
                                      const LossSpec &loss = {LossSpec::Kind::Mse, "", "labels"}) {
  auto graph = importBytes(b.serialize());
  if (!graph)
    return "import: " + llvm::toString(graph.takeError());
  auto layers = groupLayers(*graph);
  if (!layers)
    return "group-layers: " + llvm::toString(layers.takeError());
  auto backward = differentiate(*graph, *layers, loss);
  return backward ? "no error" : llvm::toString(backward.takeError());
}

/// 3 or 4 when every use of \p id is as the running mean (3) or variance (4)
/// of a BatchNormalization, which are statistics without a gradient; -1
/// otherwise.
inline int statisticInput(const Graph &graph, int id) {
  int kind = -1;
  for (int user : graph.values[id].users) {
    const Op &op = graph.ops[user];
    for (size_t k = 0; k < op.inputs.size(); ++k) {
      if (op.inputs[k] != id)
        continue;
      if (op.opType != "BatchNormalization" || k < 3 || (kind >= 0 && kind != int(k)))
        return -1;
      kind = static_cast<int>(k);
    }
  }
  return kind;
}

/// Checks every weight and float graph-input gradient of \p d against finite
/// differences; returns the number of gradients checked. BatchNormalization
/// statistics must have no gradient; running variances are drawn positive.
inline int checkFiniteDifferences(Differentiated &d, Check check) {
  const Graph &graph = d.graph;
  std::mt19937 rng(check.seed);
  std::map<std::string, Tensor> feeds = check.feeds;
  std::vector<std::pair<std::string, std::string>> grads; // value, gradient
  for (size_t id = 0; id < graph.values.size(); ++id) {
    const Value &v = graph.values[id];
    bool trainable = v.kind == ValueKind::Weight && v.producer < 0 && isFloatDType(v.type);
    bool floatInput = v.kind == ValueKind::Input && isFloatDType(v.type);
    if (!trainable && !floatInput)
      continue;
    int statistic = statisticInput(graph, static_cast<int>(id));
    if (!feeds.count(v.name))
      feeds[v.name] =
          statistic == 4
              ? randomTensor(static_cast<DType>(v.type), v.shape, rng, 0.5, 1.5)
              : randomTensor(static_cast<DType>(v.type), v.shape, rng, check.lo, check.hi);
    if (statistic >= 0) {
      EXPECT_FALSE(d.backward.weightGrads.count(v.name)) << "statistic " << v.name << " trained";
      continue;
    }
    // Tables of constants into Sin and Cos (rotary frequencies) are read, not
    // trained: the differentiate pass gives them no gradient.
    if (d.backward.tableWeights.count(v.name)) {
      EXPECT_FALSE(d.backward.weightGrads.count(v.name)) << "table " << v.name << " trained";
      continue;
    }
    if (trainable && !v.users.empty()) {
      EXPECT_TRUE(d.backward.weightGrads.count(v.name)) << "no gradient for weight " << v.name;
      if (d.backward.weightGrads.count(v.name))
        grads.push_back({v.name, d.backward.weightGrads[v.name]});
    }
    if (floatInput && d.backward.inputGrads.count(v.name))
      grads.push_back({v.name, d.backward.inputGrads[v.name]});
  }
  if (check.loss.kind == LossSpec::Kind::Mse && !feeds.count(check.loss.labels)) {
    const Value &y = graph.values[graph.outputs.front()];
    feeds[check.loss.labels] = randomTensor(static_cast<DType>(y.type), y.shape, rng, -1, 1);
  }

  Interpreter interp(graph, d.backward);
  double base = interp.forward(feeds);
  interp.runBackward();
  int checked = 0, skipped = 0;
  for (const auto &[name, gradName] : grads) {
    Tensor grad = interp.get(gradName);
    const Tensor &x = feeds[name];
    EXPECT_EQ(grad.shape(), x.shape()) << gradName;
    if (grad.shape() != x.shape())
      continue;
    std::vector<int64_t> indices(x.numElements());
    for (int64_t i = 0; i < x.numElements(); ++i)
      indices[i] = i;
    std::shuffle(indices.begin(), indices.end(), rng);
    if (static_cast<int64_t>(indices.size()) > check.samples)
      indices.resize(check.samples);
    for (int64_t i : indices) {
      std::map<std::string, Tensor> plus = feeds, minus = feeds;
      plus[name] = x.clone();
      minus[name] = x.clone();
      plus[name].setDouble(i, x.getDouble(i) + check.eps);
      minus[name].setDouble(i, x.getDouble(i) - check.eps);
      Interpreter probe(graph, d.backward);
      double up = probe.forward(plus), down = probe.forward(minus);
      double fd = (up - down) / (2 * check.eps);
      double g = grad.getDouble(i);
      double tolerance = check.atol + check.rtol * std::abs(fd);
      if (check.skipKinks) {
        // A ReLU switching inside [x - eps, x + eps] makes the two one-sided
        // differences disagree; finite differences say nothing there.
        double right = (up - base) / check.eps, left = (base - down) / check.eps;
        if (std::abs(right - left) > 10 * tolerance) {
          ++skipped;
          continue;
        }
      }
      EXPECT_NEAR(g, fd, tolerance)
          << "d loss / d " << name << "[" << i << "] (gradient " << gradName << ")";
      ++checked;
    }
  }
  EXPECT_LE(skipped * 4, checked) << "too many kinks to trust the check";
  return checked;
}

/// Differentiates \p b's model with weight and input gradients and checks
/// them all in float64.
inline void checkModel(const GraphBuilder &b, Check check = {}) {
  auto d = build(b.serialize(), check.loss, /*inputGrads=*/true);
  ASSERT_TRUE(d);
  EXPECT_GT(checkFiniteDifferences(*d, check), 0);
}

/// A float64 weight (values are replaced by random ones in the checks).
inline void doubleWeight(GraphBuilder &b, const std::string &name,
                         const std::vector<int64_t> &dims) {
  onnx::TensorProto &t = b.weight(name, dims);
  t.set_data_type(kDouble);
  t.set_raw_data(std::string(t.raw_data().size() * 2, '\0'));
}

/// A float64 scalar constant initializer.
inline void doubleScalar(GraphBuilder &b, const std::string &name, double value) {
  onnx::TensorProto *t = b.graph().add_initializer();
  t->set_name(name);
  t->set_data_type(kDouble);
  t->add_double_data(value);
}

/// x [dims] (op) w [wdims] -> y, all float64.
inline GraphBuilder binaryModel(const std::string &op, const std::vector<int64_t> &xDims,
                                const std::vector<int64_t> &wDims, bool swap = false) {
  GraphBuilder b;
  b.input("x", kDouble, xDims);
  doubleWeight(b, "w", wDims);
  b.node(op, swap ? std::vector<std::string>{"w", "x"} : std::vector<std::string>{"x", "w"}, {"y"},
         "n");
  b.output("y", kDouble);
  return b;
}

/// y = op(x * w), x [3, 4], w [4], at \p opset.
inline GraphBuilder unaryModel(const std::string &op, int opset = 17) {
  GraphBuilder b(opset);
  b.input("x", kDouble, {3, 4});
  doubleWeight(b, "w", {4});
  b.node("Mul", {"x", "w"}, {"h"}, "mul");
  b.node(op, {"h"}, {"y"}, "n");
  b.output("y", kDouble);
  return b;
}

inline void setIntAttr(onnx::NodeProto &node, const std::string &name, int64_t value) {
  auto *a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

inline void setFloatAttr(onnx::NodeProto &node, const std::string &name, float value) {
  auto *a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(value);
}

inline void setIntsAttr(onnx::NodeProto &node, const std::string &name,
                        const std::vector<int64_t> &values) {
  auto *a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (int64_t v : values)
    a->add_ints(v);
}

inline void setStringAttr(onnx::NodeProto &node, const std::string &name,
                          const std::string &value) {
  auto *a = node.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::STRING);
  a->set_s(value);
}

} // namespace pipec::test

#endif // PIPEC_TESTS_GRADIENTCHECK_H
