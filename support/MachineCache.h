//===- MachineCache.h - What pipec measures once per machine, and where -===//
//
// pipec measures a machine once and keeps the result: the `cpu` spec's
// calibration (compiler/cost/CpuCalibration.h) and the BLAS chosen for the
// CPU (support/Blas.h). Both key their files by the CPU's model name and
// keep them in one folder.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_MACHINECACHE_H
#define PIPEC_SUPPORT_MACHINECACHE_H

#include "llvm/ADT/StringRef.h"

#include <optional>
#include <string>

namespace pipec {

/// The CPU's model name from /proc/cpuinfo ("AMD EPYC 7B13"), or "unknown
/// cpu".
std::string cpuModelName();

/// What the command's environment says about this machine. The library reads
/// no environment variable: a program (tools/MachineEnvironment.h) reads
/// them once and sets these before it computes anything.
struct MachineSettings {
  /// The folder for what pipec measures here (PIPEC_CACHE_DIR, else
  /// $XDG_CACHE_HOME/pipec, else $HOME/.cache/pipec); empty: nothing is
  /// cached.
  std::string cacheDir;
  /// The BLAS asked for: "", "auto", "openblas" or "mkl" (PIPEC_BLAS).
  std::string blas;
  /// MKL's libmkl_rt.so.3 (PIPEC_MKL_LIBRARY); empty: tools/fetch-mkl.sh's.
  std::string mklLibrary;
};

/// Sets the settings, before the first measurement or GEMM.
void setMachineSettings(MachineSettings settings);
const MachineSettings &machineSettings();

/// The folder for what pipec measured on this machine
/// (MachineSettings::cacheDir); empty when none is set (then nothing is
/// cached). The folder may not exist yet.
std::string cacheDirectory();

/// Writes \p text to \p path through a unique temporary file and a rename,
/// creating the folder, so a concurrent reader sees the old file or the new
/// one, never half of one. Returns false when it could not (the caller
/// measures again next time).
bool writeCacheFile(llvm::StringRef path, llvm::StringRef text);

/// A measurement another process disturbed (its thread ran less than 90% of
/// the wall time) is cached marked as such, never over a quiet one, and
/// serves this many seconds; then it is measured again. A busy machine does
/// not measure at every command, and a quiet figure replaces it.
inline constexpr double disturbedMeasurementSeconds = 300;

/// The age in seconds of the file at \p path (its last modification);
/// nullopt when it cannot be read.
std::optional<double> cacheFileAge(llvm::StringRef path);

} // namespace pipec

#endif // PIPEC_SUPPORT_MACHINECACHE_H
