// Lines of `plateauctl get` that read a job's state rather than print a
// field: which attempt a failure belongs to.
//
// Thread safety: pure functions.
#ifndef PLATEAU_CLIENT_JOB_TEXT_H_
#define PLATEAU_CLIENT_JOB_TEXT_H_

#include <string>

#include "absl/time/time.h"
#include "plateau/v1/job.pb.h"

namespace plateau {

// The job's failure as `get` prints it ("  failure:  ...\n"), or "" when it
// has none. The failure is the attempt's that ended or is ending, which is
// not always the job's current attempt: a job PENDING after a restart
// (attempt N) shows attempt N - 1's failure until it is placed again (the
// coordinator clears it then); RESTARTING shows the attempt that just
// failed; SCHEDULED or RUNNING, the current attempt, whose ranks are being
// stopped, or whose rank's exit is held while the workers it names are
// not heard from (Job.failure_held_for). Without the attempt a pending job
// read as failing now.
std::string FailureLine(const v1::Job& job);

// When a step event's step ended: the ranks' own time (JobStepSummary's
// end_time), else, from ranks older than that field, the time the
// coordinator stored the event. After a coordinator outage the agents'
// held reports are stored together, seconds after they ran: `watch`
// showed every such step with the same elapsed time.
absl::Time StepEnded(const v1::JobEvent& event);

}  // namespace plateau

#endif  // PLATEAU_CLIENT_JOB_TEXT_H_
