//===- AttentionKernels.cpp - The default domain's attention ops ---------===//
//
// Attention (opsets 23, 24, 25), RotaryEmbedding (23), LinearAttention and
// CausalConvWithState (27).
//
// Attention is scaled dot-product attention as the default domain
// specifies it: Q, K and V as [batch, heads, sequence, head] or packed
// [batch, sequence, heads * head] (q_num_heads, kv_num_heads),
// grouped-query heads, a boolean or
// additive attn_mask (broadcast, its last dimension padded with -inf), a
// bottom-right causal frontier, past_key / past_value concatenated into the
// present outputs, softcap, softmax_precision, the four modes of
// qk_matmul_output, nonpad_kv_seqlen (24) and the sliding window of
// left_window_size / right_window_size (25).
//
// The steps are the specification's reference: Q and K scaled by
// sqrt(scale), their product soft-capped, the bias added, a softmax whose
// fully masked rows (every bias -inf) are zero, the product with V. Each
// step's result is rounded to the type the reference computes it in (the
// query's, or softmax_precision's inside the softmax), so float16 and
// bfloat16 results are those of a half-precision evaluation, not of a float
// one rounded once. Products accumulate in float (double for double).
//
// com.microsoft's Attention and MultiHeadAttention are other ops
// (ContribKernels.cpp): projections inside, integer key masks, no softcap.
//
// Before:  Attention(Q [1,1,1,1] = 1, K [1,1,2,1] = [0, 1],
//                    V [1,1,2,1] = [0, 1], is_causal = 0)
// After:   Y = [[[[0.731059]]]]   (softmax [0, 1] = [0.268941, 0.731059])
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::cpu {

namespace {

constexpr double negInf = -std::numeric_limits<double>::infinity();

/// The values of floating tensor \p t as A.
template <typename A> std::vector<A> valuesOf(const Tensor &t) {
  std::vector<A> out(t.numElements());
  visitStorage(t.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>)
      std::copy(t.data<T>(), t.data<T>() + t.numElements(), out.begin());
  });
  return out;
}

/// A tensor of floating type \p type holding \p values, rounded to what
/// the type holds.
template <typename A> Tensor tensorOf(DType type, Shape shape, const std::vector<A> &values) {
  Tensor out(type, std::move(shape));
  visitStorage(type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (isFloat<T>)
      std::transform(values.begin(), values.end(), out.data<T>(),
                     [](A v) { return static_cast<T>(v); });
  });
  out.roundToElemType();
  return out;
}

/// The sizes of one attention: batch, query and key/value heads, queries,
/// past and new keys (keys = pastKeys + newKeys), the head sizes of Q and K
/// (head) and of V (valueHead). Packed: Q, K and V are [batch, sequence,
/// heads * head].
struct AttentionSizes {
  int64_t batch = 0, qHeads = 0, kvHeads = 0, queries = 0, newKeys = 0, pastKeys = 0, keys = 0,
          head = 0, valueHead = 0;
  bool packed = false;
};

