//===- LocalComm.cpp - Ranks as threads of one process ------------------===//
#include "runtime/comm/Comm.h"

#include "llvm/Support/FormatVariadic.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>

using namespace llvm;

namespace pipec::rt {

namespace {
using Clock = std::chrono::steady_clock;
constexpr auto Poll = std::chrono::milliseconds(50);
} // namespace

struct LocalWorld::State {
  int size;
  double timeout;
  std::mutex mutex;
  std::condition_variable changed;
  int failedRank = -1;
  std::string failure;
  /// Messages from src to dst, numbered in send order.
  struct Channel {
    uint64_t sent = 0, posted = 0;
    std::map<uint64_t, cpu::Tensor> messages;
  };
  std::map<std::pair<int, int>, Channel> channels;
  /// One collective in flight per group: members deposit, then each reads
  /// every part; the slot resets when all have read.
  struct Slot {
    int arrived = 0, done = 0;
    std::vector<std::vector<cpu::Tensor>> parts;
    std::vector<std::string> strings;
  };
  std::map<std::vector<int>, Slot> slots;

  /// Waits under \p lock until \p ready; fails when a rank failed or
  /// nothing happened for the timeout. \p what says what rank \p self waits
  /// for.
  template <typename Ready>
  Error waitFor(std::unique_lock<std::mutex> &lock, int self, const std::string &what,
                Ready ready) {
    auto start = Clock::now();
    while (!ready()) {
      if (failedRank >= 0)
        return createStringError(inconvertibleErrorCode(), "rank %d failed: %s", failedRank,
                                 failure.c_str());
      if (std::chrono::duration<double>(Clock::now() - start).count() > timeout)
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: no progress for %.0f s waiting for %s", self, timeout,
                                 what.c_str());
      changed.wait_for(lock, Poll);
    }
    return Error::success();
  }
};

namespace {

class LocalComm final : public Comm {
public:
  LocalComm(std::shared_ptr<LocalWorld::State> state, int self)
      : state(std::move(state)), self(self) {}
  int rank() const override { return self; }
  int size() const override { return state->size; }

  Error send(int peer, const cpu::Tensor &tensor) override {
    std::lock_guard<std::mutex> lock(state->mutex);
    auto &channel = state->channels[{self, peer}];
    channel.messages.emplace(channel.sent++, tensor);
    state->changed.notify_all();
    return Error::success();
  }

  Expected<int> postRecv(int peer, DType type, std::vector<int64_t> shape) override {
    std::lock_guard<std::mutex> lock(state->mutex);
    auto &channel = state->channels[{peer, self}];
    int handle = next++;
    pending.emplace(handle, Pending{peer, channel.posted++, type, std::move(shape)});
    return handle;
  }

  Expected<cpu::Tensor> wait(int handle) override {
    auto found = pending.find(handle);
    if (found == pending.end())
      return createStringError(inconvertibleErrorCode(), "rank %d: no receive %d", self, handle);
    Pending p = std::move(found->second);
    pending.erase(found);
    std::unique_lock<std::mutex> lock(state->mutex);
    auto &channel = state->channels[{p.peer, self}];
    if (Error err = state->waitFor(lock, self, formatv("a message from rank {0}", p.peer).str(),
                                   [&] { return channel.messages.count(p.sequence) > 0; }))
      return err;
    auto it = channel.messages.find(p.sequence);
    cpu::Tensor tensor = std::move(it->second);
    channel.messages.erase(it);
    if (tensor.elemType() != p.type || tensor.shape() != p.shape)
      return createStringError(
          inconvertibleErrorCode(), "rank %d: message %llu from rank %d is %s, expected %s[%s]",
          self, static_cast<unsigned long long>(p.sequence), p.peer, tensor.describe().c_str(),
          cpu::elemTypeName(p.type).str().c_str(), cpu::shapeString(p.shape).c_str());
    return tensor;
  }

  Error prepareGroups(const std::vector<std::vector<int>> &) override { return Error::success(); }

  Error sum(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    // Every member adds the parts in member order: the same bits on all.
    return eachTensor(group, tensors, [&](State::Slot &slot, size_t t) {
      cpu::Tensor total = slot.parts[0][t].clone();
      for (size_t m = 1; m < slot.parts.size(); ++m)
        addInto(total, slot.parts[m][t]);
      return total;
    });
  }

  Error reduceScatter(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    if (group.size() < 2)
      return Error::success();
    int64_t n = static_cast<int64_t>(group.size());
    size_t index = std::find(group.begin(), group.end(), self) - group.begin();
    for (const cpu::Tensor &t : tensors)
      if ((t.elemType() != cpu::DType::F32 && t.elemType() != cpu::DType::F64) ||
          t.numElements() % n != 0)
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: a reduce-scatter over %lld ranks needs float tensors of "
                                 "a multiple of %lld elements, got %s",
                                 self, static_cast<long long>(n), static_cast<long long>(n),
                                 t.describe().c_str());
    // This member's block, added in member order as sum() adds.
    return eachTensor(group, tensors, [&](State::Slot &slot, size_t t) {
      const cpu::Tensor &first = slot.parts[0][t];
      int64_t c = first.numElements() / n;
      size_t width = cpu::storageSize(first.elemType());
      cpu::Tensor total(first.elemType(), {c});
      std::memcpy(total.rawData(), static_cast<const char *>(first.rawData()) + index * c * width,
                  c * width);
      for (size_t m = 1; m < slot.parts.size(); ++m) {
        const cpu::Tensor &part = slot.parts[m][t];
        addInto(total, part.elemType() == cpu::DType::F64
                           ? static_cast<const void *>(part.data<double>() + index * c)
                           : static_cast<const void *>(part.data<float>() + index * c));
      }
      return total;
    });
  }

