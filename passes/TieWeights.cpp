//===- TieWeights.cpp - tie-weights: which shared weights train as one ---===//
#include "passes/TieWeights.h"
#include "passes/GraphEdit.h"
#include "passes/GroupLayers.h"
#include "support/Diagnostics.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <cstring>
#include <map>
#include <optional>
#include <set>

using namespace llvm;

namespace pipec {
namespace {

/// The values that are float initializers of the model file.
std::vector<bool> floatInitializers(const Graph &graph) {
  std::set<std::string> names;
  for (const onnx::TensorProto &t : graph.model->graph().initializer())
    names.insert(t.name());
  std::vector<bool> out(graph.values.size(), false);
  for (size_t v = 0; v < graph.values.size(); ++v) {
    const Value &value = graph.values[v];
    out[v] = value.kind == ValueKind::Weight && value.producer < 0 && isFloatDType(value.type) &&
             !value.isGraphOutput && names.count(value.name);
  }
  return out;
}

/// Whether \p head holds bitwise the transpose of \p table (both 2-D, of
/// one type, stored in the model's files) and is not constant.
bool holdsTranspose(const Graph &graph, const Value &head, const Value &table) {
  // The whole tensors, as the files hold them (shard-tensors may have cut
  // both: the table's rows and the head's columns alike).
  auto whole = [&](const Value &v) {
    std::vector<int64_t> shape = v.shape;
    if (auto shard = graph.shards.find(v.name); shard != graph.shards.end())
      shape[shard->second.axis] *= shard->second.parts;
    return shape;
  };
  std::vector<int64_t> hs = whole(head), ts = whole(table);
  if (head.type != table.type || hs.size() != 2 || ts.size() != 2 || hs[0] != ts[1] ||
      hs[1] != ts[0] || !head.storage || !table.storage)
    return false;
  auto h = graph.storageBytes(head), e = graph.storageBytes(table);
  if (!h || !e) {
    consumeError(h.takeError());
    consumeError(e.takeError());
    return false;
  }
  int64_t rows = hs[0], cols = hs[1], elements = rows * cols;
  if (elements < 2 || h->size() != e->size() || h->size() % elements != 0)
    return false;
  size_t width = h->size() / elements;
  const uint8_t *hp = h->data(), *ep = e->data();
  bool constant = true;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t *x = hp + (i * cols + j) * width;
      if (std::memcmp(x, ep + (j * rows + i) * width, width) != 0)
        return false;
      constant = constant && std::memcmp(x, hp, width) == 0;
    }
  return !constant;
}

/// Every folded tie of \p graph, by head name.
std::vector<FoldedTie> findFoldedTies(const Graph &graph, const std::vector<bool> &candidates) {
  std::set<int> tables;
  for (const Op &op : graph.ops)
    if (!op.dead && (op.is(OpId::Gather) || op.is(OpId::TpGather)) && !op.inputs.empty() &&
        op.inputs[0] >= 0 && candidates[op.inputs[0]])
      tables.insert(op.inputs[0]);
  std::vector<FoldedTie> out;
  for (size_t h = 0; h < graph.values.size(); ++h) {
    if (!candidates[h] || tables.count(h) || graph.values[h].users.empty())
      continue;
    for (int e : tables)
      if (holdsTranspose(graph, graph.values[h], graph.values[e])) {
        out.push_back({graph.values[h].name, graph.values[e].name, false});
        break;
      }
  }
  return out;
}

} // namespace

std::vector<std::pair<std::string, std::string>> foldedTiePairs(const Graph &graph) {
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const FoldedTie &tie : findFoldedTies(graph, floatInitializers(graph)))
    pairs.push_back({tie.head, tie.embedding});
  return pairs;
}

