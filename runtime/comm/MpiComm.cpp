//===- MpiComm.cpp - One process per rank, over MPI ---------------------===//
#include "runtime/comm/Comm.h"

#include "llvm/Support/FormatVariadic.h"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

using namespace llvm;

namespace pipec::rt {

namespace {

Error mpiError(int code, const Twine &what) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return createStringError(inconvertibleErrorCode(), "%s: MPI error: %s", what.str().c_str(),
                           std::string(text, length).c_str());
}

#define PIPEC_MPI_TRY(call, what)                                                                  \
  do {                                                                                             \
    int code_ = (call);                                                                            \
    if (code_ != MPI_SUCCESS)                                                                      \
      return mpiError(code_, what);                                                                \
  } while (false)

/// An MPI type of \p type's storage size, so that a tensor travels as
/// whole elements (half types are stored as float).
MPI_Datatype storageWord(cpu::DType type) {
  switch (cpu::storageSize(type)) {
  case 8:
    return MPI_UINT64_T;
  case 4:
    return MPI_UINT32_T;
  case 2:
    return MPI_UINT16_T;
  default:
    return MPI_BYTE;
  }
}

class MpiComm final : public Comm {
public:
  MpiComm(double timeout) : timeout(timeout) {
    MPI_Comm_rank(MPI_COMM_WORLD, &self);
    MPI_Comm_size(MPI_COMM_WORLD, &count);
    // Every rank's node, so that an error can name where a lost peer ran.
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(name, &length);
    std::vector<char> all(static_cast<size_t>(count) * MPI_MAX_PROCESSOR_NAME, 0);
    MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                  MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 0; r < count; ++r)
      nodes.emplace_back(all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME);
  }
  ~MpiComm() override {
    consumeError(flush());
    for (auto &[group, comm] : comms)
      if (comm != MPI_COMM_NULL)
        MPI_Comm_free(&comm);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
      MPI_Finalize();
  }
  int rank() const override { return self; }
  int size() const override { return count; }
  std::string nodeOf(int rank) const override {
    return rank >= 0 && rank < count ? nodes[rank] : std::string();
  }

