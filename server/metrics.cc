#include "server/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "prometheus/text_serializer.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& bind_address) {
  std::unique_ptr<Metrics> m(new Metrics());
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  m->step_ = &BuildGauge().Name("plateau_job_step").Help("Optimizer steps a rank has completed.").Register(r);
  m->loss_ = &BuildGauge().Name("plateau_job_loss").Help("Loss of the latest step (mean over the global batch).").Register(r);
  m->lr_ = &BuildGauge()
                .Name("plateau_job_learning_rate")
                .Help("Learning rate the latest step's AdamW ran with (the spec's schedule at that step).")
                .Register(r);
  m->validation_loss_ = &BuildGauge()
                             .Name("plateau_job_validation_loss")
                             .Help("Mean token cross-entropy over the held-out sequences at the latest "
                                   "validation (JobSpec.validation_every).")
                             .Register(r);
  m->tokens_ = &BuildCounter()
                    .Name("plateau_job_tokens_total")
                    .Help(
                        "Tokens processed: every step's global batch (steps replayed after a restart count "
                        "again); each rank counts its 1/P share.")
                    .Register(r);
  m->flops_ =
      &BuildCounter()
           .Name("plateau_job_model_flops_total")
           .Help(
               "Model FLOPs (6 x active matrix-product params x tokens + causal attention), without "
               "recomputation: the step recomputes each layer, so the hardware does about 1.33-1.5x these. Each "
               "rank counts its 1/P share (replayed steps count again). Its rate is the job's FLOP/s over wall time.")
           .Register(r);
  m->duration_ = &BuildHistogram()
                      .Name("plateau_job_step_duration_seconds")
                      .Help(
                          "Wall time of one training step: data loading, memory-timeline recording and step 1's "
                          "warm-up included; validation and checkpoint writes not.")
                      .Register(r);
  m->peak_ = &BuildGauge()
                  .Name("plateau_job_peak_bytes")
                  .Help("Largest device bytes a live set has held in any step so far (live_set=\"total\": the peak of the sum).")
                  .Register(r);
  // A gauge of its own rather than a label on plateau_job_peak_bytes:
  // dashboards and alerts query that one without a space label.
  m->host_peak_ = &BuildGauge()
                       .Name("plateau_job_host_peak_bytes")
                       .Help("Largest host bytes (pinned on CUDA) a live set has held in any step so far "
                             "(live_set=\"total\": the peak of the sum).")
                       .Register(r);
  m->planned_ = &BuildGauge()
                     .Name("plateau_job_planned_bytes")
                     .Help(
                         "Device bytes planned per live set before launch: an upper bound "
                         "(dispatch: the worst-case routing).")
                     .Register(r);
  m->host_planned_ = &BuildGauge()
                          .Name("plateau_job_host_planned_bytes")
                          .Help(
                              "Host bytes (pinned on CUDA) planned per live set before launch: an upper bound "
                              "(live_set=\"total\": the plan's host total; 0 under the baseline schedules).")
                          .Register(r);
  m->device_cap_ = &BuildGauge()
                        .Name("plateau_job_device_cap_bytes")
                        .Help(
                            "The job's device memory cap per rank (JobSpec.device_memory_bytes, as planned); no "
                            "series without one (the whole device).")
                        .Register(r);
  m->host_cap_ = &BuildGauge()
                      .Name("plateau_job_host_cap_bytes")
                      .Help(
                          "The job's host memory cap per rank (JobSpec.host_memory_bytes, as planned); no series "
                          "without one (uncapped).")
                      .Register(r);
  m->device_used_ = &BuildGauge()
                         .Name("plateau_job_device_used_bytes")
                         .Help(
                             "The device's own view after the rank's latest step: total - free (everything on the "
                             "card: the context, NCCL, cuBLAS, the pool's cache, other processes); 0 on the CPU "
                             "backend.")
                         .Register(r);
  m->device_pool_reserved_ = &BuildGauge()
                                  .Name("plateau_job_device_pool_reserved_bytes")
                                  .Help(
                                      "Bytes the stream-ordered pool had reserved after the rank's latest step; 0 "
                                      "on the CPU backend.")
                                  .Register(r);
  m->mfu_ = &BuildGauge()
                 .Name("plateau_job_mfu_ratio")
                 .Help(
                     "Model FLOP/s of the latest step (recomputation not counted; over the step's time) over the "
                     "device's peak FLOP/s.")
                 .Register(r);
  m->tflops_ = &BuildGauge()
                    .Name("plateau_job_tflops")
                    .Help(
                        "Model TFLOP/s of the rank's latest step: its 1/P share of the step's model FLOPs over the "
                        "step's time (plateau_job_step_duration_seconds, the MFU's denominator; not validation or "
                        "checkpoint writes). Summed over ranks: the job's.")
                    .Register(r);
  m->state_ = &BuildGauge()
                   .Name("plateau_job_state")
                   .Help("The job's state as a state set: 1 for the current state, 0 for the others.")
                   .Register(r);
  m->heartbeat_ = &BuildGauge()
                       .Name("plateau_worker_last_heartbeat_timestamp_seconds")
                       .Help("Unix time of the worker's latest heartbeat.")
                       .Register(r);
  m->workers_ = &BuildGauge()
                     .Name("plateau_workers")
                     .Help("Registered workers by state: attached, or awaiting_reattach (a restarted coordinator "
                           "expects them back).")
                     .Register(r);
  m->slots_total_ = &BuildGauge().Name("plateau_slots_total").Help("Rank slots of the attached workers.").Register(r);
  m->slots_free_ = &BuildGauge()
                        .Name("plateau_slots_free")
                        .Help("Rank slots of the attached workers not held by a job's ranks.")
                        .Register(r);
  m->queue_ = &BuildGauge().Name("plateau_queue_length").Help("Jobs waiting to be scheduled (PENDING).").Register(r);
  m->unschedulable_ = &BuildGauge()
                           .Name("plateau_queue_unschedulable")
                           .Help("PENDING jobs that no registered worker could host.")
                           .Register(r);
  m->jobs_ = &BuildGauge().Name("plateau_jobs").Help("Jobs in the state database by state.").Register(r);
  m->submissions_ = &BuildCounter().Name("plateau_job_submissions_total").Help("Jobs submitted.").Register(r);
  m->cancels_ = &BuildCounter().Name("plateau_job_cancels_total").Help("Cancels of live jobs accepted.").Register(r);
  m->failures_ = &BuildCounter()
                      .Name("plateau_job_failures_total")
                      .Help("Jobs that ended FAILED, by Failure.Kind.")
                      .Register(r);
  m->restarts_ = &BuildCounter()
                      .Name("plateau_job_restarts_total")
                      .Help("Failed attempts that were restarted, by Failure.Kind.")
                      .Register(r);
  m->workers_lost_ = &BuildCounter()
                          .Name("plateau_workers_lost_total")
                          .Help(
                              "Registered workers declared lost: no heartbeat within --worker_timeout_s, or not "
                              "back within --reattach_timeout_s of a coordinator restart.")
                          .Register(r);
  m->store_errors_ = &BuildCounter()
                          .Name("plateau_store_errors_total")
                          .Help("Writes to the state database that failed (the coordinator then refuses changes).")
                          .Register(r);
  m->rpcs_ = &BuildCounter()
                  .Name("plateau_rpcs_total")
                  .Help("gRPC calls served, by service, method and status code.")
                  .Register(r);
  m->rpc_duration_ = &BuildHistogram()
                          .Name("plateau_rpc_duration_seconds")
                          .Help("Time from a call's arrival to its status (a stream: its whole life).")
                          .Register(r);
  // Present from the start, so that rate() and alerts see a 0 before the
  // first event rather than no series.
  m->submissions_->Add({});
  m->cancels_->Add({});
  m->store_errors_->Add({});
  m->workers_lost_->Add({});
  // Every reason too (a bounded set: Failure.Kind): a series that first
  // appears at 1 is no increase() to Prometheus, and PlateauJobFailed
  // alerts on the increase.
  for (int k = v1::Failure::Kind_MIN; k <= v1::Failure::Kind_MAX; ++k) {
    if (!v1::Failure::Kind_IsValid(k)) continue;
    const std::string reason = v1::Failure::Kind_Name(static_cast<v1::Failure::Kind>(k));
    m->failures_->Add({{"reason", reason}});
    m->restarts_->Add({{"reason", reason}});
  }
  m->SetWorkers(0, 0);
  m->SetSlots(0, 0);
  m->SetQueue(0, 0);
  m->SetJobCounts({});
  Metrics* self = m.get();
  std::map<std::string, HttpHandler> routes = {
      {"/metrics",
       [self] { return HttpResponse{200, "text/plain; version=0.0.4; charset=utf-8", self->Text()}; }},
      {"/healthz", [] { return HttpResponse{200, "text/plain; charset=utf-8", "ok\n"}; }},
      {"/readyz", [self] { return self->Readyz(); }},
  };
  std::map<std::string, HttpPrefixHandler> prefixes = {
      {"/jobs/", [self](const std::string& path, const std::string& query) { return self->JobPage(path, query); }},
  };
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(bind_address, std::move(routes), HttpServerOptions{}, std::move(prefixes));
  if (!server.ok()) {
    return absl::UnavailableError(absl::StrCat("--metrics_address=", bind_address, ": ", server.status().message()));
  }
  m->server_ = std::move(*server);
  return m;
}

