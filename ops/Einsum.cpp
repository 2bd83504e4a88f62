//===- Einsum.cpp - An Einsum equation, parsed once -----------------------===//
#include "ops/Einsum.h"

#include "llvm/ADT/STLExtras.h"
#include "llvm/ADT/SmallVector.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cctype>

using namespace llvm;

namespace pipec {
namespace {

using Labels = EinsumEquation::Labels;
constexpr int numLetters = EinsumEquation::numLetters;

Error fail(const Twine &why) { return createStringError(inconvertibleErrorCode(), why); }

int letterLabel(char c) {
  return std::isupper(static_cast<unsigned char>(c)) ? c - 'A' : 26 + (c - 'a');
}

char labelLetter(int l) { return static_cast<char>(l < 26 ? 'A' + l : 'a' + (l - 26)); }

/// One term of letters and at most one "..." as labels, the ellipsis as one
/// -1 placeholder (\p ellipsis: 0 or 1).
Expected<Labels> parseTerm(StringRef term, int &ellipsis) {
  Labels labels;
  ellipsis = 0;
  for (size_t i = 0; i < term.size(); ++i) {
    char c = term[i];
    if (std::isalpha(static_cast<unsigned char>(c))) {
      labels.push_back(letterLabel(c));
    } else if (term.substr(i).startswith("...") && ellipsis == 0) {
      labels.push_back(-1);
      ellipsis = 1;
      i += 2;
    } else {
      return fail("bad term '" + term + "' in the equation");
    }
  }
  return labels;
}

/// \p labels with the -1 replaced by the \p count ellipsis labels that end
/// at numLetters + \p total - 1.
Labels expandEllipsis(const Labels &labels, int count, int total) {
  Labels out;
  for (int l : labels) {
    if (l >= 0) {
      out.push_back(l);
      continue;
    }
    for (int j = total - count; j < total; ++j)
      out.push_back(numLetters + j);
  }
  return out;
}

} // namespace

std::vector<int> EinsumEquation::counts() const {
  std::vector<int> count(numLetters + ellipsisDims, 0);
  for (const Labels &in : inputs)
    for (int l : in)
      ++count[l];
  return count;
}

std::string EinsumEquation::letters(const Labels &labels) const {
  // The ellipsis's dimensions get the letters the equation leaves free, in
  // the order a-z, A-Z.
  std::string spare;
  for (char c : StringRef("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    if (text.find(c) == std::string::npos)
      spare.push_back(c);
  std::string out;
  for (int l : labels)
    out.push_back(l < numLetters ? labelLetter(l) : spare[l - numLetters]);
  return out;
}

Expected<EinsumEquation> parseEinsum(StringRef equation, ArrayRef<int64_t> ranks) {
  EinsumEquation eq;
  for (char c : equation)
    if (c != ' ')
      eq.text.push_back(c);
  if (eq.text.empty())
    return fail("missing attribute 'equation'");
  StringRef lhs = eq.text, rhs;
  bool explicitOutput = false;
  if (size_t arrow = lhs.find("->"); arrow != StringRef::npos) {
    rhs = lhs.substr(arrow + 2);
    lhs = lhs.take_front(arrow);
    explicitOutput = true;
  }
  SmallVector<StringRef, 4> terms;
  lhs.split(terms, ',');
  if (terms.size() != ranks.size())
    return fail(formatv("the equation '{0}' has {1} terms for {2} inputs", eq.text, terms.size(),
                        ranks.size()));
  std::vector<Labels> raw;
  std::vector<int> spans;
  for (size_t i = 0; i < terms.size(); ++i) {
    int ellipsis;
    Expected<Labels> labels = parseTerm(terms[i], ellipsis);
    if (!labels)
      return labels.takeError();
    int64_t letters = static_cast<int64_t>(labels->size()) - ellipsis;
    if (ranks[i] < letters || (!ellipsis && ranks[i] != letters))
      return fail(formatv("term '{0}' does not fit input {1} of rank {2}", terms[i], i, ranks[i]));
    spans.push_back(static_cast<int>(ranks[i] - letters));
    eq.ellipsisDims = std::max(eq.ellipsisDims, spans.back());
    raw.push_back(std::move(*labels));
  }
  int letterCount =
      static_cast<int>(count_if(StringRef("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
                                [&](char c) { return eq.text.find(c) == std::string::npos; }));
  if (eq.ellipsisDims > letterCount)
    return fail("too few free letters to write out '...'");
  for (size_t i = 0; i < raw.size(); ++i)
    eq.inputs.push_back(expandEllipsis(raw[i], spans[i], eq.ellipsisDims));
  std::vector<int> count = eq.counts();
  if (!explicitOutput) {
    for (int j = 0; j < eq.ellipsisDims; ++j)
      eq.output.push_back(numLetters + j);
    for (int l = 0; l < numLetters; ++l)
      if (count[l] == 1)
        eq.output.push_back(l);
    return eq;
  }
  int ellipsis;
  Expected<Labels> out = parseTerm(rhs, ellipsis);
  if (!out)
    return out.takeError();
  if (!ellipsis && eq.ellipsisDims > 0)
    return fail("the output drops the dimensions of '...'");
  eq.output = expandEllipsis(*out, eq.ellipsisDims, eq.ellipsisDims);
  std::vector<bool> seen(count.size(), false);
  for (int l : eq.output) {
    if (l < numLetters && count[l] == 0)
      return fail("an output label of '" + eq.text + "' is in no input");
    if (seen[l])
      return fail("an output label repeats in '" + eq.text + "'");
    seen[l] = true;
  }
  return eq;
}

} // namespace pipec
