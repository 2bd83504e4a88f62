//===- Differentiate.cpp - The walk from the loss back, and the I / W split ===//
//
// One walk over the layers from last to first and, inside a layer, over its
// ops in reverse topological order. By the time an op is reached every user
// of its outputs has been visited, so the outputs' gradients are complete:
// they are summed (if there are several contributions) and the op's rule
// (passes/grad/, chosen by Ops.def's GRAD column) emits the contributions to
// its inputs' gradients.
//
//===----------------------------------------------------------------------===//
#include "passes/Differentiate.h"
#include "passes/grad/GradContext.h"
#include "passes/grad/GradRules.h"

#include "ops/Attention.h"
#include "ops/OpRegistry.h"
#include "support/Attributes.h"
#include "support/Diagnostics.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <map>

using namespace llvm;

namespace pipec {
namespace {

using grad::GradContext;
using grad::GradRule;

/// Whether initializer \p id holds one entry per sample of the batch: it has
/// the graph inputs' \p batch in dimension 0, and every op reading it is an
/// element-wise Add, Sub, Mul or Div with an activation of its rank that has
/// the batch in dimension 0 too, or a ScatterElements or ScatterND that
/// scatters such an activation into it. Exporters bake a batch's attention
/// mask in that way ([batch, 1, seq, seq] of 0 and the lowest float), and
/// fold zeros_like of an activation (a MoE block's dense gates, [batch, seq,
/// experts] of zeros); a parameter is shared by the samples and broadcasts
/// along the batch instead. Such data is not trained.
bool perSample(const Graph &graph, int id, int64_t batch) {
  const Value &v = graph.values[id];
  if (v.shape.size() < 2 || batch <= 1 || v.shape[0] != batch || v.users.empty())
    return false;
  for (int user : v.users) {
    const Op &op = graph.ops[user];
    if (op.dead)
      continue;
    if ((op.is(OpId::ScatterElements) || op.is(OpId::ScatterND)) && op.inputs.size() == 3 &&
        op.inputs[0] == id && op.inputs[2] >= 0 && op.inputs[2] != id) {
      const Value &updates = graph.values[op.inputs[2]];
      if (updates.kind == ValueKind::Activation && !updates.shape.empty() &&
          updates.shape[0] == batch)
        continue;
      return false;
    }
    if (op.inputs.size() != 2 ||
        (!op.is(OpId::Add) && !op.is(OpId::Sub) && !op.is(OpId::Mul) && !op.is(OpId::Div)))
      return false;
    int other = op.inputs[0] == id ? op.inputs[1] : op.inputs[0];
    if (other < 0 || other == id)
      return false;
    const Value &o = graph.values[other];
    if (o.kind != ValueKind::Activation || o.shape.size() != v.shape.size() || o.shape[0] != batch)
      return false;
  }
  return true;
}

/// Whether initializer \p id is a mask: read only by Add, Sub, Where, Min or
/// Max, and holding an infinity or a magnitude of 1e30 or more somewhere
/// (exporters fill masks with the lowest float, -3.4e38). No parameter holds
/// such values; a causal mask an exporter folded into an initializer does,
/// and is not trained.
/// Whether every live read of \p id is as a step tensor of fused attention
/// (ops/Attention.h: a mask or bias, which fuse-attention takes only where
/// it carries no gradient).
bool readAsAttentionStep(const Graph &graph, int id) {
  const Value &v = graph.values[id];
  bool any = false;
  for (int user : v.users) {
    const Op &op = graph.ops[user];
    if (op.dead)
      continue;
    if (!op.is(OpId::ScaledDotProductAttention))
      return false;
    for (size_t i = 0; i < op.inputs.size(); ++i)
      if (op.inputs[i] == id && i < attention::FirstTensor)
        return false;
    any = true;
  }
  return any;
}

bool holdsMaskFill(const Graph &graph, int id) {
  const Value &v = graph.values[id];
  if (v.users.empty() || v.numElements() > (int64_t(1) << 26))
    return false;
  for (int user : v.users) {
    const Op &op = graph.ops[user];
    if (op.dead)
      continue;
    if (!op.is(OpId::Add) && !op.is(OpId::Sub) && !op.is(OpId::Where) && !op.is(OpId::Min) &&
        !op.is(OpId::Max))
      return false;
  }
  auto t = graph.readConstant(id, int64_t(1) << 26);
  if (!t) {
    consumeError(t.takeError());
    return false;
  }
  for (double x : (*t)->floats)
    if (!std::isfinite(x) || std::abs(x) >= 1e30)
      return true;
  return false;
}

/// Whether Constant node tensor \p id is a fill: rank 2 or more, one value
/// everywhere. An exporter writes what the model computed as torch.zeros of
/// an activation's shape so (T5's cross-attention position bias); it
/// writes parameters as initializers.
bool computedFill(const Graph &graph, int id) {
  const Value &v = graph.values[id];
  if (v.shape.size() < 2 || v.numElements() < 2 || v.numElements() > (int64_t(1) << 26))
    return false;
  auto t = graph.readConstant(id, int64_t(1) << 26);
  if (!t) {
    consumeError(t.takeError());
    return false;
  }
  const std::vector<double> &x = (*t)->floats;
  return !x.empty() && all_of(x, [&](double e) { return e == x[0]; });
}

/// Initializers that hold the cosine and the sine of the same angles: pairs
/// of one shape (rank 2 or more) with c^2 + s^2 = 1 in every element and
/// values other than 0 and +-1. They are rotary position tables, which an
/// exporter's constant folding computed from Sin and Cos of constants (torch's
/// dynamo export does for Llama, Gemma, Qwen, Falcon); like the inputs of Sin
/// and Cos (the Table flag) they get no gradient. No pair of trained
/// parameters holds such values, and a fresh model's norm scales and biases
/// (ones and zeros, of rank 1) are no such pair. So is one initializer that
/// holds both halves, sines and cosines, along its last axis.
std::vector<int> foldedRotaryTables(const Graph &graph) {
  constexpr int64_t kMaxElements = int64_t(1) << 22;
  std::map<std::vector<int64_t>, std::vector<int>> byShape;
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    // A fill holds one value: no angles.
    if (value.kind != ValueKind::Weight || value.producer >= 0 || value.users.empty() ||
        !isFloatDType(value.type) || value.shape.size() < 2 || graph.isFillWeight(int(v)))
      continue;
    int64_t n = 1;
    for (int64_t d : value.shape)
      n *= d;
    if (n >= 4 && n <= kMaxElements)
      byShape[value.shape].push_back(static_cast<int>(v));
  }
  std::vector<int> tables;
  for (const auto &[shape, ids] : byShape) {
    if (ids.size() > 32)
      continue;
    std::vector<std::shared_ptr<const ConstTensor>> read;
    for (int id : ids) {
      auto t = graph.readConstant(id, kMaxElements);
      if (!t) {
        consumeError(t.takeError());
        read.push_back(nullptr);
        continue;
      }
      // An angle's cosine or sine takes values strictly between 0 and 1 in
      // magnitude somewhere.
      bool varied = false;
      for (double x : (*t)->floats)
        varied |= std::abs(x) > 1e-3 && std::abs(x) < 1 - 1e-3;
      read.push_back(varied ? *t : nullptr);
    }
    // One table of both, the sines then the cosines along its last axis
    // (GPT-J's embed_positions, split where it is read).
    int64_t last = shape.back();
    for (size_t i = 0; i < ids.size() && last % 2 == 0; ++i) {
      if (!read[i])
        continue;
      const std::vector<double> &x = read[i]->floats;
      bool unit = true;
      for (size_t k = 0; k < x.size() && unit; k += last)
        for (int64_t j = 0; j < last / 2 && unit; ++j) {
          double a = x[k + j], b = x[k + last / 2 + j];
          unit = std::abs(a * a + b * b - 1) <= 1e-5;
        }
      if (unit)
        tables.push_back(ids[i]);
    }
    for (size_t i = 0; i < ids.size(); ++i)
      for (size_t j = i + 1; j < ids.size(); ++j) {
        if (!read[i] || !read[j] || read[i]->floats.size() != read[j]->floats.size())
          continue;
        const std::vector<double> &c = read[i]->floats, &s = read[j]->floats;
        bool unit = true;
        for (size_t k = 0; k < c.size() && unit; ++k)
          unit = std::abs(c[k] * c[k] + s[k] * s[k] - 1) <= 1e-5;
        if (unit) {
          tables.push_back(ids[i]);
          tables.push_back(ids[j]);
        }
      }
  }
  return tables;
}

} // namespace

