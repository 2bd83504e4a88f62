//===- ScaledAttention.cpp - Fused attention in training, and its gradient ===//
//
// pipec.ScaledDotProductAttention and ScaledDotProductAttentionGrad
// (ops/Attention.h), head by head: each head's scores live in a buffer of
// the thread that computes it, never in a tensor. The forward keeps one
// float per row, the log-sum-exp of the scores, from which the gradient
// recomputes the probabilities after its own product Q Kt (the recompute
// of FlashAttention, Dao et al. 2022, without its tiling: a head's scores
// fit the cache here).
//
// Before:  O, L = ScaledDotProductAttention(Q [1,1,1,1] = 1,
//                 Kt [1,1,1,2] = [0, 1], V [1,1,2,1] = [2, 4])
// After:   O = 2 e^0 / (e^0 + e^1) + 4 e^1 / (e^0 + e^1) = 3.462,
//          L = log(e^0 + e^1) = 1.313
//
//===----------------------------------------------------------------------===//
#include "math/FloatMath.h"
#include "ops/Attention.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/kernels/IndexMap.h"
#include "support/Parallel.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>
#include <limits>

using namespace llvm;

namespace pipec::cpu {
namespace {

namespace a = attention;
using a::ScoreStep;

/// One step of the scores, with its tensor read at the scores' offsets.
struct Step {
  ScoreStep kind = ScoreStep::Scale;
  float c = 0;
  const Tensor *tensor = nullptr;
  /// The tensor's element strides over the scores' dimensions (0 where it
  /// broadcasts).
  std::vector<int64_t> strides;
};

/// What both kernels read: the products' sizes and the score steps.
struct Attention {
  /// Q's heads; each reads Kt's and V's head h / groups.
  int64_t heads = 1, groups = 1, m = 0, k = 0, n = 0, d = 0;
  Shape scoreShape; // [.., m, n]
  std::vector<Step> steps;
  bool guarded = false;
  float guard = 0;

  /// Q [.., m, k], Kt [.., k, n], V [.., n, d] of \p ctx's inputs \p first
  /// on, and the steps' tensors from \p tensors on.
  static Expected<Attention> read(const OpContext &ctx, size_t first, size_t tensors);

