//===- Versions.cpp - What `pipec --version` prints -----------------------===//
#include "tools/Versions.h"
#include "compiler/onnx/OnnxImporter.h"

#include "llvm/Config/llvm-config.h"
#include "llvm/Support/FormatVariadic.h"

#include <cblas.h>
#include <google/protobuf/stubs/common.h>
#include <mpi.h>

#ifdef PIPEC_HAVE_CUDA
#include "runtime/cuda/Devices.h"
#endif

namespace pipec {

void printVersions(llvm::raw_ostream &os) {
  os << "pipec 0.1.0\n";
  os << llvm::formatv("  onnx      opsets 1..{0} (libonnx)\n", maxSupportedOpset());
  os << "  protobuf  " << google::protobuf::internal::VersionString(GOOGLE_PROTOBUF_VERSION)
     << "\n";
  os << "  llvm      " << LLVM_VERSION_STRING << "\n";
  os << "  openblas  " << openblas_get_config() << "\n";
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(mpi, &length); // allowed before MPI_Init
  llvm::StringRef mpiText(mpi, static_cast<size_t>(length));
  os << "  mpi       " << mpiText.split('\n').first.split(',').first << "\n";
#ifdef PIPEC_HAVE_CUDA
  if (auto v = cuda::libraryVersions()) {
    os << llvm::formatv(
        "  cuda      runtime {0}.{1}, driver {2}, cublas {3}, nccl {4}\n", v->runtime / 1000,
        (v->runtime % 1000) / 10,
        v->driver ? llvm::formatv("{0}.{1}", v->driver / 1000, (v->driver % 1000) / 10).str()
                  : std::string("none"),
        v->cublas, v->nccl);
  } else {
    os << "  cuda      " << llvm::toString(v.takeError()) << "\n";
  }
  if (auto devices = cuda::listDevices()) {
    if (devices->empty())
      os << "  devices   none\n";
    for (const auto &d : *devices)
      os << llvm::formatv("  device {0}  {1}, sm_{2}{3}, {4} GiB\n", d.index, d.name, d.major,
                          d.minor, d.memoryBytes >> 30);
  } else {
    os << "  devices   " << llvm::toString(devices.takeError()) << "\n";
  }
#else
  os << "  cuda      not built (configured with -DPIPEC_CUDA=OFF or no toolkit)\n";
#endif
}

} // namespace pipec
