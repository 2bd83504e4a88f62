//===- BalanceStagesTest.cpp - balance-stages ---------------------------===//
#include "ClosedForms.h"
#include "TestUtil.h"

#include "compiler/schedule/Schedule.h"
#include "models/ModelGenerators.h"
#include "passes/BalanceStages.h"
#include "passes/GroupLayers.h"

#include "llvm/Support/FormatVariadic.h"

#include <iostream>
#include <random>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;
using llvm::toString;

namespace {

/// A chain of synthetic layers with given costs, for exactness tests.
struct Synthetic {
  Graph graph;
  LayerGraph lg;
  CostTable table;
  HardwareSpec hw;

  Synthetic(const std::vector<double> &times, const std::vector<int64_t> &boundary,
            const std::vector<int64_t> &params, const std::vector<int64_t> &activations) {
    graph.path = "synthetic";
    lg.graph = &graph;
    hw.name = "synthetic";
    hw.devicesPerNode = 8;
    hw.intraNode = {"nvlink", 1e9, 1e-6};
    hw.interNode = {"ib", 1e8, 1e-5};
    for (size_t l = 0; l < times.size(); ++l) {
      Layer layer;
      layer.name = "layer" + std::to_string(l);
      layer.kind = LayerKind::Block;
      layer.params = params[l];
      layer.ops = {static_cast<int>(l)};
      lg.layers.push_back(layer);
      LayerCost cost;
      cost.name = layer.name;
      cost.params = params[l];
      cost.time = {times[l] / 3, times[l] / 3, times[l] / 3};
      cost.boundaryBytes = boundary[l];
      cost.activationBytes = activations[l];
      table.layers.push_back(cost);
    }
  }

