//===- PredictStepTest.cpp - predict-step: the one engine, by hand --------===//
//
// StepPredictor judges candidates by the simulator's engine over
// lower-schedule's array form. These tests hold it to steps, bubbles and
// memory peaks worked out by hand, and show that a written plan's programs,
// read back, run as the streams they were lowered from. The shape the
// predictor is given is checked where it is made (PipelineShape), and
// --schedule auto's search keeps the fastest candidate that fits.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "compiler/schedule/Schedule.h"
#include "compiler/sim/Simulator.h"
#include "passes/PlanMemory.h"
#include "passes/PredictStep.h"
#include "passes/SearchSchedules.h"

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
  o.shape = test::pipelineShape(kind, stages, virtualStages, microbatches, dataParallel);
  o.training.training = kind != ScheduleKind::ForwardOnly;
  o.training.recompute = recompute ? Recompute::All : Recompute::None;
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
      LoweringInputs::Collective tied;
      tied.reduce = plan::Instruction::TIED_WEIGHT;
      tied.tiedWeight = "embedding";
      tied.ranks = {0, stages - 1};
      tied.bytes = 3 << 20;
      in.collectives.insert(in.collectives.begin(), tied);
    }
    return in;
  };
  return c;
}

/// Two ranks whose numbers make a step computable by hand: links of 1e9
/// bytes/s without latency (within and between nodes), memory at 2e9 bytes/s,
/// each stage's F = 1 s, I = W = 0.5 s, and a boundary of 1e9 bytes (a
/// transfer of 1 s).
Case handCase(ScheduleKind kind, int microbatches) {
  Case c;
  BalanceOptions &o = c.options;
  o.shape = test::pipelineShape(kind, 2, 1, microbatches);
  HardwareSpec hw;
  hw.name = "hand";
  hw.memoryBandwidth = 2e9;
  hw.intraNode = {"link", 1e9, 0};
  hw.interNode = {"link", 1e9, 0};
  hw.devicesPerNode = 8;
  for (int r = 0; r < 2; ++r) {
    o.rankHardware.push_back(hw);
    o.memoryLimit.push_back(0);
    ChunkPlan chunk;
    chunk.index = r;
    chunk.rank = r;
    chunk.time = {1.0, 0.5, 0.5};
    chunk.activationBytes = 1000 * (r + 1);
    chunk.boundaryBytes = r == 0 ? 1000000000 : 0;
    c.plan.chunks.push_back(chunk);
    RankPlan rank;
    rank.index = r;
    c.plan.ranks.push_back(rank);
  }
  return c;
}

/// GPipe, P = 2, M = 2, by hand. Rank 0 runs F0 [0, 1] and F1 [1, 2]. Rank
/// 1 posts the receive of microbatch 0 at 0 and of microbatch 1 when it
/// reaches the forward that needs it, after F0: the transfers run [1, 2] and
/// [3, 4], so rank 1 runs F0 [2, 3], F1 [4, 5], B0 [5, 6], B1 [6, 7]. The
/// gradients leave at 6 and 7; rank 0 posts the second receive after B0:
/// [6, 7], B0 [7, 8], [8, 9], B1 [9, 10]. The step is 10 s, each rank busy
/// 4 s of it.
TEST(PredictStep, GPipeByHand) {
  Case c = handCase(ScheduleKind::GPipe, 2);
  StepPredictor predict(c.options);
  auto step = predict.predict(c.plan);
  ASSERT_TRUE(!!step) << toString(step.takeError());
  EXPECT_EQ(step->step, 10.0);
  EXPECT_EQ(step->bubbleFraction, 1 - 8.0 / 20.0);
  // Rank 0 keeps both microbatches' activations, rank 1 the same.
  EXPECT_EQ(step->peakMemory, (std::vector<int64_t>{2000, 4000}));
  auto fast = predict(c.plan);
  ASSERT_TRUE(!!fast) << toString(fast.takeError());
  EXPECT_EQ(*fast, 10.0);

  // The optimizer reads and writes 1e9 bytes of weights and state at 2e9
  // bytes/s: 1 s after each rank's last compute and arrival (rank 0: 10,
  // rank 1: 7, its last send ending at 9).
  for (RankPlan &rank : c.plan.ranks)
    rank.weightBytes = 1000000000;
  auto withOptimizer = StepPredictor(c.options).predict(c.plan);
  ASSERT_TRUE(!!withOptimizer) << toString(withOptimizer.takeError());
  EXPECT_EQ(withOptimizer->step, 11.0);
  EXPECT_EQ(withOptimizer->peakMemory, (std::vector<int64_t>{1000002000, 1000004000}));

  // Two replicas: a ring all-reduce of 1e9 parameters' bf16 gradients (2e9
  // bytes) takes 2 (n - 1) steps of 1e9 bytes: 2 s before the optimizer.
  c.options.shape = test::pipelineShape(ScheduleKind::GPipe, 2, 1, 2, 2);
  for (ChunkPlan &chunk : c.plan.chunks)
    chunk.params = 1000000000;
  auto replicated = StepPredictor(c.options).predict(c.plan);
  ASSERT_TRUE(!!replicated) << toString(replicated.takeError());
  EXPECT_EQ(replicated->step, 13.0);

  // Sharded over the two replicas: the ring's two halves, a reduce-scatter
  // of 1 s before the optimizer step and an all-gather of 1 s after it, and
  // the step updates half the optimizer state (here half the bytes: 0.5 s).
  c.options.training.optimizerShards = 2;
  for (RankPlan &rank : c.plan.ranks)
    rank.weightBytes = 500000000;
  auto sharded = StepPredictor(c.options).predict(c.plan);
  ASSERT_TRUE(!!sharded) << toString(sharded.takeError());
  EXPECT_EQ(sharded->step, 12.5);
}

