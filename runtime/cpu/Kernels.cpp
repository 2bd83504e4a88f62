//===- Kernels.cpp - The CPU's table of kernels, and runOp ----------------===//
//
// runOp looks a node's op up in the registry (ops/Ops.def), checks its
// inputs against the row's arity and calls the row's CPU kernel from one
// table built by expanding the CPU column. The kernels live in the files
// named in KernelTable.h; this file also holds the public building blocks
// of Kernels.h (broadcasting, sum-to-shape, transpose, the BLAS GEMM).
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/Kernels.h"
#include "runtime/cpu/ElementwiseKernels.h"
#include "runtime/cpu/FewRowGemm.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "support/Blas.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

using namespace llvm;

namespace pipec::cpu {

Tensor sumToShape(const Tensor &tensor, ArrayRef<int64_t> shape) {
  if (ArrayRef<int64_t>(tensor.shape()) == shape)
    return tensor.clone();
  Tensor out = Tensor::uninitialized(tensor.elemType(), shape); // every sum is written
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    // Floats accumulate in double: a gradient may sum thousands of terms.
    using Acc = std::conditional_t<isFloat<T>, double, T>;
    std::vector<Acc> sums(out.numElements(), Acc(0));
    const T *src = tensor.data<T>();
    forEachStrided<1>(tensor.shape(), {broadcastStrides(shape, tensor.shape())},
                      [&](int64_t i, const std::array<int64_t, 1> &off) {
                        if constexpr (isBool<T>)
                          sums[off[0]] = sums[off[0]] || src[i];
                        else
                          sums[off[0]] += src[i];
                      });
    std::transform(sums.begin(), sums.end(), out.data<T>(),
                   [](Acc v) { return static_cast<T>(v); });
  });
  out.roundToElemType();
  return out;
}

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
bool haveAvx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

/// The 8 x 8 block at \p in (rows \p ldIn apart) transposed to \p out (rows
/// \p ldOut apart): 32-bit elements moved, never computed on.
__attribute__((target("avx2"))) void transpose8x8(const float *in, int64_t ldIn, float *out,
                                                  int64_t ldOut) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i)
    r[i] = _mm256_loadu_ps(in + i * ldIn);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldOut, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldOut, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#else
bool haveAvx2() { return false; }
void transpose8x8(const float *, int64_t, float *, int64_t) {}
#endif

} // namespace

void transposeFloats(const float *in, int64_t rows, int64_t cols, int64_t ldIn, float *out,
                     int64_t ldOut) {
  int64_t i = 0;
  if (haveAvx2())
    for (; i + 8 <= rows; i += 8) {
      int64_t j = 0;
      for (; j + 8 <= cols; j += 8)
        transpose8x8(in + i * ldIn + j, ldIn, out + j * ldOut + i, ldOut);
      for (int64_t ii = i; ii < i + 8; ++ii)
        for (int64_t jj = j; jj < cols; ++jj)
          out[jj * ldOut + ii] = in[ii * ldIn + jj];
    }
  for (; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      out[j * ldOut + i] = in[i * ldIn + j];
}

Tensor transpose(const Tensor &tensor, ArrayRef<int64_t> perm) {
  assert(static_cast<int64_t>(perm.size()) == tensor.rank());
  Shape outShape(perm.size()), readStrides(perm.size());
  Shape inStrides = stridesOf(tensor.shape());
  for (size_t i = 0; i < perm.size(); ++i) {
    outShape[i] = tensor.shape()[perm[i]];
    readStrides[i] = inStrides[perm[i]];
  }
  Tensor out = Tensor::uninitialized(tensor.elemType(), outShape); // every element is copied
  size_t rank = perm.size();
  bool leadingKept = true;
  for (size_t i = 0; i + 2 < rank; ++i)
    leadingKept &= perm[i] == static_cast<int64_t>(i);
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = tensor.data<T>();
    T *dst = out.data<T>();
    if (rank >= 2 && leadingKept && perm[rank - 2] == static_cast<int64_t>(rank - 1) &&
        perm[rank - 1] == static_cast<int64_t>(rank - 2)) {
      // Matrices transposed in tiles (weights in backward, attention keys).
      int64_t rows = tensor.shape()[rank - 2], cols = tensor.shape()[rank - 1];
      int64_t batch = rows * cols > 0 ? tensor.numElements() / (rows * cols) : 0;
      // Bands of 32 rows of each matrix go to the rank's loop threads (a
      // decode step transposes every layer's whole key cache).
      constexpr int64_t tile = 32;
      int64_t bands = (rows + tile - 1) / tile;
      int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, tile * cols));
      parallelFor(batch * bands, grain, [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
          int64_t b = w / bands, i0 = (w % bands) * tile, i1 = std::min(rows, i0 + tile);
          const T *in = src + b * rows * cols;
          T *o = dst + b * rows * cols;
          for (int64_t j0 = 0; j0 < cols; j0 += tile) {
            int64_t j1 = std::min(cols, j0 + tile);
            if constexpr (sizeof(T) == 4) {
              // 32-bit elements are moved as floats, never computed on.
              transposeFloats(reinterpret_cast<const float *>(in + i0 * cols + j0), i1 - i0,
                              j1 - j0, cols, reinterpret_cast<float *>(o + j0 * rows + i0), rows);
              continue;
            }
            for (int64_t i = i0; i < i1; ++i) {
              const T *row = in + i * cols;
              for (int64_t j = j0; j < j1; ++j)
                o[j * rows + i] = row[j];
            }
          }
        }
      });
      return;
    }
    if (rank >= 1 && perm[rank - 1] == static_cast<int64_t>(rank - 1) && !std::is_same_v<T, bool>) {
      // The last dimension stays innermost: copy whole rows (attention heads).
      int64_t row = tensor.shape()[rank - 1];
      if (row == 0)
        return;
      // Runs of rows go to the rank's loop threads, each finding where its
      // first row starts.
      int64_t rows = tensor.numElements() / row;
      int64_t grain = std::max<int64_t>(1, parallelElements / row);
      parallelFor(rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin; o < end; ++o) {
          int64_t rest = o, off = 0;
          for (size_t d = rank - 1; d-- > 0;) {
            off += (rest % outShape[d]) * readStrides[d];
            rest /= outShape[d];
          }
          std::memcpy(dst + o * row, src + off, row * sizeof(T));
        }
      });
      return;
    }
    forEachStrided<1>(outShape, {readStrides},
                      [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  });
  return out;
}

