//===- HostileInputTest.cpp - Careless or hostile input through the CLI -===//
//
// The cases of a careless or hostile user: bad flag values, hand-edited
// plans, files that are not what they claim, outputs over inputs. Each ends
// in one "pipec: error:" line naming the fault and exit 2 (a malformed flag
// or value) or 1 (bad input or a failed step), or in the correct behaviour;
// never a signal, a hang or a silently different number.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"
#include "support/InputFile.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Regex.h"

#include <fstream>
#include <sys/stat.h>

using namespace pipec::test;

namespace {

/// A small GPT with a loss, compiled for 2 CPU ranks as a text plan.
class Hostile : public SmallGptPlanTest {
protected:
  Hostile() : SmallGptPlanTest("--microbatches 4 --emit text") {}
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(SmallGptPlanTest::SetUp());
    planText = readFile(plan);
  }

  /// Runs \p args; expects exit \p code and, when it fails, one line that
  /// starts "pipec: error: " and contains \p needle.
  void expectError(const std::string &args, int code, const std::string &needle) {
    std::string out;
    EXPECT_EQ(runCommand(pipecBinary + " " + args, out), code) << args << "\n" << out;
    EXPECT_EQ(out.rfind("pipec: error: ", 0), 0u) << args << "\n" << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << args << "\n" << out;
    EXPECT_NE(out.find(needle), std::string::npos) << args << "\n" << out;
  }

  /// The plan's text with \p pattern (a regular expression) replaced by
  /// \p with.
  std::string editedPlanText(const std::string &pattern, const std::string &with) {
    llvm::Regex re(pattern, llvm::Regex::Newline);
    EXPECT_TRUE(re.match(planText)) << pattern;
    return re.sub(with, planText);
  }

  /// The plan with \p pattern (a regular expression) replaced by \p with,
  /// sealed again and written to a new file; returns its path. (An edit
  /// left unsealed is refused by its seal: PlanSealRefusesEdits.)
  std::string editedPlan(const std::string &name, const std::string &pattern,
                         const std::string &with) {
    std::string text = planText;
    llvm::Regex re(pattern, llvm::Regex::Newline);
    EXPECT_TRUE(re.match(text)) << pattern;
    text = resealedTextPlan(re.sub(with, text));
    std::string path = dir.path(name);
    std::ofstream(path) << text;
    return path;
  }

  /// A 2-layer MLP with an MSE loss, compiled with \p flags into \p mlpPlan.
  void compileMlp(const std::string &flags, std::string &mlpPlan) {
    std::string mlp = dir.path("m.onnx"), out;
    mlpPlan = dir.path("m.plan");
    ASSERT_EQ(
        runCommand(pipecBinary + " model mlp --layers 2 --hidden 16 --vocab 8 --loss -o " + mlp,
                   out),
        0)
        << out;
    ASSERT_EQ(runCommand(pipecBinary + " compile " + mlp + " -o " + mlpPlan + " " + flags, out), 0)
        << out;
  }

  std::string planText;
};

