//===- Simulator.cpp - Event simulation of a plan's instruction streams ---===//
#include "compiler/sim/Simulator.h"
#include "plan/PlanFile.h"
#include "support/ChromeTrace.h"
#include "support/Diagnostics.h"

#include "llvm/ADT/DenseMap.h"
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

bool isCompute(Op::Op op) {
  return op == Op::FORWARD || op == Op::BACKWARD || op == Op::BACKWARD_INPUT ||
         op == Op::BACKWARD_WEIGHT || op == Op::RECOMPUTE;
}

char categoryOf(Op::Op op) {
  switch (op) {
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

bool sameShape(const plan::TensorRef &a, const plan::TensorRef &b) {
  return a.bytes() == b.bytes() && a.dtype() == b.dtype() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end());
}

struct RankState {
  int pc = 0;
  double clock = 0; ///< when the rank's compute stream is free
  double busy = 0;
  int outstanding = 0;    ///< posted RECVs not yet matched
  double sendsDone = 0;   ///< when its last SEND finished
  double lastArrival = 0; ///< the latest data any of its RECVs brought
  /// The channels its last SEND and RECV used, and their peers.
  int sendPeer = -1, sendChannel = -1, recvPeer = -1, recvChannel = -1;
};
/// The RECVs of one (rank, stage, microbatch, grad): how many have not
/// matched yet, and when the data of those that matched arrived.
struct Mailbox {
  int pending = 0;
  double arrival = 0;
};
/// One direction of one pair of ranks: NCCL matches the k-th send with the
/// k-th receive.
struct Channel {
  int from = 0, to = 0;
  /// A posted SEND or RECV: its instruction, a RECV's mailbox, the time.
  struct Posted {
    int at = 0, mailbox = -1;
    double time = 0;
  };
  /// The posts since both sides were last all matched (then emptied, so
  /// that they stay short), and how many were matched before.
  std::vector<Posted> sends, recvs;
  size_t base = 0;
  /// The last transfer's size and time (transfers on a channel repeat).
  int64_t lastBytes = -1;
  double lastTime = 0;
  size_t matched = 0;
};

/// The engine's working memory. A search runs hundreds of candidates of
/// the same shape in a row, so each thread keeps the last run's vectors and
/// reuses their capacity.
struct EngineMemory {
  std::vector<RankState> state;
  std::vector<Mailbox> mailbox;
  std::vector<Channel> channels;
  int used = 0; ///< channels in use: a prefix of channels
  DenseMap<uint64_t, int> channelIndex;
  std::vector<int> channelOrder; ///< by (from, to)
  std::vector<int> work;         ///< ranks that may move
  std::vector<char> queued;

  void reset(int ranks, int mailboxes) {
    state.assign(ranks, RankState());
    work.clear();
    queued.assign(ranks, 0);
    mailbox.assign(mailboxes, Mailbox());
    for (int c = 0; c < used; ++c) {
      channels[c].sends.clear();
      channels[c].recvs.clear();
      channels[c].matched = 0;
      channels[c].base = 0;
      channels[c].lastBytes = -1;
    }
    used = 0;
    channelIndex.clear();
    channelOrder.clear();
  }
};

thread_local EngineMemory engineMemory;

/// The engine behind runStreams.
class Engine {
public:
  Engine(const Streams &streams, const StreamCosts &costs, bool events, bool trusted)
      : streams(streams), costs(costs), events(events), trusted(trusted),
        P(static_cast<int>(streams.ranks.size())), memory(engineMemory), state(memory.state),
        mailbox(memory.mailbox), channels(memory.channels), channelOrder(memory.channelOrder) {
    memory.reset(P, streams.mailboxes);
  }

  Expected<SimulationResult> run(Deadlock *deadlock);

private:
  const StreamOp &at(int r, int i) const { return streams.ranks[r][i]; }
  bool done(int r) const { return state[r].pc >= static_cast<int>(streams.ranks[r].size()); }
  std::string describe(const StreamOp &op) const;
  int channel(int from, int to);
  /// Queues rank \p r to be advanced.
  void wake(int r) {
    if (!memory.queued[r])
      memory.queued[r] = 1, memory.work.push_back(r);
  }
  /// Runs rank \p r until it blocks.
  Error advance(int r, Deadlock *deadlock);
  /// Matches what both sides of channel \p c have posted, and wakes the
  /// receivers.
  Error match(int c, Deadlock *deadlock);
  /// Completes the ALLREDUCE rank \p r waits in when its whole group waits
  /// in it with nothing outstanding.
  void collective(int r);
  bool sameCollective(const StreamOp &a, const StreamOp &b) const {
    if (a.collective == b.collective)
      return true;
    const StreamCollective &x = streams.collectives[a.collective],
                           &y = streams.collectives[b.collective];
    return x.op == y.op && x.reduce == y.reduce && x.tiedWeight == y.tiedWeight;
  }

  const Streams &streams;
  const StreamCosts &costs;
  bool events, trusted;
  int P;
  EngineMemory &memory;
  std::vector<RankState> &state;
  std::vector<Mailbox> &mailbox;
  std::vector<Channel> &channels; ///< the first memory.used
  std::vector<int> &channelOrder;
  SimulationResult result;
};

std::string Engine::describe(const StreamOp &op) const {
  if (isCollective(op.op))
    return Op::Op_Name(op.op) + " " + streams.collectives[op.collective].group;
  return formatv("{0} {1} s{2} mb{3} {4} {5} {6}", op.op == Op::SEND ? "SEND" : "RECV",
                 op.grad ? "grad" : "act", op.stage, op.microbatch, op.op == Op::SEND ? "->" : "<-",
                 op.peer, streams.tensors[op.tensor]->name())
      .str();
}

int Engine::channel(int from, int to) {
  uint64_t key = static_cast<uint64_t>(from) * static_cast<uint64_t>(P) + to;
  auto [it, inserted] = memory.channelIndex.try_emplace(key, memory.used);
  if (inserted) {
    if (memory.used == static_cast<int>(channels.size()))
      channels.emplace_back();
    Channel &ch = channels[memory.used++];
    ch.from = from;
    ch.to = to;
    auto later =
        std::upper_bound(channelOrder.begin(), channelOrder.end(), key, [&](uint64_t k, int c) {
          return k < static_cast<uint64_t>(channels[c].from) * static_cast<uint64_t>(P) +
                         channels[c].to;
        });
    channelOrder.insert(later, it->second);
  }
  return it->second;
}

Error Engine::advance(int r, Deadlock *deadlock) {
  RankState &st = state[r];
  while (!done(r)) {
    const StreamOp &ins = at(r, st.pc);
    if (isCollective(ins.op)) {
      int at = st.pc;
      collective(r);
      if (st.pc == at)
        return Error::success(); // the rest of its group is not there yet
      continue;
    }
    switch (ins.op) {
    case Op::SEND:
    case Op::RECV: {
      int peer = ins.peer;
      if (peer < 0 || peer >= P || peer == r)
        return createStringError(inconvertibleErrorCode(), "rank %d step %d: %s names peer %d", r,
                                 st.pc, describe(ins).c_str(), peer);
      int c;
      if (ins.op == Op::SEND) {
        if (st.sendPeer != peer)
          st.sendPeer = peer, st.sendChannel = channel(r, peer);
        c = st.sendChannel;
        channels[c].sends.push_back({st.pc, -1, st.clock});
      } else {
        if (st.recvPeer != peer)
          st.recvPeer = peer, st.recvChannel = channel(peer, r);
        c = st.recvChannel;
        channels[c].recvs.push_back({st.pc, ins.mailbox, st.clock});
        ++mailbox[ins.mailbox].pending;
        ++st.outstanding;
      }
      ++st.pc;
      if (Error err = match(c, deadlock))
        return err;
      continue;
    }
    case Op::LOAD:
    case Op::FREE:
      ++st.pc; // no time, no data
      continue;
    default:
      break;
    }
    // Everything else runs on the compute stream after the data it receives:
    // a forward needs the activations of the stage before, a backward the
    // gradients of its own outputs, the optimizer step everything.
    double ready = 0;
    if (ins.op == Op::OPTIMIZER_STEP) {
      if (st.outstanding > 0)
        return Error::success();
      ready = st.lastArrival;
    } else if (ins.mailbox >= 0) {
      if (mailbox[ins.mailbox].pending > 0)
        return Error::success();
      ready = mailbox[ins.mailbox].arrival;
    }
    double duration = costs.compute ? costs.compute(r, ins) : 0;
    double start = std::max(st.clock, ready);
    bool compute = isCompute(ins.op);
    if (compute || ins.op == Op::OPTIMIZER_STEP) {
      if (events) {
        TimelineEvent e;
        e.rank = r;
        e.category = categoryOf(ins.op);
        e.name = ins.op == Op::OPTIMIZER_STEP
                     ? std::string("optimizer step")
                     : formatv("{0}{1}{2}", ins.stage, e.category, ins.microbatch).str();
        e.start = start;
        e.duration = duration;
        e.microbatch = ins.microbatch;
        result.events.push_back(e);
      }
      if (compute)
        st.busy += duration;
    }
    st.clock = start + duration;
    ++st.pc;
  }
  return Error::success();
}

Error Engine::match(int c, Deadlock *deadlock) {
  Channel &ch = channels[c];
  int from = ch.from, to = ch.to;
  while (ch.matched < std::min(ch.sends.size(), ch.recvs.size())) {
    const Channel::Posted &posted = ch.sends[ch.matched], &wanted = ch.recvs[ch.matched];
    int si = posted.at, ri = wanted.at;
    double sendPosted = posted.time, recvPosted = wanted.time;
    const StreamOp &send = at(from, si);
    const plan::TensorRef &sent = *streams.tensors[send.tensor];
    if (!trusted) {
      const StreamOp &recv = at(to, ri);
      const plan::TensorRef &received = *streams.tensors[recv.tensor];
      bool same = send.stage == recv.stage && send.microbatch == recv.microbatch &&
                  send.grad == recv.grad && (&sent == &received || sent.name() == received.name());
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
            from, si, describe(send).c_str(), from, ch.base + ch.matched, to, to,
            ch.base + ch.matched, from, describe(recv).c_str(), ri);
      if (&sent != &received && !sameShape(sent, received))
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d step %d: %s sends %lld bytes of %s, rank %d step %d "
                                 "receives %lld bytes of %s",
                                 from, si, describe(send).c_str(),
                                 static_cast<long long>(sent.bytes()), sent.dtype().c_str(), to, ri,
                                 static_cast<long long>(received.bytes()),
                                 received.dtype().c_str());
    }
    double start = std::max(sendPosted, recvPosted);
    int64_t bytes = sent.bytes();
    if (bytes != ch.lastBytes && costs.transfer)
      ch.lastBytes = bytes, ch.lastTime = costs.transfer(from, to, bytes);
    double length = costs.transfer ? ch.lastTime : 0;
    if (events) {
      TimelineEvent e;
      e.rank = from;
      e.category = 'C';
      e.name = formatv("send {0} s{1} mb{2} -> {3} {4}", send.grad ? "grad" : "act", send.stage,
                       send.microbatch, to, sent.name())
                   .str();
      e.start = start;
      e.duration = length;
      e.microbatch = send.microbatch;
      result.events.push_back(e);
    }
    Mailbox &box = mailbox[wanted.mailbox];
    --box.pending;
    box.arrival = std::max(box.arrival, start + length);
    --state[to].outstanding;
    state[to].lastArrival = std::max(state[to].lastArrival, start + length);
    state[from].sendsDone = std::max(state[from].sendsDone, start + length);
    ++ch.matched;
    wake(to);
  }
  if (ch.matched == ch.sends.size() && ch.matched == ch.recvs.size()) {
    ch.base += ch.matched;
    ch.sends.clear();
    ch.recvs.clear();
    ch.matched = 0;
  }
  return Error::success();
}

