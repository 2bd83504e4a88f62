//===- Profile.cpp - `pipec profile`: measured per-layer costs -----------===//
#include "driver/Profile.h"
#include "runtime/exec/Executor.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <map>

using namespace llvm;

namespace pipec {

Error profileModel(StringRef modelPath, const ProfileOptions &options, raw_ostream &os) {
  // The layers, from a one-stage compile.
  CompileOptions base;
  base.import = options.import;
  base.stages = 1;
  base.microbatches = 1;
  base.globalBatch = options.microbatchSize;
  base.hardware = "cpu";
  base.schedule = ScheduleKind::GPipe;
  // Whether the model trains is what the probe finds out; a model that does
  // not run says why below.
  base.timingOnly = true;
  auto probe = compileModel(modelPath, base, PipelineOptions());
  if (!probe)
    return probe.takeError();
  int layers = probe->layers_size();
  bool training = !probe->loss().empty();

  // One stage per layer, one microbatch: the stages run one after another.
  CompileOptions each = base;
  each.stages = layers;
  each.balance = "uniform";
  each.schedule = ScheduleKind::ZBH1;
  each.training = training;
  each.memoryLimit = "none";
  auto plan = compileModel(modelPath, each, PipelineOptions());
  if (!plan)
    return plan.takeError();
  if (plan->run_status().kind() != plan::RunStatus::RUNS)
    return createStringError(inconvertibleErrorCode(), "profile: the plan cannot %s: %s",
                             plan->run_status().kind() == plan::RunStatus::CANNOT_TRAIN ? "train"
                                                                                        : "be run",
                             plan->run_status().reason().c_str());

  rt::RunOptions run;
  run.seed = options.seed;
  run.optimizer = Optimizer::SGD;
  run.lr = 1e-9; // the weights hardly move; the arithmetic is the same
  run.steps = 1;
  auto warm = rt::runLocal(*plan, run);
  if (!warm)
    return warm.takeError();
  SmallString<128> trace;
  if (std::error_code ec = sys::fs::createTemporaryFile("pipec-profile", "json", trace))
    return createStringError(ec, "profile: a temporary file: %s", ec.message().c_str());
  run.steps = std::max(1, options.steps);
  run.tracePath = std::string(trace);
  auto measured = rt::runLocal(*plan, run);
  if (!measured) {
    sys::fs::remove(trace);
    return measured.takeError();
  }
  auto buffer = MemoryBuffer::getFile(trace);
  sys::fs::remove(trace);
  if (!buffer)
    return createStringError(buffer.getError(), "profile: reading the trace");
  auto parsed = json::parse((*buffer)->getBuffer());
  if (!parsed)
    return parsed.takeError();
  // Sum F, I, W (and B) per stage from events named "<stage><kind><mb>".
  std::map<int, std::array<double, 3>> seconds;
  if (const json::Array *events = parsed->getAsObject()->getArray("traceEvents"))
    for (const json::Value &v : *events) {
      const json::Object *e = v.getAsObject();
      if (!e || e->getString("ph").getValueOr("") != "X")
        continue;
      StringRef name = e->getString("name").getValueOr("");
      size_t kind = name.find_first_of("FIWB");
      int stage = -1;
      if (kind == StringRef::npos || name.take_front(kind).getAsInteger(10, stage))
        continue;
      double dur = e->getNumber("dur").getValueOr(0) / 1e6 / run.steps;
      auto &t = seconds[stage];
      switch (name[kind]) {
      case 'F':
        t[0] += dur;
        break;
      case 'I':
        t[1] += dur;
        break;
      case 'W':
        t[2] += dur;
        break;
      case 'B': // not split: count it as I
        t[1] += dur;
        break;
      }
    }
  json::OStream j(os, 2);
  j.object([&] {
    j.attribute("format_version", 1);
    j.attribute("hardware", "cpu");
    j.attribute("source", formatv("pipec profile {0}: {1} sample(s) per microbatch, mean of {2} "
                                  "step(s)",
                                  modelPath, options.microbatchSize, run.steps)
                              .str());
    j.attributeArray("layers", [&] {
      for (const plan::Stage &stage : plan->stages()) {
        // One layer per stage: its times are the stage's.
        auto t = seconds[stage.index()];
        for (const std::string &layer : stage.layers())
          j.object([&] {
            j.attribute("name", layer);
            j.attribute("forward_s", t[0]);
            j.attribute("backward_input_s", t[1]);
            j.attribute("backward_weight_s", t[2]);
          });
      }
    });
  });
  os << "\n";
  return Error::success();
}

} // namespace pipec
