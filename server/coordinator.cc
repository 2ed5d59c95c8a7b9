#include "server/coordinator.h"

#include <signal.h>
#include <string.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"
#include "worker/job_spec.h"
#include "worker/rank_protocol.h"

namespace plateau {
namespace {

constexpr int kDefaultPageSize = 50;
constexpr int kMaxPageSize = 1000;
constexpr size_t kMaxKvKey = 4096;
constexpr size_t kMaxKvValue = 1 << 20;

void Now(google::protobuf::Timestamp* t) {
  const absl::Time now = absl::Now();
  const int64_t ns = absl::ToUnixNanos(now);
  t->set_seconds(ns / 1000000000);
  t->set_nanos(static_cast<int32_t>(ns % 1000000000));
}

std::string DescribeBytes(int64_t b) { return absl::StrCat(b >> 20, " MiB"); }

// How much a failure explains an attempt's end: an out-of-memory or a
// crash is the cause; a peer's collective error or an agent's stop is a
// consequence of it.
constexpr int kPriorityStopped = 0, kPriorityExit = 1, kPriorityInvalid = 2, kPrioritySignal = 3,
              kPriorityOutOfMemory = 4, kPriorityWorkerLost = 3;

}  // namespace

bool IsTerminal(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED;
}

Coordinator::Coordinator(JobStore* store, Metrics* metrics, CoordinatorOptions options)
    : store_(store), metrics_(metrics), options_(options) {}

Coordinator::~Coordinator() { Stop(); }

absl::Status Coordinator::Start() {
  {
    absl::MutexLock lock(&mu_);
    // Jobs a previous coordinator left live. PENDING jobs wait again; jobs
    // that had ranks cannot be reattached yet (that arrives with fault
    // tolerance), so they fail with the reason.
    int64_t after = 0;
    bool more = true;
    while (more) {
      PLATEAU_ASSIGN_OR_RETURN(
          std::vector<v1::Job> jobs,
          store_->ListJobs(after, 500,
                           {v1::PENDING, v1::SCHEDULED, v1::RUNNING, v1::CANCELLING, v1::RESTARTING},
                           &more));
      for (v1::Job& job : jobs) {
        PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
        after = seq;
        Active& a = active_[seq];
        a.job = std::move(job);
        if (a.job.state() == v1::PENDING) {
          metrics_->OnJobState(a.job.id(), v1::PENDING);
          continue;
        }
        if (a.job.state() == v1::CANCELLING) {
          PLATEAU_RETURN_IF_ERROR(SetState(a, v1::CANCELLED, "cancelled while the coordinator restarted"));
        } else {
          v1::Failure f;
          f.set_kind(v1::Failure::WORKER_LOST);
          f.set_message("the coordinator restarted while the job had ranks; its ranks were not reattached");
          PLATEAU_RETURN_IF_ERROR(SetState(a, v1::FAILED, f.message(), &f));
        }
        active_.erase(seq);
      }
    }
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void Coordinator::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Coordinator::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.tick);
    if (stop_) break;
    Tick();
  }
}

void Coordinator::Tick() {
  ExpireWorkers();
  Schedule();
}

uint64_t Coordinator::version() {
  absl::MutexLock lock(&mu_);
  return version_;
}

uint64_t Coordinator::WaitForChange(uint64_t seen, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return version_ != seen || stop_; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  return version_;
}

absl::Status Coordinator::SetState(Active& a, v1::JobState state, const std::string& reason,
                                   const v1::Failure* failure) {
  v1::Job& job = a.job;
  job.set_state(state);
  job.set_state_reason(reason);
  if (failure != nullptr) *job.mutable_failure() = *failure;
  Now(job.mutable_update_time());
  if (state == v1::RUNNING && !job.has_start_time()) Now(job.mutable_start_time());
  if (IsTerminal(state)) Now(job.mutable_end_time());
  // The event first: a reader that sees the final state also sees its event.
  std::vector<v1::JobEvent> ev(1);
  ev[0].set_job_id(job.id());
  Now(ev[0].mutable_time());
  v1::StateChange* sc = ev[0].mutable_state_change();
  sc->set_state(state);
  sc->set_reason(reason);
  sc->set_attempt(job.attempt());
  if (failure != nullptr) *sc->mutable_failure() = *failure;
  PLATEAU_RETURN_IF_ERROR(store_->AppendEvents(ev));
  job.set_event_count(ev[0].index() + 1);
  PLATEAU_RETURN_IF_ERROR(store_->PutJob(job));
  metrics_->OnJobState(job.id(), state);
  Changed();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// JobService

absl::StatusOr<v1::PlanJobResponse> Coordinator::PlanJob(const v1::PlanJobRequest& request) {
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan, plateau::PlanJob(request.spec()));
  v1::PlanJobResponse out;
  *out.mutable_plan() = std::move(plan);
  return out;
}