std::string Metrics::Text() const { return prometheus::TextSerializer().Serialize(registry_->Collect()); }

void Metrics::SetReadiness(absl::Status status) {
  absl::MutexLock lock(&readiness_mu_);
  readiness_ = std::move(status);
}

void Metrics::SetJobPages(HttpPrefixHandler pages) {
  absl::MutexLock lock(&pages_mu_);  // waits for a page being served
  pages_ = std::move(pages);
}

HttpResponse Metrics::JobPage(const std::string& path, const std::string& query) {
  absl::MutexLock lock(&pages_mu_);
  if (!pages_) return HttpResponse{503, "text/plain; charset=utf-8", "job pages are not served yet\n"};
  return pages_(path, query);
}

HttpResponse Metrics::Readyz() {
  absl::MutexLock lock(&readiness_mu_);
  if (readiness_.ok()) return HttpResponse{200, "text/plain; charset=utf-8", "ready\n"};
  // One line, as probes log it.
  return HttpResponse{503, "text/plain; charset=utf-8",
                      absl::StrCat("not ready: ", absl::StrReplaceAll(readiness_.message(), {{"\n", " "}}), "\n")};
}

template <typename T, typename... Args>
T& Metrics::Add(prometheus::Family<T>* family, const std::string& job,
                const std::map<std::string, std::string>& labels, Args&&... args) {
  T& metric = family->Add(labels, std::forward<Args>(args)...);
  absl::MutexLock lock(&mu_);
  series_[job].emplace(&metric, [family, m = &metric] { family->Remove(m); });
  return metric;
}

