//===- GradKernels.cpp - CPU kernels for pipec's gradient ops -----------===//
//
// Plain loops over float or double storage; each kernel follows the formula
// in passes/Differentiate.h. The convolution gradients are GEMMs (OpenBLAS,
// through Kernels.h) around im2col and its adjoint col2im; the windows are
// walked in the forward kernels' order so that MaxPoolGrad picks the same
// maximum as MaxPool.
//
//===----------------------------------------------------------------------===//

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "support/Attributes.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>

using namespace llvm;

namespace pipec::cpu {
namespace {

Error fail(const onnx::NodeProto &node, const Twine &what) { return nodeError(node, what); }

/// Calls f(T{}) for float or double tensors, fails otherwise.
template <typename F>
Expected<std::vector<Tensor>> floating(const onnx::NodeProto &node, const Tensor &t, F &&f) {
  if (t.elemType() == DType::F32)
    return f(float{});
  if (t.elemType() == DType::F64)
    return f(double{});
  return fail(node, "element type " + elemTypeName(t.elemType()).str() + " is not supported");
}

/// dX = dY * g(A) elementwise, dY and A of one shape.
template <typename G>
Expected<std::vector<Tensor>> pointwise(const onnx::NodeProto &node,
                                        ArrayRef<const Tensor *> inputs, G g) {
  const Tensor &dy = *inputs[0], &a = *inputs[1];
  if (dy.shape() != a.shape() || dy.elemType() != a.elemType())
    return fail(node, "dY " + dy.describe() + " and " + a.describe() + " differ");
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(dy.elemType(), dy.shape());
    const T *pd = dy.data<T>(), *pa = a.data<T>();
    T *px = dx.data<T>();
    for (int64_t i = 0; i < dy.numElements(); ++i)
      px[i] = pd[i] * static_cast<T>(g(static_cast<double>(pa[i])));
    return std::vector<Tensor>{dx};
  });
}

/// The axis attribute (default -1, the last) as an axis of \p t.
Expected<int64_t> axisAttr(const onnx::NodeProto &node, const Tensor &t) {
  int64_t axis = attrInt(node, "axis", -1);
  if (axis < 0)
    axis += t.rank();
  if (axis < 0 || axis >= t.rank())
    return fail(node, "axis out of range for " + t.describe());
  return axis;
}

/// Splits \p shape around \p axis into outer x size x inner.
void splitAt(ArrayRef<int64_t> shape, int64_t axis, int64_t &outer, int64_t &size, int64_t &inner) {
  outer = numElementsOf(shape.take_front(axis));
  size = shape[axis];
  inner = numElementsOf(shape.drop_front(axis + 1));
}

Expected<std::vector<Tensor>> softmaxGrad(const onnx::NodeProto &node,
                                          ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &y = *inputs[1];
  if (dy.shape() != y.shape())
    return fail(node, "dY " + dy.describe() + " and Y " + y.describe() + " differ");
  Expected<int64_t> axis = axisAttr(node, y);
  if (!axis)
    return axis.takeError();
  int64_t outer, size, inner;
  splitAt(y.shape(), *axis, outer, size, inner);
  return floating(node, y, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx = Tensor::uninitialized(y.elemType(), y.shape()); // every element is written
    const T *pd = dy.data<T>(), *py = y.data<T>();
    T *px = dx.data<T>();
    // Rows are independent: the rank's loop threads take runs of them.
    parallelFor(outer * inner, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        int64_t base = (row / inner) * size * inner + row % inner;
        double dot = laneSum(size, [&](int64_t k) {
          return double(pd[base + k * inner]) * double(py[base + k * inner]);
        });
        for (int64_t k = 0; k < size; ++k) {
          int64_t i = base + k * inner;
          px[i] = static_cast<T>(double(py[i]) * (double(pd[i]) - dot));
        }
      }
    });
    return std::vector<Tensor>{dx};
  });
}

