//===- Tensor.cpp - Dense host tensors of the CPU runtime ---------------===//
//
// Storage, element access, half-precision conversions, TensorProto reading
// and writing, and the allClose comparison used by tests.
//
//===----------------------------------------------------------------------===//
#include "runtime/core/Tensor.h"
#include "runtime/core/HostBuffers.h"
#include "support/Broadcast.h"
#include "support/EnumNames.h"
#include "support/FillTensor.h"
#include "support/Float16.h"
#include "support/InputFile.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

using namespace llvm;

namespace pipec::cpu {

//===----------------------------------------------------------------------===//
// Element types
//===----------------------------------------------------------------------===//

std::string onnxTypeName(int32_t onnxType) {
  if (onnx::TensorProto_DataType_IsValid(onnxType))
    return onnx::TensorProto_DataType_Name(onnxType);
  return formatv("UNKNOWN({0})", onnxType).str();
}

Expected<DType> elemTypeFromOnnx(int32_t onnxType) {
  switch (onnxType) {
  case 1:
  case 2:
  case 3:
  case 4:
  case 5:
  case 6:
  case 7:
  case 9:
  case 10:
  case 11:
  case 12:
  case 13:
  case 16:
    return static_cast<DType>(onnxType);
  default:
    return createStringError(inconvertibleErrorCode(),
                             "element type %s is not supported by the CPU runtime",
                             onnxTypeName(onnxType).c_str());
  }
}

namespace {

/// ONNX's names of the types the runtime computes in; dtypeName for the rest.
constexpr EnumName<DType> elemTypeNames[] = {
    {DType::F32, "float"},    {DType::U8, "uint8"},   {DType::I8, "int8"},
    {DType::U16, "uint16"},   {DType::I16, "int16"},  {DType::I32, "int32"},
    {DType::I64, "int64"},    {DType::Bool, "bool"},  {DType::F16, "float16"},
    {DType::F64, "double"},   {DType::U32, "uint32"}, {DType::U64, "uint64"},
    {DType::BF16, "bfloat16"}};

} // namespace

StringRef elemTypeName(DType type) { return nameOf(elemTypeNames, type, dtypeName(type)); }

size_t storageSize(DType type) {
  return visitStorage(type, [](auto tag) { return sizeof(tag); });
}

bool isFloating(DType type) { return isFloatDType(type); }

bool isInteger(DType type) { return isIntegerDType(type); }

//===----------------------------------------------------------------------===//
// Shapes
//===----------------------------------------------------------------------===//

int64_t numElementsOf(ArrayRef<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    n *= d;
  return n;
}

std::vector<int64_t> stridesOf(ArrayRef<int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * shape[i + 1];
  return strides;
}

std::string shapeString(ArrayRef<int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {

/// The allocator of a host buffer's shared_ptr control block: the small
/// blocks of HostBuffers, which each thread keeps for reuse, instead of the
/// C heap. Every kernel output makes one.
template <typename T> struct ControlBlocks {
  using value_type = T;
  ControlBlocks() = default;
  template <typename U> ControlBlocks(const ControlBlocks<U> &) {}
  T *allocate(size_t n) {
    bool zeroed = false;
    void *block = HostBuffers::allocate(bytesFor(n), zeroed);
    if (!block)
      throw std::bad_alloc();
    return static_cast<T *>(block);
  }
  void deallocate(T *block, size_t n) { HostBuffers::release(block, bytesFor(n)); }
  static size_t bytesFor(size_t n) { return (n * sizeof(T) + 63) / 64 * 64; }
  friend bool operator==(const ControlBlocks &, const ControlBlocks &) { return true; }
  friend bool operator!=(const ControlBlocks &, const ControlBlocks &) { return false; }
};

} // namespace

//===----------------------------------------------------------------------===//
// Tensor
//===----------------------------------------------------------------------===//

Tensor::Tensor(DType type, ArrayRef<int64_t> shape) : Tensor(type, shape, true) {}

Tensor Tensor::uninitialized(DType type, ArrayRef<int64_t> shape) {
  return Tensor(type, shape, false);
}

Tensor::Tensor(DType type, ArrayRef<int64_t> shape, bool zero)
    : type(type), dims(shape.begin(), shape.end()), count(numElementsOf(dims)) {
  assert(llvm::all_of(dims, [](int64_t d) { return d >= 0; }) && "negative dimension");
  // 64-byte alignment suits SIMD loads and BLAS; never allocate zero bytes.
  size_t bytes = (std::max<size_t>(byteSize(), 1) + 63) / 64 * 64;
  bool zeroed = false;
  void *memory = HostBuffers::allocate(bytes, zeroed);
  if (!memory)
    throw AllocationFailure(static_cast<int64_t>(bytes), shapeString(dims));
  if (zero && !zeroed)
    std::memset(memory, 0, bytes);
  storage = std::shared_ptr<void>(
      memory, [bytes](void *p) { HostBuffers::release(p, bytes); }, ControlBlocks<void>());
}

double Tensor::getDouble(int64_t flatIndex) const {
  assert(flatIndex >= 0 && flatIndex < count);
  return visitStorage(type, [&](auto tag) -> double {
    using T = decltype(tag);
    return static_cast<double>(data<T>()[flatIndex]);
  });
}

int64_t Tensor::getInt64(int64_t flatIndex) const {
  assert(flatIndex >= 0 && flatIndex < count);
  return visitStorage(type, [&](auto tag) -> int64_t {
    using T = decltype(tag);
    return static_cast<int64_t>(data<T>()[flatIndex]);
  });
}

void Tensor::setDouble(int64_t flatIndex, double value) {
  assert(flatIndex >= 0 && flatIndex < count);
  visitStorage(type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool>)
      data<T>()[flatIndex] = value != 0;
    else
      data<T>()[flatIndex] = static_cast<T>(value);
  });
}

