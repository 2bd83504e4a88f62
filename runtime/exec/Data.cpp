//===- Data.cpp - What a training or inference step feeds ---------------===//
#include "runtime/exec/Data.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"
#include "support/InputFile.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <type_traits>

using namespace llvm;

namespace pipec::rt {

Expected<DType> elemTypeOfName(StringRef name) {
  std::optional<DType> type = dtypeOfName(name);
  if (!type || *type == DType::String || *type == DType::C64 || *type == DType::C128 ||
      *type == DType::Undefined)
    return createStringError(inconvertibleErrorCode(), "element type '%s' cannot be fed",
                             name.str().c_str());
  return *type;
}

namespace {

/// NumPy's descr of each type a .npy file may hold: byte order, kind, size.
/// NumPy has no bfloat16: ml_dtypes' bfloat16, which ONNX's tools use, saves
/// as '<V2', a descr no other 2-byte type writes (ml_dtypes' other types are
/// 1 or 4 bytes, NumPy's own void type saves as '|V2').
constexpr EnumName<DType> npyDescrs[] = {
    {DType::F32, "<f4"}, {DType::F64, "<f8"}, {DType::F16, "<f2"}, {DType::BF16, "<V2"},
    {DType::I64, "<i8"}, {DType::I32, "<i4"}, {DType::I16, "<i2"}, {DType::I8, "|i1"},
    {DType::U8, "|u1"},  {DType::U16, "<u2"}, {DType::U32, "<u4"}, {DType::U64, "<u8"},
    {DType::Bool, "|b1"}};

/// NumPy's descr for \p type, or "" for a type .npy does not hold.
StringRef npyDescr(DType type) { return nameOf(npyDescrs, type, ""); }

/// The type of \p descr: little-endian ('<', or '=' here), without an order
/// ('|'), or with none given.
std::optional<DType> typeOfDescr(StringRef descr) {
  // Only bfloat16 reads as a void type, and only with its own order mark.
  if (descr == "<V2")
    return DType::BF16;
  if (descr.size() == 3 && (descr[0] == '=' || descr[0] == '<' || descr[0] == '|'))
    descr = descr.drop_front();
  for (const EnumName<DType> &row : npyDescrs)
    if (row.value != DType::BF16 && row.name.drop_front() == descr)
      return row.value;
  return std::nullopt;
}

/// What a .npy header says.
struct NpyHeader {
  std::string descr;
  bool fortranOrder = false;
  std::vector<int64_t> shape;
};

/// The header dict, read as numpy reads it (a Python literal that must be a
/// dict of exactly 'descr' (a string), 'fortran_order' (True or False) and
/// 'shape' (a tuple of non-negative ints)), and stricter: a key given twice
/// (Python keeps the last silently), or anything after the dict but the
/// spaces and newline of its padding, is refused. Errors say what and where.
Expected<NpyHeader> parseNpyHeader(StringRef text) {
  size_t at = 0;
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "header at character %zu: %s", at,
                             why.str().c_str());
  };
  auto skip = [&] {
    while (at < text.size() && (text[at] == ' ' || text[at] == '\t'))
      ++at;
  };
  auto take = [&](char c) {
    skip();
    if (at < text.size() && text[at] == c) {
      ++at;
      return true;
    }
    return false;
  };
  auto string = [&]() -> std::optional<std::string> {
    skip();
    if (at >= text.size() || (text[at] != '\'' && text[at] != '"'))
      return std::nullopt;
    char quote = text[at];
    size_t close = text.find(quote, at + 1);
    if (close == StringRef::npos)
      return std::nullopt;
    std::string value = text.slice(at + 1, close).str();
    at = close + 1;
    return value;
  };
  if (!take('{'))
    return fail("not a dict");
  NpyHeader out;
  std::set<std::string> seen;
  while (!take('}')) {
    auto key = string();
    if (!key)
      return fail("expected a quoted key");
    if (!seen.insert(*key).second)
      return fail("'" + *key + "' is given twice");
    if (!take(':'))
      return fail("expected ':' after '" + *key + "'");
    skip();
    if (*key == "descr") {
      auto value = string();
      if (!value)
        return fail("'descr' is not a string");
      out.descr = *value;
    } else if (*key == "fortran_order") {
      StringRef rest = text.drop_front(at);
      if (rest.startswith("True") || rest.startswith("False")) {
        out.fortranOrder = rest.startswith("True");
        at += out.fortranOrder ? 4 : 5;
      } else {
        return fail("'fortran_order' is not True or False");
      }
    } else if (*key == "shape") {
      if (!take('('))
        return fail("'shape' is not a tuple");
      while (!take(')')) {
        skip();
        size_t digits = at;
        while (at < text.size() && isDigit(text[at]))
          ++at;
        int64_t d;
        if (digits == at || text.slice(digits, at).getAsInteger(10, d))
          return fail("'shape' holds something other than sizes");
        out.shape.push_back(d);
        if (!take(',') && (skip(), at >= text.size() || text[at] != ')'))
          return fail("expected ',' or ')' in 'shape'");
      }
    } else {
      return fail("unknown key '" + *key +
                  "'; a .npy header holds descr, fortran_order and "
                  "shape");
    }
    if (!take(',') && (skip(), at >= text.size() || text[at] != '}'))
      return fail("expected ',' or '}'");
  }
  for (const char *key : {"descr", "fortran_order", "shape"})
    if (!seen.count(key))
      return fail(Twine("no '") + key + "'");
  StringRef rest = text.drop_front(at);
  if (!rest.rtrim("\n").trim(" ").empty() || rest.count('\n') > 1)
    return fail("'" + rest.trim().str() + "' after the dict");
  return out;
}

