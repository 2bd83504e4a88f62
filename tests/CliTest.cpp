//===- CliTest.cpp - The pipec command line -----------------------------===//
#include "TestUtil.h"
#include "runtime/exec/Data.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <cstdio>

using namespace pipec::test;

namespace {

TEST(Cli, ModelThenInspectJson) {
  TempDir dir;
  std::string out;
  std::string model = dir.path("gpt.onnx");
  ASSERT_EQ(
      runCommand(pipecBinary + " model gpt --layers 3 --hidden 32 --vocab 100 --seq 8 -o " + model,
                 out),
      0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " inspect " + model + " --seq 8 --batch 2 --format json", out),
            0)
      << out;
  auto json = llvm::json::parse(out);
  ASSERT_TRUE(!!json) << llvm::toString(json.takeError()) << out;
  const auto *root = json->getAsObject();
  ASSERT_NE(root, nullptr);
  EXPECT_EQ(root->getInteger("format_version").getValueOr(-1), 1);
  const auto *m = root->getObject("model");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->getString("path").getValueOr("").str(), model);
  EXPECT_EQ(m->getString("xxh3")->size(), 32u);
  EXPECT_GT(*m->getInteger("nodes"), 0);
  const auto *layers = root->getArray("layers");
  ASSERT_NE(layers, nullptr);
  ASSERT_EQ(layers->size(), 5u);
  const char *fields[] = {
      "index", "name", "kind", "ops", "params", "flops_fwd", "activation_bytes", "boundary_bytes"};
  for (const auto &layer : *layers)
    for (const char *field : fields)
      EXPECT_TRUE(layer.getAsObject()->get(field)) << field;
  EXPECT_EQ((*layers)[0].getAsObject()->getString("kind").getValueOr(""), "embedding");
  EXPECT_EQ((*layers)[1].getAsObject()->getString("kind").getValueOr(""), "block");
  EXPECT_EQ((*layers)[4].getAsObject()->getString("kind").getValueOr(""), "head");
  // Hidden state of batch 2, seq 8, width 32 in float.
  EXPECT_EQ((*layers)[1].getAsObject()->getInteger("boundary_bytes").getValueOr(-1),
            2 * 8 * 32 * 4);
  int64_t sum = 0;
  for (const auto &layer : *layers)
    sum += *layer.getAsObject()->getInteger("params");
  EXPECT_EQ(sum, *m->getInteger("params"));
}

TEST(Cli, InspectTextShowsTheTable) {
  TempDir dir;
  std::string out;
  std::string model = dir.path("resnet.onnx");
  ASSERT_EQ(runCommand(pipecBinary + " model resnet --layers 4 --hidden 8 --seq 32 --vocab 10 -o " +
                           model,
                       out),
            0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " inspect " + model, out), 0) << out;
  EXPECT_NE(out.find("boundary bytes"), std::string::npos) << out;
  EXPECT_NE(out.find("/layer1/layer1.0"), std::string::npos) << out;
  EXPECT_NE(out.find("grouped by module-path"), std::string::npos) << out;
}

TEST(Cli, ErrorsAreOneLineWithExitCodes) {
  TempDir dir;
  std::string out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect " + dir.path("missing.onnx"), out), 1);
  EXPECT_NE(out.find("missing.onnx: cannot open"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;

  EXPECT_EQ(runCommand(pipecBinary + " inspect x.onnx --no-such-flag", out), 2) << out;
  EXPECT_EQ(runCommand(pipecBinary + " frobnicate", out), 2) << out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect x.onnx --format yaml", out), 2) << out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect x.onnx --input-shape ids", out), 2) << out;
  EXPECT_NE(out.find("--input-shape ids: expected NAME=D0,D1,.."), std::string::npos) << out;
  EXPECT_EQ(runCommand(pipecBinary + " model transformerxl -o " + dir.path("m.onnx"), out), 2)
      << out;
  EXPECT_NE(out.find("transformerxl"), std::string::npos) << out;
}

