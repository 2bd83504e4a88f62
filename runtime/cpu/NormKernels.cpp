//===- NormKernels.cpp - Softmax, normalization, reductions and losses ------===//
//
// The kernels that reduce along axes: Softmax and LogSoftmax, Layer- and
// BatchNormalization, the Reduce family, ArgMax and ArgMin, and the
// cross-entropy losses. Float sums run in double.
//
//===----------------------------------------------------------------------===//
#include "math/ElementMath.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

using namespace llvm;

namespace pipec::cpu {

PIPEC_VECTOR_CLONES void softmaxRowRange(const float *x, float *y, int64_t size, int64_t begin,
                                         int64_t end, bool logarithm) {
  for (int64_t row = begin; row < end; ++row)
    kernels::softmaxRowAt(VectorLanes(), x + row * size, y + row * size, size, 1, logarithm);
}

namespace {

/// One row of a float LayerNormalization (kernels::layerNormRow in double),
/// compiled for the CPU's vectors.
PIPEC_VECTOR_CLONES void layerNormRow(const float *in, float *out, const float *g, const float *bb,
                                      int64_t size, double epsilon, double &mean, double &invStd) {
  kernels::layerNormRow<double>(VectorLanes(), 0, size, epsilon, in, g, bb, out, &mean, &invStd);
}

/// Softmax or log-softmax of \p x along the middle dimension of \p split:
/// kernels::softmaxRow on each row, the rank's loop threads taking runs of
/// rows. Contiguous float rows take the vector clones.
template <typename T> void softmaxAlong(const T *x, T *y, AxisSplit split, bool logarithm) {
  if constexpr (std::is_same_v<T, float>)
    if (split.inner == 1)
      return parallelFor(split.outer, 16, [&](int64_t begin, int64_t end) {
        softmaxRowRange(x, y, split.size, begin, end, logarithm);
      });
  kernels::RowLayout layout{split.outer, split.size, split.inner};
  parallelFor(kernels::rowCount(layout), 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      kernels::softmaxRow(VectorLanes(), row, layout, x, y, logarithm);
  });
}

} // namespace

/// Softmax and LogSoftmax. Before opset 13 the input is flattened to 2-D at
/// axis (default 1); from 13 on the op runs along the single axis (default -1).
template <bool Logarithm> Expected<Outputs> softmax(const OpContext &ctx) {
  const bool logarithm = Logarithm;
  const Tensor &x = ctx.input(0);
  bool singleAxis = ctx.opset >= 13;
  int64_t rank = x.rank();
  if (rank == 0)
    return ctx.fail("input must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", singleAxis ? -1 : 1), rank);
  if (!axis)
    return axis.takeError();
  AxisSplit split = splitAt(x.shape(), *axis);
  if (!singleAxis)
    split = {split.outer, split.size * split.inner, 1};
  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y = Tensor::uninitialized(x.elemType(), x.shape()); // every row is written
    softmaxAlong(x.data<T>(), y.data<T>(), split, logarithm);
    return Outputs{y};
  });
}

/// LayerNormalization (opset 17): normalizes over dimensions [axis, rank).
/// Outputs Y, Mean and InvStdDev; the last two have the input's shape with
/// the normalized dimensions set to 1.
Expected<Outputs> layerNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  const Tensor *bias = ctx.optInput(2);
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (bias && bias->elemType() != x.elemType())
    return ctx.fail("B must have X's element type");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", -1), x.rank());
  if (!axis)
    return axis.takeError();
  double epsilon = ctx.attrFloat("epsilon", 1e-5f);
  int64_t stashType = ctx.attrInt("stash_type", 1);
  if (stashType != 1 && stashType != 11)
    return ctx.unsupported(formatv("stash_type {0}", stashType));
  Shape normShape(x.shape().begin() + *axis, x.shape().end());
  for (const Tensor *t : {&scale, bias}) {
    if (!t)
      continue;
    Expected<Shape> shape = broadcastShapes(t->shape(), normShape);
    if (!shape || *shape != normShape) {
      consumeError(shape.takeError());
      return ctx.fail(t->describe() + " does not broadcast to the normalized shape " +
                      shapeString(normShape));
    }
  }
  int64_t outer = product(ArrayRef<int64_t>(x.shape()).take_front(*axis));
  int64_t size = product(normShape);
  Shape statShape = x.shape();
  std::fill(statShape.begin() + *axis, statShape.end(), 1);
  DType statType = stashType == 11 ? DType::F64 : DType::F32;
  Tensor meanOut(statType, statShape), invStdOut(statType, statShape);

  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor gamma = expandTo<T>(scale, normShape);
    Tensor beta = bias ? expandTo<T>(*bias, normShape) : Tensor(x.elemType(), normShape);
    Tensor y = Tensor::uninitialized(x.elemType(), x.shape()); // every row is written
    const T *g = gamma.data<T>(), *bb = beta.data<T>();
    parallelFor(outer, 8, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        const T *in = x.data<T>() + o * size;
        T *out = y.data<T>() + o * size;
        double mean, invStd;
        if constexpr (std::is_same_v<T, float>)
          layerNormRow(in, out, g, bb, size, epsilon, mean, invStd);
        else
          kernels::layerNormRow<double>(VectorLanes(), 0, size, epsilon, in, g, bb, out, &mean,
                                        &invStd);
        meanOut.setDouble(o, mean);
        invStdOut.setDouble(o, invStd);
      }
    });
    return Outputs{y, meanOut, invStdOut};
  });
}