Expected<std::vector<Tensor>> gatherGrad(const onnx::NodeProto &node,
                                         ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &indices = *inputs[1];
  const auto *shapeAttr = findAttr(node, "shape");
  if (!shapeAttr)
    return fail(node, "missing attribute 'shape'");
  std::vector<int64_t> shape(shapeAttr->ints().begin(), shapeAttr->ints().end());
  int64_t rank = static_cast<int64_t>(shape.size());
  int64_t axis = attrInt(node, "axis", 0);
  if (axis < 0)
    axis += rank;
  if (axis < 0 || axis >= rank)
    return fail(node, "axis out of range for " + shapeString(shape));
  int64_t outer, size, inner;
  splitAt(shape, axis, outer, size, inner);
  int64_t count = indices.numElements();
  if (dy.numElements() != outer * count * inner)
    return fail(node, "dY " + dy.describe() + " does not match indices " + indices.describe());
  std::vector<int64_t> idx = indices.toInt64Vector();
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(dy.elemType(), shape);
    const T *pd = dy.data<T>();
    T *px = dx.data<T>();
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t j = 0; j < count; ++j) {
        int64_t k = idx[j] < 0 ? idx[j] + size : idx[j];
        if (k < 0 || k >= size)
          return fail(node, "index " + Twine(idx[j]) + " out of range [0, " + Twine(size) + ")");
        for (int64_t in = 0; in < inner; ++in)
          px[(o * size + k) * inner + in] += pd[(o * count + j) * inner + in];
      }
    return std::vector<Tensor>{dx};
  });
}

Expected<std::vector<Tensor>> crossEntropyGrad(const onnx::NodeProto &node,
                                               ArrayRef<const Tensor *> inputs) {
  const Tensor &dLoss = *inputs[0], &scores = *inputs[1], &labels = *inputs[2];
  if (scores.rank() < 2 || dLoss.numElements() != 1)
    return fail(node, "expects a scalar dLoss and scores of rank >= 2");
  int64_t n = scores.dim(0), c = scores.dim(1);
  int64_t inner = numElementsOf(ArrayRef<int64_t>(scores.shape()).drop_front(2));
  if (labels.numElements() != n * inner)
    return fail(node, "labels " + labels.describe() + " do not match scores " + scores.describe());
  std::string reduction = attrString(node, "reduction", "mean");
  const auto *ignoreAttr = findAttr(node, "ignore_index");
  std::vector<int64_t> lab = labels.toInt64Vector();
  double count = 0;
  for (int64_t l : lab)
    count += ignoreAttr && l == ignoreAttr->i() ? 0 : 1;
  double scale = dLoss.getDouble(0) / (reduction == "sum" || count == 0 ? 1.0 : count);
  return floating(node, scores, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(scores.elemType(), scores.shape());
    const T *ps = scores.data<T>();
    T *px = dx.data<T>();
    if constexpr (std::is_same_v<T, float>) {
      if (inner == 1) {
        for (int64_t label : lab)
          if (!(ignoreAttr && label == ignoreAttr->i()) && (label < 0 || label >= c))
            return fail(node, "label " + Twine(label) + " out of range [0, " + Twine(c) + ")");
        // Rows of classes (a language model's tokens): the rank's loop
        // threads take runs of rows; the exponentials in float, in loops
        // that vectorise, their sum in double.
        parallelFor(n, 4, [&](int64_t begin, int64_t end) {
          for (int64_t b = begin; b < end; ++b) {
            int64_t label = lab[b];
            if (ignoreAttr && label == ignoreAttr->i())
              continue;
            const float *row = ps + b * c;
            float *out = px + b * c;
            float maxV;
            double sum = shiftedExponentials(row, out, c, maxV);
            float factor = static_cast<float>(scale / sum);
            for (int64_t k = 0; k < c; ++k)
              out[k] *= factor;
            out[label] = static_cast<float>(double(out[label]) - scale);
          }
        });
        return std::vector<Tensor>{dx};
      }
    }
    for (int64_t b = 0; b < n; ++b)
      for (int64_t in = 0; in < inner; ++in) {
        int64_t label = lab[b * inner + in];
        if (ignoreAttr && label == ignoreAttr->i())
          continue;
        if (label < 0 || label >= c)
          return fail(node, "label " + Twine(label) + " out of range [0, " + Twine(c) + ")");
        int64_t base = b * c * inner + in;
        double maxV = -INFINITY, sum = 0;
        for (int64_t k = 0; k < c; ++k)
          maxV = std::max(maxV, double(ps[base + k * inner]));
        for (int64_t k = 0; k < c; ++k)
          sum += std::exp(double(ps[base + k * inner]) - maxV);
        for (int64_t k = 0; k < c; ++k) {
          double p = std::exp(double(ps[base + k * inner]) - maxV) / sum;
          px[base + k * inner] = static_cast<T>(scale * (p - (k == label ? 1.0 : 0.0)));
        }
      }
    return std::vector<Tensor>{dx};
  });
}

