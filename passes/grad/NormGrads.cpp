//===- NormGrads.cpp - Gradients of reductions and normalizations --------===//
//
// ReduceSum and ReduceMean broadcast dY back over the reduced axes; Softmax,
// LayerNormalization and the cross-entropy loss have gradient kernels of
// their own (pipec.SoftmaxGrad, LayerNormGrad*, SoftmaxCrossEntropyLossGrad);
// RMS-, Instance- and GroupNormalization are composed of ONNX ops;
// BatchNormalization is differentiated in inference and training mode, its
// running statistics carrying no gradient; in training mode each
// microbatch's batch statistics update them after the step.
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include "llvm/ADT/STLExtras.h"

using namespace llvm;

namespace pipec::grad {
namespace {

/// Axes of a reduction, from the attribute (older opsets) or the constant
/// second input; normalised to be non-negative. Empty means all axes.
Expected<std::vector<int64_t>> reduceAxes(const GradContext &ctx, size_t rank) {
  const Op &op = ctx.op();
  std::vector<int64_t> axes;
  if (auto attr = attrInts(ctx.node(), "axes")) {
    axes = *attr;
  } else if (op.inputs.size() > 1 && op.inputs[1] >= 0) {
    const Value &a = ctx.val(op.inputs[1]);
    if (!a.constant)
      return ctx.error("axes must be a compile-time constant");
    for (int64_t i = 0; i < a.constant->numElements(); ++i)
      axes.push_back(a.constant->intAt(i));
  }
  for (int64_t &a : axes)
    if (a < 0)
      a += static_cast<int64_t>(rank);
  return axes;
}

/// ReduceSum and ReduceMean: dY broadcast back over the reduced axes (and
/// divided by their size for the mean).
Error reduceSumMeanGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() -> Error {
    bool mean = ctx.def()->id == OpId::ReduceMean;
    const std::vector<int64_t> &xShape = ctx.shapeOf(0);
    auto axes = reduceAxes(ctx, xShape.size());
    if (!axes)
      return axes.takeError();
    if (axes->empty() && !(!mean && attrInt(ctx.node(), "noop_with_empty_axes", 0)))
      for (size_t k = 0; k < xShape.size(); ++k)
        axes->push_back(static_cast<int64_t>(k));
    std::vector<int64_t> kept = xShape;
    int64_t count = 1;
    for (int64_t a : *axes) {
      count *= xShape[a];
      kept[a] = 1;
    }
    std::string g = ctx.binary("Expand", ctx.reshape(ctx.dy(), kept), ctx.constInts(xShape));
    if (mean)
      g = ctx.binary("Mul", g, ctx.constScalar(1.0 / double(count), ctx.type()));
    ctx.contribute(0, g);
    return Error::success();
  });
}

