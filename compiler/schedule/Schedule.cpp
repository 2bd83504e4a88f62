//===- Schedule.cpp - Per-rank compute orders of pipeline schedules -----===//
//
// Each generator reproduces the compute order that PyTorch's
// torch.distributed.pipelining (2.15.0, schedules.py) executes on every rank,
// except ZB-H2, which PyTorch lacks and which follows Qi et al., "Zero Bubble
// Pipeline Parallelism" (2023), section 2.2. tests/fixtures/schedules/ holds
// PyTorch's orders, written by tools/make_schedule_fixtures.py. PyTorch's idle
// slots (None) are not emitted: ranks run their list in order and wait on
// data, which lower-schedule makes explicit with receives.
//
// Notation: P ranks, V chunks per rank, M microbatches, rank r. Counts are
// per rank; "k x (A B)" repeats the group k times.
//
// GPipe (ScheduleGPipe): M x F, then M x B.
// Forward-only (_ScheduleForwardOnly): M x F.
//
// 1F1B (Schedule1F1B._step_microbatches; PyTorch needs M >= P):
//   warm-up   w = min(M, P - r) x F
//   steady    M - w x (B F)
//   cool-down w x B
//
// Looped 1F1B, interleaved (ScheduleInterleaved1F1B) and zero-bubble
// (ScheduleInterleavedZeroBubble; ZB-H1 is its V = 1 case). Microbatches run
// in R = max(1, M / P) rounds of n = M / R (PyTorch needs M % R == 0). Of the
// V M forwards and V M backwards of rank r:
//   warm-up   w = min((V - 1) n + f (P - 1 - r), V M) x F
//             with f = 2 for interleaved, 1 for zero bubble
//   steady    V M - w x (F Bk)         Bk = B, or I for zero bubble
//   cool-down w x Bk
// The k-th forward (from 0) runs local chunk (k / n) mod V, the k-th backward
// local chunk V - 1 - (k / n) mod V (local chunk c is stage c P + r), so a
// rank switches chunks every n forwards or backwards. Zero bubble adds, after
// each of its I's but the first r, the W of the oldest I still without one,
// and ends with the remaining W's. PyTorch then inserts idle slots where an
// action would wait (_add_bubbles_to_actions); that moves no action, so the
// order is the one above. With F = I = W = 1 this is ZB-H1: makespan
// 3M + P - 1 against 1F1B's 3(M + P - 1).
//
// M not a multiple of P (interleaved): pipec follows PyTorch's
// ScheduleInterleaved1F1B (torch/distributed/pipelining/schedules.py):
// R = max(1, M / P) rounds of n = M / R, so P = 4 runs M = 6 as one round
// of 6 and M = 10 as two rounds of 5, and refuses M = 9 (9 % 2 != 0).
// Megatron-LM differs. Its older releases refused any M % P != 0 for the
// interleaved schedule ("number of microbatches is not divisible by
// pipeline-parallel size when using interleaved schedule", in
// get_forward_backward_func). Its current
// forward_backward_pipelining_with_interleaving
// (megatron/core/pipeline_parallel/schedules.py) runs groups of
// N = microbatch_group_size_per_vp_stage microbatches per chunk (P by
// default), requires P <= N <= M, and refuses a last group of fewer than P
// (0 < M % N < P: "dependency bubbles"). So Megatron's default takes
// M = 6 at P = 4 only with N = 6 set, and then runs pipec's order; with
// N = P it takes M = 8 or 12 as pipec does, and no M between them.
//
// ZB-H2 (Qi et al., section 2.2 and figure 3; V = 1). More forwards in
// warm-up, so that the first I arrives just as they end, and at most 2P - 1
// microbatches held (F to W) on any rank: an F that would make 2P held runs
// after the W of the oldest I without one. With F = I = W and M >= 2P - 1
// every rank runs without a gap from r to r + 3M, which turns the 1F1B
// trapezoid into a parallelogram (no synchronisation at the optimizer step
// is assumed, as in the paper).
//   warm-up   w = min(M, 2(P - r) - 1) x F
//   ramp      min(2r, M - w) x (I F)          holds grow to min(M, 2P - 1)
//   steady    M - w - 2r x (I W F)            one in, one out (if positive)
//   cool-down (I W) for each I left, then the W's left
// At P = 4, M = 8 (1-based, as in the paper's figure) rank 0 runs
// F1..F7 B1 W1 F8 B2 W2 .. B8 W8 and rank 3 runs F1 B1 .. F7 B7 W1 F8 B8
// W2..W8, the first and last rows of figure 3. The reference
// implementation's search (sail-sg/zero-bubble-pipeline-parallelism,
// zb.py's manual_order with a 2P - 1 cap) finds the same rows for the first
// and last rank; on the middle ranks it runs the tail's I's first and its
// W's in pairs, which takes the same time when F = I = W.