/// Checks Q, K, V and the past inputs and returns the sizes.
Expected<AttentionSizes> attentionSizes(const OpContext &ctx) {
  const Tensor &q = ctx.input(0), &k = ctx.input(1), &v = ctx.input(2);
  const Tensor *pastKey = ctx.optInput(4), *pastValue = ctx.optInput(5);
  if (!isFloating(q.elemType()) || !isFloating(v.elemType()))
    return ctx.fail(formatv("Q {0} and V {1} must be floating", q.describe(), v.describe()));
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (q.rank() != k.rank() || q.rank() != v.rank() || (q.rank() != 3 && q.rank() != 4))
    return ctx.fail(formatv("Q {0}, K {1} and V {2} must all be 3-D or all 4-D", q.describe(),
                            k.describe(), v.describe()));
  AttentionSizes a;
  a.packed = q.rank() == 3;
  const auto *qHeads = ctx.attr("q_num_heads"), *kvHeads = ctx.attr("kv_num_heads");
  if (a.packed) {
    a.qHeads = ctx.attrInt("q_num_heads", 0), a.kvHeads = ctx.attrInt("kv_num_heads", 0);
    if (a.qHeads <= 0 || a.kvHeads <= 0)
      return ctx.fail("3-D Q, K and V need positive q_num_heads and kv_num_heads");
    if (q.dim(2) % a.qHeads || k.dim(2) % a.kvHeads || v.dim(2) % a.kvHeads)
      return ctx.fail(formatv("Q {0}, K {1} and V {2} do not split into {3} and {4} heads",
                              q.describe(), k.describe(), v.describe(), a.qHeads, a.kvHeads));
    a.batch = q.dim(0), a.queries = q.dim(1), a.head = q.dim(2) / a.qHeads, a.newKeys = k.dim(1);
    a.valueHead = v.dim(2) / a.kvHeads;
    if (k.dim(2) / a.kvHeads != a.head)
      return ctx.fail(formatv("K {0} does not have Q's head size {1}", k.describe(), a.head));
  } else {
    if (ctx.opset >= 25 && (qHeads || kvHeads))
      return ctx.fail("q_num_heads and kv_num_heads are for 3-D inputs only");
    a.batch = q.dim(0), a.qHeads = q.dim(1), a.queries = q.dim(2), a.head = q.dim(3);
    a.kvHeads = k.dim(1), a.newKeys = k.dim(2), a.valueHead = v.dim(3);
    if (k.dim(3) != a.head || v.dim(1) != a.kvHeads)
      return ctx.fail(
          formatv("K {0} and V {1} do not match Q {2}", k.describe(), v.describe(), q.describe()));
  }
  if (k.dim(0) != a.batch || v.dim(0) != a.batch || v.dim(a.packed ? 1 : 2) != a.newKeys)
    return ctx.fail(formatv("K {0} and V {1} must share Q's batch and one sequence length",
                            k.describe(), v.describe()));
  if (a.kvHeads <= 0 || a.qHeads % a.kvHeads != 0)
    return ctx.fail(
        formatv("{0} query heads are not a multiple of {1} key/value heads", a.qHeads, a.kvHeads));
  if (static_cast<bool>(pastKey) != static_cast<bool>(pastValue))
    return ctx.fail("past_key and past_value come together");
  if (pastKey) {
    a.pastKeys = pastKey->rank() == 4 ? pastKey->dim(2) : -1;
    if (a.pastKeys < 0 || pastKey->shape() != Shape{a.batch, a.kvHeads, a.pastKeys, a.head} ||
        pastValue->shape() != Shape{a.batch, a.kvHeads, a.pastKeys, a.valueHead})
      return ctx.fail(formatv("past_key {0} and past_value {1} are not [{2}, {3}, past, {4} "
                              "and {5}]",
                              pastKey->describe(), pastValue->describe(), a.batch, a.kvHeads,
                              a.head, a.valueHead));
    if (Error e = ctx.sameType(4, 0))
      return e;
    if (Error e = ctx.sameType(5, 2))
      return e;
  }
  a.keys = a.pastKeys + a.newKeys;
  return a;
}

/// \p x (Q, K or V: [batch, heads, new, width] or packed [batch, new, heads
/// * width]) after \p past ([batch, heads, past, width] or null) along the
/// sequence: [batch, heads, past + new, width], of x's type.
Tensor concatHeads(const Tensor *past, const Tensor &x, bool packed, int64_t heads, int64_t width) {
  int64_t batch = x.dim(0), newKeys = packed ? x.dim(1) : x.dim(2),
          pastKeys = past ? past->dim(2) : 0;
  Tensor out(x.elemType(), {batch, heads, pastKeys + newKeys, width});
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    T *dst = out.data<T>();
    const T *src = x.data<T>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t n = 0; n < heads; ++n) {
        T *rows = dst + (b * heads + n) * (pastKeys + newKeys) * width;
        if (past)
          std::copy_n(past->data<T>() + (b * heads + n) * pastKeys * width, pastKeys * width, rows);
        for (int64_t l = 0; l < newKeys; ++l) {
          const T *from = packed ? src + ((b * newKeys + l) * heads + n) * width
                                 : src + ((b * heads + n) * newKeys + l) * width;
          std::copy_n(from, width, rows + (pastKeys + l) * width);
        }
      }
  });
  return out;
}

/// The additive bias of one (batch, head): attn_mask (broadcast, padded
/// with -inf), the causal frontier, the sliding window and the padding of
/// nonpad_kv_seqlen, each 0 or -inf but a float mask's values.
class AttentionBias {
public:
  static Expected<AttentionBias> make(const OpContext &ctx, const AttentionSizes &a);
  /// Fills \p row [queries, keys] with the bias of batch \p b, query head \p h.
  void fill(int64_t b, int64_t h, std::vector<double> &row) const;

private:
  AttentionSizes a;
  const Tensor *mask = nullptr;
  std::vector<double> maskValues; // bool: 0 / -inf
  std::array<int64_t, 4> maskStrides{};
  int64_t maskWidth = 0;
  std::vector<int64_t> offsets, nonpad; // per batch
  bool causal = false;
  int64_t left = -1, right = -1;
};

