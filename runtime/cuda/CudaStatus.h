//===- CudaStatus.h - CUDA, cuBLAS and NCCL return codes as llvm::Error -===//
//
// One macro for every library status: PIPEC_CUDA_TRY(call) returns an
// llvm::Error naming the call, the file and line and the library's message
// from the enclosing function (which returns Error or Expected<T>).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CUDA_CUDASTATUS_H
#define PIPEC_RUNTIME_CUDA_CUDASTATUS_H

#include "llvm/Support/Error.h"

#include <cublas_api.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace pipec::cuda {

llvm::Error statusError(cudaError_t status, const char *call, const char *file, int line);
llvm::Error statusError(cublasStatus_t status, const char *call, const char *file, int line);
llvm::Error statusError(ncclResult_t status, const char *call, const char *file, int line);

/// Moves an error out; lets the macro return it from functions returning
/// Error or Expected<T> alike, under both nvcc and the host compiler.
inline llvm::Error releaseError(llvm::Error &err) { return std::move(err); }

} // namespace pipec::cuda

#define PIPEC_CUDA_TRY(call)                                                                       \
  do {                                                                                             \
    if (llvm::Error pipecError_ = ::pipec::cuda::statusError((call), #call, __FILE__, __LINE__))   \
      return ::pipec::cuda::releaseError(pipecError_);                                             \
  } while (false)

#endif // PIPEC_RUNTIME_CUDA_CUDASTATUS_H
