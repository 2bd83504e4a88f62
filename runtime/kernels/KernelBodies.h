//===- KernelBodies.h - Per-element bodies of the device's other kernels -===//
//
// Every CUDA kernel of CudaKernels.cu is a loop around one function of this
// header or of Elementwise.h: the function computes one output element (or
// one row, or one partial sum) from its index and a parameter struct. The
// functions compile for the device under nvcc and for the host everywhere
// else, so the index math, reductions and row algorithms are checked on the
// CPU against the CPU kernels (tests/GpuTest.cpp) on machines without a GPU;
// a device run adds only the launch and the warp reductions.
//
// Row functions take a Lanes policy: SerialLanes (one thread walks the row,
// used on the host and for strided rows) or the device's WarpLanes (32
// lanes stride the row and combine with shuffles). A row function is called
// by every lane of its group with the same row, so its branches on the row
// are uniform and every lane reaches every reduction.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_KERNELBODIES_H
#define PIPEC_RUNTIME_KERNELS_KERNELBODIES_H

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

PIPEC_HD void atomicAddTo(float *target, float value) {
#if defined(__CUDA_ARCH__)
  atomicAdd(target, value);
#else
  *target += value;
#endif
}

/// Adds dY element \p i into dData (zeroed first) at its index.
template <typename I>
PIPEC_HD void gatherGradElement(int64_t i, const GatherParams &p, const float *dy, const I *indices,
                                float *dx, int *flag) {
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
/// order (deterministic) and scales (1 / count for a mean).
struct ReducePlan {
  IndexMap kept;    ///< output index -> input offset of its first element
  IndexMap reduced; ///< reduced index -> offset from there
  int64_t outputs = 0, count = 0, chunks = 1, chunkLength = 0;
  bool interleaved = false;
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
  double acc = 0;
  if (p.interleaved) {
    for (int64_t r = c; r < p.count; r += p.chunks)
      acc += static_cast<double>(base[offsetOf(p.reduced, 0, r)]);
  } else {
    int64_t end = (c + 1) * p.chunkLength < p.count ? (c + 1) * p.chunkLength : p.count;
    for (int64_t r = c * p.chunkLength; r < end; ++r)
      acc += static_cast<double>(base[offsetOf(p.reduced, 0, r)]);
  }
  partial[c * p.outputs + o] = acc;
}

/// Pass two: out[o] = scale * sum over chunks.
template <typename T>
PIPEC_HD void reduceFinishElement(int64_t o, int64_t outputs, int64_t chunks, const double *partial,
                                  double scale, T *out) {
  double acc = 0;
  for (int64_t c = 0; c < chunks; ++c)
    acc += partial[c * outputs + o];
  out[o] = static_cast<T>(acc * scale);
}

//===----------------------------------------------------------------------===//
// Rows: softmax, layer normalization, cross-entropy and their gradients
//===----------------------------------------------------------------------===//

/// One thread per row.
struct SerialLanes {
  PIPEC_HD int lane() const { return 0; }
  PIPEC_HD int count() const { return 1; }
  PIPEC_HD double sum(double v) const { return v; }
  PIPEC_HD float max(float v) const { return v; }
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

/// A row's largest element and the sum of exp(x - largest) over the row.
struct RowExpSum {
  float maxValue;
  double sum;
};

/// The RowExpSum of the row at \p in (elements l.inner apart), over all
/// lanes. Sums in double, as the CPU kernels do (a 50k-wide row loses digits
/// in float).
template <typename L>
PIPEC_HD RowExpSum rowExpSum(const L &lanes, const float *in, const RowLayout &l) {
  float maxValue = -INFINITY;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    maxValue = fmaxf(maxValue, in[j * l.inner]);
  maxValue = lanes.max(maxValue);
  double sum = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    sum += expf(in[j * l.inner] - maxValue);
  return {maxValue, lanes.sum(sum)};
}

/// Softmax (or log-softmax) of one row.
template <typename L>
PIPEC_HD void softmaxRow(const L &lanes, int64_t row, const RowLayout &l, const float *x, float *y,
                         bool logarithm) {
  const float *in = x + rowBase(l, row);
  float *out = y + rowBase(l, row);
  RowExpSum exps = rowExpSum(lanes, in, l);
  float scale = logarithm ? static_cast<float>(log(exps.sum)) : static_cast<float>(1.0 / exps.sum);
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    float shifted = in[j * l.inner] - exps.maxValue;
    out[j * l.inner] = logarithm ? shifted - scale : expf(shifted) * scale;
  }
}

/// dX = Y * (dY - sum(dY * Y)) along the row.
template <typename L>
PIPEC_HD void softmaxGradRow(const L &lanes, int64_t row, const RowLayout &l, const float *dy,
                             const float *y, float *dx) {
  int64_t base = rowBase(l, row);
  double dot = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    dot += static_cast<double>(dy[base + j * l.inner]) * y[base + j * l.inner];
  float total = static_cast<float>(lanes.sum(dot));
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    int64_t i = base + j * l.inner;
    dx[i] = y[i] * (dy[i] - total);
  }
}

