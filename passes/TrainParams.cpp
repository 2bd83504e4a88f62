//===- TrainParams.cpp - train-params: the checkpoint's parameters train --===//
#include "passes/TrainParams.h"
#include "passes/GraphEdit.h"
#include "passes/GroupLayers.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <set>

using namespace llvm;

namespace pipec {
namespace {

bool isLayout(const plan::ParamStep &step) {
  return step.has_transpose() || step.step_case() == plan::ParamStep::kUnsqueeze;
}

bool sameSteps(const plan::ParamPlace &a, const plan::ParamPlace &b) {
  if (a.steps_size() != b.steps_size())
    return false;
  for (int i = 0; i < a.steps_size(); ++i)
    if (a.steps(i).SerializeAsString() != b.steps(i).SerializeAsString())
      return false;
  return true;
}

/// How \p fold trains as its parameter: nothing to do (one weight holds it
/// as a layout), the first weight read for all (several hold it alike), or
/// a weight of its own read through nodes.
enum class Rewrite { None, Merge, Nodes };

Rewrite rewriteOf(const ParamFold &fold) {
  bool layouts =
      all_of(fold.places, [](const plan::ParamPlace &p) { return all_of(p.steps(), isLayout); });
  bool alike =
      all_of(fold.places, [&](const plan::ParamPlace &p) { return sameSteps(p, fold.places[0]); });
  if (layouts && fold.places.size() == 1)
    return Rewrite::None;
  if (layouts && alike)
    return Rewrite::Merge;
  return Rewrite::Nodes;
}

/// Builds the nodes that compute a place's steps from a weight, one op at a
/// time, inserted into the graph before op \p at, in \p scope.
class StepEmitter {
public:
  StepEmitter(Graph &graph, int at, std::string scope, std::string base)
      : graph(graph), at(at), scope(std::move(scope)), base(std::move(base)) {}

  /// The value that holds the steps of \p place applied to \p from.
  int emit(int from, const plan::ParamPlace &place) {
    int x = from;
    for (const plan::ParamStep &step : place.steps()) {
      std::vector<int64_t> shape = graph.values[x].shape;
      switch (step.step_case()) {
      case plan::ParamStep::kTranspose: {
        std::vector<int64_t> perm(step.transpose().perm().begin(), step.transpose().perm().end());
        std::vector<int64_t> moved;
        for (int64_t p : perm)
          moved.push_back(shape[p]);
        x = op("Transpose", {x}, moved, [&](onnx::NodeProto &n) { setInts(n, "perm", perm); });
        break;
      }
      case plan::ParamStep::kSlice: {
        const plan::SliceStep &s = step.slice();
        shape[s.axis()] = s.stop() - s.start();
        if (graph.opsetFor("") < 10) {
          x = op("Slice", {x}, shape, [&](onnx::NodeProto &n) {
            setInts(n, "starts", {s.start()});
            setInts(n, "ends", {s.stop()});
            setInts(n, "axes", {s.axis()});
          });
        } else {
          x = op("Slice", {x, ints({s.start()}), ints({s.stop()}), ints({s.axis()})}, shape);
        }
        break;
      }
      case plan::ParamStep::kUnsqueeze: {
        int64_t axis = step.unsqueeze();
        shape.insert(shape.begin() + axis, 1);
        if (graph.opsetFor("") < 13)
          x = op("Unsqueeze", {x}, shape, [&](onnx::NodeProto &n) { setInts(n, "axes", {axis}); });
        else
          x = op("Unsqueeze", {x, ints({axis})}, shape);
        break;
      }
      case plan::ParamStep::kAdd: {
        ConstTensor c;
        c.type = graph.values[x].type;
        c.floats = {static_cast<double>(static_cast<float>(step.add()))};
        x = op("Add", {x, constant(std::move(c))}, shape);
        break;
      }
      case plan::ParamStep::kBroadcast:
        shape[step.broadcast().axis()] = step.broadcast().size();
        x = op("Expand", {x, ints(shape, {static_cast<int64_t>(shape.size())})}, shape);
        break;
      case plan::ParamStep::kTake: {
        const plan::Take &take = step.take();
        int flat = op("Reshape", {x, ints({-1})}, {graph.values[x].numElements()});
        std::vector<int64_t> to(take.shape().begin(), take.shape().end());
        std::vector<int64_t> indices(take.indices().begin(), take.indices().end());
        x = op("Gather", {flat, ints(std::move(indices), to)}, to, [](onnx::NodeProto &n) {
          onnx::AttributeProto &a = *n.add_attribute();
          a.set_name("axis");
          a.set_type(onnx::AttributeProto::INT);
          a.set_i(0);
        });
        break;
      }
      case plan::ParamStep::STEP_NOT_SET:
        break;
      }
    }
    return x;
  }