/// BatchNormalization. Inference normalizes with the given statistics; with
/// training_mode (opset 14+) it uses the batch's and also returns the updated
/// running mean and variance.
Expected<Outputs> batchNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail("X must have rank >= 2, got " + x.describe());
  if (ctx.opset < 9 && ctx.attrInt("spatial", 1) == 0)
    return ctx.unsupported("spatial = 0 (per-activation statistics)");
  bool training = ctx.opset >= 14 && ctx.attrInt("training_mode", 0);
  if (!training &&
      (ctx.wantsOutput(1) || ctx.wantsOutput(2) || ctx.wantsOutput(3) || ctx.wantsOutput(4)))
    return ctx.unsupported("training outputs without training_mode (opset < 14)");
  int64_t channels = x.dim(1);
  for (size_t i = 1; i <= 4; ++i) {
    const Tensor &p = ctx.input(i);
    if (p.rank() != 1 || p.dim(0) != channels)
      return ctx.fail(
          formatv("input {0} must have shape [{1}], got {2}", i, channels, p.describe()));
    if (!isFloating(p.elemType()))
      return ctx.unsupportedType(p, i);
  }
  double epsilon = ctx.attrFloat("epsilon", 1e-5f), momentum = ctx.attrFloat("momentum", 0.9f);
  int64_t batch = x.dim(0), spatial = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  std::vector<double> mean(channels), var(channels);
  Tensor runningMean(ctx.input(3).elemType(), {channels});
  Tensor runningVar(ctx.input(4).elemType(), {channels});

  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    const T *in = x.data<T>();
    for (int64_t c = 0; c < channels; ++c) {
      if (!training) {
        mean[c] = ctx.input(3).getDouble(c);
        var[c] = ctx.input(4).getDouble(c);
        continue;
      }
      double sum = 0, sumSq = 0;
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t s = 0; s < spatial; ++s)
          sum += in[(n * channels + c) * spatial + s];
      double count = double(batch * spatial);
      mean[c] = sum / count;
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t s = 0; s < spatial; ++s) {
          double d = in[(n * channels + c) * spatial + s] - mean[c];
          sumSq += d * d;
        }
      var[c] = sumSq / count;
      runningMean.setDouble(c, ctx.input(3).getDouble(c) * momentum + mean[c] * (1 - momentum));
      runningVar.setDouble(c, ctx.input(4).getDouble(c) * momentum + var[c] * (1 - momentum));
    }
    Tensor y = Tensor::uninitialized(x.elemType(), x.shape()); // every element is written
    T *out = y.data<T>();
    std::vector<double> scale(channels), bias(channels);
    for (int64_t c = 0; c < channels; ++c) {
      scale[c] = ctx.input(1).getDouble(c);
      bias[c] = ctx.input(2).getDouble(c);
    }
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t c = 0; c < channels; ++c) {
        kernels::BatchNormAffine a = kernels::batchNormAffine(c, epsilon, scale.data(), bias.data(),
                                                              mean.data(), var.data());
        int64_t base = (n * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s)
          out[base + s] = kernels::batchNormApply(in[base + s], a);
      }
    if (training)
      return Outputs{y, runningMean, runningVar};
    return Outputs{y};
  });
}

