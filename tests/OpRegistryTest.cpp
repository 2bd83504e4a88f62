//===- OpRegistryTest.cpp - The compiler's consumers agree with Ops.def --===//
//
// Ops.def is the one list of ops. These tests build graphs from its rows
// and check that what the compiler decides per op follows them: inspect
// warns about no op the CPU runs, and names the ones it does not; constant
// folding evaluates every op whose FOLD names an evaluator, and no other.
//
//===----------------------------------------------------------------------===//
#include "ops/OpRegistry.h"
#include "driver/InspectReport.h"
#include "passes/ConstantEvaluator.h"

#include "llvm/ADT/STLExtras.h"

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
  op.setType(domain, type);
  graph.ops.push_back(op);
}

std::string joined(const std::vector<std::string> &lines) {
  std::string text;
  for (const std::string &line : lines)
    text += line + "\n";
  return text;
}

TEST(OpRegistry, InspectWarnsAboutNoOpWithACpuKernel) {
  Graph graph = emptyGraph();
  for (const OpDef &def : allOps())
    if (def.hasCpuKernel && def.domain != OpDomain::Pipec)
      addOp(graph, def.domainName(), def.name);
  // Every element-wise op and the kernels of the transformer, CNN and
  // contrib models: well over a hundred.
  EXPECT_GT(graph.ops.size(), 100u);
  std::vector<std::string> warnings = opWarnings(graph);
  EXPECT_TRUE(warnings.empty()) << joined(warnings);
}

TEST(OpRegistry, InspectNamesWhatTheCpuDoesNotRun) {
  // A default-domain row without a CPU kernel, whichever that is now.
  const OpDef *noKernel = llvm::find_if(allOps(), [](const OpDef &def) {
    return def.domain == OpDomain::Onnx && !def.hasCpuKernel && !def.has(Subgraph) &&
           def.since <= 23;
  });
  ASSERT_NE(noKernel, allOps().end());
  Graph graph = emptyGraph();
  addOp(graph, "", "Relu");
  addOp(graph, "", noKernel->name);
  addOp(graph, "ai.onnx.ml", "Scaler");   // a domain without rows
  addOp(graph, "com.microsoft", "Relu");  // no row in this domain
  addOp(graph, "", "Loop");               // control flow runs: its kernel interprets the body
  addOp(graph, "", "GroupNormalization"); // dead: not counted
  graph.ops.back().dead = true;
  std::vector<std::string> expected = {"ops the runtime will not run: " + noKernel->name.str() +
                                       " x1, ai.onnx.ml.Scaler x1, com.microsoft.Relu x1"};
  EXPECT_EQ(opWarnings(graph), expected);
}

TEST(OpRegistry, ControlFlowIsTheSubgraphFlag) {
  for (const OpDef &def : allOps()) {
    bool controlFlow = def.name == "If" || def.name == "Loop" || def.name == "Scan";
    EXPECT_EQ(def.has(Subgraph), controlFlow) << def.name.str();
  }
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
    EXPECT_EQ(isEvaluable(graph, op), def->foldable) << op.opType;
    foldable += def->foldable;
  }
  EXPECT_GT(foldable, 40);
  // The contrib domain folds nothing.
  Graph contrib = emptyGraph();
  addOp(contrib, "com.microsoft", "Gelu");
  EXPECT_FALSE(isEvaluable(contrib, contrib.ops.front()));
}

} // namespace
