//===- TokenStream.cpp - Windows of a flat token file, in a seeded order --===//
//
// `pipec run --data corpus.bin`: the token ids of a corpus, mapped, cut into
// windows of S + 1 tokens and drawn in an order that depends only on the
// seed and the sample's number (Data.h).
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/Data.h"

#include "support/Diagnostics.h"
#include "support/InputFile.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>

using namespace llvm;

namespace pipec::rt {

namespace {

/// Epoch \p epoch's order of \p windows windows: Fisher-Yates from the last
/// position down, position i swapping with splitmix64(key + i) mod (i + 1).
std::vector<int64_t> shuffledWindows(int64_t windows, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(windows));
  std::iota(order.begin(), order.end(), int64_t(0));
  uint64_t key = splitmix64(splitmix64(seed) + static_cast<uint64_t>(epoch));
  for (int64_t i = windows - 1; i > 0; --i) {
    uint64_t j = splitmix64(key + static_cast<uint64_t>(i)) % static_cast<uint64_t>(i + 1);
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  return order;
}

/// The element type a Megatron indexed dataset's .idx header names: magic
/// "MMIDIDX\0\0", version (uint64 1), then one byte of dtype code.
Expected<std::pair<int, bool>> megatronType(StringRef idxPath) {
  auto file = readInputFile(idxPath);
  if (!file)
    return file.takeError();
  StringRef bytes = (*file)->getBuffer();
  if (bytes.size() < 18 || !bytes.startswith(StringRef("MMIDIDX\0\0", 9)))
    return fileError(idxPath, "not a Megatron index (its header does not start MMIDIDX)");
  // Megatron-LM's dtype codes (megatron/core/datasets/indexed_dataset.py):
  // code, bytes, signed; 6 and 7 are floats.
  static const std::tuple<uint8_t, int, bool> types[] = {
      {1, 1, false}, {2, 1, true}, {3, 2, true}, {4, 4, true}, {5, 8, true}, {8, 2, false}};
  uint8_t code = static_cast<uint8_t>(bytes[17]);
  for (const auto &[known, size, isSigned] : types)
    if (code == known)
      return std::make_pair(size, isSigned);
  return fileError(idxPath,
                   formatv("token type code {0} is not an integer type", static_cast<int>(code)));
}

/// The bytes after a .npy header of one integer dimension, and the element.
Expected<std::pair<size_t, std::pair<int, bool>>> npyLayout(StringRef path, StringRef bytes) {
  auto fail = [&](const Twine &why) { return fileError(path, why); };
  if (bytes.size() < 10 || !bytes.startswith("\x93NUMPY"))
    return fail("not a NumPy .npy file");
  uint8_t major = static_cast<uint8_t>(bytes[6]);
  size_t headerLength =
      major == 1
          ? static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8
          : static_cast<size_t>(static_cast<uint8_t>(bytes[8]) |
                                static_cast<uint8_t>(bytes[9]) << 8 |
                                static_cast<uint8_t>(bytes[10]) << 16 |
                                static_cast<uint32_t>(static_cast<uint8_t>(bytes[11])) << 24);
  size_t start = (major == 1 ? 10 : 12) + headerLength;
  if (start > bytes.size())
    return fail("truncated .npy header");
  StringRef header = bytes.slice(major == 1 ? 10 : 12, start);
  if (header.contains("'fortran_order': True"))
    return fail("a token array in Fortran order; save it in C order");
  static const std::pair<const char *, std::pair<int, bool>> types[] = {
      {"'<u2'", {2, false}}, {"'<u4'", {4, false}}, {"'<i4'", {4, true}}, {"'<i8'", {8, true}},
      {"'<u8'", {8, false}}, {"'|u1'", {1, false}}, {"'<i2'", {2, true}}};
  for (const auto &[descr, type] : types) {
    if (!header.contains(descr))
      continue;
    size_t open = header.find("'shape':");
    StringRef shape = open == StringRef::npos ? "" : header.drop_front(open + 8).ltrim();
    shape = shape.drop_front(1).take_until([](char c) { return c == ')'; });
    SmallVector<StringRef, 4> dims;
    shape.split(dims, ',', -1, /*KeepEmpty=*/false);
    if (llvm::count_if(dims, [](StringRef d) { return !d.trim().empty(); }) != 1)
      return fail("a token array of " + Twine(dims.size()) +
                  " dimensions; save the ids flat (one dimension)");
    return std::make_pair(start, type);
  }
  return fail("not an integer token array (uint8, int16, uint16, int32, uint32 or int64)");
}

} // namespace

Expected<std::shared_ptr<TokenStream>> TokenStream::open(StringRef path, const Options &options) {
  auto stream = std::make_shared<TokenStream>();
  stream->options = options;
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "%s %s: %s", options.flag.c_str(),
                             path.str().c_str(), why.str().c_str());
  };
  auto file = readInputFile(path);
  if (!file)
    return file.takeError();
  stream->file = std::move(*file);
  StringRef bytes = stream->file->getBuffer();
  size_t start = 0;
  if (path.endswith(".npy")) {
    auto layout = npyLayout(path, bytes);
    if (!layout)
      return layout.takeError();
    start = layout->first;
    std::tie(stream->elementBytes, stream->isSigned) = layout->second;
  } else {
    SmallString<256> idx(path);
    sys::path::replace_extension(idx, ".idx");
    if (path.endswith(".bin") && sys::fs::exists(idx)) {
      auto type = megatronType(idx);
      if (!type)
        return type.takeError();
      std::tie(stream->elementBytes, stream->isSigned) = *type;
    } else if (options.rawType == "uint16" || options.rawType == "uint32") {
      stream->elementBytes = options.rawType == "uint16" ? 2 : 4;
      stream->isSigned = false;
    } else {
      return fail("--token-type " + options.rawType + ": expected uint16 or uint32");
    }
  }
  size_t payload = bytes.size() - start;
  if (payload % stream->elementBytes != 0)
    return fail(formatv("{0} bytes of tokens is not a whole number of {1}-byte tokens", payload,
                        stream->elementBytes));
  stream->base = bytes.data() + start;
  stream->count = static_cast<int64_t>(payload / stream->elementBytes);
  int64_t seqLen = options.seqLen;
  if (seqLen <= 0)
    return fail("the plan feeds no token ids [batch, sequence] that a token stream could fill");
  if (stream->count < seqLen + 1)
    return fail(formatv("{0} token(s), fewer than one window of S + 1 = {1} (S is the plan's "
                        "sequence length)",
                        stream->count, seqLen + 1));
  if (options.vocabulary > 0)
    for (int64_t i = 0; i < stream->count; ++i) {
      int64_t token = stream->at(i);
      if (token < 0 || token >= options.vocabulary)
        return fail(formatv("token {0} at offset {1} (byte {2}) is outside the vocabulary "
                            "[0, {3}) of the model's embedding",
                            token, i, start + static_cast<size_t>(i) * stream->elementBytes,
                            options.vocabulary));
    }
  return stream;
}

