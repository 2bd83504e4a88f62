//===- Bert.cpp - BERT sequence classifier -------------------------------===//
//
// BERT encoder with pooler and a 2-class sequence classifier.
//
//===----------------------------------------------------------------------===//
#include "models/Families.h"
#include "models/Layers.h"

#include <limits>

using namespace llvm;

namespace pipec::models {

void buildBert(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, h = o.heads, d = e / h, s = o.seq;
  int64_t f = o.ffn ? o.ffn : 4 * e;
  g.addInput("input_ids", kInt64, {kBatch, s});
  g.addInput("attention_mask", kInt64, {kBatch, s});
  Mod bert = Mod().child("bert"), emb = bert.child("embeddings");

  Mod word = emb.child("word_embeddings");
  std::string x = g.addNode("Gather", word.scope,
                            {g.addWeight(word.param("weight"), {o.vocab, e}), "input_ids"});
  Mod tokType = emb.child("token_type_embeddings");
  std::string tokIds = g.constInts(emb.scope, {1, s}, std::vector<int64_t>(s, 0));
  std::string tokW = g.addWeight(tokType.param("weight"), {2, e});
  x = g.addNode("Add", emb.scope, {x, g.addNode("Gather", tokType.scope, {tokW, tokIds})});
  Mod posEmb = emb.child("position_embeddings");
  std::string posIds = positionIds(g, emb.scope);
  std::string posW = g.addWeight(posEmb.param("weight"), {s, e});
  x = g.addNode("Add", emb.scope, {x, g.addNode("Gather", posEmb.scope, {posW, posIds})});
  x = layerNorm(g, emb.child("LayerNorm"), x, e, 1e-12f);

  // Extended mask (1 - mask[:, None, None, :]) * float_min: [B, 1, 1, S].
  std::string axes = g.constVector(bert.scope, {1, 2});
  std::string mask = g.addNode("Unsqueeze", bert.scope, {"attention_mask", axes});
  mask = g.addNode("Cast", bert.scope, {mask}, {attrInt("to", kFloat)});
  std::string one = g.constFloat(bert.scope, 1.0f);
  mask = g.addNode("Sub", bert.scope, {one, mask});
  std::string min = g.constFloat(bert.scope, std::numeric_limits<float>::lowest());
  mask = g.addNode("Mul", bert.scope, {mask, min});

  Mod encoder = bert.child("encoder");
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = encoder.child("layer." + Twine(l));
    Mod self = layer.child("attention").child("self");
    Mod attnOut = layer.child("attention").child("output");
    Mod inter = layer.child("intermediate"), out = layer.child("output");
    std::string q = linear(g, self.child("query"), x, e, e, true);
    std::string k = linear(g, self.child("key"), x, e, e, true);
    std::string v = linear(g, self.child("value"), x, e, e, true);
    q = splitHeads(g, self.scope, q, h, d, {0, 2, 1, 3});
    std::string kt = splitHeads(g, self.scope, k, h, d, {0, 2, 3, 1});
    v = splitHeads(g, self.scope, v, h, d, {0, 2, 1, 3});
    std::string a = attention(g, self.scope, q, kt, v, mask, h, d);
    a = linear(g, attnOut.child("dense"), a, e, e, true);
    a = g.addNode("Add", attnOut.scope, {a, x});
    a = layerNorm(g, attnOut.child("LayerNorm"), a, e, 1e-12f);
    std::string i = linear(g, inter.child("dense"), a, e, f, true);
    i = gelu(g, inter.child("intermediate_act_fn").scope, i);
    std::string r = linear(g, out.child("dense"), i, f, e, true);
    r = g.addNode("Add", out.scope, {r, a});
    x = layerNorm(g, out.child("LayerNorm"), r, e, 1e-12f);
  }

  Mod pooler = bert.child("pooler");
  std::string zero = g.constInts(pooler.scope, {}, {0});
  std::string first = g.addNode("Gather", pooler.scope, {x, zero}, {attrInt("axis", 1)});
  std::string p = linear(g, pooler.child("dense"), first, e, e, true);
  p = g.addNode("Tanh", pooler.child("activation").scope, {p});
  linear(g, Mod().child("classifier"), p, e, 2, true, "logits");
  g.addOutput("logits", kFloat, {kBatch, 2});
  if (o.withLoss) {
    g.addInput("labels", kInt64, {kBatch});
    crossEntropy(g, "logits", "labels");
  }
}

} // namespace pipec::models
