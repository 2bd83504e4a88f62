//===- IndexingKernels.cpp - CPU kernels that index and scatter -----------===//
//
// GatherElements and GatherND read elements or slices at computed indices;
// ScatterElements (and the deprecated Scatter), ScatterND and pipec's
// GatherElementsGrad and GatherNDGrad write them, replacing or combining with a reduction;
// TopK selects the largest or smallest elements along an axis, with their indices.
// Index values may be negative (counting from the end); one out of range
// fails the node before anything is written. Where indices repeat, the
// updates apply in row-major order of the indices, as ONNX's reference does.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

using namespace llvm;

namespace pipec::cpu {
namespace {

/// How a scatter combines an update u with the element x it lands on.
enum class Reduction { None, Add, Mul, Max, Min };

/// a + b and a * b that wrap for integers instead of overflowing; or and
/// and for bool, as numpy computes them.
template <typename T> T addWrapping(T a, T b) {
  if constexpr (isBool<T>)
    return a || b;
  else if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
  else
    return a + b;
}

template <typename T> T mulWrapping(T a, T b) {
  if constexpr (isBool<T>)
    return a && b;
  else if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
  else
    return a * b;
}

/// x combined with update u; Max and Min propagate NaN as numpy's maximum
/// and minimum do.
template <typename T> T combine(Reduction r, T x, T u) {
  switch (r) {
  case Reduction::None:
    return u;
  case Reduction::Add:
    return addWrapping(x, u);
  case Reduction::Mul:
    return mulWrapping(x, u);
  case Reduction::Max:
  case Reduction::Min:
    if constexpr (isFloat<T>)
      if (std::isnan(x) || std::isnan(u))
        return std::isnan(x) ? x : u;
    return (r == Reduction::Max) == (u > x) ? u : x;
  }
  return u;
}

/// The reduction attribute of ScatterElements and ScatterND: add and mul
/// from opset 16, max and min from 18. Scatter has none.
Expected<Reduction> reductionOf(const OpContext &ctx) {
  std::string name = ctx.attrString("reduction", "none");
  if (name == "none")
    return Reduction::None;
  if (ctx.is(OpId::Scatter))
    return ctx.fail("Scatter has no attribute 'reduction'");
  Reduction r;
  int64_t since = 16;
  if (name == "add")
    r = Reduction::Add;
  else if (name == "mul")
    r = Reduction::Mul;
  else if (name == "max" || name == "min")
    r = name == "max" ? Reduction::Max : Reduction::Min, since = 18;
  else
    return ctx.fail("unknown reduction '" + name + "'");
  if (ctx.opset < since)
    return ctx.fail(
        formatv("reduction '{0}' needs opset {1}, the model has {2}", name, since, ctx.opset));
  return r;
}

Error indexInput(const OpContext &ctx, size_t i) {
  DType type = ctx.input(i).elemType();
  if (type == DType::I64 || type == DType::I32)
    return Error::success();
  return ctx.fail(
      formatv("indices (input {0}) must be int32 or int64, not {1}", i, elemTypeName(type)));
}

/// What the scatters check first: integer indices (input 1) and updates
/// (input 2) of data's type; then their reduction.
Expected<Reduction> scatterReduction(const OpContext &ctx) {
  if (Error e = indexInput(ctx, 1))
    return e;
  if (Error e = ctx.sameType(0, 2))
    return e;
  return reductionOf(ctx);
}

/// The values of index tensor \p indices made non-negative against \p dim,
/// or an error naming the first one out of [-dim, dim).
Expected<std::vector<int64_t>> normalizedIndices(const OpContext &ctx, const Tensor &indices,
                                                 int64_t dim, int64_t axis) {
  std::vector<int64_t> index = indices.toInt64Vector();
  for (int64_t &i : index) {
    if (i < -dim || i >= dim)
      return ctx.fail(
          formatv("index {0} is out of range for dimension {1} of size {2}", i, axis, dim));
    if (i < 0)
      i += dim;
  }
  return index;
}

/// The flat offsets into data of shape \p dataShape that the elements of
/// \p indices address along \p axis (GatherElements, ScatterElements): each
/// keeps its own coordinates but along the axis, where it takes its index
/// value.
Expected<std::vector<int64_t>> elementOffsets(const OpContext &ctx, ArrayRef<int64_t> dataShape,
                                              const Tensor &indices, int64_t axis) {
  int64_t rank = static_cast<int64_t>(dataShape.size());
  if (indices.rank() != rank)
    return ctx.fail("indices " + indices.describe() + " and data " + shapeString(dataShape) +
                    " differ in rank");
  for (int64_t d = 0; d < rank; ++d)
    if (d != axis && indices.dim(d) > dataShape[d])
      return ctx.fail(formatv("indices {0} exceed data {1} in dimension {2}", indices.describe(),
                              shapeString(dataShape), d));
  Expected<std::vector<int64_t>> index = normalizedIndices(ctx, indices, dataShape[axis], axis);
  if (!index)
    return index.takeError();
  Shape strides = stridesOf(dataShape);
  int64_t axisStride = strides[axis];
  strides[axis] = 0;
  std::vector<int64_t> &offsets = *index;
  forEachStrided<1>(indices.shape(), {strides}, [&](int64_t i, const std::array<int64_t, 1> &off) {
    offsets[i] = off[0] + offsets[i] * axisStride;
  });
  return std::move(offsets);
}

/// Combines \p updates into \p out in place: the \p slice consecutive
/// updates of each offset go to the \p slice elements from it.
void scatterInto(Tensor &out, const Tensor &updates, ArrayRef<int64_t> offsets, int64_t slice,
                 Reduction r) {
  visitStorage(out.elemType(), [&](auto tag) {
    using T = decltype(tag);
    T *dst = out.data<T>();
    const T *src = updates.data<T>();
    for (int64_t offset : offsets) {
      for (int64_t j = 0; j < slice; ++j)
        dst[offset + j] = combine(r, dst[offset + j], src[j]);
      src += slice;
    }
  });
}

/// Checks the shapes ScatterND and GatherND share: data of rank >= 1 and
/// indices of rank >= 1 whose last dimension, the tuple length k, is at most
/// rank(data) - \p batch.
Expected<int64_t> tupleLength(const OpContext &ctx, const Tensor &data, const Tensor &indices,
                              int64_t batch) {
  if (data.rank() < 1 || indices.rank() < 1)
    return ctx.fail("data " + data.describe() + " and indices " + indices.describe() +
                    " must have rank >= 1");
  int64_t k = indices.dim(-1);
  if (k > data.rank() - batch)
    return ctx.fail(formatv("index tuples of length {0} do not fit data {1}", k, data.describe()) +
                    (batch ? formatv(" after {0} batch dimensions", batch).str() : ""));
  return k;
}

/// The flat offsets of the slices the k-tuples of \p indices address in
/// \p data, from dimension \p batch on; tuples of batch n start at n times
/// the batch stride.
Expected<std::vector<int64_t>> tupleOffsets(const OpContext &ctx, const Tensor &data,
                                            const Tensor &indices, int64_t batch, int64_t k) {
  std::vector<int64_t> index = indices.toInt64Vector();
  Shape strides = stridesOf(data.shape());
  int64_t tuples = product(ArrayRef<int64_t>(indices.shape()).drop_back());
  int64_t batches = product(ArrayRef<int64_t>(data.shape()).take_front(batch));
  int64_t perBatch = batches == 0 ? 0 : tuples / batches;
  int64_t batchStride = batch == 0 ? 0 : strides[batch - 1];
  std::vector<int64_t> offsets(tuples);
  for (int64_t t = 0; t < tuples; ++t) {
    int64_t offset = perBatch == 0 ? 0 : (t / perBatch) * batchStride;
    for (int64_t j = 0; j < k; ++j) {
      int64_t dim = data.dim(batch + j), i = index[t * k + j];
      if (i < -dim || i >= dim)
        return ctx.fail(
            formatv("index {0} is out of range for dimension {1} of size {2}", i, batch + j, dim));
      offset += (i < 0 ? i + dim : i) * strides[batch + j];
    }
    offsets[t] = offset;
  }
  return offsets;
}

/// What a gather's gradient checks first: its indices (input 1) are
/// integers, and attribute 'shape', which it returns, is the gathered
/// data's shape, of rank >= 1 and without negative dimensions.
Expected<Shape> gatheredShape(const OpContext &ctx) {
  if (Error e = indexInput(ctx, 1))
    return e;
  std::optional<Shape> shape = ctx.attrInts("shape");
  if (!shape || shape->empty() || llvm::any_of(*shape, [](int64_t d) { return d < 0; }))
    return ctx.fail("attribute 'shape' must be the gathered data's shape, of rank >= 1");
  return *shape;
}

/// Attribute batch_dims of GatherND and its gradient: below the ranks of the
/// data (of shape \p dataShape, named \p dataText in errors) and of
/// \p indices, which agree on those leading dimensions.
Expected<int64_t> batchDims(const OpContext &ctx, ArrayRef<int64_t> dataShape,
                            const std::string &dataText, const Tensor &indices) {
  int64_t batch = ctx.attrInt("batch_dims", 0);
  if (batch < 0 || batch >= std::min<int64_t>(dataShape.size(), indices.rank()))
    return ctx.fail(formatv("batch_dims {0} must be below the ranks of data {1} and indices {2}",
                            batch, dataText, indices.describe()));
  for (int64_t d = 0; d < batch; ++d)
    if (dataShape[d] != indices.dim(d))
      return ctx.fail(formatv("data {0} and indices {1} differ in batch dimension {2}", dataText,
                              indices.describe(), d));
  return batch;
}

/// The offsets of the elements \p indices names along the node's `axis` in
/// a tensor of \p shape (GatherElements, ScatterElements, and the former's
/// gradient).
Expected<std::vector<int64_t>> offsetsAlongAxis(const OpContext &ctx, ArrayRef<int64_t> shape,
                                                const Tensor &indices) {
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), shape.size());
  if (!axis)
    return axis.takeError();
  return elementOffsets(ctx, shape, indices, *axis);
}

