//===- ScheduleTest.cpp - Per-rank compute orders of the schedules ------===//
//
// Four kinds of checks:
//  * completeness and placement over a sweep of (P, V, M): every chunk a rank
//    owns (rankOfChunk) runs each microbatch's F once and then either one B
//    or one I followed by one W, and no rank touches another's chunk;
//  * equality with PyTorch's orders in tests/fixtures/schedules/ (written by
//    tools/make_schedule_fixtures.py from torch.distributed.pipelining; ZB-H2
//    from the zero-bubble paper's construction, checked there) and
//    with small tables checked by hand below;
//  * a unit-time simulation that runs every rank's list in order under the
//    data dependencies, which shows the orders cannot deadlock and that each
//    schedule has the bubble its paper promises;
//  * peak activations held per rank (F until B, or W) against each
//    schedule's published memory and the memory model's count.
//
//===----------------------------------------------------------------------===//
#include "compiler/schedule/Schedule.h"

#include "llvm/ADT/SmallVector.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

using namespace pipec;
using llvm::toString;

namespace {

const ScheduleKind AllKinds[] = {ScheduleKind::GPipe,       ScheduleKind::OneFOneB,
                                 ScheduleKind::Interleaved, ScheduleKind::ZBH1,
                                 ScheduleKind::ZBH2,        ScheduleKind::ZBV,
                                 ScheduleKind::DualPipeV,   ScheduleKind::ForwardOnly};

std::vector<int> virtualStagesOf(ScheduleKind kind) {
  switch (kind) {
  case ScheduleKind::Interleaved:
    return {2, 3};
  case ScheduleKind::ZBV:
  case ScheduleKind::DualPipeV:
    return {2};
  default:
    return {1};
  }
}

std::string formatRank(const std::vector<Action> &actions) {
  std::string text;
  for (const Action &a : actions)
    text += (text.empty() ? "" : " ") + formatAction(a);
  return text;
}

Schedule generate(ScheduleKind kind, int p, int v, int m) {
  auto schedule = generateSchedule(kind, p, v, m);
  if (!schedule) {
    ADD_FAILURE() << toString(schedule.takeError());
    return {};
  }
  return std::move(*schedule);
}

/// The (P, V, M) points of the sweep that the schedule accepts.
struct Point {
  ScheduleKind kind;
  int p, v, m;
  std::string name() const {
    return scheduleName(kind).str() + " P=" + std::to_string(p) + " V=" + std::to_string(v) +
           " M=" + std::to_string(m);
  }
};

std::vector<Point> sweep() {
  std::vector<Point> points;
  for (ScheduleKind kind : AllKinds)
    for (int p : {2, 4, 8})
      for (int v : virtualStagesOf(kind))
        for (int m = p; m <= 4 * p; ++m) {
          if (llvm::Error err = checkScheduleShape(kind, p, v, m)) {
            llvm::consumeError(std::move(err));
            continue;
          }
          points.push_back({kind, p, v, m});
        }
  return points;
}

/// Unit costs: F = I = W = 1, B = I + W = 2.
int cost(ActionKind kind) { return kind == ActionKind::B ? 2 : 1; }

struct Timeline {
  bool deadlocked = false;
  int makespan = 0;
  /// Per rank: start of its first action, end of its last, time computing.
  std::vector<int> first, last, busy;
  int idleWithin(int rank) const { return last[rank] - first[rank] - busy[rank]; }
};

/// Runs every rank's actions in list order, each as soon as its rank is free
/// and its inputs exist: F of chunk s needs F of s - 1 (same microbatch); the
/// input-gradient backward (B or I) of s needs that of s + 1, or s's own F on
/// the last chunk; W needs its I. A rank whose next action can never become
/// ready is a deadlock.
Timeline simulate(const Schedule &schedule) {
  int chunks = schedule.stages * schedule.virtualStages;
  std::map<std::pair<int, int>, int> forwardEnd, gradEnd, inputEnd;
  auto find = [](const std::map<std::pair<int, int>, int> &m, int s, int mb, int &t) {
    auto it = m.find({s, mb});
    if (it == m.end())
      return false;
    t = std::max(t, it->second);
    return true;
  };
  size_t ranks = schedule.ranks.size();
  Timeline tl;
  tl.first.assign(ranks, -1);
  tl.last.assign(ranks, 0);
  tl.busy.assign(ranks, 0);
  std::vector<size_t> next(ranks, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < ranks; ++r) {
      for (; next[r] < schedule.ranks[r].size(); ++next[r]) {
        const Action &a = schedule.ranks[r][next[r]];
        int start = tl.last[r];
        bool ready = true;
        switch (a.kind) {
        case ActionKind::F:
          ready = a.stage == 0 || find(forwardEnd, a.stage - 1, a.microbatch, start);
          break;
        case ActionKind::B:
        case ActionKind::I:
          ready = find(forwardEnd, a.stage, a.microbatch, start) &&
                  (a.stage == chunks - 1 || find(gradEnd, a.stage + 1, a.microbatch, start));
          break;
        case ActionKind::W:
          ready = find(inputEnd, a.stage, a.microbatch, start);
          break;
        }
        if (!ready)
          break;
        int end = start + cost(a.kind);
        if (tl.first[r] < 0)
          tl.first[r] = start;
        tl.last[r] = end;
        tl.busy[r] += cost(a.kind);
        tl.makespan = std::max(tl.makespan, end);
        if (a.kind == ActionKind::F)
          forwardEnd[{a.stage, a.microbatch}] = end;
        if (a.kind == ActionKind::B || a.kind == ActionKind::I)
          gradEnd[{a.stage, a.microbatch}] = end;
        if (a.kind == ActionKind::I)
          inputEnd[{a.stage, a.microbatch}] = end;
        progress = true;
      }
    }
  }
  for (size_t r = 0; r < ranks; ++r)
    tl.deadlocked |= next[r] != schedule.ranks[r].size();
  return tl;
}

