//===- FuseAttention.cpp - fuse-attention: attention as one node ----------===//

#include "passes/FuseAttention.h"

#include "ops/Attention.h"
#include "ops/OpRegistry.h"
#include "passes/Differentiate.h"
#include "passes/GraphEdit.h"
#include "support/Attributes.h"

#include <optional>
#include <vector>

using namespace llvm;

namespace pipec {
namespace {

using attention::ScoreStep;

/// One score step found: its kind, its scalar and, for a step that reads a
/// tensor, the op and input that read it.
struct FoundStep {
  ScoreStep kind;
  double scalar;
  int op = -1, slot = -1;
};

/// One attention found: the ops it replaces and what the fused node reads.
struct Found {
  int product = -1;
  std::vector<int> taken; // every op but the last MatMul
  std::vector<FoundStep> steps;
  std::optional<double> guard;
};

class Matcher {
public:
  explicit Matcher(const Graph &graph) : graph(graph), grads(gradientValues(graph)) {}

  /// The attention whose last product is op \p o, or nullopt.
  std::optional<Found> match(int o) const;

private:
  const Value &val(int id) const { return graph.values[id]; }
  bool isF32(int id) const { return id >= 0 && val(id).type == DType::F32 && val(id).shapeKnown; }
  /// The producer of \p id when \p id is float32, read \p reads times
  /// (operand uses) and no graph output; -1 otherwise.
  int inner(int id, size_t reads = 1) const {
    if (!isF32(id) || val(id).isGraphOutput || val(id).users.size() != reads)
      return -1;
    return val(id).producer;
  }
  /// A float scalar known at compile time.
  std::optional<double> scalar(int id) const {
    if (id < 0 || !isFloatDType(val(id).type) || !val(id).constant ||
        val(id).constant->numElements() != 1)
      return std::nullopt;
    return val(id).constant->floatAt(0);
  }
  /// Whether \p id can be a step's tensor over scores of \p shape: it takes
  /// no gradient and broadcasts to them without widening them.
  bool stepTensor(int id, const std::vector<int64_t> &shape, DType type) const {
    if (id < 0 || grads[id] || val(id).type != type || !val(id).shapeKnown)
      return false;
    const std::vector<int64_t> &t = val(id).shape;
    if (t.size() > shape.size())
      return false;
    for (size_t i = 0; i < t.size(); ++i) {
      int64_t s = shape[shape.size() - t.size() + i];
      if (t[i] != 1 && t[i] != s)
        return false;
    }
    return true;
  }
  /// Walks the score steps back from \p id (scores of \p shape) to the
  /// product Q Kt, appending them last first; false where they are not
  /// steps of ops/Attention.h.
  bool walk(int id, const std::vector<int64_t> &shape, Found &f) const;

