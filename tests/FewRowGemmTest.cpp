//===- FewRowGemmTest.cpp - gemm's paths for a few rows by a weight -----===//
//
// gemm gives a few rows of A by a weight to loops that read B as stored
// (runtime/cpu/FewRowGemm.h), one source compiled for AVX-512 and AVX2,
// where they were measured faster than the BLAS. Each case is checked against
// the product summed in double, with every tail of rows, columns and k,
// padded rows, alpha and beta, a C written by `prepare`, and the bits on one
// thread and on two; gemm's choice, and every target this CPU runs called
// directly, whether or not gemm takes it here. Where a CPU lacks AVX-512 its
// loops are not run (the test says so).
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/FewRowGemm.h"
#include "runtime/cpu/Kernels.h"
#include "support/Parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

using namespace pipec;

namespace {

struct Case {
  bool transB;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
};

/// Values in [-1, 1) from \p seed.
std::vector<float> randoms(size_t count, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> out(count);
  for (float &v : out)
    v = dist(gen);
  return out;
}

/// C from gemm(false, transB, ...), or from the few-row kernel itself,
/// against the double product: within the float rounding of k terms,
/// relative to the sum of their magnitudes.
void checkCase(const Case &c, const cpu::FewRowKernels *kernels = nullptr) {
  SCOPED_TRACE(testing::Message() << (c.transB ? "A B^T" : "A B") << " m " << c.m << " n " << c.n
                                  << " k " << c.k << " beta " << c.beta << " ("
                                  << (kernels ? kernels->target : "gemm") << ")");
  // B: n rows of k read transposed, or k rows of n.
  std::vector<float> a = randoms(c.m * c.lda, 1), b = randoms((c.transB ? c.n : c.k) * c.ldb, 2);
  auto bAt = [&](int64_t p, int64_t j) { return c.transB ? b[j * c.ldb + p] : b[p * c.ldb + j]; };
  std::vector<float> before = randoms(c.m * c.ldc, 3);
  // With beta 0, C is not read: NaNs there must not reach the result.
  if (c.beta == 0)
    std::fill(before.begin(), before.end(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> out = before;
  if (!kernels)
    cpu::gemm(false, c.transB, c.m, c.n, c.k, c.alpha, a.data(), c.lda, b.data(), c.ldb, c.beta,
              out.data(), c.ldc);
  else if (c.transB)
    kernels->transposed(c.m, c.n, c.k, c.alpha, a.data(), c.lda, b.data(), c.ldb, c.beta,
                        out.data(), c.ldc);
  else
    cpu::fewRowsPlain(*kernels, c.m, c.n, c.k, c.alpha, a.data(), c.lda, b.data(), c.ldb, c.beta,
                      out.data(), c.ldc);
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j) {
      double sum = 0, magnitude = 0;
      for (int64_t p = 0; p < c.k; ++p) {
        double term = double(a[i * c.lda + p]) * bAt(p, j);
        sum += term;
        magnitude += std::fabs(term);
      }
      double want = c.alpha * sum + (c.beta == 0 ? 0.0 : c.beta * before[i * c.ldc + j]);
      double bound = 2 * (c.k + 2) * std::numeric_limits<float>::epsilon() *
                     (std::fabs(c.alpha) * magnitude + std::fabs(want) + 1e-30);
      ASSERT_NEAR(out[i * c.ldc + j], want, bound) << "row " << i << " column " << j;
    }
  // Columns past n in each row of C are left alone.
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = c.n; j < c.ldc; ++j)
      ASSERT_TRUE(std::memcmp(&out[i * c.ldc + j], &before[i * c.ldc + j], sizeof(float)) == 0);
}

TEST(FewRowGemm, EqualsTheDoubleProductOnEveryTail) {
  // Rows: each block size of 4 and its remainders, up to the most rows each
  // path takes and one past it (the BLAS). Columns: blocks of 3 and their
  // remainders (A B^T), of 3 vectors and one and their remainders (A B), for
  // either width. k: below, at and past a vector of 8 or 16 and a block of 16
  // rows of B.
  for (bool transB : {true, false})
    for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17, 31, 32, 33})
      for (int64_t n : {1, 2, 3, 4, 5, 9, 17, 50, 70})
        for (int64_t k : {1, 7, 8, 9, 16, 17, 33, 64, 101})
          for (float beta : {0.0f, 1.5f}) {
            int64_t ldb = (transB ? k : n) + 5;
            Case c{transB, m, n, k, k + 3, ldb, n + 2, 0.75f, beta};
            checkCase(c);
            // Every target's loops themselves, also where gemm keeps the
            // BLAS, up to their limits.
            if (m <= (transB ? cpu::fewRowsTransposedMax : cpu::fewRowsPlainMax))
              for (const cpu::FewRowKernels *kernels : cpu::fewRowKernelsHere())
                checkCase(c, kernels);
          }
}

