//===- SafetensorsTest.cpp - .safetensors files and the parameter map -----===//
//
// Files written by hand to the format's specification (and by our writer)
// read back byte for byte; every way a header can lie is one line naming the
// file and the byte; a file over 4 GB (sparse) reads its last tensor; the
// parameter map's steps invert exactly.
//
//===----------------------------------------------------------------------===//
#include "runtime/exec/Safetensors.h"
#include "runtime/exec/ParamMap.h"
#include "support/Float16.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/Endian.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Path.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <fstream>
#include <unistd.h>

using namespace pipec;
using namespace pipec::rt;

namespace {

class SafetensorsTest : public ::testing::Test {
protected:
  void SetUp() override {
    ASSERT_FALSE(llvm::sys::fs::createUniqueDirectory("pipec-safetensors", dir));
  }
  void TearDown() override { llvm::sys::fs::remove_directories(dir); }

  std::string path(const std::string &name) {
    llvm::SmallString<256> p(dir);
    llvm::sys::path::append(p, name);
    return std::string(p);
  }

  /// A file of an 8-byte length, \p header and \p data.
  std::string file(const std::string &header, const std::string &data,
                   std::optional<uint64_t> length = std::nullopt) {
    std::string bytes(8, '\0');
    llvm::support::endian::write64le(bytes.data(), length.value_or(header.size()));
    bytes += header + data;
    std::string p = path("f.safetensors");
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }

  /// The error opening \p p, or "" when it opens.
  std::string errorOf(const std::string &p) {
    auto f = SafetensorsFile::open(p);
    if (f)
      return "";
    return llvm::toString(f.takeError());
  }

