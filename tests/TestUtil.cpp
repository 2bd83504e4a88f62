//===- TestUtil.cpp - Helpers shared by pipec's tests ---------------------===//
#include "TestUtil.h"
#include "passes/GroupLayers.h"
#include "plan/PlanFile.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <cstdio>
#include <fstream>
#include <google/protobuf/text_format.h>
#include <sstream>

#include <sys/wait.h>

using namespace llvm;

namespace pipec::test {

TempDir::TempDir() {
  SmallString<256> base(PIPEC_BINARY_DIR);
  sys::path::append(base, "test-tmp");
  sys::fs::create_directories(base);
  SmallString<256> made;
  sys::fs::createUniqueDirectory(Twine(base) + "/t", made);
  dir = std::string(made);
}

TempDir::~TempDir() { sys::fs::remove_directories(dir); }

std::string TempDir::path(StringRef name) const { return dir + "/" + name.str(); }

GraphBuilder::GraphBuilder(int opset) {
  model.set_ir_version(8);
  model.set_producer_name("pipec-test");
  auto *imp = model.add_opset_import();
  imp->set_domain("");
  imp->set_version(opset);
  graph().set_name("test");
}

void GraphBuilder::input(const std::string &name, int elemType, const std::vector<int64_t> &dims,
                         const std::vector<std::string> &symbols) {
  auto *in = graph().add_input();
  in->set_name(name);
  auto *t = in->mutable_type()->mutable_tensor_type();
  t->set_elem_type(elemType);
  auto *shape = t->mutable_shape();
  size_t symbol = 0;
  for (int64_t d : dims) {
    auto *dim = shape->add_dim();
    if (d >= 0)
      dim->set_dim_value(d);
    else if (symbol < symbols.size())
      dim->set_dim_param(symbols[symbol++]);
  }
}

void GraphBuilder::output(const std::string &name, int elemType) {
  auto *out = graph().add_output();
  out->set_name(name);
  out->mutable_type()->mutable_tensor_type()->set_elem_type(elemType);
}

onnx::NodeProto &GraphBuilder::node(const std::string &opType,
                                    const std::vector<std::string> &inputs,
                                    const std::vector<std::string> &outputs,
                                    const std::string &name) {
  auto *n = graph().add_node();
  n->set_op_type(opType);
  n->set_name(name);
  for (const auto &i : inputs)
    n->add_input(i);
  for (const auto &o : outputs)
    n->add_output(o);
  return *n;
}

/// A new initializer of \p graph: \p name, of ONNX element type \p type and
/// shape \p dims, without data.
static onnx::TensorProto &addInitializer(onnx::GraphProto &graph, const std::string &name, int type,
                                         const std::vector<int64_t> &dims) {
  auto *t = graph.add_initializer();
  t->set_name(name);
  t->set_data_type(type);
  for (int64_t d : dims)
    t->add_dims(d);
  return *t;
}

onnx::TensorProto &GraphBuilder::weight(const std::string &name, const std::vector<int64_t> &dims) {
  onnx::TensorProto &t = addInitializer(graph(), name, onnx::TensorProto::FLOAT, dims);
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  std::string raw(static_cast<size_t>(n) * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    float v = 0.5f + static_cast<float>(i);
    std::memcpy(&raw[i * 4], &v, 4);
  }
  t.set_raw_data(raw);
  return t;
}

onnx::TensorProto &GraphBuilder::ints(const std::string &name, const std::vector<int64_t> &values) {
  onnx::TensorProto &t = addInitializer(graph(), name, onnx::TensorProto::INT64,
                                        {static_cast<int64_t>(values.size())});
  for (int64_t v : values)
    t.add_int64_data(v);
  return t;
}

std::string GraphBuilder::serialize() const {
  std::string bytes;
  model.SerializeToString(&bytes);
  return bytes;
}

void GraphBuilder::write(const std::string &path) const {
  std::ofstream out(path, std::ios::binary);
  out << serialize();
}

Expected<Graph> importBytes(const std::string &bytes, const ImportOptions &options) {
  auto graph = importOnnxBuffer(MemoryBuffer::getMemBufferCopy(bytes, "test.onnx"), "test.onnx",
                                ".", options);
  if (!graph)
    return graph.takeError();
  PipelineOptions pipeline;
  if (Error err = runGraphPasses(*graph, pipeline))
    return err;
  return graph;
}

Expected<Graph> importGenerated(const models::GeneratorOptions &options, int64_t batch) {
  auto model = models::generateModel(options);
  if (!model)
    return model.takeError();
  std::string bytes;
  model->SerializeToString(&bytes);
  ImportOptions importOptions;
  importOptions.bindings.batch = batch;
  importOptions.bindings.seq = options.seq;
  return importBytes(bytes, importOptions);
}

Expected<Graph> loadFile(const std::string &path, const ImportOptions &options) {
  return loadGraph(path, options, PipelineOptions());
}

GroupedGraph groupGraph(Expected<Graph> graph) {
  GroupedGraph out;
  if (!graph) {
    ADD_FAILURE() << toString(graph.takeError());
    return out;
  }
  out.graph = std::make_unique<Graph>(std::move(*graph));
  auto layers = groupLayers(*out.graph);
  if (!layers) {
    ADD_FAILURE() << toString(layers.takeError());
    return out;
  }
  out.layers = std::move(*layers);
  return out;
}

::testing::AssertionResult pipecModel(const std::string &args, const std::string &model) {
  std::string command = pipecBinary + " model " + args + " -o " + model, out;
  if (runCommand(command, out) != 0)
    return ::testing::AssertionFailure() << command << "\n" << out;
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult smallGptPlan(const std::string &model, const std::string &plan,
                                        const std::string &compileFlags) {
  std::string out;
  for (const std::string &command :
       {pipecBinary + " model gpt --layers 2 --hidden 16 --vocab 50 --seq 8 --loss -o " + model,
        pipecBinary + " compile " + model + " -o " + plan + " --stages 2 --hardware cpu " +
            compileFlags})
    if (runCommand(command, out) != 0)
      return ::testing::AssertionFailure() << command << "\n" << out;
  return ::testing::AssertionSuccess();
}

int runCommand(const std::string &command, std::string &output) {
  output.clear();
  FILE *pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe)
    return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0)
    output.append(buffer, n);
  int status = pclose(pipe);
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

std::string readFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string metricLosses(const std::string &path) {
  std::string text = readFile(path), out;
  auto field = [](StringRef line, StringRef key) {
    size_t at = line.find("\"" + key.str() + "\": ");
    if (at == StringRef::npos)
      return StringRef();
    return line.drop_front(at + key.size() + 4).take_until([](char c) {
      return c == ',' || c == '}';
    });
  };
  SmallVector<StringRef, 16> lines;
  StringRef(text).split(lines, '\n', -1, /*KeepEmpty=*/false);
  for (StringRef line : lines) {
    out += (field(line, "step") + " " + field(line, "loss")).str();
    if (StringRef eval = field(line, "eval_loss"); !eval.empty())
      out += " " + eval.str();
    out += "\n";
  }
  return out;
}

bool fileExists(const std::string &path) { return sys::fs::exists(path); }

std::string realModel(StringRef relative) {
  std::string path = std::string(PIPEC_REAL_MODELS) + "/" + relative.str();
  return sys::fs::exists(path) ? path : "";
}

} // namespace pipec::test

namespace pipec::test {

std::string resealedTextPlan(const std::string &text) {
  plan::Plan plan;
  if (!google::protobuf::TextFormat::ParseFromString(text, &plan))
    return text;
  sealPlan(plan);
  auto sealed = serializePlan(plan, PlanEncoding::Text);
  if (!sealed) {
    llvm::consumeError(sealed.takeError());
    return text;
  }
  return *sealed;
}

} // namespace pipec::test
