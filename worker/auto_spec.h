// The spec side of the `auto` settings (kernels/budget/auto_settings.h):
// which fields of a plateau.v1.JobSpec ask for one, what PlanJob chooses
// them with, and the spec the ranks run once they are chosen.
//
// A user writes `auto` beside the field, which must then stay unset (0):
//   pipelined_llep { chunk_tokens_auto: true }
//   ring_dtp { strip_auto: true }
//   sco { host_budget_auto: true }
//   offload_stream_adamw { bucket_params_auto: true }
// The coordinator chooses the values when it plans the job (PlanJob,
// SubmitJob), and again when it places the first attempt, on the workers it
// placed it on (job_spec.h PlacementAutoContext); a restart keeps them where
// they fit (PlanAtEarlierAutoSettings), else chooses again; it keeps the latest
// choice in the job's plan (MemoryPlan.auto_settings); each assignment
// carries ResolvedSpec, so every rank runs the same values and a rank never
// chooses (plateau_rank refuses a spec with `auto` left).
//
// Thread safety: free functions without shared state.
#ifndef PLATEAU_WORKER_AUTO_SPEC_H_
#define PLATEAU_WORKER_AUTO_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/budget/auto_settings.h"
#include "plateau/v1/job.pb.h"
#include "plateau/v1/worker.pb.h"

namespace plateau {

// What PlanJob chooses a spec's `auto` settings with.
struct AutoContext {
  // A worker's calibration; unset: the default curve of the spec's backend
  // (DefaultCalibration), and the plan says so.
  std::optional<v1::Calibration> calibration;
  std::string worker;  // whose calibration ("worker-1 (host)"), for the plan
  // That worker's memory per device, and its host memory per rank of the
  // job (the node's shared by the job's ranks there) (0: unknown): the caps
  // for a spec whose own cap is 0.
  int64_t device_memory_bytes = 0;
  int64_t host_memory_bytes = 0;
};

// Which settings the spec leaves to the chooser (whatever its schedules;
// ChooseAutoSettings refuses one whose schedule is off).
AutoRequest AutoRequestOf(const v1::JobSpec& spec);
bool HasAutoSettings(const v1::JobSpec& spec);

// The calibration to model with and the text MemoryPlan.calibration shows:
// the context's worker's when it has one, else the default curve. Errors:
// INVALID_ARGUMENT naming the calibration's field.
absl::StatusOr<Calibration> CalibrationFor(const v1::JobSpec& spec, const AutoContext& context,
                                           std::string* description);

// The spec with every `auto` setting replaced by the plan's chosen value
// (MemoryPlan.auto_settings) and its `auto` flag cleared: what the ranks
// run. FAILED_PRECONDITION naming the field when the plan lacks a value the
// spec leaves to it.
absl::StatusOr<v1::JobSpec> ResolvedSpec(const v1::JobSpec& spec, const v1::MemoryPlan& plan);

}  // namespace plateau

#endif  // PLATEAU_WORKER_AUTO_SPEC_H_
