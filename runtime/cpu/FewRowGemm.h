//===- FewRowGemm.h - A few rows by a weight as stored ---------*- C++ -*-===//
//
// gemm's paths for a decode step's products: a few rows of A by a weight B
// read where it lies, unpacked (FewRowGemm.cpp says why). One source
// (FewRowGemmBody.inc) compiled for AVX-512 and for AVX2; which of them, if
// either, outruns the BLAS, and up to how many rows, is measured once per
// CPU and cached, never guessed from the CPU's name.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_FEWROWGEMM_H
#define PIPEC_RUNTIME_CPU_FEWROWGEMM_H

#include <cstdint>
#include <string>
#include <vector>

namespace pipec::cpu {

/// The most rows of A each form's loops are measured at (1, 2, 4, ... up
/// to these) and so may be given. On the CPUs measured the BLAS's packed
/// panels had caught up by then (docs/PERFORMANCE.md).
inline constexpr int64_t fewRowsTransposedMax = 32;
inline constexpr int64_t fewRowsPlainMax = 16;

/// The loops compiled for one target.
struct FewRowKernels {
  /// "AVX-512" or "AVX2".
  const char *target;
  /// Row-major C = alpha A B^T + beta C, A m x k (rows \p lda apart), B n x
  /// k (rows \p ldb apart); with beta == 0, C is not read. Serial: gemm
  /// splits C's columns over the rank's threads.
  void (*transposed)(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                     const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
  /// Row-major C = alpha A B + beta C, A m x k, B k x n (rows \p ldb
  /// apart); \p sums holds m n floats.
  void (*plain)(int64_t m, int64_t n, int64_t k, float alpha, const float *a, int64_t lda,
                const float *b, int64_t ldb, float beta, float *c, int64_t ldc, float *sums);
};

/// The targets this CPU runs, widest first; none off x86-64 or without
/// AVX2 and FMA.
const std::vector<const FewRowKernels *> &fewRowKernelsHere();

/// What gemm gives the loops here: for each form, the target that outran the
/// BLAS by 3% at every row count measured (1, 2, 4, ... up to the form's
/// maximum) up to the most rows, and those rows; of two that reach as far,
/// the faster over them. Measured on one
/// thread the first time this CPU and BLAS are seen, and cached beside the
/// BLAS's choice (support/MachineCache.h's rules for a busy machine).
struct FewRowChoice {
  const FewRowKernels *transposed = nullptr;
  int64_t transposedRows = 0;
  const FewRowKernels *plain = nullptr;
  int64_t plainRows = 0;
  /// "A B^T: AVX-512 up to 16 rows (1 row: 14.0 GFLOP/s, the BLAS 6.3; 16
  /// rows: 81.7, the BLAS 68.8); A B: the BLAS (1 row: AVX2 4.1, the BLAS
  /// 4.7 GFLOP/s)".
  std::string reason;
};
const FewRowChoice &fewRowChoice();

/// The choice from measured rates, as the cache keeps them: a line per form
/// and candidate, "transposed BLAS 6.5 13.6 ..." and "plain AVX2 14.1 ...",
/// GFLOP/s at 1, 2, 4, ... rows; the BLAS and every target this CPU runs
/// (fewRowKernelsHere) in both forms, or the choice is the BLAS.
FewRowChoice chooseFewRowKernels(const std::string &rates);

/// The choice in a few words, for the run's `cpu:` line: "few-row loops
/// AVX-512 (A B^T up to 16 rows, A B up to 2)", or "no few-row loops".
std::string describeFewRowChoice();

/// \p kernels' A B (FewRowKernels::plain) with a buffer of the thread's.
void fewRowsPlain(const FewRowKernels &kernels, int64_t m, int64_t n, int64_t k, float alpha,
                  const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                  int64_t ldc);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_FEWROWGEMM_H
