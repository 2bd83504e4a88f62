//===- TensorShards.h - A split weight's pieces, cut and joined ----------===//
//
// --tp T: a weight the shard-tensors pass split (plan::WeightShard) is the
// model's whole tensor in the plan; rank t of a stage's T loads piece t,
// and a run's saved weights join the pieces again. Along the shard's axis,
// seen as `stride` equal blocks, piece t holds the t-th of the `parts` cuts
// of every block, in block order (a fused QKV weight: its Q, K and V
// columns of rank t's heads).
//
// Before: W [4, 6], axis 1, parts 2, stride 3 (blocks of columns 0-1, 2-3, 4-5)
// After:  piece 0 [4, 3] = columns 0, 2, 4; piece 1 [4, 3] = columns 1, 3, 5
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_TENSORSHARDS_H
#define PIPEC_RUNTIME_EXEC_TENSORSHARDS_H

#include "plan/plan.pb.h"
#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

namespace pipec::rt {

/// Piece \p index of host tensor \p whole under \p shard; an error when
/// the shard does not cut its shape.
llvm::Expected<cpu::Tensor> shardPiece(const cpu::Tensor &whole, const plan::WeightShard &shard,
                                       int index);

/// The whole tensor of host \p pieces (one per part, in order).
llvm::Expected<cpu::Tensor> joinShards(llvm::ArrayRef<cpu::Tensor> pieces,
                                       const plan::WeightShard &shard);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_TENSORSHARDS_H