TEST_F(Hostile, MalformedFlagValuesExitTwo) {
  const std::pair<std::string, std::string> cases[] = {
      {"run PLAN --lr -1", "--lr -1: must be a finite number >= 0"},
      {"run PLAN --lr nan", "--lr nan: must be"},
      {"run PLAN --lr inf", "--lr inf: must be"},
      {"run PLAN --momentum 2", "--momentum 2: must be in [0, 1)"},
      {"run PLAN --momentum 1", "--momentum 1: must be in [0, 1)"},
      {"run PLAN --weight-decay -1", "--weight-decay -1: must be"},
      {"run PLAN --lr 1e300", "--lr 1e+300: must be a finite number >= 0 that float32 holds"},
      {"run PLAN --weight-decay 1e300", "--weight-decay 1e+300: must be a finite number >= 0 that "
                                        "float32 holds"},
      {"run PLAN --lr 0.5 --weight-decay 4",
       "--lr 0.5 with --weight-decay 4: decay multiplies each weight by 1 - lr x weight-decay = "
       "-1 per step"},
      {"run PLAN --clip-grad-norm nan", "--clip-grad-norm nan"},
      {"run PLAN --timeout 0", "--timeout 0"},
      {"run PLAN --steps 0", "--steps 0: must be at least 1"},
      {"run PLAN --warmup -2", "--warmup -2"},
      {"run PLAN --lr abc", "'abc' value invalid"},
      {"run PLAN --optimizer lion", "--optimizer lion: expected sgd, momentum or adamw"},
      {"run PLAN --comm carrier-pigeon", "--comm carrier-pigeon: expected local, mpi or nccl"},
      {"run PLAN --no-such-flag", "Unknown command line argument '--no-such-flag'"},
      {"compile MODEL -o X --microbatches 0", "--microbatches 0: must be at least 1"},
      {"compile MODEL -o X --microbatches -1", "--microbatches -1: must be at least 1"},
      {"compile MODEL -o X --batch 0", "--batch 0: must be at least 1"},
      {"compile MODEL -o X --batch -1", "--batch -1: must be at least 1"},
      {"compile MODEL -o X --memory-limit 1e30", "--memory-limit 1e30: more than 9.2e18 bytes"},
      {"compile MODEL -o X --memory-limit -5GB", "--memory-limit -5GB: expected a size"},
      {"compile MODEL -o X --schedule zigzag", "--schedule zigzag: expected gpipe"},
      {"compile MODEL -o X --optimizer lion", "--optimizer lion: expected"},
      {"compile MODEL -o X --stages 0", "--stages must be at least 1"},
      {"compile MODEL -o X --emit yaml", "--emit yaml: expected"},
      {"compile MODEL -o MODEL", "-o " + model + ": is an input of this command"},
      {"report PLAN -o PLAN", "is an input of this command"},
      {"simulate PLAN --width 5", "--width 5: must be at least 20 columns"},
      {"inspect MODEL --format yaml", "--format yaml: expected text or json"},
      {"model transformerxl -o X", "transformerxl"},
  };
  for (const auto &[args, needle] : cases) {
    std::string line = args;
    for (auto [from, to] : {std::pair<std::string, std::string>{"PLAN", plan},
                            {"MODEL", model},
                            {" X", " " + dir.path("x.out")}})
      for (size_t at; (at = line.find(from)) != std::string::npos;)
        line.replace(at, from.size(), to);
    expectError(line, 2, needle);
  }
  // Nothing was written over the model or anywhere else.
  EXPECT_FALSE(fileExists(dir.path("x.out")));
  EXPECT_EQ(readFile(plan), planText);
  std::string out;
  EXPECT_EQ(runCommand(pipecBinary + " inspect " + model, out), 0) << out;
}

TEST_F(Hostile, NonUtf8PathIsRefusedBeforeWriting) {
  std::string bad = dir.path("plan-\xff\xfe.plan");
  expectError("compile " + model + " -o '" + bad + "'", 2, "argument 4 is not valid UTF-8");
  EXPECT_FALSE(fileExists(bad));
}

/// The initializers of an ONNX file by name, as raw bytes.
std::map<std::string, std::string> weightBytes(const std::string &path) {
  onnx::ModelProto m;
  std::string bytes = readFile(path);
  EXPECT_TRUE(m.ParseFromString(bytes)) << path;
  std::map<std::string, std::string> out;
  for (const onnx::TensorProto &t : m.graph().initializer())
    out[t.name()] = t.raw_data();
  return out;
}

TEST_F(Hostile, LearningRateZeroLeavesEveryWeightAsItWas) {
  std::string out;
  auto before = weightBytes(model);
  ASSERT_GT(before.size(), 10u);
  for (const char *optimizer : {"sgd", "momentum", "adamw"}) {
    std::string saved = dir.path(std::string("zero-") + optimizer + ".onnx");
    ASSERT_EQ(runCommand(pipecBinary + " run " + plan +
                             " --quiet --steps 2 --lr 0 --weight-decay 0.1 " + "--optimizer " +
                             optimizer + " --save-weights " + saved,
                         out),
              0)
        << out;
    EXPECT_TRUE(weightBytes(saved) == before) << optimizer << ": --lr 0 moved a weight";
  }
  // The same run with a rate does move them: the comparison can fail.
  std::string moved = dir.path("moved.onnx");
  ASSERT_EQ(
      runCommand(pipecBinary + " run " + plan + " --quiet --lr 0.1 --save-weights " + moved, out),
      0)
      << out;
  auto after = weightBytes(moved);
  EXPECT_NE(after["lm_head.weight"], before["lm_head.weight"]);
}

