//===- ExecutorTest.cpp - Pipelined training equals one-rank training ---===//
//
// The invariant the project leans on: a pipelined training step gives the
// same loss, gradients and updated weights as the same step on one rank with
// the full batch, for every schedule, P, V, M and data-parallel degree. Both
// sides run the real executor on the CPU kernels; only the plan differs.
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "compiler/sim/Simulator.h"
#include "driver/Compile.h"
#include "plan/PlanFile.h"
#include "runtime/core/Backend.h"
#include "runtime/exec/Data.h"
#include "runtime/exec/Executor.h"
#include "runtime/exec/StepProfile.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/Path.h"

#include <chrono>
#include <cmath>
#include <fstream>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

const std::vector<Config> &everySchedule() {
  static const std::vector<Config> setups = {
      {"gpipe", 2, 1, 4, 1},       {"gpipe", 4, 1, 8, 1},      {"1f1b", 2, 1, 2, 1},
      {"1f1b", 4, 1, 8, 1},        {"1f1b", 3, 1, 4, 1},       {"interleaved", 2, 2, 4, 1},
      {"interleaved", 2, 2, 8, 1}, {"zb-h1", 2, 1, 4, 1},      {"zb-h1", 4, 1, 8, 1},
      {"zb-h2", 2, 1, 4, 1},       {"zb-h2", 4, 1, 8, 1},      {"zbv", 2, 2, 4, 1},
      {"zbv", 2, 2, 8, 1},         {"dualpipev", 2, 2, 4, 1},  {"dualpipev", 2, 2, 8, 1},
      {"looped-bfs", 2, 2, 4, 1},  {"looped-bfs", 2, 3, 2, 1},
  };
  return setups;
}

TEST_F(Equivalence, GptTiedEverySchedule) { check(gpt(true), 8, everySchedule()); }

TEST_F(Equivalence, GptUntied) {
  check(gpt(false), 8, {{"1f1b", 4, 1, 4, 1}, {"zbv", 2, 2, 4, 1}, {"interleaved", 2, 2, 4, 1}});
}

TEST_F(Equivalence, MlpEverySchedule) { check(mlp(), 8, everySchedule()); }

TEST_F(Equivalence, LlamaGroupedQueryAttention) {
  check(llama(), 4, {{"1f1b", 2, 1, 4, 1}, {"zb-h2", 3, 1, 4, 1}, {"dualpipev", 2, 2, 4, 1}});
}

// BERT's extended attention mask is a float activation no gradient
// reaches: it crosses every boundary forward and nothing comes back.
TEST_F(Equivalence, BertEncoder) {
  check(bert(), 4, {{"1f1b", 3, 1, 4, 1}, {"zbv", 2, 2, 4, 1}, {"interleaved", 2, 2, 2, 1}});
}

// float16 weights train through float32 master copies; every op rounds to
// float16, so a different summation order shows at float16's precision.
TEST_F(Equivalence, Float16WeightsTrainThroughFloat32Masters) {
  check(gptHalf(), 4, {{"1f1b", 2, 1, 4, 1}, {"zbv", 2, 2, 4, 1}}, "adamw", 2, 1e-2);
}

TEST_F(Equivalence, CnnEverySchedule) {
  check(cnn(), 4,
        {{"gpipe", 2, 1, 4, 1},
         {"1f1b", 3, 1, 4, 1},
         {"interleaved", 2, 2, 4, 1},
         {"zb-h1", 2, 1, 2, 1},
         {"zb-h2", 2, 1, 4, 1},
         {"zbv", 2, 2, 4, 1},
         {"dualpipev", 2, 2, 4, 1}});
}

TEST_F(Equivalence, DataParallelTimesPipeline) {
  check(gpt(true), 8, {{"1f1b", 2, 1, 2, 2}, {"zb-h1", 2, 1, 2, 2}, {"gpipe", 1, 1, 4, 2}});
}

// Adam divides by sqrt(v): where a gradient is near zero, the last-bit
// differences of a different summation order grow into the update, and
// over three steps into the gradients: 1e-4 here, 1e-5 for one SGD step.
TEST_F(Equivalence, AdamWOverThreeSteps) {
  check(gpt(true), 4, {{"1f1b", 2, 1, 2, 1}, {"zbv", 2, 2, 4, 1}}, "adamw", 3, 1e-4);
}

// The multi-chunk schedules past P = 2: interleaved (V = 2 and 3), ZB-V and
// DualPipeV at P = 3 and 4, with M not a multiple of P (PyTorch's rounds of
// M / max(1, M / P) for interleaved), then ZB-V and DualPipeV under --dp 2;
// three SGD steps, so a tied weight whose copies drifted apart shows.
TEST_F(Equivalence, MultiChunkSchedulesAtThreeAndFourRanks) {
  check(gptDeep(), 12,
        {{"interleaved", 3, 2, 4, 1},
         {"interleaved", 4, 2, 6, 1},
         {"interleaved", 3, 3, 4, 1},
         {"interleaved", 4, 3, 4, 1},
         {"zbv", 3, 2, 4, 1},
         {"zbv", 4, 2, 6, 1}},
        "sgd", 3);
  // Interleaved with M = 5 over P = 4 (one round of 5, as PyTorch's
  // ScheduleInterleaved1F1B runs it; Megatron-LM's default groups of P
  // refuse it); the tied embedding and head sit on ranks 0 and 3, and both
  // copies are compared.
  check(gptDeep(), 10, {{"interleaved", 4, 2, 5, 1}}, "sgd", 3);
  EXPECT_EQ(splitTiedWeights, 1);
  check(gptDeep(), 14, {{"dualpipev", 3, 2, 7, 1}}, "sgd", 3);
  check(gptDeep(), 10, {{"dualpipev", 4, 2, 10, 1}}, "sgd", 3);
  check(gpt(true), 8, {{"zbv", 2, 2, 4, 2}, {"dualpipev", 2, 2, 4, 2}}, "sgd", 3);
  // Interleaved over two replicas with the tied weight on ranks 0 and 2:
  // four copies of it, all compared.
  check(gptDeep(), 12, {{"interleaved", 3, 2, 3, 2}}, "sgd", 3);
  EXPECT_EQ(splitTiedWeights, 1);
}

TEST_F(Equivalence, MomentumOverThreeSteps) {
  check(mlp(), 8, {{"interleaved", 2, 2, 4, 1}}, "momentum", 3);
}

