//===- ModelIO.h - Writing what a run produced ---------------------------===//
//
// saveTrainedModel writes the model a plan was compiled from with its
// trained weights: every initializer (and Constant-node tensor) named in
// \p trained gets the new values; the rest are copied. Models whose tensors
// total more than 1 GiB store them as external data in OUT.data, as ONNX
// does for big models. Files are written atomically (temporary + rename).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_MODELIO_H
#define PIPEC_RUNTIME_CORE_MODELIO_H

#include "runtime/cpu/Tensor.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <string>

namespace pipec::rt {

/// Writes \p bytes to \p path through a temporary file and a rename.
llvm::Error writeFileAtomically(llvm::StringRef path, llvm::StringRef bytes);

/// Writes \p modelPath with the weights in \p trained to \p out.
llvm::Error saveTrainedModel(llvm::StringRef modelPath,
                             const std::map<std::string, cpu::Tensor> &trained,
                             llvm::StringRef out);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_CORE_MODELIO_H
