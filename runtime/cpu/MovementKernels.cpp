//===- MovementKernels.cpp - CPU kernels that move data ---------------------===//
//
// Reshape and its relatives (views of the input), Transpose, Concat, Split,
// Slice, Gather, Expand, Tile, the shape queries and constants. Most copy
// whole rows with memcpy; strided ones walk forEachStrided.
//
//===----------------------------------------------------------------------===//
#include "ops/Reshape.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/kernels/IndexMap.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

using namespace llvm;

namespace pipec::cpu {

Expected<Outputs> reshape(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> requested = ctx.intsFromInputOrAttr(1, "shape");
  if (!requested)
    return ctx.fail("missing the target shape");
  Expected<Shape> shape =
      reshapeTarget(x.shape(), *requested, ctx.attrInt("allowzero", 0) != 0, x.describe());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return Outputs{x.reshaped(*shape)};
}

Expected<Outputs> flatten(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  int64_t axis = ctx.attrInt("axis", 1);
  if (axis < 0)
    axis += x.rank();
  if (axis < 0 || axis > x.rank())
    return ctx.fail(
        formatv("axis {0} is out of range for rank {1}", ctx.attrInt("axis", 1), x.rank()));
  ArrayRef<int64_t> shape = x.shape();
  return Outputs{x.reshaped({product(shape.take_front(axis)), product(shape.drop_front(axis))})};
}

Expected<Outputs> squeeze(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  std::vector<bool> drop(x.rank(), false);
  if (!axes) {
    for (int64_t i = 0; i < x.rank(); ++i)
      drop[i] = x.dim(i) == 1;
  } else {
    for (int64_t a : *axes) {
      Expected<int64_t> axis = ctx.normalizeAxis(a, x.rank());
      if (!axis)
        return axis.takeError();
      if (x.dim(*axis) != 1)
        return ctx.fail(formatv("cannot squeeze dimension {0} of {1}", a, x.describe()));
      drop[*axis] = true;
    }
  }
  Shape shape;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (!drop[i])
      shape.push_back(x.dim(i));
  return Outputs{x.reshaped(shape)};
}

Expected<Outputs> unsqueeze(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  if (!axes)
    return ctx.fail("missing axes");
  int64_t rank = x.rank() + static_cast<int64_t>(axes->size());
  std::vector<bool> inserted(rank, false);
  for (int64_t a : *axes) {
    Expected<int64_t> axis = ctx.normalizeAxis(a, rank);
    if (!axis)
      return axis.takeError();
    if (inserted[*axis])
      return ctx.fail(formatv("axis {0} appears twice", a));
    inserted[*axis] = true;
  }
  Shape shape;
  int64_t next = 0;
  for (int64_t i = 0; i < rank; ++i)
    shape.push_back(inserted[i] ? 1 : x.dim(next++));
  return Outputs{x.reshaped(shape)};
}

Expected<Outputs> transposeOp(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape perm(x.rank());
  if (std::optional<Shape> given = ctx.attrInts("perm")) {
    perm = *given;
    Shape sorted = perm;
    llvm::sort(sorted);
    bool valid = static_cast<int64_t>(sorted.size()) == x.rank();
    for (int64_t i = 0; valid && i < x.rank(); ++i)
      valid = sorted[i] == i;
    if (!valid)
      return ctx.fail("perm " + shapeString(perm) + " is not a permutation of rank " +
                      Twine(x.rank()));
  } else {
    for (int64_t i = 0; i < x.rank(); ++i)
      perm[i] = x.rank() - 1 - i;
  }
  return Outputs{transpose(x, perm)};
}

Expected<Outputs> concat(const OpContext &ctx) {
  const Tensor &first = ctx.input(0);
  const auto *axisAttr = ctx.attr("axis");
  if (!axisAttr && ctx.opset >= 4)
    return ctx.fail("missing attribute 'axis'");
  // Concat-1 defaulted to axis 1.
  Expected<int64_t> axis = ctx.normalizeAxis(axisAttr ? axisAttr->i() : 1, first.rank());
  if (!axis)
    return axis.takeError();
  Shape shape = first.shape();
  shape[*axis] = 0;
  for (size_t i = 0; i < ctx.numInputs(); ++i) {
    const Tensor &t = ctx.input(i);
    if (Error e = ctx.sameType(0, i))
      return e;
    bool compatible = t.rank() == first.rank();
    for (int64_t d = 0; compatible && d < t.rank(); ++d)
      compatible = d == *axis || t.dim(d) == first.dim(d);
    if (!compatible)
      return ctx.fail("input " + Twine(i) + " " + t.describe() + " does not match input 0 " +
                      first.describe() + " outside axis " + Twine(*axis));
    shape[*axis] += t.dim(*axis);
  }
  Tensor out = Tensor::uninitialized(first.elemType(), shape); // every element is written
  size_t elemSize = storageSize(first.elemType());
  AxisSplit split = splitAt(shape, *axis);
  // Each outer index's row of the output: the inputs' blocks in turn. A
  // decode step's KV cache is copied here whole, so the rows are split over
  // the rank's threads.
  size_t rowBytes = static_cast<size_t>(shape[*axis] * split.inner) * elemSize;
  int64_t grain = std::max<int64_t>(1, parallelElements * 4 / std::max<size_t>(rowBytes, 1));
  parallelFor(split.outer, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      char *dst = static_cast<char *>(out.rawData()) + o * rowBytes;
      for (size_t i = 0; i < ctx.numInputs(); ++i) {
        const Tensor &t = ctx.input(i);
        size_t block = t.dim(*axis) * split.inner * elemSize;
        std::memcpy(dst, static_cast<const char *>(t.rawData()) + o * block, block);
        dst += block;
      }
    }
  });
  return Outputs{out};
}