/// \p shape without dimension \p axis: the shape of one sample.
std::vector<int64_t> sampleShape(ArrayRef<int64_t> shape, int axis) {
  std::vector<int64_t> out(shape.begin(), shape.end());
  if (axis >= 0 && axis < static_cast<int>(out.size()))
    out.erase(out.begin() + axis);
  return out;
}

uint64_t hashName(StringRef name) {
  uint64_t h = 0xcbf29ce484222325ull; // FNV-1a
  for (char c : name)
    h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

} // namespace

std::string safeFileName(StringRef name) {
  std::string safe = name.str();
  for (char &c : safe)
    if (c == '/' || c == ':' || c == '\\')
      c = '_';
  return safe;
}

Expected<NpyArray> parseNpy(StringRef path, StringRef bytes) {
  auto fail = [&](const Twine &why) { return fileError(path, why); };
  if (bytes.size() < 10 || !bytes.startswith("\x93NUMPY"))
    return fail("not a .npy file");
  uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t headerLength, start;
  if (major == 1) {
    headerLength = static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8;
    start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12)
      return fail("truncated header");
    headerLength = 0;
    for (int i = 0; i < 4; ++i)
      headerLength |= static_cast<size_t>(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
    start = 12;
  } else {
    return fail(formatv("unknown .npy version {0}", major));
  }
  if (start + headerLength > bytes.size())
    return fail("truncated header");
  auto header = parseNpyHeader(bytes.substr(start, headerLength));
  if (!header)
    return fail(toString(header.takeError()));
  if (header->fortranOrder)
    return fail("Fortran-order arrays are not supported; save with C order");
  auto type = typeOfDescr(header->descr);
  if (!type)
    return fail("element type '" + header->descr + "' is not supported");
  NpyArray array{*type, header->shape, bytes.drop_front(start + headerLength)};
  // The header's shape against the bytes present, before any allocation.
  uint64_t need = cpu::wireSize(*type);
  bool overflow = false;
  for (int64_t d : array.shape)
    overflow |= __builtin_mul_overflow(need, static_cast<uint64_t>(d), &need);
  if (overflow || array.data.size() != need)
    return fail(formatv("holds {0} bytes of data, shape {1} needs {2}", array.data.size(),
                        cpu::shapeString(array.shape),
                        overflow ? "more than 2^64" : Twine(need).str()));
  return array;
}

