//===- GraphEdit.h - Small edits of a Graph that passes share ------------===//
//
// The reads of a value, a fresh name, and pointing one read at another
// value, in the Graph's ops and in the ONNX nodes the stage programs are
// built from. tie-weights and train-params edit weights' readers with them.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GRAPHEDIT_H
#define PIPEC_PASSES_GRAPHEDIT_H

#include "compiler/ir/Graph.h"
#include "compiler/ir/LayerGraph.h"

#include "llvm/Support/Error.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace pipec {

/// The live ops' reads of value \p id: (op, input slot), in op order.
std::vector<std::pair<int, int>> readsOf(const Graph &graph, int id);

/// Whether an op's subgraph (If, Loop, Scan body) reads value \p id.
bool capturedBySubgraph(const Graph &graph, int id);

/// A name no value has: \p base, else base.N.
std::string freshName(const Graph &graph, const std::string &base);

/// The (node, input) of the model file that reads what input \p slot of op
/// \p o reads: the op's own node, or for an op a pass made, its fileReads.
std::pair<int, int> fileRead(const Graph &graph, int o, int slot);

/// Points input \p slot of op \p o at value \p id, in the op and its node.
/// The caller rebuilds the uses.
void rewire(Graph &graph, int o, int slot, int id);

/// Inserts the ops of \p before (op index -> ops to insert before it; the
/// op count: at the end) into the op list, and rebuilds the uses.
void insertOps(Graph &graph, std::map<int, std::vector<Op>> &before);

/// After \p pass edited \p graph: checks it (shapes known) and groups its
/// layers again into \p layers.
llvm::Error regroupAfter(Graph &graph, LayerGraph &layers, llvm::StringRef pass);

} // namespace pipec

#endif // PIPEC_PASSES_GRAPHEDIT_H
