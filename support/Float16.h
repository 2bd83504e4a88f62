//===- Float16.h - IEEE half and bfloat16 conversions -------------------===//
//
// The one place pipec converts between float and the 16-bit floating types
// (ONNX's FLOAT16 and BFLOAT16): the importer reading weights, the runtime's
// tensors, the model generators writing them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_FLOAT16_H
#define PIPEC_SUPPORT_FLOAT16_H

#include <cstdint>

namespace pipec {

/// Rounds a float to the nearest IEEE binary16 value (ties to even) and
/// returns its bits; overflow gives infinity, NaN stays NaN.
uint16_t floatToHalf(float value);
/// Widens IEEE binary16 bits to float, subnormals and specials included.
float halfToFloat(uint16_t bits);
/// Rounds a float to bfloat16 (ties to even) and returns its bits; NaN stays
/// NaN.
uint16_t floatToBFloat16(float value);
/// Widens bfloat16 bits to float (exact).
float bfloat16ToFloat(uint16_t bits);

} // namespace pipec

#endif // PIPEC_SUPPORT_FLOAT16_H
