//===- OptimizerKernels.cpp - The optimizer's update on the CPU ---------===//
#include "runtime/cpu/OptimizerKernels.h"
#include "runtime/cpu/KernelSupport.h"

namespace pipec::cpu {

namespace {

/// The update of kind \p Kind: a constant kind folds optimizerElement's
/// branches away, leaving a loop the compiler vectorises.
template <int Kind, typename T>
inline void updateOfKind(const kernels::OptimizerParams &given, const T *w, const T *g, T *m, T *v,
                         T *out, int64_t begin, int64_t end) {
  kernels::OptimizerParams p = given;
  p.kind = Kind;
  for (int64_t i = begin; i < end; ++i)
    kernels::optimizerElement<T>(i, p, w, g, m, v, out, m, v);
}

template <typename T>
inline void update(const kernels::OptimizerParams &p, const T *w, const T *g, T *m, T *v, T *out,
                   int64_t begin, int64_t end) {
  if (p.kind == 0)
    updateOfKind<0>(p, w, g, m, v, out, begin, end);
  else if (p.kind == 1)
    updateOfKind<1>(p, w, g, m, v, out, begin, end);
  else
    updateOfKind<2>(p, w, g, m, v, out, begin, end);
}

} // namespace

PIPEC_VECTOR_CLONES void optimizerUpdate(const kernels::OptimizerParams &p, const float *w,
                                         const float *g, float *m, float *v, float *out,
                                         int64_t begin, int64_t end) {
  update(p, w, g, m, v, out, begin, end);
}

PIPEC_VECTOR_CLONES void optimizerUpdate(const kernels::OptimizerParams &p, const double *w,
                                         const double *g, double *m, double *v, double *out,
                                         int64_t begin, int64_t end) {
  update(p, w, g, m, v, out, begin, end);
}

} // namespace pipec::cpu