/// Most microbatches of one rank whose F has run and whose activations are
/// not yet freed, over the rank's list: a B frees them, and for a split
/// backward the W (the I frees nothing). Chunks of a rank are added up.
int peakInFlight(const std::vector<Action> &actions) {
  int live = 0, peak = 0;
  for (const Action &a : actions) {
    if (a.kind == ActionKind::F)
      peak = std::max(peak, ++live);
    else if (a.kind == ActionKind::B || a.kind == ActionKind::W)
      --live;
  }
  return peak;
}

TEST(Schedule, FormatAndParseActions) {
  Action a{2, ActionKind::I, 5};
  EXPECT_EQ(formatAction(a), "2I5");
  auto parsed = parseAction("2I5");
  ASSERT_TRUE(static_cast<bool>(parsed)) << toString(parsed.takeError());
  EXPECT_EQ(*parsed, a);
  parsed = parseAction("13W120");
  ASSERT_TRUE(static_cast<bool>(parsed)) << toString(parsed.takeError());
  EXPECT_EQ(*parsed, (Action{13, ActionKind::W, 120}));
  for (char letter : {'F', 'B', 'I', 'W'}) {
    auto round = parseAction(std::string("0") + letter + "0");
    ASSERT_TRUE(static_cast<bool>(round)) << toString(round.takeError());
    EXPECT_EQ(actionKindLetter(round->kind), letter);
  }
  for (const char *bad :
       {"", "F0", "2F", "2X5", "2f5", "-1F0", "2F-1", "2F5 ", "2FF5", "a2F5", "99999999999F0"}) {
    auto err = parseAction(bad);
    ASSERT_FALSE(static_cast<bool>(err)) << bad;
    EXPECT_NE(toString(err.takeError()).find("<stage><F|B|I|W><microbatch>"), std::string::npos)
        << bad;
  }
}

