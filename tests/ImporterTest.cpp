//===- ImporterTest.cpp - One test per importer quirk and error ---------===//
#include "TestUtil.h"

#include "compiler/onnx/OnnxImporter.h"
#include "support/Float16.h"

#include "llvm/Support/FileSystem.h"

#include <fstream>
#include <functional>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

std::string errorOf(llvm::Expected<Graph> graph) {
  if (graph)
    return "";
  return toString(graph.takeError());
}

bool hasWarning(const Graph &graph, llvm::StringRef text) {
  for (const auto &w : graph.warnings)
    if (llvm::StringRef(w).contains(text))
      return true;
  return false;
}

const Op *findOp(const Graph &graph, llvm::StringRef type) {
  for (const Op &op : graph.ops)
    if (!op.dead && op.opType == type)
      return &op;
  return nullptr;
}

TEST(Importer, SortsUnsortedNodes) {
  GraphBuilder b;
  b.input("x", 1, {2, 3});
  b.node("Relu", {"h"}, {"y"}, "second");
  b.node("Neg", {"x"}, {"h"}, "first");
  b.output("y");
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  ASSERT_EQ(graph->ops.size(), 2u);
  EXPECT_EQ(graph->ops[0].name, "first");
  EXPECT_EQ(graph->ops[1].name, "second");
  EXPECT_TRUE(hasWarning(*graph, "not in topological order"));
  const Value &y = graph->values[graph->outputs[0]];
  EXPECT_EQ(y.shape, (std::vector<int64_t>{2, 3}));
}

TEST(Importer, LastDefinitionOfATwiceDefinedNameWins) {
  GraphBuilder b;
  b.input("x", 1, {4});
  b.node("Neg", {"x"}, {"t"}, "first_def");
  b.node("Relu", {"x"}, {"t"}, "second_def");
  b.node("Abs", {"t"}, {"y"}, "use");
  b.output("y");
  auto graph = importOnnxBuffer(llvm::MemoryBuffer::getMemBufferCopy(b.serialize()), "m.onnx", ".");
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_TRUE(hasWarning(*graph, "'t' is defined twice"));
  const Op *use = nullptr;
  for (const Op &op : graph->ops)
    if (op.name == "use")
      use = &op;
  ASSERT_NE(use, nullptr);
  int producer = graph->values[use->inputs[0]].producer;
  ASSERT_GE(producer, 0);
  EXPECT_EQ(graph->ops[producer].name, "second_def");
}

TEST(Importer, ConstantNodeTensorsAreWeights) {
  GraphBuilder b;
  b.input("x", 1, {2, 4});
  auto &c = b.node("Constant", {}, {"w"}, "paddle_weight");
  auto *attr = c.add_attribute();
  attr->set_name("value");
  attr->set_type(onnx::AttributeProto::TENSOR);
  auto *t = attr->mutable_t();
  t->set_data_type(onnx::TensorProto::FLOAT);
  t->add_dims(4);
  t->add_dims(3);
  for (int i = 0; i < 12; ++i)
    t->add_float_data(static_cast<float>(i) * 0.25f);
  b.node("MatMul", {"x", "w"}, {"y"}, "mm");
  b.output("y");
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  int w = graph->findValue("w");
  ASSERT_GE(w, 0);
  EXPECT_EQ(graph->values[w].kind, ValueKind::Weight);
  EXPECT_EQ(graph->parameterCount(), 12);
  auto data = graph->readConstant(w, 100);
  ASSERT_TRUE(!!data) << toString(data.takeError());
  EXPECT_DOUBLE_EQ((*data)->floats[5], 1.25);
  EXPECT_EQ(graph->values[graph->outputs[0]].shape, (std::vector<int64_t>{2, 3}));
}

