//===- TensorParallelTest.cpp - --tp: split stages equal one rank -------===//
//
// Tensor parallelism (the shard-tensors pass and the ranks that run its
// pieces) against the one-rank full-batch step: the same loss, gradients
// and updated weights for the generated GPT (fused QKV, tied and untied
// head), Llama (grouped-query attention, rotary halves, SwiGLU) and BERT,
// under pipeline schedules, data parallelism and the sharded optimizer, as
// threads and as MPI processes. Also what the pass splits, and what it
// refuses.
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "driver/Compile.h"
#include "plan/PlanFile.h"
#include "runtime/exec/TensorShards.h"

#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

const std::vector<Config> &schedules() {
  static const std::vector<Config> setups = {
      split("1f1b", 1, 1, 2),
      split("1f1b", 2, 1, 4),
      split("interleaved", 2, 2, 4),
      split("zbv", 2, 2, 4),
  };
  return setups;
}

TEST_F(Equivalence, TensorParallelGptTied) { check(gpt(true), 8, schedules()); }

TEST_F(Equivalence, TensorParallelGptUntied) {
  check(gpt(false), 8, {split("1f1b", 1, 1, 1), split("1f1b", 2, 1, 4)});
}

TEST_F(Equivalence, TensorParallelLlamaGroupedQueryAttention) {
  check(llama(), 8, {split("1f1b", 1, 1, 2), split("zbv", 2, 2, 4)});
}

TEST_F(Equivalence, TensorParallelBertEncoder) {
  check(bert(), 8, {split("1f1b", 1, 1, 2), split("1f1b", 2, 1, 4)});
}

TEST_F(Equivalence, TensorParallelAdamWOverThreeSteps) {
  check(gpt(true), 4, {split("1f1b", 2, 1, 2)}, "adamw", 3, 1e-4);
}

// 8 ranks: 2 stages x 2 replicas x 2 tensor-parallel ranks, each replica's
// optimizer state sharded over the replicas.
TEST_F(Equivalence, TensorParallelTimesDataParallelShardedOptimizer) {
  check(gpt(true), 8, {split("1f1b", 2, 1, 2, 2, 2, true)}, "adamw", 2, 1e-4);
}

/// The plan of \p model at --tp \p tp (one stage), or the error.
llvm::Expected<plan::Plan> compileSplit(const std::string &model, int tp,
                                        const std::string &hardware) {
  CompileOptions options;
  options.stages = 1;
  options.microbatches = 1;
  options.globalBatch = 2;
  options.tensorParallel = tp;
  options.hardware = hardware;
  options.schedule = ScheduleKind::OneFOneB;
  return compileModel(model, options, PipelineOptions());
}

