//===- LowerSchedule.cpp - lower-schedule and verify-program --------------===//
#include "passes/LowerSchedule.h"
#include "compiler/sim/Simulator.h"
#include "passes/GenerationStreams.h"
#include "plan/PlanFile.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>
#include <set>
#include <tuple>

using namespace llvm;

namespace pipec {

using Op = plan::Instruction;

namespace {

/// Per rank: the working bytes of the chunks whose forward it runs, summed.
std::vector<int64_t> workingPerRank(const Streams &streams, const LoweringInputs &in) {
  std::vector<int64_t> out(streams.ranks.size(), 0);
  for (size_t r = 0; r < streams.ranks.size(); ++r) {
    std::set<int> chunks;
    for (const StreamOp &op : streams.ranks[r])
      if (op.op == Op::FORWARD)
        chunks.insert(op.stage);
    for (int k : chunks)
      if (k < static_cast<int>(in.workingBytes.size()))
        out[r] += in.workingBytes[k];
  }
  return out;
}

bool isCompute(const plan::Instruction &i) {
  return i.op() == Op::FORWARD || i.op() == Op::BACKWARD || i.op() == Op::BACKWARD_INPUT ||
         i.op() == Op::BACKWARD_WEIGHT;
}

} // namespace

std::string formatInstruction(const plan::Instruction &i) {
  if (isCollective(i.op()))
    return formatv("{0} {1} {2} bytes", plan::Instruction::Op_Name(i.op()), i.group(), i.bytes())
        .str();
  switch (i.op()) {
  case Op::LOAD:
    return formatv("LOAD {0} s{1} mb{2}", i.group(), i.stage(), i.microbatch()).str();
  case Op::FORWARD:
    return formatv("FORWARD s{0} mb{1} buf{2}", i.stage(), i.microbatch(), i.buffer()).str();
  case Op::RECOMPUTE:
    return formatv("RECOMPUTE s{0} mb{1} buf{2}", i.stage(), i.microbatch(), i.buffer()).str();
  case Op::BACKWARD_INPUT:
    return formatv("BACKWARD_INPUT s{0} mb{1}", i.stage(), i.microbatch()).str();
  case Op::BACKWARD_WEIGHT:
    return formatv("BACKWARD_WEIGHT s{0} mb{1}", i.stage(), i.microbatch()).str();
  case Op::BACKWARD:
    return formatv("BACKWARD s{0} mb{1}", i.stage(), i.microbatch()).str();
  case Op::SEND:
  case Op::RECV:
    return formatv("{0} {1} s{2} mb{3} {4} {5} {6}", i.op() == Op::SEND ? "SEND" : "RECV",
                   i.grad() ? "grad" : "act", i.stage(), i.microbatch(),
                   i.op() == Op::SEND ? "->" : "<-", i.peer(), i.tensor().name())
        .str();
  case Op::OPTIMIZER_STEP:
    return "OPTIMIZER_STEP";
  case Op::FREE:
    return formatv("FREE buf{0}", i.buffer()).str();
  case Op::SCHEDULE:
  case Op::PICK:
    return formatv("{0} s{1} mb{2}", plan::Instruction::Op_Name(i.op()), i.stage(), i.microbatch())
        .str();
  default:
    return "?";
  }
}

namespace {

Error loweringError(const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "lower-schedule: %s", why.str().c_str());
}

/// One rank's actions, each with the instructions around it, before
/// flattening: per block (action) b, recvs[recvAt[b] .. recvAt[b + 1]] are
/// the receives it needs, and so on.
struct RankBlocks {
  std::vector<StreamOp> recvs; ///< needed by the action
  std::vector<StreamOp> body;  ///< LOAD, RECOMPUTE, the compute, FREE
  std::vector<StreamOp> sends; ///< what the action produced (and inference's FREE)
  std::vector<StreamOp> early; ///< RECVs posted here for later actions
  std::vector<int> recvAt{0}, bodyAt{0}, sendAt{0}, earlyAt;
  std::vector<BufferLife> buffers;
  std::string freeError; ///< the first FREE of activations it does not hold

