//===- Equivalence.h - Pipelined runs against one-rank runs -------------===//
//
// What the equivalence tests share: compiling a model for a pipeline shape,
// running a plan on local ranks with the weights and gradients collected,
// comparing two runs' losses, gradients, weights and every copy of them, the
// Equivalence fixture with its small models, and RunCli, the same through
// the pipec command line (mpirun included). Included by one source file
// per test binary (ExecutorTest, MemoryAtScaleTest): everything here is
// that binary's own.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_EQUIVALENCE_H
#define PIPEC_TESTS_EQUIVALENCE_H

#include "TestUtil.h"

#include "driver/Compile.h"
#include "runtime/exec/Executor.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace pipec::test {
namespace {

using llvm::formatv;

struct Config {
  std::string schedule = "1f1b";
  int stages = 1, virtualStages = 1, microbatches = 1, dp = 1;
  bool shardOptimizer = false;
  /// --tp: tensor-parallel ranks per stage.
  int tp = 1;
  /// --sequence-parallel (with tp > 1).
  bool sequenceParallel = false;
  /// --memory-limit; empty: the hardware's.
  std::string memoryLimit;
  /// --balance: uniform keeps the split fixed whatever the costs.
  std::string balance = "uniform";
  /// false: compile with --no-fuse.
  bool fuse = true;
  /// false: compile with --attention unfused.
  bool fuseAttention = true;
  /// --precision bf16 --autocast.
  bool autocast = false;
};

/// \p schedule over \p stages ranks of \p tp tensor-parallel ranks each
/// (with \p sequenceParallel, the rest split on the tokens over them).
Config split(const std::string &schedule, int stages, int virtualStages, int microbatches,
             int tp = 2, int dp = 1, bool shardOptimizer = false, bool sequenceParallel = false) {
  Config c;
  c.schedule = schedule;
  c.stages = stages;
  c.virtualStages = virtualStages;
  c.microbatches = microbatches;
  c.dp = dp;
  c.shardOptimizer = shardOptimizer;
  c.tp = tp;
  c.sequenceParallel = sequenceParallel;
  return c;
}

/// The plan of \p model for \p s; a failure is the test's, or with
/// \p error given, its message there and an empty plan.
plan::Plan compileFor(const std::string &model, const Config &s, int64_t globalBatch,
                      Recompute recompute = Recompute::None, std::string *error = nullptr) {
  CompileOptions options;
  options.stages = s.stages;
  options.virtualStages = s.virtualStages;
  options.microbatches = s.microbatches;
  options.globalBatch = globalBatch;
  options.dataParallel = s.dp;
  options.tensorParallel = s.tp;
  options.sequenceParallel = s.sequenceParallel;
  options.hardware = "cpu";
  options.balance = s.balance;
  options.recompute = recompute;
  options.shardOptimizer = s.shardOptimizer;
  options.memoryLimit = s.memoryLimit;
  options.fuse = s.fuse;
  options.fuseAttention = s.fuseAttention;
  if (s.autocast) {
    options.precision = "bf16";
    options.autocast = true;
  }
  auto kind = parseSchedule(s.schedule);
  EXPECT_TRUE(static_cast<bool>(kind)) << s.schedule;
  if (!kind) {
    llvm::consumeError(kind.takeError());
    return {};
  }
  options.schedule = *kind;
  auto plan = compileModel(model, options, PipelineOptions());
  if (!plan && error) {
    *error = llvm::toString(plan.takeError());
    return {};
  }
  EXPECT_TRUE(static_cast<bool>(plan)) << (plan ? "" : llvm::toString(plan.takeError()));
  if (!plan)
    return {};
  for (const std::string &w : plan->warnings())
    EXPECT_FALSE(llvm::StringRef(w).startswith("the plan cannot be run")) << w;
  return *plan;
}

/// Extra run settings for the equivalence checks (clipping, schedules).
rt::RunOptions extraOptions;

/// extraOptions for \p steps of \p optimizer from seed 7 (lr 0.5, adamw's
/// 1e-3), the weights and gradients collected.
rt::RunOptions stepOptions(const std::string &optimizer = "sgd", int steps = 1) {
  rt::RunOptions options = extraOptions;
  options.steps = steps;
  options.seed = 7;
  options.optimizer = llvm::cantFail(parseOptimizer(optimizer));
  options.lr = optimizer == "adamw" ? 1e-3 : 0.5;
  options.collectWeights = true;
  return options;
}

rt::RunResult runPlan(const plan::Plan &plan, const std::string &optimizer = "sgd", int steps = 1) {
  rt::RunOptions options = stepOptions(optimizer, steps);
  options.timeoutSeconds = 60;
  auto result = rt::runLocal(plan, options);
  EXPECT_TRUE(static_cast<bool>(result)) << (result ? "" : llvm::toString(result.takeError()));
  if (!result)
    return {};
  return std::move(*result);
}

double norm(const cpu::Tensor &t) {
  double sum = 0;
  for (int64_t i = 0; i < t.numElements(); ++i)
    sum += t.getDouble(i) * t.getDouble(i);
  return std::sqrt(sum);
}

/// ||a - b|| / max(||b||, floor).
double relativeError(const cpu::Tensor &a, const cpu::Tensor &b, double floor = 0) {
  double diff = 0;
  for (int64_t i = 0; i < b.numElements(); ++i) {
    double x = a.getDouble(i), y = b.getDouble(i);
    diff += (x - y) * (x - y);
  }
  double scale = std::max(norm(b), floor);
  return scale > 0 ? std::sqrt(diff) / scale : std::sqrt(diff);
}

/// Loss, every gradient and every updated weight agree within \p tolerance
/// (relative, in norm).
void expectSameStep(const rt::RunResult &pipelined, const rt::RunResult &reference,
                    const std::string &what, double tolerance = 1e-5) {
  ASSERT_EQ(pipelined.losses().size(), reference.losses().size()) << what;
  for (size_t t = 0; t < reference.losses().size(); ++t)
    EXPECT_LT(std::abs(pipelined.losses()[t] - reference.losses()[t]) /
                  std::abs(reference.losses()[t]),
              tolerance)
        << what << " step " << t << ": loss " << pipelined.losses()[t] << " vs "
        << reference.losses()[t];
  ASSERT_FALSE(reference.losses().empty()) << what;
  ASSERT_FALSE(reference.gradients.empty()) << what;
  ASSERT_FALSE(reference.weights.empty()) << what;
  ASSERT_EQ(pipelined.weights.size(), reference.weights.size()) << what;
  ASSERT_EQ(pipelined.gradients.size(), reference.gradients.size()) << what;
  double worstGrad = 0, worstWeight = 0;
  std::string worstName;
  // A gradient that is zero in exact arithmetic (a key bias: softmax ignores
  // a shift shared by all keys) is rounding noise on both sides; it is held
  // to 1e-4 of the whole gradient's norm rather than to its own.
  double total = 0;
  for (const auto &[name, ref] : reference.gradients)
    total += norm(ref) * norm(ref);
  double floor = 1e-4 * std::sqrt(total);
  for (const auto &[name, ref] : reference.gradients) {
    auto it = pipelined.gradients.find(name);
    ASSERT_NE(it, pipelined.gradients.end()) << what << ": no gradient of " << name;
    double e = relativeError(it->second, ref, floor);
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
  // Every copy: a tied weight on each rank that holds it, each replica's.
  ASSERT_FALSE(pipelined.weightCopies.empty()) << what;
  double worstCopy = 0;
  std::string worstCopyName;
  for (const auto &copy : pipelined.weightCopies) {
    auto it = reference.weights.find(copy.name);
    ASSERT_NE(it, reference.weights.end()) << what << ": no weight " << copy.name;
    double e = relativeError(copy.value, it->second);
    if (e > worstCopy)
      worstCopy = e,
      worstCopyName = formatv("{0} on rank {1} of replica {2}", copy.name, copy.rank, copy.replica);
  }
  EXPECT_LT(worstCopy, tolerance) << what << ": the copy of " << worstCopyName;
}

/// Each trained weight has a copy on every replica, and returns how many
/// weights have more than one copy in a replica (tied weights split over
/// ranks).
int expectCopiesEverywhere(const rt::RunResult &pipelined, const rt::RunResult &reference,
                           int replicas, const std::string &what) {
  std::map<std::string, std::map<int, int>> copies; // name -> replica -> copies
  for (const auto &copy : pipelined.weightCopies)
    ++copies[copy.name][copy.replica];
  int tied = 0;
  for (const auto &[name, ref] : reference.weights) {
    EXPECT_EQ(static_cast<int>(copies[name].size()), replicas) << what << ": replicas of " << name;
    tied += !copies[name].empty() && copies[name].begin()->second > 1;
  }
  return tied;
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
      llvm::Error err = models::writeModel(*proto, path, false);
      EXPECT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
    }
    return path;
  }
  /// A small transformer with a loss: 4 blocks of width 32, 4 heads,
  /// vocabulary 64, sequence 8.
  static models::GeneratorOptions transformer(models::Family family) {
    models::GeneratorOptions o(family, 4, 32, 64, 8, 4);
    o.withLoss = true;
    return o;
  }
  static std::string gpt(bool tied = true) {
    models::GeneratorOptions o = transformer(models::Family::Gpt);
    o.layers = 6;
    o.tiedEmbeddings = tied;
    return model(tied ? "gpt-tied" : "gpt", o);
  }
  /// 12 blocks: room for P x V = 12 chunks.
  static std::string gptDeep() {
    models::GeneratorOptions o = transformer(models::Family::Gpt);
    o.layers = 12;
    o.tiedEmbeddings = true;
    return model("gpt-deep", o);
  }
  static std::string mlp() {
    models::GeneratorOptions o(models::Family::Mlp, 6, 48, 24);
    o.withLoss = true;
    return model("mlp", o);
  }
  static std::string llama() {
    models::GeneratorOptions o = transformer(models::Family::Llama);
    o.kvHeads = 2;
    return model("llama", o);
  }
  static std::string bert() { return model("bert", transformer(models::Family::Bert)); }
  static std::string gptHalf() {
    models::GeneratorOptions o = transformer(models::Family::Gpt);
    o.fp16Weights = true;
    return model("gpt-fp16", o);
  }
  static std::string cnn() {
    models::GeneratorOptions o(models::Family::Resnet, 4, 4, 10, 16);
    o.withLoss = true;
    return model("cnn", o);
  }

