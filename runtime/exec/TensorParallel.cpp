//===- TensorParallel.cpp - A rank's tensor-parallel group --------------===//
//
// --tp T: the ranks that split one stage's tensors (RankGrid) sum the
// partial products of their split matrix products (TpAllReduce nodes),
// compute the vocabulary-parallel loss and its gradient over their shares of
// the classes (TpSoftmaxCrossEntropyLoss, Megatron-LM's: the rows' maximum,
// sum of exponentials and target logit reduced over the ranks) and, at the
// end of a run that keeps its weights, join their pieces of the split
// weights (TensorShards.h) into the whole tensors.
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/RankExecutor.h"
#include "runtime/exec/TensorShards.h"

#include "support/Attributes.h"
#include "support/Diagnostics.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
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
    return err;
  return sum;
}

Error RankExecutor::sumSequenceGrads() {
  std::vector<cpu::Tensor *> sums;
  for (const std::string &name : trainableHere)
    if (s.sequenceGrads.count(name))
      sums.push_back(&grads[name]);
  return sums.empty() ? Error::success() : sumOver(tpGroup(), sums);
}

Expected<cpu::Tensor> RankExecutor::gatherOverTp(const cpu::Tensor &host) {
  int64_t n = host.numElements();
  std::vector<cpu::Tensor> one{host.clone().reshaped({n})};
  if (comm.deviceSums()) {
    auto placed = be.upload(one[0]);
    if (!placed)
      return placed.takeError();
    one[0] = std::move(*placed);
    if (Error err = be.synchronize())
      return std::move(err);
  }
  if (Error err = comm.allGather(tpGroup(), one))
    return err;
  return be.download(one[0]);
}

Expected<cpu::Tensor> RankExecutor::joinOverTp(const cpu::Tensor &piece,
                                               const plan::WeightShard &shard) {
  auto host = be.download(piece);
  if (!host)
    return host.takeError();
  auto all = gatherOverTp(*host);
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

namespace {

/// One rank's rows of a vocabulary-parallel loss: its share of the classes
/// of each row (scores [rows, classes / T], in double), the rows' labels
/// over all classes, and which of them count.
struct VocabRows {
  int64_t rows = 0, classes = 0, offset = 0;
  std::vector<double> scores;
  std::vector<int64_t> labels;
  bool hasIgnore = false, mean = true;
  int64_t ignore = 0;
  bool counts(int64_t i) const { return !(hasIgnore && labels[i] == ignore); }
  /// The label's class among this rank's, or -1.
  int64_t local(int64_t i) const {
    int64_t j = labels[i] - offset;
    return counts(i) && j >= 0 && j < classes ? j : -1;
  }
};

Expected<VocabRows> vocabRows(const onnx::NodeProto &node, const cpu::Tensor &scores,
                              const cpu::Tensor &labels, int tp, int parts) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s",
                             nodeLabel(node).c_str(), node.op_type().c_str(), why.str().c_str());
  };
  if (scores.rank() != 2 || !cpu::isFloating(scores.elemType()))
    return fail("expects float scores [rows, classes], got " + scores.describe());
  VocabRows v;
  v.rows = scores.dim(0);
  v.classes = scores.dim(1);
  v.offset = tp * v.classes;
  if (labels.numElements() != v.rows)
    return fail("labels " + labels.describe() + " do not match scores " + scores.describe());
  v.labels = labels.toInt64Vector();
  if (const auto *ignore = findAttr(node, "ignore_index")) {
    v.hasIgnore = true;
    v.ignore = ignore->i();
  }
  v.mean = attrString(node, "reduction", "mean") == "mean";
  for (int64_t i = 0; i < v.rows; ++i)
    if (v.counts(i) && (v.labels[i] < 0 || v.labels[i] >= v.classes * parts))
      return fail(formatv("label {0} out of range [0, {1})", v.labels[i], v.classes * parts));
  v.scores.resize(static_cast<size_t>(v.rows * v.classes));
  for (int64_t k = 0; k < v.rows * v.classes; ++k)
    v.scores[k] = scores.getDouble(k);
  return v;
}

cpu::Tensor doubles(const std::vector<double> &values) {
  cpu::Tensor t(DType::F64, {static_cast<int64_t>(values.size())});
  std::memcpy(t.rawData(), values.data(), values.size() * sizeof(double));
  return t;
}

} // namespace

