//===- ElemOp.h - The element-wise ops of Ops.def, as codes ---------------===//
//
// One code per PIPEC_ELEMENTWISE row, in the order of ops/Ops.def. The
// fused and device kernels carry these codes; math/ElementMath.h
// maps each to its math. Kept apart from OpRegistry.h so that device code
// can include it.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_ELEMOP_H
#define PIPEC_OPS_ELEMOP_H

#include <cstdint>

namespace pipec {

enum class ElemOp : uint16_t {
#define PIPEC_ELEMENTWISE(ID, ...) ID,
#include "ops/Ops.def"
};

} // namespace pipec

#endif // PIPEC_OPS_ELEMOP_H