  /// S = Q Kt of head \p h, then the steps, into \p s [m, n].
  void scores(int64_t h, const float *q, const float *kt, float *s) const;
  /// \p ds [m, n] of head \p h back through the steps (their derivative:
  /// the scales, zero where a mask chose its fill).
  void backThroughSteps(int64_t h, float *ds) const;

private:
  /// The offset of head \p h's first score in a tensor of \p strides.
  int64_t headOffset(int64_t h, ArrayRef<int64_t> strides) const {
    int64_t offset = 0;
    for (int64_t dim = static_cast<int64_t>(scoreShape.size()) - 3; dim >= 0; --dim) {
      offset += (h % scoreShape[dim]) * strides[dim];
      h /= scoreShape[dim];
    }
    return offset;
  }
};

Expected<Attention> Attention::read(const OpContext &ctx, size_t first, size_t tensors) {
  const Tensor &q = ctx.input(first), &kt = ctx.input(first + 1), &v = ctx.input(first + 2);
  // float32, or bf16 and float16 (held as float, the results rounded by
  // runOp): the products of an autocast plan.
  for (size_t i = first; i < first + 3; ++i)
    if (!storedAs<float>(ctx.input(i).elemType()))
      return ctx.unsupportedType(ctx.input(i), i);
  int64_t rank = q.rank(), groups = ctx.attrInt("groups", 1);
  if (groups < 1 || (groups > 1 && rank < 3))
    return ctx.fail(formatv("groups {0} for Q of rank {1}", groups, rank));
  // Kt's and V's leading dimensions are Q's, the last (the heads) divided
  // by the groups.
  auto leading = [&](const Tensor &t) {
    if (t.rank() != rank)
      return false;
    for (int64_t i = 0; i < rank - 2; ++i)
      if (t.dim(i) * (i == rank - 3 ? groups : 1) != q.dim(i))
        return false;
    return true;
  };
  if (rank < 2 || !leading(kt) || !leading(v) || kt.dim(rank - 2) != q.dim(rank - 1) ||
      v.dim(rank - 2) != kt.dim(rank - 1))
    return ctx.fail(formatv("Q, Kt and V must be [.., m, k], [.., k, n] and [.., n, d] with the "
                            "same leading dimensions, Kt's and V's heads Q's / {0}",
                            groups));
  Attention at;
  at.groups = groups;
  at.heads = product(q.shape().drop_back(2));
  at.m = q.dim(rank - 2);
  at.k = q.dim(rank - 1);
  at.n = kt.dim(rank - 1);
  at.d = v.dim(rank - 1);
  at.scoreShape.assign(q.shape().begin(), q.shape().end() - 1);
  at.scoreShape.push_back(at.n);
  at.guarded = ctx.attrInt("guarded", 0) != 0;
  at.guard = ctx.attrFloat("guard", 0);
  std::optional<Shape> kinds = ctx.attrInts("steps");
  std::vector<float> scalars;
  if (const onnx::AttributeProto *attr = ctx.attr("scalars"))
    scalars.assign(attr->floats().begin(), attr->floats().end());
  size_t count = kinds ? kinds->size() : 0;
  if (scalars.size() != count)
    return ctx.fail(formatv("{0} steps but {1} scalars", count, scalars.size()));
  size_t next = tensors;
  for (size_t i = 0; i < count; ++i) {
    int64_t kind = (*kinds)[i];
    if (kind < 0 || kind >= a::ScoreSteps)
      return ctx.fail(formatv("step {0} is {1}, not a score step", i, kind));
    Step step;
    step.kind = static_cast<ScoreStep>(kind);
    step.c = scalars[i];
    if (a::readsTensor(step.kind)) {
      if (next >= ctx.numInputs() || !ctx.optInput(next))
        return ctx.fail(formatv("step {0} reads input {1}, which the node lacks", i, next));
      const Tensor &t = ctx.input(next);
      bool add = step.kind == ScoreStep::Add;
      if (add ? !storedAs<float>(t.elemType()) : t.elemType() != DType::Bool)
        return ctx.unsupportedType(t, next);
      Expected<Shape> joined = broadcastShapes(t.shape(), at.scoreShape);
      if (!joined || *joined != at.scoreShape) {
        consumeError(joined.takeError());
        return ctx.fail(formatv("input {0} does not broadcast to the scores", next));
      }
      step.tensor = &t;
      step.strides = kernels::broadcastStrides(t.shape(), at.scoreShape);
      ++next;
    }
    at.steps.push_back(std::move(step));
  }
  if (next != ctx.numInputs())
    return ctx.fail(formatv("{0} inputs, but the steps read {1}", ctx.numInputs(), next));
  return at;
}

void Attention::scores(int64_t h, const float *q, const float *kt, float *s) const {
  gemm(false, false, m, n, k, 1.0f, q + h * m * k, k, kt + h / groups * k * n, n, 0.0f, s, n);
  int64_t rank = static_cast<int64_t>(scoreShape.size());
  for (const Step &step : steps) {
    int64_t base = step.tensor ? headOffset(h, step.strides) : 0;
    int64_t rs = step.tensor ? step.strides[rank - 2] : 0,
            cs = step.tensor ? step.strides[rank - 1] : 0;
    for (int64_t i = 0; i < m; ++i) {
      float *row = s + i * n;
      switch (step.kind) {
      case ScoreStep::Scale:
        for (int64_t j = 0; j < n; ++j)
          row[j] = row[j] * step.c;
        break;
      case ScoreStep::Divide:
        for (int64_t j = 0; j < n; ++j)
          row[j] = row[j] / step.c;
        break;
      case ScoreStep::Add: {
        const float *t = step.tensor->data<float>() + base + i * rs;
        for (int64_t j = 0; j < n; ++j)
          row[j] = row[j] + t[j * cs];
        break;
      }
      case ScoreStep::Keep:
      case ScoreStep::Drop: {
        const bool *t = step.tensor->data<bool>() + base + i * rs;
        bool keepWhere = step.kind == ScoreStep::Keep;
        for (int64_t j = 0; j < n; ++j)
          row[j] = t[j * cs] == keepWhere ? row[j] : step.c;
        break;
      }
      }
    }
  }
}

void Attention::backThroughSteps(int64_t h, float *ds) const {
  int64_t rank = static_cast<int64_t>(scoreShape.size());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const Step &step = *it;
    if (step.kind == ScoreStep::Add)
      continue;
    int64_t base = step.tensor ? headOffset(h, step.strides) : 0;
    int64_t rs = step.tensor ? step.strides[rank - 2] : 0,
            cs = step.tensor ? step.strides[rank - 1] : 0;
    for (int64_t i = 0; i < m; ++i) {
      float *row = ds + i * n;
      if (step.kind == ScoreStep::Scale || step.kind == ScoreStep::Divide) {
        for (int64_t j = 0; j < n; ++j)
          row[j] = step.kind == ScoreStep::Scale ? row[j] * step.c : row[j] / step.c;
        continue;
      }
      const bool *t = step.tensor->data<bool>() + base + i * rs;
      bool keepWhere = step.kind == ScoreStep::Keep;
      for (int64_t j = 0; j < n; ++j)
        row[j] = t[j * cs] == keepWhere ? row[j] : 0.0f;
    }
  }
}

/// Softmax of one row of \p n scores in place; returns its log-sum-exp. A
/// row of -inf only (every position masked) is NaN with -inf, as softmax
/// makes it. Vectorised: FloatMath's exp, VectorLanes' maximum and sum.
PIPEC_VECTOR_CLONES float softmaxRow(float *row, int64_t n) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  float top = VectorLanes().maxOf<float>(n, [&](int64_t j) { return row[j]; });
  if (top == -inf) {
    for (int64_t j = 0; j < n; ++j)
      row[j] = std::numeric_limits<float>::quiet_NaN();
    return -inf;
  }
  for (int64_t j = 0; j < n; ++j)
    row[j] = kernels::floatmath::exp(row[j] - top);
  double sum = laneSum(n, [&](int64_t j) { return row[j]; });
  float scale = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < n; ++j)
    row[j] *= scale;
  return top + static_cast<float>(std::log(sum));
}

