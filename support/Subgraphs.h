//===- Subgraphs.h - What a node's subgraphs read from outside ------------===//
//
// If, Loop and Scan carry graphs as attributes. A subgraph may read any
// value of the scopes around it by name, without listing it as an input:
// ONNX's "outer scope" rule. The importer records those values as the op's
// captures (so that passes see the dependence), the plan lists them after
// the node's own inputs, and the CPU kernels resolve the subgraph's names
// against them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_SUBGRAPHS_H
#define PIPEC_SUPPORT_SUBGRAPHS_H

#include "onnx/onnx_pb.h"

#include <string>
#include <vector>

namespace pipec {

/// The names that \p body and the graphs nested in it read but do not
/// define (as an input, an initializer or a node's output), each once, in
/// the order they are first read.
std::vector<std::string> outerReads(const onnx::GraphProto &body);

/// The outer names that the subgraphs of \p node read: outerReads of each
/// graph attribute, each name once. Empty for a node without subgraphs.
std::vector<std::string> subgraphCaptures(const onnx::NodeProto &node);

} // namespace pipec

#endif // PIPEC_SUPPORT_SUBGRAPHS_H
