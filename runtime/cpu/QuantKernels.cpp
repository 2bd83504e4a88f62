//===- QuantKernels.cpp - Linear quantization and integer products --------===//
//
// QuantizeLinear and DequantizeLinear (per tensor, per axis and blocked, to
// and from int8, uint8, int16, uint16 and int32), DynamicQuantizeLinear,
// and the integer products MatMulInteger, ConvInteger, QLinearMatMul and
// QLinearConv.
// Quantized types pipec's tensors do not hold (float8, int4, uint4, int2,
// float4) are refused. Rounding is to nearest, ties to even, as ONNX says;
// divisions and products are rounded in the precision ONNX names.
//
// Before:  QuantizeLinear(x = [0.5, 1.5, 300], y_scale = 1, zero point 0 of uint8)
// After:   [0, 2, 255]
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Window.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::cpu {

namespace {

/// The range of a quantized integer type, or nullopt for another type.
std::optional<std::pair<double, double>> quantRange(DType type) {
  switch (type) {
  case DType::U8:
    return std::pair<double, double>(0, 255);
  case DType::I8:
    return std::pair<double, double>(-128, 127);
  case DType::U16:
    return std::pair<double, double>(0, 65535);
  case DType::I16:
    return std::pair<double, double>(-32768, 32767);
  default:
    return std::nullopt;
  }
}

/// round-half-even(\p v) clamped to [lo, hi]; NaN gives lo.
double saturateRound(double v, std::pair<double, double> range) {
  double r = std::nearbyint(v);
  if (!(r >= range.first))
    return range.first;
  return std::min(r, range.second);
}

/// How a scale or zero point of QuantizeLinear or DequantizeLinear maps onto
/// the elements of x: one value, one per index of axis, or one per block of
/// block_size indices along axis (the other dimensions as x's).
struct QuantLayout {
  enum Kind { PerTensor, PerAxis, Blocked } kind = PerTensor;
  AxisSplit split{1, 1, 1};
  int64_t block = 0, blocks = 0;

  /// The parameter's index for element \p i of x.
  int64_t indexOf(int64_t i) const {
    if (kind == PerTensor)
      return 0;
    int64_t d = (i / split.inner) % split.size;
    if (kind == PerAxis)
      return d;
    int64_t o = i / (split.size * split.inner), in = i % split.inner;
    return (o * blocks + d / block) * split.inner + in;
  }
};

/// The layout of \p scale (input \p index) for \p x, checked against
/// axis and block_size (opset 21 on).
Expected<QuantLayout> layoutOf(const OpContext &ctx, const Tensor &x, const Tensor &scale) {
  QuantLayout layout;
  int64_t block = ctx.opset >= 21 ? ctx.attrInt("block_size", 0) : 0;
  if (block < 0)
    return ctx.fail(formatv("block_size must not be negative, got {0}", block));
  // One value is per tensor whatever its rank, as ONNX's reference reads it.
  if (scale.numElements() == 1)
    return layout;
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 1), x.rank());
  if (!axis)
    return axis.takeError();
  layout.split = splitAt(x.shape(), *axis);
  if (block == 0) {
    if (scale.rank() != 1 || scale.dim(0) != x.dim(*axis))
      return ctx.fail("scale " + scale.describe() + " is neither a scalar nor one value per " +
                      "index of axis " + Twine(*axis) + " of " + x.describe());
    layout.kind = QuantLayout::PerAxis;
    return layout;
  }
  layout.kind = QuantLayout::Blocked;
  layout.block = block;
  layout.blocks = (x.dim(*axis) + block - 1) / block;
  Shape expected = x.shape();
  expected[*axis] = layout.blocks;
  if (scale.shape() != expected)
    return ctx.fail("blocked scale " + scale.describe() + " must have shape " +
                    shapeString(expected) + " for " + x.describe() + " and block_size " +
                    Twine(block));
  return layout;
}

/// Checks the inputs QuantizeLinear and DequantizeLinear share: x (input
/// 0) int32 or of a type \p xAccepts, a float scale (input 1), and a zero
/// point (input 2), when given, of the scale's shape.
Error checkLinearInputs(const OpContext &ctx, function_ref<bool(DType)> xAccepts) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  if (!xAccepts(x.elemType()) && x.elemType() != DType::I32)
    return ctx.unsupportedType(x, 0);
  if (!isFloating(scale.elemType()))
    return ctx.unsupportedType(scale, 1);
  const Tensor *zero = ctx.optInput(2);
  if (zero && zero->shape() != ctx.input(1).shape())
    return ctx.fail("zero point " + zero->describe() + " must have the scale's shape " +
                    shapeString(ctx.input(1).shape()));
  return Error::success();
}

