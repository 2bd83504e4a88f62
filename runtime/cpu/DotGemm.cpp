//===- DotGemm.cpp - Few-row products by a weight read as stored ---------===//
//
// C = alpha A B^T + beta C for an A of a few rows (a decode step's tokens) and
// a B of n rows of k (a Linear's weight as torch stores it, read transposed).
// A BLAS packs B into panels before each product; with few rows of A the
// packing costs as much as the product, and a decode step is bound by
// streaming the weights from memory anyway. Here each output is the dot
// product of its row of A and its row of B: B's rows are read where they are,
// once, three at a time, while up to four rows of A wait in cache.
//
// Each output's sum runs over k in one order (eight lanes, then their sum,
// then the tail) whatever block or thread computes it, so the bits do not
// depend on the rank's threads.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/DotGemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PIPEC_DOT_GEMM 1
#endif

namespace pipec::cpu {

#ifdef PIPEC_DOT_GEMM

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

} // namespace

bool haveDotGemm() {
  // AVX-512 machines keep their BLAS: it runs 512-bit kernels there, which
  // these 256-bit dot products were not measured against.
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !__builtin_cpu_supports("avx512f");
  return yes;
}

void dotGemm(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
             const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  int64_t j = 0;
  for (; j + 3 <= n; j += 3)
    dotColumns<3>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
  if (n - j == 2)
    dotColumns<2>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
  else if (n - j == 1)
    dotColumns<1>(m, k, alpha, a, lda, b + j * ldb, ldb, beta, c + j, ldc);
}

#else

bool haveDotGemm() { return false; }

void dotGemm(int64_t, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
             float, float *, int64_t) {}

#endif

} // namespace pipec::cpu
