//===- SearchSchedules.cpp - --schedule auto: the fastest schedule that fits -===//
#include "passes/SearchSchedules.h"

#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {

int Judged::overRank() const {
  for (size_t r = 0; r < stagePlan.ranks.size(); ++r)
    if (stagePlan.ranks[r].memoryLimit > 0 &&
        prediction.peakMemory[r] > stagePlan.ranks[r].memoryLimit)
      return static_cast<int>(r);
  return -1;
}

Expected<ScheduleSearch> searchSchedules(int stages, int microbatches, int dataParallel,
                                         const JudgeShape &judge) {
  std::vector<int> counts;
  if (microbatches > 0)
    counts = {microbatches};
  else
    for (int f : {1, 2, 4, 8})
      counts.push_back(f * stages);
  ScheduleSearch search;
  for (int count : counts)
    for (const ScheduleTraits &row : scheduleTable()) {
      if (!row.autoCandidate)
        continue;
      ScheduleCandidate candidate;
      candidate.name = formatv("{0} V={1} M={2}", row.name, row.defaultVirtualStages, count).str();
      auto shape =
          PipelineShape::make(row.kind, stages, row.defaultVirtualStages, count, 1, dataParallel);
      if (!shape) {
        candidate.error = "not accepted: " + toString(shape.takeError());
        search.tried.push_back(std::move(candidate));
        continue;
      }
      auto judgement = judge(*shape);
      if (!judgement)
        return judgement.takeError();
      candidate.shape = judgement->shape;
      candidate.judged = std::move(judgement->judged);
      candidate.error = std::move(judgement->error);
      search.tried.push_back(std::move(candidate));
      const ScheduleCandidate &tried = search.tried.back();
      if (tried.fits() &&
          (search.best < 0 ||
           tried.judged->prediction.step < search.tried[search.best].judged->prediction.step))
        search.best = static_cast<int>(search.tried.size()) - 1;
    }
  return search;
}

} // namespace pipec
