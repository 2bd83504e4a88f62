//===- ScaledAttentionTest.cpp - Attention as one node in training -------===//
//
// fuse-attention (passes/FuseAttention.h) and pipec.ScaledDotProductAttention
// with its gradient (ops/Attention.h):
//  - the CPU kernels against PyTorch's forward and gradients
//    (tools/fixtures/torch_attention.py: GPT-2's causal Where, torch.onnx's
//    padded SDPA with its NaN guard, masked rows, rank 3, grouped-query
//    heads) within 1e-5;
//  - the body the CUDA backend runs (runtime/core/AttentionBody.h) against
//    the kernels, on the CPU's kernels for its ops;
//  - which attentions the pass fuses: every block of the generated models
//    and of torch's own exports (dynamo and legacy), none in inference or
//    with --attention unfused, none whose mask trains (T5's position bias);
//  - a training step with fused attention equals the step without it
//    (pipelined too), and the plan keeps less for the backward.
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "driver/Compile.h"
#include "ops/Attention.h"
#include "runtime/core/AttentionBody.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Data.h"
#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <cmath>
#include <map>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

namespace a = attention;

std::string fixtureDir(const std::string &name) {
  return std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/torch/attention/" + name + "/";
}

cpu::Tensor load(const std::string &path) {
  auto t = rt::readNpy(path);
  EXPECT_TRUE(static_cast<bool>(t)) << path << ": " << llvm::toString(t.takeError());
  return t ? std::move(*t) : cpu::Tensor();
}

/// One case of the torch fixture: the forward node, its gradient node and
/// every tensor by file stem.
struct Case {
  onnx::NodeProto forward, backward;
  std::map<std::string, cpu::Tensor> t;
  std::vector<std::string> tensors; // the step tensors' stems, in input order

  explicit Case(const std::string &name) {
    std::string dir = fixtureDir(name);
    auto text = llvm::MemoryBuffer::getFile(dir + "node.json");
    EXPECT_TRUE(static_cast<bool>(text)) << dir;
    if (!text)
      return;
    auto json = llvm::json::parse((*text)->getBuffer());
    EXPECT_TRUE(static_cast<bool>(json)) << llvm::toString(json.takeError());
    if (!json)
      return;
    const llvm::json::Object &node = *json->getAsObject();
    for (const char *stem : {"q", "kt", "v", "out", "lse", "dout", "dq", "dkt", "dv", "scalars"})
      t[stem] = load(dir + stem + ".npy");
    for (const llvm::json::Value &file : *node.getArray("tensors")) {
      std::string stem = file.getAsString()->drop_back(4).str();
      tensors.push_back(stem);
      t[stem] = load(dir + stem + ".npy");
    }
    std::vector<int64_t> steps;
    for (const llvm::json::Value &step : *node.getArray("steps"))
      steps.push_back(*step.getAsInteger());
    const cpu::Tensor &scalars = t["scalars"];
    auto setAttrs = [&](onnx::NodeProto &n) {
      setAttrInts(n, "steps", steps);
      setAttrFloats(n, "scalars",
                    llvm::ArrayRef<float>(scalars.data<float>(), scalars.numElements()));
      setAttrInt(n, "guarded", *node.getInteger("guarded"));
      setAttrFloat(n, "guard", static_cast<float>(*node.getNumber("guard")));
      if (llvm::Optional<int64_t> groups = node.getInteger("groups"))
        setAttrInt(n, "groups", *groups);
    };
    forward.set_name(name);
    forward.set_domain("pipec");
    forward.set_op_type(a::OpType.str());
    for (const char *in : {"q", "kt", "v"})
      forward.add_input(in);
    for (const std::string &stem : tensors)
      forward.add_input(stem);
    forward.add_output("out");
    forward.add_output("lse");
    setAttrs(forward);
    backward.set_name(name + "/grad");
    backward.set_domain("pipec");
    backward.set_op_type(a::GradOpType.str());
    for (const char *in : {"dout", "q", "kt", "v", "out", "lse"})
      backward.add_input(in);
    for (const std::string &stem : tensors)
      backward.add_input(stem);
    for (const char *out : {"dq", "dkt", "dv"})
      backward.add_output(out);
    setAttrs(backward);
  }

  std::vector<const cpu::Tensor *> inputs(const onnx::NodeProto &n) {
    std::vector<const cpu::Tensor *> in;
    for (const std::string &name : n.input())
      in.push_back(&t.at(name));
    return in;
  }
};

/// max |got - want| over max |want|, where both are finite; a non-finite
/// element must be the same on both sides.
double maxError(const cpu::Tensor &got, const cpu::Tensor &want, const std::string &what) {
  EXPECT_EQ(got.shape(), want.shape()) << what;
  if (got.shape() != want.shape())
    return 1;
  double worst = 0, scale = 0;
  for (int64_t i = 0; i < want.numElements(); ++i) {
    double w = want.getDouble(i), g = got.getDouble(i);
    if (!std::isfinite(w) || !std::isfinite(g)) {
      EXPECT_TRUE(w == g || (std::isnan(w) && std::isnan(g)))
          << what << " element " << i << ": " << g << " vs " << w;
      continue;
    }
    worst = std::max(worst, std::abs(g - w));
    scale = std::max(scale, std::abs(w));
  }
  return scale > 0 ? worst / scale : worst;
}

