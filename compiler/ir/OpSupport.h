//===- OpSupport.h - Which ops the pipec runtime executes ---------------===//
//
// The compiler accepts any op it can shape; the runtime executes a fixed
// set. Reports warn about the rest before a plan is run.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_IR_OPSUPPORT_H
#define PIPEC_COMPILER_IR_OPSUPPORT_H

#include "compiler/ir/Graph.h"

namespace pipec {

/// True if the runtime has (or is specified to have) a kernel for \p op.
bool isRuntimeSupported(const Op &op);
/// True for If, Loop and Scan: kept as one opaque op.
bool isControlFlow(const Op &op);

} // namespace pipec

#endif // PIPEC_COMPILER_IR_OPSUPPORT_H
