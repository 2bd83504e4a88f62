//===- Looped.cpp - Interleaved 1F1B and ZB-H1 orders -----------------------===//
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
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

#include <algorithm>

namespace pipec::schedule {

namespace {

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

} // namespace

void generateInterleaved(RankBuilder &b, int p, int v, int m, int rank) {
  looped(b, p, v, rank, m, /*zeroBubble=*/false);
}

void generateZeroBubbleH1(RankBuilder &b, int p, int, int m, int rank) {
  looped(b, p, /*v=*/1, rank, m, /*zeroBubble=*/true);
}

} // namespace pipec::schedule
