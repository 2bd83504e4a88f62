//===- ContribKernels.cpp - CPU kernels for onnxruntime's contrib ops ---===//
//
// The com.microsoft ops that onnxruntime's transformer optimizer and
// onnxruntime-genai write into models (Attention, MultiHeadAttention,
// RotaryEmbedding, EmbedLayerNormalization, SkipLayerNormalization,
// SkipSimplifiedLayerNormalization, FastGelu), and
// SimplifiedLayerNormalization, which onnxruntime registers in the default
// domain. Inputs, attributes and outputs are those of onnxruntime's
// docs/ContribOperators.md; where that text is silent (how a mask_index
// becomes an additive bias, which cache row a position reads, what a masked
// causal score is) the kernels do what onnxruntime's CPU kernels do.
//
// Half types are computed in float and rounded once, by runOp. Layouts and
// modes onnxruntime's CPU kernels lack (packed QKV, a 4-D Megatron mask, a
// shared past/present buffer) give an UnsupportedError.
//
// Before:  node com.microsoft.FastGelu(X = [1, -1], bias = [0.5, 0])
// After:   Y = [1.39957, -0.158808]
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>

using namespace llvm;

namespace pipec::cpu {

namespace {

using Outputs = std::vector<Tensor>;
using Shape = std::vector<int64_t>;

/// Runs fn(T{}) with T the storage type of input 0, which must be floating.
template <typename Fn> Expected<Outputs> onFloating(const OpContext &ctx, Fn &&fn) {
  const Tensor &x = ctx.input(0);
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T>)
      return fn(tag);
    else
      return ctx.unsupported(formatv("element type {0} of input 0", elemTypeName(x.elemType())));
  });
}

/// The values of a (small) parameter tensor as T, whatever its floating
/// storage: gamma, beta, biases, caches.
template <typename T> std::vector<T> valuesAs(const Tensor *t) {
  if (!t)
    return {};
  if (storedAs<T>(t->elemType()))
    return std::vector<T>(t->data<T>(), t->data<T>() + t->numElements());
  std::vector<T> out(t->numElements());
  for (int64_t i = 0; i < t->numElements(); ++i)
    out[i] = static_cast<T>(t->getDouble(i));
  return out;
}

/// Checks that parameter input \p i is absent or a vector of \p size
/// floating values.
Error vectorOf(const OpContext &ctx, size_t i, StringRef what, int64_t size) {
  const Tensor *t = ctx.optInput(i);
  if (!t)
    return Error::success();
  if (!isFloating(t->elemType()) || t->rank() != 1 || t->dim(0) != size)
    return ctx.fail(formatv("{0} (input {1}) must be a floating vector of {2}, got {3}", what, i,
                            size, t->describe()));
  return Error::success();
}

/// \p shape with its last dimension set to 1: the shape of per-row
/// statistics (mean, inv_std_var).
Shape rowShape(ArrayRef<int64_t> shape) {
  Shape s(shape);
  if (!s.empty())
    s.back() = 1;
  return s;
}

//===----------------------------------------------------------------------===//
// Normalization
//===----------------------------------------------------------------------===//

/// Normalizes the \p size values at \p x into \p y:
/// y = (x - mean) / sqrt(var + eps) * gamma + beta (beta may be empty), or
/// with \p simplified (RMS norm) y = x / sqrt(mean(x^2) + eps) * gamma.
/// Statistics run in double. Returns the mean and the 1 / sqrt(...) factor
/// through \p meanOut and \p invStdOut.
template <typename T>
void normalizeRow(const T *x, T *y, int64_t size, double epsilon, bool simplified,
                  const std::vector<T> &gamma, const std::vector<T> &beta, double &meanOut,
                  double &invStdOut) {
  double sum = 0, squares = 0;
  for (int64_t j = 0; j < size; ++j) {
    sum += x[j];
    squares += double(x[j]) * x[j];
  }
  double mean = size > 0 ? sum / size : 0;
  double invStd;
  if (simplified) {
    invStd = 1 / std::sqrt((size > 0 ? squares / size : 0) + epsilon);
  } else {
    double var = 0;
    for (int64_t j = 0; j < size; ++j)
      var += (x[j] - mean) * (x[j] - mean);
    invStd = 1 / std::sqrt((size > 0 ? var / size : 0) + epsilon);
  }
  for (int64_t j = 0; j < size; ++j) {
    double centred = simplified ? double(x[j]) : x[j] - mean;
    double v = centred * invStd * gamma[j];
    if (!beta.empty())
      v += beta[j];
    y[j] = static_cast<T>(v);
  }
  meanOut = mean;
  invStdOut = invStd;
}

} // namespace

