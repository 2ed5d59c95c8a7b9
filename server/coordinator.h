// The coordinator's core, independent of the RPC layer: a facade over its
// parts, which it owns and keeps under its one mutex, plus the job state
// machine itself (SetState/Transition, Finish/MaybeFinish, StopRanks,
// RecordFailure; below). The parts, each with its own test:
//   server/placement.h         where a pending job's ranks go (a pure function)
//   server/worker_registry.h   registered workers, ids, heartbeat expiry
//   server/rendezvous_store.h  the ranks' key-value store (KvSet/KvGet/KvCheck)
//   server/telemetry.h         steps into events, progress and metrics; log lines
//   server/live_job.h          a live job's in-memory record
//
// Job lifecycle (docs/SERVICE.md):
//   PENDING -> SCHEDULED (placed; assignments go out with heartbeats)
//           -> RUNNING (every rank started) -> SUCCEEDED | FAILED
//   any live state -> CANCELLING (ranks being stopped) -> CANCELLED
//   a crashed or lost attempt with restarts left -> RESTARTING -> PENDING
//   PENDING -> FAILED (UNSCHEDULABLE) when no registered worker could host
//              the job for its max_pending_s
//   any live state -> FAILED (MAX_DURATION_EXCEEDED) once JobSpec.
//              max_duration_s has passed since Job.start_time (its first
//              start), after its ranks are stopped; never restarted
// Pending jobs are placed in order of JobSpec.priority (higher first), then
// submission; a running job is never preempted.
// A job leaves SCHEDULED/RUNNING/CANCELLING only when every rank has been
// reported gone by its agent (process group empty) or its worker was lost.
//
// Faults (docs/SERVICE.md "Faults"): a worker silent for worker_timeout is
// lost and its ranks count as gone; a rank without a step for the job's
// progress timeout is hung and its attempt is stopped. A restarted
// coordinator re-attaches the attempts it finds live in the store: every
// worker they were placed on has reattach_timeout to register again with
// its old id and the ranks it still runs; what does not come back is lost.
// What that needs is kept in the store as it happens: placements (with
// delivery and exited ranks), the attempt's failure, the rendezvous keys.
//
// Steps (server/telemetry.h): each rank's report is stored as it arrives;
// the job's event for a step is written once every rank of the attempt has
// reported it, and when the attempt ends whatever is still pending is
// written over the ranks that did report. A restarted coordinator rebuilds
// the pending steps from the stored reports and resumes after the last
// step event, so no step event is lost or written twice.
//
// Retention: a finished job's events, logs, memory timelines and rank
// reports are removed `retention` after its end by a periodic sweep (the
// job itself stays, marked events_deleted_time); DeleteJob removes a
// finished job entirely.
//
// The coordinator's own log (CoordinatorOptions::log): one line per event
// an operator wants to see: job transitions, failures, workers registered,
// re-registered and lost, re-attachment after a restart, deletions and
// retention sweeps, each naming the job or worker id.
//
// The RPC services (server/services.h) translate requests into these calls;
// authentication and TLS are layered there, not here.
//
// Thread safety: every public method may be called from any thread. One
// mutex (mu_) guards the coordinator and all its parts; it is held across
// store writes (the store is the record, so memory never runs ahead of it).
#ifndef PLATEAU_SERVER_COORDINATOR_H_
#define PLATEAU_SERVER_COORDINATOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "plateau/v1/job.pb.h"
#include "plateau/v1/worker.pb.h"
#include "server/job_store.h"
#include "server/live_job.h"
#include "server/metrics.h"
#include "server/rendezvous_store.h"
#include "server/worker_registry.h"

