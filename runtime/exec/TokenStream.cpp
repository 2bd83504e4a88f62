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
Expected<DType> megatronType(StringRef idxPath) {
  auto file = readInputFile(idxPath);
  if (!file)
    return file.takeError();
  StringRef bytes = (*file)->getBuffer();
  if (bytes.size() < 18 || !bytes.startswith(StringRef("MMIDIDX\0\0", 9)))
    return fileError(idxPath, "not a Megatron index (its header does not start MMIDIDX)");
  // Megatron-LM's dtype codes (megatron/core/datasets/indexed_dataset.py);
  // 6 and 7 are floats.
  static const std::pair<uint8_t, DType> types[] = {{1, DType::U8},  {2, DType::I8},
                                                    {3, DType::I16}, {4, DType::I32},
                                                    {5, DType::I64}, {8, DType::U16}};
  uint8_t code = static_cast<uint8_t>(bytes[17]);
  for (const auto &[known, type] : types)
    if (code == known)
      return type;
  return fileError(idxPath,
                   formatv("token type code {0} is not an integer type", static_cast<int>(code)));
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
  if (path.endswith(".npy")) {
    auto array = parseNpy(path, bytes);
    if (!array)
      return array.takeError();
    if (array->shape.size() != 1 || !isIntegerDType(array->type) || array->type == DType::U64)
      return fail(formatv("a {0} array of {1} dimension(s); token ids are one dimension of "
                          "integers (uint8 to int64)",
                          dtypeName(array->type), array->shape.size()));
    stream->type = array->type;
    bytes = array->data;
  } else {
    SmallString<256> idx(path);
    sys::path::replace_extension(idx, ".idx");
    if (path.endswith(".bin") && sys::fs::exists(idx)) {
      auto type = megatronType(idx);
      if (!type)
        return type.takeError();
      stream->type = *type;
    } else if (options.rawType == "uint16" || options.rawType == "uint32") {
      stream->type = options.rawType == "uint16" ? DType::U16 : DType::U32;
    } else {
      return fail("--token-type " + options.rawType + ": expected uint16 or uint32");
    }
  }
  size_t element = cpu::storageSize(stream->type);
  if (bytes.size() % element != 0)
    return fail(formatv("{0} bytes of tokens is not a whole number of {1}-byte tokens",
                        bytes.size(), element));
  stream->base = bytes.data();
  stream->count = static_cast<int64_t>(bytes.size() / element);
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
                            token, i,
                            (bytes.data() - stream->file->getBufferStart()) +
                                i * static_cast<int64_t>(element),
                            options.vocabulary));
    }
  return stream;
}

int64_t TokenStream::at(int64_t i) const {
  const char *p = base + static_cast<size_t>(i) * cpu::storageSize(type);
  // The file's ids may sit at any offset: copied out, not dereferenced.
  return cpu::visitStorage(type, [p](auto tag) -> int64_t {
    decltype(tag) value;
    std::memcpy(&value, p, sizeof value);
    return static_cast<int64_t>(value);
  });
}

plan::TokenStreamPosition TokenStream::position(int64_t samplesSeen) const {
  plan::TokenStreamPosition at;
  at.set_windows(windows());
  at.set_seq_len(seqLen());
  at.set_samples_seen(samplesSeen);
  at.set_tokens_seen(samplesSeen * seqLen());
  at.set_epoch(samplesSeen / windows());
  return at;
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
    return DataSource::open(plan, path, options.seed, options.allowNonfinite, options.flag);
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
  if (spec.stream() == plan::DataInput::NOT_TOKENS) { // a mask
    for (int64_t i = 0; i < out.numElements(); ++i)
      out.setDouble(i, 1);
    return out;
  }
  // [samples, S], checked by fromStream.
  int64_t samples = shape[0], seqLen = stream.seqLen();
  int offset = spec.stream() == plan::DataInput::NEXT_TOKENS ? 1 : 0;
  for (int64_t s = 0; s < samples; ++s) {
    int64_t from = stream.windowOf(first + s) * seqLen + offset;
    for (int64_t j = 0; j < seqLen; ++j) {
      int64_t token = stream.at(from + j);
      if (type == DType::I64)
        out.data<int64_t>()[s * seqLen + j] = token;
      else
        out.setDouble(s * seqLen + j, static_cast<double>(token));
    }
  }
  return out;
}

} // namespace pipec::rt
