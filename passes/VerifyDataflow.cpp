//===- VerifyDataflow.cpp - Every value a stage reads is delivered -------===//
#include "passes/VerifyDataflow.h"
#include "ops/OpRegistry.h"
#include "support/Diagnostics.h"

#include "onnx/defs/schema.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <set>
#include <tuple>

using namespace llvm;

namespace pipec {
namespace {

using Op = plan::Instruction;

Error fail(const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "verify-program: %s", why.str().c_str());
}

/// What a stage has before its forward runs: received, loaded or a weight.
StringSet<> deliveredTo(const plan::StageProgram &sp) {
  StringSet<> names;
  for (const auto *list : {&sp.recv(), &sp.loads(), &sp.weights()})
    for (const std::string &name : *list)
      names.insert(name);
  return names;
}

/// Each read of \p nodes (the \p what list) is in \p available; adds what
/// they make to it.
Error checkReads(const plan::StageProgram &sp, StringRef what,
                 const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                 StringSet<> &available, StringRef from) {
  for (const onnx::NodeProto &node : nodes) {
    for (const std::string &in : node.input())
      if (!in.empty() && !available.contains(in))
        return fail(formatv("stage {0}: {1} node '{2}' ({3}) reads '{4}', which is not {5}",
                            sp.stage(), what, nodeLabel(node), node.op_type(), in, from));
    for (const std::string &out : node.output())
      if (!out.empty())
        available.insert(out);
  }
  return Error::success();
}

/// The nodes run at load read weights alone; RECOMPUTE's read what FORWARD
/// keeps for them, weights, or what they make before. Adds the load nodes'
/// outputs to \p available.
Error checkLoadAndRerun(const plan::StageProgram &sp, StringSet<> &available) {
  StringSet<> weights;
  for (const std::string &name : sp.weights())
    weights.insert(name);
  if (Error err = checkReads(sp, "load", sp.load_nodes(), weights, "a weight"))
    return err;
  for (const onnx::NodeProto &node : sp.load_nodes())
    for (const std::string &out : node.output())
      if (!out.empty())
        available.insert(out);
  if (sp.rerun_size() == 0)
    return Error::success();
  StringSet<> kept = weights;
  for (const std::string &name : sp.keep_when_recomputing())
    kept.insert(name);
  return checkReads(sp, "recompute", sp.rerun(), kept,
                    "kept for the recompute, a weight, or made earlier by it");
}

/// Forward: each read is delivered or made earlier on the stage. Adds what
/// the forward makes to \p available.
Error checkForward(const plan::StageProgram &sp, StringSet<> &available) {
  for (const onnx::NodeProto &node : sp.forward()) {
    for (const std::string &in : node.input())
      if (!in.empty() && !available.contains(in))
        return fail(formatv("stage {0}: forward node '{1}' ({2}) reads '{3}', which no "
                            "instruction delivers to it (not received, loaded, a weight, or "
                            "computed earlier on the stage)",
                            sp.stage(), nodeLabel(node), node.op_type(), in));
    for (const std::string &out : node.output())
      if (!out.empty())
        available.insert(out);
  }
  return Error::success();
}

/// Backward: a read of a forward value (one some stage's forward makes) is
/// one of this stage's: the others never reach it.
Error checkBackward(const plan::StageProgram &sp, const StringSet<> &available,
                    const StringSet<> &forwardValues) {
  for (const auto *list : {&sp.backward_input(), &sp.backward_weight()})
    for (const onnx::NodeProto &node : *list)
      for (const std::string &in : node.input())
        if (forwardValues.contains(in) && !available.contains(in))
          return fail(formatv("stage {0}: backward node '{1}' ({2}) reads the forward value "
                              "'{3}', which is neither made on the stage nor delivered to it",
                              sp.stage(), nodeLabel(node), node.op_type(), in));
  return Error::success();
}

/// On every rank, the forward of a stage whose predecessor runs elsewhere
/// has, before it, a RECV of each value the stage receives.
Error checkReceives(const plan::Plan &plan) {
  std::map<int, int> rankOfStage;
  for (const plan::Stage &s : plan.stages())
    rankOfStage[s.index()] = s.rank();
  for (const plan::RankProgram &program : plan.programs()) {
    // (sending stage, microbatch, tensor) received so far.
    std::set<std::tuple<int, int, std::string>> received;
    for (int i = 0; i < program.instructions_size(); ++i) {
      const Op &ins = program.instructions(i);
      if (ins.op() == Op::RECV && !ins.grad())
        received.insert({ins.stage(), ins.microbatch(), ins.tensor().name()});
      if (ins.op() != Op::FORWARD || ins.stage() == 0 ||
          ins.stage() >= plan.stage_programs_size() ||
          rankOfStage[ins.stage() - 1] == program.rank())
        continue;
      for (const std::string &name : plan.stage_programs(ins.stage()).recv())
        if (!received.count({ins.stage() - 1, ins.microbatch(), name}))
          return fail(formatv("rank {0} step {1}: FORWARD s{2} mb{3} runs before a RECV of "
                              "'{4}' from stage {5}",
                              program.rank(), i, ins.stage(), ins.microbatch(), name,
                              ins.stage() - 1));
    }
  }
  return Error::success();
}

/// Every node of \p nodes, and of their subgraphs, has a kernel: a row of
/// Ops.def at \p opset with a CPU kernel (a device without its own kernel
/// runs the op on the CPU), or a collective the executor runs itself.
Error checkKernels(int stage, StringRef part,
                   const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                   int64_t opset) {
  for (const onnx::NodeProto &node : nodes) {
    const OpDef *def = lookupOp(node.domain(), node.op_type(), opset);
    if (!def || !(def->hasCpuKernel || def->has(Collective))) {
      std::string domain = node.domain().empty() || node.domain() == "ai.onnx"
                               ? std::string()
                               : " of domain '" + node.domain() + "'";
      return fail(formatv("stage {0}: {1} node '{2}' ({3}): no kernel for op {3}{4}", stage, part,
                          node.name(), node.op_type(), domain));
    }
    // An attribute the op does not take (a renamed "transB") would be
    // ignored, and its default used: the node would compute another thing.
    StringSet<> names;
    const onnx::OpSchema *schema =
        node.domain().empty() || node.domain() == "ai.onnx"
            ? onnx::OpSchemaRegistry::Schema(node.op_type(), static_cast<int>(opset), "")
            : nullptr;
    for (const onnx::AttributeProto &a : node.attribute()) {
      if (!names.insert(a.name()).second)
        return fail(formatv("stage {0}: {1} node '{2}' ({3}): attribute '{4}' is given twice",
                            stage, part, node.name(), node.op_type(), a.name()));
      if (schema && !schema->attributes().count(a.name())) {
        std::vector<std::string> known;
        for (const auto &[name, attr] : schema->attributes())
          known.push_back(name);
        return fail(formatv("stage {0}: {1} node '{2}' ({3}): attribute '{4}' is not one {3} "
                            "takes ({5})",
                            stage, part, node.name(), node.op_type(), a.name(),
                            known.empty() ? std::string("none") : join(known, ", ")));
      }
    }
    for (const onnx::AttributeProto &a : node.attribute()) {
      if (a.has_g())
        if (Error err = checkKernels(stage, part, a.g().node(), opset))
          return err;
      for (const onnx::GraphProto &g : a.graphs())
        if (Error err = checkKernels(stage, part, g.node(), opset))
          return err;
    }
  }
  return Error::success();
}

} // namespace