/// SimplifiedLayerNormalization (default domain): RMS normalization over
/// dimensions [axis, rank). Outputs Y and inv_std_var (float, the input's
/// shape with the normalized dimensions set to 1).
Expected<Outputs> simplifiedLayerNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  int64_t rank = x.rank(), axis = ctx.attrInt("axis", -1);
  if (axis < -rank || axis >= rank)
    return ctx.fail(formatv("axis {0} is out of range for rank {1}", axis, rank));
  if (axis < 0)
    axis += rank;
  if (int64_t stash = ctx.attrInt("stash_type", 1); stash != 1)
    return ctx.unsupported(formatv("stash_type {0}", stash));
  double epsilon = ctx.attrFloat("epsilon", 1e-5f);
  int64_t size = numElementsOf(ArrayRef<int64_t>(x.shape()).drop_front(axis));
  if (!isFloating(scale.elemType()) || scale.numElements() != size)
    return ctx.fail(formatv("scale {0} does not hold the {1} values of the normalized shape",
                            scale.describe(), size));
  int64_t rows = size > 0 ? x.numElements() / size : 0;
  Shape statShape = x.shape();
  std::fill(statShape.begin() + axis, statShape.end(), 1);
  Tensor invStd(DType::F32, statShape);
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    std::vector<T> gamma = valuesAs<T>(&scale);
    Tensor y(x.elemType(), x.shape());
    for (int64_t r = 0; r < rows; ++r) {
      double mean, inv;
      normalizeRow(x.data<T>() + r * size, y.data<T>() + r * size, size, epsilon, true, gamma, {},
                   mean, inv);
      invStd.data<float>()[r] = static_cast<float>(inv);
    }
    return Outputs{y, invStd};
  });
}

/// SkipLayerNormalization and SkipSimplifiedLayerNormalization: normalize
/// input + skip (+ bias) over the last dimension. skip may lack leading
/// dimensions of input or have them 1 (broadcast). Outputs: output, mean
/// (zeros when simplified, as onnxruntime gives), inv_std_var (float, last
/// dimension 1) and input_skip_bias_sum.
template <bool Simplified> Expected<Outputs> skipLayerNormalization(const OpContext &ctx) {
  const bool simplified = Simplified;
  const Tensor &x = ctx.input(0), &skip = ctx.input(1), &gammaIn = ctx.input(2);
  // Simplified: input, skip, gamma, bias. Full: input, skip, gamma, beta, bias.
  size_t biasIndex = simplified ? 3 : 4;
  if (x.rank() < 2)
    return ctx.fail("input must have rank >= 2, got " + x.describe());
  int64_t hidden = x.dim(-1);
  if (Error e = ctx.sameTypeAsFirst(1))
    return e;
  // skip: input's trailing dimensions, leading ones of size 1 allowed.
  Shape skipShape = skip.shape();
  while (!skipShape.empty() && skipShape.front() == 1 && skipShape.size() > 1)
    skipShape.erase(skipShape.begin());
  ArrayRef<int64_t> xShape = x.shape();
  if (skipShape.size() > xShape.size() || skipShape.empty() ||
      ArrayRef<int64_t>(skipShape) != xShape.take_back(skipShape.size()) ||
      skipShape.back() != hidden)
    return ctx.fail(formatv("skip {0} does not match input {1}", skip.describe(), x.describe()));
  if (Error e = vectorOf(ctx, 2, "gamma", hidden))
    return e;
  if (!simplified)
    if (Error e = vectorOf(ctx, 3, "beta", hidden))
      return e;
  if (Error e = vectorOf(ctx, biasIndex, "bias", hidden))
    return e;
  double epsilon = ctx.attrFloat("epsilon", 1e-12f);
  int64_t rows = hidden > 0 ? x.numElements() / hidden : 0;
  int64_t skipSize = skip.numElements();
  Tensor mean(DType::F32, rowShape(x.shape())), invStd(DType::F32, rowShape(x.shape()));
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    std::vector<T> gamma = valuesAs<T>(&gammaIn);
    std::vector<T> beta = simplified ? std::vector<T>() : valuesAs<T>(ctx.optInput(3));
    std::vector<T> bias = valuesAs<T>(ctx.optInput(biasIndex));
    Tensor y(x.elemType(), x.shape()), sum(x.elemType(), x.shape());
    const T *in = x.data<T>(), *sk = skip.data<T>();
    T *s = sum.data<T>();
    for (int64_t r = 0; r < rows; ++r) {
      int64_t skipRow = skipSize > 0 ? (r * hidden) % skipSize : 0;
      for (int64_t j = 0; j < hidden; ++j) {
        T v = in[r * hidden + j] + sk[skipRow + j];
        if (!bias.empty())
          v += bias[j];
        s[r * hidden + j] = v;
      }
      double m, inv;
      normalizeRow(s + r * hidden, y.data<T>() + r * hidden, hidden, epsilon, simplified, gamma,
                   beta, m, inv);
      mean.data<float>()[r] = simplified ? 0.0f : static_cast<float>(m);
      invStd.data<float>()[r] = static_cast<float>(inv);
    }
    return Outputs{y, mean, invStd, sum};
  });
}