  Error allGather(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors) override {
    return eachTensor(group, tensors, [&](State::Slot &slot, size_t t) {
      const cpu::Tensor &first = slot.parts[0][t];
      size_t bytes = first.byteSize();
      cpu::Tensor all(first.elemType(), {first.numElements() * static_cast<int64_t>(group.size())});
      for (size_t m = 0; m < slot.parts.size(); ++m)
        std::memcpy(static_cast<char *>(all.rawData()) + m * bytes, slot.parts[m][t].rawData(),
                    bytes);
      return all;
    });
  }

  Error sumAll(MutableArrayRef<double> values) override {
    std::vector<int> all = allRanks();
    if (all.size() < 2)
      return Error::success();
    cpu::Tensor t = cpu::Tensor::fromValues<double>({static_cast<int64_t>(values.size())},
                                                    ArrayRef<double>(values.data(), values.size()));
    std::vector<cpu::Tensor> one{t};
    if (Error err = sum(all, one))
      return err;
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = one[0].data<double>()[i];
    return Error::success();
  }

  Expected<std::vector<std::string>> gather(const std::string &bytes) override {
    std::vector<int> all = allRanks();
    std::vector<std::string> out;
    if (Error err = collective(all, {}, bytes, [&](State::Slot &slot) {
          if (self == 0)
            out = slot.strings;
        }))
      return err;
    return out;
  }

  Error flush() override { return Error::success(); }
  bool devicePointToPoint() const override { return true; }

  void fail(const std::string &why) override {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (state->failedRank < 0) {
      state->failedRank = self;
      state->failure = why;
    }
    state->changed.notify_all();
  }

private:
  using State = LocalWorld::State;
  struct Pending {
    int peer;
    uint64_t sequence;
    DType type;
    std::vector<int64_t> shape;
  };

  /// Ranks 0 to size - 1: the group of sumAll and gather.
  std::vector<int> allRanks() const {
    std::vector<int> all(state->size);
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  /// \p total += the first numElements() elements of \p part, of its type.
  static void addInto(cpu::Tensor &total, const void *part) {
    if (total.elemType() == cpu::DType::F64) {
      double *t = total.data<double>();
      const double *p = static_cast<const double *>(part);
      for (int64_t i = 0; i < total.numElements(); ++i)
        t[i] += p[i];
    } else {
      float *t = total.data<float>();
      const float *p = static_cast<const float *>(part);
      for (int64_t i = 0; i < total.numElements(); ++i)
        t[i] += p[i];
    }
  }
  static void addInto(cpu::Tensor &total, const cpu::Tensor &part) {
    addInto(total, part.rawData());
  }

  /// Exchanges \p tensors over \p group (nothing to do for fewer than two
  /// members), then replaces each tensors[t] by \p combine(slot, t), which
  /// reads every member's tensor t in slot.parts (member order).
  template <typename Combine>
  Error eachTensor(ArrayRef<int> group, MutableArrayRef<cpu::Tensor> tensors, Combine combine) {
    if (group.size() < 2)
      return Error::success();
    std::vector<cpu::Tensor> mine(tensors.begin(), tensors.end());
    return collective(group, std::move(mine), "", [&](State::Slot &slot) {
      for (size_t t = 0; t < tensors.size(); ++t)
        tensors[t] = combine(slot, t);
    });
  }

  template <typename Read>
  Error collective(ArrayRef<int> group, std::vector<cpu::Tensor> parts, const std::string &bytes,
                   Read read) {
    std::vector<int> key(group.begin(), group.end());
    size_t index = std::find(key.begin(), key.end(), self) - key.begin();
    if (index == key.size())
      return createStringError(inconvertibleErrorCode(), "rank %d is not in its sum group", self);
    std::unique_lock<std::mutex> lock(state->mutex);
    State::Slot &slot = state->slots[key];
    std::string what = "a collective of ranks";
    for (int r : key)
      what += " " + std::to_string(r);
    // A slot still being read by the last round is not ours yet.
    if (Error err = state->waitFor(lock, self, what, [&] { return slot.done == 0; }))
      return err;
    if (slot.arrived == 0) {
      slot.parts.assign(key.size(), {});
      slot.strings.assign(key.size(), {});
    }
    slot.parts[index] = std::move(parts);
    slot.strings[index] = bytes;
    ++slot.arrived;
    state->changed.notify_all();
    if (Error err = state->waitFor(lock, self, what,
                                   [&] { return slot.arrived == static_cast<int>(key.size()); }))
      return err;
    for (auto &p : slot.parts)
      if (p.size() != slot.parts[index].size())
        return createStringError(inconvertibleErrorCode(),
                                 "rank %d: members of a sum disagree on its tensors", self);
    read(slot);
    if (++slot.done == static_cast<int>(key.size())) {
      slot.arrived = 0;
      slot.done = 0;
      slot.parts.clear();
      slot.strings.clear();
    }
    state->changed.notify_all();
    return Error::success();
  }

  std::shared_ptr<State> state;
  int self;
  std::map<int, Pending> pending; ///< posted, not yet waited for
  int next = 0;
};

} // namespace

LocalWorld::LocalWorld(int size, double timeoutSeconds) : state(std::make_shared<State>()) {
  state->size = size;
  state->timeout = timeoutSeconds;
}

LocalWorld::~LocalWorld() = default;

std::unique_ptr<Comm> LocalWorld::comm(int rank) {
  return std::make_unique<LocalComm>(state, rank);
}

} // namespace pipec::rt
