//===- Launch.cpp - A run: every rank of a plan, its steps and results --===//
//
// runLocal runs every rank (pipeline ranks x data-parallel replicas) as a
// thread of this process, runMpi this process's rank under MPI, both
// through the Launcher (Launcher.h) that `pipec generate` starts its ranks
// with. A run makes what the ranks share from the plan, runs each rank's
// steps (resuming from and writing checkpoints, rank 0 printing progress)
// and hands the reporting process the losses, outputs, trained weights and
// trace.
//
//===----------------------------------------------------------------------===//
#include "plan/PlanFile.h"
#include "runtime/core/HostBuffers.h"
#include "runtime/cpu/FewRowGemm.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Checkpoint.h"
#include "runtime/exec/Launcher.h"
#include "runtime/exec/ModelIO.h"
#include "runtime/exec/ParamMap.h"
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/Trace.h"
#include "support/Blas.h"
#include "support/Diagnostics.h"
#include "support/InputFile.h"
#include "support/Parallel.h"
#include "support/WireSkeleton.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <malloc.h>
#include <mutex>
#include <pthread.h>
#include <random>
#include <sched.h>
#include <thread>
#include <tuple>

using namespace llvm;

namespace pipec::rt {

namespace {

/// "--FLAG VALUE: must be WHAT" unless \p ok.
Error checkNumber(bool ok, StringRef flag, double value, StringRef what) {
  if (ok)
    return Error::success();
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  return usageError("--" + flag + " " + text + ": must be " + what);
}

/// The CPUs this process may run on, in order.
std::vector<int> allowedCpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set))
        cpus.push_back(c);
  return cpus;
}

} // namespace

/// Sets the BLAS threads of each of \p ranks ranks on this node: the
/// user's --threads-per-rank, else the node's cores shared out evenly.
int shareCores(const RunOptions &options, int ranks) {
  int threads = options.threadsPerRank.value_or(defaultThreadsPerRank(ranks));
  // One pool per rank (support/Parallel.h) runs its loops and splits its
  // GEMMs into bands, each on one BLAS thread: OpenBLAS's own pool would
  // spin between GEMMs on the cores the loops need.
  cpu::setBlasThreads(1);
  return threads;
}