/// EmbedLayerNormalization: word + position (+ segment) embeddings, then
/// layer normalization. Inputs: input_ids [B,S], segment_ids, word_embedding
/// [V,H], position_embedding [P,H], segment_embedding, gamma, beta, mask
/// [B,S], position_ids ([B,S] or [1,S]). Outputs: output [B,S,H], mask_index
/// [B] (int32: how many mask entries are 1; zeros without a mask) and
/// embedding_sum [B,S,H] (before normalization).
Expected<Outputs> embedLayerNormalization(const OpContext &ctx) {
  // Segment ids (1) and their table (4) are optional; the row requires only
  // input 0.
  for (int i : {2, 3, 5, 6})
    if (!ctx.optInput(i))
      return ctx.fail(formatv("missing required input {0}", i));
  const Tensor &ids = ctx.input(0), &words = ctx.input(2), &positions = ctx.input(3);
  const Tensor *segmentIds = ctx.optInput(1), *segments = ctx.optInput(4);
  const Tensor &gammaIn = ctx.input(5);
  const Tensor *mask = ctx.optInput(7), *positionIds = ctx.optInput(8);
  for (auto [i, what] : {std::pair<size_t, StringRef>{0, "input_ids"},
                         {1, "segment_ids"},
                         {7, "mask"},
                         {8, "position_ids"}})
    if (Error e = ctx.integerInput(i, what))
      return e;
  if (ids.rank() != 2)
    return ctx.fail("input_ids must be [batch, sequence], got " + ids.describe());
  int64_t B = ids.dim(0), S = ids.dim(1);
  if (words.rank() != 2 || positions.rank() != 2 || positions.dim(1) != words.dim(1) ||
      (segments && (segments->rank() != 2 || segments->dim(1) != words.dim(1))))
    return ctx.fail(formatv("the embeddings must be [rows, hidden] of one hidden size, got "
                            "word {0}, position {1}",
                            words.describe(), positions.describe()));
  if (!isFloating(words.elemType()) || positions.elemType() != words.elemType() ||
      (segments && segments->elemType() != words.elemType()))
    return ctx.fail("the embeddings must share one floating element type");
  if (static_cast<bool>(segmentIds) != static_cast<bool>(segments))
    return ctx.fail("segment_ids and segment_embedding come together");
  int64_t H = words.dim(1);
  if (Error e = vectorOf(ctx, 5, "gamma", H))
    return e;
  if (Error e = vectorOf(ctx, 6, "beta", H))
    return e;
  for (const Tensor *t : {segmentIds, mask})
    if (t && t->shape() != ids.shape())
      return ctx.fail(
          formatv("{0} must have input_ids' shape {1}", t->describe(), shapeString(ids.shape())));
  bool broadcastPositions = false;
  if (positionIds) {
    broadcastPositions =
        positionIds->rank() == 2 && positionIds->dim(0) == 1 && B != 1 && positionIds->dim(1) == S;
    if (positionIds->shape() != ids.shape() && !broadcastPositions)
      return ctx.fail(formatv("position_ids {0} must be [batch, sequence] or [1, sequence]",
                              positionIds->describe()));
  }
  double epsilon = ctx.attrFloat("epsilon", 1e-12f);
  Tensor maskIndex(DType::I32, {B});
  if (mask)
    for (int64_t b = 0; b < B; ++b) {
      int32_t count = 0;
      for (int64_t s = 0; s < S; ++s)
        count += mask->getInt64(b * S + s) == 1;
      maskIndex.data<int32_t>()[b] = count;
    }
  return visitStorage(words.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!std::is_floating_point_v<T>) {
      return ctx.fail("the embeddings must be floating");
    } else {
      std::vector<T> gamma = valuesAs<T>(&gammaIn), beta = valuesAs<T>(ctx.optInput(6));
      Tensor y(words.elemType(), {B, S, H}), sum(words.elemType(), {B, S, H});
      auto row = [&](const Tensor &table, int64_t index, StringRef what) -> Expected<const T *> {
        if (index < 0 || index >= table.dim(0))
          return ctx.fail(formatv("{0} {1} is out of range for a table of {2} rows", what, index,
                                  table.dim(0)));
        return table.data<T>() + index * H;
      };
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
          int64_t at = b * S + s;
          auto word = row(words, ids.getInt64(at), "input id");
          if (!word)
            return word.takeError();
          int64_t position = s;
          if (positionIds)
            position = positionIds->getInt64(broadcastPositions ? s : at);
          auto pos = row(positions, position, "position id");
          if (!pos)
            return pos.takeError();
          const T *segment = nullptr;
          if (segments) {
            auto seg = row(*segments, segmentIds->getInt64(at), "segment id");
            if (!seg)
              return seg.takeError();
            segment = *seg;
          }
          T *e = sum.data<T>() + at * H;
          for (int64_t j = 0; j < H; ++j)
            e[j] = (*word)[j] + (*pos)[j] + (segment ? segment[j] : T(0));
          double mean, inv;
          normalizeRow(e, y.data<T>() + at * H, H, epsilon, false, gamma, beta, mean, inv);
        }
      return Outputs{y, maskIndex, sum};
    }
  });
}

