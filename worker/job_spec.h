// The job spec of the API (plateau.v1.JobSpec) and the step's options: every
// field validated, the conversion to TrainerOptions/BackendOptions, and the
// memory plan. The coordinator validates with it at submit and the rank
// process converts with it, so the service and the step agree on what a spec
// means.
//
// Errors: INVALID_ARGUMENT naming the field and what was expected
// ("layout.nodes: expected a divisor of layout.ranks = 4, got 3");
// UNIMPLEMENTED naming a schedule this build does not have yet;
// RESOURCE_EXHAUSTED when the plan cannot fit the device or the host cap
// (AdmitPlan), naming the cap's field, the live sets and their bytes.
//
// Thread safety: free functions without shared state.
#ifndef PLATEAU_WORKER_JOB_SPEC_H_
#define PLATEAU_WORKER_JOB_SPEC_H_

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/budget/budget.h"
#include "plateau/v1/job.pb.h"
#include "worker/auto_spec.h"
#include "worker/trainer_options.h"

namespace plateau {

// A spec's serialized size at most (plateauctl's spec file limit too): the
// coordinator keeps every pending job's spec in memory, lists them in pages
// and rewrites their rows, so their size is bounded like any other field.
inline constexpr size_t kMaxJobSpecBytes = size_t{1} << 20;

// The step's options for this spec (validated).
absl::StatusOr<TrainerOptions> ToTrainerOptions(const v1::JobSpec& spec);
// The backend every rank of the job creates.
absl::StatusOr<BackendOptions> ToBackendOptions(const v1::JobSpec& spec);


// Validates every field (ToTrainerOptions and ToBackendOptions succeed), and
// that the step computes the spec's precision on its shape (under bf16 a
// shape CheckBf16Schedules lists is refused, naming its field:
// model.experts above model.hidden).
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// The rules only a new spec is held to, tightened after jobs were accepted
// without them: the coordinator checks them at submit (SubmitJob and PlanJob,
// before AdmitJob), while placement, a restart and the rank
// (ToTrainerOptions) do not, so that a job accepted before keeps running as
// it was accepted. Today: optimizer.warmup_steps at most steps - 1
// (ValidateNewWarmup; W = steps, accepted until 2026-12-07, never reaches
// lr). INVALID_ARGUMENT naming the field.
absl::Status ValidateNewJobSpec(const v1::JobSpec& spec);

// Validates the spec and plans each rank's device and host bytes per live
// set (kernels/budget PlanMemory), without allocating anything. `fits` is
// true only when both spaces fit their caps (a cap of 0 always fits here).
// With a device cap, also N_max (the largest batch and the longest context
// that fit both caps) and the what-if table (kernels/budget/n_max.h),
// within the spec's own limits on layout.batch and model.seq_len. A bf16
// spec with a shape the bf16 step cannot take (CheckBf16Schedules) is
// planned (what it would need) though ValidateJobSpec and AdmitJob refuse
// it.
// The spec's `auto` settings (worker/auto_spec.h) are chosen first, on the
// context's calibration, and everything is planned at their values
// (MemoryPlan.auto_settings, .calibration); RESOURCE_EXHAUSTED when no
// value of them fits, naming the cap and the live set.
// `still_wanted` (when set) is asked before each shape the N_max and
// what-if searches plan (kernels/budget/n_max.h NMaxLimits::still_wanted),
// the bulk of a plan's work: a status that is not OK ends the plan with it
// (the coordinator's: its caller's deadline passed, DEADLINE_EXCEEDED, or
// it cancelled, CANCELLED).
absl::StatusOr<v1::MemoryPlan> PlanJob(const v1::JobSpec& spec, const AutoContext& auto_context = {},
                                       const std::function<absl::Status()>& still_wanted = nullptr);

// The budget's plan as the API's, against the spec's caps: the live sets of
// both spaces, their totals, the caps, `fits`, the dispatch estimate and the
// notes (PlanJob adds the model's counts). Separate so that tests can give
// it any plan, e.g. one with host terms before a schedule has them.
v1::MemoryPlan PlanToProto(const v1::JobSpec& spec, const MemoryPlan& plan);

// The admission decision on a plan of `spec` (PlanJob's), as a function of
// the two so that it is testable on any plan: RESOURCE_EXHAUSTED when
// - the host plan is over host_memory_bytes (every host live set is
//   launch-sized, so force_launch does not override it: TrainingStep::Create
//   would refuse it on every rank);
// - the launch-sized device state (every live set but dispatch) is over
//   device_memory_bytes (likewise refused by every rank, forced or not);
// - the whole device plan is over device_memory_bytes and the spec does not
//   set force_launch (with it, admitted with a note: standard EP's dispatch
//   is planned at its worst case, which real routing may stay below).
// Each message starts with the cap's field and names the live sets, the
// total, the cap and the shortfall. Otherwise returns the plan.
absl::StatusOr<v1::MemoryPlan> AdmitPlan(const v1::JobSpec& spec, v1::MemoryPlan plan);

// PlanJob, the precision check of ValidateJobSpec, then AdmitPlan. A plan
// whose `auto` settings fit no value under the spec's own cap
// (MemoryPlan.auto_nothing_fits) is refused with the chooser's reason,
// unless force_launch; under a worker's cap (the spec's is 0) it is left to
// placement (AutoFitsOnWorker), where another worker may fit.
// `still_wanted` as PlanJob's.
absl::StatusOr<v1::MemoryPlan> AdmitJob(const v1::JobSpec& spec, const AutoContext& auto_context = {},
                                        const std::function<absl::Status()>& still_wanted = nullptr);

// Placement's check of a job with `auto` settings on one worker: whether
// some value of them fits one of the job's ranks there, against the spec's
// caps or, where the spec's cap is 0, the worker's device memory and its
// host memory shared by `per_node` ranks (0 reported: unknown, not a cap).
// Whether a value fits never depends on the calibration (only which is
// chosen), so none is needed. OK for a spec without `auto` settings;
// RESOURCE_EXHAUSTED with the chooser's reason otherwise.
absl::Status AutoFitsOnWorker(const v1::JobSpec& spec, const v1::WorkerCapabilities& worker, int64_t per_node);

// A restarted attempt's plan at the `auto` values its job ran with before
// (`earlier`.auto_settings): a resumed run is then bitwise the
// uninterrupted one, since two of the settings (chunk_tokens, strip) change
// the order of sums. Checked against the spec's caps or, where one is 0,
// the context's worker memory (the chooser's rule: each whole plan within
// its cap, force_launch or not); the plan is AdmitJob's at those values
// (so its N_max and what-if rows keep them, where a choice's choose again
// at each N), with the earlier AutoSetting rows, its calibration and a note
// saying they were kept. RESOURCE_EXHAUSTED naming
// the cap when they do not fit there (the coordinator then chooses again),
// FAILED_PRECONDITION when `earlier` lacks a value.
absl::StatusOr<v1::MemoryPlan> PlanAtEarlierAutoSettings(const v1::JobSpec& spec, const v1::MemoryPlan& earlier,
                                                         const AutoContext& context);

// What the coordinator chooses a placed job's `auto` settings with, from the
// workers it was placed on ({id as shown, capabilities}, one per node): the
// most constrained memory (the least device memory, the least host memory
// per rank: every rank must fit) and the slowest calibration. The step is
// synchronous, so the slowest node sets its pace: of the workers that
// reported a calibration, the one whose own choice (at those caps) models
// the longest step, the first among equals; the plan names it and the
// others. None reported: the default curve.
absl::StatusOr<AutoContext> PlacementAutoContext(
    const v1::JobSpec& spec, const std::vector<std::pair<std::string, v1::WorkerCapabilities>>& workers);

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
