//===- Generate.cpp - `pipec generate`: the token loop of a decoder plan -===//
#include "runtime/exec/Generate.h"
#include "ops/OpRegistry.h"
#include "runtime/core/FusedProgram.h"
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

namespace {

/// What every rank of one generation shares (read-only once made).
struct Job {
  const Shared *s = nullptr;
  const plan::Generation *g = nullptr;
  const GenerateOptions *o = nullptr;
  const cpu::Tensor *prompts = nullptr;
  int64_t promptCount = 0, promptLength = 0;
  int64_t rows = 1; ///< rows (slots) per group
  int64_t groups = 1;
};

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
  const std::vector<int64_t> &shape = past.shape();
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

/// What one rank measured and picked.
struct RankOut {
  /// Last rank: the picked tokens [prompts x new], and when each prompt's
  /// tokens came (seconds since the start).
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> tokenTimes;
  /// With --trace: this rank's passes and waits.
  std::vector<TraceEvent> events;
};

/// One of the passes a rank runs: the decode step (a token per row) or the
/// prefill (a prompt per row), each its own plan's stage program.
struct Pass {
  const Shared *s = nullptr;
  RankExecutor *ex = nullptr;
  int64_t tokens = 1; ///< per row
  std::vector<const plan::TensorRef *> recvs, sends;
  /// The prefill's past inputs: zeros of its shape (every position masked).
  std::map<std::string, cpu::Tensor> pasts;
};

/// What a pass of a group does, as the first rank decides it and the
/// control tensor (int64 [rows + 1, 2]) carries it down the stages: per row
/// its prompt (-1: an idle slot) and the cache positions written before,
/// then the pass's kind.
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

/// One rank's part of the token loop. The first rank schedules: it gives
/// each slot a prompt, feeds its tokens, and when the last rank says a row
/// finished (EOS or its new tokens), the next waiting prompt takes the slot.
/// Every rank runs the groups round-robin in the same order; a group whose
/// slots are all idle with no prompt waiting is stopped, the stop passed
/// down the stages.
class GenerateRank {
public:
  GenerateRank(const Job &job, Comm &comm, Backend &be, Pass decode, std::optional<Pass> prefill)
      : job(job), comm(comm), be(be), rank(comm.rank()), last(rank + 1 == job.s->P),
        decode(std::move(decode)), prefill(std::move(prefill)) {}

  Error run(Clock::time_point start, RankOut &out);

private:
  Error prepare(Pass &pass);
  /// The first rank: group \p group's next pass, after the last rank's
  /// picks of its previous one.
  Expected<Control> schedule(int64_t group, bool first, RankOut &out);
  /// Runs \p control's pass of group \p group on this rank's stage.
  Error runPass(int64_t group, const Control &control, Clock::time_point start, RankOut &out);
  Error fillInputs(Pass &pass, Env &values, int64_t group, const Control &control);
  /// The last rank: each busy row's next token, recorded; returns the
  /// picks and which rows finished, int64 [2, rows].
  Expected<cpu::Tensor> pick(const cpu::Tensor &logits, const Control &control, int64_t tokens,
                             Clock::time_point start, RankOut &out);
  /// The prompt the first rank gives a freed slot, or -1.
  int64_t nextRequest() { return waiting < job.promptCount ? waiting++ : -1; }
  /// With --trace: an event of this rank from \p started (wallNow) to now.
  void record(RankOut &out, char category, const std::string &name, double started) {
    if (!job.o->tracePath.empty())
      out.events.push_back({name, category, rank, started, wallNow() - started});
  }
  /// Waits for \p handle, traced as a wait named \p what.
  Expected<cpu::Tensor> waitFor(int handle, RankOut &out, const std::string &what) {
    double started = wallNow();
    auto got = comm.wait(handle);
    if (got && wallNow() - started > 1e-5)
      record(out, 'C', what, started);
    return got;
  }
  /// Receives an int64 tensor of \p shape from \p peer, traced as \p what.
  Expected<cpu::Tensor> receive(int peer, std::vector<int64_t> shape, RankOut &out,
                                const std::string &what) {
    auto handle = comm.postRecv(peer, DType::I64, std::move(shape));
    if (!handle)
      return handle.takeError();
    return waitFor(*handle, out, what);
  }

