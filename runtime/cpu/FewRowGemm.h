//===- FewRowGemm.h - A few rows by a weight as stored ---------*- C++ -*-===//
//
// gemm's paths for a decode step's products: a few rows of A by a weight B
// read where it lies, unpacked (FewRowGemm.cpp says why).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_FEWROWGEMM_H
#define PIPEC_RUNTIME_CPU_FEWROWGEMM_H

#include <cstdint>

namespace pipec::cpu {

/// The most rows of A that gemm gives fewRowsTransposed and fewRowsPlain:
/// up to these each outran the BLAS on every transformer shape measured
/// (docs/PERFORMANCE.md, "Runtime"); at 4 rows fewRowsPlain only matched it.
inline constexpr int64_t fewRowsTransposedMax = 32;
inline constexpr int64_t fewRowsPlainMax = 2;

/// Whether this CPU runs them (AVX2 and FMA, without AVX-512).
bool haveFewRowGemm();

/// Row-major C = alpha A B^T + beta C, A m x k (rows \p lda apart), B n x k
/// (rows \p ldb apart); with beta == 0, C is not read. Serial: gemm splits
/// C's columns over the rank's threads.
void fewRowsTransposed(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                       const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

/// Row-major C = alpha A B + beta C, A m x k, B k x n (rows \p ldb apart);
/// as fewRowsTransposed otherwise.
void fewRowsPlain(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                  const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_FEWROWGEMM_H
