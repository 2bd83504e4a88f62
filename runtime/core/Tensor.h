//===- Tensor.h - Dense host tensors of the CPU runtime -----------------===//
//
// A Tensor is an element type, a shape and a contiguous row-major buffer.
// The buffer is owned through a std::shared_ptr: copying a Tensor is cheap and
// the copy shares the buffer (writes through one are seen by the other); use
// clone() for an independent copy. The shape is kept inline up to
// Tensor::inlineRank dimensions, so making, copying and dropping a kernel's
// output costs no heap allocation beyond its buffer. Tensors convert to and
// from ONNX TensorProto, including external data next to a model file.
//
// Half-precision types (Float16, BFloat16) are stored widened to float: their
// element type says what they are, data<float>() holds their values, and
// roundToElemType() rounds the values back to what the type can represent.
// toTensorProto() writes the real 16-bit encoding.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_TENSOR_H
#define PIPEC_RUNTIME_CORE_TENSOR_H

#include "support/DType.h"
#include "support/Float16.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

namespace onnx {
class TensorProto;
} // namespace onnx

namespace pipec::cpu {

/// Element types are support/DType.h's; the runtime computes on every one
/// but String, the complex types and Undefined.
using pipec::DType;

/// The element type for ONNX data type \p onnxType, or an error naming the
/// type when the CPU runtime does not support it (string, complex, ...).
llvm::Expected<DType> elemTypeFromOnnx(int32_t onnxType);
/// ONNX's name of a data type ("FLOAT", "INT64", "STRING", ...); "UNKNOWN(n)"
/// for numbers ONNX does not define.
std::string onnxTypeName(int32_t onnxType);
/// Lower-case short name: "float", "int64", "bfloat16", ...
llvm::StringRef elemTypeName(DType type);
/// Bytes per element in memory (4 for Float16/BFloat16: stored as float).
size_t storageSize(DType type);
/// Float, Double, Float16 and BFloat16.
bool isFloating(DType type);
/// Signed and unsigned integers (not Bool).
bool isInteger(DType type);

/// The C++ type that holds each element in memory.
template <DType E> struct StorageOf;
template <> struct StorageOf<DType::F32> { using type = float; };
template <> struct StorageOf<DType::F16> { using type = float; };
template <> struct StorageOf<DType::BF16> { using type = float; };
template <> struct StorageOf<DType::F64> { using type = double; };
template <> struct StorageOf<DType::U8> { using type = uint8_t; };
template <> struct StorageOf<DType::I8> { using type = int8_t; };
template <> struct StorageOf<DType::U16> { using type = uint16_t; };
template <> struct StorageOf<DType::I16> { using type = int16_t; };
template <> struct StorageOf<DType::I32> { using type = int32_t; };
template <> struct StorageOf<DType::I64> { using type = int64_t; };
template <> struct StorageOf<DType::U32> { using type = uint32_t; };
template <> struct StorageOf<DType::U64> { using type = uint64_t; };
template <> struct StorageOf<DType::Bool> { using type = bool; };

/// The natural element type of a C++ type (float -> Float, bool -> Bool).
template <typename T> constexpr DType elemTypeOf() {
  if constexpr (std::is_same_v<T, float>)
    return DType::F32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::F64;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return DType::U8;
  else if constexpr (std::is_same_v<T, int8_t>)
    return DType::I8;
  else if constexpr (std::is_same_v<T, uint16_t>)
    return DType::U16;
  else if constexpr (std::is_same_v<T, int16_t>)
    return DType::I16;
  else if constexpr (std::is_same_v<T, int32_t>)
    return DType::I32;
  else if constexpr (std::is_same_v<T, int64_t>)
    return DType::I64;
  else if constexpr (std::is_same_v<T, uint32_t>)
    return DType::U32;
  else if constexpr (std::is_same_v<T, uint64_t>)
    return DType::U64;
  else {
    static_assert(std::is_same_v<T, bool>, "no element type for this C++ type");
    return DType::Bool;
  }
}

/// True if elements of \p type are stored as C++ type T.
template <typename T> bool storedAs(DType type) {
  if (type == DType::F16 || type == DType::BF16)
    return std::is_same_v<T, float>;
  return elemTypeOf<T>() == type;
}

/// Calls f(T{}) with T the storage type of \p type and returns its result.
/// Kernels use it to write one generic body for every element type.
template <typename F> decltype(auto) visitStorage(DType type, F &&f) {
  switch (type) {
  case DType::F32:
  case DType::F16:
  case DType::BF16:
    return f(float{});
  case DType::F64:
    return f(double{});
  case DType::U8:
    return f(uint8_t{});
  case DType::I8:
    return f(int8_t{});
  case DType::U16:
    return f(uint16_t{});
  case DType::I16:
    return f(int16_t{});
  case DType::I32:
    return f(int32_t{});
  case DType::I64:
    return f(int64_t{});
  case DType::U32:
    return f(uint32_t{});
  case DType::U64:
    return f(uint64_t{});
  case DType::Bool:
    return f(bool{});
  default:
    break;
  }
  llvm_unreachable("no storage for this element type");
}

// The half-float conversions are support/Float16.h's.
using pipec::bfloat16ToFloat;
using pipec::floatToBFloat16;
using pipec::floatToHalf;
using pipec::halfToFloat;

/// What Tensor's constructor throws when its storage cannot be allocated
/// (malloc refused: an address-space limit, or more than the machine can
/// give). Tensors are made deep inside kernels that return no Error, so the
/// failure unwinds to the executor, which names the value being made:
/// "NAME needs N bytes". The one exception the runtime throws.
class AllocationFailure : public std::bad_alloc {
public:
  AllocationFailure(int64_t bytes, std::string shape) : bytes(bytes), shape(std::move(shape)) {}
  const char *what() const noexcept override { return "pipec: out of memory allocating a tensor"; }
  /// The bytes asked for, and the tensor's shape as shapeString writes it.
  int64_t bytes;
  std::string shape;
};

/// A dense row-major tensor. A default-constructed Tensor is null (no type,
/// no storage); every other Tensor has 64-byte aligned storage for
/// numElements() elements. Copies share storage and nothing is synchronized:
/// threads may read a shared buffer, but a writer needs its own clone().
class Tensor {
public:
  /// Dimensions kept inside the Tensor; a higher rank goes to the heap.
  static constexpr unsigned inlineRank = 6;
  using Dims = llvm::SmallVector<int64_t, inlineRank>;

