//===- Blas.cpp - OpenBLAS or MKL, whichever is faster on this CPU -------===//
//
// The choice (support/Blas.h says when it is made and how) is one Library
// value, made once and never changed: a process computes with one BLAS.
//
//===----------------------------------------------------------------------===//
#include "support/Blas.h"
#include "support/MachineCache.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <dlfcn.h>
#include <mutex>
#include <vector>

#ifdef PIPEC_BLAS_PREFIX_SCIPY
#define PIPEC_OPENBLAS_FN(name) scipy_##name
#else
#define PIPEC_OPENBLAS_FN(name) name
#endif

using namespace llvm;

namespace pipec::blas {

namespace {

// CBLAS's enum values, the same in every implementation.
constexpr int rowMajor = 101, noTrans = 111, trans = 112;

using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float *, int, const float *,
                            int, float, float *, int);
using CblasDgemm = void (*)(int, int, int, int, int, int, double, const double *, int,
                            const double *, int, double, double *, int);

/// One BLAS: its GEMMs with CBLAS's signature and what it says of itself.
enum class Kind { OpenBlas, Mkl };

struct Library {
  Kind kind;
  void *handle = nullptr; // MKL's, from dlopen; null for the linked OpenBLAS
  CblasSgemm sgemm = nullptr;
  CblasDgemm dgemm = nullptr;
  std::string config; // the library's build or version line
  std::string core;   // the CPU kernels it runs here
  std::string shortName;
};

void openblasSgemm(int layout, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                   int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  PIPEC_OPENBLAS_FN(cblas_sgemm)
  (static_cast<CBLAS_ORDER>(layout), static_cast<CBLAS_TRANSPOSE>(ta),
   static_cast<CBLAS_TRANSPOSE>(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void openblasDgemm(int layout, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                   int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  PIPEC_OPENBLAS_FN(cblas_dgemm)
  (static_cast<CBLAS_ORDER>(layout), static_cast<CBLAS_TRANSPOSE>(ta),
   static_cast<CBLAS_TRANSPOSE>(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

Library openblas() {
  Library l;
  l.kind = Kind::OpenBlas;
  l.sgemm = openblasSgemm;
  l.dgemm = openblasDgemm;
  l.config = PIPEC_OPENBLAS_FN(openblas_get_config)();
  l.core = PIPEC_OPENBLAS_FN(openblas_get_corename)();
  SmallVector<StringRef, 4> words;
  StringRef(l.config).split(words, ' ', 2);
  l.shortName = words.size() >= 2 ? (words[0] + " " + words[1]).str() : l.config;
  return l;
}

/// The CPU kernels MKL's reproducible mode calls AUTO here (mkl_cbwr.h's
/// branch numbers).
std::string mklBranchName(int branch) {
  switch (branch) {
  case 2: // AUTO: MKL names no branch for this CPU (so far, any not Intel's)
    return "CPU-dispatched";
  case 9:
    return "AVX";
  case 10:
    return "AVX2";
  case 12:
    return "AVX-512";
  case 14:
    return "AVX-512 E1";
  default:
    return "branch " + std::to_string(branch);
  }
}

/// MKL from \p path, on its sequential layer and in strict reproducible mode; None when it is not
/// installed or refuses either setting.
/// MKL's libmkl_rt.so.3: PIPEC_MKL_LIBRARY, else tools/fetch-mkl.sh's;
/// empty when neither exists.
std::string mklPath() {
  std::string path;
  if (!machineSettings().mklLibrary.empty())
    path = machineSettings().mklLibrary;
#ifdef PIPEC_MKL_DIR
  else
    path = PIPEC_MKL_DIR "/libmkl_rt.so.3";
#endif
  return !path.empty() && sys::fs::exists(path) ? path : "";
}

Optional<Library> loadMkl(const std::string &path) {
  if (path.empty())
    return None;
  void *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle)
    return None;
  auto fn = [&](const char *name) { return dlsym(handle, name); };
  auto setThreading = reinterpret_cast<int (*)(int)>(fn("MKL_Set_Threading_Layer"));
  auto setInterface = reinterpret_cast<int (*)(int)>(fn("MKL_Set_Interface_Layer"));
  auto cbwrSet = reinterpret_cast<int (*)(int)>(fn("MKL_CBWR_Set"));
  auto cbwrAuto = reinterpret_cast<int (*)()>(fn("MKL_CBWR_Get_Auto_Branch"));
  auto version = reinterpret_cast<void (*)(char *, int)>(fn("MKL_Get_Version_String"));
  Library l;
  l.kind = Kind::Mkl;
  l.handle = handle;
  l.sgemm = reinterpret_cast<CblasSgemm>(fn("cblas_sgemm"));
  l.dgemm = reinterpret_cast<CblasDgemm>(fn("cblas_dgemm"));
  if (!setThreading || !setInterface || !cbwrSet || !cbwrAuto || !version || !l.sgemm || !l.dgemm)
    return None;
  // Before any other call: the layers are fixed at MKL's first computation.
  constexpr int threadingSequential = 1, interfaceLp64 = 0;
  constexpr int cbwrAutoBranch = 2, cbwrStrict = 0x10000, cbwrSuccess = 0;
  int branch = -1;
  if (setThreading(threadingSequential) < 0 || setInterface(interfaceLp64) < 0 ||
      (branch = cbwrAuto(), cbwrSet(cbwrAutoBranch | cbwrStrict) != cbwrSuccess)) {
    dlclose(handle);
    return None;
  }
  std::array<char, 256> text{};
  version(text.data(), static_cast<int>(text.size()) - 1);
  l.config = StringRef(text.data()).trim().str();
  l.core = mklBranchName(branch);
  // "Intel(R) oneAPI Math Kernel Library Version 2026.2.1-Product Build ...".
  StringRef v = StringRef(l.config).split("Version ").second.split('-').first.split(' ').first;
  l.shortName = v.empty() ? "MKL" : ("MKL " + v).str();
  return l;
}

/// Seconds for one pass over GEMMs of transformer shapes on one thread
/// (pipec's bands each run on one): projections at 512 and 64 tokens in
/// the forward (NN), input-gradient (NT) and weight-gradient (TN) forms, a
/// wide feed-forward product and one attention head's scores.
double onePass(const Library &l, std::vector<float> &a, std::vector<float> &b,
               std::vector<float> &c) {
  struct Shape {
    int m, n, k;
    bool ta, tb;
  };
  static constexpr Shape shapes[] = {{512, 768, 256, false, false},   {512, 256, 768, false, true},
                                     {256, 768, 512, true, false},    {64, 1024, 256, false, false},
                                     {512, 1024, 1024, false, false}, {64, 64, 32, false, true}};
  auto start = std::chrono::steady_clock::now();
  for (const Shape &s : shapes) {
    int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n;
    l.sgemm(rowMajor, s.ta ? trans : noTrans, s.tb ? trans : noTrans, s.m, s.n, s.k, 1.0f, a.data(),
            lda, b.data(), ldb, 0.0f, c.data(), s.n);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

constexpr double passFlops =
    2.0 * (512.0 * 768 * 256 * 3 + 64.0 * 1024 * 256 + 512.0 * 1024 * 1024 + 64.0 * 64 * 32);

/// GFLOP/s of each library over the same passes, taking turns, medians of 7.
std::pair<double, double> measure(const Library &x, const Library &y) {
  std::vector<float> a(1 << 20), b(1 << 20), c(1 << 20);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = float((i * 7919) % 2003) * 1e-3f - 1.0f;
    b[i] = float((i * 104729) % 1009) * 1e-3f - 0.5f;
  }
  int threads = PIPEC_OPENBLAS_FN(openblas_get_num_threads)();
  PIPEC_OPENBLAS_FN(openblas_set_num_threads)(1);
  onePass(x, a, b, c); // warm caches and the libraries' first-call setup
  onePass(y, a, b, c);
  std::vector<double> tx, ty;
  for (int round = 0; round < 7; ++round) {
    tx.push_back(onePass(x, a, b, c));
    ty.push_back(onePass(y, a, b, c));
  }
  PIPEC_OPENBLAS_FN(openblas_set_num_threads)(threads);
  auto median = [](std::vector<double> &v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  return {passFlops / median(tx) / 1e9, passFlops / median(ty) / 1e9};
}

struct Chosen {
  Library library;
  std::string reason;
};

/// What OpenBLAS and MKL measured here, and MKL's name ("MKL 2026.2").
struct Measured {
  double ours = 0, mkl = 0;
  std::string mklName;
};

/// What a cache file holds: "openblas 91.4\nmkl 83.2\nmkl-name MKL 2026.2\n".
Optional<Measured> parseMeasured(StringRef text) {
  Measured m;
  SmallVector<StringRef, 4> lines;
  text.split(lines, '\n', -1, /*KeepEmpty=*/false);
  for (StringRef line : lines) {
    auto [key, value] = line.split(' ');
    if (key == "mkl-name")
      m.mklName = value.str();
    else if ((key != "openblas" && key != "mkl") ||
             value.trim().getAsDouble(key == "openblas" ? m.ours : m.mkl))
      return None;
  }
  if (!(m.ours > 0) || !(m.mkl > 0) || m.mklName.empty())
    return None;
  return m;
}

/// OpenBLAS's and MKL's GFLOP/s here, from the cache or measured now; \p mkl
/// is loaded from \p path only to measure. The cache is keyed by the CPU,
/// OpenBLAS's build and MKL's file, so a cached answer never loads MKL. One
/// process measures while the others wait on a lock, so that ranks and
/// tests started together agree. None when MKL does not load.
Optional<Measured> measuredHere(const Library &ours, const std::string &path,
                                Optional<Library> &mkl) {
  auto measureNow = [&]() -> std::optional<Measurement> {
    if (!mkl)
      mkl = loadMkl(path);
    if (!mkl)
      return std::nullopt;
    return measureMarked([&]() -> std::optional<std::string> {
      auto [oursRate, mklRate] = measure(ours, *mkl);
      return formatv("openblas {0:f1}\nmkl {1:f1}\nmkl-name {2}\n", oursRate, mklRate,
                     mkl->shortName)
          .str();
    });
  };
  sys::fs::file_status file;
  std::optional<Measurement> m;
  if (sys::fs::status(path, file))
    m = measureNow();
  else
    m = cachedMeasurement("blas",
                          formatv("{0}/{1}/{2}/{3}/{4}/v2", cpuModelName(), ours.config, path,
                                  file.getSize(),
                                  file.getLastModificationTime().time_since_epoch().count())
                              .str(),
                          measureNow, [](StringRef text) { return bool(parseMeasured(text)); });
  // Parsed from the text the cache keeps (to the tenth), so a cached run
  // decides and prints alike.
  return m ? parseMeasured(m->text) : None;
}

/// What PIPEC_BLAS asks for: unset, empty or "auto" the faster; None for
/// a word it does not know.
Optional<Optional<Kind>> asked() {
  const std::string &asked = machineSettings().blas;
  if (asked.empty() || asked == "auto")
    return Optional<Kind>();
  if (asked == "openblas")
    return Optional<Kind>(Kind::OpenBlas);
  if (asked == "mkl")
    return Optional<Kind>(Kind::Mkl);
  return None;
}

Chosen choose() {
  Library ours = openblas();
  Optional<Optional<Kind>> want = asked();
  if (!want) // check() reports it; a library without the tool falls back
    return {ours, "PIPEC_BLAS not understood"};
  if (*want == Kind::OpenBlas)
    return {ours, "PIPEC_BLAS=openblas"};
  std::string path = mklPath();
  Optional<Library> mkl;
  if (*want == Kind::Mkl) {
    mkl = loadMkl(path);
    return mkl ? Chosen{*mkl, "PIPEC_BLAS=mkl"}
               : Chosen{ours, "PIPEC_BLAS=mkl, but no MKL is installed"};
  }
  Optional<Measured> m = path.empty() ? None : measuredHere(ours, path, mkl);
  if (!m)
    return {ours, "no MKL installed"};
  if (m->mkl > 1.05 * m->ours) {
    if (!mkl)
      mkl = loadMkl(path);
    if (mkl)
      return {*mkl, formatv("measured {0:f0} GFLOP/s here against {1}'s {2:f0}", m->mkl,
                            ours.shortName, m->ours)};
  }
  if (mkl) { // loaded to measure and not called again: let its pages go
    if (auto freeBuffers = reinterpret_cast<void (*)()>(dlsym(mkl->handle, "MKL_Free_Buffers")))
      freeBuffers();
    dlclose(mkl->handle);
  }
  return {ours, formatv("measured {0:f0} GFLOP/s here against {1}'s {2:f0}", m->ours, m->mklName,
                        m->mkl)};
}

const Chosen &chosen() {
  static const Chosen c = choose(); // thread-safe: concurrent callers wait
  return c;
}

} // namespace

Error check() {
  (void)chosen(); // now, on one thread, rather than inside a rank's first GEMM
  Optional<Optional<Kind>> want = asked();
  if (!want)
    return createStringError(inconvertibleErrorCode(),
                             "PIPEC_BLAS=%s: expected openblas, mkl or auto",
                             machineSettings().blas.c_str());
  if (*want == Kind::Mkl && chosen().library.kind != Kind::Mkl)
    return createStringError(inconvertibleErrorCode(),
                             "PIPEC_BLAS=mkl: no MKL found (tools/fetch-mkl.sh installs it; "
                             "PIPEC_MKL_LIBRARY names another libmkl_rt.so.3)");
  return Error::success();
}

void sgemm(bool transA, bool transB, int m, int n, int k, float alpha, const float *a, int lda,
           const float *b, int ldb, float beta, float *c, int ldc) {
  chosen().library.sgemm(rowMajor, transA ? trans : noTrans, transB ? trans : noTrans, m, n, k,
                         alpha, a, lda, b, ldb, beta, c, ldc);
}

void dgemm(bool transA, bool transB, int m, int n, int k, double alpha, const double *a, int lda,
           const double *b, int ldb, double beta, double *c, int ldc) {
  chosen().library.dgemm(rowMajor, transA ? trans : noTrans, transB ? trans : noTrans, m, n, k,
                         alpha, a, lda, b, ldb, beta, c, ldc);
}

const char *config() { return chosen().library.config.c_str(); }

const char *coreName() { return chosen().library.core.c_str(); }

std::string name() {
  const Library &l = chosen().library;
  return l.shortName + " (" + l.core + " kernels)";
}

std::string reason() { return chosen().reason; }

std::string describe() {
  const Library &l = chosen().library;
  return l.shortName + " (" + l.core + " kernels; " + chosen().reason + ")";
}

int numThreads() {
  return chosen().library.kind == Kind::OpenBlas ? PIPEC_OPENBLAS_FN(openblas_get_num_threads)()
                                                 : 1;
}

void setNumThreads(int threads) {
  if (chosen().library.kind == Kind::OpenBlas)
    PIPEC_OPENBLAS_FN(openblas_set_num_threads)(threads);
}

} // namespace pipec::blas
