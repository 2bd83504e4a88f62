//===- MachineEnvironmentInit.cpp - Settings from the environment, at start ===//
//
// Linked into the test and benchmark binaries, which call the library
// directly: the machine's settings are read from the environment before
// main, as pipec's main reads them (tools/MachineEnvironment.h).
//
//===----------------------------------------------------------------------===//
#include "tools/MachineEnvironment.h"

namespace {

[[maybe_unused]] const bool applied = (pipec::cli::applyMachineEnvironment(), true);

} // namespace
