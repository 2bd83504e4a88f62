//===- FoldContext.cpp - The evaluators' context and tensor helpers -------===//
#include "passes/fold/FoldContext.h"

#include "support/Attributes.h"
#include "support/Broadcast.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>

using namespace llvm;

namespace pipec::fold {

Error invalid(const Graph &graph, const Op &op, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "%s: %s: %s", graph.path.c_str(),
                           describeOp(graph, op).c_str(), why.str().c_str());
}

Expected<const ConstTensor *> FoldContext::need(size_t i) const {
  if (i >= inputs.size() || !inputs[i])
    return invalid(graph, op, formatv("input {0} is missing", i));
  return inputs[i];
}

FoldResult FoldContext::done(ConstTensor t) const {
  if (t.numElements() > maxElements)
    return std::nullopt;
  std::vector<ConstTensor> out;
  out.push_back(std::move(t));
  return std::optional<std::vector<ConstTensor>>(std::move(out));
}

Error FoldContext::fail(const Twine &why) const { return invalid(graph, op, why); }

Error FoldContext::wrap(Error err) const { return invalid(graph, op, toString(std::move(err))); }

std::vector<int64_t> stridesOf(ArrayRef<int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * shape[i + 1];
  return strides;
}

ConstTensor makeLike(DType type, std::vector<int64_t> shape) {
  ConstTensor t;
  t.type = type;
  t.shape = std::move(shape);
  if (isFloatDType(type))
    t.floats.resize(product(t.shape));
  else
    t.ints.resize(product(t.shape));
  return t;
}

ConstTensor gatherElements(const ConstTensor &src, std::vector<int64_t> shape,
                           const std::function<int64_t(int64_t)> &index) {
  ConstTensor out = makeLike(src.type, std::move(shape));
  int64_t n = out.numElements();
  for (int64_t i = 0; i < n; ++i)
    copyElement(src, index(i), out, i);
  return out;
}

Expected<std::vector<int64_t>> broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  if (std::optional<std::vector<int64_t>> shape = broadcastShape(a, b))
    return std::move(*shape);
  return createStringError(inconvertibleErrorCode(), "shapes do not broadcast");
}

ConstTensor broadcastTo(const ConstTensor &src, ArrayRef<int64_t> shape) {
  auto outStrides = stridesOf(shape);
  auto srcStrides = stridesOf(src.shape);
  return gatherElements(src, shape, [&](int64_t i) {
    return broadcastIndex(i, shape, outStrides, src.shape, srcStrides);
  });
}

ConstTensor castTo(const ConstTensor &src, DType type) {
  ConstTensor out = makeLike(type, src.shape);
  int64_t n = src.numElements();
  for (int64_t i = 0; i < n; ++i) {
    if (out.isFloat())
      out.floats[i] = src.floatAt(i);
    else if (type == DType::Bool)
      out.ints[i] = src.floatAt(i) != 0.0;
    else
      out.ints[i] = src.intAt(i);
  }
  return out;
}

std::vector<int64_t> intsOf(const ConstTensor &t) {
  std::vector<int64_t> out;
  for (int64_t i = 0, n = t.numElements(); i < n; ++i)
    out.push_back(t.intAt(i));
  return out;
}

std::optional<std::vector<int64_t>> axesOf(const FoldContext &ctx, size_t input) {
  if (auto attr = attrInts(ctx.node, "axes"))
    return attr;
  if (ctx.inputs.size() > input && ctx.inputs[input])
    return intsOf(*ctx.inputs[input]);
  return std::nullopt;
}

} // namespace pipec::fold