absl::StatusOr<v1::SubmitJobResponse> Coordinator::SubmitJob(const v1::SubmitJobRequest& request) {
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan, AdmitJob(request.spec()));
  v1::SubmitJobResponse out;
  *out.mutable_plan() = plan;
  if (request.validate_only()) return out;
  v1::Job job;
  *job.mutable_spec() = request.spec();
  *job.mutable_plan() = plan;
  job.set_state(v1::PENDING);
  job.set_state_reason("waiting to be scheduled");
  job.mutable_progress()->set_total_steps(request.spec().steps());
  Now(job.mutable_create_time());
  *job.mutable_update_time() = job.create_time();
  absl::MutexLock lock(&mu_);
  PLATEAU_ASSIGN_OR_RETURN(job, store_->CreateJob(std::move(job)));
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
  Active& a = active_[seq];
  a.job = job;
  PLATEAU_RETURN_IF_ERROR(SetState(a, v1::PENDING, "waiting to be scheduled"));
  Schedule();
  *out.mutable_job() = active_.count(seq) ? active_[seq].job : a.job;
  return out;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(seq);
    if (it != active_.end()) return it->second.job;
  }
  return store_->GetJob(id);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const v1::ListJobsRequest& request) {
  if (request.page_size() < 0 || request.page_size() > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size: expected 0 (default ", kDefaultPageSize,
                                                   ") to ", kMaxPageSize, ", got ", request.page_size()));
  }
  int64_t after = 0;
  if (!request.page_token().empty() &&
      (!absl::SimpleAtoi(request.page_token(), &after) || after < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_token: expected a token from a previous ListJobs response, got '",
                     request.page_token().substr(0, 64), "'"));
  }
  std::vector<v1::JobState> states;
  for (int s : request.states()) {
    if (!v1::JobState_IsValid(s) || s == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("states: expected job states, got ", s));
    }
    states.push_back(static_cast<v1::JobState>(s));
  }
  const int limit = request.page_size() == 0 ? kDefaultPageSize : request.page_size();
  bool more = false;
  PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->ListJobs(after, limit, states, &more));
  v1::ListJobsResponse out;
  for (v1::Job& j : jobs) *out.add_jobs() = std::move(j);
  if (more && !jobs.empty()) {
    out.set_next_page_token(absl::StrCat(*ParseJobId(out.jobs(out.jobs_size() - 1).id())));
  }
  return out;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::MutexLock lock(&mu_);
  auto it = active_.find(seq);
  if (it == active_.end()) {
    PLATEAU_ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(id));
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is already ", v1::JobState_Name(job.state()), "; nothing to cancel"));
  }
  Active& a = it->second;
  if (a.cancel_requested) return a.job;
  a.cancel_requested = true;
  if (a.job.state() == v1::PENDING || a.job.state() == v1::RESTARTING) {
    PLATEAU_RETURN_IF_ERROR(SetState(a, v1::CANCELLED, "cancelled before it was scheduled"));
    v1::Job job = a.job;
    active_.erase(it);
    return job;
  }
  PLATEAU_RETURN_IF_ERROR(SetState(a, v1::CANCELLING, "cancel requested; stopping the ranks"));
  StopRanks(a);
  v1::Job job = a.job;
  MaybeFinish(seq);
  return job;
}

// ---------------------------------------------------------------------------
// Scheduling

