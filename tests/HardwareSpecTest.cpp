//===- HardwareSpecTest.cpp - Built-in, JSON and calibrated specs --------===//
#include "TestUtil.h"

#include "compiler/cost/HardwareSpec.h"
#include "driver/CpuKernels.h"
#include "support/MachineCache.h"
#include "support/Parallel.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

using namespace llvm;
using namespace pipec;

namespace {

std::string errorText(Error e) { return toString(std::move(e)); }

/// A file under the system temp dir holding \p text; removed on destruction.
class TempJson {
public:
  explicit TempJson(StringRef text) {
    int fd;
    EXPECT_FALSE(sys::fs::createTemporaryFile("pipec-hw", "json", fd, path));
    raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << text;
  }
  ~TempJson() { sys::fs::remove(path); }
  StringRef str() const { return path; }

private:
  SmallString<128> path;
};

std::string toJson(const HardwareSpec &spec) {
  std::string text;
  raw_string_ostream os(text);
  writeHardwareJson(spec, os);
  return os.str();
}

/// Loads \p text and returns the error message (empty on success).
std::string loadError(const TempJson &file) {
  Expected<HardwareSpec> spec = loadHardwareFile(file.str());
  return spec ? "" : errorText(spec.takeError());
}

const char *fullSpec = R"({
  "name": "test", "peak_flops_fp32": 1e12, "peak_flops_bf16": 2e12,
  "memory_bandwidth": 3e11, "memory_bytes": 16000000000, "launch_overhead_s": 5e-6,
  "devices_per_node": 4,
  "intra_node": {"name": "pcie", "bandwidth": 25e9, "latency_s": 3e-6},
  "inter_node": {"name": "infiniband", "bandwidth": 12.5e9, "latency_s": 6e-6}
})";

/// Expects a device's datasheet numbers: peak FLOP/s at bf16 and fp32,
/// memory bandwidth and bytes, and the links within and between nodes.
void expectDatasheet(const HardwareSpec &spec, double bf16, double f32, double bandwidth,
                     int64_t bytes, const LinkSpec &intra, const LinkSpec &inter) {
  SCOPED_TRACE(spec.name);
  EXPECT_EQ(spec.peakFlopsBf16, bf16);
  EXPECT_EQ(spec.peakFlopsF32, f32);
  EXPECT_EQ(spec.memoryBandwidth, bandwidth);
  EXPECT_EQ(spec.memoryBytes, bytes);
  EXPECT_EQ(spec.intraNode, intra);
  EXPECT_EQ(spec.interNode, inter);
}

