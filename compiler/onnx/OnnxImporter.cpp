//===- OnnxImporter.cpp - Read an ONNX file into a pipec Graph ------------===//
#include "compiler/onnx/OnnxImporter.h"
#include "support/Attributes.h"
#include "support/Diagnostics.h"
#include "support/InputFile.h"
#include "support/Subgraphs.h"
#include "support/WireSkeleton.h"

#include "google/protobuf/io/coded_stream.h"
#include "onnx/defs/schema.h"
#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <map>
#include <queue>

using namespace llvm;

namespace pipec {

/// Newest default-domain opset pipec's kernels and passes have been checked
/// against; ONNX's registry may know newer ones (1.23 goes to 28).
constexpr int64_t newestCheckedOpset = 28;

int64_t maxSupportedOpset() {
  const auto &ranges = onnx::OpSchemaRegistry::DomainToVersionRange::Instance().Map();
  auto it = ranges.find("");
  int64_t registry = it == ranges.end() ? 0 : it->second.second;
  return std::min<int64_t>(registry, newestCheckedOpset);
}

namespace {

/// Oldest default-domain opset whose schemas libonnx still carries.
constexpr int64_t minSupportedOpset = 1;

class Importer {
public:
  Importer(Graph &graph, const ImportOptions &options, StringRef baseDir)
      : graph(graph), options(options), baseDir(baseDir.str()) {}

  Error run();

private:
  Graph &graph;
  const ImportOptions &options;
  std::string baseDir;
  StringMap<uint32_t> externalFiles;

  template <typename... Ts> Error fail(const char *fmt, Ts &&...args) {
    return createStringError(inconvertibleErrorCode(), "%s: %s", graph.path.c_str(),
                             formatv(fmt, std::forward<Ts>(args)...).str().c_str());
  }

