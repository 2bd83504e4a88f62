//===- FewRowGemm.cpp - A few rows by a weight as stored -----------------===//
//
// A decode step multiplies a few rows (its tokens) by each Linear's weight.
// A BLAS packs the weight into panels before each product; with few rows the
// packing costs as much as the product, and the step is bound by streaming
// the weights from memory anyway. Here the weight is read where it lies,
// once:
//
//  - A B^T, B as torch stores a Linear's weight (n rows of k): each output
//    is the dot product of its row of A and its row of B. B's rows are read
//    a few at a time while up to four rows of A wait in cache.
//  - A B, B of k rows of n (a Linear whose transpose the exporter folded, or
//    GPT-2's Conv1D), a block of rows of A at a time: sixteen rows of B at a time
//    are each read in sequence, every row of A adding its multiples of them
//    to its sums (one FMA per term, in k's order).
//
// Each output's sum runs over k in one order (for A B^T a vector's lanes,
// then their sum, then the tail) whatever block or thread computes it, so
// the bits do not depend on the rank's threads. They do depend on the
// target's vector width: a CPU keeps one choice (fewRowChoice).
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/FewRowGemm.h"
#include "support/Blas.h"
#include "support/MachineCache.h"

#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PIPEC_FEW_ROW_GEMM 1
#endif

using namespace llvm;

namespace pipec::cpu {

#ifdef PIPEC_FEW_ROW_GEMM

// Each target's loops: FewRowGemmBody.inc compiled in a region of its own,
// so that nothing outside it is compiled for that target.

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
namespace {
using Vec = __m256;
constexpr int lanes = 8, dotRows = 4, dotColumns = 3, axpyRows = 4, axpyColumns = 3;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float *p) { return _mm256_loadu_ps(p); }
inline void store(float *p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(const float *p) { return _mm256_broadcast_ss(p); }
inline Vec fma(Vec x, Vec y, Vec acc) { return _mm256_fmadd_ps(x, y, acc); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#include "runtime/cpu/FewRowGemmBody.inc"
} // namespace
} // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
// GCC 12's own 512-bit casts and shuffles start from a deliberately
// undefined vector, which it then warns about (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace avx512 {
namespace {
using Vec = __m512;
constexpr int lanes = 16, dotRows = 6, dotColumns = 4, axpyRows = 8, axpyColumns = 3;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float *p) { return _mm512_loadu_ps(p); }
inline void store(float *p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(const float *p) { return _mm512_set1_ps(*p); }
inline Vec fma(Vec x, Vec y, Vec acc) { return _mm512_fmadd_ps(x, y, acc); }
/// The two halves added, then AVX2's sum of eight.
inline float sum(Vec v) {
  return avx2::sum(_mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#include "runtime/cpu/FewRowGemmBody.inc"
} // namespace
} // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace {
constexpr FewRowKernels avx512Kernels{"AVX-512", avx512::transposed, avx512::plain};
constexpr FewRowKernels avx2Kernels{"AVX2", avx2::transposed, avx2::plain};
} // namespace

const std::vector<const FewRowKernels *> &fewRowKernelsHere() {
  static const std::vector<const FewRowKernels *> here = [] {
    std::vector<const FewRowKernels *> out;
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && __builtin_cpu_supports("avx512f"))
      out.push_back(&avx512Kernels);
    if (avx2)
      out.push_back(&avx2Kernels);
    return out;
  }();
  return here;
}

#else

const std::vector<const FewRowKernels *> &fewRowKernelsHere() {
  static const std::vector<const FewRowKernels *> none;
  return none;
}

#endif

void fewRowsPlain(const FewRowKernels &kernels, int64_t m, int64_t n, int64_t k, float alpha,
                  const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                  int64_t ldc) {
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(m * n));
  kernels.plain(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, buffer.data());
}

