//===- GenerateTest.cpp - `pipec generate` against transformers' generate -===//
//
// The fixtures (tools/fixtures/torch_generate.py) are a GPT-2 and a Llama
// with grouped-query attention, exported by torch.onnx with their KV cache
// as optimum exports a decoder, and the tokens transformers' generate()
// gives after 4 prompts: greedy, and greedy stopping at an EOS id. A Llama
// from onnxruntime-genai's model builder (tools/fixtures/genai_generate.py)
// is the other form of decoder a user brings.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "driver/PlanVerify.h"
#include "passes/LowerSchedule.h"
#include "plan/PlanFile.h"
#include "runtime/exec/Data.h"

#include "llvm/Support/FormatVariadic.h"

#include <tuple>

using namespace pipec;
using namespace pipec::test;

namespace {

const std::string fixtures = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/torch/generate/";

/// The EOS ids the fixtures' greedy_eos tokens stop at (MANIFEST.json).
int64_t eosOf(const std::string &model) { return model == "gpt2" ? 93 : 45; }

std::vector<int64_t> readIds(const std::string &path) {
  auto t = rt::readNpy(path);
  EXPECT_TRUE(bool(t)) << path;
  if (!t) {
    llvm::consumeError(t.takeError());
    return {};
  }
  return t->toInt64Vector();
}

class Generate : public ::testing::TestWithParam<std::string> {};

// Greedy decoding gives transformers' tokens exactly, on 1, 2 and 4 stages
// and with 1 and 4 groups in flight, with and without an EOS id, with and
// without a prefill pass.
TEST_P(Generate, GreedyEqualsTransformers) {
  std::string model = GetParam();
  TempDir dir;
  std::string plan = dir.path("g.plan"), tokens = dir.path("t.npy"), out;
  std::vector<int64_t> greedy = readIds(fixtures + model + ".greedy.npy");
  std::vector<int64_t> stopped = readIds(fixtures + model + ".greedy_eos.npy");
  ASSERT_EQ(greedy.size(), 4u * 32u);
  // Prompts fed a token per decode step, or (--prompt-length 6) in one
  // prefill pass.
  for (std::string prefill : {"", " --prompt-length 6"})
    for (int stages : {1, 2, 4})
      for (int groups : {1, 4}) {
        SCOPED_TRACE(llvm::formatv("{0} stages, {1} groups{2}", stages, groups, prefill).str());
        ASSERT_EQ(
            runCommand(llvm::formatv("{0} compile {1}{2}.onnx --mode generate --max-length "
                                     "40 --stages {3} --microbatches {4} --slots 4 "
                                     "--hardware cpu -o {5}{6}",
                                     pipecBinary, fixtures, model, stages, groups, plan, prefill),
                       out),
            0)
            << out;
        // The decode step's attention reads the cache where it lies: the
        // Concat of the past and this step's keys and values, the keys'
        // transpose and scale, and Llama's repeat of its key and value
        // heads are all in each fused attention (runtime/exec/Fusion.h).
        if (stages == 1 && groups == 1 && prefill.empty()) {
          ASSERT_EQ(runCommand(llvm::formatv("{0} compile {1}{2}.onnx --mode generate "
                                             "--max-length 40 --slots 4 --hardware cpu -o {3} "
                                             "--print-after fuse",
                                             pipecBinary, fixtures, model, dir.path("p.plan")),
                               out),
                    0)
              << out;
          std::string chain = model == "llama" ? "(Concat Concat Unsqueeze Expand Reshape "
                                                 "Unsqueeze Expand Reshape Reshape Transpose "
                                                 "Reshape Mul MatMul"
                                               : "(Concat Concat Reshape Transpose Reshape Mul "
                                                 "MatMul";
          EXPECT_NE(out.find("SoftmaxAttention -> "), std::string::npos) << out;
          EXPECT_NE(out.find(chain), std::string::npos) << out;
        }
        std::string generate = pipecBinary + " generate " + plan + " --prompts " + fixtures +
                               model + ".prompts.npy --max-new-tokens 32 -o " + tokens;
        ASSERT_EQ(runCommand(generate, out), 0) << out;
        EXPECT_NE(out.find(llvm::formatv("generated 128 token(s) after 4 prompt(s) on {0} "
                                         "rank(s), {1} group(s) of {2}",
                                         stages, groups, 4 / groups)
                               .str()),
                  std::string::npos)
            << out;
        EXPECT_EQ(readIds(tokens), greedy);
        ASSERT_EQ(runCommand(generate + " --eos " + std::to_string(eosOf(model)), out), 0) << out;
        EXPECT_EQ(readIds(tokens), stopped);
      }
}

// More prompts than slots: a finished row's slot takes the next prompt (with
// an EOS id, at different steps per row); sampling with a seed gives the
// same tokens on any stage count, and another seed others.
TEST_P(Generate, RefilledSlotsAndSeededSampling) {
  std::string model = GetParam();
  TempDir dir;
  std::string plan = dir.path("g.plan"), tokens = dir.path("t.npy"), out;
  std::vector<int64_t> greedy = readIds(fixtures + model + ".greedy.npy");
  std::vector<int64_t> first, other;
  for (int stages : {1, 2, 4}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    // The first prompts of each slot in a prefill pass; those that take a
    // freed slot a token per step.
    std::string prefill = stages == 2 ? " --prompt-length 6" : "";
    ASSERT_EQ(runCommand(llvm::formatv("{0} compile {1}{2}.onnx --mode generate --max-length 40 "
                                       "--stages {3} --microbatches 2 --slots 2 --hardware cpu "
                                       "-o {4}{5}",
                                       pipecBinary, fixtures, model, stages, plan, prefill),
                         out),
              0)
        << out;
    std::string generate = pipecBinary + " generate " + plan + " --prompts " + fixtures + model +
                           ".prompts.npy -o " + tokens;
    ASSERT_EQ(runCommand(generate + " --max-new-tokens 32", out), 0) << out;
    EXPECT_EQ(readIds(tokens), greedy);
    ASSERT_EQ(
        runCommand(generate + " --max-new-tokens 32 --eos " + std::to_string(eosOf(model)), out), 0)
        << out;
    EXPECT_EQ(readIds(tokens), readIds(fixtures + model + ".greedy_eos.npy"));
    if (stages == 2) {
      // The measured timeline: each rank's passes and its waits.
      std::string trace = dir.path("trace.json");
      ASSERT_EQ(runCommand(generate + " --max-new-tokens 4 --trace " + trace, out), 0) << out;
      std::string text = readFile(trace);
      for (const char *event : {"prefill g0", "prefill g1", "decode g0", "decode g1", "recv g0"})
        EXPECT_NE(text.find(event), std::string::npos) << event;
    }
    std::string sample = generate + " --max-new-tokens 20 --temperature 0.8 --top-k 20 --top-p 0.9";
    ASSERT_EQ(runCommand(sample + " --seed 3", out), 0) << out;
    std::vector<int64_t> drawn = readIds(tokens);
    ASSERT_EQ(drawn.size(), 80u);
    for (int64_t id : drawn)
      EXPECT_TRUE(id >= 0 && id < 100) << id;
    if (first.empty())
      first = drawn;
    EXPECT_EQ(drawn, first);
    ASSERT_EQ(runCommand(sample + " --seed 4", out), 0) << out;
    if (other.empty())
      other = readIds(tokens);
    EXPECT_EQ(readIds(tokens), other);
  }
  EXPECT_NE(first, other);
  // Sampled tokens are not the greedy ones.
  std::vector<int64_t> greedyHead;
  for (int row = 0; row < 4; ++row)
    greedyHead.insert(greedyHead.end(), greedy.begin() + row * 32, greedy.begin() + row * 32 + 20);
  EXPECT_NE(first, greedyHead);
}

// One process per rank under mpirun: the same tokens, with and without the
// prefill pass.
TEST_P(Generate, MpiProcesses) {
  std::string out;
  if (runCommand("mpirun --version", out) != 0)
    GTEST_SKIP() << "mpirun is not installed";
  std::string model = GetParam();
  TempDir dir;
  std::string plan = dir.path("g.plan"), tokens = dir.path("t.npy");
  for (std::string prefill : {"", " --prompt-length 6"}) {
    SCOPED_TRACE(prefill);
    ASSERT_EQ(runCommand(pipecBinary + " compile " + fixtures + model +
                             ".onnx --mode generate --max-length 40 --stages 2 --microbatches 2 "
                             "--slots 4 --hardware cpu -o " +
                             plan + prefill,
                         out),
              0)
        << out;
    ASSERT_EQ(runCommand("env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout "
                         "120 mpirun -np 2 --oversubscribe " +
                             pipecBinary + " generate " + plan + " --prompts " + fixtures + model +
                             ".prompts.npy --max-new-tokens 32 -o " + tokens,
                         out),
              0)
        << out;
    EXPECT_NE(out.find("generated 128 token(s) after 4 prompt(s) on 2 rank(s)"), std::string::npos)
        << out;
    EXPECT_EQ(readIds(tokens), readIds(fixtures + model + ".greedy.npy"));
  }
}

INSTANTIATE_TEST_SUITE_P(fixtures, Generate, ::testing::Values("gpt2", "llama"));

// onnxruntime-genai's model form (tools/fixtures/genai_generate.py): the
// builder's Llama, its attention com.microsoft GroupQueryAttention with the
// cache a buffer each row fills at its length, and no position ids. Greedy
// decoding gives transformers' tokens (which onnxruntime-genai's own search
// gives too) on 1, 2 and 4 stages, 1 and 4 groups, with and without the
// prefill, and with 2 slots refilled.
TEST(GenerateGenai, GreedyEqualsTransformers) {
  const std::string genai = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/genai/";
  TempDir dir;
  std::string plan = dir.path("g.plan"), tokens = dir.path("t.npy"), out;
  std::vector<int64_t> greedy = readIds(genai + "llama.greedy.npy");
  ASSERT_EQ(greedy.size(), 4u * 32u);
  struct Layout {
    int stages, groups, slots;
    const char *prefill;
  };
  for (Layout l : {Layout{1, 1, 4, ""}, Layout{2, 4, 4, ""}, Layout{4, 1, 4, " --prompt-length 6"},
                   Layout{2, 2, 4, " --prompt-length 6"}, Layout{2, 2, 2, " --prompt-length 6"}}) {
    SCOPED_TRACE(llvm::formatv("{0} stages, {1} groups, {2} slots{3}", l.stages, l.groups, l.slots,
                               l.prefill)
                     .str());
    ASSERT_EQ(
        runCommand(llvm::formatv("{0} compile {1}llama.onnx --mode generate --max-length 40 "
                                 "--stages {2} --microbatches {3} --slots {4} --hardware "
                                 "cpu -o {5}{6}",
                                 pipecBinary, genai, l.stages, l.groups, l.slots, plan, l.prefill),
                   out),
        0)
        << out;
    ASSERT_EQ(runCommand(pipecBinary + " generate " + plan + " --prompts " + genai +
                             "llama.prompts.npy --max-new-tokens 32 -o " + tokens,
                         out),
              0)
        << out;
    EXPECT_EQ(readIds(tokens), greedy);
  }
  ASSERT_EQ(runCommand(pipecBinary + " report " + plan, out), 0) << out;
  EXPECT_NE(out.find("positions from the mask"), std::string::npos) << out;
  EXPECT_NE(out.find("written at each row's position (GroupQueryAttention)"), std::string::npos)
      << out;
}

// The report counts each rank's cache; bad input gets one line each.
TEST(GenerateCli, ReportAndBadInput) {
  TempDir dir;
  std::string plan = dir.path("g.plan"), out;
  std::string model = fixtures + "gpt2.onnx";
  ASSERT_EQ(runCommand(pipecBinary + " compile " + model +
                           " --mode generate --max-length 40 --stages 2 --hardware cpu -o " + plan,
                       out),
            0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " report " + plan, out), 0) << out;
  // Two layers of [2, 4, 39, 8] float keys and values per rank, 1 group:
  // the two CPU ranks share this machine's cores, so they take turns on one
  // group of both slots (one per stage by default).
  EXPECT_NE(out.find("rank 0: KV cache 39.00 KiB (4 tensors x 1 group), written in place"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("generation: rows of 40 tokens, 2 slot(s) in 1 group(s) of 2"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("groups: the 2 stages are ranks of this machine's CPU and share its cores"),
            std::string::npos)
      << out;
  // Devices of their own keep the pipe full: a group per stage, the most of
  // those that divide the slots.
  for (auto [slots, groups, why] :
       {std::tuple{4, 4, "one per stage, which keeps the pipe full"},
        std::tuple{6, 3, "the most up to one per stage that divide the 6 slots"}}) {
    std::string gpus = dir.path("h.plan");
    ASSERT_EQ(runCommand(llvm::formatv("{0} compile {1} --mode generate --max-length 40 --stages "
                                       "4 --slots {2} --hardware h100 --timing-only -o {3}",
                                       pipecBinary, model, slots, gpus),
                         out),
              0)
        << out;
    ASSERT_EQ(runCommand(pipecBinary + " report " + gpus, out), 0) << out;
    EXPECT_NE(out.find(llvm::formatv("{0} slot(s) in {1} group(s)", slots, groups).str()),
              std::string::npos)
        << out;
    EXPECT_NE(out.find(std::string("groups: ") + why), std::string::npos) << out;
  }
  // `pipec generate PLAN --prompts ARGS` exits 2, saying \p why.
  auto refused = [&](const std::string &args, const std::string &why) {
    EXPECT_EQ(runCommand(pipecBinary + " generate " + plan + " --prompts " + args, out), 2)
        << args << "\n"
        << out;
    EXPECT_NE(out.find(why), std::string::npos) << args << "\n" << out;
  };
  std::string prompts = fixtures + "gpt2.prompts.npy";
  // 6 prompt tokens and 35 new need 41 positions.
  refused(prompts + " --max-new-tokens 35",
          "pipec: error: --prompts: prompts of 6 tokens and 35 new need 41 positions; the plan "
          "holds 40 (--max-length)");
  refused(fixtures + "gpt2.greedy.npy --max-new-tokens 2 --eos 100",
          "--eos 100: outside the vocabulary of 100");
  std::string bad = dir.path("bad.npy");
  ASSERT_FALSE(bool(rt::writeNpy(
      cpu::Tensor::fromValues<int64_t>({2, 3}, {5, 6, 7, 8, 100, 9}, DType::I64), bad)));
  refused(bad, "--prompts: prompt 1 token 1 is 100, outside the vocabulary of 100");
  EXPECT_EQ(runCommand(pipecBinary + " generate " + plan + " --prompts " + prompts +
                           " --greedy --temperature 0.5",
                       out),
            2)
      << out;
  // A model without a cache, and a plan not compiled for generation.
  std::string plain = dir.path("plain.onnx");
  ASSERT_EQ(
      runCommand(pipecBinary + " model gpt --layers 2 --hidden 32 --vocab 64 --seq 8 -o " + plain,
                 out),
      0)
      << out;
  EXPECT_EQ(runCommand(pipecBinary + " compile " + plain + " --mode generate --max-length 16 -o " +
                           dir.path("p.plan"),
                       out),
            1)
      << out;
  EXPECT_NE(out.find(plain + ": cannot generate: the model has no KV cache"), std::string::npos)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " compile " + plain +
                           " --mode infer --stages 1 --microbatches 1 -o " + dir.path("i.plan"),
                       out),
            0)
      << out;
  EXPECT_EQ(
      runCommand(pipecBinary + " generate " + dir.path("i.plan") + " --prompts " + prompts, out), 1)
      << out;
  EXPECT_NE(out.find("the plan was not compiled for generation"), std::string::npos) << out;
  EXPECT_EQ(runCommand(pipecBinary + " compile " + model + " --mode generate -o " + plan, out), 2)
      << out;
  EXPECT_NE(out.find("--mode generate needs --max-length L"), std::string::npos) << out;
}

