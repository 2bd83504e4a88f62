//===- MemoryModel.h - Bytes a pipeline stage holds ---------------------===//
//
// Per rank: weights, gradients and optimizer state per parameter, plus the
// activations kept for backward times the microbatches in flight that the
// schedule keeps on that rank (see inFlightActivations). With recompute,
// each in-flight microbatch keeps only the chunk's input, and one chunk's
// full activations are rebuilt at a time.
//
//   bytes per parameter        fp32      mixed precision (bf16 + fp32 master)
//   SGD                          8         2 + 2 + 4           = 8
//   SGD with momentum           12         2 + 2 + 4 + 4       = 12
//   Adam / AdamW                16         2 + 2 + 4 + 4 + 4   = 16
//   inference                    4         2
//
// --shard-optimizer divides the optimizer's own state (the fp32 master and
// the moments: 4, 8 and 12 bytes above in mixed precision, 0, 4 and 8 in
// fp32) over the data-parallel replicas, as ZeRO stage 1 does (Rajbhandari
// et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models", SC'20); weights and gradients stay whole on every replica.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_MEMORYMODEL_H
#define PIPEC_COMPILER_COST_MEMORYMODEL_H

#include "support/Optimizer.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec {

/// Which layers recompute their activations in the backward instead of
/// keeping them (activation checkpointing).
enum class Recompute {
  None, ///< every layer keeps its activations
  All,  ///< every layer of every stage recomputes (--recompute)
  /// compile chooses per stage how many of its first layers recompute: the
  /// fewest that let every rank fit --memory-limit (--recompute auto)
  Auto,
};

/// "none", "all" or "auto" (any case); the error names the flag.
llvm::Expected<Recompute> parseRecompute(llvm::StringRef name);
llvm::StringRef recomputeName(Recompute recompute);

struct TrainingSetup {
  bool training = true;
  Optimizer optimizer = Optimizer::AdamW;
  /// bf16: a bf16 weight and gradient beside a float32 master copy (16
  /// bytes a parameter with AdamW, as ZeRO counts them), the products at
  /// the bf16 rate.
  bool mixedPrecision = true;
  /// --autocast (with mixedPrecision): the run's own types. The weights
  /// stay float32 and are the optimizer's masters, their gradients are
  /// accumulated and summed over replicas in float32 (as Megatron-LM does
  /// under bf16), and the products read bf16 copies made once a step,
  /// which the layers count as derivedWeightBytes.
  bool autocast = false;
  Recompute recompute = Recompute::None;
  /// The replicas the optimizer state is divided over (--shard-optimizer
  /// with --dp N: N), else 1.
  int optimizerShards = 1;
};

/// Bytes held per parameter, unsharded: weights, gradients and optimizer
/// state.
int64_t bytesPerParam(const TrainingSetup &setup);

/// Of bytesPerParam, the optimizer's own state: the fp32 master copy of a
/// mixed-precision weight and the moments. What sharding divides.
int64_t optimizerBytesPerParam(const TrainingSetup &setup);

/// Bytes of one parameter's gradient as the data-parallel and tied-weight
/// all-reduces move it: 2 in mixed precision, 4 in float32 and under
/// autocast.
int64_t gradientBytesPerParam(const TrainingSetup &setup);

/// Bytes \p params parameters take on a rank: weights and gradients, and
/// its shard of the optimizer state (rounded up).
int64_t weightStateBytes(int64_t params, const TrainingSetup &setup);

/// Of weightStateBytes, the optimizer state's.
int64_t optimizerStateBytes(int64_t params, const TrainingSetup &setup);

/// "16GB", "80GiB", "1.5e9", "512MiB" -> bytes; decimal units are powers of
/// 1000, binary ones of 1024. The error names the flag.
llvm::Expected<int64_t> parseByteSize(llvm::StringRef text, llvm::StringRef flag);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_MEMORYMODEL_H
