//===- Generate.cpp - `pipec generate`: the token loop of a decoder plan -===//
#include "runtime/exec/Generate.h"
#include "ops/OpRegistry.h"
#include "plan/PlanFile.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/exec/Launcher.h"
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/Trace.h"
#include "support/Diagnostics.h"
#include "support/Parallel.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

using namespace llvm;

namespace pipec::rt {

/// What every rank of one generation shares (read-only once made).
struct GenerationJob {
  const Shared *s = nullptr;
  const plan::Generation *g = nullptr;
  const GenerateOptions *o = nullptr;
  const cpu::Tensor *prompts = nullptr;
  int64_t promptCount = 0, promptLength = 0;
  int64_t rows = 1; ///< rows (slots) per group
  int64_t groups = 1;
};

namespace {

/// A uniform double in [0, 1) drawn from (seed, prompt, position) alone.
double uniformFor(uint64_t seed, int64_t prompt, int64_t position) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t z = mix(mix(mix(seed) ^ uint64_t(prompt)) ^ uint64_t(position));
  return double(z >> 11) * 0x1.0p-53;
}

/// The token row \p logits picks under \p o (\p prompt and \p position seed a
/// draw).
int64_t pickToken(const GenerateOptions &o, ArrayRef<double> logits, int64_t prompt,
                  int64_t position) {
  if (o.greedy)
    return std::max_element(logits.begin(), logits.end()) - logits.begin();
  // transformers' order: temperature, top-k, top-p, then a draw.
  std::vector<int64_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
  size_t kept = order.size();
  if (o.topK > 0 && size_t(o.topK) < kept) {
    // Ties with the k-th are kept, as a threshold on its value keeps them.
    double threshold = logits[order[o.topK - 1]];
    kept = o.topK;
    while (kept < order.size() && logits[order[kept]] >= threshold)
      ++kept;
  }
  std::vector<double> p(kept);
  double top = logits[order[0]] / o.temperature, total = 0;
  for (size_t i = 0; i < kept; ++i)
    total += p[i] = std::exp(logits[order[i]] / o.temperature - top);
  if (o.topP < 1) {
    // The smallest head of the sorted tokens whose probability reaches
    // top-p (at least one).
    double sum = 0;
    size_t head = 0;
    while (head < kept && sum < o.topP * total)
      sum += p[head++];
    kept = std::max<size_t>(head, 1);
    total = std::accumulate(p.begin(), p.begin() + kept, 0.0);
  }
  double u = uniformFor(o.seed, prompt, position) * total;
  for (size_t i = 0; i < kept; ++i) {
    u -= p[i];
    if (u < 0)
      return order[i];
  }
  return order[kept - 1];
}

/// One group's cache of one past input: the tensor, and where its
/// positions lie.
struct CacheSlot {
  const plan::Generation::Cache *entry = nullptr;
  std::vector<cpu::Tensor> groups;
};

/// Copies, for each row of \p rows (the cache's batch axis \p batchAxis),
/// \p count positions along \p axis of the present into \p past from the
/// row's position on (host tensors; the present the longer). They are the
/// present's last (Concat), or \p inPlace at the row's position too
/// (GroupQueryAttention's buffer).
void writePositions(cpu::Tensor &past, const cpu::Tensor &present, int batchAxis, int axis,
                    ArrayRef<int64_t> at, int64_t count, bool inPlace) {
  ArrayRef<int64_t> shape = past.shape();
  int64_t outer = 1, inner = 1, between = 1;
  for (int i = 0; i < axis; ++i)
    outer *= shape[i];
  for (int i = batchAxis + 1; i < axis; ++i)
    between *= shape[i];
  for (size_t i = axis + 1; i < shape.size(); ++i)
    inner *= shape[i];
  size_t bytes = inner * cpu::storageSize(past.elemType());
  int64_t pastLength = shape[axis], presentLength = present.shape()[axis];
  auto *to = static_cast<char *>(past.rawData());
  const auto *from = static_cast<const char *>(present.rawData());
  for (int64_t o = 0; o < outer; ++o) {
    int64_t row = (o / between) % shape[batchAxis];
    int64_t source = inPlace ? at[row] : presentLength - count;
    std::memcpy(to + (o * pastLength + at[row]) * bytes,
                from + (o * presentLength + source) * bytes, count * bytes);
  }
}

const plan::DataInput *dataInput(const plan::Plan &plan, StringRef name) {
  for (const plan::DataInput &d : plan.data())
    if (d.name() == name)
      return &d;
  return nullptr;
}

/// A zero host tensor of graph input \p name's type and one group's shape.
Expected<cpu::Tensor> zerosFor(const plan::Plan &plan, StringRef name) {
  const plan::DataInput *d = dataInput(plan, name);
  if (!d)
    return createStringError(inconvertibleErrorCode(), "the plan feeds no input '%s'",
                             name.str().c_str());
  auto type = elemTypeOfName(d->dtype());
  if (!type)
    return type.takeError();
  return cpu::Tensor(*type, std::vector<int64_t>(d->shape().begin(), d->shape().end()));
}

} // namespace

