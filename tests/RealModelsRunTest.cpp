//===- RealModelsRunTest.cpp - Real models, run forward, against onnxruntime ===//
//
// The forward-conformance part of the runtime's acceptance: every real model
// of ../shared/models/real whose ops the CPU kernels cover, compiled in infer
// mode into 1 and more stages, and run by the real `pipec run` on the inputs
// stored beside it, gives the outputs onnxruntime gave (REFERENCE.md).
//
// Each configuration runs M = 1 and M = 2 microbatches of the reference batch
// B: the global batch is M x B and the dataset (the B reference samples) is
// read modulo B, so every microbatch holds the whole reference batch and the
// expected output is the reference stacked M times along the batch. That also
// works for models whose batch is fixed in the file. The batch is the
// dimension the model names like one (GPT-2's past and present states hold it
// in dimension 1), else the first.
//
// A model with ops outside cpu::isSupported (subgraphs included) that fails to
// run must fail cleanly, and the test skips naming those ops; a run that
// succeeds is always compared, and no model passes without comparing.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "runtime/core/Tensor.h"
#include "runtime/cpu/Kernels.h"
#include "runtime/exec/Data.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <set>

using namespace pipec;
using namespace pipec::test;
using llvm::formatv;

namespace {

struct RealCase {
  std::string name;    ///< the test's name
  std::string model;   ///< relative to the real models folder
  std::string refData; ///< the test_data_set_0 folder, relative
  std::vector<int> stages;
};

std::ostream &operator<<(std::ostream &os, const RealCase &c) { return os << c.name; }

const std::vector<RealCase> &cases() {
  static const std::vector<RealCase> all = {
      {"DistilbertTorch",
       "distilbert_tiny_torch.onnx",
       "distilbert_tiny_torch.test_data_set_0",
       {1, 2}},
      {"BertLargeKeras",
       "bert_large_tf_keras2onnx.onnx",
       "bert_large_tf_keras2onnx.test_data_set_0",
       {1, 2, 4}},
      {"Resnet50Caffe2",
       "resnet50_caffe2_light.onnx",
       "resnet50_caffe2_light.test_data_set_0",
       {1, 2, 4}},
      {"PpocrMobilenetV3Paddle",
       "ppocrv2_cls_mobilenetv3_paddle.onnx",
       "ppocrv2_cls_mobilenetv3_paddle.test_data_set_0",
       {1, 2, 4}},
      {"Gpt2OrtFused", "gpt2_tiny_ort_fused.onnx", "gpt2_tiny_ort_fused.test_data_set_0", {1, 2}},
      {"LstmScanCntk", "lstm_scan_cntk.onnx", "lstm_scan_cntk.test_data_set_0", {1}},
      {"LlamaGenaiFp16",
       "llama_tiny_genai_fp16/model.onnx",
       "llama_tiny_genai_fp16/test_data_set_0",
       {1, 2}},
  };
  return all;
}

/// One line of the summary table.
struct Row {
  std::string model;
  int stages = 0, microbatches = 0, outputs = 0;
  double maxAbsError = 0;
  std::string note;
};

std::vector<Row> &table() {
  static std::vector<Row> rows;
  return rows;
}

std::string pipec() { return std::string(PIPEC_BINARY_DIR) + "/bin/pipec"; }

std::string shellQuoted(llvm::StringRef s) { return "'" + s.str() + "'"; }

llvm::Expected<onnx::TensorProto> readTensorProto(const std::string &path) {
  onnx::TensorProto proto;
  std::string bytes = readFile(path);
  if (bytes.empty() && !fileExists(path))
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "%s: missing", path.c_str());
  if (!proto.ParseFromString(bytes))
    return llvm::createStringError(llvm::inconvertibleErrorCode(), "%s: not a TensorProto",
                                   path.c_str());
  return proto;
}

