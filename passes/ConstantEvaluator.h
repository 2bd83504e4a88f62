//===- ConstantEvaluator.h - Evaluate shape arithmetic at compile time --===//
//
// Exporters compute reshape targets, masks and position ids at run time from
// Shape ops (Shape -> Gather -> Unsqueeze -> Concat -> Reshape, Range,
// ConstantOfShape, Expand, ...). Once input shapes are bound these are
// constants; this evaluator computes them so that infer-shapes can give every
// value a static shape and fold-constants can remove them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_CONSTANTEVALUATOR_H
#define PIPEC_PASSES_CONSTANTEVALUATOR_H

#include "compiler/ir/Graph.h"

#include <optional>

namespace pipec {

/// True if the FOLD column of \p op's row of Ops.def names an evaluator
/// (default domain only).
bool isEvaluable(const Graph &graph, const Op &op);

/// Evaluates \p op on \p inputs (nullptr for an omitted optional input).
/// Returns std::nullopt when an output would exceed \p maxElements; an error
/// when the inputs are invalid for the op. Precondition: isEvaluable(graph, op).
llvm::Expected<std::optional<std::vector<ConstTensor>>>
evaluateOp(const Graph &graph, const Op &op, llvm::ArrayRef<const ConstTensor *> inputs,
           int64_t maxElements);

} // namespace pipec

#endif // PIPEC_PASSES_CONSTANTEVALUATOR_H
