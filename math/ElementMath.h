//===- ElementMath.h - The math of every element-wise op, host and device -===//
//
// One struct per element-wise op of ops/Ops.def (PIPEC_ELEMENTWISE rows),
// named as the row's ID: its value, the element types it takes and, for a
// differentiable unary op, its derivative. The CPU kernels, the fused
// kernels (CPU and CUDA), the CUDA single-op kernels and the gradient
// kernel UnaryGrad all compute through these structs, so an op is computed
// one way everywhere and a fused run equals an unfused one bit for bit.
//
// A unary struct:
//   types     which element types it takes (ElemTypes)
//   gradFrom  what its derivative is a function of: the input x, the output
//             y, or nothing (not differentiable, or zero almost everywhere
//             with GradFrom::Zero)
//   value<T>(x, params)        y for one element of type T
//   derivative(a, params)      dy/dx at a (x or y), in double
//   read(reader, params)       its attributes (optional; see WithParams)
// A binary struct has value<T>(a, b) and no derivative: the gradients of
// Add, Mul, Pow, ... are rules of the differentiate pass. A binary struct of
// the Integer or NumericHost types has value<T>(a, b, params), for the
// attributes of BitShift and Mod.
//
// Before:  Ops.def  PIPEC_ELEMENTWISE(Erf, Onnx, "Erf", 9, 1, Pointwise<4>, unary, elementwise)
//          here     struct Erf { value = erf(x); derivative = 2/sqrt(pi) exp(-x^2) }
// After:   Erf runs on the CPU, fused, on the GPU, and differentiates.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MATH_ELEMENTMATH_H
#define PIPEC_MATH_ELEMENTMATH_H