Expected<cpu::Tensor> RankExecutor::sumHostOverTp(const cpu::Tensor &host) {
  auto placed = be.upload(host);
  if (!placed)
    return placed.takeError();
  if (Error err = sumOver(tpGroup(), {&*placed}))
    return err;
  return be.download(*placed);
}

Expected<std::vector<cpu::Tensor>>
RankExecutor::lookupCollective(const onnx::NodeProto &node, const OpDef &def,
                               ArrayRef<const cpu::Tensor *> inputs) {
  auto fail = [&](const Twine &why) {
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): %s",
                             nodeLabel(node).c_str(), node.op_type().c_str(), why.str().c_str());
  };
  bool grad = def.id == OpId::TpGatherGrad;
  auto data = be.download(*inputs[0]);
  auto ids = data ? be.download(*inputs[1]) : data.takeError();
  if (!ids)
    return ids.takeError();
  // The table's rows here: [offset, offset + rows) of rows x T.
  std::vector<int64_t> shape;
  if (grad) {
    auto attr = attrInts(node, "shape");
    if (!attr || attr->empty())
      return fail("needs the table's shape");
    shape = *attr;
  } else {
    shape.assign(data->shape().begin(), data->shape().end());
  }
  if (shape.empty() || !cpu::isFloating(data->elemType()))
    return fail("expects a float table, got " + data->describe());
  int64_t rows = shape[0], offset = tp * rows, all = rows * s.grid.T;
  int64_t width = 1;
  for (size_t k = 1; k < shape.size(); ++k)
    width *= shape[k];
  std::vector<int64_t> index = ids->toInt64Vector();
  for (int64_t &i : index) {
    if (i < -all || i >= all)
      return fail(formatv("index {0} out of range [-{1}, {1})", i, all));
    i = (i < 0 ? i + all : i) - offset; // a row here when in [0, rows)
  }
  if (!grad) {
    // Its rows' entries, zeros for the others; the group's sum has them all.
    std::vector<int64_t> outShape(ids->shape().begin(), ids->shape().end());
    outShape.insert(outShape.end(), shape.begin() + 1, shape.end());
    cpu::Tensor out(data->elemType(), outShape);
    for (size_t n = 0; n < index.size(); ++n)
      if (index[n] >= 0 && index[n] < rows)
        for (int64_t k = 0; k < width; ++k)
          out.setDouble(static_cast<int64_t>(n) * width + k, data->getDouble(index[n] * width + k));
    auto summed = sumHostOverTp(out);
    if (!summed)
      return summed.takeError();
    auto placed = be.upload(*summed);
    if (!placed)
      return placed.takeError();
    return std::vector<cpu::Tensor>{std::move(*placed)};
  }
  // dTable: each row here gets the dY of the ids that read it.
  const cpu::Tensor &dy = *data;
  if (dy.numElements() != static_cast<int64_t>(index.size()) * width)
    return fail("dY " + dy.describe() + " does not match the ids " + ids->describe());
  cpu::Tensor dx(dy.elemType(), shape);
  for (size_t n = 0; n < index.size(); ++n)
    if (index[n] >= 0 && index[n] < rows)
      for (int64_t k = 0; k < width; ++k) {
        int64_t at = index[n] * width + k;
        dx.setDouble(at, dx.getDouble(at) + dy.getDouble(static_cast<int64_t>(n) * width + k));
      }
  auto placed = be.upload(dx);
  if (!placed)
    return placed.takeError();
  return std::vector<cpu::Tensor>{std::move(*placed)};
}