TEST_F(Hostile, EditedPlansAreRefusedByEveryReader) {
  struct Case {
    const char *name, *pattern, *with, *needle;
  };
  const Case cases[] = {
      {"negative-stages", "^  stages: 2$", "  stages: -1",
       "schedule.stages -1: must be at least 1"},
      {"zero-microbatches", "^  microbatches: 4$", "  microbatches: 0",
       "schedule.microbatches 0: must be at least 1"},
      {"huge-microbatches", "^  microbatches: 4$", "  microbatches: 2000000000",
       "schedule.microbatches 2000000000: more than"},
      {"fewer-microbatches", "^  microbatches: 4$\n(.*\n)*  global_batch: 4$",
       "  microbatches: 2\n  mode: \"train\"\n  data_parallel: 1\n  global_batch: 2",
       "microbatch 2 of 2"},
      {"data-parallel", "^  data_parallel: 1$", "  data_parallel: 100000",
       "schedule.data_parallel 100000: more than 32768"},
      {"global-batch", "^  data_parallel: 1$", "  data_parallel: 1000",
       "schedule.global_batch 4 is not microbatch_size 1 x microbatches 4 x data_parallel 1000"},
      {"no-optimizer-step",
       "  instructions \\{\n    op: OPTIMIZER_STEP\n    stage: -1\n    microbatch: -1\n  \\}\n", "",
       "rank 0 has 0 OPTIMIZER_STEP instructions; a training step has 1"},
      {"bogus-trainable", "^trainable: \"lm_head.weight\"$", "trainable: \"lm_head.wieght\"",
       "trainable 'lm_head.wieght' is not one of the plan's weights"},
      {"absolute-location", "value: \"g.onnx\"", "value: \"/etc/passwd\"",
       "external-data location '/etc/passwd' is outside the model's folder"},
      {"parent-location", "value: \"g.onnx\"", "value: \"../g.onnx\"", "is outside the model's"},
      {"huge-weight", "^weights \\{\n  dims: 50$", "weights {\n  dims: 1099511627776",
       "weight 'transformer.wte.weight' needs"},
      {"negative-weight-dim", "^weights \\{\n  dims: 50$", "weights {\n  dims: -50",
       "weight 'transformer.wte.weight' has dimension -50 < 0"},
      {"bad-peer", "peer: 1$", "peer: 9", "peer 9"},
      // One flipped bit renamed a key: the offset must not default to 0.
      {"renamed-offset", "key: \"offset\"", "key: \"obfset\"",
       "unknown external-data key 'obfset' (ONNX's are location, offset, length and checksum)"},
      {"no-offset", "  external_data \\{\n    key: \"offset\"\n    value: \"[0-9]+\"\n  \\}\n", "",
       "external data without its offset"},
      {"short-length", "key: \"length\"\n    value: \"[0-9]+\"",
       "key: \"length\"\n    value: \"4\"", "external-data length 4, its shape needs"},
  };
  for (const Case &c : cases) {
    std::string edited = editedPlan(std::string(c.name) + ".plan", c.pattern, c.with);
    for (const char *command : {"report", "simulate", "run --quiet"})
      expectError(std::string(command) + " " + edited, 1, c.needle);
  }
}

/// A plan carries the hash of what compile wrote. An edit of the program
/// (an attribute's value, an inline constant, a count) is refused by every
/// reader; the training choices outside the hash may be edited and run.
TEST_F(Hostile, PlanSealRefusesEdits) {
  struct Case {
    const char *name, *pattern, *with;
  };
  const Case cases[] = {
      {"epsilon", "f: 1e-05$", "f: 0.001"},
      {"inline-constant", " int64_data: ([0-9]+)$", " int64_data: 7\\1"},
      {"hardware-name", "^  name: \"cpu\"$", "  name: \"cpu-edited\""},
  };
  std::string out;
  for (const Case &c : cases) {
    llvm::Regex re(c.pattern, llvm::Regex::Newline);
    ASSERT_TRUE(re.match(planText)) << c.name;
    std::string edited = dir.path(std::string(c.name) + ".plan");
    std::ofstream(edited) << re.sub(c.with, planText);
    for (const char *command : {"report", "simulate", "run --quiet"})
      expectError(std::string(command) + " " + edited, 1,
                  "the plan's content is not what compile wrote (its content_xxh3 differs)");
  }
  llvm::Regex seal("^content_xxh3: \"[0-9a-f]+\"\n", llvm::Regex::Newline);
  ASSERT_TRUE(seal.match(planText));
  std::string unsealed = dir.path("unsealed.plan");
  std::ofstream(unsealed) << seal.sub("", planText);
  expectError("run --quiet " + unsealed, 1, "the plan has no content_xxh3; recompile the model");
  // Training's choices are the user's: another optimizer runs, and trains
  // as the flag would.
  llvm::Regex optimizer("^  optimizer: \"[a-z]+\"$", llvm::Regex::Newline);
  ASSERT_TRUE(optimizer.match(planText));
  std::string sgd = dir.path("sgd.plan");
  std::ofstream(sgd) << optimizer.sub("  optimizer: \"sgd\"", planText);
  std::string viaPlan = dir.path("plan.jsonl"), viaFlag = dir.path("flag.jsonl");
  ASSERT_EQ(
      runCommand(pipecBinary + " run --quiet --steps 2 " + sgd + " --metrics " + viaPlan, out), 0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " run --quiet --steps 2 " + plan +
                           " --optimizer sgd --metrics " + viaFlag,
                       out),
            0)
      << out;
  EXPECT_EQ(metricLosses(viaPlan), metricLosses(viaFlag));
}

