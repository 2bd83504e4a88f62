//===- InspectReport.cpp - `pipec inspect` as text and JSON ---------------===//
#include "driver/InspectReport.h"

#include "ops/OpRegistry.h"

#include "onnx/onnx_pb.h"

#include "plan/PlanFile.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"

#include <map>

using namespace llvm;

namespace pipec {

std::string humanCount(int64_t value, bool binary) {
  const char *units[] = {"", "K", "M", "G", "T", "P"};
  double base = binary ? 1024.0 : 1000.0;
  double v = static_cast<double>(value);
  int unit = 0;
  while (std::abs(v) >= base && unit < 5)
    v /= base, ++unit;
  if (unit == 0)
    return formatv("{0}{1}", value, binary ? " B" : "").str();
  return formatv("{0:f2} {1}{2}", v, units[unit], binary ? "iB" : "").str();
}

std::vector<std::string> opWarnings(const Graph &graph) {
  std::map<std::string, int> unsupported;
  for (const Op &op : graph.ops) {
    if (op.dead)
      continue;
    std::string type = op.domain.empty() ? op.opType : op.domain + "." + op.opType;
    const OpDef *def = lookupOp(op.domain, op.opType, graph.opsetFor(op.domain));
    if (!def || !def->hasCpuKernel)
      ++unsupported[type];
  }
  std::vector<std::string> warnings;
  if (!unsupported.empty()) {
    std::string list;
    for (auto &[type, count] : unsupported)
      list += formatv("{0}{1} x{2}", list.empty() ? "" : ", ", type, count).str();
    warnings.push_back("ops the runtime will not run: " + list);
  }
  return warnings;
}

InspectReport makeInspectReport(const Graph &graph, const LayerGraph &layers) {
  InspectReport report;
  report.xxh3 = contentHash(graph.files[0]->getBuffer());
  report.nodes = graph.model->graph().node_size();
  report.params = layers.totalParams();
  for (const Layer &layer : layers.layers)
    report.flopsForward += layer.flopsForward;
  report.warnings = graph.warnings;
  for (std::string &warning : opWarnings(graph))
    report.warnings.push_back(std::move(warning));
  for (auto &[w, users] : layers.sharedWeights()) {
    std::string ls;
    for (int l : users)
      ls += (ls.empty() ? "" : ", ") + std::to_string(l);
    report.warnings.push_back(formatv("weight '{0}' is shared by layers {1}; if they land on "
                                      "different stages each keeps a copy and their gradients "
                                      "are all-reduced",
                                      graph.values[w].name, ls)
                                  .str());
  }
  return report;
}

void printInspectText(const InspectReport &report, const Graph &graph, const LayerGraph &layers,
                      raw_ostream &os) {
  os << formatv("model    {0}\n", graph.path);
  os << formatv("xxh3     {0}\n", report.xxh3);
  os << formatv("nodes    {0} in the file, {1} after folding; opset {2}\n", report.nodes,
                graph.liveOpCount(), graph.opsetFor(""));
  os << formatv("layers   {0} (grouped by {1})\n\n", layers.layers.size(),
                groupingMethodName(layers.method));
  size_t nameWidth = 4;
  for (const Layer &layer : layers.layers)
    nameWidth = std::max(nameWidth, layer.name.size());
  nameWidth = std::min<size_t>(nameWidth, 48);
  os << formatv("{0,5}  {1}  {2,-9} {3,6} {4,12} {5,12} {6,12} {7,14}\n", "index",
                left_justify("name", nameWidth), "kind", "ops", "params", "fwd FLOPs", "act bytes",
                "boundary bytes");
  int64_t totalActivation = 0;
  for (size_t i = 0; i < layers.layers.size(); ++i) {
    const Layer &layer = layers.layers[i];
    std::string name = layer.name.size() > nameWidth
                           ? "..." + layer.name.substr(layer.name.size() - nameWidth + 3)
                           : layer.name;
    int64_t boundary = i + 1 < layers.layers.size() ? layers.boundaryBytes(i) : 0;
    totalActivation += layer.activationBytes;
    os << formatv("{0,5}  {1}  {2,-9} {3,6} {4,12} {5,12} {6,12} {7,14}\n", i,
                  left_justify(name, nameWidth), layerKindName(layer.kind), layer.ops.size(),
                  humanCount(layer.params), humanCount(layer.flopsForward),
                  humanCount(layer.activationBytes, true),
                  i + 1 < layers.layers.size() ? humanCount(boundary, true) : "-");
  }
  os << formatv("\ntotal    {0} params, {1} forward FLOPs, {2} of activations\n",
                humanCount(report.params), humanCount(report.flopsForward),
                humanCount(totalActivation, true));
  if (!report.warnings.empty()) {
    os << "\nwarnings\n";
    for (const std::string &w : report.warnings)
      os << "  - " << w << "\n";
  }
}

void printInspectJson(const InspectReport &report, const Graph &graph, const LayerGraph &layers,
                      raw_ostream &os) {
  json::OStream j(os, 2);
  j.object([&] {
    j.attribute("format_version", InspectFormatVersion);
    j.attributeObject("model", [&] {
      j.attribute("path", graph.path);
      j.attribute("xxh3", report.xxh3);
      j.attribute("nodes", report.nodes);
      j.attribute("params", report.params);
      j.attribute("opset", graph.opsetFor(""));
      j.attribute("flops_fwd", report.flopsForward);
    });
    j.attribute("grouping", groupingMethodName(layers.method));
    j.attributeArray("layers", [&] {
      for (size_t i = 0; i < layers.layers.size(); ++i) {
        const Layer &layer = layers.layers[i];
        j.object([&] {
          j.attribute("index", static_cast<int64_t>(i));
          j.attribute("name", layer.name);
          j.attribute("kind", layerKindName(layer.kind));
          j.attribute("ops", static_cast<int64_t>(layer.ops.size()));
          j.attribute("params", layer.params);
          j.attribute("flops_fwd", layer.flopsForward);
          j.attribute("activation_bytes", layer.activationBytes);
          j.attribute("boundary_bytes",
                      i + 1 < layers.layers.size() ? layers.boundaryBytes(i) : int64_t(0));
          j.attributeArray("boundary_tensors", [&] {
            if (i + 1 >= layers.layers.size())
              return;
            for (int id : layers.crossingAfter(i)) {
              const Value &v = graph.values[id];
              j.object([&] {
                j.attribute("name", v.name);
                j.attribute("dtype", dtypeName(v.type));
                j.attributeArray("shape", [&] {
                  for (int64_t d : v.shape)
                    j.value(d);
                });
                j.attribute("bytes", v.byteSize());
              });
            }
          });
        });
      }
    });
    j.attributeArray("warnings", [&] {
      for (const std::string &w : report.warnings)
        j.value(w);
    });
  });
  os << "\n";
}

} // namespace pipec
