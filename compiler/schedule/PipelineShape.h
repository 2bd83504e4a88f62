//===- PipelineShape.h - The checked shape of a pipeline configuration ---===//
//
// One configuration's shape: its schedule, P ranks, V chunks per rank, M
// microbatches per step, the samples in each microbatch, dp replicas, and
// the global batch they make. It is built and checked once (make: the
// schedule's row in Schedules.def decides which (P, V, M) it accepts), then
// passed whole: balance-stages, lower-schedule and the plan read it through
// accessors and check or derive none of it again.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SCHEDULE_PIPELINESHAPE_H
#define PIPEC_COMPILER_SCHEDULE_PIPELINESHAPE_H

#include "compiler/schedule/ScheduleKind.h"

#include <cstdint>

namespace pipec {

class PipelineShape {
public:
  /// 1F1B on one rank, one microbatch of one sample: the smallest shape.
  PipelineShape() = default;

  /// The shape, or why \p schedule does not take it (checkScheduleShape's
  /// words), or a microbatch size or dp below 1.
  static llvm::Expected<PipelineShape> make(ScheduleKind schedule, int stages, int virtualStages,
                                            int microbatches, int64_t microbatchSize = 1,
                                            int dataParallel = 1);

  /// The same shape with \p samples in each microbatch (at least 1): known
  /// once the model is imported, after the schedule was checked.
  PipelineShape withMicrobatchSize(int64_t samples) const;

  ScheduleKind schedule() const { return kind; }
  int stages() const { return P; }        ///< P: ranks of one pipeline
  int virtualStages() const { return V; } ///< V: chunks per rank
  int microbatches() const { return M; }  ///< M: per step
  int64_t microbatchSize() const { return samples; }
  int dataParallel() const { return replicas; }
  /// P x V: the pipeline's stages (global chunks).
  int chunks() const { return P * V; }
  /// The samples of one step over every replica: M x microbatch size x dp.
  int64_t globalBatch() const { return M * samples * replicas; }
  /// The rank that runs global chunk \p chunk (rankOfChunk).
  int rankOfChunk(int chunk) const { return pipec::rankOfChunk(kind, P, V, chunk); }

private:
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int P = 1, V = 1, M = 1;
  int64_t samples = 1;
  int replicas = 1;
};

} // namespace pipec

#endif // PIPEC_COMPILER_SCHEDULE_PIPELINESHAPE_H
