//===- CudaStatus.cpp - CUDA, cuBLAS and NCCL return codes as llvm::Error -===//
#include "runtime/cuda/CudaStatus.h"

#include <cublas_v2.h>

namespace pipec::cuda {
namespace {

llvm::Error make(const char *library, const char *message, const char *call, const char *file,
                 int line) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), "%s:%d: %s failed: %s: %s", file,
                                 line, call, library, message);
}

} // namespace

llvm::Error statusError(cudaError_t status, const char *call, const char *file, int line) {
  if (status == cudaSuccess)
    return llvm::Error::success();
  return make("CUDA", cudaGetErrorString(status), call, file, line);
}

llvm::Error statusError(cublasStatus_t status, const char *call, const char *file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS)
    return llvm::Error::success();
  return make("cuBLAS", cublasGetStatusString(status), call, file, line);
}

llvm::Error statusError(ncclResult_t status, const char *call, const char *file, int line) {
  if (status == ncclSuccess)
    return llvm::Error::success();
  return make("NCCL", ncclGetErrorString(status), call, file, line);
}

} // namespace pipec::cuda