  const Job &job;
  Comm &comm;
  Backend &be;
  int rank;
  bool last;
  Pass decode;
  std::optional<Pass> prefill;
  /// Per cache input this rank's stage loads: one tensor per group, and its
  /// batch axis.
  std::map<std::string, std::vector<cpu::Tensor>> caches;
  std::map<std::string, int> batchAxes;
  /// The first rank: each group's slots, the token each feeds next, and
  /// the next prompt to start.
  std::vector<Control> slots;
  std::vector<std::vector<int64_t>> next;
  int64_t waiting = 0;
  /// The picks of a group's last pass when this rank is first and last.
  std::vector<cpu::Tensor> localPicks;
};

Error GenerateRank::prepare(Pass &pass) {
  for (const plan::Instruction &ins : pass.s->plan->programs(rank).instructions()) {
    if (ins.microbatch() != 0 || ins.grad())
      continue;
    if (ins.op() == plan::Instruction::RECV)
      pass.recvs.push_back(&ins.tensor());
    if (ins.op() == plan::Instruction::SEND)
      pass.sends.push_back(&ins.tensor());
  }
  for (const std::string &name : pass.s->programs[rank].loads())
    if (name == job.g->tokens() && rank != 0)
      return rankError(rank,
                       formatv("stage {0} reads the token ids: only the first stage may", rank));
  if (pass.tokens == 1)
    return Error::success();
  for (const plan::Generation::Cache &c : job.g->cache())
    if (c.stage() == rank) {
      auto zeros = zerosFor(*pass.s->plan, c.past());
      if (!zeros)
        return zeros.takeError();
      pass.pasts[c.past()] = std::move(*zeros);
    }
  return Error::success();
}

Expected<Control> GenerateRank::schedule(int64_t group, bool first, RankOut &out) {
  Control &c = slots[group];
  int64_t n = c.kind == Kind::Prefill ? prefill->tokens : 1;
  if (first) {
    c.request.resize(job.rows);
    c.position.assign(job.rows, 0);
    for (int64_t &r : c.request)
      r = nextRequest();
    // Prompts of the prefill's length go through in one pass.
    c.kind = prefill ? Kind::Prefill : Kind::Decode;
    if (c.request[0] < 0)
      c.kind = Kind::Stop; // more slots than prompts
    return c;
  }
  cpu::Tensor picks;
  if (job.s->P == 1) {
    picks = localPicks[group];
  } else {
    auto got = receive(job.s->P - 1, {2, job.rows}, out, formatv("picks g{0}", group).str());
    if (!got)
      return got.takeError();
    picks = std::move(*got);
  }
  for (int64_t i = 0; i < job.rows; ++i) {
    if (c.request[i] < 0)
      continue;
    c.position[i] += n;
    next[group][i] = picks.getInt64(i);
    if (picks.getInt64(job.rows + i)) {
      // Finished: the slot takes the next waiting prompt, from position 0.
      c.request[i] = nextRequest();
      c.position[i] = 0;
    }
  }
  c.kind = Kind::Decode;
  if (std::all_of(c.request.begin(), c.request.end(), [](int64_t r) { return r < 0; }))
    c.kind = Kind::Stop;
  return c;
}

Error GenerateRank::fillInputs(Pass &pass, Env &values, int64_t group, const Control &c) {
  const plan::Generation &g = *job.g;
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
                        : next[group][i];
          host.setDouble(i * n + k, double(name == g.tokens() ? token : position));
        }
      }
    } else if (auto zeros = pass.pasts.find(name); zeros != pass.pasts.end()) {
      host = zeros->second;
    } else if (auto cache = caches.find(name); cache != caches.end()) {
      host = cache->second[group];
    } else {
      return rankError(rank, formatv("stage {0} reads input '{1}', which has no role in "
                                     "generation",
                                     rank, name));
    }
    auto placed = be.upload(host);
    if (!placed)
      return placed.takeError();
    values[name] = std::move(*placed);
  }
  return Error::success();
}

