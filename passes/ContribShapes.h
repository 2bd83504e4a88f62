//===- ContribShapes.h - Shapes of onnxruntime's contrib ops ------------===//
//
// libonnx has no schemas for the com.microsoft ops that onnxruntime's
// optimizers and exporters emit (Attention, SkipLayerNormalization, ...), nor
// for SimplifiedLayerNormalization, which onnxruntime registers in the
// default domain. These rules give their output shapes.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_CONTRIBSHAPES_H
#define PIPEC_PASSES_CONTRIBSHAPES_H

#include "compiler/ir/Graph.h"

#include <optional>

namespace pipec {

struct TensorType {
  DType type = DType::Undefined;
  std::vector<int64_t> shape;
};

/// Output types of \p op, or std::nullopt when pipec has no rule for it.
/// Errors when a rule applies but the inputs do not fit it.
llvm::Expected<std::optional<std::vector<TensorType>>> inferContribShapes(const Graph &graph,
                                                                          const Op &op);

} // namespace pipec

#endif // PIPEC_PASSES_CONTRIBSHAPES_H
