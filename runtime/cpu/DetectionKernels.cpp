//===- DetectionKernels.cpp - RoiAlign and NonMaxSuppression on the CPU -----===//
//
// The two ops of detection heads. RoiAlign (10, 16, 22) pools each region
// of interest into a fixed grid of bins, each bin the average (or the
// maximum) of bilinear samples, as Mask R-CNN and onnxruntime define it.
// NonMaxSuppression (10, 11) selects boxes per batch and class greedily by
// score, dropping those that overlap a selected box by more than the IoU
// threshold; its output has one row per selected box, so its length depends
// on the data. Box overlaps are computed in the boxes' precision (float for
// float), as ONNX's reference and onnxruntime do, so thresholds compare
// alike.
//
//===----------------------------------------------------------------------===//
#include "runtime/cpu/KernelSupport.h"
#include "runtime/cpu/KernelTable.h"

#include "llvm/Support/FormatVariadic.h"

#include <cmath>

using namespace llvm;

namespace pipec::cpu {
namespace {

/// One bilinear sample of RoiAlign: four flat positions and their weights
/// (all zero for a sample outside the feature map).
struct Sample {
  int64_t pos[4] = {0, 0, 0, 0};
  double w[4] = {0, 0, 0, 0};
};

Sample bilinearSample(double y, double x, int64_t height, int64_t width) {
  Sample s;
  if (y < -1.0 || y > double(height) || x < -1.0 || x > double(width))
    return s;
  y = std::max(y, 0.0);
  x = std::max(x, 0.0);
  auto yLow = static_cast<int64_t>(y), xLow = static_cast<int64_t>(x);
  int64_t yHigh = yLow + 1, xHigh = xLow + 1;
  if (yLow >= height - 1) {
    yHigh = yLow = height - 1;
    y = double(yLow);
  }
  if (xLow >= width - 1) {
    xHigh = xLow = width - 1;
    x = double(xLow);
  }
  double ly = y - double(yLow), lx = x - double(xLow), hy = 1 - ly, hx = 1 - lx;
  s.pos[0] = yLow * width + xLow;
  s.pos[1] = yLow * width + xHigh;
  s.pos[2] = yHigh * width + xLow;
  s.pos[3] = yHigh * width + xHigh;
  s.w[0] = hy * hx;
  s.w[1] = hy * lx;
  s.w[2] = ly * hx;
  s.w[3] = ly * lx;
  return s;
}

struct RoiAlignSpec {
  bool average = true, halfPixel = false;
  int64_t outHeight = 1, outWidth = 1, samplingRatio = 0;
  double spatialScale = 1;
};

Expected<RoiAlignSpec> readRoiAlign(const OpContext &ctx) {
  RoiAlignSpec spec;
  std::string mode = ctx.attrString("mode", "avg");
  if (mode != "avg" && mode != "max")
    return ctx.fail("unknown mode '" + mode + "'");
  spec.average = mode == "avg";
  // Opset 10 has no attribute and means output_half_pixel.
  std::string coord = ctx.opset >= 16
                          ? ctx.attrString("coordinate_transformation_mode", "half_pixel")
                          : std::string("output_half_pixel");
  if (coord != "half_pixel" && coord != "output_half_pixel")
    return ctx.fail("unknown coordinate_transformation_mode '" + coord + "'");
  spec.halfPixel = coord == "half_pixel";
  spec.outHeight = ctx.attrInt("output_height", 1);
  spec.outWidth = ctx.attrInt("output_width", 1);
  spec.samplingRatio = ctx.attrInt("sampling_ratio", 0);
  spec.spatialScale = ctx.attrFloat("spatial_scale", 1.0f);
  if (spec.outHeight < 1 || spec.outWidth < 1 || spec.samplingRatio < 0)
    return ctx.fail("output_height and output_width must be positive, sampling_ratio >= 0");
  return spec;
}

/// The bins of one region: Y[r, :, :, :] from the feature maps of image
/// \p features ([C, H, W]).
template <typename T>
void alignRegion(const T *features, int64_t channels, int64_t height, int64_t width,
                 const double box[4], const RoiAlignSpec &spec, T *out) {
  double offset = spec.halfPixel ? 0.5 : 0.0;
  double startW = box[0] * spec.spatialScale - offset, startH = box[1] * spec.spatialScale - offset;
  double endW = box[2] * spec.spatialScale - offset, endH = box[3] * spec.spatialScale - offset;
  double roiWidth = endW - startW, roiHeight = endH - startH;
  if (!spec.halfPixel) {
    roiWidth = std::max(roiWidth, 1.0);
    roiHeight = std::max(roiHeight, 1.0);
  }
  double binH = roiHeight / double(spec.outHeight), binW = roiWidth / double(spec.outWidth);
  // Regions too large for their samples to be counted are not pooled.
  auto gridOf = [&](double extent, int64_t bins) {
    double n = spec.samplingRatio > 0 ? double(spec.samplingRatio) : std::ceil(extent / bins);
    return static_cast<int64_t>(std::clamp(n, 0.0, 1e4));
  };
  int64_t gridH = gridOf(roiHeight, spec.outHeight), gridW = gridOf(roiWidth, spec.outWidth);
  double count = double(std::max<int64_t>(gridH * gridW, 1));
  std::vector<Sample> samples;
  for (int64_t ph = 0; ph < spec.outHeight; ++ph)
    for (int64_t pw = 0; pw < spec.outWidth; ++pw)
      for (int64_t iy = 0; iy < gridH; ++iy) {
        double y = startH + double(ph) * binH + (double(iy) + 0.5) * binH / double(gridH);
        for (int64_t ix = 0; ix < gridW; ++ix) {
          double x = startW + double(pw) * binW + (double(ix) + 0.5) * binW / double(gridW);
          samples.push_back(bilinearSample(y, x, height, width));
        }
      }
  int64_t perBin = gridH * gridW, bins = spec.outHeight * spec.outWidth;
  for (int64_t c = 0; c < channels; ++c) {
    const T *map = features + c * height * width;
    for (int64_t b = 0; b < bins; ++b) {
      double value = 0;
      for (int64_t k = 0; k < perBin; ++k) {
        const Sample &s = samples[b * perBin + k];
        double terms[4];
        for (int j = 0; j < 4; ++j)
          terms[j] = s.w[j] * double(map[s.pos[j]]);
        if (spec.average) {
          value += terms[0] + terms[1] + terms[2] + terms[3];
        } else {
          // The maximum of the weighted corners, as onnxruntime computes it.
          double v = std::max({terms[0], terms[1], terms[2], terms[3]});
          value = k == 0 ? v : std::max(value, v);
        }
      }
      out[c * bins + b] = static_cast<T>(spec.average ? value / count : value);
    }
  }
}

} // namespace

/// RoiAlign (10, 16, 22): X [N, C, H, W], rois [R, 4] (x1, y1, x2, y2),
/// batch_indices [R] to Y [R, C, output_height, output_width].
Expected<Outputs> roiAlign(const OpContext &ctx) {
  const Tensor &x = ctx.input(0), &rois = ctx.input(1), &batchIndices = ctx.input(2);
  Expected<RoiAlignSpec> spec = readRoiAlign(ctx);
  if (!spec)
    return spec.takeError();
  if (x.rank() != 4)
    return ctx.fail("X must be [N, C, H, W], got " + x.describe());
  if (Error err = ctx.sameType(0, 1))
    return err;
  if (Error err = ctx.integerInput(2, "batch_indices"))
    return err;
  int64_t regions = batchIndices.numElements();
  if (rois.rank() != 2 || rois.dim(1) != 4 || rois.dim(0) != regions || batchIndices.rank() != 1)
    return ctx.fail("rois " + rois.describe() + " and batch_indices " + batchIndices.describe() +
                    " must be [R, 4] and [R]");
  int64_t channels = x.dim(1), height = x.dim(2), width = x.dim(3);
  Shape batch = batchIndices.toInt64Vector();
  for (int64_t b : batch)
    if (b < 0 || b >= x.dim(0))
      return ctx.fail(formatv("batch index {0} out of range [0, {1})", b, x.dim(0)));
  if (regions > 0 && (height == 0 || width == 0))
    return ctx.fail("X " + x.describe() + " has an empty feature map");
  for (int64_t i = 0; i < rois.numElements(); ++i)
    if (!std::isfinite(rois.getDouble(i)))
      return ctx.fail("rois must be finite");
  Shape outShape{regions, channels, spec->outHeight, spec->outWidth};
  return onFloat(ctx, x, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    Tensor y(x.elemType(), outShape);
    int64_t plane = channels * spec->outHeight * spec->outWidth;
    for (int64_t r = 0; r < regions; ++r) {
      double box[4];
      for (int j = 0; j < 4; ++j)
        box[j] = double(rois.data<T>()[r * 4 + j]);
      alignRegion(x.data<T>() + batch[r] * channels * height * width, channels, height, width, box,
                  *spec, y.data<T>() + r * plane);
    }
    return Outputs{y};
  });
}

