//===- ParamMap.cpp - A checkpoint's parameters in the plan's weights -----===//
#include "runtime/exec/ParamMap.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <numeric>

using namespace llvm;

namespace pipec::rt {
namespace {

Error stepError(const Twine &why) {
  return createStringError(inconvertibleErrorCode(), "%s", why.str().c_str());
}

std::string shapeText(ArrayRef<int64_t> shape) {
  return "[" + join(map_range(shape, [](int64_t d) { return std::to_string(d); }), ",") + "]";
}

/// \p t with its axes permuted: result axis j is t's axis perm[j].
Expected<cpu::Tensor> permuted(const cpu::Tensor &t, ArrayRef<int32_t> perm) {
  size_t rank = t.shape().size();
  std::vector<int32_t> seen(perm.begin(), perm.end());
  llvm::sort(seen);
  std::vector<int32_t> iota(rank);
  std::iota(iota.begin(), iota.end(), 0);
  if (seen != iota)
    return stepError(formatv("transpose {0} is not a permutation of {1} axes",
                             shapeText(std::vector<int64_t>(perm.begin(), perm.end())), rank));
  std::vector<int64_t> shape(rank), inStrides = cpu::stridesOf(t.shape());
  for (size_t j = 0; j < rank; ++j)
    shape[j] = t.shape()[perm[j]];
  cpu::Tensor out(t.elemType(), shape);
  std::vector<int64_t> index(rank, 0);
  for (int64_t flat = 0; flat < out.numElements(); ++flat) {
    int64_t from = 0;
    for (size_t j = 0; j < rank; ++j)
      from += index[j] * inStrides[perm[j]];
    out.setDouble(flat, t.getDouble(from));
    for (size_t j = rank; j-- > 0;)
      if (++index[j] < shape[j])
        break;
      else
        index[j] = 0;
  }
  return std::move(out);
}

/// Copies the entries [\p start, \p stop) of \p from along \p axis into
/// the same entries of \p into (into's shape but along axis), or back from
/// the slice into the whole when \p fromIsSlice.
void copyRange(const cpu::Tensor &from, cpu::Tensor &into, int axis, int64_t start, int64_t stop,
               bool fromIsSlice) {
  const cpu::Tensor &big = fromIsSlice ? into : from;
  int64_t outer = 1, inner = 1, rows = stop - start;
  for (int i = 0; i < axis; ++i)
    outer *= big.shape()[i];
  for (size_t i = axis + 1; i < big.shape().size(); ++i)
    inner *= big.shape()[i];
  int64_t bigRows = big.shape()[axis];
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inner; ++i) {
        int64_t inBig = (o * bigRows + start + r) * inner + i, inSlice = (o * rows + r) * inner + i;
        if (fromIsSlice)
          into.setDouble(inBig, from.getDouble(inSlice));
        else
          into.setDouble(inSlice, from.getDouble(inBig));
      }
}

/// \p t repeated \p size times along \p axis, where it has size 1.
cpu::Tensor broadcastAlong(const cpu::Tensor &t, int axis, int64_t size) {
  std::vector<int64_t> shape = t.shape();
  shape[axis] = size;
  cpu::Tensor out(t.elemType(), shape);
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i)
    outer *= shape[i];
  for (size_t i = axis + 1; i < shape.size(); ++i)
    inner *= shape[i];
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t r = 0; r < size; ++r)
      for (int64_t i = 0; i < inner; ++i)
        out.setDouble((o * size + r) * inner + i, t.getDouble(o * inner + i));
  return out;
}

} // namespace

