//===- GradKernels.cpp - CPU kernels for pipec's gradient ops -----------===//
//
// Plain loops over float or double storage; each kernel follows the formula
// in passes/Differentiate.h.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/GradKernels.h"

#include "runtime/cpu/Kernels.h"

#include "onnx/onnx_pb.h"

#include <cmath>

using namespace llvm;

namespace pipec::cpu {
namespace {

const onnx::AttributeProto *attr(const onnx::NodeProto &node, StringRef name) {
  for (const auto &a : node.attribute())
    if (a.name() == name)
      return &a;
  return nullptr;
}

Error fail(const onnx::NodeProto &node, const Twine &what) {
  return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s", nodeLabel(node).c_str(),
                           node.op_type().c_str(), what.str().c_str());
}

/// Calls f(T{}) for float or double tensors, fails otherwise.
template <typename F>
Expected<std::vector<Tensor>> floating(const onnx::NodeProto &node, const Tensor &t, F &&f) {
  if (t.elemType() == ElemType::Float)
    return f(float{});
  if (t.elemType() == ElemType::Double)
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
  int64_t axis = attr(node, "axis") ? attr(node, "axis")->i() : -1;
  if (axis < 0)
    axis += y.rank();
  if (axis < 0 || axis >= y.rank())
    return fail(node, "axis out of range for " + y.describe());
  int64_t outer, size, inner;
  splitAt(y.shape(), axis, outer, size, inner);
  return floating(node, y, [&](auto tag) -> Expected<std::vector<Tensor>> {
    using T = decltype(tag);
    Tensor dx(y.elemType(), y.shape());
    const T *pd = dy.data<T>(), *py = y.data<T>();
    T *px = dx.data<T>();
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t in = 0; in < inner; ++in) {
        int64_t base = o * size * inner + in;
        double dot = 0;
        for (int64_t k = 0; k < size; ++k)
          dot += double(pd[base + k * inner]) * double(py[base + k * inner]);
        for (int64_t k = 0; k < size; ++k) {
          int64_t i = base + k * inner;
          px[i] = static_cast<T>(double(py[i]) * (double(pd[i]) - dot));
        }
      }
    return std::vector<Tensor>{dx};
  });
}

Expected<std::vector<Tensor>> gatherGrad(const onnx::NodeProto &node,
                                         ArrayRef<const Tensor *> inputs) {
  const Tensor &dy = *inputs[0], &indices = *inputs[1];
  const auto *shapeAttr = attr(node, "shape");
  if (!shapeAttr)
    return fail(node, "missing attribute 'shape'");
  std::vector<int64_t> shape(shapeAttr->ints().begin(), shapeAttr->ints().end());
  int64_t rank = static_cast<int64_t>(shape.size());
  int64_t axis = attr(node, "axis") ? attr(node, "axis")->i() : 0;
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
  std::string reduction = attr(node, "reduction") ? attr(node, "reduction")->s() : "mean";
  const auto *ignoreAttr = attr(node, "ignore_index");
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
  int64_t axis = attr(node, "axis") ? attr(node, "axis")->i() : -1;
  if (axis < 0)
    axis += x.rank();
  if (axis < 0 || axis >= x.rank())
    return fail(node, "axis out of range for " + x.describe());
  double epsilon = attr(node, "epsilon") ? attr(node, "epsilon")->f() : 1e-5;
  LayerNormRows r;
  r.rows = numElementsOf(ArrayRef<int64_t>(x.shape()).take_front(axis));
  r.width = numElementsOf(ArrayRef<int64_t>(x.shape()).drop_front(axis));
  r.mean.resize(r.rows);
  r.rstd.resize(r.rows);
  for (int64_t row = 0; row < r.rows; ++row) {
    double sum = 0, sq = 0;
    for (int64_t k = 0; k < r.width; ++k)
      sum += x.getDouble(row * r.width + k);
    double mean = sum / double(r.width);
    for (int64_t k = 0; k < r.width; ++k) {
      double d = x.getDouble(row * r.width + k) - mean;
      sq += d * d;
    }
    r.mean[row] = mean;
    r.rstd[row] = 1.0 / std::sqrt(sq / double(r.width) + epsilon);
  }
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
  Tensor dx(x.elemType(), x.shape());
  std::vector<double> g(r->width), xh(r->width);
  for (int64_t row = 0; row < r->rows; ++row) {
    double meanG = 0, meanGX = 0;
    for (int64_t k = 0; k < r->width; ++k) {
      int64_t i = row * r->width + k;
      xh[k] = (x.getDouble(i) - r->mean[row]) * r->rstd[row];
      g[k] = dy.getDouble(i) * scale.getDouble(k);
      meanG += g[k];
      meanGX += g[k] * xh[k];
    }
    meanG /= double(r->width);
    meanGX /= double(r->width);
    for (int64_t k = 0; k < r->width; ++k)
      dx.setDouble(row * r->width + k, r->rstd[row] * (g[k] - meanG - xh[k] * meanGX));
  }
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
  if (const auto *shapeAttr = attr(node, "shape"))
    shape.assign(shapeAttr->ints().begin(), shapeAttr->ints().end());
  if (numElementsOf(shape) != r->width)
    return fail(node, "shape " + shapeString(shape) + " does not match X " + x.describe());
  Tensor dscale(x.elemType(), shape);
  std::vector<double> acc(r->width, 0.0);
  for (int64_t row = 0; row < r->rows; ++row)
    for (int64_t k = 0; k < r->width; ++k) {
      int64_t i = row * r->width + k;
      acc[k] += dy.getDouble(i) * (x.getDouble(i) - r->mean[row]) * r->rstd[row];
    }
  for (int64_t k = 0; k < r->width; ++k)
    dscale.setDouble(k, acc[k]);
  dscale.roundToElemType();
  return std::vector<Tensor>{dscale};
}

} // namespace

