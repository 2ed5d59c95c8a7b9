#include "timeline/svg_page.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace plateau {
namespace {

// Layout (px). Bound labels go in the right margin, phase names under the plot.
constexpr double kWidth = 1000, kHeight = 460;
constexpr double kLeft = 84, kRight = 250, kTop = 46, kBottom = 120;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;
std::string F(double v) { return absl::StrFormat("%.1f", v); }

struct Scale {
  double max = 1;  // bytes at the top of the plot
  double Y(double bytes) const { return kTop + kPlotH * (1.0 - std::min(bytes, max) / max); }
};

// Moves labels (by y) apart so that none overlaps the one above it.
void Spread(std::vector<std::pair<double, std::string>>& labels, double gap) {
  std::sort(labels.begin(), labels.end());
  for (size_t i = 1; i < labels.size(); ++i) labels[i].first = std::max(labels[i].first, labels[i - 1].first + gap);
}

}  // namespace

std::string HtmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string MemoryChartSvg(const MemoryChart& c) {
  const size_t n = c.phases.size();
  const double data = static_cast<double>(std::max<int64_t>(1, c.data_max()));
  const bool cap_on_scale = c.cap_on_scale();
  Scale s;
  s.max = c.scale_max();
  const double bar = n == 0 ? kPlotW : kPlotW / static_cast<double>(n);
  const double gap = bar > 6 ? 1 : 0;
  std::string svg = absl::StrFormat(
      "<svg class=\"memory-chart\" data-space=\"%s\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
      "height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\" aria-label=\"%s\">\n",
      c.space, static_cast<int>(kWidth), static_cast<int>(kHeight), static_cast<int>(kWidth),
      static_cast<int>(kHeight), HtmlEscape(c.title));
  absl::StrAppend(&svg, "<rect x=\"0\" y=\"0\" width=\"", F(kWidth), "\" height=\"", F(kHeight),
                  "\" fill=\"#ffffff\"/>\n");
  absl::StrAppend(&svg, "<text x=\"", F(kLeft), "\" y=\"22\" class=\"chart-title\">", HtmlEscape(c.title),
                  "</text>\n");
  // Y axis and grid.
  const double step = ChartTickStep(s.max);
  for (double v = 0; v <= s.max * 1.0001; v += step) {
    const double y = s.Y(v);
    absl::StrAppend(&svg, "<line class=\"grid\" x1=\"", F(kLeft), "\" x2=\"", F(kLeft + kPlotW), "\" y1=\"", F(y),
                    "\" y2=\"", F(y), "\" stroke=\"#e6e6e6\"/>\n<text class=\"tick\" x=\"", F(kLeft - 6), "\" y=\"",
                    F(y + 4), "\" text-anchor=\"end\">", HtmlEscape(FormatBytes(static_cast<int64_t>(v))),
                    "</text>\n");
  }
  // The stacked bands: each live set's bytes at each phase's end.
  for (size_t k = 0; k < n; ++k) {
    const double x = kLeft + bar * static_cast<double>(k);
    double below = 0;
    for (const ChartSeries& ser : c.series) {
      const double v = static_cast<double>(ser.bytes[k]);
      if (v > 0) {
        const double y0 = s.Y(below), y1 = s.Y(below + v);
        absl::StrAppend(&svg, "<rect class=\"band\" data-live-set=\"", HtmlEscape(ser.live_set), "\" data-phase=\"", k,
                        "\" x=\"", F(x), "\" y=\"", F(y1), "\" width=\"", F(std::max(0.5, bar - gap)), "\" height=\"",
                        F(std::max(0.0, y0 - y1)), "\" fill=\"", ser.color, "\"><title>", HtmlEscape(c.phases[k]),
                        ": ", HtmlEscape(ser.live_set), " ", HtmlEscape(FormatBytes(ser.bytes[k])), " at the end, ",
                        HtmlEscape(FormatBytes(ser.peak[k])), " at most</title></rect>\n");
      }
      below += v;
    }
    // What the phase held for a moment above what it ended with, in the
    // colour of the live set that rose the most.
    if (c.total_peak[k] > c.total[k]) {
      const ChartSeries* most = nullptr;
      int64_t rise = -1;
      for (const ChartSeries& ser : c.series) {
        if (ser.peak[k] - ser.bytes[k] > rise) {
          rise = ser.peak[k] - ser.bytes[k];
          most = &ser;
        }
      }
      const double y0 = s.Y(static_cast<double>(c.total[k])), y1 = s.Y(static_cast<double>(c.total_peak[k]));
      absl::StrAppend(&svg, "<rect class=\"transient\" data-live-set=\"", most ? HtmlEscape(most->live_set) : "",
                      "\" data-phase=\"", k, "\" x=\"", F(x), "\" y=\"", F(y1), "\" width=\"",
                      F(std::max(0.5, bar - gap)), "\" height=\"", F(std::max(0.5, y0 - y1)), "\" fill=\"",
                      most ? most->color : "#888888", "\" fill-opacity=\"0.4\" stroke=\"#333333\" stroke-width=\"0.5\">"
                      "<title>", HtmlEscape(c.phases[k]), ": peak ", HtmlEscape(FormatBytes(c.total_peak[k])),
                      " inside the phase (", HtmlEscape(FormatBytes(c.total[k])), " at its end)</title></rect>\n");
    }
  }
  // Bounds: each set's line at its stacked bound; then the plan's total and the cap.
  std::vector<std::pair<double, std::string>> labels;
  // Larger bounds drawn last, on top: a tiny set's line sits on the line
  // below it and must not hide it.
  std::vector<const ChartSeries*> by_bound;
  for (const ChartSeries& ser : c.series) by_bound.push_back(&ser);
  std::stable_sort(by_bound.begin(), by_bound.end(),
                   [](const ChartSeries* a, const ChartSeries* b) { return a->bound < b->bound; });
  for (const ChartSeries* line : by_bound) {
    const ChartSeries& ser = *line;
    if (ser.bound <= 0) continue;
    const double y = s.Y(static_cast<double>(ser.stacked_bound));
    absl::StrAppend(&svg, "<line class=\"bound\" data-live-set=\"", HtmlEscape(ser.live_set), "\" data-bytes=\"",
                    ser.bound, "\" x1=\"", F(kLeft), "\" x2=\"", F(kLeft + kPlotW), "\" y1=\"", F(y), "\" y2=\"",
                    F(y), "\" stroke=\"", ser.color, "\" stroke-width=\"1.5\" stroke-dasharray=\"6 3\"><title>",
                    HtmlEscape(ser.live_set), " bound (plan) ", HtmlEscape(FormatBytes(ser.bound)),
                    ", stacked on the sets below: ", HtmlEscape(FormatBytes(ser.stacked_bound)), "</title></line>\n");
    labels.emplace_back(y + 4, absl::StrCat("<tspan fill=\"", ser.color, "\">&#9632;</tspan> ", HtmlEscape(ser.live_set),
                                            " bound ", HtmlEscape(FormatBytes(ser.bound))));
  }
  if (c.planned_total > 0) {
    const double y = s.Y(static_cast<double>(c.planned_total));
    absl::StrAppend(&svg, "<line class=\"plan-total\" x1=\"", F(kLeft), "\" x2=\"", F(kLeft + kPlotW), "\" y1=\"",
                    F(y), "\" y2=\"", F(y), "\" stroke=\"#000000\" stroke-width=\"1\"><title>plan total ",
                    HtmlEscape(FormatBytes(c.planned_total)), "</title></line>\n");
    labels.emplace_back(y + 4, absl::StrCat("plan total ", HtmlEscape(FormatBytes(c.planned_total))));
  }
  if (c.cap > 0) {
    const double y = cap_on_scale ? s.Y(static_cast<double>(c.cap)) : kTop - 8;
    const std::string what =
        cap_on_scale ? absl::StrCat(c.space, " cap ", HtmlEscape(FormatBytes(c.cap)))
                     : absl::StrFormat("%s cap %s (off scale, %.0fx)", c.space,
                                       HtmlEscape(FormatBytes(c.cap)), static_cast<double>(c.cap) / data);
    absl::StrAppend(&svg, "<line class=\"cap\" data-bytes=\"", c.cap, "\" data-on-scale=\"",
                    cap_on_scale ? "true" : "false", "\" x1=\"", F(kLeft), "\" x2=\"", F(kLeft + kPlotW), "\" y1=\"",
                    F(y), "\" y2=\"", F(y), "\" stroke=\"#d62728\" stroke-width=\"2\"", cap_on_scale ? "" : " stroke-dasharray=\"2 4\"",
                    "><title>", what, "</title></line>\n");
    labels.emplace_back(y + 4, absl::StrCat("<tspan fill=\"#d62728\">", what, "</tspan>"));
  }
  Spread(labels, 13);
  for (const auto& [y, text] : labels) {
    absl::StrAppend(&svg, "<text class=\"label\" x=\"", F(kLeft + kPlotW + 8), "\" y=\"", F(y), "\">", text, "</text>\n");
  }
  // Axes, and the phase names under the plot (every k-th when many).
  absl::StrAppend(&svg, "<line x1=\"", F(kLeft), "\" x2=\"", F(kLeft), "\" y1=\"", F(kTop), "\" y2=\"", F(kTop + kPlotH),
                  "\" stroke=\"#333333\"/>\n<line x1=\"", F(kLeft), "\" x2=\"", F(kLeft + kPlotW), "\" y1=\"",
                  F(kTop + kPlotH), "\" y2=\"", F(kTop + kPlotH), "\" stroke=\"#333333\"/>\n");
  const size_t every = std::max<size_t>(1, (n + 39) / 40);
  for (size_t k = 0; k < n; k += every) {
    const double x = kLeft + bar * (static_cast<double>(k) + 0.5);
    const double y = kTop + kPlotH + 10;
    absl::StrAppend(&svg, "<text class=\"phase\" x=\"", F(x), "\" y=\"", F(y), "\" transform=\"rotate(-55 ", F(x), " ",
                    F(y), ")\" text-anchor=\"end\">", HtmlEscape(c.phases[k]), "</text>\n");
  }
  absl::StrAppend(&svg, "</svg>\n");
  return svg;
}

