//===- Fusion.cpp - Fusing element-wise chains of stage programs --------===//
#include "runtime/exec/Fusion.h"
#include "ops/OpRegistry.h"
#include "runtime/core/FusedProgram.h"
#include "support/Attributes.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringSet.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec::rt {

namespace {

using NodeList = google::protobuf::RepeatedPtrField<onnx::NodeProto>;

namespace k = kernels;

/// A group being grown: member node indices, ascending.
struct Group {
  std::vector<int> members;
};

class ListFuser {
public:
  ListFuser(NodeList &nodes, const StringSet<> &external, int64_t opset)
      : nodes(nodes), external(external), opset(opset) {}

  FusionStats run();

private:
  /// The inputs (read from outside) and outputs (read after, or named
  /// outside the list) of \p members, in first-use order; false when a
  /// member's value is read by a non-member before the last member.
  bool boundary(const std::vector<int> &members, std::vector<std::string> &inputs,
                std::vector<std::string> &outputs) const;
  bool fits(const std::vector<int> &members) const;

  NodeList &nodes;
  const StringSet<> &external;
  int64_t opset;
  /// Value -> the nodes reading it, ascending.
  StringMap<std::vector<int>> readers;
  /// Value -> the node making it.
  StringMap<int> maker;
  /// Node -> its group (-1: none).
  std::vector<int> groupOf;
  std::vector<Group> groups;
};

bool ListFuser::boundary(const std::vector<int> &members, std::vector<std::string> &inputs,
                         std::vector<std::string> &outputs) const {
  inputs.clear();
  outputs.clear();
  int last = members.back();
  std::set<int> in(members.begin(), members.end());
  StringSet<> made;
  for (int m : members) {
    const onnx::NodeProto &node = nodes[m];
    for (const std::string &name : node.input())
      if (!made.count(name) && std::find(inputs.begin(), inputs.end(), name) == inputs.end())
        inputs.push_back(name);
    const std::string &out = node.output(0);
    made.insert(out);
    bool visible = external.count(out) > 0;
    auto r = readers.find(out);
    if (r != readers.end())
      for (int reader : r->second) {
        if (in.count(reader))
          continue;
        if (reader < last)
          return false;
        visible = true;
      }
    if (visible)
      outputs.push_back(out);
  }
  return true;
}

bool ListFuser::fits(const std::vector<int> &members) const {
  std::vector<std::string> inputs, outputs;
  int steps = 0;
  for (int m : members)
    steps += fusedSteps(nodes[m]);
  if (steps > k::MaxFusedOps || !boundary(members, inputs, outputs))
    return false;
  return static_cast<int>(inputs.size()) <= k::MaxFusedInputs && !outputs.empty() &&
         static_cast<int>(outputs.size()) <= k::MaxFusedOutputs;
}

FusionStats ListFuser::run() {
  int count = nodes.size();
  groupOf.assign(count, -1);
  std::vector<bool> fusable(count);
  for (int i = 0; i < count; ++i) {
    const onnx::NodeProto &node = nodes[i];
    fusable[i] = isFusable(node, opset);
    for (const std::string &name : node.input())
      if (!name.empty())
        readers[name].push_back(i);
    for (const std::string &name : node.output())
      if (!name.empty())
        maker[name] = i;
  }
  for (int i = 0; i < count; ++i) {
    if (!fusable[i])
      continue;
    // The groups making this node's inputs.
    std::vector<int> candidates;
    for (const std::string &name : nodes[i].input()) {
      auto m = maker.find(name);
      if (m == maker.end() || m->second >= i || groupOf[m->second] < 0)
        continue;
      int g = groupOf[m->second];
      if (std::find(candidates.begin(), candidates.end(), g) == candidates.end())
        candidates.push_back(g);
    }
    auto joined = [&](ArrayRef<int> gs) {
      std::vector<int> members;
      for (int g : gs)
        members.insert(members.end(), groups[g].members.begin(), groups[g].members.end());
      members.push_back(i);
      std::sort(members.begin(), members.end());
      return members;
    };
    // All of them at once, else the first that fits alone, else none.
    std::vector<int> chosen;
    if (!candidates.empty() && fits(joined(candidates)))
      chosen = candidates;
    else
      for (int g : candidates)
        if (fits(joined({g}))) {
          chosen = {g};
          break;
        }
    if (chosen.empty()) {
      groupOf[i] = static_cast<int>(groups.size());
      groups.push_back({{i}});
      continue;
    }
    std::vector<int> members = joined(chosen);
    int target = chosen[0];
    for (int g : chosen)
      if (g != target)
        groups[g].members.clear();
    groups[target].members = members;
    for (int m : members)
      groupOf[m] = target;
  }

  // Rebuild the list: each group of two or more at its last member.
  FusionStats stats;
  std::vector<int> fusedAt(count, -1);
  for (size_t g = 0; g < groups.size(); ++g)
    if (groups[g].members.size() > 1)
      fusedAt[groups[g].members.back()] = static_cast<int>(g);
  NodeList rebuilt;
  for (int i = 0; i < count; ++i) {
    int g = groupOf[i];
    if (g < 0 || groups[g].members.size() < 2) {
      *rebuilt.Add() = nodes[i];
      continue;
    }
    if (fusedAt[i] < 0)
      continue;
    const std::vector<int> &members = groups[g].members;
    std::vector<std::string> inputs, outputs;
    boundary(members, inputs, outputs);
    std::vector<const onnx::NodeProto *> body;
    for (int m : members)
      body.push_back(&nodes[m]);
    const onnx::NodeProto &first = nodes[members.front()];
    std::string name = "fused:" + (first.name().empty() ? first.output(0) : first.name());
    *rebuilt.Add() = makeFusedNode(name, body, inputs, outputs);
    ++stats.groups;
    stats.nodes += static_cast<int64_t>(members.size());
  }
  nodes.Swap(&rebuilt);
  return stats;
}

bool isDefault(const onnx::NodeProto &n) { return n.domain().empty() || n.domain() == "ai.onnx"; }

/// MatMul, then an Add of a bias to its product and nothing else reading
/// the product: one MatMulBias node at the Add's place.
int64_t fuseMatMulBias(NodeList &nodes, const StringSet<> &external) {
  StringMap<std::vector<int>> readers;
  for (int i = 0; i < nodes.size(); ++i)
    for (const std::string &name : nodes[i].input())
      if (!name.empty())
        readers[name].push_back(i);
  std::vector<int> fusedInto(nodes.size(), -1);   // MatMul -> its Add
  std::vector<bool> claimed(nodes.size(), false); // Add -> taken by a MatMul
  for (int i = 0; i < nodes.size(); ++i) {
    const onnx::NodeProto &mm = nodes[i];
    if (!isOp(mm, OpId::MatMul) || mm.input_size() != 2 || mm.output_size() != 1 ||
        external.count(mm.output(0)))
      continue;
    auto r = readers.find(mm.output(0));
    if (r == readers.end() || r->second.size() != 1)
      continue;
    const onnx::NodeProto &add = nodes[r->second[0]];
    if (!isOp(add, OpId::Add) || add.input_size() != 2 || add.output_size() != 1 ||
        add.attribute_size() != 0 || add.input(0) == add.input(1) || claimed[r->second[0]])
      continue;
    // An Add of two products (parallel attention and MLP blocks) takes the
    // first MatMul as its bias's partner; the other stays a MatMul.
    claimed[r->second[0]] = true;
    fusedInto[i] = r->second[0];
  }
  NodeList rebuilt;
  int64_t made = 0;
  std::vector<int> madeBy(nodes.size(), -1); // Add -> its MatMul
  for (int i = 0; i < nodes.size(); ++i)
    if (fusedInto[i] >= 0)
      madeBy[fusedInto[i]] = i;
  for (int i = 0; i < nodes.size(); ++i) {
    if (fusedInto[i] >= 0)
      continue;
    if (madeBy[i] < 0) {
      *rebuilt.Add() = nodes[i];
      continue;
    }
    const onnx::NodeProto &mm = nodes[madeBy[i]], &add = nodes[i];
    const std::string &bias = add.input(0) == mm.output(0) ? add.input(1) : add.input(0);
    std::string name = "fused:" + (mm.name().empty() ? mm.output(0) : mm.name());
    onnx::NodeProto fused =
        makeFusedNode(name, {&mm, &add}, {mm.input(0), mm.input(1), bias}, {add.output(0)});
    fused.set_op_type(MatMulBiasOpType.str());
    *rebuilt.Add() = std::move(fused);
    ++made;
  }
  nodes.Swap(&rebuilt);
  return made;
}

/// Whether \p n is a Transpose that swaps its last two axes alone.
bool swapsLastTwo(const onnx::NodeProto &n) {
  std::optional<std::vector<int64_t>> perm = attrInts(n, "perm");
  if (!perm || perm->size() < 2)
    return false;
  int64_t rank = static_cast<int64_t>(perm->size());
  for (int64_t i = 0; i < rank - 2; ++i)
    if ((*perm)[i] != i)
      return false;
  return (*perm)[rank - 2] == rank - 1 && (*perm)[rank - 1] == rank - 2;
}

/// The nodes a value is made by, where they are a default-domain op of one
/// output that a given count of nodes read and nothing names.
class InnerNodes {
public:
  InnerNodes(const NodeList &nodes, const StringSet<> &external)
      : nodes(nodes), external(external) {
    for (int i = 0; i < nodes.size(); ++i) {
      for (const std::string &name : nodes[i].input())
        if (!name.empty())
          readers[name].push_back(i);
      for (const std::string &name : nodes[i].output())
        maker[name] = i;
    }
  }

