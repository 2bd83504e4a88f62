//===- ResizeKernels.cpp - Resize and Upsample on the CPU -------------------===//
//
// Resize (opsets 10 to 19) and the deprecated Upsample (7, 9). One reading
// of the node gives, per axis, the output length, the scale and the crop;
// the interpolation then runs one axis at a time, as ONNX's reference does:
// each output coordinate maps back to a fractional input coordinate by the
// coordinate_transformation_mode and takes a weighted sum of its taps
// (edge-clamped; linear two, cubic four, antialiased ones as wide as the
// downscaling demands). Nearest mode is a gather, exact for every type;
// linear and cubic compute in double and round integers to nearest even,
// saturating.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <numeric>

using namespace llvm;

namespace pipec::cpu {
namespace {

enum class Interp { Nearest, Linear, Cubic };
enum class Coord {
  HalfPixel,
  HalfPixelSymmetric,
  PytorchHalfPixel,
  AlignCorners,
  Asymmetric,
  TfCropAndResize,
  TfHalfPixelForNn
};
/// How nearest mode rounds; Simple is Resize-10's and Upsample's (floor
/// when upscaling, ceil when downscaling).
enum class Rounding { RoundPreferFloor, RoundPreferCeil, Floor, Ceil, Simple };

/// Everything the interpolation needs, per axis of X.
struct ResizeSpec {
  Interp interp = Interp::Nearest;
  Coord coord = Coord::Asymmetric;
  Rounding rounding = Rounding::Simple;
  double cubicA = -0.75, extrapolation = 0;
  bool excludeOutside = false, antialias = false;
  Shape outShape;
  /// The scale of each axis, and the resized length it implies (scale times
  /// the input length: fractional when the scale is).
  std::vector<double> scales, lengths;
  /// The crop of tf_crop_and_resize, as fractions of each axis.
  std::vector<double> roiStart, roiEnd;
};

/// Output sizes beyond this are refused rather than allocated.
constexpr double maxResizedLength = double(int64_t(1) << 40);

Expected<Interp> interpOf(const OpContext &ctx, bool cubicAllowed) {
  std::string mode = ctx.attrString("mode", "nearest");
  if (mode == "nearest")
    return Interp::Nearest;
  if (mode == "linear")
    return Interp::Linear;
  if (mode == "cubic" && cubicAllowed)
    return Interp::Cubic;
  return ctx.fail("unknown mode '" + mode + "'");
}

Expected<Coord> coordOf(const OpContext &ctx) {
  std::string name = ctx.attrString("coordinate_transformation_mode", "half_pixel");
  std::pair<StringRef, Coord> known[] = {{"half_pixel", Coord::HalfPixel},
                                         {"pytorch_half_pixel", Coord::PytorchHalfPixel},
                                         {"align_corners", Coord::AlignCorners},
                                         {"asymmetric", Coord::Asymmetric},
                                         {"tf_crop_and_resize", Coord::TfCropAndResize}};
  for (auto &[key, coord] : known)
    if (name == key)
      return coord;
  if (name == "tf_half_pixel_for_nn" && ctx.opset < 13)
    return Coord::TfHalfPixelForNn;
  if (name == "half_pixel_symmetric" && ctx.opset >= 19)
    return Coord::HalfPixelSymmetric;
  return ctx.fail("unknown coordinate_transformation_mode '" + name + "'");
}

Expected<Rounding> roundingOf(const OpContext &ctx) {
  std::string name = ctx.attrString("nearest_mode", "round_prefer_floor");
  if (name == "round_prefer_floor")
    return Rounding::RoundPreferFloor;
  if (name == "round_prefer_ceil")
    return Rounding::RoundPreferCeil;
  if (name == "floor")
    return Rounding::Floor;
  if (name == "ceil")
    return Rounding::Ceil;
  return ctx.fail("unknown nearest_mode '" + name + "'");
}

/// Fills the output shape and lengths of \p spec from one scale per axis.
Error applyScales(const OpContext &ctx, ArrayRef<int64_t> inShape, ResizeSpec &spec) {
  for (size_t d = 0; d < inShape.size(); ++d) {
    double s = spec.scales[d];
    if (!std::isfinite(s) || s <= 0)
      return ctx.fail(formatv("scale {0} of axis {1} is not positive", s, d));
    double length = s * double(inShape[d]);
    if (length > maxResizedLength)
      return ctx.unsupported(formatv("an output length of {0} on axis {1}", length, d));
    spec.lengths.push_back(length);
    spec.outShape.push_back(static_cast<int64_t>(std::floor(length)));
  }
  return Error::success();
}

/// Fills \p spec from target sizes, under keep_aspect_ratio_policy.
Error applySizes(const OpContext &ctx, ArrayRef<int64_t> inShape, ArrayRef<int64_t> axes,
                 ArrayRef<int64_t> sizes, ResizeSpec &spec) {
  int64_t rank = static_cast<int64_t>(inShape.size());
  Shape target(inShape.begin(), inShape.end());
  for (size_t i = 0; i < axes.size(); ++i) {
    if (sizes[i] < 0)
      return ctx.fail("negative size " + Twine(sizes[i]));
    if (inShape[axes[i]] == 0 && sizes[i] != 0)
      return ctx.fail(formatv("axis {0} is empty and cannot be resized to {1}", axes[i], sizes[i]));
    target[axes[i]] = sizes[i];
  }
  auto ratio = [&](int64_t d) {
    return inShape[d] == 0 ? 1.0 : double(target[d]) / double(inShape[d]);
  };
  std::string policy =
      ctx.opset >= 18 ? ctx.attrString("keep_aspect_ratio_policy", "stretch") : "stretch";
  if (policy != "stretch" && policy != "not_larger" && policy != "not_smaller")
    return ctx.fail("unknown keep_aspect_ratio_policy '" + policy + "'");
  spec.scales.assign(rank, 1.0);
  for (int64_t d = 0; d < rank; ++d)
    spec.scales[d] = ratio(d);
  if (policy != "stretch" && !axes.empty()) {
    double scale = ratio(axes[0]);
    for (int64_t d : axes)
      scale = policy == "not_larger" ? std::min(scale, ratio(d)) : std::max(scale, ratio(d));
    for (int64_t d : axes) {
      spec.scales[d] = scale;
      target[d] = static_cast<int64_t>(scale * double(inShape[d]) + 0.5);
    }
  }
  spec.outShape = target;
  for (int64_t d = 0; d < rank; ++d)
    spec.lengths.push_back(policy == "stretch" ? double(target[d])
                                               : spec.scales[d] * double(inShape[d]));
  return Error::success();
}

/// The axes attribute of Resize-18 (all axes before), made non-negative.
Expected<Shape> resizeAxes(const OpContext &ctx, int64_t rank) {
  std::optional<Shape> given = ctx.opset >= 18 ? ctx.attrInts("axes") : std::nullopt;
  if (!given) {
    Shape all(rank);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }
  Shape axes;
  for (int64_t a : *given) {
    Expected<int64_t> axis = ctx.normalizeAxis(a, rank, "axes");
    if (!axis)
      return axis.takeError();
    if (is_contained(axes, *axis))
      return ctx.fail("axis " + Twine(a) + " repeats in axes");
    axes.push_back(*axis);
  }
  return axes;
}

/// A 1-D input that is present and not empty, or nullptr.
const Tensor *nonEmptyInput(const OpContext &ctx, size_t i) {
  const Tensor *t = ctx.optInput(i);
  return t && t->numElements() > 0 ? t : nullptr;
}

/// Reads roi, scales and sizes of Resize-11 and later.
Error readResizeInputs(const OpContext &ctx, ResizeSpec &spec) {
  const Tensor &x = ctx.input(0);
  int64_t rank = x.rank();
  Expected<Shape> axes = resizeAxes(ctx, rank);
  if (!axes)
    return axes.takeError();
  int64_t count = static_cast<int64_t>(axes->size());
  const Tensor *scales = nonEmptyInput(ctx, 2), *sizes = nonEmptyInput(ctx, 3);
  if (!scales == !sizes)
    return ctx.fail("exactly one of scales and sizes must be given");
  const Tensor *given = scales ? scales : sizes;
  if (given->rank() != 1 || given->numElements() != count)
    return ctx.fail(formatv("{0} {1} must have one element per axis ({2})",
                            scales ? "scales" : "sizes", given->describe(), count));
  if (scales) {
    if (!isFloating(scales->elemType()))
      return ctx.fail("scales must be floating, got " + scales->describe());
    spec.scales.assign(rank, 1.0);
    for (int64_t i = 0; i < count; ++i)
      spec.scales[(*axes)[i]] = scales->getDouble(i);
    if (Error err = applyScales(ctx, x.shape(), spec))
      return err;
  } else {
    if (sizes->elemType() != DType::I64)
      return ctx.fail("sizes must be int64, got " + sizes->describe());
    if (Error err = applySizes(ctx, x.shape(), *axes, sizes->toInt64Vector(), spec))
      return err;
  }
  spec.roiStart.assign(rank, 0.0);
  spec.roiEnd.assign(rank, 1.0);
  if (const Tensor *roi = nonEmptyInput(ctx, 1); roi && spec.coord == Coord::TfCropAndResize) {
    if (!isFloating(roi->elemType()) || roi->rank() != 1 || roi->numElements() != 2 * count)
      return ctx.fail(
          formatv("roi {0} must hold a start and an end per axis ({1})", roi->describe(), count));
    for (int64_t i = 0; i < count; ++i) {
      spec.roiStart[(*axes)[i]] = roi->getDouble(i);
      spec.roiEnd[(*axes)[i]] = roi->getDouble(count + i);
    }
    for (int64_t d = 0; d < rank; ++d)
      if (!std::isfinite(spec.roiStart[d]) || !std::isfinite(spec.roiEnd[d]))
        return ctx.fail("roi must be finite");
  }
  return Error::success();
}

/// Resize: opset 10 takes (X, scales), asymmetric coordinates and simple
/// rounding; 11 and later (X, roi, scales, sizes) and the attributes.
Expected<ResizeSpec> readResize(const OpContext &ctx) {
  ResizeSpec spec;
  Expected<Interp> interp = interpOf(ctx, ctx.opset >= 11);
  if (!interp)
    return interp.takeError();
  spec.interp = *interp;
  const Tensor &x = ctx.input(0);
  if (ctx.opset < 11) {
    const Tensor *scales = ctx.optInput(1);
    if (!scales || !isFloating(scales->elemType()) || scales->rank() != 1 ||
        scales->numElements() != x.rank())
      return ctx.fail("scales must be a float tensor of one element per axis of " + x.describe());
    for (int64_t i = 0; i < x.rank(); ++i)
      spec.scales.push_back(scales->getDouble(i));
    if (Error err = applyScales(ctx, x.shape(), spec))
      return err;
    spec.roiStart.assign(x.rank(), 0.0);
    spec.roiEnd.assign(x.rank(), 1.0);
    return spec;
  }
  Expected<Coord> coord = coordOf(ctx);
  if (!coord)
    return coord.takeError();
  Expected<Rounding> rounding = roundingOf(ctx);
  if (!rounding)
    return rounding.takeError();
  spec.coord = *coord;
  spec.rounding = *rounding;
  spec.cubicA = ctx.attrFloat("cubic_coeff_a", -0.75f);
  spec.excludeOutside = ctx.attrInt("exclude_outside", 0) != 0;
  spec.extrapolation = ctx.attrFloat("extrapolation_value", 0.0f);
  spec.antialias = ctx.opset >= 18 && ctx.attrInt("antialias", 0) != 0;
  if (Error err = readResizeInputs(ctx, spec))
    return err;
  return spec;
}

/// Upsample: 7 reads its scales from an attribute, 9 from input 1; both
/// use asymmetric coordinates and simple rounding.
Expected<ResizeSpec> readUpsample(const OpContext &ctx) {
  ResizeSpec spec;
  Expected<Interp> interp = interpOf(ctx, false);
  if (!interp)
    return interp.takeError();
  spec.interp = *interp;
  const Tensor &x = ctx.input(0);
  if (ctx.opset < 9) {
    const onnx::AttributeProto *attr = ctx.attr("scales");
    if (!attr)
      return ctx.fail("missing attribute 'scales'");
    spec.scales.assign(attr->floats().begin(), attr->floats().end());
  } else if (const Tensor *scales = ctx.optInput(1); scales && isFloating(scales->elemType())) {
    for (int64_t i = 0; i < scales->numElements(); ++i)
      spec.scales.push_back(scales->getDouble(i));
  } else {
    return ctx.fail("Upsample-9 takes its scales as a float tensor, input 1");
  }
  if (static_cast<int64_t>(spec.scales.size()) != x.rank())
    return ctx.fail(formatv("{0} scales for {1}", spec.scales.size(), x.describe()));
  for (double s : spec.scales)
    if (!(s >= 1))
      return ctx.fail(formatv("Upsample's scales must be at least 1, got {0}", s));
  if (Error err = applyScales(ctx, x.shape(), spec))
    return err;
  spec.roiStart.assign(x.rank(), 0.0);
  spec.roiEnd.assign(x.rank(), 1.0);
  return spec;
}

/// The input coordinate that output index \p y of axis \p d maps to.
double sourceCoordinate(const ResizeSpec &spec, size_t d, int64_t in, int64_t y) {
  double s = spec.scales[d], length = spec.lengths[d], yc = double(y), inLen = double(in);
  switch (spec.coord) {
  case Coord::HalfPixel:
    return (yc + 0.5) / s - 0.5;
  case Coord::HalfPixelSymmetric: {
    double adjustment = double(spec.outShape[d]) / length;
    double offset = inLen / 2 * (1 - adjustment);
    return offset + (yc + 0.5) / s - 0.5;
  }
  case Coord::PytorchHalfPixel:
    return length > 1 ? (yc + 0.5) / s - 0.5 : 0.0;
  case Coord::AlignCorners:
    return length == 1 ? 0.0 : yc * (inLen - 1) / (length - 1);
  case Coord::Asymmetric:
    return yc / s;
  case Coord::TfCropAndResize: {
    double start = spec.roiStart[d], end = spec.roiEnd[d];
    if (length > 1)
      return start * (inLen - 1) + yc * (end - start) * (inLen - 1) / (length - 1);
    return 0.5 * (start + end) * (inLen - 1);
  }
  case Coord::TfHalfPixelForNn:
    return (yc + 0.5) / s;
  }
  return 0;
}

/// True when tf_crop_and_resize puts \p x outside the input.
bool extrapolates(const ResizeSpec &spec, double x, int64_t in) {
  return spec.coord == Coord::TfCropAndResize && (x < 0 || x > double(in - 1));
}

/// Nearest mode: the input index of coordinate \p x.
int64_t nearestIndex(const ResizeSpec &spec, size_t d, double x, int64_t in) {
  double floorX = std::floor(x), frac = x - floorX;
  double pick = x;
  if (frac != 0) {
    switch (spec.rounding) {
    case Rounding::RoundPreferFloor:
      pick = frac <= 0.5 ? floorX : floorX + 1;
      break;
    case Rounding::RoundPreferCeil:
      pick = frac < 0.5 ? floorX : floorX + 1;
      break;
    case Rounding::Floor:
      pick = floorX;
      break;
    case Rounding::Ceil:
      pick = floorX + 1;
      break;
    case Rounding::Simple:
      pick = spec.scales[d] < 1 ? floorX + 1 : std::trunc(x);
      break;
    }
  }
  pick = std::clamp(pick, 0.0, double(in - 1));
  return static_cast<int64_t>(pick);
}

/// The cubic convolution kernel of Keys with parameter \p a, at |t|.
double cubicKernel(double t, double a) {
  t = std::abs(t);
  if (t <= 1)
    return ((a + 2) * t - (a + 3)) * t * t + 1;
  if (t < 2)
    return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a;
  return 0;
}

/// The taps of one output coordinate along one axis: input indices (already
/// clamped to the axis) and their weights; none when it extrapolates.
struct Taps {
  Shape index;
  std::vector<double> weight;
  bool extrapolated = false;
};

/// Linear or cubic taps of coordinate \p x on an axis of length \p in.
Taps interpolationTaps(const ResizeSpec &spec, size_t d, double x, int64_t in) {
  Taps taps;
  if (extrapolates(spec, x, in)) {
    taps.extrapolated = true;
    return taps;
  }
  // The left neighbour and the distance from it, in (0, 1]: an integer
  // coordinate counts as a distance of 1 from the pixel before it.
  double floorX = std::floor(x);
  double base = x == floorX ? floorX - 1 : floorX, ratio = x - base;
  bool linear = spec.interp == Interp::Linear;
  double scale = spec.antialias ? std::min(spec.scales[d], 1.0) : 1.0;
  int64_t start = static_cast<int64_t>(std::floor((linear ? -1.0 : -2.0) / scale)) + 1;
  int64_t n = 2 - 2 * start;
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    double t = (double(start + j) - ratio) * scale;
    double w = linear ? std::max(0.0, 1 - std::abs(t)) : cubicKernel(t, spec.cubicA);
    int64_t i = static_cast<int64_t>(base) + start + j;
    if (spec.excludeOutside && (i < 0 || i >= in))
      w = 0;
    taps.index.push_back(std::clamp<int64_t>(i, 0, in - 1));
    taps.weight.push_back(w);
    sum += w;
  }
  if ((spec.antialias || spec.excludeOutside) && sum != 0)
    for (double &w : taps.weight)
      w /= sum;
  return taps;
}

/// Whether axis \p d maps every index to itself (ONNX's reference leaves
/// such axes alone).
bool isIdentityAxis(const ResizeSpec &spec, size_t d, int64_t in) {
  auto close = [](double a, double b) {
    return std::abs(a - b) <= 1e-9 * std::max(std::abs(a), std::abs(b));
  };
  return close(spec.scales[d], 1.0) && spec.outShape[d] == in &&
         (spec.coord != Coord::TfCropAndResize ||
          (spec.roiStart[d] == 0 && close(spec.roiEnd[d], 1.0)));
}

template <typename T> T fromDouble(double v) {
  if constexpr (isFloat<T>)
    return static_cast<T>(v);
  else
    return saturatingCast<T>(std::nearbyint(v));
}

/// Nearest mode: a gather through one index map per axis (-1: extrapolate).
template <typename T> Tensor resizeNearest(const Tensor &x, const ResizeSpec &spec) {
  int64_t rank = x.rank();
  std::vector<Shape> maps(rank);
  for (int64_t d = 0; d < rank; ++d)
    for (int64_t y = 0; y < spec.outShape[d]; ++y) {
      double src = sourceCoordinate(spec, d, x.dim(d), y);
      maps[d].push_back(extrapolates(spec, src, x.dim(d)) ? -1
                                                          : nearestIndex(spec, d, src, x.dim(d)));
    }
  Tensor out(x.elemType(), spec.outShape);
  Shape strides = stridesOf(x.shape()), at(rank, 0);
  const T *in = x.data<T>();
  T *o = out.data<T>();
  T fill = fromDouble<T>(spec.extrapolation);
  for (int64_t i = 0, e = out.numElements(); i < e; ++i) {
    int64_t offset = 0;
    bool outside = false;
    for (int64_t d = 0; d < rank; ++d) {
      outside |= maps[d][at[d]] < 0;
      offset += maps[d][at[d]] * strides[d];
    }
    o[i] = outside ? fill : in[offset];
    for (int64_t d = rank - 1; d >= 0 && ++at[d] == spec.outShape[d]; --d)
      at[d] = 0;
  }
  return out;
}

/// Linear and cubic: one weighted pass per axis that is not the identity,
/// in double.
template <typename T> Tensor resizeInterpolated(const Tensor &x, const ResizeSpec &spec) {
  Shape shape = x.shape();
  std::vector<double> current(x.numElements());
  std::transform(x.data<T>(), x.data<T>() + x.numElements(), current.begin(),
                 [](T v) { return double(v); });
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t in = shape[d], outLen = spec.outShape[d];
    if (isIdentityAxis(spec, d, in))
      continue;
    AxisSplit split = splitAt(shape, d);
    std::vector<double> next(split.outer * outLen * split.inner, 0.0);
    for (int64_t y = 0; y < outLen; ++y) {
      Taps taps = interpolationTaps(spec, d, sourceCoordinate(spec, d, in, y), in);
      for (int64_t o = 0; o < split.outer; ++o) {
        double *dst = next.data() + (o * outLen + y) * split.inner;
        if (taps.extrapolated) {
          std::fill(dst, dst + split.inner, spec.extrapolation);
          continue;
        }
        for (size_t t = 0; t < taps.index.size(); ++t) {
          const double *src = current.data() + (o * in + taps.index[t]) * split.inner;
          for (int64_t i = 0; i < split.inner; ++i)
            dst[i] += taps.weight[t] * src[i];
        }
      }
    }
    current = std::move(next);
    shape[d] = outLen;
  }
  Tensor out(x.elemType(), spec.outShape);
  std::transform(current.begin(), current.end(), out.data<T>(), fromDouble<T>);
  return out;
}

