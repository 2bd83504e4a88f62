//===- Simulator.h - Event simulation of a plan's instruction streams ---===//
//
// Runs every rank's stream under the cost model. Each rank has a compute
// stream and a communication stream. A compute instruction starts when the
// compute stream is free and the tensors it receives have arrived; its
// duration is the stage's predicted F, I, W (B = I + W; RECOMPUTE = F). A
// group of SEND / RECV is posted after the compute before it and starts when
// every rank it pairs with has posted its matching group and their
// communication streams are free; each transfer takes latency + bytes /
// bandwidth on the link between the two ranks (NVLink within a node,
// InfiniBand between nodes), so sends overlap later compute. An ALLREDUCE
// takes a ring's 2 (n - 1) (latency + bytes / n / bandwidth); the optimizer
// step reads and writes the rank's weights and state once at memory
// bandwidth.
//
// The result: per-rank timeline, busy and idle time, bubble fraction, step
// time, and peak memory (weights and state plus plan-memory's peak of live
// activations).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_SIM_SIMULATOR_H
#define PIPEC_COMPILER_SIM_SIMULATOR_H

#include "plan/plan.pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <array>
#include <functional>
#include <string>
#include <vector>

namespace pipec {

struct TimelineEvent {
  int rank = 0;
  std::string name;    ///< "0F3", "SEND act s0 mb3 -> 1 x", "ALLREDUCE dp"
  char category = 'F'; ///< F, B, I, W, R (recompute), C (communication), O (optimizer)
  double start = 0, duration = 0;
  int microbatch = -1;
};

struct SimulationResult {
  double stepTime = 0;
  double bubbleFraction = 0;
  std::vector<double> busy; ///< compute seconds per rank
  std::vector<double> idle; ///< step time minus busy
  std::vector<int64_t> peakMemory;
  std::vector<TimelineEvent> events;
};

/// One instruction of a rank's stream in the array form the simulator runs:
/// lower-schedule builds it directly, and a plan's programs are read into
/// it (streamsOf). Its tensor and collective are indices into the tables of
/// its Streams; its mailbox is resolved once, so that running it looks
/// nothing up by name.
struct StreamOp {
  plan::Instruction::Op op = plan::Instruction::LOAD;
  int stage = -1, microbatch = -1;
  int peer = -1;       ///< SEND, RECV
  bool grad = false;   ///< SEND, RECV: a gradient rather than an activation
  bool labels = false; ///< LOAD: the labels rather than the inputs
  int buffer = -1;     ///< FORWARD, RECOMPUTE, FREE: the activation buffer
  int tensor = -1;     ///< SEND, RECV: in Streams::tensors
  int collective = -1; ///< ALLREDUCE: in Streams::collectives
  /// RECV: the mailbox it fills, one per (rank, stage, microbatch, grad).
  /// FORWARD, BACKWARD, BACKWARD_INPUT, SCHEDULE: the one whose data it
  /// waits for (the stage before's activations, its own outputs' gradients,
  /// a generation's picks from the last stage); -1 when
  /// no RECV fills it.
  int mailbox = -1;
};

/// An ALLREDUCE's group and gradients.
struct StreamCollective {
  plan::Instruction::Op op = plan::Instruction::ALLREDUCE; ///< or REDUCE_SCATTER, ALL_GATHER
  plan::Instruction::Reduce reduce = plan::Instruction::NO_REDUCE;
  std::string tiedWeight;
  std::vector<int> ranks;
  int64_t bytes = 0;
  std::string group; ///< its name for people ("dp", "tied:W")
};

/// Every rank's stream. The tensors are not owned: they point into the
/// programs or lowering inputs the streams were made from.
struct Streams {
  std::vector<std::vector<StreamOp>> ranks;
  std::vector<const plan::TensorRef *> tensors;
  std::vector<StreamCollective> collectives;
  int mailboxes = 0;
};

/// \p programs in array form; points into them.
Streams streamsOf(llvm::ArrayRef<const plan::RankProgram *> programs);

/// What the streams cost; every function may return 0 (the verifier runs
/// the streams with no costs at all).
struct StreamCosts {
  /// Seconds of a compute, RECOMPUTE or OPTIMIZER_STEP instruction on a rank.
  std::function<double(int rank, const StreamOp &)> compute;
  /// Seconds to move \p bytes from one rank to another.
  std::function<double(int from, int to, int64_t bytes)> transfer;
  /// Seconds of an ALLREDUCE on a rank.
  std::function<double(int rank, const StreamCollective &)> allReduce;
};

/// What the simulator charges a step, from numbers a plan holds: per global
/// stage its F, I and W seconds (B = I + W, RECOMPUTE = F), per rank its
/// weight and state bytes (the optimizer reads and writes them once) and
/// hardware (its links; the last one serves the ranks beyond), and the
/// data-parallel degree of the dp all-reduce's ring.
struct StepCosts {
  std::vector<std::array<double, 3>> stageTimes;
  /// Per stage, a RECOMPUTE's seconds (the forward of the layers that
  /// recompute); empty: the stage's whole forward.
  std::vector<double> recomputeTimes;
  std::vector<int64_t> weightBytes;
  llvm::ArrayRef<plan::HardwareInfo> hardware; ///< not owned
  int dataParallel = 1;
};

/// The costs simulatePlan charges; \p costs must outlive them.
StreamCosts streamCosts(const StepCosts &costs);

/// Where the streams stopped when they deadlock: per rank, the instruction
/// it waits in (-1 when it finished).
struct Deadlock {
  std::vector<int> waitingAt;
};

/// Runs the streams: the one timing engine, behind simulatePlan, the step
/// balance-stages and --schedule auto judge candidates by, and
/// verify-program's deadlock check. Semantics, those of NCCL point-to-point
/// with an asynchronous communication stream per direction:
///  - SEND and RECV are posted when a rank reaches them and never block it;
///  - between two ranks, the k-th SEND one way matches the k-th RECV there
///    (NCCL matches by order, not by tag): a pair that disagrees on stage,
///    microbatch, tensor, shape or dtype is an error;
///  - a compute waits until every RECV posted before it has matched and its
///    data has arrived; a rank's step ends when its sends have finished;
///  - a collective (ALLREDUCE, REDUCE_SCATTER, ALL_GATHER) completes when
///    every rank of its group reached it.
/// A state where no rank can move is a deadlock: the error says who waits
/// for what and \p deadlock (when given) receives the blocked positions.
/// The timeline's events are recorded when \p events is set. With
/// \p trusted, a matched pair's stage, microbatch, tensor and shape are not
/// compared: for streams lower-schedule just made, whose written plan
/// verify-program checks.
llvm::Expected<SimulationResult> runStreams(const Streams &streams, const StreamCosts &costs,
                                            Deadlock *deadlock = nullptr, bool events = false,
                                            bool trusted = false);

/// Simulates \p plan's programs with the plan's stage times and links.
llvm::Expected<SimulationResult> simulatePlan(const plan::Plan &plan);
/// simulatePlan, written into \p plan: `simulated`, each rank's busy, idle
/// and peak memory, and the predicted step and bubble.
llvm::Error simulateIntoPlan(plan::Plan &plan);

// The parts of streamCosts.

/// Moving \p bytes from rank \p from to rank \p to over the link of the
/// sender's hardware \p hw (within a node or between nodes): latency plus
/// bytes / bandwidth; 0 for no bytes or no bandwidth.
double transferSeconds(const plan::HardwareInfo &hw, int from, int to, int64_t bytes);
/// A ring all-reduce of \p bytes among \p n ranks: 2 (n - 1) steps of
/// bytes / n, each taking \p step(bytes / n).
double ringAllReduceSeconds(int n, int64_t bytes, const std::function<double(int64_t)> &step);
/// One step of a data-parallel ring, whose replicas sit on other nodes.
double interNodeStepSeconds(const plan::HardwareInfo &hw, int64_t bytes);
/// The optimizer: every byte of weights, gradients and state is read and
/// written once.
double optimizerSeconds(const plan::HardwareInfo &hw, int64_t weightBytes);

/// \p result's events as a Chrome / Perfetto trace (support/ChromeTrace.h):
/// the two threads of each rank that has events, then the events.
void writeChromeTrace(const SimulationResult &result, llvm::raw_ostream &os);

/// Reads a trace in that format, as `pipec run --trace` writes one, and
/// keeps its last step: the events after the last optimizer step but one
/// (all of them for an inference run), shifted to start at 0, with each
/// rank's compute time. Errors name the file.
llvm::Expected<SimulationResult> readMeasuredTrace(llvm::StringRef path, int ranks);

/// A rank x time grid for terminals: each column is step / width seconds;
/// a cell shows what runs there: the forward of microbatch N as the digit
/// N mod 10, a backward (B or I) as a lower-case letter (a = microbatch 0),
/// a weight gradient (W) as an upper-case one, '*' a recompute, '#' the
/// optimizer step, '.' idle.
std::string formatTimeline(const SimulationResult &result, int ranks, int width);
/// What formatTimeline's characters mean, one line.
const char *timelineLegend();

} // namespace pipec

#endif // PIPEC_COMPILER_SIM_SIMULATOR_H
