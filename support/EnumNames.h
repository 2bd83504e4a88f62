//===- EnumNames.h - An enum's names from one table ---------------------===//
//
// The names of a small enum's values, kept in one constant table that serves
// both directions: the name of a value and the value of a name. A table lists
// its rows in the order an error should list them; a value may be missing
// from it, in which case its name is the caller's fallback.
//
//   constexpr EnumName<Optimizer> optimizerNames[] = {
//       {Optimizer::SGD, "sgd"}, {Optimizer::Momentum, "momentum"}, ...};
//   nameOf(optimizerNames, Optimizer::SGD, "adamw")  -> "sgd"
//   valueOf(optimizerNames, "momentum")              -> Optimizer::Momentum
//   nameList(optimizerNames)                         -> "sgd, momentum or adamw"
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_SUPPORT_ENUMNAMES_H
#define PIPEC_SUPPORT_ENUMNAMES_H

#include "llvm/ADT/StringRef.h"

#include <cstddef>
#include <optional>
#include <string>

namespace pipec {

/// One row of an enum's name table.
template <typename E> struct EnumName {
  E value;
  llvm::StringRef name;
};

/// The name \p table gives \p value, or \p fallback where no row has it.
template <typename E, size_t N>
constexpr llvm::StringRef nameOf(const EnumName<E> (&table)[N], E value, llvm::StringRef fallback) {
  for (const EnumName<E> &row : table)
    if (row.value == value)
      return row.name;
  return fallback;
}

/// The value of the first row named exactly \p name, or nullopt.
template <typename E, size_t N>
std::optional<E> valueOf(const EnumName<E> (&table)[N], llvm::StringRef name) {
  for (const EnumName<E> &row : table)
    if (row.name == name)
      return row.value;
  return std::nullopt;
}

/// The names of \p table in its order, as "a, b or c", for an error that
/// lists what it expected.
template <typename E, size_t N> std::string nameList(const EnumName<E> (&table)[N]) {
  std::string list;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0)
      list += i + 1 == N ? " or " : ", ";
    list += table[i].name.str();
  }
  return list;
}

} // namespace pipec

#endif // PIPEC_SUPPORT_ENUMNAMES_H
