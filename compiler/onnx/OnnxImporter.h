//===- OnnxImporter.h - Read an ONNX file into a pipec Graph ------------===//
//
// The importer reads what real exporters write (torch.onnx.export, tf2onnx
// and keras2onnx, paddle2onnx, onnxruntime's tools) with their quirks:
// unsorted node lists, names defined twice, weights in Constant nodes,
// initializers listed as graph inputs, external data, fp16/bf16 weights,
// symbolic dimensions, non-default domains and control flow. Weight bytes
// are never copied: they stay in memory-mapped files and the Graph keeps
// (file, offset, length) references, also for weights stored inline in the
// .onnx file. This is the only part of pipec that catches exceptions (the
// ONNX library throws); everything past it returns llvm::Error.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_ONNX_ONNXIMPORTER_H
#define PIPEC_COMPILER_ONNX_ONNXIMPORTER_H

#include "compiler/ir/Graph.h"
#include "support/WireSkeleton.h"

#include "llvm/Support/Error.h"

#include <map>
#include <string>
#include <vector>

namespace pipec {

struct ImportOptions {
  ShapeBindings bindings;
  /// Inline raw_data of at least this many bytes is left in the mapped file
  /// and referenced; smaller tensors are parsed with the model (shape
  /// constants, scalars).
  uint64_t inlineThreshold = DefaultInlineThreshold;
  /// `--tp T`: the Graph's tensorParallel, which shard-tensors reads.
  int tensorParallel = 1;
  /// `--sequence-parallel`: the Graph's sequenceParallel.
  bool sequenceParallel = false;
  /// Compiled for training: the Graph's training, which shard-tensors reads.
  bool training = false;
  /// The Graph's fuseAttention (--attention unfused clears it).
  bool fuseAttention = true;
};

/// Parses \p path into a Graph with ops in topological order and input shapes
/// bound. Shapes of other values are left for the infer-shapes pass. Errors
/// name the file and, where there is one, the node or tensor at fault.
llvm::Expected<Graph> importOnnx(llvm::StringRef path, const ImportOptions &options = {});

/// Parses an in-memory model (tests and generators). \p displayName is used
/// in diagnostics and \p baseDir to resolve external data.
llvm::Expected<Graph> importOnnxBuffer(std::unique_ptr<llvm::MemoryBuffer> buffer,
                                       llvm::StringRef displayName, llvm::StringRef baseDir,
                                       const ImportOptions &options = {});

/// The highest opset of the default domain this build can type-check.
int64_t maxSupportedOpset();

} // namespace pipec

#endif // PIPEC_COMPILER_ONNX_ONNXIMPORTER_H
