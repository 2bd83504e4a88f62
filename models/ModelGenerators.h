//===- ModelGenerators.h - Synthetic ONNX model generators ------*- C++ -*-===//
//
// Builds ONNX models shaped like torch.onnx.export output for a handful of
// well-known architectures (GPT-2, Llama, BERT, an MLP and ResNet), with
// deterministic pseudo-random weights, and writes them to disk with optional
// external data. Used to produce test and benchmark inputs for pipec.
//
//===----------------------------------------------------------------------===//

#ifndef PIPEC_MODELS_MODELGENERATORS_H
#define PIPEC_MODELS_MODELGENERATORS_H

#include "onnx/onnx_pb.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>

namespace pipec::models {

/// The architectures the generator knows.
enum class Family { Gpt, Llama, Bert, Mlp, Resnet };

/// Parses "gpt", "llama", "bert", "mlp" or "resnet" (case-insensitive). The
/// error names the bad value.
llvm::Expected<Family> parseFamily(llvm::StringRef name);

/// Returns the lowercase name of \p family ("gpt", ...).
llvm::StringRef familyName(Family family);

/// Knobs of a generated model. Graph interfaces per family (B is the batch
/// dimension, a symbolic "batch" when batch == 0):
///  - gpt, llama: input_ids int64 [B, seq] -> logits float [B, seq, vocab].
///  - bert: input_ids, attention_mask int64 [B, seq] -> logits float [B, 2]
///    (sequence classifier on the pooled first token).
///  - mlp: x float [B, vocab] -> input_proj (vocab -> hidden), `layers`
///    blocks of Gemm (hidden -> hidden) + Relu, head (hidden -> vocab) ->
///    y float [B, vocab].
///  - resnet: images float [B, 3, seq, seq] -> logits float [B, vocab].
/// With withLoss there is also an input "labels" (int64 [B, seq] for gpt and
/// llama, int64 [B] for bert and resnet, float [B, vocab] for mlp) and an
/// output "loss" (float scalar).
struct GeneratorOptions {
  GeneratorOptions() = default;
  /// A \p family model of these sizes, every other knob at its default: the
  /// sizes the tests and benchmarks choose. mlp has no sequence and no heads,
  /// resnet no heads (\p seq is its image side).
  GeneratorOptions(Family family, int layers, int hidden, int vocab, int seq = 16, int heads = 4)
      : family(family), layers(layers), hidden(hidden), heads(heads), vocab(vocab), seq(seq) {}

  Family family = Family::Gpt;
  /// Transformer blocks / MLP hidden layers / ResNet bottleneck blocks in
  /// total (16 = ResNet-50 layout 3,4,6,3; other values are spread evenly
  /// over the 4 stages, earlier stages getting the remainder).
  int layers = 2;
  /// Model width (resnet: base channel width, 64 = ResNet-50).
  int hidden = 64;
  int heads = 4;
  /// Llama key/value heads for grouped-query attention; 0 means `heads`.
  int kvHeads = 0;
  /// Feed-forward width; 0 means 4 * hidden (llama: int(8 * hidden / 3)
  /// rounded up to a multiple of 8, as Meta's Llama does).
  int ffn = 0;
  /// Vocabulary size; also the MLP input/output features and the number of
  /// ResNet classes.
  int vocab = 1000;
  /// Sequence length (resnet: image height and width, e.g. 224).
  int seq = 16;
  /// 0 = symbolic dimension named "batch"; > 0 = static batch size.
  int batch = 0;
  /// ONNX default-domain opset, 13..17.
  int opset = 17;
  /// gpt/llama: the LM head reuses the token embedding table through a
  /// Transpose node (one initializer, two users). Ignored by families
  /// without an LM head (bert, mlp, resnet).
  bool tiedEmbeddings = false;
  /// Append a loss (see above): SoftmaxCrossEntropyLoss, or an MSE built
  /// from Sub, Mul, ReduceMean for mlp.
  bool withLoss = false;
  /// Seed of the weight generator; the same options give byte-identical
  /// models.
  uint64_t seed = 1;
  /// Store weights as FLOAT16 initializers, each followed by a Cast to float.
  bool fp16Weights = false;
  /// Every weight and buffer is a ConstantOfShape fill (named like the
  /// weight) instead of an initializer: the graph keeps its structure,
  /// parameter counts and FLOPs but carries no weight bytes, for planning
  /// models too large to write out (a Llama-3-405B shape is a few MB).
  bool lightWeights = false;
};

/// Builds the model described by \p opts (ir_version 8, producer "pipec").
/// Node names follow torch module paths ("/transformer/h.0/attn/MatMul"),
/// node outputs are named "<node name>_output_0" (graph outputs excepted) and
/// initializers carry torch parameter names ("transformer.h.0.ln_1.weight").
/// gpt follows torch's export of Hugging Face's GPT-2 operator for operator
/// (Conv1D's 2-D reshapes, Shape-based head reshapes when the batch is
/// symbolic, tanh GELU): 131 nodes per block at opset 17, symbolic batch.
/// Fails on inconsistent options (e.g. hidden not divisible by heads).
llvm::Expected<onnx::ModelProto> generateModel(const GeneratorOptions &opts);

/// Writes \p model to \p path. With \p externalData, every initializer whose
/// raw_data holds at least \p externalThreshold bytes is stored in the single
/// file "<path>.data" instead (offsets 64-byte aligned, the gaps zero-filled;
/// the TensorProto gets data_location EXTERNAL and location/offset/length
/// entries, the location being the data file's basename). The data file is
/// created even when no initializer qualifies; without \p externalData it is
/// not touched. Fails, naming the path, when a file cannot be written or when
/// the protobuf part would exceed 2 GiB (\p path is not created then).
llvm::Error writeModel(const onnx::ModelProto &model, llvm::StringRef path, bool externalData,
                       uint64_t externalThreshold = 1024);

} // namespace pipec::models

#endif // PIPEC_MODELS_MODELGENERATORS_H
