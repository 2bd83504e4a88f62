//===- PlanFile.cpp - Read and write plan files ---------------------------===//
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"
#include "support/InputFile.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SHA256.h"
#include "llvm/Support/raw_ostream.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <set>

// Header-only (Debian's libxxhash-dev): nothing to link, nothing to bundle.
#define XXH_INLINE_ALL
#include <xxhash.h>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<PlanEncoding> planEncodingNames[] = {
    {PlanEncoding::Binary, "binary"}, {PlanEncoding::Text, "text"}, {PlanEncoding::Json, "json"}};

} // namespace

Expected<PlanEncoding> parsePlanEncoding(StringRef name) {
  if (std::optional<PlanEncoding> encoding = valueOf(planEncodingNames, name))
    return *encoding;
  return usageError("--emit " + name + ": expected " + nameList(planEncodingNames));
}

namespace {

/// protobuf's output, copied into a raw_ostream in the adaptor's blocks.
class RawOstreamCopier : public google::protobuf::io::CopyingOutputStream {
public:
  explicit RawOstreamCopier(raw_ostream &os) : os(os) {}
  bool Write(const void *buffer, int size) override {
    os.write(static_cast<const char *>(buffer), size);
    return true; // the stream's errors surface when the file is closed
  }

private:
  raw_ostream &os;
};

/// The binary plan, deterministic, streamed into \p os (never held whole).
Error writeBinary(const plan::Plan &plan, raw_ostream &os) {
  RawOstreamCopier copier(os);
  google::protobuf::io::CopyingOutputStreamAdaptor stream(&copier);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  if (!plan.SerializeToCodedStream(&coded))
    return createStringError(inconvertibleErrorCode(), "cannot serialize the plan");
  return Error::success();
}

} // namespace

Expected<std::string> serializePlan(const plan::Plan &plan, PlanEncoding encoding) {
  std::string out;
  switch (encoding) {
  case PlanEncoding::Binary: {
    raw_string_ostream os(out);
    if (Error err = writeBinary(plan, os))
      return std::move(err);
    os.flush();
    break;
  }
  case PlanEncoding::Text:
    if (!google::protobuf::TextFormat::PrintToString(plan, &out))
      return createStringError(inconvertibleErrorCode(), "cannot print the plan as text");
    break;
  case PlanEncoding::Json: {
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    auto status = google::protobuf::util::MessageToJsonString(plan, &out, options);
    if (!status.ok())
      return createStringError(inconvertibleErrorCode(), "cannot print the plan as JSON: %s",
                               status.ToString().c_str());
    break;
  }
  }
  return out;
}

Error writePlan(const plan::Plan &plan, StringRef path, PlanEncoding encoding) {
  if (encoding != PlanEncoding::Binary) {
    auto bytes = serializePlan(plan, encoding);
    if (!bytes)
      return bytes.takeError();
    return writeFileAtomically(path, *bytes);
  }
  // Binary plans stream to the file: a 35 MB plan held whole once more
  // would be the peak of `pipec compile`.
  return writeFileAtomically(path, [&](raw_ostream &os) { return writeBinary(plan, os); });
}

std::string sha256Hex(StringRef bytes) {
  return toHex(SHA256::hash(ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(bytes.data()),
                                              bytes.size())),
               /*LowerCase=*/true);
}

namespace {

std::string hex128(XXH128_hash_t h) {
  char text[33];
  std::snprintf(text, sizeof text, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return text;
}

} // namespace

namespace {
constexpr StringLiteral receivedGradPrefix = "grad-next:";
} // namespace

std::string receivedGradName(StringRef value) { return (receivedGradPrefix + value).str(); }

bool isReceivedGradName(StringRef name) { return name.startswith(receivedGradPrefix); }

std::string allReduceGroupName(plan::Instruction::Reduce reduce, StringRef tiedWeight) {
  switch (reduce) {
  case plan::Instruction::DATA_PARALLEL:
    return "dp";
  case plan::Instruction::TIED_WEIGHT:
    return "tied:" + tiedWeight.str();
  default:
    return "";
  }
}

std::string contentHash(StringRef bytes) {
  return hex128(XXH3_128bits(bytes.data(), bytes.size()));
}

namespace {

/// A stream that keeps nothing but the XXH3-128 of what is written to it.
class HashingOstream : public raw_ostream {
public:
  HashingOstream() : state(XXH3_createState()) { XXH3_128bits_reset(state); }
  ~HashingOstream() override {
    flush();
    XXH3_freeState(state);
  }
  std::string digest() {
    flush();
    return hex128(XXH3_128bits_digest(state));
  }

private:
  void write_impl(const char *bytes, size_t size) override {
    XXH3_128bits_update(state, bytes, size);
    written += size;
  }
  uint64_t current_pos() const override { return written; }

