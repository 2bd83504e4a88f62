//===- AutocastTest.cpp - bf16 activations where the plan says bf16 -------===//
//
// autocast (passes/Autocast.h) on torch.onnx's exports (dynamo and legacy)
// of GPT-2, Llama, BERT and ViT, and on a generated GPT whose logits are an
// output beside the loss:
//  - every product reads bf16 and writes bf16, every op of torch.autocast's
//    float32 list reads float32, every other op reads one float type and
//    writes it; the weights stay float32, each reader's Cast their only
//    reader; the loss is float32 and every graph output keeps its type;
//  - the plan's values carry those types, and its memory counts them so;
//  - --autocast without training in bf16 is refused in one line.
// Training against torch's own autocast run: tools/torch_parity.py's
// autocast rows (50 AdamW steps within 1% of torch's).
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "driver/CompileParts.h"
#include "driver/PassPipeline.h"

#include <map>
#include <set>

using namespace pipec;
using namespace pipec::test;

namespace {

/// The graph of \p model as differentiate gets it, compiled for training
/// in bf16 with --autocast on (off with \p on false).
std::unique_ptr<Prepared> prepared(const std::string &model, bool on = true) {
  CompileOptions options;
  options.training = true;
  options.hardware = "cpu";
  options.precision = "bf16";
  options.autocast = on;
  options.stages = 1;
  options.microbatches = 1;
  PassRunner runner{PipelineOptions()};
  auto setup = resolveSetup(options);
  EXPECT_TRUE(static_cast<bool>(setup)) << llvm::toString(setup.takeError());
  if (!setup)
    return nullptr;
  auto out = prepare(model, options, runner, *setup, 1);
  EXPECT_TRUE(static_cast<bool>(out)) << model << ": " << llvm::toString(out.takeError());
  return out ? std::move(*out) : nullptr;
}

bool isFloat(DType type) { return type == DType::F32 || type == DType::BF16; }

/// Checks the rules of Autocast.h on every op of \p graph; returns the
/// number of products on bf16.
int expectAutocast(const Graph &graph) {
  int low = 0;
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    std::set<DType> in;
    for (int id : op.inputs)
      if (id >= 0 && isFloat(graph.values[id].type))
        in.insert(graph.values[id].type);
    if (in.empty() || op.is(OpId::Cast) || op.is(OpId::CastLike))
      continue;
    if (op.has(LowPrecision)) {
      EXPECT_EQ(in, std::set<DType>{DType::BF16}) << op.name;
      EXPECT_EQ(graph.values[op.outputs[0]].type, DType::BF16) << op.name;
      ++low;
    } else if (op.has(FullPrecision)) {
      EXPECT_EQ(in, std::set<DType>{DType::F32}) << op.name;
    } else if (op.def && !op.has(Subgraph)) {
      EXPECT_EQ(in.size(), 1u) << op.name << " (" << op.opType << ") reads both float types";
      for (int id : op.outputs)
        if (id >= 0 && isFloat(graph.values[id].type)) {
          EXPECT_EQ(graph.values[id].type, *in.begin()) << op.name;
        }
    }
  }
  // The weights are float32 masters: what reads one as bf16 is a Cast of it
  // made for that reader alone.
  for (const Value &v : graph.values) {
    if (v.kind != ValueKind::Weight || v.producer >= 0 || v.users.empty())
      continue;
    EXPECT_EQ(v.type, DType::F32) << v.name;
  }
  for (const Op &op : graph.ops)
    if (!op.dead && op.is(OpId::Cast) && graph.values[op.outputs[0]].type == DType::BF16 &&
        graph.values[op.inputs[0]].kind == ValueKind::Weight) {
      EXPECT_EQ(graph.values[op.outputs[0]].users.size(), 1u) << op.name;
    }
  return low;
}