Expected<AttentionBias> AttentionBias::make(const OpContext &ctx, const AttentionSizes &a) {
  AttentionBias bias;
  bias.a = a;
  bias.causal = ctx.attrInt("is_causal", 0) != 0;
  if (ctx.opset >= 25) {
    bias.left = ctx.attrInt("left_window_size", -1);
    bias.right = ctx.attrInt("right_window_size", -1);
    if (bias.left < -1 || bias.right < -1)
      return ctx.fail(
          formatv("window sizes {0} and {1} must be -1 or nonnegative", bias.left, bias.right));
  }
  const Tensor *nonpad = ctx.optInput(6);
  if (nonpad && ctx.opset < 24)
    return ctx.fail("nonpad_kv_seqlen is an input from opset 24 on");
  if (nonpad) {
    if (ctx.optInput(4))
      return ctx.fail("nonpad_kv_seqlen cannot be combined with past_key and past_value");
    if (Error e = ctx.integerInput(6, "nonpad_kv_seqlen"))
      return e;
    if (nonpad->shape() != Shape{a.batch})
      return ctx.fail(formatv("nonpad_kv_seqlen {0} must be [{1}]", nonpad->describe(), a.batch));
    bias.nonpad = nonpad->toInt64Vector();
  }
  // The frontier's offset: the cached keys before the query block.
  for (int64_t b = 0; b < a.batch; ++b)
    bias.offsets.push_back(nonpad ? bias.nonpad[b] - a.queries : a.pastKeys);
  const Tensor *mask = bias.mask = ctx.optInput(3);
  if (!mask)
    return bias;
  DType maskType = mask->elemType(), queryType = ctx.input(0).elemType();
  if (maskType != DType::Bool && !isFloating(maskType))
    return ctx.fail("attn_mask must be bool or floating, got " + mask->describe());
  Shape target{a.batch, a.qHeads, a.queries, a.keys};
  int64_t rank = mask->rank();
  bool fits = rank >= 1 && rank <= 4 && mask->dim(-1) <= a.keys;
  for (int64_t i = 0; fits && i + 1 < rank; ++i) {
    int64_t d = mask->dim(i - rank);
    fits = d == 1 || d == target[4 + i - rank];
  }
  if (!fits)
    return ctx.fail(formatv("attn_mask {0} does not broadcast to {1} (its last dimension may "
                            "be shorter)",
                            mask->describe(), shapeString(target)));
  bias.maskWidth = mask->dim(-1);
  Shape strides = stridesOf(mask->shape());
  for (int64_t i = 0; i < rank; ++i)
    bias.maskStrides[4 - rank + i] = mask->dim(i) == 1 && i + 1 < rank ? 0 : strides[i];
  bias.maskValues.resize(mask->numElements());
  // A float mask joins the bias in the query's type (the specification's
  // Cast of the bias to T1), whatever its own floating type.
  for (int64_t i = 0; i < mask->numElements(); ++i)
    bias.maskValues[i] = maskType == DType::Bool ? (mask->getInt64(i) ? 0.0 : negInf)
                                                 : roundAs(queryType, mask->getDouble(i));
  return bias;
}

void AttentionBias::fill(int64_t b, int64_t h, std::vector<double> &row) const {
  int64_t queries = a.queries, keys = a.keys, offset = offsets[b];
  for (int64_t i = 0; i < queries; ++i)
    for (int64_t j = 0; j < keys; ++j) {
      double v = 0;
      if (mask)
        v = j < maskWidth ? maskValues[b * maskStrides[0] + h * maskStrides[1] +
                                       i * maskStrides[2] + j * maskStrides[3]]
                          : negInf;
      int64_t past = i + offset - j; // > 0: key j precedes the query
      if (causal && past < 0)
        v += negInf;
      if ((left >= 0 && past > left) || (right >= 0 && -past > right))
        v += negInf;
      if (!nonpad.empty() && j >= nonpad[b])
        v += negInf;
      row[i * keys + j] = v;
    }
}

/// What the attributes ask: sqrt(scale), softcap, the mode of
/// qk_matmul_output and the types the steps are rounded to.
struct AttentionOptions {
  double rootScale = 0, softcap = 0;
  int64_t mode = 0;
  DType outType = DType::F32, softmaxType = DType::F32;
};

