//===- StagePrograms.cpp - What each stage of a plan executes -----------===//
#include "passes/StagePrograms.h"
#include "ops/OpRegistry.h"
#include "plan/PlanFile.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Regex.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>

using namespace llvm;

namespace pipec {

namespace {

Error stageError(int stage, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "stage %d: %s", stage, why.str().c_str());
}

/// The node of \p op, with inputs and outputs named as the Graph has them now
/// (passes may have rewired the op since import). The values its subgraphs
/// capture follow its own inputs, so that the rank hands them to the kernel.
onnx::NodeProto nodeOf(const Graph &graph, const Op &op) {
  onnx::NodeProto node = graph.node(op);
  node.clear_input();
  for (int id : op.inputs)
    node.add_input(id >= 0 ? graph.values[id].name : "");
  for (int id : op.captures)
    node.add_input(graph.values[id].name);
  node.clear_output();
  for (int id : op.outputs)
    node.add_output(id >= 0 ? graph.values[id].name : "");
  node.set_op_type(op.opType);
  node.set_domain(op.domain);
  if (node.name().empty())
    node.set_name(op.name);
  return node;
}

/// \p path relative to \p dir when it lies under it. Both are compared
/// without "." components: a model named "m.onnx" (dir "") keeps its data
/// in "./m.onnx.data", which is "m.onnx.data" to the model.
std::string relativeTo(StringRef path, StringRef dir) {
  SmallString<256> file(path), folder(dir);
  sys::path::remove_dots(file, /*remove_dot_dot=*/false);
  sys::path::remove_dots(folder, /*remove_dot_dot=*/false);
  StringRef f = file, d = folder;
  if (d.empty())
    return f.str();
  if (f.startswith(d) && f.size() > d.size() && sys::path::is_separator(f[d.size()]))
    return f.drop_front(d.size() + 1).str();
  return f.str();
}

/// The plan's copy of weight or constant \p id: a reference into the model's
/// files when its bytes live there, else the values.
Expected<onnx::TensorProto> weightTensor(const Graph &graph, int id) {
  const Value &v = graph.values[id];
  onnx::TensorProto t;
  if (v.storage) {
    t.set_name(v.name);
    t.set_data_type(static_cast<int32_t>(v.type));
    // A split weight's tensor is the model's whole one; ranks load pieces.
    auto shard = graph.shards.find(v.name);
    for (size_t k = 0; k < v.shape.size(); ++k)
      t.add_dims(shard != graph.shards.end() && shard->second.axis == static_cast<int>(k)
                     ? v.shape[k] * shard->second.parts
                     : v.shape[k]);
    t.set_data_location(onnx::TensorProto::EXTERNAL);
    StringRef dir = sys::path::parent_path(graph.path);
    std::string file = v.storage->file == 0 ? sys::path::filename(graph.path).str()
                                            : relativeTo(graph.fileNames[v.storage->file], dir);
    auto entry = [&](StringRef key, const std::string &value) {
      auto *e = t.add_external_data();
      e->set_key(key.str());
      e->set_value(value);
    };
    entry("location", file);
    entry("offset", std::to_string(v.storage->offset));
    entry("length", std::to_string(v.storage->length));
    return t;
  }
  if (v.tensorIndex >= 0) {
    int initializers = graph.model->graph().initializer_size();
    t = v.tensorIndex < initializers ? graph.model->graph().initializer(v.tensorIndex)
                                     : *graph.constantTensors[v.tensorIndex - initializers];
    t.set_name(v.name);
    return t;
  }
  if (!v.constant)
    return createStringError(inconvertibleErrorCode(), "value '%s' has no data", v.name.c_str());
  const ConstTensor &c = *v.constant;
  t.set_name(v.name);
  t.set_data_type(static_cast<int32_t>(c.type));
  for (int64_t d : c.shape)
    t.add_dims(d);
  if (isNarrowIntegerDType(c.type)) {
    for (int64_t i : c.ints)
      t.add_int32_data(static_cast<int32_t>(i));
    return t;
  }
  switch (c.type) {
  case DType::F32:
    for (double f : c.floats)
      t.add_float_data(static_cast<float>(f));
    break;
  case DType::F64:
    for (double f : c.floats)
      t.add_double_data(f);
    break;
  case DType::I64:
    for (int64_t i : c.ints)
      t.add_int64_data(i);
    break;
  case DType::U32:
  case DType::U64:
    for (int64_t i : c.ints)
      t.add_uint64_data(static_cast<uint64_t>(i));
    break;
  default:
    return createStringError(inconvertibleErrorCode(),
                             "constant '%s' of type %s, folded at compile time, cannot be stored",
                             v.name.c_str(), dtypeName(c.type).str().c_str());
  }
  return t;
}

} // namespace

