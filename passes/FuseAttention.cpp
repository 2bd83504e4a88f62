//===- FuseAttention.cpp - fuse-attention: attention as one node ----------===//

#include "passes/FuseAttention.h"

#include "ops/Attention.h"
#include "ops/OpRegistry.h"
#include "passes/Differentiate.h"
#include "passes/GraphEdit.h"
#include "support/Attributes.h"

#include <map>
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

/// A key or value head tensor X [b, kv, n, c] that the exporter repeated
/// `groups` times per head before the attention (Llama's repeat_kv:
/// Unsqueeze at 2, Expand, Reshape merging kv and groups, with the batch
/// too in torch.onnx's dynamo export), then for K^T swapped in its last two
/// axes and scaled.
struct Repeat {
  int source = -1;    // X
  int unsqueeze = -1; // the op that read X
  int64_t groups = 1;
  bool swapped = false; // the fused input is X^T's repeat
  double scale = 1;     // and times this
  std::vector<int> ops; // the repeat's ops, read by the attention alone
};

/// One attention found: the ops it replaces and what the fused node reads.
struct Found {
  int product = -1;
  std::vector<int> taken; // every op but the last MatMul
  std::vector<FoundStep> steps;
  std::optional<double> guard;
  /// Grouped-query attention: K^T and V read as their heads before the
  /// exporter repeated them (both, with the same groups, or neither).
  std::optional<Repeat> keys, values;
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
  /// The repeat of key/value heads that made the fused input \p id (K^T
  /// when \p keys, else V), or nullopt.
  std::optional<Repeat> repeatOf(int id, bool keys) const;
  /// Whether op \p p is a Transpose of the last two axes alone.
  bool swapsLast(int p) const {
    const Op &op = graph.ops[p];
    if (!op.is(OpId::Transpose) || op.inputs.empty())
      return false;
    size_t rank = val(op.inputs[0]).shape.size();
    std::vector<int64_t> perm = attrInts(graph.node(op), "perm").value_or(std::vector<int64_t>{});
    if (rank < 2 || perm.size() != rank)
      return false;
    for (size_t i = 0; i < rank; ++i)
      if (perm[i] != static_cast<int64_t>(i < rank - 2 ? i : (i == rank - 2 ? rank - 1 : rank - 2)))
        return false;
    return true;
  }

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

std::optional<Repeat> Matcher::repeatOf(int id, bool keys) const {
  const std::vector<int64_t> &want = val(id).shape;
  if (want.size() != 4)
    return std::nullopt;
  Repeat r;
  int v = id, p = inner(v);
  auto take = [&](int input) {
    r.ops.push_back(p);
    v = graph.ops[p].inputs[input];
    p = inner(v);
  };
  // Back from the attention: a scale (K^T only), a Reshape of [b * h, x, y]
  // to [b, h, x, y], a swap of the last two axes (K^T only), then the
  // repeat itself.
  if (keys && p >= 0 && graph.ops[p].inputs.size() == 2 &&
      (graph.ops[p].is(OpId::Mul) || graph.ops[p].is(OpId::Div))) {
    const Op &op = graph.ops[p];
    bool div = op.is(OpId::Div);
    if (scalar(op.inputs[1])) {
      r.scale = div ? 1 / *scalar(op.inputs[1]) : *scalar(op.inputs[1]);
      take(0);
    } else if (!div && scalar(op.inputs[0])) {
      r.scale = *scalar(op.inputs[0]);
      take(1);
    }
  }
  // A Reshape that splits the leading [b * h] of its input alone.
  bool merged = false;
  if (p >= 0 && graph.ops[p].is(OpId::Reshape)) {
    const std::vector<int64_t> &in = val(graph.ops[p].inputs[0]).shape;
    merged = in.size() == 3 && in[0] == want[0] * want[1] && in[1] == want[2] && in[2] == want[3];
  }
  if (merged)
    take(0);
  if (keys && p >= 0 && swapsLast(p)) {
    r.swapped = true;
    take(0);
  }
  // The repeat: Reshape(Expand(Unsqueeze(X, axis 2))).
  if (p < 0 || !graph.ops[p].is(OpId::Reshape))
    return std::nullopt;
  take(0);
  if (p < 0 || !graph.ops[p].is(OpId::Expand))
    return std::nullopt;
  take(0);
  if (p < 0 || !graph.ops[p].is(OpId::Unsqueeze))
    return std::nullopt;
  const Op &unsqueeze = graph.ops[p];
  std::vector<int64_t> axes =
      attrInts(graph.node(unsqueeze), "axes").value_or(std::vector<int64_t>{});
  if (unsqueeze.inputs.size() > 1) {
    const Value &a = val(unsqueeze.inputs[1]);
    if (!a.constant)
      return std::nullopt;
    for (int64_t i = 0; i < a.constant->numElements(); ++i)
      axes.push_back(a.constant->intAt(i));
  }
  if (axes.size() != 1 || (axes[0] != 2 && axes[0] != -3))
    return std::nullopt;
  r.unsqueeze = p;
  take(0);
  r.source = v;
  const std::vector<int64_t> &x = val(v).shape;
  const std::vector<int64_t> &e = val(graph.ops[r.ops[r.ops.size() - 2]].outputs[0]).shape;
  if (!isF32(v) || x.size() != 4 || e.size() != 5 || e[0] != x[0] || e[1] != x[1] || e[3] != x[2] ||
      e[4] != x[3] || e[2] < 2)
    return std::nullopt;
  r.groups = e[2];
  // The repeat's Reshape merges the heads with their repeats (and with the
  // batch where a split follows) and keeps the last two axes: Reshapes keep
  // the elements' order, so this is head h of X at h / groups.
  const std::vector<int64_t> &repeat = val(graph.ops[r.ops[r.ops.size() - 3]].outputs[0]).shape;
  std::vector<int64_t> heads = {x[0], x[1] * r.groups, x[2], x[3]};
  if (repeat != (merged ? std::vector<int64_t>{x[0] * x[1] * r.groups, x[2], x[3]} : heads))
    return std::nullopt;
  // What the attention reads is the repeat, swapped where it says so.
  std::vector<int64_t> expected = heads;
  if (r.swapped)
    std::swap(expected[2], expected[3]);
  if (want != expected)
    return std::nullopt;
  return r;
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
  // Grouped-query attention: read K and V before their repeat, when both
  // were repeated by the same groups and the repeats feed nothing else.
  std::optional<Repeat> keys = repeatOf(product.inputs[1], true),
                        values = repeatOf(out.inputs[1], false);
  if (keys && values && keys->groups == values->groups && !values->swapped && keys->swapped) {
    f.keys = std::move(keys);
    f.values = std::move(values);
  }
  return f;
}

/// X^T of the key heads X [b, kv, n, k] a repeat read: a Transpose of its
/// last two axes, to insert before the attention.
Op swappedKeys(Graph &graph, const Repeat &r) {
  const Value &x = graph.values[r.source];
  std::string name = freshName(graph, x.name + ".transposed");
  std::vector<int64_t> shape = {x.shape[0], x.shape[1], x.shape[3], x.shape[2]};
  int id = graph.addValue(name, ValueKind::Activation);
  Value &t = graph.values[id];
  t.type = DType::F32;
  t.shape = shape;
  t.shapeKnown = true;
  onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
  node.set_name("attention:" + name);
  node.set_op_type("Transpose");
  node.add_input(graph.values[r.source].name);
  node.add_output(name);
  setAttrInts(node, "perm", {0, 1, 3, 2});
  Op op;
  op.name = node.name();
  op.scope = graph.ops[r.unsqueeze].scope;
  op.setType("", "Transpose");
  op.inputs = {r.source};
  op.outputs = {id};
  op.fileReads = {fileRead(graph, r.unsqueeze, 0)};
  op.nodeIndex = graph.model->graph().node_size() - 1;
  return op;
}

/// Replaces op \p o, the last product of \p f, by the fused node; a
/// Transpose it needs goes into \p before.
void replace(Graph &graph, int o, const Found &f, std::map<int, std::vector<Op>> &before) {
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
  int64_t groups = 1;
  if (f.keys && f.values) {
    // K^T and V as the exporter's key and value heads; a scale of K^T
    // scales the scores first.
    Op swapped = swappedKeys(graph, *f.keys);
    inputs[1] = swapped.outputs[0];
    inputs[2] = f.values->source;
    reads[1] = swapped.fileReads[0];
    reads[2] = fileRead(graph, f.values->unsqueeze, 0);
    before[o].push_back(std::move(swapped));
    if (f.keys->scale != 1) {
      kinds.push_back(static_cast<int64_t>(ScoreStep::Scale));
      scalars.push_back(static_cast<float>(f.keys->scale));
    }
    for (const Repeat *r : {&*f.keys, &*f.values})
      for (int op : r->ops)
        graph.ops[op].dead = true;
    groups = f.keys->groups;
  }
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
  if (groups > 1)
    setAttrInt(node, "groups", groups);
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
  std::map<int, std::vector<Op>> before;
  int made = 0;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    if (graph.ops[o].dead || taken[o])
      continue;
    std::optional<Found> f = matcher.match(o);
    if (!f || llvm::any_of(f->taken, [&](int t) { return taken[t]; }))
      continue;
    for (int t : f->taken)
      taken[t] = true;
    if (f->keys && f->values)
      for (const Repeat *r : {&*f->keys, &*f->values})
        for (int t : r->ops)
          taken[t] = true;
    replace(graph, o, *f, before);
    ++made;
  }
  if (made == 0)
    return false;
  insertOps(graph, before);
  graph.compact();
  return true;
}

} // namespace pipec
