//===- InputFile.h - Reading the files a user names, within their size ----===//
//
// Every file pipec reads (models, their external data, plans, datasets,
// checkpoints, cost tables, traces) comes through readInputFile: a regular
// file, symlinks followed, read or mapped within the size the file system
// reports. A device (/dev/zero), pipe, socket or directory is refused with
// an error naming the path, rather than read until memory runs out or
// waited on forever.
//
// checkInsideFolder is the confinement rule for files a model or plan
// names: the name, resolved through every symlink, must lie inside the
// folder it is relative to.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_INPUTFILE_H
#define PIPEC_SUPPORT_INPUTFILE_H

#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"

#include <memory>

namespace pipec {

/// The bytes of the regular file at \p path. Errors name the path: "PATH:
/// cannot open: WHY", "PATH: is a directory, not a file", "PATH: is not a
/// regular file (a device, pipe or socket)".
llvm::Expected<std::unique_ptr<llvm::MemoryBuffer>> readInputFile(llvm::StringRef path);

/// Succeeds when \p path, with every symlink resolved, lies inside \p folder
/// (resolved too); else "WHAT 'PATH' resolves to REAL, outside FOLDER". A
/// path that does not exist is left to the reader to report.
llvm::Error checkInsideFolder(llvm::StringRef path, llvm::StringRef folder, llvm::StringRef what);

/// This machine's physical memory in bytes (0 when unknown): more than any
/// one tensor may need. "NAME needs N bytes; this machine has M" past it.
int64_t machineMemoryBytes();
llvm::Error checkFitsMemory(const llvm::Twine &name, int64_t bytes);

} // namespace pipec

#endif // PIPEC_SUPPORT_INPUTFILE_H
