//===- DType.h - Element types of tensors in the pipec IR ---------------===//
//
// The element types pipec understands. The numbering follows ONNX's
// TensorProto.DataType so that an importer can convert with a range check.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_DTYPE_H
#define PIPEC_SUPPORT_DTYPE_H

#include "llvm/ADT/StringRef.h"
#include <cstdint>
#include <optional>

namespace pipec {

enum class DType : int32_t {
  Undefined = 0,
  F32 = 1,
  U8 = 2,
  I8 = 3,
  U16 = 4,
  I16 = 5,
  I32 = 6,
  I64 = 7,
  String = 8,
  Bool = 9,
  F16 = 10,
  F64 = 11,
  U32 = 12,
  U64 = 13,
  C64 = 14,
  C128 = 15,
  BF16 = 16,
};

/// Returns true if \p onnxType is an ONNX data type pipec knows.
bool isKnownDType(int32_t onnxType);
/// Bytes per element; 0 for Undefined and String (variable size).
int64_t dtypeSize(DType type);
/// Short lower-case name: "f32", "i64", "bf16", ...
llvm::StringRef dtypeName(DType type);
/// The type dtypeName gives \p name, or nullopt.
std::optional<DType> dtypeOfName(llvm::StringRef name);
bool isFloatDType(DType type);
bool isIntegerDType(DType type);
/// True for the integer types of 32 bits or fewer, bool included: those an
/// ONNX TensorProto keeps in int32_data.
bool isNarrowIntegerDType(DType type);

} // namespace pipec

#endif // PIPEC_SUPPORT_DTYPE_H
