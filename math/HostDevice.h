//===- HostDevice.h - Functions that compile for the host and the device -===//
//
// PIPEC_HD marks a function of runtime/kernels that the CPU kernels call on
// the host and the CUDA kernels on the device (PIPEC_HD_INLINE one that is
// always inlined). The math shims below give
// one name per libm function with a float and a double overload, so that a
// kernel body templated on its element type calls sinf for float and sin
// for double on both sides (the host's std:: overloads do the same); the
// host's float exp and tanh are FloatMath.h's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MATH_HOSTDEVICE_H
#define PIPEC_MATH_HOSTDEVICE_H

#include "math/FloatMath.h"

#include <math.h>

#if defined(__CUDACC__)
#define PIPEC_HD __host__ __device__ inline
#define PIPEC_HD_INLINE __host__ __device__ __forceinline__
#else
#define PIPEC_HD inline
// Row functions the CPU calls from its vector clones (PIPEC_VECTOR_CLONES):
// inlined, so that each clone vectorises them for its own target.
#define PIPEC_HD_INLINE [[gnu::always_inline]] inline
#endif

namespace pipec::kernels::math {

#define PIPEC_MATH_UNARY(NAME)                                                                     \
  PIPEC_HD float NAME(float x) { return ::NAME##f(x); }                                            \
  PIPEC_HD double NAME(double x) { return ::NAME(x); }
PIPEC_MATH_UNARY(acos)
PIPEC_MATH_UNARY(acosh)
PIPEC_MATH_UNARY(asin)
PIPEC_MATH_UNARY(asinh)
PIPEC_MATH_UNARY(atan)
PIPEC_MATH_UNARY(atanh)
PIPEC_MATH_UNARY(ceil)
PIPEC_MATH_UNARY(cos)
PIPEC_MATH_UNARY(cosh)
PIPEC_MATH_UNARY(erf)
PIPEC_MATH_UNARY(expm1)
PIPEC_MATH_UNARY(floor)
PIPEC_MATH_UNARY(log)
PIPEC_MATH_UNARY(log1p)
PIPEC_MATH_UNARY(nearbyint)
PIPEC_MATH_UNARY(sin)
PIPEC_MATH_UNARY(sinh)
PIPEC_MATH_UNARY(sqrt)
PIPEC_MATH_UNARY(tan)
#undef PIPEC_MATH_UNARY

// Float exp and tanh: on the host pipec's own (FloatMath.h), on the device
// CUDA's.
#if defined(__CUDA_ARCH__)
PIPEC_HD float exp(float x) { return ::expf(x); }
PIPEC_HD float tanh(float x) { return ::tanhf(x); }
#else
PIPEC_HD float exp(float x) { return floatmath::exp(x); }
PIPEC_HD float tanh(float x) { return floatmath::tanh(x); }
#endif
PIPEC_HD double exp(double x) { return ::exp(x); }
PIPEC_HD double tanh(double x) { return ::tanh(x); }

PIPEC_HD float pow(float x, float y) { return ::powf(x, y); }
PIPEC_HD double pow(double x, double y) { return ::pow(x, y); }
PIPEC_HD float fmod(float x, float y) { return ::fmodf(x, y); }
PIPEC_HD double fmod(double x, double y) { return ::fmod(x, y); }

/// NaN test that works for every arithmetic type (integers are never NaN).
template <typename T> PIPEC_HD bool isNan(T x) { return x != x; }

} // namespace pipec::kernels::math

#endif // PIPEC_MATH_HOSTDEVICE_H
