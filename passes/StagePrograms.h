//===- StagePrograms.h - What each stage of a plan executes -------------===//
//
// The last step of lowering: the ONNX nodes each global chunk runs, forward
// and (in train mode) backward, cut out of the graph and the backward
// program, with the weights they read as references into the model file.
// This is what `pipec run` executes; the Plan's StageProgram message
// documents the contract.
//
// The backward program of differentiate is per layer; a stage's lists are
// the concatenation of its layers' lists (layers last to first). Gradient
// sums that span stages are re-cut at the stage boundary:
//  - a value V sent to the next stage gets the gradient of its later users
//    back as "grad-next:V": a Sum that combined V's contributions keeps its
//    local terms and reads "grad-next:V" instead of the remote ones, and a
//    node that read a remote "grad:V" reads "grad-next:V";
//  - a value V received from the previous stage sends back the sum of its
//    local contributions and, when V is relayed on, of "grad-next:V";
//  - a weight read on several stages (a tied embedding and LM head)
//    accumulates each stage's local contributions; the plan's tied
//    ALLREDUCE sums the copies.
//
// Before: layers 0..3, chunk 1 = layers 2..3; layer 1 makes h1, read by
//         layer 2; I[2] makes grad:h1 (h1's only user).
// After:  stage 1: recv [h1], input_grads {h1: [grad:h1]};
//         stage 0: send [h1], I[1]'s reads of grad:h1 read grad-next:h1.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_STAGEPROGRAMS_H
#define PIPEC_PASSES_STAGEPROGRAMS_H

#include "compiler/ir/LayerGraph.h"
#include "passes/Differentiate.h"
#include "plan/plan.pb.h"

#include <set>
#include <string>

namespace pipec {

/// Fills plan.stage_programs, weights, trainable, data, outputs, opset and
/// loss_value for the stages already in \p plan. \p backward is null in
/// inference mode (or when there is no backward program). Weights matching
/// the regular expression \p freeze, and registered buffers recognised by
/// name (rotary cos/sin caches, inv_freq, causal masks), are not trainable.
/// Fails naming the stage and value when a stage would read something no one
/// gives it.
llvm::Error buildStagePrograms(plan::Plan &plan, const Graph &graph, const LayerGraph &layers,
                               const Backward *backward, llvm::StringRef freeze = "");

/// "grad:V" or "grad:V#K" (a gradient of V, or a contribution to it) -> V;
/// "" for any other name.
llvm::StringRef gradientOf(llvm::StringRef name);

/// The values whose gradient the backward program computes (some node makes
/// "grad:V" or a contribution "grad:V#K").
std::set<std::string> valuesWithGradients(const Backward &backward);

/// Whether a gradient crosses back over boundary tensor \p id: a float
/// activation, or a value computed from weights, that a gradient reaches
/// (\p flowing, from valuesWithGradients; null: every float activation). lower-schedule and
/// the stage programs use this one rule.
bool sendsGradient(const Graph &graph, int id, const std::set<std::string> *flowing);

} // namespace pipec

#endif // PIPEC_PASSES_STAGEPROGRAMS_H
