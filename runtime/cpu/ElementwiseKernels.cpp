//===- ElementwiseKernels.cpp - CPU kernels of the other element-wise ops ===//
//
// PRelu, Mean, Where, Clip, Cast and CastLike: element-wise, but with
// broadcast parameters, bounds or types that no single math struct holds.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/ElementwiseKernels.h"
#include "runtime/cpu/KernelTable.h"

#include "onnx/onnx_pb.h"

#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::cpu {

/// PRelu: slope broadcasts to the input's shape. Before opset 7 a 1-D slope
/// holds one value per channel (dimension 1).
Expected<Outputs> prelu(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &x = ctx.input(0);
  Tensor slope = ctx.input(1);
  if (ctx.opset < 7 && slope.rank() == 1 && x.rank() >= 2 && slope.dim(0) == x.dim(1) &&
      slope.dim(0) != 1) {
    Shape perChannel(x.rank() - 1, 1);
    perChannel[0] = slope.dim(0);
    slope = slope.reshaped(perChannel);
  }
  Expected<Shape> shape = broadcastShapes(x.shape(), slope.shape());
  if (!shape || *shape != x.shape()) {
    consumeError(shape.takeError());
    return ctx.fail("slope " + shapeString(slope.shape()) + " does not broadcast to " +
                    shapeString(x.shape()));
  }
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>)
      return ctx.unsupportedType(x, 0);
    else
      return Outputs{broadcastBinary<T, T, T>(x, slope, x.elemType(), *shape, [](T v, T s) {
        return static_cast<T>(v < 0 ? s * v : v);
      })};
  });
}

Expected<Outputs> mean(const OpContext &ctx) {
  return variadicOver(
      ctx, [](auto x, auto y) { return x + y; }, true);
}

Expected<Outputs> where(const OpContext &ctx) {
  const Tensor &cond = ctx.input(0), &x = ctx.input(1), &y = ctx.input(2);
  if (cond.elemType() != DType::Bool)
    return ctx.fail("condition must be bool, not " + elemTypeName(cond.elemType()));
  if (Error e = ctx.sameType(1, 2))
    return e;
  Expected<Shape> shape = broadcastShapes(cond.shape(), x.shape());
  if (shape)
    shape = broadcastShapes(*shape, y.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  Tensor out = Tensor::uninitialized(x.elemType(), *shape); // every element is written
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const bool *c = cond.data<bool>();
    const T *px = x.data<T>(), *py = y.data<T>();
    T *po = out.data<T>();
    // Each operand whole or a single element (attention's masks and its
    // NaN guard): a plain loop, on the rank's loop threads.
    auto step = [&](const Tensor &t) -> int64_t {
      return t.shape() == *shape ? 1 : t.numElements() == 1 ? 0 : -1;
    };
    int64_t sc = step(cond), sx = step(x), sy = step(y);
    if (sc >= 0 && sx >= 0 && sy >= 0) {
      // The steps as template arguments, so that the loop vectorises.
      auto loop = [&](auto stepC, auto stepX, auto stepY) {
        parallelFor(out.numElements(), parallelElements / 2, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            po[i] = c[i * stepC()] ? px[i * stepX()] : py[i * stepY()];
        });
      };
      using One = std::integral_constant<int64_t, 1>;
      using Zero = std::integral_constant<int64_t, 0>;
      if (sc == 1 && sx == 0 && sy == 1)
        loop(One(), Zero(), One()); // masked_fill: NaN guards, causal masks
      else if (sc == 1 && sx == 1 && sy == 0)
        loop(One(), One(), Zero());
      else if (sc == 1 && sx == 1 && sy == 1)
        loop(One(), One(), One());
      else
        loop([&] { return sc; }, [&] { return sx; }, [&] { return sy; });
      return;
    }
    forEachStrided<3>(*shape,
                      {broadcastStrides(cond.shape(), *shape), broadcastStrides(x.shape(), *shape),
                       broadcastStrides(y.shape(), *shape)},
                      [&](int64_t o, const std::array<int64_t, 3> &off) {
                        po[o] = c[off[0]] ? px[off[1]] : py[off[2]];
                      });
  });
  return Outputs{out};
}

/// Clip: bounds are inputs 1 and 2 (opset 11+) or attributes (before).
Expected<Outputs> clip(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  const Tensor *lo = ctx.optInput(1), *hi = ctx.optInput(2);
  for (const Tensor *bound : {lo, hi}) {
    if (!bound)
      continue;
    if (bound->numElements() != 1)
      return ctx.fail("min and max must be scalars, not " + bound->describe());
    if (bound->elemType() != x.elemType())
      return ctx.fail("min and max must have the input's element type " +
                      elemTypeName(x.elemType()));
  }
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      T low = std::numeric_limits<T>::lowest(), high = std::numeric_limits<T>::max();
      if (lo)
        low = lo->data<T>()[0];
      else if (ctx.attr("min"))
        low = static_cast<T>(ctx.attrFloat("min", 0));
      if (hi)
        high = hi->data<T>()[0];
      else if (ctx.attr("max"))
        high = static_cast<T>(ctx.attrFloat("max", 0));
      Tensor y(x.elemType(), x.shape());
      const T *in = x.data<T>();
      T *out = y.data<T>();
      // min(max(x, low), high): with low > high every element is high, as
      // ONNX (and numpy's clip) define it; NaN stays NaN.
      for (int64_t i = 0; i < x.numElements(); ++i) {
        T v = in[i] < low ? low : in[i];
        out[i] = high < v ? high : v;
      }
      return Outputs{y};
    }
  });
}

/// Converts every element of \p x to \p to.
Tensor castTo(const Tensor &x, DType to) {
  Tensor y(to, x.shape());
  visitStorage(x.elemType(), [&](auto fromTag) {
    using From = decltype(fromTag);
    visitStorage(to, [&](auto toTag) {
      using To = decltype(toTag);
      const From *in = x.data<From>();
      To *out = y.data<To>();
      for (int64_t i = 0; i < x.numElements(); ++i) {
        if constexpr (std::is_same_v<From, To>)
          out[i] = in[i];
        else if constexpr (isBool<To>)
          out[i] = in[i] != From(0);
        else if constexpr (isFloat<To> || (!isFloat<From> && !isBool<From>))
          out[i] = static_cast<To>(in[i]);
        else
          out[i] = saturatingCast<To>(static_cast<double>(in[i]));
      }
    });
  });
  y.roundToElemType();
  return y;
}

Expected<Outputs> cast(const OpContext &ctx) {
  const auto *to = ctx.attr("to");
  if (!to)
    return ctx.fail("missing attribute 'to'");
  Expected<DType> type = elemTypeFromOnnx(static_cast<int32_t>(to->i()));
  if (!type)
    return ctx.unsupported("cast to " + onnxTypeName(static_cast<int32_t>(to->i())));
  return Outputs{castTo(ctx.input(0), *type)};
}

Expected<Outputs> castLike(const OpContext &ctx) {
  return Outputs{castTo(ctx.input(0), ctx.input(1).elemType())};
}

} // namespace pipec::cpu
