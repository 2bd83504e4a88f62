//===- Parallel.h - Loops over a rank's threads -------------------------===//
//
// A rank computes on --threads-per-rank threads: OpenBLAS's for GEMMs, and
// for the element-wise, normalization and accumulation loops the calling
// thread plus a pool of its own (setLoopThreads). parallelFor splits [0, n)
// into contiguous chunks of at least `grain` iterations and runs them on
// those threads; the caller takes a chunk too and returns when all are done.
// Each iteration must write only its own outputs, so results do not depend
// on how many threads ran them: the same bits with 1 thread or 8.
//
// Between loops a worker spins for up to 100 us, then sleeps on a condition
// variable, so that it takes the next of a rank's closely spaced loops without
// being woken, yet does not hold a core another rank may need for long. A
// loop started inside a worker, or on a thread that never called
// setLoopThreads, runs serially.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_PARALLEL_H
#define PIPEC_SUPPORT_PARALLEL_H

#include "llvm/ADT/STLFunctionalExtras.h"

#include <cstdint>

namespace pipec {

/// The threads the calling thread's parallel loops use from now on, itself
/// included (at least 1). Starts or resizes its pool.
void setLoopThreads(int threads);

/// The calling thread's loop threads (1 unless setLoopThreads said more).
int loopThreads();

/// The CPUs this process may run on (its affinity mask), at least 1.
int allowedCpuCount();

/// The threads each of \p ranks ranks sharing this machine computes on when
/// none are asked for: the allowed CPUs divided by the ranks, at least 1.
/// `pipec run` shares the cores by it, and compile's `cpu` spec is
/// calibrated for it.
int defaultThreadsPerRank(int ranks);

/// Runs \p body(begin, end) over [0, \p n) on the calling thread's loop
/// threads, in chunks of at least \p grain iterations.
void parallelFor(int64_t n, int64_t grain, llvm::function_ref<void(int64_t, int64_t)> body);

} // namespace pipec

#endif // PIPEC_SUPPORT_PARALLEL_H
