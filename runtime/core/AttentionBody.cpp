//===- AttentionBody.cpp - Fused attention as the ops it stands for -------===//
#include "runtime/core/AttentionBody.h"

#include "ops/Attention.h"
#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <string>
#include <vector>

using namespace llvm;

namespace pipec {
namespace {

namespace a = attention;
using a::ScoreStep;

/// Appends nodes to a body and names their outputs.
class BodyWriter {
public:
  BodyWriter(onnx::GraphProto &body, int64_t opset) : body(body), opset(opset) {}

  /// A node of \p op reading \p inputs; its one output is \p out, or a
  /// fresh name.
  onnx::NodeProto &add(StringRef op, std::vector<std::string> inputs, std::string out = "") {
    onnx::NodeProto &n = *body.add_node();
    n.set_op_type(op.str());
    n.set_name(formatv("sdpa/{0}/{1}", body.node_size(), op).str());
    for (std::string &in : inputs)
      n.add_input(std::move(in));
    n.add_output(out.empty() ? "sdpa:" + std::to_string(body.node_size()) : out);
    return n;
  }
  std::string value(StringRef op, std::vector<std::string> inputs, std::string out = "") {
    return add(op, std::move(inputs), std::move(out)).output(0);
  }
  std::string scalar(float c) {
    onnx::NodeProto &n = add("Constant", {});
    onnx::TensorProto &t = *addAttr(n, "value", onnx::AttributeProto::TENSOR).mutable_t();
    t.set_data_type(onnx::TensorProto::FLOAT);
    t.add_float_data(c);
    return n.output(0);
  }
  /// An int64 constant of \p values, one-dimensional.
  std::string ints(const std::vector<int64_t> &values) {
    onnx::NodeProto &n = add("Constant", {});
    onnx::TensorProto &t = *addAttr(n, "value", onnx::AttributeProto::TENSOR).mutable_t();
    t.set_data_type(onnx::TensorProto::INT64);
    t.add_dims(static_cast<int64_t>(values.size()));
    for (int64_t v : values)
      t.add_int64_data(v);
    return n.output(0);
  }
  /// A reduction of \p x over its last axis, kept: axes as an attribute
  /// before opset \p inputSince, as an input from it.
  std::string reduceLast(StringRef op, const std::string &x, int64_t inputSince,
                         std::string out = "") {
    std::vector<std::string> inputs = {x};
    if (opset >= inputSince)
      inputs.push_back(ints({-1}));
    onnx::NodeProto &n = add(op, inputs, std::move(out));
    if (opset < inputSince)
      setAttrInts(n, "axes", {-1});
    setAttrInt(n, "keepdims", 1);
    return n.output(0);
  }
  /// \p x [.., kv, a, b] with a new axis of \p groups before its last two:
  /// [.., kv, groups, a, b] (Unsqueeze, then Expand).
  std::string groupAxis(const std::string &x, int64_t rank, int64_t groups) {
    std::vector<int64_t> to(rank + 1, 1);
    to[rank - 2] = groups;
    return value("Expand", {value("Unsqueeze", {x, ints({rank - 2})}), ints(to)});
  }
  /// \p x [.., kv, a, b] with each of its heads repeated \p groups times:
  /// [.., kv * groups, a, b], head h the repeat of head h / groups, as
  /// Llama's repeat_kv makes them.
  std::string repeatHeads(const std::string &x, int64_t rank, int64_t groups) {
    std::vector<int64_t> times(rank, 1);
    times[rank - 3] = groups;
    return value("Reshape",
                 {groupAxis(x, rank, groups), value("Mul", {value("Shape", {x}), ints(times)})});
  }
  /// The gradient of repeatHeads(\p like): \p x [.., kv * groups, a, b]
  /// summed over each head's repeats into \p out.
  std::string sumRepeats(const std::string &x, const std::string &like, int64_t rank,
                         int64_t groups, std::string out) {
    std::string grouped = value("Reshape", {x, value("Shape", {groupAxis(like, rank, groups)})});
    // (The body's opset is 13 or later: ReduceSum's axes are an input.)
    onnx::NodeProto &n = add("ReduceSum", {grouped, ints({rank - 2})}, std::move(out));
    setAttrInt(n, "keepdims", 0);
    return n.output(0);
  }
  std::string swapLast(const std::string &x, int64_t rank) {
    std::vector<int64_t> perm;
    for (int64_t i = 0; i < rank; ++i)
      perm.push_back(i);
    std::swap(perm[rank - 2], perm[rank - 1]);
    onnx::NodeProto &n = add("Transpose", {x});
    setAttrInts(n, "perm", perm);
    return n.output(0);
  }

private:
  onnx::GraphProto &body;
  int64_t opset;
};

struct Steps {
  std::vector<ScoreStep> kinds;
  std::vector<float> scalars;
  std::vector<std::string> tensors; // per step, its tensor's name or ""
};

Expected<Steps> stepsOf(const onnx::NodeProto &node, int first) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s", node.name().c_str(),
                             node.op_type().c_str(), why.str().c_str());
  };
  Steps s;
  std::vector<int64_t> kinds = attrInts(node, "steps").value_or(std::vector<int64_t>{});
  const onnx::AttributeProto *scalars = findAttr(node, "scalars");
  if (static_cast<int64_t>(kinds.size()) != (scalars ? scalars->floats_size() : 0))
    return fail("its steps and scalars differ in number");
  int next = first;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] < 0 || kinds[i] >= a::ScoreSteps)
      return fail(formatv("step {0} is {1}, not a score step", i, kinds[i]));
    ScoreStep kind = static_cast<ScoreStep>(kinds[i]);
    s.kinds.push_back(kind);
    s.scalars.push_back(scalars->floats(static_cast<int>(i)));
    std::string tensor;
    if (a::readsTensor(kind)) {
      if (next >= node.input_size())
        return fail(formatv("step {0} reads input {1}, which it lacks", i, next));
      tensor = node.input(next++);
    }
    s.tensors.push_back(tensor);
  }
  return s;
}

