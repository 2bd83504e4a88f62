//===- ExecutorTest.cpp - Pipelined training equals one-rank training ---===//
//
// The invariant the project leans on: a pipelined training step gives the
// same loss, gradients and updated weights as the same step on one rank with
// the full batch, for every schedule, P, V, M and data-parallel degree. Both
// sides run the real executor on the CPU kernels; only the plan differs.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "compiler/Compile.h"
#include "runtime/core/Data.h"
#include "runtime/core/Executor.h"
#include "runtime/plan/PlanFile.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cmath>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

struct Config {
  std::string schedule = "1f1b";
  int stages = 1, virtualStages = 1, microbatches = 1, dp = 1;
};

plan::Plan compileFor(const std::string &model, const Config &s, int64_t globalBatch,
                      bool recompute = false, const std::string &optimizer = "sgd") {
  CompileOptions options;
  options.stages = s.stages;
  options.virtualStages = s.virtualStages;
  options.microbatches = s.microbatches;
  options.globalBatch = globalBatch;
  options.dataParallel = s.dp;
  options.hardware = "cpu";
  options.balance = "uniform";
  options.recompute = recompute;
  auto kind = parseSchedule(s.schedule);
  EXPECT_TRUE(static_cast<bool>(kind)) << s.schedule;
  if (!kind) {
    llvm::consumeError(kind.takeError());
    return {};
  }
  options.schedule = *kind;
  (void)optimizer;
  auto plan = compileModel(model, options, PipelineOptions());
  EXPECT_TRUE(static_cast<bool>(plan)) << (plan ? "" : llvm::toString(plan.takeError()));
  if (!plan)
    return {};
  for (const std::string &w : plan->warnings())
    EXPECT_FALSE(llvm::StringRef(w).startswith("the plan cannot be run")) << w;
  return *plan;
}

rt::RunResult runPlan(const plan::Plan &plan, const std::string &optimizer = "sgd", int steps = 1) {
  rt::RunOptions options;
  options.steps = steps;
  options.seed = 7;
  options.optimizer = optimizer;
  options.lr = optimizer == "adamw" ? 1e-2 : 0.5;
  options.collectWeights = true;
  options.timeoutSeconds = 60;
  auto result = rt::runLocal(plan, options);
  EXPECT_TRUE(static_cast<bool>(result)) << (result ? "" : llvm::toString(result.takeError()));
  if (!result)
    return {};
  return std::move(*result);
}