  /// The node making \p value when it is an \p op node that \p count
  /// nodes read; -1 otherwise.
  int operator()(const std::string &value, OpId op, size_t count) const {
    auto m = maker.find(value);
    auto r = readers.find(value);
    if (m == maker.end() || external.count(value) || r == readers.end() ||
        r->second.size() != count)
      return -1;
    const onnx::NodeProto &n = nodes[m->second];
    return isDefault(n) && isOp(n, op) && n.output_size() == 1 ? m->second : -1;
  }

  const NodeList &nodes;

private:
  const StringSet<> &external;
  StringMap<int> maker;
  StringMap<std::vector<int>> readers;
};

/// What attention's keys and values (\p found[AttentionKeys],
/// found[AttentionValues]) are made from, as fuseSoftmaxAttention says, into
/// \p found's other inputs (AttentionInput) and the nodes in \p taken.
void traceKeysAndValues(const InnerNodes &inner, std::vector<int> &taken,
                        std::array<std::string, AttentionInputs> &found) {
  const NodeList &nodes = inner.nodes;
  // The keys as the exporter transposes and scales them, each step over
  // the whole KV cache: k = Mul(Reshape(Transpose(Reshape(key))), c).
  std::string keys = found[AttentionKeys], scale, mergedShape, splitShape;
  if (int mul = inner(keys, OpId::Mul, 1); mul >= 0 && nodes[mul].input_size() == 2)
    for (int side : {0, 1}) {
      const onnx::NodeProto &m = nodes[mul];
      int split = inner(m.input(side), OpId::Reshape, 1);
      int swap = split >= 0 ? inner(nodes[split].input(0), OpId::Transpose, 1) : -1;
      if (swap < 0 || !swapsLastTwo(nodes[swap]))
        continue;
      int merge = inner(nodes[swap].input(0), OpId::Reshape, 1);
      if (merge < 0 || nodes[merge].input_size() != 2 || nodes[split].input_size() != 2 ||
          m.input(1 - side).empty())
        continue;
      taken.insert(taken.end(), {merge, swap, split, mul});
      keys = nodes[merge].input(0);
      scale = m.input(1 - side);
      mergedShape = nodes[merge].input(1);
      splitShape = nodes[split].input(1);
      break;
    }
  // Grouped-query attention's repeat of the key and value heads (torch's
  // repeat_kv): x = Reshape(Expand(Unsqueeze(heads, axes), wide), merged).
  auto repeat = [&](std::string &value, std::array<std::string, 3> &extra) {
    int merge = inner(value, OpId::Reshape, 1);
    int wide = merge >= 0 ? inner(nodes[merge].input(0), OpId::Expand, 1) : -1;
    int unsqueeze = wide >= 0 ? inner(nodes[wide].input(0), OpId::Unsqueeze, 1) : -1;
    if (unsqueeze < 0 || nodes[unsqueeze].input_size() != 2 || nodes[wide].input_size() != 2 ||
        nodes[merge].input_size() != 2)
      return;
    taken.insert(taken.end(), {unsqueeze, wide, merge});
    value = nodes[unsqueeze].input(0);
    extra = {nodes[unsqueeze].input(1), nodes[wide].input(1), nodes[merge].input(1)};
  };
  std::string values = found[AttentionValues];
  std::array<std::string, 3> keyRepeat, valueRepeat;
  repeat(keys, keyRepeat);
  repeat(values, valueRepeat);
  // A KV cache's Concat(past, appended) that nothing else reads (the stage
  // keeps the appended positions, not the present: Generation::Cache):
  // attention reads both where they lie. The keys' only with their chain.
  auto join = [&](std::string &value, std::string &appended) {
    int concat = inner(value, OpId::Concat, 1);
    if (concat < 0 || nodes[concat].input_size() != 2)
      return;
    taken.push_back(concat);
    value = nodes[concat].input(0);
    appended = nodes[concat].input(1);
  };
  std::string keysAppended, valuesAppended;
  if (!scale.empty())
    join(keys, keysAppended);
  join(values, valuesAppended);
  found[AttentionKeys] = keys;
  found[AttentionValues] = values;
  found[AttentionKeyScale] = scale;
  found[AttentionKeyMerged] = mergedShape;
  found[AttentionKeySplit] = splitShape;
  for (int j = 0; j < 3; ++j) {
    found[AttentionKeyAxes + j] = keyRepeat[j];
    found[AttentionValueAxes + j] = valueRepeat[j];
  }
  found[AttentionKeysAppended] = keysAppended;
  found[AttentionValuesAppended] = valuesAppended;
}

/// Attention as torch's exporters write scaled_dot_product_attention out:
///   S = MatMul(Q, K); [Z = Add(S, mask)]; P = Softmax(Z, axis -1);
///   [W = Where(IsNaN(P), c, P)]; O = MatMul(P or W, V)
/// with every value between read by the next node alone and named nowhere
/// else: one SoftmaxAttention node at the last MatMul's place, whose CPU
/// kernel keeps each head's scores in cache. Where K is the keys merged to
/// three axes, their last two swapped, split back and scaled (torch's
/// decomposition over a KV cache: K = Mul(Reshape(Transpose(Reshape(key,
/// merged)), split), c)), those four nodes join it, and the kernel transposes and
/// scales each head's keys in cache rather than the whole cache in memory.
/// Where the keys or the values are grouped-query attention's repeat of
/// fewer heads (torch's repeat_kv: Reshape(Expand(Unsqueeze(x, axes),
/// wide), merged)), those three nodes join it too, the kernel reading each
/// head of x for every head that shares it. Where the keys (with their
/// chain) or the values are a KV cache's Concat(past, appended) that nothing
/// else reads, it joins too, reading the past and the appended positions.
/// The inputs of each are AttentionInput's (runtime/core/FusedProgram.h).
int64_t fuseSoftmaxAttention(NodeList &nodes, const StringSet<> &external, int64_t opset) {
  if (opset < 13) // Softmax took the whole trailing shape before
    return 0;
  InnerNodes inner(nodes, external);
  std::vector<std::vector<int>> absorbs(nodes.size()); // final MatMul -> the nodes it takes
  std::vector<bool> absorbed(nodes.size(), false);
  std::vector<std::array<std::string, AttentionInputs>> operands(nodes.size());
  for (int i = 0; i < nodes.size(); ++i) {
    const onnx::NodeProto &out = nodes[i];
    if (!isOp(out, OpId::MatMul) || out.input_size() != 2 || out.output_size() != 1)
      continue;
    std::vector<int> taken;
    std::string probs = out.input(0), guard;
    int where = inner(probs, OpId::Where, 1);
    if (where >= 0) {
      const onnx::NodeProto &w = nodes[where];
      int isNan = w.input_size() == 3 ? inner(w.input(0), OpId::IsNaN, 1) : -1;
      if (isNan < 0 || nodes[isNan].input(0) != w.input(2))
        continue;
      probs = w.input(2);
      guard = w.input(1);
      taken = {isNan, where};
    }
    int softmax = inner(probs, OpId::Softmax, taken.empty() ? 1 : 2);
    if (softmax < 0 || nodes[softmax].input_size() != 1)
      continue;
    taken.push_back(softmax);
    std::string scores = nodes[softmax].input(0), mask;
    int add = inner(scores, OpId::Add, 1);
    if (add >= 0) {
      const onnx::NodeProto &a = nodes[add];
      if (a.input_size() != 2 || a.input(0) == a.input(1))
        continue;
      bool first = inner(a.input(0), OpId::MatMul, 1) >= 0;
      scores = first ? a.input(0) : a.input(1);
      mask = first ? a.input(1) : a.input(0);
      taken.push_back(add);
    }
    int product = inner(scores, OpId::MatMul, 1);
    if (product < 0 || nodes[product].input_size() != 2)
      continue;
    taken.push_back(product);
    std::array<std::string, AttentionInputs> found{nodes[product].input(0), nodes[product].input(1),
                                                   out.input(1), mask, guard};
    traceKeysAndValues(inner, taken, found);
    if (llvm::any_of(taken, [&](int t) { return absorbed[t]; }))
      continue;
    for (int t : taken)
      absorbed[t] = true;
    std::sort(taken.begin(), taken.end());
    absorbs[i] = taken;
    operands[i] = found;
  }
  NodeList rebuilt;
  int64_t made = 0;
  for (int i = 0; i < nodes.size(); ++i) {
    if (absorbed[i])
      continue;
    if (absorbs[i].empty()) {
      *rebuilt.Add() = nodes[i];
      continue;
    }
    std::vector<const onnx::NodeProto *> body;
    for (int t : absorbs[i])
      body.push_back(&nodes[t]);
    body.push_back(&nodes[i]);
    std::string name = "fused:" + (nodes[i].name().empty() ? nodes[i].output(0) : nodes[i].name());
    // Trailing absent operands are left off (no key chain or repeat: five).
    std::vector<std::string> inputs(operands[i].begin(), operands[i].end());
    while (inputs.size() > 5 && inputs.back().empty())
      inputs.pop_back();
    onnx::NodeProto fused = makeFusedNode(name, body, inputs, {nodes[i].output(0)});
    fused.set_op_type(SoftmaxAttentionOpType.str());
    *rebuilt.Add() = std::move(fused);
    ++made;
  }
  nodes.Swap(&rebuilt);
  return made;
}

/// A MatMul whose B is made by a Transpose with perm [1, 0] that nothing
/// else reads: one MatMulTransposed node at the MatMul's place, reading the
/// Transpose's input.
int64_t fuseTransposedOperand(NodeList &nodes, const StringSet<> &external) {
  StringMap<int> maker;
  StringMap<int> reads;
  for (int i = 0; i < nodes.size(); ++i) {
    for (const std::string &name : nodes[i].input())
      if (!name.empty())
        ++reads[name];
    for (const std::string &name : nodes[i].output())
      maker[name] = i;
  }
  std::vector<int> transposeOf(nodes.size(), -1); // MatMul -> its Transpose
  std::vector<bool> absorbed(nodes.size(), false);
  for (int i = 0; i < nodes.size(); ++i) {
    const onnx::NodeProto &mm = nodes[i];
    if (!isOp(mm, OpId::MatMul) || mm.input_size() != 2 || mm.output_size() != 1 ||
        mm.input(0) == mm.input(1))
      continue;
    auto m = maker.find(mm.input(1));
    if (m == maker.end() || m->second > i || reads[mm.input(1)] != 1 || external.count(mm.input(1)))
      continue;
    const onnx::NodeProto &tr = nodes[m->second];
    std::optional<std::vector<int64_t>> perm = attrInts(tr, "perm");
    if (!isOp(tr, OpId::Transpose) || tr.input_size() != 1 || tr.output_size() != 1 || !perm ||
        *perm != std::vector<int64_t>{1, 0})
      continue;
    transposeOf[i] = m->second;
    absorbed[m->second] = true;
  }
  NodeList rebuilt;
  int64_t made = 0;
  for (int i = 0; i < nodes.size(); ++i) {
    if (absorbed[i])
      continue;
    if (transposeOf[i] < 0) {
      *rebuilt.Add() = nodes[i];
      continue;
    }
    const onnx::NodeProto &tr = nodes[transposeOf[i]], &mm = nodes[i];
    std::string name = "fused:" + (mm.name().empty() ? mm.output(0) : mm.name());
    onnx::NodeProto fused =
        makeFusedNode(name, {&tr, &mm}, {mm.input(0), tr.input(0)}, {mm.output(0)});
    fused.set_op_type(MatMulTransposedOpType.str());
    *rebuilt.Add() = std::move(fused);
    ++made;
  }
  nodes.Swap(&rebuilt);
  return made;
}

void addNames(StringSet<> &set, const google::protobuf::RepeatedPtrField<std::string> &names) {
  for (const std::string &name : names)
    set.insert(name);
}

void addInputs(StringSet<> &set, const NodeList &nodes) {
  for (const onnx::NodeProto &node : nodes)
    addNames(set, node.input());
}

} // namespace