Expected<cpu::Tensor> readNpy(StringRef path) {
  auto file = readInputFile(path);
  if (!file)
    return file.takeError();
  auto array = parseNpy(path, (*file)->getBuffer());
  if (!array)
    return array.takeError();
  cpu::Tensor tensor(array->type, array->shape);
  cpu::copyFromWire(tensor, array->data);
  return tensor;
}

Error writeNpy(const cpu::Tensor &tensor, StringRef path) {
  StringRef descr = npyDescr(tensor.elemType());
  if (descr.empty())
    return createStringError(inconvertibleErrorCode(), "%s: cannot write %s as .npy",
                             path.str().c_str(), tensor.describe().c_str());
  std::string shape = "(";
  for (int64_t d : tensor.shape())
    shape += std::to_string(d) + (tensor.rank() == 1 ? "," : ", ");
  if (tensor.rank() > 1)
    shape.resize(shape.size() - 2);
  shape += ")";
  std::string header =
      formatv("{{'descr': '{0}', 'fortran_order': False, 'shape': {1}, }", descr, shape).str();
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string bytes;
  raw_string_ostream os(bytes);
  os << "\x93NUMPY" << '\x01' << '\x00';
  os << static_cast<char>(header.size() & 0xff) << static_cast<char>(header.size() >> 8);
  os << header;
  os << cpu::toWire(tensor);
  return writeFileAtomically(path, os.str());
}

namespace {

/// DIR/NAME.npy or DIR/NAME.pb, else under NAME's safe file name (as
/// outputs are named); a missing file is an error naming both.
Expected<cpu::Tensor> readDataset(StringRef dir, StringRef where, const plan::DataInput &spec) {
  SmallString<256> npy(dir), pb(dir);
  sys::path::append(npy, spec.name() + ".npy");
  sys::path::append(pb, spec.name() + ".pb");
  if (!sys::fs::exists(npy) && !sys::fs::exists(pb)) {
    npy = dir;
    pb = dir;
    sys::path::append(npy, safeFileName(spec.name()) + ".npy");
    sys::path::append(pb, safeFileName(spec.name()) + ".pb");
  }
  if (sys::fs::exists(npy))
    return readNpy(npy);
  if (!sys::fs::exists(pb))
    return createStringError(inconvertibleErrorCode(), "%s: no %s.npy or %s.pb for input '%s'",
                             where.str().c_str(), spec.name().c_str(), spec.name().c_str(),
                             spec.name().c_str());
  auto buffer = readInputFile(pb);
  if (!buffer)
    return buffer.takeError();
  onnx::TensorProto proto;
  if ((*buffer)->getBufferSize() > size_t(INT_MAX) ||
      !proto.ParseFromArray((*buffer)->getBufferStart(),
                            static_cast<int>((*buffer)->getBufferSize())))
    return createStringError(inconvertibleErrorCode(), "%s: not an ONNX TensorProto", pb.c_str());
  return cpu::fromTensorProto(proto, dir);
}

/// Element \p i of integer tensor \p t, exactly (a uint64 above 2^63
/// too, which int64 or double would change).
__int128 integerAt(const cpu::Tensor &t, int64_t i) {
  if (t.elemType() == DType::U64)
    return t.data<uint64_t>()[i];
  return t.getInt64(i);
}

std::string integerText(__int128 v) {
  return v < 0 ? std::to_string(static_cast<int64_t>(v)) : std::to_string(static_cast<uint64_t>(v));
}

/// True when integer type \p type holds \p v.
bool holds(DType type, __int128 v) {
  return cpu::visitStorage(type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, bool>)
      return v == 0 || v == 1;
    else if constexpr (std::is_integral_v<T>)
      return v >= static_cast<__int128>(std::numeric_limits<T>::min()) &&
             v <= static_cast<__int128>(std::numeric_limits<T>::max());
    else
      return true;
  });
}

