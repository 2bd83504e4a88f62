//===- ContribShapes.cpp - Shapes of onnxruntime's contrib ops ------------===//
//
// Shapes follow onnxruntime's ContribOperators.md.
//
//===----------------------------------------------------------------------===//
#include "passes/ContribShapes.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>

using namespace llvm;

namespace pipec {
namespace {

using Types = std::vector<TensorType>;

enum class Rule {
  None,
  SameAsInput,
  /// A tensor-parallel collective's output: its input with the node's
  /// `axis` divided by T (each rank's piece) or multiplied (the whole).
  TpPiece,
  TpWhole,
  SkipNorm,
  SimplifiedNorm,
  EmbedNorm,
  Attention,
  MultiHeadAttention,
  GroupQueryAttention,
};

/// Ops.def's SHAPE tokens: onnx (ONNX's schema infers the shape) and none
/// are no rule of this file.
namespace token {
constexpr Rule onnx = Rule::None, none = Rule::None, sameAsInput = Rule::SameAsInput,
               tpPiece = Rule::TpPiece, tpWhole = Rule::TpWhole, skipNorm = Rule::SkipNorm,
               simplifiedNorm = Rule::SimplifiedNorm, embedNorm = Rule::EmbedNorm,
               attention = Rule::Attention, multiHeadAttention = Rule::MultiHeadAttention,
               groupQueryAttention = Rule::GroupQueryAttention;
} // namespace token

/// The rule of each row of Ops.def, indexed by OpId.
constexpr Rule rules[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, ...) token::SHAPE,
#include "ops/Ops.def"
};

Rule ruleFor(const Graph &graph, const Op &op) {
  const OpDef *def = lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
  return def ? rules[static_cast<size_t>(def->id)] : Rule::None;
}

} // namespace

