// The memory timeline as a terminal chart (plateauctl memory JOB): one row
// per phase, a bar of the live sets' bytes at the phase's end (one letter
// per live set: W weights, G grads, O optimizer, C checkpoints, D dispatch,
// P projection, A activations, S workspace), '+' up to the phase's peak,
// and in the empty part of every row the bounds: ':' at each live set's
// stacked bound (named by the ruler above the rows), '|' at the plan's
// total, '!' at the cap. Plain ASCII, no colours: it survives a pipe.
#ifndef PLATEAU_TIMELINE_TEXT_CHART_H_
#define PLATEAU_TIMELINE_TEXT_CHART_H_

#include <string>

#include "timeline/memory_chart.h"

namespace plateau {

// `width`: columns of the bars (at least 10).
std::string TerminalChart(const MemoryChart& chart, int width = 64);

}  // namespace plateau

#endif  // PLATEAU_TIMELINE_TEXT_CHART_H_
