//===- OpCosts.h - The cost rules of Ops.def's COST column ---------------===//
//
// Every row of ops/Ops.def names one of the rules below in its COST column;
// an op without a row is costed by Default. A rule is two halves:
//
//   flops(graph, op)                 forward FLOPs (a multiply-add is two)
//   cost(graph, op, traffic, cost)   the forward bytes and the FLOPs and
//                                    bytes of the input (I) and weight (W)
//                                    gradients, from the forward FLOPs in
//                                    `cost` and the bytes the op reads and
//                                    writes
//
// The forward halves are the rules' own; the backward halves are shared
// (the *Backward bases): pointwise (I costs the forward FLOPs and reads the
// inputs and the output twice; with a weight operand, W is one pass over the
// output), movement (I moves the bytes back), view (free), default (I = F,
// and the op is reported as defaulted), and those of GEMMs, convolutions,
// attention and lookups.
//
// Before:  Ops.def  PIPEC_ELEMENTWISE(Erf, Onnx, "Erf", 9, 1, Pointwise<4>, ...)
// After:   an Erf of N output elements costs 4N FLOPs forward and 4N for I.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_OPCOSTS_H
#define PIPEC_COMPILER_COST_OPCOSTS_H

#include "compiler/ir/Graph.h"

#include <array>