  void clear() {
    for (auto *ops : {&recvs, &body, &sends, &early})
      ops->clear();
    for (auto *at : {&recvAt, &bodyAt, &sendAt})
      at->assign(1, 0);
    earlyAt.clear();
    buffers.clear();
    freeError.clear();
  }
};

/// Per (tensor, microbatch, grad), received by one rank: where it is needed.
struct Need {
  int rank = -1, block = -1, index = -1;
};

/// lower-schedule's working memory. A search lowers hundreds of candidates
/// of the same shape in a row, so each thread keeps the last lowering's
/// vectors and reuses their capacity.
struct LoweringMemory {
  std::vector<RankBlocks> blocks;
  std::vector<int> live;
  std::vector<Need> natural;
  std::vector<int> wanted, position, fill;
  std::vector<std::pair<int, const StreamOp *>> placed;
};

thread_local LoweringMemory loweringMemory;

/// lower-schedule in three phases: each action becomes a block, receives are
/// reordered to match their senders, and the blocks are flattened into a
/// stream per rank.
class Lowering {
public:
  Lowering(const Schedule &schedule, const LoweringInputs &in)
      : schedule(schedule), in(in), P(schedule.stages), V(schedule.virtualStages), K(P * V),
        M(schedule.microbatches), memory(loweringMemory), live(memory.live), blocks(memory.blocks) {
  }

  Expected<LoweredStreams> run();

private:
  int rankOf(int stage) const { return stageRank[stage]; }
  /// The mailbox of the tensors crossing \p boundary for microbatch \p mb.
  int mailboxOf(int boundary, int mb, bool grad) const { return (boundary * M + mb) * 2 + grad; }
  /// Appends to \p out an \p op per tensor crossing \p boundary (with \p grad,
  /// those that carry a gradient back).
  void transfer(std::vector<StreamOp> &out, Op::Op op, int mb, int peer, bool grad,
                int boundary) const;
  /// Action \p a of rank \p r with its receives, body and sends; its buffers
  /// are numbered in the order the rank allocates them.
  void addBlock(const Action &a, int r, RankBlocks &blocks);
  Error makeBlocks();
  Error orderReceives();
  /// Rank \p r's blocks as one stream, its buffers with their lifetimes, then
  /// the all-reduces and the optimizer step.
  Error flatten(int r);