namespace {

/// Whether box \p a suppresses box \p b: their IoU exceeds \p threshold.
/// Corners are [y1, x1, y2, x2] in any order, or with \p centered
/// [x_center, y_center, width, height].
template <typename T> bool suppresses(const T *a, const T *b, bool centered, T threshold) {
  T aMin[2], aMax[2], bMin[2], bMax[2]; // [x, y]
  for (int d = 0; d < 2; ++d) {
    if (centered) {
      aMin[d] = a[d] - a[d + 2] / 2, aMax[d] = a[d] + a[d + 2] / 2;
      bMin[d] = b[d] - b[d + 2] / 2, bMax[d] = b[d] + b[d + 2] / 2;
    } else {
      int c = 1 - d; // x is column 1, y column 0.
      aMin[d] = std::min(a[c], a[c + 2]), aMax[d] = std::max(a[c], a[c + 2]);
      bMin[d] = std::min(b[c], b[c + 2]), bMax[d] = std::max(b[c], b[c + 2]);
    }
  }
  T extent[2];
  for (int d = 0; d < 2; ++d) {
    extent[d] = std::min(aMax[d], bMax[d]) - std::max(aMin[d], bMin[d]);
    if (!(extent[d] > 0))
      return false;
  }
  T intersection = extent[0] * extent[1];
  T areaA = (aMax[0] - aMin[0]) * (aMax[1] - aMin[1]);
  T areaB = (bMax[0] - bMin[0]) * (bMax[1] - bMin[1]);
  T unionArea = areaA + areaB - intersection;
  if (!(intersection > 0) || !(areaA > 0) || !(areaB > 0) || !(unionArea > 0))
    return false;
  return intersection / unionArea > threshold;
}

/// The selected box indices of one batch and class, in selection order.
template <typename T>
std::vector<int64_t> selectBoxes(const T *boxes, const T *scores, int64_t count, int64_t limit,
                                 bool centered, T iouThreshold, std::optional<T> scoreThreshold) {
  std::vector<int64_t> candidates;
  for (int64_t i = 0; i < count; ++i)
    if (!scoreThreshold || scores[i] > *scoreThreshold)
      candidates.push_back(i);
  // Highest score first; equal scores by index.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  std::vector<int64_t> selected;
  for (int64_t i : candidates) {
    if (static_cast<int64_t>(selected.size()) >= limit)
      break;
    bool keep = llvm::none_of(selected, [&](int64_t s) {
      return suppresses(boxes + i * 4, boxes + s * 4, centered, iouThreshold);
    });
    if (keep)
      selected.push_back(i);
  }
  return selected;
}

} // namespace