namespace {

//===----------------------------------------------------------------------===//
// Activations and rotary embeddings
//===----------------------------------------------------------------------===//

} // namespace

/// FastGelu: the tanh approximation of Gelu of X (+ bias, broadcast along the
/// last dimension).
Expected<Outputs> fastGelu(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  int64_t hidden = x.rank() > 0 ? x.dim(-1) : 1;
  if (Error e = ctx.sameTypeAsFirst(1))
    return e;
  if (const Tensor *b = ctx.optInput(1); b && b->numElements() != hidden)
    return ctx.fail(
        formatv("bias {0} must hold the {1} values of X's last dimension", b->describe(), hidden));
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    std::vector<T> bias = valuesAs<T>(ctx.optInput(1));
    Tensor y(x.elemType(), x.shape());
    const T *in = x.data<T>();
    T *out = y.data<T>();
    for (int64_t i = 0, e = x.numElements(); i < e; ++i) {
      T v = in[i] + (bias.empty() ? T(0) : bias[i % hidden]);
      out[i] = static_cast<T>(
          v * T(0.5) *
          (T(1) + std::tanh(T(0.7978845608028654) * v * (T(1) + T(0.044715) * v * v))));
    }
    return Outputs{y};
  });
}

/// RotaryEmbedding: rotates pairs of each head's first rotary_embedding_dim
/// values by the angle of the token's position. input is [B,S,N*H] or
/// [B,N,S,H]; position_ids one offset (positions offset + s) or [B,S];
/// cos_cache and sin_cache [max_position, rotary_dim / 2]. Pairs are
/// (i, i + rotary_dim / 2), or (2i, 2i + 1) when interleaved.
Expected<Outputs> rotaryEmbedding(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &ids = ctx.input(1), &cos = ctx.input(2), &sin = ctx.input(3);
  if (ctx.attrInt("is_packed_batching", 0))
    return ctx.unsupported("is_packed_batching");
  if (Error e = ctx.integerInput(1, "position_ids"))
    return e;
  for (size_t i : {2, 3})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  if (cos.rank() != 2 || sin.shape() != cos.shape())
    return ctx.fail(formatv("cos_cache {0} and sin_cache {1} must be one [positions, dim / 2] "
                            "shape",
                            cos.describe(), sin.describe()));
  int64_t heads = ctx.attrInt("num_heads", 0), rotaryDim = ctx.attrInt("rotary_embedding_dim", 0);
  int64_t B, S, headSize, batchStride, seqStride, headStride;
  if (x.rank() == 3) {
    B = x.dim(0), S = x.dim(1);
    int64_t hidden = x.dim(2);
    if (rotaryDim > 0 && heads <= 0)
      return ctx.fail("num_heads must be given with rotary_embedding_dim");
    headSize = rotaryDim == 0 ? cos.dim(1) * 2 : (heads > 0 ? hidden / heads : 0);
    if (headSize <= 0 || hidden % headSize != 0)
      return ctx.fail(
          formatv("hidden size {0} is not a multiple of the head size {1}", hidden, headSize));
    heads = hidden / headSize;
    batchStride = S * hidden, seqStride = hidden, headStride = headSize;
  } else if (x.rank() == 4) {
    B = x.dim(0), heads = x.dim(1), S = x.dim(2), headSize = x.dim(3);
    batchStride = heads * S * headSize, headStride = S * headSize, seqStride = headSize;
  } else {
    return ctx.fail("input must be [batch, seq, hidden] or [batch, heads, seq, head], got " +
                    x.describe());
  }
  if (rotaryDim == 0)
    rotaryDim = headSize;
  int64_t half = rotaryDim / 2;
  if (rotaryDim % 2 != 0 || rotaryDim > headSize || cos.dim(1) != half)
    return ctx.fail(formatv("rotary dimension {0} does not fit head size {1} and cos_cache {2}",
                            rotaryDim, headSize, cos.describe()));
  bool offsetOnly = ids.numElements() == 1 && ids.rank() <= 1;
  if (!offsetOnly && ids.shape() != Shape{B, S})
    return ctx.fail(formatv("position_ids {0} must be one offset or [batch, sequence] = {1}",
                            ids.describe(), shapeString({B, S})));
  bool interleaved = ctx.attrInt("interleaved", 0) != 0;
  int64_t maxPosition = cos.dim(0);
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y = x.clone();
    const T *in = x.data<T>(), *cosData = cos.data<T>(), *sinData = sin.data<T>();
    T *out = y.data<T>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        int64_t position = offsetOnly ? ids.getInt64(0) + s : ids.getInt64(b * S + s);
        if (position < 0 || position >= maxPosition)
          return ctx.fail(formatv("position {0} is out of range for a cos_cache of {1} rows",
                                  position, maxPosition));
        const T *c = cosData + position * half, *sn = sinData + position * half;
        for (int64_t n = 0; n < heads; ++n) {
          int64_t base = b * batchStride + s * seqStride + n * headStride;
          const T *src = in + base;
          T *dst = out + base;
          for (int64_t i = 0; i < half; ++i) {
            int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
            T re = src[first], im = src[second];
            dst[first] = re * c[i] - im * sn[i];
            dst[second] = re * sn[i] + im * c[i];
          }
        }
      }
    return Outputs{y};
  });
}

