//===- PlanMemory.h - plan-memory: buffer slots and peaks per rank ------===//
//
// lower-schedule leaves every rank's program with its buffers and their
// lifetimes: a forward's kept activations live from the FORWARD to the FREE
// after the full backward (B) or, with split backward, after W; with
// recompute a rebuilt set lives from its RECOMPUTE to the FREE after its
// backward. plan-memory gives each buffer a slot: at one instruction frees
// come before allocations, and a buffer takes a slot its stage freed (the one
// freed last) before it opens a new one, so a stage's slots hold the
// microbatches it keeps in flight. A slot is as big as the largest buffer it
// holds. It yields each rank's peak of live activation bytes, plus the
// working bytes lower-schedule gave the rank (what its chunks hold beyond
// their kept activations while one runs), which the plan checks against the
// memory model that balance-stages trusted.
//
// Before: rank 0 (1F1B, P = 2, M = 3): buf0 [FORWARD s0 mb0 .. FREE after
//         BACKWARD s0 mb0], buf1 [mb1], buf2 [mb2, allocated after buf0's FREE]
// After:  buf0 slot 0, buf1 slot 1, buf2 slot 0; 2 slots, peak 2 x the
//         stage's activation bytes
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_PLANMEMORY_H
#define PIPEC_PASSES_PLANMEMORY_H

#include "plan/plan.pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/raw_ostream.h"

#include <vector>

namespace pipec {

/// One activation buffer of a rank's program: its stage, bytes, and the
/// instructions that allocate and free it (lower-schedule's numbering).
struct BufferLife {
  int stage = 0, microbatch = 0;
  int64_t bytes = 0;
  int allocAt = 0, freeAt = -1;
};

/// plan-memory's answer for one rank's buffers.
struct SlotPlan {
  std::vector<int> slot; ///< per buffer
  std::vector<int64_t> slotBytes;
  int64_t peak = 0; ///< of live activation bytes
};

/// plan-memory on one rank's buffers. Precondition: every buffer has its
/// lifetime (allocAt before freeAt), as lower-schedule leaves it.
SlotPlan planSlots(llvm::ArrayRef<BufferLife> buffers);

/// plan-memory on each of \p programs: sets every buffer's slot and the
/// program's peak activation bytes (the slots' peak plus its working_bytes),
/// slot count and slot sizes.
/// Precondition: every buffer has its lifetime (alloc_at before free_at), as
/// lower-schedule leaves it.
void planMemory(std::vector<plan::RankProgram> &programs);

/// The text --print-after=plan-memory shows: per rank its peak and slots,
/// then each buffer's stage, microbatch, bytes, slot and lifetime
/// (instruction indices).
void printMemoryPlan(const std::vector<plan::RankProgram> &programs, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_PASSES_PLANMEMORY_H