/// Binds the calling thread, rank \p rank of \p ranks single-threaded
/// ranks, to a core of its own when the process has one for every rank;
/// rank -1 gives the thread every allowed core back.
void pinToCore(int rank, int ranks) {
  static const std::vector<int> cpus = allowedCpus();
  if (cpus.empty() || static_cast<int>(cpus.size()) < ranks)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (rank < 0)
    for (int c : cpus)
      CPU_SET(c, &set);
  else
    CPU_SET(cpus[rank], &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

std::string blasName() { return blas::describe() + "; " + cpu::describeFewRowChoice(); }

Error checkRunOptions(const RunOptions &o) {
  auto finite = [](double v) { return std::isfinite(v); };
  if (o.lrSchedule != "constant" && o.lrSchedule != "linear" && o.lrSchedule != "cosine")
    return usageError("--lr-schedule " + o.lrSchedule + ": expected constant, linear or cosine");
  struct Check {
    bool ok;
    const char *flag;
    double value;
    const char *what;
  };
  double lr = o.lr.value_or(0);
  const Check checks[] = {
      {o.steps >= 1, "steps", double(o.steps), "at least 1"},
      {o.checkpointEvery >= 1, "checkpoint-every", double(o.checkpointEvery), "at least 1"},
      {o.keepCheckpoints.value_or(1) >= 1, "keep-checkpoints",
       double(o.keepCheckpoints.value_or(1)), "at least 1"},
      // The weights are float32 (or narrower): a rate or a decay float32
      // cannot hold makes every update that uses it infinite.
      {finite(lr) && lr >= 0 && lr <= FLT_MAX, "lr", lr,
       "a finite number >= 0 that float32 holds (at most 3.4e38)"},
      {finite(o.momentum) && o.momentum >= 0 && o.momentum < 1, "momentum", o.momentum,
       "in [0, 1)"},
      {finite(o.weightDecay) && o.weightDecay >= 0 && o.weightDecay <= FLT_MAX, "weight-decay",
       o.weightDecay, "a finite number >= 0 that float32 holds (at most 3.4e38)"},
      {o.warmup >= 0, "warmup", double(o.warmup), "at least 0"},
      {finite(o.clipGradNorm) && o.clipGradNorm >= 0, "clip-grad-norm", o.clipGradNorm,
       "a finite number >= 0 (0: off)"},
      {finite(o.timeoutSeconds) && o.timeoutSeconds > 0, "timeout", o.timeoutSeconds,
       "a finite number of seconds > 0"},
      {o.ranksPerDevice >= 1, "ranks-per-device", double(o.ranksPerDevice), "at least 1"},
      {o.evalEvery >= 0, "eval-every", double(o.evalEvery), "at least 1"},
      {o.evalSteps >= 0, "eval-steps", double(o.evalSteps), "at least 1"},
      {o.seqLen >= 0, "seq-len", double(o.seqLen), "at least 1"},
      {o.threadsPerRank.value_or(1) >= 1 && o.threadsPerRank.value_or(1) <= 1024,
       "threads-per-rank", double(o.threadsPerRank.value_or(1)), "in [1, 1024]"},
  };
  for (const Check &c : checks)
    if (Error err = checkNumber(c.ok, c.flag, c.value, c.what))
      return err;
  // Decoupled decay multiplies every weight by 1 - lr x weight-decay each
  // step: from 2 on, that factor's magnitude is 1 or more, and the weights
  // grow, alternating in sign, instead of decaying, until they overflow.
  if (lr * o.weightDecay >= 2)
    return usageError(formatv("--lr {0} with --weight-decay {1}: decay multiplies each weight "
                              "by 1 - lr x weight-decay = {2} per step, which shrinks no weight; "
                              "lr x weight-decay must be below 2",
                              format("%g", lr), format("%g", o.weightDecay),
                              format("%g", 1 - lr * o.weightDecay)));
  return Error::success();
}

namespace {

/// What this run's checkpoint files carry: run \p run (drawn once per run)
/// and the plan's hash.
void setCheckpointIdentity(Shared &s, uint64_t run, const plan::Plan &plan) {
  s.checkpointRun = formatv("{0}", format_hex_no_prefix(run, 16)).str();
  s.checkpointPlan = contentHash(plan.SerializeAsString());
}

uint64_t freshRunId() {
  std::random_device device;
  return (uint64_t(device()) << 32) | device();
}

/// 950, 8.1k, 12.3M.
std::string humanRate(double v) {
  if (v >= 1e6)
    return formatv("{0:f1}M", v / 1e6).str();
  if (v >= 1e4)
    return formatv("{0:f1}k", v / 1e3).str();
  return formatv("{0:f0}", v).str();
}

} // namespace

StepRates stepRates(const plan::Plan &plan, double seconds) {
  StepRates rates;
  if (seconds <= 0)
    return rates;
  double samples = static_cast<double>(plan.schedule().global_batch());
  rates.samplesPerSecond = samples / seconds;
  rates.tokensPerSecond = samples * static_cast<double>(tokensPerSample(plan)) / seconds;
  rates.flopsPerSecond = modelFlopsPerStep(plan) / seconds;
  if (double peak = peakFlopsOfRun(plan); peak > 0)
    rates.mfu = rates.flopsPerSecond / peak;
  return rates;
}

std::string formatRates(const plan::Plan &plan, double seconds, StringRef backend) {
  StepRates rates = stepRates(plan, seconds);
  std::string text = rates.tokensPerSecond > 0
                         ? formatv("{0} tokens/s", humanRate(rates.tokensPerSecond)).str()
                         : formatv("{0:f1} samples/s", rates.samplesPerSecond).str();
  if (rates.flopsPerSecond > 0)
    text += formatv("  {0:f3} TFLOP/s", rates.flopsPerSecond / 1e12).str();
  if (rates.mfu > 0) {
    // Whose peak: a CPU plan's is calibrated; another spec's is named, and
    // said not to be this CPU's when the plan runs on one.
    std::string hardware = plan.hardware_size() > 0 ? plan.hardware(0).name() : "";
    std::string whose = "of " + hardware + "'s peak";
    if (hardware == "cpu")
      whose = "of the calibrated CPU peak";
    else if (backend == "cpu")
      whose += ", the plan's hardware, not this CPU's";
    text += formatv("  MFU {0:f1}% ({1})", 100 * rates.mfu, whose).str();
  }
  return text;
}

Expected<std::unique_ptr<Shared>> makeShared(const plan::Plan &plan, const RunOptions &options) {
  if (Error err = checkRunOptions(options))
    return err;
  if (options.backend == "cpu")
    if (Error err = checkPlanFitsMachine(plan))
      return err;
  auto model = checkPlanModel(plan, options);
  if (!model)
    return model.takeError();
  auto s = std::make_unique<Shared>();
  s->plan = &plan;
  s->options = options;
  s->modelPath = *model;
  s->modelDir = sys::path::parent_path(*model).str();
  // The pipeline's shape as compile wrote it (PipelineShape), read as
  // written: checkPlan holds each count to at least 1 in a plan that runs,
  // and the global batch to microbatch_size x M x dp.
  s->P = plan.schedule().stages();
  s->dp = plan.schedule().data_parallel();
  s->grid = RankGrid::of(plan);
  for (const plan::WeightShard &shard : plan.weight_shards())
    s->shards[shard.weight()] = &shard;
  s->sequenceGrads.insert(plan.sequence_grads().begin(), plan.sequence_grads().end());
  s->K = plan.stages_size();
  s->M = plan.schedule().microbatches();
  s->microbatchSize = plan.schedule().microbatch_size();
  s->globalBatch = plan.schedule().global_batch();
  s->training = plan.schedule().mode() == "train";
  s->shardOptimizer = s->training && plan.training().shard_optimizer() && s->dp > 1;
  for (const plan::Stage &stage : plan.stages())
    s->rankOfStage.push_back(stage.rank());
  for (const onnx::TensorProto &w : plan.weights())
    s->weightProtos[w.name()] = &w;
  s->trainable.insert(plan.trainable().begin(), plan.trainable().end());
  if (!options.initPath.empty()) {
    auto init = loadInitWeights(plan, options.initPath, s->warnings);
    if (!init)
      return init.takeError();
    s->initWeights = std::move(*init);
  }
  for (const plan::Param &p : plan.param_map().params())
    for (const plan::ParamPlace &place : p.places())
      if (double center = decayCenterOf(place); center != 0 && s->trainable.count(place.weight()))
        s->decayCenters[place.weight()] = center;
  // The flag, or else the plan's choice (a name the same table reads).
  if (options.optimizer) {
    s->optimizer = *options.optimizer;
  } else {
    auto optimizer = parseOptimizer(plan.training().optimizer());
    if (!optimizer)
      return optimizer.takeError();
    s->optimizer = *optimizer;
  }
  s->lr = options.lr ? *options.lr : (s->optimizer == Optimizer::AdamW ? 1e-3 : 1e-2);
  DataOptions reading;
  reading.seed = options.seed;
  reading.allowNonfinite = options.allowNonfinite;
  reading.tokenType = options.tokenType;
  reading.seqLen = options.seqLen;
  auto data = openRunData(plan, options.dataDir, reading);
  if (!data)
    return data.takeError();
  s->data = std::move(*data);
  if (!options.evalData.empty()) {
    if (!s->training)
      return usageError("--eval-data: the plan infers; evaluation runs between training steps "
                        "(run the evaluation set itself with --data)");
    reading.flag = "--eval-data";
    reading.shuffled = false;
    auto eval = openRunData(plan, options.evalData, reading);
    if (!eval)
      return eval.takeError();
    s->evalData = std::move(*eval);
  }
  s->fault = options.fault;
  if (plan.programs_size() != s->P)
    return createStringError(inconvertibleErrorCode(), "the plan has %d programs for %d ranks",
                             plan.programs_size(), s->P);
  s->programs.assign(plan.stage_programs().begin(), plan.stage_programs().end());
  return s;
}

namespace {

/// The all-reduce groups of the run, in one order on every rank.
std::vector<std::vector<int>> sumGroups(const Shared &s) {
  const RankGrid &grid = s.grid;
  std::vector<std::vector<int>> groups;
  for (int d = 0; d < s.dp; ++d)
    for (int t = 0; t < grid.T; ++t)
      for (const plan::RankProgram &p : s.plan->programs())
        for (const Ins &ins : p.instructions())
          if (ins.op() == Ins::ALLREDUCE && ins.reduce() == Ins::TIED_WEIGHT) {
            std::vector<int> g;
            for (int r : ins.ranks())
              g.push_back(grid.global(d, r, t));
            std::sort(g.begin(), g.end());
            groups.push_back(g);
          }
  // The ranks global(k) for k < n.
  auto group = [](int n, function_ref<int(int)> global) {
    std::vector<int> g;
    for (int k = 0; k < n; ++k)
      g.push_back(global(k));
    return g;
  };
  if (s.dp > 1) // the replicas of each (r, t)
    for (int r = 0; r < s.P; ++r)
      for (int t = 0; t < grid.T; ++t)
        groups.push_back(group(s.dp, [&](int d) { return grid.global(d, r, t); }));
  if (grid.T > 1) // the tensor-parallel ranks of each (d, r)
    for (int d = 0; d < s.dp; ++d)
      for (int r = 0; r < s.P; ++r)
        groups.push_back(group(grid.T, [&](int t) { return grid.global(d, r, t); }));
  groups.push_back(group(grid.ranks(), [](int r) { return r; }));
  return groups;
}

std::string formatDuration(double seconds) {
  int total = static_cast<int>(std::lround(seconds));
  return formatv("{0}:{1:2}:{2:2}", total / 3600, (total / 60) % 60, total % 60).str();
}

/// \p body's error; an allocation failure outside a node's kernel (a
/// gradient buffer, a received message, a checkpoint's tensor, the assembled
/// outputs) becomes "WHAT: a tensor SHAPE needs N bytes; out of memory".
template <typename Body> Error guardAllocation(const Twine &what, Body body) {
  try {
    return body();
  } catch (const cpu::AllocationFailure &failure) {
    return createStringError(inconvertibleErrorCode(),
                             "%s: a tensor %s needs %lld bytes; out of memory", what.str().c_str(),
                             failure.shape.c_str(), static_cast<long long>(failure.bytes));
  }
}

/// The evaluation after step \p step: the mean loss of the evaluation
/// batches, over every rank.
Expected<double> evaluate(const Shared &s, Comm &comm, RankExecutor &ex, int step) {
  int64_t batches = s.options.evalSteps;
  if (batches <= 0)
    batches = std::max<int64_t>(1, s.evalData->samples() / s.globalBatch);
  double sum = 0, count = 0;
  for (int64_t b = 0; b < batches; ++b) {
    double batchSum = 0, batchCount = 0;
    if (Error err = guardAllocation(
            "rank " + Twine(ex.globalRank()) + ": evaluation after step " + Twine(step),
            [&] { return ex.evaluate(static_cast<int>(b), batchSum, batchCount); }))
      return std::move(err);
    sum += batchSum;
    count += batchCount;
  }
  double totals[2] = {sum, count};
  if (Error err = comm.sumAll(totals))
    return std::move(err);
  return totals[1] > 0 ? totals[0] / totals[1] : 0;
}

/// One rank's whole run: load, resume, steps, checkpoints. Rank 0 prints.
Error runRank(const Shared &s, Comm &comm, RankExecutor &ex, RunResult &result) {
  if (Error err = comm.prepareGroups(sumGroups(s)))
    return err;
  if (Error err = guardAllocation("rank " + Twine(ex.globalRank()) + ": loading the weights",
                                  [&] { return ex.load(); }))
    return err;
  // The model's check and the weights' reading left freed copies in the
  // heap, which keepFreedMemory's thresholds would keep: back to the system.
  malloc_trim(0);
  // The steps' memory apart from the loading's: once every rank has loaded
  // (a local run's ranks share the process), a new high-water mark.
  double loaded = 0;
  if (Error err = comm.sumAll(loaded))
    return err;
  ex.loadPeakResident = cpu::startResidentWindow();
  int first = 0;
  const RunOptions &o = s.options;
  ResumeMode mode = o.resumeIfExists ? ResumeMode::IfExists
                    : o.resume       ? ResumeMode::Latest
                                     : ResumeMode::Fresh;
  auto step = agreeResumeStep(o.checkpointDir, mode, comm, ex.globalRank(), s.grid.ranks(), s.P,
                              s.grid.T, result.warnings);
  if (!step)
    return step.takeError();
  if (*step > 0) {
    std::string file = checkpointFile(o.checkpointDir, *step, ex.globalRank());
    // Written at another --tp: the same pipelines, read across.
    int writtenT = checkpointRanks(o.checkpointDir, *step) / (s.P * s.dp);
    if (Error err = guardAllocation("rank " + Twine(ex.globalRank()) + ": checkpoint " + file, [&] {
          return writtenT > 0 && writtenT != s.grid.T
                     ? ex.loadCheckpointAcross(o.checkpointDir, *step, writtenT, first)
                     : ex.loadCheckpoint(file, first);
        }))
      return err;
  }
  if (first >= o.steps && ex.globalRank() == 0)
    result.warnings.push_back(formatv("the checkpoint in {0} is at step {1}, and --steps is {2}: "
                                      "nothing left to train",
                                      o.checkpointDir, first, o.steps)
                                  .str());
  result.firstStep = first;
  auto started = Clock::now();
  for (int t = first; t < o.steps; ++t) {
    double sum = 0, count = 0;
    // run --profile: the last step, the ones before it warming up.
    bool profiled = !o.profilePath.empty() && t + 1 == o.steps;
    BackendCounters before = profiled ? ex.backendCounters() : BackendCounters();
    if (profiled) {
      ex.stepProfile = RankProfile();
      ex.stepProfile.rank = ex.globalRank();
      ex.profile = &ex.stepProfile;
    }
    auto stepStarted = Clock::now();
    if (Error err = guardAllocation("rank " + Twine(ex.globalRank()) + ": step " + Twine(t + 1),
                                    [&] { return ex.step(t, sum, count); }))
      return err;
    if (profiled) {
      ex.profile = nullptr;
      ex.stepProfile.stepSeconds =
          std::chrono::duration<double>(Clock::now() - stepStarted).count();
      ex.stepProfile.counters = ex.backendCounters() - before;
    }
    double totals[2] = {sum, count};
    if (Error err = comm.sumAll(totals))
      return err;
    double loss = totals[1] > 0 ? totals[0] / totals[1] : 0;
    StepRecord record;
    record.step = t + 1;
    record.loss = loss;
    record.seconds = std::chrono::duration<double>(Clock::now() - stepStarted).count();
    record.lr = ex.lastLr;
    record.gradNorm = ex.lastGradNorm;
    if (s.evalData && o.evalEvery > 0 && (t + 1) % o.evalEvery == 0) {
      auto evalLoss = evaluate(s, comm, ex, t + 1);
      if (!evalLoss)
        return evalLoss.takeError();
      record.evalLoss = *evalLoss;
    }
    if (comm.rank() == 0) {
      result.history.push_back(record);
      if (o.onStep)
        o.onStep(record);
    }
    if (!o.checkpointDir.empty() &&
        ((t + 1) % std::max(1, o.checkpointEvery) == 0 || t + 1 == o.steps)) {
      std::string file = checkpointFile(o.checkpointDir, t + 1, ex.globalRank());
      if (std::error_code ec = sys::fs::create_directories(sys::path::parent_path(file)))
        return rankError(ex.globalRank(), formatv("checkpoint {0}: {1}", file, ec.message()));
      if (Error err = ex.saveCheckpoint(file, t + 1))
        return err;
      double none[1] = {0};
      if (Error err = comm.sumAll(none)) // every rank's file is written
        return err;
      if (comm.rank() == 0) {
        SmallString<256> latest(o.checkpointDir);
        sys::path::append(latest, "latest");
        if (Error err = writeFileAtomically(latest, formatv("step-{0}\n", t + 1).str()))
          return err;
        if (o.keepCheckpoints)
          if (Error err = pruneCheckpoints(o.checkpointDir, *o.keepCheckpoints, t + 1))
            return err;
      }
    }
    if (comm.rank() == 0 && o.progress && o.log) {
      double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
      int done = t + 1 - first;
      double eta = done > 0 ? elapsed / done * (o.steps - t - 1) : 0;
      *o.log << formatv("step {0}/{1}", t + 1, o.steps);
      if (s.training)
        *o.log << formatv("  loss {0:f4}", loss);
      if (record.evalLoss)
        *o.log << formatv("  eval {0:f4}", *record.evalLoss);
      if (s.training && (o.lrSchedule != "constant" || o.warmup > 0))
        *o.log << formatv("  lr {0:e2}", ex.lastLr);
      if (s.training && ex.lastGradNorm >= 0)
        *o.log << formatv("  grad-norm {0:f3}", ex.lastGradNorm);
      *o.log << "  " << formatRates(*s.plan, record.seconds, o.backend)
             << formatv("  ETA {0}\n", formatDuration(eta));
      o.log->flush();
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  // Whole weights for the saved model and the tests: a collective of each
  // tensor-parallel group, so on the ranks' own threads.
  if (s.grid.T > 1 && (!o.saveWeights.empty() || o.collectWeights))
    return ex.joinSplitWeights();
  return Error::success();
}

/// Concatenates per-microbatch outputs in sample order, along each output's
/// batch axis (Plan.output_batch_axes; dimension 0 in plans without them).
/// An output without a batch dimension (axis -1, or a scalar) keeps the last
/// microbatch's value: the one of the highest-numbered samples.
Error assembleOutputs(const plan::Plan &plan,
                      const std::map<std::string, std::map<int64_t, cpu::Tensor>> &parts,
                      RunResult &result) {
  std::map<std::string, int> axes;
  for (int i = 0; i < plan.outputs_size(); ++i)
    axes[plan.outputs(i).name()] =
        i < plan.output_batch_axes_size() ? plan.output_batch_axes(i) : 0;
  for (const auto &[name, pieces] : parts) {
    if (pieces.empty())
      continue;
    auto known = axes.find(name);
    int axis = known == axes.end() ? 0 : known->second;
    const cpu::Tensor &first = pieces.begin()->second;
    if (axis < 0 || first.rank() == 0) {
      result.outputs[name] = pieces.rbegin()->second;
      continue;
    }
    std::vector<int64_t> shape = first.shape();
    for (const auto &[start, t] : pieces) {
      std::vector<int64_t> other = t.shape();
      if (axis >= first.rank() || t.rank() != first.rank() || t.elemType() != first.elemType() ||
          !std::equal(shape.begin(), shape.begin() + axis, other.begin()) ||
          !std::equal(shape.begin() + axis + 1, shape.end(), other.begin() + axis + 1))
        return createStringError(inconvertibleErrorCode(),
                                 "output '%s': microbatch pieces %s and %s do not stack along "
                                 "dimension %d",
                                 name.c_str(), first.describe().c_str(), t.describe().c_str(),
                                 axis);
    }
    shape[axis] = 0;
    for (const auto &[start, t] : pieces)
      shape[axis] += t.dim(axis);
    cpu::Tensor all(first.elemType(), shape);
    // [outer, batch, inner]: each piece fills its slice of every outer row.
    int64_t outer = cpu::numElementsOf(ArrayRef<int64_t>(shape).take_front(axis));
    size_t inner =
        static_cast<size_t>(cpu::numElementsOf(ArrayRef<int64_t>(shape).drop_front(axis + 1))) *
        cpu::storageSize(first.elemType());
    size_t outRow = static_cast<size_t>(shape[axis]) * inner, at = 0;
    for (const auto &[start, t] : pieces) {
      size_t pieceRow = static_cast<size_t>(t.dim(axis)) * inner;
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(static_cast<char *>(all.rawData()) + o * outRow + at,
                    static_cast<const char *>(t.rawData()) + o * pieceRow, pieceRow);
      at += pieceRow;
    }
    result.outputs[name] = std::move(all);
  }
  return Error::success();
}

Error writeOutputs(const RunOptions &o, const RunResult &result) {
  if (o.outputsDir.empty())
    return Error::success();
  if (std::error_code ec = sys::fs::create_directories(o.outputsDir))
    return createStringError(ec, "--outputs %s: %s", o.outputsDir.c_str(), ec.message().c_str());
  for (const auto &[name, tensor] : result.outputs) {
    SmallString<256> path(o.outputsDir);
    sys::path::append(path, safeFileName(name) + (o.outputsAsPb ? ".pb" : ".npy"));
    if (o.outputsAsPb) {
      std::string bytes;
      cpu::toTensorProto(tensor, name).SerializeToString(&bytes);
      if (Error err = writeFileAtomically(path, bytes))
        return err;
    } else if (Error err = writeNpy(tensor, path)) {
      return err;
    }
  }
  return Error::success();
}

} // namespace

/// Keeps freed tensor memory in the heap: a step frees and reallocates the
/// same large activations over and over, and returning them to the kernel
/// each time costs a page fault per page on the next touch.
void keepFreedMemory() {
  static bool done = false;
  if (done)
    return;
  done = true;
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

namespace {

/// Whether the run keeps the trained weights: to save them, or for tests.
bool keepsWeights(const RunOptions &options) {
  return !options.saveWeights.empty() || options.collectWeights;
}

/// \p ex's outcome; the weights of replica 0's ranks when the run keeps them.
Expected<RankOutcome> outcomeOf(RankExecutor &ex, const Backend &backend,
                                const RunOptions &options) {
  RankOutcome outcome;
  outcome.outputs = std::move(ex.outputs); // the run is over
  if (keepsWeights(options) && ex.replicaIndex() == 0) {
    auto weights = ex.trainedWeights();
    if (!weights)
      return weights.takeError();
    outcome.trained = std::move(*weights);
  }
  if (!options.tracePath.empty())
    outcome.events = ex.events;
  for (const auto &[op, count] : backend.fallbackOps())
    outcome.fallbacks[op] += count;
  if (int64_t peak = backend.devicePeakBytes(); peak > 0)
    outcome.devicePeak[ex.pipelineRank()] = peak;
  return outcome;
}

/// What the reporting process does with every rank's outcome, merged: the
/// graph outputs in sample order (written with --outputs), the trained model
/// (--save-weights), the trace (--trace), the weights (collectWeights).
Error finishRun(const Shared &s, RankOutcome outcome, RunResult &result) {
  const RunOptions &options = s.options;
  const auto &outputs = outcome.outputs;
  std::map<std::string, cpu::Tensor> &trained = outcome.trained;
  const std::vector<TraceEvent> &events = outcome.events;
  for (const auto &[op, count] : outcome.fallbacks)
    result.fallbacks[op] += count;
  result.peakResidentBytes = outcome.peakResident;
  result.devicePeakBytes = outcome.devicePeak;
  result.loadResidentBytes = outcome.loadResident;
  if (Error err = guardAllocation("assembling the outputs",
                                  [&] { return assembleOutputs(*s.plan, outputs, result); }))
    return err;
  if (Error err = writeOutputs(options, result))
    return err;
  result.warnings.insert(result.warnings.begin(), s.warnings.begin(), s.warnings.end());
  if (StringRef(options.saveWeights).endswith(".safetensors")) {
    std::string base =
        options.initPath.empty() ? s.plan->param_map().checkpoint() : options.initPath;
    if (Error err =
            saveTrainedParams(*s.plan, trained, base, untrainedFactor(s), options.saveWeights))
      return err;
  } else if (!options.saveWeights.empty()) {
    if (Error err = saveTrainedModel(s.modelPath, trained, *s.plan, options.saveWeights))
      return err;
  }
  if (!options.tracePath.empty())
    if (Error err = writeTrace(options.tracePath, events, s.grid.ranks()))
      return err;
  if (options.collectWeights)
    result.weights = std::move(trained);
  return Error::success();
}

/// A run on the ranks \p mpi says: threads of this process, or this
/// process's rank of an MPI job.
Expected<RunResult> launchRun(const plan::Plan &plan, const RunOptions &options, bool mpi) {
  auto launcher = Launcher::open(options, mpi);
  if (!launcher)
    return launcher.takeError();
  Launcher &l = **launcher;
  auto shared = makeShared(plan, options);
  if (!shared)
    return l.fail(shared.takeError());
  Shared &s = **shared;
  std::string layout =
      s.grid.T > 1
          ? formatv("{0} pipeline ranks x {1} replicas x {2} tensor-parallel ranks = {3} "
                    "ranks",
                    s.P, s.dp, s.grid.T, s.grid.ranks())
                .str()
          : formatv("{0} pipeline ranks x {1} replicas = {2} ranks", s.P, s.dp, s.grid.ranks())
                .str();
  if (Error err = l.place(s, layout, [](int ranks) { return ranks; }))
    return err;
  // The reporting process holds the checkpoint folder for the whole run,
  // and gives every process its run id.
  CheckpointLock lock;
  if (!options.checkpointDir.empty()) {
    if (l.primary()) {
      auto taken = CheckpointLock::take(options.checkpointDir);
      if (!taken)
        return l.fail(taken.takeError());
      lock = std::move(*taken);
    }
    auto id = l.fromPrimary(l.primary() ? freshRunId() : 0);
    if (!id)
      return id.takeError();
    setCheckpointIdentity(s, *id, plan);
  }
  std::vector<std::unique_ptr<RankExecutor>> executors;
  for (int i = 0; i < l.ranksHere(); ++i)
    executors.push_back(std::make_unique<RankExecutor>(s, l.comm(i), l.backend(i)));
  std::vector<RunResult> results(l.ranksHere());
  if (Error err = l.run([&](int i) { return runRank(s, l.comm(i), *executors[i], results[i]); }))
    return err;

  RunResult result = std::move(results[0]);
  if (!options.profilePath.empty() && options.steps > result.firstStep) {
    std::vector<RankProfile> profiles;
    for (const auto &ex : executors)
      profiles.push_back(ex->stepProfile);
    if (Error err = writeProfile(options.profilePath, options.backend, options.steps, profiles))
      return l.fail(std::move(err));
  }
  result.primary = l.primary();
  result.rankNodes = l.rankNodes();
  result.blas = blasName();
  result.threadsPerRank = l.threadsPerRank();
  // Replica 0 holds every weight; the result keeps its lowest rank's copy of
  // a tied one, and with collectWeights every copy, so tests can check that
  // they agree.
  RankOutcome mine;
  for (int i = 0; i < l.ranksHere(); ++i) {
    RankExecutor &ex = *executors[i];
    result.busySeconds.push_back(ex.busy / std::max(1, options.steps - result.firstStep));
    result.instructions += ex.instructions;
    result.nodes += ex.nodesRun;
    result.kernelSeconds += ex.kernelSeconds;
    result.instructionSeconds += ex.instructionSeconds - ex.waitSeconds;
    auto outcome = outcomeOf(ex, l.backend(i), options);
    if (!outcome)
      return l.fail(outcome.takeError());
    // A tensor-parallel group's ranks hold the same whole weights once
    // joined: the first of each group gives its copies.
    if (options.collectWeights && ex.tpIndex() == 0) {
      std::map<std::string, cpu::Tensor> others;
      if (ex.replicaIndex() != 0) {
        auto weights = ex.trainedWeights();
        if (!weights)
          return weights.takeError();
        others = std::move(*weights);
      }
      for (const auto &[name, w] : ex.replicaIndex() == 0 ? outcome->trained : others)
        result.weightCopies.push_back({name, ex.pipelineRank(), ex.replicaIndex(), w.clone()});
      if (ex.replicaIndex() == 0)
        for (const auto &[name, g] : ex.lastGrads)
          result.gradients.emplace(name, g);
    }
    mine.merge(std::move(*outcome));
  }
  // The process's peak, whichever of its ranks loaded most.
  mine.peakResident = {cpu::peakResidentBytes()};
  mine.loadResident = {0};
  for (const auto &ex : executors)
    mine.loadResident[0] = std::max(mine.loadResident[0], ex->loadPeakResident);
  auto outcomes = l.gather(std::move(mine));
  if (!outcomes)
    return outcomes.takeError();
  if (!l.primary())
    return result;
  RankOutcome all;
  for (RankOutcome &outcome : *outcomes)
    all.merge(std::move(outcome));
  if (Error err = finishRun(s, std::move(all), result))
    return l.fail(std::move(err));
  return result;
}

} // namespace

Expected<RunResult> runLocal(const plan::Plan &plan, const RunOptions &options) {
  return launchRun(plan, options, false);
}

Expected<RunResult> runMpi(const plan::Plan &plan, const RunOptions &options) {
  return launchRun(plan, options, true);
}

} // namespace pipec::rt
