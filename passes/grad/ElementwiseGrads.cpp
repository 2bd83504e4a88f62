//===- ElementwiseGrads.cpp - Gradients of element-wise ops --------------===//
//
// Unary element-wise ops differentiate through their math: every row whose
// GRAD is unary gets one pipec.UnaryGrad node. Element-wise arithmetic with
// numpy broadcasting computes each input's gradient at the output's shape,
// and SumTo undoes the broadcast.
//
// Before:  Y = LeakyRelu(X, alpha=0.1)
// After:   grad:X = pipec.UnaryGrad(grad:Y, X, op="LeakyRelu", alpha=0.1)
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"

#include <cassert>

using namespace llvm;

namespace pipec::grad {
namespace {

constexpr bool same(const char *a, const char *b) {
  for (; *a && *a == *b; ++a, ++b) {
  }
  return *a == *b;
}

/// True if the math of element-wise row \p op has a derivative the
/// UnaryGrad kernel can compute: a function of the input or the output.
constexpr bool differentiable(ElemOp op) {
  kernels::GradFrom from = kernels::elemGradFrom(op);
  return from == kernels::GradFrom::Input || from == kernels::GradFrom::Output;
}

// Every row whose GRAD is unary is a unary element-wise op with a
// derivative (GradFrom::Zero rows take `none`).
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, ...)                  \
  static_assert(!same(#GRAD, "unary"), NAME ": GRAD unary is for element-wise rows");
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, COST, GRAD, ...)                         \
  static_assert(!same(#GRAD, "unary") || (ARITY == 1 && differentiable(ElemOp::ID)),               \
                NAME ": GRAD unary needs a unary op whose math has a derivative");
#include "ops/Ops.def"

/// dX = dY * f'(A) by the op's math (math/ElementMath.h): one
/// pipec.UnaryGrad node that names the forward op and carries its
/// attributes, A being X or Y as the math's derivative reads.
Error unaryGrad(GradContext &ctx) {
  assert(ctx.def() && ctx.def()->elem && "GRAD unary on a row without element-wise math");
  bool fromInput = kernels::elemGradFrom(*ctx.def()->elem) == kernels::GradFrom::Input;
  return ctx.forEachWanted([&](size_t) {
    onnx::NodeProto &g =
        ctx.emit("UnaryGrad", {ctx.dy(), fromInput ? ctx.in(0) : ctx.y()}, "pipec");
    GradContext::setString(g, "op", ctx.op().opType);
    for (const onnx::AttributeProto &attr : ctx.node().attribute())
      *g.add_attribute() = attr;
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// d(a + b) = dY for both, d(a - b) = -dY for b.
template <bool Subtract> Error addSubGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    std::string g = (Subtract && i == 1) ? ctx.unary("Neg", ctx.dy()) : ctx.dy();
    ctx.contribute(i, ctx.sumTo(g, ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

Error mulGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    std::string g = ctx.binary("Mul", ctx.dy(), ctx.in(1 - i));
    ctx.contribute(i, ctx.sumTo(g, ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

Error divGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    // d/da (a / b) = 1 / b; d/db (a / b) = -(a / b) / b = -y / b.
    std::string g =
        i == 0
            ? ctx.binary("Div", ctx.dy(), ctx.in(1))
            : ctx.unary("Neg", ctx.binary("Div", ctx.binary("Mul", ctx.dy(), ctx.y()), ctx.in(1)));
    ctx.contribute(i, ctx.sumTo(g, ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

/// A constant scalar exponent c: dX = c X^(c-1) dY.
Error powGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const Value &e = ctx.val(ctx.op().inputs[1]);
    if (i == 1 || !e.constant || e.constant->numElements() != 1)
      return ctx.error("gradient only for a constant scalar exponent");
    double c = e.constant->floatAt(0);
    DType type = ctx.type();
    std::string g = ctx.binary("Pow", ctx.in(0), ctx.constScalar(c - 1.0, type));
    g = ctx.binary("Mul", ctx.binary("Mul", g, ctx.constScalar(c, type)), ctx.dy());
    ctx.contribute(0, g);
    return Error::success();
  });
}

/// dY goes to the first operand that equals Y (ties are not split).
Error maxMinGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    std::string zero = ctx.constScalar(0.0, ctx.type());
    std::string g = GradContext::out(
        ctx.emit("Where", {ctx.binary("Equal", ctx.in(i), ctx.y()), ctx.dy(), zero}));
    for (size_t k = 0; k < i; ++k)
      g = GradContext::out(ctx.emit("Where", {ctx.binary("Equal", ctx.in(k), ctx.y()), zero, g}));
    ctx.contribute(i, ctx.sumTo(g, ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

Error sumGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    ctx.contribute(i, ctx.sumTo(ctx.dy(), ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

/// Inside [min, max] (bounds included) Y equals X and dY passes.
Error clipGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    if (i != 0)
      return ctx.error("gradient for the bounds min / max is not implemented");
    std::string inside = ctx.binary("Equal", ctx.in(0), ctx.y());
    ctx.contribute(0, GradContext::out(
                          ctx.emit("Where", {inside, ctx.dy(), ctx.constScalar(0.0, ctx.type())})));
    return Error::success();
  });
}

/// dY to X where the condition holds, to Y elsewhere; none to the condition.
Error whereGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0)
      return Error::success();
    std::string zero = ctx.constScalar(0.0, ctx.type());
    std::string g = i == 1 ? GradContext::out(ctx.emit("Where", {ctx.in(0), ctx.dy(), zero}))
                           : GradContext::out(ctx.emit("Where", {ctx.in(0), zero, ctx.dy()}));
    ctx.contribute(i, ctx.sumTo(g, ctx.yShape(), ctx.shapeOf(i)));
    return Error::success();
  });
}

} // namespace

namespace rules {
const GradRule unary{&unaryGrad}, add{&addSubGrad<false>}, sub{&addSubGrad<true>}, mul{&mulGrad},
    div{&divGrad}, pow{&powGrad}, maxMin{&maxMinGrad}, sum{&sumGrad}, clip{&clipGrad},
    where{&whereGrad};
} // namespace rules

} // namespace pipec::grad