TEST(Cli, PrintAfterAndStats) {
  TempDir dir;
  std::string out;
  std::string model = dir.path("mlp.onnx");
  ASSERT_EQ(
      runCommand(pipecBinary + " model mlp --layers 2 --hidden 16 --vocab 8 -o " + model, out), 0);
  ASSERT_EQ(runCommand(pipecBinary + " inspect " + model +
                           " --print-after=fold-constants,group-layers --stats --dump-dir " +
                           dir.path("dump"),
                       out),
            0)
      << out;
  EXPECT_NE(out.find("IR after fold-constants"), std::string::npos);
  EXPECT_NE(out.find("IR after group-layers"), std::string::npos);
  EXPECT_NE(out.find("stats: infer-shapes"), std::string::npos);
  EXPECT_TRUE(fileExists(dir.path("dump/06-group-layers.txt")));
  EXPECT_FALSE(fileExists(dir.path("dump/07-tie-weights.txt")));
  // A pass that inspect does not run is named as such, not silently ignored.
  EXPECT_EQ(runCommand(pipecBinary + " inspect " + model + " --print-after=differentiate", out), 2);
  EXPECT_NE(
      out.find(
          "--print-after differentiate: this command runs import, infer-shapes, "
          "fold-constants, eliminate-dead, shard-tensors, fuse-attention, group-layers (or all); "
          "differentiate runs under compile"),
      std::string::npos)
      << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect " + model + " --print-after=frobnicate", out), 2);
  EXPECT_NE(out.find("--print-after frobnicate: expected all or a pass: import, "),
            std::string::npos)
      << out;
}

} // namespace

namespace {

TEST(Cli, HelpListsCommands) {
  std::string out;
  EXPECT_EQ(runCommand(pipecBinary + " --help", out), 0);
  EXPECT_NE(out.find("inspect"), std::string::npos) << out;
  EXPECT_NE(out.find("model"), std::string::npos) << out;
  EXPECT_NE(out.find("Exit codes"), std::string::npos) << out;
  // pipec's options only: none of the linked LLVM's code-generation ones.
  EXPECT_NE(out.find("--version"), std::string::npos) << out;
  for (const char *llvmOption : {"--x86-asm-syntax", "--aarch64-neon-syntax", "--amdgpu"})
    EXPECT_EQ(out.find(llvmOption), std::string::npos) << llvmOption << "\n" << out;
  EXPECT_LT(std::count(out.begin(), out.end(), '\n'), 60) << out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect --help", out), 0);
  EXPECT_NE(out.find("--input-shape"), std::string::npos) << out;
}

/// The guide's table of schedules is the one `pipec schedules` prints from
/// Schedules.def; each schedule compiles at its own V without the flag.
TEST(Cli, SchedulesTableAndDefaultV) {
  std::string table, out;
  ASSERT_EQ(runCommand(pipecBinary + " schedules", table), 0) << table;
  std::string guide = readFile(std::string(PIPEC_SOURCE_DIR) + "/docs/USER_GUIDE.md");
  EXPECT_NE(guide.find(table), std::string::npos)
      << "docs/USER_GUIDE.md's table of schedules is not `pipec schedules`' output:\n"
      << table;
  TempDir dir;
  std::string model = dir.path("g.onnx"), plan = dir.path("g.plan");
  ASSERT_EQ(runCommand(pipecBinary +
                           " model gpt --layers 4 --hidden 16 --vocab 32 --seq 8 --loss -o " +
                           model,
                       out),
            0)
      << out;
  for (const char *schedule : {"zbv", "dualpipev", "interleaved"}) {
    ASSERT_EQ(runCommand(pipecBinary + " compile " + model + " -o " + plan +
                             " --stages 2 --microbatches 4 --hardware cpu --schedule " + schedule,
                         out),
              0)
        << schedule << out;
    ASSERT_EQ(runCommand(pipecBinary + " report " + plan + " --format json", out), 0) << out;
    EXPECT_NE(out.find("\"virtual_stages\": 2"), std::string::npos) << schedule << out;
  }
  EXPECT_EQ(
      runCommand(pipecBinary + " compile " + model + " -o " + plan + " --virtual-stages 0", out), 2)
      << out;
  EXPECT_NE(out.find("--virtual-stages 0: must be at least 1"), std::string::npos) << out;
  EXPECT_EQ(
      runCommand(pipecBinary + " compile " + model + " -o " + plan + " --schedule forward", out), 2)
      << out;
  EXPECT_NE(out.find("--schedule forward: has no backward, so it cannot train"), std::string::npos)
      << out;
}

/// --parallel auto through the command line: the plan it writes, the report's
/// search, and the flags it refuses.
TEST(Cli, ParallelAutoChoosesAndReports) {
  TempDir dir;
  std::string out;
  std::string model = dir.path("l.onnx"), plan = dir.path("l.plan");
  ASSERT_EQ(runCommand(pipecBinary +
                           " model llama --layers 4 --hidden 64 --heads 4 --kv-heads 2 --vocab 64 "
                           "--seq 16 --loss -o " +
                           model,
                       out),
            0)
      << out;
  std::string compile = pipecBinary + " compile " + model + " -o " + plan;
  ASSERT_EQ(runCommand(compile + " --parallel auto --gpus 4 --batch 8 --tp 2", out), 0) << out;
  ASSERT_EQ(runCommand(pipecBinary + " report " + plan, out), 0) << out;
  EXPECT_NE(out.find("parallel search (--parallel auto)\n  chose T=2 P="), std::string::npos)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " report " + plan + " --format json", out), 0) << out;
  EXPECT_NE(out.find("\"tensor_parallel\": 2"), std::string::npos) << out;
  EXPECT_NE(out.find("\"parallel_search\": ["), std::string::npos) << out;
  EXPECT_EQ(runCommand(compile + " --parallel auto --batch 8", out), 2) << out;
  EXPECT_NE(out.find("--parallel auto: give --gpus N"), std::string::npos) << out;
  EXPECT_EQ(runCommand(compile + " --gpus 4", out), 2) << out;
  EXPECT_NE(out.find("only --parallel auto plans for a cluster"), std::string::npos) << out;
  EXPECT_EQ(runCommand(compile + " --parallel manual --gpus 4", out), 2) << out;
  EXPECT_NE(out.find("--parallel manual: expected auto"), std::string::npos) << out;
  EXPECT_EQ(runCommand(compile + " --parallel auto --gpus 4 --batch 8 --hardware h100,a100", out),
            2)
      << out;
  EXPECT_NE(out.find("give one --hardware"), std::string::npos) << out;
}