std::vector<bool> dataWeights(const Graph &graph) {
  int64_t batch = 0; // the graph inputs' first dimension
  for (int id : graph.inputs)
    if (!graph.values[id].shape.empty())
      batch = std::max(batch, graph.values[id].shape[0]);
  std::vector<bool> data(graph.values.size(), false);
  for (int id : foldedRotaryTables(graph))
    data[id] = true;
  int initializers = graph.model ? graph.model->graph().initializer_size() : 0;
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    if (value.kind == ValueKind::Weight && value.producer < 0 && isFloatDType(value.type) &&
        (perSample(graph, static_cast<int>(v), batch) ||
         readAsAttentionStep(graph, static_cast<int>(v)) ||
         holdsMaskFill(graph, static_cast<int>(v)) ||
         (value.tensorIndex >= initializers && !graph.isFillWeight(static_cast<int>(v)) &&
          computedFill(graph, static_cast<int>(v)))))
      data[v] = true;
  }
  return data;
}

namespace {

/// Which values carry a gradient, and the inputs of Table ops that get none.
struct GradientPath {
  std::vector<bool> needsGrad;
  std::vector<int> tables;
};

/// Marks the float values computed from a trainable weight (a float
/// initializer that is not per-sample data) or, with \p graphInputGrads,
/// from a float graph input, through the inputs that carry a gradient by
/// their op's rule.
GradientPath markGradientPath(const Graph &graph, bool graphInputGrads) {
  GradientPath path;
  std::vector<bool> &needsGrad = path.needsGrad;
  needsGrad.assign(graph.values.size(), false);
  std::vector<bool> isData = dataWeights(graph);
  for (int id : foldedRotaryTables(graph))
    path.tables.push_back(id);
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    bool trainable = value.kind == ValueKind::Weight && value.producer < 0 && !isData[v] &&
                     isFloatDType(value.type);
    bool input = graphInputGrads && value.kind == ValueKind::Input;
    needsGrad[v] = isFloatDType(value.type) && (trainable || input);
  }
  // An op flagged Table (Sin, Cos) passes none into an input that no graph
  // input reaches: such an input is a table computed from constants.
  std::vector<bool> fromData(graph.values.size(), false);
  for (size_t v = 0; v < graph.values.size(); ++v)
    fromData[v] = graph.values[v].kind == ValueKind::Input;
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    const OpDef *def = lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
    const GradRule &rule = grad::gradRuleOf(def);
    bool any = false, data = false;
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      int in = op.inputs[i];
      if (in < 0)
        continue;
      data |= fromData[in];
      if (!needsGrad[in] || !rule.carries(i))
        continue;
      if (def && def->has(Table) && !fromData[in])
        path.tables.push_back(in);
      else
        any = true;
    }
    for (int o : op.outputs) {
      if (o < 0)
        continue;
      fromData[o] = data;
      if (any && isFloatDType(graph.values[o].type) && graph.values[o].kind != ValueKind::Constant)
        needsGrad[o] = true;
    }
  }
  return path;
}

} // namespace

