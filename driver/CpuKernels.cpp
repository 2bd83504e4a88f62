//===- CpuKernels.cpp - Wires the CPU kernels into the CPU calibration --===//
#include "driver/CpuKernels.h"
#include "compiler/cost/CpuCalibration.h"
#include "runtime/cpu/Kernels.h"

namespace pipec {

void wireCpuKernels() {
  setCpuNodeRunner(
      static_cast<llvm::Expected<std::vector<cpu::Tensor>> (*)(
          const onnx::NodeProto &, int64_t, llvm::ArrayRef<const cpu::Tensor *>)>(&cpu::runOp));
}

} // namespace pipec
