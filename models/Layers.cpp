//===- Layers.cpp - Layers the model families share ----------------------===//
#include "models/Layers.h"

#include <cmath>

using namespace llvm;

namespace pipec::models {

std::string linear(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                   bool bias, StringRef outName) {
  std::string w = g.addWeight(m.param("weight"), {in, out});
  std::string y = g.addNode("MatMul", m.scope, {x, w}, {}, bias ? StringRef() : outName);
  if (!bias)
    return y;
  std::string b = g.addWeight(m.param("bias"), {out});
  return g.addNode("Add", m.scope, {b, y}, {}, outName);
}

std::string gemm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                 StringRef outName) {
  std::string w = g.addWeight(m.param("weight"), {out, in});
  std::string b = g.addWeight(m.param("bias"), {out});
  return g.addNode("Gemm", m.scope, {x, w, b},
                   {attrFloat("alpha", 1.0f), attrFloat("beta", 1.0f), attrInt("transB", 1)},
                   outName);
}

std::string layerNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width,
                      float eps) {
  std::string w = g.addWeight(m.param("weight"), {width}, Init::One);
  std::string b = g.addWeight(m.param("bias"), {width});
  if (g.opts().opset >= 17)
    return g.addNode("LayerNormalization", m.scope, {x, w, b},
                     {attrInt("axis", -1), attrFloat("epsilon", eps)});
  const StringRef s = m.scope;
  auto mean = [&](const std::string &in) {
    return g.addNode("ReduceMean", s, {in}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  };
  std::string centered = g.addNode("Sub", s, {x, mean(x)});
  std::string two = g.constFloat(s, 2.0f);
  std::string var = mean(g.addNode("Pow", s, {centered, two}));
  std::string epsC = g.constFloat(s, eps);
  std::string stdDev = g.addNode("Sqrt", s, {g.addNode("Add", s, {var, epsC})});
  std::string norm = g.addNode("Div", s, {centered, stdDev});
  return g.addNode("Add", s, {g.addNode("Mul", s, {norm, w}), b});
}

std::string rmsNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width, float eps) {
  std::string w = g.addWeight(m.param("weight"), {width}, Init::One);
  const StringRef s = m.scope;
  std::string two = g.constFloat(s, 2.0f);
  std::string sq = g.addNode("Pow", s, {x, two});
  std::string var =
      g.addNode("ReduceMean", s, {sq}, {attrInts("axes", {-1}), attrInt("keepdims", 1)});
  std::string epsC = g.constFloat(s, eps);
  std::string stdDev = g.addNode("Sqrt", s, {g.addNode("Add", s, {var, epsC})});
  std::string inv = g.addNode("Reciprocal", s, {stdDev});
  return g.addNode("Mul", s, {w, g.addNode("Mul", s, {x, inv})});
}

std::string gelu(GraphBuilder &g, StringRef scope, const std::string &x) {
  std::string sqrt2 = g.constFloat(scope, float(M_SQRT2));
  std::string erf = g.addNode("Erf", scope, {g.addNode("Div", scope, {x, sqrt2})});
  std::string one = g.constFloat(scope, 1.0f);
  std::string sum = g.addNode("Add", scope, {erf, one});
  std::string prod = g.addNode("Mul", scope, {x, sum});
  std::string half = g.constFloat(scope, 0.5f);
  return g.addNode("Mul", scope, {prod, half});
}

std::string splitHeads(GraphBuilder &g, StringRef scope, const std::string &x, int64_t heads,
                       int64_t dim, ArrayRef<int64_t> perm) {
  std::string shape = g.batchShape(scope, x, {g.opts().seq, heads, dim});
  std::string r = g.addNode("Reshape", scope, {x, shape});
  return g.addNode("Transpose", scope, {r}, {attrInts("perm", perm)});
}

std::string attention(GraphBuilder &g, StringRef scope, const std::string &q, const std::string &kt,
                      const std::string &v, const std::string &mask, int64_t heads, int64_t dim) {
  std::string scores = g.addNode("MatMul", scope, {q, kt});
  std::string scale = g.constFloat(scope, std::sqrt(float(dim)));
  scores = g.addNode("Div", scope, {scores, scale});
  scores = g.addNode("Add", scope, {scores, mask});
  std::string probs = g.addNode("Softmax", scope, {scores}, {attrInt("axis", -1)});
  std::string ctx = g.addNode("MatMul", scope, {probs, v});
  ctx = g.addNode("Transpose", scope, {ctx}, {attrInts("perm", {0, 2, 1, 3})});
  std::string shape = g.batchShape(scope, ctx, {g.opts().seq, heads * dim});
  return g.addNode("Reshape", scope, {ctx, shape});
}

void crossEntropy(GraphBuilder &g, const std::string &logits, const std::string &labels) {
  g.addNode("SoftmaxCrossEntropyLoss", "/loss_fct", {logits, labels},
            {attrInt("ignore_index", -100), attrString("reduction", "mean")}, "loss");
  g.addOutput("loss", kFloat, {});
}

void lmHead(GraphBuilder &g, const std::string &x, const std::string &embedding, int64_t width) {
  const GeneratorOptions &o = g.opts();
  Mod head = Mod().child("lm_head");
  std::string w = o.tiedEmbeddings
                      ? g.addNode("Transpose", head.scope, {embedding}, {attrInts("perm", {1, 0})})
                      : g.addWeight(head.param("weight"), {width, int64_t(o.vocab)});
  g.addNode("MatMul", head.scope, {x, w}, {}, "logits");
  g.addOutput("logits", kFloat, {kBatch, o.seq, o.vocab});
  if (!o.withLoss)
    return;
  g.addInput("labels", kInt64, {kBatch, o.seq});
  std::string logitShape = g.constVector("", {-1, o.vocab});
  std::string flat = g.addNode("Reshape", "", {"logits", logitShape});
  std::string labelShape = g.constVector("", {-1});
  std::string flatLabels = g.addNode("Reshape", "", {"labels", labelShape});
  crossEntropy(g, flat, flatLabels);
}

std::string positionIds(GraphBuilder &g, StringRef scope) {
  std::vector<int64_t> ids(g.opts().seq);
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = i;
  return g.constInts(scope, {1, g.opts().seq}, ids);
}

} // namespace pipec::models