/// 1F1B, P = 2, M = 3, by hand, with transfers free (links without
/// bandwidth are not charged) and a boundary of 500 bytes. Rank 0 runs F0
/// F1 B0 F2 B1 B2, rank 1 F0 B0 F1 B1 F2 B2. Without recompute the step is
/// (M + P - 1)(F + B) = 8 s. With it, each backward is preceded by its
/// recompute (1 s), which runs while the gradient is still on its way: rank
/// 1 runs F0 [1, 2], R0 B0 [2, 4], F1 [4, 5], R1 B1 [5, 7], F2 [7, 8], R2 B2
/// [8, 10]; rank 0 runs R0 [2, 3], B0 [4, 5], F2 [5, 6], R1 [6, 7], B1 [7, 8],
/// R2 [8, 9] and B2 [10, 11]: 11 s. Rank 0 keeps two microbatches in flight
/// and rank 1 one: without recompute their activations (1000 and 2000
/// bytes), with it their inputs (none for stage 0, the 500-byte boundary for
/// stage 1) and one rebuilt set at a time.
TEST(PredictStep, OneFOneBWithRecomputeByHand) {
  Case c = handCase(ScheduleKind::OneFOneB, 3);
  for (HardwareSpec &hw : c.options.rankHardware)
    hw.intraNode.bandwidth = hw.interNode.bandwidth = 0;
  c.plan.chunks[0].boundaryBytes = 500;
  auto kept = StepPredictor(c.options).predict(c.plan);
  ASSERT_TRUE(!!kept) << toString(kept.takeError());
  EXPECT_EQ(kept->step, 8.0);
  EXPECT_EQ(kept->peakMemory, (std::vector<int64_t>{2000, 2000}));

  c.options.training.recompute = Recompute::All;
  auto rebuilt = StepPredictor(c.options).predict(c.plan);
  ASSERT_TRUE(!!rebuilt) << toString(rebuilt.takeError());
  EXPECT_EQ(rebuilt->step, 11.0);
  EXPECT_EQ(rebuilt->bubbleFraction, 1 - 18.0 / 22.0);
  EXPECT_EQ(rebuilt->peakMemory, (std::vector<int64_t>{1000, 2500}));
}

