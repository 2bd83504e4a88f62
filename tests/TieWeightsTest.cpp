//===- TieWeightsTest.cpp - tie-weights, --untie and the saved ties ------===//
#include "TestUtil.h"

#include "plan/PlanFile.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

using namespace pipec;
using namespace pipec::test;

namespace {

const std::string compileFlags =
    " --stages 2 --microbatches 2 --batch 4 --hardware cpu --precision fp32 "
    "--optimizer sgd";

/// The loss of writeNormModel's models, which output their prediction.
const std::string normLoss = " --loss-fn mse --labels labels";

void fill(onnx::TensorProto &t, float base, float scale, int seed) {
  int64_t n = 1;
  for (int64_t d : t.dims())
    n *= d;
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = base + scale * static_cast<float>(std::sin(0.7 * (i + 1) + seed));
  t.set_raw_data(std::string(reinterpret_cast<const char *>(v.data()), n * sizeof(float)));
}

/// Three blocks of LayerNormalization then MatMul, MSE against "labels" (the
/// loss compile adds: normLoss).
/// With \p shared, the three LayerNormalizations read one scale, "ln.weight",
/// as a torch export of a fresh model does; else each its own, equal to it.
/// With \p ones, the scales hold 1 everywhere, as a fresh model's do.
void writeNormModel(const std::string &path, bool shared, bool ones = false) {
  GraphBuilder b;
  b.input("x", onnx::TensorProto::FLOAT, {-1, 8}, {"batch"});
  b.input("labels", onnx::TensorProto::FLOAT, {-1, 8}, {"batch"});
  std::string h = "x";
  for (int l = 0; l < 3; ++l) {
    std::string scale = shared ? "ln.weight" : llvm::formatv("layers.{0}.ln.weight", l).str();
    if (!shared || l == 0)
      fill(b.weight(scale, {8}), 1.0f, ones ? 0.0f : 0.1f, 0);
    std::string bias = llvm::formatv("layers.{0}.ln.bias", l).str();
    std::string fc = llvm::formatv("layers.{0}.fc.weight", l).str();
    fill(b.weight(bias, {8}), 0.0f, 0.1f, 10 + l);
    fill(b.weight(fc, {8, 8}), 0.0f, 0.3f, 20 + l);
    std::string prefix = llvm::formatv("/layers.{0}", l).str();
    b.node("LayerNormalization", {h, scale, bias}, {prefix + "/ln/out"},
           prefix + "/ln/LayerNormalization");
    h = l == 2 ? "y" : prefix + "/fc/out";
    b.node("MatMul", {prefix + "/ln/out", fc}, {h}, prefix + "/fc/MatMul");
  }
  b.output("y");
  b.write(path);
}

std::map<std::string, std::vector<float>> floatInitializers(const std::string &path) {
  onnx::ModelProto m;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(m.ParseFromIstream(&in)) << path;
  std::map<std::string, std::vector<float>> out;
  for (const onnx::TensorProto &t : m.graph().initializer()) {
    if (t.data_type() != onnx::TensorProto::FLOAT)
      continue;
    std::vector<float> v;
    if (!t.raw_data().empty()) {
      v.resize(t.raw_data().size() / sizeof(float));
      std::memcpy(v.data(), t.raw_data().data(), t.raw_data().size());
    } else {
      v.assign(t.float_data().begin(), t.float_data().end());
    }
    out[t.name()] = std::move(v);
  }
  return out;
}

plan::Plan readCompiled(const std::string &path) {
  auto plan = readPlan(path);
  EXPECT_TRUE(!!plan) << llvm::toString(plan.takeError());
  return plan ? std::move(*plan) : plan::Plan();
}

/// Runs `pipec compile MODEL` with the tests' flags and \p flags into
/// \p planPath; returns the exit code, the output in \p out.
int compile(const std::string &model, const std::string &flags, const std::string &planPath,
            std::string &out) {
  return runCommand(pipecBinary + " compile " + model + compileFlags + flags + " -o " + planPath,
                    out);
}

bool hasWarning(const plan::Plan &plan, const std::string &text) {
  for (const std::string &w : plan.warnings())
    if (w.find(text) != std::string::npos)
      return true;
  return false;
}

bool trains(const plan::Plan &plan, const std::string &name) {
  for (const std::string &t : plan.trainable())
    if (t == name)
      return true;
  return false;
}

TEST(TieWeights, ExporterSharingIsReportedAndUntied) {
  TempDir dir;
  std::string model = dir.path("shared.onnx"), out;
  writeNormModel(model, /*shared=*/true);
  ASSERT_EQ(compile(model, normLoss, dir.path("tied.plan"), out), 0) << out;
  plan::Plan tied = readCompiled(dir.path("tied.plan"));
  EXPECT_TRUE(hasWarning(tied, "weight 'ln.weight' is shared by 3 layers")) << out;
  EXPECT_TRUE(hasWarning(tied, "each reading it as LayerNormalization input 1; exporters share "
                               "equal tensors; trained as one weight; pass --untie "
                               "ln.weight|all to train copies"));
  EXPECT_TRUE(trains(tied, "ln.weight"));
  EXPECT_EQ(tied.ties_size(), 0);

  ASSERT_EQ(compile(model, normLoss + " --untie all", dir.path("untied.plan"), out), 0) << out;
  plan::Plan untied = readCompiled(dir.path("untied.plan"));
  EXPECT_FALSE(trains(untied, "ln.weight"));
  for (int l = 0; l < 3; ++l)
    EXPECT_TRUE(trains(untied, llvm::formatv("ln.weight.untied.{0}", l).str()));
  EXPECT_TRUE(hasWarning(untied, "weight 'ln.weight' was shared by 3 layers"));
  ASSERT_EQ(untied.ties_size(), 1);
  ASSERT_EQ(untied.ties(0).copies_size(), 3);
  std::set<int> readers;
  for (int l = 0; l < 3; ++l) {
    const plan::UntiedCopy &copy = untied.ties(0).copies(l);
    EXPECT_EQ(copy.name(), llvm::formatv("ln.weight.untied.{0}", l).str());
    // Each copy is read once, as a LayerNormalization's scale (input 1).
    ASSERT_EQ(copy.nodes_size(), 1);
    ASSERT_EQ(copy.inputs_size(), 1);
    EXPECT_EQ(copy.inputs(0), 1);
    readers.insert(copy.nodes(0));
  }
  EXPECT_EQ(readers.size(), 3u) << "three different nodes";

  // By name, as a comma list, gives the same plan's trainable weights.
  ASSERT_EQ(compile(model, normLoss + " --untie ln.weight,ln.weight", dir.path("named.plan"), out),
            0)
      << out;
  plan::Plan named = readCompiled(dir.path("named.plan"));
  EXPECT_EQ(std::vector<std::string>(named.trainable().begin(), named.trainable().end()),
            std::vector<std::string>(untied.trainable().begin(), untied.trainable().end()));
}

TEST(TieWeights, UnknownNameIsAUsageError) {
  TempDir dir;
  std::string model = dir.path("shared.onnx"), out;
  writeNormModel(model, /*shared=*/true);
  EXPECT_EQ(compile(model, normLoss + " --untie layers.0.fc.weight", dir.path("p.plan"), out), 2)
      << out;
  EXPECT_NE(out.find("--untie layers.0.fc.weight: no initializer of that name is shared by "
                     "layers or holds a folded tie; expected all or one of: ln.weight"),
            std::string::npos)
      << out;
}

/// One SGD step of the shared model with --untie all gives each copy the
/// update the model written with separate scales gives each scale.
TEST(TieWeights, UntiedCopiesTrainAsSeparateWeights) {
  TempDir dir;
  std::string shared = dir.path("shared.onnx"), separate = dir.path("separate.onnx"), out;
  writeNormModel(shared, /*shared=*/true);
  writeNormModel(separate, /*shared=*/false);
  std::string run = " --steps 1 --lr 0.1 --seed 7 --quiet --save-weights ";
  struct Case {
    std::string tag, model, flags;
  };
  for (const Case &c : {Case{"untied", shared, " --untie all"}, Case{"tied", shared, ""},
                        Case{"separate", separate, ""}}) {
    ASSERT_EQ(compile(c.model, normLoss + c.flags, dir.path(c.tag + ".plan"), out), 0) << out;
    ASSERT_EQ(runCommand(pipecBinary + " run " + dir.path(c.tag + ".plan") + run +
                             dir.path(c.tag + ".out.onnx") + " --metrics " +
                             dir.path(c.tag + ".jsonl"),
                         out),
              0)
        << out;
  }
  EXPECT_EQ(metricLosses(dir.path("untied.jsonl")), metricLosses(dir.path("separate.jsonl")));
  auto untied = floatInitializers(dir.path("untied.out.onnx"));
  auto separateOut = floatInitializers(dir.path("separate.out.onnx"));
  auto tiedOut = floatInitializers(dir.path("tied.out.onnx"));
  auto before = floatInitializers(shared);
  EXPECT_EQ(untied.count("ln.weight"), 0u) << "no node reads the original any more";
  // Where the oracles are built: onnxruntime runs the saved model, which
  // computes what the model trained with separate scales computes.
  std::string python = std::string(PIPEC_BINARY_DIR) + "/_deps/oracles/bin/python";
  if (fileExists(python)) {
    std::string check = "import onnxruntime as ort, numpy as np; "
                        "x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8); "
                        "y = [ort.InferenceSession(f).run(None, {'x': x, 'labels': x})[0] "
                        "for f in ['" +
                        dir.path("untied.out.onnx") + "', '" + dir.path("separate.out.onnx") +
                        "']]; assert np.allclose(y[0], y[1], rtol=1e-5, atol=1e-6), y";
    EXPECT_EQ(runCommand(python + " -c \"" + check + "\"", out), 0) << out;
  }
  for (int l = 0; l < 3; ++l) {
    const std::vector<float> &got = untied[llvm::formatv("ln.weight.untied.{0}", l).str()];
    const std::vector<float> &want = separateOut[llvm::formatv("layers.{0}.ln.weight", l).str()];
    ASSERT_EQ(got.size(), 8u);
    ASSERT_EQ(want.size(), 8u);
    double moved = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << l << " " << i;
      moved = std::max(moved, std::fabs(double(got[i]) - before["ln.weight"][i]));
    }
    EXPECT_GT(moved, 1e-4) << "copy " << l << " trained";
  }
  // Tied, the one scale moves by the sum of the three updates.
  for (size_t i = 0; i < 8; ++i) {
    double sum = before["ln.weight"][i];
    for (int l = 0; l < 3; ++l)
      sum +=
          separateOut[llvm::formatv("layers.{0}.ln.weight", l).str()][i] - before["ln.weight"][i];
    EXPECT_NEAR(tiedOut["ln.weight"][i], sum, 1e-5) << i;
  }
}

