//===- TieWeights.h - tie-weights: which shared weights train as one ----===//
//
// Decides, by structure and content, which initializers train as one weight,
// before differentiate sees them (train mode only):
//  - a folded tie: a 2-D float initializer H whose values are bitwise the
//    transpose of another, E, that a Gather reads as its table (an
//    embedding), H not constant. Exporters (torch's dynamo exporter) fold a
//    tied LM head's Transpose(E) into such an H, which would train apart
//    from E. The pass reads Transpose(E) where H was read, so the gradient
//    sums into E as the tie does; `--untie H` keeps them apart.
//  - a shared initializer: a float initializer read by more than one layer.
//    Exporters dedupe equal tensors (a fresh model's LayerNorm scales, all
//    ones, become one initializer), which is told from a real tie by its
//    readers: every reader reads it in the same role (op type and input
//    slot) for exporter sharing, different roles for a real tie (a Gather's
//    table and the head MatMul's B). `--untie NAME` (or `all`: every
//    same-role one) gives each reading layer its own copy, NAME.untied.L,
//    L the layer's index, so each trains separately.
//
// Before: LayerNormalization ln0 (layer 1) and ln1 (layer 2) read "ones" as
//         their scale; --untie all
// After:  ln0 reads "ones.untied.1", ln1 reads "ones.untied.2", two weights
//         with the bytes of "ones"
//
// Before: Gather(wte, ids) in layer 0, MatMul(h, head) in layer 3, head ==
//         wte^T bitwise
// After:  MatMul(h, Transpose(wte)) in layer 3; "head" is read no more
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_TIEWEIGHTS_H
#define PIPEC_PASSES_TIEWEIGHTS_H

#include "compiler/ir/LayerGraph.h"
#include "plan/plan.pb.h"

#include "llvm/ADT/STLFunctionalExtras.h"

#include <map>
#include <string>
#include <vector>

namespace pipec {

/// One reader of a weight: the ONNX node (its index in the model file's
/// graph) and the input slot.
struct WeightReader {
  int node = -1;
  int input = -1;
};

/// A parameter of a checkpoint (`--params`) that an initializer holds for
/// some of its readers: the exporter merged equal tensors of several
/// parameters (a fresh model's norm scales, all ones) into one.
struct ParamSplit {
  std::string param; ///< the checkpoint's name
  std::string copy;  ///< the weight its readers read instead
  std::vector<WeightReader> readers;
  /// From structure alone (no --params): `param` is the reading module.
  bool guessed = false;
};

/// Which weights `--untie` names: names, and "all" for every shared
/// initializer whose readers share one role; and the initializers to split
/// by parameter (driver/MapParams.h's splitMergedParams).
struct TieOptions {
  std::vector<std::string> untie;
  bool untieAll = false;
  std::map<std::string, std::vector<ParamSplit>> splits;
};

/// A float initializer read by more than one layer.
struct SharedWeight {
  std::string name;
  /// Layer indices and names, in order.
  std::vector<int> layers;
  std::vector<std::string> layerNames;
  /// "LayerNormalization input 1" when every reader reads it so (exporter
  /// sharing), else "" (a real tie).
  std::string role;
  /// When untied: one copy per reading layer (in the order of `layers`),
  /// with the readers that read it.
  std::vector<std::string> copies;
  std::vector<std::vector<WeightReader>> copyReaders;
  /// Split by parameter (TieOptions::splits): the copies' parameters, or
  /// with `guessed` their modules.
  std::vector<std::string> params;
  bool guessed = false;
};

/// A folded tie: \p head holds the transpose of \p embedding.
struct FoldedTie {
  std::string head, embedding;
  /// Kept apart by --untie.
  bool untied = false;
};

/// What tie-weights found and did.
struct TieReport {
  std::vector<FoldedTie> folded;
  std::vector<SharedWeight> shared;
  int untied() const;
  int retied() const;
};

/// The (head, embedding) pairs of \p graph's folded ties (tie-weights reads
/// the head as the embedding's transpose): shard-tensors splits both alike
/// or neither.
std::vector<std::pair<std::string, std::string>> foldedTiePairs(const Graph &graph);

/// Runs tie-weights on \p graph and its \p layers (group-layers' result):
/// reties folded ties, unties what \p options names, and regroups \p layers
/// when the graph gained ops. A name in options.untie that is neither a
/// shared initializer nor a folded tie's head is a usage error naming
/// --untie.
llvm::Expected<TieReport> tieWeights(Graph &graph, LayerGraph &layers, const TieOptions &options);

/// Adds to \p plan what \p report found and did: a warning per folded tie
/// and per shared initializer (exporter sharing, a real tie, or untied into
/// copies), but for weights that do not train (\p trained says which train:
/// those the backward gives a gradient), whose sharing changes nothing; and
/// plan.ties, the record --save-weights writes the model file by.
void describeTies(plan::Plan &plan, const TieReport &report,
                  llvm::function_ref<bool(llvm::StringRef)> trained);

/// Text form for --print-after=tie-weights.
void printTieReport(const TieReport &report, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_PASSES_TIEWEIGHTS_H
