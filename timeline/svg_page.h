// The memory timeline as a self-contained HTML page with inline SVG (no
// scripts, fonts or other requests): what the coordinator's metrics port
// serves at /jobs/ID/memory (docs/SERVICE.md "Memory timeline").
//
// Every drawn element names what it shows, so that a test (or a curious
// user's inspector) can find it: a live set's bands are
// <rect class="band" data-live-set="...">, its bound is
// <line class="bound" data-live-set="...">, a phase's transient peak is
// <rect class="transient">, the cap <line class="cap">, the plan's total
// <line class="plan-total">; each <svg class="memory-chart"> carries
// data-space="device" or "host".
#ifndef PLATEAU_TIMELINE_SVG_PAGE_H_
#define PLATEAU_TIMELINE_SVG_PAGE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "plateau/v1/job.pb.h"
#include "timeline/memory_chart.h"

namespace plateau {

// One chart as an <svg> element.
std::string MemoryChartSvg(const MemoryChart& chart);

// The whole page for `rank` of the response: a summary, links to the other
// ranks' pages, the device chart, the host chart when there is one, and
// the numbers as a table. NOT_FOUND when the rank has no timeline.
absl::StatusOr<std::string> MemoryTimelinePage(const v1::GetMemoryTimelineResponse& response, int rank);

// A page that says only `message` (no timeline yet, unknown job, ...).
std::string MessagePage(absl::string_view title, absl::string_view message);

// &, <, >, " and ' as entities.
std::string HtmlEscape(absl::string_view text);

}  // namespace plateau

#endif  // PLATEAU_TIMELINE_SVG_PAGE_H_
