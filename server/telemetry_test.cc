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
  t->set_lr(1e-3 * static_cast<double>(step));  // a schedule's rate, different at each step
}

// The live jobs, as the coordinator's FindActive returns them: one.
struct Jobs {
  mutable LiveJob job = TwoRankJob();
  LiveJob* operator()(const std::string& id, int attempt) const {
    return id == job.job.id() && attempt == job.job.attempt() ? &job : nullptr;
  }
};

// A step's end time that JSON cannot print (or before 1970) is dropped at
// ingest; a valid one is the step's.
TEST(TelemetryTest, AnEndTimeOutOfRangeIsDropped) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  AddStep(r, "job-3", 1, 1, 1, 2.5);
  r.mutable_steps(0)->mutable_telemetry()->mutable_end_time()->set_seconds(1000);
  r.mutable_steps(1)->mutable_telemetry()->mutable_end_time()->set_seconds(253402300800);  // year 10000
  AddStep(r, "job-3", 1, 0, 2, 2.25);
  AddStep(r, "job-3", 1, 1, 2, 2.25);
  r.mutable_steps(2)->mutable_telemetry()->mutable_end_time()->set_nanos(1000000000);
  r.mutable_steps(3)->mutable_telemetry()->mutable_end_time()->set_seconds(-5);
  const TelemetryBatch b = IngestTelemetry(r, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].job_step().end_time().seconds(), 1000) << "the valid rank's";
  EXPECT_FALSE(b.events[1].job_step().has_end_time()) << b.events[1].DebugString();
}

// One event per step of the whole job, once every rank has reported it.
TEST(TelemetryTest, AStepIsOneEventOnceEveryRankHasReportedIt) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  AddStep(r, "job-3", 1, 1, 1, 2.5);
  AddStep(r, "job-3", 1, 0, 2, 2.25);  // rank 1 has not reported step 2 yet
  TelemetryBatch b = IngestTelemetry(r, jobs, nullptr);
  EXPECT_EQ(b.rank_steps.size(), 3u);  // every report is kept per rank
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].job_id(), "job-3");
  ASSERT_TRUE(b.events[0].has_job_step());
  EXPECT_EQ(b.events[0].job_step().step(), 1);
  EXPECT_EQ(b.events[0].job_step().ranks(), 2);
  EXPECT_EQ(b.events[0].job_step().ranks_reported(), 2);
  EXPECT_TRUE(b.events[0].has_time());
  ASSERT_EQ(b.progressed.size(), 1u);
  EXPECT_EQ(b.progressed[0], &jobs.job);
  EXPECT_EQ(jobs.job.job.progress().step(), 1);
  EXPECT_EQ(jobs.job.ranks[0].last_step, 2);
  EXPECT_EQ(jobs.job.ranks[1].last_step, 1);
  EXPECT_NE(jobs.job.ranks[1].last_progress, absl::Time());

  v1::TelemetryRequest r2;
  AddStep(r2, "job-3", 1, 1, 2, 2.25);
  b = IngestTelemetry(r2, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].job_step().step(), 2);
  const v1::Progress& p = jobs.job.job.progress();
  EXPECT_EQ(p.step(), 2);
  EXPECT_EQ(p.total_steps(), 10);
  EXPECT_DOUBLE_EQ(p.first_loss(), 2.5);
  EXPECT_DOUBLE_EQ(p.loss(), 2.25);
  EXPECT_DOUBLE_EQ(p.tokens_per_second(), 200);       // 200 tokens in 1 s
  EXPECT_DOUBLE_EQ(p.model_flops_per_second(), 2e9);  // 1e9 per 100 tokens
  // The step's learning rate, in its event and as the job's latest.
  EXPECT_EQ(b.events[0].job_step().lr(), 2e-3);
  EXPECT_EQ(jobs.job.job.lr(), 2e-3);
  EXPECT_TRUE(jobs.job.pending_steps.empty());
}