/// Combines \p updates (called \p updatesName in errors), of indices'
/// shape, by \p r into the elements of \p out that \p indices names along
/// attribute 'axis': ScatterElements, and GatherElementsGrad into zeros.
Error scatterAlongAxis(const OpContext &ctx, Tensor &out, const Tensor &indices,
                       const Tensor &updates, StringRef updatesName, Reduction r) {
  if (updates.shape() != indices.shape())
    return ctx.fail(updatesName + " " + updates.describe() + " and indices " + indices.describe() +
                    " differ in shape");
  Expected<std::vector<int64_t>> offsets = offsetsAlongAxis(ctx, out.shape(), indices);
  if (!offsets)
    return offsets.takeError();
  scatterInto(out, updates, *offsets, 1, r);
  return Error::success();
}

/// The shape of the slices that the index tuples of \p indices gather from
/// data of \p dataShape: indices' leading dimensions, then data's from
/// dimension \p from (batch_dims plus the tuple length) on.
Shape tupleSlicesShape(const Tensor &indices, ArrayRef<int64_t> dataShape, int64_t from) {
  Shape shape(indices.shape().begin(), indices.shape().end() - 1);
  shape.insert(shape.end(), dataShape.begin() + from, dataShape.end());
  return shape;
}

/// Combines \p updates (called \p updatesName in errors) by \p r into the
/// slices of \p out that the index tuples of \p indices address, after
/// attribute batch_dims where \p batched: ScatterND, and GatherNDGrad into
/// zeros.
Error scatterTuples(const OpContext &ctx, Tensor &out, const Tensor &indices, const Tensor &updates,
                    StringRef updatesName, Reduction r, bool batched) {
  int64_t batch = 0;
  if (batched) {
    Expected<int64_t> given = batchDims(ctx, out.shape(), shapeString(out.shape()), indices);
    if (!given)
      return given.takeError();
    batch = *given;
  }
  Expected<int64_t> k = tupleLength(ctx, out, indices, batch);
  if (!k)
    return k.takeError();
  Shape expected = tupleSlicesShape(indices, out.shape(), batch + *k);
  if (updates.shape() != expected)
    return ctx.fail(updatesName + " " + updates.describe() + " must have shape " +
                    shapeString(expected));
  Expected<std::vector<int64_t>> offsets = tupleOffsets(ctx, out, indices, batch, *k);
  if (!offsets)
    return offsets.takeError();
  scatterInto(out, updates, *offsets, product(out.shape().drop_front(batch + *k)), r);
  return Error::success();
}

