//===- Reshape.cpp - Reshape's target shape ------------------------------===//
#include "ops/Reshape.h"

#include "llvm/ADT/Twine.h"

#include <string>

using namespace llvm;

namespace pipec {
namespace {

std::string listed(ArrayRef<int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

} // namespace

Expected<std::vector<int64_t>> reshapeTarget(ArrayRef<int64_t> in, ArrayRef<int64_t> requested,
                                             bool allowZero, StringRef input) {
  auto fail = [](const Twine &why) { return createStringError(inconvertibleErrorCode(), why); };
  std::vector<int64_t> shape;
  int64_t inferred = -1, known = 1, total = 1;
  for (int64_t d : in)
    total *= d;
  for (size_t i = 0; i < requested.size(); ++i) {
    int64_t d = requested[i];
    if (d == -1) {
      if (inferred >= 0)
        return fail("more than one -1 in shape " + listed(requested));
      inferred = static_cast<int64_t>(i);
      shape.push_back(1);
      continue;
    }
    if (d == 0 && !allowZero) {
      if (i >= in.size())
        return fail("0 at position " + Twine(i) + " copies no input dimension");
      d = in[i];
    } else if (d < 0) {
      return fail("invalid dimension in shape " + listed(requested));
    }
    shape.push_back(d);
    known *= d;
  }
  if (inferred >= 0) {
    if (known == 0 || total % known != 0)
      return fail("cannot infer -1 reshaping " + input + " to " + listed(requested));
    shape[inferred] = total / known;
  } else if (known != total) {
    return fail("cannot reshape " + input + " to " + listed(requested));
  }
  return shape;
}

} // namespace pipec
