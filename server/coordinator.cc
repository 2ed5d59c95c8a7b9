#include "server/coordinator.h"

#include <signal.h>
#include <string.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/status_macros.h"
#include "proto/timestamps.h"
#include "server/labels.h"
#include "server/placement.h"
#include "server/telemetry.h"
#include "worker/calibration.h"
#include "worker/job_spec.h"
#include "worker/rank_protocol.h"

namespace plateau {
namespace {

constexpr int kDefaultPageSize = 50;
constexpr int kMaxPageSize = 1000;
// A ListJobs page's stored bytes at most: 1,000 jobs of 1 MiB specs
// (kMaxJobSpecBytes) made a 1 GB page; fewer jobs come, and the page token
// continues after them.
constexpr int64_t kMaxPageBytes = int64_t{8} << 20;

// How much a failure explains an attempt's end: an out-of-memory or a
// crash is the cause; a peer's collective error or an agent's stop is a
// consequence of it.
constexpr int kPriorityStopped = 0, kPriorityExit = 1, kPriorityInvalid = 2, kPrioritySignal = 3,
              kPriorityOutOfMemory = 4, kPriorityWorkerLost = 3, kPriorityHung = 3;
// The wall-clock limit outranks what its own stop causes (the ranks'
// exits) and anything else: the job is over either way.
constexpr int kPriorityMaxDuration = 5;

constexpr int kMaxRequestIdChars = 128;

// The attempts (job id, attempt) an agent lists as running: ranks still
// running there, or exited with their reports not yet acknowledged.
std::set<std::pair<std::string, int>> ListedAttempts(
    const google::protobuf::RepeatedPtrField<v1::RunningJob>& running) {
  std::set<std::pair<std::string, int>> out;
  for (const v1::RunningJob& j : running) out.insert({j.job_id(), j.attempt()});
  return out;
}

// The priority of a failure read back from the store after a restart (the
// "stopped by its agent" distinction is not kept: it ranks as an exit).
int PriorityOf(const v1::Failure& f) {
  switch (f.kind()) {
    case v1::Failure::OUT_OF_MEMORY:
      return kPriorityOutOfMemory;
    case v1::Failure::WORKER_LOST:
      return kPriorityWorkerLost;
    case v1::Failure::RANK_HUNG:
      return kPriorityHung;
    case v1::Failure::INVALID:
      return kPriorityInvalid;
    case v1::Failure::MAX_DURATION_EXCEEDED:
      return kPriorityMaxDuration;
    default:
      return f.signal() != 0 ? kPrioritySignal : kPriorityExit;
  }
}

// What a job's `auto` settings are chosen with at submit and plan
// (worker/auto_spec.h): the calibration of an attached worker of the spec's
// backend, one that has the job's ranks per node if any has, the first by
// id among equals; none (the default curve) when no such worker has
// reported one. Placement chooses them again on the workers it picks
// (Schedule, PlacementAutoContext).
AutoContext AutoContextFor(const std::vector<WorkerSlots>& workers, const v1::JobSpec& spec) {
  AutoContext context;
  if (!HasAutoSettings(spec)) return context;
  const int64_t per_node = spec.layout().ranks() / std::max<int64_t>(1, NodesOf(spec));
  const WorkerSlots* pick = nullptr;
  for (const WorkerSlots& w : workers) {
    if (w.caps.backend() != spec.backend() || !w.caps.has_calibration()) continue;
    const bool hosts = w.caps.devices() >= per_node;
    if (pick == nullptr || (hosts && pick->caps.devices() < per_node)) pick = &w;
  }
  if (pick == nullptr) return context;
  context.calibration = pick->caps.calibration();
  context.worker = pick->caps.name().empty() ? pick->id : absl::StrCat(pick->id, " (", pick->caps.name(), ")");
  context.device_memory_bytes = pick->caps.device_memory_bytes();
  // The node's host memory is shared by the job's ranks there.
  context.host_memory_bytes = pick->caps.host_memory_bytes() / std::max<int64_t>(1, per_node);
  return context;
}

// A MAX_DURATION_EXCEEDED failure's message. `reached_step`: the job's
// step when the limit fired (-1: not known, a restarted coordinator's
// attempt or one between attempts); the job's progress is the step it got
// to. `stopped`: every rank is gone (the final reason), else being stopped.
std::string MaxDurationMessage(const v1::Job& job, int64_t reached_step, bool stopped) {
  const int64_t step = job.progress().step();
  const std::string head =
      absl::StrCat("ran for its max_duration_s (", absl::FormatDuration(absl::Seconds(job.spec().max_duration_s())),
                   " from its first start, attempt ", job.attempt());
  if (stopped && reached_step >= 0 && reached_step != step) {
    return absl::StrCat(head, "): reached at step ", reached_step, ", stopped at step ", step, " of ",
                        job.spec().steps(), "; its ranks were stopped");
  }
  return absl::StrCat(head, ", step ", step, " of ", job.spec().steps(),
                      stopped ? "); its ranks were stopped" : "); stopping its ranks");
}

}  // namespace

std::string LogTime() { return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()); }

absl::Status CheckRequestId(const std::string& id) {
  const bool id_ok = id.size() <= static_cast<size_t>(kMaxRequestIdChars) &&
                     std::all_of(id.begin(), id.end(), [](char c) {
                       return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
                              c == ':' || c == '-';
                     });
  if (!id_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request_id: expected 1 to ", kMaxRequestIdChars, " characters of [A-Za-z0-9._:-] (a UUID fits), got '",
        absl::CHexEscape(id.substr(0, 64)), id.size() > 64 ? "..." : "", "' (", id.size(), " characters)"));
  }
  return absl::OkStatus();
}

namespace {

// A page token: the last listed job's seq, "n"-prefixed for a newest-first
// listing, so that a token is never read in the other order, then "." and
// a hash of the filters (FiltersHash), so that a page asked for with other
// filters is refused instead of mixing two listings.
std::string FiltersHash(const v1::ListJobsRequest& r) {
  std::vector<int> states(r.states().begin(), r.states().end());
  std::sort(states.begin(), states.end());
  states.erase(std::unique(states.begin(), states.end()), states.end());
  const std::string canonical = absl::StrCat(absl::StrJoin(states, ","), "|", r.label_selector());
  uint32_t h = 2166136261u;  // FNV-1a: stable across builds and restarts
  for (unsigned char c : canonical) h = (h ^ c) * 16777619u;
  return absl::StrFormat("%08x", h);
}
std::string PageToken(int64_t seq, const v1::ListJobsRequest& r) {
  return absl::StrCat(r.newest_first() ? "n" : "", seq, ".", FiltersHash(r));
}

// " by CALLER" for the coordinator's log; "" when the call came from inside.
std::string By(const std::string& caller) { return caller.empty() ? "" : absl::StrCat(" by ", caller); }

// The event of `job`'s state as it now is (state, reason, attempt, the
// unschedulable mark), with `failure` when given; timed now.
v1::JobEvent StateChangeEvent(const v1::Job& job, const v1::Failure* failure) {
  v1::JobEvent ev;
  ev.set_job_id(job.id());
  Now(ev.mutable_time());
  v1::StateChange* sc = ev.mutable_state_change();
  sc->set_state(job.state());
  sc->set_reason(job.state_reason());
  sc->set_attempt(job.attempt());
  sc->set_unschedulable(job.unschedulable());
  if (failure != nullptr) *sc->mutable_failure() = *failure;
  return ev;
}

}  // namespace

bool IsTerminal(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED;
}

Coordinator::Coordinator(JobStore* store, Metrics* metrics, CoordinatorOptions options)
    : store_(store), metrics_(metrics), options_(options),
      registry_(options.worker_timeout, options.reattach_timeout),
      rendezvous_(store) {}

Coordinator::~Coordinator() { Stop(); }

absl::Status Coordinator::Start() {
  {
    absl::MutexLock lock(&mu_);
    started_ = absl::Now();
    next_sweep_ = started_;
    PLATEAU_RETURN_IF_ERROR(rendezvous_.Load());
    PLATEAU_ASSIGN_OR_RETURN(job_counts_, store_->CountJobsByState());
    int64_t restored = 0;
    // Jobs a previous coordinator left live: PENDING ones wait again, the
    // others are re-attached (Restore).
    int64_t after = 0;
    bool more = true;
    std::set<int64_t> unreadable;  // live rows that do not parse
    while (more) {
      std::vector<int64_t> corrupt;
      JobQuery live;
      live.cursor = after;
      live.limit = 500;
      live.states = {v1::PENDING, v1::SCHEDULED, v1::RUNNING, v1::CANCELLING, v1::RESTARTING};
      live.corrupt = &corrupt;
      PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->ListJobs(live, &more));
      unreadable.insert(corrupt.begin(), corrupt.end());
      for (v1::Job& job : jobs) {
        PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
        after = seq;
        // A corrupt record of one job fails that job, not the start: the
        // coordinator would otherwise never start again (and a live job
        // cannot be deleted), with every other job stuck behind it.
        const absl::Status r = Restore(seq, std::move(job));
        if (absl::IsDataLoss(r)) {
          PLATEAU_RETURN_IF_ERROR(FailCorruptJob(seq, r));
          continue;
        }
        PLATEAU_RETURN_IF_ERROR(r);
        ++restored;
      }
    }
    for (int64_t seq : unreadable) PLATEAU_RETURN_IF_ERROR(FailUnreadableJob(seq));
    // Deletes a previous coordinator began and did not finish (it stopped
    // or died between their parts): finished here, by the ticks
    // (ResumeDeletes), as wanted work. Left, the job read as swept with
    // rows still stored, and the retention sweep skipped it.
    PLATEAU_ASSIGN_OR_RETURN(const std::vector<UnfinishedDelete> unfinished, store_->UnfinishedDeletes());
    for (const UnfinishedDelete& d : unfinished) {
      absl::StatusOr<int64_t> seq = ParseJobId(d.job_id);
      // A live job is never being deleted (DeleteJob refuses it), and every
      // id it records parses: such a row is none DeleteJob wrote (a hand
      // edit, a restored backup). Forgotten, not kept: kept, it would delete
      // the live job unasked at a restart after it ends.
      if (!seq.ok() || active_.count(*seq) > 0) {
        Say(absl::StrCat("forgetting a record of a delete of '", d.job_id, "' no DeleteJob could have made (",
                         seq.ok() ? "the job is live" : "not a job id", ")"));
        PLATEAU_RETURN_IF_ERROR(store_->ForgetDelete(d.job_id));
        continue;
      }
      absl::StatusOr<v1::JobState> state = store_->RecordedState(d.job_id);
      if (absl::IsNotFound(state.status())) {
        // Gone already: only its record of the delete is left (and any
        // rendezvous keys, were the delete older than their ordering).
        PLATEAU_RETURN_IF_ERROR(rendezvous_.DeleteJob(d.job_id));
        const absl::Status gone = store_->DeleteJob(d.job_id);
        if (!absl::IsNotFound(gone)) PLATEAU_RETURN_IF_ERROR(gone);
        continue;
      }
      if (!state.ok()) {
        Say(absl::StrCat("cannot finish the delete of ", d.job_id,
                         " (cut short by a restart): ", state.status().message()));
        continue;
      }
      const absl::StatusOr<v1::Job> job = store_->GetJob(d.job_id);
      resumed_deletes_[*seq] = ResumedDelete{d.caller, *state, job.ok() ? job->event_count() : -1};
      deleting_.insert(*seq);
      Say(absl::StrCat(d.job_id, ": finishing its delete", By(d.caller), ", cut short by a restart"));
    }
    // What the retention sweep will clear: the finished jobs whose data is
    // still stored (one read of them, here; a row that does not parse is
    // left to the listings that name it).
    if (options_.retention > absl::ZeroDuration()) {
      after = 0;
      more = true;
      while (more) {
        std::vector<int64_t> corrupt;
        JobQuery finished;
        finished.cursor = after;
        finished.limit = 500;
        finished.states = {v1::SUCCEEDED, v1::FAILED, v1::CANCELLED};
        finished.corrupt = &corrupt;
        PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->ListJobs(finished, &more));
        for (const v1::Job& job : jobs) {
          PLATEAU_ASSIGN_OR_RETURN(after, ParseJobId(job.id()));
          if (!job.has_events_deleted_time() && job.has_end_time()) unswept_.emplace(TimeOf(job.end_time()), after);
        }
        if (!corrupt.empty()) after = std::max(after, corrupt.back());
      }
    }
    // The states as stored now (a replaced row's state was counted live).
    if (!unreadable.empty()) {
      PLATEAU_ASSIGN_OR_RETURN(job_counts_, store_->CountJobsByState());
    }
    if (restored > 0) {
      Say(absl::StrCat("recovered ", restored, " live job(s) from the state database; their workers have ",
                       absl::FormatDuration(options_.reattach_timeout), " to register again"));
    }
    UpdateGauges();
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