void Engine::collective(int r) {
  if (done(r) || !isCollective(at(r, state[r].pc).op) || state[r].outstanding > 0)
    return;
  const StreamOp &ins = at(r, state[r].pc);
  const StreamCollective &group = streams.collectives[ins.collective];
  double start = 0;
  for (int peer : group.ranks) {
    if (peer < 0 || peer >= P || done(peer) || !isCollective(at(peer, state[peer].pc).op) ||
        !sameCollective(at(peer, state[peer].pc), ins) || state[peer].outstanding > 0)
      return;
    start = std::max(start, state[peer].clock);
  }
  for (int peer : group.ranks) {
    const StreamCollective &theirs = streams.collectives[at(peer, state[peer].pc).collective];
    double length = costs.allReduce ? costs.allReduce(peer, theirs) : 0;
    if (events) {
      TimelineEvent e;
      e.rank = peer;
      e.category = 'C';
      e.name = std::string(collectiveOf(theirs.op)->name) + " " + group.group;
      e.start = start;
      e.duration = length;
      result.events.push_back(e);
    }
    state[peer].clock = start + length;
    ++state[peer].pc;
    if (peer != r)
      wake(peer);
  }
}

Expected<SimulationResult> Engine::run(Deadlock *deadlock) {
  // Each rank runs until it waits for data or a collective; a match wakes
  // the receiver, a collective's completion its group. Every time is fixed
  // when its instruction is posted, so the order ranks run in changes no
  // time, and the run ends where no rank can move.
  for (int r = P - 1; r >= 0; --r)
    wake(r);
  while (!memory.work.empty()) {
    int r = memory.work.back();
    memory.work.pop_back();
    memory.queued[r] = 0;
    if (Error err = advance(r, deadlock))
      return err;
  }
  std::string waits;
  std::vector<int> waiting(P, -1);
  for (int r = 0; r < P; ++r) {
    if (done(r))
      continue;
    waiting[r] = state[r].pc;
    std::string what = isCollective(at(r, state[r].pc).op)
                           ? describe(at(r, state[r].pc))
                           : "data of an unmatched RECV before step " + std::to_string(state[r].pc);
    // Name the receive that has no send yet.
    for (int c : channelOrder) {
      const Channel &ch = channels[c];
      if (ch.to == r && ch.recvs.size() > ch.matched) {
        what = describe(at(r, ch.recvs[ch.matched].at));
        break;
      }
    }
    waits += formatv("{0}rank {1} waits in {2}", waits.empty() ? "" : "; ", r, what).str();
  }
  if (!waits.empty()) {
    if (deadlock)
      deadlock->waitingAt = waiting;
    return createStringError(inconvertibleErrorCode(),
                             "deadlock under blocking point-to-point semantics: %s", waits.c_str());
  }
  for (int c : channelOrder) {
    const Channel &ch = channels[c];
    if (ch.sends.size() != ch.recvs.size()) {
      bool moreSends = ch.sends.size() > ch.recvs.size();
      int rank = moreSends ? ch.from : ch.to;
      int index = moreSends ? ch.sends[ch.recvs.size()].at : ch.recvs[ch.sends.size()].at;
      const char *missing = moreSends ? "RECV" : "SEND";
      return createStringError(inconvertibleErrorCode(), "rank %d step %d: %s has no matching %s",
                               rank, index, describe(at(rank, index)).c_str(), missing);
    }
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
  return std::move(result);
}

} // namespace

