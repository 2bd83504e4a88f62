//===- InferShapes.h - infer-shapes: a static shape for every value -----===//
//
// Walks the ops in topological order and gives each output an element type
// and a static shape. Shape arithmetic on compile-time values (Shape, Gather,
// Concat, Range, ConstantOfShape, ...) is evaluated on the way, so that the
// Reshape and Expand targets exporters compute at run time become known.
// Where ONNX's inference needs data that is computed from weights (Resize's
// scales from float initializers, which look like parameters), that data is
// evaluated too, at the inputs ONNX marks not differentiable; it becomes a
// constant when no op reads it differentiably.
// Shapes come from, in order: evaluation, pipec's rules for onnxruntime's
// com.microsoft ops, ONNX's own per-op inference, and the type the model
// declares for the value. Fails naming the node when none gives a static
// shape.
//
// Before (torch export, batch bound to 2):
//   %s = Shape(%x)            ; x: f32[2,16,64]
//   %b = Gather(%s, 0)
//   %t = Concat(Unsqueeze(%b), [16,4,16])
//   %y = Reshape(%x, %t)
// After: %s = i64[3] {2,16,64}, %t = i64[4] {2,16,4,16}, %y: f32[2,16,4,16]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_INFERSHAPES_H
#define PIPEC_PASSES_INFERSHAPES_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Largest compile-time tensor the pass evaluates and keeps, in elements.
inline constexpr int64_t MaxFoldElements = 1 << 16;

/// Returns whether any value got a shape or a value.
llvm::Expected<bool> inferShapes(Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_INFERSHAPES_H
