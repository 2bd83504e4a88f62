//===- PlanFile.cpp - Read and write plan files ---------------------------===//
#include "runtime/plan/PlanFile.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/SHA256.h"
#include "llvm/Support/raw_ostream.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include <optional>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<PlanEncoding> planEncodingNames[] = {
    {PlanEncoding::Binary, "binary"}, {PlanEncoding::Text, "text"}, {PlanEncoding::Json, "json"}};

} // namespace

Expected<PlanEncoding> parsePlanEncoding(StringRef name) {
  if (std::optional<PlanEncoding> encoding = valueOf(planEncodingNames, name))
    return *encoding;
  return createStringError(inconvertibleErrorCode(), "--emit %s: expected %s", name.str().c_str(),
                           nameList(planEncodingNames).c_str());
}

Expected<std::string> serializePlan(const plan::Plan &plan, PlanEncoding encoding) {
  std::string out;
  switch (encoding) {
  case PlanEncoding::Binary: {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!plan.SerializeToCodedStream(&coded))
      return createStringError(inconvertibleErrorCode(), "cannot serialize the plan");
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
  auto bytes = serializePlan(plan, encoding);
  if (!bytes)
    return bytes.takeError();
  return writeFileAtomically(path, *bytes);
}

std::string sha256Hex(StringRef bytes) {
  return toHex(SHA256::hash(ArrayRef<uint8_t>(reinterpret_cast<const uint8_t *>(bytes.data()),
                                              bytes.size())),
               /*LowerCase=*/true);
}

Error writeFileAtomically(StringRef path, StringRef bytes) {
  std::string temp = (path + ".tmp").str();
  std::error_code ec;
  raw_fd_ostream os(temp, ec);
  if (ec)
    return createStringError(ec, "%s: cannot write: %s", path.str().c_str(), ec.message().c_str());
  os << bytes;
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
  auto buffer = MemoryBuffer::getFile(path, /*IsText=*/false, /*RequiresNullTerminator=*/false);
  if (!buffer)
    return fail("cannot open: " + buffer.getError().message());
  StringRef bytes = (*buffer)->getBuffer();
  plan::Plan plan;
  StringRef head = bytes.ltrim();
  bool parsed = false;
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
  // What the readers index without checking (a hand-edited text or JSON
  // plan may break it).
  for (const plan::Stage &stage : plan.stages())
    if (stage.rank() < 0 || stage.rank() >= plan.ranks_size())
      return fail("stage " + Twine(stage.index()) + " is on rank " + Twine(stage.rank()) +
                  ", but the plan has " + Twine(plan.ranks_size()) + " rank(s)");
  if (plan.programs_size() > 0 && plan.hardware_size() == 0)
    return fail("instruction streams but no hardware entries");
  if (plan.programs_size() > plan.ranks_size())
    return fail(Twine(plan.programs_size()) + " instruction streams for " +
                Twine(plan.ranks_size()) + " rank(s)");
  if (plan.stage_programs_size() > 0 && plan.stage_programs_size() != plan.stages_size())
    return fail(Twine(plan.stage_programs_size()) + " stage programs for " +
                Twine(plan.stages_size()) + " stage(s)");
  for (const plan::RankProgram &program : plan.programs())
    for (const plan::Instruction &ins : program.instructions())
      if (ins.stage() < -1 || ins.stage() >= plan.stages_size())
        return fail("an instruction of rank " + Twine(program.rank()) + " names stage " +
                    Twine(ins.stage()) + " of " + Twine(plan.stages_size()));
  return plan;
}

} // namespace pipec