  BalanceOptions options(int stages, int64_t limit) const {
    BalanceOptions o;
    o.shape = test::pipelineShape(ScheduleKind::OneFOneB, stages, 1, 4 * stages);
    o.training.optimizer = Optimizer::SGD;
    o.training.mixedPrecision = false;
    for (int r = 0; r < stages; ++r) {
      o.rankCosts.push_back(&table);
      o.rankHardware.push_back(hw);
      o.memoryLimit.push_back(limit);
    }
    return o;
  }
};

/// Brute force over every composition of L layers into K non-empty chunks,
/// with chunk time and memory computed independently of the pass.
double bruteForce(const Synthetic &s, const BalanceOptions &o, std::vector<int> &bestCuts) {
  int layers = static_cast<int>(s.lg.layers.size()), k = o.shape.stages();
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> cuts(k + 1, 0);
  cuts[k] = layers;
  std::function<void(int, int)> rec = [&](int chunk, int start) {
    if (chunk == k - 1) {
      cuts[chunk] = start;
      double worst = 0;
      bool fits = true;
      for (int c = 0; c < k; ++c) {
        double t = 0;
        int64_t params = 0, act = 0;
        for (int l = cuts[c]; l < cuts[c + 1]; ++l) {
          t += s.table.layers[l].totalTime();
          params += s.lg.layers[l].params;
          act += s.table.layers[l].activationBytes;
        }
        if (c + 1 < k) // send the boundary forward and its gradient back
          t += 2 * (s.hw.intraNode.latency +
                    s.table.layers[cuts[c + 1] - 1].boundaryBytes / s.hw.intraNode.bandwidth);
        int64_t memory = params * 8 /* SGD fp32 */ + std::min<int64_t>(4 * k, k - c) * act;
        if (o.memoryLimit[c] > 0 && memory > o.memoryLimit[c])
          fits = false;
        worst = std::max(worst, t);
      }
      if (fits && worst < best) {
        best = worst;
        bestCuts = cuts;
      }
      return;
    }
    cuts[chunk] = start;
    for (int next = start + 1; next <= layers - (k - chunk - 1); ++next) {
      cuts[chunk + 1] = next;
      rec(chunk + 1, next);
    }
  };
  rec(0, 0);
  return best;
}

TEST(BalanceStages, ExactOnHundredsOfRandomInstances) {
  std::mt19937_64 rng(7);
  int checked = 0, infeasible = 0;
  for (int trial = 0; trial < 400; ++trial) {
    int layers = 1 + static_cast<int>(rng() % 9);
    int stages = 1 + static_cast<int>(rng() % std::min(layers, 4));
    std::vector<double> times;
    std::vector<int64_t> boundary, params, activations;
    for (int l = 0; l < layers; ++l) {
      times.push_back(0.001 * static_cast<double>(1 + rng() % 1000));
      boundary.push_back(static_cast<int64_t>(rng() % 4000000));
      params.push_back(static_cast<int64_t>(rng() % 1000));
      activations.push_back(static_cast<int64_t>(rng() % 1000));
    }
    Synthetic s(times, boundary, params, activations);
    int64_t limit = trial % 3 == 0 ? static_cast<int64_t>(4000 + rng() % 40000) : 0;
    BalanceOptions o = s.options(stages, limit);
    std::vector<int> cuts;
    double expected = bruteForce(s, o, cuts);
    auto plan = balanceStages(s.lg, o);
    if (expected == std::numeric_limits<double>::infinity()) {
      ASSERT_FALSE(!!plan) << "trial " << trial << ": nothing fits, the pass found a plan";
      std::string err = toString(plan.takeError());
      EXPECT_NE(err.find("bytes"), std::string::npos) << err;
      ++infeasible;
      continue;
    }
    ASSERT_TRUE(!!plan) << "trial " << trial << ": " << toString(plan.takeError());
    // The DP's min-max is exact; `time` then picks the fastest simulated
    // step, which may take a larger bottleneck.
    EXPECT_NEAR(plan->leastBottleneck, expected, 1e-12 * expected) << "trial " << trial;
    EXPECT_GE(plan->bottleneck, expected * (1 - 1e-12)) << "trial " << trial;
    for (BalanceMethod other : {BalanceMethod::Params, BalanceMethod::Uniform}) {
      BalanceOptions oo = o;
      oo.method = other;
      auto alt = balanceStages(s.lg, oo);
      if (alt && alt->fitsMemory)
        EXPECT_LE(plan->simulatedStep, alt->simulatedStep * (1 + 1e-12))
            << "trial " << trial << ": time " << plan->layout << " vs "
            << balanceMethodName(other).str() << " " << alt->layout;
      else if (!alt)
        llvm::consumeError(alt.takeError());
    }
    for (const ChunkPlan &c : plan->chunks)
      EXPECT_FALSE(c.empty()) << "trial " << trial;
    for (const RankPlan &r : plan->ranks) {
      if (limit > 0) {
        EXPECT_LE(r.peakMemory, limit) << "trial " << trial;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 250);
  EXPECT_GT(infeasible, 0) << "some memory limits must bind";
}

TEST(BalanceStages, MostEvenAmongOptimalPartitions) {
  // Four equal layers and a light one on two stages: the bottleneck is two
  // layers either way; the even split puts the light layer with one heavy.
  Synthetic s({1, 1, 1, 1, 0.1}, {0, 0, 0, 0, 0}, {1, 1, 1, 1, 1}, {0, 0, 0, 0, 0});
  auto plan = balanceStages(s.lg, s.options(3, 0));
  ASSERT_TRUE(!!plan) << toString(plan.takeError());
  EXPECT_EQ(plan->chunks[0].lastLayer, 1);
  EXPECT_EQ(plan->chunks[1].lastLayer, 2);
  EXPECT_EQ(plan->chunks[2].lastLayer, 4);
}

TEST(BalanceStages, FewerLayersThanStagesIsAnError) {
  Synthetic s({1, 1}, {0, 0}, {1, 1}, {0, 0});
  auto plan = balanceStages(s.lg, s.options(3, 0));
  ASSERT_FALSE(!!plan);
  std::string err = toString(plan.takeError());
  EXPECT_NE(err.find("cannot split 2 layers into 3 stages"), std::string::npos) << err;
}

TEST(BalanceStages, MemoryErrorNamesTheLayerOrStage) {
  Synthetic s({1, 1, 1, 1}, {0, 0, 0, 0}, {100, 100, 100, 100000}, {0, 0, 0, 0});
  auto plan = balanceStages(s.lg, s.options(2, 10000));
  ASSERT_FALSE(!!plan);
  std::string err = toString(plan.takeError());
  EXPECT_NE(err.find("layer 3 ('layer3') alone needs 800000 bytes"), std::string::npos) << err;

  Synthetic t({1, 1, 1, 1}, {0, 0, 0, 0}, {1000, 1000, 1000, 1000}, {0, 0, 0, 0});
  plan = balanceStages(t.lg, t.options(2, 9000)); // each layer fits, no split of 4 does
  ASSERT_FALSE(!!plan);
  err = toString(plan.takeError());
  EXPECT_NE(err.find("no partition into 2 stages fits"), std::string::npos) << err;
  EXPECT_NE(err.find("needs 16000 bytes against a limit of 9000"), std::string::npos) << err;
}

TEST(BalanceStages, LayoutParsing) {
  models::GeneratorOptions o(models::Family::Gpt, 6, 16, 32, 4, 2);
  o.withLoss = true;
  GroupedGraph g = groupGraph(importGenerated(o));
  const LayerGraph &lg = g.layers;
  ASSERT_EQ(lg.layers.size(), 9u); // embedding, 6 blocks, head, loss
  auto ranges = parseLayout("E,t*2|t*3|t,L", lg, 3);
  ASSERT_TRUE(!!ranges) << toString(ranges.takeError());
  EXPECT_EQ(*ranges, (std::vector<std::pair<int, int>>{{0, 2}, {3, 5}, {6, 8}}));
  ranges = parseLayout("(t|)*2t*4,L", lg, 3); // the embedding may not be skipped
  ASSERT_FALSE(!!ranges);
  EXPECT_NE(toString(ranges.takeError()).find("stage 0: 't' wants a block"), std::string::npos);
  ranges = parseLayout("E|(tt|)*3L", lg, 5);
  ASSERT_TRUE(!!ranges) << toString(ranges.takeError());
  EXPECT_EQ(ranges->back(), (std::pair<int, int>{7, 8}));
  ranges = parseLayout("E,t*6||L", lg, 3); // an empty stage, asked for
  ASSERT_TRUE(!!ranges) << toString(ranges.takeError());
  EXPECT_EQ((*ranges)[1], (std::pair<int, int>{7, 6}));
  ranges = parseLayout("E,t*6|L", lg, 3);
  ASSERT_FALSE(!!ranges);
  EXPECT_NE(toString(ranges.takeError()).find("has 2 stages, the plan has 3"), std::string::npos);
  ranges = parseLayout("E,t*5|L", lg, 2);
  ASSERT_FALSE(!!ranges);
  EXPECT_NE(toString(ranges.takeError()).find("'L' wants the layers after the last block"),
            std::string::npos);
  ranges = parseLayout("E,t*6,X|L", lg, 2);
  ASSERT_FALSE(!!ranges);
  EXPECT_NE(toString(ranges.takeError()).find("unknown token 'X'"), std::string::npos);
}

TEST(BalanceStages, UniformAndParamsMethods) {
  Synthetic s({1, 2, 3, 4, 5, 6, 7}, {0, 0, 0, 0, 0, 0, 0}, {10, 10, 10, 10, 10, 10, 40},
              {0, 0, 0, 0, 0, 0, 0});
  BalanceOptions o = s.options(3, 0);
  o.method = BalanceMethod::Uniform;
  auto uniform = balanceStages(s.lg, o);
  ASSERT_TRUE(!!uniform);
  EXPECT_EQ(uniform->chunks[0].lastLayer, 2); // 3, 2, 2 layers
  EXPECT_EQ(uniform->chunks[1].lastLayer, 4);
  o.method = BalanceMethod::Params;
  auto params = balanceStages(s.lg, o);
  ASSERT_TRUE(!!params);
  // Params 10 x 6 and 40: min-max is 40, the heavy layer alone.
  EXPECT_EQ(params->chunks[2].firstLayer, 6);
  EXPECT_EQ(params->chunks[2].params, 40);
  o.method = BalanceMethod::Time;
  auto time = balanceStages(s.lg, o);
  ASSERT_TRUE(!!time);
  EXPECT_LE(time->bottleneck, params->bottleneck);
  EXPECT_LE(time->bottleneck, uniform->bottleneck);
}

/// The ONNX bytes of a Llama 3 shape with light weights: vocabulary 128256,
/// 8 key/value heads, batch 1; "" (and a failure) when it is not generated.
std::string lightLlama(int layers, int hidden, int seq, int heads, int ffn, bool withLoss) {
  models::GeneratorOptions o(models::Family::Llama, layers, hidden, 128256, seq, heads);
  o.kvHeads = 8;
  o.ffn = ffn;
  o.batch = 1;
  o.lightWeights = true;
  o.withLoss = withLoss;
  auto model = models::generateModel(o);
  EXPECT_TRUE(!!model) << toString(model.takeError());
  std::string bytes;
  if (model)
    model->SerializeToString(&bytes);
  return bytes;
}

/// Llama 3 405B (Meta, "The Llama 3 Herd of Models", 2024): 126 blocks,
/// hidden 16384, vocabulary 128256, sequence 8192, 16 pipeline stages with
/// tensor parallelism inside each node, so every stage boundary crosses
/// nodes. Meta put one block fewer on the first and the last stage.
TEST(BalanceStages, Llama405BShapeHasLighterFirstAndLastStages) {
  std::string bytes = lightLlama(126, 16384, 8192, 128, 53248, false);
  ASSERT_FALSE(bytes.empty());
  EXPECT_LT(bytes.size(), 8u << 20) << "light weights keep the file small";
  ImportOptions io;
  io.bindings.seq = 8192;
  GroupedGraph g = groupGraph(importBytes(bytes, io));
  const LayerGraph &lg = g.layers;
  ASSERT_EQ(lg.layers.size(), 128u);
  EXPECT_NEAR(static_cast<double>(lg.totalParams()), 405e9, 5e9);
  auto hw = builtinHardware("h100");
  ASSERT_TRUE(!!hw);
  hw->devicesPerNode = 1; // one stage per node
  CostTable table = computeCosts(lg, *hw, Precision::BF16);
  BalanceOptions b;
  b.shape = test::pipelineShape(ScheduleKind::OneFOneB, 16, 1, 64);
  for (int r = 0; r < 16; ++r) {
    b.rankCosts.push_back(&table);
    b.rankHardware.push_back(*hw);
    b.memoryLimit.push_back(0);
  }
  auto plan = balanceStages(lg, b);
  ASSERT_TRUE(!!plan) << toString(plan.takeError());
  EXPECT_EQ(plan->layout, "E,t*7|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*8|t*7,L");
}

/// The simulated step of `time`, `params`, `uniform`, and of the min-max
/// partition alone (what `time` chose before it judged steps).
struct MethodSteps {
  double time = 0, params = 0, uniform = 0, minMax = 0;
  std::string timeLayout, minMaxLayout;
  int candidates = 0;
};

MethodSteps methodSteps(const LayerGraph &lg, const CostTable &table, const HardwareSpec &hw,
                        ScheduleKind kind, int stages, int virtualStages, int microbatches) {
  BalanceOptions b;
  b.shape = test::pipelineShape(kind, stages, virtualStages, microbatches);
  for (int r = 0; r < stages; ++r) {
    b.rankCosts.push_back(&table);
    b.rankHardware.push_back(hw);
    b.memoryLimit.push_back(0);
  }
  MethodSteps out;
  auto run = [&](BalanceMethod method, int maxCandidates) {
    BalanceOptions o = b;
    o.method = method;
    o.maxCandidates = maxCandidates;
    auto plan = balanceStages(lg, o);
    EXPECT_TRUE(!!plan) << (plan ? "" : toString(plan.takeError()));
    return plan ? *plan : StagePlan();
  };
  StagePlan time = run(BalanceMethod::Time, BalanceOptions().maxCandidates);
  out.time = time.simulatedStep;
  out.timeLayout = time.layout;
  out.candidates = time.candidatesSimulated;
  out.params = run(BalanceMethod::Params, 0).simulatedStep;
  out.uniform = run(BalanceMethod::Uniform, 0).simulatedStep;
  StagePlan minMax = run(BalanceMethod::Time, 1); // the DP's optimum only
  out.minMax = minMax.simulatedStep;
  out.minMaxLayout = minMax.layout;
  EXPECT_GT(out.time, 0);
  return out;
}

/// `time` is the least simulated step among the layouts it weighs, which
/// include those of `params` and `uniform`: on GPT, Llama and BERT shapes
/// and every schedule family, it is never slower than either, nor than the
/// exact min-max partition it used to return.
TEST(BalanceStages, TimeNeverPredictsASlowerStepThanParamsOrUniform) {
  auto h100 = builtinHardware("h100");
  ASSERT_TRUE(!!h100);
  models::GeneratorOptions gpt(models::Family::Gpt, 24, 2048, 50257, 1024, 16);
  models::GeneratorOptions llama(models::Family::Llama, 16, 2048, 32000, 2048, 16);
  llama.kvHeads = 4;
  models::GeneratorOptions bert(models::Family::Bert, 24, 1024, 30522, 512, 16);
  struct Shape {
    ScheduleKind kind;
    int v, m;
  };
  for (models::GeneratorOptions o : {gpt, llama, bert}) {
    o.batch = 1;
    o.lightWeights = true;
    o.withLoss = true;
    GroupedGraph g = groupGraph(importGenerated(o));
    ASSERT_FALSE(g.layers.layers.empty());
    CostTable table = computeCosts(g.layers, *h100, Precision::BF16);
    for (Shape shape : {Shape{ScheduleKind::OneFOneB, 1, 16}, Shape{ScheduleKind::GPipe, 1, 8},
                        Shape{ScheduleKind::Interleaved, 2, 16}, Shape{ScheduleKind::ZBH1, 1, 16},
                        Shape{ScheduleKind::ZBV, 2, 16}}) {
      MethodSteps s = methodSteps(g.layers, table, *h100, shape.kind, 4, shape.v, shape.m);
      std::string what =
          formatv("{0} {1} V={2} M={3}: time {4:e4} ({5}), min-max {6:e4} ({7}), "
                  "params {8:e4}, uniform {9:e4}",
                  models::familyName(o.family), scheduleName(shape.kind), shape.v, shape.m, s.time,
                  s.timeLayout, s.minMax, s.minMaxLayout, s.params, s.uniform)
              .str();
      EXPECT_LE(s.time, s.params * (1 + 1e-12)) << what;
      EXPECT_LE(s.time, s.uniform * (1 + 1e-12)) << what;
      EXPECT_LE(s.time, s.minMax * (1 + 1e-12)) << what;
      EXPECT_LE(s.candidates, BalanceOptions().maxCandidates) << what;
    }
  }
}

/// The Llama 3 8B shape of the issue: 32 blocks, width 4096, 32 heads (8
/// key/value), feed-forward 14336, vocabulary 128256, sequence 4096; P = 4,
/// M = 16, 1F1B, H100, bf16 with Adam. The exact min-max partition (the
/// old `time`) could predict a slower step than `uniform`: its bottleneck
/// stage is as fast as it can be, but the step also pays the warm-up and
/// cool-down through every stage and the optimizer over each rank's
/// weights. `time` simulates each candidate and keeps the fastest step. The
/// compiled plans: docs/USER_GUIDE.md, "Balancing".
TEST(BalanceStages, Llama3_8BShapeTimeIsTheFastestStep) {
  std::string bytes = lightLlama(32, 4096, 4096, 32, 14336, true);
  ASSERT_FALSE(bytes.empty());
  ImportOptions io;
  io.bindings.seq = 4096;
  GroupedGraph g = groupGraph(importBytes(bytes, io));
  ASSERT_EQ(g.layers.layers.size(), 35u); // embedding, 32 blocks, head, loss
  EXPECT_NEAR(static_cast<double>(g.layers.totalParams()), 8.03e9, 0.05e9);
  auto h100 = builtinHardware("h100");
  ASSERT_TRUE(!!h100);
  CostTable table = computeCosts(g.layers, *h100, Precision::BF16);
  MethodSteps s = methodSteps(g.layers, table, *h100, ScheduleKind::OneFOneB, 4, 1, 16);
  std::string what =
      formatv("time {0:f4} s ({1}, {2} candidates), min-max {3:f4} s ({4}), "
              "params {5:f4} s, uniform {6:f4} s",
              s.time, s.timeLayout, s.candidates, s.minMax, s.minMaxLayout, s.params, s.uniform)
          .str();
  EXPECT_LE(s.time, s.params) << what;
  EXPECT_LE(s.time, s.uniform) << what;
  // Since W adds each microbatch's gradients into the accumulators, the
  // min-max layout (E,t*8|t*9|t*8|t*7,L) is also the fastest step found.
  EXPECT_LE(s.time, s.minMax) << what;
  EXPECT_EQ(s.timeLayout, "E,t*8|t*9|t*8|t*7,L") << what;
  RecordProperty("steps", what);
  std::cout << what << "\n";
}

TEST(BalanceStages, HeterogeneousRanksGetProportionateWork) {
  models::GeneratorOptions o(models::Family::Gpt, 48, 4096, 32000, 2048, 32);
  o.batch = 1;
  o.lightWeights = true;
  GroupedGraph g = groupGraph(importGenerated(o));
  const LayerGraph &lg = g.layers;
  ASSERT_FALSE(lg.layers.empty());
  auto h100 = builtinHardware("h100");
  auto a100 = builtinHardware("a100");
  ASSERT_TRUE(h100 && a100);
  CostTable fast = computeCosts(lg, *h100, Precision::BF16);
  CostTable slow = computeCosts(lg, *a100, Precision::BF16);
  BalanceOptions b;
  b.shape = test::pipelineShape(ScheduleKind::OneFOneB, 4, 1, 16);
  b.rankCosts = {&fast, &fast, &slow, &slow};
  b.rankHardware = {*h100, *h100, *a100, *a100};
  b.memoryLimit = {0, 0, 0, 0};
  auto plan = balanceStages(lg, b);
  ASSERT_TRUE(!!plan) << toString(plan.takeError());
  auto blocks = [&](const ChunkPlan &c) { return c.lastLayer - c.firstLayer + 1; };
  // Per-block time ratio A100 / H100 on this model.
  double ratio = slow.layers[1].totalTime() / fast.layers[1].totalTime();
  EXPECT_GT(ratio, 2.0);
  double share = static_cast<double>(blocks(plan->chunks[1])) / blocks(plan->chunks[2]);
  EXPECT_NEAR(share, ratio, 0.6) << plan->layout;
  // And the slowest chunk is within one A100 block of the mean.
  EXPECT_LT(plan->imbalance, 1.15) << plan->layout;
}

TEST(BalanceStages, ClosedFormsOfTheStepTime) {
  // Equal unit chunks: 1F1B and GPipe bubble (P-1)/(M+P-1), interleaved
  // (P-1)/(VM+P-1), ZB-H1 makespan 3M+P-1 with F = I = W.
  auto chunks = [](int p, int v, ScheduleKind kind) {
    std::vector<ChunkPlan> out;
    for (int k = 0; k < p * v; ++k) {
      ChunkPlan c;
      c.index = k;
      c.rank = rankOfChunk(kind, p, v, k);
      c.time = {1.0 / v, 1.0 / v, 1.0 / v};
      out.push_back(c);
    }
    return out;
  };
  double bubble;
  predictStepTime(ScheduleKind::OneFOneB, 4, 6, chunks(4, 1, ScheduleKind::OneFOneB), bubble);
  EXPECT_NEAR(bubble, 3.0 / 9.0, 1e-12);
  predictStepTime(ScheduleKind::GPipe, 4, 24, chunks(4, 1, ScheduleKind::GPipe), bubble);
  EXPECT_NEAR(bubble, 3.0 / 27.0, 1e-12);
  predictStepTime(ScheduleKind::Interleaved, 4, 8, chunks(4, 2, ScheduleKind::Interleaved), bubble);
  EXPECT_NEAR(bubble, 3.0 / (16.0 + 3.0), 1e-12);
  double zb = predictStepTime(ScheduleKind::ZBH1, 4, 8, chunks(4, 1, ScheduleKind::ZBH1), bubble);
  EXPECT_NEAR(zb, 3 * 8 + 4 - 1, 1e-12);
}

TEST(ScheduleKind, ShapesAndPlacement) {
  EXPECT_EQ(rankOfChunk(ScheduleKind::ZBV, 4, 2, 0), 0);
  EXPECT_EQ(rankOfChunk(ScheduleKind::ZBV, 4, 2, 4), 3);
  EXPECT_EQ(rankOfChunk(ScheduleKind::ZBV, 4, 2, 7), 0);
  EXPECT_EQ(rankOfChunk(ScheduleKind::Interleaved, 4, 2, 5), 1);
  EXPECT_EQ(inFlightActivations(ScheduleKind::OneFOneB, 4, 1, 8, 0), 4);
  EXPECT_EQ(inFlightActivations(ScheduleKind::OneFOneB, 4, 1, 8, 3), 1);
  EXPECT_EQ(inFlightActivations(ScheduleKind::GPipe, 4, 1, 8, 3), 8);
  // ZB-H2 at P = 4, M = 16 holds 2P - 1 = 7 on every rank, from F to W.
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(inFlightActivations(ScheduleKind::ZBH2, 4, 1, 16, r), 7) << "rank " << r;
  llvm::Error err = checkScheduleShape(ScheduleKind::DualPipeV, 4, 2, 6);
  ASSERT_TRUE(!!err);
  EXPECT_NE(toString(std::move(err)).find("M >= 2P"), std::string::npos);
  err = checkScheduleShape(ScheduleKind::OneFOneB, 4, 2, 8);
  ASSERT_TRUE(!!err);
  EXPECT_NE(toString(std::move(err)).find("--virtual-stages 1"), std::string::npos);
  EXPECT_FALSE(static_cast<bool>(checkScheduleShape(ScheduleKind::ZBV, 4, 2, 4)));
}

TEST(MemoryModel, BytesPerParamAndSizes) {
  TrainingSetup adam;
  EXPECT_EQ(bytesPerParam(adam), 16);
  adam.mixedPrecision = false;
  EXPECT_EQ(bytesPerParam(adam), 16);
  TrainingSetup sgd;
  sgd.optimizer = Optimizer::SGD;
  sgd.mixedPrecision = false;
  EXPECT_EQ(bytesPerParam(sgd), 8);
  sgd.optimizer = Optimizer::Momentum;
  EXPECT_EQ(bytesPerParam(sgd), 12);
  TrainingSetup infer;
  infer.training = false;
  EXPECT_EQ(bytesPerParam(infer), 2);
  // ZeRO-1 over 8 replicas: AdamW in mixed precision keeps its bf16 weight
  // and gradient (4 bytes) and 1/8 of the fp32 master and moments (12).
  TrainingSetup zero;
  zero.optimizerShards = 8;
  EXPECT_EQ(optimizerBytesPerParam(zero), 12);
  EXPECT_EQ(weightStateBytes(8000, zero), 8000 * 4 + 8000 * 12 / 8);
  EXPECT_EQ(optimizerStateBytes(8000, zero), 12000);
  EXPECT_EQ(optimizerStateBytes(1, zero), 2); // 12 bytes over 8, rounded up
  zero.optimizer = Optimizer::SGD;
  zero.mixedPrecision = false;
  EXPECT_EQ(weightStateBytes(1000, zero), 8000); // SGD in fp32 has no state to shard
  // Mixed precision moves bf16 gradients; autocast keeps the run's types:
  // float32 weights (the masters), float32 gradients (moved at 4 bytes),
  // the moments sharded, and its bf16 copies counted by the layers.
  TrainingSetup mixed;
  EXPECT_EQ(gradientBytesPerParam(mixed), 2);
  TrainingSetup autocast;
  autocast.autocast = true;
  autocast.optimizerShards = 8;
  EXPECT_EQ(gradientBytesPerParam(autocast), 4);
  EXPECT_EQ(bytesPerParam(autocast), 16);
  EXPECT_EQ(optimizerBytesPerParam(autocast), 8);
  EXPECT_EQ(weightStateBytes(8000, autocast), 8000 * 8 + 8000 * 8 / 8);
  EXPECT_EQ(*parseByteSize("80GB", "memory-limit"), 80000000000);
  EXPECT_EQ(*parseByteSize("64GiB", "memory-limit"), 64ll << 30);
  EXPECT_EQ(*parseByteSize("1.5e9", "memory-limit"), 1500000000);
  auto bad = parseByteSize("12 parsecs", "memory-limit");
  ASSERT_FALSE(!!bad);
  EXPECT_NE(toString(bad.takeError()).find("unknown unit"), std::string::npos);
}

TEST(MemoryModel, ScheduleDecidesActivationMemory) {
  // One layer per stage, activations only: 1F1B keeps P - r microbatches on
  // rank r, GPipe keeps M everywhere.
  Synthetic s({1, 1, 1, 1}, {0, 0, 0, 0}, {0, 0, 0, 0}, {1000, 1000, 1000, 1000});
  BalanceOptions o = s.options(4, 0);
  o.shape = test::pipelineShape(ScheduleKind::OneFOneB, 4, 1, 8);
  auto plan = balanceStages(s.lg, o);
  ASSERT_TRUE(!!plan);
  EXPECT_EQ(plan->ranks[0].activationBytes, 4 * 1000);
  EXPECT_EQ(plan->ranks[3].activationBytes, 1 * 1000);
  o.shape = test::pipelineShape(ScheduleKind::GPipe, 4, 1, 8);
  plan = balanceStages(s.lg, o);
  ASSERT_TRUE(!!plan);
  EXPECT_EQ(plan->ranks[0].activationBytes, 8 * 1000);
  EXPECT_EQ(plan->ranks[3].activationBytes, 8 * 1000);
  o.shape = test::pipelineShape(ScheduleKind::OneFOneB, 4, 1, 8);
  o.training.recompute = Recompute::All; // keeps the input (boundary 0 here) plus one rebuild
  plan = balanceStages(s.lg, o);
  ASSERT_TRUE(!!plan);
  EXPECT_EQ(plan->ranks[0].activationBytes, 1000);
}

} // namespace