/// One rank's state in the token loop: its passes, its caches, each group's
/// control and picks, and what it measured.
struct GenerationLoop {
  /// One of the passes a rank runs: the decode step (a token per row) or the
  /// prefill (a prompt per row), each its own plan's stage program.
  struct Pass {
    const Shared *s = nullptr;
    RankExecutor *ex = nullptr;
    int64_t tokens = 1; ///< per row
    /// The prefill's past inputs: zeros of its shape (every position masked).
    std::map<std::string, cpu::Tensor> pasts;
  };

  /// What a pass of a group does, as SCHEDULE decides it on the first rank
  /// and the control tensor (int64 [rows + 1, 2]) carries it down the stages:
  /// per row its prompt (-1: an idle slot) and the cache positions written
  /// before, then the pass's kind.
  enum class Kind : int64_t { Decode = 0, Prefill = 1, Stop = 2 };
  struct Control {
    std::vector<int64_t> request, position;
    Kind kind = Kind::Decode;

    cpu::Tensor tensor() const {
      int64_t rows = request.size();
      cpu::Tensor t(DType::I64, {rows + 1, 2});
      int64_t *d = t.data<int64_t>();
      for (int64_t i = 0; i < rows; ++i) {
        d[2 * i] = request[i];
        d[2 * i + 1] = position[i];
      }
      d[2 * rows] = int64_t(kind);
      return t;
    }
    static Control of(const cpu::Tensor &t) {
      Control c;
      int64_t rows = t.dim(0) - 1;
      for (int64_t i = 0; i < rows; ++i) {
        c.request.push_back(t.getInt64(2 * i));
        c.position.push_back(t.getInt64(2 * i + 1));
      }
      c.kind = Kind(t.getInt64(2 * rows));
      return c;
    }
  };

  GenerationLoop(const GenerationJob &job, Pass decode, std::optional<Pass> prefill,
                 Clock::time_point start)
      : job(job), decode(std::move(decode)), prefill(std::move(prefill)), start(start) {}

  const GenerationJob &job;
  Pass decode;
  std::optional<Pass> prefill;
  Clock::time_point start;
  /// Per cache input this rank's stage loads: one tensor per group, and its
  /// batch axis.
  std::map<std::string, std::vector<cpu::Tensor>> caches;
  std::map<std::string, int> batchAxes;
  /// Per group: its pass's control, the token each row feeds next (first
  /// rank), the picks of its last pass, whether it stops in this round and
  /// whether it stopped.
  std::vector<Control> control;
  std::vector<std::vector<int64_t>> next;
  std::vector<cpu::Tensor> picks;
  std::vector<bool> stopping, stopped;
  /// The first rank: the next prompt to start.
  int64_t waiting = 0;
  /// The group whose pass this rank runs now, and its values.
  int current = -1;
  Env values;
  /// Last rank: the picked tokens [prompts x new], and when each prompt's
  /// tokens came (seconds since the start).
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> tokenTimes;
  /// With --trace: this rank's passes and waits.
  std::vector<TraceEvent> events;

  Pass &pass(int group) { return control[group].kind == Kind::Prefill ? *prefill : decode; }
  /// The prompt the first rank gives a freed slot, or -1.
  int64_t nextRequest() { return waiting < job.promptCount ? waiting++ : -1; }
};

namespace {

using Kind = GenerationLoop::Kind;
using Control = GenerationLoop::Control;
using Pass = GenerationLoop::Pass;

/// Whether \p ins moves the control, which a stopping group still passes.
bool movesControl(const Ins &ins) {
  return (ins.op() == Ins::SEND || ins.op() == Ins::RECV) &&
         ins.tensor().name() == generationControl;
}

} // namespace

