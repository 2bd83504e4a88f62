//===- KernelBodies.h - Per-element math of the CUDA backend's kernels ---===//
//
// Every CUDA kernel of CudaKernels.cu is a loop around one function of this
// header: the function computes one output element (or one row, or one
// partial sum) from its index and a parameter struct. The functions compile
// for the device under nvcc and for the host everywhere else, so the index
// math, broadcasting, reductions and row algorithms are checked on the CPU
// against the CPU kernels (tests/GpuTest.cpp) on machines without a GPU; a
// device run adds only the launch and the warp reductions.
//
// Row functions take a Lanes policy: SerialLanes (one thread walks the row,
// used on the host and for strided rows) or the device's WarpLanes (32
// lanes stride the row and combine with shuffles). A row function is called
// by every lane of its group with the same row, so its branches on the row
// are uniform and every lane reaches every reduction.
//
// Before:  IndexMap of out [2, 3] reading a [3] (strides [0, 1])
// After:   offsets(map, 4) == {1}  (out[1, 1] reads a[1])
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_KERNELBODIES_H
#define PIPEC_RUNTIME_KERNELS_KERNELBODIES_H

#include <cstdint>
#include <limits>
#include <math.h>
#include <type_traits>
#include <vector>

#if defined(__CUDACC__)
#define PIPEC_HD __host__ __device__ inline
#else
#define PIPEC_HD inline
#endif

