//===- MachineEnvironment.h - The machine's settings from the environment -===//
//
// The library reads no environment variable (support/MachineCache.h's
// MachineSettings carries what they say). Each program reads them here, once,
// before it computes anything: pipec itself, the benchmarks, and the test
// binaries (so that a test that calls the library directly sees the cache
// folder and the BLAS its ctest run was given).
//
//   PIPEC_CACHE_DIR    the folder for what pipec measures on this machine;
//                      unset: $XDG_CACHE_HOME/pipec, else
//                      $HOME/.cache/pipec
//   PIPEC_BLAS         auto (the default), openblas or mkl
//   PIPEC_MKL_LIBRARY  MKL's libmkl_rt.so.3, in place of tools/fetch-mkl.sh's
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TOOLS_MACHINEENVIRONMENT_H
#define PIPEC_TOOLS_MACHINEENVIRONMENT_H

#include "support/MachineCache.h"

#include <cstdlib>
#include <string>

namespace pipec::cli {

/// The variable \p name, or "" when it is unset.
inline std::string environmentValue(const char *name) {
  const char *value = std::getenv(name);
  return value ? value : "";
}

/// MachineSettings as the environment sets them.
inline MachineSettings machineSettingsFromEnvironment() {
  MachineSettings s;
  s.cacheDir = environmentValue("PIPEC_CACHE_DIR");
  if (s.cacheDir.empty()) {
    if (std::string xdg = environmentValue("XDG_CACHE_HOME"); !xdg.empty())
      s.cacheDir = xdg + "/pipec";
    else if (std::string home = environmentValue("HOME"); !home.empty())
      s.cacheDir = home + "/.cache/pipec";
  }
  s.blas = environmentValue("PIPEC_BLAS");
  s.mklLibrary = environmentValue("PIPEC_MKL_LIBRARY");
  return s;
}

/// Sets the machine's settings from the environment.
inline void applyMachineEnvironment() { setMachineSettings(machineSettingsFromEnvironment()); }

} // namespace pipec::cli

#endif // PIPEC_TOOLS_MACHINEENVIRONMENT_H
