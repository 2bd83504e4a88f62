//===- StagePrograms.cpp - What each stage of a plan executes -----------===//
#include "passes/StagePrograms.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

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
/// (passes may have rewired the op since import).
onnx::NodeProto nodeOf(const Graph &graph, const Op &op) {
  onnx::NodeProto node = graph.node(op);
  node.clear_input();
  for (int id : op.inputs)
    node.add_input(id >= 0 ? graph.values[id].name : "");
  node.clear_output();
  for (int id : op.outputs)
    node.add_output(id >= 0 ? graph.values[id].name : "");
  node.set_op_type(op.opType);
  node.set_domain(op.domain);
  if (node.name().empty())
    node.set_name(op.name);
  return node;
}

/// \p path relative to \p dir when it lies under it.
std::string relativeTo(StringRef path, StringRef dir) {
  if (!dir.empty() && path.startswith(dir) && path.size() > dir.size() &&
      sys::path::is_separator(path[dir.size()]))
    return path.drop_front(dir.size() + 1).str();
  return path.str();
}

/// The plan's copy of weight or constant \p id: a reference into the model's
/// files when its bytes live there, else the values.
Expected<onnx::TensorProto> weightTensor(const Graph &graph, int id) {
  const Value &v = graph.values[id];
  onnx::TensorProto t;
  if (v.storage) {
    t.set_name(v.name);
    t.set_data_type(static_cast<int32_t>(v.type));
    for (int64_t d : v.shape)
      t.add_dims(d);
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
  case DType::I32:
  case DType::I16:
  case DType::I8:
  case DType::U16:
  case DType::U8:
  case DType::Bool:
    for (int64_t i : c.ints)
      t.add_int32_data(static_cast<int32_t>(i));
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

/// "grad:V" or "grad:V#K" -> V; "" for any other name.
StringRef gradientOf(StringRef name) {
  if (!name.consume_front("grad:"))
    return "";
  size_t hash = name.rfind('#');
  if (hash != StringRef::npos && hash + 1 < name.size() &&
      all_of(name.drop_front(hash + 1), [](char c) { return isDigit(c); }))
    return name.take_front(hash);
  return name;
}

} // namespace

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
  return v.kind == ValueKind::Activation && isFloatDType(v.type) &&
         (!flowing || flowing->count(v.name));
}

