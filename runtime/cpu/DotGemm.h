//===- DotGemm.h - Few-row products by a weight read as stored -*- C++ -*-===//
//
// gemm's path for A B^T with few rows of A (DotGemm.cpp says why).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_DOTGEMM_H
#define PIPEC_RUNTIME_CPU_DOTGEMM_H

#include <cstdint>

namespace pipec::cpu {

/// The most rows of A that gemm gives dotGemm: up to here it outran the
/// BLAS on every transformer shape measured (docs/PERFORMANCE.md).
inline constexpr int64_t dotGemmMaxRows = 32;

/// Whether this CPU runs dotGemm (AVX2 and FMA, without AVX-512).
bool haveDotGemm();

/// Row-major C = alpha A B^T + beta C, A m x k (rows \p lda apart), B n x k
/// (rows \p ldb apart); with beta == 0, C is not read. Serial: gemm splits
/// C's columns over the rank's threads.
void dotGemm(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
             const float *b, int64_t ldb, float beta, float *c, int64_t ldc);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_DOTGEMM_H
