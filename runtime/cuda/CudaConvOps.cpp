//===- CudaConvOps.cpp - Convolution, pooling, the optimizer ----------------===//
//
// The CUDA backend's convolution (im2col and cuBLAS), pooling and batch
// normalization with their gradients, and the executor's own operations:
// sums, the gradient norm and the optimizer update.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/CudaOps.h"

using namespace llvm;

namespace pipec::cuda {

//===----------------------------------------------------------------------===//
// Convolution, pooling and batch normalization
//===----------------------------------------------------------------------===//

namespace {

/// Im2col columns of one batch chunk stay under this size (one image's at
/// least).
constexpr int64_t ConvColumnBytes = int64_t(256) << 20;

Shape spatialOf(ArrayRef<int64_t> shape) { return Shape(shape.begin() + 2, shape.end()); }

/// \p shape's first two dimensions, then the window's output sizes.
Shape windowOutShape(int64_t batch, int64_t channels, const k::ConvWindow &w, size_t rank) {
  Shape shape{batch, channels};
  for (size_t i = 0; i < rank; ++i)
    shape.push_back(w.out[3 - rank + i]);
  return shape;
}

/// The window attributes of \p n over \p rank spatial dimensions
/// (ops/Window.h, as the CPU kernels read them); nullopt under auto_pad
/// SAME_UPPER or SAME_LOWER (the CPU kernels compute those) and for a
/// malformed node (the host backend words its error).
std::optional<WindowAttrs> windowAttrs(const NodeView &n, size_t rank) {
  Expected<WindowAttrs> a = n.windowAttrs(static_cast<int64_t>(rank));
  if (!a) {
    consumeError(a.takeError());
    return std::nullopt;
  }
  if (a->same())
    return std::nullopt;
  return std::move(*a);
}

/// Images per im2col chunk for images of \p imageFloats column floats.
int64_t convChunk(int64_t imageFloats, int64_t batch) {
  int64_t fit = ConvColumnBytes / std::max<int64_t>(imageFloats * int64_t(sizeof(float)), 1);
  return std::clamp<int64_t>(fit, 1, std::max<int64_t>(batch, 1));
}

/// Conv's operands: X [N, C, in...], W [M, C / group, kernel...] and its
/// window, as the forward op and both gradients see them.
struct ConvGeometry {
  int64_t batch, channels, maps, group;
  k::ConvWindow w;
  int64_t gc() const { return channels / group; }
  int64_t gm() const { return maps / group; }
  int64_t rows() const { return gc() * w.kernelSize(); }
  int64_t cols() const { return w.outSize(); }
};

/// Images per im2col chunk of \p g and a column buffer for one chunk, from
/// \p scratch; none when the window is the identity (the GEMM reads the
/// images as they are).
struct ColumnChunks {
  int64_t chunk;
  std::shared_ptr<void> block;
  float *columns() const { return static_cast<float *>(block.get()); }
};

Expected<ColumnChunks>
columnChunks(const ConvGeometry &g,
             function_ref<Expected<std::shared_ptr<void>>(size_t bytes)> scratch) {
  if (g.w.isIdentity())
    return ColumnChunks{g.batch, nullptr};
  int64_t floats = g.group * g.rows() * g.cols(), chunk = convChunk(floats, g.batch);
  Expected<std::shared_ptr<void>> block =
      scratch(static_cast<size_t>(chunk * floats) * sizeof(float));
  if (!block)
    return block.takeError();
  return ColumnChunks{chunk, *block};
}

/// The geometry of a 1-D to 3-D Conv of X \p x and W \p weight; with
/// \p out (dY's shape, for a gradient) the output sizes are given. Nullopt
/// for what the device does not handle or a malformed node (nonempty
/// tensors only).
std::optional<ConvGeometry> convGeometry(const NodeView &n, ArrayRef<int64_t> x,
                                         ArrayRef<int64_t> weight,
                                         std::optional<ArrayRef<int64_t>> out) {
  if (x.size() < 3 || x.size() > 5 || weight.size() != x.size() || product(x) == 0 ||
      product(weight) == 0)
    return std::nullopt;
  ConvGeometry g{x[0], x[1], weight[0], n.attrInt("group", 1), {}};
  if (g.group < 1 || g.channels % g.group != 0 || g.maps % g.group != 0 ||
      weight[1] != g.channels / g.group)
    return std::nullopt;
  Shape kernel = spatialOf(weight);
  if (auto given = n.attrInts("kernel_shape"); given && *given != kernel)
    return std::nullopt;
  size_t rank = kernel.size();
  auto attrs = windowAttrs(n, rank);
  if (!attrs)
    return std::nullopt;
  if (out) {
    if (out->size() != x.size() || (*out)[0] != g.batch || (*out)[1] != g.maps ||
        !k::makeGradWindow(spatialOf(x), kernel, attrs->strides, attrs->dilations, attrs->pads,
                           spatialOf(*out), g.w))
      return std::nullopt;
  } else if (!k::makeConvWindow(spatialOf(x), kernel, attrs->strides, attrs->dilations, attrs->pads,
                                false, g.w)) {
    return std::nullopt;
  }
  if (g.w.outSize() == 0 || !fitsInt(g.rows()) || !fitsInt(g.cols()) || !fitsInt(g.gm()) ||
      !fitsInt(g.w.inSize()))
    return std::nullopt;
  return g;
}

} // namespace

Result CudaBackend::conv(const NodeView &n) {
  const Tensor *x = n.in(0), *weight = n.in(1), *bias = n.in(2);
  if (!isFloat(x) || !isFloat(weight) || (n.in(2) && !isFloat(bias)) || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, x->shape(), weight->shape(), std::nullopt);
  if (!geometry || (bias && (bias->rank() != 1 || bias->dim(0) != geometry->maps)))
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize();
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(wd, onDevice(*weight));
  PIPEC_TRY_ASSIGN(y, allocate(DType::F32, windowOutShape(g.batch, g.maps, g.w, x->rank() - 2)));
  const float *image = static_cast<const float *>(xd.rawData());
  const float *w = static_cast<const float *>(wd.rawData());
  float *out = static_cast<float *>(y.rawData());
  bool identity = g.w.isIdentity();
  PIPEC_TRY_ASSIGN(chunks, columnChunks(g, [&](size_t bytes) { return scratch(bytes); }));
  float *columns = chunks.columns();
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunks.chunk) {
    int64_t count = std::min(chunks.chunk, g.batch - n0);
    const float *source = image + n0 * g.channels * inSize;
    int64_t sourceN = g.channels * inSize, sourceG = g.gc() * inSize;
    if (!identity) {
      k::Im2colParams p;
      p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
      PIPEC_CUDA_TRY(launchIm2col(p, source, columns, stream));
      source = columns, sourceN = g.group * rows * cols, sourceG = rows * cols;
    }
    // Y_(n, g) = W_g [gm, rows] x columns_(n, g) [rows, cols].
    if (Error err = gemmGrid(false, false, g.gm(), cols, rows, w, rows, 0, g.gm() * rows, source,
                             cols, sourceN, sourceG, 0.0f, out + n0 * g.maps * cols, cols,
                             g.maps * cols, g.gm() * cols, count, g.group))
      return err;
  }
  if (bias) {
    PIPEC_TRY_ASSIGN(b, onDevice(*bias));
    PIPEC_CUDA_TRY(launchBias(y.numElements(), g.maps, cols,
                              static_cast<const float *>(b.rawData()), out, stream));
  }
  return Outputs{y};
}