std::vector<bool> gradientValues(const Graph &graph) {
  return markGradientPath(graph, /*graphInputGrads=*/false).needsGrad;
}

namespace {

class Differentiator {
public:
  Differentiator(const Graph &graph, const LayerGraph &layers, bool graphInputGrads)
      : graph(graph), layers(layers), graphInputGrads(graphInputGrads),
        ctx(graph, result, needsGrad) {}

  Expected<Backward> run(const LossSpec &loss);

private:
  const OpDef *defOf(const Op &op) const {
    return lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
  }
  Error seedLoss(const LossSpec &loss);
  void noteTableWeights(const std::vector<int> &tables);
  std::string countLabels(const Value &loss);
  Error differentiateOp(const Op &op);

  const Graph &graph;
  const LayerGraph &layers;
  bool graphInputGrads;
  Backward result;
  std::vector<bool> needsGrad;
  GradContext ctx;
  std::vector<int> layerOfOp;
};

Error Differentiator::seedLoss(const LossSpec &loss) {
  // An added loss over no named output reads the graph's first output
  // (tests of one-output graphs); a model's own loss is always named.
  std::string outName = loss.output;
  if (outName.empty() && loss.kind != LossSpec::Kind::ModelOutput && !graph.outputs.empty())
    outName = graph.values[graph.outputs.front()].name;
  int id = graph.findValue(outName);
  if (id < 0)
    return createStringError(inconvertibleErrorCode(), "loss: no value named '%s'",
                             outName.c_str());
  const Value &y = graph.values[id];
  if (!isFloatDType(y.type) || !y.shapeKnown)
    return createStringError(inconvertibleErrorCode(),
                             "loss: '%s' must be a float value of known shape", outName.c_str());
  if (!needsGrad[id])
    return createStringError(inconvertibleErrorCode(), "loss: '%s' does not depend on a weight",
                             outName.c_str());
  ctx.setLayer(y.producer >= 0 ? layerOfOp[y.producer] : 0);
  ctx.sinkFor(id);
  switch (loss.kind) {
  case LossSpec::Kind::ModelOutput:
    if (y.numElements() != 1)
      return createStringError(inconvertibleErrorCode(), "loss: '%s' is not a scalar (%s)",
                               outName.c_str(), formatShape(y.shape).c_str());
    result.lossValue = outName;
    {
      // A mean over counted labels is seeded with its count: the microbatch
      // then contributes its loss summed over its labels, and the step's
      // gradient divides by the labels counted in the whole step.
      std::string seed = countLabels(y);
      ctx.sinkFor(id);
      if (seed.empty())
        seed = ctx.constScalar(1.0, y.type);
      ctx.addContribution(id, y.shape.empty() ? seed : ctx.reshape(seed, y.shape));
    }
    return Error::success();
  case LossSpec::Kind::Mse: {
    // Forward: loss = ReduceMean((y - labels)^2) over all elements.
    ctx.sinkTo(result.lossForward);
    std::string diff = ctx.binary("Sub", outName, loss.labels);
    std::string sq = ctx.binary("Mul", diff, diff);
    onnx::NodeProto &mean = ctx.emit("ReduceMean", {sq});
    GradContext::setInt(mean, "keepdims", 0);
    mean.set_output(0, "pipec:loss");
    ctx.sinkFor(id);
    result.lossValue = "pipec:loss";
    // dy = 2 (y - labels) / N.
    std::string d = ctx.binary("Sub", outName, loss.labels);
    ctx.addContribution(
        id, ctx.binary("Mul", d, ctx.constScalar(2.0 / double(y.numElements()), y.type)));
    return Error::success();
  }
  case LossSpec::Kind::SoftmaxCrossEntropy: {
    ctx.sinkTo(result.lossForward);
    onnx::NodeProto &ce = ctx.emit("SoftmaxCrossEntropyLoss", {outName, loss.labels});
    GradContext::setString(ce, "reduction", "mean");
    ce.set_output(0, "pipec:loss");
    ctx.sinkFor(id);
    result.lossValue = "pipec:loss";
    onnx::NodeProto &grad = ctx.emit("SoftmaxCrossEntropyLossGrad",
                                     {ctx.constScalar(1.0, y.type), outName, loss.labels}, "pipec");
    GradContext::setString(grad, "reduction", "mean");
    ctx.addContribution(id, GradContext::out(grad));
    return Error::success();
  }
  }
  llvm_unreachable("unknown loss kind");
}

/// Records in Backward::tableWeights the initializers \p tables are
/// computed from.
void Differentiator::noteTableWeights(const std::vector<int> &tables) {
  std::vector<int> work = tables;
  std::vector<bool> seen(graph.values.size(), false);
  while (!work.empty()) {
    int v = work.back();
    work.pop_back();
    if (v < 0 || seen[v])
      continue;
    seen[v] = true;
    const Value &value = graph.values[v];
    if (value.producer < 0) {
      if (value.kind == ValueKind::Weight && isFloatDType(value.type))
        result.tableWeights.insert(value.name);
      continue;
    }
    for (int in : graph.ops[value.producer].inputs)
      work.push_back(in);
  }
}

/// When \p loss is a mean over labels that may be ignored (a
/// SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss of reduction "mean"
/// with an ignore_index and no class weights, directly), emits into the
/// loss's forward the number of labels it counts, "pipec:loss_count" (of the
/// loss's type), and returns it; else returns "".
std::string Differentiator::countLabels(const Value &loss) {
  if (loss.producer < 0)
    return "";
  const Op &op = graph.ops[loss.producer];
  if ((!op.is(OpId::SoftmaxCrossEntropyLoss) && !op.is(OpId::NegativeLogLikelihoodLoss) &&
       !op.is(OpId::TpSoftmaxCrossEntropyLoss)) ||
      op.inputs.size() != 2 || op.outputs.empty() || op.outputs[0] != graph.findValue(loss.name))
    return "";
  const onnx::NodeProto &node = graph.node(op);
  if (attrString(node, "reduction", "mean") != "mean" || !findAttr(node, "ignore_index"))
    return "";
  int64_t ignore = attrInt(node, "ignore_index", 0);
  const std::string &labels = graph.values[op.inputs[1]].name;
  ctx.sinkTo(result.lossForward);
  // Each emit may move the nodes emitted before: a node is finished before
  // the next is emitted.
  auto cast = [&](const std::string &x, DType to) {
    onnx::NodeProto &node = ctx.emit("Cast", {x});
    GradContext::setInt(node, "to", static_cast<int64_t>(to));
    return GradContext::out(node);
  };
  std::string wide = cast(labels, DType::I64);
  std::string ignoreValue = ctx.constInts({ignore});
  std::string counted = ctx.unary("Not", ctx.binary("Equal", wide, ignoreValue));
  std::string ones = cast(counted, loss.type);
  onnx::NodeProto &sum = ctx.emit("ReduceSum", {ones});
  GradContext::setInt(sum, "keepdims", 0);
  sum.set_output(0, "pipec:loss_count");
  result.lossCountValue = "pipec:loss_count";
  return result.lossCountValue;
}

Error Differentiator::differentiateOp(const Op &op) {
  const OpDef *def = defOf(op);
  const GradRule &rule = grad::gradRuleOf(def);
  // Output gradients, complete now: the op's users have all been visited.
  bool anyGrad = false;
  for (int o : op.outputs) {
    if (o < 0)
      continue;
    ctx.sinkFor(o);
    ctx.finalize(o);
    anyGrad |= !ctx.gradientOf(o).empty();
  }
  ctx.beginOp(op, rule, def);
  bool anyWanted = false;
  for (size_t i = 0; i < op.inputs.size(); ++i)
    anyWanted |= ctx.wants(i);
  if (!anyGrad || !anyWanted)
    return Error::success();

  for (int i : op.inputs)
    if (i >= 0 && needsGrad[i] && !graph.values[i].shapeKnown)
      return ctx.error("input '" + graph.values[i].name + "' has no static shape");
  if (!rule.allOutputs)
    for (size_t k = 1; k < op.outputs.size(); ++k)
      if (!ctx.dyOf(k).empty())
        return ctx.error("gradient through output " + Twine(k) + " is not implemented");
  if (ctx.dy().empty() && !rule.allOutputs)
    return Error::success();
  return rule.apply(ctx);
}

Expected<Backward> Differentiator::run(const LossSpec &loss) {
  size_t numLayers = layers.layers.size();
  result.inputGrad.resize(numLayers);
  result.weightGrad.resize(numLayers);
  layerOfOp.assign(graph.ops.size(), 0);
  for (size_t l = 0; l < numLayers; ++l)
    for (int op : layers.layers[l].ops)
      layerOfOp[op] = static_cast<int>(l);

  GradientPath path = markGradientPath(graph, graphInputGrads);
  needsGrad = std::move(path.needsGrad);
  noteTableWeights(path.tables);
  std::vector<bool> crossing(graph.values.size(), false);
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    if (value.kind != ValueKind::Weight || value.producer < 0 || !needsGrad[v])
      continue;
    for (int user : value.users)
      if (!graph.ops[user].dead && layerOfOp[user] != layerOfOp[value.producer])
        crossing[v] = true;
  }
  ctx.setCrossing(std::move(crossing));
  ctx.setOpLayers(layerOfOp);

