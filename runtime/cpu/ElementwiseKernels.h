//===- ElementwiseKernels.h - CPU kernels of the element-wise ops -------===//
//
// The CPU kernel of every PIPEC_ELEMENTWISE row of ops/Ops.def is
// elementwise<Math, Arity> over its math struct (runtime/kernels/
// ElementMath.h): one loop per element type the math takes, numpy
// broadcasting for binary ops, half types computed in float. The same math
// runs in the fused and the device kernels, so the three agree bit for bit.
// Pow's kernel also takes an exponent of another type; the variadic ops
// (Sum, Max, Min) fold their math over any number of inputs.
//
// Before:  Ops.def   PIPEC_ELEMENTWISE(Erf, ..., elementwise, ...)
// After:   the table runs elementwise<elem::Erf, 1>
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_ELEMENTWISEKERNELS_H
#define PIPEC_RUNTIME_CPU_ELEMENTWISEKERNELS_H

#include "math/ElementMath.h"
#include "runtime/cpu/KernelSupport.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

namespace pipec::cpu {

using llvm::Error;
using llvm::Expected;
using llvm::formatv;

/// Add, Sub, Mul, Div: both inputs of one numeric type, broadcast.
template <typename Fn>
inline Expected<Outputs> arithmetic(const OpContext &ctx, Fn fn, bool isDivision = false) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &a = ctx.input(0);
  Tensor b = ctx.input(1);
  // Before opset 7, broadcast=1 with an axis aligned B's dimensions with A's
  // starting at axis rather than at the end.
  if (ctx.opset < 7 && ctx.attrInt("broadcast", 0) && ctx.attr("axis")) {
    int64_t axis = ctx.attrInt("axis", 0);
    if (axis < 0)
      axis += a.rank();
    if (axis < 0 || axis + b.rank() > a.rank())
      return ctx.fail(formatv("legacy broadcast axis {0} does not fit {1} and {2}",
                              ctx.attrInt("axis", 0), a.describe(), b.describe()));
    Shape aligned = b.shape();
    aligned.resize(a.rank() - axis, 1);
    b = b.reshaped(aligned);
  }
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      if constexpr (!isFloat<T>) {
        // Integer division by zero would trap; report it instead.
        if (isDivision && llvm::is_contained(b.values<T>(), T(0)))
          return ctx.fail("integer division by zero");
      }
      return Outputs{broadcastBinary<T, T, T>(a, b, a.elemType(), *shape,
                                              [&](T x, T y) { return static_cast<T>(fn(x, y)); })};
    }
  });
}

/// Equal, Less, Greater, ...: one element type, broadcast, bool result.
template <typename Fn>
Expected<Outputs> comparison(const OpContext &ctx, Fn fn, bool allowBool = false) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  if (a.elemType() == DType::Bool && !allowBool)
    return ctx.unsupportedType(a, 0);
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    return Outputs{broadcastBinary<T, T, bool>(a, b, DType::Bool, *shape,
                                               [&](T x, T y) -> bool { return fn(x, y); })};
  });
}

/// And, Or, Xor on bool inputs.
template <typename Fn> Expected<Outputs> logical(const OpContext &ctx, Fn fn) {
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  if (a.elemType() != DType::Bool)
    return ctx.fail("input 0 must be bool, not " + elemTypeName(a.elemType()));
  if (b.elemType() != DType::Bool)
    return ctx.fail("input 1 must be bool, not " + elemTypeName(b.elemType()));
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return Outputs{broadcastBinary<bool, bool, bool>(a, b, DType::Bool, *shape, fn)};
}

/// Checks that the first \p count inputs hold integers (the bitwise ops).
inline Error integerInputs(const OpContext &ctx, size_t count) {
  for (size_t i = 0; i < count; ++i)
    if (!isInteger(ctx.input(i).elemType()))
      return ctx.fail(formatv("input {0} must hold integers, not {1}", i,
                              elemTypeName(ctx.input(i).elemType())));
  return Error::success();
}

/// IsNaN, IsInf: y = fn(x), bool, for floating x.
template <typename Fn> Expected<Outputs> floatTest(const OpContext &ctx, Fn fn) {
  const Tensor &x = ctx.input(0);
  if (!isFloating(x.elemType()))
    return ctx.fail("input 0 must be a float, not " + elemTypeName(x.elemType()));
  Tensor y(DType::Bool, x.shape());
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>) {
      const T *in = x.data<T>();
      bool *out = y.data<bool>();
      for (int64_t i = 0, e = x.numElements(); i < e; ++i)
        out[i] = fn(in[i]);
    }
  });
  return Outputs{y};
}

/// Min, Max, Sum, Mean: any number of inputs of one type, all broadcast.
template <typename Fn>
Expected<Outputs> variadicOver(const OpContext &ctx, Fn fn, bool isMean = false) {
  Shape shape = ctx.input(0).shape();
  for (size_t i = 1; i < ctx.numInputs(); ++i) {
    if (Error e = ctx.sameType(0, i))
      return e;
    Expected<Shape> next = broadcastShapes(shape, ctx.input(i).shape());
    if (!next)
      return ctx.fail(toString(next.takeError()));
    shape = *next;
  }
  const Tensor &first = ctx.input(0);
  return visitStorage(first.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(first, 0);
    } else {
      Tensor acc = expandTo<T>(first, shape);
      T *out = acc.data<T>();
      for (size_t i = 1; i < ctx.numInputs(); ++i) {
        const Tensor &next = ctx.input(i);
        const T *in = next.data<T>();
        forEachStrided<1>(shape, {broadcastStrides(next.shape(), shape)},
                          [&](int64_t o, const std::array<int64_t, 1> &off) {
                            out[o] = static_cast<T>(fn(out[o], in[off[0]]));
                          });
      }
      if (isMean)
        for (int64_t i = 0; i < acc.numElements(); ++i)
          out[i] = static_cast<T>(out[i] / static_cast<T>(ctx.numInputs()));
      return Outputs{acc};
    }
  });
}

