//===- CudaTensorOps.cpp - Views, data movement, element-wise ---------------===//
//
// The CUDA backend's op methods that move data or map elements: views and
// shape queries, transposes, slices, concat, split, gather, where, casts and
// every element-wise op of the registry.
//
//===----------------------------------------------------------------------===//
#include "ops/Reshape.h"
#include "runtime/cuda/CudaOps.h"

using namespace llvm;

namespace pipec::cuda {

//===----------------------------------------------------------------------===//
// Views and shapes
//===----------------------------------------------------------------------===//

Result CudaBackend::identity(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  return Outputs{dev};
}

/// Reshape, Flatten, Squeeze and Unsqueeze: the new shape as the CPU kernels
/// compute it, over the input's memory.
Result CudaBackend::view(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  const Shape &in = x->shape();
  int64_t rank = x->rank();
  Shape shape;
  if (n.is(OpId::Reshape)) {
    PIPEC_TRY_ASSIGN(requested, intsFromInputOrAttr(n, 1, "shape"));
    if (!requested)
      return std::nullopt;
    // A malformed target goes to the host backend, which words its error.
    Expected<Shape> target = reshapeTarget(in, *requested, n.attrInt("allowzero", 0) != 0, "");
    if (!target) {
      consumeError(target.takeError());
      return std::nullopt;
    }
    shape = std::move(*target);
  } else if (n.is(OpId::Flatten)) {
    int64_t axis = n.attrInt("axis", 1);
    if (axis < 0)
      axis += rank;
    if (axis < 0 || axis > rank)
      return std::nullopt;
    shape = {product(ArrayRef<int64_t>(in).take_front(axis)),
             product(ArrayRef<int64_t>(in).drop_front(axis))};
  } else if (n.is(OpId::Squeeze)) {
    PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
    std::vector<bool> drop(rank, false);
    if (!axes) {
      for (int64_t i = 0; i < rank; ++i)
        drop[i] = in[i] == 1;
    } else {
      for (int64_t a : *axes) {
        auto axis = NodeView::axisIn(a, rank);
        if (!axis || in[*axis] != 1)
          return std::nullopt;
        drop[*axis] = true;
      }
    }
    for (int64_t i = 0; i < rank; ++i)
      if (!drop[i])
        shape.push_back(in[i]);
  } else { // Unsqueeze
    PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
    if (!axes)
      return std::nullopt;
    int64_t outRank = rank + static_cast<int64_t>(axes->size());
    std::vector<bool> inserted(outRank, false);
    for (int64_t a : *axes) {
      auto axis = NodeView::axisIn(a, outRank);
      if (!axis || inserted[*axis])
        return std::nullopt;
      inserted[*axis] = true;
    }
    int64_t next = 0;
    for (int64_t i = 0; i < outRank; ++i)
      shape.push_back(inserted[i] ? 1 : in[next++]);
  }
  if (product(shape) != x->numElements())
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  return Outputs{dev.reshaped(shape)};
}

/// Shape and Size: host int64, as the CPU kernels make them.
Result CudaBackend::shapeOf(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  if (n.is(OpId::Size))
    return Outputs{Tensor::scalar<int64_t>(x->numElements())};
  return Outputs{cpu::shapeTensor(x->shape(), n.attrInt("start", 0), n.attrInt("end", x->rank()))};
}

Result CudaBackend::constantOfShape(const NodeView &n) {
  const Tensor *shapeInput = n.in(0);
  if (!shapeInput || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(shape, hostInts(*shapeInput));
  if (llvm::any_of(shape, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  Tensor value = Tensor::scalar(0.0f);
  if (const auto *a = n.attr("value")) {
    auto given = cpu::fromTensorProto(a->t());
    if (!given) {
      consumeError(given.takeError());
      return std::nullopt;
    }
    if (given->numElements() != 1)
      return std::nullopt;
    value = *given;
  }
  PIPEC_TRY_ASSIGN(out, allocate(value.elemType(), shape));
  uint64_t pattern = 0;
  std::memcpy(&pattern, value.rawData(), value.byteSize());
  if (out.numElements() > 0) {
    if (pattern == 0)
      PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    else
      PIPEC_CUDA_TRY(launchFill(elemBytes(out), pattern, out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Data movement
//===----------------------------------------------------------------------===//

Result CudaBackend::transpose(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  int64_t rank = x->rank();
  Shape perm(rank);
  if (std::optional<Shape> given = n.attrInts("perm")) {
    perm = *given;
    Shape sorted = perm;
    llvm::sort(sorted);
    if (static_cast<int64_t>(sorted.size()) != rank)
      return std::nullopt;
    for (int64_t i = 0; i < rank; ++i)
      if (sorted[i] != i)
        return std::nullopt;
  } else {
    for (int64_t i = 0; i < rank; ++i)
      perm[i] = rank - 1 - i;
  }
  Shape inStrides = k::contiguousStrides(x->shape()), outShape(rank), strides(rank);
  for (int64_t i = 0; i < rank; ++i) {
    outShape[i] = x->dim(perm[i]);
    strides[i] = inStrides[perm[i]];
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done, stridedCopy(dev, outShape, strides, 0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

Result CudaBackend::expand(const NodeView &n) {
  const Tensor *x = n.in(0), *shapeInput = n.in(1);
  if (!x || !shapeInput || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(requested, hostInts(*shapeInput));
  if (llvm::any_of(requested, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  auto shape = cpu::broadcastShapes(x->shape(), requested);
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done,
                   stridedCopy(dev, *shape, k::broadcastStrides(dev.shape(), *shape), 0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// Slice with any steps, as the CPU kernel clamps them.
Result CudaBackend::slice(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(starts, intsFromInputOrAttr(n, 1, "starts"));
  PIPEC_TRY_ASSIGN(ends, intsFromInputOrAttr(n, 2, "ends"));
  PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 3, "axes"));
  PIPEC_TRY_ASSIGN(steps, intsFromInputOrAttr(n, 4, "steps"));
  if (!starts || !ends)
    return std::nullopt;
  size_t count = starts->size();
  if (!k::fillSliceDefaults(count, ends->size(), axes, steps))
    return std::nullopt;
  Shape shape = x->shape(), inStrides = k::contiguousStrides(x->shape()), strides = inStrides;
  int64_t base = 0;
  std::vector<bool> seen(x->rank(), false);
  for (size_t i = 0; i < count; ++i) {
    auto axis = NodeView::axisIn((*axes)[i], x->rank());
    if (!axis || seen[*axis])
      return std::nullopt;
    seen[*axis] = true;
    int64_t dim = x->dim(*axis);
    int64_t step = std::max((*steps)[i], -std::numeric_limits<int64_t>::max());
    if (step == 0)
      return std::nullopt;
    k::SliceAxis read = k::sliceAxis(dim, (*starts)[i], (*ends)[i], step);
    shape[*axis] = read.length;
    // Only a second element steps (then |step| < dim: no overflow).
    strides[*axis] = read.length > 1 ? inStrides[*axis] * step : inStrides[*axis];
    if (read.length > 0)
      base += read.begin * inStrides[*axis];
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  Tensor out;
  PIPEC_TRY_ASSIGN(done, stridedCopy(dev, shape, strides, base, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// Concat: one 2-D copy per input (rows = the dimensions before the axis).
Result CudaBackend::concat(const NodeView &n) {
  const Tensor *first = n.in(0);
  if (!first || n.numOutputs() != 1 || first->rank() == 0)
    return std::nullopt;
  const auto *axisAttr = n.attr("axis");
  if (!axisAttr && n.opset >= 4)
    return std::nullopt;
  auto axis = NodeView::axisIn(axisAttr ? axisAttr->i() : 1, first->rank());
  if (!axis)
    return std::nullopt;
  Shape shape = first->shape();
  shape[*axis] = 0;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    const Tensor *t = n.in(i);
    if (!t || t->elemType() != first->elemType() || t->rank() != first->rank())
      return std::nullopt;
    for (int64_t d = 0; d < t->rank(); ++d)
      if (d != *axis && t->dim(d) != first->dim(d))
        return std::nullopt;
    shape[*axis] += t->dim(*axis);
  }
  PIPEC_TRY_ASSIGN(out, allocate(first->elemType(), shape));
  size_t elem = cpu::storageSize(first->elemType());
  int64_t outer = product(ArrayRef<int64_t>(shape).take_front(*axis));
  int64_t inner = product(ArrayRef<int64_t>(shape).drop_front(*axis + 1));
  size_t pitch = static_cast<size_t>(shape[*axis] * inner) * elem;
  size_t offset = 0;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    PIPEC_TRY_ASSIGN(t, onDevice(*n.in(i)));
    size_t width = static_cast<size_t>(t.dim(*axis) * inner) * elem;
    if (width > 0 && outer > 0)
      PIPEC_CUDA_TRY(cudaMemcpy2DAsync(static_cast<char *>(out.rawData()) + offset, pitch,
                                       t.rawData(), width, width, static_cast<size_t>(outer),
                                       cudaMemcpyDeviceToDevice, stream));
    offset += width;
  }
  return Outputs{out};
}

Result CudaBackend::split(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!x || x->rank() == 0)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), x->rank());
  if (!axis)
    return std::nullopt;
  int64_t dim = x->dim(*axis);
  int64_t parts = static_cast<int64_t>(n.numOutputs());
  PIPEC_TRY_ASSIGN(sizes, intsFromInputOrAttr(n, 1, "split"));
  if (!sizes) {
    if (const auto *numOutputs = n.attr("num_outputs"))
      parts = numOutputs->i();
    if (parts <= 0)
      return std::nullopt;
    if (!n.attr("num_outputs") && dim % parts != 0)
      return std::nullopt;
    sizes = k::equalSplit(dim, parts);
  }
  if (!k::splitCovers(*sizes, parts, dim))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  size_t elem = cpu::storageSize(x->elemType());
  int64_t outer = product(ArrayRef<int64_t>(x->shape()).take_front(*axis));
  int64_t inner = product(ArrayRef<int64_t>(x->shape()).drop_front(*axis + 1));
  size_t pitch = static_cast<size_t>(dim * inner) * elem;
  Outputs outputs;
  int64_t begin = 0;
  for (int64_t size : *sizes) {
    Shape shape = x->shape();
    shape[*axis] = size;
    PIPEC_TRY_ASSIGN(part, allocate(x->elemType(), shape));
    size_t width = static_cast<size_t>(size * inner) * elem;
    if (width > 0 && outer > 0)
      PIPEC_CUDA_TRY(cudaMemcpy2DAsync(
          part.rawData(), width,
          static_cast<const char *>(dev.rawData()) + static_cast<size_t>(begin * inner) * elem,
          pitch, width, static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream));
    begin += size;
    outputs.push_back(part);
  }
  return outputs;
}

Result CudaBackend::gather(const NodeView &n) {
  const Tensor *data = n.in(0), *indices = n.in(1);
  if (!data || !indices || n.numOutputs() != 1 || data->rank() == 0)
    return std::nullopt;
  DType indexType = indices->elemType();
  if (indexType != DType::I64 && indexType != DType::I32)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), data->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> dataShape = data->shape();
  k::GatherParams p;
  p.outer = product(dataShape.take_front(*axis));
  p.size = dataShape[*axis];
  p.inner = product(dataShape.drop_front(*axis + 1));
  p.count = indices->numElements();
  if (p.size == 0 && p.count > 0)
    return std::nullopt; // every index is out of range: the CPU words it
  Shape shape(dataShape.begin(), dataShape.begin() + *axis);
  shape.insert(shape.end(), indices->shape().begin(), indices->shape().end());
  shape.insert(shape.end(), dataShape.begin() + *axis + 1, dataShape.end());
  PIPEC_TRY_ASSIGN(d, onDevice(*data));
  PIPEC_TRY_ASSIGN(idx, onDevice(*indices));
  PIPEC_TRY_ASSIGN(out, allocate(data->elemType(), shape));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchGather(
        elemBytes(out), indexType == DType::I32, p, d.rawData(), idx.rawData(), out.rawData(),
        checkSlot(
            n,
            formatv("an index is out of range for dimension {0} of size {1}", *axis, p.size).str()),
        stream));
  return Outputs{out};
}

Result CudaBackend::where(const NodeView &n) {
  const Tensor *cond = n.in(0), *x = n.in(1), *y = n.in(2);
  if (!cond || !x || !y || n.numOutputs() != 1 || cond->elemType() != DType::Bool ||
      x->elemType() != y->elemType())
    return std::nullopt;
  auto partial = cpu::broadcastShapes(cond->shape(), x->shape());
  if (!partial) {
    consumeError(partial.takeError());
    return std::nullopt;
  }
  auto shape = cpu::broadcastShapes(*partial, y->shape());
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  k::IndexMap map;
  if (!k::makeIndexMap(*shape,
                       {k::broadcastStrides(cond->shape(), *shape),
                        k::broadcastStrides(x->shape(), *shape),
                        k::broadcastStrides(y->shape(), *shape)},
                       map))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(c, onDevice(*cond));
  PIPEC_TRY_ASSIGN(a, onDevice(*x));
  PIPEC_TRY_ASSIGN(b, onDevice(*y));
  PIPEC_TRY_ASSIGN(out, allocate(x->elemType(), *shape));
  PIPEC_CUDA_TRY(launchWhere(elemBytes(out), map, static_cast<const bool *>(c.rawData()),
                             a.rawData(), b.rawData(), out.rawData(), out.numElements(), stream));
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Elementwise
//===----------------------------------------------------------------------===//

/// Cast between float, double, int64, int32 and bool. Half types are read
/// as the floats they are stored as; casts to them round and fall back.
Result CudaBackend::cast(const NodeView &n) {
  const Tensor *x = n.in(0);
  const auto *to = n.attr("to");
  if (!x || !to || n.numOutputs() != 1)
    return std::nullopt;
  auto toType = cpu::elemTypeFromOnnx(static_cast<int32_t>(to->i()));
  if (!toType) {
    consumeError(toType.takeError());
    return std::nullopt;
  }
  DType fromType = x->elemType();
  if (fromType == DType::F16 || fromType == DType::BF16)
    fromType = DType::F32;
  auto from = scalarOf(fromType), target = scalarOf(*toType);
  if (!from || !target)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(*toType, x->shape()));
  if (*from == *target) {
    if (out.byteSize() > 0)
      PIPEC_CUDA_TRY(cudaMemcpyAsync(out.rawData(), dev.rawData(), out.byteSize(),
                                     cudaMemcpyDeviceToDevice, stream));
  } else {
    PIPEC_CUDA_TRY(
        launchCast(*from, *target, dev.rawData(), out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

/// The element-wise rows of Ops.def: their math (ElementMath.h) by code.
Result CudaBackend::elementwise(const NodeView &n) {
  ElemOp op = *n.def->elem;
  return n.def->minInputs == 1 ? unary(n, op) : binary(n, op);
}

/// Unary float math on float32, and the logical rows (Not) on bool.
Result CudaBackend::unary(const NodeView &n, ElemOp op) {
  const Tensor *x = n.in(0);
  if (k::elemTypes(op) == k::ElemTypes::Logical) {
    if (!x || x->elemType() != DType::Bool || n.numOutputs() != 1)
      return std::nullopt;
    PIPEC_TRY_ASSIGN(dev, onDevice(*x));
    PIPEC_TRY_ASSIGN(out, allocate(DType::Bool, x->shape()));
    PIPEC_CUDA_TRY(launchLogicalUnary(op, static_cast<const bool *>(dev.rawData()),
                                      static_cast<bool *>(out.rawData()), out.numElements(),
                                      stream));
    return Outputs{out};
  }
  if (!isFloat(x) || n.numOutputs() != 1 || !k::isFloatMath(op))
    return std::nullopt;
  auto params = n.elemParams(op);
  if (!params) {
    // The CPU kernel words the error.
    consumeError(params.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, x->shape()));
  PIPEC_CUDA_TRY(launchUnary(op, *params, static_cast<const float *>(dev.rawData()),
                             static_cast<float *>(out.rawData()), out.numElements(), stream));
  return Outputs{out};
}

/// Arithmetic on float32, and on int64 for ops that never divide;
/// comparisons on any of the device types (bool for Equal), numpy
/// broadcasting. Logical ops run on the host.
Result CudaBackend::binary(const NodeView &n, ElemOp op) {
  const Tensor *a = n.in(0), *b = n.in(1);
  if (!a || !b || n.numOutputs() != 1 || a->elemType() != b->elemType())
    return std::nullopt;
  if (n.opset < 7 && n.attrInt("broadcast", 0))
    return std::nullopt;
  auto type = scalarOf(a->elemType());
  if (!type)
    return std::nullopt;
  bool comparison = k::isComparison(op);
  if (comparison) {
    if (*type == k::Scalar::Bool && k::elemTypes(op) != k::ElemTypes::CompareAny)
      return std::nullopt;
  } else if (!k::isFloatMath(op)) {
    return std::nullopt;
  } else if (*type != k::Scalar::F32 &&
             (*type != k::Scalar::I64 || k::elemTypes(op) == k::ElemTypes::Float ||
              k::elemDivides(op))) {
    return std::nullopt;
  }
  auto shape = cpu::broadcastShapes(a->shape(), b->shape());
  if (!shape) {
    consumeError(shape.takeError());
    return std::nullopt;
  }
  k::IndexMap map;
  if (!k::makeIndexMap(
          *shape,
          {k::broadcastStrides(a->shape(), *shape), k::broadcastStrides(b->shape(), *shape)}, map))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  PIPEC_TRY_ASSIGN(out, allocate(comparison ? DType::Bool : a->elemType(), *shape));
  PIPEC_CUDA_TRY(launchBinary(op, *type, map, da.rawData(), db.rawData(), out.rawData(),
                              out.numElements(), stream));
  return Outputs{out};
}

/// Sum of any number of float inputs, broadcast: added one at a time into
/// the output.
Result CudaBackend::variadicSum(const NodeView &n) {
  if (n.numInputs() == 0 || n.numOutputs() != 1)
    return std::nullopt;
  Shape shape;
  for (size_t i = 0; i < n.numInputs(); ++i) {
    const Tensor *t = n.in(i);
    if (!isFloat(t))
      return std::nullopt;
    auto next = cpu::broadcastShapes(i == 0 ? t->shape() : ArrayRef<int64_t>(shape), t->shape());
    if (!next) {
      consumeError(next.takeError());
      return std::nullopt;
    }
    shape = *next;
  }
  if (n.numInputs() == 1)
    return identity(n);
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, shape));
  PIPEC_TRY_ASSIGN(first, onDevice(*n.in(0)));
  for (size_t i = 1; i < n.numInputs(); ++i) {
    // The first addition reads input 0; the later ones read the output
    // itself, each element where it is written.
    const Tensor &left = i == 1 ? first : out;
    k::IndexMap map;
    if (!k::makeIndexMap(shape,
                         {k::broadcastStrides(left.shape(), shape),
                          k::broadcastStrides(n.in(i)->shape(), shape)},
                         map))
      return std::nullopt;
    PIPEC_TRY_ASSIGN(right, onDevice(*n.in(i)));
    PIPEC_CUDA_TRY(launchBinary(ElemOp::Add, k::Scalar::F32, map, left.rawData(), right.rawData(),
                                out.rawData(), out.numElements(), stream));
  }
  return Outputs{out};
}

} // namespace pipec::cuda
