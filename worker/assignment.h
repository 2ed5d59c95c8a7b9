// What a worker agent checks of an assignment the coordinator sent, before
// it writes anything or starts a rank. The job id names a file of the
// agent's work directory: a forged or corrupted one ("../x", from something
// posing as the coordinator) would write outside it.
//
// Thread safety: a free function without shared state.
#ifndef PLATEAU_WORKER_ASSIGNMENT_H_
#define PLATEAU_WORKER_ASSIGNMENT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// OK when the job id is "job-N" (N > 0, as the coordinator spells it), the
// attempt >= 0, the key prefix 1 to 1024 printable characters without
// spaces, and each rank one of the spec's layout.ranks, once. Otherwise
// INVALID_ARGUMENT "assignment: FIELD: expected ..., got ...".
absl::Status CheckAssignment(const v1::Assignment& a);

// The agent's --allowed_paths: each an absolute directory, made canonical
// (links resolved; it need not exist yet). INVALID_ARGUMENT naming the
// flag otherwise. An empty list: no limit.
absl::StatusOr<std::vector<std::string>> AllowedPaths(const std::string& flag_value);

// Whether every path the spec names (data.text.path, data.shards.paths[i],
// checkpoint.directory) is plain (absolute, no '.', '..' or '//' parts)
// and lies under one of `allowed` (AllowedPaths), once links are resolved
// (as far as the path exists; one that cannot be resolved is refused): the ranks open them as
// the agent's user, so without a limit any submitter could have them read
// any file that user can (another job's checkpoints, the node's secrets)
// or write checkpoints into another job's directory. FAILED_PRECONDITION
// "FIELD=PATH: outside this worker's --allowed_paths (...)"; OK when
// `allowed` is empty. (A link swapped in between this check and the
// rank's open is not caught: give each submitter a directory of their own.)
absl::Status CheckSpecPaths(const v1::JobSpec& spec, const std::vector<std::string>& allowed);

}  // namespace plateau

#endif  // PLATEAU_WORKER_ASSIGNMENT_H_