Expected<std::optional<Types>> inferContribShapes(const Graph &graph, const Op &op) {
  Rule rule = ruleFor(graph, op);
  if (rule == Rule::None)
    return std::nullopt;
  const onnx::NodeProto &node = graph.node(op);
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s: %s: %s", graph.path.c_str(),
                             describeOp(graph, op).c_str(), why.str().c_str());
  };
  auto input = [&](size_t i) -> const Value * {
    if (i >= op.inputs.size() || op.inputs[i] < 0)
      return nullptr;
    return &graph.values[op.inputs[i]];
  };
  const Value *x = input(0);
  if (!x)
    return fail("the first input is missing");
  Types out(op.outputs.size());
  auto rowStats = [&](const Value &v) {
    TensorType t{DType::F32, v.shape};
    if (!t.shape.empty())
      t.shape.back() = 1;
    return t;
  };
  switch (rule) {
  case Rule::None:
    return std::nullopt;
  case Rule::SameAsInput:
    for (auto &t : out)
      t = {x->type, x->shape};
    return std::optional<Types>(out);
  case Rule::TpPiece:
  case Rule::TpWhole: {
    int64_t rank = static_cast<int64_t>(x->shape.size());
    int64_t axis = attrInt(node, "axis", 0), parts = std::max(1, graph.tensorParallel);
    if (axis < 0 || axis >= rank)
      return fail("axis " + Twine(axis) + " is out of range for rank " + Twine(rank));
    TensorType t{x->type, x->shape};
    if (rule == Rule::TpWhole)
      t.shape[axis] *= parts;
    else if (t.shape[axis] % parts != 0)
      return fail(formatv("axis {0} of {1} entries does not divide over {2} ranks", axis,
                          t.shape[axis], parts));
    else
      t.shape[axis] /= parts;
    out[0] = t;
    return std::optional<Types>(out);
  }
  case Rule::SimplifiedNorm: {
    // Outputs: Y, inv_std_var (the normalized dimensions [axis, rank) set
    // to 1).
    int64_t rank = static_cast<int64_t>(x->shape.size());
    int64_t axis = attrInt(node, "axis", -1);
    if (axis < -rank || axis >= rank)
      return fail("axis " + Twine(axis) + " is out of range for rank " + Twine(rank));
    TensorType stats{DType::F32, x->shape};
    std::fill(stats.shape.begin() + (axis < 0 ? axis + rank : axis), stats.shape.end(), 1);
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = i == 0 ? TensorType{x->type, x->shape} : stats;
    return std::optional<Types>(out);
  }
  case Rule::SkipNorm:
    // Outputs: output, mean, inv_std_var, input_skip_bias_sum.
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = (i == 0 || i == 3) ? TensorType{x->type, x->shape} : rowStats(*x);
    return std::optional<Types>(out);
  case Rule::EmbedNorm: {
    // Inputs: input_ids [B,S], segment_ids, word_embedding [V,H], ...
    // Outputs: output [B,S,H], mask_index [B] (i32), embedding_sum [B,S,H].
    const Value *words = input(2);
    if (x->shape.size() != 2 || !words || words->shape.size() != 2)
      return fail("expects input_ids [batch, seq] and word_embedding [vocab, hidden]");
    std::vector<int64_t> hidden = {x->shape[0], x->shape[1], words->shape[1]};
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = i == 1 ? TensorType{DType::I32, {x->shape[0]}} : TensorType{words->type, hidden};
    return std::optional<Types>(out);
  }
  case Rule::Attention: {
    // Inputs: input [B,S,Hin], weights [Hin, 3H], bias, mask_index, past
    // [2,B,N,P,Hd]. Outputs: output [B,S,Hv], present [2,B,N,P+S,Hd].
    const Value *weights = input(1);
    if (x->shape.size() != 3 || !weights || weights->shape.size() != 2)
      return fail("expects input [batch, seq, hidden] and weights [hidden, 3*hidden]");
    int64_t heads = attrInt(node, "num_heads", 0);
    if (heads <= 0)
      return fail("num_heads must be positive");
    // The value width: a third of the fused projection, or the last of
    // qkv_hidden_sizes.
    int64_t v = weights->shape[1] / 3;
    if (auto sizes = attrInts(node, "qkv_hidden_sizes"); sizes && sizes->size() == 3)
      v = (*sizes)[2];
    int64_t batch = x->shape[0], seq = x->shape[1], headSize = v / heads;
    out[0] = {x->type, {batch, seq, v}};
    if (out.size() > 1) {
      const Value *past = input(4);
      int64_t pastLen = past && past->shape.size() == 5 ? past->shape[3] : 0;
      out[1] = {x->type, {2, batch, heads, pastLen + seq, headSize}};
    }
    return std::optional<Types>(out);
  }
  case Rule::MultiHeadAttention:
  case Rule::GroupQueryAttention: {
    // Inputs: query [B,S,D], key [B,L,Dk] or [B,N,L,H], value, ...,
    // past_key [B,N,P,H] (index 6 for MHA, 3 for GQA). Outputs: output
    // [B,S,Dv], present_key/value [B,N,P+L,H].
    int64_t heads = attrInt(node, "num_heads", 0);
    if (heads <= 0 || x->shape.size() != 3)
      return fail("expects num_heads and query [batch, seq, hidden]");
    int64_t kvHeads = attrInt(node, "kv_num_heads", heads);
    const Value *key = input(1), *value = input(2);
    int64_t batch = x->shape[0], seq = x->shape[1];
    int64_t headSize = x->shape[2] / heads, outWidth = x->shape[2], keyLen = seq;
    int64_t valueHeadSize = headSize;
    if (rule == Rule::MultiHeadAttention) {
      if (value && value->shape.size() == 3)
        outWidth = value->shape[2];
      else if (value && value->shape.size() == 4)
        outWidth = value->shape[1] * value->shape[3];
      if (key && key->shape.size() == 3)
        keyLen = key->shape[1];
      else if (key && key->shape.size() == 4)
        keyLen = key->shape[2];
      valueHeadSize = outWidth / heads;
    } else {
      // Packed QKV when key is absent: D = (N + 2 * kvN) * H.
      if (!key)
        headSize = x->shape[2] / (heads + 2 * kvHeads), outWidth = heads * headSize;
      valueHeadSize = headSize;
    }
    const Value *pastKey = input(rule == Rule::MultiHeadAttention ? 6 : 3);
    int64_t pastLen = pastKey && pastKey->shape.size() == 4 ? pastKey->shape[2] : 0;
    int64_t presentHeads = rule == Rule::MultiHeadAttention ? heads : kvHeads;
    // Outputs: output, present_key, present_value (values have their own
    // head size).
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = i == 0 ? TensorType{x->type, {batch, seq, outWidth}}
                      : TensorType{x->type,
                                   {batch, presentHeads, pastLen + keyLen,
                                    i == 2 ? valueHeadSize : headSize}};
    return std::optional<Types>(out);
  }
  }
  return std::nullopt;
}

} // namespace pipec
