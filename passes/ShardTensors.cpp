//===- ShardTensors.cpp - shard-tensors: tensor parallelism by structure -===//
#include "passes/ShardTensors.h"
#include "passes/GraphEdit.h"
#include "passes/InferShapes.h"
#include "passes/TieWeights.h"

#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <optional>
#include <set>

using namespace llvm;

namespace pipec {
namespace {

/// A value's layout over the T ranks: replicated (axis -1), or split on
/// `axis`, seen as `stride` equal blocks each cut into T pieces.
struct Layout {
  int axis = -1;
  int64_t stride = 1;
  bool split() const { return axis >= 0; }
  bool operator==(const Layout &o) const { return axis == o.axis && stride == o.stride; }
  bool operator!=(const Layout &o) const { return !(*this == o); }
};

/// A shape constant a node reads, rewritten for one rank.
struct ConstEdit {
  int op = -1, slot = -1;
  ConstTensor value;
};

/// One region: the products that read one replicated activation, and what
/// their split reaches until partial sums end it. Grown on a copy of the
/// layouts, committed whole or not at all.
class Region {
public:
  Region(const Graph &graph, int parts) : graph(graph), parts(parts) {}

  const Graph &graph;
  const int parts;
  std::map<int, Layout> layouts;
  std::vector<int> partials;
  /// A row-split Gemm's bias (partial value -> its C), added once after the
  /// sum rather than by every rank.
  std::map<int, int> partialBias;
  /// The SoftmaxCrossEntropyLoss ops whose scores are split on the classes:
  /// the vocabulary-parallel loss (TpSoftmaxCrossEntropyLoss) replaces them.
  std::vector<int> vocabLosses;
  std::vector<ConstEdit> edits;
  /// Why the region stays replicated, naming the node at fault.
  std::string refusal;
  /// The weights of folded ties, which stay whole.
  const std::set<std::string> *tied = nullptr;
  /// Tables split before the regions (a tied embedding), each with its
  /// layout: a tied head's product may read them so.
  const std::map<int, Layout> *presplit = nullptr;

  Layout of(int id) const {
    auto it = id >= 0 ? layouts.find(id) : layouts.end();
    return it == layouts.end() ? Layout() : it->second;
  }
  const Value &val(int id) const { return graph.values[id]; }
  const std::vector<int64_t> &shape(int id) const { return graph.values[id].shape; }
  int rank(int id) const { return static_cast<int>(graph.values[id].shape.size()); }

  bool refuse(const Op &op, const Twine &why) {
    refusal = formatv("node '{0}' ({1}): {2}", op.name, op.opType, why.str()).str();
    return false;
  }
  Error fail(const Op &op, const Twine &why) const {
    return createStringError(inconvertibleErrorCode(), "%s: node '%s' (%s): %s", graph.path.c_str(),
                             op.name.c_str(), op.opType.c_str(), why.str().c_str());
  }
  /// Sets output \p i of \p op to \p layout.
  void setOut(const Op &op, size_t i, Layout layout) {
    if (i < op.outputs.size() && op.outputs[i] >= 0)
      layouts[op.outputs[i]] = layout;
  }

