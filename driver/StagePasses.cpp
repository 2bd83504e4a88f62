//===- StagePasses.cpp - The passes over the stage programs --------------===//
#include "driver/StagePasses.h"
#include "compiler/cost/CostModel.h"
#include "compiler/sim/Simulator.h"
#include "driver/Report.h"
#include "ops/OpRegistry.h"
#include "passes/FoldWeights.h"
#include "passes/SelectRecompute.h"
#include "passes/StagePrograms.h"
#include "runtime/core/FusedProgram.h"
#include "runtime/exec/Fusion.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec {

namespace {

/// Calls \p each(list name, fused node, its body) for the fused nodes of \p sp.
template <class Each> void forFusedNodes(const plan::StageProgram &sp, Each each) {
  auto list = [&](StringRef which, const auto &nodes) {
    for (const onnx::NodeProto &node : nodes)
      if (const onnx::GraphProto *body = node.domain() == FusedDomain ? fusedBodyOf(node) : nullptr)
        each(which, node, *body);
  };
  list("forward", sp.forward());
  list("backward-input", sp.backward_input());
  list("backward-weight", sp.backward_weight());
}

/// Bytes of \p name as the plan's runs hold it: a value of \p graph, or a
/// gradient of one ("grad:V", "grad:V#K", "grad-next:V") as that value; 0
/// for the names compile does not size (the backward's own constants).
double bytesOfName(const Graph &graph, StringRef name, Precision precision) {
  StringRef value = gradientOf(name);
  if (value.empty()) {
    value = name;
    value.consume_front("grad-next:");
  }
  int id = value.empty() ? -1 : graph.findValue(value);
  return id < 0 ? 0 : bytesAt(graph, id, precision);
}

/// The bytes \p node reads and writes.
double nodeBytes(const onnx::NodeProto &node, const Graph &graph, Precision precision) {
  double bytes = 0;
  for (const auto *names : {&node.input(), &node.output()})
    for (const std::string &name : *names)
      bytes += bytesOfName(graph, name, precision);
  return bytes;
}

/// The seconds fused node \p node saves on \p hw over its \p body's nodes
/// run one by one, which also write and read the values between them, and
/// launch once each. The CPU runs every fused node as one kernel; a
/// device's backend runs FusedElementwise and MatMulBias so (a GEMM's
/// epilogue), and the others' bodies node by node.
double fusionSaving(const onnx::NodeProto &node, const onnx::GraphProto &body,
                    const plan::HardwareInfo &hw, const Graph &graph, Precision precision) {
  bool oneKernel = hw.sum_compute_and_memory() || isOp(node, OpId::FusedElementwise) ||
                   isOp(node, OpId::MatMulBias);
  if (!oneKernel || hw.memory_bandwidth() <= 0)
    return 0;
  double separate = 0;
  for (const onnx::NodeProto &b : body.node())
    separate += nodeBytes(b, graph, precision);
  double saved = (separate - nodeBytes(node, graph, precision)) / hw.memory_bandwidth() +
                 (body.node_size() - 1) * hw.launch_overhead_s();
  return std::max(0.0, saved);
}

/// Each stage's F, I and W seconds less what its fused nodes save
/// (Stage.fused_saving_s), and the step simulated again: the plan predicts
/// the program that runs.
Error priceFusion(plan::Plan &plan, const Graph &graph) {
  if (plan.hardware_size() == 0 || plan.programs_size() == 0)
    return Error::success(); // nothing to price the nodes on, or to simulate
  auto precision = parsePrecision(plan.training().precision());
  if (!precision) {
    consumeError(precision.takeError());
    precision = Precision::FP32;
  }
  for (const plan::StageProgram &sp : plan.stage_programs()) {
    plan::Stage &stage = *plan.mutable_stages(sp.stage());
    const plan::HardwareInfo &hw = plan.hardware(std::min(stage.rank(), plan.hardware_size() - 1));
    double saved[3] = {0, 0, 0};
    int list = 0;
    for (const auto *nodes : {&sp.forward(), &sp.backward_input(), &sp.backward_weight()}) {
      for (const onnx::NodeProto &node : *nodes)
        if (const onnx::GraphProto *body =
                node.domain() == FusedDomain ? fusedBodyOf(node) : nullptr)
          saved[list] += fusionSaving(node, *body, hw, graph, *precision);
      ++list;
    }
    const double before[3] = {stage.time_f_s(), stage.time_i_s(), stage.time_w_s()};
    stage.clear_fused_saving_s();
    for (int p = 0; p < 3; ++p)
      stage.add_fused_saving_s(std::min(saved[p], before[p]));
    stage.set_time_f_s(before[0] - stage.fused_saving_s(0));
    stage.set_time_i_s(before[1] - stage.fused_saving_s(1));
    stage.set_time_w_s(before[2] - stage.fused_saving_s(2));
  }
  return simulateIntoPlan(plan);
}

} // namespace

std::string describeFusion(const plan::Fusion &f) {
  return formatv("{0} element-wise nodes into {1} kernels, {2} bias adds, {3} transposed "
                 "weights, {4} attention",
                 f.nodes(), f.groups(), f.mat_mul_bias(), f.mat_mul_transposed(),
                 f.softmax_attention())
      .str();
}

