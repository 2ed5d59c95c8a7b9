// The job spec of the API (plateau.v1.JobSpec) and the step's options: every
// field validated, the conversion to TrainerOptions/BackendOptions, and the
// memory plan. The coordinator validates with it at submit and the rank
// process converts with it, so the service and the step agree on what a spec
// means.
//
// Errors: INVALID_ARGUMENT naming the field and what was expected
// ("layout.nodes: expected a divisor of layout.ranks = 4, got 3");
// UNIMPLEMENTED naming a schedule this build does not have yet;
// RESOURCE_EXHAUSTED when the launch-sized state cannot fit the device cap,
// naming the live sets and their bytes.
//
// Thread safety: free functions without shared state.
#ifndef PLATEAU_WORKER_JOB_SPEC_H_
#define PLATEAU_WORKER_JOB_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "plateau/v1/job.pb.h"
#include "worker/trainer_options.h"

namespace plateau {

// The step's options for this spec (validated).
absl::StatusOr<TrainerOptions> ToTrainerOptions(const v1::JobSpec& spec);
// The backend every rank of the job creates.
absl::StatusOr<BackendOptions> ToBackendOptions(const v1::JobSpec& spec);

// Validates every field (ToTrainerOptions and ToBackendOptions succeed).
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// Validates the spec and plans each rank's device bytes per live set
// (kernels/model PlanMemory), without allocating anything.
absl::StatusOr<v1::MemoryPlan> PlanJob(const v1::JobSpec& spec);

// PlanJob, then refuses (RESOURCE_EXHAUSTED) a job whose launch-sized state
// cannot fit the device cap: what TrainingStep::Create would refuse on every
// rank. The dispatch live set is only an estimate under standard EP (it has
// no bound), so a plan over the cap only in dispatch is admitted with a note.
absl::StatusOr<v1::MemoryPlan> AdmitJob(const v1::JobSpec& spec);

// The spec of RecallDemoJob(ranks) (the demo and the tests), with `steps`,
// the CPU backend and a 256 MiB device arena per rank.
v1::JobSpec DemoJobSpec(int ranks, int64_t steps);

// Number of layout nodes (0 in the spec means 1).
int64_t NodesOf(const v1::JobSpec& spec);

// "job-3" style ids are the coordinator's; these render enum values for
// people: "cpu", "cuda"; "PENDING", ...
std::string BackendName(v1::Backend b);

}  // namespace plateau

#endif  // PLATEAU_WORKER_JOB_SPEC_H_
