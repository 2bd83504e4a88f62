//===- OptimizerKernels.h - The optimizer's update on the CPU -----------===//
//
// OPTIMIZER_STEP's update of one weight (SGD, momentum or AdamW) runs the
// body every backend runs, kernels::optimizerElement (in double, stored in
// the weight's type), over a range of elements. Compiled for AVX-512, AVX2
// and baseline x86-64 with one loop per kind, so that the divisions and the
// square root go eight or four at a time: each element's arithmetic is the
// element loop's, in the same order, so the bits are too.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_OPTIMIZERKERNELS_H
#define PIPEC_RUNTIME_CPU_OPTIMIZERKERNELS_H

#include "runtime/kernels/KernelBodies.h"

#include <cstdint>

namespace pipec::cpu {

/// Elements [\p begin, \p end) of an update: the new weight into \p out,
/// the moments \p m and \p v in place (null where the kind keeps none).
void optimizerUpdate(const kernels::OptimizerParams &p, const float *w, const float *g, float *m,
                     float *v, float *out, int64_t begin, int64_t end);
void optimizerUpdate(const kernels::OptimizerParams &p, const double *w, const double *g, double *m,
                     double *v, double *out, int64_t begin, int64_t end);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_OPTIMIZERKERNELS_H