/// The bundled models are generated; regenerating gives the same bytes.
TEST(Cli, BundledModelsAreReproducible) {
  TempDir dir;
  std::string out;
  std::string made = dir.path("gpt-4l.onnx");
  ASSERT_EQ(runCommand(pipecBinary +
                           " model gpt --layers 4 --hidden 64 --heads 4 --vocab 512 --seq 32 "
                           "-o " +
                           made,
                       out),
            0)
      << out;
  std::string bundled = std::string(PIPEC_SOURCE_DIR) + "/models/bundled/gpt-4l.onnx";
  EXPECT_TRUE(readFile(made) == readFile(bundled)) << "models/bundled/make.sh is out of date";
  ASSERT_EQ(runCommand(pipecBinary + " inspect " + bundled + " --format json", out), 0) << out;
  auto json = llvm::json::parse(out);
  ASSERT_TRUE(!!json);
  EXPECT_EQ(json->getAsObject()->getArray("layers")->size(), 6u);
}

} // namespace

// --recompute takes none, all or auto, as "--recompute auto" or
// "--recompute=auto"; alone it means all. The report and --stats say which
// layers of each stage recompute; a shard of nothing is refused.
TEST(Cli, RecomputeModesAndShardOptimizer) {
  TempDir dir;
  std::string model = dir.path("g.onnx"), plan = dir.path("g.plan"), out;
  ASSERT_EQ(runCommand(pipecBinary +
                           " model gpt --layers 4 --hidden 64 --heads 4 --vocab 128 --seq 16 "
                           "--loss -o " +
                           model,
                       out),
            0)
      << out;
  std::string compile = pipecBinary + " compile " + model + " -o " + plan +
                        " --stages 2 --microbatches 4 --batch 8 --hardware cpu";
  ASSERT_EQ(runCommand(compile + " --recompute --stats", out), 0) << out;
  EXPECT_NE(out.find("recomputed layers 3/3 4/4"), std::string::npos) << out;
  ASSERT_EQ(runCommand(compile + " --recompute auto --memory-limit 2.55MiB", out), 0) << out;
  ASSERT_EQ(runCommand(pipecBinary + " report " + plan, out), 0) << out;
  EXPECT_NE(out.find("recompute (auto): activations rebuilt in the backward"), std::string::npos)
      << out;
  EXPECT_NE(out.find("stage 0 (rank 0): its first 2 of 3 layers recompute"), std::string::npos)
      << out;
  EXPECT_NE(out.find("stage 1 (rank 1): keeps every layer's activations"), std::string::npos)
      << out;
  EXPECT_EQ(runCommand(compile + " --recompute=sometimes", out), 2) << out;
  EXPECT_NE(out.find("--recompute sometimes: expected none, all or auto"), std::string::npos)
      << out;
  EXPECT_EQ(runCommand(compile + " --mode infer --shard-optimizer", out), 2) << out;
  EXPECT_NE(out.find("--shard-optimizer: an inference plan has no optimizer state"),
            std::string::npos)
      << out;
}

