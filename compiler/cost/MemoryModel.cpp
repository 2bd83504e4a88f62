//===- MemoryModel.cpp - Bytes a pipeline stage holds ---------------------===//
#include "compiler/cost/MemoryModel.h"
#include "support/Diagnostics.h"
#include "support/EnumNames.h"

#include "llvm/ADT/StringSwitch.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

using namespace llvm;

namespace pipec {

namespace {

constexpr EnumName<Recompute> recomputeNames[] = {
    {Recompute::None, "none"}, {Recompute::All, "all"}, {Recompute::Auto, "auto"}};

} // namespace

Expected<Recompute> parseRecompute(StringRef name) {
  if (std::optional<Recompute> r = valueOf(recomputeNames, name.lower()))
    return *r;
  return usageError("--recompute " + name + ": expected " + nameList(recomputeNames));
}

StringRef recomputeName(Recompute recompute) { return nameOf(recomputeNames, recompute, "none"); }

int64_t optimizerBytesPerParam(const TrainingSetup &setup) {
  if (!setup.training)
    return 0;
  int64_t moments = setup.optimizer == Optimizer::SGD        ? 0
                    : setup.optimizer == Optimizer::Momentum ? 4
                                                             : 8;
  // Mixed precision: an fp32 master copy beside the bf16 weight; under
  // autocast the weight is the master.
  return moments + (setup.mixedPrecision && !setup.autocast ? 4 : 0);
}

int64_t gradientBytesPerParam(const TrainingSetup &setup) {
  return setup.mixedPrecision && !setup.autocast ? 2 : 4;
}

int64_t bytesPerParam(const TrainingSetup &setup) {
  if (!setup.training)
    return setup.mixedPrecision ? 2 : 4;
  int64_t weightAndGrad = 2 * gradientBytesPerParam(setup);
  return weightAndGrad + optimizerBytesPerParam(setup);
}

int64_t optimizerStateBytes(int64_t params, const TrainingSetup &setup) {
  int64_t shards = std::max(1, setup.optimizerShards);
  int64_t state = params * optimizerBytesPerParam(setup);
  return (state + shards - 1) / shards;
}

int64_t weightStateBytes(int64_t params, const TrainingSetup &setup) {
  return params * (bytesPerParam(setup) - optimizerBytesPerParam(setup)) +
         optimizerStateBytes(params, setup);
}

Expected<int64_t> parseByteSize(StringRef text, StringRef flag) {
  StringRef t = text.trim();
  size_t split = t.find_first_not_of("0123456789.eE+-");
  StringRef number = t.substr(0, split), unit = split == StringRef::npos ? "" : t.substr(split);
  double value;
  if (number.empty() || number.getAsDouble(value) || !std::isfinite(value) || value < 0)
    return usageError("--" + flag + " " + text + ": expected a size such as 80GB, 80GiB or 8.5e10");
  std::string u = unit.trim().lower();
  double scale = StringSwitch<double>(u)
                     .Cases("", "b", 1)
                     .Cases("k", "kb", 1e3)
                     .Cases("m", "mb", 1e6)
                     .Cases("g", "gb", 1e9)
                     .Cases("t", "tb", 1e12)
                     .Case("kib", 1024.0)
                     .Case("mib", 1024.0 * 1024)
                     .Case("gib", 1024.0 * 1024 * 1024)
                     .Case("tib", 1024.0 * 1024 * 1024 * 1024)
                     .Default(-1);
  if (scale < 0)
    return usageError("--" + flag + " " + text + ": unknown unit '" + unit +
                      "' (use B, KB, MB, GB, TB or KiB..TiB)");
  // 2^63 bytes (8 EiB) does not fit an int64_t; no machine comes near it.
  double bytes = value * scale;
  if (bytes >= 9.2e18)
    return usageError("--" + flag + " " + text + ": more than 9.2e18 bytes (int64's range)");
  return static_cast<int64_t>(std::llround(bytes));
}

} // namespace pipec
