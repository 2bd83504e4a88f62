//===- Kernels.h - Forward CPU kernels for ONNX operators ---------------===//
//
// runOp() evaluates one node on host tensors, following the operator
// specifications (attributes that became inputs, such as Squeeze axes or
// Slice starts, are read from whichever the node carries). Which kernel runs
// an op is the CPU column of its row in ops/Ops.def; KernelTable.h lists the
// kernels and the files that hold them.
// Broadcasting is numpy's wherever ONNX has it. Float and double GEMMs (MatMul,
// Gemm, Conv through im2col) go to OpenBLAS, which threads them; every other
// kernel is a plain single-threaded loop.
//
// Besides the default domain, runOp evaluates the onnxruntime contrib ops
// that transformer exporters emit (com.microsoft Attention, RotaryEmbedding,
// SkipLayerNormalization, ...) and pipec's own gradient and fused ops.
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

#include "runtime/core/OpContext.h"
#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <string>
#include <utility>
#include <vector>

namespace onnx {
class NodeProto;
} // namespace onnx

namespace pipec::cpu {

// The error kernels give for what they do not implement, and how errors
// name a node (runtime/core/OpContext.h).
using pipec::nodeLabel;
using pipec::UnsupportedError;

/// True if the CPU has a kernel for \p opType in \p domain (the registry's
/// row says so). A supported op can still return UnsupportedError for a rare
/// attribute, layout or element type.
bool isSupported(llvm::StringRef opType, llvm::StringRef domain = "");

/// Evaluates \p node, of any domain pipec knows (the default one,
/// com.microsoft, pipec), under the default-domain opset \p opset.
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
/// The same, \p row being the node's row of ops/Ops.def, found once by the
/// caller (one with a CPU kernel); null: looked up here. \p attrs, when
/// given, keeps what the kernel parsed of the node's attributes from one
/// run to the next (OpContext::parsed).
llvm::Expected<std::vector<Tensor>> runOp(const onnx::NodeProto &node, int64_t opset,
                                          llvm::ArrayRef<const Tensor *> inputs, const OpDef *row,
                                          ParsedAttrs *attrs = nullptr);

//===----------------------------------------------------------------------===//
// Building blocks shared with other kernels
//===----------------------------------------------------------------------===//

/// Sums \p tensor over the dimensions along which \p shape was broadcast to
/// it, giving a tensor of \p shape: the gradient of a broadcast. \p shape
/// must broadcast to tensor's shape.
Tensor sumToShape(const Tensor &tensor, llvm::ArrayRef<int64_t> shape);

/// \p tensor with its dimensions permuted: output dim i is input dim perm[i].
Tensor transpose(const Tensor &tensor, llvm::ArrayRef<int64_t> perm);

/// The \p rows x \p cols floats at \p in (rows \p ldIn apart) transposed
/// to \p out (its rows \p ldOut apart): out[j * ldOut + i] = in[i * ldIn +
/// j], 8 x 8 blocks through registers where the CPU has AVX2. Serial.
void transposeFloats(const float *in, int64_t rows, int64_t cols, int64_t ldIn, float *out,
                     int64_t ldOut);

/// Row-major C = alpha * op(A) * op(B) + beta * C with op(A) m x k and op(B)
/// k x n; float and double go to OpenBLAS, in bands over the calling thread's
/// loop threads (support/Parallel.h). With beta == 0, C is not read.
///
/// When \p prepare is given, gemm first calls prepare(r0, r1, c0, c1) to
/// write C's rows [r0, r1) and columns [c0, c1), on the thread that then
/// computes that block (Gemm's C, broadcast into Y where the product reads
/// it, instead of in a pass of its own).
using GemmPrepare = llvm::function_ref<void(int64_t, int64_t, int64_t, int64_t)>;
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc,
          GemmPrepare prepare = nullptr);
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, double alpha, const double *a,
          int64_t lda, const double *b, int64_t ldb, double beta, double *c, int64_t ldc,
          GemmPrepare prepare = nullptr);

/// Caps the threads one BLAS call may use (its pool, process-wide). A
/// run sets 1: gemm cuts a rank's GEMMs into bands over the rank's loop
/// threads (support/Parallel.h) instead, so the BLAS's pool never spins on
/// a core between GEMMs.
void setBlasThreads(int threads);

} // namespace pipec::cpu

#endif // PIPEC_RUNTIME_CPU_KERNELS_H