namespace {

//===----------------------------------------------------------------------===//
// Attention
//===----------------------------------------------------------------------===//

/// The sizes of one attention: B batches, N heads, S queries, P past and
/// T = P + L keys, head sizes H (queries, keys) and Hv (values).
struct AttentionSizes {
  int64_t B = 0, N = 0, S = 0, P = 0, T = 0, H = 0, Hv = 0;
};

/// onnxruntime's mask for Attention and MultiHeadAttention as an additive
/// bias [B, S, T], or empty when there is none. mask_index may be [B] (key
/// lengths: keys at or after are masked), [2B] (end then start positions),
/// [B, T] or [B, S, T] (1 attends, 0 is masked); masked scores get
/// \p filter. With \p causal, query s sees keys up to P + s, later ones get
/// the lowest float (they replace the mask value, as onnxruntime does).
Expected<std::vector<float>> attentionMask(const OpContext &ctx, const Tensor *mask,
                                           const AttentionSizes &a, bool causal, float filter,
                                           bool allowStarts) {
  std::vector<float> bias;
  if (!mask && !causal)
    return bias;
  int64_t B = a.B, S = a.S, T = a.T;
  bias.assign(B * S * T, 0.0f);
  if (mask) {
    Shape shape = mask->shape();
    bool keyLengths = shape == Shape{B}, endsAndStarts = allowStarts && shape == Shape{2 * B};
    if (mask->rank() == 4)
      return ctx.unsupported("a 4-D mask_index (Megatron)");
    if (!keyLengths && !endsAndStarts && shape != Shape{B, T} && shape != Shape{B, S, T})
      return ctx.fail(formatv("mask {0} is none of [batch]{1}, [batch, total_sequence] = {2} "
                              "or [batch, sequence, total_sequence] = {3}",
                              mask->describe(), allowStarts ? ", [2 * batch]" : "",
                              shapeString({B, T}), shapeString({B, S, T})));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        float *row = bias.data() + (b * S + s) * T;
        if (mask->rank() == 3 || mask->rank() == 2) {
          int64_t at = mask->rank() == 3 ? (b * S + s) * T : b * T;
          for (int64_t t = 0; t < T; ++t)
            row[t] = mask->getInt64(at + t) > 0 ? 0.0f : filter;
          continue;
        }
        for (int64_t t = std::max<int64_t>(mask->getInt64(b), 0); t < T; ++t)
          row[t] = filter;
        if (endsAndStarts)
          for (int64_t t = 0, e = std::min(mask->getInt64(b + B), T); t < e; ++t)
            row[t] = filter;
      }
  }
  if (causal)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t t = a.P + s + 1; t < T; ++t)
          bias[(b * S + s) * T + t] = std::numeric_limits<float>::lowest();
  return bias;
}

/// Checks attention_bias: [B or 1, N or 1, S, T], of input 0's type.
Error checkAttentionBias(const OpContext &ctx, const Tensor *bias, const AttentionSizes &a) {
  if (!bias)
    return Error::success();
  if (bias->rank() != 4 || (bias->dim(0) != a.B && bias->dim(0) != 1) ||
      (bias->dim(1) != a.N && bias->dim(1) != 1) || bias->dim(2) != a.S || bias->dim(3) != a.T)
    return ctx.fail(formatv("attention_bias {0} is not [batch or 1, heads or 1, {1}, {2}]",
                            bias->describe(), a.S, a.T));
  if (bias->elemType() != ctx.input(0).elemType())
    return ctx.fail("attention_bias must have the query's element type");
  return Error::success();
}

/// What Attention and MultiHeadAttention read once their sizes are known: the
/// key mask as an additive bias (causal with "unidirectional") and the scale
/// of Q K^T (1 / sqrt(head size) unless given).
struct AttentionScoring {
  std::vector<float> maskBias;
  float scale = 1;
};

/// The scoring of an attention of sizes \p a, with attention_bias checked.
/// \p allowStarts as attentionMask takes it.
Expected<AttentionScoring> attentionScoring(const OpContext &ctx, const Tensor *mask,
                                            const Tensor *attentionBias, const AttentionSizes &a,
                                            bool allowStarts) {
  if (Error e = checkAttentionBias(ctx, attentionBias, a))
    return e;
  bool causal = ctx.attrInt("unidirectional", 0) != 0;
  auto maskBias = attentionMask(ctx, mask, a, causal, ctx.attrFloat("mask_filter_value", -10000.0f),
                                allowStarts);
  if (!maskBias)
    return maskBias.takeError();
  AttentionScoring scoring;
  scoring.maskBias = std::move(*maskBias);
  scoring.scale = ctx.attrFloat("scale", 0.0f);
  if (scoring.scale == 0)
    scoring.scale = 1 / std::sqrt(static_cast<float>(a.H));
  return scoring;
}