  const Schedule &schedule;
  const LoweringInputs &in;
  int P, V, K, M;
  std::vector<int> stageRank;  ///< per global stage
  std::vector<int> tensorBase; ///< per boundary: its first tensor in out.streams.tensors
  LoweringMemory &memory;
  /// Per (stage, microbatch, rebuilt): the live buffer (stages are each on
  /// one rank).
  std::vector<int> &live;
  std::vector<RankBlocks> &blocks;
  LoweredStreams out;
};

StreamOp makeOp(Op::Op op, int stage, int mb) {
  StreamOp o;
  o.op = op;
  o.stage = stage;
  o.microbatch = mb;
  return o;
}

void Lowering::transfer(std::vector<StreamOp> &ops, Op::Op op, int mb, int peer, bool grad,
                        int boundary) const {
  for (size_t t = 0; t < in.sendTensors[boundary].size(); ++t) {
    if (grad && !in.hasGradient[boundary][t])
      continue;
    StreamOp o = makeOp(op, boundary, mb);
    o.peer = peer;
    o.grad = grad;
    o.tensor = tensorBase[boundary] + static_cast<int>(t);
    if (op == Op::RECV)
      o.mailbox = mailboxOf(boundary, mb, grad);
    ops.push_back(o);
  }
}

void Lowering::addBlock(const Action &a, int r, RankBlocks &b) {
  int s = a.stage, m = a.microbatch;
  auto allocate = [&](StreamOp &op, int64_t bytes, bool rebuilt) {
    op.buffer = static_cast<int>(b.buffers.size());
    b.buffers.push_back({s, m, bytes, -1, -1});
    live[(static_cast<size_t>(s) * M + m) * 2 + rebuilt] = op.buffer;
  };
  // A FREE of (s, m, rebuilt); a missing buffer is an error unless
  // \p optional (inference frees what a forward kept once it is sent).
  auto release = [&](std::vector<StreamOp> &ops, bool rebuilt, bool optional) {
    StreamOp op = makeOp(Op::FREE, s, m);
    int &held = live[(static_cast<size_t>(s) * M + m) * 2 + rebuilt];
    if (held >= 0)
      op.buffer = held, held = -1;
    else if (!optional && b.freeError.empty())
      b.freeError =
          formatv("rank {0} frees stage {1} microbatch {2}, which holds no activations", r, s, m)
              .str();
    ops.push_back(op);
  };
  switch (a.kind) {
  case ActionKind::F: {
    if (s == 0)
      b.body.push_back(makeOp(Op::LOAD, s, m));
    else if (rankOf(s - 1) != r)
      transfer(b.recvs, Op::RECV, m, rankOf(s - 1), false, s - 1);
    if (s == K - 1 && in.training) {
      b.body.push_back(makeOp(Op::LOAD, s, m));
      b.body.back().labels = true;
    }
    StreamOp forward = makeOp(Op::FORWARD, s, m);
    forward.mailbox = s > 0 ? mailboxOf(s - 1, m, false) : -1;
    allocate(forward,
             in.recomputes(s) ? in.inputBytes[s] + in.activationBytes[s] - in.rebuiltBytes[s]
                              : in.activationBytes[s],
             false);
    b.body.push_back(forward);
    if (s + 1 < K && rankOf(s + 1) != r)
      transfer(b.sends, Op::SEND, m, rankOf(s + 1), false, s);
    if (!in.training)
      release(b.sends, false, true); // kept only until sent
    break;
  }
  case ActionKind::B:
  case ActionKind::I: {
    if (s + 1 < K && rankOf(s + 1) != r)
      transfer(b.recvs, Op::RECV, m, rankOf(s + 1), true, s);
    if (in.recomputes(s)) {
      StreamOp rebuild = makeOp(Op::RECOMPUTE, s, m);
      allocate(rebuild, in.rebuiltBytes[s], true);
      b.body.push_back(rebuild);
    }
    StreamOp backward = makeOp(a.kind == ActionKind::B ? Op::BACKWARD : Op::BACKWARD_INPUT, s, m);
    backward.mailbox = s + 1 < K ? mailboxOf(s, m, true) : -1;
    b.body.push_back(backward);
    if (a.kind == ActionKind::B) {
      if (in.recomputes(s))
        release(b.body, true, false);
      release(b.body, false, false);
    }
    if (s > 0 && rankOf(s - 1) != r)
      transfer(b.sends, Op::SEND, m, rankOf(s - 1), true, s - 1);
    break;
  }
  case ActionKind::W:
    b.body.push_back(makeOp(Op::BACKWARD_WEIGHT, s, m));
    if (in.recomputes(s))
      release(b.body, true, false);
    release(b.body, false, false);
    break;
  }
  b.recvAt.push_back(static_cast<int>(b.recvs.size()));
  b.bodyAt.push_back(static_cast<int>(b.body.size()));
  b.sendAt.push_back(static_cast<int>(b.sends.size()));
}

/// Phase 1: each action with its receives, body and sends.
Error Lowering::makeBlocks() {
  live.assign(static_cast<size_t>(K) * M * 2, -1);
  if (static_cast<int>(blocks.size()) < P)
    blocks.resize(P);
  for (int r = 0; r < P; ++r)
    blocks[r].clear();
  for (int r = 0; r < P; ++r)
    for (const Action &a : schedule.ranks[r]) {
      if (a.stage < 0 || a.stage >= K || a.microbatch < 0 || a.microbatch >= M)
        return loweringError(formatv("rank {0} was given action {1}", r, formatAction(a)));
      if (rankOf(a.stage) != r)
        return loweringError(formatv("rank {0} was given action {1} of stage {2}, which runs "
                                     "on rank {3}",
                                     r, formatAction(a), a.stage, rankOf(a.stage)));
      addBlock(a, r, blocks[r]);
    }
  return Error::success();
}

/// Phase 2: NCCL matches point-to-point operations between two ranks in
/// order, so each rank posts its receives from a peer in the order that peer
/// sends: a receive moves earlier (never later) than the action that needs
/// it when the sender's order asks for it.
Error Lowering::orderReceives() {
  std::vector<Need> &natural = memory.natural;
  natural.assign(out.streams.tensors.size() * M * 2, Need());
  auto keyOf = [&](const StreamOp &op) {
    return (static_cast<size_t>(op.tensor) * M + op.microbatch) * 2 + op.grad;
  };
  std::vector<int> &wanted = memory.wanted, &position = memory.position, &fill = memory.fill;
  wanted.resize(P);
  auto &placed = memory.placed; // (block, receive)
  for (int dst = 0; dst < P; ++dst) {
    RankBlocks &d = blocks[dst];
    int count = static_cast<int>(d.recvAt.size()) - 1;
    std::fill(wanted.begin(), wanted.end(), 0);
    for (int b = 0; b < count; ++b)
      for (int i = d.recvAt[b]; i < d.recvAt[b + 1]; ++i) {
        natural[keyOf(d.recvs[i])] = {dst, b, i};
        ++wanted[d.recvs[i].peer];
      }
    placed.clear();
    for (int src = 0; src < P; ++src) {
      if (wanted[src] == 0)
        continue;
      int sent = 0;
      for (const StreamOp &send : blocks[src].sends)
        sent += send.op == Op::SEND && send.peer == dst;
      if (sent != wanted[src])
        return loweringError(formatv("rank {0} sends {1} tensors to rank {2}, which receives {3}",
                                     src, sent, dst, wanted[src]));
      // The sender's order, latest first: each receive is posted no later
      // than any receive the sender sends after it.
      position.assign(sent, 0);
      int next = count, k = sent;
      const std::vector<StreamOp> &sends = blocks[src].sends;
      for (auto it = sends.rbegin(); it != sends.rend(); ++it) {
        if (it->op != Op::SEND || it->peer != dst)
          continue;
        const Need &need = natural[keyOf(*it)];
        if (need.rank != dst)
          return loweringError(
              formatv("rank {0} never receives a tensor rank {1} sends", dst, src));
        next = std::min(next, need.block);
        position[--k] = next;
      }
      for (const StreamOp &send : sends)
        if (send.op == Op::SEND && send.peer == dst) {
          const Need &need = natural[keyOf(send)];
          placed.emplace_back(position[k++], &d.recvs[need.index]);
        }
    }
    // Each block's early receives, in the order placed (by sender, then in
    // the sender's order).
    d.earlyAt.assign(count + 1, 0);
    for (auto &[b, recv] : placed)
      ++d.earlyAt[b + 1];
    for (int b = 0; b < count; ++b)
      d.earlyAt[b + 1] += d.earlyAt[b];
    d.early.resize(placed.size());
    fill.assign(d.earlyAt.begin(), d.earlyAt.end() - 1);
    for (auto &[b, recv] : placed)
      d.early[fill[b]++] = *recv;
  }
  return Error::success();
}

Error Lowering::flatten(int r) {
  RankBlocks &b = blocks[r];
  if (!b.freeError.empty())
    return loweringError(b.freeError);
  std::vector<StreamOp> &ops = out.streams.ranks[r];
  ops.reserve(b.early.size() + b.body.size() + b.sends.size() + in.collectives.size() + 1);
  auto append = [&](const StreamOp &op) {
    int at = static_cast<int>(ops.size());
    ops.push_back(op);
    if (op.op == Op::FORWARD || op.op == Op::RECOMPUTE)
      b.buffers[op.buffer].allocAt = at;
    else if (op.op == Op::FREE && op.buffer >= 0)
      b.buffers[op.buffer].freeAt = at;
  };
  int count = static_cast<int>(b.bodyAt.size()) - 1;
  for (int a = 0; a < count; ++a) {
    for (int i = b.earlyAt[a]; i < b.earlyAt[a + 1]; ++i)
      append(b.early[i]);
    for (int i = b.bodyAt[a]; i < b.bodyAt[a + 1]; ++i)
      append(b.body[i]);
    for (int i = b.sendAt[a]; i < b.sendAt[a + 1]; ++i)
      append(b.sends[i]);
  }
  if (in.training) {
    // The sums before the update, the gathers of its shards after it.
    auto collectives = [&](bool afterUpdate) {
      for (size_t g = 0; g < in.collectives.size(); ++g) {
        const auto &c = in.collectives[g];
        if ((c.op == Op::ALL_GATHER) != afterUpdate ||
            std::find(c.ranks.begin(), c.ranks.end(), r) == c.ranks.end())
          continue;
        StreamOp op = makeOp(c.op, -1, -1);
        op.collective = static_cast<int>(g);
        append(op);
      }
    };
    collectives(false);
    append(makeOp(Op::OPTIMIZER_STEP, -1, -1));
    collectives(true);
  }
  for (const BufferLife &buffer : b.buffers)
    if (buffer.freeAt < 0)
      return loweringError(formatv("rank {0} never frees the activations of stage {1} "
                                   "microbatch {2} (no backward in its schedule)",
                                   r, buffer.stage, buffer.microbatch));
  out.buffers[r] = b.buffers;
  return Error::success();
}

Expected<LoweredStreams> Lowering::run() {
  if (static_cast<int>(in.sendTensors.size()) != K ||
      static_cast<int>(in.hasGradient.size()) != K ||
      static_cast<int>(in.activationBytes.size()) != K ||
      static_cast<int>(in.inputBytes.size()) != K)
    return loweringError(
        formatv("boundary tensors and activation sizes for {0} stages are needed", K));
  if (!in.recompute.empty() &&
      (static_cast<int>(in.recompute.size()) != K || static_cast<int>(in.rebuiltBytes.size()) != K))
    return loweringError(
        formatv("recompute choices and rebuilt bytes for {0} stages are needed", K));
  for (int k = 0; k < K; ++k) {
    stageRank.push_back(rankOfChunk(schedule.kind, P, V, k));
    tensorBase.push_back(static_cast<int>(out.streams.tensors.size()));
    for (const plan::TensorRef &t : in.sendTensors[k])
      out.streams.tensors.push_back(&t);
  }
  out.streams.mailboxes = K * M * 2;
  for (const auto &ar : in.collectives) {
    StreamCollective c;
    c.op = ar.op;
    c.reduce = ar.reduce;
    c.tiedWeight = ar.tiedWeight;
    c.ranks = ar.ranks;
    c.bytes = ar.bytes;
    c.group = allReduceGroupName(ar.reduce, ar.tiedWeight);
    out.streams.collectives.push_back(std::move(c));
  }
  out.hasGradient = in.hasGradient;
  out.training = in.training;
  out.recompute.resize(K);
  for (int k = 0; k < K; ++k)
    out.recompute[k] = in.recomputes(k);
  for (const auto &ar : in.collectives)
    out.groups.emplace_back(ar.op, ar.reduce, ar.tiedWeight, ar.ranks);
  if (Error err = makeBlocks())
    return err;
  if (Error err = orderReceives())
    return err;
  out.streams.ranks.resize(P);
  out.buffers.resize(P);
  for (int r = 0; r < P; ++r)
    if (Error err = flatten(r))
      return err;
  out.workingBytes = workingPerRank(out.streams, in);
  return std::move(out);
}

} // namespace

