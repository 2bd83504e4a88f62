//===- SpatialKernels.cpp - ConvTranspose, Col2Im, DeformConv, MaxUnpool ----===//
//
// The convolution-shaped ops besides Conv, in any number of spatial
// dimensions. ConvTranspose is Conv's input gradient: per image and group a
// GEMM, W_g^T X_g, gives the columns and col2im scatters them into the
// output. Col2Im is that scatter alone. DeformConv gathers its columns at
// the offset (and masked) positions, sampled N-linearly with zeros outside,
// then multiplies by W like Conv. MaxUnpool scatters values to the indices
// MaxPool gave.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Window.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>

using namespace llvm;

namespace pipec::cpu {
namespace {

/// The sliding-window geometry of a convolution in any number of spatial
/// dimensions: an image of `image` positions, a kernel of `kernel` taps and
/// `cols` window positions, with begin pads that may be negative (an
/// output_shape larger than ConvTranspose's full output).
struct Geometry {
  Shape image, kernel, stride, dilation, padBegin, padEnd, cols;
  int64_t rank() const { return static_cast<int64_t>(image.size()); }
  int64_t kernelSize() const { return product(kernel); }
  int64_t colSize() const { return product(cols); }
  int64_t imageSize() const { return product(image); }
};

/// Reads the window attributes of rank \p rank (ops/Window.h) into \p g;
/// returns them all.
Expected<WindowAttrs> readWindowAttrs(const OpContext &ctx, int64_t rank, Geometry &g) {
  Expected<WindowAttrs> w = ctx.windowAttrs(rank);
  if (!w)
    return w.takeError();
  g.stride = w->strides;
  g.dilation = w->dilations;
  g.padBegin.assign(w->pads.begin(), w->pads.begin() + rank);
  g.padEnd.assign(w->pads.begin() + rank, w->pads.end());
  return w;
}

/// Number of window positions along axis \p d of an image of \p image.
int64_t windowCount(const Geometry &g, int64_t d, int64_t image) {
  int64_t span = image + g.padBegin[d] + g.padEnd[d] - ((g.kernel[d] - 1) * g.dilation[d] + 1);
  return span < 0 ? 0 : span / g.stride[d] + 1;
}

/// Sums the columns [channels * kernelSize, colSize] into the images
/// [channels, imageSize] (zeroed by the caller): the adjoint of im2col. Up
/// to 3 spatial dimensions go to Window.h's col2im (kernels::col2imAddRun,
/// which zeroes its planes itself); more take the N-D loop here, which adds
/// each element's taps in the same (increasing) order.
template <typename T>
void scatterColumns(const T *columns, int64_t channels, const Geometry &g, T *image) {
  int64_t rank = g.rank(), kernelSize = g.kernelSize(), colSize = g.colSize();
  if (rank <= Window::maxRank) {
    kernels::ConvWindow w;
    for (int64_t i = 0, d = Window::maxRank - rank; i < rank; ++i, ++d) {
      w.in[d] = g.image[i], w.kernel[d] = g.kernel[i], w.stride[d] = g.stride[i];
      w.dilation[d] = g.dilation[i], w.padBegin[d] = g.padBegin[i], w.padEnd[d] = g.padEnd[i];
      w.out[d] = g.cols[i];
    }
    col2im(columns, channels, w, image);
    return;
  }
  Shape imageStrides = stridesOf(g.image);
  Shape tap(rank, 0), at(rank, 0);
  for (int64_t k = 0; k < kernelSize; ++k) {
    // The image offset of window position 0 for this tap, per axis.
    Shape origin(rank);
    for (int64_t d = 0; d < rank; ++d)
      origin[d] = tap[d] * g.dilation[d] - g.padBegin[d];
    std::fill(at.begin(), at.end(), 0);
    for (int64_t p = 0; p < colSize; ++p) {
      int64_t offset = 0;
      bool inside = true;
      for (int64_t d = 0; d < rank && inside; ++d) {
        int64_t i = origin[d] + at[d] * g.stride[d];
        inside = i >= 0 && i < g.image[d];
        offset += i * imageStrides[d];
      }
      if (inside)
        for (int64_t c = 0; c < channels; ++c)
          image[c * g.imageSize() + offset] += columns[(c * kernelSize + k) * colSize + p];
      for (int64_t d = rank - 1; d >= 0 && ++at[d] == g.cols[d]; --d)
        at[d] = 0;
    }
    for (int64_t d = rank - 1; d >= 0 && ++tap[d] == g.kernel[d]; --d)
      tap[d] = 0;
  }
}

/// ConvTranspose's output size and pads: output_shape, then auto_pad, then
/// the explicit pads decide (ONNX's order). A total padding below zero (an
/// output larger than the full one) extends the end.
Error convTransposeGeometry(const OpContext &ctx, ArrayRef<int64_t> in, Geometry &g) {
  int64_t rank = static_cast<int64_t>(in.size());
  Expected<WindowAttrs> attrs = readWindowAttrs(ctx, rank, g);
  if (!attrs)
    return attrs.takeError();
  Shape outputPadding = ctx.attrInts("output_padding").value_or(Shape(rank, 0));
  std::optional<Shape> outputShape = ctx.attrInts("output_shape");
  if (outputShape && static_cast<int64_t>(outputShape->size()) == rank + 2)
    outputShape->erase(outputShape->begin(), outputShape->begin() + 2);
  if (static_cast<int64_t>(outputPadding.size()) != rank ||
      (outputShape && static_cast<int64_t>(outputShape->size()) != rank))
    return ctx.fail("output_padding or output_shape do not match the spatial rank");
  bool same = attrs->same();
  g.image.resize(rank);
  g.cols.assign(in.begin(), in.end());
  for (int64_t d = 0; d < rank; ++d) {
    if (outputPadding[d] < 0)
      return ctx.fail("output_padding must be non-negative");
    int64_t full =
        g.stride[d] * (in[d] - 1) + outputPadding[d] + (g.kernel[d] - 1) * g.dilation[d] + 1;
    if (outputShape || same) {
      int64_t out = outputShape ? (*outputShape)[d] : in[d] * g.stride[d];
      if (out < 0)
        return ctx.fail("negative output_shape " + shapeString(*outputShape));
      int64_t total = full - out;
      // A negative total extends the end (ONNX's output_shape case, as its
      // reference and onnxruntime run it). By a stride or more both refuse
      // it, and under SAME they place the output differently.
      if (total < 0 && (same || -total >= g.stride[d]))
        return ctx.unsupported(formatv("an output length of {0} on axis {1}, more than {2} "
                                       "(the full output) allows",
                                       out, d, full));
      g.padBegin[d] = total < 0 ? 0 : attrs->samePads(total).first;
      g.padEnd[d] = total - g.padBegin[d];
    }
    g.image[d] = full - g.padBegin[d] - g.padEnd[d];
    if (g.image[d] < 0)
      return ctx.fail(formatv("pads leave a negative output length on axis {0}", d));
  }
  return Error::success();
}

} // namespace

/// ConvTranspose (1, 11): X [N, C, in...], W [C, M / group, k...], B [M].
Expected<Outputs> convTranspose(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &w = ctx.input(1);
  const Tensor *bias = ctx.optInput(2);
  if (Error err = ctx.sameType(0, 1))
    return err;
  if (Error err = ctx.sameTypeAsFirst(2))
    return err;
  if (x.rank() < 3 || w.rank() != x.rank())
    return ctx.fail("X and W must have one rank >= 3, got " + x.describe() + " and " +
                    w.describe());
  int64_t group = ctx.attrInt("group", 1), batch = x.dim(0), channels = x.dim(1);
  if (group < 1 || channels % group != 0 || w.dim(0) != channels)
    return ctx.fail(
        formatv("W {0} does not fit X {1} with group {2}", w.describe(), x.describe(), group));
  int64_t groupMaps = w.dim(1), maps = groupMaps * group, groupChannels = channels / group;
  if (bias && (bias->rank() != 1 || bias->dim(0) != maps))
    return ctx.fail("B must have shape [" + Twine(maps) + "], got " + bias->describe());
  Geometry g;
  g.kernel.assign(w.shape().begin() + 2, w.shape().end());
  if (std::optional<Shape> given = ctx.attrInts("kernel_shape"); given && *given != g.kernel)
    return ctx.fail("kernel_shape " + shapeString(*given) + " differs from W " + w.describe());
  if (Error err = convTransposeGeometry(ctx, ArrayRef<int64_t>(x.shape()).drop_front(2), g))
    return err;
  Shape outShape{batch, maps};
  outShape.insert(outShape.end(), g.image.begin(), g.image.end());
  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y(x.elemType(), outShape);
    int64_t rows = groupMaps * g.kernelSize(), cols = g.colSize(), image = g.imageSize();
    std::vector<T> columns(rows * cols);
    for (int64_t n = 0; n < batch; ++n)
      for (int64_t k = 0; k < group; ++k) {
        // columns = W_k^T X_k: [rows, groupChannels] x [groupChannels, cols].
        gemmAny<T>(true, false, rows, cols, groupChannels, T(1),
                   w.data<T>() + k * groupChannels * rows, rows,
                   x.data<T>() + (n * channels + k * groupChannels) * cols, cols, T(0),
                   columns.data(), cols);
        scatterColumns(columns.data(), groupMaps, g,
                       y.data<T>() + (n * maps + k * groupMaps) * image);
      }
    if (bias)
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t m = 0; m < maps; ++m) {
          T *plane = y.data<T>() + (n * maps + m) * image;
          T b = bias->data<T>()[m];
          for (int64_t i = 0; i < image; ++i)
            plane[i] += b;
        }
    return Outputs{y};
  });
}

