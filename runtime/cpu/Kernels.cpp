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
#include "runtime/kernels/KernelBodies.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include <cblas.h>

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <cmath>
#include <cstring>
#include <dlfcn.h>
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

  const onnx::AttributeProto *attr(StringRef name) const { return findAttr(node, name); }
  int64_t attrInt(StringRef name, int64_t otherwise) const {
    return pipec::attrInt(node, name, otherwise);
  }
  float attrFloat(StringRef name, float otherwise) const {
    return pipec::attrFloat(node, name, otherwise);
  }
  std::string attrString(StringRef name, StringRef otherwise) const {
    return pipec::attrString(node, name, otherwise);
  }
  std::optional<Shape> attrInts(StringRef name) const { return pipec::attrInts(node, name); }
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
    return unsupported(
        formatv("element type {0} of input {1}", elemTypeName(t.elemType()), inputIndex));
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
/// right-aligned): 0 along broadcast dimensions (KernelBodies' rule).
Shape broadcastStrides(ArrayRef<int64_t> shape, ArrayRef<int64_t> outShape) {
  assert(shape.size() <= outShape.size() && "shape has more dimensions than it broadcasts to");
  return cuda::kernels::broadcastStrides(shape.vec(), outShape.vec());
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
  if (ArrayRef<int64_t>(in.shape()) == outShape) {
    std::copy(src, src + in.numElements(), dst);
    return out;
  }
  forEachStrided<1>(outShape, {broadcastStrides(in.shape(), outShape)},
                    [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  return out;
}

Tensor expandAny(const Tensor &in, ArrayRef<int64_t> outShape) {
  return visitStorage(in.elemType(),
                      [&](auto tag) { return expandTo<decltype(tag)>(in, outShape); });
}

/// out[o] = fn(a[.], b[.]) over the broadcast of a and b.
template <typename TA, typename TB, typename TO, typename Fn>
Tensor broadcastBinary(const Tensor &a, const Tensor &b, ElemType outType,
                       ArrayRef<int64_t> outShape, Fn &&fn) {
  Tensor out(outType, outShape);
  const TA *pa = a.data<TA>();
  const TB *pb = b.data<TB>();
  TO *po = out.data<TO>();
  ArrayRef<int64_t> aShape = a.shape(), bShape = b.shape();
  if (aShape == outShape && bShape == outShape) {
    for (int64_t i = 0, e = out.numElements(); i < e; ++i)
      po[i] = fn(pa[i], pb[i]);
  } else if (aShape == outShape && b.numElements() == 1) {
    TB scalar = pb[0];
    for (int64_t i = 0, e = out.numElements(); i < e; ++i)
      po[i] = fn(pa[i], scalar);
  } else {
    forEachStrided<2>(
        outShape, {broadcastStrides(a.shape(), outShape), broadcastStrides(b.shape(), outShape)},
        [&](int64_t o, const std::array<int64_t, 2> &off) { po[o] = fn(pa[off[0]], pb[off[1]]); });
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

/// Converts a double to T without undefined behaviour: NaN becomes 0,
/// out-of-range values saturate (KernelBodies' castValue, which the device
/// kernels use too).
template <typename T> T saturatingCast(double v) { return cuda::kernels::castValue<double, T>(v); }

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
  if (ArrayRef<int64_t>(tensor.shape()) == shape)
    return tensor.clone();
  Tensor out(tensor.elemType(), shape);
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    // Floats accumulate in double: a gradient may sum thousands of terms.
    using Acc = std::conditional_t<IsFloat<T>, double, T>;
    std::vector<Acc> sums(out.numElements(), Acc(0));
    const T *src = tensor.data<T>();
    forEachStrided<1>(tensor.shape(), {broadcastStrides(shape, tensor.shape())},
                      [&](int64_t i, const std::array<int64_t, 1> &off) {
                        if constexpr (IsBool<T>)
                          sums[off[0]] = sums[off[0]] || src[i];
                        else
                          sums[off[0]] += src[i];
                      });
    std::transform(sums.begin(), sums.end(), out.data<T>(),
                   [](Acc v) { return static_cast<T>(v); });
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
  size_t rank = perm.size();
  bool leadingKept = true;
  for (size_t i = 0; i + 2 < rank; ++i)
    leadingKept &= perm[i] == static_cast<int64_t>(i);
  visitStorage(tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = tensor.data<T>();
    T *dst = out.data<T>();
    if (rank >= 2 && leadingKept && perm[rank - 2] == static_cast<int64_t>(rank - 1) &&
        perm[rank - 1] == static_cast<int64_t>(rank - 2)) {
      // Matrices transposed in tiles (weights in backward, attention keys).
      int64_t rows = tensor.shape()[rank - 2], cols = tensor.shape()[rank - 1];
      int64_t batch = rows * cols > 0 ? tensor.numElements() / (rows * cols) : 0;
      constexpr int64_t Tile = 32;
      for (int64_t b = 0; b < batch; ++b) {
        const T *in = src + b * rows * cols;
        T *o = dst + b * rows * cols;
        for (int64_t i0 = 0; i0 < rows; i0 += Tile)
          for (int64_t j0 = 0; j0 < cols; j0 += Tile)
            for (int64_t i = i0; i < std::min(rows, i0 + Tile); ++i)
              for (int64_t j = j0; j < std::min(cols, j0 + Tile); ++j)
                o[j * rows + i] = in[i * cols + j];
      }
      return;
    }
    if (rank >= 1 && perm[rank - 1] == static_cast<int64_t>(rank - 1) && !std::is_same_v<T, bool>) {
      // The last dimension stays innermost: copy whole rows (attention heads).
      int64_t row = tensor.shape()[rank - 1];
      if (row == 0)
        return;
      Shape outer(outShape.begin(), outShape.end() - 1);
      Shape outerStrides(readStrides.begin(), readStrides.end() - 1);
      forEachStrided<1>(outer, {outerStrides}, [&](int64_t o, const std::array<int64_t, 1> &off) {
        std::memcpy(dst + o * row, src + off[0], row * sizeof(T));
      });
      return;
    }
    forEachStrided<1>(outShape, {readStrides},
                      [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  });
  return out;
}

namespace {

/// C = alpha op(A) op(B) + beta C through \p blas (cblas_sgemm or
/// cblas_dgemm); BLAS rejects k == 0, which only scales C.
template <typename T, typename Blas>
void gemmWith(Blas blas, bool transA, bool transB, int64_t m, int64_t n, int64_t k, T alpha,
              const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j];
    return;
  }
  blas(CblasRowMajor, transA ? CblasTrans : CblasNoTrans, transB ? CblasTrans : CblasNoTrans, m, n,
       k, alpha, a, lda, b, ldb, beta, c, ldc);
}

} // namespace

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
  gemmWith(cblas_sgemm, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double *a,
          int64_t lda, const double *b, int64_t ldb, double beta, double *c, int64_t ldc) {
  gemmWith(cblas_dgemm, transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

/// y = fn(x) for the element types Accepts<T> admits; others are refused.
template <template <typename> class Accepts, typename Fn>
Expected<Outputs> unaryOver(const OpContext &ctx, Fn fn) {
  const Tensor &x = ctx.input(0);
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!Accepts<T>::value) {
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

template <typename T> struct NotBool : std::bool_constant<!IsBool<T>> {};

/// y = fn(x) for floating x (float, double, float16, bfloat16).
template <typename Fn> Expected<Outputs> floatUnary(const OpContext &ctx, Fn fn) {
  return unaryOver<std::is_floating_point>(ctx, fn);
}

/// y = fn(x) for every numeric type (not bool).
template <typename Fn> Expected<Outputs> numericUnary(const OpContext &ctx, Fn fn) {
  return unaryOver<NotBool>(ctx, fn);
}

/// x / y without the trap of INT_MIN / -1, which wraps as in two's complement.
/// (Division by zero is checked before any element is divided.)
template <typename T> T divide(T x, T y) {
  if constexpr (std::is_signed_v<T> && !IsFloat<T>)
    if (y == -1)
      return static_cast<T>(std::make_unsigned_t<T>(0) - static_cast<std::make_unsigned_t<T>>(x));
  return static_cast<T>(x / y);
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
  return floatUnary(
      ctx, [=](auto x) { return gamma * (x <= 0 ? alpha * std::expm1(double(x)) : double(x)); });
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
    return e;
  const Tensor &a = ctx.input(0);
  Tensor b = ctx.input(1);
  // Before opset 7, broadcast=1 with an axis aligned B's dimensions with A's
  // starting at axis rather than at the end.
  if (ctx.opset < 7 && ctx.attrInt("broadcast", 0) && ctx.attr("axis")) {
    int64_t axis = ctx.attrInt("axis", 0);
    if (axis < 0)
      axis += a.rank();
    if (axis < 0 || axis + b.rank() > a.rank())
      return ctx.fail(formatv("legacy broadcast axis {0} does not fit {1} and {2}",
                              ctx.attrInt("axis", 0), a.describe(), b.describe()));
    Shape aligned = b.shape();
    aligned.resize(a.rank() - axis, 1);
    b = b.reshaped(aligned);
  }
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
    return e;
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
        if constexpr (IsFloat<TX>) {
          if (b == TY(2)) // squares and cubes (GELU's tanh form) without libm
            return static_cast<TX>(a * a);
          if (b == TY(3))
            return static_cast<TX>(a * a * a);
          return static_cast<TX>(std::pow(a, b));
        } else
          return saturatingCast<TX>(std::pow(double(a), double(b)));
      })};
    });
  });
}