/// The attributes of the node's element math (its row's code).
inline Expected<kernels::ElemParams> paramsOf(const OpContext &ctx) {
  if (!ctx.def || !ctx.def->elem)
    return kernels::ElemParams();
  return ctx.elemParams(*ctx.def->elem);
}

/// The kernel of element-wise op M (a struct of ElementMath.h) of \p Arity
/// inputs.
template <typename M, int Arity> Expected<Outputs> elementwise(const OpContext &ctx) {
  using kernels::ElemTypes;
  Expected<kernels::ElemParams> params = paramsOf(ctx);
  if (!params)
    return params.takeError();
  const kernels::ElemParams p = *params;
  if constexpr (Arity == 1) {
    if constexpr (M::types == ElemTypes::Float) {
      return floatUnary(ctx, [&](auto x) { return M::value(x, p); });
    } else if constexpr (M::types == ElemTypes::Numeric) {
      return numericUnary(ctx, [&](auto x) { return M::value(x, p); });
    } else if constexpr (M::types == ElemTypes::Integer) {
      if (Error e = integerInputs(ctx, 1))
        return e;
      return numericUnary(ctx, [&](auto x) {
        if constexpr (isFloat<decltype(x)>)
          return x; // refused above
        else
          return M::value(x, p);
      });
    } else if constexpr (M::types == ElemTypes::FloatTest) {
      return floatTest(ctx, [&](auto x) -> bool { return M::value(x, p); });
    } else {
      static_assert(M::types == ElemTypes::Logical, "unary ops are float, numeric or logical");
      const Tensor &x = ctx.input(0);
      if (x.elemType() != DType::Bool)
        return ctx.fail("input 0 must be bool, not " + elemTypeName(x.elemType()));
      Tensor y(DType::Bool, x.shape());
      for (int64_t i = 0; i < x.numElements(); ++i)
        y.data<bool>()[i] = M::value(x.data<bool>()[i], p);
      return Outputs{y};
    }
  } else {
    auto fn = [](auto x, auto y) { return M::value(x, y); };
    // Integer and NumericHost math reads the node's attributes.
    auto withParams = [&p](auto x, auto y) {
      if constexpr (M::types == ElemTypes::Integer && isFloat<decltype(x)>)
        return x; // refused before
      else
        return M::value(x, y, p);
    };
    if constexpr (M::types == ElemTypes::Numeric) {
      return arithmetic(ctx, fn, M::divides);
    } else if constexpr (M::types == ElemTypes::NumericHost) {
      return arithmetic(ctx, withParams, M::divides);
    } else if constexpr (M::types == ElemTypes::Integer) {
      if (Error e = integerInputs(ctx, 2))
        return e;
      return arithmetic(ctx, withParams, M::divides);
    } else if constexpr (M::types == ElemTypes::Compare) {
      return comparison(ctx, fn);
    } else if constexpr (M::types == ElemTypes::CompareAny) {
      return comparison(ctx, fn, true);
    } else {
      static_assert(M::types == ElemTypes::Logical, "a binary op of another kind of types");
      return logical(ctx, [](bool x, bool y) -> bool { return M::value(x, y); });
    }
  }
}

/// Pow: the base's type is the result type; the exponent may differ.

/// Pow: the base's type is the result type; the exponent may differ.
template <typename M, int Arity> Expected<Outputs> power(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &y = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(x.shape(), y.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  if (x.elemType() == DType::Bool)
    return ctx.unsupportedType(x, 0);
  if (y.elemType() == DType::Bool)
    return ctx.unsupportedType(y, 1);
  return visitStorage(x.elemType(), [&](auto xTag) -> Expected<Outputs> {
    using TX = decltype(xTag);
    return visitStorage(y.elemType(), [&](auto yTag) -> Expected<Outputs> {
      using TY = decltype(yTag);
      return Outputs{broadcastBinary<TX, TY, TX>(x, y, x.elemType(), *shape, [](TX a, TY b) {
        // One type: the math every kernel shares; mixed: widened.
        if constexpr (std::is_same_v<TX, TY> && isFloat<TX>)
          return M::value(a, b);
        else if constexpr (isFloat<TX>) {
          if (b == TY(2))
            return static_cast<TX>(a * a);
          if (b == TY(3))
            return static_cast<TX>(a * a * a);
          return static_cast<TX>(std::pow(a, b));
        } else
          return saturatingCast<TX>(std::pow(double(a), double(b)));
      })};
    });
  });
}

/// PRelu: slope broadcasts to the input's shape. Before opset 7 a 1-D slope

/// The kernel of a variadic op folding M over its inputs (Sum: Add).
template <typename M> Expected<Outputs> variadic(const OpContext &ctx) {
  return variadicOver(ctx, [](auto x, auto y) { return M::value(x, y); });
}

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_ELEMENTWISEKERNELS_H
