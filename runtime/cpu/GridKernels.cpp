//===- GridKernels.cpp - GridSample and AffineGrid on the CPU -----------------===//
//
// GridSample (16: 2-D, modes bilinear / nearest / bicubic; 20 and 22: any
// number of spatial dimensions, modes linear / nearest / cubic) samples X at
// the normalized positions of a grid, as torch.nn.functional.grid_sample:
// each position is denormalized per axis (align_corners), its padding mode
// applied (zeros, border, reflection), and the value interpolated from the
// product of per-axis taps. Coordinates are computed in the grid's precision
// (float for float, float16 and bfloat16), as ONNX's reference and
// onnxruntime do, so that nearest rounding agrees with them at ties.
// AffineGrid (20) builds the grid that GridSample reads from affine matrices.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "llvm/ADT/StringSwitch.h"
#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <optional>

using namespace llvm;

namespace pipec::cpu {
namespace {

enum class GridMode { Nearest, Linear, Cubic };
enum class Padding { Zeros, Border, Reflection };

/// The spatial rank beyond which the cubic taps (4^rank per output) are
/// refused.
constexpr int64_t maxGridRank = 6;

struct GridSpec {
  GridMode mode = GridMode::Linear;
  Padding padding = Padding::Zeros;
  bool alignCorners = false;
};

Expected<GridSpec> readGridSpec(const OpContext &ctx) {
  GridSpec spec;
  bool renamed = ctx.opset >= 20;
  std::string mode = ctx.attrString("mode", renamed ? "linear" : "bilinear");
  if (mode == "nearest")
    spec.mode = GridMode::Nearest;
  else if (mode == (renamed ? "linear" : "bilinear"))
    spec.mode = GridMode::Linear;
  else if (mode == (renamed ? "cubic" : "bicubic"))
    spec.mode = GridMode::Cubic;
  else
    return ctx.fail(formatv("unknown mode '{0}' at opset {1}", mode, ctx.opset));
  std::string padding = ctx.attrString("padding_mode", "zeros");
  std::optional<Padding> known = StringSwitch<std::optional<Padding>>(padding)
                                     .Case("zeros", Padding::Zeros)
                                     .Case("border", Padding::Border)
                                     .Case("reflection", Padding::Reflection)
                                     .Default(std::nullopt);
  if (!known)
    return ctx.fail("unknown padding_mode '" + padding + "'");
  spec.padding = *known;
  spec.alignCorners = ctx.attrInt("align_corners", 0) != 0;
  return spec;
}

/// Reflects \p x into [lo, hi] as often as it takes.
template <typename G> G reflect(G x, G lo, G hi) {
  G range = hi - lo;
  if (range <= 0)
    return lo;
  if (x >= lo && x <= hi)
    return x;
  G distance = x < lo ? lo - x : x - hi;
  G flips = std::floor(distance / range);
  G rest = distance - flips * range;
  bool even = std::fmod(flips, G(2)) == 0;
  if (x < lo)
    return even ? lo + rest : hi - rest;
  return even ? hi - rest : lo + rest;
}

/// The sampling geometry of one spatial axis of X.
template <typename G> struct GridAxis {
  int64_t size;
  G lo, hi; ///< The borders that reflection mirrors at.

  /// The input index that integer position \p i reads under \p padding, or
  /// -1 for a zero.
  int64_t indexOf(int64_t i, Padding padding) const {
    if (i >= 0 && i < size)
      return i;
    if (padding == Padding::Zeros)
      return -1;
    if (padding == Padding::Border)
      return std::clamp<int64_t>(i, 0, size - 1);
    auto r = static_cast<int64_t>(reflect(G(i), lo, hi));
    return std::clamp<int64_t>(r, 0, size - 1);
  }
};

/// Keys' cubic convolution weights (a = -0.75) of the four taps around a
/// point at distance \p t in [0, 1) from the second tap.
void cubicWeights(double t, double w[4]) {
  const double a = -0.75;
  auto near = [&](double s) { return ((a + 2) * s - (a + 3)) * s * s + 1; };
  auto far = [&](double s) { return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a; };
  w[0] = far(t + 1);
  w[1] = near(t);
  w[2] = near(1 - t);
  w[3] = far(2 - t);
}

/// Per-axis taps of one grid position: input indices (-1: a zero) and
/// weights; the sample is the sum over their product.
struct AxisTaps {
  int64_t count = 0;
  int64_t index[4];
  double weight[4];
};

/// The taps of denormalized coordinate \p x on \p axis.
template <typename G> AxisTaps tapsOf(G x, const GridAxis<G> &axis, const GridSpec &spec) {
  AxisTaps taps;
  if (spec.mode == GridMode::Nearest) {
    taps.count = 1;
    taps.index[0] = axis.indexOf(static_cast<int64_t>(x), spec.padding);
    taps.weight[0] = 1;
    return taps;
  }
  G floorX = std::floor(x);
  auto first = static_cast<int64_t>(floorX);
  double t = double(x - floorX);
  if (spec.mode == GridMode::Linear) {
    taps.count = 2;
    taps.weight[0] = 1 - t;
    taps.weight[1] = t;
  } else {
    taps.count = 4;
    first -= 1;
    cubicWeights(t, taps.weight);
  }
  for (int64_t k = 0; k < taps.count; ++k)
    taps.index[k] = axis.indexOf(first + k, spec.padding);
  return taps;
}

/// Maps a normalized grid value to an input coordinate of \p axis, with the
/// out-of-range handling that precedes interpolation.
template <typename G> G denormalize(G n, const GridAxis<G> &axis, const GridSpec &spec) {
  G size = G(axis.size);
  G x = spec.alignCorners ? (n + 1) / 2 * (size - 1) : ((n + 1) * size - 1) / 2;
  if (spec.mode == GridMode::Nearest)
    x = std::nearbyint(x);
  if (x < axis.lo || x > axis.hi) {
    if (spec.padding == Padding::Border)
      x = std::clamp(x, G(0), size - 1);
    else if (spec.padding == Padding::Reflection)
      x = reflect(x, axis.lo, axis.hi);
  }
  // Far outside, every mode reads zeros or a border: keep indices finite.
  return std::clamp(x, G(-(int64_t(1) << 40)), G(int64_t(1) << 40));
}

/// The sampling geometry of each spatial axis of \p x.
template <typename G> std::vector<GridAxis<G>> gridAxes(const Tensor &x, const GridSpec &spec) {
  std::vector<GridAxis<G>> axes;
  for (int64_t d = 2; d < x.rank(); ++d) {
    G size = G(x.dim(d));
    axes.push_back(spec.alignCorners ? GridAxis<G>{x.dim(d), G(0), size - 1}
                                     : GridAxis<G>{x.dim(d), G(-0.5), size - G(0.5)});
  }
  return axes;
}

/// Whether some position of \p grid falls outside X under cubic mode with
/// border or reflection padding: ONNX's reference then moves the position
/// inside before taking its taps, while onnxruntime and PyTorch pad each
/// tap, and the two disagree.
template <typename G>
bool cubicPaddingIsAmbiguous(const Tensor &x, const Tensor &grid, const GridSpec &spec) {
  if (spec.mode != GridMode::Cubic || spec.padding == Padding::Zeros)
    return false;
  std::vector<GridAxis<G>> axes = gridAxes<G>(x, spec);
  int64_t rank = static_cast<int64_t>(axes.size());
  const G *g = grid.data<G>();
  for (int64_t p = 0, e = grid.numElements() / rank; p < e; ++p)
    for (int64_t d = 0; d < rank; ++d) {
      G n = g[p * rank + rank - 1 - d], size = G(axes[d].size);
      G at = spec.alignCorners ? (n + 1) / 2 * (size - 1) : ((n + 1) * size - 1) / 2;
      if (at < axes[d].lo || at > axes[d].hi)
        return true;
    }
  return false;
}

/// GridSample over X of storage T and a grid of storage G.
template <typename T, typename G>
Tensor gridSampleTyped(const Tensor &x, const Tensor &grid, const GridSpec &spec) {
  int64_t rank = x.rank() - 2, batch = x.dim(0), channels = x.dim(1);
  std::vector<GridAxis<G>> axes = gridAxes<G>(x, spec);
  Shape outShape{batch, channels};
  outShape.insert(outShape.end(), grid.shape().begin() + 1, grid.shape().end() - 1);
  int64_t points = product(ArrayRef<int64_t>(outShape).drop_front(2));
  int64_t plane = product(ArrayRef<int64_t>(x.shape()).drop_front(2));
  Shape strides = stridesOf(ArrayRef<int64_t>(x.shape()).drop_front(2));
  Tensor y(x.elemType(), outShape);
  const G *g = grid.data<G>();
  std::vector<AxisTaps> taps(rank);
  Shape pick(rank, 0);
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t p = 0; p < points; ++p) {
      const G *position = g + (n * points + p) * rank;
      // The grid lists coordinates innermost axis first.
      for (int64_t d = 0; d < rank; ++d)
        taps[d] = tapsOf(denormalize(position[rank - 1 - d], axes[d], spec), axes[d], spec);
      for (int64_t c = 0; c < channels; ++c) {
        const T *image = x.data<T>() + (n * channels + c) * plane;
        double sum = 0;
        std::fill(pick.begin(), pick.end(), 0);
        while (true) {
          double w = 1;
          int64_t offset = 0;
          for (int64_t d = 0; d < rank && offset >= 0; ++d) {
            int64_t i = taps[d].index[pick[d]];
            w *= taps[d].weight[pick[d]];
            offset = i < 0 ? -1 : offset + i * strides[d];
          }
          if (offset >= 0)
            sum += w * double(image[offset]);
          int64_t d = rank - 1;
          for (; d >= 0 && ++pick[d] == taps[d].count; --d)
            pick[d] = 0;
          if (d < 0)
            break;
        }
        y.data<T>()[(n * channels + c) * points + p] = static_cast<T>(sum);
      }
    }
  return y;
}

} // namespace

