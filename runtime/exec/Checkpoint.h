//===- Checkpoint.h - Where a run's checkpoints live ---------------------===//
//
// A checkpoint directory holds step-N/rank-R.ckpt for every global rank R
// and a file "latest" naming the newest complete step ("step-N"), written
// after every rank's file. A rank's file is one header line,
// "pipec-checkpoint-2 sha256=HEX\n", HEX the SHA-256 of every byte after
// it, then a plan::Checkpoint (plan.proto): the step to resume at, the
// optimizer state's shard count, the run that wrote it (one id per run,
// shared by its ranks) and the plan's hash (XXH3-128 of its bytes), then
// the weights, float32 master copies and optimizer moments by name.
// RankExecutor writes and reads it (Checkpoint.cpp); files from before
// typed checkpoints still load. A file whose bytes do not hash to its
// header is corrupt and never loaded.
//
// Resuming is collective: every rank checks its own file of a step and the
// ranks agree (a sum over all ranks) that the step is intact before any
// loads it, so all ranks resume from the same step or none does; a step
// whose files carry different run ids or plan hashes (two runs wrote into
// one folder) is refused, naming two of its files.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_CHECKPOINT_H
#define PIPEC_RUNTIME_EXEC_CHECKPOINT_H

#include "plan/plan.pb.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/raw_ostream.h"

#include <memory>
#include <string>
#include <vector>

namespace pipec::rt {

/// The file of global rank \p global in the checkpoint of step \p nextStep.
std::string checkpointFile(llvm::StringRef dir, int nextStep, int global);

/// The step that \p dir's "latest" names; errors read "--resume: ...".
llvm::Expected<int> latestCheckpoint(llvm::StringRef dir);

/// Writes \p payload (a plan::Checkpoint) to \p file behind its checksum
/// header, atomically.
llvm::Error writeCheckpointFile(llvm::StringRef file, llvm::StringRef payload);

/// The identity of \p file, "run=ID plan=HASH" ("" for a file written
/// before checkpoints carried one): the message's leading fields, read
/// without reading its tensors.
llvm::Expected<std::string> checkpointIdentity(llvm::StringRef file);

/// A checkpoint file whose checksum matched: the bytes read, and the payload
/// within them.
struct CheckpointBytes {
  std::unique_ptr<llvm::MemoryBuffer> buffer;
  llvm::StringRef payload;
  /// The payload is a plan::Checkpoint; else a file from before typed
  /// checkpoints, whose header line carried `identity`.
  bool typed = true;
  std::string identity;
};

/// The checkpoint \p bytes hold, of either format; errors say why it is
/// not one (without the file's name).
llvm::Expected<plan::Checkpoint> parseCheckpoint(const CheckpointBytes &bytes);

/// Reads \p file and checks its checksum. Errors name the file: "checkpoint
/// FILE is corrupt: its bytes hash to X, its header records Y", "checkpoint
/// FILE has no checksum header ...", or why it cannot be read.
llvm::Expected<CheckpointBytes> readCheckpointFile(llvm::StringRef file);

/// The steps N of \p dir's step-N folders, newest first; none when \p dir
/// does not exist.
std::vector<int> checkpointSteps(llvm::StringRef dir);

class Comm;

/// How a run picks the checkpoint it continues from.
enum class ResumeMode {
  Fresh,    ///< start at step 0
  Latest,   ///< --resume: the step "latest" names, which must be intact
  IfExists, ///< --resume-if-exists: the newest intact step, else step 0
};

/// The rank files of \p dir's step \p step.
int checkpointRanks(llvm::StringRef dir, int step);

/// The step all \p ranks ranks (\p stages pipeline ranks times the
/// replicas times \p tensorParallel) of a run continue from (0: from the
/// start); a step written by another number of ranks is refused (Latest) or
/// skipped (IfExists), unless only its tensor-parallel degree differs (its
/// files are then read across: RankExecutor::loadCheckpointAcross);
/// collective over \p comm, \p global this rank's global index. Latest
/// refuses a corrupt or missing file naming it, and names the newest intact
/// earlier checkpoint if there is one. IfExists skips corrupt steps, adding
/// a line per skipped step to \p skipped.
llvm::Expected<int> agreeResumeStep(llvm::StringRef dir, ResumeMode mode, Comm &comm, int global,
                                    int ranks, int stages, int tensorParallel,
                                    std::vector<std::string> &skipped);

/// A run's hold on its checkpoint folder: an exclusive flock on DIR/lock,
/// which records the holder's pid, released when this is destroyed (or the
/// process ends, however it ends).
class CheckpointLock {
public:
  CheckpointLock() = default;
  CheckpointLock(CheckpointLock &&other) noexcept : fd(other.fd) { other.fd = -1; }
  CheckpointLock &operator=(CheckpointLock &&other) noexcept;
  ~CheckpointLock();

  /// Takes \p dir (creating it) for this process; a folder another run
  /// holds is refused naming that run's pid: one run per checkpoint folder,
  /// so that no step's rank files come from two runs.
  static llvm::Expected<CheckpointLock> take(llvm::StringRef dir);

private:
  int fd = -1;
};

/// Removes the step-N folders of \p dir older than the newest \p keep
/// steps up to \p newest (their rank files, then the folder if that leaves
/// it empty). Steps after \p newest are left alone.
llvm::Error pruneCheckpoints(llvm::StringRef dir, int keep, int newest);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_CHECKPOINT_H