absl::Status Coordinator::Restore(int64_t seq, v1::Job job) {
  LiveJob& a = active_[seq];
  a.job = std::move(job);
  const v1::JobState state = a.job.state();
  metrics_->OnJobState(a.job.id(), state);
  if (state == v1::PENDING) return absl::OkStatus();
  if (state == v1::RESTARTING) {  // stopped between the two halves of Finish
    // The ended attempt's steps that were not yet events (Finish writes
    // them before RESTARTING, so normally none).
    a.ranks.assign(a.job.spec().layout().ranks(), RankState{});
    PLATEAU_RETURN_IF_ERROR(RestoreSteps(a, /*flush=*/true));
    a.ranks.clear();
    a.job.set_attempt(a.job.attempt() + 1);
    a.job.clear_placement();
    return SetState(a, v1::PENDING, "waiting to be scheduled (restart)");
  }
  const absl::Time now = absl::Now();
  const int64_t ranks = a.job.spec().layout().ranks();
  a.ranks.assign(ranks, RankState{});
  for (const v1::Placement& p : a.job.placement()) {
    registry_.Expect(p.worker_id(), now);
    // A job placed by a coordinator from before Job.hosted_by has none
    // recorded: its current workers are its hosts (written with its next
    // state change).
    if (std::find(a.job.hosted_by().begin(), a.job.hosted_by().end(), p.worker_id()) == a.job.hosted_by().end()) {
      a.job.add_hosted_by(p.worker_id());
    }
    for (int r : p.ranks()) {
      if (r < 0 || r >= ranks) {
        return absl::DataLossError(absl::StrCat("state database: ", a.job.id(), " places rank ", r, " of ", ranks));
      }
      a.ranks[r].worker_id = p.worker_id();
      a.ranks[r].started = state == v1::RUNNING;
      a.ranks[r].last_progress = now + options_.reattach_timeout;
    }
    for (int r : p.exited_ranks()) {
      if (r >= 0 && r < ranks) a.ranks[r].gone = true;
    }
  }
  if (a.job.has_failure()) {
    a.has_failure = true;
    a.failure = a.job.failure();
    a.failure_priority = PriorityOf(a.failure);
    // Still held: each worker re-registering is heard from (Register), one
    // that does not come back is lost, as before the restart.
    a.judging.insert(a.job.failure_held_for().begin(), a.job.failure_held_for().end());
  }
  metrics_->OnPlan(a.job.id(), static_cast<int>(ranks), a.job.plan());
  PLATEAU_RETURN_IF_ERROR(RestoreSteps(a, /*flush=*/false));
  Say(absl::StrCat(a.job.id(), " ", v1::JobState_Name(state), " attempt ", a.job.attempt(),
                   ": waiting for its workers to register again (",
                   absl::StrJoin(a.job.placement(), ", ",
                                 [](std::string* out, const v1::Placement& p) { out->append(p.worker_id()); }),
                   ")"));
  if (state == v1::CANCELLING) {
    a.cancel_requested = true;
    StopRanks(a);
  } else if (a.has_failure) {
    StopRanks(a);  // the attempt was already ending
  }
  MaybeFinish(seq);
  return absl::OkStatus();
}

absl::Status Coordinator::FailCorruptJob(int64_t seq, const absl::Status& why) {
  LiveJob& a = active_.at(seq);
  v1::Failure f;
  f.set_kind(v1::Failure::STATE_CORRUPT);
  f.set_message(absl::StrCat("the coordinator could not recover this job at its restart: ", why.message(),
                             "; its ranks, if any still run, are stopped when their workers register"));
  a.ranks.clear();
  // As Finish ends an attempt: its placement and its rendezvous keys go
  // (its workers, expected back by Restore, are not counted busy with it).
  a.job.clear_placement();
  Write(rendezvous_.DeleteAttempt(a.job.id(), a.job.attempt()),
        absl::StrCat("delete the rendezvous keys ", AttemptPrefix(a.job.id(), a.job.attempt()), "/"));
  PLATEAU_RETURN_IF_ERROR(SetState(a, v1::FAILED, f.message(), &f));
  std::fprintf(stderr, "%s plateau_coordinator: %s: %s\n", LogTime().c_str(), a.job.id().c_str(), f.message().c_str());
  active_.erase(seq);
  return absl::OkStatus();
}

absl::Status Coordinator::FailUnreadableJob(int64_t seq) {
  v1::Job job;
  job.set_id(JobIdOf(seq));
  v1::Failure* f = job.mutable_failure();
  f->set_kind(v1::Failure::STATE_CORRUPT);
  f->set_message(absl::StrCat(
      "the coordinator could not read this job's record at its restart (its row in table jobs does not parse): "
      "this record, FAILED, replaces it; its spec is lost (its events and logs stay); its ranks, if any still "
      "run, are stopped when their workers register"));
  job.set_state(v1::FAILED);
  job.set_state_reason(f->message());
  Now(job.mutable_update_time());
  *job.mutable_end_time() = job.update_time();
  v1::JobEvent ev = StateChangeEvent(job, f);
  PLATEAU_RETURN_IF_ERROR(Written(store_->PutJobWithEvent(job, ev), absl::StrCat("record ", job.id(), " as FAILED")));
  // Its attempt is not known: every attempt's rendezvous keys go.
  Write(rendezvous_.DeleteJob(job.id()), absl::StrCat("delete the rendezvous keys ", job.id(), "/"));
  metrics_->OnJobState(job.id(), v1::FAILED);
  // As SetState does for every other job that fails: PlateauJobFailed sees
  // it, and its series leave (they would otherwise stay until the next
  // restart, FAILED).
  metrics_->OnFailure(v1::Failure::Kind_Name(f->kind()));
  ForgetMetricsLater(job.id());
  std::fprintf(stderr, "%s plateau_coordinator: %s: %s\n", LogTime().c_str(), job.id().c_str(), f->message().c_str());
  return absl::OkStatus();
}

void Coordinator::ForgetMetricsLater(const std::string& job_id) {
  if (options_.metrics_retention > absl::ZeroDuration()) {
    forget_.emplace_back(absl::Now() + options_.metrics_retention, job_id);
  }
}

absl::Status Coordinator::RestoreSteps(LiveJob& a, bool flush) {
  // Resume after the attempt's latest step event; the reports after it are
  // pending again (or, in a finished attempt, written now).
  int64_t emitted = 0;
  absl::StatusOr<v1::JobStepSummary> last = store_->LastStepSummary(a.job.id());
  if (last.ok() && last->attempt() == a.job.attempt()) emitted = last->step();
  if (!last.ok() && !absl::IsNotFound(last.status())) return last.status();
  PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::StepTelemetry> reports,
                           store_->ReadRankSteps(a.job.id(), a.job.attempt(), emitted + 1, INT64_MAX));
  std::vector<v1::JobEvent> events = plateau::RestoreSteps(a, reports, emitted);
  if (flush) {
    std::vector<v1::JobEvent> rest = FlushSteps(a);
    events.insert(events.end(), rest.begin(), rest.end());
  }
  WriteSteps(a, std::move(events));
  return store_error_;
}

void Coordinator::WriteSteps(LiveJob& a, std::vector<v1::JobEvent> events) {
  if (events.empty()) return;
  Write(store_->AppendEvents(events), absl::StrCat("append ", a.job.id(), "'s step events"));
  a.job.set_event_count(events.back().index() + 1);
  Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s progress"));
  Changed(a.job.id());
}

void Coordinator::Say(const std::string& line) {
  if (options_.log) {
    options_.log(line);
    return;
  }
  // One line per event, with the time: journald adds its own, a plain file
  // or a terminal has none.
  std::printf("%s plateau_coordinator: %s\n", LogTime().c_str(), line.c_str());
  std::fflush(stdout);
}

void Coordinator::UpdateGauges() {
  int attached = 0, awaiting = 0;
  int64_t total = 0, free = 0;
  for (const auto& [id, w] : registry_.all()) {
    if (!w.attached) {
      ++awaiting;
      continue;
    }
    ++attached;
    total += w.caps.devices();
    if (!w.leaving) free += std::max(0, w.caps.devices() - w.used_devices);  // a leaving worker takes no work
  }
  metrics_->SetWorkers(attached, awaiting);
  metrics_->SetSlots(total, free);
  int64_t pending = 0, unschedulable = 0;
  for (const auto& [seq, a] : active_) {
    if (a.job.state() != v1::PENDING) continue;
    ++pending;
    if (a.job.unschedulable()) ++unschedulable;
  }
  metrics_->SetQueue(pending, unschedulable);
  metrics_->SetJobCounts(job_counts_);
}

// The rows the retention sweep deletes per tick (one transaction, under the
// lock: ~20 ms at the 2.1 s per 2 M rows measured).
constexpr int64_t kSweepRowsPerTick = 20000;

bool Coordinator::SweepJob(v1::Job& job, int64_t* budget) {
  // In parts of at most the tick's budget: a job of millions of rank
  // reports deleted at once held this lock for seconds (2 M rows: 2.1 s),
  // past the agents' lease, which then froze every running rank.
  int64_t deleted = 0;
  absl::StatusOr<bool> done = store_->DeleteJobDataPart(job.id(), std::max<int64_t>(1, *budget), &deleted);
  Write(done.status(), absl::StrCat("delete ", job.id(), "'s events and logs (retention)"));
  if (!store_error_.ok()) return false;
  *budget -= std::max<int64_t>(1, deleted);  // the job's own record below counts as one
  if (!*done) return false;
  Now(job.mutable_events_deleted_time());
  Write(store_->PutJob(job), absl::StrCat("record ", job.id(), "'s deleted events"));
  if (!store_error_.ok()) return false;
  Say(absl::StrCat(job.id(), ": removed its ", job.event_count(), " event(s), logs and memory timelines (",
                   v1::JobState_Name(job.state()), " since ",
                   absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", TimeOf(job.end_time()), absl::UTCTimeZone()),
                   ", --retention ", absl::FormatDuration(options_.retention), ")"));
  Changed();
  return true;
}

void Coordinator::ResumeDeletes(int64_t* budget) {
  while (!resumed_deletes_.empty() && *budget > 0) {
    auto it = resumed_deletes_.begin();
    const int64_t seq = it->first;
    const std::string id = JobIdOf(seq);
    int64_t rows = 0;
    absl::StatusOr<bool> done = store_->DeleteJobDataPart(id, *budget, &rows);
    Write(done.status(), absl::StrCat("delete ", id, "'s events, logs and reports (its delete, resumed)"));
    if (!store_error_.ok()) return;
    *budget -= std::max<int64_t>(1, rows);  // the record below counts as one
    ++it->second.parts;
    if (!*done) return;  // more parts at the next tick
    const ResumedDelete d = std::move(it->second);
    resumed_deletes_.erase(it);
    const absl::Status finished =
        FinishDelete(seq, d.state, d.caller, d.event_count,
                     absl::StrCat("; its delete, cut short by a restart, finished in ", d.parts, " part(s)"));
    if (!finished.ok()) return;  // frozen (Written)
  }
}

absl::Status Coordinator::FinishDelete(int64_t seq, v1::JobState state, const std::string& caller, int64_t event_count,
                                       const std::string& how) {
  const std::string id = JobIdOf(seq);
  deleting_.erase(seq);
  // Any rendezvous key left (an attempt ended at a restart may have kept
  // its) goes with the job, first: a kill between the two then leaves the
  // record, whose delete the next start finishes (keys included), not keys
  // no record names, read at every start for good.
  Write(rendezvous_.DeleteJob(id), absl::StrCat("delete the rendezvous keys ", id, "/"));
  PLATEAU_RETURN_IF_ERROR(Written(store_->DeleteJob(id), absl::StrCat("delete ", id)));
  if (--job_counts_[state] <= 0) job_counts_.erase(state);
  metrics_->ForgetJob(id);
  Say(absl::StrCat(id, " deleted", By(caller), " (", v1::JobState_Name(state),
                   event_count >= 0 ? absl::StrCat(", ", event_count, " event(s)") : "; its record was corrupt", how,
                   ")"));
  job_versions_.erase(id);
  Changed();  // its watchers end (NOT_FOUND)
  return absl::OkStatus();
}