/// GridSample (16, 20, 22).
Expected<Outputs> gridSample(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &grid = ctx.input(1);
  Expected<GridSpec> spec = readGridSpec(ctx);
  if (!spec)
    return spec.takeError();
  int64_t rank = x.rank() - 2;
  if (rank < 1 || grid.rank() != rank + 2 || grid.dim(-1) != rank || grid.dim(0) != x.dim(0))
    return ctx.fail("grid " + grid.describe() + " does not fit X " + x.describe());
  if (ctx.opset < 20 && rank != 2)
    return ctx.fail("GridSample-16 takes a 4-D X, got " + x.describe());
  if (rank > maxGridRank)
    return ctx.unsupported(formatv("{0} spatial dimensions (at most {1})", rank, maxGridRank));
  if (!isFloating(grid.elemType()))
    return ctx.fail("grid must be floating, got " + grid.describe());
  for (int64_t d = 2; d < x.rank(); ++d)
    if (x.dim(d) == 0 && grid.numElements() > 0)
      return ctx.fail("X " + x.describe() + " has an empty spatial dimension");
  return visitStorage(grid.elemType(), [&](auto gridTag) -> Expected<Outputs> {
    using G = decltype(gridTag);
    if constexpr (!isFloat<G>) {
      return ctx.unsupportedType(grid, 1);
    } else {
      for (G v : grid.values<G>())
        if (!std::isfinite(v))
          return ctx.unsupported("a grid position that is not finite");
      if (cubicPaddingIsAmbiguous<G>(x, grid, *spec))
        return ctx.unsupported("cubic mode with border or reflection padding at a position "
                               "outside X (ONNX's reference and onnxruntime disagree)");
      return visitStorage(x.elemType(), [&](auto tag) -> Expected<Outputs> {
        using T = decltype(tag);
        // Integers would have to round an interpolated value.
        if constexpr (!isFloat<T>) {
          if (spec->mode != GridMode::Nearest)
            return ctx.unsupportedType(x, 0);
        }
        return Outputs{gridSampleTyped<T, G>(x, grid, *spec)};
      });
    }
  });
}

