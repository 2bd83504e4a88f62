//===- ClosedForms.h - Textbook step times, the simulator's test oracle ---===//
//
// The closed forms of a schedule's step time, one per StepForm (the STEP
// column of compiler/schedule/Schedules.def), from per-chunk F, I, W and
// send times. pipec times a step by one engine, the simulation of the
// lowered programs (passes/PredictStep.h, compiler/sim); these formulas are
// what the tests hold it to where they are exact: equal chunks and free
// links give the published bubbles.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_TESTS_CLOSEDFORMS_H
#define PIPEC_TESTS_CLOSEDFORMS_H

#include "compiler/schedule/ScheduleKind.h"
#include "passes/BalanceStages.h"

#include <algorithm>
#include <vector>

namespace pipec {

/// Step time of \p chunks under \p schedule by its closed form; sets
/// \p bubbleFraction to 1 - busy / (P x step).
inline double predictStepTime(ScheduleKind schedule, int stages, int microbatches,
                              const std::vector<ChunkPlan> &chunks, double &bubbleFraction) {
  // Closed forms with per-chunk times t_k = F + I + W + send, R_r the sum of
  // rank r's chunks, one per StepForm (the STEP column of Schedules.def);
  // for equal chunks they give the textbook bubbles:
  //   GPipe, 1F1B   T = sum_k t_k + (M - 1) max_r R_r      (P-1)/(M+P-1)
  //   interleaved   T = M max_r R_r + (P - 1) max_k t_k     (P-1)/(VM+P-1)
  //   ZB-H1         T = M max_r R_r + (P - 1) max_k (F + I - W)   3M + P - 1
  //   ZB-H2, ZB-V   T = M max_r R_r + (P - 1) max_k (F + I - 2W)^+
  //   DualPipeV     T = M max_r R_r + (P/2 - 1) max_k (F + 2I - W)^+
  //   forward       T = sum_k F_k + (M - 1) max_k F_k
  double p = stages, m = microbatches;
  std::vector<double> rank(stages, 0);
  double sum = 0, maxChunk = 0, maxFIMinusW = 0, maxFIMinus2W = 0, maxDual = 0, sumF = 0, maxF = 0;
  for (const ChunkPlan &c : chunks) {
    double t = c.totalTime();
    rank[c.rank] += t;
    sum += t;
    maxChunk = std::max(maxChunk, t);
    maxFIMinusW = std::max(maxFIMinusW, c.time[0] + c.time[1] - c.time[2]);
    maxFIMinus2W = std::max(maxFIMinus2W, c.time[0] + c.time[1] - 2 * c.time[2]);
    maxDual = std::max(maxDual, c.time[0] + 2 * c.time[1] - c.time[2]);
    sumF += c.time[0] + c.commTime;
    maxF = std::max(maxF, c.time[0] + c.commTime);
  }
  double maxRank = *std::max_element(rank.begin(), rank.end());
  double step = 0;
  StepForm form = traitsOf(schedule).step;
  switch (form) {
  case StepForm::Flush:
    step = sum + (m - 1) * maxRank;
    break;
  case StepForm::Looped:
    step = m * maxRank + (p - 1) * maxChunk;
    break;
  case StepForm::ZeroBubbleH1:
    step = m * maxRank + (p - 1) * std::max(0.0, maxFIMinusW);
    break;
  case StepForm::ZeroBubble:
    step = m * maxRank + (p - 1) * std::max(0.0, maxFIMinus2W);
    break;
  case StepForm::DualPipe:
    step = m * maxRank + std::max(0.0, p / 2 - 1) * std::max(0.0, maxDual);
    break;
  case StepForm::Forward:
    step = sumF + (m - 1) * maxF;
    break;
  }
  double busy = 0;
  for (const ChunkPlan &c : chunks)
    busy += m * (form == StepForm::Forward ? c.time[0] + c.commTime : c.totalTime());
  bubbleFraction = step > 0 ? std::max(0.0, 1 - busy / (p * step)) : 0;
  return step;
}

} // namespace pipec

#endif // PIPEC_TESTS_CLOSEDFORMS_H