void Coordinator::Schedule() {
  for (auto& [seq, a] : active_) {
    if (a.job.state() != v1::PENDING) continue;
    const v1::JobSpec& spec = a.job.spec();
    const int64_t nodes = NodesOf(spec);
    const int64_t per_node = spec.layout().ranks() / nodes;
    std::vector<Worker*> fit;
    std::vector<std::string> seen;
    for (auto& [id, w] : workers_) {
      const int free = w.caps.devices() - w.used_devices;
      seen.push_back(absl::StrCat(id, " (", BackendName(w.caps.backend()), ", ", free, "/", w.caps.devices(),
                                  " free, ", DescribeBytes(w.caps.device_memory_bytes()), " each)"));
      if (w.caps.backend() != spec.backend() || free < per_node) continue;
      if (spec.device_memory_bytes() > 0 && w.caps.device_memory_bytes() > 0 &&
          spec.device_memory_bytes() > w.caps.device_memory_bytes()) {
        continue;
      }
      if (spec.device_memory_bytes() == 0 && w.caps.device_memory_bytes() > 0 &&
          a.job.plan().total_bytes() > w.caps.device_memory_bytes()) {
        continue;
      }
      fit.push_back(&w);
    }
    if (static_cast<int64_t>(fit.size()) < nodes) {
      std::string reason = absl::StrCat(
          "waiting for ", nodes, " worker(s) with backend ", BackendName(spec.backend()), ", ", per_node,
          " free device(s) and ", DescribeBytes(spec.device_memory_bytes()), " per device; ",
          workers_.empty() ? std::string("no worker is registered")
                           : absl::StrCat("workers: ", absl::StrJoin(seen, ", ")));
      if (reason != a.job.state_reason()) SetState(a, v1::PENDING, reason).IgnoreError();
      continue;
    }
    // Most free devices first, so that jobs spread over the nodes.
    std::stable_sort(fit.begin(), fit.end(), [](Worker* x, Worker* y) {
      return x->caps.devices() - x->used_devices > y->caps.devices() - y->used_devices;
    });
    a.ranks.assign(spec.layout().ranks(), RankState{});
    a.has_failure = false;
    a.failure_priority = 0;
    a.failure.Clear();
    a.tokens = a.seconds = 0;
    a.job.clear_placement();
    a.job.clear_failure();
    std::vector<std::string> where;
    for (int64_t n = 0; n < nodes; ++n) {
      Worker& w = *fit[n];
      v1::Assignment as;
      as.set_job_id(a.job.id());
      as.set_attempt(a.job.attempt());
      *as.mutable_spec() = spec;
      as.set_kv_prefix(absl::StrCat(a.job.id(), "/attempt-", a.job.attempt()));
      v1::Placement* p = a.job.add_placement();
      p->set_worker_id(w.id);
      for (int64_t r = n * per_node; r < (n + 1) * per_node; ++r) {
        as.add_ranks(static_cast<int>(r));
        p->add_ranks(static_cast<int>(r));
        a.ranks[r].worker_id = w.id;
      }
      w.used_devices += static_cast<int>(per_node);
      w.assignments.push_back(std::move(as));
      where.push_back(absl::StrCat(w.id, " (ranks ", n * per_node, "-", (n + 1) * per_node - 1, ")"));
    }
    metrics_->OnPlan(a.job.id(), static_cast<int>(spec.layout().ranks()), a.job.plan());
    SetState(a, v1::SCHEDULED, absl::StrCat("placed on ", absl::StrJoin(where, ", ")))
        .IgnoreError();
  }
}

void Coordinator::ExpireWorkers() {
  const absl::Time now = absl::Now();
  std::vector<std::string> lost;
  for (auto& [id, w] : workers_) {
    if (now - w.last_heartbeat > options_.worker_timeout) lost.push_back(id);
  }
  for (const std::string& id : lost) {
    const double silent = absl::ToDoubleSeconds(now - workers_[id].last_heartbeat);
    workers_.erase(id);
    std::vector<int64_t> touched;
    for (auto& [seq, a] : active_) {
      bool hit = false;
      for (RankState& r : a.ranks) {
        if (r.worker_id == id && !r.gone) {
          r.gone = true;
          hit = true;
        }
      }
      if (!hit) continue;
      v1::Failure f;
      f.set_kind(v1::Failure::WORKER_LOST);
      f.set_worker_id(id);
      f.set_message(absl::StrCat("worker lost: ", id, " sent no heartbeat for ",
                                 absl::StrFormat("%.1f", silent), " s"));
      RecordFailure(a, f, kPriorityWorkerLost);
      StopRanks(a);
      touched.push_back(seq);
    }
    for (int64_t seq : touched) MaybeFinish(seq);
    Changed();
  }
}

