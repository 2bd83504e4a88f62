//===- SequenceParallelTest.cpp - --sequence-parallel equals one rank ----===//
//
// Sequence parallelism (passes/SequenceParallel.h: norms and residuals split
// on the tokens over the tensor-parallel ranks) against the one-rank
// full-batch step: the same loss, gradients and updated weights for the
// generated GPT (tied head, position embeddings, Conv1D's 2-D rows), Llama
// (RMSNorm, grouped-query attention) and BERT (LayerNorm, a pooler that reads
// one token), under pipeline schedules, data parallelism and the sharded
// optimizer, as threads and as MPI processes. Also what the pass rewrites,
// and what it refuses.
//
//===----------------------------------------------------------------------===//
#include "Equivalence.h"

#include "driver/Compile.h"

#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

/// \p schedule over \p stages ranks of 2 tensor-parallel ranks, the rest
/// split on the sequence.
Config sequence(const std::string &schedule, int stages, int virtualStages, int microbatches,
                int dp = 1, bool shardOptimizer = false) {
  return split(schedule, stages, virtualStages, microbatches, 2, dp, shardOptimizer, true);
}

TEST_F(Equivalence, SequenceParallelGptTied) {
  check(gpt(true), 8,
        {sequence("1f1b", 1, 1, 2), sequence("1f1b", 2, 1, 4), sequence("interleaved", 2, 2, 4),
         sequence("zbv", 2, 2, 4)});
}

TEST_F(Equivalence, SequenceParallelLlama) {
  check(llama(), 8, {sequence("1f1b", 1, 1, 2), sequence("zbv", 2, 2, 4)});
}

TEST_F(Equivalence, SequenceParallelBertPooler) {
  check(bert(), 8, {sequence("1f1b", 1, 1, 2), sequence("1f1b", 2, 1, 4)});
}

TEST_F(Equivalence, SequenceParallelAdamWOverThreeSteps) {
  check(gpt(true), 4, {sequence("1f1b", 2, 1, 2)}, "adamw", 3, 1e-4);
}

// 8 ranks: 2 stages x 2 replicas x 2 tensor-parallel ranks.
TEST_F(Equivalence, SequenceParallelTimesDataParallelShardedOptimizer) {
  check(llama(), 8, {sequence("1f1b", 2, 1, 2, 2, true)}, "adamw", 2, 1e-4);
}

/// The nodes of \p plan's stage programs of op \p type, per program list.
std::map<std::string, int> nodesOf(const plan::Plan &plan, llvm::StringRef type) {
  std::map<std::string, int> n;
  for (const plan::StageProgram &sp : plan.stage_programs()) {
    for (const onnx::NodeProto &node : sp.forward())
      n["forward"] += node.op_type() == type;
    for (const onnx::NodeProto &node : sp.backward_input())
      n["backward"] += node.op_type() == type;
  }
  return n;
}

TEST_F(Equivalence, SequenceParallelRewritesTheSums) {
  Config c = sequence("1f1b", 2, 1, 2);
  plan::Plan p = compileFor(llama(), c, 4);
  EXPECT_TRUE(p.schedule().sequence_parallel());
  // Each of the 4 blocks: two sums, now reduce-scatters; two products'
  // inputs and the head's, now all-gathers; the lookup's sum is cut to each
  // rank's tokens. Their gradients run the other way.
  EXPECT_EQ(nodesOf(p, "TpAllReduce")["forward"], 0);
  EXPECT_EQ(nodesOf(p, "TpReduceScatter")["forward"], 8);
  EXPECT_EQ(nodesOf(p, "TpGatherCopy")["forward"], 9);
  EXPECT_EQ(nodesOf(p, "TpScatter")["forward"], 1);
  EXPECT_EQ(nodesOf(p, "TpReduceScatter")["backward"], 9);
  EXPECT_EQ(nodesOf(p, "TpAllGather")["backward"], 9);
  // The norms' scales train on each rank's tokens: summed over the ranks.
  EXPECT_EQ(p.sequence_grads_size(), 2 * 4 + 1);
  for (const std::string &w : p.sequence_grads())
    EXPECT_NE(w.find("norm"), std::string::npos) << w;
  // What crosses the stages is each rank's half of the sequence.
  plan::Plan whole = compileFor(llama(), Config{"1f1b", 2, 1, 2, 1, false, 2}, 4);
  auto firstSend = [](const plan::Plan &plan) {
    for (const plan::Instruction &i : plan.programs(0).instructions())
      if (i.op() == plan::Instruction::SEND && i.tensor().shape_size() == 3)
        return i.tensor();
    return plan::TensorRef();
  };
  plan::TensorRef piece = firstSend(p), all = firstSend(whole);
  ASSERT_EQ(piece.shape_size(), 3) << piece.name();
  ASSERT_EQ(all.shape_size(), 3) << all.name();
  EXPECT_EQ(piece.shape(1) * 2, all.shape(1));
}

TEST_F(Equivalence, SequenceParallelRefusals) {
  // Sequences of 5 tokens do not divide over 2 ranks.
  models::GeneratorOptions o(models::Family::Llama, 2, 32, 64, 5, 4);
  o.withLoss = true;
  std::string path = model("llama-seq5", o);
  Config c = sequence("1f1b", 1, 1, 1);
  std::string error;
  compileFor(path, c, 2, Recompute::None, &error);
  EXPECT_NE(error.find("its sequences of 5 tokens do not divide over --tp 2 "
                       "(--sequence-parallel)"),
            std::string::npos)
      << error;
  Config alone = sequence("1f1b", 1, 1, 1);
  alone.tp = 1;
  error.clear();
  compileFor(path, alone, 2, Recompute::None, &error);
  EXPECT_NE(error.find("--sequence-parallel: splits the sequence over the tensor-parallel ranks; "
                       "give --tp 2 or more"),
            std::string::npos)
      << error;
}

// MPI processes run the same arithmetic as threads, and save the weights of
// one rank.
TEST_F(RunCli, SequenceParallelMpiProcessesMatchThreadsAndOneRank) {
  checkSplitRuns(llama(), "--stages 2 --microbatches 4 --batch 8 --tp 2 --sequence-parallel", "sp");
}

} // namespace
