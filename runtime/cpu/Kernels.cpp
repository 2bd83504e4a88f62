//===- Kernels.cpp - Forward CPU kernels for ONNX operators -------------===//
//
// Layout: the node context (attributes, inputs, errors that name the node);
// shape helpers and the broadcast walker every strided kernel uses; then the
// kernels grouped as elementwise, matrix products, normalization, data
// movement, convolution and pooling, reductions and losses; last the registry
// that maps op types to kernels, and runOp.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/Kernels.h"

#include "onnx/onnx_pb.h"

#include <cblas.h>

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>

using namespace llvm;

namespace pipec::cpu {

char UnsupportedError::ID = 0;

void UnsupportedError::log(raw_ostream &os) const {
  os << "node '" << node << "' (" << opType << "): " << detail;
}

std::error_code UnsupportedError::convertToErrorCode() const {
  return std::make_error_code(std::errc::not_supported);
}

std::string nodeLabel(const onnx::NodeProto &node) {
  if (!node.name().empty())
    return node.name();
  for (const std::string &output : node.output())
    if (!output.empty())
      return output;
  return "<unnamed>";
}

namespace {

using Outputs = std::vector<Tensor>;
using Shape = std::vector<int64_t>;

//===----------------------------------------------------------------------===//
// Node context
//===----------------------------------------------------------------------===//

/// One node under evaluation: its inputs, typed attribute access, and errors
/// that name the node and op.
class OpContext {
public:
  OpContext(const onnx::NodeProto &node, int64_t opset, ArrayRef<const Tensor *> inputs)
      : node(node), opset(opset), inputs(inputs) {}

  const onnx::NodeProto &node;
  const int64_t opset;

  /// Input \p i, or nullptr when the node omits it.
  const Tensor *optInput(size_t i) const { return i < inputs.size() ? inputs[i] : nullptr; }
  /// Input \p i; runOp has checked that every required input is present.
  const Tensor &input(size_t i) const { return *inputs[i]; }
  size_t numInputs() const { return inputs.size(); }
  size_t numOutputs() const { return node.output_size(); }
  /// True if the node names output \p i (optional outputs may be skipped).
  bool wantsOutput(size_t i) const {
    return i < numOutputs() && !node.output(static_cast<int>(i)).empty();
  }

  const onnx::AttributeProto *attr(StringRef name) const {
    for (const auto &a : node.attribute())
      if (a.name() == name)
        return &a;
    return nullptr;
  }
  int64_t attrInt(StringRef name, int64_t otherwise) const {
    const auto *a = attr(name);
    return a ? a->i() : otherwise;
  }
  float attrFloat(StringRef name, float otherwise) const {
    const auto *a = attr(name);
    return a ? a->f() : otherwise;
  }
  std::string attrString(StringRef name, StringRef otherwise) const {
    const auto *a = attr(name);
    return a ? a->s() : otherwise.str();
  }
  std::optional<Shape> attrInts(StringRef name) const {
    const auto *a = attr(name);
    if (!a)
      return std::nullopt;
    return Shape(a->ints().begin(), a->ints().end());
  }
  /// An integer list that ONNX moved from attribute \p name to input \p i in
  /// some opset (Squeeze axes, Slice starts, Split sizes): the input when the
  /// node has it, else the attribute, else nullopt.
  std::optional<Shape> intsFromInputOrAttr(size_t i, StringRef name) const {
    if (const Tensor *t = optInput(i))
      return t->toInt64Vector();
    return attrInts(name);
  }

  /// A malformed node or input.
  Error fail(const Twine &message) const {
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s",
                             nodeLabel(node).c_str(), node.op_type().c_str(),
                             message.str().c_str());
  }
  /// Something valid that these kernels do not implement.
  Error unsupported(const Twine &message) const {
    return make_error<UnsupportedError>(nodeLabel(node), node.op_type(), message.str());
  }
  Error unsupportedType(const Tensor &t, size_t inputIndex) const {
    return unsupported(formatv("element type {0} of input {1}", elemTypeName(t.elemType()),
                               inputIndex));
  }
  /// Checks that inputs \p i and \p j have one element type.
  Error sameType(size_t i, size_t j) const {
    const Tensor &a = input(i), &b = input(j);
    if (a.elemType() == b.elemType())
      return Error::success();
    return fail(formatv("input element types differ: input {0} is {1}, input {2} is {3}", i,
                        elemTypeName(a.elemType()), j, elemTypeName(b.elemType())));
  }
  /// \p axis in [-rank, rank) made non-negative, or an error naming it.
  Expected<int64_t> normalizeAxis(int64_t axis, int64_t rank, StringRef what = "axis") const {
    if (axis < -rank || axis >= rank)
      return fail(formatv("{0} {1} is out of range for rank {2}", what, axis, rank));
    return axis < 0 ? axis + rank : axis;
  }

private:
  ArrayRef<const Tensor *> inputs;
};

//===----------------------------------------------------------------------===//
// Shape helpers and the broadcast walker
//===----------------------------------------------------------------------===//

template <typename T> constexpr bool IsFloat = std::is_floating_point_v<T>;
template <typename T> constexpr bool IsBool = std::is_same_v<T, bool>;

int64_t product(ArrayRef<int64_t> dims) { return numElementsOf(dims); }

/// Strides for reading a tensor of \p shape as if it had \p outShape (shape
/// right-aligned): 0 along broadcast dimensions.
Shape broadcastStrides(ArrayRef<int64_t> shape, ArrayRef<int64_t> outShape) {
  Shape strides(outShape.size(), 0);
  Shape own = stridesOf(shape);
  size_t offset = outShape.size() - shape.size();
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != 1)
      strides[offset + i] = own[i];
  return strides;
}

