//===- Llama.cpp - Llama with grouped-query attention --------------------===//
//
// Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.
//
//===----------------------------------------------------------------------===//
#include "models/Families.h"
#include "models/Layers.h"

#include "llvm/Support/MathExtras.h"

#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::models {
namespace {

/// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
std::string rotary(GraphBuilder &g, StringRef scope, const std::string &x, const std::string &cos,
                   const std::string &sin, int64_t dim) {
  auto slice = [&](int64_t begin, int64_t end) {
    std::string starts = g.constVector(scope, {begin});
    std::string ends = g.constVector(scope, {end});
    std::string axes = g.constVector(scope, {3});
    std::string steps = g.constVector(scope, {1});
    return g.addNode("Slice", scope, {x, starts, ends, axes, steps});
  };
  std::string x1 = slice(0, dim / 2);
  std::string x2 = slice(dim / 2, std::numeric_limits<int64_t>::max());
  std::string neg = g.addNode("Neg", scope, {x2});
  std::string rot = g.addNode("Concat", scope, {neg, x1}, {attrInt("axis", -1)});
  std::string a = g.addNode("Mul", scope, {x, cos});
  std::string b = g.addNode("Mul", scope, {rot, sin});
  return g.addNode("Add", scope, {a, b});
}

/// repeat_kv: [B, KV, S, D] -> [B, KV * Rep, S, D].
std::string repeatKv(GraphBuilder &g, StringRef scope, const std::string &x, int64_t kvHeads,
                     int64_t rep, int64_t dim) {
  std::string axes = g.constVector(scope, {2});
  std::string u = g.addNode("Unsqueeze", scope, {x, axes});
  std::string reps = g.constVector(scope, {1, 1, rep, 1, 1});
  std::string ex = g.addNode("Expand", scope, {u, reps});
  std::string shape = g.batchShape(scope, ex, {kvHeads * rep, g.opts().seq, dim});
  return g.addNode("Reshape", scope, {ex, shape});
}

} // namespace

void buildLlama(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, h = o.heads, kv = o.kvHeads ? o.kvHeads : h;
  int64_t d = e / h, s = o.seq;
  int64_t f = o.ffn ? o.ffn : alignTo(8 * e / 3, 8);
  g.addInput("input_ids", kInt64, {kBatch, s});
  Mod m = Mod().child("model");
  std::string emb = g.addWeight("model.embed_tokens.weight", {o.vocab, e});
  std::string x = g.addNode("Gather", m.child("embed_tokens").scope, {emb, "input_ids"});
  // cos/sin of position * 10000^(-2i/D), both halves repeated, computed in
  // the graph from the inv_freq buffer as HF's LlamaRotaryEmbedding does
  // (a table of constants into Cos and Sin: not trained).
  std::vector<float> invFreq(d), positions(s);
  for (int64_t i = 0; i < d; ++i)
    invFreq[i] = static_cast<float>(std::pow(10000.0, -double(2 * (i % (d / 2))) / d));
  for (int64_t p = 0; p < s; ++p)
    positions[p] = static_cast<float>(p);
  Mod rope = m.child("rotary_emb");
  std::string freq = g.addBuffer("model.rotary_emb.inv_freq", {1, d}, invFreq);
  std::string pos = g.addBuffer("model.rotary_emb.positions", {s, 1}, positions);
  std::string angles = g.addNode("Mul", rope.scope, {pos, freq});
  std::string cosT = g.addNode("Cos", rope.scope, {angles});
  std::string sinT = g.addNode("Sin", rope.scope, {angles});
  std::string mask = g.causalMask();
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = m.child("layers." + Twine(l));
    Mod attn = layer.child("self_attn"), mlp = layer.child("mlp");
    const std::string &attnScope = attn.scope;
    std::string hn = rmsNorm(g, layer.child("input_layernorm"), x, e, 1e-6f);
    std::string q = linear(g, attn.child("q_proj"), hn, e, h * d, false);
    std::string k = linear(g, attn.child("k_proj"), hn, e, kv * d, false);
    std::string v = linear(g, attn.child("v_proj"), hn, e, kv * d, false);
    q = splitHeads(g, attnScope, q, h, d, {0, 2, 1, 3});
    k = splitHeads(g, attnScope, k, kv, d, {0, 2, 1, 3});
    v = splitHeads(g, attnScope, v, kv, d, {0, 2, 1, 3});
    q = rotary(g, attnScope, q, cosT, sinT, d);
    k = rotary(g, attnScope, k, cosT, sinT, d);
    if (kv != h) {
      k = repeatKv(g, attnScope, k, kv, h / kv, d);
      v = repeatKv(g, attnScope, v, kv, h / kv, d);
    }
    std::string kt = g.addNode("Transpose", attnScope, {k}, {attrInts("perm", {0, 1, 3, 2})});
    std::string a = attention(g, attnScope, q, kt, v, mask, h, d);
    a = linear(g, attn.child("o_proj"), a, h * d, e, false);
    x = g.addNode("Add", layer.scope, {x, a});
    hn = rmsNorm(g, layer.child("post_attention_layernorm"), x, e, 1e-6f);
    std::string gate = linear(g, mlp.child("gate_proj"), hn, e, f, false);
    std::string actScope = mlp.child("act_fn").scope;
    std::string sig = g.addNode("Sigmoid", actScope, {gate});
    std::string act = g.addNode("Mul", actScope, {gate, sig});
    std::string up = linear(g, mlp.child("up_proj"), hn, e, f, false);
    std::string prod = g.addNode("Mul", mlp.scope, {act, up});
    std::string down = linear(g, mlp.child("down_proj"), prod, f, e, false);
    x = g.addNode("Add", layer.scope, {x, down});
  }
  x = rmsNorm(g, m.child("norm"), x, e, 1e-6f);
  lmHead(g, x, emb, e);
}

} // namespace pipec::models
