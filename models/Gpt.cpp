//===- Gpt.cpp - GPT-2 as torch exports it -------------------------------===//
//
// GPT-2 as torch.onnx.export traces HF's GPT2LMHeadModel: pre-LN blocks of
// GPT2Attention and a gelu_new MLP, every projection a Conv1D; HF module
// and parameter names.
//
//===----------------------------------------------------------------------===//
#include "models/Families.h"
#include "models/Layers.h"

#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::models {
namespace {

/// x.size(Index) as torch traces it: Shape -> Gather(Constant Index), an
/// int64 scalar.
std::string sizeOf(GraphBuilder &g, StringRef scope, const std::string &x, int64_t index) {
  std::string shape = g.addNode("Shape", scope, {x});
  std::string i = g.constInts(scope, {}, {index});
  return g.addNode("Gather", scope, {shape, i}, {attrInt("axis", 0)});
}

/// The Reshape target (x.size(0), x.size(1)) + Tail for x [B, S, ...]. With
/// a symbolic batch both sizes are read with sizeOf and unsqueezed to [1],
/// then concatenated with the Constant Tail; with a static batch torch folds
/// it all into one Constant.
std::string batchSeqShape(GraphBuilder &g, StringRef scope, const std::string &x,
                          ArrayRef<int64_t> tail) {
  const GeneratorOptions &o = g.opts();
  if (o.batch > 0) {
    std::vector<int64_t> shape{o.batch, o.seq};
    shape.insert(shape.end(), tail.begin(), tail.end());
    return g.constVector(scope, shape);
  }
  std::string batch = sizeOf(g, scope, x, 0);
  std::string seq = sizeOf(g, scope, x, 1);
  auto unsqueeze = [&](const std::string &scalar) {
    std::string axes = g.constVector(scope, {0});
    return g.addNode("Unsqueeze", scope, {scalar, axes});
  };
  std::string b = unsqueeze(batch);
  std::string s = unsqueeze(seq);
  std::string t = g.constVector(scope, tail);
  return g.addNode("Concat", scope, {b, s, t}, {attrInt("axis", 0)});
}

/// HF Conv1D (weight [In, Out], bias [Out]) on x [B, S, In]:
///   size_out = x.size()[:-1] + (Out,)
///   x = addmm(bias, x.view(-1, In), weight).view(size_out)
/// exported as a Reshape to the Constant [-1, In], MatMul + Add and a Reshape
/// to size_out: Shape -> Slice(0, -1) -> Concat([Out]) with a symbolic
/// batch, a Constant with a static one.
std::string conv1d(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out) {
  const GeneratorOptions &o = g.opts();
  const StringRef s = m.scope;
  std::string sizeOut;
  if (o.batch > 0) {
    sizeOut = g.constVector(s, {o.batch, o.seq, out});
  } else {
    std::string shape = g.addNode("Shape", s, {x});
    std::string starts = g.constVector(s, {0});
    std::string ends = g.constVector(s, {-1});
    std::string axes = g.constVector(s, {0});
    std::string leading = g.addNode("Slice", s, {shape, starts, ends, axes});
    std::string nf = g.constVector(s, {out});
    sizeOut = g.addNode("Concat", s, {leading, nf}, {attrInt("axis", 0)});
  }
  std::string flatShape = g.constVector(s, {-1, in});
  std::string flat = g.addNode("Reshape", s, {x, flatShape});
  std::string y = linear(g, m, flat, in, out, /*bias=*/true);
  return g.addNode("Reshape", s, {y, sizeOut});
}

/// HF gelu_new, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))),
/// one node per torch operator.
std::string geluNew(GraphBuilder &g, StringRef scope, const std::string &x) {
  std::string half = g.constFloat(scope, 0.5f);
  std::string halfX = g.addNode("Mul", scope, {half, x});
  std::string three = g.constFloat(scope, 3.0f);
  std::string cube = g.addNode("Pow", scope, {x, three});
  std::string coeff = g.constFloat(scope, 0.044715f);
  std::string inner = g.addNode("Mul", scope, {coeff, cube});
  inner = g.addNode("Add", scope, {x, inner});
  std::string scale = g.constFloat(scope, float(std::sqrt(2.0 / M_PI)));
  inner = g.addNode("Mul", scope, {scale, inner});
  std::string tanh = g.addNode("Tanh", scope, {inner});
  std::string one = g.constFloat(scope, 1.0f);
  std::string onePlus = g.addNode("Add", scope, {one, tanh});
  return g.addNode("Mul", scope, {halfX, onePlus});
}

/// GPT2Attention._split_heads: x [B, S, H * D] viewed as
/// x.size()[:-1] + (H, D), then permuted (0, 2, 1, 3) to [B, H, S, D].
std::string gptSplitHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                          int64_t dim) {
  std::string shape = batchSeqShape(g, scope, x, {heads, dim});
  std::string r = g.addNode("Reshape", scope, {x, shape});
  return g.addNode("Transpose", scope, {r}, {attrInts("perm", {0, 2, 1, 3})});
}

