//===- ConstantEvaluator.cpp - Evaluate shape arithmetic at compile time --===//
#include "passes/ConstantEvaluator.h"

#include "ops/OpRegistry.h"
#include "support/Attributes.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <cstring>
#include <functional>

using namespace llvm;

namespace pipec {
namespace {

enum class Kind {
  Unknown,
  Constant,
  Identity,
  Cast,
  Shape,
  Size,
  Gather,
  Unsqueeze,
  Squeeze,
  Concat,
  Slice,
  Reshape,
  Flatten,
  Expand,
  Tile,
  Transpose,
  ConstantOfShape,
  Range,
  Where,
  Binary,
  Unary,
  Reduce,
};

/// How the evaluator computes \p def when Ops.def marks it Fold (default
/// domain only); Unknown for the other ops, and for a Fold op the evaluator
/// does not implement (OpRegistryTest requires there is none).
Kind kindOf(const OpDef &def) {
  if (def.domain != OpDomain::Onnx || !def.has(Fold))
    return Kind::Unknown;
  switch (def.id) {
  case OpId::Constant:
    return Kind::Constant;
  case OpId::Identity:
    return Kind::Identity;
  case OpId::Cast:
    return Kind::Cast;
  case OpId::Shape:
    return Kind::Shape;
  case OpId::Size:
    return Kind::Size;
  case OpId::Gather:
    return Kind::Gather;
  case OpId::Unsqueeze:
    return Kind::Unsqueeze;
  case OpId::Squeeze:
    return Kind::Squeeze;
  case OpId::Concat:
    return Kind::Concat;
  case OpId::Slice:
    return Kind::Slice;
  case OpId::Reshape:
    return Kind::Reshape;
  case OpId::Flatten:
    return Kind::Flatten;
  case OpId::Expand:
    return Kind::Expand;
  case OpId::Tile:
    return Kind::Tile;
  case OpId::Transpose:
    return Kind::Transpose;
  case OpId::ConstantOfShape:
    return Kind::ConstantOfShape;
  case OpId::Range:
    return Kind::Range;
  case OpId::Where:
    return Kind::Where;
  case OpId::Add:
  case OpId::Sub:
  case OpId::Mul:
  case OpId::Div:
  case OpId::Equal:
  case OpId::Less:
  case OpId::Greater:
  case OpId::LessOrEqual:
  case OpId::GreaterOrEqual:
  case OpId::And:
  case OpId::Or:
  case OpId::Min:
  case OpId::Max:
  case OpId::Pow:
  case OpId::Mod:
    return Kind::Binary;
  case OpId::Neg:
  case OpId::Not:
  case OpId::Sqrt:
  case OpId::Reciprocal:
  case OpId::Abs:
  case OpId::Floor:
  case OpId::Ceil:
  case OpId::Relu:
    return Kind::Unary;
  case OpId::ReduceMax:
  case OpId::ReduceMin:
  case OpId::ReduceProd:
  case OpId::ReduceSum:
    return Kind::Reduce;
  default:
    return Kind::Unknown;
  }
}

const OpDef *defOf(const Graph &graph, const Op &op) {
  return lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
}

Error invalid(const Graph &graph, const Op &op, const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "%s: %s: %s", graph.path.c_str(),
                           describeOp(graph, op).c_str(), why.str().c_str());
}

int64_t product(ArrayRef<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

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

/// Copies element \p from of \p src into element \p to of \p dst (same type).
void copyElement(const ConstTensor &src, int64_t from, ConstTensor &dst, int64_t to) {
  if (src.isFloat())
    dst.floats[to] = src.floats[from];
  else
    dst.ints[to] = src.ints[from];
}

/// Gathers elements: out[i] = src[index(i)].
ConstTensor gatherElements(const ConstTensor &src, std::vector<int64_t> shape,
                           const std::function<int64_t(int64_t)> &index) {
  ConstTensor out = makeLike(src.type, std::move(shape));
  int64_t n = out.numElements();
  for (int64_t i = 0; i < n; ++i)
    copyElement(src, index(i), out, i);
  return out;
}

Expected<std::vector<int64_t>> broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  size_t rank = std::max(a.size(), b.size());
  std::vector<int64_t> out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      return createStringError(inconvertibleErrorCode(), "shapes do not broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

/// Index into \p shape (right-aligned in \p outShape) of flat output element i.
int64_t broadcastIndex(int64_t i, ArrayRef<int64_t> outShape, ArrayRef<int64_t> outStrides,
                       ArrayRef<int64_t> shape, ArrayRef<int64_t> strides) {
  int64_t index = 0;
  size_t offset = outShape.size() - shape.size();
  for (size_t d = 0; d < outShape.size(); ++d) {
    int64_t coord = (i / outStrides[d]) % outShape[d];
    if (d >= offset && shape[d - offset] != 1)
      index += coord * strides[d - offset];
  }
  return index;
}

ConstTensor broadcastTo(const ConstTensor &src, ArrayRef<int64_t> shape) {
  auto outStrides = stridesOf(shape);
  auto srcStrides = stridesOf(src.shape);
  return gatherElements(src, shape, [&](int64_t i) {
    return broadcastIndex(i, shape, outStrides, src.shape, srcStrides);
  });
}

int64_t normalizeAxis(int64_t axis, int64_t rank) { return axis < 0 ? axis + rank : axis; }

/// Axes from an attribute (older opsets) or an input (newer ones).
std::optional<std::vector<int64_t>> axesOf(const Graph &graph, const Op &op,
                                           ArrayRef<const ConstTensor *> inputs, size_t input) {
  if (auto attr = attrInts(graph.node(op), "axes"))
    return attr;
  if (inputs.size() > input && inputs[input]) {
    std::vector<int64_t> axes;
    for (int64_t i = 0; i < inputs[input]->numElements(); ++i)
      axes.push_back(inputs[input]->intAt(i));
    return axes;
  }
  return std::nullopt;
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

Expected<ConstTensor> binary(OpId op, const ConstTensor &a, const ConstTensor &b) {
  auto shape = broadcastShapes(a.shape, b.shape);
  if (!shape)
    return shape.takeError();
  bool compare = op == OpId::Equal || op == OpId::Less || op == OpId::Greater ||
                 op == OpId::LessOrEqual || op == OpId::GreaterOrEqual;
  DType type = compare ? DType::Bool : a.type;
  ConstTensor out = makeLike(type, *shape);
  auto outStrides = stridesOf(*shape);
  auto aStrides = stridesOf(a.shape), bStrides = stridesOf(b.shape);
  bool useFloat = a.isFloat() || b.isFloat();
  int64_t n = out.numElements();
  for (int64_t i = 0; i < n; ++i) {
    int64_t ia = broadcastIndex(i, *shape, outStrides, a.shape, aStrides);
    int64_t ib = broadcastIndex(i, *shape, outStrides, b.shape, bStrides);
    if (useFloat) {
      double x = a.floatAt(ia), y = b.floatAt(ib), r = 0;
      if (op == OpId::Add)
        r = x + y;
      else if (op == OpId::Sub)
        r = x - y;
      else if (op == OpId::Mul)
        r = x * y;
      else if (op == OpId::Div)
        r = x / y;
      else if (op == OpId::Equal)
        r = x == y;
      else if (op == OpId::Less)
        r = x < y;
      else if (op == OpId::Greater)
        r = x > y;
      else if (op == OpId::LessOrEqual)
        r = x <= y;
      else if (op == OpId::GreaterOrEqual)
        r = x >= y;
      else if (op == OpId::Min)
        r = std::min(x, y);
      else if (op == OpId::Max)
        r = std::max(x, y);
      else if (op == OpId::Pow)
        r = std::pow(x, y);
      else if (op == OpId::Mod)
        r = std::fmod(x, y);
      else
        r = (x != 0) && (y != 0) ? 1 : 0; // And; Or below
      if (op == OpId::Or)
        r = (x != 0) || (y != 0);
      if (out.isFloat())
        out.floats[i] = r;
      else
        out.ints[i] = static_cast<int64_t>(r);
      continue;
    }
    int64_t x = a.intAt(ia), y = b.intAt(ib), r = 0;
    if (op == OpId::Add)
      r = x + y;
    else if (op == OpId::Sub)
      r = x - y;
    else if (op == OpId::Mul)
      r = x * y;
    else if (op == OpId::Div || op == OpId::Mod) {
      if (y == 0)
        return createStringError(inconvertibleErrorCode(), "integer division by zero");
      if (op == OpId::Div) {
        r = x / y;
      } else {
        r = x % y;
        if (r != 0 && ((r < 0) != (y < 0)))
          r += y; // ONNX Mod with fmod=0 follows the divisor's sign
      }
    } else if (op == OpId::Equal)
      r = x == y;
    else if (op == OpId::Less)
      r = x < y;
    else if (op == OpId::Greater)
      r = x > y;
    else if (op == OpId::LessOrEqual)
      r = x <= y;
    else if (op == OpId::GreaterOrEqual)
      r = x >= y;
    else if (op == OpId::Min)
      r = std::min(x, y);
    else if (op == OpId::Max)
      r = std::max(x, y);
    else if (op == OpId::Pow)
      r = static_cast<int64_t>(std::pow(static_cast<double>(x), static_cast<double>(y)));
    else if (op == OpId::And)
      r = x && y;
    else if (op == OpId::Or)
      r = x || y;
    out.ints[i] = r;
  }
  return out;
}

ConstTensor unary(OpId op, const ConstTensor &a) {
  ConstTensor out = makeLike(a.type, a.shape);
  int64_t n = a.numElements();
  for (int64_t i = 0; i < n; ++i) {
    if (a.isFloat()) {
      double x = a.floats[i];
      double r = op == OpId::Neg          ? -x
                 : op == OpId::Sqrt       ? std::sqrt(x)
                 : op == OpId::Reciprocal ? 1.0 / x
                 : op == OpId::Abs        ? std::fabs(x)
                 : op == OpId::Floor      ? std::floor(x)
                 : op == OpId::Ceil       ? std::ceil(x)
                 : op == OpId::Relu       ? std::max(x, 0.0)
                                          : static_cast<double>(x == 0); // Not
      out.floats[i] = r;
    } else {
      int64_t x = a.ints[i];
      out.ints[i] = op == OpId::Neg    ? -x
                    : op == OpId::Abs  ? std::abs(x)
                    : op == OpId::Not  ? static_cast<int64_t>(x == 0)
                    : op == OpId::Relu ? std::max<int64_t>(x, 0)
                                       : x;
    }
  }
  return out;
}

Expected<std::vector<int64_t>> reshapeTarget(ArrayRef<int64_t> inShape, const ConstTensor &shape,
                                             bool allowZero) {
  std::vector<int64_t> out;
  int64_t known = 1, inferred = -1;
  for (int64_t i = 0; i < shape.numElements(); ++i) {
    int64_t d = shape.intAt(i);
    if (d == 0 && !allowZero) {
      if (i >= static_cast<int64_t>(inShape.size()))
        return createStringError(inconvertibleErrorCode(), "0 copies a missing input dimension");
      d = inShape[i];
    }
    if (d == -1) {
      if (inferred >= 0)
        return createStringError(inconvertibleErrorCode(), "more than one -1 in the target shape");
      inferred = i;
      out.push_back(1);
      continue;
    }
    if (d < 0)
      return createStringError(inconvertibleErrorCode(), "negative target dimension");
    known *= d;
    out.push_back(d);
  }
  int64_t total = product(inShape);
  if (inferred >= 0) {
    if (known == 0 || total % known)
      return createStringError(inconvertibleErrorCode(),
                               "cannot infer -1: %lld elements do not divide by %lld",
                               static_cast<long long>(total), static_cast<long long>(known));
    out[inferred] = total / known;
  } else if (known != total) {
    return createStringError(inconvertibleErrorCode(),
                             "target shape holds %lld elements, the input has %lld",
                             static_cast<long long>(known), static_cast<long long>(total));
  }
  return out;
}

} // namespace

bool isEvaluable(const Graph &graph, const Op &op) {
  const OpDef *def = defOf(graph, op);
  return def && kindOf(*def) != Kind::Unknown;
}

Expected<std::optional<std::vector<ConstTensor>>> evaluateOp(const Graph &graph, const Op &op,
                                                             ArrayRef<const ConstTensor *> in,
                                                             int64_t maxElements) {
  const onnx::NodeProto &node = graph.node(op);
  auto need = [&](size_t i) -> Expected<const ConstTensor *> {
    if (i >= in.size() || !in[i])
      return invalid(graph, op, formatv("input {0} is missing", i));
    return in[i];
  };
  auto done = [&](ConstTensor t) -> Expected<std::optional<std::vector<ConstTensor>>> {
    if (t.numElements() > maxElements)
      return std::nullopt;
    std::vector<ConstTensor> out;
    out.push_back(std::move(t));
    return std::optional<std::vector<ConstTensor>>(std::move(out));
  };
  auto fail = [&](const Twine &why) { return invalid(graph, op, why); };
  auto wrap = [&](Error err) { return invalid(graph, op, toString(std::move(err))); };

  const OpDef *def = defOf(graph, op);
  Kind kind = def ? kindOf(*def) : Kind::Unknown;
  switch (kind) {
  case Kind::Unknown:
    return fail("no evaluator");
  case Kind::Constant: {
    ConstTensor t;
    if (const auto *attr = findAttr(node, "value_float")) {
      t.type = DType::F32;
      t.floats = {attr->f()};
    } else if (const auto *attr = findAttr(node, "value_floats")) {
      t.type = DType::F32;
      t.shape = {attr->floats_size()};
      t.floats.assign(attr->floats().begin(), attr->floats().end());
    } else if (const auto *attr = findAttr(node, "value_int")) {
      t.type = DType::I64;
      t.ints = {attr->i()};
    } else if (const auto *attr = findAttr(node, "value_ints")) {
      t.type = DType::I64;
      t.shape = {attr->ints_size()};
      t.ints.assign(attr->ints().begin(), attr->ints().end());
    } else {
      return fail("only value, value_float(s) and value_int(s) constants are supported");
    }
    return done(std::move(t));
  }
  case Kind::Identity: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    return done(**a);
  }
  case Kind::Cast: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    int64_t to = attrInt(node, "to", 0);
    if (!isKnownDType(static_cast<int32_t>(to)) || to == static_cast<int64_t>(DType::String))
      return fail(formatv("cannot cast to data type {0}", to));
    return done(castTo(**a, static_cast<DType>(to)));
  }
  case Kind::Shape:
  case Kind::Size:
    return fail("Shape and Size are folded from the input's shape, not its data");
  case Kind::Gather: {
    auto a = need(0), idx = need(1);
    if (!a)
      return a.takeError();
    if (!idx)
      return idx.takeError();
    const ConstTensor &data = **a, &indices = **idx;
    int64_t rank = static_cast<int64_t>(data.shape.size());
    int64_t axis = normalizeAxis(attrInt(node, "axis", 0), rank);
    if (axis < 0 || axis >= rank)
      return fail("axis out of range");
    std::vector<int64_t> shape(data.shape.begin(), data.shape.begin() + axis);
    shape.insert(shape.end(), indices.shape.begin(), indices.shape.end());
    shape.insert(shape.end(), data.shape.begin() + axis + 1, data.shape.end());
    int64_t inner = product(ArrayRef<int64_t>(data.shape).drop_front(axis + 1));
    int64_t count = indices.numElements(), dim = data.shape[axis];
    for (int64_t i = 0; i < count; ++i) {
      int64_t k = indices.intAt(i);
      if (k < -dim || k >= dim)
        return fail(formatv("index {0} is out of range for dimension {1}", k, dim));
    }
    return done(gatherElements(data, shape, [&](int64_t i) {
      int64_t in = i % inner, rest = i / inner;
      int64_t k = indices.intAt(rest % count);
      int64_t outer = rest / count;
      if (k < 0)
        k += dim;
      return (outer * dim + k) * inner + in;
    }));
  }
  case Kind::Unsqueeze:
  case Kind::Squeeze: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    ConstTensor t = **a;
    auto axes = axesOf(graph, op, in, 1);
    if (kind == Kind::Unsqueeze) {
      if (!axes)
        return fail("Unsqueeze needs axes");
      int64_t rank = static_cast<int64_t>(t.shape.size() + axes->size());
      std::vector<int64_t> sorted;
      for (int64_t axis : *axes)
        sorted.push_back(normalizeAxis(axis, rank));
      std::sort(sorted.begin(), sorted.end());
      for (int64_t axis : sorted) {
        if (axis < 0 || axis > static_cast<int64_t>(t.shape.size()))
          return fail("axis out of range");
        t.shape.insert(t.shape.begin() + axis, 1);
      }
      return done(std::move(t));
    }
    std::vector<int64_t> shape;
    int64_t rank = static_cast<int64_t>(t.shape.size());
    for (int64_t d = 0; d < rank; ++d) {
      bool drop = !axes ? t.shape[d] == 1 : false;
      if (axes)
        for (int64_t axis : *axes)
          drop |= normalizeAxis(axis, rank) == d;
      if (drop && t.shape[d] != 1)
        return fail("squeezed dimension is not 1");
      if (!drop)
        shape.push_back(t.shape[d]);
    }
    t.shape = shape;
    return done(std::move(t));
  }
  case Kind::Concat: {
    std::vector<const ConstTensor *> parts;
    for (const ConstTensor *part : in)
      if (part)
        parts.push_back(part);
    if (parts.empty())
      return fail("no inputs");
    int64_t rank = static_cast<int64_t>(parts[0]->shape.size());
    int64_t axis = normalizeAxis(attrInt(node, "axis", 0), rank);
    if (axis < 0 || axis >= rank)
      return fail("axis out of range");
    std::vector<int64_t> shape = parts[0]->shape;
    shape[axis] = 0;
    for (const ConstTensor *part : parts) {
      if (static_cast<int64_t>(part->shape.size()) != rank)
        return fail("inputs differ in rank");
      for (int64_t d = 0; d < rank; ++d)
        if (d != axis && part->shape[d] != shape[d])
          return fail("inputs differ in a non-concatenated dimension");
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
    return done(std::move(out));
  }
  case Kind::Slice: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    const ConstTensor &data = **a;
    int64_t rank = static_cast<int64_t>(data.shape.size());
    std::vector<int64_t> starts, ends, axes, steps;
    if (op.inputs.size() >= 3 || graph.opsetFor("") >= 10) {
      auto s = need(1), e = need(2);
      if (!s)
        return s.takeError();
      if (!e)
        return e.takeError();
      for (int64_t i = 0; i < (*s)->numElements(); ++i)
        starts.push_back((*s)->intAt(i)), ends.push_back((*e)->intAt(i));
      if (in.size() > 3 && in[3])
        for (int64_t i = 0; i < in[3]->numElements(); ++i)
          axes.push_back(in[3]->intAt(i));
      if (in.size() > 4 && in[4])
        for (int64_t i = 0; i < in[4]->numElements(); ++i)
          steps.push_back(in[4]->intAt(i));
    } else {
      starts = attrInts(node, "starts").value_or(std::vector<int64_t>{});
      ends = attrInts(node, "ends").value_or(std::vector<int64_t>{});
      axes = attrInts(node, "axes").value_or(std::vector<int64_t>{});
    }
    if (axes.empty())
      for (size_t i = 0; i < starts.size(); ++i)
        axes.push_back(static_cast<int64_t>(i));
    if (steps.empty())
      steps.assign(starts.size(), 1);
    if (starts.size() != ends.size() || axes.size() != starts.size() ||
        steps.size() != starts.size())
      return fail("starts, ends, axes and steps differ in length");
    std::vector<int64_t> begin(rank, 0), step(rank, 1), shape = data.shape;
    for (size_t i = 0; i < starts.size(); ++i) {
      int64_t axis = normalizeAxis(axes[i], rank);
      if (axis < 0 || axis >= rank)
        return fail("axis out of range");
      int64_t dim = data.shape[axis], st = steps[i];
      if (st == 0)
        return fail("step is 0");
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
    return done(gatherElements(data, shape, [&](int64_t i) {
      int64_t index = 0;
      for (int64_t d = 0; d < rank; ++d) {
        int64_t coord = (i / outStrides[d]) % shape[d];
        index += (begin[d] + coord * step[d]) * inStrides[d];
      }
      return index;
    }));
  }
  case Kind::Reshape: {
    auto a = need(0), s = need(1);
    if (!a)
      return a.takeError();
    if (!s)
      return s.takeError();
    auto shape = reshapeTarget((*a)->shape, **s, attrInt(node, "allowzero", 0) != 0);
    if (!shape)
      return wrap(shape.takeError());
    ConstTensor t = **a;
    t.shape = *shape;
    return done(std::move(t));
  }
  case Kind::Flatten: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    ConstTensor t = **a;
    int64_t rank = static_cast<int64_t>(t.shape.size());
    int64_t axis = normalizeAxis(attrInt(node, "axis", 1), rank);
    ArrayRef<int64_t> dims(t.shape);
    t.shape = {product(dims.take_front(axis)), product(dims.drop_front(axis))};
    return done(std::move(t));
  }
  case Kind::Expand: {
    auto a = need(0), s = need(1);
    if (!a)
      return a.takeError();
    if (!s)
      return s.takeError();
    std::vector<int64_t> target;
    for (int64_t i = 0; i < (*s)->numElements(); ++i)
      target.push_back((*s)->intAt(i));
    auto shape = broadcastShapes((*a)->shape, target);
    if (!shape)
      return wrap(shape.takeError());
    if (product(*shape) > maxElements)
      return std::nullopt;
    return done(broadcastTo(**a, *shape));
  }
  case Kind::Tile: {
    auto a = need(0), r = need(1);
    if (!a)
      return a.takeError();
    if (!r)
      return r.takeError();
    const ConstTensor &data = **a;
    int64_t rank = static_cast<int64_t>(data.shape.size());
    if ((*r)->numElements() != rank)
      return fail("repeats length differs from the input rank");
    std::vector<int64_t> shape = data.shape;
    for (int64_t d = 0; d < rank; ++d)
      shape[d] *= (*r)->intAt(d);
    if (product(shape) > maxElements)
      return std::nullopt;
    auto outStrides = stridesOf(shape), inStrides = stridesOf(data.shape);
    return done(gatherElements(data, shape, [&](int64_t i) {
      int64_t index = 0;
      for (int64_t d = 0; d < rank; ++d)
        index += ((i / outStrides[d]) % shape[d] % data.shape[d]) * inStrides[d];
      return index;
    }));
  }
  case Kind::Transpose: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    const ConstTensor &data = **a;
    int64_t rank = static_cast<int64_t>(data.shape.size());
    std::vector<int64_t> perm = attrInts(node, "perm").value_or(std::vector<int64_t>{});
    if (perm.empty())
      for (int64_t d = rank - 1; d >= 0; --d)
        perm.push_back(d);
    if (static_cast<int64_t>(perm.size()) != rank)
      return fail("perm length differs from the input rank");
    std::vector<int64_t> shape(rank);
    for (int64_t d = 0; d < rank; ++d) {
      if (perm[d] < 0 || perm[d] >= rank)
        return fail("perm entry out of range");
      shape[d] = data.shape[perm[d]];
    }
    auto outStrides = stridesOf(shape), inStrides = stridesOf(data.shape);
    return done(gatherElements(data, shape, [&](int64_t i) {
      int64_t index = 0;
      for (int64_t d = 0; d < rank; ++d)
        index += ((i / outStrides[d]) % shape[d]) * inStrides[perm[d]];
      return index;
    }));
  }
  case Kind::ConstantOfShape: {
    auto s = need(0);
    if (!s)
      return s.takeError();
    std::vector<int64_t> shape;
    for (int64_t i = 0; i < (*s)->numElements(); ++i) {
      if ((*s)->intAt(i) < 0)
        return fail("negative dimension");
      shape.push_back((*s)->intAt(i));
    }
    if (product(shape) > maxElements)
      return std::nullopt;
    ConstTensor fill;
    fill.type = DType::F32;
    fill.floats = {0.0};
    if (const auto *attr = findAttr(node, "value")) {
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
          return std::nullopt; // half types: leave to shape inference
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
    }
    ConstTensor out = makeLike(fill.type, shape);
    if (out.isFloat())
      std::fill(out.floats.begin(), out.floats.end(), fill.floats[0]);
    else
      std::fill(out.ints.begin(), out.ints.end(), fill.ints[0]);
    return done(std::move(out));
  }
  case Kind::Range: {
    auto s = need(0), l = need(1), d = need(2);
    if (!s)
      return s.takeError();
    if (!l)
      return l.takeError();
    if (!d)
      return d.takeError();
    double start = (*s)->floatAt(0), limit = (*l)->floatAt(0), delta = (*d)->floatAt(0);
    if (delta == 0)
      return fail("delta is 0");
    int64_t n = std::max<int64_t>(0, static_cast<int64_t>(std::ceil((limit - start) / delta)));
    if (n > maxElements)
      return std::nullopt;
    ConstTensor out = makeLike((*s)->type, {n});
    for (int64_t i = 0; i < n; ++i) {
      if (out.isFloat())
        out.floats[i] = start + i * delta;
      else
        out.ints[i] = (*s)->intAt(0) + i * (*d)->intAt(0);
    }
    return done(std::move(out));
  }
  case Kind::Where: {
    auto c = need(0), x = need(1), y = need(2);
    if (!c)
      return c.takeError();
    if (!x)
      return x.takeError();
    if (!y)
      return y.takeError();
    auto shape = broadcastShapes((*c)->shape, (*x)->shape);
    if (!shape)
      return wrap(shape.takeError());
    auto full = broadcastShapes(*shape, (*y)->shape);
    if (!full)
      return wrap(full.takeError());
    if (product(*full) > maxElements)
      return std::nullopt;
    ConstTensor cb = broadcastTo(**c, *full), xb = broadcastTo(**x, *full),
                yb = broadcastTo(**y, *full);
    ConstTensor out = makeLike(xb.type, *full);
    for (int64_t i = 0, n = out.numElements(); i < n; ++i)
      copyElement(cb.intAt(i) ? xb : yb, i, out, i);
    return done(std::move(out));
  }
  case Kind::Binary: {
    auto a = need(0), b = need(1);
    if (!a)
      return a.takeError();
    if (!b)
      return b.takeError();
    auto shape = broadcastShapes((*a)->shape, (*b)->shape);
    if (!shape)
      return wrap(shape.takeError());
    if (product(*shape) > maxElements)
      return std::nullopt;
    auto out = binary(def->id, **a, **b);
    if (!out)
      return wrap(out.takeError());
    return done(std::move(*out));
  }
  case Kind::Unary: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    return done(unary(def->id, **a));
  }
  case Kind::Reduce: {
    auto a = need(0);
    if (!a)
      return a.takeError();
    const ConstTensor &data = **a;
    int64_t rank = static_cast<int64_t>(data.shape.size());
    auto axes = axesOf(graph, op, in, 1);
    std::vector<bool> reduce(rank, !axes || axes->empty());
    if (axes)
      for (int64_t axis : *axes) {
        axis = normalizeAxis(axis, rank);
        if (axis < 0 || axis >= rank)
          return fail("axis out of range");
        reduce[axis] = true;
      }
    bool keep = attrInt(node, "keepdims", 1) != 0;
    std::vector<int64_t> keptShape(rank), shape;
    for (int64_t d = 0; d < rank; ++d) {
      keptShape[d] = reduce[d] ? 1 : data.shape[d];
      if (keep || !reduce[d])
        shape.push_back(keptShape[d]);
    }
    ConstTensor out = makeLike(data.type, shape);
    std::vector<bool> seen(out.numElements(), false);
    auto inStrides = stridesOf(data.shape), keptStrides = stridesOf(keptShape);
    for (int64_t i = 0, n = data.numElements(); i < n; ++i) {
      int64_t o = 0;
      for (int64_t d = 0; d < rank; ++d)
        if (!reduce[d])
          o += ((i / inStrides[d]) % data.shape[d]) * keptStrides[d];
      double v = data.floatAt(i);
      double cur = data.isFloat() ? out.floats[o] : static_cast<double>(out.ints[o]);
      double r;
      if (!seen[o])
        r = v, seen[o] = true;
      else if (def->id == OpId::ReduceProd)
        r = cur * v;
      else if (def->id == OpId::ReduceSum)
        r = cur + v;
      else if (def->id == OpId::ReduceMin)
        r = std::min(cur, v);
      else
        r = std::max(cur, v);
      if (data.isFloat())
        out.floats[o] = r;
      else
        out.ints[o] = static_cast<int64_t>(r);
    }
    for (int64_t o = 0; o < out.numElements(); ++o)
      if (!seen[o] && def->id == OpId::ReduceProd) {
        if (out.isFloat())
          out.floats[o] = 1;
        else
          out.ints[o] = 1;
      }
    return done(std::move(out));
  }
  }
  return fail("no evaluator");
}

} // namespace pipec