Expected<cpu::Tensor> placeParam(const cpu::Tensor &param, const plan::ParamPlace &place,
                                 cpu::DType weightType) {
  if (place.steps().empty() && param.elemType() == weightType)
    return param; // the same tensor: shares its storage
  cpu::Tensor t(weightType, param.shape());
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.setDouble(i, param.getDouble(i));
  t.roundToElemType();
  for (const plan::ParamStep &step : place.steps()) {
    std::vector<int64_t> shape = t.shape();
    switch (step.step_case()) {
    case plan::ParamStep::kTranspose: {
      std::vector<int32_t> perm(step.transpose().perm().begin(), step.transpose().perm().end());
      auto moved = permuted(t, perm);
      if (!moved)
        return moved.takeError();
      t = std::move(*moved);
      break;
    }
    case plan::ParamStep::kSlice: {
      int axis = step.slice().axis();
      int64_t start = step.slice().start(), stop = step.slice().stop();
      if (axis < 0 || axis >= int(shape.size()) || start < 0 || stop < start || stop > shape[axis])
        return stepError(formatv("slice axis {0} from {1} to {2} does not fit shape {3}", axis,
                                 start, stop, shapeText(shape)));
      shape[axis] = stop - start;
      cpu::Tensor sliced(weightType, shape);
      copyRange(t, sliced, axis, start, stop, /*fromIsSlice=*/false);
      t = std::move(sliced);
      break;
    }
    case plan::ParamStep::kBroadcast: {
      int axis = step.broadcast().axis();
      int64_t size = step.broadcast().size();
      if (axis < 0 || axis >= int(shape.size()) || shape[axis] != 1 || size < 1)
        return stepError(formatv("broadcast axis {0} to {1} does not fit shape {2}", axis, size,
                                 shapeText(shape)));
      t = broadcastAlong(t, axis, size);
      break;
    }
    case plan::ParamStep::kUnsqueeze: {
      int axis = step.unsqueeze();
      if (axis < 0 || axis > int(shape.size()))
        return stepError(formatv("unsqueeze {0} does not fit shape {1}", axis, shapeText(shape)));
      shape.insert(shape.begin() + axis, 1);
      t = t.reshaped(shape);
      break;
    }
    case plan::ParamStep::kAdd:
      for (int64_t i = 0; i < t.numElements(); ++i)
        t.setDouble(i, static_cast<double>(static_cast<float>(step.add())) + t.getDouble(i));
      t.roundToElemType();
      break;
    case plan::ParamStep::kTake: {
      const plan::Take &take = step.take();
      std::vector<int64_t> to(take.shape().begin(), take.shape().end());
      int64_t n = 1;
      for (int64_t d : to)
        n *= d;
      if (n != take.indices_size())
        return stepError(
            formatv("take of {0} entries into shape {1}", take.indices_size(), shapeText(to)));
      cpu::Tensor taken(weightType, to);
      for (int64_t k = 0; k < n; ++k) {
        int64_t i = take.indices(k);
        if (i < 0 || i >= t.numElements())
          return stepError(formatv("take index {0} is outside shape {1}", i, shapeText(shape)));
        taken.setDouble(k, t.getDouble(i));
      }
      t = std::move(taken);
      break;
    }
    case plan::ParamStep::STEP_NOT_SET:
      return stepError("a step with no transform");
    }
  }
  return std::move(t);
}

