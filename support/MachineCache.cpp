//===- MachineCache.cpp - What pipec measures once per machine ----------===//
#include "support/MachineCache.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/raw_ostream.h"

#include <chrono>

using namespace llvm;

namespace pipec {

namespace {

MachineSettings &settings() {
  static MachineSettings s;
  return s;
}

} // namespace

void setMachineSettings(MachineSettings s) { settings() = std::move(s); }

const MachineSettings &machineSettings() { return settings(); }

std::string cpuModelName() {
  ErrorOr<std::unique_ptr<MemoryBuffer>> buf = MemoryBuffer::getFileAsStream("/proc/cpuinfo");
  if (buf) {
    SmallVector<StringRef, 64> lines;
    (*buf)->getBuffer().split(lines, '\n');
    for (StringRef line : lines)
      if (line.startswith("model name"))
        return line.split(':').second.trim().str();
  }
  return "unknown cpu";
}

std::string cacheDirectory() { return settings().cacheDir; }

bool writeCacheFile(StringRef path, StringRef text) {
  StringRef dir = sys::path::parent_path(path);
  if (sys::fs::create_directories(dir))
    return false;
  SmallString<256> tmp;
  int fd;
  if (sys::fs::createUniqueFile(dir + "/.pipec-%%%%%%.tmp", fd, tmp))
    return false;
  {
    raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << text;
    os.close();
    if (os.has_error()) {
      os.clear_error();
      sys::fs::remove(tmp);
      return false;
    }
  }
  if (sys::fs::rename(tmp, path)) {
    sys::fs::remove(tmp);
    return false;
  }
  return true;
}

std::optional<double> cacheFileAge(StringRef path) {
  sys::fs::file_status status;
  if (sys::fs::status(path, status))
    return std::nullopt;
  return std::chrono::duration<double>(std::chrono::system_clock::now() -
                                       status.getLastModificationTime())
      .count();
}

} // namespace pipec
