#include "client/job_text.h"

#include "gtest/gtest.h"

namespace plateau {
namespace {

v1::Job Lost(v1::JobState state, int attempt) {
  v1::Job job;
  job.set_state(state);
  job.set_attempt(attempt);
  v1::Failure* f = job.mutable_failure();
  f->set_kind(v1::Failure::WORKER_LOST);
  f->set_worker_id("worker-2");
  return job;
}

TEST(JobTextTest, AFailureSaysWhichAttemptItBelongsTo) {
  // Pending after a restart: attempt 2 waits; attempt 1 is the one that failed.
  EXPECT_EQ(FailureLine(Lost(v1::PENDING, 2)), "  failure:  attempt 1 failed: WORKER_LOST worker=worker-2\n");
  // RESTARTING: the attempt number goes up as it leaves this state.
  EXPECT_EQ(FailureLine(Lost(v1::RESTARTING, 1)), "  failure:  attempt 1 failed: WORKER_LOST worker=worker-2\n");
  EXPECT_EQ(FailureLine(Lost(v1::RUNNING, 0)),
            "  failure:  attempt 0 failing (its ranks are being stopped): WORKER_LOST worker=worker-2\n");
  // A rank's exit held while another worker is not heard from.
  v1::Job held = Lost(v1::RUNNING, 0);
  held.mutable_failure()->set_kind(v1::Failure::RANK_CRASHED);
  held.mutable_failure()->set_worker_id("worker-1");
  held.add_failure_held_for("worker-2");
  EXPECT_EQ(FailureLine(held),
            "  failure:  attempt 0 failing, held until worker-2 is heard from (whose loss would be the cause): "
            "RANK_CRASHED rank=0 exit_code=0 signal=0 worker=worker-1\n");
  // The job's outcome: no attempt to tell apart.
  EXPECT_EQ(FailureLine(Lost(v1::FAILED, 3)), "  failure:  WORKER_LOST worker=worker-2\n");
}

TEST(JobTextTest, ARanksFailureNamesItsRankAndNoFailureNoLine) {
  v1::Job job;
  job.set_state(v1::FAILED);
  v1::Failure* f = job.mutable_failure();
  f->set_kind(v1::Failure::OUT_OF_MEMORY);
  f->set_live_set("dispatch");
  f->set_rank(1);
  f->set_exit_code(4);
  f->set_worker_id("worker-1");
  EXPECT_EQ(FailureLine(job),
            "  failure:  OUT_OF_MEMORY live_set=dispatch rank=1 exit_code=4 signal=0 worker=worker-1\n");
  job.clear_failure();
  EXPECT_EQ(FailureLine(job), "");
}

TEST(JobTextTest, AStepEndedWhenItsRanksSayNotWhenItWasStored) {
  v1::JobEvent e;
  e.mutable_time()->set_seconds(1000);  // stored after an outage
  e.mutable_job_step()->set_step(7);
  EXPECT_EQ(StepEnded(e), absl::FromUnixSeconds(1000)) << "no end_time (older ranks): the event's time";
  e.mutable_job_step()->mutable_end_time()->set_seconds(940);
  e.mutable_job_step()->mutable_end_time()->set_nanos(500000000);
  EXPECT_EQ(StepEnded(e), absl::FromUnixSeconds(940) + absl::Milliseconds(500));
}

}  // namespace
}  // namespace plateau
