//===- Trace.cpp - The measured timeline of a run ------------------------===//
#include "runtime/exec/Trace.h"
#include "runtime/plan/PlanFile.h"

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

std::string serializeEvents(const std::vector<TraceEvent> &events) {
  std::string out;
  for (const TraceEvent &e : events)
    out += formatv("{0}\t{1}\t{2}\t{3:e}\t{4:e}\n", e.rank, e.category, e.name, e.start, e.duration)
               .str();
  return out;
}

void parseEvents(StringRef text, std::vector<TraceEvent> &events) {
  SmallVector<StringRef, 0> lines;
  text.split(lines, '\n', -1, false);
  for (StringRef line : lines) {
    SmallVector<StringRef, 5> f;
    line.split(f, '\t');
    if (f.size() != 5)
      continue;
    TraceEvent e;
    f[0].getAsInteger(10, e.rank);
    e.category = f[1].empty() ? '?' : f[1][0];
    e.name = f[2].str();
    f[3].getAsDouble(e.start);
    f[4].getAsDouble(e.duration);
    events.push_back(e);
  }
}

} // namespace pipec::rt
