//===- LowerSchedule.cpp - lower-schedule and verify-program --------------===//
#include "passes/LowerSchedule.h"
#include "compiler/sim/Simulator.h"
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

bool isCompute(const plan::Instruction &i) {
  return i.op() == Op::FORWARD || i.op() == Op::BACKWARD || i.op() == Op::BACKWARD_INPUT ||
         i.op() == Op::BACKWARD_WEIGHT;
}

} // namespace

std::string formatInstruction(const plan::Instruction &i) {
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
  case Op::ALLREDUCE:
    return formatv("ALLREDUCE {0} {1} bytes", i.group(), i.bytes()).str();
  case Op::OPTIMIZER_STEP:
    return "OPTIMIZER_STEP";
  case Op::FREE:
    return formatv("FREE buf{0}", i.buffer()).str();
  default:
    return "?";
  }
}

namespace {

/// One compute action and the instructions around it, before flattening.
struct Block {
  std::vector<plan::Instruction> recvs; ///< needed by this action
  std::vector<plan::Instruction> body;  ///< LOAD, RECOMPUTE, the compute, FREE
  std::vector<plan::Instruction> sends; ///< what the action produced
  std::vector<plan::Instruction> early; ///< RECVs posted here for later actions
};

using ChannelKey = std::tuple<int, int, bool, std::string>; // stage, microbatch, grad, tensor

ChannelKey keyOf(const plan::Instruction &i) {
  return {i.stage(), i.microbatch(), i.grad(), i.tensor().name()};
}

plan::Instruction makeInstruction(Op::Op op, int stage, int mb) {
  plan::Instruction i;
  i.set_op(op);
  i.set_stage(stage);
  i.set_microbatch(mb);
  return i;
}

Error loweringError(const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "lower-schedule: %s", why.str().c_str());
}

/// lower-schedule in three phases: each action becomes a Block, receives are
/// reordered to match their senders, and the blocks are flattened into a
/// program per rank.
class Lowering {
public:
  Lowering(const Schedule &schedule, const LoweringInputs &in)
      : schedule(schedule), in(in), P(schedule.stages), V(schedule.virtualStages), K(P * V) {}

  Expected<std::vector<plan::RankProgram>> run();

private:
  int rankOf(int stage) const { return rankOfChunk(schedule.kind, P, V, stage); }
  /// Appends to \p out an \p op per tensor crossing \p boundary (with \p grad,
  /// those that carry a gradient back).
  void transfer(std::vector<plan::Instruction> &out, Op::Op op, int stage, int mb, int peer,
                bool grad, int boundary) const;
  /// Action \p a of rank \p r with its receives, body and sends.
  Block blockOf(const Action &a, int r) const;
  Expected<std::vector<std::vector<Block>>> makeBlocks() const;
  Error orderReceives(std::vector<std::vector<Block>> &blocks) const;
  /// Moves the instructions out of \p blocks.
  Expected<plan::RankProgram> flatten(int r, std::vector<Block> &blocks) const;

  const Schedule &schedule;
  const LoweringInputs &in;
  int P, V, K;
};

void Lowering::transfer(std::vector<plan::Instruction> &out, Op::Op op, int stage, int mb, int peer,
                        bool grad, int boundary) const {
  for (size_t t = 0; t < in.sendTensors[boundary].size(); ++t) {
    if (grad && !in.hasGradient[boundary][t])
      continue;
    plan::Instruction i = makeInstruction(op, stage, mb);
    i.set_peer(peer);
    i.set_grad(grad);
    *i.mutable_tensor() = in.sendTensors[boundary][t];
    out.push_back(i);
  }
}

