//===- CudaBackend.h - The CUDA implementation of rt::Backend ------------===//
//
// What runs where (the rest of the contract is runtime/core/Backend.h):
//  - Device kernels (CudaKernels.h, cuBLAS) for the float32 ops of GPT, MLP
//    and CNN training plans and their pipec-domain gradients; the views
//    (Reshape, Flatten, Squeeze, Unsqueeze, Identity) share the input's
//    memory.
//  - Host: Shape and Size, Constant outputs that are small integer tensors,
//    and any node whose inputs are all small integer host tensors (shape
//    arithmetic). Their outputs stay on the host when they are small
//    integers, so a Reshape reads its shape without a device round trip.
//    These are not fallbacks.
//  - Fallback: every other node (its row in ops/Ops.def names no device
//    kernel, or the kernel does not take its types) runs on the host backend, its inputs
//    downloaded and its outputs uploaded; counted in fallbackOps().
//
// Errors that a kernel finds on the device (a Gather index or a label out of
// range) are reported by the next synchronize() or download(), naming the
// node. Everything is queued on the backend's own non-blocking stream; host
// memory given to upload() may be reused as soon as it returns.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDABACKEND_H
#define PIPEC_RUNTIME_CUDA_CUDABACKEND_H

#include "runtime/core/Backend.h"
#include "runtime/cuda/DevicePool.h"

#include "llvm/Support/Error.h"

#include <memory>
#include <optional>
#include <string>

namespace pipec::cuda {

/// The CUDA backend on \p device (see rt::makeCudaBackend); \p host (the
/// CPU backend) runs shape arithmetic and the ops without a device kernel.
/// Fails with "no CUDA device: ..." when the machine has no device or
/// \p device is out of range.
llvm::Expected<std::unique_ptr<rt::Backend>> createCudaBackend(int device, bool bf16,
                                                               std::unique_ptr<rt::Backend> host);

/// The memory pool statistics of a backend made by createCudaBackend;
/// nullopt for any other backend.
std::optional<DevicePool::Stats> poolStats(const rt::Backend &backend);

/// How many GEMMs a backend made by createCudaBackend ran with cuBLASLt's
/// bias epilogue (a MatMul and its bias Add in one call); nullopt for any
/// other backend.
std::optional<int64_t> biasEpilogueGemms(const rt::Backend &backend);

} // namespace pipec::cuda

/// The entry point of the CUDA plugin (runtime/exec/CpuBackend.cpp loads it
/// with dlsym): a new backend owned by the caller, which takes \p host, or
/// null with *error set.
extern "C" __attribute__((visibility("default"))) pipec::rt::Backend *
pipecMakeCudaBackend(int device, bool bf16, pipec::rt::Backend *host, std::string *error);

#endif // PIPEC_RUNTIME_CUDA_CUDABACKEND_H
