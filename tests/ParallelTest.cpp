//===- ParallelTest.cpp - A rank's loop threads ---------------------------===//
//
// parallelFor covers every iteration exactly once in contiguous chunks on
// the threads setLoopThreads gave, runs a loop inside a loop serially, and
// the kernels that use it (softmax, layer norm and its input gradient, a
// batched MatMul) give the same bits on 1 thread and on 3, and a GEMM cut
// into bands equals the whole to float rounding.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

#include "runtime/cpu/Kernels.h"
#include "support/Parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

using namespace pipec;
using namespace pipec::test;

namespace {

TEST(Parallel, EveryIterationOnceInContiguousChunksOnTheGivenThreads) {
  setLoopThreads(3);
  EXPECT_EQ(loopThreads(), 3);
  std::vector<int> hits(1000, 0);
  std::mutex m;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::set<std::thread::id> threads;
  parallelFor(1000, 10, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      ++hits[i];
    std::lock_guard<std::mutex> lock(m);
    chunks.emplace_back(begin, end);
    threads.insert(std::this_thread::get_id());
  });
  for (int h : hits)
    ASSERT_EQ(h, 1);
  // One chunk per thread, [0, 333), [333, 666), [666, 1000).
  std::sort(chunks.begin(), chunks.end());
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0], std::make_pair(int64_t(0), int64_t(333)));
  EXPECT_EQ(chunks[1], std::make_pair(int64_t(333), int64_t(666)));
  EXPECT_EQ(chunks[2], std::make_pair(int64_t(666), int64_t(1000)));
  EXPECT_LE(threads.size(), 3u);
  EXPECT_GE(threads.size(), 1u);

  // Below the grain, and inside a loop: one call on the calling thread.
  int calls = 0;
  parallelFor(15, 10, [&](int64_t begin, int64_t end) {
    ++calls;
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 15);
  });
  EXPECT_EQ(calls, 1);
  std::vector<int> inner(3, 0);
  parallelFor(3, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      parallelFor(100, 1, [&](int64_t b, int64_t e) { inner[i] += int(e - b == 100); });
  });
  EXPECT_EQ(inner, std::vector<int>({1, 1, 1}));
  setLoopThreads(1);
  EXPECT_EQ(loopThreads(), 1);
}

/// \p node's outputs on \p inputs with \p threads loop threads.
std::vector<Tensor> runOn(int threads, const onnx::NodeProto &node,
                          const std::vector<const Tensor *> &inputs) {
  setLoopThreads(threads);
  auto out = cpu::runOp(node, 17, inputs);
  setLoopThreads(1);
  EXPECT_TRUE(!!out) << (out ? "" : llvm::toString(out.takeError()));
  return out ? *out : std::vector<Tensor>();
}

void expectSameBits(const std::vector<Tensor> &a, const std::vector<Tensor> &b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].shape(), b[i].shape());
    ASSERT_EQ(a[i].byteSize(), b[i].byteSize());
    EXPECT_EQ(std::memcmp(a[i].rawData(), b[i].rawData(), a[i].byteSize()), 0) << "output " << i;
  }
}

TEST(Parallel, KernelsGiveTheSameBitsOnOneThreadAndThree) {
  Tensor x = floats({64, 8, 64}), scale = floats({64}), bias = floats({64}),
         dy = floats({64, 8, 64});
  expectSameBits(runOn(1, NodeBuilder("Softmax", 1).i("axis", -1), {&x}),
                 runOn(3, NodeBuilder("Softmax", 1).i("axis", -1), {&x}));
  onnx::NodeProto norm = NodeBuilder("LayerNormalization", 3, 3).i("axis", -1);
  expectSameBits(runOn(1, norm, {&x, &scale, &bias}), runOn(3, norm, {&x, &scale, &bias}));
  onnx::NodeProto grad = NodeBuilder("LayerNormGradInput", 3, 1, "pipec").i("axis", -1);
  expectSameBits(runOn(1, grad, {&dy, &x, &scale}), runOn(3, grad, {&dy, &x, &scale}));
  // Batched products: one whole GEMM per leading index, on any thread.
  Tensor a = floats({16, 64, 32}), b = floats({16, 32, 64});
  expectSameBits(runOn(1, NodeBuilder("MatMul", 2), {&a, &b}),
                 runOn(3, NodeBuilder("MatMul", 2), {&a, &b}));
  // A GEMM cut into bands of rows: OpenBLAS may pick another kernel for a
  // band's shape, so equal to float rounding, not necessarily to the bit.
  Tensor rows = floats({512, 256}), w = floats({256, 768});
  std::vector<Tensor> one = runOn(1, NodeBuilder("MatMul", 2), {&rows, &w});
  std::vector<Tensor> three = runOn(3, NodeBuilder("MatMul", 2), {&rows, &w});
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(three.size(), 1u);
  ASSERT_EQ(one[0].shape(), three[0].shape());
  for (int64_t i = 0; i < one[0].numElements(); ++i)
    ASSERT_NEAR(one[0].data<float>()[i], three[0].data<float>()[i],
                1e-5f * (1 + std::abs(one[0].data<float>()[i])))
        << "element " << i;
}

// The rule `pipec run` shares the cores by, which the compile's `cpu` spec
// is calibrated for.
TEST(Parallel, DefaultThreadsPerRankShareTheCores) {
  int cores = allowedCpuCount();
  EXPECT_GE(cores, 1);
  EXPECT_EQ(defaultThreadsPerRank(1), cores);
  EXPECT_EQ(defaultThreadsPerRank(0), cores);
  EXPECT_EQ(defaultThreadsPerRank(2), std::max(1, cores / 2));
  EXPECT_EQ(defaultThreadsPerRank(cores + 1), 1);
}

} // namespace
