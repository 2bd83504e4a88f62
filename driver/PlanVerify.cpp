//===- PlanVerify.cpp - A plan file, checked before any command uses it --===//
#include "driver/PlanVerify.h"
#include "compiler/schedule/ScheduleKind.h"
#include "passes/LowerSchedule.h"
#include "passes/VerifyDataflow.h"
#include "plan/PlanFile.h"
#include "support/Diagnostics.h"

using namespace llvm;

namespace pipec {

Error verifyPlanStreams(const plan::Plan &plan) {
  if (plan.programs_size() == 0)
    return Error::success(); // a plan without streams is only reported
  const plan::ScheduleInfo &s = plan.schedule();
  auto kind = parseSchedule(s.name());
  if (!kind) {
    consumeError(kind.takeError());
    return createStringError(inconvertibleErrorCode(), "schedule.name '%s' is not a schedule",
                             s.name().c_str());
  }
  std::vector<plan::RankProgram> programs(plan.programs().begin(), plan.programs().end());
  if (Error err = verifyProgram(programs, s.stages(), s.microbatches(), *kind, s.virtual_stages()))
    return err;
  // A generation's prefill starts the loop that the decode step's rounds go on.
  if (plan.has_generation() && plan.generation().has_prefill()) {
    const plan::Plan &prefill = plan.generation().prefill();
    std::vector<plan::RankProgram> starts(prefill.programs().begin(), prefill.programs().end());
    if (Error err = verifyGenerationStreams(starts, programs, s.microbatches(), *kind))
      return createStringError(inconvertibleErrorCode(), "generation.prefill: %s",
                               toString(std::move(err)).c_str());
  }
  if (plan.stage_programs_size() == 0)
    return Error::success();
  if (Error err = verifyKernels(plan))
    return err;
  return verifyDataflow(plan);
}

Expected<plan::Plan> readVerifiedPlan(StringRef path) {
  auto plan = readPlan(path);
  if (!plan)
    return plan.takeError();
  if (Error err = verifyPlanStreams(*plan)) {
    // verify-program's grid follows its first line; the error is that line.
    std::string text = toString(std::move(err));
    return fileError(path, StringRef(text).split('\n').first);
  }
  return plan;
}

} // namespace pipec