void RankExecutor::traceLoop(GenerationLoop &loop, char category, const std::string &name,
                             double started) {
  if (!loop.job.o->tracePath.empty())
    loop.events.push_back({name, category, rank, started, wallNow() - started});
}

Expected<cpu::Tensor> RankExecutor::receiveLoop(GenerationLoop &loop, const Ins &ins) {
  auto type = elemTypeOfName(ins.tensor().dtype());
  if (!type)
    return type.takeError();
  auto handle =
      comm.postRecv(ins.peer(), *type, {ins.tensor().shape().begin(), ins.tensor().shape().end()});
  if (!handle)
    return handle.takeError();
  double started = wallNow();
  auto got = comm.wait(*handle);
  if (got && wallNow() - started > 1e-5) {
    bool picks = ins.tensor().name() == generationPicks;
    traceLoop(loop, 'C', formatv("{0} g{1}", picks ? "picks" : "recv", ins.microbatch()).str(),
              started);
  }
  return got;
}

Error RankExecutor::schedule(GenerationLoop &loop, int group, bool first) {
  const GenerationJob &job = loop.job;
  Control &c = loop.control[group];
  if (first) {
    c.request.resize(job.rows);
    c.position.assign(job.rows, 0);
    for (int64_t &r : c.request)
      r = loop.nextRequest();
    // Prompts of the prefill's length go through in one pass.
    c.kind = loop.prefill ? Kind::Prefill : Kind::Decode;
    if (c.request[0] < 0)
      c.kind = Kind::Stop; // more slots than prompts
    return Error::success();
  }
  const cpu::Tensor &picks = loop.picks[group];
  if (picks.isNull() || picks.numElements() != 2 * job.rows)
    return rankError(rank, formatv("group {0} has no picks of its last pass", group));
  int64_t n = c.kind == Kind::Prefill ? loop.prefill->tokens : 1;
  for (int64_t i = 0; i < job.rows; ++i) {
    if (c.request[i] < 0)
      continue;
    c.position[i] += n;
    loop.next[group][i] = picks.getInt64(i);
    if (picks.getInt64(job.rows + i)) {
      // Finished: the slot takes the next waiting prompt, from position 0.
      c.request[i] = loop.nextRequest();
      c.position[i] = 0;
    }
  }
  c.kind = Kind::Decode;
  if (std::all_of(c.request.begin(), c.request.end(), [](int64_t r) { return r < 0; }))
    c.kind = Kind::Stop;
  return Error::success();
}

Error RankExecutor::loadPass(GenerationLoop &loop, int group) {
  const GenerationJob &job = loop.job;
  const plan::Generation &g = *job.g;
  const Control &c = loop.control[group];
  Pass &pass = loop.pass(group);
  int64_t n = pass.tokens, length = g.max_length();
  for (const std::string &name : pass.s->programs[rank].loads()) {
    cpu::Tensor host;
    if (name == g.tokens() || name == g.positions() || name == g.mask()) {
      auto t = zerosFor(*pass.s->plan, name);
      if (!t)
        return t.takeError();
      host = std::move(*t);
      for (int64_t i = 0; i < job.rows; ++i) {
        int64_t from = c.request[i] < 0 ? 0 : c.position[i];
        if (name == g.mask()) {
          // The positions written before, and this pass's (the present's
          // last n).
          for (int64_t j = 0; j < from; ++j)
            host.setDouble(i * length + j, 1);
          for (int64_t j = length - n; j < length; ++j)
            host.setDouble(i * length + j, 1);
          continue;
        }
        for (int64_t k = 0; k < n; ++k) {
          int64_t position = from + k, token = 0;
          if (c.request[i] >= 0)
            token = position < job.promptLength
                        ? job.prompts->getInt64(c.request[i] * job.promptLength + position)
                        : loop.next[group][i];
          host.setDouble(i * n + k, double(name == g.tokens() ? token : position));
        }
      }
    } else if (auto zeros = pass.pasts.find(name); zeros != pass.pasts.end()) {
      host = zeros->second;
    } else if (auto cache = loop.caches.find(name); cache != loop.caches.end()) {
      host = cache->second[group];
    } else {
      return rankError(rank, formatv("stage {0} reads input '{1}', which has no role in "
                                     "generation",
                                     rank, name));
    }
    auto placed = be.upload(host);
    if (!placed)
      return placed.takeError();
    loop.values[name] = std::move(*placed);
  }
  return Error::success();
}

