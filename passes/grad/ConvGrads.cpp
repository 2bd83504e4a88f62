//===- ConvGrads.cpp - Gradients of convolutions and pools ---------------===//
//
// [N, C, d1..] layouts with 1 to 3 spatial dimensions. Conv's input and
// weight gradients and the window pools' input gradients are kernels of
// their own (pipec.ConvGradInput, ConvGradWeight, MaxPoolGrad,
// AveragePoolGrad) that take explicit pads; GlobalAveragePool's is dY
// spread evenly over the spatial extent.
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include <algorithm>

using namespace llvm;

namespace pipec::grad {
namespace {

/// X, W and the bias B.
Error convGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const std::vector<int64_t> &xShape = ctx.shapeOf(0), &wShape = ctx.shapeOf(1);
    if (i == 2) {
      ctx.contribute(2, ctx.sumToChannels(ctx.dy(), ctx.yShape()));
      return Error::success();
    }
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
const GradRule conv = {&convGrad};
const GradRule pool = {&poolGrad};
const GradRule globalAveragePool = {&globalAveragePoolGrad};
} // namespace rules

} // namespace pipec::grad