void Coordinator::SweepRetention(int64_t budget) {
  const absl::Time now = absl::Now();
  if (options_.retention <= absl::ZeroDuration() || now < next_sweep_) return;
  // One budget of rows a tick, whatever the jobs: many due at once (the
  // first start with --retention on an old database) go over several
  // ticks, the first due first, a job of many rows in parts. (The tick's
  // budget, less what resumed deletes took.)
  const absl::Time cutoff = now - options_.retention;
  while (!unswept_.empty() && unswept_.begin()->first <= cutoff) {
    if (budget <= 0) {
      next_sweep_ = now;  // on at the next tick
      return;
    }
    const int64_t seq = unswept_.begin()->second;
    absl::StatusOr<v1::Job> job = store_->GetJob(JobIdOf(seq));
    if (!job.ok() || job->has_events_deleted_time()) {
      // Deleted meanwhile (NOT_FOUND), being deleted (DeleteJob marks it
      // first), or a record that does not parse (said; `plateauctl delete`
      // removes it).
      if (!job.ok() && !absl::IsNotFound(job.status())) {
        Say(absl::StrCat("retention sweep: ", job.status().message()));
      }
      unswept_.erase(unswept_.begin());
      continue;
    }
    if (!SweepJob(*job, &budget)) {
      if (store_error_.ok()) next_sweep_ = now;  // more parts at the next tick
      return;
    }
    unswept_.erase(unswept_.begin());
  }
  // Often enough that nothing outlives its retention by more than a tenth
  // of it, at most every 10 minutes.
  next_sweep_ = now + std::clamp(options_.retention / 10, options_.tick, absl::Minutes(10));
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
  // Frozen after a failed store write: every further change would widen the
  // gap between memory and the database (Written).
  if (!store_error_.ok()) return;
  ExpireWorkers();
  CheckProgress();
  CheckMaxDuration();
  Schedule();
  // One budget of rows a tick for both, so that the lock is held for one
  // part's time at most: the deletes a restart cut short first (wanted
  // work, begun), then the retention sweep.
  int64_t budget = kSweepRowsPerTick;
  ResumeDeletes(&budget);
  SweepRetention(budget);
  UpdateGauges();
  const absl::Time now = absl::Now();
  while (!forget_.empty() && forget_.front().first <= now) {
    metrics_->ForgetJob(forget_.front().second);
    forget_.pop_front();
  }
}

bool Coordinator::stopping() {
  absl::MutexLock lock(&mu_);
  return stop_;
}

void Coordinator::Changed(const std::string& job_id) {
  const absl::StatusOr<int64_t> seq = ParseJobId(job_id);
  if (seq.ok() && active_.count(*seq) > 0) ++job_versions_[job_id];
}

Coordinator::ChangeStamp Coordinator::JobVersion(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = job_versions_.find(job_id);
  return {it == job_versions_.end() ? 0 : it->second, version_};
}

Coordinator::ChangeStamp Coordinator::WaitForJobChange(const std::string& job_id, ChangeStamp seen,
                                                       absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto stamp = [this, &job_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = job_versions_.find(job_id);
    return ChangeStamp{it == job_versions_.end() ? 0 : it->second, version_};
  };
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !(stamp() == seen) || stop_; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  return stamp();
}

absl::Status Coordinator::SetState(LiveJob& a, v1::JobState state, const std::string& reason,
                                   const v1::Failure* failure) {
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen: the store is behind memory
  v1::Job& job = a.job;
  const v1::JobState was = job.state();
  const std::string was_reason = job.state_reason();
  job.set_state(state);
  job.set_state_reason(reason);
  if (state != v1::PENDING) {
    job.clear_unschedulable();
    job.clear_unschedulable_since();
  }
  if (failure != nullptr) *job.mutable_failure() = *failure;
  Now(job.mutable_update_time());
  if (state == v1::RUNNING && !job.has_start_time()) Now(job.mutable_start_time());
  if (IsTerminal(state)) Now(job.mutable_end_time());
  // The event and the job in one transaction: a reader that sees the new
  // state also sees its event, and a coordinator killed mid-change restarts
  // with both or neither (an event without its state would be written
  // again: a second final event, or a cancelled job run after all).
  v1::JobEvent ev = StateChangeEvent(job, failure);
  const std::string what = absl::StrCat("record ", job.id(), " as ", v1::JobState_Name(state));
  PLATEAU_RETURN_IF_ERROR(Written(store_->PutJobWithEvent(job, ev), what));
  metrics_->OnJobState(job.id(), state);
  if (was != state) {
    if (--job_counts_[was] <= 0) job_counts_.erase(was);
    ++job_counts_[state];
  }
  if (was != state || was_reason != reason) {
    Say(absl::StrCat(job.id(), " ", was == state ? "" : absl::StrCat(v1::JobState_Name(was), " -> "),
                     v1::JobState_Name(state), " (attempt ", job.attempt(), "): ", reason));
  }
  if (state == v1::FAILED) {
    metrics_->OnFailure(v1::Failure::Kind_Name(failure != nullptr ? failure->kind() : job.failure().kind()));
  } else if (state == v1::RESTARTING) {
    metrics_->OnRestart(v1::Failure::Kind_Name(failure != nullptr ? failure->kind() : job.failure().kind()));
  }
  if (IsTerminal(state) && options_.retention > absl::ZeroDuration()) {
    if (auto seq = ParseJobId(job.id()); seq.ok()) unswept_.emplace(TimeOf(job.end_time()), *seq);
  }
  if (IsTerminal(state)) {
    ForgetMetricsLater(job.id());
    // Its counter leaves with it (the map holds the live jobs'), so every
    // stream wakes once: rare, one per job's end.
    job_versions_.erase(job.id());
    Changed();
  } else {
    Changed(job.id());
  }
  return absl::OkStatus();
}

void Coordinator::Log(const std::string& job_id, int attempt, const std::string& line) {
  std::vector<v1::LogEntry> l(1);
  l[0].set_job_id(job_id);
  l[0].set_attempt(attempt);
  l[0].set_rank(-1);
  l[0].set_stream("coordinator");
  l[0].set_line(line);
  Now(l[0].mutable_time());
  Write(store_->AppendLogs(l), absl::StrCat("append a log line of ", job_id));
  Changed(job_id);
}

absl::Status Coordinator::Written(absl::Status s, absl::string_view what) {
  if (s.ok()) return s;
  metrics_->OnStoreError();
  if (store_error_.ok()) {
    store_error_ = absl::UnavailableError(absl::StrCat(
        "the coordinator's state database failed to ", what, " (", s.message(),
        "); its memory may now differ from the database, so it refuses changes and reports not "
        "ready: restart it (it recovers every job from the database)"));
    std::fprintf(stderr, "%s plateau_coordinator: %s\n", LogTime().c_str(), store_error_.ToString().c_str());
    metrics_->SetReadiness(store_error_);  // /readyz: 503 with the reason
    Changed();
  }
  return store_error_;
}

void Coordinator::Transition(LiveJob& a, v1::JobState state, const std::string& reason,
                             const v1::Failure* failure) {
  // SetState records a failed write (Written); a background transition has
  // no request to fail.
  SetState(a, state, reason, failure).IgnoreError();
}

void Coordinator::Write(absl::Status s, absl::string_view what) {
  // A failure is recorded in store_error_ (not ready, changes refused);
  // the caller has no request to fail.
  Written(std::move(s), what).IgnoreError();
}

absl::Status Coordinator::Health() {
  absl::MutexLock lock(&mu_);
  return store_error_;
}

// ---------------------------------------------------------------------------
// JobService

std::function<absl::Status()> Coordinator::PlanStillWanted(const StillWanted& still_wanted, const char* call) const {
  if (!options_.between_plan_shapes && !still_wanted) return nullptr;
  return [this, still_wanted, call]() -> absl::Status {
    if (options_.between_plan_shapes) options_.between_plan_shapes();
    if (!still_wanted) return absl::OkStatus();
    absl::Status wanted = still_wanted();
    if (wanted.ok()) return wanted;
    return absl::Status(wanted.code(), absl::StrCat(wanted.message(), "; ", call,
                                                    " stopped planning the spec (its N_max and what-if searches)"));
  };
}

absl::StatusOr<v1::PlanJobResponse> Coordinator::PlanJob(const v1::PlanJobRequest& request,
                                                         const StillWanted& still_wanted) {
  // What a submit of the spec would answer: the rules for new jobs too.
  PLATEAU_RETURN_IF_ERROR(ValidateNewJobSpec(request.spec()));
  std::vector<WorkerSlots> workers;
  {
    absl::MutexLock lock(&mu_);
    workers = registry_.Slots();
  }
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan,
                           plateau::PlanJob(request.spec(), AutoContextFor(workers, request.spec()),
                                            PlanStillWanted(still_wanted, "PlanJob")));
  v1::PlanJobResponse out;
  *out.mutable_plan() = std::move(plan);
  return out;
}

absl::StatusOr<v1::SubmitJobResponse> Coordinator::SubmitJob(const v1::SubmitJobRequest& request,
                                                             const std::string& caller,
                                                             const StillWanted& still_wanted) {
  // The spec's own fields, labels and limits included, are AdmitJob's
  // (worker/job_spec.h); the request id is the coordinator's.
  PLATEAU_RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  const bool idempotent = !request.request_id().empty() && !request.validate_only();
  // A retry is answered from the store before anything is planned: the job
  // it returns is the one the first request created, whatever the workers
  // offer now.
  if (idempotent) {
    absl::MutexLock lock(&mu_);
    PLATEAU_ASSIGN_OR_RETURN(std::optional<v1::SubmitJobResponse> again, Resubmitted(request));
    if (again.has_value()) return *std::move(again);
  }
  // The rules for new jobs only (worker/job_spec.h): a job stored before
  // one was tightened is placed and run without them, and its retry is
  // answered above.
  PLATEAU_RETURN_IF_ERROR(ValidateNewJobSpec(request.spec()));
  // The `auto` settings are chosen here, once, and kept in the job's plan:
  // every attempt's ranks run these values (AssignmentFor).
  std::vector<WorkerSlots> workers;
  {
    absl::MutexLock lock(&mu_);
    workers = registry_.Slots();
  }
  // Asked only while it plans, and only where no one can ask for the
  // result again: a submit with a request id plans to its end and stores
  // the job whoever waits, so that a retry of it (the client's own deadline
  // passed first: a slow plan on a loaded coordinator) finds the job
  // instead of starting a plan that stops again at its deadline.
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan,
                           AdmitJob(request.spec(), AutoContextFor(workers, request.spec()),
                                    PlanStillWanted(idempotent ? StillWanted() : still_wanted, "SubmitJob")));
  v1::SubmitJobResponse out;
  *out.mutable_plan() = plan;
  if (request.validate_only()) return out;
  v1::Job job;
  *job.mutable_spec() = request.spec();
  *job.mutable_plan() = plan;
  job.set_request_id(request.request_id());
  job.set_submitted_by(caller);
  job.set_state(v1::PENDING);
  job.set_state_reason("waiting to be scheduled");
  job.mutable_progress()->set_total_steps(request.spec().steps());
  Now(job.mutable_create_time());
  *job.mutable_update_time() = job.create_time();
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);
  if (idempotent) {
    // A twin request may have created it while this one was planning.
    PLATEAU_ASSIGN_OR_RETURN(std::optional<v1::SubmitJobResponse> again, Resubmitted(request));
    if (again.has_value()) return *std::move(again);
  }
  // The job and its first event (PENDING) in one transaction: two were
  // one write the client saw fail (UNAVAILABLE) that left the job stored,
  // run after a restart, and a retry without a request id a second job.
  v1::JobEvent submitted = StateChangeEvent(job, nullptr);
  auto created = store_->CreateJob(std::move(job), &submitted);
  PLATEAU_RETURN_IF_ERROR(Written(created.status(), "create a job"));
  job = *std::move(created);
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(job.id()));
  LiveJob& a = active_[seq];
  a.job = job;
  ++job_counts_[v1::PENDING];
  metrics_->OnSubmission();
  metrics_->OnJobState(job.id(), v1::PENDING);
  Say(absl::StrCat(job.id(), " submitted", By(caller), ": ", job.spec().layout().ranks(), " rank(s), ",
                   job.spec().steps(), " step(s)",
                   job.spec().name().empty() ? "" : absl::StrCat(", name '", job.spec().name(), "'")));
  Changed(job.id());
  Schedule();
  // Schedule may have ended it (and dropped `a`): the store has it then.
  auto it = active_.find(seq);
  if (it != active_.end()) {
    *out.mutable_job() = it->second.job;
  } else {
    PLATEAU_ASSIGN_OR_RETURN(*out.mutable_job(), store_->GetJob(job.id()));
  }
  return out;
}

absl::StatusOr<std::optional<v1::SubmitJobResponse>> Coordinator::Resubmitted(const v1::SubmitJobRequest& request) {
  PLATEAU_ASSIGN_OR_RETURN(std::optional<std::string> id, store_->FindRequest(request.request_id()));
  if (!id.has_value()) return std::optional<v1::SubmitJobResponse>();
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(*id));
  v1::Job job;
  if (auto it = active_.find(seq); it != active_.end()) {
    job = it->second.job;
  } else {
    PLATEAU_ASSIGN_OR_RETURN(job, store_->GetJob(*id));
  }
  // Field by field (maps in any order), not by bytes: serialization of a
  // map is not canonical.
  if (!google::protobuf::util::MessageDifferencer::Equals(job.spec(), request.spec())) {
    return absl::AlreadyExistsError(absl::StrCat(
        "request_id: '", request.request_id(), "' already created ", *id, " (", v1::JobState_Name(job.state()),
        ") with another spec; a retry must send the same spec, a new job a new request_id"));
  }
  v1::SubmitJobResponse out;
  *out.mutable_plan() = job.plan();
  *out.mutable_job() = std::move(job);
  return std::optional<v1::SubmitJobResponse>(std::move(out));
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

