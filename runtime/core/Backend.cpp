//===- Backend.cpp - What the backends share ------------------------------===//
#include "runtime/core/Backend.h"
#include "runtime/kernels/KernelBodies.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace pipec::rt {

kernels::OptimizerParams optimizerParams(const OptimizerUpdate &u) {
  kernels::OptimizerParams p;
  p.kind = u.kind == Optimizer::SGD ? 0 : u.kind == Optimizer::Momentum ? 1 : 2;
  p.lr = u.lr;
  p.momentum = u.momentum;
  p.weightDecay = u.weightDecay;
  p.beta1 = u.beta1;
  p.beta2 = u.beta2;
  p.epsilon = u.epsilon;
  p.gradScale = u.gradScale;
  p.decayCenter = u.decayCenter;
  p.c1 = 1 - std::pow(u.beta1, u.step + 1);
  p.c2 = 1 - std::pow(u.beta2, u.step + 1);
  return p;
}

llvm::Expected<std::vector<cpu::Tensor>>
Backend::downloadAll(llvm::ArrayRef<const cpu::Tensor *> tensors) {
  std::vector<cpu::Tensor> out;
  for (const cpu::Tensor *t : tensors) {
    auto host = download(*t);
    if (!host)
      return host.takeError();
    out.push_back(std::move(*host));
  }
  return out;
}

llvm::Expected<cpu::Tensor> Backend::slice(const cpu::Tensor &t, int64_t begin, int64_t count) {
  auto host = download(t);
  if (!host)
    return host.takeError();
  cpu::Tensor out(t.elemType(), {count}); // zeros
  int64_t copied = std::clamp<int64_t>(t.numElements() - begin, 0, count);
  size_t width = cpu::storageSize(t.elemType());
  if (copied > 0)
    std::memcpy(out.rawData(), static_cast<const char *>(host->rawData()) + begin * width,
                copied * width);
  return upload(out);
}

} // namespace pipec::rt