namespace pipec::cuda::kernels {

/// Dimensions an IndexMap can walk after merging contiguous ones.
constexpr int MaxRank = 8;
/// Operands an IndexMap reads (Where reads three).
constexpr int MaxOperands = 3;

/// Element types the device kernels compute on.
enum class Scalar : int { F32, F64, I64, I32, Bool };

//===----------------------------------------------------------------------===//
// Strided walks: broadcasting, transposes, slices
//===----------------------------------------------------------------------===//

/// Maps a flat row-major output index to the flat offset of each operand:
/// offset_k = base[k] + sum_d index_d * strides[k][d]. Dimensions of size 1
/// are dropped and contiguous ones merged, so a plain elementwise op walks
/// one dimension.
template <int N> struct BasicIndexMap {
  int rank = 0;
  int operands = 1;
  int64_t shape[MaxRank] = {};
  int64_t strides[N][MaxRank] = {};
  int64_t base[N] = {};
};
using IndexMap = BasicIndexMap<MaxOperands>;

/// The offset of output element \p index (< the map's element count) in
/// operand \p k. What is left of the index at the outermost dimension is
/// its coordinate there, so a one-dimensional walk divides nothing.
template <int N> PIPEC_HD int64_t offsetOf(const BasicIndexMap<N> &map, int k, int64_t index) {
  int64_t offset = map.base[k];
  for (int d = map.rank - 1; d > 0; --d) {
    int64_t i = index % map.shape[d];
    index /= map.shape[d];
    offset += i * map.strides[k][d];
  }
  return map.rank > 0 ? offset + index * map.strides[k][0] : offset;
}

/// offsetOf for every operand at once (one division per inner dimension).
template <int N>
PIPEC_HD void offsetsOf(const BasicIndexMap<N> &map, int64_t index, int64_t *offsets) {
  for (int k = 0; k < map.operands; ++k)
    offsets[k] = map.base[k];
  for (int d = map.rank - 1; d > 0; --d) {
    int64_t i = index % map.shape[d];
    index /= map.shape[d];
    for (int k = 0; k < map.operands; ++k)
      offsets[k] += i * map.strides[k][d];
  }
  if (map.rank > 0)
    for (int k = 0; k < map.operands; ++k)
      offsets[k] += index * map.strides[k][0];
}

/// Row-major strides of \p shape, in elements.
inline std::vector<int64_t> contiguousStrides(const std::vector<int64_t> &shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

/// Strides that read a tensor of \p shape as \p outShape (numpy
/// broadcasting, right-aligned): 0 along broadcast dimensions.
inline std::vector<int64_t> broadcastStrides(const std::vector<int64_t> &shape,
                                             const std::vector<int64_t> &outShape) {
  std::vector<int64_t> strides(outShape.size(), 0);
  std::vector<int64_t> own = contiguousStrides(shape);
  size_t lead = outShape.size() - shape.size();
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1)
      strides[lead + i] = own[i];
  return strides;
}

/// An IndexMap walking \p outShape with one stride vector per operand (each
/// of outShape's rank) and the given base offsets (0 when omitted). Returns
/// false when more than MaxRank dimensions remain after merging.
template <int N>
bool makeIndexMap(const std::vector<int64_t> &outShape,
                  const std::vector<std::vector<int64_t>> &strides, BasicIndexMap<N> &map,
                  const std::vector<int64_t> &bases = {}) {
  map = BasicIndexMap<N>();
  map.operands = static_cast<int>(strides.size());
  if (map.operands < 1 || map.operands > N)
    return false;
  for (int k = 0; k < map.operands; ++k)
    map.base[k] = k < static_cast<int>(bases.size()) ? bases[k] : 0;
  // Walk from the innermost dimension outwards, merging each dimension into
  // the previous kept one when every operand steps through both as one.
  std::vector<int64_t> shape;
  std::vector<std::vector<int64_t>> merged(map.operands);
  for (int64_t d = static_cast<int64_t>(outShape.size()) - 1; d >= 0; --d) {
    if (outShape[d] == 1)
      continue;
    bool mergeable = !shape.empty();
    for (int k = 0; mergeable && k < map.operands; ++k)
      mergeable = strides[k][d] == merged[k].back() * shape.back();
    if (mergeable) {
      shape.back() *= outShape[d];
      continue;
    }
    shape.push_back(outShape[d]);
    for (int k = 0; k < map.operands; ++k)
      merged[k].push_back(strides[k][d]);
  }
  if (shape.size() > static_cast<size_t>(MaxRank))
    return false;
  map.rank = static_cast<int>(shape.size());
  for (int d = 0; d < map.rank; ++d) {
    // Collected innermost first; IndexMap is outermost first.
    map.shape[d] = shape[map.rank - 1 - d];
    for (int k = 0; k < map.operands; ++k)
      map.strides[k][d] = merged[k][map.rank - 1 - d];
  }
  return true;
}

//===----------------------------------------------------------------------===//
// Elementwise ops
//===----------------------------------------------------------------------===//

enum class Unary : int {
  Relu,
  Tanh,
  Sigmoid,
  Erf,
  Sqrt,
  Exp,
  Log,
  Neg,
  Reciprocal,
  Abs,
  GeluErf,
  GeluTanh,
  LeakyRelu
};

/// Float unary ops as the CPU kernels define them (Relu keeps NaN; Sigmoid
/// never exponentiates a large positive number).
PIPEC_HD float unaryValue(Unary op, float x, float alpha) {
  switch (op) {
  case Unary::Relu:
    return x < 0 ? 0.0f : x;
  case Unary::Tanh:
    return tanhf(x);
  case Unary::Sigmoid: {
    if (x >= 0)
      return 1.0f / (1.0f + expf(-x));
    float e = expf(x);
    return e / (1.0f + e);
  }
  case Unary::Erf:
    return erff(x);
  case Unary::Sqrt:
    return sqrtf(x);
  case Unary::Exp:
    return expf(x);
  case Unary::Log:
    return logf(x);
  case Unary::Neg:
    return -x;
  case Unary::Reciprocal:
    return 1.0f / x;
  case Unary::Abs:
    return x < 0 ? -x : x;
  case Unary::GeluErf:
    return static_cast<float>(0.5 * x * (1 + erf(x * 0.70710678118654752440)));
  case Unary::GeluTanh: {
    double v = x;
    return static_cast<float>(0.5 * v *
                              (1 + tanh(0.79788456080286535588 * (v + 0.044715 * v * v * v))));
  }
  case Unary::LeakyRelu:
    return x < 0 ? alpha * x : x;
  }
  return x;
}

PIPEC_HD void unaryElement(int64_t i, Unary op, float alpha, const float *x, float *y) {
  y[i] = unaryValue(op, x[i], alpha);
}

enum class Binary : int { Add, Sub, Mul, Div, Pow, Equal, Less, Greater };

/// True for the ops that give bool.
PIPEC_HD bool isComparison(Binary op) {
  return op == Binary::Equal || op == Binary::Less || op == Binary::Greater;
}

/// Arithmetic on one type (Div and Pow for floats only: the backend sends
/// integer ones to the CPU, which checks division by zero).
template <typename T> PIPEC_HD T arithmeticValue(Binary op, T a, T b) {
  switch (op) {
  case Binary::Add:
    return a + b;
  case Binary::Sub:
    return a - b;
  case Binary::Mul:
    return a * b;
  case Binary::Div:
    return a / b;
  case Binary::Pow:
    // Squares and cubes exactly as the CPU kernel computes them.
    if (b == T(2))
      return a * a;
    if (b == T(3))
      return a * a * a;
    return static_cast<T>(powf(static_cast<float>(a), static_cast<float>(b)));
  default:
    return a;
  }
}

template <typename T> PIPEC_HD bool compareValue(Binary op, T a, T b) {
  switch (op) {
  case Binary::Equal:
    return a == b;
  case Binary::Less:
    return a < b;
  case Binary::Greater:
    return b < a;
  default:
    return false;
  }
}

/// out[i] = op(a[.], b[.]) through a two-operand map.
template <typename T>
PIPEC_HD void arithmeticElement(int64_t i, Binary op, const IndexMap &map, const T *a, const T *b,
                                T *out) {
  int64_t off[MaxOperands];
  offsetsOf(map, i, off);
  out[i] = arithmeticValue<T>(op, a[off[0]], b[off[1]]);
}

template <typename T>
PIPEC_HD void compareElement(int64_t i, Binary op, const IndexMap &map, const T *a, const T *b,
                             bool *out) {
  int64_t off[MaxOperands];
  offsetsOf(map, i, off);
  out[i] = compareValue<T>(op, a[off[0]], b[off[1]]);
}

/// out[i] = cond ? x : y through a three-operand map; T is any type of the
/// element's size.
template <typename T>
PIPEC_HD void whereElement(int64_t i, const IndexMap &map, const bool *cond, const T *x, const T *y,
                           T *out) {
  int64_t off[MaxOperands];
  offsetsOf(map, i, off);
  out[i] = cond[off[0]] ? x[off[1]] : y[off[2]];
}

/// out[i] = in[offset]: transposes, slices, broadcasts (Expand, Gemm's C).
template <typename T>
PIPEC_HD void copyElement(int64_t i, const IndexMap &map, const T *in, T *out) {
  out[i] = in[offsetOf(map, 0, i)];
}

/// Conversions as the CPU's Cast: to bool is != 0; float to integer
/// saturates and takes NaN to 0.
template <typename From, typename To> PIPEC_HD To castValue(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (std::is_floating_point_v<To> || !std::is_floating_point_v<From>) {
    return static_cast<To>(v);
  } else {
    double d = static_cast<double>(v);
    if (d != d)
      return To(0);
    if (d <= static_cast<double>(std::numeric_limits<To>::lowest()))
      return std::numeric_limits<To>::lowest();
    if (d >= static_cast<double>(std::numeric_limits<To>::max()))
      return std::numeric_limits<To>::max();
    return static_cast<To>(d);
  }
}

template <typename From, typename To>
PIPEC_HD void castElement(int64_t i, const From *in, To *out) {
  out[i] = castValue<From, To>(in[i]);
}

/// Gradient ops of domain pipec that scale dY by a function of a second
/// operand of the same shape (Differentiate.h).
enum class Pointwise : int { ReluGrad, TanhGrad, SigmoidGrad, ErfGrad, GeluErfGrad, GeluTanhGrad };

/// The factor, in double as the CPU kernels compute it.
PIPEC_HD double pointwiseFactor(Pointwise op, double a) {
  switch (op) {
  case Pointwise::ReluGrad:
    return a > 0 ? 1.0 : 0.0;
  case Pointwise::TanhGrad:
    return 1.0 - a * a;
  case Pointwise::SigmoidGrad:
    return a * (1.0 - a);
  case Pointwise::ErfGrad:
    return 1.12837916709551257390 * exp(-a * a);
  case Pointwise::GeluErfGrad:
    return 0.5 * (1 + erf(a * 0.70710678118654752440)) +
           a * exp(-0.5 * a * a) * 0.39894228040143267794;
  case Pointwise::GeluTanhGrad: {
    const double c = 0.79788456080286535588, k = 0.044715;
    double t = tanh(c * (a + k * a * a * a));
    return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * k * a * a);
  }
  }
  return 0;
}

