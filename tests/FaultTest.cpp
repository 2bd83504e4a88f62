//===- FaultTest.cpp - Corrupt checkpoints, preempted jobs, failed writes -===//
//
// Faults a long job meets, through the real CLI: a checkpoint whose bytes
// changed on disk, a job killed and restarted with its own command line, a
// checkpoint folder that must not grow without end, a write that fails
// half-way, and a tensor the process cannot allocate (under `ulimit -v`). Each ends in one
// "pipec: error:" line naming the file or value, or in the right result.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "plan/PlanFile.h"
#include "plan/plan.pb.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <fcntl.h>
#include <fstream>
#include <sys/file.h>
#include <unistd.h>

using namespace pipec::test;

namespace {

/// A small GPT with a loss, compiled for 2 CPU ranks.
class Fault : public SmallGptPlanTest {
protected:
  Fault() : SmallGptPlanTest("--microbatches 2") {}

  /// `pipec run PLAN --quiet ARGS`; returns the exit status, output in \p out.
  int run(const std::string &args, std::string &out) {
    return runCommand(pipecBinary + " run " + plan + " --quiet --optimizer adamw " + args, out);
  }

  /// Expects \p out to be one "pipec: error:" line holding every needle.
  static void expectOneErrorLine(const std::string &out,
                                 std::initializer_list<std::string> needles) {
    EXPECT_EQ(out.rfind("pipec: error: ", 0), 0u) << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
    for (const std::string &needle : needles)
      EXPECT_NE(out.find(needle), std::string::npos) << needle << "\n" << out;
  }