/// Col2Im (18): input [N, C * prod(block_shape), L] to [N, C, image_shape...].
Expected<Outputs> col2Im(const OpContext &ctx) {
  const Tensor &input = ctx.input(0), &imageShape = ctx.input(1), &blockShape = ctx.input(2);
  if (imageShape.elemType() != DType::I64 || blockShape.elemType() != DType::I64 ||
      imageShape.rank() != 1 || blockShape.rank() != 1 ||
      imageShape.numElements() != blockShape.numElements() || imageShape.numElements() < 1)
    return ctx.fail("image_shape " + imageShape.describe() + " and block_shape " +
                    blockShape.describe() + " must be int64 vectors of one length");
  Geometry g;
  g.image = imageShape.toInt64Vector();
  g.kernel = blockShape.toInt64Vector();
  int64_t rank = g.rank();
  if (Expected<WindowAttrs> attrs = readWindowAttrs(ctx, rank, g); !attrs)
    return attrs.takeError();
  for (int64_t d = 0; d < rank; ++d) {
    if (g.image[d] < 0 || g.kernel[d] < 1)
      return ctx.fail("image_shape must be non-negative and block_shape positive");
    g.cols.push_back(windowCount(g, d, g.image[d]));
  }
  int64_t kernelSize = g.kernelSize();
  if (input.rank() != 3 || input.dim(1) % kernelSize != 0 || input.dim(2) != g.colSize())
    return ctx.fail(formatv("input {0} does not hold {1} blocks of {2} per channel",
                            input.describe(), g.colSize(), kernelSize));
  int64_t batch = input.dim(0), channels = input.dim(1) / kernelSize;
  Shape outShape{batch, channels};
  outShape.insert(outShape.end(), g.image.begin(), g.image.end());
  return visitStorage(input.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(input, 0);
    } else {
      Tensor y(input.elemType(), outShape);
      for (int64_t n = 0; n < batch; ++n)
        scatterColumns(input.data<T>() + n * input.dim(1) * input.dim(2), channels, g,
                       y.data<T>() + n * channels * g.imageSize());
      return Outputs{y};
    }
  });
}

