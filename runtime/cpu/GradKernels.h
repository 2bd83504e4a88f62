//===- GradKernels.h - CPU kernels for pipec's gradient ops -------------===//
//
// Kernels for the ops of domain "pipec" that the differentiate pass emits
// where ONNX has no op (UnaryGrad, SoftmaxGrad, SumTo, GatherGrad, ...). Their
// inputs, outputs and attributes are specified in passes/Differentiate.h;
// like all of runtime/, this file only sees NodeProtos. runOp runs them
// (KernelTable.h lists them).
//
// Before:  node pipec.UnaryGrad[op = "Relu"](dY = [1, -2, 3], X = [0.5, 1, -1])
// After:   dX = [1, -2, 0]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_GRADKERNELS_H
#define PIPEC_RUNTIME_CPU_GRADKERNELS_H

#include "runtime/cpu/Kernels.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec::cpu {

/// The same as runOp, by earlier names. (Kept until their callers move.)
inline llvm::Expected<std::vector<Tensor>> runGradOp(const onnx::NodeProto &node,
                                                     llvm::ArrayRef<const Tensor *> inputs) {
  return runOp(node, 0, inputs);
}
inline llvm::Expected<std::vector<Tensor>> runAnyOp(const onnx::NodeProto &node, int64_t opset,
                                                    llvm::ArrayRef<const Tensor *> inputs) {
  return runOp(node, opset, inputs);
}

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_GRADKERNELS_H
