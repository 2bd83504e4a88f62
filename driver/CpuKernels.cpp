//===- CpuKernels.cpp - Wires the CPU kernels into the CPU calibration --===//
#include "driver/CpuKernels.h"
#include "compiler/cost/CpuCalibration.h"
#include "compiler/cost/HardwareSpec.h"
#include "runtime/cpu/Kernels.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {

void wireCpuKernels() {
  setCpuNodeRunner(
      static_cast<llvm::Expected<std::vector<cpu::Tensor>> (*)(
          const onnx::NodeProto &, int64_t, llvm::ArrayRef<const cpu::Tensor *>)>(&cpu::runOp));
}

std::string recheckCpuCalibration(const plan::Plan &plan, StringRef planPath, double measured,
                                  int threads) {
  double predicted = plan.predicted().step_time_s();
  if (plan.hardware_size() == 0 || plan.hardware(0).name() != "cpu" || predicted <= 0 ||
      measured <= 0 || (measured < 2 * predicted && predicted < 2 * measured))
    return "";
  std::string path = cpuCachePath(threads);
  sys::fs::file_status planFile, cacheFile;
  std::string off = formatv("the step took {0:f1}x the prediction", measured / predicted).str();
  if (!path.empty() && !sys::fs::status(planPath, planFile) && !sys::fs::status(path, cacheFile) &&
      cacheFile.getLastModificationTime() > planFile.getLastModificationTime())
    return "cpu: " + off +
           "; the calibration was measured again after this plan was compiled: "
           "compile again to predict with it\n";
  wireCpuKernels();
  auto spec = recalibrateCpu(threads);
  if (!spec)
    return "cpu: " + off + "; measuring the CPU again failed: " + toString(spec.takeError()) + "\n";
  double before = plan.hardware(0).peak_flops();
  return formatv("cpu: {0}; measured the CPU again ({1:f0} GFLOP/s against the plan's {2:f0}; "
                 "its thread ran {3:f2} of the wall time){4}\n",
                 off, spec->peakFlopsF32 * 1e-9, before * 1e-9, spec->calibrationCpuShare,
                 spec->calibrationDisturbed()
                     ? ": disturbed by another process, kept marked as such"
                     : ", cached: compile again to predict with it")
      .str();
}

} // namespace pipec
