//===- GenerationRoles.h - A decoder's inputs and outputs in a token loop -===//
//
// `pipec compile --mode generate` compiles one decode step of a decoder LM
// that takes its KV cache as inputs and returns it as outputs (torch.onnx
// with past_key_values, optimum's decoder exports): the sequence 1 token
// long, the past max_length - 1 positions, the attention mask max_length.
// `pipec generate` then needs to know which input is which. It is decided
// by the graph's structure, never by names:
//
//   cache      a graph output made by a Concat that reads a float graph
//              input: the input is the past, the output the present, the
//              Concat's axis the sequence axis; or a present_key or
//              present_value of com.microsoft GroupQueryAttention
//              (onnxruntime-genai's builder) whose past_key or past_value
//              is a graph input: "in place", the pass's positions written
//              where the row's past ends, on axis 2
//   logits     the float output that is not a present, of rank 3 ([batch,
//              1, vocab]); vocab is its last dimension
//   tokens     the integer input that indexes (Gather) a weight of vocab
//              rows: the token embedding
//   mask       the remaining input of rank 2 whose second dimension is
//              max_length
//   positions  the remaining integer input of rank 2 whose second
//              dimension is 1; optional where every cache is in place
//              (GroupQueryAttention rotates by the row's length, which it
//              reads from the mask)
//
// Anything else is refused with one line naming what is missing: a model
// without a cache, one that derives its positions from the past length
// (which a compiled step fixes), an input with no role.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_GENERATIONROLES_H
#define PIPEC_PASSES_GENERATIONROLES_H

#include "compiler/ir/Graph.h"
#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"

namespace pipec {

/// The roles of \p graph's inputs and outputs in generation with rows of
/// \p maxLength tokens (Generation's fields but stage, bytes, groups and
/// slots). Errors name the model file and what is missing.
llvm::Expected<plan::Generation> findGenerationRoles(const Graph &graph, int64_t maxLength);

} // namespace pipec

#endif // PIPEC_PASSES_GENERATIONROLES_H
