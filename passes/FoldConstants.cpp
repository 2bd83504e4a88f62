//===- FoldConstants.cpp - fold-constants ---------------------------------===//
#include "passes/FoldConstants.h"

using namespace llvm;

namespace pipec {

Expected<bool> foldConstants(Graph &graph) {
  bool changed = false;
  for (Op &op : graph.ops) {
    if (op.dead || op.outputs.empty())
      continue;
    bool allKnown = true;
    for (int id : op.outputs)
      allKnown &= id >= 0 && graph.values[id].constant != nullptr;
    if (!allKnown)
      continue;
    op.dead = true;
    changed = true;
  }
  if (changed)
    graph.compact();
  return changed;
}

} // namespace pipec
