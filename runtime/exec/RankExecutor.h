//===- RankExecutor.h - One rank of a run, and what all ranks share -----===//
//
// The executor's own vocabulary, shared by its files; the API is Executor.h.
//
//   Executor.cpp    RankExecutor: loads a rank's weights and interprets its
//                   instruction stream, one step at a time
//   Optimizer.cpp   OPTIMIZER_STEP: the learning-rate schedule, gradient
//                   clipping, float32 master copies of half weights
//   Checkpoint.cpp  a rank's checkpoint files
//   Trace.cpp       the measured timeline
//   Generate.cpp    a generate plan's token loop (RankExecutor::generate)
//   Launch.cpp      a run: ranks as threads (runLocal) or MPI processes
//                   (runMpi), their steps, outputs and results
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_RANKEXECUTOR_H
#define PIPEC_RUNTIME_EXEC_RANKEXECUTOR_H

#include "plan/PlanFile.h"
#include "runtime/comm/Comm.h"
#include "runtime/core/Backend.h"
#include "runtime/exec/Data.h"
#include "runtime/exec/Executor.h"
#include "runtime/exec/StepProfile.h"
#include "runtime/exec/ValueTable.h"
#include "support/ChromeTrace.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/ADT/Twine.h"
#include "llvm/Support/Error.h"

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace pipec::rt {

using Clock = std::chrono::steady_clock;

/// Seconds since the epoch: trace times that processes on one host share.
inline double wallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
using Ins = plan::Instruction;

/// "rank R: WHY".
llvm::Error rankError(int rank, const llvm::Twine &why);

/// What all ranks of a run share (read-only once made).
struct Shared {
  const plan::Plan *plan = nullptr;
  RunOptions options;
  std::string modelPath, modelDir;
  std::shared_ptr<DataSource> data;
  /// --eval-data, read in order; null without it.
  std::shared_ptr<DataSource> evalData;
  int P = 1, dp = 1, K = 1, M = 1;
  /// Where each global rank sits: (replica, pipeline rank, tensor-parallel
  /// rank); grid.T ranks run each pipeline rank's program on their pieces
  /// of its split weights.
  RankGrid grid;
  /// --tp: how each split weight is cut, by name.
  std::map<std::string, const plan::WeightShard *> shards;
  /// --sequence-parallel: the weights whose gradients each tensor-parallel
  /// rank holds for its tokens alone (plan.sequence_grads).
  std::set<std::string> sequenceGrads;
  int64_t globalBatch = 1, microbatchSize = 1;
  bool training = true;
  /// --shard-optimizer over dp > 1 replicas: each keeps and updates 1/dp of
  /// every weight's optimizer state (REDUCE_SCATTER, ALL_GATHER).
  bool shardOptimizer = false;
  std::vector<int> rankOfStage;
  std::map<std::string, const onnx::TensorProto *> weightProtos;
  /// --init: the weights the checkpoint gives, in place of the plan's.
  std::map<std::string, cpu::Tensor> initWeights;
  /// The constant a weight holds its parameter shifted by (ParamMap.h's
  /// decayCenterOf), for the weights where it is not 0.
  std::map<std::string, double> decayCenters;
  /// What every checkpoint file of this run carries: the run's id and the
  /// plan's hash (plan::Checkpoint's run and plan).
  std::string checkpointRun, checkpointPlan;
  /// Lines the run warns about before its first step (--init).
  std::vector<std::string> warnings;
  std::set<std::string> trainable;
  Optimizer optimizer = Optimizer::AdamW;
  double lr = 1e-3;
  Fault fault;
  /// The plan's stage programs, fused as compile left them.
  std::vector<plan::StageProgram> programs;
};

/// `pipec generate` (Generate.cpp): what its ranks share, and one rank's
/// state in its token loop.
struct GenerationJob;
struct GenerationLoop;

/// What the optimizer made of a weight of 1 that no gradient reached, after
/// the run's steps: the factor by which a sliced table's rows outside the
/// slice shrink (decoupled weight decay), 1 without decay.
double untrainedFactor(const Shared &s);

/// Microbatch \p mb's first sample at step \p step on replica \p replica.
inline int64_t firstSample(const Shared &s, int step, int replica, int mb) {
  return static_cast<int64_t>(step) * s.globalBatch +
         (static_cast<int64_t>(replica) * s.M + mb) * s.microbatchSize;
}

/// Interprets one rank's instruction stream: its weights, the values of the
/// microbatches in flight, its gradient accumulators and optimizer state.
class RankExecutor {
public:
  RankExecutor(const Shared &shared, Comm &comm, Backend &backend)
      : s(shared), comm(comm), be(backend), global(comm.rank()),
        replica(shared.grid.replicaOf(global)), rank(shared.grid.pipelineRankOf(global)),
        tp(shared.grid.tpOf(global)), program(shared.plan->programs(rank)) {}

  /// Loads this rank's weights; those in \p reuse (another executor's, of
  /// the same model) are shared, not read again.
  llvm::Error load(const std::map<std::string, cpu::Tensor> *reuse = nullptr);
  llvm::Error step(int t, double &lossSum, double &lossCount);
  /// Runs the plan's evaluation stream over batch \p batch of the
  /// evaluation data (Shared::evalData): forwards only, the weights as they
  /// are. The loss sums as step's do.
  llvm::Error evaluate(int batch, double &lossSum, double &lossCount);
  llvm::Error saveCheckpoint(llvm::StringRef file, int nextStep);
  llvm::Error loadCheckpoint(llvm::StringRef file, int &nextStep);
  /// Resumes from \p dir's step \p step, written at another tensor-parallel
  /// degree \p writtenT: the pieces of this rank's stage and replica joined
  /// where that run split them, and cut where this one does.
  llvm::Error loadCheckpointAcross(llvm::StringRef dir, int step, int writtenT, int &nextStep);

  int globalRank() const { return global; }
  /// Runs stage \p stage's forward nodes over \p values (its inputs, and
  /// then what it sends and its graph outputs: each other value goes after
  /// its last reader): a step of `pipec generate`.
  llvm::Error runForward(int stage, Env &values);
  /// An empty Env of this rank's value names, for runForward.
  Env makeEnv() { return Env(&names); }
  /// Runs this rank's part of a generate plan's token loop, \p loop: its
  /// generation streams (the start, then rounds until every group stopped),
  /// each instruction as loopStep says.
  llvm::Error generate(GenerationLoop &loop);
  /// Host copies of this rank's trainable weights and of the running
  /// statistics its steps update.
  llvm::Expected<std::map<std::string, cpu::Tensor>> trainedWeights();
  /// --tp: joins the pieces of the split weights (and of their last
  /// gradients, collectWeights) over this rank's tensor-parallel group, for
  /// trainedWeights to return whole; every rank of the group calls it.
  llvm::Error joinSplitWeights();
  int replicaIndex() const { return replica; }
  int pipelineRank() const { return rank; }
  int tpIndex() const { return tp; }
  std::map<std::string, cpu::Tensor> weights; ///< this rank's weights and constants
  std::map<std::string, cpu::Tensor> lastGrads;
  std::map<std::string, std::map<int64_t, cpu::Tensor>> outputs;
  std::vector<TraceEvent> events;
  double busy = 0;
  int64_t instructions = 0;
  /// The process's peak resident set while the weights loaded (of a local
  /// run's ranks, the first to ask has it; cpu::startResidentWindow).
  int64_t loadPeakResident = 0;
  /// Time inside the backend's node kernels, time in whole instructions
  /// (excluding waits for messages), and nodes run.
  double kernelSeconds = 0, instructionSeconds = 0;
  int64_t nodesRun = 0;
  /// The last step's learning rate and (with clipping) gradient norm.
  double lastLr = 0, lastGradNorm = -1;
  /// Seconds spent waiting for messages inside compute instructions.
  double waitSeconds = 0;
  /// run --profile: the profiled step's nodes, recorded while set.
  RankProfile *profile = nullptr;
  /// run --profile: the last step's profile on this rank.
  RankProfile stepProfile;
  /// What this rank's backend has done so far.
  BackendCounters backendCounters() const { return be.counters(); }

private:
  const plan::StageProgram &stageProgram(int stage) const { return s.programs[stage]; }
  /// Runs \p stream (a step's instructions, or an evaluation's) for step or
  /// evaluation batch \p t.
  llvm::Error runStream(const google::protobuf::RepeatedPtrField<Ins> &stream, int t);
  /// One instruction of the token loop (of the start when \p first):
  /// SCHEDULE (the first rank), the control, hidden state and picks
  /// received and sent, LOAD of the inputs the control makes, FORWARD and
  /// the cache writes, PICK (the last rank). A group that stops passes its
  /// control alone, then none of its instructions run.
  llvm::Error loopStep(GenerationLoop &loop, const Ins &ins, bool first);
  llvm::Error schedule(GenerationLoop &loop, int group, bool first);
  llvm::Error loadPass(GenerationLoop &loop, int group);
  llvm::Error forwardPass(GenerationLoop &loop, int group);
  llvm::Error pick(GenerationLoop &loop, int group);
  llvm::Expected<cpu::Tensor> receiveLoop(GenerationLoop &loop, const Ins &ins);
  /// With --trace: an event of this rank from \p started (wallNow) to now.
  void traceLoop(GenerationLoop &loop, char category, const std::string &name, double started);
  /// Inside evaluate: inputs come from the evaluation data, and nothing is
  /// traced or faulted.
  bool evaluating = false;
  bool local(int stage) const { return stage >= 0 && stage < s.K && s.rankOfStage[stage] == rank; }
  int peerGlobal(int pipelineRank) const { return s.grid.global(replica, pipelineRank, tp); }
  Env &env(int stage, int mb) { return envs.try_emplace({stage, mb}, &names).first->second; }
  /// \p dropAfter, when given: per node, the values to erase from
  /// \p values once it ran. \p instead, when given, is asked first with
  /// each node's index and inputs, and returns true where it has done the
  /// node's work itself (the node's outputs are then not made). \p afterNode,
  /// when given, runs with each node's index once its outputs are in
  /// \p values.
  using NodeInputs = llvm::ArrayRef<const cpu::Tensor *>;
  llvm::Error runNodes(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
                       Env &values, int stage, int mb, llvm::StringRef phase,
                       const std::vector<std::vector<std::string>> *dropAfter = nullptr,
                       llvm::function_ref<llvm::Error(int)> afterNode = nullptr,
                       llvm::function_ref<llvm::Expected<bool>(int, NodeInputs)> instead = nullptr);
  /// Per node of a node list, the values to erase once it ran.
  using DropSchedule = std::vector<std::vector<std::string>>;
  enum class NodeListKind { Forward, BackwardInput, BackwardWeight };
  /// Per stage and node list, each value's last reader in the list, for the
  /// values nothing after the list reads (dropsFor).
  std::map<std::pair<int, NodeListKind>, DropSchedule> dropSchedules;
  /// The drops of \p list of \p stage. A forward keeps what it sends, its
  /// graph outputs and, training, the loss and what the backward (or the
  /// recompute) reads; the input-gradient list keeps what the
  /// weight-gradient list and the gradient sums read; the weight-gradient
  /// list keeps its gradient terms and running statistics.
  const DropSchedule &dropsFor(int stage, NodeListKind list);
  /// Per node of a weight-gradient list (-1: before it), the gradient terms
  /// to add into their weights' accumulators once it ran, as (weight, term).
  using AddSchedule = std::map<int, std::vector<std::pair<std::string, std::string>>>;
  std::map<int, AddSchedule> addSchedules;
  /// The adds of \p stage's weight-gradient list: each term once its
  /// producer and its last reader in the list ran, so that it dies there
  /// instead of with the microbatch.
  const AddSchedule &addsFor(int stage);
  llvm::Error loadInputs(int stage, int mb, int t);
  llvm::Error collect(bool grad, int stageField, int mb);
  llvm::Error forward(int stage, int mb, int t, bool again);
  llvm::Error backwardInput(int stage, int mb);
  llvm::Error backwardWeight(int stage, int mb);
  /// Term \p term of the gradient of \p value (\p kind "weight " for a
  /// weight's, else "") in \p values; the error says it was not computed.
  llvm::Expected<const cpu::Tensor *> gradientTerm(const Env &values, const std::string &term,
                                                   llvm::StringRef kind, const std::string &value,
                                                   int stage, int mb);
  llvm::Error allReduce(const Ins &ins);
  /// Sums \p sums over \p group in place, on the device where the
  /// transport allows.
  llvm::Error sumOver(const std::vector<int> &group, const std::vector<cpu::Tensor *> &sums);
  /// The global ranks of this rank's data-parallel replicas, this one among
  /// them, in order.
  std::vector<int> replicaGroup() const;
  /// The global ranks that split this rank's stages' tensors, in order.
  std::vector<int> tpGroup() const;
  /// TpAllReduce: the sum of \p input over tpGroup().
  llvm::Expected<cpu::Tensor> sumOverTp(const cpu::Tensor &input);
  /// --sequence-parallel: sums the gradients of Shared::sequenceGrads here
  /// over tpGroup(), before the optimizer reads them.
  llvm::Error sumSequenceGrads();
  /// Host tensor \p host summed over tpGroup(), on the host.
  llvm::Expected<cpu::Tensor> sumHostOverTp(const cpu::Tensor &host);
  /// Every rank of tpGroup()'s \p host (flat), in group order, on the host.
  llvm::Expected<cpu::Tensor> gatherOverTp(const cpu::Tensor &host);
  /// A collective node (Ops.def's Collective rows without a kernel): the
  /// partial products summed, the vocabulary-parallel loss or its gradient.
  llvm::Expected<std::vector<cpu::Tensor>> runCollective(const onnx::NodeProto &node,
                                                         const OpDef &def, NodeInputs inputs);
  /// TpGather (the vocabulary-parallel lookup) and its gradient: this rank's
  /// rows of the table, [tp x rows, (tp + 1) x rows).
  llvm::Expected<std::vector<cpu::Tensor>> lookupCollective(const onnx::NodeProto &node,
                                                            const OpDef &def, NodeInputs inputs);
  /// The whole of split weight (or gradient) \p piece, from the pieces of
  /// every rank of tpGroup().
  llvm::Expected<cpu::Tensor> joinOverTp(const cpu::Tensor &piece, const plan::WeightShard &shard);
  /// joinSplitWeights' whole weights.
  std::map<std::string, cpu::Tensor> joinedWeights;
  /// --shard-optimizer: the elements of each replica's shard of weight
  /// \p name, its elements over the replicas rounded up (the last shard is
  /// padded with zeros).
  int64_t shardElements(const std::string &name) const;
  /// REDUCE_SCATTER: each gradient becomes this replica's shard of the
  /// replicas' sum (running statistics are summed whole).
  llvm::Error reduceScatter(const Ins &ins);
  /// ALL_GATHER: every replica's updated shards make the whole weights.
  llvm::Error allGather(const Ins &ins);
  /// Runs \p tensors (one per trained weight, in trainableHere's order)
  /// through \p collective over the replicas, moving them to and from the
  /// host when the transport sums host tensors.
  llvm::Error overReplicas(std::vector<cpu::Tensor> &tensors,
                           llvm::Error (Comm::*collective)(llvm::ArrayRef<int>,
                                                           llvm::MutableArrayRef<cpu::Tensor>));
  llvm::Error optimizerStep(int t);
  /// Fails, naming the first of \p slots' weights and second moments (in
  /// update order) that step \p t left infinite or NaN, when \p squares
  /// (the update's sum of their squares, read with one wait) is not finite.
  llvm::Error checkFinite(const cpu::Tensor &squares, llvm::ArrayRef<OptimizerSlot> slots, int t,
                          const OptimizerUpdate &u);
  /// --collect-weights: the step's whole gradients, times \p scale, into
  /// lastGrads.
  llvm::Error collectGradients(double scale);
  /// The step's gradient and running-statistic accumulators, zeroed.
  /// Starts a step's gradients: each trainable weight's accumulator is
  /// unset until its first term (backwardWeight takes the term itself when
  /// it can), so that the gradients grow as the backward frees activations.
  llvm::Error zeroAccumulators();
  /// Zeros for the accumulators no term reached: before a reduction or the
  /// optimizer reads them.
  llvm::Error fillUnsetGradients();
  /// Adds \p term, the value \p name of \p values, into \p acc; an unset
  /// \p acc of \p weight takes the term's buffer when nothing else holds it.
  llvm::Error accumulate(cpu::Tensor &acc, const std::string &weight, Env &values,
                         const std::string &name, const cpu::Tensor &term);
  /// Instruction \p i (\p ins) of step \p t; \p category is the trace
  /// letter of a compute (F, R, I, W, B, C, O), 0 for the rest.
  llvm::Error execute(const Ins &ins, int i, int t, char &category);
  /// Rank file \p file's checkpoint, its checksum checked; errors name the
  /// rank and the file.
  llvm::Expected<plan::Checkpoint> readCheckpoint(llvm::StringRef file);
  /// Takes the state of checkpoint \p c (read from \p file).
  llvm::Error applyCheckpoint(const plan::Checkpoint &c, llvm::StringRef file, int &nextStep);
  llvm::Error send(const Ins &ins, int i);
  llvm::Error postRecv(const Ins &ins);
  /// Counts the compute \p ins as busy time and traces it: it began at
  /// \p started and waited \p waited seconds for its receives first.
  void record(const Ins &ins, char category, double started, double waited);
  void prune(Env &values, const std::set<std::string> &keep);
  /// \p t as the Comm takes it: device tensors stay when it moves them.
  llvm::Expected<cpu::Tensor> forComm(const cpu::Tensor &t);

  const Shared &s;
  Comm &comm;
  Backend &be;
  int global, replica, rank, tp;
  const plan::RankProgram &program;
  /// The slots of the values of this rank's programs, and each node list
  /// prepared (by its address and that of its drop schedule; prepare).
  ValueNames names;
  std::map<std::pair<const void *, const void *>, PreparedList> preparedLists;
  const std::vector<PreparedNode> &
  prepare(const google::protobuf::RepeatedPtrField<onnx::NodeProto> &nodes,
          const std::vector<std::vector<std::string>> *dropAfter);
  std::map<std::pair<int, int>, Env> envs;
  std::map<std::tuple<bool, int, int, std::string>, cpu::Tensor> outbox;
  std::map<std::tuple<bool, int, int, std::string>, int> pending;
  /// Per trained weight: its gradient accumulator (with --shard-optimizer,
  /// after REDUCE_SCATTER, this replica's shard of the sum) and the
  /// optimizer's moments (sharded: of this replica's shard).
  std::map<std::string, cpu::Tensor> grads, moment1, moment2;
  /// float32 master copies of trained float16 / bfloat16 weights (sharded:
  /// of this replica's shard).
  std::map<std::string, cpu::Tensor> master;
  /// --shard-optimizer: the shards OPTIMIZER_STEP updated, in the weights'
  /// types, for ALL_GATHER.
  std::map<std::string, cpu::Tensor> updatedShards;
  /// \p t converted to ONNX element type \p to by the backend's Cast.
  llvm::Expected<cpu::Tensor> castTo(const cpu::Tensor &t, int to);
  std::vector<std::string> trainableHere;
  /// Running buffers this rank's stages update -> their momentum, and each
  /// one's sum of the step's microbatch statistics.
  std::map<std::string, float> runningHere;
  std::map<std::string, cpu::Tensor> statisticSums;
  /// Sets each running buffer from the step's statistics.
  llvm::Error updateRunningStats();
  std::map<int, std::set<std::string>> keepSets;
  /// Runs \p stage's load_nodes (the plan's fold-weights pass: nodes of
  /// weights alone); their outputs join `weights`. \p inStep: a step's
  /// refresh after the weights changed, counted with its nodes (and in its
  /// profile) as the load's run is not.
  llvm::Error runLoadNodes(int stage, bool inStep);
  /// Whether the weights changed since the load nodes last ran (an
  /// optimizer step, a restored checkpoint): the next stream runs them
  /// first, once for the step.
  bool loadNodesStale = false;
  /// Per local stage that recomputes: what FORWARD keeps
  /// (keep_when_recomputing, the plan's select-recompute pass).
  std::map<int, std::set<std::string>> keptWhenRecomputing;
  /// Buffer -> (stage, microbatch) of the FORWARD that fills it: what FREE
  /// drops.
  std::map<int, std::pair<int, int>> bufferOwner;
  /// Whether the run writes a trace (events are kept only then).
  bool tracing = !s.options.tracePath.empty();
  /// Tied weight -> the lowest pipeline rank holding it.
  std::map<std::string, int> tiedOwner;
  double lossSum = 0, lossCount = 0;
  /// The last stage's loss (and label count) of each microbatch, left where
  /// the backend computed them until settleLosses reads them all with one
  /// wait.
  struct PendingLoss {
    cpu::Tensor loss, count; // count: null without a label count
    int step = 0, microbatch = 0;
  };
  std::vector<PendingLoss> pendingLosses;
  /// Adds the pending losses to lossSum and lossCount, in microbatch order,
  /// after one download of them all; stops the run on a non-finite loss of
  /// a microbatch that counts labels.
  llvm::Error settleLosses();
};

// The pieces of a run that `pipec generate` (Generate.cpp) shares with
// `pipec run` (Launch.cpp).

/// What all ranks of a run of \p plan share; checks the options, the plan
/// against the machine and the model file's bytes.
llvm::Expected<std::unique_ptr<Shared>> makeShared(const plan::Plan &plan,
                                                   const RunOptions &options);
/// The loop threads of each of \p ranks ranks of this node (--threads-per-rank,
/// else the cores shared out).
int shareCores(const RunOptions &options, int ranks);
/// Pins the calling thread to core \p rank of \p ranks; -1 restores the mask.
void pinToCore(int rank, int ranks);
/// The BLAS, its kernels and why it was chosen, for the summary's cpu: line.
std::string blasName();
/// Keeps freed tensor memory in the heap (a step's allocations repeat).
void keepFreedMemory();

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_RANKEXECUTOR_H
