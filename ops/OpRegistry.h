//===- OpRegistry.h - What pipec knows about an op -----------------------===//
//
// The registry is ops/Ops.def: one row per (domain, op, first opset). This
// header gives the row-level facts to every floor: how an op is looked up,
// its arity, its flags, and whether each floor implements it. The
// implementations themselves live with their floor, in tables each floor
// builds from the same rows (a column per floor; Ops.def lists them), so no
// floor keeps a list of ops of its own and none can drift from another.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_OPREGISTRY_H
#define PIPEC_OPS_OPREGISTRY_H

#include "ops/ElemOp.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"

#include <cstdint>
#include <optional>

namespace pipec {

/// The domains of Ops.def's rows.
enum class OpDomain : uint8_t {
  Onnx,      ///< "" or "ai.onnx"
  Microsoft, ///< "com.microsoft": onnxruntime's contrib ops
  Pipec,     ///< "pipec": gradients and fused nodes pipec makes
};

/// One code per row of Ops.def, in its order.
enum class OpId : uint16_t {
#define PIPEC_OP(ID, ...) ID,
#include "ops/Ops.def"
};

/// Ops.def's FLAGS.
enum OpFlags : uint16_t {
  NoFlags = 0,
  /// A fused element-wise node may take it (beyond the element-wise rows,
  /// whose math decides).
  Fuse = 2,
  /// It runs subgraphs (If, Loop, Scan): pipec keeps it as one opaque op.
  Subgraph = 4,
  /// An input computed from initializers and constants alone (no graph input
  /// reaches it) is a table the op reads, not something it trains: rotary
  /// frequencies feed Sin and Cos, and exporters keep them as initializers
  /// although frameworks register them as buffers. No gradient flows into
  /// such an input.
  Table = 8,
  /// It draws random numbers: never computed ahead of a run (Dropout).
  Random = 16,
  /// It passes its first input's elements on in order with their values
  /// (Reshape, Squeeze, Cast): an index read through it is the same index.
  SameElements = 32,
  /// It moves elements without computing new ones (Slice, Transpose,
  /// Concat): an index read through it is still an index into the same table.
  MovesElements = 64,
  /// It communicates over the tensor-parallel ranks of its stage
  /// (TpAllReduce, TpCopy): the executor, which holds the ranks' Comm,
  /// runs it where the op is not the identity.
  Collective = 128,
  /// Under autocast (passes/Autocast.h) it runs on bf16 and writes bf16:
  /// torch.autocast's list of ops that autocast to lower precision on CUDA
  /// (matrix products, convolutions, attention).
  LowPrecision = 256,
  /// Under autocast it runs on float32: torch.autocast's list of ops that
  /// autocast to float32 on CUDA (exp, log, pow, softmax, the norms, sums,
  /// the losses).
  FullPrecision = 512,
};

/// What the differentiate pass knows about an op's gradient.
enum class GradKind : uint8_t {
  Rule,    ///< a rule of passes/grad/
  None,    ///< no gradient flows (integer or bool results, or zero)
  Missing, ///< differentiable, but there is no rule yet
};

/// One row of Ops.def.
struct OpDef {
  OpId id;
  OpDomain domain;
  llvm::StringLiteral name;
  int since;
  int minInputs;
  /// -1: variadic (every input required).
  int maxInputs;
  uint16_t flags;
  GradKind grad;
  bool hasCpuKernel;
  bool hasDeviceKernel;
  /// Constant folding evaluates it on compile-time values (FOLD is not none).
  bool foldable;
  /// The element-wise code of PIPEC_ELEMENTWISE rows.
  std::optional<ElemOp> elem;

  bool isVariadic() const { return maxInputs < 0; }
  bool has(OpFlags flag) const { return (flags & flag) != 0; }
  /// The domain as a node spells it: "", "com.microsoft" or "pipec".
  llvm::StringRef domainName() const;
};

/// Every row, in Ops.def's order (indexable by OpId).
llvm::ArrayRef<OpDef> allOps();
const OpDef &opDef(OpId id);
const OpDef &opDef(ElemOp op);

/// The domain of a node's domain string; nullopt for domains pipec does not
/// know (ai.onnx.ml, custom ones).
std::optional<OpDomain> opDomainOf(llvm::StringRef domain);

/// The row for op \p name of \p domain at \p opset (the row with the
/// largest first opset <= \p opset, or the first row when the op is newer
/// than \p opset); null when no row names it.
const OpDef *lookupOp(llvm::StringRef domain, llvm::StringRef name, int64_t opset = 0);

/// True when an op of \p type in \p domain is row \p id's op. Passes and
/// kernels ask this, or Op::is and OpContext::is, instead of spelling names.
bool isOp(llvm::StringRef domain, llvm::StringRef type, OpId id);

/// isOp for any node that has domain() and op_type() (onnx::NodeProto).
template <class Node> bool isOp(const Node &node, OpId id) {
  return isOp(node.domain(), node.op_type(), id);
}

} // namespace pipec

#endif // PIPEC_OPS_OPREGISTRY_H