/// Mean and 1 / sqrt(variance + epsilon) of a contiguous row (two passes,
/// summed in double as the CPU kernels do).
template <typename L>
PIPEC_HD void rowMoments(const L &lanes, const float *in, int64_t size, float epsilon, float &mean,
                         float &rstd) {
  double sum = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count())
    sum += in[j];
  double mu = lanes.sum(sum) / static_cast<double>(size);
  double sq = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    double d = in[j] - mu;
    sq += d * d;
  }
  mean = static_cast<float>(mu);
  rstd = static_cast<float>(1.0 / sqrt(lanes.sum(sq) / static_cast<double>(size) + epsilon));
}

/// LayerNormalization of contiguous row \p row of \p size elements; gamma
/// and beta (beta may be null) have \p size elements; mean and invStd (may
/// be null) get one value per row.
template <typename L>
PIPEC_HD void layerNormRow(const L &lanes, int64_t row, int64_t size, float epsilon, const float *x,
                           const float *gamma, const float *beta, float *y, float *mean,
                           float *invStd) {
  const float *in = x + row * size;
  float *out = y + row * size;
  float mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  for (int64_t j = lanes.lane(); j < size; j += lanes.count())
    out[j] = (in[j] - mu) * rstd * gamma[j] + (beta ? beta[j] : 0.0f);
  if (lanes.lane() == 0) {
    if (mean)
      mean[row] = mu;
    if (invStd)
      invStd[row] = rstd;
  }
}

/// dX = rstd * (G - mean(G) - Xh * mean(G * Xh)), G = dY * scale.
template <typename L>
PIPEC_HD void layerNormGradInputRow(const L &lanes, int64_t row, int64_t size, float epsilon,
                                    const float *dy, const float *x, const float *scale,
                                    float *dx) {
  const float *in = x + row * size, *d = dy + row * size;
  float *out = dx + row * size;
  float mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  double sumG = 0, sumGX = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    float g = d[j] * scale[j];
    sumG += g;
    sumGX += static_cast<double>(g) * ((in[j] - mu) * rstd);
  }
  float meanG = static_cast<float>(lanes.sum(sumG) / static_cast<double>(size));
  float meanGX = static_cast<float>(lanes.sum(sumGX) / static_cast<double>(size));
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    float xh = (in[j] - mu) * rstd;
    out[j] = rstd * (d[j] * scale[j] - meanG - xh * meanGX);
  }
}