int64_t TokenStream::at(int64_t i) const {
  const char *p = base + static_cast<size_t>(i) * elementBytes;
  switch (elementBytes) {
  case 1:
    return isSigned ? static_cast<int64_t>(static_cast<int8_t>(*p))
                    : static_cast<int64_t>(static_cast<uint8_t>(*p));
  case 2: {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return isSigned ? static_cast<int64_t>(static_cast<int16_t>(v)) : v;
  }
  case 4: {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return isSigned ? static_cast<int64_t>(static_cast<int32_t>(v)) : v;
  }
  default: {
    int64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  }
}

int64_t TokenStream::windowOf(int64_t n) const {
  int64_t count = windows();
  if (!options.shuffled)
    return n % count;
  int64_t epoch = n / count;
  std::shared_ptr<const std::vector<int64_t>> order;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = epochs.find(epoch);
    if (it == epochs.end()) {
      // Ranks move through the epochs together: two are enough.
      while (epochs.size() >= 2)
        epochs.erase(epochs.begin());
      it = epochs
               .emplace(epoch, std::make_shared<const std::vector<int64_t>>(
                                   shuffledWindows(count, options.seed, epoch)))
               .first;
    }
    order = it->second;
  }
  return (*order)[static_cast<size_t>(n % count)];
}