  Tensor() = default;
  /// A zero-filled tensor. Dimensions must be >= 0. Throws
  /// AllocationFailure when the memory cannot be had.
  Tensor(DType type, llvm::ArrayRef<int64_t> shape);
  /// A tensor whose elements are not set: for a kernel's output that the
  /// kernel writes whole (zeroing it first costs a pass over memory).
  static Tensor uninitialized(DType type, llvm::ArrayRef<int64_t> shape);

  /// A tensor holding \p values (row-major, size must match \p shape), of
  /// element type \p type, which must be stored as T (Float16 takes floats).
  template <typename T>
  static Tensor fromValues(llvm::ArrayRef<int64_t> shape, llvm::ArrayRef<T> values,
                           DType type = elemTypeOf<T>()) {
    assert(storedAs<T>(type) && "values do not match the element type");
    Tensor result(type, shape);
    assert(static_cast<int64_t>(values.size()) == result.numElements());
    std::copy(values.begin(), values.end(), result.data<T>());
    if (type == DType::F16 || type == DType::BF16)
      result.roundToElemType();
    return result;
  }
  template <typename T>
  static Tensor fromValues(llvm::ArrayRef<int64_t> shape, std::initializer_list<T> values,
                           DType type = elemTypeOf<T>()) {
    return fromValues(shape, llvm::ArrayRef<T>(values), type);
  }
  /// A rank-0 tensor.
  template <typename T> static Tensor scalar(T value, DType type = elemTypeOf<T>()) {
    return fromValues<T>({}, llvm::ArrayRef<T>(value), type);
  }

  /// A tensor whose elements live in the memory of accelerator \p device,
  /// owned by \p storage (a backend's allocation, in the host layout: half
  /// types stored as float). Host code must not read its data; backends move
  /// it with their own copies.
  static Tensor onDevice(DType type, llvm::ArrayRef<int64_t> shape, std::shared_ptr<void> storage,
                         int device);
  /// -1 for host memory, else the device holding the elements.
  int device() const { return deviceIndex; }
  bool onHost() const { return deviceIndex < 0; }

  bool isNull() const { return !storage; }
  /// Makes this the null tensor, dropping its share of the buffer.
  void reset() {
    if (storage) {
      storage.reset();
      dims.clear();
      count = 0;
      type = DType::F32;
      deviceIndex = -1;
    }
  }
  /// True when no other Tensor shares the buffer (a view included): its
  /// holder may write it in place.
  bool ownsBuffer() const { return storage && storage.use_count() == 1; }
  DType elemType() const { return type; }
  llvm::ArrayRef<int64_t> shape() const { return dims; }
  int64_t rank() const { return static_cast<int64_t>(dims.size()); }
  /// Dimension \p i; negative \p i counts from the end.
  int64_t dim(int64_t i) const { return dims[i < 0 ? i + rank() : i]; }
  int64_t numElements() const { return count; }
  size_t byteSize() const { return static_cast<size_t>(count) * storageSize(type); }

