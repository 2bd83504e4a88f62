//===- ConvBodies.h - Convolution, pooling and batch normalization bodies -===//
//
// The per-element (and per-row) bodies of im2col, col2im, the Conv bias,
// the pools and their gradients, and batch normalization, for the CPU and
// CUDA kernels alike (KernelBodies.h says how). The CPU calls them a row of
// elements at a time (the *Run functions), where a device thread takes one
// element. Two gradients take a scatter on the CPU and a gather on the
// device, adding the same terms in the same order: col2im (col2imAddRun
// against col2imRun) and MaxPoolGrad (poolArgmax's window maxima against
// poolGradRun); one core walks the columns and windows once rather than
// searching, for each element, the taps that read it.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_CONVBODIES_H
#define PIPEC_RUNTIME_KERNELS_CONVBODIES_H

#include "math/HostDevice.h"

#include <cstdint>
#include <limits>
#include <math.h>
#include <type_traits>
#include <vector>

namespace pipec::kernels {

/// Sliding-window geometry padded to three spatial dimensions: a 1-D or 2-D
/// op gets leading dimensions of size 1 (cpu::Window adds the op's rank).
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

/// The output position (od, oh, ow) of window \p o.
PIPEC_HD void windowAt(const ConvWindow &w, int64_t o, int64_t *at) {
  int64_t rest = o / w.out[2];
  at[0] = rest / w.out[1], at[1] = rest % w.out[1], at[2] = o % w.out[2];
}

/// Walks column entries t to t + n - 1 (in [images, rows, outSize] order,
/// all in one row) a stretch along the last output dimension at a time:
/// span(at, plane, len, from, lo, hi) for the entries at, at + 1, ... at +
/// len - 1 of the columns, of which [lo, hi) read the image elements plane +
/// from + e * stride[2] and the rest read padding.
template <typename F>
PIPEC_HD void forColumnSpans(int64_t t, int64_t n, const Im2colParams &p, F span) {
  if (n <= 0) // an empty row of an empty output
    return;
  const ConvWindow &w = p.w;
  int64_t outSize = w.outSize(), rows = p.rows(), taps = w.kernelSize();
  int64_t o = t % outSize, row = t / outSize, r = row % rows, b = row / rows;
  int64_t c = r / taps, k = r % taps;
  int64_t kw = k % w.kernel[2], kh = (k / w.kernel[2]) % w.kernel[1],
          kd = k / (w.kernel[2] * w.kernel[1]);
  int64_t plane = (b * p.channels + c) * w.inSize(), at = row * outSize + o;
  if (p.batchInner) {
    int64_t batch = p.images / p.group, nb = b / p.group, g = b % p.group;
    at = ((g * rows + r) * batch + nb) * outSize + o;
  }
  int64_t pos[3];
  windowAt(w, o, pos);
  while (n > 0) {
    // Along the last dimension the stretch reads one input row (or padding).
    int64_t id = pos[0] * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
    int64_t ih = pos[1] * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
    bool inRow = id >= 0 && id < w.in[0] && ih >= 0 && ih < w.in[1];
    int64_t len = w.out[2] - pos[2] < n ? w.out[2] - pos[2] : n;
    int64_t first = pos[2] * w.stride[2] - w.padBegin[2] + kw * w.dilation[2], lo = 0, hi = 0;
    if (inRow) {
      lo = first >= 0 ? 0 : (-first + w.stride[2] - 1) / w.stride[2];
      hi = first >= w.in[2] ? 0 : (w.in[2] - first + w.stride[2] - 1) / w.stride[2];
      lo = lo < len ? lo : len;
      hi = hi < lo ? lo : (hi < len ? hi : len);
    }
    span(at, plane, len, (id * w.in[1] + ih) * w.in[2] + first, lo, hi);
    at += len, n -= len, pos[2] = 0;
    if (++pos[1] == w.out[1])
      pos[1] = 0, ++pos[0];
  }
}

/// Column entries t to t + n - 1 (in [images, rows, outSize] order, all in
/// one row) from the images: the device fills one entry a thread, the host
/// a row a call. Any element type (the CPU's ConvInteger unfolds int32).
template <typename T>
PIPEC_HD void im2colRun(int64_t t, int64_t n, const Im2colParams &p, const T *image, T *columns) {
  int64_t stride = p.w.stride[2];
  forColumnSpans(t, n, p,
                 [&](int64_t at, int64_t plane, int64_t len, int64_t from, int64_t lo, int64_t hi) {
                   T *out = columns + at;
                   const T *in = image + plane;
                   for (int64_t e = 0; e < lo; ++e)
                     out[e] = T(0);
                   for (int64_t e = lo; e < hi; ++e)
                     out[e] = in[from + e * stride];
                   for (int64_t e = hi; e < len; ++e)
                     out[e] = T(0);
                 });
}

/// The adjoint of im2colRun, on the host: adds column entries t to t + n -
/// 1 into the image elements they were read from. Called over a channel's
/// rows in order, it adds each element's entries in increasing tap order,
/// as col2imRun (the device's form, one element a thread) sums them: the
/// same bits, with no search for the taps that read an element.
template <typename T>
PIPEC_HD void col2imAddRun(int64_t t, int64_t n, const Im2colParams &p, const T *columns,
                           T *image) {
  int64_t stride = p.w.stride[2];
  forColumnSpans(t, n, p,
                 [&](int64_t at, int64_t plane, int64_t, int64_t from, int64_t lo, int64_t hi) {
                   const T *in = columns + at;
                   T *out = image + plane;
                   for (int64_t e = lo; e < hi; ++e)
                     out[from + e * stride] += in[e];
                 });
}

/// Column element \p t (in [images, rows, outSize] order) from the images.
template <typename T>
PIPEC_HD void im2colElement(int64_t t, const Im2colParams &p, const T *image, T *columns) {
  im2colRun(t, 1, p, image, columns);
}

/// The outputs along dimension \p d whose windows read input \p i: o in
/// [first(), last()] with o * stride + k * dilation = i + padBegin for a
/// tap k in [0, kernel) (tapOf; with dilation > 1 not every o has one),
/// empty when last() < first(). next() moves to input i + 1 without a
/// division, so that a run along the last dimension divides once.
class TapRange {
public:
  PIPEC_HD TapRange(const ConvWindow &w, int d, int64_t i) : stride(w.stride[d]), out(w.out[d]) {
    // first = ceil(low / stride) = floor((low + stride - 1) / stride) and
    // last = floor(num / stride), kept as quotients and remainders.
    int64_t num = i + w.padBegin[d], low = num - (w.kernel[d] - 1) * w.dilation[d];
    floorDiv(low + stride - 1, lowQ, lowR);
    floorDiv(num, highQ, highR);
  }
  PIPEC_HD int64_t first() const { return lowQ < 0 ? 0 : lowQ; }
  PIPEC_HD int64_t last() const { return highQ < out ? highQ : out - 1; }
  PIPEC_HD void next() {
    if (++lowR == stride)
      lowR = 0, ++lowQ;
    if (++highR == stride)
      highR = 0, ++highQ;
  }

private:
  PIPEC_HD void floorDiv(int64_t a, int64_t &q, int64_t &r) const {
    q = stride == 1 ? a : a / stride;
    r = a - q * stride;
    if (r < 0)
      r += stride, --q;
  }
  int64_t stride, out, lowQ = 0, lowR = 0, highQ = 0, highR = 0;
};

/// The tap along dimension \p d by which output \p o (in TapRange) reads
/// input \p i, or -1 when the dilation skips it.
PIPEC_HD int64_t tapOf(const ConvWindow &w, int d, int64_t i, int64_t o) {
  int64_t gap = i + w.padBegin[d] - o * w.stride[d];
  if (w.dilation[d] == 1)
    return gap;
  return gap % w.dilation[d] == 0 ? gap / w.dilation[d] : -1;
}

/// Image elements i to i + n - 1 (of planes [images * channels, inSize],
/// all in one row of the last dimension): each the sum of the column
/// entries read from it, from T(0) with the taps in increasing order (the
/// outputs in decreasing order), written over the image's element. Pads
/// may be negative (ConvTranspose's longer output_shape). Any element type
/// (the CPU's Col2Im takes them all).
template <typename T>
PIPEC_HD void col2imRun(int64_t i, int64_t n, const Im2colParams &p, const T *columns, T *image) {
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize();
  if (n <= 0 || inSize == 0) // an empty row of an empty image
    return;
  int64_t outSize = w.outSize(), taps = w.kernelSize();
  int64_t pos = i % inSize, plane = i / inSize; // plane = b * channels + c
  int64_t at[3] = {pos / (w.in[2] * w.in[1]), (pos / w.in[2]) % w.in[1], pos % w.in[2]};
  TapRange rd(w, 0, at[0]), rh(w, 1, at[1]), rw(w, 2, at[2]);
  const T *cols = columns + plane * taps * outSize;
  for (int64_t e = 0; e < n; ++e, rw.next()) {
    T acc = T(0);
    for (int64_t od = rd.last(); od >= rd.first(); --od) {
      int64_t kd = tapOf(w, 0, at[0], od);
      if (kd < 0)
        continue;
      for (int64_t oh = rh.last(); oh >= rh.first(); --oh) {
        int64_t kh = tapOf(w, 1, at[1], oh);
        if (kh < 0)
          continue;
        for (int64_t ow = rw.last(); ow >= rw.first(); --ow) {
          int64_t kw = tapOf(w, 2, at[2] + e, ow);
          if (kw < 0)
            continue;
          int64_t k = (kd * w.kernel[1] + kh) * w.kernel[2] + kw;
          acc += cols[k * outSize + (od * w.out[1] + oh) * w.out[2] + ow];
        }
      }
    }
    image[i + e] = acc;
  }
}

/// Image element \p i: col2imRun of one element.
template <typename T>
PIPEC_HD void col2imElement(int64_t i, const Im2colParams &p, const T *columns, T *image) {
  col2imRun(i, 1, p, columns, image);
}

/// y[i] += bias[channel of i] for y [batch, maps, size].
template <typename T>
PIPEC_HD void biasElement(int64_t i, int64_t maps, int64_t size, const T *bias, T *y) {
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
    // The taps k in [0, kernel) with lo <= start + k * dilation < hi.
    int64_t start = o[d] * w.stride[d] - w.padBegin[d], dil = w.dilation[d];
    int64_t lo = includePad ? -w.padBegin[d] : 0, hi = w.in[d] + (includePad ? w.padEnd[d] : 0);
    if (start >= hi) // the window starts past the end
      return 0;
    int64_t below = start >= lo ? 0 : lo - start + dil - 1, above = hi - 1 - start;
    int64_t first = dil == 1 ? below : below / dil, last = dil == 1 ? above : above / dil;
    if (last >= w.kernel[d])
      last = w.kernel[d] - 1;
    if (last < first)
      return 0;
    count *= last - first + 1;
  }
  return count;
}

