//===- Kernels.h - Forward CPU kernels for ONNX operators ---------------===//
//
// runOp() evaluates one ONNX node on host tensors, following the operator
// specifications of opsets 7 to 17 (attributes that became inputs, such as
// Squeeze axes or Slice starts, are read from whichever the node carries).
// Broadcasting is numpy's wherever ONNX has it. Float and double GEMMs (MatMul,
// Gemm, Conv through im2col) go to OpenBLAS, which threads them; every other
// kernel is a plain single-threaded loop.
//
// Besides the default domain, runOp evaluates the onnxruntime contrib ops
// that transformer exporters emit (com.microsoft Attention, MultiHeadAttention,
// RotaryEmbedding, SkipLayerNormalization, ...; SimplifiedLayerNormalization
// in the default domain, where onnxruntime registers it); their kernels live
// in ContribKernels.cpp.
//
// Half types (float16, bfloat16) are computed in float and rounded to their
// type at the end, as numpy does. Ops, attributes and element types outside
// what is implemented give an UnsupportedError; malformed nodes or inputs
// (bad shapes, out-of-range indices, mismatched element types) a plain
// StringError. Both name the node and the op; neither ever aborts.
//
// Gradient kernels are meant to sit next to these in their own files and reuse
// the building blocks at the end of this header (broadcasting, sum-to-shape,
// GEMM, transpose).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_CPU_KERNELS_H
#define PIPEC_RUNTIME_CPU_KERNELS_H

#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>
#include <utility>
#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec::cpu {

/// The error for an op, attribute value or element type that the CPU kernels
/// do not implement (as opposed to a malformed node). Its message reads
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

/// How errors name \p node: its name, else its first output, else "<unnamed>".
std::string nodeLabel(const onnx::NodeProto &node);

/// True if runOp has a kernel for \p opType in \p domain ("" or "ai.onnx",
/// or "com.microsoft" for the contrib ops). A supported op can still return
/// UnsupportedError for a rare attribute, layout or element type.
bool isSupported(llvm::StringRef opType, llvm::StringRef domain = "");

/// The default-domain op types runOp implements, sorted.
std::vector<std::string> supportedOps();

/// The onnxruntime contrib ops runOp implements, as (domain, op type) pairs
/// in a fixed order; the domain is "" for SimplifiedLayerNormalization.
std::vector<std::pair<std::string, std::string>> contribOps();

/// Evaluates \p node under the default-domain opset \p opset.
///
/// \p inputs holds one pointer per node input, in order; nullptr marks an
/// omitted optional input (an empty name in the node). Trailing omitted
/// inputs may be left out. Inputs are not modified.
///
/// Returns one Tensor per node output. An output may share storage with an
/// input (Identity, Reshape, Squeeze, ... return views); outputs the node
/// omits (empty names) may be null Tensors.
llvm::Expected<std::vector<Tensor>> runOp(const onnx::NodeProto &node, int64_t opset,
                                          llvm::ArrayRef<const Tensor *> inputs);

/// True if \p opType in \p domain is one of contribOps().
bool isContribOp(llvm::StringRef opType, llvm::StringRef domain);

/// Evaluates a contrib op (isContribOp) as runOp does, before runOp's common
/// checks on outputs and its half-precision rounding; runOp calls it.
llvm::Expected<std::vector<Tensor>> runContribOp(const onnx::NodeProto &node,
                                                 llvm::ArrayRef<const Tensor *> inputs);

//===----------------------------------------------------------------------===//
// Building blocks shared with other kernels
//===----------------------------------------------------------------------===//

/// The numpy broadcast of two shapes, or an error naming both.
llvm::Expected<std::vector<int64_t>> broadcastShapes(llvm::ArrayRef<int64_t> a,
                                                     llvm::ArrayRef<int64_t> b);

/// Sums \p tensor over the dimensions along which \p shape was broadcast to
/// it, giving a tensor of \p shape: the gradient of a broadcast. \p shape
/// must broadcast to tensor's shape.
Tensor sumToShape(const Tensor &tensor, llvm::ArrayRef<int64_t> shape);

/// \p tensor with its dimensions permuted: output dim i is input dim perm[i].
Tensor transpose(const Tensor &tensor, llvm::ArrayRef<int64_t> perm);

/// Row-major C = alpha * op(A) * op(B) + beta * C with op(A) m x k and op(B)
/// k x n; float and double go to OpenBLAS. With beta == 0, C is not read.
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc);
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double *a,
          int64_t lda, const double *b, int64_t ldb, double beta, double *c, int64_t ldc);

/// Caps the threads one GEMM may use (OpenBLAS's pool; a no-op with another
/// BLAS). Ranks that run as threads of one process share the cores, so each
/// gets its share instead of every rank's GEMM spinning up all of them.
void setBlasThreads(int threads);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_KERNELS_H