StringRef gradientOf(StringRef name) {
  if (!name.consume_front("grad:"))
    return "";
  size_t hash = name.rfind('#');
  if (hash != StringRef::npos && hash + 1 < name.size() &&
      all_of(name.drop_front(hash + 1), [](char c) { return isDigit(c); }))
    return name.take_front(hash);
  return name;
}

std::set<std::string> valuesWithGradients(const Backward &backward) {
  std::set<std::string> out;
  for (const auto *lists : {&backward.inputGrad, &backward.weightGrad})
    for (const auto &list : *lists)
      for (const onnx::NodeProto &n : list)
        for (const std::string &o : n.output())
          if (StringRef v = gradientOf(o); !v.empty())
            out.insert(v.str());
  return out;
}

bool sendsGradient(const Graph &graph, int id, const std::set<std::string> *flowing) {
  const Value &v = graph.values[id];
  // A value computed from weights that a later stage reads (it is sent on
  // with the activations) sends back its gradient when one flows.
  bool derived = v.kind == ValueKind::Weight && v.producer >= 0 && flowing;
  return (v.kind == ValueKind::Activation || derived) && isFloatDType(v.type) &&
         (!flowing || flowing->count(v.name));
}

namespace {

/// Whether \p op, a Slice of \p v, drops leading positions of a dimension
/// other than the first (the batch): labels[:, 1:], the shift by which a
/// causal language model compares logits at t with tokens at t + 1.
bool dropsLeadingPositions(const Graph &graph, const Op &op, int v) {
  if (!op.is(OpId::Slice) || op.inputs.empty() || op.inputs[0] != v)
    return false;
  int rank = static_cast<int>(graph.values[v].shape.size());
  std::vector<int64_t> starts, axes;
  if (op.inputs.size() > 1) {
    auto read = [&](size_t i, std::vector<int64_t> &out) {
      if (i >= op.inputs.size() || op.inputs[i] < 0)
        return i != 1; // starts are required
      auto c = graph.readConstant(op.inputs[i], 16);
      if (!c) {
        llvm::consumeError(c.takeError());
        return false;
      }
      out = (*c)->ints;
      return true;
    };
    if (!read(1, starts) || !read(3, axes))
      return false;
  } else {
    starts = attrInts(graph.node(op), "starts").value_or(std::vector<int64_t>{});
    axes = attrInts(graph.node(op), "axes").value_or(std::vector<int64_t>{});
  }
  for (size_t i = 0; i < starts.size(); ++i) {
    int64_t axis = axes.empty() ? static_cast<int64_t>(i) : axes[i];
    if (axis < 0)
      axis += rank;
    if (axis > 0 && starts[i] >= 1)
      return true;
  }
  return false;
}

/// Synthetic-data range of integer graph input \p id: the table size when it
/// indexes a Gather or a contrib op's embedding or cache, the class count
/// when it labels a cross-entropy, looking through ops that move values
/// without changing them (labels are often shifted by a Slice and flattened
/// first). \p stream is what a token stream feeds it: TOKENS for ids that
/// index a table (a candidate: addDataInputs keeps those of the vocabulary)
/// and for labels shifted on their way to the loss, NEXT_TOKENS for labels
/// the loss reads as they are.
int64_t syntheticHigh(const Graph &graph, int id, const Backward *backward, int64_t &tableRows,
                      plan::DataInput::Stream &stream) {
  // Contrib ops that index tables (op, index input, table input, whether
  // the table is the vocabulary): EmbedLayerNormalization's input_ids,
  // segment_ids and position_ids (word, segment and position embeddings),
  // RotaryEmbedding's position_ids (the cos cache).
  static const std::tuple<OpId, size_t, size_t, bool> contribTables[] = {
      {OpId::MsEmbedLayerNormalization, 0, 2, true},
      {OpId::MsEmbedLayerNormalization, 1, 4, false},
      {OpId::MsEmbedLayerNormalization, 8, 3, false},
      {OpId::MsRotaryEmbedding, 1, 2, false}};
  stream = plan::DataInput::NOT_TOKENS;
  auto labels = [&](bool shifted, int64_t classes) {
    stream = shifted ? plan::DataInput::TOKENS : plan::DataInput::NEXT_TOKENS;
    return classes;
  };
  std::vector<int> work = {id};
  std::map<int, bool> shifted = {{id, false}};
  while (!work.empty()) {
    int v = work.back();
    work.pop_back();
    for (int user : graph.values[v].users) {
      const Op &op = graph.ops[user];
      bool asData = !op.inputs.empty() && op.inputs[0] == v;
      if ((op.is(OpId::Gather) || op.is(OpId::TpGather)) && op.inputs.size() > 1 &&
          op.inputs[1] == v) {
        const Value &data = graph.values[op.inputs[0]];
        // A vocabulary-parallel table holds one rank's share of the rows.
        int64_t parts = op.is(OpId::TpGather) ? graph.tensorParallel : 1;
        int64_t axis = attrInt(graph.node(op), "axis", 0);
        if (axis < 0)
          axis += static_cast<int64_t>(data.shape.size());
        if (axis >= 0 && axis < static_cast<int64_t>(data.shape.size())) {
          stream = plan::DataInput::TOKENS;
          return tableRows = data.shape[axis] * parts;
        }
      }
      for (const auto &[type, index, table, words] : contribTables) {
        if (!op.is(type) || op.inputs.size() <= std::max(index, table) || op.inputs[index] != v ||
            op.inputs[table] < 0)
          continue;
        const Value &rows = graph.values[op.inputs[table]];
        if (!rows.shape.empty()) {
          stream = words ? plan::DataInput::TOKENS : plan::DataInput::NOT_TOKENS;
          return tableRows = rows.shape[0];
        }
      }
      if ((op.is(OpId::SoftmaxCrossEntropyLoss) || op.is(OpId::NegativeLogLikelihoodLoss) ||
           op.is(OpId::TpSoftmaxCrossEntropyLoss)) &&
          op.inputs.size() > 1 && op.inputs[1] == v) {
        // The vocabulary-parallel loss reads one rank's share of the classes.
        const Value &scores = graph.values[op.inputs[0]];
        int64_t parts = op.is(OpId::TpSoftmaxCrossEntropyLoss) ? graph.tensorParallel : 1;
        if (scores.shape.size() > 1)
          return labels(shifted[v], scores.shape[1] * parts);
      }
      // Ops that keep or move elements without computing new ones (labels
      // are often shifted by a Slice and flattened first; transformers pads
      // them with the ignored index before it slices).
      if ((op.has(SameElements) || op.has(MovesElements) || op.is(OpId::Pad)) &&
          (asData || op.is(OpId::Concat)))
        for (int out : op.outputs)
          if (out >= 0 && !shifted.count(out)) {
            shifted[out] = shifted[v] || dropsLeadingPositions(graph, op, v);
            work.push_back(out);
          }
    }
    if (backward)
      for (const onnx::NodeProto &n : backward->lossForward)
        if (isOp(n, OpId::SoftmaxCrossEntropyLoss) && n.input_size() > 1 &&
            n.input(1) == graph.values[v].name) {
          int scores = graph.findValue(n.input(0));
          if (scores >= 0 && graph.values[scores].shape.size() > 1)
            return labels(shifted[v], graph.values[scores].shape[1]);
        }
  }
  return 2;
}

/// Whether the importer binds symbolic dimension \p name at \p position from
/// the batch: bindSymbolicDim under bindings in which only the batch rule
/// gives -1.
bool boundFromBatch(StringRef name, size_t position) {
  ShapeBindings probe;
  probe.batch = -1;
  probe.seq = -2;
  probe.past = -4;
  std::optional<int64_t> bound = bindSymbolicDim(probe, name, position);
  return bound && *bound == -1;
}

/// The dimension of graph input or output \p name that holds the samples:
/// the first one the model declares symbolic and the importer binds from the
/// batch (past_0 [2, batch_size, heads, past, head] gives 1). std::nullopt
/// when the model declares none (fixed shapes, a time-major sequence), or
/// when it lies past \p rank.
std::optional<int>
declaredBatchAxis(const google::protobuf::RepeatedPtrField<onnx::ValueInfoProto> &declared,
                  const std::string &name, size_t rank) {
  for (const onnx::ValueInfoProto &info : declared) {
    if (info.name() != name)
      continue;
    if (!info.type().has_tensor_type() || !info.type().tensor_type().has_shape())
      return std::nullopt;
    const auto &dims = info.type().tensor_type().shape().dim();
    for (int i = 0; i < dims.size() && static_cast<size_t>(i) < rank; ++i)
      if (!(dims[i].has_dim_value() && dims[i].dim_value() >= 0) &&
          boundFromBatch(dims[i].dim_param(), i))
        return i;
    return std::nullopt;
  }
  return std::nullopt;
}

/// A Sum that adds \p value's gradient contributions: grad:V from grad:V#K.
bool isCombiner(const onnx::NodeProto &n, StringRef value) {
  if (!isOp(n, OpId::Sum) || n.output_size() != 1 || n.output(0) != "grad:" + value.str())
    return false;
  return all_of(n.input(), [&](const std::string &in) {
    return StringRef(in).startswith("grad:" + value.str() + "#");
  });
}

/// A stage's backward nodes, before they are re-cut at its boundaries.
struct BackwardLists {
  /// Its layers' input- and weight-gradient nodes, layers last to first.
  std::vector<onnx::NodeProto> input, weight;
  /// The values they make (gradient contributions made here), and those of
  /// them made in the weight pass.
  std::set<std::string> local, localInW;