  /// Splits weight \p id, which \p op reads, by \p layout: an initializer
  /// that nothing else reads. A weight read elsewhere, an activation, or an
  /// axis that does not divide refuses.
  bool splitWeight(const Op &op, int id, Layout layout) {
    if (auto it = layouts.find(id); it != layouts.end())
      return it->second == layout || refuse(op, "'" + val(id).name + "' is split two ways");
    if (auto it = presplit ? presplit->find(id) : layouts.end(); presplit && it != presplit->end())
      return it->second == layout || refuse(op, "'" + val(id).name + "' is split two ways");
    const Value &v = val(id);
    // A weight the exporter reads through a Transpose (torch's Linear as
    // MatMul(x, Transpose(W))): W splits on the axis the Transpose moves.
    if (v.kind == ValueKind::Weight && v.producer >= 0) {
      const Op &t = graph.ops[v.producer];
      bool alone = readsOf(graph, id).size() == 1;
      // A weight filled at load (ConstantOfShape: a model's structure
      // without its bytes) fills one rank's piece.
      if (t.is(OpId::ConstantOfShape) && alone &&
          v.shape[layout.axis] % (layout.stride * parts) == 0)
        if (std::optional<ConstTensor> shape = constantInput(t, 0)) {
          ConstEdit edit{v.producer, 0, *shape};
          edit.value.ints[layout.axis] /= parts;
          edits.push_back(std::move(edit));
          layouts[id] = layout;
          return true;
        }
      if (!t.is(OpId::Transpose) || t.inputs.size() != 1 || !alone)
        return refuse(op, formatv("'{0}' is computed, not a weight the node alone reads", v.name));
      std::vector<int64_t> perm = permOf(t);
      if (!splitWeight(t, t.inputs[0], {static_cast<int>(perm[layout.axis]), layout.stride}))
        return false;
      layouts[id] = layout;
      return true;
    }
    bool initializer = v.kind == ValueKind::Weight && v.producer < 0 &&
                       (v.storage || v.tensorIndex >= 0) && isFloatDType(v.type);
    if (!initializer)
      return refuse(op, formatv("'{0}' has the split axis's full size and is no weight", v.name));
    if (readsOf(graph, id).size() != 1)
      return refuse(op, formatv("weight '{0}' is read by other nodes as well", v.name));
    if (tied && tied->count(v.name))
      return refuse(op, formatv("weight '{0}' is a tied head or embedding", v.name));
    int64_t size = v.shape[layout.axis];
    if (size % (layout.stride * parts) != 0)
      return refuse(op, formatv("weight '{0}' has {1} entries on axis {2}, which do not divide "
                                "over {3} blocks of {4} ranks",
                                v.name, size, layout.axis, layout.stride, parts));
    layouts[id] = layout;
    return true;
  }