// The global gradient norm counts every weight once (a tied embedding on one
// of its two ranks), so clipping scales a pipelined step as it scales the
// one-rank step; with a warm-up and a cosine schedule over three steps.
TEST_F(Equivalence, ClippingAndScheduleMatch) {
  extraOptions.clipGradNorm = 0.05;
  extraOptions.lrSchedule = "cosine";
  extraOptions.warmup = 1;
  check(gpt(true), 8, {{"1f1b", 2, 1, 4, 1}, {"zbv", 2, 2, 4, 1}, {"1f1b", 2, 1, 2, 2}}, "sgd", 3);
  extraOptions = rt::RunOptions();
}

// Recompute, including V-shaped schedules, whose next stage on the same rank
// hands its gradient over before this stage recomputes.
TEST_F(Equivalence, RecomputeChangesNothing) {
  std::string path = gpt(true);
  for (const Config &c :
       {Config{"1f1b", 2, 1, 4, 1}, Config{"zbv", 2, 2, 4, 1}, Config{"dualpipev", 2, 2, 4, 1}}) {
    plan::Plan rebuilt = compileFor(path, c, 8, Recompute::All);
    int recomputes = 0;
    for (const plan::RankProgram &p : rebuilt.programs())
      for (const plan::Instruction &i : p.instructions())
        recomputes += i.op() == plan::Instruction::RECOMPUTE;
    EXPECT_EQ(recomputes, c.stages * c.virtualStages * c.microbatches) << c.schedule;
    rt::RunResult plain = runPlan(compileFor(path, c, 8));
    expectSameStep(runPlan(rebuilt), plain, "recompute " + c.schedule, 1e-7);
  }
}

// Fused element-wise kernels compute each op as its own kernel does: a fused
// plan (the default, so every check above runs fused) equals one compiled
// with --no-fuse, for every model family, forward, both backward halves, and
// recompute.
TEST_F(Equivalence, FusionChangesNothing) {
  struct Case {
    std::string path;
    bool expectFused;
  };
  for (const Case &c : {Case{gpt(true), true}, Case{llama(), true}, Case{bert(), true},
                        Case{gptHalf(), true}, Case{mlp(), false}, Case{cnn(), false}}) {
    for (const Config &setup : {Config{"1f1b", 2, 1, 4, 1}, Config{"zbv", 2, 2, 4, 1}}) {
      std::string what = llvm::sys::path::stem(c.path).str() + " " + setup.schedule;
      Recompute recompute = setup.schedule == "zbv" ? Recompute::All : Recompute::None;
      Config unfused = setup;
      unfused.fuse = false;
      plan::Plan plainPlan = compileFor(c.path, unfused, 8, recompute);
      plan::Plan fusedPlan = compileFor(c.path, setup, 8, recompute);
      rt::RunResult plain = runPlan(plainPlan, "sgd", 2);
      rt::RunResult fused = runPlan(fusedPlan, "sgd", 2);
      const plan::Fusion &made = fusedPlan.fusion();
      EXPECT_EQ(plainPlan.fusion().groups(), 0) << what;
      // GPT's and BERT's linear layers have biases; Llama's do not.
      if (what.find("llama") == std::string::npos && c.expectFused) {
        EXPECT_GT(made.mat_mul_bias(), 0) << what;
      }
      if (c.expectFused) {
        EXPECT_GT(made.groups(), 0) << what;
        EXPECT_GT(made.nodes(), 2 * made.groups()) << what;
        EXPECT_LT(fused.nodes, plain.nodes) << what;
      }
      // Fused nodes sum in another order where they take another GEMM
      // (MatMulTransposed's few-row dot products against the BLAS on the
      // Transpose's copy): within float rounding of those sums.
      expectSameStep(fused, plain, "fusion " + what, 1e-6);
    }
  }
  extraOptions = rt::RunOptions();
}

// .npy files hold float16 in 16 bits and bools in a byte, as numpy writes
// them; a round trip keeps every value.
TEST(Npy, RoundTripsEveryType) {
  TempDir dir;
  std::vector<cpu::Tensor> tensors = {
      cpu::Tensor::fromValues<float>({2, 2}, {1.5f, -2.25f, 65504.0f, 0.0009765625f},
                                     cpu::DType::F16),
      cpu::Tensor::fromValues<bool>({3}, {true, false, true}),
      cpu::Tensor::fromValues<int64_t>({2}, {-7, 1ll << 40}),
      cpu::Tensor::fromValues<float>({1}, {3.25f})};
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::string path = dir.path("t" + std::to_string(i) + ".npy");
    ASSERT_FALSE(static_cast<bool>(rt::writeNpy(tensors[i], path)));
    // float16: 2 bytes per element after the 64-byte-aligned header.
    if (i == 0) {
      EXPECT_EQ(readFile(path).size() % 64, 8u);
    }
    auto back = rt::readNpy(path);
    ASSERT_TRUE(static_cast<bool>(back)) << llvm::toString(back.takeError());
    std::string why;
    EXPECT_TRUE(cpu::allClose(*back, tensors[i], 0, 0, &why)) << i << ": " << why;
  }
}

// Half gradient terms (a half activation read twice) sum in float and round
// to the half type; a float32 accumulator takes half terms as they are.
TEST(CpuBackend, SumsHalfTermsAndRounds) {
  auto be = rt::makeCpuBackend();
  cpu::Tensor a = cpu::Tensor::fromValues<float>({3}, {1.0f, 0.1f, 1000.0f}, cpu::DType::F16);
  cpu::Tensor b = cpu::Tensor::fromValues<float>({3}, {2.0f, 0.2f, 0.3f}, cpu::DType::F16);
  auto total = be->sum({&a, &b});
  ASSERT_TRUE(static_cast<bool>(total)) << llvm::toString(total.takeError());
  ASSERT_EQ(total->elemType(), cpu::DType::F16);
  cpu::Tensor expected = cpu::Tensor::fromValues<float>({3},
                                                        {a.data<float>()[0] + b.data<float>()[0],
                                                         a.data<float>()[1] + b.data<float>()[1],
                                                         a.data<float>()[2] + b.data<float>()[2]},
                                                        cpu::DType::F16);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(total->data<float>()[i], expected.data<float>()[i]) << i;
  // 1000 + 0.3 is not a float16 (steps of 0.5 there): rounded to 1000.5.
  EXPECT_EQ(total->data<float>()[2], 1000.5f);
  cpu::Tensor acc(cpu::DType::F32, {3});
  ASSERT_FALSE(static_cast<bool>(be->addInto(acc, a)));
  EXPECT_EQ(acc.data<float>()[1], a.data<float>()[1]);
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
  options.optimizer = Optimizer::AdamW;
  options.lr = 1e-2;
  options.dataDir = data;
  auto result = rt::runLocal(p, options);
  ASSERT_TRUE(static_cast<bool>(result)) << llvm::toString(result.takeError());
  ASSERT_EQ(result->losses().size(), 150u);
  EXPECT_LT(result->losses().back(), 0.5 * result->losses().front());
}

