//===- GradContext.h - What a gradient rule sees and emits ---------------===//
//
// The differentiate pass walks the ops from the loss back; for each op whose
// output gradients are complete it runs the op's rule (GradRules.h) on a
// GradContext. The context is the backward program under construction (its
// node lists, fresh names, the contributions to each value's gradient) and
// the op at hand: its inputs and output as the node names them, their
// shapes, the gradient dY of its output, and which inputs want a gradient.
//
// A rule emits nodes (emit and the helpers built on it) into the current
// list and records each input's gradient with contribute(i, name); the
// context names it "grad:V#K" and sums the contributions later. forEachWanted
// selects, per wanted input, the list its gradient belongs to (W for a
// weight, I otherwise), so a rule only says what to compute.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GRAD_GRADCONTEXT_H
#define PIPEC_PASSES_GRAD_GRADCONTEXT_H

#include "ops/Window.h"
#include "passes/Differentiate.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace pipec {

struct OpDef;

namespace grad {

struct GradRule;

/// One differentiate run's backward program under construction, and the op
/// whose rule runs (beginOp). Not copyable: rules get it by reference.
class GradContext {
public:
  /// Emits into \p result, whose per-layer lists must be sized already.
  /// \p needsGrad (per value: it depends on a trainable value) must outlive
  /// the context.
  GradContext(const Graph &graph, Backward &result, const std::vector<bool> &needsGrad);
  GradContext(const GradContext &) = delete;
  GradContext &operator=(const GradContext &) = delete;

  /// The graph being differentiated.
  const Graph &graph;
  const Value &val(int id) const { return graph.values[id]; }

  // --- Where nodes go -------------------------------------------------------

  void setLayer(int layer) { layerIndex = layer; }
  int layer() const { return layerIndex; }
  /// Selects the list of the current layer that a contribution to value
  /// \p id belongs to: W for a weight, I otherwise, and I for a value
  /// computed from weights that other layers read (setCrossing): its
  /// gradient crosses stages with the activations' (T5's position bias,
  /// made in the first block and added in every block).
  void sinkFor(int id);
  /// Per value: computed from weights alone and read by layers other than
  /// the one that computes it.
  void setCrossing(std::vector<bool> crossing) { crossingDerived = std::move(crossing); }
  /// Per op of the graph, the layer it is in.
  void setOpLayers(std::vector<int> layers) { opLayers = std::move(layers); }
  /// The list the next nodes go to (forEachWanted's choice for the input at
  /// hand): a rule that computes several inputs' gradients in one node
  /// makes one per list.
  const std::vector<onnx::NodeProto> &currentList() const { return *sink; }
  /// Selects \p list (e.g. the loss's forward nodes).
  void sinkTo(std::vector<onnx::NodeProto> &list) { sink = &list; }

  // --- Emitting nodes into the current list ---------------------------------

  /// A node "bwd/N/TYPE" with one fresh output "bwd:N".
  onnx::NodeProto &emit(llvm::StringRef opType, llvm::ArrayRef<std::string> inputs,
                        llvm::StringRef domain = "");
  static std::string out(const onnx::NodeProto &node) { return node.output(0); }
  static void setInt(onnx::NodeProto &node, llvm::StringRef name, int64_t v);
  static void setFloat(onnx::NodeProto &node, llvm::StringRef name, float v);
  static void setString(onnx::NodeProto &node, llvm::StringRef name, llvm::StringRef v);
  static void setInts(onnx::NodeProto &node, llvm::StringRef name, llvm::ArrayRef<int64_t> v);
  /// An int64 vector constant.
  std::string constInts(llvm::ArrayRef<int64_t> values);
  /// A scalar of element type \p type (float or double).
  std::string constScalar(double value, DType type);
  std::string unary(llvm::StringRef opType, const std::string &x, llvm::StringRef domain = "");
  std::string binary(llvm::StringRef opType, const std::string &a, const std::string &b,
                     llvm::StringRef domain = "");
  /// \p grad reduced to \p shape when it was broadcast; as is otherwise.
  std::string sumTo(const std::string &grad, const std::vector<int64_t> &gradShape,
                    const std::vector<int64_t> &shape);
  std::string reshape(const std::string &x, llvm::ArrayRef<int64_t> shape);
  /// Swaps the last two dimensions of a rank-\p rank value.
  std::string transposeLast2(const std::string &x, size_t rank);
  /// \p grad [N, C, d...] summed to the per-channel [C]: the gradient of a
  /// per-channel bias.
  std::string sumToChannels(const std::string &grad, const std::vector<int64_t> &gradShape);
  /// A per-channel [C] value reshaped to [C, 1, ...] so that it broadcasts
  /// over a rank-\p rank value [N, C, d...].
  std::string channelsFirst(const std::string &x, int64_t channels, size_t rank);

  // --- Gradient bookkeeping -------------------------------------------------

