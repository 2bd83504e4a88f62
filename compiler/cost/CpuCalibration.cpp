//===- CpuCalibration.cpp - The `cpu` spec, measured on pipec's kernels --===//
//
// A CPU rank's numbers come from timing the kernels it runs (cpu::runOp, the
// CPU backend's entry point) under the threads the rank would have: OpenBLAS
// on one thread and the rank's loop pool on the rest, as `pipec run` sets
// them (support/Parallel.h). Each node is built twice, as an ONNX node for
// the kernel and as an op of a Graph for the cost rules, so its FLOPs and
// bytes are the cost model's own. Measured, in this order:
//
//  - a 64 MiB memcpy: the memory bandwidth (read plus write);
//  - one tiny node: the dispatch cost added to every op;
//  - the element-wise, softmax, normalization and transpose kernels on
//    transformer-sized activations, fitted as
//      time - dispatch - bytes / bandwidth = FLOPs / vector rate;
//  - matrix products: MatMul on the same blocks' shapes, with weights and
//    activations that do not fit in the caches (a step reads each weight once
//    per pass), fitted by least squares on relative error as
//      time - dispatch - bytes / bandwidth = FLOPs / peak + per-GEMM cost,
//    the sum the cost model charges a CPU rank
//    (HardwareSpec::sumsComputeAndMemory).
//
// The result is cached per thread count; docs/HARDWARE.md describes it.
//
//===----------------------------------------------------------------------===//
#include "compiler/cost/CpuCalibration.h"
#include "compiler/cost/CostModel.h"
#include "compiler/cost/HardwareSpec.h"
#include "runtime/core/Tensor.h"
#include "support/Blas.h"
#include "support/MachineCache.h"
#include "support/Parallel.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/xxhash.h"

#include "onnx/onnx_pb.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

using namespace llvm;

namespace pipec {

namespace {

using cpu::Tensor;

CpuNodeRunner nodeRunner = nullptr;

/// Bumped whenever what calibrateCpu() measures changes, so that caches
/// written by an earlier pipec are measured again.
constexpr int calibrationVersion = 4;

/// The opset the calibration's nodes are read at.
constexpr int64_t calibrationOpset = 17;

/// Tokens and widths of the transformer blocks whose GEMMs and activations
/// are timed: small enough to finish in about two seconds, and spanning the
/// GEMM sizes where the per-call cost and the rate both show.
struct BlockShape {
  int64_t tokens, width;
};
constexpr BlockShape calibrationBlocks[] = {{32, 384}, {128, 384}, {128, 768}};

/// Weights cycled through per GEMM shape: more than a server's last-level
/// cache, so that each product reads its weight from memory as a step does.
constexpr int64_t coldWeightBytes = int64_t(48) << 20;

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// A float tensor of \p shape with small values that vary, so no kernel
/// meets only zeros.
Tensor filled(std::vector<int64_t> shape) {
  Tensor t = Tensor::uninitialized(DType::F32, std::move(shape));
  float *p = t.data<float>();
  for (int64_t i = 0; i < t.numElements(); ++i)
    p[i] = float((i * 7919) % 2003) * 1e-3f - 1.0f;
  return t;
}

/// One node as the CPU backend runs it, with its inputs, and what the cost
/// model charges for its forward pass.
struct Timed {
  onnx::NodeProto node;
  std::vector<Tensor> inputs;
  OpCost cost;
};

/// An operand of a calibration node: its shape, and whether it is a weight.
struct Operand {
  std::vector<int64_t> shape;
  bool weight = false;
};

/// Builds calibration nodes twice over: as ONNX nodes for the kernels, and
/// as ops of a Graph of the same shapes, so that their FLOPs, bytes and GEMM
/// calls come from the cost rules themselves (ops/Ops.def's COST column).
class Workload {
public:
  Workload() { graph.opsets[""] = calibrationOpset; }