  /// A Transpose's permutation (its attribute, else the reversal).
  std::vector<int64_t> permOf(const Op &t) const {
    if (auto p = attrInts(graph.node(t), "perm"))
      return *p;
    std::vector<int64_t> perm;
    for (int k = rank(t.inputs[0]) - 1; k >= 0; --k)
      perm.push_back(k);
    return perm;
  }
  /// The compile-time integers input \p slot of \p op holds, if any.
  std::optional<ConstTensor> constantInput(const Op &op, size_t slot) const {
    if (slot >= op.inputs.size() || op.inputs[slot] < 0)
      return std::nullopt;
    const Value &v = val(op.inputs[slot]);
    if (v.constant && !v.constant->isFloat())
      return *v.constant;
    if (v.kind == ValueKind::Constant || (v.kind == ValueKind::Weight && v.producer < 0)) {
      auto read = graph.readConstant(op.inputs[slot], 64);
      if (read && !(*read)->isFloat())
        return **read;
      if (!read)
        consumeError(read.takeError());
    }
    return std::nullopt;
  }
  /// Axes from input \p slot or attribute \p attr, normalized to \p rank.
  std::optional<std::vector<int64_t>> axesOf(const Op &op, size_t slot, StringRef attr,
                                             int64_t rank) const {
    std::vector<int64_t> axes;
    if (auto c = constantInput(op, slot))
      axes = c->ints;
    else if (auto a = attrInts(graph.node(op), attr))
      axes = *a;
    else if (slot < op.inputs.size() && op.inputs[slot] >= 0)
      return std::nullopt;
    for (int64_t &a : axes)
      a = a < 0 ? a + rank : a;
    return axes;
  }
};

using ShardRule = Expected<bool> (*)(Region &, const Op &, int);

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

//===----------------------------------------------------------------------===//
// Regions
//===----------------------------------------------------------------------===//

/// A 2-D float initializer, the Transpose of one (torch's Linear), or a
/// fill (a model without its weights' bytes).
bool matrixWeight(const Graph &graph, int id) {
  const Value &w = graph.values[id];
  if (w.kind != ValueKind::Weight || w.shape.size() != 2 || !isFloatDType(w.type))
    return false;
  if (w.producer < 0)
    return true;
  const Op &t = graph.ops[w.producer];
  return t.is(OpId::ConstantOfShape) ||
         (t.is(OpId::Transpose) && t.inputs.size() == 1 && t.inputs[0] >= 0 &&
          graph.values[t.inputs[0]].producer < 0);
}

/// A product of a replicated activation and a weight matrix (MatMul, or
/// Gemm without a transposed A): where a column split may start.
bool columnCandidate(const Graph &graph, const Op &op) {
  bool gemm = op.is(OpId::Gemm) && attrInt(graph.node(op), "transA", 0) == 0;
  if (!(op.is(OpId::MatMul) || gemm) || op.inputs.size() < 2 || op.inputs[0] < 0 ||
      op.inputs[1] < 0)
    return false;
  const Value &x = graph.values[op.inputs[0]];
  return x.kind == ValueKind::Activation && x.shape.size() >= 2 &&
         matrixWeight(graph, op.inputs[1]);
}

/// The blocks a column split of \p op's output must keep apart: k when the
/// output (through a bias and reshapes that keep its last axis) is cut into
/// k equal pieces on that axis (a fused QKV), else 1.
int64_t blocksAhead(const Graph &graph, const Op &op) {
  int id = op.outputs[0];
  for (int depth = 0; depth < 4; ++depth) {
    const Value &v = graph.values[id];
    if (v.users.size() != 1)
      return 1;
    const Op &user = graph.ops[v.users[0]];
    if (user.is(OpId::Split)) {
      int64_t axis = attrInt(graph.node(user), "axis", 0);
      int64_t rank = static_cast<int64_t>(v.shape.size());
      return (axis < 0 ? axis + rank : axis) == rank - 1 ? static_cast<int64_t>(user.outputs.size())
                                                         : 1;
    }
    if (user.outputs.empty() || user.outputs[0] < 0)
      return 1;
    const Value &next = graph.values[user.outputs[0]];
    bool keepsLast = !next.shape.empty() && next.shape.back() == v.shape.back();
    if (!keepsLast || !(user.is(OpId::Reshape) || (user.def && user.def->elem)))
      return 1;
    id = user.outputs[0];
  }
  return 1;
}

/// Grows the region of the products \p seeds (ops reading one activation)
/// over the ops from \p first on. False with the refusal recorded, or an
/// error for an axis that cannot divide.
Expected<bool> grow(Region &r, ArrayRef<int> seeds, int first,
                    const std::set<int> &committedValues) {
  const Graph &graph = r.graph;
  for (int s : seeds) {
    const Op &op = graph.ops[s];
    int64_t blocks = blocksAhead(graph, op);
    bool transB = op.is(OpId::Gemm) && attrInt(graph.node(op), "transB", 0) != 0;
    if (!r.splitWeight(op, op.inputs[1], {transB ? 0 : 1, blocks}))
      return false;
    int out = op.outputs[0];
    // Gemm's bias C: split with the columns, unless it broadcasts.
    if (op.is(OpId::Gemm) && op.inputs.size() > 2 && op.inputs[2] >= 0) {
      int c = op.inputs[2];
      int last = r.rank(c) - 1;
      if (last >= 0 && r.shape(c)[last] != 1 && !r.splitWeight(op, c, {last, blocks}))
        return false;
    }
    r.setOut(op, 0, {r.rank(out) - 1, blocks});
  }
  for (int o = first; o < static_cast<int>(graph.ops.size()); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead || is_contained(seeds, o))
      continue;
    bool touched = any_of(op.inputs, [&](int id) { return r.of(id).split(); });
    if (!touched)
      continue;
    if (any_of(op.inputs, [&](int id) { return committedValues.count(id) > 0; }))
      return r.refuse(op, "it reads two split regions");
    if (!op.def || !op.captures.empty())
      return rules::none(r, op, o);
    auto done = shardRules[static_cast<size_t>(op.def->id)](r, op, o);
    if (!done || !*done)
      return done;
  }
  return true;
}

/// A new op of \p type reading \p input, named after it; returns the op,
/// not yet in the op list, and adds its node and output value.
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

/// Writes \p r's split weights and values (their pieces' shapes, the
/// weights' cuts) and its rewritten constants into the graph.
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

/// Writes region \p r into the graph: applySplits, and the collectives to
/// insert (\p before: op index -> ops to insert before it).
void commit(Graph &graph, Region &r, ArrayRef<int> seeds, std::map<int, std::vector<Op>> &before,
            std::set<int> &committedValues) {
  applySplits(graph, r, committedValues);
  // A split graph output (a head's logits) is gathered whole under its own
  // name; the stage's nodes read its piece. A training step keeps no output
  // but the loss: there the output is dropped, not gathered every
  // microbatch.
  for (int id : std::vector<int>(graph.outputs)) {
    auto layout = r.layouts.find(id);
    if (layout == r.layouts.end())
      continue;
    if (graph.training) {
      graph.outputs.erase(std::find(graph.outputs.begin(), graph.outputs.end(), id));
      graph.values[id].isGraphOutput = false;
      continue;
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
    graph.values[whole].shape[layout->second.axis] *= r.parts; // the whole, as before
    gather.name = name + ".tpallgather";
    onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(gather.nodeIndex);
    node.set_output(0, name);
    node.set_name(name + ".tpallgather");
    auto attr = [&](const char *key, int64_t value) {
      onnx::AttributeProto &a = *node.add_attribute();
      a.set_name(key);
      a.set_type(onnx::AttributeProto::INT);
      a.set_i(value);
    };
    attr("axis", layout->second.axis);
    attr("stride", layout->second.stride);
    std::replace(graph.outputs.begin(), graph.outputs.end(), id, whole);
    graph.values[whole].isGraphOutput = true;
    graph.values[id].isGraphOutput = false;
    before[producer + 1].push_back(std::move(gather));
  }
  for (int o : r.vocabLosses) {
    Op &loss = graph.ops[o];
    loss.setType("pipec", "TpSoftmaxCrossEntropyLoss");
    onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(loss.nodeIndex);
    node.set_op_type("TpSoftmaxCrossEntropyLoss");
    node.set_domain("pipec");
  }
  const Op &first = graph.ops[seeds[0]];
  Op copy = collectiveOp(graph, "TpCopy", first.inputs[0], first.scope);
  for (int s : seeds)
    rewire(graph, s, 0, copy.outputs[0]);
  before[seeds[0]].push_back(std::move(copy));
  for (int partial : r.partials) {
    int producer = graph.values[partial].producer;
    std::vector<std::pair<int, int>> reads = readsOf(graph, partial);
    bool output = is_contained(graph.outputs, partial);
    const std::string &scope = graph.ops[producer].scope;
    Op sum = collectiveOp(graph, "TpAllReduce", partial, scope);
    int summed = sum.outputs[0];
    before[producer + 1].push_back(std::move(sum));
    if (auto bias = r.partialBias.find(partial); bias != r.partialBias.end()) {
      // The Gemm leaves its bias to an Add after the sum.
      Op &gemm = graph.ops[producer];
      gemm.inputs.resize(2);
      graph.model->mutable_graph()->mutable_node(gemm.nodeIndex)->mutable_input()->RemoveLast();
      Op add = collectiveOp(graph, "Add", summed, scope);
      add.setType("", "Add");
      add.inputs.push_back(bias->second);
      onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(add.nodeIndex);
      node.set_domain("");
      node.add_input(graph.values[bias->second].name);
      summed = add.outputs[0];
      before[producer + 1].push_back(std::move(add));
    }
    for (auto [o, slot] : reads)
      rewire(graph, o, slot, summed);
    if (output)
      std::replace(graph.outputs.begin(), graph.outputs.end(), partial, summed);
    graph.values[partial].shapeKnown = false;
  }
}

/// A vocabulary lookup whose table was split: its Gather, and the ties that
/// must split alike (a head reading Transpose(table), or a folded tie's
/// head), else the split is taken back.
struct Lookup {
  int op = -1, table = -1;
  std::vector<int> transposes; ///< outputs of Transpose(table)
  std::string foldedHead;
};

/// The vocabulary lookups: a Gather of the rows of a 2-D weight by ids
/// computed at run time (token ids), the table read by nothing else but a
/// tied head (through a Transpose, or as a folded tie). The table's rows
/// split and the lookup becomes TpGather (Megatron's vocabulary-parallel
/// embedding: each rank looks the ids up in its rows, zeros for the others,
/// and the group sums).
std::vector<Lookup> splitEmbeddings(Graph &graph, int parts,
                                    const std::map<std::string, std::string> &headOf,
                                    std::set<int> &committedValues) {
  std::vector<Lookup> split;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead || !op.is(OpId::Gather) || op.inputs.size() != 2 || op.inputs[0] < 0 ||
        op.inputs[1] < 0 || attrInt(graph.node(op), "axis", 0) != 0)
      continue;
    const Value &ids = graph.values[op.inputs[1]];
    const Value &table = graph.values[op.inputs[0]];
    if ((ids.kind != ValueKind::Activation && ids.kind != ValueKind::Input) ||
        table.shape.size() != 2 || table.kind != ValueKind::Weight)
      continue;
    Lookup lookup{o, op.inputs[0], {}, ""};
    if (auto head = headOf.find(table.name); head != headOf.end())
      lookup.foldedHead = head->second;
    bool alone = true;
    for (auto [reader, slot] : readsOf(graph, op.inputs[0])) {
      const Op &r = graph.ops[reader];
      if (reader == o)
        continue;
      bool transposes = r.is(OpId::Transpose) && r.outputs.size() == 1 && r.outputs[0] >= 0 &&
                        (!attrInts(graph.node(r), "perm") ||
                         *attrInts(graph.node(r), "perm") == std::vector<int64_t>{1, 0});
      if (!transposes) {
        alone = false;
        break;
      }
      lookup.transposes.push_back(r.outputs[0]);
    }
    Region r(graph, parts);
    bool tied = !lookup.transposes.empty();
    if (!alone || (table.producer >= 0 && (tied || !lookup.foldedHead.empty())))
      continue;
    if (tied || !lookup.foldedHead.empty()) {
      // A tied table: split here, its head's product reads it so (presplit).
      if (!isFloatDType(table.type) || table.shape[0] % parts != 0 ||
          !(table.storage || table.tensorIndex >= 0))
        continue;
      r.layouts[op.inputs[0]] = {0, 1};
    } else if (!r.splitWeight(op, op.inputs[0], {0, 1})) {
      continue;
    }
    applySplits(graph, r, committedValues);
    Op &gather = graph.ops[o];
    gather.setType("pipec", "TpGather");
    onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(gather.nodeIndex);
    node.set_op_type("TpGather");
    node.set_domain("pipec");
    node.clear_attribute();
    split.push_back(std::move(lookup));
  }
  return split;
}