namespace {

/// C = alpha op(A) op(B) + beta C through \p blas (blas::sgemm or
/// blas::dgemm), each band's block of C written first by \p prepare when
/// given; BLAS rejects k == 0, which only scales C.
template <typename T, typename Blas>
void gemmWith(Blas blas, bool transA, bool transB, int64_t m, int64_t n, int64_t k, T alpha,
              const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc,
              GemmPrepare prepare) {
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    if (prepare)
      prepare(0, m, 0, n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  // The rank's loop threads each take a band of C's rows (or, when C is
  // wider than tall, of its columns) as a GEMM of its own on one BLAS
  // thread; a band does at least a million multiply-adds.
  auto band = [&](int64_t other) {
    return std::max<int64_t>(8, (int64_t(1) << 20) / std::max<int64_t>(1, other * k));
  };
  if (m >= n)
    parallelFor(m, band(n), [&](int64_t begin, int64_t end) {
      if (prepare)
        prepare(begin, end, 0, n);
      blas(transA, transB, end - begin, n, k, alpha, transA ? a + begin : a + begin * lda, lda, b,
           ldb, beta, c + begin * ldc, ldc);
    });
  else
    parallelFor(n, band(m), [&](int64_t begin, int64_t end) {
      if (prepare)
        prepare(0, m, begin, end);
      blas(transA, transB, m, end - begin, k, alpha, a, lda, transB ? b + begin * ldb : b + begin,
           ldb, beta, c + begin, ldc);
    });
}

} // namespace

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc,
          GemmPrepare prepare) {
  // A few rows by a weight (a decode step's Linear): the weight read as
  // stored (FewRowGemm.h), in bands of C's columns, where that was measured
  // faster here.
  if (!transA && m > 0 && n > 0 && k > 0 && alpha != 0) {
    const FewRowChoice &few = fewRowChoice();
    const FewRowKernels *kernels = transB ? few.transposed : few.plain;
    if (kernels && m <= (transB ? few.transposedRows : few.plainRows)) {
      int64_t grain = std::max<int64_t>(8, (int64_t(1) << 20) / (m * k));
      parallelFor(n, grain, [&](int64_t begin, int64_t end) {
        if (prepare)
          prepare(0, m, begin, end);
        if (transB)
          kernels->transposed(m, end - begin, k, alpha, a, lda, b + begin * ldb, ldb, beta,
                              c + begin, ldc);
        else
          fewRowsPlain(*kernels, m, end - begin, k, alpha, a, lda, b + begin, ldb, beta, c + begin,
                       ldc);
      });
      return;
    }
  }
  gemmWith(blas::sgemm, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, prepare);
}

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double *a,
          int64_t lda, const double *b, int64_t ldb, double beta, double *c, int64_t ldc,
          GemmPrepare prepare) {
  gemmWith(blas::dgemm, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, prepare);
}

