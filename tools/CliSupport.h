//===- CliSupport.h - What pipec's commands share ------------------------===//
//
// Errors as one line and an exit code, the output-path check every command
// that writes runs first, and the lines a run's summary shares.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_CLISUPPORT_H
#define PIPEC_TOOLS_CLISUPPORT_H

#include "plan/plan.pb.h"
#include "runtime/exec/Executor.h"
#include "tools/MachineEnvironment.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pipec::cli {

/// Exit codes: bad input or a failed step, and bad usage.
inline constexpr int exitInput = 1;
inline constexpr int exitUsage = 2;

/// Prints \p err as "pipec: error: WHAT"; returns 2 (bad usage) for a
/// UsageError, else 1 (bad input or a failed step).
int reportError(llvm::Error err);

/// Run options as the environment sets them: PIPEC_FAULT injects a fault
/// (tests). Library code reads no environment variable; the tool reads them
/// here.
rt::RunOptions runOptionsFromEnvironment();

/// True when mpirun, srun or another MPI launcher started this process.
bool launchedByMpi();

/// A malformed flag or value: "pipec: error: WHAT", exit 2.
int badUsage(const llvm::Twine &what);

/// Refuses an output path that names one of the command's inputs (`compile
/// m.onnx -o m.onnx` would replace the model with the plan), or that is no
/// regular file (a directory, device, pipe or socket; /dev/null discards):
/// before any work, so that a long run never ends unable to write.
llvm::Error checkNotAnInput(llvm::StringRef flag, llvm::StringRef output,
                            llvm::ArrayRef<llvm::StringRef> inputs);

/// Which node each rank ran on, in runs: "node0 ranks 0-1, node1 ranks 2-4".
std::string formatRankNodes(const std::vector<std::string> &nodes);

/// The measured peak resident set of a run's steps beside the plan's
/// prediction for the same ranks (see CliSupport.cpp).
std::string formatMemory(const plan::Plan &plan, const std::vector<int64_t> &resident,
                         const std::vector<int64_t> &loading);

/// A device run's memory beside the plan's: "device memory: rank 0 peak
/// 41.2 GiB, plan 40.1 GiB (1.03x); ...", per pipeline rank of \p peaks; empty
/// when there are none.
std::string formatDeviceMemory(const plan::Plan &plan, const std::map<int, int64_t> &peaks);

/// `pipec run` (RunCommand.cpp): its subcommand, and its run.
bool runCommandGiven();
int runRun();

/// `pipec generate` (GenerateCommand.cpp): its subcommand, and its run.
bool generateCommandGiven();
int runGenerate();

} // namespace pipec::cli

#endif // PIPEC_TOOLS_CLISUPPORT_H