Error GenerateRank::runPass(int64_t group, const Control &control, Clock::time_point start,
                            RankOut &out) {
  Pass &pass = control.kind == Kind::Prefill ? *prefill : decode;
  int64_t n = pass.tokens;
  Env values = pass.ex->makeEnv();
  if (Error err = fillInputs(pass, values, group, control))
    return err;
  std::vector<int> handles;
  for (const plan::TensorRef *ref : pass.recvs) {
    auto type = elemTypeOfName(ref->dtype());
    if (!type)
      return type.takeError();
    auto handle = comm.postRecv(rank - 1, *type, {ref->shape().begin(), ref->shape().end()});
    if (!handle)
      return handle.takeError();
    handles.push_back(*handle);
  }
  for (size_t i = 0; i < pass.recvs.size(); ++i) {
    auto tensor = waitFor(handles[i], out, formatv("recv g{0}", group).str());
    if (!tensor)
      return tensor.takeError();
    auto placed = be.upload(*tensor);
    if (!placed)
      return placed.takeError();
    values[pass.recvs[i]->name()] = std::move(*placed);
  }
  double started = wallNow();
  if (Error err = pass.ex->runForward(rank, values))
    return err;
  record(out, 'F',
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
    const cpu::Tensor *present = c.appended().empty() ? nullptr : values.find(c.appended());
    if (!present)
      present = values.find(c.present());
    if (!present)
      return rankError(rank,
                       formatv("stage {0} did not make the present '{1}'", rank, c.present()));
    auto host = be.download(*present);
    if (!host)
      return host.takeError();
    writePositions(caches[c.past()][group], *host, batchAxes[c.past()], c.axis(), at, n,
                   c.in_place());
  }
  if (!last) {
    if (Error err = comm.send(rank + 1, control.tensor()))
      return err;
    for (const plan::TensorRef *ref : pass.sends) {
      const cpu::Tensor *sent = values.find(ref->name());
      if (!sent)
        return rankError(rank,
                         formatv("stage {0}: '{1}' to send was not computed", rank, ref->name()));
      auto host = be.download(*sent);
      if (!host)
        return host.takeError();
      if (Error err = comm.send(rank + 1, *host))
        return err;
    }
    return Error::success();
  }
  const cpu::Tensor *logits = values.find(job.g->logits());
  if (!logits)
    return rankError(rank,
                     formatv("the last stage did not make the logits '{0}'", job.g->logits()));
  auto host = be.download(*logits);
  if (!host)
    return host.takeError();
  auto picks = pick(*host, control, n, start, out);
  if (!picks)
    return picks.takeError();
  if (job.s->P == 1) {
    localPicks[group] = std::move(*picks);
    return Error::success();
  }
  return comm.send(0, *picks);
}

Expected<cpu::Tensor> GenerateRank::pick(const cpu::Tensor &logits, const Control &control,
                                         int64_t tokens, Clock::time_point start, RankOut &out) {
  int64_t vocab = job.g->vocab(), rows = job.rows, limit = job.o->maxNewTokens;
  // The prefill's head may have made the last position's alone.
  if (logits.numElements() == rows * vocab)
    tokens = 1;
  if (logits.numElements() != rows * tokens * vocab)
    return rankError(rank, formatv("the logits '{0}' are {1}, not [{2}, {3}, {4}]", job.g->logits(),
                                   cpu::shapeString(logits.shape()), rows, tokens, vocab));
  double now = std::chrono::duration<double>(Clock::now() - start).count();
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
      row[v] = logits.getDouble(base + v);
    int64_t token = pickToken(*job.o, row, request, index);
    bool eos = job.o->eos && token == *job.o->eos;
    out.tokens[request * limit + index] = token;
    out.tokenTimes[request].push_back(now);
    if (eos)
      // The rest of the row is the EOS id, as transformers pads it.
      std::fill(out.tokens.begin() + request * limit + index + 1,
                out.tokens.begin() + (request + 1) * limit, token);
    d[i] = token;
    d[rows + i] = eos || index + 1 == limit;
  }
  return picks;
}

