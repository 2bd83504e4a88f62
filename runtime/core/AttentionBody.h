//===- AttentionBody.h - Fused attention as the ops it stands for ---------===//
//
// pipec.ScaledDotProductAttention and its gradient (ops/Attention.h) written
// out as default-domain ONNX ops, one at a time: MatMul, the score steps
// (Mul, Div, Add, Where), Softmax, the NaN guard, and for the log-sum-exp
// LogSoftmax and ReduceSum (ops the CUDA backend has kernels for); the
// gradient's Transposes and products besides. A backend without kernels of its own for the two
// nodes runs this body with the kernels it has (the CUDA backend); the CPU's kernels are held to it
// in tests.
//
// It materialises the scores, as the nodes an exporter wrote did; only the
// fused kernels keep them per head.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_ATTENTIONBODY_H
#define PIPEC_RUNTIME_CORE_ATTENTIONBODY_H

#include "onnx/onnx_pb.h"

#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec {

/// The body of \p node, a ScaledDotProductAttention or its gradient whose
/// Q has \p rank dimensions, at default-domain \p opset (13 or later): its
/// values are \p node's inputs and outputs by name, its temporaries named
/// "sdpa:N". An error names a node of another op or malformed attributes.
llvm::Expected<onnx::GraphProto> attentionBody(const onnx::NodeProto &node, int64_t rank,
                                               int64_t opset);

} // namespace pipec

#endif // PIPEC_RUNTIME_CORE_ATTENTIONBODY_H