/// P = exp(S - l) of one row in place: NaN where every position was masked
/// (l = -inf).
PIPEC_VECTOR_CLONES void probabilitiesRow(float *row, int64_t n, float l) {
  for (int64_t j = 0; j < n; ++j)
    row[j] = kernels::floatmath::exp(row[j] - l);
}

/// dS = P (dP - dot) of one row, \p ds holding dP on entry; 0 where P is NaN.
PIPEC_VECTOR_CLONES void scoreGradRow(const float *p, float *ds, int64_t n, float dot) {
  for (int64_t j = 0; j < n; ++j) {
    float pj = p[j];
    float g = pj * (ds[j] - dot);
    ds[j] = pj != pj ? 0.0f : g;
  }
}

} // namespace

KernelResult scaledDotProductAttention(const OpContext &ctx) {
  Expected<Attention> read = Attention::read(ctx, a::Query, a::FirstTensor);
  if (!read)
    return read.takeError();
  const Attention &at = *read;
  const float *q = ctx.input(a::Query).data<float>(), *kt = ctx.input(a::KeysT).data<float>(),
              *v = ctx.input(a::Values).data<float>();
  Shape outShape(at.scoreShape.begin(), at.scoreShape.end() - 1), lseShape = outShape;
  outShape.push_back(at.d);
  lseShape.push_back(1);
  // O in the products' type, the log-sum-exp float32 whatever they are.
  Tensor out = Tensor::uninitialized(ctx.input(a::Query).elemType(), outShape); // every head
  Tensor lse = Tensor::uninitialized(DType::F32, lseShape);
  float *po = out.data<float>(), *pl = lse.data<float>();
  parallelFor(at.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(at.m * at.n);
    for (int64_t h = begin; h < end; ++h) {
      at.scores(h, q, kt, s.data());
      for (int64_t i = 0; i < at.m; ++i)
        pl[h * at.m + i] = softmaxRow(s.data() + i * at.n, at.n);
      if (at.guarded)
        for (float &p : s)
          p = std::isnan(p) ? at.guard : p;
      gemm(false, false, at.m, at.d, at.n, 1.0f, s.data(), at.n, v + h / at.groups * at.n * at.d,
           at.d, 0.0f, po + h * at.m * at.d, at.d);
    }
  });
  return std::vector<Tensor>{std::move(out), std::move(lse)};
}