  XXH3_state_t *state;
  uint64_t written = 0;
};

} // namespace

std::string planContentHash(plan::Plan &plan) {
  // The two fields are taken out for the encoding and put back, so that a
  // 35 MB plan is neither copied nor held encoded.
  std::unique_ptr<plan::TrainingInfo> training(plan.has_training() ? plan.release_training()
                                                                   : nullptr);
  std::string seal = std::move(*plan.mutable_content_xxh3());
  plan.clear_content_xxh3();
  HashingOstream os;
  Error err = writeBinary(plan, os);
  std::string hash = os.digest();
  plan.set_content_xxh3(std::move(seal));
  if (training)
    plan.set_allocated_training(training.release());
  // writeBinary fails only for a plan over protobuf's 2 GiB message limit,
  // which no reader could parse: its hash is one no plan file can match.
  if (err) {
    consumeError(std::move(err));
    return "unencodable";
  }
  return hash;
}

void sealPlan(plan::Plan &plan) { plan.set_content_xxh3(planContentHash(plan)); }

Expected<std::string> externalDataHash(const plan::Plan &plan, StringRef modelDir) {
  std::set<std::string> locations;
  std::string modelFile = sys::path::filename(plan.model().path()).str();
  for (const onnx::TensorProto &w : plan.weights())
    for (const onnx::StringStringEntryProto &entry : w.external_data())
      if (entry.key() == "location" && entry.value() != modelFile)
        locations.insert(entry.value());
  if (locations.empty())
    return "";
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t *)> hash(XXH3_createState(),
                                                                        XXH3_freeState);
  XXH3_128bits_reset(hash.get());
  for (const std::string &location : locations) {
    SmallString<256> path(modelDir);
    sys::path::append(path, location);
    if (Error err = checkInsideFolder(path, modelDir, "external data location"))
      return err;
    auto buffer = readInputFile(path);
    if (!buffer)
      return buffer.takeError();
    // The name with its NUL, then the bytes.
    XXH3_128bits_update(hash.get(), location.c_str(), location.size() + 1);
    XXH3_128bits_update(hash.get(), (*buffer)->getBufferStart(), (*buffer)->getBufferSize());
  }
  return hex128(XXH3_128bits_digest(hash.get()));
}

Error writeFileAtomically(StringRef path, StringRef bytes) {
  return writeFileAtomically(path, [&](raw_ostream &os) {
    os << bytes;
    return Error::success();
  });
}

Error checkOutputPath(StringRef path) {
  if (path == nullOutput)
    return Error::success();
  sys::fs::file_status status;
  if (sys::fs::status(path, status) || !sys::fs::exists(status))
    return Error::success(); // a new file
  if (sys::fs::is_directory(status))
    return createStringError(inconvertibleErrorCode(), "%s: is a directory; give a file name",
                             path.str().c_str());
  if (!sys::fs::is_regular_file(status))
    return createStringError(inconvertibleErrorCode(),
                             "%s: is not a regular file (a device, pipe or socket); pipec writes "
                             "its outputs to regular files (%s discards one)",
                             path.str().c_str(), nullOutput.data());
  return Error::success();
}

Error writeFileAtomically(StringRef path, function_ref<Error(raw_ostream &)> write) {
  if (Error err = checkOutputPath(path))
    return err;
  if (path == nullOutput) { // written and discarded: its errors still count
    raw_null_ostream discard;
    if (Error err = write(discard))
      return createStringError(inconvertibleErrorCode(), "%s: %s", path.str().c_str(),
                               toString(std::move(err)).c_str());
    return Error::success();
  }
  // A fresh temporary (O_EXCL): a file or symlink left at a predictable name
  // is never written through.
  SmallString<256> temp;
  int fd = -1;
  if (std::error_code ec = sys::fs::createUniqueFile(path + ".tmp-%%%%%%", fd, temp))
    return createStringError(ec, "%s: cannot write: %s", path.str().c_str(), ec.message().c_str());
  raw_fd_ostream os(fd, /*shouldClose=*/true);
  if (Error err = write(os)) {
    os.close();
    os.clear_error();
    sys::fs::remove(temp);
    return createStringError(inconvertibleErrorCode(), "%s: %s", path.str().c_str(),
                             toString(std::move(err)).c_str());
  }
  os.close(); // close() reports what a full disk refused, too
  if (os.has_error()) {
    std::error_code failed = os.error();
    os.clear_error(); // an unhandled stream error would abort at destruction
    sys::fs::remove(temp);
    return createStringError(failed, "%s: write failed: %s", path.str().c_str(),
                             failed.message().c_str());
  }
  if (std::error_code rc = sys::fs::rename(temp, path)) {
    sys::fs::remove(temp);
    return createStringError(rc, "%s: cannot rename into place: %s", path.str().c_str(),
                             rc.message().c_str());
  }
  return Error::success();
}

