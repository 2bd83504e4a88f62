//===- CudaMathOps.cpp - GEMMs, rows, reductions, gradients -----------------===//
//
// The CUDA backend's op methods over rows and products: MatMul and Gemm
// through cuBLAS, softmax and layer normalization, reductions and the
// cross-entropy loss, and pipec's gradient ops.
//
//===----------------------------------------------------------------------===//
#include "ops/Attention.h"
#include "runtime/core/AttentionBody.h"
#include "runtime/cuda/CudaOps.h"

using namespace llvm;

namespace pipec::cuda {

//===----------------------------------------------------------------------===//
// Matrix products
//===----------------------------------------------------------------------===//

/// MatMul with numpy semantics on cuBLAS: one GEMM when a single weight
/// matrix serves the whole batch, else a strided batch (a broadcast batch
/// operand is read with stride 0 or, for partial broadcasts, expanded).
Result CudaBackend::matMul(const NodeView &n) {
  const Tensor *a = n.in(0), *b = n.in(1);
  if (!isFloat(a) || !isFloat(b) || n.numOutputs() != 1 || a->rank() == 0 || b->rank() == 0)
    return std::nullopt;
  Shape aShape = a->shape(), bShape = b->shape();
  if (a->rank() == 1)
    aShape.insert(aShape.begin(), 1);
  if (b->rank() == 1)
    bShape.push_back(1);
  int64_t m = aShape[aShape.size() - 2], k = aShape.back(), nn = bShape.back();
  if (bShape[bShape.size() - 2] != k)
    return std::nullopt;
  Shape aBatch(aShape.begin(), aShape.end() - 2), bBatch(bShape.begin(), bShape.end() - 2);
  auto batch = cpu::broadcastShapes(aBatch, bBatch);
  if (!batch) {
    consumeError(batch.takeError());
    return std::nullopt;
  }
  Shape outShape = *batch, finalShape = *batch;
  outShape.push_back(m);
  outShape.push_back(nn);
  if (a->rank() > 1)
    finalShape.push_back(m);
  if (b->rank() > 1)
    finalShape.push_back(nn);
  int64_t count = product(*batch);
  bool folded = product(bBatch) == 1 && aBatch == *batch;
  if (!fitsInt(folded ? count * m : m) || !fitsInt(nn) || !fitsInt(k) || !fitsInt(count))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, outShape));
  if (out.numElements() == 0)
    return Outputs{out.reshaped(finalShape)};
  if (k == 0) {
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    return Outputs{out.reshaped(finalShape)};
  }
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  float *c = static_cast<float *>(out.rawData());
  if (folded) {
    if (Error err =
            gemm(false, false, count * m, nn, k, 1.0f, static_cast<const float *>(da.rawData()), k,
                 0, static_cast<const float *>(db.rawData()), nn, 0, 0.0f, c, nn, 0, 1))
      return err;
    return Outputs{out.reshaped(finalShape)};
  }
  // Each operand: its own batch (stride of one matrix), one matrix for all
  // (stride 0), or a partial broadcast expanded to the full batch.
  auto operand = [&](const Tensor &t, const Shape &tBatch, int64_t rows,
                     int64_t cols) -> Expected<std::optional<std::pair<Tensor, int64_t>>> {
    Shape padded(batch->size() - tBatch.size(), 1);
    padded.insert(padded.end(), tBatch.begin(), tBatch.end());
    if (padded == *batch)
      return std::optional<std::pair<Tensor, int64_t>>({t, rows * cols});
    if (product(tBatch) == 1)
      return std::optional<std::pair<Tensor, int64_t>>({t, 0});
    Shape full = *batch, own = tBatch;
    full.push_back(rows);
    full.push_back(cols);
    own.push_back(rows);
    own.push_back(cols);
    PIPEC_TRY_ASSIGN(expanded, broadcastTo(t.reshaped(own), full));
    if (!expanded)
      return std::optional<std::pair<Tensor, int64_t>>();
    return std::optional<std::pair<Tensor, int64_t>>({*expanded, rows * cols});
  };
  PIPEC_TRY_ASSIGN(left, operand(da, aBatch, m, k));
  PIPEC_TRY_ASSIGN(right, operand(db, bBatch, k, nn));
  if (!left || !right)
    return std::nullopt;
  if (Error err =
          gemm(false, false, m, nn, k, 1.0f, static_cast<const float *>(left->first.rawData()), k,
               left->second, static_cast<const float *>(right->first.rawData()), nn, right->second,
               0.0f, c, nn, m * nn, count))
    return err;
  return Outputs{out.reshaped(finalShape)};
}

