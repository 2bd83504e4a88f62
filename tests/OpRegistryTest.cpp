//===- OpRegistryTest.cpp - The compiler's consumers agree with Ops.def --===//
//
// Ops.def is the one list of ops. These tests build graphs from its rows
// and check that what the compiler decides per op follows them: constant
// folding evaluates every op marked Fold and no other.
//
//===----------------------------------------------------------------------===//
#include "ops/OpRegistry.h"
#include "passes/ConstantEvaluator.h"

#include <gtest/gtest.h>

using namespace pipec;

namespace {

/// An empty graph of the newest opsets the registry knows.
Graph emptyGraph() {
  Graph graph;
  graph.opsets[""] = 23;
  graph.opsets["com.microsoft"] = 1;
  return graph;
}

void addOp(Graph &graph, llvm::StringRef domain, llvm::StringRef type) {
  Op op;
  op.name = (type + "_" + llvm::Twine(graph.ops.size())).str();
  op.opType = type.str();
  op.domain = domain.str();
  graph.ops.push_back(op);
}

TEST(OpRegistry, FoldingEvaluatesEveryFoldOp) {
  Graph graph = emptyGraph();
  for (const OpDef &def : allOps())
    if (def.domain == OpDomain::Onnx)
      addOp(graph, "", def.name);
  int foldable = 0;
  for (const Op &op : graph.ops) {
    const OpDef *def = lookupOp("", op.opType, 23);
    ASSERT_TRUE(def);
    EXPECT_EQ(isEvaluable(graph, op), def->has(Fold)) << op.opType;
    foldable += def->has(Fold);
  }
  EXPECT_GT(foldable, 40);
  // The contrib domain folds nothing.
  Graph contrib = emptyGraph();
  addOp(contrib, "com.microsoft", "Gelu");
  EXPECT_FALSE(isEvaluable(contrib, contrib.ops.front()));
}

} // namespace
