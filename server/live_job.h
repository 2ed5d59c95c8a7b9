// What the coordinator keeps in memory about a job that is not in a final
// state: the stored job itself plus the per-rank and per-attempt facts the
// job state machine (server/coordinator.h) and telemetry ingestion
// (server/telemetry.h) read and update.
//
// Thread safety: plain data. LiveJobs are owned by the Coordinator (its
// active_ map) and touched only under its mutex.
#ifndef PLATEAU_SERVER_LIVE_JOB_H_
#define PLATEAU_SERVER_LIVE_JOB_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

// One rank of the current attempt.
struct RankState {
  std::string worker_id;
  bool started = false;
  bool gone = false;
  int64_t last_step = 0;
  absl::Time last_progress;  // its start or its last step
};

// One step some ranks of the attempt have reported (by rank).
struct PendingStep {
  std::vector<v1::StepTelemetry> ranks;
  std::vector<bool> reported;
};

struct LiveJob {
  v1::Job job;
  std::vector<RankState> ranks;  // of the current attempt
  bool cancel_requested = false;
  // The attempt's failure, the cause of its end (Finish reads it); Job.failure
  // (with Job.failure_held_for) is what is published of it (get, list, the
  // store).
  bool has_failure = false;
  int failure_priority = 0;
  v1::Failure failure;
  // A rank's plain error exit is what its peers' collectives report when
  // another worker dies: while this names the attempt's other workers not
  // heard from since that exit, `failure` is held (published with these
  // names as Job.failure_held_for, provisional). Each
  // leaves the set at its next heartbeat or report (alive: the crash
  // stands once none is left), or its loss publishes WORKER_LOST instead.
  // The hold never delays the attempt itself: its ranks are stopped at
  // once, and it ends at the worker timeout at the latest.
  std::set<std::string> judging;
  double tokens = 0, seconds = 0;  // the job's step totals this attempt
  bool hang_reported = false;
  // The job's step when its max_duration_s fired (-1: it has not, or a
  // restarted coordinator does not know): its ranks train on until they
  // are stopped, and the final reason names both steps.
  int64_t max_duration_step = -1;
  // Steps of the current attempt some rank has reported but that are not
  // yet an event (server/telemetry.h): each rank's report by step, in rank
  // order (unset: not reported). Emptied when the attempt ends.
  std::map<int64_t, PendingStep> pending_steps;
  // The latest step of the current attempt that is an event.
  int64_t emitted_step = 0;
  // When a PENDING job's waiting reason last became an event: the reason
  // names every worker's free slots, so it changes with every placement
  // anywhere; the events are kept to one a minute (Coordinator::Schedule).
  absl::Time reason_event_at = absl::InfinitePast();
  std::string reason_in_events;  // that event's reason
};

}  // namespace plateau

#endif  // PLATEAU_SERVER_LIVE_JOB_H_