Expected<LoweredStreams> lowerStreams(const Schedule &schedule, const LoweringInputs &in) {
  return Lowering(schedule, in).run();
}

bool resizeLowered(LoweredStreams &lowered, const LoweringInputs &in) {
  size_t chunks = lowered.hasGradient.size();
  if (in.hasGradient != lowered.hasGradient || in.training != lowered.training ||
      in.sendTensors.size() != chunks || in.activationBytes.size() != chunks ||
      in.inputBytes.size() != chunks || in.collectives.size() != lowered.groups.size())
    return false;
  for (size_t k = 0; k < chunks; ++k)
    if (in.sendTensors[k].size() != in.hasGradient[k].size() ||
        in.recomputes(static_cast<int>(k)) != lowered.recompute[k])
      return false;
  for (size_t g = 0; g < in.collectives.size(); ++g) {
    const auto &ar = in.collectives[g];
    if (lowered.groups[g] != std::make_tuple(ar.op, ar.reduce, ar.tiedWeight, ar.ranks))
      return false;
  }
  Streams &streams = lowered.streams;
  lowered.workingBytes = workingPerRank(streams, in);
  streams.tensors.clear();
  for (const auto &tensors : in.sendTensors)
    for (const plan::TensorRef &t : tensors)
      streams.tensors.push_back(&t);
  for (size_t g = 0; g < in.collectives.size(); ++g)
    streams.collectives[g].bytes = in.collectives[g].bytes;
  for (size_t r = 0; r < lowered.buffers.size(); ++r)
    for (BufferLife &b : lowered.buffers[r]) {
      bool rebuilt = streams.ranks[r][b.allocAt].op == Op::RECOMPUTE;
      b.bytes = rebuilt                  ? in.rebuiltBytes[b.stage]
                : in.recomputes(b.stage) ? in.inputBytes[b.stage] + in.activationBytes[b.stage] -
                                               in.rebuiltBytes[b.stage]
                                         : in.activationBytes[b.stage];
    }
  return true;
}

