//===- ShardTensors.cpp - shard-tensors: tensor parallelism by structure -===//
#include "passes/ShardTensors.h"
#include "passes/GraphEdit.h"
#include "passes/InferShapes.h"
#include "passes/SequenceParallel.h"
#include "passes/ShardRegion.h"
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

using namespace shard;

//===----------------------------------------------------------------------===//
// Regions
//===----------------------------------------------------------------------===//

/// A 2-D float initializer (a light model's fills among them, since
/// fold-constants), or the Transpose of one (torch's Linear).
bool matrixWeight(const Graph &graph, int id) {
  const Value &w = graph.values[id];
  if (w.kind != ValueKind::Weight || w.shape.size() != 2 || !isFloatDType(w.type))
    return false;
  if (w.producer < 0)
    return true;
  const Op &t = graph.ops[w.producer];
  return t.is(OpId::Transpose) && t.inputs.size() == 1 && t.inputs[0] >= 0 &&
         graph.values[t.inputs[0]].producer < 0;
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
      return noRule(r, op, o);
    auto done = shardRules[static_cast<size_t>(op.def->id)](r, op, o);
    if (!done || !*done)
      return done;
  }
  return true;
}

/// Writes region \p r into the graph: applySplits, and the collectives to
/// insert (\p before: op index -> ops to insert before it).
void commit(Graph &graph, Region &r, ArrayRef<int> seeds, std::map<int, std::vector<Op>> &before,
            std::set<int> &committedValues) {
  applySplits(graph, r, committedValues);
  // A split graph output (a head's logits) is gathered whole under its own
  // name; a training step keeps no output but the loss.
  for (int id : std::vector<int>(graph.outputs))
    if (auto layout = r.layouts.find(id); layout != r.layouts.end())
      gatherOutput(graph, id, layout->second, r.parts, before);
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
  insertOps(graph, before);
  if (graph.sequenceParallel)
    if (Error err = splitSequence(graph, committedValues))
      return std::move(err);
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
