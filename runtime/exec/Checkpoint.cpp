//===- Checkpoint.cpp - A rank's checkpoints -----------------------------===//
#include "runtime/exec/Checkpoint.h"
#include "plan/PlanFile.h"
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/TensorShards.h"
#include "support/InputFile.h"

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/file.h>
#include <tuple>
#include <unistd.h>

using namespace llvm;

namespace pipec::rt {

Error RankExecutor::saveCheckpoint(StringRef file, int nextStep) {
  plan::Checkpoint c;
  c.set_next_step(nextStep);
  // A sharded optimizer's state is this replica's shard of it: the file
  // says over how many replicas.
  c.set_shards(s.shardOptimizer ? s.dp : 1);
  c.set_run(s.checkpointRun);
  c.set_plan(s.checkpointPlan);
  c.set_tensor_parallel(s.grid.T);
  for (const std::string &name : trainableHere)
    if (auto shard = s.shards.find(name); shard != s.shards.end())
      *c.add_weight_shards() = *shard->second;
  if (const TokenStream *stream = s.data->tokenStream())
    *c.mutable_stream() = stream->position(static_cast<int64_t>(nextStep) * s.globalBatch);
  auto add = [&](const cpu::Tensor &t, const std::string &name,
                 google::protobuf::RepeatedPtrField<onnx::TensorProto> &into) -> Error {
    auto host = be.download(t);
    if (!host)
      return host.takeError();
    *into.Add() = cpu::toTensorProto(*host, name);
    return Error::success();
  };
  for (const std::string &name : trainableHere) {
    if (Error err = add(weights.at(name), name, *c.mutable_weights()))
      return err;
    if (auto it = master.find(name); it != master.end())
      if (Error err = add(it->second, name, *c.mutable_masters()))
        return err;
    if (auto it = moment1.find(name); it != moment1.end() && !it->second.isNull())
      if (Error err = add(it->second, name, *c.mutable_moment1()))
        return err;
    if (auto it = moment2.find(name); it != moment2.end() && !it->second.isNull())
      if (Error err = add(it->second, name, *c.mutable_moment2()))
        return err;
  }
  for (const auto &entry : runningHere)
    if (Error err = add(weights.at(entry.first), entry.first, *c.mutable_weights()))
      return err;
  std::string bytes;
  if (!c.SerializeToString(&bytes))
    return rankError(global, "checkpoint: cannot serialize (over 2 GiB?)");
  return writeCheckpointFile(file, bytes);
}

Expected<plan::Checkpoint> RankExecutor::readCheckpoint(StringRef file) {
  auto bytes = readCheckpointFile(file);
  if (!bytes)
    return rankError(global, toString(bytes.takeError()));
  auto parsed = parseCheckpoint(*bytes);
  if (!parsed)
    return rankError(global, formatv("checkpoint {0}: {1}", file, toString(parsed.takeError())));
  return parsed;
}

Error RankExecutor::loadCheckpoint(StringRef file, int &nextStep) {
  auto parsed = readCheckpoint(file);
  if (!parsed)
    return parsed.takeError();
  if (parsed->tensor_parallel() > 1 && parsed->tensor_parallel() != s.grid.T)
    return rankError(global, formatv("checkpoint {0} holds one of {1} tensor-parallel pieces; "
                                     "this run has --tp {2}",
                                     file, parsed->tensor_parallel(), s.grid.T));
  return applyCheckpoint(*parsed, file, nextStep);
}

Error RankExecutor::loadCheckpointAcross(StringRef dir, int step, int writtenT, int &nextStep) {
  // The files of this rank's stage and replica at the T that wrote them.
  std::vector<plan::Checkpoint> pieces;
  std::string first;
  for (int t = 0; t < writtenT; ++t) {
    std::string file = checkpointFile(dir, step, (replica * s.P + rank) * writtenT + t);
    auto parsed = readCheckpoint(file);
    if (!parsed)
      return parsed.takeError();
    if (std::max(1, parsed->tensor_parallel()) != writtenT)
      return rankError(global, formatv("checkpoint {0} was written at --tp {1}, not the {2} its "
                                       "step's files make; resume with the stages and --dp "
                                       "that wrote it",
                                       file, std::max(1, parsed->tensor_parallel()), writtenT));
    if (parsed->shards() > 1 || s.shardOptimizer)
      return rankError(global, formatv("checkpoint {0}: a sharded optimizer's state resumes at "
                                       "the --tp that wrote it ({1})",
                                       file, writtenT));
    if (t == 0)
      first = file;
    pieces.push_back(std::move(*parsed));
  }
  // Each tensor whole (the pieces joined where the writer split it), then
  // this rank's piece where this run splits it.
  std::map<std::string, const plan::WeightShard *> written;
  for (const plan::WeightShard &shard : pieces[0].weight_shards())
    written[shard.weight()] = &shard;
  plan::Checkpoint merged = pieces[0];
  merged.set_tensor_parallel(s.grid.T);
  merged.clear_weight_shards();
  using Tensors = google::protobuf::RepeatedPtrField<onnx::TensorProto>;
  // The weights, masters and moments of a checkpoint.
  auto tensorsOf = [](plan::Checkpoint &c, int kind) -> Tensors & {
    return kind == 0   ? *c.mutable_weights()
           : kind == 1 ? *c.mutable_masters()
           : kind == 2 ? *c.mutable_moment1()
                       : *c.mutable_moment2();
  };
  auto recut = [&](int kind) -> Error {
    Tensors &into = tensorsOf(merged, kind);
    for (int i = 0; i < into.size(); ++i) {
      const std::string name = into.Get(i).name();
      std::vector<cpu::Tensor> parts;
      for (plan::Checkpoint &p : pieces) {
        const Tensors &theirs = tensorsOf(p, kind);
        if (i >= theirs.size() || theirs.Get(i).name() != name)
          return createStringError(inconvertibleErrorCode(), "the files of step %d list '%s' apart",
                                   step, name.c_str());
        auto t = cpu::fromTensorProto(theirs.Get(i));
        if (!t)
          return t.takeError();
        parts.push_back(std::move(*t));
      }
      auto cut = written.find(name);
      Expected<cpu::Tensor> whole =
          cut == written.end() ? std::move(parts[0]) : joinShards(parts, *cut->second);
      if (whole)
        if (auto mine = s.shards.find(name); mine != s.shards.end())
          whole = shardPiece(*whole, *mine->second, tp);
      if (!whole)
        return createStringError(inconvertibleErrorCode(), "'%s': %s", name.c_str(),
                                 toString(whole.takeError()).c_str());
      *into.Mutable(i) = cpu::toTensorProto(*whole, name);
    }
    return Error::success();
  };
  for (int kind = 0; kind < 4; ++kind)
    if (Error err = recut(kind))
      return rankError(global, formatv("checkpoint {0} at --tp {1}: {2}", first, writtenT,
                                       toString(std::move(err))));
  return applyCheckpoint(merged, first, nextStep);
}

Error RankExecutor::applyCheckpoint(const plan::Checkpoint &c, StringRef file, int &nextStep) {
  nextStep = c.next_step();
  loadNodesStale = true;
  int shards = c.shards();
  int ours = s.shardOptimizer ? s.dp : 1;
  if (shards != ours) {
    auto says = [](int n) {
      return n > 1 ? formatv("sharded over {0} replicas", n).str() : std::string("not sharded");
    };
    return rankError(global,
                     formatv("checkpoint {0} holds optimizer state {1}, this run's is {2}; resume "
                             "with the plan's --dp and --shard-optimizer of the run that wrote it",
                             file, says(shards), says(ours)));
  }
  const TokenStream *stream = s.data->tokenStream();
  if (c.has_stream() && stream &&
      (c.stream().windows() != stream->windows() || c.stream().seq_len() != stream->seqLen()))
    return rankError(global,
                     formatv("checkpoint {0} was trained on a token stream of {1} windows of {2} "
                             "tokens; --data has {3} of {4}: resuming would not continue its "
                             "order",
                             file, c.stream().windows(), c.stream().seq_len() + 1,
                             stream->windows(), stream->seqLen() + 1));
  std::set<std::string> seen;
  std::pair<const google::protobuf::RepeatedPtrField<onnx::TensorProto> *,
            std::map<std::string, cpu::Tensor> *>
      kinds[] = {{&c.weights(), &weights},
                 {&c.masters(), &master},
                 {&c.moment1(), &moment1},
                 {&c.moment2(), &moment2}};
  for (auto [tensors, into] : kinds)
    for (const onnx::TensorProto &t : *tensors) {
      auto host = cpu::fromTensorProto(t);
      if (!host)
        return rankError(global, formatv("checkpoint {0}: {1}", file, toString(host.takeError())));
      auto tensor = be.upload(*host);
      if (!tensor)
        return tensor.takeError();
      const std::string &weight = t.name();
      if (!weights.count(weight))
        return rankError(global, formatv("checkpoint {0} holds '{1}', which this rank does not "
                                         "own; was it written for another plan?",
                                         file, weight));
      if (into == &weights) {
        if (tensor->shape() != weights[weight].shape())
          return rankError(global, formatv("checkpoint {0}: '{1}' has shape {2}, the model {3}",
                                           file, weight, cpu::shapeString(tensor->shape()),
                                           cpu::shapeString(weights[weight].shape())));
        seen.insert(weight);
      }
      (*into)[weight] = std::move(*tensor);
    }
  for (const std::string &name : trainableHere)
    if (!seen.count(name))
      return rankError(global, formatv("checkpoint {0} lacks weight '{1}'", file, name));
  // The optimizer state says which optimizer wrote it: none for SGD, the
  // first moment for momentum, both for AdamW. Another optimizer would
  // resume from state it does not have, or ignore state it should use.
  auto stateOf = [](bool first, bool second) {
    return second ? Optimizer::AdamW : first ? Optimizer::Momentum : Optimizer::SGD;
  };
  for (const std::string &name : trainableHere) {
    auto m = moment1.find(name), v = moment2.find(name);
    Optimizer got = stateOf(m != moment1.end() && !m->second.isNull(),
                            v != moment2.end() && !v->second.isNull());
    if (got != s.optimizer)
      return rankError(global, formatv("checkpoint {0} holds {1}'s optimizer state for '{2}'; "
                                       "resume with --optimizer {1}, not {3}",
                                       file, optimizerName(got), name, optimizerName(s.optimizer)));
  }
  for (const auto &entry : runningHere)
    if (!seen.count(entry.first))
      return rankError(global,
                       formatv("checkpoint {0} lacks running statistic '{1}'", file, entry.first));
  return Error::success();
}

CheckpointLock &CheckpointLock::operator=(CheckpointLock &&other) noexcept {
  if (this != &other) {
    if (fd >= 0)
      ::close(fd);
    fd = other.fd;
    other.fd = -1;
  }
  return *this;
}

CheckpointLock::~CheckpointLock() {
  if (fd >= 0)
    ::close(fd); // releases the flock
}

Expected<CheckpointLock> CheckpointLock::take(StringRef dir) {
  if (std::error_code ec = sys::fs::create_directories(dir))
    return createStringError(ec, "--checkpoint %s: cannot create it: %s", dir.str().c_str(),
                             ec.message().c_str());
  SmallString<256> path(dir);
  sys::path::append(path, "lock");
  CheckpointLock lock;
  lock.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (lock.fd < 0)
    return createStringError(inconvertibleErrorCode(), "--checkpoint %s: cannot open %s: %s",
                             dir.str().c_str(), path.c_str(), std::strerror(errno));
  if (::flock(lock.fd, LOCK_EX | LOCK_NB) != 0) {
    int why = errno;
    char pid[32] = {0};
    ssize_t n = ::pread(lock.fd, pid, sizeof pid - 1, 0);
    StringRef holder = StringRef(pid, n > 0 ? size_t(n) : 0).trim();
    if (why == EWOULDBLOCK)
      return createStringError(inconvertibleErrorCode(),
                               "--checkpoint %s is in use by another run (pid %s); one run per "
                               "checkpoint folder",
                               dir.str().c_str(),
                               holder.empty() ? "unknown" : holder.str().c_str());
    return createStringError(inconvertibleErrorCode(), "--checkpoint %s: cannot lock %s: %s",
                             dir.str().c_str(), path.c_str(), std::strerror(why));
  }
  std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock.fd, 0) != 0 || ::pwrite(lock.fd, pid.data(), pid.size(), 0) < 0)
    return createStringError(inconvertibleErrorCode(), "--checkpoint %s: cannot write %s: %s",
                             dir.str().c_str(), path.c_str(), std::strerror(errno));
  return std::move(lock);
}