/// The gradient of a gather's data, dY (input 0) added into zeros of
/// attribute 'shape' by \p scatter(out, dY, indices) -> Error.
template <typename Scatter>
Expected<Outputs> gatherGradient(const OpContext &ctx, Scatter scatter) {
  const Tensor &dy = ctx.input(0), &indices = ctx.input(1);
  Expected<Shape> shape = gatheredShape(ctx);
  if (!shape)
    return shape.takeError();
  Tensor out(dy.elemType(), *shape);
  if (Error e = scatter(out, dy, indices))
    return e;
  return Outputs{out};
}

} // namespace

Expected<Outputs> gatherElements(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1);
  if (Error e = indexInput(ctx, 1))
    return e;
  if (data.rank() == 0)
    return ctx.fail("data must have rank >= 1");
  Expected<std::vector<int64_t>> offsets = offsetsAlongAxis(ctx, data.shape(), indices);
  if (!offsets)
    return offsets.takeError();
  Tensor out(data.elemType(), indices.shape());
  visitStorage(data.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = data.data<T>();
    T *dst = out.data<T>();
    for (size_t i = 0; i < offsets->size(); ++i)
      dst[i] = src[(*offsets)[i]];
  });
  return Outputs{out};
}

/// ScatterElements, and Scatter (opsets 9 and 10), which is ScatterElements
/// without a reduction.
Expected<Outputs> scatterElements(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1), &updates = ctx.input(2);
  Expected<Reduction> r = scatterReduction(ctx);
  if (!r)
    return r.takeError();
  if (data.rank() == 0)
    return ctx.fail("data must have rank >= 1");
  Tensor out = data.clone();
  if (Error e = scatterAlongAxis(ctx, out, indices, updates, "updates", *r))
    return e;
  return Outputs{out};
}