// The summary: the lowest rank's loss, the mean time, the slowest rank,
// each live set's peak as the maximum over ranks.
TEST(TelemetryTest, TheSummaryTakesTheMaximumOverRanksAndNamesTheSlowest) {
  PendingStep p;
  p.ranks.resize(3);
  p.reported = {true, true, true};
  for (int r = 0; r < 3; ++r) {
    v1::StepTelemetry& t = p.ranks[r];
    t.set_rank(r);
    t.set_step(7);
    t.set_attempt(2);
    t.set_loss(1.5);
    t.set_tokens(300);
    t.set_seconds(r == 1 ? 0.9 : 0.3);
    v1::LiveSetBytes* w = t.add_peak();
    w->set_live_set("weights");
    w->set_bytes(100);
    v1::LiveSetBytes* d = t.add_peak();
    d->set_live_set("dispatch");
    d->set_bytes(1000 + 10 * r);  // rank 2 receives the most
    t.set_peak_total_bytes(1100 + 10 * r);
    v1::LiveSetBytes* h = t.add_host_peak();
    h->set_live_set("optimizer");
    h->set_bytes(r == 0 ? 50 : 40);
    t.set_host_peak_total_bytes(r == 0 ? 50 : 40);
    t.set_device_used_bytes(r == 2 ? 9000 : 8000);
    t.set_device_pool_reserved_bytes(r == 0 ? 7000 : 6000);
    t.set_mfu(r == 1 ? 0.2 : 0.6);  // the slowest rank's is the step's
    // Rank 1 ended last (by 0.4 s within one second): the step's end.
    t.mutable_end_time()->set_seconds(r == 2 ? 99 : 100);
    t.mutable_end_time()->set_nanos(r == 1 ? 500000000 : 100000000);
  }
  const v1::JobStepSummary s = SummarizeStep(p);
  EXPECT_EQ(s.end_time().seconds(), 100);
  EXPECT_EQ(s.end_time().nanos(), 500000000);
  EXPECT_EQ(s.device_used_bytes(), 9000);
  EXPECT_EQ(s.device_pool_reserved_bytes(), 7000);
  EXPECT_DOUBLE_EQ(s.mfu(), 0.2);
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.attempt(), 2);
  EXPECT_DOUBLE_EQ(s.loss(), 1.5);
  EXPECT_EQ(s.tokens(), 300);
  EXPECT_DOUBLE_EQ(s.seconds(), 0.5);
  EXPECT_EQ(s.slowest_rank(), 1);
  EXPECT_DOUBLE_EQ(s.slowest_seconds(), 0.9);
  ASSERT_EQ(s.peak_size(), 2);
  EXPECT_EQ(s.peak(0).live_set(), "weights");
  EXPECT_EQ(s.peak(0).bytes(), 100);
  EXPECT_EQ(s.peak(1).live_set(), "dispatch");
  EXPECT_EQ(s.peak(1).bytes(), 1020);
  EXPECT_EQ(s.peak_total_bytes(), 1120);
  ASSERT_EQ(s.host_peak_size(), 1);
  EXPECT_EQ(s.host_peak(0).bytes(), 50);
  EXPECT_EQ(s.host_peak_total_bytes(), 50);
  EXPECT_EQ(s.ranks(), 3);
  EXPECT_EQ(s.ranks_reported(), 3);
}

// A rank that never reports a step does not hold it forever: when the
// attempt ends, the pending steps become events over the ranks that did.
TEST(TelemetryTest, TheAttemptsEndFlushesStepsARankNeverReported) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  AddStep(r, "job-3", 1, 0, 2, 2.4);
  AddStep(r, "job-3", 1, 1, 1, 2.5);
  ASSERT_EQ(IngestTelemetry(r, jobs, nullptr).events.size(), 1u);
  const std::vector<v1::JobEvent> flushed = FlushSteps(jobs.job);
  ASSERT_EQ(flushed.size(), 1u);
  EXPECT_EQ(flushed[0].job_step().step(), 2);
  EXPECT_EQ(flushed[0].job_step().ranks_reported(), 1);
  EXPECT_EQ(flushed[0].job_step().ranks(), 2);
  EXPECT_DOUBLE_EQ(flushed[0].job_step().loss(), 2.4);
  EXPECT_TRUE(jobs.job.pending_steps.empty());
  EXPECT_EQ(jobs.job.job.progress().step(), 2);
  EXPECT_TRUE(FlushSteps(jobs.job).empty());
}

