//===- DualPipeV.cpp - The DualPipeV order ----------------------------------===//
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
#include "compiler/schedule/RankBuilder.h"

namespace pipec::schedule {

void generateDualPipeV(RankBuilder &b, int p, int, int m, int rank) {
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

} // namespace pipec::schedule