/// Calls fn(outIndex, offsets) for every element of \p outShape in row-major
/// order; offsets[k] is the flat offset of that element in operand k, read
/// through strides[k] (one stride per output dimension). The innermost
/// dimension runs as a plain loop, so a walk costs little more than a copy.
template <size_t N, typename Fn>
void forEachStrided(ArrayRef<int64_t> outShape, const std::array<Shape, N> &strides, Fn &&fn) {
  int64_t total = product(outShape);
  if (total == 0)
    return;
  size_t rank = outShape.size();
  std::array<int64_t, N> base{};
  if (rank == 0) {
    fn(int64_t(0), base);
    return;
  }
  int64_t inner = outShape[rank - 1];
  std::array<int64_t, N> innerStride;
  for (size_t k = 0; k < N; ++k)
    innerStride[k] = strides[k][rank - 1];
  Shape counter(rank, 0);
  int64_t out = 0;
  for (int64_t outer = 0, e = total / inner; outer < e; ++outer) {
    std::array<int64_t, N> offsets = base;
    for (int64_t j = 0; j < inner; ++j) {
      fn(out++, offsets);
      for (size_t k = 0; k < N; ++k)
        offsets[k] += innerStride[k];
    }
    for (int64_t d = static_cast<int64_t>(rank) - 2; d >= 0; --d) {
      for (size_t k = 0; k < N; ++k)
        base[k] += strides[k][d];
      if (++counter[d] < outShape[d])
        break;
      for (size_t k = 0; k < N; ++k)
        base[k] -= strides[k][d] * outShape[d];
      counter[d] = 0;
    }
  }
}

/// Reads \p in (storage type T) broadcast to \p outShape into a new tensor.
template <typename T> Tensor expandTo(const Tensor &in, ArrayRef<int64_t> outShape) {
  Tensor out(in.elemType(), outShape);
  const T *src = in.data<T>();
  T *dst = out.data<T>();
  if (in.shape() == outShape) {
    std::copy(src, src + in.numElements(), dst);
    return out;
  }
  forEachStrided<1>(outShape, {broadcastStrides(in.shape(), outShape)},
                    [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  return out;
}

Tensor expandAny(const Tensor &in, ArrayRef<int64_t> outShape) {
  return visitStorage(in.elemType(), [&](auto tag) { return expandTo<decltype(tag)>(in, outShape); });
}

/// out[o] = fn(a[.], b[.]) over the broadcast of a and b.
template <typename TA, typename TB, typename TO, typename Fn>
Tensor broadcastBinary(const Tensor &a, const Tensor &b, ElemType outType,
                       ArrayRef<int64_t> outShape, Fn &&fn) {
  Tensor out(outType, outShape);
  const TA *pa = a.data<TA>();
  const TB *pb = b.data<TB>();
  TO *po = out.data<TO>();
  if (a.shape() == outShape && b.shape() == outShape) {
    for (int64_t i = 0, e = out.numElements(); i < e; ++i)
      po[i] = fn(pa[i], pb[i]);
  } else if (a.shape() == outShape && b.numElements() == 1) {
    TB scalar = pb[0];
    for (int64_t i = 0, e = out.numElements(); i < e; ++i)
      po[i] = fn(pa[i], scalar);
  } else {
    forEachStrided<2>(outShape,
                      {broadcastStrides(a.shape(), outShape), broadcastStrides(b.shape(), outShape)},
                      [&](int64_t o, const std::array<int64_t, 2> &off) {
                        po[o] = fn(pa[off[0]], pb[off[1]]);
                      });
  }
  return out;
}

/// The input's shape with dimension \p axis split out: sizes before, at and
/// after it. Most axis kernels loop over (outer, axis, inner).
struct AxisSplit {
  int64_t outer, size, inner;
};
AxisSplit splitAt(ArrayRef<int64_t> shape, int64_t axis) {
  return {product(shape.take_front(axis)), shape[axis], product(shape.drop_front(axis + 1))};
}

/// Converts a double to an integer type without undefined behaviour: NaN
/// becomes 0, out-of-range values saturate.
template <typename T> T saturatingCast(double v) {
  if constexpr (IsBool<T>) {
    return v != 0;
  } else if constexpr (IsFloat<T>) {
    return static_cast<T>(v);
  } else {
    if (std::isnan(v))
      return 0;
    if (v <= static_cast<double>(std::numeric_limits<T>::lowest()))
      return std::numeric_limits<T>::lowest();
    if (v >= static_cast<double>(std::numeric_limits<T>::max()))
      return std::numeric_limits<T>::max();
    return static_cast<T>(v);
  }
}

} // namespace

Expected<Shape> broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1)
      return createStringError(inconvertibleErrorCode(), "shapes %s and %s do not broadcast",
                               shapeString(a).c_str(), shapeString(b).c_str());
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sumToShape(const Tensor &tensor, ArrayRef<int64_t> shape) {
  if (tensor.shape() == shape)
    return tensor.clone();
  Tensor out(tensor.elemType(), shape);
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = tensor.data<T>();
    T *dst = out.data<T>();
    forEachStrided<1>(tensor.shape(), {broadcastStrides(shape, tensor.shape())},
                      [&](int64_t i, const std::array<int64_t, 1> &off) {
                        if constexpr (IsBool<T>)
                          dst[off[0]] = dst[off[0]] || src[i];
                        else
                          dst[off[0]] += src[i];
                      });
  });
  out.roundToElemType();
  return out;
}