/// Calls \p f with \p t's elements as they are stored: double for float64,
/// float for float32 and the half types (stored as float).
template <typename F> void withFloatStorage(const Tensor &t, F f) {
  if (t.elemType() == DType::F64)
    f(t.data<double>());
  else
    f(static_cast<const float *>(t.rawData()));
}

/// Shared by both LayerNorm gradients: per row of the normalised axes, the
/// mean and reciprocal standard deviation of X.
struct LayerNormRows {
  int64_t rows = 0, width = 0;
  std::vector<double> mean, rstd;
};

Expected<LayerNormRows> layerNormRows(const onnx::NodeProto &node, const Tensor &dy,
                                      const Tensor &x) {
  if (dy.shape() != x.shape() || dy.elemType() != x.elemType())
    return fail(node, "dY " + dy.describe() + " and X " + x.describe() + " differ");
  Expected<int64_t> axis = axisAttr(node, x);
  if (!axis)
    return axis.takeError();
  if (!isFloating(x.elemType()))
    return fail(node, "element type " + elemTypeName(x.elemType()).str() + " is not supported");
  double epsilon = attrFloat(node, "epsilon", 1e-5);
  LayerNormRows r;
  r.rows = numElementsOf(ArrayRef<int64_t>(x.shape()).take_front(*axis));
  r.width = numElementsOf(ArrayRef<int64_t>(x.shape()).drop_front(*axis));
  r.mean.resize(r.rows);
  r.rstd.resize(r.rows);
  withFloatStorage(x, [&](const auto *xs) {
    parallelFor(r.rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const auto *in = xs + row * r.width;
        double mean = laneSum(r.width, [&](int64_t k) { return double(in[k]); }) / double(r.width);
        double sq = laneSum(r.width, [&](int64_t k) {
          double d = double(in[k]) - mean;
          return d * d;
        });
        r.mean[row] = mean;
        r.rstd[row] = 1.0 / std::sqrt(sq / double(r.width) + epsilon);
      }
    });
  });
  return r;
}

Expected<std::vector<Tensor>> layerNormGradInput(const onnx::NodeProto &node,
                                                 ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &x = *inputs[1], &scale = *inputs[2];
  auto r = layerNormRows(node, dy, x);
  if (!r)
    return r.takeError();
  if (scale.numElements() != r->width)
    return fail(node, "scale " + scale.describe() + " does not match X " + x.describe());
  if (!isFloating(x.elemType()))
    return fail(node, "element type " + elemTypeName(x.elemType()).str() + " is not supported");
  if (!isFloating(scale.elemType()))
    return fail(node, "scale " + scale.describe() + " is not a float");
  Tensor dx(x.elemType(), x.shape());
  // Rows are independent: each thread keeps its own g and x-hat.
  withFloatStorage(x, [&](const auto *xs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
    const T *dys = static_cast<const T *>(dy.rawData());
    T *dxs = static_cast<T *>(dx.rawData());
    std::vector<double> gamma(r->width);
    for (int64_t k = 0; k < r->width; ++k)
      gamma[k] = scale.getDouble(k);
    parallelFor(r->rows, 8, [&](int64_t begin, int64_t end) {
      std::vector<double> g(r->width), xh(r->width);
      for (int64_t row = begin; row < end; ++row) {
        for (int64_t k = 0; k < r->width; ++k) {
          int64_t i = row * r->width + k;
          xh[k] = (double(xs[i]) - r->mean[row]) * r->rstd[row];
          g[k] = double(dys[i]) * gamma[k];
        }
        double meanG = laneSum(r->width, [&](int64_t k) { return g[k]; }) / double(r->width);
        double meanGX =
            laneSum(r->width, [&](int64_t k) { return g[k] * xh[k]; }) / double(r->width);
        for (int64_t k = 0; k < r->width; ++k)
          dxs[row * r->width + k] = static_cast<T>(r->rstd[row] * (g[k] - meanG - xh[k] * meanGX));
      }
    });
  });
  dx.roundToElemType();
  return std::vector<Tensor>{dx};
}

