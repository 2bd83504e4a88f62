//===- Versions.cpp - What `pipec --version` prints -----------------------===//
#include "tools/Versions.h"
#include "compiler/onnx/OnnxImporter.h"
#include "runtime/cpu/FewRowGemm.h"
#include "support/Blas.h"

#include "llvm/Config/llvm-config.h"
#include "llvm/Support/FormatVariadic.h"

#include <google/protobuf/stubs/common.h>
#include <mpi.h>

#include <dlfcn.h>

namespace pipec {

void printVersions(llvm::raw_ostream &os) {
  os << "pipec 0.1.0\n";
  os << llvm::formatv("  onnx      {0}, opsets 1..{1}\n", PIPEC_ONNX_VERSION, maxSupportedOpset());
  os << "  protobuf  " << google::protobuf::internal::VersionString(GOOGLE_PROTOBUF_VERSION)
     << "\n";
  os << "  llvm      " << LLVM_VERSION_STRING << "\n";
  os << "  blas      " << blas::describe() << "\n";
  os << "            " << blas::config() << "\n";
  os << "  few-row   " << cpu::fewRowChoice().reason << "\n";
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(mpi, &length); // allowed before MPI_Init
  llvm::StringRef mpiText(mpi, static_cast<size_t>(length));
  os << "  mpi       " << mpiText.split('\n').first.split(',').first << "\n";
#ifdef PIPEC_CUDA_LIB_DIR
  // Loaded on demand: linking the CUDA libraries would cost every pipec
  // invocation their load time.
  // The toolkit's folder where pipec was built, else the library path by
  // soname (a machine with CUDA's and NCCL's Python packages only).
  std::string dir = PIPEC_CUDA_LIB_DIR;
  auto load = [&](const char *file, const char *soname) {
    void *handle = dlopen((dir + "/" + file).c_str(), RTLD_LAZY | RTLD_LOCAL);
    return handle ? handle : dlopen(soname, RTLD_LAZY | RTLD_LOCAL);
  };
  void *cudart = load("libcudart.so", "libcudart.so." PIPEC_CUDA_MAJOR);
  void *cublas = load("libcublas.so", "libcublas.so." PIPEC_CUDA_MAJOR);
  void *nccl = load("libnccl.so", "libnccl.so.2");
  int runtime = 0, driver = 0, devices = -1, cublasVersion = 0, ncclVersion = 0;
  if (cudart) {
    using IntFn = int (*)(int *);
    if (auto f = reinterpret_cast<IntFn>(dlsym(cudart, "cudaRuntimeGetVersion")))
      f(&runtime);
    if (auto f = reinterpret_cast<IntFn>(dlsym(cudart, "cudaDriverGetVersion")))
      f(&driver);
    if (auto f = reinterpret_cast<IntFn>(dlsym(cudart, "cudaGetDeviceCount")))
      if (f(&devices) != 0)
        devices = 0;
  }
  if (cublas)
    if (auto f = reinterpret_cast<int (*)(void *, int *)>(dlsym(cublas, "cublasGetVersion_v2")))
      f(nullptr, &cublasVersion);
  if (nccl)
    if (auto f = reinterpret_cast<int (*)(int *)>(dlsym(nccl, "ncclGetVersion")))
      f(&ncclVersion);
  os << llvm::formatv(
      "  cuda      runtime {0}.{1}, driver {2}, cublas {3}, nccl {4}, devices {5}\n",
      runtime / 1000, (runtime % 1000) / 10,
      driver ? llvm::formatv("{0}.{1}", driver / 1000, (driver % 1000) / 10).str()
             : std::string("none"),
      cublasVersion, ncclVersion, devices < 0 ? 0 : devices);
#else
  os << "  cuda      not built (configured with -DPIPEC_CUDA=OFF or no toolkit)\n";
#endif
}

} // namespace pipec