// ZB-V (ScheduleZBVZeroBubble; V = 2; chunks c0 = r, c1 = 2P - 1 - r). PyTorch
// builds it for N = max(M, 2P - 1) microbatches and drops those >= M:
//   warm-up   2(P - r) - 1 x F0;  r x (F1 F0);  P - r x (F1 I1 W1)
//   steady    N - 2P + r + 1 x (F0 I0 W0 F1 I1 W1);  P - r - 1 x (I0 W0 F1 I1 W1)
//   cool-down r x (I0 I1);  P - r x (I0 W0);  the W1's left;  the W0's left
//
// DualPipeV (ScheduleDualPipeV after DeepSeek's dualpipev.py; V = 2, V shape,
// M >= 2P). Its phases, with c0 = r and c1 = 2P - 1 - r:
//   1 nF0        2(P - r - 1) x F0
//   2 nF0F1      r + 1 x (F0 F1)
//   3 nB1W1F1    P - r - 1 x (I1 W1 F1)
//   4 nF0B1F1B0  M - 2P + r + 1 x ((F0 B1) (F1 B0))
//   5 nB1F1B0    P - r - 1 x (B1 (F1 B0))
//   6 nB1B0      r + 1 x (B1 B0); from iteration (r + 1) / 2 on, each
//                backward is an I (from that iteration's B1 on odd ranks,
//                from its B0 on even ones)
//   7 nWB0       P - r - 1 x (W I0)
//   8 nW         the r + 1 W's left
// A parenthesised (F B) is PyTorch's OVERLAP_F_B, one action whose forward and
// full backward run together on two chunks; it is emitted as the forward
// followed by the backward, the order PyTorch's runtime runs its sub-actions
// in. Every W is of the oldest I without one; DualPipe's phase 8 flushes
// them all, PyTorch's pops r + 1, which is the same set.
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/Schedule.h"
#include "support/EnumNames.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>

using namespace llvm;

namespace pipec {
namespace {

/// Appends one rank's actions, numbering microbatches per (chunk, kind) in
/// order, and queues I's for the W's that follow them.
class RankBuilder {
public:
  explicit RankBuilder(std::vector<Action> &out) : out(out) {}