Expected<AttentionOptions> attentionOptions(const OpContext &ctx, const AttentionSizes &a) {
  AttentionOptions o;
  o.outType = o.softmaxType = ctx.input(0).elemType();
  double scale = ctx.attr("scale") ? ctx.attrFloat("scale", 0) : 1 / std::sqrt(double(a.head));
  // The reference takes the root in double and casts it to the query's type.
  o.rootScale = roundAs(o.outType, std::sqrt(scale));
  // The cap divides and multiplies in the query's type.
  o.softcap = roundAs(o.outType, ctx.attrFloat("softcap", 0));
  o.mode = ctx.attrInt("qk_matmul_output_mode", 0);
  if (o.mode < 0 || o.mode > 3)
    return ctx.fail(formatv("qk_matmul_output_mode {0} is not 0, 1, 2 or 3", o.mode));
  if (ctx.attr("softmax_precision")) {
    int64_t precision = ctx.attrInt("softmax_precision", 0);
    if (precision != 1 && precision != 10 && precision != 11 && precision != 16)
      return ctx.fail(
          formatv("softmax_precision {0} is not FLOAT, FLOAT16, DOUBLE or BFLOAT16", precision));
    o.softmaxType = static_cast<DType>(precision);
  }
  return o;
}

/// The softmax of one row of \p count scores in \p x, in place, each step
/// rounded to \p type as the reference's half-precision evaluation rounds
/// it (bfloat16 sums one element at a time, as ml_dtypes' reductions do).
/// A row whose maximum is -inf gives zeros.
void softmaxRow(double *x, int64_t count, DType type) {
  double maxValue = negInf;
  bool nan = false;
  for (int64_t j = 0; j < count; ++j) {
    nan |= std::isnan(x[j]);
    maxValue = std::max(maxValue, x[j]);
  }
  if (nan)
    maxValue = std::numeric_limits<double>::quiet_NaN();
  if (maxValue == negInf)
    maxValue = 0;
  double sum = 0;
  for (int64_t j = 0; j < count; ++j) {
    x[j] = roundAs(type, std::exp(roundAs(type, x[j] - maxValue)));
    sum = type == DType::BF16 ? roundAs(type, sum + x[j]) : sum + x[j];
  }
  sum = roundAs(type, sum);
  if (sum == 0)
    sum = 1;
  for (int64_t j = 0; j < count; ++j)
    x[j] = roundAs(type, x[j] / sum);
}

/// The attention of every (batch, query head) in accumulation type A.
/// \p presentKeys and \p presentValues are [batch, kvHeads, keys, *].
template <typename A>
Outputs attend(const OpContext &ctx, const AttentionSizes &a, const AttentionOptions &o,
               const AttentionBias &bias, const Tensor &presentKeys, const Tensor &presentValues) {
  const Tensor &query = ctx.input(0);
  auto r = [&](double v) { return roundAs(o.outType, v); };
  int64_t queries = a.queries, keys = a.keys, head = a.head, valueHead = a.valueHead,
          group = a.qHeads / a.kvHeads;
  // Q and K scaled by sqrt(scale), Q as [batch, qHeads, queries, head].
  std::vector<A> q = valuesOf<A>(concatHeads(nullptr, query, a.packed, a.qHeads, head));
  std::vector<A> k = valuesOf<A>(presentKeys), v = valuesOf<A>(presentValues);
  for (A &x : q)
    x = static_cast<A>(r(x * o.rootScale));
  for (A &x : k)
    x = static_cast<A>(r(x * o.rootScale));
  bool wantScores = ctx.wantsOutput(3);
  std::vector<A> scoresOut(wantScores ? a.batch * a.qHeads * queries * keys : 0),
      y(a.batch * a.qHeads * queries * valueHead);
  std::vector<A> scores(queries * keys), probs(queries * keys);
  std::vector<double> biasRow(queries * keys), row(keys);
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t h = 0; h < a.qHeads; ++h) {
      int64_t kv = b * a.kvHeads + h / group;
      gemm(false, true, queries, keys, head, A(1), q.data() + (b * a.qHeads + h) * queries * head,
           head, k.data() + kv * keys * head, head, A(0), scores.data(), keys);
      bias.fill(b, h, biasRow);
      for (int64_t i = 0; i < queries; ++i) {
        const double *rowBias = biasRow.data() + i * keys;
        bool masked = true;
        for (int64_t j = 0; j < keys; ++j) {
          double raw = r(scores[i * keys + j]), capped = raw;
          if (o.softcap > 0)
            capped = r(r(std::tanh(r(raw / o.softcap))) * o.softcap);
          row[j] = r(capped + rowBias[j]);
          masked &= rowBias[j] == negInf;
          if (wantScores && o.mode < 3)
            scoresOut[((b * a.qHeads + h) * queries + i) * keys + j] =
                static_cast<A>(o.mode == 0   ? raw
                               : o.mode == 1 ? capped
                                             : row[j]);
        }
        for (int64_t j = 0; j < keys; ++j)
          row[j] = roundAs(o.softmaxType, row[j]);
        softmaxRow(row.data(), keys, o.softmaxType);
        for (int64_t j = 0; j < keys; ++j) {
          // A fully masked row attends nothing: zeros, not NaN.
          double p = masked ? 0 : r(row[j]);
          probs[i * keys + j] = static_cast<A>(p);
          if (wantScores && o.mode == 3)
            scoresOut[((b * a.qHeads + h) * queries + i) * keys + j] = static_cast<A>(p);
        }
      }
      A *out = a.packed ? y.data() + b * queries * a.qHeads * valueHead + h * valueHead
                        : y.data() + (b * a.qHeads + h) * queries * valueHead;
      gemm(false, false, queries, valueHead, keys, A(1), probs.data(), keys,
           v.data() + kv * keys * valueHead, valueHead, A(0), out,
           a.packed ? a.qHeads * valueHead : valueHead);
    }
  Shape yShape = a.packed ? Shape{a.batch, queries, a.qHeads * valueHead}
                          : Shape{a.batch, a.qHeads, queries, valueHead};
  return {tensorOf(o.outType, yShape, y), Tensor(), Tensor(),
          wantScores ? tensorOf(o.outType, {a.batch, a.qHeads, queries, keys}, scoresOut)
                     : Tensor()};
}

} // namespace