// Every (chunk, microbatch) a rank owns: one F; one B, or one I then one W;
// the backward after the F; no chunk of another rank.
TEST(Schedule, EveryChunkAndMicrobatchOnceOnItsRank) {
  for (const Point &pt : sweep()) {
    SCOPED_TRACE(pt.name());
    Schedule s = generate(pt.kind, pt.p, pt.v, pt.m);
    ASSERT_EQ(s.ranks.size(), static_cast<size_t>(pt.p));
    EXPECT_EQ(s.kind, pt.kind);
    EXPECT_EQ(s.stages, pt.p);
    EXPECT_EQ(s.virtualStages, pt.v);
    EXPECT_EQ(s.microbatches, pt.m);
    bool backward = pt.kind != ScheduleKind::ForwardOnly;
    bool mayFull = !splitsBackward(pt.kind) || pt.kind == ScheduleKind::DualPipeV;
    bool maySplit = splitsBackward(pt.kind);
    for (int r = 0; r < pt.p; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      // Position of each action kind per (chunk, microbatch).
      std::map<std::pair<int, int>, std::map<ActionKind, int>> seen;
      const std::vector<Action> &actions = s.ranks[r];
      for (size_t i = 0; i < actions.size(); ++i) {
        const Action &a = actions[i];
        ASSERT_GE(a.stage, 0);
        ASSERT_LT(a.stage, pt.p * pt.v);
        ASSERT_EQ(rankOfChunk(pt.kind, pt.p, pt.v, a.stage), r) << formatAction(a);
        ASSERT_GE(a.microbatch, 0);
        ASSERT_LT(a.microbatch, pt.m);
        auto &kinds = seen[{a.stage, a.microbatch}];
        ASSERT_EQ(kinds.count(a.kind), 0u) << "twice: " << formatAction(a);
        kinds[a.kind] = static_cast<int>(i);
      }
      int owned = 0;
      for (int chunk = 0; chunk < pt.p * pt.v; ++chunk) {
        if (rankOfChunk(pt.kind, pt.p, pt.v, chunk) != r)
          continue;
        ++owned;
        for (int mb = 0; mb < pt.m; ++mb) {
          std::string what = std::to_string(chunk) + "?" + std::to_string(mb);
          auto it = seen.find({chunk, mb});
          ASSERT_NE(it, seen.end()) << "missing " << what;
          const auto &kinds = it->second;
          ASSERT_EQ(kinds.count(ActionKind::F), 1u) << what;
          int f = kinds.at(ActionKind::F);
          bool full = kinds.count(ActionKind::B);
          bool split = kinds.count(ActionKind::I) || kinds.count(ActionKind::W);
          if (!backward) {
            EXPECT_EQ(kinds.size(), 1u) << what;
            continue;
          }
          ASSERT_NE(full, split) << "need one B, or one I and one W: " << what;
          if (full) {
            EXPECT_TRUE(mayFull) << what;
            EXPECT_LT(f, kinds.at(ActionKind::B)) << what;
          } else {
            EXPECT_TRUE(maySplit) << what;
            ASSERT_EQ(kinds.count(ActionKind::I), 1u) << what;
            ASSERT_EQ(kinds.count(ActionKind::W), 1u) << what;
            EXPECT_LT(f, kinds.at(ActionKind::I)) << what;
            EXPECT_LT(kinds.at(ActionKind::I), kinds.at(ActionKind::W)) << what;
          }
        }
      }
      EXPECT_EQ(owned, pt.v);
      EXPECT_EQ(seen.size(), static_cast<size_t>(pt.v * pt.m));
    }
  }
}

