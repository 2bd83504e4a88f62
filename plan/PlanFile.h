//===- PlanFile.h - Read and write plan files ---------------------------===//
//
// A plan is written in protobuf's binary format by default, or as text or
// JSON through protobuf's own printers (`--emit text|json`). Reading detects
// the format from the first bytes and refuses a format_version it does not
// know. Writing the same Plan twice gives the same bytes (map fields are
// written in key order).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PLAN_PLANFILE_H
#define PIPEC_PLAN_PLANFILE_H

#include "plan/plan.pb.h"

#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>

namespace pipec {

/// The format_version this build writes and reads.
inline constexpr uint32_t PlanFormatVersion = 8;

enum class PlanEncoding { Binary, Text, Json };

llvm::Expected<PlanEncoding> parsePlanEncoding(llvm::StringRef name);

/// The XXH3-128 of \p plan's deterministic binary encoding without
/// content_xxh3 and training (the fields a user may edit): the plan's seal.
/// \p plan is left as it was.
std::string planContentHash(plan::Plan &plan);

/// Sets \p plan's content_xxh3 to planContentHash: what compile does last.
void sealPlan(plan::Plan &plan);

/// Serializes \p plan; deterministic for equal plans.
llvm::Expected<std::string> serializePlan(const plan::Plan &plan, PlanEncoding encoding);

/// The lowercase hex XXH3-128 of \p bytes (32 digits): how a plan names its
/// model file and external data. A fast check that the bytes are the ones
/// compiled (a 227 MB model in about 20 ms), not a defence against a crafted collision
/// (docs/TRUST_MODEL.md).
std::string contentHash(llvm::StringRef bytes);

/// The lowercase hex SHA-256 of \p bytes: a checkpoint's checksum.
std::string sha256Hex(llvm::StringRef bytes);

/// Where each rank of a run sits: replica d of dp, pipeline rank r of P
/// (whose RankProgram it runs), tensor-parallel rank t of T, at global rank
/// ((d x P) + r) x T + t, so that a tensor-parallel group is consecutive
/// ranks, inside a node.
struct RankGrid {
  int P = 1, dp = 1, T = 1;
  static RankGrid of(const plan::Plan &plan) {
    const plan::ScheduleInfo &s = plan.schedule();
    return {std::max(1, s.stages()), std::max(1, s.data_parallel()),
            std::max(1, s.tensor_parallel())};
  }
  int ranks() const { return P * dp * T; }
  int global(int replica, int pipelineRank, int tp) const {
    return (replica * P + pipelineRank) * T + tp;
  }
  int replicaOf(int global) const { return global / (T * P); }
  int pipelineRankOf(int global) const { return (global / T) % P; }
  int tpOf(int global) const { return global % T; }
};

/// The name people read for an all-reduce group: "dp" for the replicas,
/// "tied:W" for weight W's copies. Nothing decides by it (Instruction's
/// reduce and tied_weight are the facts).
std::string allReduceGroupName(plan::Instruction::Reduce reduce, llvm::StringRef tiedWeight);

/// The tensors a generate plan's token loop moves besides the stages' own
/// (plan.proto's GenerationStreams): the control (int64 [rows + 1, 2]: per
/// row its prompt, -1 for an idle slot, and its cache position, then the
/// pass's kind) and the picks (int64 [2, rows]: per row its token, then
/// whether it finished).
inline constexpr const char *generationControl = "pipec.control";
inline constexpr const char *generationPicks = "pipec.picks";

/// A row of plan/Collectives.def: a collective of a group of ranks, which
/// completes when the whole group reaches it.
struct CollectiveInfo {
  plan::Instruction::Op op;
  /// Its name in traces and timelines ("allreduce", "reduce-scatter").
  const char *name;
  /// Its ring's steps as a share of an all-reduce's.
  double ringShare;
  /// A training step runs it after OPTIMIZER_STEP (the updated weights),
  /// else before it (the gradients).
  bool afterUpdate;
};

/// The row of \p op, or null when \p op is no collective.
const CollectiveInfo *collectiveOf(plan::Instruction::Op op);

/// Whether \p op is a collective (ALLREDUCE, REDUCE_SCATTER, ALL_GATHER).
inline bool isCollective(plan::Instruction::Op op) { return collectiveOf(op) != nullptr; }

/// The name under which a chunk's backward reads the gradient of a tensor V
/// it sent on, as the next chunk returns it: "grad-next:V". The stage
/// programs' nodes read it (passes/StagePrograms.h); the executor binds the
/// received gradient to it.
std::string receivedGradName(llvm::StringRef value);
/// Whether \p name is a receivedGradName.
bool isReceivedGradName(llvm::StringRef name);

/// The output path that discards what is written to it.
inline constexpr llvm::StringLiteral nullOutput = "/dev/null";

/// Succeeds for an output path pipec may write: a regular file, a name that
/// does not exist yet, or nullOutput. A directory, device, pipe or socket is
/// "PATH: is a directory; ..." or "PATH: is not a regular file ...".
llvm::Error checkOutputPath(llvm::StringRef path);

/// Writes \p bytes to \p path through a fresh temporary file (created
/// exclusively beside it) and a rename, so that readers see the old file or
/// the new one, never a part; a failed write leaves no temporary behind.
/// \p path must pass checkOutputPath; nullOutput runs the writer and keeps
/// nothing.
llvm::Error writeFileAtomically(llvm::StringRef path, llvm::StringRef bytes);

/// The same with the bytes \p write puts into the temporary file's stream;
/// an error from \p write (prefixed with the path) leaves no file either.
llvm::Error writeFileAtomically(llvm::StringRef path,
                                llvm::function_ref<llvm::Error(llvm::raw_ostream &)> write);

/// Writes \p plan to \p path atomically (a temporary file renamed into
/// place). Errors name the path.
llvm::Error writePlan(const plan::Plan &plan, llvm::StringRef path, PlanEncoding encoding);

/// Reads a plan in any of the three encodings, then checks it (checkPlan)
/// and its seal (a content_xxh3 equal to planContentHash). Errors name the
/// path: not a plan, truncated, a format_version this build does not read,
/// what checkPlan refuses, or content edited after compile.
llvm::Expected<plan::Plan> readPlan(llvm::StringRef path);

/// What every reader may rely on without checking again (PlanCheck.cpp):
/// counts positive, bounded and agreeing with each other and the streams;
/// instruction stages, microbatches, peers and buffers in range; one
/// OPTIMIZER_STEP per training rank; shapes with dimensions >= 0 whose
/// bytes are plausible (at most 16 TiB each); trainable names that are weights; external-data
/// locations relative and inside the model's folder. The error names the
/// field, rank, instruction or tensor at fault.
llvm::Error checkPlan(const plan::Plan &plan);

/// Whether the CPU that runs \p plan holds each rank's activation slots and
/// each weight: "rank R's activation slot needs N bytes; this machine has M".
/// A run on the CPU asks before it allocates; readers that only report do not.
llvm::Error checkPlanFitsMachine(const plan::Plan &plan);

/// The model FLOPs of one step of \p plan: the stages' forward FLOPs per
/// microbatch, times the microbatches of every replica, times 3 in training
/// (forward, input and weight gradients). Recomputation is not counted, as
/// model FLOPs utilisation does not count it.
double modelFlopsPerStep(const plan::Plan &plan);
/// The same from its parts: one tensor-parallel rank's forward FLOPs per
/// microbatch, summed over the stages, and the shape of the step.
double modelFlopsPerStep(double forwardPerMicrobatch, int microbatches, int dataParallel,
                         int tensorParallel, bool training);

/// The peak FLOP/s of every rank of every replica of \p plan together, at
/// its precision: the hardware spec's, or on a CPU the calibrated one.
double peakFlopsOfRun(const plan::Plan &plan);

/// The tokens one sample holds: the sequence length of the token ids the
/// plan feeds (DataInput.stream TOKENS, [batch, S]); 0 when it feeds none.
int64_t tokensPerSample(const plan::Plan &plan);

/// The XXH3-128 over the external-data files \p plan's weights name, other
/// than the model file itself (model.xxh3 covers that): each distinct
/// location in name order, as "LOCATION\0" then the file's bytes; "" when
/// there are none. Each location must resolve, through symlinks, inside
/// \p modelDir; errors name the location.
llvm::Expected<std::string> externalDataHash(const plan::Plan &plan, llvm::StringRef modelDir);

} // namespace pipec

#endif // PIPEC_PLAN_PLANFILE_H