/// Gemm: Y = alpha op(A) op(B) + beta C, C broadcast into Y first.
Result CudaBackend::gemmOp(const NodeView &n) {
  const Tensor *a = n.in(0), *b = n.in(1), *c = n.in(2);
  if (!isFloat(a) || !isFloat(b) || n.numOutputs() != 1 || a->rank() != 2 || b->rank() != 2)
    return std::nullopt;
  bool transA = n.attrInt("transA", 0), transB = n.attrInt("transB", 0);
  int64_t m = transA ? a->dim(1) : a->dim(0), k = transA ? a->dim(0) : a->dim(1);
  int64_t kb = transB ? b->dim(1) : b->dim(0), nn = transB ? b->dim(0) : b->dim(1);
  if (k != kb || k == 0 || !fitsInt(m) || !fitsInt(nn) || !fitsInt(k))
    return std::nullopt;
  Shape outShape{m, nn};
  if (c) {
    if (!isFloat(c))
      return std::nullopt;
    auto shape = cpu::broadcastShapes(c->shape(), outShape);
    if (!shape || *shape != outShape) {
      consumeError(shape.takeError());
      return std::nullopt;
    }
  }
  float alpha = n.attrFloat("alpha", 1.0f), beta = c ? n.attrFloat("beta", 1.0f) : 0.0f;
  Tensor y;
  if (c) {
    PIPEC_TRY_ASSIGN(dc, onDevice(*c));
    PIPEC_TRY_ASSIGN(done,
                     stridedCopy(dc, outShape, k::broadcastStrides(dc.shape(), outShape), 0, y));
    if (!done)
      return std::nullopt;
  } else {
    PIPEC_TRY_ASSIGN(fresh, allocate(DType::F32, outShape));
    y = fresh;
  }
  if (y.numElements() == 0)
    return Outputs{y};
  PIPEC_TRY_ASSIGN(da, onDevice(*a));
  PIPEC_TRY_ASSIGN(db, onDevice(*b));
  if (Error err = gemm(transA, transB, m, nn, k, alpha, static_cast<const float *>(da.rawData()),
                       a->dim(1), 0, static_cast<const float *>(db.rawData()), b->dim(1), 0, beta,
                       static_cast<float *>(y.rawData()), nn, 0, 1))
    return err;
  return Outputs{y};
}

//===----------------------------------------------------------------------===//
// Rows: softmax and layer normalization
//===----------------------------------------------------------------------===//

/// Softmax and LogSoftmax: along one axis from opset 13, over the flattened
/// trailing dimensions before.
Result CudaBackend::softmax(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || n.numOutputs() != 1 || x->rank() == 0)
    return std::nullopt;
  bool singleAxis = n.opset >= 13;
  auto axis = NodeView::axisIn(n.attrInt("axis", singleAxis ? -1 : 1), x->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> shape = x->shape();
  k::RowLayout layout{product(shape.take_front(*axis)), shape[*axis],
                      product(shape.drop_front(*axis + 1))};
  if (!singleAxis)
    layout = {layout.outer, layout.size * layout.inner, 1};
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, x->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchSoftmax(layout, static_cast<const float *>(dev.rawData()),
                                 static_cast<float *>(out.rawData()), n.is(OpId::LogSoftmax),
                                 stream));
  return Outputs{out};
}

