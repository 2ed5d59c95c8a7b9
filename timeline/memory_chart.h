// The memory timeline as a chart, independent of how it is drawn: the
// coordinator's HTML page (timeline/svg_page.h), plateauctl's terminal chart
// (timeline/text_chart.h) and its PNG (timeline/png_chart.h) read this model only.
//
// One chart per memory space of one rank's timeline. Along x, the step's
// phases in order; for each phase, every live set's bytes when the phase
// ended, stacked in LiveSet order (weights at the bottom), and the peak of
// the sum inside the phase (at or above the stack: a transient the
// boundaries miss). Each live set's bound is drawn as a line at the sum of
// the plan's bounds of that set and of every set below it: while every set
// stays within its bound, the top of its band stays under its line. The
// plan's total and the cap close the chart at the top.
//
// Thread safety: plain values.
#ifndef PLATEAU_TIMELINE_MEMORY_CHART_H_
#define PLATEAU_TIMELINE_MEMORY_CHART_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

struct ChartSeries {
  std::string live_set;          // "weights", ...
  std::string color;             // "#4e79a7": one colour per live set everywhere
  char letter = '?';             // 'W': the terminal chart's fill
  std::vector<int64_t> bytes;    // per phase, at its end
  std::vector<int64_t> peak;     // per phase, the most during it
  int64_t bound = 0;             // the plan's bytes for this set (0: none planned)
  int64_t stacked_bound = 0;     // bound + the bounds of every series below
};

struct MemoryChart {
  std::string space;               // "device" or "host"
  std::string title;               // "job-3, rank 0, step 100: device memory"
  std::vector<std::string> phases;
  std::vector<int64_t> merged;     // per phase: how many phases the entry covers
  // Bottom first. Every live set the plan bounds or the timeline saw.
  std::vector<ChartSeries> series;
  std::vector<int64_t> total;      // per phase: the stack's height at its end
  std::vector<int64_t> total_peak; // per phase: the peak of the sum within it
  int64_t planned_total = 0;       // the plan's total for this space
  int64_t cap = 0;                 // the space's cap (0: uncapped)

  // The height the chart needs for its data and the plan (the cap may be
  // far above; a drawing shows it off scale then).
  int64_t data_max() const;
  // The scale every drawing uses: the cap is drawn on scale when it is at
  // most 1.5x data_max() (the plot then reaches 4% above it); otherwise the
  // plot reaches 8% above the data and the cap is marked off scale, since a
  // cap far above the plan would flatten every band to nothing.
  bool cap_on_scale() const;
  double scale_max() const;
};

// The spacing of the value axis' ticks for a plot reaching `max` bytes: 1, 2
// or 5 times a power of ten of the largest binary unit (B, KiB, MiB, GiB)
// below max, so that about 5 ticks fit and read as round numbers.
double ChartTickStep(double max);

// The charts of `rank`'s timeline in `response`: the device chart, then the
// host chart when the plan or the timeline has any host bytes. NOT_FOUND
// names the ranks that have one when `rank` has none.
absl::StatusOr<std::vector<MemoryChart>> MemoryCharts(const v1::GetMemoryTimelineResponse& response, int rank);

// "6.55 MiB", "512 B", "1.20 GiB".
std::string FormatBytes(int64_t bytes);

}  // namespace plateau

#endif  // PLATEAU_TIMELINE_MEMORY_CHART_H_