TEST(Autocast, TorchsExportsTrainTheirProductsOnBf16) {
  std::string dir = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/torch/train/";
  for (const char *file :
       {"gpt2_tied.onnx", "gpt2_tied_legacy.onnx", "llama.onnx", "llama_legacy.onnx",
        "bert_mlm.onnx", "bert_mlm_legacy.onnx", "vit.onnx", "vit_legacy.onnx"}) {
    SCOPED_TRACE(file);
    auto p = prepared(dir + file);
    ASSERT_TRUE(p);
    const Graph &g = p->graph;
    // Each block's projections, its attention and its MLP, and the head.
    EXPECT_GE(expectAutocast(g), 2 * 5) << file;
    for (int id : g.outputs)
      EXPECT_EQ(g.values[id].type, DType::F32) << g.values[id].name;
    ASSERT_TRUE(p->backward) << p->backwardError;
  }
}

class AutocastModels : public Equivalence {};

TEST_F(AutocastModels, OutputsKeepTheirNamesAndTypes) {
  // The generated GPT writes its logits beside the loss: the head's product
  // is bf16, and a Cast writes the output under its own name.
  std::unique_ptr<Prepared> off = prepared(gpt(true), false), on = prepared(gpt(true));
  ASSERT_TRUE(off && on);
  EXPECT_GT(expectAutocast(on->graph), 0);
  ASSERT_EQ(on->graph.outputs.size(), off->graph.outputs.size());
  for (size_t i = 0; i < on->graph.outputs.size(); ++i) {
    const Value &a = on->graph.values[on->graph.outputs[i]];
    const Value &b = off->graph.values[off->graph.outputs[i]];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.type, b.type) << a.name;
    EXPECT_EQ(a.shape, b.shape) << a.name;
  }
}

TEST_F(AutocastModels, PlanHoldsTheTypesItRuns) {
  // The plan's stage programs carry the casts, and the boundary between two
  // stages is sent as the type the run holds.
  Config two{"1f1b", 2, 1, 2, 1};
  two.autocast = true;
  plan::Plan p = compileFor(gpt(true), two, 4);
  int casts = 0, again = 0;
  for (const plan::StageProgram &program : p.stage_programs()) {
    // What a microbatch keeps holds no float32 copy that a Cast widened
    // from a bf16 activation: the backward widens the bf16 value again. The
    // logits' Cast is the loss layer's (group-layers), so the loss keeps
    // the bf16 logits too.
    std::set<std::string> widened;
    for (const onnx::NodeProto &node : program.forward()) {
      if (node.op_type() != "Cast" || node.output_size() != 1)
        continue;
      ++casts;
      for (const onnx::AttributeProto &a : node.attribute())
        if (a.name() == "to" && a.i() == onnx::TensorProto::FLOAT)
          widened.insert(node.output(0));
    }
    for (const std::string &kept : program.keep())
      EXPECT_FALSE(widened.count(kept))
          << "stage " << program.stage() << " keeps the widened " << kept;
    for (const auto *list : {&program.backward_input(), &program.backward_weight()})
      for (const onnx::NodeProto &node : *list)
        again += node.op_type() == "Cast" && node.output_size() == 1 &&
                 llvm::StringRef(node.output(0)).contains(".again.");
  }
  EXPECT_GT(casts, 0);
  EXPECT_GT(again, 0);
  EXPECT_EQ(p.training().precision(), "bf16");
  // A step runs, and its loss is a finite number near the float32 plan's.
  Config fp32{"1f1b", 2, 1, 2, 1};
  std::vector<double> mixed = runPlan(p, "sgd", 2).losses(),
                      full = runPlan(compileFor(gpt(true), fp32, 4), "sgd", 2).losses();
  ASSERT_EQ(mixed.size(), 2u);
  ASSERT_EQ(full.size(), 2u);
  for (size_t s = 0; s < full.size(); ++s)
    EXPECT_NEAR(mixed[s], full[s], 2e-2 * std::abs(full[s])) << "step " << s;
}

TEST_F(AutocastModels, RefusedWithoutBf16Training) {
  std::string out;
  std::string base = pipecBin() + " compile " + gpt(true) + " -o " + dir->path("x.plan") +
                     " --hardware cpu --autocast";
  EXPECT_EQ(runCommand(base + " --mode train --precision fp32", out), 2) << out;
  EXPECT_NE(out.find("--autocast: needs --mode train and --precision bf16"), std::string::npos)
      << out;
  EXPECT_EQ(runCommand(base + " --mode infer --precision bf16", out), 2) << out;
  EXPECT_NE(out.find("--autocast"), std::string::npos) << out;
}

} // namespace
