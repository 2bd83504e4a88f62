//===- Blas.h - The BLAS pipec calls, chosen for the CPU it runs on ------===//
//
// pipec's GEMMs go to one of two libraries, chosen once per process:
//
// - OpenBLAS, linked. By default the build from PyPI's scipy-openblas32
//   wheel (tools/fetch-openblas.sh), whose every symbol is prefixed
//   "scipy_" so that it never clashes with another OpenBLAS in the process;
//   the portable bundle links Debian's OpenBLAS archive, unprefixed. CMake
//   defines PIPEC_BLAS_PREFIX_SCIPY for the first.
// - Intel's MKL from PyPI's mkl wheel (tools/fetch-mkl.sh), loaded with
//   dlopen when present, on its sequential threading layer and in its
//   strict reproducible mode (the same bits whatever the operands'
//   alignment).
//
// Which one: PIPEC_BLAS=openblas or PIPEC_BLAS=mkl in the environment says;
// otherwise the faster of the two on single-threaded GEMMs of transformer
// shapes, measured the first time this CPU, OpenBLAS build and MKL file are
// seen and cached beside the `cpu` spec (PIPEC_CACHE_DIR, else
// $XDG_CACHE_HOME/pipec, else ~/.cache/pipec). OpenBLAS keeps ties: MKL must
// be 5% faster. Without MKL installed the choice is OpenBLAS. MKL is loaded
// only to measure it or to call it.
//
// Everything else in pipec calls the functions here; the first call makes
// the choice (concurrent first calls wait for one).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_BLAS_H
#define PIPEC_SUPPORT_BLAS_H

#include "llvm/Support/Error.h"

#include <string>

namespace pipec::blas {

/// An error naming PIPEC_BLAS when it asks for what cannot be had (a word
/// other than openblas, mkl or auto; mkl where none is installed). The
/// choice itself never fails: it falls back to OpenBLAS, and reason() says
/// why. Makes the choice, so that a measurement runs on a quiet thread:
/// `pipec` calls this first.
llvm::Error check();

/// Row-major C = alpha op(A) op(B) + beta C.
void sgemm(bool transA, bool transB, int m, int n, int k, float alpha, const float *a, int lda,
           const float *b, int ldb, float beta, float *c, int ldc);

void dgemm(bool transA, bool transB, int m, int n, int k, double alpha, const double *a, int lda,
           const double *b, int ldb, double beta, double *c, int ldc);

/// The chosen library's build line: OpenBLAS's ("OpenBLAS 0.3.34
/// DYNAMIC_ARCH ... SkylakeX") or MKL's version string.
const char *config();

/// The CPU kernels the chosen library runs here ("SkylakeX", "Haswell" for
/// OpenBLAS; "AVX2", "AVX-512" for MKL).
const char *coreName();

/// "OpenBLAS 0.3.34 (Haswell kernels)", "MKL 2026.2.1 (AVX-512 kernels)".
std::string name();

/// Why it was chosen: "PIPEC_BLAS=mkl", "no MKL installed", "measured 91
/// GFLOP/s here against MKL 2026.2's 83" (the loser second).
std::string reason();

/// Both, for `pipec --version` and the run's `cpu:` line: "OpenBLAS
/// 0.3.34.481.3 (Haswell kernels; no MKL installed)".
std::string describe();

int numThreads();

/// The threads of the library's own pool, process-wide. MKL runs on its
/// sequential layer and ignores it: pipec splits GEMMs over its own threads.
void setNumThreads(int threads);

} // namespace pipec::blas

#endif // PIPEC_SUPPORT_BLAS_H