/// Graph inputs that are not backed by an initializer, and graph outputs, in
/// graph order; and the ops (subgraphs included) the CPU kernels lack.
struct ModelInfo {
  std::vector<std::string> inputs, outputs;
  std::set<std::string> unsupported;
  /// Per output: the first dimension declared with a name containing
  /// "batch", else 0.
  std::map<std::string, int> outputBatchAxis;
};

void collectUnsupported(const onnx::GraphProto &graph, std::set<std::string> &out) {
  for (const onnx::NodeProto &node : graph.node()) {
    if (!cpu::isSupported(node.op_type(), node.domain()))
      out.insert(node.domain().empty() || node.domain() == "ai.onnx"
                     ? node.op_type()
                     : node.domain() + "." + node.op_type());
    for (const onnx::AttributeProto &a : node.attribute()) {
      if (a.has_g())
        collectUnsupported(a.g(), out);
      for (const onnx::GraphProto &g : a.graphs())
        collectUnsupported(g, out);
    }
  }
}

ModelInfo readModelInfo(const std::string &path) {
  onnx::ModelProto model;
  EXPECT_TRUE(model.ParseFromString(readFile(path))) << path;
  ModelInfo info;
  std::set<std::string> initializers;
  for (const onnx::TensorProto &t : model.graph().initializer())
    initializers.insert(t.name());
  for (const onnx::ValueInfoProto &v : model.graph().input())
    if (!initializers.count(v.name()))
      info.inputs.push_back(v.name());
  for (const onnx::ValueInfoProto &v : model.graph().output()) {
    info.outputs.push_back(v.name());
    int axis = 0;
    const auto &dims = v.type().tensor_type().shape().dim();
    for (int i = dims.size() - 1; i >= 0; --i)
      if (llvm::StringRef(dims[i].dim_param()).lower().find("batch") != std::string::npos)
        axis = i;
    info.outputBatchAxis[v.name()] = axis;
  }
  collectUnsupported(model.graph(), info.unsupported);
  return info;
}

/// The graph name of reference file K: the TensorProto's own name when it is
/// one of \p names, else the K-th of \p names (backend-test numbering).
std::string nameOf(const onnx::TensorProto &proto, const std::vector<std::string> &names,
                   size_t k) {
  if (llvm::is_contained(names, proto.name()))
    return proto.name();
  return k < names.size() ? names[k] : "";
}

/// One tensor of a real model's test data: the graph input or output it is
/// for, its file and its contents.
struct RefTensor {
  std::string name, path;
  onnx::TensorProto proto;
};

/// \p dir's files KIND_0.pb, KIND_1.pb, ... (\p kind "input" or "output") up
/// to the first one missing, each matched to one of \p names. A file that
/// cannot be read or matches no name fails the test and ends the list.
std::vector<RefTensor> readRefTensors(const std::string &dir, const std::string &kind,
                                      const std::vector<std::string> &names) {
  std::vector<RefTensor> out;
  for (size_t k = 0;; ++k) {
    std::string path = dir + "/" + kind + "_" + std::to_string(k) + ".pb";
    if (!fileExists(path))
      break;
    auto proto = readTensorProto(path);
    if (!proto) {
      ADD_FAILURE() << llvm::toString(proto.takeError());
      break;
    }
    std::string name = nameOf(*proto, names, k);
    if (name.empty()) {
      ADD_FAILURE() << path << " matches no graph " << kind;
      break;
    }
    out.push_back({name, path, std::move(*proto)});
  }
  return out;
}

/// \p t stacked \p times along dimension \p axis.
cpu::Tensor stack(const cpu::Tensor &t, int times, int axis) {
  if (times == 1 || t.rank() == 0)
    return t;
  std::vector<int64_t> shape = t.shape();
  shape[axis] *= times;
  cpu::Tensor out(t.elemType(), shape);
  int64_t outer = cpu::numElementsOf(llvm::ArrayRef<int64_t>(shape).take_front(axis));
  size_t slice = t.byteSize() / static_cast<size_t>(std::max<int64_t>(outer, 1));
  for (int64_t o = 0; o < outer; ++o)
    for (int i = 0; i < times; ++i)
      std::memcpy(static_cast<char *>(out.rawData()) + (o * times + i) * slice,
                  static_cast<const char *>(t.rawData()) + o * slice, slice);
  return out;
}

