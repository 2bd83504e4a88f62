//===- FloatMathTest.cpp - The host's float exp and tanh ------------------===//
//
// math/FloatMath.h against libm's double exp and tanh rounded to
// float (the reference): the error in units in the last place of the
// reference, over every 61st float of the ranges that matter and the
// special values.
//
//===----------------------------------------------------------------------===//
#include "math/FloatMath.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

using namespace pipec::kernels;

namespace {

/// |got - want| in units of want's last place (the subnormal spacing below
/// the smallest normal).
double ulpError(float got, double want) {
  float rounded = static_cast<float>(want);
  double ulp = std::fabs(double(std::nextafter(rounded, std::numeric_limits<float>::infinity())) -
                         double(rounded));
  if (std::isinf(ulp) || ulp == 0)
    ulp = std::ldexp(1.0, -149);
  return std::fabs(double(got) - want) / ulp;
}

float fromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

/// The largest error of \p f against \p reference over every 61st float
/// (by bit pattern) of [lo, hi], both of the same sign.
template <typename F, typename R> double worstOver(float lo, float hi, F f, R reference) {
  uint32_t a, b;
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
  if (a > b)
    std::swap(a, b);
  double worst = 0;
  for (uint32_t bits = a; bits <= b && bits >= a; bits += 61) {
    float x = fromBits(bits);
    worst = std::max(worst, ulpError(f(x), reference(double(x))));
  }
  return worst;
}

/// The largest error of \p f against \p reference over [lo, -0], [0, hi]
/// and the small positive floats [1e-30, 1e-3], each by worstOver.
template <typename F, typename R> double worstAcross(float lo, float hi, F f, R reference) {
  return std::max({worstOver(0.0f, hi, f, reference), worstOver(-0.0f, lo, f, reference),
                   worstOver(1e-30f, 1e-3f, f, reference)});
}

TEST(FloatMath, ExpWithinTwoUlp) {
  EXPECT_LE(worstAcross(-103.9f, 88.72f, floatmath::exp, [](double x) { return std::exp(x); }),
            2.0);
  EXPECT_EQ(floatmath::exp(0.0f), 1.0f);
  EXPECT_EQ(floatmath::exp(89.0f), std::numeric_limits<float>::infinity());
  EXPECT_EQ(floatmath::exp(std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(floatmath::exp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(floatmath::exp(-std::numeric_limits<float>::max()), 0.0f);
  EXPECT_TRUE(std::isnan(floatmath::exp(std::numeric_limits<float>::quiet_NaN())));
  // A subnormal result, as libm gives it.
  EXPECT_NEAR(floatmath::exp(-100.0f), std::exp(-100.0), std::ldexp(1.0, -148));
  EXPECT_GT(floatmath::exp(-103.0f), 0.0f);
}

TEST(FloatMath, TanhWithinTwoUlp) {
  EXPECT_LE(worstAcross(-12.0f, 12.0f, floatmath::tanh, [](double x) { return std::tanh(x); }),
            2.0);
  EXPECT_EQ(floatmath::tanh(0.0f), 0.0f);
  EXPECT_TRUE(std::signbit(floatmath::tanh(-0.0f)));
  EXPECT_EQ(floatmath::tanh(20.0f), 1.0f);
  EXPECT_EQ(floatmath::tanh(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_TRUE(std::isnan(floatmath::tanh(std::numeric_limits<float>::quiet_NaN())));
}

} // namespace