Tensor transpose(const Tensor &tensor, ArrayRef<int64_t> perm) {
  assert(static_cast<int64_t>(perm.size()) == tensor.rank());
  Shape outShape(perm.size()), readStrides(perm.size());
  Shape inStrides = stridesOf(tensor.shape());
  for (size_t i = 0; i < perm.size(); ++i) {
    outShape[i] = tensor.shape()[perm[i]];
    readStrides[i] = inStrides[perm[i]];
  }
  Tensor out(tensor.elemType(), outShape);
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = tensor.data<T>();
    T *dst = out.data<T>();
    forEachStrided<1>(outShape, {readStrides}, [&](int64_t o, const std::array<int64_t, 1> &off) {
      dst[o] = src[off[0]];
    });
  });
  return out;
}

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha,
          const double *a, int64_t lda, const double *b, int64_t ldb, double beta, double *c,
          int64_t ldc) {
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  cblas_dgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

namespace {

/// GEMM on any numeric storage type: OpenBLAS for float and double, a plain
/// triple loop for the integer types, which BLAS lacks.
template <typename T>
void gemmAny(bool transA, bool transB, int64_t m, int64_t n, int64_t k, T alpha, const T *a,
             int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
  if constexpr (IsFloat<T>) {
    pipec::cpu::gemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        T sum = 0;
        for (int64_t p = 0; p < k; ++p)
          sum += (transA ? a[p * lda + i] : a[i * lda + p]) *
                 (transB ? b[j * ldb + p] : b[p * ldb + j]);
        c[i * ldc + j] = static_cast<T>(alpha * sum + (beta == 0 ? T(0) : beta * c[i * ldc + j]));
      }
  }
}

//===----------------------------------------------------------------------===//
// Elementwise kernels
//===----------------------------------------------------------------------===//

/// y = fn(x) for floating x (float, double, float16, bfloat16).
template <typename Fn> Expected<Outputs> floatUnary(const OpContext &ctx, Fn fn) {
  const Tensor &x = ctx.input(0);
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(x.elemType(), x.shape());
      const T *in = x.data<T>();
      T *out = y.data<T>();
      for (int64_t i = 0, e = x.numElements(); i < e; ++i)
        out[i] = static_cast<T>(fn(in[i]));
      return Outputs{y};
    }
  });
}

/// y = fn(x) for every numeric type (not bool).
template <typename Fn> Expected<Outputs> numericUnary(const OpContext &ctx, Fn fn) {
  const Tensor &x = ctx.input(0);
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(x.elemType(), x.shape());
      const T *in = x.data<T>();
      T *out = y.data<T>();
      for (int64_t i = 0, e = x.numElements(); i < e; ++i)
        out[i] = static_cast<T>(fn(in[i]));
      return Outputs{y};
    }
  });
}

template <typename T> T sigmoid(T x) {
  // Never exponentiates a large positive number.
  if (x >= 0)
    return T(1) / (T(1) + std::exp(-x));
  T e = std::exp(x);
  return e / (T(1) + e);
}

template <typename T> T softplus(T x) {
  return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x));
}

