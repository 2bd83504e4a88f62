//===- Simulator.cpp - Event simulation of a plan's instruction streams ---===//
#include "compiler/sim/Simulator.h"
#include "support/ChromeTrace.h"
#include "support/Diagnostics.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"

#include <limits>
#include <map>
#include <set>
#include <tuple>

using namespace llvm;

namespace pipec {
namespace {

using Op = plan::Instruction;

bool isP2P(const plan::Instruction &i) { return i.op() == Op::SEND || i.op() == Op::RECV; }

bool isCompute(const plan::Instruction &i) {
  return i.op() == Op::FORWARD || i.op() == Op::BACKWARD || i.op() == Op::BACKWARD_INPUT ||
         i.op() == Op::BACKWARD_WEIGHT || i.op() == Op::RECOMPUTE;
}

char categoryOf(const plan::Instruction &i) {
  switch (i.op()) {
  case Op::FORWARD:
    return 'F';
  case Op::BACKWARD:
    return 'B';
  case Op::BACKWARD_INPUT:
    return 'I';
  case Op::BACKWARD_WEIGHT:
    return 'W';
  case Op::RECOMPUTE:
    return 'R';
  default:
    return 'O';
  }
}

struct RankState {
  int pc = 0;
  double clock = 0; ///< when the rank's compute stream is free
  double busy = 0;
  /// Posted RECVs by (stage, microbatch, grad): how many have not matched
  /// yet, and when the data of those that matched arrived.
  std::map<std::tuple<int, int, bool>, std::pair<int, double>> inbox;
  int outstanding = 0;  ///< all posted RECVs not yet matched
  double sendsDone = 0; ///< when its last SEND finished
};

/// One direction of one pair of ranks: NCCL matches the k-th send with the
/// k-th receive.
struct Channel {
  std::vector<std::pair<int, double>> sends, recvs; // (instruction, post time)
  size_t matched = 0;
};

std::string describe(const plan::Instruction &ins) {
  if (ins.op() == Op::ALLREDUCE)
    return "ALLREDUCE " + ins.group();
  return formatv("{0} {1} s{2} mb{3} {4} {5} {6}", ins.op() == Op::SEND ? "SEND" : "RECV",
                 ins.grad() ? "grad" : "act", ins.stage(), ins.microbatch(),
                 ins.op() == Op::SEND ? "->" : "<-", ins.peer(), ins.tensor().name())
      .str();
}

class Streams {
public:
  Streams(ArrayRef<const plan::RankProgram *> programs, const StreamCosts &costs)
      : programs(programs), costs(costs), P(static_cast<int>(programs.size())), state(P) {}

  Expected<SimulationResult> run(Deadlock *deadlock);

private:
  ArrayRef<const plan::RankProgram *> programs;
  const StreamCosts &costs;
  int P;
  std::vector<RankState> state;
  std::map<std::pair<int, int>, Channel> channels; // (from, to)
  SimulationResult result;

