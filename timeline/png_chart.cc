#include "timeline/png_chart.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace plateau {
namespace {

using chart::Canvas;
using chart::Point;
using chart::Rgb;

// Panel layout (px), as the SVG page's: labels of the bounds in the right
// margin, phase names under the plot.
constexpr int kLeft = 84, kRight = 250, kTop = 40, kBottom = 60;
constexpr int kPlotW = kPngPanelWidth - kLeft - kRight;
constexpr int kPlotH = kPngPanelHeight - kTop - kBottom;
constexpr Rgb kWhite{255, 255, 255}, kInk{51, 51, 51}, kGrid{230, 230, 230}, kBlack{0, 0, 0},
    kCapRed{214, 39, 40};

// Halfway to white: the phase's peak box above its bands.
Rgb Pale(Rgb c) {
  return {static_cast<uint8_t>((c.r + 255) / 2), static_cast<uint8_t>((c.g + 255) / 2),
          static_cast<uint8_t>((c.b + 255) / 2)};
}

void DrawPanel(Canvas& cv, int top, const MemoryChart& c) {
  const size_t n = c.phases.size();
  const double max = c.scale_max();
  auto y_of = [&](double bytes) { return top + PngChartY(c, bytes); };
  cv.Text(kLeft, top + 12, c.title, kInk);
  // Value axis: grid lines and their labels.
  const double step = ChartTickStep(max);
  for (double v = 0; v <= max * 1.0001; v += step) {
    const double y = y_of(v);
    cv.Line({kLeft + 0.0, y}, {kLeft + kPlotW + 0.0, y}, kGrid);
    const std::string label = FormatBytes(static_cast<int64_t>(v));
    cv.Text(kLeft - 6 - Canvas::TextWidth(label), static_cast<int>(y) - 3, label, kInk);
  }
  // Bands, and the peak box of each phase above them.
  const double bar = PngChartBarWidth(c);
  const double gap = bar > 6 ? 1 : 0;
  for (size_t k = 0; k < n; ++k) {
    const double x0 = PngChartBarX(c, k), x1 = x0 + std::max(1.0, bar - gap);
    double below = 0;
    for (const ChartSeries& s : c.series) {
      const double v = static_cast<double>(s.bytes[k]);
      if (v > 0) {
        cv.FillPolygon({{x0, y_of(below + v)}, {x1, y_of(below + v)}, {x1, y_of(below)}, {x0, y_of(below)}},
                       ParseColor(s.color));
      }
      below += v;
    }
    if (c.total_peak[k] > c.total[k]) {
      // In the colour of the live set that rose the most, as on the page.
      const ChartSeries* most = nullptr;
      for (const ChartSeries& s : c.series) {
        if (most == nullptr || s.peak[k] - s.bytes[k] > most->peak[k] - most->bytes[k]) most = &s;
      }
      const double ya = y_of(static_cast<double>(c.total_peak[k])), yb = y_of(static_cast<double>(c.total[k]));
      cv.FillPolygon({{x0, ya}, {x1, ya}, {x1, yb}, {x0, yb}}, Pale(most ? ParseColor(most->color) : kGrid));
      cv.Polyline({{x0, ya}, {x1, ya}}, kInk);
    }
  }
  // Bounds (larger drawn last, on top, as on the page), the plan's total, the cap.
  std::vector<std::pair<double, std::pair<std::string, Rgb>>> labels;
  std::vector<const ChartSeries*> by_bound;
  for (const ChartSeries& s : c.series) by_bound.push_back(&s);
  std::stable_sort(by_bound.begin(), by_bound.end(),
                   [](const ChartSeries* a, const ChartSeries* b) { return a->bound < b->bound; });
  for (const ChartSeries* s : by_bound) {
    if (s->bound <= 0) continue;
    const double y = y_of(static_cast<double>(s->stacked_bound));
    cv.DashedLine({kLeft + 0.0, y}, {kLeft + kPlotW + 0.0, y}, ParseColor(s->color), 2, 6, 3);
    labels.push_back({y, {absl::StrCat(s->live_set, " bound ", FormatBytes(s->bound)), ParseColor(s->color)}});
  }
  if (c.planned_total > 0) {
    const double y = y_of(static_cast<double>(c.planned_total));
    cv.Line({kLeft + 0.0, y}, {kLeft + kPlotW + 0.0, y}, kBlack);
    labels.push_back({y, {absl::StrCat("plan total ", FormatBytes(c.planned_total)), kBlack}});
  }
  if (c.cap > 0) {
    const bool on = c.cap_on_scale();
    const double y = on ? y_of(static_cast<double>(c.cap)) : top + kTop - 8;
    if (on) {
      cv.Line({kLeft + 0.0, y}, {kLeft + kPlotW + 0.0, y}, kCapRed, 2);
    } else {
      cv.DashedLine({kLeft + 0.0, y}, {kLeft + kPlotW + 0.0, y}, kCapRed, 2, 2, 4);
    }
    const std::string what =
        on ? absl::StrCat(c.space, " cap ", FormatBytes(c.cap))
           : absl::StrFormat("%s cap %s (off scale, %.0fx)", c.space, FormatBytes(c.cap),
                             static_cast<double>(c.cap) / static_cast<double>(std::max<int64_t>(1, c.data_max())));
    labels.push_back({y, {what, kCapRed}});
  }
  // Labels in the right margin, moved apart so none overlaps the one above.
  std::sort(labels.begin(), labels.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  double last = -1e9;
  for (auto& [y, text] : labels) {
    const double ly = std::max(y - 3, last + Canvas::TextHeight() + 3);
    last = ly;
    cv.FillRect(kLeft + kPlotW + 8, static_cast<int>(ly), kLeft + kPlotW + 16, static_cast<int>(ly) + 7, text.second);
    cv.Text(kLeft + kPlotW + 20, static_cast<int>(ly), text.first, kInk);
  }
  // Axes, and the phase names under every k-th bar (k so that they fit).
  cv.Line({kLeft + 0.0, top + kTop + 0.0}, {kLeft + 0.0, top + kTop + kPlotH + 0.0}, kInk);
  cv.Line({kLeft + 0.0, top + kTop + kPlotH + 0.0}, {kLeft + kPlotW + 0.0, top + kTop + kPlotH + 0.0}, kInk);
  int widest = 1;
  for (const std::string& p : c.phases) widest = std::max(widest, Canvas::TextWidth(p));
  const size_t every = std::max<size_t>(1, static_cast<size_t>((widest + 8) / std::max(1.0, bar)) + 1);
  for (size_t k = 0; k < n; k += every) {
    const double x = kLeft + bar * static_cast<double>(k);
    cv.Line({x, top + kTop + kPlotH + 0.0}, {x, top + kTop + kPlotH + 4.0}, kInk);
    // Alternate two rows so neighbouring names never touch.
    const int row = static_cast<int>((k / every) % 2);
    cv.Text(static_cast<int>(x), top + kTop + kPlotH + 8 + row * 12, c.phases[k], kInk);
  }
}

}  // namespace

double PngChartY(const MemoryChart& c, double bytes) {
  const double max = c.scale_max();
  return kTop + kPlotH * (1.0 - std::min(bytes, max) / max);
}

double PngChartBarWidth(const MemoryChart& c) {
  return c.phases.empty() ? kPlotW : static_cast<double>(kPlotW) / static_cast<double>(c.phases.size());
}

double PngChartBarX(const MemoryChart& c, size_t phase) {
  return kLeft + PngChartBarWidth(c) * static_cast<double>(phase);
}

Rgb ParseColor(const std::string& hex) {
  if (hex.size() != 7 || hex[0] != '#') return {136, 136, 136};
  char* end = nullptr;
  const long v = std::strtol(hex.c_str() + 1, &end, 16);
  if (end != hex.c_str() + 7) return {136, 136, 136};
  return {static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 8), static_cast<uint8_t>(v)};
}

Canvas MemoryChartsCanvas(const std::vector<MemoryChart>& charts) {
  const int panels = std::max<int>(1, static_cast<int>(charts.size()));
  Canvas cv(kPngPanelWidth, kPngPanelHeight * panels, kWhite);
  for (size_t i = 0; i < charts.size(); ++i) DrawPanel(cv, static_cast<int>(i) * kPngPanelHeight, charts[i]);
  return cv;
}

}  // namespace plateau
