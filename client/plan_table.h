// The what-if table of a memory plan as `plateauctl plan` prints it, and
// the values chosen for the spec's `auto` settings. The what-if table: N_max
// (the largest batch and the longest context that fit the job's caps) as
// specified, with the four schedules off, each on alone and all on, then
// the settings each row ran with and what limits the spec's own shape.
//
// Thread safety: a pure function.
#ifndef PLATEAU_CLIENT_PLAN_TABLE_H_
#define PLATEAU_CLIENT_PLAN_TABLE_H_

#include <string>

#include "plateau/v1/job.pb.h"

namespace plateau {

// Empty when the plan has no N_max (no device cap: the plan's notes say so).
std::string FormatWhatIf(const v1::MemoryPlan& plan);

// The spec's `auto` settings as the plan chose them: each field, its value,
// the modelled seconds and why, and the curves the model read (`plan` and
// `get` print it). Empty when the spec has none.
std::string FormatAutoSettings(const v1::MemoryPlan& plan);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_PLAN_TABLE_H_