/// A plan too big for this machine but not for the one it was compiled for
/// is reported and simulated here; only a CPU run refuses it, before it
/// allocates, naming the weight.
TEST_F(Hostile, PlansBiggerThanThisMachineReportButDoNotRun) {
  if (pipec::machineMemoryBytes() >= (int64_t(256) << 30))
    GTEST_SKIP() << "this machine holds 256 GiB";
  // [2^32, 16] floats: 256 GiB, more than this machine and less than the
  // 16 TiB no plan may ask for.
  // Its external data says as much (the length the shape needs).
  planText = editedPlanText("^weights \\{\n  dims: 50$", "weights {\n  dims: 4294967296");
  std::string edited = editedPlan("big.plan", "value: \"3200\"", "value: \"274877906944\"");
  std::string out;
  for (const char *command : {"report", "simulate"})
    EXPECT_EQ(runCommand(pipecBinary + " " + command + " " + edited, out), 0) << out;
  expectError("run --quiet " + edited, 1,
              "weight 'transformer.wte.weight' needs 274877906944 bytes; this machine has");
}

/// A thousand replicas are for mpirun, not for threads of one process.
TEST_F(Hostile, LocalRunsBoundTheirThreads) {
  std::string edited = editedPlan("replicas.plan", "^  data_parallel: 1\n  global_batch: 4$",
                                  "  data_parallel: 1000\n  global_batch: 4000");
  expectError("run --quiet " + edited, 1, "the plan has 2000 ranks as threads of one process");
}

/// A NumPy .npy (version 1) of \p descr ('<f4', '<i8') and \p shape over
/// \p data, whose size need not match the shape.
/// A version 1.0 .npy file of header dict \p dict (padded as numpy pads it)
/// and \p data.
void writeNpyDict(const std::string &path, std::string header, const std::string &data) {
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string bytes = "\x93NUMPY\x01";
  bytes += '\0';
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
}

void writeNpy(const std::string &path, const std::string &descr, const std::string &shape,
              const std::string &data) {
  writeNpyDict(path, "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }",
               data);
}

template <typename T> std::string rawBytes(const std::vector<T> &values) {
  return std::string(reinterpret_cast<const char *>(values.data()), values.size() * sizeof(T));
}

// Fusion is the plan's (compile --no-fuse): run says so in one line.
TEST_F(Hostile, RunNoFuseSaysItIsACompileOption) {
  expectError("run --quiet " + plan + " --no-fuse", 2,
              "--no-fuse is a compile option: the plan holds its fused nodes");
}

TEST_F(Hostile, FilesThatAreNotFilesAreRefused) {
  expectError("inspect /dev/zero", 1, "/dev/zero: is not a regular file");
  expectError("report /dev/zero", 1, "/dev/zero: is not a regular file");
  std::string data = dir.path("data");
  llvm::sys::fs::create_directories(data);
  ASSERT_FALSE(llvm::sys::fs::create_link("/dev/zero", data + "/input_ids.npy"));
  expectError("run --quiet " + plan + " --data " + data, 1, "input_ids.npy: is not a regular file");
  expectError("inspect " + dir.root(), 1, "is a directory, not a file");
}

TEST_F(Hostile, NpyHeadersAreCheckedAgainstTheirBytes) {
  std::string data = dir.path("data");
  llvm::sys::fs::create_directories(data);
  writeNpy(data + "/input_ids.npy", "<i8", "(1099511627776, 16)", std::string(1024, '\0'));
  writeNpy(data + "/labels.npy", "<i8", "(8, 8)", rawBytes(std::vector<int64_t>(64, 1)));
  expectError("run --quiet " + plan + " --data " + data, 1,
              "input_ids.npy: holds 1024 bytes of data, shape [1099511627776,16] needs "
              "140737488355328");
  writeNpy(data + "/input_ids.npy", "<i8", "(4611686018427387904, 16)", std::string(8, '\0'));
  expectError("run --quiet " + plan + " --data " + data, 1, "needs more than 2^64");
  // Bytes after the data: the header's shape does not describe the file.
  std::string ids = rawBytes(std::vector<int64_t>(64, 1));
  writeNpy(data + "/input_ids.npy", "<i8", "(8, 8)", ids + "extra");
  expectError("run --quiet " + plan + " --data " + data, 1,
              "input_ids.npy: holds 517 bytes of data, shape [8,8] needs 512");
  // Headers numpy refuses, and one it reads wrongly (a key twice: Python
  // keeps the last).
  struct Case {
    const char *dict, *needle;
  };
  const Case cases[] = {
      {"{'descr': '<i8', 'fortran_order': False, 'shape': (8, 8), 'shape': (2, 32), }",
       "'shape' is given twice"},
      {"{'descr': '<i8', 'fortran_order': False, 'shape': (8, 8), 'extra': 1, }",
       "unknown key 'extra'"},
      {"{'descr': '<i8', 'shape': (8, 8), }", "no 'fortran_order'"},
      {"{'descr': '<i8', 'fortran_order': 0, 'shape': (8, 8), }",
       "'fortran_order' is not True or False"},
      {"{'descr': '<i8', 'fortran_order': False, 'shape': (8, -8), }",
       "'shape' holds something other than sizes"},
      {"{'descr': '<i8', 'fortran_order': False, 'shape': (8, 8), } junk", "'junk' after the dict"},
      {"['descr', '<i8']", "not a dict"},
  };
  for (const Case &c : cases) {
    writeNpyDict(data + "/input_ids.npy", c.dict, ids);
    expectError("run --quiet " + plan + " --data " + data, 1,
                std::string("input_ids.npy: header at character"));
    expectError("run --quiet " + plan + " --data " + data, 1, c.needle);
  }
}