namespace {

/// The Reduce kinds that sum (Sum, Mean, SumSquare, L2) over a float
/// tensor: kernels::reducePartialElement with one chunk per output (the
/// elements added in row-major order, in double), then
/// kernels::reduceFinishElement, outputs on the loop threads. False when the
/// walk needs more dimensions than an IndexMap has.
template <typename T>
bool sumByPlan(const Tensor &x, const std::vector<bool> &reduced, ReduceKind kind, T *out) {
  kernels::ReducePlan plan;
  if (!kernels::makeReducePlan(std::vector<int64_t>(x.shape().begin(), x.shape().end()), reduced,
                               plan))
    return false;
  plan.chunks = 1;
  plan.chunkLength = plan.count;
  plan.squares = kind == ReduceKind::SumSquare || kind == ReduceKind::L2;
  // A mean over no elements is 0 / 0, NaN.
  double divisor = kind == ReduceKind::Mean ? static_cast<double>(plan.count) : 1.0;
  std::vector<double> partial(plan.outputs);
  const T *in = x.data<T>();
  int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, plan.count));
  parallelFor(plan.outputs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      kernels::reducePartialElement(o, plan, in, partial.data());
      if (kind == ReduceKind::L2)
        out[o] = static_cast<T>(std::sqrt(partial[o]));
      else
        kernels::reduceFinishElement(o, plan.outputs, 1, partial.data(), divisor, out);
    }
  });
  return true;
}

} // namespace

/// The Reduce* family. Axes come from input 1 (ReduceSum from opset 13) or
/// the axes attribute; no axes means all, unless noop_with_empty_axes.
template <ReduceKind Kind> Expected<Outputs> reduce(const OpContext &ctx) {
  const ReduceKind kind = Kind;
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  bool keepDims = ctx.attrInt("keepdims", 1);
  if (!axes || axes->empty()) {
    if (ctx.attrInt("noop_with_empty_axes", 0))
      return Outputs{x};
    axes.emplace(x.rank());
    std::iota(axes->begin(), axes->end(), 0);
  }
  std::vector<bool> reduced(x.rank(), false);
  for (int64_t a : *axes) {
    Expected<int64_t> axis = ctx.normalizeAxis(a, x.rank());
    if (!axis)
      return axis.takeError();
    reduced[*axis] = true;
  }
  Shape keptShape = x.shape(), outShape;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (reduced[i])
      keptShape[i] = 1;
    if (!reduced[i] || keepDims)
      outShape.push_back(keptShape[i]);
  }
  Shape accStrides = broadcastStrides(keptShape, x.shape());
  int64_t outCount = product(keptShape);
  int64_t perOutput = outCount ? x.numElements() / outCount : 0;

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      // Opset 20 orders booleans: the largest is any, the smallest all (an
      // empty set gives false and true).
      if (kind != ReduceKind::Max && kind != ReduceKind::Min)
        return ctx.unsupportedType(x, 0);
      const T *in = x.data<T>();
      bool any = kind == ReduceKind::Max;
      std::vector<char> acc(outCount, any ? 0 : 1);
      forEachStrided<1>(x.shape(), {accStrides}, [&](int64_t i, const std::array<int64_t, 1> &off) {
        bool v = static_cast<bool>(in[i]);
        acc[off[0]] = any ? (acc[off[0]] || v) : (acc[off[0]] && v);
      });
      Tensor out(x.elemType(), outShape);
      T *po = out.data<T>();
      for (int64_t o = 0; o < outCount; ++o)
        po[o] = static_cast<T>(acc[o] != 0);
      return Outputs{out};
    } else {
      // Floats accumulate in double, integers in 64-bit integers.
      using Acc = std::conditional_t<isFloat<T>, double,
                                     std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>>;
      const T *in = x.data<T>();
      Acc init = 0;
      if (kind == ReduceKind::Prod)
        init = 1;
      else if (kind == ReduceKind::Max)
        init = isFloat<T> ? -std::numeric_limits<Acc>::infinity()
                          : static_cast<Acc>(std::numeric_limits<T>::lowest());
      else if (kind == ReduceKind::Min)
        init = isFloat<T> ? std::numeric_limits<Acc>::infinity()
                          : static_cast<Acc>(std::numeric_limits<T>::max());
      bool sums = kind == ReduceKind::Sum || kind == ReduceKind::Mean ||
                  kind == ReduceKind::SumSquare || kind == ReduceKind::L2;
      if constexpr (isFloat<T>)
        if (sums) {
          Tensor out = Tensor::uninitialized(x.elemType(), outShape); // every element is written
          if (sumByPlan(x, reduced, kind, out.data<T>()))
            return Outputs{out};
        }
      std::vector<Acc> acc(outCount, init);
      std::vector<double> shift;
      auto walk = [&](auto &&fn) {
        forEachStrided<1>(x.shape(), {accStrides},
                          [&](int64_t i, const std::array<int64_t, 1> &off) { fn(in[i], off[0]); });
      };
      switch (kind) {
      case ReduceKind::Sum:
      case ReduceKind::Mean:
        walk([&](T v, int64_t o) { acc[o] += v; });
        break;
      case ReduceKind::Max:
        walk([&](T v, int64_t o) { acc[o] = kernels::elem::Max::value<Acc>(acc[o], v); });
        break;
      case ReduceKind::Min:
        walk([&](T v, int64_t o) { acc[o] = kernels::elem::Min::value<Acc>(acc[o], v); });
        break;
      case ReduceKind::Prod:
        walk([&](T v, int64_t o) { acc[o] *= v; });
        break;
      case ReduceKind::L1:
        walk([&](T v, int64_t o) { acc[o] += v < 0 ? Acc(0) - Acc(v) : Acc(v); });
        break;
      case ReduceKind::L2:
      case ReduceKind::SumSquare:
        walk([&](T v, int64_t o) { acc[o] += Acc(v) * Acc(v); });
        break;
      case ReduceKind::LogSum:
        walk([&](T v, int64_t o) { acc[o] += v; });
        break;
      case ReduceKind::LogSumExp: {
        // Subtract each output's maximum before exponentiating.
        shift.assign(outCount, -std::numeric_limits<double>::infinity());
        walk([&](T v, int64_t o) { shift[o] = std::max(shift[o], double(v)); });
        std::vector<double> sums(outCount, 0);
        walk([&](T v, int64_t o) { sums[o] += std::exp(double(v) - shift[o]); });
        for (int64_t o = 0; o < outCount; ++o)
          acc[o] = static_cast<Acc>(std::log(sums[o]) + shift[o]);
        break;
      }
      }
      Tensor out(x.elemType(), outShape);
      T *po = out.data<T>();
      for (int64_t o = 0; o < outCount; ++o) {
        double v = static_cast<double>(acc[o]);
        switch (kind) {
        case ReduceKind::Mean:
          if constexpr (isFloat<T>)
            v = perOutput ? v / perOutput : std::numeric_limits<double>::quiet_NaN();
          else
            v = perOutput ? static_cast<double>(acc[o] / static_cast<Acc>(perOutput)) : 0;
          break;
        case ReduceKind::L2:
          v = std::sqrt(v);
          break;
        case ReduceKind::LogSum:
          v = std::log(v);
          break;
        default:
          break;
        }
        if constexpr (isFloat<T>)
          po[o] = static_cast<T>(v);
        else if (kind == ReduceKind::Mean || kind == ReduceKind::L2 || kind == ReduceKind::LogSum)
          po[o] = saturatingCast<T>(v);
        else
          po[o] = static_cast<T>(acc[o]);
      }
      return Outputs{out};
    }
  });
}

