//===- ZeroBubbleV.cpp - The ZB-V order -------------------------------------===//
//
// ZB-V (ScheduleZBVZeroBubble; V = 2; chunks c0 = r, c1 = 2P - 1 - r). PyTorch
// builds it for N = max(M, 2P - 1) microbatches and drops those >= M:
//   warm-up   2(P - r) - 1 x F0;  r x (F1 F0);  P - r x (F1 I1 W1)
//   steady    N - 2P + r + 1 x (F0 I0 W0 F1 I1 W1);  P - r - 1 x (I0 W0 F1 I1 W1)
//   cool-down r x (I0 I1);  P - r x (I0 W0);  the W1's left;  the W0's left
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

#include <algorithm>

namespace pipec::schedule {

namespace {

/// ZB-V for n >= 2P - 1 microbatches.
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

} // namespace

void generateZeroBubbleV(RankBuilder &b, int p, int, int m, int rank) {
  zeroBubbleV(b, p, rank, std::max(m, 2 * p - 1));
  b.dropMicrobatchesFrom(m);
}

} // namespace pipec::schedule