std::string checkpointFile(StringRef dir, int nextStep, int global) {
  SmallString<256> path(dir);
  sys::path::append(path, formatv("step-{0}", nextStep).str(),
                    formatv("rank-{0}.ckpt", global).str());
  return std::string(path);
}

Expected<int> latestCheckpoint(StringRef dir) {
  SmallString<256> latest(dir);
  sys::path::append(latest, "latest");
  auto buffer = MemoryBuffer::getFile(latest);
  if (!buffer)
    return createStringError(inconvertibleErrorCode(), "--resume: %s: %s", latest.c_str(),
                             buffer.getError().message().c_str());
  int step = 0;
  StringRef text = (*buffer)->getBuffer().trim();
  if (!text.consume_front("step-") || text.getAsInteger(10, step))
    return createStringError(inconvertibleErrorCode(), "--resume: %s does not name a step",
                             latest.c_str());
  return step;
}

namespace {

/// The checksum line of a file whose payload is a plan::Checkpoint, and
/// that of the files before it (a GraphProto whose doc_string held
/// "step=N shards=S", the identity "run=ID plan=HASH" in the line).
constexpr StringLiteral headerPrefix = "pipec-checkpoint-2 sha256=";
constexpr StringLiteral untypedPrefix = "pipec-checkpoint sha256=";

/// "run=ID plan=HASH", as errors name a file's run.
std::string identityText(StringRef run, StringRef plan) {
  return run.empty() && plan.empty() ? "" : ("run=" + run + " plan=" + plan).str();
}

} // namespace