/// PRelu: slope broadcasts to the input's shape. Before opset 7 a 1-D slope
/// holds one value per channel (dimension 1).
Expected<Outputs> prelu(const OpContext &ctx) {
  if (Error e = ctx.sameType(0, 1))
    return e;
  const Tensor &x = ctx.input(0);
  Tensor slope = ctx.input(1);
  if (ctx.opset < 7 && slope.rank() == 1 && x.rank() >= 2 && slope.dim(0) == x.dim(1) &&
      slope.dim(0) != 1) {
    Shape perChannel(x.rank() - 1, 1);
    perChannel[0] = slope.dim(0);
    slope = slope.reshaped(perChannel);
  }
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
      return Outputs{broadcastBinary<T, T, T>(x, slope, x.elemType(), *shape, [](T v, T s) {
        return static_cast<T>(v < 0 ? s * v : v);
      })};
  });
}

/// Min, Max, Sum, Mean: any number of inputs of one type, all broadcast.
template <typename Fn>
Expected<Outputs> variadic(const OpContext &ctx, Fn fn, bool isMean = false) {
  Shape shape = ctx.input(0).shape();
  for (size_t i = 1; i < ctx.numInputs(); ++i) {
    if (Error e = ctx.sameType(0, i))
      return e;
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
    return e;
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
    return e;
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
        Shape aStrides = broadcastStrides(aBatch, *batch),
              bStrides = broadcastStrides(bBatch, *batch);
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
    return e;
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
      gemmAny<T>(transA, transB, m, n, k, static_cast<T>(alpha), a.data<T>(), a.dim(1), b.data<T>(),
                 b.dim(1), static_cast<T>(beta), y.data<T>(), n);
      return Outputs{y};
    }
  });
}

//===----------------------------------------------------------------------===//
// Softmax and normalization
//===----------------------------------------------------------------------===//

/// Softmax or log-softmax of \p x along the middle dimension of \p split.
/// Sums run in double; each exponential is computed once.
template <typename T> void softmaxAlong(const T *x, T *y, AxisSplit split, bool logarithm) {
  std::vector<double> shifted(split.size);
  for (int64_t o = 0; o < split.outer; ++o)
    for (int64_t i = 0; i < split.inner; ++i) {
      const T *in = x + o * split.size * split.inner + i;
      T *out = y + o * split.size * split.inner + i;
      double maxValue = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < split.size; ++j)
        maxValue = std::max(maxValue, double(in[j * split.inner]));
      double sum = 0;
      for (int64_t j = 0; j < split.size; ++j) {
        shifted[j] = double(in[j * split.inner]) - maxValue;
        double e = std::exp(shifted[j]);
        sum += e;
        if (!logarithm)
          shifted[j] = e;
      }
      double scale = logarithm ? std::log(sum) : 1 / sum;
      for (int64_t j = 0; j < split.size; ++j)
        out[j * split.inner] = static_cast<T>(logarithm ? shifted[j] - scale : shifted[j] * scale);
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
    return e;
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
  if (ctx.opset < 9 && ctx.attrInt("spatial", 1) == 0)
    return ctx.unsupported("spatial = 0 (per-activation statistics)");
  bool training = ctx.opset >= 14 && ctx.attrInt("training_mode", 0);
  if (!training &&
      (ctx.wantsOutput(1) || ctx.wantsOutput(2) || ctx.wantsOutput(3) || ctx.wantsOutput(4)))
    return ctx.unsupported("training outputs without training_mode (opset < 14)");
  int64_t channels = x.dim(1);
  for (size_t i = 1; i <= 4; ++i) {
    const Tensor &p = ctx.input(i);
    if (p.rank() != 1 || p.dim(0) != channels)
      return ctx.fail(
          formatv("input {0} must have shape [{1}], got {2}", i, channels, p.describe()));
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

//===----------------------------------------------------------------------===//
// Data movement
//===----------------------------------------------------------------------===//

Expected<Outputs> reshape(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> requested = ctx.intsFromInputOrAttr(1, "shape");
  if (!requested)
    return ctx.fail("missing the target shape");
  bool allowZero = ctx.attrInt("allowzero", 0);
  Shape shape;
  int64_t inferred = -1;
  for (size_t i = 0; i < requested->size(); ++i) {
    int64_t d = (*requested)[i];
    if (d == -1) {
      if (inferred >= 0)
        return ctx.fail("more than one -1 in shape " + shapeString(*requested));
      inferred = static_cast<int64_t>(i);
      shape.push_back(1);
    } else if (d == 0 && !allowZero) {
      if (static_cast<int64_t>(i) >= x.rank())
        return ctx.fail("0 at position " + Twine(i) + " copies no input dimension");
      shape.push_back(x.dim(i));
    } else if (d < 0) {
      return ctx.fail("invalid dimension in shape " + shapeString(*requested));
    } else {
      shape.push_back(d);
    }
  }
  if (inferred >= 0) {
    int64_t known = product(shape);
    if (known == 0 || x.numElements() % known != 0)
      return ctx.fail("cannot infer -1 reshaping " + x.describe() + " to " +
                      shapeString(*requested));
    shape[inferred] = x.numElements() / known;
  }
  if (product(shape) != x.numElements())
    return ctx.fail("cannot reshape " + x.describe() + " to " + shapeString(*requested));
  return Outputs{x.reshaped(shape)};
}

Expected<Outputs> flatten(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  int64_t axis = ctx.attrInt("axis", 1);
  if (axis < 0)
    axis += x.rank();
  if (axis < 0 || axis > x.rank())
    return ctx.fail(
        formatv("axis {0} is out of range for rank {1}", ctx.attrInt("axis", 1), x.rank()));
  ArrayRef<int64_t> shape = x.shape();
  return Outputs{x.reshaped({product(shape.take_front(axis)), product(shape.drop_front(axis))})};
}

Expected<Outputs> squeeze(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  std::vector<bool> drop(x.rank(), false);
  if (!axes) {
    for (int64_t i = 0; i < x.rank(); ++i)
      drop[i] = x.dim(i) == 1;
  } else {
    for (int64_t a : *axes) {
      Expected<int64_t> axis = ctx.normalizeAxis(a, x.rank());
      if (!axis)
        return axis.takeError();
      if (x.dim(*axis) != 1)
        return ctx.fail(formatv("cannot squeeze dimension {0} of {1}", a, x.describe()));
      drop[*axis] = true;
    }
  }
  Shape shape;
  for (int64_t i = 0; i < x.rank(); ++i)
    if (!drop[i])
      shape.push_back(x.dim(i));
  return Outputs{x.reshaped(shape)};
}

Expected<Outputs> unsqueeze(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  if (!axes)
    return ctx.fail("missing axes");
  int64_t rank = x.rank() + static_cast<int64_t>(axes->size());
  std::vector<bool> inserted(rank, false);
  for (int64_t a : *axes) {
    Expected<int64_t> axis = ctx.normalizeAxis(a, rank);
    if (!axis)
      return axis.takeError();
    if (inserted[*axis])
      return ctx.fail(formatv("axis {0} appears twice", a));
    inserted[*axis] = true;
  }
  Shape shape;
  int64_t next = 0;
  for (int64_t i = 0; i < rank; ++i)
    shape.push_back(inserted[i] ? 1 : x.dim(next++));
  return Outputs{x.reshaped(shape)};
}

Expected<Outputs> transposeOp(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape perm(x.rank());
  if (std::optional<Shape> given = ctx.attrInts("perm")) {
    perm = *given;
    Shape sorted = perm;
    llvm::sort(sorted);
    bool valid = static_cast<int64_t>(sorted.size()) == x.rank();
    for (int64_t i = 0; valid && i < x.rank(); ++i)
      valid = sorted[i] == i;
    if (!valid)
      return ctx.fail("perm " + shapeString(perm) + " is not a permutation of rank " +
                      Twine(x.rank()));
  } else {
    for (int64_t i = 0; i < x.rank(); ++i)
      perm[i] = x.rank() - 1 - i;
  }
  return Outputs{transpose(x, perm)};
}

Expected<Outputs> concat(const OpContext &ctx) {
  const Tensor &first = ctx.input(0);
  const auto *axisAttr = ctx.attr("axis");
  if (!axisAttr && ctx.opset >= 4)
    return ctx.fail("missing attribute 'axis'");
  // Concat-1 defaulted to axis 1.
  Expected<int64_t> axis = ctx.normalizeAxis(axisAttr ? axisAttr->i() : 1, first.rank());
  if (!axis)
    return axis.takeError();
  Shape shape = first.shape();
  shape[*axis] = 0;
  for (size_t i = 0; i < ctx.numInputs(); ++i) {
    const Tensor &t = ctx.input(i);
    if (Error e = ctx.sameType(0, i))
      return e;
    bool compatible = t.rank() == first.rank();
    for (int64_t d = 0; compatible && d < t.rank(); ++d)
      compatible = d == *axis || t.dim(d) == first.dim(d);
    if (!compatible)
      return ctx.fail("input " + Twine(i) + " " + t.describe() + " does not match input 0 " +
                      first.describe() + " outside axis " + Twine(*axis));
    shape[*axis] += t.dim(*axis);
  }
  Tensor out(first.elemType(), shape);
  size_t elemSize = storageSize(first.elemType());
  AxisSplit split = splitAt(shape, *axis);
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t o = 0; o < split.outer; ++o)
    for (size_t i = 0; i < ctx.numInputs(); ++i) {
      const Tensor &t = ctx.input(i);
      size_t block = t.dim(*axis) * split.inner * elemSize;
      std::memcpy(dst, static_cast<const char *>(t.rawData()) + o * block, block);
      dst += block;
    }
  return Outputs{out};
}

Expected<Outputs> split(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), x.rank());
  if (!axis)
    return axis.takeError();
  int64_t dim = x.dim(*axis);
  int64_t parts = static_cast<int64_t>(ctx.numOutputs());
  std::optional<Shape> sizes = ctx.intsFromInputOrAttr(1, "split");
  if (!sizes) {
    if (const auto *numOutputs = ctx.attr("num_outputs"))
      parts = numOutputs->i();
    if (parts <= 0)
      return ctx.fail("no outputs to split into");
    // Equal parts; opset 18's num_outputs lets the last one be smaller.
    int64_t chunk = (dim + parts - 1) / parts;
    if (!ctx.attr("num_outputs") && dim % parts != 0)
      return ctx.fail(formatv("dimension {0} of size {1} does not split into {2} equal parts",
                              *axis, dim, parts));
    sizes.emplace();
    for (int64_t i = 0; i < parts; ++i)
      sizes->push_back(std::max<int64_t>(0, std::min(chunk, dim - i * chunk)));
  }
  if (static_cast<int64_t>(sizes->size()) != parts ||
      std::accumulate(sizes->begin(), sizes->end(), int64_t(0)) != dim ||
      llvm::any_of(*sizes, [](int64_t s) { return s < 0; }))
    return ctx.fail(formatv("split sizes {0} do not cover dimension {1} of size {2} in {3} parts",
                            shapeString(*sizes), *axis, dim, parts));
  AxisSplit layout = splitAt(x.shape(), *axis);
  size_t elemSize = storageSize(x.elemType());
  Outputs outputs;
  int64_t begin = 0;
  for (int64_t size : *sizes) {
    Shape shape = x.shape();
    shape[*axis] = size;
    Tensor part(x.elemType(), shape);
    size_t block = size * layout.inner * elemSize;
    for (int64_t o = 0; o < layout.outer; ++o)
      std::memcpy(static_cast<char *>(part.rawData()) + o * block,
                  static_cast<const char *>(x.rawData()) +
                      (o * dim + begin) * layout.inner * elemSize,
                  block);
    begin += size;
    outputs.push_back(part);
  }
  return outputs;
}