Expected<std::vector<Tensor>> layerNormGradWeight(const onnx::NodeProto &node,
                                                  ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &x = *inputs[1];
  auto r = layerNormRows(node, dy, x);
  if (!r)
    return r.takeError();
  if (!isFloating(x.elemType()))
    return fail(node, "element type " + elemTypeName(x.elemType()).str() + " is not supported");
  std::vector<int64_t> shape{r->width};
  if (const auto *shapeAttr = findAttr(node, "shape"))
    shape.assign(shapeAttr->ints().begin(), shapeAttr->ints().end());
  if (numElementsOf(shape) != r->width)
    return fail(node, "shape " + shapeString(shape) + " does not match X " + x.describe());
  Tensor dscale(x.elemType(), shape);
  // A sum over rows, in row order (the bits do not depend on threads).
  std::vector<double> acc(r->width, 0.0);
  withFloatStorage(x, [&](const auto *xs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
    const T *dys = static_cast<const T *>(dy.rawData());
    for (int64_t row = 0; row < r->rows; ++row)
      for (int64_t k = 0; k < r->width; ++k) {
        int64_t i = row * r->width + k;
        acc[k] += double(dys[i]) * (double(xs[i]) - r->mean[row]) * r->rstd[row];
      }
  });
  for (int64_t k = 0; k < r->width; ++k)
    dscale.setDouble(k, acc[k]);
  dscale.roundToElemType();
  return std::vector<Tensor>{dscale};
}

//===----------------------------------------------------------------------===//
// Convolution and pooling gradients
//===----------------------------------------------------------------------===//

/// Sliding-window geometry of a Conv or pool gradient, padded to three
/// spatial dimensions as the forward kernels pad it (a 1-D or 2-D op gets
/// leading dimensions of size 1). Pads are explicit (the differentiate pass
/// resolves auto_pad) and the output sizes are dY's.
struct Window {
  static constexpr int MaxRank = 3;
  std::array<int64_t, MaxRank> in, kernel, stride, dilation, padBegin, padEnd, out;
  int64_t inSize() const { return in[0] * in[1] * in[2]; }
  int64_t outSize() const { return out[0] * out[1] * out[2]; }
  int64_t kernelSize() const { return kernel[0] * kernel[1] * kernel[2]; }
  /// True when every window is one input element at the same position: the
  /// im2col columns are the image itself.
  bool isIdentity() const {
    for (int d = 0; d < MaxRank; ++d)
      if (kernel[d] != 1 || stride[d] != 1 || padBegin[d] != 0 || out[d] != in[d])
        return false;
    return true;
  }
};

std::vector<int64_t> intsAttr(const onnx::NodeProto &node, StringRef name,
                              std::vector<int64_t> otherwise) {
  return attrInts(node, name).value_or(std::move(otherwise));
}