KernelResult scaledDotProductAttentionGrad(const OpContext &ctx) {
  Expected<Attention> read = Attention::read(ctx, a::GradQuery, a::GradFirstTensor);
  if (!read)
    return read.takeError();
  const Attention &at = *read;
  const Tensor &dOut = ctx.input(a::GradOut), &out = ctx.input(a::GradForwardOut),
               &lse = ctx.input(a::GradLogSumExp);
  Shape outShape(at.scoreShape.begin(), at.scoreShape.end() - 1);
  outShape.push_back(at.d);
  for (size_t i : {size_t(a::GradOut), size_t(a::GradForwardOut), size_t(a::GradLogSumExp)})
    if (!storedAs<float>(ctx.input(i).elemType()))
      return ctx.unsupportedType(ctx.input(i), i);
  if (dOut.shape() != ArrayRef<int64_t>(outShape) || out.shape() != ArrayRef<int64_t>(outShape) ||
      lse.numElements() != at.heads * at.m)
    return ctx.fail("dO and O must have the output's shape and L one element per row");
  const float *q = ctx.input(a::GradQuery).data<float>(),
              *kt = ctx.input(a::GradKeysT).data<float>(),
              *v = ctx.input(a::GradValues).data<float>(), *pdo = dOut.data<float>(),
              *po = out.data<float>(), *pl = lse.data<float>();
  auto like = [&](size_t i) {
    return Tensor::uninitialized(ctx.input(i).elemType(), ctx.input(i).shape());
  };
  Tensor dq = like(a::GradQuery), dkt = like(a::GradKeysT), dv = like(a::GradValues);
  float *pdq = dq.data<float>(), *pdk = dkt.data<float>(), *pdv = dv.data<float>();
  int64_t m = at.m, n = at.n, k = at.k, d = at.d;
  // By key/value head: its group's query heads one after the other, each
  // adding its dKt and dV into the head's (beta 1 after the first).
  int64_t groups = at.groups;
  parallelFor(at.heads / groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(m * n), ds(m * n);
    for (int64_t h = begin * groups; h < end * groups; ++h) {
      int64_t kv = h / groups;
      float beta = h % groups == 0 ? 0.0f : 1.0f;
      const float *dO = pdo + h * m * d, *o = po + h * m * d, *l = pl + h * m;
      at.scores(h, q, kt, p.data());
      for (int64_t i = 0; i < m; ++i)
        probabilitiesRow(p.data() + i * n, n, l[i]);
      // dS = P (dP - rowsum(dO O)), dP = dO V^T; no gradient on a row
      // whose probabilities are NaN (every position masked).
      gemm(false, true, m, n, d, 1.0f, dO, d, v + kv * n * d, d, 0.0f, ds.data(), n);
      for (int64_t i = 0; i < m; ++i) {
        const float *dOi = dO + i * d, *oi = o + i * d;
        double dot = laneSum(d, [&](int64_t c) { return double(dOi[c]) * oi[c]; });
        scoreGradRow(p.data() + i * n, ds.data() + i * n, n, static_cast<float>(dot));
      }
      // dV = P^T dO with the probabilities the forward multiplied V by.
      if (at.guarded)
        for (float &x : p)
          x = std::isnan(x) ? at.guard : x;
      gemm(true, false, n, d, m, 1.0f, p.data(), n, dO, d, beta, pdv + kv * n * d, d);
      at.backThroughSteps(h, ds.data());
      gemm(false, true, m, k, n, 1.0f, ds.data(), n, kt + kv * k * n, n, 0.0f, pdq + h * m * k, k);
      gemm(true, false, k, n, m, 1.0f, q + h * m * k, k, ds.data(), n, beta, pdk + kv * k * n, n);
    }
  });
  return std::vector<Tensor>{std::move(dq), std::move(dkt), std::move(dv)};
}

} // namespace pipec::cpu
