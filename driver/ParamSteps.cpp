//===- ParamSteps.cpp - The training graph's steps before differentiate --===//
//
// The compile steps that read the user's checkpoint (--params) into the
// graph before differentiate: train-params (passes/TrainParams.h), the
// initializers that hold no parameter, and the embeddings' padding rows;
// then autocast (passes/Autocast.h), which gives the activations the types
// a bf16 run stores.
//
//===----------------------------------------------------------------------===//
#include "driver/CompileParts.h"
#include "driver/MapParams.h"
#include "passes/Autocast.h"
#include "passes/TrainParams.h"
#include "support/Diagnostics.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <optional>
#include <set>

using namespace llvm;

namespace pipec {
namespace {
/// The pad_token_id and vocab_size of the config.json beside checkpoint
/// \p params (or in its folder), when it has them.
std::optional<std::pair<int64_t, int64_t>> configPadding(StringRef params) {
  SmallString<256> path(params);
  if (!sys::fs::is_directory(path))
    sys::path::remove_filename(path);
  sys::path::append(path, "config.json");
  auto file = MemoryBuffer::getFile(path);
  if (!file)
    return std::nullopt;
  auto parsed = json::parse((*file)->getBuffer());
  if (!parsed) {
    consumeError(parsed.takeError());
    return std::nullopt;
  }
  const json::Object *config = parsed->getAsObject();
  if (!config)
    return std::nullopt;
  auto pad = config->getInteger("pad_token_id");
  auto vocab = config->getInteger("vocab_size");
  if (!pad || *pad < 0)
    return std::nullopt;
  // transformers' T5 family embeds without padding_idx: pad_token_id only
  // marks the labels and the decoder's first token there.
  if (auto type = config->getString("model_type"))
    if (is_contained(ArrayRef<StringRef>{"t5", "mt5", "umt5", "longt5", "switch_transformers"},
                     *type))
      return std::nullopt;
  return std::make_pair(int64_t(*pad), vocab ? int64_t(*vocab) : int64_t(-1));
}

} // namespace

/// train-params (train mode): each parameter of the --params checkpoint
/// that the exporter folded trains as itself; without one, each parameter
/// the graph's structure shows (guessParamFolds).
Error trainParamsStep(Prepared &out, const CompileOptions &options, PassRunner &runner) {
  if (!options.training)
    return runner.skip("train-params", "inference (--mode infer) trains no weights");
  // Without a checkpoint, what the graph's structure shows (guessed).
  bool guess = options.params.empty();
  return runner.run(
      "train-params",
      [&]() -> Error {
        std::set<std::string> holding; // weights that hold some parameter's values
        bool everyParamHeld = false;
        Expected<std::vector<ParamFold>> folds = std::vector<ParamFold>();
        if (guess) {
          std::set<std::string> decided; // what tie-weights did stays
          for (const SharedWeight &w : out.ties.shared)
            decided.insert(w.copies.begin(), w.copies.end());
          for (const FoldedTie &t : out.ties.folded) {
            decided.insert(t.head);
            decided.insert(t.embedding);
          }
          folds = guessParamFolds(out.graph, decided);
        } else {
          folds = findParamFolds(out.graph, options.params, holding, everyParamHeld);
        }
        if (!folds)
          return folds.takeError();
        auto rewrites = trainParams(out.graph, out.layers, *folds);
        if (!rewrites)
          return rewrites.takeError();
        out.paramRewrites = std::move(*rewrites);
        if (guess)
          return Error::success();
        for (const ParamFold &fold : *folds)
          if (fold.places.size() == 1)
            out.paramWeights[fold.param] = fold.places[0].weight();
        for (const ParamRewrite &r : out.paramRewrites)
          out.paramWeights[r.param] = r.weight;
        // One tensor of the checkpoint is one parameter: a Constant node's
        // float tensor that holds none (a zero bias the legacy exporter
        // wrote as a constant) is data, and does not train; so is an
        // initializer that holds none when every parameter is held (a
        // buffer's table). Else it may be the fold of a parameter no weight
        // holds that no step describes (a gather of a table): it trains as
        // before, and mapParams names it.
        int initializers = out.graph.model->graph().initializer_size();
        for (const ParamFold &fold : *folds)
          for (const plan::ParamPlace &place : fold.places)
            holding.insert(place.weight());
        for (const ParamRewrite &r : out.paramRewrites)
          holding.insert(r.weight);
        for (Value &v : out.graph.values)
          if (v.kind == ValueKind::Weight && v.producer < 0 && !v.users.empty() &&
              isFloatDType(v.type) && v.numElements() > 1 &&
              (everyParamHeld || v.tensorIndex >= initializers) && !holding.count(v.name)) {
            v.kind = ValueKind::Constant;
            out.unheld.push_back(v.name);
          }
        return Error::success();
      },
      [&] {
        int fresh = static_cast<int>(
            count_if(out.paramRewrites, [](const ParamRewrite &r) { return r.newWeight; }));
        return formatv("parameters rewritten {0}{3}: {1} read through nodes, {2} merged copies",
                       out.paramRewrites.size(), fresh, out.paramRewrites.size() - fresh,
                       guess ? " (guessed from structure, no --params)" : "")
            .str();
      },
      [&](raw_ostream &os) {
        printParamRewrites(out.paramRewrites, os);
        out.layers.print(os);
      });
}

/// Fills graph.paddingRows (train mode): --pad-row's, by weight or --params
/// parameter name, and with --params the pad_token_id of the checkpoint's
/// config.json for each table of vocab_size rows a Gather reads by a graph
/// input (the token embedding).
Error choosePaddingRows(Prepared &out, const CompileOptions &options) {
  Graph &graph = out.graph;
  // A vocabulary-parallel table (shard-tensors) holds one rank's rows.
  auto rowsOf = [&](int id) {
    const Value &v = graph.values[id];
    auto shard = graph.shards.find(v.name);
    int64_t parts =
        shard != graph.shards.end() && shard->second.axis == 0 ? shard->second.parts : 1;
    return v.shape.empty() ? 0 : v.shape[0] * parts;
  };
  for (const auto &[name, row] : options.padRows) {
    std::string weight = name;
    if (auto it = out.paramWeights.find(name); it != out.paramWeights.end())
      weight = it->second;
    int id = graph.findValue(weight);
    if (id < 0 || graph.values[id].kind != ValueKind::Weight || graph.values[id].producer >= 0)
      return usageError(formatv("--pad-row {0}={1}: no weight{2} is named '{0}'", name, row,
                                options.params.empty() ? "" : " or --params parameter"));
    if (row >= rowsOf(id))
      return usageError(
          formatv("--pad-row {0}={1}: '{2}' has {3} rows", name, row, weight, rowsOf(id)));
    graph.paddingRows[weight] = row;
    out.paddingNotes.push_back(
        formatv("row {0} of '{1}' takes no gradient (--pad-row)", row, weight).str());
  }
  if (options.params.empty())
    return Error::success();
  auto config = configPadding(options.params);
  if (!config)
    return Error::success();
  auto [pad, vocab] = *config;
  for (const Op &op : graph.ops) {
    if (op.dead || !(op.is(OpId::Gather) || op.is(OpId::TpGather)) || op.inputs.size() < 2 ||
        op.inputs[0] < 0 || op.inputs[1] < 0)
      continue;
    const Value &table = graph.values[op.inputs[0]];
    if (table.kind != ValueKind::Weight || table.producer >= 0 ||
        graph.values[op.inputs[1]].kind != ValueKind::Input ||
        (vocab > 0 && rowsOf(op.inputs[0]) != vocab) || pad >= rowsOf(op.inputs[0]) ||
        graph.paddingRows.count(table.name))
      continue;
    graph.paddingRows[table.name] = pad;
    out.paddingNotes.push_back(formatv("row {0} of '{1}' takes no gradient (pad_token_id of the "
                                       "config.json beside --params, as torch's padding_idx)",
                                       pad, table.name)
                                   .str());
  }
  return Error::success();
}

/// autocast (train mode, --autocast): bf16 activations where torch.autocast
/// keeps them.
Error autocastStep(Prepared &out, const CompileOptions &options, PassRunner &runner) {
  if (!options.training)
    return runner.skip("autocast", "inference (--mode infer) keeps the model's types");
  if (!options.autocast)
    return runner.skip("autocast", "without --autocast, activations keep the model's types");
  out.graph.autocast = true;
  AutocastReport report;
  return runner.run(
      "autocast",
      [&]() -> Error {
        auto done = autocast(out.graph, out.layers);
        if (!done)
          return done.takeError();
        report = *done;
        return Error::success();
      },
      [&] { return formatv("casts {0}, bf16 products {1}", report.casts, report.lowOps).str(); },
      [&](raw_ostream &os) { printGraph(out.graph, os); });
}

} // namespace pipec