Error writeCheckpointFile(StringRef file, StringRef payload) {
  std::string bytes = (headerPrefix + sha256Hex(payload) + "\n").str();
  bytes.append(payload.data(), payload.size());
  return writeFileAtomically(file, bytes);
}

Expected<plan::Checkpoint> parseCheckpoint(const CheckpointBytes &bytes) {
  plan::Checkpoint c;
  if (bytes.typed) {
    if (!c.ParseFromArray(bytes.payload.data(), static_cast<int>(bytes.payload.size())))
      return createStringError(inconvertibleErrorCode(), "not a pipec checkpoint");
    if (c.next_step() < 0 || c.shards() < 1)
      return createStringError(inconvertibleErrorCode(), "bad step %d or shard count %d",
                               c.next_step(), c.shards());
    return c;
  }
  // A file from before typed checkpoints: its tensors named "w:", "p:",
  // "m:" and "v:" NAME, its step and shards in the graph's doc_string.
  onnx::GraphProto g;
  if (!g.ParseFromArray(bytes.payload.data(), static_cast<int>(bytes.payload.size())) ||
      !StringRef(g.doc_string()).startswith("step="))
    return createStringError(inconvertibleErrorCode(), "not a pipec checkpoint");
  auto [step, rest] = StringRef(g.doc_string()).drop_front(5).split(' ');
  int nextStep = 0, shards = 1; // files from before sharding say nothing
  if (step.getAsInteger(10, nextStep) || nextStep < 0)
    return createStringError(inconvertibleErrorCode(), "bad step");
  if (rest.consume_front("shards=") && (rest.getAsInteger(10, shards) || shards < 1))
    return createStringError(inconvertibleErrorCode(), "bad shard count");
  c.set_next_step(nextStep);
  c.set_shards(shards);
  for (const onnx::TensorProto &t : g.initializer()) {
    StringRef name = t.name();
    auto *into = name.startswith("w:")   ? c.mutable_weights()
                 : name.startswith("p:") ? c.mutable_masters()
                 : name.startswith("m:") ? c.mutable_moment1()
                 : name.startswith("v:") ? c.mutable_moment2()
                                         : nullptr;
    if (!into)
      continue;
    onnx::TensorProto &added = *into->Add();
    added = t;
    added.set_name(name.drop_front(2).str());
  }
  return c;
}

