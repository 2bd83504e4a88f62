//===- LayerGraph.h - A model as a chain of layers ----------------------===//
//
// Pipeline partitioning cuts a chain, so group-layers turns the op DAG into
// an ordered list of layers: the embedding (or a stem), the repeated blocks,
// the head and the loss. Every op belongs to one layer, a layer only reads
// values made by itself or by earlier layers, and the tensors that cross each
// boundary between two consecutive layers are listed with their bytes. A
// weight read by two layers (a tied embedding and LM head) is one weight with
// two users.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_IR_LAYERGRAPH_H
#define PIPEC_COMPILER_IR_LAYERGRAPH_H

#include "compiler/ir/Graph.h"

#include "llvm/Support/raw_ostream.h"

namespace pipec {

enum class LayerKind { Embedding, Block, Head, Loss, Other };

/// "embedding", "block", "head", "loss" or "other", as in the JSON output.
llvm::StringRef layerKindName(LayerKind kind);

/// A tensor live across one or more layer boundaries.
struct CrossingTensor {
  int value = -1;
  /// Layer that produces it; for a graph input, the first layer that reads it.
  int fromLayer = 0;
  /// Last layer that reads it.
  int toLayer = 0;
};

struct Layer {
  std::string name;
  LayerKind kind = LayerKind::Other;
  /// Op indices into Graph::ops, in topological order.
  std::vector<int> ops;
  /// Weights (value ids) the layer reads, each counted once.
  std::vector<int> weights;
  int64_t params = 0;
  int64_t flopsForward = 0;
  /// Bytes of activations the layer produces (what backward would keep).
  int64_t activationBytes = 0;
};

/// Which evidence group-layers used.
enum class GroupingMethod { ModulePath, RepeatedStructure, CutAnalysis };
llvm::StringRef groupingMethodName(GroupingMethod method);

class LayerGraph {
public:
  /// The graph the layers refer to; it must outlive the LayerGraph.
  const Graph *graph = nullptr;
  std::vector<Layer> layers;
  /// Every tensor that crosses at least one boundary, by value id.
  std::vector<CrossingTensor> crossings;
  GroupingMethod method = GroupingMethod::CutAnalysis;

  /// Tensors crossing the boundary after layer \p i (from i to i + 1).
  std::vector<int> crossingAfter(size_t i) const;
  /// Their total bytes.
  int64_t boundaryBytes(size_t i) const;
  /// Weights read by more than one layer, with the layers that read them.
  std::vector<std::pair<int, std::vector<int>>> sharedWeights() const;
  int64_t totalParams() const;

  /// Text form used by `--print-after=group-layers` and golden tests.
  void print(llvm::raw_ostream &os) const;
  /// Checks the invariants in the file comment; the error names the layer.
  llvm::Error verify() const;
};

} // namespace pipec

#endif // PIPEC_COMPILER_IR_LAYERGRAPH_H