FusionStats fuseStageProgram(plan::StageProgram &program, int64_t opset,
                             ArrayRef<std::string> read) {
  // Every name the program uses outside its node lists.
  StringSet<> named;
  addNames(named, program.send());
  addNames(named, program.outputs());
  addNames(named, program.keep());
  for (const auto *sums : {&program.input_grads(), &program.weight_grads()})
    for (const plan::GradSum &sum : *sums) {
      named.insert(sum.value());
      addNames(named, sum.terms());
    }
  for (const std::string &name : read)
    if (!name.empty())
      named.insert(name);
  NodeList *lists[] = {program.mutable_forward(), program.mutable_backward_input(),
                       program.mutable_backward_weight()};
  FusionStats total;
  for (NodeList *list : lists) {
    StringSet<> external = named;
    for (NodeList *other : lists)
      if (other != list)
        addInputs(external, *other);
    total.matMulTransposed += fuseTransposedOperand(*list, external);
    total.softmaxAttention += fuseSoftmaxAttention(*list, external, opset);
    if (opset >= 7)
      total.matMulBias += fuseMatMulBias(*list, external);
    FusionStats stats = ListFuser(*list, external, opset).run();
    total.groups += stats.groups;
    total.nodes += stats.nodes;
  }
  return total;
}

} // namespace pipec::rt
