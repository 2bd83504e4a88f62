//===- Graph.h - The op graph pipec imports from ONNX -------------------===//
//
// A Graph is the imported ONNX graph in SSA form: ops in topological order,
// values with element type and (after infer-shapes) static shape, and weights
// that reference their bytes in memory-mapped files instead of holding them.
// Ops keep a pointer to their ONNX NodeProto for attributes; the Graph owns
// the ModelProto those live in.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_IR_GRAPH_H
#define PIPEC_COMPILER_IR_GRAPH_H

#include "ops/OpRegistry.h"
#include "support/DType.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/Error.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/raw_ostream.h"

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace google::protobuf {
class Arena;
} // namespace google::protobuf

namespace onnx {
class ModelProto;
class NodeProto;
class TensorProto;
} // namespace onnx

namespace pipec {

/// Where the bytes of a weight live: a range of one of the Graph's mapped
/// files (the model file itself for weights stored inline, or an external
/// data file).
struct WeightRef {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// A tensor whose values are known at compile time and small enough to hold:
/// shape arithmetic, scalars, folded shape subgraphs. Integer and bool types
/// keep their values in `ints`, floating types in `floats`.
struct ConstTensor {
  DType type = DType::Undefined;
  std::vector<int64_t> shape;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  int64_t numElements() const;
  bool isFloat() const { return isFloatDType(type); }
  /// Element \p i as an integer (floats are truncated).
  int64_t intAt(int64_t i) const;
  /// Element \p i as a double.
  double floatAt(int64_t i) const;
};

/// How symbolic input dimensions are bound to numbers.
/// How a weight is split over the tensor-parallel ranks of its stage
/// (shard-tensors): its axis, seen as `stride` blocks of equal size, each cut
/// into `parts` pieces; rank t holds piece t of every block. A fused QKV
/// weight's output axis has stride 3, so each rank holds its heads' columns
/// of Q, of K and of V.
struct TensorShard {
  int axis = 0;
  int parts = 1;
  int64_t stride = 1;
};

struct ShapeBindings {
  /// Whole input shapes by input name (`--input-shape NAME=D0,D1,..`).
  std::map<std::string, std::vector<int64_t>> inputShapes;
  /// Named symbolic dimensions (`--dim NAME=V`), e.g. "past_seq_len" = 2.
  std::map<std::string, int64_t> dims;
  /// Dimensions named like a batch ("batch", "batch_size", "N").
  int64_t batch = 1;
  /// Dimensions named like a sequence ("seq", "sequence_length", ...).
  int64_t seq = 128;
  /// Dimensions named like a past length ("past_sequence_length").
  int64_t past = 0;
};

/// The number a symbolic dimension \p name at \p position gets under
/// \p bindings; std::nullopt when no rule names it.
std::optional<int64_t> bindSymbolicDim(const ShapeBindings &bindings, llvm::StringRef name,
                                       size_t position);

/// Weights are the tensors a training run would update: floating tensors of
/// more than one element, and large 8-bit (quantized) tensors.
bool looksLikeParameter(DType type, int64_t elements);

enum class ValueKind {
  Input,      ///< a graph input fed at run time
  Weight,     ///< a parameter: an initializer, a Constant node tensor, or
              ///< derived from those alone (e.g. ConstantOfShape fills)
  Constant,   ///< a small compile-time value (shape arithmetic, scalars)
  Activation, ///< computed from inputs at run time
};

struct Value {
  std::string name;
  ValueKind kind = ValueKind::Activation;
  DType type = DType::Undefined;
  std::vector<int64_t> shape;
  bool shapeKnown = false;
  /// Index of the op that defines this value, or -1.
  int producer = -1;
  /// Ops that read this value (an op appears once per operand use).
  std::vector<int> users;
  bool isGraphOutput = false;
  /// Bytes of a weight stored in a file (inline or external data).
  std::optional<WeightRef> storage;
  /// The value when known at compile time and small.
  std::shared_ptr<const ConstTensor> constant;
  /// Index of the initializer or Constant node tensor in the ONNX graph, or
  /// -1; used to read inline typed data (float_data, int64_data, ...).
  int tensorIndex = -1;

  int64_t numElements() const;
  int64_t byteSize() const;
  bool isParameter() const { return kind == ValueKind::Weight; }
};

struct Op {
  std::string name;
  /// The module path the exporter recorded for the node, in torch's legacy
  /// naming ("/model/layers.0/self_attn/q_proj/MatMul"): the node's name when
  /// it is such a path, else what node metadata says (torch's dynamo
  /// exporter keeps it in metadata_props), else empty.
  std::string scope;
  std::string opType;
  std::string domain; ///< "" for the default ONNX domain
  /// Ops.def's row for the op, resolved once by setType; null for ops pipec
  /// does not know (another domain, an op with no row).
  const OpDef *def = nullptr;
  /// Value ids; -1 for an omitted optional input or output.
  std::vector<int> inputs;
  std::vector<int> outputs;
  /// Outer-scope values read by the op's subgraphs (If/Loop/Scan bodies).
  std::vector<int> captures;
  /// Index of the NodeProto in the model's top-level graph.
  int nodeIndex = -1;
  /// Per input of an op a pass made from nodes of the file (fuse-attention):
  /// the (node, input) of the file that read the same value, so that what
  /// is recorded against the file (untied copies, a parameter's readers)
  /// names the file's node. Empty for an op of the file.
  std::vector<std::pair<int, int>> fileReads;
  /// Set by passes that remove the op; compact() drops dead ops.
  bool dead = false;