Error softmaxGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t) -> Error {
    int64_t opset = ctx.graph.opsetFor("");
    int64_t axis = attrInt(ctx.node(), "axis", opset >= 13 ? -1 : 1);
    if (opset < 13 && axis != static_cast<int64_t>(ctx.yShape().size()) - 1 && axis != -1)
      return ctx.error("gradient of pre-13 Softmax needs the last axis");
    onnx::NodeProto &g = ctx.emit("SoftmaxGrad", {ctx.dy(), ctx.y()}, "pipec");
    GradContext::setInt(g, "axis", axis);
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// For the scores; no class weights, reduction mean or sum.
Error softmaxCrossEntropyLossGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() -> Error {
    const Op &op = ctx.op();
    const onnx::NodeProto &node = ctx.node();
    if (op.inputs.size() > 2 && op.inputs[2] >= 0)
      return ctx.error("gradient with class weights is not implemented");
    std::string reduction = attrString(node, "reduction", "mean");
    if (reduction == "none")
      return ctx.error("gradient of reduction 'none' is not implemented");
    onnx::NodeProto &g =
        ctx.emit("SoftmaxCrossEntropyLossGrad", {ctx.dy(), ctx.in(0), ctx.in(1)}, "pipec");
    GradContext::setString(g, "reduction", reduction);
    if (const auto *ii = findAttr(node, "ignore_index"))
      GradContext::setInt(g, "ignore_index", ii->i());
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// The vocabulary-parallel loss (shard-tensors): its gradient needs the
/// whole row's softmax, so it is a collective of the stage's
/// tensor-parallel ranks too.
Error tpSoftmaxCrossEntropyLossGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() -> Error {
    const onnx::NodeProto &node = ctx.node();
    onnx::NodeProto &g =
        ctx.emit("TpSoftmaxCrossEntropyLossGrad", {ctx.dy(), ctx.in(0), ctx.in(1)}, "pipec");
    GradContext::setString(g, "reduction", attrString(node, "reduction", "mean"));
    if (const auto *ii = findAttr(node, "ignore_index"))
      GradContext::setInt(g, "ignore_index", ii->i());
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

Error layerNormalizationGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    int64_t axis = attrInt(ctx.node(), "axis", -1);
    float epsilon = attrFloat(ctx.node(), "epsilon", 1e-5f);
    if (i == 0 || i == 1) {
      bool input = i == 0;
      onnx::NodeProto &g =
          input ? ctx.emit("LayerNormGradInput", {ctx.dy(), ctx.in(0), ctx.in(1)}, "pipec")
                : ctx.emit("LayerNormGradWeight", {ctx.dy(), ctx.in(0)}, "pipec");
      GradContext::setInt(g, "axis", axis);
      GradContext::setFloat(g, "epsilon", epsilon);
      if (!input)
        GradContext::setInts(g, "shape", ctx.shapeOf(1));
      ctx.contribute(i, GradContext::out(g));
    } else {
      ctx.contribute(2, ctx.sumTo(ctx.dy(), ctx.yShape(), ctx.shapeOf(2)));
    }
    return Error::success();
  });
}

/// ReduceMean of \p x over \p axes, kept, in the form of the graph's opset
/// (axes an input from opset 18).
std::string meanOver(GradContext &ctx, const std::string &x, ArrayRef<int64_t> axes) {
  if (ctx.graph.opsetFor("") >= 18)
    return ctx.binary("ReduceMean", x, ctx.constInts(axes));
  onnx::NodeProto &node = ctx.emit("ReduceMean", {x});
  GradContext::setInts(node, "axes", axes);
  return GradContext::out(node);
}

/// Checks that X and the parameters share Y's element type.
Error sameTypes(const GradContext &ctx) {
  for (int id : ctx.op().inputs)
    if (id >= 0 && ctx.val(id).type != ctx.type())
      return ctx.error("gradient with inputs of another element type than Y is not implemented");
  return Error::success();
}

/// Inference form: Y = Scale (X - Mean) / sqrt(Var + epsilon) + B, the
/// running statistics being constants.
Error batchNormalizationInferenceGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const onnx::NodeProto &node = ctx.node();
    DType type = ctx.type();
    const std::vector<int64_t> &xShape = ctx.shapeOf(0);
    float epsilon = attrFloat(node, "epsilon", 1e-5f);
    if (i == 0) {
      // dX = dY Scale / sqrt(Var + epsilon), per channel.
      std::string rstd =
          ctx.unary("Sqrt", ctx.binary("Add", ctx.in(4), ctx.constScalar(epsilon, type)));
      std::string factor =
          ctx.channelsFirst(ctx.binary("Div", ctx.in(1), rstd), xShape[1], xShape.size());
      ctx.contribute(0, ctx.binary("Mul", ctx.dy(), factor));
    } else if (i == 1) {
      onnx::NodeProto &g =
          ctx.emit("BatchNormGradWeight", {ctx.dy(), ctx.in(0), ctx.in(3), ctx.in(4)}, "pipec");
      GradContext::setFloat(g, "epsilon", epsilon);
      ctx.contribute(1, GradContext::out(g));
    } else {
      ctx.contribute(2, ctx.sumToChannels(ctx.dy(), ctx.yShape()));
    }
    return Error::success();
  });
}