TEST_F(Hostile, TokenIdsAndSampleCountsAreChecked) {
  std::string data = dir.path("data");
  llvm::sys::fs::create_directories(data);
  std::vector<int64_t> ids(8 * 8, 3), labels(8 * 8, 4);
  ids[2 * 8 + 5] = -1; // sample 2
  writeNpy(data + "/input_ids.npy", "<i8", "(8, 8)", rawBytes(ids));
  writeNpy(data + "/labels.npy", "<i8", "(8, 8)", rawBytes(labels));
  expectError("run --quiet " + plan + " --data " + data, 1,
              "input 'input_ids' sample 2 holds -1, outside [0, 50): the rows of the table it "
              "indexes");
  ids[2 * 8 + 5] = 50; // one past the vocabulary
  writeNpy(data + "/input_ids.npy", "<i8", "(8, 8)", rawBytes(ids));
  expectError("run --quiet " + plan + " --data " + data, 1, "sample 2 holds 50, outside [0, 50)");
  // A uint64 id past int64's range is reported as it is, never wrapped or
  // rounded through a double.
  std::vector<uint64_t> wide(ids.begin(), ids.end());
  wide[2 * 8 + 5] = (uint64_t(1) << 63) + 5;
  writeNpy(data + "/input_ids.npy", "<u8", "(8, 8)", rawBytes(wide));
  expectError("run --quiet " + plan + " --data " + data, 1,
              "input 'input_ids' holds 9223372036854775813 at element 21, which int64 (the "
              "model's type) cannot hold");
  ids[2 * 8 + 5] = 49;
  writeNpy(data + "/input_ids.npy", "<i8", "(5, 8)", rawBytes(std::vector<int64_t>(40, 3)));
  expectError("run --quiet " + plan + " --data " + data, 1,
              "input 'labels' has 8 samples, input 'input_ids' 5; every input needs the same "
              "number");
  writeNpy(data + "/input_ids.npy", "<i8", "(8, 8)", rawBytes(ids));
  std::string out;
  EXPECT_EQ(runCommand(pipecBinary + " run --quiet " + plan + " --data " + data, out), 0) << out;
}

TEST_F(Hostile, NonFiniteDataAndLossStopTheRun) {
  std::string mlpPlan, out;
  ASSERT_NO_FATAL_FAILURE(compileMlp("--stages 2 --microbatches 4 --hardware cpu", mlpPlan));
  std::string data = dir.path("data");
  llvm::sys::fs::create_directories(data);
  std::vector<float> x(8 * 8, 0.5f), labels(8 * 8, 0.25f);
  x[3 * 8 + 1] = std::numeric_limits<float>::quiet_NaN(); // sample 3
  writeNpy(data + "/x.npy", "<f4", "(8, 8)", rawBytes(x));
  writeNpy(data + "/labels.npy", "<f4", "(8, 8)", rawBytes(labels));
  std::string saved = dir.path("trained.onnx");
  expectError("run --quiet " + mlpPlan + " --data " + data + " --save-weights " + saved, 1,
              "--data " + data + ": input 'x' sample 3 holds NaN (pass --allow-nonfinite");
  // Fed on purpose, the NaN reaches the loss, which stops the run before
  // any weight moves: nothing is saved.
  expectError("run --quiet " + mlpPlan + " --data " + data + " --allow-nonfinite --save-weights " +
                  saved,
              1, "step 1 microbatch 3: the loss is NaN; stopped before the optimizer step");
  EXPECT_FALSE(fileExists(saved));
  x[3 * 8 + 1] = std::numeric_limits<float>::infinity();
  writeNpy(data + "/x.npy", "<f4", "(8, 8)", rawBytes(x));
  expectError("run --quiet " + mlpPlan + " --data " + data, 1, "sample 3 holds inf");
}