PIPEC_HD void pointwiseElement(int64_t i, Pointwise op, const float *dy, const float *a,
                               float *dx) {
  dx[i] = dy[i] * static_cast<float>(pointwiseFactor(op, static_cast<double>(a[i])));
}

/// out[i] = a[i] + b[i] (gradient accumulation; out may be a).
template <typename T> PIPEC_HD void addElement(int64_t i, const T *a, const T *b, T *out) {
  out[i] = a[i] + b[i];
}

template <typename T> PIPEC_HD void fillElement(int64_t i, T value, T *out) { out[i] = value; }

//===----------------------------------------------------------------------===//
// Fused element-wise programs
//===----------------------------------------------------------------------===//

/// Limits of one fused node (runtime/cpu/Fused.h makes them; the fusion
/// pass never builds a larger one).
constexpr int MaxFusedInputs = 8;
constexpr int MaxFusedOps = 16;
constexpr int MaxFusedOutputs = 4;
constexpr int MaxFusedRegisters = MaxFusedInputs + MaxFusedOps;

enum class FusedKind : int { Unary, Binary, Pointwise };

/// One step: register dst = op(register a[, register b]). Registers
/// 0..inputs-1 hold the inputs; step s writes register inputs + s.
struct FusedOp {
  FusedKind kind = FusedKind::Unary;
  int op = 0;
  int a = 0, b = 0;
  float alpha = 0;
};

/// A straight-line program over one element of every operand.
struct FusedProgram {
  int inputs = 0, ops = 0, outputs = 0;
  FusedOp code[MaxFusedOps];
  /// The register each output is read from.
  int outputRegister[MaxFusedOutputs] = {};
};

/// One step on one element, each op exactly as its own kernel computes it.
PIPEC_HD float fusedStep(const FusedOp &step, float a, float b) {
  switch (step.kind) {
  case FusedKind::Unary:
    return unaryValue(static_cast<Unary>(step.op), a, step.alpha);
  case FusedKind::Binary:
    return arithmeticValue<float>(static_cast<Binary>(step.op), a, b);
  case FusedKind::Pointwise:
    return a * static_cast<float>(
                   pointwiseFactor(static_cast<Pointwise>(step.op), static_cast<double>(b)));
  }
  return a;
}

using FusedMap = BasicIndexMap<MaxFusedInputs>;

/// Output element \p i of every output: the inputs read through \p map
/// (numpy broadcasting), the program run in registers.
PIPEC_HD void fusedElement(int64_t i, const FusedProgram &p, const FusedMap &map,
                           const float *const *in, float *const *out) {
  float r[MaxFusedRegisters];
  int64_t off[MaxFusedInputs];
  offsetsOf(map, i, off);
  for (int k = 0; k < p.inputs; ++k)
    r[k] = in[k][off[k]];
  for (int s = 0; s < p.ops; ++s)
    r[p.inputs + s] = fusedStep(p.code[s], r[p.code[s].a], r[p.code[s].b]);
  for (int o = 0; o < p.outputs; ++o)
    out[o][i] = r[p.outputRegister[o]];
}

//===----------------------------------------------------------------------===//
// Gather and its gradient
//===----------------------------------------------------------------------===//

/// Data [outer, size, inner] indexed along the middle dimension by `count`
/// indices: out [outer, count, inner].
struct GatherParams {
  int64_t outer = 1, size = 1, count = 0, inner = 1;
};

/// One output element; an index outside [-size, size) sets *flag and gives 0.
template <typename T, typename I>
PIPEC_HD void gatherElement(int64_t o, const GatherParams &p, const T *data, const I *indices,
                            T *out, int *flag) {
  int64_t in = o % p.inner, rest = o / p.inner;
  int64_t j = rest % p.count, outer = rest / p.count;
  int64_t k = static_cast<int64_t>(indices[j]);
  if (k < 0)
    k += p.size;
  if (k < 0 || k >= p.size) {
    *flag = 1;
    out[o] = T(0);
    return;
  }
  out[o] = data[(outer * p.size + k) * p.inner + in];
}

PIPEC_HD void atomicAddTo(float *target, float value) {
#if defined(__CUDA_ARCH__)
  atomicAdd(target, value);
#else
  *target += value;
#endif
}

/// Adds dY element \p i into dData (zeroed first) at its index.
template <typename I>
PIPEC_HD void gatherGradElement(int64_t i, const GatherParams &p, const float *dy, const I *indices,
                                float *dx, int *flag) {
  int64_t in = i % p.inner, rest = i / p.inner;
  int64_t j = rest % p.count, outer = rest / p.count;
  int64_t k = static_cast<int64_t>(indices[j]);
  if (k < 0)
    k += p.size;
  if (k < 0 || k >= p.size) {
    *flag = 1;
    return;
  }
  atomicAddTo(dx + (outer * p.size + k) * p.inner + in, dy[i]);
}

//===----------------------------------------------------------------------===//
// Reductions (ReduceSum, ReduceMean, SumTo)
//===----------------------------------------------------------------------===//

/// A sum over some dimensions in two passes. Pass one: partial sum t covers
/// output o and chunk c of the reduced elements (interleaved: elements c,
/// c + chunks, ...; else the contiguous range [c * chunkLength, ...)), so
/// neighbouring threads read neighbouring memory whether the reduced
/// dimensions are innermost or not. Pass two adds each output's chunks in
/// order (deterministic) and scales (1 / count for a mean).
struct ReducePlan {
  IndexMap kept;    ///< output index -> input offset of its first element
  IndexMap reduced; ///< reduced index -> offset from there
  int64_t outputs = 0, count = 0, chunks = 1, chunkLength = 0;
  bool interleaved = false;
};

