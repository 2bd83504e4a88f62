//===- RealModelsTest.cpp - Models written by real exporters ------------===//
//
// Files made by torch, keras2onnx, paddle2onnx, onnxruntime's tools and CNTK
// (see the shared models' PROVENANCE.md). Skipped where they are absent.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "passes/GroupLayers.h"

#include <optional>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

/// Imports and groups \p path, with sequence-like dimensions bound to \p seq
/// where given and past-length ones to \p past.
GroupedGraph load(const std::string &path, std::optional<int64_t> seq = std::nullopt,
                  int64_t past = 0) {
  ImportOptions options;
  if (seq)
    options.bindings.seq = *seq;
  options.bindings.past = past;
  return groupGraph(loadFile(path, options));
}

int blocks(const LayerGraph &lg) {
  int n = 0;
  for (const Layer &l : lg.layers)
    n += l.kind == LayerKind::Block;
  return n;
}

#define REAL_MODEL(var, rel)                                                                       \
  std::string var = realModel(rel);                                                                \
  if (var.empty())                                                                                 \
    GTEST_SKIP() << "shared real models are absent";

TEST(RealModels, BertLargeKeras) {
  REAL_MODEL(path, "bert_large_tf_keras2onnx.onnx");
  auto m = load(path);
  EXPECT_EQ(m.layers.method, GroupingMethod::ModulePath);
  EXPECT_EQ(blocks(m.layers), 24);
  EXPECT_EQ(m.layers.layers.size(), 26u);
  EXPECT_EQ(m.layers.layers.front().kind, LayerKind::Embedding);
  EXPECT_EQ(m.layers.layers.back().kind, LayerKind::Head);
  EXPECT_EQ(m.layers.layers[24].name, "tf_bert_for_question_answering/bert/encoder/layer_._23");
  // Keras' Tensordot reshapes are shape arithmetic and fold away.
  for (const Op &op : m.graph->ops)
    EXPECT_NE(op.opType, "Shape");
}

TEST(RealModels, DistilbertTorch) {
  REAL_MODEL(path, "distilbert_tiny_torch.onnx");
  auto m = load(path, 8);
  EXPECT_EQ(blocks(m.layers), 2);
  EXPECT_EQ(m.layers.layers.front().kind, LayerKind::Embedding);
  EXPECT_EQ(m.layers.layers.back().kind, LayerKind::Head);
  // The hidden state [1, 8, 2] floats crosses from the embedding to block 0.
  EXPECT_EQ(m.layers.boundaryBytes(0), 1 * 8 * 2 * 4);
}

TEST(RealModels, Resnet50Caffe2) {
  REAL_MODEL(path, "resnet50_caffe2_light.onnx");
  auto m = load(path);
  EXPECT_EQ(blocks(m.layers), 16);
  EXPECT_EQ(m.layers.layers.size(), 18u);
  EXPECT_EQ(m.layers.layers.front().name, "stem");
  EXPECT_EQ(m.layers.layers[1].name, "gpu_0/res2_0");
  EXPECT_EQ(m.layers.layers[16].name, "gpu_0/res5_2");
  // ResNet-50 has 25.5 M parameters; the light file keeps every weight
  // (as fills) except the BN running statistics.
  EXPECT_NEAR(static_cast<double>(m.layers.totalParams()), 25.5e6, 1.0e6);
  // The stage outputs: 256 x 56 x 56 floats leave the res2 stage.
  EXPECT_EQ(m.layers.boundaryBytes(3), 256 * 56 * 56 * 4);
}

TEST(RealModels, LlamaGenaiFp16ExternalData) {
  REAL_MODEL(path, "llama_tiny_genai_fp16/model.onnx");
  auto m = load(path, 4);
  EXPECT_EQ(blocks(m.layers), 2);
  EXPECT_EQ(m.layers.layers[1].name, "/model/layers.0");
  EXPECT_EQ(m.layers.layers.back().kind, LayerKind::Head);
  // Weights live in model.onnx.data, mapped.
  ASSERT_GE(m.graph->files.size(), 2u);
  int lmHead = -1;
  for (int w : m.layers.layers.back().weights)
    if (m.graph->values[w].shape == std::vector<int64_t>{16, 32000})
      lmHead = w;
  ASSERT_GE(lmHead, 0);
  EXPECT_EQ(m.graph->values[lmHead].type, DType::F16);
  EXPECT_EQ(m.graph->values[lmHead].storage->file, 1u);
  const Value &logits = m.graph->values[m.graph->outputs[0]];
  EXPECT_EQ(logits.shape, (std::vector<int64_t>{1, 4, 32000}));
}

TEST(RealModels, Gpt2OnnxruntimeFused) {
  REAL_MODEL(path, "gpt2_tiny_ort_fused.onnx");
  auto m = load(path, 4, 2);
  EXPECT_EQ(blocks(m.layers), 5);
  const Value &logits = m.graph->values[m.graph->outputs[0]];
  EXPECT_EQ(logits.shape, (std::vector<int64_t>{1, 4, 1000}));
  const Value &present = m.graph->values[m.graph->outputs[1]];
  EXPECT_EQ(present.shape, (std::vector<int64_t>{2, 1, 4, 6, 8}));
}

TEST(RealModels, MobilenetPaddleConstantWeights) {
  REAL_MODEL(path, "ppocrv2_cls_mobilenetv3_paddle.onnx");
  auto m = load(path);
  // Weights are Constant nodes; they still count as parameters.
  EXPECT_GT(m.layers.totalParams(), 100000);
  EXPECT_GE(blocks(m.layers), 2);
  EXPECT_EQ(m.graph->values[m.graph->outputs[0]].shape, (std::vector<int64_t>{6, 2}));
}

TEST(RealModels, LstmScanStaysOpaque) {
  REAL_MODEL(path, "lstm_scan_cntk.onnx");
  auto m = load(path, 5);
  int scans = 0;
  for (const Op &op : m.graph->ops)
    scans += op.opType == "Scan";
  EXPECT_EQ(scans, 4);
  EXPECT_EQ(m.graph->inputs.size(), 1u) << "20 of 21 inputs are initializers";
}

} // namespace