Result CudaBackend::convGradInput(const NodeView &n) {
  const Tensor *dy = n.in(0), *weight = n.in(1);
  auto xShape = n.attrInts("shape");
  if (!isFloat(dy) || !isFloat(weight) || !xShape || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, *xShape, weight->shape(), dy->shape());
  if (!geometry)
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize();
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(wd, onDevice(*weight));
  PIPEC_TRY_ASSIGN(dx, allocate(DType::F32, *xShape));
  const float *grad = static_cast<const float *>(dyd.rawData());
  const float *w = static_cast<const float *>(wd.rawData());
  float *image = static_cast<float *>(dx.rawData());
  bool identity = g.w.isIdentity();
  PIPEC_TRY_ASSIGN(chunks, columnChunks(g, [&](size_t bytes) { return scratch(bytes); }));
  float *columns = chunks.columns();
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunks.chunk) {
    int64_t count = std::min(chunks.chunk, g.batch - n0);
    float *target = image + n0 * g.channels * inSize;
    int64_t targetN = g.channels * inSize, targetG = g.gc() * inSize;
    if (!identity)
      target = columns, targetN = g.group * rows * cols, targetG = rows * cols;
    // columns_(n, g) = W_g^T [rows, gm] x dY_(n, g) [gm, cols].
    if (Error err = gemmGrid(true, false, rows, cols, g.gm(), w, rows, 0, g.gm() * rows,
                             grad + n0 * g.maps * cols, cols, g.maps * cols, g.gm() * cols, 0.0f,
                             target, cols, targetN, targetG, count, g.group))
      return err;
    if (!identity) {
      k::Im2colParams p;
      p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
      PIPEC_CUDA_TRY(launchCol2im(p, columns, image + n0 * g.channels * inSize, stream));
    }
  }
  return Outputs{dx};
}

