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

/// The evaluator of \p def when Ops.def marks it Fold (default domain only);
/// null for the other ops, and for a Fold op the evaluator does not
/// implement (OpRegistryTest requires there is none).
fold::Evaluator evaluatorOf(const OpDef &def) {
  if (def.domain != OpDomain::Onnx || !def.has(Fold))
    return nullptr;
  switch (def.id) {
  case OpId::Constant:
    return fold::constant;
  case OpId::Identity:
    return fold::identity;
  case OpId::Cast:
    return fold::cast;
  case OpId::Shape:
  case OpId::Size:
    return fold::shapeOrSize;
  case OpId::Gather:
    return fold::gather;
  case OpId::Unsqueeze:
    return fold::unsqueeze;
  case OpId::Squeeze:
    return fold::squeeze;
  case OpId::Concat:
    return fold::concat;
  case OpId::Slice:
    return fold::slice;
  case OpId::Reshape:
    return fold::reshape;
  case OpId::Flatten:
    return fold::flatten;
  case OpId::Expand:
    return fold::expand;
  case OpId::Tile:
    return fold::tile;
  case OpId::Transpose:
    return fold::transpose;
  case OpId::ConstantOfShape:
    return fold::constantOfShape;
  case OpId::Range:
    return fold::range;
  case OpId::Where:
    return fold::where;
  case OpId::Add:
  case OpId::Sub:
  case OpId::Mul:
  case OpId::Div:
  case OpId::Equal:
  case OpId::Less:
  case OpId::Greater:
  case OpId::LessOrEqual:
  case OpId::GreaterOrEqual:
  case OpId::And:
  case OpId::Or:
  case OpId::Min:
  case OpId::Max:
  case OpId::Pow:
  case OpId::Mod:
    return fold::binary;
  case OpId::Neg:
  case OpId::Not:
  case OpId::Sqrt:
  case OpId::Reciprocal:
  case OpId::Abs:
  case OpId::Floor:
  case OpId::Ceil:
  case OpId::Relu:
    return fold::unary;
  case OpId::ReduceMax:
  case OpId::ReduceMin:
  case OpId::ReduceProd:
  case OpId::ReduceSum:
    return fold::reduce;
  default:
    return nullptr;
  }
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
