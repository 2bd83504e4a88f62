//===- Parallel.cpp - Loops over a rank's threads -----------------------===//
#include "support/Parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <sched.h>
#include <thread>
#include <vector>

namespace pipec {

namespace {

/// One parallelFor: its body and the chunks not yet taken or not yet done.
/// Workers hold it by shared_ptr, so one that wakes late finds its own
/// (finished) loop rather than the next one's counters.
struct Loop {
  llvm::function_ref<void(int64_t, int64_t)> body;
  int64_t n = 0, chunks = 0;
  std::atomic<int64_t> next{0}, pending{0};
};

/// How long a thread that waits for a loop (a worker for the next one, the
/// caller for its workers' chunks) spins before it sleeps. A rank's loops
/// come microseconds apart, and waking a sleeping thread (on a virtual
/// machine, its halted CPU) costs tens of microseconds each time: the
/// benchmark GPT's one-rank step on two threads took 304 ms without the
/// spin and 270 ms with it (20 us to 500 us all did about as well).
constexpr double spinSeconds = 100e-6;

/// Spins until \p ready() or spinSeconds have passed; returns ready().
template <typename Ready> bool spinUntil(Ready ready) {
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  for (int i = 1;; ++i) {
    if (ready())
      return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (i % 64 == 0 && std::chrono::duration<double>(Clock::now() - start).count() > spinSeconds)
      return ready();
  }
}

class LoopPool {
public:
  explicit LoopPool(int workers) {
    for (int i = 0; i < workers; ++i)
      threads.emplace_back([this] { work(); });
  }

  ~LoopPool() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    for (std::thread &t : threads)
      t.join();
  }

  int size() const { return static_cast<int>(threads.size()) + 1; }

  void run(int64_t n, int64_t chunks, llvm::function_ref<void(int64_t, int64_t)> body) {
    auto loop = std::make_shared<Loop>();
    loop->body = body;
    loop->n = n;
    loop->chunks = chunks;
    loop->pending = chunks;
    {
      std::lock_guard<std::mutex> lock(mutex);
      current = loop;
      generation.fetch_add(1);
    }
    wake.notify_all();
    runChunks(*loop);
    if (spinUntil([&] { return loop->pending.load() == 0; }))
      return;
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [&] { return loop->pending.load() == 0; });
  }

private:
  void runChunks(Loop &loop) {
    for (;;) {
      int64_t c = loop.next.fetch_add(1);
      if (c >= loop.chunks)
        return;
      loop.body(loop.n * c / loop.chunks, loop.n * (c + 1) / loop.chunks);
      if (loop.pending.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mutex);
        done.notify_all();
      }
    }
  }

  void work();

  std::vector<std::thread> threads;
  std::mutex mutex;
  std::condition_variable wake, done;
  std::shared_ptr<Loop> current;
  /// Bumped (under the mutex) for each loop; read without it while spinning.
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> stopping{false};
};

thread_local int wantedThreads = 1;
/// On a pool's worker, or on a caller inside its own loop: a loop started
/// there runs serially.
thread_local bool onWorker = false;
thread_local std::unique_ptr<LoopPool> pool;

void LoopPool::work() {
  onWorker = true;
  uint64_t seen = 0;
  for (;;) {
    spinUntil([&] { return stopping.load() || generation.load() != seen; });
    std::shared_ptr<Loop> loop;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stopping || generation != seen; });
      if (stopping)
        return;
      seen = generation;
      loop = current;
    }
    runChunks(*loop);
  }
}

} // namespace

void setLoopThreads(int threads) {
  wantedThreads = std::max(1, threads);
  if (wantedThreads == 1)
    pool.reset();
  else if (!pool || pool->size() != wantedThreads)
    pool = std::make_unique<LoopPool>(wantedThreads - 1);
}

int loopThreads() { return onWorker ? 1 : wantedThreads; }

int allowedCpuCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
    return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

int defaultThreadsPerRank(int ranks) { return std::max(1, allowedCpuCount() / std::max(1, ranks)); }

void parallelFor(int64_t n, int64_t grain, llvm::function_ref<void(int64_t, int64_t)> body) {
  if (n <= 0)
    return;
  int64_t chunks = std::min<int64_t>(loopThreads(), n / std::max<int64_t>(grain, 1));
  if (chunks <= 1 || !pool) {
    body(0, n);
    return;
  }
  onWorker = true;
  pool->run(n, chunks, body);
  onWorker = false;
}

} // namespace pipec
