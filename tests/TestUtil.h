//===- TestUtil.h - Helpers shared by pipec's tests ---------------------===//
#ifndef PIPEC_TESTS_TESTUTIL_H
#define PIPEC_TESTS_TESTUTIL_H

#include "compiler/ir/LayerGraph.h"
#include "compiler/schedule/PipelineShape.h"
#include "driver/PassPipeline.h"
#include "models/ModelGenerators.h"

#include "onnx/onnx_pb.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace pipec::test {

/// The pipec command of this build.
inline const std::string pipecBinary = std::string(PIPEC_BINARY_DIR) + "/bin/pipec";

/// A fresh directory under the build tree, removed when the object dies.
class TempDir {
public:
  TempDir();
  ~TempDir();
  std::string path(llvm::StringRef name) const;
  const std::string &root() const { return dir; }

private:
  std::string dir;
};

/// Builds small ONNX graphs for importer tests.
class GraphBuilder {
public:
  explicit GraphBuilder(int opset = 17);
  onnx::ModelProto model;
  onnx::GraphProto &graph() { return *model.mutable_graph(); }

  /// Adds a graph input; a dim < 0 becomes the symbolic dim named in \p symbols.
  void input(const std::string &name, int elemType, const std::vector<int64_t> &dims,
             const std::vector<std::string> &symbols = {});
  void output(const std::string &name, int elemType = 1);
  onnx::NodeProto &node(const std::string &opType, const std::vector<std::string> &inputs,
                        const std::vector<std::string> &outputs, const std::string &name = "");
  /// Adds a float initializer with values 0.5, 1.5, 2.5, ... as raw_data.
  onnx::TensorProto &weight(const std::string &name, const std::vector<int64_t> &dims);
  /// Adds an int64 initializer.
  onnx::TensorProto &ints(const std::string &name, const std::vector<int64_t> &values);
  std::string serialize() const;
  /// Writes the model to \p path.
  void write(const std::string &path) const;
};

/// Imports bytes with the default graph passes.
llvm::Expected<Graph> importBytes(const std::string &bytes, const ImportOptions &options = {});
/// Generates a model, imports it with the default graph passes, binding the
/// batch to \p batch and the sequence to the generator's.
llvm::Expected<Graph> importGenerated(const models::GeneratorOptions &options, int64_t batch = 1);

/// Imports a file with the default graph passes.
llvm::Expected<Graph> loadFile(const std::string &path, const ImportOptions &options = {});

/// A graph and its layers, which point into it.
struct GroupedGraph {
  std::unique_ptr<Graph> graph;
  LayerGraph layers;
};
/// Groups the layers of an imported \p graph. A failed import or grouping
/// fails the test; the result then holds what was made before it.
GroupedGraph groupGraph(llvm::Expected<Graph> graph);

/// Runs a shell command; returns its exit status and captures stdout+stderr.
int runCommand(const std::string &command, std::string &output);

/// `pipec model ARGS -o MODEL` by the built pipec; the command and its
/// output as a failure when it does not exit 0.
::testing::AssertionResult pipecModel(const std::string &args, const std::string &model);

/// `pipec model gpt` of 2 layers, width 16, vocabulary 50, 8 tokens and a
/// loss to \p model, compiled for 2 CPU ranks with \p compileFlags to
/// \p plan by the built pipec; the failing command's output otherwise.
::testing::AssertionResult smallGptPlan(const std::string &model, const std::string &plan,
                                        const std::string &compileFlags);

/// A fixture: smallGptPlan's model and plan, compiled with the flags its
/// subclass gives, in a directory of the test's own.
class SmallGptPlanTest : public ::testing::Test {
protected:
  explicit SmallGptPlanTest(std::string compileFlags) : compileFlags(std::move(compileFlags)) {}
  void SetUp() override { ASSERT_TRUE(smallGptPlan(model, plan, compileFlags)); }

  TempDir dir;
  std::string model = dir.path("g.onnx"), plan = dir.path("g.plan");

private:
  std::string compileFlags;
};

/// A shape the test knows the schedule takes (it aborts on one it does not).
inline PipelineShape pipelineShape(ScheduleKind kind, int stages, int virtualStages,
                                   int microbatches, int dataParallel = 1) {
  return llvm::cantFail(
      PipelineShape::make(kind, stages, virtualStages, microbatches, 1, dataParallel));
}

std::string readFile(const std::string &path);
/// The losses of a `pipec run --metrics` file, a line per step: "STEP LOSS"
/// and " EVAL" when it evaluated, as written (the rest of a line is timing).
std::string metricLosses(const std::string &path);

/// \p text, a text plan edited by a test, sealed again as compile seals
/// (sealPlan), so that the edit reaches the checks behind the seal: what a
/// user who forges the seal meets. Text that does not parse is returned
/// as it is.
std::string resealedTextPlan(const std::string &text);
bool fileExists(const std::string &path);

/// The real third-party models, or "" when the shared folder is absent.
std::string realModel(llvm::StringRef relative);

} // namespace pipec::test

#endif // PIPEC_TESTS_TESTUTIL_H
