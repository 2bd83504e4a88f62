//===- NumericKernels.cpp - Normalizations, LpPool, Det, SwiGLU, BitCast ---===//
//
// The numeric ops that are not one formula per element: SwiGLU (two
// operands without broadcasting), the normalizations (LpNormalization,
// LRN, Instance-, Group- and RMSNormalization), LpPool, Det and BitCast.
// Statistics and sums run in double. Where ONNX computes a first stage in
// stash_type and casts it back to the input's type before scaling
// (GroupNormalization 21, RMSNormalization), that cast is rounded here too.
//
//===----------------------------------------------------------------------===//
#include "math/ElementMath.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Window.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstring>

using namespace llvm;

namespace pipec::cpu {

namespace {

/// Checks stash_type, the precision of a normalization's first stage: float
/// or double (pipec computes both in double).
Error checkStashType(const OpContext &ctx) {
  int64_t stash = ctx.attrInt("stash_type", 1);
  if (stash != 1 && stash != 11)
    return ctx.unsupported(formatv("stash_type {0}", stash));
  return Error::success();
}

/// Checks that input \p i is a float type.
Error floatInput(const OpContext &ctx, size_t i) {
  if (!isFloating(ctx.input(i).elemType()))
    return ctx.unsupportedType(ctx.input(i), i);
  return Error::success();
}

/// Checks that input 0, called \p name in errors, is a float tensor of
/// images: rank 2 or more, [N, C, ...].
Error floatImages(const OpContext &ctx, StringRef name) {
  if (Error e = floatInput(ctx, 0))
    return e;
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail(name + " must have rank >= 2 (N x C x ...), got " + x.describe());
  return Error::success();
}

/// Mean and variance (population) of n values from \p at(j), in double.
template <typename Fn> std::pair<double, double> moments(int64_t n, Fn at) {
  double mean = 0, var = 0;
  for (int64_t j = 0; j < n; ++j)
    mean += at(j);
  mean /= static_cast<double>(n);
  for (int64_t j = 0; j < n; ++j)
    var += (at(j) - mean) * (at(j) - mean);
  return {mean, var / static_cast<double>(n)};
}

} // namespace

/// SwiGLU (opset 28): Swish_alpha(A) * B, A and B of one shape and type.
Expected<Outputs> swiGlu(const OpContext &ctx) {
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (a.shape() != b.shape())
    return ctx.fail("A " + a.describe() + " and B " + b.describe() +
                    " must have one shape (SwiGLU does not broadcast)");
  if (Error e = floatInput(ctx, 0))
    return e;
  kernels::ElemParams params;
  params.alpha = ctx.attrFloat("alpha", 1.0f);
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!isFloat<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      return Outputs{broadcastBinary<T, T, T>(a, b, a.elemType(), a.shape(), [&](T x, T y) {
        return static_cast<T>(kernels::elem::Swish::value(x, params) * y);
      })};
    }
  });
}

/// LpNormalization: x divided by its L1 or L2 norm along axis; a zero norm
/// gives zeros (opset 22 says so; the same values before).
Expected<Outputs> lpNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (Error e = floatInput(ctx, 0))
    return e;
  int64_t p = ctx.attrInt("p", 2);
  if (p != 1 && p != 2)
    return ctx.fail(formatv("p must be 1 or 2, not {0}", p));
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", -1), x.rank());
  if (!axis)
    return axis.takeError();
  AxisSplit split = splitAt(x.shape(), *axis);
  Tensor y(x.elemType(), x.shape());
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>) {
      for (int64_t o = 0; o < split.outer; ++o)
        for (int64_t i = 0; i < split.inner; ++i) {
          const T *in = x.data<T>() + o * split.size * split.inner + i;
          T *out = y.data<T>() + o * split.size * split.inner + i;
          double norm = 0;
          for (int64_t j = 0; j < split.size; ++j) {
            double v = in[j * split.inner];
            norm += p == 1 ? std::fabs(v) : v * v;
          }
          if (p == 2)
            norm = std::sqrt(norm);
          for (int64_t j = 0; j < split.size; ++j)
            out[j * split.inner] = static_cast<T>(norm == 0 ? 0.0 : in[j * split.inner] / norm);
        }
    }
  });
  return Outputs{y};
}