/// ArgMax and ArgMin: int64 indices along one axis; ties go to the first
/// index, or the last with select_last_index.
template <bool IsMax> Expected<Outputs> argExtreme(const OpContext &ctx) {
  const bool isMax = IsMax;
  const Tensor &x = ctx.input(0);
  if (x.rank() == 0)
    return ctx.fail("input must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), x.rank());
  if (!axis)
    return axis.takeError();
  bool keepDims = ctx.attrInt("keepdims", 1), last = ctx.attrInt("select_last_index", 0);
  AxisSplit split = splitAt(x.shape(), *axis);
  if (split.size == 0)
    return ctx.fail("cannot take an index along an empty axis");
  Shape outShape = x.shape();
  if (keepDims)
    outShape[*axis] = 1;
  else
    outShape.erase(outShape.begin() + *axis);
  Tensor out(DType::I64, outShape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *in = x.data<T>();
    int64_t *po = out.data<int64_t>();
    for (int64_t o = 0; o < split.outer; ++o)
      for (int64_t i = 0; i < split.inner; ++i) {
        const T *row = in + o * split.size * split.inner + i;
        int64_t best = 0;
        for (int64_t j = 1; j < split.size; ++j) {
          T v = row[j * split.inner], b = row[best * split.inner];
          bool better = isMax ? b < v : v < b;
          if (better || (last && v == b))
            best = j;
        }
        po[o * split.inner + i] = best;
      }
  });
  return Outputs{out};
}

