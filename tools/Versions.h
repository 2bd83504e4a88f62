//===- Versions.h - What `pipec --version` prints -----------------------===//
#ifndef PIPEC_TOOLS_VERSIONS_H
#define PIPEC_TOOLS_VERSIONS_H

#include "llvm/Support/raw_ostream.h"

namespace pipec {

/// Prints pipec's version and the versions of the libraries it links:
/// ONNX (and its highest opset), protobuf, LLVM, OpenBLAS, MPI and, when
/// built with CUDA, the CUDA runtime, cuBLAS, NCCL and the visible devices.
void printVersions(llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_TOOLS_VERSIONS_H
