//===- KernelBodies.h - Per-element bodies of the CPU and device kernels -===//
//
// Every CUDA kernel of CudaKernels.cu is a loop around one function of this
// header, of ConvBodies.h or of Elementwise.h: the function computes one
// output element (or one row, or one partial sum) from its index and a
// parameter struct. The functions compile for the device under nvcc and for
// the host everywhere else, and the CPU kernels of the same ops loop around
// them too: each op's arithmetic is written once. Where the two differ, it
// is in a template argument: the Lanes policy, and the type Acc that a row's
// element-wise arithmetic runs in (the CPU's double, the device's float).
// tests/KernelBodiesTest.cpp runs the device's configuration on the host
// against the CPU kernels, so a device run adds only the launch and the warp
// reductions.
//
// Row functions take a Lanes policy (StridedLanes below): the CPU's
// VectorLanes (one thread walks the row, sums over eight fixed lanes),
// SerialLanes (one thread, in order), or the device's WarpLanes (32 lanes
// stride the row and combine with shuffles). A row function is called by
// every lane of its group with the same row, so its branches on the row are
// uniform and every lane reaches every reduction.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_KERNELBODIES_H
#define PIPEC_RUNTIME_KERNELS_KERNELBODIES_H

#include "runtime/kernels/ConvBodies.h"
#include "runtime/kernels/Elementwise.h"
#include "runtime/kernels/IndexMap.h"

#include <cstdint>
#include <limits>
#include <math.h>
#include <type_traits>
#include <vector>

namespace pipec::kernels {

//===----------------------------------------------------------------------===//
// Gather and its gradient
//===----------------------------------------------------------------------===//

/// Data [outer, size, inner] indexed along the middle dimension by `count`
/// indices: out [outer, count, inner].
struct GatherParams {
  int64_t outer = 1, size = 1, count = 0, inner = 1;
};

/// The data element output element \p o reads, or -1 for an index outside
/// [-size, size).
template <typename I>
PIPEC_HD int64_t gatherSource(int64_t o, const GatherParams &p, const I *indices) {
  int64_t in = o % p.inner, rest = o / p.inner;
  int64_t j = rest % p.count, outer = rest / p.count;
  int64_t k = static_cast<int64_t>(indices[j]);
  if (k < 0)
    k += p.size;
  if (k < 0 || k >= p.size)
    return -1;
  return (outer * p.size + k) * p.inner + in;
}

/// One output element; an index outside [-size, size) sets *flag and gives 0.
template <typename T, typename I>
PIPEC_HD void gatherElement(int64_t o, const GatherParams &p, const T *data, const I *indices,
                            T *out, int *flag) {
  int64_t source = gatherSource(o, p, indices);
  if (source < 0) {
    *flag = 1;
    out[o] = T(0);
    return;
  }
  out[o] = data[source];
}

/// *target += value, atomically on the device (float and double).
template <typename T> PIPEC_HD void atomicAddTo(T *target, T value) {
#if defined(__CUDA_ARCH__)
  atomicAdd(target, value);
#else
  *target += value;
#endif
}

/// Adds dY element \p i into dData (zeroed first) at its index; the CPU
/// walks i in order, so each element's terms add in index order.
template <typename T, typename I>
PIPEC_HD void gatherGradElement(int64_t i, const GatherParams &p, const T *dy, const I *indices,
                                T *dx, int *flag) {
  int64_t target = gatherSource(i, p, indices);
  if (target < 0) {
    *flag = 1;
    return;
  }
  atomicAddTo(dx + target, dy[i]);
}

//===----------------------------------------------------------------------===//
// Reductions (ReduceSum, ReduceMean, SumTo)
//===----------------------------------------------------------------------===//

/// A sum over some dimensions in two passes. Pass one: partial sum t covers
/// output o and chunk c of the reduced elements (interleaved: elements c,
/// c + chunks, ...; else the contiguous range [c * chunkLength, ...)), so
/// neighbouring threads read neighbouring memory whether the reduced
/// dimensions are innermost or not. Pass two adds each output's chunks in
/// order (deterministic) and divides (by the count for a mean). The CPU
/// runs one chunk per output: its sums add the elements in row-major order.
struct ReducePlan {
  IndexMap kept;    ///< output index -> input offset of its first element
  IndexMap reduced; ///< reduced index -> offset from there
  int64_t outputs = 0, count = 0, chunks = 1, chunkLength = 0;
  bool interleaved = false;
  bool squares = false; ///< sum the squares (ReduceSumSquare, ReduceL2)
};

/// The plan summing a tensor of \p shape over the dimensions marked in
/// \p reduced, outputs in row-major order of the kept dimensions. False when
/// the walks need more than MaxRank dimensions.
inline bool makeReducePlan(const std::vector<int64_t> &shape, const std::vector<bool> &reduced,
                           ReducePlan &plan, int64_t targetThreads = 1 << 17) {
  plan = ReducePlan();
  std::vector<int64_t> strides = contiguousStrides(shape);
  std::vector<int64_t> keptShape, keptStrides, redShape, redStrides;
  plan.outputs = plan.count = 1;
  int64_t innermost = -1; // the last dimension of size > 1
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1)
      innermost = static_cast<int64_t>(d);
    if (reduced[d]) {
      redShape.push_back(shape[d]);
      redStrides.push_back(strides[d]);
      plan.count *= shape[d];
    } else {
      keptShape.push_back(shape[d]);
      keptStrides.push_back(strides[d]);
      plan.outputs *= shape[d];
    }
  }
  if (!makeIndexMap(keptShape, {keptStrides}, plan.kept) ||
      !makeIndexMap(redShape, {redStrides}, plan.reduced))
    return false;
  plan.interleaved = innermost >= 0 && reduced[innermost];
  // Enough partial sums to fill the device, each over >= 32 elements.
  int64_t wanted = plan.outputs > 0 ? targetThreads / plan.outputs : 1;
  int64_t most = (plan.count + 31) / 32;
  plan.chunks = wanted < 1 ? 1 : (wanted < most ? wanted : most);
  if (plan.chunks < 1)
    plan.chunks = 1;
  plan.chunkLength = (plan.count + plan.chunks - 1) / plan.chunks;
  return true;
}