/// BatchNormalization in training mode (opset 14+) normalizes with the
/// batch's statistics.
bool batchNormTraining(const GradContext &ctx) {
  return ctx.graph.opsetFor("") >= 14 && attrInt(ctx.node(), "training_mode", 0);
}

/// Every axis of a rank-\p rank value but the channels, 1.
std::vector<int64_t> axesButChannels(size_t rank) {
  std::vector<int64_t> axes{0};
  for (size_t a = 2; a < rank; ++a)
    axes.push_back(static_cast<int64_t>(a));
  return axes;
}

/// The batch's moments per channel over \p axes (kept [1, C, 1..] shapes):
/// its mean, X - mean, and the biased variance the forward normalizes with.
struct BatchMoments {
  std::string mean, centred, variance;
};

BatchMoments batchMoments(GradContext &ctx, ArrayRef<int64_t> axes) {
  std::string x = ctx.in(0);
  std::string mean = meanOver(ctx, x, axes);
  std::string centred = ctx.binary("Sub", x, mean);
  return {mean, centred, meanOver(ctx, ctx.binary("Mul", centred, centred), axes)};
}

/// Training form: with Xh = (X - mean) rstd over the batch, per channel,
/// dX = Scale rstd (dY - mean(dY) - Xh mean(dY Xh)), dScale = sum(dY Xh)
/// and dB = sum(dY), the means and sums over every axis but 1.
Error batchNormalizationTrainingGrad(GradContext &ctx) {
  const std::vector<int64_t> &xShape = ctx.shapeOf(0);
  std::vector<int64_t> axes = axesButChannels(xShape.size());
  return ctx.forEachWanted([&](size_t i) -> Error {
    if (i == 2) {
      ctx.contribute(2, ctx.sumToChannels(ctx.dy(), ctx.yShape()));
      return Error::success();
    }
    BatchMoments moments = batchMoments(ctx, axes);
    float epsilon = attrFloat(ctx.node(), "epsilon", 1e-5f);
    std::string rstd = ctx.unary(
        "Reciprocal", ctx.unary("Sqrt", ctx.binary("Add", moments.variance,
                                                   ctx.constScalar(epsilon, ctx.type()))));
    std::string normalized = ctx.binary("Mul", moments.centred, rstd);
    std::string dyNormalized = ctx.binary("Mul", ctx.dy(), normalized);
    if (i == 1) {
      ctx.contribute(1, ctx.sumToChannels(dyNormalized, ctx.yShape()));
      return Error::success();
    }
    std::string inner =
        ctx.binary("Sub", ctx.binary("Sub", ctx.dy(), meanOver(ctx, ctx.dy(), axes)),
                   ctx.binary("Mul", normalized, meanOver(ctx, dyNormalized, axes)));
    std::string scale = ctx.channelsFirst(ctx.in(1), xShape[1], xShape.size());
    ctx.contribute(0, ctx.binary("Mul", inner, ctx.binary("Mul", scale, rstd)));
    return Error::success();
  });
}

Error batchNormalizationGrad(GradContext &ctx) {
  const Op &op = ctx.op();
  if (op.inputs.size() < 5 || llvm::is_contained(op.inputs, -1))
    return ctx.error("expects 5 inputs");
  for (size_t k = 1; k < 5; ++k)
    if (ctx.val(op.inputs[k]).type != ctx.type())
      return ctx.error("gradient with parameters of another element type than X is not "
                       "implemented");
  return batchNormTraining(ctx) ? batchNormalizationTrainingGrad(ctx)
                                : batchNormalizationInferenceGrad(ctx);
}