/// Copies the strided view (shape, strides, start offset) of \p x.
Tensor gatherStrided(const Tensor &x, ArrayRef<int64_t> shape, const Shape &strides,
                     int64_t start) {
  Tensor out(x.elemType(), shape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>() + start;
    T *dst = out.data<T>();
    forEachStrided<1>(shape, {strides},
                      [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  });
  return out;
}

/// Slice: starts, ends, axes and steps are inputs from opset 10, attributes
/// before. Negative steps walk backwards.
Expected<Outputs> slice(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> starts = ctx.intsFromInputOrAttr(1, "starts");
  std::optional<Shape> ends = ctx.intsFromInputOrAttr(2, "ends");
  if (!starts || !ends)
    return ctx.fail("missing starts or ends");
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(3, "axes");
  std::optional<Shape> steps = ctx.intsFromInputOrAttr(4, "steps");
  size_t count = starts->size();
  if (!axes) {
    axes.emplace(count);
    std::iota(axes->begin(), axes->end(), 0);
  }
  if (!steps)
    steps.emplace(count, 1);
  if (ends->size() != count || axes->size() != count || steps->size() != count)
    return ctx.fail("starts, ends, axes and steps differ in length");
  Shape shape = x.shape(), inStrides = stridesOf(x.shape()), readStrides = inStrides;
  int64_t start = 0;
  std::vector<bool> seen(x.rank(), false);
  for (size_t i = 0; i < count; ++i) {
    Expected<int64_t> axis = ctx.normalizeAxis((*axes)[i], x.rank());
    if (!axis)
      return axis.takeError();
    if (seen[*axis])
      return ctx.fail(formatv("axis {0} appears twice", (*axes)[i]));
    seen[*axis] = true;
    int64_t dim = x.dim(*axis);
    // Keep -step representable; no dimension is that long anyway.
    int64_t step = std::max((*steps)[i], -std::numeric_limits<int64_t>::max());
    if (step == 0)
      return ctx.fail("step 0 on axis " + Twine((*axes)[i]));
    int64_t begin = (*starts)[i], end = (*ends)[i];
    if (begin < 0)
      begin += dim;
    if (end < 0)
      end += dim;
    int64_t length;
    if (dim == 0) {
      begin = 0;
      length = 0;
    } else if (step > 0) {
      begin = std::clamp<int64_t>(begin, 0, dim);
      end = std::clamp<int64_t>(end, 0, dim);
      // Written so that a huge step cannot overflow.
      length = end > begin ? (end - begin - 1) / step + 1 : 0;
    } else {
      begin = std::clamp<int64_t>(begin, 0, dim - 1);
      end = std::clamp<int64_t>(end, -1, dim - 1);
      length = begin > end ? (begin - end - 1) / -step + 1 : 0;
    }
    shape[*axis] = length;
    readStrides[*axis] = inStrides[*axis] * step;
    if (length > 0)
      start += begin * inStrides[*axis];
  }
  return Outputs{gatherStrided(x, shape, readStrides, start)};
}

Expected<Outputs> gather(const OpContext &ctx) {
  const Tensor &data = ctx.input(0), &indices = ctx.input(1);
  if (indices.elemType() != ElemType::Int64 && indices.elemType() != ElemType::Int32)
    return ctx.fail("indices must be int32 or int64, not " + elemTypeName(indices.elemType()));
  if (data.rank() == 0)
    return ctx.fail("data must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), data.rank());
  if (!axis)
    return axis.takeError();
  AxisSplit layout = splitAt(data.shape(), *axis);
  Shape shape(data.shape().begin(), data.shape().begin() + *axis);
  shape.insert(shape.end(), indices.shape().begin(), indices.shape().end());
  shape.insert(shape.end(), data.shape().begin() + *axis + 1, data.shape().end());
  std::vector<int64_t> index = indices.toInt64Vector();
  for (int64_t &i : index) {
    if (i < -layout.size || i >= layout.size)
      return ctx.fail(formatv("index {0} is out of range for dimension {1} of size {2}", i, *axis,
                              layout.size));
    if (i < 0)
      i += layout.size;
  }
  Tensor out(data.elemType(), shape);
  size_t block = layout.inner * storageSize(data.elemType());
  const char *src = static_cast<const char *>(data.rawData());
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t o = 0; o < layout.outer; ++o)
    for (int64_t i : index) {
      std::memcpy(dst, src + (o * layout.size + i) * block, block);
      dst += block;
    }
  return Outputs{out};
}

Expected<Outputs> expand(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape requested = ctx.input(1).toInt64Vector();
  if (llvm::any_of(requested, [](int64_t d) { return d < 0; }))
    return ctx.fail("negative dimension in shape " + shapeString(requested));
  Expected<Shape> shape = broadcastShapes(x.shape(), requested);
  if (!shape)
    return ctx.fail(toString(shape.takeError()));
  return Outputs{expandAny(x, *shape)};
}

Expected<Outputs> tile(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  Shape repeats = ctx.input(1).toInt64Vector();
  if (static_cast<int64_t>(repeats.size()) != x.rank() ||
      llvm::any_of(repeats, [](int64_t r) { return r < 0; }))
    return ctx.fail("repeats " + shapeString(repeats) + " do not fit " + x.describe());
  // View the output as [r0, d0, r1, d1, ...]: the repeat dimensions read
  // with stride 0.
  Shape viewShape, viewStrides, outShape;
  Shape inStrides = stridesOf(x.shape());
  for (int64_t i = 0; i < x.rank(); ++i) {
    viewShape.push_back(repeats[i]);
    viewShape.push_back(x.dim(i));
    viewStrides.push_back(0);
    viewStrides.push_back(inStrides[i]);
    outShape.push_back(repeats[i] * x.dim(i));
  }
  return Outputs{gatherStrided(x, viewShape, viewStrides, 0).reshaped(outShape)};
}

Expected<Outputs> shapeOp(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  int64_t rank = x.rank();
  int64_t start = ctx.attrInt("start", 0), end = ctx.attrInt("end", rank);
  if (start < 0)
    start += rank;
  if (end < 0)
    end += rank;
  start = std::clamp<int64_t>(start, 0, rank);
  end = std::clamp<int64_t>(end, 0, rank);
  Shape dims(x.shape().begin() + start, x.shape().begin() + std::max(start, end));
  return Outputs{Tensor::fromValues<int64_t>({static_cast<int64_t>(dims.size())}, dims)};
}

Expected<Outputs> size(const OpContext &ctx) {
  return Outputs{Tensor::scalar<int64_t>(ctx.input(0).numElements())};
}

Expected<Outputs> constantOfShape(const OpContext &ctx) {
  Shape shape = ctx.input(0).toInt64Vector();
  if (llvm::any_of(shape, [](int64_t d) { return d < 0; }))
    return ctx.fail("negative dimension in " + shapeString(shape));
  Tensor value = Tensor::scalar(0.0f);
  if (const auto *attr = ctx.attr("value")) {
    Expected<Tensor> given = fromTensorProto(attr->t());
    if (!given)
      return ctx.unsupported(toString(given.takeError()));
    if (given->numElements() != 1)
      return ctx.fail("value must have one element, not " + given->describe());
    value = *given;
  }
  return Outputs{expandAny(value.reshaped({}), shape)};
}

Expected<Outputs> range(const OpContext &ctx) {
  const Tensor &start = ctx.input(0), &limit = ctx.input(1), &delta = ctx.input(2);
  for (size_t i = 0; i < 3; ++i)
    if (ctx.input(i).numElements() != 1)
      return ctx.fail("start, limit and delta must be scalars");
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (Error e = ctx.sameType(0, 2))
    return e;
  return visitStorage(start.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(start, 0);
    } else {
      T first = start.data<T>()[0], step = delta.data<T>()[0], last = limit.data<T>()[0];
      if (step == T(0))
        return ctx.fail("delta is 0");
      double steps = std::ceil((double(last) - double(first)) / double(step));
      if (!std::isfinite(steps))
        return ctx.fail("start, limit and delta give no finite element count");
      int64_t count = std::max<int64_t>(0, static_cast<int64_t>(steps));
      Tensor out(start.elemType(), {count});
      for (int64_t i = 0; i < count; ++i)
        out.data<T>()[i] = static_cast<T>(first + static_cast<T>(i) * step);
      return Outputs{out};
    }
  });
}

