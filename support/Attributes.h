//===- Attributes.h - Typed access to ONNX node attributes --------------===//
//
// Shared by the compiler (passes read attributes of the graph's nodes) and the
// runtime (kernels read those of the plan's nodes).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_ATTRIBUTES_H
#define PIPEC_SUPPORT_ATTRIBUTES_H

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringRef.h"

#include <optional>
#include <string>
#include <vector>

namespace pipec {

inline const onnx::AttributeProto *findAttr(const onnx::NodeProto &node, llvm::StringRef name) {
  for (const auto &attr : node.attribute())
    if (attr.name() == name)
      return &attr;
  return nullptr;
}

inline int64_t attrInt(const onnx::NodeProto &node, llvm::StringRef name, int64_t otherwise) {
  const auto *attr = findAttr(node, name);
  return attr ? attr->i() : otherwise;
}

inline float attrFloat(const onnx::NodeProto &node, llvm::StringRef name, float otherwise) {
  const auto *attr = findAttr(node, name);
  return attr ? attr->f() : otherwise;
}

inline std::string attrString(const onnx::NodeProto &node, llvm::StringRef name,
                              llvm::StringRef otherwise = "") {
  const auto *attr = findAttr(node, name);
  return attr ? attr->s() : otherwise.str();
}

inline std::optional<std::vector<int64_t>> attrInts(const onnx::NodeProto &node,
                                                    llvm::StringRef name) {
  const auto *attr = findAttr(node, name);
  if (!attr)
    return std::nullopt;
  return std::vector<int64_t>(attr->ints().begin(), attr->ints().end());
}

} // namespace pipec

#endif // PIPEC_SUPPORT_ATTRIBUTES_H