/// softmax(scale * Q K^T + mask + attention_bias) V for every batch and
/// head. q [B,N,S,H], k [B,N,T,H], v [B,N,T,Hv], contiguous; mask [B,S,T] or
/// empty. Writes out [B,S,N*Hv]. The softmax runs in double.
template <typename T>
void attend(const AttentionSizes &a, T scale, const T *q, const T *k, const T *v,
            const std::vector<float> &mask, const Tensor *attentionBias, T *out) {
  int64_t B = a.B, N = a.N, S = a.S, T_ = a.T, H = a.H, Hv = a.Hv;
  if (S == 0 || T_ == 0) {
    std::fill(out, out + B * S * N * Hv, T(0));
    return;
  }
  std::vector<T> scores(S * T_);
  std::vector<double> row(T_);
  const T *biasData = attentionBias ? attentionBias->data<T>() : nullptr;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      const T *qb = q + (b * N + n) * S * H, *kb = k + (b * N + n) * T_ * H;
      const T *vb = v + (b * N + n) * T_ * Hv;
      gemm(false, true, S, T_, H, scale, qb, H, kb, H, T(0), scores.data(), T_);
      const T *biasRows = nullptr;
      if (biasData) {
        int64_t bb = attentionBias->dim(0) == 1 ? 0 : b;
        int64_t bn = attentionBias->dim(1) == 1 ? 0 : n;
        biasRows = biasData + (bb * attentionBias->dim(1) + bn) * S * T_;
      }
      for (int64_t s = 0; s < S; ++s) {
        T *x = scores.data() + s * T_;
        double maxValue = -std::numeric_limits<double>::infinity();
        for (int64_t t = 0; t < T_; ++t) {
          // Sums in T, as onnxruntime adds them: a score next to a -10000
          // mask value keeps only T's precision.
          T value = x[t];
          if (!mask.empty())
            value = static_cast<T>(value + mask[(b * S + s) * T_ + t]);
          if (biasRows)
            value += biasRows[s * T_ + t];
          row[t] = value;
          maxValue = std::max(maxValue, row[t]);
        }
        double sum = 0;
        for (int64_t t = 0; t < T_; ++t) {
          row[t] = std::exp(row[t] - maxValue);
          sum += row[t];
        }
        for (int64_t t = 0; t < T_; ++t)
          x[t] = static_cast<T>(row[t] / sum);
      }
      gemm(false, false, S, Hv, T_, T(1), scores.data(), T_, vb, Hv, T(0),
           out + b * S * N * Hv + n * Hv, N * Hv);
    }
}

/// Copies rows [B*L, N*H] at \p src (row stride \p stride, plus \p bias when
/// given) into \p dst [B,N,L,H] starting at sequence position \p offset of
/// \p length positions.
template <typename T>
void toHeads(const T *src, int64_t stride, const T *bias, int64_t B, int64_t L, int64_t N,
             int64_t H, T *dst, int64_t offset, int64_t length) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t n = 0; n < N; ++n) {
        const T *from = src + (b * L + l) * stride + n * H;
        T *to = dst + ((b * N + n) * length + offset + l) * H;
        for (int64_t h = 0; h < H; ++h)
          to[h] = from[h] + (bias ? bias[n * H + h] : T(0));
      }
}

/// Copies past [B,N,P,H] into the first P positions of \p dst [B,N,T,H].
template <typename T>
void copyPast(const T *past, int64_t B, int64_t N, int64_t P, int64_t H, T *dst, int64_t T_) {
  for (int64_t bn = 0; bn < B * N; ++bn)
    std::copy(past + bn * P * H, past + (bn + 1) * P * H, dst + bn * T_ * H);
}

} // namespace