Expected<Outputs> constant(const OpContext &ctx) {
  if (const auto *value = ctx.attr("value")) {
    Expected<Tensor> t = fromTensorProto(value->t());
    if (!t)
      return ctx.unsupported(toString(t.takeError()));
    return Outputs{*t};
  }
  if (const auto *value = ctx.attr("value_float"))
    return Outputs{Tensor::scalar(value->f())};
  if (const auto *value = ctx.attr("value_int"))
    return Outputs{Tensor::scalar<int64_t>(value->i())};
  if (const auto *value = ctx.attr("value_floats")) {
    std::vector<float> v(value->floats().begin(), value->floats().end());
    return Outputs{Tensor::fromValues<float>({static_cast<int64_t>(v.size())}, v)};
  }
  if (const auto *value = ctx.attr("value_ints")) {
    Shape v(value->ints().begin(), value->ints().end());
    return Outputs{Tensor::fromValues<int64_t>({static_cast<int64_t>(v.size())}, v)};
  }
  return ctx.unsupported("a Constant without value, value_float(s) or value_int(s)");
}

Expected<Outputs> identity(const OpContext &ctx) { return Outputs{ctx.input(0)}; }

/// Dropout outside training is the identity with an all-true mask. Training
/// with a positive ratio draws random numbers, which these kernels do not.
Expected<Outputs> dropout(const OpContext &ctx) {
  const Tensor &x = ctx.input(0);
  bool training = false;
  double ratio = ctx.attrFloat("ratio", 0.5f);
  if (ctx.opset >= 12) {
    const Tensor *r = ctx.optInput(1), *t = ctx.optInput(2);
    if ((r && r->numElements() != 1) || (t && t->numElements() != 1))
      return ctx.fail("ratio and training_mode must be scalars");
    if (r)
      ratio = r->getDouble(0);
    training = t && t->getDouble(0) != 0;
  }
  if (training && ratio != 0)
    return ctx.unsupported("training-mode Dropout with ratio > 0 (random masks)");
  Outputs outputs{x};
  if (ctx.wantsOutput(1)) {
    // Opsets 7 to 9 type the mask like the input.
    Tensor mask(ctx.opset >= 10 ? ElemType::Bool : x.elemType(), x.shape());
    for (int64_t i = 0; i < mask.numElements(); ++i)
      mask.setDouble(i, 1);
    outputs.push_back(mask);
  }
  return outputs;
}

//===----------------------------------------------------------------------===//
// Convolution and pooling
//===----------------------------------------------------------------------===//

/// Sliding-window geometry of Conv and the pools, padded to three spatial
/// dimensions: a 1-D or 2-D op gets leading dimensions of size 1.
struct Window {
  static constexpr int MaxRank = 3;
  int64_t rank = 0; ///< The op's own spatial rank.
  std::array<int64_t, MaxRank> in, kernel, stride, dilation, padBegin, padEnd, out;
  int64_t outSize() const { return out[0] * out[1] * out[2]; }
  int64_t inSize() const { return in[0] * in[1] * in[2]; }
  int64_t kernelSize() const { return kernel[0] * kernel[1] * kernel[2]; }
};