Expected<CheckpointBytes> readCheckpointFile(StringRef file) {
  auto buffer = readInputFile(file);
  if (!buffer)
    return createStringError(inconvertibleErrorCode(), "checkpoint %s",
                             toString(buffer.takeError()).c_str());
  StringRef all = (*buffer)->getBuffer();
  auto [header, payload] = all.split('\n');
  StringRef recorded = header, identity;
  bool typed = recorded.consume_front(headerPrefix);
  if (typed || recorded.consume_front(untypedPrefix))
    std::tie(recorded, identity) = recorded.split(' ');
  else
    recorded = "";
  if (recorded.size() != 64 || payload.data() == nullptr || header.size() == all.size())
    return createStringError(inconvertibleErrorCode(),
                             "checkpoint %s has no checksum header (not a pipec checkpoint, or "
                             "one written before checkpoints carried checksums)",
                             file.str().c_str());
  std::string actual = sha256Hex(payload);
  if (actual != recorded)
    return createStringError(inconvertibleErrorCode(),
                             "checkpoint %s is corrupt: its bytes hash to sha256 %s, its header "
                             "records %s",
                             file.str().c_str(), actual.c_str(), recorded.str().c_str());
  return CheckpointBytes{std::move(*buffer), payload, typed, identity.str()};
}

