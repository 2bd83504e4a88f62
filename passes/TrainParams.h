//===- TrainParams.h - train-params: the checkpoint's parameters train ----===//
//
// Exporters fold a parameter into the initializers the graph reads: a
// position table read at an offset becomes its rows [2, 2 + S), a class
// token broadcast over the batch becomes one copy per sample, a norm scale
// written as 1 + w becomes the sum, and a layer shared by several layers
// becomes one initializer per reader. Training those initializers trains
// the fold, not the parameter: each copy gets one reader's gradient, and a
// sum near 1 moves at float32's spacing near 1.
//
// With `--params`, driver/MapParams.h finds, per parameter of the
// checkpoint, the weights that hold it and the steps from the one to the
// other (plan.proto's ParamStep). This pass (train mode) makes the
// parameter the weight that trains wherever a step is not a layout of it:
//  - a parameter held through a slice, a broadcast or an added constant,
//    or held by several weights in different ways, becomes one weight of
//    the parameter's values, and each reading layer computes the steps as
//    nodes (Slice, Expand, Add, Transpose, Unsqueeze) from it: the
//    gradients of every reader sum into the parameter;
//  - a parameter held alike by several weights (one initializer per
//    reader of a shared layer, a transpose folded once per reader) is read
//    through the first of them everywhere.
// A parameter held by one weight through a transpose or new axes alone
// trains as that weight: the steps are a bijection of the elements, so the
// update is the parameter's, element for element.
//
// Before: Gather(ids, pos) in layer 0, pos = rows [2, 10) of table [66,64]
//         (an initializer of shape [8,64])
// After:  Gather(ids, Slice(table, 2, 10, axis 0)) in layer 0, where
//         "table" holds the checkpoint's [66,64] and trains
//
// Before: Add(x, cls) with cls [4,1,64], four copies of cls_token [1,1,64]
// After:  Add(x, Expand(cls_token, [4,1,64])); cls_token trains
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_TRAINPARAMS_H
#define PIPEC_PASSES_TRAINPARAMS_H

#include "compiler/ir/LayerGraph.h"
#include "plan/plan.pb.h"

#include "llvm/Support/Error.h"

#include <memory>
#include <string>
#include <vector>

namespace pipec {

/// A parameter of the checkpoint and the graph's weights that hold it.
struct ParamFold {
  std::string param; ///< the checkpoint's name
  /// Its values, in the element type of the weights that hold it.
  std::shared_ptr<const ConstTensor> value;
  /// Each weight that holds it, with the steps from the parameter to it.
  std::vector<plan::ParamPlace> places;
  /// From structure alone (no --params): `param` names the first weight.
  bool guessed = false;
};

/// What train-params did to one parameter.
struct ParamRewrite {
  std::string param;
  /// The weight that trains as the parameter: a new one of its values, or
  /// the first weight of `places` when they all hold it alike.
  std::string weight;
  bool newWeight = false;
  bool guessed = false; ///< ParamFold::guessed
  /// The weights that held it before, each with its steps from `weight`.
  std::vector<plan::ParamPlace> places;
  /// The layers whose nodes now read `weight`.
  int readers = 0;
};

/// Runs train-params on \p graph and its \p layers (after tie-weights):
/// rewrites each fold of \p folds that does not train as its parameter,
/// and regroups \p layers when the graph gained ops. Folds whose weights
/// differ in element type, or that a subgraph reads, are left as they are.
llvm::Expected<std::vector<ParamRewrite>> trainParams(Graph &graph, LayerGraph &layers,
                                                      const std::vector<ParamFold> &folds);

/// Adds to \p plan a warning per rewrite and a WeightTie per weight
/// replaced (its param_weight and steps), the record --save-weights writes
/// the model file by.
void describeParamRewrites(plan::Plan &plan, const std::vector<ParamRewrite> &rewrites);

/// Text form for --print-after=train-params.
void printParamRewrites(const std::vector<ParamRewrite> &rewrites, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_PASSES_TRAINPARAMS_H