absl::StatusOr<v1::GetMemoryTimelineResponse> Coordinator::GetMemoryTimeline(const std::string& id) {
  PLATEAU_ASSIGN_OR_RETURN(v1::Job job, GetJob(id));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::MemoryTimeline> ranks, store_->ReadMemoryTimelines(id));
  if (ranks.empty()) {
    const v1::JobSpec& spec = job.spec();
    if (spec.has_memory_timeline_every() && spec.memory_timeline_every() == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(id, " records no memory timeline: its spec sets memory_timeline_every: 0"));
    }
    if (job.has_events_deleted_time()) {
      return absl::FailedPreconditionError(absl::StrCat(
          id,
          " has no memory timeline: removed with its events after the coordinator's --retention"));
    }
    const int64_t every = spec.has_memory_timeline_every() ? spec.memory_timeline_every()
                                                           : kDefaultMemoryTimelineEvery;
    // A finished job will not record one: "yet" only while it may.
    return absl::FailedPreconditionError(absl::StrCat(
        id,
        IsTerminal(job.state()) ? " recorded no memory timeline ("
                                : " has no memory timeline yet (",
        v1::JobState_Name(job.state()), ", step ", job.progress().step(),
        "): each rank records one at step 1 and every ", every, " steps (memory_timeline_every)"));
  }
  v1::GetMemoryTimelineResponse out;
  out.set_job_id(id);
  for (v1::MemoryTimeline& t : ranks) *out.add_ranks() = std::move(t);
  *out.mutable_plan() = job.plan();
  return out;
}

v1::ListWorkersResponse Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::vector<std::string>> jobs;  // by worker
  for (const auto& [seq, a] : active_) {
    for (const v1::Placement& p : a.job.placement()) jobs[p.worker_id()].push_back(a.job.id());
  }
  v1::ListWorkersResponse out;
  for (const auto& [id, w] : registry_.all()) {
    v1::WorkerInfo* i = out.add_workers();
    i->set_id(id);
    i->set_name(w.caps.name());
    i->set_address(w.caps.rank_address());
    i->set_backend(w.caps.backend());
    i->set_slots_total(w.caps.devices());
    i->set_slots_free(std::max(0, w.caps.devices() - w.used_devices));
    i->set_device_memory_bytes(w.caps.device_memory_bytes());
    i->set_host_memory_bytes(w.caps.host_memory_bytes());
    SetTimestamp(i->mutable_last_heartbeat(), w.last_heartbeat);
    if (w.registered != absl::Time()) SetTimestamp(i->mutable_registered_time(), w.registered);
    i->set_state(w.leaving ? "leaving" : w.attached ? "attached" : "awaiting_reattach");
    for (const std::string& j : jobs[id]) i->add_running_jobs(j);
  }
  return out;
}

absl::Status Coordinator::DeleteJob(const std::string& id, const std::string& caller) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::StatusOr<v1::Job> job;
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  {
    absl::MutexLock lock(&mu_);
    PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
    if (stop_) {
      // Nothing written yet: UNAVAILABLE means the delete did not begin
      // (one begun and then stopped would be committed behind it).
      return absl::UnavailableError(
          absl::StrCat("the coordinator is shutting down: job ", id, " was not deleted; retry when it is back"));
    }
    auto it = active_.find(seq);
    if (it != active_.end()) {
      const bool cancelling = it->second.job.state() == v1::CANCELLING;
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id, " is ", v1::JobState_Name(it->second.job.state()),
                       ": only a finished job (SUCCEEDED, FAILED or CANCELLED) can be deleted; ",
                       cancelling ? "wait for it to be CANCELLED (its ranks are stopping)" : "cancel it first"));
    }
    if (deleting_.count(seq) > 0) {
      // Transient: ABORTED, which a client may retry (and then finds the
      // job gone: NOT_FOUND).
      return absl::AbortedError(absl::StrCat("job ", id,
                                             resumed_deletes_.count(seq) > 0
                                                 ? " is being deleted (a delete a restart of the coordinator cut short)"
                                                 : " is being deleted by another request",
                                             ": retry, or wait for it to end"));
    }
    // A record that does not parse (DATA_LOSS, which ListJobs names) can be
    // deleted too: that is how an operator clears it. Its state column counts.
    job = store_->GetJob(id);
    if (!job.ok() && job.status().code() != absl::StatusCode::kDataLoss) return job.status();
    if (job.ok()) {
      state = job->state();
    } else {
      PLATEAU_ASSIGN_OR_RETURN(state, store_->RecordedState(id));
      // A live job's record was parsed at start-up, so this one finished; its
      // state column is checked all the same.
      if (!IsTerminal(state)) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", id, " is ", v1::JobState_Name(state),
                         " by its row's state column: only a finished job can be deleted"));
      }
    }
    // Marked first, as the retention sweep marks what it removed, and
    // recorded as begun in the same transaction (BeginDelete): meanwhile
    // the job reads as swept (its streams say so, late lines are dropped),
    // not whole with rows gone; and a restart between the parts, whose
    // commits are each their own, finds the delete and finishes it
    // (ResumeDeletes).
    if (job.ok() && !job->has_events_deleted_time()) Now(job->mutable_events_deleted_time());
    PLATEAU_RETURN_IF_ERROR(Written(store_->BeginDelete(id, caller, job.ok() ? &*job : nullptr),
                                    absl::StrCat("mark ", id, "'s data as being deleted")));
    deleting_.insert(seq);
  }
  // Its data in parts, each one transaction under the lock, the lock free
  // between them. A finished job gains no data meanwhile (it is marked:
  // its late log lines are dropped) and the sweep leaves it alone. It runs
  // to the end whether or not its caller still waits (unlike a ListJobs
  // scan): a delete is wanted work, and one stopped half-way left a job
  // that reads as swept for a client that said it could not reach us.
  int parts = 0;
  for (bool done = false; !done;) {
    int64_t rows = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) {
        // Shutting down (SIGTERM): a large delete held the shutdown for its
        // whole length. Recorded as begun, it is finished by the next start.
        deleting_.erase(seq);
        Say(absl::StrCat(id, ": its delete", By(caller), " stopped after ", parts,
                         " part(s) of its data by the shutdown; the next start finishes it"));
        return absl::UnavailableError(
            absl::StrCat("the coordinator is shutting down: the delete of ", id, " is finished when it starts again"));
      }
      absl::Status s = store_error_;
      if (s.ok()) {
        absl::StatusOr<bool> part = store_->DeleteJobDataPart(id, kSweepRowsPerTick, &rows);
        s = Written(part.status(), absl::StrCat("delete ", id, "'s events, logs and reports"));
        done = s.ok() && *part;
      }
      if (!s.ok()) {
        deleting_.erase(seq);
        return s;
      }
    }
    ++parts;
    if (options_.after_delete_part) options_.after_delete_part(rows);
  }
  absl::MutexLock lock(&mu_);
  return FinishDelete(seq, state, caller, job.ok() ? job->event_count() : -1,
                      parts > 1 ? absl::StrCat("; its data in ", parts, " parts") : "");
}

absl::StatusOr<std::vector<v1::JobEvent>> Coordinator::ReadEvents(const std::string& id, int64_t from, int limit,
                                                                  bool per_rank) {
  if (per_rank) {
    PLATEAU_ASSIGN_OR_RETURN(v1::Job job, GetJob(id));
    const int64_t ranks = std::max<int64_t>(1, job.spec().layout().ranks());
    limit = static_cast<int>(std::clamp<int64_t>(options_.per_rank_reports_per_read / ranks, 1, std::max(1, limit)));
  }
  PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::JobEvent> events, store_->ReadEvents(id, from, limit));
  if (!per_rank) return events;
  // One read per run of step events of one attempt.
  for (size_t i = 0; i < events.size();) {
    if (!events[i].has_job_step()) {
      ++i;
      continue;
    }
    const int attempt = events[i].job_step().attempt();
    size_t j = i;
    while (j < events.size() && events[j].has_job_step() && events[j].job_step().attempt() == attempt) ++j;
    PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::StepTelemetry> reports,
                             store_->ReadRankSteps(id, attempt, events[i].job_step().step(),
                                                   events[j - 1].job_step().step()));
    size_t r = 0;
    for (size_t k = i; k < j; ++k) {
      v1::JobStepSummary* s = events[k].mutable_job_step();
      while (r < reports.size() && reports[r].step() < s->step()) ++r;
      for (; r < reports.size() && reports[r].step() == s->step(); ++r) *s->add_per_rank() = reports[r];
    }
    i = j;
  }
  return events;
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const v1::ListJobsRequest& request,
                                                           const StillWanted& still_wanted) {
  if (request.page_size() < 0 || request.page_size() > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size: expected 0 (default ", kDefaultPageSize,
                                                   ") to ", kMaxPageSize, ", got ", request.page_size()));
  }
  JobQuery query;
  query.newest_first = request.newest_first();
  if (!request.page_token().empty()) {
    absl::string_view token = request.page_token();
    const bool newest = absl::ConsumePrefix(&token, "n");
    // "<seq>.<filters>"; a token without the hash (made before it) is taken
    // as it is.
    absl::string_view filters;
    if (const size_t dot = token.find('.'); dot != absl::string_view::npos) {
      filters = token.substr(dot + 1);
      token = token.substr(0, dot);
    }
    if (!absl::SimpleAtoi(token, &query.cursor) || query.cursor < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token: expected a token from a previous ListJobs response, got '",
                       absl::CHexEscape(request.page_token().substr(0, 64)), "'"));
    }
    if (newest != request.newest_first()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "page_token: '", request.page_token(), "' continues a ", newest ? "newest-first" : "oldest-first",
          " listing; repeat its request with newest_first: ", newest ? "true" : "false", " and the same filters"));
    }
    if (!filters.empty() && filters != FiltersHash(request)) {
      return absl::InvalidArgumentError(
          absl::StrCat("page_token: '", absl::CHexEscape(request.page_token().substr(0, 64)),
                       "' continues a listing with other filters (states, label_selector): repeat its request's "
                       "filters, or list again from the first page"));
    }
  }
  for (int s : request.states()) {
    if (!v1::JobState_IsValid(s) || s == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("states: expected job states, got ", s));
    }
    query.states.push_back(static_cast<v1::JobState>(s));
  }
  PLATEAU_ASSIGN_OR_RETURN(LabelSelector selector, LabelSelector::Parse(request.label_selector()));
  if (!selector.empty()) {
    query.match = [selector](const v1::Job& j) { return selector.Matches(j.spec().labels()); };
  }
  query.limit = request.page_size() == 0 ? kDefaultPageSize : request.page_size();
  query.max_bytes = kMaxPageBytes;
  // A selective label_selector scans the history kListScanRows jobs a
  // read: a scan whose caller gave up stops at the next read.
  if (options_.between_list_reads || still_wanted) {
    query.between_reads = [this, &still_wanted, &request]() -> absl::Status {
      if (options_.between_list_reads) options_.between_list_reads();
      if (!still_wanted) return absl::OkStatus();
      absl::Status wanted = still_wanted();
      if (wanted.ok()) return wanted;
      return absl::Status(wanted.code(), absl::StrCat(wanted.message(),
                                                      "; ListJobs stopped its scan of the stored jobs "
                                                      "for label_selector '",
                                                      request.label_selector(), "'"));
    };
  }
  bool more = false;
  PLATEAU_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, store_->ListJobs(query, &more));
  v1::ListJobsResponse out;
  for (v1::Job& j : jobs) *out.add_jobs() = std::move(j);
  if (more && !jobs.empty()) {
    out.set_next_page_token(PageToken(*ParseJobId(out.jobs(out.jobs_size() - 1).id()), request));
  }
  return out;
}

