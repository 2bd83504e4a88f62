//===- BalanceStages.h - balance-stages: layers to pipeline chunks ------===//
//
// Cuts the chain of layers into P x V contiguous chunks and places chunk k on
// rank rankOfChunk(k) (looped, or a V for ZB-V and DualPipeV). Methods:
//   time     the least predicted step time, as the simulator predicts the
//            compiled plan's step (PredictStep.h). Candidates: for each
//            bottleneck on the Pareto front (the slowest chunk, compute plus
//            the send of its boundary tensors, from the least any partition
//            reaches up to that of the most even partition), the most even
//            partition under it (least sum of squared chunk times), by an
//            exact dynamic program over (chunk, layer), O(P V L^2) with
//            pruning; the params and uniform layouts; then a local search
//            that moves one layer across one boundary while that shortens
//            the step. The least bottleneck is not the least step: the
//            warm-up and cool-down run through every chunk, the optimizer
//            step and the gradient all-reduces scale with a rank's
//            parameters, and with V > 1 a rank runs the sum of its chunks.
//            So `time` never predicts a slower step than `params` or
//            `uniform` where they fit memory.
//   params   DeepSpeed's default: the same exact min-max over parameter
//            counts.
//   uniform  equal layer counts (the first chunks take the remainder).
//   LAYOUT   an explicit layout, Megatron-like: "E,t*7|t*8|t*8|t*7,L".
// Memory limits hold per rank: weights, gradients, optimizer state and the
// activations of the microbatches the schedule keeps in flight, summed over
// a rank's chunks. Every plan prints its layout.
//
// Before: 34 layers (embedding, 32 blocks, head), P = 4
// After:  E,t*8|t*8|t*8|t*8,L   (chunk times within one block of each other)
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_BALANCESTAGES_H
#define PIPEC_PASSES_BALANCESTAGES_H

#include "compiler/cost/CostModel.h"
#include "compiler/cost/MemoryModel.h"
#include "compiler/schedule/PipelineShape.h"

#include <functional>

namespace pipec {

struct LoweringInputs;
struct StagePlan;

enum class BalanceMethod { Time, Params, Uniform, Layout };
llvm::StringRef balanceMethodName(BalanceMethod method);

struct BalanceOptions {
  /// The schedule, P, V, M and dp replicas (whose gradient all-reduce is
  /// part of the step), checked.
  PipelineShape shape;
  BalanceMethod method = BalanceMethod::Time;
  /// The layout string when method is Layout.
  std::string layout;
  TrainingSetup training;
  /// Per rank (size stages): the cost table of its hardware (tables may be
  /// shared between ranks), the hardware, and the memory limit in bytes
  /// (0: no limit).
  std::vector<const CostTable *> rankCosts;
  std::vector<HardwareSpec> rankHardware;
  std::vector<int64_t> memoryLimit;
  /// The lowering inputs the compiled plan of a partition will have (the
  /// driver's boundary tensors and all-reduces); unset: one tensor of the
  /// cost table's boundary bytes per cut (defaultLoweringInputs).
  std::function<LoweringInputs(const StagePlan &)> lowering;
  /// Most partitions the `time` method simulates (Pareto front and local
  /// search together).
  int maxCandidates = 160;
};

struct ChunkPlan {
  int index = 0;
  int rank = 0;
  /// Position among the rank's chunks (0 .. V-1).
  int chunkOnRank = 0;
  /// Layer range, inclusive; firstLayer > lastLayer for an empty chunk.
  int firstLayer = 0, lastLayer = -1;
  std::array<double, 3> time{};
  /// Sending the boundary tensors after the chunk (and their gradients).
  double commTime = 0;
  int64_t params = 0;
  double flopsForward = 0;
  int64_t activationBytes = 0; ///< kept per microbatch (without recompute)
  int64_t workingBytes = 0;    ///< held beyond them while it runs (its largest layer's)
  int64_t boundaryBytes = 0;   ///< sent per microbatch
  /// How many of the chunk's first layers recompute their activations in
  /// the backward (--recompute: all; auto: as the memory limit needs), the
  /// bytes RECOMPUTE rebuilds per microbatch and the seconds it takes.
  int recomputedLayers = 0;
  int64_t rebuiltBytes = 0;
  double recomputeTime = 0;
  bool recomputes() const { return recomputedLayers > 0; }
  double totalTime() const { return time[0] + time[1] + time[2] + commTime; }
  bool empty() const { return firstLayer > lastLayer; }
};

struct RankPlan {
  int index = 0;
  std::string hardware;
  int64_t memoryLimit = 0;
  int64_t weightBytes = 0;     ///< weights, gradients and optimizer state
  int64_t optimizerBytes = 0;  ///< of weightBytes, the (sharded) optimizer state
  int64_t activationBytes = 0; ///< activations at the schedule's peak
  int64_t peakMemory = 0;
  /// Compute and send time per step.
  double busy = 0;
};

struct StagePlan {
  BalanceMethod method = BalanceMethod::Time;
  std::string layout;
  std::vector<ChunkPlan> chunks;
  std::vector<RankPlan> ranks;
  /// The slowest chunk's time per microbatch.
  double bottleneck = 0;
  /// The least bottleneck any partition that fits memory reaches (the exact
  /// min-max partition; 0 for layouts given by hand).
  double leastBottleneck = 0;
  /// The simulated step (PredictStep.h) of this partition, and how many
  /// partitions `time` simulated to choose it.
  double simulatedStep = 0;
  int candidatesSimulated = 0;
  /// Slowest over mean chunk time.
  double imbalance = 1;
  bool fitsMemory = true;
};

/// Balances \p layers as \p options say. Errors: fewer layers than chunks
/// (unless a layout asks for empty chunks), a malformed layout (naming the
/// stage and layer), and memory limits nothing fits (naming the stage, rank
/// and bytes).
llvm::Expected<StagePlan> balanceStages(const LayerGraph &layers, const BalanceOptions &options);

/// The text --print-after=balance-stages shows: the method, layout and
/// predicted figures, then one line per chunk (rank, layers, F / I / W and
/// send times, bytes) and per rank (memory).
void printStagePlan(const StagePlan &plan, llvm::raw_ostream &os);

/// The Megatron-like layout of a plan: "E,t*7|t*8|...|t*7,L".
std::string formatLayout(const LayerGraph &layers, const StagePlan &plan);

/// Parses \p layout into one inclusive layer range per chunk (empty chunks
/// as {first, first - 1}). Tokens: E the leading non-block layers, t one
/// block, L the trailing non-block layers, o any one layer; "x*N" and
/// "(...)*N" repeat; "|" ends a stage; "," and spaces separate for reading.
llvm::Expected<std::vector<std::pair<int, int>>> parseLayout(llvm::StringRef layout,
                                                             const LayerGraph &layers, int chunks);

} // namespace pipec

#endif // PIPEC_PASSES_BALANCESTAGES_H
