//===- ShardRegion.cpp - The SHARD rules of Ops.def ---------------------===//
#include "passes/ShardRegion.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"

#include <algorithm>

using namespace llvm;

namespace pipec::shard {

//===----------------------------------------------------------------------===//
// The rules of Ops.def's SHARD column
//===----------------------------------------------------------------------===//

namespace rules {

Expected<bool> none(Region &r, const Op &op, int) {
  return r.refuse(op, "no rule carries a split value through this op");
}

/// Element-wise with broadcasting: the split inputs agree on the output's
/// axis; another input broadcasts there (size 1, or no such axis), or is a
/// weight split with them (a bias).
Expected<bool> elementwise(Region &r, const Op &op, int) {
  int out = op.outputs.empty() ? -1 : op.outputs[0];
  if (out < 0)
    return r.refuse(op, "it has no output");
  int outRank = r.rank(out);
  std::optional<Layout> layout;
  for (int id : op.inputs) {
    Layout l = r.of(id);
    if (!l.split())
      continue;
    int a = l.axis + outRank - r.rank(id);
    if (r.shape(id)[l.axis] != r.shape(out)[a])
      return r.refuse(op, "a split input is broadcast");
    if (layout && *layout != Layout{a, l.stride})
      return r.refuse(op, "its inputs are split on different axes");
    layout = Layout{a, l.stride};
  }
  for (int id : op.inputs) {
    if (id < 0 || r.of(id).split())
      continue;
    int k = layout->axis - (outRank - r.rank(id));
    if (k < 0 || r.shape(id)[k] == 1)
      continue;
    if (!r.splitWeight(op, id, {k, layout->stride}))
      return false;
  }
  for (size_t i = 0; i < op.outputs.size(); ++i)
    if (op.outputs[i] >= 0 && r.shape(op.outputs[i]) == r.shape(out))
      r.setOut(op, i, *layout);
  return true;
}

/// Softmax and LogSoftmax: along an axis other than the split one.
Expected<bool> alongAxis(Region &r, const Op &op, int) {
  int in = op.inputs[0];
  int outRank = r.rank(in);
  bool flattens = r.graph.opsetFor(op.domain) < 13;
  int64_t axis = attrInt(r.graph.node(op), "axis", flattens ? 1 : -1);
  axis = axis < 0 ? axis + outRank : axis;
  if (flattens && axis != outRank - 1)
    return r.refuse(op, "before opset 13 it flattens the axes after 'axis'");
  Layout l = r.of(in);
  if (axis == l.axis)
    return r.refuse(op, "it normalizes along the split axis");
  r.setOut(op, 0, l);
  return true;
}

Expected<bool> transpose(Region &r, const Op &op, int) {
  int in = op.inputs[0];
  std::vector<int64_t> perm = r.permOf(op);
  Layout l = r.of(in);
  for (int j = 0; j < static_cast<int>(perm.size()); ++j)
    if (perm[j] == l.axis)
      r.setOut(op, 0, {j, l.stride});
  return true;
}

/// Reshape: the split axis maps to one output axis. Axes merged in front
/// of it multiply its blocks ([B, H] -> [B*H]: B blocks of H, each cut into
/// T pieces); an axis split into several takes the split on the first that
/// the blocks do not fill ([3*H*D] of 3 blocks -> [3, H, D]: on H). The
/// target's entry for that axis is rewritten to one rank's.
Expected<bool> reshape(Region &r, const Op &op, int o) {
  int in = op.inputs[0], out = op.outputs[0];
  std::optional<ConstTensor> target = r.constantInput(op, 1);
  if (!target)
    return r.refuse(op, "its target shape is not known at compile time");
  if (attrInt(r.graph.node(op), "allowzero", 0) != 0 && is_contained(target->ints, 0))
    return r.refuse(op, "it has allowzero and a 0 in its target");
  const std::vector<int64_t> &from = r.shape(in), &to = r.shape(out);
  Layout l = r.of(in);
  // Groups of input axes and output axes with equal products.
  size_t i = 0, j = 0;
  while (i < from.size() || j < to.size()) {
    size_t i0 = i, j0 = j;
    int64_t a = i < from.size() ? from[i++] : 1, b = j < to.size() ? to[j++] : 1;
    while (a != b) {
      if (a < b && i < from.size())
        a *= from[i++];
      else if (b < a && j < to.size())
        b *= to[j++];
      else
        return r.refuse(op, "its shapes do not group");
    }
    if (l.axis < static_cast<int>(i0) || l.axis >= static_cast<int>(i))
      continue;
    if (j - j0 > 1 && i - i0 > 1)
      return r.refuse(op, "it regroups the split axis with others");
    int64_t blocks = l.stride;
    for (size_t k = i0; k < static_cast<size_t>(l.axis); ++k)
      blocks *= from[k];
    size_t head = j0;
    while (head + 1 < j && blocks % to[head] == 0)
      blocks /= to[head++];
    int64_t heads = to[head];
    if (heads % blocks != 0)
      return r.refuse(op, "it cuts the split axis across its blocks");
    if ((heads / blocks) % r.parts != 0)
      return r.fail(op, formatv("its {0} heads (axis {1} of {2}) do not divide over --tp {3}",
                                heads / blocks, head, formatShape(to), r.parts));
    r.setOut(op, 0, {static_cast<int>(head), blocks});
    ConstEdit edit{o, 1, *target};
    if (head < edit.value.ints.size() && edit.value.ints[head] > 0)
      edit.value.ints[head] /= r.parts;
    else if (head < edit.value.ints.size() && edit.value.ints[head] == 0 &&
             (static_cast<int>(head) != l.axis || blocks != l.stride))
      return r.refuse(op, "it copies an input axis onto the split one");
    r.edits.push_back(std::move(edit));
    return true;
  }
  return r.refuse(op, "the split axis has no output axis");
}

/// MatMul: batch axes carry a split when both operands agree on it (or the
/// other broadcasts); rows and columns carry theirs; a contracted split
/// with a weight makes the partial sums of a row-split product.
Expected<bool> matMul(Region &r, const Op &op, int) {
  int lhs = op.inputs[0], rhs = op.inputs[1], out = op.outputs[0];
  int ra = r.rank(lhs), rb = r.rank(rhs), outRank = r.rank(out);
  if (ra < 2 || rb < 2)
    return r.refuse(op, "a split vector operand");
  Layout la = r.of(lhs), lb = r.of(rhs);
  if (la.split() && la.axis == ra - 1) {
    if (lb.split() ? !(lb.axis == rb - 2 && lb.stride == la.stride)
                   : !r.splitWeight(op, rhs, {rb - 2, la.stride}))
      return lb.split() ? r.refuse(op, "its operands split different axes") : false;
    r.partials.push_back(out);
    return true;
  }
  if (lb.split() && lb.axis == rb - 2)
    return r.refuse(op, "it contracts a split axis of a replicated operand");
  if (la.split() && la.axis == ra - 2) {
    if (lb.split())
      return r.refuse(op, "both operands are split");
    r.setOut(op, 0, {outRank - 2, la.stride});
    return true;
  }
  if (lb.split() && lb.axis == rb - 1) {
    if (la.split())
      return r.refuse(op, "both operands are split");
    r.setOut(op, 0, {outRank - 1, lb.stride});
    return true;
  }
  // A batch axis.
  int a = la.split() ? la.axis + outRank - ra : lb.axis + outRank - rb;
  Layout l = la.split() ? la : lb;
  for (auto [id, lay, rk] : {std::tuple{lhs, la, ra}, std::tuple{rhs, lb, rb}}) {
    int k = a - (outRank - rk);
    if (lay.split() ? lay != Layout{k, l.stride} : (k >= 0 && r.shape(id)[k] != 1))
      return r.refuse(op, "its operands do not split one batch axis");
  }
  r.setOut(op, 0, {a, l.stride});
  return true;
}

/// Gemm: a split contracted axis of A with a weight B makes a row-split
/// product's partial sums; its bias C is then added once, after the sum.
Expected<bool> gemm(Region &r, const Op &op, int) {
  const onnx::NodeProto &node = r.graph.node(op);
  int lhs = op.inputs[0], rhs = op.inputs[1], out = op.outputs[0];
  bool transA = attrInt(node, "transA", 0) != 0, transB = attrInt(node, "transB", 0) != 0;
  Layout la = r.of(lhs);
  if (r.of(rhs).split() || la.axis != (transA ? 0 : 1))
    return r.refuse(op, "only a split of A's contracted axis carries through it");
  if (!r.splitWeight(op, rhs, {transB ? 1 : 0, la.stride}))
    return false;
  if (op.inputs.size() > 2 && op.inputs[2] >= 0) {
    if (attrFloat(node, "beta", 1.0f) != 1.0f)
      return r.refuse(op, "its bias is scaled (beta)");
    r.partialBias[out] = op.inputs[2];
  }
  r.partials.push_back(out);
  return true;
}

/// SoftmaxCrossEntropyLoss of [rows, classes] scores split on the classes
/// (a language model's head): Megatron's vocabulary-parallel loss, whose
/// maximum, sum of exponentials and target logit are reduced over the ranks.
Expected<bool> softmaxCrossEntropy(Region &r, const Op &op, int o) {
  int scores = op.inputs[0];
  Layout l = r.of(scores);
  if (r.rank(scores) != 2 || l.axis != 1 || l.stride != 1 || r.of(op.inputs[1]).split())
    return r.refuse(op, "only [rows, classes] scores split on the classes carry through it");
  if (op.inputs.size() > 2 && op.inputs[2] >= 0)
    return r.refuse(op, "it weighs its classes");
  if (op.outputs.size() > 1 && op.outputs[1] >= 0)
    return r.refuse(op, "its log-probabilities are read");
  if (attrString(r.graph.node(op), "reduction", "mean") == "none")
    return r.refuse(op, "its reduction is none");
  r.vocabLosses.push_back(o);
  return true;
}

/// Split: along another axis each piece keeps the split; along the split
/// axis, `stride` equal pieces (a fused QKV) each split plainly.
Expected<bool> split(Region &r, const Op &op, int o) {
  int in = op.inputs[0];
  Layout l = r.of(in);
  int64_t axis = attrInt(r.graph.node(op), "axis", 0);
  axis = axis < 0 ? axis + r.rank(in) : axis;
  if (axis != l.axis) {
    for (size_t i = 0; i < op.outputs.size(); ++i)
      r.setOut(op, i, l);
    return true;
  }
  int64_t pieces = static_cast<int64_t>(op.outputs.size());
  if (pieces != l.stride)
    return r.refuse(op,
                    formatv("it cuts the split axis into {0} pieces, not {1}", pieces, l.stride));
  for (int id : op.outputs)
    if (id < 0 || r.shape(id)[axis] * pieces != r.shape(in)[axis])
      return r.refuse(op, "its pieces differ in size");
  if (op.inputs.size() > 1 && op.inputs[1] >= 0) {
    std::optional<ConstTensor> sizes = r.constantInput(op, 1);
    if (!sizes)
      return r.refuse(op, "its sizes are not known at compile time");
    ConstEdit edit{o, 1, *sizes};
    for (int64_t &s : edit.value.ints)
      s /= r.parts;
    r.edits.push_back(std::move(edit));
  } else if (attrInts(r.graph.node(op), "split")) {
    return r.refuse(op, "its sizes are an attribute");
  }
  for (size_t i = 0; i < op.outputs.size(); ++i)
    r.setOut(op, i, {l.axis, 1});
  return true;
}

Expected<bool> unsqueeze(Region &r, const Op &op, int) {
  int in = op.inputs[0], outRank = r.rank(op.outputs[0]);
  auto axes = r.axesOf(op, 1, "axes", outRank);
  if (!axes)
    return r.refuse(op, "its axes are not known at compile time");
  Layout l = r.of(in);
  int k = 0;
  for (int j = 0; j < outRank; ++j) {
    if (is_contained(*axes, j))
      continue;
    if (k++ == l.axis)
      r.setOut(op, 0, {j, l.stride});
  }
  return true;
}

Expected<bool> squeeze(Region &r, const Op &op, int) {
  int in = op.inputs[0], outRank = r.rank(in);
  auto axes = r.axesOf(op, 1, "axes", outRank);
  if (!axes)
    return r.refuse(op, "its axes are not known at compile time");
  Layout l = r.of(in);
  int below = 0;
  for (int j = 0; j < l.axis; ++j)
    below += axes->empty() ? r.shape(in)[j] == 1 : is_contained(*axes, j);
  r.setOut(op, 0, {l.axis - below, l.stride});
  return true;
}

/// Expand: the target's entry on the split axis becomes one rank's.
Expected<bool> expand(Region &r, const Op &op, int o) {
  int in = op.inputs[0], out = op.outputs[0];
  std::optional<ConstTensor> target = r.constantInput(op, 1);
  if (!target)
    return r.refuse(op, "its target shape is not known at compile time");
  Layout l = r.of(in);
  int outRank = r.rank(out), a = l.axis + outRank - r.rank(in);
  int k = a - (outRank - static_cast<int>(target->ints.size()));
  ConstEdit edit{o, 1, *target};
  if (k >= 0 && edit.value.ints[k] != 1) {
    if (edit.value.ints[k] != r.shape(in)[l.axis])
      return r.refuse(op, "it broadcasts the split axis");
    edit.value.ints[k] /= r.parts;
    r.edits.push_back(std::move(edit));
  }
  r.setOut(op, 0, {a, l.stride});
  return true;
}

Expected<bool> concat(Region &r, const Op &op, int) {
  int out = op.outputs[0], outRank = r.rank(out);
  int64_t axis = attrInt(r.graph.node(op), "axis", 0);
  axis = axis < 0 ? axis + outRank : axis;
  std::optional<Layout> layout;
  for (int id : op.inputs)
    if (Layout l = r.of(id); l.split()) {
      if (l.axis == axis || (layout && *layout != l))
        return r.refuse(op, "it joins along the split axis, or inputs split apart");
      layout = l;
    }
  for (int id : op.inputs)
    if (!r.of(id).split() && !r.splitWeight(op, id, *layout))
      return false;
  r.setOut(op, 0, *layout);
  return true;
}

/// Slice: along other axes, or the whole of the split axis.
Expected<bool> slice(Region &r, const Op &op, int) {
  int in = op.inputs[0], outRank = r.rank(in);
  Layout l = r.of(in);
  auto axes = r.axesOf(op, 3, "axes", outRank);
  auto starts = r.constantInput(op, 1), ends = r.constantInput(op, 2);
  std::optional<ConstTensor> steps = r.constantInput(op, 4);
  if (!axes || !starts || !ends || (op.inputs.size() > 4 && op.inputs[4] >= 0 && !steps))
    return r.refuse(op, "its bounds are not known at compile time");
  if (axes->empty())
    for (size_t k = 0; k < starts->ints.size(); ++k)
      axes->push_back(static_cast<int64_t>(k));
  for (size_t k = 0; k < axes->size(); ++k) {
    if ((*axes)[k] != l.axis)
      continue;
    int64_t size = r.shape(in)[l.axis];
    bool whole = starts->ints[k] == 0 && ends->ints[k] >= size && (!steps || steps->ints[k] == 1);
    if (!whole)
      return r.refuse(op, "it slices the split axis");
  }
  r.setOut(op, 0, l);
  return true;
}

/// ReduceMean, ReduceSum: over axes other than the split one, which keeps
/// its place among the axes kept.
Expected<bool> reduce(Region &r, const Op &op, int) {
  int in = op.inputs[0];
  Layout l = r.of(in);
  if (!l.split())
    return r.refuse(op, "its axes input is split");
  const onnx::NodeProto &node = r.graph.node(op);
  auto axes = r.axesOf(op, 1, "axes", r.rank(in));
  if (!axes)
    return r.refuse(op, "its axes are not known at compile time");
  if (axes->empty() && attrInt(node, "noop_with_empty_axes", 0) == 0)
    return r.refuse(op, "it reduces every axis");
  if (is_contained(*axes, l.axis))
    return r.refuse(op, "it reduces the split axis");
  int axis = l.axis;
  if (attrInt(node, "keepdims", 1) == 0)
    axis -= static_cast<int>(count_if(*axes, [&](int64_t a) { return a < l.axis; }));
  r.setOut(op, 0, {axis, l.stride});
  return true;
}

/// LayerNormalization, SimplifiedLayerNormalization: over the axes from
/// `axis` on, before which the split axis lies; the scale and bias span the
/// normalized axes alone. The mean and inverse deviation keep the axes.
Expected<bool> normalize(Region &r, const Op &op, int) {
  int in = op.inputs[0];
  Layout l = r.of(in);
  if (!l.split())
    return r.refuse(op, "its scale or bias is split");
  int64_t axis = attrInt(r.graph.node(op), "axis", -1);
  axis = axis < 0 ? axis + r.rank(in) : axis;
  if (l.axis >= axis)
    return r.refuse(op, "it normalizes along the split axis");
  for (size_t i = 0; i < op.outputs.size(); ++i)
    r.setOut(op, i, l);
  return true;
}

} // namespace rules

/// The rule of each row of Ops.def (its SHARD column), by OpId.
// clang-format off
const ShardRule shardRules[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, DEVICE, FOLD,    \
                 FLAGS, SHARD)                                                                     \
    &rules::SHARD,
#include "ops/Ops.def"
};
// clang-format on

