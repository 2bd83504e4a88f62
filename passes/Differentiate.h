//===- Differentiate.h - differentiate: backward ops per layer, split I / W ===//
//
// Reverse-mode autodiff at compile time. For every layer, from the last to
// the first, the gradient rule of each op (in reverse topological order)
// emits backward nodes. Nodes that produce the gradient of a weight, or of a
// value computed from weights alone (a tied embedding's Transpose), go to the
// layer's weight-gradient list W; all other nodes go to its input-gradient
// list I. Gradients are ONNX ops where ONNX has one and ops of domain "pipec"
// (documented below; runtime/cpu/GradKernels implements them) where it has
// not.
//
// Rules exist for: MatMul (2-D, batched, broadcast; not 1-D operands), Gemm
// (transA/transB, alpha/beta, bias C), Add, Sub, Mul, Div, Sum, Max, Min (numpy
// broadcasting; Max / Min send dY to the first operand equal to Y), Clip (for
// X; not for the bounds), every unary element-wise op whose row of ops/Ops.def
// has GRAD unary (Relu, Tanh, Sigmoid, Erf, Gelu, Neg, Abs, Sqrt, Reciprocal,
// Exp, Log, Sin, Cos, Atan, Softplus, LeakyRelu, Elu, HardSigmoid, HardSwish,
// ...: one pipec.UnaryGrad each), Pow (constant scalar exponent), ReduceMean
// and ReduceSum, Softmax, LayerNormalization, Gather (gradient for the data
// operand: embeddings), Reshape, Flatten, Squeeze, Unsqueeze, Transpose,
// Expand, Concat, Split, Slice (step 1), Where, Cast, Identity and Dropout (as
// identity: inference-mode dropout), SoftmaxCrossEntropyLoss (no class weights,
// reduction mean or sum), Conv (1 to 3 spatial dimensions; strides, pads,
// dilations, group, every auto_pad; X, W and bias B), MaxPool and AveragePool
// (1 to 3 spatial dimensions, ceil_mode, dilations, count_include_pad; output 0
// only), GlobalAveragePool, GlobalMaxPool and BatchNormalization in inference
// mode (training_mode = 0: X, Scale and B; the running mean and variance are
// statistics and get no gradient, so they have no entry in
// Backward::weightGrads). Values of kind Weight are trainable when they are
// initializers of a float type; a registered buffer (e.g. a rotary cos/sin
// table) gets a gradient like any weight, which the optimizer may ignore. No
// gradient flows through the ops whose GRAD is none (integer and bool results;
// Floor, Ceil, Round and Sign, whose derivative is zero). The rules are
// passes/grad/GradRules.h's.
//
// Naming: the gradient of value V is "grad:V". When V has several users its
// contributions are named "grad:V#K" and summed by a Sum node into "grad:V"
// in the layer of V's producer. Temporaries are named "bwd:N" (N counts up).
//
// Order of evaluation, the runtime's contract: forward of every layer (plus
// Backward::lossForward after the last), then for layers L = last..0 the
// list inputGrad[L] followed by weightGrad[L]. weightGrad[L] may read tensors
// made by inputGrad[L] (e.g. the summed "grad:Y" of a layer's output) and by
// the I lists of later layers; inputGrad[L] never reads a W list's tensors.
// Both may read forward values of any layer and of the graph inputs.
//
// Gradients of the tensors that cross a layer boundary ("grad:V", or the
// contributions "grad:V#K" when V has users in several layers) are what
// crosses the same boundary backward.
//
// A backward read of a value made by an exact widening Cast in the same
// layer (bf16 to float32: autocast's casts before torch's float32 ops) reads
// "V.again.iL" or "V.again.wL" instead, a Cast of V's narrow input placed
// before the list's first reader: a microbatch keeps the narrow value, not
// the wide copy, and the values are the same.
//
// Before:  layer 0: Y = MatMul(X, W1); H = Relu(Y)
//          layer 1: Z = MatMul(H, W2); loss = ReduceSum(Z, keepdims=0)
// After:   I[1]: grad:loss = Constant(1)
//                grad:Z = Expand(Reshape(grad:loss, [1, 1]), [B, N])
//                grad:H = MatMul(grad:Z, Transpose(W2, perm=[1, 0]))
//          W[1]: grad:W2 = Gemm(Reshape(H, [-1, K]), Reshape(grad:Z, [-1, N]),
//                               transA=1)
//          I[0]: grad:Y = pipec.UnaryGrad(grad:H, Y, op="Relu")
//          W[0]: grad:W1 = Gemm(Reshape(X, ..), Reshape(grad:Y, ..), transA=1)
//
// pipec-domain ops (inputs; outputs; attributes):
//  - SumTo(dY; dX; shape: ints). dY summed over the dimensions along which
//    `shape` was broadcast to dY's shape (numpy rules).
//  - UnaryGrad(dY, A; dX; op: string, and the forward node's attributes).
//    dX = dY * f'(A), f being the math of the unary element-wise op `op` of
//    the default domain (math/ElementMath.h) with the attributes
//    the node carries (alpha, beta, gamma, approximate, as the forward
//    node's). A is the forward input X when that math's derivative reads the
//    input (GradFrom::Input: Relu, Erf, Gelu, Log, ...) and the forward
//    output Y when it reads the output (GradFrom::Output: Tanh, Sigmoid,
//    Exp, Sqrt, Reciprocal, Tan). f'(A) is computed in double and rounded
//    once to dY's type.
//  - SoftmaxGrad(dY, Y; dX; axis: int). Y = softmax(X, axis);
//    dX = Y * (dY - sum(dY * Y, axis)).
//  - GatherGrad(dY, Indices; dData; axis: int, shape: ints). Scatter-add of
//    dY into zeros of `shape` (Data's shape) along `axis`; negative indices
//    count from the end.
//  - GatherElementsGrad(dY, Indices; dData; axis: int, shape: ints).
//    Zeros of `shape` (Data's shape) with each dY element added at the
//    element of Data that GatherElements read for it.
//  - GatherNDGrad(dY, Indices; dData; batch_dims: int, shape: ints). Zeros
//    of `shape` with each slice of dY added at the slice of Data that its
//    index tuple addressed (GatherND's layout, batch_dims leading batch
//    dimensions).
//  - LayerNormGradInput(dY, X, Scale; dX; axis: int, epsilon: float).
//    Normalised axes are axis..rank-1; with Xh = (X - mean) * rstd and
//    G = dY * Scale: dX = rstd * (G - mean(G) - Xh * mean(G * Xh)).
//  - LayerNormGradWeight(dY, X; dScale; axis: int, epsilon: float,
//    shape: ints). dScale = sum over the leading axes of dY * Xh, reshaped
//    to `shape` (Scale's shape). It reads only forward values and dY, so it
//    can run in W long after I.
//  - ConvGradInput(dY, W; dX; kernel_shape, strides, dilations, pads: ints,
//    group: int, shape: ints). The gradient of Conv(X, W) for X, of
//    `shape` (X's shape): per image and group, W^T dY scattered back over
//    the windows (col2im). pads are explicit, begin then end per spatial
//    dimension (the pass resolves auto_pad); the output's spatial sizes are
//    dY's.
//  - ConvGradWeight(dY, X; dW; kernel_shape, strides, dilations, pads: ints,
//    group: int, shape: ints). The gradient for W, of `shape` (W's shape):
//    dY times the transposed im2col columns of X, summed over the batch. The
//    bias gets SumTo over all but the channel dimension.
//  - MaxPoolGrad(dY, X; dX; kernel_shape, strides, dilations, pads: ints).
//    Each dY element is added at the position of its window's maximum in X
//    (the first one in row-major window order, padding never), recomputed
//    from X as the forward kernel picks it. GlobalMaxPool uses it with the
//    whole spatial extent as the window.
//  - AveragePoolGrad(dY; dX; kernel_shape, strides, dilations, pads: ints,
//    count_include_pad: int, shape: ints). Each dY element divided by its
//    window's count (positions inside the padded input with
//    count_include_pad, inside X otherwise) and added to the window's
//    positions inside X; dX has `shape`.
//  - ResizeGrad(dY, X, roi, scales, sizes; dX; the forward Resize's
//    attributes). X and the optional roi, scales and sizes are the forward
//    node's inputs; dX is the adjoint of that Resize (linear in X) applied
//    to dY: each output's gradient added to the input positions it was
//    interpolated from, with the same weights; extrapolated outputs add
//    nothing.
//  - BatchNormGradWeight(dY, X, Mean, Var; dScale; epsilon: float). X
//    [N, C, d1..], the others [C]; dScale[c] = sum over all but dimension 1
//    of dY * (X - Mean[c]) / sqrt(Var[c] + epsilon). (Inference-mode dX is
//    dY * Scale / sqrt(Var + epsilon) in ONNX ops.)
//  - SoftmaxCrossEntropyLossGrad(dLoss, Scores, Labels; dScores;
//    reduction: "mean" | "sum", ignore_index: int, optional). Scores
//    [N, C, d1..], Labels int [N, d1..], dLoss a scalar;
//    dScores = dLoss * (softmax(Scores, 1) - onehot(Labels)) / count, count
//    being the number of labels != ignore_index for "mean" and 1 for "sum";
//    ignored positions get 0.
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_PASSES_DIFFERENTIATE_H
#define PIPEC_PASSES_DIFFERENTIATE_H

