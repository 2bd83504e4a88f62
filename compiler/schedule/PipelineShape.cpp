//===- PipelineShape.cpp - The checked shape of a pipeline configuration -===//
#include "compiler/schedule/PipelineShape.h"

#include <algorithm>

using namespace llvm;

namespace pipec {

Expected<PipelineShape> PipelineShape::make(ScheduleKind schedule, int stages, int virtualStages,
                                            int microbatches, int64_t microbatchSize,
                                            int dataParallel) {
  if (Error err = checkScheduleShape(schedule, stages, virtualStages, microbatches))
    return std::move(err);
  if (microbatchSize < 1 || dataParallel < 1)
    return createStringError(inconvertibleErrorCode(),
                             "a pipeline needs at least one sample per microbatch and one "
                             "replica (%lld and %d given)",
                             static_cast<long long>(microbatchSize), dataParallel);
  PipelineShape shape;
  shape.kind = schedule;
  shape.P = stages;
  shape.V = virtualStages;
  shape.M = microbatches;
  shape.samples = microbatchSize;
  shape.replicas = dataParallel;
  return shape;
}

PipelineShape PipelineShape::withMicrobatchSize(int64_t size) const {
  PipelineShape shape = *this;
  shape.samples = std::max<int64_t>(1, size);
  return shape;
}

} // namespace pipec