Expected<std::vector<cpu::Tensor>>
RankExecutor::runCollective(const onnx::NodeProto &node, const OpDef &def,
                            ArrayRef<const cpu::Tensor *> inputs) {
  if (def.id == OpId::TpAllReduce) {
    auto summed = sumOverTp(*inputs[0]);
    if (!summed)
      return summed.takeError();
    return std::vector<cpu::Tensor>{std::move(*summed)};
  }
  // Along the node's split axis, of `stride` blocks each cut into T pieces,
  // as a split weight's are.
  plan::WeightShard cut;
  cut.set_axis(static_cast<int>(attrInt(node, "axis", 0)));
  cut.set_parts(s.grid.T);
  cut.set_stride(attrInt(node, "stride", 1));
  auto place = [&](Expected<cpu::Tensor> host) -> Expected<std::vector<cpu::Tensor>> {
    if (!host)
      return host.takeError();
    auto placed = be.upload(*host);
    if (!placed)
      return placed.takeError();
    return std::vector<cpu::Tensor>{std::move(*placed)};
  };
  // A split value, whole: every rank's piece, joined.
  if (def.id == OpId::TpAllGather || def.id == OpId::TpGatherCopy)
    return place(joinOverTp(*inputs[0], cut));
  // This rank's piece of the group's sum, or of a replicated value.
  if (def.id == OpId::TpReduceScatter || def.id == OpId::TpScatter) {
    Expected<cpu::Tensor> whole =
        def.id == OpId::TpReduceScatter ? sumOverTp(*inputs[0]) : be.download(*inputs[0]);
    if (whole && def.id == OpId::TpReduceScatter)
      whole = be.download(*whole);
    if (!whole)
      return whole.takeError();
    return place(shardPiece(*whole, cut, tp));
  }
  if (def.id == OpId::TpGather || def.id == OpId::TpGatherGrad)
    return lookupCollective(node, def, inputs);
  bool grad = def.id == OpId::TpSoftmaxCrossEntropyLossGrad;
  if (def.id != OpId::TpSoftmaxCrossEntropyLoss && !grad)
    return createStringError(inconvertibleErrorCode(), "node '%s' (%s): no collective runs it",
                             nodeLabel(node).c_str(), node.op_type().c_str());
  auto scores = be.download(*inputs[grad ? 1 : 0]);
  auto labels = scores ? be.download(*inputs[grad ? 2 : 1]) : scores.takeError();
  if (!labels)
    return labels.takeError();
  auto rows = vocabRows(node, *scores, *labels, tp, s.grid.T);
  if (!rows)
    return rows.takeError();
  const VocabRows &v = *rows;
  // Each row's maximum over every rank's classes (gathered: a maximum is no
  // sum), then its sum of exponentials below it.
  std::vector<double> most(v.rows, -INFINITY), sums(v.rows, 0.0), picked(v.rows, 0.0);
  for (int64_t i = 0; i < v.rows; ++i)
    for (int64_t j = 0; j < v.classes; ++j)
      most[i] = std::max(most[i], v.scores[i * v.classes + j]);
  auto all = gatherOverTp(doubles(most));
  if (!all)
    return all.takeError();
  for (int t = 0; t < s.grid.T; ++t)
    for (int64_t i = 0; i < v.rows; ++i)
      most[i] = std::max(most[i], all->data<double>()[t * v.rows + i]);
  for (int64_t i = 0; i < v.rows; ++i) {
    for (int64_t j = 0; j < v.classes; ++j)
      sums[i] += std::exp(v.scores[i * v.classes + j] - most[i]);
    if (int64_t j = v.local(i); j >= 0)
      picked[i] = v.scores[i * v.classes + j] - most[i];
  }
  auto sum = sumHostOverTp(doubles(sums));
  if (!sum)
    return sum.takeError();
  double count = 0;
  for (int64_t i = 0; i < v.rows; ++i)
    count += v.counts(i);
  if (!grad) {
    // loss = log(sum) - (target - max), summed or averaged over the rows
    // that count.
    auto target = sumHostOverTp(doubles(picked));
    if (!target)
      return target.takeError();
    double total = 0;
    for (int64_t i = 0; i < v.rows; ++i)
      if (v.counts(i))
        total += std::log(sum->data<double>()[i]) - target->data<double>()[i];
    cpu::Tensor loss(scores->elemType(), {});
    loss.setDouble(0, v.mean ? total / count : total);
    auto placed = be.upload(loss);
    if (!placed)
      return placed.takeError();
    return std::vector<cpu::Tensor>{std::move(*placed)};
  }
  // dScores = dLoss / divisor * (softmax - onehot(label)), 0 for a row
  // that does not count.
  auto dLoss = be.download(*inputs[0]);
  if (!dLoss)
    return dLoss.takeError();
  double scale = dLoss->getDouble(0) / (v.mean && count > 0 ? count : 1.0);
  cpu::Tensor dx(scores->elemType(), scores->shape());
  for (int64_t i = 0; i < v.rows; ++i) {
    if (!v.counts(i))
      continue;
    int64_t label = v.local(i);
    for (int64_t j = 0; j < v.classes; ++j) {
      double p = std::exp(v.scores[i * v.classes + j] - most[i]) / sum->data<double>()[i];
      dx.setDouble(i * v.classes + j, scale * (p - (j == label ? 1.0 : 0.0)));
    }
  }
  auto placed = be.upload(dx);
  if (!placed)
    return placed.takeError();
  return std::vector<cpu::Tensor>{std::move(*placed)};
}

} // namespace pipec::rt