#include "math/HostDevice.h"
#include "ops/ElemOp.h"

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace pipec::kernels {

/// The element types an element-wise op takes, and what it gives.
enum class ElemTypes : uint8_t {
  Float,      ///< float, double, float16, bfloat16; the same type out
  Numeric,    ///< every number type (not bool); the same type out
  Compare,    ///< numbers in, bool out
  CompareAny, ///< numbers or bool in, bool out
  Logical,    ///< bool in, bool out
  Integer,    ///< integers only (not bool); the same type out: the bitwise ops
  FloatTest,  ///< floats in, bool out: IsNaN, IsInf
  /// Every number type, the same type out, by an attribute that binary math
  /// reads (Mod's fmod): the fused and device kernels take no binary
  /// attributes, so only the CPU computes these.
  NumericHost,
};

/// What the derivative of a unary op is a function of.
enum class GradFrom : uint8_t {
  None,   ///< no gradient flows (bool or integer results)
  Zero,   ///< the derivative is 0 wherever it exists (Floor, Sign)
  Input,  ///< derivative(x)
  Output, ///< derivative(y): cheaper, and what backward keeps (Tanh)
};

/// The attribute values of one node that its op's math needs (LeakyRelu's
/// alpha, Gelu's approximation), read once on the host.
struct ElemParams {
  float alpha = 0, beta = 0, gamma = 0;
  int mode = 0;
};

/// Reads a node's attributes for ElemParams (host only).
class ParamReader {
public:
  virtual ~ParamReader() = default;
  virtual int64_t attrInt(const char *name, int64_t otherwise) const = 0;
  virtual float attrFloat(const char *name, float otherwise) const = 0;
  virtual std::string attrString(const char *name, const char *otherwise) const = 0;
};

/// The base of every math struct without attributes. read() returns an
/// error message, or an empty string when the attributes are valid.
struct NoParams {
  static std::string read(const ParamReader &, ElemParams &) { return {}; }
};

namespace elem {

// Unary float ops -----------------------------------------------------------

#define PIPEC_FLOAT_UNARY(ID, FROM, VALUE, DERIVATIVE)                                             \
  struct ID : NoParams {                                                                           \
    static constexpr ElemTypes types = ElemTypes::Float;                                           \
    static constexpr GradFrom gradFrom = GradFrom::FROM;                                           \
    template <typename T> PIPEC_HD static T value(T x, const ElemParams &) { return VALUE; }       \
    PIPEC_HD static double derivative(double a, const ElemParams &) {                              \
      (void)a;                                                                                     \
      return DERIVATIVE;                                                                           \
    }                                                                                              \
  };
PIPEC_FLOAT_UNARY(Acos, Input, math::acos(x), -1.0 / ::sqrt(1.0 - a * a))
PIPEC_FLOAT_UNARY(Acosh, Input, math::acosh(x), 1.0 / ::sqrt(a * a - 1.0))
PIPEC_FLOAT_UNARY(Asin, Input, math::asin(x), 1.0 / ::sqrt(1.0 - a * a))
PIPEC_FLOAT_UNARY(Asinh, Input, math::asinh(x), 1.0 / ::sqrt(a * a + 1.0))
PIPEC_FLOAT_UNARY(Atan, Input, math::atan(x), 1.0 / (1.0 + a * a))
PIPEC_FLOAT_UNARY(Atanh, Input, math::atanh(x), 1.0 / (1.0 - a * a))
PIPEC_FLOAT_UNARY(Ceil, Zero, math::ceil(x), 0.0)
PIPEC_FLOAT_UNARY(Cos, Input, math::cos(x), -::sin(a))
PIPEC_FLOAT_UNARY(Cosh, Input, math::cosh(x), ::sinh(a))
PIPEC_FLOAT_UNARY(Erf, Input, math::erf(x), 1.12837916709551257390 * ::exp(-a * a))
PIPEC_FLOAT_UNARY(Exp, Output, math::exp(x), a)
PIPEC_FLOAT_UNARY(Floor, Zero, math::floor(x), 0.0)
PIPEC_FLOAT_UNARY(Log, Input, math::log(x), 1.0 / a)
PIPEC_FLOAT_UNARY(Reciprocal, Output, T(1) / x, -a *a)
PIPEC_FLOAT_UNARY(Round, Zero, math::nearbyint(x), 0.0)
PIPEC_FLOAT_UNARY(Sin, Input, math::sin(x), ::cos(a))
PIPEC_FLOAT_UNARY(Sinh, Input, math::sinh(x), ::cosh(a))
PIPEC_FLOAT_UNARY(Softsign, Input, x / (1 + (x < 0 ? -x : x)),
                  1.0 / ((1.0 + ::fabs(a)) * (1.0 + ::fabs(a))))
PIPEC_FLOAT_UNARY(Sqrt, Output, math::sqrt(x), 0.5 / a)
PIPEC_FLOAT_UNARY(Tan, Output, math::tan(x), 1.0 + a * a)
PIPEC_FLOAT_UNARY(Tanh, Output, math::tanh(x), 1.0 - a * a)
#undef PIPEC_FLOAT_UNARY

/// Never exponentiates a large positive number.
struct Sigmoid : NoParams {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Output;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    if (x >= 0)
      return T(1) / (T(1) + math::exp(-x));
    T e = math::exp(x);
    return e / (T(1) + e);
  }
  PIPEC_HD static double derivative(double y, const ElemParams &) { return y * (1.0 - y); }
};

struct Softplus : NoParams {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    return x > 0 ? x + math::log1p(math::exp(-x)) : math::log1p(math::exp(x));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) { return Sigmoid::value(x, p); }
};

/// Mish (ONNX 18): x tanh(softplus(x)); the derivative by the product rule.
struct Mish : NoParams {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    return static_cast<T>(x * math::tanh(Softplus::value(x, p)));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    double t = ::tanh(Softplus::value(x, p)), s = Sigmoid::value(x, p);
    return t + x * s * (1 - t * t);
  }
};

struct HardSwish : NoParams {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    double gate = x / 6 + 0.5;
    gate = gate < 0.0 ? 0.0 : (gate > 1.0 ? 1.0 : gate);
    return static_cast<T>(x * gate);
  }
  PIPEC_HD static double derivative(double x, const ElemParams &) {
    return x < -3 ? 0.0 : (x > 3 ? 1.0 : (2 * x + 3) / 6);
  }
};

/// The ops with attributes read them through read(); defaults as ONNX's.
struct LeakyRelu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 0.01f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    return x < 0 ? static_cast<T>(static_cast<double>(p.alpha) * x) : x;
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) { return x > 0 ? 1.0 : p.alpha; }
};

struct Elu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 1.0f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    return x < 0 ? static_cast<T>(p.alpha * ::expm1(static_cast<double>(x))) : x;
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    return x > 0 ? 1.0 : p.alpha * ::exp(x);
  }
};

