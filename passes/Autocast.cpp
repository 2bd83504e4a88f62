//===- Autocast.cpp - autocast: bf16 activations where the plan says bf16 --===//
#include "passes/Autocast.h"
#include "passes/GraphEdit.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include <map>

using namespace llvm;

namespace pipec {

namespace {

/// How an op's float inputs are cast (Autocast.h).
enum class Policy { Low, Full, Promote, Declared, Own };

Policy policyOf(const Op &op) {
  if (op.is(OpId::Cast) || op.is(OpId::CastLike))
    return Policy::Own;
  if (!op.def || op.has(Subgraph))
    return Policy::Declared;
  if (op.has(LowPrecision))
    return Policy::Low;
  if (op.has(FullPrecision))
    return Policy::Full;
  return Policy::Promote;
}

bool takesPart(DType type) { return type == DType::F32 || type == DType::BF16; }

class Rewrite {
public:
  explicit Rewrite(Graph &graph) : graph(graph) {}

  AutocastReport run() {
    size_t count = graph.ops.size();
    for (size_t o = 0; o < count; ++o)
      if (!graph.ops[o].dead)
        visit(static_cast<int>(o));
    insertOps(graph, before);
    restoreOutputs();
    return report;
  }

private:
  Graph &graph;
  AutocastReport report;
  /// Casts to insert before op index (in the ops as they were).
  std::map<int, std::vector<Op>> before;
  /// An activation's cast to a type, made once and read by every later op.
  std::map<std::pair<int, DType>, int> made;
  /// The graph outputs' types before the rewrite.
  std::map<int, DType> declared;

  void visit(int o) {
    Op &op = graph.ops[o];
    std::vector<int> slots;
    for (size_t i = 0; i < op.inputs.size(); ++i)
      if (op.inputs[i] >= 0 && takesPart(graph.values[op.inputs[i]].type))
        slots.push_back(static_cast<int>(i));
    switch (policyOf(op)) {
    case Policy::Own:
      // Cast writes what its attribute says; CastLike its target's type.
      if (op.is(OpId::CastLike) && op.inputs.size() > 1 && !op.outputs.empty() &&
          op.outputs[0] >= 0)
        retype(op.outputs[0], graph.values[op.inputs[1]].type);
      return;
    case Policy::Declared:
    case Policy::Full:
      castAll(o, slots, DType::F32);
      return;
    case Policy::Low:
      if (slots.empty())
        return;
      castAll(o, slots, DType::BF16);
      if (int out = graph.ops[o].outputs.empty() ? -1 : graph.ops[o].outputs[0];
          out >= 0 && graph.values[out].type == DType::F32)
        retype(out, DType::BF16);
      ++report.lowOps;
      return;
    case Policy::Promote:
      break;
    }
    bool wideActivation = false, narrow = false;
    for (int i : slots) {
      const Value &v = graph.values[op.inputs[i]];
      if (v.type == DType::BF16)
        narrow = true;
      else if (v.kind == ValueKind::Activation || v.kind == ValueKind::Input)
        wideActivation = true;
    }
    if (!narrow)
      return;
    DType to = wideActivation ? DType::F32 : DType::BF16;
    castAll(o, slots, to);
    for (int id : graph.ops[o].outputs)
      if (id >= 0 && takesPart(graph.values[id].type))
        retype(id, to);
  }

  /// Casts the inputs \p slots of op \p o that are not \p to already.
  void castAll(int o, const std::vector<int> &slots, DType to) {
    for (int i : slots)
      if (graph.values[graph.ops[o].inputs[i]].type != to)
        castInput(o, i, to);
  }

  void retype(int id, DType type) {
    Value &v = graph.values[id];
    if (v.isGraphOutput)
      declared.try_emplace(id, v.type);
    v.type = type;
  }

  /// Points input \p slot of op \p o at its value cast to \p to: one cast
  /// per reader of a weight or constant (each layer its own), one per
  /// activation and type for all its readers.
  void castInput(int o, int slot, DType to) {
    int id = graph.ops[o].inputs[slot];
    ValueKind kind = graph.values[id].kind; // (castOp adds values)
    bool shared = kind == ValueKind::Activation || kind == ValueKind::Input;
    if (shared)
      if (auto it = made.find({id, to}); it != made.end()) {
        rewire(graph, o, slot, it->second);
        return;
      }
    Op cast = castOp(id, to, graph.ops[o].scope);
    cast.fileReads = {fileRead(graph, o, slot)};
    int out = cast.outputs[0];
    // A weight's cast is a weight derived from it, as a tied head's
    // Transpose is: the product's gradient into it is a weight gradient
    // (deferred with W), and the memory model holds it per microbatch.
    if (kind == ValueKind::Weight)
      graph.values[out].kind = ValueKind::Weight;
    before[o].push_back(std::move(cast));
    if (shared)
      made[{id, to}] = out;
    rewire(graph, o, slot, out);
  }

  /// A Cast of value \p id to \p to, writing value \p out, or a new value
  /// when it is -1.
  Op castOp(int id, DType to, const std::string &scope, int out = -1) {
    if (out < 0) {
      std::string name =
          freshName(graph, graph.values[id].name + (to == DType::BF16 ? ".bf16" : ".f32"));
      out = graph.addValue(name, ValueKind::Activation);
      Value &v = graph.values[out];
      v.type = to;
      v.shape = graph.values[id].shape;
      v.shapeKnown = graph.values[id].shapeKnown;
    }
    const std::string &name = graph.values[out].name;
    onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
    node.set_name("autocast:" + name);
    node.set_op_type("Cast");
    node.add_input(graph.values[id].name);
    node.add_output(name);
    setAttrInt(node, "to", static_cast<int64_t>(to));
    Op op;
    op.name = node.name();
    op.scope = scope;
    op.setType("", "Cast");
    op.inputs = {id};
    op.outputs = {out};
    op.nodeIndex = graph.model->graph().node_size() - 1;
    ++report.casts;
    return op;
  }

  /// A graph output left bf16 keeps its name and type: its producer writes
  /// a new bf16 value, and a Cast writes the output from it.
  void restoreOutputs() {
    std::map<int, std::vector<Op>> after;
    for (auto [id, type] : declared) {
      if (graph.values[id].type == type || graph.values[id].producer < 0)
        continue;
      int o = graph.values[id].producer;
      std::string name = freshName(graph, graph.values[id].name + ".bf16");
      int narrow = graph.addValue(name, ValueKind::Activation);
      Value &n = graph.values[narrow];
      const Value &whole = graph.values[id];
      n.type = whole.type;
      n.shape = whole.shape;
      n.shapeKnown = whole.shapeKnown;
      Op &producer = graph.ops[o];
      for (size_t k = 0; k < producer.outputs.size(); ++k)
        if (producer.outputs[k] == id) {
          producer.outputs[k] = narrow;
          graph.model->mutable_graph()
              ->mutable_node(producer.nodeIndex)
              ->set_output(static_cast<int>(k), name);
        }
      for (auto [reader, slot] : readsOf(graph, id))
        rewire(graph, reader, slot, narrow);
      graph.values[id].type = type;
      after[o + 1].push_back(castOp(narrow, type, producer.scope, id));
    }
    if (!after.empty())
      insertOps(graph, after);
  }
};

} // namespace

Expected<AutocastReport> autocast(Graph &graph, LayerGraph &layers) {
  if (!graph.training || !graph.autocast)
    return AutocastReport{};
  AutocastReport report = Rewrite(graph).run();
  if (report.casts == 0)
    return report;
  if (Error err = regroupAfter(graph, layers, "autocast"))
    return err;
  return report;
}

} // namespace pipec
