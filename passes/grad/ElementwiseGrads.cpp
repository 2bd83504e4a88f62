//===- ElementwiseGrads.cpp - Gradients of element-wise ops --------------===//
//
// Element-wise arithmetic with numpy broadcasting: each input's gradient is
// computed at the output's shape and SumTo undoes the broadcast.
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

using namespace llvm;

namespace pipec::grad {
namespace {

Error unaryGrad(GradContext &ctx) {
  const std::string &t = ctx.op().opType;
  return ctx.forEachWanted([&](size_t) -> Error {
    if (t == "Neg") {
      ctx.contribute(0, ctx.unary("Neg", ctx.dy()));
    } else if (t == "Relu" || t == "Erf") {
      ctx.contribute(0, ctx.binary(t + "Grad", ctx.dy(), ctx.in(0), "pipec"));
    } else if (t == "Gelu") {
      onnx::NodeProto &g = ctx.emit("GeluGrad", {ctx.dy(), ctx.in(0)}, "pipec");
      GradContext::setString(g, "approximate", attrString(ctx.node(), "approximate", "none"));
      ctx.contribute(0, GradContext::out(g));
    } else if (t == "Abs") {
      ctx.contribute(0, ctx.binary("Mul", ctx.dy(), ctx.unary("Sign", ctx.in(0))));
    } else if (t == "Tanh" || t == "Sigmoid") {
      ctx.contribute(0, ctx.binary(t + "Grad", ctx.dy(), ctx.y(), "pipec"));
    } else if (t == "Reciprocal") {
      // d (1 / x) = -1 / x^2 = -y^2.
      ctx.contribute(
          0, ctx.unary("Neg", ctx.binary("Mul", ctx.dy(), ctx.binary("Mul", ctx.y(), ctx.y()))));
    } else if (t == "Exp") {
      ctx.contribute(0, ctx.binary("Mul", ctx.dy(), ctx.y()));
    } else if (t == "Log") {
      ctx.contribute(0, ctx.binary("Div", ctx.dy(), ctx.in(0)));
    } else if (t == "Sqrt") {
      // d sqrt(x) = 0.5 / sqrt(x).
      ctx.contribute(0, ctx.binary("Div",
                                   ctx.binary("Mul", ctx.dy(), ctx.constScalar(0.5, ctx.type())),
                                   ctx.y()));
    } else {
      return ctx.error("no gradient rule");
    }
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
const GradRule unary = {&unaryGrad};
const GradRule add = {&addSubGrad<false>};
const GradRule sub = {&addSubGrad<true>};
const GradRule mul = {&mulGrad};
const GradRule div = {&divGrad};
const GradRule pow = {&powGrad};
const GradRule maxMin = {&maxMinGrad};
const GradRule sum = {&sumGrad};
const GradRule clip = {&clipGrad};
const GradRule where = {&whereGrad};
} // namespace rules

} // namespace pipec::grad