/// The start of a MaxPool's running maximum: -inf for floating types, the
/// lowest value for integers (what a window of padding only gives).
template <typename T> PIPEC_HD T poolLowest() {
  if constexpr (std::is_floating_point_v<T>)
    return T(-INFINITY);
  else
    return std::numeric_limits<T>::lowest();
}

/// Calls \p f(i) for the input position i (row-major in the image plane)
/// of each tap of the window at output position \p at (windowAt's) that
/// reads the input, in tap order.
template <typename F> PIPEC_HD void forWindowInputs(const ConvWindow &w, const int64_t *at, F &&f) {
  for (int64_t kd = 0; kd < w.kernel[0]; ++kd) {
    int64_t id = at[0] * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
    if (id < 0 || id >= w.in[0])
      continue;
    for (int64_t kh = 0; kh < w.kernel[1]; ++kh) {
      int64_t ih = at[1] * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
      if (ih < 0 || ih >= w.in[1])
        continue;
      for (int64_t kw = 0; kw < w.kernel[2]; ++kw) {
        int64_t iw = at[2] * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
        if (iw >= 0 && iw < w.in[2])
          f((id * w.in[1] + ih) * w.in[2] + iw);
      }
    }
  }
}

/// The input position of the maximum of window \p o over \p plane (the
/// first strict maximum in tap order, NaN never replacing a value), -1 for
/// a window of padding only; \p best gets its value (poolLowest then).
template <typename T>
PIPEC_HD int64_t poolArgmax(const ConvWindow &w, int64_t o, const T *plane, T &best) {
  int64_t at[3], bestIndex = -1;
  windowAt(w, o, at);
  best = poolLowest<T>();
  forWindowInputs(w, at, [&](int64_t i) {
    if (bestIndex < 0 || plane[i] > best)
      best = plane[i], bestIndex = i;
  });
  return bestIndex;
}