/// LRN: x / (bias + alpha / size * sum of squares)^beta, the sum over the
/// channels [c - floor((size-1)/2), c + ceil((size-1)/2)] that exist.
Expected<Outputs> lrn(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (Error e = floatImages(ctx, "X"))
    return e;
  if (!ctx.attr("size"))
    return ctx.fail("missing attribute 'size'");
  int64_t size = ctx.attrInt("size", 1);
  if (size < 1)
    return ctx.fail(formatv("size must be positive, not {0}", size));
  double alpha = ctx.attrFloat("alpha", 1e-4f), beta = ctx.attrFloat("beta", 0.75f);
  double bias = ctx.attrFloat("bias", 1.0f);
  int64_t before = (size - 1) / 2, after = size / 2; // floor and ceil of (size-1)/2
  AxisSplit split = splitAt(x.shape(), 1);
  Tensor y(x.elemType(), x.shape());
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>) {
      for (int64_t n = 0; n < split.outer; ++n)
        for (int64_t c = 0; c < split.size; ++c)
          for (int64_t s = 0; s < split.inner; ++s) {
            const T *plane = x.data<T>() + n * split.size * split.inner + s;
            double sum = 0;
            for (int64_t k = std::max<int64_t>(0, c - before);
                 k <= std::min(split.size - 1, c + after); ++k)
              sum += double(plane[k * split.inner]) * plane[k * split.inner];
            double v = plane[c * split.inner];
            y.data<T>()[(n * split.size + c) * split.inner + s] =
                static_cast<T>(v / std::pow(bias + alpha / size * sum, beta));
          }
    }
  });
  return Outputs{y};
}

namespace {

/// y = scale * (x - mean) / sqrt(var + epsilon) + bias over groups of
/// channels: \p groups per image, each \p perGroup channels of \p spatial
/// elements. scale and bias hold one value per channel, or per group when
/// \p perGroupParams. The normalized value is rounded to x's type before
/// it is scaled.
Tensor normalizeGroups(const Tensor &x, const Tensor &scale, const Tensor &bias, int64_t groups,
                       int64_t spatial, bool perGroupParams, double epsilon) {
  Tensor y(x.elemType(), x.shape());
  if (groups == 0) // no channels: nothing to normalize
    return y;
  int64_t batch = x.dim(0), channels = x.dim(1), perGroup = channels / groups;
  int64_t groupSize = perGroup * spatial;
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>) {
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t g = 0; g < groups; ++g) {
          int64_t base = (n * groups + g) * groupSize;
          const T *in = x.data<T>() + base;
          auto [mean, var] = moments(groupSize, [&](int64_t j) { return double(in[j]); });
          double invStd = 1 / std::sqrt(var + epsilon);
          for (int64_t j = 0; j < groupSize; ++j) {
            int64_t param = perGroupParams ? g : g * perGroup + j / spatial;
            double normalized = roundAs(x.elemType(), (in[j] - mean) * invStd);
            y.data<T>()[base + j] =
                static_cast<T>(scale.getDouble(param) * normalized + bias.getDouble(param));
          }
        }
    }
  });
  return y;
}

} // namespace

/// InstanceNormalization: each (image, channel) normalized over its spatial
/// elements, then scaled and shifted per channel.
Expected<Outputs> instanceNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1), &bias = ctx.input(2);
  if (Error e = floatImages(ctx, "input"))
    return e;
  for (size_t i : {1, 2}) {
    if (Error e = ctx.sameType(0, i))
      return e;
    if (ctx.input(i).rank() != 1 || ctx.input(i).dim(0) != x.dim(1))
      return ctx.fail(formatv("input {0} must have shape [{1}], got {2}", i, x.dim(1),
                              ctx.input(i).describe()));
  }
  int64_t spatial = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  return Outputs{
      normalizeGroups(x, scale, bias, x.dim(1), spatial, true, ctx.attrFloat("epsilon", 1e-5f))};
}