/// A plan's programs read back into the array form run as the lowered
/// streams they were written from, on every schedule family: what `pipec
/// simulate` shows of a written plan is what the compiler judged.
TEST(PredictStep, WrittenProgramsRunAsLowered) {
  std::mt19937 rng(16);
  struct Family {
    ScheduleKind kind;
    int v;
  };
  int compared = 0;
  for (Family f : {Family{ScheduleKind::GPipe, 1}, Family{ScheduleKind::OneFOneB, 1},
                   Family{ScheduleKind::Interleaved, 2}, Family{ScheduleKind::ZBH1, 1},
                   Family{ScheduleKind::ZBH2, 1}, Family{ScheduleKind::ZBV, 2},
                   Family{ScheduleKind::DualPipeV, 2}, Family{ScheduleKind::LoopedBFS, 2},
                   Family{ScheduleKind::ForwardOnly, 1}})
    for (int stages : {2, 4})
      for (bool recompute : {false, true}) {
        int microbatches = 2 * stages + 1;
        if (llvm::Error err = checkScheduleShape(f.kind, stages, f.v, microbatches)) {
          llvm::consumeError(std::move(err));
          continue;
        }
        Case c = makeCase(f.kind, stages, f.v, microbatches, recompute, 2, rng);
        std::string what =
            formatv("{0} P={1} recompute={2}", scheduleName(f.kind), stages, recompute).str();
        auto schedule = generateSchedule(f.kind, stages, f.v, microbatches);
        ASSERT_TRUE(!!schedule) << what << ": " << toString(schedule.takeError());
        LoweringInputs inputs = c.options.lowering(c.plan);
        auto lowered = lowerStreams(*schedule, inputs);
        ASSERT_TRUE(!!lowered) << what << ": " << toString(lowered.takeError());
        std::vector<plan::RankProgram> programs = toRankPrograms(*lowered, *schedule);
        std::vector<const plan::RankProgram *> pointers;
        for (const plan::RankProgram &p : programs)
          pointers.push_back(&p);
        Streams read = streamsOf(pointers);
        ASSERT_EQ(read.ranks.size(), lowered->streams.ranks.size()) << what;
        for (size_t r = 0; r < read.ranks.size(); ++r) {
          ASSERT_EQ(read.ranks[r].size(), lowered->streams.ranks[r].size()) << what;
          for (size_t i = 0; i < read.ranks[r].size(); ++i) {
            const StreamOp &a = read.ranks[r][i], &b = lowered->streams.ranks[r][i];
            std::string at = formatv("{0} rank {1} step {2}", what, r, i).str();
            EXPECT_EQ(a.op, b.op) << at;
            EXPECT_EQ(a.stage, b.stage) << at;
            EXPECT_EQ(a.microbatch, b.microbatch) << at;
            using Op = plan::Instruction;
            if (b.op == Op::SEND || b.op == Op::RECV) {
              EXPECT_EQ(a.peer, b.peer) << at;
              EXPECT_EQ(a.grad, b.grad) << at;
              EXPECT_EQ(read.tensors[a.tensor]->name(), lowered->streams.tensors[b.tensor]->name())
                  << at;
              EXPECT_EQ(read.tensors[a.tensor]->bytes(),
                        lowered->streams.tensors[b.tensor]->bytes())
                  << at;
            }
            if (b.op == Op::FORWARD || b.op == Op::RECOMPUTE || b.op == Op::FREE)
              EXPECT_EQ(a.buffer, b.buffer) << at;
            if (b.op == Op::LOAD)
              EXPECT_EQ(a.labels, b.labels) << at;
            if (b.op == Op::ALLREDUCE) {
              const StreamCollective &x = read.collectives[a.collective],
                                     &y = lowered->streams.collectives[b.collective];
              EXPECT_EQ(x.group, y.group) << at;
              EXPECT_EQ(x.ranks, y.ranks) << at;
              EXPECT_EQ(x.bytes, y.bytes) << at;
            }
            // A receive fills a mailbox; a compute read back waits on one
            // only where a receive fills it, and then so does the lowered.
            if (b.op == Op::RECV)
              EXPECT_TRUE(a.mailbox >= 0 && b.mailbox >= 0) << at;
            if (a.mailbox >= 0)
              EXPECT_GE(b.mailbox, 0) << at;
          }
        }
        plan::Plan skeleton;
        for (const HardwareSpec &hw : c.options.rankHardware)
          *skeleton.add_hardware() = hardwareInfo(hw, true);
        skeleton.mutable_schedule()->set_data_parallel(c.options.shape.dataParallel());
        for (const ChunkPlan &chunk : c.plan.chunks) {
          plan::Stage *stage = skeleton.add_stages();
          stage->set_index(chunk.index);
          stage->set_time_f_s(chunk.time[Forward]);
          stage->set_time_i_s(chunk.time[BackwardInput]);
          stage->set_time_w_s(chunk.time[BackwardWeight]);
        }
        for (const RankPlan &rank : c.plan.ranks)
          skeleton.add_ranks()->set_weight_bytes(rank.weightBytes);
        planMemory(programs);
        for (plan::RankProgram &p : programs)
          *skeleton.add_programs() = std::move(p);
        auto simulated = simulatePlan(skeleton);
        auto predicted = StepPredictor(c.options).predict(c.plan);
        ASSERT_TRUE(!!simulated) << what << ": " << toString(simulated.takeError());
        ASSERT_TRUE(!!predicted) << what << ": " << toString(predicted.takeError());
        EXPECT_EQ(simulated->stepTime, predicted->step) << what;
        EXPECT_EQ(simulated->bubbleFraction, predicted->bubbleFraction) << what;
        EXPECT_EQ(simulated->peakMemory, predicted->peakMemory) << what;
        ++compared;
      }
  EXPECT_GE(compared, 16);
}

