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

#include "llvm/ADT/STLFunctionalExtras.h"
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

/// CPU seconds the calling thread has run.
double threadCpuSeconds();

/// What a measurement found, as the text its cache file keeps, and whether
/// another process held the cores meanwhile.
struct Measurement {
  std::string text;
  bool disturbed = false;
};

/// Runs \p measure on the calling thread and marks the result disturbed
/// when the thread ran less than 90% of the wall time.
std::optional<Measurement> measureMarked(llvm::function_ref<std::optional<std::string>()> measure);

/// A measurement kept once per machine: the text cached under \p key (a
/// file \p prefix-<hash of key>.txt in the cache folder) when it is quiet,
/// or disturbed and younger than disturbedMeasurementSeconds, and \p valid
/// accepts it; else \p measure runs (one process measures while the others
/// wait on \p prefix's lock) and its result is cached, a disturbed one
/// marked by a "disturbed 1" line. A quiet figure is never replaced. With no
/// cache folder, \p measure runs every time. nullopt when \p measure gives
/// none.
std::optional<Measurement>
cachedMeasurement(llvm::StringRef prefix, llvm::StringRef key,
                  llvm::function_ref<std::optional<Measurement>()> measure,
                  llvm::function_ref<bool(llvm::StringRef)> valid);

} // namespace pipec

#endif // PIPEC_SUPPORT_MACHINECACHE_H
