//===- BenchCompile.cpp - Import, grouping and balancing speed ----------===//
//
// Measures, on generated models written once under build/bench-data:
//  - a 1,024-layer GPT (134k nodes): bare protobuf parse of the file, the
//    skeleton scan, pipec's import, and import + passes + group-layers;
//  - a GPT with ~1.5 GB of weights stored inline against the same model with
//    external data: pipec's import time must not grow with weight bytes,
//    while a bare protobuf parse copies them;
//  - balance-stages of the 1,026-layer chain onto 16 and 64 stages.
// Run through tools/bench.sh, which writes the table to docs/PERFORMANCE.md.
//
//===----------------------------------------------------------------------===//
#include "driver/Compile.h"
#include "driver/PassPipeline.h"
#include "models/ModelGenerators.h"
#include "passes/BalanceStages.h"
#include "passes/GroupLayers.h"
#include "passes/PredictStep.h"
#include "support/WireSkeleton.h"
#include "tools/bench/BenchData.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"

#include <benchmark/benchmark.h>
#include <google/protobuf/arena.h>
#include <google/protobuf/io/coded_stream.h>

#include <cstdlib>
#include <iostream>
#include <memory>

using namespace pipec;
using pipec::bench::ensureModel;

namespace {

models::GeneratorOptions deepGpt() {
  return models::GeneratorOptions(models::Family::Gpt, 1024, 64, 1000, 16, 4);
}

/// About 1.5 GB of fp32 weights: 24 blocks of hidden 1024 (12 h^2 each),
/// a 32000 x 1024 embedding and LM head.
models::GeneratorOptions heavyGpt() {
  return models::GeneratorOptions(models::Family::Gpt, 24, 1024, 32000, 16, 16);
}

void setBytes(benchmark::State &state, const std::string &path) {
  uint64_t size = 0;
  llvm::sys::fs::file_size(path, size);
  state.counters["file_MB"] = static_cast<double>(size) / 1e6;
}

/// protobuf's own parser on the whole file: the floor for any importer that
/// hands the bytes to protobuf, and it copies every weight.
void protobufParse(benchmark::State &state, const std::string &path) {
  setBytes(state, path);
  auto buffer = llvm::MemoryBuffer::getFile(path, false, false);
  for (auto _ : state) {
    google::protobuf::Arena arena;
    auto *model = google::protobuf::Arena::CreateMessage<onnx::ModelProto>(&arena);
    google::protobuf::io::CodedInputStream stream(
        reinterpret_cast<const uint8_t *>((*buffer)->getBufferStart()),
        static_cast<int>((*buffer)->getBufferSize()));
    stream.SetTotalBytesLimit(INT32_MAX);
    if (!model->ParseFromCodedStream(&stream))
      state.SkipWithError("parse failed");
    benchmark::DoNotOptimize(model);
  }
}

void skeleton(benchmark::State &state, const std::string &path) {
  setBytes(state, path);
  auto buffer = llvm::MemoryBuffer::getFile(path, false, false);
  for (auto _ : state) {
    auto out = makeSkeleton((*buffer)->getBuffer(), 64);
    if (!out)
      state.SkipWithError(llvm::toString(out.takeError()).c_str());
    else
      state.counters["skeleton_MB"] = static_cast<double>(out->size()) / 1e6;
  }
}

void importOnly(benchmark::State &state, const std::string &path) {
  setBytes(state, path);
  for (auto _ : state) {
    auto graph = importOnnx(path);
    if (!graph) {
      state.SkipWithError(llvm::toString(graph.takeError()).c_str());
      break;
    }
    state.counters["nodes"] = graph->model->graph().node_size();
  }
}

void importAndGroup(benchmark::State &state, const std::string &path) {
  setBytes(state, path);
  ImportOptions options;
  options.bindings.seq = 16;
  for (auto _ : state) {
    auto graph = loadGraph(path, options, PipelineOptions());
    if (!graph) {
      state.SkipWithError(llvm::toString(graph.takeError()).c_str());
      break;
    }
    auto layers = groupLayers(*graph);
    if (!layers) {
      state.SkipWithError(llvm::toString(layers.takeError()).c_str());
      break;
    }
    state.counters["layers"] = static_cast<double>(layers->layers.size());
  }
}

/// The 1,026-layer chain ready to balance: its layer graph, H100 costs and
/// the options for \p stages ranks, 4P microbatches, 1F1B.
struct BalanceSetup {
  Graph graph;
  std::unique_ptr<LayerGraph> layers;
  HardwareSpec hardware;
  CostTable table;
  BalanceOptions options;
};

/// The setup, or why there is none (the benchmark is skipped with it).
llvm::Expected<std::unique_ptr<BalanceSetup>> balanceSetup(const std::string &path, int stages,
                                                           BalanceMethod method) {
  ImportOptions import;
  import.bindings.seq = 16;
  auto graph = loadGraph(path, import, PipelineOptions());
  if (!graph)
    return graph.takeError();
  auto setup = std::make_unique<BalanceSetup>();
  setup->graph = std::move(*graph);
  auto layers = groupLayers(setup->graph);
  if (!layers)
    return layers.takeError();
  setup->layers = std::make_unique<LayerGraph>(std::move(*layers));
  auto hw = builtinHardware("h100");
  if (!hw)
    return hw.takeError();
  setup->hardware = *hw;
  setup->table = computeCosts(*setup->layers, setup->hardware, Precision::BF16);
  BalanceOptions &b = setup->options;
  auto shape = PipelineShape::make(ScheduleKind::OneFOneB, stages, 1, 4 * stages);
  if (!shape)
    return shape.takeError();
  b.shape = *shape;
  b.method = method;
  for (int r = 0; r < stages; ++r) {
    b.rankCosts.push_back(&setup->table);
    b.rankHardware.push_back(setup->hardware);
    b.memoryLimit.push_back(setup->hardware.memoryBytes);
  }
  return setup;
}

/// balance-stages alone: the layer graph and costs are built once.
void balance(benchmark::State &state, const std::string &path, int stages, BalanceMethod method) {
  auto setup = balanceSetup(path, stages, method);
  if (!setup) {
    state.SkipWithError(llvm::toString(setup.takeError()).c_str());
    return;
  }
  const LayerGraph &layers = *(*setup)->layers;
  for (auto _ : state) {
    auto plan = balanceStages(layers, (*setup)->options);
    if (!plan) {
      state.SkipWithError(llvm::toString(plan.takeError()).c_str());
      break;
    }
    state.counters["layers"] = static_cast<double>(layers.layers.size());
    state.counters["imbalance"] = plan->imbalance;
  }
}

/// One prediction of the step (lower-schedule's array form run by the
/// simulator's engine) with its memory peaks, as a search makes one per
/// candidate: the 1,026-layer chain split uniformly onto \p stages ranks.
void predictStep(benchmark::State &state, const std::string &path, int stages) {
  auto setup = balanceSetup(path, stages, BalanceMethod::Uniform);
  if (!setup) {
    state.SkipWithError(llvm::toString(setup.takeError()).c_str());
    return;
  }
  const BalanceOptions &b = (*setup)->options;
  auto plan = balanceStages(*(*setup)->layers, b);
  if (!plan) {
    state.SkipWithError(llvm::toString(plan.takeError()).c_str());
    return;
  }
  StepPredictor predict(b);
  for (auto _ : state) {
    auto step = predict.predict(*plan);
    if (!step) {
      state.SkipWithError(llvm::toString(step.takeError()).c_str());
      break;
    }
    benchmark::DoNotOptimize(step->step);
  }
}

/// The whole compile: import, passes, grouping, costs, three balancings,
/// schedule, lowering, verification and simulation of each.
void compileAll(benchmark::State &state, const std::string &path, int stages, int microbatches) {
  CompileOptions options;
  options.import.bindings.seq = 16;
  options.stages = stages;
  options.microbatches = microbatches;
  options.timingOnly = true; // the compile is measured, whether or not the model runs
  for (auto _ : state) {
    auto plan = compileModel(path, options, PipelineOptions());
    if (!plan) {
      state.SkipWithError(llvm::toString(plan.takeError()).c_str());
      break;
    }
    int64_t instructions = 0;
    for (const auto &program : plan->programs())
      instructions += program.instructions_size();
    state.counters["instructions"] = static_cast<double>(instructions);
  }
}

/// Registers \p fn with \p args as benchmark \p name, timed in milliseconds.
template <typename Fn, typename... Args> auto *registerMs(const char *name, Fn fn, Args... args) {
  return benchmark::RegisterBenchmark(name, fn, args...)->Unit(benchmark::kMillisecond);
}

void registerAll() {
  std::string deep = ensureModel("gpt-1024l.onnx", deepGpt(), false);
  registerMs("gpt1024/protobuf_parse", protobufParse, deep);
  registerMs("gpt1024/skeleton_scan", skeleton, deep);
  registerMs("gpt1024/pipec_import", importOnly, deep);
  registerMs("gpt1024/import_passes_group", importAndGroup, deep);
  registerMs("gpt1024/balance_time_16_stages", balance, deep, 16, BalanceMethod::Time);
  registerMs("gpt1024/balance_time_64_stages", balance, deep, 64, BalanceMethod::Time);
  registerMs("gpt1024/balance_params_64_stages", balance, deep, 64, BalanceMethod::Params);
  registerMs("gpt1024/predict_step_p64_m256", predictStep, deep, 64);
  registerMs("gpt1024/compile_p64_m256", compileAll, deep, 64, 256)->Iterations(1);
  if (std::getenv("PIPEC_BENCH_SKIP_HEAVY"))
    return;
  std::string inlined = ensureModel("gpt-1.5gb-inline.onnx", heavyGpt(), false);
  std::string external = ensureModel("gpt-1.5gb-external.onnx", heavyGpt(), true);
  registerMs("gpt1.5GB/protobuf_parse_inline", protobufParse, inlined);
  registerMs("gpt1.5GB/pipec_import_inline", importOnly, inlined);
  registerMs("gpt1.5GB/pipec_import_external", importOnly, external);
  registerMs("gpt1.5GB/import_passes_group_inline", importAndGroup, inlined);
  registerMs("gpt1.5GB/import_passes_group_external", importAndGroup, external);
}

} // namespace

int main(int argc, char **argv) {
  benchmark::Initialize(&argc, argv);
  registerAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
