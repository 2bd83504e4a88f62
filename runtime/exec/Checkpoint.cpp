//===- Checkpoint.cpp - A rank's checkpoints -----------------------------===//
#include "runtime/exec/Checkpoint.h"
#include "runtime/exec/RankExecutor.h"
#include "runtime/plan/PlanFile.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

using namespace llvm;

namespace pipec::rt {

Error RankExecutor::saveCheckpoint(StringRef file, int nextStep) {
  onnx::GraphProto g;
  g.set_name("pipec checkpoint");
  g.set_doc_string(formatv("step={0}", nextStep).str());
  auto add = [&](const cpu::Tensor &t, const std::string &name) -> Error {
    auto host = be.download(t);
    if (!host)
      return host.takeError();
    *g.add_initializer() = cpu::toTensorProto(*host, name);
    return Error::success();
  };
  for (const std::string &name : trainableHere) {
    if (Error err = add(weights.at(name), "w:" + name))
      return err;
    if (auto it = master.find(name); it != master.end())
      if (Error err = add(it->second, "p:" + name))
        return err;
    if (auto it = moment1.find(name); it != moment1.end() && !it->second.isNull())
      if (Error err = add(it->second, "m:" + name))
        return err;
    if (auto it = moment2.find(name); it != moment2.end() && !it->second.isNull())
      if (Error err = add(it->second, "v:" + name))
        return err;
  }
  std::string bytes;
  if (!g.SerializeToString(&bytes))
    return rankError(global, "checkpoint: cannot serialize (over 2 GiB?)");
  return writeFileAtomically(file, bytes);
}

Error RankExecutor::loadCheckpoint(StringRef file, int &nextStep) {
  auto buffer = MemoryBuffer::getFile(file, false, false);
  if (!buffer)
    return rankError(global, formatv("checkpoint {0}: {1}", file, buffer.getError().message()));
  onnx::GraphProto g;
  if (!g.ParseFromArray((*buffer)->getBufferStart(),
                        static_cast<int>((*buffer)->getBufferSize())) ||
      !StringRef(g.doc_string()).startswith("step="))
    return rankError(global, formatv("checkpoint {0} is not a pipec checkpoint", file));
  if (StringRef(g.doc_string()).drop_front(5).getAsInteger(10, nextStep))
    return rankError(global, formatv("checkpoint {0}: bad step", file));
  std::set<std::string> seen;
  for (const onnx::TensorProto &t : g.initializer()) {
    auto host = cpu::fromTensorProto(t);
    if (!host)
      return rankError(global, formatv("checkpoint {0}: {1}", file, toString(host.takeError())));
    auto tensor = be.upload(*host);
    if (!tensor)
      return tensor.takeError();
    StringRef name = t.name();
    std::string weight = name.drop_front(2).str();
    if (!weights.count(weight))
      return rankError(global, formatv("checkpoint {0} holds '{1}', which this rank does not own; "
                                       "was it written for another plan?",
                                       file, weight));
    if (name.startswith("w:")) {
      if (tensor->shape() != weights[weight].shape())
        return rankError(global, formatv("checkpoint {0}: '{1}' has shape {2}, the model {3}", file,
                                         weight, cpu::shapeString(tensor->shape()),
                                         cpu::shapeString(weights[weight].shape())));
      weights[weight] = std::move(*tensor);
      seen.insert(weight);
    } else if (name.startswith("p:")) {
      master[weight] = std::move(*tensor);
    } else if (name.startswith("m:")) {
      moment1[weight] = std::move(*tensor);
    } else if (name.startswith("v:")) {
      moment2[weight] = std::move(*tensor);
    }
  }
  for (const std::string &name : trainableHere)
    if (!seen.count(name))
      return rankError(global, formatv("checkpoint {0} lacks weight '{1}'", file, name));
  return Error::success();
}

std::string checkpointFile(StringRef dir, int nextStep, int global) {
  SmallString<256> path(dir);
  sys::path::append(path, formatv("step-{0}", nextStep).str(),
                    formatv("rank-{0}.ckpt", global).str());
  return std::string(path);
}

Expected<int> latestCheckpoint(StringRef dir) {
  SmallString<256> latest(dir);
  sys::path::append(latest, "latest");
  auto buffer = MemoryBuffer::getFile(latest);
  if (!buffer)
    return createStringError(inconvertibleErrorCode(), "--resume: %s: %s", latest.c_str(),
                             buffer.getError().message().c_str());
  int step = 0;
  StringRef text = (*buffer)->getBuffer().trim();
  if (!text.consume_front("step-") || text.getAsInteger(10, step))
    return createStringError(inconvertibleErrorCode(), "--resume: %s does not name a step",
                             latest.c_str());
  return step;
}

} // namespace pipec::rt