Expected<plan::Plan> readPlan(StringRef path) {
  auto fail = [&](const Twine &why) { return fileError(path, why); };
  auto buffer = readInputFile(path);
  if (!buffer)
    return buffer.takeError();
  StringRef bytes = (*buffer)->getBuffer();
  plan::Plan plan;
  StringRef head = bytes.ltrim();
  bool parsed = false;
  // protobuf logs why a parse failed (bad UTF-8, a text-format syntax error)
  // on stderr; the error below is the one line the user sees.
  google::protobuf::LogSilencer silence;
  if (head.startswith("{")) {
    google::protobuf::util::JsonParseOptions options;
    parsed = google::protobuf::util::JsonStringToMessage(std::string(bytes), &plan, options).ok();
  } else if (head.startswith("format_version")) {
    parsed = google::protobuf::TextFormat::ParseFromString(std::string(bytes), &plan);
  } else {
    parsed = plan.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  }
  if (!parsed)
    return fail("not a pipec plan (truncated, corrupt, or another kind of file)");
  if (plan.format_version() != PlanFormatVersion)
    return fail("plan format_version " + Twine(plan.format_version()) +
                " is not the one this pipec reads (" + Twine(PlanFormatVersion) +
                "); recompile the model");
  if (Error err = checkPlan(plan))
    return fail(toString(std::move(err)));
  // The seal is checked after the structure, so that a plan broken in a way
  // checkPlan names says so; what is left is content edited by hand.
  if (plan.content_xxh3().empty())
    return fail("the plan has no content_xxh3; recompile the model");
  if (planContentHash(plan) != plan.content_xxh3())
    return fail("the plan's content is not what compile wrote (its content_xxh3 differs): only "
                "training's precision, optimizer and recompute may be edited; recompile the "
                "model for any other change");
  return plan;
}

double modelFlopsPerStep(const plan::Plan &plan) {
  double forward = 0;
  for (const plan::Stage &stage : plan.stages())
    forward += stage.flops_f();
  const plan::ScheduleInfo &s = plan.schedule();
  return modelFlopsPerStep(forward, s.microbatches(), s.data_parallel(), s.tensor_parallel(),
                           s.mode() == "train");
}

double modelFlopsPerStep(double forwardPerMicrobatch, int microbatches, int dataParallel,
                         int tensorParallel, bool training) {
  // A stage's FLOPs are one tensor-parallel rank's: its split products'
  // share and the replicated rest (norms, embedding, head), which every
  // rank computes.
  return forwardPerMicrobatch * std::max(1, microbatches) * std::max(1, dataParallel) *
         std::max(1, tensorParallel) * (training ? 3 : 1);
}

double peakFlopsOfRun(const plan::Plan &plan) {
  const plan::ScheduleInfo &s = plan.schedule();
  double pipeline = 0;
  for (int r = 0; r < s.stages(); ++r)
    pipeline += plan.hardware_size() == 0  ? 0
                : r < plan.hardware_size() ? plan.hardware(r).peak_flops()
                                           : plan.hardware(0).peak_flops();
  return pipeline * std::max(1, s.data_parallel()) * std::max(1, s.tensor_parallel());
}

int64_t tokensPerSample(const plan::Plan &plan) {
  for (const plan::DataInput &d : plan.data())
    if (d.stream() == plan::DataInput::TOKENS && d.shape_size() == 2)
      return d.shape(1);
  return 0;
}

const CollectiveInfo *collectiveOf(plan::Instruction::Op op) {
  static const CollectiveInfo rows[] = {
#define PIPEC_COLLECTIVE(OP, NAME, RING, WHEN)                                                     \
  {plan::Instruction::OP, NAME, RING, std::string_view(#WHEN) == "AfterUpdate"},
#include "plan/Collectives.def"
  };
  for (const CollectiveInfo &row : rows)
    if (row.op == op)
      return &row;
  return nullptr;
}

} // namespace pipec