namespace plateau {

struct CoordinatorOptions {
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // A worker silent for this long is lost; its jobs fail (or restart).
  // Two heartbeat intervals: one missed heartbeat is tolerated.
  absl::Duration worker_timeout = absl::Seconds(2);
  // After a restart: how long the workers of live jobs have to register
  // again before they count as lost.
  absl::Duration reattach_timeout = absl::Seconds(10);
  // JobSpec.progress_timeout_s when the spec leaves it 0.
  absl::Duration default_progress_timeout = absl::Seconds(600);
  // JobSpec.max_pending_s when the spec leaves it 0: how long a job that no
  // registered worker could host stays PENDING before it fails; 0: forever.
  absl::Duration default_max_pending = absl::Seconds(600);
  absl::Duration tick = absl::Milliseconds(100);
  // A finished job's metric series are removed this long after its final
  // state (Prometheus has scraped the final values by then); 0: kept until
  // the coordinator restarts.
  absl::Duration metrics_retention = absl::Minutes(15);
  // A finished job's events, logs, memory timelines and per-rank step
  // reports are removed this long after its final state; 0: kept forever.
  absl::Duration retention = absl::Hours(24 * 30);
  // A PENDING job whose waiting reason changes (it names every worker's
  // free slots) gets an event for it at most this often; the job itself
  // always has the latest reason.
  absl::Duration pending_reason_event_every = absl::Minutes(1);
  // A per-rank read of a job's events (WatchJob's per_rank) carries every
  // rank's report of each step event: it reads at most this many reports'
  // worth of events at once (at least one), so a watch of a thousand-rank
  // job does not build 256 events x 1,000 reports in one read.
  int64_t per_rank_reports_per_read = 4096;
  // The coordinator's own log, one line per call (no newline); unset: the
  // line goes to stdout with the time and "plateau_coordinator: ".
  std::function<void(const std::string&)> log;
  // For tests: called by DeleteJob after each part of a job's data it
  // deleted, with the lock released (the number of rows of that part).
  std::function<void(int64_t rows)> after_delete_part;
  // For tests: called by ListJobs between its reads of stored jobs (a
  // label_selector's scan reads kListScanRows at a time), with no lock held.
  std::function<void()> between_list_reads;
  // For tests: called by PlanJob and SubmitJob before each shape their
  // plan's N_max and what-if searches plan, with no lock held.
  std::function<void()> between_plan_shapes;
};

// Asked between the parts of a long call that is work for its caller alone
// (a ListJobs scan's reads, the shapes a plan searches), with no lock held: a status that is not OK
// ends the call with it. The RPC layer answers DEADLINE_EXCEEDED once the
// caller's deadline has passed and CANCELLED once it went away, so that a
// call nobody waits for stops within one part instead of running to its
// end. (A DeleteJob is not asked: it runs to its end, wanted or not.)
// Empty: never asked (callers inside the process).
using StillWanted = std::function<absl::Status()>;

bool IsTerminal(v1::JobState state);

// What every line the coordinator prints starts with: now, UTC, to the
// millisecond (journald adds its own time; a file or a terminal has none).
std::string LogTime();

// SubmitJobRequest.request_id: "" or 1 to 128 characters of [A-Za-z0-9._:-];
// INVALID_ARGUMENT naming request_id otherwise.
absl::Status CheckRequestId(const std::string& id);

class Coordinator {
 public:
  Coordinator(JobStore* store, Metrics* metrics, CoordinatorOptions options);
  ~Coordinator();

  // Recovers jobs left live by a previous coordinator and starts the
  // scheduler thread.
  absl::Status Start();
  void Stop();