Expected<cpu::Tensor> unplaceParam(const cpu::Tensor &weight, const plan::ParamPlace &place,
                                   const cpu::Tensor &param, double untrainedFactor) {
  // The shapes before each step, from the parameter's on.
  std::vector<std::vector<int64_t>> shapes = {param.shape()};
  for (const plan::ParamStep &step : place.steps()) {
    std::vector<int64_t> shape = shapes.back();
    if (step.has_transpose()) {
      if (step.transpose().perm_size() != int(shape.size()))
        return stepError("transpose does not fit shape " + shapeText(shape));
      std::vector<int64_t> moved;
      for (int32_t p : step.transpose().perm())
        moved.push_back(shape.at(p));
      shape = moved;
    } else if (step.has_slice()) {
      if (step.slice().axis() < 0 || step.slice().axis() >= int(shape.size()))
        return stepError("slice does not fit shape " + shapeText(shape));
      shape[step.slice().axis()] = step.slice().stop() - step.slice().start();
    } else if (step.has_broadcast()) {
      if (step.broadcast().axis() < 0 || step.broadcast().axis() >= int(shape.size()))
        return stepError("broadcast does not fit shape " + shapeText(shape));
      shape[step.broadcast().axis()] = step.broadcast().size();
    } else if (step.step_case() == plan::ParamStep::kUnsqueeze) {
      if (step.unsqueeze() < 0 || step.unsqueeze() > int(shape.size()))
        return stepError("unsqueeze does not fit shape " + shapeText(shape));
      shape.insert(shape.begin() + step.unsqueeze(), 1);
    } else if (step.has_take()) {
      int64_t n = 1;
      for (int64_t d : shape)
        n *= d;
      for (int64_t i : step.take().indices())
        if (i < 0 || i >= n)
          return stepError(formatv("take index {0} is outside shape {1}", i, shapeText(shape)));
      shape.assign(step.take().shape().begin(), step.take().shape().end());
    }
    shapes.push_back(shape);
  }
  if (shapes.back() != weight.shape())
    return stepError(formatv("the weight is {0}; the steps make {1}", shapeText(weight.shape()),
                             shapeText(shapes.back())));
  if (place.steps().empty() && weight.elemType() == param.elemType())
    return weight; // the same tensor: shares its storage
  // In float64 through the inverse steps, rounded once at the end.
  cpu::Tensor t(cpu::DType::F64, weight.shape());
  for (int64_t i = 0; i < t.numElements(); ++i)
    t.setDouble(i, weight.getDouble(i));
  for (int s = place.steps_size(); s-- > 0;) {
    const plan::ParamStep &step = place.steps(s);
    const std::vector<int64_t> &before = shapes[s];
    if (step.has_transpose()) {
      std::vector<int32_t> inverse(step.transpose().perm_size());
      for (int j = 0; j < step.transpose().perm_size(); ++j)
        inverse[step.transpose().perm(j)] = j;
      auto moved = permuted(t, inverse);
      if (!moved)
        return moved.takeError();
      t = std::move(*moved);
    } else if (step.has_slice() || step.has_take()) {
      // The entries the slice or the take left out: the checkpoint's, as the
      // optimizer left a weight that no gradient reached.
      cpu::Tensor whole(cpu::DType::F64, before);
      auto full = placeParam(
          param,
          [&] {
            plan::ParamPlace prefix;
            for (int k = 0; k < s; ++k)
              *prefix.add_steps() = place.steps(k);
            return prefix;
          }(),
          cpu::DType::F64);
      if (!full)
        return full.takeError();
      for (int64_t i = 0; i < whole.numElements(); ++i)
        whole.setDouble(i, full->getDouble(i) * untrainedFactor);
      if (step.has_slice()) {
        copyRange(t, whole, step.slice().axis(), step.slice().start(), step.slice().stop(),
                  /*fromIsSlice=*/true);
      } else { // each entry read holds it; the first read is taken
        for (int64_t k = step.take().indices_size(); k-- > 0;)
          whole.setDouble(step.take().indices(k), t.getDouble(k));
      }
      t = std::move(whole);
    } else if (step.has_broadcast()) {
      // Every copy holds the parameter: the first is taken.
      cpu::Tensor first(cpu::DType::F64, before);
      copyRange(t, first, step.broadcast().axis(), 0, 1, /*fromIsSlice=*/false);
      t = std::move(first);
    } else if (step.step_case() == plan::ParamStep::kUnsqueeze) {
      t = t.reshaped(before);
    } else if (step.step_case() == plan::ParamStep::kAdd) {
      double c = static_cast<float>(step.add());
      for (int64_t i = 0; i < t.numElements(); ++i)
        t.setDouble(i, t.getDouble(i) - c);
    }
  }
  cpu::Tensor out(param.elemType(), param.shape());
  for (int64_t i = 0; i < out.numElements(); ++i)
    out.setDouble(i, t.getDouble(i));
  out.roundToElemType();
  return std::move(out);
}

double decayCenterOf(const plan::ParamPlace &place) {
  double center = 0;
  for (const plan::ParamStep &step : place.steps())
    if (step.step_case() == plan::ParamStep::kAdd)
      center += static_cast<float>(step.add());
  return center;
}

std::string describeSteps(const plan::ParamPlace &place) {
  std::vector<std::string> parts;
  for (const plan::ParamStep &step : place.steps()) {
    switch (step.step_case()) {
    case plan::ParamStep::kTranspose:
      parts.push_back("transpose " +
                      shapeText(std::vector<int64_t>(step.transpose().perm().begin(),
                                                     step.transpose().perm().end())));
      break;
    case plan::ParamStep::kSlice:
      parts.push_back(formatv("rows {0}:{1} of axis {2}", step.slice().start(), step.slice().stop(),
                              step.slice().axis()));
      break;
    case plan::ParamStep::kBroadcast:
      parts.push_back(
          formatv("broadcast axis {0} to {1}", step.broadcast().axis(), step.broadcast().size()));
      break;
    case plan::ParamStep::kUnsqueeze:
      parts.push_back(formatv("unsqueeze {0}", step.unsqueeze()));
      break;
    case plan::ParamStep::kTake:
      parts.push_back(formatv(
          "take {0} entries into {1}", step.take().indices_size(),
          shapeText(std::vector<int64_t>(step.take().shape().begin(), step.take().shape().end()))));
      break;
    case plan::ParamStep::kAdd:
      parts.push_back(formatv("{0} + w", step.add()));
      break;
    case plan::ParamStep::STEP_NOT_SET:
      break;
    }
  }
  return parts.empty() ? "as it is" : join(parts, ", ");
}

} // namespace pipec::rt