/// Attention (ONNX 23, 24, 25). Outputs Y, present_key, present_value and
/// qk_matmul_output.
Expected<Outputs> onnxAttention(const OpContext &ctx) {
  auto sizes = attentionSizes(ctx);
  if (!sizes)
    return sizes.takeError();
  auto bias = AttentionBias::make(ctx, *sizes);
  if (!bias)
    return bias.takeError();
  auto options = attentionOptions(ctx, *sizes);
  if (!options)
    return options.takeError();
  const AttentionSizes &a = *sizes;
  Tensor keys = concatHeads(ctx.optInput(4), ctx.input(1), a.packed, a.kvHeads, a.head);
  Tensor values = concatHeads(ctx.optInput(5), ctx.input(2), a.packed, a.kvHeads, a.valueHead);
  bool wide = ctx.input(0).elemType() == DType::F64 || values.elemType() == DType::F64;
  Outputs out = wide ? attend<double>(ctx, a, *options, *bias, keys, values)
                     : attend<float>(ctx, a, *options, *bias, keys, values);
  out[1] = keys;
  out[2] = values;
  return out;
}

//===----------------------------------------------------------------------===//
// RotaryEmbedding
//===----------------------------------------------------------------------===//

/// RotaryEmbedding (ONNX 23): rotates the first rotary_embedding_dim values
/// of each head, as halves (x[i], x[i + dim / 2]) or interleaved pairs
/// (x[2i], x[2i + 1]), by the angles of the token's cos_cache and sin_cache
/// rows. X is [B, N, S, H] or [B, S, N * H] (num_heads); the caches are
/// [positions, dim / 2] indexed by position_ids [B, S], or [B, S, dim / 2]
/// without them.
Expected<Outputs> onnxRotaryEmbedding(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &cos = ctx.input(1), &sin = ctx.input(2);
  const Tensor *ids = ctx.optInput(3);
  if (!isFloating(x.elemType()))
    return ctx.unsupportedType(x, 0);
  for (size_t i : {1, 2})
    if (Error e = ctx.sameType(i, 0))
      return e;
  if (Error e = ctx.integerInput(3, "position_ids"))
    return e;
  int64_t batch, seqLen, heads, head, headStride, seqStride;
  if (x.rank() == 4) {
    batch = x.dim(0), heads = x.dim(1), seqLen = x.dim(2), head = x.dim(3);
    headStride = seqLen * head, seqStride = head;
  } else if (x.rank() == 3) {
    heads = ctx.attrInt("num_heads", 0);
    if (heads <= 0 || x.dim(2) % heads != 0)
      return ctx.fail(formatv("3-D X {0} needs num_heads that divides its last dimension, got {1}",
                              x.describe(), heads));
    batch = x.dim(0), seqLen = x.dim(1), head = x.dim(2) / heads;
    headStride = head, seqStride = heads * head;
  } else {
    return ctx.fail("X must be [batch, heads, sequence, head] or [batch, sequence, hidden], got " +
                    x.describe());
  }
  int64_t dim = ctx.attrInt("rotary_embedding_dim", 0);
  if (dim == 0)
    dim = head;
  int64_t half = dim / 2;
  if (dim < 0 || dim % 2 != 0 || dim > head)
    return ctx.fail(
        formatv("rotary_embedding_dim {0} must be even and at most the head size {1}", dim, head));
  // Cache rows: by position id, or one per (batch, token); 1s broadcast.
  int64_t cacheRank = ids ? 2 : 3;
  bool fits = cos.rank() == cacheRank && sin.shape() == cos.shape() && cos.dim(-1) == half;
  if (fits && ids)
    fits = ids->rank() == 2 && (ids->dim(0) == batch || ids->dim(0) == 1) &&
           (ids->dim(1) == seqLen || ids->dim(1) == 1);
  if (fits && !ids)
    fits = (cos.dim(0) == batch || cos.dim(0) == 1) && (cos.dim(1) == seqLen || cos.dim(1) == 1);
  if (!fits)
    return ctx.fail(formatv("cos_cache {0}, sin_cache {1} and position_ids {2} do not fit "
                            "{3} tokens of rotary dimension {4}",
                            cos.describe(), sin.describe(), ids ? ids->describe() : "(none)",
                            shapeString({batch, seqLen}), dim));
  bool interleaved = ctx.attrInt("interleaved", 0) != 0;
  auto r = [&](double v) { return roundAs(x.elemType(), v); };
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!isFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y = x.clone();
      const T *in = x.data<T>(), *cosData = cos.data<T>(), *sinData = sin.data<T>();
      T *out = y.data<T>();
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t s = 0; s < seqLen; ++s) {
          int64_t cacheRow;
          if (ids) {
            int64_t at = (ids->dim(0) == 1 ? 0 : b) * ids->dim(1) + (ids->dim(1) == 1 ? 0 : s);
            cacheRow = ids->getInt64(at);
            if (cacheRow < 0 || cacheRow >= cos.dim(0))
              return ctx.fail(formatv("position id {0} is out of range for a cache of {1} rows",
                                      cacheRow, cos.dim(0)));
          } else {
            cacheRow = (cos.dim(0) == 1 ? 0 : b) * cos.dim(1) + (cos.dim(1) == 1 ? 0 : s);
          }
          const T *c = cosData + cacheRow * half, *sn = sinData + cacheRow * half;
          for (int64_t n = 0; n < heads; ++n) {
            int64_t base = b * seqLen * heads * head + n * headStride + s * seqStride;
            for (int64_t i = 0; i < half; ++i) {
              int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
              // Each product and sum in X's type, as the specification's
              // Mul, Sub and Add nodes compute them.
              double re = in[base + first], im = in[base + second];
              out[base + first] = static_cast<T>(r(r(c[i] * re) - r(sn[i] * im)));
              out[base + second] = static_cast<T>(r(r(sn[i] * re) + r(c[i] * im)));
            }
          }
        }
      return Outputs{y};
    }
  });
}

