//===- RankBuilder.h - How a generator writes one rank's actions --------===//
//
// Private to compiler/schedule: the generators of generators/ (one per row
// of Schedules.def) emit a rank's actions through a RankBuilder, which
// numbers the microbatches and keeps the I's that still wait for their W.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SCHEDULE_RANKBUILDER_H
#define PIPEC_COMPILER_SCHEDULE_RANKBUILDER_H

#include "compiler/schedule/Schedule.h"

#include <deque>
#include <map>
#include <vector>

namespace pipec::schedule {

/// Appends one rank's actions, numbering microbatches per (chunk, kind) in
/// order, and queues I's for the W's that follow them.
class RankBuilder {
public:
  explicit RankBuilder(std::vector<Action> &out) : out(out) {}

  void forward(int stage) { emit(stage, ActionKind::F); }
  void fullBackward(int stage) { emit(stage, ActionKind::B); }
  /// The full backward of microbatch \p microbatch, for orders that do not
  /// run a chunk's backwards in microbatch order.
  void fullBackwardOf(int stage, int microbatch) {
    out.push_back({stage, ActionKind::B, microbatch});
  }
  void inputBackward(int stage) { pendingWeights.push_back(emit(stage, ActionKind::I)); }
  /// The W of the oldest I without one (of \p stage when given); nothing
  /// when there is none.
  void weightBackward(int stage = -1);
  bool weightPending(int stage) const;
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
  int held(int stage) const;
  /// Drops the actions of microbatches \p m and later: for orders built for
  /// more microbatches than the step has.
  void dropMicrobatchesFrom(int m);

private:
  Action emit(int stage, ActionKind kind);
  int count(int stage, ActionKind kind) const {
    auto it = next.find({stage, kind});
    return it == next.end() ? 0 : it->second;
  }

  std::vector<Action> &out;
  std::map<std::pair<int, ActionKind>, int> next;
  std::deque<Action> pendingWeights;
};

/// The shape a generator is asked for: P ranks, V chunks per rank, M
/// microbatches; it writes rank \p rank's order.
using Generator = void (*)(RankBuilder &b, int p, int v, int m, int rank);

#define PIPEC_SCHEDULE(ID, NAME, TITLE, PLACEMENT, VIRTUAL, DEFAULT_V, BACKWARD, MICROBATCHES,     \
                       AUTO, GENERATE, ...)                                                        \
  void GENERATE(RankBuilder &b, int p, int v, int m, int rank);
#include "compiler/schedule/Schedules.def"

} // namespace pipec::schedule

#endif // PIPEC_COMPILER_SCHEDULE_RANKBUILDER_H
