//===- OpCosts.cpp - The cost rules and their table ----------------------===//
#include "compiler/cost/OpCosts.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>

using namespace llvm;

namespace pipec {
namespace {

int64_t elements(const Graph &graph, int id) {
  return id >= 0 && graph.values[id].shapeKnown ? graph.values[id].numElements() : 0;
}

int64_t outputElements(const Graph &graph, const Op &op) {
  int64_t n = 0;
  for (int id : op.outputs)
    n += elements(graph, id);
  return n;
}

int64_t inputElements(const Graph &graph, const Op &op, size_t input) {
  return input < op.inputs.size() ? elements(graph, op.inputs[input]) : 0;
}

const std::vector<int64_t> &inputShape(const Graph &graph, const Op &op, size_t input) {
  static const std::vector<int64_t> empty;
  if (input >= op.inputs.size() || op.inputs[input] < 0)
    return empty;
  return graph.values[op.inputs[input]].shape;
}

bool isWeight(const Graph &graph, int id) {
  return id >= 0 && graph.values[id].kind == ValueKind::Weight;
}

bool isActivation(const Graph &graph, int id) {
  return id >= 0 && (graph.values[id].kind == ValueKind::Activation ||
                     graph.values[id].kind == ValueKind::Input);
}

/// Reads, computes and writes everything once.
void forwardBytes(const OpTraffic &t, OpCost &cost) {
  cost.bytes[Forward] = t.in + t.weights + t.out;
}

} // namespace

namespace cost {

// Backward halves -------------------------------------------------------------

void PointwiseBackward::cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  cost.flops[BackwardInput] = cost.flops[Forward];
  cost.bytes[BackwardInput] = t.in + 2 * t.out;
  if (t.anyWeight) {
    cost.flops[BackwardWeight] = t.outElems;
    cost.bytes[BackwardWeight] = t.out + t.weights;
  }
}

void DefaultBackward::cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  cost.defaulted = true;
  cost.flops[BackwardInput] = cost.flops[Forward];
  cost.bytes[BackwardInput] = t.in + t.out;
}

void MovementBackward::cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  cost.bytes[BackwardInput] = t.in + t.out;
}

void ViewBackward::cost(const Graph &, const Op &, const OpTraffic &, OpCost &) {}

void GatherBackward::cost(const Graph &graph, const Op &op, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  bool table = !op.inputs.empty() && isWeight(graph, op.inputs[0]);
  cost.flops[BackwardInput] = table ? cost.flops[Forward] : 0;
  cost.flops[BackwardWeight] = table ? t.outElems : 0;
  // Gathering activations: the gradient is a scatter.
  cost.bytes[BackwardInput] = table ? 0 : 2 * t.out;
  cost.bytes[BackwardWeight] = table ? 2 * t.out : 0;
}

template <bool Bias>
void MatMulBackward<Bias>::cost(const Graph &graph, const Op &op, const OpTraffic &t,
                                OpCost &cost) {
  forwardBytes(t, cost);
  int activations = 0;
  for (size_t i = 0; i < std::min<size_t>(2, op.inputs.size()); ++i)
    activations += isActivation(graph, op.inputs[i]);
  bool bias = Bias && op.inputs.size() > 2;
  double gemm = cost.flops[Forward] - (bias ? t.outElems : 0);
  cost.flops[BackwardInput] = gemm * activations;
  cost.flops[BackwardWeight] = gemm * (2 - activations) + (t.anyWeight && bias ? t.outElems : 0);
  cost.bytes[BackwardInput] = activations ? t.out + t.in + t.weights : 0;
  cost.bytes[BackwardWeight] = activations < 2 ? t.out + t.in + t.weights : 0;
  cost.gemms = {1, double(activations), double(2 - activations)};
}

void EinsumBackward::cost(const Graph &graph, const Op &op, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  int activations = 0, weights = 0;
  for (int id : op.inputs) {
    activations += isActivation(graph, id);
    weights += isWeight(graph, id);
  }
  cost.flops[BackwardInput] = cost.flops[Forward] * activations;
  cost.flops[BackwardWeight] = cost.flops[Forward] * weights;
  cost.bytes[BackwardInput] = activations ? t.out + t.in + t.weights : 0;
  cost.bytes[BackwardWeight] = weights ? t.out + t.in + t.weights : 0;
  cost.gemms = {1, double(activations), double(weights)};
}

void ConvBackward::cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  cost.flops[BackwardInput] = cost.flops[Forward];
  cost.flops[BackwardWeight] = t.anyWeight ? cost.flops[Forward] : 0;
  cost.bytes[BackwardInput] = t.out + t.in + t.weights;
  cost.bytes[BackwardWeight] = t.anyWeight ? t.out + t.in + t.weights : 0;
  cost.gemms = {1, 1, t.anyWeight ? 1.0 : 0.0};
}