  /// Pipelined \p setups against one rank with the whole batch.
  void check(const std::string &path, int64_t batch, const std::vector<Config> &setups,
             const std::string &optimizer = "sgd", int steps = 1, double tolerance = 1e-5) {
    plan::Plan single = compileFor(path, Config{"gpipe", 1, 1, 1, 1}, batch);
    rt::RunResult reference = runPlan(single, optimizer, steps);
    for (const Config &s : setups) {
      std::string what = formatv("{0} {1} P={2} V={3} M={4} dp={5} tp={6}{7}",
                                 llvm::sys::path::stem(path), s.schedule, s.stages, s.virtualStages,
                                 s.microbatches, s.dp, s.tp, s.sequenceParallel ? " sp" : "");
      plan::Plan pipelined = compileFor(path, s, batch);
      if (pipelined.stage_programs_size() == 0) {
        ADD_FAILURE() << what << ": the plan has no stage programs to run";
        continue;
      }
      SCOPED_TRACE(what);
      rt::RunResult run = runPlan(pipelined, optimizer, steps);
      expectSameStep(run, reference, what, tolerance);
      splitTiedWeights = expectCopiesEverywhere(run, reference, s.dp, what);
    }
  }

  /// After check(): of its last setup, the weights with a copy on more than
  /// one rank.
  int splitTiedWeights = 0;

