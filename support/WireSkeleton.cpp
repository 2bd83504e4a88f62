//===- WireSkeleton.cpp - Strip inline weight bytes from an ONNX model ----===//
//
// Field numbers are those of onnx.proto (ONNX 1.12):
//   ModelProto.graph = 7
//   GraphProto.node = 1, GraphProto.initializer = 5
//   NodeProto.attribute = 5
//   AttributeProto.t = 5, .g = 6, .tensors = 10, .graphs = 11
//   TensorProto.raw_data = 9, .external_data = 13, .data_location = 14
//   StringStringEntryProto.key = 1, .value = 2
//
//===----------------------------------------------------------------------===//
#include "support/WireSkeleton.h"

#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {
namespace {

enum class MessageKind { Model, Graph, Node, Attribute, Tensor };

enum WireType : uint32_t { Varint = 0, Fixed64 = 1, Length = 2, Fixed32 = 5 };

/// A length-delimited field rewritten as a message: field \c number of a
/// \c parent holds a \c child (onnx.proto's field numbers).
struct ChildField {
  MessageKind parent;
  uint32_t number;
  MessageKind child;
};
constexpr ChildField childFields[] = {
    {MessageKind::Model, 7, MessageKind::Graph},       // ModelProto.graph
    {MessageKind::Graph, 1, MessageKind::Node},        // GraphProto.node
    {MessageKind::Graph, 5, MessageKind::Tensor},      // GraphProto.initializer
    {MessageKind::Node, 5, MessageKind::Attribute},    // NodeProto.attribute
    {MessageKind::Attribute, 5, MessageKind::Tensor},  // AttributeProto.t
    {MessageKind::Attribute, 10, MessageKind::Tensor}, // AttributeProto.tensors
    {MessageKind::Attribute, 6, MessageKind::Graph},   // AttributeProto.g
    {MessageKind::Attribute, 11, MessageKind::Graph},  // AttributeProto.graphs
};

class SkeletonWriter {
public:
  SkeletonWriter(StringRef bytes, uint64_t threshold)
      : base(reinterpret_cast<const uint8_t *>(bytes.data())), threshold(threshold) {}

  Error rewrite(MessageKind kind, const uint8_t *begin, const uint8_t *end, std::string &out,
                int depth);

private:
  const uint8_t *base;
  uint64_t threshold;

  Error malformed(const uint8_t *at, const char *what) const {
    return createStringError(inconvertibleErrorCode(),
                             "malformed protobuf at byte %lld: %s (truncated or corrupt file?)",
                             static_cast<long long>(at - base), what);
  }

  Error readVarint(const uint8_t *&p, const uint8_t *end, uint64_t &value) const {
    value = 0;
    const uint8_t *start = p;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end)
        return malformed(start, "varint runs past the end");
      uint8_t byte = *p++;
      value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if (!(byte & 0x80))
        return Error::success();
    }
    return malformed(start, "varint longer than 10 bytes");
  }

  /// Reads one field header and finds where the field's payload is.
  struct Field {
    uint32_t number;
    uint32_t wireType;
    const uint8_t *start;   // first byte of the tag
    const uint8_t *payload; // first byte after the tag (and length)
    const uint8_t *next;    // first byte after the field
  };

  Error readField(const uint8_t *&p, const uint8_t *end, Field &field) const {
    field.start = p;
    uint64_t tag;
    if (Error err = readVarint(p, end, tag))
      return err;
    field.number = static_cast<uint32_t>(tag >> 3);
    field.wireType = static_cast<uint32_t>(tag & 7);
    if (field.number == 0)
      return malformed(field.start, "field number 0");
    switch (field.wireType) {
    case Varint: {
      uint64_t ignored;
      field.payload = p;
      if (Error err = readVarint(p, end, ignored))
        return err;
      break;
    }
    case Fixed64:
    case Fixed32: {
      size_t size = field.wireType == Fixed64 ? 8 : 4;
      field.payload = p;
      if (static_cast<size_t>(end - p) < size)
        return malformed(field.start, "fixed-size field runs past the end");
      p += size;
      break;
    }
    case Length: {
      uint64_t length;
      if (Error err = readVarint(p, end, length))
        return err;
      if (length > static_cast<uint64_t>(end - p))
        return malformed(field.start, "length-delimited field runs past the end");
      field.payload = p;
      p += length;
      break;
    }
    default:
      return malformed(field.start, "unsupported wire type (groups are not used by ONNX)");
    }
    field.next = p;
    return Error::success();
  }

  static void appendVarint(std::string &out, uint64_t value) {
    while (value >= 0x80) {
      out.push_back(static_cast<char>((value & 0x7f) | 0x80));
      value >>= 7;
    }
    out.push_back(static_cast<char>(value));
  }

  static void appendTag(std::string &out, uint32_t number, uint32_t wireType) {
    appendVarint(out, (static_cast<uint64_t>(number) << 3) | wireType);
  }

  static void appendBytesField(std::string &out, uint32_t number, StringRef bytes) {
    appendTag(out, number, Length);
    appendVarint(out, bytes.size());
    out.append(bytes.data(), bytes.size());
  }

  static void appendEntry(std::string &out, StringRef key, StringRef value) {
    std::string entry;
    appendBytesField(entry, 1, key);
    appendBytesField(entry, 2, value);
    appendBytesField(out, 13, entry);
  }

  /// The child message kind of a length-delimited field, if it is rewritten.
  static bool childKind(MessageKind parent, uint32_t number, MessageKind &child) {
    for (const ChildField &f : childFields)
      if (f.parent == parent && f.number == number)
        return child = f.child, true;
    return false;
  }

  Error rewriteTensor(const uint8_t *begin, const uint8_t *end, std::string &out);
};