void AttentionBackward::cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  cost.flops[BackwardInput] = 2 * cost.flops[Forward];
  cost.flops[BackwardWeight] = t.anyWeight ? cost.flops[Forward] / 2 : 0;
  cost.bytes[BackwardInput] = 2 * (t.in + t.out);
  cost.bytes[BackwardWeight] = t.anyWeight ? t.in + t.out + t.weights : 0;
  // Q K^T and P V; for I the scores again, and dP, dQ, dK, dV.
  cost.gemms = {2, 6, t.anyWeight ? 1.0 : 0.0};
}

// Forward halves --------------------------------------------------------------

template <int K> int64_t Pointwise<K>::flops(const Graph &graph, const Op &op) {
  return K * outputElements(graph, op);
}

int64_t Default::flops(const Graph &graph, const Op &op) { return outputElements(graph, op); }

int64_t Movement::flops(const Graph &, const Op &) { return 0; }

int64_t View::flops(const Graph &, const Op &) { return 0; }

template <int K> int64_t Gather<K>::flops(const Graph &graph, const Op &op) {
  return op.outputs.empty() ? 0 : K * elements(graph, op.outputs[0]);
}

int64_t Select::flops(const Graph &graph, const Op &op) { return Reduce::flops(graph, op); }

int64_t MatMul::flops(const Graph &graph, const Op &op) {
  const auto &a = inputShape(graph, op, 0);
  int64_t k = a.empty() ? 1 : a.back();
  return 2 * elements(graph, op.outputs[0]) * k;
}

int64_t Gemm::flops(const Graph &graph, const Op &op) {
  const auto &a = inputShape(graph, op, 0);
  bool transA = attrInt(graph.node(op), "transA", 0) != 0;
  int64_t k = a.size() == 2 ? (transA ? a[0] : a[1]) : 1;
  int64_t flops = 2 * elements(graph, op.outputs[0]) * k;
  if (op.inputs.size() > 2 && op.inputs[2] >= 0)
    flops += elements(graph, op.outputs[0]);
  return flops;
}

int64_t Einsum::flops(const Graph &graph, const Op &op) {
  std::string equation = attrString(graph.node(op), "equation", "");
  SmallVector<StringRef, 4> terms;
  StringRef(equation).split("->").first.split(terms, ',');
  // The size of each letter, and of each dimension '...' spans, counted
  // from the last (operands broadcast right-aligned).
  std::map<char, int64_t> letters;
  std::vector<int64_t> spanned;
  for (size_t i = 0; i < terms.size() && i < op.inputs.size(); ++i) {
    const auto &shape = inputShape(graph, op, i);
    int64_t named = llvm::count_if(
        terms[i], [](char c) { return std::isalpha(static_cast<unsigned char>(c)); });
    int64_t span = std::max<int64_t>(0, static_cast<int64_t>(shape.size()) - named);
    size_t d = 0;
    for (size_t k = 0; k < terms[i].size() && d < shape.size(); ++k) {
      char c = terms[i][k];
      if (std::isalpha(static_cast<unsigned char>(c))) {
        letters[c] = std::max(letters[c], shape[d++]);
      } else if (c == '.' && terms[i].substr(k).startswith("...")) {
        spanned.resize(std::max<size_t>(spanned.size(), span), 1);
        for (int64_t j = span - 1; j >= 0; --j)
          spanned[j] = std::max(spanned[j], shape[d++]);
        k += 2;
      }
    }
  }
  int64_t points = 1;
  for (const auto &[letter, size] : letters)
    points *= size;
  for (int64_t size : spanned)
    points *= size;
  return (terms.size() > 1 ? 2 : 1) * points;
}

int64_t Conv::flops(const Graph &graph, const Op &op) { return flopsWith(graph, op, 1); }

int64_t Conv::flopsWith(const Graph &graph, const Op &op, size_t weight) {
  // Cin / groups * prod(kernel): every dimension of W but the first.
  const auto &w = inputShape(graph, op, weight);
  int64_t kernel = 1;
  for (size_t i = 1; i < w.size(); ++i)
    kernel *= w[i];
  return 2 * elements(graph, op.outputs[0]) * kernel;
}

int64_t ConvTranspose::flops(const Graph &graph, const Op &op) {
  const auto &w = inputShape(graph, op, 1);
  int64_t group = attrInt(graph.node(op), "group", 1);
  int64_t cout = w.size() > 1 ? w[1] * group : 1;
  int64_t spatial = 1;
  for (size_t i = 2; i < w.size(); ++i)
    spatial *= w[i];
  return 2 * inputElements(graph, op, 0) * cout * spatial / std::max<int64_t>(1, group);
}