const char *const Cases[] = {"causal_gpt2", "padded_sdpa", "masked_rows", "no_heads", "gqa_llama"};

TEST(ScaledAttention, KernelsEqualTorch) {
  for (const char *name : Cases) {
    SCOPED_TRACE(name);
    Case c(name);
    auto fwd = cpu::runOp(c.forward, 17, c.inputs(c.forward));
    ASSERT_TRUE(static_cast<bool>(fwd)) << llvm::toString(fwd.takeError());
    EXPECT_LT(maxError((*fwd)[0], c.t["out"], "O"), 1e-5);
    EXPECT_LT(maxError((*fwd)[1], c.t["lse"], "L"), 1e-5);
    // The gradient from torch's own forward values.
    auto bwd = cpu::runOp(c.backward, 17, c.inputs(c.backward));
    ASSERT_TRUE(static_cast<bool>(bwd)) << llvm::toString(bwd.takeError());
    EXPECT_LT(maxError((*bwd)[0], c.t["dq"], "dQ"), 1e-5);
    EXPECT_LT(maxError((*bwd)[1], c.t["dkt"], "dKt"), 1e-5);
    EXPECT_LT(maxError((*bwd)[2], c.t["dv"], "dV"), 1e-5);
  }
}

/// The fused nodes as their body's ops, on the CPU's kernels for them (at
/// both ways of passing a reduction's axes).
TEST(ScaledAttention, BodyEqualsKernels) {
  for (int64_t opset : {17, 18}) {
    for (const char *name : Cases) {
      SCOPED_TRACE(formatv("{0} opset {1}", name, opset).str());
      Case c(name);
      int64_t rank = c.t["q"].rank();
      for (onnx::NodeProto *node : {&c.forward, &c.backward}) {
        auto body = attentionBody(*node, rank, opset);
        ASSERT_TRUE(static_cast<bool>(body)) << llvm::toString(body.takeError());
        std::vector<const cpu::Tensor *> in = c.inputs(*node);
        auto kernel = cpu::runOp(*node, opset, in);
        ASSERT_TRUE(static_cast<bool>(kernel)) << llvm::toString(kernel.takeError());
        auto steps = runBodyGraph(
            *body, *node, in,
            [&](const onnx::NodeProto &step, llvm::ArrayRef<const cpu::Tensor *> args) {
              return cpu::runOp(step, opset, args);
            });
        ASSERT_TRUE(static_cast<bool>(steps)) << llvm::toString(steps.takeError());
        ASSERT_EQ(steps->size(), kernel->size());
        for (size_t o = 0; o < kernel->size(); ++o) {
          cpu::Tensor got = (*steps)[o];
          if (node == &c.forward && o == a::LogSumExp) {
            // A row masked whole is -inf in the kernel, NaN in the body.
            got = cpu::Tensor::fromValues<float>(
                got.shape(), llvm::ArrayRef<float>(got.data<float>(), got.numElements()));
            for (int64_t i = 0; i < got.numElements(); ++i)
              if (std::isinf((*kernel)[o].data<float>()[i]) && std::isnan(got.data<float>()[i]))
                got.data<float>()[i] = (*kernel)[o].data<float>()[i];
          }
          EXPECT_LT(maxError(got, (*kernel)[o], node->output(static_cast<int>(o))), 1e-5);
        }
      }
    }
  }
}

TEST(ScaledAttention, RefusesWhatItCannotCompute) {
  Case c("causal_gpt2");
  onnx::NodeProto wrong = c.forward;
  wrong.mutable_attribute(0)->add_ints(7); // a step with no scalar, of no kind
  auto out = cpu::runOp(wrong, 17, c.inputs(wrong));
  ASSERT_FALSE(static_cast<bool>(out));
  EXPECT_NE(llvm::toString(out.takeError()).find("causal_gpt2"), std::string::npos);
  // V of another length than the keys.
  cpu::Tensor shortV =
      cpu::Tensor::fromValues<float>({2, 4, 15, 8}, std::vector<float>(2 * 4 * 15 * 8, 0.0f));
  std::vector<const cpu::Tensor *> in = c.inputs(c.forward);
  in[a::Values] = &shortV;
  auto mismatched = cpu::runOp(c.forward, 17, in);
  ASSERT_FALSE(static_cast<bool>(mismatched));
  EXPECT_NE(llvm::toString(mismatched.takeError()).find("[.., n, d]"), std::string::npos);
}

//===----------------------------------------------------------------------===//
// The pass, and training with it
//===----------------------------------------------------------------------===//

/// The nodes of \p type in every stage program's forward.
int countForward(const plan::Plan &p, llvm::StringRef type) {
  int n = 0;
  for (const plan::StageProgram &program : p.stage_programs())
    for (const onnx::NodeProto &node : program.forward())
      n += node.op_type() == type;
  return n;
}