  /// The Sum combining \p value's contributions, if one is here.
  onnx::NodeProto *combiner(StringRef value) {
    for (auto *list : {&input, &weight})
      for (onnx::NodeProto &n : *list)
        if (isCombiner(n, value))
          return &n;
    return nullptr;
  }
  /// The contributions made here to each value's gradient, in name order
  /// (indexLocal fills it once local is complete: asking per weight by
  /// scanning local made stage building quadratic).
  std::map<std::string, std::vector<std::string>, std::less<>> byValue;
  void indexLocal() {
    for (const std::string &name : local)
      if (StringRef v = gradientOf(name); !v.empty())
        byValue[v.str()].push_back(name);
  }
  /// The contributions to \p value's gradient made here.
  std::vector<std::string> contributions(StringRef value) const {
    auto it = byValue.find(value);
    return it == byValue.end() ? std::vector<std::string>() : it->second;
  }
};

/// Builds one stage's program: its boundaries, its forward nodes (and the
/// loss on the last stage), its outputs and, with a backward program, its
/// backward nodes and gradient sums.
class StageBuilder {
public:
  StageBuilder(const Graph &graph, const LayerGraph &layers, const Backward *backward,
               const std::set<std::string> *flowing, int stage, int stages)
      : graph(graph), layers(layers), backward(backward), flowing(flowing), k(stage),
        last(stage + 1 == stages), stages(stages) {}