Block Lowering::blockOf(const Action &a, int r) const {
  int s = a.stage, m = a.microbatch;
  Block b;
  switch (a.kind) {
  case ActionKind::F: {
    if (s == 0)
      b.body.push_back(makeInstruction(Op::LOAD, s, m)), b.body.back().set_group("inputs");
    else if (rankOf(s - 1) != r)
      transfer(b.recvs, Op::RECV, s - 1, m, rankOf(s - 1), false, s - 1);
    if (s == K - 1 && in.training)
      b.body.push_back(makeInstruction(Op::LOAD, s, m)), b.body.back().set_group("labels");
    b.body.push_back(makeInstruction(Op::FORWARD, s, m));
    if (s + 1 < K && rankOf(s + 1) != r)
      transfer(b.sends, Op::SEND, s, m, rankOf(s + 1), false, s);
    if (!in.training)
      b.sends.push_back(makeInstruction(Op::FREE, s, m)); // kept only until sent
    break;
  }
  case ActionKind::B:
  case ActionKind::I: {
    if (s + 1 < K && rankOf(s + 1) != r)
      transfer(b.recvs, Op::RECV, s, m, rankOf(s + 1), true, s);
    if (in.recompute)
      b.body.push_back(makeInstruction(Op::RECOMPUTE, s, m));
    b.body.push_back(
        makeInstruction(a.kind == ActionKind::B ? Op::BACKWARD : Op::BACKWARD_INPUT, s, m));
    if (a.kind == ActionKind::B) {
      if (in.recompute)
        b.body.push_back(makeInstruction(Op::FREE, s, m)), b.body.back().set_group("rebuilt");
      b.body.push_back(makeInstruction(Op::FREE, s, m));
    }
    if (s > 0 && rankOf(s - 1) != r)
      transfer(b.sends, Op::SEND, s - 1, m, rankOf(s - 1), true, s - 1);
    break;
  }
  case ActionKind::W:
    b.body.push_back(makeInstruction(Op::BACKWARD_WEIGHT, s, m));
    if (in.recompute)
      b.body.push_back(makeInstruction(Op::FREE, s, m)), b.body.back().set_group("rebuilt");
    b.body.push_back(makeInstruction(Op::FREE, s, m));
    break;
  }
  return b;
}

/// Phase 1: each action with its receives, body and sends. Buffers are named
/// by (stage, microbatch, rebuilt) and numbered when flattened.
Expected<std::vector<std::vector<Block>>> Lowering::makeBlocks() const {
  std::vector<std::vector<Block>> blocks(P);
  for (int r = 0; r < P; ++r)
    for (const Action &a : schedule.ranks[r]) {
      if (rankOf(a.stage) != r)
        return loweringError(formatv("rank {0} was given action {1} of stage {2}, which runs "
                                     "on rank {3}",
                                     r, formatAction(a), a.stage, rankOf(a.stage)));
      blocks[r].push_back(blockOf(a, r));
    }
  return blocks;
}

/// Phase 2: NCCL matches point-to-point operations between two ranks in
/// order, so each rank posts its receives from a peer in the order that peer
/// sends: a receive moves earlier (never later) than the action that needs
/// it when the sender's order asks for it.
Error Lowering::orderReceives(std::vector<std::vector<Block>> &blocks) const {
  for (int dst = 0; dst < P; ++dst) {
    std::map<ChannelKey, std::pair<int, int>> natural; // -> (block, index in recvs)
    std::map<int, std::vector<ChannelKey>> wanted;     // src -> keys in dst's need order
    for (int b = 0; b < static_cast<int>(blocks[dst].size()); ++b)
      for (int i = 0; i < static_cast<int>(blocks[dst][b].recvs.size()); ++i) {
        const plan::Instruction &recv = blocks[dst][b].recvs[i];
        natural[keyOf(recv)] = {b, i};
        wanted[recv.peer()].push_back(keyOf(recv));
      }
    std::vector<std::vector<plan::Instruction>> placed(blocks[dst].size());
    for (auto &[src, keys] : wanted) {
      std::vector<ChannelKey> order; // the sender's order
      for (const Block &b : blocks[src])
        for (const plan::Instruction &send : b.sends)
          if (send.op() == Op::SEND && send.peer() == dst)
            order.push_back(keyOf(send));
      if (order.size() != keys.size())
        return loweringError(formatv("rank {0} sends {1} tensors to rank {2}, which receives {3}",
                                     src, order.size(), dst, keys.size()));
      std::vector<int> position(order.size());
      int next = static_cast<int>(blocks[dst].size());
      for (int k = static_cast<int>(order.size()) - 1; k >= 0; --k) {
        auto it = natural.find(order[k]);
        if (it == natural.end())
          return loweringError(
              formatv("rank {0} never receives a tensor rank {1} sends", dst, src));
        next = std::min(next, it->second.first);
        position[k] = next;
      }
      for (size_t k = 0; k < order.size(); ++k) {
        auto [b, i] = natural.at(order[k]);
        placed[position[k]].push_back(blocks[dst][b].recvs[i]);
      }
    }
    for (size_t b = 0; b < blocks[dst].size(); ++b)
      blocks[dst][b].early = std::move(placed[b]);
  }
  return Error::success();
}

