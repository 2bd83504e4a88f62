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
//   1F1B's paired send-forward / receive-backward not to deadlock. A group's
//   operations reach the stream only at ncclGroupEnd, so the events that
//   say a receive (or a group's sends) completed are recorded there.
// - wait() polls the receive's event, so a peer that never sends turns into
//   an error after the timeout instead of a hang. The compute stream reads
//   a received buffer only after that (host-side) wait, and the backend
//   holds the tensor until its reads are done; the buffer is then freed in
//   the communication stream's order.
// - A sent tensor stays referenced until its group's event completes. A sum
//   first waits for the device: the accumulators are the backend's.
//
//===----------------------------------------------------------------------===//
#include "runtime/comm/Comm.h"
#include "runtime/cuda/CudaStatus.h"

#include "llvm/Support/FormatVariadic.h"

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <type_traits>

using namespace llvm;

namespace pipec::rt {
namespace {

/// The communication stream, shared with the buffers NCCL sends from and
/// receives into: their deleters free them in its order, also after the
/// Comm is gone (a received tensor may outlive it).
using SharedStream = std::shared_ptr<std::remove_pointer_t<cudaStream_t>>;

class NcclComm final : public Comm {
public:
  NcclComm(std::unique_ptr<Comm> host, int device, double timeout)
      : host(std::move(host)), device(device), timeout(timeout) {}

