#include "timeline/text_chart.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace plateau {
namespace {

// As the page: a cap more than this far above the data is off scale.
constexpr double kCapOnScale = 1.5;

}  // namespace

std::string TerminalChart(const MemoryChart& c, int width) {
  width = std::max(width, 10);
  const double data = static_cast<double>(std::max<int64_t>(1, c.data_max()));
  const bool cap_on_scale = c.cap > 0 && c.cap <= kCapOnScale * data;
  const double max = cap_on_scale ? static_cast<double>(c.cap) : data;
  // The column a byte count ends at (0 .. width).
  auto col = [&](double bytes) {
    return std::clamp(static_cast<int>(std::lround(bytes / max * width)), 0, width);
  };
  size_t name_w = 5;
  for (const std::string& p : c.phases) name_w = std::max(name_w, p.size());
  name_w = std::min<size_t>(name_w, 40);

  std::string out = absl::StrCat(c.title, "\n");
  absl::StrAppend(&out, "plan total ", FormatBytes(c.planned_total), "; ", c.space, " cap ",
                  c.cap > 0 ? FormatBytes(c.cap) : std::string("none"),
                  c.cap > 0 && !cap_on_scale ? absl::StrFormat(" (off scale: %.1fx the chart)", c.cap / data) : "",
                  "; ", c.phases.size(), " rows\n");
  // The marks of the empty part of a row: bounds, plan total, cap.
  std::vector<char> marks(width + 1, ' ');
  std::string ruler(width + 1, ' ');
  // Two bounds in one column: the ruler names the larger (a tiny set's
  // bound sits on the one below it and says little).
  std::vector<int64_t> named(width + 1, 0);
  for (const ChartSeries& s : c.series) {
    if (s.bound <= 0) continue;
    const int k = col(static_cast<double>(s.stacked_bound));
    marks[k] = ':';
    if (s.bound > named[k]) {
      ruler[k] = s.letter;
      named[k] = s.bound;
    }
  }
  if (c.planned_total > 0) {
    marks[col(static_cast<double>(c.planned_total))] = '|';
  }
  if (cap_on_scale) {
    marks[col(static_cast<double>(c.cap))] = '!';
    ruler[col(static_cast<double>(c.cap))] = '!';
  }
  absl::StrAppend(&out, std::string(name_w, ' '), "  0", std::string(std::max(0, width - 1), ' '),
                  FormatBytes(static_cast<int64_t>(max)), "\n");
  absl::StrAppend(&out, absl::StrFormat("%-*s  ", static_cast<int>(name_w), "bound"), ruler, "\n");
  for (size_t k = 0; k < c.phases.size(); ++k) {
    std::string row(width + 1, ' ');
    for (int i = 0; i <= width; ++i) row[i] = marks[i];
    double below = 0;
    for (const ChartSeries& s : c.series) {
      const int a = col(below), b = col(below + static_cast<double>(s.bytes[k]));
      for (int i = a; i < b; ++i) row[i] = s.letter;
      below += static_cast<double>(s.bytes[k]);
    }
    const int end = col(below), peak = col(static_cast<double>(c.total_peak[k]));
    for (int i = end; i < peak; ++i) row[i] = '+';
    std::string name = c.phases[k].size() > name_w ? c.phases[k].substr(0, name_w - 2) + ".." : c.phases[k];
    absl::StrAppend(&out, absl::StrFormat("%-*s  ", static_cast<int>(name_w), name), row, " ",
                    FormatBytes(c.total[k]));
    if (c.total_peak[k] > c.total[k]) absl::StrAppend(&out, " (peak ", FormatBytes(c.total_peak[k]), ")");
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "legend:\n");
  for (const ChartSeries& s : c.series) {
    absl::StrAppend(&out, "  ", std::string(1, s.letter), " ", s.live_set);
    if (s.bound > 0) absl::StrAppend(&out, " (bound ", FormatBytes(s.bound), ")");
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  + peak inside the phase, : a bound stacked on those left of it, | plan total",
                  cap_on_scale ? ", ! cap" : "", "\n");
  return out;
}

}  // namespace plateau
