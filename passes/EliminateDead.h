//===- EliminateDead.h - eliminate-dead: remove ops no output needs -----===//
//
// Removes ops none of whose outputs reaches a graph output, and forgets
// weights and constants nothing reads any more.
//
// Before:  %a = Shape(%x)   ; %a unused after fold-constants
//          %y = Relu(%x)    ; graph output
// After:   %y = Relu(%x)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_ELIMINATEDEAD_H
#define PIPEC_PASSES_ELIMINATEDEAD_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// Returns whether any op was removed.
llvm::Expected<bool> eliminateDead(Graph &graph);

} // namespace pipec

#endif // PIPEC_PASSES_ELIMINATEDEAD_H
