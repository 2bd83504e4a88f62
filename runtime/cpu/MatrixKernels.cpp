//===- MatrixKernels.cpp - MatMul, Gemm, Conv and the pools on the CPU ------===//
//
// The products go to the BLAS (float, double) or a plain loop (integers);
// Conv is im2col per image and group, then one GEMM. Conv's im2col and
// bias and the pools loop around the device's per-element bodies
// (runtime/kernels/ConvBodies.h).
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Window.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <limits>

using namespace llvm;

namespace pipec::cpu {

/// MatMul with numpy semantics: 1-D operands gain and then lose a dimension,
/// batch dimensions broadcast.
Expected<Outputs> matMul(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  if (a.rank() == 0 || b.rank() == 0)
    return ctx.fail("operands must have rank >= 1, got " + a.describe() + " and " + b.describe());
  // Shapes kept inline: a decode step's MatMuls are small enough that
  // heap shapes would show.
  using Dims = Tensor::Dims;
  Dims aShape(a.shape().begin(), a.shape().end()), bShape(b.shape().begin(), b.shape().end());
  if (a.rank() == 1)
    aShape.insert(aShape.begin(), 1);
  if (b.rank() == 1)
    bShape.push_back(1);
  int64_t m = aShape[aShape.size() - 2], k = aShape.back();
  int64_t n = bShape.back();
  if (bShape[bShape.size() - 2] != k)
    return ctx.fail("inner dimensions differ: " + a.describe() + " x " + b.describe());
  ArrayRef<int64_t> aBatch = ArrayRef<int64_t>(aShape).drop_back(2);
  ArrayRef<int64_t> bBatch = ArrayRef<int64_t>(bShape).drop_back(2);
  // The batch dimensions broadcast, right-aligned.
  Dims batch(std::max(aBatch.size(), bBatch.size()), 1);
  for (size_t i = 0; i < batch.size(); ++i) {
    int64_t da = i < aBatch.size() ? aBatch[aBatch.size() - 1 - i] : 1;
    int64_t db = i < bBatch.size() ? bBatch[bBatch.size() - 1 - i] : 1;
    if (da != db && da != 1 && db != 1) {
      Expected<Shape> broadcast = broadcastShapes(aBatch, bBatch);
      return ctx.fail("batch dimensions: " + (broadcast ? std::string("do not broadcast")
                                                        : toString(broadcast.takeError())));
    }
    batch[batch.size() - 1 - i] = da == 1 ? db : da;
  }
  Dims outShape = batch;
  outShape.push_back(m);
  outShape.push_back(n);
  Dims finalShape = batch;
  if (a.rank() > 1)
    finalShape.push_back(m);
  if (b.rank() > 1)
    finalShape.push_back(n);

  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      // The products write every element (beta 0), but for k = 0 the BLAS
      // is not called: zeros then.
      Tensor out =
          k > 0 ? Tensor::uninitialized(a.elemType(), outShape) : Tensor(a.elemType(), outShape);
      const T *pa = a.data<T>(), *pb = b.data<T>();
      T *po = out.data<T>();
      if (product(bBatch) == 1 && aBatch == ArrayRef<int64_t>(batch)) {
        // One weight matrix for the whole batch: fold the batch into M.
        gemmAny<T>(false, false, product(aBatch) * m, n, k, T(1), pa, k, pb, n, T(0), po, n);
      } else {
        Shape aStrides = broadcastStrides(aBatch, batch),
              bStrides = broadcastStrides(bBatch, batch);
        for (int64_t &s : aStrides)
          s *= m * k;
        for (int64_t &s : bStrides)
          s *= k * n;
        // The products are independent: the rank's loop threads take runs
        // of them (attention's per-head products are small).
        std::vector<std::array<int64_t, 2>> offsets(product(batch));
        forEachStrided<2>(batch, {aStrides, bStrides},
                          [&](int64_t i, const std::array<int64_t, 2> &off) { offsets[i] = off; });
        int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, m * n * k));
        parallelFor(static_cast<int64_t>(offsets.size()), grain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            gemmAny<T>(false, false, m, n, k, T(1), pa + offsets[i][0], k, pb + offsets[i][1], n,
                       T(0), po + i * m * n, n);
        });
      }
      return Outputs{out.reshaped(finalShape)};
    }
  });
}

namespace {

/// Gemm's attributes, read once per node.
struct GemmAttrs {
  bool transA, transB;
  float alpha, beta;
};

} // namespace

