//===- HostBuffers.h - The host memory of tensors, reused by size -------===//
//
// A training step allocates and frees the same large activations and
// gradients, in the same order, every step. Blocks of at least
// HostBuffers::minCachedBytes are carved from one reservation of address
// space, first fit, and return to it merged with their free neighbours, so
// that a block of one size is served by the memory that blocks of other
// sizes freed: after the first step a step meets no fresh page (no page
// fault, no zeroing by the kernel). The free memory stays resident up to an
// eighth over the most ever in use; past that, growing the arena first gives
// the least recently freed ranges back to the kernel. The resident size then
// stays near the most memory in use at once.
//
// Exact-size reuse (a free list per size class) left the GPT-2 124M step
// faulting in 1.8 GB of fresh pages: the backward asks for other sizes than
// the forward frees.
//
// Smaller blocks come from the C heap; up to 16 KiB, each thread keeps a few
// it freed, by power-of-two size, for its next allocations.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_HOSTBUFFERS_H
#define PIPEC_RUNTIME_CORE_HOSTBUFFERS_H

#include <cstddef>
#include <cstdint>

namespace pipec::cpu {

namespace HostBuffers {

inline constexpr size_t minCachedBytes = size_t(1) << 20;

/// A block of \p bytes, 64-byte aligned; null when the system refuses it.
/// \p zeroed tells whether it holds zeros (a fresh mapping does).
void *allocate(size_t bytes, bool &zeroed);
/// Gives back a block of allocate(\p bytes).
void release(void *block, size_t bytes);

struct Stats {
  /// Bytes in use (in whole pages), kept resident for reuse, the most of the
  /// two together, and the most in use. hits are blocks served wholly from
  /// kept memory, misses those that needed fresh pages.
  int64_t inUse = 0, kept = 0, mark = 0, peakInUse = 0;
  int64_t hits = 0, misses = 0;
};
Stats stats();

} // namespace HostBuffers

/// The process's peak resident set, in bytes, since it started or since the
/// last startResidentWindow (Linux's VmHWM; getrusage's maxrss where /proc
/// has none).
int64_t peakResidentBytes();

/// Starts a new window for peakResidentBytes (the kernel's high-water mark
/// is reset to the pages now resident); returns the peak of the window it
/// closes. Without /proc's clear_refs the window never closes.
int64_t startResidentWindow();

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CORE_HOSTBUFFERS_H
