//===- ScheduleKind.cpp - Pipeline schedules and their placements ---------===//
#include "compiler/schedule/ScheduleKind.h"

#include "llvm/ADT/Twine.h"

#include <algorithm>

using namespace llvm;

namespace pipec {

namespace {

constexpr ScheduleTraits table[] = {
#define PIPEC_SCHEDULE(ID, NAME, TITLE, PLACEMENT, VIRTUAL, DEFAULT_V, BACKWARD, MICROBATCHES,     \
                       AUTO, GENERATE, STEP, ACCEPTS, USE)                                         \
  {ScheduleKind::ID,                                                                               \
   NAME,                                                                                           \
   TITLE,                                                                                          \
   Placement::PLACEMENT,                                                                           \
   VirtualRule::VIRTUAL,                                                                           \
   DEFAULT_V,                                                                                      \
   BackwardKind::BACKWARD,                                                                         \
   MicrobatchRule::MICROBATCHES,                                                                   \
   AUTO,                                                                                           \
   StepForm::STEP,                                                                                 \
   ACCEPTS,                                                                                        \
   USE},
#include "compiler/schedule/Schedules.def"
};

// The table is indexed by the enum: its rows are the enum's values in order.
constexpr bool rowsInEnumOrder() {
  for (size_t i = 0; i < std::size(table); ++i)
    if (static_cast<size_t>(table[i].kind) != i)
      return false;
  return true;
}
static_assert(rowsInEnumOrder(), "Schedules.def: one row per ScheduleKind, in order");

} // namespace

ArrayRef<ScheduleTraits> scheduleTable() { return table; }

const ScheduleTraits &traitsOf(ScheduleKind kind) { return table[static_cast<size_t>(kind)]; }

Expected<ScheduleKind> parseSchedule(StringRef name) {
  std::string lower = name.lower();
  for (const ScheduleTraits &row : table)
    if (row.name == lower)
      return row.kind;
  std::string names;
  for (size_t i = 0; i < std::size(table); ++i)
    names += (i == 0 ? "" : i + 1 == std::size(table) ? " or " : ", ") + table[i].name.str();
  return createStringError(inconvertibleErrorCode(), "--schedule %s: expected %s",
                           name.str().c_str(), names.c_str());
}

StringRef scheduleName(ScheduleKind kind) { return traitsOf(kind).name; }

std::string scheduleNamesForHelp() {
  std::string names;
  for (const ScheduleTraits &row : table)
    if (row.backward != BackwardKind::None)
      names += row.name.str() + "|";
  return names + "auto";
}

bool isVShaped(ScheduleKind kind) { return traitsOf(kind).placement == Placement::VShape; }

bool splitsBackward(ScheduleKind kind) { return traitsOf(kind).backward == BackwardKind::Split; }

int rankOfChunk(ScheduleKind kind, int stages, int virtualStages, int chunk) {
  (void)virtualStages;
  if (isVShaped(kind)) {
    int round = chunk / stages, offset = chunk % stages;
    return round % 2 == 0 ? offset : stages - 1 - offset;
  }
  return chunk % stages;
}

Error checkScheduleShape(ScheduleKind kind, int stages, int virtualStages, int microbatches) {
  const ScheduleTraits &row = traitsOf(kind);
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(),
                             "%s with %d stages, %d virtual stages and "
                             "%d microbatches: %s",
                             row.name.str().c_str(), stages, virtualStages, microbatches,
                             why.str().c_str());
  };
  if (stages < 1)
    return fail("--stages must be at least 1");
  if (microbatches < 1)
    return fail("--microbatches must be at least 1");
  switch (row.virtualRule) {
  case VirtualRule::One:
    if (virtualStages != 1)
      return fail("this schedule runs one chunk per rank; use --virtual-stages 1 (or "
                  "--schedule interleaved)");
    break;
  case VirtualRule::TwoOrMore:
    if (virtualStages < 2)
      return fail(row.title + " needs --virtual-stages 2 or more");
    break;
  case VirtualRule::Two:
    if (virtualStages != 2)
      return fail(row.title + " places exactly two chunks per rank in a V; use --virtual-stages 2");
    break;
  }
  switch (row.microbatches) {
  case MicrobatchRule::Any:
    // ZB-H1 takes any M: PyTorch's ScheduleInterleavedZeroBubble applies the
    // rounds rule below even to one stage per rank, where rounds change
    // nothing in the order. PyTorch's ScheduleZBVZeroBubble builds the order
    // for max(M, 2P - 1) microbatches and drops the extra ones.
    break;
  case MicrobatchRule::AtLeastStages:
    // PyTorch's Schedule1F1B refuses fewer microbatches than stages.
    if (microbatches < stages)
      return fail(row.title + " needs at least as many microbatches as stages");
    break;
  case MicrobatchRule::EqualRounds: {
    // PyTorch's ScheduleInterleaved1F1B runs microbatches in R = max(1, M / P)
    // rounds of equal size, so M need not be a multiple of P (M = 10 with
    // P = 4 runs two rounds of 5), but R must divide M.
    int rounds = std::max(1, microbatches / stages);
    if (microbatches % rounds != 0)
      return fail("the microbatches must split into max(1, M / P) = " + Twine(rounds) +
                  " equal rounds");
    break;
  }
  case MicrobatchRule::AtLeastTwiceStages:
    // DeepSeek's DualPipeV needs two microbatches per arm of the V.
    if (microbatches < 2 * stages)
      return fail(row.title + " needs at least twice as many microbatches as stages (M >= 2P)");
    break;
  }
  return Error::success();
}

std::string scheduleTableMarkdown() {
  static constexpr StringLiteral virtualText[] = {"1", ">= 2", "2"};
  std::string out = "| schedule | V | accepts | when to use it |\n|---|---|---|---|\n";
  for (const ScheduleTraits &row : table)
    out += "| `" + row.name.str() + "` | " + virtualText[static_cast<int>(row.virtualRule)].str() +
           " | " + row.accepts.str() + " | " + row.use.str() + " |\n";
  return out + "| `auto` | | | simulates the rows marked for it (all but `forward`) for M in {P, "
               "2P, 4P, 8P} (or the given M), each at its V, and keeps the fastest that fits the "
               "memory limit; the report lists what was tried |\n";
}

} // namespace pipec
