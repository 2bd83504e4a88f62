//===- Compile.cpp - `pipec compile`: a model to a plan -------------------===//
#include "driver/Compile.h"
#include "compiler/schedule/Schedule.h"
#include "compiler/sim/Simulator.h"
#include "driver/CompileParts.h"
#include "driver/CpuKernels.h"
#include "driver/InspectReport.h"
#include "driver/MapParams.h"
#include "driver/Report.h"
#include "driver/SearchParallel.h"
#include "driver/StagePasses.h"
#include "passes/ActivationMemory.h"
#include "passes/BalanceStages.h"
#include "passes/Differentiate.h"
#include "passes/GroupLayers.h"
#include "passes/LowerSchedule.h"
#include "passes/PlanMemory.h"
#include "passes/PredictStep.h"
#include "passes/SearchSchedules.h"
#include "passes/StagePrograms.h"
#include "passes/TieWeights.h"
#include "passes/VerifyDataflow.h"
#include "plan/PlanFile.h"
#include "support/Attributes.h"
#include "support/Diagnostics.h"
#include "support/MachineCache.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/BuryPointer.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <map>
#include <optional>
#include <set>

using namespace llvm;

namespace pipec {
namespace {

Error flagError(const Twine &message) { return usageError(message); }

/// One entry per rank from a single value or a comma-separated list.
Expected<std::vector<std::string>> perRank(StringRef flag, StringRef value, int ranks) {
  SmallVector<StringRef, 8> parts;
  value.split(parts, ',');
  std::vector<std::string> out;
  for (StringRef p : parts)
    out.push_back(p.trim().str());
  if (out.size() == 1)
    out.assign(ranks, out[0]);
  if (static_cast<int>(out.size()) != ranks)
    return flagError(
        formatv("--{0} {1}: give one value, or one per rank ({2})", flag, value, ranks));
  return out;
}

} // namespace

Expected<Setup> resolveSetup(const CompileOptions &options) {
  Setup setup;
  auto names = perRank("hardware", options.hardware, options.stages);
  if (!names)
    return names.takeError();
  // Each name once: `cpu` (or a file over it) reads or measures its
  // calibration for the share of this machine's cores that `pipec run` gives
  // each of the plan's ranks; a JSON spec is parsed.
  int computing = options.computingRanks > 0
                      ? options.computingRanks
                      : options.stages * options.dataParallel * options.tensorParallel;
  int cpuThreads = defaultThreadsPerRank(computing);
  wireCpuKernels();
  std::map<std::string, HardwareSpec> resolved;
  for (const std::string &name : *names) {
    auto it = resolved.find(name);
    if (it == resolved.end()) {
      auto hw = resolveHardware(name, cpuThreads);
      if (!hw)
        return hw.takeError();
      it = resolved.emplace(name, std::move(*hw)).first;
    }
    setup.hardware.push_back(sharedByRanks(it->second, computing, cpuThreads, allowedCpuCount()));
  }
  std::string precisionText = options.precision;
  if (precisionText.empty())
    precisionText = setup.hardware[0].sharesHostCores ? "fp32" : "bf16";
  auto precision = parsePrecision(precisionText);
  if (!precision)
    return precision.takeError();
  setup.precision = *precision;
  if (options.autocast && (!options.training || setup.precision != Precision::BF16))
    return usageError(formatv("--autocast: needs --mode train and --precision bf16 (this "
                              "compile: --mode {0}, --precision {1})",
                              options.training ? "train" : "infer", precisionName(setup.precision))
                          .str());
  if (options.memoryLimit.empty()) {
    for (const HardwareSpec &hw : setup.hardware)
      setup.limits.push_back(hw.memoryBytes);
  } else {
    auto values = perRank("memory-limit", options.memoryLimit, options.stages);
    if (!values)
      return values.takeError();
    for (const std::string &v : *values) {
      if (v == "none") {
        setup.limits.push_back(0);
        continue;
      }
      auto bytes = parseByteSize(v, "memory-limit");
      if (!bytes)
        return bytes.takeError();
      setup.limits.push_back(*bytes);
    }
  }
  return setup;
}

namespace {

/// differentiate, in train mode: the backward program against the loss
/// chooseLoss finds by structure (or the one the flags name). A model with
/// nothing to train against, or one it cannot differentiate, still compiles
/// for its timing; the plan then says why it has no backward program. Two
/// outputs that could each be the loss stop the compile.
Error differentiateStep(Prepared &out, const CompileOptions &options, PassRunner &runner) {
  auto choice = chooseLoss(out.graph, options.loss);
  if (!choice)
    return choice.takeError();
  LossSpec loss;
  if (choice->spec) {
    loss = *choice->spec;
    out.lossText = choice->reason;
  } else {
    out.backwardError = choice->reason;
  }
  return runner.run(
      "differentiate",
      [&]() -> Error {
        if (!out.backwardError.empty())
          return Error::success();
        auto backward = differentiate(out.graph, out.layers, loss);
        if (backward) {
          out.backward = std::move(*backward);
          out.flowing = valuesWithGradients(*out.backward);
        } else
          out.backwardError = toString(backward.takeError());
        return Error::success();
      },
      [&] {
        if (!out.backward)
          return std::string("no backward program");
        size_t inputOps = 0, weightOps = 0;
        for (size_t l = 0; l < out.backward->inputGrad.size(); ++l) {
          inputOps += out.backward->inputGrad[l].size();
          weightOps += out.backward->weightGrad[l].size();
        }
        return formatv("backward ops {0} (I {1}, W {2}), weight gradients {3}",
                       inputOps + weightOps, inputOps, weightOps, out.backward->weightGrads.size())
            .str();
      },
      [&](raw_ostream &os) {
        if (out.backward)
          printBackward(*out.backward, out.layers, os);
        else
          os << "no backward program: " << out.backwardError << "\n";
      });
}

/// tie-weights (train mode): folded ties read as one weight, --untie's
/// copies.
Error tieStep(Prepared &out, StringRef modelPath, const CompileOptions &options,
              PassRunner &runner) {
  if (!options.training)
    return runner.skip("tie-weights", "inference (--mode infer) trains no weights");
  TieOptions ties;
  ties.untie = options.untie;
  ties.untieAll = options.untieAll;
  if (!options.params.empty()) {
    auto splits = splitMergedParams(modelPath, options.params);
    if (!splits)
      return splits.takeError();
    ties.splits = std::move(*splits);
  } else {
    auto splits = guessMergedSplits(out.graph);
    if (!splits)
      return splits.takeError();
    ties.splits = std::move(*splits);
  }
  return runner.run(
      "tie-weights",
      [&]() -> Error {
        auto report = tieWeights(out.graph, out.layers, ties);
        if (!report)
          return report.takeError();
        out.ties = std::move(*report);
        return Error::success();
      },
      [&] {
        return formatv("shared {0}, folded ties {1}: retied {2}, untied {3}",
                       out.ties.shared.size(), out.ties.folded.size(), out.ties.retied(),
                       out.ties.untied())
            .str();
      },
      [&](raw_ostream &os) {
        printTieReport(out.ties, os);
        out.layers.print(os);
      });
}

} // namespace

Expected<std::unique_ptr<Prepared>> prepare(StringRef modelPath, const CompileOptions &options,
                                            PassRunner &runner, const Setup &setup,
                                            int64_t microbatchSize, StringRef knownHash) {
  ImportOptions importOptions = options.import;
  importOptions.bindings.batch = microbatchSize;
  importOptions.tensorParallel = options.tensorParallel;
  importOptions.sequenceParallel = options.sequenceParallel;
  importOptions.training = options.training;
  importOptions.fuseAttention = options.fuseAttention;
  auto graph = loadGraph(modelPath, importOptions, runner);
  if (!graph)
    return graph.takeError();
  auto out = std::make_unique<Prepared>();
  out->graph = std::move(*graph);
  // One hash per compile (XXH3-128 runs at memory speed, but the file may be GBs).
  out->xxh3 = knownHash.empty() ? contentHash(out->graph.files[0]->getBuffer()) : knownHash.str();
  out->fileNodes = out->graph.fileNodes;
  auto layers = buildLayerGraph(out->graph, runner);
  if (!layers)
    return layers.takeError();
  out->layers = std::move(*layers);
  if (Error err = tieStep(*out, modelPath, options, runner))
    return err;
  if (Error err = trainParamsStep(*out, options, runner))
    return err;
  if (options.training)
    if (Error err = choosePaddingRows(*out, options))
      return err;
  if (Error err = autocastStep(*out, options, runner))
    return err;
  // After tie-weights: its copies are read by one layer each.
  out->sharedWeights = out->layers.sharedWeights();
  for (const HardwareSpec &hw : setup.hardware) {
    auto [it, inserted] = out->tables.try_emplace(hw.name);
    if (inserted) {
      it->second = computeCosts(out->layers, hw, setup.precision);
      if (!options.costs.empty())
        if (Error err = applyMeasuredCosts(it->second, options.costs))
          return err;
    }
  }
  for (const HardwareSpec &hw : setup.hardware)
    out->rankCosts.push_back(&out->tables.at(hw.name));
  Error err = options.training
                  ? differentiateStep(*out, options, runner)
                  : runner.skip("differentiate", "inference (--mode infer) has no backward");
  if (err)
    return err;
  // Without a backward program a train plan cannot run; its tables keep
  // every activation.
  if (!options.training || out->backward)
    for (auto &[name, table] : out->tables)
      countActivationMemory(table, out->layers, out->backward ? &*out->backward : nullptr);
  indexCuts(*out, setup.precision);
  return out;
}

namespace {

/// lower-schedule (the schedule's compute actions, lowered to each rank's
/// instructions), plan-memory and verify-program.
Expected<std::vector<plan::RankProgram>>
programPasses(const LoweringInputs &lowering, const PipelineShape &shape, PassRunner &runner) {
  std::vector<plan::RankProgram> programs;
  auto count = [&](auto op) {
    int n = 0;
    for (const plan::RankProgram &p : programs)
      n += static_cast<int>(std::count_if(p.instructions().begin(), p.instructions().end(), op));
    return n;
  };
  Error err = runner.run(
      "lower-schedule",
      [&]() -> Error {
        auto lowered = lowerSchedule(generateSchedule(shape), lowering);
        if (!lowered)
          return lowered.takeError();
        programs = std::move(*lowered);
        return Error::success();
      },
      [&] {
        return formatv("instructions {0} on {1} ranks ({2}, V={3}, M={4})",
                       count([](const plan::Instruction &) { return true; }), programs.size(),
                       scheduleName(shape.schedule()), shape.virtualStages(), shape.microbatches())
            .str();
      },
      [&](raw_ostream &os) { printPrograms(programs, os); });
  if (err)
    return err;
  err = runner.run(
      "plan-memory",
      [&] {
        planMemory(programs);
        return Error::success();
      },
      [&] {
        int buffers = 0, slots = 0;
        int64_t peak = 0;
        for (const plan::RankProgram &p : programs) {
          buffers += p.buffers_size();
          slots += p.slots();
          peak = std::max(peak, p.peak_activation_bytes());
        }
        return formatv("buffers {0} in {1} slots, peak {2} activation bytes on a rank", buffers,
                       slots, peak)
            .str();
      },
      [&](raw_ostream &os) { printMemoryPlan(programs, os); });
  if (err)
    return err;
  auto sends = [&] {
    return count([](const plan::Instruction &i) { return i.op() == plan::Instruction::SEND; });
  };
  err = runner.run(
      "verify-program",
      [&] {
        return verifyProgram(programs, shape.stages(), shape.microbatches(), shape.schedule(),
                             shape.virtualStages());
      },
      [&] { return formatv("ranks {0}, sends {1} matched", programs.size(), sends()).str(); },
      [&](raw_ostream &os) {
        os << formatv("verified: {0} ranks; {1} sends, each matched by one receive of its "
                      "tensor, shape and dtype; every compute after its inputs; the streams run "
                      "to the end under blocking semantics\n",
                      programs.size(), sends());
        os << formatGrid(programs, {});
      });
  if (err)
    return err;
  return programs;
}

/// The programs in \p plan, each stage's and rank's memory peak, and the
/// predicted step by simulating them.
Error simulateInto(plan::Plan &plan, std::vector<plan::RankProgram> programs,
                   const StagePlan &stagePlan, int stages) {
  for (auto &program : programs)
    *plan.add_programs() = std::move(program);
  for (int k = 0; k < plan.stages_size(); ++k) {
    const plan::RankProgram &program = plan.programs(plan.stages(k).rank());
    plan.mutable_stages(k)->set_memory_peak_bytes(plan.ranks(plan.stages(k).rank()).weight_bytes() +
                                                  program.peak_activation_bytes());
  }
  if (Error err = simulateIntoPlan(plan))
    return err;
  for (int r = 0; r < stages; ++r)
    plan.mutable_ranks(r)->set_activation_bytes(plan.programs(r).peak_activation_bytes());
  plan.mutable_predicted()->set_bottleneck_s(stagePlan.bottleneck);
  plan.mutable_predicted()->set_imbalance(stagePlan.imbalance);
  return Error::success();
}

/// balance-stages for \p balance.
Expected<StagePlan> balanceStep(const Prepared &prepared, const BalanceOptions &balance,
                                PassRunner &runner) {
  std::optional<StagePlan> stagePlan;
  Error err = runner.run(
      "balance-stages",
      [&]() -> Error {
        auto balanced = balanceStages(prepared.layers, balance);
        if (!balanced)
          return balanced.takeError();
        stagePlan = std::move(*balanced);
        return Error::success();
      },
      [&] {
        std::string recomputed;
        if (balance.training.recompute != Recompute::None) {
          recomputed = ", recomputed layers";
          for (const ChunkPlan &c : stagePlan->chunks)
            recomputed += formatv(" {0}/{1}", c.recomputedLayers, c.lastLayer - c.firstLayer + 1);
        }
        return formatv("chunks {0} on {1} ranks, bottleneck {2:e3} s, layout {3}{4}",
                       stagePlan->chunks.size(), stagePlan->ranks.size(), stagePlan->bottleneck,
                       stagePlan->layout, recomputed)
            .str();
      },
      [&](raw_ostream &os) { printStagePlan(*stagePlan, os); });
  if (err)
    return err;
  return std::move(*stagePlan);
}

} // namespace

Expected<Judged> judge(const CompileOptions &options, const Setup &setup, const Prepared &prepared,
                       const PipelineShape &shape, PassRunner &runner) {
  BalanceOptions balance = balanceOptions(options, setup, prepared, shape);
  auto stagePlan = balanceStep(prepared, balance, runner);
  if (!stagePlan)
    return stagePlan.takeError();
  auto predicted = StepPredictor(balance).predict(*stagePlan);
  if (!predicted)
    return predicted.takeError();
  return Judged{std::move(*stagePlan), std::move(*predicted)};
}

namespace {

/// What balancing bought: the other methods on the same inputs, with the
/// steps the simulator predicts.
void addAlternatives(plan::Plan &plan, const CompileOptions &options, const Setup &setup,
                     const Prepared &prepared, const PipelineShape &shape,
                     const PassRunner &runner) {
  for (const char *alt : {"time", "params", "uniform"}) {
    auto *a = plan.add_alternatives();
    a->set_method(alt);
    if (options.balance == alt) {
      a->set_layout(plan.layout());
      a->set_step_time_s(plan.predicted().step_time_s());
      a->set_bottleneck_s(plan.predicted().bottleneck_s());
      a->set_imbalance(plan.predicted().imbalance());
      a->set_fits_memory(fitsMemory(plan));
      continue;
    }
    CompileOptions altOptions = options;
    altOptions.balance = alt;
    PassRunner quiet = runner.quiet();
    auto judged = judge(altOptions, setup, prepared, shape, quiet);
    if (!judged) {
      a->set_error(toString(judged.takeError()));
      continue;
    }
    a->set_layout(judged->stagePlan.layout);
    a->set_step_time_s(judged->prediction.step);
    a->set_bottleneck_s(judged->stagePlan.bottleneck);
    a->set_imbalance(judged->stagePlan.imbalance);
    a->set_fits_memory(judged->overRank() < 0);
  }
}

/// Balance (unless \p balanced gives the partition balance-stages made for
/// these inputs), schedule, lower, verify and simulate one configuration,
/// with the other balancing methods beside it.
Expected<plan::Plan> buildPlan(StringRef modelPath, const CompileOptions &options,
                               const Setup &setup, const Prepared &prepared,
                               const PipelineShape &shape, PassRunner &runner,
                               std::optional<StagePlan> balanced = std::nullopt) {
  BalanceOptions balance = balanceOptions(options, setup, prepared, shape);
  std::optional<StagePlan> stagePlan = std::move(balanced);
  if (!stagePlan) {
    auto made = balanceStep(prepared, balance, runner);
    if (!made)
      return made.takeError();
    stagePlan = std::move(*made);
  }

  plan::Plan plan;
  describeRun(plan, modelPath, options, setup, prepared, balance, *stagePlan);
  describeLayers(plan, options, prepared);
  describeStages(plan, prepared.layers, *stagePlan);
  LoweringInputs lowering = loweringInputs(options, shape, setup, prepared, *stagePlan);
  for (const HardwareSpec &hw : setup.hardware)
    if (hw.calibrationDisturbed()) {
      plan.add_warnings(formatv("the '{0}' calibration was disturbed: its thread ran {1:f2} of "
                                "the wall time (another process took the cores), so the "
                                "predictions may be slow; it serves {2:f0} s, then a compile "
                                "measures again",
                                hw.name, hw.calibrationCpuShare, disturbedMeasurementSeconds)
                            .str());
      break;
    }
  for (const LoweringInputs::Collective &ar : lowering.collectives)
    if (ar.reduce == plan::Instruction::TIED_WEIGHT)
      plan.add_warnings(formatv("weight '{0}' is shared by {1} ranks: each keeps a copy{2}",
                                ar.tiedWeight, ar.ranks.size(),
                                options.training ? " and their gradients are all-reduced" : "")
                            .str());
  auto programs = programPasses(lowering, shape, runner);
  if (!programs)
    return programs.takeError();
  if (Error err = simulateInto(plan, std::move(*programs), *stagePlan, shape.stages()))
    return err;
  addAlternatives(plan, options, setup, prepared, shape, runner);
  addWarnings(plan, prepared.graph, *prepared.rankCosts[0]);
  if (prepared.backward) {
    describeTies(plan, prepared.ties, [&](StringRef name) {
      return prepared.backward->weightGrads.count(name.str()) > 0;
    });
    describeParamRewrites(plan, prepared.paramRewrites);
    for (const std::string &note : prepared.paddingNotes)
      plan.add_warnings(note);
    if (!prepared.unheld.empty())
      plan.add_warnings(formatv("--params: {0} float initializer(s) hold no tensor of the "
                                "checkpoint and do not train (Constant nodes: data the "
                                "export computed): {1}",
                                prepared.unheld.size(),
                                join(ArrayRef(prepared.unheld).take_front(8), ", ") +
                                    (prepared.unheld.size() > 8 ? ", ..." : ""))
                            .str());
  }
  return plan;
}

/// The runtime feeds every input by samples along its batch axis (the
/// dimension the model names like a batch, else the first), one microbatch at
/// a time. An input whose batch dimension is not the microbatch size (fixed
/// so in the model, or bound so by --input-shape) would be fed the wrong
/// samples, and its outputs stacked to the wrong batch.
Error checkDataBatch(const plan::Plan &plan) {
  const plan::ScheduleInfo &s = plan.schedule();
  for (const plan::DataInput &d : plan.data()) {
    int axis = d.batch_axis();
    if (d.shape_size() == 0 || d.whole())
      continue; // fed whole
    if (axis < 0 || axis >= d.shape_size())
      return flagError(formatv("input '{0}' has batch axis {1}, outside its {2} dimensions",
                               d.name(), axis, d.shape_size()));
    int64_t samples = d.shape(axis);
    if (samples == s.microbatch_size())
      continue;
    std::string where =
        axis == 0 ? std::string("its first dimension") : formatv("dimension {0}", axis).str();
    return flagError(formatv("input '{0}' has {1} in {2} (the batch), but the microbatches hold "
                             "{3} sample(s); give --batch {4} for {5} microbatch(es) of {1}",
                             d.name(), samples, where, s.microbatch_size(),
                             samples * s.microbatches() * s.data_parallel(), s.microbatches()));
  }
  return Error::success();
}

/// GroupQueryAttention with do_rotary reads a cos_cache row per position:
/// rows longer than the cache (the sequence and past compile bound) cannot
/// run.
Error checkRotaryLength(const Graph &graph, const Op &op) {
  if (op.dead || !op.is(OpId::MsGroupQueryAttention) || !attrInt(graph.node(op), "do_rotary", 0) ||
      op.inputs.size() < 8 || op.inputs[7] < 0 || op.outputs.size() < 2 || op.outputs[1] < 0)
    return Error::success();
  const Value &cos = graph.values[op.inputs[7]], &present = graph.values[op.outputs[1]];
  if (cos.shape.empty() || present.shape.size() != 4 || present.shape[2] <= cos.shape[0])
    return Error::success();
  return createStringError(inconvertibleErrorCode(),
                           "node '%s' (GroupQueryAttention): rows of %lld positions outrun its "
                           "cos_cache of %lld; compile a shorter --seq, --past or --max-length",
                           op.name.c_str(), static_cast<long long>(present.shape[2]),
                           static_cast<long long>(cos.shape[0]));
}

/// What a kernel refuses that compile can see in the graph: training-mode
/// Dropout with a ratio above zero draws random masks, which pipec's kernels
/// do not (a torch model exported in train mode has them). A training_mode
/// fed at run time may be true. Rotary positions past the cos_cache.
Error checkKernelPreconditions(const Graph &graph) {
  for (const Op &op : graph.ops) {
    if (Error err = checkRotaryLength(graph, op))
      return err;
    if (op.dead || !op.is(OpId::Dropout) || op.inputs.size() < 3 || op.inputs[2] < 0)
      continue;
    auto scalar = [&](int id) -> std::optional<double> {
      auto t = graph.readConstant(id, 1);
      if (!t) {
        consumeError(t.takeError());
        return std::nullopt;
      }
      return (*t)->numElements() == 1 ? std::optional<double>((*t)->floatAt(0)) : std::nullopt;
    };
    std::optional<double> training = scalar(op.inputs[2]);
    std::optional<double> ratio = op.inputs[1] >= 0 ? scalar(op.inputs[1]) : 0.5;
    if (ratio && *ratio == 0)
      continue;
    if (!training)
      return createStringError(inconvertibleErrorCode(),
                               "node '%s' (Dropout): training_mode is fed at run time, and in "
                               "training mode Dropout draws random masks, which pipec does not",
                               op.name.c_str());
    if (*training != 0)
      return createStringError(inconvertibleErrorCode(),
                               "node '%s' (Dropout): training-mode Dropout with a ratio above "
                               "zero draws random masks, which pipec does not",
                               op.name.c_str());
  }
  return Error::success();
}

/// The programs `pipec run` executes. A plan that compiles, runs: a model
/// pipec cannot train (no loss, an op without a gradient rule) or run (a
/// stage program that cannot be built, a batch the microbatches do not hold)
/// is an error naming why, unless \p options ask for the timing alone
/// (--timing-only: the report and simulation stand, and the plan's warnings
/// say why it cannot run). Cut programs whose data does not reach them
/// (verifyDataflow) are always an error.
Error attachStagePrograms(plan::Plan &plan, const Prepared &prepared, const CompileOptions &options,
                          PassRunner &runner) {
  const std::string &model = plan.model().path();
  auto cannot = [&](StringRef what, const std::string &why) -> Error {
    bool train = what == "train" && StringRef(why).find("--mode infer") == StringRef::npos;
    return createStringError(inconvertibleErrorCode(),
                             "%s: the plan cannot %s: %s; %scompile with --timing-only for its "
                             "report alone",
                             model.c_str(), what.str().c_str(), why.c_str(),
                             train ? "compile with --mode infer to run it forward, or " : "or ");
  };
  if (plan.schedule().mode() == "train" && !prepared.backward) {
    if (!options.timingOnly)
      return cannot("train", prepared.backwardError);
    // The backward warning is already there.
    // The reason is what run says, with the way out where it has none.
    bool inferAdvised = StringRef(prepared.backwardError).contains("--mode infer");
    plan.mutable_run_status()->set_kind(plan::RunStatus::CANNOT_TRAIN);
    plan.mutable_run_status()->set_reason(
        prepared.backwardError +
        (inferAdvised ? "" : "; compile with --mode infer to run it forward"));
    return skipStagePasses("the plan cannot train: it has no stage programs", runner);
  }
  const Backward *backward = plan.schedule().mode() == "train" ? &*prepared.backward : nullptr;
  Error err = buildStagePrograms(plan, prepared.graph, prepared.layers, backward, options.freeze);
  if (!err)
    err = checkDataBatch(plan);
  if (!err)
    err = verifyKernels(plan);
  if (!err)
    err = checkKernelPreconditions(prepared.graph);
  if (err) {
    if (!options.timingOnly)
      return cannot("be run", toString(std::move(err)));
    plan.clear_stage_programs();
    plan.clear_weights();
    plan.clear_trainable();
    plan.clear_data();
    plan.clear_outputs();
    std::string why = toString(std::move(err));
    plan.add_warnings("the plan cannot be run: " + why);
    plan.mutable_run_status()->set_kind(plan::RunStatus::CANNOT_RUN);
    plan.mutable_run_status()->set_reason(why);
    return skipStagePasses("the plan cannot run: it has no stage programs", runner);
  }
  if (Error err = keepAppendedPositions(plan, prepared.graph, options.maxLength))
    return err;
  if (Error err = fuseStagePrograms(plan, prepared.graph, options.fuse, runner))
    return err;
  if (Error err = foldAndSelectRecompute(plan, runner))
    return err;
  if (Error err = verifyDataflow(plan))
    return err;
  if (options.maxLength > 0)
    if (Error err = describeGeneration(plan, prepared.graph, options.maxLength))
      return err;
  // The weights' bytes beyond the .onnx file: its xxh3 covers only itself.
  SmallString<256> modelDir(sys::path::parent_path(plan.model().path()));
  if (modelDir.empty())
    modelDir = ".";
  auto dataHash = externalDataHash(plan, modelDir);
  if (!dataHash)
    return dataHash.takeError();
  plan.mutable_model()->set_data_xxh3(*dataHash);
  return Error::success();
}

/// How the plan's schedule_search shows one candidate --schedule auto tried.
struct AutoCandidate {
  std::string name;  ///< "zbv V=2 M=8"
  std::string error; ///< why it has no plan
  bool simulated = false, fits = false;
  double step = 0, bubble = 0;
  int64_t peak = 0, limit = 0; ///< the rank with the most memory
  int peakRank = 0;
  int overRank = -1; ///< the first rank over its limit
  int64_t overBytes = 0, overLimit = 0;

