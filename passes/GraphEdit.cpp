//===- GraphEdit.cpp - Small edits of a Graph that passes share ----------===//
#include "passes/GraphEdit.h"
#include "passes/GroupLayers.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"

namespace pipec {

std::vector<std::pair<int, int>> readsOf(const Graph &graph, int id) {
  std::vector<std::pair<int, int>> reads;
  for (size_t o = 0; o < graph.ops.size(); ++o) {
    const Op &op = graph.ops[o];
    if (op.dead)
      continue;
    for (size_t i = 0; i < op.inputs.size(); ++i)
      if (op.inputs[i] == id)
        reads.emplace_back(static_cast<int>(o), static_cast<int>(i));
  }
  return reads;
}

bool capturedBySubgraph(const Graph &graph, int id) {
  return llvm::any_of(
      graph.ops, [&](const Op &op) { return !op.dead && llvm::is_contained(op.captures, id); });
}

std::string freshName(const Graph &graph, const std::string &base) {
  std::string name = base;
  for (int n = 1; graph.findValue(name) >= 0; ++n)
    name = base + "." + std::to_string(n);
  return name;
}

std::pair<int, int> fileRead(const Graph &graph, int o, int slot) {
  const Op &op = graph.ops[o];
  if (static_cast<size_t>(slot) < op.fileReads.size())
    return op.fileReads[slot];
  return {op.nodeIndex, slot};
}

void rewire(Graph &graph, int o, int slot, int id) {
  Op &op = graph.ops[o];
  op.inputs[slot] = id;
  graph.model->mutable_graph()->mutable_node(op.nodeIndex)->set_input(slot, graph.values[id].name);
}

void insertOps(Graph &graph, std::map<int, std::vector<Op>> &before) {
  std::vector<Op> ops;
  for (int o = 0; o < static_cast<int>(graph.ops.size()); ++o) {
    if (auto it = before.find(o); it != before.end())
      for (Op &added : it->second)
        ops.push_back(std::move(added));
    ops.push_back(std::move(graph.ops[o]));
  }
  if (auto it = before.find(static_cast<int>(graph.ops.size())); it != before.end())
    for (Op &added : it->second)
      ops.push_back(std::move(added));
  graph.ops = std::move(ops);
  graph.rebuildUses();
}

llvm::Error regroupAfter(Graph &graph, LayerGraph &layers, llvm::StringRef pass) {
  if (llvm::Error err = verifyGraph(graph, /*requireShapes=*/true))
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "%s: %s", pass.str().c_str(),
                                   llvm::toString(std::move(err)).c_str());
  auto regrouped = groupLayers(graph);
  if (!regrouped)
    return regrouped.takeError();
  layers = std::move(*regrouped);
  return llvm::Error::success();
}

} // namespace pipec
