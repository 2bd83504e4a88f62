//===- Window.cpp - Conv and pool window attributes ----------------------===//
#include "ops/Window.h"

#include "llvm/ADT/Twine.h"

using namespace llvm;

namespace pipec {

Expected<WindowAttrs> windowAttrs(int64_t rank, std::optional<std::vector<int64_t>> strides,
                                  std::optional<std::vector<int64_t>> dilations,
                                  std::optional<std::vector<int64_t>> pads, StringRef autoPad) {
  auto fail = [](const Twine &why) { return createStringError(inconvertibleErrorCode(), why); };
  WindowAttrs w;
  w.strides = strides.value_or(std::vector<int64_t>(rank, 1));
  w.dilations = dilations.value_or(std::vector<int64_t>(rank, 1));
  w.pads = pads.value_or(std::vector<int64_t>(2 * rank, 0));
  if (static_cast<int64_t>(w.strides.size()) != rank ||
      static_cast<int64_t>(w.dilations.size()) != rank ||
      static_cast<int64_t>(w.pads.size()) != 2 * rank)
    return fail("strides, dilations or pads do not match the " + Twine(rank) +
                " spatial dimensions");
  for (int64_t d = 0; d < rank; ++d)
    if (w.strides[d] < 1 || w.dilations[d] < 1 || w.pads[d] < 0 || w.pads[rank + d] < 0)
      return fail("strides and dilations must be positive and pads non-negative");
  if (autoPad.empty() || autoPad == "NOTSET")
    w.autoPad = AutoPad::NotSet;
  else if (autoPad == "VALID")
    w.autoPad = AutoPad::Valid;
  else if (autoPad == "SAME_UPPER")
    w.autoPad = AutoPad::SameUpper;
  else if (autoPad == "SAME_LOWER")
    w.autoPad = AutoPad::SameLower;
  else
    return fail("unknown auto_pad '" + autoPad + "'");
  if (w.autoPad == AutoPad::Valid)
    w.pads.assign(2 * rank, 0);
  return w;
}

} // namespace pipec
