#include "server/telemetry.h"

#include <utility>

#include "absl/time/clock.h"
#include "proto/timestamps.h"
#include "server/job_store.h"

namespace plateau {
namespace {


}  // namespace

TelemetryBatch IngestTelemetry(v1::TelemetryRequest request, double device_peak_flops,
                               absl::FunctionRef<LiveJob*(const std::string& job_id, int attempt)> find,
                               Metrics* metrics) {
  TelemetryBatch out;
  for (v1::TelemetryRequest::Step& s : *request.mutable_steps()) {
    LiveJob* a = find(s.job_id(), s.telemetry().attempt());
    if (a == nullptr) continue;
    const v1::StepTelemetry& t = s.telemetry();
    if (t.rank() < 0 || t.rank() >= static_cast<int>(a->ranks.size())) continue;
    RankState& rs = a->ranks[t.rank()];
    // A batch re-sent after a lost reply is not counted twice.
    if (t.step() <= rs.last_step) continue;
    rs.last_step = t.step();
    rs.last_progress = absl::Now();
    if (metrics != nullptr) {
      metrics->OnStep(a->job.id(), static_cast<int>(a->ranks.size()), t, device_peak_flops);
    }
    if (t.rank() == 0) {
      v1::Progress* p = a->job.mutable_progress();
      if (p->step() == 0) p->set_first_loss(t.loss());
      p->set_step(t.step());
      p->set_total_steps(a->job.spec().steps());
      p->set_loss(t.loss());
      a->tokens += t.tokens();
      a->seconds += t.seconds();
      if (a->seconds > 0) {
        p->set_tokens_per_second(a->tokens / a->seconds);
        p->set_model_flops_per_second(t.model_flops() * (a->tokens / t.tokens()) / a->seconds);
      }
      out.progressed.push_back(a);
    }
    if (s.telemetry().has_memory_timeline()) {
      v1::StepTelemetry* st = s.mutable_telemetry();
      JobMemoryTimeline m{s.job_id(), std::move(*st->mutable_memory_timeline())};
      st->clear_memory_timeline();
      // What the step says, not what the timeline says: one source.
      m.timeline.set_rank(st->rank());
      m.timeline.set_step(st->step());
      m.timeline.set_attempt(st->attempt());
      Now(m.timeline.mutable_time());
      out.timelines.push_back(std::move(m));
    }
    v1::JobEvent e;
    e.set_job_id(s.job_id());
    Now(e.mutable_time());
    *e.mutable_step() = std::move(*s.mutable_telemetry());
    out.events.push_back(std::move(e));
  }
  for (v1::LogEntry& l : *request.mutable_logs()) {
    if (!ParseJobId(l.job_id()).ok()) continue;
    if (l.line().size() > kMaxLogLineBytes) l.mutable_line()->resize(kMaxLogLineBytes);
    if (!l.has_time()) Now(l.mutable_time());
    out.logs.push_back(std::move(l));
  }
  return out;
}

}  // namespace plateau