  Error init() {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    cudaStream_t made = nullptr;
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking));
    stream = SharedStream(made, [](cudaStream_t s) { cudaStreamDestroy(s); });
    PIPEC_CUDA_TRY(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking));
    copyStream = SharedStream(made, [](cudaStream_t s) { cudaStreamDestroy(s); });
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
    cudaSetDevice(device);
    if (!failed)
      consumeError(flush());
    for (auto &[h, r] : recvs)
      if (r.done)
        cudaEventDestroy(r.done);
    recvs.clear();
    for (Flight &f : inFlight)
      cudaEventDestroy(f.done);
    inFlight.clear();
    openSends.clear();
    for (auto &[group, c] : groups)
      if (c)
        ncclCommDestroy(c);
    if (world)
      ncclCommDestroy(world);
  }

  int rank() const override { return host->rank(); }
  int size() const override { return host->size(); }
  bool devicePointToPoint() const override { return true; }
  bool deviceSums() const override { return true; }

  Error groupStart() override {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    PIPEC_CUDA_TRY(ncclGroupStart());
    ++groupDepth;
    return Error::success();
  }
  Error groupEnd() override {
    if (groupDepth == 0)
      return createStringError(inconvertibleErrorCode(), "rank %d: a group end without a start",
                               rank());
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    --groupDepth;
    PIPEC_CUDA_TRY(ncclGroupEnd());
    return groupDepth == 0 ? enqueued() : Error::success();
  }

  Error send(int peer, const cpu::Tensor &tensor) override {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    cpu::Tensor message = tensor;
    if (tensor.onHost()) {
      // Backends keep small integer results (shapes) on the host. Copied on
      // a stream of its own: waiting for the communication stream here could
      // wait for a peer that waits for this very message.
      void *memory = nullptr;
      PIPEC_CUDA_TRY(
          cudaMallocAsync(&memory, std::max<size_t>(tensor.byteSize(), 1), copyStream.get()));
      std::shared_ptr<void> storage(memory, bufferDeleter());
      PIPEC_CUDA_TRY(cudaMemcpyAsync(memory, tensor.rawData(), tensor.byteSize(),
                                     cudaMemcpyHostToDevice, copyStream.get()));
      PIPEC_CUDA_TRY(cudaStreamSynchronize(copyStream.get())); // the host tensor may go now
      message =
          cpu::Tensor::onDevice(tensor.elemType(), tensor.shape(), std::move(storage), device);
    }
    PIPEC_CUDA_TRY(
        ncclSend(message.rawData(), message.byteSize(), ncclChar, peer, world, stream.get()));
    openSends.push_back(std::move(message)); // until the send has run
    return groupDepth == 0 ? enqueued() : Error::success();
  }

  Expected<int> postRecv(int peer, DType type, std::vector<int64_t> shape) override {
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    size_t bytes = static_cast<size_t>(cpu::numElementsOf(shape)) * cpu::storageSize(type);
    void *memory = nullptr;
    PIPEC_CUDA_TRY(cudaMallocAsync(&memory, std::max<size_t>(bytes, 1), stream.get()));
    Pending p;
    // The compute stream reads the buffer; the backend holds the tensor until
    // those reads are done, so the free comes after them.
    p.tensor = cpu::Tensor::onDevice(type, std::move(shape),
                                     std::shared_ptr<void>(memory, bufferDeleter()), device);
    p.peer = peer;
    PIPEC_CUDA_TRY(ncclRecv(memory, bytes, ncclChar, peer, world, stream.get()));
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
    int handle = next++;
    recvs.emplace(handle, std::move(p));
    if (groupDepth > 0) {
      // Inside a group the receive is queued on the stream only by
      // ncclGroupEnd: an event recorded now would complete without it.
      openRecvs.push_back(handle);
      return handle;
    }
    if (Error err = enqueued())
      return err;
    return handle;
  }

  Expected<cpu::Tensor> wait(int handle) override {
    auto it = recvs.find(handle);
    if (it == recvs.end())
      return createStringError(inconvertibleErrorCode(), "rank %d: no receive %d", rank(), handle);
    if (!it->second.recorded)
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: waiting for a receive from rank %d inside its own "
                               "send/receive group",
                               rank(), it->second.peer);
    if (Error err =
            poll(it->second.done, formatv("a message from rank {0}", it->second.peer).str(), world))
      return err;
    cudaEventDestroy(it->second.done);
    cpu::Tensor out = std::move(it->second.tensor);
    recvs.erase(it);
    retireSends();
    return out;
  }

  Error prepareGroups(const std::vector<std::vector<int>> &all) override {
    if (Error err = host->prepareGroups(all))
      return err;
    PIPEC_CUDA_TRY(cudaSetDevice(device));
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
    // The executor has synchronized the backend, so the accumulators are
    // written (Executor.cpp, sumOver).
    return collective(
        group, tensors, "an all-reduce",
        [&](const cpu::Tensor &t, cpu::Tensor & /*in place*/, ncclComm_t comm) -> Error {
          if (!cpu::isFloating(t.elemType()))
            return createStringError(inconvertibleErrorCode(),
                                     "rank %d: NCCL sums floating-point device tensors, not %s",
                                     rank(), t.describe().c_str());
          ncclDataType_t type = t.elemType() == cpu::DType::F64 ? ncclFloat64 : ncclFloat32;
          // The accumulators are the rank's own: summed in place.
          PIPEC_CUDA_TRY(ncclAllReduce(t.rawData(), const_cast<void *>(t.rawData()),
                                       static_cast<size_t>(t.numElements()), type, ncclSum, comm,
                                       stream.get()));
          return Error::success();
        });
  }

  Error reduceScatter(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    size_t n = group.size();
    return collective(
        group, tensors, "a reduce-scatter",
        [&](const cpu::Tensor &t, cpu::Tensor &out, ncclComm_t comm) -> Error {
          if (t.elemType() != cpu::DType::F32 && t.elemType() != cpu::DType::F64)
            return createStringError(inconvertibleErrorCode(),
                                     "rank %d: a reduce-scatter needs float tensors, not %s",
                                     rank(), t.describe().c_str());
          if (t.numElements() % static_cast<int64_t>(n) != 0)
            return createStringError(inconvertibleErrorCode(),
                                     "rank %d: a reduce-scatter over %zu ranks of %s", rank(), n,
                                     t.describe().c_str());
          int64_t block = t.numElements() / static_cast<int64_t>(n);
          auto made = deviceTensor(t.elemType(), block);
          if (!made)
            return made.takeError();
          out = std::move(*made);
          ncclDataType_t type = t.elemType() == cpu::DType::F64 ? ncclFloat64 : ncclFloat32;
          PIPEC_CUDA_TRY(ncclReduceScatter(t.rawData(), out.rawData(), static_cast<size_t>(block),
                                           type, ncclSum, comm, stream.get()));
          return Error::success();
        });
  }

  Error allGather(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    size_t n = group.size();
    return collective(group, tensors, "an all-gather",
                      [&](const cpu::Tensor &t, cpu::Tensor &out, ncclComm_t comm) -> Error {
                        auto made =
                            deviceTensor(t.elemType(), t.numElements() * static_cast<int64_t>(n));
                        if (!made)
                          return made.takeError();
                        out = std::move(*made);
                        // Bytes: half types are stored as float, every type moves as it is.
                        PIPEC_CUDA_TRY(ncclAllGather(t.rawData(), out.rawData(), t.byteSize(),
                                                     ncclChar, comm, stream.get()));
                        return Error::success();
                      });
  }

  Error sumAll(MutableArrayRef<double> values) override { return host->sumAll(values); }
  std::string nodeOf(int rank) const override { return host->nodeOf(rank); }
  Expected<std::vector<std::string>> gather(const std::string &bytes) override {
    return host->gather(bytes);
  }

  Error flush() override {
    if (stream) {
      PIPEC_CUDA_TRY(cudaSetDevice(device));
      if (Error err = drain("sends to complete"))
        return err;
      for (Flight &f : inFlight)
        cudaEventDestroy(f.done);
      inFlight.clear();
    }
    return host->flush();
  }

  void fail(const std::string &why) override {
    // Every communicator: a peer may be blocked in a group's all-reduce.
    failed = true;
    for (auto &[group, c] : groups)
      if (c) {
        ncclCommAbort(c);
        c = nullptr;
      }
    if (world)
      ncclCommAbort(world);
    world = nullptr;
    host->fail(why);
  }

  /// Reports a failed init to every rank (they wait in MPI_Bcast or
  /// ncclCommInitRank otherwise).
  void failInit(const std::string &why) {
    failed = true;
    host->fail(why);
  }