Expected<Outputs> leakyRelu(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 0.01f);
  return floatUnary(ctx, [=](auto x) { return x < 0 ? alpha * x : x; });
}

Expected<Outputs> elu(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 1.0f);
  return floatUnary(ctx, [=](auto x) { return x < 0 ? alpha * std::expm1(double(x)) : x; });
}

Expected<Outputs> selu(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 1.67326319217681884765625f);
  double gamma = ctx.attrFloat("gamma", 1.05070102214813232421875f);
  return floatUnary(ctx, [=](auto x) {
    return gamma * (x <= 0 ? alpha * std::expm1(double(x)) : double(x));
  });
}

Expected<Outputs> celu(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 1.0f);
  return floatUnary(ctx, [=](auto x) {
    return std::max(0.0, double(x)) + std::min(0.0, alpha * std::expm1(x / alpha));
  });
}

Expected<Outputs> thresholdedRelu(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 1.0f);
  return floatUnary(ctx, [=](auto x) { return x > alpha ? x : decltype(x)(0); });
}

Expected<Outputs> hardSigmoid(const OpContext &ctx) {
  double alpha = ctx.attrFloat("alpha", 0.2f), beta = ctx.attrFloat("beta", 0.5f);
  return floatUnary(ctx, [=](auto x) { return std::clamp(alpha * x + beta, 0.0, 1.0); });
}

Expected<Outputs> gelu(const OpContext &ctx) {
  std::string approximate = ctx.attrString("approximate", "none");
  if (approximate == "tanh")
    return floatUnary(ctx, [](auto x) {
      double v = x;
      return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    });
  if (approximate != "none")
    return ctx.fail("approximate must be 'none' or 'tanh', not '" + approximate + "'");
  return floatUnary(ctx, [](auto x) { return 0.5 * x * (1 + std::erf(x * M_SQRT1_2)); });
}

/// Add, Sub, Mul, Div: both inputs of one numeric type, broadcast.
template <typename Fn>
Expected<Outputs> arithmetic(const OpContext &ctx, Fn fn, bool isDivision = false) {
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      if constexpr (!IsFloat<T>) {
        // Integer division by zero would trap; report it instead.
        if (isDivision && llvm::is_contained(b.values<T>(), T(0)))
          return ctx.fail("integer division by zero");
      }
      return Outputs{broadcastBinary<T, T, T>(a, b, a.elemType(), *shape,
                                              [&](T x, T y) { return static_cast<T>(fn(x, y)); })};
    }
  });
}

/// Equal, Less, Greater, ...: one element type, broadcast, bool result.
template <typename Fn>
Expected<Outputs> comparison(const OpContext &ctx, Fn fn, bool allowBool = false) {
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  if (a.elemType() == ElemType::Bool && !allowBool)
    return ctx.unsupportedType(a, 0);
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    return Outputs{broadcastBinary<T, T, bool>(a, b, ElemType::Bool, *shape,
                                               [&](T x, T y) -> bool { return fn(x, y); })};
  });
}

/// And, Or, Xor on bool inputs.
template <typename Fn> Expected<Outputs> logical(const OpContext &ctx, Fn fn) {
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  if (a.elemType() != ElemType::Bool)
    return ctx.fail("input 0 must be bool, not " + elemTypeName(a.elemType()));
  if (b.elemType() != ElemType::Bool)
    return ctx.fail("input 1 must be bool, not " + elemTypeName(b.elemType()));
  Expected<Shape> shape = broadcastShapes(a.shape(), b.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return Outputs{broadcastBinary<bool, bool, bool>(a, b, ElemType::Bool, *shape, fn)};
}

Expected<Outputs> logicalNot(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.elemType() != ElemType::Bool)
    return ctx.fail("input 0 must be bool, not " + elemTypeName(x.elemType()));
  Tensor y(ElemType::Bool, x.shape());
  for (int64_t i = 0; i < x.numElements(); ++i)
    y.data<bool>()[i] = !x.data<bool>()[i];
  return Outputs{y};
}