std::vector<int64_t> Tensor::toInt64Vector() const {
  std::vector<int64_t> result(count);
  for (int64_t i = 0; i < count; ++i)
    result[i] = getInt64(i);
  return result;
}

Tensor Tensor::onDevice(DType type, ArrayRef<int64_t> shape, std::shared_ptr<void> storage,
                        int device) {
  Tensor t;
  t.type = type;
  t.dims.assign(shape.begin(), shape.end());
  t.count = numElementsOf(t.dims);
  t.storage = std::move(storage);
  t.deviceIndex = device;
  return t;
}

Tensor Tensor::clone() const {
  if (isNull())
    return Tensor();
  assert(onHost() && "clone() of a device tensor: use its backend");
  Tensor copy(type, dims);
  std::memcpy(copy.rawData(), rawData(), byteSize());
  return copy;
}

Tensor Tensor::reshaped(ArrayRef<int64_t> newShape) const {
  assert(numElementsOf(newShape) == count && "reshape changes the element count");
  Tensor result = *this;
  result.dims.assign(newShape.begin(), newShape.end());
  return result;
}

void Tensor::roundToElemType() {
  if (type == DType::F16) {
    for (float &v : MutableArrayRef<float>(data<float>(), count))
      v = halfToFloat(floatToHalf(v));
  } else if (type == DType::BF16) {
    for (float &v : MutableArrayRef<float>(data<float>(), count))
      v = bfloat16ToFloat(floatToBFloat16(v));
  }
}

std::string Tensor::describe() const {
  if (isNull())
    return "null";
  return (elemTypeName(type) + shapeString(dims)).str();
}

//===----------------------------------------------------------------------===//
// TensorProto
//===----------------------------------------------------------------------===//

size_t wireSize(DType type) {
  if (type == DType::F16 || type == DType::BF16)
    return 2;
  return storageSize(type);
}

void copyFromWire(Tensor &tensor, StringRef bytes) {
  DType type = tensor.elemType();
  if (type == DType::F16 || type == DType::BF16) {
    float *out = tensor.data<float>();
    for (int64_t i = 0; i < tensor.numElements(); ++i) {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      out[i] = type == DType::F16 ? halfToFloat(bits) : bfloat16ToFloat(bits);
    }
    return;
  }
  if (type == DType::Bool) {
    bool *out = tensor.data<bool>();
    for (int64_t i = 0; i < tensor.numElements(); ++i)
      out[i] = bytes[i] != 0;
    return;
  }
  std::memcpy(tensor.rawData(), bytes.data(), tensor.byteSize());
}