namespace pipec {

/// Pass indices into the F / I / W arrays.
enum Pass { Forward = 0, BackwardInput = 1, BackwardWeight = 2 };

struct OpCost {
  std::array<double, 3> flops{};
  std::array<double, 3> bytes{};
  /// Matrix products (GEMM calls) per pass: each pays HardwareSpec::gemmOverhead.
  std::array<double, 3> gemms{};
  /// Bytes each pass sums over the stage's tensor-parallel ranks (a ring
  /// all-reduce on the intra-node link): TpAllReduce's forward, TpCopy's
  /// gradient.
  std::array<double, 3> tpSumBytes{};
  /// No rule for this op: the documented default was used.
  bool defaulted = false;
};

/// The bytes one op reads and writes, at the precision of the run.
struct OpTraffic {
  /// Bytes of the inputs that are not weights.
  double in = 0;
  /// Bytes of the weight inputs.
  double weights = 0;
  /// Bytes of the outputs.
  double out = 0;
  /// Elements of all outputs.
  double outElems = 0;
  /// Some input is a weight.
  bool anyWeight = false;
};

/// Forward FLOPs of \p op by its rule; precondition: shapes are inferred.
int64_t forwardFlops(const Graph &graph, const Op &op);

/// Fills \p cost by the rule of \p op: everything but the forward FLOPs,
/// which \p cost holds on entry.
void applyCostRule(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);

namespace cost {

// Backward halves -------------------------------------------------------------

/// I costs the forward FLOPs; a weight operand costs one pass over the
/// output in W (a bias, a norm's scale).
struct PointwiseBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// I = F, moving the inputs and outputs once; marks the cost defaulted.
struct DefaultBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// No FLOPs; I moves the bytes back.
struct MovementBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// Free both ways: no bytes move.
struct ViewBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// From a weight table: I costs the forward FLOPs and W a scatter-add of the
/// output; from an activation: I is a scatter of the output.
struct GatherBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// The GEMM once for I per activation operand, once for W per weight
/// operand; with \p Bias (Gemm's C) its FLOPs leave the GEMM and W sums the
/// bias gradient.
template <bool Bias> struct MatMulBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// An einsum of the forward FLOPs per operand: I for each activation
/// operand, W for each weight operand.
struct EinsumBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// F for I, and again for W when a weight is read.
struct ConvBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// 2F for I (the recomputed scores); F / 2 for W when a weight is read.
struct AttentionBackward {
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};

// The rules of the COST column ---------------------------------------------

/// K FLOPs per output element.
template <int K> struct Pointwise : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// One FLOP per output element.
struct Default : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Data movement: no FLOPs.
struct Movement : MovementBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// A reinterpretation of the input (Reshape, Squeeze, ...): no FLOPs.
struct View : ViewBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// A lookup into input 0: K FLOPs per element of output 0.
template <int K> struct Gather : GatherBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// A selection from input 0 (TopK): one FLOP per element of the largest
/// input; the gradient scatters the output back, as a lookup's does.
struct Select : GatherBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Output elements times the contracted dimension, times two.
struct MatMul : MatMulBackward<false> {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// MatMul's FLOPs, no gradient (integer GEMMs): defaulted backward.
struct MatMulNoGrad : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op) { return MatMul::flops(graph, op); }
};
/// MatMul's FLOPs (transA read), plus one per output element for C.
struct Gemm : MatMulBackward<true> {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// 2 * output elements * Cin / groups * kernel elements.
struct Conv : ConvBackward {
  static int64_t flops(const Graph &graph, const Op &op);
  /// The same with W as input \p weight.
  static int64_t flopsWith(const Graph &graph, const Op &op, size_t weight);
};
/// Conv's FLOPs with W as input \p Weight, no gradient (the integer
/// convolutions): defaulted backward.
template <size_t Weight> struct ConvNoGrad : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op) {
    return Conv::flopsWith(graph, op, Weight);
  }
};
/// 2 * input elements * Cout / groups * kernel elements.
struct ConvTranspose : ConvBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Two FLOPs per point of the product space of all labels (one with a
/// single operand); each operand's gradient is an einsum over the same
/// space (EinsumBackward).
struct Einsum : EinsumBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Q K^T and P V (4 B S T width) and the softmax (5 B S T); with
/// \p Projection, the fused input projection by input 1 too.
template <bool Projection> struct Attention : AttentionBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// pipec.ScaledDotProductAttention (ops/Attention.h), per head of m
/// queries, n keys, Q Kt of width k and V of width d: forward, Q Kt and P V
/// (2 m n (k + d)) and per score its steps, exponential and softmax
/// (ExpFlops); I, Q Kt again, dP, dV, dQ and dKt (2 m n (3 k + 2 d)), the
/// exponential again and dS; the bytes are Q, Kt, V and O (and the masks)
/// each way, the scores never leaving the kernel.
struct ScoresAttention {
  /// What one score's exponential and softmax (or its gradient) cost,
  /// counted in FLOPs of the GEMMs' kind (a polynomial exponential).
  static constexpr int64_t ExpFlops = 20;
  static int64_t flops(const Graph &graph, const Op &op);
  static void cost(const Graph &graph, const Op &op, const OpTraffic &traffic, OpCost &cost);
};
/// A sum over the stage's tensor-parallel ranks in pass \p P of its
/// output's bytes: no FLOPs; its time is the link's (CostModel).
template <Pass P> struct TpSum {
  static int64_t flops(const Graph &, const Op &) { return 0; }
  static void cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
    cost.tpSumBytes[P] = t.out;
  }
};
/// A reduce-scatter or an all-gather over the stage's tensor-parallel
/// ranks: half an all-reduce's ring (TpSum's time) of the whole tensor's
/// bytes (the input's when \p OfInput, else the output's), in the forward
/// when \p InForward and in the backward's input gradients when
/// \p InBackward.
template <bool OfInput, bool InForward, bool InBackward> struct TpHalfRing {
  static int64_t flops(const Graph &, const Op &) { return 0; }
  static void cost(const Graph &, const Op &, const OpTraffic &t, OpCost &cost) {
    double whole = OfInput ? t.in : t.out;
    if (InForward)
      cost.tpSumBytes[Forward] = whole / 2;
    if (InBackward)
      cost.tpSumBytes[BackwardInput] = whole / 2;
  }
};
/// TpAllGather: a split value gathered whole for replicated use.
struct AllGatherRing : TpHalfRing<false, true, false> {};
/// TpGatherCopy: gathered whole for split products; its gradient is
/// reduce-scattered.
struct GatherCopyRing : TpHalfRing<false, true, true> {};
/// TpReduceScatter: partial sums reduced to each rank's piece; its gradient
/// is all-gathered.
struct ReduceScatterRing : TpHalfRing<true, true, true> {};
/// TpScatter: each rank's piece of a replicated value, cut where it is;
/// its gradient is all-gathered.
struct ScatterRing : TpHalfRing<true, false, true> {};
/// K FLOPs per element of output 0.
template <int K> struct Norm : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// One FLOP per element of the largest input.
struct Reduce : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Reduce's FLOPs, no gradient rule costed: defaulted backward.
struct ReduceNoGrad : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op) { return Reduce::flops(graph, op); }
};
/// Output elements times the elements of kernel_shape.
struct Pool : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Pool's FLOPs, no gradient rule costed: defaulted backward.
struct PoolNoGrad : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op) { return Pool::flops(graph, op); }
};
/// K FLOPs per element of input 0 (the scores).
template <int K> struct Loss : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// One FLOP per output element for each input after the first.
struct Variadic : PointwiseBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};
/// Control flow (If, Loop, Scan): the body is not costed, one FLOP per
/// output element stands in (inspect warns about these ops).
struct Opaque : DefaultBackward {
  static int64_t flops(const Graph &graph, const Op &op);
};

} // namespace cost
} // namespace pipec

#endif // PIPEC_COMPILER_COST_OPCOSTS_H