// Training-mode BatchNormalization normalizes each microbatch by its own
// statistics; after the step its running mean and variance take the mean
// over every microbatch and replica of the batches' mean and unbiased
// variance, with the node's momentum (PyTorch's update, once per step).
// The expected values are computed here from the data alone.
TEST_F(Equivalence, RunningStatisticsTakeTheStepsBatches) {
  const int64_t batch = 8, channels = 2, spatial = 3;
  const float momentum = 0.75f;
  GraphBuilder b(15);
  b.input("x", onnx::TensorProto::FLOAT, {-1, channels, spatial}, {"batch"});
  for (const char *name : {"scale", "bias", "running_mean", "running_var"})
    b.weight(name, {channels});
  auto &bn = b.node("BatchNormalization", {"x", "scale", "bias", "running_mean", "running_var"},
                    {"y", "new_mean", "new_var"}, "bn");
  auto *a = bn.add_attribute();
  a->set_name("training_mode"), a->set_type(onnx::AttributeProto::INT), a->set_i(1);
  a = bn.add_attribute();
  a->set_name("momentum"), a->set_type(onnx::AttributeProto::FLOAT), a->set_f(momentum);
  b.node("Mul", {"y", "y"}, {"yy"}, "square");
  b.node("Mul", {"yy", "x"}, {"weighted"}, "weight");
  auto &sum = b.node("ReduceSum", {"weighted"}, {"loss"}, "loss");
  a = sum.add_attribute();
  a->set_name("keepdims"), a->set_type(onnx::AttributeProto::INT), a->set_i(0);
  b.output("loss");
  std::string path = dir->path("batchnorm-training.onnx");
  b.write(path);

  std::vector<float> x(batch * channels * spatial);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = float(std::sin(0.7 * double(i)) * (1 + i % 5));
  std::string data = dir->path("batchnorm-data");
  ASSERT_FALSE(llvm::sys::fs::create_directories(data));
  ASSERT_FALSE(static_cast<bool>(rt::writeNpy(
      cpu::Tensor::fromValues<float>({batch, channels, spatial}, x), data + "/x.npy")));

  for (const Config &config :
       {Config{"1f1b", 1, 1, 4, 1}, Config{"1f1b", 1, 1, 2, 2}, Config{"gpipe", 1, 1, 1, 1}}) {
    SCOPED_TRACE(formatv("M={0} dp={1}", config.microbatches, config.dp).str());
    plan::Plan p = compileFor(path, config, batch);
    rt::RunOptions options;
    options.steps = 1;
    options.optimizer = Optimizer::SGD;
    options.lr = 0.1;
    options.dataDir = data;
    options.collectWeights = true;
    auto result = rt::runLocal(p, options);
    ASSERT_TRUE(static_cast<bool>(result)) << llvm::toString(result.takeError());
    const int pieces = config.microbatches * config.dp;
    const int64_t per = batch / pieces, n = per * spatial;
    for (int64_t c = 0; c < channels; ++c) {
      double meanSum = 0, varSum = 0;
      for (int k = 0; k < pieces; ++k) {
        double s = 0, sq = 0;
        for (int64_t i = k * per; i < (k + 1) * per; ++i)
          for (int64_t j = 0; j < spatial; ++j)
            s += x[(i * channels + c) * spatial + j];
        double mean = s / double(n);
        for (int64_t i = k * per; i < (k + 1) * per; ++i)
          for (int64_t j = 0; j < spatial; ++j) {
            double d = x[(i * channels + c) * spatial + j] - mean;
            sq += d * d;
          }
        meanSum += mean;
        varSum += sq / double(n - 1);
      }
      double start = 0.5 + double(c); // GraphBuilder's weights hold 0.5, 1.5, ...
      double wantMean = momentum * start + (1 - momentum) * meanSum / pieces;
      double wantVar = momentum * start + (1 - momentum) * varSum / pieces;
      ASSERT_TRUE(result->weights.count("running_mean") && result->weights.count("running_var"));
      EXPECT_NEAR(result->weights.at("running_mean").getDouble(c), wantMean, 1e-5) << c;
      EXPECT_NEAR(result->weights.at("running_var").getDouble(c), wantVar, 1e-5) << c;
    }
    for (const auto &copy : result->weightCopies) // every replica holds the same buffers
      if (copy.name == "running_var")
        EXPECT_EQ(relativeError(copy.value, result->weights.at("running_var")), 0);
  }
}

/// Whether a CUDA device and the CUDA plugin are here.
bool haveGpu() {
  auto backend = rt::makeCudaBackend(0, false);
  if (!backend) {
    llvm::consumeError(backend.takeError());
    return false;
  }
  return true;
}

// The same pipelined step on the GPU (two ranks sharing device 0) and on the
// CPU: the pipeline and the backends agree.
TEST_F(Equivalence, CudaBackendMatchesCpu) {
  if (!haveGpu())
    GTEST_SKIP() << "no CUDA device or no CUDA backend";
  plan::Plan p = compileFor(gpt(true), Config{"1f1b", 2, 1, 4, 1}, 8);
  rt::RunResult cpuRun = runPlan(p);
  rt::RunOptions options = stepOptions();
  options.backend = "cuda";
  options.precision = "fp32";
  options.ranksPerDevice = 2;
  auto gpuRun = rt::runLocal(p, options);
  ASSERT_TRUE(static_cast<bool>(gpuRun)) << llvm::toString(gpuRun.takeError());
  // Different summation orders (cuBLAS, atomics): agreement to 1e-4.
  expectSameStep(*gpuRun, cpuRun, "cuda vs cpu", 1e-4);
}