/// The plan summing a tensor of \p shape over the dimensions marked in
/// \p reduced, outputs in row-major order of the kept dimensions. False when
/// the walks need more than MaxRank dimensions.
inline bool makeReducePlan(const std::vector<int64_t> &shape, const std::vector<bool> &reduced,
                           ReducePlan &plan, int64_t targetThreads = 1 << 17) {
  plan = ReducePlan();
  std::vector<int64_t> strides = contiguousStrides(shape);
  std::vector<int64_t> keptShape, keptStrides, redShape, redStrides;
  plan.outputs = plan.count = 1;
  int64_t innermost = -1; // the last dimension of size > 1
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1)
      innermost = static_cast<int64_t>(d);
    if (reduced[d]) {
      redShape.push_back(shape[d]);
      redStrides.push_back(strides[d]);
      plan.count *= shape[d];
    } else {
      keptShape.push_back(shape[d]);
      keptStrides.push_back(strides[d]);
      plan.outputs *= shape[d];
    }
  }
  if (!makeIndexMap(keptShape, {keptStrides}, plan.kept) ||
      !makeIndexMap(redShape, {redStrides}, plan.reduced))
    return false;
  plan.interleaved = innermost >= 0 && reduced[innermost];
  // Enough partial sums to fill the device, each over >= 32 elements.
  int64_t wanted = plan.outputs > 0 ? targetThreads / plan.outputs : 1;
  int64_t most = (plan.count + 31) / 32;
  plan.chunks = wanted < 1 ? 1 : (wanted < most ? wanted : most);
  if (plan.chunks < 1)
    plan.chunks = 1;
  plan.chunkLength = (plan.count + plan.chunks - 1) / plan.chunks;
  return true;
}

/// Pass one: partial[c * outputs + o] for t in [0, outputs * chunks).
template <typename T>
PIPEC_HD void reducePartialElement(int64_t t, const ReducePlan &p, const T *in, double *partial) {
  int64_t o, c;
  if (p.interleaved) {
    o = t / p.chunks;
    c = t % p.chunks;
  } else {
    c = t / p.outputs;
    o = t % p.outputs;
  }
  const T *base = in + offsetOf(p.kept, 0, o);
  double acc = 0;
  if (p.interleaved) {
    for (int64_t r = c; r < p.count; r += p.chunks)
      acc += static_cast<double>(base[offsetOf(p.reduced, 0, r)]);
  } else {
    int64_t end = (c + 1) * p.chunkLength < p.count ? (c + 1) * p.chunkLength : p.count;
    for (int64_t r = c * p.chunkLength; r < end; ++r)
      acc += static_cast<double>(base[offsetOf(p.reduced, 0, r)]);
  }
  partial[c * p.outputs + o] = acc;
}

/// Pass two: out[o] = scale * sum over chunks.
template <typename T>
PIPEC_HD void reduceFinishElement(int64_t o, int64_t outputs, int64_t chunks, const double *partial,
                                  double scale, T *out) {
  double acc = 0;
  for (int64_t c = 0; c < chunks; ++c)
    acc += partial[c * outputs + o];
  out[o] = static_cast<T>(acc * scale);
}

//===----------------------------------------------------------------------===//
// Rows: softmax, layer normalization, cross-entropy and their gradients
//===----------------------------------------------------------------------===//

/// One thread per row.
struct SerialLanes {
  PIPEC_HD int lane() const { return 0; }
  PIPEC_HD int count() const { return 1; }
  PIPEC_HD double sum(double v) const { return v; }
  PIPEC_HD float max(float v) const { return v; }
};

/// A tensor viewed as rows along one axis: [outer, size, inner] with rows
/// (outer, inner) of `size` elements `inner` apart.
struct RowLayout {
  int64_t outer = 1, size = 1, inner = 1;
};

PIPEC_HD int64_t rowCount(const RowLayout &l) { return l.outer * l.inner; }
PIPEC_HD int64_t rowBase(const RowLayout &l, int64_t row) {
  return (row / l.inner) * l.size * l.inner + row % l.inner;
}

/// Softmax (or log-softmax) of one row.
template <typename L>
PIPEC_HD void softmaxRow(const L &lanes, int64_t row, const RowLayout &l, const float *x, float *y,
                         bool logarithm) {
  const float *in = x + rowBase(l, row);
  float *out = y + rowBase(l, row);
  float maxValue = -INFINITY;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    maxValue = fmaxf(maxValue, in[j * l.inner]);
  maxValue = lanes.max(maxValue);
  // Sums in double, as the CPU kernels do (a 50k-wide row loses digits in
  // float).
  double sum = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    sum += expf(in[j * l.inner] - maxValue);
  sum = lanes.sum(sum);
  float scale = logarithm ? static_cast<float>(log(sum)) : static_cast<float>(1.0 / sum);
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    float shifted = in[j * l.inner] - maxValue;
    out[j * l.inner] = logarithm ? shifted - scale : expf(shifted) * scale;
  }
}

/// dX = Y * (dY - sum(dY * Y)) along the row.
template <typename L>
PIPEC_HD void softmaxGradRow(const L &lanes, int64_t row, const RowLayout &l, const float *dy,
                             const float *y, float *dx) {
  int64_t base = rowBase(l, row);
  double dot = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    dot += static_cast<double>(dy[base + j * l.inner]) * y[base + j * l.inner];
  float total = static_cast<float>(lanes.sum(dot));
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    int64_t i = base + j * l.inner;
    dx[i] = y[i] * (dy[i] - total);
  }
}

/// Mean and 1 / sqrt(variance + epsilon) of a contiguous row (two passes,
/// summed in double as the CPU kernels do).
template <typename L>
PIPEC_HD void rowMoments(const L &lanes, const float *in, int64_t size, float epsilon, float &mean,
                         float &rstd) {
  double sum = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count())
    sum += in[j];
  double mu = lanes.sum(sum) / static_cast<double>(size);
  double sq = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    double d = in[j] - mu;
    sq += d * d;
  }
  mean = static_cast<float>(mu);
  rstd = static_cast<float>(1.0 / sqrt(lanes.sum(sq) / static_cast<double>(size) + epsilon));
}

