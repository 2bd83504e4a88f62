//===- NcclComm.cpp - Device tensors between ranks, over NCCL -------------===//
//
// `mpirun -np N pipec run PLAN --backend cuda --comm nccl`: boundary tensors
// and gradient sums move GPU memory with NCCL; host-side sums (the step's
// loss), gathers and failure reports go over the MPI Comm this one wraps.
//
// - One world communicator, made from an id rank 0 broadcasts over MPI;
//   one more per all-reduce group (tied weights, data-parallel replicas),
//   split from it in the same order on every rank.
// - Sends and receives run on a communication stream of their own, so they
//   overlap the compute stream; the SEND/RECV instructions the plan posts
//   together are one ncclGroupStart/End group, which is what NCCL needs for
//   1F1B's paired send-forward / receive-backward not to deadlock.
// - wait() polls the receive's event, so a peer that never sends turns into
//   an error after the timeout instead of a hang.
//
//===----------------------------------------------------------------------===//
#include "runtime/comm/Comm.h"
#include "runtime/cuda/CudaStatus.h"

#include "llvm/Support/FormatVariadic.h"

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <deque>
#include <map>
#include <thread>

using namespace llvm;

namespace pipec::rt {
namespace {

class NcclComm final : public Comm {
public:
  NcclComm(std::unique_ptr<Comm> host, int device, double timeout)
      : host(std::move(host)), device(device), timeout(timeout) {}

  Error init() {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ncclUniqueId id;
    if (host->rank() == 0)
      PIPEC_CUDA_TRY(ncclGetUniqueId(&id));
    if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
      return createStringError(inconvertibleErrorCode(), "rank %d: broadcasting the NCCL id",
                               host->rank());
    PIPEC_CUDA_TRY(ncclCommInitRank(&world, host->size(), id, host->rank()));
    return Error::success();
  }

  ~NcclComm() override {
    consumeError(flush());
    for (auto &[group, c] : groups)
      if (c)
        ncclCommDestroy(c);
    if (world)
      ncclCommDestroy(world);
    for (auto &[h, r] : recvs)
      cudaEventDestroy(r.done);
    if (stream)
      cudaStreamDestroy(stream);
  }

  int rank() const override { return host->rank(); }
  int size() const override { return host->size(); }
  bool devicePointToPoint() const override { return true; }
  bool deviceSums() const override { return true; }

  Error groupStart() override {
    PIPEC_CUDA_TRY(ncclGroupStart());
    return Error::success();
  }
  Error groupEnd() override {
    PIPEC_CUDA_TRY(ncclGroupEnd());
    return Error::success();
  }

  Error send(int peer, const cpu::Tensor &tensor) override {
    cpu::Tensor message = tensor;
    if (tensor.onHost()) {
      // Backends keep small integer results (shapes) on the host.
      void *memory = nullptr;
      PIPEC_CUDA_TRY(cudaMallocAsync(&memory, std::max<size_t>(tensor.byteSize(), 1), stream));
      cudaStream_t s = stream;
      std::shared_ptr<void> storage(memory, [s](void *p) { cudaFreeAsync(p, s); });
      PIPEC_CUDA_TRY(cudaMemcpyAsync(memory, tensor.rawData(), tensor.byteSize(),
                                     cudaMemcpyHostToDevice, stream));
      PIPEC_CUDA_TRY(cudaStreamSynchronize(stream)); // the host tensor may go now
      message =
          cpu::Tensor::onDevice(tensor.elemType(), tensor.shape(), std::move(storage), device);
    }
    PIPEC_CUDA_TRY(ncclSend(message.rawData(), message.byteSize(), ncclChar, peer, world, stream));
    sends.push_back(std::move(message)); // kept alive until flush()
    return Error::success();
  }

  Expected<int> postRecv(int peer, cpu::ElemType type, std::vector<int64_t> shape) override {
    size_t bytes = static_cast<size_t>(cpu::numElementsOf(shape)) * cpu::storageSize(type);
    void *memory = nullptr;
    PIPEC_CUDA_TRY(cudaMallocAsync(&memory, std::max<size_t>(bytes, 1), stream));
    cudaStream_t s = stream;
    std::shared_ptr<void> storage(memory, [s](void *p) { cudaFreeAsync(p, s); });
    Pending p;
    p.tensor = cpu::Tensor::onDevice(type, std::move(shape), std::move(storage), device);
    p.peer = peer;
    PIPEC_CUDA_TRY(ncclRecv(memory, bytes, ncclChar, peer, world, stream));
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    // Recorded now, it completes with everything queued on the stream so far,
    // this receive included (a group's receives complete at its end).
    PIPEC_CUDA_TRY(cudaEventRecord(p.done, stream));
    int handle = next++;
    recvs.emplace(handle, std::move(p));
    return handle;
  }