/// Gemm: Y = alpha * op(A) * op(B) + beta * C, C broadcast to Y.
Expected<Outputs> gemmOp(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  const Tensor *c = ctx.optInput(2);
  if (a.rank() != 2 || b.rank() != 2)
    return ctx.fail("A and B must be matrices, got " + a.describe() + " and " + b.describe());
  GemmAttrs at = ctx.parsed<GemmAttrs>([&] {
    return GemmAttrs{ctx.attrInt("transA", 0) != 0, ctx.attrInt("transB", 0) != 0,
                     ctx.attrFloat("alpha", 1.0f), ctx.attrFloat("beta", 1.0f)};
  });
  bool transA = at.transA, transB = at.transB;
  int64_t m = transA ? a.dim(1) : a.dim(0), k = transA ? a.dim(0) : a.dim(1);
  int64_t kb = transB ? b.dim(1) : b.dim(0), n = transB ? b.dim(0) : b.dim(1);
  if (k != kb)
    return ctx.fail("inner dimensions differ: " + a.describe() + " x " + b.describe() +
                    (transA ? " (transA)" : "") + (transB ? " (transB)" : ""));
  const int64_t outShape[2] = {m, n};
  // C's strides as Y's rows and columns read it (0 along a broadcast one).
  int64_t cStrides[2] = {0, 0};
  if (c) {
    if (c->elemType() != a.elemType())
      return ctx.fail("C must have A's element type");
    int64_t rows = c->rank() == 2 ? c->dim(0) : 1, cols = c->rank() >= 1 ? c->dim(-1) : 1;
    if (c->rank() > 2 || (rows != 1 && rows != m) || (cols != 1 && cols != n))
      return ctx.fail("C " + c->describe() + " does not broadcast to " + shapeString(outShape));
    cStrides[0] = rows == 1 ? 0 : cols;
    cStrides[1] = cols == 1 ? 0 : 1;
  }
  double alpha = at.alpha, beta = c ? at.beta : 0.0;
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      // Without C, beta is 0 and the product writes every element (for
      // k = 0, gemm writes the zeros itself).
      if constexpr (isFloat<T>) {
        // C is broadcast into each band of Y by the thread that computes it.
        Tensor y = Tensor::uninitialized(a.elemType(), outShape); // every element is written
        T *py = y.data<T>();
        const T *pc = c ? c->data<T>() : nullptr;
        auto fillC = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
          for (int64_t i = r0; i < r1; ++i) {
            const T *row = pc + i * cStrides[0];
            if (cStrides[1] == 1)
              std::copy(row + c0, row + c1, py + i * n + c0);
            else
              std::fill(py + i * n + c0, py + i * n + c1, row[0]);
          }
        };
        cpu::gemm(transA, transB, m, n, k, static_cast<T>(alpha), a.data<T>(), a.dim(1),
                  b.data<T>(), b.dim(1), static_cast<T>(beta), py, n,
                  c ? GemmPrepare(fillC) : GemmPrepare());
        return single(std::move(y));
      } else {
        Tensor y = c ? expandTo<T>(*c, outShape) : Tensor::uninitialized(a.elemType(), outShape);
        gemmAny<T>(transA, transB, m, n, k, static_cast<T>(alpha), a.data<T>(), a.dim(1),
                   b.data<T>(), b.dim(1), static_cast<T>(beta), y.data<T>(), n);
        return single(std::move(y));
      }
    }
  });
}

