//===- Curves.h - Training curves from a metrics file -------------------===//
//
// `pipec run --metrics FILE` writes one JSON object a line, one line per
// training step:
//
//   {"step": 1, "loss": 5.5412, "lr": 0.001, "tokens_per_s": 8123.4}
//   {"step": 50, "loss": 3.12, "eval_loss": 3.30, "lr": 0.001}
//
// readMetrics reads such a file back; printCurvesSvg draws it for the HTML
// partition report as inline SVG charts (loss with eval loss, learning rate,
// throughput), with no script and no link.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_CURVES_H
#define PIPEC_DRIVER_CURVES_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

/// One line of a metrics file. Every field but the step may be absent; a
/// present one may be NaN or infinite (a run that diverged writes `nan`).
/// tflops is per second; mfu is a fraction of the peak (0.041 is 4.1%).
struct MetricsPoint {
  int64_t step = 0;
  std::optional<double> loss, evalLoss, lr, tokensPerSecond, samplesPerSecond, gradNorm, tflops,
      mfu;
};

/// The lines of the metrics file at \p path, in file order. Blank lines are
/// skipped. Each other line must be a JSON object with a whole-number
/// "step"; "loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s",
/// "grad_norm", "tflops" and "mfu" are read when present and must be
/// numbers or null (null is absent); nan, inf and infinity, bare or quoted,
/// in any case and with a sign, read as the non-finite numbers; other keys
/// are ignored. An error is one line: "PATH:LINE: what is wrong", or PATH
/// and why it could not be read, or that it holds no line.
llvm::Expected<std::vector<MetricsPoint>> readMetrics(llvm::StringRef path);

/// Writes an HTML section, "<h2>Training curves</h2>" and one inline SVG
/// per chart, for \p points in any step order: loss and eval loss (eval as
/// points with a tooltip each, joined by a line), learning rate, and
/// tokens/s (samples/s where no point has tokens/s). A chart whose series
/// has no finite value is left out; non-finite values are not drawn and
/// are counted beneath their chart. Each series is drawn from at most
/// about 1000 points (downsampleSeries).
void printCurvesSvg(llvm::ArrayRef<MetricsPoint> points, llvm::raw_ostream &os);

/// A few lines for `pipec report --metrics` in text: the steps, the first
/// and last loss and eval loss, the lowest eval loss, and the median rates.
/// \p points must not be empty (readMetrics never gives none).
std::string summarizeMetrics(llvm::ArrayRef<MetricsPoint> points);

/// At most \p maxPoints (4 when less) of \p series, a series of (step,
/// finite value) sorted by step: the first and the last, and between them
/// the lowest and the highest value of each of (maxPoints - 2) / 2 equal
/// runs of points, in step order, so that spikes survive. A series that
/// fits is returned as it is.
std::vector<std::pair<int64_t, double>>
downsampleSeries(llvm::ArrayRef<std::pair<int64_t, double>> series, size_t maxPoints);

} // namespace pipec

#endif // PIPEC_DRIVER_CURVES_H