/// LayerNormalization (stash_type float): Y, and Mean and InvStdDev when
/// the node has those outputs.
Result CudaBackend::layerNorm(const NodeView &n) {
  const Tensor *x = n.in(0), *scale = n.in(1), *bias = n.in(2);
  if (!isFloat(x) || !isFloat(scale) || (bias && !isFloat(bias)) || n.numOutputs() > 3)
    return std::nullopt;
  if (n.attrInt("stash_type", 1) != 1)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), x->rank());
  if (!axis)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  Shape normShape(x->shape().begin() + *axis, x->shape().end());
  int64_t rows = product(ArrayRef<int64_t>(x->shape()).take_front(*axis));
  int64_t size = product(normShape);
  // Scale and bias broadcast to the normalized shape.
  std::optional<Tensor> gamma, beta;
  for (const Tensor *t : {scale, bias}) {
    if (!t)
      continue;
    auto shape = cpu::broadcastShapes(t->shape(), normShape);
    if (!shape || *shape != normShape) {
      consumeError(shape.takeError());
      return std::nullopt;
    }
    PIPEC_TRY_ASSIGN(dev, onDevice(*t));
    PIPEC_TRY_ASSIGN(
        full, broadcastTo(dev.reshaped(t->numElements() == size ? ArrayRef<int64_t>(normShape)
                                                                : t->shape()),
                          normShape));
    if (!full)
      return std::nullopt;
    (t == scale ? gamma : beta) = *full;
  }
  PIPEC_TRY_ASSIGN(dx, onDevice(*x));
  PIPEC_TRY_ASSIGN(y, allocate(DType::F32, x->shape()));
  Shape statShape = x->shape();
  std::fill(statShape.begin() + *axis, statShape.end(), 1);
  Outputs outputs{y};
  for (size_t i = 1; i < n.numOutputs(); ++i) {
    PIPEC_TRY_ASSIGN(stat, allocate(DType::F32, statShape));
    outputs.push_back(stat);
  }
  auto statData = [&](size_t i) {
    return i < outputs.size() ? static_cast<float *>(outputs[i].rawData()) : nullptr;
  };
  if (rows > 0 && size > 0)
    PIPEC_CUDA_TRY(launchLayerNorm(rows, size, epsilon, static_cast<const float *>(dx.rawData()),
                                   static_cast<const float *>(gamma->rawData()),
                                   beta ? static_cast<const float *>(beta->rawData()) : nullptr,
                                   static_cast<float *>(y.rawData()), statData(1), statData(2),
                                   stream));
  return outputs;
}

//===----------------------------------------------------------------------===//
// Reductions and losses
//===----------------------------------------------------------------------===//