/// Without --params, a shared scale of one value everywhere is the
/// exporter's merge of one scale per module: each module trains its own
/// copy, as the model written with separate scales trains them, and compile
/// says it guessed.
TEST(TieWeights, OneValueSharedByModulesSplitsWithoutParams) {
  TempDir dir;
  std::string shared = dir.path("shared.onnx"), separate = dir.path("separate.onnx"), out;
  writeNormModel(shared, /*shared=*/true, /*ones=*/true);
  writeNormModel(separate, /*shared=*/false, /*ones=*/true);
  for (const std::string &tag : {std::string("shared"), std::string("separate")}) {
    ASSERT_EQ(compile(dir.path(tag + ".onnx"), normLoss, dir.path(tag + ".plan"), out), 0) << out;
    ASSERT_EQ(runCommand(pipecBinary + " run " + dir.path(tag + ".plan") +
                             " --steps 1 --lr 0.1 --seed 7 --quiet --save-weights " +
                             dir.path(tag + ".out.onnx") + " --metrics " + dir.path(tag + ".jsonl"),
                         out),
              0)
        << out;
  }
  plan::Plan plan = readCompiled(dir.path("shared.plan"));
  EXPECT_TRUE(hasWarning(plan, "weight 'ln.weight' holds one value everywhere and is read by 3 "
                               "modules (layers.0.ln, layers.1.ln, layers.2.ln); guessed to be "
                               "the exporter's merge of 3 parameters"))
      << out;
  EXPECT_TRUE(hasWarning(plan, "pass --params to decide from the checkpoint"));
  EXPECT_FALSE(trains(plan, "ln.weight"));
  EXPECT_EQ(metricLosses(dir.path("shared.jsonl")), metricLosses(dir.path("separate.jsonl")));
  auto got = floatInitializers(dir.path("shared.out.onnx"));
  auto want = floatInitializers(dir.path("separate.out.onnx"));
  for (int l = 0; l < 3; ++l) {
    const std::vector<float> &copy = got[llvm::formatv("ln.weight.layers.{0}.ln", l).str()];
    const std::vector<float> &scale = want[llvm::formatv("layers.{0}.ln.weight", l).str()];
    ASSERT_EQ(copy.size(), 8u) << l;
    EXPECT_EQ(copy, scale) << l;
    EXPECT_NE(copy, std::vector<float>(8, 1.0f)) << "copy " << l << " trained";
  }
}

