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
#include "llvm/Support/MemoryBuffer.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pipec::rt {

/// SplitMix64's finalizer of \p x + the golden gamma: the counter-based
/// randomness of synthetic data and of a token stream's order.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// \p name as a file name: '/', ':' and '\\' made '_' (graph inputs and
/// outputs are named like paths).
std::string safeFileName(llvm::StringRef name);

/// A .npy file's array: its element type, shape and little-endian bytes
/// (inside the file's own bytes).
struct NpyArray {
  DType type = DType::Undefined;
  std::vector<int64_t> shape;
  llvm::StringRef data;
};
/// Parses the .npy file \p bytes of \p path: its header, and its data's size
/// against the shape. Errors name the path.
llvm::Expected<NpyArray> parseNpy(llvm::StringRef path, llvm::StringRef bytes);
llvm::Expected<cpu::Tensor> readNpy(llvm::StringRef path);
llvm::Error writeNpy(const cpu::Tensor &tensor, llvm::StringRef path);

/// The element type of a plan dtype name ("f32", "i64", ...).
llvm::Expected<DType> elemTypeOfName(llvm::StringRef name);

/// A flat array of token ids (`pipec run --data FILE`), read as windows of
/// S + 1 tokens: window w holds tokens w*S .. w*S + S, so that ids and the
/// labels shifted by one come from one window. Sample n of a run reads
/// window perm_e[n mod N] of epoch e = n / N (N windows): perm_e is a
/// Fisher-Yates shuffle of 0 .. N-1 drawn from splitmix64 keyed by the seed
/// and the epoch (docs/USER_GUIDE.md gives it in Python), so the order is
/// the same however many stages, microbatches and replicas run it. An
/// evaluation stream is read in order, unshuffled.
///
/// Files: NumPy .npy of one integer dimension; a raw .bin of little-endian
/// uint16 or uint32 (nanoGPT's), or a Megatron indexed dataset's .bin whose
/// .idx beside it gives the type. The file is mapped, not read.
class TokenStream {
public:
  struct Options {
    std::string flag = "--data"; ///< named in errors
    std::string rawType = "uint16";
    int64_t seqLen = 0;
    /// The rows of the vocabulary: every token must lie in [0, vocabulary).
    int64_t vocabulary = 0;
    bool shuffled = true;
    uint64_t seed = 1;
  };
  static llvm::Expected<std::shared_ptr<TokenStream>> open(llvm::StringRef path,
                                                           const Options &options);
  int64_t tokens() const { return count; }
  int64_t windows() const { return (count - 1) / options.seqLen; }
  int64_t seqLen() const { return options.seqLen; }
  const std::string &flagName() const { return options.flag; }
  /// The window sample \p n reads.
  int64_t windowOf(int64_t n) const;
  /// Token \p i of the file.
  int64_t at(int64_t i) const;
  /// Where the stream stands after \p samplesSeen samples (a checkpoint's).
  plan::TokenStreamPosition position(int64_t samplesSeen) const;

private:
  Options options;
  std::unique_ptr<llvm::MemoryBuffer> file;
  const char *base = nullptr;
  DType type = DType::U16;
  int64_t count = 0;
  mutable std::mutex mutex;
  /// The permutations of the epochs last asked for.
  mutable std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> epochs;
};

/// How `pipec run` reads --data or --eval-data.
struct DataOptions {
  std::string flag = "--data"; ///< named in errors
  uint64_t seed = 1;
  bool allowNonfinite = false;
  /// A raw token file's element type (TokenStream).
  std::string tokenType = "uint16";
  /// --seq-len: 0, or the plan's sequence length (checked).
  int64_t seqLen = 0;
  /// Draw a stream's windows in the seeded order (training), or in order
  /// (evaluation).
  bool shuffled = true;
};

class DataSource;

/// The data at \p path for \p plan: synthetic when empty, a directory of
/// per-input datasets, or else a file of token ids (TokenStream), windows
/// of the plan's sequence length over the vocabulary its token ids index.
llvm::Expected<std::shared_ptr<DataSource>>
openRunData(const plan::Plan &plan, llvm::StringRef path, const DataOptions &options);

class DataSource {
public:
  /// Feeds \p plan's inputs from \p stream: those the plan marks TOKENS get
  /// a window's first S tokens, NEXT_TOKENS its last S, masks ones. An
  /// input a stream cannot feed (DataInput.stream NOT_TOKENS, not a mask),
  /// or one not shaped [batch, S], is an error naming it.
  static llvm::Expected<std::shared_ptr<DataSource>>
  fromStream(const plan::Plan &plan, std::shared_ptr<const TokenStream> stream);
  /// The token stream it reads, if any.
  const TokenStream *tokenStream() const { return stream.get(); }
  /// The samples it holds before it repeats: a stream's windows, a
  /// directory's samples per input; 0 for synthetic data (no end).
  int64_t samples() const;

  /// Opens the data of \p plan: synthetic from \p seed when \p dir is empty,
  /// else one file per input in \p dir (errors name the file). Datasets are
  /// checked whole: the same number of samples in every input, no NaN or
  /// infinity unless \p allowNonfinite, indices inside the table they index
  /// (DataInput.index_rows); errors name the input and sample.
  static llvm::Expected<std::shared_ptr<DataSource>> open(const plan::Plan &plan,
                                                          llvm::StringRef dir, uint64_t seed,
                                                          bool allowNonfinite = false,
                                                          llvm::StringRef flag = "--data");
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
  int64_t datasetSamples = 0;
  std::shared_ptr<const TokenStream> stream;
};

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_DATA_H
