//===- Generate.h - `pipec generate`: the token loop of a decoder plan ---===//
//
// A plan compiled with --mode generate runs one decode step of a decoder LM
// per stage program: a token per row, the row's KV cache as the model's
// past (max_length - 1 positions, plan.generation). The loop:
//
//  - the rows (slots) are split into M groups that flow through the stages
//    as microbatches do: while the last stage picks group g's next tokens,
//    the first stage already runs group g + 1, so once the pipe is full no
//    stage waits;
//  - each rank owns the cache of its stages' layers, one per group,
//    allocated once and written in place: after a step, the present's new
//    position (its last) is copied into the cache at the row's position.
//    Only the hidden state crosses stages, and the chosen tokens go from
//    the last rank back to the first;
//  - the attention mask holds 1 at the row's written positions and at the
//    new one (the present's last), 0 elsewhere; position ids are the row's
//    position;
//  - ranks of one machine share its cores among the groups in flight, since
//    a rank computes only on a group that has reached it: with one group the
//    stages take turns, each on all the cores;
//  - a group's first prompts go through in one prefill pass when the plan
//    has one of their length, else a prompt is fed one token per decode
//    step; from its last token on, the last stage picks a token per row:
//    the arg-max (greedy, the first of equal ones as torch's), or a draw
//    after temperature, top-k and top-p (in transformers' order) from a
//    generator seeded by (seed, prompt, position), so the same on any stage
//    or group count;
//  - a row that picks the EOS id, or has its new tokens, is finished (the
//    rest of its tokens are the EOS id): its slot takes the next waiting
//    prompt, whose tokens then go one per step while the group's other rows
//    decode (each row has its own position, mask and cache positions). The
//    first rank schedules and sends each pass's rows and positions down the
//    stages with the hidden state; a group with no prompt left stops.
//
// Each rank runs the loop from its streams in the plan (plan.proto's
// GenerationStreams, made by passes/GenerationStreams.h and proved by
// verify-program): its start, then its round until every group stopped.
// RankExecutor::generate runs them instruction by instruction, as it runs
// a training step's.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_GENERATE_H
#define PIPEC_RUNTIME_EXEC_GENERATE_H

#include "runtime/exec/Executor.h"

#include <optional>

namespace pipec::rt {

struct GenerateOptions {
  /// The model path, backend, threads per rank, timeout and fusion.
  RunOptions run;
  int64_t maxNewTokens = 16;
  /// Greedy, or sampling with these.
  bool greedy = true;
  double temperature = 1;
  int64_t topK = 0; ///< 0: every token
  double topP = 1;  ///< 1: every token
  uint64_t seed = 0;
  std::optional<int64_t> eos;
  /// Write the measured timeline here (Chrome trace, as `run --trace`):
  /// each rank's passes (F), and its waits for the hidden state, the
  /// control or the picks (C).
  std::string tracePath;
};

struct GenerateResult {
  /// int64 [prompts, maxNewTokens].
  cpu::Tensor tokens;
  /// The loop's wall time; from its start to the first row's first token;
  /// the mean time between a group's consecutive tokens.
  double seconds = 0, firstTokenSeconds = 0, perTokenSeconds = 0;
  /// Tokens picked (rows of the prompts times new tokens).
  int64_t generated = 0;
  std::string blas;
  int threadsPerRank = 1;
  /// Whether this process reports (local, or MPI rank 0).
  bool primary = true;
};

/// Checks \p prompts (int64 [N, S], ids below the vocabulary, S plus the
/// new tokens within max_length) and \p options against \p plan: one line
/// naming the flag or file at fault.
llvm::Error checkGenerate(const plan::Plan &plan, const GenerateOptions &options,
                          const cpu::Tensor &prompts);

/// Generates after each of \p prompts with every rank of \p plan a thread of
/// this process.
llvm::Expected<GenerateResult> generateLocal(const plan::Plan &plan, const GenerateOptions &options,
                                             const cpu::Tensor &prompts);

/// Runs this process's rank of \p plan under MPI (mpirun -np P); rank 0's
/// result holds the tokens and times.
llvm::Expected<GenerateResult> generateMpi(const plan::Plan &plan, const GenerateOptions &options,
                                           const cpu::Tensor &prompts);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_GENERATE_H
