#include "worker/auto_spec.h"

#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "worker/calibration.h"

namespace plateau {

AutoRequest AutoRequestOf(const v1::JobSpec& spec) {
  const v1::ScheduleSpec& s = spec.schedule();
  AutoRequest r;
  r.chunk_tokens = s.has_pipelined_llep() && s.pipelined_llep().chunk_tokens_auto();
  r.strip = s.has_ring_dtp() && s.ring_dtp().strip_auto();
  r.host_budget = s.has_sco() && s.sco().host_budget_auto();
  r.bucket_params = s.has_offload_stream_adamw() && s.offload_stream_adamw().bucket_params_auto();
  return r;
}

bool HasAutoSettings(const v1::JobSpec& spec) { return AutoRequestOf(spec).any(); }

absl::StatusOr<Calibration> CalibrationFor(const v1::JobSpec& spec, const AutoContext& context,
                                           std::string* description) {
  if (context.calibration.has_value()) {
    PLATEAU_ASSIGN_OR_RETURN(Calibration c, CalibrationFromProto(*context.calibration));
    const absl::Time when = absl::FromUnixSeconds(context.calibration->measured_unix_seconds());
    *description = absl::StrCat("measured on ", context.worker.empty() ? "a worker" : context.worker, " (",
                                context.calibration->backend(), ") at ",
                                absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", when, absl::UTCTimeZone()));
    return c;
  }
  const bool cuda = spec.backend() == v1::BACKEND_CUDA;
  *description = absl::StrCat("the default ", cuda ? "cuda" : "cpu",
                              " curve (no worker of this backend has reported a calibration; "
                              "docs/SCHEDULES.md \"Automatic settings\")");
  return DefaultCalibration(cuda ? CalibrationBackend::kCuda : CalibrationBackend::kCpu);
}

absl::StatusOr<v1::JobSpec> ResolvedSpec(const v1::JobSpec& spec, const v1::MemoryPlan& plan) {
  v1::JobSpec out = spec;
  const AutoRequest r = AutoRequestOf(spec);
  auto value = [&](AutoSetting s) -> absl::StatusOr<int64_t> {
    for (const v1::AutoSetting& a : plan.auto_settings()) {
      if (a.field() == AutoSettingField(s)) return a.value();
    }
    return absl::FailedPreconditionError(
        absl::StrCat(AutoSettingField(s), "_auto: the job's plan has no chosen value for it"));
  };
  v1::ScheduleSpec* s = out.mutable_schedule();
  if (r.chunk_tokens) {
    PLATEAU_ASSIGN_OR_RETURN(const int64_t v, value(AutoSetting::kChunkTokens));
    s->mutable_pipelined_llep()->set_chunk_tokens(v);
    s->mutable_pipelined_llep()->clear_chunk_tokens_auto();
  }
  if (r.strip) {
    PLATEAU_ASSIGN_OR_RETURN(const int64_t v, value(AutoSetting::kStrip));
    s->mutable_ring_dtp()->set_strip(v);
    s->mutable_ring_dtp()->clear_strip_auto();
  }
  if (r.host_budget) {
    PLATEAU_ASSIGN_OR_RETURN(const int64_t v, value(AutoSetting::kHostBudget));
    s->mutable_sco()->set_host_budget_bytes(v);
    s->mutable_sco()->clear_host_budget_auto();
  }
  if (r.bucket_params) {
    PLATEAU_ASSIGN_OR_RETURN(const int64_t v, value(AutoSetting::kBucketParams));
    s->mutable_offload_stream_adamw()->set_bucket_params(v);
    s->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  }
  return out;
}

}  // namespace plateau
