// The coordinator's Prometheus metrics (prometheus-cpp), served on /metrics.
// Names follow Prometheus conventions. The training job's id is the label
// `job_id`, not `job`: Prometheus sets `job` to the scrape job's name, so a
// `job` label of ours would be overwritten (or need honor_labels).
// Per job and rank:
//   plateau_job_step, plateau_job_loss (gauges)
//   plateau_job_tokens_total, plateau_job_model_flops_total (counters; each
//     rank counts its 1/P share of the global batch, so summing over ranks
//     gives the job, and rate(plateau_job_model_flops_total) is FLOP/s over
//     wall time; tokens processed: replayed steps count again; model FLOPs
//     without recomputation, worker/trainer_options.h ModelFlopsPerStep)
//   plateau_job_step_duration_seconds (histogram; data loading, memory-
//     timeline recording and step 1's warm-up in it, validation and
//     checkpoint writes not)
//   plateau_job_peak_bytes{live_set}, plateau_job_planned_bytes{live_set}
//     (device bytes), plateau_job_host_peak_bytes{live_set},
//     plateau_job_host_planned_bytes{live_set} (host bytes; gauges of their
//     own so that queries of the device ones stay as they are)
//   plateau_job_device_cap_bytes, plateau_job_host_cap_bytes (the plan's
//     caps; only where the plan has one)
//   plateau_job_device_used_bytes, plateau_job_device_pool_reserved_bytes
//     (the device's own view after the rank's latest step; 0 on the CPU
//     backend)
//   plateau_job_mfu_ratio (only where the worker knows its device's peak)
//   plateau_job_tflops (the rank's model TFLOP/s in its latest step: its
//     share of the step's model FLOPs over the step's time, as the MFU)
// per job: plateau_job_state{state} (a state set: 1 for the current state);
// per worker: plateau_worker_last_heartbeat_timestamp_seconds (removed when
// the worker is lost, so that an alert on a stale heartbeat ends with it).
// plateau_workers_lost_total counts the losses (no labels: a worker's id is
// in the coordinator's log).
// The coordinator itself:
//   plateau_workers{state="attached"|"awaiting_reattach"}
//   plateau_slots_total, plateau_slots_free (rank slots of attached workers)
//   plateau_queue_length (PENDING jobs), plateau_queue_unschedulable (of
//     those, the ones no registered worker could host)
//   plateau_jobs{state} (jobs in the store by state)
//   plateau_job_submissions_total, plateau_job_cancels_total,
//   plateau_job_failures_total{reason} (jobs ended FAILED, by Failure.Kind),
//   plateau_job_restarts_total{reason} (failed attempts restarted); every
//     reason's series is there from 0 at the start
//   plateau_store_errors_total (failed writes to the state database)
//   plateau_rpcs_total{service,method,code}, plateau_rpc_duration_seconds
//     {service,method} (histogram; a watch lasts as long as its stream)
//
// The same HTTP port (server/http_server.h) answers the probes operators and
// Kubernetes expect: /healthz 200 while the process serves at all, /readyz
// 200 once SetReadiness(OK) and 503 with a one-line reason otherwise. Any
// other path is 404, except the pages below /jobs/ the coordinator serves
// (SetJobPages: /jobs/ID/memory, server/memory_page.h).
//
// Thread safety: every method may be called from any thread; a job's OnStep,
// OnPlan and ForgetJob in one order at a time (the coordinator calls them
// under its lock): a ForgetJob amid an OnStep of the same job would remove a
// gauge that OnStep still sets.
#ifndef PLATEAU_SERVER_METRICS_H_
#define PLATEAU_SERVER_METRICS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "plateau/v1/job.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/http_server.h"

namespace plateau {

class Metrics {
 public:
  // Serves /metrics, /healthz and /readyz on `bind_address` ("127.0.0.1:0"
  // picks a free port). Not ready until SetReadiness(OkStatus()).
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& bind_address);

  int port() const { return server_->port(); }

  // What /readyz answers from now on: 200 when OK, else 503 and the message.
  void SetReadiness(absl::Status status);
  // What paths below /jobs/ answer (the coordinator's pages,
  // server/memory_page.h); until set, and after SetJobPages(nullptr), 503.
  // Setting waits for a page being served, so that the coordinator can
  // withdraw its pages before it is destroyed.
  void SetJobPages(HttpPrefixHandler pages);
  // The exposition text of every series (what GET /metrics returns).
  std::string Text() const;