  explicit AutoCandidate(const ScheduleCandidate &tried) : name(tried.name), error(tried.error) {
    if (tried.judged)
      describe(*tried.judged);
  }

  /// The figures of a candidate \p judged; the peak is the last rank's of
  /// the most memory.
  void describe(const Judged &judged) {
    simulated = true;
    step = judged.prediction.step;
    bubble = judged.prediction.bubbleFraction;
    const std::vector<RankPlan> &ranks = judged.stagePlan.ranks;
    for (size_t r = 0; r < ranks.size(); ++r)
      if (judged.prediction.peakMemory[r] >= peak) {
        peak = judged.prediction.peakMemory[r];
        peakRank = ranks[r].index;
        limit = ranks[r].memoryLimit;
      }
    int over = judged.overRank();
    fits = over < 0;
    if (!fits) {
      overRank = ranks[over].index;
      overBytes = judged.prediction.peakMemory[over];
      overLimit = ranks[over].memoryLimit;
    }
  }

  /// One line: its predicted step, bubble and peak memory, and why it lost
  /// to the step \p chosen (0 while nothing was chosen).
  std::string explain(double chosen) const {
    if (!simulated)
      return name + ": " + error;
    std::string line = formatv("{0}: step {1:e3} s, bubble {2:f1}%, peak memory {3} on rank {4}{5}",
                               name, step, 100 * bubble, humanCount(peak, true), peakRank,
                               limit > 0 ? " of " + humanCount(limit, true) : std::string())
                           .str();
    if (!fits)
      return line + formatv("; lost: over the memory limit (rank {0} needs {1} of {2})", overRank,
                            humanCount(overBytes, true), humanCount(overLimit, true))
                        .str();
    if (chosen > 0 && step > chosen)
      return line + formatv("; lost: slower by {0:f1}%", 100 * (step / chosen - 1)).str();
    return line;
  }
};

/// One `pipec compile`: the resolved setup, the front half of the pipeline
/// per microbatch size (cached), and the runner that shows the passes of
/// the plan it returns.
class Compilation {
public:
  Compilation(StringRef modelPath, const CompileOptions &options, Setup setup,
              const PipelineOptions &pipeline)
      : modelPath(modelPath), options(options), setup(std::move(setup)), runner(pipeline) {}
  ~Compilation() {
    for (auto &[size, prepared] : cache)
      release(std::move(prepared));
  }