#include "compiler/ir/LayerGraph.h"

#include "onnx/onnx_pb.h"

#include "llvm/Support/raw_ostream.h"

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace pipec {

/// Which scalar is minimised.
struct LossSpec {
  enum class Kind {
    /// A float scalar output of the model itself, whatever its name.
    ModelOutput,
    /// mean((output - labels)^2) over all elements; labels float, output's
    /// shape.
    Mse,
    /// SoftmaxCrossEntropyLoss(output, labels), mean reduction, class
    /// dimension 1; labels integer.
    SoftmaxCrossEntropy,
  };
  Kind kind = Kind::ModelOutput;
  /// The output the loss is (ModelOutput) or is computed from (empty: the
  /// graph's first output).
  std::string output;
  /// The graph input holding the labels (Mse, SoftmaxCrossEntropy).
  std::string labels;
};

/// What the user said about the loss: compile's --loss, --loss-fn and
/// --labels.
struct LossOptions {
  /// --loss NAME: the output to train against; empty: found by structure.
  std::string output;
  /// --loss-fn: a loss pipec adds over an output (Mse or
  /// SoftmaxCrossEntropy); ModelOutput when none was asked for.
  LossSpec::Kind addedLoss = LossSpec::Kind::ModelOutput;
  /// --labels INPUT: the graph input an added loss compares with.
  std::string labels;
};

/// The loss a plan trains against, and the sentence the compile summary
/// and the report show.
struct LossChoice {
  /// Empty when the model has nothing to train against (then `reason` says
  /// why and what to pass).
  std::optional<LossSpec> spec;
  std::string reason;
};

/// The float initializers of \p graph that are data, not parameters, and
/// get no gradient: rotary position tables an exporter folded, tensors of
/// one entry per sample (a batch's attention mask, a folded zeros_like),
/// masks (filled with infinities or the lowest float; or read only as a
/// fused attention's masks), and Constant node fills (one value everywhere,
/// rank 2 or more: a computed torch.zeros).
std::vector<bool> dataWeights(const Graph &graph);

/// Per value of \p graph: whether a training step computes its gradient
/// (it is computed from a trainable weight through ops whose rules pass
/// one on), as differentiate decides it.
std::vector<bool> gradientValues(const Graph &graph);

/// Chooses the loss of \p graph (after infer-shapes) by structure, never
/// by a name:
///  - the loss is the graph output that is a float scalar (rank 0 or one
///    element) and depends on a trainable weight through differentiable
///    ops; exactly one such output is taken whatever it is called;
///  - `--loss NAME` picks the output and always wins: a scalar is the loss,
///    a tensor needs --loss-fn;
///  - pipec adds a loss (`--loss-fn` with `--labels INPUT`) only when asked
///    and only over a non-scalar output.
/// Fails, in one line, when several outputs could be the loss (listing them
/// and naming --loss), when the flags name what the model lacks, or when a
/// loss is added to a model that computes its own.
llvm::Expected<LossChoice> chooseLoss(const Graph &graph, const LossOptions &options);

/// A running buffer a step updates from the batches it saw (a training-mode
/// BatchNormalization's running mean or variance): after the optimizer,
/// buffer = momentum * buffer + (1 - momentum) * the mean of `statistic`
/// over the step's microbatches and data-parallel replicas.
struct RunningStat {
  /// The initializer updated.
  std::string buffer;
  /// The value holding one microbatch's statistic, made in the W list of
  /// `layer`.
  std::string statistic;
  float momentum = 0.9f;
  int layer = 0;
  /// The node that keeps the statistic.
  std::string node;
};

/// The backward program of a model.
struct Backward {
  /// Per layer, in the layer order of the LayerGraph.
  std::vector<std::vector<onnx::NodeProto>> inputGrad;
  std::vector<std::vector<onnx::NodeProto>> weightGrad;
  /// Forward nodes that compute the loss (scalar "pipec:loss") when it is
  /// not a model output, or the count of its labels; they run after the last
  /// layer's forward.
  std::vector<onnx::NodeProto> lossForward;
  /// The name of the loss value.
  std::string lossValue;
  /// The number of labels the loss counts, computed in lossForward, when the
  /// loss is a mean over labels some of which may be ignored; empty else.
  /// The backward is seeded with it (see plan.proto's loss_count_value).
  std::string lossCountValue;
  /// Trainable weight (initializer) name -> name of its gradient value. A
  /// weight read by several layers gets its gradient summed in the W list of
  /// the lowest of those layers.
  std::map<std::string, std::string> weightGrads;
  /// Initializers read only as tables (through an op flagged Table in
  /// Ops.def, such as rotary frequencies into Sin and Cos, or the cosine and
  /// sine tables an exporter folded from them); they get no gradient through
  /// those reads.
  std::set<std::string> tableWeights;
  /// Float graph input name -> gradient name; filled only when asked for.
  std::map<std::string, std::string> inputGrads;
  /// The running buffers a step updates, in graph order.
  std::vector<RunningStat> runningStats;
};

/// Builds the backward program of \p graph (after infer-shapes: every
/// value's shape must be static) grouped as \p layers. Values that only
/// feed compile-time constants get no gradient. With \p graphInputGrads the
/// gradients of float graph inputs are computed too (into inputGrad[0]).
/// Fails naming the node for an op without a rule ("node 'N' (Op): no
/// gradient rule") or an unsupported form of one, and for a bad loss spec.
llvm::Expected<Backward> differentiate(const Graph &graph, const LayerGraph &layers,
                                       const LossSpec &loss, bool graphInputGrads = false);

/// The text --print-after=differentiate shows: the loss's forward nodes,
/// then per layer in the order the runtime evaluates them (last to first)
/// its I and W node lists, one node a line ("grad:H = MatMul(grad:Z, bwd:3)
/// {transB=1}"), then each trainable weight's gradient.
void printBackward(const Backward &backward, const LayerGraph &layers, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_PASSES_DIFFERENTIATE_H