double maxAbsDiff(const cpu::Tensor &a, const cpu::Tensor &b) {
  double worst = 0;
  for (int64_t i = 0; i < std::min(a.numElements(), b.numElements()); ++i) {
    double d = std::abs(a.getDouble(i) - b.getDouble(i));
    if (std::isnan(d))
      return NAN;
    worst = std::max(worst, d);
  }
  return worst;
}

/// REFERENCE.md: fp32 about 1e-4 relative over a 1e-6 floor; fp16 1e-2 over
/// 1e-3. Integer outputs must be equal.
std::pair<double, double> tolerance(DType type) {
  if (type == cpu::DType::F16 || type == cpu::DType::BF16)
    return {1e-2, 1e-3};
  return {1e-4, 1e-6};
}

std::string firstLine(llvm::StringRef text) { return text.split('\n').first.trim().str(); }

class RealModelRun : public ::testing::TestWithParam<RealCase> {
protected:
  static void TearDownTestSuite() {
    if (table().empty())
      return;
    std::cout << formatv("\n{0,-24} {1,6} {2,3} {3,8} {4,14}  {5}\n", "model", "stages", "M",
                         "outputs", "max abs error", "")
                     .str();
    for (const Row &r : table()) {
      if (r.outputs == 0)
        std::cout << formatv("{0,-24} {1,6} {2,3} {3,8} {4,14}  {5}\n", r.model, r.stages,
                             r.microbatches, "-", "-", r.note)
                         .str();
      else
        std::cout << formatv("{0,-24} {1,6} {2,3} {3,8} {4,14:e2}  {5}\n", r.model, r.stages,
                             r.microbatches, r.outputs, r.maxAbsError, r.note)
                         .str();
    }
    table().clear();
  }
};