void Metrics::Drop(prometheus::Family<prometheus::Gauge>* family, const std::string& job,
                   const std::map<std::string, std::string>& labels) {
  if (!family->Has(labels)) return;
  prometheus::Gauge* gauge = &family->Add(labels);  // the existing one
  absl::MutexLock lock(&mu_);
  if (auto it = series_.find(job); it != series_.end()) it->second.erase(gauge);
  family->Remove(gauge);
}

std::pair<Metrics::PeakMap::iterator, Metrics::PeakMap::iterator> Metrics::PeaksOf(const std::string& job) {
  // Keys are "job/rank/space/set": the job's run from "job/" up to "job0"
  // ('0' follows '/'), so "job-3" does not take "job-30"'s.
  return {peaks_.lower_bound(job + "/"), peaks_.lower_bound(job + "0")};
}

void Metrics::ForgetJob(const std::string& job) {
  absl::MutexLock lock(&mu_);
  auto it = series_.find(job);
  if (it == series_.end()) return;
  for (auto& [metric, remove] : it->second) remove();
  series_.erase(it);
  const auto [first, last] = PeaksOf(job);
  peaks_.erase(first, last);
}

void Metrics::OnJobState(const std::string& job, v1::JobState state) {
  for (int s = v1::PENDING; s <= v1::RESTARTING; ++s) {
    Add(state_, job, {{"job_id", job}, {"state", v1::JobState_Name(static_cast<v1::JobState>(s))}})
        .Set(s == state ? 1 : 0);
  }
}

