//===- OneFOneB.cpp - The 1F1B order ----------------------------------------===//
//
// 1F1B (Schedule1F1B._step_microbatches; PyTorch needs M >= P):
//   warm-up   w = min(M, P - r) x F
//   steady    M - w x (B F)
//   cool-down w x B
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

namespace pipec::schedule {

void generateOneFOneB(RankBuilder &b, int p, int, int m, int rank) {
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

} // namespace pipec::schedule
