//===- Layers.h - Layers the model families share ------------------------===//
//
// torch modules as torch.onnx.export writes them, built on a GraphBuilder:
// linear and Gemm projections, norms, GELU, attention, the LM head and the
// cross-entropy loss.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MODELS_LAYERS_H
#define PIPEC_MODELS_LAYERS_H

#include "models/GraphBuilder.h"

namespace pipec::models {

/// x @ W (+ b) with W [In, Out] named "<module>.weight".
std::string linear(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                   bool bias, llvm::StringRef outName = "");

/// torch.nn.Linear on a 2-D input: Gemm(x, W [Out, In], b, transB=1).
std::string gemm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t in, int64_t out,
                 llvm::StringRef outName = "");

/// LayerNorm over the last axis: the LayerNormalization op from opset 17,
/// torch's decomposition (ReduceMean, Sub, Pow, Sqrt, Div) before.
std::string layerNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width,
                      float eps);

/// Llama RMSNorm: w * (x * 1 / sqrt(mean(x^2) + eps)).
std::string rmsNorm(GraphBuilder &g, const Mod &m, const std::string &x, int64_t width, float eps);

/// Exact GELU as torch exports it: x * (1 + erf(x / sqrt(2))) * 0.5.
std::string gelu(GraphBuilder &g, llvm::StringRef scope, const std::string &x);

/// [B, S, Heads * Dim] -> Reshape [B, S, Heads, Dim] -> Transpose(Perm).
std::string splitHeads(GraphBuilder &g, llvm::StringRef scope, const std::string &x, int64_t heads,
                       int64_t dim, llvm::ArrayRef<int64_t> perm);

/// softmax(Q K^T / sqrt(Dim) + Mask) V with Q, V [B, H, S, Dim] and
/// KT [B, H, Dim, S]; returns the heads merged back to [B, S, H * Dim].
std::string attention(GraphBuilder &g, llvm::StringRef scope, const std::string &q,
                      const std::string &kt, const std::string &v, const std::string &mask,
                      int64_t heads, int64_t dim);

/// SoftmaxCrossEntropyLoss (mean, ignore_index -100) as the "loss" output.
void crossEntropy(GraphBuilder &g, const std::string &logits, const std::string &labels);

/// The LM head producing "logits" [B, S, V] (and the loss): MatMul with its
/// own weight, or with the Transpose of the token embedding when tied.
void lmHead(GraphBuilder &g, const std::string &x, const std::string &embedding, int64_t width);

/// Position ids 0..seq-1 as an int64 [1, seq] Constant.
std::string positionIds(GraphBuilder &g, llvm::StringRef scope);

} // namespace pipec::models

#endif // PIPEC_MODELS_LAYERS_H