/// The row statistics LayerNormGradWeight needs.
template <typename L>
PIPEC_HD void layerNormStatsRow(const L &lanes, int64_t row, int64_t size, float epsilon,
                                const float *x, float *mean, float *rstd) {
  float mu, r;
  rowMoments(lanes, x + row * size, size, epsilon, mu, r);
  if (lanes.lane() == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

/// Pass one of dScale[k] = sum over rows of dY * Xh: partial sum t covers
/// column k = t % size over rows chunk c = t / size.
PIPEC_HD void layerNormGradWeightPartial(int64_t t, int64_t rows, int64_t size, int64_t chunkLength,
                                         const float *dy, const float *x, const float *mean,
                                         const float *rstd, double *partial) {
  int64_t k = t % size, c = t / size;
  int64_t end = (c + 1) * chunkLength < rows ? (c + 1) * chunkLength : rows;
  double acc = 0;
  for (int64_t r = c * chunkLength; r < end; ++r) {
    int64_t i = r * size + k;
    acc += static_cast<double>(dy[i]) * static_cast<double>((x[i] - mean[r]) * rstd[r]);
  }
  partial[t] = acc;
}

/// SoftmaxCrossEntropyLoss over scores laid out as rows along dimension 1.
struct CrossEntropyParams {
  bool hasIgnore = false;
  int64_t ignoreIndex = 0;
  /// 0 none, 1 sum, 2 mean.
  int reduction = 2;
};

/// One position: its log-probabilities (if \p logProb), loss and whether
/// it counts. An out-of-range label sets *flag and counts as ignored.
template <typename L>
PIPEC_HD void crossEntropyRow(const L &lanes, int64_t row, const RowLayout &l,
                              const CrossEntropyParams &p, const float *scores,
                              const int64_t *labels, float *logProb, float *losses, float *valid,
                              int *flag) {
  int64_t base = rowBase(l, row);
  const float *in = scores + base;
  RowExpSum exps = rowExpSum(lanes, in, l);
  float maxValue = exps.maxValue;
  float logSum = static_cast<float>(log(exps.sum));
  if (logProb)
    for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
      logProb[base + j * l.inner] = in[j * l.inner] - maxValue - logSum;
  if (lanes.lane() != 0)
    return;
  int64_t label = labels[row];
  bool ignored = p.hasIgnore && label == p.ignoreIndex;
  if (!ignored && (label < 0 || label >= l.size)) {
    *flag = 1;
    ignored = true;
  }
  losses[row] = ignored ? 0.0f : -(in[label * l.inner] - maxValue - logSum);
  valid[row] = ignored ? 0.0f : 1.0f;
}

/// The reduced loss: sum, or sum / count of the positions that count.
template <typename L>
PIPEC_HD void crossEntropyFinish(const L &lanes, int64_t positions, bool mean, const float *losses,
                                 const float *valid, float *out) {
  double total = 0, count = 0;
  for (int64_t i = lanes.lane(); i < positions; i += lanes.count()) {
    total += losses[i];
    count += valid[i];
  }
  total = lanes.sum(total);
  count = lanes.sum(count);
  if (lanes.lane() == 0)
    out[0] = static_cast<float>(mean ? total / count : total);
}

/// The number of labels != ignore_index (the mean's divisor).
template <typename L>
PIPEC_HD void labelCount(const L &lanes, int64_t positions, const CrossEntropyParams &p,
                         const int64_t *labels, double *count) {
  double n = 0;
  for (int64_t i = lanes.lane(); i < positions; i += lanes.count())
    n += p.hasIgnore && labels[i] == p.ignoreIndex ? 0.0 : 1.0;
  n = lanes.sum(n);
  if (lanes.lane() == 0)
    count[0] = n;
}

/// dScores = dLoss * (softmax - onehot(label)) / divisor for one position;
/// ignored positions get 0.
template <typename L>
PIPEC_HD void crossEntropyGradRow(const L &lanes, int64_t row, const RowLayout &l,
                                  const CrossEntropyParams &p, const float *dLoss,
                                  const double *count, const float *scores, const int64_t *labels,
                                  float *dx, int *flag) {
  int64_t base = rowBase(l, row);
  const float *in = scores + base;
  float *out = dx + base;
  int64_t label = labels[row];
  bool ignored = p.hasIgnore && label == p.ignoreIndex;
  if (!ignored && (label < 0 || label >= l.size)) {
    if (lanes.lane() == 0)
      *flag = 1;
    ignored = true;
  }
  if (ignored) {
    for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
      out[j * l.inner] = 0;
    return;
  }
  double divisor = p.reduction != 2 || count[0] == 0 ? 1.0 : count[0];
  float scale = static_cast<float>(static_cast<double>(dLoss[0]) / divisor);
  RowExpSum exps = rowExpSum(lanes, in, l);
  float total = static_cast<float>(exps.sum);
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    float prob = expf(in[j * l.inner] - exps.maxValue) / total;
    out[j * l.inner] = scale * (prob - (j == label ? 1.0f : 0.0f));
  }
}

//===----------------------------------------------------------------------===//
// Convolution, pooling and batch normalization
//===----------------------------------------------------------------------===//

/// Sliding-window geometry padded to three spatial dimensions as the CPU
/// kernels pad it: a 1-D or 2-D op gets leading dimensions of size 1.
struct ConvWindow {
  int64_t in[3] = {1, 1, 1}, kernel[3] = {1, 1, 1}, stride[3] = {1, 1, 1};
  int64_t dilation[3] = {1, 1, 1}, padBegin[3] = {0, 0, 0}, padEnd[3] = {0, 0, 0};
  int64_t out[3] = {1, 1, 1};
  PIPEC_HD int64_t inSize() const { return in[0] * in[1] * in[2]; }
  PIPEC_HD int64_t outSize() const { return out[0] * out[1] * out[2]; }
  PIPEC_HD int64_t kernelSize() const { return kernel[0] * kernel[1] * kernel[2]; }
  /// Every window is one input element at its own position: the im2col
  /// columns are the image itself.
  bool isIdentity() const {
    for (int d = 0; d < 3; ++d)
      if (kernel[d] != 1 || stride[d] != 1 || padBegin[d] != 0 || out[d] != in[d])
        return false;
    return true;
  }
};

/// The window of a forward Conv or pool with explicit pads (auto_pad NOTSET)
/// over the spatial sizes \p in, output sizes as the CPU kernels compute
/// them (ceil_mode for pools). False when the attributes do not fit.
inline bool makeConvWindow(const std::vector<int64_t> &in, const std::vector<int64_t> &kernel,
                           const std::vector<int64_t> &strides,
                           const std::vector<int64_t> &dilations, const std::vector<int64_t> &pads,
                           bool ceilMode, ConvWindow &w) {
  w = ConvWindow();
  size_t rank = in.size();
  if (rank < 1 || rank > 3 || kernel.size() != rank || strides.size() != rank ||
      dilations.size() != rank || pads.size() != 2 * rank)
    return false;
  size_t lead = 3 - rank;
  for (size_t i = 0; i < rank; ++i) {
    size_t d = lead + i;
    int64_t k = kernel[i], s = strides[i], dil = dilations[i];
    int64_t begin = pads[i], end = pads[rank + i];
    if (k < 1 || s < 1 || dil < 1 || begin < 0 || end < 0)
      return false;
    int64_t span = in[i] + begin + end - ((k - 1) * dil + 1);
    if (span < 0)
      return false;
    int64_t out = (ceilMode ? (span + s - 1) / s : span / s) + 1;
    if (ceilMode && (out - 1) * s >= in[i] + begin)
      --out;
    w.in[d] = in[i], w.kernel[d] = k, w.stride[d] = s, w.dilation[d] = dil;
    w.padBegin[d] = begin, w.padEnd[d] = end, w.out[d] = out;
  }
  return true;
}

/// The window of a Conv or pool gradient: as makeConvWindow with the output
/// sizes given (dY's), which must be what ceil_mode off or on gives.
inline bool makeGradWindow(const std::vector<int64_t> &in, const std::vector<int64_t> &kernel,
                           const std::vector<int64_t> &strides,
                           const std::vector<int64_t> &dilations, const std::vector<int64_t> &pads,
                           const std::vector<int64_t> &out, ConvWindow &w) {
  if (out.size() != in.size() || !makeConvWindow(in, kernel, strides, dilations, pads, false, w))
    return false;
  size_t lead = 3 - in.size();
  for (size_t i = 0; i < in.size(); ++i) {
    size_t d = lead + i;
    int64_t span = w.in[d] + w.padBegin[d] + w.padEnd[d] - (w.kernel[d] - 1) * w.dilation[d] - 1;
    if (out[i] < span / w.stride[d] + 1 || out[i] > (span + w.stride[d] - 1) / w.stride[d] + 1)
      return false;
    w.out[d] = out[i];
  }
  return true;
}

/// im2col and col2im over `images` images of `channels` contiguous planes
/// (image b of a grouped Conv is batch b / group, group b % group, whose
/// planes are contiguous in X). Columns are [images, rows, outSize] with
/// rows = channels * taps; with batchInner they are [group, rows, images /
/// group, outSize], so that one GEMM per group sums over the batch.
struct Im2colParams {
  ConvWindow w;
  int64_t images = 1, channels = 1, group = 1;
  bool batchInner = false;
  PIPEC_HD int64_t rows() const { return channels * w.kernelSize(); }
};

/// Input position (row-major in the image plane) that tap \p k of output
/// position \p o reads, or -1 in the padding.
PIPEC_HD int64_t tapSource(const ConvWindow &w, int64_t k, int64_t o) {
  int64_t kw = k % w.kernel[2], kh = (k / w.kernel[2]) % w.kernel[1],
          kd = k / (w.kernel[2] * w.kernel[1]);
  int64_t ow = o % w.out[2], oh = (o / w.out[2]) % w.out[1], od = o / (w.out[2] * w.out[1]);
  int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
  int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
  int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
  if (id < 0 || id >= w.in[0] || ih < 0 || ih >= w.in[1] || iw < 0 || iw >= w.in[2])
    return -1;
  return (id * w.in[1] + ih) * w.in[2] + iw;
}

/// Column element \p t (in [images, rows, outSize] order) from the images.
PIPEC_HD void im2colElement(int64_t t, const Im2colParams &p, const float *image, float *columns) {
  int64_t outSize = p.w.outSize(), rows = p.rows(), taps = p.w.kernelSize();
  int64_t o = t % outSize, r = (t / outSize) % rows, b = t / (outSize * rows);
  int64_t c = r / taps, k = r % taps;
  int64_t i = tapSource(p.w, k, o);
  float v = i < 0 ? 0.0f : image[(b * p.channels + c) * p.w.inSize() + i];
  if (p.batchInner) {
    int64_t batch = p.images / p.group, n = b / p.group, g = b % p.group;
    columns[((g * rows + r) * batch + n) * outSize + o] = v;
  } else {
    columns[t] = v;
  }
}

/// Output position along one dimension that tap \p k reads input \p i from,
/// or -1.
PIPEC_HD int64_t tapTarget(int64_t i, int64_t k, int64_t stride, int64_t dilation, int64_t pad,
                           int64_t out) {
  int64_t num = i + pad - k * dilation;
  if (num < 0 || num % stride != 0 || num / stride >= out)
    return -1;
  return num / stride;
}

/// Image element \p i: the sum of the column entries read from it, taps in
/// increasing order (the CPU col2im's order for one element).
PIPEC_HD void col2imElement(int64_t i, const Im2colParams &p, const float *columns, float *image) {
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize(), outSize = w.outSize(), taps = w.kernelSize();
  int64_t pos = i % inSize, plane = i / inSize; // plane = b * channels + c
  int64_t iw = pos % w.in[2], ih = (pos / w.in[2]) % w.in[1], id = pos / (w.in[2] * w.in[1]);
  const float *cols = columns + plane * taps * outSize;
  float acc = 0;
  int64_t k = 0;
  for (int64_t kd = 0; kd < w.kernel[0]; ++kd) {
    int64_t od = tapTarget(id, kd, w.stride[0], w.dilation[0], w.padBegin[0], w.out[0]);
    for (int64_t kh = 0; kh < w.kernel[1]; ++kh) {
      int64_t oh = tapTarget(ih, kh, w.stride[1], w.dilation[1], w.padBegin[1], w.out[1]);
      for (int64_t kw = 0; kw < w.kernel[2]; ++kw, ++k) {
        int64_t ow = tapTarget(iw, kw, w.stride[2], w.dilation[2], w.padBegin[2], w.out[2]);
        if (od < 0 || oh < 0 || ow < 0)
          continue;
        acc += cols[k * outSize + (od * w.out[1] + oh) * w.out[2] + ow];
      }
    }
  }
  image[i] = acc;
}

/// y[i] += bias[channel of i] for y [batch, maps, size].
PIPEC_HD void biasElement(int64_t i, int64_t maps, int64_t size, const float *bias, float *y) {
  y[i] += bias[(i / size) % maps];
}

/// A 1-D to 3-D MaxPool or AveragePool.
struct PoolParams {
  ConvWindow w;
  bool isMax = true, includePad = false;
};

/// Taps of output position (od, oh, ow) inside the padded input (includePad)
/// or the input: the AveragePool divisor.
PIPEC_HD int64_t poolCount(const ConvWindow &w, const int64_t *o, bool includePad) {
  int64_t count = 1;
  for (int d = 0; d < 3; ++d) {
    int64_t n = 0;
    for (int64_t k = 0; k < w.kernel[d]; ++k) {
      int64_t at = o[d] * w.stride[d] - w.padBegin[d] + k * w.dilation[d];
      n += includePad ? (at >= -w.padBegin[d] && at < w.in[d] + w.padEnd[d])
                      : (at >= 0 && at < w.in[d]);
    }
    count *= n;
  }
  return count;
}

/// The input position of the maximum of window \p o over \p plane (the
/// first strict maximum in tap order, as the CPU kernels pick it), -1 for a
/// window of padding only; \p best gets its value.
PIPEC_HD int64_t poolArgmax(const ConvWindow &w, int64_t o, const float *plane, float &best) {
  int64_t bestIndex = -1;
  best = -INFINITY;
  int64_t taps = w.kernelSize();
  for (int64_t k = 0; k < taps; ++k) {
    int64_t i = tapSource(w, k, o);
    if (i >= 0 && (bestIndex < 0 || plane[i] > best)) {
      best = plane[i];
      bestIndex = i;
    }
  }
  return bestIndex;
}

/// Pool output element \p t of [planes, outSize].
PIPEC_HD void poolElement(int64_t t, const PoolParams &p, const float *x, float *y) {
  const ConvWindow &w = p.w;
  int64_t outSize = w.outSize(), o = t % outSize, plane = t / outSize;
  const float *in = x + plane * w.inSize();
  if (p.isMax) {
    float best;
    poolArgmax(w, o, in, best);
    y[t] = best;
    return;
  }
  int64_t taps = w.kernelSize(), valid = 0;
  double sum = 0;
  for (int64_t k = 0; k < taps; ++k) {
    int64_t i = tapSource(w, k, o);
    if (i >= 0) {
      sum += in[i];
      ++valid;
    }
  }
  int64_t at[3] = {o / (w.out[2] * w.out[1]), (o / w.out[2]) % w.out[1], o % w.out[2]};
  int64_t count = p.includePad ? poolCount(w, at, true) : valid;
  y[t] = static_cast<float>(count ? sum / static_cast<double>(count) : 0.0);
}

/// Input gradient element \p i of [planes, inSize]: MaxPoolGrad adds dY of
/// the windows whose maximum it is in increasing output order,
/// AveragePoolGrad dY / count of every window reading it in increasing tap
/// order (the CPU kernels' orders for one element).
PIPEC_HD void poolGradElement(int64_t i, const PoolParams &p, const float *dy, const float *x,
                              float *dx) {
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize(), outSize = w.outSize();
  int64_t pos = i % inSize, plane = i / inSize;
  int64_t at[3] = {pos / (w.in[2] * w.in[1]), (pos / w.in[2]) % w.in[1], pos % w.in[2]};
  const float *grad = dy + plane * outSize;
  float acc = 0;
  int64_t o3[3];
  // Max: taps in decreasing order meet the windows in increasing order.
  for (int64_t a = 0; a < w.kernel[0]; ++a) {
    int64_t kd = p.isMax ? w.kernel[0] - 1 - a : a;
    o3[0] = tapTarget(at[0], kd, w.stride[0], w.dilation[0], w.padBegin[0], w.out[0]);
    if (o3[0] < 0)
      continue;
    for (int64_t b = 0; b < w.kernel[1]; ++b) {
      int64_t kh = p.isMax ? w.kernel[1] - 1 - b : b;
      o3[1] = tapTarget(at[1], kh, w.stride[1], w.dilation[1], w.padBegin[1], w.out[1]);
      if (o3[1] < 0)
        continue;
      for (int64_t c = 0; c < w.kernel[2]; ++c) {
        int64_t kw = p.isMax ? w.kernel[2] - 1 - c : c;
        o3[2] = tapTarget(at[2], kw, w.stride[2], w.dilation[2], w.padBegin[2], w.out[2]);
        if (o3[2] < 0)
          continue;
        int64_t o = (o3[0] * w.out[1] + o3[1]) * w.out[2] + o3[2];
        if (p.isMax) {
          float best;
          if (poolArgmax(w, o, x + plane * inSize, best) == pos)
            acc += grad[o];
        } else {
          acc += grad[o] / static_cast<float>(poolCount(w, o3, p.includePad));
        }
      }
    }
  }
  dx[i] = acc;
}

/// BatchNormalization (inference) of element \p i of X [batch, channels,
/// spatial], in double as the CPU kernel computes it.
PIPEC_HD void batchNormElement(int64_t i, int64_t channels, int64_t spatial, double epsilon,
                               const float *x, const float *scale, const float *bias,
                               const float *mean, const float *var, float *y) {
  int64_t c = (i / spatial) % channels;
  double mul = static_cast<double>(scale[c]) / sqrt(static_cast<double>(var[c]) + epsilon);
  double add = static_cast<double>(bias[c]) - static_cast<double>(mean[c]) * mul;
  y[i] = static_cast<float>(static_cast<double>(x[i]) * mul + add);
}

/// Pass one of BatchNormGradWeight: partial t covers channel t / chunks and
/// chunk t % chunks of its batch * spatial elements, summing dY (X - mean).
PIPEC_HD void batchNormGradWeightPartial(int64_t t, int64_t channels, int64_t batch,
                                         int64_t spatial, int64_t chunks, const float *dy,
                                         const float *x, const float *mean, double *partial) {
  int64_t c = t / chunks, chunk = t % chunks, count = batch * spatial;
  int64_t length = (count + chunks - 1) / chunks;
  int64_t end = (chunk + 1) * length < count ? (chunk + 1) * length : count;
  double mu = static_cast<double>(mean[c]), acc = 0;
  for (int64_t r = chunk * length; r < end; ++r) {
    int64_t i = ((r / spatial) * channels + c) * spatial + r % spatial;
    acc += static_cast<double>(dy[i]) * (static_cast<double>(x[i]) - mu);
  }
  partial[t] = acc;
}

/// Pass two: dScale[c] = sum of its chunks / sqrt(var + epsilon).
PIPEC_HD void batchNormGradWeightFinish(int64_t c, int64_t chunks, double epsilon,
                                        const double *partial, const float *var, float *out) {
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k)
    acc += partial[c * chunks + k];
  out[c] = static_cast<float>(acc / sqrt(static_cast<double>(var[c]) + epsilon));
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

/// Writes the new weight and moments (never in place; m and v may be null
/// for SGD, v for momentum).
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
