//===- GpuTest.cpp - The CUDA backend's device layer --------------------===//
//
// Library versions need no device; device tests skip cleanly without one.
//
//===----------------------------------------------------------------------===//
#include "runtime/cuda/Devices.h"

#include <gtest/gtest.h>

using namespace pipec;

namespace {

TEST(Gpu, LibrariesLinkAndReportVersions) {
  auto v = cuda::libraryVersions();
  ASSERT_TRUE(!!v) << llvm::toString(v.takeError());
  EXPECT_GE(v->runtime, 12000);
  EXPECT_GE(v->cublas, 120000);
  EXPECT_GE(v->nccl, 21800);
}

TEST(Gpu, KernelRunsOnEveryDevice) {
  auto devices = cuda::listDevices();
  ASSERT_TRUE(!!devices) << llvm::toString(devices.takeError());
  if (devices->empty())
    GTEST_SKIP() << "no CUDA device";
  for (const auto &d : *devices) {
    EXPECT_GT(d.memoryBytes, 0u);
    llvm::Error err = cuda::selfTest(d.index);
    EXPECT_FALSE(static_cast<bool>(err)) << llvm::toString(std::move(err));
  }
}

} // namespace
