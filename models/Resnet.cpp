//===- Resnet.cpp - ResNet with bottleneck blocks ------------------------===//
//
// torchvision ResNet v1.5 with bottleneck blocks.
//
//===----------------------------------------------------------------------===//
#include "models/Families.h"
#include "models/Layers.h"

using namespace llvm;

namespace pipec::models {
namespace {

/// Bias-free square Conv with weight [Out, In, K, K].
std::string conv(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                 int64_t k, int64_t stride, int64_t pad) {
  std::string w = g.addWeight(m.param("weight"), {out, in, k, k});
  return g.addNode("Conv", m.scope, {x, w},
                   {attrInts("dilations", {1, 1}), attrInt("group", 1),
                    attrInts("kernel_shape", {k, k}), attrInts("pads", {pad, pad, pad, pad}),
                    attrInts("strides", {stride, stride})});
}

/// Eval-mode BatchNorm2d.
std::string batchNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t channels) {
  std::string scale = g.addWeight(m.param("weight"), {channels}, Init::One);
  std::string bias = g.addWeight(m.param("bias"), {channels});
  std::string mean = g.addWeight(m.param("running_mean"), {channels});
  std::string var = g.addWeight(m.param("running_var"), {channels}, Init::One);
  return g.addNode("BatchNormalization", m.scope, {x, scale, bias, mean, var},
                   {attrFloat("epsilon", 1e-5f), attrFloat("momentum", 0.9f)});
}

} // namespace

void buildResnet(GraphBuilder &g) {
  const GeneratorOptions &o = g.opts();
  int64_t c = o.hidden, s = o.seq;
  g.addInput("images", kFloat, {kBatch, 3, s, s});
  Mod root;
  std::string x = conv(g, root.child("conv1"), "images", 3, c, 7, 2, 3);
  x = batchNorm(g, root.child("bn1"), x, c);
  x = g.addNode("Relu", "/relu", {x});
  x = g.addNode("MaxPool", "/maxpool", {x},
                {attrInt("ceil_mode", 0), attrInts("kernel_shape", {3, 3}),
                 attrInts("pads", {1, 1, 1, 1}), attrInts("strides", {2, 2})});
  int blocks[4] = {3, 4, 6, 3};
  if (o.layers != 16)
    for (int stage = 0; stage < 4; ++stage)
      blocks[stage] = o.layers / 4 + (stage < o.layers % 4 ? 1 : 0);
  int64_t in = c;
  for (int stage = 0; stage < 4; ++stage) {
    int64_t planes = c << stage, out = planes * 4;
    std::string layer = "layer" + std::to_string(stage + 1);
    for (int b = 0; b < blocks[stage]; ++b) {
      std::string name = layer + "." + std::to_string(b);
      Mod block{"/" + layer + "/" + name, name};
      int64_t stride = (b == 0 && stage > 0) ? 2 : 1;
      std::string y = conv(g, block.child("conv1"), x, in, planes, 1, 1, 0);
      y = batchNorm(g, block.child("bn1"), y, planes);
      y = g.addNode("Relu", block.child("relu").scope, {y});
      y = conv(g, block.child("conv2"), y, planes, planes, 3, stride, 1);
      y = batchNorm(g, block.child("bn2"), y, planes);
      y = g.addNode("Relu", block.child("relu_1").scope, {y});
      y = conv(g, block.child("conv3"), y, planes, out, 1, 1, 0);
      y = batchNorm(g, block.child("bn3"), y, out);
      std::string identity = x;
      if (b == 0) {
        Mod ds = block.child("downsample");
        Mod dsConv{ds.scope + "/downsample.0", ds.paramPrefix + ".0"};
        Mod dsNorm{ds.scope + "/downsample.1", ds.paramPrefix + ".1"};
        identity = conv(g, dsConv, x, in, out, 1, stride, 0);
        identity = batchNorm(g, dsNorm, identity, out);
      }
      x = g.addNode("Add", block.scope, {y, identity});
      x = g.addNode("Relu", block.child("relu_2").scope, {x});
      in = out;
    }
  }
  x = g.addNode("GlobalAveragePool", "/avgpool", {x});
  x = g.addNode("Flatten", "", {x}, {attrInt("axis", 1)});
  gemm(g, root.child("fc"), x, in, o.vocab, "logits");
  g.addOutput("logits", kFloat, {kBatch, o.vocab});
  if (o.withLoss) {
    g.addInput("labels", kInt64, {kBatch});
    crossEntropy(g, "logits", "labels");
  }
}

} // namespace pipec::models
