// The what-if table of a memory plan as `plateauctl plan` prints it: N_max
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

}  // namespace plateau

#endif  // PLATEAU_CLIENT_PLAN_TABLE_H_
