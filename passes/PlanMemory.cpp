//===- PlanMemory.cpp - plan-memory: buffer slots and peaks per rank ------===//
#include "passes/PlanMemory.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <map>

using namespace llvm;

namespace pipec {
namespace {

/// Assigns buffer slots by liveness (per stage, the slot freed last first)
/// and computes the rank's peak of live activation bytes.
void planMemory(plan::RankProgram &program) {
  std::map<int, std::vector<int>> freeSlots; // stage -> free slot ids
  std::vector<int64_t> slotBytes;
  std::vector<std::pair<int, int>> events; // (instruction, +buffer+1 / -buffer-1)
  for (int b = 0; b < program.buffers_size(); ++b) {
    events.emplace_back(program.buffers(b).alloc_at(), b + 1);
    events.emplace_back(program.buffers(b).free_at(), -(b + 1));
  }
  // At one instruction, frees come before allocations: a FREE sits at its own
  // index and a buffer allocated later never shares it.
  std::sort(events.begin(), events.end());
  int64_t live = 0, peak = 0;
  for (auto &[at, code] : events) {
    (void)at;
    int b = std::abs(code) - 1;
    plan::Buffer *buffer = program.mutable_buffers(b);
    if (code > 0) {
      auto &pool = freeSlots[buffer->stage()];
      int slot;
      if (pool.empty()) {
        slot = static_cast<int>(slotBytes.size());
        slotBytes.push_back(buffer->bytes());
      } else {
        // A stage's slots hold both kinds of its buffers (kept inputs and,
        // with recompute, rebuilt activations): a slot is as big as the
        // largest it holds.
        slot = pool.back();
        pool.pop_back();
        slotBytes[slot] = std::max(slotBytes[slot], buffer->bytes());
      }
      buffer->set_slot(slot);
      live += buffer->bytes();
      peak = std::max(peak, live);
    } else {
      freeSlots[buffer->stage()].push_back(buffer->slot());
      live -= buffer->bytes();
    }
  }
  program.set_peak_activation_bytes(peak);
  program.set_slots(static_cast<int>(slotBytes.size()));
  for (int64_t bytes : slotBytes)
    program.add_slot_bytes(bytes);
}

} // namespace

void planMemory(std::vector<plan::RankProgram> &programs) {
  for (plan::RankProgram &program : programs)
    planMemory(program);
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