//===----------------------------------------------------------------------===//
// Through the CLI: MPI processes, faults, bad input, checkpoints, outputs
//===----------------------------------------------------------------------===//

TEST_F(RunCli, MpiProcessesMatchThreadsAndOneRank) {
  if (!haveMpirun())
    GTEST_SKIP() << "mpirun is not installed";
  std::string model = gpt(true), out;
  std::string one = plan(model, "--stages 1 --microbatches 1 --batch 8", "one");
  std::string two = plan(model, "--stages 2 --microbatches 4 --batch 8 --schedule zb-h1", "two");
  std::string dp = plan(model, "--stages 2 --microbatches 2 --batch 8 --dp 2", "dp");
  std::string flags = " --steps 2 --optimizer sgd --lr 0.5 --quiet --save-weights ";
  ASSERT_EQ(runCommand(pipecBin() + " run " + one + flags + dir->path("one.onnx"), out), 0) << out;
  ASSERT_EQ(runCommand(pipecBin() + " run " + two + flags + dir->path("local.onnx"), out), 0)
      << out;
  ASSERT_EQ(runCommand(mpirun(2) + pipecBin() + " run " + two + " --comm mpi" + flags +
                           dir->path("mpi.onnx"),
                       out),
            0)
      << out;
  ASSERT_EQ(runCommand(mpirun(4) + pipecBin() + " run " + dp + " --comm mpi" + flags +
                           dir->path("dp.onnx"),
                       out),
            0)
      << out;
  // Threads and processes run the same arithmetic: the same bytes.
  std::string threads = readFile(dir->path("local.onnx"));
  ASSERT_FALSE(threads.empty());
  EXPECT_EQ(threads, readFile(dir->path("mpi.onnx")));
  auto reference = readWeights(dir->path("one.onnx"));
  ASSERT_GT(reference.size(), 10u);
  for (const char *name : {"mpi.onnx", "dp.onnx"}) {
    auto weights = readWeights(dir->path(name));
    ASSERT_EQ(weights.size(), reference.size()) << name;
    double worst = 0;
    for (const auto &[w, ref] : reference)
      worst = std::max(worst, relativeError(weights.at(w), ref));
    EXPECT_LT(worst, 1e-5) << name;
  }
}

TEST_F(RunCli, MpiRankKilledMidStepEndsTheJob) {
  if (!haveMpirun())
    GTEST_SKIP() << "mpirun is not installed";
  std::string two = plan(gpt(true), "--stages 2 --microbatches 4 --batch 8", "kill");
  std::string out;
  auto start = std::chrono::steady_clock::now();
  int rc = runCommand("timeout 60 " + mpirun(2, "PIPEC_FAULT=rank=1,step=1,at=5,kind=kill") +
                          pipecBin() + " run " + two + " --comm mpi --steps 3",
                      out);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 124) << "the job hung: " << out;
  EXPECT_LT(seconds, 30) << out;
  EXPECT_NE(out.find("rank 1"), std::string::npos) << out;
}

TEST_F(RunCli, FailingRankStopsTheOthers) {
  std::string two = plan(gpt(true), "--stages 4 --microbatches 4 --batch 8", "fail");
  std::string out;
  int rc = runCommand("PIPEC_FAULT=rank=2,step=0,at=3,kind=error timeout 60 " + pipecBin() +
                          " run " + two + " --steps 2",
                      out);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("error: rank 2: injected fault"), std::string::npos) << out;
  if (haveMpirun()) {
    rc = runCommand("timeout 60 " + mpirun(4, "PIPEC_FAULT=rank=2,step=0,at=3,kind=error") +
                        pipecBin() + " run " + two + " --comm mpi --steps 2",
                    out);
    EXPECT_NE(rc, 0) << out;
    EXPECT_NE(rc, 124) << out;
    EXPECT_NE(out.find("rank 2: injected fault"), std::string::npos) << out;
  }
}

TEST_F(RunCli, BadInputNamesTheFault) {
  std::string model = gpt(true), other = mlp(), out;
  std::string p = plan(model, "--stages 2 --microbatches 2 --batch 4", "bad");
  // A plan for another model.
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --model " + other, out), 1) << out;
  EXPECT_NE(out.find("xxh3"), std::string::npos) << out;
  EXPECT_NE(out.find(other), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  // A missing data file.
  std::string empty = dir->path("empty-data");
  llvm::sys::fs::create_directories(empty);
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --data " + empty, out), 1) << out;
  EXPECT_NE(out.find("input_ids"), std::string::npos) << out;
  EXPECT_NE(out.find(empty), std::string::npos) << out;
  // A data file of the wrong shape.
  std::string wrong = dir->path("wrong-data");
  llvm::sys::fs::create_directories(wrong);
  for (const char *name : {"input_ids", "labels"})
    ASSERT_FALSE(
        static_cast<bool>(rt::writeNpy(cpu::Tensor::fromValues<int64_t>({2, 3}, {1, 2, 3, 4, 5, 6}),
                                       wrong + "/" + name + ".npy")));
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --data " + wrong, out), 1) << out;
  EXPECT_NE(out.find("[2,3]"), std::string::npos) << out;
  // The wrong number of MPI processes.
  if (haveMpirun()) {
    EXPECT_NE(runCommand("timeout 60 " + mpirun(3) + pipecBin() + " run " + p + " --comm mpi", out),
              0);
    EXPECT_NE(out.find("mpirun -np 2"), std::string::npos) << out;
  }
  // Not a plan; a truncated plan.
  EXPECT_EQ(runCommand(pipecBin() + " run " + model, out), 1) << out;
  std::string bytes = readFile(p);
  std::string cut = dir->path("cut.plan");
  { std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2); }
  EXPECT_EQ(runCommand(pipecBin() + " run " + cut, out), 1) << out;
  // A hand-edited plan whose stage names a rank it does not have: every
  // reader refuses it by the stage and rank, none crashes.
  {
    auto edited = readPlan(p);
    ASSERT_TRUE(static_cast<bool>(edited)) << llvm::toString(edited.takeError());
    edited->mutable_stages(1)->set_rank(7);
    std::string wrong = dir->path("wrong-rank.plan");
    ASSERT_FALSE(static_cast<bool>(writePlan(*edited, wrong, PlanEncoding::Text)));
    for (const char *command : {" run ", " report ", " simulate "}) {
      EXPECT_EQ(runCommand(pipecBin() + command + wrong, out), 1) << command << out;
      EXPECT_NE(out.find("stage 1 is on rank 7, but the plan has 2 rank(s)"), std::string::npos)
          << command << out;
    }
  }
  // Flags.
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --comm carrier-pigeon", out), 2) << out;
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --steps 0", out), 2) << out;
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --resume", out), 2) << out;
  if (!haveGpu()) {
    EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --backend cuda", out), 1) << out;
    EXPECT_NE(out.find("cuda"), std::string::npos) << out;
  }
}