  if (Error err = seedLoss(loss))
    return err;
  for (int l = static_cast<int>(numLayers) - 1; l >= 0; --l) {
    ctx.setLayer(l);
    const std::vector<int> &ops = layers.layers[l].ops;
    for (auto it = ops.rbegin(); it != ops.rend(); ++it)
      if (Error err = differentiateOp(graph.ops[*it]))
        return err;
    // Running statistics, in graph order within the layer.
    for (int id : ops) {
      const Op &op = graph.ops[id];
      const OpDef *def = defOf(op);
      const GradRule &rule = grad::gradRuleOf(def);
      if (op.dead || !rule.statistics)
        continue;
      ctx.sinkTo(result.weightGrad[l]);
      ctx.beginOp(op, rule, def);
      if (Error err = rule.statistics(ctx))
        return err;
    }
  }
  // A running buffer belongs to one node: exporters share equal tensors
  // (a fresh model's zero means), which then need copies of their own.
  std::stable_sort(result.runningStats.begin(), result.runningStats.end(),
                   [](const RunningStat &a, const RunningStat &b) { return a.layer < b.layer; });
  std::map<std::string, const RunningStat *> keeper;
  for (const RunningStat &r : result.runningStats) {
    auto [it, fresh] = keeper.emplace(r.buffer, &r);
    if (!fresh && it->second->node == r.node)
      return createStringError(inconvertibleErrorCode(),
                               "node '%s' (BatchNormalization): initializer '%s' is both its "
                               "running mean and variance",
                               r.node.c_str(), r.buffer.c_str());
    if (!fresh)
      return createStringError(
          inconvertibleErrorCode(),
          "initializer '%s' is the running statistic of BatchNormalization nodes '%s' and "
          "'%s'; each needs its own (an exporter shared equal tensors: pass --untie %s)",
          r.buffer.c_str(), it->second->node.c_str(), r.node.c_str(), r.buffer.c_str());
  }
  // Leaves: trainable weights and graph inputs, summed in the lowest layer
  // that contributed.
  for (const auto &[id, contributed] : ctx.contributionLayers()) {
    const Value &value = graph.values[id];
    if (value.producer >= 0)
      continue;
    ctx.setLayer(*std::min_element(contributed.begin(), contributed.end()));
    ctx.sinkFor(id);
    ctx.finalize(id);
    if (value.kind == ValueKind::Weight)
      result.weightGrads[value.name] = ctx.gradientOf(id);
    else
      result.inputGrads[value.name] = ctx.gradientOf(id);
  }
  return std::move(result);
}