  /// The plan for the schedule, V and M the options give.
  Expected<plan::Plan> fixedSchedule();
  /// --schedule auto: simulate the candidates, keep the fastest that fits.
  Expected<plan::Plan> autoSchedule();

private:
  /// Judges one shape --schedule auto's search (passes/SearchSchedules.h)
  /// asks for: the front half for its microbatch size, then balancing and
  /// the prediction, without building a plan.
  Expected<Judgement> judgeCandidate(const PipelineShape &checked);

  Expected<int64_t> microbatchSizeFor(int microbatches) const;
  /// The front half for microbatches of \p size, run through \p passes the
  /// first time that size is asked for.
  Expected<const Prepared *> preparedFor(int64_t size, PassRunner &passes);
  /// Frees \p prepared, or leaves it to exit (options.disableFree).
  void release(std::unique_ptr<Prepared> prepared) const {
    if (options.disableFree)
      BuryPointer(std::move(prepared));
  }

  StringRef modelPath;
  const CompileOptions &options;
  Setup setup;
  PassRunner runner;
  std::map<int64_t, std::unique_ptr<Prepared>> cache;
};

/// The samples in each microbatch when --batch is not given: those a model
/// of fixed shapes holds in the first dimension of every input (torch.onnx
/// exports the example batch it was given: input_ids [4, 8] holds 4), else
/// one. A model with symbolic dimensions binds them to one sample.
int64_t fixedBatchOf(const Graph &graph) {
  if (!graph.boundDims.empty())
    return 1;
  std::optional<int64_t> samples;
  for (int id : graph.inputs) {
    const Value &v = graph.values[id];
    if (v.shape.empty())
      continue;
    if (samples && *samples != v.shape[0])
      return 1;
    samples = v.shape[0];
  }
  return samples && *samples > 0 ? *samples : 1;
}

Expected<int64_t> Compilation::microbatchSizeFor(int microbatches) const {
  if (options.globalBatch <= 0)
    return 1; // fixedBatchOf the model, once prepared
  int64_t perReplica = options.globalBatch / options.dataParallel;
  if (perReplica % microbatches != 0)
    return flagError(formatv("--batch {0} does not divide into {1} microbatches of {2} "
                             "replica(s)",
                             options.globalBatch, microbatches, options.dataParallel));
  return perReplica / microbatches;
}

Expected<const Prepared *> Compilation::preparedFor(int64_t size, PassRunner &passes) {
  auto it = cache.find(size);
  if (it != cache.end())
    return it->second.get();
  auto made = prepare(modelPath, options, passes, setup, size,
                      cache.empty() ? "" : cache.begin()->second->xxh3);
  if (!made)
    return made.takeError();
  const Prepared *ptr = made->get();
  cache[size] = std::move(*made);
  return ptr;
}

Expected<plan::Plan> Compilation::fixedSchedule() {
  ScheduleKind kind = options.training ? options.schedule : ScheduleKind::ForwardOnly;
  // Without --virtual-stages a schedule runs at its row's V.
  int virtualStages = !options.training           ? 1
                      : options.virtualStages > 0 ? options.virtualStages
                                                  : traitsOf(kind).defaultVirtualStages;
  int microbatches = options.microbatches > 0 ? options.microbatches : 4 * options.stages;
  auto size = microbatchSizeFor(microbatches);
  if (!size)
    return size.takeError();
  auto prepared = preparedFor(*size, runner);
  if (!prepared)
    return prepared.takeError();
  auto shape = PipelineShape::make(
      kind, options.stages, virtualStages, microbatches,
      options.globalBatch > 0 ? *size : fixedBatchOf((*prepared)->graph), options.dataParallel);
  if (!shape)
    return shape.takeError();
  auto built = buildPlan(modelPath, options, setup, **prepared, *shape, runner);
  if (!built)
    return built.takeError();
  if (Error err = attachStagePrograms(*built, **prepared, options, runner))
    return err;
  return built;
}

Expected<Judgement> Compilation::judgeCandidate(const PipelineShape &checked) {
  Judgement out{checked, std::nullopt, ""};
  auto size = microbatchSizeFor(checked.microbatches());
  if (!size) {
    out.error = toString(size.takeError());
    return out;
  }
  // The candidates' passes run quietly; the winner's are shown when its plan
  // is built.
  PassRunner quietFront = runner.quiet(), quietBack = runner.quiet();
  auto prepared = preparedFor(*size, quietFront);
  if (!prepared)
    return prepared.takeError();
  out.shape = checked.withMicrobatchSize(
      options.globalBatch > 0 ? *size : fixedBatchOf((*prepared)->graph));
  // The balancing alternatives are judged for the winner alone.
  auto judged = judge(options, setup, **prepared, out.shape, quietBack);
  if (!judged)
    out.error = "lost: no plan: " + toString(judged.takeError());
  else
    out.judged = std::move(*judged);
  return out;
}

Expected<plan::Plan> Compilation::autoSchedule() {
  // The candidates are judged without building their plans; the winner's
  // plan is built here.
  auto search =
      searchSchedules(options.stages, options.microbatches, options.dataParallel,
                      [this](const PipelineShape &shape) { return judgeCandidate(shape); });
  if (!search)
    return search.takeError();
  std::vector<AutoCandidate> tried;
  for (const ScheduleCandidate &candidate : search->tried)
    tried.emplace_back(candidate);
  if (search->best < 0) {
    std::vector<std::string> lines;
    for (const AutoCandidate &t : tried)
      lines.push_back(t.explain(0));
    return flagError("--schedule auto: no schedule fits the memory limits; tried " +
                     join(lines, "; "));
  }
  ScheduleCandidate &winner = search->tried[search->best];
  const PipelineShape &bestShape = *winner.shape;
  const std::string &bestText = winner.name;
  std::optional<StagePlan> bestStagePlan = std::move(winner.judged->stagePlan);
  auto size = microbatchSizeFor(bestShape.microbatches());
  if (!size)
    return size.takeError();
  PassRunner quiet = runner.quiet();
  auto cached = preparedFor(*size, quiet);
  if (!cached)
    return cached.takeError();
  const Prepared *bestPrepared = *cached;
  // The winner's front half once more through the runner that shows it, so
  // that what --stats, --print-after and --dump-dir show is what the plan is
  // built from (the same IR: the passes are deterministic).
  // Its partition is balance-stages' for the same inputs, kept unless the
  // passes are shown.
  std::unique_ptr<Prepared> shown;
  if (runner.shows()) {
    auto made =
        prepare(modelPath, options, runner, setup, bestShape.microbatchSize(), bestPrepared->xxh3);
    if (!made)
      return made.takeError();
    shown = std::move(*made);
    bestPrepared = shown.get();
    bestStagePlan.reset();
  }
  auto best = buildPlan(modelPath, options, setup, *bestPrepared, bestShape, runner,
                        std::move(bestStagePlan));
  if (!best)
    return best.takeError();
  double chosenStep = best->predicted().step_time_s();
  int fitting = static_cast<int>(
      std::count_if(tried.begin(), tried.end(), [](const AutoCandidate &t) { return t.fits; }));
  best->add_schedule_search(formatv("chose {0}: step {1}, the least simulated step of the {2} "
                                    "candidates that fit the memory limits ({3} tried)",
                                    bestText, formatSeconds(chosenStep), fitting, tried.size())
                                .str());
  for (const AutoCandidate &t : tried)
    best->add_schedule_search(t.name == bestText ? t.explain(chosenStep) + ": chosen"
                                                 : t.explain(chosenStep));
  Error err = attachStagePrograms(*best, *bestPrepared, options, runner);
  release(std::move(shown));
  if (err)
    return err;
  return std::move(*best);
}

} // namespace

Expected<plan::Plan> compileModel(StringRef modelPath, const CompileOptions &given,
                                  const PipelineOptions &pipeline) {
  CompileOptions options = given;
  if (Error err = checkPrintAfter(pipeline.printAfter, passNames()))
    return err;
  if (options.stages < 1)
    return flagError("--stages must be at least 1");
  if (options.virtualStages < 0)
    return flagError("--virtual-stages must be at least 1");
  if (options.training && !options.autoSchedule &&
      traitsOf(options.schedule).backward == BackwardKind::None)
    return flagError(formatv("--schedule {0}: has no backward, so it cannot train; inference "
                             "(--mode infer) runs it whatever --schedule says",
                             scheduleName(options.schedule)));
  if (options.dataParallel < 1)
    return flagError("--dp must be at least 1");
  if (options.tensorParallel < 1)
    return flagError(formatv("--tp {0}: must be at least 1", options.tensorParallel));
  if (options.sequenceParallel && options.tensorParallel < 2 && options.parallel.gpus == 0)
    return flagError("--sequence-parallel: splits the sequence over the tensor-parallel ranks; "
                     "give --tp 2 or more");
  if (options.tensorParallel > 1 && options.maxLength > 0)
    return flagError(formatv("--tp {0}: generation runs without tensor parallelism (--mode "
                             "generate takes --tp 1)",
                             options.tensorParallel));
  if (options.parallel.gpus < 0)
    return flagError(formatv("--gpus {0}: must be at least 1", options.parallel.gpus));
  if (options.parallel.gpus > 0)
    return searchParallel(modelPath, options, pipeline);
  // 0 asks for the default; a negative count is a mistake, never a default.
  if (options.microbatches < 0)
    return flagError(formatv("--microbatches {0}: must be at least 1", options.microbatches));
  if (options.globalBatch < 0)
    return flagError(formatv("--batch {0}: must be at least 1", options.globalBatch));
  // A generation plan's ranks compute at once only on groups in flight: the
  // `cpu` spec is measured for the share of the cores that gives each.
  std::string groupsReason;
  auto computing = [&] {
    return options.dataParallel * std::min(options.stages, std::max(1, options.microbatches));
  };
  if (options.maxLength > 0 && options.computingRanks == 0)
    options.computingRanks = computing();
  auto setup = resolveSetup(options);
  if (!setup)
    return setup.takeError();
  if (options.maxLength > 0) {
    std::tie(options.microbatches, groupsReason) = generationGroups(options, *setup);
    if (computing() != options.computingRanks) {
      options.computingRanks = computing();
      setup = resolveSetup(options);
      if (!setup)
        return setup.takeError();
    }
  }
  if (options.globalBatch > 0 && options.globalBatch % options.dataParallel != 0)
    return flagError(formatv("--batch {0} does not divide over --dp {1} replicas",
                             options.globalBatch, options.dataParallel));
  // A tensor-parallel group talks at every split product: it stays inside
  // a node, on the intra-node link.
  for (const HardwareSpec &hw : setup->hardware)
    if (options.tensorParallel > std::max(1, hw.devicesPerNode))
      return flagError(formatv("--tp {0}: larger than a node of {1} ({2} devices); a "
                               "tensor-parallel group stays inside a node",
                               options.tensorParallel, hw.name, hw.devicesPerNode));
  Compilation compilation(modelPath, options, std::move(*setup), pipeline);
  if (options.training && options.autoSchedule)
    return compilation.autoSchedule();
  auto plan = compilation.fixedSchedule();
  if (plan && options.maxLength > 0)
    plan->mutable_generation()->set_groups_reason(groupsReason);
  if (!plan || options.maxLength == 0 || options.promptLength == 0)
    return plan;
  return withPrefill(std::move(*plan), modelPath, options);
}

} // namespace pipec