  /// Ops emitted so far, in order; the caller inserts them at `at`.
  std::vector<Op> ops;

private:
  static void setInts(onnx::NodeProto &n, StringRef name, ArrayRef<int64_t> values) {
    onnx::AttributeProto &a = *n.add_attribute();
    a.set_name(name.str());
    a.set_type(onnx::AttributeProto::INTS);
    for (int64_t v : values)
      a.add_ints(v);
  }

  int constant(ConstTensor c) {
    int id = graph.addValue(freshName(graph, base + ".const"), ValueKind::Constant);
    Value &v = graph.values[id];
    v.type = c.type;
    v.shape = c.shape;
    v.shapeKnown = true;
    v.constant = std::make_shared<const ConstTensor>(std::move(c));
    return id;
  }

  int ints(std::vector<int64_t> values, std::vector<int64_t> shape = {}) {
    ConstTensor c;
    c.type = DType::I64;
    c.shape = shape.empty() ? std::vector<int64_t>{static_cast<int64_t>(values.size())} : shape;
    c.ints = std::move(values);
    return constant(std::move(c));
  }

  int op(
      StringRef type, std::vector<int> inputs, std::vector<int64_t> shape,
      function_ref<void(onnx::NodeProto &)> attributes = [](onnx::NodeProto &) {}) {
    std::string name = freshName(graph, base + "." + type.lower());
    int out = graph.addValue(name, ValueKind::Weight);
    graph.values[out].type = graph.values[inputs[0]].type;
    graph.values[out].shape = std::move(shape);
    graph.values[out].shapeKnown = true;
    onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
    node.set_name(name);
    node.set_op_type(type.str());
    for (int in : inputs)
      node.add_input(graph.values[in].name);
    node.add_output(name);
    attributes(node);
    Op o;
    o.name = name;
    o.scope = scope;
    o.setType("", type);
    o.inputs = std::move(inputs);
    o.outputs = {out};
    o.nodeIndex = graph.model->graph().node_size() - 1;
    ops.push_back(std::move(o));
    return out;
  }