void Coordinator::RecordFailure(Active& a, const v1::Failure& f, int priority) {
  if (a.has_failure && a.failure_priority >= priority) return;
  a.has_failure = true;
  a.failure_priority = priority;
  a.failure = f;
}

void Coordinator::StopRanks(Active& a) {
  for (const v1::Placement& p : a.job.placement()) {
    auto w = workers_.find(p.worker_id());
    if (w == workers_.end()) continue;
    // An assignment not yet delivered is withdrawn: its ranks never start.
    auto& as = w->second.assignments;
    auto undelivered = std::find_if(as.begin(), as.end(), [&](const v1::Assignment& x) {
      return x.job_id() == a.job.id() && x.attempt() == a.job.attempt();
    });
    if (undelivered != as.end()) {
      for (int r : undelivered->ranks()) a.ranks[r].gone = true;
      as.erase(undelivered);
      continue;
    }
    v1::Cancellation c;
    c.set_job_id(a.job.id());
    c.set_attempt(a.job.attempt());
    w->second.cancellations.push_back(c);
  }
}

void Coordinator::MaybeFinish(int64_t seq) {
  auto it = active_.find(seq);
  if (it == active_.end()) return;
  for (const RankState& r : it->second.ranks) {
    if (!r.gone) return;
  }
  Finish(seq);
}

void Coordinator::Finish(int64_t seq) {
  Active& a = active_[seq];
  for (const v1::Placement& p : a.job.placement()) {
    auto w = workers_.find(p.worker_id());
    if (w != workers_.end()) w->second.used_devices -= p.ranks_size();
  }
  a.job.clear_placement();
  if (a.cancel_requested) {
    SetState(a, v1::CANCELLED, "cancelled; every rank process has exited").IgnoreError();
  } else if (!a.has_failure) {
    SetState(a, v1::SUCCEEDED, absl::StrCat("all ", a.ranks.size(), " ranks finished ",
                                            a.job.spec().steps(), " steps"))
        .IgnoreError();
  } else {
    const bool restartable = a.failure.kind() == v1::Failure::RANK_CRASHED ||
                             a.failure.kind() == v1::Failure::WORKER_LOST;
    if (restartable && a.job.attempt() < a.job.spec().max_restarts()) {
      SetState(a, v1::RESTARTING,
               absl::StrCat("attempt ", a.job.attempt(), " failed (", a.failure.message(), "); restart ",
                            a.job.attempt() + 1, " of ", a.job.spec().max_restarts()),
               &a.failure)
          .IgnoreError();
      a.job.set_attempt(a.job.attempt() + 1);
      a.ranks.clear();
      SetState(a, v1::PENDING, "waiting to be scheduled (restart)").IgnoreError();
      return;
    }
    SetState(a, v1::FAILED, a.failure.message(), &a.failure).IgnoreError();
  }
  active_.erase(seq);
}

// ---------------------------------------------------------------------------
// WorkerService

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  const v1::WorkerCapabilities& c = request.capabilities();
  if (c.backend() != v1::BACKEND_CPU && c.backend() != v1::BACKEND_CUDA) {
    return absl::InvalidArgumentError("capabilities.backend: expected BACKEND_CPU or BACKEND_CUDA");
  }
  if (c.devices() < 1 || c.devices() > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("capabilities.devices: expected 1 to 4096, got ", c.devices()));
  }
  if (c.device_memory_bytes() < 0 || c.host_memory_bytes() < 0) {
    return absl::InvalidArgumentError("capabilities.device_memory_bytes: expected >= 0");
  }
  if (c.rank_address().empty()) {
    return absl::InvalidArgumentError("capabilities.rank_address: expected the address ranks listen on");
  }
  absl::MutexLock lock(&mu_);
  Worker w;
  w.id = absl::StrCat("worker-", next_worker_++);
  w.caps = c;
  w.last_heartbeat = absl::Now();
  metrics_->OnHeartbeat(w.id, w.last_heartbeat);
  v1::RegisterResponse out;
  out.set_worker_id(w.id);
  out.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  workers_[w.id] = std::move(w);
  Changed();
  Schedule();
  return out;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered (lost or unknown); register again"));
  }
  Worker& w = it->second;
  w.last_heartbeat = absl::Now();
  metrics_->OnHeartbeat(w.id, w.last_heartbeat);
  v1::HeartbeatResponse out;
  for (v1::Assignment& a : w.assignments) *out.add_assignments() = std::move(a);
  for (v1::Cancellation& c : w.cancellations) *out.add_cancellations() = std::move(c);
  w.assignments.clear();
  w.cancellations.clear();
  return out;
}

