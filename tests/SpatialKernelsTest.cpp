//===- SpatialKernelsTest.cpp - Resampling, transposed conv and detection -===//
//
// Cases of the ops-spatial kernels that ONNX's node tests leave out: integer
// linear Resize and its rounding, Resize-10's nearest rounding, one-pixel
// outputs, tf_crop_and_resize extrapolating in nearest mode, antialias with
// axes and keep_aspect_ratio_policy, Upsample-7's attribute, ConvTranspose
// with groups, dilations and an output_shape past the full output,
// GridSample in double with reflection far outside, MaxUnpool's
// output_shape, NonMaxSuppression with centered boxes and a score threshold,
// RoiAlign's max mode. Expected values come from onnxruntime 1.32 and ONNX
// 1.23's reference evaluator (onnx.reference), run from the oracles venv
// (tools/oracles.sh); each case says which, and why where they differ.
//
//===----------------------------------------------------------------------===//
#include "KernelTestUtil.h"

using namespace pipec;
using namespace pipec::test;

namespace {

Tensor f32(const Shape &shape, std::vector<float> values) {
  return Tensor::fromValues<float>(shape, values);
}

/// The error of \p node on \p inputs, or "no error".
std::string errorOf(const onnx::NodeProto &node, const std::vector<Tensor> &inputs, int64_t opset) {
  auto out = cpu::runOp(node, opset, pointers(inputs));
  if (out)
    return "no error";
  return llvm::toString(out.takeError());
}

TEST(SpatialKernels, ResizeLinearRoundsIntegersToNearestEven) {
  Tensor x = Tensor::fromValues<uint8_t>({1, 1, 2, 3}, {0, 255, 10, 3, 4, 200});
  Tensor scales = f32({4}, {1, 1, 1, 2.5f});
  auto y =
      runCpu(NodeBuilder("Resize", 3).s("mode", "linear").omitInput(1), {x, Tensor(), scales}, 19);
  // ONNX's reference, which rounds half to even (onnxruntime truncates the
  // halves: 127, 181, 3, 3, 62).
  Tensor expected = Tensor::fromValues<uint8_t>(
      {1, 1, 2, 7}, {0, 25, 128, 229, 182, 83, 10, 3, 3, 4, 4, 63, 141, 200});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected, 0, 0));
}

TEST(SpatialKernels, Resize10NearestRoundsUpWhenDownscaling) {
  Tensor x = f32({1, 1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  Tensor scales = f32({4}, {1, 1, 1, 0.6f});
  auto y = runCpu(NodeBuilder("Resize", 2), {x, scales}, 10);
  // onnxruntime (ONNX's reference has no Resize-10).
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], f32({1, 1, 2, 3}, {1, 3, 5, 6, 8, 10})));
}

TEST(SpatialKernels, ResizeCubicPytorchHalfPixelToOnePixel) {
  Tensor x = f32({1, 1, 1, 5}, {1, 2, 4, 8, 16});
  Tensor sizes = int64s({4}, {1, 1, 1, 1});
  auto y = runCpu(NodeBuilder("Resize", 4)
                      .s("mode", "cubic")
                      .s("coordinate_transformation_mode", "pytorch_half_pixel")
                      .omitInput(1)
                      .omitInput(2),
                  {x, Tensor(), Tensor(), sizes}, 13);
  // onnxruntime, and the spec's x_original = 0 for a length of 1 (ONNX's
  // reference uses -0.5 and gives 0.90625).
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], f32({1, 1, 1, 1}, {1})));
}

TEST(SpatialKernels, ResizeCropAndResizeExtrapolatesInNearestMode) {
  Tensor x = Tensor::fromValues<int32_t>({1, 1, 3, 4}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  Tensor roi = f32({8}, {0, 0, -0.5f, 0.2f, 1, 1, 0.9f, 1.4f});
  Tensor sizes = int64s({4}, {1, 1, 3, 3});
  auto y = runCpu(NodeBuilder("Resize", 4)
                      .s("mode", "nearest")
                      .s("coordinate_transformation_mode", "tf_crop_and_resize")
                      .f("extrapolation_value", -7)
                      .omitInput(2),
                  {x, roi, Tensor(), sizes}, 13);
  // ONNX's reference, as the spec says for positions outside the input
  // (onnxruntime extrapolates only the columns: its first row reads 1, 2).
  Tensor expected = Tensor::fromValues<int32_t>({1, 1, 3, 3}, {-7, -7, -7, 1, 2, -7, 9, 10, -7});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected, 0, 0));
}

