//===- CpuKernels.cpp - Wires the CPU kernels into the CPU calibration --===//
#include "driver/CpuKernels.h"
#include "compiler/cost/CpuCalibration.h"
#include "runtime/cpu/Kernels.h"

namespace pipec {

void wireCpuKernels() { setCpuNodeRunner(&cpu::runOp); }

} // namespace pipec
