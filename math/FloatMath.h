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
// and tanh within 1.31 ulp (tests/FloatMathTest checks 2 ulp); NaN,
// infinities, overflow and underflow behave as libm's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MATH_FLOATMATH_H
#define PIPEC_MATH_FLOATMATH_H

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

/// e^c as p * 2^n: n = round(c / ln2) and p = e^r, r = c - n ln2, by the
/// degree-7 polynomial. No clamps or selects: the caller keeps c within
/// [-103.98, 88.72].
struct ReducedExp {
  float n;
  float p;
};
inline ReducedExp reducedExp(float c) {
  // n = round(c / ln2) by the 1.5 * 2^23 trick (no rounding call).
  const float shifter = 12582912.0f;
  float n = (c * 1.44269504088896341f + shifter) - shifter;
  // r = c - n ln2 in two steps; n * 0.693359375 is exact (9 + 8 bits).
  float r = c - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return {n, p};
}

/// e^x: +inf from 88.72 on, 0 below -103.98, subnormal between. Branch-free
/// (selects, no early returns), so that loops over it vectorise.
inline float exp(float x) {
  const float high = 88.7228394f, low = -103.972084f;
  float c = x < low ? low : x;
  c = c > high ? high : c;
  ReducedExp e = reducedExp(c);
  // Scale by 2^n in two halves, so that subnormal results and n = 128 work.
  int32_t k = static_cast<int32_t>(e.n);
  int32_t half = k / 2;
  float y = e.p * powerOfTwo(half) * powerOfTwo(k - half);
  y = x < low ? 0.0f : y;
  y = x >= high ? __builtin_inff() : y;
  return x != x ? x : y;
}

/// tanh(x): odd, +-1 beyond |x| = 9.1. Branch-free, as exp. Both forms
/// are computed on |x| and the sign put back last (which keeps -0). Above
/// 0.625 the result is at least 0.55 and 1 - 2 / (e + 1) shrinks e's
/// relative error, so e = exp(2|x|) needs no range checks: 2|x| <= 18.2
/// gives n in [0, 27], one power of two, no overflow or subnormal.
inline float tanh(float x) {
  float a = x < 0 ? -x : x;
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * a + a;
  // tanh(9.1) rounds to 1. exp's reduction, without its clamps and selects.
  float t = 2.0f * (a < 9.1f ? a : 9.1f);
  ReducedExp q = reducedExp(t);
  float e = q.p * powerOfTwo(static_cast<int32_t>(q.n));
  float large = 1.0f - 2.0f / (e + 1.0f);
  float y = __builtin_copysignf(a < 0.625f ? small : large, x);
  return x != x ? x : y;
}

} // namespace pipec::kernels::floatmath

#endif // PIPEC_MATH_FLOATMATH_H