/// Pass one: partial[c * outputs + o] for t in [0, outputs * chunks).
template <typename T>
PIPEC_HD void reducePartialElement(int64_t t, const ReducePlan &p, const T *in, double *partial) {
  int64_t o, c;
  if (p.interleaved) {
    o = t / p.chunks;
    c = t % p.chunks;
  } else {
    c = t / p.outputs;
    o = t % p.outputs;
  }
  const T *base = in + offsetOf(p.kept, 0, o);
  auto term = [&](int64_t r) {
    double v = static_cast<double>(base[offsetOf(p.reduced, 0, r)]);
    return p.squares ? v * v : v;
  };
  double acc = 0;
  if (p.interleaved) {
    for (int64_t r = c; r < p.count; r += p.chunks)
      acc += term(r);
  } else {
    int64_t end = (c + 1) * p.chunkLength < p.count ? (c + 1) * p.chunkLength : p.count;
    for (int64_t r = c * p.chunkLength; r < end; ++r)
      acc += term(r);
  }
  partial[c * p.outputs + o] = acc;
}

/// Pass two: out[o] = the sum over chunks / divisor (1 for a sum).
template <typename T>
PIPEC_HD void reduceFinishElement(int64_t o, int64_t outputs, int64_t chunks, const double *partial,
                                  double divisor, T *out) {
  double acc = 0;
  for (int64_t c = 0; c < chunks; ++c)
    acc += partial[c * outputs + o];
  out[o] = static_cast<T>(acc / divisor);
}

//===----------------------------------------------------------------------===//
// Rows: softmax, layer normalization, cross-entropy and their gradients
//===----------------------------------------------------------------------===//

