//===- Attributes.h - Typed access to ONNX node attributes --------------===//
//
// Shared by the compiler (passes read attributes of the graph's nodes) and the
// runtime (kernels read those of the plan's nodes).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_ATTRIBUTES_H
#define PIPEC_SUPPORT_ATTRIBUTES_H

#include "onnx/onnx_pb.h"

#include "llvm/ADT/ArrayRef.h"
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

// Setters: each adds attribute \p name to \p node (which must not have it).

inline onnx::AttributeProto &addAttr(onnx::NodeProto &node, llvm::StringRef name,
                                     onnx::AttributeProto::AttributeType type) {
  onnx::AttributeProto &attr = *node.add_attribute();
  attr.set_name(name.str());
  attr.set_type(type);
  return attr;
}

inline void setAttrInt(onnx::NodeProto &node, llvm::StringRef name, int64_t v) {
  addAttr(node, name, onnx::AttributeProto::INT).set_i(v);
}

inline void setAttrFloat(onnx::NodeProto &node, llvm::StringRef name, float v) {
  addAttr(node, name, onnx::AttributeProto::FLOAT).set_f(v);
}

inline void setAttrString(onnx::NodeProto &node, llvm::StringRef name, llvm::StringRef v) {
  addAttr(node, name, onnx::AttributeProto::STRING).set_s(v.str());
}

inline void setAttrInts(onnx::NodeProto &node, llvm::StringRef name, llvm::ArrayRef<int64_t> v) {
  onnx::AttributeProto &attr = addAttr(node, name, onnx::AttributeProto::INTS);
  for (int64_t x : v)
    attr.add_ints(x);
}

inline void setAttrFloats(onnx::NodeProto &node, llvm::StringRef name, llvm::ArrayRef<float> v) {
  onnx::AttributeProto &attr = addAttr(node, name, onnx::AttributeProto::FLOATS);
  for (float x : v)
    attr.add_floats(x);
}

} // namespace pipec

#endif // PIPEC_SUPPORT_ATTRIBUTES_H