  // --- JobService
  // `caller` (server/security.h CallerOf) is recorded as the job's
  // submitted_by or cancelled_by and in the coordinator's log; "" from
  // callers inside the process (tests). SubmitJob and PlanJob hold a spec
  // to the rules for new jobs (worker/job_spec.h ValidateNewJobSpec) too;
  // placing, restarting and running a stored job do not.
  // `still_wanted` is asked between the shapes the plan of SubmitJob and
  // PlanJob searches (N_max and the what-if table, worker/job_spec.h
  // PlanJob): a plan is work for its caller alone. A submit is asked only
  // while it plans, never once it stores the job.
  absl::StatusOr<v1::SubmitJobResponse> SubmitJob(const v1::SubmitJobRequest& request, const std::string& caller = "",
                                                  const StillWanted& still_wanted = nullptr);
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  // `still_wanted` is asked between the reads of a label_selector's scan.
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request,
                                                const StillWanted& still_wanted = nullptr);
  absl::StatusOr<v1::Job> CancelJob(const std::string& id, const std::string& caller = "");
  absl::StatusOr<v1::PlanJobResponse> PlanJob(const v1::PlanJobRequest& request,
                                              const StillWanted& still_wanted = nullptr);
  // The latest memory timeline of each rank and the job's plan. NOT_FOUND:
  // no such job; FAILED_PRECONDITION: none recorded yet (or never: the spec
  // sets memory_timeline_every to 0).
  absl::StatusOr<v1::GetMemoryTimelineResponse> GetMemoryTimeline(const std::string& id);
  // The registered workers (and those a restart expects back), by id.
  v1::ListWorkersResponse ListWorkers();
  // Deletes a finished job and everything of it (events, logs, timelines,
  // rank reports, metric series). FAILED_PRECONDITION when it is not
  // finished, ABORTED while another DeleteJob of it is under way; NOT_FOUND when there
  // is no such job. The data goes in parts of at most kSweepRowsPerTick
  // rows, the lock released between them (a job of millions of rows held
  // it for seconds: every heartbeat waited, past the agents' lease); the
  // job is marked first (events_deleted_time: it reads as swept), with the
  // delete recorded as begun (JobStore::BeginDelete), and its record goes
  // last. It runs to its end whether or not the caller still waits; a
  // shutdown (Stop) ends it between parts, UNAVAILABLE. A delete cut short
  // (a shutdown, a crash) is finished by the next start, in the ticks, at
  // most kSweepRowsPerTick rows a tick (ResumeDeletes); a DeleteJob of it
  // meanwhile is ABORTED.
  absl::Status DeleteJob(const std::string& id, const std::string& caller = "");
  // The events of a job from `from` (at most `limit`), as WatchJob sends
  // them: with every rank's report in each step event when `per_rank`, and
  // then at most per_rank_reports_per_read / ranks events (at least one).
  absl::StatusOr<std::vector<v1::JobEvent>> ReadEvents(const std::string& id, int64_t from, int limit,
                                                       bool per_rank);
  // What a stream of one job waits on: that job's counter, which grows
  // whenever its events, logs or state change, and the coordinator's, which
  // grows on changes to no one job (a sweep, a registration, a failed
  // store write). A counter of the whole coordinator woke every open stream
  // of every job on each worker's telemetry batch (each wake copying its job
  // under mu_ and reading SQLite): the cost grew with watchers times the
  // cluster's change rate, not the watched job's.
  struct ChangeStamp {
    uint64_t job = 0;
    uint64_t all = 0;
    bool operator==(const ChangeStamp& o) const { return job == o.job && all == o.all; }
  };
  ChangeStamp JobVersion(const std::string& job_id);
  // Returns when the stamp of `job_id` differs from `seen`, the coordinator
  // stops, or after `timeout`; the stamp then.
  ChangeStamp WaitForJobChange(const std::string& job_id, ChangeStamp seen, absl::Duration timeout);
  // Whether Stop has been called (streams end, UNAVAILABLE).
  bool stopping();
  JobStore& store() { return *store_; }

  // OK while every write to the state database has succeeded; after a failed
  // one, UNAVAILABLE saying what failed: the coordinator then refuses every
  // change and reports not ready until it is restarted (it recovers from the
  // database).
  absl::Status Health();

