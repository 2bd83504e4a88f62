//===- DevicePool.cpp - A caching allocator of device memory -------------===//
#include "runtime/cuda/DevicePool.h"

#include "runtime/cuda/CudaStatus.h"

#include "llvm/ADT/STLExtras.h"

#include <cuda_runtime_api.h>

#include <algorithm>

using namespace llvm;

namespace pipec::cuda {
namespace {

size_t roundUp(size_t value, size_t step) { return (value + step - 1) / step * step; }

/// Makes \p device current for a scope and restores the previous device.
class DeviceScope {
public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous) != cudaSuccess)
      previous = -1;
    if (previous != device)
      cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous >= 0)
      cudaSetDevice(previous);
  }

private:
  int previous = -1;
};

} // namespace

std::shared_ptr<DevicePool> DevicePool::create(int device) {
  return std::shared_ptr<DevicePool>(new DevicePool(device));
}

DevicePool::~DevicePool() {
  // Every block handle holds the pool, so nothing is in use any more. At
  // process exit the runtime may already be unloading; frees then fail
  // harmlessly.
  DeviceScope scope(deviceIndex);
  for (const auto &[block, size] : ownBlocks)
    cudaFree(block);
  if (arena)
    cudaFree(arena);
  cudaGetLastError();
}

size_t DevicePool::sizeClass(size_t bytes) {
  constexpr size_t Small = 512, Large = size_t(1) << 20;
  if (bytes <= Small)
    return Small;
  if (bytes < Large)
    return roundUp(bytes, Small);
  size_t power = Large;
  while (power <= bytes / 2)
    power *= 2;
  return roundUp(bytes, power / 4);
}

Expected<std::shared_ptr<void>> DevicePool::allocate(size_t bytes) {
  size_t size = sizeClass(bytes);
  void *block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = freeBlocks.find(size);
    if (it != freeBlocks.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      ++counters.hits;
      counters.bytesCached -= static_cast<int64_t>(size);
    } else if (arena && arenaUsed + size <= arenaSize) {
      block = arena + arenaUsed;
      arenaUsed += size;
      ++counters.misses;
    } else {
      cudaError_t status = cudaMalloc(&block, size);
      if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        if (Error err = freeCachedLocked())
          return err;
        status = cudaMalloc(&block, size);
      }
      if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return createStringError(
            inconvertibleErrorCode(),
            "cuda:%d: out of memory allocating %zu bytes (%lld bytes in use by this rank)",
            deviceIndex, bytes, static_cast<long long>(counters.bytesInUse));
      }
      PIPEC_CUDA_TRY(status);
      ownBlocks[block] = size;
      ++counters.deviceAllocations;
      ++counters.misses;
      counters.bytesFromDevice += static_cast<int64_t>(size);
    }
    counters.bytesInUse += static_cast<int64_t>(size);
    counters.peakInUse = std::max(counters.peakInUse, counters.bytesInUse);
  }
  std::shared_ptr<DevicePool> self = shared_from_this();
  return std::shared_ptr<void>(block, [self, size](void *p) { self->release(p, size); });
}

void DevicePool::release(void *block, size_t size) {
  std::lock_guard<std::mutex> lock(mutex);
  freeBlocks[size].push_back(block);
  counters.bytesInUse -= static_cast<int64_t>(size);
  counters.bytesCached += static_cast<int64_t>(size);
}

Error DevicePool::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex);
  if (arena || bytes == 0)
    return Error::success();
  size_t freeBytes = 0, totalBytes = 0;
  PIPEC_CUDA_TRY(cudaMemGetInfo(&freeBytes, &totalBytes));
  constexpr size_t Granule = size_t(2) << 20;
  size_t size = std::min(roundUp(bytes, Granule), freeBytes / 10 * 9 / Granule * Granule);
  if (size == 0)
    return Error::success();
  void *block = nullptr;
  if (cudaMalloc(&block, size) != cudaSuccess) {
    // A hint only: run without the arena.
    cudaGetLastError();
    return Error::success();
  }
  arena = static_cast<char *>(block);
  arenaSize = size;
  ++counters.deviceAllocations;
  counters.bytesFromDevice += static_cast<int64_t>(size);
  return Error::success();
}

Error DevicePool::freeCachedLocked() {
  // A cached block may still be read or written by work queued on the
  // owner's stream (stream-ordered reuse): the device must be idle before
  // the block goes back to CUDA. cudaFree synchronizes in practice, but not
  // by contract.
  bool anyOwn = llvm::any_of(freeBlocks, [&](const auto &entry) {
    return llvm::any_of(entry.second, [&](void *block) { return ownBlocks.count(block) != 0; });
  });
  if (anyOwn)
    PIPEC_CUDA_TRY(cudaDeviceSynchronize());
  for (auto &[size, blocks] : freeBlocks) {
    std::vector<void *> kept;
    for (void *block : blocks) {
      auto own = ownBlocks.find(block);
      if (own == ownBlocks.end()) {
        kept.push_back(block); // carved from the arena
        continue;
      }
      ownBlocks.erase(own);
      counters.bytesCached -= static_cast<int64_t>(size);
      counters.bytesFromDevice -= static_cast<int64_t>(size);
      PIPEC_CUDA_TRY(cudaFree(block));
    }
    blocks = std::move(kept);
  }
  return Error::success();
}

bool DevicePool::owns(const void *address) const {
  const char *p = static_cast<const char *>(address);
  std::lock_guard<std::mutex> lock(mutex);
  if (arena && p >= arena && p < arena + arenaSize)
    return true;
  return ownBlocks.count(const_cast<void *>(address)) != 0;
}

DevicePool::Stats DevicePool::stats() const {
  std::lock_guard<std::mutex> lock(mutex);
  return counters;
}

} // namespace pipec::cuda