namespace {

/// Reads Transpose(tie.embedding) where tie.head was read: a Transpose op
/// (and node) in the scope of the head's first reader, just before it.
void retie(Graph &graph, const FoldedTie &tie) {
  int head = graph.findValue(tie.head), table = graph.findValue(tie.embedding);
  std::vector<std::pair<int, int>> reads = readsOf(graph, head);
  int at = reads.front().first;
  std::vector<int64_t> shape = {graph.values[table].shape[1], graph.values[table].shape[0]};
  DType type = graph.values[table].type;
  std::string name = freshName(graph, tie.head + ".retied");
  int out = graph.addValue(name, ValueKind::Weight);
  graph.values[out].type = type;
  graph.values[out].shape = shape;
  graph.values[out].shapeKnown = true;

  onnx::NodeProto &node = *graph.model->mutable_graph()->add_node();
  node.set_name(name);
  node.set_op_type("Transpose");
  node.add_input(tie.embedding);
  node.add_output(name);
  onnx::AttributeProto &perm = *node.add_attribute();
  perm.set_name("perm");
  perm.set_type(onnx::AttributeProto::INTS);
  perm.add_ints(1);
  perm.add_ints(0);

  Op op;
  op.name = name;
  op.scope = graph.ops[at].scope;
  op.setType("", "Transpose");
  op.inputs = {table};
  op.outputs = {out};
  op.nodeIndex = graph.model->graph().node_size() - 1;
  graph.ops.insert(graph.ops.begin() + at, std::move(op));
  for (auto [o, slot] : reads)
    rewire(graph, o + 1, slot, out); // the readers moved one down
  graph.rebuildUses();
}

/// "LayerNormalization input 1" when every read of \p id is in one role,
/// else "".
std::string roleOf(const Graph &graph, int id) {
  std::set<std::pair<std::string, int>> roles;
  for (auto [o, slot] : readsOf(graph, id))
    roles.insert({graph.ops[o].opType, slot});
  if (roles.size() != 1)
    return "";
  return formatv("{0} input {1}", roles.begin()->first, roles.begin()->second).str();
}

/// Adds a copy of weight \p id (named \p base, or base.N when taken) and
/// points the \p reads (op, input slot) at it; records it in \p shared.
/// Returns the copy's id; the caller rebuilds the uses.
int copyFor(Graph &graph, int id, const std::string &base,
            const std::vector<std::pair<int, int>> &reads, SharedWeight &shared) {
  std::string name = freshName(graph, base);
  Value copy = graph.values[id];
  copy.name = name;
  copy.users.clear();
  int copyId = graph.addValue(name, copy.kind);
  graph.values[copyId] = std::move(copy);
  std::vector<WeightReader> readers;
  for (auto [o, slot] : reads) {
    rewire(graph, o, slot, copyId);
    auto [node, input] = fileRead(graph, o, slot);
    readers.push_back({node, input});
  }
  shared.copies.push_back(name);
  shared.copyReaders.push_back(std::move(readers));
  return copyId;
}

/// Gives each layer that reads shared.name its own copy.
Error untie(Graph &graph, LayerGraph &layers, SharedWeight &shared) {
  int id = graph.findValue(shared.name);
  if (capturedBySubgraph(graph, id))
    return usageError(formatv("--untie {0}: a subgraph (If, Loop, Scan) reads it; such a weight "
                              "cannot be untied",
                              shared.name));
  std::vector<int> layerOf(graph.ops.size(), -1);
  for (size_t l = 0; l < layers.layers.size(); ++l)
    for (int o : layers.layers[l].ops)
      layerOf[o] = static_cast<int>(l);
  std::vector<std::pair<int, int>> reads = readsOf(graph, id);
  for (int l : shared.layers) {
    std::vector<std::pair<int, int>> mine;
    for (auto [o, slot] : reads)
      if (layerOf[o] == l)
        mine.push_back({o, slot});
    int copyId = copyFor(graph, id, formatv("{0}.untied.{1}", shared.name, l).str(), mine, shared);
    std::replace(layers.layers[l].weights.begin(), layers.layers[l].weights.end(), id, copyId);
  }
  graph.rebuildUses();
  return Error::success();
}

/// Gives each parameter \p splits names its own copy of \p name, read by
/// that parameter's readers; the other readers keep reading \p name.
/// Returns the record, or nullopt when the graph has no such weight.
std::optional<SharedWeight> splitByParams(Graph &graph, const std::string &name,
                                          const std::vector<ParamSplit> &splits) {
  int id = graph.findValue(name);
  if (id < 0 || graph.values[id].kind != ValueKind::Weight || capturedBySubgraph(graph, id))
    return std::nullopt;
  std::vector<std::pair<int, int>> reads = readsOf(graph, id);
  SharedWeight shared;
  shared.name = name;
  for (const ParamSplit &split : splits) {
    std::set<std::pair<int, int>> wanted;
    for (const WeightReader &r : split.readers)
      wanted.insert({r.node, r.input});
    std::vector<std::pair<int, int>> mine;
    for (auto [o, slot] : reads)
      if (wanted.count(fileRead(graph, o, slot)))
        mine.push_back({o, slot});
    if (mine.empty())
      continue;
    copyFor(graph, id, split.copy, mine, shared);
    shared.params.push_back(split.param);
    shared.guessed = split.guessed;
  }
  if (shared.copies.empty())
    return std::nullopt;
  graph.rebuildUses();
  return shared;
}

} // namespace