  /// Appends \p op over \p operands producing \p out; returns its node for
  /// attributes.
  onnx::NodeProto &add(StringRef op, ArrayRef<Operand> operands, std::vector<int64_t> out) {
    Timed t;
    t.node.set_op_type(op.str());
    t.node.set_name(("calibrate/" + op + "/" + Twine(items.size())).str());
    Op costed;
    costed.setType("", op);
    for (const Operand &o : operands) {
      std::string name = t.node.name() + "/in" + std::to_string(costed.inputs.size());
      t.node.add_input(name);
      costed.inputs.push_back(
          value(name, o.weight ? ValueKind::Weight : ValueKind::Activation, o.shape));
      t.inputs.push_back(filled(o.shape));
    }
    t.node.add_output(t.node.name() + "/out");
    costed.outputs.push_back(value(t.node.output(0), ValueKind::Activation, std::move(out)));
    t.cost = opCost(graph, costed, Precision::FP32);
    items.push_back(std::move(t));
    return items.back().node;
  }

  std::vector<Timed> items;

private:
  int value(StringRef name, ValueKind kind, std::vector<int64_t> shape) {
    int id = graph.addValue(name, kind);
    Value &v = graph.values[id];
    v.type = DType::F32;
    v.shape = std::move(shape);
    v.shapeKnown = true;
    return id;
  }

