//===- BenchRuntime.cpp - What the CPU executor achieves ------------------===//
//
// On generated models written once under build/bench-data:
//  - a 6-block GPT trained for one step on 1 rank and on 2 ranks (1F1B, the
//    same 8 microbatches): the pipeline speedup on 2 cores, and per rank the
//    measured compute time against the cost model's prediction;
//  - the same two runs predicted from `pipec profile`'s measured cost table
//    instead of the roofline;
//  - a tiny, deep MLP on 4 ranks with 64 microbatches, where kernels do
//    almost nothing: the executor's overhead per instruction;
//  - fused element-wise kernels: the one-rank GPT step with and without
//    fusion, alternating, and
//    GPT-2's eight-node GELU as one fused kernel against eight kernels;
//  - a decode step's few-row products by a weight: gemm's loops over the
//    weight as stored against the BLAS.
// Run through tools/bench-runtime.sh, which writes the table to
// docs/PERFORMANCE.md.
//
//===----------------------------------------------------------------------===//
#include "compiler/cost/HardwareSpec.h"
#include "driver/Compile.h"
#include "driver/Profile.h"
#include "models/ModelGenerators.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/cpu/FewRowGemm.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Executor.h"
#include "support/Blas.h"
#include "support/Parallel.h"
#include "tools/bench/BenchData.h"

#include "llvm/Support/FileSystem.h"

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>

using namespace pipec;
using pipec::bench::ensureModel;

