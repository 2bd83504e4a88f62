//===- GroupLayersTest.cpp - group-layers on generated models -----------===//
#include "TestUtil.h"

#include "models/ModelGenerators.h"
#include "passes/GroupLayers.h"

#include "llvm/Support/raw_ostream.h"

#include <cstdlib>
#include <fstream>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

GroupedGraph generateAndGroup(models::GeneratorOptions options, int64_t batch = 2) {
  return groupGraph(importGenerated(options, batch));
}

std::vector<std::string> kinds(const LayerGraph &lg) {
  std::vector<std::string> out;
  for (const Layer &l : lg.layers)
    out.push_back(layerKindName(l.kind).str());
  return out;
}

int countKind(const LayerGraph &lg, LayerKind kind) {
  int n = 0;
  for (const Layer &l : lg.layers)
    n += l.kind == kind;
  return n;
}

models::GeneratorOptions options(models::Family family, int layers) {
  return models::GeneratorOptions(family, layers, 32, 100,
                                  family == models::Family::Resnet ? 32 : 8, 4);
}

TEST(GroupLayers, GptAtAnyDepthIsEmbeddingBlocksHead) {
  for (int depth : {1, 2, 5, 24}) {
    auto g = generateAndGroup(options(models::Family::Gpt, depth));
    const LayerGraph &lg = g.layers;
    EXPECT_EQ(lg.method, GroupingMethod::ModulePath);
    ASSERT_EQ(static_cast<int>(lg.layers.size()), depth + 2) << "depth " << depth;
    EXPECT_EQ(lg.layers.front().kind, LayerKind::Embedding);
    EXPECT_EQ(lg.layers.back().kind, LayerKind::Head);
    EXPECT_EQ(countKind(lg, LayerKind::Block), depth);
    EXPECT_EQ(lg.layers[1].name, "/transformer/h.0");
    // Exactly the hidden state crosses each boundary: batch 2 x seq 8 x 32 floats.
    for (size_t i = 0; i + 1 < lg.layers.size(); ++i) {
      auto crossing = lg.crossingAfter(i);
      ASSERT_EQ(crossing.size(), 1u) << "boundary " << i << " depth " << depth;
      EXPECT_EQ(lg.boundaryBytes(i), 2 * 8 * 32 * 4);
    }
    // All blocks are the same size and hold their own weights.
    for (int b = 1; b <= depth; ++b) {
      EXPECT_EQ(lg.layers[b].ops.size(), lg.layers[1].ops.size());
      EXPECT_EQ(lg.layers[b].params, lg.layers[1].params);
      EXPECT_EQ(lg.layers[b].flopsForward, lg.layers[1].flopsForward);
    }
    EXPECT_EQ(lg.totalParams(), g.graph->parameterCount());
  }
}

TEST(GroupLayers, BlockParamsMatchTheArchitecture) {
  auto g = generateAndGroup(options(models::Family::Gpt, 2));
  const int64_t h = 32;
  // GPT-2 block: ln_1, ln_2 (2h each), c_attn (h x 3h + 3h), c_proj (h x h + h),
  // c_fc (h x 4h + 4h), mlp c_proj (4h x h + h).
  int64_t expected =
      4 * h + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h);
  EXPECT_EQ(g.layers.layers[1].params, expected);
  // Forward FLOPs of a block are dominated by 2 * tokens * 12 h^2 of GEMMs.
  int64_t tokens = 2 * 8;
  EXPECT_GE(g.layers.layers[1].flopsForward, 2 * tokens * 12 * h * h);
  EXPECT_LE(g.layers.layers[1].flopsForward, 2 * 2 * tokens * 12 * h * h);
}

TEST(GroupLayers, LlamaBertMlpResnet) {
  auto llama = generateAndGroup(options(models::Family::Llama, 3));
  EXPECT_EQ(countKind(llama.layers, LayerKind::Block), 3);
  EXPECT_EQ(llama.layers.layers[1].name, "/model/layers.0");
  EXPECT_EQ(kinds(llama.layers).front(), "embedding");

  auto bert = generateAndGroup(options(models::Family::Bert, 24));
  EXPECT_EQ(bert.layers.layers.size(), 26u);
  EXPECT_EQ(countKind(bert.layers, LayerKind::Block), 24);
  EXPECT_EQ(bert.layers.layers[24].name, "/bert/encoder/layer.23");

  auto mlp = generateAndGroup(options(models::Family::Mlp, 6));
  EXPECT_EQ(countKind(mlp.layers, LayerKind::Block), 6);

  auto resnet = generateAndGroup(options(models::Family::Resnet, 16));
  EXPECT_EQ(countKind(resnet.layers, LayerKind::Block), 16);
  EXPECT_EQ(resnet.layers.layers.front().name, "stem");
  EXPECT_EQ(resnet.layers.layers.back().kind, LayerKind::Head);
  EXPECT_EQ(resnet.layers.layers.size(), 18u);
}

