//===- ModelIO.cpp - Writing what a run produced -------------------------===//
#include "runtime/exec/ModelIO.h"

#include "ops/OpRegistry.h"
#include "plan/PlanFile.h"
#include "runtime/exec/ParamMap.h"
#include "runtime/exec/Safetensors.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <set>

using namespace llvm;

namespace pipec::rt {
namespace {

/// The initializer of \p graph named \p name, or null.
onnx::TensorProto *findInitializer(onnx::GraphProto &graph, StringRef name) {
  for (onnx::TensorProto &t : *graph.mutable_initializer())
    if (t.name() == name)
      return &t;
  return nullptr;
}

/// Adds tie.weight's copies as initializers (the trained values, else the
/// file's) and points their readers at them; drops tie.weight when nothing
/// reads it any more. Counts the trained copies into \p replaced.
Error untieCopies(onnx::GraphProto &graph, const plan::WeightTie &tie,
                  const std::map<std::string, cpu::Tensor> &trained, size_t &replaced) {
  const onnx::TensorProto *original = findInitializer(graph, tie.weight());
  if (!original)
    return createStringError(inconvertibleErrorCode(), "no initializer '%s' to untie",
                             tie.weight().c_str());
  onnx::TensorProto source = *original;
  for (const plan::UntiedCopy &copy : tie.copies()) {
    auto it = trained.find(copy.name());
    onnx::TensorProto t = source;
    if (it != trained.end()) {
      t = cpu::toTensorProto(it->second, copy.name());
      ++replaced;
    }
    t.set_name(copy.name());
    *graph.add_initializer() = std::move(t);
    for (int i = 0; i < copy.nodes_size() && i < copy.inputs_size(); ++i) {
      int node = copy.nodes(i), input = copy.inputs(i);
      if (node < 0 || node >= graph.node_size() || input < 0 ||
          input >= graph.node(node).input_size() || graph.node(node).input(input) != tie.weight())
        return createStringError(inconvertibleErrorCode(),
                                 "node %d input %d does not read '%s', as the plan says", node,
                                 input, tie.weight().c_str());
      graph.mutable_node(node)->set_input(input, copy.name());
    }
  }
  bool read = any_of(graph.output(), [&](const auto &o) { return o.name() == tie.weight(); });
  for (const onnx::NodeProto &n : graph.node())
    read = read || is_contained(n.input(), tie.weight());
  if (!read) {
    auto *list = graph.mutable_initializer();
    list->erase(std::find_if(list->begin(), list->end(),
                             [&](const onnx::TensorProto &t) { return t.name() == tie.weight(); }));
  }
  return Error::success();
}

/// Writes tie.weight as the transpose of tie.transpose_of's values (already
/// the trained ones).
Error retieHead(onnx::GraphProto &graph, const plan::WeightTie &tie) {
  onnx::TensorProto *head = findInitializer(graph, tie.weight());
  const onnx::TensorProto *table = findInitializer(graph, tie.transpose_of());
  if (!head || !table)
    return createStringError(inconvertibleErrorCode(), "no initializers '%s' and '%s' to retie",
                             tie.weight().c_str(), tie.transpose_of().c_str());
  auto values = cpu::fromTensorProto(*table);
  if (!values)
    return values.takeError();
  if (values->rank() != 2)
    return createStringError(inconvertibleErrorCode(), "'%s' is not 2-D",
                             tie.transpose_of().c_str());
  int64_t rows = values->dim(0), cols = values->dim(1);
  cpu::Tensor transposed(values->elemType(), {cols, rows});
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      transposed.setDouble(j * rows + i, values->getDouble(i * cols + j));
  *head = cpu::toTensorProto(transposed, tie.weight());
  return Error::success();
}

/// Writes tie.weight as tie.steps applied to the trained values of
/// tie.param_weight (train-params), when it trained; adds param_weight to
/// \p params when the model file has no initializer of that name.
Error computeFromParam(onnx::GraphProto &graph, const plan::WeightTie &tie,
                       const std::map<std::string, cpu::Tensor> &trained,
                       std::set<std::string> &params) {
  onnx::TensorProto *held = findInitializer(graph, tie.weight());
  if (!held)
    return createStringError(inconvertibleErrorCode(), "no initializer '%s' to write from '%s'",
                             tie.weight().c_str(), tie.param_weight().c_str());
  auto it = trained.find(tie.param_weight());
  if (it == trained.end())
    return Error::success();
  if (!findInitializer(graph, tie.param_weight()))
    params.insert(tie.param_weight());
  auto type = cpu::elemTypeFromOnnx(held->data_type());
  if (!type)
    return type.takeError();
  plan::ParamPlace place;
  *place.mutable_steps() = tie.steps();
  auto value = placeParam(it->second, place, *type);
  if (!value)
    return createStringError(inconvertibleErrorCode(), "'%s' from '%s': %s", tie.weight().c_str(),
                             tie.param_weight().c_str(), toString(value.takeError()).c_str());
  *held = cpu::toTensorProto(*value, tie.weight());
  return Error::success();
}

} // namespace

Error saveTrainedModel(StringRef modelPath, const std::map<std::string, cpu::Tensor> &trained,
                       const plan::Plan &plan, StringRef out) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "--save-weights %s: %s", out.str().c_str(),
                             why.str().c_str());
  };
  auto file = MemoryBuffer::getFile(modelPath, false, false);
  if (!file)
    return fail(modelPath + ": " + file.getError().message());
  if ((*file)->getBufferSize() > static_cast<size_t>(INT_MAX))
    return fail(modelPath + " is over 2 GiB inline; store its weights as external data");
  onnx::ModelProto model;
  if (!model.ParseFromArray((*file)->getBufferStart(), static_cast<int>((*file)->getBufferSize())))
    return fail(modelPath + " does not parse as ONNX");
  StringRef dir = sys::path::parent_path(modelPath);
  size_t replaced = 0;
  auto refill = [&](onnx::TensorProto &t) -> Error {
    auto it = trained.find(t.name());
    if (it != trained.end()) {
      std::string name = t.name();
      t = cpu::toTensorProto(it->second, name);
      ++replaced;
      return Error::success();
    }
    if (t.data_location() == onnx::TensorProto::EXTERNAL) {
      auto tensor = cpu::fromTensorProto(t, dir);
      if (!tensor)
        return tensor.takeError();
      std::string name = t.name();
      t = cpu::toTensorProto(*tensor, name);
    }
    return Error::success();
  };
  onnx::GraphProto &graph = *model.mutable_graph();
  for (onnx::TensorProto &t : *graph.mutable_initializer())
    if (Error err = refill(t))
      return fail(toString(std::move(err)));
  for (onnx::NodeProto &node : *graph.mutable_node()) {
    if (!isOp(node, OpId::Constant) || node.output_size() != 1)
      continue;
    for (onnx::AttributeProto &a : *node.mutable_attribute())
      if (a.name() == "value" && a.has_t()) {
        a.mutable_t()->set_name(node.output(0));
        if (Error err = refill(*a.mutable_t()))
          return fail(toString(std::move(err)));
      }
  }
  std::set<std::string> params; // trained weights the file holds only through ties
  for (const plan::WeightTie &tie : plan.ties()) {
    Error err = !tie.param_weight().empty()  ? computeFromParam(graph, tie, trained, params)
                : tie.transpose_of().empty() ? untieCopies(graph, tie, trained, replaced)
                                             : retieHead(graph, tie);
    if (err)
      return fail(toString(std::move(err)));
  }
  replaced += params.size();
  if (replaced < trained.size())
    return fail(formatv("{0} of {1} trained weights are not tensors of {2}",
                        trained.size() - replaced, trained.size(), modelPath));

  // Big models keep their tensors beside the .onnx file.
  size_t total = 0;
  for (const onnx::TensorProto &t : graph.initializer())
    total += t.raw_data().size();
  if (total > (size_t(1) << 30) && out != nullOutput) {
    std::string dataName = sys::path::filename(out).str() + ".data";
    SmallString<256> dataPath(sys::path::parent_path(out));
    sys::path::append(dataPath, dataName);
    if (Error err = checkOutputPath(dataPath))
      return fail(toString(std::move(err)));
    SmallString<256> tmp;
    int fd = -1;
    if (std::error_code ec = sys::fs::createUniqueFile(dataPath + ".tmp-%%%%%%", fd, tmp))
      return fail(std::string(dataPath) + ": " + ec.message());
    raw_fd_ostream os(fd, /*shouldClose=*/true);
    uint64_t offset = 0;
    for (onnx::TensorProto &t : *graph.mutable_initializer()) {
      if (t.raw_data().size() < 1024)
        continue;
      uint64_t pad = (4096 - offset % 4096) % 4096;
      os.write_zeros(pad);
      offset += pad;
      os << t.raw_data();
      auto entry = [&](const char *key, const std::string &value) {
        auto *e = t.add_external_data();
        e->set_key(key);
        e->set_value(value);
      };
      entry("location", dataName);
      entry("offset", std::to_string(offset));
      entry("length", std::to_string(t.raw_data().size()));
      offset += t.raw_data().size();
      t.clear_raw_data();
      t.set_data_location(onnx::TensorProto::EXTERNAL);
    }
    // Streamed, not through writeFileAtomically: it is over a gigabyte.
    os.close();
    if (os.has_error()) {
      std::string why = os.error().message();
      os.clear_error(); // an unhandled stream error would abort at destruction
      sys::fs::remove(tmp);
      return fail(std::string(tmp) + ": write failed: " + why);
    }
    if (std::error_code rc = sys::fs::rename(tmp, dataPath)) {
      sys::fs::remove(tmp);
      return fail(std::string(dataPath) + ": " + rc.message());
    }
  }
  std::string bytes;
  if (!model.SerializeToString(&bytes))
    return fail("the model does not serialize");
  return writeFileAtomically(out, bytes);
}