Error RankExecutor::forwardPass(GenerationLoop &loop, int group) {
  const GenerationJob &job = loop.job;
  const Control &control = loop.control[group];
  Pass &pass = loop.pass(group);
  double started = wallNow();
  if (Error err = pass.ex->runForward(rank, loop.values))
    return err;
  traceLoop(loop, 'F',
            formatv("{0} g{1}", control.kind == Kind::Prefill ? "prefill" : "decode", group).str(),
            started);
  std::vector<int64_t> at(job.rows);
  for (int64_t i = 0; i < job.rows; ++i)
    at[i] = control.request[i] < 0 ? 0 : control.position[i];
  for (const plan::Generation::Cache &c : job.g->cache()) {
    if (c.stage() != rank)
      continue;
    // This pass's positions alone where the stage keeps them (a decode
    // step's), else the present, whose last positions they are.
    const cpu::Tensor *present = c.appended().empty() ? nullptr : loop.values.find(c.appended());
    if (!present)
      present = loop.values.find(c.present());
    if (!present)
      return rankError(rank,
                       formatv("stage {0} did not make the present '{1}'", rank, c.present()));
    auto host = be.download(*present);
    if (!host)
      return host.takeError();
    writePositions(loop.caches[c.past()][group], *host, loop.batchAxes[c.past()], c.axis(), at,
                   pass.tokens, c.in_place());
  }
  return Error::success();
}

Error RankExecutor::pick(GenerationLoop &loop, int group) {
  const GenerationJob &job = loop.job;
  const Control &control = loop.control[group];
  const cpu::Tensor *found = loop.values.find(job.g->logits());
  if (!found)
    return rankError(rank,
                     formatv("the last stage did not make the logits '{0}'", job.g->logits()));
  auto logits = be.download(*found);
  if (!logits)
    return logits.takeError();
  int64_t vocab = job.g->vocab(), rows = job.rows, limit = job.o->maxNewTokens;
  int64_t tokens = loop.pass(group).tokens;
  // The prefill's head may have made the last position's alone.
  if (logits->numElements() == rows * vocab)
    tokens = 1;
  if (logits->numElements() != rows * tokens * vocab)
    return rankError(rank, formatv("the logits '{0}' are {1}, not [{2}, {3}, {4}]", job.g->logits(),
                                   cpu::shapeString(logits->shape()), rows, tokens, vocab));
  double now = std::chrono::duration<double>(Clock::now() - loop.start).count();
  cpu::Tensor picks(DType::I64, {2, rows});
  int64_t *d = picks.data<int64_t>();
  std::vector<double> row(vocab);
  int64_t n = control.kind == Kind::Prefill ? job.promptLength : 1;
  for (int64_t i = 0; i < rows; ++i) {
    int64_t request = control.request[i];
    // The index among the new tokens of the one this pass picks.
    int64_t index = request < 0 ? -1 : control.position[i] + n - job.promptLength;
    if (index < 0)
      continue;
    int64_t base = (i * tokens + tokens - 1) * vocab;
    for (int64_t v = 0; v < vocab; ++v)
      row[v] = logits->getDouble(base + v);
    int64_t token = pickToken(*job.o, row, request, index);
    bool eos = job.o->eos && token == *job.o->eos;
    loop.tokens[request * limit + index] = token;
    loop.tokenTimes[request].push_back(now);
    if (eos)
      // The rest of the row is the EOS id, as transformers pads it.
      std::fill(loop.tokens.begin() + request * limit + index + 1,
                loop.tokens.begin() + (request + 1) * limit, token);
    d[i] = token;
    d[rows + i] = eos || index + 1 == limit;
  }
  loop.picks[group] = std::move(picks);
  return Error::success();
}

