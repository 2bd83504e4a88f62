//===- Generate.cpp - `pipec generate`: the token loop of a decoder plan -===//
#include "runtime/exec/Generate.h"
#include "runtime/exec/RankExecutor.h"
#include "support/Diagnostics.h"
#include "support/Parallel.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

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
  int64_t rows = 1; ///< rows per group
  int64_t groups = 1, waves = 1;
  int64_t steps = 1; ///< decode steps of a wave: prompt + new tokens - 1
};

/// The prompt row \p i of group \p group in wave \p wave feeds: past the
/// last prompt, the last one again (its tokens are dropped).
int64_t promptOf(const Job &job, int64_t wave, int64_t group, int64_t i) {
  int64_t index = (wave * job.groups + group) * job.rows + i;
  return std::min(index, job.promptCount - 1);
}

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

/// Copies the present's last position along \p axis into \p past at
/// position \p at (both host tensors, present one position longer).
void writePosition(cpu::Tensor &past, const cpu::Tensor &present, int axis, int64_t at) {
  const std::vector<int64_t> &shape = past.shape();
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i)
    outer *= shape[i];
  for (size_t i = axis + 1; i < shape.size(); ++i)
    inner *= shape[i];
  size_t bytes = inner * cpu::storageSize(past.elemType());
  int64_t pastLength = shape[axis], presentLength = present.shape()[axis];
  auto *to = static_cast<char *>(past.rawData());
  const auto *from = static_cast<const char *>(present.rawData());
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(to + (o * pastLength + at) * bytes,
                from + (o * presentLength + presentLength - 1) * bytes, bytes);
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
  /// Last rank: the picked tokens [prompts x new], and when each group's
  /// tokens came (seconds since the start), per wave and group.
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> tokenTimes;
};

class GenerateRank {
public:
  GenerateRank(const Job &job, Comm &comm, RankExecutor &ex, Backend &be)
      : job(job), s(*job.s), comm(comm), ex(ex), be(be), rank(comm.rank()), last(rank + 1 == s.P),
        sp(s.programs[rank]) {}

  Error run(Clock::time_point start, RankOut &out);

private:
  Error prepare();
  /// Step \p step of group \p group in wave \p wave.
  Error step(int64_t wave, int64_t step, int64_t group, Clock::time_point start, RankOut &out);
  Error fillInputs(Env &values, int64_t wave, int64_t step, int64_t group);

  const Job &job;
  const Shared &s;
  Comm &comm;
  RankExecutor &ex;
  Backend &be;
  int rank;
  bool last;
  const plan::StageProgram &sp;
  std::vector<const plan::TensorRef *> recvs, sends;
  std::vector<CacheSlot> caches;
  /// The tokens each group feeds next (first rank; the last rank's picks).
  std::vector<std::vector<int64_t>> next;
  /// Whether each row of each group has picked the EOS id (last rank).
  std::vector<std::vector<bool>> finished;
};

Error GenerateRank::prepare() {
  for (const plan::Instruction &ins : s.plan->programs(rank).instructions()) {
    if (ins.microbatch() != 0 || ins.grad())
      continue;
    if (ins.op() == plan::Instruction::RECV)
      recvs.push_back(&ins.tensor());
    if (ins.op() == plan::Instruction::SEND)
      sends.push_back(&ins.tensor());
  }
  for (const plan::Generation::Cache &c : job.g->cache()) {
    if (c.stage() != rank)
      continue;
    CacheSlot slot{&c, {}};
    for (int64_t g = 0; g < job.groups; ++g) {
      auto zeros = zerosFor(*s.plan, c.past());
      if (!zeros)
        return zeros.takeError();
      slot.groups.push_back(std::move(*zeros));
    }
    caches.push_back(std::move(slot));
  }
  for (const std::string &name : sp.loads())
    if (name == job.g->tokens() && rank != 0)
      return rankError(rank,
                       formatv("stage {0} reads the token ids: only the first stage may", rank));
  next.assign(job.groups, std::vector<int64_t>(job.rows, 0));
  finished.assign(job.groups, std::vector<bool>(job.rows, false));
  return Error::success();
}

