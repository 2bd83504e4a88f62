//===- IndexMap.h - Strided walks for host and device kernels ------------===//
//
// An IndexMap maps a flat row-major output index to the flat offset of each
// operand: broadcasting, transposes and slices are all strided reads. The
// functions compile for the device under nvcc and for the host everywhere
// else (HostDevice.h), so the CPU checks the index math that the device
// kernels use.
//
// Before:  IndexMap of out [2, 3] reading a [3] (strides [0, 1])
// After:   offsets(map, 4) == {1}  (out[1, 1] reads a[1])
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_KERNELS_INDEXMAP_H
#define PIPEC_RUNTIME_KERNELS_INDEXMAP_H

#include "math/HostDevice.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

namespace pipec::kernels {

/// Dimensions an IndexMap can walk after merging contiguous ones.
constexpr int MaxRank = 8;
/// Operands an IndexMap reads (Where reads three).
constexpr int MaxOperands = 3;

/// Element types the device kernels compute on.
enum class Scalar : int { F32, F64, I64, I32, Bool };

/// Maps a flat row-major output index to the flat offset of each operand:
/// offset_k = base[k] + sum_d index_d * strides[k][d]. Dimensions of size 1
/// are dropped and contiguous ones merged, so a plain elementwise op walks
/// one dimension.
template <int N> struct BasicIndexMap {
  int rank = 0;
  int operands = 1;
  int64_t shape[MaxRank] = {};
  int64_t strides[N][MaxRank] = {};
  int64_t base[N] = {};
};
using IndexMap = BasicIndexMap<MaxOperands>;

/// The offset of output element \p index (< the map's element count) in
/// operand \p k. What is left of the index at the outermost dimension is
/// its coordinate there, so a one-dimensional walk divides nothing.
template <int N> PIPEC_HD int64_t offsetOf(const BasicIndexMap<N> &map, int k, int64_t index) {
  int64_t offset = map.base[k];
  for (int d = map.rank - 1; d > 0; --d) {
    int64_t i = index % map.shape[d];
    index /= map.shape[d];
    offset += i * map.strides[k][d];
  }
  return map.rank > 0 ? offset + index * map.strides[k][0] : offset;
}

/// offsetOf for every operand at once (one division per inner dimension).
template <int N>
PIPEC_HD void offsetsOf(const BasicIndexMap<N> &map, int64_t index, int64_t *offsets) {
  for (int k = 0; k < map.operands; ++k)
    offsets[k] = map.base[k];
  for (int d = map.rank - 1; d > 0; --d) {
    int64_t i = index % map.shape[d];
    index /= map.shape[d];
    for (int k = 0; k < map.operands; ++k)
      offsets[k] += i * map.strides[k][d];
  }
  if (map.rank > 0)
    for (int k = 0; k < map.operands; ++k)
      offsets[k] += index * map.strides[k][0];
}

/// Row-major strides of \p shape, in elements.
template <typename Shape> std::vector<int64_t> contiguousStrides(const Shape &shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * shape[d + 1];
  return strides;
}

/// Strides that read a tensor of \p shape as \p outShape (numpy
/// broadcasting, right-aligned): its contiguous strides, 0 along broadcast
/// dimensions. Either shape is any indexable list of int64_t.
template <typename InShape, typename OutShape>
std::vector<int64_t> broadcastStrides(const InShape &shape, const OutShape &outShape) {
  std::vector<int64_t> strides(outShape.size(), 0);
  size_t lead = outShape.size() - shape.size();
  int64_t step = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1)
      strides[lead + i] = step;
    step *= shape[i];
  }
  return strides;
}