/// Reads strides, dilations and pads for a window of \p kernel sliding over
/// \p in to give \p out, and checks that the sizes agree (out as with
/// ceil_mode off or on).
Expected<Window> windowOf(const onnx::NodeProto &node, ArrayRef<int64_t> in,
                          ArrayRef<int64_t> kernel, ArrayRef<int64_t> out) {
  size_t rank = in.size();
  if (rank < 1 || rank > Window::MaxRank)
    return fail(node, Twine(rank) + " spatial dimensions (1 to 3 are supported)");
  if (kernel.size() != rank || out.size() != rank)
    return fail(node, "kernel " + shapeString(kernel) + ", input " + shapeString(in) +
                          " and output " + shapeString(out) + " spatial sizes differ in rank");
  if (const auto *given = findAttr(node, "kernel_shape");
      given &&
      !std::equal(given->ints().begin(), given->ints().end(), kernel.begin(), kernel.end()))
    return fail(node, "kernel_shape does not match the kernel " + shapeString(kernel));
  std::vector<int64_t> strides = intsAttr(node, "strides", std::vector<int64_t>(rank, 1));
  std::vector<int64_t> dilations = intsAttr(node, "dilations", std::vector<int64_t>(rank, 1));
  std::vector<int64_t> pads = intsAttr(node, "pads", std::vector<int64_t>(2 * rank, 0));
  if (strides.size() != rank || dilations.size() != rank || pads.size() != 2 * rank)
    return fail(node, "strides, dilations or pads do not match the spatial rank");
  Window w;
  size_t lead = Window::MaxRank - rank;
  for (int d = 0; d < Window::MaxRank; ++d) {
    w.in[d] = w.kernel[d] = w.stride[d] = w.dilation[d] = w.out[d] = 1;
    w.padBegin[d] = w.padEnd[d] = 0;
  }
  for (size_t i = 0; i < rank; ++i) {
    size_t d = lead + i;
    w.in[d] = in[i], w.kernel[d] = kernel[i], w.stride[d] = strides[i];
    w.dilation[d] = dilations[i], w.padBegin[d] = pads[i], w.padEnd[d] = pads[rank + i];
    w.out[d] = out[i];
    if (w.kernel[d] < 1 || w.stride[d] < 1 || w.dilation[d] < 1 || w.padBegin[d] < 0 ||
        w.padEnd[d] < 0)
      return fail(node, "kernel, strides and dilations must be positive and pads non-negative");
    int64_t span = w.in[d] + w.padBegin[d] + w.padEnd[d] - (w.kernel[d] - 1) * w.dilation[d] - 1;
    if (span < 0 || w.out[d] < span / w.stride[d] + 1 ||
        w.out[d] > (span + w.stride[d] - 1) / w.stride[d] + 1)
      return fail(node, "output size " + Twine(w.out[d]) + " does not fit input size " +
                            Twine(w.in[d]) + " in spatial dimension " + Twine(i));
  }
  return w;
}

/// Calls f(k, o, i, inPadded) for every kernel tap k and output position o
/// (both row-major; the taps outermost) of one plane. i is the input element
/// the tap reads, or -1 where it reads padding; inPadded says whether the
/// tap lies inside the padded input. For one o the taps come in increasing
/// k, as in the forward kernels' window loops.
template <typename F> void forEachTap(const Window &w, F &&f) {
  int64_t k = 0;
  for (int64_t kd = 0; kd < w.kernel[0]; ++kd)
    for (int64_t kh = 0; kh < w.kernel[1]; ++kh)
      for (int64_t kw = 0; kw < w.kernel[2]; ++kw, ++k) {
        int64_t o = 0;
        for (int64_t od = 0; od < w.out[0]; ++od) {
          int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
          bool padD = id >= -w.padBegin[0] && id < w.in[0] + w.padEnd[0];
          bool inD = id >= 0 && id < w.in[0];
          for (int64_t oh = 0; oh < w.out[1]; ++oh) {
            int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
            bool padH = padD && ih >= -w.padBegin[1] && ih < w.in[1] + w.padEnd[1];
            bool inH = inD && ih >= 0 && ih < w.in[1];
            for (int64_t ow = 0; ow < w.out[2]; ++ow, ++o) {
              int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
              bool padW = padH && iw >= -w.padBegin[2] && iw < w.in[2] + w.padEnd[2];
              bool inW = inH && iw >= 0 && iw < w.in[2];
              f(k, o, inW ? (id * w.in[1] + ih) * w.in[2] + iw : int64_t(-1), padW);
            }
          }
        }
      }
}

/// Unfolds \p channels planes of \p image into columns [channels * kernel
/// taps, output positions], zeros where a tap reads padding.
template <typename T> void im2col(const T *image, int64_t channels, const Window &w, T *columns) {
  int64_t inSize = w.inSize(), colSize = w.kernelSize() * w.outSize(), outSize = w.outSize();
  for (int64_t c = 0; c < channels; ++c) {
    const T *plane = image + c * inSize;
    T *cols = columns + c * colSize;
    forEachTap(w, [&](int64_t k, int64_t o, int64_t i, bool) {
      cols[k * outSize + o] = i < 0 ? T(0) : plane[i];
    });
  }
}