  /// Typed element pointers. T must be the storage type of elemType().
  template <typename T> T *data() {
    assert(storedAs<T>(type) && "wrong storage type");
    return static_cast<T *>(storage.get());
  }
  template <typename T> const T *data() const {
    assert(storedAs<T>(type) && "wrong storage type");
    return static_cast<const T *>(storage.get());
  }
  template <typename T> llvm::ArrayRef<T> values() const { return {data<T>(), size_t(count)}; }
  void *rawData() { return storage.get(); }
  const void *rawData() const { return storage.get(); }

  /// Element \p flatIndex converted to double (bool: 0 or 1).
  double getDouble(int64_t flatIndex) const;
  /// Element \p flatIndex converted to int64 (floats truncate).
  int64_t getInt64(int64_t flatIndex) const;
  /// Stores \p value converted to the element type (no half rounding).
  void setDouble(int64_t flatIndex, double value);
  /// All elements converted to int64: for shape, axes and index inputs.
  std::vector<int64_t> toInt64Vector() const;

  /// An independent deep copy (of a host tensor).
  Tensor clone() const;
  /// A tensor of the same elements and storage under another shape with the
  /// same number of elements.
  Tensor reshaped(llvm::ArrayRef<int64_t> newShape) const;
  /// Rounds stored values to what Float16/BFloat16 can represent; a no-op for
  /// other types. Kernels compute half types in float and call this last.
  void roundToElemType();

  /// "float[2,3]", "int64[]" (a scalar), "null".
  std::string describe() const;

private:
  Tensor(DType type, llvm::ArrayRef<int64_t> shape, bool zero);

  DType type = DType::F32;
  Dims dims;
  int64_t count = 0;
  std::shared_ptr<void> storage;
  int deviceIndex = -1;
};

/// Number of elements of \p shape (1 for a scalar).
int64_t numElementsOf(llvm::ArrayRef<int64_t> shape);
/// Row-major strides of \p shape, in elements.
std::vector<int64_t> stridesOf(llvm::ArrayRef<int64_t> shape);
/// "[2,3]".
std::string shapeString(llvm::ArrayRef<int64_t> shape);
/// The numpy broadcast of two shapes, or an error naming both.
llvm::Expected<std::vector<int64_t>> broadcastShapes(llvm::ArrayRef<int64_t> a,
                                                     llvm::ArrayRef<int64_t> b);
/// ONNX Shape: dimensions \p start to \p end of \p shape (each counted from
/// the back when negative, then clamped to the rank), as a host int64 vector.
Tensor shapeTensor(llvm::ArrayRef<int64_t> shape, int64_t start, int64_t end);

/// Reads \p proto. Raw data, the typed repeated fields and external data
/// (file, offset, length, resolved against \p baseDir, the model's directory)
/// are all accepted. Errors name the tensor: unsupported data type, size
/// mismatch, unreadable external file.
llvm::Expected<Tensor> fromTensorProto(const onnx::TensorProto &proto,
                                       llvm::StringRef baseDir = "");
/// Writes \p tensor as raw_data (half types in their 16-bit encoding).
onnx::TensorProto toTensorProto(const Tensor &tensor, llvm::StringRef name = "");

/// Bytes per element in the little-endian wire encoding of ONNX's raw_data
/// and .npy files (2 for float16 and bfloat16).
size_t wireSize(DType type);
/// Fills \p tensor from wire bytes (at least numElements x wireSize; this
/// host is little-endian, as every machine pipec targets).
void copyFromWire(Tensor &tensor, llvm::StringRef bytes);
/// \p tensor's elements in the wire encoding.
std::string toWire(const Tensor &tensor);

/// Compares \p actual against \p expected: same element type and shape, and
/// for floating types |a - e| <= atol + rtol * |e| everywhere (NaN matches NaN,
/// infinities must match exactly); integers and bools must be equal. On a
/// mismatch returns false and, if \p why is given, describes the first
/// difference.
bool allClose(const Tensor &actual, const Tensor &expected, double rtol = 1e-5, double atol = 1e-8,
              std::string *why = nullptr);

} // namespace pipec::cpu

namespace llvm {
// A tensor's shape (an ArrayRef) against one a kernel built as a vector:
// "x.shape() != Shape{batch, n}". Declared beside ArrayRef, where
// argument-dependent lookup finds them (also from gtest's EXPECT_EQ).
inline bool operator==(ArrayRef<int64_t> a, const std::vector<int64_t> &b) { return a.equals(b); }
inline bool operator==(const std::vector<int64_t> &a, ArrayRef<int64_t> b) { return b.equals(a); }
inline bool operator!=(ArrayRef<int64_t> a, const std::vector<int64_t> &b) { return !a.equals(b); }
inline bool operator!=(const std::vector<int64_t> &a, ArrayRef<int64_t> b) { return !b.equals(a); }
} // namespace llvm

#endif // PIPEC_RUNTIME_CORE_TENSOR_H