/// Pow: the base's type is the result type; the exponent may differ.
Expected<Outputs> pow(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &y = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(x.shape(), y.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  if (x.elemType() == ElemType::Bool)
    return ctx.unsupportedType(x, 0);
  if (y.elemType() == ElemType::Bool)
    return ctx.unsupportedType(y, 1);
  return visitStorage(x.elemType(), [&](auto xTag) -> Expected<Outputs> {
    using TX = decltype(xTag);
    return visitStorage(y.elemType(), [&](auto yTag) -> Expected<Outputs> {
      using TY = decltype(yTag);
      return Outputs{broadcastBinary<TX, TY, TX>(x, y, x.elemType(), *shape, [](TX a, TY b) {
        if constexpr (IsFloat<TX>)
          return static_cast<TX>(std::pow(a, b));
        else
          return saturatingCast<TX>(std::pow(double(a), double(b)));
      })};
    });
  });
}

/// PRelu: slope broadcasts to the input's shape.
Expected<Outputs> prelu(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  const Tensor &x = ctx.input(0), &slope = ctx.input(1);
  Expected<Shape> shape = broadcastShapes(x.shape(), slope.shape());
  if (!shape || *shape != x.shape()) {
    consumeError(shape.takeError());
    return ctx.fail("slope " + shapeString(slope.shape()) + " does not broadcast to " +
                    shapeString(x.shape()));
  }
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>)
      return ctx.unsupportedType(x, 0);
    else
      return Outputs{broadcastBinary<T, T, T>(
          x, slope, x.elemType(), *shape, [](T v, T s) { return static_cast<T>(v < 0 ? s * v : v); })};
  });
}

/// Min, Max, Sum, Mean: any number of inputs of one type, all broadcast.
template <typename Fn>
Expected<Outputs> variadic(const OpContext &ctx, Fn fn, bool isMean = false) {
  Shape shape = ctx.input(0).shape();
  for (size_t i = 1; i < ctx.numInputs(); ++i) {
    if (Error e = ctx.sameType(0, i))
      return std::move(e);
    Expected<Shape> next = broadcastShapes(shape, ctx.input(i).shape());
    if (!next)
      return ctx.fail(toString(next.takeError()));
    shape = *next;
  }
  const Tensor &first = ctx.input(0);
  return visitStorage(first.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(first, 0);
    } else {
      Tensor acc = expandTo<T>(first, shape);
      T *out = acc.data<T>();
      for (size_t i = 1; i < ctx.numInputs(); ++i) {
        const Tensor &next = ctx.input(i);
        const T *in = next.data<T>();
        forEachStrided<1>(shape, {broadcastStrides(next.shape(), shape)},
                          [&](int64_t o, const std::array<int64_t, 1> &off) {
                            out[o] = static_cast<T>(fn(out[o], in[off[0]]));
                          });
      }
      if (isMean)
        for (int64_t i = 0; i < acc.numElements(); ++i)
          out[i] = static_cast<T>(out[i] / static_cast<T>(ctx.numInputs()));
      return Outputs{acc};
    }
  });
}

/// Max/Min that propagate NaN, as numpy's maximum/minimum do.
template <typename T> T maxOf(T a, T b) {
  if constexpr (IsFloat<T>)
    if (std::isnan(a) || std::isnan(b))
      return std::numeric_limits<T>::quiet_NaN();
  return a < b ? b : a;
}
template <typename T> T minOf(T a, T b) {
  if constexpr (IsFloat<T>)
    if (std::isnan(a) || std::isnan(b))
      return std::numeric_limits<T>::quiet_NaN();
  return b < a ? b : a;
}

Expected<Outputs> where(const OpContext &ctx) {
  const Tensor &cond = ctx.input(0), &x = ctx.input(1), &y = ctx.input(2);
  if (cond.elemType() != ElemType::Bool)
    return ctx.fail("condition must be bool, not " + elemTypeName(cond.elemType()));
  if (Error e = ctx.sameType(1, 2))
    return std::move(e);
  Expected<Shape> shape = broadcastShapes(cond.shape(), x.shape());
  if (shape)
    shape = broadcastShapes(*shape, y.shape());
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  Tensor out(x.elemType(), *shape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const bool *c = cond.data<bool>();
    const T *px = x.data<T>(), *py = y.data<T>();
    T *po = out.data<T>();
    forEachStrided<3>(*shape,
                      {broadcastStrides(cond.shape(), *shape), broadcastStrides(x.shape(), *shape),
                       broadcastStrides(y.shape(), *shape)},
                      [&](int64_t o, const std::array<int64_t, 3> &off) {
                        po[o] = c[off[0]] ? px[off[1]] : py[off[2]];
                      });
  });
  return Outputs{out};
}

/// Clip: bounds are inputs 1 and 2 (opset 11+) or attributes (before).
Expected<Outputs> clip(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  const Tensor *lo = ctx.optInput(1), *hi = ctx.optInput(2);
  for (const Tensor *bound : {lo, hi}) {
    if (!bound)
      continue;
    if (bound->numElements() != 1)
      return ctx.fail("min and max must be scalars, not " + bound->describe());
    if (bound->elemType() != x.elemType())
      return ctx.fail("min and max must have the input's element type " +
                      elemTypeName(x.elemType()));
  }
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      T low = std::numeric_limits<T>::lowest(), high = std::numeric_limits<T>::max();
      if (lo)
        low = lo->data<T>()[0];
      else if (ctx.attr("min"))
        low = static_cast<T>(ctx.attrFloat("min", 0));
      if (hi)
        high = hi->data<T>()[0];
      else if (ctx.attr("max"))
        high = static_cast<T>(ctx.attrFloat("max", 0));
      Tensor y(x.elemType(), x.shape());
      const T *in = x.data<T>();
      T *out = y.data<T>();
      for (int64_t i = 0; i < x.numElements(); ++i)
        out[i] = in[i] < low ? low : (high < in[i] ? high : in[i]);
      return Outputs{y};
    }
  });
}

