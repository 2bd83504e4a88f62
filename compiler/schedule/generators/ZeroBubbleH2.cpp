//===- ZeroBubbleH2.cpp - The ZB-H2 order -----------------------------------===//
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
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

#include <algorithm>

namespace pipec::schedule {

void generateZeroBubbleH2(RankBuilder &b, int p, int, int m, int rank) {
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

} // namespace pipec::schedule