absl::StatusOr<v1::Job> Coordinator::CancelJob(const std::string& id, const std::string& caller) {
  PLATEAU_ASSIGN_OR_RETURN(int64_t seq, ParseJobId(id));
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  auto it = active_.find(seq);
  if (it == active_.end()) {
    PLATEAU_ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(id));
    // A cancel retried after its answer was lost finds the job CANCELLED:
    // the answer it would have had (OK, the job), not the refusal a job
    // that ended otherwise gets.
    if (job.state() == v1::CANCELLED) return job;
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is already ", v1::JobState_Name(job.state()), "; nothing to cancel"));
  }
  LiveJob& a = it->second;
  if (a.cancel_requested) return a.job;
  a.cancel_requested = true;
  a.job.set_cancelled_by(caller);  // written with the state change below
  metrics_->OnCancel();
  if (a.job.state() == v1::PENDING || a.job.state() == v1::RESTARTING) {
    // A job pending after a failed attempt has run (its progress is kept
    // across attempts): "before it was scheduled" told its user it never
    // ran. RESTARTING is the moment before its attempt number goes up.
    const bool restart = a.job.attempt() > 0 || a.job.state() == v1::RESTARTING;
    const int next = a.job.attempt() + (a.job.state() == v1::RESTARTING ? 1 : 0);
    const std::string when = restart ? absl::StrCat(" while waiting to restart (attempt ", next, ", last at step ",
                                                    a.job.progress().step(), " of ", a.job.spec().steps(), ")")
                                     : std::string(" before it was scheduled");
    PLATEAU_RETURN_IF_ERROR(SetState(a, v1::CANCELLED, absl::StrCat("cancelled", By(caller), when)));
    v1::Job job = a.job;
    active_.erase(it);
    return job;
  }
  PLATEAU_RETURN_IF_ERROR(
      SetState(a, v1::CANCELLING, absl::StrCat("cancel requested", By(caller), "; stopping the ranks")));
  StopRanks(a);
  v1::Job job = a.job;
  MaybeFinish(seq);
  return job;
}

// ---------------------------------------------------------------------------
// Scheduling

void Coordinator::Schedule() {
  // Right after a (re)start the workers of before may still be registering
  // again: a job found unschedulable then keeps its earlier mark and clock,
  // and none is newly marked or failed.
  const bool settling = absl::Now() < started_ + options_.reattach_timeout;
  std::vector<int64_t> failed;
  // The queue's order: priority, higher first, then submission (seq). A job
  // that cannot be placed now does not hold back a later one that can (no
  // reservation), and a running job is never preempted.
  std::vector<std::pair<int32_t, int64_t>> queue;
  for (const auto& [seq, a] : active_) {
    if (a.job.state() == v1::PENDING) queue.emplace_back(-a.job.spec().priority(), seq);
  }
  std::sort(queue.begin(), queue.end());
  for (const auto& [unused, seq] : queue) {
    LiveJob& a = active_.at(seq);
    const PlacementDecision d = Place(a.job, registry_.Slots());
    if (d.kind == PlacementDecision::Kind::kUnschedulable) {
      if (settling && a.job.unschedulable()) continue;  // keeps its mark and clock
      if (!settling) {
        if (!MarkUnschedulable(a, d.reason)) failed.push_back(seq);
        continue;
      }
    }
    if (d.kind != PlacementDecision::Kind::kPlaced) {
      // Every placement or finish anywhere changes the reason's free-slot
      // counts: an event for each would grow a long-pending job's events
      // without bound. The job (get, list) always has the latest reason;
      // its events at most one a minute (pending_reason_event_every; the
      // latest reason once that is up, Schedule running every tick), and at
      // once on leaving unschedulable.
      const absl::Time now = absl::Now();
      const bool event_due =
          d.waiting_reason != a.reason_in_events && now - a.reason_event_at >= options_.pending_reason_event_every;
      if (d.waiting_reason != a.job.state_reason() || a.job.unschedulable() || event_due) {
        const bool was_unschedulable = a.job.unschedulable();
        a.job.clear_unschedulable();  // a worker that can host it registered
        a.job.clear_unschedulable_since();
        if (was_unschedulable || event_due) {
          a.reason_event_at = now;
          a.reason_in_events = d.waiting_reason;
          Transition(a, v1::PENDING, d.waiting_reason);
        } else {
          a.job.set_state_reason(d.waiting_reason);
          Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s waiting reason"));
          Changed(a.job.id());
        }
      }
      continue;
    }
    const v1::JobSpec& spec = a.job.spec();
    const int64_t per_node = spec.layout().ranks() / static_cast<int64_t>(d.nodes.size());
    // The `auto` settings are chosen for the workers the first attempt got
    // (their calibration and memory; PlacementAutoContext takes the slowest
    // and the most constrained of them), so that it runs what suits where
    // it runs: the plan, and what the ranks receive (AssignmentFor), are
    // this choice. A restart keeps the values the job ran with when they
    // fit its new workers, so that its resumed run is bitwise the
    // uninterrupted one (PlanAtEarlierAutoSettings); else it chooses again
    // and the job's log says why.
    if (HasAutoSettings(spec)) {
      std::vector<std::pair<std::string, v1::WorkerCapabilities>> placed;
      for (const std::string& id : d.nodes) placed.push_back({id, registry_.at(id).caps});
      absl::StatusOr<AutoContext> context = PlacementAutoContext(spec, placed);
      const bool ran_before =
          a.job.attempt() > 0 && a.job.plan().auto_settings_size() > 0 && !a.job.plan().has_auto_nothing_fits();
      std::string earlier_misfit;
      absl::StatusOr<v1::MemoryPlan> plan = absl::InternalError("not planned");
      if (!context.ok()) {
        plan = context.status();
      } else if (ran_before) {
        plan = PlanAtEarlierAutoSettings(spec, a.job.plan(), *context);
        if (!plan.ok()) {
          earlier_misfit = std::string(plan.status().message());
          plan = AdmitJob(spec, *context);
        }
      } else {
        plan = AdmitJob(spec, *context);
      }
      if (plan.ok() && !earlier_misfit.empty()) {
        Log(a.job.id(), a.job.attempt(),
            absl::StrCat("the `auto` settings of the earlier attempt are not kept on ", absl::StrJoin(d.nodes, ", "),
                         " (", earlier_misfit,
                         "): chosen again there, so this attempt's steps are not bitwise those of an uninterrupted "
                         "run"));
      }
      if (plan.ok() && plan->has_auto_nothing_fits()) {
        plan = absl::ResourceExhaustedError(plan->auto_nothing_fits().reason());
      }
      if (!plan.ok()) {
        // Placement checked that some value fits there (WhyCannotHost), so
        // this is unexpected; the job is not launched there and waits.
        const std::string why = absl::StrCat("waiting to be scheduled: the `auto` settings chosen again for ",
                                             absl::StrJoin(d.nodes, ", "), " do not admit it: ",
                                             plan.status().message());
        if (why != a.job.state_reason()) Transition(a, v1::PENDING, why);
        continue;
      }
      *a.job.mutable_plan() = *std::move(plan);
    }
    a.ranks.assign(spec.layout().ranks(), RankState{});
    a.has_failure = false;
    a.failure_priority = 0;
    a.failure.Clear();
    a.judging.clear();
    a.tokens = a.seconds = 0;
    a.hang_reported = false;
    a.pending_steps.clear();
    a.emitted_step = 0;
    a.job.clear_placement();
    a.job.clear_failure();
    a.job.clear_failure_held_for();
    std::vector<std::string> where;
    for (size_t n = 0; n < d.nodes.size(); ++n) {
      Worker& w = registry_.at(d.nodes[n]);
      v1::Placement* p = a.job.add_placement();
      p->set_worker_id(w.id);
      if (std::find(a.job.hosted_by().begin(), a.job.hosted_by().end(), w.id) == a.job.hosted_by().end()) {
        a.job.add_hosted_by(w.id);
      }
      for (int64_t r = n * per_node; r < static_cast<int64_t>(n + 1) * per_node; ++r) {
        p->add_ranks(static_cast<int>(r));
        a.ranks[r].worker_id = w.id;
      }
      w.used_devices += static_cast<int>(per_node);
      w.assignments.push_back(AssignmentFor(a, *p));
      where.push_back(per_node == 1 ? absl::StrCat(w.id, " (rank ", n, ")")
                                    : absl::StrCat(w.id, " (ranks ", n * per_node, "-", (n + 1) * per_node - 1, ")"));
    }
    metrics_->OnPlan(a.job.id(), static_cast<int>(spec.layout().ranks()), a.job.plan());
    Transition(a, v1::SCHEDULED, absl::StrCat("placed on ", absl::StrJoin(where, ", ")));
  }
  for (int64_t seq : failed) active_.erase(seq);
}

bool Coordinator::MarkUnschedulable(LiveJob& a, const std::string& why) {
  const absl::Time now = absl::Now();
  if (!a.job.unschedulable()) {
    a.job.set_unschedulable(true);
    Now(a.job.mutable_unschedulable_since());
  }
  const int64_t limit_s = a.job.spec().max_pending_s();
  const absl::Duration limit = limit_s > 0 ? absl::Seconds(limit_s) : options_.default_max_pending;
  const bool expires = limit > absl::ZeroDuration();
  if (expires && now - TimeOf(a.job.unschedulable_since()) >= limit) {
    v1::Failure f;
    f.set_kind(v1::Failure::UNSCHEDULABLE);
    f.set_message(absl::StrCat("unschedulable for ", absl::FormatDuration(limit),
                               " (max_pending_s): no registered worker could host it; ", why));
    Log(a.job.id(), a.job.attempt(), f.message());
    Transition(a, v1::FAILED, f.message(), &f);
    return false;
  }
  const std::string reason = absl::StrCat(
      "unschedulable: ", why, "; ",
      expires ? absl::StrCat("fails after ", absl::FormatDuration(limit), " (max_pending_s) unless one registers")
              : std::string("waits for one to register (no max_pending_s)"));
  // The first mark and each change of what the workers offer is an event.
  if (reason != a.job.state_reason()) Transition(a, v1::PENDING, reason);
  return true;
}

void Coordinator::ExpireWorkers() {
  const absl::Time now = absl::Now();
  // One loss at a time: the next lost worker is still registered while the
  // attempts on this one are stopped (StopRanks withdraws its assignments).
  for (const std::string& id : registry_.Expired(now)) {
    {
      // Its heartbeat arrived and waits for mu_ (held by a slow store
      // write): alive; the heartbeat renews it once handled.
      absl::MutexLock inflight(&inflight_mu_);
      if (inflight_beats_.count(id) > 0) continue;
    }
    // One whose agent said it was leaving (a shutdown, a rollout) is gone
    // as told, not lost: PlateauWorkerLost alerts on this counter.
    const Worker* found = registry_.Find(id);
    const bool left = found != nullptr && found->leaving;
    const std::string why = registry_.Remove(id, now);
    metrics_->ForgetWorker(id);
    if (!left) metrics_->OnWorkerLost();
    // Its ranks died with it, or are stopped when it comes back.
    const int touched = FailAttemptsOn(id, absl::StrCat("worker lost: ", id, " ", why), /*ranks_gone=*/true);
    Say(absl::StrCat(id, " lost: ", why, AffectedJobs(touched)));
  }
}

std::string Coordinator::AffectedJobs(int touched) {
  return touched == 0 ? "; it ran no live job" : absl::StrCat("; ", touched, " live job(s) affected");
}

int Coordinator::FailAttemptsOn(const std::string& worker_id, const std::string& message, bool ranks_gone) {
  std::vector<int64_t> touched;
  for (auto& [seq, a] : active_) {
    bool hit = false;
    for (RankState& r : a.ranks) {
      if (r.worker_id != worker_id || r.gone) continue;
      hit = true;
      r.gone = ranks_gone;
    }
    if (!hit) continue;
    v1::Failure f;
    f.set_kind(v1::Failure::WORKER_LOST);
    f.set_worker_id(worker_id);
    f.set_message(message);
    RecordFailure(a, f, kPriorityWorkerLost);
    Log(a.job.id(), a.job.attempt(), f.message());
    StopRanks(a);
    touched.push_back(seq);
  }
  for (int64_t seq : touched) {
    MaybeFinish(seq);
    Changed(JobIdOf(seq));
  }
  return static_cast<int>(touched.size());
}