  void forward(int stage) { emit(stage, ActionKind::F); }
  void fullBackward(int stage) { emit(stage, ActionKind::B); }
  void inputBackward(int stage) { pendingWeights.push_back(emit(stage, ActionKind::I)); }
  /// The W of the oldest I without one (of \p stage when given); nothing
  /// when there is none.
  void weightBackward(int stage = -1) {
    auto it = std::find_if(pendingWeights.begin(), pendingWeights.end(),
                           [&](const Action &a) { return stage < 0 || a.stage == stage; });
    if (it == pendingWeights.end())
      return;
    out.push_back({it->stage, ActionKind::W, it->microbatch});
    pendingWeights.erase(it);
  }
  bool weightPending(int stage) const {
    return std::any_of(pendingWeights.begin(), pendingWeights.end(),
                       [&](const Action &a) { return a.stage == stage; });
  }
  /// Backward of \p stage: I when \p split, else B.
  void backward(int stage, bool split) {
    if (split)
      inputBackward(stage);
    else
      fullBackward(stage);
  }
  void drainWeights() {
    while (!pendingWeights.empty())
      weightBackward();
  }
  int forwards(int stage) const { return count(stage, ActionKind::F); }
  /// Microbatches of \p stage whose activations are held: forwards run
  /// minus those freed, by a B or by the W after an I (an I frees nothing).
  int held(int stage) const {
    int freed = count(stage, ActionKind::B) -
                static_cast<int>(std::count_if(pendingWeights.begin(), pendingWeights.end(),
                                               [&](const Action &a) { return a.stage == stage; }));
    return forwards(stage) - freed;
  }

private:
  Action emit(int stage, ActionKind kind) {
    // B and I share a counter: each microbatch gets one or the other.
    ActionKind counted = kind == ActionKind::I ? ActionKind::B : kind;
    Action action{stage, kind, next[{stage, counted}]++};
    out.push_back(action);
    return action;
  }
  int count(int stage, ActionKind kind) const {
    auto it = next.find({stage, kind});
    return it == next.end() ? 0 : it->second;
  }

