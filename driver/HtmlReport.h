//===- HtmlReport.h - `pipec report --format html` ----------------------===//
//
// One self-contained HTML file, no network: a summary (model, schedule, P,
// V, M, predicted step time, bubble, peak memory per rank against the
// limit), the stage table, bars of per-stage time and per-rank memory, the
// simulated pipeline timeline as SVG (one row per rank, F / I / W / B /
// communication coloured, microbatch numbers, bubbles visible), and the
// comparison of balancing methods; with a measured trace (`pipec run
// --trace`), the measured timeline of the run's last step beneath the
// simulated one, on its own time scale.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_HTMLREPORT_H
#define PIPEC_DRIVER_HTMLREPORT_H

#include "compiler/sim/Simulator.h"
#include "plan/plan.pb.h"

#include "llvm/Support/raw_ostream.h"

namespace pipec {

void printReportHtml(const plan::Plan &plan, llvm::raw_ostream &os,
                     const SimulationResult *measured = nullptr);

} // namespace pipec

#endif // PIPEC_DRIVER_HTMLREPORT_H
