//===- ContribKernelsTest.cpp - onnxruntime's contrib ops on the CPU -----===//
//
// The onnxruntime contrib ops (Attention, MultiHeadAttention,
// GroupQueryAttention, RotaryEmbedding, the fused normalizations, FastGelu)
// against plain loops or hand numbers.
//
//===----------------------------------------------------------------------===//
#include "CpuKernelTestUtil.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

using namespace pipec::cpu;
using namespace pipec::test::kernels;

namespace {

//===----------------------------------------------------------------------===//
// onnxruntime contrib ops
//===----------------------------------------------------------------------===//

NodeBuilder contribNode(const std::string &op, int inputs, int outputs = 1) {
  return NodeBuilder(op, inputs, outputs, "com.microsoft");
}

/// Softmax attention by plain loops, in double: q [B,N,S,H], k and v
/// [B,N,T,H]; bias(b, n, s, t) is added to the scaled score, and a pair with
/// allowed(b, s, t) false gets no weight. Returns [B,S,N*H].
std::vector<double>
naiveAttention(int64_t B, int64_t N, int64_t S, int64_t T, int64_t H, const std::vector<double> &q,
               const std::vector<double> &k, const std::vector<double> &v, double scale,
               const std::function<double(int64_t, int64_t, int64_t, int64_t)> &bias,
               const std::function<bool(int64_t, int64_t, int64_t)> &allowed) {
  std::vector<double> out(B * S * N * H, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) {
        std::vector<double> w(T, 0.0);
        double sum = 0;
        for (int64_t t = 0; t < T; ++t) {
          if (!allowed(b, s, t))
            continue;
          double dot = 0;
          for (int64_t h = 0; h < H; ++h)
            dot += q[((b * N + n) * S + s) * H + h] * k[((b * N + n) * T + t) * H + h];
          w[t] = std::exp(scale * dot + bias(b, n, s, t));
          sum += w[t];
        }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            out[(b * S + s) * N * H + n * H + h] += w[t] / sum * v[((b * N + n) * T + t) * H + h];
      }
  return out;
}

Tensor floats(std::vector<int64_t> shape, const std::vector<double> &values) {
  std::vector<float> f(values.begin(), values.end());
  return Tensor::fromValues<float>(std::move(shape), llvm::ArrayRef<float>(f));
}

TEST(CpuKernels, AttentionWithMaskPastAndCausalMatchesLoops) {
  // B=2, S=3, D=4, N=2 heads of H=2, past P=2 (T=5), mask_index [B, T] with
  // a hole in each row, unidirectional.
  const int64_t batch = 2, seqLen = 3, hidden = 4, numHeads = 2, headSize = 2, pastLen = 2,
                total = pastLen + seqLen;
  Tensor x = randomTensor({batch, seqLen, hidden}, 30), w = randomTensor({hidden, 3 * hidden}, 31);
  Tensor bias = randomTensor({3 * hidden}, 32),
         past = randomTensor({2, batch, numHeads, pastLen, headSize}, 33);
  Tensor mask = Tensor::fromValues<int32_t>({batch, total}, {1, 0, 1, 1, 1, 1, 1, 1, 0, 1});
  auto out = run(contribNode("Attention", 5, 2)
                     .attr("num_heads", int64_t(numHeads))
                     .attr("unidirectional", int64_t(1)),
                 {&x, &w, &bias, &mask, &past});
  ASSERT_EQ(out.size(), 2u);

  // Q, K, V by loops; K and V continue the past.
  std::vector<double> q(batch * numHeads * seqLen * headSize),
      k(batch * numHeads * total * headSize), v(batch * numHeads * total * headSize);
  const float *px = x.data<float>(), *pw = w.data<float>(), *pb = bias.data<float>();
  const float *pp = past.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < numHeads; ++n) {
      for (int64_t t = 0; t < pastLen; ++t)
        for (int64_t h = 0; h < headSize; ++h) {
          k[((b * numHeads + n) * total + t) * headSize + h] =
              pp[(((0 * batch + b) * numHeads + n) * pastLen + t) * headSize + h];
          v[((b * numHeads + n) * total + t) * headSize + h] =
              pp[(((1 * batch + b) * numHeads + n) * pastLen + t) * headSize + h];
        }
      for (int64_t s = 0; s < seqLen; ++s)
        for (int64_t h = 0; h < headSize; ++h) {
          double proj[3];
          for (int part = 0; part < 3; ++part) {
            int64_t col = part * hidden + n * headSize + h;
            proj[part] = pb[col];
            for (int64_t d = 0; d < hidden; ++d)
              proj[part] += double(px[(b * seqLen + s) * hidden + d]) * pw[d * 3 * hidden + col];
          }
          q[((b * numHeads + n) * seqLen + s) * headSize + h] = proj[0];
          k[((b * numHeads + n) * total + pastLen + s) * headSize + h] = proj[1];
          v[((b * numHeads + n) * total + pastLen + s) * headSize + h] = proj[2];
        }
    }
  auto want = naiveAttention(
      batch, numHeads, seqLen, total, headSize, q, k, v, 1 / std::sqrt(double(headSize)),
      [](int64_t, int64_t, int64_t, int64_t) { return 0.0; },
      [&](int64_t b, int64_t s, int64_t t) {
        return mask.data<int32_t>()[b * total + t] == 1 && t <= pastLen + s;
      });
  expectClose(out[0], floats({batch, seqLen, hidden}, want), 1e-5, 1e-5);
  // present [2, B, N, T, H]: the keys, then the values.
  std::vector<double> present(k);
  present.insert(present.end(), v.begin(), v.end());
  expectClose(out[1], floats({2, batch, numHeads, total, headSize}, present), 1e-5, 1e-5);
}