/// A row function's lanes walk the row's elements j in [0, n) between them.
/// The policy gives the walks and the reductions:
///   forEach(n, f)      f(j) for the lane's own elements;
///   sumOf(n, term)     the sum of term(j) over every lane, in double;
///   maxOf<T>(n, term)  the largest term(j) over every lane (NaN skipped);
///   leader()           true in one lane, the one that writes the row's
///                      scalars.
/// StridedLanes derives them from lane(), count() and the combining sum()
/// and max() (lane l takes l, l + count, ...): SerialLanes and the device's
/// WarpLanes. The CPU's VectorLanes (runtime/cpu/KernelSupport.h) walks the
/// row in one thread and sums over eight fixed lanes, so that its loops
/// vectorise with the bits fixed. An element a lane writes in forEach is
/// read back by the same lane in the next walk.
template <typename Self> struct StridedLanes {
  template <typename F> PIPEC_HD void forEach(int64_t n, F f) const {
    for (int64_t j = self().lane(); j < n; j += self().count())
      f(j);
  }
  template <typename F> PIPEC_HD double sumOf(int64_t n, F term) const {
    double acc = 0;
    for (int64_t j = self().lane(); j < n; j += self().count())
      acc += static_cast<double>(term(j));
    return self().sum(acc);
  }
  template <typename T, typename F> PIPEC_HD T maxOf(int64_t n, F term) const {
    T best = -static_cast<T>(INFINITY);
    for (int64_t j = self().lane(); j < n; j += self().count()) {
      T v = term(j);
      best = v > best ? v : best;
    }
    return self().max(best);
  }
  PIPEC_HD bool leader() const { return self().lane() == 0; }

private:
  PIPEC_HD const Self &self() const { return static_cast<const Self &>(*this); }
};

/// One thread per row.
struct SerialLanes : StridedLanes<SerialLanes> {
  PIPEC_HD int lane() const { return 0; }
  PIPEC_HD int count() const { return 1; }
  PIPEC_HD double sum(double v) const { return v; }
  template <typename T> PIPEC_HD T max(T v) const { return v; }
};

/// A tensor viewed as rows along one axis: [outer, size, inner] with rows
/// (outer, inner) of `size` elements `inner` apart.
struct RowLayout {
  int64_t outer = 1, size = 1, inner = 1;
};

PIPEC_HD int64_t rowCount(const RowLayout &l) { return l.outer * l.inner; }
PIPEC_HD int64_t rowBase(const RowLayout &l, int64_t row) {
  return (row / l.inner) * l.size * l.inner + row % l.inner;
}

/// A row's largest element and the log of the sum of exp(x - largest), the
/// exponentials in T and their sum in double (a 50k-wide row loses digits in
/// float).
template <typename T> struct LogSumExp { T maxValue, logSum; };

template <typename L, typename T>
PIPEC_HD_INLINE LogSumExp<T> logSumExp(const L &lanes, const T *in, int64_t size, int64_t step) {
  T maxValue = lanes.template maxOf<T>(size, [&](int64_t j) { return in[j * step]; });
  double sum = lanes.sumOf(size, [&](int64_t j) { return math::exp(in[j * step] - maxValue); });
  return {maxValue, static_cast<T>(log(sum))};
}

/// Softmax (or log-softmax) of the row at \p in, \p size elements \p step
/// apart, into \p out (which may be \p in for softmax): the exponentials in
/// T, written to out, their sum in double, then one scale in T.
template <typename L, typename T>
PIPEC_HD_INLINE void softmaxRowAt(const L &lanes, const T *in, T *out, int64_t size, int64_t step,
                                  bool logarithm) {
  if (logarithm) {
    LogSumExp<T> s = logSumExp(lanes, in, size, step);
    lanes.forEach(size, [&](int64_t j) { out[j * step] = (in[j * step] - s.maxValue) - s.logSum; });
    return;
  }
  T maxValue = lanes.template maxOf<T>(size, [&](int64_t j) { return in[j * step]; });
  lanes.forEach(size, [&](int64_t j) { out[j * step] = math::exp(in[j * step] - maxValue); });
  double sum = lanes.sumOf(size, [&](int64_t j) { return out[j * step]; });
  T scale = static_cast<T>(1 / sum);
  lanes.forEach(size, [&](int64_t j) { out[j * step] *= scale; });
}

/// Softmax (or log-softmax) of one row.
template <typename L, typename T>
PIPEC_HD_INLINE void softmaxRow(const L &lanes, int64_t row, const RowLayout &l, const T *x, T *y,
                                bool logarithm) {
  int64_t base = rowBase(l, row);
  softmaxRowAt(lanes, x + base, y + base, l.size, l.inner, logarithm);
}

