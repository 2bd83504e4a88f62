//===- GroupQueryAttention.cpp - com.microsoft GroupQueryAttention on CPU -===//
//
// The attention of onnxruntime-genai's decoders: N query heads over Nkv key
// and value heads, causal, with the KV cache as a buffer each row fills from
// position 0. Inputs, attributes and outputs are those of onnxruntime's
// docs/ContribOperators.md; where that text is silent the kernel does what
// onnxruntime's CPU kernel does:
//   - seqlens_k[b] is row b's total length less one, total_sequence_length
//     the present's length (at least the past buffer's).
//   - A pass whose S queries are the whole total length is a first prompt:
//     every row starts at position 0 (rows shorter than S are right-padded).
//     Otherwise row b's new keys start at seqlens_k[b] + 1 - S, where its
//     past ends. onnxruntime allows S > 1 there only for one row; this
//     kernel takes any number, each at its own position.
//   - The present holds the past's first positions of the row, then the new
//     keys and values (rotated, for keys, with do_rotary), then zeros.
//   - Query s of row b sees keys up to its own position and within the
//     row's length (a first prompt's padding sees the row's keys), the last
//     local_window_size of them with a window.
//   - do_rotary rotates queries and new keys by their positions (a first
//     prompt's padding by its index too), with cos_cache and sin_cache
//     [positions, rotary_dim / 2]; pairs are (i, i + rotary_dim / 2), or
//     (2i, 2i + 1) with rotary_interleaved.
//   - softcap c replaces a scaled score x by c tanh(x / c); smooth_softmax
//     adds exp(0) to each softmax's sum.
// position_ids, attention_bias and head_sink (inputs 9 to 11) give an
// UnsupportedError.
//
// Before:  query [1,1,N*H], past_key [1,Nkv,3,H], seqlens_k = [3],
//          total_sequence_length = 4
// After:   present_key [1,Nkv,4,H]: the past's 3 positions, then the new key;
//          output [1,1,N*H]: each head's attention over those 4 keys
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "support/Parallel.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

using namespace llvm;