/// GroupNormalization: num_groups groups of channels per image. Opset 18
/// takes scale and bias per group, opset 21 per channel.
Expected<Outputs> groupNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1), &bias = ctx.input(2);
  if (Error e = floatImages(ctx, "X"))
    return e;
  if (!ctx.attr("num_groups"))
    return ctx.fail("missing attribute 'num_groups'");
  int64_t groups = ctx.attrInt("num_groups", 1), channels = x.dim(1);
  if (groups < 1 || channels % groups != 0)
    return ctx.fail(formatv("num_groups {0} does not divide the {1} channels", groups, channels));
  if (Error e = checkStashType(ctx))
    return e;
  bool perGroup = ctx.opset < 21;
  int64_t params = perGroup ? groups : channels;
  for (size_t i : {1, 2}) {
    if (Error e = ctx.sameType(0, i))
      return e;
    if (ctx.input(i).rank() != 1 || ctx.input(i).dim(0) != params)
      return ctx.fail(formatv("input {0} must have shape [{1}] (one per {2}), got {3}", i, params,
                              perGroup ? "group" : "channel", ctx.input(i).describe()));
  }
  int64_t spatial = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  return Outputs{
      normalizeGroups(x, scale, bias, groups, spatial, perGroup, ctx.attrFloat("epsilon", 1e-5f))};
}

/// RMSNormalization (opset 23): x / sqrt(mean of x^2 over [axis, rank) +
/// epsilon), rounded to x's type, times scale (broadcast to x). Y has
/// scale's type.
Expected<Outputs> rmsNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  if (Error e = floatInput(ctx, 0))
    return e;
  if (Error e = floatInput(ctx, 1))
    return e;
  if (Error e = checkStashType(ctx))
    return e;
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", -1), x.rank());
  if (!axis)
    return axis.takeError();
  Expected<Shape> shape = broadcastShapes(scale.shape(), x.shape());
  if (!shape || *shape != x.shape()) {
    consumeError(shape.takeError());
    return ctx.fail("scale " + scale.describe() + " does not broadcast to X " + x.describe());
  }
  double epsilon = ctx.attrFloat("epsilon", 1e-5f);
  int64_t outer = product(ArrayRef<int64_t>(x.shape()).take_front(*axis));
  int64_t size = product(ArrayRef<int64_t>(x.shape()).drop_front(*axis));
  Tensor gamma = expandAny(scale, x.shape());
  Tensor y(scale.elemType(), x.shape());
  for (int64_t o = 0; o < outer; ++o) {
    double sumSq = 0;
    for (int64_t j = 0; j < size; ++j) {
      double v = x.getDouble(o * size + j);
      sumSq += v * v;
    }
    double invRms = 1 / std::sqrt(sumSq / static_cast<double>(size) + epsilon);
    for (int64_t j = 0; j < size; ++j) {
      int64_t i = o * size + j;
      double normalized = roundAs(x.elemType(), x.getDouble(i) * invRms);
      y.setDouble(i, normalized * gamma.getDouble(i));
    }
  }
  return Outputs{y};
}

/// LpPool: (sum of |x|^p over each window)^(1/p); padding adds nothing.
/// Opset 1 reads p as a float, later opsets as an integer.
Expected<Outputs> lpPool(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (Error e = floatInput(ctx, 0))
    return e;
  Expected<Window> geometry = poolWindow(ctx, x);
  if (!geometry)
    return geometry.takeError();
  const Window &w = *geometry;
  double p = 2;
  if (const onnx::AttributeProto *attr = ctx.attr("p"))
    p = attr->type() == onnx::AttributeProto::FLOAT ? attr->f() : static_cast<double>(attr->i());
  if (!(p > 0))
    return ctx.fail(formatv("p must be positive, not {0}", p));
  Tensor y(x.elemType(), w.outShape(x.dim(0), x.dim(1)));
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>) {
      T *out = y.data<T>();
      for (int64_t plane = 0, o = 0; plane < x.dim(0) * x.dim(1); ++plane) {
        const T *in = x.data<T>() + plane * w.inSize();
        for (int64_t od = 0; od < w.out[0]; ++od)
          for (int64_t oh = 0; oh < w.out[1]; ++oh)
            for (int64_t ow = 0; ow < w.out[2]; ++ow, ++o) {
              double sum = 0;
              for (int64_t kd = 0; kd < w.kernel[0]; ++kd)
                for (int64_t kh = 0; kh < w.kernel[1]; ++kh)
                  for (int64_t kw = 0; kw < w.kernel[2]; ++kw) {
                    int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
                    int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
                    int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
                    if (id < 0 || id >= w.in[0] || ih < 0 || ih >= w.in[1] || iw < 0 ||
                        iw >= w.in[2])
                      continue;
                    double v = std::fabs(double(in[(id * w.in[1] + ih) * w.in[2] + iw]));
                    sum += p == 1 ? v : p == 2 ? v * v : std::pow(v, p);
                  }
              out[o] = static_cast<T>(p == 1   ? sum
                                      : p == 2 ? std::sqrt(sum)
                                               : std::pow(sum, 1 / p));
            }
      }
    }
  });
  return Outputs{y};
}

