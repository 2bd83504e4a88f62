//===- InputFile.cpp - Reading the files a user names, within their size --===//
#include "support/InputFile.h"
#include "support/Diagnostics.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <unistd.h>

using namespace llvm;

namespace pipec {

namespace {

/// Refuses what is not a regular file, by its status.
Error checkRegular(StringRef path, const sys::fs::file_status &status) {
  if (status.type() == sys::fs::file_type::directory_file)
    return fileError(path, "is a directory, not a file");
  if (status.type() != sys::fs::file_type::regular_file)
    return fileError(path, "is not a regular file (a device, pipe or socket); pipec reads only "
                           "regular files");
  return Error::success();
}

} // namespace

Expected<std::unique_ptr<MemoryBuffer>> readInputFile(StringRef path) {
  if (path.find('\0') != StringRef::npos)
    return fileError(path.take_until([](char c) { return c == '\0'; }),
                     "the path holds a NUL byte");
  // Status before opening: opening a FIFO would wait for a writer.
  sys::fs::file_status status;
  if (std::error_code ec = sys::fs::status(path, status))
    return fileError(path, "cannot open: " + ec.message());
  if (Error err = checkRegular(path, status))
    return std::move(err);
  Expected<sys::fs::file_t> fd = sys::fs::openNativeFileForRead(path);
  if (!fd)
    return fileError(path, "cannot open: " + toString(fd.takeError()));
  // And after: the file may have been replaced in between.
  std::error_code ec = sys::fs::status(*fd, status);
  Error err = ec ? fileError(path, "cannot open: " + ec.message()) : checkRegular(path, status);
  if (err) {
    sys::fs::closeFile(*fd);
    return std::move(err);
  }
  auto buffer = MemoryBuffer::getOpenFile(*fd, path, status.getSize(),
                                          /*RequiresNullTerminator=*/false);
  sys::fs::closeFile(*fd);
  if (!buffer)
    return fileError(path, "cannot read: " + buffer.getError().message());
  return std::move(*buffer);
}

Error checkInsideFolder(StringRef path, StringRef folder, StringRef what) {
  SmallString<256> real, realFolder;
  if (sys::fs::real_path(path, real) || sys::fs::real_path(folder, realFolder))
    return Error::success(); // missing: the reader names it
  StringRef inside = real;
  if (inside.consume_front(realFolder) && (inside.empty() || sys::path::is_separator(inside[0])))
    return Error::success();
  return createStringError(inconvertibleErrorCode(), "%s '%s' resolves to %s, outside %s",
                           what.str().c_str(), path.str().c_str(), real.c_str(),
                           realFolder.c_str());
}

int64_t machineMemoryBytes() {
  long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? int64_t(pages) * size : 0;
}

Error checkFitsMemory(const Twine &name, int64_t bytes) {
  int64_t machine = machineMemoryBytes();
  if (machine > 0 && bytes > machine)
    return createStringError(inconvertibleErrorCode(), "%s needs %lld bytes; this machine has %lld",
                             name.str().c_str(), static_cast<long long>(bytes),
                             static_cast<long long>(machine));
  return Error::success();
}

} // namespace pipec
