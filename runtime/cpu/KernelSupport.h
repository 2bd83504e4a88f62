//===- KernelSupport.h - Building blocks of the CPU kernels --------------===//
//
// What the CPU kernel files share: the broadcast walker every strided
// kernel uses, broadcasting and expanding, axis splits, a GEMM for every
// numeric type, and the loops of element-wise unary kernels. Internal to
// runtime/cpu.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_KERNELSUPPORT_H
#define PIPEC_RUNTIME_CPU_KERNELSUPPORT_H

#include "math/FloatMath.h"
#include "runtime/core/OpContext.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/kernels/KernelBodies.h"
#include "support/Parallel.h"

#include "llvm/ADT/ArrayRef.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <limits>
#include <type_traits>
#include <vector>

namespace pipec::cpu {

/// A loop function compiled for AVX-512, AVX2 and baseline x86-64, the
/// CPU's best chosen when the program loads (GCC's target_clones). Each
/// element's arithmetic is the same in every version (no FMA contraction,
/// reductions over fixed lanes): the results are too.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PIPEC_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PIPEC_VECTOR_CLONES
#endif

using Outputs = std::vector<Tensor>;
using Shape = std::vector<int64_t>;

/// The outputs of a kernel with one, \p t moved in (an initializer list
/// would copy it).
inline Outputs single(Tensor t) {
  Outputs outs;
  outs.push_back(std::move(t));
  return outs;
}

template <typename T> constexpr bool isFloat = std::is_floating_point_v<T>;
template <typename T> constexpr bool isBool = std::is_same_v<T, bool>;

/// Runs fn(T{}) with T the storage type of \p x, input \p index of the node;
/// another than a floating type is unsupported.
template <typename Fn>
llvm::Expected<Outputs> onFloat(const OpContext &ctx, const Tensor &x, size_t index, Fn &&fn) {
  return visitStorage(x.elemType(), [&](auto tag) -> llvm::Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!isFloat<T>)
      return ctx.unsupportedType(x, index);
    else
      return fn(tag);
  });
}

inline int64_t product(llvm::ArrayRef<int64_t> dims) { return numElementsOf(dims); }

/// Strides for reading a tensor of \p shape as if it had \p outShape (shape
/// right-aligned): 0 along broadcast dimensions (KernelBodies' rule).
inline Shape broadcastStrides(llvm::ArrayRef<int64_t> shape, llvm::ArrayRef<int64_t> outShape) {
  assert(shape.size() <= outShape.size() && "shape has more dimensions than it broadcasts to");
  return kernels::broadcastStrides(shape, outShape);
}

/// Calls fn(outIndex, offsets) for every element of \p outShape in row-major
/// order; offsets[k] is the flat offset of that element in operand k, read
/// through strides[k] (one stride per output dimension). The innermost
/// dimension runs as a plain loop, so a walk costs little more than a copy.
template <size_t N, typename Fn>
void forEachStrided(llvm::ArrayRef<int64_t> outShape, const std::array<Shape, N> &strides,
                    Fn &&fn) {
  int64_t total = product(outShape);
  if (total == 0)
    return;
  size_t rank = outShape.size();
  std::array<int64_t, N> base{};
  if (rank == 0) {
    fn(int64_t(0), base);
    return;
  }
  int64_t inner = outShape[rank - 1];
  std::array<int64_t, N> innerStride;
  for (size_t k = 0; k < N; ++k)
    innerStride[k] = strides[k][rank - 1];
  Shape counter(rank, 0);
  int64_t out = 0;
  for (int64_t outer = 0, e = total / inner; outer < e; ++outer) {
    std::array<int64_t, N> offsets = base;
    for (int64_t j = 0; j < inner; ++j) {
      fn(out++, offsets);
      for (size_t k = 0; k < N; ++k)
        offsets[k] += innerStride[k];
    }
    for (int64_t d = static_cast<int64_t>(rank) - 2; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k)
        base[k] += strides[k][d];
      if (++counter[d] < outShape[d])
        break;
      for (size_t k = 0; k < N; ++k)
        base[k] -= strides[k][d] * outShape[d];
      counter[d] = 0;
    }
  }
}

