//===- TensorBoard.cpp - Scalars in TensorBoard's event files ------------===//
#include "tools/TensorBoard.h"

#include "support/Diagnostics.h"
#include "tools/tensorboard_event.pb.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <array>
#include <chrono>
#include <unistd.h>

using namespace llvm;

namespace pipec::cli {

namespace {

double wallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

} // namespace

uint32_t crc32c(StringRef bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1; // Castagnoli, reflected
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (char b : bytes)
    crc = table[(crc ^ static_cast<uint8_t>(b)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t maskedCrc32c(StringRef bytes) {
  uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

Expected<std::unique_ptr<TensorBoardWriter>> TensorBoardWriter::open(StringRef dir) {
  if (std::error_code ec = sys::fs::create_directories(dir))
    return createStringError(ec, "--tensorboard %s: %s", dir.str().c_str(), ec.message().c_str());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  auto writer = std::unique_ptr<TensorBoardWriter>(new TensorBoardWriter());
  SmallString<256> path(dir);
  sys::path::append(path, formatv("events.out.tfevents.{0}.{1}.{2}.pipec",
                                  static_cast<int64_t>(wallSeconds()), host, getpid())
                              .str());
  writer->file = path.str().str();
  writer->out = std::fopen(writer->file.c_str(), "wb");
  if (!writer->out)
    return fileError(writer->file, "cannot create the event file");
  tensorboard::Event first;
  first.set_wall_time(wallSeconds());
  first.set_file_version("brain.Event:2");
  if (Error err = writer->record(first.SerializeAsString()))
    return std::move(err);
  return std::move(writer);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (out)
    std::fclose(out);
}

Error TensorBoardWriter::write(int64_t step, ArrayRef<std::pair<std::string, double>> scalars) {
  tensorboard::Event event;
  event.set_wall_time(wallSeconds());
  event.set_step(step);
  for (const auto &[tag, value] : scalars) {
    tensorboard::Summary::Value &v = *event.mutable_summary()->add_value();
    v.set_tag(tag);
    v.set_simple_value(static_cast<float>(value));
  }
  return record(event.SerializeAsString());
}

Error TensorBoardWriter::record(const std::string &data) {
  char header[12];
  uint64_t length = data.size();
  for (int i = 0; i < 8; ++i)
    header[i] = static_cast<char>(length >> (8 * i));
  uint32_t lengthCrc = maskedCrc32c(StringRef(header, 8));
  uint32_t dataCrc = maskedCrc32c(data);
  for (int i = 0; i < 4; ++i)
    header[8 + i] = static_cast<char>(lengthCrc >> (8 * i));
  char footer[4];
  for (int i = 0; i < 4; ++i)
    footer[i] = static_cast<char>(dataCrc >> (8 * i));
  if (std::fwrite(header, 1, 12, out) != 12 ||
      std::fwrite(data.data(), 1, data.size(), out) != data.size() ||
      std::fwrite(footer, 1, 4, out) != 4 || std::fflush(out) != 0)
    return fileError(file, "cannot write the event file (disk full?)");
  return Error::success();
}

} // namespace pipec::cli