Result CudaBackend::convGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1);
  auto wShape = n.attrInts("shape");
  if (!isFloat(dy) || !isFloat(x) || !wShape || n.numOutputs() != 1)
    return std::nullopt;
  auto geometry = convGeometry(n, x->shape(), *wShape, dy->shape());
  if (!geometry)
    return std::nullopt;
  const ConvGeometry &g = *geometry;
  int64_t rows = g.rows(), cols = g.cols(), inSize = g.w.inSize(), gm = g.gm();
  // One GEMM per group sums a chunk's images: K = count * cols.
  int64_t chunk = std::min(convChunk(g.group * rows * cols, g.batch), INT_MAX / cols);
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(dw, allocate(DType::F32, *wShape));
  PIPEC_TRY_ASSIGN(columnBlock,
                   scratch(static_cast<size_t>(chunk * g.group * rows * cols) * sizeof(float)));
  PIPEC_TRY_ASSIGN(gradBlock, scratch(static_cast<size_t>(chunk * g.maps * cols) * sizeof(float)));
  const float *grad = static_cast<const float *>(dyd.rawData());
  const float *image = static_cast<const float *>(xd.rawData());
  float *columns = static_cast<float *>(columnBlock.get());
  float *gradT = static_cast<float *>(gradBlock.get());
  for (int64_t n0 = 0; n0 < g.batch; n0 += chunk) {
    int64_t count = std::min(chunk, g.batch - n0);
    // dY of the chunk as [group, gm, count, cols].
    k::IndexMap map;
    if (!k::makeIndexMap({g.group, gm, count, cols}, {{gm * cols, cols, g.maps * cols, 1}}, map,
                         {n0 * g.maps * cols}))
      return std::nullopt;
    PIPEC_CUDA_TRY(launchCopy(4, map, grad, gradT, count * g.maps * cols, stream));
    k::Im2colParams p;
    p.w = g.w, p.images = count * g.group, p.channels = g.gc(), p.group = g.group;
    p.batchInner = true;
    PIPEC_CUDA_TRY(launchIm2col(p, image + n0 * g.channels * inSize, columns, stream));
    // dW_g += dY_g [gm, count * cols] x columns_g^T [count * cols, rows].
    int64_t depth = count * cols;
    if (Error err = gemm(false, true, gm, rows, depth, 1.0f, gradT, depth, gm * depth, columns,
                         depth, rows * depth, n0 == 0 ? 0.0f : 1.0f,
                         static_cast<float *>(dw.rawData()), rows, gm * rows, g.group))
      return err;
  }
  return Outputs{dw};
}