/// NonMaxSuppression (10, 11): boxes [B, N, 4], scores [B, C, N] and the
/// optional limits to selected_indices [K, 3] (batch, class, box).
Expected<Outputs> nonMaxSuppression(const OpContext &ctx) {
  const Tensor &boxes = ctx.input(0), &scores = ctx.input(1);
  const Tensor *limitIn = ctx.optInput(2), *iouIn = ctx.optInput(3), *scoreIn = ctx.optInput(4);
  if (Error err = ctx.sameType(0, 1))
    return err;
  if (boxes.rank() != 3 || boxes.dim(2) != 4 || scores.rank() != 3 ||
      scores.dim(0) != boxes.dim(0) || scores.dim(2) != boxes.dim(1))
    return ctx.fail("boxes " + boxes.describe() + " and scores " + scores.describe() +
                    " must be [B, N, 4] and [B, C, N]");
  int64_t centerPointBox = ctx.attrInt("center_point_box", 0);
  if (centerPointBox != 0 && centerPointBox != 1)
    return ctx.fail("center_point_box must be 0 or 1");
  if (limitIn && (limitIn->elemType() != DType::I64 || limitIn->numElements() > 1))
    return ctx.fail("max_output_boxes_per_class must be one int64, got " + limitIn->describe());
  for (const Tensor *t : {iouIn, scoreIn})
    if (t && (!isFloating(t->elemType()) || t->numElements() > 1))
      return ctx.fail("thresholds must be one float each, got " + t->describe());
  int64_t limit =
      limitIn && limitIn->numElements() == 1 ? std::max<int64_t>(0, limitIn->getInt64(0)) : 0;
  double iou = iouIn && iouIn->numElements() == 1 ? iouIn->getDouble(0) : 0.0;
  if (!(iou >= 0 && iou <= 1))
    return ctx.fail(formatv("iou_threshold {0} is outside [0, 1]", iou));
  std::optional<double> scoreThreshold;
  if (scoreIn && scoreIn->numElements() == 1)
    scoreThreshold = scoreIn->getDouble(0);
  int64_t batches = boxes.dim(0), classes = scores.dim(1), count = boxes.dim(1);
  return onFloat(ctx, boxes, 0, [&](auto tag) -> Expected<Outputs> {
    using T = decltype(tag);
    if (llvm::any_of(scores.values<T>(), [](T v) { return std::isnan(v); }))
      return ctx.unsupported("NaN scores (they have no order)");
    std::optional<T> threshold;
    if (scoreThreshold)
      threshold = static_cast<T>(*scoreThreshold);
    std::vector<int64_t> rows;
    for (int64_t b = 0; b < batches; ++b)
      for (int64_t c = 0; c < classes; ++c) {
        const T *s = scores.data<T>() + (b * classes + c) * count;
        for (int64_t i : selectBoxes(boxes.data<T>() + b * count * 4, s, count, limit,
                                     centerPointBox == 1, static_cast<T>(iou), threshold))
          rows.insert(rows.end(), {b, c, i});
      }
    int64_t selected = static_cast<int64_t>(rows.size() / 3);
    return Outputs{Tensor::fromValues<int64_t>({selected, 3}, rows)};
  });
}

} // namespace pipec::cpu
