//===- Families.h - One builder per model family -------------------------===//
//
// Each lays out its architecture on a GraphBuilder (graph inputs, weights,
// nodes, outputs and, with withLoss, the loss) as ModelGenerators.h
// describes it; each lives in its own file (Gpt.cpp, Llama.cpp, ...).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_MODELS_FAMILIES_H
#define PIPEC_MODELS_FAMILIES_H

#include "models/GraphBuilder.h"

namespace pipec::models {

/// GPT-2 as torch.onnx.export traces HF's GPT2LMHeadModel: pre-LN blocks of
/// GPT2Attention and a gelu_new MLP, every projection a Conv1D; HF module
/// and parameter names.
void buildGpt(GraphBuilder &g);

/// Llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.
void buildLlama(GraphBuilder &g);

/// BERT encoder with pooler and a 2-class sequence classifier.
void buildBert(GraphBuilder &g);

/// input_proj, `layers` x (Gemm + Relu), head; MSE loss.
void buildMlp(GraphBuilder &g);

/// torchvision ResNet v1.5 with bottleneck blocks.
void buildResnet(GraphBuilder &g);

} // namespace pipec::models

#endif // PIPEC_MODELS_FAMILIES_H