  /// Fills \p sp for the stage's layers [\p first, \p lastLayer].
  Error build(plan::StageProgram &sp, int first, int lastLayer);

  /// The graph inputs the stage loads, and the weights and constants it
  /// reads (by name and value id).
  std::set<std::string> loads, weights;
  std::set<int> weightIds;

private:
  void addBoundaries(plan::StageProgram &sp, int first, int lastLayer);
  Error addForward(plan::StageProgram &sp, int first, int lastLayer);
  /// Appends \p node to \p sp's forward after resolving what it reads.
  Error addForwardNode(plan::StageProgram &sp, onnx::NodeProto node);
  /// Where the stage gets \p name from: computed here, received, loaded, or
  /// a weight; an error when another stage computes it and does not send it.
  Error resolve(const std::string &name, bool backwardRead);
  Error addBackward(plan::StageProgram &sp, int first, int lastLayer);
  /// Tensors sent on: their later users' gradient arrives as grad-next:V.
  void readGradientsOfSent(BackwardLists &lists) const;
  /// Received tensors send back their gradient; \p zeroShaped gets those
  /// whose gradient is all zeros (shaped like the value).
  Error addInputGrads(plan::StageProgram &sp, BackwardLists &lists,
                      std::set<std::string> &zeroShaped) const;
  /// Weights: each stage accumulates its own contributions. Returns the
  /// outputs of the Sums dropped because some of their terms are remote.
  std::set<std::string> addWeightGrads(plan::StageProgram &sp, BackwardLists &lists) const;
  /// The backward nodes, each read checked, and what backward keeps from
  /// forward.
  Error addBackwardNodes(plan::StageProgram &sp, BackwardLists &lists,
                         const std::set<std::string> &dropped,
                         const std::set<std::string> &zeroShaped);