namespace pipec::cpu {

namespace {

/// The sizes of one GroupQueryAttention, and where each row's new
/// positions go.
struct GqaSizes {
  int64_t B = 0, S = 0, N = 0, Nkv = 0, H = 0;
  int64_t past = 0;       // the past buffer's positions
  int64_t present = 0;    // the present's: max(total_sequence_length, past)
  int64_t rotaryHalf = 0; // 0 without do_rotary
  bool packed = false, interleaved = false;
  /// Row widths of query, key and value (packed: all three in query's).
  int64_t qStride = 0, kStride = 0, vStride = 0, kOffset = 0, vOffset = 0;
  /// Per row: its first new position (where its past ends) and its length.
  std::vector<int64_t> start, length;
  int64_t window = -1;
  float scale = 1, softcap = 0;
  bool smooth = false;
};

/// The sizes of \p ctx's GroupQueryAttention, its inputs checked.
Expected<GqaSizes> gqaSizes(const OpContext &ctx) {
  const Tensor &query = ctx.input(0);
  const Tensor *key = ctx.optInput(1), *value = ctx.optInput(2);
  const Tensor *pastKey = ctx.optInput(3), *pastValue = ctx.optInput(4);
  const Tensor *cosCache = ctx.optInput(7), *sinCache = ctx.optInput(8);
  if (ctx.optInput(9) || ctx.optInput(10) || ctx.optInput(11))
    return ctx.unsupported("position_ids, attention_bias and head_sink");
  if (ctx.numInputs() < 7 || !ctx.optInput(5) || !ctx.optInput(6))
    return ctx.fail("seqlens_k and total_sequence_length (inputs 5 and 6) are required");
  const Tensor &seqlens = ctx.input(5), &total = ctx.input(6);
  if (Error e = ctx.integerInput(5, "seqlens_k"))
    return e;
  if (Error e = ctx.integerInput(6, "total_sequence_length"))
    return e;
  for (size_t i : {1, 2, 3, 4, 7, 8})
    if (Error e = ctx.sameTypeAsFirst(i))
      return e;
  GqaSizes a;
  a.N = ctx.attrInt("num_heads", 0), a.Nkv = ctx.attrInt("kv_num_heads", 0);
  if (a.N <= 0 || a.Nkv <= 0 || a.N % a.Nkv != 0)
    return ctx.fail(
        formatv("num_heads {0} must be a positive multiple of kv_num_heads {1}", a.N, a.Nkv));
  if (query.rank() != 3)
    return ctx.fail("query must be [batch, sequence, hidden], got " + query.describe());
  a.B = query.dim(0), a.S = query.dim(1);
  a.packed = key == nullptr;
  if (a.packed != (value == nullptr))
    return ctx.fail("key and value come together, or both are packed into query");
  int64_t width = query.dim(2);
  if (a.packed) {
    if (width % (a.N + 2 * a.Nkv) != 0)
      return ctx.fail(
          formatv("packed query width {0} is not (num_heads + 2 kv_num_heads) heads", width));
    a.H = width / (a.N + 2 * a.Nkv);
    a.qStride = a.kStride = a.vStride = width;
    a.kOffset = a.N * a.H, a.vOffset = (a.N + a.Nkv) * a.H;
  } else {
    if (width % a.N != 0)
      return ctx.fail(formatv("query width {0} is not a multiple of {1} heads", width, a.N));
    a.H = width / a.N;
    Shape kv{a.B, a.S, a.Nkv * a.H};
    if (key->shape() != kv || value->shape() != kv)
      return ctx.fail(formatv("key {0} and value {1} must be {2}", key->describe(),
                              value->describe(), shapeString(kv)));
    a.qStride = width, a.kStride = a.vStride = a.Nkv * a.H;
  }
  if (static_cast<bool>(pastKey) != static_cast<bool>(pastValue))
    return ctx.fail("past_key and past_value come together");
  if (pastKey) {
    if (pastKey->rank() != 4 || pastKey->dim(0) != a.B || pastKey->dim(1) != a.Nkv ||
        pastKey->dim(3) != a.H || pastValue->shape() != pastKey->shape())
      return ctx.fail(formatv("past_key {0} and past_value {1} are not [{2}, {3}, past, {4}]",
                              pastKey->describe(), pastValue->describe(), a.B, a.Nkv, a.H));
    a.past = pastKey->dim(2);
  }
  if (seqlens.numElements() != a.B)
    return ctx.fail(
        formatv("seqlens_k {0} must hold one length per row of {1}", seqlens.describe(), a.B));
  if (total.numElements() != 1)
    return ctx.fail("total_sequence_length must be one value, got " + total.describe());
  int64_t totalLength = total.getInt64(0);
  a.present = std::max(totalLength, a.past);
  bool firstPrompt = a.S == totalLength;
  if (ctx.attrInt("do_rotary", 0) != 0) {
    if (!cosCache || !sinCache || cosCache->rank() != 2 || sinCache->shape() != cosCache->shape())
      return ctx.fail("do_rotary needs cos_cache and sin_cache of one [positions, dim / 2] shape");
    a.rotaryHalf = cosCache->dim(1);
    if (a.rotaryHalf <= 0 || 2 * a.rotaryHalf > a.H)
      return ctx.fail(formatv("cos_cache {0} does not rotate within the head size {1}",
                              cosCache->describe(), a.H));
  }
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t length = seqlens.getInt64(b) + 1;
    int64_t start = firstPrompt ? 0 : length - a.S;
    if (length < 1 || start < 0 || start > a.past || start + a.S > a.present ||
        (firstPrompt && length > a.S))
      return ctx.fail(formatv("row {0}: seqlens_k {1} does not fit {2} queries, a past of {3} "
                              "and a total of {4}",
                              b, length - 1, a.S, a.past, totalLength));
    // Rotary positions run to start + S - 1 (a first prompt's padding too).
    if (a.rotaryHalf > 0 && start + a.S > cosCache->dim(0))
      return ctx.fail(formatv("row {0}: position {1} is out of range for a cos_cache of {2} rows",
                              b, start + a.S - 1, cosCache->dim(0)));
    a.start.push_back(start);
    a.length.push_back(length);
  }
  a.interleaved = ctx.attrInt("rotary_interleaved", 0) != 0;
  a.window = ctx.attrInt("local_window_size", -1);
  a.softcap = ctx.attrFloat("softcap", 0.0f);
  a.smooth = ctx.attrInt("smooth_softmax", 0) != 0;
  a.scale = ctx.attrFloat("scale", 0.0f);
  if (a.scale == 0)
    a.scale = 1 / std::sqrt(static_cast<float>(a.H));
  return a;
}

/// Copies \p H values of \p src into \p dst, rotating the first 2 * \p half
/// by the angles of position \p p in \p cos and \p sin ([positions, half]).
template <typename T>
void rotate(const T *src, T *dst, int64_t H, int64_t half, const T *cos, const T *sin, int64_t p,
            bool interleaved) {
  std::copy(src, src + H, dst);
  const T *c = cos + p * half, *sn = sin + p * half;
  for (int64_t i = 0; i < half; ++i) {
    int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
    T re = src[first], im = src[second];
    dst[first] = re * c[i] - im * sn[i];
    dst[second] = re * sn[i] + im * c[i];
  }
}

/// present_key and present_value [B, Nkv, present, H]: each row's past up
/// to its start, then its new keys (rotated) and values, then zeros.
template <typename T>
void writePresent(const GqaSizes &a, const T *k, const T *v, const Tensor *pastKey,
                  const Tensor *pastValue, const T *cos, const T *sin, T *pk, T *pv) {
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Nkv; ++h) {
      int64_t to = (b * a.Nkv + h) * a.present * a.H;
      if (pastKey) {
        int64_t from = (b * a.Nkv + h) * a.past * a.H;
        std::copy_n(pastKey->data<T>() + from, a.start[b] * a.H, pk + to);
        std::copy_n(pastValue->data<T>() + from, a.start[b] * a.H, pv + to);
      }
      for (int64_t s = 0; s < a.S; ++s) {
        int64_t row = b * a.S + s, at = to + (a.start[b] + s) * a.H;
        const T *kRow = k + row * a.kStride + a.kOffset + h * a.H;
        if (a.rotaryHalf > 0)
          rotate(kRow, pk + at, a.H, a.rotaryHalf, cos, sin, a.start[b] + s, a.interleaved);
        else
          std::copy_n(kRow, a.H, pk + at);
        std::copy_n(v + row * a.vStride + a.vOffset + h * a.H, a.H, pv + at);
      }
      int64_t written = (a.start[b] + a.S) * a.H, all = a.present * a.H;
      std::fill(pk + to + written, pk + to + all, T(0));
      std::fill(pv + to + written, pv + to + all, T(0));
    }
}

