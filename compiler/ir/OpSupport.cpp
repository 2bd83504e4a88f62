//===- OpSupport.cpp - Which ops the pipec runtime executes ---------------===//
#include "compiler/ir/OpSupport.h"

#include "llvm/ADT/StringSet.h"

namespace pipec {

bool isRuntimeSupported(const Op &op) {
  // The op set of the CPU and CUDA backends: what transformer, MLP and CNN
  // exports use, forward and backward.
  static const llvm::StringSet<> supported = {"MatMul",
                                              "Gemm",
                                              "Add",
                                              "Sub",
                                              "Mul",
                                              "Div",
                                              "Relu",
                                              "Gelu",
                                              "Erf",
                                              "Tanh",
                                              "Sigmoid",
                                              "Softmax",
                                              "LayerNormalization",
                                              "Gather",
                                              "Reshape",
                                              "Transpose",
                                              "Concat",
                                              "Split",
                                              "Slice",
                                              "Squeeze",
                                              "Unsqueeze",
                                              "Where",
                                              "Cast",
                                              "Conv",
                                              "BatchNormalization",
                                              "MaxPool",
                                              "AveragePool",
                                              "GlobalAveragePool",
                                              "Flatten",
                                              "Dropout",
                                              "Identity",
                                              "Pow",
                                              "Sqrt",
                                              "ReduceMean",
                                              "ReduceSum",
                                              "Neg",
                                              "Exp",
                                              "Equal",
                                              "Expand",
                                              "Sum",
                                              "Softplus",
                                              "Constant",
                                              "ConstantOfShape",
                                              "SoftmaxCrossEntropyLoss",
                                              "Reciprocal",
                                              "Clip",
                                              "Shape",
                                              "Range",
                                              "Less",
                                              "Greater",
                                              "Not",
                                              "Min",
                                              "Max",
                                              "Abs",
                                              "Log",
                                              "HardSigmoid",
                                              "HardSwish"};
  return op.domain.empty() && supported.contains(op.opType);
}

bool isControlFlow(const Op &op) {
  return op.domain.empty() && (op.opType == "If" || op.opType == "Loop" || op.opType == "Scan");
}

} // namespace pipec