/// GatherElementsGrad(dY, indices) [axis, shape]: the gradient of
/// GatherElements' data, zeros of `shape` with dY added at the elements
/// the indices gathered.
Expected<Outputs> gatherElementsGrad(const OpContext &ctx) {
  return gatherGradient(ctx, [&](Tensor &out, const Tensor &dy, const Tensor &indices) {
    return scatterAlongAxis(ctx, out, indices, dy, "dY", Reduction::Add);
  });
}

Expected<Outputs> gatherND(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1);
  if (Error e = indexInput(ctx, 1))
    return e;
  Expected<int64_t> batchOrError = batchDims(ctx, data.shape(), data.describe(), indices);
  if (!batchOrError)
    return batchOrError.takeError();
  int64_t batch = *batchOrError;
  Expected<int64_t> k = tupleLength(ctx, data, indices, batch);
  if (!k)
    return k.takeError();
  Expected<std::vector<int64_t>> offsets = tupleOffsets(ctx, data, indices, batch, *k);
  if (!offsets)
    return offsets.takeError();
  Tensor out(data.elemType(), tupleSlicesShape(indices, data.shape(), batch + *k));
  size_t block = product(ArrayRef<int64_t>(data.shape()).drop_front(batch + *k)) *
                 storageSize(data.elemType());
  const char *src = static_cast<const char *>(data.rawData());
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t offset : *offsets) {
    std::memcpy(dst, src + offset * storageSize(data.elemType()), block);
    dst += block;
  }
  return Outputs{out};
}

/// GatherNDGrad(dY, indices) [batch_dims, shape]: the gradient of
/// GatherND's data, zeros of `shape` with each slice of dY added at the
/// slice its index tuple gathered.
Expected<Outputs> gatherNDGrad(const OpContext &ctx) {
  return gatherGradient(ctx, [&](Tensor &out, const Tensor &dy, const Tensor &indices) {
    return scatterTuples(ctx, out, indices, dy, "dY", Reduction::Add, /*batched=*/true);
  });
}

Expected<Outputs> scatterND(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1), &updates = ctx.input(2);
  Expected<Reduction> r = scatterReduction(ctx);
  if (!r)
    return r.takeError();
  Tensor out = data.clone();
  if (Error e = scatterTuples(ctx, out, indices, updates, "updates", *r, /*batched=*/false))
    return e;
  return Outputs{out};
}

namespace {

/// K of TopK: input 1 (an int64 [1]) from opset 10, attribute 'k' before.
Expected<int64_t> topKCount(const OpContext &ctx, int64_t axisSize) {
  int64_t k;
  if (const Tensor *given = ctx.optInput(1)) {
    if (given->elemType() != DType::I64 || given->numElements() != 1)
      return ctx.fail("K must be an int64 tensor of one element, got " + given->describe());
    k = given->getInt64(0);
  } else if (ctx.attr("k")) {
    k = ctx.attrInt("k", 0);
  } else {
    return ctx.fail("missing K (input 1, or attribute 'k' before opset 10)");
  }
  if (k < 0 || k > axisSize)
    return ctx.fail(formatv("K {0} is out of range for an axis of size {1}", k, axisSize));
  return k;
}

/// Whether a ranks above b for TopK: NaN above every number, as
/// onnxruntime and numpy's sort order it.
template <typename T> bool ranksAbove(T a, T b) {
  if constexpr (isFloat<T>)
    if (std::isnan(a) || std::isnan(b))
      return !std::isnan(b);
  return a > b;
}

} // namespace