Streams streamsOf(ArrayRef<const plan::RankProgram *> programs) {
  Streams out;
  out.ranks.resize(programs.size());
  // Mailboxes: (rank, stage, microbatch, grad) of every RECV.
  std::map<std::tuple<int, int64_t, int64_t, bool>, int> boxes;
  for (size_t r = 0; r < programs.size(); ++r) {
    std::vector<StreamOp> &ops = out.ranks[r];
    ops.reserve(programs[r]->instructions_size());
    for (const plan::Instruction &ins : programs[r]->instructions()) {
      StreamOp op;
      op.op = ins.op();
      op.stage = ins.stage();
      op.microbatch = ins.microbatch();
      op.buffer = ins.buffer();
      switch (ins.op()) {
      case Op::SEND:
      case Op::RECV:
        op.peer = ins.peer();
        op.grad = ins.grad();
        op.tensor = static_cast<int>(out.tensors.size());
        out.tensors.push_back(&ins.tensor());
        if (ins.op() == Op::RECV) {
          auto [it, inserted] = boxes.try_emplace(
              {static_cast<int>(r), ins.stage(), ins.microbatch(), ins.grad()}, out.mailboxes);
          out.mailboxes += inserted ? 1 : 0;
          op.mailbox = it->second;
        }
        break;
      case Op::LOAD:
        op.labels = ins.group() == "labels";
        break;
      default:
        break;
      }
      if (isCollective(ins.op())) {
        StreamCollective c;
        c.op = ins.op();
        c.reduce = ins.reduce();
        c.tiedWeight = ins.tied_weight();
        c.ranks.assign(ins.ranks().begin(), ins.ranks().end());
        c.bytes = ins.bytes();
        c.group = ins.group();
        op.collective = static_cast<int>(out.collectives.size());
        out.collectives.push_back(std::move(c));
      }
      ops.push_back(op);
    }
  }
  int lastStage = 0;
  for (const std::vector<StreamOp> &ops : out.ranks)
    for (const StreamOp &op : ops)
      lastStage = std::max(lastStage, op.stage);
  for (size_t r = 0; r < programs.size(); ++r)
    for (StreamOp &op : out.ranks[r]) {
      std::tuple<int, int64_t, int64_t, bool> key;
      if (op.op == Op::SCHEDULE) // a generation's: after the last stage's picks
        key = {static_cast<int>(r), lastStage, op.microbatch, false};
      else if (op.op == Op::FORWARD)
        key = {static_cast<int>(r), int64_t(op.stage) - 1, op.microbatch, false};
      else if (op.op == Op::BACKWARD || op.op == Op::BACKWARD_INPUT)
        key = {static_cast<int>(r), op.stage, op.microbatch, true};
      else
        continue;
      auto it = boxes.find(key);
      op.mailbox = it == boxes.end() ? -1 : it->second;
    }
  return out;
}