/// GPT2Attention._merge_heads: x [B, H, S, D] permuted (0, 2, 1, 3), then
/// viewed as x.size()[:-2] + (H * D,).
std::string gptMergeHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                          int64_t dim) {
  std::string t = g.addNode("Transpose", scope, {x}, {attrInts("perm", {0, 2, 1, 3})});
  std::string shape = batchSeqShape(g, scope, t, {heads * dim});
  return g.addNode("Reshape", scope, {t, shape});
}

/// GPT2Attention on x [B, S, E]: c_attn, Split into query, key and value,
/// heads split, softmax(where(Mask, q k^T / sqrt(D), float_min)) v, heads
/// merged, c_proj. \p mask is the bool [1, 1, S, S] causal buffer.
std::string gptAttention(GraphBuilder &g, const Mod &attn, const std::string &x,
                         const std::string &mask, int64_t e, int64_t heads) {
  int64_t d = e / heads;
  const StringRef s = attn.scope;
  std::string qkv = conv1d(g, attn.child("c_attn"), x, e, 3 * e);
  std::string sizes = g.constVector(s, {e, e, e});
  std::vector<std::string> parts = g.addNodeN("Split", s, {qkv, sizes}, 3, {attrInt("axis", 2)});
  std::string q = gptSplitHeads(g, s, parts[0], heads, d);
  std::string k = gptSplitHeads(g, s, parts[1], heads, d);
  std::string v = gptSplitHeads(g, s, parts[2], heads, d);
  // _attn: matmul(query, key.transpose(-1, -2)) / sqrt(D), causal where.
  std::string kt = g.addNode("Transpose", s, {k}, {attrInts("perm", {0, 1, 3, 2})});
  std::string scores = g.addNode("MatMul", s, {q, kt});
  std::string scale = g.constFloat(s, std::sqrt(float(d)));
  scores = g.addNode("Div", s, {scores, scale});
  std::string maskValue = g.constFloat(s, std::numeric_limits<float>::lowest());
  scores = g.addNode("Where", s, {mask, scores, maskValue});
  std::string probs = g.addNode("Softmax", s, {scores}, {attrInt("axis", -1)});
  std::string ctx = g.addNode("MatMul", s, {probs, v});
  ctx = gptMergeHeads(g, s, ctx, heads, d);
  return conv1d(g, attn.child("c_proj"), ctx, e, e);
}

} // namespace

void buildGpt(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t e = o.hidden, s = o.seq;
  int64_t f = o.ffn ? o.ffn : 4 * e;
  g.addInput("input_ids", kInt64, {kBatch, s});
  Mod t = Mod().child("transformer");
  std::string wte = g.addWeight("transformer.wte.weight", {o.vocab, e});
  std::string x = g.addNode("Gather", t.child("wte").scope, {wte, "input_ids"});
  std::string pos = positionIds(g, t.scope);
  std::string wpe = g.addWeight("transformer.wpe.weight", {s, e});
  std::string p = g.addNode("Gather", t.child("wpe").scope, {wpe, pos});
  x = g.addNode("Add", t.scope, {x, p});
  // GPT2Attention's `bias` buffer (true on and below the diagonal), one copy
  // shared by all blocks.
  std::vector<uint8_t> causal(s * s, 0);
  for (int64_t i = 0; i < s; ++i)
    for (int64_t j = 0; j <= i; ++j)
      causal[i * s + j] = 1;
  std::string mask = g.addBoolBuffer("causal_mask", {1, 1, s, s}, causal);
  for (int l = 0; l < o.layers; ++l) {
    Mod block = t.child("h." + Twine(l));
    Mod mlp = block.child("mlp");
    std::string hn = layerNorm(g, block.child("ln_1"), x, e, 1e-5f);
    std::string a = gptAttention(g, block.child("attn"), hn, mask, e, o.heads);
    x = g.addNode("Add", block.scope, {a, x});
    hn = layerNorm(g, block.child("ln_2"), x, e, 1e-5f);
    std::string m = conv1d(g, mlp.child("c_fc"), hn, e, f);
    m = geluNew(g, mlp.child("act").scope, m);
    m = conv1d(g, mlp.child("c_proj"), m, f, e);
    x = g.addNode("Add", block.scope, {x, m});
  }
  x = layerNorm(g, t.child("ln_f"), x, e, 1e-5f);
  lmHead(g, x, wte, e);
}

} // namespace pipec::models
