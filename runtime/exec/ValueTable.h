//===- ValueTable.h - A rank's values by slot, and its prepared nodes -----===//
//
// A rank names each value its stage programs make once, at load: the name
// gets a slot (ValueNames). A microbatch's values (Env) are a tensor per
// slot, set or not. The nodes of each node list are prepared once, the
// first time the list runs (PreparedNode): their op's row of ops/Ops.def,
// and each input and output as a slot, so that running a node looks up no
// string. Instructions that move values by name (loads, sends, receives,
// gradient sums) go through the names; nodes through the slots.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_VALUETABLE_H
#define PIPEC_RUNTIME_EXEC_VALUETABLE_H

#include "ops/OpRegistry.h"
#include "runtime/core/OpContext.h"
#include "runtime/core/Tensor.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <string>
#include <unordered_map>
#include <vector>

namespace pipec::rt {

/// The slots of a rank's value names: each name one slot, for good.
class ValueNames {
public:
  /// The slot of \p name, given one if it has none.
  int slotOf(const std::string &name) {
    auto [it, added] = slots.try_emplace(name, static_cast<int>(names.size()));
    if (added)
      names.push_back(name);
    return it->second;
  }
  /// The slot of \p name, or -1 when it has none.
  int find(const std::string &name) const {
    auto it = slots.find(name);
    return it == slots.end() ? -1 : it->second;
  }
  const std::string &name(int slot) const { return names[slot]; }
  int size() const { return static_cast<int>(names.size()); }

private:
  std::unordered_map<std::string, int> slots;
  std::vector<std::string> names;
};

/// One microbatch's values, by slot of a ValueNames; a slot holding a null
/// tensor is unset.
class Env {
public:
  explicit Env(ValueNames *names = nullptr) : names(names) {}

  /// The value \p name, or null when unset.
  cpu::Tensor *find(const std::string &name) { return at(names->find(name)); }
  const cpu::Tensor *find(const std::string &name) const {
    return const_cast<Env *>(this)->find(name);
  }
  bool count(const std::string &name) const { return find(name) != nullptr; }
  /// The tensor of \p name to assign; it is set once it is not null.
  cpu::Tensor &operator[](const std::string &name) { return put(names->slotOf(name)); }
  void erase(const std::string &name) { clear(names->find(name)); }

  /// The value in \p slot (-1: none), or null when unset.
  cpu::Tensor *at(int slot) {
    return slot >= 0 && slot < static_cast<int>(slots.size()) && !slots[slot].isNull()
               ? &slots[slot]
               : nullptr;
  }
  cpu::Tensor &put(int slot) {
    if (slot >= static_cast<int>(slots.size()))
      slots.resize(std::max(slot + 1, names->size())); // once for the names made so far
    return slots[slot];
  }
  void clear(int slot) {
    if (slot >= 0 && slot < static_cast<int>(slots.size()))
      slots[slot].reset();
  }
  /// Unsets every value, keeping the slots for the next microbatch that
  /// takes this Env (a step makes thousands of values: sizing the table
  /// again per microbatch costs more than its nodes' dispatch).
  void reset() {
    for (cpu::Tensor &t : slots)
      t.reset();
  }
  /// Unsets every value whose name \p drop says to.
  void clearIf(llvm::function_ref<bool(const std::string &)> drop) {
    for (size_t s = 0; s < slots.size(); ++s)
      if (!slots[s].isNull() && drop(names->name(static_cast<int>(s))))
        slots[s].reset();
  }

private:
  ValueNames *names;
  std::vector<cpu::Tensor> slots;
};

/// A node of a node list as the rank runs it.
struct PreparedNode {
  const onnx::NodeProto *node = nullptr;
  /// Its op's row, when the row has a CPU kernel or is a collective the
  /// executor runs; else null (the backend looks the op up by name).
  const OpDef *def = nullptr;
  /// Per input: its slot (-1 for an omitted input), and the weight of that
  /// name where the rank holds one (read when the slot is unset).
  llvm::ArrayRef<int> inputs;
  llvm::ArrayRef<const cpu::Tensor *> weights;
  /// Per output: its slot, -1 for an omitted one.
  llvm::ArrayRef<int> outputs;
  /// The slots to unset once it ran.
  llvm::ArrayRef<int> drops;
  /// What its kernel parsed of its attributes, kept for the next run (the
  /// node lists are otherwise fixed once prepared).
  mutable ParsedAttrs attrs;
};

/// A node list as the rank runs it: its nodes, and the slots and weights
/// that their lists view, in node order in two arrays (a node's lists are
/// read where the one before it left off, not from a heap block each).
class PreparedList {
public:
  /// Appends \p node, whose lists are \p inputs, \p weights (one per
  /// input), \p outputs and \p drops.
  void add(const onnx::NodeProto &node, const OpDef *def, llvm::ArrayRef<int> inputs,
           llvm::ArrayRef<const cpu::Tensor *> weights, llvm::ArrayRef<int> outputs,
           llvm::ArrayRef<int> drops) {
    assert(inputs.size() == weights.size() && "a weight per input");
    PreparedNode &p = list.emplace_back();
    p.node = &node;
    p.def = def;
    lengths.push_back({slots.size(), inputs.size(), outputs.size(), drops.size()});
    slots.insert(slots.end(), inputs.begin(), inputs.end());
    slots.insert(slots.end(), outputs.begin(), outputs.end());
    slots.insert(slots.end(), drops.begin(), drops.end());
    nodeWeights.insert(nodeWeights.end(), weights.begin(), weights.end());
  }
  /// Points each node's lists into the arrays, once every node is added.
  void seal() {
    size_t weightAt = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      auto [at, in, out, drop] = lengths[i];
      list[i].inputs = llvm::ArrayRef<int>(slots).slice(at, in);
      list[i].outputs = llvm::ArrayRef<int>(slots).slice(at + in, out);
      list[i].drops = llvm::ArrayRef<int>(slots).slice(at + in + out, drop);
      list[i].weights = llvm::ArrayRef<const cpu::Tensor *>(nodeWeights).slice(weightAt, in);
      weightAt += in;
    }
    lengths = {};
  }
  const std::vector<PreparedNode> &nodes() const { return list; }

private:
  std::vector<PreparedNode> list;
  std::vector<int> slots;
  std::vector<const cpu::Tensor *> nodeWeights;
  /// Per node until seal: where its slots start, and its input, output and
  /// drop counts.
  std::vector<std::array<size_t, 4>> lengths;
};

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_VALUETABLE_H