std::string MessagePage(absl::string_view title, absl::string_view message) {
  return absl::StrCat("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>", HtmlEscape(title),
                      "</title></head>\n<body style=\"font-family: sans-serif\"><h1>", HtmlEscape(title), "</h1>\n<p>",
                      HtmlEscape(message), "</p></body></html>\n");
}

absl::StatusOr<std::string> MemoryTimelinePage(const v1::GetMemoryTimelineResponse& r, int rank) {
  absl::StatusOr<std::vector<MemoryChart>> charts = MemoryCharts(r, rank);
  if (!charts.ok()) return charts.status();
  const v1::MemoryTimeline* t = nullptr;
  for (const v1::MemoryTimeline& x : r.ranks()) {
    if (x.rank() == rank) t = &x;
  }
  const std::string title = absl::StrCat(r.job_id(), " memory timeline, rank ", rank);
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>", HtmlEscape(title), "</title>\n",
      "<style>body{font-family:sans-serif;margin:24px;color:#222}svg text{font:11px sans-serif;fill:#222}"
      "svg .chart-title{font-size:14px;font-weight:bold}table{border-collapse:collapse;font-size:12px}"
      "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th:first-child,td:first-child{text-align:left}"
      "</style></head>\n<body>\n<h1>", HtmlEscape(title), "</h1>\n");
  const std::string when =
      t->has_time() ? absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixSeconds(t->time().seconds()),
                                       absl::UTCTimeZone())
                    : "unknown";
  absl::StrAppend(&html, "<p class=\"summary\">Step ", t->step(), " (attempt ", t->attempt(), "), received ",
                  HtmlEscape(when), "; ", t->phases_size(), " entries for ", t->phases_seen(), " phases",
                  t->phases_seen() > t->phases_size() ? " (neighbouring phases merged)" : "", ".</p>\n");
  if (r.ranks_size() > 1) {
    absl::StrAppend(&html, "<p class=\"ranks\">Ranks:");
    for (const v1::MemoryTimeline& x : r.ranks()) {
      if (x.rank() == rank) {
        absl::StrAppend(&html, " <b>", x.rank(), "</b>");
      } else {
        absl::StrAppend(&html, " <a href=\"?rank=", x.rank(), "\">", x.rank(), "</a>");
      }
    }
    absl::StrAppend(&html, "</p>\n");
  }
  absl::StrAppend(&html,
                  "<p>Each column is a phase of the step. The coloured bands stack every live set's bytes when the "
                  "phase ended; a pale box above a column is the most the phase held for a moment (in the colour of "
                  "the live set that rose the most). A dashed line is a live set's bound from the plan, stacked on "
                  "the bounds below it: while every live set is within its bound, the top of its band stays under its "
                  "line. The black line is the plan's total, the red one the cap.</p>\n");
  for (const MemoryChart& c : *charts) {
    absl::StrAppend(&html, "<h2>", HtmlEscape(c.space == "device" ? "Device" : "Host"), "</h2>\n", MemoryChartSvg(c));
  }
  // The numbers, for copying.
  for (const MemoryChart& c : *charts) {
    absl::StrAppend(&html, "<details><summary>", HtmlEscape(c.space), " bytes per phase (at the end / at most)</summary>\n"
                    "<table class=\"numbers\" data-space=\"", HtmlEscape(c.space), "\"><tr><th>phase</th>");
    for (const ChartSeries& s : c.series) absl::StrAppend(&html, "<th>", HtmlEscape(s.live_set), "</th>");
    absl::StrAppend(&html, "<th>total</th></tr>\n<tr><td>bound (plan)</td>");
    for (const ChartSeries& s : c.series) absl::StrAppend(&html, "<td>", s.bound, "</td>");
    absl::StrAppend(&html, "<td>", c.planned_total, "</td></tr>\n");
    for (size_t k = 0; k < c.phases.size(); ++k) {
      absl::StrAppend(&html, "<tr><td>", HtmlEscape(c.phases[k]), "</td>");
      for (const ChartSeries& s : c.series) absl::StrAppend(&html, "<td>", s.bytes[k], " / ", s.peak[k], "</td>");
      absl::StrAppend(&html, "<td>", c.total[k], " / ", c.total_peak[k], "</td></tr>\n");
    }
    absl::StrAppend(&html, "</table></details>\n");
  }
  absl::StrAppend(&html, "</body></html>\n");
  return html;
}

}  // namespace plateau