Expected<Window> windowGeometry(const OpContext &ctx, ArrayRef<int64_t> spatial,
                                ArrayRef<int64_t> kernel, bool ceilMode) {
  int64_t rank = static_cast<int64_t>(spatial.size());
  if (rank < 1 || rank > Window::maxRank)
    return ctx.unsupported(formatv("{0} spatial dimensions (1 to 3 are supported)", rank));
  if (static_cast<int64_t>(kernel.size()) != rank)
    return ctx.fail("kernel_shape " + shapeString(kernel) + " does not match the input's " +
                    Twine(rank) + " spatial dimensions");
  Expected<WindowAttrs> attrs = ctx.windowAttrs(rank);
  if (!attrs)
    return attrs.takeError();
  const Shape &pads = attrs->pads;
  Window w; // sizes 1 and pads 0 in the leading dimensions
  w.rank = rank;
  int64_t lead = Window::maxRank - rank;
  for (int64_t i = 0; i < rank; ++i) {
    int64_t d = lead + i, in = spatial[i], k = kernel[i], s = attrs->strides[i],
            dil = attrs->dilations[i];
    if (k < 1)
      return ctx.fail("kernel_shape must be positive");
    int64_t effective = (k - 1) * dil + 1;
    int64_t begin = pads[i], end = pads[rank + i], out;
    if (attrs->same()) {
      out = (in + s - 1) / s;
      std::tie(begin, end) = attrs->samePads(std::max<int64_t>(0, (out - 1) * s + effective - in));
    } else {
      int64_t span = in + begin + end - effective;
      if (span < 0)
        return ctx.fail(formatv("kernel extent {0} exceeds padded input size {1}", effective,
                                in + begin + end));
      out = (ceilMode ? (span + s - 1) / s : span / s) + 1;
      // A window that would start in the end padding is dropped.
      if (ceilMode && (out - 1) * s >= in + begin)
        --out;
    }
    w.in[d] = in;
    w.kernel[d] = k;
    w.stride[d] = s;
    w.dilation[d] = dil;
    w.padBegin[d] = begin;
    w.padEnd[d] = end;
    w.out[d] = out;
  }
  return w;
}

Expected<Window> poolWindow(const OpContext &ctx, const Tensor &x) {
  if (x.rank() < 3)
    return ctx.fail("X must have rank >= 3, got " + x.describe());
  std::optional<Shape> kernel = ctx.attrInts("kernel_shape");
  if (!kernel)
    return ctx.fail("missing attribute 'kernel_shape'");
  return windowGeometry(ctx, ArrayRef<int64_t>(x.shape()).drop_front(2), *kernel,
                        ctx.attrInt("ceil_mode", 0));
}

/// Conv (1-D to 3-D, groups): im2col per image and group, then a GEMM.
Expected<Outputs> conv(const OpContext &ctx) {
  return convolve(ctx, ctx.input(0), ctx.input(1), ctx.optInput(2), false);
}

Expected<Outputs> convolve(const OpContext &ctx, const Tensor &x, const Tensor &weight,
                           const Tensor *bias, bool int32) {
  if (x.elemType() != weight.elemType())
    return ctx.fail("X and W must have one element type, got " + x.describe() + " and " +
                    weight.describe());
  if (bias && bias->elemType() != x.elemType())
    return ctx.fail("B must have X's element type");
  if (x.rank() < 3 || weight.rank() != x.rank())
    return ctx.fail("X and W must have the same rank >= 3, got " + x.describe() + " and " +
                    weight.describe());
  int64_t group = ctx.attrInt("group", 1);
  int64_t batch = x.dim(0), channels = x.dim(1), maps = weight.dim(0);
  if (group < 1 || channels % group != 0 || maps % group != 0 || weight.dim(1) != channels / group)
    return ctx.fail(
        formatv("W {0} does not fit X {1} with group {2}", weight.describe(), x.describe(), group));
  if (bias && (bias->rank() != 1 || bias->dim(0) != maps))
    return ctx.fail("B must have shape [" + Twine(maps) + "], got " + bias->describe());
  ArrayRef<int64_t> kernel = ArrayRef<int64_t>(weight.shape()).drop_front(2);
  if (std::optional<Shape> given = ctx.attrInts("kernel_shape");
      given && ArrayRef<int64_t>(*given) != kernel)
    return ctx.fail("kernel_shape " + shapeString(*given) + " differs from W " + weight.describe());
  Expected<Window> w =
      windowGeometry(ctx, ArrayRef<int64_t>(x.shape()).drop_front(2), kernel, false);
  if (!w)
    return w.takeError();
  Shape outShape = w->outShape(batch, maps);

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!isFloat<T> && !std::is_same_v<T, int32_t>) {
      return ctx.unsupportedType(x, 0);
    } else {
      if (!isFloat<T> && !int32)
        return ctx.unsupportedType(x, 0);
      Tensor y(x.elemType(), outShape);
      int64_t groupChannels = channels / group, groupMaps = maps / group;
      int64_t rows = groupChannels * w->kernelSize(), cols = w->outSize();
      // A 1x1 kernel over the unpadded input reads the image as the columns.
      bool pointwise = w->isIdentity();
      std::vector<T> columns(pointwise ? 0 : rows * cols);
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t g = 0; g < group; ++g) {
          const T *image = x.data<T>() + (n * channels + g * groupChannels) * w->inSize();
          const T *cols2 = image;
          if (!pointwise) {
            im2col(image, groupChannels, *w, columns.data());
            cols2 = columns.data();
          }
          T *out = y.data<T>() + (n * maps + g * groupMaps) * cols;
          gemmAny<T>(false, false, groupMaps, cols, rows, T(1),
                     weight.data<T>() + g * groupMaps * rows, rows, cols2, cols, T(0), out, cols);
        }
      if (bias)
        forEachRow(batch * maps, cols, [&](int64_t row) {
          for (int64_t i = row * cols; i < (row + 1) * cols; ++i)
            kernels::biasElement(i, maps, cols, bias->data<T>(), y.data<T>());
        });
      return Outputs{y};
    }
  });
}

