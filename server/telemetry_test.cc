#include "server/telemetry.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace plateau {
namespace {

LiveJob TwoRankJob() {
  LiveJob a;
  a.job.set_id("job-3");
  a.job.set_attempt(1);
  a.job.mutable_spec()->set_steps(10);
  a.ranks.resize(2);
  return a;
}

void AddStep(v1::TelemetryRequest& r, const std::string& job, int attempt, int rank, int64_t step, double loss) {
  v1::TelemetryRequest::Step* s = r.add_steps();
  s->set_job_id(job);
  v1::StepTelemetry* t = s->mutable_telemetry();
  t->set_attempt(attempt);
  t->set_rank(rank);
  t->set_step(step);
  t->set_loss(loss);
  t->set_tokens(100);
  t->set_seconds(0.5);
  t->set_model_flops(1e9);
}

// The live jobs, as the coordinator's FindActive returns them: one.
struct Jobs {
  mutable LiveJob job = TwoRankJob();
  LiveJob* operator()(const std::string& id, int attempt) const {
    return id == job.job.id() && attempt == job.job.attempt() ? &job : nullptr;
  }
};

TEST(TelemetryTest, StepsBecomeEventsAndRankZeroMovesTheProgress) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  AddStep(r, "job-3", 1, 1, 1, 2.6);
  AddStep(r, "job-3", 1, 0, 2, 2.25);
  TelemetryBatch b = IngestTelemetry(r, 0, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 3u);
  EXPECT_EQ(b.events[2].job_id(), "job-3");
  EXPECT_EQ(b.events[2].step().step(), 2);
  EXPECT_TRUE(b.events[2].has_time());
  ASSERT_EQ(b.progressed.size(), 2u);  // once per rank-0 step
  EXPECT_EQ(b.progressed[0], &jobs.job);
  const v1::Progress& p = jobs.job.job.progress();
  EXPECT_EQ(p.step(), 2);
  EXPECT_EQ(p.total_steps(), 10);
  EXPECT_DOUBLE_EQ(p.first_loss(), 2.5);
  EXPECT_DOUBLE_EQ(p.loss(), 2.25);
  EXPECT_DOUBLE_EQ(p.tokens_per_second(), 200);         // 200 tokens in 1 s (rank 0's)
  EXPECT_DOUBLE_EQ(p.model_flops_per_second(), 2e9);    // 1e9 per 100 tokens
  EXPECT_EQ(jobs.job.ranks[0].last_step, 2);
  EXPECT_EQ(jobs.job.ranks[1].last_step, 1);
  EXPECT_NE(jobs.job.ranks[1].last_progress, absl::Time());
}

// A batch re-sent after a lost reply counts once; steps of other attempts,
// unknown jobs and ranks out of range are dropped.
TEST(TelemetryTest, ResentStepsAndStrangersAreDropped) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  ASSERT_EQ(IngestTelemetry(r, 0, jobs, nullptr).events.size(), 1u);
  TelemetryBatch again = IngestTelemetry(r, 0, jobs, nullptr);
  EXPECT_TRUE(again.events.empty());
  EXPECT_TRUE(again.progressed.empty());
  EXPECT_DOUBLE_EQ(jobs.job.job.progress().tokens_per_second(), 200);

  v1::TelemetryRequest strangers;
  AddStep(strangers, "job-3", 0, 0, 5, 1);  // an old attempt
  AddStep(strangers, "job-4", 1, 0, 5, 1);  // not live
  AddStep(strangers, "job-3", 1, 2, 5, 1);  // rank 2 of 2
  AddStep(strangers, "job-3", 1, -1, 5, 1);
  TelemetryBatch b = IngestTelemetry(strangers, 0, jobs, nullptr);
  EXPECT_TRUE(b.events.empty());
  EXPECT_EQ(jobs.job.job.progress().step(), 1);
}

// A step's memory timeline is taken out of its event (WatchJob streams stay
// small) and kept for the store, stamped with the step's rank, step and
// attempt; a re-sent step's timeline counts once, like the step.
TEST(TelemetryTest, MemoryTimelinesLeaveTheirEvents) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 1, 1, 2.5);
  v1::MemoryTimeline* t = r.mutable_steps(0)->mutable_telemetry()->mutable_memory_timeline();
  t->set_rank(0);  // wrong: the step's rank wins
  t->add_phases()->set_name("forward 0");
  AddStep(r, "job-3", 1, 0, 1, 2.5);  // no timeline
  TelemetryBatch b = IngestTelemetry(r, 0, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_FALSE(b.events[0].step().has_memory_timeline());
  ASSERT_EQ(b.timelines.size(), 1u);
  EXPECT_EQ(b.timelines[0].job_id, "job-3");
  EXPECT_EQ(b.timelines[0].timeline.rank(), 1);
  EXPECT_EQ(b.timelines[0].timeline.step(), 1);
  EXPECT_EQ(b.timelines[0].timeline.attempt(), 1);
  EXPECT_TRUE(b.timelines[0].timeline.has_time());
  EXPECT_EQ(b.timelines[0].timeline.phases(0).name(), "forward 0");
  EXPECT_TRUE(IngestTelemetry(r, 0, jobs, nullptr).timelines.empty());
}

TEST(TelemetryTest, LogLinesAreCutStampedAndNeedAJobId) {
  Jobs jobs;
  v1::TelemetryRequest r;
  v1::LogEntry* ok = r.add_logs();
  ok->set_job_id("job-9");  // logs need no live job: a finished one's last lines still count
  ok->set_line(std::string(kMaxLogLineBytes + 10, 'x'));
  v1::LogEntry* stamped = r.add_logs();
  stamped->set_job_id("job-3");
  stamped->set_line("kept time");
  stamped->mutable_time()->set_seconds(42);
  r.add_logs()->set_job_id("not-a-job");
  TelemetryBatch b = IngestTelemetry(r, 0, jobs, nullptr);
  ASSERT_EQ(b.logs.size(), 2u);
  EXPECT_EQ(b.logs[0].line().size(), kMaxLogLineBytes);
  EXPECT_TRUE(b.logs[0].has_time());
  EXPECT_EQ(b.logs[1].time().seconds(), 42);
}

}  // namespace
}  // namespace plateau
