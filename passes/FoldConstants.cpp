//===- FoldConstants.cpp - fold-constants ---------------------------------===//
#include "passes/FoldConstants.h"
#include "support/Attributes.h"
#include "support/FillTensor.h"

#include <google/protobuf/arena.h>

using namespace llvm;

namespace pipec {
namespace {

/// Makes the float parameter a ConstantOfShape fills (a model stored
/// without its weights' bytes) a weight of the graph, as an initializer
/// holding the fill (support/FillTensor.h); returns whether \p op was one.
bool fillToWeight(Graph &graph, Op &op) {
  if (!op.is(OpId::ConstantOfShape) || op.outputs.size() != 1 || op.outputs[0] < 0)
    return false;
  Value &w = graph.values[op.outputs[0]];
  if (w.kind != ValueKind::Weight || !isFloatDType(w.type) || !w.shapeKnown)
    return false;
  auto *t = google::protobuf::Arena::CreateMessage<onnx::TensorProto>(graph.arena.get());
  if (const auto *value = findAttr(graph.node(op), "value"))
    *t = value->t();
  else
    t->add_float_data(0.0f); // ONNX's default fill: a float 0
  if (t->data_type() == 0)
    t->set_data_type(static_cast<int32_t>(DType::F32));
  if (t->data_type() != static_cast<int32_t>(w.type))
    return false;
  t->set_name(w.name);
  t->clear_dims();
  for (int64_t d : w.shape)
    t->add_dims(d);
  t->set_doc_string(fillTensorDoc.str());
  w.tensorIndex =
      graph.model->graph().initializer_size() + static_cast<int>(graph.constantTensors.size());
  graph.constantTensors.push_back(t);
  w.producer = -1;
  op.dead = true;
  return true;
}

} // namespace

Expected<bool> foldConstants(Graph &graph) {
  bool changed = false;
  for (Op &op : graph.ops) {
    if (op.dead || op.outputs.empty())
      continue;
    if (fillToWeight(graph, op)) {
      changed = true;
      continue;
    }
    bool allKnown = true;
    for (int id : op.outputs)
      allKnown &= id >= 0 && graph.values[id].constant != nullptr;
    if (!allKnown)
      continue;
    op.dead = true;
    changed = true;
  }
  if (changed)
    graph.compact();
  return changed;
}

} // namespace pipec
