//===- AttentionKernelsTest.cpp - The default domain's attention ops ------===//
//
// Cases ONNX's node tests leave out, for Attention, RotaryEmbedding,
// LinearAttention and CausalConvWithState: a float mask shorter than the
// keys and broadcast over heads with grouped-query heads, packed 3-D inputs
// with nonpad_kv_seqlen and a causal frontier, a rotary embedding of part of
// each head with position ids broadcast over the batch, a gated linear
// attention with per-key decay and grouped heads, an empty query block, and
// the errors for malformed nodes. Expected numbers come from ONNX 1.23's
// reference implementation (onnx.reference.ReferenceEvaluator, the oracles
// venv), printed to nine significant digits.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

using namespace pipec::test;

namespace {

Tensor values(const Shape &shape, std::initializer_list<float> v) {
  return Tensor::fromValues<float>(shape, v);
}

/// The error of running \p node under \p opset, or "" when it ran.
std::string errorOf(const onnx::NodeProto &node, const std::vector<Tensor> &inputs, int64_t opset) {
  auto out = pipec::cpu::runOp(node, opset, pointers(inputs));
  return out ? std::string() : llvm::toString(out.takeError());
}

// Reference: Attention-23 on these inputs. The rank-3 mask [2, 1, 2] is
// [heads, queries, keys]: each query head has its own two-key mask, padded
// with -inf to the three keys; the two query heads share one key/value head.
TEST(AttentionKernels, ShortMaskBroadcastsOverQueriesWithGroupedHeads) {
  Tensor q = values({1, 2, 2, 2}, {-0.600000024f, -0.230000004f, 0.140000001f, 0.50999999f,
                                   -0.419999987f, -0.0500000007f, 0.319999993f, 0.689999998f});
  Tensor k = values({1, 1, 3, 2}, {-0.540000021f, -0.207000002f, 0.126000002f, 0.458999991f,
                                   -0.377999991f, -0.0449999981f});
  Tensor v = values({1, 1, 3, 2}, {-0.660000026f, -0.253000021f, 0.153999999f, 0.56099999f,
                                   -0.461999983f, -0.0550000034f});
  Tensor mask = values({2, 1, 2}, {0.5f, -1, 0, 0.25f});
  auto y = runCpu(NodeBuilder("Attention", 4), {q, k, v, mask}, 23);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(
      y[0], values({1, 2, 2, 2}, {-0.553248167f, -0.146248177f, -0.470693469f, -0.0636934564f,
                                  -0.247167796f, 0.159832209f, -0.111487463f, 0.295512527f})));
}

// Reference: Attention-24, packed [batch, sequence, heads * head] inputs, two
// query heads on one key/value head, is_causal with nonpad_kv_seqlen [3, 2]:
// batch 1's frontier starts at 2 - 2 = 0 and its third key is padding.
TEST(AttentionKernels, PackedInputsWithNonpadLengthsAndCausalFrontier) {
  Tensor q =
      values({2, 2, 4}, {-0.600000024f, -0.230000004f, 0.140000001f, 0.50999999f, -0.419999987f,
                         -0.0500000007f, 0.319999993f, 0.689999998f, -0.239999995f, 0.129999995f,
                         0.5f, -0.430000007f, -0.0599999987f, 0.310000002f, 0.680000007f, -0.25f});
  Tensor k = values({2, 3, 2}, {-0.480000019f, -0.184f, 0.112000003f, 0.407999992f, -0.335999995f,
                                -0.0400000028f, 0.256000012f, 0.551999986f, -0.192000002f,
                                0.103999995f, 0.400000006f, -0.344000012f});
  Tensor v = values({2, 3, 2}, {-0.720000029f, -0.276000023f, 0.168000013f, 0.611999989f,
                                -0.504000008f, -0.0600000024f, 0.384000003f, 0.828000009f,
                                -0.288000017f, 0.156000003f, 0.600000024f, -0.516000032f});
  Tensor lengths = int64s({2}, {3, 2});
  NodeBuilder node("Attention", 7);
  node.omitInput(3).omitInput(4).omitInput(5);
  node.i("is_causal", 1).i("q_num_heads", 2).i("kv_num_heads", 1);
  auto y = runCpu(node, {q, k, v, Tensor(), Tensor(), Tensor(), lengths}, 24);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(
      close(y[0], values({2, 2, 4}, {-0.352365941f, 0.0916341022f, -0.215964913f, 0.228035063f,
                                     -0.382911533f, 0.061088495f, -0.281242728f, 0.162757263f,
                                     0.384000003f, 0.828000009f, 0.384000003f, 0.828000009f,
                                     0.0612979643f, 0.505297959f, 0.0708491281f, 0.514849186f})));
}