TEST(CpuKernels, MultiHeadAttentionWithBiasPastAndKeyLengthsMatchesLoops) {
  // B=2, S=2, N=2 heads of H=2, L=2 new keys after P=1 past ones (T=3);
  // key_padding_mask [B] gives key lengths 3 and 2; attention_bias is shared
  // by the batch.
  const int64_t batch = 2, seqLen = 2, numHeads = 2, headSize = 2, hidden = numHeads * headSize,
                newLen = 2, pastLen = 1, total = pastLen + newLen;
  Tensor query = randomTensor({batch, seqLen, hidden}, 40),
         key = randomTensor({batch, newLen, hidden}, 41),
         value = randomTensor({batch, newLen, hidden}, 42), bias = randomTensor({3 * hidden}, 43);
  Tensor lengths = Tensor::fromValues<int32_t>({batch}, {3, 2});
  Tensor attentionBias = randomTensor({1, numHeads, seqLen, total}, 44);
  Tensor pastKey = randomTensor({batch, numHeads, pastLen, headSize}, 45),
         pastValue = randomTensor({batch, numHeads, pastLen, headSize}, 46);
  auto out = run(contribNode("MultiHeadAttention", 8, 3).attr("num_heads", int64_t(numHeads)),
                 {&query, &key, &value, &bias, &lengths, &attentionBias, &pastKey, &pastValue});
  ASSERT_EQ(out.size(), 3u);

  std::vector<double> q(batch * numHeads * seqLen * headSize),
      k(batch * numHeads * total * headSize), v(batch * numHeads * total * headSize);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < numHeads; ++n)
      for (int64_t h = 0; h < headSize; ++h) {
        for (int64_t s = 0; s < seqLen; ++s)
          q[((b * numHeads + n) * seqLen + s) * headSize + h] =
              double(query.data<float>()[(b * seqLen + s) * hidden + n * headSize + h]) +
              bias.data<float>()[n * headSize + h];
        for (int64_t t = 0; t < total; ++t) {
          size_t at = ((b * numHeads + n) * total + t) * headSize + h;
          if (t < pastLen) {
            k[at] = pastKey.data<float>()[((b * numHeads + n) * pastLen + t) * headSize + h];
            v[at] = pastValue.data<float>()[((b * numHeads + n) * pastLen + t) * headSize + h];
          } else {
            int64_t row = (b * newLen + t - pastLen) * hidden + n * headSize + h;
            k[at] = double(key.data<float>()[row]) + bias.data<float>()[hidden + n * headSize + h];
            v[at] = double(value.data<float>()[row]) +
                    bias.data<float>()[2 * hidden + n * headSize + h];
          }
        }
      }
  auto want = naiveAttention(
      batch, numHeads, seqLen, total, headSize, q, k, v, 1 / std::sqrt(double(headSize)),
      [&](int64_t, int64_t n, int64_t s, int64_t t) {
        return double(attentionBias.data<float>()[(n * seqLen + s) * total + t]);
      },
      [&](int64_t b, int64_t, int64_t t) { return t < lengths.data<int32_t>()[b]; });
  expectClose(out[0], floats({batch, seqLen, hidden}, want), 1e-5, 1e-5);
  expectClose(out[1], floats({batch, numHeads, total, headSize}, k), 1e-5, 1e-5);
  expectClose(out[2], floats({batch, numHeads, total, headSize}, v), 1e-5, 1e-5);
}