Error RankExecutor::loopStep(GenerationLoop &loop, const Ins &ins, bool first) {
  int group = ins.microbatch();
  if (group < 0 || group >= loop.job.groups)
    return rankError(rank,
                     formatv("the token loop names group {0} of {1}", group, loop.job.groups));
  if (loop.stopped[group] || (loop.stopping[group] && !movesControl(ins)))
    return Error::success();
  bool control = movesControl(ins);
  switch (ins.op()) {
  case Ins::SCHEDULE:
    if (Error err = schedule(loop, group, first))
      return err;
    break;
  case Ins::RECV: {
    auto got = receiveLoop(loop, ins);
    if (!got)
      return got.takeError();
    if (ins.tensor().name() == generationPicks) {
      loop.picks[group] = std::move(*got);
      return Error::success();
    }
    if (!control) {
      auto placed = be.upload(*got);
      if (!placed)
        return placed.takeError();
      if (loop.current != group)
        return rankError(
            rank, formatv("group {0}'s '{1}' came before its control", group, ins.tensor().name()));
      loop.values[ins.tensor().name()] = std::move(*placed);
      return Error::success();
    }
    if (got->rank() != 2 || got->dim(0) != loop.job.rows + 1 || got->dim(1) != 2)
      return rankError(
          rank, formatv("group {0}'s control is {1}", group, cpu::shapeString(got->shape())));
    loop.control[group] = Control::of(*got);
    break;
  }
  case Ins::LOAD:
    return loadPass(loop, group);
  case Ins::FORWARD:
    return forwardPass(loop, group);
  case Ins::PICK:
    return pick(loop, group);
  case Ins::SEND: {
    if (control)
      return comm.send(ins.peer(), loop.control[group].tensor());
    if (ins.tensor().name() == generationPicks)
      return comm.send(ins.peer(), loop.picks[group]);
    const cpu::Tensor *sent = loop.values.find(ins.tensor().name());
    if (!sent)
      return rankError(
          rank, formatv("stage {0}: '{1}' to send was not computed", rank, ins.tensor().name()));
    auto host = be.download(*sent);
    if (!host)
      return host.takeError();
    return comm.send(ins.peer(), *host);
  }
  default:
    return rankError(rank, formatv("{0} is not a step of the token loop", Ins::Op_Name(ins.op())));
  }
  // SCHEDULE, or the control received: the group's pass begins.
  if (loop.control[group].kind == Kind::Stop) {
    loop.stopping[group] = true;
    return Error::success();
  }
  if (loop.control[group].kind == Kind::Prefill && !loop.prefill)
    return rankError(rank,
                     formatv("group {0}'s pass is a prefill, which this rank has not", group));
  loop.current = group;
  loop.values = loop.pass(group).ex->makeEnv();
  return Error::success();
}

Error RankExecutor::generate(GenerationLoop &loop) {
  const GenerationJob &job = loop.job;
  for (const plan::Generation::Cache &c : job.g->cache())
    if (c.stage() == rank) {
      const plan::DataInput *d = dataInput(*job.s->plan, c.past());
      if (!d || d->batch_axis() >= c.axis())
        return rankError(rank, formatv("the cache '{0}' does not hold its rows before its "
                                       "positions",
                                       c.past()));
      loop.batchAxes[c.past()] = d->batch_axis();
      for (int64_t g = 0; g < job.groups; ++g) {
        auto zeros = zerosFor(*job.s->plan, c.past());
        if (!zeros)
          return zeros.takeError();
        loop.caches[c.past()].push_back(std::move(*zeros));
      }
    }
  if (rank + 1 == s.P) {
    loop.tokens.assign(job.promptCount * job.o->maxNewTokens, 0);
    loop.tokenTimes.assign(job.promptCount, {});
  }
  loop.control.assign(job.groups, Control());
  loop.next.assign(job.groups, std::vector<int64_t>(job.rows, 0));
  loop.picks.assign(job.groups, cpu::Tensor());
  loop.stopping.assign(job.groups, false);
  loop.stopped.assign(job.groups, false);
  // The plan's streams: the start (the prefill's, when it runs), then
  // rounds until every group stopped.
  const plan::GenerationStreams &own = program.generation();
  const auto &start =
      loop.prefill ? loop.prefill->s->plan->programs(rank).generation().start() : own.start();
  for (bool first = true;
       std::find(loop.stopped.begin(), loop.stopped.end(), false) != loop.stopped.end();
       first = false) {
    for (const Ins &ins : first ? start : own.round())
      if (Error err = loopStep(loop, ins, first))
        return err;
    for (int g = 0; g < job.groups; ++g)
      if (loop.stopping[g])
        loop.stopped[g] = true;
  }
  return comm.flush();
}

namespace {} // namespace

