//===- blas_compare.cpp - Candidate BLAS libraries side by side ---------===//
//
// Loads each candidate BLAS with dlopen (so one process holds libraries that
// export the same names) and times its sgemm on the GEMM shapes of pipec's
// benchmark GPT (6 blocks, width 256, vocabulary 2,000, sequence 64, batch 8:
// 512 tokens a step, 64 a microbatch at M = 8), forward and backward:
// the median over the rounds, candidates alternating shape by shape.
//
//   blas_compare [--rounds N] [--threads N] NAME=LIB[:SYMBOL_PREFIX] ...
//
// A library's idle pool threads spin for a while after each call, so with
// more than one thread each candidate must run in a process of its own
// (tools/bench_blas.py does that, alternating them and making the table).
// It prints "name,shape,GFLOP/s,config" lines, one per candidate and shape.
//
//===----------------------------------------------------------------------===//

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// CBLAS's enum values, fixed by the reference interface.
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

using Sgemm = void (*)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                       float, float *, int);
using SetThreads = void (*)(int);
using GetConfig = const char *(*)();

struct Candidate {
  std::string name;
  Sgemm sgemm = nullptr;
  std::string config;
  std::vector<std::vector<double>> samples;
};

struct Shape {
  const char *what;
  int m, n, k;
  bool transA, transB;
};

// Row-major C[m,n] = op(A) op(B): the forward X W, the input gradient
// dY W^T, and the weight gradient X^T dY of each projection.
std::vector<Shape> gptShapes() {
  std::vector<Shape> shapes;
  struct Proj {
    const char *name;
    int in, out;
  };
  const Proj projs[] = {{"qkv", 256, 768},
                        {"attn-out", 256, 256},
                        {"mlp-up", 256, 1024},
                        {"mlp-down", 1024, 256},
                        {"lm-head", 256, 2000}};
  for (int tokens : {512, 64}) {
    for (const Proj &p : projs) {
      shapes.push_back({p.name, tokens, p.out, p.in, false, false});
      shapes.push_back({p.name, tokens, p.in, p.out, false, true});
      shapes.push_back({p.name, p.in, p.out, tokens, true, false});
    }
  }
  // Attention: per head, scores Q K^T [64,32]x[32,64] and context P V.
  shapes.push_back({"attn-scores", 64, 64, 32, false, true});
  shapes.push_back({"attn-context", 64, 32, 64, false, false});
  return shapes;
}

double timeOnce(Sgemm sgemm, const Shape &s, std::vector<float> &a, std::vector<float> &b,
                std::vector<float> &c) {
  int lda = s.transA ? s.m : s.k;
  int ldb = s.transB ? s.k : s.n;
  // Enough repetitions for about a millisecond of work.
  double flops = 2.0 * s.m * s.n * s.k;
  int reps = std::max(1, static_cast<int>(2e7 / flops));
  auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    sgemm(kRowMajor, s.transA ? kTrans : kNoTrans, s.transB ? kTrans : kNoTrans, s.m, s.n, s.k,
          1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), s.n);
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  return took.count() / reps;
}

} // namespace

int main(int argc, char **argv) {
  int rounds = 15;
  int threads = 0;
  std::vector<Candidate> candidates;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
      continue;
    }
    if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
      continue;
    }
    auto eq = arg.find('=');
    if (eq == std::string::npos) {
      std::fprintf(stderr, "blas_compare: expected NAME=LIB[:PREFIX], got '%s'\n", arg.c_str());
      return 2;
    }
    std::string lib = arg.substr(eq + 1), prefix;
    if (auto colon = lib.find(':'); colon != std::string::npos) {
      prefix = lib.substr(colon + 1);
      lib.resize(colon);
    }
    void *handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      std::fprintf(stderr, "blas_compare: %s: %s\n", lib.c_str(), dlerror());
      return 1;
    }
    Candidate cand;
    cand.name = arg.substr(0, eq);
    cand.sgemm = reinterpret_cast<Sgemm>(dlsym(handle, (prefix + "cblas_sgemm").c_str()));
    if (!cand.sgemm) {
      std::fprintf(stderr, "blas_compare: %s has no %scblas_sgemm\n", lib.c_str(), prefix.c_str());
      return 1;
    }
    if (threads > 0) {
      for (const char *setter : {"openblas_set_num_threads", "MKL_Set_Num_Threads"})
        if (auto set = reinterpret_cast<SetThreads>(dlsym(handle, (prefix + setter).c_str())))
          set(threads);
      // BLIS counts threads in its dim_t, a 64-bit integer.
      if (auto set = reinterpret_cast<void (*)(long)>(dlsym(handle, "bli_thread_set_num_threads")))
        set(threads);
    }
    if (auto config =
            reinterpret_cast<GetConfig>(dlsym(handle, (prefix + "openblas_get_config").c_str())))
      cand.config = config();
    candidates.push_back(cand);
  }
  if (candidates.empty()) {
    std::fprintf(stderr, "usage: blas_compare [--rounds N] [--threads N] NAME=LIB[:PREFIX] ...\n");
    return 2;
  }

  std::vector<Shape> shapes = gptShapes();
  std::vector<float> a(1 << 21, 0.5f), b(1 << 21, 0.25f), c(1 << 21);
  for (Candidate &cand : candidates)
    cand.samples.assign(shapes.size(), {});
  for (int round = 0; round < rounds + 1; ++round) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      for (size_t i = 0; i < candidates.size(); ++i) {
        // Rotate the order each round so no candidate always runs first.
        Candidate &cand = candidates[(i + round + s) % candidates.size()];
        double t = timeOnce(cand.sgemm, shapes[s], a, b, c);
        if (round > 0) // round 0 warms caches and thread pools
          cand.samples[s].push_back(t);
      }
    }
  }

  // One line per candidate and shape: name, shape, median GFLOP/s.
  for (Candidate &cand : candidates)
    for (size_t s = 0; s < shapes.size(); ++s) {
      const Shape &sh = shapes[s];
      std::vector<double> v = cand.samples[s];
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      std::printf("%s,%s %s%s %d x %d x %d,%.3f,%s\n", cand.name.c_str(), sh.what,
                  sh.transA ? "T" : "N", sh.transB ? "T" : "N", sh.m, sh.n, sh.k,
                  2.0 * sh.m * sh.n * sh.k / v[v.size() / 2] / 1e9, cand.config.c_str());
    }
  return 0;
}