/// GroupQueryAttention decoding one token over a long past (4 query heads
/// over 2 key/value heads, head size 12): against attention in double, and
/// bit for bit against each score summed one row at a time in float, the
/// order the kernel's blocks of 8 keys keep.
TEST(CpuKernels, GroupQueryAttentionScoresKeepTheirOrder) {
  const int64_t batch = 2, numHeads = 4, kvHeads = 2, headSize = 12, pastLen = 21;
  const int64_t hidden = numHeads * headSize, kvHidden = kvHeads * headSize;
  Tensor query = randomTensor({batch, 1, hidden}, 50), key = randomTensor({batch, 1, kvHidden}, 51),
         value = randomTensor({batch, 1, kvHidden}, 52),
         pastKey = randomTensor({batch, kvHeads, pastLen, headSize}, 53),
         pastValue = randomTensor({batch, kvHeads, pastLen, headSize}, 54);
  // Row 0 sees all its past; row 1 only its first 17 positions.
  Tensor seqlens = Tensor::fromValues<int32_t>({batch}, {int32_t(pastLen), 17});
  Tensor totalLength = Tensor::fromValues<int32_t>({}, {int32_t(pastLen + 1)});
  auto out = run(contribNode("GroupQueryAttention", 7, 3)
                     .attr("num_heads", numHeads)
                     .attr("kv_num_heads", kvHeads),
                 {&query, &key, &value, &pastKey, &pastValue, &seqlens, &totalLength});
  ASSERT_EQ(out.size(), 3u);
  const Tensor &presentKey = out[1], &presentValue = out[2];
  int64_t present = presentKey.dim(2);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t seen = seqlens.data<int32_t>()[b] + 1;
    for (int64_t n = 0; n < numHeads; ++n) {
      const float *q = query.data<float>() + b * hidden + n * headSize;
      int64_t kv = (b * kvHeads + n / (numHeads / kvHeads)) * present * headSize;
      std::vector<double> exact(seen), scores(seen);
      double maxExact = -INFINITY, maxScore = -INFINITY;
      for (int64_t t = 0; t < seen; ++t) {
        const float *k = presentKey.data<float>() + kv + t * headSize;
        float dot = 0;
        double full = 0;
        for (int64_t i = 0; i < headSize; ++i) {
          dot += q[i] * k[i];
          full += double(q[i]) * k[i];
        }
        scores[t] = double(dot * float(1 / std::sqrt(double(headSize))));
        exact[t] = full / std::sqrt(double(headSize));
        maxScore = std::max(maxScore, scores[t]);
        maxExact = std::max(maxExact, exact[t]);
      }
      double sum = 0, sumExact = 0;
      for (int64_t t = 0; t < seen; ++t) {
        sum += scores[t] = std::exp(scores[t] - maxScore);
        sumExact += exact[t] = std::exp(exact[t] - maxExact);
      }
      for (int64_t h = 0; h < headSize; ++h) {
        double total = 0, totalExact = 0;
        for (int64_t t = 0; t < seen; ++t) {
          double v = presentValue.data<float>()[kv + t * headSize + h];
          total += scores[t] / sum * v;
          totalExact += exact[t] / sumExact * v;
        }
        float got = out[0].data<float>()[b * hidden + n * headSize + h];
        EXPECT_EQ(got, float(total)) << "row " << b << " head " << n << " element " << h;
        EXPECT_NEAR(got, totalExact, 1e-5) << "row " << b << " head " << n << " element " << h;
      }
    }
  }
}