// The CUDA plugin, where the build made one, loads into this process and
// into pipec: it takes ONNX (and the one registration of onnx/onnx-ml.proto)
// from the executable. Without a device the backend says so, not the loader.
TEST_F(RunCli, CudaPluginLoads) {
  std::string plugin = std::string(PIPEC_BINARY_DIR) + "/lib/libpipec_cuda_backend.so";
  if (!llvm::sys::fs::exists(plugin))
    GTEST_SKIP() << "built without the CUDA backend";
  auto backend = rt::makeCudaBackend(0, false);
  bool device = static_cast<bool>(backend);
  if (!device) {
    std::string error = llvm::toString(backend.takeError());
    EXPECT_NE(error.find("no CUDA device"), std::string::npos) << error;
  }
  std::string p = plan(gpt(true), "--stages 1 --microbatches 1 --batch 2", "cuda"), out;
  int rc = runCommand(pipecBin() + " run " + p + " --backend cuda --steps 1", out);
  if (device) {
    EXPECT_EQ(rc, 0) << out;
  } else {
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("no CUDA device"), std::string::npos) << out;
  }
}

TEST_F(RunCli, ResumedRunIsBitIdentical) {
  std::string p = plan(gpt(true),
                       "--stages 2 --microbatches 2 --batch 4 --schedule zbv "
                       "--virtual-stages 2",
                       "resume");
  std::string ckpt = dir->path("ckpt"), out;
  std::string flags = " --optimizer adamw --quiet";
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 4" + flags + " --save-weights " +
                           dir->path("straight.onnx"),
                       out),
            0)
      << out;
  // float16 weights resume from their float32 masters.
  std::string half = plan(gptHalf(), "--stages 2 --microbatches 2 --batch 4", "resume-half");
  ASSERT_EQ(runCommand(pipecBin() + " run " + half + " --steps 3" + flags + " --save-weights " +
                           dir->path("half-straight.onnx"),
                       out),
            0)
      << out;
  ASSERT_EQ(
      runCommand(pipecBin() + " run " + half + " --steps 2 --checkpoint " + ckpt + "-half" + flags,
                 out),
      0)
      << out;
  ASSERT_EQ(runCommand(pipecBin() + " run " + half + " --steps 3 --resume --checkpoint " + ckpt +
                           "-half" + flags + " --save-weights " + dir->path("half-resumed.onnx"),
                       out),
            0)
      << out;
  std::string halfStraight = readFile(dir->path("half-straight.onnx"));
  ASSERT_FALSE(halfStraight.empty());
  EXPECT_TRUE(halfStraight == readFile(dir->path("half-resumed.onnx")));
  // Under autocast the bf16 copies of the weights (and the tied head's
  // Transpose) are load nodes, made once a step: a resumed run makes them
  // again from the restored weights.
  std::string cast = plan(gpt(true),
                          "--stages 2 --microbatches 2 --batch 4 --precision bf16 "
                          "--autocast",
                          "resume-autocast");
  auto castPlan = readPlan(cast);
  ASSERT_TRUE(!!castPlan) << toString(castPlan.takeError());
  EXPECT_GT(castPlan->stage_programs(1).load_nodes_size(), 0);
  for (const char *run :
       {" --steps 3 --save-weights autocast-straight.onnx", " --steps 2 --checkpoint autocast-ckpt",
        " --steps 3 --resume --checkpoint autocast-ckpt --save-weights "
        "autocast-resumed.onnx"})
    ASSERT_EQ(
        runCommand("cd " + dir->root() + " && " + pipecBin() + " run " + cast + run + flags, out),
        0)
        << out;
  std::string castStraight = readFile(dir->path("autocast-straight.onnx"));
  ASSERT_FALSE(castStraight.empty());
  EXPECT_TRUE(castStraight == readFile(dir->path("autocast-resumed.onnx")));
  // Killed during step 2 (after the checkpoint of step 2), then resumed.
  int rc = runCommand("PIPEC_FAULT=rank=1,step=2,at=4,kind=error " + pipecBin() + " run " + p +
                          " --steps 4 --checkpoint " + ckpt + flags,
                      out);
  ASSERT_EQ(rc, 1) << out;
  EXPECT_EQ(readFile(ckpt + "/latest"), "step-2\n");
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 4 --resume --checkpoint " + ckpt +
                           flags + " --save-weights " + dir->path("resumed.onnx"),
                       out),
            0)
      << out;
  std::string straight = readFile(dir->path("straight.onnx"));
  ASSERT_FALSE(straight.empty());
  EXPECT_TRUE(straight == readFile(dir->path("resumed.onnx")));
  // A checkpoint of another plan is refused by name.
  std::string q = plan(mlp(), "--stages 2 --microbatches 2 --batch 4", "resume-other");
  EXPECT_EQ(runCommand(pipecBin() + " run " + q + " --steps 4 --resume --checkpoint " + ckpt, out),
            1);
  EXPECT_NE(out.find("checkpoint"), std::string::npos) << out;
}

TEST_F(RunCli, InferenceWritesOutputsThatDoNotDependOnTheSplit) {
  std::string model = gpt(false), out;
  std::string one = plan(model, "--mode infer --stages 1 --microbatches 1 --batch 4", "inf1");
  std::string three = plan(model, "--mode infer --stages 3 --microbatches 2 --batch 4", "inf3");
  ASSERT_EQ(runCommand(pipecBin() + " run " + one + " --steps 2 --outputs " + dir->path("o1"), out),
            0)
      << out;
  ASSERT_EQ(
      runCommand(pipecBin() + " run " + three + " --steps 2 --outputs " + dir->path("o3"), out), 0)
      << out;
  auto a = rt::readNpy(dir->path("o1") + "/logits.npy");
  auto b = rt::readNpy(dir->path("o3") + "/logits.npy");
  ASSERT_TRUE(static_cast<bool>(a)) << llvm::toString(a.takeError());
  ASSERT_TRUE(static_cast<bool>(b)) << llvm::toString(b.takeError());
  EXPECT_EQ(a->shape(), (std::vector<int64_t>{8, 8, 64})); // 2 steps x 4 samples
  std::string why;
  EXPECT_TRUE(cpu::allClose(*b, *a, 1e-5, 1e-6, &why)) << why;
}