Expected<std::shared_ptr<DataSource>>
DataSource::fromStream(const plan::Plan &plan, std::shared_ptr<const TokenStream> stream) {
  auto source = std::make_shared<DataSource>();
  source->stream = std::move(stream);
  const std::string &flag = source->stream->flagName();
  for (const plan::DataInput &spec : plan.data()) {
    Input in;
    in.spec = spec;
    auto type = elemTypeOfName(spec.dtype());
    if (!type)
      return type.takeError();
    in.type = *type;
    bool tokens = spec.stream() != plan::DataInput::NOT_TOKENS;
    if (!tokens && !spec.ones())
      return createStringError(inconvertibleErrorCode(),
                               "%s: input '%s' is neither token ids, nor labels, nor a mask: a "
                               "token stream cannot feed it; give a directory of datasets, one "
                               "per input",
                               flag.c_str(), spec.name().c_str());
    if (tokens && (spec.shape_size() != 2 || spec.batch_axis() != 0 ||
                   spec.shape(1) != source->stream->seqLen() || !isIntegerDType(in.type)))
      return createStringError(
          inconvertibleErrorCode(), "%s: input '%s' is %s %s; a token stream fills [batch, %lld]",
          flag.c_str(), spec.name().c_str(), spec.dtype().c_str(),
          cpu::shapeString(std::vector<int64_t>(spec.shape().begin(), spec.shape().end())).c_str(),
          static_cast<long long>(source->stream->seqLen()));
    source->inputs.emplace(spec.name(), std::move(in));
  }
  return source;
}

Expected<std::shared_ptr<DataSource>> openRunData(const plan::Plan &plan, StringRef path,
                                                  const DataOptions &options) {
  if (path.empty() || sys::fs::is_directory(path)) {
    auto source = DataSource::open(plan, path, options.seed, options.allowNonfinite);
    if (source || options.flag == "--data")
      return source;
    // The directory's errors name --data: say which flag gave it.
    std::string text = toString(source.takeError());
    if (StringRef(text).startswith("--data "))
      text = options.flag + text.substr(6);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  }
  // The sequence length and vocabulary of the ids the plan feeds.
  const plan::DataInput *ids = nullptr;
  for (const plan::DataInput &d : plan.data())
    if (d.stream() == plan::DataInput::TOKENS && d.shape_size() == 2 &&
        (!ids || (ids->index_rows() == 0 && d.index_rows() > 0)))
      ids = &d;
  TokenStream::Options stream;
  stream.flag = options.flag;
  stream.rawType = options.tokenType;
  stream.shuffled = options.shuffled;
  stream.seed = options.seed;
  if (ids) {
    stream.seqLen = ids->shape(1);
    stream.vocabulary = ids->index_rows() > 0 ? ids->index_rows() : ids->high();
  }
  if (options.seqLen > 0 && ids && options.seqLen != stream.seqLen)
    return createStringError(
        inconvertibleErrorCode(),
        "--seq-len %lld: the plan was compiled for sequences of %lld (input "
        "'%s' %s); compile the model for %lld",
        static_cast<long long>(options.seqLen), static_cast<long long>(stream.seqLen),
        ids->name().c_str(),
        cpu::shapeString(std::vector<int64_t>(ids->shape().begin(), ids->shape().end())).c_str(),
        static_cast<long long>(options.seqLen));
  auto opened = TokenStream::open(path, stream);
  if (!opened)
    return opened.takeError();
  return DataSource::fromStream(plan, std::move(*opened));
}

/// What sample \p first and the ones after it read of the stream, for \p in.
cpu::Tensor streamMicrobatch(const TokenStream &stream, const plan::DataInput &spec, DType type,
                             int64_t first) {
  std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
  cpu::Tensor out(type, shape);
  int64_t samples = shape.empty() ? 1 : shape[0];
  int64_t width = out.numElements() / std::max<int64_t>(samples, 1);
  int64_t seqLen = stream.seqLen();
  int offset = spec.stream() == plan::DataInput::NEXT_TOKENS ? 1 : 0;
  for (int64_t s = 0; s < samples; ++s)
    for (int64_t j = 0; j < width; ++j) {
      int64_t at = s * width + j;
      if (spec.stream() == plan::DataInput::NOT_TOKENS) {
        out.setDouble(at, 1); // a mask
        continue;
      }
      int64_t token = stream.at(stream.windowOf(first + s) * seqLen + offset + j);
      if (type == DType::I64)
        out.data<int64_t>()[at] = token;
      else
        out.setDouble(at, static_cast<double>(token));
    }
  return out;
}

} // namespace pipec::rt