/// ReduceSum and ReduceMean on floats: axes from the input or attribute,
/// none meaning all (or nothing, with noop_with_empty_axes).
Result CudaBackend::reduce(const NodeView &n) {
  const Tensor *x = n.in(0);
  if (!isFloat(x) || n.numOutputs() != 1)
    return std::nullopt;
  PIPEC_TRY_ASSIGN(axes, intsFromInputOrAttr(n, 1, "axes"));
  bool keepDims = n.attrInt("keepdims", 1);
  int64_t rank = x->rank();
  if (!axes || axes->empty()) {
    if (n.attrInt("noop_with_empty_axes", 0))
      return identity(n);
    axes.emplace(rank);
    std::iota(axes->begin(), axes->end(), 0);
  }
  std::vector<bool> reduced(rank, false);
  for (int64_t a : *axes) {
    auto axis = NodeView::axisIn(a, rank);
    if (!axis)
      return std::nullopt;
    reduced[*axis] = true;
  }
  Shape outShape;
  int64_t count = 1;
  for (int64_t i = 0; i < rank; ++i) {
    if (reduced[i])
      count *= x->dim(i);
    if (!reduced[i])
      outShape.push_back(x->dim(i));
    else if (keepDims)
      outShape.push_back(1);
  }
  // A mean over no elements is 0 / 0, NaN.
  double divisor = n.is(OpId::ReduceMean) ? static_cast<double>(count) : 1.0;
  PIPEC_TRY_ASSIGN(dev, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, outShape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, divisor, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

namespace {

/// The labels of a cross-entropy over \p scores [N, C, d...]: int64 of
/// [N, d...] (exact shape or, for the gradient, element count).
bool labelsFit(const Tensor &scores, const Tensor &labels, bool exactShape) {
  if (labels.elemType() != DType::I64)
    return false;
  Shape shape{scores.dim(0)};
  shape.insert(shape.end(), scores.shape().begin() + 2, scores.shape().end());
  return exactShape ? labels.shape() == shape : labels.numElements() == product(shape);
}

} // namespace

Result CudaBackend::crossEntropy(const NodeView &n) {
  const Tensor *scores = n.in(0), *labels = n.in(1);
  if (!isFloat(scores) || !labels || n.in(2) || n.numOutputs() > 2 || scores->rank() < 2 ||
      !labelsFit(*scores, *labels, true))
    return std::nullopt;
  std::string reductionName = n.attrString("reduction", "mean");
  k::CrossEntropyParams p;
  if (reductionName == "none")
    p.reduction = 0;
  else if (reductionName == "sum")
    p.reduction = 1;
  else if (reductionName == "mean")
    p.reduction = 2;
  else
    return std::nullopt;
  if (const auto *ignore = n.attr("ignore_index")) {
    p.hasIgnore = true;
    p.ignoreIndex = ignore->i();
  }
  ArrayRef<int64_t> shape = scores->shape();
  k::RowLayout layout{shape[0], shape[1], product(shape.drop_front(2))};
  int64_t positions = k::rowCount(layout);
  if (positions > 0 && layout.size == 0)
    return std::nullopt; // every label is out of range: the CPU words it
  PIPEC_TRY_ASSIGN(s, onDevice(*scores));
  PIPEC_TRY_ASSIGN(l, onDevice(*labels));
  PIPEC_TRY_ASSIGN(losses, allocate(DType::F32, labels->shape()));
  PIPEC_TRY_ASSIGN(valid, scratch(static_cast<size_t>(positions) * sizeof(float)));
  Tensor loss = losses;
  if (p.reduction != 0) {
    PIPEC_TRY_ASSIGN(scalar, allocate(DType::F32, {}));
    loss = scalar;
  }
  Outputs outputs{loss};
  float *logProb = nullptr;
  if (n.numOutputs() == 2) {
    PIPEC_TRY_ASSIGN(lp, allocate(DType::F32, scores->shape()));
    outputs.push_back(lp);
    logProb = static_cast<float *>(lp.rawData());
  }
  if (positions == 0) {
    // No labels: the sum is 0 and the mean 0 / 0.
    if (p.reduction != 0)
      PIPEC_CUDA_TRY(launchFill(4, p.reduction == 2 ? 0x7fc00000u : 0u, loss.rawData(), 1, stream));
    return outputs;
  }
  PIPEC_CUDA_TRY(launchCrossEntropy(
      layout, p, static_cast<const float *>(s.rawData()), static_cast<const int64_t *>(l.rawData()),
      logProb, static_cast<float *>(losses.rawData()), static_cast<float *>(valid.get()),
      static_cast<float *>(loss.rawData()),
      checkSlot(n, formatv("a label is out of range for {0} classes", layout.size).str()), stream));
  return outputs;
}

//===----------------------------------------------------------------------===//
// Gradient ops of domain pipec
//===----------------------------------------------------------------------===//

Result CudaBackend::sumTo(const NodeView &n) {
  const Tensor *dy = n.in(0);
  std::optional<Shape> shape = n.attrInts("shape");
  if (!isFloat(dy) || !shape || n.numOutputs() != 1 ||
      shape->size() > static_cast<size_t>(dy->rank()))
    return std::nullopt;
  auto b = cpu::broadcastShapes(*shape, dy->shape());
  if (!b || *b != dy->shape()) {
    consumeError(b.takeError());
    return std::nullopt;
  }
  if (*shape == dy->shape())
    return identity(n);
  size_t lead = dy->shape().size() - shape->size();
  std::vector<bool> reduced(dy->rank());
  for (int64_t d = 0; d < dy->rank(); ++d) {
    int64_t target = static_cast<size_t>(d) < lead ? 1 : (*shape)[d - lead];
    reduced[d] = target == 1 && dy->dim(d) != 1;
  }
  PIPEC_TRY_ASSIGN(dev, onDevice(*dy));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, *shape));
  PIPEC_TRY_ASSIGN(done, reduceInto(dev, reduced, 1.0, out));
  if (!done)
    return std::nullopt;
  return Outputs{out};
}