TEST(FewRowGemm, TheRankThreadsSplitTheColumnsWithoutChangingABit) {
  // A decode step's shapes: the most rows gemm gives each form's loops
  // here, by a weight of 2003 rows of 768 read transposed, or of 768 rows
  // of 2003. The two threads' bands split the columns where one thread's
  // blocks do not.
  const cpu::FewRowChoice &choice = cpu::fewRowChoice();
  if (!choice.transposed && !choice.plain)
    GTEST_SKIP() << "gemm keeps the BLAS on this CPU: " << choice.reason;
  const int64_t n = 2003, k = 768;
  for (const bool transB : {true, false}) {
    const int64_t m = transB ? choice.transposedRows : choice.plainRows;
    if (m == 0)
      continue;
    std::vector<float> a = randoms(m * k, 4), b = randoms(n * k, 5);
    auto product = [&](int threads) {
      std::vector<float> c(m * n);
      std::thread worker([&] {
        setLoopThreads(threads);
        cpu::gemm(false, transB, m, n, k, 1.0f, a.data(), k, b.data(), transB ? k : n, 0.0f,
                  c.data(), n);
      });
      worker.join();
      return c;
    };
    std::vector<float> one = product(1), two = product(2);
    EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0)
        << (transB ? "A B^T" : "A B");
  }
}

TEST(FewRowGemm, PrepareWritesEachBandBeforeItsProduct) {
  // Gemm's bias: prepare writes C's block, then the product adds to it.
  const int64_t m = 5, n = 70, k = 33;
  std::vector<float> a = randoms(m * k, 6), b = randoms(n * k, 7), bias = randoms(n, 8);
  std::vector<float> c(m * n, std::numeric_limits<float>::quiet_NaN());
  int64_t written = 0;
  cpu::gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 1.0f, c.data(), n,
            [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
              for (int64_t i = r0; i < r1; ++i)
                for (int64_t j = c0; j < c1; ++j)
                  c[i * n + j] = bias[j];
              written += (r1 - r0) * (c1 - c0);
            });
  EXPECT_EQ(written, m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = bias[j];
      for (int64_t p = 0; p < k; ++p)
        want += double(a[i * k + p]) * b[j * k + p];
      ASSERT_NEAR(c[i * n + j], want, 1e-5) << "row " << i << " column " << j;
    }
}

/// The rates line of one form and candidate: \p rate at each row count, or
/// \p lowRate from row count \p from on.
std::string ratesLine(const char *form, const std::string &name, int64_t maxRows, double rate,
                      int64_t from = 1 << 20, double lowRate = 0) {
  std::string line = std::string(form) + " " + name;
  for (int64_t r = 1; r <= maxRows; r *= 2)
    line += " " + std::to_string(r >= from ? lowRate : rate);
  return line + "\n";
}

TEST(FewRowGemm, TheChoiceTakesTheTargetThatOutrunsTheBlasToTheMostRows) {
  const std::vector<const cpu::FewRowKernels *> &here = cpu::fewRowKernelsHere();
  if (here.empty())
    GTEST_SKIP() << "this CPU runs no few-row loops (no AVX2 and FMA)";
  const int64_t tMax = cpu::fewRowsTransposedMax, pMax = cpu::fewRowsPlainMax;
  // A B^T: the widest target outruns the BLAS up to 4 rows, the last up to
  // 16 (a 2% lead at 32 is not enough); A B: every target loses at one row
  // and wins after (so none is taken).
  std::string rates = ratesLine("transposed", "BLAS", tMax, 10);
  for (size_t i = 0; i < here.size(); ++i)
    rates += i + 1 == here.size() && here.size() > 1
                 ? ratesLine("transposed", here[i]->target, tMax, 20, 32, 10.2)
                 : ratesLine("transposed", here[i]->target, tMax, 20, 8, 5);
  rates += ratesLine("plain", "BLAS", pMax, 10);
  for (const cpu::FewRowKernels *k : here)
    rates += ratesLine("plain", k->target, pMax, 9, 2, 30);
  cpu::FewRowChoice choice = cpu::chooseFewRowKernels(rates);
  ASSERT_EQ(choice.transposed, here.back()) << choice.reason;
  EXPECT_EQ(choice.transposedRows, here.size() > 1 ? 16 : 4) << choice.reason;
  EXPECT_EQ(choice.plain, nullptr) << choice.reason;
  EXPECT_EQ(choice.plainRows, 0);
  EXPECT_NE(choice.reason.find(std::string("A B^T: ") + here.back()->target + " up to"),
            std::string::npos)
      << choice.reason;
  EXPECT_NE(choice.reason.find("A B: the BLAS (1 row:"), std::string::npos) << choice.reason;

  // Equal reach: the faster over it.
  rates = ratesLine("transposed", "BLAS", tMax, 10) + ratesLine("plain", "BLAS", pMax, 10);
  for (size_t i = 0; i < here.size(); ++i) {
    rates += ratesLine("transposed", here[i]->target, tMax, 20 + double(i));
    rates += ratesLine("plain", here[i]->target, pMax, 12);
  }
  choice = cpu::chooseFewRowKernels(rates);
  EXPECT_EQ(choice.transposed, here.back()) << choice.reason;
  EXPECT_EQ(choice.transposedRows, tMax);
  EXPECT_EQ(choice.plain, here.front()) << choice.reason;
  EXPECT_EQ(choice.plainRows, pMax);

  // A target missing from the rates, or a line cut short: the BLAS.
  for (std::string broken :
       {ratesLine("transposed", "BLAS", tMax, 10) + ratesLine("plain", "BLAS", pMax, 10),
        rates.substr(0, rates.rfind(' ')) + "\n"}) {
    choice = cpu::chooseFewRowKernels(broken);
    EXPECT_EQ(choice.transposed, nullptr) << broken;
    EXPECT_EQ(choice.plain, nullptr) << broken;
    EXPECT_NE(choice.reason.find("the measurement failed"), std::string::npos);
  }
}

} // namespace