int TieReport::untied() const {
  return static_cast<int>(
      count_if(shared, [](const SharedWeight &s) { return !s.copies.empty(); }) +
      count_if(folded, [](const FoldedTie &f) { return f.untied; }));
}

int TieReport::retied() const {
  return static_cast<int>(count_if(folded, [](const FoldedTie &f) { return !f.untied; }));
}

Expected<TieReport> tieWeights(Graph &graph, LayerGraph &layers, const TieOptions &options) {
  TieReport report;
  std::set<std::string> named(options.untie.begin(), options.untie.end());
  report.folded = findFoldedTies(graph, floatInitializers(graph));
  for (FoldedTie &tie : report.folded) {
    tie.untied = named.count(tie.head) > 0;
    if (!tie.untied)
      retie(graph, tie);
  }
  std::vector<SharedWeight> splitWeights;
  for (const auto &[name, splits] : options.splits)
    if (auto split = splitByParams(graph, name, splits))
      splitWeights.push_back(std::move(*split));
  if (report.retied() || !splitWeights.empty())
    if (Error err = regroupAfter(graph, layers, "tie-weights"))
      return std::move(err);

  std::vector<bool> candidates = floatInitializers(graph);
  for (auto &[w, readers] : layers.sharedWeights()) {
    if (!candidates[w])
      continue;
    SharedWeight s;
    s.name = graph.values[w].name;
    s.layers = readers;
    for (int l : readers)
      s.layerNames.push_back(layers.layers[l].name);
    s.role = roleOf(graph, w);
    report.shared.push_back(std::move(s));
  }
  for (const std::string &name : options.untie) {
    bool known = any_of(report.shared, [&](const SharedWeight &s) { return s.name == name; }) ||
                 any_of(report.folded, [&](const FoldedTie &f) { return f.head == name; });
    if (known)
      continue;
    std::vector<std::string> names;
    for (const SharedWeight &s : report.shared)
      names.push_back(s.name);
    for (const FoldedTie &f : report.folded)
      names.push_back(f.head);
    return usageError(formatv("--untie {0}: no initializer of that name is shared by layers or "
                              "holds a folded tie; {1}",
                              name,
                              names.empty() ? std::string("the model has none")
                                            : "expected all or one of: " + join(names, ", ")));
  }
  // A retied table is read through a Transpose node that only the compiled
  // graph has: copies of it could not be written back into the model file.
  for (const FoldedTie &tie : report.folded)
    if (!tie.untied && named.count(tie.embedding))
      return usageError(formatv("--untie {0}: '{1}' is read as its transpose (a folded tie); "
                                "pass --untie {1} to train the two apart",
                                tie.embedding, tie.head));
  for (SharedWeight &s : report.shared)
    if (named.count(s.name) || (options.untieAll && !s.role.empty()))
      if (Error err = untie(graph, layers, s))
        return err;
  for (SharedWeight &s : splitWeights)
    report.shared.push_back(std::move(s));
  return report;
}

