//===- Reshape.h - Reshape's target shape, resolved in one place ---------===//
//
// ONNX's Reshape takes a requested shape in which 0 copies the input's
// dimension at that position (unless allowzero, where 0 is a dimension of
// size 0) and one -1 is inferred from the element count. The CPU kernel
// (runtime/cpu/MovementKernels.cpp), the CUDA backend
// (runtime/cuda/CudaTensorOps.cpp) and constant folding
// (passes/fold/ShapeFolds.cpp) resolve it here.
//
//   input [2, 3, 4], requested [0, -1]:  [2, 12]
//   input [2, 0, 3], requested [0, -1]:  [2, 0]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_RESHAPE_H
#define PIPEC_OPS_RESHAPE_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <vector>

namespace pipec {

/// The shape Reshape makes of an input of shape \p in from \p requested.
/// Fails, for the caller to name the node, on two -1s, a 0 past the input's
/// rank, a dimension below -1, or a shape that does not hold the input's
/// elements; \p input is how the messages name the input ("float[2,3]").
llvm::Expected<std::vector<int64_t>> reshapeTarget(llvm::ArrayRef<int64_t> in,
                                                   llvm::ArrayRef<int64_t> requested,
                                                   bool allowZero, llvm::StringRef input);

} // namespace pipec

#endif // PIPEC_OPS_RESHAPE_H
