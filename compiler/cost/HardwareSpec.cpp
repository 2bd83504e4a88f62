//===- HardwareSpec.cpp - Built-in, file and calibrated hardware specs ---===//
//
// Datasheet numbers for the built-in GPUs, and the JSON reader and writer;
// the CPU calibration and its cache are in CpuCalibration.cpp.
// docs/HARDWARE.md cites every number.
//
//===----------------------------------------------------------------------===//
#include "compiler/cost/HardwareSpec.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

using namespace llvm;

namespace pipec {

double LinkSpec::transferTime(int64_t bytes) const {
  if (bytes <= 0)
    return 0;
  assert(bandwidth > 0 && "link without bandwidth");
  return latency + double(bytes) / bandwidth;
}

bool LinkSpec::operator==(const LinkSpec &o) const {
  return name == o.name && bandwidth == o.bandwidth && latency == o.latency;
}

bool HardwareSpec::operator==(const HardwareSpec &o) const {
  return name == o.name && peakFlopsF32 == o.peakFlopsF32 && peakFlopsBf16 == o.peakFlopsBf16 &&
         vectorFlops == o.vectorFlops && memoryBandwidth == o.memoryBandwidth &&
         memoryBytes == o.memoryBytes && launchOverhead == o.launchOverhead &&
         gemmOverhead == o.gemmOverhead && sumsComputeAndMemory == o.sumsComputeAndMemory &&
         intraNode == o.intraNode && interNode == o.interNode &&
         devicesPerNode == o.devicesPerNode && sharesHostCores == o.sharesHostCores &&
         source == o.source && calibrationCpuShare == o.calibrationCpuShare &&
         calibratedAt == o.calibratedAt;
}

namespace {

// NVLink latency: estimate from NCCL point-to-point small-message latency.
// InfiniBand NDR: 400 Gb/s per port = 50e9 B/s; latency is an estimate.
// Launch overhead: estimate of one CUDA kernel launch plus stream bookkeeping.
constexpr double nvlinkLatency = 2e-6;
constexpr double infinibandNdrBandwidth = 50e9;
constexpr double infinibandLatency = 5e-6;
constexpr double gpuLaunchOverhead = 4e-6;

HardwareSpec gpu(StringRef name, double f32, double bf16, double memBw, int64_t memBytes,
                 double nvlinkPerDirection, StringRef source) {
  HardwareSpec s;
  s.name = name.str();
  s.peakFlopsF32 = f32;
  s.peakFlopsBf16 = bf16;
  s.memoryBandwidth = memBw;
  s.memoryBytes = memBytes;
  s.launchOverhead = gpuLaunchOverhead;
  s.intraNode = {"nvlink", nvlinkPerDirection, nvlinkLatency};
  s.interNode = {"infiniband", infinibandNdrBandwidth, infinibandLatency};
  s.devicesPerNode = 8;
  s.source = source.str();
  return s;
}

// Memory sizes are the datasheets' decimal gigabytes (80 GB = 80e9 bytes),
// a little under what the devices hold, which leaves room for the CUDA context.
Optional<HardwareSpec> datasheetGpu(StringRef name) {
  if (name == "a100") // A100 80GB SXM: NVLink 3 is 600 GB/s total.
    return gpu(name, 19.5e12, 312e12, 2.0e12, 80'000'000'000, 300e9,
               "NVIDIA A100 datasheet (80GB SXM): 312 TFLOPS bf16 dense, 19.5 TFLOPS fp32, "
               "2039 GB/s HBM2e, NVLink 600 GB/s; latencies and launch overhead estimated");
  if (name == "h100") // H100 SXM: NVLink 4 is 900 GB/s total.
    return gpu(name, 67e12, 989e12, 3.35e12, 80'000'000'000, 450e9,
               "NVIDIA H100 datasheet (SXM): 989 TFLOPS bf16 dense, 67 TFLOPS fp32, "
               "3.35 TB/s HBM3, NVLink 900 GB/s; latencies and launch overhead estimated");
  if (name == "h200") // H200 SXM: H100 compute, HBM3e, NVLink 900 GB/s total.
    return gpu(name, 67e12, 989e12, 4.8e12, 141'000'000'000, 450e9,
               "NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 67 TFLOPS fp32, "
               "4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s; latencies and launch overhead estimated");
  return None;
}

//===-- JSON reader -------------------------------------------------------===//

std::string formatNumber(double d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", d);
  return buf;
}

// Reads the fields of one JSON object, keeping the first problem (which names
// the file and the dotted field); once there is one, later reads do nothing.
class FieldReader {
public:
  FieldReader(StringRef path, const json::Object &obj, StringRef prefix, bool allOptional)
      : path(path), obj(obj), prefix(prefix), allOptional(allOptional) {}

