//===- Comm.h - How the ranks of a run talk to each other ---------------===//
//
// One interface, two transports:
//  - local: every rank is a thread of one process (`pipec run PLAN`); a
//    message is a shared, immutable tensor handed over through a queue;
//  - mpi: one process per rank (`mpirun -np N pipec run PLAN --comm mpi`),
//    any number of nodes; point-to-point is MPI_Isend/MPI_Irecv, sums are
//    MPI_Allreduce on communicators made once per group, the sharded
//    optimizer's MPI_Reduce_scatter_block and MPI_Allgather on the same.
//
// Point-to-point semantics are the plan's (NCCL's): between two ranks,
// messages match in the order they are posted, so a rank posts its receives
// from a peer in the order that peer sends. A send returns at once; a
// receive returns a handle that wait() completes.
//
// A rank that fails calls fail(): local peers blocked in wait() or in a sum
// return an error naming it within a poll interval; under MPI the job is
// aborted (mpirun then names the rank). A wait that sees no progress for
// the timeout fails too, so a run never hangs: under MPI the collectives
// are non-blocking (MPI_Iallreduce, ...) and polled under the same timeout,
// and the error names the lost peer's node.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_COMM_COMM_H
#define PIPEC_RUNTIME_COMM_COMM_H

#include "runtime/core/Tensor.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <memory>
#include <string>
#include <vector>

namespace pipec::rt {

class Comm {
public:
  virtual ~Comm() = default;
  /// This rank and the number of ranks, over all pipeline replicas.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The node (host) rank \p rank runs on; empty where every rank is a
  /// thread of this process.
  virtual std::string nodeOf(int rank) const {
    (void)rank;
    return std::string();
  }
  /// How many of the ranks below \p end run on this rank's node.
  int onThisNodeBelow(int end) const {
    std::string here = nodeOf(rank());
    int n = 0;
    for (int r = 0; r < end; ++r)
      n += nodeOf(r) == here;
    return n;
  }
  /// How many ranks share this rank's node (its cores and devices), and this
  /// rank's index among them in rank order.
  int ranksOnThisNode() const { return onThisNodeBelow(size()); }
  int indexOnThisNode() const { return onThisNodeBelow(rank()); }
  /// Posts \p tensor to \p peer. Tensors are never modified once made, so
  /// the storage is shared until the message is delivered.
  virtual llvm::Error send(int peer, const cpu::Tensor &tensor) = 0;
  /// Posts a receive from \p peer of a tensor of \p type and \p shape.
  virtual llvm::Expected<int> postRecv(int peer, DType type, std::vector<int64_t> shape) = 0;
  virtual llvm::Expected<cpu::Tensor> wait(int handle) = 0;
  /// Announces the groups sum() will be called on, identically on every
  /// rank (MPI makes their communicators here, collectively).
  virtual llvm::Error prepareGroups(const std::vector<std::vector<int>> &groups) = 0;
  /// Element-wise sums float tensors over \p group (sorted global ranks,
  /// including this one) in place; every member gets the same bits.
  virtual llvm::Error sum(llvm::ArrayRef<int> group,
                          llvm::MutableArrayRef<cpu::Tensor> tensors) = 0;
  /// Reduce-scatter over \p group (sorted global ranks, including this
  /// one, N of them): each of \p tensors is flat, float32 or float64, of
  /// N x c elements; it is summed over the group and replaced by the c
  /// elements of the sum at this rank's position in the group, with the
  /// bits sum() would give them. The sharded optimizer's gradients.
  virtual llvm::Error reduceScatter(llvm::ArrayRef<int> group,
                                    llvm::MutableArrayRef<cpu::Tensor> tensors) = 0;
  /// All-gather over \p group: each of \p tensors is flat, of c elements
  /// of any type, and is replaced by the N x c elements of every member's,
  /// in group order. The sharded optimizer's updated weights.
  virtual llvm::Error allGather(llvm::ArrayRef<int> group,
                                llvm::MutableArrayRef<cpu::Tensor> tensors) = 0;
  /// Sums \p values over all ranks in place.
  virtual llvm::Error sumAll(llvm::MutableArrayRef<double> values) = 0;
  /// Every rank's \p bytes, at rank 0 (others get an empty list).
  virtual llvm::Expected<std::vector<std::string>> gather(const std::string &bytes) = 0;
  /// Completes the sends posted so far.
  virtual llvm::Error flush() = 0;
  /// Tells the other ranks this one failed with \p why.
  virtual void fail(const std::string &why) = 0;

  /// Whether send() may be handed device tensors (the sender's stream
  /// synchronized): local threads share the process's devices; NCCL moves
  /// device memory. Otherwise the executor sends host copies.
  virtual bool devicePointToPoint() const { return false; }
  /// Whether sum(), reduceScatter() and allGather() work on device tensors
  /// (NCCL); otherwise host tensors.
  virtual bool deviceSums() const { return false; }
  /// Brackets the SEND/RECV instructions that the plan posts together, for
  /// transports that must issue them as one group (NCCL).
  virtual llvm::Error groupStart() { return llvm::Error::success(); }
  virtual llvm::Error groupEnd() { return llvm::Error::success(); }
};

/// The shared state of a local run; one Comm per rank thread.
class LocalWorld {
public:
  LocalWorld(int size, double timeoutSeconds);
  ~LocalWorld();
  std::unique_ptr<Comm> comm(int rank);
  struct State;

private:
  std::shared_ptr<State> state;
};

/// MPI_Init_thread if needed; the Comm of this process. MPI is finalized
/// when the last MpiComm is destroyed.
llvm::Expected<std::unique_ptr<Comm>> makeMpiComm(double timeoutSeconds);

/// NCCL over \p bootstrap (an MPI Comm, kept for host sums and gathers):
/// point-to-point and gradient sums move device memory of \p device. From
/// the CUDA plugin; fails clearly without it.
llvm::Expected<std::unique_ptr<Comm>> makeNcclComm(std::unique_ptr<Comm> bootstrap, int device,
                                                   double timeoutSeconds);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_COMM_COMM_H