/// LayerNormalization of contiguous row \p row of \p size elements; gamma
/// and beta (beta may be null) have \p size elements; mean and invStd (may
/// be null) get one value per row.
template <typename L>
PIPEC_HD void layerNormRow(const L &lanes, int64_t row, int64_t size, float epsilon, const float *x,
                           const float *gamma, const float *beta, float *y, float *mean,
                           float *invStd) {
  const float *in = x + row * size;
  float *out = y + row * size;
  float mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  for (int64_t j = lanes.lane(); j < size; j += lanes.count())
    out[j] = (in[j] - mu) * rstd * gamma[j] + (beta ? beta[j] : 0.0f);
  if (lanes.lane() == 0) {
    if (mean)
      mean[row] = mu;
    if (invStd)
      invStd[row] = rstd;
  }
}

/// dX = rstd * (G - mean(G) - Xh * mean(G * Xh)), G = dY * scale.
template <typename L>
PIPEC_HD void layerNormGradInputRow(const L &lanes, int64_t row, int64_t size, float epsilon,
                                    const float *dy, const float *x, const float *scale,
                                    float *dx) {
  const float *in = x + row * size, *d = dy + row * size;
  float *out = dx + row * size;
  float mu, rstd;
  rowMoments(lanes, in, size, epsilon, mu, rstd);
  double sumG = 0, sumGX = 0;
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    float g = d[j] * scale[j];
    sumG += g;
    sumGX += static_cast<double>(g) * ((in[j] - mu) * rstd);
  }
  float meanG = static_cast<float>(lanes.sum(sumG) / static_cast<double>(size));
  float meanGX = static_cast<float>(lanes.sum(sumGX) / static_cast<double>(size));
  for (int64_t j = lanes.lane(); j < size; j += lanes.count()) {
    float xh = (in[j] - mu) * rstd;
    out[j] = rstd * (d[j] * scale[j] - meanG - xh * meanGX);
  }
}

/// The row statistics LayerNormGradWeight needs.
template <typename L>
PIPEC_HD void layerNormStatsRow(const L &lanes, int64_t row, int64_t size, float epsilon,
                                const float *x, float *mean, float *rstd) {
  float mu, r;
  rowMoments(lanes, x + row * size, size, epsilon, mu, r);
  if (lanes.lane() == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
}

/// Pass one of dScale[k] = sum over rows of dY * Xh: partial sum t covers
/// column k = t % size over rows chunk c = t / size.
PIPEC_HD void layerNormGradWeightPartial(int64_t t, int64_t rows, int64_t size, int64_t chunkLength,
                                         const float *dy, const float *x, const float *mean,
                                         const float *rstd, double *partial) {
  int64_t k = t % size, c = t / size;
  int64_t end = (c + 1) * chunkLength < rows ? (c + 1) * chunkLength : rows;
  double acc = 0;
  for (int64_t r = c * chunkLength; r < end; ++r) {
    int64_t i = r * size + k;
    acc += static_cast<double>(dy[i]) * static_cast<double>((x[i] - mean[r]) * rstd[r]);
  }
  partial[t] = acc;
}

/// SoftmaxCrossEntropyLoss over scores laid out as rows along dimension 1.
struct CrossEntropyParams {
  bool hasIgnore = false;
  int64_t ignoreIndex = 0;
  /// 0 none, 1 sum, 2 mean.
  int reduction = 2;
};

/// One position: its log-probabilities (if \p logProb), loss and whether
/// it counts. An out-of-range label sets *flag and counts as ignored.
template <typename L>
PIPEC_HD void crossEntropyRow(const L &lanes, int64_t row, const RowLayout &l,
                              const CrossEntropyParams &p, const float *scores,
                              const int64_t *labels, float *logProb, float *losses, float *valid,
                              int *flag) {
  int64_t base = rowBase(l, row);
  const float *in = scores + base;
  float maxValue = -INFINITY;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    maxValue = fmaxf(maxValue, in[j * l.inner]);
  maxValue = lanes.max(maxValue);
  double sum = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    sum += expf(in[j * l.inner] - maxValue);
  float logSum = static_cast<float>(log(lanes.sum(sum)));
  if (logProb)
    for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
      logProb[base + j * l.inner] = in[j * l.inner] - maxValue - logSum;
  if (lanes.lane() != 0)
    return;
  int64_t label = labels[row];
  bool ignored = p.hasIgnore && label == p.ignoreIndex;
  if (!ignored && (label < 0 || label >= l.size)) {
    *flag = 1;
    ignored = true;
  }
  losses[row] = ignored ? 0.0f : -(in[label * l.inner] - maxValue - logSum);
  valid[row] = ignored ? 0.0f : 1.0f;
}

/// The reduced loss: sum, or sum / count of the positions that count.
template <typename L>
PIPEC_HD void crossEntropyFinish(const L &lanes, int64_t positions, bool mean, const float *losses,
                                 const float *valid, float *out) {
  double total = 0, count = 0;
  for (int64_t i = lanes.lane(); i < positions; i += lanes.count()) {
    total += losses[i];
    count += valid[i];
  }
  total = lanes.sum(total);
  count = lanes.sum(count);
  if (lanes.lane() == 0)
    out[0] = static_cast<float>(mean ? total / count : total);
}

/// The number of labels != ignore_index (the mean's divisor).
template <typename L>
PIPEC_HD void labelCount(const L &lanes, int64_t positions, const CrossEntropyParams &p,
                         const int64_t *labels, double *count) {
  double n = 0;
  for (int64_t i = lanes.lane(); i < positions; i += lanes.count())
    n += p.hasIgnore && labels[i] == p.ignoreIndex ? 0.0 : 1.0;
  n = lanes.sum(n);
  if (lanes.lane() == 0)
    count[0] = n;
}

/// dScores = dLoss * (softmax - onehot(label)) / divisor for one position;
/// ignored positions get 0.
template <typename L>
PIPEC_HD void crossEntropyGradRow(const L &lanes, int64_t row, const RowLayout &l,
                                  const CrossEntropyParams &p, const float *dLoss,
                                  const double *count, const float *scores, const int64_t *labels,
                                  float *dx, int *flag) {
  int64_t base = rowBase(l, row);
  const float *in = scores + base;
  float *out = dx + base;
  int64_t label = labels[row];
  bool ignored = p.hasIgnore && label == p.ignoreIndex;
  if (!ignored && (label < 0 || label >= l.size)) {
    if (lanes.lane() == 0)
      *flag = 1;
    ignored = true;
  }
  if (ignored) {
    for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
      out[j * l.inner] = 0;
    return;
  }
  double divisor = p.reduction != 2 || count[0] == 0 ? 1.0 : count[0];
  float scale = static_cast<float>(static_cast<double>(dLoss[0]) / divisor);
  float maxValue = -INFINITY;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    maxValue = fmaxf(maxValue, in[j * l.inner]);
  maxValue = lanes.max(maxValue);
  double sum = 0;
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count())
    sum += expf(in[j * l.inner] - maxValue);
  float total = static_cast<float>(lanes.sum(sum));
  for (int64_t j = lanes.lane(); j < l.size; j += lanes.count()) {
    float prob = expf(in[j * l.inner] - maxValue) / total;
    out[j * l.inner] = scale * (prob - (j == label ? 1.0f : 0.0f));
  }
}