/// Reads strides, dilations, pads and auto_pad for a window of \p kernel
/// over \p spatial, and computes the output size (ceil_mode for pools).
Expected<Window> windowGeometry(const OpContext &ctx, ArrayRef<int64_t> spatial,
                                ArrayRef<int64_t> kernel, bool ceilMode) {
  int64_t rank = static_cast<int64_t>(spatial.size());
  if (rank < 1 || rank > Window::MaxRank)
    return ctx.unsupported(formatv("{0} spatial dimensions (1 to 3 are supported)", rank));
  if (static_cast<int64_t>(kernel.size()) != rank)
    return ctx.fail("kernel_shape " + shapeString(kernel) + " does not match the input's " +
                    Twine(rank) + " spatial dimensions");
  Shape strides = ctx.attrInts("strides").value_or(Shape(rank, 1));
  Shape dilations = ctx.attrInts("dilations").value_or(Shape(rank, 1));
  Shape pads = ctx.attrInts("pads").value_or(Shape(2 * rank, 0));
  if (static_cast<int64_t>(strides.size()) != rank ||
      static_cast<int64_t>(dilations.size()) != rank ||
      static_cast<int64_t>(pads.size()) != 2 * rank)
    return ctx.fail("strides, dilations or pads do not match the spatial rank");
  std::string autoPad = ctx.attrString("auto_pad", "NOTSET");
  if (autoPad != "NOTSET" && autoPad != "VALID" && autoPad != "SAME_UPPER" &&
      autoPad != "SAME_LOWER")
    return ctx.fail("unknown auto_pad '" + autoPad + "'");

  Window w;
  w.rank = rank;
  int64_t lead = Window::MaxRank - rank;
  for (int64_t i = 0; i < Window::MaxRank; ++i) {
    w.in[i] = w.kernel[i] = w.stride[i] = w.dilation[i] = w.out[i] = 1;
    w.padBegin[i] = w.padEnd[i] = 0;
  }
  for (int64_t i = 0; i < rank; ++i) {
    int64_t d = lead + i, in = spatial[i], k = kernel[i], s = strides[i], dil = dilations[i];
    if (k < 1 || s < 1 || dil < 1 || pads[i] < 0 || pads[rank + i] < 0)
      return ctx.fail("kernel, strides and dilations must be positive and pads non-negative");
    int64_t effective = (k - 1) * dil + 1;
    int64_t begin = pads[i], end = pads[rank + i], out;
    if (autoPad == "SAME_UPPER" || autoPad == "SAME_LOWER") {
      out = (in + s - 1) / s;
      int64_t total = std::max<int64_t>(0, (out - 1) * s + effective - in);
      begin = autoPad == "SAME_UPPER" ? total / 2 : total - total / 2;
      end = total - begin;
    } else {
      if (autoPad == "VALID")
        begin = end = 0;
      int64_t span = in + begin + end - effective;
      if (span < 0)
        return ctx.fail(formatv("kernel extent {0} exceeds padded input size {1}", effective,
                                in + begin + end));
      out = (ceilMode ? (span + s - 1) / s : span / s) + 1;
      // A window that would start in the end padding is dropped.
      if (ceilMode && (out - 1) * s >= in + begin)
        --out;
    }
    w.in[d] = in;
    w.kernel[d] = k;
    w.stride[d] = s;
    w.dilation[d] = dil;
    w.padBegin[d] = begin;
    w.padEnd[d] = end;
    w.out[d] = out;
  }
  return w;
}

/// Unfolds one image's channels [channels, in...] into columns
/// [channels * kernel, out...] so that convolution becomes one GEMM.
template <typename T> void im2col(const T *image, int64_t channels, const Window &w, T *columns) {
  int64_t outSize = w.outSize();
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t kd = 0; kd < w.kernel[0]; ++kd)
      for (int64_t kh = 0; kh < w.kernel[1]; ++kh)
        for (int64_t kw = 0; kw < w.kernel[2]; ++kw) {
          T *row =
              columns + (((c * w.kernel[0] + kd) * w.kernel[1] + kh) * w.kernel[2] + kw) * outSize;
          for (int64_t od = 0; od < w.out[0]; ++od) {
            int64_t id = od * w.stride[0] - w.padBegin[0] + kd * w.dilation[0];
            for (int64_t oh = 0; oh < w.out[1]; ++oh) {
              int64_t ih = oh * w.stride[1] - w.padBegin[1] + kh * w.dilation[1];
              T *dst = row + (od * w.out[1] + oh) * w.out[2];
              if (id < 0 || id >= w.in[0] || ih < 0 || ih >= w.in[1]) {
                std::fill(dst, dst + w.out[2], T(0));
                continue;
              }
              const T *src = image + ((c * w.in[0] + id) * w.in[1] + ih) * w.in[2];
              for (int64_t ow = 0; ow < w.out[2]; ++ow) {
                int64_t iw = ow * w.stride[2] - w.padBegin[2] + kw * w.dilation[2];
                dst[ow] = iw >= 0 && iw < w.in[2] ? src[iw] : T(0);
              }
            }
          }
        }
}

/// Conv (1-D to 3-D, groups): im2col per image and group, then a GEMM.
Expected<Outputs> conv(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &weight = ctx.input(1);
  const Tensor *bias = ctx.optInput(2);
  if (Error e = ctx.sameType(0, 1))
    return e;
  if (bias && bias->elemType() != x.elemType())
    return ctx.fail("B must have X's element type");
  if (x.rank() < 3 || weight.rank() != x.rank())
    return ctx.fail("X and W must have the same rank >= 3, got " + x.describe() + " and " +
                    weight.describe());
  int64_t group = ctx.attrInt("group", 1);
  int64_t batch = x.dim(0), channels = x.dim(1), maps = weight.dim(0);
  if (group < 1 || channels % group != 0 || maps % group != 0 || weight.dim(1) != channels / group)
    return ctx.fail(
        formatv("W {0} does not fit X {1} with group {2}", weight.describe(), x.describe(), group));
  if (bias && (bias->rank() != 1 || bias->dim(0) != maps))
    return ctx.fail("B must have shape [" + Twine(maps) + "], got " + bias->describe());
  ArrayRef<int64_t> kernel = ArrayRef<int64_t>(weight.shape()).drop_front(2);
  if (std::optional<Shape> given = ctx.attrInts("kernel_shape");
      given && ArrayRef<int64_t>(*given) != kernel)
    return ctx.fail("kernel_shape " + shapeString(*given) + " differs from W " + weight.describe());
  Expected<Window> w =
      windowGeometry(ctx, ArrayRef<int64_t>(x.shape()).drop_front(2), kernel, false);
  if (!w)
    return w.takeError();
  Shape outShape{batch, maps};
  for (int64_t i = 0; i < w->rank; ++i)
    outShape.push_back(w->out[Window::MaxRank - w->rank + i]);

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(x.elemType(), outShape);
      int64_t groupChannels = channels / group, groupMaps = maps / group;
      int64_t rows = groupChannels * w->kernelSize(), cols = w->outSize();
      // A 1x1 kernel over the unpadded input reads the image as the columns.
      bool pointwise = w->kernelSize() == 1 && w->padBegin == std::array<int64_t, 3>{0, 0, 0} &&
                       w->padEnd == std::array<int64_t, 3>{0, 0, 0} &&
                       w->stride == std::array<int64_t, 3>{1, 1, 1};
      std::vector<T> columns(pointwise ? 0 : rows * cols);
      for (int64_t n = 0; n < batch; ++n)
        for (int64_t g = 0; g < group; ++g) {
          const T *image = x.data<T>() + (n * channels + g * groupChannels) * w->inSize();
          const T *cols2 = image;
          if (!pointwise) {
            im2col(image, groupChannels, *w, columns.data());
            cols2 = columns.data();
          }
          T *out = y.data<T>() + (n * maps + g * groupMaps) * cols;
          gemmAny<T>(false, false, groupMaps, cols, rows, T(1),
                     weight.data<T>() + g * groupMaps * rows, rows, cols2, cols, T(0), out, cols);
          if (bias)
            for (int64_t m = 0; m < groupMaps; ++m)
              for (int64_t p = 0; p < cols; ++p)
                out[m * cols + p] += bias->data<T>()[g * groupMaps + m];
        }
      return Outputs{y};
    }
  });
}