  void onlyKnown(ArrayRef<StringRef> known) {
    std::vector<StringRef> keys;
    for (const auto &kv : obj)
      keys.push_back(kv.first);
    llvm::sort(keys); // report the same key on every run
    for (StringRef key : keys)
      if (!llvm::is_contained(known, key))
        fail(key, "is not a known field");
  }
  void text(StringRef key, std::string &out, bool required = true) {
    if (const json::Value *v = find(key, required)) {
      if (Optional<StringRef> s = v->getAsString())
        out = s->str();
      else
        fail(key, "must be a string");
    }
  }
  /// A number > 0, or >= 0 when \p zeroOk.
  void number(StringRef key, double &out, bool zeroOk = false, bool required = true) {
    const json::Value *v = find(key, required);
    Optional<double> d = v ? v->getAsNumber() : None;
    if (v && !d)
      fail(key, "must be a number");
    else if (d && (*d < 0 || (*d == 0 && !zeroOk)))
      fail(key,
           (zeroOk ? "must not be negative, got " : "must be positive, got ") + formatNumber(*d));
    else if (d)
      out = *d;
  }
  /// An optional boolean.
  void flag(StringRef key, bool &out) {
    const json::Value *v = find(key, /*required=*/false);
    Optional<bool> b = v ? v->getAsBoolean() : None;
    if (v && !b)
      fail(key, "must be true or false");
    else if (b)
      out = *b;
  }
  /// An integer in [1, max].
  void count(StringRef key, int64_t &out, int64_t max) {
    const json::Value *v = find(key);
    Optional<int64_t> i = v ? v->getAsInteger() : None;
    if (v && !i)
      fail(key, "must be an integer");
    else if (i && (*i <= 0 || *i > max))
      fail(key, "must be in [1, " + Twine(max) + "], got " + Twine(*i));
    else if (i)
      out = *i;
  }
  const json::Object *object(StringRef key) {
    const json::Value *v = find(key);
    if (v && !v->getAsObject())
      fail(key, "must be an object");
    return v ? v->getAsObject() : nullptr;
  }
  Error finish() {
    return problem.empty() ? Error::success()
                           : createStringError(inconvertibleErrorCode(), problem);
  }

private:
  const json::Value *find(StringRef key, bool required = true) {
    if (!problem.empty())
      return nullptr;
    const json::Value *v = obj.get(key);
    if (!v && required && !allOptional)
      fail(key, "is missing");
    return v;
  }
  void fail(StringRef key, const Twine &what) {
    if (problem.empty())
      problem = (path + ": field '" + prefix + key + "' " + what).str();
  }