namespace {

/// The value of \p image (of shape g.image) at fractional position \p at,
/// N-linear with zeros outside the image.
template <typename T>
double sampleLinear(const T *image, const Geometry &g, ArrayRef<double> at,
                    ArrayRef<int64_t> strides) {
  int64_t rank = g.rank();
  double sum = 0;
  for (int64_t corner = 0; corner < (int64_t(1) << rank); ++corner) {
    double w = 1;
    int64_t offset = 0;
    for (int64_t d = 0; d < rank; ++d) {
      double low = std::floor(at[d]);
      bool high = (corner >> (rank - 1 - d)) & 1;
      double i = low + (high ? 1 : 0);
      w *= high ? at[d] - low : 1 - (at[d] - low);
      if (i < 0 || i >= double(g.image[d])) {
        w = 0;
        break;
      }
      offset += static_cast<int64_t>(i) * strides[d];
    }
    if (w != 0)
      sum += w * double(image[offset]);
  }
  return sum;
}

/// DeformConv's deformable im2col of image \p n: columns [C * K, outSize].
template <typename T>
void deformColumns(const Tensor &x, const Tensor &offset, const Tensor *mask, int64_t n,
                   int64_t offsetGroups, const Geometry &g, std::vector<T> &columns) {
  int64_t rank = g.rank(), channels = x.dim(1), kernelSize = g.kernelSize();
  int64_t outSize = g.colSize(), imageSize = g.imageSize();
  int64_t groupChannels = channels / offsetGroups;
  Shape strides = stridesOf(g.image), tap(rank, 0), at(rank, 0);
  std::vector<double> position(rank);
  const T *offsets = offset.data<T>() + n * offsetGroups * kernelSize * rank * outSize;
  const T *masks = mask ? mask->data<T>() + n * offsetGroups * kernelSize * outSize : nullptr;
  for (int64_t og = 0; og < offsetGroups; ++og)
    for (int64_t k = 0; k < kernelSize; ++k) {
      std::fill(at.begin(), at.end(), 0);
      for (int64_t p = 0; p < outSize; ++p) {
        bool finite = true;
        for (int64_t d = 0; d < rank; ++d) {
          double delta = double(offsets[((og * kernelSize + k) * rank + d) * outSize + p]);
          position[d] =
              double(at[d] * g.stride[d] - g.padBegin[d] + tap[d] * g.dilation[d]) + delta;
          finite &= std::abs(position[d]) < 1e15;
        }
        double scale = masks ? double(masks[(og * kernelSize + k) * outSize + p]) : 1.0;
        for (int64_t c = og * groupChannels; c < (og + 1) * groupChannels; ++c) {
          const T *image = x.data<T>() + (n * channels + c) * imageSize;
          double v = finite ? sampleLinear(image, g, position, strides) : 0.0;
          columns[(c * kernelSize + k) * outSize + p] = static_cast<T>(v * scale);
        }
        for (int64_t d = rank - 1; d >= 0 && ++at[d] == g.cols[d]; --d)
          at[d] = 0;
      }
      for (int64_t d = rank - 1; d >= 0 && ++tap[d] == g.kernel[d]; --d)
        tap[d] = 0;
    }
}

/// Checks DeformConv's operands and fills its geometry.
Error deformGeometry(const OpContext &ctx, Geometry &g, int64_t &offsetGroups) {
  const Tensor &x = ctx.input(0), &w = ctx.input(1), &offset = ctx.input(2);
  const Tensor *bias = ctx.optInput(3), *mask = ctx.optInput(4);
  for (size_t i = 1; i < 5; ++i)
    if (Error err = ctx.sameTypeAsFirst(i))
      return err;
  if (x.rank() < 3 || w.rank() != x.rank() || offset.rank() != x.rank())
    return ctx.fail("X, W and offset must have one rank >= 3, got " + x.describe() + ", " +
                    w.describe() + " and " + offset.describe());
  int64_t rank = x.rank() - 2, group = ctx.attrInt("group", 1);
  offsetGroups = ctx.attrInt("offset_group", 1);
  int64_t channels = x.dim(1), maps = w.dim(0);
  if (group < 1 || channels % group != 0 || maps % group != 0 || w.dim(1) != channels / group ||
      offsetGroups < 1 || channels % offsetGroups != 0)
    return ctx.fail(formatv("W {0} does not fit X {1} with group {2} and offset_group {3}",
                            w.describe(), x.describe(), group, offsetGroups));
  g.image.assign(x.shape().begin() + 2, x.shape().end());
  g.kernel.assign(w.shape().begin() + 2, w.shape().end());
  if (std::optional<Shape> given = ctx.attrInts("kernel_shape"); given && *given != g.kernel)
    return ctx.fail("kernel_shape " + shapeString(*given) + " differs from W " + w.describe());
  if (Expected<WindowAttrs> attrs = readWindowAttrs(ctx, rank, g); !attrs)
    return attrs.takeError();
  for (int64_t d = 0; d < rank; ++d)
    g.cols.push_back(windowCount(g, d, g.image[d]));
  Shape expect{x.dim(0), offsetGroups * g.kernelSize() * rank};
  expect.insert(expect.end(), g.cols.begin(), g.cols.end());
  if (offset.shape() != expect)
    return ctx.fail("offset " + offset.describe() + " must have shape " + shapeString(expect));
  expect[1] = offsetGroups * g.kernelSize();
  if (mask && mask->shape() != expect)
    return ctx.fail("mask " + mask->describe() + " must have shape " + shapeString(expect));
  if (bias && (bias->rank() != 1 || bias->dim(0) != maps))
    return ctx.fail("B must have shape [" + Twine(maps) + "], got " + bias->describe());
  return Error::success();
}

} // namespace