/// The one-stage plan of \p model in \p mode (train or infer), one microbatch
/// of the batch it was exported with (else one sample); \p fuse false:
/// --attention unfused.
plan::Plan compileIn(const std::string &model, const std::string &mode, bool fuse = true) {
  CompileOptions options;
  options.training = mode == "train";
  options.hardware = "cpu";
  options.fuseAttention = fuse;
  options.stages = 1;
  options.microbatches = 1;
  auto plan = compileModel(model, options, PipelineOptions());
  EXPECT_TRUE(static_cast<bool>(plan)) << model << ": " << llvm::toString(plan.takeError());
  return plan ? std::move(*plan) : plan::Plan();
}

class FusedAttention : public Equivalence {};

TEST_F(FusedAttention, EveryBlockOfTheGeneratedModels) {
  for (const auto &[path, blocks] :
       {std::pair{gpt(true), 6}, std::pair{llama(), 4}, std::pair{bert(), 4}}) {
    SCOPED_TRACE(path);
    EXPECT_EQ(countForward(compileIn(path, "train"), a::OpType), blocks);
    EXPECT_EQ(countForward(compileIn(path, "train", false), a::OpType), 0);
    EXPECT_EQ(countForward(compileIn(path, "infer"), a::OpType), 0);
  }
}

/// torch.onnx's exports of real families, dynamo and legacy: attention
/// fused in every block, whatever the exporter wrote (an additive mask and
/// the NaN guard, a scale after the mask, float casts before the product).
TEST(FusedAttentionExports, EveryBlockOfTorchsExports) {
  std::string dir = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/torch/train/";
  for (const auto &[file, blocks] :
       {std::pair{"gpt2_tied.onnx", 2}, std::pair{"gpt2_tied_legacy.onnx", 2},
        std::pair{"llama.onnx", 2}, std::pair{"llama_legacy.onnx", 2},
        std::pair{"bert_mlm.onnx", 2}, std::pair{"bert_mlm_legacy.onnx", 2},
        std::pair{"vit.onnx", 2}, std::pair{"vit_legacy.onnx", 2}}) {
    SCOPED_TRACE(file);
    plan::Plan p = compileIn(dir + file, "train");
    EXPECT_EQ(countForward(p, a::OpType), blocks);
    EXPECT_EQ(countForward(p, "Softmax"), 0);
  }
  // Grouped-query attention (Llama's 4 query heads over 2 key/value heads,
  // Gemma's 4 over 1): the node reads K and V as the model made them, before
  // repeat_kv.
  for (const auto &[file, groups] :
       {std::pair{"llama.onnx", 2}, std::pair{"llama_legacy.onnx", 2},
        std::pair{"user_llama.onnx", 2}, std::pair{"user_gemma.onnx", 4}}) {
    SCOPED_TRACE(file);
    plan::Plan p = compileIn(dir + file, "train");
    int grouped = 0;
    for (const plan::StageProgram &program : p.stage_programs())
      for (const onnx::NodeProto &node : program.forward())
        if (node.op_type() == a::OpType) {
          EXPECT_EQ(attrInt(node, "groups", 1), groups) << node.name();
          ++grouped;
        }
    EXPECT_EQ(grouped, 2);
  }
  // T5's self-attention adds a position bias made from a trained table: its
  // gradient needs the scores', so those blocks keep their nodes.
  plan::Plan t5 = compileIn(dir + "user_t5.onnx", "train");
  EXPECT_GT(countForward(t5, "Softmax"), 0);
}

TEST_F(FusedAttention, TrainsAsTheNodesItReplaces) {
  for (const std::string &path : {gpt(true), llama(), bert()}) {
    SCOPED_TRACE(path);
    Config unfused{"gpipe", 1, 1, 1, 1};
    unfused.fuseAttention = false;
    rt::RunResult reference = runPlan(compileFor(path, unfused, 8), "sgd", 1);
    for (const Config &s : {Config{"gpipe", 1, 1, 1, 1}, Config{"1f1b", 2, 1, 4, 1}}) {
      std::string what = formatv("{0} P={1} M={2}", s.schedule, s.stages, s.microbatches).str();
      plan::Plan fused = compileFor(path, s, 8);
      ASSERT_GT(countForward(fused, a::OpType), 0) << what;
      expectSameStep(runPlan(fused, "sgd", 1), reference, what);
    }
  }
}

TEST_F(FusedAttention, KeepsLessForTheBackward) {
  // Sequence 256: the probabilities the softmax's and the product's
  // gradients read (4 heads x 256 x 256 per block) outweigh the rest of a
  // block's activations (about 16 x 256 x 32).
  models::GeneratorOptions o(models::Family::Gpt, 4, 32, 64, 256, 4);
  o.withLoss = true;
  std::string path = model("gpt-seq256", o);
  plan::Plan fused = compileIn(path, "train"), unfused = compileIn(path, "train", false);
  ASSERT_EQ(fused.ranks_size(), 1);
  ASSERT_EQ(unfused.ranks_size(), 1);
  EXPECT_LT(fused.ranks(0).activation_bytes() * 2, unfused.ranks(0).activation_bytes())
      << fused.ranks(0).activation_bytes() << " vs " << unfused.ranks(0).activation_bytes();
}

} // namespace
