//===- LowerSchedule.h - lower-schedule and verify-program --------------===//
//
// lower-schedule turns each rank's compute actions into its instruction
// stream: LOAD of inputs and labels, a RECV of every boundary tensor before
// the compute that reads it and a SEND after the compute that makes it (one
// per tensor: a boundary may carry the hidden state, a mask and position
// ids), RECOMPUTE before a backward when checkpointing, the all-reduces of
// tied weights and data-parallel replicas, and OPTIMIZER_STEP. SEND and RECV
// are posted asynchronously; the ones between two computes form one group
// (one NCCL group: they complete together), which is what keeps 1F1B's
// send-forward / receive-backward pairs from deadlocking.
//
// Every forward's kept activations get a buffer, freed by the full backward
// (B) or, with split backward, by W; with recompute the rebuilt activations
// get one too. lower-schedule numbers the buffers and records their
// lifetimes; plan-memory (PlanMemory.h) then gives them slots and peaks.
//
// verify-program checks that every SEND has a matching RECV (peer, tensor,
// shape, dtype), that each rank's order respects the data dependencies, and
// that the streams cannot deadlock under blocking, NCCL-like semantics, by
// running all ranks; on failure it prints the rank x step grid with the
// blocked steps marked.
//
// Before: rank 1: 1F0 1F1 1B0 1F2 1B1 1B2          (P = 2, M = 3)
// After:  rank 1: RECV act 0.0 <- 0 | LOAD labels 0 | FORWARD 1.0 |
//                 RECV act 0.1 <- 0 | ... | BACKWARD 1.0 | SEND grad 1.0 -> 0 | ...
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_LOWERSCHEDULE_H
#define PIPEC_PASSES_LOWERSCHEDULE_H

#include "compiler/schedule/Schedule.h"
#include "compiler/sim/Simulator.h"
#include "passes/PlanMemory.h"
#include "plan/plan.pb.h"

#include "llvm/Support/raw_ostream.h"

#include <string>
#include <tuple>
#include <vector>

namespace pipec {

struct LoweringInputs {
  /// Per global chunk: the tensors that cross its output boundary (empty for
  /// the last chunk) and whether each carries a gradient back.
  std::vector<std::vector<plan::TensorRef>> sendTensors;
  std::vector<std::vector<bool>> hasGradient;
  /// Per global chunk: activation bytes kept per microbatch without
  /// recompute, and the bytes of its input.
  std::vector<int64_t> activationBytes;
  std::vector<int64_t> inputBytes;
  /// Per global chunk (empty: none): what it holds beyond its kept
  /// activations while it runs (LayerCost::workingBytes, its largest layer's).
  std::vector<int64_t> workingBytes;
  bool training = true;
  /// Per global chunk (empty: none): whether it recomputes, with a RECOMPUTE
  /// before each backward, and the bytes that rebuilds per microbatch (the
  /// activations of its recomputing layers). Its FORWARD keeps its input and
  /// the rest.
  std::vector<bool> recompute;
  std::vector<int64_t> rebuiltBytes;
  bool recomputes(int chunk) const {
    return chunk < static_cast<int>(recompute.size()) && recompute[chunk];
  }
  /// Every chunk recomputes all its layers (--recompute).
  void recomputeAll() {
    recompute.assign(activationBytes.size(), true);
    rebuiltBytes = activationBytes;
  }
  /// The step's collectives, in order: ALLREDUCE and REDUCE_SCATTER go
  /// before the optimizer step, ALL_GATHER after it.
  struct Collective {
    plan::Instruction::Op op = plan::Instruction::ALLREDUCE;
    plan::Instruction::Reduce reduce = plan::Instruction::DATA_PARALLEL;
    std::string tiedWeight; ///< TIED_WEIGHT: the weight
    std::vector<int> ranks;
    int64_t bytes = 0;
  };
  std::vector<Collective> collectives;
};

/// lower-schedule's result in array form: each rank's stream and its
/// buffers with their lifetimes. The streams' tensors point into the
/// LoweringInputs, which must outlive them.
struct LoweredStreams {
  Streams streams;
  std::vector<std::vector<BufferLife>> buffers;
  /// Per rank: the working bytes of the chunks it runs, summed.
  std::vector<int64_t> workingBytes;
  /// What the streams' structure depends on besides the schedule: each
  /// boundary's tensors (by whether each carries a gradient back), training,
  /// recompute and the collectives. Sizes and names do not shape it.
  std::vector<std::vector<bool>> hasGradient;
  bool training = true;
  std::vector<bool> recompute;
  std::vector<
      std::tuple<plan::Instruction::Op, plan::Instruction::Reduce, std::string, std::vector<int>>>
      groups;
};

/// lower-schedule, in array form: what the simulator runs when the compiler
/// judges a candidate, and what the plan's programs are written from.
llvm::Expected<LoweredStreams> lowerStreams(const Schedule &schedule, const LoweringInputs &inputs);

/// Brings \p lowered, lowered from the same schedule, to \p inputs when they
/// differ from its own only in sizes and names (a search's candidates: the
/// same tensors crossing each boundary, of other sizes): the same streams
/// lowerStreams would make, with their tensors pointing into \p inputs and
/// their buffers' and all-reduces' bytes from it. Returns false, leaving it
/// as it was, when the structure differs.
bool resizeLowered(LoweredStreams &lowered, const LoweringInputs &inputs);

/// The plan's programs of \p lowered (lowered from \p schedule).
std::vector<plan::RankProgram> toRankPrograms(const LoweredStreams &lowered,
                                              const Schedule &schedule);

/// lower-schedule. The result has one RankProgram per rank, its buffers with
/// their lifetimes but without slots (plan-memory's job).
llvm::Expected<std::vector<plan::RankProgram>> lowerSchedule(const Schedule &schedule,
                                                             const LoweringInputs &inputs);

/// The text --print-after=lower-schedule shows: the rank x step grid of
/// compute actions, then each rank's instructions, numbered.
void printPrograms(const std::vector<plan::RankProgram> &programs, llvm::raw_ostream &os);

/// Fills \p program's `evaluation` from its training instructions: the
/// loads, forwards, activation transfers and the frees of what the forwards
/// made, in their order.
void addEvaluationStream(plan::RankProgram &program);

/// verify-program, over each rank's instructions and, in a train plan, its
/// evaluation stream; the error holds the rank x step grid when it fails.
llvm::Error verifyProgram(const std::vector<plan::RankProgram> &programs, int stages,
                          int microbatches, ScheduleKind kind, int virtualStages);

/// verify-program over a generate plan's loop (GenerationStreams.h): each
/// rank's start of \p starts (the programs' own, or a prefill's), two of
/// \p programs' rounds and their stop, of \p groups groups, as one stream.
llvm::Error verifyGenerationStreams(const std::vector<plan::RankProgram> &starts,
                                    const std::vector<plan::RankProgram> &programs, int groups,
                                    ScheduleKind kind);

/// One line per instruction, e.g. "SEND act s1 mb3 -> 2 /h.3/Add_output_0".
std::string formatInstruction(const plan::Instruction &instruction);

/// The rank x step grid of compute actions; steps in \p marked (one per rank,
/// -1 for none) are shown in brackets.
std::string formatGrid(const std::vector<plan::RankProgram> &programs,
                       const std::vector<int> &marked);

} // namespace pipec

#endif // PIPEC_PASSES_LOWERSCHEDULE_H