Error GenerateRank::fillInputs(Env &values, int64_t wave, int64_t step, int64_t group) {
  const plan::Generation &g = *job.g;
  for (const std::string &name : sp.loads()) {
    if (name == g.tokens() || name == g.positions() || name == g.mask()) {
      auto t = zerosFor(*s.plan, name);
      if (!t)
        return t.takeError();
      for (int64_t i = 0; i < job.rows; ++i) {
        if (name == g.tokens()) {
          int64_t token =
              step < job.promptLength
                  ? job.prompts->getInt64(promptOf(job, wave, group, i) * job.promptLength + step)
                  : next[group][i];
          t->setDouble(i, double(token));
        } else if (name == g.positions()) {
          t->setDouble(i, double(step));
        } else {
          // The written positions and the new one (the present's last).
          int64_t length = g.max_length();
          for (int64_t j = 0; j < step; ++j)
            t->setDouble(i * length + j, 1);
          t->setDouble(i * length + length - 1, 1);
        }
      }
      auto placed = be.upload(*t);
      if (!placed)
        return placed.takeError();
      values[name] = std::move(*placed);
      continue;
    }
    auto cache = std::find_if(caches.begin(), caches.end(),
                              [&](const CacheSlot &c) { return c.entry->past() == name; });
    if (cache == caches.end())
      return rankError(rank, formatv("stage {0} reads input '{1}', which has no role in "
                                     "generation",
                                     rank, name));
    auto placed = be.upload(cache->groups[group]);
    if (!placed)
      return placed.takeError();
    values[name] = std::move(*placed);
  }
  return Error::success();
}

Error GenerateRank::step(int64_t wave, int64_t step, int64_t group, Clock::time_point start,
                         RankOut &out) {
  Env values;
  if (rank == 0 && step >= job.promptLength && s.P > 1) {
    // The tokens the last rank picked for this group at the step before.
    auto handle = comm.postRecv(s.P - 1, DType::I64, {job.rows});
    if (!handle)
      return handle.takeError();
    auto tokens = comm.wait(*handle);
    if (!tokens)
      return tokens.takeError();
    for (int64_t i = 0; i < job.rows; ++i)
      next[group][i] = tokens->getInt64(i);
  }
  if (Error err = fillInputs(values, wave, step, group))
    return err;
  std::vector<int> handles;
  for (const plan::TensorRef *ref : recvs) {
    auto type = elemTypeOfName(ref->dtype());
    if (!type)
      return type.takeError();
    auto handle = comm.postRecv(rank - 1, *type, {ref->shape().begin(), ref->shape().end()});
    if (!handle)
      return handle.takeError();
    handles.push_back(*handle);
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    auto tensor = comm.wait(handles[i]);
    if (!tensor)
      return tensor.takeError();
    auto placed = be.upload(*tensor);
    if (!placed)
      return placed.takeError();
    values[recvs[i]->name()] = std::move(*placed);
  }
  if (Error err = ex.runForward(rank, values))
    return err;
  for (CacheSlot &cache : caches) {
    auto present = values.find(cache.entry->present());
    if (present == values.end())
      return rankError(
          rank, formatv("stage {0} did not make the present '{1}'", rank, cache.entry->present()));
    auto host = be.download(present->second);
    if (!host)
      return host.takeError();
    writePosition(cache.groups[group], *host, cache.entry->axis(), step);
  }
  for (const plan::TensorRef *ref : sends) {
    auto it = values.find(ref->name());
    if (it == values.end())
      return rankError(rank,
                       formatv("stage {0}: '{1}' to send was not computed", rank, ref->name()));
    auto host = be.download(it->second);
    if (!host)
      return host.takeError();
    if (Error err = comm.send(rank + 1, *host))
      return err;
  }
  if (!last || step + 1 < job.promptLength)
    return Error::success();
  // The last stage picks each row's next token.
  auto logits = values.find(job.g->logits());
  if (logits == values.end())
    return rankError(rank,
                     formatv("the last stage did not make the logits '{0}'", job.g->logits()));
  auto host = be.download(logits->second);
  if (!host)
    return host.takeError();
  int64_t vocab = job.g->vocab(), position = step + 1 - job.promptLength;
  if (host->numElements() != job.rows * vocab)
    return rankError(rank, formatv("the logits '{0}' are {1}, not [{2}, 1, {3}]", job.g->logits(),
                                   cpu::shapeString(host->shape()), job.rows, vocab));
  std::vector<double> row(vocab);
  cpu::Tensor picked(DType::I64, {job.rows});
  for (int64_t i = 0; i < job.rows; ++i) {
    for (int64_t v = 0; v < vocab; ++v)
      row[v] = host->getDouble(i * vocab + v);
    int64_t prompt = promptOf(job, wave, group, i);
    int64_t token = pickToken(*job.o, row, prompt, position);
    if (finished[group][i])
      token = *job.o->eos;
    else if (job.o->eos && token == *job.o->eos)
      finished[group][i] = true;
    picked.data<int64_t>()[i] = token;
    int64_t index = (wave * job.groups + group) * job.rows + i;
    if (index < job.promptCount)
      out.tokens[index * job.o->maxNewTokens + position] = token;
  }
  out.tokenTimes[wave * job.groups + group].push_back(
      std::chrono::duration<double>(Clock::now() - start).count());
  if (step + 1 == job.steps)
    return Error::success();
  if (s.P == 1) {
    for (int64_t i = 0; i < job.rows; ++i)
      next[group][i] = picked.data<int64_t>()[i];
    return Error::success();
  }
  return comm.send(0, picked);
}