/// \p data as \p type: floats to floats and integers to integers convert
/// (integers exactly: a value the input's type cannot hold is refused,
/// never wrapped); a float file for an integer input (or the reverse) is
/// refused.
Expected<cpu::Tensor> asInputType(cpu::Tensor data, DType type, StringRef origin,
                                  const plan::DataInput &spec) {
  if (data.elemType() == type)
    return data;
  if (cpu::isFloating(data.elemType()) != cpu::isFloating(type))
    return createStringError(inconvertibleErrorCode(), "%s: input '%s' is %s, the model takes %s",
                             origin.str().c_str(), spec.name().c_str(),
                             cpu::elemTypeName(data.elemType()).str().c_str(),
                             spec.dtype().c_str());
  cpu::Tensor converted(type, data.shape());
  if (cpu::isFloating(type)) {
    for (int64_t i = 0; i < data.numElements(); ++i)
      converted.setDouble(i, data.getDouble(i));
    return converted;
  }
  for (int64_t i = 0; i < data.numElements(); ++i) {
    __int128 v = integerAt(data, i);
    if (!holds(type, v))
      return createStringError(inconvertibleErrorCode(),
                               "%s: input '%s' holds %s at element %lld, which %s (the "
                               "model's type) cannot hold",
                               origin.str().c_str(), spec.name().c_str(), integerText(v).c_str(),
                               static_cast<long long>(i), cpu::elemTypeName(type).str().c_str());
    cpu::visitStorage(type, [&](auto tag) {
      using T = decltype(tag);
      converted.data<T>()[i] = static_cast<T>(v);
    });
  }
  return converted;
}

/// Checks a sampled input's spec against the plan's microbatches.
Error checkSampled(const plan::Plan &plan, const plan::DataInput &spec) {
  int axis = spec.batch_axis();
  if (spec.shape_size() == 0)
    return createStringError(inconvertibleErrorCode(),
                             "input '%s' is a scalar; inputs need a batch dimension",
                             spec.name().c_str());
  if (axis < 0 || axis >= spec.shape_size())
    return createStringError(inconvertibleErrorCode(),
                             "input '%s': batch axis %d is outside its %d dimensions",
                             spec.name().c_str(), axis, spec.shape_size());
  if (spec.shape(axis) != plan.schedule().microbatch_size() &&
      plan.schedule().microbatch_size() > 0)
    return createStringError(inconvertibleErrorCode(),
                             "input '%s' holds %lld samples, the plan's microbatches %lld",
                             spec.name().c_str(), static_cast<long long>(spec.shape(axis)),
                             static_cast<long long>(plan.schedule().microbatch_size()));
  return Error::success();
}

/// A dataset of samples stacked along the batch axis: any number of them,
/// each of the spec's sample shape.
Error checkDataset(const cpu::Tensor &data, StringRef origin, const plan::DataInput &spec) {
  int axis = spec.batch_axis();
  std::vector<int64_t> row =
      sampleShape(ArrayRef<int64_t>(spec.shape().data(), spec.shape_size()), axis);
  if (data.rank() == spec.shape_size() && sampleShape(data.shape(), axis) == row &&
      data.dim(axis) != 0)
    return Error::success();
  return createStringError(
      inconvertibleErrorCode(),
      "%s: input '%s' has shape %s; samples of shape %s are needed, stacked along %s",
      origin.str().c_str(), spec.name().c_str(), cpu::shapeString(data.shape()).c_str(),
      cpu::shapeString(row).c_str(),
      axis == 0 ? "a first dimension" : formatv("dimension {0}", axis).str().c_str());
}

