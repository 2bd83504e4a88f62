//===- DType.cpp - Element type properties --------------------------------===//
#include "support/DType.h"
#include "support/EnumNames.h"

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

namespace {

/// Every type but Undefined, whose name is "undef".
constexpr EnumName<DType> dtypeNames[] = {
    {DType::F32, "f32"},   {DType::U8, "u8"},   {DType::I8, "i8"},     {DType::U16, "u16"},
    {DType::I16, "i16"},   {DType::I32, "i32"}, {DType::I64, "i64"},   {DType::String, "string"},
    {DType::Bool, "bool"}, {DType::F16, "f16"}, {DType::F64, "f64"},   {DType::U32, "u32"},
    {DType::U64, "u64"},   {DType::C64, "c64"}, {DType::C128, "c128"}, {DType::BF16, "bf16"}};

} // namespace

llvm::StringRef dtypeName(DType type) { return nameOf(dtypeNames, type, "undef"); }

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

bool isNarrowIntegerDType(DType type) {
  return type == DType::I32 || type == DType::I16 || type == DType::I8 || type == DType::U16 ||
         type == DType::U8 || type == DType::Bool;
}

std::optional<DType> dtypeOfName(llvm::StringRef name) { return valueOf(dtypeNames, name); }

} // namespace pipec
