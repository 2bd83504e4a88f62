//===- Window.h - Sliding windows of Conv and the pools on the CPU ------===//
//
// The geometry of a kernel sliding over 1 to 3 spatial dimensions (strides,
// dilations, pads, auto_pad, ceil_mode), read once from a node, and the
// im2col unfolding that turns a convolution into one GEMM, with its adjoint
// col2im. Conv, the pools, LpPool, ConvInteger, the Conv and pool gradients
// and ConvTranspose share them. The window is the device's
// kernels::ConvWindow, and im2col and col2im loop around the per-element
// bodies that the device's kernels loop around too
// (runtime/kernels/ConvBodies.h). Internal to runtime/cpu.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_WINDOW_H
#define PIPEC_RUNTIME_CPU_WINDOW_H

#include "runtime/cpu/KernelSupport.h"
#include "runtime/kernels/KernelBodies.h"
#include "support/Parallel.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <algorithm>

namespace pipec::cpu {

/// Sliding-window geometry of Conv and the pools: the device's window,
/// padded to three spatial dimensions (a 1-D or 2-D op gets leading
/// dimensions of size 1), and the op's own spatial rank.
struct Window : kernels::ConvWindow {
  static constexpr int maxRank = 3;
  int64_t rank = 0; ///< The op's own spatial rank.
  /// The op's output shape: [batch, channels] and the op's own rank of
  /// spatial output sizes.
  Shape outShape(int64_t batch, int64_t channels) const {
    Shape shape{batch, channels};
    shape.insert(shape.end(), out + maxRank - rank, out + maxRank);
    return shape;
  }
};

/// Reads strides, dilations, pads and auto_pad for a window of \p kernel
/// over \p spatial, and computes the output size (ceil_mode for pools).
/// Errors name the node: a malformed attribute, or more than 3 dimensions
/// (unsupported).
llvm::Expected<Window> windowGeometry(const OpContext &ctx, llvm::ArrayRef<int64_t> spatial,
                                      llvm::ArrayRef<int64_t> kernel, bool ceilMode);

/// The window of a pool (MaxPool, AveragePool, LpPool) over \p x
/// [N, C, spatial...]: kernel_shape and ceil_mode read from \p ctx's node,
/// the rest as windowGeometry reads it. Errors name the node: X of rank
/// below 3, kernel_shape missing or not matching X.
llvm::Expected<Window> poolWindow(const OpContext &ctx, const Tensor &x);

/// Conv of \p x by \p weight plus \p bias (optional) with the attributes of
/// \p ctx's node (group, kernel_shape, strides, dilations, pads, auto_pad):
/// float types, and int32 when \p int32 (ConvInteger, its zero points
/// subtracted). Errors name the node.
llvm::Expected<Outputs> convolve(const OpContext &ctx, const Tensor &x, const Tensor &weight,
                                 const Tensor *bias, bool int32);

/// Runs \p body(row) for each of \p rows rows of \p rowSize elements on the
/// loop threads, chunks of about 2^14 elements each (the element loops of
/// im2col, col2im, Conv's bias, the pools and their gradients).
template <typename F> void forEachRow(int64_t rows, int64_t rowSize, F &&body) {
  int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, rowSize));
  parallelFor(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      body(r);
  });
}

/// Unfolds one image's channels [channels, in...] into columns
/// [channels * kernel, out...] so that convolution becomes one GEMM, a row
/// of columns a call: any element type (ConvInteger unfolds int32).
template <typename T>
void im2col(const T *image, int64_t channels, const kernels::ConvWindow &w, T *columns) {
  kernels::Im2colParams p;
  p.w = w;
  p.channels = channels;
  int64_t outSize = w.outSize();
  forEachRow(p.rows(), outSize,
             [&](int64_t r) { kernels::im2colRun(r * outSize, outSize, p, image, columns); });
}

/// The adjoint of im2col: writes each element of the \p channels planes of
/// \p image as the sum of the column entries read from it, from T(0) with
/// the taps in increasing order (kernels::col2imAddRun over each channel's
/// rows in order; the channels on the loop threads). Pads may be negative.
template <typename T>
void col2im(const T *columns, int64_t channels, const kernels::ConvWindow &w, T *image) {
  kernels::Im2colParams p;
  p.w = w;
  p.channels = channels;
  int64_t taps = w.kernelSize(), outSize = w.outSize(), inSize = w.inSize();
  forEachRow(channels, taps * outSize, [&](int64_t c) {
    std::fill(image + c * inSize, image + (c + 1) * inSize, T(0));
    for (int64_t k = 0; k < taps; ++k)
      kernels::col2imAddRun((c * taps + k) * outSize, outSize, p, columns, image);
  });
}

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_WINDOW_H