namespace {

/// Negative log-likelihood of \p labels under \p logProb [N, C, D...], with
/// optional class weights, ignore_index and reduction none, sum or mean (mean
/// divides by the total weight of the labels that are not ignored).
template <typename T>
Expected<Tensor> negativeLogLikelihood(const OpContext &ctx, const Tensor &logProb,
                                       const Tensor &labels, const Tensor *weights) {
  ArrayRef<int64_t> shape = logProb.shape();
  if (shape.size() < 2)
    return ctx.fail("scores must have rank >= 2, got " + logProb.describe());
  Shape labelShape{shape[0]};
  labelShape.insert(labelShape.end(), shape.begin() + 2, shape.end());
  if (labels.shape() != labelShape || !isInteger(labels.elemType()))
    return ctx.fail("labels must be integers of shape " + shapeString(labelShape) + ", got " +
                    labels.describe());
  int64_t batch = shape[0], classes = shape[1], inner = product(shape.drop_front(2));
  if (weights && (weights->elemType() != logProb.elemType() || weights->rank() != 1 ||
                  weights->dim(0) != classes))
    return ctx.fail("weights must be " + elemTypeName(logProb.elemType()) + "[" + Twine(classes) +
                    "], got " + weights->describe());
  std::string reduction = ctx.attrString("reduction", "mean");
  if (reduction != "none" && reduction != "sum" && reduction != "mean")
    return ctx.fail("unknown reduction '" + reduction + "'");
  const auto *ignoreAttr = ctx.attr("ignore_index");
  const T *lp = logProb.data<T>();
  Tensor losses(logProb.elemType(), labelShape);
  // A position's weight: its class's, 1 without weights, 0 when ignored.
  std::vector<T> weight(batch * inner, T(0));
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t d = 0; d < inner; ++d) {
      int64_t i = n * inner + d, label = labels.getInt64(i);
      if (ignoreAttr && label == ignoreAttr->i())
        continue;
      if (label < 0 || label >= classes)
        return ctx.fail(formatv("label {0} is out of range for {1} classes", label, classes));
      weight[i] = weights ? weights->data<T>()[label] : T(1);
      double loss = -double(lp[(n * classes + label) * inner + d]) * double(weight[i]);
      losses.data<T>()[i] = static_cast<T>(loss);
    }
  if (reduction == "none")
    return losses;
  T total;
  kernels::crossEntropyFinish(kernels::SerialLanes(), batch * inner, reduction == "mean",
                              losses.data<T>(), weight.data(), &total);
  return Tensor::scalar(total, logProb.elemType());
}

} // namespace

/// SoftmaxCrossEntropyLoss: log-softmax over the class dimension, then
/// negative log-likelihood. Outputs the loss and, if asked, the log-probs.
Expected<Outputs> softmaxCrossEntropy(const OpContext &ctx) {
  const Tensor &scores = ctx.input(0);
  if (scores.rank() < 2)
    return ctx.fail("scores must have rank >= 2, got " + scores.describe());
  return onFloat(ctx, scores, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor logProb(scores.elemType(), scores.shape());
    softmaxAlong(scores.data<T>(), logProb.data<T>(), splitAt(scores.shape(), 1), true);
    // A half-precision log_prob output is what the loss must be computed from.
    logProb.roundToElemType();
    Expected<Tensor> loss = negativeLogLikelihood<T>(ctx, logProb, ctx.input(1), ctx.optInput(2));
    if (!loss)
      return loss.takeError();
    return Outputs{*loss, logProb};
  });
}

Expected<Outputs> negativeLogLikelihoodLoss(const OpContext &ctx) {
  const Tensor &input = ctx.input(0);
  return onFloat(ctx, input, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Expected<Tensor> loss = negativeLogLikelihood<T>(ctx, input, ctx.input(1), ctx.optInput(2));
    if (!loss)
      return loss.takeError();
    return Outputs{*loss};
  });
}

template Expected<Outputs> softmax<true>(const OpContext &);
template Expected<Outputs> softmax<false>(const OpContext &);
template Expected<Outputs> argExtreme<true>(const OpContext &);
template Expected<Outputs> argExtreme<false>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::Sum>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::Mean>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::Max>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::Min>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::Prod>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::L1>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::L2>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::LogSum>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::LogSumExp>(const OpContext &);
template Expected<Outputs> reduce<ReduceKind::SumSquare>(const OpContext &);

} // namespace pipec::cpu
