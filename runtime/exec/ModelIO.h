//===- ModelIO.h - Writing what a run produced ---------------------------===//
//
// saveTrainedModel writes the model a plan was compiled from with its
// trained weights: every initializer (and Constant-node tensor) named in
// \p trained gets the new values; the rest are copied. Models whose tensors
// total more than 1 GiB store them as external data in OUT.data, as ONNX
// does for big models. Files are written atomically (temporary + rename).
//
// The plan's ties (passes/TieWeights.h) say where the stages read other
// weights than the file's: an untied initializer's copies become
// initializers of their own, read by the nodes that read the copy in the
// plan (the original is dropped when no node reads it any more); a retied
// head is written as the transpose of its embedding's trained values. The
// saved model is the model file's graph with those edits, and onnxruntime
// computes with what trained.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_MODELIO_H
#define PIPEC_RUNTIME_EXEC_MODELIO_H

#include "plan/PlanFile.h"
#include "runtime/core/Tensor.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <string>
#include <vector>

namespace pipec::rt {

/// Writes \p modelPath with the weights in \p trained to \p out, edited
/// as the ties of \p plan (the plan compiled from it) say.
llvm::Error saveTrainedModel(llvm::StringRef modelPath,
                             const std::map<std::string, cpu::Tensor> &trained,
                             const plan::Plan &plan, llvm::StringRef out);

/// --init: the weights \p checkpoint gives through \p plan's ParamMap, as
/// tensors in each weight's layout. Errors name the checkpoint and the
/// tensor: missing, or of another shape or dtype than the map's. Trained
/// weights the map does not cover keep the model file's values, each with
/// a line in \p warnings.
llvm::Expected<std::map<std::string, cpu::Tensor>>
loadInitWeights(const plan::Plan &plan, llvm::StringRef checkpoint,
                std::vector<std::string> &warnings);

/// --save-weights OUT.safetensors: every parameter of \p plan's ParamMap
/// under its own name, shape and dtype, from the weights in \p trained
/// through the inverse steps; parameters no trained weight holds, and a
/// sliced table's other rows (times \p untrainedFactor), as \p base (the
/// checkpoint the run started from) has them.
llvm::Error saveTrainedParams(const plan::Plan &plan,
                              const std::map<std::string, cpu::Tensor> &trained,
                              llvm::StringRef base, double untrainedFactor, llvm::StringRef out);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_MODELIO_H