TEST(Importer, InitializersListedAsInputsAreWeights) {
  GraphBuilder b(9);
  b.input("x", 1, {2, 2});
  b.input("w", 1, {2, 2}); // IR version 3 style: every initializer is an input too
  b.weight("w", {2, 2});
  b.node("MatMul", {"x", "w"}, {"y"});
  b.output("y");
  b.model.set_ir_version(3);
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  ASSERT_EQ(graph->inputs.size(), 1u);
  EXPECT_EQ(graph->values[graph->inputs[0]].name, "x");
  EXPECT_EQ(graph->values[graph->findValue("w")].kind, ValueKind::Weight);
}

TEST(Importer, ExternalDataIsMappedNotCopied) {
  TempDir dir;
  GraphBuilder b;
  b.input("x", 1, {1, 8});
  b.node("MatMul", {"x", "w"}, {"y"});
  b.output("y");
  auto *t = b.graph().add_initializer();
  t->set_name("w");
  t->set_data_type(onnx::TensorProto::FLOAT);
  t->add_dims(8);
  t->add_dims(8);
  t->set_data_location(onnx::TensorProto::EXTERNAL);
  auto entry = [&](const char *k, const std::string &v) {
    auto *e = t->add_external_data();
    e->set_key(k);
    e->set_value(v);
  };
  entry("location", "weights.bin");
  entry("offset", "128");
  entry("length", "256");
  std::string blob(128 + 256, '\0');
  for (int i = 0; i < 64; ++i) {
    float v = static_cast<float>(i) - 3.0f;
    std::memcpy(&blob[128 + 4 * i], &v, 4);
  }
  std::ofstream(dir.path("weights.bin"), std::ios::binary) << blob;
  b.write(dir.path("m.onnx"));
  auto graph = loadFile(dir.path("m.onnx"));
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  const Value &w = graph->values[graph->findValue("w")];
  ASSERT_TRUE(w.storage.has_value());
  EXPECT_EQ(w.storage->file, 1u);
  EXPECT_EQ(w.storage->offset, 128u);
  EXPECT_EQ(w.storage->length, 256u);
  auto data = graph->readConstant(graph->findValue("w"), 1000);
  ASSERT_TRUE(!!data);
  EXPECT_DOUBLE_EQ((*data)->floats[10], 7.0);

  // The same model without its data file names both.
  llvm::sys::fs::remove(dir.path("weights.bin"));
  std::string err = errorOf(loadFile(dir.path("m.onnx")));
  EXPECT_NE(err.find("initializer 'w'"), std::string::npos) << err;
  EXPECT_NE(err.find("weights.bin"), std::string::npos) << err;

  // A range past the end of the data file.
  std::ofstream(dir.path("weights.bin"), std::ios::binary) << std::string(200, '\0');
  err = errorOf(loadFile(dir.path("m.onnx")));
  EXPECT_NE(err.find("lies outside"), std::string::npos) << err;
}

TEST(Importer, InlineWeightsStayInTheMappedFile) {
  TempDir dir;
  GraphBuilder b;
  b.input("x", 1, {1, 128});
  b.weight("w", {128, 128}); // 64 KiB of raw_data
  b.node("MatMul", {"x", "w"}, {"y"});
  b.output("y");
  b.write(dir.path("m.onnx"));
  auto graph = loadFile(dir.path("m.onnx"));
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  const Value &w = graph->values[graph->findValue("w")];
  ASSERT_TRUE(w.storage.has_value());
  EXPECT_EQ(w.storage->file, 0u) << "inline data is referenced in the model file itself";
  EXPECT_EQ(w.storage->length, 128u * 128u * 4u);
  // The parsed model holds no copy of the bytes.
  EXPECT_LT(graph->model->ByteSizeLong(), 1024u);
  auto bytes = graph->storageBytes(w);
  ASSERT_TRUE(!!bytes);
  const char *fileStart = graph->files[0]->getBufferStart();
  EXPECT_EQ(reinterpret_cast<const char *>(bytes->data()), fileStart + w.storage->offset);
  float third;
  std::memcpy(&third, bytes->data() + 8, 4);
  EXPECT_FLOAT_EQ(third, 2.5f);
}