TEST_F(RunCli, BuffersAndFrozenWeightsStayPut) {
  std::string model = llama(), out;
  std::string p = plan(model, "--stages 2 --microbatches 2 --batch 4 --freeze 'norm'", "frozen");
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 2 --quiet --save-weights " +
                           dir->path("frozen.onnx"),
                       out),
            0)
      << out;
  auto before = readWeights(model), after = readWeights(dir->path("frozen.onnx"));
  int changed = 0, kept = 0;
  for (const auto &[name, w] : before) {
    bool same = relativeError(after.at(name), w) == 0;
    bool frozen = llvm::StringRef(name).contains("rotary_emb") || name == "causal_mask" ||
                  llvm::StringRef(name).contains("norm");
    EXPECT_EQ(same, frozen) << name;
    (same ? kept : changed) += 1;
  }
  EXPECT_GT(changed, 10);
  EXPECT_GE(kept, 4);
}

TEST_F(RunCli, MeasuredTraceBesideThePrediction) {
  std::string p = plan(gpt(true), "--stages 2 --microbatches 4 --batch 8", "traced"), out;
  std::string trace = dir->path("run-trace.json");
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 2 --quiet --trace " + trace, out), 0)
      << out;
  ASSERT_EQ(runCommand(pipecBin() + " report " + p + " --trace " + trace, out), 0) << out;
  EXPECT_NE(out.find("measured (last step of"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1: compute"), std::string::npos) << out;
  std::string html = dir->path("traced.html");
  ASSERT_EQ(
      runCommand(pipecBin() + " report " + p + " --trace " + trace + " --format html -o " + html,
                 out),
      0)
      << out;
  std::string page = readFile(html);
  EXPECT_NE(page.find("Measured timeline"), std::string::npos);
  // Both timelines: one SVG for the simulation, one for the measurement.
  size_t timelines = 0;
  for (size_t at = page.find("class=timeline"); at != std::string::npos;
       at = page.find("class=timeline", at + 1))
    ++timelines;
  EXPECT_EQ(timelines, 2u);
  // The last step's forwards are all there: 4 microbatches on each of 2 ranks.
  auto measured = readMeasuredTrace(trace, 2);
  ASSERT_TRUE(static_cast<bool>(measured)) << llvm::toString(measured.takeError());
  int forwards = 0;
  for (const TimelineEvent &e : measured->events)
    forwards += e.category == 'F';
  EXPECT_EQ(forwards, 8);
  EXPECT_GT(measured->stepTime, 0);
  EXPECT_EQ(runCommand(pipecBin() + " report " + p + " --trace " + p, out), 1) << out;
}

// run --profile: the last step's nodes by op class on every rank, which add
// up to the rank's node time inside the step, and the backend's counters,
// the same in two runs of the same plan.
TEST_F(RunCli, ProfileOfTheLastStep) {
  std::string p = plan(gpt(true), "--stages 2 --microbatches 4 --batch 8", "profiled"), out;
  auto profile = [&](const std::string &name) -> llvm::json::Value {
    std::string file = dir->path(name);
    EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --steps 2 --quiet --profile " + file, out), 0)
        << out;
    auto parsed = llvm::json::parse(readFile(file));
    EXPECT_TRUE(static_cast<bool>(parsed)) << (parsed ? "" : llvm::toString(parsed.takeError()));
    return parsed ? std::move(*parsed) : llvm::json::Value(nullptr);
  };
  llvm::json::Value first = profile("profile-1.json"), second = profile("profile-2.json");
  const llvm::json::Object *a = first.getAsObject(), *b = second.getAsObject();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->getString("backend").getValueOr(""), "cpu");
  EXPECT_EQ(a->getInteger("step").getValueOr(0), 2);
  const llvm::json::Array *ranks = a->getArray("ranks"), *again = b->getArray("ranks");
  ASSERT_TRUE(ranks && again);
  ASSERT_EQ(ranks->size(), 2u);
  for (size_t r = 0; r < ranks->size(); ++r) {
    const llvm::json::Object &rank = *(*ranks)[r].getAsObject();
    double step = *rank.getNumber("step_s"), nodes = *rank.getNumber("nodes_s");
    EXPECT_GT(nodes, 0);
    EXPECT_LE(nodes, step);
    double classes = 0, products = 0;
    int64_t nodeCount = 0;
    for (const llvm::json::Value &c : *rank.getArray("classes")) {
      const llvm::json::Object &o = *c.getAsObject();
      classes += *o.getNumber("seconds");
      nodeCount += *o.getInteger("nodes");
      llvm::StringRef op = o.getString("op").getValueOr("");
      if (op.startswith("MatMul") || op == "Gemm")
        products += *o.getNumber("gflops");
    }
    EXPECT_NEAR(classes, nodes, 1e-9 + 1e-9 * nodes);
    EXPECT_GT(products, 0);
    // Every node the backend ran is a launch; what it counts is the same
    // in a second run of the same plan.
    EXPECT_GE(*rank.getInteger("launches"), nodeCount / 2);
    const llvm::json::Object &other = *(*again)[r].getAsObject();
    for (const char *counter : {"launches", "host_syncs", "d2h_bytes", "allocations"})
      EXPECT_EQ(rank.getInteger(counter), other.getInteger(counter)) << counter;
  }
  // What makes the host wait, counted as a device would: on every rank the
  // tied embedding's gradient, summed over the two ranks that hold it
  // through the host (64 x 32 floats), and the one norm of the updated
  // state that checks it is finite (a double); on the last stage also the
  // microbatches' losses and label counts (a float each), read together
  // with one wait before the optimizer step.
  const int64_t tied = 64 * 32 * 4, norm = 8, microbatches = 4;
  const llvm::json::Object &front = *(*ranks)[0].getAsObject(), &last = *(*ranks)[1].getAsObject();
  EXPECT_EQ(front.getInteger("host_syncs").getValueOr(-1), 2);
  EXPECT_EQ(front.getInteger("d2h_bytes").getValueOr(-1), tied + norm);
  EXPECT_EQ(last.getInteger("host_syncs").getValueOr(-1), 3);
  EXPECT_EQ(last.getInteger("d2h_bytes").getValueOr(-1), microbatches * (4 + 4) + tied + norm);
  EXPECT_EQ(
      runCommand(pipecBin() + " run " + p + " --steps 1 --profile " + dir->path("profile-3.json"),
                 out),
      2)
      << out;
  EXPECT_NE(out.find("--profile: profiles the last step after the first warms up"),
            std::string::npos)
      << out;
}

// A one-rank training step waits for the device twice, however many
// microbatches it runs: once for all their losses and label counts, once
// for the finite check of the updated state.
TEST_F(RunCli, OneRankStepWaitsTwice) {
  std::string p = plan(gpt(true), "--stages 1 --microbatches 8 --batch 8", "one-rank"), out;
  std::string file = dir->path("one-rank.json");
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 2 --quiet --profile " + file, out), 0)
      << out;
  auto parsed = llvm::json::parse(readFile(file));
  ASSERT_TRUE(static_cast<bool>(parsed)) << llvm::toString(parsed.takeError());
  const llvm::json::Array *ranks = parsed->getAsObject()->getArray("ranks");
  ASSERT_TRUE(ranks && ranks->size() == 1);
  const llvm::json::Object &rank = *(*ranks)[0].getAsObject();
  EXPECT_EQ(rank.getInteger("host_syncs").getValueOr(-1), 2);
  EXPECT_EQ(rank.getInteger("d2h_bytes").getValueOr(-1), 8 * (4 + 4) + 8);
}

// The optimizer updates every weight in launches of 32 (multi-tensor), in
// place once the moments exist, and returns the squares of what it wrote
// for the finite check; a weight something else still holds is replaced,
// and the holder keeps the values it had.
TEST(CpuBackend, OptimizerUpdatesInPlace) {
  auto be = rt::makeCpuBackend();
  rt::OptimizerUpdate u;
  u.kind = rt::OptimizerUpdate::Kind::AdamW;
  u.lr = 1e-2;
  u.weightDecay = 0.1;
  const int weights = 40; // two launches
  std::vector<cpu::Tensor> w, g, m(weights), v(weights);
  for (int i = 0; i < weights; ++i) {
    w.emplace_back(cpu::DType::F32, std::vector<int64_t>{3, i + 1});
    g.emplace_back(cpu::DType::F32, std::vector<int64_t>{3, i + 1});
    for (int64_t e = 0; e < w[i].numElements(); ++e) {
      w[i].setDouble(e, 0.5 - 0.01 * (e + i));
      g[i].setDouble(e, 0.2 * std::sin(double(e + 7 * i)));
    }
  }
  std::vector<cpu::Tensor> reference;
  for (const cpu::Tensor &t : w)
    reference.push_back(t.clone());
  std::vector<cpu::Tensor> refM(weights), refV(weights);
  auto same = [](const cpu::Tensor &a, const cpu::Tensor &b) {
    if (a.numElements() != b.numElements())
      return false;
    for (int64_t e = 0; e < a.numElements(); ++e)
      if (a.getDouble(e) != b.getDouble(e))
        return false;
    return true;
  };
  auto slotsOf = [](std::vector<cpu::Tensor> &w, std::vector<cpu::Tensor> &g,
                    std::vector<cpu::Tensor> &m, std::vector<cpu::Tensor> &v) {
    std::vector<rt::OptimizerSlot> slots;
    for (size_t i = 0; i < w.size(); ++i)
      slots.push_back({&w[i], &g[i], &m[i], &v[i], i == 3 ? 1.0 : 0.0});
    return slots;
  };
  for (int step = 0; step < 3; ++step) {
    u.step = step;
    // The reference: one weight at a time.
    for (int i = 0; i < weights; ++i) {
      rt::OptimizerSlot one{&reference[i], &g[i], &refM[i], &refV[i], i == 3 ? 1.0 : 0.0};
      ASSERT_TRUE(static_cast<bool>(rt::makeCpuBackend()->optimize(u, {one})));
    }
    cpu::Tensor held = step == 2 ? w[5] : cpu::Tensor(); // a send in flight
    cpu::Tensor heldValues = step == 2 ? w[5].clone() : cpu::Tensor();
    std::vector<const void *> addresses;
    for (const cpu::Tensor &t : w)
      addresses.push_back(t.rawData());
    rt::BackendCounters before = be->counters();
    auto squares = be->optimize(u, slotsOf(w, g, m, v));
    ASSERT_TRUE(static_cast<bool>(squares)) << llvm::toString(squares.takeError());
    rt::BackendCounters after = be->counters();
    EXPECT_EQ(after.launches - before.launches, 2);
    // The first step makes both moments of each weight; later steps make
    // only the one number, and a new weight for the one held elsewhere.
    int64_t made = after.allocations - before.allocations;
    EXPECT_EQ(made, step == 0 ? 2 * weights + 1 : step == 2 ? 2 : 1) << "step " << step;
    double expected = 0;
    for (int i = 0; i < weights; ++i) {
      EXPECT_TRUE(same(w[i], reference[i])) << "weight " << i << " step " << step;
      EXPECT_TRUE(same(v[i], refV[i])) << "weight " << i << " step " << step;
      EXPECT_EQ(w[i].rawData() == addresses[i], !(step == 2 && i == 5)) << "weight " << i;
      for (const cpu::Tensor *t : {&w[i], &v[i]})
        for (int64_t e = 0; e < t->numElements(); ++e)
          expected += t->getDouble(e) * t->getDouble(e);
    }
    if (step == 2) {
      EXPECT_TRUE(same(held, heldValues)) << "the holder's weight was written";
    }
    EXPECT_NEAR(squares->getDouble(0), expected, 1e-12 * expected);
  }
  // A gradient of another size is refused, naming the weight.
  cpu::Tensor wrong(cpu::DType::F32, {2});
  rt::OptimizerSlot bad{&w[0], &wrong, &m[0], &v[0], 0.0, "h.0.attn.weight"};
  auto refused = be->optimize(u, {bad});
  ASSERT_FALSE(static_cast<bool>(refused));
  EXPECT_NE(llvm::toString(refused.takeError()).find("training 'h.0.attn.weight'"),
            std::string::npos);
}

// A profile's FLOPs: a product's 2 M N K from its shapes (Gemm's transA
// read), one per output element otherwise.
TEST(StepProfile, NodeFlops) {
  onnx::NodeProto matmul, gemm, add;
  matmul.set_op_type("MatMul");
  gemm.set_op_type("Gemm");
  onnx::AttributeProto *trans = gemm.add_attribute();
  trans->set_name("transA");
  trans->set_type(onnx::AttributeProto::INT);
  trans->set_i(1);
  add.set_op_type("Add");
  cpu::Tensor a(cpu::DType::F32, {2, 3, 4}), b(cpu::DType::F32, {4, 5});
  std::vector<cpu::Tensor> product;
  product.emplace_back(cpu::DType::F32, std::vector<int64_t>{2, 3, 5});
  EXPECT_EQ(rt::nodeFlops(matmul, {&a, &b}, product), 2.0 * 2 * 3 * 5 * 4);
  cpu::Tensor at(cpu::DType::F32, {7, 3}), bt(cpu::DType::F32, {7, 5});
  std::vector<cpu::Tensor> out;
  out.emplace_back(cpu::DType::F32, std::vector<int64_t>{3, 5});
  EXPECT_EQ(rt::nodeFlops(gemm, {&at, &bt}, out), 2.0 * 3 * 5 * 7);
  EXPECT_EQ(rt::nodeFlops(add, {&at, &at}, out), 15.0);
}

TEST_F(RunCli, ProfiledCostsFeedCompile) {
  std::string model = gpt(true), out, costs = dir->path("costs.json");
  ASSERT_EQ(runCommand(pipecBin() + " profile " + model + " --batch 2 --steps 2 -o " + costs, out),
            0)
      << out;
  auto parsed = llvm::json::parse(readFile(costs));
  ASSERT_TRUE(static_cast<bool>(parsed)) << llvm::toString(parsed.takeError());
  const llvm::json::Array *layers = parsed->getAsObject()->getArray("layers");
  ASSERT_NE(layers, nullptr);
  // One row per layer (embedding, 6 blocks, head and the loss), each timed.
  plan::Plan p = compileFor(model, Config{"1f1b", 2, 1, 2, 1}, 4);
  ASSERT_EQ(static_cast<int>(layers->size()), p.layers_size());
  int blocks = 0;
  for (const llvm::json::Value &v : *layers) {
    const llvm::json::Object *row = v.getAsObject();
    EXPECT_GE(row->getNumber("forward_s").getValueOr(-1), 0);
    if (row->getString("name").getValueOr("").contains("/h.")) {
      ++blocks;
      EXPECT_GT(row->getNumber("forward_s").getValueOr(0), 0);
      EXPECT_GT(row->getNumber("backward_input_s").getValueOr(0), 0);
      EXPECT_GT(row->getNumber("backward_weight_s").getValueOr(0), 0);
    }
  }
  EXPECT_EQ(blocks, 6);
  std::string planned =
      plan(model, "--stages 2 --batch 4 --microbatches 2 --costs " + costs, "profiled");
  auto read = readPlan(planned);
  ASSERT_TRUE(static_cast<bool>(read)) << llvm::toString(read.takeError());
  for (const plan::LayerInfo &layer : read->layers())
    EXPECT_TRUE(layer.measured()) << layer.name();
}

// Clipping by the global norm: one SGD step at lr 1 moves the weights by
// exactly the clip norm; the schedule's rates are the documented ones.
TEST_F(RunCli, ClippingAndScheduleNumbers) {
  std::string model = gpt(true), out;
  std::string p = plan(model, "--stages 2 --microbatches 2 --batch 4", "clipped");
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 1 --optimizer sgd --lr 1 " +
                           "--clip-grad-norm 0.05 --save-weights " + dir->path("clipped.onnx"),
                       out),
            0)
      << out;
  EXPECT_NE(out.find("grad-norm "), std::string::npos) << out;
  auto before = readWeights(model), after = readWeights(dir->path("clipped.onnx"));
  double moved = 0;
  for (const auto &[name, w] : before)
    for (int64_t i = 0; i < w.numElements(); ++i) {
      double d = after.at(name).getDouble(i) - w.getDouble(i);
      moved += d * d;
    }
  EXPECT_NEAR(std::sqrt(moved), 0.05, 0.05 * 1e-3);
  // Warm-up 1, then cosine over the 3 remaining steps of 4: 0.1, 0.1,
  // 0.1 * (1 + cos(pi / 3)) / 2, 0.1 * (1 + cos(2 pi / 3)) / 2.
  ASSERT_EQ(runCommand(pipecBin() + " run " + p + " --steps 4 --lr 0.1 --lr-schedule cosine " +
                           "--warmup 1",
                       out),
            0)
      << out;
  for (const char *rate : {"step 1/4  loss", "lr 1.00e-01", "lr 7.50e-02", "lr 2.50e-02"})
    EXPECT_NE(out.find(rate), std::string::npos) << rate << "\n" << out;
  EXPECT_EQ(runCommand(pipecBin() + " run " + p + " --lr-schedule sideways", out), 2) << out;
}

TEST_F(RunCli, SavedModelHoldsTheTrainedWeights) {
  plan::Plan p = compileFor(gpt(true), Config{"1f1b", 2, 1, 2, 1}, 4);
  rt::RunOptions options;
  options.steps = 2;
  options.optimizer = Optimizer::SGD;
  options.lr = 0.5;
  options.collectWeights = true;
  options.saveWeights = dir->path("saved.onnx");
  auto result = rt::runLocal(p, options);
  ASSERT_TRUE(static_cast<bool>(result)) << llvm::toString(result.takeError());
  auto saved = readWeights(options.saveWeights);
  for (const auto &[name, w] : result->weights) {
    ASSERT_TRUE(saved.count(name)) << name;
    EXPECT_EQ(relativeError(saved.at(name), w), 0) << name;
  }
  // The saved model is a model pipec reads.
  std::string out;
  EXPECT_EQ(runCommand(pipecBin() + " inspect " + options.saveWeights, out), 0) << out;
}

} // namespace