Expected<Outputs> runResize(const OpContext &ctx, const ResizeSpec &spec) {
  const Tensor &x = ctx.input(0);
  if (static_cast<int64_t>(spec.outShape.size()) != x.rank())
    return ctx.fail("the output rank differs from X's");
  for (int64_t d = 0; d < x.rank(); ++d)
    if (x.dim(d) == 0 && spec.outShape[d] != 0)
      return ctx.fail(formatv("axis {0} is empty and cannot be resized", d));
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if (spec.interp == Interp::Nearest)
      return Outputs{resizeNearest<T>(x, spec)};
    if constexpr (isBool<T>)
      return ctx.unsupportedType(x, 0);
    else
      return Outputs{resizeInterpolated<T>(x, spec)};
  });
}

/// The taps of output index \p y of axis \p d in any mode: nearest is one
/// tap of weight 1.
Taps tapsOf(const ResizeSpec &spec, size_t d, int64_t in, int64_t y) {
  double x = sourceCoordinate(spec, d, in, y);
  if (spec.interp != Interp::Nearest)
    return interpolationTaps(spec, d, x, in);
  Taps taps;
  taps.extrapolated = extrapolates(spec, x, in);
  if (!taps.extrapolated) {
    taps.index.push_back(nearestIndex(spec, d, x, in));
    taps.weight.push_back(1);
  }
  return taps;
}