/// Takes back the split of \p lookup's table where no tie of it split (its
/// head's region stayed whole): the lookup reads the whole table. Some heads
/// split and others not cannot be taken back: an error naming the table.
Error keepTiesWhole(Graph &graph, const Lookup &lookup, int parts, std::set<int> &committedValues) {
  int ties = !lookup.foldedHead.empty(), split = graph.shards.count(lookup.foldedHead);
  for (int out : lookup.transposes) {
    ++ties;
    split += committedValues.count(out);
  }
  if (split == ties)
    return Error::success();
  if (split > 0)
    return createStringError(inconvertibleErrorCode(),
                             "%s: --tp %d: the heads tied to '%s' split in part; compile with "
                             "--tp 1, or --untie them",
                             graph.path.c_str(), parts, graph.values[lookup.table].name.c_str());
  Value &table = graph.values[lookup.table];
  table.shape[0] *= parts;
  graph.shards.erase(table.name);
  committedValues.erase(lookup.table);
  Op &gather = graph.ops[lookup.op];
  gather.setType("", "Gather");
  onnx::NodeProto &node = *graph.model->mutable_graph()->mutable_node(gather.nodeIndex);
  node.set_op_type("Gather");
  node.set_domain("");
  graph.warnings.push_back(formatv("--tp {0}: the embedding '{1}' stays whole, as its tied head "
                                   "does",
                                   parts, table.name)
                               .str());
  return Error::success();
}

} // namespace