Expected<bool> noRule(Region &r, const Op &op, int o) { return rules::none(r, op, o); }

Op collectiveOp(Graph &graph, StringRef type, int input, const std::string &scope) {
  std::string name = freshName(graph, graph.values[input].name + "." + type.lower());
  int out = graph.addValue(name, ValueKind::Activation);
  Value &v = graph.values[out];
  v.type = graph.values[input].type;
  v.shape = graph.values[input].shape;
  v.shapeKnown = true;
  onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
  node.set_name(name);
  node.set_op_type(type.str());
  node.set_domain("pipec");
  node.add_input(graph.values[input].name);
  node.add_output(name);
  Op op;
  op.name = name;
  op.scope = scope;
  op.setType("pipec", type);
  op.inputs = {input};
  op.outputs = {out};
  op.nodeIndex = graph.model->graph().node_size() - 1;
  return op;
}

void applySplits(Graph &graph, Region &r, std::set<int> &committedValues) {
  for (auto &[id, layout] : r.layouts) {
    Value &v = graph.values[id];
    committedValues.insert(id);
    v.shape[layout.axis] /= r.parts;
    if (v.kind == ValueKind::Weight && v.producer < 0)
      graph.shards[v.name] = {layout.axis, r.parts, layout.stride};
    else
      v.shapeKnown = false;
  }
  for (ConstEdit &e : r.edits) {
    const Op &op = graph.ops[e.op];
    int id = graph.addValue(freshName(graph, op.name + ".tp_shape"), ValueKind::Constant);
    Value &v = graph.values[id];
    v.type = e.value.type;
    v.shape = e.value.shape;
    v.shapeKnown = true;
    v.constant = std::make_shared<const ConstTensor>(std::move(e.value));
    rewire(graph, e.op, e.slot, id);
  }
}