void Metrics::OnPlan(const std::string& job, int ranks, const v1::MemoryPlan& plan) {
  {
    absl::MutexLock lock(&mu_);
    for (auto [p, last] = PeaksOf(job); p != last; ++p) {
      p->second.bytes = 0;
      p->second.gauge->Set(0);
    }
  }
  for (int r = 0; r < ranks; ++r) {
    const std::string rank = absl::StrCat(r);
    for (const v1::LiveSetBytes& ls : plan.live_sets()) {
      Add(planned_, job, {{"job_id", job}, {"rank", rank}, {"live_set", ls.live_set()}})
          .Set(static_cast<double>(ls.bytes()));
    }
    Add(planned_, job, {{"job_id", job}, {"rank", rank}, {"live_set", "total"}})
        .Set(static_cast<double>(plan.total_bytes()));
    for (const v1::LiveSetBytes& ls : plan.host_live_sets()) {
      Add(host_planned_, job, {{"job_id", job}, {"rank", rank}, {"live_set", ls.live_set()}})
          .Set(static_cast<double>(ls.bytes()));
    }
    Add(host_planned_, job, {{"job_id", job}, {"rank", rank}, {"live_set", "total"}})
        .Set(static_cast<double>(plan.host_total_bytes()));
    // A cap of 0 is none (the whole device; an uncapped host): no series,
    // and none left from an earlier plan that had one.
    for (const auto& [family, cap] :
         {std::pair{device_cap_, plan.device_memory_bytes()}, std::pair{host_cap_, plan.host_memory_bytes()}}) {
      const std::map<std::string, std::string> labels = {{"job_id", job}, {"rank", rank}};
      if (cap > 0) {
        Add(family, job, labels).Set(static_cast<double>(cap));
      } else {
        Drop(family, job, labels);
      }
    }
  }
}

void Metrics::OnStep(const std::string& job, int ranks, const v1::StepTelemetry& t) {
  const std::string rank = absl::StrCat(t.rank());
  const std::map<std::string, std::string> labels = {{"job_id", job}, {"rank", rank}};
  Add(step_, job, labels).Set(static_cast<double>(t.step()));
  Add(loss_, job, labels).Set(t.loss());
  Add(lr_, job, labels).Set(t.lr());
  if (t.has_validation_loss()) Add(validation_loss_, job, labels).Set(t.validation_loss());
  const double share = ranks > 0 ? 1.0 / ranks : 1.0;
  Add(tokens_, job, labels).Increment(static_cast<double>(t.tokens()) * share);
  Add(flops_, job, labels).Increment(t.model_flops() * share);
  // Up to an hour: a long-context step (1M tokens: ~70-140 s on an H200)
  // above the largest finite bucket reads as that bucket's bound in
  // histogram_quantile, whatever its real time.
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600};
  Add(duration_, job, labels, kBuckets).Observe(t.seconds());
  // The rank's own MFU, where it knows the peak of the step's precision
  // (the worker's flags, else the device's name: worker/device_telemetry.h);
  // absent otherwise. (The worker's fp32 flag is no stand-in: a bf16 step
  // measured against it read ~15 times its MFU.)
  if (t.mfu() > 0) Add(mfu_, job, labels).Set(t.mfu());
  // Per step, where rate(plateau_job_model_flops_total) is per wall time
  // and saw-tooths over windows shorter than a step. 0: not reported.
  if (t.tflops() > 0) Add(tflops_, job, labels).Set(t.tflops());
  // The device's own view beside the budget's accounting (0 on the CPU
  // backend): what the card holds besides the live sets.
  Add(device_used_, job, labels).Set(static_cast<double>(t.device_used_bytes()));
  Add(device_pool_reserved_, job, labels).Set(static_cast<double>(t.device_pool_reserved_bytes()));
  auto raise = [&](prometheus::Family<prometheus::Gauge>* family, absl::string_view space, const std::string& set,
                   int64_t bytes) {
    // The coordinator calls OnStep, OnPlan and ForgetJob under its own lock,
    // so the gauge is not removed between Add and the Set below.
    prometheus::Gauge& gauge = Add(family, job, {{"job_id", job}, {"rank", rank}, {"live_set", set}});
    // Set under the lock, so that OnPlan's reset and this raise are in one
    // order for the map and the gauge alike.
    absl::MutexLock lock(&mu_);
    Peak& peak = peaks_[absl::StrCat(job, "/", rank, "/", space, "/", set)];
    peak.gauge = &gauge;
    if (bytes > peak.bytes) peak.bytes = static_cast<double>(bytes);
    gauge.Set(peak.bytes);
  };
  for (const v1::LiveSetBytes& ls : t.peak()) raise(peak_, "device", ls.live_set(), ls.bytes());
  raise(peak_, "device", "total", t.peak_total_bytes());
  for (const v1::LiveSetBytes& ls : t.host_peak()) raise(host_peak_, "host", ls.live_set(), ls.bytes());
  raise(host_peak_, "host", "total", t.host_peak_total_bytes());
}

