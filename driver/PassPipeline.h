//===- PassPipeline.h - Import, run the graph passes, group layers ------===//
//
// The front half of `pipec compile` and all of `pipec inspect`: import the
// ONNX file, run the graph passes listed in passes/Passes.def with the
// verifier between them, then group-layers. Every pass can print its output
// (--print-after=NAME), dump it to a directory (--dump-dir) and report
// statistics (--stats).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_PASSPIPELINE_H
#define PIPEC_DRIVER_PASSPIPELINE_H

#include "compiler/ir/LayerGraph.h"
#include "compiler/onnx/OnnxImporter.h"

#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

namespace pipec {

struct PipelineOptions {
  /// Pass names whose output is printed, or "all".
  std::vector<std::string> printAfter;
  /// Directory that receives NN-<pass>.txt after every pass when set.
  std::string dumpDir;
  /// Print per-pass time and op counts.
  bool stats = false;
  /// Run the verifier after every pass (always on in tests).
  bool verify = true;
  /// Where printing and statistics go; stderr when null.
  llvm::raw_ostream *log = nullptr;
};

/// The names of all passes in Passes.def order.
std::vector<std::string> passNames();

/// The passes --print-after and --dump-dir show: import, the graph passes
/// and group-layers.
std::vector<std::string> printablePasses();

/// Runs the graph passes of Passes.def in order.
llvm::Error runGraphPasses(Graph &graph, const PipelineOptions &options);

/// Imports \p path and runs the graph passes.
llvm::Expected<Graph> loadGraph(llvm::StringRef path, const ImportOptions &importOptions,
                                const PipelineOptions &options);

/// Runs group-layers on \p graph, printing or dumping it when asked.
llvm::Expected<LayerGraph> buildLayerGraph(const Graph &graph, const PipelineOptions &options);

} // namespace pipec

#endif // PIPEC_DRIVER_PASSPIPELINE_H