/// Pool output element \p t of [planes, outSize]. AveragePool divides the
/// double sum by the count in double and rounds once (0 for no count).
template <typename T> PIPEC_HD void poolElement(int64_t t, const PoolParams &p, const T *x, T *y) {
  const ConvWindow &w = p.w;
  int64_t outSize = w.outSize(), o = t % outSize, plane = t / outSize;
  const T *in = x + plane * w.inSize();
  if (p.isMax) {
    T best;
    poolArgmax(w, o, in, best);
    y[t] = best;
    return;
  }
  int64_t at[3], valid = 0;
  windowAt(w, o, at);
  double sum = 0;
  forWindowInputs(w, at, [&](int64_t i) { sum += static_cast<double>(in[i]), ++valid; });
  int64_t count = p.includePad ? poolCount(w, at, true) : valid;
  y[t] = static_cast<T>(count ? sum / static_cast<double>(count) : 0.0);
}

/// Input gradient elements i to i + n - 1 of [planes, inSize] (all in one
/// row of the last dimension): MaxPoolGrad adds dY of the windows whose
/// maximum it is in increasing output order, AveragePoolGrad dY / T(count)
/// of every window reading it in increasing tap order, each from T(0) (the
/// CPU kernels' orders for one element). MaxPoolGrad finds each window's
/// maximum with poolArgmax over \p x; AveragePoolGrad does not read x.
template <typename T>
PIPEC_HD void poolGradRun(int64_t i, int64_t n, const PoolParams &p, const T *dy, const T *x,
                          T *dx) {
  if (n <= 0) // an empty row of an empty input
    return;
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize(), outSize = w.outSize();
  int64_t pos = i % inSize, plane = i / inSize;
  int64_t at[3] = {pos / (w.in[2] * w.in[1]), (pos / w.in[2]) % w.in[1], pos % w.in[2]};
  TapRange range[3] = {TapRange(w, 0, at[0]), TapRange(w, 1, at[1]), TapRange(w, 2, at[2])};
  const T *grad = dy + plane * outSize;
  for (int64_t e = 0; e < n; ++e, ++at[2], range[2].next()) {
    T acc = T(0);
    int64_t o3[3], span[3];
    for (int d = 0; d < 3; ++d)
      span[d] = range[d].last() - range[d].first();
    // Max: the windows in increasing order; Average: the taps in increasing
    // order, which meet the windows in decreasing order.
    for (int64_t a = 0; a <= span[0]; ++a) {
      o3[0] = p.isMax ? range[0].first() + a : range[0].last() - a;
      if (tapOf(w, 0, at[0], o3[0]) < 0)
        continue;
      for (int64_t b = 0; b <= span[1]; ++b) {
        o3[1] = p.isMax ? range[1].first() + b : range[1].last() - b;
        if (tapOf(w, 1, at[1], o3[1]) < 0)
          continue;
        for (int64_t c = 0; c <= span[2]; ++c) {
          o3[2] = p.isMax ? range[2].first() + c : range[2].last() - c;
          if (tapOf(w, 2, at[2], o3[2]) < 0)
            continue;
          int64_t o = (o3[0] * w.out[1] + o3[1]) * w.out[2] + o3[2];
          if (p.isMax) {
            T best;
            if (poolArgmax(w, o, x + plane * inSize, best) == pos + e)
              acc += grad[o];
          } else {
            acc += grad[o] / static_cast<T>(poolCount(w, o3, p.includePad));
          }
        }
      }
    }
    dx[i + e] = acc;
  }
}

