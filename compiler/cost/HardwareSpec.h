//===- HardwareSpec.h - Devices and links the cost model prices ---------===//
//
// The numbers the cost model turns FLOPs and bytes into seconds with: peak
// compute, memory bandwidth and capacity, per-op launch overhead, and the
// alpha-beta links inside and between nodes. Built-in specs come from public
// datasheets (docs/HARDWARE.md cites each); "cpu" is measured on this machine
// and cached; any spec can be read from or written to a JSON file.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_HARDWARESPEC_H
#define PIPEC_COMPILER_COST_HARDWARESPEC_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdint>
#include <string>

namespace pipec {

/// A point-to-point link in the alpha-beta model: a message of n bytes takes
/// latency + n / bandwidth seconds.
struct LinkSpec {
  std::string name;     ///< "nvlink", "infiniband", "loopback", "pcie".
  double bandwidth = 0; ///< Bytes per second, per direction.
  double latency = 0;   ///< Seconds (alpha).

  /// Seconds to move \p bytes one way; 0 when \p bytes <= 0.
  /// Precondition: bandwidth > 0.
  double transferTime(int64_t bytes) const;

  bool operator==(const LinkSpec &other) const;
  bool operator!=(const LinkSpec &other) const { return !(*this == other); }
};

/// One kind of device and the links between devices of that kind.
struct HardwareSpec {
  std::string name;           ///< "a100", "h100", "h200", "cpu" or a file's name.
  double peakFlopsF32 = 0;    ///< FLOP/s, dense.
  double peakFlopsBf16 = 0;   ///< FLOP/s, dense; also used for fp16.
  double memoryBandwidth = 0; ///< Bytes/s, read plus write.
  int64_t memoryBytes = 0;    ///< Device memory in bytes.
  double launchOverhead = 0;  ///< Seconds added per op (kernel launch, dispatch).
  LinkSpec intraNode;         ///< Between devices of one node.
  LinkSpec interNode;         ///< Between nodes.
  int devicesPerNode = 8;
  std::string source; ///< Where the numbers come from, one line.

  /// Peak dense FLOP/s at bf16/fp16 when \p bf16, else at fp32.
  double peakFlops(bool bf16) const { return bf16 ? peakFlopsBf16 : peakFlopsF32; }

  bool operator==(const HardwareSpec &other) const;
  bool operator!=(const HardwareSpec &other) const { return !(*this == other); }
};

/// The spec named \p name: "a100" (A100 80GB SXM), "h100" (H100 SXM), "h200"
/// (H200 SXM) from datasheets, or "cpu" (this machine, see cpuHardware()).
/// Fails with a message listing the known names.
llvm::Expected<HardwareSpec> builtinHardware(llvm::StringRef name);

/// The names builtinHardware() accepts, comma separated, in a stable order.
llvm::StringRef builtinHardwareNames();

/// Reads a spec from the JSON file \p path (format in docs/HARDWARE.md). With
/// "base": "<built-in name>" every field is optional and overrides the base;
/// without it every field but "source" is required. Unknown fields, missing
/// fields, wrong types and out-of-range values are errors naming \p path and
/// the field (dotted for link fields, e.g. "intra_node.bandwidth").
llvm::Expected<HardwareSpec> loadHardwareFile(llvm::StringRef path);

/// loadHardwareFile() when \p nameOrPath ends in ".json", else builtinHardware().
llvm::Expected<HardwareSpec> resolveHardware(llvm::StringRef nameOrPath);

/// Measures this machine, in under about a second: the sgemm rate of OpenBLAS
/// on all its threads (512^3, repeated for 0.2 s after a warm-up) as both peak
/// rates, the bandwidth of a 64 MiB memcpy (read plus write bytes), the cost
/// of one tiny sgemm call as launch overhead, and a loopback link (memcpy
/// bandwidth, 1 us latency, as shared-memory MPI) both inside and between
/// nodes. memoryBytes is the physical memory, devicesPerNode the CPU count.
llvm::Expected<HardwareSpec> calibrateCpu();

/// calibrateCpu(), cached as JSON in $PIPEC_CACHE_DIR, else
/// $XDG_CACHE_HOME/pipec, else $HOME/.cache/pipec, file
/// cpu-<hash of CPU model name and CPU count>.json. A missing or unreadable
/// cache is recalibrated and rewritten; failing to write the cache is not an
/// error (the measured spec is still returned).
llvm::Expected<HardwareSpec> cpuHardware();

/// The cache file cpuHardware() uses on this machine, or "" when no cache
/// directory is configured.
std::string cpuCachePath();

/// Writes \p spec as JSON that loadHardwareFile() reads back equal: each double
/// in the shortest form that parses back to it, keys in a fixed order.
/// Precondition: all numbers are finite.
void writeHardwareJson(const HardwareSpec &spec, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_HARDWARESPEC_H
