//===- CpuCalibration.h - The kernels the CPU calibration times ---------===//
//
// calibrateCpu (HardwareSpec.h) measures a CPU rank by timing the kernels it
// runs. compiler/ does not reach the runtime's kernels; it times them through
// this one entry, which the driver wires to pipec's own (wireCpuKernels in
// driver/CpuKernels.h) before it resolves the "cpu" hardware.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_CPUCALIBRATION_H
#define PIPEC_COMPILER_COST_CPUCALIBRATION_H

#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include "onnx/onnx_pb.h"

#include <vector>

namespace pipec {

/// Runs one node on host tensors as a CPU rank does (cpu::runOp's contract).
using CpuNodeRunner = llvm::Expected<std::vector<cpu::Tensor>> (*)(
    const onnx::NodeProto &node, int64_t opset, llvm::ArrayRef<const cpu::Tensor *> inputs);

/// The runner calibrateCpu times; until one is set, calibrating fails with
/// an error that says so.
void setCpuNodeRunner(CpuNodeRunner runner);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_CPUCALIBRATION_H
