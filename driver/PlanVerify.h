//===- PlanVerify.h - A plan file, checked before any command uses it ----===//
//
// Every command that reads a plan (report, simulate, run) reads it through
// readVerifiedPlan: readPlan's structural checks (plan/PlanFile.h,
// checkPlan), then verify-program over the instruction streams (every send
// matched by a receive of the same shape, every microbatch's forward and
// backward on every stage, no deadlock) and verify-dataflow over the stage
// programs, as compile ran them. A plan edited after compile is held to the
// same proof as one compile wrote.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_PLANVERIFY_H
#define PIPEC_DRIVER_PLANVERIFY_H

#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"

namespace pipec {

/// Reads, checks and verifies the plan at \p path; errors name the path.
llvm::Expected<plan::Plan> readVerifiedPlan(llvm::StringRef path);

/// verify-program and verify-dataflow over an already checked \p plan.
llvm::Error verifyPlanStreams(const plan::Plan &plan);

} // namespace pipec

#endif // PIPEC_DRIVER_PLANVERIFY_H