//===----------------------------------------------------------------------===//
// The table
//===----------------------------------------------------------------------===//

KernelResult none(const OpContext &ctx) {
  return ctx.unsupported("no CPU kernel for op " + ctx.op());
}

namespace {

using KernelFn = KernelResult (*)(const OpContext &);
namespace elem = kernels::elem;

/// The CPU kernel of each row of Ops.def, by OpId.
// clang-format off
const KernelFn kernelTable[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, ...) &CPU,
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, COST, GRAD, CPU, ...)                    \
    &CPU<elem::ID, ARITY>,
#include "ops/Ops.def"
};
// clang-format on

/// The row of \p node when the CPU runs it, or an UnsupportedError.
Expected<const OpDef *> rowOf(const onnx::NodeProto &node, int64_t opset) {
  const OpDef *def = lookupOp(node.domain(), node.op_type(), opset);
  if (def && def->hasCpuKernel)
    return def;
  if (!opDomainOf(node.domain()))
    return make_error<UnsupportedError>(nodeLabel(node), node.op_type(),
                                        "no CPU kernel for domain '" + node.domain() + "'");
  std::string where = node.domain().empty() || node.domain() == "ai.onnx"
                          ? std::string()
                          : " of domain '" + node.domain() + "'";
  return make_error<UnsupportedError>(nodeLabel(node), node.op_type(),
                                      "no CPU kernel for op " + node.op_type() + where);
}

/// Checks \p ctx's inputs against its row: how many, and that the required
/// ones are there.
Error checkArity(const OpContext &ctx) {
  const OpDef &def = *ctx.def;
  // The values its subgraphs capture follow a control-flow node's own
  // inputs; its kernel tells them apart and checks them.
  if (def.has(Subgraph))
    return Error::success();
  int given = ctx.node.input_size();
  if (!def.isVariadic() && given > def.maxInputs)
    return ctx.fail(formatv("{0} inputs, at most {1} expected", given, def.maxInputs));
  if (given < def.minInputs)
    return ctx.fail(formatv("{0} inputs, at least {1} expected", given, def.minInputs));
  int required = def.isVariadic() ? given : def.minInputs;
  for (int i = 0; i < required; ++i)
    if (!ctx.optInput(i))
      return ctx.fail("missing required input " + Twine(i));
  return Error::success();
}

} // namespace

bool isSupported(StringRef opType, StringRef domain) {
  const OpDef *def = lookupOp(domain, opType);
  return def && def->hasCpuKernel;
}

Expected<std::vector<Tensor>> runOp(const onnx::NodeProto &node, int64_t opset,
                                    ArrayRef<const Tensor *> inputs) {
  return runOp(node, opset, inputs, nullptr);
}

Expected<std::vector<Tensor>> runOp(const onnx::NodeProto &node, int64_t opset,
                                    ArrayRef<const Tensor *> inputs, const OpDef *row,
                                    ParsedAttrs *attrs) {
  Expected<const OpDef *> def = row ? Expected<const OpDef *>(row) : rowOf(node, opset);
  if (!def)
    return def.takeError();
  OpContext ctx(node, opset, inputs, *def, attrs);
  if (static_cast<int>(inputs.size()) > node.input_size())
    return ctx.fail(
        formatv("{0} input tensors for {1} node inputs", inputs.size(), node.input_size()));
  for (const Tensor *t : inputs)
    if (t && t->isNull())
      return ctx.fail("an input is a null tensor");
  if (Error err = checkArity(ctx))
    return err;

  Expected<Outputs> outputs = kernelTable[static_cast<size_t>((*def)->id)](ctx);
  if (!outputs)
    return outputs.takeError();
  size_t wanted = ctx.numOutputs();
  for (size_t i = outputs->size(); i < wanted; ++i)
    if (ctx.wantsOutput(i))
      return ctx.unsupported(formatv("output {0} ('{1}')", i, node.output(static_cast<int>(i))));
  outputs->resize(wanted);
  // Half-precision results were computed in float; round them unless they
  // are views of an input (already representable, and not ours to write).
  for (Tensor &out : *outputs) {
    if (out.isNull() || (out.elemType() != DType::F16 && out.elemType() != DType::BF16))
      continue;
    bool shared = llvm::any_of(
        inputs, [&](const Tensor *in) { return in && in->rawData() == out.rawData(); });
    if (!shared)
      out.roundToElemType();
  }
  return std::move(*outputs);
}

void setBlasThreads(int threads) { blas::setNumThreads(std::max(1, threads)); }

} // namespace pipec::cpu