/// Input gradient element \p i: poolGradRun of one element.
template <typename T>
PIPEC_HD void poolGradElement(int64_t i, const PoolParams &p, const T *dy, const T *x, T *dx) {
  poolGradRun(i, 1, p, dy, x, dx);
}

/// BatchNormalization (inference) of channel \p c as y = x * mul + add, in
/// double.
struct BatchNormAffine {
  double mul, add;
};

template <typename P>
PIPEC_HD BatchNormAffine batchNormAffine(int64_t c, double epsilon, const P *scale, const P *bias,
                                         const P *mean, const P *var) {
  double mul = static_cast<double>(scale[c]) / sqrt(static_cast<double>(var[c]) + epsilon);
  return {mul, static_cast<double>(bias[c]) - static_cast<double>(mean[c]) * mul};
}

template <typename T> PIPEC_HD T batchNormApply(T x, const BatchNormAffine &a) {
  return static_cast<T>(static_cast<double>(x) * a.mul + a.add);
}

/// Element \p i of X [batch, channels, spatial].
template <typename T, typename P>
PIPEC_HD void batchNormElement(int64_t i, int64_t channels, int64_t spatial, double epsilon,
                               const T *x, const P *scale, const P *bias, const P *mean,
                               const P *var, T *y) {
  int64_t c = (i / spatial) % channels;
  y[i] = batchNormApply(x[i], batchNormAffine(c, epsilon, scale, bias, mean, var));
}

