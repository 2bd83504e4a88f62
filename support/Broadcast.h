//===- Broadcast.h - numpy's broadcasting of two shapes ----------*- C++ -*-===//
//
// The shape two operands broadcast to, right-aligned as numpy and ONNX's
// multidirectional broadcasting say. The constant folder and the runtime's
// element-wise kernels both use it; each words its own error.
//
// Before:  [2, 1, 3] and [4, 1]
// After:   [2, 4, 3]
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_BROADCAST_H
#define PIPEC_SUPPORT_BROADCAST_H

#include "llvm/ADT/ArrayRef.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace pipec {

/// The shape \p a and \p b broadcast to, or nullopt when a dimension of one
/// is neither 1 nor the other's.
inline std::optional<std::vector<int64_t>> broadcastShape(llvm::ArrayRef<int64_t> a,
                                                          llvm::ArrayRef<int64_t> b) {
  size_t rank = std::max(a.size(), b.size());
  std::vector<int64_t> out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      return std::nullopt;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

} // namespace pipec

#endif // PIPEC_SUPPORT_BROADCAST_H