void addEvaluationStream(plan::RankProgram &program) {
  std::set<int> rebuilt; // the buffers RECOMPUTE fills, which evaluation never makes
  for (const plan::Instruction &i : program.instructions())
    if (i.op() == Op::RECOMPUTE)
      rebuilt.insert(i.buffer());
  program.clear_evaluation();
  for (const plan::Instruction &i : program.instructions()) {
    bool keep = false;
    switch (i.op()) {
    case Op::LOAD:
    case Op::FORWARD:
      keep = true;
      break;
    case Op::SEND:
    case Op::RECV:
      keep = !i.grad();
      break;
    case Op::FREE:
      keep = !rebuilt.count(i.buffer());
      break;
    default:
      break;
    }
    if (keep)
      *program.add_evaluation() = i;
  }
}

std::vector<plan::RankProgram> toRankPrograms(const LoweredStreams &lowered,
                                              const Schedule &schedule) {
  const Streams &streams = lowered.streams;
  std::vector<plan::RankProgram> programs(streams.ranks.size());
  for (size_t r = 0; r < streams.ranks.size(); ++r) {
    plan::RankProgram &prog = programs[r];
    prog.set_rank(static_cast<int>(r));
    prog.set_working_bytes(r < lowered.workingBytes.size() ? lowered.workingBytes[r] : 0);
    for (const Action &a : schedule.ranks[r])
      prog.add_actions(formatAction(a));
    prog.mutable_instructions()->Reserve(static_cast<int>(streams.ranks[r].size()));
    for (const StreamOp &op : streams.ranks[r]) {
      plan::Instruction &i = *prog.add_instructions();
      i.set_op(op.op);
      i.set_stage(op.stage);
      i.set_microbatch(op.microbatch);
      switch (op.op) {
      case Op::SEND:
      case Op::RECV:
        i.set_peer(op.peer);
        i.set_grad(op.grad);
        *i.mutable_tensor() = *streams.tensors[op.tensor];
        break;
      case Op::LOAD:
        i.set_group(op.labels ? "labels" : "inputs");
        break;
      case Op::FORWARD:
      case Op::RECOMPUTE:
      case Op::FREE:
        if (op.buffer >= 0)
          i.set_buffer(op.buffer);
        break;
      default:
        break;
      }
      if (isCollective(op.op)) {
        const StreamCollective &c = streams.collectives[op.collective];
        i.set_group(c.group);
        i.set_reduce(c.reduce);
        i.set_tied_weight(c.tiedWeight);
        for (int rank : c.ranks)
          i.add_ranks(rank);
        i.set_bytes(c.bytes);
      }
    }
    if (lowered.training)
      addEvaluationStream(prog);
    const std::vector<BufferLife> &buffers = lowered.buffers[r];
    for (size_t b = 0; b < buffers.size(); ++b) {
      plan::Buffer *out = prog.add_buffers();
      out->set_index(static_cast<int>(b));
      out->set_stage(buffers[b].stage);
      out->set_microbatch(buffers[b].microbatch);
      out->set_bytes(buffers[b].bytes);
      out->set_alloc_at(buffers[b].allocAt);
      out->set_free_at(buffers[b].freeAt);
    }
  }
  return programs;
}