namespace {

std::string shapeText(ArrayRef<int64_t> shape) {
  return "[" + join(map_range(shape, [](int64_t d) { return std::to_string(d); }), ",") + "]";
}

/// The tensor \p p names in \p file, checked against the map's shape and
/// dtype.
Expected<cpu::Tensor> paramTensor(const SafetensorsFile &file, const plan::Param &p) {
  const SafeTensor *t = file.find(p.name());
  if (!t)
    return createStringError(inconvertibleErrorCode(),
                             "%s: no tensor '%s', which the plan's parameter map holds",
                             file.path().c_str(), p.name().c_str());
  std::vector<int64_t> shape(p.shape().begin(), p.shape().end());
  if (t->shape != shape || safetensorsDType(t->type) != p.dtype())
    return createStringError(inconvertibleErrorCode(),
                             "%s: tensor '%s' is %s %s; the plan was compiled (--params) "
                             "for %s %s",
                             file.path().c_str(), p.name().c_str(),
                             safetensorsDType(t->type).str().c_str(), shapeText(t->shape).c_str(),
                             p.dtype().c_str(), shapeText(shape).c_str());
  return file.toTensor(*t);
}

Error noParamMap(StringRef flag) {
  return createStringError(inconvertibleErrorCode(),
                           "%s: the plan has no parameter map; compile it with --params "
                           "CHECKPOINT.safetensors",
                           flag.str().c_str());
}

} // namespace

