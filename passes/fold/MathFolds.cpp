//===- MathFolds.cpp - Evaluators of element-wise math and reductions -----===//
//
// The ops whose FOLD is binary or unary, and ReduceMax/Min/Prod/Sum. An
// element is computed as a double when the op has a float operand and as an
// int64 otherwise, then stored in the output's type. Where that formula is
// the one of math/ElementMath.h on the same type, it is called
// from there; the comments say where folding computes otherwise.
//
//===----------------------------------------------------------------------===//
#include "passes/fold/FoldContext.h"

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include "llvm/Support/ErrorHandling.h"

#include <algorithm>
#include <cmath>

using namespace llvm;

namespace pipec::fold {
namespace {

namespace elem = kernels::elem;

/// Binary \p op of \p x and \p y where folding computes it as ElementMath.h
/// does on both doubles and integers; std::nullopt for the other ops.
template <typename T> std::optional<T> sharedBinary(OpId op, T x, T y) {
  switch (op) {
  case OpId::Add:
    return elem::Add::value(x, y);
  case OpId::Sub:
    return elem::Sub::value(x, y);
  case OpId::Mul:
    return elem::Mul::value(x, y);
  case OpId::Equal:
    return elem::Equal::value(x, y);
  case OpId::Less:
    return elem::Less::value(x, y);
  case OpId::Greater:
    return elem::Greater::value(x, y);
  case OpId::LessOrEqual:
    return elem::LessOrEqual::value(x, y);
  case OpId::GreaterOrEqual:
    return elem::GreaterOrEqual::value(x, y);
  case OpId::And:
    return elem::And::value(x, y);
  case OpId::Or:
    return elem::Or::value(x, y);
  default:
    return std::nullopt;
  }
}

/// Binary \p op of \p x and \p y, either of them a float; \p params holds
/// Mod's fmod.
double binaryFloat(OpId op, double x, double y, const kernels::ElemParams &params) {
  if (std::optional<double> r = sharedBinary(op, x, y))
    return *r;
  switch (op) {
  case OpId::Div:
    return elem::Div::value(x, y);
  // std::min and std::max give the first operand when either is NaN;
  // elem::Min and elem::Max give NaN. Folding keeps std::min and std::max.
  case OpId::Min:
    return std::min(x, y);
  case OpId::Max:
    return std::max(x, y);
  // elem::Pow squares and cubes by multiplying, which may round otherwise
  // than pow. Folding keeps pow.
  case OpId::Pow:
    return std::pow(x, y);
  case OpId::Mod:
    return elem::Mod::value(x, y, params);
  default:
    llvm_unreachable("not a binary op that folds");
  }
}

/// Binary \p op of integers \p x and \p y; std::nullopt for a division by 0.
std::optional<int64_t> binaryInt(OpId op, int64_t x, int64_t y, const kernels::ElemParams &params) {
  if (std::optional<int64_t> r = sharedBinary(op, x, y))
    return r;
  switch (op) {
  case OpId::Div:
    // elem::Div truncates as x / y does; INT64_MIN / -1, undefined for
    // x / y, wraps.
    if (y == 0)
      return std::nullopt;
    return elem::Div::value(x, y);
  case OpId::Mod:
    if (y == 0)
      return std::nullopt;
    return elem::Mod::value(x, y, params);
  case OpId::Min:
    return elem::Min::value(x, y);
  case OpId::Max:
    return elem::Max::value(x, y);
  // elem::Pow takes floats only.
  case OpId::Pow:
    return static_cast<int64_t>(std::pow(static_cast<double>(x), static_cast<double>(y)));
  default:
    llvm_unreachable("not a binary op that folds");
  }
}

Expected<ConstTensor> binaryElements(OpId op, const ConstTensor &a, const ConstTensor &b,
                                     const kernels::ElemParams &params) {
  auto shape = broadcastShapes(a.shape, b.shape);
  if (!shape)
    return shape.takeError();
  bool compare = op == OpId::Equal || op == OpId::Less || op == OpId::Greater ||
                 op == OpId::LessOrEqual || op == OpId::GreaterOrEqual;
  DType type = compare ? DType::Bool : a.type;
  ConstTensor out = makeLike(type, *shape);
  auto outStrides = stridesOf(*shape);
  auto aStrides = stridesOf(a.shape), bStrides = stridesOf(b.shape);
  bool useFloat = a.isFloat() || b.isFloat();
  int64_t n = out.numElements();
  for (int64_t i = 0; i < n; ++i) {
    int64_t ia = broadcastIndex(i, *shape, outStrides, a.shape, aStrides);
    int64_t ib = broadcastIndex(i, *shape, outStrides, b.shape, bStrides);
    if (useFloat) {
      double r = binaryFloat(op, a.floatAt(ia), b.floatAt(ib), params);
      if (out.isFloat())
        out.floats[i] = r;
      else
        out.ints[i] = static_cast<int64_t>(r);
      continue;
    }
    std::optional<int64_t> r = binaryInt(op, a.intAt(ia), b.intAt(ib), params);
    if (!r)
      return createStringError(inconvertibleErrorCode(), "integer division by zero");
    out.ints[i] = *r;
  }
  return out;
}

/// Unary \p op of \p x where folding computes it as ElementMath.h does on
/// both doubles and integers; std::nullopt for the other ops.
template <typename T> std::optional<T> sharedUnary(OpId op, T x) {
  kernels::ElemParams none;
  switch (op) {
  case OpId::Neg:
    return elem::Neg::value(x, none);
  case OpId::Not:
    return elem::Not::value(x, none);
  case OpId::Relu:
    return elem::Relu::value(x, none);
  default:
    return std::nullopt;
  }
}

/// Unary \p op of float \p x.
double unaryFloat(OpId op, double x) {
  if (std::optional<double> r = sharedUnary(op, x))
    return *r;
  kernels::ElemParams none;
  switch (op) {
  case OpId::Sqrt:
    return elem::Sqrt::value(x, none);
  case OpId::Reciprocal:
    return elem::Reciprocal::value(x, none);
  // elem::Abs keeps the sign of -0 and of a negative NaN; fabs clears it.
  // Folding keeps fabs.
  case OpId::Abs:
    return std::fabs(x);
  case OpId::Floor:
    return elem::Floor::value(x, none);
  case OpId::Ceil:
    return elem::Ceil::value(x, none);
  default:
    llvm_unreachable("not a unary op that folds");
  }
}

/// Unary \p op of integer \p x; the float-only ops leave it as it is.
int64_t unaryInt(OpId op, int64_t x) {
  if (std::optional<int64_t> r = sharedUnary(op, x))
    return *r;
  if (op == OpId::Abs)
    return elem::Abs::value(x, kernels::ElemParams());
  return x;
}

} // namespace

FoldResult binary(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<2>();
  if (!inputs)
    return inputs.takeError();
  auto [a, b] = *inputs;
  auto shape = broadcastShapes(a->shape, b->shape);
  if (!shape)
    return ctx.wrap(shape.takeError());
  if (product(*shape) > ctx.maxElements)
    return std::nullopt;
  // Mod's fmod is the one attribute of a binary op that folds.
  kernels::ElemParams params;
  if (ctx.def.id == OpId::Mod) {
    int64_t fmod = attrInt(ctx.node, "fmod", 0);
    if (fmod != 0 && fmod != 1)
      return ctx.fail("fmod must be 0 or 1");
    params.mode = static_cast<int>(fmod);
  }
  auto out = binaryElements(ctx.def.id, *a, *b, params);
  if (!out)
    return ctx.wrap(out.takeError());
  return ctx.done(std::move(*out));
}

FoldResult unary(const FoldContext &ctx) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  const ConstTensor &in = **a;
  ConstTensor out = makeLike(in.type, in.shape);
  int64_t n = in.numElements();
  for (int64_t i = 0; i < n; ++i) {
    if (in.isFloat())
      out.floats[i] = unaryFloat(ctx.def.id, in.floats[i]);
    else
      out.ints[i] = unaryInt(ctx.def.id, in.ints[i]);
  }
  return ctx.done(std::move(out));
}