namespace {

std::string gpt() {
  models::GeneratorOptions o(models::Family::Gpt, 6, 256, 2000, 64, 8);
  o.withLoss = true;
  return ensureModel("bench-gpt6.onnx", o);
}

std::string tinyMlp() {
  models::GeneratorOptions o(models::Family::Mlp, 16, 8, 8);
  o.withLoss = true;
  return ensureModel("bench-mlp16.onnx", o);
}

/// The GPT's cost table from `pipec profile` at microbatch size 1.
std::string profiledCosts() {
  static std::string path;
  if (!path.empty())
    return path;
  path = bench::dataDir() + "/bench-gpt6.costs.json";
  std::string text;
  llvm::raw_string_ostream os(text);
  ProfileOptions options;
  options.steps = 3;
  if (llvm::Error err = profileModel(gpt(), options, os)) {
    std::cerr << llvm::toString(std::move(err)) << "\n";
    std::exit(1);
  }
  std::error_code ec;
  llvm::raw_fd_ostream file(path, ec);
  file << os.str();
  return path;
}

plan::Plan compile(const std::string &model, int stages, int microbatches, int64_t batch,
                   const std::string &costs = "", bool fuse = true) {
  CompileOptions options;
  options.costs = costs;
  options.fuse = fuse;
  options.stages = stages;
  options.microbatches = microbatches;
  options.globalBatch = batch;
  options.hardware = "cpu";
  options.schedule = ScheduleKind::OneFOneB;
  auto plan = compileModel(model, options, PipelineOptions());
  if (!plan) {
    std::cerr << llvm::toString(plan.takeError()) << "\n";
    std::exit(1);
  }
  return *plan;
}

/// One training step per iteration (after a warm-up step); counters carry
/// the prediction and the measured compute time per rank.
void trainStep(benchmark::State &state, const std::string &model, int stages, int microbatches,
               int64_t batch, const std::string &costs = "", bool fuse = true,
               std::optional<int> threadsPerRank = std::nullopt) {
  // The `cpu` spec calibrated seconds before the steps it predicts: on a
  // shared machine the speed drifts over a run.
  llvm::sys::fs::remove(cpuCachePath(defaultThreadsPerRank(stages)));
  plan::Plan plan = compile(model, stages, microbatches, batch, costs, fuse);
  rt::RunOptions options;
  options.steps = 1;
  options.optimizer = Optimizer::SGD;
  options.threadsPerRank = threadsPerRank;
  auto warm = rt::runLocal(plan, options);
  if (!warm) {
    state.SkipWithError(llvm::toString(warm.takeError()).c_str());
    return;
  }
  std::vector<double> busy(stages, 0);
  int64_t instructions = 0, nodes = 0;
  double overhead = 0;
  for (auto _ : state) {
    auto result = rt::runLocal(plan, options);
    if (!result) {
      state.SkipWithError(llvm::toString(result.takeError()).c_str());
      return;
    }
    state.SetIterationTime(result->seconds);
    for (int r = 0; r < stages; ++r)
      busy[r] += result->busySeconds[r];
    instructions = result->instructions;
    nodes = result->nodes;
    overhead += (result->instructionSeconds - result->kernelSeconds) /
                std::max<int64_t>(1, result->instructions);
  }
  double n = static_cast<double>(state.iterations());
  state.counters["predicted_step_s"] = plan.predicted().step_time_s();
  state.counters["instructions"] = static_cast<double>(instructions);
  state.counters["nodes"] = static_cast<double>(nodes);
  state.counters["overhead_per_instruction_s"] = overhead / n;
  for (int r = 0; r < stages; ++r) {
    state.counters["rank" + std::to_string(r) + "_busy_s"] = busy[r] / n;
    state.counters["rank" + std::to_string(r) + "_predicted_busy_s"] = plan.ranks(r).busy_s();
  }
}

void benchGptOneRank(benchmark::State &state) { trainStep(state, gpt(), 1, 8, 8); }
void benchGptTwoRanks(benchmark::State &state) { trainStep(state, gpt(), 2, 8, 8); }
// The same with one BLAS thread per rank: the pipeline's own scaling, with
// no rank's GEMM spreading onto the core the other rank computes on.
void benchGptOneRankOneThread(benchmark::State &state) {
  trainStep(state, gpt(), 1, 8, 8, "", true, 1);
}
void benchGptTwoRanksOneThreadEach(benchmark::State &state) {
  trainStep(state, gpt(), 2, 8, 8, "", true, 1);
}
void benchMlpOverhead(benchmark::State &state) { trainStep(state, tinyMlp(), 4, 64, 64); }
void benchGptOneRankProfiled(benchmark::State &state) {
  trainStep(state, gpt(), 1, 8, 8, profiledCosts());
}
void benchGptTwoRanksProfiled(benchmark::State &state) {
  trainStep(state, gpt(), 2, 8, 8, profiledCosts());
}
/// One rank's step with and without fusion, alternating within each
/// iteration (and which goes first) so that both see the same machine,
/// after a warm-up run of each; the iteration time is the fused step's.
void benchGptFusedAgainstUnfused(benchmark::State &state) {
  plan::Plan fused = compile(gpt(), 1, 8, 8), unfused = compile(gpt(), 1, 8, 8, "", false);
  rt::RunOptions options;
  options.steps = 1;
  options.optimizer = Optimizer::SGD;
  rt::RunResult withFusion, without;
  auto run = [&](const plan::Plan &plan, rt::RunResult &into) {
    auto result = rt::runLocal(plan, options);
    if (!result) {
      state.SkipWithError(llvm::toString(result.takeError()).c_str());
      return false;
    }
    into = std::move(*result);
    return true;
  };
  if (!run(fused, withFusion) || !run(unfused, without))
    return;
  double fusedSeconds = 0, unfusedSeconds = 0;
  bool fusedFirst = false;
  for (auto _ : state) {
    fusedFirst = !fusedFirst;
    bool ok = fusedFirst ? run(fused, withFusion) && run(unfused, without)
                         : run(unfused, without) && run(fused, withFusion);
    if (!ok)
      return;
    state.SetIterationTime(withFusion.seconds);
    fusedSeconds += withFusion.seconds;
    unfusedSeconds += without.seconds;
  }
  double n = static_cast<double>(state.iterations());
  state.counters["fused_step_s"] = fusedSeconds / n;
  state.counters["unfused_step_s"] = unfusedSeconds / n;
  state.counters["fused_nodes"] = static_cast<double>(withFusion.nodes);
  state.counters["unfused_nodes"] = static_cast<double>(without.nodes);
}

/// GPT-2's GELU (tanh form, eight nodes) on x + bias, x of [rows, cols],
/// as the forward of a training step keeps it (the tanh and x / 2 too): one
/// fused node against its nodes one kernel each.
void benchGeluChain(benchmark::State &state) {
  auto step = [](const std::string &op, std::vector<std::string> in, const std::string &out) {
    onnx::NodeProto n;
    n.set_op_type(op);
    n.set_name(out);
    for (const std::string &name : in)
      n.add_input(name);
    n.add_output(out);
    return n;
  };
  std::vector<onnx::NodeProto> body = {
      step("Add", {"x", "bias"}, "h"),  step("Mul", {"half", "h"}, "a"),
      step("Pow", {"h", "three"}, "p"), step("Mul", {"c", "p"}, "b"),
      step("Add", {"h", "b"}, "s"),     step("Mul", {"root", "s"}, "u"),
      step("Tanh", {"u"}, "t"),         step("Add", {"one", "t"}, "e"),
      step("Mul", {"a", "e"}, "y")};
  std::vector<const onnx::NodeProto *> pointers;
  for (const onnx::NodeProto &n : body)
    pointers.push_back(&n);
  onnx::NodeProto fused = makeFusedNode(
      "gelu", pointers, {"x", "bias", "half", "three", "c", "root", "one"}, {"a", "t", "y"});
  const int64_t rows = 2048, cols = 1024;
  cpu::Tensor x(cpu::DType::F32, {rows, cols}), bias(cpu::DType::F32, {cols});
  for (int64_t i = 0; i < x.numElements(); ++i)
    x.data<float>()[i] = static_cast<float>((i * 7919) % 2001) / 1000.0f - 1.0f;
  for (int64_t i = 0; i < cols; ++i)
    bias.data<float>()[i] = static_cast<float>(i % 17) / 17.0f;
  cpu::Tensor half = cpu::Tensor::scalar(0.5f), three = cpu::Tensor::scalar(3.0f),
              c = cpu::Tensor::scalar(0.044715f), root = cpu::Tensor::scalar(0.7978845608f),
              one = cpu::Tensor::scalar(1.0f);
  std::vector<const cpu::Tensor *> in = {&x, &bias, &half, &three, &c, &root, &one};
  // Both forms alternate within an iteration, each going first in turn:
  // they see the same machine.
  double fusedSeconds = 0, unfusedSeconds = 0;
  using Clock = std::chrono::steady_clock;
  // Seconds of one call of \p body, or a negative number after an error.
  auto timed = [&](auto body) {
    auto start = Clock::now();
    auto out = body();
    double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (!out) {
      state.SkipWithError(llvm::toString(out.takeError()).c_str());
      return -1.0;
    }
    benchmark::DoNotOptimize(out->front().rawData());
    return seconds;
  };
  auto asOne = [&] { return cpu::runOp(fused, 17, in); };
  auto asEight = [&] {
    return runFusedBody(fused, in,
                        [](const onnx::NodeProto &n, llvm::ArrayRef<const cpu::Tensor *> args) {
                          return cpu::runOp(n, 17, args);
                        });
  };
  bool fusedFirst = false;
  for (auto _ : state) {
    fusedFirst = !fusedFirst;
    double f = -1, u = -1;
    if (fusedFirst) {
      f = timed(asOne);
      if (f >= 0)
        u = timed(asEight);
    } else {
      u = timed(asEight);
      if (u >= 0)
        f = timed(asOne);
    }
    if (f < 0 || u < 0)
      return;
    state.SetIterationTime(f);
    fusedSeconds += f;
    unfusedSeconds += u;
  }
  double n = static_cast<double>(state.iterations());
  state.counters["fused_s"] = fusedSeconds / n;
  state.counters["unfused_s"] = unfusedSeconds / n;
  state.counters["elements"] = static_cast<double>(rows * cols);
}

/// The executor's cost per node: `pipec model mlp --layers 2000 --hidden 8`
/// (4,002 nodes of 8-wide Gemm and Relu), inference on one rank, one
/// microbatch of one sample, one thread, unfused, 300 steps per iteration
/// as tools/bench-dispatch.sh runs them (it alternates two builds on the same
/// job): the first step's preparing is a small part of the mean. Its kernels
/// are tiny, so the time is mostly dispatch: the counter ns_per_node.
void benchNodeDispatch(benchmark::State &state) {
  models::GeneratorOptions o(models::Family::Mlp, 2000, 8, 1000);
  std::string model = ensureModel("bench-mlp2000x8.onnx", o);
  CompileOptions options;
  options.stages = 1;
  options.microbatches = 1;
  options.globalBatch = 1;
  options.training = false;
  options.hardware = "cpu";
  options.fuse = false;
  auto plan = compileModel(model, options, PipelineOptions());
  if (!plan) {
    state.SkipWithError(llvm::toString(plan.takeError()).c_str());
    return;
  }
  rt::RunOptions run;
  run.steps = 300;
  run.threadsPerRank = 1;
  run.keepOutputs = false;
  double nodes = 0, seconds = 0;
  for (auto _ : state) {
    auto result = rt::runLocal(*plan, run);
    if (!result) {
      state.SkipWithError(llvm::toString(result.takeError()).c_str());
      return;
    }
    state.SetIterationTime(result->seconds / run.steps);
    nodes = static_cast<double>(result->nodes) / run.steps;
    seconds += result->seconds / run.steps;
  }
  state.counters["nodes"] = nodes;
  state.counters["ns_per_node"] = seconds / static_cast<double>(state.iterations()) / nodes * 1e9;
}

/// A decode step's product: \p m rows by a weight of \p n by \p k, read
/// transposed (\p transposed: a Linear as torch stores it, n rows of k) or
/// not (k rows of n, the exporter's folded transpose or GPT-2's Conv1D),
/// through the few-row loops of one target (runtime/cpu/FewRowGemm.h: 0 the
/// widest this CPU runs, 1 the next) against the BLAS on the same operands,
/// alternating, one thread each. The weights cycle through 256 MiB of
/// copies, so each product streams its weight from memory as a decode step
/// does.
void benchDecodeGemm(benchmark::State &state) {
  const bool transposed = state.range(0) != 0;
  const int64_t m = state.range(1), n = state.range(2), k = state.range(3);
  const size_t target = static_cast<size_t>(state.range(4));
  const std::vector<const cpu::FewRowKernels *> &here = cpu::fewRowKernelsHere();
  if (target >= here.size()) {
    state.SkipWithError("this CPU runs no such target's few-row loops (FewRowGemm.h)");
    return;
  }
  const cpu::FewRowKernels &kernels = *here[target];
  state.SetLabel(kernels.target);
  int64_t copies = std::max<int64_t>(2, (int64_t(256) << 20) / (n * k * 4));
  std::vector<float> a(m * k), w(copies * n * k), c(m * n);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = static_cast<float>((i * 7919) % 2001) / 1000.0f - 1.0f;
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<float>((i * 104729) % 2003) / 1000.0f - 1.0f;
  using Clock = std::chrono::steady_clock;
  int64_t next = 0, ldw = transposed ? k : n;
  auto timed = [&](bool few) {
    const float *weight = w.data() + (next++ % copies) * n * k;
    auto start = Clock::now();
    if (few && transposed)
      kernels.transposed(m, n, k, 1.0f, a.data(), k, weight, ldw, 0.0f, c.data(), n);
    else if (few)
      cpu::fewRowsPlain(kernels, m, n, k, 1.0f, a.data(), k, weight, ldw, 0.0f, c.data(), n);
    else
      blas::sgemm(false, transposed, int(m), int(n), int(k), 1.0f, a.data(), int(k), weight,
                  int(ldw), 0.0f, c.data(), int(n));
    benchmark::DoNotOptimize(c.data());
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  cpu::setBlasThreads(1);
  double fewSeconds = 0, blasSeconds = 0;
  bool fewFirst = false;
  for (auto _ : state) {
    fewFirst = !fewFirst;
    double f = 0, b = 0;
    if (fewFirst) {
      f = timed(true);
      b = timed(false);
    } else {
      b = timed(false);
      f = timed(true);
    }
    state.SetIterationTime(f);
    fewSeconds += f;
    blasSeconds += b;
  }
  double iterations = static_cast<double>(state.iterations());
  double flops = 2.0 * double(m) * double(n) * double(k);
  state.counters["few_row_gflops"] = flops * iterations / fewSeconds * 1e-9;
  state.counters["blas_gflops"] = flops * iterations / blasSeconds * 1e-9;
}

/// Every benchmark here times its iterations itself (SetIterationTime).
void manualMilliseconds(benchmark::internal::Benchmark *b) {
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(benchGptOneRank)->Name("gpt6/1_rank_m8")->Apply(manualMilliseconds);
BENCHMARK(benchGptTwoRanks)->Name("gpt6/2_ranks_1f1b_m8")->Apply(manualMilliseconds);
BENCHMARK(benchGptOneRankOneThread)->Name("gpt6/1_rank_m8_1_thread")->Apply(manualMilliseconds);
BENCHMARK(benchGptTwoRanksOneThreadEach)
    ->Name("gpt6/2_ranks_1f1b_m8_1_thread_each")
    ->Apply(manualMilliseconds);
BENCHMARK(benchGptOneRankProfiled)
    ->Name("gpt6/1_rank_m8_profiled_costs")
    ->Apply(manualMilliseconds);
BENCHMARK(benchGptTwoRanksProfiled)
    ->Name("gpt6/2_ranks_1f1b_m8_profiled_costs")
    ->Apply(manualMilliseconds);
BENCHMARK(benchGptFusedAgainstUnfused)
    ->Name("gpt6/1_rank_m8_fused_vs_unfused")
    ->Apply(manualMilliseconds);
BENCHMARK(benchGeluChain)->Name("gelu_2048x1024/fused_vs_unfused")->Apply(manualMilliseconds);
BENCHMARK(benchMlpOverhead)->Name("mlp16_tiny/4_ranks_1f1b_m64")->Apply(manualMilliseconds);
// Five runs of 300 steps: the benchmark library would otherwise size the
// iterations by the per-step time it is given, not by what a run takes.
BENCHMARK(benchNodeDispatch)
    ->Name("mlp2000x8/dispatch_1_rank_1_thread")
    ->Apply(manualMilliseconds)
    ->Iterations(5);
// Read transposed: rows 1, 8 and 16 by GPT-2's head (50257 x 768), 16 by a
// Llama's feed-forward (2816 x 1024) and its down projection (1024 x 2816).
// As stored: 1, 2 and 4 rows by GPT-2's first feed-forward (768 rows of
// 3072) and a Llama's (1024 rows of 2816). Each on the widest target here
// and the next (AVX-512 and AVX2 where both run).
BENCHMARK(benchDecodeGemm)
    ->Name("decode_gemm")
    ->ArgsProduct({{1}, {1, 8, 16}, {50257}, {768}, {0, 1}})
    ->ArgsProduct({{1}, {16}, {2816}, {1024}, {0, 1}})
    ->ArgsProduct({{1}, {16}, {1024}, {2816}, {0, 1}})
    ->ArgsProduct({{0}, {1, 2, 4}, {3072}, {768}, {0, 1}})
    ->ArgsProduct({{0}, {1, 2, 4}, {2816}, {1024}, {0, 1}})
    ->ArgNames({"transposed", "m", "n", "k", "target"})
    ->Apply(manualMilliseconds);

} // namespace

BENCHMARK_MAIN();