  const Graph &graph;
  const LayerGraph &layers;
  const Backward *backward;
  const std::set<std::string> *flowing;
  /// The stage's index, whether it is the last, and how many there are.
  int k;
  bool last;
  int stages;
  std::set<std::string> recv, sendWithGrad;
  /// The values forward computes.
  std::set<std::string> produced;
  /// The forward program being built: values computed from weights and
  /// constants alone that another stage computes and does not send are
  /// computed here again.
  plan::StageProgram *forwardOut = nullptr;
};

Error StageBuilder::build(plan::StageProgram &sp, int first, int lastLayer) {
  sp.set_stage(k);
  addBoundaries(sp, first, lastLayer);
  if (Error err = addForward(sp, first, lastLayer))
    return err;
  for (int l = first; l <= lastLayer; ++l)
    for (int opIndex : layers.layers[l].ops)
      for (int out : graph.ops[opIndex].outputs)
        if (out >= 0 && graph.values[out].isGraphOutput)
          sp.add_outputs(graph.values[out].name);
  if (backward)
    if (Error err = addBackward(sp, first, lastLayer))
      return err;
  for (const std::string &name : loads)
    sp.add_loads(name);
  for (const std::string &name : weights)
    sp.add_weights(name);
  return Error::success();
}

/// Boundaries, as lowering sends them.
void StageBuilder::addBoundaries(plan::StageProgram &sp, int first, int lastLayer) {
  int numLayers = static_cast<int>(layers.layers.size());
  std::vector<int> recvIds, sendIds;
  if (first > 0)
    recvIds = layers.crossingAfter(first - 1);
  if (lastLayer + 1 < numLayers && k + 1 < stages)
    sendIds = layers.crossingAfter(lastLayer);
  for (int id : recvIds) {
    recv.insert(graph.values[id].name);
    sp.add_recv(graph.values[id].name);
  }
  for (int id : sendIds) {
    sp.add_send(graph.values[id].name);
    if (sendsGradient(graph, id, flowing))
      sendWithGrad.insert(graph.values[id].name);
  }
}

Error StageBuilder::resolve(const std::string &name, bool backwardRead) {
  if (name.empty() || produced.count(name) || recv.count(name))
    return Error::success();
  int id = graph.findValue(name);
  if (id < 0)
    return stageError(k, formatv("reads '{0}', which no stage computes", name));
  const Value &v = graph.values[id];
  if (v.kind == ValueKind::Input) {
    loads.insert(name);
    return Error::success();
  }
  if (v.producer < 0) {
    weights.insert(name);
    weightIds.insert(id);
    return Error::success();
  }
  // A value computed from weights and constants alone that no gradient
  // reaches (a causal mask too large to fold at compile time, shared by every
  // block): this stage computes it again rather than receive it.
  if (!backwardRead && forwardOut && v.kind != ValueKind::Activation &&
      v.kind != ValueKind::Input && !(flowing && flowing->count(name))) {
    return addForwardNode(*forwardOut, nodeOf(graph, graph.ops[v.producer]));
  }
  return stageError(k, formatv("{0} reads '{1}', computed on another stage and not sent here",
                               backwardRead ? "backward" : "forward", name));
}

Error StageBuilder::addForwardNode(plan::StageProgram &sp, onnx::NodeProto node) {
  for (const std::string &in : node.input())
    if (Error err = resolve(in, false))
      return err;
  for (const std::string &out : node.output())
    if (!out.empty())
      produced.insert(out);
  *sp.add_forward() = std::move(node);
  return Error::success();
}

/// Forward: the layers' ops, then the loss on the last stage.
Error StageBuilder::addForward(plan::StageProgram &sp, int first, int lastLayer) {
  forwardOut = &sp;
  for (int l = first; l <= lastLayer; ++l)
    for (int opIndex : layers.layers[l].ops)
      if (!graph.ops[opIndex].dead)
        if (Error err = addForwardNode(sp, nodeOf(graph, graph.ops[opIndex])))
          return err;
  if (!last || !backward)
    return Error::success();
  for (const onnx::NodeProto &n : backward->lossForward) {
    for (const std::string &in : n.input())
      if (Error err = resolve(in, false))
        return err;
    for (const std::string &out : n.output())
      produced.insert(out);
    *sp.add_forward() = n;
  }
  if (!produced.count(backward->lossValue))
    return stageError(
        k, formatv("the loss '{0}' is not computed on the last stage", backward->lossValue));
  return Error::success();
}

Error StageBuilder::addBackward(plan::StageProgram &sp, int first, int lastLayer) {
  BackwardLists lists;
  for (int l = lastLayer; l >= first; --l) {
    lists.input.insert(lists.input.end(), backward->inputGrad[l].begin(),
                       backward->inputGrad[l].end());
    lists.weight.insert(lists.weight.end(), backward->weightGrad[l].begin(),
                        backward->weightGrad[l].end());
  }
  for (const auto *list : {&lists.input, &lists.weight})
    for (const onnx::NodeProto &n : *list)
      for (const std::string &out : n.output()) {
        lists.local.insert(out);
        if (list == &lists.weight)
          lists.localInW.insert(out);
      }
  lists.indexLocal();
  readGradientsOfSent(lists);
  std::set<std::string> zeroShaped;
  if (Error err = addInputGrads(sp, lists, zeroShaped))
    return err;
  std::set<std::string> dropped = addWeightGrads(sp, lists);
  for (const RunningStat &r : backward->runningStats)
    if (r.layer >= first && r.layer <= lastLayer) {
      plan::RunningStat &stat = *sp.add_running_stats();
      stat.set_buffer(r.buffer);
      stat.set_statistic(r.statistic);
      stat.set_momentum(r.momentum);
    }
  return addBackwardNodes(sp, lists, dropped, zeroShaped);
}

void StageBuilder::readGradientsOfSent(BackwardLists &lists) const {
  std::map<std::string, std::string> rename;
  for (const std::string &v : sendWithGrad) {
    std::string next = receivedGradName(v);
    if (onnx::NodeProto *sum = lists.combiner(v)) {
      std::vector<std::string> keep;
      for (const std::string &in : sum->input())
        if (lists.local.count(in))
          keep.push_back(in);
      keep.push_back(next);
      sum->clear_input();
      for (const std::string &in : keep)
        sum->add_input(in);
    } else if (!lists.local.count("grad:" + v)) {
      rename["grad:" + v] = next;
    }
  }
  for (auto *list : {&lists.input, &lists.weight})
    for (onnx::NodeProto &n : *list)
      for (std::string &in : *n.mutable_input())
        if (auto it = rename.find(in); it != rename.end())
          in = it->second;
}

Error StageBuilder::addInputGrads(plan::StageProgram &sp, BackwardLists &lists,
                                  std::set<std::string> &zeroShaped) const {
  for (const std::string &v : recv) {
    int id = graph.findValue(v);
    if (id < 0 || !sendsGradient(graph, id, flowing))
      continue;
    plan::GradSum &g = *sp.add_input_grads();
    g.set_value(v);
    std::vector<std::string> terms;
    if (lists.combiner(v))
      terms = {"grad:" + v};
    else
      terms = lists.contributions(v);
    for (const std::string &t : terms)
      if (lists.localInW.count(t))
        return stageError(k, formatv("the gradient of boundary tensor '{0}' is computed in "
                                     "the weight pass",
                                     v));
    if (sendWithGrad.count(v) && !lists.combiner(v))
      terms.push_back(receivedGradName(v));
    if (terms.empty())
      zeroShaped.insert(v); // the zeros sent back take V's shape
    for (const std::string &t : terms)
      g.add_terms(t);
  }
  return Error::success();
}

std::set<std::string> StageBuilder::addWeightGrads(plan::StageProgram &sp,
                                                   BackwardLists &lists) const {
  std::set<std::string> dropped;
  for (const auto &entry : backward->weightGrads) {
    const std::string &w = entry.first;
    std::vector<std::string> terms = lists.contributions(w);
    if (terms.empty())
      continue;
    if (onnx::NodeProto *sum = lists.combiner(w)) {
      bool allLocal =
          all_of(sum->input(), [&](const std::string &in) { return lists.local.count(in) > 0; });
      if (allLocal) {
        terms = {"grad:" + w};
      } else {
        dropped.insert(sum->output(0));
        terms.clear();
        for (const std::string &in : sum->input())
          if (lists.local.count(in))
            terms.push_back(in);
      }
    }
    plan::GradSum &g = *sp.add_weight_grads();
    g.set_value(w);
    for (const std::string &t : terms)
      g.add_terms(t);
  }
  return dropped;
}

Error StageBuilder::addBackwardNodes(plan::StageProgram &sp, BackwardLists &lists,
                                     const std::set<std::string> &dropped,
                                     const std::set<std::string> &zeroShaped) {
  std::set<std::string> made, keep;
  for (const std::string &v : sendWithGrad)
    made.insert(receivedGradName(v));
  for (auto *list : {&lists.input, &lists.weight}) {
    auto *target =
        list == &lists.input ? sp.mutable_backward_input() : sp.mutable_backward_weight();
    for (onnx::NodeProto &n : *list) {
      if (n.output_size() == 1 && dropped.count(n.output(0)))
        continue;
      for (const std::string &in : n.input()) {
        if (in.empty() || made.count(in))
          continue;
        if (produced.count(in) || recv.count(in)) {
          keep.insert(in);
          continue;
        }
        if (Error err = resolve(in, true))
          return err;
        if (loads.count(in))
          keep.insert(in);
      }
      for (const std::string &out : n.output())
        made.insert(out);
      *target->Add() = std::move(n);
    }
  }
  for (const auto *sums : {&sp.input_grads(), &sp.weight_grads()})
    for (const plan::GradSum &g : *sums)
      for (const std::string &t : g.terms())
        if (!made.count(t))
          return stageError(k, formatv("the gradient of '{0}' needs '{1}', which the stage "
                                       "does not compute",
                                       g.value(), t));
  for (const plan::RunningStat &r : sp.running_stats())
    if (!made.count(r.statistic()))
      return stageError(k, formatv("the running statistic of '{0}' needs '{1}', which the "
                                   "stage does not compute",
                                   r.buffer(), r.statistic()));
  keep.insert(zeroShaped.begin(), zeroShaped.end());
  for (const std::string &name : keep)
    sp.add_keep(name);
  return Error::success();
}

/// Which weights train, by structure: every float initializer the loss
/// depends on through differentiable ops (those the differentiate pass gave
/// a gradient), but those matching \p freeze. A note says what trains and
/// why each other float initializer the stages read does not.
void addTrainable(plan::Plan &plan, const Graph &graph, const Backward &backward,
                  const std::set<int> &weightIds, StringRef freeze) {
  std::optional<llvm::Regex> frozen;
  if (!freeze.empty())
    frozen.emplace(freeze);
  std::vector<std::string> byFreeze, tables, noPath, running;
  std::set<std::string> runningBuffers;
  for (const RunningStat &r : backward.runningStats)
    runningBuffers.insert(r.buffer);
  for (const auto &entry : backward.weightGrads) {
    const std::string &w = entry.first;
    if (frozen && frozen->match(w))
      byFreeze.push_back(w);
    else
      plan.add_trainable(w);
  }
  for (int id : weightIds) {
    const Value &v = graph.values[id];
    if (v.producer >= 0 || v.kind != ValueKind::Weight || !isFloatDType(v.type) ||
        backward.weightGrads.count(v.name))
      continue;
    (runningBuffers.count(v.name)          ? running
     : backward.tableWeights.count(v.name) ? tables
                                           : noPath)
        .push_back(v.name);
  }
  std::string note = formatv("trains {0} weight(s)", plan.trainable_size()).str();
  if (!byFreeze.empty())
    note += "; not trained, matching --freeze: " + join(byFreeze, ", ");
  if (!tables.empty())
    note += "; not trained, rotary tables (frequencies read through Sin/Cos, or the cosine and "
            "sine the exporter folded from them): " +
            join(tables, ", ");
  if (!running.empty())
    note += "; not trained, running statistics each step updates from its batches' mean and "
            "variance: " +
            join(running, ", ");
  if (!noPath.empty())
    note += "; not trained, the loss does not depend on them through differentiable ops "
            "(shapes, masks, comparisons), they hold one entry per sample (a batch's "
            "attention mask, a folded zeros_like), they are masks (filled with infinities "
            "or the lowest float) or Constant nodes of one value (a computed zeros): " +
            join(noPath, ", ");
  if (!byFreeze.empty() || !tables.empty() || !running.empty() || !noPath.empty())
    plan.add_warnings(note);
}

/// Token ids are the inputs that index the vocabulary: a table of as many
/// rows as the loss has classes, or, with no labels to say, the largest
/// table an input indexes. Position ids index a table too (a Gather of the
/// position embedding) and get no tokens from a stream.
void keepVocabularyIds(plan::Plan &plan) {
  int64_t vocabulary = 0;
  for (const plan::DataInput &d : plan.data())
    if (d.stream() != plan::DataInput::NOT_TOKENS && d.index_rows() == 0)
      vocabulary = std::max(vocabulary, d.high()); // labels: the class count
  if (vocabulary == 0)
    for (const plan::DataInput &d : plan.data())
      if (d.stream() == plan::DataInput::TOKENS)
        vocabulary = std::max(vocabulary, d.index_rows());
  for (plan::DataInput &d : *plan.mutable_data())
    if (d.stream() == plan::DataInput::TOKENS && d.index_rows() > 0 && d.index_rows() != vocabulary)
      d.set_stream(plan::DataInput::NOT_TOKENS);
}

/// What a step feeds: the graph inputs the stages load (\p loadedBy: the
/// first stage that loads each).
void addDataInputs(plan::Plan &plan, const Graph &graph, const Backward *backward,
                   const std::map<std::string, int> &loadedBy) {
  for (int id : graph.inputs) {
    const Value &v = graph.values[id];
    auto it = loadedBy.find(v.name);
    if (it == loadedBy.end())
      continue;
    plan::DataInput &d = *plan.add_data();
    d.set_name(v.name);
    d.set_dtype(dtypeName(v.type).str());
    for (int64_t dim : v.shape)
      d.add_shape(dim);
    d.set_batch_axis(
        declaredBatchAxis(graph.model->graph().input(), v.name, v.shape.size()).value_or(0));
    // One microbatch on one replica holds the whole batch: an input that is
    // not a stack of microbatch samples (another batch dimension, or a
    // scalar) is fed as it is.
    const plan::ScheduleInfo &s = plan.schedule();
    if (s.microbatches() == 1 && s.data_parallel() <= 1 &&
        (v.shape.empty() || v.shape[d.batch_axis()] != s.microbatch_size()))
      d.set_whole(true);
    d.set_role(it->second == 0 || plan.stages_size() == 1 ? "input" : "labels");
    if (isIntegerDType(v.type)) {
      std::string lower = StringRef(v.name).lower();
      d.set_ones(StringRef(lower).contains("mask"));
      int64_t tableRows = 0;
      plan::DataInput::Stream stream = plan::DataInput::NOT_TOKENS;
      d.set_high(syntheticHigh(graph, id, backward, tableRows, stream));
      d.set_index_rows(tableRows);
      d.set_stream(stream);
    }
  }
  keepVocabularyIds(plan);
}

/// The graph outputs and the dimension each stacks its microbatches along.
void addOutputs(plan::Plan &plan, const Graph &graph) {
  for (int id : graph.outputs) {
    const Value &v = graph.values[id];
    plan::TensorRef &t = *plan.add_outputs();
    t.set_name(v.name);
    t.set_dtype(dtypeName(v.type).str());
    for (int64_t dim : v.shape)
      t.add_shape(dim);
    t.set_bytes(v.byteSize());
    // Outputs the model declares without a batch dimension stack along
    // dimension 0 as before (fixed batch in the file); only scalars have none.
    std::optional<int> axis =
        declaredBatchAxis(graph.model->graph().output(), v.name, v.shape.size());
    plan.add_output_batch_axes(axis ? *axis : (v.shape.empty() ? -1 : 0));
  }
}

} // namespace

