//===- CurvesTest.cpp - Metrics files and their training curves ---------===//
//
// readMetrics on good lines, on lines with keys it does not know, on
// non-finite numbers and on each kind of bad line (the error names the file
// and the line); printCurvesSvg's charts: one <svg> per chart present,
// eval points with tooltips, every coordinate inside its chart, and no
// NaN or infinity in the text, for full runs, single points, constant and
// non-finite series, and runs too long to draw point by point.
//
//===----------------------------------------------------------------------===//
#include "driver/Curves.h"
#include "tests/TestUtil.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/raw_ostream.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

using namespace llvm;
using namespace pipec;
using namespace pipec::test;

namespace {

std::string writeText(const TempDir &dir, StringRef name, StringRef text) {
  std::string path = dir.path(name);
  std::ofstream(path, std::ios::binary) << text.str();
  return path;
}

/// The points of \p text read back; a failed read fails the test.
std::vector<MetricsPoint> readText(StringRef text) {
  TempDir dir;
  auto points = readMetrics(writeText(dir, "run.jsonl", text));
  if (!points) {
    ADD_FAILURE() << toString(points.takeError());
    return {};
  }
  return *points;
}

/// The error of a read of \p path, or "" when it succeeds.
std::string readError(StringRef path) {
  auto points = readMetrics(path);
  return points ? "" : toString(points.takeError());
}

std::string curves(ArrayRef<MetricsPoint> points) {
  std::string html;
  raw_string_ostream os(html);
  printCurvesSvg(points, os);
  return os.str();
}

/// The text of each <svg>...</svg> of \p html; a nested, unclosed or
/// unopened one fails the test.
std::vector<StringRef> svgs(StringRef html) {
  std::vector<StringRef> out;
  size_t at = 0;
  while (true) {
    size_t open = html.find("<svg", at), close = html.find("</svg>", at);
    if (open == StringRef::npos) {
      EXPECT_EQ(close, StringRef::npos) << "a </svg> with no <svg";
      return out;
    }
    EXPECT_LT(close, html.find("<svg", open + 1)) << "an <svg inside an <svg";
    if (close == StringRef::npos || close < open) {
      ADD_FAILURE() << "an <svg without its </svg>";
      return out;
    }
    out.push_back(html.slice(open, close + 6));
    at = close + 6;
  }
}

/// The numbers of attribute \p name in \p svg: every one of
/// name='a,b c,d' or name='a'.
std::vector<double> attributeNumbers(StringRef svg, StringRef name) {
  std::vector<double> out;
  std::string key = (" " + name + "='").str();
  for (size_t at = svg.find(key); at != StringRef::npos; at = svg.find(key, at + 1)) {
    StringRef value = svg.drop_front(at + key.size()).split('\'').first;
    SmallVector<StringRef, 64> parts;
    value.split(parts, ' ', -1, false);
    for (StringRef part : parts)
      for (StringRef number : {part.split(',').first, part.split(',').second}) {
        double parsed;
        if (!number.empty()) {
          EXPECT_FALSE(number.getAsDouble(parsed)) << name.str() << "='" << value.str() << "'";
          out.push_back(parsed);
        }
      }
  }
  return out;
}

/// Every drawn point of \p svg lies inside its view box.
void expectInsideViewBox(StringRef svg) {
  std::vector<double> box = attributeNumbers(svg.split('>').first, "viewBox");
  ASSERT_EQ(box.size(), 4u);
  std::vector<double> points = attributeNumbers(svg, "points");
  ASSERT_EQ(points.size() % 2, 0u);
  for (size_t i = 0; i < points.size(); i += 2) {
    EXPECT_TRUE(points[i] >= 0 && points[i] <= box[2]) << points[i];
    EXPECT_TRUE(points[i + 1] >= 0 && points[i + 1] <= box[3]) << points[i + 1];
  }
  for (double x : attributeNumbers(svg, "cx"))
    EXPECT_TRUE(x >= 0 && x <= box[2]) << x;
  for (double y : attributeNumbers(svg, "cy"))
    EXPECT_TRUE(y >= 0 && y <= box[3]) << y;
}

void expectNoNonFiniteText(StringRef html) {
  std::string lower = html.lower();
  EXPECT_EQ(lower.find("nan"), std::string::npos) << html.str();
  EXPECT_EQ(lower.find("inf"), std::string::npos) << html.str();
}

MetricsPoint point(int64_t step, std::optional<double> loss,
                   std::optional<double> evalLoss = std::nullopt,
                   std::optional<double> lr = std::nullopt,
                   std::optional<double> tokensPerSecond = std::nullopt) {
  return MetricsPoint{step, loss, evalLoss, lr, tokensPerSecond};
}

/// 200 steps of a decaying loss, a warm-up of the learning rate, tokens/s,
/// and an eval loss of 4.0 - 0.1 k at step 25 k.
std::vector<MetricsPoint> fullRun() {
  std::vector<MetricsPoint> points;
  for (int step = 1; step <= 200; ++step) {
    MetricsPoint p;
    p.step = step;
    p.loss = 3 + 2.5 * std::exp(-step / 50.0);
    p.lr = step < 10 ? 1e-3 * step / 10 : 1e-3;
    p.tokensPerSecond = 8000 + (step % 7) * 10;
    p.samplesPerSecond = 250;
    p.tflops = 0.0125;
    p.mfu = 0.04;
    if (int k = step / 25; step % 25 == 0)
      p.evalLoss = 4.0 - 0.1 * k;
    points.push_back(p);
  }
  return points;
}

TEST(Curves, ReadsEveryKnownKey) {
  auto points =
      readText("{\"step\": 1, \"loss\": 5.5412, \"lr\": 0.001, \"tokens_per_s\": 8123.4, "
               "\"samples_per_s\": 253.8, \"grad_norm\": 1.5, \"tflops\": 0.0123, \"mfu\": 0.041}\n"
               "\n"
               "{\"step\": 50, \"loss\": 3.12, \"eval_loss\": 3.30}\n");
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].step, 1);
  EXPECT_EQ(points[0].loss, 5.5412);
  EXPECT_EQ(points[0].lr, 0.001);
  EXPECT_EQ(points[0].tokensPerSecond, 8123.4);
  EXPECT_EQ(points[0].samplesPerSecond, 253.8);
  EXPECT_EQ(points[0].gradNorm, 1.5);
  EXPECT_EQ(points[0].tflops, 0.0123);
  EXPECT_EQ(points[0].mfu, 0.041);
  EXPECT_FALSE(points[0].evalLoss);
  EXPECT_EQ(points[1].step, 50);
  EXPECT_EQ(points[1].evalLoss, 3.30);
  EXPECT_FALSE(points[1].lr);
  EXPECT_FALSE(points[1].tokensPerSecond);
}

