//===- FusedProgram.h - Fused element-wise nodes, compiled for a kernel --===//
//
// The executor (runtime/exec/Fusion.h) replaces chains of float
// element-wise nodes of a stage program (a GELU written out as eight nodes,
// a bias add followed by a residual add, the scaling chains of backward) by
// one node of domain "pipec", op FusedElementwise. Its attribute "body" (a
// graph) holds the nodes it replaces, in order; its inputs are the values
// the body reads from outside, its outputs the body's values that are read
// after it.
//
// Which nodes may join is the registry's: an element-wise row whose math
// maps floats to floats (math/ElementMath.h), a Sum, or a
// UnaryGrad, with no attributes but those their math reads. A backend
// compiles the body into a register program (kernels/Elementwise.h:
// FusedProgram) and runs it in one pass over the output: each element read
// once, each op exactly as its own kernel computes it, nothing in between
// written to memory. When the inputs are not all float32, or an output
// would be smaller than the others (it depends only on broadcast inputs),
// the body runs node by node instead, as if it had never been fused.
//
// Before:  y = Mul(x, Add(Tanh(x), one))               3 nodes, 3 passes
// After:   y = FusedElementwise[body = the 3 nodes](x, one)   1 pass
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_FUSEDPROGRAM_H
#define PIPEC_RUNTIME_CORE_FUSEDPROGRAM_H

#include "runtime/core/Tensor.h"
#include "runtime/kernels/Elementwise.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace onnx {
class GraphProto;
class NodeProto;
} // namespace onnx

namespace pipec {

inline constexpr llvm::StringLiteral FusedDomain = "pipec";
inline constexpr llvm::StringLiteral FusedOpType = "FusedElementwise";
/// A MatMul and the Add of a bias to its product (runtime/exec/Fusion.h);
/// inputs A, B, bias; its body holds the two nodes.
inline constexpr llvm::StringLiteral MatMulBiasOpType = "MatMulBias";
/// A MatMul whose B is a 2-D Transpose (perm [1, 0]) that nothing else
/// reads (runtime/exec/Fusion.h): Y = A W^T; inputs A and W, its body the
/// Transpose and the MatMul.
inline constexpr llvm::StringLiteral MatMulTransposedOpType = "MatMulTransposed";
/// Attention's products and softmax (runtime/exec/Fusion.h):
/// O = MatMul(Softmax(MatMul(Q, K) [+ mask]) [NaN -> c], V); its inputs are
/// AttentionInput's, absent ones empty and trailing ones left off; its body
/// the nodes it replaces.
inline constexpr llvm::StringLiteral SoftmaxAttentionOpType = "SoftmaxAttention";

/// A SoftmaxAttention node's inputs, in order (runtime/exec/Fusion.cpp says
/// which nodes each chain stands for).
enum AttentionInput : int {
  AttentionQuery,
  AttentionKeys,   // the product's K, or the cache's keys under the chains below
  AttentionValues, // V, or the cache's values under the chains below
  AttentionMask,
  AttentionGuard, // the NaN guard's c
  // The keys' transpose and scale: Mul(Reshape(Transpose(Reshape(keys,
  // merged)), split), scale).
  AttentionKeyScale,
  AttentionKeyMerged,
  AttentionKeySplit,
  // Grouped-query repeats: Reshape(Expand(Unsqueeze(x, axes), wide), heads).
  AttentionKeyAxes,
  AttentionKeyWide,
  AttentionKeyHeads,
  AttentionValueAxes,
  AttentionValueWide,
  AttentionValueHeads,
  // A KV cache's Concat(past, appended): the keys and values are the past.
  AttentionKeysAppended,
  AttentionValuesAppended,
  AttentionInputs
};

/// The fused step of \p node (at default-domain \p opset), or nullopt when
/// it cannot be one: not a float element-wise op the fused kernels compute
/// exactly as its own kernel does, or with attributes its math does not
/// read.
std::optional<kernels::FusedOp> fusedStepOf(const onnx::NodeProto &node, int64_t opset);

/// Whether \p node can be a step of a fused node.
bool isFusable(const onnx::NodeProto &node, int64_t opset);

/// The steps \p node takes in a fused program (a Sum of n inputs takes
/// n - 1).
int fusedSteps(const onnx::NodeProto &node);

/// The body graph of a fused, MatMulBias, MatMulTransposed or
/// SoftmaxAttention node, or null.
const onnx::GraphProto *fusedBodyOf(const onnx::NodeProto &node);

/// A fused node named \p name replacing \p body (in order), reading
/// \p inputs and producing \p outputs.
onnx::NodeProto makeFusedNode(const std::string &name, llvm::ArrayRef<const onnx::NodeProto *> body,
                              llvm::ArrayRef<std::string> inputs,
                              llvm::ArrayRef<std::string> outputs);

/// A fused node compiled for the kernels.
struct FusedKernel {
  kernels::FusedProgram program;
  /// Per output, a bit per input it depends on.
  uint32_t dependsOn[kernels::MaxFusedOutputs] = {};
};

/// Compiles \p node's body. Fails, naming the node, when the body has a step
/// that is not fusable, reads a value that is neither an input nor made
/// before, leaves an output unmade, or is over the kernels' limits.
llvm::Expected<FusedKernel> compileFused(const onnx::NodeProto &node, int64_t opset);

/// The shape of every output of \p kernel on \p inputs, when the fused
/// kernel can compute them: all inputs float32, broadcastable, and each
/// output's own inputs broadcast to the full shape. nullopt otherwise: the
/// body then runs node by node.
std::optional<std::vector<int64_t>> fusedShape(const FusedKernel &kernel,
                                               llvm::ArrayRef<const cpu::Tensor *> inputs);

/// The map that reads each input at an output element of \p shape; false
/// if the shape has too many dimensions after merging.
bool makeFusedMap(const std::vector<int64_t> &shape, llvm::ArrayRef<const cpu::Tensor *> inputs,
                  kernels::FusedMap &map);

/// Runs the body of fused \p node one node at a time through \p run; its
/// outputs are the fused node's.
llvm::Expected<std::vector<cpu::Tensor>>
runFusedBody(const onnx::NodeProto &node, llvm::ArrayRef<const cpu::Tensor *> inputs,
             llvm::function_ref<llvm::Expected<std::vector<cpu::Tensor>>(
                 const onnx::NodeProto &, llvm::ArrayRef<const cpu::Tensor *>)>
                 run);

/// Runs \p body, the steps that compute \p node, one node at a time through
/// \p run: its values start as \p node's inputs, by name, and end as its
/// outputs.
llvm::Expected<std::vector<cpu::Tensor>>
runBodyGraph(const onnx::GraphProto &body, const onnx::NodeProto &node,
             llvm::ArrayRef<const cpu::Tensor *> inputs,
             llvm::function_ref<llvm::Expected<std::vector<cpu::Tensor>>(
                 const onnx::NodeProto &, llvm::ArrayRef<const cpu::Tensor *>)>
                 run);

/// The bias length of MatMulBias \p node on \p inputs when the bias can be
/// added in a GEMM's epilogue: a body of MatMul then Add, A float32
/// [..., M, K], B float32 [K, N], the bias float32 with N elements along the
/// last axis (leading axes 1); nullopt otherwise (the body then runs node by
/// node).
std::optional<int64_t> epilogueBias(const onnx::NodeProto &node,
                                    llvm::ArrayRef<const cpu::Tensor *> inputs);

} // namespace pipec

#endif // PIPEC_RUNTIME_CORE_FUSEDPROGRAM_H
