//===- Profile.h - `pipec profile`: measured per-layer costs -------------===//
//
// Measures each layer's forward, backward-for-inputs and backward-for-
// weights time on this machine's CPU and writes the cost table that
// `pipec compile --costs FILE` puts in place of the roofline. The model is
// compiled with one stage per layer and a zero-bubble schedule with one
// microbatch, so the stages run one at a time and each F, I and W is its
// own timed instruction; a warm-up step, then the mean over the measured
// steps.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_PROFILE_H
#define PIPEC_DRIVER_PROFILE_H

#include "driver/Compile.h"

#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

namespace pipec {

struct ProfileOptions {
  ImportOptions import;
  /// Samples per microbatch, as the plans the table is for will use.
  int64_t microbatchSize = 1;
  int steps = 3;
  uint64_t seed = 1;
};

/// Profiles \p modelPath and writes the cost table (JSON, format_version 1)
/// to \p os. Layers are named as in `pipec inspect`.
llvm::Error profileModel(llvm::StringRef modelPath, const ProfileOptions &options,
                         llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_DRIVER_PROFILE_H