Expected<Outputs> split(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), x.rank());
  if (!axis)
    return axis.takeError();
  int64_t dim = x.dim(*axis);
  int64_t parts = static_cast<int64_t>(ctx.numOutputs());
  std::optional<Shape> sizes = ctx.intsFromInputOrAttr(1, "split");
  if (!sizes) {
    if (const auto *numOutputs = ctx.attr("num_outputs"))
      parts = numOutputs->i();
    if (parts <= 0)
      return ctx.fail("no outputs to split into");
    // Equal parts; opset 18's num_outputs lets the last one be smaller.
    if (!ctx.attr("num_outputs") && dim % parts != 0)
      return ctx.fail(formatv("dimension {0} of size {1} does not split into {2} equal parts",
                              *axis, dim, parts));
    sizes = kernels::equalSplit(dim, parts);
  }
  if (!kernels::splitCovers(*sizes, parts, dim))
    return ctx.fail(formatv("split sizes {0} do not cover dimension {1} of size {2} in {3} parts",
                            shapeString(*sizes), *axis, dim, parts));
  AxisSplit layout = splitAt(x.shape(), *axis);
  size_t elemSize = storageSize(x.elemType());
  Outputs outputs;
  int64_t begin = 0;
  for (int64_t size : *sizes) {
    Shape shape = x.shape();
    shape[*axis] = size;
    Tensor part = Tensor::uninitialized(x.elemType(), shape); // every block is copied
    size_t block = size * layout.inner * elemSize;
    int64_t grain = std::max<int64_t>(1, parallelElements * 4 / std::max<size_t>(block, 1));
    parallelFor(layout.outer, grain, [&](int64_t first, int64_t last) {
      for (int64_t o = first; o < last; ++o)
        std::memcpy(static_cast<char *>(part.rawData()) + o * block,
                    static_cast<const char *>(x.rawData()) +
                        (o * dim + begin) * layout.inner * elemSize,
                    block);
    });
    begin += size;
    outputs.push_back(part);
  }
  return outputs;
}

namespace {

/// Copies the strided view (shape, strides, start offset) of \p x.
Tensor gatherStrided(const Tensor &x, ArrayRef<int64_t> shape, const Shape &strides,
                     int64_t start) {
  Tensor out = Tensor::uninitialized(x.elemType(), shape); // every element is written
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>() + start;
    T *dst = out.data<T>();
    forEachStrided<1>(shape, {strides},
                      [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  });
  return out;
}

} // namespace