/// UnaryGrad: dY times the derivative of the op it names (ElementMath.h).
Result CudaBackend::unaryGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *a = n.in(1);
  if (!isFloat(dy) || !isFloat(a) || dy->shape() != a->shape() || n.numOutputs() != 1)
    return std::nullopt;
  std::string name = n.attrString("op", "");
  const OpDef *forward = lookupOp("", name);
  if (!forward || !forward->elem || forward->minInputs != 1)
    return std::nullopt;
  auto params = n.elemParams(*forward->elem);
  if (!params) {
    consumeError(params.takeError());
    return std::nullopt;
  }
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(x, onDevice(*a));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, dy->shape()));
  PIPEC_CUDA_TRY(launchGradient(*forward->elem, *params, static_cast<const float *>(d.rawData()),
                                static_cast<const float *>(x.rawData()),
                                static_cast<float *>(out.rawData()), out.numElements(), stream));
  return Outputs{out};
}

/// The body of a fused node (runtime/core/FusedProgram.h) node by node on this
/// backend: for inputs its kernel does not take.
Result CudaBackend::runBody(const NodeView &n) {
  auto outputs = runFusedBody(n.node, n.allInputs(),
                              [&](const onnx::NodeProto &step, ArrayRef<const Tensor *> in) {
                                return dispatch(NodeView(step, n.opset, in, device));
                              });
  if (!outputs)
    return outputs.takeError();
  return std::move(*outputs);
}

Result CudaBackend::runAttentionBody(const NodeView &n) {
  ArrayRef<const Tensor *> inputs = n.allInputs();
  size_t q = n.node.op_type() == attention::GradOpType ? size_t(attention::GradQuery)
                                                       : size_t(attention::Query);
  if (q >= inputs.size() || !inputs[q])
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): no Q",
                             n.node.name().c_str(), n.node.op_type().c_str());
  auto body = attentionBody(n.node, inputs[q]->rank(), n.opset);
  if (!body)
    return body.takeError();
  auto outputs = runBodyGraph(*body, n.node, inputs,
                              [&](const onnx::NodeProto &step, ArrayRef<const Tensor *> in) {
                                return dispatch(NodeView(step, n.opset, in, device));
                              });
  if (!outputs)
    return outputs.takeError();
  return std::move(*outputs);
}

/// A fused element-wise node (runtime/core/FusedProgram.h) as one kernel; its body
/// node by node on this backend when the kernel does not take the inputs
/// (not all float32, or an output smaller than the others).
Result CudaBackend::fused(const NodeView &n) {
  auto kernel = compileFused(n.node, n.opset);
  if (!kernel)
    return kernel.takeError();
  ArrayRef<const Tensor *> inputs = n.allInputs();
  std::optional<Shape> shape = fusedShape(*kernel, inputs);
  k::FusedMap map;
  if (!shape || !makeFusedMap(*shape, inputs, map))
    return runBody(n);
  const k::FusedProgram &p = kernel->program;
  std::vector<Tensor> devices;
  const float *in[k::MaxFusedInputs] = {};
  for (int i = 0; i < p.inputs; ++i) {
    PIPEC_TRY_ASSIGN(d, onDevice(*inputs[i]));
    devices.push_back(d);
    in[i] = static_cast<const float *>(devices.back().rawData());
  }
  Outputs outputs;
  float *out[k::MaxFusedOutputs] = {};
  for (int o = 0; o < p.outputs; ++o) {
    PIPEC_TRY_ASSIGN(t, allocate(DType::F32, *shape));
    outputs.push_back(t);
    out[o] = static_cast<float *>(outputs.back().rawData());
  }
  int64_t count = product(*shape);
  if (count > 0)
    PIPEC_CUDA_TRY(launchFused(p, map, in, out, count, stream));
  return outputs;
}

