//===- ConvGrads.cpp - Gradients of convolutions and pools ---------------===//
//
// [N, C, d1..] layouts with 1 to 3 spatial dimensions. Conv's input and
// weight gradients and the window pools' input gradients are kernels of
// their own (pipec.ConvGradInput, ConvGradWeight, MaxPoolGrad,
// AveragePoolGrad) that take explicit pads; GlobalAveragePool's is dY
// spread evenly over the spatial extent. ConvTranspose, Conv's input
// gradient, differentiates through Conv and ConvGradWeight.
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include <algorithm>

using namespace llvm;

namespace pipec::grad {
namespace {

/// The bias B of a Conv or ConvTranspose: dY summed to its channels.
Error biasGrad(GradContext &ctx) {
  ctx.contribute(2, ctx.sumToChannels(ctx.dy(), ctx.yShape()));
  return Error::success();
}

/// X, W and the bias B.
Error convGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const std::vector<int64_t> &xShape = ctx.shapeOf(0), &wShape = ctx.shapeOf(1);
    if (i == 2)
      return biasGrad(ctx);
    // dX scatters W^T dY back through col2im; dW is dY times X's im2col
    // columns, transposed.
    onnx::NodeProto &g = i == 0 ? ctx.emit("ConvGradInput", {ctx.dy(), ctx.in(1)}, "pipec")
                                : ctx.emit("ConvGradWeight", {ctx.dy(), ctx.in(0)}, "pipec");
    std::vector<int64_t> kernel(wShape.begin() + std::min<size_t>(2, wShape.size()), wShape.end());
    if (Error err = ctx.setWindowAttrs(g, kernel, xShape, ctx.yShape()))
      return err;
    GradContext::setInt(g, "group", attrInt(ctx.node(), "group", 1));
    GradContext::setInts(g, "shape", i == 0 ? xShape : wShape);
    ctx.contribute(i, GradContext::out(g));
    return Error::success();
  });
}

/// ConvTranspose's window, its pads as ONNX resolves them (output_shape, then
/// auto_pad, then pads); an error where they would be negative (an output
/// longer than the full one), which Conv cannot take.
Expected<WindowAttrs> convTransposeWindow(GradContext &ctx, ArrayRef<int64_t> kernel,
                                          ArrayRef<int64_t> xShape, ArrayRef<int64_t> yShape) {
  const onnx::NodeProto &node = ctx.node();
  size_t rank = kernel.size();
  Expected<WindowAttrs> w = ctx.windowAttrs(rank);
  if (!w)
    return w.takeError();
  std::vector<int64_t> &pads = w->pads;
  std::vector<int64_t> outputPadding =
      attrInts(node, "output_padding").value_or(std::vector<int64_t>(rank, 0));
  if (outputPadding.size() != rank)
    return ctx.error("output_padding does not match the spatial rank");
  bool resolved = attrInts(node, "output_shape") || w->same();
  for (size_t d = 0; d < rank; ++d) {
    int64_t full = w->strides[d] * (xShape[d + 2] - 1) + outputPadding[d] +
                   (kernel[d] - 1) * w->dilations[d] + 1;
    if (resolved) {
      int64_t total = full - yShape[d + 2];
      if (total < 0)
        return ctx.error("gradient of an output longer than the full one is not implemented");
      std::tie(pads[d], pads[rank + d]) = w->samePads(total);
    }
  }
  return w;
}

/// ConvTranspose is Conv's input gradient: dX is Conv(dY, W) and dW the
/// weight gradient of that Conv with X as its output gradient, both over
/// ConvTranspose's strides, dilations and resolved pads.
Error convTransposeGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const std::vector<int64_t> &xShape = ctx.shapeOf(0), &wShape = ctx.shapeOf(1);
    if (i == 2)
      return biasGrad(ctx);
    size_t rank = xShape.size() < 3 ? 0 : xShape.size() - 2;
    if (rank < 1 || rank > 3 || wShape.size() != rank + 2)
      return ctx.error("gradient with " + Twine(int64_t(xShape.size()) - 2) +
                       " spatial dimensions is not implemented (1 to 3 are)");
    std::vector<int64_t> kernel(wShape.begin() + 2, wShape.end());
    Expected<WindowAttrs> w = convTransposeWindow(ctx, kernel, xShape, ctx.yShape());
    if (!w)
      return w.takeError();
    onnx::NodeProto &g = i == 0 ? ctx.emit("Conv", {ctx.dy(), ctx.in(1)})
                                : ctx.emit("ConvGradWeight", {ctx.in(0), ctx.dy()}, "pipec");
    GradContext::setInts(g, "kernel_shape", kernel);
    GradContext::setInts(g, "strides", w->strides);
    GradContext::setInts(g, "dilations", w->dilations);
    GradContext::setInts(g, "pads", w->pads);
    GradContext::setInt(g, "group", attrInt(ctx.node(), "group", 1));
    if (i == 1)
      GradContext::setInts(g, "shape", wShape);
    ctx.contribute(i, GradContext::out(g));
    return Error::success();
  });
}

/// MaxPool, AveragePool (output 0 only) and GlobalMaxPool, whose window is
/// the whole spatial extent.
Error poolGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) -> Error {
    OpId id = ctx.def()->id;
    const std::vector<int64_t> &xShape = ctx.shapeOf(0);
    std::vector<int64_t> kernel;
    if (id == OpId::GlobalMaxPool)
      kernel.assign(xShape.begin() + std::min<size_t>(2, xShape.size()), xShape.end());
    else if (auto k = attrInts(ctx.node(), "kernel_shape"))
      kernel = *k;
    else
      return ctx.error("missing attribute 'kernel_shape'");
    bool isMax = id != OpId::AveragePool;
    onnx::NodeProto &g = isMax ? ctx.emit("MaxPoolGrad", {ctx.dy(), ctx.in(0)}, "pipec")
                               : ctx.emit("AveragePoolGrad", {ctx.dy()}, "pipec");
    if (Error err = ctx.setWindowAttrs(g, kernel, xShape, ctx.yShape()))
      return err;
    if (!isMax) {
      GradContext::setInt(g, "count_include_pad", attrInt(ctx.node(), "count_include_pad", 0));
      GradContext::setInts(g, "shape", xShape);
    }
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

Error globalAveragePoolGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) {
    const std::vector<int64_t> &xShape = ctx.shapeOf(0);
    int64_t size = 1;
    for (size_t d = 2; d < xShape.size(); ++d)
      size *= xShape[d];
    std::string g = ctx.binary("Expand", ctx.dy(), ctx.constInts(xShape));
    ctx.contribute(0, ctx.binary("Mul", g, ctx.constScalar(1.0 / double(size), ctx.type())));
    return Error::success();
  });
}

} // namespace

namespace rules {
const GradRule conv{&convGrad}, convTranspose{&convTransposeGrad}, pool{&poolGrad},
    globalAveragePool{&globalAveragePoolGrad};
} // namespace rules

} // namespace pipec::grad