/// The scores S = steps(Q Kt).
std::string scores(BodyWriter &w, const Steps &s, const std::string &q, const std::string &kt) {
  std::string x = w.value("MatMul", {q, kt});
  for (size_t i = 0; i < s.kinds.size(); ++i) {
    const std::string &t = s.tensors[i];
    switch (s.kinds[i]) {
    case ScoreStep::Scale:
      x = w.value("Mul", {x, w.scalar(s.scalars[i])});
      break;
    case ScoreStep::Divide:
      x = w.value("Div", {x, w.scalar(s.scalars[i])});
      break;
    case ScoreStep::Add:
      x = w.value("Add", {x, t});
      break;
    case ScoreStep::Keep:
      x = w.value("Where", {t, x, w.scalar(s.scalars[i])});
      break;
    case ScoreStep::Drop:
      x = w.value("Where", {t, w.scalar(s.scalars[i]), x});
      break;
    }
  }
  return x;
}

} // namespace

Expected<onnx::GraphProto> attentionBody(const onnx::NodeProto &node, int64_t rank, int64_t opset) {
  bool grad = node.op_type() == a::GradOpType;
  int first = grad ? int(a::GradFirstTensor) : int(a::FirstTensor);
  if ((!grad && node.op_type() != a::OpType) || rank < 2 || opset < 13 ||
      node.input_size() < first || node.output_size() < (grad ? 3 : 2))
    return createStringError(inconvertibleErrorCode(),
                             "node '%s' (%s): not a fused attention of rank 2 or more at opset 13+",
                             node.name().c_str(), node.op_type().c_str());
  Expected<Steps> steps = stepsOf(node, first);
  if (!steps)
    return steps.takeError();
  bool guarded = attrInt(node, "guarded", 0) != 0;
  float guard = attrFloat(node, "guard", 0);
  int64_t groups = attrInt(node, "groups", 1);
  if (groups < 1 || (groups > 1 && rank < 3))
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): groups %lld at rank %lld",
                             node.name().c_str(), node.op_type().c_str(),
                             static_cast<long long>(groups), static_cast<long long>(rank));
  onnx::GraphProto body;
  BodyWriter w(body, opset);
  // Grouped-query attention: Kt's and V's heads repeated to Q's.
  auto repeated = [&](const std::string &x) {
    return groups > 1 ? w.repeatHeads(x, rank, groups) : x;
  };
  if (!grad) {
    std::string s = scores(w, *steps, node.input(a::Query), repeated(node.input(a::KeysT)));
    onnx::NodeProto &softmax = w.add("Softmax", {s});
    setAttrInt(softmax, "axis", -1);
    std::string p = softmax.output(0);
    // L = sum_j P_j (S_j - log P_j), by ops every backend has (no ReduceMax
    // on the device): each finite S_j - log P_j is L, and a masked one
    // (NaN, or 0 where the fill was the lowest float) weighs P_j = 0.
    onnx::NodeProto &logSoftmax = w.add("LogSoftmax", {s});
    setAttrInt(logSoftmax, "axis", -1);
    std::string each = w.value("Sub", {s, logSoftmax.output(0)});
    each = w.value("Where", {w.value("IsNaN", {each}), w.scalar(0), each});
    w.reduceLast("ReduceSum", w.value("Mul", {p, each}), 13, node.output(a::LogSumExp));
    if (guarded)
      p = w.value("Where", {w.value("IsNaN", {p}), w.scalar(guard), p});
    w.value("MatMul", {p, repeated(node.input(a::Values))}, node.output(a::Out));
    return body;
  }
  const std::string &dO = node.input(a::GradOut), &q = node.input(a::GradQuery);
  std::string kt = repeated(node.input(a::GradKeysT)), v = repeated(node.input(a::GradValues));
  // Each head's dKt and dV: the sum over its repeats.
  auto summed = [&](const std::string &full, const std::string &like, int o) {
    if (groups > 1)
      w.sumRepeats(full, like, rank, groups, node.output(o));
  };
  std::string s = scores(w, *steps, q, kt);
  std::string p = w.value("Exp", {w.value("Sub", {s, node.input(a::GradLogSumExp)})});
  std::string nan = w.value("IsNaN", {p}), zero = w.scalar(0);
  std::string used = guarded ? w.value("Where", {nan, w.scalar(guard), p}) : p;
  summed(w.value("MatMul", {w.swapLast(used, rank), dO}, groups > 1 ? "" : node.output(2)),
         node.input(a::GradValues), 2);
  std::string dp = w.value("MatMul", {dO, w.swapLast(v, rank)});
  std::string rowDot =
      w.reduceLast("ReduceSum", w.value("Mul", {dO, node.input(a::GradForwardOut)}), 13);
  std::string ds = w.value("Mul", {w.value("Where", {nan, zero, p}), w.value("Sub", {dp, rowDot})});
  for (size_t i = steps->kinds.size(); i-- > 0;) {
    const std::string &t = steps->tensors[i];
    switch (steps->kinds[i]) {
    case ScoreStep::Scale:
      ds = w.value("Mul", {ds, w.scalar(steps->scalars[i])});
      break;
    case ScoreStep::Divide:
      ds = w.value("Div", {ds, w.scalar(steps->scalars[i])});
      break;
    case ScoreStep::Add:
      break;
    case ScoreStep::Keep:
      ds = w.value("Where", {t, ds, zero});
      break;
    case ScoreStep::Drop:
      ds = w.value("Where", {t, zero, ds});
      break;
    }
  }
  w.value("MatMul", {ds, w.swapLast(kt, rank)}, node.output(0));
  summed(w.value("MatMul", {w.swapLast(q, rank), ds}, groups > 1 ? "" : node.output(1)),
         node.input(a::GradKeysT), 1);
  return body;
}

} // namespace pipec