void setLayoutAttrs(Graph &graph, const Op &op, Layout layout) {
  onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(op.nodeIndex);
  for (auto [key, value] : {std::pair<const char *, int64_t>{"axis", layout.axis},
                            std::pair<const char *, int64_t>{"stride", layout.stride}}) {
    onnx::AttributeProto &a = *node.add_attribute();
    a.set_name(key);
    a.set_type(onnx::AttributeProto::INT);
    a.set_i(value);
  }
}

void gatherOutput(Graph &graph, int id, Layout layout, int parts,
                  std::map<int, std::vector<Op>> &before) {
  if (graph.training) {
    graph.outputs.erase(std::find(graph.outputs.begin(), graph.outputs.end(), id));
    graph.values[id].isGraphOutput = false;
    return;
  }
  std::string name = graph.values[id].name;
  int producer = graph.values[id].producer;
  std::string pieceName = freshName(graph, name + ".tp_piece");
  graph.valueIds.erase(name);
  graph.values[id].name = pieceName;
  graph.valueIds[pieceName] = id;
  for (auto [o, slot] : readsOf(graph, id))
    rewire(graph, o, slot, id);
  onnx::NodeProto &made =
      *graph.model->mutable_graph()->mutable_node(graph.ops[producer].nodeIndex);
  for (int k = 0; k < made.output_size(); ++k)
    if (made.output(k) == name)
      made.set_output(k, pieceName);
  Op gather = collectiveOp(graph, "TpAllGather", id, graph.ops[producer].scope);
  int whole = gather.outputs[0];
  graph.valueIds.erase(graph.values[whole].name);
  graph.values[whole].name = name;
  graph.valueIds[name] = whole;
  graph.values[whole].shape[layout.axis] *= parts; // the whole, as before
  gather.name = name + ".tpallgather";
  onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(gather.nodeIndex);
  node.set_output(0, name);
  node.set_name(name + ".tpallgather");
  setLayoutAttrs(graph, gather, layout);
  std::replace(graph.outputs.begin(), graph.outputs.end(), id, whole);
  graph.values[whole].isGraphOutput = true;
  graph.values[id].isGraphOutput = false;
  before[producer + 1].push_back(std::move(gather));
}

} // namespace pipec::shard