/// dX = Y * (dY - sum(dY * Y)) along the row, the dot product in double and
/// the rest in Acc (the CPU's double, the device's float).
template <typename Acc, typename L, typename T>
PIPEC_HD_INLINE void softmaxGradRow(const L &lanes, int64_t row, const RowLayout &l, const T *dy,
                                    const T *y, T *dx) {
  int64_t base = rowBase(l, row), step = l.inner;
  double dot = lanes.sumOf(l.size, [&](int64_t j) {
    int64_t i = base + j * step;
    return static_cast<double>(dy[i]) * static_cast<double>(y[i]);
  });
  Acc total = static_cast<Acc>(dot);
  lanes.forEach(l.size, [&](int64_t j) {
    int64_t i = base + j * step;
    dx[i] = static_cast<T>(static_cast<Acc>(y[i]) * (static_cast<Acc>(dy[i]) - total));
  });
}

/// Mean and 1 / sqrt(variance + epsilon) of a contiguous row: two passes
/// summed in double, the results kept in Acc.
template <typename Acc, typename L, typename T>
PIPEC_HD_INLINE void rowMoments(const L &lanes, const T *in, int64_t size, double epsilon,
                                Acc &mean, Acc &rstd) {
  double n = static_cast<double>(size);
  double mu = lanes.sumOf(size, [&](int64_t j) { return static_cast<double>(in[j]); }) / n;
  double sq = lanes.sumOf(size, [&](int64_t j) {
    double d = static_cast<double>(in[j]) - mu;
    return d * d;
  });
  mean = static_cast<Acc>(mu);
  rstd = static_cast<Acc>(1 / sqrt(sq / n + epsilon));
}

/// LayerNormalization of contiguous row \p row of \p size elements, each
/// output computed in Acc; gamma and beta (beta may be null) have \p size
/// elements; mean and invStd (may be null) get one value per row.
template <typename Acc, typename L, typename T, typename S>
PIPEC_HD_INLINE void layerNormRow(const L &lanes, int64_t row, int64_t size, double epsilon,
                                  const T *x, const T *gamma, const T *beta, T *y, S *mean,
                                  S *invStd) {
  const T *in = x + row * size;
  T *out = y + row * size;
  Acc mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  lanes.forEach(size, [&](int64_t j) {
    Acc shift = beta ? static_cast<Acc>(beta[j]) : Acc(0);
    out[j] =
        static_cast<T>((static_cast<Acc>(in[j]) - mu) * rstd * static_cast<Acc>(gamma[j]) + shift);
  });
  if (lanes.leader()) {
    if (mean)
      mean[row] = static_cast<S>(mu);
    if (invStd)
      invStd[row] = static_cast<S>(rstd);
  }
}

/// dX = rstd * (G - mean(G) - Xh * mean(G * Xh)), G = dY * scale, in Acc;
/// the means summed in double.
template <typename Acc, typename L, typename T, typename G>
PIPEC_HD_INLINE void layerNormGradInputRow(const L &lanes, int64_t row, int64_t size,
                                           double epsilon, const T *dy, const T *x, const G *scale,
                                           T *dx) {
  const T *in = x + row * size, *d = dy + row * size;
  T *out = dx + row * size;
  Acc mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  auto g = [&](int64_t j) { return static_cast<Acc>(d[j]) * static_cast<Acc>(scale[j]); };
  auto xh = [&](int64_t j) { return (static_cast<Acc>(in[j]) - mu) * rstd; };
  double n = static_cast<double>(size);
  Acc meanG = static_cast<Acc>(lanes.sumOf(size, g) / n);
  Acc meanGX = static_cast<Acc>(lanes.sumOf(size, [&](int64_t j) {
    return static_cast<double>(g(j)) * static_cast<double>(xh(j));
  }) / n);
  lanes.forEach(
      size, [&](int64_t j) { out[j] = static_cast<T>(rstd * (g(j) - meanG - xh(j) * meanGX)); });
}