/// AffineGrid (20): theta [N, 2, 3] or [N, 3, 4] applied to the evenly
/// spaced positions of size (N, C, H, W) or (N, C, D, H, W).
Expected<Outputs> affineGrid(const OpContext &ctx) {
  const Tensor &theta = ctx.input(0), &size = ctx.input(1);
  if (size.elemType() != DType::I64 || size.rank() != 1 ||
      (size.numElements() != 4 && size.numElements() != 5))
    return ctx.fail("size must be int64 (N, C, H, W) or (N, C, D, H, W), got " + size.describe());
  Shape dims = size.toInt64Vector();
  int64_t rank = size.numElements() - 2;
  if (theta.rank() != 3 || theta.dim(1) != rank || theta.dim(2) != rank + 1 ||
      theta.dim(0) != dims[0])
    return ctx.fail("theta " + theta.describe() + " does not fit size " + shapeString(dims));
  if (llvm::any_of(dims, [](int64_t d) { return d < 0; }))
    return ctx.fail("negative size " + shapeString(dims));
  bool alignCorners = ctx.attrInt("align_corners", 0) != 0;
  // Spatial extents, outermost first; base[d][i] is the normalized
  // position of index i along it.
  Shape spatial(dims.begin() + 2, dims.end());
  std::vector<std::vector<double>> base(rank);
  for (int64_t d = 0; d < rank; ++d) {
    int64_t len = spatial[d];
    if (alignCorners && len == 1)
      return ctx.unsupported("align_corners with a spatial size of 1 (ONNX's reference and its "
                             "function body disagree)");
    for (int64_t i = 0; i < len; ++i)
      base[d].push_back(alignCorners ? -1 + 2.0 * double(i) / double(len - 1)
                                     : -1 + (2.0 * double(i) + 1) / double(len));
  }
  Shape outShape{dims[0]};
  outShape.insert(outShape.end(), spatial.begin(), spatial.end());
  outShape.push_back(rank);
  return onFloat(ctx, theta, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor grid(theta.elemType(), outShape);
    int64_t points = product(spatial);
    T *out = grid.data<T>();
    Shape at(rank, 0);
    std::vector<double> position(rank + 1, 1.0);
    for (int64_t n = 0; n < dims[0]; ++n) {
      const T *m = theta.data<T>() + n * rank * (rank + 1);
      std::fill(at.begin(), at.end(), 0);
      for (int64_t p = 0; p < points; ++p) {
        // The homogeneous position lists the innermost axis first.
        for (int64_t d = 0; d < rank; ++d)
          position[d] = base[rank - 1 - d][at[rank - 1 - d]];
        for (int64_t r = 0; r < rank; ++r) {
          double v = 0;
          for (int64_t k = 0; k <= rank; ++k)
            v += double(m[r * (rank + 1) + k]) * position[k];
          out[(n * points + p) * rank + r] = static_cast<T>(v);
        }
        for (int64_t d = rank - 1; d >= 0 && ++at[d] == spatial[d]; --d)
          at[d] = 0;
      }
    }
    return Outputs{grid};
  });
}

} // namespace pipec::cpu
