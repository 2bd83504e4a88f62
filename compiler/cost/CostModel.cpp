//===- CostModel.cpp - Per-layer F / I / W cost on a HardwareSpec ---------===//
#include "compiler/cost/CostModel.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"

#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <optional>
#include <set>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<Precision> precisionNames[] = {{Precision::FP32, "fp32"},
                                                  {Precision::BF16, "bf16"}};

} // namespace

Expected<Precision> parsePrecision(StringRef name) {
  if (std::optional<Precision> precision = valueOf(precisionNames, name))
    return *precision;
  return createStringError(inconvertibleErrorCode(), "--precision %s: expected %s",
                           name.str().c_str(), nameList(precisionNames).c_str());
}

StringRef precisionName(Precision precision) { return nameOf(precisionNames, precision, "fp32"); }

double bytesAt(const Graph &graph, int id, Precision precision) {
  const Value &v = graph.values[id];
  double bytes = static_cast<double>(v.byteSize());
  if (precision == Precision::BF16 && v.type == DType::F32 && !graph.autocast)
    bytes /= 2;
  return bytes;
}

namespace {

bool isWeight(const Graph &graph, int id) {
  return id >= 0 && graph.values[id].kind == ValueKind::Weight;
}

bool isCompileTime(const Graph &graph, const Op &op) {
  for (int out : op.outputs)
    if (out >= 0 && graph.values[out].kind == ValueKind::Activation)
      return false;
  return true;
}

} // namespace

OpCost opCost(const Graph &graph, const Op &op, Precision precision) {
  OpCost cost;
  if (op.dead || isCompileTime(graph, op))
    return cost;
  OpTraffic traffic;
  for (int id : op.inputs)
    if (id >= 0) {
      (isWeight(graph, id) ? traffic.weights : traffic.in) += bytesAt(graph, id, precision);
      traffic.anyWeight |= isWeight(graph, id);
    }
  for (int id : op.outputs)
    if (id >= 0) {
      traffic.out += bytesAt(graph, id, precision);
      traffic.outElems += static_cast<double>(graph.values[id].numElements());
    }
  cost.flops[Forward] = static_cast<double>(forwardFlops(graph, op));
  applyCostRule(graph, op, traffic, cost);
  return cost;
}

CostTable computeCosts(const LayerGraph &lg, const HardwareSpec &hw, Precision precision) {
  const Graph &graph = *lg.graph;
  CostTable table;
  table.hardware = hw.name;
  table.precision = precision;
  std::set<std::string> defaulted;
  bool bf16 = precision == Precision::BF16;
  for (size_t l = 0; l < lg.layers.size(); ++l) {
    const Layer &layer = lg.layers[l];
    LayerCost lc;
    lc.name = layer.name;
    lc.kind = layer.kind;
    lc.params = layer.params;
    // The float32 weights whose gradient a product makes: a CPU rank's
    // GEMM adds it into the accumulator (beta = 1), no pass of its own.
    std::set<int> addedByGemm;
    for (int op : layer.ops) {
      const Op &o = graph.ops[op];
      OpCost c = opCost(graph, o, precision);
      if (hw.sharesHostCores && (o.is(OpId::MatMul) || o.is(OpId::Gemm)) &&
          c.gemms[BackwardWeight] > 0)
        for (int in : o.inputs)
          if (in >= 0 && graph.values[in].type == DType::F32)
            addedByGemm.insert(in);
      // A weight derived from weights is made once per weight update, not
      // per microbatch (the fold-weights pass); its gradient is.
      bool derived = !o.outputs.empty() && llvm::all_of(o.outputs, [&](int out) {
        return out < 0 || graph.isDerivedWeight(out);
      });
      for (int p = derived ? 1 : 0; p < 3; ++p) {
        // A ring all-reduce over the T ranks of one node: 2 (T - 1) steps of
        // bytes / T each way, each step paying the link's latency.
        if (c.tpSumBytes[p] > 0 && graph.tensorParallel > 1) {
          double steps = 2.0 * (graph.tensorParallel - 1);
          double seconds = steps * (hw.intraNode.latency + c.tpSumBytes[p] / graph.tensorParallel /
                                                               hw.intraNode.bandwidth);
          lc.time[p] += seconds;
          lc.tpCommTime += seconds;
        }
        lc.flops[p] += c.flops[p];
        lc.bytes[p] += c.bytes[p];
        if (c.flops[p] > 0 || c.bytes[p] > 0) {
          double compute = c.flops[p] / hw.flopsFor(c.gemms[p], bf16);
          double memory = c.bytes[p] / hw.memoryBandwidth;
          // A product too small to be split over threads and packed pays at
          // most its own arithmetic's time again.
          double gemmCalls = std::min(c.gemms[p] * hw.gemmOverhead, compute);
          lc.time[p] += (hw.sumsComputeAndMemory ? compute + memory : std::max(compute, memory)) +
                        hw.launchOverhead + gemmCalls;
        }
      }
      if (c.defaulted) {
        ++lc.defaultedOps;
        defaulted.insert(o.domain.empty() ? o.opType : o.domain + "." + o.opType);
      }
      for (int out : o.outputs)
        if (out >= 0 && graph.values[out].kind == ValueKind::Activation)
          lc.activationBytes += static_cast<int64_t>(bytesAt(graph, out, precision));
    }
    // Each microbatch's weight gradients are added into the step's float32
    // accumulators: the accumulator read and written, the gradient read.
    for (int w : layer.weights)
      if (isFloatDType(graph.values[w].type) && lc.flops[BackwardWeight] > 0 &&
          !addedByGemm.count(w))
        lc.time[BackwardWeight] +=
            3.0 * double(graph.values[w].numElements()) * sizeof(float) / hw.memoryBandwidth +
            hw.launchOverhead;
    if (l + 1 < lg.layers.size())
      for (int id : lg.crossingAfter(l))
        lc.boundaryBytes += static_cast<int64_t>(bytesAt(graph, id, precision));
    if (l > 0)
      lc.inputBytes = table.layers.back().boundaryBytes;
    table.layers.push_back(std::move(lc));
  }
  table.defaultedOpTypes.assign(defaulted.begin(), defaulted.end());
  return table;
}