/// A shape the schedule does not take is refused where it is made, in
/// checkScheduleShape's words: no pass downstream sees it.
TEST(PipelineShape, RefusesWhatTheScheduleDoesNotTake) {
  auto few = PipelineShape::make(ScheduleKind::OneFOneB, 4, 1, 2); // 1F1B needs M >= P
  ASSERT_FALSE(!!few);
  EXPECT_NE(toString(few.takeError())
                .find("1f1b with 4 stages, 1 virtual stages and 2 "
                      "microbatches: 1F1B needs at least as many "
                      "microbatches as stages"),
            std::string::npos);
  auto noReplica = PipelineShape::make(ScheduleKind::GPipe, 2, 1, 2, 1, 0);
  ASSERT_FALSE(!!noReplica);
  EXPECT_NE(toString(noReplica.takeError()).find("one replica"), std::string::npos);
  auto shape = PipelineShape::make(ScheduleKind::ZBV, 3, 2, 5, 4, 2);
  ASSERT_TRUE(!!shape) << toString(shape.takeError());
  EXPECT_EQ(shape->chunks(), 6);
  EXPECT_EQ(shape->globalBatch(), 5 * 4 * 2);
  EXPECT_EQ(shape->rankOfChunk(4), 1); // the V's second arm runs back: chunk 4 on rank 1
  EXPECT_EQ(shape->withMicrobatchSize(3).globalBatch(), 5 * 3 * 2);
}

/// A training step whose schedule never runs a stage's backward leaves its
/// activations held: lower-schedule refuses that, and so does predict().
TEST(PredictStep, ActivationsNeverFreedAreAnError) {
  std::mt19937 rng(2);
  Case c = makeCase(ScheduleKind::GPipe, 2, 1, 2, false, 1, rng);
  // Forwards only, yet training.
  c.options.shape = test::pipelineShape(ScheduleKind::ForwardOnly, 2, 1, 2);
  StepPredictor predict(c.options);
  auto full = predict.predict(c.plan);
  ASSERT_FALSE(!!full);
  EXPECT_NE(toString(full.takeError()).find("never frees"), std::string::npos);
}

} // namespace

namespace {

/// --schedule auto's search over a judge whose steps are given per schedule
/// (a made-up step per row, a memory limit only 1F1B at M = 2P fits).
TEST(SearchSchedules, KeepsTheFastestThatFits) {
  std::vector<std::string> judgedNames;
  auto judge = [&](const PipelineShape &shape) -> llvm::Expected<Judgement> {
    std::string name = formatv("{0} M={1}", scheduleName(shape.schedule()), shape.microbatches());
    judgedNames.push_back(name);
    Judgement out{shape.withMicrobatchSize(3), std::nullopt, ""};
    if (shape.schedule() == ScheduleKind::ZBH2) {
      out.error = "lost: no plan: made up";
      return out;
    }
    Judged judged;
    RankPlan rank;
    rank.memoryLimit = 100;
    judged.stagePlan.ranks.push_back(rank);
    // Faster with more microbatches; ZB-V fastest but over the limit.
    judged.prediction.step = 10.0 / shape.microbatches();
    judged.prediction.peakMemory = {shape.schedule() == ScheduleKind::ZBV ? 200 : 50};
    if (shape.schedule() == ScheduleKind::ZBV)
      judged.prediction.step /= 2;
    out.judged = std::move(judged);
    return out;
  };
  auto search = searchSchedules(2, 0, 1, judge);
  ASSERT_TRUE(!!search) << toString(search.takeError());
  // Every row auto tries, at M = P, 2P, 4P, 8P.
  int rows = 0;
  for (const ScheduleTraits &row : scheduleTable())
    rows += row.autoCandidate;
  ASSERT_EQ(static_cast<int>(search->tried.size()), 4 * rows);
  ASSERT_GE(search->best, 0);
  const ScheduleCandidate &best = search->tried[search->best];
  // The step is 10 / M for every row that fits: the first row at M = 16
  // wins the tie; ZB-V is faster but never fits.
  EXPECT_EQ(best.name, "gpipe V=1 M=16");
  EXPECT_EQ(best.shape->microbatchSize(), 3);
  EXPECT_EQ(best.judged->prediction.step, 10.0 / 16);
  for (const ScheduleCandidate &c : search->tried) {
    if (c.name.rfind("zbv", 0) == 0)
      EXPECT_FALSE(c.fits()) << c.name;
    if (c.name.rfind("zb-h2", 0) == 0)
      EXPECT_EQ(c.error, "lost: no plan: made up") << c.name;
    // DualPipeV needs M >= 2P: at M = 2 it is refused before it is judged.
    if (c.name == "dualpipev V=2 M=2")
      EXPECT_EQ(c.error.rfind("not accepted: dualpipev with 2 stages", 0), 0u) << c.error;
  }
  EXPECT_EQ(std::count(judgedNames.begin(), judgedNames.end(), "dualpipev M=2"), 0);

  // An error of the judge's own ends the search.
  auto failing = searchSchedules(2, 4, 1, [](const PipelineShape &) -> llvm::Expected<Judgement> {
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "the model cannot be read");
  });
  ASSERT_FALSE(!!failing);
  EXPECT_EQ(toString(failing.takeError()), "the model cannot be read");
}

} // namespace