TEST(SpatialKernels, ResizeAntialiasOverReorderedAxesNotSmaller) {
  Tensor x(DType::F32, {1, 4, 5});
  for (int64_t i = 0; i < 20; ++i)
    x.data<float>()[i] = float(i);
  Tensor sizes = int64s({2}, {2, 2});
  auto y = runCpu(NodeBuilder("Resize", 4)
                      .s("mode", "linear")
                      .i("antialias", 1)
                      .ints("axes", {2, 1})
                      .s("keep_aspect_ratio_policy", "not_smaller")
                      .omitInput(1)
                      .omitInput(2),
                  {x, Tensor(), Tensor(), sizes}, 18);
  // onnxruntime and ONNX's reference agree.
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], f32({1, 2, 3}, {3.75f, 5.625f, 7, 12.5f, 14.375f, 15.75f})));
}

TEST(SpatialKernels, Upsample7LinearReadsItsScalesAttribute) {
  onnx::NodeProto node = NodeBuilder("Upsample", 1).s("mode", "linear");
  auto *scales = node.add_attribute();
  scales->set_name("scales");
  scales->set_type(onnx::AttributeProto::FLOATS);
  for (float s : {1.0f, 1.0f, 2.0f, 1.5f})
    scales->add_floats(s);
  auto y = runCpu(node, {f32({1, 1, 2, 2}, {1, 3, 5, 9})}, 7);
  // onnxruntime (ONNX's reference does not run Upsample-7).
  Tensor expected =
      f32({1, 1, 4, 3}, {1, 2.3333333f, 3, 3, 5, 6, 5, 7.6666667f, 9, 5, 7.6666667f, 9});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected));
}

TEST(SpatialKernels, ConvTransposeGroupsDilationsAndLongerOutputShape) {
  Tensor x = f32({1, 2, 3}, {0.5f, 1, 1.5f, 2, 2.5f, 3});
  Tensor w(DType::F32, {2, 2, 3});
  for (int64_t i = 0; i < 12; ++i)
    w.data<float>()[i] = (float(i) - 5) / 4;
  Tensor b = f32({4}, {0.5f, -1, 2, 0.25f});
  auto node = [](int64_t length) {
    return NodeBuilder("ConvTranspose", 3)
        .i("group", 2)
        .ints("dilations", {2})
        .ints("strides", {3})
        .ints("output_shape", {length});
  };
  auto y = runCpu(node(13), {x, w, b}, 11);
  // onnxruntime (ONNX's reference fails on groups here; without groups it
  // agrees with onnxruntime). The full output is 11 long: 13 extends its end.
  Tensor expected =
      f32({1, 4, 13},
          {-0.125f, 0.5f,  0,      -0.75f, 0.125f,  -0.5f, -1.375f, -0.25f, -1,     0.5f,  -0.625f,
           0.5f,    0.5f,  -1.25f, -1,     -1.125f, -1.5f, -1,      -1.25f, -1.75f, -1,    -1.375f,
           -1,      -1,    -1,     -1,     2.5f,    2,     3,       2.625f, 3.5f,   3.25f, 2.75f,
           3.875f,  3.5f,  2,      4.25f,  2,       2,     2.25f,   0.25f,  2.75f,  2.75f, 3.25f,
           3.375f,  3.25f, 4,      4,      0.25f,   4.75f, 0.25f,   0.25f});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected));
  // A whole stride past the full output: both onnxruntime and ONNX's
  // reference refuse it.
  EXPECT_NE(errorOf(node(14), {x, w, b}, 11).find("an output length of 14"), std::string::npos);
}