  Graph &graph;
  int at;
  std::string scope, base;
};

/// Reads the steps of \p place applied to \p from wherever place.weight()
/// was read: one chain of nodes per reading module (ops of one scope), just
/// before its first reader. Returns the number of chains.
int readThroughSteps(Graph &graph, int from, const plan::ParamPlace &place) {
  int weight = graph.findValue(place.weight());
  std::vector<std::string> scopes; // in the order of their first reads
  for (auto [o, slot] : readsOf(graph, weight))
    if (!is_contained(scopes, graph.ops[o].scope))
      scopes.push_back(graph.ops[o].scope);
  for (const std::string &scope : scopes) {
    std::vector<std::pair<int, int>> mine;
    for (auto [o, slot] : readsOf(graph, weight))
      if (graph.ops[o].scope == scope)
        mine.push_back({o, slot});
    int at = mine.front().first;
    StepEmitter emitter(graph, at, scope, place.weight() + ".from");
    int value = emitter.emit(from, place);
    int added = static_cast<int>(emitter.ops.size());
    graph.ops.insert(graph.ops.begin() + at, std::make_move_iterator(emitter.ops.begin()),
                     std::make_move_iterator(emitter.ops.end()));
    for (auto [o, slot] : mine)
      rewire(graph, o + added, slot, value); // the readers moved down
    graph.rebuildUses();
  }
  return static_cast<int>(scopes.size());
}

} // namespace

Expected<std::vector<ParamRewrite>> trainParams(Graph &graph, LayerGraph &layers,
                                                const std::vector<ParamFold> &folds) {
  std::vector<ParamRewrite> out;
  for (const ParamFold &fold : folds) {
    if (fold.places.empty())
      continue;
    Rewrite kind = rewriteOf(fold);
    if (kind == Rewrite::None)
      continue;
    std::vector<int> ids;
    for (const plan::ParamPlace &place : fold.places)
      ids.push_back(graph.findValue(place.weight()));
    DType type = ids[0] >= 0 ? graph.values[ids[0]].type : DType::Undefined;
    bool fits = all_of(ids, [&](int id) {
      // A weight split over tensor-parallel ranks keeps its form (shard-tensors
      // cut it as the model file holds it).
      return id >= 0 && graph.values[id].kind == ValueKind::Weight &&
             !graph.shards.count(graph.values[id].name) && graph.values[id].producer < 0 &&
             graph.values[id].type == type && !graph.values[id].users.empty() &&
             !capturedBySubgraph(graph, id);
    });
    if (!fits || (kind == Rewrite::Nodes && (!fold.value || fold.value->type != type)))
      continue;
    ParamRewrite rewrite;
    rewrite.param = fold.param;
    rewrite.guessed = fold.guessed;
    if (kind == Rewrite::Merge) {
      rewrite.weight = fold.places[0].weight();
      for (size_t i = 1; i < fold.places.size(); ++i) {
        for (auto [o, slot] : readsOf(graph, ids[i]))
          rewire(graph, o, slot, ids[0]);
        plan::ParamPlace same;
        same.set_weight(fold.places[i].weight());
        rewrite.places.push_back(std::move(same));
      }
      graph.rebuildUses();
      rewrite.readers = static_cast<int>(fold.places.size());
    } else {
      rewrite.newWeight = true;
      rewrite.weight = freshName(graph, fold.guessed ? fold.param + ".param" : fold.param);
      int param = graph.addValue(rewrite.weight, ValueKind::Weight);
      Value &v = graph.values[param];
      v.type = type;
      v.shape = fold.value->shape;
      v.shapeKnown = true;
      v.constant = fold.value;
      for (const plan::ParamPlace &place : fold.places) {
        rewrite.readers += readThroughSteps(graph, param, place);
        plan::ParamPlace from = place;
        rewrite.places.push_back(std::move(from));
      }
    }
    out.push_back(std::move(rewrite));
  }
  if (!out.empty())
    if (Error err = regroupAfter(graph, layers, "train-params"))
      return std::move(err);
  return out;
}

namespace {

std::string describe(const plan::ParamPlace &place) {
  std::vector<std::string> parts;
  for (const plan::ParamStep &step : place.steps()) {
    if (step.has_transpose())
      parts.push_back("a transpose");
    else if (step.has_slice())
      parts.push_back(formatv("rows {0}:{1} of axis {2}", step.slice().start(), step.slice().stop(),
                              step.slice().axis()));
    else if (step.has_broadcast())
      parts.push_back(
          formatv("{0} copies along axis {1}", step.broadcast().size(), step.broadcast().axis()));
    else if (step.step_case() == plan::ParamStep::kAdd)
      parts.push_back(formatv("{0} + w", step.add()));
    else if (step.has_take())
      parts.push_back(formatv("a gather of {0} entries", step.take().indices_size()));
  }
  return parts.empty() ? "a copy" : join(parts, ", ");
}

} // namespace

void describeParamRewrites(plan::Plan &plan, const std::vector<ParamRewrite> &rewrites) {
  for (const ParamRewrite &r : rewrites) {
    std::vector<std::string> held;
    for (const plan::ParamPlace &place : r.places)
      held.push_back(formatv("'{0}' ({1})", place.weight(), describe(place)));
    if (r.guessed)
      plan.add_warnings(
          r.newWeight
              ? formatv("guessed without --params: {0} hold{1} one parameter, which trains as "
                        "weight '{2}', read by {3} modules through nodes; pass --params to "
                        "decide from the checkpoint",
                        join(held, ", "), r.places.size() == 1 ? "s" : "", r.weight, r.readers)
                    .str()
              : formatv("guessed without --params: '{0}' and {1} hold equal values, one "
                        "parameter, which trains as '{0}'; pass --params to decide from the "
                        "checkpoint",
                        r.weight, join(held, ", "))
                    .str());
    else
      plan.add_warnings(
          r.newWeight
              ? formatv("--params: parameter '{0}' trains as weight '{1}', read by {2} modules "
                        "through nodes; the exporter folded it into {3}",
                        r.param, r.weight, r.readers, join(held, ", "))
                    .str()
              : formatv("--params: parameter '{0}' trains as weight '{1}', read in place of {2}: "
                        "the exporter wrote one copy per reader",
                        r.param, r.weight, join(held, ", "))
                    .str());
    for (const plan::ParamPlace &place : r.places) {
      plan::WeightTie &t = *plan.add_ties();
      t.set_weight(place.weight());
      t.set_param_weight(r.weight);
      *t.mutable_steps() = place.steps();
    }
  }
}

void printParamRewrites(const std::vector<ParamRewrite> &rewrites, raw_ostream &os) {
  os << formatv("params rewritten={0}\n", rewrites.size());
  for (const ParamRewrite &r : rewrites) {
    os << "param " << r.param << " weight=" << r.weight << (r.newWeight ? " new" : "")
       << " readers=" << r.readers << "\n";
    for (const plan::ParamPlace &place : r.places)
      os << "  held " << place.weight() << " as " << describe(place) << "\n";
  }
}

} // namespace pipec