TEST_F(Equivalence, ShardTensorsSplitsByStructure) {
  auto plan = compileSplit(gpt(true), 2, "cpu");
  ASSERT_TRUE(static_cast<bool>(plan)) << llvm::toString(plan.takeError());
  EXPECT_EQ(plan->schedule().tensor_parallel(), 2);
  std::map<std::string, plan::WeightShard> shards;
  for (const plan::WeightShard &s : plan->weight_shards())
    shards[s.weight()] = s;
  // Per block: the fused QKV's columns in 3 blocks (its Q, K and V), their
  // bias, the output projection's rows; the MLP's up columns and bias, its
  // down rows; and the tied embedding's rows, which its head reads
  // transposed (the vocabulary's columns). The norms and the output
  // projections' biases stay whole.
  EXPECT_EQ(shards.size(), 6u * 6 + 1);
  EXPECT_EQ(shards["transformer.wte.weight"].axis(), 0);
  for (int b = 0; b < 6; ++b) {
    std::string block = formatv("transformer.h.{0}.", b).str();
    ASSERT_TRUE(shards.count(block + "attn.c_attn.weight")) << block;
    EXPECT_EQ(shards[block + "attn.c_attn.weight"].axis(), 1);
    EXPECT_EQ(shards[block + "attn.c_attn.weight"].stride(), 3);
    EXPECT_EQ(shards[block + "attn.c_attn.bias"].stride(), 3);
    EXPECT_EQ(shards[block + "attn.c_proj.weight"].axis(), 0);
    EXPECT_EQ(shards[block + "mlp.c_fc.weight"].axis(), 1);
    EXPECT_EQ(shards[block + "mlp.c_fc.weight"].stride(), 1);
    EXPECT_EQ(shards[block + "mlp.c_proj.weight"].axis(), 0);
    EXPECT_FALSE(shards.count(block + "attn.c_proj.bias"));
    EXPECT_FALSE(shards.count(block + "ln_1.weight"));
  }
  // Two sums a block forward, and two (the copies' gradients) backward, and
  // the head's copy's.
  int forward = 0, backward = 0;
  for (const plan::StageProgram &sp : plan->stage_programs()) {
    for (const onnx::NodeProto &n : sp.forward())
      forward += n.op_type() == "TpAllReduce";
    for (const onnx::NodeProto &n : sp.backward_input())
      backward += n.op_type() == "TpAllReduce";
  }
  EXPECT_EQ(forward, 12);
  EXPECT_EQ(backward, 13);
  // The model's parameters are counted whole; each block's sums cost their
  // ring's time on the intra-node link, the embedding's nothing.
  auto whole = compileSplit(gpt(true), 1, "cpu");
  ASSERT_TRUE(static_cast<bool>(whole)) << llvm::toString(whole.takeError());
  EXPECT_EQ(plan->model().params(), whole->model().params());
  for (const plan::LayerInfo &l : plan->layers())
    if (l.kind() == "block" || l.kind() == "embedding")
      EXPECT_GT(l.tp_comm_s(), 0) << l.name();
  for (const plan::LayerInfo &l : whole->layers())
    EXPECT_EQ(l.tp_comm_s(), 0) << l.name();
  // The plan holds each split weight whole, as the model file does.
  for (const onnx::TensorProto &w : plan->weights()) {
    if (w.name() == "transformer.h.0.attn.c_attn.weight")
      EXPECT_EQ(w.dims(1), 3 * 32);
  }
}

/// The nodes of \p plan's stage programs of op \p type.
int nodesOf(const plan::Plan &plan, llvm::StringRef type) {
  int n = 0;
  for (const plan::StageProgram &sp : plan.stage_programs())
    for (const auto *list : {&sp.forward(), &sp.backward_input(), &sp.backward_weight()})
      for (const onnx::NodeProto &node : *list)
        n += node.op_type() == type;
  return n;
}

TEST_F(Equivalence, ShardTensorsSplitsEveryFamily) {
  // Llama: Q, K, V, the output, gate, up and down of each of 4 blocks, the
  // untied head over the vocabulary, whose loss is then vocabulary-parallel,
  // and the embedding's rows, whose lookup is too.
  auto llamaPlan = compileSplit(llama(), 2, "cpu");
  ASSERT_TRUE(static_cast<bool>(llamaPlan)) << llvm::toString(llamaPlan.takeError());
  EXPECT_EQ(llamaPlan->weight_shards_size(), 7 * 4 + 2);
  EXPECT_EQ(nodesOf(*llamaPlan, "TpGather"), 1);
  // The model's logits beside its loss: a training step keeps no output but
  // the loss, so they are not gathered every microbatch.
  EXPECT_EQ(nodesOf(*llamaPlan, "TpAllGather"), 0);
  for (const plan::TensorRef &out : llamaPlan->outputs())
    EXPECT_NE(out.name(), "logits");
  EXPECT_EQ(nodesOf(*llamaPlan, "TpGatherGrad"), 1);
  EXPECT_EQ(nodesOf(*llamaPlan, "TpSoftmaxCrossEntropyLoss"), 1);
  EXPECT_EQ(nodesOf(*llamaPlan, "TpSoftmaxCrossEntropyLossGrad"), 1);
  auto bertPlan = compileSplit(bert(), 2, "cpu");
  ASSERT_TRUE(static_cast<bool>(bertPlan)) << llvm::toString(bertPlan.takeError());
  EXPECT_GE(bertPlan->weight_shards_size(), 4 * 4);
  // A tied head and its embedding split alike: the lookup takes the table's
  // rows, the head its transpose's columns, and the loss is
  // vocabulary-parallel.
  auto tied = compileSplit(gpt(true), 2, "cpu");
  ASSERT_TRUE(static_cast<bool>(tied)) << llvm::toString(tied.takeError());
  EXPECT_EQ(nodesOf(*tied, "TpSoftmaxCrossEntropyLoss"), 1);
  EXPECT_EQ(nodesOf(*tied, "TpGather"), 1);
  for (const std::string &w : tied->warnings())
    EXPECT_FALSE(llvm::StringRef(w).contains("stay")) << w;
}