// The orders PyTorch runs, as tools/make_schedule_fixtures.py wrote them.
TEST(Schedule, MatchesPyTorchFixtures) {
  std::string dir = std::string(PIPEC_SOURCE_DIR) + "/tests/fixtures/schedules";
  std::vector<std::string> files;
  std::error_code ec;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec; it.increment(ec))
    if (llvm::sys::path::extension(it->path()) == ".txt")
      files.push_back(it->path());
  ASSERT_FALSE(ec) << dir << ": " << ec.message();
  std::sort(files.begin(), files.end());
  ASSERT_GE(files.size(), 20u) << dir;
  std::set<ScheduleKind> covered;
  for (const std::string &file : files) {
    SCOPED_TRACE(file);
    // <schedule>-p<P>-v<V>-m<M>.txt; the schedule name may hold '-'.
    llvm::StringRef stem = llvm::sys::path::stem(file);
    llvm::SmallVector<llvm::StringRef, 6> parts;
    stem.split(parts, '-');
    ASSERT_GE(parts.size(), 4u);
    int p = 0, v = 0, m = 0;
    size_t n = parts.size();
    ASSERT_TRUE(parts[n - 3].consume_front("p") && !parts[n - 3].getAsInteger(10, p));
    ASSERT_TRUE(parts[n - 2].consume_front("v") && !parts[n - 2].getAsInteger(10, v));
    ASSERT_TRUE(parts[n - 1].consume_front("m") && !parts[n - 1].getAsInteger(10, m));
    std::string name = llvm::join(llvm::makeArrayRef(parts).drop_back(3), "-");
    auto kind = parseSchedule(name);
    ASSERT_TRUE(static_cast<bool>(kind)) << toString(kind.takeError());
    covered.insert(*kind);
    Schedule s = generate(*kind, p, v, m);
    std::ifstream in(file);
    std::string line;
    int rank = 0;
    while (std::getline(in, line)) {
      ASSERT_LT(rank, p) << "more lines than ranks";
      EXPECT_EQ(formatRank(s.ranks[rank]), line) << "rank " << rank;
      ++rank;
    }
    EXPECT_EQ(rank, p);
  }
  // Every schedule; ZB-H2's fixtures are the paper's construction (see the
  // script), the others PyTorch's.
  for (ScheduleKind kind : AllKinds)
    EXPECT_TRUE(covered.count(kind)) << scheduleName(kind).str();
}

