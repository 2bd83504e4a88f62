//===- Elementwise.h - Element-wise and fused kernels, host and device ---===//
//
// The per-element bodies of the device's element-wise kernels and of fused
// programs. The math of each op is ElementMath.h's, by its ElemOp code, so
// the CPU kernels, the fused kernels and the device kernels compute one
// formula per op.
//
// Before:  FusedProgram {inputs 1; code: r1 = Tanh(r0); r2 = Mul(r0, r1)}
// After:   fusedElement(i) writes x[i] * tanh(x[i]) without a round trip
//          through memory
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_ELEMENTWISE_H
#define PIPEC_RUNTIME_KERNELS_ELEMENTWISE_H

#include "math/ElementMath.h"
#include "runtime/kernels/IndexMap.h"

#include <cstdint>
#include <limits>
#include <type_traits>

namespace pipec::kernels {

namespace detail {
// Templates, so that the branches an op does not have are discarded.
template <typename M, int Arity, typename T> PIPEC_HD T arithmetic(T a, T b) {
  if constexpr (Arity == 2 && (M::types == ElemTypes::Numeric ||
                               (M::types == ElemTypes::Float && std::is_floating_point_v<T>)))
    return static_cast<T>(M::value(a, b));
  else
    return a;
}
template <typename M, int Arity, typename T> PIPEC_HD bool compare(T a, T b) {
  if constexpr (Arity == 2 && (M::types == ElemTypes::Compare || M::types == ElemTypes::CompareAny))
    return M::value(a, b);
  else
    return false;
}

/// Binary \p op on a and b by its row of Ops.def: a comparison's bool when
/// \p Compare, else the arithmetic op's T.
template <bool Compare, typename T, typename R = std::conditional_t<Compare, bool, T>>
PIPEC_HD R binaryValue(ElemOp op, T a, T b) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    if constexpr (Compare)                                                                         \
      return compare<elem::ID, ARITY, T>(a, b);                                                    \
    else                                                                                           \
      return arithmetic<elem::ID, ARITY, T>(a, b);
#include "ops/Ops.def"
  }
  if constexpr (Compare)
    return false;
  else
    return a;
}
} // namespace detail

/// Binary \p op of one numeric type T (Add, Mul, Div, Pow, ...), as the CPU
/// kernel computes an element.
template <typename T> PIPEC_HD T arithmeticValue(ElemOp op, T a, T b) {
  return detail::binaryValue<false>(op, a, b);
}

/// Comparison \p op (Equal, Less, ...) of one type T.
template <typename T> PIPEC_HD bool compareValue(ElemOp op, T a, T b) {
  return detail::binaryValue<true>(op, a, b);
}

/// True for the binary ops that give bool.
constexpr bool isComparison(ElemOp op) {
  ElemTypes t = elemTypes(op);
  return t == ElemTypes::Compare || t == ElemTypes::CompareAny;
}

PIPEC_HD void unaryElement(int64_t i, ElemOp op, const ElemParams &p, const float *x, float *y) {
  y[i] = elemValue(op, x[i], 0.0f, p);
}

/// out[i] = op(a[.], b[.]) through a two-operand map, into bool for a
/// comparison (\p Compare).
template <bool Compare, typename T, typename R>
PIPEC_HD void binaryElement(int64_t i, ElemOp op, const IndexMap &map, const T *a, const T *b,
                            R *out) {
  int64_t off[MaxOperands];
  offsetsOf(map, i, off);
  out[i] = detail::binaryValue<Compare>(op, a[off[0]], b[off[1]]);
}

template <typename T>
PIPEC_HD void arithmeticElement(int64_t i, ElemOp op, const IndexMap &map, const T *a, const T *b,
                                T *out) {
  binaryElement<false>(i, op, map, a, b, out);
}

template <typename T>
PIPEC_HD void compareElement(int64_t i, ElemOp op, const IndexMap &map, const T *a, const T *b,
                             bool *out) {
  binaryElement<true>(i, op, map, a, b, out);
}

/// dx[i] = dy[i] * derivative of unary \p op at a[i] (UnaryGrad).
PIPEC_HD void gradientElement(int64_t i, ElemOp op, const ElemParams &p, const float *dy,
                              const float *a, float *dx) {
  dx[i] = elemGradient(op, dy[i], a[i], p);
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

/// out[i] = a[i] + b[i] (gradient accumulation; out may be a).
template <typename T> PIPEC_HD void addElement(int64_t i, const T *a, const T *b, T *out) {
  out[i] = a[i] + b[i];
}

template <typename T> PIPEC_HD void fillElement(int64_t i, T value, T *out) { out[i] = value; }

//===----------------------------------------------------------------------===//
// Fused element-wise programs
//===----------------------------------------------------------------------===//

/// Limits of one fused node (runtime/core/FusedProgram.h makes them; the
/// fusion pass never builds a larger one).
constexpr int MaxFusedInputs = 8;
constexpr int MaxFusedOps = 16;
constexpr int MaxFusedOutputs = 4;
constexpr int MaxFusedRegisters = MaxFusedInputs + MaxFusedOps;

/// One step: register dst = op(register a[, register b]), or for a gradient
/// step register a times the derivative of op at register b. Registers
/// 0..inputs-1 hold the inputs; step s writes register inputs + s.
struct FusedOp {
  ElemOp op = ElemOp::Add;
  bool gradient = false;
  int a = 0, b = 0;
  ElemParams params;
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
  return step.gradient ? elemGradient(step.op, a, b, step.params)
                       : elemValue(step.op, a, b, step.params);
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

} // namespace pipec::kernels

#endif // PIPEC_RUNTIME_KERNELS_ELEMENTWISE_H