Result CudaBackend::windowPool(const NodeView &n) {
  const Tensor *x = n.in(0);
  auto kernel = n.attrInts("kernel_shape");
  if (!isFloat(x) || !kernel || x->rank() < 3 || x->rank() > 5 || n.wantsOutput(1) ||
      x->numElements() == 0)
    return std::nullopt;
  auto attrs = windowAttrs(n, kernel->size());
  k::PoolParams p;
  if (!attrs || !k::makeConvWindow(spatialOf(x->shape()), *kernel, attrs->strides, attrs->dilations,
                                   attrs->pads, n.attrInt("ceil_mode", 0), p.w))
    return std::nullopt;
  p.isMax = n.is(OpId::MaxPool);
  p.includePad = n.attrInt("count_include_pad", 0);
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(y,
                   allocate(DType::F32, windowOutShape(x->dim(0), x->dim(1), p.w, x->rank() - 2)));
  PIPEC_CUDA_TRY(launchPool(p, x->dim(0) * x->dim(1), static_cast<const float *>(xd.rawData()),
                            static_cast<float *>(y.rawData()), stream));
  return Outputs{y};
}

/// MaxPoolGrad (dY, X) and AveragePoolGrad (dY; X's shape as attribute).
Result CudaBackend::poolGrad(const NodeView &n) {
  bool isMax = n.is(OpId::MaxPoolGrad);
  const Tensor *dy = n.in(0), *x = isMax ? n.in(1) : nullptr;
  auto kernel = n.attrInts("kernel_shape");
  std::optional<Shape> xShape = isMax && isFloat(x) ? Shape(x->shape()) : n.attrInts("shape");
  if (!isFloat(dy) || (isMax && !isFloat(x)) || !kernel || !xShape || n.numOutputs() != 1 ||
      dy->rank() < 3 || dy->rank() > 5 || xShape->size() != size_t(dy->rank()) ||
      (*xShape)[0] != dy->dim(0) || (*xShape)[1] != dy->dim(1) || product(*xShape) == 0 ||
      dy->numElements() == 0)
    return std::nullopt;
  auto attrs = windowAttrs(n, kernel->size());
  k::PoolParams p;
  if (!attrs || !k::makeGradWindow(spatialOf(*xShape), *kernel, attrs->strides, attrs->dilations,
                                   attrs->pads, spatialOf(dy->shape()), p.w))
    return std::nullopt;
  p.isMax = isMax;
  p.includePad = n.attrInt("count_include_pad", 0);
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  Tensor xd;
  if (isMax) {
    PIPEC_TRY_ASSIGN(dev, onDevice(*x));
    xd = dev;
  }
  PIPEC_TRY_ASSIGN(dx, allocate(DType::F32, *xShape));
  PIPEC_CUDA_TRY(launchPoolGrad(p, dy->dim(0) * dy->dim(1),
                                static_cast<const float *>(dyd.rawData()),
                                isMax ? static_cast<const float *>(xd.rawData()) : nullptr,
                                static_cast<float *>(dx.rawData()), stream));
  return Outputs{dx};
}

Result CudaBackend::globalAveragePool(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || x->rank() < 3 || n.numOutputs() != 1)
    return std::nullopt;
  int64_t size = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  if (size == 0)
    return std::nullopt;
  Shape outShape = x->shape();
  std::fill(outShape.begin() + 2, outShape.end(), 1);
  std::vector<bool> reduced(x->rank(), true);
  reduced[0] = reduced[1] = false;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, outShape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, static_cast<double>(size), out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// BatchNormalization in inference mode.
