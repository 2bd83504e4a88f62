//===- CliSupport.h - What pipec's commands share ------------------------===//
//
// Errors as one line and an exit code, and the output-path check every
// command that writes runs first.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_CLISUPPORT_H
#define PIPEC_TOOLS_CLISUPPORT_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

namespace pipec::cli {

/// Exit codes: bad input or a failed step, and bad usage.
inline constexpr int exitInput = 1;
inline constexpr int exitUsage = 2;

/// Prints \p err as "pipec: error: WHAT"; returns 2 (bad usage) for a
/// UsageError, else 1 (bad input or a failed step).
int reportError(llvm::Error err);

/// A malformed flag or value: "pipec: error: WHAT", exit 2.
int badUsage(const llvm::Twine &what);

/// Refuses an output path that names one of the command's inputs (`compile
/// m.onnx -o m.onnx` would replace the model with the plan), or that is no
/// regular file (a directory, device, pipe or socket; /dev/null discards):
/// before any work, so that a long run never ends unable to write.
llvm::Error checkNotAnInput(llvm::StringRef flag, llvm::StringRef output,
                            llvm::ArrayRef<llvm::StringRef> inputs);

/// `pipec generate` (GenerateCommand.cpp): its subcommand, and its run.
bool generateCommandGiven();
int runGenerate();

} // namespace pipec::cli

#endif // PIPEC_TOOLS_CLISUPPORT_H