Coordinator::Active* Coordinator::FindActive(const std::string& job_id, int attempt) {
  auto seq = ParseJobId(job_id);
  if (!seq.ok()) return nullptr;
  auto it = active_.find(*seq);
  if (it == active_.end() || it->second.job.attempt() != attempt) return nullptr;
  return &it->second;
}

absl::Status Coordinator::ReportRankStatus(const v1::RankStatusRequest& request) {
  absl::MutexLock lock(&mu_);
  if (workers_.find(request.worker_id()) == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered"));
  }
  Active* a = FindActive(request.job_id(), request.attempt());
  if (a == nullptr) return absl::OkStatus();  // a finished job or an old attempt
  if (request.rank() < 0 || request.rank() >= static_cast<int>(a->ranks.size()) ||
      a->ranks[request.rank()].worker_id != request.worker_id()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(), " of ", request.job_id(),
                                                   " is not placed on ", request.worker_id()));
  }
  RankState& r = a->ranks[request.rank()];
  const int64_t seq = *ParseJobId(request.job_id());
  if (request.has_started()) {
    r.started = true;
    bool all = true;
    for (const RankState& x : a->ranks) all = all && x.started;
    if (all && a->job.state() == v1::SCHEDULED) {
      PLATEAU_RETURN_IF_ERROR(
          SetState(*a, v1::RUNNING, absl::StrCat("all ", a->ranks.size(), " ranks started")));
    }
    return absl::OkStatus();
  }
  if (!request.has_exited()) return absl::InvalidArgumentError("status: expected started or exited");
  const v1::RankExited& e = request.exited();
  r.gone = true;
  r.started = true;
  const bool failed = e.signal() != 0 || e.exit_code() != kRankExitOk;
  if (failed && !a->cancel_requested) {
    v1::Failure f;
    f.set_rank(request.rank());
    f.set_exit_code(e.exit_code());
    f.set_signal(e.signal());
    f.set_worker_id(request.worker_id());
    int priority;
    const std::string detail = e.message().empty() ? "" : absl::StrCat(": ", e.message());
    if (e.stopped_by_agent()) {
      f.set_kind(v1::Failure::RANK_CRASHED);
      f.set_message(absl::StrCat("rank ", request.rank(), " was stopped by its agent", detail));
      priority = kPriorityStopped;
    } else if (e.error_code() == "RESOURCE_EXHAUSTED" || e.exit_code() == kRankExitOutOfMemory) {
      f.set_kind(v1::Failure::OUT_OF_MEMORY);
      f.set_live_set(e.live_set());
      f.set_message(absl::StrCat("out of memory on rank ", request.rank(),
                                 e.live_set().empty() ? "" : absl::StrCat(" in live set '", e.live_set(), "'"),
                                 detail));
      priority = kPriorityOutOfMemory;
    } else if (e.signal() != 0) {
      f.set_kind(v1::Failure::RANK_CRASHED);
      f.set_message(absl::StrCat("rank ", request.rank(), " was killed by signal ", e.signal(), " (",
                                 strsignal(e.signal()), ")"));
      priority = kPrioritySignal;
    } else if (e.exit_code() == kRankExitInvalidJob) {
      f.set_kind(v1::Failure::INVALID);
      f.set_message(absl::StrCat("rank ", request.rank(), " refused the job (exit code ", e.exit_code(), ")",
                                 detail));
      priority = kPriorityInvalid;
    } else {
      f.set_kind(v1::Failure::RANK_CRASHED);
      f.set_message(absl::StrCat("rank ", request.rank(), " exited with code ", e.exit_code(), detail));
      priority = kPriorityExit;
    }
    const bool first = !a->has_failure;
    RecordFailure(*a, f, priority);
    if (first) StopRanks(*a);  // the other ranks would wait on a dead peer
  }
  MaybeFinish(seq);
  Changed();
  return absl::OkStatus();
}