/// Converts every element of \p x to \p to.
Tensor castTo(const Tensor &x, ElemType to) {
  Tensor y(to, x.shape());
  visitStorage(x.elemType(), [&](auto fromTag) {
    using From = decltype(fromTag);
    visitStorage(to, [&](auto toTag) {
      using To = decltype(toTag);
      const From *in = x.data<From>();
      To *out = y.data<To>();
      for (int64_t i = 0; i < x.numElements(); ++i) {
        if constexpr (std::is_same_v<From, To>)
          out[i] = in[i];
        else if constexpr (IsBool<To>)
          out[i] = in[i] != From(0);
        else if constexpr (IsFloat<To> || (!IsFloat<From> && !IsBool<From>))
          out[i] = static_cast<To>(in[i]);
        else
          out[i] = saturatingCast<To>(static_cast<double>(in[i]));
      }
    });
  });
  y.roundToElemType();
  return y;
}

Expected<Outputs> cast(const OpContext &ctx) {
  const auto *to = ctx.attr("to");
  if (!to)
    return ctx.fail("missing attribute 'to'");
  Expected<ElemType> type = elemTypeFromOnnx(static_cast<int32_t>(to->i()));
  if (!type)
    return ctx.unsupported("cast to " + onnxTypeName(static_cast<int32_t>(to->i())));
  return Outputs{castTo(ctx.input(0), *type)};
}

Expected<Outputs> castLike(const OpContext &ctx) {
  return Outputs{castTo(ctx.input(0), ctx.input(1).elemType())};
}

//===----------------------------------------------------------------------===//
// Matrix products
//===----------------------------------------------------------------------===//

/// MatMul with numpy semantics: 1-D operands gain and then lose a dimension,
/// batch dimensions broadcast.
Expected<Outputs> matMul(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  if (a.rank() == 0 || b.rank() == 0)
    return ctx.fail("operands must have rank >= 1, got " + a.describe() + " and " + b.describe());
  Shape aShape = a.shape(), bShape = b.shape();
  if (a.rank() == 1)
    aShape.insert(aShape.begin(), 1);
  if (b.rank() == 1)
    bShape.push_back(1);
  int64_t m = aShape[aShape.size() - 2], k = aShape.back();
  int64_t n = bShape.back();
  if (bShape[bShape.size() - 2] != k)
    return ctx.fail("inner dimensions differ: " + a.describe() + " x " + b.describe());
  ArrayRef<int64_t> aBatch = ArrayRef<int64_t>(aShape).drop_back(2);
  ArrayRef<int64_t> bBatch = ArrayRef<int64_t>(bShape).drop_back(2);
  Expected<Shape> batch = broadcastShapes(aBatch, bBatch);
  if (!batch)
    return ctx.fail("batch dimensions: " + toString(batch.takeError()));
  Shape outShape = *batch;
  outShape.push_back(m);
  outShape.push_back(n);
  Shape finalShape = *batch;
  if (a.rank() > 1)
    finalShape.push_back(m);
  if (b.rank() > 1)
    finalShape.push_back(n);

  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      Tensor out(a.elemType(), outShape);
      const T *pa = a.data<T>(), *pb = b.data<T>();
      T *po = out.data<T>();
      if (product(bBatch) == 1 && Shape(aBatch) == *batch) {
        // One weight matrix for the whole batch: fold the batch into M.
        gemmAny<T>(false, false, product(aBatch) * m, n, k, T(1), pa, k, pb, n, T(0), po, n);
      } else {
        Shape aStrides = broadcastStrides(aBatch, *batch), bStrides = broadcastStrides(bBatch, *batch);
        for (int64_t &s : aStrides)
          s *= m * k;
        for (int64_t &s : bStrides)
          s *= k * n;
        forEachStrided<2>(*batch, {aStrides, bStrides},
                          [&](int64_t i, const std::array<int64_t, 2> &off) {
                            gemmAny<T>(false, false, m, n, k, T(1), pa + off[0], k, pb + off[1], n,
                                       T(0), po + i * m * n, n);
                          });
      }
      return Outputs{out.reshaped(finalShape)};
    }
  });
}