  StringRef path;
  const json::Object &obj;
  std::string prefix;
  bool allOptional;
  std::string problem;
};

// Over a base every field is optional, link fields included.
Error readSpec(StringRef path, const json::Object &obj, bool hasBase, HardwareSpec &spec) {
  FieldReader r(path, obj, "", hasBase);
  r.onlyKnown({"name", "base", "peak_flops_fp32", "peak_flops_bf16", "vector_flops",
               "memory_bandwidth", "memory_bytes", "launch_overhead_s", "gemm_overhead_s",
               "sum_compute_and_memory", "devices_per_node", "shares_host_cores", "intra_node",
               "inter_node", "source", "calibration_cpu_share", "calibrated_at"});
  r.text("name", spec.name);
  r.number("peak_flops_fp32", spec.peakFlopsF32);
  r.number("peak_flops_bf16", spec.peakFlopsBf16);
  r.number("vector_flops", spec.vectorFlops, /*zeroOk=*/true, /*required=*/false);
  r.number("memory_bandwidth", spec.memoryBandwidth);
  r.count("memory_bytes", spec.memoryBytes, std::numeric_limits<int64_t>::max());
  r.number("launch_overhead_s", spec.launchOverhead, /*zeroOk=*/true);
  // Optional even without a base: specs written before it existed had none.
  r.number("gemm_overhead_s", spec.gemmOverhead, /*zeroOk=*/true, /*required=*/false);
  r.flag("sum_compute_and_memory", spec.sumsComputeAndMemory);
  int64_t devices = spec.devicesPerNode;
  r.count("devices_per_node", devices, std::numeric_limits<int>::max());
  spec.devicesPerNode = int(devices);
  r.flag("shares_host_cores", spec.sharesHostCores);
  std::pair<StringRef, LinkSpec *> links[] = {{"intra_node", &spec.intraNode},
                                              {"inter_node", &spec.interNode}};
  for (auto [key, link] : links) {
    const json::Object *linkObj = r.object(key);
    if (!linkObj)
      continue;
    FieldReader l(path, *linkObj, (key + ".").str(), hasBase);
    l.onlyKnown({"name", "bandwidth", "latency_s"});
    l.text("name", link->name);
    l.number("bandwidth", link->bandwidth);
    l.number("latency_s", link->latency, /*zeroOk=*/true);
    if (Error e = l.finish())
      return e;
  }
  // Optional even without a base: loadHardwareFile() defaults it to the path.
  r.text("source", spec.source, /*required=*/false);
  r.number("calibration_cpu_share", spec.calibrationCpuShare, /*zeroOk=*/true,
           /*required=*/false);
  r.text("calibrated_at", spec.calibratedAt, /*required=*/false);
  return r.finish();
}

} // namespace

StringRef builtinHardwareNames() { return "a100, h100, h200, cpu"; }

Expected<HardwareSpec> builtinHardware(StringRef name, int cpuThreads) {
  std::string lower = name.lower();
  if (Optional<HardwareSpec> spec = datasheetGpu(lower))
    return *spec;
  if (lower == "cpu")
    return cpuHardware(cpuThreads);
  return createStringError(inconvertibleErrorCode(), "unknown hardware '" + name +
                                                         "' (known: " + builtinHardwareNames() +
                                                         ", or a path ending in .json)");
}

Expected<HardwareSpec> loadHardwareFile(StringRef path, int cpuThreads) {
  ErrorOr<std::unique_ptr<MemoryBuffer>> buf = MemoryBuffer::getFile(path, /*IsText=*/true);
  if (!buf)
    return createStringError(buf.getError(), path + ": cannot read: " + buf.getError().message());
  Expected<json::Value> root = json::parse((*buf)->getBuffer());
  if (!root)
    return createStringError(inconvertibleErrorCode(),
                             path + ": not valid JSON: " + toString(root.takeError()));
  const json::Object *obj = root->getAsObject();
  if (!obj)
    return createStringError(inconvertibleErrorCode(), path + ": expected a JSON object");

  HardwareSpec spec;
  bool hasBase = obj->get("base") != nullptr;
  if (hasBase) {
    Optional<StringRef> base = obj->getString("base");
    Expected<HardwareSpec> baseSpec =
        base ? builtinHardware(*base, cpuThreads)
             : createStringError(inconvertibleErrorCode(), "must be a string");
    if (!baseSpec)
      return createStringError(inconvertibleErrorCode(),
                               path + ": field 'base' " + toString(baseSpec.takeError()));
    spec = std::move(*baseSpec);
    spec.source = ("file " + path + " over " + spec.name + ": " + spec.source).str();
  } else {
    spec.source = ("file " + path).str();
  }
  if (Error e = readSpec(path, *obj, hasBase, spec))
    return e;
  return spec;
}

Expected<HardwareSpec> resolveHardware(StringRef nameOrPath, int cpuThreads) {
  if (nameOrPath.endswith(".json"))
    return loadHardwareFile(nameOrPath, cpuThreads);
  return builtinHardware(nameOrPath, cpuThreads);
}

void writeHardwareJson(const HardwareSpec &spec, raw_ostream &os) {
  json::OStream j(os, /*IndentSize=*/2);
  // llvm::json prints every double with 17 digits (1e-6 as 9.9999999999999995e-07);
  // the shortest form that parses back to the same double reads better.
  auto number = [&](StringRef key, double d) {
    assert(std::isfinite(d) && "JSON has no infinities");
    char buf[32];
    for (int digits = 1; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof(buf), "%.*g", digits, d);
      if (std::strtod(buf, nullptr) == d)
        break;
    }
    j.attributeBegin(key);
    j.rawValue(buf);
    j.attributeEnd();
  };
  auto link = [&](StringRef key, const LinkSpec &l) {
    j.attributeObject(key, [&] {
      j.attribute("name", l.name);
      number("bandwidth", l.bandwidth);
      number("latency_s", l.latency);
    });
  };
  j.object([&] {
    j.attribute("name", spec.name);
    number("peak_flops_fp32", spec.peakFlopsF32);
    number("peak_flops_bf16", spec.peakFlopsBf16);
    number("vector_flops", spec.vectorFlops);
    number("memory_bandwidth", spec.memoryBandwidth);
    j.attribute("memory_bytes", spec.memoryBytes);
    number("launch_overhead_s", spec.launchOverhead);
    number("gemm_overhead_s", spec.gemmOverhead);
    j.attribute("sum_compute_and_memory", spec.sumsComputeAndMemory);
    j.attribute("devices_per_node", int64_t(spec.devicesPerNode));
    j.attribute("shares_host_cores", spec.sharesHostCores);
    link("intra_node", spec.intraNode);
    link("inter_node", spec.interNode);
    j.attribute("source", spec.source);
    if (spec.calibrationCpuShare > 0)
      number("calibration_cpu_share", spec.calibrationCpuShare);
    if (!spec.calibratedAt.empty())
      j.attribute("calibrated_at", spec.calibratedAt);
  });
  os << "\n";
}

HardwareSpec sharedByRanks(HardwareSpec spec, int ranks, int threads, int cpus) {
  int64_t wanted = int64_t(std::max(1, ranks)) * std::max(1, threads);
  if (!spec.sharesHostCores || cpus < 1 || wanted <= cpus)
    return spec;
  double share = double(cpus) / double(wanted);
  spec.peakFlopsF32 *= share;
  spec.peakFlopsBf16 *= share;
  spec.vectorFlops *= share;
  spec.memoryBandwidth *= share;
  spec.launchOverhead /= share;
  spec.gemmOverhead /= share;
  spec.source += formatv("; {0} ranks of {1} thread(s) computing at once on {2} CPUs take turns: "
                         "each at {3:f2} of these rates",
                         ranks, threads, cpus, share)
                     .str();
  return spec;
}

} // namespace pipec
