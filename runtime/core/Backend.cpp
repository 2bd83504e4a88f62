//===- Backend.cpp - What the backends share ------------------------------===//
#include "runtime/core/Backend.h"
#include "runtime/kernels/KernelBodies.h"

#include <cmath>

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

} // namespace pipec::rt