namespace {

/// Fills \p sp's `recompute`: the kept values its first \p recomputed of
/// \p layerCount layers (from \p first) make; all of them, with the loss's,
/// when every layer recomputes.
void markRecomputed(plan::StageProgram &sp, const Graph &graph, const LayerGraph &layers, int first,
                    int recomputed, int layerCount) {
  std::set<std::string> made;
  if (recomputed >= layerCount) {
    for (const onnx::NodeProto &n : sp.forward())
      made.insert(n.output().begin(), n.output().end());
  } else {
    for (int l = first; l < first + recomputed; ++l)
      for (int opIndex : layers.layers[l].ops)
        for (int out : graph.ops[opIndex].outputs)
          made.insert(graph.values[out].name);
  }
  for (const std::string &v : sp.keep())
    if (made.count(v))
      sp.add_recompute(v);
}

} // namespace

Error buildStagePrograms(plan::Plan &plan, const Graph &graph, const LayerGraph &layers,
                         const Backward *backward, StringRef freeze) {
  int stages = plan.stages_size();
  plan.set_opset(graph.opsetFor(""));
  std::set<int> weightIds;
  std::map<std::string, int> loadedBy; // graph input -> first stage that loads it
  std::set<std::string> flowing;
  if (backward)
    flowing = valuesWithGradients(*backward);
  const std::set<std::string> *flowingPtr = backward ? &flowing : nullptr;
  for (int k = 0; k < stages; ++k) {
    const plan::Stage &stage = plan.stages(k);
    int first = stage.first_layer(), last = stage.last_layer();
    if (first > last)
      return stageError(k, "has no layers; running an empty stage is not supported");
    StageBuilder builder(graph, layers, backward, flowingPtr, k, stages);
    plan::StageProgram &sp = *plan.add_stage_programs();
    if (Error err = builder.build(sp, first, last))
      return err;
    if (backward && stage.recomputed_layers() > 0)
      markRecomputed(sp, graph, layers, first, stage.recomputed_layers(), last - first + 1);
    for (const std::string &name : builder.loads)
      loadedBy.emplace(name, k);
    weightIds.insert(builder.weightIds.begin(), builder.weightIds.end());
  }

  // Weights and constants, each once, and which of them train.
  for (int id : weightIds) {
    auto t = weightTensor(graph, id);
    if (!t)
      return t.takeError();
    *plan.add_weights() = std::move(*t);
  }
  if (backward) {
    addTrainable(plan, graph, *backward, weightIds, freeze);
    plan.set_loss_value(backward->lossValue);
    plan.set_loss_reduction(backward->lossCountValue.empty() ? "mean" : "token-mean");
    plan.set_loss_count_value(backward->lossCountValue);
  }
  addDataInputs(plan, graph, backward, loadedBy);
  addOutputs(plan, graph);
  return Error::success();
}

} // namespace pipec
