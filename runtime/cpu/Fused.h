//===- Fused.h - Fused element-wise nodes: one pass for a chain of ops ---===//
//
// The executor (runtime/core/Fusion.h) replaces chains of float
// element-wise nodes of a stage program (a GELU written out as eight nodes,
// a bias add followed by a residual add, the scaling chains of backward) by
// one node of domain "pipec", op FusedElementwise. Its attribute "body" (a
// graph) holds the nodes it replaces, in order; its inputs are the values
// the body reads from outside, its outputs the body's values that are read
// after it.
//
// A backend compiles the body into a register program (KernelBodies.h:
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
#ifndef PIPEC_RUNTIME_CPU_FUSED_H
#define PIPEC_RUNTIME_CPU_FUSED_H

#include "runtime/core/Tensor.h"
#include "runtime/kernels/KernelBodies.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec::cpu {

inline constexpr llvm::StringLiteral FusedDomain = "pipec";
inline constexpr llvm::StringLiteral FusedOpType = "FusedElementwise";
/// A MatMul and the Add of a bias to its product (runtime/core/Fusion.h);
/// inputs A, B, bias; its body holds the two nodes.
inline constexpr llvm::StringLiteral MatMulBiasOpType = "MatMulBias";

/// The kernels' code of float unary op \p node (Gelu by its approximation;
/// LeakyRelu's slope into \p alpha), or nullopt. Shared by the fused and
/// the single-op kernels.
std::optional<cuda::kernels::Unary> unaryOpOf(const onnx::NodeProto &node, float *alpha);
/// Add, Sub, Mul, Div, Pow, Equal, Less or Greater.
std::optional<cuda::kernels::Binary> binaryOpOf(llvm::StringRef opType);
/// The pipec pointwise gradients: ReluGrad, TanhGrad, SigmoidGrad, ErfGrad,
/// GeluGrad (by its approximation).
std::optional<cuda::kernels::Pointwise> pointwiseOpOf(const onnx::NodeProto &node);

/// Whether \p node (at default-domain \p opset) can be a step of a fused
/// node: a float element-wise op the fused kernels compute exactly as its
/// own kernel does.
bool isFusable(const onnx::NodeProto &node, int64_t opset);

/// The steps \p node takes in a fused program (a Sum of n inputs takes
/// n - 1).
int fusedSteps(const onnx::NodeProto &node);

/// A fused node named \p name replacing \p body (in order), reading
/// \p inputs and producing \p outputs.
onnx::NodeProto makeFusedNode(const std::string &name, llvm::ArrayRef<const onnx::NodeProto *> body,
                              llvm::ArrayRef<std::string> inputs,
                              llvm::ArrayRef<std::string> outputs);

/// A fused node compiled for the kernels.
struct FusedKernel {
  cuda::kernels::FusedProgram program;
  /// Per output, a bit per input it depends on.
  uint32_t dependsOn[cuda::kernels::MaxFusedOutputs] = {};
};

/// Compiles \p node's body. Fails, naming the node, when the body has a step
/// that is not fusable, reads a value that is neither an input nor made
/// before, leaves an output unmade, or is over the kernels' limits.
llvm::Expected<FusedKernel> compileFused(const onnx::NodeProto &node, int64_t opset);

/// The shape of every output of \p kernel on \p inputs, when the fused
/// kernel can compute them: all inputs float32, broadcastable, and each
/// output's own inputs broadcast to the full shape. nullopt otherwise: the body then runs node by
/// node.
std::optional<std::vector<int64_t>> fusedShape(const FusedKernel &kernel,
                                               llvm::ArrayRef<const Tensor *> inputs);

/// The map that reads each input at an output element of \p shape; false
/// if the shape has too many dimensions after merging.
bool makeFusedMap(const std::vector<int64_t> &shape, llvm::ArrayRef<const Tensor *> inputs,
                  cuda::kernels::FusedMap &map);

/// Runs the body of fused \p node one node at a time through \p run; its
/// outputs are the fused node's.
llvm::Expected<std::vector<Tensor>>
runFusedBody(const onnx::NodeProto &node, llvm::ArrayRef<const Tensor *> inputs,
             llvm::function_ref<llvm::Expected<std::vector<Tensor>>(const onnx::NodeProto &,
                                                                    llvm::ArrayRef<const Tensor *>)>
                 run);

/// The CPU kernel of a fused node: blocks of elements, one op at a time
/// over a block, so that each op's loop is tight and the block stays in L1.
llvm::Expected<std::vector<Tensor>> runFused(const onnx::NodeProto &node, int64_t opset,
                                             llvm::ArrayRef<const Tensor *> inputs);

/// The bias length of MatMulBias \p node on \p inputs when the bias can be
/// added in a GEMM's epilogue: a body of MatMul then Add, A float32
/// [..., M, K], B float32 [K, N], the bias float32 with N elements along the
/// last axis (leading axes 1); nullopt otherwise (the body then runs node by
/// node).
std::optional<int64_t> epilogueBias(const onnx::NodeProto &node,
                                    llvm::ArrayRef<const Tensor *> inputs);

/// The CPU kernel of MatMulBias: the MatMul, then the bias added in place.
llvm::Expected<std::vector<Tensor>> runMatMulBias(const onnx::NodeProto &node, int64_t opset,
                                                  llvm::ArrayRef<const Tensor *> inputs);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_FUSED_H