FoldResult reduce(const FoldContext &ctx) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  const ConstTensor &data = **a;
  int64_t rank = static_cast<int64_t>(data.shape.size());
  auto axes = axesOf(ctx, 1);
  std::vector<bool> reduce(rank, !axes || axes->empty());
  if (axes)
    for (int64_t axis : *axes) {
      axis = normalizeAxis(axis, rank);
      if (axis < 0 || axis >= rank)
        return ctx.fail("axis out of range");
      reduce[axis] = true;
    }
  bool keep = attrInt(ctx.node, "keepdims", 1) != 0;
  std::vector<int64_t> keptShape(rank), shape;
  for (int64_t d = 0; d < rank; ++d) {
    keptShape[d] = reduce[d] ? 1 : data.shape[d];
    if (keep || !reduce[d])
      shape.push_back(keptShape[d]);
  }
  OpId id = ctx.def.id;
  ConstTensor out = makeLike(data.type, shape);
  std::vector<bool> seen(out.numElements(), false);
  auto inStrides = stridesOf(data.shape), keptStrides = stridesOf(keptShape);
  for (int64_t i = 0, n = data.numElements(); i < n; ++i) {
    int64_t o = 0;
    for (int64_t d = 0; d < rank; ++d)
      if (!reduce[d])
        o += ((i / inStrides[d]) % data.shape[d]) * keptStrides[d];
    double v = data.floatAt(i);
    double cur = data.isFloat() ? out.floats[o] : static_cast<double>(out.ints[o]);
    double r;
    if (!seen[o])
      r = v, seen[o] = true;
    else if (id == OpId::ReduceProd)
      r = cur * v;
    else if (id == OpId::ReduceSum)
      r = cur + v;
    else if (id == OpId::ReduceMin)
      r = std::min(cur, v);
    else
      r = std::max(cur, v);
    if (data.isFloat())
      out.floats[o] = r;
    else
      out.ints[o] = static_cast<int64_t>(r);
  }
  for (int64_t o = 0; o < out.numElements(); ++o)
    if (!seen[o] && id == OpId::ReduceProd) {
      if (out.isFloat())
        out.floats[o] = 1;
      else
        out.ints[o] = 1;
    }
  return ctx.done(std::move(out));
}

} // namespace pipec::fold
