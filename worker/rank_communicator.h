// The world communicator's options of a rank process, from its job spec.
// Apart from worker/job_spec (which the coordinator links to validate specs)
// because it needs the communicator's API, which only the rank may depend
// on (tools/check-deps).
#ifndef PLATEAU_WORKER_RANK_COMMUNICATOR_H_
#define PLATEAU_WORKER_RANK_COMMUNICATOR_H_

#include "absl/status/statusor.h"
#include "kernels/communicator.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

// The world communicator every rank of the job creates, less what differs
// per rank or per attempt (rank, store, prefix, hostname, device_index):
// the backend's own transport (Gloo for cpu, NCCL for cuda), the world size
// (layout.ranks) and the timeout that bounds the rendezvous and each
// collective: the job's progress timeout (progress_timeout_s; 0: the
// coordinator's default, 600 s), at least 60 s, on both backends. NCCL's
// watchdog aborts a collective that has not finished that long after it
// started, and Gloo a wait that long, also one merely waiting for a slow
// peer (rank 0 writing a checkpoint), so a shorter bound would abort healthy
// jobs, while a collective stuck longer than the job's progress timeout is
// the hang the coordinator would declare anyway; the rank then fails with
// the collective's DEADLINE_EXCEEDED instead of being killed silently.
// (Backend cpu used Gloo's fixed 60 s until 2026-12-07: a checkpoint commit
// over a minute failed every other rank of a healthy job.)
absl::StatusOr<CommunicatorOptions> ToCommunicatorOptions(const v1::JobSpec& spec);

}  // namespace plateau

#endif  // PLATEAU_WORKER_RANK_COMMUNICATOR_H_