//===----------------------------------------------------------------------===//
// Convolution, pooling and batch normalization
//===----------------------------------------------------------------------===//

/// Sliding-window geometry padded to three spatial dimensions as the CPU
/// kernels pad it: a 1-D or 2-D op gets leading dimensions of size 1.
struct ConvWindow {
  int64_t in[3] = {1, 1, 1}, kernel[3] = {1, 1, 1}, stride[3] = {1, 1, 1};
  int64_t dilation[3] = {1, 1, 1}, padBegin[3] = {0, 0, 0}, padEnd[3] = {0, 0, 0};
  int64_t out[3] = {1, 1, 1};
  PIPEC_HD int64_t inSize() const { return in[0] * in[1] * in[2]; }
  PIPEC_HD int64_t outSize() const { return out[0] * out[1] * out[2]; }
  PIPEC_HD int64_t kernelSize() const { return kernel[0] * kernel[1] * kernel[2]; }
  /// Every window is one input element at its own position: the im2col
  /// columns are the image itself.
  bool isIdentity() const {
    for (int d = 0; d < 3; ++d)
      if (kernel[d] != 1 || stride[d] != 1 || padBegin[d] != 0 || out[d] != in[d])
        return false;
    return true;
  }
};

/// The window of a forward Conv or pool with explicit pads (auto_pad NOTSET)
/// over the spatial sizes \p in, output sizes as the CPU kernels compute
/// them (ceil_mode for pools). False when the attributes do not fit.
inline bool makeConvWindow(const std::vector<int64_t> &in, const std::vector<int64_t> &kernel,
                           const std::vector<int64_t> &strides,
                           const std::vector<int64_t> &dilations, const std::vector<int64_t> &pads,
                           bool ceilMode, ConvWindow &w) {
  w = ConvWindow();
  size_t rank = in.size();
  if (rank < 1 || rank > 3 || kernel.size() != rank || strides.size() != rank ||
      dilations.size() != rank || pads.size() != 2 * rank)
    return false;
  size_t lead = 3 - rank;
  for (size_t i = 0; i < rank; ++i) {
    size_t d = lead + i;
    int64_t k = kernel[i], s = strides[i], dil = dilations[i];
    int64_t begin = pads[i], end = pads[rank + i];
    if (k < 1 || s < 1 || dil < 1 || begin < 0 || end < 0)
      return false;
    int64_t span = in[i] + begin + end - ((k - 1) * dil + 1);
    if (span < 0)
      return false;
    int64_t out = (ceilMode ? (span + s - 1) / s : span / s) + 1;
    if (ceilMode && (out - 1) * s >= in[i] + begin)
      --out;
    w.in[d] = in[i], w.kernel[d] = k, w.stride[d] = s, w.dilation[d] = dil;
    w.padBegin[d] = begin, w.padEnd[d] = end, w.out[d] = out;
  }
  return true;
}

/// The window of a Conv or pool gradient: as makeConvWindow with the output
/// sizes given (dY's), which must be what ceil_mode off or on gives.
inline bool makeGradWindow(const std::vector<int64_t> &in, const std::vector<int64_t> &kernel,
                           const std::vector<int64_t> &strides,
                           const std::vector<int64_t> &dilations, const std::vector<int64_t> &pads,
                           const std::vector<int64_t> &out, ConvWindow &w) {
  if (out.size() != in.size() || !makeConvWindow(in, kernel, strides, dilations, pads, false, w))
    return false;
  size_t lead = 3 - in.size();
  for (size_t i = 0; i < in.size(); ++i) {
    size_t d = lead + i;
    int64_t span = w.in[d] + w.padBegin[d] + w.padEnd[d] - (w.kernel[d] - 1) * w.dilation[d] - 1;
    if (out[i] < span / w.stride[d] + 1 || out[i] > (span + w.stride[d] - 1) / w.stride[d] + 1)
      return false;
    w.out[d] = out[i];
  }
  return true;
}

/// im2col and col2im over `images` images of `channels` contiguous planes
/// (image b of a grouped Conv is batch b / group, group b % group, whose
/// planes are contiguous in X). Columns are [images, rows, outSize] with
/// rows = channels * taps; with batchInner they are [group, rows, images /
/// group, outSize], so that one GEMM per group sums over the batch.
struct Im2colParams {
  ConvWindow w;
  int64_t images = 1, channels = 1, group = 1;
  bool batchInner = false;
  PIPEC_HD int64_t rows() const { return channels * w.kernelSize(); }
};

