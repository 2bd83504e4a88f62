//===- Einsum.h - An Einsum equation, parsed once for kernel and gradient -===//
//
// Einsum's "equation" attribute read against its operands' ranks, for the
// CPU kernel (runtime/cpu/EinsumKernels.cpp) and the gradient rule
// (passes/grad/EinsumGrads.cpp) alike. Each dimension of each operand and of
// the output gets a label: letters are labels 0-51 in ASCII order (A-Z, then
// a-z); the dimensions an ellipsis stands for are labels 52 and up,
// right-aligned across operands as broadcasting aligns them. The implicit
// output is the ellipsis, then the letters seen once, in ASCII order.
//
//   "bij,bjk->bik" on ranks (3, 3):  inputs {{27,34,35},{27,35,36}},
//                                    output {27,34,36}
//   "...ij,jk" on ranks (4, 2):      inputs {{52,53,34,35},{35,36}},
//                                    output {52,53,34,36}
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_OPS_EINSUM_H
#define PIPEC_OPS_EINSUM_H

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pipec {

struct EinsumEquation {
  /// Labels 0-51 are letters; ellipsis dimensions are numLetters and up.
  static constexpr int numLetters = 52;
  using Labels = std::vector<int>;

  /// The equation without spaces, as given.
  std::string text;
  std::vector<Labels> inputs;
  Labels output;
  /// How many dimensions the ellipsis stands for (the most of any operand).
  int ellipsisDims = 0;

  /// How many times each label appears over the inputs.
  std::vector<int> counts() const;
  /// \p labels written as letters: a letter label as itself, an ellipsis
  /// label as a letter the equation does not use (the same one for the same
  /// label), so that the result is an explicit equation's term.
  std::string letters(const Labels &labels) const;
};

/// Parses \p equation for operands of \p ranks. The error says what is wrong
/// with the equation ("bad term 'a1' in the equation"), for the caller to
/// prefix with the node.
llvm::Expected<EinsumEquation> parseEinsum(llvm::StringRef equation, llvm::ArrayRef<int64_t> ranks);

} // namespace pipec

#endif // PIPEC_OPS_EINSUM_H
