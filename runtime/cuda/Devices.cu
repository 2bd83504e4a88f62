//===- Devices.cu - CUDA devices and the libraries pipec links ------------===//
#include "runtime/cuda/CudaStatus.h"
#include "runtime/cuda/Devices.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <library_types.h>
#include <nccl.h>

#include <vector>

namespace pipec::cuda {

llvm::Expected<std::vector<DeviceInfo>> listDevices() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    cudaGetLastError(); // clear the sticky error of this probe
    return std::vector<DeviceInfo>();
  }
  PIPEC_CUDA_TRY(status);
  std::vector<DeviceInfo> devices;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    PIPEC_CUDA_TRY(cudaGetDeviceProperties(&prop, i));
    devices.push_back({i, prop.name, prop.major, prop.minor,
                       static_cast<uint64_t>(prop.totalGlobalMem), prop.multiProcessorCount});
  }
  return devices;
}

llvm::Expected<LibraryVersions> libraryVersions() {
  LibraryVersions v;
  PIPEC_CUDA_TRY(cudaRuntimeGetVersion(&v.runtime));
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess)
    v.driver = 0;
  int major = 0, minor = 0, patch = 0;
  PIPEC_CUDA_TRY(cublasGetProperty(MAJOR_VERSION, &major));
  PIPEC_CUDA_TRY(cublasGetProperty(MINOR_VERSION, &minor));
  PIPEC_CUDA_TRY(cublasGetProperty(PATCH_LEVEL, &patch));
  v.cublas = major * 10000 + minor * 100 + patch;
  PIPEC_CUDA_TRY(ncclGetVersion(&v.nccl));
  return v;
}

namespace {

__global__ void fillIota(float *out, int n, float scale) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    out[i] = scale * static_cast<float>(i);
}

} // namespace

llvm::Error selfTest(int device) {
  constexpr int n = 1 << 20;
  PIPEC_CUDA_TRY(cudaSetDevice(device));
  float *buffer = nullptr;
  PIPEC_CUDA_TRY(cudaMalloc(&buffer, n * sizeof(float)));
  fillIota<<<(n + 255) / 256, 256>>>(buffer, n, 0.5f);
  std::vector<float> host(n);
  cudaError_t launch = cudaGetLastError();
  cudaError_t copy = cudaMemcpy(host.data(), buffer, n * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(buffer);
  PIPEC_CUDA_TRY(launch);
  PIPEC_CUDA_TRY(copy);
  for (int i = 0; i < n; ++i)
    if (host[i] != 0.5f * static_cast<float>(i))
      return llvm::createStringError(llvm::inconvertibleErrorCode(),
                                     "device %d: self-test element %d is %g, expected %g", device,
                                     i, host[i], 0.5 * i);
  return llvm::Error::success();
}

} // namespace pipec::cuda
