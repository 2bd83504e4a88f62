//===- Safetensors.cpp - Reading and writing .safetensors checkpoints -----===//
#include "runtime/exec/Safetensors.h"

#include "plan/PlanFile.h"
#include "support/Float16.h"
#include "support/InputFile.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/Endian.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <set>

using namespace llvm;
using json = nlohmann::json;

namespace pipec::rt {
namespace {

/// The reference implementation's limit on the header.
constexpr uint64_t maxHeaderBytes = 100'000'000;

struct DTypeName {
  const char *name;
  cpu::DType type;
};
constexpr DTypeName dtypeNames[] = {
    {"F64", cpu::DType::F64},   {"F32", cpu::DType::F32}, {"F16", cpu::DType::F16},
    {"BF16", cpu::DType::BF16}, {"I64", cpu::DType::I64}, {"I32", cpu::DType::I32},
    {"I16", cpu::DType::I16},   {"I8", cpu::DType::I8},   {"U64", cpu::DType::U64},
    {"U32", cpu::DType::U32},   {"U16", cpu::DType::U16}, {"U8", cpu::DType::U8},
    {"BOOL", cpu::DType::Bool},
};

/// Bytes per element in the file.
uint64_t fileElementSize(cpu::DType type) { return static_cast<uint64_t>(dtypeSize(type)); }

/// A JSON parse that refuses a key given twice in one object (nlohmann
/// keeps the last one silently; a tensor named twice is an attack or a
/// broken writer, never a checkpoint).
Expected<json> parseStrict(StringRef text, std::string &duplicate) {
  std::vector<std::set<std::string>> keys;
  json::parser_callback_t callback = [&](int, json::parse_event_t event, json &parsed) {
    if (event == json::parse_event_t::object_start)
      keys.emplace_back();
    else if (event == json::parse_event_t::object_end && !keys.empty())
      keys.pop_back();
    else if (event == json::parse_event_t::key && !keys.empty() && parsed.is_string() &&
             !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::parse_error &e) {
    return createStringError(inconvertibleErrorCode(), "%zu: %s", e.byte, e.what());
  }
}

/// A non-negative integer of JSON, or nullopt.
std::optional<uint64_t> unsignedOf(const json &v) {
  if (v.is_number_unsigned())
    return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

} // namespace

StringRef safetensorsDType(cpu::DType type) {
  for (const DTypeName &d : dtypeNames)
    if (d.type == type)
      return d.name;
  return "";
}

std::optional<cpu::DType> safetensorsDTypeOf(StringRef name) {
  for (const DTypeName &d : dtypeNames)
    if (name == d.name)
      return d.type;
  return std::nullopt;
}

Expected<SafetensorsFile> SafetensorsFile::open(StringRef path) {
  if (sys::fs::is_directory(path)) {
    SmallString<256> single(path), index(path);
    sys::path::append(single, "model.safetensors");
    sys::path::append(index, "model.safetensors.index.json");
    if (sys::fs::exists(single))
      return openFile(single);
    if (sys::fs::exists(index))
      return openIndex(index);
    return createStringError(inconvertibleErrorCode(),
                             "%s: a folder with neither model.safetensors nor "
                             "model.safetensors.index.json",
                             path.str().c_str());
  }
  if (path.endswith(".index.json"))
    return openIndex(path);
  return openFile(path);
}

Expected<SafetensorsFile> SafetensorsFile::openIndex(StringRef path) {
  auto file = readInputFile(path);
  if (!file)
    return file.takeError();
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s: %s", path.str().c_str(),
                             why.str().c_str());
  };
  std::string duplicate;
  auto index = parseStrict((*file)->getBuffer(), duplicate);
  if (!index)
    return fail("not JSON: " + toString(index.takeError()));
  if (!duplicate.empty())
    return fail("names '" + duplicate + "' twice");
  auto map = index->is_object() ? index->find("weight_map") : index->end();
  if (map == index->end() || !map->is_object() || map->empty())
    return fail("no \"weight_map\" of tensor names to shard files");
  // The shards, each once, in the order the index first names them.
  std::vector<std::string> shards;
  std::map<std::string, std::string> shardOf;
  for (auto &[name, shard] : map->items()) {
    if (!shard.is_string())
      return fail("weight_map '" + name + "' is not a file name");
    std::string file = shard.get<std::string>();
    if (!is_contained(shards, file))
      shards.push_back(file);
    shardOf[name] = file;
  }
  StringRef dir = sys::path::parent_path(path);
  SafetensorsFile out;
  out.filePath = path.str();
  for (const std::string &shard : shards) {
    SmallString<256> shardPath(dir.empty() ? "." : dir);
    sys::path::append(shardPath, shard);
    if (sys::path::is_absolute(shard) || StringRef(shard).contains(".."))
      return fail("shard '" + shard + "' is not a file name inside the index's folder");
    if (Error err = checkInsideFolder(shardPath, dir.empty() ? "." : dir, "shard"))
      return err;
    auto one = openFile(shardPath);
    if (!one)
      return one.takeError();
    for (SafeTensor &t : one->list) {
      auto it = shardOf.find(t.name);
      if (it == shardOf.end() || it->second != shard)
        return fail(
            formatv("shard '{0}' holds '{1}', which the weight_map {2}", shard, t.name,
                    it == shardOf.end() ? "does not name" : "puts in '" + it->second + "'"));
      shardOf.erase(it);
      out.list.push_back(std::move(t));
    }
    if (out.meta.empty())
      out.meta = std::move(one->meta);
    out.buffers.insert(out.buffers.end(), one->buffers.begin(), one->buffers.end());
  }
  if (!shardOf.empty())
    return fail(formatv("'{0}' is in no shard, though the weight_map puts it in '{1}'",
                        shardOf.begin()->first, shardOf.begin()->second));
  for (size_t i = 0; i < out.list.size(); ++i)
    out.byName[out.list[i].name] = i;
  return std::move(out);
}

Expected<SafetensorsFile> SafetensorsFile::openFile(StringRef path) {
  auto file = readInputFile(path);
  if (!file)
    return file.takeError();
  SafetensorsFile out;
  out.filePath = path.str();
  out.buffers.push_back(std::move(*file));
  StringRef bytes = out.buffers.back()->getBuffer();
  auto fail = [&](uint64_t at, const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s: safetensors header at byte %llu: %s",
                             path.str().c_str(), static_cast<unsigned long long>(at),
                             why.str().c_str());
  };
  if (bytes.size() < 8)
    return fail(0,
                formatv("the file has {0} bytes; the header length alone takes 8", bytes.size()));
  uint64_t n = support::endian::read64le(bytes.data());
  if (n > maxHeaderBytes)
    return fail(0, formatv("the header says it is {0} bytes, over the format's limit of {1}", n,
                           maxHeaderBytes));
  if (n > bytes.size() - 8)
    return fail(0, formatv("the header says it is {0} bytes; the file has {1} after the length", n,
                           bytes.size() - 8));
  StringRef text = bytes.substr(8, n);
  uint64_t dataStart = 8 + n;
  uint64_t dataSize = bytes.size() - dataStart;
  std::string duplicate;
  auto header = parseStrict(text, duplicate);
  if (!header) {
    std::string why = toString(header.takeError());
    auto [at, what] = StringRef(why).split(": ");
    uint64_t pos = 0;
    at.getAsInteger(10, pos);
    return fail(8 + (pos > 0 ? pos - 1 : 0), "the header is not JSON: " + what);
  }
  if (!duplicate.empty())
    return fail(8, "the header names '" + duplicate + "' twice");
  if (!header->is_object())
    return fail(8, "the header is not a JSON object");
  for (auto &[key, value] : header->items()) {
    if (key == "__metadata__") {
      if (!value.is_object())
        return fail(8, "__metadata__ is not an object of strings");
      for (auto &[k, v] : value.items()) {
        if (!v.is_string())
          return fail(8, "__metadata__ '" + k + "' is not a string");
        out.meta[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string &tensorName = key;
    auto bad = [&](const Twine &why) { return fail(8, "tensor '" + tensorName + "': " + why); };
    if (!value.is_object())
      return bad("not an object");
    for (auto &[k, v] : value.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        return bad("unknown key '" + k + "'");
    SafeTensor t;
    t.name = key;
    t.file = out.filePath;
    auto dtype = value.find("dtype");
    if (dtype == value.end() || !dtype->is_string())
      return bad("no dtype");
    std::string dtypeText = dtype->get<std::string>();
    const DTypeName *known =
        find_if(dtypeNames, [&](const DTypeName &d) { return dtypeText == d.name; });
    if (known == std::end(dtypeNames))
      return bad("dtype '" + dtypeText + "' is not one pipec reads (F64, F32, F16, BF16, " +
                 "I64, I32, I16, I8, U64, U32, U16, U8, BOOL)");
    t.type = known->type;
    auto shape = value.find("shape");
    if (shape == value.end() || !shape->is_array())
      return bad("no shape");
    uint64_t count = 1;
    for (const json &d : *shape) {
      auto dim = unsignedOf(d);
      if (!dim || *dim > uint64_t(INT64_MAX))
        return bad("shape " + shape->dump() + " is not a list of sizes");
      if (*dim != 0 && count > UINT64_MAX / *dim)
        return bad("shape " + shape->dump() + " overflows");
      count *= *dim;
      t.shape.push_back(static_cast<int64_t>(*dim));
    }
    auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2)
      return bad("data_offsets is not [begin, end]");
    auto begin = unsignedOf((*offsets)[0]), end = unsignedOf((*offsets)[1]);
    if (!begin || !end || *begin > *end)
      return bad("data_offsets " + offsets->dump() + " is not a range");
    if (*end > dataSize)
      return bad(
          formatv("data_offsets {0} run past the data's {1} bytes", offsets->dump(), dataSize));
    uint64_t size = fileElementSize(t.type);
    if (count > UINT64_MAX / size || count * size != *end - *begin)
      return bad(formatv("shape {0} of {1} needs {2} bytes; data_offsets {3} hold {4}",
                         shape->dump(), dtypeText, count > UINT64_MAX / size ? 0 : count * size,
                         offsets->dump(), *end - *begin));
    t.offset = dataStart + *begin;
    t.bytes = bytes.substr(dataStart + *begin, *end - *begin);
    out.list.push_back(std::move(t));
  }
  // As the reference: the ranges tile the data, in order, without a hole.
  stable_sort(out.list, [](const SafeTensor &a, const SafeTensor &b) {
    return a.offset < b.offset || (a.offset == b.offset && a.bytes.size() < b.bytes.size());
  });
  uint64_t next = dataStart;
  for (const SafeTensor &t : out.list) {
    if (t.offset < next)
      return fail(t.offset, formatv("tensor '{0}' overlaps the tensor before it", t.name));
    if (t.offset > next)
      return fail(next, formatv("{0} bytes before tensor '{1}' belong to no tensor",
                                t.offset - next, t.name));
    next = t.offset + t.bytes.size();
  }
  if (next != bytes.size())
    return fail(next, formatv("{0} bytes at the end belong to no tensor", bytes.size() - next));
  for (size_t i = 0; i < out.list.size(); ++i)
    out.byName[out.list[i].name] = i;
  return std::move(out);
}

const SafeTensor *SafetensorsFile::find(StringRef name) const {
  auto it = byName.find(name.str());
  return it == byName.end() ? nullptr : &list[it->second];
}

Expected<cpu::Tensor> SafetensorsFile::toTensor(const SafeTensor &t) const {
  if (Error err = checkFitsMemory(t.file + ": tensor '" + t.name + "'",
                                  static_cast<int64_t>(t.bytes.size())))
    return std::move(err);
  cpu::Tensor out = cpu::Tensor::uninitialized(t.type, t.shape);
  int64_t n = out.numElements();
  const char *src = t.bytes.data();
  if (t.type == cpu::DType::F16 || t.type == cpu::DType::BF16) {
    float *dst = out.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      uint16_t bits = support::endian::read16le(src + 2 * i);
      dst[i] = t.type == cpu::DType::F16 ? halfToFloat(bits) : bfloat16ToFloat(bits);
    }
  } else if (n > 0) {
    std::memcpy(out.rawData(), src, t.bytes.size());
  }
  return std::move(out);
}

Error writeSafetensors(StringRef path, const std::map<std::string, cpu::Tensor> &tensors,
                       const std::map<std::string, std::string> &metadata) {
  json header = json::object();
  if (!metadata.empty())
    header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto &[name, t] : tensors) {
    StringRef dtype = safetensorsDType(t.elemType());
    if (dtype.empty())
      return createStringError(inconvertibleErrorCode(),
                               "%s: tensor '%s' is %s; safetensors has "
                               "no such dtype",
                               path.str().c_str(), name.c_str(),
                               cpu::elemTypeName(t.elemType()).str().c_str());
    uint64_t size = static_cast<uint64_t>(t.numElements()) * fileElementSize(t.elemType());
    header[name] = {
        {"dtype", dtype.str()}, {"shape", t.shape()}, {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // the data starts 8-byte aligned
  return writeFileAtomically(path, [&](raw_ostream &os) -> Error {
    char length[8];
    support::endian::write64le(length, text.size());
    os.write(length, 8);
    os << text;
    std::vector<char> half;
    for (const auto &[name, t] : tensors) {
      if (t.elemType() == cpu::DType::F16 || t.elemType() == cpu::DType::BF16) {
        half.resize(2 * t.numElements());
        const float *src = t.data<float>();
        for (int64_t i = 0; i < t.numElements(); ++i)
          support::endian::write16le(half.data() + 2 * i, t.elemType() == cpu::DType::F16
                                                              ? floatToHalf(src[i])
                                                              : floatToBFloat16(src[i]));
        os.write(half.data(), half.size());
      } else if (t.numElements() > 0) {
        os.write(static_cast<const char *>(t.rawData()), t.byteSize());
      }
    }
    return Error::success();
  });
}

} // namespace pipec::rt
