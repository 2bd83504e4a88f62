//===- Diagnostics.h - How errors name what they are about ---------------===//
//
// One wording for the node an error is about, wherever it is found: the
// importer, the passes, the CPU and CUDA kernels. An error names the node
// (its name, else its first output) and its op: "node 'NAME' (OP): WHAT".
// A reader's error about a file it reads names the file: "PATH: WHAT".
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_DIAGNOSTICS_H
#define PIPEC_SUPPORT_DIAGNOSTICS_H

#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <string>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec {

/// How errors name \p node: its name, else its first output, else
/// "<unnamed>".
std::string nodeLabel(const onnx::NodeProto &node);

/// "node 'LABEL' (OP): WHAT", with \p opType given (a fused node's errors
/// name FusedElementwise, not the step).
llvm::Error nodeError(llvm::StringRef label, llvm::StringRef opType, const llvm::Twine &what);
/// "node 'LABEL' (OP): WHAT" for \p node.
llvm::Error nodeError(const onnx::NodeProto &node, const llvm::Twine &what);

/// "PATH: WHAT", about the file at \p path.
llvm::Error fileError(llvm::StringRef path, const llvm::Twine &what);

} // namespace pipec

#endif // PIPEC_SUPPORT_DIAGNOSTICS_H