  static TempDir *dir;
};

TempDir *Equivalence::dir = nullptr;

//===----------------------------------------------------------------------===//
// Through the CLI
//===----------------------------------------------------------------------===//

std::string pipecBin() { return std::string(PIPEC_BINARY_DIR) + "/bin/pipec"; }

bool haveMpirun() {
  std::string out;
  return runCommand("mpirun --version", out) == 0;
}

/// mpirun as root, oversubscribed (tests start more ranks than cores).
std::string mpirun(int ranks, const std::string &env = "") {
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  if (!env.empty())
    cmd += env + " ";
  cmd += formatv("mpirun -np {0} --oversubscribe", ranks).str();
  if (!env.empty())
    cmd += " -x " + env.substr(0, env.find('='));
  return cmd + " ";
}

/// Initializers of an ONNX file by name.
std::map<std::string, cpu::Tensor> readWeights(const std::string &path) {
  std::map<std::string, cpu::Tensor> out;
  onnx::ModelProto model;
  std::string bytes = readFile(path);
  EXPECT_TRUE(model.ParseFromString(bytes)) << path;
  for (const onnx::TensorProto &t : model.graph().initializer()) {
    auto tensor = cpu::fromTensorProto(t, llvm::sys::path::parent_path(path));
    EXPECT_TRUE(static_cast<bool>(tensor));
    if (tensor)
      out.emplace(t.name(), std::move(*tensor));
  }
  return out;
}

