// The memory timeline as a PNG (plateauctl memory JOB --png FILE): the
// drawing of the page's SVG chart (timeline/svg_page.h) on client/chart's
// canvas, one panel per memory space, device on top. The same model
// (timeline/memory_chart.h), the same scale and the same colours: stacked
// bands per live set at each phase's end, a pale box up to the phase's
// peak, each live set's stacked bound as a dashed line in its colour, the
// plan's total in black and the cap in red (dotted at the top when off
// scale). Phase names are written under every k-th bar that has room.
#ifndef PLATEAU_TIMELINE_PNG_CHART_H_
#define PLATEAU_TIMELINE_PNG_CHART_H_

#include <vector>

#include "client/chart/canvas.h"
#include "timeline/memory_chart.h"

namespace plateau {

// Pixel size of one panel.
inline constexpr int kPngPanelWidth = 1000;
inline constexpr int kPngPanelHeight = 420;

// Where a panel draws (panel-relative pixels; add the panel's index x
// kPngPanelHeight to y): the y of `bytes` on the value axis, and the left
// edge and width of phase k's bar. The tests read the drawing through these.
double PngChartY(const MemoryChart& chart, double bytes);
double PngChartBarX(const MemoryChart& chart, size_t phase);
double PngChartBarWidth(const MemoryChart& chart);

// One panel per chart, stacked top to bottom (at least one panel's height
// when `charts` is empty).
chart::Canvas MemoryChartsCanvas(const std::vector<MemoryChart>& charts);

// "#4e79a7" as RGB; grey for anything else.
chart::Rgb ParseColor(const std::string& hex);

}  // namespace plateau

#endif  // PLATEAU_TIMELINE_PNG_CHART_H_
