//===- PlanCheck.cpp - What every plan reader checks before use ----------===//
//
// A plan file is input like any other: hand-edited, truncated, or written
// by someone else. readPlan runs checkPlan on every plan it returns, so that
// report, simulate and run index its fields without checking them again:
//
//   counts     stages P, virtual stages V, microbatches M, data_parallel and
//              the microbatch size are positive and bounded; there are P x V
//              stages, P instruction streams and P x V stage programs
//   streams    every instruction's stage, microbatch, peer, buffer and group
//              ranks are in range, compute runs on its stage's rank, a
//              training rank has exactly one OPTIMIZER_STEP, and with a
//              sharded optimizer over replicas one REDUCE_SCATTER of "dp"
//              before it and one ALL_GATHER after it (and no "dp" ALLREDUCE)
//   tensors    every shape (weights, data, messages, buffers) has dimensions
//              >= 0 whose byte size fits int64 and this machine's memory
//   names      every trainable name is a weight; a weight's external-data
//              location is a relative path inside the model's folder
//
// Whether the streams match and cannot deadlock is verify-program's proof,
// which the command line runs on top (passes/ is above this floor).
//
// Before:  schedule { stages: -1 }          (report aborted in the timeline)
// After:   m.plan: schedule.stages -1: must be at least 1
//
//===----------------------------------------------------------------------===//
#include "plan/PlanFile.h"
#include "support/DType.h"
#include "support/Diagnostics.h"
#include "support/InputFile.h"
#include "support/Optimizer.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringSet.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cmath>
#include <map>
#include <optional>

using namespace llvm;

