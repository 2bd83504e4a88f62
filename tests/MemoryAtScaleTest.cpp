//===- MemoryAtScaleTest.cpp - Sharded optimizer state, chosen recompute -===//
//
// --shard-optimizer (ZeRO-1) and --recompute auto change where memory goes,
// never what a step computes: each run here against the run without them,
// on local ranks and under mpirun, and the plans' memory against the model's.
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "plan/plan.pb.h"
#include "runtime/core/HostBuffers.h"

using namespace pipec;
using namespace pipec::test;

namespace {

// --shard-optimizer (ZeRO-1): the replicas reduce-scatter the gradients,
// each updates its shard of every weight with its shard of the AdamW state,
// and they all-gather the new weights. Three AdamW steps with clipping and
// weight decay give the unsharded run's weights, gradients and losses
// within 1e-6, on every replica: for 1F1B, ZB-V and DualPipeV at dp 2 and
// dp 3 (3 divides few of the weights' sizes, so the last shards are
// padded). Each rank's optimizer state in the plan is 1/dp of the
// unsharded plan's, within rounding.
TEST_F(Equivalence, ShardedOptimizerMatchesUnsharded) {
  extraOptions.clipGradNorm = 0.05;
  extraOptions.weightDecay = 0.1;
  std::string path = gpt(true);
  for (int dp : {2, 3})
    for (Config config : {Config{"1f1b", 2, 1, 4, dp}, Config{"zbv", 2, 2, 4, dp},
                          Config{"dualpipev", 2, 2, 4, dp}}) {
      std::string what = formatv("{0} dp={1}", config.schedule, dp);
      SCOPED_TRACE(what);
      plan::Plan whole = compileFor(path, config, 4 * dp);
      config.shardOptimizer = true;
      plan::Plan sharded = compileFor(path, config, 4 * dp);
      ASSERT_TRUE(sharded.training().shard_optimizer());
      ASSERT_EQ(sharded.ranks_size(), whole.ranks_size());
      for (int r = 0; r < whole.ranks_size(); ++r) {
        int64_t before = whole.ranks(r).optimizer_bytes(),
                after = sharded.ranks(r).optimizer_bytes();
        EXPECT_GT(before, 0);
        EXPECT_LE(std::abs(after * dp - before), dp) << "rank " << r;
        EXPECT_EQ(whole.ranks(r).weight_bytes() - before, sharded.ranks(r).weight_bytes() - after);
      }
      rt::RunResult reference = runPlan(whole, "adamw", 3);
      rt::RunResult run = runPlan(sharded, "adamw", 3);
      expectSameStep(run, reference, what, 1e-6);
      expectCopiesEverywhere(run, reference, dp, what);
    }
  extraOptions = rt::RunOptions();
}

// float16 weights: each replica keeps the float32 master of its shard, and
// the replicas gather the float16 roundings.
TEST_F(Equivalence, ShardedOptimizerKeepsFloat32MastersOfItsShard) {
  Config config{"1f1b", 2, 1, 2, 2};
  plan::Plan whole = compileFor(gptHalf(), config, 8);
  config.shardOptimizer = true;
  plan::Plan sharded = compileFor(gptHalf(), config, 8);
  expectSameStep(runPlan(sharded, "adamw", 2), runPlan(whole, "adamw", 2), "fp16 dp=2", 1e-6);
}

// --shard-optimizer over MPI processes (MPI_Reduce_scatter_block,
// MPI_Allgather): three AdamW steps with clipping and weight decay give the
// unsharded run's weights, for 1F1B, ZB-V and DualPipeV at dp 2 (4
// processes) and dp 3 (6).
TEST_F(RunCli, MpiShardedOptimizerMatchesUnsharded) {
  if (!haveMpirun())
    GTEST_SKIP() << "mpirun is not installed";
  std::string model = gpt(true), out;
  std::string flags = " --steps 3 --optimizer adamw --lr 1e-3 --clip-grad-norm 0.05 "
                      "--weight-decay 0.1 --quiet --save-weights ";
  for (const char *schedule : {"1f1b", "zbv", "dualpipev"})
    for (int dp : {2, 3}) {
      std::string name = formatv("{0}-dp{1}", schedule, dp);
      SCOPED_TRACE(name);
      std::string shape =
          formatv("--stages 2 --virtual-stages {0} --schedule {1} --microbatches 4 --batch {2} "
                  "--dp {3}",
                  std::string(schedule) == "1f1b" ? 1 : 2, schedule, 4 * dp, dp);
      std::string whole = plan(model, shape, "whole-" + name);
      std::string sharded = plan(model, shape + " --shard-optimizer", "sharded-" + name);
      std::string reference = dir->path("whole-" + name + ".onnx");
      std::string mpi = dir->path("sharded-mpi-" + name + ".onnx");
      ASSERT_EQ(runCommand(pipecBin() + " run " + whole + flags + reference, out), 0) << out;
      ASSERT_EQ(
          runCommand(mpirun(2 * dp) + pipecBin() + " run " + sharded + " --comm mpi" + flags + mpi,
                     out),
          0)
          << out;
      EXPECT_LT(worstWeightError(mpi, reference), 1e-6);
    }
}

// A sharded run's checkpoints hold each replica's shard of the optimizer
// state: resuming continues exactly, and resuming at another number of
// replicas, or unsharded, is refused naming both.
TEST_F(RunCli, ShardedCheckpointsResumeOnlyAtTheirReplicas) {
  std::string model = gpt(true), out;
  std::string shape = "--stages 2 --microbatches 2 --batch 8 --dp 2";
  std::string sharded = plan(model, shape + " --shard-optimizer", "resume-sharded");
  std::string whole = plan(model, shape, "resume-whole");
  std::string wider = plan(model, "--stages 2 --microbatches 2 --batch 12 --dp 3 --shard-optimizer",
                           "resume-wider");
  std::string ckpt = dir->path("sharded-ckpt"), straight = dir->path("straight.onnx"),
              resumed = dir->path("resumed.onnx");
  std::string flags = " --optimizer adamw --lr 1e-3 --quiet";
  ASSERT_EQ(
      runCommand(pipecBin() + " run " + sharded + flags + " --steps 3 --save-weights " + straight,
                 out),
      0)
      << out;
  ASSERT_EQ(
      runCommand(pipecBin() + " run " + sharded + flags + " --steps 2 --checkpoint " + ckpt, out),
      0)
      << out;
  ASSERT_EQ(runCommand(pipecBin() + " run " + sharded + flags +
                           " --steps 3 --resume --checkpoint " + ckpt + " --save-weights " +
                           resumed,
                       out),
            0)
      << out;
  EXPECT_EQ(readFile(resumed), readFile(straight));
  EXPECT_EQ(
      runCommand(pipecBin() + " run " + whole + flags + " --steps 3 --resume --checkpoint " + ckpt,
                 out),
      1);
  EXPECT_NE(out.find("holds optimizer state sharded over 2 replicas, this run's is not sharded"),
            std::string::npos)
      << out;
  EXPECT_EQ(
      runCommand(pipecBin() + " run " + wider + flags + " --steps 3 --resume --checkpoint " + ckpt,
                 out),
      1);
  EXPECT_NE(out.find("was written by 4 ranks (2 replicas of 2 pipeline ranks), this run has 6 (3 "
                     "replicas of 2 pipeline ranks)"),
            std::string::npos)
      << out;
}

/// The most any rank of \p plan is predicted to hold.
/// A limit that takes \p num / \p den of what recompute could save on the
/// rank of \p plan's largest peak: the kept activations of its microbatches
/// in flight (its slots' peak), not its weights and their state nor what a
/// layer holds while it runs (working_bytes).
int64_t limitBelow(const plan::Plan &plan, int64_t num, int64_t den) {
  int64_t most = 0, limit = 0;
  for (const plan::Rank &r : plan.ranks())
    if (r.peak_memory_bytes() >= most) {
      most = r.peak_memory_bytes();
      const plan::RankProgram &p = plan.programs(r.index());
      limit = most - (p.peak_activation_bytes() - p.working_bytes()) * num / den;
    }
  return limit;
}

/// Per stage of \p plan: its recomputed layers and its layer count.
std::vector<std::pair<int, int>> recomputedLayers(const plan::Plan &plan) {
  std::vector<std::pair<int, int>> out;
  for (const plan::Stage &s : plan.stages())
    out.push_back({s.recomputed_layers(), s.last_layer() - s.first_layer() + 1});
  return out;
}

// --recompute auto under a memory limit that takes a quarter of what the
// best plan without recompute keeps for its microbatches in flight: compile recomputes the first
// layers of the stages that need it and no more (under 1F1B the first ranks, which keep more
// microbatches in flight, recompute more), the plan fits, and three AdamW steps give the weights of
// the run that keeps every activation, within 1e-6.
TEST_F(Equivalence, RecomputeAutoChangesNothing) {
  std::string path = gptDeep();
  int partial = 0;
  for (Config config : {Config{"1f1b", 4, 1, 8, 1}, Config{"zb-h1", 3, 1, 6, 1},
                        Config{"zbv", 2, 2, 4, 1}, Config{"interleaved", 2, 2, 4, 1}}) {
    std::string what =
        formatv("{0} P={1} V={2}", config.schedule, config.stages, config.virtualStages);
    SCOPED_TRACE(what);
    config.balance = "time"; // the partition and the recompute that fit
    plan::Plan kept = compileFor(path, config, 24);
    int64_t limit = limitBelow(kept, 1, 4);
    config.memoryLimit = std::to_string(limit);
    plan::Plan chosen = compileFor(path, config, 24, Recompute::Auto);
    ASSERT_GT(chosen.stages_size(), 0);
    EXPECT_EQ(chosen.training().recompute_mode(), "auto");
    auto layers = recomputedLayers(chosen);
    int recomputing = 0, fewer = 0;
    for (auto [recomputed, count] : layers) {
      recomputing += recomputed > 0;
      fewer += recomputed < count;
      partial += recomputed > 0 && recomputed < count;
    }
    EXPECT_GT(recomputing, 0) << what << ": nothing recomputes under " << limit;
    EXPECT_GT(fewer, 0) << what << ": every layer recomputes";
    for (const plan::Rank &r : chosen.ranks())
      EXPECT_LE(r.peak_memory_bytes(), limit) << "rank " << r.index();
    // Under 1F1B rank 0 holds the most microbatches: it recomputes the most.
    if (config.schedule == "1f1b")
      EXPECT_GE(layers.front().first, layers.back().first);
    expectSameStep(runPlan(chosen, "adamw", 3), runPlan(kept, "adamw", 3), what, 1e-6);
  }
  EXPECT_GT(partial, 0) << "no stage recomputed only some of its layers";
}

// Over P x M, for 1F1B and the zero-bubble schedules (whose delayed W keeps
// several microbatches' recomputed activations at once): a plan compiled
// with --recompute auto under a limit that takes a fifth of what the best
// plan without recompute keeps for its microbatches in flight keeps, on every rank, the peak the
// memory model predicted or less, as plan-memory counts it from the lowered streams (buffers by
// liveness, plus weights, gradients and optimizer state), and within the
// limit. Where no partition fits even with every layer recomputing, compile
// says so; most of the grid fits.
TEST_F(Equivalence, RecomputeAutoPeaksStayWithinThePrediction) {
  std::string path = gptDeep();
  int fitted = 0, refused = 0;
  for (const char *schedule : {"1f1b", "zb-h1", "zbv"})
    for (int stages : {2, 3, 4})
      for (int microbatches : {4, 8}) {
        int virtualStages = std::string(schedule) == "zbv" ? 2 : 1;
        Config config{schedule, stages, virtualStages, microbatches, 1};
        config.balance = "time";
        std::string what = formatv("{0} P={1} M={2}", schedule, stages, microbatches);
        SCOPED_TRACE(what);
        plan::Plan kept = compileFor(path, config, 24);
        int64_t limit = limitBelow(kept, 1, 5);
        config.memoryLimit = std::to_string(limit);
        std::string error;
        plan::Plan chosen = compileFor(path, config, 24, Recompute::Auto, &error);
        if (!error.empty()) {
          EXPECT_NE(error.find("with every layer recomputing"), std::string::npos) << error;
          ++refused;
          continue;
        }
        ++fitted;
        ASSERT_EQ(chosen.programs_size(), stages) << what;
        for (int r = 0; r < stages; ++r) {
          int64_t planned =
              chosen.programs(r).peak_activation_bytes() + chosen.ranks(r).weight_bytes();
          EXPECT_EQ(planned, chosen.ranks(r).peak_memory_bytes()) << what << " rank " << r;
          EXPECT_LE(planned, chosen.ranks(r).model_peak_bytes()) << what << " rank " << r;
          EXPECT_LE(planned, limit) << what << " rank " << r;
        }
      }
  EXPECT_GT(fitted, 3 * refused) << fitted << " fitted, " << refused << " refused";
}

TEST(HostBuffers, FreedMemoryServesOtherSizesAndStaysUnderTheMark) {
  using pipec::cpu::HostBuffers::stats;
  // 4 MiB of floats, well over the cached minimum.
  const std::vector<int64_t> shape{1024, 1024};
  {
    cpu::Tensor a = cpu::Tensor::uninitialized(DType::F32, shape);
    a.data<float>()[7] = 3.0f;
  }
  auto before = stats();
  {
    // Kept memory comes back, and zeros are written when asked.
    cpu::Tensor b(DType::F32, shape);
    EXPECT_EQ(b.data<float>()[7], 0.0f);
  }
  auto after = stats();
  EXPECT_EQ(after.hits, before.hits + 1);
  EXPECT_EQ(after.misses, before.misses);
  // A step's pattern: the backward asks for other sizes than the forward
  // freed (two 3 MiB and 5 MiB blocks, then one of 8 MiB, then four of
  // 2 MiB). From the second time on, the freed ranges, merged, serve it all
  // without a fresh page.
  auto step = [] {
    {
      cpu::Tensor x = cpu::Tensor::uninitialized(DType::F32, {3, 1 << 18});
      cpu::Tensor y = cpu::Tensor::uninitialized(DType::F32, {5, 1 << 18});
    }
    { cpu::Tensor z = cpu::Tensor::uninitialized(DType::F32, {8, 1 << 18}); }
    std::vector<cpu::Tensor> small;
    for (int i = 0; i < 4; ++i)
      small.push_back(cpu::Tensor::uninitialized(DType::F32, {2, 1 << 18}));
  };
  // Exact-size reuse would keep a block of each size, 24 MiB; merged, the
  // step holds no more than its most at once, 8 MiB.
  auto cold = stats();
  step();
  auto once = stats();
  EXPECT_LE(once.inUse + once.kept, cold.inUse + cold.kept + (int64_t(8) << 20));
  step();
  auto warm = stats();
  step();
  EXPECT_EQ(stats().misses, warm.misses);
  EXPECT_EQ(stats().hits, warm.hits + 7);
  // A size never seen makes room by giving kept memory back: in use and
  // kept together stay within an eighth over the most ever in use.
  {
    cpu::Tensor c = cpu::Tensor::uninitialized(DType::F32, {1024, 1023 * 3});
    auto now = stats();
    EXPECT_LE(now.inUse + now.kept, std::max(now.peakInUse + now.peakInUse / 8, now.inUse));
  }
}

} // namespace