/// Training mode: each microbatch's batch mean and unbiased variance (n / (n
/// - 1) times the biased one, n values per channel) update the running mean
/// and variance (inputs 3 and 4, when they are initializers) after the step
/// with the node's momentum, as PyTorch's BatchNorm updates its buffers.
/// (ONNX's optional outputs 1 and 2 apply the biased variance; the forward
/// kernel computes those as ONNX says.)
Error batchNormalizationStatistics(GradContext &ctx) {
  const Op &op = ctx.op();
  if (!batchNormTraining(ctx) || op.inputs.size() < 5)
    return Error::success();
  auto isBuffer = [&](size_t k) {
    const Value &v = ctx.val(op.inputs[k]);
    return op.inputs[k] >= 0 && v.kind == ValueKind::Weight && v.producer < 0 &&
           isFloatDType(v.type);
  };
  if (!isBuffer(3) || !isBuffer(4))
    return Error::success();
  const std::vector<int64_t> &xShape = ctx.shapeOf(0);
  if (xShape.size() < 2)
    return ctx.error("X must have rank >= 2");
  int64_t count = 1;
  for (size_t a = 0; a < xShape.size(); ++a)
    if (a != 1)
      count *= xShape[a];
  if (count < 2)
    return ctx.error("training needs more than one value per channel; a microbatch has " +
                     Twine(count));
  std::vector<int64_t> axes = axesButChannels(xShape.size());
  float momentum = attrFloat(ctx.node(), "momentum", 0.9f);
  BatchMoments moments = batchMoments(ctx, axes);
  ctx.updateRunning(3, ctx.reshape(moments.mean, {xShape[1]}), momentum);
  std::string unbiased = ctx.binary("Mul", moments.variance,
                                    ctx.constScalar(double(count) / double(count - 1), ctx.type()));
  ctx.updateRunning(4, ctx.reshape(unbiased, {xShape[1]}), momentum);
  return Error::success();
}

/// RMSNormalization: with r = 1 / sqrt(mean(x^2) + epsilon) over the axes
/// [axis, rank) and n = x r, Y = n Scale. dX = r (g - n mean(g n)) for
/// g = dY Scale; dScale is dY n summed to Scale's shape.
Error rmsNormalizationGrad(GradContext &ctx) {
  if (Error e = sameTypes(ctx))
    return e;
  int64_t rank = static_cast<int64_t>(ctx.shapeOf(0).size());
  int64_t axis = attrInt(ctx.node(), "axis", -1);
  if (axis < 0)
    axis += rank;
  if (axis < 0 || axis >= rank)
    return ctx.error("axis out of range");
  std::vector<int64_t> axes;
  for (int64_t a = axis; a < rank; ++a)
    axes.push_back(a);
  float epsilon = attrFloat(ctx.node(), "epsilon", 1e-5f);
  return ctx.forEachWanted([&](size_t i) -> Error {
    std::string x = ctx.in(0);
    std::string meanSquare = meanOver(ctx, ctx.binary("Mul", x, x), axes);
    std::string r = ctx.unary(
        "Reciprocal",
        ctx.unary("Sqrt", ctx.binary("Add", meanSquare, ctx.constScalar(epsilon, ctx.type()))));
    std::string n = ctx.binary("Mul", x, r);
    if (i == 1) {
      ctx.contribute(1, ctx.sumTo(ctx.binary("Mul", ctx.dy(), n), ctx.yShape(), ctx.shapeOf(1)));
      return Error::success();
    }
    std::string g = ctx.binary("Mul", ctx.dy(), ctx.in(1));
    std::string projection = meanOver(ctx, ctx.binary("Mul", g, n), axes);
    ctx.contribute(0, ctx.binary("Mul", r, ctx.binary("Sub", g, ctx.binary("Mul", n, projection))));
    return Error::success();
  });
}

