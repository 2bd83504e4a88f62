//===- GradRules.cpp - Ops.def's GRAD column as a table ------------------===//
#include "passes/grad/GradRules.h"

#include "ops/OpRegistry.h"

using namespace llvm;

namespace pipec::grad {
namespace {

Error noContribution(GradContext &) { return Error::success(); }

bool noInput(size_t) { return false; }

Error noRule(GradContext &ctx) { return ctx.error("no gradient rule"); }

} // namespace

namespace rules {
const GradRule none = {&noContribution, &noInput};
const GradRule missing = {&noRule};
} // namespace rules

namespace {

/// The rule of each row of Ops.def, indexed by OpId.
const GradRule *const table[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, ...) &rules::GRAD,
#include "ops/Ops.def"
};

} // namespace

const GradRule &gradRuleOf(const OpDef *def) {
  return def ? *table[static_cast<size_t>(def->id)] : rules::missing;
}

} // namespace pipec::grad