// Each collective runs on its side of the update (plan/Collectives.def): a
// sharded plan whose all-gather of the updated weights comes before
// OPTIMIZER_STEP is refused by every reader, naming the instruction.
TEST_F(Hostile, ACollectiveOnTheWrongSideOfTheUpdateIsRefused) {
  std::string mlpPlan;
  ASSERT_NO_FATAL_FAILURE(compileMlp("--stages 1 --microbatches 1 --batch 8 --dp 2 "
                                     "--shard-optimizer --hardware cpu --emit text",
                                     mlpPlan));
  std::string text = readFile(mlpPlan);
  // The update and the gather after it, swapped.
  llvm::Regex pair("  instructions \\{\n    op: OPTIMIZER_STEP\n([^}]*)\\}\n  instructions \\{\n"
                   "    op: ALL_GATHER\n([^}]*)\\}\n");
  ASSERT_TRUE(pair.match(text)) << text.substr(0, 2000);
  std::string swapped = pair.sub("  instructions {\n    op: ALL_GATHER\n\\2}\n  instructions {\n"
                                 "    op: OPTIMIZER_STEP\n\\1}\n",
                                 text);
  std::string edited = dir.path("gather-first.plan");
  std::ofstream(edited) << resealedTextPlan(swapped);
  for (const char *command : {"report", "run --quiet"})
    expectError(std::string(command) + " " + edited, 1,
                "ALL_GATHER runs before OPTIMIZER_STEP; a step runs it after");
}

TEST_F(Hostile, AnUpdateThatOverflowsStopsTheRun) {
  // MSE against labels of 1e18: the first loss (about 1e36) is finite, its
  // gradient about 1e18, and an SGD step of lr 1e24 moves the weights past
  // float32's largest value. The run stops there, naming the weight, and
  // saves nothing; --allow-nonfinite goes on.
  std::string mlpPlan, out;
  ASSERT_NO_FATAL_FAILURE(
      compileMlp("--stages 1 --microbatches 1 --batch 8 --hardware cpu --optimizer sgd", mlpPlan));
  std::string data = dir.path("data");
  llvm::sys::fs::create_directories(data);
  std::vector<float> x(8 * 8, 0.5f), labels(8 * 8, 1e18f);
  writeNpy(data + "/x.npy", "<f4", "(8, 8)", rawBytes(x));
  writeNpy(data + "/labels.npy", "<f4", "(8, 8)", rawBytes(labels));
  std::string saved = dir.path("trained.onnx");
  std::string run = "run --quiet " + mlpPlan + " --data " + data +
                    " --optimizer sgd --lr 1e24 --steps 2 --save-weights " + saved;
  EXPECT_EQ(runCommand(pipecBinary + " " + run + " 2>&1", out), 1) << out;
  EXPECT_NE(out.find("step 1: the update left weight '"), std::string::npos) << out;
  EXPECT_NE(out.find("infinite or NaN (lr 1e+24, weight decay 0); lower --lr"), std::string::npos)
      << out;
  EXPECT_FALSE(fileExists(saved));
}

TEST_F(Hostile, ConvChannelsAreCheckedAgainstTheWeight) {
  for (int64_t channels : {int64_t(5), int64_t(1) << 40}) {
    GraphBuilder b;
    b.input("x", 1, {1, channels, 8, 8});
    b.weight("w", {4, 3, 3, 3});
    b.node("Conv", {"x", "w"}, {"y"}, "conv");
    b.output("y");
    std::string path = dir.path("conv.onnx");
    b.write(path);
    expectError("inspect " + path, 1,
                "input 'x' has " + std::to_string(channels) +
                    " channels, the weight 'w' [4,3,3,3] expects 3");
  }
}

TEST_F(Hostile, DuplicateInitializersAreRefused) {
  GraphBuilder b;
  b.input("x", 1, {2, 4});
  b.weight("w", {4, 4});
  b.weight("w", {4, 4});
  b.node("MatMul", {"x", "w"}, {"y"}, "mm");
  b.output("y");
  std::string path = dir.path("dup.onnx");
  b.write(path);
  expectError("inspect " + path, 1, "initializer 'w' is defined twice (#0 and #1)");
}

/// A GPT whose weights are in g.onnx.data beside it.
class HostileExternal : public Hostile {
protected:
  void SetUp() override {
    model = dir.path("m/g.onnx");
    plan = dir.path("m/g.plan");
    llvm::sys::fs::create_directories(dir.path("m"));
    std::string out;
    ASSERT_EQ(runCommand(pipecBinary +
                             " model gpt --layers 2 --hidden 16 --vocab 50 --seq 8 --loss " +
                             "--external-data -o " + model,
                         out),
              0)
        << out;
    ASSERT_TRUE(fileExists(model + ".data"));
  }
  std::string compile() {
    std::string out;
    runCommand(pipecBinary + " compile " + model + " -o " + plan + " --stages 2 --hardware cpu",
               out);
    return out;
  }
};

