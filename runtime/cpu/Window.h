//===- Window.h - Sliding windows of Conv and the pools on the CPU ------===//
//
// The geometry of a kernel sliding over 1 to 3 spatial dimensions (strides,
// dilations, pads, auto_pad, ceil_mode), read once from a node, and the
// im2col unfolding that turns a convolution into one GEMM. Conv, the pools,
// LpPool and ConvInteger share them. Internal to runtime/cpu.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_WINDOW_H
#define PIPEC_RUNTIME_CPU_WINDOW_H

#include "runtime/cpu/KernelSupport.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <algorithm>
#include <array>

namespace pipec::cpu {

/// Sliding-window geometry of Conv and the pools, padded to three spatial
/// dimensions: a 1-D or 2-D op gets leading dimensions of size 1.
struct Window {
  static constexpr int maxRank = 3;
  int64_t rank = 0; ///< The op's own spatial rank.
  std::array<int64_t, maxRank> in, kernel, stride, dilation, padBegin, padEnd, out;
  int64_t outSize() const { return out[0] * out[1] * out[2]; }
  int64_t inSize() const { return in[0] * in[1] * in[2]; }
  int64_t kernelSize() const { return kernel[0] * kernel[1] * kernel[2]; }
  /// The op's output shape: [batch, channels] and the op's own rank of
  /// spatial output sizes.
  Shape outShape(int64_t batch, int64_t channels) const {
    Shape shape{batch, channels};
    shape.insert(shape.end(), out.end() - rank, out.end());
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

/// Unfolds one image's channels [channels, in...] into columns
/// [channels * kernel, out...] so that convolution becomes one GEMM.
template <typename T> void im2col(const T *image, int64_t channels, const Window &w, T *columns) {
  int64_t outSize = w.outSize();
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t kd = 0; kd < w.kernel[0]; ++kd)
      for (int64_t kh = 0; kh < w.kernel[1]; ++kh)
        for (int64_t kw = 0; kw < w.kernel[2]; ++kw) {
          T *row =
              columns + (((c * w.kernel[0] + kd) * w.kernel[1] + kh) * w.kernel[2] + kw) * outSize;
          for (int64_t od = 0; od < w.out[0]; ++od) {
            int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
            for (int64_t oh = 0; oh < w.out[1]; ++oh) {
              int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
              T *dst = row + (od * w.out[1] + oh) * w.out[2];
              if (id < 0 || id >= w.in[0] || ih < 0 || ih >= w.in[1]) {
                std::fill(dst, dst + w.out[2], T(0));
                continue;
              }
              const T *src = image + ((c * w.in[0] + id) * w.in[1] + ih) * w.in[2];
              for (int64_t ow = 0; ow < w.out[2]; ++ow) {
                int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
                dst[ow] = iw >= 0 && iw < w.in[2] ? src[iw] : T(0);
              }
            }
          }
        }
}

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_WINDOW_H
