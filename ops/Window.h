//===- Window.h - Conv and pool window attributes, read in one place -----===//
//
// Conv, ConvTranspose, the pools and their gradients slide a window over
// the spatial dimensions. ONNX gives it as strides, dilations, pads (the
// begins of every spatial dimension, then the ends) and auto_pad. Every
// floor reads them here: the CPU kernels (runtime/cpu/MatrixKernels.cpp,
// SpatialKernels.cpp), the CUDA backend (runtime/cuda/CudaConvOps.cpp) and
// the gradient rules (passes/grad/GradContext.cpp, ConvGrads.cpp).
//
//   strides [2, 2], no dilations or pads, auto_pad VALID on 2 dimensions:
//   strides {2, 2}, dilations {1, 1}, pads {0, 0, 0, 0}, AutoPad::Valid
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_WINDOW_H
#define PIPEC_OPS_WINDOW_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace pipec {

enum class AutoPad { NotSet, Valid, SameUpper, SameLower };

struct WindowAttrs {
  std::vector<int64_t> strides, dilations;
  /// The begin pads of every spatial dimension, then the end pads; zero
  /// under auto_pad VALID.
  std::vector<int64_t> pads;
  AutoPad autoPad = AutoPad::NotSet;

  /// auto_pad SAME_UPPER or SAME_LOWER: the pads follow from the sizes.
  bool same() const { return autoPad == AutoPad::SameUpper || autoPad == AutoPad::SameLower; }
  /// SAME's split of \p total padding into (begin, end): the odd one at the
  /// end for SAME_UPPER, at the begin for SAME_LOWER.
  std::pair<int64_t, int64_t> samePads(int64_t total) const {
    int64_t begin = autoPad == AutoPad::SameUpper ? total / 2 : total - total / 2;
    return {begin, total - begin};
  }
};

/// The window attributes over \p rank spatial dimensions, from the values a
/// node gives (nullopt or "" where it gives none), ONNX's defaults filled
/// in: strides and dilations 1, pads 0, auto_pad NOTSET. Fails, for the
/// caller to name the node, when a list's length does not match the rank,
/// a stride or dilation is below 1 or a pad negative, or auto_pad is not
/// one of ONNX's four.
llvm::Expected<WindowAttrs> windowAttrs(int64_t rank, std::optional<std::vector<int64_t>> strides,
                                        std::optional<std::vector<int64_t>> dilations,
                                        std::optional<std::vector<int64_t>> pads,
                                        llvm::StringRef autoPad);

/// windowAttrs of a node through its attribute readers: \p ints(name) an
/// integer list or nullopt, \p text(name) a string or "".
template <class Ints, class Text>
llvm::Expected<WindowAttrs> readWindowAttrs(int64_t rank, Ints ints, Text text) {
  return windowAttrs(rank, ints("strides"), ints("dilations"), ints("pads"), text("auto_pad"));
}

} // namespace pipec

#endif // PIPEC_OPS_WINDOW_H