TEST_F(HostileExternal, ExternalDataStaysInsideTheModelsFolder) {
  ASSERT_EQ(compile().find("error"), std::string::npos);
  // The data moved out, and a symlink left in its place.
  std::string outside = dir.path("outside.data");
  ASSERT_FALSE(llvm::sys::fs::rename(model + ".data", outside));
  ASSERT_FALSE(llvm::sys::fs::create_link(outside, model + ".data"));
  for (const char *command : {"inspect ", "compile --hardware cpu -o /dev/null "})
    expectError(command + model, 1, "resolves to " + outside + ", outside " + dir.path("m"));
  expectError("run --quiet " + plan, 1, "resolves to " + outside + ", outside");
  // /etc/passwd through a symlink is the same case.
  llvm::sys::fs::remove(model + ".data");
  ASSERT_FALSE(llvm::sys::fs::create_link("/etc/passwd", model + ".data"));
  expectError("inspect " + model, 1, "resolves to /etc/passwd, outside");
}

TEST_F(HostileExternal, WeightReferencesMustBeTheModels) {
  std::string out;
  ASSERT_EQ(runCommand(pipecBinary + " compile " + model + " -o " + plan +
                           " --stages 2 --hardware cpu --emit text",
                       out),
            0)
      << out;
  std::string text = readFile(plan);
  // A plausible edit (or one flipped digit): a weight's offset moved to the
  // start of the data file, where another tensor (or nothing) is.
  llvm::Regex offset("key: \"offset\"\n *value: \"([1-9][0-9]*)\"", llvm::Regex::Newline);
  llvm::SmallVector<llvm::StringRef, 2> found;
  ASSERT_TRUE(offset.match(text, &found)) << "no external weight with an offset";
  std::string edited = dir.path("m/edited.plan");
  std::ofstream(edited) << resealedTextPlan(offset.sub("key: \"offset\"\n    value: \"0\"", text));
  expectError("run --quiet " + edited, 1, "keeps no tensor of its type and shape");
  // The plan as compiled runs.
  EXPECT_EQ(runCommand(pipecBinary + " run --quiet " + plan, out), 0) << out;
}

TEST_F(HostileExternal, NulInALocationIsRefused) {
  onnx::ModelProto m;
  ASSERT_TRUE(m.ParseFromString(readFile(model)));
  for (onnx::TensorProto &t : *m.mutable_graph()->mutable_initializer())
    for (auto &entry : *t.mutable_external_data())
      if (entry.key() == "location")
        entry.set_value(std::string("g.onnx.data\0/../../etc/passwd", 30));
  std::string bytes;
  m.SerializeToString(&bytes);
  std::ofstream(model, std::ios::binary) << bytes;
  expectError("inspect " + model, 1, "external data location 'g.onnx.data' holds a NUL byte");
}

TEST_F(HostileExternal, ThePlansHashCoversTheExternalData) {
  ASSERT_EQ(compile().find("error"), std::string::npos);
  std::string out;
  ASSERT_EQ(runCommand(pipecBinary + " run --quiet " + plan, out), 0) << out;
  // Another model's weights of the same shapes: one byte differs.
  std::string data = readFile(model + ".data");
  data[data.size() / 2] ^= 1;
  std::ofstream(model + ".data", std::ios::binary) << data;
  expectError("run --quiet " + plan, 1, "its external data has xxh3");
}