namespace {

/// Synthetic-data range of integer graph input \p id: the table size when it
/// indexes a Gather or a contrib op's embedding or cache, the class count
/// when it labels a cross-entropy, looking through ops that move values
/// without changing them (labels are often shifted by a Slice and flattened
/// first).
int64_t syntheticHigh(const Graph &graph, int id, const Backward *backward) {
  static const std::set<std::string> passThrough = {"Slice",     "Reshape",  "Flatten", "Squeeze",
                                                    "Unsqueeze", "Identity", "Cast",    "Transpose",
                                                    "Expand",    "Concat",   "Split"};
  // Contrib ops that index tables (op, index input, table input):
  // EmbedLayerNormalization's input_ids, segment_ids and position_ids (word,
  // segment and position embeddings), RotaryEmbedding's position_ids (the
  // cos cache).
  static const std::tuple<StringRef, size_t, size_t> contribTables[] = {
      {"EmbedLayerNormalization", 0, 2},
      {"EmbedLayerNormalization", 1, 4},
      {"EmbedLayerNormalization", 8, 3},
      {"RotaryEmbedding", 1, 2}};
  std::vector<int> work = {id};
  std::set<int> seen = {id};
  while (!work.empty()) {
    int v = work.back();
    work.pop_back();
    for (int user : graph.values[v].users) {
      const Op &op = graph.ops[user];
      bool asData = !op.inputs.empty() && op.inputs[0] == v;
      if (op.opType == "Gather" && op.inputs.size() > 1 && op.inputs[1] == v) {
        const Value &data = graph.values[op.inputs[0]];
        int64_t axis = attrInt(graph.node(op), "axis", 0);
        if (axis < 0)
          axis += static_cast<int64_t>(data.shape.size());
        if (axis >= 0 && axis < static_cast<int64_t>(data.shape.size()))
          return data.shape[axis];
      }
      for (const auto &[type, index, table] : contribTables) {
        if (op.opType != type || op.domain != "com.microsoft" ||
            op.inputs.size() <= std::max(index, table) || op.inputs[index] != v ||
            op.inputs[table] < 0)
          continue;
        const Value &rows = graph.values[op.inputs[table]];
        if (!rows.shape.empty())
          return rows.shape[0];
      }
      if ((op.opType == "SoftmaxCrossEntropyLoss" || op.opType == "NegativeLogLikelihoodLoss") &&
          op.inputs.size() > 1 && op.inputs[1] == v) {
        const Value &scores = graph.values[op.inputs[0]];
        if (scores.shape.size() > 1)
          return scores.shape[1];
      }
      if (passThrough.count(op.opType) && (asData || op.opType == "Concat"))
        for (int out : op.outputs)
          if (out >= 0 && seen.insert(out).second)
            work.push_back(out);
    }
    if (backward)
      for (const onnx::NodeProto &n : backward->lossForward)
        if (n.op_type() == "SoftmaxCrossEntropyLoss" && n.input_size() > 1 &&
            n.input(1) == graph.values[v].name) {
          int scores = graph.findValue(n.input(0));
          if (scores >= 0 && graph.values[scores].shape.size() > 1)
            return graph.values[scores].shape[1];
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

} // namespace

Error buildStagePrograms(plan::Plan &plan, const Graph &graph, const LayerGraph &layers,
                         const Backward *backward, StringRef freeze) {
  int K = plan.stages_size();
  int numLayers = static_cast<int>(layers.layers.size());
  plan.set_opset(graph.opsetFor(""));
  std::set<int> weightIds;
  std::map<std::string, int> loadedBy; // graph input -> first stage that loads it
  std::set<std::string> flowing;
  if (backward)
    flowing = valuesWithGradients(*backward);
  const std::set<std::string> *flowingPtr = backward ? &flowing : nullptr;
  for (int k = 0; k < K; ++k) {
    const plan::Stage &stage = plan.stages(k);
    int a = stage.first_layer(), b = stage.last_layer();
    if (a > b)
      return stageError(k, "has no layers; running an empty stage is not supported");
    plan::StageProgram &sp = *plan.add_stage_programs();
    sp.set_stage(k);

    // Boundaries, as lowering sends them.
    std::vector<int> recvIds, sendIds;
    if (a > 0)
      recvIds = layers.crossingAfter(a - 1);
    if (b + 1 < numLayers && k + 1 < K)
      sendIds = layers.crossingAfter(b);
    std::set<std::string> recv, send, sendWithGrad;
    for (int id : recvIds) {
      recv.insert(graph.values[id].name);
      sp.add_recv(graph.values[id].name);
    }
    for (int id : sendIds) {
      send.insert(graph.values[id].name);
      sp.add_send(graph.values[id].name);
      if (sendsGradient(graph, id, flowingPtr))
        sendWithGrad.insert(graph.values[id].name);
    }

    // Forward: the layers' ops, then the loss on the last stage.
    std::set<std::string> produced, loads, weights;
    auto resolveForward = [&](const std::string &name, bool backwardRead) -> Error {
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
      return stageError(k, formatv("{0} reads '{1}', computed on another stage and not sent here",
                                   backwardRead ? "backward" : "forward", name));
    };
    for (int l = a; l <= b; ++l)
      for (int opIndex : layers.layers[l].ops) {
        const Op &op = graph.ops[opIndex];
        if (op.dead)
          continue;
        onnx::NodeProto node = nodeOf(graph, op);
        for (const std::string &in : node.input())
          if (Error err = resolveForward(in, false))
            return err;
        for (const std::string &out : node.output())
          if (!out.empty())
            produced.insert(out);
        *sp.add_forward() = std::move(node);
      }
    bool last = k + 1 == K;
    if (last && backward) {
      for (const onnx::NodeProto &n : backward->lossForward) {
        for (const std::string &in : n.input())
          if (Error err = resolveForward(in, false))
            return err;
        for (const std::string &out : n.output())
          produced.insert(out);
        *sp.add_forward() = n;
      }
      if (!produced.count(backward->lossValue))
        return stageError(
            k, formatv("the loss '{0}' is not computed on the last stage", backward->lossValue));
    }
    const std::set<std::string> &forwardValues = produced; // forward's, before backward
    for (int l = a; l <= b; ++l)
      for (int opIndex : layers.layers[l].ops)
        for (int out : graph.ops[opIndex].outputs)
          if (out >= 0 && graph.values[out].isGraphOutput)
            sp.add_outputs(graph.values[out].name);

    if (backward) {
      std::vector<onnx::NodeProto> inputList, weightList;
      for (int l = b; l >= a; --l) {
        inputList.insert(inputList.end(), backward->inputGrad[l].begin(),
                         backward->inputGrad[l].end());
        weightList.insert(weightList.end(), backward->weightGrad[l].begin(),
                          backward->weightGrad[l].end());
      }
      // Contributions made here, by value.
      std::set<std::string> local, localInW;
      for (const auto *list : {&inputList, &weightList})
        for (const onnx::NodeProto &n : *list)
          for (const std::string &out : n.output()) {
            local.insert(out);
            if (list == &weightList)
              localInW.insert(out);
          }
      auto isCombiner = [](const onnx::NodeProto &n, StringRef value) {
        if (n.op_type() != "Sum" || n.output_size() != 1 || n.output(0) != "grad:" + value.str())
          return false;
        return all_of(n.input(), [&](const std::string &in) {
          return StringRef(in).startswith("grad:" + value.str() + "#");
        });
      };
      auto findCombiner = [&](StringRef value) -> onnx::NodeProto * {
        for (auto *list : {&inputList, &weightList})
          for (onnx::NodeProto &n : *list)
            if (isCombiner(n, value))
              return &n;
        return nullptr;
      };
      auto contributions = [&](StringRef value) {
        std::vector<std::string> out;
        for (const std::string &name : local)
          if (gradientOf(name) == value)
            out.push_back(name);
        return out;
      };

      // Tensors sent on: their later users' gradient arrives as grad-next:V.
      std::map<std::string, std::string> rename;
      for (const std::string &v : sendWithGrad) {
        std::string next = "grad-next:" + v;
        if (onnx::NodeProto *sum = findCombiner(v)) {
          std::vector<std::string> keep;
          for (const std::string &in : sum->input())
            if (local.count(in))
              keep.push_back(in);
          keep.push_back(next);
          sum->clear_input();
          for (const std::string &in : keep)
            sum->add_input(in);
        } else if (!local.count("grad:" + v)) {
          rename["grad:" + v] = next;
        }
      }
      for (auto *list : {&inputList, &weightList})
        for (onnx::NodeProto &n : *list)
          for (std::string &in : *n.mutable_input())
            if (auto it = rename.find(in); it != rename.end())
              in = it->second;

      // Received tensors send back their gradient.
      std::set<std::string> zeroShaped;
      for (const std::string &v : recv) {
        int id = graph.findValue(v);
        if (id < 0 || !sendsGradient(graph, id, flowingPtr))
          continue;
        plan::GradSum &g = *sp.add_input_grads();
        g.set_value(v);
        std::vector<std::string> terms;
        if (findCombiner(v))
          terms = {"grad:" + v};
        else
          terms = contributions(v);
        for (const std::string &t : terms)
          if (localInW.count(t))
            return stageError(k, formatv("the gradient of boundary tensor '{0}' is computed in "
                                         "the weight pass",
                                         v));
        if (sendWithGrad.count(v) && !findCombiner(v))
          terms.push_back("grad-next:" + v);
        if (terms.empty())
          zeroShaped.insert(v); // the zeros sent back take V's shape
        for (const std::string &t : terms)
          g.add_terms(t);
      }

      // Weights: each stage accumulates its own contributions.
      std::set<std::string> dropped;
      for (const auto &entry : backward->weightGrads) {
        const std::string &w = entry.first;
        std::vector<std::string> terms = contributions(w);
        if (terms.empty())
          continue;
        if (onnx::NodeProto *sum = findCombiner(w)) {
          bool allLocal =
              all_of(sum->input(), [&](const std::string &in) { return local.count(in) > 0; });
          if (allLocal) {
            terms = {"grad:" + w};
          } else {
            dropped.insert(sum->output(0));
            terms.clear();
            for (const std::string &in : sum->input())
              if (local.count(in))
                terms.push_back(in);
          }
        }
        plan::GradSum &g = *sp.add_weight_grads();
        g.set_value(w);
        for (const std::string &t : terms)
          g.add_terms(t);
      }

      // Check every read and record what backward keeps from forward.
      std::set<std::string> made, keep;
      for (const std::string &v : sendWithGrad)
        made.insert("grad-next:" + v);
      for (auto *list : {&inputList, &weightList}) {
        auto *target =
            list == &inputList ? sp.mutable_backward_input() : sp.mutable_backward_weight();
        for (onnx::NodeProto &n : *list) {
          if (n.output_size() == 1 && dropped.count(n.output(0)))
            continue;
          for (const std::string &in : n.input()) {
            if (in.empty() || made.count(in))
              continue;
            if (forwardValues.count(in) || recv.count(in)) {
              keep.insert(in);
              continue;
            }
            if (Error err = resolveForward(in, true))
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
      keep.insert(zeroShaped.begin(), zeroShaped.end());
      for (const std::string &name : keep)
        sp.add_keep(name);
    }
    for (const std::string &name : loads) {
      sp.add_loads(name);
      loadedBy.emplace(name, k);
    }
    for (const std::string &name : weights)
      sp.add_weights(name);
  }

  // Weights and constants, each once, and which of them train.
  for (int id : weightIds) {
    auto t = weightTensor(graph, id);
    if (!t)
      return t.takeError();
    *plan.add_weights() = std::move(*t);
  }
  if (backward) {
    // Registered buffers look like weights in ONNX: float initializers. Those
    // named like one, and those the user freezes, are not trained.
    llvm::Regex buffer("(^|[./_])(inv_freq|cos_cached|sin_cached|cos_cache|sin_cache|"
                       "causal_mask|masked_bias|attn\\.bias)$");
    std::optional<llvm::Regex> frozen;
    if (!freeze.empty())
      frozen.emplace(freeze);
    std::vector<std::string> skipped;
    for (const auto &entry : backward->weightGrads) {
      const std::string &w = entry.first;
      if (buffer.match(w) || (frozen && frozen->match(w))) {
        skipped.push_back(w);
        continue;
      }
      plan.add_trainable(w);
    }
    if (!skipped.empty())
      plan.add_warnings("not trained (buffers by name" +
                        std::string(freeze.empty() ? "" : ", or --freeze") +
                        "): " + join(skipped, ", "));
  }
  if (backward) {
    plan.set_loss_value(backward->lossValue);
    plan.set_loss_reduction("mean");
  }

  // What a step feeds: the graph inputs the stages load.
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
    d.set_role(it->second == 0 || K == 1 ? "input" : "labels");
    if (isIntegerDType(v.type)) {
      std::string lower = StringRef(v.name).lower();
      d.set_ones(StringRef(lower).contains("mask"));
      d.set_high(syntheticHigh(graph, id, backward));
    }
  }
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
  return Error::success();
}

} // namespace pipec