Expected<std::string> checkpointIdentity(StringRef file) {
  auto buffer = readInputFile(file);
  if (!buffer)
    return createStringError(inconvertibleErrorCode(), "checkpoint %s",
                             toString(buffer.takeError()).c_str());
  auto [header, payload] = (*buffer)->getBuffer().split('\n');
  if (header.consume_front(untypedPrefix))
    return header.split(' ').second.str();
  if (!header.consume_front(headerPrefix))
    return createStringError(inconvertibleErrorCode(), "checkpoint %s has no checksum header",
                             file.str().c_str());
  // The run and the plan lead the message: read up to its first tensor.
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t *>(payload.data()),
                                            static_cast<int>(payload.size()));
  std::string run, plan;
  for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
    int field = static_cast<int>(tag >> 3);
    if (field >= plan::Checkpoint::kWeightsFieldNumber)
      break;
    std::string *text = field == plan::Checkpoint::kRunFieldNumber    ? &run
                        : field == plan::Checkpoint::kPlanFieldNumber ? &plan
                                                                      : nullptr;
    if (text ? !google::protobuf::internal::WireFormatLite::ReadString(&in, text)
             : !google::protobuf::internal::WireFormatLite::SkipField(&in, tag))
      return createStringError(inconvertibleErrorCode(), "checkpoint %s is not a pipec checkpoint",
                               file.str().c_str());
  }
  return identityText(run, plan);
}

