//===- Fusion.h - Fusing element-wise chains of stage programs ----------===//
//
// Compile's fuse pass (driver/StagePasses.h) replaces chains of fusable
// element-wise nodes (runtime/core/FusedProgram.h: float unary, binary and
// pointwise-gradient ops) in each node list of a stage program by
// FusedElementwise nodes; the plan holds them, and the pass prices them
// (`compile --no-fuse` keeps every node its own kernel).
//
// A group is grown in program order: a fusable node joins the groups that
// make its inputs when the joined group can run at the node's position,
// which holds when no value the group makes is read by a node outside it
// that comes earlier. A value stays visible (becomes an output of the
// fused node) when a node outside the group reads it, or the stage program
// names it outside this node list (keep, send, outputs, gradient sums, the
// other node lists, the loss). Groups of one node stay as they are.
//
// Before:  t = Tanh(x); u = Add(t, one); y = Mul(x, u); z = MatMul(y, w)
// After:   y = FusedElementwise(x, one); z = MatMul(y, w)
//
// First, a MatMul by a 2-D Transpose (perm [1, 0]) that nothing else reads
// (a linear layer of torch's exporter: its weight is [out, in]) becomes one
// MatMulTransposed node: the GEMM reads the weight transposed, and no
// transposed copy is made. The CUDA backend runs its body.
//
// Before:  t = Transpose(w, perm=[1, 0]); y = MatMul(x, t)
// After:   y = MatMulTransposed(x, w)
//
// Then a MatMul whose product only an Add reads (a linear layer's bias)
// becomes one MatMulBias node (runtime/core/FusedProgram.h): the CUDA backend adds
// the bias in the GEMM's epilogue (cuBLASLt), the CPU in place. A
// MatMulTransposed keeps its Add (a residual is no bias for an epilogue).
//
// Before:  m = MatMul(x, w); y = Add(b, m)
// After:   y = MatMulBias(x, w, b)
//
// Before those, attention as torch's exporters write it out (two MatMuls
// around a Softmax, with a mask Add and a NaN guard or without) becomes
// one SoftmaxAttention node (runtime/core/FusedProgram.h) when nothing
// else reads the values between: the CPU computes each head's scores,
// softmax and product in cache, each step as its own kernel does.
//
// Before:  s = MatMul(q, k); z = Add(s, m); p = Softmax(z); o = MatMul(p, v)
// After:   o = SoftmaxAttention(q, k, v, m)
//
// Keys that torch's decomposition transposes and scales over the whole KV
// cache each decode step join it, and the CPU does that per head in cache:
//
// Before:  k = Mul(Reshape(Transpose(Reshape(key, merged)), split), c); ...
// After:   o = SoftmaxAttention(q, key, v, m, guard, c, merged, split)
//
// and so does grouped-query attention's repeat of the key and value heads
// (x = Reshape(Expand(Unsqueeze(heads, axes), wide), merged)): the CPU reads
// each head for the heads that share it rather than copying it for each.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_FUSION_H
#define PIPEC_RUNTIME_EXEC_FUSION_H

#include "plan/plan.pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>

namespace pipec::rt {

struct FusionStats {
  /// Fused element-wise nodes made, and the nodes they replace.
  int64_t groups = 0, nodes = 0;
  /// MatMulBias nodes made (each replacing a MatMul and an Add).
  int64_t matMulBias = 0;
  /// MatMulTransposed nodes made (each replacing a Transpose and a MatMul).
  int64_t matMulTransposed = 0;
  /// SoftmaxAttention nodes made (each replacing attention's two MatMuls,
  /// its Softmax and its mask and NaN-guard nodes).
  int64_t softmaxAttention = 0;

  FusionStats &operator+=(const FusionStats &other) {
    groups += other.groups;
    nodes += other.nodes;
    matMulBias += other.matMulBias;
    softmaxAttention += other.softmaxAttention;
    matMulTransposed += other.matMulTransposed;
    return *this;
  }
};

/// Fuses the three node lists of \p program in place; \p opset is the
/// plan's default-domain opset and \p read the values the executor reads
/// by name besides the program's own lists (the loss and its label count).
FusionStats fuseStageProgram(plan::StageProgram &program, int64_t opset,
                             llvm::ArrayRef<std::string> read = {});

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_FUSION_H
