//===- Safetensors.h - Reading and writing .safetensors checkpoints -------===//
//
// The checkpoint format of Hugging Face (save_pretrained) and of
// safetensors.torch.save_file: an 8-byte little-endian header length N, N
// bytes of JSON naming each tensor's dtype, shape and [begin, end) byte
// range in the data that follows, then the data, tensors packed without
// holes. Specification: https://github.com/huggingface/safetensors.
//
// SafetensorsFile maps the file (readInputFile) and checks the header the
// way the reference implementation does, and more: a header over 100 MB,
// JSON that does not parse, a key given twice, a dtype or key it does not
// know, a shape whose bytes disagree with its range, ranges that overlap,
// leave a hole, or run past the end of the file. Each is one line naming
// the file and the byte offset at fault. Offsets are 64-bit: files over
// 4 GB read as any other. Tensors are read in place; toTensor copies one.
//
// A checkpoint too big for one file comes as shards, as save_pretrained
// writes them: DIR/model.safetensors.index.json maps each tensor's name to
// its shard (a file of DIR). open takes a .safetensors file, such an index,
// or a folder holding either, and reads every shard as one checkpoint.
//
// writeSafetensors writes tensors in name order through a temporary file
// renamed into place, streaming: a 10 GB checkpoint is never held twice.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_SAFETENSORS_H
#define PIPEC_RUNTIME_EXEC_SAFETENSORS_H

#include "runtime/core/Tensor.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace pipec::rt {

/// One tensor of a safetensors file, its bytes in place.
struct SafeTensor {
  std::string name;
  std::string file; ///< the shard that holds it
  cpu::DType type = cpu::DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0; ///< of its first byte, from the start of the file
  llvm::StringRef bytes;
};

class SafetensorsFile {
public:
  /// Maps and checks \p path: a .safetensors file, a sharded checkpoint's
  /// index (.index.json), or a folder holding model.safetensors or
  /// model.safetensors.index.json. Errors: "PATH: safetensors header at
  /// byte N: WHY", what is wrong with the index, or why a file cannot be
  /// read.
  static llvm::Expected<SafetensorsFile> open(llvm::StringRef path);

  const std::string &path() const { return filePath; }
  /// In the order of their data.
  const std::vector<SafeTensor> &tensors() const { return list; }
  /// The tensor named \p name, or null.
  const SafeTensor *find(llvm::StringRef name) const;
  /// The header's "__metadata__" strings (the first shard's).
  const std::map<std::string, std::string> &metadata() const { return meta; }

  /// A host copy of \p t.
  llvm::Expected<cpu::Tensor> toTensor(const SafeTensor &t) const;

private:
  static llvm::Expected<SafetensorsFile> openFile(llvm::StringRef path);
  static llvm::Expected<SafetensorsFile> openIndex(llvm::StringRef path);

  std::string filePath;
  std::vector<std::shared_ptr<llvm::MemoryBuffer>> buffers;
  std::vector<SafeTensor> list;
  std::map<std::string, size_t> byName;
  std::map<std::string, std::string> meta;
};

/// The safetensors dtype name of \p type ("F32", "BF16", ...), or "" when
/// the format has none (strings, complex numbers).
llvm::StringRef safetensorsDType(cpu::DType type);

/// The type of safetensors dtype name \p name, or nullopt.
std::optional<cpu::DType> safetensorsDTypeOf(llvm::StringRef name);

/// Writes \p tensors (host tensors; names are the keys) and \p metadata to
/// \p path atomically. Errors name the path.
llvm::Error writeSafetensors(llvm::StringRef path,
                             const std::map<std::string, cpu::Tensor> &tensors,
                             const std::map<std::string, std::string> &metadata = {});

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_SAFETENSORS_H