static Expected<std::string> readExternalData(const onnx::TensorProto &proto, StringRef baseDir,
                                              StringRef tensorName) {
  std::string location;
  int64_t offset = 0, length = -1;
  for (const auto &entry : proto.external_data()) {
    if (entry.key() == "location")
      location = entry.value();
    else if (entry.key() == "offset" && !to_integer(entry.value(), offset))
      offset = -1;
    else if (entry.key() == "length" && !to_integer(entry.value(), length))
      length = -2;
  }
  if (location.empty() || offset < 0 || length < -1)
    return createStringError(inconvertibleErrorCode(),
                             "tensor '%s': external data needs a location and valid offset/length",
                             tensorName.str().c_str());
  if (location.find('\0') != std::string::npos)
    return createStringError(inconvertibleErrorCode(),
                             "tensor '%s': external data location holds a NUL byte",
                             tensorName.str().c_str());
  SmallString<256> path(baseDir);
  sys::path::append(path, location);
  // Where a symlink in the model's folder leads is what is read.
  if (Error err =
          checkInsideFolder(path, baseDir.empty() ? "." : baseDir, "external data location"))
    return createStringError(inconvertibleErrorCode(), "tensor '%s': %s", tensorName.str().c_str(),
                             toString(std::move(err)).c_str());
  auto file = readInputFile(path);
  if (!file)
    return createStringError(inconvertibleErrorCode(), "tensor '%s': external data: %s",
                             tensorName.str().c_str(), toString(file.takeError()).c_str());
  StringRef contents = (*file)->getBuffer();
  if (static_cast<size_t>(offset) > contents.size() ||
      (length >= 0 && static_cast<size_t>(offset + length) > contents.size()))
    return createStringError(inconvertibleErrorCode(),
                             "tensor '%s': external data '%s' is shorter than offset + length",
                             tensorName.str().c_str(), path.c_str());
  return contents.substr(offset, length < 0 ? StringRef::npos : static_cast<size_t>(length)).str();
}

Expected<Tensor> fromTensorProto(const onnx::TensorProto &proto, StringRef baseDir) {
  std::string name = proto.name().empty() ? "<unnamed>" : proto.name();
  auto fail = [&](const Twine &message) {
    return createStringError(inconvertibleErrorCode(), "tensor '%s': %s", name.c_str(),
                             message.str().c_str());
  };
  Expected<DType> type = elemTypeFromOnnx(proto.data_type());
  if (!type)
    return fail(toString(type.takeError()));
  if (proto.has_segment())
    return fail("segmented tensors are not supported");
  std::vector<int64_t> shape(proto.dims().begin(), proto.dims().end());
  if (llvm::any_of(shape, [](int64_t d) { return d < 0; }))
    return fail("negative dimension in " + shapeString(shape));
  // The data present against the shape, before the tensor is allocated: a
  // dims edited to 2^31 must not take gigabytes before it is refused.
  uint64_t elements = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements))
      return fail("shape " + shapeString(shape) + " overflows");
  if (proto.doc_string() == fillTensorDoc) {
    // A weight stored as its fill: the one value over the shape.
    onnx::TensorProto one = proto;
    one.clear_doc_string();
    one.clear_dims();
    one.add_dims(1);
    Expected<Tensor> value = fromTensorProto(one, baseDir);
    if (!value)
      return value.takeError();
    Tensor filled(*type, shape);
    visitStorage(*type, [&](auto tag) {
      using T = decltype(tag);
      std::fill_n(filled.data<T>(), filled.numElements(), value->data<T>()[0]);
    });
    return std::move(filled);
  }
  if (proto.data_location() != onnx::TensorProto::EXTERNAL) {
    if (proto.has_raw_data()) {
      if (proto.raw_data().size() / std::max<size_t>(1, wireSize(*type)) != elements ||
          proto.raw_data().size() % std::max<size_t>(1, wireSize(*type)) != 0)
        return fail(formatv("raw data has {0} bytes, shape {1} needs {2} elements of {3}",
                            proto.raw_data().size(), shapeString(shape), elements,
                            wireSize(*type)));
    } else {
      uint64_t held = uint64_t(
          std::max({proto.float_data_size(), proto.int32_data_size(), proto.int64_data_size(),
                    proto.double_data_size(), proto.uint64_data_size(), proto.string_data_size()}));
      if (held != elements)
        return fail(formatv("{0} values for shape {1}", held, shapeString(shape)));
    }
  }
  Tensor tensor(*type, shape);
  int64_t count = tensor.numElements();

  auto checkCount = [&](int64_t have) -> Error {
    if (have != count)
      return fail(formatv("{0} values for shape {1}", have, shapeString(shape)));
    return Error::success();
  };
  // Checks that field holds count values, then copies them into the tensor,
  // each cast to the storage type.
  auto copyFrom = [&](const auto &field) -> Expected<Tensor> {
    if (Error e = checkCount(field.size()))
      return e;
    visitStorage(*type, [&](auto tag) {
      using T = decltype(tag);
      for (int64_t i = 0; i < count; ++i)
        tensor.data<T>()[i] = static_cast<T>(field[i]);
    });
    return std::move(tensor);
  };

  if (proto.data_location() == onnx::TensorProto::EXTERNAL) {
    Expected<std::string> bytes = readExternalData(proto, baseDir, name);
    if (!bytes)
      return bytes.takeError();
    if (bytes->size() != count * wireSize(*type))
      return fail(formatv("external data has {0} bytes, shape {1} needs {2}", bytes->size(),
                          shapeString(shape), count * wireSize(*type)));
    copyFromWire(tensor, *bytes);
    return tensor;
  }
  if (proto.has_raw_data()) {
    if (proto.raw_data().size() != count * wireSize(*type))
      return fail(formatv("raw data has {0} bytes, shape {1} needs {2}", proto.raw_data().size(),
                          shapeString(shape), count * wireSize(*type)));
    copyFromWire(tensor, proto.raw_data());
    return tensor;
  }

  switch (*type) {
  case DType::F32:
    return copyFrom(proto.float_data());
  case DType::F64:
    return copyFrom(proto.double_data());
  case DType::I64:
    return copyFrom(proto.int64_data());
  case DType::U32:
  case DType::U64:
    return copyFrom(proto.uint64_data());
  case DType::F16:
  case DType::BF16:
    if (Error e = checkCount(proto.int32_data_size()))
      return e;
    for (int64_t i = 0; i < count; ++i) {
      auto bits = static_cast<uint16_t>(proto.int32_data(i));
      tensor.data<float>()[i] = *type == DType::F16 ? halfToFloat(bits) : bfloat16ToFloat(bits);
    }
    return tensor;
  default: // The small integer types and bool travel in int32_data.
    return copyFrom(proto.int32_data());
  }
}

