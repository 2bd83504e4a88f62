//===- Launcher.h - Where a job's ranks run, for run and generate -------===//
//
// `pipec run` and `pipec generate` start their ranks one way: every rank a
// thread of this process (--comm local), or this process one rank of an
// MPI job (--comm mpi, nccl). The Launcher makes the ranks' comms and
// backends, shares out the node's cores, runs each rank's body, and brings
// every rank's outcome to the reporting process in one message
// (plan.proto's RankResult between processes, a RankOutcome in memory).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_LAUNCHER_H
#define PIPEC_RUNTIME_EXEC_LAUNCHER_H

#include "runtime/exec/RankExecutor.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace pipec::rt {

/// What a rank brings the reporting process, in threads and processes
/// alike: its pieces of the graph outputs, its trained weights (when the run
/// keeps them), its measured timeline (with --trace), the ops its device
/// left to the host, and a generation's tokens (the last rank's).
struct RankOutcome {
  std::map<std::string, std::map<int64_t, cpu::Tensor>> outputs;
  std::map<std::string, cpu::Tensor> trained;
  std::vector<TraceEvent> events;
  std::map<std::string, int64_t> fallbacks;
  /// Per process, in rank order: its peak resident set in the steps and
  /// while it loaded.
  std::vector<int64_t> peakResident, loadResident;
  /// Per pipeline rank: the most device memory one of its ranks held at
  /// once (Backend::devicePeakBytes; ranks of this process, none on the CPU).
  std::map<int, int64_t> devicePeak;
  /// Generation: the picked tokens [prompts x new], and when each prompt's
  /// came (seconds since the loop's start).
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> tokenTimes;

  /// Adds \p other's, ranks in order: of a weight held twice (a tied
  /// weight's copies) the first, the lowest rank's, stays.
  void merge(RankOutcome &&other);
};

/// Where a job's ranks run.
class Launcher {
public:
  /// Opens the job: under MPI (\p mpi) this process's comm first, so that
  /// every later failure stops the whole job.
  static llvm::Expected<std::unique_ptr<Launcher>> open(const RunOptions &options, bool mpi);

  /// \p err as one line; under MPI the job stopped with it.
  llvm::Error fail(llvm::Error err);
  /// Places the ranks of \p s that run here, with their comms and backends
  /// (CUDA: the device of the rank's index on its node over
  /// --ranks-per-device; under --comm nccl, NCCL over MPI). Of n ranks on a
  /// node, \p computing(n) compute at once and share its cores. \p layout
  /// names the plan's ranks for mpirun's count ("2 ranks"). Under MPI the
  /// job stopped when it fails.
  llvm::Error place(const Shared &s, llvm::StringRef layout,
                    llvm::function_ref<int(int)> computing);

  /// The ranks placed here: every rank as threads, this process's under MPI.
  int ranksHere() const { return static_cast<int>(comms.size()); }
  int globalRank(int here) const { return mpi ? comms[0]->rank() : here; }
  Comm &comm(int here) { return *comms[here]; }
  Backend &backend(int here) { return *backends[here]; }
  int threadsPerRank() const { return threads; }
  /// Whether this process reports: always with threads, rank 0's under MPI.
  bool primary() const { return !mpi || comms[0]->rank() == 0; }
  /// Under MPI, the node of each rank; empty with threads.
  std::vector<std::string> rankNodes() const;

  /// Every process at this point together (a generation's common start).
  llvm::Error together();
  /// Runs \p body(here) for each rank placed here, each with its loop
  /// threads (threads: each on a thread of its own, rank 0 on the caller's;
  /// a rank that fails fails its Comm so that its peers stop). Returns the
  /// first failure; under MPI the job stopped with it.
  llvm::Error run(llvm::function_ref<llvm::Error(int)> body);
  /// \p value of the reporting process, on every process.
  llvm::Expected<uint64_t> fromPrimary(uint64_t value);
  /// This process's outcome to the reporting process: there, every
  /// process's in rank order; elsewhere none.
  llvm::Expected<std::vector<RankOutcome>> gather(RankOutcome mine);

private:
  explicit Launcher(const RunOptions &options, bool mpi) : options(options), mpi(mpi) {}

  const RunOptions &options;
  bool mpi;
  std::unique_ptr<LocalWorld> world;
  std::vector<std::unique_ptr<Comm>> comms;
  std::vector<std::unique_ptr<Backend>> backends;
  int threads = 1;
};

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_LAUNCHER_H