struct Selu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 1.67326319217681884765625f);
    p.gamma = r.attrFloat("gamma", 1.05070102214813232421875f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    double v = static_cast<double>(x);
    return static_cast<T>(p.gamma * (x <= 0 ? p.alpha * ::expm1(v) : v));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    return p.gamma * (x > 0 ? 1.0 : p.alpha * ::exp(x));
  }
};

struct Celu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 1.0f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    double v = static_cast<double>(x), alpha = p.alpha;
    double negative = alpha * ::expm1(x / alpha);
    return static_cast<T>((v > 0 ? v : 0.0) + (negative < 0 ? negative : 0.0));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    return x > 0 ? 1.0 : ::exp(x / p.alpha);
  }
};

struct ThresholdedRelu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 1.0f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    return static_cast<double>(x) > static_cast<double>(p.alpha) ? x : T(0);
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    return x > static_cast<double>(p.alpha) ? 1.0 : 0.0;
  }
};

struct HardSigmoid {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 0.2f);
    p.beta = r.attrFloat("beta", 0.5f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    double v = static_cast<double>(p.alpha) * x + static_cast<double>(p.beta);
    return static_cast<T>(v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    double v = static_cast<double>(p.alpha) * x + static_cast<double>(p.beta);
    return v > 0.0 && v < 1.0 ? static_cast<double>(p.alpha) : 0.0;
  }
};

/// GELU, exact (mode 0, erf) or tanh-approximated (mode 1), in double.
struct Gelu {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    std::string approximate = r.attrString("approximate", "none");
    if (approximate != "none" && approximate != "tanh")
      return "approximate must be 'none' or 'tanh', not '" + approximate + "'";
    p.mode = approximate == "tanh" ? 1 : 0;
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    double v = static_cast<double>(x);
    if (p.mode == 1)
      return static_cast<T>(0.5 * v * (1 + ::tanh(::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
    return static_cast<T>(0.5 * v * (1 + ::erf(v * M_SQRT1_2)));
  }
  PIPEC_HD static double derivative(double a, const ElemParams &p) {
    if (p.mode == 1) {
      const double c = 0.79788456080286535588, k = 0.044715;
      double t = ::tanh(c * (a + k * a * a * a));
      return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * k * a * a);
    }
    return 0.5 * (1 + ::erf(a * 0.70710678118654752440)) +
           a * ::exp(-0.5 * a * a) * 0.39894228040143267794;
  }
};

/// Swish (ONNX 24): x sigmoid(alpha x), in the element's type as ONNX's
/// reference computes it.
struct Swish {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("alpha", 1.0f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    return static_cast<T>(x * Sigmoid::value(static_cast<T>(static_cast<T>(p.alpha) * x), p));
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    double s = Sigmoid::value(p.alpha * x, p);
    return s + p.alpha * x * s * (1 - s);
  }
};

// Unary ops on every number type ----------------------------------------------

namespace detail {
/// \p v as a T: floats round; integers truncate and saturate, NaN to 0 (as
/// the CPU's Cast).
template <typename T> PIPEC_HD T fromDouble(double v) {
  if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(v);
  } else {
    if (v != v)
      return T(0);
    if (v <= static_cast<double>(std::numeric_limits<T>::lowest()))
      return std::numeric_limits<T>::lowest();
    if (v >= static_cast<double>(std::numeric_limits<T>::max()))
      return std::numeric_limits<T>::max();
    return static_cast<T>(v);
  }
}
} // namespace detail

/// Shrink (ONNX 9): x + bias below -lambd, x - bias above lambd, else 0; the
/// sum in double, stored in the element's type.
struct Shrink {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.alpha = r.attrFloat("lambd", 0.5f);
    p.beta = r.attrFloat("bias", 0.0f);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &p) {
    double v = static_cast<double>(x), lambd = p.alpha, bias = p.beta;
    if (v < -lambd)
      return detail::fromDouble<T>(v + bias);
    if (v > lambd)
      return detail::fromDouble<T>(v - bias);
    return T(0);
  }
  PIPEC_HD static double derivative(double x, const ElemParams &p) {
    return x < -static_cast<double>(p.alpha) || x > static_cast<double>(p.alpha) ? 1.0 : 0.0;
  }
};

struct Abs : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    if constexpr (std::is_unsigned_v<T>)
      return x;
    else
      return x < 0 ? static_cast<T>(-x) : x;
  }
  PIPEC_HD static double derivative(double x, const ElemParams &) { return (0.0 < x) - (x < 0.0); }
};

