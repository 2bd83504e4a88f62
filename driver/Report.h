//===- Report.h - `pipec report`: the partition report of a plan --------===//
//
// Per stage: rank, layers (names and range), params, forward FLOPs,
// predicted F / I / W time, the boundary bytes it sends and the rank's peak
// memory against its limit; then the imbalance, the layout string, and the
// predicted step time of the time, params and uniform methods side by side.
// Reads only the plan. The JSON field names are a stable interface (DESIGN:
// report), fields may be added.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_REPORT_H
#define PIPEC_DRIVER_REPORT_H

#include "plan/plan.pb.h"

#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

namespace pipec {

inline constexpr int ReportFormatVersion = 1;

void printReportText(const plan::Plan &plan, llvm::raw_ostream &os);
void printReportJson(const plan::Plan &plan, llvm::raw_ostream &os);

/// Why the first and last stages hold fewer blocks, in the plan's numbers:
/// a block's time, each edge stage's blocks and its embedding, head and loss
/// layers (time, blocks' worth, parameters), and the edge ranks' memory
/// (weights with optimizer state, activations held). Empty for one stage.
std::vector<std::string> explainEdgeStages(const plan::Plan &plan);

/// "12.3 ms", "850 us", "1.20 s".
std::string formatSeconds(double seconds);

} // namespace pipec

#endif // PIPEC_DRIVER_REPORT_H
