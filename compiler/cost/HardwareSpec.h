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
  std::string name;         ///< "a100", "h100", "h200", "cpu" or a file's name.
  double peakFlopsF32 = 0;  ///< FLOP/s, dense.
  double peakFlopsBf16 = 0; ///< FLOP/s, dense; also used for fp16.
  /// FLOP/s of the ops that are not matrix products (element-wise,
  /// normalization, softmax, losses) where they run slower than the peak
  /// (CPU ranks: vector loops, not BLAS); 0 prices them at the peak too.
  double vectorFlops = 0;
  double memoryBandwidth = 0; ///< Bytes/s, read plus write.
  int64_t memoryBytes = 0;    ///< Device memory in bytes.
  double launchOverhead = 0;  ///< Seconds added per op (kernel launch, dispatch).
  /// Seconds added per matrix product (each GEMM a MatMul, Gemm or
  /// convolution runs, forward and backward) on top of launchOverhead: on CPU
  /// ranks, splitting it over the rank's threads and packing its operands.
  double gemmOverhead = 0;
  /// An op's time adds its arithmetic and its memory traffic (CPU ranks,
  /// whose GEMMs stream their weights before computing on them) instead of
  /// taking the larger (GPUs, which overlap them).
  bool sumsComputeAndMemory = false;
  LinkSpec intraNode; ///< Between devices of one node.
  LinkSpec interNode; ///< Between nodes.
  int devicesPerNode = 8;
  /// Its ranks are threads or processes of one machine that share its cores
  /// and memory (the `cpu` spec and files over it), not devices of their own.
  bool sharesHostCores = false;
  std::string source; ///< Where the numbers come from, one line.
  /// A calibrated spec's conditions: the share of the wall time the
  /// calibrating thread ran (0: unknown, a spec from a file or a datasheet)
  /// and when it ran (UTC, ISO 8601). Below minCalibrationCpuShare another
  /// process took the cores: the figures are not cached.
  double calibrationCpuShare = 0;
  std::string calibratedAt;
  static constexpr double minCalibrationCpuShare = 0.9;
  bool calibrationDisturbed() const {
    return calibrationCpuShare > 0 && calibrationCpuShare < minCalibrationCpuShare;
  }

  /// Peak dense FLOP/s at bf16/fp16 when \p bf16, else at fp32.
  double peakFlops(bool bf16) const { return bf16 ? peakFlopsBf16 : peakFlopsF32; }
  /// FLOP/s of an op that runs \p gemms matrix products (the peak), or none
  /// (vectorFlops when set).
  double flopsFor(double gemms, bool bf16) const {
    return gemms > 0 || vectorFlops <= 0 ? peakFlops(bf16) : vectorFlops;
  }

  bool operator==(const HardwareSpec &other) const;
  bool operator!=(const HardwareSpec &other) const { return !(*this == other); }
};

/// The spec named \p name: "a100" (A100 80GB SXM), "h100" (H100 SXM), "h200"
/// (H200 SXM) from datasheets, or "cpu": one rank of this machine computing
/// on \p cpuThreads threads (0: every CPU), see cpuHardware(). Fails with a
/// message listing the known names.
llvm::Expected<HardwareSpec> builtinHardware(llvm::StringRef name, int cpuThreads = 0);

/// The names builtinHardware() accepts, comma separated, in a stable order.
llvm::StringRef builtinHardwareNames();

/// Reads a spec from the JSON file \p path (format in docs/HARDWARE.md). With
/// "base": "<built-in name>" every field is optional and overrides the base;
/// without it every field but "source" is required. Unknown fields, missing
/// fields, wrong types and out-of-range values are errors naming \p path and
/// the field (dotted for link fields, e.g. "intra_node.bandwidth"). A base of
/// "cpu" is calibrated for \p cpuThreads threads, as builtinHardware().
llvm::Expected<HardwareSpec> loadHardwareFile(llvm::StringRef path, int cpuThreads = 0);

/// loadHardwareFile() when \p nameOrPath ends in ".json", else
/// builtinHardware(); "cpu", or a file over it, is calibrated for
/// \p cpuThreads threads (0: every CPU).
llvm::Expected<HardwareSpec> resolveHardware(llvm::StringRef nameOrPath, int cpuThreads = 0);

/// Measures one CPU rank of this machine computing on \p threads threads
/// (0: every CPU), by timing pipec's own CPU kernels as a rank runs them
/// (compiler/cost/CpuCalibration.cpp; docs/HARDWARE.md "CPU calibration"):
/// the cost of one tiny node as launch overhead; the bandwidth and vector
/// FLOP rate fitted over the element-wise, softmax, normalization and
/// transpose kernels; the GEMM rate and per-GEMM cost fitted over
/// transformer-sized matrix products (sumsComputeAndMemory is set). The links are
/// loopback (memcpy bandwidth, 1 us latency, as shared-memory MPI) both inside
/// and between nodes. memoryBytes is the physical memory, devicesPerNode the
/// CPU count. Takes about two seconds.
llvm::Expected<HardwareSpec> calibrateCpu(int threads = 0);

/// \p spec, a rank of this machine's CPU (sharesHostCores), as it computes
/// when \p ranks ranks of \p threads threads each compute at once on
/// \p cpus CPUs: past the CPUs they take turns, so each runs at
/// cpus / (ranks x threads) of its calibrated rates (FLOP/s and bandwidth
/// times that share, per-node and per-GEMM costs over it). The spec as it
/// is when they fit, or for a device.
HardwareSpec sharedByRanks(HardwareSpec spec, int ranks, int threads, int cpus);

/// calibrateCpu(\p threads), cached as JSON in $PIPEC_CACHE_DIR, else
/// $XDG_CACHE_HOME/pipec, else $HOME/.cache/pipec (cpuCachePath()). A missing
/// or unreadable cache is recalibrated and rewritten; failing to write the
/// cache is not an error (the measured spec is still returned). A
/// calibration another process disturbed (calibrationDisturbed: the
/// calibrating thread ran less than 90% of the wall time) is cached marked
/// as such, never over a quiet one; it serves for
/// disturbedMeasurementSeconds (support/MachineCache.h), then the next call
/// measures again and replaces it.
llvm::Expected<HardwareSpec> cpuHardware(int threads = 0);

/// Measures again, whatever the cache holds, and replaces the cache unless
/// a disturbed measurement would replace a quiet one: when a run's step
/// departs from the plan's prediction.
llvm::Expected<HardwareSpec> recalibrateCpu(int threads = 0);

/// The cache file cpuHardware(\p threads) uses on this machine: named by a
/// hash of the CPU model, the CPU count, the BLAS build, the calibration's
/// version and \p threads; "" when no cache directory is configured.
std::string cpuCachePath(int threads = 0);

/// Writes \p spec as JSON that loadHardwareFile() reads back equal: each double
/// in the shortest form that parses back to it, keys in a fixed order.
/// Precondition: all numbers are finite.
void writeHardwareJson(const HardwareSpec &spec, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_HARDWARESPEC_H
