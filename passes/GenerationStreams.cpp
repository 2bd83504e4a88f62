//===- GenerationStreams.cpp - `pipec generate`'s loop as rank streams --===//
#include "passes/GenerationStreams.h"
#include "support/DType.h"

#include <vector>

namespace pipec {

namespace {

using Ins = plan::Instruction;

plan::TensorRef int64Tensor(const char *name, std::vector<int64_t> shape) {
  plan::TensorRef t;
  t.set_name(name);
  t.set_dtype(dtypeName(DType::I64).str());
  int64_t bytes = 8;
  for (int64_t d : shape) {
    t.add_shape(d);
    bytes *= d;
  }
  t.set_bytes(bytes);
  return t;
}

/// Which of a rank's three streams.
enum class Kind { Start, Round, Stop };

struct Builder {
  int ranks, groups;
  plan::TensorRef control, picks;
  /// Per rank: the tensors its forward sends the next rank, and receives
  /// from the one before.
  std::vector<std::vector<const plan::TensorRef *>> sends, recvs;

  void add(google::protobuf::RepeatedPtrField<Ins> &out, Ins::Op op, int stage, int group,
           int peer = -1, const plan::TensorRef *tensor = nullptr) const {
    Ins &i = *out.Add();
    i.set_op(op);
    i.set_stage(stage);
    i.set_microbatch(group);
    if (tensor) {
      i.set_peer(peer);
      *i.mutable_tensor() = *tensor;
    }
  }

  void build(int r, Kind kind, google::protobuf::RepeatedPtrField<Ins> &out) const {
    bool first = r == 0, last = r + 1 == ranks, stop = kind == Kind::Stop;
    for (int g = 0; g < groups; ++g) {
      if (first && !last && kind != Kind::Start)
        add(out, Ins::RECV, ranks - 1, g, ranks - 1, &picks);
      if (first)
        add(out, Ins::SCHEDULE, r, g);
      else
        add(out, Ins::RECV, r - 1, g, r - 1, &control);
      if (!stop && !first)
        for (const plan::TensorRef *t : recvs[r])
          add(out, Ins::RECV, r - 1, g, r - 1, t);
      if (!stop) {
        add(out, Ins::LOAD, r, g);
        out.rbegin()->set_group("inputs");
        add(out, Ins::FORWARD, r, g);
      }
      if (!last) {
        add(out, Ins::SEND, r, g, r + 1, &control);
        if (!stop)
          for (const plan::TensorRef *t : sends[r])
            add(out, Ins::SEND, r, g, r + 1, t);
      } else if (!stop) {
        add(out, Ins::PICK, r, g);
        if (!first)
          add(out, Ins::SEND, r, g, 0, &picks);
      }
    }
  }
};

} // namespace

void addGenerationStreams(plan::Plan &plan) {
  const plan::ScheduleInfo &s = plan.schedule();
  Builder b{s.stages(),
            s.microbatches(),
            int64Tensor(generationControl, {s.microbatch_size() + 1, 2}),
            int64Tensor(generationPicks, {2, s.microbatch_size()}),
            {},
            {}};
  b.sends.resize(plan.programs_size());
  b.recvs.resize(plan.programs_size());
  for (int r = 0; r < plan.programs_size(); ++r)
    for (const Ins &i : plan.programs(r).instructions())
      if (i.microbatch() == 0 && !i.grad() && (i.op() == Ins::SEND || i.op() == Ins::RECV))
        (i.op() == Ins::SEND ? b.sends : b.recvs)[r].push_back(&i.tensor());
  for (int r = 0; r < plan.programs_size(); ++r) {
    plan::GenerationStreams &streams = *plan.mutable_programs(r)->mutable_generation();
    streams.Clear();
    b.build(r, Kind::Start, *streams.mutable_start());
    b.build(r, Kind::Round, *streams.mutable_round());
    b.build(r, Kind::Stop, *streams.mutable_stop());
  }
}

} // namespace pipec
