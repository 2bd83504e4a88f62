//===- MovementFolds.cpp - Evaluators of ops that move elements -----------===//
//
// Gather, Concat, Slice, Expand, Tile, Transpose and Where: each output
// element is an input element, found by index arithmetic.
//
//===----------------------------------------------------------------------===//
#include "passes/fold/FoldContext.h"

#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>

using namespace llvm;

namespace pipec::fold {

FoldResult gather(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<2>();
  if (!inputs)
    return inputs.takeError();
  auto [a, idx] = *inputs;
  const ConstTensor &data = *a, &indices = *idx;
  int64_t rank = static_cast<int64_t>(data.shape.size());
  int64_t axis = normalizeAxis(attrInt(ctx.node, "axis", 0), rank);
  if (axis < 0 || axis >= rank)
    return ctx.fail("axis out of range");
  std::vector<int64_t> shape(data.shape.begin(), data.shape.begin() + axis);
  shape.insert(shape.end(), indices.shape.begin(), indices.shape.end());
  shape.insert(shape.end(), data.shape.begin() + axis + 1, data.shape.end());
  int64_t inner = product(ArrayRef<int64_t>(data.shape).drop_front(axis + 1));
  int64_t count = indices.numElements(), dim = data.shape[axis];
  for (int64_t i = 0; i < count; ++i) {
    int64_t k = indices.intAt(i);
    if (k < -dim || k >= dim)
      return ctx.fail(formatv("index {0} is out of range for dimension {1}", k, dim));
  }
  return ctx.done(gatherElements(data, shape, [&](int64_t i) {
    int64_t in = i % inner, rest = i / inner;
    int64_t k = indices.intAt(rest % count);
    int64_t outer = rest / count;
    if (k < 0)
      k += dim;
    return (outer * dim + k) * inner + in;
  }));
}

FoldResult concat(const FoldContext &ctx) {
  std::vector<const ConstTensor *> parts;
  for (const ConstTensor *part : ctx.inputs)
    if (part)
      parts.push_back(part);
  if (parts.empty())
    return ctx.fail("no inputs");
  int64_t rank = static_cast<int64_t>(parts[0]->shape.size());
  int64_t axis = normalizeAxis(attrInt(ctx.node, "axis", 0), rank);
  if (axis < 0 || axis >= rank)
    return ctx.fail("axis out of range");
  std::vector<int64_t> shape = parts[0]->shape;
  shape[axis] = 0;
  for (const ConstTensor *part : parts) {
    if (static_cast<int64_t>(part->shape.size()) != rank)
      return ctx.fail("inputs differ in rank");
    for (int64_t d = 0; d < rank; ++d)
      if (d != axis && part->shape[d] != shape[d])
        return ctx.fail("inputs differ in a non-concatenated dimension");
    shape[axis] += part->shape[axis];
  }
  DType type = parts[0]->type;
  ConstTensor out = makeLike(type, shape);
  int64_t outer = product(ArrayRef<int64_t>(shape).take_front(axis));
  int64_t inner = product(ArrayRef<int64_t>(shape).drop_front(axis + 1));
  int64_t at = 0;
  for (int64_t o = 0; o < outer; ++o)
    for (const ConstTensor *part : parts) {
      int64_t chunk = part->shape[axis] * inner;
      ConstTensor converted = part->type == type ? ConstTensor() : castTo(*part, type);
      const ConstTensor &src = part->type == type ? *part : converted;
      for (int64_t i = 0; i < chunk; ++i)
        copyElement(src, o * chunk + i, out, at++);
    }
  return ctx.done(std::move(out));
}

FoldResult slice(const FoldContext &ctx) {
  ArrayRef<const ConstTensor *> in = ctx.inputs;
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  const ConstTensor &data = **a;
  int64_t rank = static_cast<int64_t>(data.shape.size());
  std::vector<int64_t> starts, ends, axes, steps;
  if (ctx.op.inputs.size() >= 3 || ctx.graph.opsetFor("") >= 10) {
    auto s = ctx.need(1), e = ctx.need(2);
    if (!s)
      return s.takeError();
    if (!e)
      return e.takeError();
    for (int64_t i = 0; i < (*s)->numElements(); ++i)
      starts.push_back((*s)->intAt(i)), ends.push_back((*e)->intAt(i));
    if (in.size() > 3 && in[3])
      axes = intsOf(*in[3]);
    if (in.size() > 4 && in[4])
      steps = intsOf(*in[4]);
  } else {
    starts = attrInts(ctx.node, "starts").value_or(std::vector<int64_t>{});
    ends = attrInts(ctx.node, "ends").value_or(std::vector<int64_t>{});
    axes = attrInts(ctx.node, "axes").value_or(std::vector<int64_t>{});
  }
  if (axes.empty())
    for (size_t i = 0; i < starts.size(); ++i)
      axes.push_back(static_cast<int64_t>(i));
  if (steps.empty())
    steps.assign(starts.size(), 1);
  if (starts.size() != ends.size() || axes.size() != starts.size() || steps.size() != starts.size())
    return ctx.fail("starts, ends, axes and steps differ in length");
  std::vector<int64_t> begin(rank, 0), step(rank, 1), shape = data.shape;
  for (size_t i = 0; i < starts.size(); ++i) {
    int64_t axis = normalizeAxis(axes[i], rank);
    if (axis < 0 || axis >= rank)
      return ctx.fail("axis out of range");
    int64_t dim = data.shape[axis], st = steps[i];
    if (st == 0)
      return ctx.fail("step is 0");
    int64_t s = starts[i], e = ends[i];
    if (s < 0)
      s += dim;
    if (e < 0)
      e += dim;
    if (st > 0) {
      s = std::clamp<int64_t>(s, 0, dim);
      e = std::clamp<int64_t>(e, 0, dim);
      shape[axis] = e > s ? (e - s + st - 1) / st : 0;
    } else {
      s = std::clamp<int64_t>(s, 0, dim - 1);
      e = std::clamp<int64_t>(e, -1, dim - 1);
      shape[axis] = s > e ? (s - e - st - 1) / -st : 0;
    }
    begin[axis] = s;
    step[axis] = st;
  }
  auto outStrides = stridesOf(shape), inStrides = stridesOf(data.shape);
  return ctx.done(gatherElements(data, shape, [&](int64_t i) {
    int64_t index = 0;
    for (int64_t d = 0; d < rank; ++d) {
      int64_t coord = (i / outStrides[d]) % shape[d];
      index += (begin[d] + coord * step[d]) * inStrides[d];
    }
    return index;
  }));
}

FoldResult expand(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<2>();
  if (!inputs)
    return inputs.takeError();
  auto [a, s] = *inputs;
  auto shape = broadcastShapes(a->shape, intsOf(*s));
  if (!shape)
    return ctx.wrap(shape.takeError());
  if (product(*shape) > ctx.maxElements)
    return std::nullopt;
  return ctx.done(broadcastTo(*a, *shape));
}

FoldResult tile(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<2>();
  if (!inputs)
    return inputs.takeError();
  auto [a, r] = *inputs;
  const ConstTensor &data = *a;
  int64_t rank = static_cast<int64_t>(data.shape.size());
  if (r->numElements() != rank)
    return ctx.fail("repeats length differs from the input rank");
  std::vector<int64_t> shape = data.shape;
  for (int64_t d = 0; d < rank; ++d)
    shape[d] *= r->intAt(d);
  if (product(shape) > ctx.maxElements)
    return std::nullopt;
  auto outStrides = stridesOf(shape), inStrides = stridesOf(data.shape);
  return ctx.done(gatherElements(data, shape, [&](int64_t i) {
    int64_t index = 0;
    for (int64_t d = 0; d < rank; ++d)
      index += ((i / outStrides[d]) % shape[d] % data.shape[d]) * inStrides[d];
    return index;
  }));
}

FoldResult transpose(const FoldContext &ctx) {
  auto a = ctx.need(0);
  if (!a)
    return a.takeError();
  const ConstTensor &data = **a;
  int64_t rank = static_cast<int64_t>(data.shape.size());
  std::vector<int64_t> perm = attrInts(ctx.node, "perm").value_or(std::vector<int64_t>{});
  if (perm.empty())
    for (int64_t d = rank - 1; d >= 0; --d)
      perm.push_back(d);
  if (static_cast<int64_t>(perm.size()) != rank)
    return ctx.fail("perm length differs from the input rank");
  std::vector<int64_t> shape(rank);
  for (int64_t d = 0; d < rank; ++d) {
    if (perm[d] < 0 || perm[d] >= rank)
      return ctx.fail("perm entry out of range");
    shape[d] = data.shape[perm[d]];
  }
  auto outStrides = stridesOf(shape), inStrides = stridesOf(data.shape);
  return ctx.done(gatherElements(data, shape, [&](int64_t i) {
    int64_t index = 0;
    for (int64_t d = 0; d < rank; ++d)
      index += ((i / outStrides[d]) % shape[d]) * inStrides[perm[d]];
    return index;
  }));
}

FoldResult where(const FoldContext &ctx) {
  auto inputs = ctx.needInputs<3>();
  if (!inputs)
    return inputs.takeError();
  auto [c, x, y] = *inputs;
  auto shape = broadcastShapes(c->shape, x->shape);
  if (!shape)
    return ctx.wrap(shape.takeError());
  auto full = broadcastShapes(*shape, y->shape);
  if (!full)
    return ctx.wrap(full.takeError());
  if (product(*full) > ctx.maxElements)
    return std::nullopt;
  ConstTensor cb = broadcastTo(*c, *full), xb = broadcastTo(*x, *full), yb = broadcastTo(*y, *full);
  ConstTensor out = makeLike(xb.type, *full);
  for (int64_t i = 0, n = out.numElements(); i < n; ++i)
    copyElement(cb.intAt(i) ? xb : yb, i, out, i);
  return ctx.done(std::move(out));
}

} // namespace pipec::fold