Error checkGenerate(const plan::Plan &plan, const GenerateOptions &o, const cpu::Tensor &prompts) {
  if (!plan.has_generation())
    return createStringError(inconvertibleErrorCode(),
                             "the plan was not compiled for generation: compile the model with "
                             "--mode generate --max-length L");
  const plan::Generation &g = plan.generation();
  if (plan.stages_size() != plan.schedule().stages())
    return createStringError(inconvertibleErrorCode(),
                             "generation runs one stage per rank; the plan has %d stages on %d "
                             "ranks",
                             plan.stages_size(), plan.schedule().stages());
  if (plan.schedule().data_parallel() != 1)
    return createStringError(inconvertibleErrorCode(),
                             "generation runs one pipeline; the plan has --dp %d",
                             plan.schedule().data_parallel());
  if (plan.schedule().tensor_parallel() > 1)
    return createStringError(inconvertibleErrorCode(),
                             "generation runs without tensor parallelism; the plan has --tp %d",
                             plan.schedule().tensor_parallel());
  if (prompts.rank() != 2 || prompts.dim(0) < 1 || prompts.dim(1) < 1 ||
      !cpu::isInteger(prompts.elemType()))
    return usageError(formatv("--prompts: expected integer token ids [prompts, length], got {0} "
                              "{1}",
                              cpu::elemTypeName(prompts.elemType()),
                              cpu::shapeString(prompts.shape())));
  if (o.maxNewTokens < 1)
    return usageError(formatv("--max-new-tokens {0}: must be at least 1", o.maxNewTokens));
  int64_t length = prompts.dim(1);
  if (length + o.maxNewTokens > g.max_length())
    return usageError(formatv("--prompts: prompts of {0} tokens and {1} new need {2} positions; "
                              "the plan holds {3} (--max-length)",
                              length, o.maxNewTokens, length + o.maxNewTokens, g.max_length()));
  for (int64_t i = 0; i < prompts.numElements(); ++i)
    if (int64_t id = prompts.getInt64(i); id < 0 || id >= g.vocab())
      return usageError(formatv("--prompts: prompt {0} token {1} is {2}, outside the "
                                "vocabulary of {3}",
                                i / length, i % length, id, g.vocab()));
  if (o.eos && (*o.eos < 0 || *o.eos >= g.vocab()))
    return usageError(formatv("--eos {0}: outside the vocabulary of {1}", *o.eos, g.vocab()));
  if (!o.greedy) {
    if (!(o.temperature > 0) || !std::isfinite(o.temperature))
      return usageError(formatv("--temperature {0}: must be above 0", o.temperature));
    if (o.topK < 0)
      return usageError(formatv("--top-k {0}: must be at least 0", o.topK));
    if (!(o.topP > 0 && o.topP <= 1))
      return usageError(formatv("--top-p {0}: must be in (0, 1]", o.topP));
  }
  return Error::success();
}