Expected<std::map<std::string, cpu::Tensor>>
loadInitWeights(const plan::Plan &plan, StringRef checkpoint, std::vector<std::string> &warnings) {
  if (plan.param_map().params().empty())
    return noParamMap("--init " + checkpoint.str());
  auto file = SafetensorsFile::open(checkpoint);
  if (!file)
    return file.takeError();
  std::map<std::string, int32_t> weightTypes;
  for (const onnx::TensorProto &w : plan.weights())
    weightTypes[w.name()] = w.data_type();
  std::map<std::string, cpu::Tensor> out;
  std::set<std::string> mapped;
  // The checkpoint the map was made from: a parameter no weight holds (the
  // exporter folded it away) must be the same in both, or the model cannot
  // compute what --init's checkpoint holds.
  std::optional<SafetensorsFile> mappedFrom;
  if (plan.param_map().checkpoint() != checkpoint) {
    auto from = SafetensorsFile::open(plan.param_map().checkpoint());
    if (from)
      mappedFrom = std::move(*from);
    else
      warnings.push_back(formatv("--init {0}: the parameters no weight holds are not compared "
                                 "with those the plan was mapped from: {1}",
                                 checkpoint, toString(from.takeError())));
  }
  for (const plan::Param &p : plan.param_map().params()) {
    mapped.insert(p.name());
    if (p.places().empty() && p.alias_of().empty() && mappedFrom) {
      auto mine = paramTensor(*file, p);
      auto theirs = paramTensor(*mappedFrom, p);
      if (!mine)
        return mine.takeError();
      if (!theirs)
        return theirs.takeError();
      for (int64_t i = 0; i < mine->numElements(); ++i)
        if (mine->getDouble(i) != theirs->getDouble(i))
          return createStringError(
              inconvertibleErrorCode(),
              "--init %s: parameter '%s' differs from the one the plan was mapped from (%s), and "
              "no weight of the model holds it (the exporter folded it into a constant): the "
              "model cannot compute with it; export with torch.onnx.export(..., optimize=False), "
              "or from this checkpoint's weights",
              checkpoint.str().c_str(), p.name().c_str(), plan.param_map().checkpoint().c_str());
    }
    if (p.places().empty())
      continue;
    auto value = paramTensor(*file, p);
    if (!value)
      return value.takeError();
    for (const plan::ParamPlace &place : p.places()) {
      auto type = weightTypes.find(place.weight());
      if (type == weightTypes.end())
        return createStringError(inconvertibleErrorCode(),
                                 "the plan's parameter map names no "
                                 "weight '%s'",
                                 place.weight().c_str());
      auto elem = cpu::elemTypeFromOnnx(type->second);
      if (!elem)
        return elem.takeError();
      auto placed = placeParam(*value, place, *elem);
      if (!placed)
        return createStringError(inconvertibleErrorCode(), "%s: tensor '%s' into weight '%s': %s",
                                 checkpoint.str().c_str(), p.name().c_str(), place.weight().c_str(),
                                 toString(placed.takeError()).c_str());
      out[place.weight()] = std::move(*placed);
    }
  }
  for (const std::string &w : plan.trainable())
    if (!out.count(w))
      warnings.push_back(formatv("--init {0}: trained weight '{1}' holds no parameter of the "
                                 "plan's map; it starts from the model file's values",
                                 checkpoint, w));
  std::vector<std::string> unknown;
  for (const SafeTensor &t : file->tensors())
    if (!mapped.count(t.name))
      unknown.push_back("'" + t.name + "'");
  if (!unknown.empty())
    warnings.push_back(
        formatv("--init {0}: {1} tensors the plan's map does not name are not "
                "loaded: {2}",
                checkpoint, unknown.size(),
                join(ArrayRef(unknown).take_front(5), ", ") + (unknown.size() > 5 ? ", ..." : "")));
  return std::move(out);
}