struct Neg : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    return static_cast<T>(-x);
  }
  PIPEC_HD static double derivative(double, const ElemParams &) { return -1.0; }
};

/// Keeps NaN (x < 0 is false for it).
struct Relu : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr GradFrom gradFrom = GradFrom::Input;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    return x < 0 ? T(0) : x;
  }
  PIPEC_HD static double derivative(double x, const ElemParams &) { return x > 0 ? 1.0 : 0.0; }
};

struct Sign : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr GradFrom gradFrom = GradFrom::Zero;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    return static_cast<T>((T(0) < x) - (x < T(0)));
  }
  PIPEC_HD static double derivative(double, const ElemParams &) { return 0.0; }
};

struct Not : NoParams {
  static constexpr ElemTypes types = ElemTypes::Logical;
  static constexpr GradFrom gradFrom = GradFrom::None;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) { return !x; }
  PIPEC_HD static double derivative(double, const ElemParams &) { return 0.0; }
};

// Unary integer ops and float tests ---------------------------------------------

struct BitwiseNot : NoParams {
  static constexpr ElemTypes types = ElemTypes::Integer;
  static constexpr GradFrom gradFrom = GradFrom::None;
  template <typename T> PIPEC_HD static T value(T x, const ElemParams &) {
    return static_cast<T>(~x);
  }
  PIPEC_HD static double derivative(double, const ElemParams &) { return 0.0; }
};

struct IsNaN : NoParams {
  static constexpr ElemTypes types = ElemTypes::FloatTest;
  static constexpr GradFrom gradFrom = GradFrom::None;
  template <typename T> PIPEC_HD static bool value(T x, const ElemParams &) { return x != x; }
  PIPEC_HD static double derivative(double, const ElemParams &) { return 0.0; }
};

/// IsInf: mode bit 0 detects +inf (detect_positive), bit 1 -inf
/// (detect_negative).
struct IsInf {
  static constexpr ElemTypes types = ElemTypes::FloatTest;
  static constexpr GradFrom gradFrom = GradFrom::None;
  static std::string read(const ParamReader &r, ElemParams &p) {
    p.mode = (r.attrInt("detect_positive", 1) != 0 ? 1 : 0) |
             (r.attrInt("detect_negative", 1) != 0 ? 2 : 0);
    return {};
  }
  template <typename T> PIPEC_HD static bool value(T x, const ElemParams &p) {
    if (x == std::numeric_limits<T>::infinity())
      return (p.mode & 1) != 0;
    if (x == -std::numeric_limits<T>::infinity())
      return (p.mode & 2) != 0;
    return false;
  }
  PIPEC_HD static double derivative(double, const ElemParams &) { return 0.0; }
};

// Binary ops -------------------------------------------------------------------

/// x / y without the trap of INT_MIN / -1, which wraps as in two's
/// complement. Integer division by zero is refused before any element is
/// divided (divides = true).
struct Div : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr bool divides = true;
  template <typename T> PIPEC_HD static T value(T x, T y) {
    if constexpr (std::is_signed_v<T> && !std::is_floating_point_v<T>)
      if (y == T(-1))
        return static_cast<T>(std::make_unsigned_t<T>(0) - static_cast<std::make_unsigned_t<T>>(x));
    return static_cast<T>(x / y);
  }
};

#define PIPEC_BINARY(ID, TYPES, VALUE)                                                             \
  struct ID : NoParams {                                                                           \
    static constexpr ElemTypes types = ElemTypes::TYPES;                                           \
    static constexpr bool divides = false;                                                         \
    template <typename T> PIPEC_HD static auto value(T a, T b) { return VALUE; }                   \
  };
PIPEC_BINARY(Add, Numeric, static_cast<T>(a + b))
PIPEC_BINARY(Sub, Numeric, static_cast<T>(a - b))
PIPEC_BINARY(Mul, Numeric, static_cast<T>(a *b))
PIPEC_BINARY(Equal, CompareAny, a == b)
PIPEC_BINARY(Less, Compare, a < b)
PIPEC_BINARY(Greater, Compare, b < a)
PIPEC_BINARY(LessOrEqual, Compare, a <= b)
PIPEC_BINARY(GreaterOrEqual, Compare, a >= b)
PIPEC_BINARY(And, Logical, a &&b)
PIPEC_BINARY(Or, Logical, a || b)
PIPEC_BINARY(Xor, Logical, a != b)
#undef PIPEC_BINARY