/// Element \p i's term of BatchNormGradWeight's sum: dY (X - mean), in
/// double.
template <typename T>
PIPEC_HD double batchNormGradWeightTerm(int64_t i, const T *dy, const T *x, double mean) {
  return static_cast<double>(dy[i]) * (static_cast<double>(x[i]) - mean);
}

/// Pass one of BatchNormGradWeight: partial t covers channel t / chunks and
/// chunk t % chunks of its batch * spatial elements (in batch-major order),
/// summing their terms.
template <typename T, typename P>
PIPEC_HD void batchNormGradWeightPartial(int64_t t, int64_t channels, int64_t batch,
                                         int64_t spatial, int64_t chunks, const T *dy, const T *x,
                                         const P *mean, double *partial) {
  int64_t c = t / chunks, chunk = t % chunks, count = batch * spatial;
  int64_t length = (count + chunks - 1) / chunks;
  int64_t end = (chunk + 1) * length < count ? (chunk + 1) * length : count;
  double mu = static_cast<double>(mean[c]), acc = 0;
  for (int64_t r = chunk * length; r < end; ++r)
    acc +=
        batchNormGradWeightTerm(((r / spatial) * channels + c) * spatial + r % spatial, dy, x, mu);
  partial[t] = acc;
}

/// Pass two: dScale[c] = sum of its chunks / sqrt(var + epsilon).
template <typename T, typename P>
PIPEC_HD void batchNormGradWeightFinish(int64_t c, int64_t chunks, double epsilon,
                                        const double *partial, const P *var, T *out) {
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k)
    acc += partial[c * chunks + k];
  out[c] = static_cast<T>(acc / sqrt(static_cast<double>(var[c]) + epsilon));
}

} // namespace pipec::kernels

#endif // PIPEC_RUNTIME_KERNELS_CONVBODIES_H