void Coordinator::CheckProgress() {
  const absl::Time now = absl::Now();
  for (auto& [seq, a] : active_) {
    if (a.hang_reported || a.cancel_requested || a.ranks.empty()) continue;
    if (a.job.state() != v1::SCHEDULED && a.job.state() != v1::RUNNING) continue;
    const int64_t timeout_s = a.job.spec().progress_timeout_s();
    const absl::Duration timeout =
        timeout_s > 0 ? absl::Seconds(timeout_s) : options_.default_progress_timeout;
    // Ranks whose clock runs: started, or delivered to their worker.
    std::vector<int> stalled;
    for (size_t r = 0; r < a.ranks.size(); ++r) {
      const RankState& x = a.ranks[r];
      if (x.gone || x.last_progress == absl::Time()) continue;
      if (now - x.last_progress > timeout) stalled.push_back(static_cast<int>(r));
    }
    if (stalled.empty()) continue;
    // The rank furthest behind is named; all stalled ones are listed. Ranks
    // tied there are named together: a rank stuck outside a collective
    // holds its peers inside it at the same step, so which one stopped
    // first cannot be told from here (their logs may say); the lowest is
    // Failure.rank.
    int worst = stalled[0];
    for (int r : stalled) {
      if (a.ranks[r].last_step < a.ranks[worst].last_step) worst = r;
    }
    // Tied: every running rank at that step, stalled past the timeout yet
    // or not. Their last reports reach the coordinator up to an agent's
    // send interval (200 ms) apart, more across workers, so the first past
    // the timeout is not the one that stopped.
    std::vector<int> tied;
    for (size_t r = 0; r < a.ranks.size(); ++r) {
      const RankState& x = a.ranks[r];
      if (x.gone || x.last_progress == absl::Time()) continue;
      if (x.last_step == a.ranks[worst].last_step) tied.push_back(static_cast<int>(r));
    }
    const absl::Duration silent = now - a.ranks[worst].last_progress;  // past the timeout
    worst = tied[0];
    v1::Failure f;
    f.set_kind(v1::Failure::RANK_HUNG);
    f.set_rank(worst);
    f.set_worker_id(a.ranks[worst].worker_id);
    f.set_message(absl::StrCat(
        tied.size() == 1 ? absl::StrCat("rank ", worst) : absl::StrCat("ranks ", absl::StrJoin(tied, ", ")),
        " hung: no step progress for ", absl::FormatDuration(absl::Trunc(silent, absl::Seconds(1))),
        " (progress timeout ", absl::FormatDuration(timeout), "; last step ", a.ranks[worst].last_step,
        tied.size() == 1 ? absl::StrCat("; stalled ranks ", absl::StrJoin(stalled, ", "))
                         : std::string(", all of them: one stuck outside a collective holds the others in it, so "
                                       "which stopped first is not known here"),
        "); its ranks were killed"));
    a.hang_reported = true;
    RecordFailure(a, f, kPriorityHung);
    Log(a.job.id(), a.job.attempt(), f.message());
    a.job.set_state_reason(f.message());
    Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s hang"));
    StopRanks(a);
    Changed(a.job.id());
  }
}

void Coordinator::CheckMaxDuration() {
  const absl::Time now = absl::Now();
  std::vector<int64_t> ended, stopped;
  for (auto& [seq, a] : active_) {
    const int64_t limit_s = a.job.spec().max_duration_s();
    if (limit_s <= 0 || !a.job.has_start_time() || a.cancel_requested) continue;
    if (a.has_failure && a.failure.kind() == v1::Failure::MAX_DURATION_EXCEEDED) continue;  // being stopped
    const absl::Duration limit = absl::Seconds(limit_s);
    const absl::Duration ran = now - TimeOf(a.job.start_time());
    if (ran < limit) continue;
    v1::Failure f;
    f.set_kind(v1::Failure::MAX_DURATION_EXCEEDED);
    if (a.job.state() == v1::PENDING || a.job.state() == v1::RESTARTING) {
      // Between attempts: nothing runs, so it ends now.
      f.set_message(MaxDurationMessage(a.job, /*reached_step=*/-1, /*stopped=*/true));
      Log(a.job.id(), a.job.attempt(), f.message());
      Transition(a, v1::FAILED, f.message(), &f);
      ended.push_back(seq);
      continue;
    }
    a.max_duration_step = a.job.progress().step();
    f.set_message(MaxDurationMessage(a.job, a.max_duration_step, /*stopped=*/false));
    Log(a.job.id(), a.job.attempt(), f.message());
    RecordFailure(a, f, kPriorityMaxDuration);
    a.job.set_state_reason(f.message());
    Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s max_duration_s"));
    StopRanks(a);
    stopped.push_back(seq);
    Changed(a.job.id());
  }
  for (int64_t seq : ended) active_.erase(seq);
  // Ranks withdrawn before delivery are gone already (after the loop:
  // finishing erases from active_).
  for (int64_t seq : stopped) MaybeFinish(seq);
}

void Coordinator::RecordFailure(LiveJob& a, const v1::Failure& f, int priority) {
  if (a.has_failure && a.failure_priority >= priority) return;
  const bool was = a.has_failure;
  a.has_failure = true;
  a.failure_priority = priority;
  a.failure = f;
  // A cause outranks the exit held: it is the failure, not provisional.
  if (priority > kPriorityExit) a.judging.clear();
  if (!a.judging.empty()) {
    Say(absl::StrCat(a.job.id(), " attempt ", a.job.attempt(), " failing: ", v1::Failure::Kind_Name(f.kind()), ": ",
                     f.message(), "; held until ", absl::StrJoin(a.judging, ", "),
                     " is heard from or lost (a lost peer fails its ranks' collectives)"));
  } else {
    Say(absl::StrCat(a.job.id(), " attempt ", a.job.attempt(), (was ? " failure now: " : " failing: "),
                     v1::Failure::Kind_Name(f.kind()), ": ", f.message()));
  }
  PublishFailure(a);
}

void Coordinator::PublishFailure(LiveJob& a) {
  // Kept with the job, held or standing (Job.failure_held_for), so that a
  // restarted coordinator knows the attempt is failing, why, and whom it
  // still waits to hear from.
  *a.job.mutable_failure() = a.failure;
  a.job.clear_failure_held_for();
  for (const std::string& w : a.judging) a.job.add_failure_held_for(w);
  Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s failure"));
  Changed(a.job.id());
}

void Coordinator::Rejudged(LiveJob& a, const std::string& why) {
  if (a.judging.empty()) {
    Say(absl::StrCat(a.job.id(), " attempt ", a.job.attempt(), " failing: ", v1::Failure::Kind_Name(a.failure.kind()),
                     ": ", a.failure.message(), " (", why, ": the failure stands)"));
  }
  PublishFailure(a);
}

void Coordinator::Heard(const std::string& worker_id, const std::set<std::pair<std::string, int>>& reporting) {
  for (auto& [seq, a] : active_) {
    if (reporting.count({a.job.id(), a.job.attempt()}) > 0) continue;
    if (a.judging.erase(worker_id) > 0) Rejudged(a, absl::StrCat(worker_id, " was heard from"));
  }
}

void Coordinator::Delivered(LiveJob& a, v1::Placement& p) {
  if (p.delivered()) return;
  p.set_delivered(true);
  Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s delivered assignment"));
}

void Coordinator::StopRanks(LiveJob& a) {
  for (const v1::Placement& p : a.job.placement()) {
    Worker* w = registry_.Find(p.worker_id());
    if (w == nullptr) continue;
    if (!p.delivered() && !w->attached) {
      // After a restart: the assignment may have been sent, and arrived,
      // without an acknowledgement the killed coordinator recorded. The
      // worker's registration settles it (Reattach: listed, the ranks are
      // stopped; not listed, they never started and count as gone; never
      // back, lost).
      continue;
    }
    if (!p.delivered()) {
      const auto same = [&](const auto& x) { return x.job_id == a.job.id() && x.attempt == a.job.attempt(); };
      auto sent = std::find_if(w->unacknowledged.begin(), w->unacknowledged.end(), same);
      if (sent == w->unacknowledged.end()) {
        // Not sent (or, after a restart, not known to have arrived: the
        // worker's registration says, Reattach): withdrawn, its ranks
        // never start.
        auto& as = w->assignments;
        as.erase(std::remove_if(as.begin(), as.end(),
                                [&](const v1::Assignment& x) {
                                  return x.job_id() == a.job.id() && x.attempt() == a.job.attempt();
                                }),
                 as.end());
        for (int r : p.ranks()) a.ranks[r].gone = true;
        continue;
      }
      // Sent, and whether it arrived is not yet known: not sent again, and
      // stopped if it did arrive. The worker's next heartbeat settles it.
      sent->withdrawn = true;
    }
    v1::Cancellation c;
    c.set_job_id(a.job.id());
    c.set_attempt(a.job.attempt());
    w->cancellations.push_back(c);
  }
}

v1::Assignment Coordinator::AssignmentFor(const LiveJob& a, const v1::Placement& p) {
  v1::Assignment as;
  as.set_job_id(a.job.id());
  as.set_attempt(a.job.attempt());
  // The ranks run the values the plan chose for the spec's `auto` settings.
  // A plan without them (impossible for a job admitted by this build) sends
  // the spec as it is, which every rank refuses naming the field.
  absl::StatusOr<v1::JobSpec> resolved = ResolvedSpec(a.job.spec(), a.job.plan());
  *as.mutable_spec() = resolved.ok() ? *std::move(resolved) : a.job.spec();
  as.set_kv_prefix(AttemptPrefix(a.job.id(), a.job.attempt()));
  for (int r : p.ranks()) as.add_ranks(r);
  return as;
}

v1::Placement* Coordinator::PlacementOn(LiveJob& a, const std::string& worker_id) {
  for (v1::Placement& p : *a.job.mutable_placement()) {
    if (p.worker_id() == worker_id) return &p;
  }
  return nullptr;
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
  LiveJob& a = active_[seq];
  // The attempt's outcome below publishes its failure as it stands.
  a.judging.clear();
  a.job.clear_failure_held_for();
  // Steps some rank never reported end with the attempt, before its final
  // state (a watcher that sees the state has seen every step).
  WriteSteps(a, FlushSteps(a));
  for (const v1::Placement& p : a.job.placement()) {
    // A worker not yet re-attached after a restart has not counted them.
    if (Worker* w = registry_.FindAttached(p.worker_id())) w->used_devices -= p.ranks_size();
  }
  a.job.clear_placement();
  // The attempt's rendezvous keys are of no further use.
  Write(rendezvous_.DeleteAttempt(a.job.id(), a.job.attempt()),
        absl::StrCat("delete the rendezvous keys ", AttemptPrefix(a.job.id(), a.job.attempt()), "/"));
  if (a.cancel_requested) {
    Transition(a, v1::CANCELLED, "cancelled; every rank process has exited");
  } else if (!a.has_failure) {
    Transition(a, v1::SUCCEEDED, absl::StrCat("all ", a.ranks.size(), " ranks finished ",
                                              a.job.spec().steps(), " steps"));
  } else {
    const bool restartable = a.failure.kind() == v1::Failure::RANK_CRASHED ||
                             a.failure.kind() == v1::Failure::WORKER_LOST ||
                             a.failure.kind() == v1::Failure::RANK_HUNG;
    if (restartable && a.job.attempt() < a.job.spec().max_restarts()) {
      Transition(a, v1::RESTARTING,
                 absl::StrCat("attempt ", a.job.attempt(), " failed (", a.failure.message(), "); restart ",
                              a.job.attempt() + 1, " of ", a.job.spec().max_restarts()),
                 &a.failure);
      a.job.set_attempt(a.job.attempt() + 1);
      a.ranks.clear();
      a.emitted_step = 0;
      Transition(a, v1::PENDING, "waiting to be scheduled (restart)");
      return;
    }
    if (a.failure.kind() == v1::Failure::MAX_DURATION_EXCEEDED) {
      // The ranks trained on until they were stopped: the final reason
      // names the step they got to (the steps just flushed included), not
      // only the one when the limit fired.
      a.failure.set_message(MaxDurationMessage(a.job, a.max_duration_step, /*stopped=*/true));
    }
    Transition(a, v1::FAILED, a.failure.message(), &a.failure);
  }
  active_.erase(seq);
}

// ---------------------------------------------------------------------------
// WorkerService

absl::StatusOr<v1::RegisterResponse> Coordinator::Register(const v1::RegisterRequest& request) {
  PLATEAU_RETURN_IF_ERROR(WorkerRegistry::CheckCapabilities(request.capabilities()));
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  v1::RegisterResponse out;
  out.set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
  // A worker registering again keeps its id when nobody else holds it; if
  // this coordinator was expecting it (a restart: it had ranks of a live
  // job when the previous coordinator stopped), its ranks re-attach.
  bool expected = false, restarted = false;
  // A calibration the planner cannot model would make every `auto` submit
  // of its backend fail (AutoContextFor picks one worker's): it is set
  // aside, saying why, and the worker takes jobs as one without.
  v1::WorkerCapabilities caps_kept = request.capabilities();
  std::string calibration_dropped;
  if (caps_kept.has_calibration()) {
    if (absl::StatusOr<Calibration> c = CalibrationFromProto(caps_kept.calibration()); !c.ok()) {
      calibration_dropped = std::string(c.status().message());
      caps_kept.clear_calibration();
    }
  }
  Worker& w = registry_.Attach(request.worker_id(), caps_kept, absl::Now(), &expected, &restarted);
  if (!calibration_dropped.empty()) {
    Say(absl::StrCat(w.id, "'s calibration is not used (", calibration_dropped,
                     "): its jobs' `auto` settings are chosen on the default curve"));
  }
  metrics_->OnHeartbeat(w.id, w.last_heartbeat);
  out.set_worker_id(w.id);
  const v1::WorkerCapabilities& caps = request.capabilities();
  Say(absl::StrCat(w.id, restarted ? " registered again (its agent restarted)"
                         : expected ? " registered again after the coordinator's restart"
                         : !request.worker_id().empty() && request.worker_id() == w.id ? " registered again"
                         : " registered",
                   !request.worker_id().empty() && request.worker_id() != w.id
                       ? absl::StrCat(" (asked for ", request.worker_id().substr(0, 64), ", held by another)")
                       : "",
                   ": name '", caps.name(), "', ", caps.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu", ", ",
                   caps.devices(), " slot(s), ranks on ", caps.rank_address(), ", ", request.running_size(),
                   " attempt(s) running"));
  Reattach(w, expected, restarted ? "its agent's restart" : "the coordinator's restart", request, &out);
  // Back: a crash held on its account stands, but where it still lists the
  // attempt, once those ranks' exits are reported (one may be the cause).
  Heard(w.id, ListedAttempts(request.running()));
  Changed();
  Schedule();
  return out;
}

