//===- ConstantEvaluator.cpp - Evaluate shape arithmetic at compile time --===//
//
// Picks the evaluator of an op by its row of ops/Ops.def and runs it; the
// evaluators are in passes/fold/ (FoldContext.h lists them by family).
//
//===----------------------------------------------------------------------===//
#include "passes/ConstantEvaluator.h"

#include "ops/OpRegistry.h"
#include "passes/fold/FoldContext.h"

using namespace llvm;

namespace pipec {
namespace {

/// The evaluator of each row of Ops.def (its FOLD column), by OpId.
// clang-format off
const fold::Evaluator evaluators[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, DEVICE, FOLD,    \
                 FLAGS, SHARD)                                                                     \
    fold::FOLD,
#include "ops/Ops.def"
};
// clang-format on

/// The evaluator of \p def (default domain only); null for the others.
fold::Evaluator evaluatorOf(const OpDef &def) {
  return def.domain == OpDomain::Onnx ? evaluators[static_cast<size_t>(def.id)] : nullptr;
}

const OpDef *defOf(const Graph &graph, const Op &op) {
  return lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
}

} // namespace

bool isEvaluable(const Graph &graph, const Op &op) {
  const OpDef *def = defOf(graph, op);
  return def && evaluatorOf(*def);
}

Expected<std::optional<std::vector<ConstTensor>>> evaluateOp(const Graph &graph, const Op &op,
                                                             ArrayRef<const ConstTensor *> in,
                                                             int64_t maxElements) {
  const OpDef *def = defOf(graph, op);
  fold::Evaluator evaluate = def ? evaluatorOf(*def) : nullptr;
  if (!evaluate)
    return fold::invalid(graph, op, "no evaluator");
  return evaluate(fold::FoldContext{graph, op, graph.node(op), *def, in, maxElements});
}

} // namespace pipec
