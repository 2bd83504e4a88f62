//===- GradKernels.cpp - CPU kernels for pipec's gradient ops -----------===//
//
// Plain loops over float or double storage; each kernel follows the formula
// in passes/Differentiate.h. The convolution gradients are GEMMs (OpenBLAS,
// through Kernels.h) around im2col and its adjoint col2im (Window.h); the
// pool gradients use the device's bodies (runtime/kernels/ConvBodies.h):
// MaxPoolGrad adds each window's dY at its poolArgmax, as MaxPool picks
// it, and AveragePoolGrad loops around poolGradRun.
//
//===----------------------------------------------------------------------===//

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/cpu/Window.h"
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

/// Calls f(T{}) for float or double tensors (float for bf16 and float16,
/// held as float: runOp rounds what f writes in their type), fails
/// otherwise.
template <typename F>
Expected<std::vector<Tensor>> floating(const onnx::NodeProto &node, const Tensor &t, F &&f) {
  if (storedAs<float>(t.elemType()))
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
    kernels::RowLayout layout{outer, size, inner};
    // Rows are independent: the rank's loop threads take runs of them.
    parallelFor(outer * inner, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        kernels::softmaxGradRow<double>(VectorLanes(), row, layout, dy.data<T>(), y.data<T>(),
                                        dx.data<T>());
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
  for (int64_t i : idx)
    if (i < -size || i >= size)
      return fail(node, "index " + Twine(i) + " out of range [0, " + Twine(size) + ")");
  // kernels::gatherSource over blocks of the inner elements, as Gather's
  // kernel reads them: each block of dY added whole, in order.
  kernels::GatherParams blocks{outer, size, count, 1};
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(dy.elemType(), shape);
    const T *pd = dy.data<T>();
    T *px = dx.data<T>();
    for (int64_t b = 0; b < outer * count; ++b) {
      T *to = px + kernels::gatherSource(b, blocks, idx.data()) * inner;
      for (int64_t in = 0; in < inner; ++in)
        to[in] += pd[b * inner + in];
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
  kernels::CrossEntropyParams p;
  if (const auto *ignoreAttr = findAttr(node, "ignore_index")) {
    p.hasIgnore = true;
    p.ignoreIndex = ignoreAttr->i();
  }
  p.reduction = reduction == "sum" ? 1 : reduction == "none" ? 0 : 2;
  std::vector<int64_t> lab = labels.toInt64Vector();
  for (int64_t label : lab)
    if (!(p.hasIgnore && label == p.ignoreIndex) && (label < 0 || label >= c))
      return fail(node, "label " + Twine(label) + " out of range [0, " + Twine(c) + ")");
  double count;
  kernels::labelCount(kernels::SerialLanes(), n * inner, p, lab.data(), &count);
  kernels::RowLayout layout{n, c, inner};
  return floating(node, scores, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx = Tensor::uninitialized(scores.elemType(), scores.shape()); // every row is written
    T dl = static_cast<T>(dLoss.getDouble(0));
    int flag = 0; // the labels are checked above
    // Rows of classes (a language model's tokens): the rank's loop threads
    // take runs of rows.
    parallelFor(n * inner, 4, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        kernels::crossEntropyGradRow(VectorLanes(), row, layout, p, &dl, &count, scores.data<T>(),
                                     lab.data(), dx.data<T>(), &flag);
    });
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

/// Shared by both LayerNorm gradients: X's rows (the normalised axes) and
/// epsilon, after checking dY against X.
struct LayerNormRows {
  int64_t rows = 0, width = 0;
  double epsilon = 0;
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
  LayerNormRows r;
  r.epsilon = attrFloat(node, "epsilon", 1e-5);
  r.rows = numElementsOf(ArrayRef<int64_t>(x.shape()).take_front(*axis));
  r.width = numElementsOf(ArrayRef<int64_t>(x.shape()).drop_front(*axis));
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
  if (!isFloating(scale.elemType()))
    return fail(node, "scale " + scale.describe() + " is not a float");
  Tensor dx = Tensor::uninitialized(x.elemType(), x.shape()); // every row is written
  std::vector<double> gamma(r->width);
  for (int64_t k = 0; k < r->width; ++k)
    gamma[k] = scale.getDouble(k);
  // kernels::layerNormGradInputRow in double; rows on the loop threads.
  withFloatStorage(x, [&](const auto *xs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
    const T *dys = static_cast<const T *>(dy.rawData());
    T *dxs = static_cast<T *>(dx.rawData());
    parallelFor(r->rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        kernels::layerNormGradInputRow<double>(VectorLanes(), row, r->width, r->epsilon, dys, xs,
                                               gamma.data(), dxs);
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
  std::vector<int64_t> shape{r->width};
  if (const auto *shapeAttr = findAttr(node, "shape"))
    shape.assign(shapeAttr->ints().begin(), shapeAttr->ints().end());
  if (numElementsOf(shape) != r->width)
    return fail(node, "shape " + shapeString(shape) + " does not match X " + x.describe());
  Tensor dscale(x.elemType(), shape);
  // kernels::layerNormStatsRow and layerNormGradWeightTerm in double; the
  // terms summed over rows in row order (the bits do not depend on threads).
  std::vector<double> mean(r->rows), rstd(r->rows), acc(r->width, 0.0);
  withFloatStorage(x, [&](const auto *xs) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xs)>>;
    const T *dys = static_cast<const T *>(dy.rawData());
    parallelFor(r->rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        kernels::layerNormStatsRow<double>(VectorLanes(), row, r->width, r->epsilon, xs,
                                           mean.data(), rstd.data());
    });
    for (int64_t row = 0; row < r->rows; ++row)
      for (int64_t k = 0; k < r->width; ++k)
        acc[k] += kernels::layerNormGradWeightTerm<double>(row * r->width + k, row, dys, xs,
                                                           mean.data(), rstd.data());
  });
  for (int64_t k = 0; k < r->width; ++k)
    dscale.setDouble(k, acc[k]);
  dscale.roundToElemType();
  return std::vector<Tensor>{dscale};
}

//===----------------------------------------------------------------------===//
// Convolution and pooling gradients
//===----------------------------------------------------------------------===//

std::vector<int64_t> intsAttr(const onnx::NodeProto &node, StringRef name,
                              std::vector<int64_t> otherwise) {
  return attrInts(node, name).value_or(std::move(otherwise));
}

/// Reads strides, dilations and pads for a window of \p kernel sliding over
/// \p in to give \p out, and checks that the sizes agree (out as with
/// ceil_mode off or on). The window is padded to three spatial dimensions
/// as the forward kernels pad it; pads are explicit (the differentiate pass
/// resolves auto_pad) and the output sizes are dY's.
Expected<kernels::ConvWindow> windowOf(const onnx::NodeProto &node, ArrayRef<int64_t> in,
                                       ArrayRef<int64_t> kernel, ArrayRef<int64_t> out) {
  size_t rank = in.size();
  if (rank < 1 || rank > 3)
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
  kernels::ConvWindow w;
  if (kernels::makeGradWindow(in.vec(), kernel.vec(), strides, dilations, pads, out.vec(), w))
    return w;
  // Name the first dimension that does not fit.
  for (size_t i = 0; i < rank; ++i) {
    if (kernel[i] < 1 || strides[i] < 1 || dilations[i] < 1 || pads[i] < 0 || pads[rank + i] < 0)
      return fail(node, "kernel, strides and dilations must be positive and pads non-negative");
    if (!kernels::makeGradWindow({in[i]}, {kernel[i]}, {strides[i]}, {dilations[i]},
                                 {pads[i], pads[rank + i]}, {out[i]}, w))
      return fail(node, "output size " + Twine(out[i]) + " does not fit input size " +
                            Twine(in[i]) + " in spatial dimension " + Twine(i));
  }
  return fail(node, "the window does not fit its input and output sizes");
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
  kernels::ConvWindow window;
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
    const kernels::ConvWindow &w = s->window;
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
Expected<kernels::ConvWindow> poolWindow(const onnx::NodeProto &node, const Tensor &dy,
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
    const T *px = x.data<T>(), *pd = dy.data<T>();
    T *out = dx.data<T>();
    // Each window's dY goes to its maximum (kernels::poolArgmax, the forward
    // kernel's choice: the first strict maximum in tap order), the windows
    // in increasing order: per element, the order in which the device's
    // poolGradRun adds them.
    forEachRow(planes, outSize, [&](int64_t plane) {
      T best;
      for (int64_t o = 0; o < outSize; ++o) {
        int64_t at = kernels::poolArgmax(*w, o, px + plane * inSize, best);
        if (at >= 0)
          out[plane * inSize + at] += pd[plane * outSize + o];
      }
    });
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
  kernels::PoolParams p;
  p.w = *w;
  p.isMax = false, p.includePad = includePad;
  return floating(node, dy, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx = Tensor::uninitialized(dy.elemType(), *xShape); // every element is written
    int64_t rowSize = p.w.in[2];
    forEachRow(dx.dim(0) * dx.dim(1) * p.w.in[0] * p.w.in[1], rowSize, [&](int64_t r) {
      kernels::poolGradRun<T>(r * rowSize, rowSize, p, dy.data<T>(), nullptr, dx.data<T>());
    });
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
    std::vector<double> mu(channels), variance(channels), partial(channels);
    for (int64_t c = 0; c < channels; ++c) {
      mu[c] = mean.getDouble(c);
      variance[c] = var.getDouble(c);
    }
    // Each channel's terms added in batch-major order, in one chunk (the
    // device's pass two over one partial sum).
    for (int64_t c = 0; c < channels; ++c) {
      double acc = 0;
      for (int64_t n = 0; n < batch; ++n) {
        int64_t base = (n * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s)
          acc += kernels::batchNormGradWeightTerm(base + s, dy.data<T>(), x.data<T>(), mu[c]);
      }
      partial[c] = acc;
      kernels::batchNormGradWeightFinish(c, 1, epsilon, partial.data(), variance.data(),
                                         dscale.data<T>());
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