  std::vector<Action> &out;
  std::map<std::pair<int, ActionKind>, int> next;
  std::deque<Action> pendingWeights;
};

void gpipe(RankBuilder &b, int rank, int m) {
  for (int i = 0; i < m; ++i)
    b.forward(rank);
  for (int i = 0; i < m; ++i)
    b.fullBackward(rank);
}

void forwardOnly(RankBuilder &b, int rank, int m) {
  for (int i = 0; i < m; ++i)
    b.forward(rank);
}

void oneFOneB(RankBuilder &b, int p, int rank, int m) {
  int warmup = std::min(m, p - rank);
  for (int i = 0; i < warmup; ++i)
    b.forward(rank);
  for (int i = 0; i < m - warmup; ++i) {
    b.fullBackward(rank);
    b.forward(rank);
  }
  for (int i = 0; i < warmup; ++i)
    b.fullBackward(rank);
}

/// Interleaved 1F1B and its zero-bubble form (ZB-H1 when v == 1).
void looped(RankBuilder &b, int p, int v, int rank, int m, bool zeroBubble) {
  int rounds = std::max(1, m / p);
  int perRound = m / rounds;
  int total = v * m;
  int warmup = std::min((v - 1) * perRound + (zeroBubble ? 1 : 2) * (p - 1 - rank), total);
  auto forwardStage = [&](int op) { return (op / perRound) % v * p + rank; };
  auto backwardStage = [&](int op) { return (v - 1 - (op - warmup) / perRound % v) * p + rank; };
  // Zero bubble holds back the W's of the first `rank` I's: ranks nearer the
  // end of the pipeline wait less for their I's and so can afford to.
  auto backward = [&](int op) {
    b.backward(backwardStage(op), zeroBubble);
    if (zeroBubble && op - warmup >= rank)
      b.weightBackward();
  };
  for (int op = 0; op < warmup; ++op)
    b.forward(forwardStage(op));
  for (int op = warmup; op < total; ++op) {
    b.forward(forwardStage(op));
    backward(op);
  }
  for (int op = total; op < total + warmup; ++op)
    backward(op);
  b.drainWeights();
}

void zeroBubbleH2(RankBuilder &b, int p, int rank, int m) {
  int cap = 2 * p - 1;
  int warmup = std::min(m, cap - 2 * rank);
  for (int i = 0; i < warmup; ++i)
    b.forward(rank);
  // Every I is followed by an F while forwards remain, preceded by a W when
  // the rank already holds 2P - 1 microbatches; once they run out, by a W.
  for (int i = 0; i < m; ++i) {
    b.inputBackward(rank);
    if (b.forwards(rank) == m) {
      b.weightBackward();
      continue;
    }
    if (b.held(rank) >= cap)
      b.weightBackward();
    b.forward(rank);
  }
  b.drainWeights();
}

/// ZB-V for n >= 2P - 1 microbatches; the caller drops those >= M.
void zeroBubbleV(RankBuilder &b, int p, int rank, int n) {
  int c0 = rank, c1 = 2 * p - 1 - rank;
  auto inputWeight = [&](int stage) {
    b.inputBackward(stage);
    b.weightBackward(stage);
  };
  for (int i = 0; i < 2 * (p - rank) - 1; ++i)
    b.forward(c0);
  for (int i = 0; i < rank; ++i) {
    b.forward(c1);
    b.forward(c0);
  }
  for (int i = 0; i < p - rank; ++i) {
    b.forward(c1);
    inputWeight(c1);
  }
  for (int i = 0; i < n - 2 * p + rank + 1; ++i) {
    b.forward(c0);
    inputWeight(c0);
    b.forward(c1);
    inputWeight(c1);
  }
  for (int i = 0; i < p - rank - 1; ++i) {
    inputWeight(c0);
    b.forward(c1);
    inputWeight(c1);
  }
  for (int i = 0; i < rank; ++i) {
    b.inputBackward(c0);
    b.inputBackward(c1);
  }
  for (int i = 0; i < p - rank; ++i) {
    b.inputBackward(c0);
    b.weightBackward(c0);
  }
  while (b.weightPending(c1))
    b.weightBackward(c1);
  while (b.weightPending(c0))
    b.weightBackward(c0);
}

void dualPipeV(RankBuilder &b, int p, int rank, int m) {
  int c0 = rank, c1 = 2 * p - 1 - rank;
  // 1 nF0, 2 nF0F1: fill both arms of the V.
  for (int i = 0; i < 2 * (p - rank - 1); ++i)
    b.forward(c0);
  for (int i = 0; i < rank + 1; ++i) {
    b.forward(c0);
    b.forward(c1);
  }
  // 3 nB1W1F1: the first backwards of the second arm, W at once.
  for (int i = 0; i < p - rank - 1; ++i) {
    b.inputBackward(c1);
    b.weightBackward();
    b.forward(c1);
  }
  // 4 nF0B1F1B0: each pair is one OVERLAP_F_B in PyTorch (on the last rank
  // the first one is two plain actions, which reads the same here).
  for (int i = 0; i < m - 2 * p + rank + 1; ++i) {
    b.forward(c0);
    b.fullBackward(c1);
    b.forward(c1);
    b.fullBackward(c0);
  }
  // 5 nB1F1B0.
  for (int i = 0; i < p - rank - 1; ++i) {
    b.fullBackward(c1);
    b.forward(c1);
    b.fullBackward(c0);
  }
  // 6 nB1B0: backwards split into I and W from the midpoint on, one chunk
  // earlier on odd ranks.
  bool split = false;
  for (int i = 0; i < rank + 1; ++i) {
    if (i == (rank + 1) / 2 && rank % 2 == 1)
      split = true;
    b.backward(c1, split);
    if (i == (rank + 1) / 2 && rank % 2 == 0)
      split = true;
    b.backward(c0, split);
  }
  // 7 nWB0, 8 nW: the deferred W's fill the drain.
  for (int i = 0; i < p - rank - 1; ++i) {
    b.weightBackward();
    b.backward(c0, split);
  }
  b.drainWeights();
}

constexpr EnumName<ActionKind> actionKindLetters[] = {
    {ActionKind::F, "F"}, {ActionKind::B, "B"}, {ActionKind::I, "I"}, {ActionKind::W, "W"}};

} // namespace

std::vector<int64_t> peakHeldPerChunk(const Schedule &schedule, int rank) {
  std::vector<int> stages;
  for (const Action &a : schedule.ranks[rank])
    stages.push_back(a.stage);
  std::sort(stages.begin(), stages.end());
  stages.erase(std::unique(stages.begin(), stages.end()), stages.end());
  std::vector<int64_t> held(stages.size(), 0), peak(stages.size(), 0);
  bool inference = schedule.kind == ScheduleKind::ForwardOnly;
  for (const Action &a : schedule.ranks[rank]) {
    size_t c = std::lower_bound(stages.begin(), stages.end(), a.stage) - stages.begin();
    if (a.kind == ActionKind::F) {
      peak[c] = std::max(peak[c], ++held[c]);
      // Inference keeps nothing past the forward that made it.
      if (inference)
        --held[c];
    } else if (a.kind == ActionKind::B || a.kind == ActionKind::W) {
      --held[c];
    }
  }
  return peak;
}

int64_t inFlightActivations(ScheduleKind kind, int stages, int virtualStages, int microbatches,
                            int rank) {
  Expected<Schedule> schedule = generateSchedule(kind, stages, virtualStages, microbatches);
  if (!schedule) {
    consumeError(schedule.takeError());
    return static_cast<int64_t>(virtualStages) * microbatches;
  }
  int64_t sum = 0;
  for (int64_t held : peakHeldPerChunk(*schedule, rank))
    sum += held;
  return sum;
}

char actionKindLetter(ActionKind kind) { return nameOf(actionKindLetters, kind, "?").front(); }

std::string formatAction(const Action &action) {
  return std::to_string(action.stage) + actionKindLetter(action.kind) +
         std::to_string(action.microbatch);
}

Expected<Action> parseAction(StringRef text) {
  auto fail = [&] {
    return createStringError(inconvertibleErrorCode(),
                             "action '%s': expected <stage><F|B|I|W><microbatch>, e.g. 2I5",
                             text.str().c_str());
  };
  size_t letter = text.find_first_not_of("0123456789");
  if (letter == 0 || letter == StringRef::npos || letter + 1 >= text.size())
    return fail();
  std::optional<ActionKind> kind = valueOf(actionKindLetters, text.substr(letter, 1));
  if (!kind)
    return fail();
  Action action;
  action.kind = *kind;
  // getAsInteger rejects signs, blanks and overflow, and needs every char.
  if (text.take_front(letter).getAsInteger(10, action.stage) ||
      text.drop_front(letter + 1).getAsInteger(10, action.microbatch) || action.stage < 0 ||
      action.microbatch < 0)
    return fail();
  return action;
}

Expected<Schedule> generateSchedule(ScheduleKind kind, int stages, int virtualStages,
                                    int microbatches) {
  if (Error err = checkScheduleShape(kind, stages, virtualStages, microbatches))
    return err;
  Schedule schedule;
  schedule.kind = kind;
  schedule.stages = stages;
  schedule.virtualStages = virtualStages;
  schedule.microbatches = microbatches;
  schedule.ranks.resize(stages);
  int p = stages, v = virtualStages, m = microbatches;
  for (int rank = 0; rank < p; ++rank) {
    std::vector<Action> &out = schedule.ranks[rank];
    RankBuilder b(out);
    switch (kind) {
    case ScheduleKind::GPipe:
      gpipe(b, rank, m);
      break;
    case ScheduleKind::OneFOneB:
      oneFOneB(b, p, rank, m);
      break;
    case ScheduleKind::Interleaved:
      looped(b, p, v, rank, m, /*zeroBubble=*/false);
      break;
    case ScheduleKind::ZBH1:
      looped(b, p, /*v=*/1, rank, m, /*zeroBubble=*/true);
      break;
    case ScheduleKind::ZBH2:
      zeroBubbleH2(b, p, rank, m);
      break;
    case ScheduleKind::ZBV:
      zeroBubbleV(b, p, rank, std::max(m, 2 * p - 1));
      out.erase(std::remove_if(out.begin(), out.end(),
                               [&](const Action &a) { return a.microbatch >= m; }),
                out.end());
      break;
    case ScheduleKind::DualPipeV:
      dualPipeV(b, p, rank, m);
      break;
    case ScheduleKind::ForwardOnly:
      forwardOnly(b, rank, m);
      break;
    }
  }
  return schedule;
}

} // namespace pipec
