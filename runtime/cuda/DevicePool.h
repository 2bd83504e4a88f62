//===- DevicePool.h - A caching allocator of device memory ---------------===//
//
// One pool per CUDA backend. Blocks are rounded up to a size class and, when
// their last handle is dropped, go back to the free list of their class
// instead of to cudaFree; the next request of that class takes one from the
// list. A training step allocates the same sizes every microbatch, so after
// the first step nearly every request is a hit.
//
// Stream order: a freed block is handed out again for work on the owning
// backend's compute stream, queued after whatever used the block before, so
// that reuse needs no synchronization. Memory that another stream reads (a
// NCCL send) must stay referenced until that stream's work is complete.
//
// reserve() carves blocks from one arena cudaMalloc'ed up front; blocks
// beyond it are cudaMalloc'ed one by one. When cudaMalloc fails the pool
// waits for the device, frees its cached blocks and tries once more.
// Everything is released when the pool is destroyed, which happens after
// the backend and the last tensor using the pool are gone: each block's
// handle holds the pool.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_DEVICEPOOL_H
#define PIPEC_RUNTIME_CUDA_DEVICEPOOL_H

#include "llvm/Support/Error.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace pipec::cuda {

class DevicePool : public std::enable_shared_from_this<DevicePool> {
public:
  struct Stats {
    /// Requests served from a free list, and from fresh memory.
    int64_t hits = 0, misses = 0;
    /// cudaMalloc calls, arena included.
    int64_t deviceAllocations = 0;
    /// Bytes in blocks handed out now, cached in free lists, and obtained
    /// from CUDA in total (arena included).
    int64_t bytesInUse = 0, bytesCached = 0, bytesFromDevice = 0;
    /// The most bytes handed out at once since the pool was made.
    int64_t peakInUse = 0;
  };

  /// A pool on \p device (does not allocate yet).
  static std::shared_ptr<DevicePool> create(int device);
  ~DevicePool();
  DevicePool(const DevicePool &) = delete;
  DevicePool &operator=(const DevicePool &) = delete;

  /// A block of at least \p bytes (a valid pointer even for 0), released to
  /// the pool when the last copy of the handle is dropped. The caller has
  /// made the pool's device current.
  llvm::Expected<std::shared_ptr<void>> allocate(size_t bytes);

  /// Pre-allocates one arena of about \p bytes (at most 90% of the device's
  /// free memory; less, or nothing, is not an error). Once only.
  llvm::Error reserve(size_t bytes);

  /// Whether \p address is the start of a block of this pool (one handed
  /// out, or cached).
  bool owns(const void *address) const;

  Stats stats() const;

  /// The size class of a request: 512-byte steps below 1 MiB, then four
  /// steps per power of two (at most 25% slack).
  static size_t sizeClass(size_t bytes);

  int device() const { return deviceIndex; }

private:
  explicit DevicePool(int device) : deviceIndex(device) {}
  void release(void *block, size_t size);
  /// cudaFree of every cached block outside the arena; mutex held.
  llvm::Error freeCachedLocked();

  int deviceIndex;
  mutable std::mutex mutex;
  std::map<size_t, std::vector<void *>> freeBlocks;
  /// Blocks from their own cudaMalloc, with their class (freed when an
  /// allocation finds the device full).
  std::map<void *, size_t> ownBlocks;
  char *arena = nullptr;
  size_t arenaSize = 0, arenaUsed = 0;
  Stats counters;
};

} // namespace pipec::cuda

#endif // PIPEC_RUNTIME_CUDA_DEVICEPOOL_H