TEST(Curves, ReadsTodaysFilesInFileOrder) {
  auto points = readText("{\"step\": 2, \"loss\": 5.25}\r\n{\"step\": 1, \"loss\": 5.5}");
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].step, 2);
  EXPECT_EQ(points[0].loss, 5.25);
  EXPECT_EQ(points[1].step, 1);
  EXPECT_EQ(points[1].loss, 5.5);
}

TEST(Curves, IgnoresUnknownKeysAndReadsNullAsAbsent) {
  auto points = readText("{\"step\": 3, \"note\": \"warm\", \"loss\": 1, \"nested\": "
                         "{\"lr\": [1, 2]}, \"lr\": null, \"eval\": 7}\n");
  ASSERT_EQ(points.size(), 1u);
  EXPECT_EQ(points[0].step, 3);
  EXPECT_EQ(points[0].loss, 1.0);
  EXPECT_FALSE(points[0].lr);
  EXPECT_FALSE(points[0].evalLoss);
}

TEST(Curves, ReadsNonFiniteSpellings) {
  auto points = readText("{\"step\": 1, \"loss\": nan}\n"
                         "{\"step\": 2, \"loss\": -nan, \"note\": \"inf nan stay text\"}\n"
                         "{\"step\": 3, \"loss\": inf}\n"
                         "{\"step\": 4, \"loss\": -Infinity}\n"
                         "{\"step\": 5, \"loss\": NaN, \"lr\": 1e-5}\n"
                         "{\"step\": 6, \"loss\": \"inf\"}\n");
  ASSERT_EQ(points.size(), 6u);
  EXPECT_TRUE(std::isnan(*points[0].loss));
  EXPECT_TRUE(std::isnan(*points[1].loss));
  EXPECT_EQ(*points[2].loss, HUGE_VAL);
  EXPECT_EQ(*points[3].loss, -HUGE_VAL);
  EXPECT_TRUE(std::isnan(*points[4].loss));
  EXPECT_EQ(points[4].lr, 1e-5);
  EXPECT_EQ(*points[5].loss, HUGE_VAL);
}