Result CudaBackend::batchNorm(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || x->rank() < 2 || n.numOutputs() < 1)
    return std::nullopt;
  if ((n.opset < 9 && n.attrInt("spatial", 1) == 0) ||
      (n.opset >= 14 && n.attrInt("training_mode", 0)))
    return std::nullopt;
  for (size_t i = 1; i <= 4; ++i)
    if (n.wantsOutput(i))
      return std::nullopt;
  int64_t channels = x->dim(1);
  std::vector<Tensor> params;
  for (size_t i = 1; i <= 4; ++i) {
    const Tensor *t = n.in(i);
    if (!isFloat(t) || t->rank() != 1 || t->dim(0) != channels)
      return std::nullopt;
    PIPEC_TRY_ASSIGN(dev, onDevice(*t));
    params.push_back(dev);
  }
  int64_t spatial = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  double epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(y, allocate(DType::F32, x->shape()));
  auto param = [&](size_t i) { return static_cast<const float *>(params[i].rawData()); };
  PIPEC_CUDA_TRY(launchBatchNorm(x->dim(0), channels, spatial, epsilon,
                                 static_cast<const float *>(xd.rawData()), param(0), param(1),
                                 param(2), param(3), static_cast<float *>(y.rawData()), stream));
  return Outputs{y};
}

Result CudaBackend::batchNormGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1), *mean = n.in(2), *var = n.in(3);
  if (!isFloat(dy) || !isFloat(x) || !isFloat(mean) || !isFloat(var) || dy->shape() != x->shape() ||
      x->rank() < 2 || n.numOutputs() != 1)
    return std::nullopt;
  int64_t channels = x->dim(1);
  for (const Tensor *t : {mean, var})
    if (t->rank() != 1 || t->dim(0) != channels)
      return std::nullopt;
  double epsilon = n.attr("epsilon") ? n.attr("epsilon")->f() : 1e-5;
  int64_t batch = x->dim(0), spatial = product(ArrayRef<int64_t>(x->shape()).drop_front(2));
  PIPEC_TRY_ASSIGN(dyd, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xd, onDevice(*x));
  PIPEC_TRY_ASSIGN(md, onDevice(*mean));
  PIPEC_TRY_ASSIGN(vd, onDevice(*var));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, {channels}));
  if (channels == 0)
    return Outputs{out};
  int64_t chunks = batchNormGradWeightChunks(channels, batch * spatial);
  PIPEC_TRY_ASSIGN(partial, scratch(static_cast<size_t>(channels * chunks) * sizeof(double)));
  PIPEC_CUDA_TRY(launchBatchNormGradWeight(
      batch, channels, spatial, epsilon, static_cast<const float *>(dyd.rawData()),
      static_cast<const float *>(xd.rawData()), static_cast<const float *>(md.rawData()),
      static_cast<const float *>(vd.rawData()), static_cast<double *>(partial.get()), chunks,
      static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// The executor's own operations
//===----------------------------------------------------------------------===//

Expected<Tensor> CudaBackend::sum(ArrayRef<const Tensor *> terms) {
  if (Error err = enter())
    return err;
  ++counted.launches;
  if (terms.empty())
    return createStringError(inconvertibleErrorCode(), "cuda:%d: a sum of no terms", device);
  const Tensor &first = *terms[0];
  if (first.elemType() == DType::F16 || first.elemType() == DType::BF16) {
    // Half gradient terms (rare: half activations with several consumers)
    // are added on the host, where the sum rounds to the half type as the
    // CPU backend's does.
    PIPEC_TRY_ASSIGN(total, download(first));
    total = total.clone();
    for (const Tensor *t : terms.drop_front()) {
      if (t->elemType() != first.elemType() || t->numElements() != first.numElements())
        return createStringError(inconvertibleErrorCode(), "cuda:%d: adding %s to %s", device,
                                 t->describe().c_str(), first.describe().c_str());
      PIPEC_TRY_ASSIGN(term, download(*t));
      float *acc = static_cast<float *>(total.rawData());
      const float *add = static_cast<const float *>(term.rawData());
      for (int64_t i = 0; i < total.numElements(); ++i)
        acc[i] += add[i];
      total.roundToElemType();
    }
    return onDevice(total);
  }
  auto type = scalarOf(first.elemType());
  if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64))
    return createStringError(inconvertibleErrorCode(), "cuda:%d: summing %s: float or double only",
                             device, first.describe().c_str());
  for (const Tensor *t : terms)
    if (t->elemType() != first.elemType() || t->numElements() != first.numElements())
      return createStringError(inconvertibleErrorCode(), "cuda:%d: adding %s to %s", device,
                               t->describe().c_str(), first.describe().c_str());
  PIPEC_TRY_ASSIGN(out, allocate(first.elemType(), first.shape()));
  PIPEC_TRY_ASSIGN(a, onDevice(first));
  if (terms.size() == 1) {
    if (out.byteSize() > 0)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(out.rawData(), a.rawData(), out.byteSize(),
                                     cudaMemcpyDeviceToDevice, stream));
  }
  for (size_t i = 1; i < terms.size(); ++i) {
    PIPEC_TRY_ASSIGN(b, onDevice(*terms[i]));
    PIPEC_CUDA_TRY(launchAdd(*type, i == 1 ? a.rawData() : out.rawData(), b.rawData(),
                             out.rawData(), out.numElements(), stream));
  }
  if (Error err = commitHolds())
    return err;
  return out;
}

