// The memory timeline's PNG drawing from a known timeline: one panel per
// space; every band in its live set's colour where the model puts it; each
// bound, the plan's total and the cap drawn on their own rows (found by
// drawing again without them); the peak box of a transient; a PNG out.
#include "timeline/png_chart.h"

#include <cmath>
#include <string>
#include <vector>

#include "client/chart/png.h"
#include "gtest/gtest.h"
#include "timeline/memory_chart.h"
#include "timeline/timeline_testing.h"

namespace plateau {
namespace {

using chart::Canvas;
using chart::Rgb;

std::vector<MemoryChart> Charts(bool with_host) {
  auto charts = MemoryCharts(ExampleTimeline(with_host), 0);
  EXPECT_TRUE(charts.ok()) << charts.status();
  return charts.ok() ? *charts : std::vector<MemoryChart>{};
}

// Pixels of row y (within the plot's width) that differ between a and b and
// are `color` in a.
int ChangedTo(const Canvas& a, const Canvas& b, int y, Rgb color) {
  int n = 0;
  for (int x = 0; x < a.width(); ++x) {
    if (a.At(x, y) != b.At(x, y) && a.At(x, y) == color) ++n;
  }
  return n;
}

TEST(PngChartTest, OnePanelPerSpace) {
  EXPECT_EQ(Charts(true).size(), 2u);
  Canvas both = MemoryChartsCanvas(Charts(true));
  EXPECT_EQ(both.width(), kPngPanelWidth);
  EXPECT_EQ(both.height(), 2 * kPngPanelHeight);
  Canvas device = MemoryChartsCanvas(Charts(false));
  EXPECT_EQ(device.height(), kPngPanelHeight);
}

TEST(PngChartTest, EveryBandInItsColourWhereTheModelPutsIt) {
  const std::vector<MemoryChart> charts = Charts(true);
  const Canvas cv = MemoryChartsCanvas(charts);
  int bands = 0;
  for (size_t panel = 0; panel < charts.size(); ++panel) {
    const MemoryChart& c = charts[panel];
    const int top = static_cast<int>(panel) * kPngPanelHeight;
    for (size_t k = 0; k < c.phases.size(); ++k) {
      const int x = static_cast<int>(PngChartBarX(c, k) + PngChartBarWidth(c) / 2);
      double below = 0;
      for (const ChartSeries& s : c.series) {
        const double v = static_cast<double>(s.bytes[k]);
        if (v > 0) {
          const int y = top + static_cast<int>(std::lround((PngChartY(c, below) + PngChartY(c, below + v)) / 2));
          EXPECT_EQ(cv.At(x, y), ParseColor(s.color)) << c.space << " " << c.phases[k] << " " << s.live_set;
          ++bands;
        }
        below += v;
      }
    }
  }
  // weights, grads in 3 phases, activations in 1 (device); optimizer in 3 (host).
  EXPECT_EQ(bands, 3 * 2 + 1 + 3);
}

TEST(PngChartTest, EachBoundThePlanAndTheCapOnTheirRows) {
  const std::vector<MemoryChart> charts = Charts(false);
  const MemoryChart& c = charts.at(0);
  const Canvas full = MemoryChartsCanvas(charts);
  // The top set's stacked bound is the plan's total (3000 here), whose line
  // is drawn over it: the bounds are looked for without the total.
  std::vector<MemoryChart> bounds_only = charts;
  bounds_only[0].planned_total = 0;
  const Canvas with_bounds = MemoryChartsCanvas(bounds_only);
  int bounds = 0;
  for (size_t i = 0; i < c.series.size(); ++i) {
    if (c.series[i].bound <= 0) continue;
    std::vector<MemoryChart> without = bounds_only;
    without[0].series[i].bound = 0;
    const int y = static_cast<int>(std::lround(PngChartY(c, static_cast<double>(c.series[i].stacked_bound))));
    // A dashed line two pixels thick: most of the plot's width, in its colour.
    EXPECT_GT(ChangedTo(with_bounds, MemoryChartsCanvas(without), y, ParseColor(c.series[i].color)), 300)
        << c.series[i].live_set;
    ++bounds;
  }
  EXPECT_EQ(bounds, 4);  // weights, grads, dispatch, activations
  std::vector<MemoryChart> no_plan = charts;
  no_plan[0].planned_total = 0;
  EXPECT_GT(ChangedTo(full, MemoryChartsCanvas(no_plan),
                      static_cast<int>(std::lround(PngChartY(c, static_cast<double>(c.planned_total)))), Rgb{0, 0, 0}),
            500);
  ASSERT_TRUE(c.cap_on_scale());  // 4000 over a plan of 3000
  std::vector<MemoryChart> no_cap = charts;
  no_cap[0].cap = 0;
  EXPECT_GT(ChangedTo(full, MemoryChartsCanvas(no_cap),
                      static_cast<int>(std::lround(PngChartY(c, static_cast<double>(c.cap)))), Rgb{214, 39, 40}),
            500);
}

TEST(PngChartTest, TransientPeakBoxAboveTheBands) {
  const std::vector<MemoryChart> charts = Charts(false);
  const MemoryChart& c = charts.at(0);
  const size_t k = 1;  // "forward 0": 2300 at its end, 2800 at most
  ASSERT_EQ(c.phases[k], "forward 0");
  const int x = static_cast<int>(PngChartBarX(c, k) + PngChartBarWidth(c) / 2);
  const int y = static_cast<int>(std::lround((PngChartY(c, 2300) + PngChartY(c, 2800)) / 2));
  const Canvas cv = MemoryChartsCanvas(charts);
  const Canvas plain = MemoryChartsCanvas({});
  EXPECT_NE(cv.At(x, y), Rgb({255, 255, 255}));
  EXPECT_EQ(plain.At(x, y), Rgb({255, 255, 255}));
}

TEST(PngChartTest, EncodesAsPng) {
  const std::string png = chart::EncodePng(MemoryChartsCanvas(Charts(true)));
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(PngChartTest, ParseColor) {
  EXPECT_EQ(ParseColor("#4e79a7"), Rgb({0x4e, 0x79, 0xa7}));
  EXPECT_EQ(ParseColor("red"), Rgb({136, 136, 136}));
  EXPECT_EQ(ParseColor("#12345z"), Rgb({136, 136, 136}));
}

}  // namespace
}  // namespace plateau
