//===- CpuKernels.h - Wires the CPU kernels into the CPU calibration ----===//
//
// The compiler times a CPU rank by running pipec's own kernels (runtime/cpu)
// through compiler/cost/CpuCalibration.h; the driver, which may see both
// floors, connects them. compileModel does so before it resolves hardware.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_CPUKERNELS_H
#define PIPEC_DRIVER_CPUKERNELS_H

namespace pipec {

/// Sets the calibration's node runner to cpu::runOp; idempotent.
void wireCpuKernels();

} // namespace pipec

#endif // PIPEC_DRIVER_CPUKERNELS_H
