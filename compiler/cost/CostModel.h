//===- CostModel.h - Per-layer F / I / W cost on a HardwareSpec ---------===//
//
// An analysis of a LayerGraph: FLOPs and bytes moved by every op for the
// forward pass (F), the backward pass for inputs (I) and the backward pass
// for weights (W), and the time of each on a HardwareSpec by a roofline:
//   t = max(FLOPs / FLOP/s, bytes / memory bandwidth) + launch overhead
//       + min(GEMM calls x GEMM overhead, FLOPs / FLOP/s),
// at the peak FLOP/s for matrix products and the spec's vector rate for the
// rest (HardwareSpec::flopsFor), the sum of the first two instead of their
// max where the spec says so (CPU ranks, HardwareSpec::sumsComputeAndMemory),
// and in W, per float weight, adding the microbatch's gradient into the
// step's accumulator (three float32 passes over the weight; none on CPU ranks
// for a float32 weight whose gradient a product makes, which the GEMM adds
// into the accumulator with beta = 1). The zero-bubble schedules need I and W
// apart. A measured cost table
// (`compile --costs FILE`) overrides the roofline per layer.
//
// Backward rules (FLOPs): a GEMM X W (weight W) costs the same again for dX
// and again for dW; a GEMM of two activations costs twice for the two input
// gradients and nothing for W; a convolution costs its forward FLOPs for dX
// and again for dW; elementwise, normalization and softmax ops cost about
// their forward for dX, and one pass over the output for dgamma, dbeta or a
// bias; an embedding lookup costs nothing for I and a scatter-add of its
// output for W. Ops without a rule get F = one FLOP per output element,
// I = F, W = 0, and are listed as defaulted so that reports flag them. The
// rule of each op is its COST column in ops/Ops.def (OpCosts.h).
//
//===----------------------------------------------------------------------===//
#ifndef PIPEC_COMPILER_COST_COSTMODEL_H
#define PIPEC_COMPILER_COST_COSTMODEL_H

#include "compiler/cost/HardwareSpec.h"
#include "compiler/cost/OpCosts.h"
#include "compiler/ir/LayerGraph.h"

#include <array>

namespace pipec {

enum class Precision { FP32, BF16 };
llvm::Expected<Precision> parsePrecision(llvm::StringRef name);
llvm::StringRef precisionName(Precision precision);

/// The cost of one op; ops that only compute constants cost nothing.
OpCost opCost(const Graph &graph, const Op &op, Precision precision);

struct LayerCost {
  std::string name;
  LayerKind kind = LayerKind::Other;
  std::array<double, 3> flops{};
  std::array<double, 3> bytes{};
  /// Seconds per microbatch for F, I and W.
  std::array<double, 3> time{};
  int64_t params = 0;
  /// Bytes of activations kept for backward per microbatch: every forward
  /// value the layer makes until countActivationMemory (after differentiate)
  /// narrows it to those its backward reads, none in inference.
  int64_t activationBytes = 0;
  /// The most bytes its forward or backward holds at once beyond what it
  /// keeps: temporaries, gradients, the weight-gradient terms
  /// (countActivationMemory; 0 until then).
  int64_t workingBytes = 0;
  /// Bytes of the weights the layer derives from float weights at run time
  /// (autocast's bf16 copies, a tied head's Transpose): made once per
  /// optimizer step and held by the stage like its weights
  /// (countActivationMemory; 0 until then).
  int64_t derivedWeightBytes = 0;
  /// Bytes entering the layer from earlier ones (what recompute keeps).
  int64_t inputBytes = 0;
  /// Bytes crossing the boundary after this layer.
  int64_t boundaryBytes = 0;
  /// Seconds of time (included in it) the layer's sums over the stage's
  /// tensor-parallel ranks take per microbatch (--tp).
  double tpCommTime = 0;
  /// Times come from a measured cost table.
  bool measured = false;
  int defaultedOps = 0;
  double totalTime() const { return time[0] + time[1] + time[2]; }
};

struct CostTable {
  std::string hardware;
  Precision precision = Precision::BF16;
  std::vector<LayerCost> layers;
  /// Op types costed by the default rule, sorted.
  std::vector<std::string> defaultedOpTypes;
};

/// Bytes of value \p id of \p graph as the run would hold it: under bf16
/// precision a float32 value is counted as bf16, unless autocast gave the
/// graph's values the types a run stores (Graph::autocast).
double bytesAt(const Graph &graph, int id, Precision precision);

/// Roofline costs of every layer of \p layers on \p hardware.
CostTable computeCosts(const LayerGraph &layers, const HardwareSpec &hardware, Precision precision);

/// Overrides times from a measured cost table, a JSON file:
///   {"format_version": 1, "hardware": "h100",
///    "layers": [{"name": "...", "forward_s": .., "backward_input_s": ..,
///                "backward_weight_s": ..}, ...]}
/// Layers are matched by name; a name the model does not have is an error
/// naming the file and the layer.
llvm::Error applyMeasuredCosts(CostTable &table, llvm::StringRef path);

/// Writes \p table in the format applyMeasuredCosts reads.
void writeCostTable(const CostTable &table, llvm::raw_ostream &os);

} // namespace pipec

#endif // PIPEC_COMPILER_COST_COSTMODEL_H
