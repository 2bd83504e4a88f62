//===- Subgraphs.cpp - What a node's subgraphs read from outside ----------===//
#include "support/Subgraphs.h"

#include "llvm/ADT/StringSet.h"

namespace pipec {

namespace {

/// Appends \p name to \p names unless \p seen has it.
void addOnce(const std::string &name, llvm::StringSet<> &seen, std::vector<std::string> &names) {
  if (!name.empty() && seen.insert(name).second)
    names.push_back(name);
}

void appendCaptures(const onnx::NodeProto &node, llvm::StringSet<> &seen,
                    std::vector<std::string> &names) {
  for (const onnx::AttributeProto &attr : node.attribute()) {
    if (attr.has_g())
      for (const std::string &name : outerReads(attr.g()))
        addOnce(name, seen, names);
    for (const onnx::GraphProto &g : attr.graphs())
      for (const std::string &name : outerReads(g))
        addOnce(name, seen, names);
  }
}

} // namespace

std::vector<std::string> outerReads(const onnx::GraphProto &body) {
  llvm::StringSet<> local;
  for (const auto &in : body.input())
    local.insert(in.name());
  for (const auto &init : body.initializer())
    local.insert(init.name());
  for (const auto &node : body.node())
    for (const auto &out : node.output())
      local.insert(out);
  llvm::StringSet<> seen;
  std::vector<std::string> names;
  for (const auto &node : body.node()) {
    for (const auto &in : node.input())
      if (!local.count(in))
        addOnce(in, seen, names);
    std::vector<std::string> inner;
    llvm::StringSet<> innerSeen;
    appendCaptures(node, innerSeen, inner);
    for (const std::string &name : inner)
      if (!local.count(name))
        addOnce(name, seen, names);
  }
  // A graph output may name an outer value directly.
  for (const auto &out : body.output())
    if (!local.count(out.name()))
      addOnce(out.name(), seen, names);
  return names;
}

std::vector<std::string> subgraphCaptures(const onnx::NodeProto &node) {
  llvm::StringSet<> seen;
  std::vector<std::string> names;
  appendCaptures(node, seen, names);
  return names;
}

} // namespace pipec
