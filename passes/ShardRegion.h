//===- ShardRegion.h - A split value's layout and the SHARD rules ------===//
//
// What passes/ShardTensors.cpp grows a tensor-parallel region with, and
// passes/SequenceParallel.cpp a sequence-parallel one: each value's layout
// over the T ranks (split on an axis, seen as equal blocks each cut into T
// pieces), the region that holds the layouts of one split until it is
// committed, and the rule of each op of Ops.def (its SHARD column) that
// carries a split value through the op or refuses it, naming the node.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_SHARDREGION_H
#define PIPEC_PASSES_SHARDREGION_H

#include "compiler/ir/Graph.h"
#include "passes/GraphEdit.h"

#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <optional>
#include <set>

namespace pipec::shard {

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
  /// A sequence-parallel region (passes/SequenceParallel.h): a replicated
  /// value that meets its pieces, weight or activation, is cut to this
  /// rank's piece where it is read (scatters), never split at its source.
  bool scatterReplicated = false;
  std::vector<std::pair<int, Layout>> scatters;

  Layout of(int id) const {
    auto it = id >= 0 ? layouts.find(id) : layouts.end();
    return it == layouts.end() ? Layout() : it->second;
  }
  const Value &val(int id) const { return graph.values[id]; }
  const std::vector<int64_t> &shape(int id) const { return graph.values[id].shape; }
  int rank(int id) const { return static_cast<int>(graph.values[id].shape.size()); }

  bool refuse(const Op &op, const llvm::Twine &why) {
    refusal = llvm::formatv("node '{0}' ({1}): {2}", op.name, op.opType, why.str()).str();
    return false;
  }
  llvm::Error fail(const Op &op, const llvm::Twine &why) const {
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "%s: node '%s' (%s): %s",
                                   graph.path.c_str(), op.name.c_str(), op.opType.c_str(),
                                   why.str().c_str());
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
    if (scatterReplicated) {
      if (val(id).shape[layout.axis] % (layout.stride * parts) != 0)
        return refuse(op, llvm::formatv("'{0}' has {1} entries on axis {2}, which do not divide "
                                        "over {3} blocks of {4} ranks",
                                        val(id).name, val(id).shape[layout.axis], layout.axis,
                                        layout.stride, parts));
      scatters.push_back({id, layout});
      layouts[id] = layout;
      return true;
    }
    if (auto it = presplit ? presplit->find(id) : layouts.end(); presplit && it != presplit->end())
      return it->second == layout || refuse(op, "'" + val(id).name + "' is split two ways");
    const Value &v = val(id);
    // A weight the exporter reads through a Transpose (torch's Linear as
    // MatMul(x, Transpose(W))): W splits on the axis the Transpose moves.
    if (v.kind == ValueKind::Weight && v.producer >= 0) {
      const Op &t = graph.ops[v.producer];
      bool alone = readsOf(graph, id).size() == 1;
      // (A light model's fills are weights by now: fold-constants.)
      if (!t.is(OpId::Transpose) || t.inputs.size() != 1 || !alone)
        return refuse(
            op, llvm::formatv("'{0}' is computed, not a weight the node alone reads", v.name));
      std::vector<int64_t> perm = permOf(t);
      if (!splitWeight(t, t.inputs[0], {static_cast<int>(perm[layout.axis]), layout.stride}))
        return false;
      layouts[id] = layout;
      return true;
    }
    bool initializer = v.kind == ValueKind::Weight && v.producer < 0 &&
                       (v.storage || v.tensorIndex >= 0) && isFloatDType(v.type);
    if (!initializer)
      return refuse(op,
                    llvm::formatv("'{0}' has the split axis's full size and is no weight", v.name));
    if (readsOf(graph, id).size() != 1)
      return refuse(op, llvm::formatv("weight '{0}' is read by other nodes as well", v.name));
    if (tied && tied->count(v.name))
      return refuse(op, llvm::formatv("weight '{0}' is a tied head or embedding", v.name));
    int64_t size = v.shape[layout.axis];
    if (size % (layout.stride * parts) != 0)
      return refuse(op,
                    llvm::formatv("weight '{0}' has {1} entries on axis {2}, which do not divide "
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
        llvm::consumeError(read.takeError());
    }
    return std::nullopt;
  }
  /// Axes from input \p slot or attribute \p attr, normalized to \p rank.
  std::optional<std::vector<int64_t>> axesOf(const Op &op, size_t slot, llvm::StringRef attr,
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

using ShardRule = llvm::Expected<bool> (*)(Region &, const Op &, int);

/// A new op of \p type reading \p input, named after it; returns the op,
/// not yet in the op list, and adds its node and output value (of the
/// input's type and shape).
Op collectiveOp(Graph &graph, llvm::StringRef type, int input, const std::string &scope);
/// The "axis" and "stride" attributes of \p op, a collective over pieces
/// of \p layout.
void setLayoutAttrs(Graph &graph, const Op &op, Layout layout);
/// Writes \p r's split weights and values (their pieces' shapes, the
/// weights' cuts) and its rewritten constants into the graph; each split
/// value joins \p committedValues.
void applySplits(Graph &graph, Region &r, std::set<int> &committedValues);
/// Graph output \p id, split by \p layout over \p parts ranks: gathered
/// whole under its own name (TpAllGather, queued in \p before: op index ->
/// ops to insert before it), the stage's nodes reading its piece; in a
/// training graph, which keeps no output but the loss, dropped instead of
/// gathered every microbatch.
void gatherOutput(Graph &graph, int id, Layout layout, int parts,
                  std::map<int, std::vector<Op>> &before);

/// The rule of each row of Ops.def (its SHARD column), by OpId.
extern const ShardRule shardRules[];
/// The rule of a row without one: a split value may not reach the op.
llvm::Expected<bool> noRule(Region &r, const Op &op, int);

} // namespace pipec::shard

#endif // PIPEC_PASSES_SHARDREGION_H
