//===- MachineCache.cpp - What pipec measures once per machine ----------===//
#include "support/MachineCache.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/raw_ostream.h"
#include "llvm/Support/xxhash.h"

#include <chrono>
#include <ctime>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

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

double threadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

std::optional<Measurement> measureMarked(function_ref<std::optional<std::string>()> measure) {
  double cpuStart = threadCpuSeconds();
  auto wallStart = std::chrono::steady_clock::now();
  std::optional<std::string> text = measure();
  if (!text)
    return std::nullopt;
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wallStart).count();
  return Measurement{std::move(*text), wall > 0 && (threadCpuSeconds() - cpuStart) < 0.9 * wall};
}

namespace {

constexpr StringLiteral disturbedLine = "disturbed 1\n";

/// The cached measurement at \p path, its mark taken off the text.
std::optional<Measurement> readMeasurement(StringRef path) {
  ErrorOr<std::unique_ptr<MemoryBuffer>> buf = MemoryBuffer::getFile(path);
  if (!buf)
    return std::nullopt;
  Measurement m;
  m.text = (*buf)->getBuffer().str();
  if (size_t at = m.text.find(disturbedLine); at != std::string::npos) {
    m.disturbed = true;
    m.text.erase(at, disturbedLine.size());
  }
  return m;
}

} // namespace

std::optional<Measurement> cachedMeasurement(StringRef prefix, StringRef key,
                                             function_ref<std::optional<Measurement>()> measure,
                                             function_ref<bool(StringRef)> valid) {
  std::string dir = cacheDirectory();
  if (dir.empty())
    return measure();
  SmallString<256> path(dir);
  sys::path::append(path, prefix + "-" + utohexstr(xxHash64(key), /*LowerCase=*/true) + ".txt");
  // A disturbed measurement serves a while, then is measured again.
  auto fresh = [&](const std::optional<Measurement> &m) {
    if (!m || !valid(m->text))
      return false;
    std::optional<double> age = cacheFileAge(path);
    return !m->disturbed || (age && *age < disturbedMeasurementSeconds);
  };
  if (std::optional<Measurement> m = readMeasurement(path); fresh(m))
    return m;
  sys::fs::create_directories(dir);
  int lock =
      ::open((dir + "/" + prefix + ".lock").str().c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock >= 0)
    ::flock(lock, LOCK_EX);
  std::optional<Measurement> m = readMeasurement(path);
  // None, or a disturbed one that served its time (a quiet one is never
  // replaced).
  if (!fresh(m) && (m = measure()))
    writeCacheFile(path, m->text + (m->disturbed ? disturbedLine.str() : std::string()));
  if (lock >= 0)
    ::close(lock); // releases the flock
  return m;
}

} // namespace pipec
