// Telemetry ingestion: a worker's batch (TelemetryRequest) of per-step
// telemetry and log lines turned into what the coordinator keeps: one
// JobEvent per step not seen before, the job's Progress (from rank 0: step,
// loss, tokens/s, model FLOP/s), each rank's progress clock (the hang check
// reads it), the per-rank Prometheus series, and the log lines as stored.
// It writes nothing to the store: the Coordinator writes the batch through
// its Written, so a failed write freezes it as any other.
//
// Thread safety: a plain function over LiveJobs owned by the Coordinator;
// it is called under the Coordinator's mutex, which guards those jobs.
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
  std::vector<v1::JobEvent> events;  // to append; one per new step
  std::vector<v1::LogEntry> logs;    // to append
  // Jobs whose Progress moved (rank 0 stepped), to be stored again; a job
  // appears once per rank-0 step of the batch.
  std::vector<LiveJob*> progressed;
  // The memory timelines the steps carried (to store: the latest per rank),
  // taken out of their events so that WatchJob streams stay small.
  std::vector<JobMemoryTimeline> timelines;
};

// Applies `request`, sent by a worker whose device peaks at
// `device_peak_flops` (0: unknown), to the live jobs `find` returns
// (nullptr: a finished job or an old attempt, whose steps are dropped).
// A step's memory timeline goes to `timelines`, stamped with the time it
// arrived and the step's rank, step and attempt. A step at or below a rank's last one is a batch re-sent after a lost reply
// and is not counted twice; a rank out of range is dropped, as is a log line
// whose job id is malformed. `metrics` may be null (no series).
TelemetryBatch IngestTelemetry(v1::TelemetryRequest request, double device_peak_flops,
                               absl::FunctionRef<LiveJob*(const std::string& job_id, int attempt)> find,
                               Metrics* metrics);

}  // namespace plateau

#endif  // PLATEAU_SERVER_TELEMETRY_H_