/// Attention: self-attention with the Q, K and V projections fused into one
/// weight. input [B,S,D], weights [D, Dq+Dk+Dv], bias [Dq+Dk+Dv], mask_index,
/// past [2,B,N,P,H], attention_bias [B|1,N|1,S,T]. Outputs output [B,S,Dv]
/// and present [2,B,N,P+S,H].
Expected<Outputs> attention(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &w = ctx.input(1);
  const Tensor *bias = ctx.optInput(2), *mask = ctx.optInput(3), *past = ctx.optInput(4);
  const Tensor *attentionBias = ctx.optInput(5);
  if (ctx.attrInt("past_present_share_buffer", 0) || ctx.optInput(6))
    return ctx.unsupported("a past/present buffer shared through past_sequence_length");
  if (ctx.attrInt("do_rotary", 0))
    return ctx.unsupported("do_rotary");
  int64_t N = ctx.attrInt("num_heads", 0);
  if (N <= 0)
    return ctx.fail("num_heads must be positive");
  if (x.rank() != 3 || w.rank() != 2 || w.dim(0) != x.dim(2))
    return ctx.fail(formatv("input {0} and weights {1} are not [batch, sequence, D] and "
                            "[D, 3 * hidden]",
                            x.describe(), w.describe()));
  for (size_t i : {1, 2, 4})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  if (Error e = ctx.integerInput(3, "mask_index"))
    return e;
  int64_t width = w.dim(1);
  Shape sizes = ctx.attrInts("qkv_hidden_sizes").value_or(Shape{});
  if (sizes.empty()) {
    if (width % 3 != 0)
      return ctx.fail(
          formatv("weights {0}: the projection width is not a multiple of 3", w.describe()));
    sizes = {width / 3, width / 3, width / 3};
  }
  if (sizes.size() != 3 || sizes[0] + sizes[1] + sizes[2] != width ||
      llvm::any_of(sizes, [&](int64_t s) { return s <= 0 || s % N != 0; }) || sizes[0] != sizes[1])
    return ctx.fail(formatv(
        "qkv_hidden_sizes [{0}] do not split weights {1} into Q, K, V of "
        "{2} heads",
        llvm::join(llvm::map_range(sizes, [](int64_t s) { return std::to_string(s); }), ","),
        w.describe(), N));
  if (bias && (bias->rank() != 1 || bias->dim(0) != width))
    return ctx.fail(formatv("bias {0} must be a vector of {1}", bias->describe(), width));
  AttentionSizes a;
  a.B = x.dim(0), a.S = x.dim(1), a.N = N, a.H = sizes[0] / N, a.Hv = sizes[2] / N;
  if (past) {
    if (past->rank() != 5 || past->dim(0) != 2 || past->dim(1) != a.B || past->dim(2) != N ||
        past->dim(4) != a.H || a.H != a.Hv)
      return ctx.fail(formatv("past {0} is not [2, {1}, {2}, past_sequence, {3}]", past->describe(),
                              a.B, N, a.H));
    a.P = past->dim(3);
  }
  a.T = a.P + a.S;
  auto scoring = attentionScoring(ctx, mask, attentionBias, a, /*allowStarts=*/true);
  if (!scoring)
    return scoring.takeError();
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    int64_t rows = a.B * a.S;
    std::vector<T> qkv(rows * width);
    gemm(false, false, rows, width, x.dim(2), T(1), x.data<T>(), x.dim(2), w.data<T>(), width, T(0),
         qkv.data(), width);
    std::vector<T> b = valuesAs<T>(bias);
    const T *bq = b.empty() ? nullptr : b.data();
    const T *bk = bq ? bq + sizes[0] : nullptr, *bv = bq ? bq + sizes[0] + sizes[1] : nullptr;
    std::vector<T> q(a.B * N * a.S * a.H);
    toHeads(qkv.data(), width, bq, a.B, a.S, N, a.H, q.data(), 0, a.S);
    // present [2,B,N,T,H] holds the keys then the values; with different
    // head sizes (no past) they get their own buffers.
    Tensor present(x.elemType(), {2, a.B, N, a.T, a.H});
    std::vector<T> ownV;
    T *k = present.data<T>(), *v = k + a.B * N * a.T * a.H;
    if (a.Hv != a.H) {
      ownV.resize(a.B * N * a.T * a.Hv);
      v = ownV.data();
    }
    if (past) {
      const T *pk = past->data<T>(), *pv = pk + a.B * N * a.P * a.H;
      copyPast(pk, a.B, N, a.P, a.H, k, a.T);
      copyPast(pv, a.B, N, a.P, a.H, v, a.T);
    }
    toHeads(qkv.data() + sizes[0], width, bk, a.B, a.S, N, a.H, k, a.P, a.T);
    toHeads(qkv.data() + sizes[0] + sizes[1], width, bv, a.B, a.S, N, a.Hv, v, a.P, a.T);
    Tensor out(x.elemType(), {a.B, a.S, sizes[2]});
    attend<T>(a, static_cast<T>(scoring->scale), q.data(), k, v, scoring->maskBias, attentionBias,
              out.data<T>());
    if (a.Hv != a.H)
      return Outputs{out}; // present needs one head size
    return Outputs{out, present};
  });
}

