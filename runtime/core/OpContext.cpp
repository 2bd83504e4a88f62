//===- OpContext.cpp - One node under evaluation --------------------------===//
#include "runtime/core/OpContext.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

using namespace llvm;

namespace pipec {

char UnsupportedError::ID = 0;

void UnsupportedError::log(raw_ostream &os) const {
  os << "node '" << node << "' (" << opType << "): " << detail;
}

std::error_code UnsupportedError::convertToErrorCode() const {
  return std::make_error_code(std::errc::not_supported);
}

namespace {

/// A node's attributes for the element math.
class NodeParams final : public kernels::ParamReader {
public:
  explicit NodeParams(const onnx::NodeProto &node) : node(node) {}
  int64_t attrInt(const char *name, int64_t otherwise) const override {
    return pipec::attrInt(node, name, otherwise);
  }
  float attrFloat(const char *name, float otherwise) const override {
    return pipec::attrFloat(node, name, otherwise);
  }
  std::string attrString(const char *name, const char *otherwise) const override {
    return pipec::attrString(node, name, otherwise);
  }

private:
  const onnx::NodeProto &node;
};

} // namespace

Expected<WindowAttrs> OpContext::windowAttrs(int64_t rank) const {
  Expected<WindowAttrs> w = readWindowAttrs(
      rank, [&](StringRef name) { return attrInts(name); },
      [&](StringRef name) { return attrString(name, ""); });
  if (!w)
    return fail(toString(w.takeError()));
  return w;
}

StringRef OpContext::op() const { return node.op_type(); }

size_t OpContext::numOutputs() const { return node.output_size(); }

bool OpContext::wantsOutput(size_t i) const {
  return i < numOutputs() && !node.output(static_cast<int>(i)).empty();
}

const onnx::AttributeProto *OpContext::attr(StringRef name) const { return findAttr(node, name); }

int64_t OpContext::attrInt(StringRef name, int64_t otherwise) const {
  return pipec::attrInt(node, name, otherwise);
}

float OpContext::attrFloat(StringRef name, float otherwise) const {
  return pipec::attrFloat(node, name, otherwise);
}

std::string OpContext::attrString(StringRef name, StringRef otherwise) const {
  return pipec::attrString(node, name, otherwise);
}

std::optional<OpContext::Shape> OpContext::attrInts(StringRef name) const {
  return pipec::attrInts(node, name);
}

std::optional<OpContext::Shape> OpContext::intsFromInputOrAttr(size_t i, StringRef name) const {
  if (const cpu::Tensor *t = optInput(i))
    return t->toInt64Vector();
  return attrInts(name);
}

Expected<kernels::ElemParams> OpContext::elemParams(ElemOp op) const {
  struct Read {
    ElemOp op;
    kernels::ElemParams params;
    std::string error;
  };
  auto readNow = [&] {
    Read r{op, {}, {}};
    r.error = kernels::readElemParams(op, NodeParams(node), r.params);
    return r;
  };
  Read read = parsed<Read>(readNow);
  if (read.op != op) // a node read as another op than the first time
    read = readNow();
  if (!read.error.empty())
    return fail(read.error);
  return read.params;
}

Error OpContext::fail(const Twine &message) const { return nodeError(node, message); }

Error OpContext::unsupported(const Twine &message) const {
  return make_error<UnsupportedError>(nodeLabel(node), node.op_type(), message.str());
}

Error OpContext::unsupportedType(const cpu::Tensor &t, size_t inputIndex) const {
  return unsupported(
      formatv("element type {0} of input {1}", cpu::elemTypeName(t.elemType()), inputIndex));
}

Error OpContext::sameType(size_t i, size_t j) const {
  const cpu::Tensor &a = input(i), &b = input(j);
  if (a.elemType() == b.elemType())
    return Error::success();
  return fail(formatv("input element types differ: input {0} is {1}, input {2} is {3}", i,
                      cpu::elemTypeName(a.elemType()), j, cpu::elemTypeName(b.elemType())));
}

Error OpContext::sameTypeAsFirst(size_t i) const {
  const cpu::Tensor *t = optInput(i);
  if (!t || t->elemType() == input(0).elemType())
    return Error::success();
  return fail(formatv("input {0} is {1}, input 0 is {2}", i, cpu::elemTypeName(t->elemType()),
                      cpu::elemTypeName(input(0).elemType())));
}

Error OpContext::integerInput(size_t i, StringRef what) const {
  const cpu::Tensor *t = optInput(i);
  if (!t || cpu::isInteger(t->elemType()))
    return Error::success();
  return fail(formatv("{0} (input {1}) must hold integers, got {2}", what, i, t->describe()));
}

Expected<int64_t> OpContext::normalizeAxis(int64_t axis, int64_t rank, StringRef what) const {
  if (axis < -rank || axis >= rank)
    return fail(formatv("{0} {1} is out of range for rank {2}", what, axis, rank));
  return axis < 0 ? axis + rank : axis;
}

} // namespace pipec
