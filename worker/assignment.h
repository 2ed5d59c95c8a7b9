// What a worker agent checks of an assignment the coordinator sent, before
// it writes anything or starts a rank. The job id names a file of the
// agent's work directory: a forged or corrupted one ("../x", from something
// posing as the coordinator) would write outside it.
//
// Thread safety: a free function without shared state.
#ifndef PLATEAU_WORKER_ASSIGNMENT_H_
#define PLATEAU_WORKER_ASSIGNMENT_H_

#include "absl/status/status.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// OK when the job id is "job-N" (N > 0, as the coordinator spells it), the
// attempt >= 0, the key prefix 1 to 1024 printable characters without
// spaces, and each rank one of the spec's layout.ranks, once. Otherwise
// INVALID_ARGUMENT "assignment: FIELD: expected ..., got ...".
absl::Status CheckAssignment(const v1::Assignment& a);

}  // namespace plateau

#endif  // PLATEAU_WORKER_ASSIGNMENT_H_