std::string describeValue(const Value &v) {
  return formatv("'{0}' {1}{2}", v.name, dtypeName(v.type), formatShape(v.shape, v.shapeKnown))
      .str();
}

std::string listValues(const Graph &graph, const std::vector<int> &ids) {
  std::vector<std::string> parts;
  for (int id : ids)
    parts.push_back(describeValue(graph.values[id]));
  return parts.empty() ? std::string("none") : join(parts, ", ");
}

StringRef lossFnName(LossSpec::Kind kind) {
  return kind == LossSpec::Kind::Mse ? "mse" : "cross-entropy";
}

/// The loss pipec adds (--loss-fn) over \p output against --labels.
Expected<LossChoice> addedLoss(const Graph &graph, const LossOptions &options, int output,
                               StringRef why) {
  StringRef fn = lossFnName(options.addedLoss);
  if (options.labels.empty())
    return usageError(formatv("--loss-fn {0} needs --labels INPUT: the graph input that holds "
                              "the labels",
                              fn));
  int labels = graph.findValue(options.labels);
  std::vector<int> inputs(graph.inputs.begin(), graph.inputs.end());
  if (labels < 0 || graph.values[labels].kind != ValueKind::Input)
    return usageError(formatv("--labels {0}: the model has no input '{0}' (inputs: {1})",
                              options.labels, listValues(graph, inputs)));
  const Value &l = graph.values[labels];
  bool crossEntropy = options.addedLoss == LossSpec::Kind::SoftmaxCrossEntropy;
  if (crossEntropy ? !isIntegerDType(l.type) : !isFloatDType(l.type))
    return usageError(formatv("--labels {0}: {1} needs {2} labels, and '{0}' is {3}",
                              options.labels, fn, crossEntropy ? "integer" : "float",
                              dtypeName(l.type)));
  LossChoice choice;
  choice.spec = LossSpec{options.addedLoss, graph.values[output].name, options.labels};
  choice.reason = formatv("{0} of output '{1}' against input '{2}' (--loss-fn {3}; {4})",
                          crossEntropy ? "softmax cross-entropy" : "mean squared error",
                          graph.values[output].name, options.labels, fn, why)
                      .str();
  return choice;
}

} // namespace

