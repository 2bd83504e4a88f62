//===- PlanMemory.cpp - plan-memory: buffer slots and peaks per rank ------===//
#include "passes/PlanMemory.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <map>

using namespace llvm;

namespace pipec {

SlotPlan planSlots(ArrayRef<BufferLife> buffers) {
  SlotPlan out;
  out.slot.assign(buffers.size(), -1);
  std::map<int, std::vector<int>> freeSlots; // stage -> free slot ids
  std::vector<std::pair<int, int>> events;   // (instruction, +buffer+1 / -buffer-1)
  events.reserve(2 * buffers.size());
  for (int b = 0; b < static_cast<int>(buffers.size()); ++b) {
    events.emplace_back(buffers[b].allocAt, b + 1);
    events.emplace_back(buffers[b].freeAt, -(b + 1));
  }
  // At one instruction, frees come before allocations: a FREE sits at its own
  // index and a buffer allocated later never shares it.
  std::sort(events.begin(), events.end());
  int64_t live = 0;
  for (auto &[at, code] : events) {
    (void)at;
    int b = std::abs(code) - 1;
    const BufferLife &buffer = buffers[b];
    if (code > 0) {
      auto &pool = freeSlots[buffer.stage];
      int slot;
      if (pool.empty()) {
        slot = static_cast<int>(out.slotBytes.size());
        out.slotBytes.push_back(buffer.bytes);
      } else {
        // A stage's slots hold both kinds of its buffers (kept inputs and,
        // with recompute, rebuilt activations): a slot is as big as the
        // largest it holds.
        slot = pool.back();
        pool.pop_back();
        out.slotBytes[slot] = std::max(out.slotBytes[slot], buffer.bytes);
      }
      out.slot[b] = slot;
      live += buffer.bytes;
      out.peak = std::max(out.peak, live);
    } else {
      freeSlots[buffer.stage].push_back(out.slot[b]);
      live -= buffer.bytes;
    }
  }
  return out;
}

void planMemory(std::vector<plan::RankProgram> &programs) {
  for (plan::RankProgram &program : programs) {
    std::vector<BufferLife> buffers;
    for (const plan::Buffer &b : program.buffers())
      buffers.push_back({b.stage(), b.microbatch(), b.bytes(), b.alloc_at(), b.free_at()});
    SlotPlan slots = planSlots(buffers);
    for (int b = 0; b < program.buffers_size(); ++b)
      program.mutable_buffers(b)->set_slot(slots.slot[b]);
    program.set_peak_activation_bytes(slots.peak + program.working_bytes());
    program.set_slots(static_cast<int>(slots.slotBytes.size()));
    program.clear_slot_bytes();
    for (int64_t bytes : slots.slotBytes)
      program.add_slot_bytes(bytes);
  }
}

void printMemoryPlan(const std::vector<plan::RankProgram> &programs, raw_ostream &os) {
  for (const plan::RankProgram &p : programs) {
    os << formatv("rank {0}: peak {1} activation bytes, {2} buffers in {3} slots\n", p.rank(),
                  p.peak_activation_bytes(), p.buffers_size(), p.slots());
    for (int s = 0; s < p.slot_bytes_size(); ++s)
      os << formatv("  slot {0} bytes={1}\n", s, p.slot_bytes(s));
    for (const plan::Buffer &b : p.buffers())
      os << formatv("  buf{0} s{1} mb{2} bytes={3} slot={4} live={5}..{6}\n", b.index(), b.stage(),
                    b.microbatch(), b.bytes(), b.slot(), b.alloc_at(), b.free_at());
  }
}

} // namespace pipec