/// ||a - b|| / ||b||.
double relativeError(const cpu::Tensor &a, const cpu::Tensor &b) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < b.numElements(); ++i) {
    double x = a.getDouble(i), y = b.getDouble(i);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

/// Loss, every gradient and every updated weight agree within \p tolerance
/// (relative, in norm).
void expectSameStep(const rt::RunResult &pipelined, const rt::RunResult &reference,
                    const std::string &what, double tolerance = 1e-5) {
  ASSERT_EQ(pipelined.losses.size(), reference.losses.size()) << what;
  for (size_t t = 0; t < reference.losses.size(); ++t)
    EXPECT_LT(std::abs(pipelined.losses[t] - reference.losses[t]) / std::abs(reference.losses[t]),
              tolerance)
        << what << " step " << t << ": loss " << pipelined.losses[t] << " vs "
        << reference.losses[t];
  ASSERT_FALSE(reference.weights.empty()) << what;
  ASSERT_EQ(pipelined.weights.size(), reference.weights.size()) << what;
  ASSERT_EQ(pipelined.gradients.size(), reference.gradients.size()) << what;
  double worstGrad = 0, worstWeight = 0;
  std::string worstName;
  for (const auto &[name, ref] : reference.gradients) {
    auto it = pipelined.gradients.find(name);
    ASSERT_NE(it, pipelined.gradients.end()) << what << ": no gradient of " << name;
    double e = relativeError(it->second, ref);
    if (e > worstGrad)
      worstGrad = e, worstName = name;
  }
  for (const auto &[name, ref] : reference.weights) {
    auto it = pipelined.weights.find(name);
    ASSERT_NE(it, pipelined.weights.end()) << what << ": no weight " << name;
    worstWeight = std::max(worstWeight, relativeError(it->second, ref));
  }
  EXPECT_LT(worstGrad, tolerance) << what << ": gradient of " << worstName;
  EXPECT_LT(worstWeight, tolerance) << what;
}

class Equivalence : public ::testing::Test {
protected:
  static void SetUpTestSuite() { dir = new TempDir(); }
  static void TearDownTestSuite() { delete dir; }

  static std::string model(const std::string &name, const models::GeneratorOptions &options) {
    std::string path = dir->path(name + ".onnx");
    if (!llvm::sys::fs::exists(path)) {
      auto proto = models::generateModel(options);
      EXPECT_TRUE(static_cast<bool>(proto));
      if (!proto)
        return path;
      llvm::consumeError(models::writeModel(*proto, path, false));
    }
    return path;
  }
  static std::string gpt(bool tied = true) {
    models::GeneratorOptions o;
    o.family = models::Family::Gpt;
    o.layers = 6;
    o.hidden = 32;
    o.heads = 4;
    o.vocab = 64;
    o.seq = 8;
    o.tiedEmbeddings = tied;
    o.withLoss = true;
    return model(tied ? "gpt-tied" : "gpt", o);
  }
  static std::string mlp() {
    models::GeneratorOptions o;
    o.family = models::Family::Mlp;
    o.layers = 6;
    o.hidden = 48;
    o.vocab = 24;
    o.withLoss = true;
    return model("mlp", o);
  }

  /// Pipelined \p setups against one rank with the whole batch.
  void check(const std::string &path, int64_t batch, const std::vector<Config> &setups,
             const std::string &optimizer = "sgd", int steps = 1, double tolerance = 1e-5) {
    plan::Plan single = compileFor(path, Config{"gpipe", 1, 1, 1, 1}, batch);
    rt::RunResult reference = runPlan(single, optimizer, steps);
    for (const Config &s : setups) {
      std::string what = formatv("{0} {1} P={2} V={3} M={4} dp={5}", llvm::sys::path::stem(path),
                                 s.schedule, s.stages, s.virtualStages, s.microbatches, s.dp);
      plan::Plan pipelined = compileFor(path, s, batch);
      if (pipelined.stage_programs_size() == 0)
        continue;
      SCOPED_TRACE(what);
      expectSameStep(runPlan(pipelined, optimizer, steps), reference, what, tolerance);
    }
  }

  static TempDir *dir;
};

TempDir *Equivalence::dir = nullptr;

const std::vector<Config> &everySchedule() {
  static const std::vector<Config> setups = {
      {"gpipe", 2, 1, 4, 1},       {"gpipe", 4, 1, 8, 1},     {"1f1b", 2, 1, 2, 1},
      {"1f1b", 4, 1, 8, 1},        {"1f1b", 3, 1, 4, 1},      {"interleaved", 2, 2, 4, 1},
      {"interleaved", 2, 2, 8, 1}, {"zb-h1", 2, 1, 4, 1},     {"zb-h1", 4, 1, 8, 1},
      {"zb-h2", 2, 1, 4, 1},       {"zb-h2", 4, 1, 8, 1},     {"zbv", 2, 2, 4, 1},
      {"zbv", 2, 2, 8, 1},         {"dualpipev", 2, 2, 4, 1}, {"dualpipev", 2, 2, 8, 1},
  };
  return setups;
}

TEST_F(Equivalence, GptTiedEverySchedule) { check(gpt(true), 8, everySchedule()); }

TEST_F(Equivalence, GptUntied) {
  check(gpt(false), 8, {{"1f1b", 4, 1, 4, 1}, {"zbv", 2, 2, 4, 1}, {"interleaved", 2, 2, 4, 1}});
}

TEST_F(Equivalence, MlpEverySchedule) { check(mlp(), 8, everySchedule()); }

TEST_F(Equivalence, DataParallelTimesPipeline) {
  check(gpt(true), 8, {{"1f1b", 2, 1, 2, 2}, {"zb-h1", 2, 1, 2, 2}, {"gpipe", 1, 1, 4, 2}});
}

// Adam divides by sqrt(v): where a gradient is near zero, the last-bit
// differences of a different summation order grow into the update, and
// over three steps into the gradients: 1e-4 here, 1e-5 for one SGD step.
TEST_F(Equivalence, AdamWOverThreeSteps) {
  check(gpt(true), 4, {{"1f1b", 2, 1, 2, 1}, {"zbv", 2, 2, 4, 1}}, "adamw", 3, 1e-4);
}

TEST_F(Equivalence, MomentumOverThreeSteps) {
  check(mlp(), 8, {{"interleaved", 2, 2, 4, 1}}, "momentum", 3);
}

TEST_F(Equivalence, RecomputeChangesNothing) {
  std::string path = gpt(true);
  rt::RunResult plain = runPlan(compileFor(path, Config{"1f1b", 2, 1, 4, 1}, 8));
  rt::RunResult again = runPlan(compileFor(path, Config{"1f1b", 2, 1, 4, 1}, 8, true));
  expectSameStep(again, plain, "recompute", 1e-7);
}

TEST_F(Equivalence, TrainingLowersTheLossOnAFixedDataset) {
  // Eight samples written as .npy: every step sees the same batch, which the
  // model must fit.
  std::string path = mlp();
  plan::Plan whole = compileFor(path, Config{"gpipe", 1, 1, 1, 1}, 8);
  auto synthetic = rt::DataSource::open(whole, "", 3);
  ASSERT_TRUE(static_cast<bool>(synthetic));
  std::string data = dir->path("fixed-data");
  ASSERT_FALSE(llvm::sys::fs::create_directories(data));
  for (const plan::DataInput &in : whole.data()) {
    auto tensor = (*synthetic)->microbatch(in.name(), 0);
    ASSERT_TRUE(static_cast<bool>(tensor));
    ASSERT_FALSE(static_cast<bool>(rt::writeNpy(*tensor, data + "/" + in.name() + ".npy")));
  }
  plan::Plan p = compileFor(path, Config{"1f1b", 2, 1, 2, 1}, 8);
  rt::RunOptions options;
  options.steps = 150;
  options.optimizer = "adamw";
  options.lr = 1e-2;
  options.dataDir = data;
  auto result = rt::runLocal(p, options);
  ASSERT_TRUE(static_cast<bool>(result)) << llvm::toString(result.takeError());
  ASSERT_EQ(result->losses.size(), 150u);
  EXPECT_LT(result->losses.back(), 0.5 * result->losses.front());
}

} // namespace