  /// Flips every bit of the byte at \p offset (from the end when negative).
  static void flipByte(const std::string &path, long offset) {
    std::string bytes = readFile(path);
    ASSERT_GT(bytes.size(), 100u) << path;
    size_t at = offset >= 0 ? size_t(offset) : bytes.size() - size_t(-offset);
    bytes[at] = static_cast<char>(~bytes[at]);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

  /// The pipec::plan::Checkpoint of rank file \p path.
  static pipec::plan::Checkpoint typedCheckpoint(const std::string &path) {
    std::string bytes = readFile(path);
    size_t line = bytes.find('\n');
    pipec::plan::Checkpoint c;
    EXPECT_NE(line, std::string::npos) << path;
    EXPECT_TRUE(line != std::string::npos && c.ParseFromString(bytes.substr(line + 1))) << path;
    return c;
  }

  std::string stepFile(int step, int rank) {
    return ckpt + "/step-" + std::to_string(step) + "/rank-" + std::to_string(rank) + ".ckpt";
  }

  std::string ckpt = dir.path("ckpt");
};

TEST_F(Fault, AStepMixingTwoRunsIsRefusedNamingTwoFiles) {
  std::string out;
  // Two runs of the same plan, another learning rate: rank 1's file of step
  // 2 comes from the second (as when two runs wrote one folder).
  ASSERT_EQ(run("--steps 2 --lr 0.01 --checkpoint " + ckpt, out), 0) << out;
  std::string other = dir.path("other");
  ASSERT_EQ(run("--steps 2 --lr 0.02 --checkpoint " + other, out), 0) << out;
  ASSERT_FALSE(llvm::sys::fs::copy_file(other + "/step-2/rank-1.ckpt", stepFile(2, 1)));
  EXPECT_EQ(run("--steps 3 --resume --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"checkpoint step-2 mixes the files of two runs: " + stepFile(2, 0),
                           stepFile(2, 1), "run="});
  // --resume-if-exists passes over it to the newest step of one run.
  EXPECT_EQ(run("--steps 3 --resume-if-exists --checkpoint " + ckpt, out), 0) << out;
  EXPECT_NE(out.find("mixes the files of two runs"), std::string::npos) << out;
  EXPECT_NE(out.find("skipped"), std::string::npos) << out;
  // Each file carries its run and its plan, typed.
  pipec::plan::Checkpoint mine = typedCheckpoint(stepFile(1, 0)),
                          theirs = typedCheckpoint(other + "/step-1/rank-0.ckpt");
  EXPECT_EQ(mine.run().size(), 16u) << mine.run();
  EXPECT_NE(mine.run(), theirs.run());
  EXPECT_EQ(mine.plan().size(), 32u) << mine.plan(); // XXH3-128, hex
  EXPECT_EQ(mine.next_step(), 1);
  EXPECT_EQ(mine.shards(), 1);
  EXPECT_GT(mine.weights_size(), 0);
  EXPECT_EQ(mine.moment1_size(), mine.moment2_size()); // AdamW's
}

/// A checkpoint written before checkpoints were typed (a GraphProto of
/// "w:", "m:" and "v:" NAME tensors, its step in the doc_string, the
/// identity in the checksum line) still resumes, to the same weights.
TEST_F(Fault, UntypedCheckpointStillResumes) {
  std::string out;
  ASSERT_EQ(
      run("--steps 3 --checkpoint " + ckpt + " --save-weights " + dir.path("typed.onnx"), out), 0)
      << out;
  for (int rank = 0; rank < 2; ++rank) {
    pipec::plan::Checkpoint c = typedCheckpoint(stepFile(2, rank));
    onnx::GraphProto g;
    g.set_doc_string("step=" + std::to_string(c.next_step()) + " shards=1");
    std::pair<const char *, const google::protobuf::RepeatedPtrField<onnx::TensorProto> *> kinds[] =
        {{"w:", &c.weights()}, {"p:", &c.masters()}, {"m:", &c.moment1()}, {"v:", &c.moment2()}};
    for (auto [prefix, tensors] : kinds)
      for (const onnx::TensorProto &t : *tensors) {
        onnx::TensorProto &added = *g.add_initializer();
        added = t;
        added.set_name(prefix + t.name());
      }
    std::string payload = g.SerializeAsString();
    std::ofstream(stepFile(2, rank), std::ios::binary | std::ios::trunc)
        << "pipec-checkpoint sha256=" << pipec::sha256Hex(payload) << " run=" << c.run()
        << " plan=" << c.plan() << "\n"
        << payload;
  }
  std::ofstream(ckpt + "/latest", std::ios::trunc) << "step-2\n";
  ASSERT_EQ(
      run("--steps 3 --resume --checkpoint " + ckpt + " --save-weights " + dir.path("untyped.onnx"),
          out),
      0)
      << out;
  EXPECT_EQ(readFile(dir.path("untyped.onnx")), readFile(dir.path("typed.onnx")));
}

TEST_F(Fault, CorruptCheckpointIsRefusedNamingTheFileAndAnIntactOne) {
  std::string out;
  ASSERT_EQ(run("--steps 3 --checkpoint " + ckpt, out), 0) << out;
  EXPECT_EQ(readFile(ckpt + "/latest"), "step-3\n");
  EXPECT_EQ(readFile(stepFile(3, 1)).rfind("pipec-checkpoint-2 sha256=", 0), 0u);
  // An intact checkpoint resumes.
  ASSERT_EQ(run("--steps 3 --resume --checkpoint " + ckpt, out), 0) << out;
  // One byte flipped in the middle of rank 1's weights of step 3.
  std::string bad = stepFile(3, 1);
  long middle = long(readFile(bad).size() / 2);
  flipByte(bad, middle);
  EXPECT_EQ(run("--steps 4 --resume --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"checkpoint " + bad + " is corrupt",
                           "the newest intact checkpoint is " + ckpt + "/step-2"});
  // Step 2 broken too, in its last byte and in rank 0: step 1 is offered.
  flipByte(stepFile(2, 0), -1);
  EXPECT_EQ(run("--steps 4 --resume --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"checkpoint " + bad + " is corrupt",
                           "the newest intact checkpoint is " + ckpt + "/step-1"});
  // A byte of the recorded checksum itself, and a missing file.
  flipByte(stepFile(1, 1), 30);
  llvm::sys::fs::remove(stepFile(1, 0));
  EXPECT_EQ(run("--steps 4 --resume --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"checkpoint " + bad + " is corrupt",
                           "no earlier checkpoint in " + ckpt + " is intact"});
  // A file that is not a checkpoint at all.
  std::ofstream(bad, std::ios::binary | std::ios::trunc) << std::string(200, 'x');
  EXPECT_EQ(run("--steps 4 --resume --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"checkpoint " + bad + " has no checksum header"});
}

TEST_F(Fault, ResumeUnderAnotherOptimizerIsRefusedAndNothingLeftIsSaid) {
  std::string out;
  ASSERT_EQ(run("--steps 2 --checkpoint " + ckpt, out), 0) << out;
  // AdamW's moments resumed by SGD (dropped) or momentum (half of them).
  for (const char *other : {"sgd", "momentum"}) {
    EXPECT_EQ(runCommand(pipecBinary + " run " + plan + " --quiet --optimizer " + other +
                             " --steps 3 --resume --checkpoint " + ckpt,
                         out),
              1)
        << out;
    expectOneErrorLine(out, {"checkpoint " + ckpt + "/step-2/rank-",
                             "holds adamw's optimizer state for '",
                             std::string("resume with --optimizer adamw, not ") + other});
  }
  // A checkpoint already past --steps trains nothing, and says so.
  ASSERT_EQ(run("--steps 1 --resume --checkpoint " + ckpt + " 2>&1", out), 0) << out;
  EXPECT_NE(out.find("pipec: warning: the checkpoint in " + ckpt +
                     " is at step 2, and --steps is 1: nothing left to train"),
            std::string::npos)
      << out;
}

TEST_F(Fault, ACheckpointFolderHasOneRunAtATime) {
  // Another run holds the folder (here: this test, as pid 4242): a second
  // run is refused naming it, and goes once the holder lets go.
  std::string out;
  llvm::sys::fs::create_directories(ckpt);
  int fd = ::open((ckpt + "/lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::pwrite(fd, "4242\n", 5, 0), 5);
  EXPECT_EQ(run("--steps 1 --checkpoint " + ckpt, out), 1) << out;
  expectOneErrorLine(out, {"--checkpoint " + ckpt + " is in use by another run (pid 4242)"});
  EXPECT_FALSE(fileExists(ckpt + "/latest"));
  ::close(fd);
  ASSERT_EQ(run("--steps 1 --checkpoint " + ckpt, out), 0) << out;
  EXPECT_EQ(readFile(ckpt + "/latest"), "step-1\n");
}

TEST_F(Fault, ResumeIfExistsContinuesFromTheNewestIntactCheckpoint) {
  std::string out;
  ASSERT_EQ(run("--steps 4 --save-weights " + dir.path("straight.onnx"), out), 0) << out;
  std::string straight = readFile(dir.path("straight.onnx"));
  ASSERT_FALSE(straight.empty());
  // The same command line throughout; the first start finds no folder.
  std::string job = "--resume-if-exists --checkpoint " + ckpt + " --save-weights " +
                    dir.path("job.onnx") + " --metrics " + dir.path("job.jsonl");
  // Preempted after step 2 (rank 1 fails in step 3, after step 2's checkpoint).
  ASSERT_EQ(runCommand("PIPEC_FAULT=rank=1,step=2,at=3,kind=error " + pipecBinary + " run " + plan +
                           " --quiet --optimizer adamw --steps 4 " + job,
                       out),
            1)
      << out;
  EXPECT_EQ(readFile(ckpt + "/latest"), "step-2\n");
  ASSERT_EQ(run("--steps 4 " + job, out), 0) << out;
  EXPECT_EQ(out, "");
  // It ran steps 3 and 4 only, and ends where the straight run ends, bit for bit.
  std::string metrics = readFile(dir.path("job.jsonl"));
  EXPECT_EQ(metrics.find("{\"step\": 3"), 0u) << metrics;
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 2) << metrics;
  EXPECT_TRUE(readFile(dir.path("job.onnx")) == straight);
  // Step 4's checkpoint corrupt: the restart warns, takes step 3, and again
  // ends bit-identical.
  flipByte(stepFile(4, 0), -10);
  ASSERT_EQ(run("--steps 4 " + job, out), 0) << out;
  EXPECT_NE(out.find("pipec: warning: checkpoint " + stepFile(4, 0) + " is corrupt"),
            std::string::npos)
      << out;
  metrics = readFile(dir.path("job.jsonl"));
  EXPECT_EQ(metrics.find("{\"step\": 4"), 0u) << metrics;
  EXPECT_TRUE(readFile(dir.path("job.onnx")) == straight);
}

TEST_F(Fault, KeepCheckpointsKeepsTheNewestN) {
  std::string out;
  ASSERT_EQ(run("--steps 5 --checkpoint " + ckpt + " --keep-checkpoints 2", out), 0) << out;
  for (int step = 1; step <= 5; ++step)
    EXPECT_EQ(llvm::sys::fs::exists(ckpt + "/step-" + std::to_string(step)), step >= 4) << step;
  EXPECT_EQ(readFile(ckpt + "/latest"), "step-5\n");
  // Every other checkpoint, keep 1: only the last remains; it resumes.
  ASSERT_EQ(run("--steps 4 --checkpoint " + dir.path("one") +
                    " --checkpoint-every 2 --keep-checkpoints 1",
                out),
            0)
      << out;
  EXPECT_FALSE(llvm::sys::fs::exists(dir.path("one/step-2")));
  EXPECT_TRUE(fileExists(dir.path("one/step-4/rank-1.ckpt")));
  ASSERT_EQ(run("--steps 5 --resume --checkpoint " + dir.path("one"), out), 0) << out;
  // N is range-checked, and both flags need a folder.
  const std::pair<std::string, std::string> cases[] = {
      {"--checkpoint C --keep-checkpoints 0", "--keep-checkpoints 0: must be at least 1"},
      {"--checkpoint C --keep-checkpoints -3", "--keep-checkpoints -3: must be at least 1"},
      {"--keep-checkpoints 2", "--keep-checkpoints needs --checkpoint DIR"},
      {"--resume-if-exists", "--resume-if-exists needs --checkpoint DIR"},
      {"--checkpoint C --resume --resume-if-exists", "exclude each other"},
  };
  for (const auto &[args, needle] : cases) {
    std::string line = args;
    if (size_t at = line.find(" C "); at != std::string::npos)
      line.replace(at, 3, " " + dir.path("c2") + " ");
    EXPECT_EQ(run(line, out), 2) << line << "\n" << out;
    expectOneErrorLine(out, {needle});
  }
  EXPECT_FALSE(llvm::sys::fs::exists(dir.path("c2")));
}

/// True when a temporary of an atomic write of \p path (PATH.tmp...) is
/// left in its folder.
bool temporaryBeside(const std::string &path) {
  std::string folder = llvm::sys::path::parent_path(path).str();
  std::string prefix = llvm::sys::path::filename(path).str() + ".tmp";
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(folder, ec), end; it != end && !ec; it.increment(ec))
    if (llvm::StringRef(llvm::sys::path::filename(it->path())).startswith(prefix))
      return true;
  return false;
}

TEST_F(Fault, FailedModelWriteLeavesNoPartialFile) {
  std::string out;
  // The target is a folder: the write completes, its rename fails.
  std::string folder = dir.path("taken.onnx");
  ASSERT_FALSE(llvm::sys::fs::create_directory(folder));
  std::string gen = pipecBinary + " model gpt --layers 2 --hidden 16 --vocab 50 --seq 8 -o ";
  EXPECT_EQ(runCommand(gen + folder, out), 1) << out;
  expectOneErrorLine(out, {folder});
  EXPECT_FALSE(temporaryBeside(folder));
  // External data whose file cannot be replaced: the old model stays whole,
  // and nothing half-written is left beside it.
  std::string old = readFile(model);
  ASSERT_FALSE(llvm::sys::fs::create_directory(model + ".data"));
  EXPECT_EQ(runCommand(gen + model + " --external-data", out), 1) << out;
  expectOneErrorLine(out, {model + ".data"});
  EXPECT_TRUE(readFile(model) == old);
  EXPECT_FALSE(temporaryBeside(model));
  EXPECT_FALSE(temporaryBeside(model + ".data"));
  // An unwritable folder (where permissions bind: not as root).
  std::string locked = dir.path("locked");
  ASSERT_FALSE(llvm::sys::fs::create_directory(locked));
  llvm::sys::fs::setPermissions(locked, llvm::sys::fs::owner_read | llvm::sys::fs::owner_exe);
  int rc = runCommand(gen + locked + "/m.onnx", out);
  if (rc != 0) {
    EXPECT_EQ(rc, 1) << out;
    expectOneErrorLine(out, {locked + "/m.onnx"});
  }
  EXPECT_FALSE(temporaryBeside(locked + "/m.onnx"));
  llvm::sys::fs::setPermissions(locked, llvm::sys::fs::all_all);
}

TEST_F(Fault, AllocationFailureNamesTheValue) {
#ifdef __SANITIZE_ADDRESS__
  // AddressSanitizer reserves terabytes of shadow memory at start, which an
  // address-space limit (ulimit -v) refuses before pipec runs.
  GTEST_SKIP() << "needs ulimit -v, which AddressSanitizer cannot run under";
#endif
  // Logits of 64 x 8 tokens over a 2^20-word vocabulary: 2 GiB of float32,
  // past an address-space limit of 1.5 GB; every input and weight is small.
  std::string big = dir.path("big.onnx"), bigPlan = dir.path("big.plan"), out;
  ASSERT_EQ(
      runCommand(pipecBinary + " model gpt --layers 1 --hidden 8 --vocab 1048576 --seq 8 -o " + big,
                 out),
      0)
      << out;
  ASSERT_EQ(runCommand(pipecBinary + " compile " + big + " -o " + bigPlan +
                           " --mode infer --stages 1 --microbatches 1 --batch 64 --hardware cpu",
                       out),
            0)
      << out;
  EXPECT_EQ(runCommand("ulimit -v 1500000 && OPENBLAS_NUM_THREADS=1 exec " + pipecBinary + " run " +
                           bigPlan + " --quiet",
                       out),
            1)
      << out;
  expectOneErrorLine(out, {"rank 0: stage 0 microbatch 0 forward: 'logits' needs 2147483648 bytes "
                           "([64,8,1048576], made by MatMul node '/lm_head/MatMul'); out of "
                           "memory"});
}

} // namespace
