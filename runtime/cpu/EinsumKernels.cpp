//===- EinsumKernels.cpp - The CPU kernel of Einsum -----------------------===//
//
// Einsum in three steps, as numpy's einsum computes it:
//
//   1. Parse the equation into one label per dimension of each operand and
//      of the output (ops/Einsum.h, which the gradient rule reads too).
//   2. Reduce each operand to distinct labels: a repeated label takes the
//      diagonal, and a label no other operand or the output has is summed.
//   3. Contract the operands left to right, two at a time, as a batched
//      GEMM: shared labels still needed are the batch, shared labels no
//      longer needed the contracted K, the others M and N. A dimension of
//      size 1 broadcasts against the other operand's. The result is summed
//      and transposed into the output's order.
//
//===----------------------------------------------------------------------===//
#include "ops/Einsum.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/Support/FormatVariadic.h"

#include <map>

using namespace llvm;

namespace pipec::cpu {
namespace {

using Labels = EinsumEquation::Labels;

/// An operand or intermediate result with one label per dimension.
struct Labeled {
  Tensor tensor;
  Labels labels;
};

/// The parsed equation (ops/Einsum.h) and the size of each label.
struct Equation {
  std::vector<Labels> inputs;
  Labels output;
  Shape sizes;
};

Expected<Equation> parseEquation(const OpContext &ctx) {
  std::vector<int64_t> ranks;
  for (size_t i = 0; i < ctx.numInputs(); ++i)
    ranks.push_back(ctx.input(i).rank());
  Expected<EinsumEquation> parsed = parseEinsum(ctx.attrString("equation", ""), ranks);
  if (!parsed)
    return ctx.fail(toString(parsed.takeError()));
  Equation eq{std::move(parsed->inputs), std::move(parsed->output), {}};
  size_t labels = EinsumEquation::numLetters + parsed->ellipsisDims;
  eq.sizes.assign(labels, 1);
  std::vector<bool> fixed(labels, false);
  for (size_t i = 0; i < eq.inputs.size(); ++i)
    for (size_t d = 0; d < eq.inputs[i].size(); ++d) {
      int l = eq.inputs[i][d];
      int64_t size = ctx.input(i).dim(d);
      // Sizes agree, or one of them is 1 and broadcasts.
      if (fixed[l] && size != eq.sizes[l] && size != 1 && eq.sizes[l] != 1)
        return ctx.fail(formatv("a label has sizes {0} and {1} in the equation '{2}'", eq.sizes[l],
                                size, parsed->text));
      if (!fixed[l] || eq.sizes[l] == 1)
        eq.sizes[l] = size;
      fixed[l] = true;
    }
  return eq;
}

/// \p x with each repeated label reduced to its diagonal.
Expected<Labeled> diagonal(const OpContext &ctx, size_t input, const Labels &labels) {
  const Tensor &x = ctx.input(input);
  Labels unique;
  Shape shape, strides, inStrides = stridesOf(x.shape());
  for (size_t d = 0; d < labels.size(); ++d) {
    auto it = llvm::find(unique, labels[d]);
    if (it == unique.end()) {
      unique.push_back(labels[d]);
      shape.push_back(x.dim(d));
      strides.push_back(inStrides[d]);
      continue;
    }
    size_t k = it - unique.begin();
    if (shape[k] != x.dim(d))
      return ctx.fail(formatv("a repeated label has sizes {0} and {1} in input {2} {3}", shape[k],
                              x.dim(d), input, x.describe()));
    strides[k] += inStrides[d];
  }
  if (unique.size() == labels.size())
    return Labeled{x, labels};
  Tensor out(x.elemType(), shape);
  visitStorage(x.elemType(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>();
    T *dst = out.data<T>();
    forEachStrided<1>(shape, {strides},
                      [&](int64_t o, const std::array<int64_t, 1> &off) { dst[o] = src[off[0]]; });
  });
  return Labeled{out, unique};
}

int64_t dimOf(const Labeled &x, int label) {
  return x.tensor.dim(llvm::find(x.labels, label) - x.labels.begin());
}

/// \p x transposed so that its labels read \p order (a permutation of them).
Labeled permuted(const Labeled &x, const Labels &order) {
  if (order == x.labels)
    return x;
  Shape perm;
  for (int l : order)
    perm.push_back(llvm::find(x.labels, l) - x.labels.begin());
  return {transpose(x.tensor, perm), order};
}

/// \p x with the labels for which \p drop is true summed out.
template <typename Pred> Labeled sumOut(const Labeled &x, Pred drop) {
  Labels kept, dropped;
  for (int l : x.labels)
    (drop(l) ? dropped : kept).push_back(l);
  if (dropped.empty())
    return x;
  Labels order = kept;
  order.insert(order.end(), dropped.begin(), dropped.end());
  Labeled p = permuted(x, order);
  Shape shape(p.tensor.shape().begin(), p.tensor.shape().begin() + kept.size());
  int64_t rows = product(shape),
          block = product(ArrayRef<int64_t>(p.tensor.shape()).drop_front(kept.size()));
  Tensor out(x.tensor.elemType(), shape);
  visitStorage(x.tensor.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!isBool<T>) {
      using Acc = std::conditional_t<isFloat<T>, double, T>;
      const T *src = p.tensor.data<T>();
      T *dst = out.data<T>();
      for (int64_t r = 0; r < rows; ++r) {
        Acc sum = 0;
        for (int64_t j = 0; j < block; ++j)
          if constexpr (isFloat<T>)
            sum += src[r * block + j];
          else // Wraps instead of overflowing.
            sum = static_cast<T>(static_cast<uint64_t>(sum) +
                                 static_cast<uint64_t>(src[r * block + j]));
        dst[r] = static_cast<T>(sum);
      }
    }
  });
  return {out, kept};
}