/// Phase 3: rank \p r's blocks flattened, its buffers numbered with their
/// lifetimes, then the all-reduces and the optimizer step.
Expected<plan::RankProgram> Lowering::flatten(int r, std::vector<Block> &blocks) const {
  plan::RankProgram prog;
  prog.set_rank(r);
  std::map<std::tuple<int, int, bool>, int> live; // (stage, mb, rebuilt) -> buffer
  auto append = [&](plan::Instruction &&ins) {
    *prog.add_instructions() = std::move(ins);
    return prog.instructions_size() - 1;
  };
  auto allocate = [&](int at, int stage, int mb, int64_t bytes, bool rebuilt) {
    plan::Buffer *b = prog.add_buffers();
    b->set_index(prog.buffers_size() - 1);
    b->set_stage(stage);
    b->set_microbatch(mb);
    b->set_bytes(bytes);
    b->set_alloc_at(at);
    b->set_free_at(-1);
    live[{stage, mb, rebuilt}] = b->index();
    prog.mutable_instructions(at)->set_buffer(b->index());
  };
  for (size_t a = 0; a < blocks.size(); ++a) {
    prog.add_actions(formatAction(schedule.ranks[r][a]));
    for (plan::Instruction &ins : blocks[a].early)
      append(std::move(ins));
    for (plan::Instruction &body : blocks[a].body) {
      int at = append(std::move(body));
      const plan::Instruction &ins = prog.instructions(at);
      int s = ins.stage(), m = ins.microbatch();
      if (ins.op() == Op::FORWARD)
        allocate(at, s, m, in.recompute ? in.inputBytes[s] : in.activationBytes[s], false);
      else if (ins.op() == Op::RECOMPUTE)
        allocate(at, s, m, in.activationBytes[s], true);
      else if (ins.op() == Op::FREE) {
        auto it = live.find({s, m, ins.group() == "rebuilt"});
        if (it == live.end())
          return loweringError(formatv("rank {0} frees stage {1} microbatch {2}, which holds no "
                                       "activations",
                                       r, s, m));
        prog.mutable_instructions(at)->set_buffer(it->second);
        prog.mutable_instructions(at)->clear_group();
        prog.mutable_buffers(it->second)->set_free_at(at);
        live.erase(it);
      }
    }
    for (plan::Instruction &send : blocks[a].sends) {
      int at = append(std::move(send));
      const plan::Instruction &ins = prog.instructions(at);
      if (ins.op() == Op::FREE) {
        auto it = live.find({ins.stage(), ins.microbatch(), false});
        if (it != live.end()) {
          prog.mutable_instructions(at)->set_buffer(it->second);
          prog.mutable_buffers(it->second)->set_free_at(at);
          live.erase(it);
        }
      }
    }
  }
  if (in.training) {
    for (const auto &ar : in.allReduces) {
      if (std::find(ar.ranks.begin(), ar.ranks.end(), r) == ar.ranks.end())
        continue;
      plan::Instruction i = makeInstruction(Op::ALLREDUCE, -1, -1);
      i.set_group(allReduceGroupName(ar.reduce, ar.tiedWeight));
      i.set_reduce(ar.reduce);
      i.set_tied_weight(ar.tiedWeight);
      for (int rank : ar.ranks)
        i.add_ranks(rank);
      i.set_bytes(ar.bytes);
      append(std::move(i));
    }
    append(makeInstruction(Op::OPTIMIZER_STEP, -1, -1));
  }
  for (const plan::Buffer &b : prog.buffers())
    if (b.free_at() < 0)
      return loweringError(formatv("rank {0} never frees the activations of stage {1} "
                                   "microbatch {2} (no backward in its schedule)",
                                   r, b.stage(), b.microbatch()));
  return prog;
}

Expected<std::vector<plan::RankProgram>> Lowering::run() {
  if (static_cast<int>(in.sendTensors.size()) != K ||
      static_cast<int>(in.activationBytes.size()) != K)
    return loweringError(
        formatv("boundary tensors and activation sizes for {0} stages are needed", K));
  auto blocks = makeBlocks();
  if (!blocks)
    return blocks.takeError();
  if (Error err = orderReceives(*blocks))
    return err;
  std::vector<plan::RankProgram> programs;
  for (int r = 0; r < P; ++r) {
    auto program = flatten(r, (*blocks)[r]);
    if (!program)
      return program.takeError();
    programs.push_back(std::move(*program));
  }
  return programs;
}

} // namespace

Expected<std::vector<plan::RankProgram>> lowerSchedule(const Schedule &schedule,
                                                       const LoweringInputs &in) {
  return Lowering(schedule, in).run();
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

Error verifyProgram(const std::vector<plan::RankProgram> &programs, int stages, int microbatches,
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
  auto run = runStreams(streams, StreamCosts(), &deadlock);
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

} // namespace pipec
