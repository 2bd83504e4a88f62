//===- HostBuffers.cpp - The host memory of tensors, reused by size -----===//
#include "runtime/core/HostBuffers.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <vector>

namespace pipec::cpu::HostBuffers {

namespace {

struct Kept {
  void *block;
  size_t bytes;
};

class Cache {
public:
  void *take(size_t bytes, bool &zeroed);
  void give(void *block, size_t bytes);
  Stats snapshot() {
    std::lock_guard<std::mutex> lock(mutex);
    return counts;
  }

private:
  /// Returns the least recently kept block to the kernel; the lock held.
  void dropOldest();

  std::mutex mutex;
  /// Kept blocks, least recently freed first, and per size the most recent
  /// last.
  std::list<Kept> order;
  std::map<size_t, std::vector<std::list<Kept>::iterator>> bySize;
  Stats counts;
};

void *Cache::take(size_t bytes, bool &zeroed) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto same = bySize.find(bytes);
    if (same != bySize.end() && !same->second.empty()) {
      auto it = same->second.back();
      same->second.pop_back();
      void *block = it->block;
      order.erase(it);
      counts.kept -= static_cast<int64_t>(bytes);
      counts.inUse += static_cast<int64_t>(bytes);
      ++counts.hits;
      zeroed = false;
      return block;
    }
    // Kept blocks may add an eighth of the most ever in use: room for the
    // sizes a step needs in another order than it frees them.
    counts.inUse += static_cast<int64_t>(bytes);
    counts.peakInUse = std::max(counts.peakInUse, counts.inUse);
    while (!order.empty() && counts.inUse + counts.kept > counts.peakInUse + counts.peakInUse / 8)
      dropOldest();
    counts.mark = std::max(counts.mark, counts.inUse + counts.kept);
    ++counts.misses;
  }
  void *block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (block == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(mutex);
    counts.inUse -= static_cast<int64_t>(bytes);
    return nullptr;
  }
  zeroed = true;
  return block;
}

void Cache::give(void *block, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  order.push_back({block, bytes});
  bySize[bytes].push_back(std::prev(order.end()));
  counts.inUse -= static_cast<int64_t>(bytes);
  counts.kept += static_cast<int64_t>(bytes);
}

void Cache::dropOldest() {
  Kept oldest = order.front();
  std::vector<std::list<Kept>::iterator> &same = bySize[oldest.bytes];
  // The oldest of its size is the first of its list.
  same.erase(same.begin());
  order.pop_front();
  counts.kept -= static_cast<int64_t>(oldest.bytes);
  munmap(oldest.block, oldest.bytes);
}

/// \p bytes rounded up to its size class: eight classes per power of two,
/// so that blocks of nearby sizes serve each other, at most an eighth
/// wasted.
size_t sizeClass(size_t bytes) {
  size_t power = size_t(1) << (63 - __builtin_clzll(bytes));
  size_t step = std::max<size_t>(power / 8, 4096);
  return (bytes + step - 1) / step * step;
}

Cache &cache() {
  // Never destroyed: tensors of static objects may be freed after it would be.
  static Cache *instance = new Cache();
  return *instance;
}

} // namespace

void *allocate(size_t bytes, bool &zeroed) {
  if (bytes >= minCachedBytes)
    return cache().take(sizeClass(bytes), zeroed);
  zeroed = false;
  return std::aligned_alloc(64, bytes);
}

void release(void *block, size_t bytes) {
  if (bytes >= minCachedBytes)
    cache().give(block, sizeClass(bytes));
  else
    std::free(block);
}

Stats stats() { return cache().snapshot(); }

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
