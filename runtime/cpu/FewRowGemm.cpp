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
//    three at a time while up to four rows of A wait in cache.
//  - A B, B of k rows of n (a Linear whose transpose the exporter folded),
//    for one or two rows of A:
//    sixteen rows of B at a time are each read in sequence, every row of A
//    adding its multiples of them to its sums (one FMA per term, in k's
//    order).
//
// Each output's sum runs over k in one order (for A B^T eight lanes, then
// their sum, then the tail) whatever block or thread computes it, so the bits
// do not depend on the rank's threads.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/FewRowGemm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PIPEC_FEW_ROW_GEMM 1
#endif

namespace pipec::cpu {

#ifdef PIPEC_FEW_ROW_GEMM

namespace {

#define PIPEC_AVX2 __attribute__((target("avx2,fma")))

PIPEC_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// C's R x J block: rows of A at \p a, rows of B at \p b.
template <int R, int J>
PIPEC_AVX2 void dotBlock(int64_t k, float alpha, const float *a, int64_t lda, const float *b,
                         int64_t ldb, float beta, float *c, int64_t ldc) {
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      acc[r][j] = _mm256_setzero_ps();
  int64_t whole = k & ~int64_t(7);
  for (int64_t p = 0; p < whole; p += 8) {
    __m256 w[J];
    for (int j = 0; j < J; ++j)
      w[j] = _mm256_loadu_ps(b + j * ldb + p);
    for (int r = 0; r < R; ++r) {
      __m256 x = _mm256_loadu_ps(a + r * lda + p);
      for (int j = 0; j < J; ++j)
        acc[r][j] = _mm256_fmadd_ps(x, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float sum = sum8(acc[r][j]);
      for (int64_t p = whole; p < k; ++p)
        sum += a[r * lda + p] * b[j * ldb + p];
      float &out = c[r * ldc + j];
      out = beta == 0 ? alpha * sum : alpha * sum + beta * out;
    }
}

/// Columns [0, J) of C: every row of A against J rows of B, which stay in
/// cache from the first block of rows to the last.
template <int J>
PIPEC_AVX2 void dotColumns(int64_t m, int64_t k, float alpha, const float *a, int64_t lda,
                           const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4)
    dotBlock<4, J>(k, alpha, a + r * lda, lda, b, ldb, beta, c + r * ldc, ldc);
  switch (m - r) {
  case 3:
    dotBlock<3, J>(k, alpha, a + r * lda, lda, b, ldb, beta, c + r * ldc, ldc);
    break;
  case 2:
    dotBlock<2, J>(k, alpha, a + r * lda, lda, b, ldb, beta, c + r * ldc, ldc);
    break;
  case 1:
    dotBlock<1, J>(k, alpha, a + r * lda, lda, b, ldb, beta, c + r * ldc, ldc);
    break;
  default:
    break;
  }
}

/// The sums of R rows of A (rows \p lda apart) over \p kc rows of B, in
/// \p sums' first 8J columns (rows \p ldSums apart): started at zero when
/// \p first, else continued.
template <int R, int J>
PIPEC_AVX2 void axpyBlock(int64_t kc, bool first, const float *a, int64_t lda, const float *b,
                          int64_t ldb, float *sums, int64_t ldSums) {
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * ldSums + 8 * j);
  for (int64_t p = 0; p < kc; ++p) {
    __m256 w[J];
    for (int j = 0; j < J; ++j)
      w[j] = _mm256_loadu_ps(b + p * ldb + 8 * j);
    for (int r = 0; r < R; ++r) {
      __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      for (int j = 0; j < J; ++j)
        acc[r][j] = _mm256_fmadd_ps(x, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      _mm256_storeu_ps(sums + r * ldSums + 8 * j, acc[r][j]);
}

template <int J>
PIPEC_AVX2 void axpyRows(int64_t m, int64_t kc, bool first, const float *a, int64_t lda,
                         const float *b, int64_t ldb, float *sums, int64_t ldSums) {
  switch (m) {
  case 4:
    axpyBlock<4, J>(kc, first, a, lda, b, ldb, sums, ldSums);
    break;
  case 3:
    axpyBlock<3, J>(kc, first, a, lda, b, ldb, sums, ldSums);
    break;
  case 2:
    axpyBlock<2, J>(kc, first, a, lda, b, ldb, sums, ldSums);
    break;
  default:
    axpyBlock<1, J>(kc, first, a, lda, b, ldb, sums, ldSums);
    break;
  }
}

} // namespace

bool haveFewRowGemm() {
  // AVX-512 machines keep their BLAS: it runs 512-bit kernels there, which
  // these 256-bit loops were not measured against.
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !__builtin_cpu_supports("avx512f");
  return yes;
}

void fewRowsTransposed(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                       const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t j = 0;
  for (; j + 3 <= n; j += 3)
    dotColumns<3>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
  if (n - j == 2)
    dotColumns<2>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
  else if (n - j == 1)
    dotColumns<1>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
}

void fewRowsPlain(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                  const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  // Sixteen rows of B at a time, each read in sequence across its columns;
  // the sums so far wait in a buffer of C's size.
  const int64_t rowsOfB = 16;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(m * n));
  float *sums = buffer.data();
  for (int64_t p0 = 0; p0 < k; p0 += rowsOfB) {
    int64_t kc = std::min(rowsOfB, k - p0);
    bool first = p0 == 0;
    const float *ap = a + p0, *bp = b + p0 * ldb;
    int64_t j = 0;
    for (; j + 24 <= n; j += 24)
      axpyRows<3>(m, kc, first, ap, lda, bp + j, ldb, sums + j, n);
    for (; j + 8 <= n; j += 8)
      axpyRows<1>(m, kc, first, ap, lda, bp + j, ldb, sums + j, n);
    // The last columns one by one, each term one FMA as in the vectors.
    for (; j < n; ++j)
      for (int64_t r = 0; r < m; ++r) {
        float sum = first ? 0.0f : sums[r * n + j];
        for (int64_t p = 0; p < kc; ++p)
          sum = std::fma(ap[r * lda + p], bp[p * ldb + j], sum);
        sums[r * n + j] = sum;
      }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float &out = c[r * ldc + j];
      out = beta == 0 ? alpha * sums[r * n + j] : alpha * sums[r * n + j] + beta * out;
    }
}

#else

bool haveFewRowGemm() { return false; }

void fewRowsTransposed(int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                       int64_t, float, float *, int64_t) {}

void fewRowsPlain(int64_t, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                  float, float *, int64_t) {}

#endif

} // namespace pipec::cpu