TEST(GroupLayers, TiedEmbeddingIsOneWeightWithTwoUsers) {
  auto o = options(models::Family::Gpt, 2);
  o.tiedEmbeddings = true;
  auto g = generateAndGroup(o);
  auto shared = g.layers.sharedWeights();
  ASSERT_EQ(shared.size(), 1u);
  EXPECT_EQ(g.graph->values[shared[0].first].name, "transformer.wte.weight");
  EXPECT_EQ(shared[0].second, (std::vector<int>{0, 3}));
  // Counted once in the total, in full in each layer that holds a copy: the
  // head holds ln_f (2 x 32) and the tied table (100 x 32).
  int64_t table = 100 * 32;
  EXPECT_EQ(g.layers.layers.back().params, table + 2 * 32);
  EXPECT_EQ(g.layers.totalParams(), g.graph->parameterCount());
}

TEST(GroupLayers, LossGetsItsOwnLayer) {
  auto o = options(models::Family::Gpt, 2);
  o.withLoss = true;
  auto g = generateAndGroup(o);
  EXPECT_EQ(kinds(g.layers),
            (std::vector<std::string>{"embedding", "block", "block", "head", "loss"}));
}

TEST(GroupLayers, RepeatedStructureWithoutNames) {
  // Strip every name a path could come from: node names and weight names.
  auto model = models::generateModel(options(models::Family::Gpt, 4));
  ASSERT_TRUE(!!model);
  auto &graph = *model->mutable_graph();
  for (auto &node : *graph.mutable_node())
    node.clear_name();
  std::map<std::string, std::string> rename;
  int next = 0;
  for (auto &init : *graph.mutable_initializer()) {
    std::string fresh = "w" + std::to_string(next++);
    rename[init.name()] = fresh;
    init.set_name(fresh);
  }
  for (auto &node : *graph.mutable_node())
    for (auto &in : *node.mutable_input())
      if (rename.count(in))
        in = rename[in];
  std::string bytes;
  model->SerializeToString(&bytes);
  ImportOptions io;
  io.bindings.batch = 2;
  io.bindings.seq = 8;
  auto imported = importBytes(bytes, io);
  ASSERT_TRUE(!!imported) << toString(imported.takeError());
  auto lg = groupLayers(*imported);
  ASSERT_TRUE(!!lg) << toString(lg.takeError());
  EXPECT_EQ(lg->method, GroupingMethod::RepeatedStructure);
  EXPECT_EQ(countKind(*lg, LayerKind::Block), 4);
  for (size_t i = 0; i + 1 < lg->layers.size(); ++i)
    EXPECT_EQ(lg->boundaryBytes(i), 2 * 8 * 32 * 4) << "boundary " << i;
}

TEST(GroupLayers, VerifierCatchesABrokenLayerGraph) {
  auto g = generateAndGroup(options(models::Family::Gpt, 2));
  llvm::Error ok = g.layers.verify();
  EXPECT_FALSE(static_cast<bool>(ok));
  llvm::consumeError(std::move(ok));
  LayerGraph broken = g.layers;
  std::swap(broken.layers[1], broken.layers[2]);
  llvm::Error err = broken.verify();
  ASSERT_TRUE(!!err);
  std::string text = toString(std::move(err));
  EXPECT_NE(text.find("from the later layer"), std::string::npos) << text;

  LayerGraph missing = g.layers;
  missing.layers[1].ops.pop_back();
  err = missing.verify();
  ASSERT_TRUE(!!err);
  text = toString(std::move(err));
  EXPECT_NE(text.find("belongs to no layer"), std::string::npos) << text;
}

/// Golden text: set PIPEC_UPDATE_GOLDEN=1 to rewrite after an intended change.
void checkGolden(const LayerGraph &lg, const std::string &name) {
  std::string text;
  llvm::raw_string_ostream os(text);
  lg.print(os);
  os.flush();
  std::string path = std::string(PIPEC_SOURCE_DIR) + "/tests/golden/" + name;
  if (std::getenv("PIPEC_UPDATE_GOLDEN")) {
    std::ofstream(path) << text;
    return;
  }
  ASSERT_TRUE(fileExists(path)) << path << " is missing; run with PIPEC_UPDATE_GOLDEN=1";
  EXPECT_EQ(text, readFile(path)) << "golden " << path;
}

TEST(GroupLayersGolden, Gpt2Layers) {
  checkGolden(generateAndGroup(options(models::Family::Gpt, 2)).layers, "gpt-2l.layergraph.txt");
}

TEST(GroupLayersGolden, TiedLlamaWithLoss) {
  auto o = options(models::Family::Llama, 2);
  o.tiedEmbeddings = true;
  o.withLoss = true;
  checkGolden(generateAndGroup(o).layers, "llama-2l-tied-loss.layergraph.txt");
}

TEST(GroupLayersGolden, Resnet4Blocks) {
  auto o = options(models::Family::Resnet, 4);
  o.hidden = 8;
  checkGolden(generateAndGroup(o, 1).layers, "resnet-4b.layergraph.txt");
}

} // namespace