/// An IndexMap walking \p outShape with one stride vector per operand (each
/// of outShape's rank) and the given base offsets (0 when omitted). Returns
/// false when more than MaxRank dimensions remain after merging.
template <int N>
bool makeIndexMap(const std::vector<int64_t> &outShape,
                  const std::vector<std::vector<int64_t>> &strides, BasicIndexMap<N> &map,
                  const std::vector<int64_t> &bases = {}) {
  map = BasicIndexMap<N>();
  map.operands = static_cast<int>(strides.size());
  if (map.operands < 1 || map.operands > N)
    return false;
  for (int k = 0; k < map.operands; ++k)
    map.base[k] = k < static_cast<int>(bases.size()) ? bases[k] : 0;
  // Walk from the innermost dimension outwards, merging each dimension into
  // the previous kept one when every operand steps through both as one.
  std::vector<int64_t> shape;
  std::vector<std::vector<int64_t>> merged(map.operands);
  for (int64_t d = static_cast<int64_t>(outShape.size()) - 1; d >= 0; --d) {
    if (outShape[d] == 1)
      continue;
    bool mergeable = !shape.empty();
    for (int k = 0; mergeable && k < map.operands; ++k)
      mergeable = strides[k][d] == merged[k].back() * shape.back();
    if (mergeable) {
      shape.back() *= outShape[d];
      continue;
    }
    shape.push_back(outShape[d]);
    for (int k = 0; k < map.operands; ++k)
      merged[k].push_back(strides[k][d]);
  }
  if (shape.size() > static_cast<size_t>(MaxRank))
    return false;
  map.rank = static_cast<int>(shape.size());
  for (int d = 0; d < map.rank; ++d) {
    // Collected innermost first; IndexMap is outermost first.
    map.shape[d] = shape[map.rank - 1 - d];
    for (int k = 0; k < map.operands; ++k)
      map.strides[k][d] = merged[k][map.rank - 1 - d];
  }
  return true;
}

/// Slice's axes and steps where the node omits them: 0, 1, .. and 1s for
/// \p count starts. False when \p ends, the axes or the steps are not
/// \p count long.
inline bool fillSliceDefaults(size_t count, size_t ends, std::optional<std::vector<int64_t>> &axes,
                              std::optional<std::vector<int64_t>> &steps) {
  if (!axes) {
    axes.emplace(count);
    std::iota(axes->begin(), axes->end(), 0);
  }
  if (!steps)
    steps.emplace(count, 1);
  return ends == count && axes->size() == count && steps->size() == count;
}

/// What Slice reads along one axis: \p length elements from \p begin.
struct SliceAxis {
  int64_t begin = 0, length = 0;
};

/// Slice from \p start towards \p end (either counted from the back when
/// negative) in steps of \p step (not 0) along a dimension of \p dim, both
/// ends clamped as ONNX says.
inline SliceAxis sliceAxis(int64_t dim, int64_t start, int64_t end, int64_t step) {
  if (start < 0)
    start += dim;
  if (end < 0)
    end += dim;
  SliceAxis axis;
  if (dim == 0)
    return axis;
  // Lengths as 1 + (span - 1) / |step|: a step near INT64_MAX (an
  // exporter's "to the end") must not overflow.
  if (step > 0) {
    axis.begin = std::clamp<int64_t>(start, 0, dim);
    end = std::clamp<int64_t>(end, 0, dim);
    axis.length = end > axis.begin ? 1 + (end - axis.begin - 1) / step : 0;
  } else {
    axis.begin = std::clamp<int64_t>(start, 0, dim - 1);
    end = std::clamp<int64_t>(end, -1, dim - 1);
    axis.length = axis.begin > end ? 1 + (axis.begin - end - 1) / -step : 0;
  }
  return axis;
}

/// Split of a dimension of \p dim into \p parts (at least 1) equal parts,
/// but the last, which is smaller when \p parts does not divide \p dim.
inline std::vector<int64_t> equalSplit(int64_t dim, int64_t parts) {
  int64_t chunk = (dim + parts - 1) / parts;
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < parts; ++i)
    sizes.push_back(std::max<int64_t>(0, std::min(chunk, dim - i * chunk)));
  return sizes;
}

/// True when \p sizes are \p parts sizes, none negative, that sum to \p dim.
inline bool splitCovers(const std::vector<int64_t> &sizes, int64_t parts, int64_t dim) {
  return static_cast<int64_t>(sizes.size()) == parts &&
         std::accumulate(sizes.begin(), sizes.end(), int64_t(0)) == dim &&
         std::none_of(sizes.begin(), sizes.end(), [](int64_t s) { return s < 0; });
}

} // namespace pipec::kernels

#endif // PIPEC_RUNTIME_KERNELS_INDEXMAP_H