/// Max and Min propagate NaN, as numpy's maximum and minimum do.
struct Max : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr bool divides = false;
  template <typename T> PIPEC_HD static T value(T a, T b) {
    if constexpr (std::is_floating_point_v<T>)
      if (math::isNan(a) || math::isNan(b))
        return std::numeric_limits<T>::quiet_NaN();
    return a < b ? b : a;
  }
};
struct Min : NoParams {
  static constexpr ElemTypes types = ElemTypes::Numeric;
  static constexpr bool divides = false;
  template <typename T> PIPEC_HD static T value(T a, T b) {
    if constexpr (std::is_floating_point_v<T>)
      if (math::isNan(a) || math::isNan(b))
        return std::numeric_limits<T>::quiet_NaN();
    return b < a ? b : a;
  }
};

/// Pow of one float type. Squares and cubes (GELU's tanh form) are
/// products, without libm. (The CPU kernel also takes integers and an
/// exponent of another type.)
struct Pow : NoParams {
  static constexpr ElemTypes types = ElemTypes::Float;
  static constexpr bool divides = false;
  template <typename T> PIPEC_HD static T value(T a, T b) {
    if (b == T(2))
      return static_cast<T>(a * a);
    if (b == T(3))
      return static_cast<T>(a * a * a);
    return math::pow(a, b);
  }
};

// Binary integer ops and Mod ----------------------------------------------------

#define PIPEC_INTEGER_BINARY(ID, VALUE)                                                            \
  struct ID : NoParams {                                                                           \
    static constexpr ElemTypes types = ElemTypes::Integer;                                         \
    static constexpr bool divides = false;                                                         \
    template <typename T> PIPEC_HD static T value(T a, T b, const ElemParams &) {                  \
      return static_cast<T>(VALUE);                                                                \
    }                                                                                              \
  };
PIPEC_INTEGER_BINARY(BitwiseAnd, a &b)
PIPEC_INTEGER_BINARY(BitwiseOr, a | b)
PIPEC_INTEGER_BINARY(BitwiseXor, a ^ b)
#undef PIPEC_INTEGER_BINARY

/// BitShift: mode 0 shifts left, 1 right (arithmetic for signed types, as
/// opset 28 defines them). A shift by a negative amount or by the width or
/// more gives what the sign fill alone gives: -1 for a negative a shifted
/// right, else 0.
struct BitShift {
  static constexpr ElemTypes types = ElemTypes::Integer;
  static constexpr bool divides = false;
  static std::string read(const ParamReader &r, ElemParams &p) {
    std::string direction = r.attrString("direction", "");
    if (direction != "LEFT" && direction != "RIGHT")
      return "direction must be 'LEFT' or 'RIGHT', not '" + direction + "'";
    p.mode = direction == "RIGHT" ? 1 : 0;
    return {};
  }
  template <typename T> PIPEC_HD static T value(T a, T b, const ElemParams &p) {
    using U = std::make_unsigned_t<T>;
    constexpr int bits = 8 * sizeof(T);
    bool right = p.mode == 1;
    bool outOfRange = static_cast<U>(b) >= static_cast<U>(bits);
    if constexpr (std::is_signed_v<T>) {
      outOfRange = b < 0 || b >= T(bits);
      if (outOfRange)
        return right && a < 0 ? T(-1) : T(0);
    }
    if (outOfRange)
      return T(0);
    if (right)
      return static_cast<T>(a >> b);
    return static_cast<T>(static_cast<U>(static_cast<U>(a) << b));
  }
};