template <bool Projection> int64_t Attention<Projection>::flops(const Graph &graph, const Op &op) {
  // Q K^T and P V: 4 * B * heads * S * T * head_dim.
  // ONNX's own Attention (no projection) also takes [batch, heads, sequence,
  // head] and reads the keys' length from K.
  const auto &x = inputShape(graph, op, 0);
  bool heads = !Projection && x.size() == 4;
  if (x.size() != 3 && !heads)
    return outputElements(graph, op);
  int64_t batch = x[0], seq = heads ? x[2] : x[1], width = x.back();
  int64_t total = seq;
  if (!Projection) {
    const auto &k = inputShape(graph, op, 1);
    if (k.size() == x.size())
      total = k[heads ? 2 : 1];
  }
  if (op.outputs.size() > 1 && op.outputs[1] >= 0) {
    const auto &present = graph.values[op.outputs[1]].shape;
    if (present.size() >= 2)
      total = present[present.size() - 2];
  }
  int64_t attnWidth = elements(graph, op.outputs[0]) / std::max<int64_t>(1, batch * seq);
  int64_t flops = 4 * batch * seq * total * attnWidth + 5 * batch * seq * total;
  if (Projection) {
    const auto &w = inputShape(graph, op, 1);
    if (w.size() == 2)
      flops += 2 * batch * seq * width * w[1];
  }
  return flops;
}

namespace {

/// heads x m x n, and k and d, of a fused attention; nullopt when its
/// shapes are not those of ops/Attention.h.
struct ScoresShape {
  int64_t scores, k, d;
};
std::optional<ScoresShape> scoresShape(const Graph &graph, const Op &op) {
  const auto &q = inputShape(graph, op, 0), &kt = inputShape(graph, op, 1),
             &v = inputShape(graph, op, 2);
  if (q.size() < 2 || kt.size() != q.size() || v.size() != q.size())
    return std::nullopt;
  int64_t scores = q[q.size() - 2] * kt.back();
  for (size_t i = 0; i + 2 < q.size(); ++i)
    scores *= q[i];
  return ScoresShape{scores, q.back(), v.back()};
}

} // namespace

int64_t ScoresAttention::flops(const Graph &graph, const Op &op) {
  std::optional<ScoresShape> s = scoresShape(graph, op);
  return s ? s->scores * (2 * (s->k + s->d) + ExpFlops) : outputElements(graph, op);
}

void ScoresAttention::cost(const Graph &graph, const Op &op, const OpTraffic &t, OpCost &cost) {
  forwardBytes(t, cost);
  std::optional<ScoresShape> s = scoresShape(graph, op);
  cost.flops[BackwardInput] =
      s ? static_cast<double>(s->scores * (2 * (3 * s->k + 2 * s->d) + ExpFlops + 5))
        : 2 * cost.flops[Forward];
  cost.flops[BackwardWeight] = 0;
  // Reads Q, Kt, V, O, dO and the masks; writes dQ, dKt and dV.
  cost.bytes[BackwardInput] = 2 * (t.in + t.out);
  cost.bytes[BackwardWeight] = 0;
  cost.gemms = {2, 5, 0.0};
}

template <int K> int64_t Norm<K>::flops(const Graph &graph, const Op &op) {
  return op.outputs.empty() ? 0 : K * elements(graph, op.outputs[0]);
}

int64_t Reduce::flops(const Graph &graph, const Op &op) {
  int64_t in = 0;
  for (int id : op.inputs)
    in = std::max(in, elements(graph, id));
  return in;
}

int64_t Pool::flops(const Graph &graph, const Op &op) {
  auto kernel = attrInts(graph.node(op), "kernel_shape").value_or(std::vector<int64_t>{});
  int64_t k = 1;
  for (int64_t d : kernel)
    k *= d;
  return outputElements(graph, op) * k;
}

template <int K> int64_t Loss<K>::flops(const Graph &graph, const Op &op) {
  return K * inputElements(graph, op, 0);
}

int64_t Variadic::flops(const Graph &graph, const Op &op) {
  return outputElements(graph, op) *
         std::max<int64_t>(1, static_cast<int64_t>(op.inputs.size()) - 1);
}

int64_t Opaque::flops(const Graph &graph, const Op &op) { return outputElements(graph, op); }

} // namespace cost

namespace {

/// A rule as a pair of functions.
struct CostRule {
  int64_t (*flops)(const Graph &, const Op &);
  void (*cost)(const Graph &, const Op &, const OpTraffic &, OpCost &);
};

/// The rule of each row of Ops.def, indexed by OpId.
const CostRule rules[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, ...)                        \
  {&cost::COST::flops, &cost::COST::cost},
#include "ops/Ops.def"
};

const CostRule &ruleOf(const Graph &graph, const Op &op) {
  static const CostRule fallback = {&cost::Default::flops, &cost::Default::cost};
  const OpDef *def = lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
  return def ? rules[static_cast<size_t>(def->id)] : fallback;
}

} // namespace

int64_t forwardFlops(const Graph &graph, const Op &op) {
  return ruleOf(graph, op).flops(graph, op);
}

void applyCostRule(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost) {
  ruleOf(graph, op).cost(graph, op, traffic, cost);
}

} // namespace pipec
