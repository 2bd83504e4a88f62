//===- LinearGrads.cpp - Gradients of MatMul and Gemm --------------------===//
//
// Products with the other operand, transposed. A 2-D weight's gradient is
// one GEMM over every batch row folded together; batched operands are
// summed back over the dimensions they were broadcast along.
//
// A product by a transposed weight (torch's Linear: MatMul(X, Transpose(W)))
// reads W itself in the backward, and W's gradient is one GEMM of the
// transposed operands; the transposed copy is then read by the forward only.
//
// Before:  dX = Gemm(dY, Wt, transB=1); dWt = Gemm(X, dY, transA=1);
//          dW = Transpose(dWt)
// After:   dX = Gemm(dY, W); dW = Gemm(dY, X, transA=1)
//
//===----------------------------------------------------------------------===//
#include "passes/grad/GradRules.h"

#include "support/Attributes.h"

using namespace llvm;

namespace pipec::grad {
namespace {

/// True when B = Transpose(W) of a 2-D weight W in the layer at hand
/// (transposedWeight) and this MatMul is B's only reader: W's gradient is
/// then dY^T A, one GEMM, and neither B's gradient nor its Transpose back is
/// made.
bool gradIntoTransposedWeight(const GradContext &ctx) {
  if (ctx.transposedWeight(1) < 0)
    return false;
  int self = static_cast<int>(&ctx.op() - ctx.graph.ops.data());
  const std::vector<int> &users = ctx.val(ctx.op().inputs[1]).users;
  return users.size() == 1 && users[0] == self;
}

Error matMulGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) -> Error {
    const std::vector<int64_t> &a = ctx.shapeOf(0), &b = ctx.shapeOf(1);
    const std::vector<int64_t> &yShape = ctx.yShape();
    if (a.size() < 2 || b.size() < 2)
      return ctx.error("gradient of a 1-D MatMul operand is not implemented");
    if (i == 0 && b.size() == 2) {
      // dA = dY B^T as one GEMM over the folded batch rows: the BLAS reads B
      // transposed, so no transposed copy of the weight is made. B =
      // Transpose(W) reads W as it is, so that B dies with the forward.
      int64_t n = yShape.back();
      bool fromWeight = ctx.transposedWeight(1) >= 0;
      onnx::NodeProto &g = ctx.emit("Gemm", {ctx.reshape(ctx.dy(), {-1, n}),
                                             fromWeight ? ctx.transposedWeightName(1) : ctx.in(1)});
      GradContext::setInt(g, "transB", fromWeight ? 0 : 1);
      std::vector<int64_t> gShape = yShape;
      gShape.back() = a.back();
      ctx.contribute(0, ctx.sumTo(ctx.reshape(GradContext::out(g), gShape), gShape, a));
    } else if (i == 0) {
      // dA = dY B^T, summed over broadcast batch dimensions.
      std::string g = ctx.binary("MatMul", ctx.dy(), ctx.transposeLast2(ctx.in(1), b.size()));
      std::vector<int64_t> gShape = yShape;
      gShape.back() = a.back();
      ctx.contribute(0, ctx.sumTo(g, gShape, a));
    } else if (b.size() == 2) {
      // dB = A^T dY with every batch dimension folded into the rows.
      int64_t k = a.back(), n = yShape.back();
      bool direct = gradIntoTransposedWeight(ctx);
      if (direct)
        ctx.sinkFor(ctx.transposedWeight(1));
      std::string a2 = ctx.reshape(ctx.in(0), {-1, k});
      std::string dy2 = ctx.reshape(ctx.dy(), {-1, n});
      if (direct) {
        onnx::NodeProto &g = ctx.emit("Gemm", {dy2, a2});
        GradContext::setInt(g, "transA", 1);
        ctx.addContribution(ctx.transposedWeight(1), GradContext::out(g));
        return Error::success();
      }
      onnx::NodeProto &g = ctx.emit("Gemm", {a2, dy2});
      GradContext::setInt(g, "transA", 1);
      ctx.contribute(1, GradContext::out(g));
    } else {
      std::string g = ctx.binary("MatMul", ctx.transposeLast2(ctx.in(0), a.size()), ctx.dy());
      std::vector<int64_t> gShape = yShape;
      gShape[gShape.size() - 2] = a.back();
      ctx.contribute(1, ctx.sumTo(g, gShape, b));
    }
    return Error::success();
  });
}

/// transA / transB, alpha and beta; the bias C summed back to its shape.
Error gemmGrad(GradContext &ctx) {
  return ctx.forEachWanted([&](size_t i) {
    const onnx::NodeProto &node = ctx.node();
    float alpha = attrFloat(node, "alpha", 1.0f), beta = attrFloat(node, "beta", 1.0f);
    bool ta = attrInt(node, "transA", 0) != 0, tb = attrInt(node, "transB", 0) != 0;
    std::string dy = ctx.dy();
    onnx::NodeProto *g = nullptr;
    if (i == 0) {
      // d op(A) = alpha dY op(B)^T.
      g = ta ? &ctx.emit("Gemm", {ctx.in(1), dy}) : &ctx.emit("Gemm", {dy, ctx.in(1)});
      GradContext::setInt(*g, "transA", ta ? tb : 0);
      GradContext::setInt(*g, "transB", ta ? 1 : !tb);
    } else if (i == 1) {
      // d op(B) = alpha op(A)^T dY.
      g = tb ? &ctx.emit("Gemm", {dy, ctx.in(0)}) : &ctx.emit("Gemm", {ctx.in(0), dy});
      GradContext::setInt(*g, "transA", tb ? 1 : !ta);
      GradContext::setInt(*g, "transB", tb ? ta : 0);
    } else {
      std::string s = beta == 1.0f ? dy : ctx.binary("Mul", dy, ctx.constScalar(beta, ctx.type()));
      ctx.contribute(2, ctx.sumTo(s, ctx.yShape(), ctx.shapeOf(2)));
      return Error::success();
    }
    GradContext::setFloat(*g, "alpha", alpha);
    ctx.contribute(i, GradContext::out(*g));
    return Error::success();
  });
}

} // namespace

namespace rules {
const GradRule matMul{&matMulGrad}, gemm{&gemmGrad};
} // namespace rules

} // namespace pipec::grad
