//===- OpContext.h - One node under evaluation, for every backend --------===//
//
// A kernel, CPU or CUDA, sees its node through an OpContext: the node's
// inputs (nullptr for an omitted optional one), typed access to its
// attributes, the registry's row for its op, and errors that name the node
// and op ("node 'NAME' (OP): ..."). Two kinds of error: fail() for a
// malformed node or input, unsupported() (an UnsupportedError) for
// something valid that the kernel does not implement; callers tell them
// apart to fall back or to report.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CORE_OPCONTEXT_H
#define PIPEC_RUNTIME_CORE_OPCONTEXT_H

#include "math/ElementMath.h"
#include "ops/OpRegistry.h"
#include "ops/Window.h"
#include "runtime/core/Tensor.h"
#include "support/Diagnostics.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace onnx {
class AttributeProto;
class NodeProto;
} // namespace onnx

namespace pipec {

/// The error for an op, attribute value or element type that a kernel does
/// not implement (as opposed to a malformed node). Its message reads
/// "node 'NAME' (OP): DETAIL".
class UnsupportedError : public llvm::ErrorInfo<UnsupportedError> {
public:
  static char ID;
  UnsupportedError(std::string node, std::string opType, std::string detail)
      : node(std::move(node)), opType(std::move(opType)), detail(std::move(detail)) {}
  void log(llvm::raw_ostream &os) const override;
  std::error_code convertToErrorCode() const override;
  /// The node's label (its name, else its first output).
  const std::string &nodeLabel() const { return node; }
  const std::string &op() const { return opType; }
  /// What is missing, without the node: "element type string of input 0".
  const std::string &what() const { return detail; }

private:
  std::string node, opType, detail;
};

/// What a kernel read from its node's attributes, kept with a prepared node
/// (the executor's node lists) between its runs, so that the node's
/// attributes are read once: OpContext::parsed.
class ParsedAttrs {
private:
  friend class OpContext;
  /// The call site that made value.
  const void *site = nullptr;
  std::shared_ptr<const void> value;
};

class OpContext {
public:
  using Shape = std::vector<int64_t>;

  /// \p def is the registry's row for the node's op, when it has one;
  /// \p kept, where the node is run more than once, keeps what parsed() read.
  OpContext(const onnx::NodeProto &node, int64_t opset, llvm::ArrayRef<const cpu::Tensor *> inputs,
            const OpDef *def = nullptr, ParsedAttrs *kept = nullptr)
      : node(node), opset(opset), def(def), inputs(inputs), kept(kept) {}

  const onnx::NodeProto &node;
  /// The default-domain opset the node runs under.
  const int64_t opset;
  const OpDef *const def;

  llvm::StringRef op() const;
  /// True when the node is Ops.def's row \p id.
  bool is(OpId id) const { return def && def->id == id; }
  /// Input \p i, or nullptr when the node omits it.
  const cpu::Tensor *optInput(size_t i) const {
    return i < inputs.size() && inputs[i] && !inputs[i]->isNull() ? inputs[i] : nullptr;
  }
  /// Input \p i; runOp has checked that every required input is present.
  const cpu::Tensor &input(size_t i) const { return *inputs[i]; }
  llvm::ArrayRef<const cpu::Tensor *> allInputs() const { return inputs; }
  size_t numInputs() const { return inputs.size(); }
  size_t numOutputs() const;
  /// True if the node names output \p i (optional outputs may be skipped).
  bool wantsOutput(size_t i) const;

  const onnx::AttributeProto *attr(llvm::StringRef name) const;
  int64_t attrInt(llvm::StringRef name, int64_t otherwise) const;
  float attrFloat(llvm::StringRef name, float otherwise) const;
  std::string attrString(llvm::StringRef name, llvm::StringRef otherwise) const;
  std::optional<Shape> attrInts(llvm::StringRef name) const;
  /// \p parse(), a T made from the node's attributes alone (no input), read
  /// on the node's first run and kept after it where the node has a
  /// ParsedAttrs; read on every call where it has none. A kernel calls it
  /// once per run (a second call site would replace the first's value).
  template <typename T, typename Parse> T parsed(Parse parse) const {
    static const char site = 0;
    if (!kept)
      return parse();
    if (kept->site != &site) {
      kept->value = std::make_shared<const T>(parse());
      kept->site = &site;
    }
    return *static_cast<const T *>(kept->value.get());
  }
  /// An integer list that ONNX moved from attribute \p name to input \p i in
  /// some opset (Squeeze axes, Slice starts, Split sizes): the input when the
  /// node has it (a host tensor), else the attribute, else nullopt.
  std::optional<Shape> intsFromInputOrAttr(size_t i, llvm::StringRef name) const;
  /// The node's window attributes over \p rank spatial dimensions
  /// (ops/Window.h), or an error naming the node.
  llvm::Expected<WindowAttrs> windowAttrs(int64_t rank) const;
  /// The attributes the element math of \p op reads; an error naming the
  /// node when they are invalid. Read through parsed(): an element-wise
  /// kernel reads nothing else that way.
  llvm::Expected<kernels::ElemParams> elemParams(ElemOp op) const;

  /// A malformed node or input.
  llvm::Error fail(const llvm::Twine &message) const;
  /// Something valid that the kernel does not implement.
  llvm::Error unsupported(const llvm::Twine &message) const;
  llvm::Error unsupportedType(const cpu::Tensor &t, size_t inputIndex) const;
  /// Checks that inputs \p i and \p j have one element type.
  llvm::Error sameType(size_t i, size_t j) const;
  /// Checks that input \p i is absent or has input 0's element type.
  llvm::Error sameTypeAsFirst(size_t i) const;
  /// Checks that input \p i is absent or holds integers (ids, masks).
  llvm::Error integerInput(size_t i, llvm::StringRef what) const;
  /// \p axis in [-rank, rank) made non-negative, or an error naming it.
  llvm::Expected<int64_t> normalizeAxis(int64_t axis, int64_t rank,
                                        llvm::StringRef what = "axis") const;

private:
  llvm::ArrayRef<const cpu::Tensor *> inputs;
  ParsedAttrs *kept;
};

} // namespace pipec

#endif // PIPEC_RUNTIME_CORE_OPCONTEXT_H