/// TopK: the K largest (or smallest) elements along the axis and their
/// int64 indices, best first. Equal elements keep their order (the lower
/// index first), as ONNX specifies; sorted = 0 gives the same order.
Expected<Outputs> topK(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.rank() == 0)
    return ctx.fail("input must have rank >= 1");
  if (x.elemType() == DType::Bool)
    return ctx.unsupportedType(x, 0);
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", -1), x.rank());
  if (!axis)
    return axis.takeError();
  AxisSplit split = splitAt(x.shape(), *axis);
  Expected<int64_t> k = topKCount(ctx, split.size);
  if (!k)
    return k.takeError();
  bool largest = ctx.attrInt("largest", 1) != 0;
  Shape shape = x.shape();
  shape[*axis] = *k;
  Tensor values(x.elemType(), shape), indices(DType::I64, shape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *in = x.data<T>();
    T *pv = values.data<T>();
    int64_t *pi = indices.data<int64_t>();
    std::vector<int64_t> order(split.size);
    for (int64_t o = 0; o < split.outer; ++o)
      for (int64_t i = 0; i < split.inner; ++i) {
        const T *row = in + o * split.size * split.inner + i;
        auto before = [&](int64_t a, int64_t b) {
          T va = row[a * split.inner], vb = row[b * split.inner];
          bool above = largest ? ranksAbove(va, vb) : ranksAbove(vb, va);
          bool below = largest ? ranksAbove(vb, va) : ranksAbove(va, vb);
          return above || (!below && a < b);
        };
        for (int64_t j = 0; j < split.size; ++j)
          order[j] = j;
        std::partial_sort(order.begin(), order.begin() + *k, order.end(), before);
        int64_t base = o * *k * split.inner + i;
        for (int64_t j = 0; j < *k; ++j) {
          pv[base + j * split.inner] = row[order[j] * split.inner];
          pi[base + j * split.inner] = order[j];
        }
      }
  });
  return Outputs{values, indices};
}

/// Trilu: the upper (j - i >= k) or lower (j - i <= k) triangle of each
/// matrix of the last two dimensions; zeros elsewhere.
Expected<Outputs> trilu(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail("input " + x.describe() + " must have rank >= 2");
  int64_t k = 0;
  if (const Tensor *kIn = ctx.optInput(1)) {
    if (kIn->elemType() != DType::I64 || kIn->numElements() != 1)
      return ctx.fail("k must be one int64, not " + kIn->describe());
    k = kIn->data<int64_t>()[0];
  }
  bool upper = ctx.attrInt("upper", 1) != 0;
  int64_t rows = x.dim(-2), cols = x.dim(-1);
  int64_t matrices = rows * cols == 0 ? 0 : x.numElements() / (rows * cols);
  Tensor y(x.elemType(), x.shape());
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>();
    T *dst = y.data<T>();
    for (int64_t m = 0; m < matrices; ++m)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          int64_t at = (m * rows + i) * cols + j;
          // j - i cannot overflow; compared with k it decides the triangle.
          if (upper ? j - i >= k : j - i <= k)
            dst[at] = src[at];
        }
  });
  return Outputs{y};
}