namespace {

/// The constant inputs of the Slice keepLastPosition adds: starts, ends and
/// axes of the last position on axis 1.
constexpr const char *lastPositionInputs[3] = {
    "pipec.last-position.starts", "pipec.last-position.ends", "pipec.last-position.axes"};

/// Only the last position's logits pick a token: the prefill's head (the
/// MatMul that makes the logits from [rows, S, width]) runs on that
/// position alone, as transformers' logits_to_keep does. The head is the
/// largest product of a prefill (its vocabulary wide); the logits become
/// [rows, 1, vocab].
void keepLastPosition(Shared &prefill, const std::string &logits) {
  for (plan::StageProgram &sp : prefill.programs)
    for (int i = 0; i < sp.forward_size(); ++i) {
      onnx::NodeProto &head = *sp.mutable_forward(i);
      bool product = isOp(head, OpId::MatMul) || isOp(head, OpId::MatMulBias) ||
                     isOp(head, OpId::MatMulTransposed);
      if (!product || head.output_size() != 1 || head.output(0) != logits)
        continue;
      onnx::NodeProto slice;
      slice.set_op_type("Slice");
      slice.set_name("pipec.last-position");
      slice.add_input(head.input(0));
      for (const char *input : lastPositionInputs)
        slice.add_input(input);
      std::string last = "pipec.last-position:" + head.input(0);
      slice.add_output(last);
      head.set_input(0, last);
      *sp.mutable_forward()->Add() = std::move(slice);
      // The Slice goes right before the head.
      for (int j = sp.forward_size() - 1; j > i; --j)
        sp.mutable_forward()->SwapElements(j, j - 1);
      return;
    }
}

/// A generation's shared state: the job, the decode step's run and the
/// prefill's (when the prompts have its length).
struct Setup {
  GenerationJob job;
  RunOptions runOptions;
  std::unique_ptr<Shared> decode, prefill;
};

Expected<std::unique_ptr<Setup>> setUp(const plan::Plan &plan, const GenerateOptions &options,
                                       const cpu::Tensor &prompts) {
  if (Error err = checkGenerate(plan, options, prompts))
    return err;
  auto setup = std::make_unique<Setup>();
  setup->runOptions = options.run;
  setup->runOptions.steps = 1;
  auto shared = makeShared(plan, setup->runOptions);
  if (!shared)
    return shared.takeError();
  setup->decode = std::move(*shared);
  const Shared &s = *setup->decode;
  GenerationJob &job = setup->job;
  job.s = &s;
  job.g = &plan.generation();
  job.o = &options;
  job.prompts = &prompts;
  job.promptCount = prompts.dim(0);
  job.promptLength = prompts.dim(1);
  job.rows = s.microbatchSize;
  job.groups = s.M;
  // Prompts of the prefill's length go through in one pass.
  const plan::Generation &g = plan.generation();
  if (g.has_prefill() && g.prefill_length() == job.promptLength) {
    auto made = makeShared(g.prefill(), setup->runOptions);
    if (!made)
      return made.takeError();
    setup->prefill = std::move(*made);
    keepLastPosition(*setup->prefill, g.logits());
  }
  return setup;
}

/// One rank's executors: the decode step's, and the prefill's, which shares
/// the weights both plans read from the same bytes (the constants compile
/// folded for one length, shapes and masks, are each plan's own).
struct RankExecutors {
  std::unique_ptr<RankExecutor> decode, prefill;
};

Expected<RankExecutors> loadRank(const Setup &setup, Comm &comm, Backend &backend) {
  RankExecutors ex;
  ex.decode = std::make_unique<RankExecutor>(*setup.decode, comm, backend);
  if (Error err = ex.decode->load())
    return err;
  if (!setup.prefill)
    return ex;
  std::map<std::string, cpu::Tensor> same;
  for (const auto &[name, w] : ex.decode->weights) {
    auto a = setup.decode->weightProtos.find(name), b = setup.prefill->weightProtos.find(name);
    if (a != setup.decode->weightProtos.end() && b != setup.prefill->weightProtos.end() &&
        a->second->SerializeAsString() == b->second->SerializeAsString())
      same.emplace(name, w);
  }
  ex.prefill = std::make_unique<RankExecutor>(*setup.prefill, comm, backend);
  if (Error err = ex.prefill->load(&same))
    return err;
  int64_t values[3] = {-1, std::numeric_limits<int64_t>::max(), 1};
  for (int i = 0; i < 3; ++i) {
    auto placed = backend.upload(cpu::Tensor::fromValues<int64_t>({1}, {values[i]}));
    if (!placed)
      return placed.takeError();
    ex.prefill->weights[lastPositionInputs[i]] = std::move(*placed);
  }
  return ex;
}

/// Rank \p rank's pass of \p s (\p tokens per row) on \p ex.
Expected<Pass> makePass(const GenerationJob &job, const Shared &s, RankExecutor &ex, int rank,
                        int64_t tokens) {
  Pass pass{&s, &ex, tokens, {}};
  for (const std::string &name : s.programs[rank].loads())
    if (name == job.g->tokens() && rank != 0)
      return rankError(rank,
                       formatv("stage {0} reads the token ids: only the first stage may", rank));
  if (tokens == 1)
    return pass;
  for (const plan::Generation::Cache &c : job.g->cache())
    if (c.stage() == rank) {
      auto zeros = zerosFor(*s.plan, c.past());
      if (!zeros)
        return zeros.takeError();
      pass.pasts[c.past()] = std::move(*zeros);
    }
  return pass;
}

Error runRank(const Setup &setup, RankExecutors &ex, int rank, Clock::time_point start,
              RankOutcome &out) {
  auto decode = makePass(setup.job, *setup.decode, *ex.decode, rank, 1);
  if (!decode)
    return decode.takeError();
  std::optional<Pass> prefill;
  if (ex.prefill) {
    auto made = makePass(setup.job, *setup.prefill, *ex.prefill, rank, setup.job.promptLength);
    if (!made)
      return made.takeError();
    prefill = std::move(*made);
  }
  GenerationLoop loop(setup.job, std::move(*decode), std::move(prefill), start);
  Error err = ex.decode->generate(loop);
  out.tokens = std::move(loop.tokens);
  out.tokenTimes = std::move(loop.tokenTimes);
  out.events = std::move(loop.events);
  return err;
}

/// The result from the last rank's \p out, the loop having taken
/// \p seconds.
GenerateResult resultOf(const GenerationJob &job, const RankOutcome &out, double seconds) {
  GenerateResult result;
  result.seconds = seconds;
  result.tokens = cpu::Tensor::fromValues<int64_t>({job.promptCount, job.o->maxNewTokens},
                                                   ArrayRef<int64_t>(out.tokens));
  result.generated = job.promptCount * job.o->maxNewTokens;
  if (!out.tokenTimes.empty() && !out.tokenTimes[0].empty())
    result.firstTokenSeconds = out.tokenTimes[0][0];
  double gaps = 0;
  int64_t counted = 0;
  for (const std::vector<double> &times : out.tokenTimes)
    if (times.size() > 1) {
      gaps += times.back() - times.front();
      counted += int64_t(times.size()) - 1;
    }
  result.perTokenSeconds = counted ? gaps / counted : 0;
  result.blas = blasName();
  return result;
}

/// How many of \p ranks ranks that share a machine compute at once: no more
/// than there are groups in flight, since a rank computes only on a group
/// that has reached it. With one group the stages take turns, so each rank
/// computes on all the cores it shares.
int computingAtOnce(const GenerationJob &job, int ranks) {
  return static_cast<int>(std::clamp<int64_t>(job.groups, 1, std::max(1, ranks)));
}

} // namespace

