//===- TensorBoard.h - Scalars in TensorBoard's event files --------------===//
//
// `pipec run --tensorboard DIR`: one events.out.tfevents.* file per run, a
// TFRecord stream of Event messages (tools/tensorboard_event.proto): the
// file version first, then per step its scalars, flushed as each step ends
// so that a running TensorBoard follows the run. No TensorBoard library is
// needed to write it.
//
// A TFRecord is the data's length (uint64, little-endian), the masked
// CRC-32C of those 8 bytes, the data, and the masked CRC-32C of the data
// (tensorflow/core/lib/io/record_writer.cc).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_TENSORBOARD_H
#define PIPEC_TOOLS_TENSORBOARD_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

namespace pipec::cli {

/// CRC-32C (Castagnoli) of \p bytes, and TFRecord's mask of it.
uint32_t crc32c(llvm::StringRef bytes);
uint32_t maskedCrc32c(llvm::StringRef bytes);

class TensorBoardWriter {
public:
  /// Creates \p dir if needed and a new event file in it; errors name it.
  static llvm::Expected<std::unique_ptr<TensorBoardWriter>> open(llvm::StringRef dir);
  ~TensorBoardWriter();
  /// Writes step \p step's scalars (tag, value) and flushes.
  llvm::Error write(int64_t step, llvm::ArrayRef<std::pair<std::string, double>> scalars);
  const std::string &path() const { return file; }

private:
  llvm::Error record(const std::string &data);
  std::string file;
  std::FILE *out = nullptr;
};

} // namespace pipec::cli

#endif // PIPEC_TOOLS_TENSORBOARD_H
