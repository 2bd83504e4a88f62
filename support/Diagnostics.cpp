//===- Diagnostics.cpp - How errors name what they are about -------------===//
#include "support/Diagnostics.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/raw_ostream.h"

using namespace llvm;

namespace pipec {

std::string nodeLabel(const onnx::NodeProto &node) {
  if (!node.name().empty())
    return node.name();
  for (const std::string &output : node.output())
    if (!output.empty())
      return output;
  return "<unnamed>";
}

Error nodeError(StringRef label, StringRef opType, const Twine &what) {
  return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s", label.str().c_str(),
                           opType.str().c_str(), what.str().c_str());
}

Error nodeError(const onnx::NodeProto &node, const Twine &what) {
  return nodeError(nodeLabel(node), node.op_type(), what);
}

Error fileError(StringRef path, const Twine &what) {
  return createStringError(inconvertibleErrorCode(), "%s: %s", path.str().c_str(),
                           what.str().c_str());
}

char UsageError::ID = 0;

void UsageError::log(raw_ostream &os) const { os << text; }

std::error_code UsageError::convertToErrorCode() const { return inconvertibleErrorCode(); }

Error usageError(const Twine &message) { return make_error<UsageError>(message.str()); }

} // namespace pipec