/// Input position (row-major in the image plane) that tap \p k of output
/// position \p o reads, or -1 in the padding.
PIPEC_HD int64_t tapSource(const ConvWindow &w, int64_t k, int64_t o) {
  int64_t kw = k % w.kernel[2], kh = (k / w.kernel[2]) % w.kernel[1],
          kd = k / (w.kernel[2] * w.kernel[1]);
  int64_t ow = o % w.out[2], oh = (o / w.out[2]) % w.out[1], od = o / (w.out[2] * w.out[1]);
  int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
  int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
  int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
  if (id < 0 || id >= w.in[0] || ih < 0 || ih >= w.in[1] || iw < 0 || iw >= w.in[2])
    return -1;
  return (id * w.in[1] + ih) * w.in[2] + iw;
}

/// Column element \p t (in [images, rows, outSize] order) from the images.
PIPEC_HD void im2colElement(int64_t t, const Im2colParams &p, const float *image, float *columns) {
  int64_t outSize = p.w.outSize(), rows = p.rows(), taps = p.w.kernelSize();
  int64_t o = t % outSize, r = (t / outSize) % rows, b = t / (outSize * rows);
  int64_t c = r / taps, k = r % taps;
  int64_t i = tapSource(p.w, k, o);
  float v = i < 0 ? 0.0f : image[(b * p.channels + c) * p.w.inSize() + i];
  if (p.batchInner) {
    int64_t batch = p.images / p.group, n = b / p.group, g = b % p.group;
    columns[((g * rows + r) * batch + n) * outSize + o] = v;
  } else {
    columns[t] = v;
  }
}

/// Output position along one dimension that tap \p k reads input \p i from,
/// or -1.
PIPEC_HD int64_t tapTarget(int64_t i, int64_t k, int64_t stride, int64_t dilation, int64_t pad,
                           int64_t out) {
  int64_t num = i + pad - k * dilation;
  if (num < 0 || num % stride != 0 || num / stride >= out)
    return -1;
  return num / stride;
}

/// Image element \p i: the sum of the column entries read from it, taps in
/// increasing order (the CPU col2im's order for one element).
PIPEC_HD void col2imElement(int64_t i, const Im2colParams &p, const float *columns, float *image) {
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize(), outSize = w.outSize(), taps = w.kernelSize();
  int64_t pos = i % inSize, plane = i / inSize; // plane = b * channels + c
  int64_t iw = pos % w.in[2], ih = (pos / w.in[2]) % w.in[1], id = pos / (w.in[2] * w.in[1]);
  const float *cols = columns + plane * taps * outSize;
  float acc = 0;
  int64_t k = 0;
  for (int64_t kd = 0; kd < w.kernel[0]; ++kd) {
    int64_t od = tapTarget(id, kd, w.stride[0], w.dilation[0], w.padBegin[0], w.out[0]);
    for (int64_t kh = 0; kh < w.kernel[1]; ++kh) {
      int64_t oh = tapTarget(ih, kh, w.stride[1], w.dilation[1], w.padBegin[1], w.out[1]);
      for (int64_t kw = 0; kw < w.kernel[2]; ++kw, ++k) {
        int64_t ow = tapTarget(iw, kw, w.stride[2], w.dilation[2], w.padBegin[2], w.out[2]);
        if (od < 0 || oh < 0 || ow < 0)
          continue;
        acc += cols[k * outSize + (od * w.out[1] + oh) * w.out[2] + ow];
      }
    }
  }
  image[i] = acc;
}

/// y[i] += bias[channel of i] for y [batch, maps, size].
PIPEC_HD void biasElement(int64_t i, int64_t maps, int64_t size, const float *bias, float *y) {
  y[i] += bias[(i / size) % maps];
}

/// A 1-D to 3-D MaxPool or AveragePool.
struct PoolParams {
  ConvWindow w;
  bool isMax = true, includePad = false;
};

/// Taps of output position (od, oh, ow) inside the padded input (includePad)
/// or the input: the AveragePool divisor.
PIPEC_HD int64_t poolCount(const ConvWindow &w, const int64_t *o, bool includePad) {
  int64_t count = 1;
  for (int d = 0; d < 3; ++d) {
    int64_t n = 0;
    for (int64_t k = 0; k < w.kernel[d]; ++k) {
      int64_t at = o[d] * w.stride[d] - w.padBegin[d] + k * w.dilation[d];
      n += includePad ? (at >= -w.padBegin[d] && at < w.in[d] + w.padEnd[d])
                      : (at >= 0 && at < w.in[d]);
    }
    count *= n;
  }
  return count;
}

/// The input position of the maximum of window \p o over \p plane (the
/// first strict maximum in tap order, as the CPU kernels pick it), -1 for a
/// window of padding only; \p best gets its value.
PIPEC_HD int64_t poolArgmax(const ConvWindow &w, int64_t o, const float *plane, float &best) {
  int64_t bestIndex = -1;
  best = -INFINITY;
  int64_t taps = w.kernelSize();
  for (int64_t k = 0; k < taps; ++k) {
    int64_t i = tapSource(w, k, o);
    if (i >= 0 && (bestIndex < 0 || plane[i] > best)) {
      best = plane[i];
      bestIndex = i;
    }
  }
  return bestIndex;
}

/// Pool output element \p t of [planes, outSize].
PIPEC_HD void poolElement(int64_t t, const PoolParams &p, const float *x, float *y) {
  const ConvWindow &w = p.w;
  int64_t outSize = w.outSize(), o = t % outSize, plane = t / outSize;
  const float *in = x + plane * w.inSize();
  if (p.isMax) {
    float best;
    poolArgmax(w, o, in, best);
    y[t] = best;
    return;
  }
  int64_t taps = w.kernelSize(), valid = 0;
  double sum = 0;
  for (int64_t k = 0; k < taps; ++k) {
    int64_t i = tapSource(w, k, o);
    if (i >= 0) {
      sum += in[i];
      ++valid;
    }
  }
  int64_t at[3] = {o / (w.out[2] * w.out[1]), (o / w.out[2]) % w.out[1], o % w.out[2]};
  int64_t count = p.includePad ? poolCount(w, at, true) : valid;
  y[t] = static_cast<float>(count ? sum / static_cast<double>(count) : 0.0);
}

