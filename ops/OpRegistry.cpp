//===- OpRegistry.cpp - Ops.def as a table -------------------------------===//
#include "ops/OpRegistry.h"
#include "support/EnumNames.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/ADT/Twine.h"

#include <cassert>
#include <string>
#include <vector>

using namespace llvm;

namespace pipec {
namespace {

constexpr bool same(const char *a, const char *b) {
  for (; *a && *a == *b; ++a, ++b) {
  }
  return *a == *b;
}

/// True unless a column (stringized) names no implementation.
constexpr bool implemented(const char *column) { return !same(column, "none"); }

constexpr GradKind gradKind(const char *column) {
  return same(column, "none") ? GradKind::None
                              : (same(column, "missing") ? GradKind::Missing : GradKind::Rule);
}

// clang-format off
const OpDef rows[] = {
#define PIPEC_OP(ID, DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, SHAPE, COST, GRAD, CPU, DEVICE, FOLD,    \
                 FLAGS, SHARD)                                                                     \
    {OpId::ID, OpDomain::DOMAIN, NAME, SINCE, MIN_IN, MAX_IN, FLAGS, gradKind(#GRAD),              \
     implemented(#CPU), implemented(#DEVICE), implemented(#FOLD), std::nullopt},
#define PIPEC_ELEMENTWISE(ID, DOMAIN, NAME, SINCE, ARITY, COST, GRAD, CPU, FOLD, FLAGS)            \
    {OpId::ID, OpDomain::DOMAIN, NAME, SINCE, ARITY, ARITY, FLAGS, gradKind(#GRAD), true, true,    \
     implemented(#FOLD), ElemOp::ID},
#include "ops/Ops.def"
};
// clang-format on

/// The name each domain has in a model; ONNX's default domain also has "ai.onnx".
constexpr EnumName<OpDomain> domainNames[] = {
    {OpDomain::Onnx, ""}, {OpDomain::Microsoft, "com.microsoft"}, {OpDomain::Pipec, "pipec"}};

/// Rows by "DOMAIN/NAME", each list in Ops.def's order.
const StringMap<std::vector<const OpDef *>> &index() {
  static const StringMap<std::vector<const OpDef *>> map = [] {
    StringMap<std::vector<const OpDef *>> m;
    for (const OpDef &def : rows)
      m[(Twine(def.domainName()) + "/" + def.name).str()].push_back(&def);
    return m;
  }();
  return map;
}

/// Row index of each element-wise code.
const std::vector<OpId> &elemRows() {
  static const std::vector<OpId> ids = [] {
    std::vector<OpId> v;
    for (const OpDef &def : rows)
      if (def.elem) {
        assert(static_cast<size_t>(*def.elem) == v.size() && "ElemOp out of Ops.def order");
        v.push_back(def.id);
      }
    return v;
  }();
  return ids;
}

} // namespace

StringRef OpDef::domainName() const { return nameOf(domainNames, domain, ""); }

ArrayRef<OpDef> allOps() { return rows; }

const OpDef &opDef(OpId id) {
  assert(static_cast<size_t>(id) < std::size(rows));
  return rows[static_cast<size_t>(id)];
}

const OpDef &opDef(ElemOp op) { return opDef(elemRows()[static_cast<size_t>(op)]); }

std::optional<OpDomain> opDomainOf(StringRef domain) {
  if (domain == "ai.onnx")
    return OpDomain::Onnx;
  return valueOf(domainNames, domain);
}

bool isOp(StringRef domain, StringRef type, OpId id) {
  const OpDef &def = opDef(id);
  return type == def.name && opDomainOf(domain) == def.domain;
}

const OpDef *lookupOp(StringRef domain, StringRef name, int64_t opset) {
  std::optional<OpDomain> d = opDomainOf(domain);
  if (!d)
    return nullptr;
  static const char *const names[] = {"", "com.microsoft", "pipec"};
  auto it = index().find((Twine(names[static_cast<int>(*d)]) + "/" + name).str());
  if (it == index().end())
    return nullptr;
  const OpDef *best = it->second.front();
  for (const OpDef *def : it->second)
    if (def->since <= opset && def->since >= best->since)
      best = def;
  return best;
}

} // namespace pipec
