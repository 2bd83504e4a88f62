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
#include <limits>

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

/// The tensor-parallel pair (Megatron-LM's f and g): TpCopy hands a
/// replicated value to every rank's shard of a split product, so its
/// gradient sums the ranks' partial gradients (TpAllReduce); TpAllReduce
/// sums the ranks' partial products into a replicated value, so its
/// gradient is the replicated gradient itself.
Error tpCopyGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i == 0)
      ctx.contribute(0, ctx.unary("TpAllReduce", ctx.dy(), "pipec"));
    return Error::success();
  });
}

/// Sequence parallelism's pairs (Korthikanti et al., 2022), each along the
/// forward node's axis and blocks: TpGatherCopy (all-gather for split
/// products, whose gradients are partial) and TpReduceScatter are each
/// other's gradient; TpAllGather (for replicated use) and TpScatter (each
/// rank's piece of a replicated value) too.
template <const char *Grad> Error tpPieceGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    if (i != 0)
      return Error::success();
    onnx::NodeProto &g = ctx.emit(Grad, {ctx.dy()}, "pipec");
    GradContext::setInt(g, "axis", attrInt(ctx.node(), "axis", 0));
    GradContext::setInt(g, "stride", attrInt(ctx.node(), "stride", 1));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}
constexpr char allGatherOp[] = "TpAllGather", reduceScatterOp[] = "TpReduceScatter",
               scatterOp[] = "TpScatter";

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

/// The gradient scatters dY back to the entries the slice read, zeros
/// elsewhere, one sliced axis at a time. Along an axis read with step q,
/// dY's entries are q apart: each is followed by q - 1 zeros (an axis of q
/// after it, flattened), and the whole is placed at the first entry read,
/// zeros before and after (the CPU backend has no Pad). A negative step
/// reads from the end: dY is reversed along the axis first, and placed at
/// the last entry read.
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
    if (ctx.node().input_size() > 4 && !ctx.node().input(4).empty() && steps.empty())
      return ctx.error("gradient needs constant steps");
    if (axes.empty())
      for (size_t k = 0; k < starts.size(); ++k)
        axes.push_back(static_cast<int64_t>(k));
    std::string g = ctx.dy();
    std::vector<int64_t> shape = ctx.yShape();
    for (size_t k = 0; k < axes.size(); ++k) {
      int64_t a = axes[k] < 0 ? axes[k] + static_cast<int64_t>(rank) : axes[k];
      int64_t dim = xShape[a], n = shape[a];
      int64_t step = k < steps.size() ? steps[k] : 1;
      if (step == 0)
        return ctx.error("a slice with step 0");
      int64_t start = starts[k] < 0 ? starts[k] + dim : starts[k];
      if (n == 0) {
        // Nothing read along this axis: the gradient is zeros.
        shape[a] = dim;
        g = ctx.binary("Expand", ctx.constScalar(0.0, ctx.type()), ctx.constInts(shape));
        continue;
      }
      int64_t first = std::clamp<int64_t>(start, 0, dim);
      if (step < 0) {
        // Read from start down: the last read entry is the lowest.
        first = std::clamp<int64_t>(start, 0, dim - 1) + (n - 1) * step;
        onnx::NodeProto &rev = ctx.emit(
            "Slice", {g, ctx.constInts({-1}), ctx.constInts({std::numeric_limits<int64_t>::min()}),
                      ctx.constInts({a}), ctx.constInts({-1})});
        g = GradContext::out(rev);
        step = -step;
      }
      if (step > 1) {
        // [.., n, ..] -> [.., n, 1, ..] ++ zeros [.., n, step - 1, ..] ->
        // [.., n * step, ..], then the entries up to X's end.
        std::vector<int64_t> one = shape, zeros = shape, spread = shape;
        one.insert(one.begin() + a + 1, 1);
        zeros.insert(zeros.begin() + a + 1, step - 1);
        spread[a] = n * step;
        std::string lifted = ctx.binary("Reshape", g, ctx.constInts(one));
        std::string zero =
            ctx.binary("Expand", ctx.constScalar(0.0, ctx.type()), ctx.constInts(zeros));
        onnx::NodeProto &cat = ctx.emit("Concat", {lifted, zero});
        GradContext::setInt(cat, "axis", a + 1);
        g = ctx.binary("Reshape", GradContext::out(cat), ctx.constInts(spread));
        int64_t kept = std::min(n * step, dim - first);
        if (kept < n * step)
          g = GradContext::out(ctx.emit(
              "Slice", {g, ctx.constInts({0}), ctx.constInts({kept}), ctx.constInts({a})}));
        n = kept;
      }
      shape[a] = n;
      int64_t before = first, after = dim - first - n;
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

/// dY with the padding row's reads zeroed, when the Gather's table has one
/// (Graph::paddingRows); else dY.
std::string withoutPaddingRow(GradContext &ctx) {
  auto pad = ctx.graph.paddingRows.find(ctx.node().input(0));
  if (pad == ctx.graph.paddingRows.end())
    return ctx.dy();
  std::string isPad = ctx.binary("Equal", ctx.in(1), ctx.constInts({pad->second}));
  std::vector<int64_t> trailing;
  for (size_t a = 1; a < ctx.shapeOf(0).size(); ++a)
    trailing.push_back(static_cast<int64_t>(ctx.shapeOf(1).size() + a - 1));
  if (!trailing.empty())
    isPad = ctx.binary("Unsqueeze", isPad, ctx.constInts(trailing));
  return GradContext::out(ctx.emit("Where", {isPad, ctx.constScalar(0.0, ctx.type()), ctx.dy()}));
}

/// The gradient for the data operand (an embedding table): dY scattered
/// back by the indices. The indices get none. A table with a padding row
/// (Graph::paddingRows, torch's padding_idx) takes no gradient there: dY is
/// zeroed where the index is that row.
Error gatherGrad(GradContext &ctx) {
  if (!ctx.graph.paddingRows.count(ctx.node().input(0)) || attrInt(ctx.node(), "axis", 0) != 0)
    return gatheredDataGrad(ctx, "GatherGrad", "axis");
  return ctx.ifDataWanted([&]() {
    onnx::NodeProto &g = ctx.emit("GatherGrad", {withoutPaddingRow(ctx), ctx.in(1)}, "pipec");
    GradContext::setInt(g, "axis", 0);
    GradContext::setInts(g, "shape", ctx.shapeOf(0));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

/// The vocabulary-parallel lookup (shard-tensors): each rank adds dY into
/// the rows of its share of the table (pipec.TpGatherGrad, run by the
/// executor, which knows the rank's share); the padding row takes none.
Error tpGatherGrad(GradContext &ctx) {
  return ctx.ifDataWanted([&]() {
    onnx::NodeProto &g = ctx.emit("TpGatherGrad", {withoutPaddingRow(ctx), ctx.in(1)}, "pipec");
    GradContext::setInts(g, "shape", ctx.shapeOf(0));
    ctx.contribute(0, GradContext::out(g));
    return Error::success();
  });
}

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
    resize{&resizeGrad, &onlyData}, tpCopy{&tpCopyGrad}, tpAllReduce{&identityGrad},
    tpGather{&tpGatherGrad, &onlyData}, tpAllGather{&tpPieceGrad<scatterOp>},
    tpGatherCopy{&tpPieceGrad<reduceScatterOp>}, tpReduceScatter{&tpPieceGrad<allGatherOp>},
    tpScatter{&tpPieceGrad<allGatherOp>};
} // namespace rules

} // namespace pipec::grad