//===----------------------------------------------------------------------===//
// LinearAttention and CausalConvWithState
//===----------------------------------------------------------------------===//

namespace {

/// The update rules of LinearAttention: whether the state decays by
/// exp(decay) and whether writes are delta-corrected by beta.
struct LinearRule {
  bool gated = false, delta = false;
};

/// Checks LinearAttention's inputs; returns the rule, and through \p sizes
/// batch, sequence, q and kv heads, dk, dv.
Expected<LinearRule> linearAttentionRule(const OpContext &ctx, std::array<int64_t, 6> &sizes) {
  const Tensor &q = ctx.input(0), &k = ctx.input(1), &v = ctx.input(2);
  const Tensor *past = ctx.optInput(3), *decay = ctx.optInput(4), *beta = ctx.optInput(5);
  std::string rule = ctx.attrString("update_rule", "gated_delta");
  LinearRule r;
  if (rule != "linear" && rule != "gated" && rule != "delta" && rule != "gated_delta")
    return ctx.fail("update_rule '" + rule + "' is none of linear, gated, delta, gated_delta");
  r.gated = rule == "gated" || rule == "gated_delta";
  r.delta = rule == "delta" || rule == "gated_delta";
  if (r.gated != static_cast<bool>(decay) || r.delta != static_cast<bool>(beta))
    return ctx.fail("update_rule '" + rule + "' takes decay " + (r.gated ? "and" : "but not") +
                    " beta " + (r.delta ? "" : "not"));
  int64_t qHeads = ctx.attrInt("q_num_heads", 0), kvHeads = ctx.attrInt("kv_num_heads", 0);
  if (qHeads <= 0 || kvHeads <= 0 || qHeads % kvHeads != 0)
    return ctx.fail(formatv("q_num_heads {0} must be a positive multiple of kv_num_heads {1}",
                            qHeads, kvHeads));
  for (size_t i : {0, 1, 2, 4, 5})
    if (const Tensor *t = ctx.optInput(i); t && (t->rank() != 3 || !isFloating(t->elemType())))
      return ctx.fail(formatv("input {0} must be a floating [batch, sequence, packed], got {1}", i,
                              t->describe()));
  for (size_t i : {1, 2, 4, 5})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  int64_t batch = q.dim(0), seqLen = q.dim(1);
  if (q.dim(2) % qHeads != 0 || v.dim(2) % kvHeads != 0)
    return ctx.fail(formatv("query {0} and value {1} do not split into {2} and {3} heads",
                            q.describe(), v.describe(), qHeads, kvHeads));
  int64_t dk = q.dim(2) / qHeads, dv = v.dim(2) / kvHeads;
  Shape bt{batch, seqLen};
  auto leading = [&](const Tensor &t) { return Shape{t.dim(0), t.dim(1)} == bt; };
  if (!leading(k) || !leading(v) || k.dim(2) != kvHeads * dk)
    return ctx.fail(formatv("key {0} and value {1} do not match query {2} with {3} kv heads",
                            k.describe(), v.describe(), q.describe(), kvHeads));
  if (decay && (!leading(*decay) || (decay->dim(2) != kvHeads && decay->dim(2) != kvHeads * dk)))
    return ctx.fail(formatv("decay {0} must be [{1}, {2}, {3} or {4}]", decay->describe(), batch,
                            seqLen, kvHeads, kvHeads * dk));
  if (beta && (!leading(*beta) || (beta->dim(2) != kvHeads && beta->dim(2) != 1)))
    return ctx.fail(
        formatv("beta {0} must be [{1}, {2}, {3} or 1]", beta->describe(), batch, seqLen, kvHeads));
  if (past && (past->shape() != Shape{batch, kvHeads, dk, dv} || !isFloating(past->elemType())))
    return ctx.fail(formatv("past_state {0} must be a floating [{1}, {2}, {3}, {4}]",
                            past->describe(), batch, kvHeads, dk, dv));
  sizes = {batch, seqLen, qHeads, kvHeads, dk, dv};
  return r;
}

} // namespace

