//===- Curves.cpp - Training curves from a metrics file ------------------===//
//
// Reading: one llvm::json document a line, with the non-finite numbers
// that C's printf ("nan", "-inf") and Python ("NaN", "Infinity") write
// quoted first, since JSON has no spelling for them. Drawing: each chart
// maps steps and values onto fixed pixel ranges whose ends are "nice"
// numbers (1, 2 or 5 x 10^k), widened first when every value is the same,
// so that no division by zero can reach the output.
//
//===----------------------------------------------------------------------===//
#include "driver/Curves.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/JSON.h"
#include "llvm/Support/MemoryBuffer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

using namespace llvm;

namespace pipec {
namespace {

using Sample = std::pair<int64_t, double>;

/// The keys of a metrics line that are read, each with the field it fills.
struct MetricsKey {
  const char *key;
  std::optional<double> MetricsPoint::*field;
};
constexpr MetricsKey metricsKeys[] = {{"loss", &MetricsPoint::loss},
                                      {"eval_loss", &MetricsPoint::evalLoss},
                                      {"lr", &MetricsPoint::lr},
                                      {"tokens_per_s", &MetricsPoint::tokensPerSecond},
                                      {"samples_per_s", &MetricsPoint::samplesPerSecond},
                                      {"grad_norm", &MetricsPoint::gradNorm},
                                      {"tflops", &MetricsPoint::tflops},
                                      {"mfu", &MetricsPoint::mfu}};

/// The drawn series of a chart keep at most this many points each.
constexpr size_t maxPointsPerSeries = 1000;
/// Values are clamped to this before drawing, so that a range never
/// overflows.
constexpr double maxDrawn = 1e300;

/// printf's formatting of \p values.
template <typename... Ts> std::string printed(const char *fmt, Ts... values) {
  std::string text;
  raw_string_ostream(text) << format(fmt, values...);
  return text;
}

Error lineError(const Twine &message) {
  return make_error<StringError>(message, inconvertibleErrorCode());
}

/// NaN or an infinity as printf and Python write them, with a sign and in
/// any case.
std::optional<double> nonFinite(StringRef word) {
  double sign = 1;
  if (word.consume_front("-"))
    sign = -1;
  else
    word.consume_front("+");
  if (word.equals_insensitive("nan"))
    return std::numeric_limits<double>::quiet_NaN();
  if (word.equals_insensitive("inf") || word.equals_insensitive("infinity"))
    return sign * std::numeric_limits<double>::infinity();
  return std::nullopt;
}

/// \p line with each bare nan or infinity outside a string quoted.
std::string quoteNonFinite(StringRef line) {
  std::string out;
  bool inString = false;
  for (size_t i = 0; i < line.size();) {
    char c = line[i];
    if (inString) {
      size_t width = c == '\\' && i + 1 < line.size() ? 2 : 1;
      out += line.substr(i, width).str();
      inString = c != '"';
      i += width;
      continue;
    }
    if (c != '-' && c != '+' && !isAlpha(c)) {
      inString = c == '"';
      out += c;
      ++i;
      continue;
    }
    size_t end = i + 1;
    while (end < line.size() && isAlnum(line[end]))
      ++end;
    StringRef word = line.slice(i, end);
    out += nonFinite(word) ? ("\"" + word + "\"").str() : word.str();
    i = end;
  }
  return out;
}

/// "not JSON near column 6: invalid JSON value" from llvm::json's
/// "[1:5, byte=5]: Invalid JSON value", whose column counts from 0 (each
/// line is a document of its own).
std::string describeParseError(Error error) {
  std::string text = toString(std::move(error));
  StringRef rest(text);
  size_t close = rest.find("]: ");
  unsigned column = 0;
  if (!rest.startswith("[") || close == StringRef::npos ||
      rest.slice(1, close).split(':').second.split(',').first.getAsInteger(10, column))
    return "not JSON: " + text;
  std::string message = rest.drop_front(close + 3).str();
  if (!message.empty())
    message[0] = toLower(message[0]);
  return formatv("not JSON near column {0}: {1}", column + 1, message);
}

/// \p line as JSON, read again with its non-finite numbers quoted when it
/// does not parse as it is.
Expected<json::Value> parseJson(StringRef line) {
  Expected<json::Value> parsed = json::parse(line);
  if (parsed)
    return parsed;
  Expected<json::Value> quoted = json::parse(quoteNonFinite(line));
  if (quoted) {
    consumeError(parsed.takeError());
    return quoted;
  }
  consumeError(quoted.takeError());
  return lineError(describeParseError(parsed.takeError()));
}

Expected<MetricsPoint> parseLine(StringRef line) {
  Expected<json::Value> parsed = parseJson(line);
  if (!parsed)
    return parsed.takeError();
  const json::Object *object = parsed->getAsObject();
  const json::Value *step = object ? object->get("step") : nullptr;
  if (!step || !step->getAsNumber())
    return lineError("expected a JSON object with a numeric \"step\"");
  Optional<int64_t> whole = step->getAsInteger();
  if (!whole)
    return lineError(Twine("\"step\" must be a whole number, not ") +
                     printed("%g", *step->getAsNumber()));
  MetricsPoint point;
  point.step = *whole;
  for (const MetricsKey &key : metricsKeys) {
    const json::Value *value = object->get(key.key);
    if (!value || value->getAsNull())
      continue;
    std::optional<double> number;
    if (Optional<double> parsedNumber = value->getAsNumber())
      number = *parsedNumber;
    else if (Optional<StringRef> text = value->getAsString())
      number = nonFinite(*text);
    if (!number)
      return lineError(formatv("\"{0}\" must be a number", key.key).str());
    point.*key.field = number;
  }
  return point;
}

//===----------------------------------------------------------------------===//
// Charts
//===----------------------------------------------------------------------===//

/// One line of a chart: its finite samples by step, and how many values
/// were not finite.
struct Series {
  std::string name;
  const char *color;
  bool markers; // eval: every sample a dot with a tooltip
  std::vector<Sample> samples;
  size_t nonFinite = 0;
};

Series collect(ArrayRef<MetricsPoint> points, std::optional<double> MetricsPoint::*field,
               StringRef name, const char *color, bool markers = false) {
  Series series{name.str(), color, markers, {}, 0};
  for (const MetricsPoint &point : points) {
    const std::optional<double> &value = point.*field;
    if (!value)
      continue;
    if (std::isfinite(*value))
      series.samples.push_back({point.step, std::clamp(*value, -maxDrawn, maxDrawn)});
    else
      ++series.nonFinite;
  }
  std::stable_sort(series.samples.begin(), series.samples.end(),
                   [](const Sample &a, const Sample &b) { return a.first < b.first; });
  return series;
}

/// The upper median of \p values, if any.
std::optional<double> median(std::vector<double> values) {
  if (values.empty())
    return std::nullopt;
  auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

/// The median of the finite values of \p field, if any.
std::optional<double> median(ArrayRef<MetricsPoint> points,
                             std::optional<double> MetricsPoint::*field) {
  std::vector<double> values;
  for (const MetricsPoint &point : points)
    if (const std::optional<double> &value = point.*field; value && std::isfinite(*value))
      values.push_back(*value);
  return median(std::move(values));
}

/// A value in a caption or a tooltip.
std::string formatValue(double value) { return printed("%.5g", value); }

/// An axis from lo to hi, both multiples of step.
struct Axis {
  double lo, hi, step;
  double fraction(double value) const { return hi > lo ? (value - lo) / (hi - lo) : 0.5; }
};

/// 1, 2, 5 or 10 x 10^k, the first at least \p rough (> 0).
double niceStep(double rough) {
  double magnitude = std::pow(10.0, std::floor(std::log10(rough)));
  double mantissa = rough / magnitude;
  return (mantissa <= 1 ? 1 : mantissa <= 2 ? 2 : mantissa <= 5 ? 5 : 10) * magnitude;
}

/// About five intervals over [lo, hi]; a range too narrow to tell apart
/// from one value is widened around it. \p whole: the ticks are integers.
Axis niceAxis(double lo, double hi, bool whole) {
  if (!(hi - lo > std::abs(lo) * 1e-12 + 1e-280)) {
    double pad = whole ? 1 : std::abs(lo) / 10;
    if (!(pad > 1e-280))
      pad = 1;
    lo -= pad;
    hi = lo + 2 * pad;
  }
  double step = niceStep((hi - lo) / 5);
  if (whole)
    step = std::max(step, 1.0);
  return {std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

/// The multiples of the axis' step between its ends.
std::vector<double> ticks(const Axis &axis) {
  std::vector<double> out;
  double last = std::floor(axis.hi / axis.step + 1e-9);
  for (double k = std::ceil(axis.lo / axis.step - 1e-9); k <= last && out.size() < 24; ++k) {
    double value = k * axis.step;
    out.push_back(std::abs(value) < axis.step * 1e-9 ? 0 : value);
  }
  return out;
}

/// The shortest label that tells \p value apart from its neighbours
/// \p step away.
std::string tickLabel(double value, double step) {
  if (value == 0)
    return "0";
  int magnitude = static_cast<int>(std::floor(std::log10(std::abs(value))));
  int digits = magnitude - static_cast<int>(std::floor(std::log10(step))) + 1;
  digits = std::clamp(std::max(digits, magnitude + 1), 1, 15);
  return printed("%.*g", digits, value);
}

// Pixel layout of a chart.
constexpr int chartWidth = 900, chartHeight = 306;
constexpr int plotLeft = 80, plotRight = 870, plotTop = 34, plotBottom = 264;

struct Frame {
  Axis x, y;
  double px(double step) const { return plotLeft + x.fraction(step) * (plotRight - plotLeft); }
  double py(double value) const { return plotBottom - y.fraction(value) * (plotBottom - plotTop); }
};

void drawAxes(const Frame &frame, StringRef yTitle, raw_ostream &os) {
  for (double t : ticks(frame.y)) {
    double y = frame.py(t);
    os << formatv("<line x1='{0}' x2='{1}' y1='{2:f1}' y2='{2:f1}' stroke='#eee'/>"
                  "<text x='{3}' y='{4:f1}' font-size='10' text-anchor='end'>{5}</text>\n",
                  plotLeft, plotRight, y, plotLeft - 6, y + 3.5, tickLabel(t, frame.y.step));
  }
  for (double t : ticks(frame.x)) {
    double x = frame.px(t);
    os << formatv("<line x1='{0:f1}' x2='{0:f1}' y1='{1}' y2='{2}' stroke='#999'/>"
                  "<text x='{0:f1}' y='{3}' font-size='10' text-anchor='middle'>{4}</text>\n",
                  x, plotBottom, plotBottom + 5, plotBottom + 17, tickLabel(t, frame.x.step));
  }
  os << formatv("<path d='M{0} {1} V{2} H{3}' fill='none' stroke='#999'/>\n", plotLeft, plotTop,
                plotBottom, plotRight);
  os << formatv("<text x='{0}' y='{1}' font-size='12' text-anchor='middle'>step</text>\n",
                (plotLeft + plotRight) / 2, chartHeight - 6);
  os << formatv("<text x='16' y='{0}' font-size='12' text-anchor='middle' "
                "transform='rotate(-90 16 {0})'>{1}</text>\n",
                (plotTop + plotBottom) / 2, yTitle);
}

void drawSeries(const Series &series, const Frame &frame, raw_ostream &os) {
  std::vector<Sample> drawn = downsampleSeries(series.samples, maxPointsPerSeries);
  if (drawn.size() > 1) {
    os << formatv("<polyline fill='none' stroke='{0}' stroke-width='{1}' "
                  "stroke-linejoin='round' points='",
                  series.color, series.markers ? "1.2" : "1.5");
    for (size_t i = 0; i < drawn.size(); ++i)
      os << formatv("{0}{1:f1},{2:f1}", i ? " " : "", frame.px(static_cast<double>(drawn[i].first)),
                    frame.py(drawn[i].second));
    os << "'/>\n";
  }
  if (!series.markers && drawn.size() > 1)
    return;
  for (const auto &[step, value] : drawn)
    os << formatv("<circle cx='{0:f1}' cy='{1:f1}' r='3.5' fill='{2}' stroke='white'>"
                  "<title>step {3}: {4} {5}</title></circle>\n",
                  frame.px(static_cast<double>(step)), frame.py(value), series.color, step,
                  series.name, formatValue(value));
}

void drawLegend(ArrayRef<const Series *> series, raw_ostream &os) {
  double x = plotLeft;
  for (const Series *s : series) {
    os << formatv("<line x1='{0}' x2='{1}' y1='16' y2='16' stroke='{2}' stroke-width='2'/>", x,
                  x + 18, s->color);
    if (s->markers)
      os << formatv("<circle cx='{0}' cy='16' r='3.5' fill='{1}'/>", x + 9, s->color);
    os << formatv("<text x='{0}' y='20' font-size='12'>{1}</text>\n", x + 24, s->name);
    x += 40 + 7 * static_cast<double>(s->name.size());
  }
}

/// What a caption says of a series.
enum class Summary { Ends, Median };

std::string summarize(const Series &series, Summary summary) {
  if (series.samples.empty())
    return "";
  const std::vector<Sample> &s = series.samples;
  if (summary == Summary::Median) {
    std::vector<double> values;
    values.reserve(s.size());
    for (const Sample &sample : s)
      values.push_back(sample.second);
    return formatv("{0}: median {1} over {2} step(s)", series.name,
                   formatValue(*median(std::move(values))), s.size());
  }
  std::string text =
      formatv("{0}: {1} at step {2}", series.name, formatValue(s.front().second), s.front().first);
  if (s.size() > 1)
    text += formatv(", {0} at step {1}", formatValue(s.back().second), s.back().first).str();
  if (series.markers && s.size() > 2) {
    auto lowest = std::min_element(
        s.begin(), s.end(), [](const Sample &a, const Sample &b) { return a.second < b.second; });
    text += formatv(", lowest {0} at step {1}", formatValue(lowest->second), lowest->first).str();
  }
  return text;
}

/// One chart of the \p series that are present, with a caption; nothing
/// when none is.
void printChart(StringRef title, StringRef yTitle, ArrayRef<Series> series, Summary summary,
                ArrayRef<std::string> extraNotes, raw_ostream &os) {
  std::vector<const Series *> drawn;
  std::vector<std::string> notes;
  double minValue = std::numeric_limits<double>::infinity(), maxValue = -minValue;
  double minStep = minValue, maxStep = maxValue;
  for (const Series &s : series) {
    if (s.nonFinite)
      notes.push_back(formatv("{0} non-finite value(s) of {1} not drawn", s.nonFinite, s.name));
    if (s.samples.empty())
      continue;
    drawn.push_back(&s);
    notes.push_back(summarize(s, summary));
    minStep = std::min(minStep, static_cast<double>(s.samples.front().first));
    maxStep = std::max(maxStep, static_cast<double>(s.samples.back().first));
    for (const Sample &sample : s.samples) {
      minValue = std::min(minValue, sample.second);
      maxValue = std::max(maxValue, sample.second);
    }
  }
  if (drawn.empty() && notes.empty())
    return;
  os << "<h3>" << title << "</h3>\n";
  if (drawn.empty()) {
    os << "<p class='note warn'>Nothing to draw: " << join(notes, "; ") << ".</p>\n";
    return;
  }
  Frame frame{niceAxis(minStep, maxStep, true), niceAxis(minValue, maxValue, false)};
  os << formatv("<svg class=curve viewBox='0 0 {0} {1}' width='{0}' height='{1}' "
                "xmlns='http://www.w3.org/2000/svg' font-family='sans-serif'>\n",
                chartWidth, chartHeight);
  drawAxes(frame, yTitle, os);
  for (const Series *s : drawn)
    drawSeries(*s, frame, os);
  if (drawn.size() > 1)
    drawLegend(drawn, os);
  os << "</svg>\n";
  notes.insert(notes.end(), extraNotes.begin(), extraNotes.end());
  os << "<p class=note>" << join(notes, "; ") << ".</p>\n";
}

} // namespace

Expected<std::vector<MetricsPoint>> readMetrics(StringRef path) {
  ErrorOr<std::unique_ptr<MemoryBuffer>> file = MemoryBuffer::getFile(path, /*IsText=*/true);
  if (!file)
    return createStringError(file.getError(), "%s: cannot read the metrics file: %s",
                             path.str().c_str(), file.getError().message().c_str());
  std::vector<MetricsPoint> points;
  StringRef rest = (*file)->getBuffer();
  for (size_t lineNumber = 1; !rest.empty(); ++lineNumber) {
    auto [line, tail] = rest.split('\n');
    rest = tail;
    line = line.trim();
    if (line.empty())
      continue;
    Expected<MetricsPoint> point = parseLine(line);
    if (!point)
      return createStringError(inconvertibleErrorCode(), "%s:%zu: %s", path.str().c_str(),
                               lineNumber, toString(point.takeError()).c_str());
    points.push_back(*point);
  }
  if (points.empty())
    return createStringError(inconvertibleErrorCode(), "%s: the metrics file is empty",
                             path.str().c_str());
  return points;
}

std::vector<Sample> downsampleSeries(ArrayRef<Sample> series, size_t maxPoints) {
  maxPoints = std::max<size_t>(maxPoints, 4);
  if (series.size() <= maxPoints)
    return series.vec();
  std::vector<Sample> out{series.front()};
  size_t inner = series.size() - 2, buckets = (maxPoints - 2) / 2;
  auto byValue = [](const Sample &a, const Sample &b) { return a.second < b.second; };
  for (size_t b = 0; b < buckets; ++b) {
    const Sample *begin = series.begin() + 1 + inner * b / buckets;
    const Sample *end = series.begin() + 1 + inner * (b + 1) / buckets;
    if (begin == end)
      continue;
    auto [lowest, highest] = std::minmax_element(begin, end, byValue);
    out.push_back(*std::min(lowest, highest));
    if (lowest != highest)
      out.push_back(*std::max(lowest, highest));
  }
  out.push_back(series.back());
  return out;
}

void printCurvesSvg(ArrayRef<MetricsPoint> points, raw_ostream &os) {
  os << "<h2>Training curves</h2>\n";
  if (points.empty()) {
    os << "<p>No metrics.</p>\n";
    return;
  }
  auto [first, last] = std::minmax_element(
      points.begin(), points.end(),
      [](const MetricsPoint &a, const MetricsPoint &b) { return a.step < b.step; });
  os << formatv("<p>{0} line(s) of metrics, steps {1} to {2}.</p>\n", points.size(), first->step,
                last->step);

  printChart("Loss", "loss",
             {collect(points, &MetricsPoint::loss, "loss", "#4c78a8"),
              collect(points, &MetricsPoint::evalLoss, "eval loss", "#f58518", true)},
             Summary::Ends, {}, os);
  printChart("Learning rate", "learning rate",
             {collect(points, &MetricsPoint::lr, "learning rate", "#54a24b")}, Summary::Ends, {},
             os);

  bool tokens = std::any_of(points.begin(), points.end(),
                            [](const MetricsPoint &p) { return p.tokensPerSecond.has_value(); });
  std::vector<std::string> extra;
  if (std::optional<double> tflops = median(points, &MetricsPoint::tflops))
    extra.push_back("median " + formatValue(*tflops) + " TFLOP/s");
  if (std::optional<double> mfu = median(points, &MetricsPoint::mfu))
    extra.push_back("median MFU " + formatValue(100 * *mfu) + "%");
  printChart("Throughput", tokens ? "tokens / s" : "samples / s",
             {tokens ? collect(points, &MetricsPoint::tokensPerSecond, "tokens / s", "#b279a2")
                     : collect(points, &MetricsPoint::samplesPerSecond, "samples / s", "#b279a2")},
             Summary::Median, extra, os);
}

std::string summarizeMetrics(ArrayRef<MetricsPoint> points) {
  std::vector<MetricsPoint> sorted(points.begin(), points.end());
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const MetricsPoint &a, const MetricsPoint &b) { return a.step < b.step; });
  std::string text = formatv("metrics: {0} step(s), {1} to {2}", sorted.size(), sorted.front().step,
                             sorted.back().step)
                         .str();
  auto firstAndLast = [&](std::optional<double> MetricsPoint::*field, StringRef name) {
    const MetricsPoint *first = nullptr, *last = nullptr;
    for (const MetricsPoint &p : sorted)
      if ((p.*field) && std::isfinite(*(p.*field))) {
        if (!first)
          first = &p;
        last = &p;
      }
    if (first)
      text +=
          formatv("\n  {0} {1} at step {2}, {3} at step {4}", name, formatValue(*(first->*field)),
                  first->step, formatValue(*(last->*field)), last->step)
              .str();
  };
  firstAndLast(&MetricsPoint::loss, "loss");
  firstAndLast(&MetricsPoint::evalLoss, "eval loss");
  const MetricsPoint *best = nullptr;
  for (const MetricsPoint &p : sorted)
    if (p.evalLoss && std::isfinite(*p.evalLoss) && (!best || *p.evalLoss < *best->evalLoss))
      best = &p;
  if (best)
    text += formatv("; lowest {0} at step {1}", formatValue(*best->evalLoss), best->step).str();
  std::vector<std::string> rates;
  if (std::optional<double> v = median(sorted, &MetricsPoint::tokensPerSecond))
    rates.push_back(formatValue(*v) + " tokens/s");
  else if (std::optional<double> v = median(sorted, &MetricsPoint::samplesPerSecond))
    rates.push_back(formatValue(*v) + " samples/s");
  if (std::optional<double> v = median(sorted, &MetricsPoint::tflops))
    rates.push_back(formatValue(*v) + " TFLOP/s");
  if (std::optional<double> v = median(sorted, &MetricsPoint::mfu))
    rates.push_back("MFU " + formatValue(100 * *v) + "%");
  if (!rates.empty())
    text += "\n  median " + join(rates, ", ");
  return text + "\n";
}

} // namespace pipec