Expected<std::vector<plan::RankProgram>> lowerSchedule(const Schedule &schedule,
                                                       const LoweringInputs &in) {
  auto lowered = lowerStreams(schedule, in);
  if (!lowered)
    return lowered.takeError();
  return toRankPrograms(*lowered, schedule);
}

std::string formatGrid(const std::vector<plan::RankProgram> &programs,
                       const std::vector<int> &marked) {
  size_t width = 4;
  for (const auto &p : programs)
    for (const auto &a : p.actions())
      width = std::max(width, a.size() + 2);
  std::string out;
  for (size_t r = 0; r < programs.size(); ++r) {
    out += formatv("rank {0,2} |", r).str();
    for (int a = 0; a < programs[r].actions_size(); ++a) {
      std::string cell = programs[r].actions(a);
      if (r < marked.size() && marked[r] == a)
        cell = "[" + cell + "]";
      out += " " + std::string(width - cell.size(), ' ') + cell;
    }
    if (r < marked.size() && marked[r] == programs[r].actions_size())
      out += " [end]";
    out += "\n";
  }
  return out;
}

void printPrograms(const std::vector<plan::RankProgram> &programs, raw_ostream &os) {
  os << formatGrid(programs, {});
  for (const plan::RankProgram &p : programs) {
    os << formatv("rank {0}: {1} instructions, {2} buffers\n", p.rank(), p.instructions_size(),
                  p.buffers_size());
    for (int i = 0; i < p.instructions_size(); ++i)
      os << formatv("  {0,4}  {1}\n", i, formatInstruction(p.instructions(i)));
  }
}

namespace {
/// verify-program over one stream per rank.
Error verifyStreams(const std::vector<plan::RankProgram> &programs, int stages, int microbatches,
                    ScheduleKind kind, int virtualStages);
} // namespace

Error verifyProgram(const std::vector<plan::RankProgram> &programs, int stages, int microbatches,
                    ScheduleKind kind, int virtualStages) {
  if (Error err = verifyStreams(programs, stages, microbatches, kind, virtualStages))
    return err;
  if (std::any_of(programs.begin(), programs.end(),
                  [](const plan::RankProgram &p) { return p.has_generation(); }))
    if (Error err = verifyGenerationStreams(programs, programs, microbatches, kind))
      return err;
  // A train plan's evaluation streams, proved as its steps are.
  if (std::none_of(programs.begin(), programs.end(),
                   [](const plan::RankProgram &p) { return p.evaluation_size() > 0; }))
    return Error::success();
  std::vector<plan::RankProgram> evaluation(programs.size());
  for (size_t r = 0; r < programs.size(); ++r) {
    evaluation[r].set_rank(programs[r].rank());
    *evaluation[r].mutable_instructions() = programs[r].evaluation();
  }
  if (Error err = verifyStreams(evaluation, stages, microbatches, kind, virtualStages))
    return createStringError(inconvertibleErrorCode(), "%s (the evaluation streams)",
                             toString(std::move(err)).c_str());
  return Error::success();
}

