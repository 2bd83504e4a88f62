//===- Launcher.cpp - Where a job's ranks run, for run and generate -----===//
#include "runtime/exec/Launcher.h"
#include "runtime/exec/Trace.h"
#include "support/Parallel.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <mutex>
#include <thread>

using namespace llvm;

namespace pipec::rt {

void RankOutcome::merge(RankOutcome &&other) {
  for (auto &[name, parts] : other.outputs)
    outputs[name].insert(std::make_move_iterator(parts.begin()),
                         std::make_move_iterator(parts.end()));
  for (auto &[name, w] : other.trained)
    trained.emplace(name, std::move(w));
  events.insert(events.end(), other.events.begin(), other.events.end());
  for (const auto &[op, count] : other.fallbacks)
    fallbacks[op] += count;
  peakResident.insert(peakResident.end(), other.peakResident.begin(), other.peakResident.end());
  loadResident.insert(loadResident.end(), other.loadResident.begin(), other.loadResident.end());
  for (const auto &[rank, bytes] : other.devicePeak)
    devicePeak[rank] = std::max(devicePeak[rank], bytes);
  if (!other.tokens.empty()) {
    tokens = std::move(other.tokens);
    tokenTimes = std::move(other.tokenTimes);
  }
}

namespace {

/// The outcome as the message a process sends rank 0.
plan::RankResult toMessage(const RankOutcome &outcome) {
  plan::RankResult message;
  for (const auto &[name, w] : outcome.trained)
    *message.add_weights() = cpu::toTensorProto(w, name);
  for (const auto &[name, parts] : outcome.outputs)
    for (const auto &[start, t] : parts) {
      plan::OutputPart *part = message.add_outputs();
      part->set_start(start);
      *part->mutable_tensor() = cpu::toTensorProto(t, name);
    }
  addEvents(message, outcome.events);
  for (const auto &[op, count] : outcome.fallbacks)
    (*message.mutable_fallback_ops())[op] = count;
  if (!outcome.peakResident.empty())
    message.set_peak_resident_bytes(outcome.peakResident.front());
  if (!outcome.loadResident.empty())
    message.set_load_resident_bytes(outcome.loadResident.front());
  message.mutable_tokens()->Add(outcome.tokens.begin(), outcome.tokens.end());
  for (const std::vector<double> &times : outcome.tokenTimes)
    message.add_token_times()->mutable_seconds()->Add(times.begin(), times.end());
  return message;
}

Expected<RankOutcome> fromMessage(const plan::RankResult &message) {
  RankOutcome outcome;
  appendEvents(message, outcome.events);
  for (const auto &[op, count] : message.fallback_ops())
    outcome.fallbacks[op] += count;
  outcome.peakResident = {message.peak_resident_bytes()};
  outcome.loadResident = {message.load_resident_bytes()};
  for (const plan::OutputPart &part : message.outputs()) {
    auto tensor = cpu::fromTensorProto(part.tensor());
    if (!tensor)
      return tensor.takeError();
    outcome.outputs[part.tensor().name()][part.start()] = std::move(*tensor);
  }
  for (const onnx::TensorProto &t : message.weights()) {
    auto tensor = cpu::fromTensorProto(t);
    if (!tensor)
      return tensor.takeError();
    outcome.trained.emplace(t.name(), std::move(*tensor));
  }
  outcome.tokens.assign(message.tokens().begin(), message.tokens().end());
  for (const plan::GroupTimes &times : message.token_times())
    outcome.tokenTimes.emplace_back(times.seconds().begin(), times.seconds().end());
  return outcome;
}

/// The backend of one rank: the CPU, or CUDA device \p device.
Expected<std::unique_ptr<Backend>> makeBackend(const Shared &s, int device, int pipelineRank) {
  if (s.options.backend == "cpu")
    return makeCpuBackend();
  if (s.options.backend != "cuda")
    return createStringError(inconvertibleErrorCode(), "--backend %s: expected cpu or cuda",
                             s.options.backend.c_str());
  std::string precision =
      s.options.precision.empty() ? s.plan->training().precision() : s.options.precision;
  auto backend = makeCudaBackend(device, precision == "bf16");
  if (!backend)
    return backend.takeError();
  if (Error err = (*backend)->reserve(s.plan->ranks(pipelineRank).peak_memory_bytes()))
    return err;
  return backend;
}

} // namespace

Expected<std::unique_ptr<Launcher>> Launcher::open(const RunOptions &options, bool mpi) {
  keepFreedMemory();
  std::unique_ptr<Launcher> launcher(new Launcher(options, mpi));
  if (!mpi)
    return launcher;
  auto comm = makeMpiComm(options.timeoutSeconds);
  if (!comm)
    return comm.takeError();
  launcher->comms.push_back(std::move(*comm));
  return launcher;
}

Error Launcher::fail(Error err) {
  if (!mpi)
    return err; // as it is: a flag's error keeps its exit code
  std::string text = toString(std::move(err));
  comms[0]->fail(text);
  return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
}

Error Launcher::place(const Shared &s, StringRef layout, function_ref<int(int)> computing) {
  int ranks = s.grid.ranks();
  if (!mpi) {
    // Each local rank is a thread with its own weights, gradients and
    // optimizer state; past a few hundred that is a memory runaway, not a
    // run.
    constexpr int maxLocalRanks = 256;
    if (ranks > maxLocalRanks)
      return createStringError(inconvertibleErrorCode(),
                               "the plan has %d ranks as threads of one process (at most %d); "
                               "run it under mpirun with --comm mpi",
                               ranks, maxLocalRanks);
    threads = shareCores(options, computing(ranks));
    world = std::make_unique<LocalWorld>(ranks, options.timeoutSeconds);
    for (int r = 0; r < ranks; ++r) {
      auto backend =
          makeBackend(s, r / std::max(1, options.ranksPerDevice), s.grid.pipelineRankOf(r));
      if (!backend)
        return backend.takeError();
      backends.push_back(std::move(*backend));
      comms.push_back(world->comm(r));
    }
    return Error::success();
  }
  Comm &comm = *comms[0];
  if (comm.size() != ranks) {
    // Every process finds it: rank 0 says it once.
    Error err = createStringError(inconvertibleErrorCode(),
                                  "the plan has %s; mpirun started %d (use mpirun -np %d)",
                                  layout.str().c_str(), comm.size(), ranks);
    return comm.rank() == 0 ? fail(std::move(err)) : std::move(err);
  }
  // Processes on one node share its cores.
  threads = shareCores(options, computing(comm.ranksOnThisNode()));
  setLoopThreads(threads);
  int device = comm.indexOnThisNode() / std::max(1, options.ranksPerDevice);
  auto backend = makeBackend(s, device, s.grid.pipelineRankOf(comm.rank()));
  if (!backend)
    return fail(backend.takeError());
  backends.push_back(std::move(*backend));
  if (options.comm == "nccl") {
    auto nccl = makeNcclComm(std::move(comms[0]), device, options.timeoutSeconds);
    if (!nccl)
      return nccl.takeError();
    comms[0] = std::move(*nccl);
  }
  return Error::success();
}

std::vector<std::string> Launcher::rankNodes() const {
  std::vector<std::string> nodes;
  if (mpi)
    for (int r = 0; r < comms[0]->size(); ++r)
      nodes.push_back(comms[0]->nodeOf(r));
  return nodes;
}

Error Launcher::together() {
  if (!mpi)
    return Error::success();
  double none[1] = {0};
  if (Error err = comms[0]->sumAll(none))
    return fail(std::move(err));
  return Error::success();
}

Error Launcher::run(function_ref<Error(int)> body) {
  if (mpi) {
    if (Error err = body(0))
      return fail(std::move(err));
    return Error::success();
  }
  int ranks = ranksHere();
  std::vector<std::string> errors(ranks);
  std::mutex errorMutex;
  int firstFailed = -1;
  auto runOne = [&](int r) {
    // With one BLAS thread a rank computes on its own thread only: give
    // each its own core while there are enough.
    if (threads == 1)
      pinToCore(r, ranks);
    setLoopThreads(threads);
    if (Error err = body(r)) {
      std::string text = toString(std::move(err));
      {
        std::lock_guard<std::mutex> lock(errorMutex);
        if (firstFailed < 0)
          firstFailed = r;
      }
      errors[r] = text;
      comms[r]->fail(text);
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < ranks; ++r)
    others.emplace_back(runOne, r);
  runOne(0);
  if (threads == 1)
    pinToCore(-1, ranks); // the caller's thread gets its mask back
  for (std::thread &t : others)
    t.join();
  if (firstFailed >= 0)
    return createStringError(inconvertibleErrorCode(), "%s", errors[firstFailed].c_str());
  return Error::success();
}

Expected<uint64_t> Launcher::fromPrimary(uint64_t value) {
  if (!mpi)
    return value;
  // In two exact halves.
  uint64_t mine = primary() ? value : 0;
  double halves[2] = {double(mine >> 32), double(mine & 0xffffffffu)};
  if (Error err = comms[0]->sumAll(halves))
    return fail(std::move(err));
  return (uint64_t(halves[0]) << 32) | uint64_t(halves[1]);
}

Expected<std::vector<RankOutcome>> Launcher::gather(RankOutcome mine) {
  std::vector<RankOutcome> all;
  if (!mpi) {
    all.push_back(std::move(mine));
    return all;
  }
  Comm &comm = *comms[0];
  std::string bytes;
  if (!toMessage(mine).SerializeToString(&bytes))
    return fail(rankError(comm.rank(), "its results are over protobuf's 2 GiB limit"));
  auto gathered = comm.gather(bytes);
  if (!gathered)
    return fail(gathered.takeError());
  if (!primary())
    return all;
  for (size_t from = 0; from < gathered->size(); ++from) {
    plan::RankResult message;
    if (!message.ParseFromString((*gathered)[from]))
      return fail(rankError(0, formatv("rank {0}'s results did not parse", from)));
    auto theirs = fromMessage(message);
    if (!theirs)
      return fail(theirs.takeError());
    all.push_back(std::move(*theirs));
  }
  return all;
}

} // namespace pipec::rt