  const Graph &graph;
  std::vector<bool> grads;
};

bool Matcher::walk(int id, const std::vector<int64_t> &shape, Found &f) const {
  int p = inner(id);
  if (p < 0 || val(id).shape != shape || f.steps.size() > 8)
    return false;
  const Op &op = graph.ops[p];
  if (op.inputs.size() < 2 || op.outputs.size() != 1)
    return false;
  // A step reading input \p slot of op p (-1: none), then the rest from
  // \p next.
  auto step = [&](ScoreStep kind, double c, int slot, int next) {
    size_t steps = f.steps.size(), taken = f.taken.size();
    f.steps.push_back({kind, c, slot >= 0 ? p : -1, slot});
    f.taken.push_back(p);
    if (walk(next, shape, f))
      return true;
    f.steps.resize(steps);
    f.taken.resize(taken);
    return false;
  };
  int a = op.inputs[0], b = op.inputs[1];
  if (op.is(OpId::MatMul)) {
    f.product = p;
    f.taken.push_back(p);
    return true;
  }
  if (op.is(OpId::Mul))
    return (scalar(b) && step(ScoreStep::Scale, *scalar(b), -1, a)) ||
           (scalar(a) && step(ScoreStep::Scale, *scalar(a), -1, b));
  if (op.is(OpId::Div))
    return scalar(b) && step(ScoreStep::Divide, *scalar(b), -1, a);
  if (op.is(OpId::Add))
    return (stepTensor(b, shape, DType::F32) && step(ScoreStep::Add, 0, 1, a)) ||
           (stepTensor(a, shape, DType::F32) && step(ScoreStep::Add, 0, 0, b));
  if (op.is(OpId::Where) && op.inputs.size() == 3) {
    int cond = op.inputs[0], x = op.inputs[1], y = op.inputs[2];
    if (!stepTensor(cond, shape, DType::Bool))
      return false;
    return (scalar(y) && step(ScoreStep::Keep, *scalar(y), 0, x)) ||
           (scalar(x) && step(ScoreStep::Drop, *scalar(x), 0, y));
  }
  return false;
}

std::optional<Found> Matcher::match(int o) const {
  const Op &out = graph.ops[o];
  if (!out.is(OpId::MatMul) || out.inputs.size() != 2 || out.outputs.size() != 1 ||
      !isF32(out.inputs[1]) || !isF32(out.outputs[0]))
    return std::nullopt;
  Found f;
  // Back from the probabilities: Casts that keep float32, the NaN guard.
  int probs = out.inputs[0], p = inner(probs);
  for (int casts = 0; p >= 0 && graph.ops[p].is(OpId::Cast) && casts < 3; ++casts) {
    f.taken.push_back(p);
    probs = graph.ops[p].inputs[0];
    p = inner(probs);
  }
  if (p >= 0 && graph.ops[p].is(OpId::Where) && graph.ops[p].inputs.size() == 3) {
    const Op &where = graph.ops[p];
    const Value &nan = val(where.inputs[0]);
    int isNan = nan.producer, guarded = where.inputs[2];
    if (isNan < 0 || !graph.ops[isNan].is(OpId::IsNaN) || graph.ops[isNan].inputs[0] != guarded ||
        nan.users.size() != 1 || nan.isGraphOutput || !scalar(where.inputs[1]))
      return std::nullopt;
    f.guard = *scalar(where.inputs[1]);
    f.taken.push_back(p);
    f.taken.push_back(isNan);
    probs = guarded;
    p = inner(probs, 2);
  }
  if (p < 0 || !graph.ops[p].is(OpId::Softmax) || graph.ops[p].inputs.size() != 1)
    return std::nullopt;
  const std::vector<int64_t> &scores = val(probs).shape;
  int64_t rank = static_cast<int64_t>(scores.size());
  int64_t axis = attrInt(graph.node(graph.ops[p]), "axis", -1);
  if (rank < 2 || (axis != -1 && axis != rank - 1))
    return std::nullopt;
  f.taken.push_back(p);
  if (!walk(graph.ops[p].inputs[0], scores, f))
    return std::nullopt;
  std::reverse(f.steps.begin(), f.steps.end());
  // The products: Q [.., m, k] Kt [.., k, n] and P V [.., n, d], no
  // broadcasting between them.
  const Op &product = graph.ops[f.product];
  if (product.inputs.size() != 2 || !isF32(product.inputs[0]) || !isF32(product.inputs[1]))
    return std::nullopt;
  const std::vector<int64_t> &q = val(product.inputs[0]).shape, &kt = val(product.inputs[1]).shape,
                             &v = val(out.inputs[1]).shape;
  if (static_cast<int64_t>(q.size()) != rank || kt.size() != q.size() || v.size() != q.size())
    return std::nullopt;
  for (int64_t i = 0; i < rank - 2; ++i)
    if (kt[i] != q[i] || v[i] != q[i])
      return std::nullopt;
  if (kt[rank - 2] != q[rank - 1] || v[rank - 2] != kt[rank - 1])
    return std::nullopt;
  return f;
}

/// Replaces op \p o, the last product of \p f, by the fused node.
void replace(Graph &graph, int o, const Found &f) {
  Op &out = graph.ops[o];
  const Op &product = graph.ops[f.product];
  int result = out.outputs[0];
  std::vector<int> inputs = {product.inputs[0], product.inputs[1], out.inputs[1]};
  // Where the file read each input: Q and Kt at the first product, V at the
  // second, each step's tensor at its step.
  std::vector<std::pair<int, int>> reads = {fileRead(graph, f.product, 0),
                                            fileRead(graph, f.product, 1), fileRead(graph, o, 1)};
  std::vector<int64_t> kinds;
  std::vector<float> scalars;
  for (const FoundStep &s : f.steps) {
    kinds.push_back(static_cast<int64_t>(s.kind));
    scalars.push_back(static_cast<float>(s.scalar));
    if (s.op >= 0) {
      inputs.push_back(graph.ops[s.op].inputs[s.slot]);
      reads.push_back(fileRead(graph, s.op, s.slot));
    }
  }
  std::string name = freshName(graph, graph.values[result].name + ".logsumexp");
  int lse = graph.addValue(name, ValueKind::Activation);
  Value &l = graph.values[lse];
  l.type = DType::F32;
  l.shape = graph.values[out.inputs[0]].shape;
  l.shape.back() = 1;
  l.shapeKnown = true;
  onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
  node.set_name(out.name.empty() ? "attention:" + graph.values[result].name : out.name);
  node.set_op_type(attention::OpType.str());
  node.set_domain("pipec");
  for (int id : inputs)
    node.add_input(graph.values[id].name);
  node.add_output(graph.values[result].name);
  node.add_output(name);
  setAttrInts(node, "steps", kinds);
  setAttrFloats(node, "scalars", scalars);
  setAttrInt(node, "guarded", f.guard ? 1 : 0);
  setAttrFloat(node, "guard", static_cast<float>(f.guard.value_or(0)));
  for (int t : f.taken)
    graph.ops[t].dead = true;
  out.fileReads = std::move(reads);
  out.setType("pipec", attention::OpType);
  out.name = node.name();
  out.inputs = inputs;
  out.outputs = {result, lse};
  out.nodeIndex = graph.model->graph().node_size() - 1;
}

} // namespace

Expected<bool> fuseAttention(Graph &graph) {
  if (!graph.training || !graph.fuseAttention || graph.opsetFor("") < 13)
    return false;
  Matcher matcher(graph);
  std::vector<bool> taken(graph.ops.size(), false);
  int made = 0;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    if (graph.ops[o].dead || taken[o])
      continue;
    std::optional<Found> f = matcher.match(o);
    if (!f || llvm::any_of(f->taken, [&](int t) { return taken[t]; }))
      continue;
    for (int t : f->taken)
      taken[t] = true;
    replace(graph, o, *f);
    ++made;
  }
  if (made == 0)
    return false;
  graph.compact();
  return true;
}

} // namespace pipec