Error GenerateRank::run(Clock::time_point start, RankOut &out) {
  if (Error err = prepare(decode))
    return err;
  if (prefill)
    if (Error err = prepare(*prefill))
      return err;
  for (const plan::Generation::Cache &c : job.g->cache())
    if (c.stage() == rank) {
      const plan::DataInput *d = dataInput(*job.s->plan, c.past());
      if (!d || d->batch_axis() >= c.axis())
        return rankError(rank, formatv("the cache '{0}' does not hold its rows before its "
                                       "positions",
                                       c.past()));
      batchAxes[c.past()] = d->batch_axis();
      for (int64_t g = 0; g < job.groups; ++g) {
        auto zeros = zerosFor(*job.s->plan, c.past());
        if (!zeros)
          return zeros.takeError();
        caches[c.past()].push_back(std::move(*zeros));
      }
    }
  if (last) {
    out.tokens.assign(job.promptCount * job.o->maxNewTokens, 0);
    out.tokenTimes.assign(job.promptCount, {});
  }
  slots.assign(job.groups, Control());
  next.assign(job.groups, std::vector<int64_t>(job.rows, 0));
  localPicks.assign(job.groups, cpu::Tensor());
  // The groups round-robin, each until it stops.
  std::vector<int64_t> active(job.groups);
  std::iota(active.begin(), active.end(), 0);
  std::vector<bool> started(job.groups, false);
  while (!active.empty()) {
    for (size_t a = 0; a < active.size();) {
      int64_t group = active[a];
      Control control;
      if (rank == 0) {
        auto scheduled = schedule(group, !started[group], out);
        if (!scheduled)
          return scheduled.takeError();
        control = std::move(*scheduled);
        started[group] = true;
      } else {
        auto got = receive(rank - 1, {job.rows + 1, 2}, out, formatv("recv g{0}", group).str());
        if (!got)
          return got.takeError();
        control = Control::of(*got);
      }
      if (control.kind == Kind::Stop) {
        if (!last)
          if (Error err = comm.send(rank + 1, control.tensor()))
            return err;
        active.erase(active.begin() + a);
        continue;
      }
      if (Error err = runPass(group, control, start, out))
        return err;
      ++a;
    }
  }
  return comm.flush();
}

} // namespace

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
  Job job;
  RunOptions runOptions;
  std::unique_ptr<Shared> decode, prefill;
};