/// MaxPool (with optional Indices output) and AveragePool over 1-D to 3-D.
Expected<Outputs> pool(const OpContext &ctx, bool isMax) {
  const Tensor &x = ctx.input(0);
  if (x.rank() < 3)
    return ctx.fail("X must have rank >= 3, got " + x.describe());
  std::optional<Shape> kernel = ctx.attrInts("kernel_shape");
  if (!kernel)
    return ctx.fail("missing attribute 'kernel_shape'");
  Expected<Window> geometry = windowGeometry(ctx, ArrayRef<int64_t>(x.shape()).drop_front(2),
                                             *kernel, ctx.attrInt("ceil_mode", 0));
  if (!geometry)
    return geometry.takeError();
  const Window &w = *geometry;
  bool includePad = ctx.attrInt("count_include_pad", 0);
  bool columnMajor = ctx.attrInt("storage_order", 0);
  int64_t planes = x.dim(0) * x.dim(1);
  Shape outShape{x.dim(0), x.dim(1)};
  for (int64_t i = 0; i < w.rank; ++i)
    outShape.push_back(w.out[Window::MaxRank - w.rank + i]);

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      if (!isMax && !IsFloat<T>)
        return ctx.unsupportedType(x, 0);
      Tensor y(x.elemType(), outShape), indices(ElemType::Int64, outShape);
      T *out = y.data<T>();
      int64_t *outIndex = indices.data<int64_t>();
      for (int64_t plane = 0; plane < planes; ++plane) {
        const T *in = x.data<T>() + plane * w.inSize();
        int64_t o = plane * w.outSize();
        for (int64_t od = 0; od < w.out[0]; ++od)
          for (int64_t oh = 0; oh < w.out[1]; ++oh)
            for (int64_t ow = 0; ow < w.out[2]; ++ow, ++o) {
              std::array<int64_t, 3> origin{od * w.stride[0] - w.padBegin[0],
                                            oh * w.stride[1] - w.padBegin[1],
                                            ow * w.stride[2] - w.padBegin[2]};
              T best = std::numeric_limits<T>::lowest();
              if constexpr (IsFloat<T>)
                best = -std::numeric_limits<T>::infinity();
              int64_t bestIndex = -1, padded = 0, valid = 0;
              double sum = 0;
              for (int64_t kd = 0; kd < w.kernel[0]; ++kd)
                for (int64_t kh = 0; kh < w.kernel[1]; ++kh)
                  for (int64_t kw = 0; kw < w.kernel[2]; ++kw) {
                    std::array<int64_t, 3> at{origin[0] + kd * w.dilation[0],
                                              origin[1] + kh * w.dilation[1],
                                              origin[2] + kw * w.dilation[2]};
                    bool inPadded = true, inInput = true;
                    for (int d = 0; d < 3; ++d) {
                      inPadded &= at[d] >= -w.padBegin[d] && at[d] < w.in[d] + w.padEnd[d];
                      inInput &= at[d] >= 0 && at[d] < w.in[d];
                    }
                    padded += inPadded;
                    if (!inInput)
                      continue;
                    ++valid;
                    int64_t offset = (at[0] * w.in[1] + at[1]) * w.in[2] + at[2];
                    T v = in[offset];
                    sum += v;
                    if (bestIndex < 0 || v > best) {
                      best = v;
                      bestIndex =
                          columnMajor ? at[0] + (at[1] + at[2] * w.in[1]) * w.in[0] : offset;
                    }
                  }
              if (isMax) {
                out[o] = best;
                outIndex[o] = bestIndex < 0 ? -1 : plane * w.inSize() + bestIndex;
              } else {
                int64_t count = includePad ? padded : valid;
                out[o] = static_cast<T>(count ? sum / count : 0.0);
              }
            }
      }
      if (isMax && ctx.wantsOutput(1))
        return Outputs{y, indices};
      return Outputs{y};
    }
  });
}

/// GlobalAveragePool and GlobalMaxPool: one value per (batch, channel).
Expected<Outputs> globalPool(const OpContext &ctx, bool isMax) {
  const Tensor &x = ctx.input(0);
  if (x.rank() < 2)
    return ctx.fail("X must have rank >= 2, got " + x.describe());
  Shape outShape = x.shape();
  std::fill(outShape.begin() + 2, outShape.end(), 1);
  int64_t planes = x.dim(0) * x.dim(1);
  int64_t size = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      Tensor y(x.elemType(), outShape);
      for (int64_t p = 0; p < planes; ++p) {
        const T *in = x.data<T>() + p * size;
        double acc = isMax ? -std::numeric_limits<double>::infinity() : 0;
        for (int64_t i = 0; i < size; ++i)
          acc = isMax ? std::max(acc, double(in[i])) : acc + in[i];
        y.data<T>()[p] = static_cast<T>(isMax ? acc : acc / size);
      }
      return Outputs{y};
    }
  });
}

//===----------------------------------------------------------------------===//
// Reductions
//===----------------------------------------------------------------------===//

enum class ReduceKind { Sum, Mean, Max, Min, Prod, L1, L2, LogSum, LogSumExp, SumSquare };

/// The Reduce* family. Axes come from input 1 (ReduceSum from opset 13) or
/// the axes attribute; no axes means all, unless noop_with_empty_axes.
Expected<Outputs> reduce(const OpContext &ctx, ReduceKind kind) {
  const Tensor &x = ctx.input(0);
  std::optional<Shape> axes = ctx.intsFromInputOrAttr(1, "axes");
  bool keepDims = ctx.attrInt("keepdims", 1);
  if (!axes || axes->empty()) {
    if (ctx.attrInt("noop_with_empty_axes", 0))
      return Outputs{x};
    axes.emplace(x.rank());
    std::iota(axes->begin(), axes->end(), 0);
  }
  std::vector<bool> reduced(x.rank(), false);
  for (int64_t a : *axes) {
    Expected<int64_t> axis = ctx.normalizeAxis(a, x.rank());
    if (!axis)
      return axis.takeError();
    reduced[*axis] = true;
  }
  Shape keptShape = x.shape(), outShape;
  for (int64_t i = 0; i < x.rank(); ++i) {
    if (reduced[i])
      keptShape[i] = 1;
    if (!reduced[i] || keepDims)
      outShape.push_back(keptShape[i]);
  }
  Shape accStrides = broadcastStrides(keptShape, x.shape());
  int64_t outCount = product(keptShape);
  int64_t perOutput = outCount ? x.numElements() / outCount : 0;

  return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (IsBool<T>) {
      return ctx.unsupportedType(x, 0);
    } else {
      // Floats accumulate in double, integers in 64-bit integers.
      using Acc = std::conditional_t<IsFloat<T>, double,
                                     std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>>;
      const T *in = x.data<T>();
      Acc init = 0;
      if (kind == ReduceKind::Prod)
        init = 1;
      else if (kind == ReduceKind::Max)
        init = IsFloat<T> ? -std::numeric_limits<Acc>::infinity()
                          : static_cast<Acc>(std::numeric_limits<T>::lowest());
      else if (kind == ReduceKind::Min)
        init = IsFloat<T> ? std::numeric_limits<Acc>::infinity()
                          : static_cast<Acc>(std::numeric_limits<T>::max());
      std::vector<Acc> acc(outCount, init);
      std::vector<double> shift;
      auto walk = [&](auto &&fn) {
        forEachStrided<1>(x.shape(), {accStrides},
                          [&](int64_t i, const std::array<int64_t, 1> &off) { fn(in[i], off[0]); });
      };
      switch (kind) {
      case ReduceKind::Sum:
      case ReduceKind::Mean:
        walk([&](T v, int64_t o) { acc[o] += v; });
        break;
      case ReduceKind::Max:
        walk([&](T v, int64_t o) { acc[o] = maxOf<Acc>(acc[o], v); });
        break;
      case ReduceKind::Min:
        walk([&](T v, int64_t o) { acc[o] = minOf<Acc>(acc[o], v); });
        break;
      case ReduceKind::Prod:
        walk([&](T v, int64_t o) { acc[o] *= v; });
        break;
      case ReduceKind::L1:
        walk([&](T v, int64_t o) { acc[o] += v < 0 ? Acc(0) - Acc(v) : Acc(v); });
        break;
      case ReduceKind::L2:
      case ReduceKind::SumSquare:
        walk([&](T v, int64_t o) { acc[o] += Acc(v) * Acc(v); });
        break;
      case ReduceKind::LogSum:
        walk([&](T v, int64_t o) { acc[o] += v; });
        break;
      case ReduceKind::LogSumExp: {
        // Subtract each output's maximum before exponentiating.
        shift.assign(outCount, -std::numeric_limits<double>::infinity());
        walk([&](T v, int64_t o) { shift[o] = std::max(shift[o], double(v)); });
        std::vector<double> sums(outCount, 0);
        walk([&](T v, int64_t o) { sums[o] += std::exp(double(v) - shift[o]); });
        for (int64_t o = 0; o < outCount; ++o)
          acc[o] = static_cast<Acc>(std::log(sums[o]) + shift[o]);
        break;
      }
      }
      Tensor out(x.elemType(), outShape);
      T *po = out.data<T>();
      for (int64_t o = 0; o < outCount; ++o) {
        double v = static_cast<double>(acc[o]);
        switch (kind) {
        case ReduceKind::Mean:
          if constexpr (IsFloat<T>)
            v = perOutput ? v / perOutput : std::numeric_limits<double>::quiet_NaN();
          else
            v = perOutput ? static_cast<double>(acc[o] / static_cast<Acc>(perOutput)) : 0;
          break;
        case ReduceKind::L2:
          v = std::sqrt(v);
          break;
        case ReduceKind::LogSum:
          v = std::log(v);
          break;
        default:
          break;
        }
        if constexpr (IsFloat<T>)
          po[o] = static_cast<T>(v);
        else if (kind == ReduceKind::Mean || kind == ReduceKind::L2 || kind == ReduceKind::LogSum)
          po[o] = saturatingCast<T>(v);
        else
          po[o] = static_cast<T>(acc[o]);
      }
      return Outputs{out};
    }
  });
}