TEST(CpuKernels, RotaryEmbeddingHalvesAndInterleavedPairs) {
  // One head of 4 at position 1, where the cache holds angles with
  // (cos, sin) = (0, 1) for the first pair and (0.5, 0.5) for the second.
  Tensor x = Tensor::fromValues<float>({1, 1, 4}, {1, 2, 3, 4});
  Tensor position = Tensor::fromValues<int64_t>({1, 1}, {1});
  Tensor cos = Tensor::fromValues<float>({2, 2}, {1, 1, 0, 0.5f});
  Tensor sin = Tensor::fromValues<float>({2, 2}, {0, 0, 1, 0.5f});
  // Halves: pairs (x0, x2) = (1, 3) and (x1, x3) = (2, 4);
  // (re, im) -> (re cos - im sin, re sin + im cos).
  auto halves = run(contribNode("RotaryEmbedding", 4), {&x, &position, &cos, &sin});
  expectClose(halves[0], Tensor::fromValues<float>({1, 1, 4}, {-3, -1, 1, 3}));
  // Interleaved: pairs (x0, x1) = (1, 2) and (x2, x3) = (3, 4).
  auto pairs = run(contribNode("RotaryEmbedding", 4).attr("interleaved", int64_t(1)),
                   {&x, &position, &cos, &sin});
  expectClose(pairs[0], Tensor::fromValues<float>({1, 1, 4}, {-2, 1, -0.5f, 3.5f}));
  // A one-element position_ids is an offset: position 0 + s; row 0 is the
  // identity rotation.
  Tensor offset = Tensor::fromValues<int64_t>({1}, {0});
  auto identity = run(contribNode("RotaryEmbedding", 4), {&x, &offset, &cos, &sin});
  expectClose(identity[0], x);
  Tensor far = Tensor::fromValues<int64_t>({1, 1}, {2});
  EXPECT_EQ(errorOf(contribNode("RotaryEmbedding", 4).name("rope"), {&x, &far, &cos, &sin}),
            "node 'rope' (RotaryEmbedding): position 2 is out of range for a cos_cache of 2 rows");
}

TEST(CpuKernels, RotaryEmbeddingLayoutsAndPartialRotation) {
  // [B, S, N*H] and [B, N, S, H] rotate the same heads.
  const int64_t batch = 2, seqLen = 3, numHeads = 2, headSize = 4;
  Tensor x = randomTensor({batch, seqLen, numHeads * headSize}, 50);
  Tensor cos = randomTensor({8, headSize / 2}, 51), sin = randomTensor({8, headSize / 2}, 52);
  Tensor position = Tensor::fromValues<int64_t>({batch, seqLen}, {0, 3, 7, 5, 1, 2});
  auto flat = run(contribNode("RotaryEmbedding", 4), {&x, &position, &cos, &sin});
  Tensor heads = transpose(x.reshaped({batch, seqLen, numHeads, headSize}), {0, 2, 1, 3});
  auto split = run(contribNode("RotaryEmbedding", 4), {&heads, &position, &cos, &sin});
  expectClose(transpose(split[0], {0, 2, 1, 3}).reshaped({batch, seqLen, numHeads * headSize}),
              flat[0]);
  // rotary_embedding_dim 2 of a head of 4: the last two values pass through.
  Tensor half = randomTensor({8, 1}, 53), halfSin = randomTensor({8, 1}, 54);
  auto partial = run(contribNode("RotaryEmbedding", 4)
                         .attr("rotary_embedding_dim", int64_t(2))
                         .attr("num_heads", int64_t(numHeads)),
                     {&x, &position, &half, &halfSin});
  for (int64_t row = 0; row < batch * seqLen; ++row)
    for (int64_t n = 0; n < numHeads; ++n) {
      const float *in = x.data<float>() + row * numHeads * headSize + n * headSize;
      const float *got = partial[0].data<float>() + row * numHeads * headSize + n * headSize;
      int64_t p = position.data<int64_t>()[row];
      float c = half.data<float>()[p], s = halfSin.data<float>()[p];
      EXPECT_NEAR(got[0], in[0] * c - in[1] * s, 1e-6);
      EXPECT_NEAR(got[1], in[0] * s + in[1] * c, 1e-6);
      EXPECT_EQ(got[2], in[2]);
      EXPECT_EQ(got[3], in[3]);
    }
}