/// InstanceNormalization (\p groups 0: one group per channel) and
/// GroupNormalization. On X viewed as [N, G, K], n = (x - mean) s over K
/// with s = 1 / sqrt(var + epsilon), and Y = n Scale + B with Scale and B
/// per channel (per group for GroupNormalization before opset 21).
/// dX = s (g - mean(g) - n mean(g n)) for g = dY Scale; dScale and dB sum
/// dY n and dY per channel (or group).
Error groupStatisticsGrad(GradContext &ctx, bool grouped) {
  if (Error e = sameTypes(ctx))
    return e;
  const std::vector<int64_t> &xShape = ctx.shapeOf(0);
  if (xShape.size() < 2)
    return ctx.error("expects X of rank >= 2");
  int64_t batch = xShape[0], channels = xShape[1];
  int64_t groups = grouped ? attrInt(ctx.node(), "num_groups", 0) : channels;
  if (groups < 1 || channels % groups != 0)
    return ctx.error("num_groups must divide the channels");
  bool perGroup = grouped && ctx.graph.opsetFor("") < 21;
  int64_t elements = 1;
  for (int64_t d : xShape)
    elements *= d;
  std::vector<int64_t> viewShape{batch, groups,
                                 batch * groups == 0 ? 0 : elements / batch / groups};
  std::vector<int64_t> paramShape{groups, 1};
  float epsilon = attrFloat(ctx.node(), "epsilon", 1e-5f);
  return ctx.forEachWanted([&](size_t i) -> Error {
    if (i == 2 && !perGroup) {
      ctx.contribute(2, ctx.sumToChannels(ctx.dy(), ctx.yShape()));
      return Error::success();
    }
    std::string dyView = ctx.reshape(ctx.dy(), viewShape);
    if (i == 2) {
      ctx.contribute(2, ctx.reshape(ctx.sumTo(dyView, viewShape, paramShape), {groups}));
      return Error::success();
    }
    std::string x = ctx.reshape(ctx.in(0), viewShape);
    std::string centered = ctx.binary("Sub", x, meanOver(ctx, x, {2}));
    std::string var = meanOver(ctx, ctx.binary("Mul", centered, centered), {2});
    std::string s =
        ctx.unary("Reciprocal",
                  ctx.unary("Sqrt", ctx.binary("Add", var, ctx.constScalar(epsilon, ctx.type()))));
    std::string n = ctx.binary("Mul", centered, s);
    if (i == 1) {
      std::string dyn = ctx.binary("Mul", dyView, n);
      ctx.contribute(1, perGroup ? ctx.reshape(ctx.sumTo(dyn, viewShape, paramShape), {groups})
                                 : ctx.sumToChannels(ctx.reshape(dyn, xShape), ctx.yShape()));
      return Error::success();
    }
    std::string g =
        perGroup ? ctx.binary("Mul", dyView, ctx.reshape(ctx.in(1), paramShape))
                 : ctx.reshape(ctx.binary("Mul", ctx.dy(),
                                          ctx.channelsFirst(ctx.in(1), channels, xShape.size())),
                               viewShape);
    std::string centeredG = ctx.binary("Sub", g, meanOver(ctx, g, {2}));
    std::string projection = ctx.binary("Mul", n, meanOver(ctx, ctx.binary("Mul", g, n), {2}));
    std::string dx = ctx.binary("Mul", s, ctx.binary("Sub", centeredG, projection));
    ctx.contribute(0, ctx.reshape(dx, xShape));
    return Error::success();
  });
}

Error instanceNormalizationGrad(GradContext &ctx) { return groupStatisticsGrad(ctx, false); }
Error groupNormalizationGrad(GradContext &ctx) { return groupStatisticsGrad(ctx, true); }

/// The running mean and variance (inputs 3 and 4) are statistics, not
/// parameters: nothing flows back into them.
bool exceptStatistics(size_t input) { return input < 3; }

} // namespace

namespace rules {
const GradRule reduceSumMean{&reduceSumMeanGrad}, softmax{&softmaxGrad},
    softmaxCrossEntropyLoss{&softmaxCrossEntropyLossGrad},
    tpSoftmaxCrossEntropyLoss{&tpSoftmaxCrossEntropyLossGrad},
    layerNormalization{&layerNormalizationGrad},
    batchNormalization{&batchNormalizationGrad, &exceptStatistics, false,
                       &batchNormalizationStatistics},
    rmsNormalization{&rmsNormalizationGrad}, instanceNormalization{&instanceNormalizationGrad},
    groupNormalization{&groupNormalizationGrad};
} // namespace rules

} // namespace pipec::grad
