//===- EinsumGrads.cpp - The gradient of Einsum --------------------------===//
//
// An einsum is linear in each operand, so the gradient of operand i is an
// einsum too: dY and every other operand, contracted into operand i's
// labels. Three things take more than that one einsum:
//
//   - '...' is written out as letters the equation does not use, one per
//     dimension it spans in each operand (right-aligned, as the kernel
//     aligns them), since the ranks are static;
//   - a label only operand i has, summed away by the forward, is in no
//     operand of the gradient einsum: it is left out there, and the result
//     is expanded back along it;
//   - a dimension of size 1 that the forward broadcast against a larger one
//     is summed back to 1 (pipec.SumTo); one the other operands broadcast
//     against operand i's larger one is expanded.
//
// A label repeated within one operand (a diagonal, "ii->i") has no rule.
//
// Before:  y = Einsum(x, w) [equation = "bsd,edf->bsef"]
// After:   grad:x = Einsum(dY, w) [equation = "bsef,edf->bsd"]
//          grad:w = Einsum(dY, x) [equation = "bsef,bsd->edf"]
//
// Before:  y = Einsum(a, b) [equation = "ij,jk->i"]
// After:   grad:b = Expand(Reshape(Einsum(dY, a) ["i,ij->j"], [J, 1]), [J, K])
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "ops/Einsum.h"
#include "support/Attributes.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"

#include <algorithm>

using namespace llvm;

namespace pipec::grad {
namespace {

/// A term of the equation: one letter per dimension.
using Term = std::string;

/// The equation with '...' written out: a term per operand and the output's.
struct Equation {
  std::vector<Term> inputs;
  Term output;
};

/// Parses the forward node's equation (ops/Einsum.h) against its operands'
/// ranks, as letters.
Expected<Equation> parseEquation(GradContext &ctx) {
  std::vector<int64_t> ranks;
  for (size_t i = 0; i < ctx.op().inputs.size(); ++i)
    ranks.push_back(static_cast<int64_t>(ctx.shapeOf(i).size()));
  Expected<EinsumEquation> parsed = parseEinsum(attrString(ctx.node(), "equation", ""), ranks);
  if (!parsed)
    return ctx.error(toString(parsed.takeError()));
  Equation eq;
  for (const EinsumEquation::Labels &labels : parsed->inputs)
    eq.inputs.push_back(parsed->letters(labels));
  eq.output = parsed->letters(parsed->output);
  return eq;
}

/// The gradient of operand \p i of the einsum \p eq.
Error operandGrad(GradContext &ctx, const Equation &eq, size_t i) {
  const Term &own = eq.inputs[i];
  for (size_t d = 0; d < own.size(); ++d)
    if (own.find(own[d]) != d)
      return ctx.error("gradient of an operand with a repeated label (a diagonal) in '" +
                       attrString(ctx.node(), "equation", "") + "' is not implemented");
  // The terms and inputs of the gradient einsum, and what it produces.
  std::vector<Term> terms = {eq.output};
  std::vector<std::string> inputs = {ctx.dy()};
  std::vector<const std::vector<int64_t> *> shapes = {&ctx.yShape()};
  for (size_t j = 0; j < eq.inputs.size(); ++j)
    if (j != i) {
      terms.push_back(eq.inputs[j]);
      inputs.push_back(ctx.in(j));
      shapes.push_back(&ctx.shapeOf(j));
    }
  const std::vector<int64_t> &xShape = ctx.shapeOf(i);
  Term produced;
  std::vector<int64_t> gShape; // X's rank: 1 where a label is X's alone
  std::vector<int64_t> producedShape;
  for (size_t d = 0; d < own.size(); ++d) {
    int64_t size = 1;
    bool shared = false;
    for (size_t t = 0; t < terms.size(); ++t)
      for (size_t k = 0; k < terms[t].size(); ++k)
        if (terms[t][k] == own[d]) {
          // A size of 1 broadcasts against the others, as in the kernel.
          if (!shared || size == 1)
            size = (*shapes[t])[k];
          shared = true;
        }
    if (!shared) {
      gShape.push_back(1);
      continue;
    }
    produced.push_back(own[d]);
    producedShape.push_back(size);
    gShape.push_back(size);
  }
  std::string g = ctx.dy();
  if (inputs.size() > 1 || produced != eq.output) {
    std::string equation = terms[0]; // empty for a scalar dY
    for (size_t t = 1; t < terms.size(); ++t)
      equation += "," + terms[t];
    onnx::NodeProto &node = ctx.emit("Einsum", inputs);
    GradContext::setString(node, "equation", equation + "->" + produced);
    g = GradContext::out(node);
  }
  if (gShape != producedShape)
    g = ctx.reshape(g, gShape);
  // Broadcast dimensions summed back to 1; X's own expanded from 1.
  std::vector<int64_t> summed = gShape;
  for (size_t d = 0; d < own.size(); ++d)
    if (xShape[d] == 1)
      summed[d] = 1;
  g = ctx.sumTo(g, gShape, summed);
  if (summed != xShape)
    g = ctx.binary("Expand", g, ctx.constInts(xShape));
  ctx.contribute(i, g);
  return Error::success();
}

Error einsumGrad(GradContext &ctx) {
  Expected<Equation> eq = parseEquation(ctx);
  if (!eq)
    return eq.takeError();
  return ctx.forEachWanted([&](size_t i) { return operandGrad(ctx, *eq, i); });
}

} // namespace

namespace rules {
const GradRule einsum{&einsumGrad};
} // namespace rules

} // namespace pipec::grad
