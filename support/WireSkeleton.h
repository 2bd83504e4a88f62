//===- WireSkeleton.h - Parse ONNX protobuf without copying weights -----===//
//
// Protobuf's generated parser copies every `bytes` field, so a model with
// gigabytes of inline weights would be read into memory once more. This
// scanner walks the wire format of a ModelProto and writes a copy without
// the large raw_data payloads: each such TensorProto is rewritten to say
// that its data is external, at (offset, length) of the model file itself,
// with a marker entry "pipec.inline". The copy is then parsed as usual; its
// size depends on the number of nodes, not on the weight bytes.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_WIRESKELETON_H
#define PIPEC_SUPPORT_WIRESKELETON_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>

namespace pipec {

/// How deep subgraphs (If, Loop and Scan bodies) may nest in a model pipec
/// reads. Each level nests three messages (node, attribute, graph), which
/// protobuf's parser counts against its recursion limit (100 by default: 33
/// levels of If).
inline constexpr int MaxSubgraphDepth = 1000;
/// The nesting of messages that allows: a model, its graph, and per level.
inline constexpr int MaxMessageDepth = 3 * MaxSubgraphDepth + 16;

/// The raw_data size from which pipec leaves a tensor's bytes in the file:
/// smaller tensors (shape constants, scalars) are parsed with the model.
inline constexpr uint64_t DefaultInlineThreshold = 64;

/// The external_data key that marks a tensor rewritten by makeSkeleton.
inline constexpr const char *InlineDataMarker = "pipec.inline";

/// Returns \p bytes (a serialized ModelProto) with every TensorProto.raw_data
/// of at least \p threshold bytes replaced by a reference into \p bytes.
/// Fails with the byte offset where the wire format is malformed.
llvm::Expected<std::string> makeSkeleton(llvm::StringRef bytes, uint64_t threshold);

} // namespace pipec

#endif // PIPEC_SUPPORT_WIRESKELETON_H