Error GenerateRank::run(Clock::time_point start, RankOut &out) {
  if (Error err = prepare())
    return err;
  if (last) {
    out.tokens.assign(job.promptCount * job.o->maxNewTokens, 0);
    out.tokenTimes.assign(job.waves * job.groups, {});
  }
  for (int64_t wave = 0; wave < job.waves; ++wave) {
    for (auto &rows : finished)
      std::fill(rows.begin(), rows.end(), false);
    for (int64_t t = 0; t < job.steps; ++t)
      for (int64_t group = 0; group < job.groups; ++group)
        if (Error err = step(wave, t, group, start, out))
          return err;
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

Expected<GenerateResult> generateLocal(const plan::Plan &plan, const GenerateOptions &options,
                                       const cpu::Tensor &prompts) {
  if (Error err = checkGenerate(plan, options, prompts))
    return err;
  keepFreedMemory();
  RunOptions runOptions = options.run;
  runOptions.steps = 1;
  auto shared = makeShared(plan, runOptions);
  if (!shared)
    return shared.takeError();
  Shared &s = **shared;
  Job job;
  job.s = &s;
  job.g = &plan.generation();
  job.o = &options;
  job.prompts = &prompts;
  job.promptCount = prompts.dim(0);
  job.promptLength = prompts.dim(1);
  job.rows = s.microbatchSize;
  job.groups = s.M;
  int64_t slots = job.rows * job.groups;
  job.waves = (job.promptCount + slots - 1) / slots;
  job.steps = job.promptLength + options.maxNewTokens - 1;

  int ranks = s.P;
  int threadsPerRank = shareCores(runOptions, ranks);
  LocalWorld world(ranks, runOptions.timeoutSeconds);
  std::vector<std::unique_ptr<Comm>> comms;
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<RankExecutor>> executors;
  for (int r = 0; r < ranks; ++r) {
    auto backend = makeBackend(s, r / std::max(1, runOptions.ranksPerDevice), r);
    if (!backend)
      return backend.takeError();
    backends.push_back(std::move(*backend));
    comms.push_back(world.comm(r));
    executors.push_back(std::make_unique<RankExecutor>(s, *comms.back(), *backends.back()));
    if (Error err = executors.back()->load())
      return err;
  }
  std::vector<RankOut> outs(ranks);
  std::vector<std::string> errors(ranks);
  std::mutex errorMutex;
  int firstFailed = -1;
  auto start = Clock::now();
  auto body = [&](int r) {
    if (threadsPerRank == 1)
      pinToCore(r, ranks);
    setLoopThreads(threadsPerRank);
    GenerateRank rank(job, *comms[r], *executors[r], *backends[r]);
    if (Error err = rank.run(start, outs[r])) {
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
  std::vector<std::thread> threads;
  for (int r = 1; r < ranks; ++r)
    threads.emplace_back(body, r);
  body(0);
  if (threadsPerRank == 1)
    pinToCore(-1, ranks);
  for (std::thread &t : threads)
    t.join();
  if (firstFailed >= 0)
    return createStringError(inconvertibleErrorCode(), "%s", errors[firstFailed].c_str());

  GenerateResult result;
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const RankOut &out = outs[ranks - 1];
  result.tokens = cpu::Tensor::fromValues<int64_t>({job.promptCount, options.maxNewTokens},
                                                   ArrayRef<int64_t>(out.tokens));
  result.generated = job.promptCount * options.maxNewTokens;
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
  result.threadsPerRank = threadsPerRank;
  return result;
}

} // namespace pipec::rt