/// The element type ONNX type \p onnxType names for a quantized result, or
/// an error: unsupported for the types pipec does not hold.
Expected<DType> quantizedType(const OpContext &ctx, int64_t onnxType) {
  Expected<DType> type = elemTypeFromOnnx(static_cast<int32_t>(onnxType));
  if (!type) {
    consumeError(type.takeError());
    return ctx.unsupported("quantized type " + onnxTypeName(static_cast<int32_t>(onnxType)));
  }
  if (!quantRange(*type))
    return ctx.fail("output type " + elemTypeName(*type) + " is not a quantized type");
  return *type;
}

/// The float type that attribute \p attr (opset 23 on) names, or \p otherwise
/// where it is absent or 0.
Expected<DType> floatTypeAttr(const OpContext &ctx, StringRef attr, DType otherwise) {
  int64_t given = ctx.opset >= 23 ? ctx.attrInt(attr, 0) : 0;
  if (given == 0)
    return otherwise;
  Expected<DType> type = elemTypeFromOnnx(static_cast<int32_t>(given));
  if (!type || !isFloating(*type)) {
    consumeError(type.takeError());
    return ctx.fail(attr + " " + onnxTypeName(static_cast<int32_t>(given)) +
                    " is not a float type");
  }
  return *type;
}

/// A tensor of \p type and x's shape whose element i is f(i, p), p being the
/// index of its scale (and zero point) in scale's layout for \p x.
template <typename F>
Expected<Outputs> perScale(const OpContext &ctx, const Tensor &x, const Tensor &scale, DType type,
                           F f) {
  Expected<QuantLayout> layout = layoutOf(ctx, x, scale);
  if (!layout)
    return layout.takeError();
  Tensor y(type, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    y.setDouble(i, f(i, layout->indexOf(i)));
  return Outputs{y};
}

} // namespace

/// QuantizeLinear: y = saturate(round(x / y_scale) + y_zero_point). The
/// division is rounded in y_scale's type, or in 'precision' (opset 23 on).
/// y has the zero point's type, else output_dtype (opset 21 on), else uint8.
Expected<Outputs> quantizeLinear(const OpContext &ctx) {
  if (Error e = checkLinearInputs(ctx, isFloating))
    return e;
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  const Tensor *zero = ctx.optInput(2);
  int64_t outputType = ctx.opset >= 21 ? ctx.attrInt("output_dtype", 0) : 0;
  DType type = DType::U8;
  if (zero) {
    type = zero->elemType();
    if (outputType != 0 && outputType != static_cast<int64_t>(type))
      return ctx.fail("output_dtype " + onnxTypeName(static_cast<int32_t>(outputType)) +
                      " differs from the zero point's type " + elemTypeName(type));
  } else if (outputType != 0) {
    Expected<DType> given = quantizedType(ctx, outputType);
    if (!given)
      return given.takeError();
    type = *given;
  }
  std::optional<std::pair<double, double>> range = quantRange(type);
  if (!range)
    return ctx.fail("the zero point's type " + elemTypeName(type) + " is not a quantized type");
  Expected<DType> precision = floatTypeAttr(ctx, "precision", scale.elemType());
  if (!precision)
    return precision.takeError();
  DType p = *precision;
  return perScale(ctx, x, scale, type, [&](int64_t i, int64_t at) {
    double quotient = roundAs(p, roundAs(p, x.getDouble(i)) / roundAs(p, scale.getDouble(at)));
    // Rounded before the zero point is added: 1.5 + 32767 must give 32769.
    double rounded = std::nearbyint(quotient) + (zero ? zero->getDouble(at) : 0.0);
    return saturateRound(rounded, *range);
  });
}