bool isGradOpSupported(StringRef opType) {
  return opType == "SumTo" || opType == "ReluGrad" || opType == "TanhGrad" ||
         opType == "SigmoidGrad" || opType == "ErfGrad" || opType == "SoftmaxGrad" ||
         opType == "GatherGrad" || opType == "SoftmaxCrossEntropyLossGrad" ||
         opType == "LayerNormGradInput" || opType == "GeluGrad" || opType == "LayerNormGradWeight";
}

Expected<std::vector<Tensor>> runGradOp(const onnx::NodeProto &node,
                                        ArrayRef<const Tensor *> inputs) {
  StringRef t = node.op_type();
  auto need = [&](size_t n) -> Error {
    if (inputs.size() < n)
      return fail(node, "expects " + Twine(n) + " inputs, got " + Twine(inputs.size()));
    for (size_t i = 0; i < n; ++i)
      if (!inputs[i] || inputs[i]->isNull())
        return fail(node, "input " + Twine(i) + " is missing");
    return Error::success();
  };
  if (t == "SumTo") {
    if (Error err = need(1))
      return err;
    const auto *shapeAttr = attr(node, "shape");
    if (!shapeAttr)
      return fail(node, "missing attribute 'shape'");
    std::vector<int64_t> shape(shapeAttr->ints().begin(), shapeAttr->ints().end());
    auto b = broadcastShapes(shape, inputs[0]->shape());
    if (!b || *b != inputs[0]->shape()) {
      if (!b)
        consumeError(b.takeError());
      return fail(node, shapeString(shape) + " does not broadcast to " + inputs[0]->describe());
    }
    return std::vector<Tensor>{sumToShape(*inputs[0], shape)};
  }
  if (t == "ReluGrad" || t == "TanhGrad" || t == "SigmoidGrad" || t == "ErfGrad") {
    if (Error err = need(2))
      return err;
    if (t == "ReluGrad")
      return pointwise(node, inputs, [](double x) { return x > 0 ? 1.0 : 0.0; });
    if (t == "TanhGrad")
      return pointwise(node, inputs, [](double y) { return 1.0 - y * y; });
    if (t == "SigmoidGrad")
      return pointwise(node, inputs, [](double y) { return y * (1.0 - y); });
    return pointwise(node, inputs,
                     [](double x) { return 2.0 / std::sqrt(M_PI) * std::exp(-x * x); });
  }
  if (t == "GeluGrad") {
    if (Error err = need(2))
      return err;
    std::string approximate = attr(node, "approximate") ? attr(node, "approximate")->s() : "none";
    if (approximate == "tanh")
      return pointwise(node, inputs, [](double x) {
        const double c = std::sqrt(2.0 / M_PI), k = 0.044715;
        double t = std::tanh(c * (x + k * x * x * x));
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x);
      });
    if (approximate != "none")
      return fail(node, "approximate '" + approximate + "' is not 'none' or 'tanh'");
    return pointwise(node, inputs, [](double x) {
      return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) +
             x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    });
  }
  if (t == "SoftmaxGrad") {
    if (Error err = need(2))
      return err;
    return softmaxGrad(node, inputs);
  }
  if (t == "GatherGrad") {
    if (Error err = need(2))
      return err;
    return gatherGrad(node, inputs);
  }
  if (t == "LayerNormGradInput") {
    if (Error err = need(3))
      return err;
    return layerNormGradInput(node, inputs);
  }
  if (t == "LayerNormGradWeight") {
    if (Error err = need(2))
      return err;
    return layerNormGradWeight(node, inputs);
  }
  if (t == "SoftmaxCrossEntropyLossGrad") {
    if (Error err = need(3))
      return err;
    return crossEntropyGrad(node, inputs);
  }
  return make_error<UnsupportedError>(nodeLabel(node), node.op_type(), "no pipec gradient kernel");
}

Expected<std::vector<Tensor>> runAnyOp(const onnx::NodeProto &node, int64_t opset,
                                       ArrayRef<const Tensor *> inputs) {
  if (node.domain() == "pipec")
    return runGradOp(node, inputs);
  return runOp(node, opset, inputs);
}

} // namespace pipec::cpu