TEST(Importer, ReadsFloat16AndBfloat16Weights) {
  GraphBuilder b(17);
  b.input("x", 10, {1, 2});
  auto *h = b.graph().add_initializer();
  h->set_name("h");
  h->set_data_type(onnx::TensorProto::FLOAT16);
  h->add_dims(2);
  uint16_t halfBits[2] = {0x3c00, 0xc100}; // 1.0, -2.5
  h->set_raw_data(std::string(reinterpret_cast<char *>(halfBits), 4));
  auto *bf = b.graph().add_initializer();
  bf->set_name("bf");
  bf->set_data_type(onnx::TensorProto::BFLOAT16);
  bf->add_dims(2);
  bf->add_int32_data(0x3fc0); // 1.5
  bf->add_int32_data(0xc040); // -3.0
  b.node("Add", {"x", "h"}, {"y"});
  b.output("y", 10);
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  auto half = graph->readConstant(graph->findValue("h"), 10);
  ASSERT_TRUE(!!half) << toString(half.takeError());
  EXPECT_DOUBLE_EQ((*half)->floats[0], 1.0);
  EXPECT_DOUBLE_EQ((*half)->floats[1], -2.5);
  auto brain = graph->readConstant(graph->findValue("bf"), 10);
  ASSERT_TRUE(!!brain) << toString(brain.takeError());
  EXPECT_DOUBLE_EQ((*brain)->floats[0], 1.5);
  EXPECT_DOUBLE_EQ((*brain)->floats[1], -3.0);
  EXPECT_EQ(graph->values[graph->outputs[0]].type, DType::F16);
  EXPECT_FLOAT_EQ(halfToFloat(0x0001), 5.9604645e-08f); // smallest subnormal
}