absl::Status Coordinator::ReportTelemetry(v1::TelemetryRequest request) {
  absl::MutexLock lock(&mu_);
  auto w = workers_.find(request.worker_id());
  if (w == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered"));
  }
  const double peak_flops = w->second.caps.device_peak_flops();
  std::vector<v1::JobEvent> events;
  std::vector<Active*> progressed;
  for (v1::TelemetryRequest::Step& s : *request.mutable_steps()) {
    Active* a = FindActive(s.job_id(), s.telemetry().attempt());
    if (a == nullptr) continue;
    const v1::StepTelemetry& t = s.telemetry();
    metrics_->OnStep(a->job.id(), static_cast<int>(a->ranks.size()), t, peak_flops);
    if (t.rank() == 0) {
      v1::Progress* p = a->job.mutable_progress();
      if (p->step() == 0 || a->tokens == 0) p->set_first_loss(t.loss());
      p->set_step(t.step());
      p->set_total_steps(a->job.spec().steps());
      p->set_loss(t.loss());
      a->tokens += t.tokens();
      a->seconds += t.seconds();
      if (a->seconds > 0) {
        p->set_tokens_per_second(a->tokens / a->seconds);
        p->set_model_flops_per_second(t.model_flops() * (a->tokens / t.tokens()) / a->seconds);
      }
      progressed.push_back(a);
    }
    v1::JobEvent e;
    e.set_job_id(s.job_id());
    Now(e.mutable_time());
    *e.mutable_step() = std::move(*s.mutable_telemetry());
    events.push_back(std::move(e));
  }
  PLATEAU_RETURN_IF_ERROR(store_->AppendEvents(events));
  std::vector<v1::LogEntry> logs;
  for (v1::LogEntry& l : *request.mutable_logs()) {
    auto seq = ParseJobId(l.job_id());
    if (!seq.ok()) continue;
    if (l.line().size() > 16384) l.mutable_line()->resize(16384);
    if (!l.has_time()) Now(l.mutable_time());
    logs.push_back(std::move(l));
  }
  PLATEAU_RETURN_IF_ERROR(store_->AppendLogs(logs));
  for (Active* a : progressed) {
    a->job.set_event_count(store_->EventCount(a->job.id()));
    PLATEAU_RETURN_IF_ERROR(store_->PutJob(a->job));
  }
  if (!events.empty() || !logs.empty()) Changed();
  return absl::OkStatus();
}

absl::Status Coordinator::KvSet(const std::string& key, const std::string& value) {
  if (key.empty() || key.size() > kMaxKvKey) {
    return absl::InvalidArgumentError(absl::StrCat("key: expected 1 to ", kMaxKvKey, " bytes"));
  }
  if (value.size() > kMaxKvValue) {
    return absl::InvalidArgumentError(absl::StrCat("value: expected at most ", kMaxKvValue, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  kv_[key] = value;
  Changed();
  return absl::OkStatus();
}

absl::StatusOr<std::string> Coordinator::KvGet(const std::string& key, absl::Duration wait) {
  if (key.empty() || key.size() > kMaxKvKey) {
    return absl::InvalidArgumentError(absl::StrCat("key: expected 1 to ", kMaxKvKey, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  auto present = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return kv_.count(key) > 0 || stop_; };
  mu_.AwaitWithTimeout(absl::Condition(&present), std::min(wait, absl::Seconds(10)));
  auto it = kv_.find(key);
  if (it == kv_.end()) return absl::NotFoundError(absl::StrCat("key '", key.substr(0, 256), "' is not set"));
  return it->second;
}

bool Coordinator::KvCheck(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  for (const std::string& k : keys) {
    if (kv_.count(k) == 0) return false;
  }
  return true;
}

}  // namespace plateau
