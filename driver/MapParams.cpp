//===- MapParams.cpp - Which checkpoint tensor each weight holds ----------===//
#include "driver/MapParams.h"
#include "driver/ParamMatch.h"

#include "runtime/exec/ParamMap.h"
#include "runtime/exec/Safetensors.h"
#include "support/InputFile.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>

using namespace llvm;

namespace pipec {
namespace params {

std::string shapeText(ArrayRef<int64_t> shape) {
  return "[" + join(map_range(shape, [](int64_t d) { return std::to_string(d); }), ",") + "]";
}

/// A sum over the elements of a hash of each value: equal for two tensors
/// that hold the same values in any order (a transpose), so that only
/// candidates that can match are compared element by element.
uint64_t mix(double v) {
  uint64_t x;
  std::memcpy(&x, &v, sizeof x);
  x += 0x9e3779b97f4a7c15ULL; // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t fingerprint(const cpu::Tensor &t) {
  uint64_t sum = 0;
  int64_t n = t.numElements();
  if (cpu::storedAs<float>(t.elemType())) {
    const float *v = t.data<float>();
    for (int64_t i = 0; i < n; ++i)
      sum += mix(v[i]);
  } else {
    for (int64_t i = 0; i < n; ++i)
      sum += mix(t.getDouble(i));
  }
  return sum;
}

bool sameValues(const cpu::Tensor &a, const cpu::Tensor &b) {
  if (a.shape() != b.shape())
    return false;
  auto same = [](double x, double y) { return x == y || (std::isnan(x) && std::isnan(y)); };
  if (cpu::storedAs<float>(a.elemType()) && cpu::storedAs<float>(b.elemType())) {
    const float *x = a.data<float>(), *y = b.data<float>();
    for (int64_t i = 0; i < a.numElements(); ++i)
      if (!same(x[i], y[i]))
        return false;
    return true;
  }
  for (int64_t i = 0; i < a.numElements(); ++i)
    if (!same(a.getDouble(i), b.getDouble(i)))
      return false;
  return true;
}

/// Whether \p t holds one number in every element.
bool oneValue(const cpu::Tensor &t) {
  for (int64_t i = 1; i < t.numElements(); ++i)
    if (t.getDouble(i) != t.getDouble(0))
      return false;
  return true;
}

/// \p t as the constant a new weight holds.
std::shared_ptr<ConstTensor> constantOf(const cpu::Tensor &t, DType type) {
  auto value = std::make_shared<ConstTensor>();
  value->type = type;
  value->shape = t.shape();
  value->floats.resize(t.numElements());
  for (int64_t i = 0; i < t.numElements(); ++i)
    value->floats[i] = t.getDouble(i);
  return value;
}

/// findPlaces' slices and copies: the rows [s, s + n) along at most one
/// axis, or one row there repeated; new leading axes; copies along every
/// axis longer than the parameter's (after the slice). Each start s that
/// the weight's first element allows is tried.
std::vector<plan::ParamPlace> findCopies(const Weight &w, Param &p) {
  std::vector<plan::ParamPlace> found;
  ArrayRef<int64_t> ws = w.value.shape(), ps = p.value.shape();
  size_t lead = ws.size() - ps.size();
  ArrayRef<int64_t> core = ws.drop_front(lead);
  int axis = -1;
  for (size_t a = 0; a < ps.size(); ++a) {
    if (core[a] == ps[a] || ps[a] == 1)
      continue;
    if (axis >= 0)
      return found;
    axis = static_cast<int>(a);
  }
  // A weight of one value (a fresh bias, a mask's fill) holds any constant
  // parameter's copies: no evidence of a fold.
  if (oneValue(w.value))
    return found;
  const cpu::Tensor &cast = p.as(w.value.elemType()).first;
  int64_t rows = axis < 0 ? 0 : core[axis] < ps[axis] ? core[axis] : 1;
  int64_t inner = 1;
  for (size_t a = axis + 1; axis >= 0 && a < ps.size(); ++a)
    inner *= ps[a];
  for (int64_t start = 0; found.empty() && (axis < 0 ? start == 0 : start + rows <= ps[axis]);
       ++start) {
    if (cast.getDouble(start * inner) != w.value.getDouble(0))
      continue;
    plan::ParamPlace place;
    place.set_weight(w.name);
    std::vector<int64_t> shape(ps.begin(), ps.end());
    if (axis >= 0 && rows < ps[axis]) {
      auto *slice = place.add_steps()->mutable_slice();
      slice->set_axis(axis);
      slice->set_start(start);
      slice->set_stop(start + rows);
      shape[axis] = rows;
    }
    for (size_t i = 0; i < lead; ++i) {
      place.add_steps()->set_unsqueeze(0);
      shape.insert(shape.begin(), 1);
    }
    for (size_t a = 0; a < ws.size(); ++a)
      if (shape[a] != ws[a]) {
        if (shape[a] != 1)
          return found;
        auto *b = place.add_steps()->mutable_broadcast();
        b->set_axis(static_cast<int>(a));
        b->set_size(ws[a]);
      }
    auto placed = rt::placeParam(p.value, place, w.value.elemType());
    if (placed && sameValues(*placed, w.value))
      found.push_back(std::move(place));
    else if (!placed)
      consumeError(placed.takeError());
  }
  return found;
}

/// The places that hold \p p in \p w: a permutation of its axes, then new
/// leading axes of size 1; or along at most one axis the rows [s, s + n)
/// (a position table read at an offset) or one row repeated, then new
/// leading axes, and copies along the axes the parameter lacks or has of
/// size 1 (a class token or a position slice expanded over the batch).
/// None, or the constant added, in findShifted.
std::vector<plan::ParamPlace> findPlaces(const Weight &w, Param &p) {
  std::vector<plan::ParamPlace> found;
  ArrayRef<int64_t> ws = w.value.shape(), ps = p.value.shape();
  if (ws.size() < ps.size() || w.value.numElements() == 0)
    return found;
  size_t lead = ws.size() - ps.size();
  ArrayRef<int64_t> core = ws.drop_front(lead);
  if (any_of(ws.take_front(lead), [](int64_t d) { return d != 1; }) ||
      w.value.numElements() != p.value.numElements())
    return findCopies(w, p);
  auto finish = [&](plan::ParamPlace place) {
    for (size_t i = 0; i < lead; ++i)
      place.add_steps()->set_unsqueeze(0);
    return place;
  };
  const std::pair<cpu::Tensor, uint64_t> &castAndPrint = p.as(w.value.elemType());
  const cpu::Tensor &cast = castAndPrint.first;
  uint64_t print = castAndPrint.second;
  auto verify = [&](plan::ParamPlace place) {
    place.set_weight(w.name);
    place = finish(std::move(place));
    if (place.steps().empty()) { // the cast tensor is the weight's value
      if (sameValues(cast, w.value))
        found.push_back(std::move(place));
      return;
    }
    auto placed = rt::placeParam(p.value, place, w.value.elemType());
    if (placed && sameValues(*placed, w.value))
      found.push_back(std::move(place));
    else if (!placed)
      consumeError(placed.takeError());
  };
  if (w.value.numElements() == p.value.numElements()) {
    if (print != w.print)
      return found;
    std::vector<int32_t> perm(ps.size());
    std::iota(perm.begin(), perm.end(), 0);
    if (core == ps)
      verify(plan::ParamPlace());
    if (ps.size() < 2 || ps.size() > 4 || !found.empty())
      return found;
    while (std::next_permutation(perm.begin(), perm.end())) {
      bool fits = true;
      for (size_t j = 0; j < perm.size(); ++j)
        fits = fits && ps[perm[j]] == core[j];
      if (!fits)
        continue;
      plan::ParamPlace place;
      auto *t = place.add_steps()->mutable_transpose();
      for (int32_t a : perm)
        t->add_perm(a);
      verify(std::move(place));
    }
    return found;
  }
  return found;
}

/// The place that holds \p p in \p w plus a constant (Gemma's norm scale
/// exported as 1 + w), if one does.
std::optional<plan::ParamPlace> findShifted(const Weight &w, Param &p) {
  ArrayRef<int64_t> ws = w.value.shape(), ps = p.value.shape();
  int64_t n = w.value.numElements();
  if (n == 0 || ws.size() < ps.size() || n != p.value.numElements() ||
      ws.drop_front(ws.size() - ps.size()) != ps)
    return std::nullopt;
  const cpu::Tensor &cast = p.as(w.value.elemType()).first;
  // The constant, rounded to 6 decimals: the exporter added a short one
  // (1, 0.5), and w[0] - p[0] holds it with the sum's rounding.
  auto constantAt = [&](int64_t i) {
    return std::round((w.value.getDouble(i) - cast.getDouble(i)) * 1e6) / 1e6;
  };
  double c = constantAt(0);
  if (c == 0 || !std::isfinite(c) || constantAt(n - 1) != c)
    return std::nullopt;
  plan::ParamPlace place;
  place.set_weight(w.name);
  place.add_steps()->set_add(c);
  for (size_t i = 0; i < ws.size() - ps.size(); ++i)
    place.add_steps()->set_unsqueeze(0);
  auto placed = rt::placeParam(p.value, place, w.value.elemType());
  if (!placed) {
    consumeError(placed.takeError());
    return std::nullopt;
  }
  if (!sameValues(*placed, w.value))
    return std::nullopt;
  return place;
}

/// The place that holds \p p in \p w as a gather of its entries by constant
/// indices (T5's relative position bias: [1, heads, S, S] of a [buckets,
/// heads] table), if one does: every value of \p w is one of \p p's, whose
/// values all differ (so each names one entry). Tables up to 64K entries.
std::optional<plan::ParamPlace> findTaken(const Weight &w, Param &p) {
  constexpr int64_t kMaxTable = int64_t(1) << 16, kMaxWeight = int64_t(1) << 24;
  int64_t n = w.value.numElements(), m = p.value.numElements();
  if (m < 2 || m > kMaxTable || n < 2 || n > kMaxWeight || oneValue(w.value))
    return std::nullopt;
  const cpu::Tensor &cast = p.as(w.value.elemType()).first;
  if (!p.entries) {
    p.entries.emplace();
    for (int64_t i = 0; i < m; ++i)
      if (!p.entries->emplace(cast.getDouble(i), i).second) {
        p.entries->clear(); // two entries alike: no index is certain
        break;
      }
  }
  if (p.entries->empty() || !p.entries->count(w.value.getDouble(0)))
    return std::nullopt;
  plan::ParamPlace place;
  place.set_weight(w.name);
  plan::Take &take = *place.add_steps()->mutable_take();
  for (int64_t k = 0; k < n; ++k) {
    auto it = p.entries->find(w.value.getDouble(k));
    if (it == p.entries->end())
      return std::nullopt;
    take.add_indices(it->second);
  }
  for (int64_t d : w.value.shape())
    take.add_shape(d);
  return place;
}

/// True when \p weight carries \p param's name: equal, or after a wrapping
/// module's prefix ("m.transformer.wte.weight" for "transformer.wte.weight").
bool carriesName(StringRef weight, StringRef param) {
  return weight == param || (weight.endswith(param) && weight.size() > param.size() &&
                             weight[weight.size() - param.size() - 1] == '.');
}

/// The module of \p node: the dynamo exporter's "pkg.torch.onnx.name_scopes"
/// (the module path before the op's own name,
/// "m.model.layers.0.input_layernorm"), or the legacy exporter's node name
/// ("/m/model/layers.0/input_layernorm/Mul"); "" when it has neither.
std::string scopeOf(const onnx::NodeProto &node) {
  for (const onnx::StringStringEntryProto &entry : node.metadata_props())
    if (entry.key() == "pkg.torch.onnx.name_scopes") {
      // A Python list of strings: the module path is the one before last.
      SmallVector<StringRef, 8> parts;
      StringRef(entry.value()).split(parts, '\'');
      std::vector<std::string> items;
      for (size_t i = 1; i < parts.size(); i += 2)
        items.push_back(parts[i].str());
      if (items.size() >= 2)
        return items[items.size() - 2];
    }
  StringRef name(node.name());
  if (!name.consume_front("/") || !name.contains('/'))
    return "";
  std::string scope = name.rsplit('/').first.str();
  std::replace(scope.begin(), scope.end(), '/', '.');
  return scope;
}

/// The model file at \p path, or nullopt when it does not parse (the
/// compile that read it already said why).
std::optional<onnx::ModelProto> parseModel(StringRef path) {
  auto file = readInputFile(path);
  if (!file) {
    consumeError(file.takeError());
    return std::nullopt;
  }
  if ((*file)->getBufferSize() > size_t(INT_MAX))
    return std::nullopt;
  onnx::ModelProto model;
  if (!model.ParseFromArray((*file)->getBufferStart(), int((*file)->getBufferSize())))
    return std::nullopt;
  return model;
}

/// The reads of each initializer of \p model by the main graph's nodes.
std::map<std::string, std::vector<Reader>> readersOf(const onnx::ModelProto &model, int nodes) {
  std::set<std::string> initializers;
  for (const onnx::TensorProto &t : model.graph().initializer())
    initializers.insert(t.name());
  std::map<std::string, std::vector<Reader>> readers;
  int count = nodes < 0 ? model.graph().node_size() : std::min(nodes, model.graph().node_size());
  for (int n = 0; n < count; ++n) {
    const onnx::NodeProto &node = model.graph().node(n);
    std::string scope = scopeOf(node);
    for (int i = 0; i < node.input_size(); ++i)
      if (initializers.count(node.input(i)))
        readers[node.input(i)].push_back({n, i, scope});
  }
  return readers;
}

/// The modules whose nodes read each initializer of the model at \p path.
std::map<std::string, std::set<std::string>> readerScopes(StringRef path) {
  std::map<std::string, std::set<std::string>> scopes;
  if (auto model = parseModel(path))
    for (const auto &[name, readers] : readersOf(*model))
      for (const Reader &r : readers)
        if (!r.scope.empty())
          scopes[name].insert(r.scope);
  return scopes;
}

/// True when a node of module \p scope may read parameter \p param: the
/// parameter's module ("model.layers.0.input_layernorm" of its name) is the
/// scope, after a wrapping module's prefix.
bool readsInScope(StringRef scope, StringRef param) {
  StringRef module = param.rsplit('.').first;
  if (module == param)
    return false;
  return scope == module || (scope.endswith(module) && scope.size() > module.size() &&
                             scope[scope.size() - module.size() - 1] == '.');
}

} // namespace params

using namespace params;

namespace params {

/// The float weights of \p graph that its ops read, stored in its files or
/// inline (typed data); with \p wanted, those it keeps (their values alone
/// are read). A light model's fills hold no values to compare: none.
Expected<std::vector<Weight>> graphWeights(const Graph &graph,
                                           function_ref<bool(const Value &)> wanted) {
  std::vector<Weight> weights;
  for (size_t id = 0; id < graph.values.size(); ++id) {
    const Value &v = graph.values[id];
    if (v.kind != ValueKind::Weight || v.producer >= 0 || v.users.empty() || !v.shapeKnown ||
        (v.type != DType::F32 && v.type != DType::F64) ||
        graph.isFillWeight(static_cast<int>(id)) || (wanted && !wanted(v)))
      continue; // 16-bit floats are held as float32 in memory: not read here
    cpu::Tensor value(v.type, v.shape);
    if (v.storage) {
      auto bytes = graph.storageBytes(v);
      if (!bytes)
        return bytes.takeError();
      if (bytes->size() != value.byteSize())
        continue;
      std::memcpy(value.rawData(), bytes->data(), bytes->size());
    } else {
      auto known = graph.readConstant(static_cast<int>(id), value.numElements());
      if (!known) {
        consumeError(known.takeError());
        continue;
      }
      if (int64_t((*known)->floats.size()) != value.numElements())
        continue;
      for (int64_t i = 0; i < value.numElements(); ++i)
        value.setDouble(i, (*known)->floats[i]);
    }
    Weight w;
    w.name = v.name;
    w.print = fingerprint(value);
    w.value = std::move(value);
    w.trained = true;
    weights.push_back(std::move(w));
  }
  return std::move(weights);
}

} // namespace params

Expected<std::map<std::string, std::vector<ParamSplit>>> splitMergedParams(StringRef modelPath,
                                                                           StringRef checkpoint) {
  std::map<std::string, std::vector<ParamSplit>> splits;
  auto model = parseModel(modelPath);
  if (!model)
    return splits;
  auto file = rt::SafetensorsFile::open(checkpoint);
  if (!file)
    return file.takeError();
  SmallString<256> modelDir(sys::path::parent_path(modelPath));
  if (modelDir.empty())
    modelDir = ".";
  std::map<std::string, const onnx::TensorProto *> initializers;
  for (const onnx::TensorProto &t : model->graph().initializer())
    initializers[t.name()] = &t;
  std::map<std::string, Param> params; // read when a scope asks for them
  for (const auto &[name, readers] : readersOf(*model)) {
    std::set<std::string> scopes;
    for (const Reader &r : readers)
      if (!r.scope.empty())
        scopes.insert(r.scope);
    if (scopes.size() < 2)
      continue;
    auto value = cpu::fromTensorProto(*initializers[name], modelDir);
    if (!value) {
      consumeError(value.takeError());
      continue;
    }
    if (!cpu::isFloating(value->elemType()))
      continue;
    Weight w;
    w.name = name;
    w.print = fingerprint(*value);
    w.value = std::move(*value);
    // Each module's parameter: the one of its name whose values the
    // initializer holds.
    std::map<std::string, std::string> paramOf;
    for (const std::string &scope : scopes) {
      // As mapParams: a constant added only where nothing else matched.
      std::vector<std::string> found, shifted;
      for (const rt::SafeTensor &t : file->tensors()) {
        if (!readsInScope(scope, t.name) || !cpu::isFloating(t.type))
          continue;
        auto it = params.find(t.name);
        if (it == params.end()) {
          auto tensor = file->toTensor(t);
          if (!tensor)
            return tensor.takeError();
          Param p;
          p.tensor = &t;
          p.value = std::move(*tensor);
          it = params.emplace(t.name, std::move(p)).first;
        }
        if (!findPlaces(w, it->second).empty())
          found.push_back(t.name);
        else if (findShifted(w, it->second))
          shifted.push_back(t.name);
      }
      if (found.empty())
        found = shifted;
      if (found.size() == 1)
        paramOf[scope] = found[0];
    }
    std::vector<std::string> order; // the parameters, by first reader
    for (const Reader &r : readers)
      if (auto it = paramOf.find(r.scope); it != paramOf.end() && !is_contained(order, it->second))
        order.push_back(it->second);
    if (order.size() < 2)
      continue;
    const std::string &initializer = name;
    bool carried = any_of(order, [&](const std::string &p) { return carriesName(initializer, p); });
    for (const std::string &p : order) {
      if (carried && carriesName(name, p))
        continue;
      ParamSplit split;
      split.param = p;
      split.copy = name + "." + p;
      for (const Reader &r : readers)
        if (auto it = paramOf.find(r.scope); it != paramOf.end() && it->second == p)
          split.readers.push_back({r.node, r.input});
      splits[name].push_back(std::move(split));
    }
  }
  return splits;
}

namespace {

/// The plan's float weights, with their values.
Expected<std::vector<Weight>> loadWeights(const plan::Plan &plan) {
  SmallString<256> modelDir(sys::path::parent_path(plan.model().path()));
  if (modelDir.empty())
    modelDir = ".";
  std::set<std::string> trainable(plan.trainable().begin(), plan.trainable().end());
  std::vector<Weight> weights;
  for (const onnx::TensorProto &t : plan.weights()) {
    auto value = cpu::fromTensorProto(t, modelDir);
    if (!value)
      return value.takeError();
    if (!cpu::isFloating(value->elemType()))
      continue;
    Weight w;
    w.name = t.name();
    w.print = fingerprint(*value);
    w.value = std::move(*value);
    w.trained = trainable.count(w.name) > 0;
    weights.push_back(std::move(w));
  }
  return std::move(weights);
}

/// The checkpoint's tensors, in name order.
Expected<std::vector<Param>> loadParams(const rt::SafetensorsFile &file) {
  std::vector<Param> params;
  std::map<std::string, const rt::SafeTensor *> byName;
  for (const rt::SafeTensor &t : file.tensors())
    byName[t.name] = &t;
  for (const auto &[name, t] : byName) {
    auto value = file.toTensor(*t);
    if (!value)
      return value.takeError();
    Param p;
    p.tensor = t;
    p.value = std::move(*value);
    params.push_back(std::move(p));
  }

  return std::move(params);
}

/// Every (weight, parameter) pair whose values agree under some transform;
/// a constant added only where nothing else matched, a gather of entries
/// only where neither did.
std::vector<std::vector<Match>> matchAll(const std::vector<Weight> &weights,
                                         std::vector<Param> &params) {
  std::vector<std::vector<Match>> matches(weights.size());
  for (size_t w = 0; w < weights.size(); ++w) {
    for (size_t p = 0; p < params.size(); ++p)
      if (cpu::isFloating(params[p].value.elemType()))
        for (plan::ParamPlace &place : findPlaces(weights[w], params[p]))
          matches[w].push_back({p, std::move(place)});
    if (matches[w].empty())
      for (size_t p = 0; p < params.size(); ++p)
        if (cpu::isFloating(params[p].value.elemType()))
          if (auto place = findShifted(weights[w], params[p]))
            matches[w].push_back({p, std::move(*place)});
    if (matches[w].empty())
      for (size_t p = 0; p < params.size(); ++p)
        if (cpu::isFloating(params[p].value.elemType()))
          if (auto place = findTaken(weights[w], params[p]))
            matches[w].push_back({p, std::move(*place)});
  }
  return matches;
}

/// Gives each weight one parameter, into that parameter's places: the only
/// one it matches; else the one whose name the weight carries; else the only
/// one whose module reads the weight in the graph; else the only one no
/// other weight holds. Ties left open go to \p problems.
void choose(const std::vector<Weight> &weights, std::vector<Param> &params,
            std::vector<std::vector<Match>> &matches,
            const std::map<std::string, std::set<std::string>> &scopes,
            std::vector<std::string> &problems) {
  std::vector<int> chosen(weights.size(), -1);
  std::set<size_t> held;
  for (size_t w = 0; w < weights.size(); ++w) {
    if (matches[w].size() == 1)
      chosen[w] = 0;
    for (size_t m = 0; m < matches[w].size() && matches[w].size() > 1; ++m)
      if (carriesName(weights[w].name, params[matches[w][m].param].tensor->name))
        chosen[w] = static_cast<int>(m);
    auto scope = scopes.find(weights[w].name);
    if (chosen[w] < 0 && matches[w].size() > 1 && scope != scopes.end()) {
      std::vector<int> read;
      for (size_t m = 0; m < matches[w].size(); ++m)
        if (any_of(scope->second, [&](const std::string &s) {
              return readsInScope(s, params[matches[w][m].param].tensor->name);
            }))
          read.push_back(static_cast<int>(m));
      if (read.size() == 1)
        chosen[w] = read[0];
    }
    if (chosen[w] >= 0)
      held.insert(matches[w][chosen[w]].param);
  }
  for (size_t w = 0; w < weights.size(); ++w) {
    if (chosen[w] >= 0 || matches[w].empty())
      continue;
    std::vector<int> free;
    std::vector<std::string> names;
    for (size_t m = 0; m < matches[w].size(); ++m) {
      names.push_back("'" + params[matches[w][m].param].tensor->name + "'");
      if (!held.count(matches[w][m].param))
        free.push_back(static_cast<int>(m));
    }
    if (free.size() == 1) {
      chosen[w] = free[0];
      held.insert(matches[w][free[0]].param);
      continue;
    }
    problems.push_back(formatv("weight '{0}' holds the values of {1} alike (equal "
                               "parameters); it is mapped to none of them",
                               weights[w].name, join(names, ", ")));
  }
  for (size_t w = 0; w < weights.size(); ++w)
    if (chosen[w] >= 0) {
      Match &m = matches[w][chosen[w]];
      params[m.param].places.push_back(std::move(m.place));
    }
}

/// Names the checkpoint leaves out: a parameter whose module reads a weight
/// that holds another of equal values (two names of one tied tensor: the
/// embedding and the head that reads it; set as its aliasOf), and a weight
/// exported under its parameter's other name (the tied head save_pretrained
/// writes once; returned as {name, parameter}).
std::vector<std::pair<std::string, std::string>>
findAliases(std::vector<Param> &params, const std::map<std::string, std::set<std::string>> &scopes,
            const rt::SafetensorsFile &file, const std::set<std::string> &made) {
  for (Param &p : params) {
    if (!p.places.empty() || !cpu::isFloating(p.value.elemType()))
      continue;
    for (const Param &q : params) {
      bool readHere = any_of(q.places, [&](const plan::ParamPlace &place) {
        auto scope = scopes.find(place.weight());
        return scope != scopes.end() && any_of(scope->second, [&](const std::string &s) {
                 return readsInScope(s, p.tensor->name);
               });
      });
      if (readHere && q.tensor->type == p.tensor->type && sameValues(q.value, p.value)) {
        p.aliasOf = q.tensor->name;
        break;
      }
    }
  }
  std::map<std::string, int> prefixes;
  for (const Param &p : params)
    for (const plan::ParamPlace &place : p.places)
      if (place.steps().empty() && carriesName(place.weight(), p.tensor->name) &&
          !made.count(place.weight()))
        ++prefixes[place.weight().substr(0, place.weight().size() - p.tensor->name.size())];
  std::string prefix;
  int most = 0;
  for (const auto &[text, count] : prefixes)
    if (count > most) {
      most = count;
      prefix = text;
    }
  std::vector<std::pair<std::string, std::string>> extraAliases;
  for (const Param &p : params)
    for (const plan::ParamPlace &place : p.places) {
      StringRef rest(place.weight());
      // Without a weight to show the wrapper's prefix, a name of three
      // parts or more ("m.lm_head.weight") is taken to have one.
      if (most == 0 && rest.count('.') >= 2)
        rest = rest.split('.').second;
      if (!place.steps().empty() || carriesName(place.weight(), p.tensor->name) ||
          !rest.consume_front(prefix) || rest == p.tensor->name || file.find(rest))
        continue;
      extraAliases.push_back({rest.str(), p.tensor->name});
    }
  return extraAliases;
}

} // namespace

namespace {

/// A checkpoint, its tensors, and every (weight, parameter) pair that
/// matches (matchAll). `params` point into `file`.
struct Matched {
  rt::SafetensorsFile file;
  std::vector<Weight> weights;
  std::vector<Param> params;
  std::vector<std::vector<Match>> matches;
};

Expected<std::unique_ptr<Matched>> matchCheckpoint(StringRef checkpoint,
                                                   Expected<std::vector<Weight>> weights) {
  if (!weights)
    return weights.takeError();
  auto file = rt::SafetensorsFile::open(checkpoint);
  if (!file)
    return file.takeError();
  auto out = std::make_unique<Matched>(Matched{std::move(*file), std::move(*weights), {}, {}});
  auto params = loadParams(out->file);
  if (!params)
    return params.takeError();
  out->params = std::move(*params);
  out->matches = matchAll(out->weights, out->params);
  return std::move(out);
}

} // namespace

Expected<std::vector<ParamFold>> findParamFolds(const Graph &graph, StringRef checkpoint,
                                                std::set<std::string> &matched,
                                                bool &everyParamHeld) {
  auto found = matchCheckpoint(checkpoint, graphWeights(graph));
  if (!found)
    return found.takeError();
  std::vector<Weight> &weights = (*found)->weights;
  std::vector<Param> &params = (*found)->params;
  for (size_t w = 0; w < weights.size(); ++w)
    if (!(*found)->matches[w].empty())
      matched.insert(weights[w].name);
  std::vector<std::string> problems; // mapParams reports them on the plan
  choose(weights, params, (*found)->matches, readerScopes(graph.path), problems);
  std::vector<ParamFold> folds;
  everyParamHeld = true;
  for (Param &p : params) {
    if (p.places.empty()) {
      everyParamHeld = everyParamHeld && !cpu::isFloating(p.value.elemType());
      continue;
    }
    const Weight *first = nullptr;
    for (const Weight &w : weights)
      if (w.name == p.places[0].weight())
        first = &w;
    ParamFold fold;
    fold.param = p.tensor->name;
    fold.value = constantOf(p.as(first->value.elemType()).first, first->value.elemType());
    fold.places = std::move(p.places);
    folds.push_back(std::move(fold));
  }
  return folds;
}

Expected<ParamMapSummary> mapParams(plan::Plan &plan, StringRef checkpoint) {
  auto found = matchCheckpoint(checkpoint, loadWeights(plan));
  if (!found)
    return found.takeError();
  rt::SafetensorsFile *file = &(*found)->file;
  std::vector<Weight> *weights = &(*found)->weights;
  std::vector<Param> *params = &(*found)->params;
  std::vector<std::vector<Match>> &matches = (*found)->matches;
  ParamMapSummary summary;
  std::map<std::string, std::set<std::string>> scopes = readerScopes(plan.model().path());
  choose(*weights, *params, matches, scopes, summary.problems);
  // train-params' weights carry their parameter's own name, not the
  // exporter's prefix.
  std::set<std::string> made;
  for (const plan::WeightTie &tie : plan.ties())
    if (!tie.param_weight().empty())
      made.insert(tie.param_weight());
  std::vector<std::pair<std::string, std::string>> extraAliases =
      findAliases(*params, scopes, *file, made);

  plan::ParamMap &map = *plan.mutable_param_map();
  map.Clear();
  SmallString<256> absolute(checkpoint);
  sys::fs::make_absolute(absolute);
  map.set_checkpoint(std::string(absolute));
  std::set<std::string> trainedHeld;
  for (Param &p : *params) {
    plan::Param &entry = *map.add_params();
    entry.set_name(p.tensor->name);
    entry.set_dtype(rt::safetensorsDType(p.tensor->type).str());
    for (int64_t d : p.tensor->shape)
      entry.add_shape(d);
    entry.set_alias_of(p.aliasOf);
    bool folded = false;
    for (plan::ParamPlace &place : p.places) {
      folded = folded || !place.steps().empty();
      trainedHeld.insert(place.weight());
      *entry.add_places() = std::move(place);
    }
    if (!cpu::isFloating(p.value.elemType()))
      continue;
    ++summary.params;
    summary.placed += entry.places_size() > 0;
    summary.folded += folded;
    summary.aliases += !p.aliasOf.empty();
    if (entry.places_size() == 0 && p.aliasOf.empty())
      summary.problems.push_back(formatv(
          "parameter '{0}' {1}: no weight of the model holds it; the graph does not read it, or "
          "the exporter folded it into a constant (torch.onnx.export(..., optimize=False) keeps "
          "parameters as they are; the legacy exporter: do_constant_folding=False); "
          "--save-weights writes it unchanged",
          p.tensor->name, shapeText(p.tensor->shape)));
  }
  for (const auto &[alias, of] : extraAliases) {
    plan::Param &entry = *map.add_params();
    entry.set_name(alias);
    entry.set_alias_of(of);
    const rt::SafeTensor *t = file->find(of);
    entry.set_dtype(rt::safetensorsDType(t->type).str());
    for (int64_t d : t->shape)
      entry.add_shape(d);
    ++summary.aliases;
  }
  for (const Weight &w : *weights)
    if (w.trained && !trainedHeld.count(w.name))
      summary.problems.push_back(
          formatv("trained weight '{0}' {1} holds no tensor of {2}; --save-weights .safetensors "
                  "cannot write what it learns",
                  w.name, shapeText(w.value.shape()), checkpoint));
  if (summary.placed == 0)
    return createStringError(inconvertibleErrorCode(),
                             "--params %s: no weight of %s holds any of its %d tensors; is it "
                             "the checkpoint of this model?",
                             checkpoint.str().c_str(), plan.model().path().c_str(), summary.params);
  for (const std::string &line : summary.problems)
    plan.add_warnings("--params: " + line);
  return std::move(summary);
}

} // namespace pipec