Error CudaBackend::addInto(Tensor &accumulator, const Tensor &term) {
  if (Error err = enter())
    return err;
  ++counted.launches;
  if (accumulator.device() != device)
    return createStringError(inconvertibleErrorCode(),
                             "cuda:%d: the accumulator %s is not this device's", device,
                             accumulator.describe().c_str());
  auto type = scalarOf(accumulator.elemType());
  // A float32 accumulator takes float16 / bfloat16 terms: they are stored
  // as float (the CPU backend's rule).
  bool sameStorage =
      term.elemType() == accumulator.elemType() ||
      (accumulator.elemType() == DType::F32 && cpu::storedAs<float>(term.elemType()));
  if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64) || !sameStorage ||
      term.numElements() != accumulator.numElements())
    return createStringError(inconvertibleErrorCode(),
                             "cuda:%d: adding %s into %s (float or double of one size only)",
                             device, term.describe().c_str(), accumulator.describe().c_str());
  PIPEC_TRY_ASSIGN(t, onDevice(term));
  PIPEC_CUDA_TRY(launchAdd(*type, accumulator.rawData(), t.rawData(), accumulator.rawData(),
                           accumulator.numElements(), stream));
  return commitHolds();
}

Expected<double> CudaBackend::sumOfSquares(ArrayRef<const Tensor *> tensors, double scale) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(block, pool->allocate(sizeof(double)));
  double *total = static_cast<double *>(block.get());
  PIPEC_CUDA_TRY(cudaMemsetAsync(total, 0, sizeof(double), stream));
  for (const Tensor *t : tensors) {
    auto type = scalarOf(t->elemType());
    if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64))
      return createStringError(inconvertibleErrorCode(),
                               "cuda:%d: the norm of %s: float or double only", device,
                               t->describe().c_str());
    PIPEC_TRY_ASSIGN(d, onDevice(*t));
    PIPEC_CUDA_TRY(launchSumSquares(*type, d.rawData(), d.numElements(), scale, total, stream));
  }
  double result = 0;
  PIPEC_CUDA_TRY(cudaMemcpyAsync(&result, total, sizeof(double), cudaMemcpyDeviceToHost, stream));
  counted.launches += static_cast<int64_t>(tensors.size());
  ++counted.hostSyncs;
  counted.deviceToHostBytes += sizeof(double);
  PIPEC_CUDA_TRY(cudaStreamSynchronize(stream));
  if (Error err = commitHolds())
    return err;
  return result;
}