/// A MatMul and its bias Add (runtime/core/FusedProgram.h) as one cuBLASLt GEMM with
/// a bias epilogue; the two nodes as they are for other shapes or types,
/// or when cuBLASLt has no algorithm.
Result CudaBackend::matMulBias(const NodeView &n) {
  ArrayRef<const Tensor *> inputs = n.allInputs();
  std::optional<int64_t> nn = epilogueBias(n.node, inputs);
  if (!nn)
    return runBody(n);
  const Tensor &a = *inputs[0];
  int64_t k = a.dim(-1), m = a.numElements() / std::max<int64_t>(k, 1);
  if (m == 0 || k == 0 || *nn == 0 || !fitsInt(m) || !fitsInt(k) || !fitsInt(*nn))
    return runBody(n);
  Shape shape = a.shape();
  shape.back() = *nn;
  PIPEC_TRY_ASSIGN(da, onDevice(a));
  PIPEC_TRY_ASSIGN(db, onDevice(*inputs[1]));
  PIPEC_TRY_ASSIGN(dbias, onDevice(*inputs[2]));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, shape));
  PIPEC_TRY_ASSIGN(done, gemmBias(m, *nn, k, static_cast<const float *>(da.rawData()),
                                  static_cast<const float *>(db.rawData()),
                                  static_cast<const float *>(dbias.rawData()),
                                  static_cast<float *>(out.rawData())));
  if (!done)
    return runBody(n);
  return Outputs{out};
}

Result CudaBackend::softmaxGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *y = n.in(1);
  if (!isFloat(dy) || !isFloat(y) || dy->shape() != y->shape() || n.numOutputs() != 1 ||
      y->rank() == 0)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), y->rank());
  if (!axis)
    return std::nullopt;
  ArrayRef<int64_t> shape = y->shape();
  k::RowLayout layout{product(shape.take_front(*axis)), shape[*axis],
                      product(shape.drop_front(*axis + 1))};
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(yy, onDevice(*y));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, y->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchSoftmaxGrad(layout, static_cast<const float *>(d.rawData()),
                                     static_cast<const float *>(yy.rawData()),
                                     static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::gatherGrad(const NodeView &n) {
  const Tensor *dy = n.in(0), *indices = n.in(1);
  std::optional<Shape> shape = n.attrInts("shape");
  if (!isFloat(dy) || !indices || !shape || shape->empty() || n.numOutputs() != 1)
    return std::nullopt;
  DType indexType = indices->elemType();
  if (indexType != DType::I64 && indexType != DType::I32)
    return std::nullopt;
  auto axis = NodeView::axisIn(n.attrInt("axis", 0), static_cast<int64_t>(shape->size()));
  if (!axis || llvm::any_of(*shape, [](int64_t d) { return d < 0; }))
    return std::nullopt;
  k::GatherParams p;
  p.outer = product(ArrayRef<int64_t>(*shape).take_front(*axis));
  p.size = (*shape)[*axis];
  p.inner = product(ArrayRef<int64_t>(*shape).drop_front(*axis + 1));
  p.count = indices->numElements();
  if (dy->numElements() != p.outer * p.count * p.inner || (p.size == 0 && p.count > 0))
    return std::nullopt;
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(idx, onDevice(*indices));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, *shape));
  if (out.byteSize() > 0)
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
  if (dy->numElements() > 0)
    PIPEC_CUDA_TRY(launchGatherGrad(
        indexType == DType::I32, p, static_cast<const float *>(d.rawData()), idx.rawData(),
        static_cast<float *>(out.rawData()),
        checkSlot(n, formatv("an index is out of range [0, {0})", p.size).str()), stream));
  return Outputs{out};
}

namespace {

/// The rows of a LayerNorm gradient: [rows, width] split at the axis.
std::optional<std::pair<int64_t, int64_t>> layerNormRows(const NodeView &n, const Tensor &x) {
  auto axis = NodeView::axisIn(n.attrInt("axis", -1), x.rank());
  if (!axis)
    return std::nullopt;
  return std::make_pair(product(ArrayRef<int64_t>(x.shape()).take_front(*axis)),
                        product(ArrayRef<int64_t>(x.shape()).drop_front(*axis)));
}

} // namespace