void Coordinator::Reattach(Worker& w, bool expected, const std::string& after, const v1::RegisterRequest& request,
                           v1::RegisterResponse* out) {
  const absl::Time now = absl::Now();
  // What the agent runs, by attempt.
  std::map<std::pair<std::string, int>, std::set<int>> running;
  for (const v1::RunningJob& j : request.running()) {
    running[{j.job_id(), j.attempt()}].insert(j.ranks().begin(), j.ranks().end());
  }
  std::set<std::pair<std::string, int>> attached;
  std::vector<int64_t> touched;
  if (expected) {
    for (auto& [seq, a] : active_) {
      v1::Placement* p = PlacementOn(a, w.id);
      if (p == nullptr) continue;
      const std::pair<std::string, int> key{a.job.id(), a.job.attempt()};
      auto run = running.find(key);
      w.used_devices += p->ranks_size();
      touched.push_back(seq);
      if (!p->delivered() && run == running.end()) {
        if (a.cancel_requested || a.has_failure) {
          for (int r : p->ranks()) a.ranks[r].gone = true;
          continue;
        }
        // A fresh agent process whose predecessor may have received it: if
        // its ranks here had begun to meet (written or read a rendezvous
        // key), they died with that process, and ranks sent again would read
        // their keys, or join a meeting that counts them already. The
        // attempt restarts under fresh keys instead (a restart, counted as
        // one). Ranks of other nodes that met say nothing here.
        if (request.agent_started() &&
            rendezvous_.AnyMet(a.job.id(), a.job.attempt(), {p->ranks().begin(), p->ranks().end()})) {
          for (int r : p->ranks()) a.ranks[r].gone = true;
          v1::Failure f;
          f.set_kind(v1::Failure::RANK_CRASHED);
          f.set_rank(p->ranks(0));
          f.set_worker_id(w.id);
          f.set_message(absl::StrCat(
              "attempt ", a.job.attempt(), "'s assignment to ", w.id, " was never acknowledged, and ", w.id,
              " registered again after ", after, " as a new agent process, and its ranks there had begun to meet ",
              "(rendezvous keys written or read): they died with the old process, and ranks sent again would meet ",
              "their leftovers; the attempt restarts under fresh keys"));
          RecordFailure(a, f, kPriorityExit);  // the first: a failing attempt is not here
          StopRanks(a);                        // the others would wait on ranks that never come
          continue;
        }
        // The assignment never reached the worker: send it (again).
        w.assignments.push_back(AssignmentFor(a, *p));
        continue;
      }
      attached.insert(key);
      p->set_delivered(true);
      for (int r : p->ranks()) {
        RankState& x = a.ranks[r];
        if (x.gone) continue;
        if (run != running.end() && run->second.count(r)) {
          x.started = true;
          x.last_progress = now;
          continue;
        }
        // Delivered, not exited, and not running there: the rank is gone
        // without a word (the agent restarted, say).
        x.gone = true;
        v1::Failure f;
        f.set_kind(v1::Failure::RANK_CRASHED);
        f.set_rank(r);
        f.set_worker_id(w.id);
        f.set_message(absl::StrCat("rank ", r, " was no longer running on ", w.id,
                                   " when it registered again after ", after));
        if (a.judging.count(w.id) > 0) {
          // What a crash held on its account waited to learn: its ranks
          // died under their peers, whose exit was the consequence.
          a.judging.clear();
          a.has_failure = false;
        }
        RecordFailure(a, f, kPriorityExit);
      }
      const bool queued = std::any_of(w.cancellations.begin(), w.cancellations.end(), [&](const v1::Cancellation& c) {
        return c.job_id() == a.job.id() && c.attempt() == a.job.attempt();
      });
      if ((a.cancel_requested || a.has_failure) && !queued) {
        v1::Cancellation c;
        c.set_job_id(a.job.id());
        c.set_attempt(a.job.attempt());
        w.cancellations.push_back(c);
      }
      bool all = true;
      for (const RankState& x : a.ranks) all = all && x.started;
      if (all && a.job.state() == v1::SCHEDULED) {
        Transition(a, v1::RUNNING, absl::StrCat("all ", a.ranks.size(), " ranks started"));
      } else {
        Write(store_->PutJob(a.job), absl::StrCat("record ", a.job.id(), "'s re-attached ranks"));
      }
      // Re-attached only when some of its ranks still run there; otherwise
      // the failure recorded above says what happened to them.
      if (run != running.end()) {
        Log(a.job.id(), a.job.attempt(), absl::StrCat("re-attached after ", after, ": ", w.id));
        Say(absl::StrCat(a.job.id(), " attempt ", a.job.attempt(), " re-attached to ", w.id, " after ", after));
      }
    }
  }
  // Anything else it runs belongs to no live attempt here: it stops it.
  for (const auto& [key, ranks] : running) {
    if (attached.count(key)) continue;
    v1::Cancellation* c = out->add_cancellations();
    c->set_job_id(key.first);
    c->set_attempt(key.second);
  }
  for (int64_t seq : touched) MaybeFinish(seq);
}

void Coordinator::Leaving(Worker& w) {
  w.leaving = true;
  // Its ranks there exit (stopped by the agent) and are reported as usual.
  const int touched =
      FailAttemptsOn(w.id, absl::StrCat("worker left: ", w.id, "'s agent is shutting down"), /*ranks_gone=*/false);
  Say(absl::StrCat(w.id, " is leaving: its agent is shutting down", AffectedJobs(touched)));
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  // Counted as in flight from its arrival until it is handled (see
  // inflight_beats_): the entry lives only as long as this call, so the map
  // holds at most one entry per concurrent request.
  {
    absl::MutexLock arrived(&inflight_mu_);
    ++inflight_beats_[request.worker_id()];
  }
  struct Handled {
    Coordinator* c;
    const std::string& id;
    ~Handled() {
      absl::MutexLock done(&c->inflight_mu_);
      auto it = c->inflight_beats_.find(id);
      if (--it->second == 0) c->inflight_beats_.erase(it);
    }
  } handled{this, request.worker_id()};
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  Worker* found = registry_.FindAttached(request.worker_id());
  if (found == nullptr) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered (lost, unknown, or the coordinator restarted); "
                                            "register again"));
  }
  Worker& w = *found;
  registry_.Beat(w, absl::Now());
  metrics_->OnHeartbeat(w.id, w.last_heartbeat);
  const std::set<std::pair<std::string, int>> running = ListedAttempts(request.running());
  if (request.leaving() && !w.leaving) {
    Leaving(w);  // WORKER_LOST outranks a crash held on its account
  } else {
    // Alive; a hold on an attempt it still lists waits for its ranks'
    // exit reports (one may name a signal, the cause).
    Heard(w.id, running);
  }
  v1::HeartbeatResponse out;
  // Assignments sent before: arrived, lost, or not yet known.
  std::vector<int64_t> touched;
  for (auto it = w.unacknowledged.begin(); it != w.unacknowledged.end();) {
    LiveJob* a = FindActive(it->job_id, it->attempt);
    v1::Placement* p = a != nullptr ? PlacementOn(*a, w.id) : nullptr;
    if (p == nullptr) {  // the attempt is over
      it = w.unacknowledged.erase(it);
      continue;
    }
    if (running.count({it->job_id, it->attempt})) {
      Delivered(*a, *p);
      it = w.unacknowledged.erase(it);
      continue;
    }
    // Sent before the answer carrying it went out: says nothing about it.
    if (request.beat() != 0 && request.beat() <= it->beat) {
      ++it;
      continue;
    }
    // Not listed by a heartbeat the agent sent after that answer came or
    // was lost, and no rank of it reported: it never arrived.
    if (it->withdrawn) {
      for (int r : p->ranks()) a->ranks[r].gone = true;
      touched.push_back(*ParseJobId(it->job_id));
      it = w.unacknowledged.erase(it);
      continue;
    }
    Say(absl::StrCat(it->job_id, " attempt ", it->attempt, ": the assignment sent to ", w.id,
                     " did not arrive (heartbeat ", request.beat(), " does not list it); sending it again"));
    *out.add_assignments() = AssignmentFor(*a, *p);
    it->beat = request.beat();
    ++it;
  }
  for (v1::Assignment& as : w.assignments) {
    // The ranks' clocks start now; the assignment counts as delivered once
    // the agent says it arrived.
    if (LiveJob* a = FindActive(as.job_id(), as.attempt()); a != nullptr) {
      for (int r : as.ranks()) a->ranks[r].last_progress = w.last_heartbeat;
    }
    w.unacknowledged.push_back({as.job_id(), as.attempt(), request.beat(), false});
    *out.add_assignments() = std::move(as);
  }
  w.assignments.clear();
  // Stops: those queued, and again for every attempt the agent still runs
  // that is to stop (an earlier answer with its cancellation may have been
  // lost; the agent's stop is idempotent).
  std::set<std::pair<std::string, int>> cancelled;
  for (v1::Cancellation& c : w.cancellations) {
    cancelled.insert({c.job_id(), c.attempt()});
    *out.add_cancellations() = std::move(c);
  }
  w.cancellations.clear();
  // Also an attempt that is over here (lost with its worker, voided at a
  // restart, finished): its stop may have gone out once, in an answer that
  // was lost. The agent stops nothing that has already exited.
  for (const auto& key : running) {
    LiveJob* a = FindActive(key.first, key.second);
    if ((a != nullptr && !(a->cancel_requested || a->has_failure)) || cancelled.count(key)) continue;
    v1::Cancellation* c = out.add_cancellations();
    c->set_job_id(key.first);
    c->set_attempt(key.second);
  }
  for (int64_t seq : touched) {
    MaybeFinish(seq);
    Changed(JobIdOf(seq));
  }
  // Renewed by this answer; the agent freezes its ranks when it lapses
  // (WorkerRegistry::lease says why it ends before the worker timeout).
  out.set_lease_ms(absl::ToInt64Milliseconds(registry_.lease()));
  return out;
}

LiveJob* Coordinator::FindActive(const std::string& job_id, int attempt) {
  auto seq = ParseJobId(job_id);
  if (!seq.ok()) return nullptr;
  auto it = active_.find(*seq);
  if (it == active_.end() || it->second.job.attempt() != attempt) return nullptr;
  return &it->second;
}