namespace {

enum class PadMode { Constant, Reflect, Edge, Wrap };

/// Where output position \p o of a padded axis reads: -1 for the constant,
/// else the position in the (cropped) input of length \p len, which is
/// > 0 for every mode but Constant.
int64_t padSource(PadMode mode, int64_t o, int64_t before, int64_t len) {
  int64_t c = o - before;
  if (c >= 0 && c < len)
    return c;
  switch (mode) {
  case PadMode::Constant:
    return -1;
  case PadMode::Edge:
    return c < 0 ? 0 : len - 1;
  case PadMode::Wrap:
    return ((c % len) + len) % len;
  case PadMode::Reflect: {
    // numpy's reflect (the edge is not repeated) has period 2 (len - 1).
    if (len == 1)
      return 0;
    int64_t period = 2 * (len - 1), m = ((c % period) + period) % period;
    return m >= len ? period - m : m;
  }
  }
  return -1;
}

struct PadSpec {
  PadMode mode;
  /// Per axis of the input: the pads before and after (negative crops).
  Shape before, after;
};

/// Pad's mode, pads and axes, from attributes before opset 11 (`paddings`
/// in opset 1) and from inputs 1 and 3 since.
Expected<PadSpec> padSpec(const OpContext &ctx, int64_t rank) {
  PadSpec spec;
  std::string mode = ctx.attrString("mode", "constant");
  std::optional<PadMode> known = StringSwitch<std::optional<PadMode>>(mode)
                                     .Case("constant", PadMode::Constant)
                                     .Case("reflect", PadMode::Reflect)
                                     .Case("edge", PadMode::Edge)
                                     .Case("wrap", PadMode::Wrap)
                                     .Default(std::nullopt);
  if (!known || (*known == PadMode::Wrap && ctx.opset < 19))
    return ctx.fail("unknown mode '" + mode + "' at opset " + Twine(ctx.opset));
  spec.mode = *known;
  std::optional<Shape> pads;
  if (ctx.opset >= 11) {
    const Tensor *p = ctx.optInput(1);
    if (!p || (p->elemType() != DType::I64))
      return ctx.fail("pads (input 1) must be an int64 tensor");
    pads = p->toInt64Vector();
  } else {
    pads = ctx.attrInts(ctx.opset >= 2 ? "pads" : "paddings");
    if (!pads)
      return ctx.fail(ctx.opset >= 2 ? "missing attribute 'pads'" : "missing attribute 'paddings'");
  }
  Shape axes;
  if (const Tensor *a = ctx.opset >= 18 ? ctx.optInput(3) : nullptr) {
    if (a->elemType() != DType::I64 && a->elemType() != DType::I32)
      return ctx.fail("axes (input 3) must be int32 or int64, not " + a->describe());
    axes = a->toInt64Vector();
  } else {
    for (int64_t d = 0; d < rank; ++d)
      axes.push_back(d);
  }
  if (pads->size() != 2 * axes.size())
    return ctx.fail(formatv("{0} pads for {1} axes", pads->size(), axes.size()));
  spec.before.assign(rank, 0);
  spec.after.assign(rank, 0);
  std::vector<bool> seen(rank, false);
  for (size_t i = 0; i < axes.size(); ++i) {
    Expected<int64_t> axis = ctx.normalizeAxis(axes[i], rank);
    if (!axis)
      return axis.takeError();
    if (seen[*axis])
      return ctx.fail(formatv("axis {0} appears twice", axes[i]));
    seen[*axis] = true;
    spec.before[*axis] = (*pads)[i];
    spec.after[*axis] = (*pads)[axes.size() + i];
  }
  return spec;
}

/// The constant of a constant-mode Pad as a one-element tensor of \p x's
/// type: the `value` attribute before opset 11, input 2 since (0 when
/// omitted).
Expected<Tensor> padValue(const OpContext &ctx, const Tensor &x) {
  Tensor value(x.elemType(), {});
  if (ctx.opset < 11) {
    value.setDouble(0, ctx.attrFloat("value", 0));
    return value;
  }
  const Tensor *v = ctx.optInput(2);
  if (!v)
    return value;
  if (v->elemType() != x.elemType() || v->numElements() != 1)
    return ctx.fail("constant_value " + v->describe() + " must be one element of " +
                    elemTypeName(x.elemType()));
  return *v;
}

} // namespace

