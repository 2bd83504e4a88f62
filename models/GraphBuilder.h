//===- GraphBuilder.h - ONNX graphs with torch-style names ---------------===//
//
// What the model families build with (Families.h; the API is
// ModelGenerators.h): a GraphBuilder appends nodes, Constant nodes and
// pseudo-random initializers to an onnx::GraphProto with the names
// torch.onnx.export gives them, and a Mod names a torch module.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MODELS_GRAPHBUILDER_H
#define PIPEC_MODELS_GRAPHBUILDER_H

#include "models/ModelGenerators.h"

#include "onnx/onnx_pb.h"
#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pipec::models {

/// Dimension placeholder for the batch size in value infos and shapes.
constexpr int64_t kBatch = -1;

constexpr int32_t kFloat = onnx::TensorProto::FLOAT;
constexpr int32_t kInt64 = onnx::TensorProto::INT64;

onnx::AttributeProto attrInt(llvm::StringRef name, int64_t value);

onnx::AttributeProto attrFloat(llvm::StringRef name, float value);

onnx::AttributeProto attrInts(llvm::StringRef name, llvm::ArrayRef<int64_t> values);

onnx::AttributeProto attrString(llvm::StringRef name, llvm::StringRef value);

/// A torch module: its export scope ("/transformer/h.0") and its parameter
/// prefix ("transformer.h.0").
struct Mod {
  std::string scope;
  std::string paramPrefix;

  Mod child(const llvm::Twine &name) const {
    std::string n = name.str();
    return {scope + "/" + n, paramPrefix.empty() ? n : paramPrefix + "." + n};
  }
  std::string param(llvm::StringRef leaf) const { return paramPrefix + "." + leaf.str(); }
};

/// How a weight is filled: ~N(0, 0.02), or 1 + N(0, 0.02) for norm scales
/// and batch-norm variances.
enum class Init { Normal, One };

/// Appends nodes, constants, initializers and graph inputs/outputs to a graph
/// with torch-style names.
class GraphBuilder {
public:
  GraphBuilder(onnx::GraphProto &graph, const GeneratorOptions &opts)
      : graph(graph), options(opts) {}

  const GeneratorOptions &opts() const { return options; }

  /// Adds a node named "<Scope>/<OpType>" (then "_1", "_2", ... as torch
  /// does) and returns its outputs "<name>_output_<i>"; \p outName, when
  /// given, names the first output instead.
  std::vector<std::string> addNodeN(llvm::StringRef opType, llvm::StringRef scope,
                                    llvm::ArrayRef<std::string> inputs, unsigned numOutputs,
                                    llvm::ArrayRef<onnx::AttributeProto> attrs = {},
                                    llvm::StringRef outName = "");

  /// Single-output addNodeN.
  std::string addNode(llvm::StringRef opType, llvm::StringRef scope,
                      llvm::ArrayRef<std::string> inputs,
                      llvm::ArrayRef<onnx::AttributeProto> attrs = {},
                      llvm::StringRef outName = "") {
    return addNodeN(opType, scope, inputs, 1, attrs, outName)[0];
  }

  /// Adds a Constant node holding \p tensor.
  std::string constant(llvm::StringRef scope, onnx::TensorProto tensor);

  /// Adds an int64 Constant of shape \p dims (a scalar when empty).
  std::string constInts(llvm::StringRef scope, llvm::ArrayRef<int64_t> dims,
                        llvm::ArrayRef<int64_t> values);

  /// Adds a 1-D int64 Constant.
  std::string constVector(llvm::StringRef scope, llvm::ArrayRef<int64_t> values) {
    return constInts(scope, {int64_t(values.size())}, values);
  }

  /// Adds a scalar float Constant.
  std::string constFloat(llvm::StringRef scope, float value);

  /// Adds a pseudo-random float weight and returns the value to consume: the
  /// initializer itself, or with fp16Weights the output of its Cast to float.
  /// Each weight is seeded from the options' seed and its own name.
  std::string addWeight(llvm::StringRef name, llvm::ArrayRef<int64_t> dims,
                        Init kind = Init::Normal);

  /// With lightWeights: a ConstantOfShape fill named \p name instead of an
  /// initializer, as ONNX's "light" test models store their weights.
  std::string addFill(llvm::StringRef name, llvm::ArrayRef<int64_t> dims, int32_t elemType,
                      float value);

  /// Adds a float32 initializer with fixed contents (masks, rotary tables).
  std::string addBuffer(llvm::StringRef name, llvm::ArrayRef<int64_t> dims,
                        llvm::ArrayRef<float> values);

  /// Adds a BOOL initializer with fixed contents, one byte (0 or 1) each.
  std::string addBoolBuffer(llvm::StringRef name, llvm::ArrayRef<int64_t> dims,
                            llvm::ArrayRef<uint8_t> values);

  /// Declares a graph input; kBatch in \p dims is the batch dimension.
  void addInput(llvm::StringRef name, int32_t elemType, llvm::ArrayRef<int64_t> dims);

  /// Declares a graph output; kBatch in \p dims is the batch dimension.
  void addOutput(llvm::StringRef name, int32_t elemType, llvm::ArrayRef<int64_t> dims);

  /// Returns an int64 shape [batch, Rest...] for a Reshape. With a symbolic
  /// batch it is read from dimension 0 of \p like as torch does (Shape,
  /// Gather, Unsqueeze, Concat); otherwise it is a Constant.
  std::string batchShape(llvm::StringRef scope, const std::string &like,
                         llvm::ArrayRef<int64_t> rest);

  /// The shared [1, 1, seq, seq] additive causal mask (0 on and below the
  /// diagonal, float lowest above), created on first use.
  std::string causalMask();

private:
  std::string uniqueName(std::string base);

  void fillValueInfo(onnx::ValueInfoProto &vi, llvm::StringRef name, int32_t elemType,
                     llvm::ArrayRef<int64_t> dims);

  onnx::GraphProto &graph;
  const GeneratorOptions &options;
  llvm::StringMap<unsigned> nameCounts;
  std::string causalMaskName;
};

} // namespace pipec::models

#endif // PIPEC_MODELS_GRAPHBUILDER_H