TEST(SpatialKernels, GridSampleDoubleReflectsFarOutside) {
  Tensor x = Tensor::fromValues<double>({1, 1, 2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor grid = Tensor::fromValues<double>({1, 1, 3, 2}, {-3.7, 0.2, 5.1, -2.6, 0.3, 0.9});
  auto y = runCpu(NodeBuilder("GridSample", 2)
                      .s("mode", "linear")
                      .s("padding_mode", "reflection")
                      .i("align_corners", 0),
                  {x, grid}, 20);
  // onnxruntime, which computes in double (ONNX's reference in float:
  // 4.5499998, 6, 5.4500000).
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(
      close(y[0], Tensor::fromValues<double>({1, 1, 1, 3}, {4.55, 6.0, 5.45}), 1e-12, 1e-12));
  // Cubic with border padding outside X: the reference clamps the position
  // (2.836, 3.0, 5.2713), onnxruntime clamps the taps (2.836, 2.928,
  // 5.2713); refused rather than either.
  std::string err = errorOf(NodeBuilder("GridSample", 2)
                                .s("mode", "cubic")
                                .s("padding_mode", "border")
                                .i("align_corners", 1),
                            {x, grid}, 20);
  EXPECT_NE(err.find("disagree"), std::string::npos) << err;
}

TEST(SpatialKernels, MaxUnpoolOutputShapePadsTheEnd) {
  Tensor x = f32({1, 1, 2, 2}, {5, 6, 7, 8});
  Tensor indices = int64s({1, 1, 2, 2}, {5, 7, 13, 15});
  Tensor outputShape = int64s({4}, {1, 1, 5, 5});
  auto y = runCpu(NodeBuilder("MaxUnpool", 3).ints("kernel_shape", {2, 2}).ints("strides", {2, 2}),
                  {x, indices, outputShape}, 11);
  // ONNX's reference and node test (onnxruntime reads the indices in the
  // 5x5 output instead).
  Tensor expected = f32(
      {1, 1, 5, 5}, {0, 0, 0, 0, 0, 0, 5, 0, 6, 0, 0, 0, 0, 0, 0, 0, 7, 0, 8, 0, 0, 0, 0, 0, 0});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected, 0, 0));
  Tensor smaller = int64s({4}, {1, 1, 3, 5});
  EXPECT_NE(
      errorOf(NodeBuilder("MaxUnpool", 3).ints("kernel_shape", {2, 2}).ints("strides", {2, 2}),
              {x, indices, smaller}, 11)
          .find("smaller than the unpooled"),
      std::string::npos);
}

TEST(SpatialKernels, NonMaxSuppressionCenteredBoxesWithScoreThreshold) {
  Tensor boxes = f32({1, 5, 4}, {0.5f, 0.5f, 1,    1,    0.5f, 0.6f, 1,    1,    0.5f, 0.4f,
                                 1,    1,    2.5f, 2.5f, 1,    1,    2.6f, 2.4f, 1.2f, 0.8f});
  Tensor scores = f32({1, 2, 5}, {0.9f, 0.75f, 0.6f, 0.95f, 0.3f, 0.1f, 0.8f, 0.85f, 0.2f, 0.7f});
  auto y = runCpu(NodeBuilder("NonMaxSuppression", 5).i("center_point_box", 1),
                  {boxes, scores, int64s({1}, {2}), f32({1}, {0.4f}), f32({1}, {0.25f})}, 11);
  // onnxruntime and ONNX's reference agree.
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], int64s({4, 3}, {0, 0, 3, 0, 0, 0, 0, 1, 2, 0, 1, 4}), 0, 0));
}

TEST(SpatialKernels, RoiAlignMaxMode) {
  Tensor x(DType::F32, {1, 2, 4, 4});
  for (int64_t i = 0; i < 32; ++i)
    x.data<float>()[i] = float(i % 7 - 2);
  Tensor rois = f32({2, 4}, {0.3f, 0.6f, 2.9f, 3.1f, 1, 0, 3.5f, 2});
  auto y = runCpu(NodeBuilder("RoiAlign", 3)
                      .s("mode", "max")
                      .i("output_height", 2)
                      .i("output_width", 2)
                      .i("sampling_ratio", 2),
                  {x, rois, int64s({2}, {0, 0})}, 16);
  // onnxruntime and ONNX's reference agree (the maximum of the weighted
  // corners of each sample).
  Tensor expected = f32({2, 2, 2, 2}, {2.2378125f, 3.5612488f, 0.8912497f, 1.2487495f, 3.3687499f,
                                       1.0868746f, 1.1812499f, 1.9771872f, 0.609375f, 0.9375f,
                                       1.828125f, 2.8125f, 0.875f, 2.0625f, 0.5625f, 0.703125f});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(close(y[0], expected));
}

} // namespace