namespace pipec {

namespace {

using Ins = plan::Instruction;

/// Far above any pipeline anyone runs, far below what would exhaust threads
/// or memory before a single step.
constexpr int64_t maxRanks = 65536;
constexpr int64_t maxVirtualStages = 1024;
constexpr int64_t maxMicrobatches = 1 << 20;

Error planError(const Twine &what) {
  return createStringError(inconvertibleErrorCode(), "%s", what.str().c_str());
}

/// More bytes than any one device or host holds (16 TiB): what a plan may
/// not ask of one tensor or slot, wherever it is read. Whether it fits the
/// machine that runs it is the run's question (checkPlanFitsMachine): a plan
/// compiled for an 80 GB GPU is still reported on a laptop.
constexpr int64_t implausibleBytes = int64_t(1) << 44;

Error checkPlausible(const Twine &name, int64_t bytes) {
  if (bytes > implausibleBytes)
    return planError(name + " needs " + Twine(bytes) +
                     " bytes, more than pipec accepts for one allocation (16 TiB)");
  return Error::success();
}

/// The bytes of \p dims elements of \p elementSize bytes, or an error naming
/// \p name for a negative dimension or a size past int64.
template <typename Dims>
Expected<int64_t> shapeBytes(const Twine &name, const Dims &dims, int64_t elementSize) {
  int64_t bytes = std::max<int64_t>(elementSize, 1);
  for (int64_t d : dims) {
    if (d < 0)
      return planError(name + " has dimension " + Twine(d) + " < 0");
    if (d != 0 && bytes > std::numeric_limits<int64_t>::max() / d)
      return planError(name + " has more than 2^63 bytes");
    bytes *= d;
  }
  if (Error err = checkPlausible(name, bytes))
    return err;
  return bytes;
}

Error checkCount(StringRef field, int64_t value, int64_t low, int64_t high) {
  if (value < low)
    return planError(field + " " + Twine(value) + ": must be at least " + Twine(low));
  if (value > high)
    return planError(field + " " + Twine(value) + ": more than " + Twine(high));
  return Error::success();
}

Error checkSchedule(const plan::Plan &plan) {
  const plan::ScheduleInfo &s = plan.schedule();
  if (s.mode() != "train" && s.mode() != "infer")
    return planError("schedule.mode '" + s.mode() + "': expected train or infer");
  if (Error err = checkCount("schedule.stages", s.stages(), 1, maxRanks))
    return err;
  if (Error err = checkCount("schedule.virtual_stages", s.virtual_stages(), 1, maxVirtualStages))
    return err;
  if (Error err = checkCount("schedule.microbatches", s.microbatches(), 1, maxMicrobatches))
    return err;
  if (Error err = checkCount("schedule.data_parallel", s.data_parallel(), 1, maxRanks / s.stages()))
    return err;
  if (Error err = checkCount("schedule.tensor_parallel", std::max(1, s.tensor_parallel()), 1,
                             maxRanks / (int64_t(s.stages()) * s.data_parallel())))
    return err;
  int64_t replicas = s.data_parallel();
  if (Error err = checkCount("schedule.microbatch_size", s.microbatch_size(),
                             plan.programs_size() ? 1 : 0, int64_t(1) << 40))
    return err;
  // A plan that runs carries its global batch, which the runtime reads as
  // written; one that is only reported may leave it out.
  if ((s.global_batch() != 0 || plan.programs_size()) && s.microbatch_size() != 0 &&
      s.global_batch() != s.microbatch_size() * s.microbatches() * replicas)
    return planError(formatv("schedule.global_batch {0} is not microbatch_size {1} x "
                             "microbatches {2} x data_parallel {3}",
                             s.global_batch(), s.microbatch_size(), s.microbatches(), replicas));
  int64_t chunks = int64_t(s.stages()) * s.virtual_stages();
  if (plan.stages_size() != 0 && plan.stages_size() != chunks)
    return planError(formatv("{0} stages for {1} ranks x {2} virtual stages", plan.stages_size(),
                             s.stages(), s.virtual_stages()));
  if (plan.ranks_size() != 0 && plan.ranks_size() != s.stages())
    return planError(formatv("{0} rank entries for {1} stages", plan.ranks_size(), s.stages()));
  if (plan.programs_size() != 0 && plan.programs_size() != s.stages())
    return planError(
        formatv("{0} instruction streams for {1} ranks", plan.programs_size(), s.stages()));
  if (plan.stage_programs_size() != 0 && plan.stage_programs_size() != plan.stages_size())
    return planError(formatv("{0} stage programs for {1} stages", plan.stage_programs_size(),
                             plan.stages_size()));
  for (int i = 0; i < plan.stages_size(); ++i) {
    const plan::Stage &stage = plan.stages(i);
    if (stage.rank() < 0 || stage.rank() >= s.stages())
      return planError(formatv("stage {0} is on rank {1}, but the plan has {2} rank(s)", i,
                               stage.rank(), s.stages()));
    if (stage.index() != i || stage.chunk() < 0 || stage.chunk() >= s.virtual_stages())
      return planError(formatv("stage {0}: index {1}, chunk {2} (of {3} per rank)", i,
                               stage.index(), stage.chunk(), s.virtual_stages()));
  }
  for (int i = 0; i < plan.stage_programs_size(); ++i)
    if (plan.stage_programs(i).stage() != i)
      return planError(
          formatv("stage program {0} says it is stage {1}", i, plan.stage_programs(i).stage()));
  return Error::success();
}

/// Instruction \p ins of rank \p r's stream \p stream ("instruction",
/// "generation.round instruction", ...), at \p at.
Error checkInstruction(const plan::Plan &plan, int r, int at, const plan::RankProgram &program,
                       const Ins &ins, StringRef stream = "instruction") {
  auto fail = [&](const Twine &why) {
    return planError("rank " + Twine(r) + " " + stream + " " + Twine(at) + ": " + why);
  };
  if (!Ins::Op_IsValid(ins.op()))
    return fail("unknown op " + Twine(int(ins.op())));
  int ranks = plan.schedule().stages(), microbatches = plan.schedule().microbatches();
  bool compute = ins.op() == Ins::FORWARD || ins.op() == Ins::RECOMPUTE ||
                 ins.op() == Ins::BACKWARD || ins.op() == Ins::BACKWARD_INPUT ||
                 ins.op() == Ins::BACKWARD_WEIGHT || ins.op() == Ins::SCHEDULE ||
                 ins.op() == Ins::PICK;
  bool message = ins.op() == Ins::SEND || ins.op() == Ins::RECV;
  if (ins.stage() < -1 || ins.stage() >= plan.stages_size() || (compute && ins.stage() < 0))
    return fail("stage " + Twine(ins.stage()) + " of " + Twine(plan.stages_size()));
  if (compute && plan.stages(ins.stage()).rank() != r)
    return fail("stage " + Twine(ins.stage()) + " runs on rank " +
                Twine(plan.stages(ins.stage()).rank()));
  if ((compute || message || ins.op() == Ins::LOAD) &&
      (ins.microbatch() < 0 || ins.microbatch() >= microbatches))
    return fail("microbatch " + Twine(ins.microbatch()) + " of " + Twine(microbatches));
  if (message) {
    if (ins.peer() < 0 || ins.peer() >= ranks || ins.peer() == r)
      return fail("peer " + Twine(ins.peer()) + " (ranks 0.." + Twine(ranks - 1) + ")");
    std::optional<DType> type = dtypeOfName(ins.tensor().dtype());
    if (!type || dtypeSize(*type) == 0)
      return fail("tensor '" + ins.tensor().name() + "' has dtype '" + ins.tensor().dtype() + "'");
    auto bytes =
        shapeBytes("tensor '" + ins.tensor().name() + "'", ins.tensor().shape(), dtypeSize(*type));
    if (!bytes)
      return fail(toString(bytes.takeError()));
    if (ins.tensor().bytes() < 0 || ins.tensor().bytes() > *bytes)
      return fail(formatv("tensor '{0}' claims {1} bytes for {2}", ins.tensor().name(),
                          ins.tensor().bytes(), *bytes));
  }
  if (ins.op() == Ins::ALLREDUCE) {
    if (ins.reduce() != Ins::DATA_PARALLEL && ins.reduce() != Ins::TIED_WEIGHT)
      return fail("all-reduce group '" + ins.group() + "' has no reduce kind");
    if ((ins.reduce() == Ins::TIED_WEIGHT) == ins.tied_weight().empty())
      return fail("all-reduce group '" + ins.group() + "': tied_weight '" + ins.tied_weight() +
                  "' goes with TIED_WEIGHT and only with it");
    if (ins.group() != allReduceGroupName(ins.reduce(), ins.tied_weight()))
      return fail("all-reduce group '" + ins.group() + "' is not named for what it sums ('" +
                  allReduceGroupName(ins.reduce(), ins.tied_weight()) + "')");
    for (int peer : ins.ranks())
      if (peer < 0 || peer >= ranks)
        return fail("all-reduce group '" + ins.group() + "' names rank " + Twine(peer));
    if (ins.bytes() < 0)
      return fail("all-reduce of " + Twine(ins.bytes()) + " bytes");
  }
  if (ins.op() == Ins::REDUCE_SCATTER || ins.op() == Ins::ALL_GATHER) {
    std::string what = Ins::Op_Name(ins.op());
    if (!plan.training().shard_optimizer())
      return fail(what + " in a plan whose optimizer is not sharded");
    if (ins.reduce() != Ins::DATA_PARALLEL || ins.group() != "dp")
      return fail(what + " of group '" + ins.group() + "': only the replicas' \"dp\" is sharded");
    for (int peer : ins.ranks())
      if (peer < 0 || peer >= ranks)
        return fail(what + " names rank " + Twine(peer));
    if (ins.bytes() < 0)
      return fail(what + " of " + Twine(ins.bytes()) + " bytes");
  }
  if (ins.buffer() < 0 || (ins.buffer() > 0 && ins.buffer() >= program.buffers_size()))
    return fail("buffer " + Twine(ins.buffer()) + " of " + Twine(program.buffers_size()));
  return Error::success();
}

Error checkPrograms(const plan::Plan &plan) {
  bool training = plan.schedule().mode() == "train";
  if (!training && plan.training().shard_optimizer())
    return planError("training.shard_optimizer is set in an inference plan");
  for (int r = 0; r < plan.programs_size(); ++r) {
    const plan::RankProgram &program = plan.programs(r);
    if (program.rank() != r)
      return planError(formatv("instruction stream {0} says it is rank {1}", r, program.rank()));
    int steps = 0, scatters = 0, gathers = 0, sums = 0;
    const plan::GenerationStreams &loop = program.generation();
    for (auto [name, stream] : {std::pair{"generation.start instruction", &loop.start()},
                                {"generation.round instruction", &loop.round()},
                                {"generation.stop instruction", &loop.stop()}})
      for (int i = 0; i < stream->size(); ++i) {
        const Ins &ins = stream->Get(i);
        bool loopOp = ins.op() == Ins::SCHEDULE || ins.op() == Ins::PICK || ins.op() == Ins::LOAD ||
                      ins.op() == Ins::FORWARD || ins.op() == Ins::SEND || ins.op() == Ins::RECV;
        if (!loopOp)
          return planError(formatv("rank {0} {1} {2}: {3} is not a step of the token loop", r, name,
                                   i, Ins::Op_Name(ins.op())));
        if (Error err = checkInstruction(plan, r, i, program, ins, name))
          return err;
      }
    for (int i = 0; i < program.instructions_size(); ++i) {
      if (Error err = checkInstruction(plan, r, i, program, program.instructions(i)))
        return err;
      const Ins &ins = program.instructions(i);
      steps += ins.op() == Ins::OPTIMIZER_STEP;
      // Each collective on its side of the update (Collectives.def's WHEN):
      // the gradients' before it, the updated weights' after.
      if (const CollectiveInfo *c = collectiveOf(ins.op());
          c && training && c->afterUpdate != (steps > 0))
        return planError(formatv("rank {0} instruction {1}: {2} runs {3} OPTIMIZER_STEP; a step "
                                 "runs it {4}",
                                 r, i, Ins::Op_Name(ins.op()), steps > 0 ? "after" : "before",
                                 c->afterUpdate ? "after" : "before"));
      scatters += ins.op() == Ins::REDUCE_SCATTER;
      gathers += ins.op() == Ins::ALL_GATHER;
      sums += ins.op() == Ins::ALLREDUCE && ins.reduce() == Ins::DATA_PARALLEL;
    }
    // Training ranks update once per step; without it the rank's weights
    // silently stay where they were.
    if (steps != (training ? 1 : 0))
      return planError(formatv("rank {0} has {1} OPTIMIZER_STEP instructions; a {2} step has {3}",
                               r, steps, training ? "training" : "inference", training ? 1 : 0));
    // A sharded update reads the shard of the summed gradients and leaves
    // each replica only its shard of the new weights.
    int replicas = plan.schedule().data_parallel();
    bool sharded = plan.training().shard_optimizer() && replicas > 1;
    if (sharded && (scatters != 1 || gathers != 1 || sums != 0))
      return planError(formatv(
          "rank {0}: its optimizer is sharded over {1} replicas, so its step needs one "
          "REDUCE_SCATTER of \"dp\" before OPTIMIZER_STEP and one ALL_GATHER after it, and no "
          "\"dp\" ALLREDUCE; it has {2}, {3} and {4}",
          r, replicas, scatters, gathers, sums));
    int sharding = 0;
    for (const Ins &ins : program.instructions())
      sharding += ins.op() == Ins::REDUCE_SCATTER || ins.op() == Ins::ALL_GATHER;
    if (!sharded && sharding > 0)
      return planError(formatv("rank {0} has {1} REDUCE_SCATTER and ALL_GATHER instructions, but "
                               "its optimizer is not sharded over replicas",
                               r, sharding));
    for (const plan::Buffer &b : program.buffers())
      if (b.bytes() < 0 || b.slot() < 0 || (program.slots() > 0 && b.slot() >= program.slots()))
        return planError(formatv("rank {0} buffer {1}: {2} bytes in slot {3} of {4}", r, b.index(),
                                 b.bytes(), b.slot(), program.slots()));
    for (int64_t bytes : program.slot_bytes())
      if (Error err = checkPlausible("rank " + Twine(r) + "'s activation slot", bytes))
        return err;
  }
  return Error::success();
}

/// A weight's shape, type and external-data location.
Error checkWeight(const onnx::TensorProto &w) {
  std::string name = "weight '" + w.name() + "'";
  if (!isKnownDType(w.data_type()))
    return planError(name + " has unknown data type " + Twine(w.data_type()));
  if (auto bytes = shapeBytes(name, w.dims(), dtypeSize(static_cast<DType>(w.data_type()))); !bytes)
    return bytes.takeError();
  // ONNX's external-data keys, each once; location, offset and length are
  // required here (a reference without its offset would read the file from
  // byte 0), and the length is the shape's.
  if (w.data_location() == onnx::TensorProto::EXTERNAL || w.external_data_size() > 0) {
    std::map<std::string, std::string> keys;
    for (const onnx::StringStringEntryProto &entry : w.external_data()) {
      if (entry.key() != "location" && entry.key() != "offset" && entry.key() != "length" &&
          entry.key() != "checksum")
        return planError(name + ": unknown external-data key '" + entry.key() +
                         "' (ONNX's are location, offset, length and checksum)");
      if (!keys.emplace(entry.key(), entry.value()).second)
        return planError(name + ": external-data key '" + entry.key() + "' is given twice");
    }
    for (const char *required : {"location", "offset", "length"})
      if (!keys.count(required))
        return planError(name + ": external data without its " + required);
    uint64_t offset = 0, length = 0;
    if (!to_integer(keys["offset"], offset, 10) || !to_integer(keys["length"], length, 10))
      return planError(name + ": external-data offset '" + keys["offset"] + "' or length '" +
                       keys["length"] + "' is not a number of bytes");
    auto bytes = shapeBytes(name, w.dims(), dtypeSize(static_cast<DType>(w.data_type())));
    if (!bytes)
      return bytes.takeError();
    if (length != static_cast<uint64_t>(*bytes))
      return planError(formatv("{0}: external-data length {1}, its shape needs {2} bytes", name,
                               length, *bytes));
  }
  for (const onnx::StringStringEntryProto &entry : w.external_data()) {
    if (entry.key() != "location")
      continue;
    StringRef location = entry.value();
    if (location.empty() || location.find('\0') != StringRef::npos)
      return planError(name + ": external-data location is empty or holds a NUL byte");
    if (sys::path::is_absolute(location) ||
        std::any_of(sys::path::begin(location), sys::path::end(location),
                    [](StringRef part) { return part == ".."; }))
      return planError(name + ": external-data location '" + location +
                       "' is outside the model's folder");
  }
  return Error::success();
}

/// Train mode: every gradient a stage sums is a weight's that the stage
/// reads (a frozen one's too), once; every trained weight gets one
/// somewhere. A renamed
/// sum would leave its weight untrained without a word.
Error checkWeightGrads(const plan::Plan &plan) {
  if (plan.schedule().mode() != "train" || plan.stage_programs_size() == 0)
    return Error::success();
  StringSet<> trainable, graded;
  for (const std::string &w : plan.trainable())
    trainable.insert(w);
  for (const plan::StageProgram &sp : plan.stage_programs()) {
    StringSet<> reads, here;
    for (const std::string &w : sp.weights())
      reads.insert(w);
    for (const plan::GradSum &g : sp.weight_grads()) {
      std::string what = formatv("stage {0} sums a gradient for '{1}'", sp.stage(), g.value());
      if (!reads.count(g.value()))
        return planError(what + ", which it does not read");
      if (!here.insert(g.value()).second)
        return planError(what + " twice");
      graded.insert(g.value());
    }
  }
  for (const std::string &w : plan.trainable())
    if (!graded.count(w))
      return planError("trained weight '" + w + "' gets no gradient from any stage");
  return Error::success();
}

/// The parameter map names weights of the plan, each parameter once, and
/// steps that fit: the runtime reads the checkpoint through it.
Error checkParamMap(const plan::Plan &plan, const StringSet<> &weights) {
  StringSet<> names;
  for (const plan::Param &p : plan.param_map().params()) {
    std::string what = "parameter '" + p.name() + "'";
    if (!names.insert(p.name()).second)
      return planError(what + " is mapped twice");
    std::optional<DType> type = dtypeOfName(StringRef(p.dtype()).lower());
    if (type && (*type == DType::String || *type == DType::C64 || *type == DType::C128))
      type.reset();
    if (!type)
      return planError(what + " has dtype '" + p.dtype() + "'");
    if (auto bytes = shapeBytes(what, p.shape(), dtypeSize(*type)); !bytes)
      return bytes.takeError();
    if (!p.alias_of().empty() && p.places_size() > 0)
      return planError(what + " is an alias and has places of its own");
    for (const plan::ParamPlace &place : p.places()) {
      if (!weights.count(place.weight()))
        return planError(what + " is held by '" + place.weight() +
                         "', which is not one of the plan's weights");
      for (const plan::ParamStep &step : place.steps()) {
        bool fits = true;
        if (step.has_transpose())
          fits = step.transpose().perm_size() <= 8;
        else if (step.has_slice())
          fits = step.slice().axis() >= 0 && step.slice().axis() < 8 && step.slice().stop() >= 0;
        else if (step.step_case() == plan::ParamStep::kUnsqueeze)
          fits = step.unsqueeze() >= 0 && step.unsqueeze() <= 8;
        else if (step.step_case() == plan::ParamStep::kAdd)
          fits = std::isfinite(step.add());
        else
          fits = false;
        if (!fits)
          return planError(what + " in '" + place.weight() + "' has a step that is not one");
      }
    }
  }
  for (const plan::Param &p : plan.param_map().params())
    if (!p.alias_of().empty() && !names.count(p.alias_of()))
      return planError("parameter '" + p.name() + "' is an alias of '" + p.alias_of() +
                       "', which the map does not hold");
  return Error::success();
}

Error checkTensors(const plan::Plan &plan) {
  StringSet<> weights;
  for (const onnx::TensorProto &w : plan.weights()) {
    if (!weights.insert(w.name()).second)
      return planError("weight '" + w.name() + "' is listed twice");
    if (Error err = checkWeight(w))
      return err;
  }
  for (const std::string &name : plan.trainable())
    if (!weights.count(name))
      return planError("trainable '" + name + "' is not one of the plan's weights");
  // Each split weight is one of the plan's, cut into the plan's T pieces of
  // equal blocks along one of its axes.
  StringSet<> split;
  int parts = std::max(1, plan.schedule().tensor_parallel());
  for (const plan::WeightShard &shard : plan.weight_shards()) {
    std::string name = "weight shard '" + shard.weight() + "'";
    auto w = llvm::find_if(plan.weights(),
                           [&](const onnx::TensorProto &t) { return t.name() == shard.weight(); });
    if (w == plan.weights().end())
      return planError(name + " is not one of the plan's weights");
    if (!split.insert(shard.weight()).second)
      return planError(name + " is listed twice");
    if (shard.parts() != parts || shard.axis() < 0 || shard.axis() >= w->dims_size() ||
        shard.stride() < 1 || w->dims(shard.axis()) % (shard.stride() * parts) != 0)
      return planError(formatv("{0}: axis {1} of {2} pieces in {3} blocks does not cut its "
                               "dimensions over tensor_parallel {4}",
                               name, shard.axis(), shard.parts(), shard.stride(), parts));
  }
  for (const plan::DataInput &d : plan.data()) {
    std::optional<DType> type = dtypeOfName(d.dtype());
    if (!type || dtypeSize(*type) == 0)
      return planError("data input '" + d.name() + "' has dtype '" + d.dtype() + "'");
    if (auto bytes = shapeBytes("data input '" + d.name() + "'", d.shape(), dtypeSize(*type));
        !bytes)
      return bytes.takeError();
    if (d.shape_size() > 0 && (d.batch_axis() < 0 || d.batch_axis() >= d.shape_size()))
      return planError(formatv("data input '{0}' has batch axis {1} of {2} dimensions", d.name(),
                               d.batch_axis(), d.shape_size()));
    if (d.high() < 0)
      return planError("data input '" + d.name() + "' has high " + Twine(d.high()));
  }
  if (Error err = checkWeightGrads(plan))
    return err;
  return checkParamMap(plan, weights);
}

/// The roles of plan.generation in \p step, a pass of \p tokens tokens per
/// row over a past of max_length - tokens (the decode step: 1; the prefill:
/// prefill_length): each role an input or output of the shape the token
/// loop fills or reads, each cache a past input its stage loads and the
/// present it makes. \p field prefixes the errors.
Error checkGenerationStep(const plan::Generation &g, const plan::Plan &step, int64_t tokens,
                          const std::string &field) {
  auto input = [&](StringRef name) -> const plan::DataInput * {
    for (const plan::DataInput &d : step.data())
      if (d.name() == name)
        return &d;
    return nullptr;
  };
  auto output = [&](StringRef name) -> const plan::TensorRef * {
    for (const plan::TensorRef &out : step.outputs())
      if (out.name() == name)
        return &out;
    return nullptr;
  };
  int64_t rows = step.schedule().microbatch_size();
  struct Role {
    StringRef what;
    const std::string &name;
    int64_t width;
  };
  // Positions follow from the mask where every cache is in place
  // (GroupQueryAttention rotates by seqlens_k); a Concat cache needs them.
  bool inPlace = llvm::all_of(g.cache(), [](const auto &c) { return c.in_place(); });
  for (Role role : {Role{"tokens", g.tokens(), tokens}, Role{"positions", g.positions(), tokens},
                    Role{"mask", g.mask(), g.max_length()}}) {
    if (role.what == "positions" && role.name.empty() && inPlace && g.cache_size() > 0)
      continue;
    const plan::DataInput *d = input(role.name);
    if (!d || d->shape_size() != 2 || d->shape(0) != rows || d->shape(1) != role.width)
      return planError(formatv("{0}{1} '{2}' is not an input of shape [{3}, {4}]", field, role.what,
                               role.name, rows, role.width));
  }
  const plan::TensorRef *logits = output(g.logits());
  if (!logits || logits->shape_size() != 3 || logits->shape(0) != rows ||
      logits->shape(1) != tokens || logits->shape(2) != g.vocab())
    return planError(formatv("{0}logits '{1}' is not an output of shape [{2}, {3}, {4}]", field,
                             g.logits(), rows, tokens, g.vocab()));
  if (g.cache_size() == 0)
    return planError(field + "no cache");
  for (const plan::Generation::Cache &c : g.cache()) {
    const plan::DataInput *d = input(c.past());
    if (!d || c.axis() < 0 || c.axis() >= d->shape_size() ||
        d->shape(c.axis()) != g.max_length() - tokens)
      return planError(formatv("{0}cache '{1}' is not an input {2} positions long on axis {3}",
                               field, c.past(), g.max_length() - tokens, c.axis()));
    if (c.stage() < 0 || c.stage() >= step.stage_programs_size() ||
        !is_contained(step.stage_programs(c.stage()).loads(), c.past()))
      return planError(
          formatv("{0}cache '{1}': stage {2} does not load it", field, c.past(), c.stage()));
    const plan::TensorRef *present = output(c.present());
    if (!present || present->shape_size() != d->shape_size() ||
        present->shape(c.axis()) != g.max_length())
      return planError(formatv("{0}cache '{1}': its present '{2}' is not an output {3} "
                               "positions long",
                               field, c.past(), c.present(), g.max_length()));
  }
  return Error::success();
}

/// --mode generate: the decode step's roles, and the prefill's, compiled
/// for the same rows in the same stage layout.
Error checkGeneration(const plan::Plan &plan) {
  if (!plan.has_generation())
    return Error::success();
  const plan::Generation &g = plan.generation();
  const plan::ScheduleInfo &s = plan.schedule();
  std::string field = "generation: ";
  if (s.mode() != "infer")
    return planError(field + "a plan in mode " + s.mode() + " does not generate");
  if (Error err = checkCount("generation.max_length", g.max_length(), 2, int64_t(1) << 24))
    return err;
  if (Error err = checkCount("generation.vocab", g.vocab(), 1, int64_t(1) << 31))
    return err;
  if (g.groups() != s.microbatches() || g.slots() != s.global_batch())
    return planError(formatv("{0}{1} groups of {2} slots, where the schedule has {3} "
                             "microbatches of {4} samples",
                             field, g.groups(), g.slots(), s.microbatches(), s.global_batch()));
  if (Error err = checkGenerationStep(g, plan, 1, field))
    return err;
  if (!g.has_prefill())
    return g.prefill_length() == 0 ? Error::success()
                                   : planError(field + "prefill_length " +
                                               Twine(g.prefill_length()) + " without a prefill");
  const plan::Plan &prefill = g.prefill();
  field = "generation.prefill: ";
  if (Error err =
          checkCount("generation.prefill_length", g.prefill_length(), 1, g.max_length() - 1))
    return err;
  if (prefill.has_generation())
    return planError(field + "holds a generation of its own");
  if (Error err = checkPlan(prefill))
    return planError(field + toString(std::move(err)));
  const plan::ScheduleInfo &p = prefill.schedule();
  bool same = p.stages() == s.stages() && p.microbatches() == s.microbatches() &&
              p.microbatch_size() == s.microbatch_size() &&
              prefill.stages_size() == plan.stages_size();
  for (int i = 0; same && i < plan.stages_size(); ++i)
    same = prefill.stages(i).rank() == plan.stages(i).rank() &&
           prefill.stages(i).first_layer() == plan.stages(i).first_layer() &&
           prefill.stages(i).last_layer() == plan.stages(i).last_layer();
  if (!same)
    return planError(field + "its stages, groups or rows are not the decode step's (layout " +
                     prefill.layout() + " against " + plan.layout() + ")");
  return checkGenerationStep(g, prefill, g.prefill_length(), field);
}

} // namespace

Error checkPlanFitsMachine(const plan::Plan &plan) {
  for (const plan::RankProgram &program : plan.programs())
    for (int64_t bytes : program.slot_bytes())
      if (Error err =
              checkFitsMemory("rank " + Twine(program.rank()) + "'s activation slot", bytes))
        return err;
  for (const onnx::TensorProto &w : plan.weights()) {
    std::string name = "weight '" + w.name() + "'";
    auto bytes = shapeBytes(name, w.dims(), dtypeSize(static_cast<DType>(w.data_type())));
    if (!bytes)
      return bytes.takeError();
    if (Error err = checkFitsMemory(name, *bytes))
      return err;
  }
  return Error::success();
}

Error checkPlan(const plan::Plan &plan) {
  if (Error err = checkSchedule(plan))
    return err;
  // The optimizer a run takes when no flag names one: a name of the one
  // table (support/Optimizer.h).
  if (!plan.training().optimizer().empty()) {
    auto optimizer = parseOptimizer(plan.training().optimizer());
    if (!optimizer) {
      consumeError(optimizer.takeError());
      return planError("training.optimizer '" + plan.training().optimizer() + "': expected " +
                       optimizerNameList());
    }
  }
  if (Error err = checkPrograms(plan))
    return err;
  if (Error err = checkTensors(plan))
    return err;
  return checkGeneration(plan);
}

} // namespace pipec
