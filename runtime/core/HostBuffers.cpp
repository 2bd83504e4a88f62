//===- HostBuffers.cpp - The host memory of tensors, reused by size -----===//
#include "runtime/core/HostBuffers.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace pipec::cpu::HostBuffers {

namespace {

constexpr uintptr_t pageBytes = 4096;
/// The writable part of the arena grows by at least this much at a time.
constexpr uintptr_t commitStep = uintptr_t(64) << 20;

/// A free range of the arena. Its first residentBytes may hold pages the
/// kernel backs (an approximation once ranges merge); zeroed when none of it
/// was written since it was mapped or given back.
struct Range {
  uintptr_t bytes = 0;
  uintptr_t residentBytes = 0;
  bool zeroed = false;
  uint64_t freedAt = 0; ///< When it was last freed (or merged), for trimming.
};

/// One reservation of address space, made writable as it is used, from which
/// blocks are carved first-fit and to which they return, merged with their
/// free neighbours. The free ranges below the top stay resident, up to an
/// eighth over the most ever in use; past that, growing the top first gives
/// the least recently freed ranges back to the kernel. Blocks the arena
/// cannot hold (no reservation, or it is full) are mapped on their own.
class Arena {
public:
  Arena();
  void *take(uintptr_t bytes, bool &zeroed);
  void give(void *block, uintptr_t bytes);
  Stats snapshot() {
    std::lock_guard<std::mutex> lock(mutex);
    return counts;
  }

private:
  bool holds(uintptr_t address) const { return address >= base && address < base + reserved; }
  /// Gives free ranges back to the kernel, least recently freed first, until
  /// in use and resident free fit under an eighth over the peak, or none is
  /// left resident; the lock held.
  void trim();
  /// Makes [base, \p end) writable; false when the system refuses.
  bool commitTo(uintptr_t end);

  std::mutex mutex;
  uintptr_t base = 0, reserved = 0;
  uintptr_t top = 0;               ///< The end of the part ever handed out.
  uintptr_t committed = 0;         ///< The end of the writable part.
  std::map<uintptr_t, Range> free; ///< By address.
  uint64_t clock = 0;
  Stats counts;
};

Arena::Arena() {
  // Address space only (PROT_NONE is neither backed nor charged); the part
  // in use is made writable as the top grows. Smaller reservations where the
  // process's address space is limited.
  for (uintptr_t size = uintptr_t(1) << 40; size >= (uintptr_t(1) << 32); size >>= 2) {
    void *p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) {
      base = top = committed = reinterpret_cast<uintptr_t>(p);
      reserved = size;
      return;
    }
  }
}

bool Arena::commitTo(uintptr_t end) {
  if (end <= committed)
    return true;
  uintptr_t limit = base + reserved;
  uintptr_t want = std::min(limit, std::max(end, committed + commitStep));
  want = (want + pageBytes - 1) / pageBytes * pageBytes;
  if (mprotect(reinterpret_cast<void *>(committed), want - committed, PROT_READ | PROT_WRITE) != 0)
    return false;
  committed = want;
  return true;
}

void Arena::trim() {
  auto over = [&] { return counts.inUse + counts.kept > counts.peakInUse + counts.peakInUse / 8; };
  while (over()) {
    auto oldest = free.end();
    for (auto it = free.begin(); it != free.end(); ++it)
      if (it->second.residentBytes > 0 &&
          (oldest == free.end() || it->second.freedAt < oldest->second.freedAt))
        oldest = it;
    if (oldest == free.end())
      return;
    Range &r = oldest->second;
    uintptr_t first = (oldest->first + pageBytes - 1) / pageBytes * pageBytes;
    uintptr_t last = (oldest->first + r.bytes) / pageBytes * pageBytes;
    if (last > first)
      madvise(reinterpret_cast<void *>(first), last - first, MADV_DONTNEED);
    counts.kept -= static_cast<int64_t>(r.residentBytes);
    r.residentBytes = 0;
    r.zeroed = first == oldest->first && last == oldest->first + r.bytes;
  }
}

void *Arena::take(uintptr_t bytes, bool &zeroed) {
  bytes = (bytes + pageBytes - 1) / pageBytes * pageBytes;
  {
    std::lock_guard<std::mutex> lock(mutex);
    counts.inUse += static_cast<int64_t>(bytes);
    counts.peakInUse = std::max(counts.peakInUse, counts.inUse);
    // First fit: the lowest free range that holds the block, its front.
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->second.bytes < bytes)
        continue;
      uintptr_t address = it->first;
      Range r = it->second;
      free.erase(it);
      uintptr_t resident = std::min(r.residentBytes, bytes);
      if (r.bytes > bytes)
        free[address + bytes] = {r.bytes - bytes, r.residentBytes - resident, r.zeroed, r.freedAt};
      counts.kept -= static_cast<int64_t>(resident);
      zeroed = r.zeroed;
      if (resident == bytes) {
        ++counts.hits;
      } else {
        ++counts.misses;
        trim();
      }
      counts.mark = std::max(counts.mark, counts.inUse + counts.kept);
      return reinterpret_cast<void *>(address);
    }
    // The top grows, from the free range that ends there if one does.
    uintptr_t address = top;
    Range below;
    if (!free.empty()) {
      auto last = std::prev(free.end());
      if (last->first + last->second.bytes == top) {
        address = last->first;
        below = last->second;
      }
    }
    if (base != 0 && address + bytes <= base + reserved) {
      // Fresh pages: first give back what the eighth over the peak does not
      // allow (never the range this block is about to take).
      if (below.bytes > 0)
        free.erase(address);
      counts.kept -= static_cast<int64_t>(below.residentBytes);
      trim();
      if (commitTo(address + bytes)) {
        top = address + bytes;
        zeroed = below.bytes == 0 || below.zeroed;
        ++counts.misses;
        counts.mark = std::max(counts.mark, counts.inUse + counts.kept);
        return reinterpret_cast<void *>(address);
      }
      if (below.bytes > 0) {
        free[address] = below;
        counts.kept += static_cast<int64_t>(below.residentBytes);
      }
    }
    ++counts.misses;
    counts.mark = std::max(counts.mark, counts.inUse + counts.kept);
  }
  // Outside the arena: a mapping of its own.
  void *block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (block == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(mutex);
    counts.inUse -= static_cast<int64_t>(bytes);
    return nullptr;
  }
  zeroed = true;
  return block;
}