Expected<LossChoice> chooseLoss(const Graph &graph, const LossOptions &options) {
  bool adding = options.addedLoss != LossSpec::Kind::ModelOutput;
  if (!adding && !options.labels.empty())
    return usageError(formatv("--labels {0}: labels are read only by a loss pipec adds; give "
                              "--loss-fn cross-entropy|mse too",
                              options.labels));
  std::vector<bool> needsGrad = markGradientPath(graph, false).needsGrad;
  auto isScalar = [&](int id) {
    const Value &v = graph.values[id];
    return isFloatDType(v.type) && v.shapeKnown && v.numElements() == 1;
  };
  std::vector<int> outputs(graph.outputs.begin(), graph.outputs.end());
  std::vector<int> candidates, tensors;
  for (int id : outputs) {
    if (!needsGrad[id])
      continue;
    if (isScalar(id))
      candidates.push_back(id);
    else if (isFloatDType(graph.values[id].type))
      tensors.push_back(id);
  }

  if (!options.output.empty()) {
    auto it =
        llvm::find_if(outputs, [&](int id) { return graph.values[id].name == options.output; });
    if (it == outputs.end())
      return usageError(formatv("--loss {0}: the model has no output '{0}' (outputs: {1})",
                                options.output, listValues(graph, outputs)));
    const Value &v = graph.values[*it];
    if (!isFloatDType(v.type))
      return usageError(
          formatv("--loss {0}: the output is {1}, not a float", options.output, describeValue(v)));
    if (!needsGrad[*it])
      return usageError(formatv("--loss {0}: the output does not depend on any trainable weight",
                                options.output));
    if (adding)
      return addedLoss(graph, options, *it, "--loss chose the output");
    if (!isScalar(*it))
      return usageError(formatv("--loss {0}: the output is {1}, not a scalar; to add a loss over "
                                "it give --loss-fn cross-entropy|mse --labels INPUT",
                                options.output, describeValue(v)));
    LossChoice choice;
    choice.spec = LossSpec{LossSpec::Kind::ModelOutput, v.name, ""};
    choice.reason = formatv("the model's output '{0}' (chosen by --loss)", v.name).str();
    return choice;
  }

  if (adding) {
    if (!candidates.empty())
      return usageError(formatv("--loss-fn {0}: the model computes its own loss ({1}, a float "
                                "scalar that depends on the weights); drop --loss-fn, or add "
                                "the loss over another output with --loss NAME",
                                lossFnName(options.addedLoss), listValues(graph, candidates)));
    if (tensors.size() != 1)
      return usageError(formatv("--loss-fn {0}: which output? the model has {1} float outputs "
                                "that depend on the weights ({2}); choose one with --loss NAME",
                                lossFnName(options.addedLoss), tensors.size(),
                                listValues(graph, tensors)));
    return addedLoss(graph, options, tensors.front(),
                     "its one float output that depends on the weights");
  }

  LossChoice choice;
  if (candidates.size() > 1)
    return createStringError(inconvertibleErrorCode(),
                             "the model has %zu outputs that could be its loss (float scalars "
                             "that depend on the weights): %s; choose one with --loss NAME",
                             candidates.size(), listValues(graph, candidates).c_str());
  if (candidates.empty()) {
    choice.reason = formatv("no output is a float scalar that depends on the weights (outputs: "
                            "{0}); to train, give --loss-fn cross-entropy|mse --labels INPUT, "
                            "or compile with --mode infer",
                            listValues(graph, outputs))
                        .str();
    return choice;
  }
  const Value &v = graph.values[candidates.front()];
  choice.spec = LossSpec{LossSpec::Kind::ModelOutput, v.name, ""};
  choice.reason = formatv("the model's output '{0}', its one float scalar output that depends "
                          "on the weights",
                          v.name)
                      .str();
  return choice;
}