  // --- WorkerService
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::Status ReportRankStatus(const v1::RankStatusRequest& request);
  absl::Status ReportTelemetry(v1::TelemetryRequest request);
  // `rank`: the attempt's rank calling (KvSetRequest.rank), recorded as
  // having begun to meet (RendezvousStore::MarkMet); INVALID_ARGUMENT
  // outside the attempt's ranks. A Set without one counts as any rank's; a
  // Get or Check without one is not counted. Keys under an attempt's
  // ".met/" are the coordinator's own: a Set there is refused.
  absl::Status KvSet(const std::string& key, const std::string& value, std::optional<int> rank = std::nullopt);
  // NOT_FOUND when the key is still unset after `wait`.
  absl::StatusOr<std::string> KvGet(const std::string& key, absl::Duration wait,
                                    std::optional<int> rank = std::nullopt);
  absl::StatusOr<bool> KvCheck(const std::vector<std::string>& keys, std::optional<int> rank = std::nullopt);

 private:
  // What a plan asks between the shapes it searches (worker/job_spec.h
  // PlanJob): the test hook, then `still_wanted`, whose stop then says
  // that `call` stopped planning. nullptr when neither is set.
  std::function<absl::Status()> PlanStillWanted(const StillWanted& still_wanted, const char* call) const;
  void Loop();
  void Tick() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places pending jobs that fit; marks the ones no registered worker could
  // ever host as unschedulable, and fails those marked for max_pending.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks a PENDING job that no registered worker could host (`why`), or
  // fails it when it has been so for its max_pending: false then (the
  // caller erases it).
  bool MarkUnschedulable(LiveJob& a, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heartbeat said the worker's agent is shutting down
  // (HeartbeatRequest.leaving): no new work for it, and its live attempts
  // fail WORKER_LOST now rather than once its heartbeats stop.
  void Leaving(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails every live attempt with ranks not yet gone on `worker_id` as
  // WORKER_LOST with `message`, stops its ranks elsewhere and ends what can
  // end; returns how many. `ranks_gone`: its ranks there count as gone (a
  // lost worker), else their exits are awaited (a leaving one).
  int FailAttemptsOn(const std::string& worker_id, const std::string& message, bool ranks_gone)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "; it ran no live job" or "; N live job(s) affected", for Say.
  static std::string AffectedJobs(int touched);
  void CheckProgress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the events and logs of jobs finished longer than retention ago.
  // Deletes up to `budget` rows (the tick's budget) of due jobs' data.
  void SweepRetention(int64_t budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One part of the deletes a restart cut short (resumed_deletes_), up to
  // *budget rows (taken from it); a delete whose data is all gone is
  // finished (FinishDelete).
  void ResumeDeletes(int64_t* budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The end of a delete whose data is gone: the job's record (with its
  // request id and its record of the delete), its rendezvous keys, its
  // count and metric series; the log says who asked, its state and events
  // (`event_count` -1: its record did not parse) and `how` it went. The
  // store's error (frozen) when the record cannot be deleted.
  absl::Status FinishDelete(int64_t seq, v1::JobState state, const std::string& caller, int64_t event_count,
                            const std::string& how) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The gauges computed from the registry and the live jobs.
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a restart: the attempt's steps reported but not yet events
  // (server/telemetry.h RestoreSteps); `flush`: the attempt is over, write
  // them all.
  absl::Status RestoreSteps(LiveJob& a, bool flush) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends step events and records the job's progress and event count.
  void WriteSteps(LiveJob& a, std::vector<v1::JobEvent> events) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One line of the coordinator's own log (CoordinatorOptions::log).
  void Say(const std::string& line);
  // Stops (then fails) jobs past their JobSpec.max_duration_s, counted from
  // Job.start_time; a job between attempts fails at once.
  void CheckMaxDuration() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The answer to a retried idempotent submit: the job its request_id
  // created (ALREADY_EXISTS when the spec differs); nullopt when none.
  absl::StatusOr<std::optional<v1::SubmitJobResponse>> Resubmitted(const v1::SubmitJobRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rebuilds a live attempt read from the store after a restart.
  absl::Status Restore(int64_t seq, v1::Job job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Restore found a corrupt record of job `seq` (`why`, DATA_LOSS): the job
  // fails (STATE_CORRUPT, not restarted) and leaves the live jobs.
  absl::Status FailCorruptJob(int64_t seq, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A live job whose row does not parse: replaced by a FAILED record
  // (STATE_CORRUPT) saying so, its spec lost (events and logs stay), its
  // rendezvous keys deleted; counted and forgotten as any job that fails.
  absl::Status FailUnreadableJob(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A job reached a final state: its metric series go
  // --metrics_retention_s from now (forget_).
  void ForgetMetricsLater(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One part of a due job's data (SweepRetention); true once all of it is
  // gone and the job records so.
  // Takes what it deletes from *budget (rows).
  bool SweepJob(v1::Job& job, int64_t* budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker registering again with the ranks it runs: attach them.
  // `expected`: the restart left ranks of live jobs placed on it.
  // `after`: what happened, for logs and failures ("the coordinator's
  // restart", "its agent's restart").
  void Reattach(Worker& w, bool expected, const std::string& after, const v1::RegisterRequest& request,
                v1::RegisterResponse* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Assignment AssignmentFor(const LiveJob& a, const v1::Placement& p);
  v1::Placement* PlacementOn(LiveJob& a, const std::string& worker_id);
  // Every write to the store goes through these: a failed write is kept in
  // store_error_ (the first one), which freezes the coordinator (Tick does
  // nothing, changes are refused, Health() says why) instead of letting its
  // memory and its database silently diverge. Written returns store_error_
  // for a request to fail with; Write is for paths with no request.
  absl::Status Written(absl::Status s, absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Write(absl::Status s, absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // SetState from a path with no request to fail (a failure is recorded).
  void Transition(LiveJob& a, v1::JobState state, const std::string& reason,
                  const v1::Failure* failure = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a state change: an event, the stored job, metrics, waiters.
  absl::Status SetState(LiveJob& a, v1::JobState state, const std::string& reason,
                        const v1::Failure* failure = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank of the attempt is gone: decide the outcome.
  void Finish(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinish(int64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops the attempt's ranks: a cancellation to each worker whose
  // assignment arrived or may have; one not sent is withdrawn and its ranks
  // count as gone.
  void StopRanks(LiveJob& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker of `p` has the assignment (it listed the attempt, or a rank
  // reported): recorded, so that a restarted coordinator re-attaches the
  // ranks rather than sending it again.
  void Delivered(LiveJob& a, v1::Placement& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Makes `f` the attempt's failure unless one of `priority` or higher is,
  // and publishes it, held while LiveJob::judging names workers (a failure
  // of a higher priority than a rank's exit ends the hold).
  void RecordFailure(LiveJob& a, const v1::Failure& f, int priority) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Job.failure and Job.failure_held_for become the attempt's failure and
  // its judging set, stored.
  void PublishFailure(LiveJob& a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The judging set shrank (`why`): published again, and said when the
  // failure now stands.
  void Rejudged(LiveJob& a, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker `worker_id` was heard from (a heartbeat, a rank's report): it
  // leaves the attempts' judging sets, and a held failure with none left
  // stands. Not the attempts in `reporting` (job id, attempt): a heartbeat
  // or a registration lists those with ranks there still running (being
  // stopped) or whose exits the agent has yet to have acknowledged, and
  // their exit reports (a signal outranks the held exit) settle the hold
  // there.
  void Heard(const std::string& worker_id, const std::set<std::pair<std::string, int>>& reporting = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  LiveJob* FindActive(const std::string& job_id, int attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A change to no one job (ChangeStamp::all), and one to `job_id`'s rows or
  // state (ChangeStamp::job).
  void Changed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++version_; }
  // Only a live job's (a finished job's streams have ended; a late log line
  // of one would leave an entry behind for good).
  void Changed(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A line of the job's log from the coordinator itself (rank -1).
  void Log(const std::string& job_id, int attempt, const std::string& line) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The live attempt whose prefix (AttemptPrefix + "/") `key` is exactly
  // under, with its number; nullptr when none.
  const LiveJob* AttemptOfKey(const std::string& key, int* attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records that `rank` (nullopt: any) of `key`'s live attempt has begun to
  // meet; INVALID_ARGUMENT for a rank outside it, the store's error when
  // frozen and the mark is not there yet. Nothing for a key of no live
  // attempt, or a rank already marked.
  absl::Status MarkMet(const std::string& key, std::optional<int> rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobStore* const store_;
  Metrics* const metrics_;
  const CoordinatorOptions options_;

  absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  // Per job id; a job's entry leaves with it (deleted or swept), which its
  // watchers see as a change.
  std::map<std::string, uint64_t> job_versions_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // When Start ran: for reattach_timeout after it, workers that were
  // registered before a restart may still be registering again, so no job
  // is newly found unschedulable and none fails for it.
  absl::Time started_ ABSL_GUARDED_BY(mu_);
  WorkerRegistry registry_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, LiveJob> active_ ABSL_GUARDED_BY(mu_);  // by job seq; the live jobs
  RendezvousStore rendezvous_ ABSL_GUARDED_BY(mu_);
  // Finished jobs whose metric series go at the given time, oldest first.
  std::deque<std::pair<absl::Time, std::string>> forget_ ABSL_GUARDED_BY(mu_);
  // Jobs in the store by state (the plateau_jobs gauge), kept in step with
  // SetState from a count at Start.
  std::map<v1::JobState, int64_t> job_counts_ ABSL_GUARDED_BY(mu_);
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_);
  // The finished jobs whose data is still stored, by end time then seq:
  // what the retention sweep will clear, in the order it comes due. Read
  // from the store once at Start, kept by SetState (a job's end) and the
  // sweep; a job deleted meanwhile is dropped when its turn comes. (The
  // sweep listed and parsed every finished job from the oldest not yet
  // due at each pass: a month of jobs under the lock every 10 minutes.)
  std::set<std::pair<absl::Time, int64_t>> unswept_ ABSL_GUARDED_BY(mu_);
  // Jobs (by seq) whose DeleteJob is deleting their data in parts, or
  // whose delete a restart cut short (resumed_deletes_): a second DeleteJob
  // is refused (ABORTED). (The sweep and late log lines see the mark
  // DeleteJob writes first: events_deleted_time.)
  std::set<int64_t> deleting_ ABSL_GUARDED_BY(mu_);
  // The deletes a previous coordinator began and did not finish (the
  // store's UnfinishedDeletes at Start), finished by the ticks.
  struct ResumedDelete {
    std::string caller;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;  // the row's: counted in job_counts_
    int64_t event_count = -1;                        // -1: its record does not parse
    int parts = 0;
  };
  std::map<int64_t, ResumedDelete> resumed_deletes_ ABSL_GUARDED_BY(mu_);
  // The first failed write to the store (see Written); OK while none failed.
  absl::Status store_error_ ABSL_GUARDED_BY(mu_);
  // Heartbeats that have arrived and wait for mu_, by worker id (a count:
  // a retry may overlap its predecessor). mu_ is held across store writes,
  // which can stall for seconds on a busy disk (SQLite's busy timeout is
  // 5 s); a worker whose heartbeat waits on the coordinator is alive, and
  // ExpireWorkers must not declare it lost for the coordinator's own delay.
  // Its own small lock, taken before mu_ and never while holding it
  // except in ExpireWorkers (inflight_mu_ is always the inner lock).
  absl::Mutex inflight_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::map<std::string, int> inflight_beats_ ABSL_GUARDED_BY(inflight_mu_);
  std::thread thread_;
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_COORDINATOR_H_
