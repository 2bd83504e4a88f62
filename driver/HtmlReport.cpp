//===- HtmlReport.cpp - `pipec report --format html` ----------------------===//
#include "driver/HtmlReport.h"
#include "compiler/sim/Simulator.h"
#include "driver/Curves.h"
#include "driver/InspectReport.h"
#include "driver/Report.h"

#include "llvm/Support/FormatVariadic.h"

using namespace llvm;

namespace pipec {
namespace {

std::string escape(StringRef text) {
  std::string out;
  for (char c : text) {
    switch (c) {
    case '&':
      out += "&amp;";
      break;
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '"':
      out += "&quot;";
      break;
    default:
      out += c;
    }
  }
  return out;
}

const char *colorOf(char category) {
  switch (category) {
  case 'F':
    return "#4c78a8";
  case 'B':
    return "#54a24b";
  case 'I':
    return "#72b7b2";
  case 'W':
    return "#f58518";
  case 'R':
    return "#b279a2";
  case 'O':
    return "#444444";
  default:
    return "#9d9d9d";
  }
}

void legend(raw_ostream &os) {
  os << "<div class=legend>";
  for (auto [c, name] :
       std::initializer_list<std::pair<char, const char *>>{{'F', "forward"},
                                                            {'B', "backward (B)"},
                                                            {'I', "backward for inputs (I)"},
                                                            {'W', "backward for weights (W)"},
                                                            {'R', "recompute"},
                                                            {'C', "send / receive"},
                                                            {'O', "optimizer step"}})
    os << formatv("<span><i style='background:{0}'></i>{1}</span>", colorOf(c), name);
  os << "<span><i style='background:#f3f3f3;border:1px solid #ccc'></i>idle (bubble)</span>";
  os << "</div>\n";
}

/// One row per rank of \p ranks (a simulation has the pipeline's, a measured
/// run every replica's), drawn over \p sim's step time.
void timeline(const SimulationResult &sim, int ranks, raw_ostream &os) {
  const double width = 1100, rowHeight = 34, commHeight = 6, left = 70, top = 24;
  double height = top + ranks * (rowHeight + commHeight + 10) + 30;
  double step = sim.stepTime > 0 ? sim.stepTime : 1;
  auto x = [&](double t) { return left + t / step * width; };
  os << formatv("<svg class=timeline viewBox='0 0 {0} {1}' width='{0}' height='{1}' "
                "xmlns='http://www.w3.org/2000/svg' font-family='sans-serif'>\n",
                left + width + 20, height);
  for (int r = 0; r < ranks; ++r) {
    double y = top + r * (rowHeight + commHeight + 10);
    os << formatv("<text x='4' y='{0}' font-size='13'>rank {1}</text>\n", y + rowHeight * 0.65, r);
    os << formatv("<rect x='{0}' y='{1}' width='{2}' height='{3}' fill='#f3f3f3'/>\n", left, y,
                  width, rowHeight);
  }
  for (const TimelineEvent &e : sim.events) {
    if (e.rank >= ranks || e.duration <= 0)
      continue;
    double y = top + e.rank * (rowHeight + commHeight + 10);
    bool comm = e.category == 'C';
    double y0 = comm ? y + rowHeight + 2 : y;
    double h = comm ? commHeight : rowHeight;
    double w = std::max(0.5, x(e.start + e.duration) - x(e.start));
    os << formatv("<rect x='{0:f2}' y='{1}' width='{2:f2}' height='{3}' fill='{4}' "
                  "stroke='white' stroke-width='0.5'><title>{5} ({6})</title></rect>\n",
                  x(e.start), y0, w, h, colorOf(e.category), escape(e.name),
                  formatSeconds(e.duration));
    if (!comm && e.microbatch >= 0 && w >= 14)
      os << formatv("<text x='{0:f2}' y='{1}' font-size='11' fill='white' "
                    "text-anchor='middle'>{2}</text>\n",
                    x(e.start) + w / 2, y + rowHeight * 0.65, e.microbatch);
  }
  double axisY = top + ranks * (rowHeight + commHeight + 10) + 4;
  for (int tick = 0; tick <= 10; ++tick) {
    double t = step * tick / 10;
    os << formatv("<line x1='{0}' x2='{0}' y1='{1}' y2='{2}' stroke='#999'/>", x(t), axisY,
                  axisY + 5);
    os << formatv("<text x='{0}' y='{1}' font-size='10' text-anchor='middle'>{2}</text>\n", x(t),
                  axisY + 17, escape(formatSeconds(t)));
  }
  os << "</svg>\n";
}

void bars(raw_ostream &os, StringRef title, const std::vector<std::string> &labels,
          const std::vector<std::vector<std::pair<double, char>>> &segments,
          const std::vector<double> &limits, function_ref<std::string(double)> format) {
  double maxValue = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    double sum = 0;
    for (auto &[v, c] : segments[i])
      sum += v;
    maxValue = std::max(maxValue, sum);
    if (i < limits.size())
      maxValue = std::max(maxValue, limits[i]);
  }
  if (maxValue <= 0)
    maxValue = 1;
  const double width = 700, row = 22, left = 110;
  double height = segments.size() * row + 10;
  os << "<h3>" << escape(title) << "</h3>\n";
  os << formatv("<svg viewBox='0 0 {0} {1}' width='{0}' height='{1}' "
                "xmlns='http://www.w3.org/2000/svg' font-family='sans-serif'>\n",
                left + width + 120, height);
  for (size_t i = 0; i < segments.size(); ++i) {
    double y = i * row + 4, xPos = left, sum = 0;
    os << formatv("<text x='4' y='{0}' font-size='12'>{1}</text>\n", y + 13, escape(labels[i]));
    for (auto &[v, c] : segments[i]) {
      double w = v / maxValue * width;
      os << formatv("<rect x='{0:f2}' y='{1}' width='{2:f2}' height='{3}' fill='{4}'/>\n", xPos, y,
                    w, row - 6, colorOf(c));
      xPos += w;
      sum += v;
    }
    os << formatv("<text x='{0:f2}' y='{1}' font-size='11'>{2}</text>\n", xPos + 4, y + 12,
                  escape(format(sum)));
    if (i < limits.size() && limits[i] > 0) {
      double lx = left + limits[i] / maxValue * width;
      os << formatv("<line x1='{0:f2}' x2='{0:f2}' y1='{1}' y2='{2}' stroke='#d62728' "
                    "stroke-width='2'><title>limit {3}</title></line>\n",
                    lx, y - 2, y + row - 4, escape(format(limits[i])));
    }
  }
  os << "</svg>\n";
}

/// Why the edge stages are lighter, and the balancing methods side by side.
void printBalancing(const plan::Plan &plan, raw_ostream &os) {
  std::vector<std::string> edges = explainEdgeStages(plan);
  if (!edges.empty()) {
    os << "<h2>First and last stages</h2>\n<ul>\n";
    for (const std::string &line : edges)
      os << "<li>" << escape(line) << "</li>\n";
    os << "</ul>\n";
  }
  if (plan.alternatives_size()) {
    os << "<h2>Balancing methods</h2>\n<table>\n<tr><th class=l>method</th><th>predicted "
          "step</th><th>slowest stage</th><th>imbalance</th><th class=l>layout</th></tr>\n";
    for (const auto &a : plan.alternatives()) {
      bool chosen = a.method() == plan.balance_method();
      if (!a.error().empty()) {
        os << formatv("<tr><td class=l>{0}</td><td colspan=4 class='l warn'>{1}</td></tr>\n",
                      escape(a.method()), escape(a.error()));
        continue;
      }
      os << formatv("<tr{0}><td class=l>{1}</td><td>{2}</td><td>{3}</td><td>{4:f3}</td>"
                    "<td class=l><code>{5}</code>{6}</td></tr>\n",
                    chosen ? " class=chosen" : "", escape(a.method()),
                    formatSeconds(a.step_time_s()), formatSeconds(a.bottleneck_s()), a.imbalance(),
                    escape(a.layout()),
                    a.fits_memory() ? "" : " <span class=warn>over the memory limit</span>");
    }
    os << "</table>\n";
  }
}

} // namespace

