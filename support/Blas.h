//===- Blas.h - The BLAS pipec calls, under one set of names ------------===//
//
// pipec's BLAS is OpenBLAS. By default it is the build from PyPI's
// scipy-openblas32 wheel (tools/fetch-openblas.sh), whose every symbol is
// prefixed "scipy_" so that it never clashes with another OpenBLAS in the
// process; the portable bundle links Debian's OpenBLAS archive, unprefixed.
// CMake defines PIPEC_BLAS_PREFIX_SCIPY for the first. Everything else in
// pipec calls the functions here.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_BLAS_H
#define PIPEC_SUPPORT_BLAS_H

#include <cblas.h>

#ifdef PIPEC_BLAS_PREFIX_SCIPY
#define PIPEC_BLAS_FN(name) scipy_##name
#else
#define PIPEC_BLAS_FN(name) name
#endif

namespace pipec::blas {

/// Row-major C = alpha op(A) op(B) + beta C.
inline void sgemm(bool transA, bool transB, int m, int n, int k, float alpha, const float *a,
                  int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  PIPEC_BLAS_FN(cblas_sgemm)
  (CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, m, n, k,
   alpha, a, lda, b, ldb, beta, c, ldc);
}

inline void dgemm(bool transA, bool transB, int m, int n, int k, double alpha, const double *a,
                  int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  PIPEC_BLAS_FN(cblas_dgemm)
  (CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, m, n, k,
   alpha, a, lda, b, ldb, beta, c, ldc);
}

/// OpenBLAS's build line: version, DYNAMIC_ARCH, and the CPU kernel it
/// chose for this machine ("OpenBLAS 0.3.34 DYNAMIC_ARCH ... SkylakeX").
inline const char *config() { return PIPEC_BLAS_FN(openblas_get_config)(); }

/// The CPU kernel OpenBLAS runs here ("SkylakeX", "Haswell", "Zen").
inline const char *coreName() { return PIPEC_BLAS_FN(openblas_get_corename)(); }

inline int numThreads() { return PIPEC_BLAS_FN(openblas_get_num_threads)(); }

/// The threads of OpenBLAS's pool, process-wide.
inline void setNumThreads(int threads) { PIPEC_BLAS_FN(openblas_set_num_threads)(threads); }

} // namespace pipec::blas

#endif // PIPEC_SUPPORT_BLAS_H
