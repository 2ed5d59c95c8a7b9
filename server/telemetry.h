// Telemetry ingestion: a worker's batch (TelemetryRequest) of per-step
// telemetry and log lines turned into what the coordinator keeps: each
// rank's report (stored per rank: the durable buffer of steps not yet
// complete, and the per-rank detail a watch may ask for), one JobEvent per
// step of the whole job once every rank of the attempt has reported it
// (JobStepSummary: loss, tokens, time, the slowest rank, peaks as the
// maximum over ranks), the job's Progress (from those steps), each rank's
// progress clock (the hang check reads it), the per-rank Prometheus series,
// and the log lines as stored. It writes nothing to the store: the
// Coordinator writes the batch through its Written, so a failed write
// freezes it as any other.
//
// A step is complete when every rank's latest reported step is at or past
// it (ranks report their steps in order; one that skipped a step does not
// hold the others back). A rank that never reports it (it crashed, its
// worker was lost, the attempt was cancelled) does not hold it forever:
// when the attempt ends the coordinator flushes what is pending
// (FlushSteps), each step as a summary of the ranks that did report it
// (JobStepSummary.ranks_reported < ranks), so nothing is lost, nothing
// waits, and nothing stays in memory.
//
// Thread safety: plain functions over LiveJobs owned by the Coordinator;
// they are called under the Coordinator's mutex, which guards those jobs.
#ifndef PLATEAU_SERVER_TELEMETRY_H_
#define PLATEAU_SERVER_TELEMETRY_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "plateau/v1/job.pb.h"
#include "plateau/v1/worker.pb.h"
#include "server/job_store.h"
#include "server/live_job.h"
#include "server/metrics.h"

namespace plateau {

// Longer log lines are cut to this many bytes.
constexpr size_t kMaxLogLineBytes = 16384;

struct TelemetryBatch {
  // Each new report of a rank, to store (JobStore::PutRankSteps) before
  // the events: a restarted coordinator rebuilds its pending steps from them.
  std::vector<JobRankStep> rank_steps;
  std::vector<v1::JobEvent> events;  // to append; one per step now complete
  std::vector<v1::LogEntry> logs;    // to append
  // Jobs whose Progress moved (a step completed), to be stored again; each
  // once.
  std::vector<LiveJob*> progressed;
  // The memory timelines the steps carried (to store: the latest per rank),
  // taken out of their reports so that stored steps stay small.
  std::vector<JobMemoryTimeline> timelines;
};

// Applies `request`, sent by a worker, to the live jobs `find` returns
// (nullptr: a finished job or an old attempt, whose steps are dropped).
// A step's memory timeline goes to `timelines`, stamped with the time it
// arrived and the step's rank, step and attempt. A step at or below a
// rank's last one is a batch re-sent after a lost reply and is not counted
// twice; a rank out of range is dropped, as is a report of a rank another
// worker than `request.worker_id` hosts, a step outside 1 .. the spec's
// steps, a peak of a live set that does not exist, and a log line whose
// job id is malformed (the caller drops lines of jobs that do not exist).
// `metrics` may be null (no series).
TelemetryBatch IngestTelemetry(v1::TelemetryRequest request,
                               absl::FunctionRef<LiveJob*(const std::string& job_id, int attempt)> find,
                               Metrics* metrics);

// The attempt is over: its pending steps become events now, each over the
// ranks that reported it, in step order; the job's Progress moves with them.
std::vector<v1::JobEvent> FlushSteps(LiveJob& a);

// After a coordinator restart: the attempt's stored reports (`reports`, any
// order) and its latest step event (`emitted`; 0: none). Steps after
// `emitted` are pending again, each rank's last step is its latest report,
// and the steps that completed before the restart without becoming an
// event are returned as events (to append), so none is lost or repeated.
std::vector<v1::JobEvent> RestoreSteps(LiveJob& a, const std::vector<v1::StepTelemetry>& reports,
                                       int64_t emitted);

// One event of a step from the reports of the ranks that sent it (by rank;
// `reported` says which are set). Exposed for tests.
v1::JobStepSummary SummarizeStep(const PendingStep& p);

}  // namespace plateau

#endif  // PLATEAU_SERVER_TELEMETRY_H_