Error verifyKernels(const plan::Plan &plan) {
  for (int s = 0; s < plan.stage_programs_size(); ++s) {
    const plan::StageProgram &sp = plan.stage_programs(s);
    if (Error err = checkKernels(s, "forward", sp.forward(), plan.opset()))
      return err;
    if (Error err = checkKernels(s, "backward", sp.backward_input(), plan.opset()))
      return err;
    if (Error err = checkKernels(s, "backward", sp.backward_weight(), plan.opset()))
      return err;
    if (Error err = checkKernels(s, "load", sp.load_nodes(), plan.opset()))
      return err;
  }
  return Error::success();
}

Error verifyDataflow(const plan::Plan &plan) {
  StringSet<> forwardValues;
  for (const plan::StageProgram &sp : plan.stage_programs())
    for (const onnx::NodeProto &node : sp.forward())
      for (const std::string &out : node.output())
        if (!out.empty())
          forwardValues.insert(out);
  for (int s = 0; s < plan.stage_programs_size(); ++s) {
    const plan::StageProgram &sp = plan.stage_programs(s);
    if (s > 0) {
      StringSet<> sent;
      for (const std::string &name : plan.stage_programs(s - 1).send())
        sent.insert(name);
      for (const std::string &name : sp.recv())
        if (!sent.contains(name))
          return fail(
              formatv("stage {0} receives '{1}', which stage {2} does not send", s, name, s - 1));
    }
    StringSet<> available = deliveredTo(sp);
    if (Error err = checkLoadAndRerun(sp, available))
      return err;
    if (Error err = checkForward(sp, available))
      return err;
    if (Error err = checkBackward(sp, available, forwardValues))
      return err;
  }
  return checkReceives(plan);
}

} // namespace pipec