/// MaxPool (with optional Indices output) and AveragePool over 1-D to 3-D.
template <bool IsMax> Expected<Outputs> pool(const OpContext &ctx) {
  const bool isMax = IsMax;
  const Tensor &x = ctx.input(0);
  Expected<Window> geometry = poolWindow(ctx, x);
  if (!geometry)
    return geometry.takeError();
  const Window &w = *geometry;
  bool includePad = ctx.attrInt("count_include_pad", 0);
  bool columnMajor = ctx.attrInt("storage_order", 0);
  int64_t planes = x.dim(0) * x.dim(1);
  Shape outShape = w.outShape(x.dim(0), x.dim(1));

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      if (!isMax && !isFloat<T>)
        return ctx.unsupportedType(x, 0);
      bool wantsIndices = isMax && ctx.wantsOutput(1);
      Tensor y = Tensor::uninitialized(x.elemType(), outShape); // every element is written
      Tensor indices = wantsIndices ? Tensor::uninitialized(DType::I64, outShape) : Tensor();
      kernels::PoolParams p;
      p.w = w;
      p.isMax = isMax, p.includePad = includePad;
      const T *in = x.data<T>();
      T *out = y.data<T>();
      int64_t *outIndex = wantsIndices ? indices.data<int64_t>() : nullptr;
      int64_t inSize = w.inSize(), outSize = w.outSize();
      // Indices: the maximum's position in X, its spatial part column-major
      // for storage_order 1; -1 for a window of padding only.
      auto indexOf = [&](int64_t plane, int64_t at) -> int64_t {
        if (at < 0)
          return -1;
        if (columnMajor) {
          int64_t iw = at % w.in[2], rest = at / w.in[2], ih = rest % w.in[1], id = rest / w.in[1];
          at = id + (ih + iw * w.in[1]) * w.in[0];
        }
        return plane * inSize + at;
      };
      forEachRow(planes, outSize, [&](int64_t plane) {
        for (int64_t o = 0, t = plane * outSize; o < outSize; ++o, ++t) {
          if (outIndex)
            outIndex[t] = indexOf(plane, kernels::poolArgmax(p.w, o, in + plane * inSize, out[t]));
          else
            kernels::poolElement(t, p, in, out);
        }
      });
      if (wantsIndices)
        return Outputs{y, indices};
      return Outputs{y};
    }
  });
}

/// GlobalAveragePool and GlobalMaxPool: one value per (batch, channel).
template <bool IsMax> Expected<Outputs> globalPool(const OpContext &ctx) {
  const bool isMax = IsMax;
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail("X must have rank >= 2, got " + x.describe());
  Shape outShape = x.shape();
  std::fill(outShape.begin() + 2, outShape.end(), 1);
  int64_t planes = x.dim(0) * x.dim(1);
  int64_t size = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y(x.elemType(), outShape);
    for (int64_t p = 0; p < planes; ++p) {
      const T *in = x.data<T>() + p * size;
      double acc = isMax ? -std::numeric_limits<double>::infinity() : 0;
      for (int64_t i = 0; i < size; ++i)
        acc = isMax ? std::max(acc, double(in[i])) : acc + in[i];
      y.data<T>()[p] = static_cast<T>(isMax ? acc : acc / size);
    }
    return Outputs{y};
  });
}

template Expected<Outputs> pool<true>(const OpContext &);
template Expected<Outputs> pool<false>(const OpContext &);
template Expected<Outputs> globalPool<true>(const OpContext &);
template Expected<Outputs> globalPool<false>(const OpContext &);

} // namespace pipec::cpu