/// The adjoint of im2col: adds every column entry to the image element it
/// was read from.
template <typename T> void col2im(const T *columns, int64_t channels, const Window &w, T *image) {
  int64_t inSize = w.inSize(), colSize = w.kernelSize() * w.outSize(), outSize = w.outSize();
  for (int64_t c = 0; c < channels; ++c) {
    T *plane = image + c * inSize;
    const T *cols = columns + c * colSize;
    forEachTap(w, [&](int64_t k, int64_t o, int64_t i, bool) {
      if (i >= 0)
        plane[i] += cols[k * outSize + o];
    });
  }
}

/// The shape attribute, required.
Expected<std::vector<int64_t>> shapeAttr(const onnx::NodeProto &node) {
  auto shape = attrInts(node, "shape");
  if (!shape)
    return fail(node, "missing attribute 'shape'");
  return *shape;
}

/// Conv's operands as its gradients see them: X [N, C, in...], W [M, C /
/// group, kernel...], dY [N, M, out...].
struct ConvShapes {
  int64_t batch, channels, maps, group;
  Window window;
  int64_t groupChannels() const { return channels / group; }
  int64_t groupMaps() const { return maps / group; }
  /// Rows of one group's im2col matrix.
  int64_t rows() const { return groupChannels() * window.kernelSize(); }
};

Expected<ConvShapes> convShapes(const onnx::NodeProto &node, const Tensor &dy, ArrayRef<int64_t> x,
                                ArrayRef<int64_t> w) {
  if (dy.rank() < 3 || int64_t(x.size()) != dy.rank() || int64_t(w.size()) != dy.rank())
    return fail(node, "dY " + dy.describe() + ", X " + shapeString(x) + " and W " + shapeString(w) +
                          " must have the same rank >= 3");
  ConvShapes s;
  s.batch = x[0], s.channels = x[1], s.maps = w[0];
  s.group = attrInt(node, "group", 1);
  if (s.group < 1 || s.channels % s.group != 0 || s.maps % s.group != 0 ||
      w[1] != s.channels / s.group || dy.dim(0) != s.batch || dy.dim(1) != s.maps)
    return fail(node, "dY " + dy.describe() + ", X " + shapeString(x) + " and W " + shapeString(w) +
                          " do not fit with group " + Twine(s.group));
  auto window =
      windowOf(node, x.drop_front(2), w.drop_front(2), ArrayRef<int64_t>(dy.shape()).drop_front(2));
  if (!window)
    return window.takeError();
  s.window = *window;
  return s;
}

/// ConvGradInput (dX from dY and W, \p ofInput) or ConvGradWeight (dW from
/// dY and X): per image and group, one GEMM of dY with the other operand,
/// through im2col columns unless the window is the identity. The shape
/// attribute is the result's.
Expected<std::vector<Tensor>> convGrad(const onnx::NodeProto &node, ArrayRef<const Tensor *> inputs,
                                       bool ofInput) {
  const Tensor &dy = *inputs[0], &other = *inputs[1];
  auto shape = shapeAttr(node);
  if (!shape)
    return shape.takeError();
  if (dy.elemType() != other.elemType())
    return fail(node, "dY " + dy.describe() + (ofInput ? " and W " : " and X ") + other.describe() +
                          " differ in type");
  auto s = ofInput ? convShapes(node, dy, *shape, other.shape())
                   : convShapes(node, dy, other.shape(), *shape);
  if (!s)
    return s.takeError();
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    const Window &w = s->window;
    Tensor grad(dy.elemType(), *shape);
    int64_t rows = s->rows(), cols = w.outSize(), gc = s->groupChannels(), gm = s->groupMaps();
    bool identity = w.isIdentity();
    std::vector<T> columns(identity ? 0 : rows * cols);
    for (int64_t n = 0; n < s->batch; ++n)
      for (int64_t g = 0; g < s->group; ++g) {
        int64_t imageAt = (n * s->channels + g * gc) * w.inSize();
        const T *dyg = dy.data<T>() + (n * s->maps + g * gm) * cols;
        if (ofInput) {
          T *image = grad.data<T>() + imageAt;
          // columns = W_g^T dY_g: [rows, gm] x [gm, cols].
          gemm(true, false, rows, cols, gm, T(1), other.data<T>() + g * gm * rows, rows, dyg, cols,
               T(0), identity ? image : columns.data(), cols);
          if (!identity)
            col2im(columns.data(), gc, w, image);
        } else {
          const T *image = other.data<T>() + imageAt;
          if (!identity)
            im2col(image, gc, w, columns.data());
          // dW_g += dY_g columns^T: [gm, cols] x [cols, rows].
          gemm(false, true, gm, rows, cols, T(1), dyg, cols, identity ? image : columns.data(),
               cols, T(1), grad.data<T>() + g * gm * rows, rows);
        }
      }
    return std::vector<Tensor>{grad};
  });
}

