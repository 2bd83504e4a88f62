//===- ModelGeneratorsTest.cpp - Tests of the synthetic model generators --===//
//
// Every family must pass the ONNX checker and strict shape inference at the
// supported opset extremes; node/initializer counts, weight tying, external
// data layout and determinism are checked on small models.
//
//===----------------------------------------------------------------------===//

#include "models/ModelGenerators.h"

#include "onnx/checker.h"
#include "onnx/shape_inference/implementation.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include "gtest/gtest.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

using namespace pipec::models;

namespace {

onnx::ModelProto generateOrFail(const GeneratorOptions &Opts) {
  llvm::Expected<onnx::ModelProto> Model = generateModel(Opts);
  if (!Model) {
    ADD_FAILURE() << llvm::toString(Model.takeError());
    return {};
  }
  return std::move(*Model);
}

/// Small but complete options for \p F.
GeneratorOptions smallOptions(Family F) {
  GeneratorOptions Opts;
  Opts.family = F;
  Opts.hidden = 32;
  Opts.heads = 4;
  Opts.vocab = 50;
  Opts.seq = 8;
  if (F == Family::Resnet) {
    Opts.hidden = 8;
    Opts.seq = 32;
    Opts.layers = 4;
    Opts.vocab = 10;
  }
  return Opts;
}

int countOps(const onnx::ModelProto &Model, llvm::StringRef OpType) {
  return std::count_if(Model.graph().node().begin(), Model.graph().node().end(),
                       [&](const onnx::NodeProto &N) { return N.op_type() == OpType; });
}

int countConsumers(const onnx::ModelProto &Model, llvm::StringRef Value) {
  int Count = 0;
  for (const onnx::NodeProto &N : Model.graph().node())
    for (const std::string &In : N.input())
      Count += In == Value;
  return Count;
}

bool hasNode(const onnx::ModelProto &Model, llvm::StringRef Name) {
  for (const onnx::NodeProto &N : Model.graph().node())
    if (N.name() == Name)
      return true;
  return false;
}

const onnx::TensorProto *findInitializer(const onnx::ModelProto &Model, llvm::StringRef Name) {
  for (const onnx::TensorProto &T : Model.graph().initializer())
    if (T.name() == Name)
      return &T;
  return nullptr;
}

/// Runs the checker and strict shape inference (type checks, node errors
/// thrown, data propagation); reports exceptions as test failures.
void checkAndInfer(onnx::ModelProto &Model) {
  try {
    onnx::checker::check_model(Model);
    onnx::ShapeInferenceOptions Options(/*check_type_val=*/true,
                                        /*strict_mode_val=*/1,
                                        /*data_prop_val=*/true);
    onnx::shape_inference::InferShapes(Model, onnx::OpSchemaRegistry::Instance(), Options);
  } catch (const std::exception &E) {
    ADD_FAILURE() << E.what();
  }
}

/// Expects every node output to have an inferred type with a fully static
/// shape.
void expectAllShapesStatic(const onnx::ModelProto &Model) {
  std::map<std::string, const onnx::TypeProto *> Types;
  for (const onnx::ValueInfoProto &VI : Model.graph().value_info())
    Types[VI.name()] = &VI.type();
  for (const onnx::ValueInfoProto &VI : Model.graph().output())
    Types[VI.name()] = &VI.type();
  for (const onnx::NodeProto &N : Model.graph().node())
    for (const std::string &Out : N.output()) {
      auto It = Types.find(Out);
      ASSERT_NE(It, Types.end()) << "no type inferred for " << Out;
      const onnx::TypeProto &T = *It->second;
      ASSERT_TRUE(T.has_tensor_type()) << Out;
      EXPECT_NE(T.tensor_type().elem_type(), 0) << Out;
      ASSERT_TRUE(T.tensor_type().has_shape()) << Out;
      for (const auto &Dim : T.tensor_type().shape().dim())
        EXPECT_TRUE(Dim.has_dim_value()) << "dynamic dim in " << Out;
    }
}

std::vector<int64_t> dimsOf(const onnx::ValueInfoProto &VI) {
  std::vector<int64_t> Dims;
  for (const auto &D : VI.type().tensor_type().shape().dim())
    Dims.push_back(D.has_dim_value() ? D.dim_value() : -1);
  return Dims;
}

/// A fresh directory for files written by one test.
std::string makeTempDir() {
  llvm::SmallString<128> Dir;
  std::error_code EC = llvm::sys::fs::createUniqueDirectory("pipec-gen", Dir);
  EXPECT_FALSE(EC) << EC.message();
  return std::string(Dir.str());
}

TEST(ModelGenerators, ParseFamily) {
  EXPECT_EQ(llvm::cantFail(parseFamily("gpt")), Family::Gpt);
  EXPECT_EQ(llvm::cantFail(parseFamily("llama")), Family::Llama);
  EXPECT_EQ(llvm::cantFail(parseFamily("bert")), Family::Bert);
  EXPECT_EQ(llvm::cantFail(parseFamily("mlp")), Family::Mlp);
  EXPECT_EQ(llvm::cantFail(parseFamily("resnet")), Family::Resnet);
  llvm::Expected<Family> Bad = parseFamily("transformerXL");
  ASSERT_FALSE(bool(Bad));
  EXPECT_NE(llvm::toString(Bad.takeError()).find("transformerXL"), std::string::npos);
}

TEST(ModelGenerators, RejectsBadOptions) {
  GeneratorOptions Opts;
  Opts.hidden = 30; // Not divisible by 4 heads.
  llvm::Expected<onnx::ModelProto> M = generateModel(Opts);
  ASSERT_FALSE(bool(M));
  llvm::consumeError(M.takeError());
  Opts = GeneratorOptions();
  Opts.opset = 12;
  M = generateModel(Opts);
  ASSERT_FALSE(bool(M));
  EXPECT_NE(llvm::toString(M.takeError()).find("opset"), std::string::npos);
}

/// family, opset, tiedEmbeddings, withLoss, batch.
using Variant = std::tuple<Family, int, bool, bool, int>;

class AllFamilies : public ::testing::TestWithParam<Variant> {};

TEST_P(AllFamilies, PassesCheckerAndShapeInference) {
  auto [F, Opset, Tied, Loss, Batch] = GetParam();
  GeneratorOptions Opts = smallOptions(F);
  Opts.opset = Opset;
  Opts.tiedEmbeddings = Tied;
  Opts.withLoss = Loss;
  Opts.batch = Batch;
  onnx::ModelProto Model = generateOrFail(Opts);
  ASSERT_GT(Model.graph().node_size(), 0);
  EXPECT_EQ(Model.ir_version(), 8);
  EXPECT_EQ(Model.producer_name(), "pipec");
  ASSERT_EQ(Model.opset_import_size(), 1);
  EXPECT_EQ(Model.opset_import(0).version(), Opset);

  checkAndInfer(Model);
  if (Batch > 0)
    expectAllShapesStatic(Model);

  // Interface: the first output and, with a loss, a scalar "loss".
  const auto &Outputs = Model.graph().output();
  ASSERT_EQ(Outputs.size(), Loss ? 2 : 1);
  int64_t B = Batch > 0 ? Batch : -1;
  std::vector<int64_t> Expected;
  switch (F) {
  case Family::Gpt:
  case Family::Llama:
    Expected = {B, Opts.seq, Opts.vocab};
    break;
  case Family::Bert:
    Expected = {B, 2};
    break;
  case Family::Mlp:
  case Family::Resnet:
    Expected = {B, Opts.vocab};
    break;
  }
  EXPECT_EQ(Outputs[0].name(), F == Family::Mlp ? "y" : "logits");
  EXPECT_EQ(dimsOf(Outputs[0]), Expected);
  if (Tied && (F == Family::Gpt || F == Family::Llama)) {
    const char *Table = F == Family::Gpt ? "transformer.wte.weight" : "model.embed_tokens.weight";
    EXPECT_EQ(countConsumers(Model, Table), 2);
  }
  if (Loss) {
    EXPECT_EQ(Outputs[1].name(), "loss");
    EXPECT_TRUE(dimsOf(Outputs[1]).empty());
    EXPECT_EQ(Model.graph().input().rbegin()->name(), "labels");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Generators, AllFamilies,
    ::testing::Combine(::testing::Values(Family::Gpt, Family::Llama, Family::Bert, Family::Mlp,
                                         Family::Resnet),
                       ::testing::Values(13, 17), ::testing::Bool(), ::testing::Bool(),
                       ::testing::Values(0, 2)),
    [](const ::testing::TestParamInfo<Variant> &Info) {
      const Variant &V = Info.param;
      int Batch = std::get<4>(V);
      return familyName(std::get<0>(V)).str() + "_opset" + std::to_string(std::get<1>(V)) +
             (std::get<2>(V) ? "_tied" : "") + (std::get<3>(V) ? "_loss" : "") +
             (Batch ? "_batch" + std::to_string(Batch) : std::string("_dynbatch"));
    });

TEST(ModelGenerators, LlamaGroupedQueryAttentionAndFp16) {
  GeneratorOptions Opts = smallOptions(Family::Llama);
  Opts.kvHeads = 2;
  Opts.batch = 3;
  Opts.fp16Weights = true;
  onnx::ModelProto Model = generateOrFail(Opts);
  checkAndInfer(Model);
  expectAllShapesStatic(Model);
  EXPECT_TRUE(hasNode(Model, "/model/layers.1/self_attn/q_proj/MatMul"));
  EXPECT_TRUE(hasNode(Model, "/model/norm/ReduceMean"));
  const onnx::TensorProto *K = findInitializer(Model, "model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(K, nullptr);
  EXPECT_EQ(K->data_type(), onnx::TensorProto::FLOAT16);
  // k_proj maps hidden 32 to kvHeads 2 * head_dim 8.
  EXPECT_EQ(K->dims(1), 16);
}

/// Per-op node counts of \p Model.
std::map<std::string, int> opCounts(const onnx::ModelProto &Model) {
  std::map<std::string, int> Counts;
  for (const onnx::NodeProto &N : Model.graph().node())
    ++Counts[N.op_type()];
  return Counts;
}

// GPT-2 with L blocks has, per block, 6 MatMuls (c_attn, Q*K^T, P*V,
// attn.c_proj, mlp.c_fc, mlp.c_proj) plus one for lm_head: 6 * L + 1.
// Initializers: wte, wpe; per block 12 (ln_1, c_attn, attn.c_proj, ln_2,
// c_fc, mlp.c_proj, each a weight and a bias); ln_f weight and bias;
// lm_head.weight; the shared bool causal mask: 2 + 12 * L + 2 + 1 + 1. Tying
// drops lm_head.weight and reads wte through a Transpose instead.
TEST(ModelGenerators, GptCountsAndTiedEmbeddings) {
  constexpr int Layers = 2;
  GeneratorOptions Opts = smallOptions(Family::Gpt);
  Opts.layers = Layers;
  onnx::ModelProto Untied = generateOrFail(Opts);
  EXPECT_EQ(countOps(Untied, "MatMul"), 6 * Layers + 1);
  EXPECT_EQ(countOps(Untied, "Gemm"), 0);
  EXPECT_EQ(Untied.graph().initializer_size(), 2 + 12 * Layers + 2 + 1 + 1);
  EXPECT_EQ(countConsumers(Untied, "transformer.wte.weight"), 1);
  EXPECT_NE(findInitializer(Untied, "lm_head.weight"), nullptr);
  for (const char *Name :
       {"/transformer/wte/Gather", "/transformer/wpe/Gather",
        "/transformer/h.1/ln_1/LayerNormalization", "/transformer/h.1/attn/c_attn/MatMul",
        "/transformer/h.1/attn/c_attn/Add", "/transformer/h.1/attn/c_attn/Reshape_1",
        "/transformer/h.1/attn/Split", "/transformer/h.1/attn/Where",
        "/transformer/h.1/attn/Softmax", "/transformer/h.1/attn/c_proj/Slice",
        "/transformer/h.1/mlp/c_fc/MatMul", "/transformer/h.1/mlp/act/Tanh",
        "/transformer/h.1/mlp/c_proj/Add", "/transformer/ln_f/LayerNormalization",
        "/lm_head/MatMul"})
    EXPECT_TRUE(hasNode(Untied, Name)) << Name;
  const onnx::TensorProto *CAttn = findInitializer(Untied, "transformer.h.1.attn.c_attn.weight");
  ASSERT_NE(CAttn, nullptr);
  EXPECT_EQ(std::vector<int64_t>(CAttn->dims().begin(), CAttn->dims().end()),
            (std::vector<int64_t>{Opts.hidden, 3 * Opts.hidden}));
  const onnx::TensorProto *CAttnBias = findInitializer(Untied, "transformer.h.1.attn.c_attn.bias");
  ASSERT_NE(CAttnBias, nullptr);
  EXPECT_EQ(CAttnBias->dims(0), 3 * Opts.hidden);
  const onnx::TensorProto *Mask = findInitializer(Untied, "causal_mask");
  ASSERT_NE(Mask, nullptr);
  EXPECT_EQ(Mask->data_type(), onnx::TensorProto::BOOL);

  Opts.tiedEmbeddings = true;
  onnx::ModelProto Tied = generateOrFail(Opts);
  EXPECT_EQ(Tied.graph().initializer_size(), Untied.graph().initializer_size() - 1);
  EXPECT_EQ(findInitializer(Tied, "lm_head.weight"), nullptr);
  EXPECT_EQ(countConsumers(Tied, "transformer.wte.weight"), 2);
  EXPECT_EQ(countOps(Tied, "MatMul"), 6 * Layers + 1);
}

// What one GPT-2 block adds at opset 17, following torch's export of HF's
// GPT2Block:
//  - 4 Conv1Ds (c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj), each Shape,
//    Slice (+ 3 Constants) and Concat (+ 1 Constant) for the view back,
//    Reshape to a Constant [-1, in], MatMul, Add, Reshape: 4 x 12 = 48.
//  - 4 (batch, seq, ...) Reshape targets (query, key, value split; merge),
//    each 2 x (Shape, Constant, Gather), 2 x (Constant, Unsqueeze), Concat
//    (+ 1 Constant): 4 x 12 = 48.
//  - Split (+ Constant sizes): 2; 3 x (Reshape, Transpose) for the heads: 6;
//    key.transpose: 1; MatMul, Div (+ Constant), Where (+ Constant), Softmax,
//    MatMul: 7; merge Transpose, Reshape: 2.
//  - ln_1 and ln_2 (LayerNormalization each): 2; residual Adds: 2.
//  - gelu_new: Mul, Pow, Mul, Add, Mul, Tanh, Add, Mul + 5 Constants: 13.
// In all 48 + 48 + 2 + 6 + 1 + 7 + 2 + 2 + 2 + 13 = 131 nodes, 48 of them
// Constants. Opset 13 decomposes each LayerNorm into 11 nodes: 131 + 2 x 10
// = 151. 1024 blocks thus give 131 x 1024 = 134144 nodes (plus 6 around
// them) at opset 17. A static batch folds each Conv1D's view target and each
// head Reshape target into one Constant as torch does (no Shape nodes):
// 131 - 4 x 6 - 4 x 11 = 63.
TEST(ModelGenerators, GptPerBlockNodeCounts) {
  const std::map<std::string, int> PerBlock = {
      {"Add", 8},       {"Concat", 8},    {"Constant", 48},
      {"Div", 1},       {"Gather", 8},    {"LayerNormalization", 2},
      {"MatMul", 6},    {"Mul", 4},       {"Pow", 1},
      {"Reshape", 12},  {"Shape", 12},    {"Slice", 4},
      {"Softmax", 1},   {"Split", 1},     {"Tanh", 1},
      {"Transpose", 5}, {"Unsqueeze", 8}, {"Where", 1}};
  GeneratorOptions Opts = smallOptions(Family::Gpt);
  Opts.layers = 2;
  std::map<std::string, int> Two = opCounts(generateOrFail(Opts));
  Opts.layers = 3;
  onnx::ModelProto ThreeModel = generateOrFail(Opts);
  std::map<std::string, int> Three = opCounts(ThreeModel);
  std::map<std::string, int> Diff;
  for (const auto &[Op, Count] : Three)
    if (int D = Count - Two[Op])
      Diff[Op] = D;
  EXPECT_EQ(Diff, PerBlock);
  int Total = 0;
  for (const auto &[Op, Count] : PerBlock)
    Total += Count;
  EXPECT_EQ(Total, 131);
  // Embeddings (Gather, Constant, Gather, Add), ln_f and lm_head.
  EXPECT_EQ(ThreeModel.graph().node_size(), 131 * 3 + 6);

  Opts.opset = 13;
  int Opset13Three = generateOrFail(Opts).graph().node_size();
  Opts.layers = 2;
  EXPECT_EQ(Opset13Three - generateOrFail(Opts).graph().node_size(), 151);

  Opts.opset = 17;
  Opts.batch = 2;
  onnx::ModelProto StaticTwo = generateOrFail(Opts);
  EXPECT_EQ(countOps(StaticTwo, "Shape"), 0);
  Opts.layers = 3;
  EXPECT_EQ(generateOrFail(Opts).graph().node_size() - StaticTwo.graph().node_size(), 63);
}

// The torch-shaped export of a 1024-block GPT exceeds 100k nodes whatever its
// width (kept tiny here).
TEST(ModelGenerators, GptThousandBlocksExceedHundredThousandNodes) {
  GeneratorOptions Opts;
  Opts.layers = 1024;
  Opts.hidden = 8;
  Opts.heads = 2;
  Opts.vocab = 10;
  Opts.seq = 4;
  onnx::ModelProto Model = generateOrFail(Opts);
  EXPECT_EQ(Model.graph().node_size(), 131 * 1024 + 6);
  EXPECT_GT(Model.graph().node_size(), 100000);
}

TEST(ModelGenerators, BertAndMlpNames) {
  onnx::ModelProto Bert = generateOrFail(smallOptions(Family::Bert));
  for (const char *Name :
       {"/bert/embeddings/word_embeddings/Gather", "/bert/embeddings/LayerNorm/LayerNormalization",
        "/bert/encoder/layer.1/attention/self/query/MatMul",
        "/bert/encoder/layer.1/attention/output/dense/MatMul",
        "/bert/encoder/layer.1/intermediate/dense/MatMul", "/bert/pooler/dense/MatMul",
        "/classifier/MatMul"})
    EXPECT_TRUE(hasNode(Bert, Name)) << Name;
  onnx::ModelProto Mlp = generateOrFail(smallOptions(Family::Mlp));
  for (const char *Name :
       {"/input_proj/Gemm", "/layers.1/linear/Gemm", "/layers.1/act/Relu", "/head/Gemm"})
    EXPECT_TRUE(hasNode(Mlp, Name)) << Name;
}

// ResNet-50: conv1, 16 bottlenecks of 3 convs, 4 downsample convs = 53.
TEST(ModelGenerators, Resnet50HasFiftyThreeConvs) {
  GeneratorOptions Opts = smallOptions(Family::Resnet);
  Opts.layers = 16;
  Opts.seq = 64;
  Opts.batch = 1;
  onnx::ModelProto Model = generateOrFail(Opts);
  EXPECT_EQ(countOps(Model, "Conv"), 53);
  EXPECT_EQ(countOps(Model, "BatchNormalization"), 53);
  EXPECT_TRUE(hasNode(Model, "/layer4/layer4.2/relu_2/Relu"));
  EXPECT_TRUE(hasNode(Model, "/layer2/layer2.0/downsample/downsample.0/Conv"));
  EXPECT_FALSE(hasNode(Model, "/layer2/layer2.1/downsample/downsample.0/Conv"));
  EXPECT_NE(findInitializer(Model, "layer3.5.conv2.weight"), nullptr);
  checkAndInfer(Model);
  expectAllShapesStatic(Model);
}

TEST(ModelGenerators, Determinism) {
  GeneratorOptions Opts = smallOptions(Family::Gpt);
  std::string A = generateOrFail(Opts).SerializeAsString();
  std::string B = generateOrFail(Opts).SerializeAsString();
  EXPECT_EQ(A, B);

  Opts.seed = 2;
  onnx::ModelProto Other = generateOrFail(Opts);
  EXPECT_NE(Other.SerializeAsString(), A);
  onnx::ModelProto First;
  ASSERT_TRUE(First.ParseFromString(A));
  const char *Weight = "transformer.h.0.attn.c_attn.weight";
  ASSERT_NE(findInitializer(First, Weight), nullptr);
  ASSERT_NE(findInitializer(Other, Weight), nullptr);
  const std::string &Raw = findInitializer(First, Weight)->raw_data();
  EXPECT_NE(Raw, findInitializer(Other, Weight)->raw_data());
  EXPECT_NE(Raw, std::string(Raw.size(), '\0'));
}

TEST(ModelGenerators, WriteInlineRoundTrips) {
  onnx::ModelProto Model = generateOrFail(smallOptions(Family::Llama));
  std::string Dir = makeTempDir();
  std::string Path = Dir + "/llama.onnx";
  ASSERT_FALSE(bool(writeModel(Model, Path, /*externalData=*/false)));
  onnx::ModelProto Read;
  std::ifstream In(Path, std::ios::binary);
  ASSERT_TRUE(Read.ParseFromIstream(&In));
  EXPECT_EQ(Read.SerializeAsString(), Model.SerializeAsString());
  llvm::sys::fs::remove_directories(Dir);

  llvm::Error E = writeModel(Model, "/nonexistent-dir/x.onnx", false);
  ASSERT_TRUE(bool(E));
  EXPECT_NE(llvm::toString(std::move(E)).find("/nonexistent-dir/x.onnx"), std::string::npos);
}

TEST(ModelGenerators, WriteExternalData) {
  GeneratorOptions Opts = smallOptions(Family::Gpt);
  onnx::ModelProto Model = generateOrFail(Opts);
  std::string Dir = makeTempDir();
  std::string Path = Dir + "/gpt.onnx";
  constexpr uint64_t Threshold = 1024;
  ASSERT_FALSE(bool(writeModel(Model, Path, /*externalData=*/true, Threshold)));

  uint64_t DataSize = 0;
  ASSERT_FALSE(llvm::sys::fs::file_size(Path + ".data", DataSize));
  onnx::ModelProto Read;
  {
    std::ifstream In(Path, std::ios::binary);
    ASSERT_TRUE(Read.ParseFromIstream(&In));
  }
  ASSERT_EQ(Read.graph().initializer_size(), Model.graph().initializer_size());

  // External tensors: 64-byte aligned, in order, gaps under 64 bytes and the
  // last one ending exactly at the end of the file.
  std::vector<std::pair<uint64_t, uint64_t>> Ranges;
  for (int I = 0; I < Read.graph().initializer_size(); ++I) {
    const onnx::TensorProto &T = Read.graph().initializer(I);
    const onnx::TensorProto &Orig = Model.graph().initializer(I);
    EXPECT_EQ(T.name(), Orig.name());
    if (Orig.raw_data().size() < Threshold) {
      EXPECT_NE(T.data_location(), onnx::TensorProto::EXTERNAL);
      EXPECT_EQ(T.raw_data(), Orig.raw_data());
      continue;
    }
    EXPECT_EQ(T.data_location(), onnx::TensorProto::EXTERNAL) << T.name();
    EXPECT_FALSE(T.has_raw_data());
    std::map<std::string, std::string> Entries;
    for (const auto &E : T.external_data())
      Entries[E.key()] = E.value();
    EXPECT_EQ(Entries["location"], "gpt.onnx.data");
    uint64_t Offset = std::stoull(Entries["offset"]);
    uint64_t Length = std::stoull(Entries["length"]);
    EXPECT_EQ(Length, Orig.raw_data().size());
    EXPECT_EQ(Offset % 64, 0u);
    Ranges.emplace_back(Offset, Length);

    // The bytes in the file are the original raw data.
    std::ifstream Data(Path + ".data", std::ios::binary);
    Data.seekg(Offset);
    std::string Bytes(Length, '\0');
    Data.read(Bytes.data(), Length);
    EXPECT_EQ(Bytes, Orig.raw_data()) << T.name();
  }
  ASSERT_FALSE(Ranges.empty());
  uint64_t End = 0;
  for (auto [Offset, Length] : Ranges) {
    EXPECT_GE(Offset, End);
    EXPECT_LT(Offset - End, 64u);
    End = Offset + Length;
  }
  EXPECT_EQ(End, DataSize);

  // The checker accepts the written model with its data next to it.
  try {
    onnx::checker::check_model(Path);
  } catch (const std::exception &E) {
    ADD_FAILURE() << E.what();
  }
  llvm::sys::fs::remove_directories(Dir);
}

} // namespace
