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
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_MEMORYMODEL_H
#define PIPEC_COMPILER_COST_MEMORYMODEL_H

#include "support/Optimizer.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec {

struct TrainingSetup {
  bool training = true;
  Optimizer optimizer = Optimizer::AdamW;
  bool mixedPrecision = true;
  bool recompute = false;
};

/// Bytes held per parameter: weights, gradients and optimizer state.
int64_t bytesPerParam(const TrainingSetup &setup);

/// "16GB", "80GiB", "1.5e9", "512MiB" -> bytes; decimal units are powers of
/// 1000, binary ones of 1024. The error names the flag.
llvm::Expected<int64_t> parseByteSize(llvm::StringRef text, llvm::StringRef flag);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_MEMORYMODEL_H