  Error send(int peer, const cpu::Tensor &tensor) override {
    if (tensor.byteSize() > static_cast<size_t>(INT_MAX))
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: a message of %zu bytes is over MPI's 2 GiB count", self,
                               tensor.byteSize());
    sends.push_back({MPI_REQUEST_NULL, tensor});
    Message &m = sends.back();
    PIPEC_MPI_TRY(MPI_Isend(const_cast<void *>(m.tensor.rawData()),
                            static_cast<int>(m.tensor.byteSize()), MPI_BYTE, peer, 0,
                            MPI_COMM_WORLD, &m.request),
                  formatv("rank {0}: send to rank {1}", self, peer));
    // Retire completed sends so their tensors can go.
    while (!sends.empty()) {
      int done = 0;
      PIPEC_MPI_TRY(MPI_Test(&sends.front().request, &done, MPI_STATUS_IGNORE),
                    formatv("rank {0}: send", self));
      if (!done)
        break;
      sends.pop_front();
    }
    return Error::success();
  }

  Expected<int> postRecv(int peer, DType type, std::vector<int64_t> shape) override {
    cpu::Tensor tensor(type, std::move(shape));
    if (tensor.byteSize() > static_cast<size_t>(INT_MAX))
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: a message of %zu bytes is over MPI's 2 GiB count", self,
                               tensor.byteSize());
    int handle = nextHandle++;
    Message &m = recvs[handle];
    m.tensor = std::move(tensor);
    m.peer = peer;
    PIPEC_MPI_TRY(MPI_Irecv(m.tensor.rawData(), static_cast<int>(m.tensor.byteSize()), MPI_BYTE,
                            peer, 0, MPI_COMM_WORLD, &m.request),
                  formatv("rank {0}: receive from rank {1}", self, peer));
    return handle;
  }

  Expected<cpu::Tensor> wait(int handle) override {
    auto it = recvs.find(handle);
    if (it == recvs.end())
      return createStringError(inconvertibleErrorCode(), "rank %d: no receive %d", self, handle);
    Message &m = it->second;
    MPI_Status status;
    if (Error err = poll(m.request, &status, "a message from " + who(m.peer), {m.peer}))
      return err;
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    if (static_cast<size_t>(received) != m.tensor.byteSize())
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: rank %d sent %d bytes, expected %s (%zu bytes)", self,
                               m.peer, received, m.tensor.describe().c_str(), m.tensor.byteSize());
    cpu::Tensor out = std::move(m.tensor);
    recvs.erase(it);
    return out;
  }

  Error prepareGroups(const std::vector<std::vector<int>> &groups) override {
    for (const std::vector<int> &group : groups) {
      if (group.size() < 2 || comms.count(group))
        continue;
      bool member = std::find(group.begin(), group.end(), self) != group.end();
      MPI_Comm comm = MPI_COMM_NULL;
      PIPEC_MPI_TRY(MPI_Comm_split(MPI_COMM_WORLD, member ? 0 : MPI_UNDEFINED, self, &comm),
                    formatv("rank {0}: making a communicator", self));
      comms[group] = comm;
    }
    return Error::success();
  }

  /// The communicator prepareGroups made for \p group.
  Expected<MPI_Comm> communicator(ArrayRef<int> group) {
    auto it = comms.find(std::vector<int>(group.begin(), group.end()));
    if (it == comms.end() || it->second == MPI_COMM_NULL)
      return createStringError(inconvertibleErrorCode(), "rank %d: no communicator for a group",
                               self);
    return it->second;
  }

  Error sum(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    if (group.size() < 2 || tensors.empty())
      return Error::success();
    auto comm = communicator(group);
    if (!comm)
      return comm.takeError();
    bool isDouble = tensors[0].elemType() == cpu::DType::F64;
    for (const cpu::Tensor &t : tensors)
      if (t.elemType() != tensors[0].elemType() ||
          (t.elemType() != cpu::DType::F32 && t.elemType() != cpu::DType::F64))
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: a sum needs float32 or float64 tensors of one type, "
                                 "got %s and %s",
                                 self, tensors[0].describe().c_str(), t.describe().c_str());
    size_t elementSize = isDouble ? sizeof(double) : sizeof(float);
    size_t total = 0;
    for (const cpu::Tensor &t : tensors)
      total += static_cast<size_t>(t.numElements());
    // One fused buffer, reduced in pieces below INT_MAX elements.
    std::vector<char> buffer(total * elementSize);
    size_t at = 0;
    for (const cpu::Tensor &t : tensors) {
      std::memcpy(buffer.data() + at, t.rawData(), t.byteSize());
      at += t.byteSize();
    }
    for (size_t start = 0; start < total; start += INT_MAX / 2) {
      int n = static_cast<int>(std::min<size_t>(INT_MAX / 2, total - start));
      MPI_Request request;
      PIPEC_MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, buffer.data() + start * elementSize, n,
                                   isDouble ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM, *comm, &request),
                    formatv("rank {0}: all-reduce", self));
      if (Error err = poll(request, MPI_STATUS_IGNORE, "an all-reduce of " + members(group), group))
        return err;
    }
    at = 0;
    for (cpu::Tensor &t : tensors) {
      cpu::Tensor fresh(t.elemType(), t.shape());
      std::memcpy(fresh.rawData(), buffer.data() + at, fresh.byteSize());
      at += fresh.byteSize();
      t = std::move(fresh);
    }
    return Error::success();
  }

  Error reduceScatter(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    int n = static_cast<int>(group.size());
    return eachTensor(
        group, tensors, "a reduce-scatter",
        [&](const cpu::Tensor &t, MPI_Comm comm, MPI_Request &request) -> Expected<cpu::Tensor> {
          bool isDouble = t.elemType() == cpu::DType::F64;
          if ((!isDouble && t.elemType() != cpu::DType::F32) || t.numElements() % n != 0 ||
              t.numElements() / n > INT_MAX)
            return createStringError(
                inconvertibleErrorCode(),
                "rank %d: a reduce-scatter over %d ranks needs float tensors of a "
                "multiple of %d elements, at most INT_MAX each, got %s",
                self, n, n, t.describe().c_str());
          int block = static_cast<int>(t.numElements() / n);
          cpu::Tensor mine(t.elemType(), {block});
          PIPEC_MPI_TRY(MPI_Ireduce_scatter_block(t.rawData(), mine.rawData(), block,
                                                  isDouble ? MPI_DOUBLE : MPI_FLOAT, MPI_SUM, comm,
                                                  &request),
                        formatv("rank {0}: reduce-scatter", self));
          return mine;
        });
  }

  Error allGather(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    int n = static_cast<int>(group.size());
    return eachTensor(
        group, tensors, "an all-gather",
        [&](const cpu::Tensor &t, MPI_Comm comm, MPI_Request &request) -> Expected<cpu::Tensor> {
          if (t.numElements() > INT_MAX)
            return createStringError(inconvertibleErrorCode(),
                                     "rank %d: an all-gather of %s is over MPI's INT_MAX count",
                                     self, t.describe().c_str());
          int count = static_cast<int>(t.numElements());
          MPI_Datatype word = storageWord(t.elemType());
          cpu::Tensor all(t.elemType(), {t.numElements() * n});
          PIPEC_MPI_TRY(
              MPI_Iallgather(t.rawData(), count, word, all.rawData(), count, word, comm, &request),
              formatv("rank {0}: all-gather", self));
          return all;
        });
  }

  /// Runs \p start (tensor, communicator, request), which returns the
  /// result tensor, on each of \p tensors over \p group, waits for its
  /// request under the timeout, and then replaces the tensor by the result
  /// (the request reads the tensor until it completes).
  template <typename Start>
  Error eachTensor(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors, const char *what,
                   Start start) {
    if (group.size() < 2 || tensors.empty())
      return Error::success();
    auto comm = communicator(group);
    if (!comm)
      return comm.takeError();
    for (cpu::Tensor &t : tensors) {
      MPI_Request request;
      Expected<cpu::Tensor> out = start(t, *comm, request);
      if (!out)
        return out.takeError();
      if (Error err =
              poll(request, MPI_STATUS_IGNORE, std::string(what) + " of " + members(group), group))
        return err;
      t = std::move(*out);
    }
    return Error::success();
  }

  Error sumAll(MutableArrayRef<double> values) override {
    MPI_Request request;
    PIPEC_MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                                 MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD, &request),
                  formatv("rank {0}: all-reduce", self));
    if (Error err = poll(request, MPI_STATUS_IGNORE, "a sum over " + everyone(), allRanks()))
      return err;
    return Error::success();
  }

  Expected<std::vector<std::string>> gather(const std::string &bytes) override {
    if (bytes.size() > static_cast<size_t>(INT_MAX))
      return createStringError(inconvertibleErrorCode(),
                               "rank %d: %zu bytes to gather, over MPI's 2 GiB count", self,
                               bytes.size());
    int mine = static_cast<int>(bytes.size());
    std::vector<int> sizes(self == 0 ? count : 0), offsets;
    MPI_Request request;
    PIPEC_MPI_TRY(
        MPI_Igather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD, &request),
        formatv("rank {0}: gather", self));
    if (Error err = poll(request, MPI_STATUS_IGNORE, "a gather of " + everyone(), allRanks()))
      return err;
    std::vector<char> all;
    if (self == 0) {
      int64_t total = 0;
      for (int s : sizes) {
        offsets.push_back(static_cast<int>(total));
        total += s;
      }
      if (total > INT_MAX)
        return createStringError(inconvertibleErrorCode(),
                                 "gathering %lld bytes at rank 0 is over MPI's 2 GiB count",
                                 static_cast<long long>(total));
      all.resize(total);
    }
    PIPEC_MPI_TRY(MPI_Igatherv(bytes.data(), mine, MPI_BYTE, all.data(), sizes.data(),
                               offsets.data(), MPI_BYTE, 0, MPI_COMM_WORLD, &request),
                  formatv("rank {0}: gather", self));
    if (Error err = poll(request, MPI_STATUS_IGNORE, "a gather of " + everyone(), allRanks()))
      return err;
    std::vector<std::string> out;
    for (int r = 0; self == 0 && r < count; ++r)
      out.emplace_back(all.data() + offsets[r], sizes[r]);
    return out;
  }

  Error flush() override {
    while (!sends.empty()) {
      if (Error err = poll(sends.front().request, MPI_STATUS_IGNORE, "a send to complete", {}))
        return err;
      sends.pop_front();
    }
    return Error::success();
  }

  void fail(const std::string &why) override {
    // The job cannot go on without this rank: mpirun names it to the user and
    // stops the others.
    fprintf(stderr, "pipec: error: %s\n", why.c_str());
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

private:
  struct Message {
    MPI_Request request = MPI_REQUEST_NULL;
    cpu::Tensor tensor;
    int peer = -1;
  };

  /// Waits for \p request, polling so that a stuck peer turns into an error
  /// after the timeout instead of a hang. Meanwhile it answers other ranks'
  /// pings; after the timeout it pings \p peers (those it waits for) and
  /// names the ones that do not answer: stopped, dead, or cut off.
  Error poll(MPI_Request &request, MPI_Status *status, const std::string &what,
             const std::vector<int> &peers) {
    auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::microseconds(1);
    bool extended = false;
    while (true) {
      int done = 0;
      PIPEC_MPI_TRY(MPI_Test(&request, &done, status), formatv("rank {0}: waiting", self));
      if (done)
        return Error::success();
      answerPings();
      double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout * (extended ? 2 : 1)) {
        std::string silent = silentPeers(peers);
        // Peers that answer wait for someone else: the rank that waits for
        // the one that does not is the one to say so. This one waits a
        // second timeout first (a deadlock among live ranks ends then).
        if (!extended && !silent.empty() && silent.find("not answer") == std::string::npos) {
          extended = true;
          continue;
        }
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: no progress for %.0f s waiting for %s%s", self,
                                 timeout * (extended ? 2 : 1), what.c_str(), silent.c_str());
      }
      // Backing off to at most 100 us: a message that arrives is seen
      // within that, where a longer sleep would delay the critical path.
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(100));
    }
  }

  /// Tags of the pings a waiting rank sends after its timeout, and their
  /// answers (the plan's messages use tag 0).
  static constexpr int PingTag = 7, PongTag = 8;

  /// Answers the pings that have arrived.
  void answerPings() {
    while (true) {
      int arrived = 0;
      MPI_Status status;
      if (MPI_Iprobe(MPI_ANY_SOURCE, PingTag, MPI_COMM_WORLD, &arrived, &status) != MPI_SUCCESS ||
          !arrived)
        return;
      MPI_Recv(nullptr, 0, MPI_BYTE, status.MPI_SOURCE, PingTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Request reply;
      if (MPI_Isend(nullptr, 0, MPI_BYTE, status.MPI_SOURCE, PongTag, MPI_COMM_WORLD, &reply) ==
          MPI_SUCCESS)
        MPI_Request_free(&reply);
    }
  }

  /// "; rank 5 (on node2) does not answer": which of \p peers do not answer
  /// a ping within a few seconds (while this rank answers theirs); "" when
  /// all do, or there are none to ask.
  std::string silentPeers(const std::vector<int> &peers) {
    std::vector<int> asked;
    std::vector<MPI_Request> replies;
    for (int peer : peers) {
      if (peer == self || peer < 0 || peer >= count)
        continue;
      MPI_Request ping, reply;
      if (MPI_Isend(nullptr, 0, MPI_BYTE, peer, PingTag, MPI_COMM_WORLD, &ping) != MPI_SUCCESS ||
          MPI_Irecv(nullptr, 0, MPI_BYTE, peer, PongTag, MPI_COMM_WORLD, &reply) != MPI_SUCCESS)
        continue;
      MPI_Request_free(&ping);
      asked.push_back(peer);
      replies.push_back(reply);
    }
    if (asked.empty())
      return "";
    std::vector<bool> answered(asked.size(), false);
    auto start = std::chrono::steady_clock::now();
    double window = std::min(3.0, timeout);
    size_t missing = asked.size();
    while (missing > 0 &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
               window) {
      for (size_t i = 0; i < asked.size(); ++i) {
        int done = 0;
        if (!answered[i] && MPI_Test(&replies[i], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
            done) {
          answered[i] = true;
          --missing;
        }
      }
      answerPings();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string silent;
    int quiet = 0;
    for (size_t i = 0; i < asked.size(); ++i) {
      if (answered[i])
        continue;
      MPI_Cancel(&replies[i]);
      MPI_Request_free(&replies[i]);
      silent += (silent.empty() ? "" : ", ") + who(asked[i]);
      ++quiet;
    }
    if (quiet == 0)
      return asked.size() == 1 ? "; it answers a ping (it waits for another rank)"
                               : "; every one of them answers a ping (each waits for another)";
    return "; " + silent + (quiet == 1 ? " does" : " do") + " not answer";
  }

  /// Every rank, in order.
  std::vector<int> allRanks() const {
    std::vector<int> ranks(count);
    for (int r = 0; r < count; ++r)
      ranks[r] = r;
    return ranks;
  }

  /// "rank R (on NODE)".
  std::string who(int rank) const { return formatv("rank {0} (on {1})", rank, nodeOf(rank)).str(); }
  /// "all 8 ranks (on node0, node1, node2)".
  std::string everyone() const {
    std::string named = members(allRanks());
    return formatv("all {0} ranks{1}", count, named.substr(named.find(" (on"))).str();
  }
  /// "ranks 1, 3 (on node0, node1)": a group and its nodes.
  std::string members(ArrayRef<int> group) const {
    std::string ranks, where;
    std::set<std::string> seen;
    for (int r : group) {
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      if (seen.insert(nodeOf(r)).second)
        where += (where.empty() ? "" : ", ") + nodeOf(r);
    }
    return "ranks " + ranks + " (on " + where + ")";
  }

  double timeout;
  std::vector<std::string> nodes;
  int self = 0, count = 1, nextHandle = 0;
  std::deque<Message> sends;
  std::map<int, Message> recvs;
  std::map<std::vector<int>, MPI_Comm> comms;
};

} // namespace

Expected<std::unique_ptr<Comm>> makeMpiComm(double timeoutSeconds) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (code != MPI_SUCCESS)
      return mpiError(code, "MPI_Init_thread");
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return std::make_unique<MpiComm>(timeoutSeconds);
}

} // namespace pipec::rt
