//===- RobustnessTest.cpp - Bad input never crashes ---------------------===//
//
// Truncated and corrupted models end in an error that names the file, never
// in a crash; every model of Debian's ONNX test data imports or fails cleanly.
//
//===----------------------------------------------------------------------===//
#include "TestUtil.h"

#include "models/ModelGenerators.h"
#include "passes/GroupLayers.h"

#include "llvm/Support/FileSystem.h"

#include <random>

using namespace pipec;
using namespace pipec::test;
using llvm::toString;

namespace {

std::string smallModelBytes() {
  auto model =
      models::generateModel(models::GeneratorOptions(models::Family::Gpt, 2, 16, 50, 4, 2));
  EXPECT_TRUE(!!model);
  std::string bytes;
  model->SerializeToString(&bytes);
  return bytes;
}

/// Imports, runs the passes and groups; returns "" or the one-line error.
std::string tryAll(const std::string &bytes) {
  ImportOptions options;
  options.bindings.seq = 4;
  auto graph = importBytes(bytes, options);
  if (!graph)
    return toString(graph.takeError());
  auto layers = groupLayers(*graph);
  if (!layers)
    return toString(layers.takeError());
  return "";
}

TEST(Robustness, TruncatedAtManyOffsets) {
  std::string bytes = smallModelBytes();
  ASSERT_EQ(tryAll(bytes), "");
  int failures = 0, cases = 0;
  for (size_t cut = 0; cut < bytes.size(); cut += 1 + cut / 16) {
    std::string err = tryAll(bytes.substr(0, cut));
    ++cases;
    if (!err.empty()) {
      ++failures;
      EXPECT_NE(err.find("test.onnx"), std::string::npos) << "cut " << cut << ": " << err;
      EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    }
  }
  EXPECT_GT(cases, 100);
  EXPECT_GT(failures, cases / 2) << "most truncations must be detected";
}

TEST(Robustness, FlippedBytes) {
  std::string bytes = smallModelBytes();
  std::mt19937_64 rng(20261129);
  int failures = 0;
  const int trials = 600;
  for (int trial = 0; trial < trials; ++trial) {
    std::string broken = bytes;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f)
      broken[rng() % broken.size()] ^= static_cast<char>(1 + rng() % 255);
    std::string err = tryAll(broken);
    if (!err.empty()) {
      ++failures;
      EXPECT_NE(err.find("test.onnx"), std::string::npos) << "trial " << trial << ": " << err;
    }
  }
  // Flips inside weight bytes are legal models; flips in the structure fail.
  EXPECT_GT(failures, 0);
  EXPECT_LT(failures, trials);
}

TEST(Robustness, DebianOnnxTestData) {
  std::string root = PIPEC_ONNX_TESTDATA;
  if (!llvm::sys::fs::exists(root))
    GTEST_SKIP() << root << " is absent (package libonnx-testdata)";
  std::vector<std::string> files;
  std::error_code ec;
  for (llvm::sys::fs::recursive_directory_iterator it(root, ec), end; it != end && !ec;
       it.increment(ec))
    if (llvm::StringRef(it->path()).endswith(".onnx"))
      files.push_back(it->path());
  std::sort(files.begin(), files.end());
  ASSERT_GT(files.size(), 1000u);
  int imported = 0, grouped = 0;
  std::map<std::string, int> reasons;
  for (const std::string &file : files) {
    auto graph = loadFile(file);
    if (!graph) {
      std::string err = toString(graph.takeError());
      EXPECT_NE(err.find(file), std::string::npos) << err;
      EXPECT_EQ(err.find('\n'), std::string::npos) << err;
      ++reasons[err.substr(err.find(": ", file.size()) + 2, 40)];
      continue;
    }
    ++imported;
    auto layers = groupLayers(*graph);
    if (layers)
      ++grouped;
    else
      llvm::consumeError(layers.takeError()); // e.g. a graph that only reshapes constants
  }
  RecordProperty("imported", imported);
  RecordProperty("grouped", grouped);
  std::cout << "libonnx-testdata: " << files.size() << " models, " << imported << " imported, "
            << grouped << " grouped\n";
  for (auto &[reason, n] : reasons)
    std::cout << "  " << n << " x " << reason << "\n";
  // Most node tests are single ops with static shapes: nearly all must import.
  EXPECT_GT(imported, static_cast<int>(files.size() * 9 / 10));
}

} // namespace