namespace {

/// The row counts each form is measured at.
SmallVector<int64_t, 8> rowCounts(bool transposed) {
  SmallVector<int64_t, 8> rows;
  for (int64_t r = 1; r <= (transposed ? fewRowsTransposedMax : fewRowsPlainMax); r *= 2)
    rows.push_back(r);
  return rows;
}

/// GFLOP/s at each row count of each form, for the BLAS (index 0) and each
/// target here, in one line per form and candidate: "transposed AVX2 6.8
/// 11.9 ..." (the rates in rowCounts' order).
std::string measureRates() {
  // GPT-2's feed-forward weight, 3072 x 768 (9 MiB): two copies taken in
  // turn, so that each product reads its weight from past the core's caches
  // as a decode step does.
  const int64_t n = 3072, k = 768, copies = 2;
  std::vector<float> w(copies * n * k), a(fewRowsTransposedMax * k), c(fewRowsTransposedMax * n),
      sums(fewRowsTransposedMax * n);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = float((i * 7919) % 2001) * 1e-3f - 1.0f;
  for (size_t i = 0; i < a.size(); ++i)
    a[i] = float((i * 104729) % 2003) * 1e-3f - 1.0f;
  const std::vector<const FewRowKernels *> &here = fewRowKernelsHere();
  int64_t turn = 0;
  auto seconds = [&](bool transposed, int64_t rows, const FewRowKernels *kernels) {
    const float *b = w.data() + (turn++ % copies) * n * k;
    auto start = std::chrono::steady_clock::now();
    if (!kernels)
      blas::sgemm(false, transposed, int(rows), int(n), int(k), 1.0f, a.data(), int(k), b,
                  int(transposed ? k : n), 0.0f, c.data(), int(n));
    else if (transposed)
      kernels->transposed(rows, n, k, 1.0f, a.data(), k, b, k, 0.0f, c.data(), n);
    else
      kernels->plain(rows, n, k, 1.0f, a.data(), k, b, n, 0.0f, c.data(), n, sums.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int threads = blas::numThreads();
  blas::setNumThreads(1);
  std::string out;
  for (bool transposed : {true, false}) {
    SmallVector<int64_t, 8> rows = rowCounts(transposed);
    // [candidate][row count] -> the times of each round, taken in turns.
    std::vector<std::vector<std::vector<double>>> times(
        here.size() + 1, std::vector<std::vector<double>>(rows.size()));
    for (int round = 0; round < 8; ++round)
      for (size_t r = 0; r < rows.size(); ++r)
        for (size_t i = 0; i <= here.size(); ++i) {
          double t = seconds(transposed, rows[r], i == 0 ? nullptr : here[i - 1]);
          if (round > 0) // the first warms caches and first-call setup
            times[i][r].push_back(t);
        }
    for (size_t i = 0; i <= here.size(); ++i) {
      out += transposed ? "transposed " : "plain ";
      out += i == 0 ? "BLAS" : here[i - 1]->target;
      for (size_t r = 0; r < rows.size(); ++r) {
        std::vector<double> &v = times[i][r];
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        out += formatv(" {0:f1}", 2.0 * double(rows[r]) * n * k / v[v.size() / 2] * 1e-9).str();
      }
      out += "\n";
    }
  }
  blas::setNumThreads(threads);
  return out;
}

/// The rates of one form's candidates, by name ("BLAS", "AVX2", ...).
struct FormRates {
  SmallVector<std::pair<std::string, SmallVector<double, 8>>, 3> candidates;
};

/// \p text's rates per form; nullopt unless every line is whole and the
/// BLAS and every target here are measured in both forms.
std::optional<std::pair<FormRates, FormRates>> parseRates(StringRef text) {
  FormRates transposed, plain;
  SmallVector<StringRef, 8> lines;
  text.split(lines, '\n', -1, /*KeepEmpty=*/false);
  for (StringRef line : lines) {
    SmallVector<StringRef, 10> words;
    line.split(words, ' ', -1, /*KeepEmpty=*/false);
    if (words.size() < 3 || (words[0] != "transposed" && words[0] != "plain"))
      return std::nullopt;
    bool isTransposed = words[0] == "transposed";
    // "AVX-512" is one word; a target's name has no space.
    SmallVector<double, 8> rates;
    for (StringRef word : ArrayRef<StringRef>(words).drop_front(2)) {
      double rate;
      if (word.getAsDouble(rate) || !(rate > 0))
        return std::nullopt;
      rates.push_back(rate);
    }
    if (rates.size() != rowCounts(isTransposed).size())
      return std::nullopt;
    (isTransposed ? transposed : plain).candidates.push_back({words[1].str(), rates});
  }
  size_t want = fewRowKernelsHere().size() + 1;
  if (transposed.candidates.size() != want || plain.candidates.size() != want)
    return std::nullopt;
  return std::pair{transposed, plain};
}

/// One form's choice from its rates: the target with the most rows up to
/// which it outran the BLAS at every count by 3%, ties to the larger sum of
/// its rates over them; and the phrase that says so.
std::pair<const FewRowKernels *, int64_t> chooseForm(const FormRates &rates, bool transposed,
                                                     std::string &reason) {
  SmallVector<int64_t, 8> rows = rowCounts(transposed);
  const SmallVector<double, 8> &blasRates = rates.candidates[0].second;
  const FewRowKernels *best = nullptr;
  size_t bestReach = 0; // row counts it outran the BLAS at
  double bestSum = 0, bestAtOne = 0, bestAtMost = 0;
  for (const auto &[name, rate] : makeArrayRef(rates.candidates).drop_front()) {
    size_t reach = 0;
    double sum = 0;
    for (; reach < rows.size() && rate[reach] > 1.03 * blasRates[reach]; ++reach)
      sum += rate[reach];
    if (reach > bestReach || (reach > 0 && reach == bestReach && sum > bestSum)) {
      for (const FewRowKernels *k : fewRowKernelsHere())
        if (name == k->target)
          best = k;
      bestReach = reach;
      bestSum = sum;
      bestAtOne = rate[0];
      bestAtMost = rate[reach - 1];
    }
  }
  reason += transposed ? "A B^T: " : "A B: ";
  if (!best) {
    reason += "the BLAS (1 row:";
    for (const auto &[name, rate] : makeArrayRef(rates.candidates).drop_front())
      reason += formatv(" {0} {1:f1},", name, rate[0]).str();
    reason += formatv(" the BLAS {0:f1} GFLOP/s)", blasRates[0]).str();
    return {nullptr, 0};
  }
  int64_t bestRows = rows[bestReach - 1];
  reason +=
      formatv("{0} up to {1} rows (1 row: {2:f1} GFLOP/s, the BLAS {3:f1}; {1} rows: {4:f1}, "
              "the BLAS {5:f1})",
              best->target, bestRows, bestAtOne, blasRates[0], bestAtMost, blasRates[bestReach - 1])
          .str();
  return {best, bestRows};
}

FewRowChoice choose() {
  if (fewRowKernelsHere().empty()) {
    FewRowChoice none;
    none.reason = "the BLAS (this CPU has no AVX2 and FMA)";
    return none;
  }
  std::string targets;
  for (const FewRowKernels *k : fewRowKernelsHere())
    targets += std::string(k->target) + ",";
  std::optional<Measurement> m = cachedMeasurement(
      "few-row",
      formatv("{0}/{1}/{2}/{3}/v1", cpuModelName(), blas::config(), blas::name(), targets).str(),
      [] { return measureMarked([] { return std::optional<std::string>(measureRates()); }); },
      [](StringRef text) { return bool(parseRates(text)); });
  if (!m) {
    FewRowChoice none;
    none.reason = "the BLAS (the measurement failed)";
    return none;
  }
  FewRowChoice choice = chooseFewRowKernels(m->text);
  if (m->disturbed)
    choice.reason += " (measured while the machine was busy)";
  return choice;
}

} // namespace

FewRowChoice chooseFewRowKernels(const std::string &rates) {
  FewRowChoice choice;
  std::optional<std::pair<FormRates, FormRates>> parsed = parseRates(rates);
  if (!parsed) {
    choice.reason = "the BLAS (the measurement failed)";
    return choice;
  }
  std::tie(choice.transposed, choice.transposedRows) =
      chooseForm(parsed->first, /*transposed=*/true, choice.reason);
  choice.reason += "; ";
  std::tie(choice.plain, choice.plainRows) =
      chooseForm(parsed->second, /*transposed=*/false, choice.reason);
  return choice;
}

const FewRowChoice &fewRowChoice() {
  static const FewRowChoice c = choose(); // thread-safe: concurrent callers wait
  return c;
}

std::string describeFewRowChoice() {
  const FewRowChoice &c = fewRowChoice();
  if (!c.transposed && !c.plain)
    return "no few-row loops";
  std::string out = "few-row loops";
  if (c.transposed)
    out += formatv(" {0} for A B^T up to {1} rows", c.transposed->target, c.transposedRows).str();
  if (c.plain)
    out +=
        formatv("{0} {1} for A B up to {2}", c.transposed ? "," : "", c.plain->target, c.plainRows)
            .str();
  return out;
}

} // namespace pipec::cpu
