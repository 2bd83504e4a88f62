//===- ParamMap.h - A checkpoint's parameters in the plan's weights -------===//
//
// An exporter's default optimisation folds a parameter into another
// initializer: Transpose(W) of a Linear becomes W's transpose under a new
// name, GPT-2's position table its first S rows (then unsqueezed), Gemma's
// norm scale 1 + w. The plan's ParamMap (plan.proto; made by
// driver/MapParams.h) records, per parameter of a checkpoint, the weights
// that hold it and the steps from the one to the other.
//
// placeParam applies those steps (the checkpoint's tensor into the weight's
// layout: `pipec run --init`); unplaceParam inverts them (a trained weight
// back into the parameter: `--save-weights OUT.safetensors`). A sliced
// table's rows outside the slice never reach the weight: unplaceParam takes
// them from the checkpoint's tensor, scaled by what the optimizer did to a
// weight whose gradient stayed zero (decoupled weight decay shrinks them as
// torch's AdamW does).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_RUNTIME_EXEC_PARAMMAP_H
#define PIPEC_RUNTIME_EXEC_PARAMMAP_H

#include "plan/plan.pb.h"
#include "runtime/core/Tensor.h"

#include "llvm/Support/Error.h"

namespace pipec::rt {

/// \p param (the checkpoint's tensor) as the weight of \p place holds it:
/// cast to \p weightType, then place.steps in order. Errors name the step
/// that does not fit the shape.
llvm::Expected<cpu::Tensor> placeParam(const cpu::Tensor &param, const plan::ParamPlace &place,
                                       cpu::DType weightType);

/// The parameter \p weight holds through \p place, of \p param's shape and
/// element type (\p param: the checkpoint's tensor, whose entries outside a
/// slice are kept, times \p untrainedFactor).
llvm::Expected<cpu::Tensor> unplaceParam(const cpu::Tensor &weight, const plan::ParamPlace &place,
                                         const cpu::Tensor &param, double untrainedFactor);

/// The constant a weight adds to its parameter ("1 + w": 1), 0 when none:
/// decoupled weight decay pulls the weight towards it, so that it decays the
/// parameter, not the sum.
double decayCenterOf(const plan::ParamPlace &place);

/// "transpose [1,0], slice axis 0 to 8, unsqueeze 0, add 1": the steps.
std::string describeSteps(const plan::ParamPlace &place);

} // namespace pipec::rt

#endif // PIPEC_RUNTIME_EXEC_PARAMMAP_H
