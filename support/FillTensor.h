//===- FillTensor.h - A weight stored as its one fill value -------------===//
//
// A model stored without its weights' bytes (ONNX's "light" test models,
// `pipec model --light`) makes each weight with a ConstantOfShape. The
// fold-constants pass makes such a fill the weight it stands for, as an
// initializer would hold it, so that it trains, shards and is counted as
// the checkpoint tensor it stands for. Its tensor is a TensorProto of the
// weight's dims whose data holds the one fill value, marked by this
// doc_string: Graph::readConstant and cpu::fromTensorProto repeat the value
// over the shape.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_FILLTENSOR_H
#define PIPEC_SUPPORT_FILLTENSOR_H

#include "llvm/ADT/StringRef.h"

namespace pipec {

inline constexpr llvm::StringLiteral fillTensorDoc = "pipec:fill";

} // namespace pipec

#endif // PIPEC_SUPPORT_FILLTENSOR_H