/// DeformConv (19, 22): Conv over positions moved by offset and weighted
/// by mask.
Expected<Outputs> deformConv(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &w = ctx.input(1), &offset = ctx.input(2);
  const Tensor *bias = ctx.optInput(3), *mask = ctx.optInput(4);
  Geometry g;
  int64_t offsetGroups = 1;
  if (Error err = deformGeometry(ctx, g, offsetGroups))
    return err;
  int64_t batch = x.dim(0), channels = x.dim(1), maps = w.dim(0);
  int64_t group = ctx.attrInt("group", 1), groupChannels = channels / group;
  int64_t groupMaps = maps / group, rows = groupChannels * g.kernelSize(), cols = g.colSize();
  Shape outShape{batch, maps};
  outShape.insert(outShape.end(), g.cols.begin(), g.cols.end());
  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y(x.elemType(), outShape);
    std::vector<T> columns(channels * g.kernelSize() * cols);
    for (int64_t n = 0; n < batch; ++n) {
      deformColumns<T>(x, offset, mask, n, offsetGroups, g, columns);
      for (int64_t k = 0; k < group; ++k) {
        T *out = y.data<T>() + (n * maps + k * groupMaps) * cols;
        gemmAny<T>(false, false, groupMaps, cols, rows, T(1), w.data<T>() + k * groupMaps * rows,
                   rows, columns.data() + k * rows * cols, cols, T(0), out, cols);
        if (bias)
          for (int64_t m = 0; m < groupMaps; ++m)
            for (int64_t p = 0; p < cols; ++p)
              out[m * cols + p] += bias->data<T>()[k * groupMaps + m];
      }
    }
    return Outputs{y};
  });
}