TEST(CpuKernels, SkipLayerNormalizationsMatchLoops) {
  // input [2,3,4] + skip [3,4] (broadcast over the batch) + bias.
  Tensor x = randomTensor({2, 3, 4}, 60), skip = randomTensor({3, 4}, 61);
  Tensor gamma = randomTensor({4}, 62), beta = randomTensor({4}, 63), bias = randomTensor({4}, 64);
  auto full = run(contribNode("SkipLayerNormalization", 5, 4).attr("epsilon", 1e-5f),
                  {&x, &skip, &gamma, &beta, &bias});
  auto rms = run(contribNode("SkipSimplifiedLayerNormalization", 4, 4).attr("epsilon", 1e-5f),
                 {&x, &skip, &gamma, &bias});
  ASSERT_EQ(full.size(), 4u);
  ASSERT_EQ(rms.size(), 4u);
  std::vector<double> wantFull, wantRms, sums, means, invStds, invRms;
  for (int64_t r = 0; r < 6; ++r) {
    double v[4], mean = 0, var = 0, squares = 0;
    for (int j = 0; j < 4; ++j) {
      v[j] = double(x.data<float>()[r * 4 + j]) + skip.data<float>()[(r % 3) * 4 + j] +
             bias.data<float>()[j];
      sums.push_back(v[j]);
      mean += v[j] / 4;
      squares += v[j] * v[j] / 4;
    }
    for (int j = 0; j < 4; ++j)
      var += (v[j] - mean) * (v[j] - mean) / 4;
    means.push_back(mean);
    invStds.push_back(1 / std::sqrt(var + 1e-5));
    invRms.push_back(1 / std::sqrt(squares + 1e-5));
    for (int j = 0; j < 4; ++j) {
      wantFull.push_back((v[j] - mean) * invStds.back() * gamma.data<float>()[j] +
                         beta.data<float>()[j]);
      wantRms.push_back(v[j] * invRms.back() * gamma.data<float>()[j]);
    }
  }
  expectClose(full[0], floats({2, 3, 4}, wantFull));
  expectClose(full[1], floats({2, 3, 1}, means));
  expectClose(full[2], floats({2, 3, 1}, invStds));
  expectClose(full[3], floats({2, 3, 4}, sums));
  expectClose(rms[0], floats({2, 3, 4}, wantRms));
  // onnxruntime gives no mean for RMS normalization: zeros.
  expectClose(rms[1], Tensor(DType::F32, {2, 3, 1}));
  expectClose(rms[2], floats({2, 3, 1}, invRms));
  expectClose(rms[3], floats({2, 3, 4}, sums));
}

TEST(CpuKernels, SimplifiedLayerNormalizationNumbers) {
  // Rows [3, 4] and [0, 2]: mean squares 12.5 and 2.
  Tensor x = Tensor::fromValues<float>({2, 2}, {3, 4, 0, 2});
  Tensor scale = Tensor::fromValues<float>({2}, {1, 2});
  NodeBuilder node("SimplifiedLayerNormalization", 2, 2);
  node.attr("epsilon", 0.0f);
  auto out = run(node, {&x, &scale});
  float a = 1 / std::sqrt(12.5f), b = 1 / std::sqrt(2.0f);
  expectClose(out[0], Tensor::fromValues<float>({2, 2}, {3 * a, 8 * a, 0, 4 * b}));
  expectClose(out[1], Tensor::fromValues<float>({2, 1}, {a, b}));
  // Half precision in and out, computed in float.
  Tensor h = Tensor::fromValues<float>({2, 2}, {3, 4, 0, 2}, DType::F16);
  Tensor hs = Tensor::fromValues<float>({2}, {1, 2}, DType::F16);
  auto half = run(node, {&h, &hs});
  EXPECT_EQ(half[0].elemType(), DType::F16);
  expectClose(half[0], Tensor::fromValues<float>({2, 2}, {3 * a, 8 * a, 0, 4 * b}, DType::F16));
  EXPECT_TRUE(isSupported("SimplifiedLayerNormalization"));
  EXPECT_FALSE(isSupported("SimplifiedLayerNormalization", "com.microsoft"));
}