/// The dot products of \p q with each of 8 keys of \p H floats, given
/// transposed in \p keysT (H x 8, transposeFloats), into \p dots: 8 sums
/// side by side, each summing its products in the order of i as one key's
/// loop would (the same bits).
void dotEight(const float *q, const float *keysT, int64_t H, float dots[8]) {
  using Lanes = float __attribute__((vector_size(16)));
  Lanes low = {0, 0, 0, 0}, high = {0, 0, 0, 0};
  for (int64_t i = 0; i < H; ++i) {
    Lanes qi = {q[i], q[i], q[i], q[i]}, k0, k1;
    std::memcpy(&k0, keysT + i * 8, sizeof k0);
    std::memcpy(&k1, keysT + i * 8 + 4, sizeof k1);
    low += qi * k0;
    high += qi * k1;
  }
  std::memcpy(dots, &low, sizeof low);
  std::memcpy(dots + 4, &high, sizeof high);
}

/// One query head's row of scores: its maximum, and each score softmaxed
/// in place over [first, seen), then the weighted sum of the values into
/// \p dst (each output element summing its positions in order, eight
/// elements at a time so that their sums run side by side in registers).
template <typename T>
void weighValues(const GqaSizes &a, double *scores, double maxScore, int64_t first, int64_t seen,
                 const T *values, T *dst) {
  double sum = a.smooth ? std::exp(-maxScore) : 0.0;
  for (int64_t t = first; t < seen; ++t)
    sum += scores[t] = std::exp(scores[t] - maxScore);
  for (int64_t t = first; t < seen; ++t)
    scores[t] /= sum;
  int64_t i = 0;
  for (; i + 8 <= a.H; i += 8) {
    double sums[8] = {};
    for (int64_t t = first; t < seen; ++t) {
      const T *vRow = values + t * a.H + i;
      for (int l = 0; l < 8; ++l)
        sums[l] += scores[t] * static_cast<double>(vRow[l]);
    }
    for (int l = 0; l < 8; ++l)
      dst[i + l] = static_cast<T>(sums[l]);
  }
  for (; i < a.H; ++i) {
    double total = 0;
    for (int64_t t = first; t < seen; ++t)
      total += scores[t] * static_cast<double>(values[t * a.H + i]);
    dst[i] = static_cast<T>(total);
  }
}