TEST_F(Hostile, OutputsGoOnlyToRegularFiles) {
  std::string compile = "compile " + model + " --stages 2 --hardware cpu -o ";
  // A folder, a pipe: refused before any work (a pipe would block the
  // write; a folder would fail it after the compile).
  expectError(compile + dir.root(), 1, dir.root() + ": is a directory; give a file name");
  std::string fifo = dir.path("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expectError(compile + fifo, 1, fifo + ": is not a regular file (a device, pipe or socket)");
  expectError("run --quiet " + plan + " --steps 1 --save-weights " + fifo, 1,
              "is not a regular file");
  // /dev/null discards, and stays the device it is.
  std::string out;
  EXPECT_EQ(runCommand(pipecBinary + " " + compile + "/dev/null", out), 0) << out;
  EXPECT_EQ(runCommand(pipecBinary + " run --quiet " + plan + " --steps 1 --metrics /dev/null " +
                           "--save-weights /dev/null",
                       out),
            0)
      << out;
  llvm::sys::fs::file_status status;
  ASSERT_FALSE(llvm::sys::fs::status("/dev/null", status));
  EXPECT_EQ(status.type(), llvm::sys::fs::file_type::character_file);
  // A symlink left where the old temporary's name was is not written
  // through: the temporary is created exclusively.
  std::string victim = dir.path("victim"), target = dir.path("out.plan");
  std::ofstream(victim) << "keep";
  ASSERT_FALSE(llvm::sys::fs::create_link(victim, target + ".tmp"));
  EXPECT_EQ(runCommand(pipecBinary + " " + compile + target, out), 0) << out;
  EXPECT_EQ(readFile(victim), "keep");
}

/// The committed GPT-2 checkpoint fixture (tools/fixtures/torch_checkpoints.py)
/// compiled with --params as a text plan.
class HostileParams : public Hostile {
protected:
  void SetUp() override {
    Hostile::SetUp();
    fixture = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/torch/checkpoints/gpt2";
    paramsPlan = dir.path("p.plan");
    std::string out;
    ASSERT_EQ(runCommand(pipecBinary + " compile " + fixture + "/model.onnx --params " + fixture +
                             "/model.safetensors --stages 2 --hardware cpu --emit text -o " +
                             paramsPlan,
                         out),
              0)
        << out;
    paramsText = readFile(paramsPlan);
  }

  /// A copy of the fixture's checkpoint with \p from replaced by \p to in
  /// its bytes (the header's JSON).
  std::string editedCheckpoint(const std::string &name, const std::string &from,
                               const std::string &to) {
    std::string bytes = readFile(fixture + "/model.safetensors");
    size_t at = bytes.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos)
      bytes.replace(at, from.size(), to);
    std::string path = dir.path(name);
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  std::string fixture, paramsPlan, paramsText;
};

TEST_F(HostileParams, CheckpointsThatLieAreRefusedNamingFileAndTensor) {
  std::string run = "run --quiet " + paramsPlan + " --data " + fixture + "/data --init ";
  // A header whose length field runs past the file.
  std::string shortFile = dir.path("short.safetensors");
  std::ofstream(shortFile, std::ios::binary)
      << std::string("\xff\xff\xff\x00\x00\x00\x00\x00{}", 10);
  expectError(
      "compile " + fixture + "/model.onnx --params " + shortFile + " -o " + dir.path("x.plan"), 1,
      shortFile + ": safetensors header at byte 0: the header says it is 16777215 bytes");
  // A tensor renamed: the map's name is missing (same length, so the
  // header stays valid).
  std::string renamed = editedCheckpoint("renamed.safetensors", "\"transformer.ln_f.bias\"",
                                         "\"transformer.ln_f.xxxx\"");
  expectError(run + renamed, 1,
              "no tensor 'transformer.ln_f.bias', which the plan's parameter map holds");
  // A dtype the map does not expect.
  std::string retyped =
      editedCheckpoint("retyped.safetensors", "\"transformer.ln_f.bias\":{\"dtype\":\"F32\"",
                       "\"transformer.ln_f.bias\":{\"dtype\":\"I32\"");
  expectError(run + retyped, 1,
              "tensor 'transformer.ln_f.bias' is I32 [64]; the plan was compiled");
  // --init on a plan compiled without --params.
  expectError("run --quiet " + plan + " --init " + fixture + "/model.safetensors", 1,
              "the plan has no parameter map; compile it with --params");
  // Saving over the checkpoint the run starts from.
  std::string copy = dir.path("start.safetensors");
  llvm::sys::fs::copy_file(fixture + "/other.safetensors", copy);
  expectError(run + copy + " --save-weights " + copy, 2, "--save-weights");
}

TEST_F(HostileParams, EditedParameterMapsAreRefused) {
  struct Case {
    const char *pattern, *with, *needle;
  };
  const Case cases[] = {
      {"weight: \"m.transformer.ln_f.bias\"", "weight: \"nothing\"",
       "parameter 'transformer.ln_f.bias' is held by 'nothing', which is not one of the plan's "
       "weights"},
      {"dtype: \"F32\"", "dtype: \"Q7\"", "has dtype 'Q7'"},
      {"alias_of: \"transformer.wte.weight\"", "alias_of: \"transformer.nothing\"",
       "is an alias of 'transformer.nothing', which the map does not hold"},
  };
  for (const Case &c : cases) {
    llvm::Regex re(c.pattern, llvm::Regex::Newline);
    ASSERT_TRUE(re.match(paramsText)) << c.pattern;
    std::string edited = dir.path("edited.plan");
    std::ofstream(edited) << resealedTextPlan(re.sub(c.with, paramsText));
    expectError("run --quiet " + edited + " --data " + fixture + "/data", 1, c.needle);
  }
}

} // namespace