Result CudaBackend::layerNormGradInput(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1), *scale = n.in(2);
  if (!isFloat(dy) || !isFloat(x) || !isFloat(scale) || dy->shape() != x->shape() ||
      n.numOutputs() != 1)
    return std::nullopt;
  auto rows = layerNormRows(n, *x);
  if (!rows || scale->numElements() != rows->second)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xx, onDevice(*x));
  PIPEC_TRY_ASSIGN(s, onDevice(*scale));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, x->shape()));
  if (out.numElements() > 0)
    PIPEC_CUDA_TRY(launchLayerNormGradInput(
        rows->first, rows->second, epsilon, static_cast<const float *>(d.rawData()),
        static_cast<const float *>(xx.rawData()), static_cast<const float *>(s.rawData()),
        static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::layerNormGradWeight(const NodeView &n) {
  const Tensor *dy = n.in(0), *x = n.in(1);
  if (!isFloat(dy) || !isFloat(x) || dy->shape() != x->shape() || n.numOutputs() != 1)
    return std::nullopt;
  auto rows = layerNormRows(n, *x);
  if (!rows)
    return std::nullopt;
  auto [count, width] = *rows;
  Shape shape = n.attrInts("shape").value_or(Shape{width});
  if (product(shape) != width)
    return std::nullopt;
  float epsilon = n.attrFloat("epsilon", 1e-5f);
  PIPEC_TRY_ASSIGN(d, onDevice(*dy));
  PIPEC_TRY_ASSIGN(xx, onDevice(*x));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, shape));
  if (width == 0)
    return Outputs{out};
  if (count == 0) {
    PIPEC_CUDA_TRY(cudaMemsetAsync(out.rawData(), 0, out.byteSize(), stream));
    return Outputs{out};
  }
  int64_t chunks = layerNormGradWeightChunks(count, width);
  PIPEC_TRY_ASSIGN(stats, scratch(2 * static_cast<size_t>(count) * sizeof(float)));
  PIPEC_TRY_ASSIGN(partial, scratch(static_cast<size_t>(width * chunks) * sizeof(double)));
  float *mean = static_cast<float *>(stats.get());
  PIPEC_CUDA_TRY(launchLayerNormGradWeight(
      count, width, epsilon, static_cast<const float *>(d.rawData()),
      static_cast<const float *>(xx.rawData()), mean, mean + count,
      static_cast<double *>(partial.get()), chunks, static_cast<float *>(out.rawData()), stream));
  return Outputs{out};
}

Result CudaBackend::crossEntropyGrad(const NodeView &n) {
  const Tensor *dLoss = n.in(0), *scores = n.in(1), *labels = n.in(2);
  if (!isFloat(dLoss) || !isFloat(scores) || !labels || dLoss->numElements() != 1 ||
      scores->rank() < 2 || !labelsFit(*scores, *labels, false) || n.numOutputs() != 1)
    return std::nullopt;
  k::CrossEntropyParams p;
  p.reduction = n.attrString("reduction", "mean") == "sum" ? 1 : 2;
  if (const auto *ignore = n.attr("ignore_index")) {
    p.hasIgnore = true;
    p.ignoreIndex = ignore->i();
  }
  ArrayRef<int64_t> shape = scores->shape();
  k::RowLayout layout{shape[0], shape[1], product(shape.drop_front(2))};
  PIPEC_TRY_ASSIGN(dl, onDevice(*dLoss));
  PIPEC_TRY_ASSIGN(s, onDevice(*scores));
  PIPEC_TRY_ASSIGN(l, onDevice(*labels));
  PIPEC_TRY_ASSIGN(out, allocate(DType::F32, scores->shape()));
  if (out.numElements() == 0)
    return Outputs{out};
  PIPEC_TRY_ASSIGN(count, scratch(sizeof(double)));
  PIPEC_CUDA_TRY(launchCrossEntropyGrad(
      layout, p, static_cast<const float *>(dl.rawData()), static_cast<const float *>(s.rawData()),
      static_cast<const int64_t *>(l.rawData()), static_cast<double *>(count.get()),
      static_cast<float *>(out.rawData()),
      checkSlot(n, formatv("a label is out of range [0, {0})", layout.size).str()), stream));
  return Outputs{out};
}

} // namespace pipec::cuda