Error fuseStagePrograms(plan::Plan &plan, const Graph &graph, bool fuse, PassRunner &runner) {
  if (!fuse)
    return runner.skip("fuse", "--no-fuse keeps every node its own kernel");
  return runner.run(
      "fuse",
      [&] {
        rt::FusionStats stats;
        for (plan::StageProgram &program : *plan.mutable_stage_programs())
          stats += rt::fuseStageProgram(program, plan.opset(),
                                        {plan.loss_value(), plan.loss_count_value()});
        plan::Fusion &f = *plan.mutable_fusion();
        f.set_groups(stats.groups);
        f.set_nodes(stats.nodes);
        f.set_mat_mul_bias(stats.matMulBias);
        f.set_mat_mul_transposed(stats.matMulTransposed);
        f.set_softmax_attention(stats.softmaxAttention);
        return priceFusion(plan, graph);
      },
      [&] { return describeFusion(plan.fusion()); },
      [&](raw_ostream &os) { printFusedNodes(plan, os); });
}

Error skipStagePasses(StringRef why, PassRunner &runner) {
  for (StringRef pass : {"fuse", "fold-weights", "select-recompute"})
    if (Error err = runner.skip(pass, why))
      return err;
  return Error::success();
}

Error foldAndSelectRecompute(plan::Plan &plan, PassRunner &runner) {
  bool training = plan.schedule().mode() == "train";
  // Each stage's nodes of one list (load_nodes or rerun), for the printers.
  using NodeList =
      const google::protobuf::RepeatedPtrField<onnx::NodeProto> &(plan::StageProgram::*)() const;
  auto perStage = [&](NodeList list, raw_ostream &os) {
    for (const plan::StageProgram &sp : plan.stage_programs()) {
      os << formatv("stage {0}: {1} nodes\n", sp.stage(), (sp.*list)().size());
      for (const onnx::NodeProto &node : (sp.*list)())
        os << formatv("  {0} -> {1}\n", node.op_type(), join(node.output(), ", "));
    }
  };
  int64_t total = 0;
  Error err = runner.run(
      "fold-weights",
      [&] {
        for (plan::StageProgram &sp : *plan.mutable_stage_programs())
          total += foldWeightNodes(sp, plan.opset());
        return Error::success();
      },
      [&] { return formatv("load nodes {0}", total).str(); },
      [&](raw_ostream &os) { perStage(&plan::StageProgram::load_nodes, os); });
  if (err)
    return err;
  total = 0;
  if (!training || !plan.training().recompute())
    return runner.skip("select-recompute", "no stage recomputes");
  return runner.run(
      "select-recompute",
      [&] {
        for (plan::StageProgram &sp : *plan.mutable_stage_programs())
          total += selectRecompute(sp);
        return Error::success();
      },
      [&] { return formatv("rerun nodes {0}", total).str(); },
      [&](raw_ostream &os) { perStage(&plan::StageProgram::rerun, os); });
}

void printFusedNodes(const plan::Plan &plan, raw_ostream &os) {
  os << "fused " << describeFusion(plan.fusion()) << "\n";
  for (const plan::StageProgram &sp : plan.stage_programs())
    forFusedNodes(sp,
                  [&](StringRef which, const onnx::NodeProto &node, const onnx::GraphProto &body) {
                    std::vector<std::string> steps;
                    for (const onnx::NodeProto &step : body.node())
                      steps.push_back(step.op_type());
                    os << formatv("  stage {0} {1}: {2} -> {3} ({4})\n", sp.stage(), which,
                                  node.op_type(), join(node.output(), ", "), join(steps, " "));
                  });
}

void printFusionByStage(const plan::Plan &plan, raw_ostream &os) {
  os << "\nfused by compile: " << describeFusion(plan.fusion()) << "\n";
  for (const plan::StageProgram &sp : plan.stage_programs()) {
    // Op -> (fused nodes, the nodes they replace), in name order.
    std::map<std::string, std::pair<int, int>> byOp;
    forFusedNodes(sp, [&](StringRef, const onnx::NodeProto &node, const onnx::GraphProto &body) {
      auto &[count, replaced] = byOp[node.op_type()];
      ++count;
      replaced += body.node_size();
    });
    std::vector<std::string> parts;
    for (const auto &[op, counts] : byOp)
      parts.push_back(formatv("{0} {1} of {2} nodes", counts.first, op, counts.second).str());
    std::string saves;
    const plan::Stage &stage = plan.stages(sp.stage());
    if (stage.fused_saving_s_size() == 3) {
      saves = formatv("; saves F {0}", formatSeconds(stage.fused_saving_s(0))).str();
      if (plan.schedule().mode() == "train")
        saves += formatv(", I {0}, W {1}", formatSeconds(stage.fused_saving_s(1)),
                         formatSeconds(stage.fused_saving_s(2)))
                     .str();
      saves += " per microbatch";
    }
    os << formatv("  stage {0}: {1}{2}\n", sp.stage(), parts.empty() ? "none" : join(parts, ", "),
                  saves);
  }
}

} // namespace pipec