// A model with external data, named relative to the current directory as a
// user in its folder types it: the plan's references match the model's, and
// the plan runs.
TEST(Cli, ExternalDataModelNamedFromItsFolder) {
  TempDir dir;
  std::string out;
  std::string cd = "cd " + dir.path("") + " && ";
  ASSERT_EQ(runCommand(cd + pipecBinary +
                           " model gpt --layers 2 --hidden 32 --vocab 64 --seq 8 --external-data "
                           "-o g.onnx",
                       out),
            0)
      << out;
  ASSERT_EQ(runCommand(cd + pipecBinary +
                           " compile g.onnx -o g.plan --stages 2 --mode infer --batch 2 "
                           "--microbatches 2",
                       out),
            0)
      << out;
  ASSERT_EQ(runCommand(cd + pipecBinary + " run g.plan --outputs outs", out), 0) << out;
  EXPECT_NE(out.find("wrote 1 output(s) to outs"), std::string::npos) << out;
}

// The BLAS: measured once per CPU and cached, chosen by hand with
// PIPEC_BLAS, and both libraries give a model the same numbers.
TEST(Cli, BlasIsMeasuredOnceAndCanBeChosenByHand) {
  TempDir dir;
  // The environment this test runs in may choose already.
  std::string cache = "env -u PIPEC_BLAS PIPEC_CACHE_DIR=" + dir.path("cache") + " ";
  std::string out;
  ASSERT_EQ(runCommand(cache + "PIPEC_BLAS=openblas " + pipecBinary + " --version", out), 0) << out;
  EXPECT_NE(out.find("blas      OpenBLAS 0.3.34"), std::string::npos) << out;
  EXPECT_NE(out.find("kernels; PIPEC_BLAS=openblas)\n"), std::string::npos) << out;
  // The few-row loops are measured whatever the BLAS (FewRowGemm.h); the
  // BLAS was not.
  EXPECT_NE(out.find("few-row   A B^T: "), std::string::npos) << out;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir.path("cache"), ec), end; it != end && !ec;
       it.increment(ec))
    EXPECT_FALSE(llvm::sys::path::filename(it->path()).startswith("blas-"))
        << "measured though told";

  EXPECT_EQ(runCommand(cache + "PIPEC_BLAS=atlas " + pipecBinary + " inspect m.onnx", out), 2)
      << out;
  EXPECT_EQ(out, "pipec: error: PIPEC_BLAS=atlas: expected openblas, mkl or auto\n");
  EXPECT_EQ(runCommand(cache + "PIPEC_BLAS=mkl PIPEC_MKL_LIBRARY=" + dir.path("none.so") + " " +
                           pipecBinary + " inspect m.onnx",
                       out),
            2)
      << out;
  EXPECT_NE(out.find("PIPEC_BLAS=mkl: no MKL found"), std::string::npos) << out;

  // The first run measured both and kept the numbers; the faster by 5% won.
  // A measurement another process disturbed (the test suite beside it) is
  // kept marked "disturbed 1" for a while: a few tries, each from no file,
  // for a quiet one.
  std::string measured;
  for (int attempt = 0; attempt < 5 && measured.empty(); ++attempt) {
    ASSERT_EQ(runCommand(cache + pipecBinary + " --version", out), 0) << out;
    if (out.find("; no MKL installed") != std::string::npos)
      GTEST_SKIP() << "no MKL here (tools/fetch-mkl.sh): OpenBLAS without measuring";
    for (llvm::sys::fs::directory_iterator it(dir.path("cache"), ec), end; it != end && !ec;
         it.increment(ec))
      if (llvm::sys::path::filename(it->path()).startswith("blas-"))
        measured = it->path();
    if (!measured.empty() && readFile(measured).find("disturbed 1") != std::string::npos) {
      llvm::sys::fs::remove(measured);
      measured.clear();
    }
  }
  if (measured.empty())
    GTEST_SKIP() << "every BLAS measurement was disturbed by another process";
  auto text = llvm::MemoryBuffer::getFile(measured);
  ASSERT_TRUE(!!text);
  double openblas = 0, mkl = 0;
  ASSERT_EQ(
      std::sscanf((*text)->getBuffer().str().c_str(), "openblas %lf\nmkl %lf", &openblas, &mkl), 2)
      << (*text)->getBuffer().str();
  EXPECT_GT(openblas, 1.0);
  EXPECT_GT(mkl, 1.0);
  bool mklWins = mkl > 1.05 * openblas;
  EXPECT_NE(out.find(mklWins ? "blas      MKL 2026" : "blas      OpenBLAS 0.3.34"),
            std::string::npos)
      << out << openblas << " " << mkl;
  EXPECT_NE(out.find(llvm::formatv("kernels; measured {0:f0} GFLOP/s here against",
                                   mklWins ? mkl : openblas)
                         .str()),
            std::string::npos)
      << out;
  // The second run reads them: the same line, the file untouched.
  llvm::sys::fs::file_status before, after;
  ASSERT_FALSE(llvm::sys::fs::status(measured, before));
  std::string again;
  ASSERT_EQ(runCommand(cache + pipecBinary + " --version", again), 0) << again;
  EXPECT_EQ(again, out);
  ASSERT_FALSE(llvm::sys::fs::status(measured, after));
  EXPECT_EQ(before.getLastModificationTime(), after.getLastModificationTime());

  // MKL by hand: a GPT's logits within float rounding of OpenBLAS's.
  std::string model = dir.path("gpt.onnx"), plan = dir.path("gpt.plan");
  ASSERT_EQ(
      runCommand(pipecBinary + " model gpt --layers 2 --hidden 64 --vocab 300 --seq 16 -o " + model,
                 out),
      0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " compile " + model +
                           " --mode infer --batch 2 --microbatches 1 -o " + plan,
                       out),
            0)
      << out;
  std::vector<pipec::cpu::Tensor> logits;
  for (const char *blas : {"openblas", "mkl"}) {
    std::string outputs = dir.path(std::string("out-") + blas);
    ASSERT_EQ(runCommand(cache + "PIPEC_BLAS=" + blas + " " + pipecBinary + " run " + plan +
                             " --steps 1 --outputs " + outputs,
                         out),
              0)
        << out;
    EXPECT_NE(out.find(std::string("kernels; PIPEC_BLAS=") + blas + "); "), std::string::npos)
        << out;
    auto values = pipec::rt::readNpy(outputs + "/logits.npy");
    ASSERT_TRUE(!!values) << llvm::toString(values.takeError());
    logits.push_back(std::move(*values));
  }
  EXPECT_EQ(logits[0].shape(), (std::vector<int64_t>{2, 16, 300}));
  std::string why;
  EXPECT_TRUE(pipec::cpu::allClose(logits[1], logits[0], 1e-5, 1e-6, &why)) << why;
}
