//===- GPipe.cpp - GPipe and forward-only orders ----------------------------===//
//
// GPipe (ScheduleGPipe): M x F, then M x B.
// Forward-only (_ScheduleForwardOnly): M x F.
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

namespace pipec::schedule {

void generateGPipe(RankBuilder &b, int, int, int m, int rank) {
  for (int i = 0; i < m; ++i)
    b.forward(rank);
  for (int i = 0; i < m; ++i)
    b.fullBackward(rank);
}

void generateForwardOnly(RankBuilder &b, int, int, int m, int rank) {
  for (int i = 0; i < m; ++i)
    b.forward(rank);
}

} // namespace pipec::schedule