/// The adjoint of Resize, which is linear in X: each axis's pass run
/// backwards, last axis first, adding each output's gradient to its taps
/// with their weights. Extrapolated outputs are constants and pass none.
template <typename T>
Tensor resizeAdjoint(const Tensor &dy, ArrayRef<int64_t> inShape, const ResizeSpec &spec) {
  int64_t rank = static_cast<int64_t>(inShape.size());
  Shape shape = spec.outShape;
  std::vector<double> current(dy.data<T>(), dy.data<T>() + dy.numElements());
  for (int64_t d = rank - 1; d >= 0; --d) {
    int64_t in = inShape[d], outLen = spec.outShape[d];
    if (isIdentityAxis(spec, d, in))
      continue;
    shape[d] = in;
    AxisSplit split = splitAt(shape, d);
    std::vector<double> next(split.outer * in * split.inner, 0.0);
    for (int64_t y = 0; y < outLen; ++y) {
      Taps taps = tapsOf(spec, d, in, y);
      for (int64_t o = 0; o < split.outer; ++o) {
        const double *src = current.data() + (o * outLen + y) * split.inner;
        for (size_t t = 0; t < taps.index.size(); ++t) {
          double *dst = next.data() + (o * in + taps.index[t]) * split.inner;
          for (int64_t i = 0; i < split.inner; ++i)
            dst[i] += taps.weight[t] * src[i];
        }
      }
    }
    current = std::move(next);
  }
  Tensor dx(dy.elemType(), Shape(inShape.begin(), inShape.end()));
  std::transform(current.begin(), current.end(), dx.data<T>(),
                 [](double v) { return static_cast<T>(v); });
  return dx;
}

} // namespace