Expected<std::unique_ptr<Setup>> setUp(const plan::Plan &plan, const GenerateOptions &options,
                                       const cpu::Tensor &prompts) {
  if (Error err = checkGenerate(plan, options, prompts))
    return err;
  keepFreedMemory();
  auto setup = std::make_unique<Setup>();
  setup->runOptions = options.run;
  setup->runOptions.steps = 1;
  auto shared = makeShared(plan, setup->runOptions);
  if (!shared)
    return shared.takeError();
  setup->decode = std::move(*shared);
  const Shared &s = *setup->decode;
  Job &job = setup->job;
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

Error runRank(const Setup &setup, Comm &comm, Backend &backend, RankExecutors &ex,
              Clock::time_point start, RankOut &out) {
  Pass decode{setup.decode.get(), ex.decode.get(), 1, {}, {}, {}};
  std::optional<Pass> prefill;
  if (ex.prefill)
    prefill = Pass{setup.prefill.get(), ex.prefill.get(), setup.job.promptLength, {}, {}, {}};
  GenerateRank rank(setup.job, comm, backend, std::move(decode), std::move(prefill));
  return rank.run(start, out);
}

/// The result from the last rank's \p out, the loop having taken
/// \p seconds.
GenerateResult resultOf(const Job &job, const RankOut &out, double seconds) {
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
int computingAtOnce(const Job &job, int ranks) {
  return static_cast<int>(std::clamp<int64_t>(job.groups, 1, std::max(1, ranks)));
}

} // namespace

Expected<GenerateResult> generateLocal(const plan::Plan &plan, const GenerateOptions &options,
                                       const cpu::Tensor &prompts) {
  auto setup = setUp(plan, options, prompts);
  if (!setup)
    return setup.takeError();
  const Setup &su = **setup;
  int ranks = su.decode->P;
  int threadsPerRank = shareCores(su.runOptions, computingAtOnce(su.job, ranks));
  LocalWorld world(ranks, su.runOptions.timeoutSeconds);
  std::vector<std::unique_ptr<Comm>> comms;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<RankExecutors> executors;
  for (int r = 0; r < ranks; ++r) {
    auto backend = makeBackend(*su.decode, r / std::max(1, su.runOptions.ranksPerDevice), r);
    if (!backend)
      return backend.takeError();
    backends.push_back(std::move(*backend));
    comms.push_back(world.comm(r));
    auto ex = loadRank(su, *comms.back(), *backends.back());
    if (!ex)
      return ex.takeError();
    executors.push_back(std::move(*ex));
  }
  std::vector<RankOut> outs(ranks);
  auto start = Clock::now();
  if (Error err = runRankThreads(ranks, threadsPerRank, comms, [&](int r) {
        return runRank(su, *comms[r], *backends[r], executors[r], start, outs[r]);
      }))
    return err;
  GenerateResult result = resultOf(su.job, outs[ranks - 1],
                                   std::chrono::duration<double>(Clock::now() - start).count());
  result.threadsPerRank = threadsPerRank;
  if (!options.tracePath.empty()) {
    std::vector<TraceEvent> events;
    for (RankOut &out : outs)
      events.insert(events.end(), out.events.begin(), out.events.end());
    if (Error err = writeTrace(options.tracePath, events, ranks))
      return err;
  }
  return result;
}

Expected<GenerateResult> generateMpi(const plan::Plan &plan, const GenerateOptions &options,
                                     const cpu::Tensor &prompts) {
  auto comm = makeMpiComm(options.run.timeoutSeconds);
  if (!comm)
    return comm.takeError();
  auto failed = [&](Error err) -> Error {
    std::string text = toString(std::move(err));
    (*comm)->fail(text);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  };
  auto setup = setUp(plan, options, prompts);
  if (!setup)
    return failed(setup.takeError());
  const Setup &su = **setup;
  auto place =
      placeMpiProcess(**comm, su.decode->P, formatv("{0} ranks", su.decode->P).str(), su.runOptions,
                      [&](int ranks) { return computingAtOnce(su.job, ranks); });
  if (!place)
    return failed(place.takeError());
  int threadsPerRank = place->threadsPerRank;
  int rank = (*comm)->rank();
  // Its device as pipec run places it: the rank's index on its node over
  // --ranks-per-device.
  auto backend = makeBackend(*su.decode, place->device, rank);
  if (!backend)
    return failed(backend.takeError());
  auto ex = loadRank(su, **comm, **backend);
  if (!ex)
    return failed(ex.takeError());
  // Every rank starts together: the times are from one start.
  double none[1] = {0};
  if (Error err = (*comm)->sumAll(none))
    return failed(std::move(err));
  auto start = Clock::now();
  RankOut out;
  if (Error err = runRank(su, **comm, **backend, *ex, start, out))
    return failed(std::move(err));
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // The last rank's tokens and times, and every rank's trace events, to
  // rank 0 in one typed message (plan.proto's RankResult).
  plan::RankResult message;
  if (rank + 1 == su.decode->P) {
    message.mutable_tokens()->Add(out.tokens.begin(), out.tokens.end());
    for (const std::vector<double> &times : out.tokenTimes)
      message.add_token_times()->mutable_seconds()->Add(times.begin(), times.end());
  }
  addEvents(message, out.events);
  std::string bytes;
  if (!message.SerializeToString(&bytes))
    return failed(rankError(rank, "its results are over protobuf's 2 GiB limit"));
  auto gathered = (*comm)->gather(bytes);
  if (!gathered)
    return failed(gathered.takeError());
  GenerateResult result;
  result.primary = rank == 0;
  if (rank == 0) {
    std::vector<TraceEvent> events;
    plan::RankResult from;
    for (size_t r = 0; r < gathered->size(); ++r) {
      plan::RankResult part;
      if (!part.ParseFromString((*gathered)[r]))
        return failed(
            createStringError(inconvertibleErrorCode(), "rank %zu sent a malformed result", r));
      size_t first = events.size();
      appendEvents(part, events);
      for (size_t e = first; e < events.size(); ++e)
        events[e].rank = int(r);
      if (r + 1 == gathered->size())
        from = std::move(part);
    }
    if (!options.tracePath.empty())
      if (Error err = writeTrace(options.tracePath, events, int(gathered->size())))
        return failed(std::move(err));
    const Job &job = su.job;
    RankOut last;
    size_t want = job.promptCount * job.o->maxNewTokens;
    if (static_cast<size_t>(from.tokens_size()) != want)
      return failed(createStringError(inconvertibleErrorCode(), "rank %d sent %d tokens, not %zu",
                                      su.decode->P - 1, from.tokens_size(), want));
    last.tokens.assign(from.tokens().begin(), from.tokens().end());
    for (const plan::GroupTimes &times : from.token_times())
      last.tokenTimes.emplace_back(times.seconds().begin(), times.seconds().end());
    result = resultOf(job, last, seconds);
  }
  result.threadsPerRank = threadsPerRank;
  return result;
}

} // namespace pipec::rt