Expected<Tensor> CudaBackend::optimize(const rt::OptimizerUpdate &u,
                                       ArrayRef<rt::OptimizerSlot> slots) {
  if (Error err = enter())
    return err;
  PIPEC_TRY_ASSIGN(squares, zeros(DType::F64, {1}));
  k::OptimizerParams p = rt::optimizerParams(u);
  // Written in place when this pool's buffer has no other handle; else a
  // new tensor (what the update reads stays as it was).
  auto inPlace = [&](const Tensor &t) {
    return t.device() == device && t.ownsBuffer() && pool->owns(t.rawData());
  };
  auto writable = [&](const Tensor &t) -> Expected<Tensor> {
    if (inPlace(t))
      return t;
    return allocate(t.elemType(), t.shape());
  };
  OptimizerTable table;
  std::optional<k::Scalar> tableType;
  // What the table's pointers read until its launch is queued: an upload,
  // the weight a new tensor replaces. Dropped earlier, the pool would hand
  // their blocks to the next slot's tensors before the kernel read them.
  std::vector<Tensor> reads;
  auto flush = [&]() -> Error {
    if (table.count > 0) {
      ++counted.launches;
      PIPEC_CUDA_TRY(
          launchOptimizer(*tableType, p, table, static_cast<double *>(squares.rawData()), stream));
    }
    table.count = 0;
    reads.clear();
    return Error::success();
  };
  for (const rt::OptimizerSlot &slot : slots) {
    Tensor &w = *slot.w;
    const Tensor &g = *slot.g;
    auto type = scalarOf(w.elemType());
    if (!type || (*type != k::Scalar::F32 && *type != k::Scalar::F64) ||
        g.elemType() != w.elemType() || g.numElements() != w.numElements())
      return createStringError(inconvertibleErrorCode(),
                               "cuda:%d: training '%s': weight %s, gradient %s (float or double, "
                               "of one type and size)",
                               device, slot.name.str().c_str(), w.describe().c_str(),
                               g.describe().c_str());
    if (table.count == OptimizerTable::Slots || (tableType && *tableType != *type))
      if (Error err = flush())
        return err;
    tableType = type;
    // The moments start at zero, and are the backend's own after that.
    auto moment = [&](Tensor &t, bool needed) -> Error {
      if (!needed)
        return Error::success();
      if (t.isNull()) {
        PIPEC_TRY_ASSIGN(fresh, zeros(w.elemType(), w.shape()));
        t = fresh;
      } else if (!inPlace(t)) {
        PIPEC_TRY_ASSIGN(source, onDevice(t));
        PIPEC_TRY_ASSIGN(copy, allocate(w.elemType(), w.shape()));
        PIPEC_CUDA_TRY(cudaMemcpyAsync(copy.rawData(), source.rawData(), source.byteSize(),
                                       cudaMemcpyDeviceToDevice, stream));
        t = copy;
      }
      return Error::success();
    };
    if (Error err = moment(*slot.m, p.kind >= 1))
      return err;
    if (Error err = moment(*slot.v, p.kind == 2))
      return err;
    PIPEC_TRY_ASSIGN(out, writable(w));
    PIPEC_TRY_ASSIGN(dw, onDevice(w));
    PIPEC_TRY_ASSIGN(dg, onDevice(g));
    int s = table.count++;
    table.w[s] = dw.rawData();
    table.g[s] = dg.rawData();
    table.wOut[s] = out.rawData();
    table.m[s] = table.mOut[s] = p.kind >= 1 ? slot.m->rawData() : nullptr;
    table.v[s] = table.vOut[s] = p.kind == 2 ? slot.v->rawData() : nullptr;
    table.n[s] = w.numElements();
    table.decayCenter[s] = slot.decayCenter;
    reads.push_back(dw);
    reads.push_back(dg);
    w = out;
  }
  if (Error err = flush())
    return err;
  if (Error err = commitHolds())
    return err;
  return squares;
}

} // namespace pipec::cuda