namespace {

/// Whether a Cast from \p from to \p to gives back every value exactly.
bool widensExactly(DType from, DType to) {
  bool half = from == DType::BF16 || from == DType::F16;
  return (half && (to == DType::F32 || to == DType::F64)) ||
         (from == DType::F32 && to == DType::F64);
}

/// The backward reads a widening Cast's input and widens it again where it
/// needs the wide value, instead of each microbatch keeping the wide copy:
/// the widening is exact, so the values are the same, and a microbatch
/// keeps 2 bytes an element (none when it keeps the narrow value anyway)
/// instead of 4. Autocast's casts before torch's float32 ops (GELU's Pow,
/// the loss's logits) are such; the fuse pass fuses the Cast into its
/// reader where that is element-wise (GPT-2's GELU backward: 2 of the
/// model's 7). Only in the Cast's own layer, whose stage holds its input.
void widenAgainInBackward(const Graph &graph, const LayerGraph &layers, Backward &backward) {
  for (size_t l = 0; l < layers.layers.size(); ++l) {
    std::map<std::string, int> wide; // wide value -> its Cast
    for (int o : layers.layers[l].ops) {
      const Op &op = graph.ops[o];
      if (op.dead || !op.is(OpId::Cast) || op.inputs.size() != 1 || op.outputs.size() != 1 ||
          op.inputs[0] < 0 || op.outputs[0] < 0)
        continue;
      const Value &x = graph.values[op.inputs[0]], &v = graph.values[op.outputs[0]];
      if (x.kind == ValueKind::Activation && !v.isGraphOutput && widensExactly(x.type, v.type))
        wide[v.name] = o;
    }
    if (wide.empty())
      continue;
    auto rewrite = [&](std::vector<onnx::NodeProto> &list, StringRef part) {
      std::map<std::string, std::string> again;
      std::vector<onnx::NodeProto> out;
      for (onnx::NodeProto &node : list) {
        for (int i = 0; i < node.input_size(); ++i) {
          auto it = wide.find(node.input(i));
          if (it == wide.end())
            continue;
          auto [name, fresh] =
              again.try_emplace(it->first, formatv("{0}.again.{1}{2}", it->first, part, l).str());
          if (fresh) {
            onnx::NodeProto cast = graph.node(graph.ops[it->second]);
            cast.set_name(name->second);
            cast.clear_output();
            cast.add_output(name->second);
            out.push_back(std::move(cast));
          }
          node.set_input(i, name->second);
        }
        out.push_back(std::move(node));
      }
      list = std::move(out);
    };
    rewrite(backward.inputGrad[l], "i");
    rewrite(backward.weightGrad[l], "w");
  }
}

} // namespace