/// MaxUnpool (9, 11): X's values written at the flat positions of indices
/// in a zero tensor of the unpooled shape.
Expected<Outputs> maxUnpool(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &indices = ctx.input(1);
  const Tensor *outputShape = ctx.optInput(2);
  if (x.rank() < 3 || indices.shape() != x.shape() || indices.elemType() != DType::I64)
    return ctx.fail("I " + indices.describe() + " must be int64 of X's shape " + x.describe());
  int64_t rank = x.rank() - 2;
  Geometry g;
  std::optional<Shape> kernel = ctx.attrInts("kernel_shape");
  if (!kernel || static_cast<int64_t>(kernel->size()) != rank)
    return ctx.fail("kernel_shape must give " + Twine(rank) + " spatial sizes");
  g.kernel = *kernel;
  if (Expected<WindowAttrs> attrs = readWindowAttrs(ctx, rank, g); !attrs)
    return attrs.takeError();
  Shape shape{x.dim(0), x.dim(1)};
  for (int64_t d = 0; d < rank; ++d) {
    int64_t size = (x.dim(2 + d) - 1) * g.stride[d] - g.padBegin[d] - g.padEnd[d] + g.kernel[d];
    if (g.kernel[d] < 1 || size < 0)
      return ctx.fail("kernel_shape, strides and pads leave no unpooled shape");
    shape.push_back(size);
  }
  // Indices address the unpooled shape; an output_shape pads it at the end
  // of each axis (ONNX's reference; onnxruntime reads the indices in
  // output_shape instead).
  Shape padded = shape;
  if (outputShape) {
    if (outputShape->elemType() != DType::I64 || outputShape->rank() != 1 ||
        outputShape->numElements() != x.rank())
      return ctx.fail("output_shape " + outputShape->describe() + " must be int64 of " +
                      Twine(x.rank()) + " elements");
    padded = outputShape->toInt64Vector();
    for (int64_t d = 0; d < x.rank(); ++d)
      if (padded[d] < shape[d])
        return ctx.fail("output_shape " + shapeString(padded) + " is smaller than the unpooled " +
                        shapeString(shape));
  }
  int64_t total = product(shape);
  std::vector<int64_t> where = indices.toInt64Vector();
  for (int64_t i : where)
    if (i < 0 || i >= total)
      return ctx.fail(formatv("index {0} out of range [0, {1})", i, total));
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y(x.elemType(), padded);
    const T *in = x.data<T>();
    Shape strides = stridesOf(padded);
    for (size_t i = 0; i < where.size(); ++i) {
      // The position of flat index where[i] of the unpooled shape.
      int64_t rest = where[i], offset = 0;
      for (int64_t d = x.rank() - 1; d >= 0; --d) {
        offset += rest % shape[d] * strides[d];
        rest /= shape[d];
      }
      y.data<T>()[offset] = in[i];
    }
    return Outputs{y};
  });
}

} // namespace pipec::cpu
