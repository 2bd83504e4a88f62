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

/// An error in what the user typed (a malformed flag or value), as opposed
/// to bad input files or a failed step: the command line exits 2 for it,
/// 1 for the others.
class UsageError : public llvm::ErrorInfo<UsageError> {
public:
  static char ID;
  explicit UsageError(std::string text) : text(std::move(text)) {}
  void log(llvm::raw_ostream &os) const override;
  std::error_code convertToErrorCode() const override;

private:
  std::string text;
};

/// A UsageError: "--flag VALUE: what was expected".
llvm::Error usageError(const llvm::Twine &message);

} // namespace pipec

#endif // PIPEC_SUPPORT_DIAGNOSTICS_H