/// The row statistics LayerNormGradWeight needs.
template <typename Acc, typename L, typename T, typename S>
PIPEC_HD_INLINE void layerNormStatsRow(const L &lanes, int64_t row, int64_t size, double epsilon,
                                       const T *x, S *mean, S *rstd) {
  Acc mu, r;
  rowMoments(lanes, x + row * size, size, epsilon, mu, r);
  if (lanes.leader()) {
    mean[row] = static_cast<S>(mu);
    rstd[row] = static_cast<S>(r);
  }
}

/// Element \p i (of row \p r)'s term of dScale: dY * (X - mean) * rstd in
/// Acc, to be summed in double.
template <typename Acc, typename T, typename S>
PIPEC_HD double layerNormGradWeightTerm(int64_t i, int64_t r, const T *dy, const T *x,
                                        const S *mean, const S *rstd) {
  return static_cast<double>(static_cast<Acc>(dy[i]) *
                             (static_cast<Acc>(x[i]) - static_cast<Acc>(mean[r])) *
                             static_cast<Acc>(rstd[r]));
}

/// Pass one of dScale[k] = sum over rows of the terms: partial sum t covers
/// column k = t % size over rows chunk c = t / size, rows in order.
template <typename Acc, typename T, typename S>
PIPEC_HD void layerNormGradWeightPartial(int64_t t, int64_t rows, int64_t size, int64_t chunkLength,
                                         const T *dy, const T *x, const S *mean, const S *rstd,
                                         double *partial) {
  int64_t k = t % size, c = t / size;
  int64_t end = (c + 1) * chunkLength < rows ? (c + 1) * chunkLength : rows;
  double acc = 0;
  for (int64_t r = c * chunkLength; r < end; ++r)
    acc += layerNormGradWeightTerm<Acc>(r * size + k, r, dy, x, mean, rstd);
  partial[t] = acc;
}

/// SoftmaxCrossEntropyLoss over scores laid out as rows along dimension 1.
struct CrossEntropyParams {
  bool hasIgnore = false;
  int64_t ignoreIndex = 0;
  /// 0 none, 1 sum, 2 mean.
  int reduction = 2;
};

/// Whether \p label counts; an out-of-range label sets *flag and does not.
PIPEC_HD bool labelCounts(const CrossEntropyParams &p, int64_t label, int64_t classes, int *flag) {
  if (p.hasIgnore && label == p.ignoreIndex)
    return false;
  if (label < 0 || label >= classes) {
    *flag = 1;
    return false;
  }
  return true;
}

/// One position: its log-probabilities (if \p logProb; as log-softmax
/// computes them), its loss and whether it counts.
template <typename L, typename T, typename I>
PIPEC_HD_INLINE void crossEntropyRow(const L &lanes, int64_t row, const RowLayout &l,
                                     const CrossEntropyParams &p, const T *scores, const I *labels,
                                     T *logProb, T *losses, T *valid, int *flag) {
  int64_t base = rowBase(l, row), step = l.inner;
  const T *in = scores + base;
  LogSumExp<T> s = logSumExp(lanes, in, l.size, step);
  if (logProb)
    lanes.forEach(l.size, [&](int64_t j) {
      logProb[base + j * step] = (in[j * step] - s.maxValue) - s.logSum;
    });
  if (!lanes.leader())
    return;
  int64_t label = static_cast<int64_t>(labels[row]);
  bool counts = labelCounts(p, label, l.size, flag);
  losses[row] = counts ? -((in[label * step] - s.maxValue) - s.logSum) : T(0);
  valid[row] = counts ? T(1) : T(0);
}

/// The reduced loss: the sum of the losses, or it divided by the sum of
/// \p valid (1 for a position that counts, or its class weight).
template <typename L, typename T>
PIPEC_HD void crossEntropyFinish(const L &lanes, int64_t positions, bool mean, const T *losses,
                                 const T *valid, T *out) {
  double total = lanes.sumOf(positions, [&](int64_t i) { return losses[i]; });
  double count = lanes.sumOf(positions, [&](int64_t i) { return valid[i]; });
  if (lanes.leader())
    out[0] = static_cast<T>(mean ? total / count : total);
}