/// MultiHeadAttention: query [B,S,D]; key and value [B,L,Dk] / [B,L,Dv]
/// (projected, split into heads here) or [B,N,L,H] / [B,N,L,Hv] (already
/// split, used as they are); bias [D+Dk+Dv]; key_padding_mask; attention_bias
/// [B|1,N|1,S,T]; past_key / past_value [B,N,P,H]. Outputs output [B,S,Dv],
/// present_key [B,N,T,H] and present_value [B,N,T,Hv], T = P + L.
Expected<Outputs> multiHeadAttention(const OpContext &ctx) {
  const Tensor &query = ctx.input(0);
  const Tensor *key = ctx.optInput(1), *value = ctx.optInput(2), *bias = ctx.optInput(3);
  const Tensor *mask = ctx.optInput(4), *attentionBias = ctx.optInput(5);
  const Tensor *pastKey = ctx.optInput(6), *pastValue = ctx.optInput(7);
  if (ctx.optInput(8) || ctx.optInput(9))
    return ctx.unsupported("past_sequence_length and cache_indirection (beam search buffers)");
  int64_t N = ctx.attrInt("num_heads", 0);
  if (N <= 0)
    return ctx.fail("num_heads must be positive");
  if (query.rank() == 5 || (key && key->rank() == 5) || !key)
    return ctx.unsupported("packed QKV or KV");
  if (query.rank() != 3 || !value)
    return ctx.fail("query must be [batch, sequence, hidden] with key and value, got " +
                    query.describe());
  for (size_t i : {1, 2, 3, 6, 7})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  if (Error e = ctx.integerInput(4, "key_padding_mask"))
    return e;
  AttentionSizes a;
  a.B = query.dim(0), a.S = query.dim(1), a.N = N;
  int64_t D = query.dim(2);
  if (D % N != 0)
    return ctx.fail(formatv("query width {0} is not a multiple of {1} heads", D, N));
  a.H = D / N;
  bool split = key->rank() == 4;
  int64_t L, Dv;
  if (split) {
    if (value->rank() != 4 || key->dim(0) != a.B || key->dim(1) != N || key->dim(3) != a.H ||
        value->dim(0) != a.B || value->dim(1) != N || value->dim(2) != key->dim(2))
      return ctx.fail(formatv("key {0} and value {1} are not [{2}, {3}, kv_sequence, head]",
                              key->describe(), value->describe(), a.B, N));
    if (pastKey || pastValue || bias)
      return ctx.unsupported("past or bias with key and value already split into heads");
    L = key->dim(2), a.Hv = value->dim(3), Dv = N * a.Hv;
  } else {
    if (key->rank() != 3 || value->rank() != 3 || key->dim(0) != a.B || value->dim(0) != a.B ||
        key->dim(1) != value->dim(1) || key->dim(2) != D || value->dim(2) % N != 0)
      return ctx.fail(formatv("key {0} and value {1} are not [{2}, kv_sequence, {3}] and [{2}, "
                              "kv_sequence, {1} heads x v_head]",
                              key->describe(), value->describe(), a.B, D, N));
    L = key->dim(1), Dv = value->dim(2), a.Hv = Dv / N;
  }
  if (bias && (bias->rank() != 1 || bias->dim(0) != 2 * D + Dv))
    return ctx.fail(formatv("bias {0} must be a vector of {1}", bias->describe(), 2 * D + Dv));
  if (static_cast<bool>(pastKey) != static_cast<bool>(pastValue))
    return ctx.fail("past_key and past_value come together");
  if (pastKey) {
    if (pastKey->rank() != 4 || pastKey->dim(0) != a.B || pastKey->dim(1) != N ||
        pastKey->dim(3) != a.H || pastValue->shape() != Shape{a.B, N, pastKey->dim(2), a.Hv})
      return ctx.fail(formatv("past_key {0} and past_value {1} are not [{2}, {3}, past, head]",
                              pastKey->describe(), pastValue->describe(), a.B, N));
    a.P = pastKey->dim(2);
  }
  a.T = a.P + L;
  auto scoring = attentionScoring(ctx, mask, attentionBias, a, /*allowStarts=*/false);
  if (!scoring)
    return scoring.takeError();
  return onFloating(ctx, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    std::vector<T> b = valuesAs<T>(bias);
    const T *bq = b.empty() ? nullptr : b.data();
    const T *bk = bq ? bq + D : nullptr, *bv = bq ? bq + 2 * D : nullptr;
    std::vector<T> q(a.B * N * a.S * a.H);
    toHeads(query.data<T>(), D, bq, a.B, a.S, N, a.H, q.data(), 0, a.S);
    Tensor presentKey(query.elemType(), {a.B, N, a.T, a.H});
    Tensor presentValue(query.elemType(), {a.B, N, a.T, a.Hv});
    T *k = presentKey.data<T>(), *v = presentValue.data<T>();
    if (split) {
      std::copy(key->data<T>(), key->data<T>() + key->numElements(), k);
      std::copy(value->data<T>(), value->data<T>() + value->numElements(), v);
    } else {
      if (pastKey) {
        copyPast(pastKey->data<T>(), a.B, N, a.P, a.H, k, a.T);
        copyPast(pastValue->data<T>(), a.B, N, a.P, a.Hv, v, a.T);
      }
      toHeads(key->data<T>(), D, bk, a.B, L, N, a.H, k, a.P, a.T);
      toHeads(value->data<T>(), Dv, bv, a.B, L, N, a.Hv, v, a.P, a.T);
    }
    Tensor out(query.elemType(), {a.B, a.S, Dv});
    attend<T>(a, static_cast<T>(scoring->scale), q.data(), k, v, scoring->maskBias, attentionBias,
              out.data<T>());
    return Outputs{out, presentKey, presentValue};
  });
}

template Expected<Outputs> skipLayerNormalization<true>(const OpContext &);
template Expected<Outputs> skipLayerNormalization<false>(const OpContext &);

} // namespace pipec::cpu
