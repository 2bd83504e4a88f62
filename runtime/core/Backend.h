//===- Backend.h - Where a rank computes: CPU or a CUDA device -----------===//
//
// The executor (Executor.h) is the same for every backend; a Backend runs
// the stage programs' nodes and the few operations the executor does itself
// (gradient accumulation, the optimizer update). Values are cpu::Tensor
// handles: host tensors on the CPU backend, device tensors
// (cpu::Tensor::onDevice) on the CUDA backend. A backend accepts host
// tensors anywhere (weights and data are loaded on the host) and returns its
// own.
//
// The CUDA backend runs every op it has a kernel for on its device, on the
// rank's compute stream; any other op runs on the CPU kernels with its
// inputs copied to the host and its outputs back (counted in
// fallbackOps()). Half of the precision choice is here: with bf16, GEMMs use
// bf16 tensor cores with fp32 accumulation while weights, gradients and the
// optimizer stay fp32.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_BACKEND_H
#define PIPEC_RUNTIME_CORE_BACKEND_H

#include "runtime/core/Tensor.h"
#include "support/Optimizer.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec {
struct OpDef;
class ParsedAttrs;
} // namespace pipec

namespace pipec::kernels {
struct OptimizerParams;
} // namespace pipec::kernels

namespace pipec::rt {

/// One optimizer step's settings, the same for every weight it updates.
struct OptimizerUpdate {
  using Kind = Optimizer;
  Kind kind = Kind::SGD;
  double lr = 1e-2, momentum = 0.9, weightDecay = 0;
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
  /// The accumulated gradient is multiplied by this first (1 / (M * dp)).
  double gradScale = 1;
  /// 0-based step, for Adam's bias correction.
  int step = 0;
  /// Weight decay pulls the weight towards this, not 0: a weight that holds
  /// its parameter plus a constant (ParamMap.h) decays the parameter.
  double decayCenter = 0;
};

/// One weight's part in a multi-tensor update (Backend::optimize): the
/// weight (or its master copy, or a replica's shard of it), its gradient,
/// and the moments its kind needs (null until the first step; the backend
/// creates them).
struct OptimizerSlot {
  cpu::Tensor *w = nullptr;
  const cpu::Tensor *g = nullptr;
  cpu::Tensor *m = nullptr, *v = nullptr;
  /// Weight decay pulls w towards this, not 0 (OptimizerUpdate::decayCenter).
  double decayCenter = 0;
  /// The weight's name, for errors.
  llvm::StringRef name;
};

/// The slots one launch of a device's update takes: their table is the
/// kernel's argument (kernel arguments are limited to 4 KiB), so nothing is
/// uploaded for it.
inline constexpr int OptimizerSlotsPerLaunch = 32;

/// \p u as the element-wise update kernel (kernels::optimizerElement) takes
/// it: the kind as a number and Adam's bias corrections at u.step.
kernels::OptimizerParams optimizerParams(const OptimizerUpdate &u);

/// What a backend has done that costs a device its pace, counted from its
/// creation: what it launched, the host's waits for it, the bytes it
/// handed back to the host, and its allocations. `pipec run --profile`
/// reports a step's share. A device backend counts the device's calls; the
/// CPU backend counts the calls that would be those on a device, so that a
/// CPU run tells how a step would talk to a GPU.
struct BackendCounters {
  int64_t launches = 0, hostSyncs = 0, deviceToHostBytes = 0, allocations = 0;
  BackendCounters operator-(const BackendCounters &o) const {
    return {launches - o.launches, hostSyncs - o.hostSyncs, deviceToHostBytes - o.deviceToHostBytes,
            allocations - o.allocations};
  }
};

class Backend {
public:
  virtual ~Backend() = default;
  /// "cpu" or "cuda:N".
  virtual std::string name() const = 0;
  /// Evaluates \p node (any domain) under default-domain \p opset.
  virtual llvm::Expected<std::vector<cpu::Tensor>>
  run(const onnx::NodeProto &node, int64_t opset, llvm::ArrayRef<const cpu::Tensor *> inputs) = 0;
  /// The same, \p def being \p node's row of ops/Ops.def, found once when
  /// the rank prepared its nodes (null: the backend looks it up), and \p
  /// attrs what its kernel parsed of its attributes on an earlier run.
  virtual llvm::Expected<std::vector<cpu::Tensor>> run(const onnx::NodeProto &node,
                                                       const OpDef *def, ParsedAttrs &attrs,
                                                       int64_t opset,
                                                       llvm::ArrayRef<const cpu::Tensor *> inputs) {
    (void)def, (void)attrs;
    return run(node, opset, inputs);
  }
  /// Runs \p node (one output) and adds its result into \p accumulator in
  /// place, without making the output, where the backend can: returns false,
  /// having done nothing, where it cannot (the caller then runs the node and
  /// adds). The CPU backend takes a float32 Gemm without C into a float32
  /// accumulator (the BLAS's beta = 1).
  virtual llvm::Expected<bool> runInto(const onnx::NodeProto &node, int64_t opset,
                                       llvm::ArrayRef<const cpu::Tensor *> inputs,
                                       cpu::Tensor &accumulator) {
    (void)node, (void)opset, (void)inputs, (void)accumulator;
    return false;
  }
  /// The backend's copy of host tensor \p host (the same handle on the CPU).
  virtual llvm::Expected<cpu::Tensor> upload(const cpu::Tensor &host) = 0;
  /// A host copy of \p tensor, complete when this returns.
  virtual llvm::Expected<cpu::Tensor> download(const cpu::Tensor &tensor) = 0;
  /// Host copies of \p tensors, complete when this returns, after one wait
  /// for them all (a step's losses and label counts). The default downloads
  /// each in turn.
  virtual llvm::Expected<std::vector<cpu::Tensor>>
  downloadAll(llvm::ArrayRef<const cpu::Tensor *> tensors);
  /// A zero tensor of the backend's.
  virtual llvm::Expected<cpu::Tensor> zeros(DType type, llvm::ArrayRef<int64_t> shape) = 0;
  /// A fresh tensor holding the sum of \p terms (same type and element
  /// count; float or double).
  virtual llvm::Expected<cpu::Tensor> sum(llvm::ArrayRef<const cpu::Tensor *> terms) = 0;
  /// \p accumulator += \p term, in place (the accumulator is the backend's
  /// own, never shared).
  virtual llvm::Error addInto(cpu::Tensor &accumulator, const cpu::Tensor &term) = 0;
  /// The sum over \p tensors (float or double) of (scale x)^2 for every
  /// element x, in double: the squared gradient norm for clipping, without
  /// moving the gradients off the device.
  virtual llvm::Expected<double> sumOfSquares(llvm::ArrayRef<const cpu::Tensor *> tensors,
                                              double scale) = 0;
  /// Applies \p update to every slot, OptimizerSlotsPerLaunch slots a
  /// launch (multi-tensor, as NVIDIA's apex multi_tensor_apply). A tensor is
  /// written in place where the backend's handle is its only one; one that
  /// something else still holds (a weight in flight to another rank, a view
  /// kept for later) is replaced by a new tensor. After the first step,
  /// which creates the moments, nothing is allocated. Returns a one-element
  /// double tensor of the backend's: the sum of the squares of every
  /// updated weight and second moment, finite exactly when they all are,
  /// for the caller to read with the step's other numbers.
  virtual llvm::Expected<cpu::Tensor> optimize(const OptimizerUpdate &update,
                                               llvm::ArrayRef<OptimizerSlot> slots) = 0;
  /// A flat copy of elements [\p begin, \p begin + \p count) of \p t (in
  /// its flat order), zeros where that runs past its end: a replica's shard
  /// of a weight, or a gradient padded to a whole number of shards
  /// (--shard-optimizer). The default goes through the host.
  virtual llvm::Expected<cpu::Tensor> slice(const cpu::Tensor &t, int64_t begin, int64_t count);
  /// A hint before the first step: the plan's peak bytes for this rank
  /// (weights, gradients, optimizer state, activations). The CUDA backend
  /// sizes its memory pool from it.
  virtual llvm::Error reserve(int64_t bytes) {
    (void)bytes;
    return llvm::Error::success();
  }
  /// Waits until everything queued on the rank's streams is done.
  virtual llvm::Error synchronize() = 0;
  /// Ops that ran on the CPU kernels instead of the device, by op type.
  virtual std::map<std::string, int64_t> fallbackOps() const { return {}; }
  /// The most device memory the rank's tensors held at once (bytes handed
  /// out by its pool, size classes' slack included); 0 on the CPU.
  virtual int64_t devicePeakBytes() const { return 0; }
  /// What the backend has done so far (BackendCounters).
  virtual BackendCounters counters() const { return {}; }
};

/// The CPU backend: the kernels of runtime/cpu, GEMMs through OpenBLAS.
std::unique_ptr<Backend> makeCpuBackend();

/// The CUDA backend on \p device with its own compute stream; \p bf16 selects
/// bf16 tensor-core GEMMs. Fails with a clear message when pipec was built
/// without CUDA or the device does not exist.
llvm::Expected<std::unique_ptr<Backend>> makeCudaBackend(int device, bool bf16);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_CORE_BACKEND_H