absl::Status Coordinator::ReportRankStatus(const v1::RankStatusRequest& request) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  Worker* worker = registry_.FindAttached(request.worker_id());
  if (worker == nullptr) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered"));
  }
  // Alive: a failure held on its account stands. Once this report is taken
  // (on every return), so that its own news (a signal, an out-of-memory)
  // replaces a held failure before that could stand for a moment.
  absl::Cleanup heard = [&] { Heard(worker->id); };
  LiveJob* a = FindActive(request.job_id(), request.attempt());
  if (a == nullptr) return absl::OkStatus();  // a finished job or an old attempt
  if (request.rank() < 0 || request.rank() >= static_cast<int>(a->ranks.size()) ||
      a->ranks[request.rank()].worker_id != request.worker_id()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(), " of ", request.job_id(),
                                                   " is not placed on ", request.worker_id()));
  }
  // A rank's status is the surest sign that its assignment arrived.
  if (v1::Placement* p = PlacementOn(*a, request.worker_id()); p != nullptr && !p->delivered()) {
    Delivered(*a, *p);
    auto& sent = worker->unacknowledged;
    sent.erase(std::remove_if(sent.begin(), sent.end(),
                              [&](const Worker::Sent& x) {
                                return x.job_id == request.job_id() && x.attempt == request.attempt();
                              }),
               sent.end());
  }
  RankState& r = a->ranks[request.rank()];
  const int64_t seq = *ParseJobId(request.job_id());
  if (request.has_started()) {
    if (r.gone) return absl::OkStatus();  // a late duplicate
    r.started = true;
    r.last_progress = absl::Now();
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
  if (r.gone) return absl::OkStatus();  // a retried report already counted
  r.gone = true;
  r.started = true;
  if (v1::Placement* p = PlacementOn(*a, request.worker_id())) {
    p->add_exited_ranks(request.rank());
    // Acknowledged to the agent, which then forgets the exit: synced.
    PLATEAU_RETURN_IF_ERROR(Written(store_->PutJob(a->job, JobStore::Durability::kPowerLoss),
                                    absl::StrCat("record ", a->job.id(), "'s exited rank")));
  }
  // A rank its agent killed in a hung teardown (worker/agent.h) counts as
  // having exited with the code it said: its work was over.
  const int signal = e.killed_in_teardown() ? 0 : e.signal();
  const bool failed = signal != 0 || e.exit_code() != kRankExitOk;
  if (failed && !a->cancel_requested) {
    v1::Failure f;
    f.set_rank(request.rank());
    f.set_exit_code(e.exit_code());
    f.set_signal(signal);
    f.set_worker_id(request.worker_id());
    int priority;
    const std::string detail =
        absl::StrCat(e.message().empty() ? "" : absl::StrCat(": ", e.message()),
                     e.killed_in_teardown() ? " (then its teardown hung: its agent killed it)" : "");
    if (e.stopped_by_agent()) {
      f.set_kind(v1::Failure::RANK_CRASHED);
      f.set_message(absl::StrCat("rank ", request.rank(), " was stopped by its agent", detail));
      priority = kPriorityStopped;
    } else if (e.error_code() == "RESOURCE_EXHAUSTED" || e.exit_code() == kRankExitOutOfMemory) {
      f.set_kind(v1::Failure::OUT_OF_MEMORY);
      f.set_live_set(e.live_set());
      std::string bytes;
      if (e.has_out_of_memory()) {
        const v1::OutOfMemory& o = e.out_of_memory();
        *f.mutable_out_of_memory() = o;
      }
      // The rank's own message (MemorySpace::OutOfMemory) already names the
      // space, the bytes asked and free, the cap and what was in use: said
      // again here it read twice. The summary only stands in for a rank
      // that sent the numbers without a message.
      if (e.has_out_of_memory() && e.message().empty()) {
        const v1::OutOfMemory& o = e.out_of_memory();
        bytes = absl::StrCat(": asked for ", o.bytes_requested(), " bytes of ", o.space(), " memory, ",
                             o.bytes_free(), " free",
                             o.cap_bytes() > 0 ? absl::StrCat(" of its ", o.cap_bytes(), "-byte cap") : "");
      }
      f.set_message(absl::StrCat("out of memory on rank ", request.rank(),
                                 e.live_set().empty() ? "" : absl::StrCat(" in live set '", e.live_set(), "'"),
                                 bytes, detail));
      priority = kPriorityOutOfMemory;
    } else if (signal != 0) {
      f.set_kind(v1::Failure::RANK_CRASHED);
      f.set_message(absl::StrCat("rank ", request.rank(), " was killed by signal ", signal, " (",
                                 strsignal(signal), ")"));
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
    if (first && priority == kPriorityExit) {
      // The other workers with ranks still running: one may have died
      // under its peers (SIGKILL, a power cut), whose ranks then exit with
      // a connection error long before its worker timeout. Held until each
      // is heard from again or lost, so that the healthy worker is not
      // named as the cause meanwhile.
      for (const RankState& x : a->ranks) {
        if (!x.gone && x.worker_id != request.worker_id()) a->judging.insert(x.worker_id);
      }
    }
    RecordFailure(*a, f, priority);
    if (first) StopRanks(*a);  // the other ranks would wait on a dead peer
    // Withdrawn ranks (never sent) are gone without a word from their
    // worker, which then has nothing to be judged on.
    for (auto it = a->judging.begin(); it != a->judging.end();) {
      const bool running = std::any_of(a->ranks.begin(), a->ranks.end(),
                                       [&](const RankState& x) { return !x.gone && x.worker_id == *it; });
      it = running ? std::next(it) : a->judging.erase(it);
    }
    if (a->has_failure && a->job.failure_held_for_size() != static_cast<int>(a->judging.size())) {
      Rejudged(*a, "the workers it waited on have no ranks left");
    }
  }
  MaybeFinish(seq);
  Changed(request.job_id());
  return absl::OkStatus();
}

absl::Status Coordinator::ReportTelemetry(v1::TelemetryRequest request) {
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  Worker* w = registry_.FindAttached(request.worker_id());
  if (w == nullptr) {
    return absl::NotFoundError(absl::StrCat("worker_id: '", request.worker_id().substr(0, 64),
                                            "' is not registered"));
  }
  // A batch stored before, sent again because its answer was lost: its log
  // lines would be appended twice. (Across a coordinator restart this is
  // not known: docs/SERVICE.md.)
  const uint64_t sender = request.sender();
  const int64_t batch = request.batch();
  if (batch > 0 && sender == w->batch_sender && batch <= w->batch_stored) return absl::OkStatus();
  // Events, progress and metrics are worked out by server/telemetry.h; the
  // writes go through Written here.
  TelemetryBatch b = IngestTelemetry(
      std::move(request),
      [this](const std::string& job_id, int attempt) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return FindActive(job_id, attempt);  // under mu_, held by this call
      },
      metrics_);
  // Log lines of jobs that exist, from a worker that hosted them: a line
  // for a job id not yet given out was stored and shown as the log of the
  // job that later got the id, one for a deleted job was a row no delete
  // would sweep, and any worker could write into any job's log. A finished
  // job's last lines still count (they arrive after its end), until the
  // retention pass has removed its logs (a line then would start them
  // again at index 0, which a client resuming "from N" would never read).
  const auto hosted = [&](const v1::Job& job) {  // (request was moved from)
    return std::find(job.hosted_by().begin(), job.hosted_by().end(), w->id) != job.hosted_by().end();
  };
  std::map<std::string, bool> accepted;
  b.logs.erase(std::remove_if(b.logs.begin(), b.logs.end(),
                              [&](const v1::LogEntry& l) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                auto [it, added] = accepted.emplace(l.job_id(), false);
                                if (added) {
                                  auto seq = ParseJobId(l.job_id());
                                  auto live = seq.ok() ? active_.find(*seq) : active_.end();
                                  if (live != active_.end()) {
                                    it->second = hosted(live->second.job);
                                  } else if (seq.ok()) {
                                    const absl::StatusOr<v1::Job> stored = store_->GetJob(l.job_id());
                                    it->second = stored.ok() && !stored->has_events_deleted_time() && hosted(*stored);
                                  }
                                }
                                return !it->second;
                              }),
               b.logs.end());
  // The reports first: a restarted coordinator rebuilds the steps not yet
  // events from them (RestoreSteps).
  PLATEAU_RETURN_IF_ERROR(Written(store_->PutRankSteps(b.rank_steps), "store the ranks' step reports"));
  PLATEAU_RETURN_IF_ERROR(Written(store_->AppendEvents(b.events), "append step events"));
  PLATEAU_RETURN_IF_ERROR(Written(store_->AppendLogs(b.logs), "append log lines"));
  PLATEAU_RETURN_IF_ERROR(Written(store_->PutMemoryTimelines(b.timelines), "store memory timelines"));
  for (LiveJob* a : b.progressed) {
    absl::StatusOr<int64_t> events = store_->EventCount(a->job.id());
    PLATEAU_RETURN_IF_ERROR(Written(events.status(), absl::StrCat("count ", a->job.id(), "'s events")));
    a->job.set_event_count(*events);
    PLATEAU_RETURN_IF_ERROR(Written(store_->PutJob(a->job), absl::StrCat("record ", a->job.id(), "'s progress")));
  }
  for (const v1::JobEvent& e : b.events) Changed(e.job_id());
  for (const v1::LogEntry& l : b.logs) Changed(l.job_id());
  if (batch > 0) {
    w->batch_sender = sender;
    w->batch_stored = batch;
  }
  return absl::OkStatus();
}

// The rendezvous store (server/rendezvous_store.h) under mu_: a Set is
// written through Written like every store write, and wakes KvGet waiters.

const LiveJob* Coordinator::AttemptOfKey(const std::string& key, int* attempt) {
  const std::vector<std::string> parts = absl::StrSplit(key, absl::MaxSplits('/', 2));
  const LiveJob* a = nullptr;
  if (parts.size() == 3 && !parts[2].empty() && absl::StartsWith(parts[1], "attempt-") &&
      absl::SimpleAtoi(absl::StripPrefix(parts[1], "attempt-"), attempt)) {
    a = FindActive(parts[0], *attempt);
  }
  // Exactly its prefix: not "attempt-01", which names it in numbers.
  if (a == nullptr || !absl::StartsWith(key, AttemptPrefix(a->job.id(), a->job.attempt()) + "/")) return nullptr;
  return a;
}

absl::Status Coordinator::MarkMet(const std::string& key, std::optional<int> rank) {
  int attempt = -1;
  const LiveJob* a = AttemptOfKey(key, &attempt);
  if (a == nullptr) return absl::OkStatus();
  const int64_t ranks = a->job.spec().layout().ranks();
  if (rank.has_value() && (*rank < 0 || *rank >= ranks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", *rank, " is not a rank of ", a->job.id(), " (0 to ", ranks - 1, ")"));
  }
  if (rendezvous_.Met(a->job.id(), attempt, rank)) return absl::OkStatus();
  // A mark to write: not while frozen (a read served without its mark would
  // leave the rank uncounted after the restart that recovers).
  PLATEAU_RETURN_IF_ERROR(store_error_);
  return Written(rendezvous_.MarkMet(a->job.id(), attempt, rank),
                 absl::StrCat("record that a rank of ", AttemptPrefix(a->job.id(), attempt), " began to meet"));
}

absl::Status Coordinator::KvSet(const std::string& key, const std::string& value, std::optional<int> rank) {
  PLATEAU_RETURN_IF_ERROR(RendezvousStore::CheckKey(key));
  PLATEAU_RETURN_IF_ERROR(RendezvousStore::CheckValue(value));
  absl::MutexLock lock(&mu_);
  PLATEAU_RETURN_IF_ERROR(store_error_);  // frozen after a failed write (Written)
  // Only a live attempt's ranks write, under exactly its prefix: keys leave
  // only with their attempt (DeleteAttempt), so any other would be kept,
  // and reloaded at every start, for good.
  int attempt = -1;
  const LiveJob* a = AttemptOfKey(key, &attempt);
  if (a == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "key: expected one under a live attempt's prefix (job-N/attempt-A/...), got '", key.substr(0, 256), "'"));
  }
  if (RendezvousStore::IsOwnKey(key)) {
    return absl::FailedPreconditionError(
        absl::StrCat("key: '", key.substr(0, 256), "' is under the attempt's .met/, which is the coordinator's"));
  }
  // Bounded per attempt: every key stays in memory and in the store, and
  // is reloaded at every start, until the attempt ends. A job's ranks write
  // a few keys each (Gloo's addresses per group, NCCL's id); a new key
  // past the bound is refused. (A key set again replaces its value.)
  const int64_t ranks = a->job.spec().layout().ranks();
  const int64_t max_keys = 1024 + 64 * ranks, max_bytes = (int64_t{64} << 20) + 4096 * max_keys;
  const RendezvousStore::Usage used = rendezvous_.AttemptUsage(a->job.id(), attempt);
  if (!rendezvous_.Contains({key}) &&
      (used.keys + 1 > max_keys || used.bytes + static_cast<int64_t>(key.size() + value.size()) > max_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("key: ", AttemptPrefix(a->job.id(), attempt), " holds ", used.keys,
                                                     " keys of ", used.bytes, " bytes; an attempt of ", ranks,
                                                     " ranks may hold ", max_keys, " keys of ", max_bytes, " bytes"));
  }
  // Who met first, then the key: a key is never there without its writer
  // marked (Reattach reads the marks).
  PLATEAU_RETURN_IF_ERROR(MarkMet(key, rank));
  // No stream waits on keys (a KvGet waits on the key itself).
  PLATEAU_RETURN_IF_ERROR(Written(rendezvous_.Set(key, value), absl::StrCat("store the key ", key)));
  return absl::OkStatus();
}

absl::StatusOr<std::string> Coordinator::KvGet(const std::string& key, absl::Duration wait, std::optional<int> rank) {
  PLATEAU_RETURN_IF_ERROR(RendezvousStore::CheckKey(key));
  absl::MutexLock lock(&mu_);
  if (rank.has_value()) PLATEAU_RETURN_IF_ERROR(MarkMet(key, rank));
  return rendezvous_.Get(mu_, key, wait, &stop_);
}

absl::StatusOr<bool> Coordinator::KvCheck(const std::vector<std::string>& keys, std::optional<int> rank) {
  absl::MutexLock lock(&mu_);
  if (rank.has_value() && !keys.empty()) PLATEAU_RETURN_IF_ERROR(MarkMet(keys[0], rank));
  return rendezvous_.Contains(keys);
}

}  // namespace plateau