namespace {

std::vector<std::string> tieWarnings(const TieReport &report,
                                     function_ref<bool(StringRef)> trained) {
  std::vector<std::string> out;
  for (const FoldedTie &f : report.folded)
    out.push_back(
        f.untied ? formatv("'{0}' holds the transpose of '{1}' (an exporter folded a tied weight); "
                           "trained apart, as --untie {0} asks",
                           f.head, f.embedding)
                       .str()
                 : formatv("'{0}' holds the transpose of '{1}' (an exporter folded a tied weight); "
                           "trained as one weight; pass --untie {0} to train apart",
                           f.head, f.embedding)
                       .str());
  for (const SharedWeight &s : report.shared) {
    bool untied = !s.copies.empty();
    if (!(untied ? any_of(s.copies, trained) : trained(s.name)))
      continue;
    std::string layers = join(s.layerNames, ", ");
    if (s.guessed)
      out.push_back(formatv("weight '{0}' holds one value everywhere and is read by {1} modules "
                            "({2}); guessed to be the exporter's merge of {1} parameters, one "
                            "per module, and trained as {1} copies, {3}; pass --params to "
                            "decide from the checkpoint",
                            s.name, s.params.size(), join(s.params, ", "), join(s.copies, ", "))
                        .str());
    else if (!s.params.empty())
      out.push_back(formatv("weight '{0}' holds {1} parameters of --params, which the exporter "
                            "merged (equal values: {2}); trained as {1} copies, {3}",
                            s.name, s.params.size(), join(s.params, ", "), join(s.copies, ", "))
                        .str());
    else if (untied)
      out.push_back(formatv("weight '{0}' was shared by {1} layers ({2}); trained as {1} copies, "
                            "{3}, as --untie asks",
                            s.name, s.layers.size(), layers, join(s.copies, ", "))
                        .str());
    else if (!s.role.empty())
      out.push_back(formatv("weight '{0}' is shared by {1} layers ({2}), each reading it as {3}; "
                            "exporters share equal tensors; trained as one weight; pass --untie "
                            "{0}|all to train copies",
                            s.name, s.layers.size(), layers, s.role)
                        .str());
    else
      out.push_back(formatv("weight '{0}' is tied: read by {1} layers ({2}) in different roles; "
                            "trained as one weight, its gradients summed",
                            s.name, s.layers.size(), layers)
                        .str());
  }
  return out;
}

} // namespace

void describeTies(plan::Plan &plan, const TieReport &report,
                  function_ref<bool(StringRef)> trained) {
  for (const std::string &w : tieWarnings(report, trained))
    plan.add_warnings(w);
  for (const FoldedTie &f : report.folded)
    if (!f.untied) {
      plan::WeightTie &t = *plan.add_ties();
      t.set_weight(f.head);
      t.set_transpose_of(f.embedding);
    }
  for (const SharedWeight &s : report.shared) {
    if (s.copies.empty())
      continue;
    plan::WeightTie &t = *plan.add_ties();
    t.set_weight(s.name);
    for (size_t c = 0; c < s.copies.size(); ++c) {
      plan::UntiedCopy &copy = *t.add_copies();
      copy.set_name(s.copies[c]);
      for (const WeightReader &r : s.copyReaders[c]) {
        copy.add_nodes(r.node);
        copy.add_inputs(r.input);
      }
    }
  }
}

void printTieReport(const TieReport &report, raw_ostream &os) {
  os << formatv("ties retied={0} untied={1}\n", report.retied(), report.untied());
  for (const FoldedTie &f : report.folded)
    os << formatv("folded {0} = transpose({1}){2}\n", f.head, f.embedding,
                  f.untied ? " untied" : "");
  for (const SharedWeight &s : report.shared) {
    os << "shared " << s.name << " layers=";
    for (size_t i = 0; i < s.layers.size(); ++i)
      os << (i ? "," : "") << s.layers[i];
    os << " role=" << (s.role.empty() ? "tie" : s.role);
    if (!s.copies.empty())
      os << " copies=" << join(s.copies, ",");
    os << "\n";
  }
}

} // namespace pipec
