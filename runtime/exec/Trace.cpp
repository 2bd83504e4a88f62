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

} // namespace pipec::rt