TEST_P(RealModelRun, MatchesOnnxRuntime) {
  const RealCase &c = GetParam();
  std::string model = realModel(c.model), refDir = realModel(c.refData);
  if (model.empty() || refDir.empty())
    GTEST_SKIP() << "shared real models are absent";
  ModelInfo info = readModelInfo(model);
  ASSERT_FALSE(info.inputs.empty()) << model;

  // The reference inputs and outputs, by graph name.
  std::vector<std::pair<std::string, std::string>> inputFiles; // name, .pb path
  std::map<std::string, std::vector<int64_t>> inputShapes;
  for (const RefTensor &in : readRefTensors(refDir, "input", info.inputs)) {
    inputFiles.emplace_back(in.name, in.path);
    inputShapes[in.name] = {in.proto.dims().begin(), in.proto.dims().end()};
  }
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(inputFiles.size(), info.inputs.size()) << refDir << ": one file per graph input";
  std::vector<std::pair<std::string, cpu::Tensor>> expected;
  for (const RefTensor &out : readRefTensors(refDir, "output", info.outputs)) {
    auto tensor = cpu::fromTensorProto(out.proto);
    ASSERT_TRUE(!!tensor) << out.path << ": " << llvm::toString(tensor.takeError());
    expected.emplace_back(out.name, std::move(*tensor));
  }
  ASSERT_FALSE(HasFailure());
  ASSERT_FALSE(expected.empty()) << refDir << ": no output_K.pb";
  const std::vector<int64_t> &firstShape = inputShapes[info.inputs[0]];
  ASSERT_FALSE(firstShape.empty()) << "input '" << info.inputs[0] << "' is a scalar";
  int64_t batch = firstShape[0];

  TempDir dir;
  // DIR/NAME.pb per input, the name as it is ('/' makes a subfolder).
  std::string data = dir.path("data");
  for (const auto &[name, path] : inputFiles) {
    std::string target = data + "/" + name + ".pb";
    ASSERT_FALSE(llvm::sys::fs::create_directories(llvm::sys::path::parent_path(target)));
    ASSERT_FALSE(llvm::sys::fs::copy_file(path, target)) << target;
  }
  std::string shapes;
  for (const std::string &name : info.inputs)
    shapes += " --input-shape " +
              shellQuoted(name + "=" +
                          llvm::join(llvm::map_range(inputShapes[name],
                                                     [](int64_t d) { return std::to_string(d); }),
                                     ","));

  std::string blockers = llvm::join(info.unsupported, ", ");
  for (int P : c.stages) {
    for (int M : {1, 2}) {
      std::string what = formatv("{0} P={1} M={2}", c.name, P, M).str();
      std::string plan = dir.path(formatv("p{0}m{1}.plan", P, M).str());
      std::string outDir = dir.path(formatv("out-p{0}m{1}", P, M).str());
      std::string out;
      ASSERT_EQ(runCommand(formatv("{0} compile {1} --mode infer --hardware cpu --stages {2} "
                                   "--microbatches {3} --batch {4}{5} -o {6}",
                                   pipec(), shellQuoted(model), P, M, M * batch, shapes,
                                   shellQuoted(plan))
                               .str(),
                           out),
                0)
          << what << "\n"
          << out;
      int rc = runCommand(formatv("{0} run {1} --quiet --data {2} --outputs {3}", pipec(),
                                  shellQuoted(plan), shellQuoted(data), shellQuoted(outDir))
                              .str(),
                          out);
      if (rc != 0 && !info.unsupported.empty()) {
        // Not a crash: exit 1 with a one-line error, which names a missing
        // kernel if it is about one.
        EXPECT_EQ(rc, 1) << what << ":\n" << out;
        EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << what << ":\n" << out;
        std::string why = firstLine(out);
        size_t at = why.find("): no CPU kernel");
        // A failure that names no missing kernel is a bug in a supported one.
        ASSERT_NE(at, std::string::npos) << what << ": " << why;
        {
          std::string op = why.substr(0, at);
          op = op.substr(op.rfind('(') + 1);
          EXPECT_TRUE(llvm::any_of(
              info.unsupported,
              [&](llvm::StringRef b) { return b.rsplit('.').second == op || b == op; }))
              << what << ": the run names " << op << ", cpu::isSupported lacks " << blockers;
        }
        table().push_back({c.name, P, M, 0, 0, "skipped: no CPU kernel for " + blockers});
        GTEST_SKIP() << c.name << ": no CPU kernel for " << blockers << " (run: " << why << ")";
      }
      ASSERT_EQ(rc, 0) << what << ":\n" << out;

      Row row{c.name, P, M, 0, 0, ""};
      for (const auto &[name, reference] : expected) {
        std::string safe = name;
        for (char &ch : safe)
          if (ch == '/' || ch == ':' || ch == '\\')
            ch = '_';
        std::string path = outDir + "/" + safe + ".npy";
        auto actual = rt::readNpy(path);
        ASSERT_TRUE(!!actual) << what << ": " << llvm::toString(actual.takeError());
        cpu::Tensor want = stack(reference, M, info.outputBatchAxis[name]);
        auto [rtol, atol] = tolerance(want.elemType());
        std::string why;
        EXPECT_TRUE(cpu::allClose(*actual, want, rtol, atol, &why))
            << what << ": output '" << name << "': " << why;
        ++row.outputs;
        row.maxAbsError = std::max(row.maxAbsError, maxAbsDiff(*actual, want));
      }
      table().push_back(row);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Real, RealModelRun, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<RealCase> &info) {
                           return info.param.name;
                         });

} // namespace
