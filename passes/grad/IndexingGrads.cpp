//===- IndexingGrads.cpp - Gradients of indexing, padding and scans -------===//
//
// The gradient of an op that selects elements goes back to where they came
// from: Trilu masks dY as it masked X, Pad slices dY back to X, a
// GatherElements or GatherND scatter-adds dY into zeros
// (pipec.GatherElementsGrad, pipec.GatherNDGrad), and so does TopK at the
// indices it chose; ScatterElements and ScatterND zero the scattered
// positions of dY for their data and gather them for their updates, and
// CumSum accumulates dY in the other direction. Indices, pads, axes and k
// get no gradient.
//
// Before:  y = CumSum(x, axis) [exclusive = 1]
// After:   grad:x = CumSum(dY, axis) [exclusive = 1, reverse = 1]
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "support/Attributes.h"

using namespace llvm;

namespace pipec::grad {
namespace {

/// dX = Trilu(dY, k): the elements Trilu kept pass their gradient.
Error triluGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() {
    std::vector<std::string> inputs = {ctx.dy()};
    if (ctx.node().input_size() > 1 && !ctx.in(1).empty())
      inputs.push_back(ctx.in(1));
    onnx::NodeProto &g = ctx.emit("Trilu", inputs);
    GradContext::setInt(g, "upper", attrInt(ctx.node(), "upper", 1));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// dX of y_i = sum_{j <= i} x_j is dx_j = sum_{i >= j} dy_i: the same scan
/// of dY (exclusive stays exclusive) in the other direction.
Error cumSumGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() {
    onnx::NodeProto &g = ctx.emit("CumSum", {ctx.dy(), ctx.in(1)});
    GradContext::setInt(g, "exclusive", attrInt(ctx.node(), "exclusive", 0));
    GradContext::setInt(g, "reverse", attrInt(ctx.node(), "reverse", 0) ? 0 : 1);
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// dData: dY added into zeros at the elements gathered (repeated indices
/// add up).
Error gatherElementsGrad(GradContext &ctx) {
  return gatheredDataGrad(ctx, "GatherElementsGrad", "axis");
}

/// dData: each slice of dY added into zeros at the slice its index tuple
/// gathered (repeated tuples add up).
Error gatherNDGrad(GradContext &ctx) { return gatheredDataGrad(ctx, "GatherNDGrad", "batch_dims"); }

/// dX: dValues added into zeros at the indices TopK chose (its output 1),
/// along its axis: the gradient of a GatherElements. K gets none.
Error topKGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() -> Error {
    const onnx::NodeProto &node = ctx.node();
    if (node.output_size() < 2 || node.output(1).empty())
      return ctx.error("gradient needs the Indices output");
    onnx::NodeProto &g = ctx.emit("GatherElementsGrad", {ctx.dy(), node.output(1)}, "pipec");
    GradContext::setInt(g, "axis", attrInt(node, "axis", -1));
    GradContext::setInts(g, "shape", ctx.shapeOf(0));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// ScatterElements and ScatterND: reduction none zeroes the scattered
/// positions of dY for data (\p scatter of zeros over dY) and gathers them
/// for the updates (\p gather); add passes dY to data whole. The other
/// reductions have no rule. ScatterElements works element by element along
/// its axis, which both nodes take.
Error scatterGrad(GradContext &ctx, StringRef scatter, StringRef gather) {
  std::string reduction = attrString(ctx.node(), "reduction", "none");
  if (reduction != "none" && reduction != "add")
    return ctx.error("gradient of " + scatter + " with reduction '" + reduction +
                     "' is not implemented");
  std::optional<int64_t> axis;
  if (scatter == "ScatterElements")
    axis = attrInt(ctx.node(), "axis", 0);
  auto withAxis = [&](onnx::NodeProto &node) {
    if (axis)
      GradContext::setInt(node, "axis", *axis);
    return GradContext::out(node);
  };
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0 && reduction == "add") {
      ctx.contribute(0, ctx.dy());
    } else if (i == 0) {
      std::string zeros =
          ctx.binary("Expand", ctx.constScalar(0.0, ctx.type()), ctx.constInts(ctx.shapeOf(2)));
      ctx.contribute(0, withAxis(ctx.emit(scatter, {ctx.dy(), ctx.in(1), zeros})));
    } else if (i == 2) {
      ctx.contribute(2, withAxis(ctx.emit(gather, {ctx.dy(), ctx.in(1)})));
    }
    return Error::success();
  });
}

Error scatterElementsGrad(GradContext &ctx) {
  return scatterGrad(ctx, "ScatterElements", "GatherElements");
}

Error scatterNDGrad(GradContext &ctx) { return scatterGrad(ctx, "ScatterND", "GatherND"); }

/// Pad's pads per dimension of X (begin..., end...), when they are constant.
Expected<std::vector<int64_t>> constantPads(GradContext &ctx, size_t rank) {
  int64_t opset = ctx.graph.opsetFor("");
  std::optional<std::vector<int64_t>> pads =
      opset >= 11 ? ctx.constantInput(1) : attrInts(ctx.node(), opset >= 2 ? "pads" : "paddings");
  if (!pads)
    return ctx.error("gradient needs constant pads");
  std::vector<int64_t> axes;
  if (opset >= 18 && ctx.node().input_size() > 3 && !ctx.in(3).empty()) {
    std::optional<std::vector<int64_t>> given = ctx.constantInput(3);
    if (!given)
      return ctx.error("gradient needs constant axes");
    axes = *given;
  } else {
    for (size_t d = 0; d < rank; ++d)
      axes.push_back(static_cast<int64_t>(d));
  }
  if (pads->size() != 2 * axes.size())
    return ctx.error("pads do not match the axes");
  std::vector<int64_t> full(2 * rank, 0);
  for (size_t k = 0; k < axes.size(); ++k) {
    int64_t a = axes[k] < 0 ? axes[k] + static_cast<int64_t>(rank) : axes[k];
    if (a < 0 || a >= static_cast<int64_t>(rank))
      return ctx.error("axis " + Twine(axes[k]) + " is out of range");
    full[a] = (*pads)[k];
    full[rank + a] = (*pads)[axes.size() + k];
  }
  return full;
}

/// Constant mode: dX is the part of dY that X filled, a Slice. Where
/// negative pads cropped X (or before opset 10, whose Slice takes
/// attributes), dY is padded by the negated pads instead: that crops what
/// was padded and puts zeros back where X was cropped.
Expected<std::string> padInputGrad(GradContext &ctx) {
  const std::vector<int64_t> &xShape = ctx.shapeOf(0);
  size_t rank = xShape.size();
  Expected<std::vector<int64_t>> pads = constantPads(ctx, rank);
  if (!pads)
    return pads.takeError();
  int64_t opset = ctx.graph.opsetFor("");
  bool crops = llvm::any_of(*pads, [](int64_t p) { return p < 0; });
  if (!crops && opset >= 10) {
    std::vector<int64_t> starts, ends, axes;
    for (size_t d = 0; d < rank; ++d) {
      starts.push_back((*pads)[d]);
      ends.push_back((*pads)[d] + xShape[d]);
      axes.push_back(static_cast<int64_t>(d));
    }
    return GradContext::out(ctx.emit(
        "Slice", {ctx.dy(), ctx.constInts(starts), ctx.constInts(ends), ctx.constInts(axes)}));
  }
  std::vector<int64_t> negated;
  for (int64_t p : *pads)
    negated.push_back(-p);
  if (opset >= 11)
    return ctx.binary("Pad", ctx.dy(), ctx.constInts(negated));
  onnx::NodeProto &g = ctx.emit("Pad", {ctx.dy()});
  GradContext::setInts(g, opset >= 2 ? "pads" : "paddings", negated);
  return GradContext::out(g);
}

/// dX as padInputGrad computes it; the constant (input 2) gets the sum of
/// dY over the padded positions: all of dY less what went to X.
Error padGrad(GradContext &ctx) {
  std::string mode = attrString(ctx.node(), "mode", "constant");
  if (mode != "constant")
    return ctx.error("gradient of Pad in mode '" + mode + "' is not implemented");
  return ctx.forEachWanted([&](size_t i) -> Error {
    if (i != 0 && i != 2)
      return Error::success();
    Expected<std::string> dx = padInputGrad(ctx);
    if (!dx)
      return dx.takeError();
    if (i == 0) {
      ctx.contribute(0, *dx);
      return Error::success();
    }
    auto total = [&](const std::string &t) {
      onnx::NodeProto &g = ctx.emit("ReduceSum", {t});
      GradContext::setInt(g, "keepdims", 0);
      return GradContext::out(g);
    };
    std::string padded = ctx.binary("Sub", total(ctx.dy()), total(*dx));
    ctx.contribute(2, ctx.reshape(padded, ctx.shapeOf(2)));
    return Error::success();
  });
}

} // namespace

Error gatheredDataGrad(GradContext &ctx, StringRef gradOp, StringRef attr) {
  return ctx.ifDataWanted([&]() {
    onnx::NodeProto &g = ctx.emit(gradOp, {ctx.dy(), ctx.in(1)}, "pipec");
    GradContext::setInt(g, attr, attrInt(ctx.node(), attr, 0));
    GradContext::setInts(g, "shape", ctx.shapeOf(0));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

namespace rules {
const GradRule trilu{&triluGrad}, cumSum{&cumSumGrad}, gatherElements{&gatherElementsGrad},
    gatherND{&gatherNDGrad}, scatterND{&scatterNDGrad}, scatterElements{&scatterElementsGrad},
    topK{&topKGrad}, pad{&padGrad};
} // namespace rules

} // namespace pipec::grad
