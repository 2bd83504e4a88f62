//===- GenerationStreams.h - `pipec generate`'s loop as rank streams ----===//
//
// A generate plan's ranks run the token loop from streams the plan holds
// (plan.proto's GenerationStreams), made here from the plan's inference
// stream: the hidden state a stage sends the next is what its forward of
// microbatch 0 sends there. Per group g, in group order (P ranks):
//
//   rank 0        [RECV picks g <- P-1]  SCHEDULE g  LOAD g  FORWARD g
//                 SEND control g -> 1  SEND hidden g -> 1
//   rank 0<r<P-1  RECV control g  RECV hidden g  LOAD g  FORWARD g
//                 SEND control g  SEND hidden g
//   rank P-1      RECV control g  RECV hidden g  LOAD g  FORWARD g
//                 PICK g  SEND picks g -> 0
//
// The start has no RECV of picks; the round has it; the stop keeps the
// control's SCHEDULE, SEND and RECV and the picks' RECV alone. One rank
// schedules and picks with no transfer. verifyGenerationStreams
// (LowerSchedule.h) proves them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GENERATIONSTREAMS_H
#define PIPEC_PASSES_GENERATIONSTREAMS_H

#include "plan/PlanFile.h"

namespace pipec {

/// Fills each of \p plan's programs' `generation` from its inference
/// stream (one stage per rank).
void addGenerationStreams(plan::Plan &plan);

} // namespace pipec

#endif // PIPEC_PASSES_GENERATIONSTREAMS_H
