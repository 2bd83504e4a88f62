//===- ShapeGrads.cpp - Gradients of data movement -----------------------===//
//
// The gradient of an op that only moves data is dY moved back into the
// input's layout: reshaped, transposed back, summed over a broadcast,
// sliced out of a concatenation, padded back around a slice, scattered
// back from a lookup, or interpolated back through Resize's adjoint.
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "support/Attributes.h"

#include <algorithm>

using namespace llvm;

namespace pipec::grad {
namespace {

/// Identity, and Dropout as identity (inference-mode dropout).
Error identityGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0)
      ctx.contribute(0, ctx.dy());
    return Error::success();
  });
}

Error castGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) {
    onnx::NodeProto &cast = ctx.emit("Cast", {ctx.dy()});
    GradContext::setInt(cast, "to", static_cast<int64_t>(ctx.val(ctx.op().inputs[0]).type));
    ctx.contribute(0, GradContext::out(cast));
    return Error::success();
  });
}

/// Reshape, Flatten, Squeeze and Unsqueeze: dY in X's shape.
Error reshapeGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0)
      ctx.contribute(0, ctx.reshape(ctx.dy(), ctx.shapeOf(0)));
    return Error::success();
  });
}

/// dY transposed by the inverse permutation.
Error transposeGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) {
    size_t rank = ctx.shapeOf(0).size();
    std::vector<int64_t> perm;
    if (auto p = attrInts(ctx.node(), "perm"))
      perm = *p;
    else
      for (size_t k = 0; k < rank; ++k)
        perm.push_back(static_cast<int64_t>(rank - 1 - k));
    std::vector<int64_t> inverse(rank);
    for (size_t k = 0; k < rank; ++k)
      inverse[perm[k]] = static_cast<int64_t>(k);
    onnx::NodeProto &tr = ctx.emit("Transpose", {ctx.dy()});
    GradContext::setInts(tr, "perm", inverse);
    ctx.contribute(0, GradContext::out(tr));
    return Error::success();
  });
}

Error expandGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0)
      ctx.contribute(0, ctx.sumTo(ctx.dy(), ctx.yShape(), ctx.shapeOf(0)));
    return Error::success();
  });
}

/// Each input's part of dY, sliced out along the axis.
Error concatGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    int64_t axis = attrInt(ctx.node(), "axis", 0);
    if (axis < 0)
      axis += static_cast<int64_t>(ctx.yShape().size());
    int64_t start = 0;
    for (size_t k = 0; k < i; ++k)
      start += ctx.shapeOf(k)[axis];
    std::string g = GradContext::out(
        ctx.emit("Slice", {ctx.dy(), ctx.constInts({start}),
                           ctx.constInts({start + ctx.shapeOf(i)[axis]}), ctx.constInts({axis})}));
    ctx.contribute(i, g);
    return Error::success();
  });
}

/// The outputs' gradients concatenated, zeros for the outputs without one.
Error splitGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() {
    int64_t axis = attrInt(ctx.node(), "axis", 0);
    if (axis < 0)
      axis += static_cast<int64_t>(ctx.shapeOf(0).size());
    std::vector<std::string> parts;
    for (size_t k = 0; k < ctx.op().outputs.size(); ++k) {
      std::string part = ctx.dyOf(k);
      if (part.empty()) {
        const std::vector<int64_t> &shape = ctx.val(ctx.op().outputs[k]).shape;
        part = ctx.binary("Expand", ctx.constScalar(0.0, ctx.type()), ctx.constInts(shape));
      }
      parts.push_back(part);
    }
    onnx::NodeProto &g = ctx.emit("Concat", parts);
    GradContext::setInt(g, "axis", axis);
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// Step-1 slices only: the gradient pads dY back with zeros.
Error sliceGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() -> Error {
    const std::vector<int64_t> &xShape = ctx.shapeOf(0);
    size_t rank = xShape.size();
    std::vector<int64_t> starts = ctx.constantInput(1).value_or(std::vector<int64_t>{}),
                         axes = ctx.constantInput(3).value_or(std::vector<int64_t>{}),
                         steps = ctx.constantInput(4).value_or(std::vector<int64_t>{});
    if (ctx.graph.opsetFor("") < 10) {
      starts = attrInts(ctx.node(), "starts").value_or(std::vector<int64_t>{});
      axes = attrInts(ctx.node(), "axes").value_or(std::vector<int64_t>{});
    }
    if (starts.empty() && !xShape.empty())
      return ctx.error("gradient needs constant starts");
    for (int64_t s : steps)
      if (s != 1)
        return ctx.error("gradient of a slice with step != 1 is not implemented");
    if (axes.empty())
      for (size_t k = 0; k < starts.size(); ++k)
        axes.push_back(static_cast<int64_t>(k));
    // Zeros are concatenated before and after dY along each sliced axis
    // (the CPU backend has no Pad), growing it back to X's shape.
    std::string g = ctx.dy();
    std::vector<int64_t> shape = ctx.yShape();
    for (size_t k = 0; k < axes.size(); ++k) {
      int64_t a = axes[k] < 0 ? axes[k] + static_cast<int64_t>(rank) : axes[k];
      int64_t dim = xShape[a];
      int64_t s = std::clamp<int64_t>(starts[k] < 0 ? starts[k] + dim : starts[k], 0, dim);
      int64_t before = s, after = dim - s - shape[a];
      if (before == 0 && after == 0)
        continue;
      std::vector<std::string> parts;
      for (int64_t width : {before, int64_t(-1), after}) {
        if (width == 0)
          continue;
        if (width < 0) {
          parts.push_back(g);
          continue;
        }
        std::vector<int64_t> zeroShape = shape;
        zeroShape[a] = width;
        parts.push_back(
            ctx.binary("Expand", ctx.constScalar(0.0, ctx.type()), ctx.constInts(zeroShape)));
      }
      onnx::NodeProto &cat = ctx.emit("Concat", parts);
      GradContext::setInt(cat, "axis", a);
      g = GradContext::out(cat);
      shape[a] = dim;
    }
    ctx.contribute(0, g);
    return Error::success();
  });
}

/// The gradient for the data operand (an embedding table): dY scattered
/// back by the indices. The indices get none.
Error gatherGrad(GradContext &ctx) { return gatheredDataGrad(ctx, "GatherGrad", "axis"); }

/// Resize is linear in X: its gradient is the adjoint of the same
/// interpolation (pipec.ResizeGrad, which rereads the forward node's inputs
/// and attributes). roi, scales and sizes get none.
Error resizeGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) {
    std::vector<std::string> inputs{ctx.dy()};
    for (const std::string &name : ctx.node().input())
      inputs.push_back(name);
    onnx::NodeProto &g = ctx.emit("ResizeGrad", inputs, "pipec");
    for (const onnx::AttributeProto &a : ctx.node().attribute())
      *g.add_attribute() = a;
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

bool onlyData(size_t input) { return input == 0; }

} // namespace

namespace rules {
const GradRule identity{&identityGrad}, cast{&castGrad}, reshape{&reshapeGrad},
    transpose{&transposeGrad}, expand{&expandGrad}, concat{&concatGrad},
    split{&splitGrad, everyInput, /*allOutputs=*/true}, slice{&sliceGrad}, gather{&gatherGrad},
    resize{&resizeGrad, &onlyData};
} // namespace rules

} // namespace pipec::grad
