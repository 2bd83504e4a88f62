//===- StepProfile.h - run --profile: where one step's time went --------===//
//
// `pipec run PLAN --profile FILE` profiles the last step of the run (the
// first steps warm up). Each rank records every node it runs: its op type,
// the host time from the end of the node before to its end (its dispatch
// included; on a device that is the enqueue), the bytes of its inputs and
// outputs, and its FLOPs (a matrix product's 2 M N K from its shapes, one per
// output element otherwise); the backend's counters over the step
// (BackendCounters: launches, host synchronisations, bytes copied back to the
// host, allocations); and the step's wall time. The file sums the nodes by op
// class, each with its share of the rank's node time and of the step and its
// achieved GFLOP/s and GB/s; the rest of the step (the optimizer, sends,
// waits for other ranks) is the step less the nodes' time.
//
// The file (JSON):
//   {"backend": "cpu", "step": 3, "ranks": [{"rank": 0, "step_s": 0.41,
//     "nodes_s": 0.38, "other_s": 0.03, "launches": 812, "host_syncs": 9,
//     "d2h_bytes": 72, "allocations": 1650,
//     "classes": [{"op": "MatMul", "nodes": 96, "seconds": 0.21,
//                  "share_of_nodes": 0.55, "share_of_step": 0.51,
//                  "gflops": 1.2e2, "gbytes": 0.8, "gflop_per_s": 571.4,
//                  "gb_per_s": 3.8}, ...]}]}
// Classes are in order of seconds, most first.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_STEPPROFILE_H
#define PIPEC_RUNTIME_EXEC_STEPPROFILE_H

#include "runtime/core/Backend.h"
#include "runtime/core/Tensor.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <map>
#include <string>

namespace pipec::rt {

/// One op class's nodes in the profiled step.
struct ClassTotals {
  int64_t nodes = 0;
  double seconds = 0, flops = 0, bytes = 0;
};

/// One rank's profiled step.
struct RankProfile {
  int rank = 0; ///< global rank
  double stepSeconds = 0, nodeSeconds = 0;
  std::map<std::string, ClassTotals> classes;
  BackendCounters counters;

  /// Records \p node, run in \p seconds on \p inputs (null where absent)
  /// into \p outputs (none where something else ran it).
  void node(const onnx::NodeProto &node, llvm::ArrayRef<const cpu::Tensor *> inputs,
            llvm::ArrayRef<cpu::Tensor> outputs, double seconds);
};

/// The FLOPs of \p node on \p inputs into \p outputs, as above.
double nodeFlops(const onnx::NodeProto &node, llvm::ArrayRef<const cpu::Tensor *> inputs,
                 llvm::ArrayRef<cpu::Tensor> outputs);

/// Writes the profile of step \p step (1-based) of \p ranks, run on
/// \p backend, to \p path; the error names the file.
llvm::Error writeProfile(llvm::StringRef path, llvm::StringRef backend, int step,
                         llvm::ArrayRef<RankProfile> ranks);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_STEPPROFILE_H
