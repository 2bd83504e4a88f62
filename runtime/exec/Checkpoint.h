//===- Checkpoint.h - Where a run's checkpoints live ---------------------===//
//
// A checkpoint directory holds step-N/rank-R.ckpt for every global rank R
// and a file "latest" naming the newest complete step ("step-N"), written
// after every rank's file. A rank's file is a GraphProto of tensors "w:NAME"
// (weights), "p:NAME" (float32 master copies), "m:NAME" and "v:NAME"
// (optimizer moments), with doc_string "step=N"; RankExecutor writes and
// reads it (Checkpoint.cpp).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_CHECKPOINT_H
#define PIPEC_RUNTIME_EXEC_CHECKPOINT_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>

namespace pipec::rt {

/// The file of global rank \p global in the checkpoint of step \p nextStep.
std::string checkpointFile(llvm::StringRef dir, int nextStep, int global);

/// The step that \p dir's "latest" names; errors read "--resume: ...".
llvm::Expected<int> latestCheckpoint(llvm::StringRef dir);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_CHECKPOINT_H
