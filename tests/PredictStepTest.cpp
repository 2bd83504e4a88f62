//===- PredictStepTest.cpp - predict-step against lowering + simulation -===//
//
// StepPredictor follows the schedule on plain arrays instead of building the
// lowered programs; these tests hold it to the long way (lower-schedule's
// programs, given their memory plan and run by simulatePlan), bit for bit,
// on every schedule family: the step, the bubble and each rank's memory
// peak.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "compiler/schedule/Schedule.h"
#include "passes/PredictStep.h"

#include "llvm/Support/FormatVariadic.h"

#include <random>

using namespace pipec;
using llvm::formatv;
using llvm::toString;

namespace {

/// One configuration's chunks with irregular times, so that no tie hides a
/// difference of order, and boundary tensors from \p lowering.
struct Case {
  BalanceOptions options;
  StagePlan plan;
};

Case makeCase(ScheduleKind kind, int stages, int virtualStages, int microbatches, bool recompute,
              int dataParallel, std::mt19937 &rng) {
  std::uniform_real_distribution<double> time(1e-4, 5e-3);
  std::uniform_int_distribution<int64_t> bytes(0, 1 << 24);
  Case c;
  BalanceOptions &o = c.options;
  o.stages = stages;
  o.virtualStages = virtualStages;
  o.microbatches = microbatches;
  o.schedule = kind;
  o.training.training = kind != ScheduleKind::ForwardOnly;
  o.training.recompute = recompute;
  o.dataParallel = dataParallel;
  auto h100 = builtinHardware("h100"), a100 = builtinHardware("a100");
  EXPECT_TRUE(h100 && a100);
  for (int r = 0; r < stages; ++r) {
    HardwareSpec hw = r % 3 == 2 ? *a100 : *h100;
    hw.devicesPerNode = 2; // links within and between nodes
    o.rankHardware.push_back(hw);
    o.memoryLimit.push_back(0);
  }
  int chunks = stages * virtualStages;
  for (int k = 0; k < chunks; ++k) {
    ChunkPlan chunk;
    chunk.index = k;
    chunk.rank = rankOfChunk(kind, stages, virtualStages, k);
    chunk.time = {time(rng), time(rng), time(rng)};
    chunk.activationBytes = bytes(rng);
    chunk.boundaryBytes = k + 1 < chunks ? bytes(rng) : 0;
    chunk.params = bytes(rng);
    c.plan.chunks.push_back(chunk);
  }
  for (int r = 0; r < stages; ++r) {
    RankPlan rank;
    rank.index = r;
    rank.weightBytes = bytes(rng) * 8;
    c.plan.ranks.push_back(rank);
  }
  // Up to three tensors per boundary, some without a gradient, one boundary
  // with none; a weight tied between the first and last rank.
  std::vector<std::vector<int64_t>> tensorBytes(chunks);
  std::vector<std::vector<bool>> grads(chunks);
  for (int k = 0; k + 1 < chunks; ++k) {
    int n = k == chunks / 2 ? 0 : 1 + static_cast<int>(rng() % 3);
    for (int t = 0; t < n; ++t) {
      tensorBytes[k].push_back(t == 2 ? 0 : bytes(rng));
      grads[k].push_back(t == 0 || rng() % 2);
    }
  }
  o.lowering = [=](const StagePlan &plan) {
    LoweringInputs in = defaultLoweringInputs(plan, o);
    for (int k = 0; k < chunks; ++k) {
      in.sendTensors[k].clear();
      for (size_t t = 0; t < tensorBytes[k].size(); ++t) {
        plan::TensorRef ref;
        ref.set_name(formatv("b{0}.t{1}", k, t).str());
        ref.set_dtype("uint8");
        ref.add_shape(tensorBytes[k][t]);
        ref.set_bytes(tensorBytes[k][t]);
        in.sendTensors[k].push_back(ref);
      }
      in.hasGradient[k] = grads[k];
    }
    if (stages > 1) {
      LoweringInputs::AllReduce tied;
      tied.reduce = plan::Instruction::TIED_WEIGHT;
      tied.tiedWeight = "embedding";
      tied.ranks = {0, stages - 1};
      tied.bytes = 3 << 20;
      in.allReduces.insert(in.allReduces.begin(), tied);
    }
    return in;
  };
  return c;
}

TEST(PredictStep, SameStepAsLoweringAndSimulating) {
  std::mt19937 rng(16);
  struct Family {
    ScheduleKind kind;
    int v;
  };
  int compared = 0;
  for (Family f :
       {Family{ScheduleKind::GPipe, 1}, Family{ScheduleKind::OneFOneB, 1},
        Family{ScheduleKind::Interleaved, 2}, Family{ScheduleKind::Interleaved, 3},
        Family{ScheduleKind::ZBH1, 1}, Family{ScheduleKind::ZBH2, 1}, Family{ScheduleKind::ZBV, 2},
        Family{ScheduleKind::DualPipeV, 2}, Family{ScheduleKind::ForwardOnly, 1}})
    for (int stages : {1, 2, 4, 5})
      for (int factor : {1, 2, 4})
        for (int extra : {0, 1})
          for (bool recompute : {false, true})
            for (int dp : {1, 2}) {
              int microbatches = factor * stages + extra;
              if (llvm::Error err = checkScheduleShape(f.kind, stages, f.v, microbatches)) {
                llvm::consumeError(std::move(err));
                continue;
              }
              Case c = makeCase(f.kind, stages, f.v, microbatches, recompute, dp, rng);
              StepPredictor predict(c.options);
              auto fast = predict(c.plan);
              auto full = predict.predict(c.plan);
              auto slow = predict.lowerAndSimulate(c.plan);
              std::string what =
                  formatv("{0} P={1} V={2} M={3} recompute={4} dp={5}", scheduleName(f.kind),
                          stages, f.v, microbatches, recompute, dp)
                      .str();
              ASSERT_TRUE(!!slow) << what << ": " << toString(slow.takeError());
              ASSERT_TRUE(!!fast) << what << ": " << toString(fast.takeError());
              ASSERT_TRUE(!!full) << what << ": " << toString(full.takeError());
              EXPECT_EQ(*fast, slow->step) << what;
              EXPECT_GT(*fast, 0) << what;
              EXPECT_EQ(full->step, slow->step) << what;
              EXPECT_EQ(full->bubbleFraction, slow->bubbleFraction) << what;
              if (stages > 1 || f.kind != ScheduleKind::ForwardOnly) { // one rank infers busily
                EXPECT_GT(full->bubbleFraction, 0) << what;
              }
              EXPECT_EQ(full->peakMemory, slow->peakMemory) << what;
              ASSERT_EQ(static_cast<int>(full->peakMemory.size()), stages) << what;
              if (f.kind != ScheduleKind::ForwardOnly) { // a recompute keeps stage 0's input: none
                EXPECT_GT(full->peakMemory[0], c.plan.ranks[0].weightBytes) << what;
              }
              ++compared;
            }
  EXPECT_GT(compared, 200);
}

/// A schedule the options do not accept is an error either way.
TEST(PredictStep, RejectedScheduleIsAnError) {
  std::mt19937 rng(1);
  Case c = makeCase(ScheduleKind::OneFOneB, 4, 1, 2, false, 1, rng); // 1F1B needs M >= P
  StepPredictor predict(c.options);
  auto fast = predict(c.plan);
  auto full = predict.predict(c.plan);
  auto slow = predict.lowerAndSimulate(c.plan);
  EXPECT_FALSE(!!fast);
  EXPECT_FALSE(!!full);
  EXPECT_FALSE(!!slow);
  if (!fast)
    llvm::consumeError(fast.takeError());
  if (!full)
    llvm::consumeError(full.takeError());
  if (!slow)
    llvm::consumeError(slow.takeError());
}

/// A training step whose schedule never runs a stage's backward leaves its
/// activations held: lower-schedule refuses that, and so does predict().
TEST(PredictStep, ActivationsNeverFreedAreAnError) {
  std::mt19937 rng(2);
  Case c = makeCase(ScheduleKind::GPipe, 2, 1, 2, false, 1, rng);
  c.options.schedule = ScheduleKind::ForwardOnly; // forwards only, yet training
  StepPredictor predict(c.options);
  auto full = predict.predict(c.plan);
  auto slow = predict.lowerAndSimulate(c.plan);
  ASSERT_FALSE(!!full);
  ASSERT_FALSE(!!slow);
  EXPECT_NE(toString(full.takeError()).find("never frees"), std::string::npos);
  EXPECT_NE(toString(slow.takeError()).find("never frees"), std::string::npos);
}

} // namespace
