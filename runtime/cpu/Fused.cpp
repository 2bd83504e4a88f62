//===- Fused.cpp - The CPU kernels of fused element-wise nodes ------------===//
//
// A fused node runs in blocks of elements, one step at a time over a block,
// so that each step's loop is tight (its op fixed at compile time, one
// instantiation per element-wise row of ops/Ops.def) and the block stays in
// L1. MatMulBias is the MatMul's GEMM and then the bias added in place;
// MatMulTransposed one GEMM that reads its weight transposed.
//
//===----------------------------------------------------------------------===//
#include "ops/OpRegistry.h"
#include "ops/Reshape.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "support/Attributes.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

using namespace llvm;

namespace pipec::cpu {

namespace k = kernels;

namespace {

/// d = op(a, b) over a block of n elements, the op's math fixed at compile
/// time.
template <typename M, int Arity>
PIPEC_VECTOR_CLONES void valueBlock(float *__restrict__ d, const float *__restrict__ a,
                                    const float *__restrict__ b, int64_t n,
                                    const k::ElemParams &p) {
  if constexpr (std::is_same_v<M, k::elem::Pow>) {
    // A constant exponent of 2 or 3 (GELU's cube) is a product; the math's
    // test per element would keep the loop from vectorising.
    int64_t twos = 0, threes = 0; // counts, so that the scan vectorises
    for (int64_t j = 0; j < n; ++j) {
      twos += b[j] == 2.0f;
      threes += b[j] == 3.0f;
    }
    bool square = twos == n, cube = threes == n;
    if (square || cube) {
      for (int64_t j = 0; j < n; ++j)
        d[j] = square ? a[j] * a[j] : a[j] * a[j] * a[j];
      return;
    }
  }
  for (int64_t j = 0; j < n; ++j)
    d[j] = k::detail::value<M, Arity>(a[j], b[j], p);
}

/// d = a * derivative(b) over a block: a gradient step of unary op M.
template <typename M, int Arity>
PIPEC_VECTOR_CLONES void gradientBlock(float *__restrict__ d, const float *__restrict__ a,
                                       const float *__restrict__ b, int64_t n,
                                       const k::ElemParams &p) {
  for (int64_t j = 0; j < n; ++j)
    d[j] = a[j] * static_cast<float>(k::detail::derivative<M, Arity>(static_cast<double>(b[j]), p));
}

void runStep(const k::FusedOp &s, float *d, const float *a, const float *b, int64_t n) {
  switch (s.op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return s.gradient ? gradientBlock<k::elem::ID, ARITY>(d, a, b, n, s.params)                    \
                      : valueBlock<k::elem::ID, ARITY>(d, a, b, n, s.params);
#include "ops/Ops.def"
  }
}

/// out[j] = data[offset of element start + j of operand k], j < n: the
/// offset computed once, then stepped along the innermost dimension with a
/// carry, instead of a division per element.
void gather(const k::FusedMap &map, int k, const float *data, int64_t start, int64_t n,
            float *out) {
  if (map.rank == 0) {
    std::fill_n(out, n, data[map.base[k]]);
    return;
  }
  int64_t index[k::MaxRank];
  int64_t rest = start;
  for (int d = map.rank - 1; d > 0; --d) {
    index[d] = rest % map.shape[d];
    rest /= map.shape[d];
  }
  index[0] = rest;
  int64_t offset = k::offsetOf(map, k, start);
  int inner = map.rank - 1;
  const int64_t *strides = map.strides[k];
  for (int64_t j = 0; j < n; ++j) {
    out[j] = data[offset];
    offset += strides[inner];
    if (++index[inner] < map.shape[inner])
      continue;
    for (int d = inner; d > 0 && index[d] == map.shape[d]; --d) {
      offset += strides[d - 1] - index[d] * strides[d];
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

/// The registers of a tanh-approximated GELU, as GPT-2 and torch's
/// exporters write it out in eight nodes:
///   y = (x * half) * (tanh((x + x^3 * cube) * inner) + one)
/// with x the one input read whole and the rest scalar constants. Matched
/// by the program's structure (Add and Mul either way round), whatever the
/// constants' values, except Pow's exponent, which must be 3.
struct GeluTanh {
  int x = -1;
  float half = 0, cube = 0, inner = 0, one = 0;
};

/// Matches program \p p against the GELU's expression tree; input r is a
/// scalar constant of value scalar[r] when isScalar[r].
class GeluMatcher {
public:
  GeluMatcher(const k::FusedProgram &p, ArrayRef<bool> isScalar, ArrayRef<float> scalar)
      : p(p), isScalar(isScalar), scalar(scalar) {}

  /// The GELU's registers and constants, or nullopt when \p p is another
  /// program.

  std::optional<GeluTanh> match() {
    if (p.outputs != 1 || p.ops != 8)
      return std::nullopt;
    GeluTanh g;
    // y = Mul(Mul(x, half), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), cube)), inner)), one))
    bool ok = binary(p.outputRegister[0], ElemOp::Mul, g, [&](int l, int r, GeluTanh &b) {
      return binary(l, ElemOp::Mul, b,
                    [&](int x, int c, GeluTanh &b2) {
                      return input(x, b2) && constant(c, b2.half);
                    }) &&
             binary(r, ElemOp::Add, b, [&](int t, int c, GeluTanh &b2) {
               return constant(c, b2.one) && tanhOf(t, b2);
             });
    });
    return ok ? std::optional<GeluTanh>(g) : std::nullopt;
  }

private:
  const k::FusedProgram &p;
  ArrayRef<bool> isScalar;
  ArrayRef<float> scalar;

  const k::FusedOp *stepOf(int reg, ElemOp op) const {
    if (reg < p.inputs)
      return nullptr;
    const k::FusedOp &s = p.code[reg - p.inputs];
    return s.op == op && !s.gradient ? &s : nullptr;
  }
  bool input(int reg, GeluTanh &g) const {
    if (reg >= p.inputs || isScalar[reg] || (g.x >= 0 && g.x != reg))
      return false;
    g.x = reg;
    return true;
  }
  bool constant(int reg, float &value) const {
    if (reg >= p.inputs || !isScalar[reg])
      return false;
    value = scalar[reg];
    return true;
  }
  /// Register \p reg is op(l, r) or, op commuting, op(r, l), with
  /// sides(l, r, g) true; g keeps the bindings of the order that matched.
  template <typename Sides> bool binary(int reg, ElemOp op, GeluTanh &g, Sides sides) const {
    const k::FusedOp *s = stepOf(reg, op);
    if (!s)
      return false;
    for (auto [l, r] : {std::pair{s->a, s->b}, std::pair{s->b, s->a}}) {
      GeluTanh tried = g;
      if (sides(l, r, tried)) {
        g = tried;
        return true;
      }
    }
    return false;
  }
  bool tanhOf(int reg, GeluTanh &g) const {
    const k::FusedOp *t = stepOf(reg, ElemOp::Tanh);
    return t && binary(t->a, ElemOp::Mul, g, [&](int sum, int c, GeluTanh &b) {
             return constant(c, b.inner) &&
                    binary(sum, ElemOp::Add, b, [&](int x, int q, GeluTanh &b2) {
                      return input(x, b2) &&
                             binary(q, ElemOp::Mul, b2, [&](int pw, int c2, GeluTanh &b3) {
                               const k::FusedOp *pow = stepOf(pw, ElemOp::Pow);
                               float three;
                               return constant(c2, b3.cube) && pow && input(pow->a, b3) &&
                                      constant(pow->b, three) && three == 3.0f;
                             });
                    });
           });
  }
};

/// The GELU over a block, each op as its own step computes it (Mul and Add
/// commute exactly; Pow's cube is (x x) x, as Pow computes it), in one loop
/// that keeps every intermediate in registers.
PIPEC_VECTOR_CLONES void geluTanhBlock(float *__restrict__ d, const float *__restrict__ x,
                                       int64_t n, float half, float cube, float inner, float one) {
  const k::ElemParams none;
  for (int64_t j = 0; j < n; ++j) {
    float v = x[j];
    float cubed = k::elem::Pow::value(v, 3.0f);
    float u = (v + cubed * cube) * inner;
    d[j] = (v * half) * (k::detail::value<k::elem::Tanh, 1>(u, 0.0f, none) + one);
  }
}

/// runFusedBody on the CPU kernels.
Expected<std::vector<Tensor>> runBodyOnCpu(const onnx::NodeProto &node, int64_t opset,
                                           ArrayRef<const Tensor *> inputs) {
  return runFusedBody(node, inputs, [&](const onnx::NodeProto &step, ArrayRef<const Tensor *> in) {
    return runOp(step, opset, in);
  });
}

} // namespace

KernelResult fused(const OpContext &ctx) {
  const onnx::NodeProto &node = ctx.node;
  int64_t opset = ctx.opset;
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  auto kernel = compileFused(node, opset);
  if (!kernel)
    return kernel.takeError();
  std::optional<std::vector<int64_t>> shape = fusedShape(*kernel, inputs);
  k::FusedMap map;
  if (!shape || !makeFusedMap(*shape, inputs, map))
    return runBodyOnCpu(node, opset, inputs);
  const k::FusedProgram &p = kernel->program;
  std::vector<Tensor> outputs;
  for (int o = 0; o < p.outputs; ++o)
    outputs.push_back(Tensor::uninitialized(DType::F32, *shape)); // every block is written
  int64_t total = numElementsOf(*shape);
  // An input read at consecutive offsets over the whole output is used in
  // place; any other (broadcast) one is gathered into its register block.
  // A single element (a scalar constant) fills its block once.
  enum class Read { InPlace, Scalar, Gather };
  std::vector<Read> reads;
  for (const Tensor *t : inputs)
    reads.push_back(t->shape() == *shape    ? Read::InPlace
                    : t->numElements() == 1 ? Read::Scalar
                                            : Read::Gather);
  // A tanh GELU of an input read whole runs as one loop (the same bits as
  // its steps).
  bool isScalar[k::MaxFusedInputs] = {};
  float scalars[k::MaxFusedInputs] = {};
  for (int i = 0; i < p.inputs; ++i)
    if (reads[i] == Read::Scalar) {
      isScalar[i] = true;
      scalars[i] = inputs[i]->data<float>()[0];
    }
  std::optional<GeluTanh> gelu =
      GeluMatcher(p, ArrayRef<bool>(isScalar, p.inputs), ArrayRef<float>(scalars, p.inputs))
          .match();
  if (gelu && reads[gelu->x] == Read::InPlace) {
    const float *x = inputs[gelu->x]->data<float>();
    float *y = outputs[0].data<float>();
    parallelFor(total, 4096, [&](int64_t begin, int64_t end) {
      geluTanhBlock(y + begin, x + begin, end - begin, gelu->half, gelu->cube, gelu->inner,
                    gelu->one);
    });
    return outputs;
  }
  // Blocks are independent: the rank's loop threads take runs of them.
  constexpr int64_t blockSize = 256;
  int64_t blocks = (total + blockSize - 1) / blockSize;
  parallelFor(blocks, 16, [&](int64_t firstBlock, int64_t endBlock) {
    alignas(64) float scratch[k::MaxFusedRegisters][blockSize];
    const float *src[k::MaxFusedRegisters] = {};
    float *dst[k::MaxFusedRegisters] = {};
    for (int64_t start = firstBlock * blockSize; start < std::min(total, endBlock * blockSize);
         start += blockSize) {
      int64_t n = std::min(blockSize, total - start);
      for (int i = 0; i < p.inputs; ++i) {
        const float *data = inputs[i]->data<float>();
        src[i] = scratch[i];
        if (reads[i] == Read::InPlace)
          src[i] = data + start;
        else if (reads[i] == Read::Scalar && start == firstBlock * blockSize)
          std::fill_n(scratch[i], blockSize, data[0]);
        else if (reads[i] == Read::Gather)
          gather(map, i, data, start, n, scratch[i]);
      }
      // A step that makes an output writes it straight into the output.
      for (int s = 0; s < p.ops; ++s)
        dst[p.inputs + s] = scratch[p.inputs + s];
      for (int o = 0; o < p.outputs; ++o)
        dst[p.outputRegister[o]] = outputs[o].data<float>() + start;
      for (int s = 0; s < p.ops; ++s) {
        const k::FusedOp &step = p.code[s];
        int r = p.inputs + s;
        runStep(step, dst[r], src[step.a], src[step.b], n);
        src[r] = dst[r];
      }
      // Two outputs of one register: the second is a copy.
      for (int o = 0; o < p.outputs; ++o)
        if (outputs[o].data<float>() + start != src[p.outputRegister[o]])
          std::memcpy(outputs[o].data<float>() + start, src[p.outputRegister[o]],
                      n * sizeof(float));
    }
  });
  return outputs;
}

KernelResult matMulBias(const OpContext &ctx) {
  const onnx::NodeProto &node = ctx.node;
  int64_t opset = ctx.opset;
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  std::optional<int64_t> n = epilogueBias(node, inputs);
  if (!n)
    return runBodyOnCpu(node, opset, inputs);
  auto product = runOp(fusedBodyOf(node)->node(0), opset, {inputs[0], inputs[1]});
  if (!product)
    return product.takeError();
  // Float addition commutes exactly: the same bits as the Add, either way
  // round.
  Tensor &y = product->front();
  float *out = y.data<float>();
  const float *bias = inputs[2]->data<float>();
  for (int64_t row = 0, rows = y.numElements() / std::max<int64_t>(*n, 1); row < rows; ++row)
    for (int64_t j = 0; j < *n; ++j)
      out[row * *n + j] += bias[j];
  return std::move(*product);
}

namespace {

/// The Reshape step of \p steps whose target is the fused node's value
/// \p shapeName, or null.
const onnx::NodeProto *reshapeTo(const onnx::GraphProto &steps, const std::string &shapeName) {
  for (const onnx::NodeProto &step : steps.node())
    if (isOp(step, OpId::Reshape) && step.input_size() == 2 && step.input(1) == shapeName)
      return &step;
  return nullptr;
}

/// \p in reshaped as \p step asks for \p requested (an int64 tensor); empty
/// when it cannot be.
std::vector<int64_t> reshaped(ArrayRef<int64_t> in, const Tensor *requested,
                              const onnx::NodeProto *step) {
  if (!requested || !step || requested->elemType() != DType::I64)
    return {};
  Expected<std::vector<int64_t>> out =
      reshapeTarget(in, ArrayRef<int64_t>(requested->data<int64_t>(), requested->numElements()),
                    attrInt(*step, "allowzero", 0) != 0, "");
  if (!out) {
    consumeError(out.takeError());
    return {};
  }
  return *out;
}

/// The shape the key chain (Fusion.cpp: Reshape to AttentionKeyMerged,
/// Transpose of the last two axes, Reshape to AttentionKeySplit) makes of keys of
/// \p shape [.., n, k], when it is [.., k, n] (their last two axes
/// swapped); empty otherwise.
std::vector<int64_t> keyChainShape(const OpContext &ctx, const onnx::GraphProto &steps,
                                   ArrayRef<int64_t> shape) {
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  int64_t rank = static_cast<int64_t>(shape.size());
  std::vector<int64_t> three = reshaped(shape, inputs[AttentionKeyMerged],
                                        reshapeTo(steps, ctx.node.input(AttentionKeyMerged)));
  if (three.size() != 3 || three[1] != shape[rank - 2] || three[2] != shape[rank - 1])
    return {};
  std::vector<int64_t> want(shape.begin(), shape.end());
  std::swap(want[rank - 2], want[rank - 1]);
  if (reshaped({three[0], three[2], three[1]}, inputs[AttentionKeySplit],
               reshapeTo(steps, ctx.node.input(AttentionKeySplit))) != want)
    return {};
  return want;
}

/// How many heads share each head of \p shape [.., heads, t, d] after the
/// grouped-query repeat whose values are the fused node's inputs from
/// \p first (AttentionKeyAxes or AttentionValueAxes: the Unsqueeze's axes,
/// then the Expand's shape and the Reshape's target): an Unsqueeze before the last two axes, an
/// Expand of that axis alone, a Reshape merging it into the heads. 0 when it is not that.
int64_t repeatOf(const OpContext &ctx, const onnx::GraphProto &steps, ArrayRef<int64_t> shape,
                 size_t first) {
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  const Tensor *axes = inputs[first], *expand = inputs[first + 1];
  int64_t rank = static_cast<int64_t>(shape.size());
  if (!axes || !expand || axes->elemType() != DType::I64 || axes->numElements() != 1 ||
      expand->elemType() != DType::I64 || expand->numElements() != rank + 1)
    return 0;
  int64_t axis = axes->data<int64_t>()[0];
  if ((axis < 0 ? axis + rank + 1 : axis) != rank - 2)
    return 0;
  // The unsqueezed [.., heads, 1, t, d] expanded: every axis but the new one
  // kept (1 or its own size), the new one to the repeat.
  const int64_t *e = expand->data<int64_t>();
  std::vector<int64_t> wide(shape.begin(), shape.end());
  wide.insert(wide.begin() + (rank - 2), e[rank - 2]);
  for (int64_t i = 0; i <= rank; ++i)
    if (i != rank - 2 && e[i] != 1 && e[i] != wide[i])
      return 0;
  int64_t repeat = wide[rank - 2];
  std::vector<int64_t> want(shape.begin(), shape.end());
  want[rank - 3] *= repeat;
  if (repeat < 1 ||
      reshaped(wide, inputs[first + 2], reshapeTo(steps, ctx.node.input(first + 2))) != want)
    return 0;
  return repeat;
}

/// The shape of Concat(\p past, \p appended) on the axis before the last
/// (Fusion.cpp's cache Concat, the step of \p steps that reads the fused
/// node's value \p name second); empty when that step joins on another
/// axis or the two do not join.
Shape appendedShape(const onnx::GraphProto &steps, const Tensor &past, const Tensor &appended,
                    const std::string &name) {
  const onnx::NodeProto *concat = nullptr;
  for (const onnx::NodeProto &step : steps.node())
    if (isOp(step, OpId::Concat) && step.input_size() == 2 && step.input(1) == name)
      concat = &step;
  int64_t rank = past.rank();
  if (!concat || appended.rank() != rank || appended.elemType() != past.elemType() || rank < 2)
    return {};
  int64_t axis = attrInt(*concat, "axis", 0);
  if ((axis < 0 ? axis + rank : axis) != rank - 2)
    return {};
  Shape joined(past.shape().begin(), past.shape().end());
  for (int64_t i = 0; i < rank; ++i)
    if (i != rank - 2 && appended.dim(i) != joined[i])
      return {};
  joined[rank - 2] += appended.dim(rank - 2);
  return joined;
}

} // namespace

KernelResult softmaxAttention(const OpContext &ctx) {
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  auto body = [&] { return runBodyOnCpu(ctx.node, ctx.opset, inputs); };
  auto input = [&](size_t i) { return i < inputs.size() ? inputs[i] : nullptr; };
  const Tensor *q = input(AttentionQuery), *kt = input(AttentionKeys), *v = input(AttentionValues),
               *mask = input(AttentionMask), *guard = input(AttentionGuard);
  // Fusion.cpp's key chain (AttentionKeyScale on): the keys untransposed and
  // unscaled, scaled and transposed here head by head. Its grouped-query
  // repeats (AttentionKeyAxes, AttentionValueAxes on): each
  // key and value head read for the heads that share it.
  // The cache's Concat (AttentionKeysAppended, AttentionValuesAppended): keys and values are the
  // past's positions, then the appended ones, each head read where they lie.
  const Tensor *keyScale = input(AttentionKeyScale), *keysAppended = input(AttentionKeysAppended),
               *valuesAppended = input(AttentionValuesAppended);
  bool keyRepeat = input(AttentionKeyAxes) != nullptr,
       valueRepeat = input(AttentionValueAxes) != nullptr;
  auto isFloat = [](const Tensor *t) { return t && t->elemType() == DType::F32; };
  // The body's own nodes for what the kernel does not take: other types,
  // broadcast batch dimensions, a softmax over another axis, a mask that
  // does not broadcast to the scores, a key chain that does more than swap
  // the keys' last two axes, a repeat that does more than share heads.
  if (!isFloat(q) || !isFloat(kt) || !isFloat(v) || (mask && !isFloat(mask)) ||
      (guard && (!isFloat(guard) || guard->numElements() != 1)) ||
      (keyScale && (!isFloat(keyScale) || keyScale->numElements() != 1)))
    return body();
  int64_t rank = q->rank();
  if (rank < 3 || kt->rank() != rank || v->rank() != rank)
    return body();
  const onnx::GraphProto *steps = fusedBodyOf(ctx.node);
  if (!steps)
    return body(); // which names the missing body
  // The keys and values as the products read them: [.., k, n] and [.., n, d].
  // Appended keys are taken with their chain alone (rows of k to transpose).
  Shape keyShape(kt->shape().begin(), kt->shape().end()),
      valueShape(v->shape().begin(), v->shape().end());
  if (keysAppended &&
      (!keyScale ||
       (keyShape = appendedShape(*steps, *kt, *keysAppended, ctx.node.input(AttentionKeysAppended)))
           .empty()))
    return body();
  if (valuesAppended && (valueShape = appendedShape(*steps, *v, *valuesAppended,
                                                    ctx.node.input(AttentionValuesAppended)))
                            .empty())
    return body();
  int64_t keysShared = 1, valuesShared = 1;
  if (keyRepeat && !(keysShared = repeatOf(ctx, *steps, keyShape, AttentionKeyAxes)))
    return body();
  keyShape[rank - 3] *= keysShared;
  if (valueRepeat && !(valuesShared = repeatOf(ctx, *steps, valueShape, AttentionValueAxes)))
    return body();
  valueShape[rank - 3] *= valuesShared;
  if (keyScale && (keyShape = keyChainShape(ctx, *steps, keyShape)).empty())
    return body();
  ArrayRef<int64_t> qs = q->shape(), ks = keyShape, vs = valueShape;
  if (qs.drop_back(2) != ks.drop_back(2) || qs.drop_back(2) != vs.drop_back(2))
    return body();
  int64_t m = qs[rank - 2], k = qs[rank - 1], n = ks[rank - 1], d = vs[rank - 1];
  if (ks[rank - 2] != k || vs[rank - 2] != n || m == 0 || n == 0 || k == 0 || d == 0)
    return body();
  for (const onnx::NodeProto &step : steps->node())
    if (isOp(step, OpId::Softmax)) {
      int64_t axis = attrInt(step, "axis", -1);
      if (axis != -1 && axis != rank - 1)
        return body();
    }
  Shape scores(qs.begin(), qs.end() - 1);
  scores.push_back(n);
  Shape maskStrides;
  if (mask) {
    Expected<Shape> shape = broadcastShapes(mask->shape(), scores);
    if (!shape || *shape != scores) {
      consumeError(shape.takeError());
      return body();
    }
    maskStrides = broadcastStrides(mask->shape(), scores);
  }
  Shape outShape(qs.begin(), qs.end() - 1);
  outShape.push_back(d);
  Tensor out = Tensor::uninitialized(DType::F32, outShape); // every head is written
  const float *pq = q->data<float>(), *pk = kt->data<float>(), *pv = v->data<float>();
  const float *pm = mask ? mask->data<float>() : nullptr;
  float replacement = guard ? guard->data<float>()[0] : 0.0f;
  float *po = out.data<float>();
  int64_t heads = product(qs.drop_back(2)), headsAxis = qs[rank - 3];
  // Each head as the body's nodes compute it, in order: the same GEMMs,
  // the mask's float add, softmax's rows, the NaN guard's select.
  float c = keyScale ? keyScale->data<float>()[0] : 1.0f;
  int64_t pastKeys = keysAppended ? kt->dim(rank - 2) : n,
          pastValues = valuesAppended ? v->dim(rank - 2) : n;
  const float *pka = keysAppended ? keysAppended->data<float>() : nullptr,
              *pva = valuesAppended ? valuesAppended->data<float>() : nullptr;
  parallelFor(heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(m * n), scaled(keyScale ? k * n : 0), staged(pva ? n * d : 0);
    for (int64_t h = begin; h < end; ++h) {
      // The key and value heads this head reads: of its group when shared.
      int64_t group = h / headsAxis, within = h % headsAxis;
      int64_t kh = group * (headsAxis / keysShared) + within / keysShared,
              vh = group * (headsAxis / valuesShared) + within / valuesShared;
      const float *keys = pk + kh * k * n, *values = pv + vh * n * d;
      if (keyScale) { // the Transpose's copy, then the Mul's products
        transposeFloats(pk + kh * pastKeys * k, pastKeys, k, k, scaled.data(), n);
        if (pka)
          transposeFloats(pka + kh * (n - pastKeys) * k, n - pastKeys, k, k,
                          scaled.data() + pastKeys, n);
        for (float &x : scaled)
          x = x * c;
        keys = scaled.data();
      }
      if (pva) { // the Concat's copy, of this head alone
        std::memcpy(staged.data(), pv + vh * pastValues * d, pastValues * d * sizeof(float));
        std::memcpy(staged.data() + pastValues * d, pva + vh * (n - pastValues) * d,
                    (n - pastValues) * d * sizeof(float));
        values = staged.data();
      }
      gemm(false, false, m, n, k, 1.0f, pq + h * m * k, k, keys, n, 0.0f, s.data(), n);
      if (pm) {
        int64_t rest = h, offset = 0;
        for (int64_t dim = rank - 3; dim >= 0; --dim) {
          offset += (rest % qs[dim]) * maskStrides[dim];
          rest /= qs[dim];
        }
        int64_t rowStride = maskStrides[rank - 2], colStride = maskStrides[rank - 1];
        for (int64_t i = 0; i < m; ++i) {
          const float *row = pm + offset + i * rowStride;
          float *si = s.data() + i * n;
          if (colStride == 1)
            for (int64_t j = 0; j < n; ++j)
              si[j] = si[j] + row[j];
          else
            for (int64_t j = 0; j < n; ++j)
              si[j] = si[j] + row[j * colStride];
        }
      }
      softmaxRowRange(s.data(), s.data(), n, 0, m, false);
      if (guard)
        for (float &x : s)
          x = x != x ? replacement : x;
      gemm(false, false, m, d, n, 1.0f, s.data(), n, values, d, 0.0f, po + h * m * d, d);
    }
  });
  return Outputs{out};
}

KernelResult matMulTransposed(const OpContext &ctx) {
  ArrayRef<const Tensor *> inputs = ctx.allInputs();
  const Tensor &a = *inputs[0], &w = *inputs[1];
  bool floats =
      (a.elemType() == DType::F32 || a.elemType() == DType::F64) && w.elemType() == a.elemType();
  // The body's own nodes for what one GEMM over the folded rows does not
  // take (a 1-D A, a W that is not 2-D, other types).
  if (!floats || a.rank() < 2 || w.rank() != 2 || a.dim(-1) != w.dim(1))
    return runBodyOnCpu(ctx.node, ctx.opset, inputs);
  int64_t k = a.dim(-1), n = w.dim(0), m = a.numElements() / std::max<int64_t>(k, 1);
  Shape shape = a.shape();
  shape.back() = n;
  return visitStorage(a.elemType(), [&](auto tag) -> KernelResult {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      // Zeros when k = 0: the BLAS is not called then.
      Tensor y = k > 0 ? Tensor::uninitialized(a.elemType(), shape) : Tensor(a.elemType(), shape);
      if (k > 0 && m > 0 && n > 0)
        gemmAny<T>(false, true, m, n, k, T(1), a.data<T>(), k, w.data<T>(), k, T(0), y.data<T>(),
                   n);
      return Outputs{y};
    } else {
      return runBodyOnCpu(ctx.node, ctx.opset, inputs);
    }
  });
}

} // namespace pipec::cpu
