//===- Trace.cpp - The measured timeline of a run ------------------------===//
#include "runtime/exec/Trace.h"
#include "plan/PlanFile.h"

#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <numeric>

using namespace llvm;

namespace pipec::rt {

Error writeTrace(StringRef path, const std::vector<TraceEvent> &events, int ranks) {
  double origin = events.empty() ? 0 : events.front().start;
  for (const TraceEvent &e : events)
    origin = std::min(origin, e.start);
  std::vector<int> all(std::max(0, ranks));
  std::iota(all.begin(), all.end(), 0);
  std::string text;
  raw_string_ostream os(text);
  printChromeTrace(os, all, events, origin);
  return writeFileAtomically(path, os.str());
}

void addEvents(plan::RankResult &message, const std::vector<TraceEvent> &events) {
  for (const TraceEvent &e : events) {
    plan::RankEvent *event = message.add_events();
    event->set_name(e.name);
    event->set_category(std::string(1, e.category));
    event->set_rank(e.rank);
    event->set_start_s(e.start);
    event->set_duration_s(e.duration);
  }
}

void appendEvents(const plan::RankResult &message, std::vector<TraceEvent> &events) {
  for (const plan::RankEvent &e : message.events())
    events.push_back({e.name(), e.category().empty() ? '?' : e.category()[0], e.rank(), e.start_s(),
                      e.duration_s()});
}

} // namespace pipec::rt