/// The window of a pool over \p xShape whose gradient is \p dy.
Expected<Window> poolWindow(const onnx::NodeProto &node, const Tensor &dy,
                            ArrayRef<int64_t> xShape) {
  if (dy.rank() < 3 || int64_t(xShape.size()) != dy.rank() || dy.dim(0) != xShape[0] ||
      dy.dim(1) != xShape[1])
    return fail(node, "dY " + dy.describe() + " does not fit X " + shapeString(xShape));
  const auto *kernel = findAttr(node, "kernel_shape");
  if (!kernel)
    return fail(node, "missing attribute 'kernel_shape'");
  return windowOf(node, xShape.drop_front(2),
                  std::vector<int64_t>(kernel->ints().begin(), kernel->ints().end()),
                  ArrayRef<int64_t>(dy.shape()).drop_front(2));
}

Expected<std::vector<Tensor>> maxPoolGrad(const onnx::NodeProto &node,
                                          ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &x = *inputs[1];
  if (dy.elemType() != x.elemType())
    return fail(node, "dY " + dy.describe() + " and X " + x.describe() + " differ in type");
  auto w = poolWindow(node, dy, x.shape());
  if (!w)
    return w.takeError();
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(dy.elemType(), x.shape());
    int64_t planes = x.dim(0) * x.dim(1), inSize = w->inSize(), outSize = w->outSize();
    std::vector<T> best(outSize);
    std::vector<int64_t> argmax(outSize);
    for (int64_t p = 0; p < planes; ++p) {
      const T *in = x.data<T>() + p * inSize;
      std::fill(argmax.begin(), argmax.end(), -1);
      // The forward kernel's choice: the first strict maximum in window order.
      forEachTap(*w, [&](int64_t, int64_t o, int64_t i, bool) {
        if (i >= 0 && (argmax[o] < 0 || in[i] > best[o])) {
          best[o] = in[i];
          argmax[o] = i;
        }
      });
      const T *grad = dy.data<T>() + p * outSize;
      T *out = dx.data<T>() + p * inSize;
      for (int64_t o = 0; o < outSize; ++o)
        if (argmax[o] >= 0)
          out[argmax[o]] += grad[o];
    }
    return std::vector<Tensor>{dx};
  });
}

Expected<std::vector<Tensor>> averagePoolGrad(const onnx::NodeProto &node,
                                              ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0];
  auto xShape = shapeAttr(node);
  if (!xShape)
    return xShape.takeError();
  auto w = poolWindow(node, dy, *xShape);
  if (!w)
    return w.takeError();
  bool includePad = findAttr(node, "count_include_pad") && findAttr(node, "count_include_pad")->i();
  int64_t outSize = w->outSize(), inSize = w->inSize();
  // Every plane has the same window counts.
  std::vector<int64_t> count(outSize, 0);
  forEachTap(*w, [&](int64_t, int64_t o, int64_t i, bool inPadded) {
    count[o] += includePad ? inPadded : i >= 0;
  });
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(dy.elemType(), *xShape);
    int64_t planes = dx.dim(0) * dx.dim(1);
    for (int64_t p = 0; p < planes; ++p) {
      const T *grad = dy.data<T>() + p * outSize;
      T *out = dx.data<T>() + p * inSize;
      forEachTap(*w, [&](int64_t, int64_t o, int64_t i, bool) {
        if (i >= 0)
          out[i] += grad[o] / static_cast<T>(count[o]);
      });
    }
    return std::vector<Tensor>{dx};
  });
}