std::vector<int> checkpointSteps(StringRef dir) {
  std::vector<int> steps;
  std::error_code ec;
  for (sys::fs::directory_iterator it(dir, ec), end; it != end && !ec; it.increment(ec)) {
    StringRef name = sys::path::filename(it->path());
    int step = 0;
    if (name.consume_front("step-") && !name.getAsInteger(10, step) && step >= 0 &&
        sys::fs::is_directory(it->path()))
      steps.push_back(step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

namespace {

/// The lowest rank whose file of \p step (\p written files) is not intact,
/// -1 when all are; collective: each of the \p ranks ranks checks the files
/// r with r mod ranks = \p global (its own, when the run that wrote them
/// had as many ranks).
Expected<int> firstBadRank(StringRef dir, int step, Comm &comm, int global, int ranks,
                           int written) {
  std::vector<double> bad(std::max(written, 1), 0.0);
  for (int r = global; r < written; r += ranks)
    if (auto mine = readCheckpointFile(checkpointFile(dir, step, r)); !mine) {
      consumeError(mine.takeError());
      bad[r] = 1;
    }
  if (Error err = comm.sumAll(bad))
    return err;
  for (int r = 0; r < written; ++r)
    if (bad[r] > 0)
      return r;
  return -1;
}

/// Why rank \p rank's file of \p step is not intact. Every rank computes
/// the same text, so whichever rank reports the error reports this one.
std::string whyBad(StringRef dir, int step, int rank) {
  auto bytes = readCheckpointFile(checkpointFile(dir, step, rank));
  return bytes ? "checkpoint " + checkpointFile(dir, step, rank) + " changed while being read"
               : toString(bytes.takeError());
}

} // namespace

int checkpointRanks(StringRef dir, int step) {
  SmallString<256> folder(dir);
  sys::path::append(folder, formatv("step-{0}", step).str());
  int written = 0;
  std::error_code ec;
  for (sys::fs::directory_iterator it(folder, ec), end; it != end && !ec; it.increment(ec)) {
    StringRef name = sys::path::filename(it->path());
    int rank = 0;
    written += name.consume_front("rank-") && name.consume_back(".ckpt") &&
               !name.getAsInteger(10, rank) && rank >= 0;
  }
  return written;
}

namespace {

/// The files of \p step to check: those written when they make whole
/// pipelines (a run at another --tp wrote them), else at least \p ranks (a
/// missing one is then found missing).
int filesToCheck(StringRef dir, int step, int ranks, int tp) {
  int written = checkpointRanks(dir, step), pipelines = ranks / std::max(1, tp);
  return written > 0 && written % pipelines == 0 ? written : std::max(written, ranks);
}

/// Succeeds when \p step holds the files of \p ranks ranks (\p stages
/// pipeline ranks times the replicas times \p tp), or of the same pipelines
/// at another tensor-parallel degree; else says how many wrote it. A run at
/// another --dp would find some files missing or left over, and a sharded
/// optimizer's state split for another number of replicas.
Error sameRanks(StringRef dir, int step, int ranks, int stages, int tp) {
  SmallString<256> folder(dir);
  sys::path::append(folder, formatv("step-{0}", step).str());
  int written = checkpointRanks(dir, step);
  int pipelines = ranks / std::max(1, tp);
  if (written == ranks || written == 0 || written % pipelines == 0)
    return Error::success(); // none: the files' own checks say why
  auto replicas = [&](int n) {
    return n % stages == 0
               ? formatv(" ({0} replicas of {1} pipeline ranks)", n / stages, stages).str()
               : std::string();
  };
  return createStringError(inconvertibleErrorCode(),
                           "checkpoint %s was written by %d ranks%s, this run has %d%s; resume "
                           "with the stages and --dp that wrote it (--tp may differ)",
                           folder.c_str(), written, replicas(written).c_str(), ranks,
                           replicas(ranks).c_str());
}

/// Succeeds when every rank's file of \p step was written by one run of one
/// plan (checkpointIdentity); else names two files that disagree.
/// Every rank reads the same headers and reaches the same answer.
Error checkOneRun(StringRef dir, int step, int ranks) {
  std::string first;
  for (int r = 0; r < ranks; ++r) {
    auto identity = checkpointIdentity(checkpointFile(dir, step, r));
    if (!identity)
      return identity.takeError();
    if (r == 0) {
      first = *identity;
    } else if (*identity != first) {
      auto text = [](const std::string &id) { return id.empty() ? std::string("none") : id; };
      return createStringError(inconvertibleErrorCode(),
                               "checkpoint step-%d mixes the files of two runs: %s (%s) and %s "
                               "(%s)",
                               step, checkpointFile(dir, step, 0).c_str(), text(first).c_str(),
                               checkpointFile(dir, step, r).c_str(), text(*identity).c_str());
    }
  }
  return Error::success();
}

} // namespace

Expected<int> agreeResumeStep(StringRef dir, ResumeMode mode, Comm &comm, int global, int ranks,
                              int stages, int tp, std::vector<std::string> &skipped) {
  if (mode == ResumeMode::Fresh)
    return 0;
  std::vector<int> steps = checkpointSteps(dir);
  if (mode == ResumeMode::IfExists) {
    for (int step : steps) {
      if (Error other = sameRanks(dir, step, ranks, stages, tp)) {
        skipped.push_back(toString(std::move(other)) + "; skipped");
        continue;
      }
      int written = filesToCheck(dir, step, ranks, tp);
      auto bad = firstBadRank(dir, step, comm, global, ranks, written);
      if (!bad)
        return bad.takeError();
      if (*bad < 0) {
        Error mixed = checkOneRun(dir, step, written);
        if (!mixed)
          return step;
        skipped.push_back(toString(std::move(mixed)) + "; skipped");
        continue;
      }
      skipped.push_back(whyBad(dir, step, *bad) + "; skipped");
    }
    return 0;
  }
  auto latest = latestCheckpoint(dir);
  if (!latest)
    return latest.takeError();
  if (Error other = sameRanks(dir, *latest, ranks, stages, tp))
    return std::move(other);
  int written = filesToCheck(dir, *latest, ranks, tp);
  auto bad = firstBadRank(dir, *latest, comm, global, ranks, written);
  if (!bad)
    return bad.takeError();
  if (*bad < 0) {
    if (Error mixed = checkOneRun(dir, *latest, written))
      return std::move(mixed);
    return *latest;
  }
  std::string why = whyBad(dir, *latest, *bad);
  for (int step : steps) {
    if (step >= *latest)
      continue;
    auto earlier = firstBadRank(dir, step, comm, global, ranks, filesToCheck(dir, step, ranks, tp));
    if (!earlier)
      return earlier.takeError();
    if (*earlier < 0) {
      SmallString<256> intact(dir);
      sys::path::append(intact, formatv("step-{0}", step).str());
      return createStringError(inconvertibleErrorCode(),
                               "%s; the newest intact checkpoint is %s (--resume-if-exists "
                               "continues from it)",
                               why.c_str(), intact.c_str());
    }
  }
  return createStringError(inconvertibleErrorCode(), "%s; no earlier checkpoint in %s is intact",
                           why.c_str(), dir.str().c_str());
}

Error pruneCheckpoints(StringRef dir, int keep, int newest) {
  int kept = 0;
  for (int step : checkpointSteps(dir)) {
    if (step > newest || ++kept <= keep)
      continue;
    SmallString<256> folder(dir);
    sys::path::append(folder, formatv("step-{0}", step).str());
    std::error_code ec;
    std::vector<std::string> files;
    for (sys::fs::directory_iterator it(folder, ec), end; it != end && !ec; it.increment(ec)) {
      StringRef name = sys::path::filename(it->path());
      if (name.startswith("rank-") && (name.endswith(".ckpt") || name.endswith(".ckpt.tmp")))
        files.push_back(it->path());
    }
    for (const std::string &file : files)
      if (std::error_code rc = sys::fs::remove(file))
        return createStringError(rc, "--keep-checkpoints: cannot remove %s: %s", file.c_str(),
                                 rc.message().c_str());
    sys::fs::remove(folder); // fails, harmlessly, when other files remain
  }
  return Error::success();
}

} // namespace pipec::rt