onnx::TensorProto toTensorProto(const Tensor &tensor, StringRef name) {
  onnx::TensorProto proto;
  proto.set_name(name.str());
  proto.set_data_type(static_cast<int32_t>(tensor.elemType()));
  for (int64_t d : tensor.shape())
    proto.add_dims(d);
  proto.set_raw_data(toWire(tensor));
  return proto;
}

std::string toWire(const Tensor &tensor) {
  DType type = tensor.elemType();
  std::string bytes;
  if (type == DType::F16 || type == DType::BF16) {
    bytes.resize(2 * tensor.numElements());
    for (int64_t i = 0; i < tensor.numElements(); ++i) {
      float v = tensor.data<float>()[i];
      uint16_t bits = type == DType::F16 ? floatToHalf(v) : floatToBFloat16(v);
      std::memcpy(&bytes[2 * i], &bits, 2);
    }
  } else {
    bytes.assign(static_cast<const char *>(tensor.rawData()), tensor.byteSize());
  }
  return bytes;
}

//===----------------------------------------------------------------------===//
// Comparison
//===----------------------------------------------------------------------===//

bool allClose(const Tensor &actual, const Tensor &expected, double rtol, double atol,
              std::string *why) {
  auto mismatch = [&](const std::string &message) {
    if (why)
      *why = message;
    return false;
  };
  if (actual.isNull() || expected.isNull())
    return mismatch("null tensor: got " + actual.describe() + ", expected " + expected.describe());
  if (actual.elemType() != expected.elemType() || actual.shape() != expected.shape())
    return mismatch("got " + actual.describe() + ", expected " + expected.describe());
  bool floating = isFloating(actual.elemType());
  for (int64_t i = 0; i < actual.numElements(); ++i) {
    bool close;
    if (floating) {
      double a = actual.getDouble(i), e = expected.getDouble(i);
      if (std::isnan(a) || std::isnan(e))
        close = std::isnan(a) && std::isnan(e);
      else if (std::isinf(a) || std::isinf(e))
        close = a == e;
      else
        close = std::fabs(a - e) <= atol + rtol * std::fabs(e);
    } else {
      close = actual.getInt64(i) == expected.getInt64(i);
      if (close && (actual.elemType() == DType::U64))
        close = actual.data<uint64_t>()[i] == expected.data<uint64_t>()[i];
    }
    if (!close)
      return mismatch(formatv("element {0} of {1}: got {2}, expected {3}", i, actual.describe(),
                              format("%.9g", actual.getDouble(i)),
                              format("%.9g", expected.getDouble(i)))
                          .str());
  }
  return true;
}

Tensor shapeTensor(ArrayRef<int64_t> shape, int64_t start, int64_t end) {
  int64_t rank = static_cast<int64_t>(shape.size());
  if (start < 0)
    start += rank;
  if (end < 0)
    end += rank;
  start = std::clamp<int64_t>(start, 0, rank);
  end = std::clamp<int64_t>(end, 0, rank);
  std::vector<int64_t> dims(shape.begin() + start, shape.begin() + std::max(start, end));
  return Tensor::fromValues<int64_t>({static_cast<int64_t>(dims.size())}, dims);
}

Expected<std::vector<int64_t>> broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  if (std::optional<std::vector<int64_t>> shape = broadcastShape(a, b))
    return std::move(*shape);
  return createStringError(inconvertibleErrorCode(), "shapes %s and %s do not broadcast",
                           shapeString(a).c_str(), shapeString(b).c_str());
}

} // namespace pipec::cpu
