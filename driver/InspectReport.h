//===- InspectReport.h - `pipec inspect` as text and JSON ---------------===//
//
// The layer table of a model: index, name, kind, ops, params, forward FLOPs,
// activation bytes and the bytes crossing the boundary after each layer, then
// totals and warnings. The JSON field names are a stable interface (see
// docs/USER_GUIDE.md): fields may be added, never renamed.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_INSPECTREPORT_H
#define PIPEC_DRIVER_INSPECTREPORT_H

#include "compiler/ir/LayerGraph.h"

#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

namespace pipec {

inline constexpr int InspectFormatVersion = 1;

struct InspectReport {
  std::string xxh3;
  int64_t nodes = 0; ///< nodes in the ONNX file, Constant nodes included
  int64_t params = 0;
  int64_t flopsForward = 0;
  std::vector<std::string> warnings;
};

/// Computes the figures and warnings (hashes the model file).
InspectReport makeInspectReport(const Graph &graph, const LayerGraph &layers);

/// The warnings of makeInspectReport about \p graph's live ops: control
/// flow kept as one opaque op (a row of Ops.def with the Subgraph flag), and
/// the ops the runtime will not run (no row, or no CPU kernel), each with
/// its count.
std::vector<std::string> opWarnings(const Graph &graph);
void printInspectText(const InspectReport &report, const Graph &graph, const LayerGraph &layers,
                      llvm::raw_ostream &os);
void printInspectJson(const InspectReport &report, const Graph &graph, const LayerGraph &layers,
                      llvm::raw_ostream &os);

/// "1.23 G", "512 K", "17": a short human form of a count (base 1000) or,
/// with \p binary, of a byte size (base 1024, "KiB").
std::string humanCount(int64_t value, bool binary = false);

} // namespace pipec

#endif // PIPEC_DRIVER_INSPECTREPORT_H