  const plan::Instruction &at(int r, int i) const { return programs[r]->instructions(i); }
  bool done(int r) const { return state[r].pc >= programs[r]->instructions_size(); }
  /// Runs rank r until it blocks; returns whether it moved.
  Expected<bool> step(int r);
  Expected<bool> match(Deadlock *deadlock);
};

Expected<bool> Streams::step(int r) {
  RankState &st = state[r];
  bool moved = false;
  while (!done(r)) {
    const plan::Instruction &ins = at(r, st.pc);
    if (isP2P(ins)) {
      int peer = ins.peer();
      if (peer < 0 || peer >= P || peer == r)
        return createStringError(inconvertibleErrorCode(), "rank %d step %d: %s names peer %d", r,
                                 st.pc, describe(ins).c_str(), peer);
      if (ins.op() == Op::SEND) {
        channels[{r, peer}].sends.emplace_back(st.pc, st.clock);
      } else {
        channels[{peer, r}].recvs.emplace_back(st.pc, st.clock);
        ++st.inbox[{ins.stage(), ins.microbatch(), ins.grad()}].first;
        ++st.outstanding;
      }
      ++st.pc;
      moved = true;
      continue;
    }
    if (ins.op() == Op::ALLREDUCE)
      return moved; // collectives are completed by run()
    // Everything else runs on the compute stream after the data it receives:
    // a forward needs the activations of the stage before, a backward the
    // gradients of its own outputs, the optimizer step everything.
    double ready = 0;
    auto needs = [&](std::tuple<int, int, bool> key) {
      auto it = st.inbox.find(key);
      if (it == st.inbox.end())
        return true;
      ready = std::max(ready, it->second.second);
      return it->second.first == 0;
    };
    bool satisfied = true;
    if (ins.op() == Op::FORWARD)
      satisfied = needs({ins.stage() - 1, ins.microbatch(), false});
    else if (ins.op() == Op::BACKWARD || ins.op() == Op::BACKWARD_INPUT)
      satisfied = needs({ins.stage(), ins.microbatch(), true});
    else if (ins.op() == Op::OPTIMIZER_STEP) {
      satisfied = st.outstanding == 0;
      for (auto &[key, entry] : st.inbox)
        ready = std::max(ready, entry.second);
    }
    if (!satisfied)
      return moved;
    double duration = costs.compute ? costs.compute(r, ins) : 0;
    double start = std::max(st.clock, ready);
    if (isCompute(ins) || ins.op() == Op::OPTIMIZER_STEP) {
      TimelineEvent e;
      e.rank = r;
      e.category = categoryOf(ins);
      e.name = ins.op() == Op::OPTIMIZER_STEP
                   ? std::string("optimizer step")
                   : formatv("{0}{1}{2}", ins.stage(), e.category, ins.microbatch()).str();
      e.start = start;
      e.duration = duration;
      e.microbatch = ins.microbatch();
      result.events.push_back(e);
      if (isCompute(ins))
        st.busy += duration;
    }
    st.clock = start + duration;
    ++st.pc;
    moved = true;
  }
  return moved;
}

Expected<bool> Streams::match(Deadlock *deadlock) {
  bool progress = false;
  for (auto &[key, ch] : channels) {
    auto [from, to] = key;
    while (ch.matched < std::min(ch.sends.size(), ch.recvs.size())) {
      auto [si, sendPosted] = ch.sends[ch.matched];
      auto [ri, recvPosted] = ch.recvs[ch.matched];
      const plan::Instruction &send = at(from, si), &recv = at(to, ri);
      bool same = send.stage() == recv.stage() && send.microbatch() == recv.microbatch() &&
                  send.grad() == recv.grad() && send.tensor().name() == recv.tensor().name();
      if (!same && deadlock) {
        deadlock->waitingAt.assign(P, -1);
        deadlock->waitingAt[from] = si;
        deadlock->waitingAt[to] = ri;
      }
      if (!same)
        return createStringError(
            inconvertibleErrorCode(),
            "rank %d step %d: %s is rank %d's send number %zu to rank %d, but rank %d's "
            "receive number %zu from rank %d is %s (step %d): point-to-point operations match "
            "in order",
            from, si, describe(send).c_str(), from, ch.matched, to, to, ch.matched, from,
            describe(recv).c_str(), ri);
      if (send.tensor().bytes() != recv.tensor().bytes() ||
          send.tensor().dtype() != recv.tensor().dtype() ||
          !std::equal(send.tensor().shape().begin(), send.tensor().shape().end(),
                      recv.tensor().shape().begin(), recv.tensor().shape().end()))
        return createStringError(
            inconvertibleErrorCode(),
            "rank %d step %d: %s sends %lld bytes of %s, rank %d step %d "
            "receives %lld bytes of %s",
            from, si, describe(send).c_str(), static_cast<long long>(send.tensor().bytes()),
            send.tensor().dtype().c_str(), to, ri, static_cast<long long>(recv.tensor().bytes()),
            recv.tensor().dtype().c_str());
      double start = std::max(sendPosted, recvPosted);
      double length = costs.transfer ? costs.transfer(from, to, send.tensor().bytes()) : 0;
      TimelineEvent e;
      e.rank = from;
      e.category = 'C';
      e.name = formatv("send {0} s{1} mb{2} -> {3} {4}", send.grad() ? "grad" : "act", send.stage(),
                       send.microbatch(), to, send.tensor().name())
                   .str();
      e.start = start;
      e.duration = length;
      e.microbatch = send.microbatch();
      result.events.push_back(e);
      auto &entry = state[to].inbox[{recv.stage(), recv.microbatch(), recv.grad()}];
      --entry.first;
      entry.second = std::max(entry.second, start + length);
      --state[to].outstanding;
      state[from].sendsDone = std::max(state[from].sendsDone, start + length);
      ++ch.matched;
      progress = true;
    }
  }
  return progress;
}

Expected<SimulationResult> Streams::run(Deadlock *deadlock) {
  while (true) {
    bool progress = false;
    for (int r = 0; r < P; ++r) {
      auto moved = step(r);
      if (!moved)
        return moved.takeError();
      progress |= *moved;
    }
    auto matched = match(deadlock);
    if (!matched)
      return matched.takeError();
    progress |= *matched;
    // Collectives: every rank of the group waits at the same ALLREDUCE.
    for (int r = 0; r < P; ++r) {
      if (done(r) || at(r, state[r].pc).op() != Op::ALLREDUCE || state[r].outstanding > 0)
        continue;
      const plan::Instruction &ins = at(r, state[r].pc);
      bool ready = true;
      double start = 0;
      for (int peer : ins.ranks()) {
        if (peer < 0 || peer >= P || done(peer) || at(peer, state[peer].pc).op() != Op::ALLREDUCE ||
            at(peer, state[peer].pc).reduce() != ins.reduce() ||
            at(peer, state[peer].pc).tied_weight() != ins.tied_weight() ||
            state[peer].outstanding > 0) {
          ready = false;
          break;
        }
        start = std::max(start, state[peer].clock);
      }
      if (!ready)
        continue;
      for (int peer : ins.ranks()) {
        double length = costs.allReduce ? costs.allReduce(peer, at(peer, state[peer].pc)) : 0;
        TimelineEvent e;
        e.rank = peer;
        e.category = 'C';
        e.name = "allreduce " + ins.group();
        e.start = start;
        e.duration = length;
        result.events.push_back(e);
        state[peer].clock = start + length;
        ++state[peer].pc;
      }
      progress = true;
    }
    bool all = true;
    for (int r = 0; r < P; ++r)
      all &= done(r);
    if (all)
      break;
    if (!progress) {
      std::string waits;
      std::vector<int> waiting(P, -1);
      for (int r = 0; r < P; ++r) {
        if (done(r))
          continue;
        waiting[r] = state[r].pc;
        std::string what =
            at(r, state[r].pc).op() == Op::ALLREDUCE
                ? describe(at(r, state[r].pc))
                : "data of an unmatched RECV before step " + std::to_string(state[r].pc);
        // Name the receive that has no send yet.
        for (auto &[key, ch] : channels)
          if (key.second == r && ch.recvs.size() > ch.matched) {
            what = describe(at(r, ch.recvs[ch.matched].first));
            break;
          }
        waits += formatv("{0}rank {1} waits in {2}", waits.empty() ? "" : "; ", r, what).str();
      }
      if (deadlock)
        deadlock->waitingAt = waiting;
      return createStringError(inconvertibleErrorCode(),
                               "deadlock under blocking point-to-point semantics: %s",
                               waits.c_str());
    }
  }
  for (auto &[key, ch] : channels)
    if (ch.sends.size() != ch.recvs.size()) {
      auto [from, to] = key;
      bool moreSends = ch.sends.size() > ch.recvs.size();
      int rank = moreSends ? from : to;
      int index = moreSends ? ch.sends[ch.recvs.size()].first : ch.recvs[ch.sends.size()].first;
      const char *missing = moreSends ? "RECV" : "SEND";
      return createStringError(inconvertibleErrorCode(), "rank %d step %d: %s has no matching %s",
                               rank, index, describe(at(rank, index)).c_str(), missing);
    }
  double step = 0;
  for (RankState &st : state) {
    st.clock = std::max(st.clock, st.sendsDone);
    step = std::max(step, st.clock);
  }
  result.stepTime = step;
  double busy = 0;
  for (int r = 0; r < P; ++r) {
    result.busy.push_back(state[r].busy);
    result.idle.push_back(step - state[r].busy);
    busy += state[r].busy;
  }
  result.bubbleFraction = step > 0 ? std::max(0.0, 1 - busy / (P * step)) : 0;
  std::stable_sort(result.events.begin(), result.events.end(),
                   [](const TimelineEvent &a, const TimelineEvent &b) {
                     return a.rank != b.rank ? a.rank < b.rank : a.start < b.start;
                   });
  return result;
}

} // namespace

Expected<SimulationResult> runStreams(ArrayRef<const plan::RankProgram *> programs,
                                      const StreamCosts &costs, Deadlock *deadlock) {
  return Streams(programs, costs).run(deadlock);
}

double transferSeconds(const plan::HardwareInfo &hw, int from, int to, int64_t bytes) {
  int perNode = std::max(1, hw.devices_per_node());
  const plan::LinkInfo &l = from / perNode == to / perNode ? hw.intra_node() : hw.inter_node();
  if (bytes <= 0 || l.bandwidth() <= 0)
    return 0.0;
  return l.latency_s() + static_cast<double>(bytes) / l.bandwidth();
}

double ringAllReduceSeconds(int n, int64_t bytes, const std::function<double(int64_t)> &step) {
  n = std::max(1, n);
  if (n <= 1)
    return 0.0;
  return 2.0 * (n - 1) * step(bytes / n);
}

double interNodeStepSeconds(const plan::HardwareInfo &hw, int64_t bytes) {
  const plan::LinkInfo &l = hw.inter_node();
  return l.bandwidth() > 0 ? l.latency_s() + static_cast<double>(bytes) / l.bandwidth() : 0.0;
}

double optimizerSeconds(const plan::HardwareInfo &hw, int64_t weightBytes) {
  if (hw.memory_bandwidth() <= 0)
    return 0.0;
  return 2.0 * static_cast<double>(weightBytes) / hw.memory_bandwidth();
}

Expected<SimulationResult> simulatePlan(const plan::Plan &plan) {
  if (plan.programs_size() == 0)
    return createStringError(inconvertibleErrorCode(),
                             "the plan has no instruction streams to simulate");
  std::map<int, const plan::Stage *> stages;
  for (const auto &s : plan.stages())
    stages[s.index()] = &s;
  auto hardware = [&](int r) -> const plan::HardwareInfo & {
    return plan.hardware(std::min(r, plan.hardware_size() - 1));
  };
  auto link = [&](int from, int to, int64_t bytes) {
    return transferSeconds(hardware(from), from, to, bytes);
  };
  StreamCosts costs;
  costs.compute = [&](int r, const plan::Instruction &ins) {
    auto it = stages.find(ins.stage());
    const plan::Stage *s = it == stages.end() ? nullptr : it->second;
    switch (ins.op()) {
    case Op::FORWARD:
    case Op::RECOMPUTE:
      return s ? s->time_f_s() : 0.0;
    case Op::BACKWARD:
      return s ? s->time_i_s() + s->time_w_s() : 0.0;
    case Op::BACKWARD_INPUT:
      return s ? s->time_i_s() : 0.0;
    case Op::BACKWARD_WEIGHT:
      return s ? s->time_w_s() : 0.0;
    case Op::OPTIMIZER_STEP:
      return r < plan.ranks_size() ? optimizerSeconds(hardware(r), plan.ranks(r).weight_bytes())
                                   : 0.0;
    default:
      return 0.0;
    }
  };
  costs.transfer = link;
  costs.allReduce = [&](int r, const plan::Instruction &ins) {
    if (ins.reduce() == plan::Instruction::DATA_PARALLEL)
      return ringAllReduceSeconds(plan.schedule().data_parallel(), ins.bytes(),
                                  [&](int64_t b) { return interNodeStepSeconds(hardware(r), b); });
    // The step is asked for only with two ranks or more.
    return ringAllReduceSeconds(ins.ranks_size(), ins.bytes(), [&](int64_t b) {
      return link(r, ins.ranks(0) == r ? ins.ranks(1) : ins.ranks(0), b);
    });
  };
  std::vector<const plan::RankProgram *> programs;
  for (const auto &p : plan.programs())
    programs.push_back(&p);
  auto result = runStreams(programs, costs);
  if (!result)
    return result.takeError();
  for (int r = 0; r < plan.programs_size(); ++r) {
    int64_t weights = r < plan.ranks_size() ? plan.ranks(r).weight_bytes() : 0;
    result->peakMemory.push_back(weights + plan.programs(r).peak_activation_bytes());
  }
  return result;
}

void writeChromeTrace(const SimulationResult &result, raw_ostream &os) {
  std::set<int> ranks;
  std::vector<TraceEvent> events;
  for (const TimelineEvent &e : result.events) {
    ranks.insert(e.rank);
    events.push_back({e.name, e.category, e.rank, e.start, e.duration});
  }
  printChromeTrace(os, std::vector<int>(ranks.begin(), ranks.end()), events);
}

Expected<SimulationResult> readMeasuredTrace(StringRef path, int ranks) {
  auto fail = [&](const Twine &why) { return fileError(path, why); };
  auto buffer = MemoryBuffer::getFile(path);
  if (!buffer)
    return fail(buffer.getError().message());
  auto parsed = parseChromeTrace((*buffer)->getBuffer());
  if (!parsed)
    return fail(toString(parsed.takeError()));
  std::vector<TimelineEvent> events;
  for (TraceEvent &e : *parsed) {
    TimelineEvent t;
    t.rank = e.rank;
    t.name = std::move(e.name);
    t.category = e.category;
    t.start = e.start;
    t.duration = e.duration;
    // "<stage><kind><microbatch>", e.g. "2I5".
    size_t kind = t.name.find_first_of("FBIWR");
    if (t.category != 'C' && kind != std::string::npos)
      StringRef(t.name).drop_front(kind + 1).getAsInteger(10, t.microbatch);
    if (t.rank >= 0 && t.rank < ranks)
      events.push_back(std::move(t));
  }
  if (events.empty())
    return fail("holds no events of ranks below " + Twine(ranks));
  // The last step starts where every rank has ended the step before it.
  std::map<int, std::vector<double>> optimizerEnds;
  for (const TimelineEvent &e : events)
    if (e.category == 'O')
      optimizerEnds[e.rank].push_back(e.start + e.duration);
  double from = -1;
  for (auto &[rank, ends] : optimizerEnds) {
    std::sort(ends.begin(), ends.end());
    if (ends.size() >= 2)
      from = std::max(from, ends[ends.size() - 2]);
  }
  SimulationResult result;
  result.busy.assign(ranks, 0);
  double begin = std::numeric_limits<double>::max(), end = 0;
  for (const TimelineEvent &e : events)
    if (e.start >= from) {
      begin = std::min(begin, e.start);
      end = std::max(end, e.start + e.duration);
    }
  for (TimelineEvent &e : events) {
    if (e.start < from)
      continue;
    e.start -= begin;
    if (e.category != 'C')
      result.busy[e.rank] += e.duration;
    result.events.push_back(std::move(e));
  }
  result.stepTime = end - begin;
  for (int r = 0; r < ranks; ++r)
    result.idle.push_back(std::max(0.0, result.stepTime - result.busy[r]));
  double busy = 0;
  for (double b : result.busy)
    busy += b;
  result.bubbleFraction =
      result.stepTime > 0 ? 1 - busy / (result.stepTime * std::max(1, ranks)) : 0;
  return result;
}

const char *timelineLegend() {
  return "digits: forward of microbatch N (mod 10); a-z: backward (I or B, mod 26); A-Z: weight "
         "gradient (W, mod 26); *: recompute; #: optimizer; .: idle";
}

std::string formatTimeline(const SimulationResult &result, int ranks, int width) {
  std::vector<std::string> rows(ranks, std::string(width, '.'));
  double step = result.stepTime > 0 ? result.stepTime : 1;
  for (const TimelineEvent &e : result.events) {
    if (e.category == 'C' || e.rank >= ranks || e.duration <= 0)
      continue;
    int from = static_cast<int>(e.start / step * width);
    int to = std::max(from + 1, static_cast<int>((e.start + e.duration) / step * width));
    char c = e.category == 'O' ? '#' : static_cast<char>('0' + (e.microbatch % 10));
    if (e.category == 'B' || e.category == 'I')
      c = static_cast<char>('a' + e.microbatch % 26);
    if (e.category == 'W')
      c = static_cast<char>('A' + e.microbatch % 26);
    if (e.category == 'R')
      c = '*';
    for (int x = from; x < std::min(to, width); ++x)
      rows[e.rank][x] = c;
  }
  std::string out;
  for (int r = 0; r < ranks; ++r)
    out += formatv("rank {0,2} |{1}|\n", r, rows[r]).str();
  return out;
}

} // namespace pipec
