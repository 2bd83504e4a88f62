//===- Autocast.h - autocast: bf16 activations where the plan says bf16 ----===//
//
// In a training compile with --precision bf16 --autocast, rewrites the
// graph into the mixed precision of torch.autocast(dtype=torch.bfloat16) on
// CUDA (PyTorch's "Autocast Op Reference"): the products run on bf16 and
// write bf16, the ops that need range run on float32, and the rest run on
// the widest of their float inputs. Weights stay float32 (the masters the
// optimizer updates); each reader of one gets its own Cast to bf16 (a
// weight derived from it, as a tied head's Transpose: the product's
// gradient into it is a W gradient), whose gradient (a Cast back) is
// accumulated in float32. The graph's values then
// carry the types the device stores, and the memory model counts them as
// they are.
//
// Each float32 or bf16 input of an op, in graph order, by Ops.def's FLAGS:
//  - LowPrecision (MatMul, Gemm, Conv, ConvTranspose, Einsum, attention):
//    every float input is cast to bf16; the first output is bf16, the others
//    (attention's log-sum-exp) keep float32.
//  - FullPrecision (Softmax, LayerNormalization, Exp, Log, Pow, ReduceSum,
//    the losses, ...): every bf16 input is cast to float32.
//  - otherwise: float32 when an input computed at run time (an activation
//    or a graph input) is float32, and every bf16 input is cast up; bf16
//    when a bf16 input meets only weights and constants, which are cast
//    down (a linear's bias after its MatMul, a scalar of GELU's formula).
//  - Cast and CastLike keep their own rules; an op with subgraphs, or one
//    pipec does not know, gets the float32 its body or schema declares.
// A graph output the rewrite left bf16 is cast back to float32 under its
// own name.
//
// Before:  Y = MatMul(X, W); Z = Add(Y, B); P = Softmax(Z)
// After:   Xh = Cast(X, bf16); Wh = Cast(W, bf16); Y = MatMul(Xh, Wh) (bf16)
//          Bh = Cast(B, bf16); Z = Add(Y, Bh) (bf16)
//          Zf = Cast(Z, float); P = Softmax(Zf)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_AUTOCAST_H
#define PIPEC_PASSES_AUTOCAST_H

#include "compiler/ir/Graph.h"
#include "compiler/ir/LayerGraph.h"

namespace pipec {

/// What autocast did: the casts it inserted and the ops it made bf16.
struct AutocastReport {
  int casts = 0;
  int lowOps = 0;
};

/// Rewrites \p graph as above when it trains with autocast on, then groups
/// \p layers again; a graph without it is left as it is.
llvm::Expected<AutocastReport> autocast(Graph &graph, LayerGraph &layers);

} // namespace pipec

#endif // PIPEC_PASSES_AUTOCAST_H