void Metrics::OnHeartbeat(const std::string& worker, absl::Time when) {
  heartbeat_->Add({{"worker", worker}}).Set(absl::ToDoubleSeconds(when - absl::UnixEpoch()));
}

void Metrics::ForgetWorker(const std::string& worker) {
  // Family::Add returns the series when it exists (and makes one that is
  // removed at once when it does not).
  heartbeat_->Remove(&heartbeat_->Add({{"worker", worker}}));
}

void Metrics::SetWorkers(int attached, int awaiting_reattach) {
  workers_->Add({{"state", "attached"}}).Set(attached);
  workers_->Add({{"state", "awaiting_reattach"}}).Set(awaiting_reattach);
}

void Metrics::SetSlots(int64_t total, int64_t free) {
  slots_total_->Add({}).Set(static_cast<double>(total));
  slots_free_->Add({}).Set(static_cast<double>(free));
}

void Metrics::SetQueue(int64_t pending, int64_t unschedulable) {
  queue_->Add({}).Set(static_cast<double>(pending));
  unschedulable_->Add({}).Set(static_cast<double>(unschedulable));
}

void Metrics::SetJobCounts(const std::map<v1::JobState, int64_t>& counts) {
  for (int s = v1::PENDING; s <= v1::RESTARTING; ++s) {
    auto it = counts.find(static_cast<v1::JobState>(s));
    jobs_->Add({{"state", v1::JobState_Name(static_cast<v1::JobState>(s))}})
        .Set(it == counts.end() ? 0 : static_cast<double>(it->second));
  }
}

void Metrics::OnSubmission() { submissions_->Add({}).Increment(); }
void Metrics::OnCancel() { cancels_->Add({}).Increment(); }
void Metrics::OnFailure(const std::string& reason) { failures_->Add({{"reason", reason}}).Increment(); }
void Metrics::OnRestart(const std::string& reason) { restarts_->Add({{"reason", reason}}).Increment(); }
void Metrics::OnStoreError() { store_errors_->Add({}).Increment(); }
void Metrics::OnWorkerLost() { workers_lost_->Add({}).Increment(); }

void Metrics::OnRpc(const std::string& service, const std::string& method, const std::string& code,
                    double seconds) {
  rpcs_->Add({{"service", service}, {"method", method}, {"code", code}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 600, 3600};
  rpc_duration_->Add({{"service", service}, {"method", method}}, kBuckets).Observe(seconds);
}

}  // namespace plateau