/// Slice: starts, ends, axes and steps are inputs from opset 10, attributes
/// before. Negative steps walk backwards.
Expected<Outputs> slice(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> starts = ctx.intsFromInputOrAttr(1, "starts");
  std::optional<Shape> ends = ctx.intsFromInputOrAttr(2, "ends");
  if (!starts || !ends)
    return ctx.fail("missing starts or ends");
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(3, "axes");
  std::optional<Shape> steps = ctx.intsFromInputOrAttr(4, "steps");
  size_t count = starts->size();
  if (!kernels::fillSliceDefaults(count, ends->size(), axes, steps))
    return ctx.fail("starts, ends, axes and steps differ in length");
  Shape shape = x.shape(), inStrides = stridesOf(x.shape()), readStrides = inStrides;
  int64_t start = 0;
  std::vector<bool> seen(x.rank(), false);
  for (size_t i = 0; i < count; ++i) {
    Expected<int64_t> axis = ctx.normalizeAxis((*axes)[i], x.rank());
    if (!axis)
      return axis.takeError();
    if (seen[*axis])
      return ctx.fail(formatv("axis {0} appears twice", (*axes)[i]));
    seen[*axis] = true;
    int64_t dim = x.dim(*axis);
    // Keep -step representable; no dimension is that long anyway.
    int64_t step = std::max((*steps)[i], -std::numeric_limits<int64_t>::max());
    if (step == 0)
      return ctx.fail("step 0 on axis " + Twine((*axes)[i]));
    kernels::SliceAxis read = kernels::sliceAxis(dim, (*starts)[i], (*ends)[i], step);
    shape[*axis] = read.length;
    // An axis read once (or not at all) never steps: a huge step there
    // would overflow the walk's offsets, which add it after the last read.
    readStrides[*axis] = read.length > 1 ? inStrides[*axis] * step : 0;
    if (read.length > 0)
      start += read.begin * inStrides[*axis];
  }
  return Outputs{gatherStrided(x, shape, readStrides, start)};
}

Expected<Outputs> gather(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1);
  if (indices.elemType() != DType::I64 && indices.elemType() != DType::I32)
    return ctx.fail("indices must be int32 or int64, not " + elemTypeName(indices.elemType()));
  if (data.rank() == 0)
    return ctx.fail("data must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), data.rank());
  if (!axis)
    return axis.takeError();
  AxisSplit layout = splitAt(data.shape(), *axis);
  Shape shape(data.shape().begin(), data.shape().begin() + *axis);
  shape.insert(shape.end(), indices.shape().begin(), indices.shape().end());
  shape.insert(shape.end(), data.shape().begin() + *axis + 1, data.shape().end());
  std::vector<int64_t> index = indices.toInt64Vector();
  for (int64_t i : index)
    if (i < -layout.size || i >= layout.size)
      return ctx.fail(formatv("index {0} is out of range for dimension {1} of size {2}", i, *axis,
                              layout.size));
  Tensor out = Tensor::uninitialized(data.elemType(), shape); // every block is written
  // kernels::gatherSource over blocks of the inner elements, each copied
  // whole.
  int64_t count = static_cast<int64_t>(index.size());
  kernels::GatherParams p{layout.outer, layout.size, count, 1};
  size_t block = layout.inner * storageSize(data.elemType());
  const char *src = static_cast<const char *>(data.rawData());
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t b = 0; b < layout.outer * count; ++b, dst += block)
    std::memcpy(dst, src + kernels::gatherSource(b, p, index.data()) * block, block);
  return Outputs{out};
}

Expected<Outputs> expand(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape requested = ctx.input(1).toInt64Vector();
  if (llvm::any_of(requested, [](int64_t d) { return d < 0; }))
    return ctx.fail("negative dimension in shape " + shapeString(requested));
  Expected<Shape> shape = broadcastShapes(x.shape(), requested);
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return Outputs{expandAny(x, *shape)};
}

Expected<Outputs> tile(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape repeats = ctx.input(1).toInt64Vector();
  if (static_cast<int64_t>(repeats.size()) != x.rank() ||
      llvm::any_of(repeats, [](int64_t r) { return r < 0; }))
    return ctx.fail("repeats " + shapeString(repeats) + " do not fit " + x.describe());
  // View the output as [r0, d0, r1, d1, ...]: the repeat dimensions read
  // with stride 0.
  Shape viewShape, viewStrides, outShape;
  Shape inStrides = stridesOf(x.shape());
  for (int64_t i = 0; i < x.rank(); ++i) {
    viewShape.push_back(repeats[i]);
    viewShape.push_back(x.dim(i));
    viewStrides.push_back(0);
    viewStrides.push_back(inStrides[i]);
    outShape.push_back(repeats[i] * x.dim(i));
  }
  return Outputs{gatherStrided(x, viewShape, viewStrides, 0).reshaped(outShape)};
}

Expected<Outputs> shapeOp(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  return Outputs{shapeTensor(x.shape(), ctx.attrInt("start", 0), ctx.attrInt("end", x.rank()))};
}