/// Det: the determinant of each [M, M] matrix of [*, M, M], by LU
/// decomposition with partial pivoting in double.
Expected<Outputs> det(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (Error e = floatInput(ctx, 0))
    return e;
  if (x.rank() < 2 || x.dim(-1) != x.dim(-2))
    return ctx.fail("X must be square matrices [*, M, M], got " + x.describe());
  int64_t m = x.dim(-1);
  Shape outShape(x.shape().begin(), x.shape().end() - 2);
  Tensor y(x.elemType(), outShape);
  std::vector<double> lu(m * m);
  for (int64_t b = 0; b < y.numElements(); ++b) {
    for (int64_t i = 0; i < m * m; ++i)
      lu[i] = x.getDouble(b * m * m + i);
    double result = 1;
    for (int64_t k = 0; k < m && result != 0; ++k) {
      int64_t pivot = k;
      for (int64_t r = k + 1; r < m; ++r)
        if (std::fabs(lu[r * m + k]) > std::fabs(lu[pivot * m + k]))
          pivot = r;
      if (lu[pivot * m + k] == 0) {
        result = 0;
        break;
      }
      if (pivot != k) {
        std::swap_ranges(lu.begin() + k * m, lu.begin() + (k + 1) * m, lu.begin() + pivot * m);
        result = -result;
      }
      result *= lu[k * m + k];
      for (int64_t r = k + 1; r < m; ++r) {
        double factor = lu[r * m + k] / lu[k * m + k];
        for (int64_t c = k; c < m; ++c)
          lu[r * m + c] -= factor * lu[k * m + c];
      }
    }
    y.setDouble(b, result);
  }
  return Outputs{y};
}

namespace {

/// The bits of element \p i of \p t in its ONNX encoding (little endian,
/// float16 and bfloat16 in 16 bits).
uint64_t bitsOf(const Tensor &t, int64_t i) {
  uint64_t bits = 0;
  if (t.elemType() == DType::F16)
    return floatToHalf(t.data<float>()[i]);
  if (t.elemType() == DType::BF16)
    return floatToBFloat16(t.data<float>()[i]);
  size_t bytes = storageSize(t.elemType());
  std::memcpy(&bits, static_cast<const char *>(t.rawData()) + i * bytes, bytes);
  return bits;
}

/// Stores \p bits, an ONNX encoding of \p t's type, as element \p i.
void setBits(Tensor &t, int64_t i, uint64_t bits) {
  if (t.elemType() == DType::F16) {
    t.data<float>()[i] = halfToFloat(static_cast<uint16_t>(bits));
  } else if (t.elemType() == DType::BF16) {
    t.data<float>()[i] = bfloat16ToFloat(static_cast<uint16_t>(bits));
  } else if (t.elemType() == DType::Bool) {
    t.data<bool>()[i] = (bits & 0xff) != 0;
  } else {
    size_t bytes = storageSize(t.elemType());
    std::memcpy(static_cast<char *>(t.rawData()) + i * bytes, &bits, bytes);
  }
}

} // namespace

/// BitCast (opset 26): the same bits read as type 'to', of the same width.
Expected<Outputs> bitCast(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  const onnx::AttributeProto *to = ctx.attr("to");
  if (!to)
    return ctx.fail("missing attribute 'to'");
  int32_t onnxType = static_cast<int32_t>(to->i());
  if (onnxType == static_cast<int32_t>(DType::String))
    return ctx.fail("BitCast to string is not defined");
  Expected<DType> type = elemTypeFromOnnx(onnxType);
  if (!type) {
    consumeError(type.takeError());
    return ctx.unsupported("bitcast to " + onnxTypeName(onnxType));
  }
  if (dtypeSize(*type) != dtypeSize(x.elemType()))
    return ctx.fail(
        formatv("{0} and {1} differ in width", elemTypeName(x.elemType()), elemTypeName(*type)));
  Tensor y(*type, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    setBits(y, i, bitsOf(x, i));
  return Outputs{y};
}

} // namespace pipec::cpu
