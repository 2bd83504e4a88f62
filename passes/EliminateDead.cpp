//===- EliminateDead.cpp - eliminate-dead ---------------------------------===//
#include "passes/EliminateDead.h"

using namespace llvm;

namespace pipec {

Expected<bool> eliminateDead(Graph &graph) {
  std::vector<bool> needed(graph.values.size(), false);
  for (int id : graph.outputs)
    needed[id] = true;
  bool changed = false;
  // Ops are in topological order: one backward sweep finds every live op.
  for (size_t i = graph.ops.size(); i-- > 0;) {
    Op &op = graph.ops[i];
    if (op.dead)
      continue;
    bool live = false;
    for (int id : op.outputs)
      live |= id >= 0 && needed[id];
    if (!live) {
      op.dead = true;
      changed = true;
      continue;
    }
    for (int id : op.inputs)
      if (id >= 0)
        needed[id] = true;
    for (int id : op.captures)
      needed[id] = true;
  }
  if (changed)
    graph.compact();
  return changed;
}

} // namespace pipec