/// ArgMax and ArgMin: int64 indices along one axis; ties go to the first
/// index, or the last with select_last_index.
Expected<Outputs> argExtreme(const OpContext &ctx, bool isMax) {
  const Tensor &x = ctx.input(0);
  if (x.rank() == 0)
    return ctx.fail("input must have rank >= 1");
  Expected<int64_t> axis = ctx.normalizeAxis(ctx.attrInt("axis", 0), x.rank());
  if (!axis)
    return axis.takeError();
  bool keepDims = ctx.attrInt("keepdims", 1), last = ctx.attrInt("select_last_index", 0);
  AxisSplit split = splitAt(x.shape(), *axis);
  if (split.size == 0)
    return ctx.fail("cannot take an index along an empty axis");
  Shape outShape = x.shape();
  if (keepDims)
    outShape[*axis] = 1;
  else
    outShape.erase(outShape.begin() + *axis);
  Tensor out(ElemType::Int64, outShape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *in = x.data<T>();
    int64_t *po = out.data<int64_t>();
    for (int64_t o = 0; o < split.outer; ++o)
      for (int64_t i = 0; i < split.inner; ++i) {
        const T *row = in + o * split.size * split.inner + i;
        int64_t best = 0;
        for (int64_t j = 1; j < split.size; ++j) {
          T v = row[j * split.inner], b = row[best * split.inner];
          bool better = isMax ? b < v : v < b;
          if (better || (last && v == b))
            best = j;
        }
        po[o * split.inner + i] = best;
      }
  });
  return Outputs{out};
}

//===----------------------------------------------------------------------===//
// Losses
//===----------------------------------------------------------------------===//

/// Negative log-likelihood of \p labels under \p logProb [N, C, D...], with
/// optional class weights, ignore_index and reduction none, sum or mean (mean
/// divides by the total weight of the labels that are not ignored).
template <typename T>
Expected<Tensor> negativeLogLikelihood(const OpContext &ctx, const Tensor &logProb,
                                       const Tensor &labels, const Tensor *weights) {
  ArrayRef<int64_t> shape = logProb.shape();
  if (shape.size() < 2)
    return ctx.fail("scores must have rank >= 2, got " + logProb.describe());
  Shape labelShape{shape[0]};
  labelShape.insert(labelShape.end(), shape.begin() + 2, shape.end());
  if (labels.shape() != labelShape || !isInteger(labels.elemType()))
    return ctx.fail("labels must be integers of shape " + shapeString(labelShape) + ", got " +
                    labels.describe());
  int64_t batch = shape[0], classes = shape[1], inner = product(shape.drop_front(2));
  if (weights && (weights->elemType() != logProb.elemType() || weights->rank() != 1 ||
                  weights->dim(0) != classes))
    return ctx.fail("weights must be " + elemTypeName(logProb.elemType()) + "[" + Twine(classes) +
                    "], got " + weights->describe());
  std::string reduction = ctx.attrString("reduction", "mean");
  if (reduction != "none" && reduction != "sum" && reduction != "mean")
    return ctx.fail("unknown reduction '" + reduction + "'");
  const auto *ignoreAttr = ctx.attr("ignore_index");
  const T *lp = logProb.data<T>();
  Tensor losses(logProb.elemType(), labelShape);
  double total = 0, weightSum = 0;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t d = 0; d < inner; ++d) {
      int64_t i = n * inner + d, label = labels.getInt64(i);
      if (ignoreAttr && label == ignoreAttr->i())
        continue;
      if (label < 0 || label >= classes)
        return ctx.fail(formatv("label {0} is out of range for {1} classes", label, classes));
      double w = weights ? double(weights->data<T>()[label]) : 1.0;
      double loss = -double(lp[(n * classes + label) * inner + d]) * w;
      losses.data<T>()[i] = static_cast<T>(loss);
      total += loss;
      weightSum += w;
    }
  if (reduction == "none")
    return losses;
  return Tensor::scalar(static_cast<T>(reduction == "sum" ? total : total / weightSum),
                        logProb.elemType());
}

/// SoftmaxCrossEntropyLoss: log-softmax over the class dimension, then
/// negative log-likelihood. Outputs the loss and, if asked, the log-probs.
Expected<Outputs> softmaxCrossEntropy(const OpContext &ctx) {
  const Tensor &scores = ctx.input(0);
  if (scores.rank() < 2)
    return ctx.fail("scores must have rank >= 2, got " + scores.describe());
  return visitStorage(scores.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(scores, 0);
    } else {
      Tensor logProb(scores.elemType(), scores.shape());
      softmaxAlong(scores.data<T>(), logProb.data<T>(), splitAt(scores.shape(), 1), true);
      // A half-precision log_prob output is what the loss must be computed from.
      logProb.roundToElemType();
      Expected<Tensor> loss = negativeLogLikelihood<T>(ctx, logProb, ctx.input(1), ctx.optInput(2));
      if (!loss)
        return loss.takeError();
      return Outputs{*loss, logProb};
    }
  });
}

Expected<Outputs> negativeLogLikelihoodLoss(const OpContext &ctx) {
  const Tensor &input = ctx.input(0);
  return visitStorage(input.elemType(), [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if constexpr (!IsFloat<T>) {
      return ctx.unsupportedType(input, 0);
    } else {
      Expected<Tensor> loss = negativeLogLikelihood<T>(ctx, input, ctx.input(1), ctx.optInput(2));
      if (!loss)
        return loss.takeError();
      return Outputs{*loss};
    }
  });
}

//===----------------------------------------------------------------------===//
// Registry
//===----------------------------------------------------------------------===//

using KernelFn = Expected<Outputs> (*)(const OpContext &);

/// One op: how many inputs it takes (maxInputs -1: variadic, all required)
/// and its kernel.
struct KernelInfo {
  StringLiteral op;
  int minInputs;
  int maxInputs;
  KernelFn run;
};

template <typename T> T absolute(T x) {
  if constexpr (std::is_unsigned_v<T>)
    return x;
  else
    return x < 0 ? static_cast<T>(-x) : x;
}