TEST(HardwareSpec, DatasheetNumbers) {
  Expected<HardwareSpec> a100 = builtinHardware("a100");
  ASSERT_TRUE(bool(a100)) << errorText(a100.takeError());
  expectDatasheet(*a100, 312e12, 19.5e12, 2.0e12, 80'000'000'000, {"nvlink", 300e9, 2e-6},
                  {"infiniband", 50e9, 5e-6});
  EXPECT_EQ(a100->launchOverhead, 4e-6);
  EXPECT_EQ(a100->devicesPerNode, 8);
  EXPECT_EQ(a100->peakFlops(true), 312e12);
  EXPECT_EQ(a100->peakFlops(false), 19.5e12);

  Expected<HardwareSpec> h100 = builtinHardware("h100");
  ASSERT_TRUE(bool(h100));
  expectDatasheet(*h100, 989e12, 67e12, 3.35e12, 80'000'000'000, {"nvlink", 450e9, 2e-6},
                  {"infiniband", 50e9, 5e-6});

  Expected<HardwareSpec> h200 = builtinHardware("H200");
  ASSERT_TRUE(bool(h200));
  EXPECT_EQ(h200->name, "h200");
  EXPECT_EQ(h200->peakFlopsBf16, 989e12);
  EXPECT_EQ(h200->peakFlopsF32, 67e12);
  EXPECT_EQ(h200->memoryBandwidth, 4.8e12);
  EXPECT_EQ(h200->memoryBytes, 141'000'000'000);
  EXPECT_EQ(h200->intraNode.bandwidth, 450e9);
  EXPECT_FALSE(h200->source.empty());
}

TEST(HardwareSpec, UnknownNameListsKnownOnes) {
  Expected<HardwareSpec> spec = resolveHardware("v100");
  ASSERT_FALSE(bool(spec));
  std::string msg = errorText(spec.takeError());
  EXPECT_NE(msg.find("'v100'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a100, h100, h200, cpu"), std::string::npos) << msg;
}

TEST(HardwareSpec, TransferTime) {
  LinkSpec link{"nvlink", 100e9, 2e-6};
  EXPECT_EQ(link.transferTime(0), 0);
  EXPECT_DOUBLE_EQ(link.transferTime(1'000'000'000), 2e-6 + 0.01);
  EXPECT_DOUBLE_EQ(link.transferTime(1), 2e-6 + 1e-11);
}

TEST(HardwareSpec, JsonIsShortAndStable) {
  Expected<HardwareSpec> a100 = builtinHardware("a100");
  ASSERT_TRUE(bool(a100));
  std::string text = toJson(*a100);
  EXPECT_TRUE(StringRef(text).startswith(
      "{\n  \"name\": \"a100\",\n  \"peak_flops_fp32\": 1.95e+13,\n  \"peak_flops_bf16\": "
      "3.12e+14,\n  \"vector_flops\": 0,\n"
      "  \"memory_bandwidth\": 2e+12,\n  \"memory_bytes\": 80000000000,\n"
      "  \"launch_overhead_s\": 4e-06,\n  \"gemm_overhead_s\": 0,\n"
      "  \"sum_compute_and_memory\": false,\n  \"devices_per_node\": 8,\n"))
      << text;
  EXPECT_NE(text.find("\"latency_s\": 2e-06"), std::string::npos) << text;
}

TEST(HardwareSpec, JsonRoundTrip) {
  for (StringRef name : {"a100", "h100", "h200"}) {
    Expected<HardwareSpec> spec = builtinHardware(name);
    ASSERT_TRUE(bool(spec));
    spec->launchOverhead = 1.0 / 3; // a double that needs all 17 digits
    spec->gemmOverhead = 2.0 / 3;
    spec->vectorFlops = 1e12 / 7;
    spec->sumsComputeAndMemory = true;
    TempJson file(toJson(*spec));
    Expected<HardwareSpec> back = resolveHardware(file.str());
    ASSERT_TRUE(bool(back)) << errorText(back.takeError());
    EXPECT_EQ(*back, *spec) << toJson(*back);
  }
}

TEST(HardwareSpec, FullFileWithoutSource) {
  TempJson file(fullSpec);
  Expected<HardwareSpec> spec = loadHardwareFile(file.str());
  ASSERT_TRUE(bool(spec)) << errorText(spec.takeError());
  EXPECT_EQ(spec->name, "test");
  EXPECT_EQ(spec->memoryBytes, 16'000'000'000);
  EXPECT_EQ(spec->devicesPerNode, 4);
  EXPECT_EQ(spec->interNode, (LinkSpec{"infiniband", 12.5e9, 6e-6}));
  EXPECT_EQ(spec->source, ("file " + file.str()).str());
  // Optional: files written before they existed have neither.
  EXPECT_EQ(spec->gemmOverhead, 0);
  EXPECT_EQ(spec->vectorFlops, 0);
  EXPECT_EQ(spec->flopsFor(0, false), 1e12); // no vector rate: the peak
  EXPECT_FALSE(spec->sumsComputeAndMemory);
}

TEST(HardwareSpec, BaseOverride) {
  TempJson file(R"({"base": "h100", "name": "h100-ib200",
                    "inter_node": {"bandwidth": 25e9}, "devices_per_node": 4})");
  Expected<HardwareSpec> spec = loadHardwareFile(file.str());
  ASSERT_TRUE(bool(spec)) << errorText(spec.takeError());
  Expected<HardwareSpec> h100 = builtinHardware("h100");
  ASSERT_TRUE(bool(h100));
  EXPECT_EQ(spec->name, "h100-ib200");
  EXPECT_EQ(spec->interNode, (LinkSpec{"infiniband", 25e9, 5e-6}));
  EXPECT_EQ(spec->devicesPerNode, 4);
  EXPECT_EQ(spec->peakFlopsBf16, h100->peakFlopsBf16);
  EXPECT_EQ(spec->intraNode, h100->intraNode);
  EXPECT_NE(spec->source.find("over h100"), std::string::npos) << spec->source;
}

/// The error of loading fullSpec with its first \p from replaced by \p to,
/// which must name the file.
std::string errorOfEditedSpec(const std::string &from, const std::string &to) {
  std::string text = fullSpec;
  text.replace(text.find(from), from.size(), to);
  TempJson file(text);
  std::string msg = loadError(file);
  EXPECT_NE(msg.find(file.str().str()), std::string::npos) << msg;
  return msg;
}

TEST(HardwareSpec, MissingField) {
  std::string msg = errorOfEditedSpec("\"peak_flops_bf16\": 2e12,", "");
  EXPECT_NE(msg.find("'peak_flops_bf16' is missing"), std::string::npos) << msg;

  TempJson nested(R"({"name": "x", "peak_flops_fp32": 1, "peak_flops_bf16": 1,
    "memory_bandwidth": 1, "memory_bytes": 1, "launch_overhead_s": 0, "devices_per_node": 1,
    "intra_node": {"name": "pcie", "bandwidth": 1}, "inter_node": {}})");
  msg = loadError(nested);
  EXPECT_NE(msg.find("'intra_node.latency_s' is missing"), std::string::npos) << msg;
}

TEST(HardwareSpec, NegativeBandwidth) {
  std::string msg = errorOfEditedSpec("25e9", "-25e9");
  EXPECT_NE(msg.find("'intra_node.bandwidth' must be positive, got -2.5e+10"), std::string::npos)
      << msg;
}

TEST(HardwareSpec, WrongTypesAndUnknownFields) {
  TempJson wrongType(R"({"base": "a100", "memory_bytes": "80GB"})");
  EXPECT_NE(loadError(wrongType).find("'memory_bytes' must be an integer"), std::string::npos)
      << loadError(wrongType);
  TempJson typo(R"({"base": "a100", "peak_flop_bf16": 1e15})");
  EXPECT_NE(loadError(typo).find("'peak_flop_bf16' is not a known field"), std::string::npos)
      << loadError(typo);
  TempJson notFlag(R"({"base": "a100", "sum_compute_and_memory": 1})");
  EXPECT_NE(loadError(notFlag).find("'sum_compute_and_memory' must be true or false"),
            std::string::npos)
      << loadError(notFlag);
  TempJson negative(R"({"base": "a100", "gemm_overhead_s": -1e-6})");
  EXPECT_NE(loadError(negative).find("'gemm_overhead_s' must not be negative"), std::string::npos)
      << loadError(negative);
  TempJson badBase(R"({"base": "tpu"})");
  EXPECT_NE(loadError(badBase).find("'base' unknown hardware 'tpu'"), std::string::npos)
      << loadError(badBase);
}

TEST(HardwareSpec, NotJson) {
  TempJson file("name = a100\n");
  std::string msg = loadError(file);
  EXPECT_NE(msg.find(file.str().str()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  Expected<HardwareSpec> missing = resolveHardware("/nonexistent/pipec-hw.json");
  ASSERT_FALSE(bool(missing));
  EXPECT_NE(errorText(missing.takeError()).find("/nonexistent/pipec-hw.json: cannot read"),
            std::string::npos);
}

TEST(HardwareSpec, CalibratedCpuIsCached) {
  wireCpuKernels(); // as compileModel does: the calibration times the CPU kernels
  SmallString<128> dir;
  ASSERT_FALSE(sys::fs::createUniqueDirectory("pipec-cache", dir));
  MachineSettings saved = machineSettings(), here = saved;
  here.cacheDir = std::string(dir);
  setMachineSettings(here);

  // One file per share of the cores: a rank on one thread is another device.
  std::string path = cpuCachePath(1);
  EXPECT_TRUE(StringRef(path).startswith(dir)) << path;
  EXPECT_TRUE(StringRef(path).endswith("-1t.json")) << path;
  EXPECT_NE(cpuCachePath(2), path);
  EXPECT_FALSE(sys::fs::exists(path));

  // A calibration another process disturbs is cached marked (the test
  // suite may run beside it): a few tries for a quiet one, which replaces it.
  Expected<HardwareSpec> cpu = cpuHardware(1);
  for (int attempt = 0; attempt < 4 && cpu && cpu->calibrationDisturbed(); ++attempt)
    cpu = recalibrateCpu(1);
  ASSERT_TRUE(bool(cpu)) << errorText(cpu.takeError());
  if (cpu->calibrationDisturbed())
    GTEST_SKIP() << "every calibration was disturbed by another process (its thread ran "
                 << cpu->calibrationCpuShare << " of the wall time)";
  EXPECT_EQ(cpu->name, "cpu");
  EXPECT_GT(cpu->peakFlopsF32, 1e9);
  EXPECT_LT(cpu->peakFlopsF32, 1e13);
  EXPECT_GT(cpu->memoryBandwidth, 1e8);
  EXPECT_LT(cpu->memoryBandwidth, 1e12);
  EXPECT_GT(cpu->launchOverhead, 0);
  EXPECT_LT(cpu->launchOverhead, 1e-3);
  EXPECT_GE(cpu->gemmOverhead, 0);
  EXPECT_GE(cpu->vectorFlops, 0);
  EXPECT_LE(cpu->vectorFlops, cpu->peakFlopsF32 * 10);
  EXPECT_LT(cpu->gemmOverhead, 1e-2);
  EXPECT_TRUE(cpu->sumsComputeAndMemory);
  EXPECT_GT(cpu->memoryBytes, 0);
  EXPECT_NE(cpu->source.find("on 1 thread"), std::string::npos) << cpu->source;
  EXPECT_EQ(cpu->intraNode.name, "loopback");
  EXPECT_EQ(cpu->intraNode.latency, 1e-6);
  EXPECT_GT(cpu->intraNode.bandwidth, 1e8);
  // The memory bandwidth is a memcpy's, reading and writing each byte.
  EXPECT_DOUBLE_EQ(cpu->memoryBandwidth, 2 * cpu->intraNode.bandwidth);

  // Written, and read back equal.
  ASSERT_TRUE(sys::fs::exists(path));
  Expected<HardwareSpec> fromFile = loadHardwareFile(path);
  ASSERT_TRUE(bool(fromFile)) << errorText(fromFile.takeError());
  EXPECT_EQ(*fromFile, *cpu);
  Expected<HardwareSpec> again = cpuHardware(1);
  ASSERT_TRUE(bool(again));
  EXPECT_EQ(*again, *cpu);

  // Used: an edited cache is what cpuHardware() returns.
  HardwareSpec edited = *cpu;
  edited.peakFlopsF32 = 123e9;
  {
    std::error_code ec;
    raw_fd_ostream os(path, ec);
    ASSERT_FALSE(ec);
    writeHardwareJson(edited, os);
  }
  Expected<HardwareSpec> cached = cpuHardware(1);
  ASSERT_TRUE(bool(cached));
  EXPECT_EQ(cached->peakFlopsF32, 123e9);

  // A file over "cpu" starts from the calibration for the threads asked for.
  TempJson over(R"({"base": "cpu", "name": "cpu-fast", "memory_bandwidth": 1e12})");
  Expected<HardwareSpec> overOne = resolveHardware(over.str(), 1);
  ASSERT_TRUE(bool(overOne)) << errorText(overOne.takeError());
  EXPECT_EQ(overOne->name, "cpu-fast");
  EXPECT_EQ(overOne->memoryBandwidth, 1e12);
  EXPECT_EQ(overOne->peakFlopsF32, 123e9); // the edited one-thread cache
  EXPECT_TRUE(overOne->sumsComputeAndMemory);

  // A damaged cache is measured again and rewritten.
  {
    std::error_code ec;
    raw_fd_ostream os(path, ec);
    os << "{";
  }
  Expected<HardwareSpec> remeasured = cpuHardware(1);
  ASSERT_TRUE(bool(remeasured));
  EXPECT_GT(remeasured->peakFlopsF32, 1e9);
  // Rewritten, marked disturbed where it was.
  Expected<HardwareSpec> rewritten = loadHardwareFile(path);
  ASSERT_TRUE(bool(rewritten)) << errorText(rewritten.takeError());
  EXPECT_EQ(*rewritten, *remeasured);

  setMachineSettings(saved);
  sys::fs::remove_directories(dir);
}

/// Points the cache folder (MachineSettings::cacheDir) at a fresh
/// directory while it lives.
class CacheDir {
public:
  CacheDir() : saved(machineSettings()) {
    EXPECT_FALSE(sys::fs::createUniqueDirectory("pipec-cache", dir));
    MachineSettings here = saved;
    here.cacheDir = std::string(dir);
    setMachineSettings(here);
  }
  ~CacheDir() {
    setMachineSettings(saved);
    sys::fs::remove_directories(dir);
  }
  std::string str() const { return std::string(dir); }

private:
  SmallString<128> dir;
  MachineSettings saved;
};

/// Sets \p path's modification time \p seconds into the past.
void ageFile(const std::string &path, int seconds) {
  auto old = std::chrono::system_clock::now() - std::chrono::seconds(seconds);
  int fd = -1;
  ASSERT_FALSE(sys::fs::openFileForWrite(path, fd, sys::fs::CD_OpenExisting, sys::fs::OF_Append));
  ASSERT_FALSE(sys::fs::setLastAccessAndModificationTime(
      fd, sys::toTimePoint(std::chrono::system_clock::to_time_t(old))));
  sys::Process::SafelyCloseFileDescriptor(fd);
}

/// A calibration taken while other threads load every core (twice over) is
/// returned, marked disturbed, and not cached; one on the machine as it is
/// then is cached exactly when it was not disturbed, its conditions kept.
TEST(HardwareSpec, DisturbedCalibrationIsMarkedAndReplaced) {
  wireCpuKernels();
  CacheDir cache;
  std::string path = cpuCachePath(1);
  // \p measure with twice as many busy threads as cores beside it.
  auto underLoad = [](auto measure) {
    std::atomic<bool> stop{false};
    std::vector<std::thread> busy;
    unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < 2 * cpus; ++i)
      busy.emplace_back([&] {
        volatile uint64_t x = 0;
        while (!stop.load(std::memory_order_relaxed))
          x = x + 1;
      });
    Expected<HardwareSpec> spec = measure();
    stop = true;
    for (std::thread &t : busy)
      t.join();
    return spec;
  };
  Expected<HardwareSpec> loaded = underLoad([] { return cpuHardware(1); });
  ASSERT_TRUE(bool(loaded)) << errorText(loaded.takeError());
  EXPECT_GT(loaded->calibrationCpuShare, 0);
  EXPECT_LT(loaded->calibrationCpuShare, HardwareSpec::minCalibrationCpuShare);
  EXPECT_TRUE(loaded->calibrationDisturbed());
  EXPECT_FALSE(loaded->calibratedAt.empty());
  // Cached marked: the next compile uses it, and is told it was disturbed.
  ASSERT_TRUE(sys::fs::exists(path));
  Expected<HardwareSpec> again = cpuHardware(1);
  ASSERT_TRUE(bool(again)) << errorText(again.takeError());
  EXPECT_TRUE(again->calibrationDisturbed());
  EXPECT_EQ(again->calibratedAt, loaded->calibratedAt);

  // Once it has served its time, a quiet measurement replaces it.
  ageFile(path, static_cast<int>(disturbedMeasurementSeconds) + 10);
  Expected<HardwareSpec> quiet = cpuHardware(1);
  ASSERT_TRUE(bool(quiet)) << errorText(quiet.takeError());
  EXPECT_GT(quiet->calibrationCpuShare, 0);
  EXPECT_NE(quiet->calibratedAt, loaded->calibratedAt) << "measured again";
  Expected<HardwareSpec> fromFile = loadHardwareFile(path);
  ASSERT_TRUE(bool(fromFile)) << errorText(fromFile.takeError());
  EXPECT_EQ(fromFile->calibrationCpuShare, quiet->calibrationCpuShare);
  EXPECT_EQ(fromFile->calibratedAt, quiet->calibratedAt);
  if (quiet->calibrationDisturbed())
    GTEST_SKIP() << "this machine was busy for the quiet measurement too";
  // A disturbed figure never replaces a quiet one.
  Expected<HardwareSpec> busy = underLoad([] { return recalibrateCpu(1); });
  ASSERT_TRUE(bool(busy)) << errorText(busy.takeError());
  EXPECT_TRUE(busy->calibrationDisturbed());
  Expected<HardwareSpec> kept = cpuHardware(1);
  ASSERT_TRUE(bool(kept)) << errorText(kept.takeError());
  EXPECT_EQ(kept->calibratedAt, quiet->calibratedAt);
}

/// `pipec run` of a plan whose step departs from its prediction by more than
/// 2x measures the CPU again, once per plan, and says so.
TEST(HardwareSpec, RunFarFromItsPredictionMeasuresAgain) {
  wireCpuKernels();
  CacheDir cache;
  pipec::test::TempDir dir;
  const std::string pipecBinary = std::string(PIPEC_BINARY_DIR) + "/bin/pipec";
  // Threads per rank as a one-rank plan on this machine gets them.
  int threads = defaultThreadsPerRank(1);
  Expected<HardwareSpec> real = cpuHardware(threads);
  ASSERT_TRUE(bool(real)) << errorText(real.takeError());
  HardwareSpec slow = *real;
  slow.launchOverhead *= 50; // every node predicted 50x its dispatch
  slow.calibrationCpuShare = 1;
  {
    std::error_code ec;
    raw_fd_ostream os(cpuCachePath(threads), ec);
    ASSERT_FALSE(ec);
    writeHardwareJson(slow, os);
  }
  std::string model = dir.path("mlp.onnx"), plan = dir.path("mlp.plan"), out;
  std::string env = "PIPEC_CACHE_DIR=" + cache.str() + " ";
  ASSERT_EQ(pipec::test::runCommand(
                env + pipecBinary + " model mlp --layers 200 --hidden 8 -o " + model, out),
            0)
      << out;
  ASSERT_EQ(pipec::test::runCommand(env + pipecBinary + " compile " + model +
                                        " --mode infer --stages 1 --microbatches 1 --batch 1 "
                                        "--hardware cpu -o " +
                                        plan,
                                    out),
            0)
      << out;
  ASSERT_EQ(pipec::test::runCommand(env + pipecBinary + " run " + plan + " --steps 20", out), 0)
      << out;
  EXPECT_NE(out.find("x the prediction; measured the CPU again ("), std::string::npos) << out;
  Expected<HardwareSpec> after = loadHardwareFile(cpuCachePath(threads));
  ASSERT_TRUE(bool(after)) << errorText(after.takeError());
  bool replaced = out.find(", cached: compile again to predict with it") != std::string::npos;
  EXPECT_EQ(after->launchOverhead != slow.launchOverhead, replaced) << out;
  if (replaced) {
    ASSERT_EQ(pipec::test::runCommand(env + pipecBinary + " run " + plan + " --steps 20", out), 0)
        << out;
    EXPECT_NE(out.find("the calibration was measured again after this plan was compiled"),
              std::string::npos)
        << out;
  }
}

} // namespace

/// The rules every once-per-machine measurement keeps (the BLAS's choice and
/// the few-row loops'): a quiet figure is read back and never replaced; a
/// disturbed one is cached marked, serves disturbedMeasurementSeconds, then
/// is measured again; a file its reader rejects is measured again.
TEST(MachineCache, CachedMeasurementKeepsQuietFiguresAndRetriesDisturbedOnes) {
  CacheDir cache;
  int measured = 0;
  Measurement next{"rate 1\n", /*disturbed=*/true};
  auto measure = [&]() -> std::optional<Measurement> {
    ++measured;
    return next;
  };
  auto valid = [](StringRef text) { return text.startswith("rate "); };
  auto get = [&] { return cachedMeasurement("probe", "this cpu", measure, valid); };

  std::optional<Measurement> first = get();
  ASSERT_TRUE(first);
  EXPECT_TRUE(first->disturbed);
  EXPECT_EQ(measured, 1);
  std::string path;
  std::error_code ec;
  for (sys::fs::directory_iterator it(cache.str(), ec), end; it != end && !ec; it.increment(ec))
    if (sys::path::filename(it->path()).startswith("probe-"))
      path = it->path();
  ASSERT_FALSE(path.empty());
  // Marked in the file, the mark not in the text read back.
  std::optional<Measurement> second = get();
  ASSERT_TRUE(second);
  EXPECT_EQ(measured, 1) << "a young disturbed figure serves";
  EXPECT_TRUE(second->disturbed);
  EXPECT_EQ(second->text, "rate 1\n");

  // Served its time: measured again, quiet now.
  ageFile(path, static_cast<int>(disturbedMeasurementSeconds) + 10);
  next = {"rate 2\n", false};
  std::optional<Measurement> third = get();
  ASSERT_TRUE(third);
  EXPECT_EQ(measured, 2);
  EXPECT_FALSE(third->disturbed);
  EXPECT_EQ(third->text, "rate 2\n");

  // A quiet figure is never replaced, however old.
  ageFile(path, 10 * static_cast<int>(disturbedMeasurementSeconds));
  next = {"rate 3\n", true};
  std::optional<Measurement> fourth = get();
  ASSERT_TRUE(fourth);
  EXPECT_EQ(measured, 2);
  EXPECT_EQ(fourth->text, "rate 2\n");

  // A file the reader rejects is measured again and rewritten.
  ASSERT_TRUE(writeCacheFile(path, "garbage\n"));
  next = {"rate 4\n", false};
  std::optional<Measurement> fifth = get();
  ASSERT_TRUE(fifth);
  EXPECT_EQ(measured, 3);
  EXPECT_EQ(fifth->text, "rate 4\n");
  EXPECT_EQ(get()->text, "rate 4\n");
  EXPECT_EQ(measured, 3);
}

// Ranks of this machine past its CPUs take turns: each computes at the share
// of the CPUs it gets. A device, or ranks that fit, keep their rates.
TEST(HardwareSpec, RanksPastTheCpusShareThem) {
  HardwareSpec cpu;
  cpu.name = "cpu";
  cpu.sharesHostCores = true;
  cpu.peakFlopsF32 = cpu.peakFlopsBf16 = 100e9;
  cpu.vectorFlops = 20e9;
  cpu.memoryBandwidth = 10e9;
  cpu.launchOverhead = 1e-6;
  cpu.gemmOverhead = 4e-6;
  HardwareSpec shared = sharedByRanks(cpu, 4, 1, 2);
  EXPECT_DOUBLE_EQ(shared.peakFlopsF32, 50e9);
  EXPECT_DOUBLE_EQ(shared.peakFlopsBf16, 50e9);
  EXPECT_DOUBLE_EQ(shared.vectorFlops, 10e9);
  EXPECT_DOUBLE_EQ(shared.memoryBandwidth, 5e9);
  EXPECT_DOUBLE_EQ(shared.launchOverhead, 2e-6);
  EXPECT_DOUBLE_EQ(shared.gemmOverhead, 8e-6);
  EXPECT_NE(shared.source.find("4 ranks of 1 thread(s) computing at once on 2 CPUs take turns"),
            std::string::npos)
      << shared.source;
  EXPECT_EQ(sharedByRanks(cpu, 2, 1, 2), cpu);
  EXPECT_EQ(sharedByRanks(cpu, 1, 2, 2), cpu);
  HardwareSpec device = cpu;
  device.sharesHostCores = false;
  EXPECT_EQ(sharedByRanks(device, 8, 1, 2), device);
}