void printReportHtml(const plan::Plan &plan, raw_ostream &os, const SimulationResult *measured,
                     ArrayRef<MetricsPoint> curves) {
  const auto &sched = plan.schedule();
  auto sim = simulatePlan(plan);
  os << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>\n<title>pipec report: "
     << escape(plan.model().path()) << "</title>\n<style>\n"
     << "body{font-family:sans-serif;margin:24px;color:#222;max-width:1300px}"
        "h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;"
        "padding:4px 8px;text-align:right}th{background:#f5f5f5}td.l,th.l{text-align:left}"
        ".summary td{text-align:left}.legend span{margin-right:16px;font-size:13px}"
        ".legend i{display:inline-block;width:12px;height:12px;margin-right:4px;"
        "vertical-align:middle}.note{font-size:13px;color:#555}.warn{color:#b15928}"
        ".chosen{font-weight:bold}"
        "code{background:#f5f5f5;padding:1px 4px}\n"
     << "</style></head><body>\n";
  os << "<h1>pipec partition report</h1>\n<table class=summary>\n";
  auto row = [&](StringRef k, const std::string &v) {
    os << "<tr><th class=l>" << escape(k) << "</th><td>" << v << "</td></tr>\n";
  };
  row("model", escape(plan.model().path()) + " (" + humanCount(plan.model().params()) +
                   " params, xxh3 " + escape(plan.model().xxh3().substr(0, 16)) + ")");
  row("schedule",
      formatv("{0}, P = {1}, V = {2}, M = {3}, {4}", escape(sched.name()), sched.stages(),
              sched.virtual_stages(), sched.microbatches(), escape(sched.mode()))
          .str());
  std::string hw;
  for (int r = 0; r < plan.hardware_size(); ++r)
    hw += (r ? ", " : "") + plan.hardware(r).name();
  row("hardware", escape(hw) + "; precision " + escape(plan.training().precision()) +
                      ", optimizer " + escape(plan.training().optimizer()));
  row("predicted step",
      escape(formatSeconds(plan.predicted().step_time_s())) +
          formatv(" (simulated), bubble {0:f1}%, imbalance {1:f3}",
                  100 * plan.predicted().bubble_fraction(), plan.predicted().imbalance())
              .str());
  row("layout", "<code>" + escape(plan.layout()) + "</code> (balanced by " +
                    escape(plan.balance_method()) + ")");
  std::string memory;
  for (const auto &r : plan.ranks()) {
    bool over = r.memory_limit_bytes() > 0 && r.peak_memory_bytes() > r.memory_limit_bytes();
    memory +=
        formatv("{0}{1}rank {2}: {3} / {4}", r.index() ? "<br>" : "",
                over ? "<span class=warn>" : "", r.index(), humanCount(r.peak_memory_bytes(), true),
                r.memory_limit_bytes() > 0 ? humanCount(r.memory_limit_bytes(), true)
                                           : std::string("no limit"))
            .str() +
        (over ? " (over)</span>" : "");
  }
  row("peak memory", memory);
  os << "</table>\n";

  os << "<h2>Pipeline timeline</h2>\n";
  legend(os);
  if (sim)
    timeline(*sim, sched.stages(), os);
  else
    os << "<p class=warn>" << escape(toString(sim.takeError())) << "</p>\n";
  if (measured) {
    os << "<h2>Measured timeline</h2>\n<p>The last step of <code>pipec run --trace</code>: "
       << escape(formatSeconds(measured->stepTime)) << " against "
       << escape(formatSeconds(plan.predicted().step_time_s())) << " predicted ("
       << formatv("{0:f1}", plan.predicted().step_time_s() > 0
                                ? measured->stepTime / plan.predicted().step_time_s()
                                : 0.0)
       << "x), bubble " << formatv("{0:f1}", 100 * measured->bubbleFraction)
       << "%. Drawn on its own time scale; ranks past P are data-parallel replicas.</p>\n";
    timeline(*measured, sched.stages() * sched.data_parallel(), os);
  }
  if (!curves.empty())
    printCurvesSvg(curves, os);

  os << "<h2>Stages</h2>\n<table>\n<tr><th>stage</th><th>rank</th><th>chunk</th>"
        "<th class=l>layers</th><th>params</th><th>fwd FLOPs</th><th>F</th><th>I</th>"
        "<th>W</th><th>send / mb</th><th>sent bytes / mb</th><th>peak memory</th></tr>\n";
  for (const auto &s : plan.stages()) {
    std::string layers =
        s.layers_size() == 0
            ? "(empty)"
            : formatv("{0}-{1}: {2}{3}", s.first_layer(), s.last_layer(), escape(s.layers(0)),
                      s.layers_size() > 1 ? " .. " + escape(s.layers(s.layers_size() - 1))
                                          : std::string())
                  .str();
    os << formatv("<tr><td>{0}</td><td>{1}</td><td>{2}</td><td class=l>{3}</td><td>{4}</td>"
                  "<td>{5}</td><td>{6}</td><td>{7}</td><td>{8}</td><td>{9}</td><td>{10}</td>"
                  "<td>{11}</td></tr>\n",
                  s.index(), s.rank(), s.chunk(), layers, humanCount(s.params()),
                  humanCount(static_cast<int64_t>(s.flops_f())), formatSeconds(s.time_f_s()),
                  formatSeconds(s.time_i_s()), formatSeconds(s.time_w_s()),
                  formatSeconds(s.comm_s()), humanCount(s.boundary_bytes(), true),
                  humanCount(s.memory_peak_bytes(), true));
  }
  os << "</table>\n";

  std::vector<std::string> stageLabels;
  std::vector<std::vector<std::pair<double, char>>> stageTimes;
  for (const auto &s : plan.stages()) {
    stageLabels.push_back(formatv("stage {0} (rank {1})", s.index(), s.rank()).str());
    stageTimes.push_back(
        {{s.time_f_s(), 'F'}, {s.time_i_s(), 'I'}, {s.time_w_s(), 'W'}, {s.comm_s(), 'C'}});
  }
  bars(os, "Time per stage and microbatch (F, I, W, send)", stageLabels, stageTimes, {},
       [](double v) { return formatSeconds(v); });
  std::vector<std::string> rankLabels;
  std::vector<std::vector<std::pair<double, char>>> rankMemory;
  std::vector<double> limits;
  for (const auto &r : plan.ranks()) {
    rankLabels.push_back(formatv("rank {0}", r.index()).str());
    double activations = static_cast<double>(r.peak_memory_bytes() - r.weight_bytes());
    rankMemory.push_back({{static_cast<double>(r.weight_bytes()), 'F'}, {activations, 'W'}});
    limits.push_back(static_cast<double>(r.memory_limit_bytes()));
  }
  bars(os, "Peak memory per rank (weights with state; activations) against the limit", rankLabels,
       rankMemory, limits, [](double v) { return humanCount(static_cast<int64_t>(v), true); });

  printBalancing(plan, os);
  if (plan.parallel_search_size()) {
    os << "<h2>Parallel search</h2>\n<ul>\n";
    for (const auto &line : plan.parallel_search())
      os << "<li>" << escape(line) << "</li>\n";
    os << "</ul>\n";
  }
  if (plan.schedule_search_size()) {
    os << "<h2>Schedule search</h2>\n<ul>\n";
    for (const auto &line : plan.schedule_search())
      os << "<li>" << escape(line) << "</li>\n";
    os << "</ul>\n";
  }
  if (plan.warnings_size()) {
    os << "<h2>Warnings</h2>\n<ul>\n";
    for (const auto &w : plan.warnings())
      os << "<li class=warn>" << escape(w) << "</li>\n";
    os << "</ul>\n";
  }
  os << "</body></html>\n";
}

} // namespace pipec