/// DequantizeLinear: y = (x - x_zero_point) * x_scale, the product rounded
/// in y's type: output_dtype (opset 23 on), else x_scale's type.
Expected<Outputs> dequantizeLinear(const OpContext &ctx) {
  if (Error e = checkLinearInputs(ctx, [](DType t) { return quantRange(t).has_value(); }))
    return e;
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  const Tensor *zero = ctx.optInput(2);
  if (zero && zero->elemType() != x.elemType())
    return ctx.fail("the zero point must have x's element type " + elemTypeName(x.elemType()));
  Expected<DType> type = floatTypeAttr(ctx, "output_dtype", scale.elemType());
  if (!type)
    return type.takeError();
  return perScale(ctx, x, scale, *type, [&](int64_t i, int64_t at) {
    double shifted = x.getDouble(i) - (zero ? zero->getDouble(at) : 0.0);
    return roundAs(*type, shifted * scale.getDouble(at));
  });
}

/// DynamicQuantizeLinear: uint8 with the scale and zero point that map
/// [min(0, min x), max(0, max x)] onto [0, 255], in float32 as ONNX's
/// reference computes them. Outputs y, y_scale and y_zero_point.
Expected<Outputs> dynamicQuantizeLinear(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.elemType() != DType::F32)
    return ctx.unsupportedType(x, 0);
  const float *in = x.data<float>();
  float low = 0, high = 0;
  for (int64_t i = 0; i < x.numElements(); ++i) {
    low = std::min(low, in[i]);
    high = std::max(high, in[i]);
  }
  float scale = (high == low ? 1.0f : high - low) / 255.0f;
  std::pair<double, double> range(0, 255);
  float zero = std::nearbyint(std::clamp(0.0f - low / scale, 0.0f, 255.0f));
  if (!(zero >= 0)) // -inf and inf in x make the scale infinite and this NaN
    zero = 0;
  Tensor y(DType::U8, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    y.data<uint8_t>()[i] =
        static_cast<uint8_t>(saturateRound(std::nearbyint(in[i] / scale) + zero, range));
  return Outputs{y, Tensor::scalar(scale), Tensor::scalar(static_cast<uint8_t>(zero))};
}