/// LinearAttention (ONNX 27): the recurrence of update_rule run token by
/// token in float, as the specification defines it (chunk_size only tunes
/// chunked evaluations). Outputs output [B, T, Hq * dv] and present_state
/// [B, Hkv, dk, dv], of past_state's type (the query's without one).
Expected<Outputs> linearAttention(const OpContext &ctx) {
  std::array<int64_t, 6> sizes;
  auto rule = linearAttentionRule(ctx, sizes);
  if (!rule)
    return rule.takeError();
  auto [batch, seqLen, qHeads, kvHeads, dk, dv] = sizes;
  const Tensor *pastIn = ctx.optInput(3), *decayIn = ctx.optInput(4), *betaIn = ctx.optInput(5);
  std::vector<float> q = valuesOf<float>(ctx.input(0)), k = valuesOf<float>(ctx.input(1));
  std::vector<float> v = valuesOf<float>(ctx.input(2));
  std::vector<float> state =
      pastIn ? valuesOf<float>(*pastIn) : std::vector<float>(batch * kvHeads * dk * dv);
  std::vector<float> decay = decayIn ? valuesOf<float>(*decayIn) : std::vector<float>();
  std::vector<float> beta = betaIn ? valuesOf<float>(*betaIn) : std::vector<float>();
  int64_t decayWidth = decayIn ? decayIn->dim(2) : 0, betaWidth = betaIn ? betaIn->dim(2) : 0;
  double scale = ctx.attrFloat("scale", 0);
  if (scale == 0)
    scale = 1 / std::sqrt(static_cast<double>(dk));
  int64_t group = qHeads / kvHeads;
  std::vector<float> out(batch * seqLen * qHeads * dv), update(dv);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kvHeads; ++h) {
      float *s = state.data() + (b * kvHeads + h) * dk * dv;
      for (int64_t t = 0; t < seqLen; ++t) {
        int64_t token = b * seqLen + t;
        const float *kt = k.data() + (token * kvHeads + h) * dk,
                    *vt = v.data() + (token * kvHeads + h) * dv;
        if (rule->gated)
          for (int64_t d = 0; d < dk; ++d) {
            float g = decay[token * decayWidth + (decayWidth == kvHeads ? h : h * dk + d)];
            float factor = std::exp(g);
            for (int64_t m = 0; m < dv; ++m)
              s[d * dv + m] *= factor;
          }
        for (int64_t m = 0; m < dv; ++m)
          update[m] = vt[m];
        if (rule->delta) {
          float rate = beta[token * betaWidth + (betaWidth == 1 ? 0 : h)];
          for (int64_t m = 0; m < dv; ++m) {
            double retrieved = 0;
            for (int64_t d = 0; d < dk; ++d)
              retrieved += double(s[d * dv + m]) * kt[d];
            update[m] = rate * (vt[m] - static_cast<float>(retrieved));
          }
        }
        for (int64_t d = 0; d < dk; ++d)
          for (int64_t m = 0; m < dv; ++m)
            s[d * dv + m] += kt[d] * update[m];
        // The query heads of this kv head read the updated state.
        for (int64_t g = 0; g < group; ++g) {
          int64_t head = h * group + g;
          const float *qt = q.data() + (token * qHeads + head) * dk;
          float *o = out.data() + (token * qHeads + head) * dv;
          for (int64_t m = 0; m < dv; ++m) {
            double sum = 0;
            for (int64_t d = 0; d < dk; ++d)
              sum += double(qt[d]) * s[d * dv + m];
            o[m] = static_cast<float>(scale * static_cast<float>(sum));
          }
        }
      }
    }
  DType outType = ctx.input(0).elemType();
  DType stateType = pastIn ? pastIn->elemType() : outType;
  return Outputs{tensorOf(outType, {batch, seqLen, qHeads * dv}, out),
                 tensorOf(stateType, {batch, kvHeads, dk, dv}, state)};
}

