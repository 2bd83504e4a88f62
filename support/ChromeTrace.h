//===- ChromeTrace.h - Timelines as Chrome / Perfetto trace JSON ---------===//
//
// The one trace format of pipec: the simulator's predicted timeline
// (`pipec simulate --trace`) and the runtime's measured one (`pipec run
// --trace`) are both written here, and `pipec report --trace` reads a
// measured one back through parseChromeTrace.
//
// The format: one process (pid 0); rank R has two threads, tid 2R for its
// compute ("rank R") and tid 2R + 1 for its communication ("rank R comm"),
// named by metadata events ("ph": "M"). Each event is a complete event
// ("ph": "X") with its one-letter category as "cat" and "ts" and "dur" in
// microseconds; an event of category 'C' sits on the communication thread.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_CHROMETRACE_H
#define PIPEC_SUPPORT_CHROMETRACE_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

namespace pipec {

/// One span of a rank's timeline.
struct TraceEvent {
  std::string name;
  /// F, B, I, W, R (recompute), C (communication), O (optimizer).
  char category = 'F';
  int rank = 0;
  /// Seconds.
  double start = 0, duration = 0;
};

/// Writes the trace of \p events to \p os: first a name for the two threads
/// of each rank in \p ranks (in that order), then each event in order, its
/// "ts" being (start - \p origin) in microseconds. Ends with a newline.
void printChromeTrace(llvm::raw_ostream &os, llvm::ArrayRef<int> ranks,
                      llvm::ArrayRef<TraceEvent> events, double origin = 0);

/// The complete events of a trace in that format, in file order, with times
/// in seconds; other events are skipped. A missing "cat" reads as 'F'.
/// Fails on text that is not JSON ("not JSON: ...") or has no
/// "traceEvents" ("not a Chrome trace (no traceEvents)").
llvm::Expected<std::vector<TraceEvent>> parseChromeTrace(llvm::StringRef json);

} // namespace pipec

#endif // PIPEC_SUPPORT_CHROMETRACE_H
