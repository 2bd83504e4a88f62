//===- HtmlReport.h - `pipec report --format html` ----------------------===//
//
// One self-contained HTML file, no network: a summary (model, schedule, P,
// V, M, predicted step time, bubble, peak memory per rank against the
// limit), the stage table, bars of per-stage time and per-rank memory, the
// simulated pipeline timeline as SVG (one row per rank, F / I / W / B /
// communication coloured, microbatch numbers, bubbles visible), and the
// comparison of balancing methods; with a measured trace (`pipec run
// --trace`), the measured timeline of the run's last step beneath the
// simulated one, on its own time scale; with the metrics of a run (`pipec
// run --metrics`), its training curves after the timelines: loss and eval
// loss, learning rate and throughput against the step (Curves.h).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_HTMLREPORT_H
#define PIPEC_DRIVER_HTMLREPORT_H

#include "compiler/sim/Simulator.h"
#include "driver/Curves.h"
#include "plan/plan.pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/raw_ostream.h"

namespace pipec {

/// Writes the report of \p plan to \p os. \p measured: the timeline of a
/// run's last step, drawn beneath the simulated one; \p curves: the lines
/// of a run's metrics file (readMetrics), drawn after the timelines when
/// there are any.
void printReportHtml(const plan::Plan &plan, llvm::raw_ostream &os,
                     const SimulationResult *measured = nullptr,
                     llvm::ArrayRef<MetricsPoint> curves = {});

} // namespace pipec

#endif // PIPEC_DRIVER_HTMLREPORT_H
