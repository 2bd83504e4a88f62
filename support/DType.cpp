//===- DType.cpp - Element type properties --------------------------------===//
#include "support/DType.h"

namespace pipec {

bool isKnownDType(int32_t onnxType) { return onnxType >= 1 && onnxType <= 16; }

int64_t dtypeSize(DType type) {
  switch (type) {
  case DType::F32:
  case DType::I32:
  case DType::U32:
    return 4;
  case DType::U8:
  case DType::I8:
  case DType::Bool:
    return 1;
  case DType::U16:
  case DType::I16:
  case DType::F16:
  case DType::BF16:
    return 2;
  case DType::I64:
  case DType::U64:
  case DType::F64:
  case DType::C64:
    return 8;
  case DType::C128:
    return 16;
  case DType::Undefined:
  case DType::String:
    return 0;
  }
  return 0;
}

llvm::StringRef dtypeName(DType type) {
  switch (type) {
  case DType::Undefined:
    return "undef";
  case DType::F32:
    return "f32";
  case DType::U8:
    return "u8";
  case DType::I8:
    return "i8";
  case DType::U16:
    return "u16";
  case DType::I16:
    return "i16";
  case DType::I32:
    return "i32";
  case DType::I64:
    return "i64";
  case DType::String:
    return "string";
  case DType::Bool:
    return "bool";
  case DType::F16:
    return "f16";
  case DType::F64:
    return "f64";
  case DType::U32:
    return "u32";
  case DType::U64:
    return "u64";
  case DType::C64:
    return "c64";
  case DType::C128:
    return "c128";
  case DType::BF16:
    return "bf16";
  }
  return "undef";
}

bool isFloatDType(DType type) {
  return type == DType::F32 || type == DType::F16 || type == DType::BF16 || type == DType::F64;
}

bool isIntegerDType(DType type) {
  switch (type) {
  case DType::U8:
  case DType::I8:
  case DType::U16:
  case DType::I16:
  case DType::I32:
  case DType::I64:
  case DType::U32:
  case DType::U64:
  case DType::Bool:
    return true;
  default:
    return false;
  }
}

std::optional<DType> dtypeOfName(llvm::StringRef name) {
  for (int32_t t = 0; t <= static_cast<int32_t>(DType::BF16); ++t)
    if (isKnownDType(t) && dtypeName(static_cast<DType>(t)) == name)
      return static_cast<DType>(t);
  return std::nullopt;
}

} // namespace pipec
