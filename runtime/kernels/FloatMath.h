//===- FloatMath.h - exp and tanh of floats without libm ------------------===//
//
// The host's float exp and tanh, for the element-wise kernels and softmax.
// glibc's expf and tanhf (which calls expm1f) are correct to the last bit
// but take a call, branches and, for very negative arguments, a slow
// underflow path per element; on the benchmark GPT they were a third of the
// CPU time of a forward. These are branch-light polynomials the compiler
// can inline and vectorise, after Cephes' expf and tanhf (S. L. Moshier,
// "Methods and Programs for Mathematical Functions", 1989): exp by
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-7
// polynomial in r; tanh by an odd polynomial below 0.625 and
// 1 - 2 / (exp(2|x|) + 1) above. Against libm's double precision over
// every third float, exp is within 0.98 ulp (subnormal results included)
// and tanh within 1.33 ulp (tests/FloatMathTest checks 2 ulp); NaN,
// infinities, overflow and underflow behave as libm's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_FLOATMATH_H
#define PIPEC_RUNTIME_KERNELS_FLOATMATH_H

#include <cstdint>
#include <cstring>

namespace pipec::kernels::floatmath {

/// 2^n for n in [-126, 127], from its bits.
inline float powerOfTwo(int32_t n) {
  uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// e^x, within 2 ulp; +inf above 88.72, 0 below -103.98 and subnormal
/// between.
inline float exp(float x) {
  if (!(x < 88.7228394f)) // NaN, or too large for a float
    return x != x ? x : __builtin_inff();
  if (x < -103.972084f)
    return 0.0f;
  // n = round(x / ln2) by the 1.5 * 2^23 trick (no rounding call).
  const float shifter = 12582912.0f;
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  // r = x - n ln2 in two steps; n * 0.693359375 is exact (9 + 8 bits).
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // Scale by 2^n in two halves, so that subnormal results and n = 128 work.
  int32_t k = static_cast<int32_t>(n);
  int32_t half = k / 2;
  return p * powerOfTwo(half) * powerOfTwo(k - half);
}

/// tanh(x), within 2 ulp; odd, +-1 beyond |x| = 9.1.
inline float tanh(float x) {
  float a = x < 0 ? -x : x;
  float y;
  if (x == 0)
    return x; // keeps -0
  if (a < 0.625f) {
    float z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    return p * z * x + x;
  }
  if (a > 9.1f) // including +-inf; tanh(9.1) rounds to 1
    y = 1.0f;
  else if (a == a)
    y = 1.0f - 2.0f / (floatmath::exp(a + a) + 1.0f);
  else
    return x; // NaN
  return x < 0 ? -y : y;
}

} // namespace pipec::kernels::floatmath

#endif // PIPEC_RUNTIME_KERNELS_FLOATMATH_H