Expected<SimulationResult> runStreams(const Streams &streams, const StreamCosts &costs,
                                      Deadlock *deadlock, bool events, bool trusted) {
  return Engine(streams, costs, events, trusted).run(deadlock);
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

StreamCosts streamCosts(const StepCosts &c) {
  auto hardware = [&c](int r) -> const plan::HardwareInfo & {
    return c.hardware[std::min<size_t>(r, c.hardware.size() - 1)];
  };
  auto link = [hardware](int from, int to, int64_t bytes) {
    return transferSeconds(hardware(from), from, to, bytes);
  };
  StreamCosts costs;
  if (c.hardware.empty())
    return costs;
  costs.compute = [&c, hardware](int r, const StreamOp &ins) {
    const std::array<double, 3> *t =
        ins.stage >= 0 && ins.stage < static_cast<int>(c.stageTimes.size())
            ? &c.stageTimes[ins.stage]
            : nullptr;
    switch (ins.op) {
    case Op::FORWARD:
      return t ? (*t)[0] : 0.0;
    case Op::RECOMPUTE:
      if (ins.stage >= 0 && ins.stage < static_cast<int>(c.recomputeTimes.size()))
        return c.recomputeTimes[ins.stage];
      return t ? (*t)[0] : 0.0;
    case Op::BACKWARD:
      return t ? (*t)[1] + (*t)[2] : 0.0;
    case Op::BACKWARD_INPUT:
      return t ? (*t)[1] : 0.0;
    case Op::BACKWARD_WEIGHT:
      return t ? (*t)[2] : 0.0;
    case Op::OPTIMIZER_STEP:
      return r < static_cast<int>(c.weightBytes.size())
                 ? optimizerSeconds(hardware(r), c.weightBytes[r])
                 : 0.0;
    default:
      return 0.0;
    }
  };
  costs.transfer = link;
  costs.allReduce = [&c, hardware, link](int r, const StreamCollective &group) {
    if (group.reduce == plan::Instruction::DATA_PARALLEL) {
      // A ring all-reduce is a reduce-scatter and then an all-gather, each
      // half of its steps.
      double ring = ringAllReduceSeconds(c.dataParallel, group.bytes, [&](int64_t b) {
        return interNodeStepSeconds(hardware(r), b);
      });
      return ring * collectiveOf(group.op)->ringShare;
    }
    // The step is asked for only with two ranks or more.
    return ringAllReduceSeconds(static_cast<int>(group.ranks.size()), group.bytes, [&](int64_t b) {
      return link(r, group.ranks[0] == r ? group.ranks[1] : group.ranks[0], b);
    });
  };
  return costs;
}

Expected<SimulationResult> simulatePlan(const plan::Plan &plan) {
  if (plan.programs_size() == 0)
    return createStringError(inconvertibleErrorCode(),
                             "the plan has no instruction streams to simulate");
  StepCosts step;
  step.stageTimes.assign(plan.stages_size(), {0.0, 0.0, 0.0});
  step.recomputeTimes.assign(plan.stages_size(), 0.0);
  for (const plan::Stage &s : plan.stages())
    if (s.index() >= 0 && s.index() < plan.stages_size()) {
      step.stageTimes[s.index()] = {s.time_f_s(), s.time_i_s(), s.time_w_s()};
      step.recomputeTimes[s.index()] = s.recomputed_layers() > 0 ? s.time_r_s() : s.time_f_s();
    }
  for (const plan::Rank &r : plan.ranks())
    step.weightBytes.push_back(r.weight_bytes());
  std::vector<plan::HardwareInfo> hardware(plan.hardware().begin(), plan.hardware().end());
  step.hardware = hardware;
  step.dataParallel = plan.schedule().data_parallel();
  std::vector<const plan::RankProgram *> programs;
  for (const auto &p : plan.programs())
    programs.push_back(&p);
  auto result = runStreams(streamsOf(programs), streamCosts(step), nullptr, true);
  if (!result)
    return result.takeError();
  for (int r = 0; r < plan.programs_size(); ++r) {
    int64_t weights = r < plan.ranks_size() ? plan.ranks(r).weight_bytes() : 0;
    result->peakMemory.push_back(weights + plan.programs(r).peak_activation_bytes());
  }
  return result;
}

Error simulateIntoPlan(plan::Plan &plan) {
  auto simulated = simulatePlan(plan);
  if (!simulated)
    return simulated.takeError();
  plan::Simulated &sim = *plan.mutable_simulated();
  sim.Clear();
  sim.set_step_time_s(simulated->stepTime);
  sim.set_bubble_fraction(simulated->bubbleFraction);
  for (size_t r = 0; r < simulated->busy.size(); ++r) {
    sim.add_busy_s(simulated->busy[r]);
    sim.add_idle_s(simulated->idle[r]);
    sim.add_peak_memory_bytes(simulated->peakMemory[r]);
    if (static_cast<int>(r) < plan.ranks_size()) {
      plan::Rank &rank = *plan.mutable_ranks(r);
      rank.set_busy_s(simulated->busy[r]);
      rank.set_idle_s(simulated->idle[r]);
      rank.set_peak_memory_bytes(simulated->peakMemory[r]);
    }
  }
  plan.mutable_predicted()->set_step_time_s(simulated->stepTime);
  plan.mutable_predicted()->set_bubble_fraction(simulated->bubbleFraction);
  return Error::success();
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
