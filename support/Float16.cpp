//===- Float16.cpp - IEEE half and bfloat16 conversions ------------------===//
#include "support/Float16.h"

#include <cmath>
#include <cstring>

namespace pipec {
namespace {

uint32_t floatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

float bitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

} // namespace

uint16_t floatToHalf(float value) {
  uint32_t bits = floatBits(value);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t absBits = bits & 0x7fffffff;
  if (absBits >= 0x7f800000) // Inf or NaN; keep NaN quiet.
    return sign | (absBits > 0x7f800000 ? 0x7e00 : 0x7c00);
  if (absBits >= 0x477ff000) // Rounds to a value above the largest half.
    return sign | 0x7c00;
  if (absBits < 0x38800000) {
    // Subnormal half (or zero): scale so that the half's ulp (2^-24) becomes
    // 1 and let the FPU round to nearest even.
    float scaled = bitsToFloat(absBits) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to even.
  uint32_t rounded = absBits + 0xfff + ((absBits >> 13) & 1);
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

float halfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24.
    float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  if (exp == 0x1f)
    return bitsToFloat(sign | 0x7f800000 | (mant << 13));
  return bitsToFloat(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

uint16_t floatToBFloat16(float value) {
  uint32_t bits = floatBits(value);
  if ((bits & 0x7fffffff) > 0x7f800000)
    return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounded = bits + 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(rounded >> 16);
}

float bfloat16ToFloat(uint16_t bits) { return bitsToFloat(static_cast<uint32_t>(bits) << 16); }

} // namespace pipec