  /// Sets the op's type and domain ("ai.onnx" is kept as "") and its row.
  void setType(llvm::StringRef domain, llvm::StringRef type);
  /// True when the op is Ops.def's row \p id.
  bool is(OpId id) const { return def && def->id == id; }
  bool has(OpFlags flag) const { return def && def->has(flag); }
};

/// The imported graph. Immutable in shape of its contract: passes edit it in
/// place and call compact() when they remove ops.
class Graph {
public:
  Graph();
  ~Graph();
  Graph(Graph &&) noexcept;
  Graph &operator=(Graph &&) noexcept;

  /// Path of the model file as given to the importer.
  std::string path;
  /// Owns `model` and every message in it: one allocation region instead of
  /// hundreds of thousands of small ones.
  std::unique_ptr<google::protobuf::Arena> arena;
  /// The model as parsed, with inline weight bytes replaced by references.
  onnx::ModelProto *model = nullptr;
  /// Mapped files: [0] is the model file, then external data files.
  std::vector<std::unique_ptr<llvm::MemoryBuffer>> files;
  std::vector<std::string> fileNames;
  /// Tensors of Constant nodes (owned by `model`); a Value's tensorIndex past
  /// the initializers indexes this list.
  std::vector<const onnx::TensorProto *> constantTensors;

  std::vector<Value> values;
  /// Ops in topological order.
  std::vector<Op> ops;
  std::vector<int> inputs;
  std::vector<int> outputs;
  llvm::StringMap<int> valueIds;
  /// Opset version per domain ("" is ai.onnx).
  std::map<std::string, int64_t> opsets;
  /// How symbolic dimensions were bound at import.
  ShapeBindings bindings;
  /// Embedding tables whose row of this index takes no gradient (torch's
  /// padding_idx): `--pad-row`, or the pad_token_id of a checkpoint's
  /// config. Differentiate's Gather rule reads it.
  std::map<std::string, int64_t> paddingRows;
  /// T: the ranks each stage's tensors are split over (`--tp`); 1 for none.
  int tensorParallel = 1;
  /// `--sequence-parallel`: what stays outside the split products (norms,
  /// residuals) is split on the sequence over the same T ranks.
  bool sequenceParallel = false;
  /// The weights each tensor-parallel rank trains on its share of the
  /// sequence (a norm's scale): their gradients are summed over the T ranks
  /// before the optimizer.
  std::set<std::string> sequenceGrads;
  /// Compiled for training (`--mode train`): a step keeps no graph output
  /// but the loss, so shard-tensors gathers none.
  bool training = false;
  /// Nodes of the model file's graph; passes append theirs after them.
  int fileNodes = 0;
  /// Attention fused into one node for training (fuse-attention); false
  /// under --attention unfused.
  bool fuseAttention = true;
  /// autocast rewrote the graph's float32 activations to bf16 where
  /// torch.autocast would (--autocast): its values carry the types a run
  /// stores, and the memory model counts them as they are.
  bool autocast = false;
  /// The weights shard-tensors split, by name: each Value's shape is one
  /// rank's piece, the plan's tensor the whole (PlanFile's weight shards).
  std::map<std::string, TensorShard> shards;
  /// Non-fatal findings of the importer and passes, in the order found.
  std::vector<std::string> warnings;
  /// The symbolic input dimensions the importer bound (name, value), in the
  /// order met; errors that a binding may cause name them.
  std::vector<std::pair<std::string, int64_t>> boundDims;

  const onnx::NodeProto &node(const Op &op) const;
  int64_t opsetFor(llvm::StringRef domain) const;

  /// Adds a value; \p name must not exist yet.
  int addValue(llvm::StringRef name, ValueKind kind);
  int findValue(llvm::StringRef name) const;

  /// The raw little-endian bytes of a weight with file storage. The memory
  /// stays valid while the Graph lives.
  llvm::Expected<llvm::ArrayRef<uint8_t>> storageBytes(const Value &value) const;
  /// Reads a value that is known at compile time (file storage, inline
  /// typed data or a folded constant). Refuses more than \p maxElements.
  llvm::Expected<std::shared_ptr<const ConstTensor>> readConstant(int valueId,
                                                                  int64_t maxElements) const;

  /// Recomputes producer and users from the ops.
  void rebuildUses();
  /// Drops dead ops and renumbers; value ids stay valid.
  void compact();
  /// Total parameter elements (weights reachable from live ops).
  int64_t parameterCount() const;
  int liveOpCount() const;
  /// Whether value \p id is a weight derived at run time from a float
  /// weight (autocast's bf16 copy, a tied head's Transpose), not a stored
  /// one or a fill: the fold-weights pass makes it once per weight update,
  /// and the memory and time models count it so.
  bool isDerivedWeight(int id) const;
  /// Whether value \p id is a weight the model stores as a fill (a
  /// ConstantOfShape of a light model, which fold-constants made a weight:
  /// support/FillTensor.h), a parameter like an initializer.
  bool isFillWeight(int id) const;
};

/// Prints one line per value and op; used by --print-after and tests.
void printGraph(const Graph &graph, llvm::raw_ostream &os);
/// Checks SSA and topological order (and shapes when \p requireShapes).
llvm::Error verifyGraph(const Graph &graph, bool requireShapes);

/// "op 'NAME' (TYPE)" for diagnostics; uses the first output if unnamed.
std::string describeOp(const Graph &graph, const Op &op);
/// "[2,3,4]" or "[?]" when unknown.
std::string formatShape(const std::vector<int64_t> &shape, bool known = true);

} // namespace pipec

#endif // PIPEC_COMPILER_IR_GRAPH_H