/// The number of labels != ignore_index (the mean's divisor).
template <typename L, typename I>
PIPEC_HD void labelCount(const L &lanes, int64_t positions, const CrossEntropyParams &p,
                         const I *labels, double *count) {
  double n = lanes.sumOf(positions, [&](int64_t i) {
    return p.hasIgnore && static_cast<int64_t>(labels[i]) == p.ignoreIndex ? 0.0 : 1.0;
  });
  if (lanes.leader())
    count[0] = n;
}

/// dScores = dLoss / divisor * (softmax - onehot(label)) for one position:
/// the exponentials in T, their sum in double, one factor in T, and the
/// label's element less the scale in double; ignored positions get 0.
template <typename L, typename T, typename I>
PIPEC_HD_INLINE void crossEntropyGradRow(const L &lanes, int64_t row, const RowLayout &l,
                                         const CrossEntropyParams &p, const T *dLoss,
                                         const double *count, const T *scores, const I *labels,
                                         T *dx, int *flag) {
  int64_t base = rowBase(l, row), step = l.inner;
  const T *in = scores + base;
  T *out = dx + base;
  int64_t label = static_cast<int64_t>(labels[row]);
  int ignoredFlag = 0;
  if (!labelCounts(p, label, l.size, &ignoredFlag)) {
    if (ignoredFlag && lanes.leader())
      *flag = 1;
    lanes.forEach(l.size, [&](int64_t j) { out[j * step] = T(0); });
    return;
  }
  double divisor = p.reduction != 2 || count[0] == 0 ? 1.0 : count[0];
  double scale = static_cast<double>(dLoss[0]) / divisor;
  T maxValue = lanes.template maxOf<T>(l.size, [&](int64_t j) { return in[j * step]; });
  lanes.forEach(l.size, [&](int64_t j) { out[j * step] = math::exp(in[j * step] - maxValue); });
  double sum = lanes.sumOf(l.size, [&](int64_t j) { return out[j * step]; });
  T factor = static_cast<T>(scale / sum);
  lanes.forEach(l.size, [&](int64_t j) {
    T v = out[j * step] * factor;
    out[j * step] = j == label ? static_cast<T>(static_cast<double>(v) - scale) : v;
  });
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

/// One update, in double as the CPU backend computes it. kind: 0 SGD, 1
/// momentum, 2 AdamW; c1 and c2 are Adam's bias corrections
/// 1 - beta^(step + 1).
struct OptimizerParams {
  int kind = 0;
  double lr = 0, momentum = 0, weightDecay = 0, beta1 = 0, beta2 = 0, epsilon = 0, gradScale = 1;
  double c1 = 1, c2 = 1;
  double decayCenter = 0; ///< decay pulls towards it (a weight holding 1 + w: 1)
};

/// Writes the new weight and moments (m and v may be null for SGD, v for
/// momentum). The outputs may be the inputs: element i is read before it is
/// written.
template <typename T>
PIPEC_HD void optimizerElement(int64_t i, const OptimizerParams &p, const T *w, const T *g,
                               const T *m, const T *v, T *wOut, T *mOut, T *vOut) {
  double wi = static_cast<double>(w[i]);
  double decayed = p.weightDecay * (wi - p.decayCenter);
  if (p.kind == 0) {
    wOut[i] = static_cast<T>(wi - p.lr * (static_cast<double>(g[i]) * p.gradScale + decayed));
  } else if (p.kind == 1) {
    double gi = static_cast<double>(g[i]) * p.gradScale + decayed;
    gi = p.momentum * static_cast<double>(m[i]) + gi;
    mOut[i] = static_cast<T>(gi);
    wOut[i] = static_cast<T>(wi - p.lr * gi);
  } else {
    double gi = static_cast<double>(g[i]) * p.gradScale;
    double mi = p.beta1 * static_cast<double>(m[i]) + (1 - p.beta1) * gi;
    double vi = p.beta2 * static_cast<double>(v[i]) + (1 - p.beta2) * gi * gi;
    mOut[i] = static_cast<T>(mi);
    vOut[i] = static_cast<T>(vi);
    wi -= p.lr * (mi / p.c1 / (sqrt(vi / p.c2) + p.epsilon) + decayed);
    wOut[i] = static_cast<T>(wi);
  }
}

} // namespace pipec::kernels

#endif // PIPEC_RUNTIME_KERNELS_KERNELBODIES_H
