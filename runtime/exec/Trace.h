//===- Trace.h - The measured timeline of a run --------------------------===//
//
// Each rank records its compute instructions and its waits for messages as
// TraceEvents (support/ChromeTrace.h), in seconds since the epoch. MPI ranks
// send theirs to rank 0 as text; the reporting process writes them all as
// one Chrome trace, in the simulator's format.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_TRACE_H
#define PIPEC_RUNTIME_EXEC_TRACE_H

#include "plan/plan.pb.h"
#include "support/ChromeTrace.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace pipec::rt {

/// Writes \p events of a run of \p ranks global ranks to \p path
/// (atomically), times from the earliest event on.
llvm::Error writeTrace(llvm::StringRef path, const std::vector<TraceEvent> &events, int ranks);

/// \p events into \p message's events (the result a rank sends rank 0).
void addEvents(plan::RankResult &message, const std::vector<TraceEvent> &events);
/// The events of \p message, appended to \p events.
void appendEvents(const plan::RankResult &message, std::vector<TraceEvent> &events);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_TRACE_H