Error saveTrainedParams(const plan::Plan &plan, const std::map<std::string, cpu::Tensor> &trained,
                        StringRef base, double untrainedFactor, StringRef out) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "--save-weights %s: %s", out.str().c_str(),
                             why.str().c_str());
  };
  if (plan.param_map().params().empty())
    return noParamMap("--save-weights " + out.str());
  auto file = SafetensorsFile::open(base);
  if (!file)
    return fail("the parameters the run started from: " + toString(file.takeError()));
  std::map<std::string, cpu::Tensor> tensors;
  std::vector<const plan::Param *> aliases;
  for (const plan::Param &p : plan.param_map().params()) {
    if (!p.alias_of().empty()) {
      aliases.push_back(&p);
      continue;
    }
    // The checkpoint's tensor is read only where it is written as it is, or
    // a slice keeps its other rows; else its shape and dtype are enough.
    auto isSlice = [](const plan::ParamStep &s) { return s.has_slice(); };
    const plan::ParamPlace *from = nullptr;
    for (const plan::ParamPlace &place : p.places())
      if (!from && trained.count(place.weight()))
        from = &place;
    std::optional<cpu::DType> type = safetensorsDTypeOf(p.dtype());
    cpu::Tensor result;
    if (!from || any_of(from->steps(), isSlice) || !type) {
      auto value = paramTensor(*file, p);
      if (!value)
        return fail(toString(value.takeError()));
      result = std::move(*value);
    } else {
      result = cpu::Tensor::uninitialized(*type,
                                          std::vector<int64_t>(p.shape().begin(), p.shape().end()));
    }
    for (const plan::ParamPlace *place = from; place; place = nullptr) {
      auto it = trained.find(place->weight());
      auto back = unplaceParam(it->second, *place, result, untrainedFactor);
      if (!back)
        return fail(formatv("parameter '{0}' from weight '{1}': {2}", p.name(), place->weight(),
                            toString(back.takeError())));
      result = std::move(*back);
    }
    tensors.emplace(p.name(), std::move(result));
  }
  for (const plan::Param *p : aliases) {
    auto it = tensors.find(p->alias_of());
    if (it == tensors.end())
      return fail(formatv("'{0}' is an alias of '{1}', which the map does not hold", p->name(),
                          p->alias_of()));
    tensors.emplace(p->name(), it->second); // written, never changed: shared
  }
  return writeSafetensors(out, tensors, file->metadata());
}

} // namespace pipec::rt