  Error readOpsets();
  /// \p describe names the tensor in errors; it runs only on failure.
  Expected<int> addTensor(const onnx::TensorProto &tensor, int tensorIndex,
                          function_ref<std::string()> describe);
  Expected<WeightRef> externalStorage(const onnx::TensorProto &tensor, StringRef what);
  Error addInputs();
  Error addNodes();
  Error sortOps(std::vector<Op> &unsorted);
  Error addOutputs();
  Expected<std::vector<int64_t>> bindShape(const onnx::ValueInfoProto &info);
  int64_t bindDim(StringRef name, size_t position, StringRef input);
  /// Named dimensions of graph inputs that the graph itself fixes (the
  /// head size of a GroupQueryAttention's past), by name.
  void findImpliedDims();
  std::map<std::string, int64_t> impliedDims;
  /// Defines \p name as \p id; a second definition wins over the first.
  void define(StringRef name, int id, function_ref<std::string()> by);
};

/// "node 'LABEL' (DOMAIN.OP)" as every error names a node (the domain when
/// it is not the default one).
std::string describeNode(const onnx::NodeProto &node) {
  std::string type = node.domain().empty() ? node.op_type() : node.domain() + "." + node.op_type();
  return formatv("node '{0}' ({1})", nodeLabel(node), type).str();
}

/// The quoted items of a Python list literal: "['', 'm', 'm.model']".
std::vector<std::string> pythonStrings(StringRef list) {
  std::vector<std::string> items;
  for (size_t i = 0; i < list.size(); ++i) {
    char quote = list[i];
    if (quote != '\'' && quote != '"')
      continue;
    size_t end = list.find(quote, i + 1);
    if (end == StringRef::npos)
      break;
    items.push_back(list.slice(i + 1, end).str());
    i = end;
  }
  return items;
}

/// "/m/model/layers.0/self_attn/transpose" from the nested module paths
/// torch's dynamo exporter records per node ("pkg.torch.onnx.name_scopes":
/// ['', 'm', 'm.model', 'm.model.layers.0', ..., 'transpose'], or the older
/// "namespace": ": Cls/m: Cls/m.model: Cls/.../transpose: aten.op"): each
/// module's name relative to its parent, then the node's own.
std::string scopeFromMetadata(const onnx::NodeProto &node) {
  std::vector<std::string> scopes;
  for (const auto &prop : node.metadata_props()) {
    if (prop.key() == "pkg.torch.onnx.name_scopes") {
      scopes = pythonStrings(prop.value());
      break;
    }
    if (prop.key() == "namespace") {
      SmallVector<StringRef, 16> parts;
      StringRef(prop.value()).split(parts, '/');
      for (StringRef part : parts)
        scopes.push_back(part.split(':').first.trim().str());
    }
  }
  if (scopes.size() < 2)
    return "";
  std::string path, parent;
  for (size_t i = 0; i + 1 < scopes.size(); ++i) {
    StringRef module = scopes[i];
    if (module.empty())
      continue;
    StringRef relative = module;
    if (!parent.empty() && module.startswith(parent + "."))
      relative = module.drop_front(parent.size() + 1);
    path += "/" + relative.str();
    parent = module.str();
  }
  if (path.empty())
    return "";
  return path + "/" + scopes.back();
}

std::string scopeOf(const onnx::NodeProto &node) {
  StringRef name = node.name();
  if (name.contains('/') || name.contains('.'))
    return name.str();
  return scopeFromMetadata(node);
}

Error Importer::readOpsets() {
  const onnx::ModelProto &model = *graph.model;
  for (const auto &opset : model.opset_import()) {
    std::string domain = opset.domain() == "ai.onnx" ? "" : opset.domain();
    graph.opsets[domain] = opset.version();
  }
  if (model.opset_import_size() == 0)
    graph.opsets[""] = 1; // IR version 1-2 models carry no opset_import.
  auto it = graph.opsets.find("");
  if (it == graph.opsets.end())
    return Error::success(); // only custom domains: nothing to type-check
  int64_t maxOpset = maxSupportedOpset();
  if (it->second < minSupportedOpset || it->second > maxOpset)
    return fail("unsupported opset {0} of the default ONNX domain (this build supports {1} to {2})",
                it->second, minSupportedOpset, maxOpset);
  return Error::success();
}

Expected<WeightRef> Importer::externalStorage(const onnx::TensorProto &tensor, StringRef what) {
  std::string location;
  uint64_t offset = 0, length = 0;
  bool haveLength = false, isInline = false;
  for (const auto &entry : tensor.external_data()) {
    if (entry.key() == "location")
      location = entry.value();
    else if (entry.key() == "offset" || entry.key() == "length") {
      uint64_t number;
      if (!to_integer(entry.value(), number, 10))
        return fail("{0}: external data {1} '{2}' is not a number", what, entry.key(),
                    entry.value());
      if (entry.key() == "offset")
        offset = number;
      else
        length = number, haveLength = true;
    } else if (entry.key() == InlineDataMarker)
      isInline = true;
  }
  uint32_t file = 0;
  if (!isInline) {
    if (location.empty())
      return fail("{0}: external data has no location", what);
    if (location.find('\0') != std::string::npos)
      return fail("{0}: external data location '{1}' holds a NUL byte", what,
                  StringRef(location).take_until([](char c) { return c == '\0'; }));
    SmallString<256> native(location);
    sys::path::native(native);
    if (sys::path::is_absolute(native) || StringRef(native).contains(".."))
      return fail("{0}: external data location '{1}' must be a relative path below the model's "
                  "directory",
                  what, location);
    auto found = externalFiles.find(location);
    if (found != externalFiles.end()) {
      file = found->second;
    } else {
      SmallString<256> full(baseDir);
      sys::path::append(full, native);
      // A symlink in the model's folder may point anywhere: where it
      // resolves to is what counts.
      if (Error err = checkInsideFolder(full, baseDir, "external data location"))
        return fail("{0}: {1}", what, toString(std::move(err)));
      auto buffer = readInputFile(full);
      if (!buffer)
        return fail("{0}: external data: {1}", what, toString(buffer.takeError()));
      file = static_cast<uint32_t>(graph.files.size());
      graph.files.push_back(std::move(*buffer));
      graph.fileNames.push_back(std::string(full));
      externalFiles[location] = file;
    }
  }
  uint64_t fileSize = graph.files[file]->getBufferSize();
  if (!haveLength)
    length = offset <= fileSize ? fileSize - offset : 0;
  if (offset > fileSize || length > fileSize - offset)
    return fail("{0}: external data range [{1}, {2}) lies outside '{3}' ({4} bytes)", what, offset,
                offset + length, graph.fileNames[file], fileSize);
  return WeightRef{file, offset, length};
}

Expected<int> Importer::addTensor(const onnx::TensorProto &tensor, int tensorIndex,
                                  function_ref<std::string()> describe) {
  if (!isKnownDType(tensor.data_type())) {
    std::string what = describe();
    return fail("{0}: unknown data type {1}", what, tensor.data_type());
  }
  int id = graph.addValue("", ValueKind::Constant);
  Value &value = graph.values[id];
  value.name = tensor.name();
  value.type = static_cast<DType>(tensor.data_type());
  int64_t elements = 1;
  for (int64_t d : tensor.dims()) {
    if (d < 0)
      return fail("{0}: negative dimension {1}", describe(), d);
    // 2^60 elements of at most 8 bytes stay inside int64 byte counts.
    if (__builtin_mul_overflow(elements, d, &elements) || elements > (int64_t(1) << 60))
      return fail("{0}: its shape has more than 2^60 elements", describe());
    value.shape.push_back(d);
  }
  value.shapeKnown = true;
  value.tensorIndex = tensorIndex;
  if (value.type == DType::String)
    return id;
  int64_t expected = value.numElements() * dtypeSize(value.type);
  if (tensor.data_location() == onnx::TensorProto::EXTERNAL) {
    std::string what = describe();
    auto storage = externalStorage(tensor, what);
    if (!storage)
      return storage.takeError();
    if (static_cast<int64_t>(storage->length) != expected)
      return fail("{0}: holds {1} bytes, its shape {2} of {3} needs {4}", what, storage->length,
                  formatShape(value.shape), dtypeName(value.type), expected);
    graph.values[id].storage = *storage;
  } else if (tensor.has_raw_data() && (tensor.float_data_size() || tensor.int32_data_size() ||
                                       tensor.int64_data_size() || tensor.double_data_size() ||
                                       tensor.uint64_data_size() || tensor.string_data_size())) {
    // ONNX holds a tensor's values in raw_data or in one typed field, never
    // both: which would be meant is a guess.
    return fail("{0}: holds its values twice, in raw_data and in a typed field (float_data, "
                "int32_data, ...); ONNX allows one",
                describe());
  } else if (tensor.has_raw_data() && static_cast<int64_t>(tensor.raw_data().size()) != expected) {
    return fail("{0}: holds {1} bytes, its shape {2} of {3} needs {4}", describe(),
                tensor.raw_data().size(), formatShape(value.shape), dtypeName(value.type),
                expected);
  }
  Value &v = graph.values[id];
  v.kind = looksLikeParameter(v.type, v.numElements()) ? ValueKind::Weight : ValueKind::Constant;
  return id;
}

void Importer::define(StringRef name, int id, function_ref<std::string()> by) {
  auto [it, inserted] = graph.valueIds.try_emplace(name, id);
  if (inserted)
    return;
  int previous = it->second;
  graph.warnings.push_back(
      formatv("name '{0}' is defined twice; the last definition ({1}) wins", name, by()).str());
  // Keep the earlier definition under a unique name so that it stays addressable.
  std::string renamed;
  for (int n = 1;; ++n) {
    renamed = formatv("{0}#dup{1}", name, n).str();
    if (!graph.valueIds.count(renamed))
      break;
  }
  graph.values[previous].name = renamed;
  graph.valueIds[renamed] = previous;
  it->second = id;
  graph.values[id].name = name.str();
}

int64_t Importer::bindDim(StringRef name, size_t position, StringRef input) {
  auto note = [&](int64_t value) {
    std::pair<std::string, int64_t> bound(
        name.empty() ? "dim " + std::to_string(position) : name.str(), value);
    if (!llvm::is_contained(graph.boundDims, bound))
      graph.boundDims.push_back(std::move(bound));
    return value;
  };
  if (auto value = bindSymbolicDim(options.bindings, name, position))
    return note(*value);
  if (auto implied = impliedDims.find(name.str()); implied != impliedDims.end())
    return note(implied->second);
  note(1);
  graph.warnings.push_back(formatv("input '{0}': dimension {1} ('{2}') has no binding; using 1 "
                                   "(set it with --dim {2}=N or --input-shape)",
                                   input, position, name)
                               .str());
  return 1;
}

Expected<std::vector<int64_t>> Importer::bindShape(const onnx::ValueInfoProto &info) {
  auto given = options.bindings.inputShapes.find(info.name());
  const auto &type = info.type();
  if (given != options.bindings.inputShapes.end()) {
    if (type.has_tensor_type() && type.tensor_type().has_shape() &&
        type.tensor_type().shape().dim_size() != static_cast<int>(given->second.size()))
      return fail("input '{0}': --input-shape gives rank {1}, the model declares rank {2}",
                  info.name(), given->second.size(), type.tensor_type().shape().dim_size());
    return given->second;
  }
  if (!type.has_tensor_type())
    return fail("input '{0}': only tensor inputs are supported", info.name());
  if (!type.tensor_type().has_shape())
    return fail("input '{0}': the model gives no shape; pass --input-shape {0}=D0,D1,..",
                info.name());
  std::vector<int64_t> shape;
  const auto &dims = type.tensor_type().shape().dim();
  for (int i = 0; i < dims.size(); ++i) {
    const auto &dim = dims[i];
    if (dim.has_dim_value() && dim.dim_value() >= 0)
      shape.push_back(dim.dim_value());
    else
      shape.push_back(bindDim(dim.dim_param(), i, info.name()));
  }
  return shape;
}

void Importer::findImpliedDims() {
  // onnxruntime-genai's builder names the cache's head size (past_key
  // [batch, kv_heads, past, "kv_cache_dim"]) with no rule to bind it; its
  // GroupQueryAttention fixes it: the query's projection (a MatMul by a
  // weight, before a bias Add) is num_heads heads wide, or num_heads + 2
  // kv_num_heads with Q, K and V packed (no key input).
  const onnx::GraphProto &g = graph.model->graph();
  std::map<std::string, const onnx::NodeProto *> producers;
  for (const onnx::NodeProto &node : g.node())
    for (const std::string &out : node.output())
      producers[out] = &node;
  auto width = [&](const std::string &name) -> int64_t {
    auto it = producers.find(name);
    if (it != producers.end() && it->second->op_type() == "Add" && it->second->input_size() > 0)
      it = producers.find(it->second->input(0));
    if (it == producers.end() || it->second->op_type() != "MatMul" || it->second->input_size() != 2)
      return 0;
    int weight = graph.findValue(it->second->input(1));
    return weight >= 0 && graph.values[weight].shape.size() == 2 ? graph.values[weight].shape[1]
                                                                 : 0;
  };
  for (const onnx::NodeProto &node : g.node()) {
    if (node.domain() != "com.microsoft" || node.op_type() != "GroupQueryAttention" ||
        node.input_size() < 5)
      continue;
    int64_t heads = attrInt(node, "num_heads", 0), kvHeads = attrInt(node, "kv_num_heads", 0);
    bool packed = node.input_size() < 2 || node.input(1).empty();
    int64_t across = packed ? heads + 2 * kvHeads : heads, w = width(node.input(0));
    if (heads <= 0 || kvHeads <= 0 || w <= 0 || w % across != 0)
      continue;
    for (const onnx::ValueInfoProto &input : g.input())
      if (input.name() == node.input(3) || input.name() == node.input(4)) {
        const auto &shape = input.type().tensor_type().shape();
        if (shape.dim_size() == 4 && !shape.dim(3).dim_param().empty())
          impliedDims.emplace(shape.dim(3).dim_param(), w / across);
      }
  }
}

Error Importer::addInputs() {
  const onnx::GraphProto &g = graph.model->graph();
  StringMap<int> seen;
  for (int i = 0; i < g.initializer_size(); ++i) {
    const onnx::TensorProto &tensor = g.initializer(i);
    if (tensor.name().empty())
      return fail("initializer #{0} has no name", i);
    // Which of two weights of one name is meant is a guess no reader may
    // make differently from another: refused.
    auto [first, fresh] = seen.try_emplace(tensor.name(), i);
    if (!fresh)
      return fail("initializer '{0}' is defined twice (#{1} and #{2})", tensor.name(),
                  first->second, i);
    auto describe = [&] { return formatv("initializer '{0}'", tensor.name()).str(); };
    auto id = addTensor(tensor, i, describe);
    if (!id)
      return id.takeError();
    define(tensor.name(), *id, describe);
  }
  findImpliedDims();
  for (const auto &input : g.input()) {
    // Older exporters list every initializer as a graph input too; the
    // initializer is the value, the input only declares its type.
    if (graph.valueIds.count(input.name()))
      continue;
    int id = graph.addValue(input.name(), ValueKind::Input);
    Value &value = graph.values[id];
    if (!input.type().has_tensor_type())
      return fail("input '{0}': only tensor inputs are supported", input.name());
    int32_t elem = input.type().tensor_type().elem_type();
    if (!isKnownDType(elem))
      return fail("input '{0}': unknown data type {1}", input.name(), elem);
    value.type = static_cast<DType>(elem);
    auto shape = bindShape(input);
    if (!shape)
      return shape.takeError();
    value.shape = std::move(*shape);
    value.shapeKnown = true;
    graph.inputs.push_back(id);
  }
  for (const auto &[name, shape] : options.bindings.inputShapes)
    if (graph.findValue(name) < 0 || graph.values[graph.findValue(name)].kind != ValueKind::Input)
      return fail("--input-shape names '{0}', which is not an input of the model", name);
  return Error::success();
}

Error Importer::addNodes() {
  onnx::GraphProto &g = *graph.model->mutable_graph();
  std::vector<Op> unsorted;
  std::vector<int> opOfNode(g.node_size(), -1);
  // First define every output, so that unsorted node lists resolve.
  for (int n = 0; n < g.node_size(); ++n) {
    const onnx::NodeProto &node = g.node(n);
    auto label = [&] { return describeNode(node); };
    bool isConstant =
        node.op_type() == "Constant" && (node.domain().empty() || node.domain() == "ai.onnx");
    if (isConstant) {
      if (node.output_size() != 1)
        return fail("{0}: a Constant has exactly one output", label());
      const onnx::TensorProto *tensor = nullptr;
      for (const auto &attr : node.attribute())
        if (attr.name() == "value" && attr.has_t())
          tensor = &attr.t();
      if (tensor) {
        int index = g.initializer_size() + static_cast<int>(graph.constantTensors.size());
        graph.constantTensors.push_back(tensor);
        auto id = addTensor(*tensor, index, label);
        if (!id)
          return id.takeError();
        // The value goes by the node's output name, whatever the tensor's.
        graph.values[*id].name = node.output(0);
        define(node.output(0), *id, label);
        continue;
      }
      // value_float(s), value_int(s), ...: keep as an op, folded by infer-shapes.
    }
    Op op;
    op.name = node.name();
    op.setType(node.domain(), node.op_type());
    op.scope = scopeOf(node);
    op.nodeIndex = n;
    for (const auto &out : node.output()) {
      if (out.empty()) {
        op.outputs.push_back(-1);
        continue;
      }
      int id = graph.addValue("", ValueKind::Activation);
      graph.values[id].name = out;
      op.outputs.push_back(id);
      define(out, id, label);
    }
    opOfNode[n] = static_cast<int>(unsorted.size());
    unsorted.push_back(std::move(op));
  }
  // Then resolve inputs by name.
  for (Op &op : unsorted) {
    const onnx::NodeProto &node = g.node(op.nodeIndex);
    for (const auto &in : node.input()) {
      if (in.empty()) {
        op.inputs.push_back(-1);
        continue;
      }
      int id = graph.findValue(in);
      if (id < 0)
        return fail("{0}: input '{1}' is not produced by any node, initializer or graph input",
                    describeNode(node), in);
      op.inputs.push_back(id);
    }
    for (const std::string &name : subgraphCaptures(node)) {
      int id = graph.findValue(name);
      if (id < 0)
        return fail("{0}: a subgraph reads '{1}', which no node, initializer or graph input "
                    "defines",
                    describeNode(node), name);
      if (!is_contained(op.captures, id))
        op.captures.push_back(id);
    }
  }
  return sortOps(unsorted);
}

Error Importer::sortOps(std::vector<Op> &unsorted) {
  // Kahn's algorithm, taking the ready op that came first in the file, so
  // that a sorted file keeps its order and an unsorted one gets a stable one.
  size_t n = unsorted.size();
  std::vector<int> producerOf(graph.values.size(), -1);
  for (size_t i = 0; i < n; ++i)
    for (int out : unsorted[i].outputs)
      if (out >= 0)
        producerOf[out] = static_cast<int>(i);
  std::vector<int> pending(n, 0);
  std::vector<std::vector<int>> consumers(n);
  for (size_t i = 0; i < n; ++i) {
    auto addDep = [&](int in) {
      if (in >= 0 && producerOf[in] >= 0) {
        ++pending[i];
        consumers[producerOf[in]].push_back(static_cast<int>(i));
      }
    };
    for (int in : unsorted[i].inputs)
      addDep(in);
    for (int in : unsorted[i].captures)
      addDep(in);
  }
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (size_t i = 0; i < n; ++i)
    if (pending[i] == 0)
      ready.push(static_cast<int>(i));
  std::vector<int> order;
  order.reserve(n);
  while (!ready.empty()) {
    int i = ready.top();
    ready.pop();
    order.push_back(i);
    for (int c : consumers[i])
      if (--pending[c] == 0)
        ready.push(c);
  }
  if (order.size() != n) {
    for (size_t i = 0; i < n; ++i)
      if (pending[i] > 0)
        return fail("the graph has a cycle through {0}",
                    describeNode(graph.model->graph().node(unsorted[i].nodeIndex)));
  }
  bool wasSorted = is_sorted(order);
  if (!wasSorted)
    graph.warnings.push_back("nodes were not in topological order; sorted them");
  graph.ops.reserve(n);
  for (int i : order)
    graph.ops.push_back(std::move(unsorted[i]));
  graph.rebuildUses();
  return Error::success();
}

Error Importer::addOutputs() {
  for (const auto &output : graph.model->graph().output()) {
    int id = graph.findValue(output.name());
    if (id < 0)
      return fail("graph output '{0}' is not produced by any node", output.name());
    graph.values[id].isGraphOutput = true;
    graph.outputs.push_back(id);
  }
  return Error::success();
}

Error Importer::run() {
  if (Error err = readOpsets())
    return err;
  if (Error err = addInputs())
    return err;
  if (Error err = addNodes())
    return err;
  return addOutputs();
}

} // namespace

Expected<Graph> importOnnxBuffer(std::unique_ptr<MemoryBuffer> buffer, StringRef displayName,
                                 StringRef baseDir, const ImportOptions &options) {
  Graph graph;
  graph.path = displayName.str();
  auto fail = [&](const Twine &message) {
    return createStringError(inconvertibleErrorCode(), "%s: %s", graph.path.c_str(),
                             message.str().c_str());
  };
  if (buffer->getBufferSize() == 0)
    return fail("the file is empty");
  auto skeleton = makeSkeleton(buffer->getBuffer(), options.inlineThreshold);
  if (!skeleton)
    return fail(toString(skeleton.takeError()));
  graph.arena = std::make_unique<google::protobuf::Arena>();
  graph.model = google::protobuf::Arena::CreateMessage<onnx::ModelProto>(graph.arena.get());
  bool parsed = false;
  // protobuf stops at 100 nested messages by default: 33 levels of If.
  try {
    google::protobuf::io::CodedInputStream stream(
        reinterpret_cast<const uint8_t *>(skeleton->data()), static_cast<int>(skeleton->size()));
    stream.SetRecursionLimit(MaxMessageDepth);
    parsed = graph.model->ParseFromCodedStream(&stream) && stream.ConsumedEntireMessage();
  } catch (const std::exception &e) {
    return fail(Twine("not a valid ONNX model: ") + e.what());
  }
  if (!parsed)
    return fail(formatv("not a valid ONNX model (protobuf parse failed: truncated or corrupt "
                        "file, or subgraphs nested more than {0} deep?)",
                        MaxSubgraphDepth));
  if (!graph.model->has_graph())
    return fail("not an ONNX model: it has no graph");
  graph.files.push_back(std::move(buffer));
  graph.fileNames.push_back(graph.path);
  graph.bindings = options.bindings;
  graph.tensorParallel = options.tensorParallel;
  graph.sequenceParallel = options.sequenceParallel;
  graph.training = options.training;
  graph.fileNodes = graph.model->graph().node_size();
  graph.fuseAttention = options.fuseAttention;
  Importer importer(graph, options, baseDir);
  try {
    if (Error err = importer.run())
      return err;
  } catch (const std::exception &e) {
    return fail(Twine("import failed: ") + e.what());
  }
  return graph;
}

Expected<Graph> importOnnx(StringRef path, const ImportOptions &options) {
  auto buffer = readInputFile(path);
  if (!buffer)
    return buffer.takeError();
  SmallString<256> dir(path);
  sys::path::remove_filename(dir);
  if (dir.empty())
    dir = ".";
  return importOnnxBuffer(std::move(*buffer), path, dir, options);
}

} // namespace pipec