void Arena::give(void *block, uintptr_t bytes) {
  bytes = (bytes + pageBytes - 1) / pageBytes * pageBytes;
  uintptr_t address = reinterpret_cast<uintptr_t>(block);
  std::lock_guard<std::mutex> lock(mutex);
  counts.inUse -= static_cast<int64_t>(bytes);
  if (!holds(address)) {
    munmap(block, bytes);
    return;
  }
  counts.kept += static_cast<int64_t>(bytes);
  Range r{bytes, bytes, false, ++clock};
  // Merge with the free neighbours on either side.
  auto next = free.lower_bound(address);
  if (next != free.end() && next->first == address + bytes) {
    r.bytes += next->second.bytes;
    r.residentBytes += next->second.residentBytes;
    r.zeroed = false;
    next = free.erase(next);
  }
  if (next != free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes == address) {
      prev->second.bytes += r.bytes;
      prev->second.residentBytes += r.residentBytes;
      prev->second.zeroed = false;
      prev->second.freedAt = r.freedAt;
      return;
    }
  }
  free[address] = r;
}

Arena &arena() {
  // Never destroyed: tensors of static objects may be freed after it would be.
  static Arena *instance = new Arena();
  return *instance;
}

} // namespace

namespace {

/// Small blocks a thread freed, kept for its next allocations of the class:
/// a step makes and drops thousands of tiny tensors (a bias, a scalar, a
/// few-row activation), and the C heap's free and malloc cost more than the
/// kernels that use them. Classes are the powers of two from 64 bytes to
/// smallMaxBytes; each keeps at most smallKept blocks. A block freed on
/// another thread than made it joins that thread's cache. Under
/// AddressSanitizer nothing is kept, so that a use after free is seen.
constexpr size_t smallMaxBytes = size_t(16) << 10;
constexpr int smallClasses = 9; // 64 B << 0 .. 8
constexpr size_t smallKept = 32;

/// The class of \p bytes (a multiple of 64), or -1 above smallMaxBytes.
int smallClassOf(size_t bytes) {
  if (bytes > smallMaxBytes)
    return -1;
  int k = 0;
  while ((size_t(64) << k) < bytes)
    ++k;
  return k;
}

struct SmallCache {
  std::vector<void *> kept[smallClasses];
  ~SmallCache();
};
thread_local bool smallCacheGone = false; // destroyed: blocks go to the heap
thread_local SmallCache smallCache;

SmallCache::~SmallCache() {
  for (std::vector<void *> &blocks : kept)
    for (void *b : blocks)
      std::free(b);
  smallCacheGone = true;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool keepSmallBlocks = false;
#else
constexpr bool keepSmallBlocks = true;
#endif

} // namespace

void *allocate(size_t bytes, bool &zeroed) {
  if (bytes >= minCachedBytes)
    return arena().take(bytes, zeroed);
  zeroed = false;
  int k = keepSmallBlocks ? smallClassOf(bytes) : -1;
  if (k < 0)
    return std::aligned_alloc(64, bytes);
  if (!smallCacheGone && !smallCache.kept[k].empty()) {
    void *block = smallCache.kept[k].back();
    smallCache.kept[k].pop_back();
    return block;
  }
  return std::aligned_alloc(64, size_t(64) << k);
}

void release(void *block, size_t bytes) {
  if (bytes >= minCachedBytes) {
    arena().give(block, bytes);
    return;
  }
  int k = keepSmallBlocks ? smallClassOf(bytes) : -1;
  if (k >= 0 && !smallCacheGone && smallCache.kept[k].size() < smallKept)
    smallCache.kept[k].push_back(block);
  else
    std::free(block);
}

Stats stats() { return arena().snapshot(); }

} // namespace pipec::cpu::HostBuffers

namespace pipec::cpu {

int64_t peakResidentBytes() {
  if (std::FILE *status = std::fopen("/proc/self/status", "r")) {
    char line[256];
    long long kib = -1;
    while (kib < 0 && std::fgets(line, sizeof line, status))
      if (std::sscanf(line, "VmHWM: %lld kB", &kib) != 1)
        kib = -1;
    std::fclose(status);
    if (kib >= 0)
      return kib * 1024;
  }
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0)
    return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024; // Linux counts KiB
}

int64_t startResidentWindow() {
  int64_t closed = peakResidentBytes();
  // "5" resets the peak resident set size (proc(5), /proc/pid/clear_refs).
  if (std::FILE *refs = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", refs);
    std::fclose(refs);
  }
  return closed;
}

} // namespace pipec::cpu
