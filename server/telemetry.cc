#include "server/telemetry.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/time/clock.h"
#include "kernels/memory.h"
#include "proto/timestamps.h"
#include "proto/utf8.h"
#include "server/job_store.h"

namespace plateau {
namespace {

// The maximum over ranks of each live set, in the order the sets first appear.
void MaxInto(const google::protobuf::RepeatedPtrField<v1::LiveSetBytes>& from,
             google::protobuf::RepeatedPtrField<v1::LiveSetBytes>* into) {
  for (const v1::LiveSetBytes& ls : from) {
    auto it = std::find_if(into->begin(), into->end(),
                           [&](const v1::LiveSetBytes& x) { return x.live_set() == ls.live_set(); });
    if (it == into->end()) {
      *into->Add() = ls;
    } else if (ls.bytes() > it->bytes()) {
      it->set_bytes(ls.bytes());
    }
  }
}

PendingStep& Pending(LiveJob& a, int64_t step) {
  PendingStep& p = a.pending_steps[step];
  if (p.ranks.size() != a.ranks.size()) {
    p.ranks.resize(a.ranks.size());
    p.reported.resize(a.ranks.size(), false);
  }
  return p;
}

// The event of a summary, and the job's Progress moved to it.
v1::JobEvent EventOf(LiveJob& a, v1::JobStepSummary s) {
  v1::Progress* p = a.job.mutable_progress();
  if (p->step() == 0) p->set_first_loss(s.loss());
  p->set_step(s.step());
  p->set_total_steps(a.job.spec().steps());
  p->set_loss(s.loss());
  a.job.set_lr(s.lr());
  if (s.has_validation_loss()) {
    a.job.set_validation_loss(s.validation_loss());
    a.job.set_validation_step(s.step());
  }
  a.tokens += static_cast<double>(s.tokens());
  a.seconds += s.seconds();
  if (a.seconds > 0 && s.tokens() > 0) {
    p->set_tokens_per_second(a.tokens / a.seconds);
    p->set_model_flops_per_second(s.model_flops() * (a.tokens / static_cast<double>(s.tokens())) / a.seconds);
  }
  a.emitted_step = s.step();
  v1::JobEvent e;
  e.set_job_id(a.job.id());
  Now(e.mutable_time());
  *e.mutable_job_step() = std::move(s);
  return e;
}

// Moves the pending steps up to `through` (all: INT64_MAX) into events.
void Emit(LiveJob& a, int64_t through, std::vector<v1::JobEvent>* out) {
  for (auto it = a.pending_steps.begin(); it != a.pending_steps.end() && it->first <= through;) {
    if (it->first > a.emitted_step) out->push_back(EventOf(a, SummarizeStep(it->second)));
    it = a.pending_steps.erase(it);
  }
}

// The step every rank has reached (each rank's latest report).
int64_t CompleteThrough(const LiveJob& a) {
  if (a.ranks.empty()) return 0;
  int64_t m = a.ranks[0].last_step;
  for (const RankState& r : a.ranks) m = std::min(m, r.last_step);
  return m;
}

}  // namespace

v1::JobStepSummary SummarizeStep(const PendingStep& p) {
  v1::JobStepSummary s;
  s.set_ranks(static_cast<int>(p.ranks.size()));
  int reported = 0;
  double seconds = 0;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    if (!p.reported[r]) continue;
    const v1::StepTelemetry& t = p.ranks[r];
    if (reported == 0) {  // the lowest rank's view of the global batch
      s.set_step(t.step());
      s.set_total_steps(t.total_steps());
      s.set_attempt(t.attempt());
      s.set_loss(t.loss());
      s.set_grad_norm(t.grad_norm());
      s.set_lr(t.lr());
      if (t.has_validation_loss()) s.set_validation_loss(t.validation_loss());
      s.set_tokens(t.tokens());
      s.set_model_flops(t.model_flops());
      s.set_slowest_rank(static_cast<int>(r));
      s.set_slowest_seconds(t.seconds());
    }
    ++reported;
    seconds += t.seconds();
    if (t.seconds() > s.slowest_seconds()) {
      s.set_slowest_rank(static_cast<int>(r));
      s.set_slowest_seconds(t.seconds());
    }
    MaxInto(t.peak(), s.mutable_peak());
    MaxInto(t.host_peak(), s.mutable_host_peak());
    s.set_peak_total_bytes(std::max(s.peak_total_bytes(), t.peak_total_bytes()));
    s.set_host_peak_total_bytes(std::max(s.host_peak_total_bytes(), t.host_peak_total_bytes()));
    s.set_device_used_bytes(std::max(s.device_used_bytes(), t.device_used_bytes()));
    s.set_device_pool_reserved_bytes(std::max(s.device_pool_reserved_bytes(), t.device_pool_reserved_bytes()));
    if (t.has_end_time() && (!s.has_end_time() || TimeOf(t.end_time()) > TimeOf(s.end_time()))) {
      *s.mutable_end_time() = t.end_time();
    }
  }
  s.set_ranks_reported(reported);
  if (reported > 0) {
    s.set_seconds(seconds / reported);
    s.set_mfu(p.ranks[s.slowest_rank()].mfu());
  }
  return s;
}