  llvm::SmallString<128> dir;
};

TEST_F(SafetensorsTest, ReadsWhatTheSpecificationDescribes) {
  // Two float32 and one bfloat16, as safetensors.torch.save_file lays them.
  std::string data;
  auto putFloat = [&](float v) {
    char b[4];
    llvm::support::endian::write32le(b, *reinterpret_cast<uint32_t *>(&v));
    data.append(b, 4);
  };
  putFloat(1.5f);
  putFloat(-2.0f);
  char half[2];
  llvm::support::endian::write16le(half, floatToBFloat16(0.375f));
  data.append(half, 2);
  std::string p = file(R"({"__metadata__":{"format":"pt"},)"
                       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"BF16","shape":[1,1],"data_offsets":[8,10]}})",
                       data);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(!!f) << llvm::toString(f.takeError());
  EXPECT_EQ(f->metadata().at("format"), "pt");
  ASSERT_EQ(f->tensors().size(), 2u);
  auto a = f->toTensor(*f->find("a"));
  ASSERT_TRUE(!!a);
  EXPECT_EQ(a->getDouble(0), 1.5);
  EXPECT_EQ(a->getDouble(1), -2.0);
  auto b = f->toTensor(*f->find("b"));
  ASSERT_TRUE(!!b);
  EXPECT_EQ(b->elemType(), cpu::DType::BF16);
  EXPECT_EQ(b->shape(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(b->getDouble(0), 0.375);
}

TEST_F(SafetensorsTest, WritesWhatItReadsBack) {
  std::map<std::string, cpu::Tensor> tensors;
  tensors["w"] = cpu::Tensor::fromValues<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  cpu::Tensor h(cpu::DType::F16, {3});
  h.setDouble(0, 0.5);
  h.setDouble(1, -1024);
  h.setDouble(2, 65504);
  tensors["h"] = h;
  tensors["i"] = cpu::Tensor::fromValues<int64_t>({2}, {-7, int64_t(1) << 40});
  tensors["empty"] = cpu::Tensor(cpu::DType::F32, {0, 4});
  std::string p = path("out.safetensors");
  ASSERT_FALSE(!!writeSafetensors(p, tensors, {{"format", "pt"}}).operator bool());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(!!f) << llvm::toString(f.takeError());
  ASSERT_EQ(f->tensors().size(), 4u);
  for (const auto &[name, want] : tensors) {
    const SafeTensor *t = f->find(name);
    ASSERT_NE(t, nullptr) << name;
    auto got = f->toTensor(*t);
    ASSERT_TRUE(!!got);
    EXPECT_EQ(got->elemType(), want.elemType()) << name;
    EXPECT_EQ(got->shape(), want.shape()) << name;
    for (int64_t i = 0; i < want.numElements(); ++i)
      EXPECT_EQ(got->getDouble(i), want.getDouble(i)) << name << " " << i;
  }
  // The data starts 8-byte aligned, as the reference writer pads it.
  EXPECT_EQ(f->tensors().front().offset % 8, 0u);
  // No temporary is left beside it.
  std::error_code ec;
  int files = 0;
  for (llvm::sys::fs::directory_iterator it(dir, ec), end; it != end && !ec; it.increment(ec))
    ++files;
  EXPECT_EQ(files, 1);
}

TEST_F(SafetensorsTest, EveryLyingHeaderIsOneLineNamingTheFileAndByte) {
  std::string eight(8, '\0');
  struct Case {
    std::string header, data;
    std::optional<uint64_t> length;
    std::string expect;
  };
  const Case cases[] = {
      {"{}", "", uint64_t(1) << 40, "at byte 0: the header says it is 1099511627776 bytes"},
      {"{}", "", uint64_t(200), "at byte 0: the header says it is 200 bytes; the file has 2"},
      {"{\"a\":", "", std::nullopt, "the header is not JSON"},
      {"[1,2]", "", std::nullopt, "at byte 8: the header is not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       eight, std::nullopt, "names 'a' twice"},
      {R"({"a":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})", eight, std::nullopt,
       "tensor 'a': dtype 'F8_E4M3' is not one pipec reads"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight, std::nullopt,
       "shape [3] of F32 needs 12 bytes; data_offsets [0,8] hold 8"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight, std::nullopt,
       "is not a list of sizes"},
      {R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight, std::nullopt,
       "run past the data's 8 bytes"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight, std::nullopt,
       "is not a range"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       eight, std::nullopt, "overlaps the tensor before it"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight, std::nullopt,
       "4 bytes before tensor 'a' belong to no tensor"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight, std::nullopt,
       "4 bytes at the end belong to no tensor"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"device":"cuda"}})", eight,
       std::nullopt, "unknown key 'device'"},
      {R"({"__metadata__":{"format":1}})", "", std::nullopt, "'format' is not a string"},
      {R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", eight,
       std::nullopt, "overflows"},
  };
  for (const Case &c : cases) {
    std::string p = file(c.header, c.data, c.length);
    std::string error = errorOf(p);
    EXPECT_NE(error.find(p + ": safetensors header at byte "), std::string::npos) << error;
    EXPECT_NE(error.find(c.expect), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  std::string tiny = path("tiny.safetensors");
  std::ofstream(tiny) << "abc";
  EXPECT_NE(errorOf(tiny).find("the file has 3 bytes"), std::string::npos);
  EXPECT_NE(errorOf(dir.str().str())
                .find("a folder with neither model.safetensors nor "
                      "model.safetensors.index.json"),
            std::string::npos);
}

TEST_F(SafetensorsTest, ShardsReadAsOneCheckpoint) {
  // As save_pretrained writes a checkpoint over its shard size: two shards
  // and an index naming each tensor's shard.
  std::map<std::string, cpu::Tensor> first, second;
  first["a"] = cpu::Tensor::fromValues<float>({2}, {1, 2});
  second["b"] = cpu::Tensor::fromValues<float>({1}, {3});
  second["c"] = cpu::Tensor::fromValues<int64_t>({1}, {4});
  ASSERT_FALSE(writeSafetensors(path("model-00001-of-00002.safetensors"), first));
  ASSERT_FALSE(writeSafetensors(path("model-00002-of-00002.safetensors"), second));
  auto index = [&](const std::string &map) {
    std::ofstream(path("model.safetensors.index.json"))
        << R"({"metadata": {"total_size": 20}, "weight_map": {)" << map << "}}";
  };
  index(R"("a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",)"
        R"( "c": "model-00002-of-00002.safetensors")");
  for (const std::string &p : {dir.str().str(), path("model.safetensors.index.json")}) {
    auto f = SafetensorsFile::open(p);
    ASSERT_TRUE(!!f) << llvm::toString(f.takeError());
    ASSERT_EQ(f->tensors().size(), 3u);
    auto b = f->toTensor(*f->find("b"));
    ASSERT_TRUE(!!b);
    EXPECT_EQ(b->getDouble(0), 3);
    EXPECT_EQ(f->find("a")->file, path("model-00001-of-00002.safetensors"));
  }
  struct Case {
    std::string map, expect;
  };
  const Case cases[] = {
      {R"("a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors")",
       "shard 'model-00002-of-00002.safetensors' holds 'c', which the weight_map does not name"},
      {R"("a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",)"
       R"( "c": "model-00002-of-00002.safetensors", "d": "model-00001-of-00002.safetensors")",
       "'d' is in no shard"},
      {R"("a": "../model-00001-of-00002.safetensors")", "is not a file name inside"},
      {R"("a": 7)", "weight_map 'a' is not a file name"},
      {R"("a": "x.safetensors", "a": "y.safetensors")", "names 'a' twice"},
  };
  for (const Case &c : cases) {
    index(c.map);
    std::string error = errorOf(path("model.safetensors.index.json"));
    EXPECT_NE(error.find(c.expect), std::string::npos) << error;
    EXPECT_NE(error.find("model.safetensors.index.json"), std::string::npos) << error;
  }
}

TEST_F(SafetensorsTest, FilesOverFourGigabytesRead) {
  // A sparse file: 4.5 GB of zeros, then one float32 tensor at its end.
  const uint64_t big = (uint64_t(9) << 29); // 4.5 GiB
  std::string header = R"({"zeros":{"dtype":"U8","shape":[)" + std::to_string(big) +
                       R"(],"data_offsets":[0,)" + std::to_string(big) +
                       R"(]},"last":{"dtype":"F32","shape":[1],"data_offsets":[)" +
                       std::to_string(big) + "," + std::to_string(big + 4) + "]}}";
  std::string p = path("big.safetensors");
  int fd = ::open(p.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  char length[8];
  llvm::support::endian::write64le(length, header.size());
  ASSERT_EQ(::write(fd, length, 8), 8);
  ASSERT_EQ(::write(fd, header.data(), header.size()), ssize_t(header.size()));
  float value = 2.5f;
  if (::pwrite(fd, &value, 4, 8 + header.size() + big) != 4) {
    ::close(fd);
    GTEST_SKIP() << "the file system takes no 4.5 GB sparse file";
  }
  ::close(fd);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(!!f) << llvm::toString(f.takeError());
  const SafeTensor *last = f->find("last");
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(last->offset, 8 + header.size() + big);
  auto t = f->toTensor(*last);
  ASSERT_TRUE(!!t);
  EXPECT_EQ(t->getDouble(0), 2.5);
}

plan::ParamPlace placeOf(std::initializer_list<std::function<void(plan::ParamStep &)>> steps) {
  plan::ParamPlace place;
  place.set_weight("w");
  for (const auto &step : steps)
    step(*place.add_steps());
  return place;
}

TEST(ParamMapTest, StepsPlaceAndInvertExactly) {
  // A position table of 6 rows, 2 wide: the exporter kept rows 0..3, then
  // unsqueezed: [1, 4, 2].
  cpu::Tensor table =
      cpu::Tensor::fromValues<float>({6, 2}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  plan::ParamPlace sliced = placeOf({[](plan::ParamStep &s) {
                                       s.mutable_slice()->set_axis(0);
                                       s.mutable_slice()->set_stop(4);
                                     },
                                     [](plan::ParamStep &s) { s.set_unsqueeze(0); }});
  auto held = placeParam(table, sliced, cpu::DType::F32);
  ASSERT_TRUE(!!held) << llvm::toString(held.takeError());
  EXPECT_EQ(held->shape(), (std::vector<int64_t>{1, 4, 2}));
  EXPECT_EQ(held->getDouble(7), 7);
  // Trained: every held entry moved by 100; the rows outside the slice are
  // the checkpoint's times the optimizer's factor for untouched weights.
  cpu::Tensor trained = held->clone();
  for (int64_t i = 0; i < trained.numElements(); ++i)
    trained.setDouble(i, trained.getDouble(i) + 100);
  auto back = unplaceParam(trained, sliced, table, 0.5);
  ASSERT_TRUE(!!back) << llvm::toString(back.takeError());
  EXPECT_EQ(back->shape(), table.shape());
  for (int64_t i = 0; i < 8; ++i)
    EXPECT_EQ(back->getDouble(i), i + 100) << i;
  for (int64_t i = 8; i < 12; ++i)
    EXPECT_EQ(back->getDouble(i), i * 0.5) << i;

  // A Linear's weight [out, in] held transposed; a bfloat16 parameter held
  // in float32.
  cpu::Tensor linear(cpu::DType::BF16, {2, 3});
  for (int64_t i = 0; i < 6; ++i)
    linear.setDouble(i, 0.25 * i);
  plan::ParamPlace transposed = placeOf({[](plan::ParamStep &s) {
    s.mutable_transpose()->add_perm(1);
    s.mutable_transpose()->add_perm(0);
  }});
  auto t = placeParam(linear, transposed, cpu::DType::F32);
  ASSERT_TRUE(!!t);
  EXPECT_EQ(t->elemType(), cpu::DType::F32);
  EXPECT_EQ(t->shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(t->getDouble(1), 0.75); // [0][1] is the parameter's [1][0]
  auto u = unplaceParam(*t, transposed, linear, 1.0);
  ASSERT_TRUE(!!u);
  EXPECT_EQ(u->elemType(), cpu::DType::BF16);
  for (int64_t i = 0; i < 6; ++i)
    EXPECT_EQ(u->getDouble(i), 0.25 * i);

  // Gemma's norm scale, 1 + w: decay pulls towards 1, and the saved
  // parameter is the weight less 1.
  cpu::Tensor scale = cpu::Tensor::fromValues<float>({2}, {0.125f, -0.5f});
  plan::ParamPlace shifted = placeOf({[](plan::ParamStep &s) { s.set_add(1); }});
  EXPECT_EQ(decayCenterOf(shifted), 1.0);
  EXPECT_EQ(decayCenterOf(sliced), 0.0);
  auto s = placeParam(scale, shifted, cpu::DType::F32);
  ASSERT_TRUE(!!s);
  EXPECT_EQ(s->getDouble(0), 1.125);
  auto w = unplaceParam(*s, shifted, scale, 1.0);
  ASSERT_TRUE(!!w);
  EXPECT_EQ(w->getDouble(1), -0.5);

  // A step that does not fit is an error, not a crash.
  plan::ParamPlace tooLong = placeOf({[](plan::ParamStep &s) {
    s.mutable_slice()->set_axis(0);
    s.mutable_slice()->set_stop(9);
  }});
  auto bad = placeParam(table, tooLong, cpu::DType::F32);
  ASSERT_FALSE(!!bad);
  EXPECT_NE(llvm::toString(bad.takeError()).find("does not fit shape [6,2]"), std::string::npos);
}

} // namespace