/// \p x with the dimensions of labels in \p sizes grown to those sizes
/// (from 1: broadcasting).
Labeled grown(const Labeled &x, const std::map<int, int64_t> &sizes) {
  Shape shape = x.tensor.shape();
  for (size_t d = 0; d < shape.size(); ++d)
    if (auto it = sizes.find(x.labels[d]); it != sizes.end())
      shape[d] = it->second;
  return shape == x.tensor.shape() ? x : Labeled{expandAny(x.tensor, shape), x.labels};
}

Labels concatenated(std::initializer_list<const Labels *> parts) {
  Labels out;
  for (const Labels *p : parts)
    out.insert(out.end(), p->begin(), p->end());
  return out;
}

/// \p a0 and \p b0 contracted over their shared labels that \p keep
/// rejects, as a batched GEMM [batch, M, K] x [batch, K, N]; their other
/// labels that \p keep rejects are summed first.
template <typename Keep> Labeled contract(const Labeled &a0, const Labeled &b0, Keep keep) {
  Labels shared;
  std::map<int, int64_t> sizes;
  for (int l : a0.labels)
    if (llvm::is_contained(b0.labels, l)) {
      shared.push_back(l);
      sizes[l] = std::max(dimOf(a0, l), dimOf(b0, l));
    }
  auto unneeded = [&](int l) { return !keep(l) && !llvm::is_contained(shared, l); };
  Labeled a = sumOut(grown(a0, sizes), unneeded), b = sumOut(grown(b0, sizes), unneeded);
  Labels batch, reduced, aRest, bRest;
  for (int l : shared)
    (keep(l) ? batch : reduced).push_back(l);
  for (int l : a.labels)
    if (!sizes.count(l))
      aRest.push_back(l);
  for (int l : b.labels)
    if (!sizes.count(l))
      bRest.push_back(l);
  Labels outLabels = concatenated({&batch, &aRest, &bRest});
  Tensor at = permuted(a, concatenated({&batch, &aRest, &reduced})).tensor;
  Tensor bt = permuted(b, concatenated({&batch, &reduced, &bRest})).tensor;
  auto sizeOf = [](const Labeled &x, const Labels &ls) {
    int64_t n = 1;
    for (int l : ls)
      n *= dimOf(x, l);
    return n;
  };
  int64_t batches = sizeOf(a, batch), m = sizeOf(a, aRest), n = sizeOf(b, bRest),
          k = sizeOf(a, reduced);
  Shape shape;
  for (int l : outLabels)
    shape.push_back(llvm::is_contained(b.labels, l) ? dimOf(b, l) : dimOf(a, l));
  Tensor out(a.tensor.elemType(), shape);
  visitStorage(out.elemType(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!isBool<T>) {
      for (int64_t i = 0; i < batches; ++i)
        gemmAny<T>(false, false, m, n, k, T(1), at.data<T>() + i * m * k, k,
                   bt.data<T>() + i * k * n, n, T(0), out.data<T>() + i * m * n, n);
    }
  });
  return {out, outLabels};
}

} // namespace

Expected<Outputs> einsum(const OpContext &ctx) {
  for (size_t i = 0; i < ctx.numInputs(); ++i) {
    if (Error e = ctx.sameType(0, i))
      return e;
    if (ctx.input(i).elemType() == DType::Bool)
      return ctx.unsupportedType(ctx.input(i), i);
  }
  Expected<Equation> eq = parseEquation(ctx);
  if (!eq)
    return eq.takeError();
  size_t count = eq->inputs.size();
  // Whether the output or an operand from index i on needs label l.
  auto neededAfter = [&](size_t i, int l) {
    if (llvm::is_contained(eq->output, l))
      return true;
    for (size_t j = i; j < count; ++j)
      if (llvm::is_contained(eq->inputs[j], l))
        return true;
    return false;
  };
  std::vector<Labeled> operands;
  for (size_t i = 0; i < count; ++i) {
    Expected<Labeled> x = diagonal(ctx, i, eq->inputs[i]);
    if (!x)
      return x.takeError();
    operands.push_back(sumOut(*x, [&](int l) {
      if (llvm::is_contained(eq->output, l))
        return false;
      for (size_t j = 0; j < count; ++j)
        if (j != i && llvm::is_contained(eq->inputs[j], l))
          return false;
      return true;
    }));
  }
  Labeled acc = operands[0];
  for (size_t i = 1; i < count; ++i)
    acc = contract(acc, operands[i], [&](int l) { return neededAfter(i + 1, l); });
  acc = sumOut(acc, [&](int l) { return !llvm::is_contained(eq->output, l); });
  // A label of size 1 left in the result broadcasts to the output's size.
  Shape shape;
  for (int l : eq->output)
    shape.push_back(eq->sizes[l]);
  Labeled result = permuted(acc, eq->output);
  if (result.tensor.shape() != shape)
    result.tensor = expandAny(result.tensor, shape);
  return Outputs{result.tensor};
}

} // namespace pipec::cpu
