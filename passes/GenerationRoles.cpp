//===- GenerationRoles.cpp - A decoder's inputs and outputs in a token loop ===//
#include "passes/GenerationRoles.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <set>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec {

namespace {

Error refuse(const Graph &graph, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "%s: cannot generate: %s", graph.path.c_str(),
                           why.str().c_str());
}

bool isGraphInput(const Graph &graph, int id) {
  return id >= 0 && graph.values[id].kind == ValueKind::Input;
}

/// Ops that pass their first input's elements on unchanged in value: a
/// token id read through them is still the token id.
bool isReshaping(const Op &op) { return op.has(SameElements); }

/// What a Concat(\p past, appended) that makes \p present appends: this
/// pass's positions alone; empty when \p present is made otherwise.
std::string appendedOf(const Graph &graph, int past, int present) {
  int producer = graph.values[present].producer;
  if (producer < 0)
    return "";
  const Op &op = graph.ops[producer];
  if (!op.is(OpId::Concat) || op.inputs.size() != 2 || op.inputs[0] != past || op.inputs[1] < 0)
    return "";
  return graph.values[op.inputs[1]].name;
}

} // namespace

Expected<plan::Generation> findGenerationRoles(const Graph &graph, int64_t maxLength) {
  plan::Generation roles;
  roles.set_max_length(maxLength);
  std::set<int> cacheInputs, cacheOutputs;
  // A cache entry: the graph input \p in (the past) and the graph output
  // \p out (its present), along \p axis.
  auto addCache = [&](int in, int out, int64_t axis, bool inPlace) -> Error {
    const Value &past = graph.values[in], &present = graph.values[out];
    int64_t rank = static_cast<int64_t>(present.shape.size());
    if (axis < 0)
      axis += rank;
    if (axis < 0 || axis >= rank || past.shape.size() != present.shape.size() ||
        past.shape[axis] != maxLength - 1 || present.shape[axis] != maxLength)
      return refuse(graph, formatv("the cache '{0}' -> '{1}' is not {2} positions long on its "
                                   "axis {3} (shapes {4} and {5}); its past dimension is not "
                                   "the one --max-length sets",
                                   past.name, present.name, maxLength - 1, axis,
                                   formatShape(past.shape), formatShape(present.shape)));
    plan::Generation::Cache *cache = roles.add_cache();
    cache->set_past(past.name);
    cache->set_present(present.name);
    cache->set_axis(static_cast<int32_t>(axis));
    cache->set_in_place(inPlace);
    cache->set_appended(appendedOf(graph, in, out));
    cacheInputs.insert(in);
    cacheOutputs.insert(out);
    return Error::success();
  };
  for (int out : graph.outputs) {
    const Value &present = graph.values[out];
    if (present.producer < 0 || !isFloatDType(present.type))
      continue;
    const Op &op = graph.ops[present.producer];
    // onnxruntime's attention ops: present_key and present_value (outputs
    // 1, 2) are past_key and past_value (inputs 1 + pastOffset, 2 +
    // pastOffset) with this pass's keys and values on the sequence axis of
    // [batch, heads, seq, head]. GroupQueryAttention (onnxruntime-genai's
    // builder) writes them in place where each row's past ends;
    // MultiHeadAttention (its earlier and fp16 exports) appends them.
    struct AttentionCache {
      OpId op;
      size_t pastOffset;
      bool inPlace;
    };
    static const AttentionCache attentionCaches[] = {{OpId::MsGroupQueryAttention, 2, true},
                                                     {OpId::MsMultiHeadAttention, 5, false}};
    const AttentionCache *attention = nullptr;
    for (const AttentionCache &a : attentionCaches)
      if (op.is(a.op))
        attention = &a;
    if (attention) {
      for (size_t i = 1; i <= 2; ++i) {
        size_t past = i + attention->pastOffset;
        if (i < op.outputs.size() && op.outputs[i] == out && op.inputs.size() > past &&
            isGraphInput(graph, op.inputs[past]))
          if (Error err = addCache(op.inputs[past], out, 2, attention->inPlace))
            return std::move(err);
      }
      continue;
    }
    if (!op.is(OpId::Concat))
      continue;
    for (int in : op.inputs) {
      if (!isGraphInput(graph, in) || !isFloatDType(graph.values[in].type))
        continue;
      if (Error err = addCache(in, out, attrInt(graph.node(op), "axis", 0), /*inPlace=*/false))
        return std::move(err);
      break;
    }
  }
  if (roles.cache_size() == 0)
    return refuse(graph, "the model has no KV cache: no graph output is a Concat of a graph "
                         "input or a GroupQueryAttention's or MultiHeadAttention's present "
                         "(export the decoder with "
                         "past_key_values as inputs and the present keys and values as "
                         "outputs)");
  int logits = -1;
  for (int out : graph.outputs) {
    const Value &v = graph.values[out];
    if (cacheOutputs.count(out) || !isFloatDType(v.type) || v.shape.size() != 3)
      continue;
    if (logits >= 0)
      return refuse(graph, formatv("two outputs could be the logits, '{0}' and '{1}'",
                                   graph.values[logits].name, v.name));
    logits = out;
  }
  if (logits < 0)
    return refuse(graph, "no output is the logits: a float [batch, 1, vocab] besides the cache");
  int64_t vocab = graph.values[logits].shape[2];
  roles.set_logits(graph.values[logits].name);
  roles.set_vocab(vocab);
  int tokens = -1;
  for (int in : graph.inputs) {
    const Value &v = graph.values[in];
    if (cacheInputs.count(in) || !isIntegerDType(v.type) || v.shape.size() != 2)
      continue;
    // The ids may be reshaped or cast on their way to the table.
    std::vector<int> reach = {in};
    for (size_t i = 0; i < reach.size() && tokens != in; ++i)
      for (int user : graph.values[reach[i]].users) {
        const Op &op = graph.ops[user];
        if (isReshaping(op) && !op.outputs.empty() && op.outputs[0] >= 0 && reach.size() < 64) {
          reach.push_back(op.outputs[0]);
          continue;
        }
        if (!op.is(OpId::Gather) || op.inputs.size() < 2 || op.inputs[1] != reach[i])
          continue;
        const Value &table = graph.values[op.inputs[0]];
        if (table.isParameter() && !table.shape.empty() && table.shape[0] == vocab)
          tokens = in;
      }
  }
  if (tokens < 0)
    return refuse(graph, formatv("no input is the token ids: an integer [batch, 1] that indexes "
                                 "an embedding of {0} rows, the logits' vocabulary",
                                 vocab));
  roles.set_tokens(graph.values[tokens].name);
  for (int in : graph.inputs) {
    const Value &v = graph.values[in];
    if (in == tokens || cacheInputs.count(in))
      continue;
    if (v.shape.size() == 2 && v.shape[1] == maxLength && roles.mask().empty()) {
      roles.set_mask(v.name);
      continue;
    }
    if (v.shape.size() == 2 && v.shape[1] == 1 && isIntegerDType(v.type) &&
        roles.positions().empty()) {
      roles.set_positions(v.name);
      continue;
    }
    return refuse(graph, formatv("input '{0}' ({1}) has no role in generation: expected the "
                                 "token ids, position ids [batch, 1], an attention mask [batch, "
                                 "{2}] and the cache",
                                 v.name, formatShape(v.shape), maxLength));
  }
  if (roles.mask().empty())
    return refuse(graph, formatv("the model has no attention mask input [batch, {0}]: without "
                                 "one every cache position counts, the unwritten ones too",
                                 maxLength));
  // GroupQueryAttention rotates by each row's length, which the mask
  // gives (seqlens_k); a Concat cache's attention needs the positions.
  bool inPlace = llvm::all_of(roles.cache(), [](const auto &c) { return c.in_place(); });
  if (roles.positions().empty() && !inPlace)
    return refuse(graph, "the model has no position ids input [batch, 1]: it derives positions "
                         "from the past length, which a compiled decode step fixes (export it "
                         "with position_ids)");
  return roles;
}

} // namespace pipec
