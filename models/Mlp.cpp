//===- Mlp.cpp - A multi-layer perceptron --------------------------------===//
//
// input_proj, `layers` x (Gemm + Relu), head; MSE loss.
//
//===----------------------------------------------------------------------===//
#include "models/Families.h"
#include "models/Layers.h"

using namespace llvm;

namespace pipec::models {

void buildMlp(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t in = o.vocab, e = o.hidden;
  g.addInput("x", kFloat, {kBatch, in});
  Mod root;
  std::string x = gemm(g, root.child("input_proj"), "x", in, e);
  for (int l = 0; l < o.layers; ++l) {
    Mod layer = root.child("layers." + Twine(l));
    x = gemm(g, layer.child("linear"), x, e, e);
    x = g.addNode("Relu", layer.child("act").scope, {x});
  }
  gemm(g, root.child("head"), x, e, in, "y");
  g.addOutput("y", kFloat, {kBatch, in});
  if (!o.withLoss)
    return;
  g.addInput("labels", kFloat, {kBatch, in});
  std::string diff = g.addNode("Sub", "/loss_fn", {"y", "labels"});
  std::string sq = g.addNode("Mul", "/loss_fn", {diff, diff});
  g.addNode("ReduceMean", "/loss_fn", {sq}, {attrInt("keepdims", 0)}, "loss");
  g.addOutput("loss", kFloat, {});
}

} // namespace pipec::models