private:
  /// A flat device tensor of \p count elements, allocated and freed in the
  /// communication stream's order.
  Expected<cpu::Tensor> deviceTensor(DType type, int64_t count) {
    void *memory = nullptr;
    size_t bytes = static_cast<size_t>(count) * cpu::storageSize(type);
    PIPEC_CUDA_TRY(cudaMallocAsync(&memory, std::max<size_t>(bytes, 1), stream.get()));
    return cpu::Tensor::onDevice(type, {count}, std::shared_ptr<void>(memory, bufferDeleter()),
                                 device);
  }

  /// Queues \p each (tensor, communicator) on every one of \p tensors as
  /// one NCCL group over \p group's communicator, and waits for them under
  /// the timeout. The sends queued before complete first, so that the
  /// collective does not wait behind a peer that is itself waiting for them.
  template <typename Each>
  Error collective(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors, const char *what,
                   Each each) {
    if (group.size() < 2 || tensors.empty())
      return Error::success();
    if (groupDepth > 0)
      return createStringError(inconvertibleErrorCode(), "rank %d: %s inside a send/receive group",
                               rank(), what);
    auto it = groups.find(std::vector<int>(group.begin(), group.end()));
    if (it == groups.end() || !it->second)
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: no NCCL communicator for a group", rank());
    for (const cpu::Tensor &t : tensors)
      if (t.onHost())
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: NCCL moves device tensors, not host %s", rank(),
                                 t.describe().c_str());
    PIPEC_CUDA_TRY(cudaSetDevice(device));
    if (Error err = drain("earlier sends and receives to complete"))
      return err;
    // The results replace the tensors once the group has run: it reads them
    // until then. (An in-place sum leaves its result null.)
    std::vector<cpu::Tensor> results(tensors.size());
    PIPEC_CUDA_TRY(ncclGroupStart());
    for (size_t i = 0; i < tensors.size(); ++i)
      if (Error err = each(tensors[i], results[i], it->second)) {
        ncclGroupEnd();
        return err;
      }
    PIPEC_CUDA_TRY(ncclGroupEnd());
    cudaEvent_t done;
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    Error err = cuda::statusError(cudaEventRecord(done, stream.get()), "cudaEventRecord", __FILE__,
                                  __LINE__);
    if (!err)
      err = poll(done, what, it->second);
    cudaEventDestroy(done);
    if (err)
      return err;
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!results[i].isNull())
        tensors[i] = std::move(results[i]);
    return Error::success();
  }

  struct Pending {
    cpu::Tensor tensor;
    cudaEvent_t done = nullptr;
    int peer = -1;
    /// Whether done is recorded after the receive (at the end of its group).
    bool recorded = false;
  };
  /// The sends of one group and an event after them.
  struct Flight {
    cudaEvent_t done;
    std::vector<cpu::Tensor> tensors;
  };

  /// Frees a buffer in the communication stream's order.
  std::function<void(void *)> bufferDeleter() const {
    SharedStream s = stream;
    return [s](void *p) { cudaFreeAsync(p, s.get()); };
  }

  /// After the operations posted since the last call are on the stream
  /// (outside a group, or at its end): records the receives' events and one
  /// for the sends, which stay referenced until it completes.
  Error enqueued() {
    for (int handle : openRecvs) {
      Pending &p = recvs.at(handle);
      PIPEC_CUDA_TRY(cudaEventRecord(p.done, stream.get()));
      p.recorded = true;
    }
    openRecvs.clear();
    if (!openSends.empty()) {
      Flight f;
      PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming));
      f.tensors = std::move(openSends);
      openSends.clear();
      Error err = cuda::statusError(cudaEventRecord(f.done, stream.get()), "cudaEventRecord",
                                    __FILE__, __LINE__);
      inFlight.push_back(std::move(f));
      if (err)
        return err;
    }
    retireSends();
    return Error::success();
  }

  /// Drops the sends that have completed, in order.
  void retireSends() {
    while (!inFlight.empty()) {
      if (cudaEventQuery(inFlight.front().done) != cudaSuccess) {
        cudaGetLastError(); // not ready: no error for the next CUDA call
        break;
      }
      cudaEventDestroy(inFlight.front().done);
      inFlight.pop_front();
    }
  }

  /// Waits, under the timeout, for everything queued on the stream so far.
  Error drain(const std::string &what) {
    cudaEvent_t done;
    PIPEC_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    Error err = cuda::statusError(cudaEventRecord(done, stream.get()), "cudaEventRecord", __FILE__,
                                  __LINE__);
    if (!err)
      err = poll(done, what, world);
    cudaEventDestroy(done);
    if (!err)
      retireSends();
    return err;
  }

  Error poll(cudaEvent_t event, const std::string &what, ncclComm_t comm) {
    auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(1);
    while (true) {
      cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess)
        return Error::success();
      if (status != cudaErrorNotReady)
        PIPEC_CUDA_TRY(status);
      // Not an error, but left as the thread's last one: the backend's next
      // kernel launch on this thread would report it as its own.
      cudaGetLastError();
      for (ncclComm_t c : {comm, world}) {
        ncclResult_t async = ncclSuccess;
        if (c && ncclCommGetAsyncError(c, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress)
          PIPEC_CUDA_TRY(async);
      }
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
  SharedStream stream, copyStream;
  ncclComm_t world = nullptr;
  std::map<std::vector<int>, ncclComm_t> groups;
  std::map<int, Pending> recvs;
  /// ncclGroupStart depth, and what the open group posted.
  int groupDepth = 0;
  std::vector<int> openRecvs;
  std::vector<cpu::Tensor> openSends;
  std::deque<Flight> inFlight;
  int next = 0;
  bool failed = false;
};

} // namespace
} // namespace pipec::rt

/// The plugin's entry point (see runtime/core/CpuBackend.cpp): takes
/// ownership of \p bootstrap; null and \p error on failure, after reporting
/// it through \p bootstrap's fail() (under MPI that stops the job: the other
/// ranks are blocked in the collective setup, and the caller no longer has
/// the bootstrap to tell them).
extern "C" __attribute__((visibility("default"))) pipec::rt::Comm *
pipecMakeNcclComm(pipec::rt::Comm *bootstrap, int device, double timeout, std::string *error) {
  auto comm = std::make_unique<pipec::rt::NcclComm>(std::unique_ptr<pipec::rt::Comm>(bootstrap),
                                                    device, timeout);
  if (llvm::Error err = comm->init()) {
    std::string text = llvm::toString(std::move(err));
    // The other ranks wait for this one in collective calls: under MPI the
    // job stops here, naming the reason.
    comm->failInit(llvm::formatv("rank {0}: --comm nccl: {1}", comm->rank(), text).str());
    *error = text;
    return nullptr;
  }
  return comm.release();
}