Expected<std::vector<Tensor>> batchNormGradWeight(const onnx::NodeProto &node,
                                                  ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &x = *inputs[1], &mean = *inputs[2], &var = *inputs[3];
  if (dy.shape() != x.shape() || dy.elemType() != x.elemType() || x.rank() < 2)
    return fail(node,
                "dY " + dy.describe() + " and X " + x.describe() + " must be alike, of rank >= 2");
  int64_t channels = x.dim(1);
  for (const Tensor *p : {&mean, &var})
    if (p->rank() != 1 || p->dim(0) != channels)
      return fail(node, "mean and variance must have shape [" + Twine(channels) + "], got " +
                            p->describe());
  double epsilon = attrFloat(node, "epsilon", 1e-5);
  int64_t batch = x.dim(0), spatial = numElementsOf(ArrayRef<int64_t>(x.shape()).drop_front(2));
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dscale(dy.elemType(), {channels});
    const T *pd = dy.data<T>(), *px = x.data<T>();
    for (int64_t c = 0; c < channels; ++c) {
      double mu = mean.getDouble(c), acc = 0;
      for (int64_t n = 0; n < batch; ++n) {
        int64_t base = (n * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s)
          acc += double(pd[base + s]) * (double(px[base + s]) - mu);
      }
      dscale.data<T>()[c] = static_cast<T>(acc / std::sqrt(var.getDouble(c) + epsilon));
    }
    return std::vector<Tensor>{dscale};
  });
}

} // namespace

KernelResult sumTo(const OpContext &ctx) {
  const Tensor &dy = ctx.input(0);
  std::optional<std::vector<int64_t>> shape = ctx.attrInts("shape");
  if (!shape)
    return ctx.fail("missing attribute 'shape'");
  auto b = broadcastShapes(*shape, dy.shape());
  if (!b || *b != dy.shape()) {
    if (!b)
      consumeError(b.takeError());
    return ctx.fail(shapeString(*shape) + " does not broadcast to " + dy.describe());
  }
  return std::vector<Tensor>{sumToShape(dy, *shape)};
}

KernelResult unaryGrad(const OpContext &ctx) {
  // The derivative of ElementMath.h, which the fused and device kernels
  // compute too: one formula per op.
  std::string forward = ctx.attrString("op", "");
  const OpDef *def = lookupOp("", forward);
  if (!def || !def->elem || def->minInputs != 1)
    return ctx.fail("'op' must name a unary element-wise op, not '" + forward + "'");
  Expected<kernels::ElemParams> params = ctx.elemParams(*def->elem);
  if (!params)
    return params.takeError();
  ElemOp op = *def->elem;
  kernels::ElemParams p = *params;
  return pointwise(ctx.node, ctx.allInputs(),
                   [&](double a) { return kernels::elemDerivative(op, a, p); });
}

// The gradient kernels above that read only the node and its inputs.
#define PIPEC_NODE_KERNEL(NAME)                                                                    \
  KernelResult NAME(const OpContext &ctx) { return NAME(ctx.node, ctx.allInputs()); }
PIPEC_NODE_KERNEL(softmaxGrad)
PIPEC_NODE_KERNEL(gatherGrad)
PIPEC_NODE_KERNEL(layerNormGradInput)
PIPEC_NODE_KERNEL(layerNormGradWeight)
PIPEC_NODE_KERNEL(maxPoolGrad)
PIPEC_NODE_KERNEL(averagePoolGrad)
PIPEC_NODE_KERNEL(batchNormGradWeight)
PIPEC_NODE_KERNEL(crossEntropyGrad)
#undef PIPEC_NODE_KERNEL

KernelResult convGradInput(const OpContext &ctx) {
  return convGrad(ctx.node, ctx.allInputs(), /*ofInput=*/true);
}
KernelResult convGradWeight(const OpContext &ctx) {
  return convGrad(ctx.node, ctx.allInputs(), /*ofInput=*/false);
}

} // namespace pipec::cpu