  void OnJobState(const std::string& job, v1::JobState state);
  // The planned bytes per live set, device and host, and the plan's caps,
  // for each of the job's ranks, at each placement. The job's peaks start again from 0: a restart may plan
  // smaller (its `auto` settings chosen again), and an earlier attempt's
  // peak against the new plan would read as a live set above its plan.
  void OnPlan(const std::string& job, int ranks, const v1::MemoryPlan& plan);
  // One rank's step. Its MFU is the rank's own (t.mfu(): against the peak
  // of the step's precision on its device); none where the rank knows no
  // such peak (0).
  void OnStep(const std::string& job, int ranks, const v1::StepTelemetry& t);
  void OnHeartbeat(const std::string& worker, absl::Time when);
  // Removes the worker's series (it was lost).
  void ForgetWorker(const std::string& worker);
  // A registered worker was declared lost (no heartbeat within
  // --worker_timeout_s, or not back within --reattach_timeout_s of a
  // coordinator restart).
  void OnWorkerLost();
  // The coordinator's gauges (server/coordinator.cc UpdateGauges).
  void SetWorkers(int attached, int awaiting_reattach);
  void SetSlots(int64_t total, int64_t free);
  void SetQueue(int64_t pending, int64_t unschedulable);
  void SetJobCounts(const std::map<v1::JobState, int64_t>& counts);
  void OnSubmission();
  void OnCancel();
  void OnFailure(const std::string& reason);
  void OnRestart(const std::string& reason);
  void OnStoreError();
  // One finished RPC (server/rpc_metrics.h).
  void OnRpc(const std::string& service, const std::string& method, const std::string& code,
             double seconds);
  // Removes every series of the job (a finished job, once Prometheus has
  // had time to scrape its final values), so that /metrics does not grow
  // with every job a coordinator ever ran.
  void ForgetJob(const std::string& job);

 private:
  Metrics() = default;
  // Family::Add that remembers the series under its job, for ForgetJob.
  template <typename T, typename... Args>
  T& Add(prometheus::Family<T>* family, const std::string& job,
         const std::map<std::string, std::string>& labels, Args&&... args);
  // Removes the job's gauge with these labels, if there is one.
  void Drop(prometheus::Family<prometheus::Gauge>* family, const std::string& job,
            const std::map<std::string, std::string>& labels);

  HttpResponse Readyz();
  HttpResponse JobPage(const std::string& path, const std::string& query);

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Gauge>* step_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_ = nullptr;
  prometheus::Family<prometheus::Gauge>* lr_ = nullptr;
  prometheus::Family<prometheus::Gauge>* validation_loss_ = nullptr;
  prometheus::Family<prometheus::Counter>* tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* flops_ = nullptr;
  prometheus::Family<prometheus::Histogram>* duration_ = nullptr;
  prometheus::Family<prometheus::Gauge>* peak_ = nullptr;
  prometheus::Family<prometheus::Gauge>* host_peak_ = nullptr;
  prometheus::Family<prometheus::Gauge>* planned_ = nullptr;
  prometheus::Family<prometheus::Gauge>* host_planned_ = nullptr;
  prometheus::Family<prometheus::Gauge>* device_cap_ = nullptr;
  prometheus::Family<prometheus::Gauge>* host_cap_ = nullptr;
  prometheus::Family<prometheus::Gauge>* device_used_ = nullptr;
  prometheus::Family<prometheus::Gauge>* device_pool_reserved_ = nullptr;
  prometheus::Family<prometheus::Gauge>* mfu_ = nullptr;
  prometheus::Family<prometheus::Gauge>* tflops_ = nullptr;
  prometheus::Family<prometheus::Gauge>* state_ = nullptr;
  prometheus::Family<prometheus::Gauge>* heartbeat_ = nullptr;
  prometheus::Family<prometheus::Gauge>* workers_ = nullptr;
  prometheus::Family<prometheus::Gauge>* slots_total_ = nullptr;
  prometheus::Family<prometheus::Gauge>* slots_free_ = nullptr;
  prometheus::Family<prometheus::Gauge>* queue_ = nullptr;
  prometheus::Family<prometheus::Gauge>* unschedulable_ = nullptr;
  prometheus::Family<prometheus::Gauge>* jobs_ = nullptr;
  prometheus::Family<prometheus::Counter>* submissions_ = nullptr;
  prometheus::Family<prometheus::Counter>* cancels_ = nullptr;
  prometheus::Family<prometheus::Counter>* failures_ = nullptr;
  prometheus::Family<prometheus::Counter>* restarts_ = nullptr;
  prometheus::Family<prometheus::Counter>* store_errors_ = nullptr;
  prometheus::Family<prometheus::Counter>* workers_lost_ = nullptr;
  prometheus::Family<prometheus::Counter>* rpcs_ = nullptr;
  prometheus::Family<prometheus::Histogram>* rpc_duration_ = nullptr;

  absl::Mutex mu_;
  // The largest peak each (job, rank, space, live set) has reached since
  // the job's plan was last set, and the gauge that shows it.
  struct Peak {
    double bytes = 0;
    prometheus::Gauge* gauge = nullptr;
  };
  using PeakMap = std::map<std::string, Peak>;
  PeakMap peaks_ ABSL_GUARDED_BY(mu_);
  // The entries of peaks_ that are `job`'s, [first, last).
  std::pair<PeakMap::iterator, PeakMap::iterator> PeaksOf(const std::string& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every series of a job, as the closure that removes it.
  std::map<std::string, std::map<const void*, std::function<void()>>> series_ ABSL_GUARDED_BY(mu_);

  absl::Mutex pages_mu_;
  HttpPrefixHandler pages_ ABSL_GUARDED_BY(pages_mu_);

  absl::Mutex readiness_mu_;
  absl::Status readiness_ ABSL_GUARDED_BY(readiness_mu_) = absl::UnavailableError("starting");
  // Last: destroyed first, so no handler runs on a destroyed member.
  std::unique_ptr<HttpServer> server_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_METRICS_H_