Expected<Outputs> size(const OpContext &ctx) {
  return Outputs{Tensor::scalar<int64_t>(ctx.input(0).numElements())};
}

Expected<Outputs> constantOfShape(const OpContext &ctx) {
  Shape shape = ctx.input(0).toInt64Vector();
  if (llvm::any_of(shape, [](int64_t d) { return d < 0; }))
    return ctx.fail("negative dimension in " + shapeString(shape));
  Tensor value = Tensor::scalar(0.0f);
  if (const auto *attr = ctx.attr("value")) {
    Expected<Tensor> given = fromTensorProto(attr->t());
    if (!given)
      return ctx.unsupported(toString(given.takeError()));
    if (given->numElements() != 1)
      return ctx.fail("value must have one element, not " + given->describe());
    value = *given;
  }
  return Outputs{expandAny(value.reshaped({}), shape)};
}

Expected<Outputs> range(const OpContext &ctx) {
  const Tensor &start = ctx.input(0), &limit = ctx.input(1), &delta = ctx.input(2);
  for (size_t i = 0; i < 3; ++i)
    if (ctx.input(i).numElements() != 1)
      return ctx.fail("start, limit and delta must be scalars");
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (Error e = ctx.sameType(0, 2))
    return e;
  return visitStorage(start.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(start, 0);
    } else {
      T first = start.data<T>()[0], step = delta.data<T>()[0], last = limit.data<T>()[0];
      if (step == T(0))
        return ctx.fail("delta is 0");
      double steps = std::ceil((double(last) - double(first)) / double(step));
      if (!std::isfinite(steps))
        return ctx.fail("start, limit and delta give no finite element count");
      int64_t count = std::max<int64_t>(0, static_cast<int64_t>(steps));
      Tensor out(start.elemType(), {count});
      for (int64_t i = 0; i < count; ++i)
        out.data<T>()[i] = static_cast<T>(first + static_cast<T>(i) * step);
      return Outputs{out};
    }
  });
}

Expected<Outputs> constant(const OpContext &ctx) {
  if (const auto *value = ctx.attr("value")) {
    Expected<Tensor> t = fromTensorProto(value->t());
    if (!t)
      return ctx.unsupported(toString(t.takeError()));
    return Outputs{*t};
  }
  if (const auto *value = ctx.attr("value_float"))
    return Outputs{Tensor::scalar(value->f())};
  if (const auto *value = ctx.attr("value_int"))
    return Outputs{Tensor::scalar<int64_t>(value->i())};
  if (const auto *value = ctx.attr("value_floats")) {
    std::vector<float> v(value->floats().begin(), value->floats().end());
    return Outputs{Tensor::fromValues<float>({static_cast<int64_t>(v.size())}, v)};
  }
  if (const auto *value = ctx.attr("value_ints")) {
    Shape v(value->ints().begin(), value->ints().end());
    return Outputs{Tensor::fromValues<int64_t>({static_cast<int64_t>(v.size())}, v)};
  }
  return ctx.unsupported("a Constant without value, value_float(s) or value_int(s)");
}

Expected<Outputs> identity(const OpContext &ctx) { return Outputs{ctx.input(0)}; }

/// Dropout outside training is the identity with an all-true mask. Training
/// with a positive ratio draws random numbers, which these kernels do not.
Expected<Outputs> dropout(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  bool training = false;
  double ratio = ctx.attrFloat("ratio", 0.5f);
  if (ctx.opset >= 12) {
    const Tensor *r = ctx.optInput(1), *t = ctx.optInput(2);
    if ((r && r->numElements() != 1) || (t && t->numElements() != 1))
      return ctx.fail("ratio and training_mode must be scalars");
    if (r)
      ratio = r->getDouble(0);
    training = t && t->getDouble(0) != 0;
  }
  if (training && ratio != 0)
    return ctx.unsupported("training-mode Dropout with ratio > 0 (random masks)");
  Outputs outputs{x};
  if (ctx.wantsOutput(1)) {
    // Opsets 7 to 9 type the mask like the input.
    Tensor mask(ctx.opset >= 10 ? DType::Bool : x.elemType(), x.shape());
    for (int64_t i = 0; i < mask.numElements(); ++i)
      mask.setDouble(i, 1);
    outputs.push_back(mask);
  }
  return outputs;
}

} // namespace pipec::cpu