std::string generateTiedGpt(const TempDir &dir) {
  std::string model = dir.path("gpt.onnx"), out;
  EXPECT_EQ(runCommand(pipecBinary +
                           " model gpt --tied --loss --layers 2 --hidden 16 --heads 2 "
                           "--vocab 64 --seq 8 -o " +
                           model,
                       out),
            0)
      << out;
  return model;
}

TEST(TieWeights, RealTieStaysTied) {
  TempDir dir;
  std::string model = generateTiedGpt(dir), out;
  ASSERT_EQ(compile(model, " --seq 8", dir.path("p.plan"), out), 0) << out;
  plan::Plan plan = readCompiled(dir.path("p.plan"));
  EXPECT_TRUE(hasWarning(plan, "weight 'transformer.wte.weight' is tied: read by 2 layers")) << out;
  EXPECT_FALSE(hasWarning(plan, "exporters share"));
  EXPECT_TRUE(trains(plan, "transformer.wte.weight"));
  EXPECT_EQ(plan.ties_size(), 0);
}

/// The tied GPT with its head's Transpose(wte) folded into an initializer,
/// as torch's dynamo exporter writes it; with \p zeros, wte and the head
/// are zero-filled (a constant matrix is no evidence of a tie).
std::string foldHead(const TempDir &dir, const std::string &model, bool zeros) {
  onnx::ModelProto m;
  {
    std::ifstream in(model, std::ios::binary);
    EXPECT_TRUE(m.ParseFromIstream(&in));
  }
  onnx::GraphProto &g = *m.mutable_graph();
  const std::string wte = "transformer.wte.weight";
  onnx::TensorProto *table = nullptr;
  for (onnx::TensorProto &t : *g.mutable_initializer())
    if (t.name() == wte)
      table = &t;
  EXPECT_NE(table, nullptr);
  if (!table)
    return "";
  int64_t rows = table->dims(0), cols = table->dims(1);
  std::vector<float> e(rows * cols), h(rows * cols);
  std::memcpy(e.data(), table->raw_data().data(), e.size() * sizeof(float));
  if (zeros) {
    std::fill(e.begin(), e.end(), 0.0f);
    table->set_raw_data(std::string(reinterpret_cast<const char *>(e.data()), e.size() * 4));
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      h[j * rows + i] = e[i * cols + j];
  std::string transposed;
  for (int n = 0; n < g.node_size(); ++n)
    if (g.node(n).op_type() == "Transpose" && g.node(n).input(0) == wte) {
      transposed = g.node(n).output(0);
      g.mutable_node()->erase(g.mutable_node()->begin() + n);
      break;
    }
  EXPECT_FALSE(transposed.empty());
  for (onnx::NodeProto &n : *g.mutable_node())
    for (int i = 0; i < n.input_size(); ++i)
      if (n.input(i) == transposed)
        n.set_input(i, "lm_head.weight");
  onnx::TensorProto &head = *g.add_initializer();
  head.set_name("lm_head.weight");
  head.set_data_type(onnx::TensorProto::FLOAT);
  head.add_dims(cols);
  head.add_dims(rows);
  head.set_raw_data(std::string(reinterpret_cast<const char *>(h.data()), h.size() * 4));
  std::string path = dir.path(zeros ? "zeros.onnx" : "folded.onnx");
  std::ofstream os(path, std::ios::binary);
  m.SerializeToOstream(&os);
  return path;
}

TEST(TieWeights, FoldedTieIsRetied) {
  TempDir dir;
  std::string folded = foldHead(dir, generateTiedGpt(dir), false), out;
  ASSERT_EQ(compile(folded, " --seq 8", dir.path("p.plan"), out), 0) << out;
  plan::Plan plan = readCompiled(dir.path("p.plan"));
  EXPECT_TRUE(hasWarning(plan, "'lm_head.weight' holds the transpose of 'transformer.wte.weight' "
                               "(an exporter folded a tied weight); trained as one weight; pass "
                               "--untie lm_head.weight to train apart"))
      << out;
  EXPECT_TRUE(trains(plan, "transformer.wte.weight"));
  EXPECT_FALSE(trains(plan, "lm_head.weight"));
  ASSERT_EQ(plan.ties_size(), 1);
  EXPECT_EQ(plan.ties(0).transpose_of(), "transformer.wte.weight");

  // The saved model holds the trained tie: the head is wte's transpose.
  ASSERT_EQ(runCommand(pipecBinary + " run " + dir.path("p.plan") +
                           " --steps 1 --lr 0.1 --quiet --save-weights " + dir.path("out.onnx"),
                       out),
            0)
      << out;
  auto saved = floatInitializers(dir.path("out.onnx"));
  auto original = floatInitializers(folded);
  const std::vector<float> &e = saved["transformer.wte.weight"], &h = saved["lm_head.weight"];
  ASSERT_EQ(e.size(), 64u * 16u);
  ASSERT_EQ(h.size(), e.size());
  EXPECT_NE(e, original["transformer.wte.weight"]) << "wte trained";
  for (int64_t i = 0; i < 64; ++i)
    for (int64_t j = 0; j < 16; ++j)
      ASSERT_EQ(h[j * 64 + i], e[i * 16 + j]) << i << " " << j;

  // --untie keeps them apart.
  ASSERT_EQ(compile(folded, " --seq 8 --untie lm_head.weight", dir.path("apart.plan"), out), 0)
      << out;
  plan::Plan apart = readCompiled(dir.path("apart.plan"));
  EXPECT_TRUE(trains(apart, "lm_head.weight"));
  EXPECT_TRUE(hasWarning(apart, "trained apart, as --untie lm_head.weight asks"));
  EXPECT_EQ(apart.ties_size(), 0);

  // The embedding of a retied head cannot be untied from its readers.
  EXPECT_EQ(compile(folded, " --seq 8 --untie transformer.wte.weight", dir.path("bad.plan"), out),
            2)
      << out;
  EXPECT_NE(out.find("--untie transformer.wte.weight: 'lm_head.weight' is read as its transpose "
                     "(a folded tie); pass --untie lm_head.weight to train the two apart"),
            std::string::npos)
      << out;
}

TEST(TieWeights, ConstantMatricesAreNoTie) {
  TempDir dir;
  std::string zeros = foldHead(dir, generateTiedGpt(dir), true), out;
  ASSERT_EQ(compile(zeros, " --seq 8", dir.path("p.plan"), out), 0) << out;
  plan::Plan plan = readCompiled(dir.path("p.plan"));
  EXPECT_FALSE(hasWarning(plan, "holds the transpose")) << out;
  EXPECT_TRUE(trains(plan, "lm_head.weight"));
  EXPECT_EQ(plan.ties_size(), 0);
}

} // namespace