// Inference: the split head's logits, gathered whole under the model's own
// output name, equal one rank's.
TEST_F(Equivalence, TensorParallelInferenceGathersTheLogits) {
  models::GeneratorOptions o(models::Family::Llama, 2, 32, 64, 8, 4);
  o.kvHeads = 2;
  std::string path = model("llama-infer", o);
  auto run = [&](int tp) {
    CompileOptions options;
    options.stages = 2;
    options.microbatches = 2;
    options.globalBatch = 4;
    options.tensorParallel = tp;
    options.hardware = "cpu";
    options.training = false;
    options.schedule = ScheduleKind::OneFOneB;
    auto plan = compileModel(path, options, PipelineOptions());
    EXPECT_TRUE(static_cast<bool>(plan)) << (plan ? "" : llvm::toString(plan.takeError()));
    rt::RunOptions ro;
    ro.steps = 1;
    ro.seed = 3;
    ro.keepOutputs = true;
    auto result = plan ? rt::runLocal(*plan, ro) : llvm::Expected<rt::RunResult>(plan.takeError());
    EXPECT_TRUE(static_cast<bool>(result)) << (result ? "" : llvm::toString(result.takeError()));
    return result ? std::move(*result) : rt::RunResult();
  };
  rt::RunResult one = run(1), two = run(2);
  ASSERT_EQ(one.outputs.size(), 1u);
  ASSERT_EQ(two.outputs.size(), 1u);
  const cpu::Tensor &a = one.outputs.begin()->second, &b = two.outputs.begin()->second;
  EXPECT_EQ(one.outputs.begin()->first, two.outputs.begin()->first);
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_LT(relativeError(b, a), 1e-5);
  EXPECT_GT(norm(a), 0);
}

TEST_F(Equivalence, ShardTensorsRefusesHeadsThatDoNotDivide) {
  models::GeneratorOptions o(models::Family::Gpt, 2, 48, 64, 8, 3);
  o.withLoss = true;
  auto plan = compileSplit(model("gpt-3-heads", o), 2, "cpu");
  ASSERT_FALSE(static_cast<bool>(plan));
  std::string error = llvm::toString(plan.takeError());
  EXPECT_NE(error.find("(Reshape): its 3 heads"), std::string::npos) << error;
  EXPECT_NE(error.find("do not divide over --tp 2"), std::string::npos) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
}

TEST_F(Equivalence, TensorParallelStaysInsideANode) {
  auto plan = compileSplit(gpt(true), 16, "h100");
  ASSERT_FALSE(static_cast<bool>(plan));
  std::string error = llvm::toString(plan.takeError());
  EXPECT_NE(error.find("--tp 16: larger than a node of h100 (8 devices)"), std::string::npos)
      << error;
}

