//===- LossChoiceTest.cpp - The loss is found by structure, never by name -===//
//
// chooseLoss on small graphs built here: the one float scalar output that
// depends on the weights is the loss whatever it is called; two such
// outputs are refused naming --loss; --loss picks one; a loss is added only
// when asked (--loss-fn, --labels), over a non-scalar output. And through
// the CLI: the refusal is one line with exit 1, the summary says what the
// plan trains against, and a model whose loss is called "out" trains.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"
#include "models/GraphBuilder.h"
#include "passes/Differentiate.h"
#include "passes/GroupLayers.h"
#include "plan/PlanFile.h"
#include "runtime/core/Tensor.h"
#include "runtime/exec/Data.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/FileSystem.h"

#include <cmath>
#include <set>

using namespace llvm;

namespace pipec::test {
namespace {

/// x [4, 8] -> logits = x W [4, 8]; scalars: `out` (mean of the logits),
/// optionally `aux` (sum of the logits: a second candidate) and `count` (a
/// sum of the input alone: a float scalar that depends on no weight); an
/// int64 `labels` input read by nothing that matters for the loss.
GraphBuilder lossModel(bool aux, bool count, bool logitsOutput, const std::string &lossName) {
  const onnx::AttributeProto noKeepdims = models::attrInt("keepdims", 0);
  GraphBuilder b;
  b.input("x", onnx::TensorProto::FLOAT, {4, 8});
  b.input("labels", onnx::TensorProto::INT64, {4});
  b.weight("W", {8, 8});
  b.node("MatMul", {"x", "W"}, {"logits"}, "mm");
  if (!lossName.empty()) {
    b.node("ReduceMean", {"logits"}, {lossName}, "mean").add_attribute()->CopyFrom(noKeepdims);
    b.output(lossName);
  }
  if (aux) {
    b.node("ReduceSum", {"logits"}, {"aux"}, "sum").add_attribute()->CopyFrom(noKeepdims);
    b.output("aux");
  }
  if (count) {
    b.node("ReduceSum", {"x"}, {"count"}, "count").add_attribute()->CopyFrom(noKeepdims);
    b.output("count");
  }
  if (logitsOutput)
    b.output("logits");
  return b;
}

Expected<LossChoice> choose(const GraphBuilder &b, const LossOptions &options = {}) {
  auto graph = importBytes(b.serialize());
  if (!graph)
    return graph.takeError();
  return chooseLoss(*graph, options);
}

/// The error of choosing a loss for \p b under \p options; a failure, and
/// "", when a loss is chosen.
std::string refusal(const GraphBuilder &b, const LossOptions &options = {}) {
  auto choice = choose(b, options);
  EXPECT_FALSE(!!choice);
  return choice ? std::string() : toString(choice.takeError());
}

TEST(LossChoice, TheOneScalarThatDependsOnTheWeightsWhateverItsName) {
  for (const char *name : {"out", "loss", "mean_3"}) {
    auto choice = choose(lossModel(false, true, true, name));
    ASSERT_TRUE(!!choice) << toString(choice.takeError());
    ASSERT_TRUE(choice->spec.has_value()) << choice->reason;
    EXPECT_EQ(choice->spec->kind, LossSpec::Kind::ModelOutput);
    EXPECT_EQ(choice->spec->output, name);
    EXPECT_EQ(choice->reason, std::string("the model's output '") + name +
                                  "', its one float scalar output that depends on the weights");
  }
}

TEST(LossChoice, TwoCandidatesAreRefusedNamingTheFlag) {
  EXPECT_EQ(refusal(lossModel(true, true, false, "out")),
            "the model has 2 outputs that could be its loss (float scalars that depend on the "
            "weights): 'out' f32[], 'aux' f32[]; choose one with --loss NAME");
  LossOptions pick;
  pick.output = "aux";
  auto chosen = choose(lossModel(true, true, false, "out"), pick);
  ASSERT_TRUE(!!chosen) << toString(chosen.takeError());
  ASSERT_TRUE(chosen->spec.has_value());
  EXPECT_EQ(chosen->spec->output, "aux");
  EXPECT_EQ(chosen->reason, "the model's output 'aux' (chosen by --loss)");
}

TEST(LossChoice, NothingIsInferredFromAnInputCalledLabels) {
  // Logits and an int64 input called "labels": no loss is added unasked.
  auto none = choose(lossModel(false, false, true, ""));
  ASSERT_TRUE(!!none) << toString(none.takeError());
  EXPECT_FALSE(none->spec.has_value());
  EXPECT_NE(none->reason.find("no output is a float scalar that depends on the weights"),
            std::string::npos)
      << none->reason;
  EXPECT_NE(none->reason.find("--loss-fn cross-entropy|mse --labels INPUT"), std::string::npos);

  LossOptions added;
  added.addedLoss = LossSpec::Kind::SoftmaxCrossEntropy;
  added.labels = "labels";
  auto ce = choose(lossModel(false, false, true, ""), added);
  ASSERT_TRUE(!!ce) << toString(ce.takeError());
  ASSERT_TRUE(ce->spec.has_value());
  EXPECT_EQ(ce->spec->kind, LossSpec::Kind::SoftmaxCrossEntropy);
  EXPECT_EQ(ce->spec->output, "logits");
  EXPECT_EQ(ce->spec->labels, "labels");
}

TEST(LossChoice, AddedLossesAreCheckedAgainstTheModel) {
  LossOptions added;
  added.addedLoss = LossSpec::Kind::SoftmaxCrossEntropy;
  added.labels = "labels";
  // The model computes its own loss: adding one is refused.
  EXPECT_NE(refusal(lossModel(false, false, true, "out"), added)
                .find("the model computes its own loss ('out' f32[]"),
            std::string::npos);
  // Labels that are not an input, of the wrong type, or missing.
  added.labels = "y";
  EXPECT_EQ(refusal(lossModel(false, false, true, ""), added),
            "--labels y: the model has no input 'y' (inputs: 'x' f32[4,8], 'labels' "
            "i64[4])");
  added.addedLoss = LossSpec::Kind::Mse;
  added.labels = "labels";
  EXPECT_EQ(refusal(lossModel(false, false, true, ""), added),
            "--labels labels: mse needs float labels, and 'labels' is i64");
  added.labels = "";
  EXPECT_NE(refusal(lossModel(false, false, true, ""), added).find("needs --labels INPUT"),
            std::string::npos);
  // --loss that names no output, or a tensor without --loss-fn.
  LossOptions pick;
  pick.output = "nope";
  EXPECT_EQ(refusal(lossModel(false, false, true, "out"), pick),
            "--loss nope: the model has no output 'nope' (outputs: 'out' f32[], 'logits' "
            "f32[4,8])");
  pick.output = "logits";
  EXPECT_NE(refusal(lossModel(false, false, true, "out"), pick).find("not a scalar"),
            std::string::npos);
  pick.output = "count";
  EXPECT_EQ(refusal(lossModel(false, true, false, "out"), pick),
            "--loss count: the output does not depend on any trainable weight");
}

TEST(LossChoice, TheCliRefusesTwoCandidatesAndTrainsAnOutputCalledOut) {
  TempDir dir;
  std::string out;
  lossModel(true, false, false, "out").write(dir.path("two.onnx"));
  int status = runCommand(pipecBinary + " compile " + dir.path("two.onnx") + " --stages 1 -o " +
                              dir.path("two.plan") + " --hardware cpu 2>&1",
                          out);
  EXPECT_EQ(status, 1) << out;
  EXPECT_EQ(out, "pipec: error: the model has 2 outputs that could be its loss (float scalars "
                 "that depend on the weights): 'out' f32[], 'aux' f32[]; choose one with "
                 "--loss NAME\n");
  EXPECT_FALSE(fileExists(dir.path("two.plan")));

  ASSERT_EQ(runCommand(pipecBinary + " compile " + dir.path("two.onnx") +
                           " --stages 1 --loss out -o " + dir.path("out.plan") +
                           " --hardware cpu --optimizer sgd 2>&1",
                       out),
            0)
      << out;
  EXPECT_NE(out.find("trains against the model's output 'out' (chosen by --loss)"),
            std::string::npos)
      << out;
  // x fixed by --data: L(W) = mean(x W) = sum_k c_k r_k / 32 with c the
  // column sums of x and r the row sums of W, so dL/dW_kj = c_k / 32 and one
  // SGD step (lr 1) lowers the loss by exactly lr * 8 * sum_k c_k^2 / 32^2.
  std::vector<float> x(32);
  std::vector<double> c(8, 0.0);
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 8; ++k) {
      x[i * 8 + k] = 0.1f * (i + 1) - 0.03f * k;
      c[k] += x[i * 8 + k];
    }
  std::string data = dir.path("data");
  ASSERT_FALSE(static_cast<bool>(sys::fs::create_directories(data)));
  ASSERT_FALSE(
      static_cast<bool>(rt::writeNpy(cpu::Tensor::fromValues<float>({4, 8}, x), data + "/x.npy")));
  ASSERT_FALSE(static_cast<bool>(
      rt::writeNpy(cpu::Tensor::fromValues<int64_t>({4}, {0, 1, 2, 3}), data + "/labels.npy")));
  ASSERT_EQ(runCommand(pipecBinary + " run " + dir.path("out.plan") + " --data " + data +
                           " --steps 2 --optimizer sgd --lr 1 --metrics " + dir.path("m.jsonl") +
                           " --quiet 2>&1",
                       out),
            0)
      << out;
  std::string metrics = readFile(dir.path("m.jsonl"));
  auto first = metrics.find("\"loss\": "), second = metrics.rfind("\"loss\": ");
  ASSERT_NE(first, second) << metrics;
  double l1 = std::stod(metrics.substr(first + 8)), l2 = std::stod(metrics.substr(second + 8));
  double drop = 0;
  for (double ck : c)
    drop += 1.0 * 8 * ck * ck / (32.0 * 32.0);
  EXPECT_NEAR(l1 - l2, drop, 1e-3 * drop) << metrics;
}

/// Sets \p t's float values.
void setValues(onnx::TensorProto &t, const std::vector<float> &v) {
  t.set_raw_data(std::string(reinterpret_cast<const char *>(v.data()), v.size() * sizeof(float)));
}

TEST(TrainableWeights, WhatAnExporterFoldedIsDataNotParameters) {
  // x [4, 8] (a batch of 4) through W; then what torch.onnx's default
  // optimisation folds into initializers: rotary tables cos and sin
  // [8, 8] (c^2 + s^2 = 1), a mask [1, 8] of 0 and the lowest float,
  // and zeros_like [4, 8] that ScatterElements fills per sample. Only W
  // trains; the loss depends on them all.
  GraphBuilder b;
  b.input("x", onnx::TensorProto::FLOAT, {4, 8});
  b.input("idx", onnx::TensorProto::INT64, {4, 8});
  b.weight("W", {8, 8});
  std::vector<float> c(64), sn(64), mask(8, 0.0f), zeros(32, 0.0f);
  for (int i = 0; i < 64; ++i) {
    c[i] = std::cos(0.1f * i);
    sn[i] = std::sin(0.1f * i);
  }
  setValues(b.weight("cos", {8, 8}), c);
  setValues(b.weight("sin", {8, 8}), sn);
  mask[7] = -3.4028235e38f;
  setValues(b.weight("mask", {1, 8}), mask);
  setValues(b.weight("zeros", {4, 8}), zeros);
  b.node("MatMul", {"x", "W"}, {"h"}, "mm");
  b.node("MatMul", {"h", "cos"}, {"hc"}, "rc");
  b.node("MatMul", {"h", "sin"}, {"hs"}, "rs");
  b.node("Add", {"hc", "hs"}, {"r"}, "rot");
  b.node("MatMul", {"r", "W"}, {"scores"}, "qk");
  b.node("Add", {"scores", "mask"}, {"masked"}, "causal");
  b.node("Softmax", {"masked"}, {"p"}, "softmax");
  b.node("ScatterElements", {"zeros", "idx", "p"}, {"gates"}, "scatter");
  b.node("ReduceMean", {"gates"}, {"out"}, "mean").add_attribute()->CopyFrom([] {
    onnx::AttributeProto a;
    a.set_name("keepdims");
    a.set_type(onnx::AttributeProto::INT);
    a.set_i(0);
    return a;
  }());
  b.output("out");
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  auto layers = groupLayers(*graph);
  ASSERT_TRUE(!!layers) << toString(layers.takeError());
  auto choice = chooseLoss(*graph, {});
  ASSERT_TRUE(!!choice && choice->spec) << (choice ? choice->reason : "");
  auto backward = differentiate(*graph, *layers, *choice->spec);
  ASSERT_TRUE(!!backward) << toString(backward.takeError());
  std::vector<std::string> trained;
  for (const auto &[weight, gradient] : backward->weightGrads)
    trained.push_back(weight);
  EXPECT_EQ(trained, std::vector<std::string>{"W"});
  EXPECT_EQ(backward->tableWeights, (std::set<std::string>{"cos", "sin"}));
}

} // namespace
} // namespace pipec::test