/// CausalConvWithState (ONNX 27): a depthwise convolution of each channel
/// of input [B, C, L] with weight [C, 1, k] over the input preceded by
/// past_state [B, C, k - 1] (zeros without one), plus bias [C], then SiLU
/// when activation is silu or swish. Outputs output [B, C, L] and
/// present_state, the last k - 1 positions of past and input together.
Expected<Outputs> causalConvWithState(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &w = ctx.input(1);
  const Tensor *bias = ctx.optInput(2), *past = ctx.optInput(3);
  std::string activation = ctx.attrString("activation", "none");
  if (activation != "none" && activation != "silu" && activation != "swish")
    return ctx.fail("activation '" + activation + "' is none of none, silu, swish");
  if (!isFloating(x.elemType()))
    return ctx.unsupportedType(x, 0);
  for (size_t i : {1, 2, 3})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  if (x.rank() != 3 || w.rank() != 3 || w.dim(0) != x.dim(1) || w.dim(1) != 1 || w.dim(2) < 1)
    return ctx.fail(formatv("input {0} and weight {1} are not [batch, channels, length] and "
                            "[channels, 1, k >= 1]",
                            x.describe(), w.describe()));
  int64_t batch = x.dim(0), channels = x.dim(1), length = x.dim(2), kernel = w.dim(2);
  if (bias && bias->shape() != Shape{channels})
    return ctx.fail(formatv("bias {0} must be [{1}]", bias->describe(), channels));
  if (past && past->shape() != Shape{batch, channels, kernel - 1})
    return ctx.fail(formatv("past_state {0} must be [{1}, {2}, {3}]", past->describe(), batch,
                            channels, kernel - 1));
  DType type = x.elemType();
  bool silu = activation != "none";
  std::vector<double> in = valuesOf<double>(x), weight = valuesOf<double>(w);
  std::vector<double> bs = bias ? valuesOf<double>(*bias) : std::vector<double>(channels);
  std::vector<double> state =
      past ? valuesOf<double>(*past) : std::vector<double>(batch * channels * (kernel - 1));
  std::vector<double> out(batch * channels * length), present(batch * channels * (kernel - 1)),
      padded(length + kernel - 1);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c) {
      int64_t bc = b * channels + c;
      std::copy_n(state.begin() + bc * (kernel - 1), kernel - 1, padded.begin());
      std::copy_n(in.begin() + bc * length, length, padded.begin() + kernel - 1);
      for (int64_t l = 0; l < length; ++l) {
        double sum = bs[c];
        for (int64_t j = 0; j < kernel; ++j)
          sum += weight[c * kernel + j] * padded[l + j];
        // The convolution's result is of X's type before the activation.
        double y = roundAs(type, sum);
        out[bc * length + l] = silu ? y / (1 + std::exp(-y)) : y;
      }
      std::copy_n(padded.begin() + length, kernel - 1, present.begin() + bc * (kernel - 1));
    }
  return Outputs{tensorOf(type, {batch, channels, length}, out),
                 tensorOf(type, {batch, channels, kernel - 1}, present)};
}

} // namespace pipec::cpu
