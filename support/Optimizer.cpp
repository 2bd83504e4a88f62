//===- Optimizer.cpp - The optimizers pipec trains with -----------------===//
#include "support/Optimizer.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"

#include <optional>
#include <string>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<Optimizer> optimizerNames[] = {
    {Optimizer::SGD, "sgd"}, {Optimizer::Momentum, "momentum"}, {Optimizer::AdamW, "adamw"}};
/// Other names --optimizer takes.
constexpr EnumName<Optimizer> optimizerAliases[] = {{Optimizer::Momentum, "sgd-momentum"},
                                                    {Optimizer::AdamW, "adam"}};

} // namespace

Expected<Optimizer> parseOptimizer(StringRef name) {
  std::string lower = name.lower();
  if (std::optional<Optimizer> optimizer = valueOf(optimizerNames, lower))
    return *optimizer;
  if (std::optional<Optimizer> optimizer = valueOf(optimizerAliases, lower))
    return *optimizer;
  return usageError("--optimizer " + name + ": expected " + optimizerNameList());
}

StringRef optimizerName(Optimizer optimizer) { return nameOf(optimizerNames, optimizer, "adamw"); }

std::string optimizerNameList() { return nameList(optimizerNames); }

} // namespace pipec