  Expected<cpu::Tensor> wait(int handle) override {
    auto it = recvs.find(handle);
    if (it == recvs.end())
      return createStringError(inconvertibleErrorCode(), "rank %d: no receive %d", rank(), handle);
    if (Error err =
            poll(it->second.done, formatv("a message from rank {0}", it->second.peer).str()))
      return err;
    cudaEventDestroy(it->second.done);
    cpu::Tensor out = std::move(it->second.tensor);
    recvs.erase(it);
    return out;
  }

  Error prepareGroups(const std::vector<std::vector<int>> &all) override {
    if (Error err = host->prepareGroups(all))
      return err;
    for (const std::vector<int> &group : all) {
      if (group.size() < 2 || groups.count(group))
        continue;
      bool member = std::find(group.begin(), group.end(), rank()) != group.end();
      ncclComm_t c = nullptr;
      PIPEC_CUDA_TRY(ncclCommSplit(world, member ? 0 : NCCL_SPLIT_NOCOLOR, rank(), &c, nullptr));
      groups[group] = c;
    }
    return Error::success();
  }

  Error sum(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    if (group.size() < 2 || tensors.empty())
      return Error::success();
    auto it = groups.find(std::vector<int>(group.begin(), group.end()));
    if (it == groups.end() || !it->second)
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: no NCCL communicator for a "
                               "group",
                               rank());
    PIPEC_CUDA_TRY(ncclGroupStart());
    for (cpu::Tensor &t : tensors) {
      if (t.onHost())
        return createStringError(inconvertibleErrorCode(), "rank %d: NCCL sums device tensors",
                                 rank());
      ncclDataType_t type = t.elemType() == cpu::ElemType::Double ? ncclFloat64 : ncclFloat32;
      // The accumulators are the rank's own: summed in place.
      PIPEC_CUDA_TRY(ncclAllReduce(t.rawData(), t.rawData(), static_cast<size_t>(t.numElements()),
                                   type, ncclSum, it->second, stream));
    }
    PIPEC_CUDA_TRY(ncclGroupEnd());
    cudaEvent_t done;
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    PIPEC_CUDA_TRY(cudaEventRecord(done, stream));
    Error err = poll(done, "an all-reduce");
    cudaEventDestroy(done);
    return err;
  }

  Error sumAll(MutableArrayRef<double> values) override { return host->sumAll(values); }
  Expected<std::vector<std::string>> gather(const std::string &bytes) override {
    return host->gather(bytes);
  }

  Error flush() override {
    if (stream) {
      cudaEvent_t done;
      PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      PIPEC_CUDA_TRY(cudaEventRecord(done, stream));
      Error err = poll(done, "sends to complete");
      cudaEventDestroy(done);
      if (err)
        return err;
    }
    sends.clear();
    return host->flush();
  }

  void fail(const std::string &why) override {
    if (world)
      ncclCommAbort(world);
    world = nullptr;
    host->fail(why);
  }

private:
  struct Pending {
    cpu::Tensor tensor;
    cudaEvent_t done = nullptr;
    int peer = -1;
  };

  Error poll(cudaEvent_t event, const std::string &what) {
    auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(1);
    while (true) {
      cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess)
        return Error::success();
      if (status != cudaErrorNotReady)
        PIPEC_CUDA_TRY(status);
      ncclResult_t async = ncclSuccess;
      if (world && ncclCommGetAsyncError(world, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress)
        PIPEC_CUDA_TRY(async);
      double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout)
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: no progress for %.0f s waiting for %s", rank(), timeout,
                                 what.c_str());
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  std::unique_ptr<Comm> host;
  int device;
  double timeout;
  cudaStream_t stream = nullptr;
  ncclComm_t world = nullptr;
  std::map<std::vector<int>, ncclComm_t> groups;
  std::map<int, Pending> recvs;
  std::deque<cpu::Tensor> sends;
  int next = 0;
};

} // namespace
} // namespace pipec::rt

/// The plugin's entry point (see runtime/core/CpuBackend.cpp): takes
/// ownership of \p bootstrap; null and \p error on failure.
extern "C" __attribute__((visibility("default"))) pipec::rt::Comm *
pipecMakeNcclComm(pipec::rt::Comm *bootstrap, int device, double timeout, std::string *error) {
  auto comm = std::make_unique<pipec::rt::NcclComm>(std::unique_ptr<pipec::rt::Comm>(bootstrap),
                                                    device, timeout);
  if (llvm::Error err = comm->init()) {
    *error = llvm::toString(std::move(err));
    return nullptr;
  }
  return comm.release();
}
