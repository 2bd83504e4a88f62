//===- ModelIO.cpp - Writing what a run produced -------------------------===//
#include "runtime/exec/ModelIO.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <climits>

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
    if (node.op_type() != "Constant" || node.output_size() != 1)
      continue;
    for (onnx::AttributeProto &a : *node.mutable_attribute())
      if (a.name() == "value" && a.has_t()) {
        a.mutable_t()->set_name(node.output(0));
        if (Error err = refill(*a.mutable_t()))
          return fail(toString(std::move(err)));
      }
  }
  for (const plan::WeightTie &tie : plan.ties()) {
    Error err = tie.transpose_of().empty() ? untieCopies(graph, tie, trained, replaced)
                                           : retieHead(graph, tie);
    if (err)
      return fail(toString(std::move(err)));
  }
  if (replaced < trained.size())
    return fail(formatv("{0} of {1} trained weights are not tensors of {2}",
                        trained.size() - replaced, trained.size(), modelPath));

  // Big models keep their tensors beside the .onnx file.
  size_t total = 0;
  for (const onnx::TensorProto &t : graph.initializer())
    total += t.raw_data().size();
  if (total > (size_t(1) << 30)) {
    std::string dataName = sys::path::filename(out).str() + ".data";
    SmallString<256> dataPath(sys::path::parent_path(out));
    sys::path::append(dataPath, dataName);
    std::string tmp = std::string(dataPath) + ".tmp";
    std::error_code ec;
    raw_fd_ostream os(tmp, ec);
    if (ec)
      return fail(tmp + ": " + ec.message());
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
      return fail(tmp + ": write failed: " + why);
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

} // namespace pipec::rt