// After a coordinator restart: the reports after the last step event are
// pending again; a step that completed without becoming an event becomes
// one now, and none before it is repeated.
TEST(TelemetryTest, RestoreResumesAfterTheLastStepEvent) {
  Jobs jobs;
  std::vector<v1::StepTelemetry> stored;
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t step = 4; step <= (rank == 0 ? 6 : 5); ++step) {
      v1::StepTelemetry t;
      t.set_rank(rank);
      t.set_step(step);
      t.set_attempt(1);
      t.set_tokens(100);
      t.set_seconds(0.5);
      stored.push_back(t);
    }
  }
  const std::vector<v1::JobEvent> events = RestoreSteps(jobs.job, stored, /*emitted=*/4);
  ASSERT_EQ(events.size(), 1u);  // step 5: both ranks had it; 4 was an event
  EXPECT_EQ(events[0].job_step().step(), 5);
  EXPECT_EQ(jobs.job.ranks[0].last_step, 6);
  EXPECT_EQ(jobs.job.ranks[1].last_step, 5);
  ASSERT_EQ(jobs.job.pending_steps.size(), 1u);
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 1, 6, 2.0);
  AddStep(r, "job-3", 1, 1, 5, 2.0);  // a re-sent report: not counted again
  TelemetryBatch b = IngestTelemetry(r, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 1u);
  EXPECT_EQ(b.events[0].job_step().step(), 6);
  EXPECT_EQ(b.events[0].job_step().ranks_reported(), 2);
}

// A batch re-sent after a lost reply counts once; steps of other attempts,
// unknown jobs and ranks out of range are dropped.
TEST(TelemetryTest, ResentStepsAndStrangersAreDropped) {
  Jobs jobs;
  v1::TelemetryRequest r;
  AddStep(r, "job-3", 1, 0, 1, 2.5);
  AddStep(r, "job-3", 1, 1, 1, 2.5);
  ASSERT_EQ(IngestTelemetry(r, jobs, nullptr).events.size(), 1u);
  TelemetryBatch again = IngestTelemetry(r, jobs, nullptr);
  EXPECT_TRUE(again.events.empty());
  EXPECT_TRUE(again.rank_steps.empty());
  EXPECT_TRUE(again.progressed.empty());
  EXPECT_DOUBLE_EQ(jobs.job.job.progress().tokens_per_second(), 200);

  v1::TelemetryRequest strangers;
  AddStep(strangers, "job-3", 0, 0, 5, 1);  // an old attempt
  AddStep(strangers, "job-4", 1, 0, 5, 1);  // not live
  AddStep(strangers, "job-3", 1, 2, 5, 1);  // rank 2 of 2
  AddStep(strangers, "job-3", 1, -1, 5, 1);
  TelemetryBatch b = IngestTelemetry(strangers, jobs, nullptr);
  EXPECT_TRUE(b.events.empty());
  EXPECT_TRUE(b.rank_steps.empty());
  EXPECT_EQ(jobs.job.job.progress().step(), 1);
}

// A step's memory timeline is taken out of its report (stored reports stay
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
  TelemetryBatch b = IngestTelemetry(r, jobs, nullptr);
  ASSERT_EQ(b.events.size(), 1u);
  ASSERT_EQ(b.rank_steps.size(), 2u);
  EXPECT_FALSE(b.rank_steps[0].telemetry.has_memory_timeline());
  ASSERT_EQ(b.timelines.size(), 1u);
  EXPECT_EQ(b.timelines[0].job_id, "job-3");
  EXPECT_EQ(b.timelines[0].timeline.rank(), 1);
  EXPECT_EQ(b.timelines[0].timeline.step(), 1);
  EXPECT_EQ(b.timelines[0].timeline.attempt(), 1);
  EXPECT_TRUE(b.timelines[0].timeline.has_time());
  EXPECT_EQ(b.timelines[0].timeline.phases(0).name(), "forward 0");
  EXPECT_TRUE(IngestTelemetry(r, jobs, nullptr).timelines.empty());
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
  TelemetryBatch b = IngestTelemetry(r, jobs, nullptr);
  ASSERT_EQ(b.logs.size(), 2u);
  EXPECT_EQ(b.logs[0].line().size(), kMaxLogLineBytes);
  EXPECT_TRUE(b.logs[0].has_time());
  EXPECT_EQ(b.logs[1].time().seconds(), 42);
}

}  // namespace
}  // namespace plateau
