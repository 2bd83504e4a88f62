//===- PassPipeline.h - The pipeline of named passes --------------------===//
//
// Every pass of `pipec compile` runs through one PassRunner, in the order of
// passes/Passes.def: import, the graph passes, group-layers, differentiate,
// balance-stages, lower-schedule, plan-memory, verify-program. The runner
// times each pass, reports its statistics (--stats), prints the IR it leaves
// (--print-after=NAME|all) and writes that IR to NN-NAME.txt in a directory
// (--dump-dir), NN being the pass's position in Passes.def. `pipec inspect`
// runs the passes up to group-layers through it too.
//
// This file also holds the front half of the pipeline, which inspect and
// compile share: import, the graph passes with the verifier between them,
// and group-layers.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_PASSPIPELINE_H
#define PIPEC_DRIVER_PASSPIPELINE_H

#include "compiler/ir/LayerGraph.h"
#include "compiler/onnx/OnnxImporter.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/Support/raw_ostream.h"

#include <string>
#include <vector>

namespace pipec {

struct PipelineOptions {
  /// Pass names whose output is printed, or "all".
  std::vector<std::string> printAfter;
  /// Directory that receives NN-<pass>.txt after every pass when set.
  std::string dumpDir;
  /// Print per-pass time and the size of the IR each pass leaves.
  bool stats = false;
  /// Run the verifier after every graph pass (always on in tests).
  bool verify = true;
  /// Where printing and statistics go; stderr when null.
  llvm::raw_ostream *log = nullptr;
};

/// The names of all passes in Passes.def order, import first.
std::vector<std::string> passNames();

/// Passes.def as the Markdown table of docs/USER_GUIDE.md: per pass its
/// position, name, what --print-after shows and what --stats counts.
std::string passTable();

/// The passes `pipec inspect` runs: import through group-layers.
std::vector<std::string> inspectPasses();

/// Checks \p printAfter: every name is "all" or one of \p runs (the passes
/// the command runs, in Passes.def order). The one-line error lists them,
/// and says which command runs a pass of Passes.def that \p runs lacks.
llvm::Error checkPrintAfter(llvm::ArrayRef<std::string> printAfter,
                            llvm::ArrayRef<std::string> runs);

/// Runs the passes of one compile, each through run() or skip(), in
/// Passes.def order (asserted). A runner holds no IR: each pass's body reads
/// and writes the caller's.
class PassRunner {
public:
  explicit PassRunner(PipelineOptions options);

  /// A runner with the same verification that prints, dumps and counts
  /// nothing: for the plans compile builds only to compare (the balancing
  /// alternatives, the candidates of --schedule auto).
  PassRunner quiet() const;

  /// Whether any pass's output is shown (--stats, --print-after or
  /// --dump-dir).
  bool shows() const;

  const PipelineOptions &options() const { return opts; }

  /// Runs \p body as the pass \p name. When it succeeds: with --stats prints
  /// "stats: NAME  T ms  SUMMARY" (T: \p body's time, SUMMARY: \p summary()),
  /// with --print-after prints a banner and \p print's text, with --dump-dir
  /// writes that text atomically to NN-NAME.txt. Returns \p body's error, or
  /// the dump's.
  llvm::Error run(llvm::StringRef name, llvm::function_ref<llvm::Error()> body,
                  llvm::function_ref<std::string()> summary,
                  llvm::function_ref<void(llvm::raw_ostream &)> print);

  /// Pass \p name does not run in this compile because of \p why: --stats,
  /// --print-after and --dump-dir say so.
  llvm::Error skip(llvm::StringRef name, llvm::StringRef why);

private:
  /// The pass's position in Passes.def, checked to follow the last one run.
  int advance(llvm::StringRef name);
  bool wantsPrint(llvm::StringRef name) const;
  llvm::raw_ostream &log() const;
  llvm::Error show(int index, llvm::StringRef name,
                   llvm::function_ref<void(llvm::raw_ostream &)> print) const;

  PipelineOptions opts;
  std::vector<std::string> names;
  int last = -1;
};

/// Runs the graph passes of Passes.def in order through \p runner.
llvm::Error runGraphPasses(Graph &graph, PassRunner &runner);
llvm::Error runGraphPasses(Graph &graph, const PipelineOptions &options);

/// Imports \p path and runs the graph passes.
llvm::Expected<Graph> loadGraph(llvm::StringRef path, const ImportOptions &importOptions,
                                PassRunner &runner);
llvm::Expected<Graph> loadGraph(llvm::StringRef path, const ImportOptions &importOptions,
                                const PipelineOptions &options);

/// Runs group-layers on \p graph.
llvm::Expected<LayerGraph> buildLayerGraph(const Graph &graph, PassRunner &runner);

} // namespace pipec

#endif // PIPEC_DRIVER_PASSPIPELINE_H