Error SkeletonWriter::rewriteTensor(const uint8_t *begin, const uint8_t *end, std::string &out) {
  // Find the last raw_data field (protobuf semantics: the last one wins).
  const uint8_t *p = begin;
  const uint8_t *raw = nullptr;
  uint64_t rawLength = 0;
  Field field;
  while (p < end) {
    if (Error err = readField(p, end, field))
      return err;
    if (field.number == 9 && field.wireType == Length) {
      raw = field.payload;
      rawLength = static_cast<uint64_t>(field.next - field.payload);
    }
  }
  bool strip = raw && rawLength >= threshold;
  p = begin;
  while (p < end) {
    if (Error err = readField(p, end, field))
      return err;
    if (strip && (field.number == 9 || field.number == 14))
      continue;
    out.append(reinterpret_cast<const char *>(field.start), field.next - field.start);
  }
  if (strip) {
    appendEntry(out, "location", "");
    appendEntry(out, "offset", std::to_string(raw - base));
    appendEntry(out, "length", std::to_string(rawLength));
    appendEntry(out, InlineDataMarker, "1");
    appendTag(out, 14, Varint);
    appendVarint(out, 1); // TensorProto.EXTERNAL
  }
  return Error::success();
}

Error SkeletonWriter::rewrite(MessageKind kind, const uint8_t *begin, const uint8_t *end,
                              std::string &out, int depth) {
  if (depth > MaxMessageDepth)
    return malformed(begin, formatv("messages nested too deeply (subgraphs more than {0} deep)",
                                    MaxSubgraphDepth)
                                .str()
                                .c_str());
  if (kind == MessageKind::Tensor)
    return rewriteTensor(begin, end, out);
  const uint8_t *p = begin;
  Field field;
  std::string child;
  while (p < end) {
    if (Error err = readField(p, end, field))
      return err;
    MessageKind sub;
    if (field.wireType == Length && childKind(kind, field.number, sub)) {
      child.clear();
      if (Error err = rewrite(sub, field.payload, field.next, child, depth + 1))
        return err;
      appendBytesField(out, field.number, child);
      continue;
    }
    out.append(reinterpret_cast<const char *>(field.start), field.next - field.start);
  }
  return Error::success();
}

} // namespace

Expected<std::string> makeSkeleton(StringRef bytes, uint64_t threshold) {
  SkeletonWriter writer(bytes, threshold);
  std::string out;
  out.reserve(std::min<size_t>(bytes.size(), 1 << 20));
  const auto *begin = reinterpret_cast<const uint8_t *>(bytes.data());
  if (Error err = writer.rewrite(MessageKind::Model, begin, begin + bytes.size(), out, 0))
    return err;
  return out;
}

} // namespace pipec
