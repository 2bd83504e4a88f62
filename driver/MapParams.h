//===- MapParams.h - Which checkpoint tensor each weight holds ------------===//
//
// `pipec compile MODEL.onnx --params CKPT.safetensors`: the model's own
// tensors, as save_pretrained or safetensors.torch.save_file wrote them,
// matched to the plan's weights by exact value, under the transforms
// exporters apply when they fold a parameter: a cast, a transpose (any
// permutation), the leading rows along one axis, new axes of size 1, a
// constant added ("1 + w"). The result is the plan's ParamMap
// (runtime/exec/ParamMap.h applies it).
//
// Values decide, not names: a weight matches the parameters whose values
// it holds. Names only break ties between parameters of equal values: the
// one whose name the weight carries (exporters keep the parameter's name,
// after the prefix of a wrapping module, when they do not fold it), else
// the one no other weight holds. A tie that neither breaks is reported.
// A weight exported under the name of a parameter the checkpoint lacks (a
// tied head: save_pretrained writes "lm_head.weight" only once, as the
// embedding) gives that name as an alias, so that a saved checkpoint has
// every name torch's state_dict has.
//
// The report names every parameter no weight holds (with the export
// setting that keeps a folded one), every trained weight that holds no
// parameter, and every tie left open.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_MAPPARAMS_H
#define PIPEC_DRIVER_MAPPARAMS_H

#include "passes/TieWeights.h"
#include "passes/TrainParams.h"
#include "plan/plan.pb.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace pipec {

struct ParamMapSummary {
  int params = 0; ///< float tensors of the checkpoint
  int placed = 0; ///< held by a weight
  int folded = 0; ///< held through at least one transform
  int aliases = 0;
  /// One line each: unplaced parameters, trained weights without one,
  /// open ties. Also in the plan's warnings.
  std::vector<std::string> problems;
};

/// The initializers of the model at \p modelPath that its exporter merged
/// from several parameters of \p checkpoint: equal values (a fresh model's
/// norm scales, all ones) read by the modules of different parameters. Each
/// gets one split per parameter, with that parameter's readers, for
/// tie-weights to give them copies (TieOptions::splits) before they train.
/// Readers of the parameter whose name the initializer carries keep it.
llvm::Expected<std::map<std::string, std::vector<ParamSplit>>>
splitMergedParams(llvm::StringRef modelPath, llvm::StringRef checkpoint);

/// The parameters of \p checkpoint that the float weights of \p graph hold
/// (read from the graph's files, tie-weights' copies included), each with
/// its places, for train-params. Matching as mapParams does; ties it
/// cannot break leave the weight out. \p matched gets every weight that
/// holds some parameter's values, tie or not; \p everyParamHeld whether
/// every float parameter is held by some weight.
llvm::Expected<std::vector<ParamFold>> findParamFolds(const Graph &graph,
                                                      llvm::StringRef checkpoint,
                                                      std::set<std::string> &matched,
                                                      bool &everyParamHeld);

/// Without a checkpoint, the merges structure shows: each float initializer
/// of \p graph that holds one value everywhere (a fresh model's norm scales,
/// all ones) and is read by the nodes of several modules is the exporter's
/// merge of one parameter per module. Each module gets a split (guessed),
/// as splitMergedParams' are; a read whose module the file does not record
/// is a module of its own.
llvm::Expected<std::map<std::string, std::vector<ParamSplit>>>
guessMergedSplits(const Graph &graph);

/// Without a checkpoint, the folds structure shows in \p graph, but for the
/// weights tie-weights \p decided on (its copies, folded ties):
///  - float initializers that hold equal values, as they are or transposed,
///    and are read by the nodes of one module, the same for all, are that
///    module's one parameter, exported once per call (ALBERT's layer group,
///    called by every layer). Equal values read by different modules are
///    different parameters (a decoder initialised from its encoder);
///  - one that holds equal copies along an axis is one parameter broadcast
///    (a class token expanded over the batch).
/// Values of one number everywhere are no evidence and are left out; so is
/// data (dataWeights), but for entries per sample that are equal copies (a
/// token type row expanded over the batch). Each fold names its first
/// weight as the parameter and is marked guessed.
llvm::Expected<std::vector<ParamFold>> guessParamFolds(const Graph &graph,
                                                       const std::set<std::string> &decided);

/// Fills \p plan's param_map from the safetensors file \p checkpoint.
/// Errors: the file cannot be read, or it shares no tensor with the model.
llvm::Expected<ParamMapSummary> mapParams(plan::Plan &plan, llvm::StringRef checkpoint);

} // namespace pipec

#endif // PIPEC_DRIVER_MAPPARAMS_H
