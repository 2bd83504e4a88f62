//===- GradKernels.h - CPU kernels for pipec's gradient ops -------------===//
//
// Kernels for the ops of domain "pipec" that the differentiate pass emits
// where ONNX has no op (ReluGrad, SoftmaxGrad, SumTo, GatherGrad, ...). Their
// inputs, outputs and attributes are specified in passes/Differentiate.h;
// like all of runtime/, this file only sees NodeProtos.
//
// Before:  node pipec.ReluGrad(dY = [1, -2, 3], X = [0.5, 1, -1])
// After:   dX = [1, -2, 0]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_GRADKERNELS_H
#define PIPEC_RUNTIME_CPU_GRADKERNELS_H

#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec::cpu {

/// Evaluates a pipec-domain gradient node. \p inputs holds one pointer per
/// node input, in order. Float and double element types. Returns one Tensor
/// per output; errors name the node and op.
llvm::Expected<std::vector<Tensor>> runGradOp(const onnx::NodeProto &node,
                                              llvm::ArrayRef<const Tensor *> inputs);

/// Routes domain "pipec" to runGradOp and every other node to runOp under
/// the default-domain \p opset.
llvm::Expected<std::vector<Tensor>> runAnyOp(const onnx::NodeProto &node, int64_t opset,
                                             llvm::ArrayRef<const Tensor *> inputs);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_GRADKERNELS_H