/// \p stream, one formatInstruction line per instruction.
std::vector<std::string>
lines(const google::protobuf::RepeatedPtrField<plan::Instruction> &stream) {
  std::vector<std::string> out;
  for (const plan::Instruction &i : stream)
    out.push_back(formatInstruction(i));
  return out;
}

// The token loop is in the plan: each rank's start, round and stop streams,
// which verify-program proves and the plan reader checks.
TEST(GenerateCli, PlanHoldsTheLoop) {
  TempDir dir;
  std::string path = dir.path("g.plan"), out;
  ASSERT_EQ(runCommand(pipecBinary + " compile " + fixtures +
                           "gpt2.onnx --mode generate --max-length 40 --stages 2 --microbatches "
                           "2 --slots 4 --prompt-length 6 --hardware cpu -o " +
                           path,
                       out),
            0)
      << out;
  auto plan = readPlan(path);
  ASSERT_TRUE(bool(plan)) << llvm::toString(plan.takeError());
  ASSERT_FALSE(bool(verifyPlanStreams(*plan)));
  const plan::RankProgram &first = plan->programs(0), &last = plan->programs(1);
  // What the first stage's forward sends the second (GPT-2's hidden state
  // and its attention mask).
  std::vector<std::string> hidden;
  for (const plan::Instruction &i : first.instructions())
    if (i.op() == plan::Instruction::SEND && i.microbatch() == 0)
      hidden.push_back(i.tensor().name());
  ASSERT_EQ(hidden.size(), 2u);
  std::vector<std::string> round, last0, last1;
  for (int g : {0, 1}) {
    std::string mb = llvm::formatv("mb{0}", g).str();
    std::vector<std::string> block = {
        "RECV act s1 " + mb + " <- 1 pipec.picks", "SCHEDULE s0 " + mb, "LOAD inputs s0 " + mb,
        "FORWARD s0 " + mb + " buf0", "SEND act s0 " + mb + " -> 1 pipec.control"};
    std::vector<std::string> theirs = {"RECV act s0 " + mb + " <- 0 pipec.control"};
    for (const std::string &h : hidden) {
      block.push_back("SEND act s0 " + mb + " -> 1 " + h);
      theirs.push_back("RECV act s0 " + mb + " <- 0 " + h);
    }
    for (const std::string &step : {"LOAD inputs s1 " + mb, "FORWARD s1 " + mb + " buf0",
                                    "PICK s1 " + mb, "SEND act s1 " + mb + " -> 0 pipec.picks"})
      theirs.push_back(step);
    round.insert(round.end(), block.begin(), block.end());
    last0.insert(last0.end(), theirs.begin(), theirs.end());
    last1.push_back("RECV act s0 " + mb + " <- 0 pipec.control");
  }
  EXPECT_EQ(lines(first.generation().round()), round);
  // The start has no picks to wait for; the last rank picks and sends them,
  // and in the stop passes the control alone.
  std::vector<std::string> start = lines(first.generation().start());
  EXPECT_EQ(std::vector<std::string>(start.begin(), start.begin() + start.size() / 2),
            std::vector<std::string>(round.begin() + 1, round.begin() + round.size() / 2));
  EXPECT_EQ(lines(last.generation().round()), last0);
  EXPECT_EQ(lines(last.generation().stop()), last1);
  // The prefill's start sends its own hidden state, [rows, 6, width].
  const plan::RankProgram &prefill = plan->generation().prefill().programs(0);
  EXPECT_EQ(prefill.generation().start(5).tensor().shape(1), 6);

  // A first rank whose start waits for picks, which no pass has made yet.
  plan::Plan waits = *plan;
  auto &early = *waits.mutable_programs(0)->mutable_generation()->mutable_start();
  *early.Add() = first.generation().round(0);
  for (int i = early.size() - 1; i > 0; --i)
    early.SwapElements(i, i - 1);
  llvm::Error err = verifyPlanStreams(waits);
  ASSERT_TRUE(bool(err));
  std::string text = llvm::toString(std::move(err));
  EXPECT_NE(text.find("verify-program: rank 0 step 0: RECV act s1 mb0 <- 1 pipec.picks has no "
                      "matching SEND on rank 1 (the generation streams)"),
            std::string::npos)
      << text;
  // A round whose last rank sends no picks.
  plan::Plan unmatched = *plan;
  unmatched.mutable_programs(1)->mutable_generation()->mutable_round()->DeleteSubrange(
      hidden.size() + 4, 1);
  err = verifyPlanStreams(unmatched);
  ASSERT_TRUE(bool(err));
  text = llvm::toString(std::move(err));
  EXPECT_NE(text.find("pipec.picks has no matching SEND on rank 1 (the generation streams)"),
            std::string::npos)
      << text;
  // The plan reader takes only the loop's own steps, naming the stream.
  plan::Plan reduced = *plan;
  reduced.mutable_programs(0)->mutable_generation()->mutable_round(1)->set_op(
      plan::Instruction::ALLREDUCE);
  err = checkPlan(reduced);
  ASSERT_TRUE(bool(err));
  EXPECT_NE(llvm::toString(std::move(err))
                .find("rank 0 generation.round instruction 1: ALLREDUCE is not a step of the "
                      "token loop"),
            std::string::npos);
}

} // namespace
