//===- ControlFlowKernels.cpp - If, Loop and Scan: a subgraph interpreter -===//
//
// pipec keeps a node with subgraphs as one opaque op (Ops.def's Subgraph
// flag): the compiler sees its inputs, the outer values its subgraphs
// capture (support/Subgraphs.h), and its outputs, never the subgraph's
// nodes. Its CPU kernel interprets the subgraph here, node by node, through
// runOp, in a scope that resolves a name in the subgraph first, then in
// each enclosing one, up to the node's inputs. The plan lists the captured
// values after the node's own inputs, so every name a subgraph reads from
// outside arrives as one of them.
//
// Semantics follow the ONNX operator specification (If 1-25, Loop 1-25,
// Scan 8 and 9-25); tensors only: sequence and optional values are refused
// where the model is imported.
//
//===----------------------------------------------------------------------===//
#include "ops/OpRegistry.h"
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"
#include "support/Attributes.h"

#include "onnx/onnx_pb.h"

#include "llvm/ADT/StringMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cstring>
#include <limits>

using namespace llvm;

namespace pipec::cpu {

namespace {

/// Where a subgraph's names resolve: its own values, then the enclosing
/// scope's, up to the node's inputs.
class Scope {
public:
  explicit Scope(const Scope *parent = nullptr) : parent(parent) {}
  void bind(StringRef name, Tensor value) {
    if (!name.empty())
      values[name] = std::move(value);
  }
  const Tensor *find(StringRef name) const {
    auto it = values.find(name);
    if (it != values.end())
      return &it->second;
    return parent ? parent->find(name) : nullptr;
  }

private:
  const Scope *parent;
  StringMap<Tensor> values;
};

/// The graph attribute \p name of the node, or an error naming it.
Expected<const onnx::GraphProto *> graphAttr(const OpContext &ctx, StringRef name) {
  const onnx::AttributeProto *attr = ctx.attr(name);
  if (!attr || !attr->has_g())
    return ctx.fail("missing graph attribute '" + name + "'");
  return &attr->g();
}

Expected<Outputs> runNode(const onnx::NodeProto &node, int64_t opset, const Scope &scope);

/// Runs \p body with its inputs bound to \p inputs (in order) inside
/// \p outer; returns its outputs.
Expected<Outputs> runGraph(const OpContext &ctx, const onnx::GraphProto &body,
                           ArrayRef<Tensor> inputs, const Scope &outer) {
  if (static_cast<size_t>(body.input_size()) != inputs.size())
    return ctx.fail(formatv("subgraph '{0}' takes {1} inputs, the op gives it {2}", body.name(),
                            body.input_size(), inputs.size()));
  Scope scope(&outer);
  for (size_t i = 0; i < inputs.size(); ++i)
    scope.bind(body.input(static_cast<int>(i)).name(), inputs[i]);
  for (const onnx::TensorProto &init : body.initializer()) {
    Expected<Tensor> t = fromTensorProto(init);
    if (!t)
      return ctx.fail("subgraph '" + body.name() + "': " + toString(t.takeError()));
    scope.bind(init.name(), std::move(*t));
  }
  for (const onnx::NodeProto &node : body.node()) {
    Expected<Outputs> outs = runNode(node, ctx.opset, scope);
    if (!outs)
      return ctx.fail("subgraph '" + body.name() + "': " + toString(outs.takeError()));
    for (int o = 0; o < node.output_size() && o < static_cast<int>(outs->size()); ++o)
      scope.bind(node.output(o), std::move((*outs)[o]));
  }
  Outputs result;
  for (const onnx::ValueInfoProto &out : body.output()) {
    const Tensor *t = scope.find(out.name());
    if (!t)
      return ctx.fail("subgraph '" + body.name() + "' does not compute its output '" + out.name() +
                      "'");
    result.push_back(*t);
  }
  return result;
}

Expected<Outputs> ifWithScope(const OpContext &ctx, const Scope &scope);
Expected<Outputs> loopWithScope(const OpContext &ctx, const Scope &scope);
Expected<Outputs> scanWithScope(const OpContext &ctx, const Scope &scope);

/// One node of a subgraph: a control-flow node recurses with the scope;
/// every other runs through runOp.
Expected<Outputs> runNode(const onnx::NodeProto &node, int64_t opset, const Scope &scope) {
  std::vector<const Tensor *> inputs;
  for (const std::string &name : node.input()) {
    if (name.empty()) {
      inputs.push_back(nullptr);
      continue;
    }
    const Tensor *t = scope.find(name);
    if (!t)
      return createStringError(inconvertibleErrorCode(),
                               "node '%s' (%s) reads '%s', which is "
                               "not defined in its scope",
                               nodeLabel(node).c_str(), node.op_type().c_str(), name.c_str());
    inputs.push_back(t);
  }
  bool defaultDomain = node.domain().empty() || node.domain() == "ai.onnx";
  if (defaultDomain && (isOp(node, OpId::If) || isOp(node, OpId::Loop) || isOp(node, OpId::Scan))) {
    OpContext ctx(node, opset, inputs, lookupOp("", node.op_type(), opset));
    if (isOp(node, OpId::If))
      return ifWithScope(ctx, scope);
    if (isOp(node, OpId::Loop))
      return loopWithScope(ctx, scope);
    return scanWithScope(ctx, scope);
  }
  return runOp(node, opset, inputs);
}

/// The scope of a node run from a plan: its inputs by name (the plan lists
/// the values its subgraphs capture among them).
Scope nodeScope(const OpContext &ctx) {
  Scope scope;
  for (size_t i = 0; i < ctx.numInputs(); ++i)
    if (const Tensor *t = ctx.optInput(i))
      scope.bind(ctx.node.input(static_cast<int>(i)), *t);
  return scope;
}

/// The value of a boolean (or numeric) one-element tensor.
Expected<bool> truth(const OpContext &ctx, const Tensor &t, StringRef what) {
  if (t.numElements() != 1)
    return ctx.fail(what + " must hold one element, not " + t.describe());
  return t.getDouble(0) != 0;
}

Expected<Outputs> ifWithScope(const OpContext &ctx, const Scope &scope) {
  const Tensor *cond = ctx.optInput(0);
  if (!cond)
    return ctx.fail("missing the condition (input 0)");
  Expected<bool> taken = truth(ctx, *cond, "the condition");
  if (!taken)
    return taken.takeError();
  Expected<const onnx::GraphProto *> branch =
      graphAttr(ctx, *taken ? "then_branch" : "else_branch");
  if (!branch)
    return branch.takeError();
  Expected<Outputs> outs = runGraph(ctx, **branch, {}, scope);
  if (outs && outs->size() != ctx.numOutputs())
    return ctx.fail(
        formatv("the branch gives {0} outputs for the node's {1}", outs->size(), ctx.numOutputs()));
  return outs;
}

/// The slice at \p index of \p t along \p axis, that axis removed.
Tensor sliceAt(const Tensor &t, int64_t axis, int64_t index) {
  Shape shape = t.shape();
  int64_t outer = product(ArrayRef<int64_t>(shape).take_front(axis));
  size_t inner = product(ArrayRef<int64_t>(shape).drop_front(axis + 1)) * storageSize(t.elemType());
  int64_t length = shape[axis];
  shape.erase(shape.begin() + axis);
  Tensor out(t.elemType(), shape);
  const char *src = static_cast<const char *>(t.rawData());
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(dst + o * inner, src + (o * length + index) * inner, inner);
  return out;
}

/// The tensors of \p slices stacked along a new \p axis; all have one shape
/// and type (an error otherwise).
Expected<Tensor> stack(const OpContext &ctx, ArrayRef<Tensor> slices, int64_t axis,
                       StringRef what) {
  const Tensor &first = slices.front();
  for (const Tensor &s : slices)
    if (s.shape() != first.shape() || s.elemType() != first.elemType())
      return ctx.fail(what + " changes from " + first.describe() + " to " + s.describe() +
                      " between iterations");
  Shape shape = first.shape();
  if (axis < 0 || axis > static_cast<int64_t>(shape.size()))
    return ctx.fail(
        formatv("axis {0} of {1} is out of range for rank {2}", axis, what, shape.size() + 1));
  int64_t outer = product(ArrayRef<int64_t>(shape).take_front(axis));
  size_t inner = product(ArrayRef<int64_t>(shape).drop_front(axis)) * storageSize(first.elemType());
  int64_t length = static_cast<int64_t>(slices.size());
  shape.insert(shape.begin() + axis, length);
  Tensor out(first.elemType(), shape);
  char *dst = static_cast<char *>(out.rawData());
  for (int64_t i = 0; i < length; ++i) {
    const char *src = static_cast<const char *>(slices[i].rawData());
    for (int64_t o = 0; o < outer; ++o)
      std::memcpy(dst + (o * length + i) * inner, src + o * inner, inner);
  }
  return out;
}

/// An empty scan output: [0] followed by the body output's declared shape,
/// which must be static.
Expected<Tensor> emptyScanOutput(const OpContext &ctx, const onnx::ValueInfoProto &info) {
  const onnx::TypeProto::Tensor &type = info.type().tensor_type();
  Shape shape = {0};
  for (const auto &dim : type.shape().dim()) {
    if (!dim.has_dim_value())
      return ctx.unsupported("a loop of no iterations whose scan output '" + info.name() +
                             "' has no static shape");
    shape.push_back(dim.dim_value());
  }
  Expected<DType> elem = elemTypeFromOnnx(type.elem_type());
  if (!elem)
    return elem.takeError();
  return Tensor(*elem, shape);
}

Expected<Outputs> loopWithScope(const OpContext &ctx, const Scope &scope) {
  Expected<const onnx::GraphProto *> bodyOrError = graphAttr(ctx, "body");
  if (!bodyOrError)
    return bodyOrError.takeError();
  const onnx::GraphProto &body = **bodyOrError;
  int64_t carried = body.input_size() - 2;
  if (carried < 0 || body.output_size() < carried + 1)
    return ctx.fail(formatv("the body has {0} inputs and {1} outputs: it needs the iteration "
                            "number and condition, and the condition and each loop-carried "
                            "value back",
                            body.input_size(), body.output_size()));
  if (ctx.numInputs() < static_cast<size_t>(2 + carried))
    return ctx.fail(formatv("{0} loop-carried values in the body, {1} inputs to the node", carried,
                            ctx.numInputs()));
  const Tensor *tripCount = ctx.optInput(0), *condIn = ctx.optInput(1);
  if (!tripCount && !condIn)
    return ctx.unsupported("a loop with neither a trip count nor a condition never ends");
  int64_t trips = std::numeric_limits<int64_t>::max();
  if (tripCount) {
    if (tripCount->numElements() != 1)
      return ctx.fail("the trip count must hold one element, not " + tripCount->describe());
    trips = static_cast<int64_t>(tripCount->getDouble(0));
  }
  bool go = true;
  if (condIn) {
    Expected<bool> c = truth(ctx, *condIn, "the condition");
    if (!c)
      return c.takeError();
    go = *c;
  }
  std::vector<Tensor> state;
  for (int64_t i = 0; i < carried; ++i) {
    const Tensor *v = ctx.optInput(static_cast<size_t>(2 + i));
    if (!v)
      return ctx.fail(formatv("missing loop-carried value (input {0})", 2 + i));
    state.push_back(*v);
  }
  size_t scans = static_cast<size_t>(body.output_size() - 1 - carried);
  std::vector<std::vector<Tensor>> scanned(scans);
  for (int64_t i = 0; i < trips && go; ++i) {
    std::vector<Tensor> in = {Tensor::scalar<int64_t>(i), Tensor::scalar<bool>(go)};
    in.insert(in.end(), state.begin(), state.end());
    Expected<Outputs> outs = runGraph(ctx, body, in, scope);
    if (!outs)
      return outs.takeError();
    Expected<bool> c = truth(ctx, (*outs)[0], "the body's condition");
    if (!c)
      return c.takeError();
    go = *c;
    for (int64_t k = 0; k < carried; ++k)
      state[k] = std::move((*outs)[1 + k]);
    for (size_t k = 0; k < scans; ++k)
      scanned[k].push_back(std::move((*outs)[1 + carried + k]));
  }
  Outputs result(state.begin(), state.end());
  for (size_t k = 0; k < scans; ++k) {
    const onnx::ValueInfoProto &info = body.output(static_cast<int>(1 + carried + k));
    Expected<Tensor> out = scanned[k].empty() ? emptyScanOutput(ctx, info)
                                              : stack(ctx, scanned[k], 0, "'" + info.name() + "'");
    if (!out)
      return out.takeError();
    result.push_back(std::move(*out));
  }
  return result;
}

/// Scan's axes and directions, one per scan input or output.
struct ScanLayout {
  std::vector<int64_t> inAxes, inReverse, outAxes, outReverse;
};

/// Runs Scan's body over \p states and \p scanIns (opset 9's form, no batch
/// axis): the final states, then the scan outputs.
Expected<Outputs> scanCore(const OpContext &ctx, const onnx::GraphProto &body,
                           std::vector<Tensor> states, ArrayRef<Tensor> scanIns,
                           const ScanLayout &layout, const Scope &scope) {
  size_t n = states.size();
  int64_t length = -1;
  for (size_t j = 0; j < scanIns.size(); ++j) {
    int64_t axis = layout.inAxes[j];
    if (axis < 0)
      axis += scanIns[j].rank();
    if (axis < 0 || axis >= scanIns[j].rank())
      return ctx.fail(formatv("scan input {0} {1} has no axis {2}", j, scanIns[j].describe(),
                              layout.inAxes[j]));
    int64_t len = scanIns[j].dim(axis);
    if (length >= 0 && len != length)
      return ctx.fail(formatv("scan inputs disagree in length: {0} and {1}", length, len));
    length = len;
  }
  if (length < 0)
    return ctx.fail("Scan needs at least one scan input");
  size_t k = static_cast<size_t>(body.output_size()) - n;
  std::vector<std::vector<Tensor>> scanned(k);
  for (int64_t t = 0; t < length; ++t) {
    std::vector<Tensor> in = states;
    for (size_t j = 0; j < scanIns.size(); ++j) {
      int64_t axis = layout.inAxes[j] < 0 ? layout.inAxes[j] + scanIns[j].rank() : layout.inAxes[j];
      in.push_back(sliceAt(scanIns[j], axis, layout.inReverse[j] ? length - 1 - t : t));
    }
    Expected<Outputs> outs = runGraph(ctx, body, in, scope);
    if (!outs)
      return outs.takeError();
    for (size_t s = 0; s < n; ++s)
      states[s] = std::move((*outs)[s]);
    for (size_t s = 0; s < k; ++s)
      scanned[s].push_back(std::move((*outs)[n + s]));
  }
  Outputs result(states.begin(), states.end());
  for (size_t s = 0; s < k; ++s) {
    const onnx::ValueInfoProto &info = body.output(static_cast<int>(n + s));
    if (scanned[s].empty()) {
      Expected<Tensor> empty = emptyScanOutput(ctx, info);
      if (!empty)
        return empty.takeError();
      result.push_back(std::move(*empty));
      continue;
    }
    if (layout.outReverse[s])
      std::reverse(scanned[s].begin(), scanned[s].end());
    int64_t axis = layout.outAxes[s];
    if (axis < 0)
      axis += scanned[s].front().rank() + 1;
    Expected<Tensor> out = stack(ctx, scanned[s], axis, "'" + info.name() + "'");
    if (!out)
      return out.takeError();
    result.push_back(std::move(*out));
  }
  return result;
}

/// Attribute \p name as \p count values, \p otherwise each where absent.
Expected<std::vector<int64_t>> perScan(const OpContext &ctx, StringRef name, size_t count,
                                       int64_t otherwise) {
  std::optional<Shape> given = ctx.attrInts(name);
  if (!given)
    return std::vector<int64_t>(count, otherwise);
  if (given->size() != count)
    return ctx.fail(formatv("{0} has {1} values for {2}", name, given->size(), count));
  return *given;
}

Expected<Outputs> scanWithScope(const OpContext &ctx, const Scope &scope) {
  Expected<const onnx::GraphProto *> bodyOrError = graphAttr(ctx, "body");
  if (!bodyOrError)
    return bodyOrError.takeError();
  const onnx::GraphProto &body = **bodyOrError;
  int64_t m = ctx.attrInt("num_scan_inputs", 0);
  bool batched = ctx.opset < 9; // Scan-8: sequence_lens first, and a batch axis.
  size_t first = batched ? 1 : 0;
  int64_t n = body.input_size() - m;
  if (m < 1 || n < 0 || body.output_size() < n)
    return ctx.fail(formatv("num_scan_inputs {0} does not fit a body of {1} inputs and {2} "
                            "outputs",
                            m, body.input_size(), body.output_size()));
  if (ctx.numInputs() < first + static_cast<size_t>(n + m))
    return ctx.fail(formatv("the body takes {0} values, the node has {1} inputs", n + m,
                            ctx.numInputs() - first));
  std::vector<Tensor> states, scanIns;
  for (int64_t i = 0; i < n + m; ++i) {
    const Tensor *t = ctx.optInput(first + static_cast<size_t>(i));
    if (!t)
      return ctx.fail(formatv("missing input {0}", first + i));
    (i < n ? states : scanIns).push_back(*t);
  }
  size_t k = static_cast<size_t>(body.output_size() - n);
  ScanLayout layout;
  auto read = [&](StringRef name, size_t count, std::vector<int64_t> &into) -> Error {
    Expected<std::vector<int64_t>> v = perScan(ctx, name, count, 0);
    if (!v)
      return v.takeError();
    into = std::move(*v);
    return Error::success();
  };
  if (!batched) {
    if (Error e = read("scan_input_axes", m, layout.inAxes))
      return e;
    if (Error e = read("scan_input_directions", m, layout.inReverse))
      return e;
    if (Error e = read("scan_output_axes", k, layout.outAxes))
      return e;
    if (Error e = read("scan_output_directions", k, layout.outReverse))
      return e;
    return scanCore(ctx, body, std::move(states), scanIns, layout, scope);
  }
  // Scan-8: every input has the batch axis 0; each batch row is one scan.
  if (Error e = read("directions", m, layout.inReverse))
    return e;
  layout.inAxes.assign(m, 0);
  layout.outAxes.assign(k, 0);
  layout.outReverse.assign(k, 0);
  if (scanIns[0].rank() < 1 || scanIns[0].dim(0) < 1)
    return ctx.unsupported("Scan-8 over an empty batch");
  int64_t batch = scanIns[0].dim(0);
  for (const std::vector<Tensor> *group : {&states, &scanIns})
    for (const Tensor &t : *group)
      if (t.rank() < 1 || t.dim(0) != batch)
        return ctx.fail(formatv("input {0} does not have the batch size {1}", t.describe(), batch));
  if (const Tensor *lens = ctx.optInput(0))
    for (int64_t i = 0; i < lens->numElements(); ++i)
      if (scanIns[0].rank() < 2 || lens->getDouble(i) != scanIns[0].dim(1))
        return ctx.unsupported("sequence_lens shorter than the scan inputs");
  std::vector<std::vector<Tensor>> rows(static_cast<size_t>(n) + k);
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<Tensor> rowStates, rowIns;
    for (const Tensor &t : states)
      rowStates.push_back(sliceAt(t, 0, b));
    for (const Tensor &t : scanIns)
      rowIns.push_back(sliceAt(t, 0, b));
    Expected<Outputs> outs = scanCore(ctx, body, std::move(rowStates), rowIns, layout, scope);
    if (!outs)
      return outs.takeError();
    for (size_t i = 0; i < outs->size(); ++i)
      rows[i].push_back(std::move((*outs)[i]));
  }
  Outputs result;
  for (size_t i = 0; i < rows.size(); ++i) {
    Expected<Tensor> out = stack(ctx, rows[i], 0, formatv("output {0}", i).str());
    if (!out)
      return out.takeError();
    result.push_back(std::move(*out));
  }
  return result;
}

} // namespace

KernelResult ifOp(const OpContext &ctx) { return ifWithScope(ctx, nodeScope(ctx)); }
KernelResult loop(const OpContext &ctx) { return loopWithScope(ctx, nodeScope(ctx)); }
KernelResult scan(const OpContext &ctx) { return scanWithScope(ctx, nodeScope(ctx)); }

} // namespace pipec::cpu