  /// Records \p name (made by the last nodes emitted) as a contribution to
  /// value \p id; emits an Identity when \p name is not a fresh output of
  /// the last node (e.g. the output gradient passed through unchanged).
  void addContribution(int id, std::string name);
  /// Records \p statistic (made by the last nodes emitted) as one
  /// microbatch's statistic of the running buffer read as input \p i of the
  /// op at hand (see RunningStat).
  void updateRunning(size_t i, std::string statistic, float momentum);
  /// Sums the contributions to \p id into "grad:NAME" in the current list.
  void finalize(int id);
  /// The summed gradient of value \p id, or "" when it has none (yet).
  std::string gradientOf(int id) const;
  /// Per value with contributions, the layers they came from.
  const std::map<int, std::vector<int>> &contributionLayers() const { return contribLayers; }

  // --- The op being differentiated ------------------------------------------

  /// The forward node's window attributes over \p rank spatial dimensions
  /// (ops/Window.h), or an error naming it.
  llvm::Expected<WindowAttrs> windowAttrs(size_t rank) const;

  /// Makes \p op, differentiated by \p rule, the op at hand. \p def is its
  /// row of Ops.def (null when it has none).
  void beginOp(const Op &op, const GradRule &rule, const OpDef *def);
  const Op &op() const { return *current; }
  const OpDef *def() const { return currentDef; }
  const onnx::NodeProto &node() const { return *currentNode; }
  /// True if input \p i exists, depends on a trainable value and carries a
  /// gradient by the op's rule.
  bool wants(size_t i) const;
  /// Runs \p f on every wanted input, with the list selected for it.
  llvm::Error forEachWanted(llvm::function_ref<llvm::Error(size_t)> f);
  /// Runs \p f once if input 0, the data, is wanted: for the ops whose
  /// other inputs (indices, shapes, axes) get no gradient.
  llvm::Error ifDataWanted(llvm::function_ref<llvm::Error()> f);
  /// Input \p i as the node names it (a folded constant's Value may carry
  /// no name of its own).
  const std::string &in(size_t i) const { return currentNode->input(static_cast<int>(i)); }
  /// Output 0 as the node names it.
  const std::string &y() const { return currentNode->output(0); }
  const std::vector<int64_t> &shapeOf(size_t i) const { return val(current->inputs[i]).shape; }
  /// The elements of input \p i as integers when it is a constant (Slice's
  /// starts, Pad's pads); nullopt when it is absent or computed.
  std::optional<std::vector<int64_t>> constantInput(size_t i) const;
  const std::vector<int64_t> &yShape() const { return val(current->outputs[0]).shape; }
  /// The element type of output 0.
  DType type() const { return val(current->outputs[0]).type; }
  /// The gradient of output \p k, or "" when nothing downstream needs it.
  std::string dyOf(size_t k) const;
  /// The gradient of output 0.
  std::string dy() const { return dyOf(0); }
  /// Records \p name as a contribution to input \p i of the op.
  void contribute(size_t i, std::string name) {
    addContribution(current->inputs[i], std::move(name));
  }
  /// The weight W when input \p i is Transpose(W) of a 2-D initializer W
  /// (perm [1, 0]), made in the layer at hand: a product's rule may read W
  /// and let the GEMM read it transposed, so that the transposed copy dies
  /// with the forward. -1 otherwise.
  int transposedWeight(size_t i) const;
  /// W's name as the Transpose of transposedWeight(i) names it.
  const std::string &transposedWeightName(size_t i) const;
  /// "node 'N' (Op): \p what".
  llvm::Error error(const llvm::Twine &what) const;
  /// Sets kernel_shape, strides, dilations and explicit pads on \p g, the
  /// gradient node of the Conv or pool at hand whose input has shape
  /// \p xShape and output \p yShape. auto_pad is resolved here as the
  /// forward kernels resolve it, so the gradient kernels only know explicit
  /// pads.
  llvm::Error setWindowAttrs(onnx::NodeProto &g, llvm::ArrayRef<int64_t> kernel,
                             llvm::ArrayRef<int64_t> xShape, llvm::ArrayRef<int64_t> yShape);

private:
  /// Where one gradient contribution was written, so that a lone
  /// contribution can be renamed to the canonical "grad:V".
  struct Contribution {
    std::vector<onnx::NodeProto> *list;
    size_t index;
    int output = 0; ///< which output of the node it is
  };

  std::string fresh() { return "bwd:" + std::to_string(counter++); }

  Backward &result;
  const std::vector<bool> &needsGrad;
  std::vector<bool> crossingDerived;
  std::vector<int> opLayers;
  std::vector<onnx::NodeProto> *sink = nullptr;
  int layerIndex = 0;
  int counter = 0;
  std::map<int, std::vector<Contribution>> contribs;
  std::map<int, std::vector<int>> contribLayers;
  std::map<int, std::string> finalGrad;
  const Op *current = nullptr;
  const OpDef *currentDef = nullptr;
  const GradRule *currentRule = nullptr;
  const onnx::NodeProto *currentNode = nullptr;
};

} // namespace grad
} // namespace pipec

#endif // PIPEC_PASSES_GRAD_GRADCONTEXT_H