TEST(CpuKernels, EmbedLayerNormalizationMatchesLoops) {
  // ids [2,3]; position_ids [1,3] shared by the batch; a mask whose ones
  // give mask_index; no segments.
  Tensor ids = Tensor::fromValues<int32_t>({2, 3}, {4, 0, 2, 1, 1, 3});
  Tensor words = randomTensor({5, 4}, 70), positions = randomTensor({6, 4}, 71);
  Tensor gamma = randomTensor({4}, 72), beta = randomTensor({4}, 73);
  Tensor mask = Tensor::fromValues<int32_t>({2, 3}, {1, 1, 0, 1, 0, 0});
  Tensor positionIds = Tensor::fromValues<int32_t>({1, 3}, {5, 2, 0});
  auto out = run(contribNode("EmbedLayerNormalization", 9, 3).attr("epsilon", 1e-5f),
                 {&ids, nullptr, &words, &positions, nullptr, &gamma, &beta, &mask, &positionIds});
  ASSERT_EQ(out.size(), 3u);
  std::vector<double> want, sums;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t s = 0; s < 3; ++s) {
      double e[4], mean = 0, var = 0;
      int64_t id = ids.data<int32_t>()[b * 3 + s], pos = positionIds.data<int32_t>()[s];
      for (int j = 0; j < 4; ++j) {
        e[j] = double(words.data<float>()[id * 4 + j]) + positions.data<float>()[pos * 4 + j];
        sums.push_back(e[j]);
        mean += e[j] / 4;
      }
      for (int j = 0; j < 4; ++j)
        var += (e[j] - mean) * (e[j] - mean) / 4;
      for (int j = 0; j < 4; ++j)
        want.push_back((e[j] - mean) / std::sqrt(var + 1e-5) * gamma.data<float>()[j] +
                       beta.data<float>()[j]);
    }
  expectClose(out[0], floats({2, 3, 4}, want));
  EXPECT_EQ(out[1].shape(), (std::vector<int64_t>{2}));
  EXPECT_EQ(out[1].data<int32_t>()[0], 2);
  EXPECT_EQ(out[1].data<int32_t>()[1], 1);
  expectClose(out[2], floats({2, 3, 4}, sums));
  Tensor bad = Tensor::fromValues<int32_t>({2, 3}, {4, 0, 2, 1, 1, 5});
  EXPECT_EQ(errorOf(contribNode("EmbedLayerNormalization", 7).name("embed"),
                    {&bad, nullptr, &words, &positions, nullptr, &gamma, &beta}),
            "node 'embed' (EmbedLayerNormalization): input id 5 is out of range for a table of 5 "
            "rows");
}

TEST(CpuKernels, FastGeluWithBias) {
  // Y = 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))), v = X + bias.
  Tensor x = Tensor::fromValues<float>({2, 2}, {1, -1, 0, 2});
  Tensor bias = Tensor::fromValues<float>({2}, {0.5f, 0});
  auto out = run(contribNode("FastGelu", 2), {&x, &bias});
  auto gelu = [](double v) {
    return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
  };
  expectClose(out[0], floats({2, 2}, {gelu(1.5), gelu(-1), gelu(0.5), gelu(2)}));
  EXPECT_NEAR(out[0].data<float>()[0], 1.39957, 1e-5);
}

TEST(CpuKernels, ContribLayoutsOnnxRuntimeLacksAreUnsupported) {
  EXPECT_TRUE(isSupported("Attention", "com.microsoft"));
  EXPECT_TRUE(isSupported("RotaryEmbedding", "com.microsoft"));
  EXPECT_TRUE(isSupported("Attention")); // the default domain's own op (AttentionKernels.cpp)
  auto unsupported = [](const NodeBuilder &node, std::vector<const Tensor *> inputs) {
    auto outputs = runOp(node.node, 17, inputs);
    if (outputs)
      return std::string("no error");
    std::string message = "not an UnsupportedError";
    llvm::handleAllErrors(
        outputs.takeError(), [&](const UnsupportedError &e) { message = e.what(); },
        [](const llvm::ErrorInfoBase &) {});
    return message;
  };
  Tensor x = randomTensor({1, 2, 4}, 80), w = randomTensor({4, 12}, 81);
  Tensor mask4d = Tensor::fromValues<int32_t>({1, 1, 2, 2}, {1, 1, 1, 1});
  EXPECT_EQ(unsupported(contribNode("Attention", 4).attr("num_heads", int64_t(2)),
                        {&x, &w, nullptr, &mask4d}),
            "a 4-D mask_index (Megatron)");
  Tensor packed = randomTensor({1, 2, 2, 3, 2}, 82);
  EXPECT_EQ(
      unsupported(contribNode("MultiHeadAttention", 1).attr("num_heads", int64_t(2)), {&packed}),
      "packed QKV or KV");
  Tensor y = randomTensor({1, 2, 4}, 83);
  EXPECT_EQ(
      errorOf(contribNode("Attention", 2).name("attn").attr("num_heads", int64_t(3)), {&y, &w}),
      "node 'attn' (Attention): qkv_hidden_sizes [4,4,4] do not split weights float[4,12] "
      "into Q, K, V of 3 heads");
}

} // namespace
