//===- FoldConstants.h - fold-constants: drop ops computed at compile time ===//
//
// After infer-shapes, an op whose every output holds a compile-time value
// (ConstTensor) is no longer needed: its outputs become constants and the op
// is removed. Run eliminate-dead afterwards to drop what only fed it.
//
// A ConstantOfShape that fills a float parameter (a model stored without its
// weights' bytes: ONNX's light models, `pipec model --light`) becomes that
// parameter, a weight of the graph as an initializer would hold it
// (support/FillTensor.h): it trains, shards and counts as the tensor of the
// checkpoint it stands for.
//
// Before:  %t = Concat(%a, %b)        ; %t known: i64[4] {2,16,4,16}
//          %y = Reshape(%x, %t)
// After:   %y = Reshape(%x, %t)       ; %t is a constant, Concat is gone
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_FOLDCONSTANTS_H
#define PIPEC_PASSES_FOLDCONSTANTS_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Returns whether any op was removed.
llvm::Expected<bool> foldConstants(Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_FOLDCONSTANTS_H