// An empty query block attends nothing; the present key and value are still
// the past followed by the new keys.
TEST(AttentionKernels, EmptyQueryBlockKeepsThePresentCache) {
  Tensor q(DType::F32, {1, 1, 0, 2});
  Tensor k = values({1, 1, 1, 2}, {1, 2}), v = values({1, 1, 1, 2}, {3, 4});
  Tensor pastKey = values({1, 1, 1, 2}, {5, 6}), pastValue = values({1, 1, 1, 2}, {7, 8});
  NodeBuilder node("Attention", 6, 3);
  node.omitInput(3);
  auto out = runCpu(node, {q, k, v, Tensor(), pastKey, pastValue}, 23);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].shape(), (Shape{1, 1, 0, 2}));
  EXPECT_TRUE(close(out[1], values({1, 1, 2, 2}, {5, 6, 1, 2})));
  EXPECT_TRUE(close(out[2], values({1, 1, 2, 2}, {7, 8, 3, 4})));
}

TEST(AttentionKernels, MalformedAttentionNodesAreErrors) {
  Tensor q = floats({1, 2, 3, 4}), kv = floats({1, 1, 5, 4}), past = floats({1, 1, 2, 4});
  Tensor packed = floats({1, 3, 8});
  // past_key without past_value.
  NodeBuilder pastAlone("Attention", 5);
  pastAlone.omitInput(3);
  EXPECT_NE(errorOf(pastAlone, {q, kv, kv, Tensor(), past}, 23), "");
  // nonpad_kv_seqlen is an input of opset 24 on.
  NodeBuilder nonpad("Attention", 7);
  nonpad.omitInput(3).omitInput(4).omitInput(5);
  Tensor lengths = int64s({1}, {5});
  EXPECT_NE(errorOf(nonpad, {q, kv, kv, Tensor(), Tensor(), Tensor(), lengths}, 23), "");
  EXPECT_EQ(errorOf(nonpad, {q, kv, kv, Tensor(), Tensor(), Tensor(), lengths}, 24), "");
  // Packed inputs without head counts; a mask that does not broadcast.
  EXPECT_NE(errorOf(NodeBuilder("Attention", 3), {packed, packed, packed}, 23), "");
  EXPECT_NE(errorOf(NodeBuilder("Attention", 4), {q, kv, kv, floats({4, 5})}, 23), "");
  // Three query heads do not share two key/value heads.
  EXPECT_NE(errorOf(NodeBuilder("Attention", 3),
                    {floats({1, 3, 3, 4}), floats({1, 2, 5, 4}), floats({1, 2, 5, 4})}, 23),
            "");
}

// Reference: RotaryEmbedding-23, packed [batch, sequence, 2 heads * 4], the
// first two values of each head rotated as an interleaved pair, position ids
// [1, 3] shared by both batches.
TEST(AttentionKernels, RotaryEmbeddingOfPartOfPackedHeadsWithBroadcastIds) {
  std::vector<float> x(48);
  for (int i = 0; i < 48; ++i)
    x[i] = static_cast<float>(std::fmod(i * 0.37, 1.3) - 0.6);
  Tensor input = Tensor::fromValues<float>({2, 3, 8}, x);
  Tensor cosCache = values({5, 1}, {1, 0.955336511f, 0.825335622f, 0.621609986f, 0.362357765f});
  Tensor sinCache = values({5, 1}, {0, 0.295520216f, 0.564642489f, 0.783326924f, 0.932039082f});
  Tensor ids = int64s({1, 3}, {4, 0, 2});
  auto node = NodeBuilder("RotaryEmbedding", 4)
                  .i("interleaved", 1)
                  .i("rotary_embedding_dim", 2)
                  .i("num_heads", 2);
  auto y = runCpu(node, {input, cosCache, sinCache, ids}, 23);
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(
      y[0], values({2, 3, 8}, {-0.00304566324f, -0.642565727f,  0.140000001f,   0.50999999f,
                               -0.105588302f,   -0.40957427f,   0.319999993f,   0.689999998f,
                               -0.239999995f,   0.129999995f,   0.5f,           -0.430000007f,
                               -0.0599999987f,  0.310000002f,   0.680000007f,   -0.25f,
                               -0.177634567f,   0.472171575f,   -0.439999998f,  -0.0700000003f,
                               -0.130709782f,   0.722367644f,   -0.25999999f,   0.109999999f,
                               0.593349338f,    0.284317762f,   -0.0799999982f, 0.289999992f,
                               0.490806699f,    0.517309189f,   0.100000001f,   0.469999999f,
                               -0.460000008f,   -0.0900000036f, 0.280000001f,   0.649999976f,
                               -0.280000001f,   0.0900000036f,  0.460000008f,   -0.469999999f,
                               -0.23498705f,    0.166376367f,   0.639999986f,   -0.289999992f,
                               -0.188062266f,   0.416572422f,   -0.479999989f,  -0.109999999f})));
}