TelemetryBatch IngestTelemetry(v1::TelemetryRequest request,
                               absl::FunctionRef<LiveJob*(const std::string& job_id, int attempt)> find,
                               Metrics* metrics) {
  TelemetryBatch out;
  std::vector<LiveJob*> touched;
  for (v1::TelemetryRequest::Step& s : *request.mutable_steps()) {
    LiveJob* a = find(s.job_id(), s.telemetry().attempt());
    if (a == nullptr) continue;
    v1::StepTelemetry* t = s.mutable_telemetry();
    if (t->rank() < 0 || t->rank() >= static_cast<int>(a->ranks.size())) continue;
    RankState& rs = a->ranks[t->rank()];
    // Only the rank's own worker reports it, and only steps of the job: a
    // step past the end (2^62, from another worker) was taken as the
    // rank's last, after which every real report was dropped as old and
    // the healthy job was failed RANK_HUNG.
    if (rs.worker_id != request.worker_id() || t->step() < 1 || t->step() > a->job.spec().steps()) continue;
    // A batch re-sent after a lost reply is not counted twice.
    if (t->step() <= rs.last_step) continue;
    // Peaks of the live sets there are: any other name became a new
    // Prometheus series for ever.
    for (auto* peaks : {t->mutable_peak(), t->mutable_host_peak()}) {
      peaks->erase(std::remove_if(peaks->begin(), peaks->end(),
                                  [](const v1::LiveSetBytes& ls) { return !ParseLiveSet(ls.live_set()).ok(); }),
                   peaks->end());
    }
    // A time JSON cannot print (nanos out of range, a year past 9999) or
    // before 1970 is dropped: `watch` then counts to the event's time.
    if (t->has_end_time()) {
      const google::protobuf::Timestamp& e = t->end_time();
      if (e.nanos() < 0 || e.nanos() > 999999999 || e.seconds() < 0 || e.seconds() > 253402300799) {
        t->clear_end_time();
      }
    }
    rs.last_step = t->step();
    rs.last_progress = absl::Now();
    if (metrics != nullptr) {
      metrics->OnStep(a->job.id(), static_cast<int>(a->ranks.size()), *t);
    }
    if (t->has_memory_timeline()) {
      JobMemoryTimeline m{s.job_id(), std::move(*t->mutable_memory_timeline())};
      t->clear_memory_timeline();
      // What the step says, not what the timeline says: one source.
      m.timeline.set_rank(t->rank());
      m.timeline.set_step(t->step());
      m.timeline.set_attempt(t->attempt());
      Now(m.timeline.mutable_time());
      out.timelines.push_back(std::move(m));
    }
    if (t->step() > a->emitted_step) {
      PendingStep& p = Pending(*a, t->step());
      p.ranks[t->rank()] = *t;
      p.reported[t->rank()] = true;
    }
    if (std::find(touched.begin(), touched.end(), a) == touched.end()) touched.push_back(a);
    out.rank_steps.push_back(JobRankStep{s.job_id(), std::move(*t)});
  }
  for (LiveJob* a : touched) {
    const size_t before = out.events.size();
    Emit(*a, CompleteThrough(*a), &out.events);
    if (out.events.size() > before) out.progressed.push_back(a);
  }
  for (v1::LogEntry& l : *request.mutable_logs()) {
    if (!ParseJobId(l.job_id()).ok()) continue;
    // Cut on a character boundary: a split character would be stored as a
    // row no later read can parse (proto/utf8.h).
    if (l.line().size() > kMaxLogLineBytes) l.mutable_line()->resize(Utf8Prefix(l.line(), kMaxLogLineBytes).size());
    if (!l.has_time()) Now(l.mutable_time());
    // A line, never a stream's heartbeat (job.proto LogEntry.heartbeat):
    // stored with one, it would be skipped by every client that follows.
    l.clear_heartbeat();
    out.logs.push_back(std::move(l));
  }
  return out;
}

std::vector<v1::JobEvent> FlushSteps(LiveJob& a) {
  std::vector<v1::JobEvent> out;
  Emit(a, INT64_MAX, &out);
  return out;
}

std::vector<v1::JobEvent> RestoreSteps(LiveJob& a, const std::vector<v1::StepTelemetry>& reports,
                                       int64_t emitted) {
  a.emitted_step = emitted;
  a.pending_steps.clear();
  for (const v1::StepTelemetry& t : reports) {
    if (t.rank() < 0 || t.rank() >= static_cast<int>(a.ranks.size())) continue;
    RankState& rs = a.ranks[t.rank()];
    rs.last_step = std::max(rs.last_step, t.step());
    if (t.step() <= emitted) continue;
    PendingStep& p = Pending(a, t.step());
    p.ranks[t.rank()] = t;
    p.reported[t.rank()] = true;
  }
  std::vector<v1::JobEvent> out;
  Emit(a, CompleteThrough(a), &out);
  return out;
}

}  // namespace plateau