  Graph graph;
};

void intAttribute(onnx::NodeProto &n, StringRef name, int64_t value) {
  onnx::AttributeProto *a = n.add_attribute();
  a->set_name(name.str());
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

void intsAttribute(onnx::NodeProto &n, StringRef name, ArrayRef<int64_t> values) {
  onnx::AttributeProto *a = n.add_attribute();
  a->set_name(name.str());
  a->set_type(onnx::AttributeProto::INTS);
  for (int64_t v : values)
    a->add_ints(v);
}

/// Runs \p t once; a kernel that fails makes the calibration fail.
Error runOnce(const Timed &t) {
  std::vector<const Tensor *> in;
  for (const Tensor &x : t.inputs)
    in.push_back(&x);
  if (!nodeRunner)
    return createStringError(inconvertibleErrorCode(),
                             "cpu calibration: no CPU kernels are wired to time "
                             "(setCpuNodeRunner; the driver's wireCpuKernels)");
  Expected<std::vector<Tensor>> out = nodeRunner(t.node, calibrationOpset, in);
  if (!out)
    return createStringError(inconvertibleErrorCode(), "cpu calibration: %s: %s",
                             t.node.op_type().c_str(), toString(out.takeError()).c_str());
  return Error::success();
}

/// Seconds per pass over \p program: after a warm-up pass, the median of
/// five rounds, each repeating the program for at least \p minSeconds. The
/// median, not the fastest: a step meets the machine as it usually is.
Expected<double> secondsPerPass(ArrayRef<Timed> program, double minSeconds) {
  for (const Timed &t : program)
    if (Error err = runOnce(t))
      return err;
  std::array<double, 5> rounds;
  for (double &round : rounds) {
    int passes = 0;
    Clock::time_point start = Clock::now();
    double elapsed = 0;
    do {
      for (const Timed &t : program)
        if (Error err = runOnce(t))
          return err;
      ++passes;
      elapsed = secondsSince(start);
    } while (elapsed < minSeconds);
    round = elapsed / passes;
  }
  std::nth_element(rounds.begin(), rounds.begin() + 2, rounds.end());
  return rounds[2];
}

/// A calibration row: y = a x1 (+ b x2), weighted by 1 / scale^2 so that the
/// fit minimises the relative error of each measurement.
using FitRow = std::array<double, 4>; // x1, x2, y, scale

/// Least squares for y = a x1 over \p rows (x2 unused); 0 without rows.
double fitOne(ArrayRef<FitRow> rows) {
  double s11 = 0, s1y = 0;
  for (const auto &[x1, x2, y, scale] : rows) {
    s11 += x1 * x1 / (scale * scale);
    s1y += x1 * y / (scale * scale);
  }
  return s11 > 0 ? s1y / s11 : 0.0;
}

/// Least squares for y = a x1 + b x2 over \p rows; false when the system is
/// singular.
bool fitTwo(ArrayRef<FitRow> rows, double &a, double &b) {
  double s11 = 0, s12 = 0, s22 = 0, s1y = 0, s2y = 0;
  for (const auto &[x1, x2, y, scale] : rows) {
    double w = 1.0 / (scale * scale);
    s11 += w * x1 * x1;
    s12 += w * x1 * x2;
    s22 += w * x2 * x2;
    s1y += w * x1 * y;
    s2y += w * x2 * y;
  }
  double det = s11 * s22 - s12 * s12;
  if (!(det > 0))
    return false;
  a = (s1y * s22 - s2y * s12) / det;
  b = (s2y * s11 - s1y * s12) / det;
  return true;
}

/// Seconds of one node whose kernel does next to nothing (a one-element Add):
/// the dispatch every op pays.
Expected<double> measureDispatch() {
  Workload w;
  for (int i = 0; i < 64; ++i)
    w.add("Add", {{{1}}, {{1}}}, {1});
  Expected<double> pass = secondsPerPass(w.items, 0.005);
  if (!pass)
    return pass.takeError();
  return *pass / double(w.items.size());
}

/// Times the element-wise, softmax, layer normalization and transpose
/// kernels on the blocks' activations, each on its own, and fits the FLOP
/// rate of
///   seconds - dispatch - bytes / bandwidth = FLOPs / vector rate;
/// 0 when the FLOPs take no measurable time beyond the bytes.
Expected<double> measureVectorFlops(double dispatch, double bandwidth) {
  Workload w;
  for (BlockShape b : calibrationBlocks) {
    int64_t t = b.tokens, d = b.width, heads = d / 64;
    w.add("Add", {{{t, 4 * d}}, {{t, 4 * d}}}, {t, 4 * d});
    w.add("Mul", {{{t, 4 * d}}, {{t, 4 * d}}}, {t, 4 * d});
    intAttribute(w.add("Softmax", {{{heads, t, t}}}, {heads, t, t}), "axis", -1);
    intAttribute(w.add("LayerNormalization", {{{t, d}}, {{d}, true}, {{d}, true}}, {t, d}), "axis",
                 -1);
    intsAttribute(w.add("Transpose", {{{t, heads, 64}}}, {heads, t, 64}), "perm", {1, 0, 2});
  }
  std::vector<FitRow> rows;
  for (const Timed &t : w.items) {
    Expected<double> one = secondsPerPass(ArrayRef<Timed>(&t, 1), 0.004);
    if (!one)
      return one.takeError();
    double flops = t.cost.flops[Forward];
    double rest = *one - dispatch - t.cost.bytes[Forward] / bandwidth;
    if (flops <= 0 || rest <= 0)
      continue; // no arithmetic, or all of it hidden in the traffic's time
    rows.push_back({flops, 0, rest, *one});
  }
  double perFlop = fitOne(rows);
  return perFlop > 0 ? 1 / perFlop : 0.0;
}

struct GemmFit {
  double peak = 0;    ///< FLOP/s
  double perCall = 0; ///< seconds
};

/// Times MatMul x[t, k] @ W[k, n] over each block's three products (width to
/// width, to 4 x width and back), and fits the cost model's CPU GEMM time,
///   seconds - dispatch - bytes / bandwidth = FLOPs / peak + per-call cost,
/// minimising the squared relative error. The weights stream from memory
/// before the arithmetic on them, so small-token products are slow for their
/// FLOPs, which a rate alone cannot say.
Expected<GemmFit> measureGemms(double dispatch, double bandwidth) {
  std::vector<FitRow> rows;
  for (BlockShape b : calibrationBlocks) {
    int64_t d = b.width;
    std::pair<int64_t, int64_t> products[] = {{d, d}, {d, 4 * d}, {4 * d, d}};
    for (auto [k, n] : products) {
      int64_t weightBytes = k * n * int64_t(sizeof(float));
      int64_t copies = std::max<int64_t>(2, std::min<int64_t>(64, coldWeightBytes / weightBytes));
      Workload w;
      for (int64_t c = 0; c < copies; ++c)
        w.add("MatMul", {{{b.tokens, k}}, {{k, n}, true}}, {b.tokens, n});
      Expected<double> pass = secondsPerPass(w.items, 0.02);
      if (!pass)
        return pass.takeError();
      const OpCost &cost = w.items[0].cost;
      double total = *pass / double(copies);
      double rest = total - dispatch - cost.bytes[Forward] / bandwidth;
      if (rest > 0) // else all traffic: it says nothing of the arithmetic
        rows.push_back({cost.flops[Forward], cost.gemms[Forward], rest, total});
    }
  }
  double perFlop = 0, perCall = 0;
  if (!fitTwo(rows, perFlop, perCall) || !(perFlop > 0) || perCall < 0) {
    perCall = 0; // no per-call cost to see: the rate alone
    perFlop = fitOne(rows);
  }
  if (!(perFlop > 0))
    return createStringError(inconvertibleErrorCode(),
                             "cpu calibration measured no GEMM time (clock too coarse?)");
  return GemmFit{1 / perFlop, perCall};
}

// Best of five 64 MiB memcpys; the buffers are written first so page faults
// are not timed. Returns the bytes copied per second (one direction).
double measureCopyRate() {
  const size_t bytes = size_t(64) << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    Clock::time_point start = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, secondsSince(start));
    src[i] = char(dst[bytes - 1 - i] + 1); // keep the copies observable
  }
  return double(bytes) / best;
}

struct Measured {
  double dispatch = 0, bandwidth = 0, vectorFlops = 0;
  GemmFit gemm;
};

/// The kernel measurements on the calling thread, with \p threads loop
/// threads and OpenBLAS on one (as a rank runs), over memory of \p bandwidth.
Expected<Measured> measureKernels(int threads, double bandwidth) {
  setLoopThreads(threads);
  Measured m;
  m.bandwidth = bandwidth;
  Expected<double> dispatch = measureDispatch();
  if (!dispatch)
    return dispatch.takeError();
  m.dispatch = *dispatch;
  Expected<double> vector = measureVectorFlops(m.dispatch, bandwidth);
  if (!vector)
    return vector.takeError();
  m.vectorFlops = *vector;
  Expected<GemmFit> gemm = measureGemms(m.dispatch, bandwidth);
  if (!gemm)
    return gemm.takeError();
  m.gemm = *gemm;
  return m;
}

// Failures only mean the next run calibrates again.
void writeCache(StringRef path, const HardwareSpec &spec) {
  std::string text;
  raw_string_ostream os(text);
  writeHardwareJson(spec, os);
  writeCacheFile(path, os.str());
}

int resolvedThreads(int threads) { return threads > 0 ? threads : allowedCpuCount(); }

/// Now, UTC, as 2026-12-06T05:30:00Z.
std::string utcNow() {
  std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

} // namespace

void setCpuNodeRunner(CpuNodeRunner runner) { nodeRunner = runner; }

Expected<HardwareSpec> calibrateCpu(int threads) {
  threads = resolvedThreads(threads);
  // Memory first: the kernels' fits take its traffic out of their times.
  double copy = measureCopyRate();
  if (!(copy > 0))
    return createStringError(inconvertibleErrorCode(),
                             "cpu calibration measured no copy time (clock too coarse?)");
  double bandwidth = 2 * copy; // a copy reads and writes every byte
  // On a thread of its own: the loop pool belongs to the thread that sized
  // it, so the caller's is left as it was. OpenBLAS's count is process-wide.
  int blasThreads = blas::numThreads();
  blas::setNumThreads(1);
  Measured measured;
  std::string problem;
  double cpuSeconds = 0, wallSeconds = 0;
  std::thread worker([&] {
    // The share of the wall time this thread ran: another process that
    // takes the cores makes every figure slow, and says so here.
    double cpuStart = threadCpuSeconds();
    Clock::time_point start = Clock::now();
    Expected<Measured> m = measureKernels(threads, bandwidth);
    cpuSeconds = threadCpuSeconds() - cpuStart;
    wallSeconds = secondsSince(start);
    if (m)
      measured = *m;
    else
      problem = toString(m.takeError());
  });
  worker.join();
  blas::setNumThreads(std::max(1, blasThreads));
  if (!problem.empty())
    return createStringError(inconvertibleErrorCode(), problem);
  int cpus = allowedCpuCount();
  HardwareSpec s;
  s.name = "cpu";
  // OpenBLAS computes in fp32 only; bf16 models run in fp32 on the CPU ranks.
  s.peakFlopsF32 = measured.gemm.peak;
  s.peakFlopsBf16 = measured.gemm.peak;
  s.vectorFlops = measured.vectorFlops;
  s.gemmOverhead = measured.gemm.perCall;
  s.sumsComputeAndMemory = true;
  s.memoryBandwidth = measured.bandwidth;
  s.memoryBytes = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGE_SIZE));
  s.launchOverhead = measured.dispatch;
  // Ranks on one machine talk through shared memory: a memcpy plus ~1 us of
  // MPI bookkeeping; there is no separate network, so both links are loopback.
  s.intraNode = {"loopback", copy, 1e-6};
  s.interNode = s.intraNode;
  s.devicesPerNode = cpus;
  s.sharesHostCores = true;
  s.calibrationCpuShare = wallSeconds > 0 ? std::min(1.0, cpuSeconds / wallSeconds) : 0;
  s.calibratedAt = utcNow();
  s.source = "calibrated on " + cpuModelName() + ", " + std::to_string(cpus) +
             " cpus: pipec's CPU kernels on " + std::to_string(threads) +
             (threads == 1 ? " thread" : " threads") + " (" + blas::name() +
             "), transformer-sized MatMul, element-wise and normalization kernels; 64 MiB memcpy";
  return s;
}