Error verifyGenerationStreams(const std::vector<plan::RankProgram> &starts,
                              const std::vector<plan::RankProgram> &programs, int groups,
                              ScheduleKind kind) {
  int ranks = static_cast<int>(programs.size());
  if (static_cast<int>(starts.size()) != ranks)
    return createStringError(inconvertibleErrorCode(),
                             "verify-program: %d generation starts for %d ranks",
                             int(starts.size()), ranks);
  // Unrolled: round k's pass of group g is microbatch k * groups + g, and
  // the picks it sends are those the first rank's next round receives.
  std::vector<plan::RankProgram> unrolled(ranks);
  for (int r = 0; r < ranks; ++r) {
    const plan::GenerationStreams &own = programs[r].generation();
    const google::protobuf::RepeatedPtrField<plan::Instruction> *rounds[4] = {
        &starts[r].generation().start(), &own.round(), &own.round(), &own.stop()};
    unrolled[r].set_rank(r);
    for (int k = 0; k < 4; ++k)
      for (const plan::Instruction &i : *rounds[k]) {
        plan::Instruction &copy = *unrolled[r].add_instructions() = i;
        bool picks = i.op() == Op::SEND && i.tensor().name() == generationPicks;
        copy.set_microbatch((k + (picks ? 1 : 0)) * groups + i.microbatch());
      }
  }
  if (Error err = verifyStreams(unrolled, ranks, 3 * groups, kind, 1))
    return createStringError(inconvertibleErrorCode(), "%s (the generation streams)",
                             toString(std::move(err)).c_str());
  return Error::success();
}

