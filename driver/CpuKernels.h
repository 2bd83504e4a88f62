//===- CpuKernels.h - Wires the CPU kernels into the CPU calibration ----===//
//
// The compiler times a CPU rank by running pipec's own kernels (runtime/cpu)
// through compiler/cost/CpuCalibration.h; the driver, which may see both
// floors, connects them. compileModel does so before it resolves hardware.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_CPUKERNELS_H
#define PIPEC_DRIVER_CPUKERNELS_H

#include "plan/plan.pb.h"

#include "llvm/ADT/StringRef.h"

#include <string>

namespace pipec {

/// Sets the calibration's node runner to cpu::runOp; idempotent.
void wireCpuKernels();

/// After `pipec run` of \p plan (the file \p planPath) measured a step of
/// \p measured seconds on ranks of \p threads threads: when the plan was
/// predicted on the `cpu` calibration and the step is more than 2x away from
/// its prediction, the calibration may have been taken on a machine in
/// another state (a busy login node). Measures the CPU again
/// (recalibrateCpu), once per plan (not when the cache is newer than the
/// plan file), and returns the summary's line saying so; "" otherwise.
std::string recheckCpuCalibration(const plan::Plan &plan, llvm::StringRef planPath, double measured,
                                  int threads);

} // namespace pipec

#endif // PIPEC_DRIVER_CPUKERNELS_H
