//===- LoopedBFS.cpp - The looped breadth-first order -------------------===//
//
// Looped BFS (ScheduleLoopedBFS, after Lamy-Poirier, "Breadth-First Pipeline
// Parallelism", 2022, arXiv:2211.05953; looped placement, V >= 2). Rank r
// runs its chunks c P + r in increasing order, each with all M forwards,
// then the chunks in decreasing order, each with all M full backwards from
// the last microbatch to the first:
//   forwards    for c = 0 .. V - 1:      M x F(c P + r), microbatch 0 .. M - 1
//   backwards   for c = V - 1 .. 0:      M x B(c P + r), microbatch M - 1 .. 0
// PyTorch pads the order with idle slots (r before the forwards, 2(P - 1 - r)
// before the backwards); they move no action, so the order is the one above.
// Every rank holds V M microbatches at the turn, as GPipe holds M.
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/RankBuilder.h"

namespace pipec::schedule {

void generateLoopedBFS(RankBuilder &b, int p, int v, int m, int rank) {
  for (int c = 0; c < v; ++c)
    for (int i = 0; i < m; ++i)
      b.forward(c * p + rank);
  for (int c = v - 1; c >= 0; --c)
    for (int i = m - 1; i >= 0; --i)
      b.fullBackwardOf(c * p + rank, i);
}

} // namespace pipec::schedule
