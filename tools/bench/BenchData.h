//===- BenchData.h - The generated models the benchmarks run on -*- C++ -*-===//
//
// Both benchmarks run on generated models that the first run writes under
// build/bench-data and later runs reuse.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_BENCH_BENCHDATA_H
#define PIPEC_TOOLS_BENCH_BENCHDATA_H

#include "models/ModelGenerators.h"

#include "llvm/Support/FileSystem.h"

#include <cstdlib>
#include <iostream>
#include <string>

namespace pipec::bench {

/// build/bench-data, made when missing.
inline std::string dataDir() {
  std::string dir = std::string(PIPEC_BINARY_DIR) + "/bench-data";
  llvm::sys::fs::create_directories(dir);
  return dir;
}

/// The path of \p name in dataDir(), written from \p options (with external
/// data for weights of 1 KiB and more when \p externalData) unless it is there
/// already. Prints the error and exits when the model cannot be written.
inline std::string ensureModel(const std::string &name, const models::GeneratorOptions &options,
                               bool externalData = false) {
  std::string path = dataDir() + "/" + name;
  if (llvm::sys::fs::exists(path))
    return path;
  auto model = models::generateModel(options);
  if (!model) {
    std::cerr << llvm::toString(model.takeError()) << "\n";
    std::exit(1);
  }
  if (llvm::Error err = models::writeModel(*model, path, externalData)) {
    std::cerr << llvm::toString(std::move(err)) << "\n";
    std::exit(1);
  }
  return path;
}

} // namespace pipec::bench

#endif // PIPEC_TOOLS_BENCH_BENCHDATA_H