TEST(TensorShards, PiecesOfBlocksJoinBack) {
  // W [2, 6], columns in 3 blocks of 2: piece 0 takes each block's first.
  std::vector<float> values;
  for (int i = 0; i < 12; ++i)
    values.push_back(static_cast<float>(i));
  cpu::Tensor whole = cpu::Tensor::fromValues<float>({2, 6}, values);
  plan::WeightShard shard;
  shard.set_axis(1);
  shard.set_parts(2);
  shard.set_stride(3);
  auto p0 = rt::shardPiece(whole, shard, 0), p1 = rt::shardPiece(whole, shard, 1);
  ASSERT_TRUE(p0 && p1);
  EXPECT_EQ(p0->values<float>().vec(), (std::vector<float>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(p1->values<float>().vec(), (std::vector<float>{1, 3, 5, 7, 9, 11}));
  auto joined = rt::joinShards({*p0, *p1}, shard);
  ASSERT_TRUE(static_cast<bool>(joined));
  EXPECT_EQ(joined->values<float>().vec(), values);
  shard.set_stride(4);
  auto bad = rt::shardPiece(whole, shard, 0);
  ASSERT_FALSE(static_cast<bool>(bad));
  EXPECT_NE(llvm::toString(bad.takeError()).find("does not cut its shape"), std::string::npos);
}

// MPI processes run the same arithmetic as threads; saved weights are the
// whole tensors, equal to one rank's.
TEST_F(RunCli, TensorParallelMpiProcessesMatchThreadsAndOneRank) {
  std::string out;
  std::string split = checkSplitRuns(
      gpt(true), "--stages 2 --microbatches 4 --batch 8 --tp 2 --schedule 1f1b", "tp");
  if (!haveMpirun())
    GTEST_SKIP() << "mpirun is not installed";
  // A wrong process count names the layout.
  EXPECT_NE(runCommand(mpirun(2) + pipecBin() + " run " + split + " --comm mpi --steps 1", out), 0);
  EXPECT_NE(out.find("2 pipeline ranks x 1 replicas x 2 tensor-parallel ranks = 4 ranks"),
            std::string::npos)
      << out;
}

} // namespace

// A checkpoint written at --tp 2 resumes at --tp 1, and one written at
// --tp 1 at --tp 2: the same weights as a run that never stopped (AdamW's
// moments travel with them; Adam's division amplifies rounding, as in
// AdamWOverThreeSteps).
TEST_F(RunCli, TensorParallelCheckpointsResumeAtAnotherDegree) {
  std::string model = gpt(true), out;
  std::string one = plan(model, "--stages 2 --microbatches 2 --batch 4", "ck-tp1");
  std::string two = plan(model, "--stages 2 --microbatches 2 --batch 4 --tp 2", "ck-tp2");
  std::string flags = " --optimizer adamw --seed 7 --quiet";
  ASSERT_EQ(runCommand(pipecBin() + " run " + one + " --steps 4" + flags + " --save-weights " +
                           dir->path("ck-ref.onnx"),
                       out),
            0)
      << out;
  for (auto [first, then, name] : {std::tuple{two, one, "ck-2to1"}, {one, two, "ck-1to2"}}) {
    std::string folder = dir->path(name);
    ASSERT_EQ(
        runCommand(pipecBin() + " run " + first + " --steps 2" + flags + " --checkpoint " + folder,
                   out),
        0)
        << out;
    ASSERT_EQ(runCommand(pipecBin() + " run " + then + " --steps 4" + flags + " --checkpoint " +
                             folder + " --resume --save-weights " +
                             dir->path(std::string(name) + ".onnx"),
                         out),
              0)
        << out;
    EXPECT_LT(worstWeightError(dir->path(std::string(name) + ".onnx"), dir->path("ck-ref.onnx")),
              1e-4)
        << name;
  }
  // Another pipeline of as many ranks (1 stage x --tp 2 where 2 stages
  // wrote it) is refused in one line naming the file at fault.
  std::string three = plan(model, "--stages 1 --microbatches 2 --batch 4 --tp 2", "ck-p1");
  EXPECT_EQ(runCommand(pipecBin() + " run " + three + " --steps 4" + flags + " --checkpoint " +
                           dir->path("ck-2to1") + " --resume",
                       out),
            1)
      << out;
  EXPECT_NE(out.find("ck-2to1/step-4/rank-"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
}
