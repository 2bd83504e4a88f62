//===- Data.h - What a training or inference step feeds -----------------===//
//
// Each graph input of a plan (Plan.data) is fed per microbatch. Samples are
// numbered across the run: step t of a run with global batch G holds samples
// t*G .. t*G+G-1, replica d's microbatch m the slice starting at
// t*G + (d*M + m)*B (B samples per microbatch). A sample's contents depend
// only on its number, so the same run split into other stages, microbatches
// or replicas sees the same data: the basis of the equivalence tests.
//
//  - synthetic (default): counter-based random values from (seed, input,
//    sample, element): integers uniform in [0, high), floats N(0, 1), masks
//    all ones;
//  - --data DIR: DIR/NAME.npy or DIR/NAME.pb (an ONNX TensorProto) holds a
//    dataset per input, N samples stacked along the input's batch axis;
//    sample i is index i mod N along it.
//
// An input's batch axis (DataInput.batch_axis) is the dimension that holds
// its samples: 0 for most inputs, 1 for a past state [2, batch, heads, past,
// head]. A microbatch is sliced along it, so each sample keeps its contents
// whichever axis holds it.
//
// .npy files are NumPy's format (versions 1 to 3, C order, little-endian).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_DATA_H
#define PIPEC_RUNTIME_EXEC_DATA_H

#include "plan/plan.pb.h"
#include "runtime/core/Tensor.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <memory>
#include <string>

namespace pipec::rt {

/// \p name as a file name: '/', ':' and '\\' made '_' (graph inputs and
/// outputs are named like paths).
std::string safeFileName(llvm::StringRef name);

llvm::Expected<cpu::Tensor> readNpy(llvm::StringRef path);
llvm::Error writeNpy(const cpu::Tensor &tensor, llvm::StringRef path);

/// The element type of a plan dtype name ("f32", "i64", ...).
llvm::Expected<DType> elemTypeOfName(llvm::StringRef name);

class DataSource {
public:
  /// Opens the data of \p plan: synthetic from \p seed when \p dir is empty,
  /// else one file per input in \p dir (errors name the file). Datasets are
  /// checked whole: the same number of samples in every input, no NaN or
  /// infinity unless \p allowNonfinite, indices inside the table they index
  /// (DataInput.index_rows); errors name the input and sample.
  static llvm::Expected<std::shared_ptr<DataSource>>
  open(const plan::Plan &plan, llvm::StringRef dir, uint64_t seed, bool allowNonfinite = false);
  /// Samples first .. first + B - 1 of input \p name, stacked along its batch
  /// axis; a whole input (DataInput.whole) as it is.
  llvm::Expected<cpu::Tensor> microbatch(const std::string &name, int64_t first) const;

private:
  struct Input {
    plan::DataInput spec;
    DType type = DType::F32;
    cpu::Tensor dataset; ///< null for synthetic
  };
  std::map<std::string, Input> inputs;
  uint64_t seed = 0;
};

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_DATA_H