/// Gemm: Y = alpha * op(A) * op(B) + beta * C, C broadcast to Y.
Expected<Outputs> gemmOp(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  const Tensor &a = ctx.input(0), &b = ctx.input(1);
  const Tensor *c = ctx.optInput(2);
  if (a.rank() != 2 || b.rank() != 2)
    return ctx.fail("A and B must be matrices, got " + a.describe() + " and " + b.describe());
  bool transA = ctx.attrInt("transA", 0), transB = ctx.attrInt("transB", 0);
  int64_t m = transA ? a.dim(1) : a.dim(0), k = transA ? a.dim(0) : a.dim(1);
  int64_t kb = transB ? b.dim(1) : b.dim(0), n = transB ? b.dim(0) : b.dim(1);
  if (k != kb)
    return ctx.fail("inner dimensions differ: " + a.describe() + " x " + b.describe() +
                    (transA ? " (transA)" : "") + (transB ? " (transB)" : ""));
  Shape outShape{m, n};
  if (c) {
    if (c->elemType() != a.elemType())
      return ctx.fail("C must have A's element type");
    Expected<Shape> shape = broadcastShapes(c->shape(), outShape);
    if (!shape || *shape != outShape) {
      consumeError(shape.takeError());
      return ctx.fail("C " + c->describe() + " does not broadcast to " + shapeString(outShape));
    }
  }
  double alpha = ctx.attrFloat("alpha", 1.0f), beta = c ? ctx.attrFloat("beta", 1.0f) : 0.0;
  return visitStorage(a.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(a, 0);
    } else {
      Tensor y = c ? expandTo<T>(*c, outShape) : Tensor(a.elemType(), outShape);
      gemmAny<T>(transA, transB, m, n, k, static_cast<T>(alpha), a.data<T>(), a.dim(1),
                 b.data<T>(), b.dim(1), static_cast<T>(beta), y.data<T>(), n);
      return Outputs{y};
    }
  });
}

//===----------------------------------------------------------------------===//
// Softmax and normalization
//===----------------------------------------------------------------------===//

/// Softmax or log-softmax of \p x along the middle dimension of \p split.
template <typename T>
void softmaxAlong(const T *x, T *y, AxisSplit split, bool logarithm) {
  for (int64_t o = 0; o < split.outer; ++o)
    for (int64_t i = 0; i < split.inner; ++i) {
      const T *in = x + o * split.size * split.inner + i;
      T *out = y + o * split.size * split.inner + i;
      double maxValue = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < split.size; ++j)
        maxValue = std::max(maxValue, double(in[j * split.inner]));
      double sum = 0;
      for (int64_t j = 0; j < split.size; ++j)
        sum += std::exp(double(in[j * split.inner]) - maxValue);
      double logSum = std::log(sum);
      for (int64_t j = 0; j < split.size; ++j) {
        double shifted = double(in[j * split.inner]) - maxValue;
        out[j * split.inner] = static_cast<T>(logarithm ? shifted - logSum : std::exp(shifted) / sum);
      }
    }
}

/// Softmax and LogSoftmax. Before opset 13 the input is flattened to 2-D at
/// axis (default 1); from 13 on the op runs along the single axis (default -1).
Expected<Outputs> softmax(const OpContext &ctx, bool logarithm) {
  const Tensor &x = ctx.input(0);
  bool singleAxis = ctx.opset >= 13;
  int64_t rank = x.rank();
  if (rank == 0)
    return ctx.fail("input must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", singleAxis ? -1 : 1), rank);
  if (!axis)
    return axis.takeError();
  AxisSplit split = splitAt(x.shape(), *axis);
  if (!singleAxis)
    split = {split.outer, split.size * split.inner, 1};
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(x.elemType(), x.shape());
      softmaxAlong(x.data<T>(), y.data<T>(), split, logarithm);
      return Outputs{y};
    }
  });
}