/// Reads \p in (storage type T) broadcast to \p outShape into a new tensor.
template <typename T> Tensor expandTo(const Tensor &in, llvm::ArrayRef<int64_t> outShape) {
  Tensor out = Tensor::uninitialized(in.elemType(), outShape); // every element is written
  const T *src = in.data<T>();
  T *dst = out.data<T>();
  if (llvm::ArrayRef<int64_t>(in.shape()) == outShape) {
    std::copy(src, src + in.numElements(), dst);
    return out;
  }
  // The trailing dimensions the input holds whole are copied as runs (GQA's
  // repeat of a key cache over its query heads).
  size_t rank = outShape.size(), inRank = in.shape().size(), split = rank;
  int64_t run = 1;
  while (split > 0 && split - 1 + inRank >= rank &&
         in.shape()[split - 1 + inRank - rank] == outShape[split - 1])
    run *= outShape[--split];
  Shape strides = broadcastStrides(in.shape(), outShape);
  if (run >= 16 && split > 0) {
    forEachStrided<1>(outShape.take_front(split), {Shape(strides.begin(), strides.begin() + split)},
                      [&](int64_t o, const std::array<int64_t, 1> &off) {
                        std::copy(src + off[0], src + off[0] + run, dst + o * run);
                      });
    return out;
  }
  forEachStrided<1>(outShape, {strides},
                    [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  return out;
}

inline Tensor expandAny(const Tensor &in, llvm::ArrayRef<int64_t> outShape) {
  return visitStorage(in.elemType(),
                      [&](auto tag) { return expandTo<decltype(tag)>(in, outShape); });
}

/// Elements below which an element-wise loop runs on the calling thread
/// alone: waking the rank's loop threads costs more than they would save.
constexpr int64_t parallelElements = int64_t(1) << 15;

/// out[o] = fn(a[.], b[.]) over the broadcast of a and b. The trailing
/// dimensions both operands hold whole are read as runs (a bias row, or an
/// attention mask shared by the heads), so the inner loop is plain and
/// vectorises; the rank's loop threads take runs of output elements. fn
/// must be pure: each element is computed once, on some thread.
template <typename TA, typename TB, typename TO, typename Fn>
Tensor broadcastBinary(const Tensor &a, const Tensor &b, DType outType,
                       llvm::ArrayRef<int64_t> outShape, Fn &&fn) {
  Tensor out = Tensor::uninitialized(outType, outShape); // every element is written
  const TA *pa = a.data<TA>();
  const TB *pb = b.data<TB>();
  TO *po = out.data<TO>();
  llvm::ArrayRef<int64_t> aShape = a.shape(), bShape = b.shape();
  int64_t total = out.numElements();
  int64_t grain = std::max<int64_t>(1, parallelElements / 2);
  if (aShape == outShape && bShape == outShape) {
    parallelFor(total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        po[i] = fn(pa[i], pb[i]);
    });
    return out;
  }
  if (aShape == outShape && b.numElements() == 1) {
    TB scalar = pb[0];
    parallelFor(total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        po[i] = fn(pa[i], scalar);
    });
    return out;
  }
  size_t rank = outShape.size(), split = rank;
  int64_t run = 1;
  auto holds = [&](llvm::ArrayRef<int64_t> shape, size_t d) {
    size_t lead = rank - shape.size();
    return d >= lead && shape[d - lead] == outShape[d];
  };
  while (split > 0 && holds(aShape, split - 1) && holds(bShape, split - 1))
    run *= outShape[--split];
  Shape aStrides = broadcastStrides(aShape, outShape),
        bStrides = broadcastStrides(bShape, outShape);
  if (run < 16 || split == 0) {
    forEachStrided<2>(
        outShape, {aStrides, bStrides},
        [&](int64_t o, const std::array<int64_t, 2> &off) { po[o] = fn(pa[off[0]], pb[off[1]]); });
    return out;
  }
  // Run r of the output starts where the leading dimensions' index of r
  // points in each operand.
  int64_t runs = total / run;
  parallelFor(runs, std::max<int64_t>(1, grain / run), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t rest = r, offA = 0, offB = 0;
      for (size_t d = split; d-- > 0;) {
        int64_t index = rest % outShape[d];
        rest /= outShape[d];
        offA += index * aStrides[d];
        offB += index * bStrides[d];
      }
      const TA *ra = pa + offA;
      const TB *rb = pb + offB;
      TO *ro = po + r * run;
      for (int64_t j = 0; j < run; ++j)
        ro[j] = fn(ra[j], rb[j]);
    }
  });
  return out;
}

/// The input's shape with dimension \p axis split out: sizes before, at and
/// after it. Most axis kernels loop over (outer, axis, inner).
struct AxisSplit {
  int64_t outer, size, inner;
};
/// Partial results a row reduction keeps apart: one running sum waits an
/// add's latency per element, eight independent ones fill a vector.
constexpr int reductionLanes = 8;

/// The sum over k in [0, n) of term(k), in double: eight partial sums over
/// interleaved elements, combined in a fixed order, so the loop vectorises
/// and the result depends only on n and the terms (not on threads). Always
/// inlined, so that a PIPEC_VECTOR_CLONES caller vectorises it for its own
/// target rather than calling the baseline version.
template <typename Term> [[gnu::always_inline]] inline double laneSum(int64_t n, Term term) {
  double lane[reductionLanes] = {};
  int64_t k = 0;
  for (; k + reductionLanes <= n; k += reductionLanes)
    for (int l = 0; l < reductionLanes; ++l)
      lane[l] += double(term(k + l));
  double tail = 0;
  for (; k < n; ++k)
    tail += double(term(k));
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) +
         tail;
}