// Small tables worked out by hand from each schedule's phases (see
// Schedule.cpp), one string per rank.
TEST(Schedule, HandCheckedTables) {
  struct Table {
    ScheduleKind kind;
    int p, v, m;
    std::vector<std::string> ranks;
  };
  const Table tables[] = {
      {ScheduleKind::GPipe, 2, 1, 2, {"0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"}},
      {ScheduleKind::ForwardOnly, 2, 1, 3, {"0F0 0F1 0F2", "1F0 1F1 1F2"}},
      // 1F1B: warm-up min(M, P - r), then B F pairs, then the B's left.
      {ScheduleKind::OneFOneB, 2, 1, 3, {"0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"}},
      // Interleaved, P = 2, V = 2, M = 4: two rounds of n = 2; warm-up
      // n + 2(P - 1 - r) = 4 and 2; chunks switch every 2 ops, forwards
      // counted from op 0, backwards from the end of warm-up.
      {ScheduleKind::Interleaved,
       2,
       2,
       4,
       {"0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"}},
      // ZB-H1, P = 2, M = 4: warm-up P - 1 - r; rank 1 holds back its first W.
      {ScheduleKind::ZBH1,
       2,
       1,
       4,
       {"0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"}},
      // ZB-H2, P = 2, M = 3: warm-up 2(P - r) - 1 = 3 and 1; W's at the tail.
      {ScheduleKind::ZBH2,
       2,
       1,
       3,
       {"0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2", "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2"}},
      // ZB-V, P = 2, M = 4 (chunks 0, 3 on rank 0; 1, 2 on rank 1):
      // warm-up 3 x F0 | F1 I1 W1 x 2; steady once with F0, once without;
      // cool-down (I0 W0) x 2.
      {ScheduleKind::ZBV,
       2,
       2,
       4,
       {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3"}},
      // DualPipeV, P = 2, M = 4, rank 0 (chunks 0, 3): nF0 x 2, nF0F1 x 1,
      // nB1W1F1 x 1, main x 1, nB1F1B0 x 1, nB1B0 x 1 (I from the midpoint),
      // nWB0 x 1, nW. Rank 1 (chunks 1, 2): nF0F1 x 2, main x 2, nB1B0 x 2.
      {ScheduleKind::DualPipeV,
       2,
       2,
       4,
       {"0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"}},
  };
  for (const Table &t : tables) {
    SCOPED_TRACE(scheduleName(t.kind).str() + " P=" + std::to_string(t.p) +
                 " M=" + std::to_string(t.m));
    Schedule s = generate(t.kind, t.p, t.v, t.m);
    ASSERT_EQ(s.ranks.size(), t.ranks.size());
    for (size_t r = 0; r < t.ranks.size(); ++r)
      EXPECT_EQ(formatRank(s.ranks[r]), t.ranks[r]) << "rank " << r;
  }
}

// Every row of Schedules.def is whole: its name parses back to it, its
// default V is one it takes, and its generator runs every microbatch's
// forward on every chunk and the backward the row declares.
TEST(Schedule, EveryRowIsConsistent) {
  for (const ScheduleTraits &row : scheduleTable()) {
    SCOPED_TRACE(row.name.str());
    auto parsed = parseSchedule(row.name);
    ASSERT_TRUE(static_cast<bool>(parsed)) << toString(parsed.takeError());
    EXPECT_EQ(*parsed, row.kind);
    EXPECT_EQ(&traitsOf(row.kind), &row);
    const int p = 4, m = 8, v = row.defaultVirtualStages;
    auto s = generateSchedule(row.kind, p, v, m);
    ASSERT_TRUE(static_cast<bool>(s)) << toString(s.takeError());
    std::map<std::pair<int, char>, int> counts; // (stage, letter) -> actions
    for (int r = 0; r < p; ++r)
      for (const Action &a : s->ranks[r]) {
        EXPECT_EQ(rankOfChunk(row.kind, p, v, a.stage), r) << formatAction(a);
        ++counts[{a.stage, actionKindLetter(a.kind)}];
      }
    auto count = [&](int stage, char letter) { return counts[{stage, letter}]; };
    for (int stage = 0; stage < p * v; ++stage) {
      EXPECT_EQ(count(stage, 'F'), m) << "stage " << stage;
      int full = count(stage, 'B'), inputs = count(stage, 'I'), weights = count(stage, 'W');
      EXPECT_EQ(inputs, weights) << "stage " << stage;
      switch (row.backward) {
      case BackwardKind::None:
        EXPECT_EQ(full + inputs, 0) << "stage " << stage;
        break;
      case BackwardKind::Full:
        EXPECT_EQ(full, m) << "stage " << stage;
        EXPECT_EQ(inputs, 0) << "stage " << stage;
        break;
      case BackwardKind::Split:
        // DualPipeV splits only part of its backwards.
        EXPECT_EQ(full + inputs, m) << "stage " << stage;
        EXPECT_GT(inputs, 0) << "stage " << stage;
        break;
      }
    }
  }
  // The help lists the rows that train, then auto.
  EXPECT_EQ(scheduleNamesForHelp(),
            "gpipe|1f1b|interleaved|zb-h1|zb-h2|zbv|dualpipev|looped-bfs|auto");
}

// Shapes PyTorch (or DualPipe) refuses, refused with the reason.
TEST(Schedule, RejectsWhatPyTorchRejects) {
  struct Bad {
    ScheduleKind kind;
    int p, v, m;
    const char *why;
  };
  const Bad bad[] = {
      {ScheduleKind::DualPipeV, 4, 2, 7, "M >= 2P"},
      {ScheduleKind::DualPipeV, 2, 2, 3, "M >= 2P"},
      {ScheduleKind::DualPipeV, 4, 3, 8, "--virtual-stages 2"},
      {ScheduleKind::ZBV, 4, 1, 8, "--virtual-stages 2"},
      {ScheduleKind::ZBV, 4, 3, 8, "--virtual-stages 2"},
      {ScheduleKind::OneFOneB, 4, 2, 8, "--virtual-stages 1"},
      {ScheduleKind::OneFOneB, 4, 1, 3, "at least as many microbatches as stages"},
      {ScheduleKind::GPipe, 2, 2, 4, "--virtual-stages 1"},
      {ScheduleKind::ZBH1, 2, 2, 4, "--virtual-stages 1"},
      {ScheduleKind::ZBH2, 2, 2, 4, "--virtual-stages 1"},
      {ScheduleKind::Interleaved, 4, 1, 8, "--virtual-stages 2 or more"},
      // Two rounds (M / P = 2) of 4.5 microbatches.
      {ScheduleKind::Interleaved, 4, 2, 9, "2 equal rounds"},
      {ScheduleKind::GPipe, 0, 1, 4, "--stages"},
      {ScheduleKind::GPipe, 2, 1, 0, "--microbatches"},
  };
  for (const Bad &b : bad) {
    auto s = generateSchedule(b.kind, b.p, b.v, b.m);
    ASSERT_FALSE(static_cast<bool>(s)) << scheduleName(b.kind).str() << " M=" << b.m;
    std::string message = toString(s.takeError());
    EXPECT_NE(message.find(b.why), std::string::npos) << message;
  }
  // What PyTorch takes although it may look odd: interleaved with M not a
  // multiple of P (rounds of M / max(1, M / P)), ZB-V with M < P.
  for (Point pt :
       {Point{ScheduleKind::Interleaved, 4, 2, 10}, Point{ScheduleKind::Interleaved, 4, 2, 6},
        Point{ScheduleKind::Interleaved, 4, 2, 3}, Point{ScheduleKind::ZBV, 4, 2, 2},
        Point{ScheduleKind::ZBH1, 4, 1, 9}}) {
    auto s = generateSchedule(pt.kind, pt.p, pt.v, pt.m);
    EXPECT_TRUE(static_cast<bool>(s)) << pt.name() << ": " << toString(s.takeError());
    if (s) {
      EXPECT_FALSE(simulate(*s).deadlocked) << pt.name();
    }
  }
}

// With unit costs (F = I = W = 1, B = 2), one microbatch costs 3 per chunk.
// What is checked and why:
//  * no schedule deadlocks: every rank's list can be run in order;
//  * GPipe and 1F1B take 3(M + P - 1): P - 1 fill and drain steps of 3, the
//    bubble fraction (P - 1) / (M + P - 1) of Narayanan et al.;
//  * interleaved takes 3(V M + P - 1) in per-chunk units, so its bubble is
//    (P - 1) / (V M + P - 1): V times smaller, as Megatron's paper and
//    PyTorch's schedule promise;
//  * ZB-H1 takes 3M + P - 1: a third of 1F1B's bubble (Qi et al., 2023);
//  * ZB-H2 runs every rank without a gap from its first action to its last
//    (r to r + 3M) once M >= 2P - 1: the paper's zero bubble, which turns the
//    1F1B trapezoid into a parallelogram; the makespan is still 3M + P - 1
//    because the last rank cannot start before P - 1;
//  * ZB-V runs every rank without a gap once M >= 2P, in 6M + P - 1;
//  * forward-only takes M + P - 1.
// DualPipeV's gain is running a forward and a backward at once, which this
// model serialises; for it only deadlock-freedom is checked.
TEST(Schedule, UnitTimeSimulation) {
  for (const Point &pt : sweep()) {
    SCOPED_TRACE(pt.name());
    Schedule s = generate(pt.kind, pt.p, pt.v, pt.m);
    Timeline tl = simulate(s);
    ASSERT_FALSE(tl.deadlocked);
    int p = pt.p, v = pt.v, m = pt.m;
    switch (pt.kind) {
    case ScheduleKind::GPipe:
    case ScheduleKind::OneFOneB:
      EXPECT_EQ(tl.makespan, 3 * (m + p - 1));
      break;
    case ScheduleKind::Interleaved:
      EXPECT_EQ(tl.makespan, 3 * (v * m + p - 1));
      break;
    case ScheduleKind::ZBH1:
      EXPECT_EQ(tl.makespan, 3 * m + p - 1);
      break;
    case ScheduleKind::ZBH2:
      EXPECT_EQ(tl.makespan, 3 * m + p - 1);
      if (m >= 2 * p - 1)
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(tl.first[r], r) << "rank " << r;
          EXPECT_EQ(tl.idleWithin(r), 0) << "rank " << r;
        }
      break;
    case ScheduleKind::ZBV:
      if (m >= 2 * p) {
        EXPECT_EQ(tl.makespan, 6 * m + p - 1);
        for (int r = 0; r < p; ++r)
          EXPECT_EQ(tl.idleWithin(r), 0) << "rank " << r;
      }
      break;
    case ScheduleKind::DualPipeV:
      break;
    case ScheduleKind::ForwardOnly:
      EXPECT_EQ(tl.makespan, m + p - 1);
      break;
    }
  }
}

// Peaks per rank against the published memory of each schedule, counted
// from F to the pass that frees (B, or W): GPipe M; 1F1B min(M, P - r)
// (Narayanan et al.); ZB-H1 at most 1F1B's P (Qi et al., table 2); ZB-H2
// min(M, 2P - 1) on every rank (Qi et al., section 2.2); interleaved
// PyTorch's warm-up plus one; ZB-V at most 2P chunks of half a stage, 1F1B's
// bytes (Qi et al., 2024); DualPipeV within 2P + 1. inFlightActivations,
// the memory model's count, is never below the peak.
TEST(Schedule, PeakActivationsAsPublished) {
  for (const Point &pt : sweep()) {
    SCOPED_TRACE(pt.name());
    if (pt.kind == ScheduleKind::ForwardOnly)
      continue; // Inference frees each activation after its forward.
    Schedule s = generate(pt.kind, pt.p, pt.v, pt.m);
    int64_t p = pt.p, v = pt.v, m = pt.m;
    for (int r = 0; r < pt.p; ++r) {
      int64_t peak = peakInFlight(s.ranks[r]);
      EXPECT_LE(peak, inFlightActivations(pt.kind, pt.p, pt.v, pt.m, r)) << "rank " << r;
      switch (pt.kind) {
      case ScheduleKind::GPipe:
        EXPECT_EQ(peak, m) << "rank " << r;
        break;
      case ScheduleKind::OneFOneB:
        EXPECT_EQ(peak, std::min(m, p - r)) << "rank " << r;
        break;
      case ScheduleKind::ZBH1:
        EXPECT_LE(peak, p) << "rank " << r;
        break;
      case ScheduleKind::ZBH2:
        EXPECT_EQ(peak, std::min(m, 2 * p - 1)) << "rank " << r;
        break;
      case ScheduleKind::Interleaved: {
        int64_t perRound = m / std::max<int64_t>(1, m / p);
        EXPECT_EQ(peak, std::min(v * m, (v - 1) * perRound + 2 * (p - 1 - r) + 1)) << "rank " << r;
        break;
      }
      case ScheduleKind::ZBV:
        EXPECT_LE(peak, 2 * p) << "rank " << r;
        break;
      case ScheduleKind::DualPipeV:
        EXPECT_LE(peak, 2 * p + 1) << "rank " << r;
        break;
      case ScheduleKind::ForwardOnly:
        break;
      }
    }
  }
}

} // namespace