/// Resize (10, 11, 13, 18, 19): nearest, linear and cubic in any rank.
Expected<Outputs> resize(const OpContext &ctx) {
  Expected<ResizeSpec> spec = readResize(ctx);
  if (!spec)
    return spec.takeError();
  return runResize(ctx, *spec);
}

/// Upsample (7, 9): Resize-10's semantics with scales of at least 1.
Expected<Outputs> upsample(const OpContext &ctx) {
  Expected<ResizeSpec> spec = readUpsample(ctx);
  if (!spec)
    return spec.takeError();
  return runResize(ctx, *spec);
}

/// ResizeGrad (pipec): dY, then the forward Resize's inputs and
/// attributes, to dX.
Expected<Outputs> resizeGrad(const OpContext &ctx) {
  const Tensor &dy = ctx.input(0);
  if (!ctx.optInput(1))
    return ctx.fail("missing the forward input X (input 1)");
  // The forward node's view: its inputs follow dY.
  OpContext forward(ctx.node, ctx.opset, ctx.allInputs().drop_front(), ctx.def);
  Expected<ResizeSpec> spec = readResize(forward);
  if (!spec)
    return spec.takeError();
  const Tensor &x = forward.input(0);
  if (dy.shape() != spec->outShape || dy.elemType() != x.elemType())
    return ctx.fail("dY " + dy.describe() + " does not match Resize's output " +
                    shapeString(spec->outShape) + " of X " + x.describe());
  return onFloat(ctx, dy, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    return Outputs{resizeAdjoint<T>(dy, x.shape(), *spec)};
  });
}

} // namespace pipec::cpu
