//===- PlanMemory.cpp - plan-memory: buffer slots and peaks per rank ------===//
#include "passes/PlanMemory.h"

#include <algorithm>
#include <map>

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

} // namespace pipec
