//===- ModelCheck.cpp - The plan's model is the one it was compiled for --===//
//
// Before a run loads anything: the plan can run, its model file (and external
// data) hash as the plan says, and every weight the plan reads from them
// names bytes where the model keeps a tensor of that weight's type and shape.
//
//===----------------------------------------------------------------------===//
#include "plan/PlanFile.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Executor.h"
#include "runtime/exec/ModelIO.h"
#include "support/DType.h"
#include "support/InputFile.h"
#include "support/WireSkeleton.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <climits>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

using namespace llvm;

namespace pipec::rt {

namespace {

/// Where a tensor's bytes are in a model's external data.
struct ExternalRef {
  std::string location;
  int64_t offset = 0, length = -1;
  bool operator<(const ExternalRef &o) const {
    return std::tie(location, offset, length) < std::tie(o.location, o.offset, o.length);
  }
};

ExternalRef externalRefOf(const onnx::TensorProto &t) {
  ExternalRef ref;
  for (const onnx::StringStringEntryProto &e : t.external_data()) {
    if (e.key() == "location")
      ref.location = e.value();
    else if (e.key() == "offset")
      StringRef(e.value()).getAsInteger(10, ref.offset);
    else if (e.key() == "length")
      StringRef(e.value()).getAsInteger(10, ref.length);
  }
  return ref;
}

/// Every plan weight the plan reads from the model's files names bytes where
/// the model (which the hash covers) keeps a tensor of the weight's type and
/// shape: in its external data, the exact range an initializer names; in
/// the .onnx file itself, bytes equal to an initializer's raw_data. An
/// edited offset or a flipped bit in a plan cannot make a run read other
/// bytes, such as the .onnx header, as weights. The model is parsed without
/// its large inline payloads (makeSkeleton), so that inline weights are not
/// held twice.
Error checkWeightReferences(const plan::Plan &plan, StringRef modelBytes, StringRef path) {
  bool external = any_of(plan.weights(), [](const onnx::TensorProto &w) {
    return w.data_location() == onnx::TensorProto::EXTERNAL;
  });
  if (!external || modelBytes.size() > size_t(INT_MAX))
    return Error::success();
  auto skeleton = makeSkeleton(modelBytes, DefaultInlineThreshold);
  onnx::ModelProto model;
  if (!skeleton || !model.ParseFromString(*skeleton)) {
    consumeError(skeleton.takeError());
    return createStringError(inconvertibleErrorCode(), "%s: does not parse as ONNX",
                             path.str().c_str());
  }
  using Kind = std::pair<int32_t, std::vector<int64_t>>; // dtype and shape
  std::map<ExternalRef, Kind> kept;
  std::multimap<std::string, Kind> inlineTensors; // by the hash of the raw bytes
  // Every tensor of the model: initializers and Constant values, in
  // subgraphs too.
  std::vector<const onnx::TensorProto *> tensors;
  std::function<void(const onnx::GraphProto &)> collect = [&](const onnx::GraphProto &g) {
    for (const onnx::TensorProto &t : g.initializer())
      tensors.push_back(&t);
    for (const onnx::NodeProto &n : g.node())
      for (const onnx::AttributeProto &a : n.attribute()) {
        if (a.has_t())
          tensors.push_back(&a.t());
        for (const onnx::TensorProto &t : a.tensors())
          tensors.push_back(&t);
        if (a.has_g())
          collect(a.g());
        for (const onnx::GraphProto &sub : a.graphs())
          collect(sub);
      }
  };
  collect(model.graph());
  for (const onnx::TensorProto *tensor : tensors) {
    const onnx::TensorProto &t = *tensor;
    std::vector<int64_t> dims(t.dims().begin(), t.dims().end());
    if (t.data_location() != onnx::TensorProto::EXTERNAL) {
      if (!t.raw_data().empty())
        inlineTensors.insert({contentHash(t.raw_data()), {t.data_type(), dims}});
      continue;
    }
    ExternalRef ref = externalRefOf(t);
    if (any_of(t.external_data(),
               [](const onnx::StringStringEntryProto &e) { return e.key() == InlineDataMarker; })) {
      // makeSkeleton's: the payload is in the model file at (offset, length).
      inlineTensors.insert(
          {contentHash(modelBytes.substr(ref.offset, ref.length)), {t.data_type(), dims}});
      continue;
    }
    if (ref.length < 0)
      ref.length = cpu::numElementsOf(dims) * int64_t(dtypeSize(static_cast<DType>(t.data_type())));
    kept[ref] = {t.data_type(), dims};
  }
  for (const onnx::TensorProto &w : plan.weights()) {
    if (w.data_location() != onnx::TensorProto::EXTERNAL)
      continue;
    ExternalRef ref = externalRefOf(w);
    std::vector<int64_t> dims(w.dims().begin(), w.dims().end());
    Kind kind = {w.data_type(), dims};
    bool found = false;
    if (ref.location == sys::path::filename(path)) {
      if (ref.offset >= 0 && ref.length >= 0 && uint64_t(ref.offset) <= modelBytes.size() &&
          uint64_t(ref.length) <= modelBytes.size() - ref.offset) {
        auto range =
            inlineTensors.equal_range(contentHash(modelBytes.substr(ref.offset, ref.length)));
        for (auto it = range.first; it != range.second && !found; ++it)
          found = it->second == kind;
      }
    } else {
      auto it = kept.find(ref);
      found = it != kept.end() && it->second == kind;
    }
    if (!found)
      return createStringError(
          inconvertibleErrorCode(),
          "weight '%s': the plan reads %s bytes %lld..%lld, where %s keeps no tensor of its type "
          "and shape %s; the plan was edited, or compiled for another model",
          w.name().c_str(), ref.location.c_str(), static_cast<long long>(ref.offset),
          static_cast<long long>(ref.offset + ref.length), path.str().c_str(),
          cpu::shapeString(dims).c_str());
  }
  return Error::success();
}

} // namespace

Expected<std::string> checkPlanModel(const plan::Plan &plan, const RunOptions &options) {
  switch (plan.run_status().kind()) {
  case plan::RunStatus::CANNOT_RUN:
    return createStringError(inconvertibleErrorCode(), "the plan cannot be run: %s",
                             plan.run_status().reason().c_str());
  case plan::RunStatus::CANNOT_TRAIN:
    return createStringError(inconvertibleErrorCode(), "the plan cannot train: %s",
                             plan.run_status().reason().c_str());
  default:
    if (plan.stage_programs_size() == 0)
      return createStringError(inconvertibleErrorCode(),
                               "the plan has no stage programs, yet its run_status says it runs");
    break;
  }
  std::string path = options.modelPath.empty() ? plan.model().path() : options.modelPath;
  if (!sys::fs::exists(path) && options.modelPath.empty() && sys::path::is_relative(path) &&
      !options.planDir.empty()) {
    SmallString<256> beside(options.planDir);
    sys::path::append(beside, path);
    if (sys::fs::exists(beside))
      path = std::string(beside);
  }
  auto file = readInputFile(path);
  if (!file)
    return createStringError(inconvertibleErrorCode(),
                             "cannot read the plan's model: %s (pass --model FILE)",
                             toString(file.takeError()).c_str());
  std::string hash = contentHash((*file)->getBuffer());
  if (hash != plan.model().xxh3())
    return createStringError(inconvertibleErrorCode(),
                             "%s: xxh3 %s differs from the plan's model (%s, xxh3 %s); "
                             "recompile the plan for this model",
                             path.c_str(), hash.substr(0, 12).c_str(), plan.model().path().c_str(),
                             plan.model().xxh3().substr(0, 12).c_str());
  SmallString<256> dir(sys::path::parent_path(path));
  if (dir.empty())
    dir = ".";
  auto dataHash = externalDataHash(plan, dir);
  if (!dataHash)
    return dataHash.takeError();
  if (*dataHash != plan.model().data_xxh3())
    return createStringError(
        inconvertibleErrorCode(),
        "%s: its external data has xxh3 %s, the plan's model had %s; recompile the plan for "
        "this model's data",
        path.c_str(), dataHash->empty() ? "(none)" : dataHash->substr(0, 12).c_str(),
        plan.model().data_xxh3().empty() ? "(none)"
                                         : plan.model().data_xxh3().substr(0, 12).c_str());
  if (Error err = checkWeightReferences(plan, (*file)->getBuffer(), path))
    return std::move(err);
  return path;
}

} // namespace pipec::rt
