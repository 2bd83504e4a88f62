//===- ModelIO.h - Writing what a run produced ---------------------------===//
//
// saveTrainedModel writes the model a plan was compiled from with its
// trained weights: every initializer (and Constant-node tensor) named in
// \p trained gets the new values; the rest are copied. Models whose tensors
// total more than 1 GiB store them as external data in OUT.data, as ONNX
// does for big models. Files are written atomically (temporary + rename).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_MODELIO_H
#define PIPEC_RUNTIME_EXEC_MODELIO_H

#include "runtime/core/Tensor.h"
#include "runtime/plan/PlanFile.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <string>

namespace pipec::rt {

/// Writes \p modelPath with the weights in \p trained to \p out.
llvm::Error saveTrainedModel(llvm::StringRef modelPath,
                             const std::map<std::string, cpu::Tensor> &trained,
                             llvm::StringRef out);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_MODELIO_H
