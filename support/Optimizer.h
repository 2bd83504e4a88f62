//===- Optimizer.h - The optimizers pipec trains with -------------------===//
//
// One enum and one table of names for every floor: compile prices the
// optimizer's state (compiler/cost/MemoryModel), the plan records its name
// (TrainingInfo.optimizer), and run updates the weights and checks a
// checkpoint's state by it (runtime/core/Backend.h, runtime/exec).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_OPTIMIZER_H
#define PIPEC_SUPPORT_OPTIMIZER_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>

namespace pipec {

enum class Optimizer { SGD, Momentum, AdamW };

/// "sgd", "momentum" or "adamw", and the aliases "sgd-momentum" and "adam";
/// any case. The error is "--optimizer NAME: expected sgd, momentum or
/// adamw".
llvm::Expected<Optimizer> parseOptimizer(llvm::StringRef name);

/// "sgd", "momentum" or "adamw": what plans record and flags take.
llvm::StringRef optimizerName(Optimizer optimizer);

/// "sgd, momentum or adamw", for errors.
std::string optimizerNameList();

} // namespace pipec

#endif // PIPEC_SUPPORT_OPTIMIZER_H
