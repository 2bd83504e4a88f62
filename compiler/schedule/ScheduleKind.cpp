//===- ScheduleKind.cpp - Pipeline schedules and their placements ---------===//
#include "compiler/schedule/ScheduleKind.h"
#include "support/EnumNames.h"

#include <algorithm>
#include <optional>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<ScheduleKind> scheduleNames[] = {{ScheduleKind::GPipe, "gpipe"},
                                                    {ScheduleKind::OneFOneB, "1f1b"},
                                                    {ScheduleKind::Interleaved, "interleaved"},
                                                    {ScheduleKind::ZBH1, "zb-h1"},
                                                    {ScheduleKind::ZBH2, "zb-h2"},
                                                    {ScheduleKind::ZBV, "zbv"},
                                                    {ScheduleKind::DualPipeV, "dualpipev"},
                                                    {ScheduleKind::ForwardOnly, "forward"}};

} // namespace

Expected<ScheduleKind> parseSchedule(StringRef name) {
  if (std::optional<ScheduleKind> kind = valueOf(scheduleNames, name.lower()))
    return *kind;
  return createStringError(inconvertibleErrorCode(), "--schedule %s: expected %s",
                           name.str().c_str(), nameList(scheduleNames).c_str());
}

StringRef scheduleName(ScheduleKind kind) { return nameOf(scheduleNames, kind, "1f1b"); }

bool isVShaped(ScheduleKind kind) {
  return kind == ScheduleKind::ZBV || kind == ScheduleKind::DualPipeV;
}

bool splitsBackward(ScheduleKind kind) {
  return kind == ScheduleKind::ZBH1 || kind == ScheduleKind::ZBH2 || kind == ScheduleKind::ZBV ||
         kind == ScheduleKind::DualPipeV;
}

int rankOfChunk(ScheduleKind kind, int stages, int virtualStages, int chunk) {
  (void)virtualStages;
  if (isVShaped(kind)) {
    int round = chunk / stages, offset = chunk % stages;
    return round % 2 == 0 ? offset : stages - 1 - offset;
  }
  return chunk % stages;
}

Error checkScheduleShape(ScheduleKind kind, int stages, int virtualStages, int microbatches) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(),
                             "%s with %d stages, %d virtual stages and "
                             "%d microbatches: %s",
                             scheduleName(kind).str().c_str(), stages, virtualStages, microbatches,
                             why.str().c_str());
  };
  if (stages < 1)
    return fail("--stages must be at least 1");
  if (microbatches < 1)
    return fail("--microbatches must be at least 1");
  switch (kind) {
  case ScheduleKind::GPipe:
  case ScheduleKind::OneFOneB:
  case ScheduleKind::ZBH1:
  case ScheduleKind::ZBH2:
  case ScheduleKind::ForwardOnly:
    if (virtualStages != 1)
      return fail("this schedule runs one chunk per rank; use --virtual-stages 1 (or "
                  "--schedule interleaved)");
    // PyTorch's Schedule1F1B refuses fewer microbatches than stages. ZB-H1
    // takes any M: PyTorch's ScheduleInterleavedZeroBubble applies the
    // interleaved rounds rule below even to one stage per rank, where rounds
    // change nothing in the order.
    if (kind == ScheduleKind::OneFOneB && microbatches < stages)
      return fail("1F1B needs at least as many microbatches as stages");
    return Error::success();
  case ScheduleKind::Interleaved: {
    if (virtualStages < 2)
      return fail("interleaved 1F1B needs --virtual-stages 2 or more");
    // PyTorch's ScheduleInterleaved1F1B runs microbatches in R = max(1, M / P)
    // rounds of equal size, so M need not be a multiple of P (M = 10 with
    // P = 4 runs two rounds of 5), but R must divide M.
    int rounds = std::max(1, microbatches / stages);
    if (microbatches % rounds != 0)
      return fail("the microbatches must split into max(1, M / P) = " + Twine(rounds) +
                  " equal rounds");
    return Error::success();
  }
  case ScheduleKind::ZBV:
    // PyTorch's ScheduleZBVZeroBubble takes any M: it builds the order for
    // max(M, 2P - 1) microbatches and drops the extra ones.
    if (virtualStages != 2)
      return fail("ZB-V places exactly two chunks per rank in a V; use --virtual-stages 2");
    return Error::success();
  case ScheduleKind::DualPipeV:
    if (virtualStages != 2)
      return fail("DualPipeV places exactly two chunks per rank in a V; use --virtual-stages 2");
    if (microbatches < 2 * stages)
      return fail("DualPipeV needs at least twice as many microbatches as stages (M >= 2P)");
    return Error::success();
  }
  return Error::success();
}

} // namespace pipec