TEST(Curves, BadLinesNameTheFileAndLine) {
  const std::pair<const char *, const char *> cases[] = {
      {"not json", "not JSON near column "},
      {"{\"step\": 1} {\"step\": 2}", "not JSON near column 13: text after end of document"},
      {"{\"step\": 1, \"loss\": }", "not JSON near column "},
      {"{\"step\": 1, \"loss\": nan", "not JSON near column "},
      {"[1, 2]", "expected a JSON object with a numeric \"step\""},
      {"{\"loss\": 1}", "expected a JSON object with a numeric \"step\""},
      {"{\"step\": \"3\"}", "expected a JSON object with a numeric \"step\""},
      {"{\"step\": null}", "expected a JSON object with a numeric \"step\""},
      {"{\"step\": 1.5}", "\"step\" must be a whole number, not 1.5"},
      {"{\"step\": 1, \"loss\": \"low\"}", "\"loss\" must be a number"},
      {"{\"step\": 1, \"lr\": [0.1]}", "\"lr\" must be a number"},
      {"{\"step\": 1, \"eval_loss\": true}", "\"eval_loss\" must be a number"},
  };
  TempDir dir;
  for (const auto &[line, expected] : cases) {
    std::string path = writeText(
        dir, "bad.jsonl", "{\"step\": 1, \"loss\": 2}\n" + std::string(line) + "\n{\"step\": 3}\n");
    std::string error = readError(path);
    SCOPED_TRACE(line);
    EXPECT_EQ(error.rfind(path + ":2: ", 0), 0u) << error;
    EXPECT_NE(error.find(expected), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
}

TEST(Curves, EmptyAndMissingFilesAreErrors) {
  TempDir dir;
  for (const char *text : {"", "\n \n\t\n"}) {
    std::string path = writeText(dir, "empty.jsonl", text);
    std::string error = readError(path);
    EXPECT_NE(error.find(path + ": "), std::string::npos) << error;
    EXPECT_NE(error.find("empty"), std::string::npos) << error;
  }
  std::string missing = dir.path("missing.jsonl");
  std::string error = readError(missing);
  EXPECT_NE(error.find(missing + ": "), std::string::npos) << error;
  EXPECT_NE(error.find("No such file"), std::string::npos) << error;
}

TEST(Curves, DrawsEachChartOfAFullRun) {
  std::string html = curves(fullRun());
  EXPECT_EQ(html.rfind("<h2>Training curves</h2>", 0), 0u);
  std::vector<StringRef> charts = svgs(html);
  ASSERT_EQ(charts.size(), 3u) << "loss, learning rate, throughput";
  for (StringRef svg : charts)
    expectInsideViewBox(svg);
  expectNoNonFiniteText(html);
  // Eight eval points, each a dot with its tooltip, on the loss chart.
  EXPECT_EQ(charts[0].count("<circle"), 8u + 1) << "eight dots and the legend's";
  EXPECT_NE(charts[0].find("<title>step 50: eval loss 3.8</title>"), StringRef::npos);
  EXPECT_NE(charts[0].find("<title>step 200: eval loss 3.2</title>"), StringRef::npos);
  EXPECT_NE(charts[0].find(">eval loss</text>"), StringRef::npos) << "a legend";
  EXPECT_EQ(charts[0].count("<polyline"), 2u);
  // Nice ticks: steps 0 to 200 by 50, loss 3 to 5.5 by 0.5.
  for (const char *label : {">0<", ">50<", ">150<", ">200<", ">3.5<", ">5.5<"})
    EXPECT_NE(charts[0].find(label), StringRef::npos) << label;
  EXPECT_NE(charts[1].find(">0.001<"), StringRef::npos);
  EXPECT_NE(charts[2].find(">tokens / s</text>"), StringRef::npos);
  EXPECT_NE(html.find("median MFU 4%"), std::string::npos);
  EXPECT_NE(html.find("lowest 3.2 at step 200"), std::string::npos);
}

TEST(Curves, DrawsOnlyTheSeriesPresent) {
  std::vector<MetricsPoint> points;
  for (int step = 1; step <= 5; ++step)
    points.push_back(point(step, 6.0 - step));
  std::string html = curves(points);
  ASSERT_EQ(svgs(html).size(), 1u);
  EXPECT_EQ(html.find("<circle"), std::string::npos);
  EXPECT_EQ(html.find("Learning rate"), std::string::npos);
  EXPECT_EQ(html.find("Throughput"), std::string::npos);
  EXPECT_NE(html.find("loss: 5 at step 1, 1 at step 5"), std::string::npos);

  for (MetricsPoint &p : points)
    p.samplesPerSecond = 100 + p.step;
  html = curves(points);
  ASSERT_EQ(svgs(html).size(), 2u);
  EXPECT_NE(html.find(">samples / s</text>"), std::string::npos);
  EXPECT_EQ(html.find("tokens / s"), std::string::npos);
}

TEST(Curves, SinglePointsConstantAndNonFiniteSeries) {
  const double nan = std::nan(""), inf = HUGE_VAL;
  std::vector<MetricsPoint> points = {
      point(7, 2.5, std::nullopt, 0.001, nan),
      point(8, nan, std::nullopt, 0.001, inf),
      point(9, -inf, 2.0, 0.001, -inf),
  };
  std::string html = curves(points);
  expectNoNonFiniteText(html);
  std::vector<StringRef> charts = svgs(html);
  ASSERT_EQ(charts.size(), 2u) << "loss and a constant learning rate; no finite tokens/s";
  for (StringRef svg : charts)
    expectInsideViewBox(svg);
  EXPECT_EQ(charts[0].count("<circle"), 2u + 1) << "one loss, one eval loss, the legend's";
  EXPECT_NE(html.find("2 non-finite value(s) of loss not drawn"), std::string::npos);
  EXPECT_NE(html.find("Nothing to draw: 3 non-finite value(s) of tokens / s not drawn"),
            std::string::npos);

  // One point of each series, every value the same.
  html = curves({point(1, 0.0, 0.0, 0.0, 0.0)});
  expectNoNonFiniteText(html);
  charts = svgs(html);
  ASSERT_EQ(charts.size(), 3u);
  for (StringRef svg : charts)
    expectInsideViewBox(svg);

  // Extremes that would overflow a range.
  html = curves({point(1, 1e308, std::nullopt, -1e308), point(2, -1e308, std::nullopt, 1e-320)});
  expectNoNonFiniteText(html);
  for (StringRef svg : svgs(html))
    expectInsideViewBox(svg);
}

TEST(Curves, DownsamplingKeepsEndsAndSpikes) {
  std::vector<std::pair<int64_t, double>> series;
  for (int64_t step = 1; step <= 100001; ++step)
    series.push_back({step, step == 55555  ? 100.0
                            : step == 7777 ? -100.0
                                           : 1.0 / static_cast<double>(step)});
  auto drawn = downsampleSeries(series, 1000);
  ASSERT_LE(drawn.size(), 1000u);
  ASSERT_GE(drawn.size(), 900u);
  EXPECT_EQ(drawn.front(), series.front());
  EXPECT_EQ(drawn.back(), series.back());
  EXPECT_NE(std::find(drawn.begin(), drawn.end(), series[55554]), drawn.end());
  EXPECT_NE(std::find(drawn.begin(), drawn.end(), series[7776]), drawn.end());
  EXPECT_TRUE(std::is_sorted(drawn.begin(), drawn.end()));
  EXPECT_EQ(downsampleSeries(makeArrayRef(series).take_front(1000), 1000).size(), 1000u);
  EXPECT_EQ(downsampleSeries(makeArrayRef(series).take_front(3), 1000).size(), 3u);
}

TEST(Curves, LongRunsAreDrawnFromAThousandPoints) {
  std::vector<MetricsPoint> points;
  for (int step = 100000; step >= 1; --step)
    points.push_back(point(step, 2 + 1.0 / step));
  std::string html = curves(points);
  std::vector<StringRef> charts = svgs(html);
  ASSERT_EQ(charts.size(), 1u);
  expectInsideViewBox(charts[0]);
  std::vector<double> xy = attributeNumbers(charts[0], "points");
  EXPECT_LE(xy.size() / 2, 1000u);
  EXPECT_GE(xy.size() / 2, 900u);
  for (size_t i = 2; i < xy.size(); i += 2)
    EXPECT_LE(xy[i - 2], xy[i]) << "drawn in step order";
}

} // namespace