std::string cpuCachePath(int threads) {
  SmallString<256> dir(cacheDirectory());
  if (dir.empty())
    return "";
  // A different BLAS (or its kernel for this CPU), calibration or share of
  // the cores is a different machine.
  uint64_t hash =
      xxHash64(cpuModelName() + "/" + std::to_string(allowedCpuCount()) + "/" + blas::name() + "/" +
               blas::config() + "/v" + std::to_string(calibrationVersion));
  sys::path::append(dir, "cpu-" + utohexstr(hash, /*LowerCase=*/true) + "-" +
                             std::to_string(resolvedThreads(threads)) + "t.json");
  return std::string(dir);
}

namespace {

/// The cached calibration at \p path, when there is a readable one.
std::optional<HardwareSpec> readCache(const std::string &path) {
  if (path.empty() || !sys::fs::exists(path))
    return std::nullopt;
  Expected<HardwareSpec> cached = loadHardwareFile(path);
  if (!cached || cached->name != "cpu") {
    consumeError(cached.takeError()); // stale or damaged: measure again
    return std::nullopt;
  }
  cached->sharesHostCores = true; // a cache written before the field
  return *cached;
}

/// Caches \p spec unless it is disturbed and \p cached is a quiet figure: a
/// disturbed figure is kept marked (calibrationDisturbed) until a quiet one
/// replaces it.
void keep(const std::string &path, const HardwareSpec &spec,
          const std::optional<HardwareSpec> &cached) {
  if (path.empty() || (spec.calibrationDisturbed() && cached && !cached->calibrationDisturbed()))
    return;
  writeCache(path, spec);
}

} // namespace

Expected<HardwareSpec> cpuHardware(int threads) {
  std::string path = cpuCachePath(threads);
  std::optional<HardwareSpec> cached = readCache(path);
  // A disturbed figure serves for a while, marked (the plan warns), so that
  // a busy machine does not measure at every compile; then it is measured
  // again.
  if (cached && !cached->calibrationDisturbed())
    return *cached;
  if (std::optional<double> age = cached ? cacheFileAge(path) : std::nullopt;
      age && *age < disturbedMeasurementSeconds)
    return *cached;
  Expected<HardwareSpec> spec = calibrateCpu(threads);
  if (spec)
    keep(path, *spec, cached);
  return spec;
}

Expected<HardwareSpec> recalibrateCpu(int threads) {
  Expected<HardwareSpec> spec = calibrateCpu(threads);
  std::string path = cpuCachePath(threads);
  if (spec)
    keep(path, *spec, readCache(path));
  return spec;
}

} // namespace pipec