Expected<bool> shardTensors(Graph &graph) {
  int parts = graph.tensorParallel;
  if (parts <= 1)
    return false;
  graph.rebuildUses();
  // Candidates grouped by the activation they read, in op order.
  std::map<int, std::vector<int>> groups;
  std::vector<int> order;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o)
    if (!graph.ops[o].dead && columnCandidate(graph, graph.ops[o])) {
      int x = graph.ops[o].inputs[0];
      if (groups[x].empty())
        order.push_back(x);
      groups[x].push_back(o);
    }
  std::set<int> committedValues;
  std::map<int, std::vector<Op>> before;
  // A folded tie's head trains as its embedding's transpose (tie-weights,
  // after this pass): it splits only where its embedding did, alike.
  std::vector<std::pair<std::string, std::string>> ties = foldedTiePairs(graph);
  std::map<std::string, std::string> headOf;
  for (auto &[head, embedding] : ties)
    headOf[embedding] = head;
  std::vector<Lookup> lookups = splitEmbeddings(graph, parts, headOf, committedValues);
  std::map<int, Layout> presplit;
  std::set<std::string> tied;
  for (auto &[head, embedding] : ties) {
    int table = graph.findValue(embedding);
    if (!graph.shards.count(embedding)) {
      tied.insert(head);
      tied.insert(embedding);
    } else if (table >= 0) {
      presplit[table] = {0, 1};
    }
  }
  for (const Lookup &lookup : lookups)
    presplit[lookup.table] = {0, 1};
  std::vector<std::pair<std::string, std::string>> replicated;
  for (int x : order) {
    if (committedValues.count(x))
      continue; // a row split's input, read by its own products
    std::vector<int> seeds = groups[x];
    Region r(graph, parts);
    r.tied = &tied;
    r.presplit = &presplit;
    auto grown = grow(r, seeds, seeds[0], committedValues);
    if (!grown)
      return grown.takeError();
    if (!*grown) {
      replicated.push_back({graph.ops[seeds[0]].name, r.refusal});
      continue;
    }
    commit(graph, r, seeds, before, committedValues);
  }
  for (const Lookup &lookup : lookups)
    if (Error err = keepTiesWhole(graph, lookup, parts, committedValues))
      return std::move(err);
  if (before.empty() && lookups.empty()) {
    graph.warnings.push_back(formatv("--tp {0}: no matrix product could be split; every rank "
                                     "computes the whole model",
                                     parts));
    return false;
  }
  for (auto &[op, why] : replicated)
    graph.warnings.push_back(
        formatv("--tp {0}: node '{1}' and what it feeds stay replicated: {2}", parts, op, why)
            .str());
  std::vector<Op> ops;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    if (auto it = before.find(o); it != before.end())
      for (Op &added : it->second)
        ops.push_back(std::move(added));
    ops.push_back(std::move(graph.ops[o]));
  }
  if (auto it = before.find(static_cast<int>(graph.ops.size())); it != before.end())
    for (Op &added : it->second)
      ops.push_back(std::move(added));
  graph.ops = std::move(ops);
  graph.rebuildUses();
  // One rank's shapes, inferred again from the split weights and the
  // rewritten targets; each split value must come out as its piece.
  std::map<int, std::vector<int64_t>> expected;
  for (int id : committedValues)
    if (graph.values[id].kind != ValueKind::Weight) {
      expected[id] = graph.values[id].shape;
      graph.values[id].shapeKnown = false;
    }
  auto inferred = inferShapes(graph);
  if (!inferred)
    return inferred.takeError();
  for (auto &[id, shape] : expected)
    if (graph.values[id].shape != shape)
      return createStringError(
          inconvertibleErrorCode(), "%s: --tp %d: '%s' has shape %s on one rank, not its piece %s",
          graph.path.c_str(), parts, graph.values[id].name.c_str(),
          formatShape(graph.values[id].shape).c_str(), formatShape(shape).c_str());
  return true;
}

} // namespace pipec