/// Input gradient element \p i of [planes, inSize]: MaxPoolGrad adds dY of
/// the windows whose maximum it is in increasing output order,
/// AveragePoolGrad dY / count of every window reading it in increasing tap
/// order (the CPU kernels' orders for one element).
PIPEC_HD void poolGradElement(int64_t i, const PoolParams &p, const float *dy, const float *x,
                              float *dx) {
  const ConvWindow &w = p.w;
  int64_t inSize = w.inSize(), outSize = w.outSize();
  int64_t pos = i % inSize, plane = i / inSize;
  int64_t at[3] = {pos / (w.in[2] * w.in[1]), (pos / w.in[2]) % w.in[1], pos % w.in[2]};
  const float *grad = dy + plane * outSize;
  float acc = 0;
  int64_t o3[3];
  // Max: taps in decreasing order meet the windows in increasing order.
  for (int64_t a = 0; a < w.kernel[0]; ++a) {
    int64_t kd = p.isMax ? w.kernel[0] - 1 - a : a;
    o3[0] = tapTarget(at[0], kd, w.stride[0], w.dilation[0], w.padBegin[0], w.out[0]);
    if (o3[0] < 0)
      continue;
    for (int64_t b = 0; b < w.kernel[1]; ++b) {
      int64_t kh = p.isMax ? w.kernel[1] - 1 - b : b;
      o3[1] = tapTarget(at[1], kh, w.stride[1], w.dilation[1], w.padBegin[1], w.out[1]);
      if (o3[1] < 0)
        continue;
      for (int64_t c = 0; c < w.kernel[2]; ++c) {
        int64_t kw = p.isMax ? w.kernel[2] - 1 - c : c;
        o3[2] = tapTarget(at[2], kw, w.stride[2], w.dilation[2], w.padBegin[2], w.out[2]);
        if (o3[2] < 0)
          continue;
        int64_t o = (o3[0] * w.out[1] + o3[1]) * w.out[2] + o3[2];
        if (p.isMax) {
          float best;
          if (poolArgmax(w, o, x + plane * inSize, best) == pos)
            acc += grad[o];
        } else {
          acc += grad[o] / static_cast<float>(poolCount(w, o3, p.includePad));
        }
      }
    }
  }
  dx[i] = acc;
}

/// BatchNormalization (inference) of element \p i of X [batch, channels,
/// spatial], in double as the CPU kernel computes it.
PIPEC_HD void batchNormElement(int64_t i, int64_t channels, int64_t spatial, double epsilon,
                               const float *x, const float *scale, const float *bias,
                               const float *mean, const float *var, float *y) {
  int64_t c = (i / spatial) % channels;
  double mul = static_cast<double>(scale[c]) / sqrt(static_cast<double>(var[c]) + epsilon);
  double add = static_cast<double>(bias[c]) - static_cast<double>(mean[c]) * mul;
  y[i] = static_cast<float>(static_cast<double>(x[i]) * mul + add);
}

/// Pass one of BatchNormGradWeight: partial t covers channel t / chunks and
/// chunk t % chunks of its batch * spatial elements, summing dY (X - mean).
PIPEC_HD void batchNormGradWeightPartial(int64_t t, int64_t channels, int64_t batch,
                                         int64_t spatial, int64_t chunks, const float *dy,
                                         const float *x, const float *mean, double *partial) {
  int64_t c = t / chunks, chunk = t % chunks, count = batch * spatial;
  int64_t length = (count + chunks - 1) / chunks;
  int64_t end = (chunk + 1) * length < count ? (chunk + 1) * length : count;
  double mu = static_cast<double>(mean[c]), acc = 0;
  for (int64_t r = chunk * length; r < end; ++r) {
    int64_t i = ((r / spatial) * channels + c) * spatial + r % spatial;
    acc += static_cast<double>(dy[i]) * (static_cast<double>(x[i]) - mu);
  }
  partial[t] = acc;
}

/// Pass two: dScale[c] = sum of its chunks / sqrt(var + epsilon).
PIPEC_HD void batchNormGradWeightFinish(int64_t c, int64_t chunks, double epsilon,
                                        const double *partial, const float *var, float *out) {
  double acc = 0;
  for (int64_t k = 0; k < chunks; ++k)
    acc += partial[c * chunks + k];
  out[c] = static_cast<float>(acc / sqrt(static_cast<double>(var[c]) + epsilon));
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

/// One update, in double as the CPU backend computes it. kind: 0 SGD, 1
/// momentum, 2 AdamW; c1 and c2 are Adam's bias corrections
/// 1 - beta^(step + 1).
struct OptimizerParams {
  int kind = 0;
  double lr = 0, momentum = 0, weightDecay = 0, beta1 = 0, beta2 = 0, epsilon = 0, gradScale = 1;
  double c1 = 1, c2 = 1;
};

/// Writes the new weight and moments (never in place; m and v may be null
/// for SGD, v for momentum).
template <typename T>
PIPEC_HD void optimizerElement(int64_t i, const OptimizerParams &p, const T *w, const T *g,
                               const T *m, const T *v, T *wOut, T *mOut, T *vOut) {
  double wi = static_cast<double>(w[i]);
  if (p.kind == 0) {
    wOut[i] =
        static_cast<T>(wi - p.lr * (static_cast<double>(g[i]) * p.gradScale + p.weightDecay * wi));
  } else if (p.kind == 1) {
    double gi = static_cast<double>(g[i]) * p.gradScale + p.weightDecay * wi;
    gi = p.momentum * static_cast<double>(m[i]) + gi;
    mOut[i] = static_cast<T>(gi);
    wOut[i] = static_cast<T>(wi - p.lr * gi);
  } else {
    double gi = static_cast<double>(g[i]) * p.gradScale;
    double mi = p.beta1 * static_cast<double>(m[i]) + (1 - p.beta1) * gi;
    double vi = p.beta2 * static_cast<double>(v[i]) + (1 - p.beta2) * gi * gi;
    mOut[i] = static_cast<T>(mi);
    vOut[i] = static_cast<T>(vi);
    wi -= p.lr * (mi / p.c1 / (sqrt(vi / p.c2) + p.epsilon) + p.weightDecay * wi);
    wOut[i] = static_cast<T>(wi);
  }
}

} // namespace pipec::cuda::kernels

#endif // PIPEC_RUNTIME_KERNELS_KERNELBODIES_H
