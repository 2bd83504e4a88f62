//===- Devices.h - CUDA devices and the libraries pipec links -----------===//
#ifndef PIPEC_RUNTIME_CUDA_DEVICES_H
#define PIPEC_RUNTIME_CUDA_DEVICES_H

#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace pipec::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;
  uint64_t memoryBytes = 0;
  int multiprocessors = 0;
};

struct LibraryVersions {
  int runtime = 0; ///< CUDA runtime, e.g. 13000
  int driver = 0;  ///< 0 when no driver is installed
  int cublas = 0;
  int nccl = 0;
};

/// The devices this process can use; empty (not an error) on a machine
/// without a GPU or driver.
llvm::Expected<std::vector<DeviceInfo>> listDevices();

/// Versions of the CUDA runtime, driver, cuBLAS and NCCL; needs no device.
llvm::Expected<LibraryVersions> libraryVersions();

/// Runs a kernel on \p device that fills a buffer, copies it back and checks
/// every element. Fails with the CUDA error when anything goes wrong.
llvm::Error selfTest(int device);

} // namespace pipec::cuda

#endif // PIPEC_RUNTIME_CUDA_DEVICES_H
