//===- StagePasses.cpp - The passes over the stage programs --------------===//
#include "driver/StagePasses.h"
#include "passes/FoldWeights.h"
#include "passes/SelectRecompute.h"
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

} // namespace

std::string describeFusion(const plan::Fusion &f) {
  return formatv("{0} element-wise nodes into {1} kernels, {2} bias adds, {3} transposed "
                 "weights, {4} attention",
                 f.nodes(), f.groups(), f.mat_mul_bias(), f.mat_mul_transposed(),
                 f.softmax_attention())
      .str();
}

Error fuseStagePrograms(plan::Plan &plan, bool fuse, PassRunner &runner) {
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
        return Error::success();
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
  Error err = training
                  ? runner.skip("fold-weights", "training changes the weights every step")
                  : runner.run(
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
    os << formatv("  stage {0}: {1}\n", sp.stage(), parts.empty() ? "none" : join(parts, ", "));
  }
}

} // namespace pipec