TEST(AttentionKernels, MalformedRotaryEmbeddingNodesAreErrors) {
  Tensor x = floats({1, 2, 3, 4}), cache = floats({4, 2});
  // A position past the cache's rows.
  EXPECT_NE(
      errorOf(NodeBuilder("RotaryEmbedding", 4), {x, cache, cache, int64s({1, 3}, {0, 1, 4})}, 23),
      "");
  // An odd rotary dimension; packed input without num_heads.
  EXPECT_NE(errorOf(NodeBuilder("RotaryEmbedding", 4).i("rotary_embedding_dim", 3),
                    {x, cache, cache, int64s({1, 3}, {0, 1, 2})}, 23),
            "");
  EXPECT_NE(errorOf(NodeBuilder("RotaryEmbedding", 4),
                    {floats({1, 3, 8}), cache, cache, int64s({1, 3}, {0, 1, 2})}, 23),
            "");
}

// Reference: LinearAttention-27, update_rule gated, decay per key dimension
// [batch, sequence, kv heads * key size], two query heads reading one state.
TEST(AttentionKernels, GatedLinearAttentionWithPerKeyDecayAndGroupedHeads) {
  Tensor q = values({1, 2, 4}, {-0.600000024f, -0.230000004f, 0.140000001f, 0.50999999f,
                                -0.419999987f, -0.0500000007f, 0.319999993f, 0.689999998f});
  Tensor k = values({1, 2, 2}, {-0.420000017f, -0.160999998f, 0.0979999974f, 0.356999993f});
  Tensor v = values({1, 2, 3}, {-0.600000024f, -0.230000004f, 0.140000001f, 0.50999999f,
                                -0.419999987f, -0.0500000007f});
  Tensor decay = values({1, 2, 2}, {-0.100000001f, -0.200000003f, -0.300000012f, -0.400000006f});
  NodeBuilder node("LinearAttention", 5, 2);
  node.omitInput(3).i("q_num_heads", 2).i("kv_num_heads", 1).s("update_rule", "gated");
  auto out = runCpu(node, {q, k, v, Tensor(), decay}, 27);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(close(
      out[0], values({1, 2, 6}, {-0.122625068f, -0.0470062681f, 0.0286125131f, 0.0597830489f,
                                 0.0229168348f, -0.0139493784f, -0.0790127814f, -0.0046056523f,
                                 0.0155571969f, 0.173977256f, -0.054166127f, -0.0270460956f})));
  EXPECT_TRUE(close(out[1], values({1, 1, 2, 3}, {0.236666217f, 0.0304030441f, -0.0484601147f,
                                                  0.246822894f, -0.125118047f, -0.0329590142f})));
  // gated needs decay and takes no beta.
  NodeBuilder noDecay("LinearAttention", 3, 2);
  noDecay.i("q_num_heads", 2).i("kv_num_heads", 1).s("update_rule", "gated");
  EXPECT_NE(errorOf(noDecay, {q, k, v}, 27), "");
}

TEST(AttentionKernels, MalformedCausalConvWithStateNodesAreErrors) {
  Tensor x = floats({1, 2, 5}), w = floats({2, 1, 3});
  NodeBuilder withPast("CausalConvWithState", 4, 2);
  withPast.omitInput(2);
  // past_state must hold the k - 1 = 2 positions before the input.
  EXPECT_NE(errorOf(withPast, {x, w, Tensor(), floats({1, 2, 3})}, 27), "");
  EXPECT_EQ(errorOf(withPast, {x, w, Tensor(), floats({1, 2, 2})}, 27), "");
  EXPECT_NE(errorOf(NodeBuilder("CausalConvWithState", 2, 2).s("activation", "relu"), {x, w}, 27),
            "");
  EXPECT_NE(errorOf(NodeBuilder("CausalConvWithState", 2, 2), {x, floats({3, 1, 3})}, 27), "");
}

} // namespace