Error applyMeasuredCosts(CostTable &table, StringRef path) {
  auto fail = [&](const Twine &why) { return fileError(path, why); };
  auto buffer = MemoryBuffer::getFile(path);
  if (!buffer)
    return fail("cannot open: " + buffer.getError().message());
  auto json = json::parse((*buffer)->getBuffer());
  if (!json)
    return fail("not JSON: " + toString(json.takeError()));
  const json::Object *root = json->getAsObject();
  if (!root)
    return fail("expected a JSON object");
  if (root->getInteger("format_version").getValueOr(0) != 1)
    return fail("format_version must be 1");
  // Times measured on one kind of device say nothing of another.
  if (auto measuredOn = root->getString("hardware");
      measuredOn && !table.hardware.empty() && *measuredOn != table.hardware)
    return fail(formatv("measured on '{0}', but these costs are for '{1}' (--hardware)",
                        *measuredOn, table.hardware)
                    .str());
  const json::Array *layers = root->getArray("layers");
  if (!layers)
    return fail("missing 'layers'");
  StringMap<size_t> byName;
  for (size_t i = 0; i < table.layers.size(); ++i)
    byName[table.layers[i].name] = i;
  for (size_t i = 0; i < layers->size(); ++i) {
    const json::Object *entry = (*layers)[i].getAsObject();
    if (!entry)
      return fail(formatv("layers[{0}] is not an object", i));
    auto name = entry->getString("name");
    if (!name)
      return fail(formatv("layers[{0}] has no name", i));
    auto it = byName.find(*name);
    if (it == byName.end())
      return fail(formatv("layer '{0}' is not a layer of this model", *name));
    LayerCost &lc = table.layers[it->second];
    const char *keys[3] = {"forward_s", "backward_input_s", "backward_weight_s"};
    for (int p = 0; p < 3; ++p) {
      auto v = entry->getNumber(keys[p]);
      if (!v || *v < 0)
        return fail(formatv("layer '{0}': '{1}' must be a non-negative number", *name, keys[p]));
      lc.time[p] = *v;
    }
    lc.measured = true;
  }
  return Error::success();
}

void writeCostTable(const CostTable &table, raw_ostream &os) {
  json::OStream j(os, 2);
  j.object([&] {
    j.attribute("format_version", 1);
    j.attribute("hardware", table.hardware);
    j.attribute("precision", precisionName(table.precision));
    j.attributeArray("layers", [&] {
      for (const LayerCost &lc : table.layers)
        j.object([&] {
          j.attribute("name", lc.name);
          j.attribute("forward_s", lc.time[Forward]);
          j.attribute("backward_input_s", lc.time[BackwardInput]);
          j.attribute("backward_weight_s", lc.time[BackwardWeight]);
        });
    });
  });
  os << "\n";
}

} // namespace pipec