namespace {
Error verifyStreams(const std::vector<plan::RankProgram> &programs, int stages, int microbatches,
                    ScheduleKind kind, int virtualStages) {
  int ranks = static_cast<int>(programs.size()), chunks = stages * virtualStages;
  auto fail = [&](const Twine &why, const std::vector<int> &marked = {}) {
    std::string text = "verify-program: " + why.str();
    if (!marked.empty())
      text += "\n" + formatGrid(programs, marked);
    return createStringError(inconvertibleErrorCode(), "%s", text.c_str());
  };
  using Key = std::tuple<int, int, int, int, bool, std::string>; // from,to,stage,mb,grad,tensor
  std::map<Key, std::pair<int, int>> sends, recvs;               // -> (rank, instruction)
  for (int r = 0; r < ranks; ++r) {
    const auto &prog = programs[r];
    std::set<std::pair<int, int>> forwarded, inputGrad, weightGrad;
    for (int i = 0; i < prog.instructions_size(); ++i) {
      const plan::Instruction &ins = prog.instructions(i);
      std::pair<int, int> sm{ins.stage(), ins.microbatch()};
      switch (ins.op()) {
      case Op::SEND:
      case Op::RECV: {
        if (ins.peer() < 0 || ins.peer() >= ranks || ins.peer() == r)
          return fail(formatv("rank {0} step {1}: {2} names peer {3}", r, i, formatInstruction(ins),
                              ins.peer()));
        bool send = ins.op() == Op::SEND;
        Key key{
            send ? r : ins.peer(), send ? ins.peer() : r, ins.stage(), ins.microbatch(), ins.grad(),
            ins.tensor().name()};
        auto &table = send ? sends : recvs;
        if (!table.emplace(key, std::make_pair(r, i)).second)
          return fail(
              formatv("rank {0} step {1}: {2} is posted twice", r, i, formatInstruction(ins)));
        break;
      }
      case Op::FORWARD:
        if (rankOfChunk(kind, stages, virtualStages, ins.stage()) != r)
          return fail(formatv("rank {0} step {1}: stage {2} runs on rank {3}", r, i, ins.stage(),
                              rankOfChunk(kind, stages, virtualStages, ins.stage())));
        // A stage before this one on the same rank hands over locally.
        if (ins.stage() > 0 && rankOfChunk(kind, stages, virtualStages, ins.stage() - 1) == r &&
            !forwarded.count({ins.stage() - 1, ins.microbatch()}))
          return fail(formatv("rank {0} step {1}: {2} runs before the forward of stage {3}", r, i,
                              formatInstruction(ins), ins.stage() - 1));
        if (!forwarded.insert(sm).second)
          return fail(formatv("rank {0} step {1}: {2} runs twice", r, i, formatInstruction(ins)));
        break;
      case Op::BACKWARD:
      case Op::BACKWARD_INPUT:
        if (!forwarded.count(sm))
          return fail(formatv("rank {0} step {1}: {2} runs before its forward", r, i,
                              formatInstruction(ins)));
        if (ins.stage() + 1 < chunks &&
            rankOfChunk(kind, stages, virtualStages, ins.stage() + 1) == r &&
            !inputGrad.count({ins.stage() + 1, ins.microbatch()}))
          return fail(formatv("rank {0} step {1}: {2} runs before the backward of stage {3}", r, i,
                              formatInstruction(ins), ins.stage() + 1));
        if (!inputGrad.insert(sm).second)
          return fail(formatv("rank {0} step {1}: {2} runs twice", r, i, formatInstruction(ins)));
        if (ins.op() == Op::BACKWARD)
          weightGrad.insert(sm);
        break;
      case Op::BACKWARD_WEIGHT:
        if (!inputGrad.count(sm))
          return fail(formatv("rank {0} step {1}: {2} runs before its input gradient", r, i,
                              formatInstruction(ins)));
        if (!weightGrad.insert(sm).second)
          return fail(formatv("rank {0} step {1}: {2} runs twice", r, i, formatInstruction(ins)));
        break;
      default:
        break;
      }
    }
    // Every microbatch runs forward on every stage of the rank, and a
    // training step has each one's weight gradient before the optimizer.
    for (int stage = 0; stage < chunks; ++stage) {
      if (rankOfChunk(kind, stages, virtualStages, stage) != r)
        continue;
      for (int m = 0; m < microbatches; ++m)
        if (!forwarded.count({stage, m}))
          return fail(
              formatv("rank {0}: stage {1} never runs the forward of microbatch {2}", r, stage, m));
    }
    bool training =
        std::any_of(prog.instructions().begin(), prog.instructions().end(),
                    [](const plan::Instruction &x) { return x.op() == Op::OPTIMIZER_STEP; });
    for (auto &sm : forwarded)
      if (training && !weightGrad.count(sm))
        return fail(formatv("rank {0}: stage {1} microbatch {2} has no weight gradient before the "
                            "optimizer step",
                            r, sm.first, sm.second));
  }
  for (auto &[key, where] : sends) {
    auto it = recvs.find(key);
    const plan::Instruction &s = programs[where.first].instructions(where.second);
    if (it == recvs.end())
      return fail(formatv("rank {0} step {1}: {2} has no matching RECV on rank {3}", where.first,
                          where.second, formatInstruction(s), s.peer()));
    const plan::Instruction &rcv = programs[it->second.first].instructions(it->second.second);
    if (rcv.tensor().dtype() != s.tensor().dtype() || rcv.tensor().bytes() != s.tensor().bytes() ||
        std::vector<int64_t>(rcv.tensor().shape().begin(), rcv.tensor().shape().end()) !=
            std::vector<int64_t>(s.tensor().shape().begin(), s.tensor().shape().end()))
      return fail(formatv("rank {0} step {1}: {2} sends {3} bytes of {4}, rank {5} step {6} "
                          "receives {7} bytes of {8}",
                          where.first, where.second, formatInstruction(s), s.tensor().bytes(),
                          s.tensor().dtype(), it->second.first, it->second.second,
                          rcv.tensor().bytes(), rcv.tensor().dtype()));
  }
  for (auto &[key, where] : recvs)
    if (!sends.count(key))
      return fail(formatv("rank {0} step {1}: {2} has no matching SEND on rank {3}", where.first,
                          where.second,
                          formatInstruction(programs[where.first].instructions(where.second)),
                          programs[where.first].instructions(where.second).peer()));

  // Run all ranks under blocking, NCCL-like semantics (runStreams).
  Deadlock deadlock;
  std::vector<const plan::RankProgram *> streams;
  for (const auto &p : programs)
    streams.push_back(&p);
  auto run = runStreams(streamsOf(streams), StreamCosts(), &deadlock);
  if (run)
    return Error::success();
  std::vector<int> marked(ranks, -1);
  for (int r = 0; r < ranks; ++r) {
    if (deadlock.waitingAt.size() <= static_cast<size_t>(r) || deadlock.waitingAt[r] < 0)
      continue;
    // A RECV belongs to the action after it, a SEND to the one before.
    int at = deadlock.waitingAt[r], actions = 0;
    for (int i = 0; i < at; ++i)
      actions += isCompute(programs[r].instructions(i)) ? 1 : 0;
    if (at < programs[r].instructions_size() && programs[r].instructions(at).op() == Op::SEND &&
        actions > 0)
      --actions;
    marked[r] = actions;
  }
  return fail(toString(run.takeError()), marked);
}
} // namespace

} // namespace pipec
