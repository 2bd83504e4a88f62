//===- DifferentiateModelsTest.cpp - Whole models against finite differences ===//
//
// The generated MLP, GPT (tied and untied), Llama, a small CNN and a ResNet:
// every weight's gradient from the backward program against finite
// differences of the float32 loss, and the I / W split of each layer.
//
//===----------------------------------------------------------------------===//
#include "tests/GradientCheck.h"

#include "models/ModelGenerators.h"

using namespace pipec;
using namespace pipec::test;

namespace {

/// The name of the value whose gradient \p output is, or "" for a temporary.
std::string gradientOf(const std::string &output) {
  llvm::StringRef name(output);
  if (!name.consume_front("grad:"))
    return "";
  return name.split('#').first.str();
}

/// Every W node writes temporaries or weight gradients, every I node
/// temporaries or activation / input gradients.
void expectSplit(const Differentiated &d) {
  const Graph &graph = d.graph;
  for (size_t l = 0; l < d.backward.inputGrad.size(); ++l) {
    for (const auto &[list, isW] :
         {std::pair(&d.backward.inputGrad[l], false), std::pair(&d.backward.weightGrad[l], true)})
      for (const onnx::NodeProto &node : *list)
        for (const std::string &out : node.output()) {
          std::string of = gradientOf(out);
          if (of.empty())
            continue;
          int id = graph.findValue(of);
          ASSERT_GE(id, 0) << out;
          EXPECT_EQ(graph.values[id].kind == ValueKind::Weight, isW)
              << "layer " << l << (isW ? " W" : " I") << " writes " << out;
        }
  }
}

/// Generates \p options' model with its loss, imports it with its batch and,
/// with \p bindSeq, its sequence bound, differentiates the "loss" output and
/// checks the I / W split; gtest failure and null on an error.
std::unique_ptr<Differentiated> buildGenerated(models::GeneratorOptions options, bool bindSeq) {
  options.withLoss = true;
  auto model = models::generateModel(options);
  if (!model) {
    ADD_FAILURE() << llvm::toString(model.takeError());
    return nullptr;
  }
  std::string bytes;
  model->SerializeToString(&bytes);
  ImportOptions importOptions;
  importOptions.bindings.batch = options.batch;
  if (bindSeq)
    importOptions.bindings.seq = options.seq;
  auto d = build(bytes, {LossSpec::Kind::ModelOutput, "loss", ""}, false, importOptions);
  if (d)
    expectSplit(*d);
  return d;
}

/// The float32 check of a generated model's "loss" output, on \p samples
/// elements of each gradient.
Check lossCheck(int samples) {
  Check check;
  check.eps = 1e-3, check.atol = 2e-3, check.rtol = 2e-2, check.samples = samples;
  check.loss = {LossSpec::Kind::ModelOutput, "loss", ""};
  return check;
}

TEST(Differentiate, MlpEndToEnd) {
  models::GeneratorOptions options(models::Family::Mlp, 2, 6, 5);
  options.batch = 3;
  auto d = buildGenerated(options, /*bindSeq=*/false);
  ASSERT_TRUE(d);
  EXPECT_GE(d->layers.layers.size(), 3u);
  Check check = lossCheck(6);
  check.skipKinks = true;
  EXPECT_GT(checkFiniteDifferences(*d, check), 30);
  EXPECT_EQ(d->backward.weightGrads.size(), 8u);
  // Every layer with weights does its weight gradients in W.
  for (size_t l = 0; l < d->layers.layers.size(); ++l) {
    if (!d->layers.layers[l].weights.empty()) {
      EXPECT_FALSE(d->backward.weightGrad[l].empty()) << "layer " << l;
    }
  }
}

/// Differentiates a small generated decoder (input_ids and labels int64
/// [2, 4]) and checks sampled elements of every weight gradient in float32.
void checkDecoder(models::Family family, bool tied) {
  models::GeneratorOptions options(family, 1, 8, 11, 4, 2);
  options.batch = 2;
  options.tiedEmbeddings = tied;
  auto d = buildGenerated(options, /*bindSeq=*/true);
  ASSERT_TRUE(d);
  Check check = lossCheck(8);
  check.lo = -0.5, check.hi = 0.5;
  check.feeds["input_ids"] = Tensor::fromValues<int64_t>({2, 4}, {1, 5, 10, 3, 0, 7, 7, 2});
  check.feeds["labels"] = Tensor::fromValues<int64_t>({2, 4}, {5, 10, 3, 9, 7, 7, 2, 4});
  EXPECT_GT(checkFiniteDifferences(*d, check), 20);
}

TEST(Differentiate, GptEndToEnd) { checkDecoder(models::Family::Gpt, false); }

TEST(Differentiate, GptTiedEmbeddingsEndToEnd) { checkDecoder(models::Family::Gpt, true); }

TEST(Differentiate, LlamaEndToEnd) { checkDecoder(models::Family::Llama, false); }

TEST(Differentiate, SmallCnnEndToEnd) {
  // images [2, 3, 8, 8] -> Conv 3x3 pad 1 (+ bias) -> BatchNormalization
  // (eval) -> Relu -> MaxPool 2x2 -> Conv 3x3 stride 2 pad 1 ->
  // GlobalAveragePool -> Flatten -> Gemm -> logits [2, 3]; softmax cross
  // entropy as the loss spec.
  GraphBuilder b;
  b.input("images", kDouble, {2, 3, 8, 8});
  doubleWeight(b, "conv1.weight", {4, 3, 3, 3});
  doubleWeight(b, "conv1.bias", {4});
  for (const char *name : {"bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"})
    doubleWeight(b, name, {4});
  doubleWeight(b, "conv2.weight", {5, 4, 3, 3});
  doubleWeight(b, "fc.weight", {3, 5});
  doubleWeight(b, "fc.bias", {3});
  auto &conv1 = b.node("Conv", {"images", "conv1.weight", "conv1.bias"}, {"c1"}, "conv1");
  setIntsAttr(conv1, "pads", {1, 1, 1, 1});
  b.node("BatchNormalization", {"c1", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"},
         {"n1"}, "bn");
  b.node("Relu", {"n1"}, {"r1"}, "relu");
  auto &pool = b.node("MaxPool", {"r1"}, {"p1"}, "maxpool");
  setIntsAttr(pool, "kernel_shape", {2, 2});
  setIntsAttr(pool, "strides", {2, 2});
  auto &conv2 = b.node("Conv", {"p1", "conv2.weight"}, {"c2"}, "conv2");
  setIntsAttr(conv2, "strides", {2, 2});
  setIntsAttr(conv2, "pads", {1, 1, 1, 1});
  b.node("GlobalAveragePool", {"c2"}, {"g"}, "avgpool");
  b.node("Flatten", {"g"}, {"f"}, "flatten");
  auto &fc = b.node("Gemm", {"f", "fc.weight", "fc.bias"}, {"logits"}, "fc");
  setIntAttr(fc, "transB", 1);
  b.output("logits", kDouble);

  Check check;
  check.loss = {LossSpec::Kind::SoftmaxCrossEntropy, "logits", "labels"};
  check.feeds["labels"] = Tensor::fromValues<int64_t>({2}, {0, 2});
  check.skipKinks = true;
  auto d = build(b.serialize(), check.loss, /*inputGrads=*/true);
  ASSERT_TRUE(d);
  expectSplit(*d);
  EXPECT_GT(checkFiniteDifferences(*d, check), 400);
  // conv1 weight and bias, bn weight and bias, conv2, fc weight and bias.
  EXPECT_EQ(d->backward.weightGrads.size(), 7u);
  EXPECT_EQ(d->backward.inputGrads.count("images"), 1u);
}

TEST(Differentiate, ResnetEndToEnd) {
  // One bottleneck block per stage, base width 2, 16 x 16 images, float32.
  models::GeneratorOptions options(models::Family::Resnet, 4, 2, 3, 16);
  options.batch = 2;
  auto d = buildGenerated(options, /*bindSeq=*/false);
  ASSERT_TRUE(d);
  Check check = lossCheck(4);
  check.lo = -0.5, check.hi = 0.5;
  check.skipKinks = true;
  check.feeds["labels"] = Tensor::fromValues<int64_t>({2}, {0, 2});
  EXPECT_GT(checkFiniteDifferences(*d, check), 100);
  // Each block: 4 convolutions (one downsampling) and 4 batch norms, which
  // train their scale and bias only; the stem's conv and batch norm; the
  // classifier's weight and bias.
  EXPECT_EQ(d->backward.weightGrads.size(), size_t(4 * (4 + 4 * 2) + (1 + 2) + 2));
}

} // namespace