namespace {

/// How a zero point of an integer product lines up with its operand.
enum class ZeroPoint {
  Scalar,     ///< one value (ConvInteger's x)
  Broadcast,  ///< numpy broadcasting ([N] or [..., 1, N]: per column of B)
  PerRow,     ///< [M] means [M, 1] (per row of A); else broadcast
  PerChannel, ///< [M] means [M, 1, ...] (per output channel of W); else scalar
};

/// \p x (int8 or uint8) minus \p zero, laid out as \p layout says, as
/// int32.
Expected<Tensor> shifted(const OpContext &ctx, const Tensor &x, const Tensor *zero, size_t index,
                         ZeroPoint layout) {
  if (x.elemType() != DType::I8 && x.elemType() != DType::U8)
    return ctx.unsupportedType(x, index);
  Tensor out(DType::I32, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    out.data<int32_t>()[i] = static_cast<int32_t>(x.getInt64(i));
  if (!zero)
    return out;
  if (zero->elemType() != x.elemType())
    return ctx.fail(formatv("the zero point of input {0} must have its element type {1}", index,
                            elemTypeName(x.elemType())));
  Tensor z = *zero;
  bool vector = z.rank() == 1 && z.numElements() > 1;
  if ((layout == ZeroPoint::Scalar || (layout == ZeroPoint::PerChannel && !vector)) &&
      z.numElements() != 1)
    return ctx.fail(formatv("the zero point of input {0} must be a scalar{1}, got {2}", index,
                            layout == ZeroPoint::PerChannel ? " or one per output channel" : "",
                            zero->describe()));
  if (vector && (layout == ZeroPoint::PerRow || layout == ZeroPoint::PerChannel)) {
    Shape shape(layout == ZeroPoint::PerRow ? 2 : std::max<int64_t>(x.rank(), 1), 1);
    shape[0] = z.numElements();
    z = z.reshaped(shape);
  }
  Expected<Shape> shape = broadcastShapes(z.shape(), x.shape());
  if (!shape || *shape != x.shape()) {
    consumeError(shape.takeError());
    return ctx.fail(formatv("zero point {0} does not broadcast to input {1} {2}", zero->describe(),
                            index, x.describe()));
  }
  Tensor expanded = expandAny(z, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    out.data<int32_t>()[i] -= static_cast<int32_t>(expanded.getInt64(i));
  return out;
}

/// The product of int32 \p a and \p b with MatMul's broadcasting.
Expected<Tensor> integerProduct(const OpContext &ctx, const Tensor &a, const Tensor &b) {
  const Tensor *operands[] = {&a, &b};
  OpContext inner(ctx.node, ctx.opset, operands, ctx.def);
  Expected<Outputs> product = matMul(inner);
  if (!product)
    return product.takeError();
  return std::move((*product)[0]);
}

/// The operands of MatMulInteger and ConvInteger (inputs 0 and 1) minus
/// their optional zero points (inputs 2 and 3), laid out as \p aLayout and
/// \p bLayout say, as int32.
Expected<std::pair<Tensor, Tensor>> shiftedOperands(const OpContext &ctx, ZeroPoint aLayout,
                                                    ZeroPoint bLayout) {
  Expected<Tensor> a = shifted(ctx, ctx.input(0), ctx.optInput(2), 0, aLayout);
  if (!a)
    return a.takeError();
  Expected<Tensor> b = shifted(ctx, ctx.input(1), ctx.optInput(3), 1, bLayout);
  if (!b)
    return b.takeError();
  return std::make_pair(std::move(*a), std::move(*b));
}

/// Checks the operands QLinearMatMul and QLinearConv share: the scales
/// (inputs 1, 4 and 6) of one floating type, and y_zero_point (input 7) of
/// a quantized type other than the 16-bit ones. Returns the range of
/// y_zero_point's type.
Expected<std::pair<double, double>> requantRange(const OpContext &ctx) {
  for (size_t i : {1, 4, 6})
    if (!isFloating(ctx.input(i).elemType()))
      return ctx.unsupportedType(ctx.input(i), i);
  if (Error e = ctx.sameType(1, 4))
    return e;
  if (Error e = ctx.sameType(1, 6))
    return e;
  const Tensor &yZero = ctx.input(7);
  std::optional<std::pair<double, double>> range = quantRange(yZero.elemType());
  if (!range || yZero.elemType() == DType::I16 || yZero.elemType() == DType::U16)
    return ctx.unsupportedType(yZero, 7);
  return *range;
}

} // namespace

/// MatMulInteger: (A - a_zero_point) x (B - b_zero_point) in int32.
Expected<Outputs> matMulInteger(const OpContext &ctx) {
  Expected<std::pair<Tensor, Tensor>> operands =
      shiftedOperands(ctx, ZeroPoint::PerRow, ZeroPoint::Broadcast);
  if (!operands)
    return operands.takeError();
  Expected<Tensor> y = integerProduct(ctx, operands->first, operands->second);
  if (!y)
    return y.takeError();
  return Outputs{*y};
}

/// ConvInteger: Conv of (x - x_zero_point) by (w - w_zero_point) in int32;
/// padding reads as the zero point (0 after the shift).
Expected<Outputs> convInteger(const OpContext &ctx) {
  Expected<std::pair<Tensor, Tensor>> operands =
      shiftedOperands(ctx, ZeroPoint::Scalar, ZeroPoint::PerChannel);
  if (!operands)
    return operands.takeError();
  return convolve(ctx, operands->first, operands->second, nullptr, true);
}

/// QLinearMatMul: the int32 product of the shifted operands, requantized by
/// a_scale * b_scale / y_scale (rounded in the scales' type) plus
/// y_zero_point. Scales and zero points are per tensor, or per row of a and
/// per column of b.
Expected<Outputs> qLinearMatMul(const OpContext &ctx) {
  const Tensor &aScale = ctx.input(1), &bScale = ctx.input(4), &yScale = ctx.input(6);
  const Tensor &yZero = ctx.input(7);
  Expected<std::pair<double, double>> range = requantRange(ctx);
  if (!range)
    return range.takeError();
  Expected<Tensor> a = shifted(ctx, ctx.input(0), &ctx.input(2), 0, ZeroPoint::PerRow);
  if (!a)
    return a.takeError();
  Expected<Tensor> b = shifted(ctx, ctx.input(3), &ctx.input(5), 3, ZeroPoint::Broadcast);
  if (!b)
    return b.takeError();
  Expected<Tensor> product = integerProduct(ctx, *a, *b);
  if (!product)
    return product.takeError();
  const Shape &shape = product->shape();
  // Per-row scales of a ([M] or [..., M, 1]) and the rest broadcast to y.
  auto spread = [&](const Tensor &t, bool perRow) -> Expected<Tensor> {
    Tensor v = t;
    if (perRow && v.rank() == 1 && v.numElements() > 1)
      v = v.reshaped({v.numElements(), 1});
    Expected<Shape> joint = broadcastShapes(v.shape(), shape);
    if (!joint || *joint != shape) {
      consumeError(joint.takeError());
      return ctx.fail(t.describe() + " does not broadcast to the product " + shapeString(shape));
    }
    return expandAny(v, shape);
  };
  Expected<Tensor> as = spread(aScale, true), bs = spread(bScale, false);
  Expected<Tensor> ys = spread(yScale, false), yz = spread(yZero, false);
  if (!as || !bs || !ys || !yz) {
    Error err = joinErrors(as.takeError(), bs.takeError());
    err = joinErrors(std::move(err), ys.takeError());
    return joinErrors(std::move(err), yz.takeError());
  }
  DType scaleType = aScale.elemType();
  Tensor y(yZero.elemType(), shape);
  for (int64_t i = 0; i < y.numElements(); ++i) {
    double factor = roundAs(scaleType, as->getDouble(i) * bs->getDouble(i));
    factor = roundAs(scaleType, factor / ys->getDouble(i));
    double v = static_cast<double>(product->data<int32_t>()[i]) * factor + yz->getDouble(i);
    y.setDouble(i, saturateRound(v, *range));
  }
  return Outputs{y};
}

/// QLinearConv: the int32 Conv of the shifted x and w plus B, requantized
/// by x_scale * w_scale / y_scale (rounded in the scales' type; w_scale per
/// tensor or per output channel) plus y_zero_point.
Expected<Outputs> qLinearConv(const OpContext &ctx) {
  const Tensor &xScale = ctx.input(1), &wScale = ctx.input(4), &yScale = ctx.input(6);
  const Tensor &yZero = ctx.input(7), &weight = ctx.input(3);
  Expected<std::pair<double, double>> range = requantRange(ctx);
  if (!range)
    return range.takeError();
  for (size_t i : {1, 6, 7})
    if (ctx.input(i).numElements() != 1)
      return ctx.fail(formatv("input {0} must be a scalar, got {1}", i, ctx.input(i).describe()));
  if (weight.rank() < 1)
    return ctx.fail("w must have rank >= 3, got " + weight.describe());
  int64_t maps = weight.dim(0);
  bool perChannel = wScale.numElements() != 1;
  if (perChannel && (wScale.rank() != 1 || wScale.dim(0) != maps))
    return ctx.fail(formatv("w_scale must be a scalar or one value per output channel ({0}), got "
                            "{1}",
                            maps, wScale.describe()));
  const Tensor *bias = ctx.optInput(8);
  if (bias && bias->elemType() != DType::I32)
    return ctx.fail("B must hold int32, not " + elemTypeName(bias->elemType()));
  Expected<Tensor> x = shifted(ctx, ctx.input(0), &ctx.input(2), 0, ZeroPoint::Scalar);
  if (!x)
    return x.takeError();
  Expected<Tensor> w = shifted(ctx, weight, &ctx.input(5), 3, ZeroPoint::PerChannel);
  if (!w)
    return w.takeError();
  Expected<Outputs> conv = convolve(ctx, *x, *w, bias, true);
  if (!conv)
    return conv.takeError();
  const Tensor &sum = (*conv)[0];
  DType scaleType = xScale.elemType();
  int64_t plane = sum.rank() > 2 ? product(ArrayRef<int64_t>(sum.shape()).drop_front(2)) : 1;
  std::vector<double> factors(perChannel ? maps : 1);
  for (size_t m = 0; m < factors.size(); ++m) {
    double f = roundAs(scaleType, xScale.getDouble(0) * wScale.getDouble(m));
    factors[m] = roundAs(scaleType, f / yScale.getDouble(0));
  }
  double zero = yZero.getDouble(0);
  Tensor y(yZero.elemType(), sum.shape());
  for (int64_t i = 0; i < y.numElements(); ++i) {
    double factor = factors[perChannel ? (i / plane) % maps : 0];
    double v = static_cast<double>(sum.data<int32_t>()[i]) * factor + zero;
    y.setDouble(i, saturateRound(v, *range));
  }
  return Outputs{y};
}

} // namespace pipec::cpu