// clang-format off
const KernelInfo kernels[] = {
    {"Abs", 1, 1, [](const OpContext &c) { return numericUnary(c, [](auto x) { return absolute(x); }); }},
    {"Acos", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::acos(x); }); }},
    {"Acosh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::acosh(x); }); }},
    {"Add", 2, 2, [](const OpContext &c) { return arithmetic(c, [](auto x, auto y) { return x + y; }); }},
    {"And", 2, 2, [](const OpContext &c) { return logical(c, [](bool x, bool y) { return x && y; }); }},
    {"ArgMax", 1, 1, [](const OpContext &c) { return argExtreme(c, true); }},
    {"ArgMin", 1, 1, [](const OpContext &c) { return argExtreme(c, false); }},
    {"Asin", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::asin(x); }); }},
    {"Asinh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::asinh(x); }); }},
    {"Atan", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::atan(x); }); }},
    {"Atanh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::atanh(x); }); }},
    {"AveragePool", 1, 1, [](const OpContext &c) { return pool(c, false); }},
    {"BatchNormalization", 5, 5, batchNormalization},
    {"Cast", 1, 1, cast},
    {"CastLike", 2, 2, castLike},
    {"Ceil", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::ceil(x); }); }},
    {"Celu", 1, 1, celu},
    {"Clip", 1, 3, clip},
    {"Concat", 1, -1, concat},
    {"Constant", 0, 0, constant},
    {"ConstantOfShape", 1, 1, constantOfShape},
    {"Conv", 2, 3, conv},
    {"Cos", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::cos(x); }); }},
    {"Cosh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::cosh(x); }); }},
    {"Div", 2, 2, [](const OpContext &c) { return arithmetic(c, [](auto x, auto y) { return divide(x, y); }, true); }},
    {"Dropout", 1, 3, dropout},
    {"Elu", 1, 1, elu},
    {"Equal", 2, 2, [](const OpContext &c) { return comparison(c, [](auto x, auto y) { return x == y; }, true); }},
    {"Erf", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::erf(x); }); }},
    {"Exp", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::exp(x); }); }},
    {"Expand", 2, 2, expand},
    {"Flatten", 1, 1, flatten},
    {"Floor", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::floor(x); }); }},
    {"Gather", 2, 2, gather},
    {"Gelu", 1, 1, gelu},
    {"Gemm", 2, 3, gemmOp},
    {"GlobalAveragePool", 1, 1, [](const OpContext &c) { return globalPool(c, false); }},
    {"GlobalMaxPool", 1, 1, [](const OpContext &c) { return globalPool(c, true); }},
    {"Greater", 2, 2, [](const OpContext &c) { return comparison(c, [](auto x, auto y) { return x > y; }); }},
    {"GreaterOrEqual", 2, 2, [](const OpContext &c) { return comparison(c, [](auto x, auto y) { return x >= y; }); }},
    {"HardSigmoid", 1, 1, hardSigmoid},
    {"HardSwish", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return x * std::clamp(x / 6 + 0.5, 0.0, 1.0); }); }},
    {"Identity", 1, 1, identity},
    {"LayerNormalization", 2, 3, layerNormalization},
    {"LeakyRelu", 1, 1, leakyRelu},
    {"Less", 2, 2, [](const OpContext &c) { return comparison(c, [](auto x, auto y) { return x < y; }); }},
    {"LessOrEqual", 2, 2, [](const OpContext &c) { return comparison(c, [](auto x, auto y) { return x <= y; }); }},
    {"Log", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::log(x); }); }},
    {"LogSoftmax", 1, 1, [](const OpContext &c) { return softmax(c, true); }},
    {"MatMul", 2, 2, matMul},
    {"Max", 1, -1, [](const OpContext &c) { return variadic(c, [](auto x, auto y) { return maxOf(x, y); }); }},
    {"MaxPool", 1, 1, [](const OpContext &c) { return pool(c, true); }},
    {"Mean", 1, -1, [](const OpContext &c) { return variadic(c, [](auto x, auto y) { return x + y; }, true); }},
    {"Min", 1, -1, [](const OpContext &c) { return variadic(c, [](auto x, auto y) { return minOf(x, y); }); }},
    {"Mul", 2, 2, [](const OpContext &c) { return arithmetic(c, [](auto x, auto y) { return x * y; }); }},
    {"Neg", 1, 1, [](const OpContext &c) { return numericUnary(c, [](auto x) { return -x; }); }},
    {"NegativeLogLikelihoodLoss", 2, 3, negativeLogLikelihoodLoss},
    {"Not", 1, 1, logicalNot},
    {"Or", 2, 2, [](const OpContext &c) { return logical(c, [](bool x, bool y) { return x || y; }); }},
    {"Pow", 2, 2, pow},
    {"PRelu", 2, 2, prelu},
    {"Range", 3, 3, range},
    {"Reciprocal", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return 1 / x; }); }},
    {"ReduceL1", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::L1); }},
    {"ReduceL2", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::L2); }},
    {"ReduceLogSum", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::LogSum); }},
    {"ReduceLogSumExp", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::LogSumExp); }},
    {"ReduceMax", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::Max); }},
    {"ReduceMean", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::Mean); }},
    {"ReduceMin", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::Min); }},
    {"ReduceProd", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::Prod); }},
    {"ReduceSum", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::Sum); }},
    {"ReduceSumSquare", 1, 2, [](const OpContext &c) { return reduce(c, ReduceKind::SumSquare); }},
    {"Relu", 1, 1, [](const OpContext &c) { return numericUnary(c, [](auto x) { return x < 0 ? decltype(x)(0) : x; }); }},
    {"Reshape", 1, 2, reshape},
    {"Round", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::nearbyint(x); }); }},
    {"Selu", 1, 1, selu},
    {"Shape", 1, 1, shapeOp},
    {"Sigmoid", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return sigmoid(x); }); }},
    {"Sign", 1, 1, [](const OpContext &c) { return numericUnary(c, [](auto x) { return (decltype(x)(0) < x) - (x < decltype(x)(0)); }); }},
    {"Sin", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::sin(x); }); }},
    {"Sinh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::sinh(x); }); }},
    {"Size", 1, 1, size},
    {"Slice", 1, 5, slice},
    {"Softmax", 1, 1, [](const OpContext &c) { return softmax(c, false); }},
    {"SoftmaxCrossEntropyLoss", 2, 3, softmaxCrossEntropy},
    {"Softplus", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return softplus(x); }); }},
    {"Softsign", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return x / (1 + std::abs(x)); }); }},
    {"Split", 1, 2, split},
    {"Sqrt", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::sqrt(x); }); }},
    {"Squeeze", 1, 2, squeeze},
    {"Sub", 2, 2, [](const OpContext &c) { return arithmetic(c, [](auto x, auto y) { return x - y; }); }},
    {"Sum", 1, -1, [](const OpContext &c) { return variadic(c, [](auto x, auto y) { return x + y; }); }},
    {"Tan", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::tan(x); }); }},
    {"Tanh", 1, 1, [](const OpContext &c) { return floatUnary(c, [](auto x) { return std::tanh(x); }); }},
    {"ThresholdedRelu", 1, 1, thresholdedRelu},
    {"Tile", 2, 2, tile},
    {"Transpose", 1, 1, transposeOp},
    {"Unsqueeze", 1, 2, unsqueeze},
    {"Where", 3, 3, where},
    {"Xor", 2, 2, [](const OpContext &c) { return logical(c, [](bool x, bool y) { return x != y; }); }},
};
// clang-format on

const KernelInfo *findKernel(StringRef opType) {
  for (const KernelInfo &k : kernels)
    if (k.op == opType)
      return &k;
  return nullptr;
}

bool isDefaultDomain(StringRef domain) { return domain.empty() || domain == "ai.onnx"; }

} // namespace

bool isSupported(StringRef opType, StringRef domain) {
  return (isDefaultDomain(domain) && findKernel(opType)) || isContribOp(opType, domain);
}

std::vector<std::string> supportedOps() {
  std::vector<std::string> ops;
  for (const KernelInfo &k : kernels)
    ops.push_back(k.op.str());
  for (const auto &[domain, op] : contribOps())
    if (isDefaultDomain(domain))
      ops.push_back(op);
  llvm::sort(ops);
  return ops;
}

namespace {

/// The default-domain kernel of \p ctx's node, after checking its inputs
/// against the kernel's counts.
Expected<Outputs> runDefaultDomainOp(const OpContext &ctx) {
  const onnx::NodeProto &node = ctx.node;
  if (!isDefaultDomain(node.domain()))
    return ctx.unsupported("no CPU kernel for domain '" + node.domain() + "'");
  const KernelInfo *kernel = findKernel(node.op_type());
  if (!kernel)
    return ctx.unsupported("no CPU kernel for op " + node.op_type());
  int required = kernel->maxInputs < 0 ? node.input_size() : kernel->minInputs;
  if (kernel->maxInputs >= 0 && node.input_size() > kernel->maxInputs)
    return ctx.fail(
        formatv("{0} inputs, at most {1} expected", node.input_size(), kernel->maxInputs));
  if (node.input_size() < kernel->minInputs)
    return ctx.fail(
        formatv("{0} inputs, at least {1} expected", node.input_size(), kernel->minInputs));
  for (int i = 0; i < required; ++i)
    if (!ctx.optInput(i))
      return ctx.fail("missing required input " + Twine(i));
  return kernel->run(ctx);
}

} // namespace

Expected<std::vector<Tensor>> runOp(const onnx::NodeProto &node, int64_t opset,
                                    ArrayRef<const Tensor *> inputs) {
  OpContext ctx(node, opset, inputs);
  if (static_cast<int>(inputs.size()) > node.input_size())
    return ctx.fail(
        formatv("{0} input tensors for {1} node inputs", inputs.size(), node.input_size()));
  for (const Tensor *t : inputs)
    if (t && t->isNull())
      return ctx.fail("an input is a null tensor");

  Expected<Outputs> outputs = isContribOp(node.op_type(), node.domain())
                                  ? runContribOp(node, inputs)
                                  : runDefaultDomainOp(ctx);
  if (!outputs)
    return outputs.takeError();
  size_t wanted = ctx.numOutputs();
  for (size_t i = outputs->size(); i < wanted; ++i)
    if (ctx.wantsOutput(i))
      return ctx.unsupported(formatv("output {0} ('{1}')", i, node.output(static_cast<int>(i))));
  outputs->resize(wanted);
  // Half-precision results were computed in float; round them unless they
  // are views of an input (already representable, and not ours to write).
  for (Tensor &out : *outputs) {
    if (out.isNull())
      continue;
    bool shared = llvm::any_of(
        inputs, [&](const Tensor *in) { return in && in->rawData() == out.rawData(); });
    if (!shared)
      out.roundToElemType();
  }
  return std::move(*outputs);
}

void setBlasThreads(int threads) {
  using SetThreads = void (*)(int);
  if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    set(std::max(1, threads));
}

} // namespace pipec::cpu