namespace {

/// A generation on the ranks \p mpi says: threads of this process, or this
/// process's rank of an MPI job.
Expected<GenerateResult> launchGenerate(const plan::Plan &plan, const GenerateOptions &options,
                                        const cpu::Tensor &prompts, bool mpi) {
  auto launcher = Launcher::open(options.run, mpi);
  if (!launcher)
    return launcher.takeError();
  Launcher &l = **launcher;
  auto setup = setUp(plan, options, prompts);
  if (!setup)
    return l.fail(setup.takeError());
  const Setup &su = **setup;
  int ranks = su.decode->P;
  if (Error err = l.place(*su.decode, formatv("{0} ranks", ranks).str(),
                          [&](int n) { return computingAtOnce(su.job, n); }))
    return err;
  std::vector<RankExecutors> executors;
  for (int i = 0; i < l.ranksHere(); ++i) {
    auto ex = loadRank(su, l.comm(i), l.backend(i));
    if (!ex)
      return l.fail(ex.takeError());
    executors.push_back(std::move(*ex));
  }
  // Every rank starts together: the times are from one start.
  if (Error err = l.together())
    return err;
  std::vector<RankOutcome> outs(l.ranksHere());
  auto start = Clock::now();
  if (Error err =
          l.run([&](int i) { return runRank(su, executors[i], l.globalRank(i), start, outs[i]); }))
    return err;
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // The last rank's tokens and times, and every rank's trace events, to
  // the reporting process in one message.
  RankOutcome mine;
  for (RankOutcome &out : outs)
    mine.merge(std::move(out));
  auto outcomes = l.gather(std::move(mine));
  if (!outcomes)
    return outcomes.takeError();
  GenerateResult result;
  result.primary = l.primary();
  result.threadsPerRank = l.threadsPerRank();
  if (!l.primary())
    return result;
  RankOutcome all;
  for (RankOutcome &outcome : *outcomes)
    all.merge(std::move(outcome));
  size_t want = su.job.promptCount * options.maxNewTokens;
  if (all.tokens.size() != want)
    return l.fail(createStringError(inconvertibleErrorCode(), "rank %d sent %zu tokens, not %zu",
                                    ranks - 1, all.tokens.size(), want));
  if (!options.tracePath.empty())
    if (Error err = writeTrace(options.tracePath, all.events, ranks))
      return l.fail(std::move(err));
  int threadsPerRank = result.threadsPerRank;
  result = resultOf(su.job, all, seconds);
  result.threadsPerRank = threadsPerRank;
  return result;
}

} // namespace

Expected<GenerateResult> generateLocal(const plan::Plan &plan, const GenerateOptions &options,
                                       const cpu::Tensor &prompts) {
  return launchGenerate(plan, options, prompts, false);
}

Expected<GenerateResult> generateMpi(const plan::Plan &plan, const GenerateOptions &options,
                                     const cpu::Tensor &prompts) {
  return launchGenerate(plan, options, prompts, true);
}

} // namespace pipec::rt
