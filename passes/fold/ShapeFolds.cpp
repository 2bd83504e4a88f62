//===- ShapeFolds.cpp - Evaluators of constants, casts and reshapes -------===//
//
// The ops whose result is a constant of the node (Constant, ConstantOfShape,
// Range), a conversion of its input (Cast), or its input's elements under
// another shape (Identity, Unsqueeze, Squeeze, Reshape, Flatten).
//
//===----------------------------------------------------------------------===//
#include "ops/Reshape.h"
#include "passes/fold/FoldContext.h"

#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstring>

using namespace llvm;

namespace pipec::fold {
namespace {

/// ConstantOfShape's fill: its "value" attribute, or a float 0. std::nullopt
/// for raw data of a type not read here (the half types): those are left to
/// shape inference.
std::optional<ConstTensor> fillOf(const onnx::NodeProto &node) {
  ConstTensor fill;
  fill.type = DType::F32;
  fill.floats = {0.0};
  const auto *attr = findAttr(node, "value");
  if (!attr)
    return fill;
  const onnx::TensorProto &t = attr->t();
  fill.type = static_cast<DType>(t.data_type());
  fill.floats.clear();
  double v = 0;
  if (t.has_raw_data() && !t.raw_data().empty()) {
    const char *raw = t.raw_data().data();
    switch (fill.type) {
    case DType::F32: {
      float f;
      std::memcpy(&f, raw, 4);
      v = f;
      break;
    }
    case DType::I64: {
      int64_t x;
      std::memcpy(&x, raw, 8);
      v = static_cast<double>(x);
      break;
    }
    case DType::I32: {
      int32_t x;
      std::memcpy(&x, raw, 4);
      v = x;
      break;
    }
    case DType::F64:
      std::memcpy(&v, raw, 8);
      break;
    case DType::Bool:
    case DType::U8:
    case DType::I8:
      v = static_cast<uint8_t>(raw[0]);
      break;
    default:
      return std::nullopt;
    }
  } else if (t.float_data_size()) {
    v = t.float_data(0);
  } else if (t.int64_data_size()) {
    v = static_cast<double>(t.int64_data(0));
  } else if (t.int32_data_size()) {
    v = t.int32_data(0);
  } else if (t.double_data_size()) {
    v = t.double_data(0);
  }
  if (isFloatDType(fill.type))
    fill.floats = {v};
  else
    fill.ints = {static_cast<int64_t>(v)};
  return fill;
}

/// Input 0's elements under the shape \p shapeOf makes of its shape: the
/// evaluators that only reshape. An error of \p shapeOf is returned as it is.
FoldResult reshaped(const FoldContext &ctx,
                    function_ref<Expected<std::vector<int64_t>>(ArrayRef<int64_t>)> shapeOf) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  auto shape = shapeOf((*a)->shape);
  if (!shape)
    return shape.takeError();
  ConstTensor t = **a;
  t.shape = std::move(*shape);
  return ctx.done(std::move(t));
}

} // namespace

FoldResult constant(const FoldContext &ctx) {
  ConstTensor t;
  if (const auto *attr = findAttr(ctx.node, "value_float")) {
    t.type = DType::F32;
    t.floats = {attr->f()};
  } else if (const auto *attr = findAttr(ctx.node, "value_floats")) {
    t.type = DType::F32;
    t.shape = {attr->floats_size()};
    t.floats.assign(attr->floats().begin(), attr->floats().end());
  } else if (const auto *attr = findAttr(ctx.node, "value_int")) {
    t.type = DType::I64;
    t.ints = {attr->i()};
  } else if (const auto *attr = findAttr(ctx.node, "value_ints")) {
    t.type = DType::I64;
    t.shape = {attr->ints_size()};
    t.ints.assign(attr->ints().begin(), attr->ints().end());
  } else {
    return ctx.fail("only value, value_float(s) and value_int(s) constants are supported");
  }
  return ctx.done(std::move(t));
}

FoldResult identity(const FoldContext &ctx) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  return ctx.done(**a);
}

FoldResult cast(const FoldContext &ctx) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  int64_t to = attrInt(ctx.node, "to", 0);
  if (!isKnownDType(static_cast<int32_t>(to)) || to == static_cast<int64_t>(DType::String))
    return ctx.fail(formatv("cannot cast to data type {0}", to));
  return ctx.done(castTo(**a, static_cast<DType>(to)));
}