/// Mod: mode 0 (fmod = 0) takes the divisor's sign, a - floor(a / b) * b;
/// mode 1 truncates as C's fmod and %. Floats by fmod, then moved into the
/// divisor's sign: a zero remainder is a zero of b's sign, and a NaN or
/// infinite operand gives what ONNX (opset 28) and numpy give. Integer
/// division by zero is refused before any element is computed (divides).
struct Mod {
  static constexpr ElemTypes types = ElemTypes::NumericHost;
  static constexpr bool divides = true;
  static std::string read(const ParamReader &r, ElemParams &p) {
    int64_t fmod = r.attrInt("fmod", 0);
    if (fmod != 0 && fmod != 1)
      return "fmod must be 0 or 1, not " + std::to_string(fmod);
    p.mode = static_cast<int>(fmod);
    return {};
  }
  template <typename T> PIPEC_HD static T value(T a, T b, const ElemParams &p) {
    if constexpr (std::is_floating_point_v<T>) {
      T r = math::fmod(a, b);
      if (p.mode == 1)
        return r;
      if (r != T(0))
        return (r < T(0)) != (b < T(0)) ? static_cast<T>(r + b) : r;
      return b < T(0) ? -T(0) : T(0);
    } else {
      if (b == T(0))
        return T(0);
      if constexpr (std::is_signed_v<T>)
        if (b == T(-1))
          return T(0); // INT_MIN % -1 would trap
      T r = static_cast<T>(a % b);
      if (p.mode == 0 && r != T(0) && ((r < T(0)) != (b < T(0))))
        r = static_cast<T>(r + b);
      return r;
    }
  }
};

} // namespace elem

//===----------------------------------------------------------------------===//
// By op code: the fused and device kernels
//===----------------------------------------------------------------------===//

namespace detail {
// Templates, so that the branches an op does not have are discarded.
template <typename M, int Arity> PIPEC_HD float value(float a, float b, const ElemParams &p) {
  if constexpr (M::types != ElemTypes::Float && M::types != ElemTypes::Numeric)
    return a;
  else if constexpr (Arity == 1)
    return M::value(a, p);
  else
    return M::value(a, b);
}
template <typename M, int Arity> PIPEC_HD double derivative(double a, const ElemParams &p) {
  if constexpr (Arity == 1)
    return M::derivative(a, p);
  else
    return 0;
}
template <typename M, int Arity> constexpr GradFrom gradFrom() {
  if constexpr (Arity == 1)
    return M::gradFrom;
  else
    return GradFrom::None;
}
} // namespace detail

/// Element types of \p op.
constexpr ElemTypes elemTypes(ElemOp op) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return elem::ID::types;
#include "ops/Ops.def"
  }
  return ElemTypes::Float;
}

namespace detail {
template <typename M, int Arity> constexpr bool divides() {
  if constexpr (Arity == 2)
    return M::divides;
  else
    return false;
}
} // namespace detail

/// True for binary ops that divide, whose integer form refuses a zero
/// divisor (the CPU checks it; the device leaves integers to the CPU).
constexpr bool elemDivides(ElemOp op) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return detail::divides<elem::ID, ARITY>();
#include "ops/Ops.def"
  }
  return false;
}

/// True for ops that give a float from floats: the ones a fused program
/// computes.
constexpr bool isFloatMath(ElemOp op) {
  ElemTypes t = elemTypes(op);
  return t == ElemTypes::Float || t == ElemTypes::Numeric;
}

/// \p op (unary: \p b is ignored) on float operands, exactly as its CPU
/// kernel computes a float32 element.
PIPEC_HD float elemValue(ElemOp op, float a, float b, const ElemParams &p) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return detail::value<elem::ID, ARITY>(a, b, p);
#include "ops/Ops.def"
  }
  return a;
}

/// The derivative of unary \p op at \p a (its input or output, as the op's
/// gradFrom says), in double; 0 for ops without one.
PIPEC_HD double elemDerivative(ElemOp op, double a, const ElemParams &p) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return detail::derivative<elem::ID, ARITY>(a, p);
#include "ops/Ops.def"
  }
  return 0;
}

/// What the derivative of unary \p op reads (GradFrom::None for binary ops).
constexpr GradFrom elemGradFrom(ElemOp op) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return detail::gradFrom<elem::ID, ARITY>();
#include "ops/Ops.def"
  }
  return GradFrom::None;
}

/// The gradient of unary \p op for one element: dx = dy * derivative(a),
/// the factor in double and rounded once, as the CPU kernel computes it.
PIPEC_HD float elemGradient(ElemOp op, float dy, float a, const ElemParams &p) {
  return dy * static_cast<float>(elemDerivative(op, static_cast<double>(a), p));
}

/// Reads \p op's attributes; an error message, or empty when they are valid.
inline std::string readElemParams(ElemOp op, const ParamReader &reader, ElemParams &params) {
  switch (op) {
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, ...)                                     \
  case ElemOp::ID:                                                                                 \
    return elem::ID::read(reader, params);
#include "ops/Ops.def"
  }
  return {};
}

} // namespace pipec::kernels

#endif // PIPEC_MATH_ELEMENTMATH_H