Expected<Backward> differentiate(const Graph &graph, const LayerGraph &layers, const LossSpec &loss,
                                 bool graphInputGrads) {
  Differentiator d(graph, layers, graphInputGrads);
  auto backward = d.run(loss);
  if (backward)
    widenAgainInBackward(graph, layers, *backward);
  return backward;
}

namespace {

/// An attribute's value as the node line shows it; tensors and graphs by
/// their kind only.
std::string attributeText(const onnx::AttributeProto &a) {
  std::string text;
  raw_string_ostream os(text);
  auto list = [&](const auto &values, auto print) {
    os << "[";
    for (int i = 0; i < values.size(); ++i) {
      os << (i ? ", " : "");
      print(values.Get(i));
    }
    os << "]";
  };
  auto real = [&](float v) { os << format("%g", v); };
  switch (a.type()) {
  case onnx::AttributeProto::INT:
    os << a.i();
    break;
  case onnx::AttributeProto::FLOAT:
    real(a.f());
    break;
  case onnx::AttributeProto::STRING:
    os << '"' << a.s() << '"';
    break;
  case onnx::AttributeProto::INTS:
    list(a.ints(), [&](int64_t v) { os << v; });
    break;
  case onnx::AttributeProto::FLOATS:
    list(a.floats(), real);
    break;
  case onnx::AttributeProto::TENSOR:
    os << "<tensor>";
    break;
  default:
    os << "<" << onnx::AttributeProto::AttributeType_Name(a.type()) << ">";
    break;
  }
  return os.str();
}

void printNode(const onnx::NodeProto &node, StringRef prefix, raw_ostream &os) {
  os << prefix << join(node.output().begin(), node.output().end(), ", ") << " = ";
  if (!node.domain().empty())
    os << node.domain() << ".";
  os << node.op_type() << "(" << join(node.input().begin(), node.input().end(), ", ") << ")";
  if (node.attribute_size() > 0) {
    os << " {";
    for (int i = 0; i < node.attribute_size(); ++i)
      os << (i ? ", " : "") << node.attribute(i).name() << "=" << attributeText(node.attribute(i));
    os << "}";
  }
  os << "\n";
}

} // namespace

void printBackward(const Backward &backward, const LayerGraph &layers, raw_ostream &os) {
  size_t inputOps = 0, weightOps = 0;
  for (size_t l = 0; l < backward.inputGrad.size(); ++l) {
    inputOps += backward.inputGrad[l].size();
    weightOps += backward.weightGrad[l].size();
  }
  os << formatv("backward layers={0} loss={1} I-ops={2} W-ops={3} weights={4}\n",
                backward.inputGrad.size(), backward.lossValue, inputOps, weightOps,
                backward.weightGrads.size());
  if (!backward.lossForward.empty()) {
    os << "loss forward\n";
    for (const onnx::NodeProto &node : backward.lossForward)
      printNode(node, "  ", os);
  }
  for (size_t l = backward.inputGrad.size(); l-- > 0;) {
    os << formatv("layer {0} \"{1}\"\n", l, layers.layers[l].name);
    for (const onnx::NodeProto &node : backward.inputGrad[l])
      printNode(node, "  I ", os);
    for (const onnx::NodeProto &node : backward.weightGrad[l])
      printNode(node, "  W ", os);
  }
  for (const auto &[weight, gradient] : backward.weightGrads)
    os << "weight " << weight << " -> " << gradient << "\n";
  for (const auto &[input, gradient] : backward.inputGrads)
    os << "input " << input << " -> " << gradient << "\n";
}

} // namespace pipec