FoldResult shapeOrSize(const FoldContext &ctx) {
  return ctx.fail("Shape and Size are folded from the input's shape, not its data");
}

FoldResult unsqueeze(const FoldContext &ctx) {
  return reshaped(ctx, [&](ArrayRef<int64_t> in) -> Expected<std::vector<int64_t>> {
    auto axes = axesOf(ctx, 1);
    if (!axes)
      return ctx.fail("Unsqueeze needs axes");
    int64_t rank = static_cast<int64_t>(in.size() + axes->size());
    std::vector<int64_t> sorted;
    for (int64_t axis : *axes)
      sorted.push_back(normalizeAxis(axis, rank));
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> shape = in.vec();
    for (int64_t axis : sorted) {
      if (axis < 0 || axis > static_cast<int64_t>(shape.size()))
        return ctx.fail("axis out of range");
      shape.insert(shape.begin() + axis, 1);
    }
    return shape;
  });
}

FoldResult squeeze(const FoldContext &ctx) {
  return reshaped(ctx, [&](ArrayRef<int64_t> in) -> Expected<std::vector<int64_t>> {
    auto axes = axesOf(ctx, 1);
    std::vector<int64_t> shape;
    int64_t rank = static_cast<int64_t>(in.size());
    for (int64_t d = 0; d < rank; ++d) {
      bool drop = !axes ? in[d] == 1 : false;
      if (axes)
        for (int64_t axis : *axes)
          drop |= normalizeAxis(axis, rank) == d;
      if (drop && in[d] != 1)
        return ctx.fail("squeezed dimension is not 1");
      if (!drop)
        shape.push_back(in[d]);
    }
    return shape;
  });
}

FoldResult reshape(const FoldContext &ctx) {
  return reshaped(ctx, [&](ArrayRef<int64_t> in) -> Expected<std::vector<int64_t>> {
    auto s = ctx.need(1);
    if (!s)
      return s.takeError();
    auto shape = reshapeTarget(in, intsOf(**s), attrInt(ctx.node, "allowzero", 0) != 0,
                               formatShape(in.vec()));
    if (!shape)
      return ctx.wrap(shape.takeError());
    return shape;
  });
}

FoldResult flatten(const FoldContext &ctx) {
  return reshaped(ctx, [&](ArrayRef<int64_t> in) -> Expected<std::vector<int64_t>> {
    int64_t axis = normalizeAxis(attrInt(ctx.node, "axis", 1), static_cast<int64_t>(in.size()));
    return std::vector<int64_t>{product(in.take_front(axis)), product(in.drop_front(axis))};
  });
}

FoldResult constantOfShape(const FoldContext &ctx) {
  auto s = ctx.need(0);
  if (!s)
    return s.takeError();
  std::vector<int64_t> shape;
  for (int64_t i = 0; i < (*s)->numElements(); ++i) {
    if ((*s)->intAt(i) < 0)
      return ctx.fail("negative dimension");
    shape.push_back((*s)->intAt(i));
  }
  if (product(shape) > ctx.maxElements)
    return std::nullopt;
  std::optional<ConstTensor> fill = fillOf(ctx.node);
  if (!fill)
    return std::nullopt;
  ConstTensor out = makeLike(fill->type, shape);
  if (out.isFloat())
    std::fill(out.floats.begin(), out.floats.end(), fill->floats[0]);
  else
    std::fill(out.ints.begin(), out.ints.end(), fill->ints[0]);
  return ctx.done(std::move(out));
}

FoldResult range(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<3>();
  if (!inputs)
    return inputs.takeError();
  auto [s, l, d] = *inputs;
  double start = s->floatAt(0), limit = l->floatAt(0), delta = d->floatAt(0);
  if (delta == 0)
    return ctx.fail("delta is 0");
  int64_t n = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((limit - start) / delta)));
  if (n > ctx.maxElements)
    return std::nullopt;
  ConstTensor out = makeLike(s->type, {n});
  for (int64_t i = 0; i < n; ++i) {
    if (out.isFloat())
      out.floats[i] = start + i * delta;
    else
      out.ints[i] = s->intAt(0) + i * d->intAt(0);
  }
  return ctx.done(std::move(out));
}

} // namespace pipec::fold