TEST(Importer, BindsSymbolicDimensions) {
  GraphBuilder b;
  b.input("ids", 7, {-1, -1}, {"batch_size", "sequence_length"});
  b.input("mask", 7, {-1, -1, -1}, {"batch_size", "heads", "total_sequence_length"});
  b.node("Identity", {"ids"}, {"a"});
  b.node("Identity", {"mask"}, {"b"});
  b.output("a", 7);
  b.output("b", 7);
  ImportOptions options;
  options.bindings.batch = 3;
  options.bindings.seq = 5;
  options.bindings.past = 2;
  options.bindings.dims["heads"] = 4;
  auto graph = importBytes(b.serialize(), options);
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(graph->values[graph->findValue("ids")].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(graph->values[graph->findValue("mask")].shape, (std::vector<int64_t>{3, 4, 7}));

  options.bindings.inputShapes["ids"] = {6, 9};
  graph = importBytes(b.serialize(), options);
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(graph->values[graph->findValue("ids")].shape, (std::vector<int64_t>{6, 9}));

  options.bindings.inputShapes["ids"] = {6};
  std::string err = errorOf(importBytes(b.serialize(), options));
  EXPECT_NE(err.find("input 'ids': --input-shape gives rank 1"), std::string::npos) << err;

  options.bindings.inputShapes.clear();
  options.bindings.inputShapes["nope"] = {1};
  err = errorOf(importBytes(b.serialize(), options));
  EXPECT_NE(err.find("'nope', which is not an input"), std::string::npos) << err;

  // An unknown symbolic name binds to 1 with a warning that says how to set it.
  GraphBuilder c;
  c.input("x", 1, {-1}, {"widgets"});
  c.node("Relu", {"x"}, {"y"});
  c.output("y");
  graph = importBytes(c.serialize());
  ASSERT_TRUE(!!graph);
  EXPECT_TRUE(hasWarning(*graph, "--dim widgets=N"));
}

TEST(Importer, ShapesOnnxruntimeContribOps) {
  GraphBuilder b(17);
  auto *imp = b.model.add_opset_import();
  imp->set_domain("com.microsoft");
  imp->set_version(1);
  b.input("x", 1, {2, 5, 8});
  b.weight("gamma", {8});
  b.node("FastGelu", {"x"}, {"g"}).set_domain("com.microsoft");
  auto &skip = b.node("SkipLayerNormalization", {"g", "x", "gamma"}, {"y", "", "", "sum"});
  skip.set_domain("com.microsoft");
  b.output("y");
  b.output("sum");
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(graph->values[graph->findValue("y")].shape, (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(graph->values[graph->findValue("sum")].shape, (std::vector<int64_t>{2, 5, 8}));
}

TEST(Importer, UnknownCustomOpNeedsADeclaredType) {
  GraphBuilder b;
  auto *imp = b.model.add_opset_import();
  imp->set_domain("acme.ops");
  imp->set_version(1);
  b.input("x", 1, {3});
  b.node("Frobnicate", {"x"}, {"y"}, "/model/frob").set_domain("acme.ops");
  b.output("y");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(err.find("node '/model/frob' (acme.ops.Frobnicate)"), std::string::npos) << err;
  EXPECT_NE(err.find("no shape rule"), std::string::npos) << err;

  // With a declared static type it imports, and the op keeps its domain.
  auto *info = b.graph().mutable_output(0)->mutable_type()->mutable_tensor_type();
  info->mutable_shape()->add_dim()->set_dim_value(3);
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  EXPECT_EQ(graph->ops[0].domain, "acme.ops");
}

TEST(Importer, KeepsControlFlowAsOneOpaqueOp) {
  GraphBuilder b(13);
  b.input("x", 1, {4});
  b.input("flag", 9, {});
  b.node("Relu", {"x"}, {"r"});
  auto &node = b.node("If", {"flag"}, {"y"}, "/model/branch");
  auto branch = [&](const char *name, const char *op) {
    auto *attr = node.add_attribute();
    attr->set_name(name);
    attr->set_type(onnx::AttributeProto::GRAPH);
    auto *g = attr->mutable_g();
    g->set_name(name);
    auto *n = g->add_node();
    n->set_op_type(op);
    n->add_input("r"); // an outer-scope value
    n->add_output(std::string(name) + "_out");
    auto *out = g->add_output();
    out->set_name(std::string(name) + "_out");
  };
  branch("then_branch", "Neg");
  branch("else_branch", "Abs");
  b.output("y");
  auto *t = b.graph().mutable_output(0)->mutable_type()->mutable_tensor_type();
  t->mutable_shape()->add_dim()->set_dim_value(4);
  auto graph = importBytes(b.serialize());
  ASSERT_TRUE(!!graph) << toString(graph.takeError());
  const Op *cond = findOp(*graph, "If");
  ASSERT_NE(cond, nullptr);
  ASSERT_EQ(cond->captures.size(), 1u);
  EXPECT_EQ(graph->values[cond->captures[0]].name, "r");
  EXPECT_EQ(graph->values[graph->outputs[0]].shape, (std::vector<int64_t>{4}));
  // The captured value keeps its producer alive and ordered before the If.
  EXPECT_EQ(graph->ops[0].opType, "Relu");
}

TEST(ImporterErrors, TruncatedFile) {
  TempDir dir;
  GraphBuilder b;
  b.input("x", 1, {64});
  b.weight("w", {64});
  b.node("Add", {"x", "w"}, {"y"});
  b.output("y");
  std::string bytes = b.serialize();
  std::ofstream(dir.path("cut.onnx"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  std::string err = errorOf(loadFile(dir.path("cut.onnx")));
  EXPECT_NE(err.find("cut.onnx"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated or corrupt"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << "one line: " << err;
}

TEST(ImporterErrors, MissingFileAndEmptyFile) {
  TempDir dir;
  std::string err = errorOf(loadFile(dir.path("absent.onnx")));
  EXPECT_NE(err.find("absent.onnx: cannot open"), std::string::npos) << err;
  std::ofstream(dir.path("empty.onnx"));
  err = errorOf(loadFile(dir.path("empty.onnx")));
  EXPECT_NE(err.find("empty.onnx: the file is empty"), std::string::npos) << err;
}

TEST(ImporterErrors, MissingInitializerNamesTheNode) {
  GraphBuilder b;
  b.input("x", 1, {2});
  b.node("Add", {"x", "bias"}, {"y"}, "/model/add");
  b.output("y");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(err.find("node '/model/add' (Add): input 'bias' is not produced"), std::string::npos)
      << err;
}

TEST(ImporterErrors, CycleNamesANodeOnIt) {
  GraphBuilder b;
  b.input("x", 1, {2});
  b.node("Add", {"x", "b"}, {"a"}, "loop_a");
  b.node("Relu", {"a"}, {"b"}, "loop_b");
  b.output("b");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(err.find("the graph has a cycle through node 'loop_"), std::string::npos) << err;
}

/// The import error of y = x + w, w a float initializer of 2 that \p spoil
/// has changed.
std::string errorOfSpoiledWeight(const std::function<void(onnx::TensorProto &)> &spoil) {
  GraphBuilder b;
  b.input("x", 1, {2});
  spoil(b.weight("w", {2}));
  b.node("Add", {"x", "w"}, {"y"});
  b.output("y");
  return errorOf(importBytes(b.serialize()));
}

TEST(ImporterErrors, UnknownDataType) {
  std::string err = errorOfSpoiledWeight([](onnx::TensorProto &w) { w.set_data_type(99); });
  EXPECT_NE(err.find("initializer 'w': unknown data type 99"), std::string::npos) << err;
}

TEST(ImporterErrors, WeightBytesDisagreeWithShape) {
  std::string err =
      errorOfSpoiledWeight([](onnx::TensorProto &w) { w.set_raw_data(std::string(12, '\0')); });
  EXPECT_NE(err.find("initializer 'w': holds 12 bytes"), std::string::npos) << err;
}

TEST(ImporterErrors, ValuesHeldTwiceAreRefused) {
  // raw_data and float_data both set: which one is meant is a guess.
  std::string err = errorOfSpoiledWeight([](onnx::TensorProto &w) { w.add_float_data(1.0f); });
  EXPECT_NE(err.find("initializer 'w': holds its values twice, in raw_data and in a typed field"),
            std::string::npos)
      << err;
}

/// y = x + 1 inside \p depth Ifs nested in their then-branches (each else
/// branch computes the same directly).
std::string nestedIfs(int depth) {
  auto add = [](const std::string &out) {
    onnx::GraphProto g;
    g.set_name(out);
    onnx::NodeProto &n = *g.add_node();
    n.set_op_type("Add");
    n.add_input("x");
    n.add_input("one");
    n.add_output(out);
    onnx::ValueInfoProto &o = *g.add_output();
    o.set_name(out);
    o.mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
    o.mutable_type()->mutable_tensor_type()->mutable_shape()->add_dim()->set_dim_value(2);
    return g;
  };
  onnx::GraphProto inner = add("y" + std::to_string(depth));
  for (int d = depth - 1; d >= 0; --d) {
    onnx::GraphProto outer = add("unused");
    outer.clear_node();
    outer.set_name("g" + std::to_string(d));
    outer.mutable_output(0)->set_name("y" + std::to_string(d));
    onnx::NodeProto &n = *outer.add_node();
    n.set_op_type("If");
    n.add_input("c");
    n.add_output("y" + std::to_string(d));
    onnx::AttributeProto &then = *n.add_attribute();
    then.set_name("then_branch");
    then.set_type(onnx::AttributeProto::GRAPH);
    *then.mutable_g() = std::move(inner);
    onnx::AttributeProto &otherwise = *n.add_attribute();
    otherwise.set_name("else_branch");
    otherwise.set_type(onnx::AttributeProto::GRAPH);
    *otherwise.mutable_g() = add("e" + std::to_string(d));
    inner = std::move(outer);
  }
  GraphBuilder b;
  b.input("x", onnx::TensorProto::FLOAT, {2});
  b.input("c", onnx::TensorProto::BOOL, {});
  b.weight("one", {2});
  *b.graph().add_node() = inner.node(0);
  b.output("y0");
  return b.serialize();
}

TEST(Importer, DeeplyNestedSubgraphsParse) {
  // protobuf's default limit of 100 nested messages allowed 33 levels of If;
  // 200 levels parse now (what the import says of them past parsing is not
  // this test's), and more than 1000 are refused by name.
  for (int depth : {40, 200}) {
    std::string err = errorOf(importBytes(nestedIfs(depth)));
    EXPECT_EQ(err.find("protobuf"), std::string::npos) << depth << ": " << err;
  }
  std::string err = errorOf(importBytes(nestedIfs(1100)));
  EXPECT_NE(err.find("subgraphs more than 1000 deep"), std::string::npos) << err;
}

TEST(ImporterErrors, ShapeMismatchNamesTheNode) {
  GraphBuilder b;
  b.input("x", 1, {2, 3});
  b.weight("w", {4, 5});
  b.node("MatMul", {"x", "w"}, {"y"}, "/model/proj/MatMul");
  b.output("y");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(err.find("node '/model/proj/MatMul' (MatMul): shape inference failed"),
            std::string::npos)
      << err;
}

TEST(ImporterErrors, UnsupportedOpset) {
  GraphBuilder b(99);
  b.input("x", 1, {2});
  b.node("Relu", {"x"}, {"y"});
  b.output("y");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(err.find("unsupported opset 99"), std::string::npos) << err;
}

// ONNX 1.23's registry goes to opset 28, and so does pipec's default domain.
TEST(ImporterErrors, OpsetsUpTo28) {
  for (int opset : {7, 17, 18, 20, 25, 28}) {
    SCOPED_TRACE(opset);
    GraphBuilder b(opset);
    b.input("x", 1, {2});
    b.node("Relu", {"x"}, {"y"});
    b.output("y");
    EXPECT_EQ(errorOf(importBytes(b.serialize())), "");
  }
  GraphBuilder b(29);
  b.input("x", 1, {2});
  b.node("Relu", {"x"}, {"y"});
  b.output("y");
  std::string err = errorOf(importBytes(b.serialize()));
  EXPECT_NE(
      err.find("unsupported opset 29 of the default ONNX domain (this build supports 1 to 28)"),
      std::string::npos)
      << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
}

// A sequence longer than the model's position table fails shape inference;
// the error says what the symbolic dimensions were bound to and which table
// limits them.
TEST(ImporterErrors, ABindingTooLongForATableSaysWhatFits) {
  GraphBuilder b;
  b.input("ids", 7, {-1, -1}, {"batch_size", "sequence_length"});
  b.weight("position_embeddings", {4, 8});
  b.weight("bias", {4, 8});
  b.node("Gather", {"position_embeddings", "ids"}, {"rows"}, "/embeddings/Gather");
  b.node("Add", {"rows", "bias"}, {"y"}, "/embeddings/Add");
  b.output("y");
  ImportOptions options;
  options.bindings.seq = 4;
  EXPECT_EQ(errorOf(importBytes(b.serialize(), options)), "");
  options.bindings.seq = 16;
  std::string err = errorOf(importBytes(b.serialize(), options));
  EXPECT_NE(err.find("node '/embeddings/Add' (Add): shape inference failed"), std::string::npos)
      << err;
  EXPECT_NE(err.find("(the inputs' symbolic dimensions were bound: batch_size=1, "
                     "sequence_length=16; the table 'position_embeddings' has 4 rows: a "
                     "dimension it indexes (such as --seq) fits up to 4)"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;
}

TEST(ImporterErrors, NotAModel) {
  std::string err = errorOf(importBytes("this is not protobuf at all, just text\n"));
  EXPECT_NE(err.find("test.onnx"), std::string::npos) << err;
}

} // namespace
