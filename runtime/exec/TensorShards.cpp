//===- TensorShards.cpp - A split weight's pieces, cut and joined --------===//
#include "runtime/exec/TensorShards.h"

#include "llvm/Support/FormatVariadic.h"

#include <cstring>

using namespace llvm;

namespace pipec::rt {
namespace {

/// The copy both directions make: per outer index and block, `run` bytes
/// of piece \p index between the whole tensor and the piece.
struct Cut {
  int64_t outer = 1, blocks = 1, inner = 1, whole = 0, piece = 0, cut = 0;
};

Expected<Cut> cutOf(ArrayRef<int64_t> shape, const plan::WeightShard &shard) {
  int axis = shard.axis();
  int64_t parts = shard.parts(), stride = shard.stride();
  if (axis < 0 || axis >= static_cast<int>(shape.size()) || parts < 1 || stride < 1 ||
      shape[axis] % (parts * stride) != 0)
    return createStringError(inconvertibleErrorCode(),
                             "shard axis %d of %lld pieces in %lld blocks does not cut its shape",
                             axis, static_cast<long long>(parts), static_cast<long long>(stride));
  Cut c;
  for (int k = 0; k < axis; ++k)
    c.outer *= shape[k];
  for (size_t k = axis + 1; k < shape.size(); ++k)
    c.inner *= shape[k];
  c.blocks = stride;
  c.whole = shape[axis];
  c.piece = shape[axis] / parts;
  c.cut = c.piece / stride;
  return c;
}

/// Copies piece \p index's elements between \p whole and \p piece (to the
/// piece when \p out, else back).
void copyPiece(const Cut &c, size_t elem, int index, char *whole, char *piece, bool out) {
  size_t run = static_cast<size_t>(c.cut * c.inner) * elem;
  for (int64_t o = 0; o < c.outer; ++o)
    for (int64_t b = 0; b < c.blocks; ++b) {
      char *w = whole + ((o * c.whole + b * (c.whole / c.blocks) + index * c.cut) * c.inner) * elem;
      char *p = piece + ((o * c.piece + b * c.cut) * c.inner) * elem;
      if (out)
        std::memcpy(p, w, run);
      else
        std::memcpy(w, p, run);
    }
}

} // namespace

Expected<cpu::Tensor> shardPiece(const cpu::Tensor &whole, const plan::WeightShard &shard,
                                 int index) {
  auto c = cutOf(whole.shape(), shard);
  if (!c)
    return c.takeError();
  std::vector<int64_t> shape(whole.shape().begin(), whole.shape().end());
  shape[shard.axis()] = c->piece;
  cpu::Tensor piece = cpu::Tensor::uninitialized(whole.elemType(), shape);
  size_t elem = whole.numElements() ? whole.byteSize() / whole.numElements() : 0;
  copyPiece(*c, elem, index, static_cast<char *>(const_cast<void *>(whole.rawData())),
            static_cast<char *>(piece.rawData()), /*out=*/true);
  return piece;
}

Expected<cpu::Tensor> joinShards(ArrayRef<cpu::Tensor> pieces, const plan::WeightShard &shard) {
  if (pieces.empty() || static_cast<int>(pieces.size()) != shard.parts())
    return createStringError(inconvertibleErrorCode(), "%zu pieces for a shard of %d parts",
                             pieces.size(), shard.parts());
  std::vector<int64_t> shape(pieces[0].shape().begin(), pieces[0].shape().end());
  if (shard.axis() < 0 || shard.axis() >= static_cast<int>(shape.size()))
    return createStringError(inconvertibleErrorCode(), "shard axis %d of a rank-%zu piece",
                             shard.axis(), shape.size());
  shape[shard.axis()] *= shard.parts();
  auto c = cutOf(shape, shard);
  if (!c)
    return c.takeError();
  cpu::Tensor whole = cpu::Tensor::uninitialized(pieces[0].elemType(), shape);
  size_t elem = pieces[0].numElements() ? pieces[0].byteSize() / pieces[0].numElements() : 0;
  for (int t = 0; t < shard.parts(); ++t) {
    if (pieces[t].shape() != pieces[0].shape() || pieces[t].elemType() != pieces[0].elemType())
      return createStringError(inconvertibleErrorCode(), "piece %d differs from piece 0", t);
    copyPiece(*c, elem, t, static_cast<char *>(whole.rawData()),
              static_cast<char *>(const_cast<void *>(pieces[t].rawData())), /*out=*/false);
  }
  return whole;
}

} // namespace pipec::rt