/// Pad: negative pads crop first, then the cropped input is padded; reflect,
/// edge and wrap read the cropped input.
Expected<Outputs> pad(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Expected<PadSpec> spec = padSpec(ctx, x.rank());
  if (!spec)
    return spec.takeError();
  Expected<Tensor> value = padValue(ctx, x);
  if (!value)
    return value.takeError();
  int64_t rank = x.rank();
  Shape shape(rank), inStrides = stridesOf(x.shape());
  // Per axis, the input offset each output position reads (-1: the value).
  std::vector<Shape> source(rank);
  int64_t start = 0;
  for (int64_t d = 0; d < rank; ++d) {
    int64_t before = spec->before[d], after = spec->after[d];
    int64_t cropBefore = std::max<int64_t>(0, -before), cropAfter = std::max<int64_t>(0, -after);
    int64_t len = x.dim(d) - cropBefore - cropAfter;
    if (len < 0)
      return ctx.fail(formatv("pads {0} and {1} crop more than dimension {2} of {3} holds", before,
                              after, d, x.describe()));
    int64_t padBefore = std::max<int64_t>(0, before), padAfter = std::max<int64_t>(0, after);
    if (len == 0 && spec->mode != PadMode::Constant && padBefore + padAfter > 0)
      return ctx.fail(formatv("cannot pad the empty dimension {0} of {1} in mode '{2}'", d,
                              x.describe(), ctx.attrString("mode", "")));
    shape[d] = len + padBefore + padAfter;
    start += cropBefore * inStrides[d];
    for (int64_t o = 0; o < shape[d]; ++o) {
      int64_t c = padSource(spec->mode, o, padBefore, len);
      source[d].push_back(c < 0 ? -1 : c * inStrides[d]);
    }
  }
  Tensor y(x.elemType(), shape);
  if (y.numElements() == 0)
    return Outputs{y};
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>() + start;
    T *dst = y.data<T>();
    T fill = value->data<T>()[0];
    if (rank == 0) {
      dst[0] = src[0];
      return;
    }
    // An odometer over the outer axes; the innermost one runs as a loop.
    Shape counter(rank - 1, 0);
    const Shape &inner = source[rank - 1];
    for (int64_t o = 0, rows = y.numElements() / shape[rank - 1]; o < rows; ++o) {
      int64_t base = 0;
      bool filled = false;
      for (int64_t d = 0; d + 1 < rank; ++d) {
        filled |= source[d][counter[d]] < 0;
        base += source[d][counter[d]];
      }
      for (int64_t j = 0; j < shape[rank - 1]; ++j)
        *dst++ = filled || inner[j] < 0 ? fill : src[base + inner[j]];
      for (int64_t d = rank - 2; d >= 0 && ++counter[d] == shape[d]; --d)
        counter[d] = 0;
    }
  });
  return Outputs{y};
}

namespace {

/// \p v rounded to what \p type holds (float16 and bfloat16 are stored as
/// float).
float roundedTo(DType type, float v) {
  if (type == DType::F16)
    return halfToFloat(floatToHalf(v));
  if (type == DType::BF16)
    return bfloat16ToFloat(floatToBFloat16(v));
  return v;
}
double roundedTo(DType, double v) { return v; }

/// CumSum and CumProd along the axis of input 1, inclusive or exclusive,
/// forward or reversed. Each partial result is rounded to the element type,
/// as numpy's accumulate computes float16.
template <bool Product> Expected<Outputs> cumulative(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &axisIn = ctx.input(1);
  if ((axisIn.elemType() != DType::I64 && axisIn.elemType() != DType::I32) ||
      axisIn.numElements() != 1 || axisIn.rank() > 1)
    return ctx.fail("axis must be one int32 or int64, not " + axisIn.describe());
  Expected<int64_t> axis = ctx.normalizeAxis(axisIn.getInt64(0), x.rank());
  if (!axis)
    return axis.takeError();
  bool exclusive = ctx.attrInt("exclusive", 0) != 0, reverse = ctx.attrInt("reverse", 0) != 0;
  AxisSplit layout = splitAt(x.shape(), *axis);
  DType type = x.elemType();
  return visitStorage(type, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (isBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(type, x.shape());
      const T *src = x.data<T>();
      T *dst = y.data<T>();
      for (int64_t o = 0; o < layout.outer; ++o)
        for (int64_t in = 0; in < layout.inner; ++in) {
          T acc = Product ? T(1) : T(0);
          for (int64_t s = 0; s < layout.size; ++s) {
            int64_t at =
                (o * layout.size + (reverse ? layout.size - 1 - s : s)) * layout.inner + in;
            if (exclusive)
              dst[at] = acc;
            acc = Product ? mulWrapping(acc, src[at]) : addWrapping(acc, src[at]);
            if constexpr (isFloat<T>)
              acc = roundedTo(type, acc);
            if (!exclusive)
              dst[at] = acc;
          }
        }
      return Outputs{y};
    }
  });
}

} // namespace

Expected<Outputs> cumSum(const OpContext &ctx) { return cumulative<false>(ctx); }
Expected<Outputs> cumProd(const OpContext &ctx) { return cumulative<true>(ctx); }

} // namespace pipec::cpu
