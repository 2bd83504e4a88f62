//===- FoldContext.h - What an op's evaluator sees, and the evaluators ----===//
//
// evaluateOp (passes/ConstantEvaluator.cpp) picks the evaluator of an op by
// its row of ops/Ops.def and runs it on a FoldContext: the graph, the op and
// its node, the constant inputs, and the most elements a result may have. An
// evaluator returns its result through done(), std::nullopt when the result
// would be too large, or an error naming the op (fail, wrap).
//
// The evaluators, by family:
//   ShapeFolds.cpp     constant, identity, cast, shapeOrSize, unsqueeze,
//                      squeeze, reshape, flatten, constantOfShape, range
//   MovementFolds.cpp  gather, concat, slice, expand, tile, transpose, where
//   MathFolds.cpp      binary, unary, reduce
// and the tensor helpers they share, in FoldContext.cpp.
//
// Before:  Unsqueeze(data = [2, 3] of I64, axes = [0])
// After:   fold::unsqueeze gives [1, 2, 3], the same elements
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_FOLD_FOLDCONTEXT_H
#define PIPEC_PASSES_FOLD_FOLDCONTEXT_H

#include "compiler/ir/Graph.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <array>
#include <functional>
#include <optional>
#include <vector>

namespace pipec {

struct OpDef;

namespace fold {

/// The outputs of an evaluated op; std::nullopt when one would have more
/// elements than allowed.
using FoldResult = llvm::Expected<std::optional<std::vector<ConstTensor>>>;

/// An error "GRAPH: OP: WHY" naming \p op of \p graph.
llvm::Error invalid(const Graph &graph, const Op &op, const llvm::Twine &why);

/// One op being evaluated. It borrows everything it names, for the length of
/// one evaluateOp call.
struct FoldContext {
  const Graph &graph;
  const Op &op;
  const onnx::NodeProto &node;
  /// The op's row of Ops.def.
  const OpDef &def;
  /// The constant inputs; nullptr for an omitted optional input.
  llvm::ArrayRef<const ConstTensor *> inputs;
  int64_t maxElements;

  /// Input \p i; an error naming the op when it is omitted.
  llvm::Expected<const ConstTensor *> need(size_t i) const;
  /// Inputs 0 to N - 1; the error of the first omitted one.
  template <size_t N> llvm::Expected<std::array<const ConstTensor *, N>> needInputs() const {
    std::array<const ConstTensor *, N> out;
    for (size_t i = 0; i < N; ++i) {
      llvm::Expected<const ConstTensor *> input = need(i);
      if (!input)
        return input.takeError();
      out[i] = *input;
    }
    return out;
  }
  /// \p t as the op's one output; std::nullopt when it has more than
  /// maxElements elements.
  FoldResult done(ConstTensor t) const;
  /// An error naming the op: \p why.
  llvm::Error fail(const llvm::Twine &why) const;
  /// \p err, consumed, as an error naming the op.
  llvm::Error wrap(llvm::Error err) const;
};

/// Computes the outputs of ctx.op.
using Evaluator = FoldResult (*)(const FoldContext &ctx);
/// The FOLD token of an op that is never folded.
inline constexpr Evaluator none = nullptr;

// ShapeFolds.cpp
FoldResult constant(const FoldContext &ctx);
FoldResult identity(const FoldContext &ctx);
FoldResult cast(const FoldContext &ctx);
FoldResult shapeOrSize(const FoldContext &ctx);
FoldResult unsqueeze(const FoldContext &ctx);
FoldResult squeeze(const FoldContext &ctx);
FoldResult reshape(const FoldContext &ctx);
FoldResult flatten(const FoldContext &ctx);
FoldResult constantOfShape(const FoldContext &ctx);
FoldResult range(const FoldContext &ctx);
// MovementFolds.cpp
FoldResult gather(const FoldContext &ctx);
FoldResult concat(const FoldContext &ctx);
FoldResult slice(const FoldContext &ctx);
FoldResult expand(const FoldContext &ctx);
FoldResult tile(const FoldContext &ctx);
FoldResult transpose(const FoldContext &ctx);
FoldResult where(const FoldContext &ctx);
// MathFolds.cpp
FoldResult binary(const FoldContext &ctx);
FoldResult unary(const FoldContext &ctx);
FoldResult reduce(const FoldContext &ctx);

// Tensor helpers (FoldContext.cpp) ------------------------------------------

/// The product of \p dims (1 for none).
inline int64_t product(llvm::ArrayRef<int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

/// \p axis counted from the front when negative; not range-checked.
inline int64_t normalizeAxis(int64_t axis, int64_t rank) { return axis < 0 ? axis + rank : axis; }

/// Row-major strides of \p shape, in elements.
std::vector<int64_t> stridesOf(llvm::ArrayRef<int64_t> shape);

/// A zero tensor of \p type and \p shape.
ConstTensor makeLike(DType type, std::vector<int64_t> shape);

/// Copies element \p from of \p src into element \p to of \p dst (same type).
inline void copyElement(const ConstTensor &src, int64_t from, ConstTensor &dst, int64_t to) {
  if (src.isFloat())
    dst.floats[to] = src.floats[from];
  else
    dst.ints[to] = src.ints[from];
}

/// Gathers elements: out[i] = src[index(i)], \p shape the shape of out.
ConstTensor gatherElements(const ConstTensor &src, std::vector<int64_t> shape,
                           const std::function<int64_t(int64_t)> &index);

/// The shape \p a and \p b broadcast to (numpy rules); an error when they
/// do not broadcast.
llvm::Expected<std::vector<int64_t>> broadcastShapes(llvm::ArrayRef<int64_t> a,
                                                     llvm::ArrayRef<int64_t> b);

/// Index into \p shape (right-aligned in \p outShape) of flat output
/// element \p i.
inline int64_t broadcastIndex(int64_t i, llvm::ArrayRef<int64_t> outShape,
                              llvm::ArrayRef<int64_t> outStrides, llvm::ArrayRef<int64_t> shape,
                              llvm::ArrayRef<int64_t> strides) {
  int64_t index = 0;
  size_t offset = outShape.size() - shape.size();
  for (size_t d = 0; d < outShape.size(); ++d) {
    int64_t coord = (i / outStrides[d]) % outShape[d];
    if (d >= offset && shape[d - offset] != 1)
      index += coord * strides[d - offset];
  }
  return index;
}

/// \p src broadcast to \p shape (which it must broadcast to).
ConstTensor broadcastTo(const ConstTensor &src, llvm::ArrayRef<int64_t> shape);

/// \p src converted element by element to \p type.
ConstTensor castTo(const ConstTensor &src, DType type);

/// The elements of \p t as integers (floats are truncated).
std::vector<int64_t> intsOf(const ConstTensor &t);

/// The op's axes: its "axes" attribute (older opsets) or else its input
/// \p input (newer ones); std::nullopt when it has neither.
std::optional<std::vector<int64_t>> axesOf(const FoldContext &ctx, size_t input);

} // namespace fold
} // namespace pipec

#endif // PIPEC_PASSES_FOLD_FOLDCONTEXT_H