/// output [B, S, N * H]: each query head's softmax over the keys it sees
/// of its kv head (N / Nkv query heads share one), times their values. The
/// query heads of one kv head go together, so that each block of 8 keys is
/// transposed once for all of them.
template <typename T>
void attendHeads(const GqaSizes &a, const T *q, const T *pk, const T *pv, const T *cos,
                 const T *sin, T *out) {
  int64_t group = a.N / a.Nkv;
  // kv heads are independent: the rank's loop threads take runs of them,
  // each run some 64k multiply-adds at least (a tiny decode step's heads
  // stay on one thread: waking another costs more than they do).
  int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) /
                                           std::max<int64_t>(1, group * a.S * a.present * a.H));
  parallelFor(a.B * a.Nkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> qRot(group * a.H);
    std::vector<const T *> qRows(group);
    std::vector<double> scores(group * a.present), maxScores(group);
    std::vector<float> keysT(8 * a.H);
    auto score = [softcap = a.softcap, scale = a.scale](float dot) {
      double x = static_cast<double>(dot * scale);
      return softcap > 0 ? softcap * std::tanh(x / softcap) : x;
    };
    for (int64_t unit = begin; unit < end; ++unit) {
      int64_t b = unit / a.Nkv, kv = unit % a.Nkv;
      const T *keys = pk + (b * a.Nkv + kv) * a.present * a.H;
      const T *values = pv + (b * a.Nkv + kv) * a.present * a.H;
      for (int64_t s = 0; s < a.S; ++s) {
        for (int64_t j = 0; j < group; ++j) {
          int64_t n = kv * group + j;
          qRows[j] = q + (b * a.S + s) * a.qStride + n * a.H;
          if (a.rotaryHalf > 0) {
            rotate(qRows[j], qRot.data() + j * a.H, a.H, a.rotaryHalf, cos, sin, a.start[b] + s,
                   a.interleaved);
            qRows[j] = qRot.data() + j * a.H;
          }
          maxScores[j] = a.smooth ? 0.0 : -INFINITY;
        }
        int64_t seen = std::min(a.start[b] + s + 1, a.length[b]), first = 0;
        if (a.window > 0 && seen > a.window)
          first = seen - a.window;
        int64_t t = first;
        if constexpr (std::is_same_v<T, float>)
          for (; t + 8 <= seen; t += 8) {
            transposeFloats(keys + t * a.H, 8, a.H, a.H, keysT.data(), 8);
            for (int64_t j = 0; j < group; ++j) {
              float dots[8];
              dotEight(qRows[j], keysT.data(), a.H, dots);
              double *row = scores.data() + j * a.present;
              for (int l = 0; l < 8; ++l) {
                double x = score(dots[l]);
                row[t + l] = x;
                maxScores[j] = std::max(maxScores[j], x);
              }
            }
          }
        for (; t < seen; ++t) {
          const T *kRow = keys + t * a.H;
          for (int64_t j = 0; j < group; ++j) {
            float dot = 0;
            for (int64_t i = 0; i < a.H; ++i)
              dot += static_cast<float>(qRows[j][i]) * static_cast<float>(kRow[i]);
            double x = score(dot);
            scores[j * a.present + t] = x;
            maxScores[j] = std::max(maxScores[j], x);
          }
        }
        for (int64_t j = 0; j < group; ++j) {
          int64_t n = kv * group + j;
          weighValues(a, scores.data() + j * a.present, maxScores[j], first, seen, values,
                      out + (b * a.S + s) * a.N * a.H + n * a.H);
        }
      }
    }
  });
}

} // namespace

Expected<Outputs> groupQueryAttention(const OpContext &ctx) {
  auto sizes = gqaSizes(ctx);
  if (!sizes)
    return sizes.takeError();
  const GqaSizes &a = *sizes;
  const Tensor &query = ctx.input(0);
  return onFloat(ctx, query, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    const T *q = query.data<T>();
    const T *k = a.packed ? q : ctx.input(1).data<T>(), *v = a.packed ? q : ctx.input(2).data<T>();
    const T *cos = a.rotaryHalf > 0 ? ctx.input(7).data<T>() : nullptr;
    const T *sin = a.rotaryHalf > 0 ? ctx.input(8).data<T>() : nullptr;
    // writePresent and attendHeads write every element.
    Tensor presentKey = Tensor::uninitialized(query.elemType(), {a.B, a.Nkv, a.present, a.H});
    Tensor presentValue = Tensor::uninitialized(query.elemType(), {a.B, a.Nkv, a.present, a.H});
    writePresent(a, k, v, ctx.optInput(3), ctx.optInput(4), cos, sin, presentKey.data<T>(),
                 presentValue.data<T>());
    Tensor out = Tensor::uninitialized(query.elemType(), {a.B, a.S, a.N * a.H});
    attendHeads(a, q, presentKey.data<T>(), presentValue.data<T>(), cos, sin, out.data<T>());
    return Outputs{out, presentKey, presentValue};
  });
}

} // namespace pipec::cpu
