//===- ParallelSearchTest.cpp - --parallel auto against every layout ----===//
//
// The search's choice against the plans `--schedule auto` compiles for every
// layout of the same devices, flag by flag (a path of its own: the schedule
// search and the whole compile), its memory pruning, the flags it keeps
// fixed, and its refusals.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "driver/Compile.h"
#include "models/ModelGenerators.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FormatVariadic.h"

#include <gtest/gtest.h>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

class ParallelSearch : public ::testing::Test {
protected:
  static void SetUpTestSuite() {
    dir = new TempDir();
    // 8 blocks of width 256, 8 heads over 4 key/value heads, vocabulary 512,
    // sequence 64: T of 1, 2 and 4 split it; 8 does not divide the key/value
    // heads.
    models::GeneratorOptions o(models::Family::Llama, 8, 256, 512, 64, 8);
    o.kvHeads = 4;
    o.withLoss = true;
    path = new std::string(dir->path("llama.onnx"));
    auto proto = models::generateModel(o);
    ASSERT_TRUE(static_cast<bool>(proto)) << llvm::toString(proto.takeError());
    llvm::Error err = models::writeModel(*proto, *path, false);
    ASSERT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
  }
  static void TearDownTestSuite() {
    delete dir;
    delete path;
  }

  /// --parallel auto for \p gpus H100s, a batch of 32 sequences.
  static CompileOptions searching(int gpus) {
    CompileOptions options;
    options.parallel.gpus = gpus;
    options.globalBatch = 32;
    options.hardware = "h100";
    options.autoSchedule = true;
    options.shardOptimizer = true;
    return options;
  }
  static llvm::Expected<plan::Plan> compile(const CompileOptions &options) {
    return compileModel(*path, options, PipelineOptions());
  }

  static TempDir *dir;
  static std::string *path;
};

TempDir *ParallelSearch::dir = nullptr;
std::string *ParallelSearch::path = nullptr;

/// The line of \p plan's parallel_search that begins with \p prefix, or "".
std::string lineOf(const plan::Plan &plan, llvm::StringRef prefix) {
  for (const std::string &line : plan.parallel_search())
    if (llvm::StringRef(line).startswith(prefix))
      return line;
  return "";
}

TEST_F(ParallelSearch, ChoosesTheLeastStepOfEveryLayout) {
  auto chosen = compile(searching(8));
  ASSERT_TRUE(static_cast<bool>(chosen)) << llvm::toString(chosen.takeError());
  const plan::ScheduleInfo &s = chosen->schedule();
  EXPECT_EQ(s.tensor_parallel() * s.stages() * s.data_parallel(), 8);
  EXPECT_EQ(s.global_batch(), 32);
  // A plan that runs: its stage programs are there.
  EXPECT_GT(chosen->stage_programs_size(), 0);
  ASSERT_GT(chosen->parallel_search_size(), 1);
  EXPECT_TRUE(llvm::StringRef(chosen->parallel_search(0)).startswith("chose "))
      << chosen->parallel_search(0);
  // T = 8 does not divide the 4 key/value heads: refused with the reason.
  std::string refused = lineOf(*chosen, "T=8:");
  EXPECT_NE(refused.find("heads (axis 2 of [1,64,4,32]) do not divide over --tp 8"),
            std::string::npos)
      << refused;
  // Every layout compiled on its own, --schedule auto over one-sample
  // microbatches: none predicts a shorter step than the choice.
  double best = chosen->predicted().step_time_s();
  int layouts = 0;
  for (int tp : {1, 2, 4})
    for (int stages : {1, 2, 4, 8}) {
      if (8 % (tp * stages) != 0)
        continue;
      CompileOptions fixed = searching(0);
      fixed.tensorParallel = tp;
      fixed.stages = stages;
      fixed.dataParallel = 8 / (tp * stages);
      fixed.microbatches = static_cast<int>(32 / fixed.dataParallel);
      auto plan = compile(fixed);
      ASSERT_TRUE(static_cast<bool>(plan)) << llvm::toString(plan.takeError());
      ++layouts;
      EXPECT_GE(plan->predicted().step_time_s(), best * (1 - 1e-9))
          << formatv("T={0} P={1}: {2}", tp, stages, plan->schedule_search(0)).str();
      // The search judged the same layout to the same step.
      std::string line = lineOf(*chosen, formatv("T={0} P={1} D={2} M={3}x1:", tp, stages,
                                                 fixed.dataParallel, fixed.microbatches)
                                             .str());
      EXPECT_FALSE(line.empty()) << formatv("T={0} P={1}", tp, stages).str();
    }
  EXPECT_EQ(layouts, 9);
}

TEST_F(ParallelSearch, PrunesOnMemoryBeforeBalancing) {
  auto whole = compile(searching(8));
  ASSERT_TRUE(static_cast<bool>(whole)) << llvm::toString(whole.takeError());
  // A limit of a third of the model's weights with their AdamW state (16
  // bytes a parameter in bf16, before the replicas' shard of the optimizer's
  // 12): one rank of one stage cannot hold it.
  int64_t state = whole->model().params() * 4;
  CompileOptions options = searching(8);
  options.memoryLimit = std::to_string(state);
  auto plan = compile(options);
  ASSERT_TRUE(static_cast<bool>(plan)) << llvm::toString(plan.takeError());
  std::string pruned = lineOf(*plan, "T=1 P=1 D=8:");
  EXPECT_NE(pruned.find("pruned: weights"), std::string::npos) << pruned;
  const plan::ScheduleInfo &s = plan->schedule();
  EXPECT_GE(s.tensor_parallel() * s.stages(), 2);
  for (const plan::Rank &r : plan->ranks())
    EXPECT_LE(r.peak_memory_bytes(), state) << r.index();
}

TEST_F(ParallelSearch, KeepsTheFlagsGiven) {
  CompileOptions options = searching(8);
  options.tensorParallel = 2;
  options.parallel.fixedTp = true;
  options.stages = 2;
  options.parallel.fixedStages = true;
  auto plan = compile(options);
  ASSERT_TRUE(static_cast<bool>(plan)) << llvm::toString(plan.takeError());
  EXPECT_EQ(plan->schedule().tensor_parallel(), 2);
  EXPECT_EQ(plan->schedule().stages(), 2);
  EXPECT_EQ(plan->schedule().data_parallel(), 2);
  for (const std::string &line : plan->parallel_search())
    EXPECT_FALSE(llvm::StringRef(line).startswith("T=1 ")) << line;
}

TEST_F(ParallelSearch, Refusals) {
  CompileOptions noBatch = searching(8);
  noBatch.globalBatch = 0;
  auto plan = compile(noBatch);
  ASSERT_FALSE(static_cast<bool>(plan));
  EXPECT_NE(llvm::toString(plan.takeError()).find("--parallel auto: give --batch"),
            std::string::npos);
  CompileOptions wideNode = searching(8);
  wideNode.parallel.gpusPerNode = 16;
  plan = compile(wideNode);
  ASSERT_FALSE(static_cast<bool>(plan));
  EXPECT_NE(llvm::toString(plan.takeError()).find("--gpus-per-node 16"), std::string::npos);
  // Nothing fits a megabyte: the error names the layout that came closest.
  CompileOptions tiny = searching(8);
  tiny.memoryLimit = "1MB";
  plan = compile(tiny);
  ASSERT_FALSE(static_cast<bool>(plan));
  std::string why = llvm::toString(plan.takeError());
  EXPECT_NE(why.find("no layout of 8 devices fits the memory limit; the closest, T="),
            std::string::npos)
      << why;
}

} // namespace
