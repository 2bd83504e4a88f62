//===- ParamMatch.h - Matching weights to parameters by value -----------===//
//
// What driver/MapParams.cpp (a checkpoint's parameters in the graph's
// weights) and driver/GuessParams.cpp (the parameters the graph's structure
// shows) share: weights and parameters with their values, the places that
// hold a parameter in a weight, and which module's nodes read each
// initializer. Internal to the driver.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_DRIVER_PARAMMATCH_H
#define PIPEC_DRIVER_PARAMMATCH_H

#include "compiler/ir/Graph.h"
#include "plan/plan.pb.h"
#include "runtime/core/Tensor.h"
#include "runtime/exec/Safetensors.h"

#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/Support/Error.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace onnx {
class ModelProto;
class NodeProto;
} // namespace onnx

namespace pipec::params {

/// A sum over the elements of a hash of each value: equal for two tensors
/// that hold the same values in any order (a transpose).
uint64_t fingerprint(const cpu::Tensor &t);
/// Whether \p t holds one number in every element.
bool oneValue(const cpu::Tensor &t);
/// \p t as the constant a new weight holds.
std::shared_ptr<ConstTensor> constantOf(const cpu::Tensor &t, DType type);

struct Weight {
  std::string name;
  cpu::Tensor value;
  bool trained = false;
  uint64_t print = 0;
};

struct Param {
  const rt::SafeTensor *tensor = nullptr;
  cpu::Tensor value;
  std::map<cpu::DType, std::pair<cpu::Tensor, uint64_t>> cast; ///< per weight type
  std::vector<plan::ParamPlace> places;
  std::string aliasOf;
  /// Each value to its flat index, when every entry differs (findTaken's).
  std::optional<std::unordered_map<double, int64_t>> entries;

  const std::pair<cpu::Tensor, uint64_t> &as(cpu::DType type) {
    auto it = cast.find(type);
    if (it != cast.end())
      return it->second;
    if (type == value.elemType()) // shares value's storage
      return cast.emplace(type, std::make_pair(value, fingerprint(value))).first->second;
    cpu::Tensor t(type, value.shape());
    for (int64_t i = 0; i < t.numElements(); ++i)
      t.setDouble(i, value.getDouble(i));
    t.roundToElemType();
    uint64_t print = fingerprint(t);
    return cast.emplace(type, std::make_pair(std::move(t), print)).first->second;
  }
};

struct Match {
  size_t param;
  plan::ParamPlace place;
};

/// A node's read of an initializer, and the module the node belongs to.
struct Reader {
  int node = -1, input = -1;
  std::string scope;
};

/// The places that hold \p p in \p w (MapParams.cpp).
std::vector<plan::ParamPlace> findPlaces(const Weight &w, Param &p);

/// The reads of each initializer of \p model by the main graph's nodes (its
/// first \p nodes when given: the file's, before those passes appended).
std::map<std::string, std::vector<Reader>> readersOf(const onnx::ModelProto &model, int nodes = -1);

/// The float weights of \p graph that its ops read, stored in its files or
/// inline (typed data); with \p wanted, those it keeps (their values alone
/// are read). A light model's fills hold no values to compare: none.
llvm::Expected<std::vector<Weight>>
graphWeights(const Graph &graph, llvm::function_ref<bool(const Value &)> wanted = nullptr);

} // namespace pipec::params

#endif // PIPEC_DRIVER_PARAMMATCH_H
