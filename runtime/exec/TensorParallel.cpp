//===- TensorParallel.cpp - A rank's tensor-parallel group --------------===//
//
// --tp T: the ranks that split one stage's tensors (RankGrid) sum the
// partial products of their split matrix products (TpAllReduce nodes) and,
// at the end of a run that keeps its weights, join their pieces of the
// split weights (TensorShards.h) into the whole tensors.
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/TensorShards.h"

#include "llvm/Support/FormatVariadic.h"

#include <cstring>

using namespace llvm;

namespace pipec::rt {

std::vector<int> RankExecutor::tpGroup() const {
  std::vector<int> group;
  for (int t = 0; t < s.grid.T; ++t)
    group.push_back(s.grid.global(replica, rank, t));
  return group;
}

Expected<cpu::Tensor> RankExecutor::sumOverTp(const cpu::Tensor &input) {
  // A fresh copy: the transports may sum in place.
  auto sum = be.sum({&input});
  if (!sum)
    return sum.takeError();
  if (Error err = sumOver(tpGroup(), {&*sum}))
    return std::move(err);
  return sum;
}

Expected<cpu::Tensor> RankExecutor::joinOverTp(const cpu::Tensor &piece,
                                               const plan::WeightShard &shard) {
  auto host = be.download(piece);
  if (!host)
    return host.takeError();
  int64_t n = host->numElements();
  std::vector<cpu::Tensor> one{host->clone().reshaped({n})};
  if (comm.deviceSums()) {
    auto placed = be.upload(one[0]);
    if (!placed)
      return placed.takeError();
    one[0] = std::move(*placed);
    if (Error err = be.synchronize())
      return std::move(err);
  }
  if (Error err = comm.allGather(tpGroup(), one))
    return std::move(err);
  auto all = be.download(one[0]);
  if (!all)
    return all.takeError();
  std::vector<cpu::Tensor> pieces;
  size_t bytes = host->byteSize();
  for (int t = 0; t < s.grid.T; ++t) {
    cpu::Tensor p = cpu::Tensor::uninitialized(host->elemType(), host->shape());
    std::memcpy(p.rawData(), static_cast<const char *>(all->rawData()) + t * bytes, bytes);
    pieces.push_back(std::move(p));
  }
  return joinShards(pieces, shard);
}

Error RankExecutor::joinSplitWeights() {
  for (const std::string &name : trainableHere)
    if (auto shard = s.shards.find(name); shard != s.shards.end()) {
      auto whole = joinOverTp(weights[name], *shard->second);
      if (!whole)
        return rankError(global, formatv("joining '{0}': {1}", name, toString(whole.takeError())));
      joinedWeights[name] = std::move(*whole);
    }
  for (auto &[name, g] : lastGrads)
    if (auto shard = s.shards.find(name); shard != s.shards.end()) {
      auto whole = joinOverTp(g, *shard->second);
      if (!whole)
        return rankError(global, formatv("joining the gradient of '{0}': {1}", name,
                                         toString(whole.takeError())));
      g = std::move(*whole);
    }
  return Error::success();
}

} // namespace pipec::rt