/// LayerNormalization (opset 17): normalizes over dimensions [axis, rank).
/// Outputs Y, Mean and InvStdDev; the last two have the input's shape with
/// the normalized dimensions set to 1.
Expected<Outputs> layerNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &scale = ctx.input(1);
  const Tensor *bias = ctx.optInput(2);
  if (Error e = ctx.sameType(0, 1))
    return std::move(e);
  if (bias && bias->elemType() != x.elemType())
    return ctx.fail("B must have X's element type");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", -1), x.rank());
  if (!axis)
    return axis.takeError();
  double epsilon = ctx.attrFloat("epsilon", 1e-5f);
  int64_t stashType = ctx.attrInt("stash_type", 1);
  if (stashType != 1 && stashType != 11)
    return ctx.unsupported(formatv("stash_type {0}", stashType));
  Shape normShape(x.shape().begin() + *axis, x.shape().end());
  for (const Tensor *t : {&scale, bias}) {
    if (!t)
      continue;
    Expected<Shape> shape = broadcastShapes(t->shape(), normShape);
    if (!shape || *shape != normShape) {
      consumeError(shape.takeError());
      return ctx.fail(t->describe() + " does not broadcast to the normalized shape " +
                      shapeString(normShape));
    }
  }
  int64_t outer = product(ArrayRef<int64_t>(x.shape()).take_front(*axis));
  int64_t size = product(normShape);
  Shape statShape = x.shape();
  std::fill(statShape.begin() + *axis, statShape.end(), 1);
  ElemType statType = stashType == 11 ? ElemType::Double : ElemType::Float;
  Tensor meanOut(statType, statShape), invStdOut(statType, statShape);

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor gamma = expandTo<T>(scale, normShape);
      Tensor beta = bias ? expandTo<T>(*bias, normShape) : Tensor(x.elemType(), normShape);
      Tensor y(x.elemType(), x.shape());
      const T *g = gamma.data<T>(), *bb = beta.data<T>();
      for (int64_t o = 0; o < outer; ++o) {
        const T *in = x.data<T>() + o * size;
        T *out = y.data<T>() + o * size;
        double mean = 0, var = 0;
        for (int64_t j = 0; j < size; ++j)
          mean += in[j];
        mean /= size;
        for (int64_t j = 0; j < size; ++j)
          var += (in[j] - mean) * (in[j] - mean);
        var /= size;
        double invStd = 1 / std::sqrt(var + epsilon);
        for (int64_t j = 0; j < size; ++j)
          out[j] = static_cast<T>((in[j] - mean) * invStd * g[j] + bb[j]);
        meanOut.setDouble(o, mean);
        invStdOut.setDouble(o, invStd);
      }
      return Outputs{y, meanOut, invStdOut};
    }
  });
}

/// BatchNormalization. Inference normalizes with the given statistics; with
/// training_mode (opset 14+) it uses the batch's and also returns the updated
/// running mean and variance.
Expected<Outputs> batchNormalization(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail("X must have rank >= 2, got " + x.describe());
  bool training = ctx.opset >= 14 && ctx.attrInt("training_mode", 0);
  if (!training && (ctx.wantsOutput(1) || ctx.wantsOutput(2) || ctx.wantsOutput(3) ||
                    ctx.wantsOutput(4)))
    return ctx.unsupported("training outputs without training_mode (opset < 14)");
  int64_t channels = x.dim(1);
  for (size_t i = 1; i <= 4; ++i) {
    const Tensor &p = ctx.input(i);
    if (p.rank() != 1 || p.dim(0) != channels)
      return ctx.fail(formatv("input {0} must have shape [{1}], got {2}", i, channels,
                              p.describe()));
    if (!isFloating(p.elemType()))
      return ctx.unsupportedType(p, i);
  }
  double epsilon = ctx.attrFloat("epsilon", 1e-5f), momentum = ctx.attrFloat("momentum", 0.9f);
  int64_t batch = x.dim(0), spatial = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  std::vector<double> mean(channels), var(channels);
  Tensor runningMean(ctx.input(3).elemType(), {channels});
  Tensor runningVar(ctx.input(4).elemType(), {channels});

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      const T *in = x.data<T>();
      for (int64_t c = 0; c < channels; ++c) {
        if (!training) {
          mean[c] = ctx.input(3).getDouble(c);
          var[c] = ctx.input(4).getDouble(c);
          continue;
        }
        double sum = 0, sumSq = 0;
        for (int64_t n = 0; n < batch; ++n)
          for (int64_t s = 0; s < spatial; ++s)
            sum += in[(n * channels + c) * spatial + s];
        double count = double(batch * spatial);
        mean[c] = sum / count;
        for (int64_t n = 0; n < batch; ++n)
          for (int64_t s = 0; s < spatial; ++s) {
            double d = in[(n * channels + c) * spatial + s] - mean[c];
            sumSq += d * d;
          }
        var[c] = sumSq / count;
        runningMean.setDouble(c, ctx.input(3).getDouble(c) * momentum + mean[c] * (1 - momentum));
        runningVar.setDouble(c, ctx.input(4).getDouble(c) * momentum + var[c] * (1 - momentum));
      }
      Tensor y(x.elemType(), x.shape());
      T *out = y.data<T>();
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t c = 0; c < channels; ++c) {
          double mul = ctx.input(1).getDouble(c) / std::sqrt(var[c] + epsilon);
          double add = ctx.input(2).getDouble(c) - mean[c] * mul;
          int64_t base = (n * channels + c) * spatial;
          for (int64_t s = 0; s < spatial; ++s)
            out[base + s] = static_cast<T>(in[base + s] * mul + add);
        }
      if (training)
        return Outputs{y, runningMean, runningVar};
      return Outputs{y};
    }
  });
}