/// The lanes KernelBodies' row functions take on the CPU: one thread walks
/// the row; sums are laneSum's and maxima take eight lanes too, so that the
/// loops vectorise and the bits do not depend on the vector width. Always
/// inlined, as laneSum.
struct VectorLanes {
  template <typename F> [[gnu::always_inline]] void forEach(int64_t n, F f) const {
    for (int64_t j = 0; j < n; ++j)
      f(j);
  }
  template <typename F> [[gnu::always_inline]] double sumOf(int64_t n, F term) const {
    return laneSum(n, term);
  }
  /// The largest term (NaNs skipped; -infinity when there is none).
  template <typename T, typename F> [[gnu::always_inline]] T maxOf(int64_t n, F term) const {
    T lane[reductionLanes];
    for (T &v : lane)
      v = -std::numeric_limits<T>::infinity();
    int64_t k = 0;
    for (; k + reductionLanes <= n; k += reductionLanes)
      for (int l = 0; l < reductionLanes; ++l) {
        T v = term(k + l);
        lane[l] = v > lane[l] ? v : lane[l];
      }
    T best = -std::numeric_limits<T>::infinity();
    for (; k < n; ++k) {
      T v = term(k);
      best = v > best ? v : best;
    }
    for (T v : lane)
      best = v > best ? v : best;
    return best;
  }
  bool leader() const { return true; }
};

/// Softmax (or log-softmax) of float rows [begin, end) of \p size, x to y
/// (which may be x for softmax): kernels::softmaxRowAt on each row, compiled
/// for the CPU's vectors. Softmax's kernel on its rows, and
/// SoftmaxAttention's.
void softmaxRowRange(const float *x, float *y, int64_t size, int64_t begin, int64_t end,
                     bool logarithm);

inline AxisSplit splitAt(llvm::ArrayRef<int64_t> shape, int64_t axis) {
  return {product(shape.take_front(axis)), shape[axis], product(shape.drop_front(axis + 1))};
}

/// Converts a double to T without undefined behaviour: NaN becomes 0,
/// out-of-range values saturate (KernelBodies' castValue, which the device
/// kernels use too).
template <typename T> T saturatingCast(double v) { return kernels::castValue<double, T>(v); }

/// GEMM on any numeric storage type: OpenBLAS for float and double, a plain
/// triple loop for the integer types, which BLAS lacks.
template <typename T>
void gemmAny(bool transA, bool transB, int64_t m, int64_t n, int64_t k, T alpha, const T *a,
             int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
  if constexpr (isFloat<T>) {
    pipec::cpu::gemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        T sum = 0;
        for (int64_t p = 0; p < k; ++p)
          sum += (transA ? a[p * lda + i] : a[i * lda + p]) *
                 (transB ? b[j * ldb + p] : b[p * ldb + j]);
        c[i * ldc + j] = static_cast<T>(alpha * sum + (beta == 0 ? T(0) : beta * c[i * ldc + j]));
      }
  }
}

/// y = fn(x) for the element types Accepts<T> admits; others are refused.
template <template <typename> class Accepts, typename Fn>
llvm::Expected<Outputs> unaryOver(const OpContext &ctx, Fn fn) {
  const Tensor &x = ctx.input(0);
  return visitStorage(x.elemType(), [&](auto tag) -> llvm::Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!Accepts<T>::value) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y = Tensor::uninitialized(x.elemType(), x.shape()); // every element is written
      const T *in = x.data<T>();
      T *out = y.data<T>();
      for (int64_t i = 0, e = x.numElements(); i < e; ++i)
        out[i] = static_cast<T>(fn(in[i]));
      return single(std::move(y));
    }
  });
}

template <typename T> struct NotBool : std::bool_constant<!isBool<T>> {};

/// y = fn(x) for floating x (float, double, float16, bfloat16).
template <typename Fn> llvm::Expected<Outputs> floatUnary(const OpContext &ctx, Fn fn) {
  return unaryOver<std::is_floating_point>(ctx, fn);
}

/// y = fn(x) for every numeric type (not bool).
template <typename Fn> llvm::Expected<Outputs> numericUnary(const OpContext &ctx, Fn fn) {
  return unaryOver<NotBool>(ctx, fn);
}

/// \p v rounded to what element type \p type holds (float, float16,
/// bfloat16); double and the other types keep it.
inline double roundAs(DType type, double v) {
  switch (type) {
  case DType::F32:
    return static_cast<float>(v);
  case DType::F16:
    return halfToFloat(floatToHalf(static_cast<float>(v)));
  case DType::BF16:
    return bfloat16ToFloat(floatToBFloat16(static_cast<float>(v)));
  default:
    return v;
  }
}

/// x / y without the trap of INT_MIN / -1, which wraps as in two's complement.

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_KERNELSUPPORT_H