class RunCli : public Equivalence {
protected:
  /// \p model compiled with \p flags (tensor-parallel over 4 ranks), run 2
  /// SGD steps as threads and as 4 MPI processes: the weights saved equal
  /// one rank's, and the two runs' files are the same bytes. Returns the
  /// split plan.
  std::string checkSplitRuns(const std::string &model, const std::string &flags,
                             const std::string &name);
  /// Compiles \p model to a plan file with the given compile flags.
  std::string plan(const std::string &model, const std::string &flags, const std::string &name) {
    std::string path = dir->path(name + ".plan"), out;
    int rc = runCommand(
        pipecBin() + " compile " + model + " -o " + path + " --hardware cpu " + flags, out);
    EXPECT_EQ(rc, 0) << out;
    return path;
  }
};

/// The largest relative error over the weights of two saved models.
double worstWeightError(const std::string &a, const std::string &b) {
  auto left = readWeights(a), right = readWeights(b);
  EXPECT_GT(right.size(), 10u) << b;
  EXPECT_EQ(left.size(), right.size()) << a << " and " << b;
  double worst = 0;
  for (const auto &[w, ref] : right)
    if (left.count(w))
      worst = std::max(worst, relativeError(left.at(w), ref));
  return worst;
}

std::string RunCli::checkSplitRuns(const std::string &model, const std::string &flags,
                                   const std::string &name) {
  std::string out;
  std::string one = plan(model, "--stages 1 --microbatches 1 --batch 8", name + "-one");
  std::string split = plan(model, flags, name + "-split");
  std::string run = " --steps 2 --optimizer sgd --lr 0.5 --quiet --save-weights ";
  std::string saved = dir->path(name + "-one.onnx"), local = dir->path(name + "-local.onnx");
  EXPECT_EQ(runCommand(pipecBin() + " run " + one + run + saved, out), 0) << out;
  EXPECT_EQ(runCommand(pipecBin() + " run " + split + run + local, out), 0) << out;
  EXPECT_LT(worstWeightError(local, saved), 1e-5);
  if (!haveMpirun())
    return split;
  std::string mpi = dir->path(name + "-mpi.onnx");
  EXPECT_EQ(runCommand(mpirun(4) + pipecBin() + " run " + split + " --comm mpi" + run + mpi, out),
            0)
      << out;
  EXPECT_EQ(readFile(local), readFile(mpi));
  return split;
}

} // namespace
} // namespace pipec::test

#endif // PIPEC_TESTS_EQUIVALENCE_H