/// Refuses a dataset value no step should see: a NaN or infinity (unless
/// \p allowNonfinite), or an index outside the table it indexes. Training
/// takes [0, rows) (a token id of -1 would read the last embedding row);
/// inference keeps ONNX's Gather semantics, [-rows, rows). Names the input
/// and sample.
Error checkValues(const cpu::Tensor &data, StringRef origin, const plan::DataInput &spec,
                  bool allowNonfinite, bool training) {
  bool floating = cpu::isFloating(data.elemType());
  int64_t rows = spec.index_rows();
  if ((floating && allowNonfinite) || (!floating && rows <= 0))
    return Error::success();
  int axis = spec.whole() ? -1 : spec.batch_axis();
  int64_t inner =
      axis < 0 ? 1 : cpu::numElementsOf(ArrayRef<int64_t>(data.shape()).drop_front(axis + 1));
  auto fail = [&](int64_t i, const Twine &what) {
    std::string where =
        axis < 0 ? std::string()
                 : formatv(" sample {0}", (i / std::max<int64_t>(inner, 1)) % data.dim(axis)).str();
    return createStringError(inconvertibleErrorCode(), "%s: input '%s'%s holds %s",
                             origin.str().c_str(), spec.name().c_str(), where.c_str(),
                             what.str().c_str());
  };
  __int128 low = training ? 0 : -static_cast<__int128>(rows);
  for (int64_t i = 0; i < data.numElements(); ++i) {
    if (floating) {
      double v = data.getDouble(i);
      if (!std::isfinite(v))
        return fail(i, formatv("{0} (pass --allow-nonfinite to feed it)",
                               std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf")));
      continue;
    }
    __int128 v = integerAt(data, i);
    if (v < low || v >= rows)
      return fail(i, formatv("{0}, outside [{1}, {2}): the rows of the table it indexes",
                             integerText(v), integerText(low), rows));
  }
  return Error::success();
}

} // namespace

Expected<std::shared_ptr<DataSource>> DataSource::open(const plan::Plan &plan, StringRef dir,
                                                       uint64_t seed, bool allowNonfinite,
                                                       StringRef flag) {
  // What errors name: "--data DIR".
  std::string where = (flag + " " + dir).str();
  auto source = std::make_shared<DataSource>();
  source->seed = seed;
  std::string counted; // the first sampled input read, and its samples
  int64_t countedSamples = 0;
  for (const plan::DataInput &spec : plan.data()) {
    Input in;
    in.spec = spec;
    auto type = elemTypeOfName(spec.dtype());
    if (!type)
      return createStringError(inconvertibleErrorCode(), "input '%s': %s", spec.name().c_str(),
                               toString(type.takeError()).c_str());
    in.type = *type;
    if (!spec.whole())
      if (Error err = checkSampled(plan, spec))
        return err;
    if (!dir.empty()) {
      Expected<cpu::Tensor> data = readDataset(dir, where, spec);
      if (data)
        data = asInputType(std::move(*data), in.type, where, spec);
      if (!data)
        return data.takeError();
      std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
      if (spec.whole() && data->shape() != shape)
        return createStringError(
            inconvertibleErrorCode(), "%s: input '%s' has shape %s; the model takes %s whole",
            where.c_str(), spec.name().c_str(), cpu::shapeString(data->shape()).c_str(),
            cpu::shapeString(shape).c_str());
      if (!spec.whole())
        if (Error err = checkDataset(*data, where, spec))
          return err;
      if (Error err =
              checkValues(*data, where, spec, allowNonfinite, plan.schedule().mode() == "train"))
        return err;
      // Sample i of every input is one sample: the counts must agree, or
      // inputs and labels silently pair up wrongly.
      if (!spec.whole()) {
        int64_t samples = data->dim(spec.batch_axis());
        if (!counted.empty() && samples != countedSamples)
          return createStringError(inconvertibleErrorCode(),
                                   "%s: input '%s' has %lld samples, input '%s' %lld; "
                                   "every input needs the same number",
                                   where.c_str(), spec.name().c_str(),
                                   static_cast<long long>(samples), counted.c_str(),
                                   static_cast<long long>(countedSamples));
        counted = spec.name();
        countedSamples = samples;
        source->datasetSamples = samples;
      }
      in.dataset = std::move(*data);
    }
    source->inputs.emplace(spec.name(), std::move(in));
  }
  return source;
}

int64_t DataSource::samples() const { return stream ? stream->windows() : datasetSamples; }

// TokenStream.cpp: what samples first.. of a stream give input \p spec.
cpu::Tensor streamMicrobatch(const TokenStream &stream, const plan::DataInput &spec, DType type,
                             int64_t first);

Expected<cpu::Tensor> DataSource::microbatch(const std::string &name, int64_t first) const {
  auto it = inputs.find(name);
  if (it == inputs.end())
    return createStringError(inconvertibleErrorCode(), "the plan feeds no input '%s'",
                             name.c_str());
  const Input &in = it->second;
  if (stream)
    return streamMicrobatch(*stream, in.spec, in.type, first);
  std::vector<int64_t> shape(in.spec.shape().begin(), in.spec.shape().end());
  if (in.spec.whole()) {
    // The whole input, every step: its dataset, or one synthetic sample of
    // its full shape.
    if (!in.dataset.isNull())
      return in.dataset;
    shape.insert(shape.begin(), 1);
  }
  cpu::Tensor out(in.type, shape);
  // The microbatch as [outer, samples, inner] around the batch axis.
  int axis = in.spec.whole() ? 0 : in.spec.batch_axis();
  int64_t samples = shape[axis];
  int64_t outer = cpu::numElementsOf(ArrayRef<int64_t>(shape).take_front(axis));
  int64_t inner = cpu::numElementsOf(ArrayRef<int64_t>(shape).drop_front(axis + 1));
  if (!in.dataset.isNull()) {
    int64_t rows = in.dataset.dim(axis);
    size_t element = cpu::storageSize(in.type);
    size_t innerBytes = static_cast<size_t>(inner) * element;
    const char *from = static_cast<const char *>(in.dataset.rawData());
    char *to = static_cast<char *>(out.rawData());
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t s = 0; s < samples; ++s) {
        int64_t row = (first + s) % rows;
        std::memcpy(to + (o * samples + s) * innerBytes, from + (o * rows + row) * innerBytes,
                    innerBytes);
      }
    return out;
  }
  // Element e of a sample is its e-th value in row-major order (outer, then
  // inner): along axis 0 that is the sample's own flat layout.
  uint64_t base = splitmix64(seed ^ hashName(name));
  bool floating = cpu::isFloating(in.type);
  for (int64_t s = 0; s < samples; ++s) {
    uint64_t sampleKey = splitmix64(base + static_cast<uint64_t>(first + s));
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t j = 0; j < inner; ++j) {
        int64_t e = o * inner + j;
        int64_t i = (o * samples + s) * inner + j;
        uint64_t u = splitmix64(sampleKey ^ static_cast<uint64_t>(e) * 0xD6E8FEB86659FD93ull);
        if (in.spec.ones()) {
          out.setDouble(i, 1);
        } else if (floating) {
          // Box-Muller from two 53-bit uniforms.
          double u1 = (static_cast<double>(u >> 11) + 0.5) * 0x1.0p-53;
          double u2 = static_cast<double>(splitmix64(u) >> 11) * 0x1.0p-53;
          out.setDouble(i, std::sqrt(-2 * std::log(u1)) * std::cos(2 * M_PI * u2));
        } else {
          int64_t high = std::max<int64_t>(in.spec.high(), 1);
          out.setDouble(i, static_cast<double>(u % static_cast<uint64_t>(high)));
        }
      }
  }
  if (floating)
    out.roundToElemType();
  if (in.spec.whole())
    return out.reshaped(std::vector<int64_t>(in.spec.shape().begin(), in.spec.shape().end()));
  return out;
}

} // namespace pipec::rt
