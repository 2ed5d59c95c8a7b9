// Faults end to end, with real processes over loopback (tests/cluster.h):
// a lost worker, a restart from the last checkpoint on the remaining
// worker, a hung rank, a coordinator killed and restarted mid-job (also for
// longer than the agent's lease: the ranks freeze, then resume), and a
// worker that was declared lost while it still ran ranks, a frozen agent
// whose ranks stop themselves, and a rank whose teardown hangs. After each, no rank process is left.
// (A partition: tests/multinode_test.cc.)
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer/lr_schedule.h"
#include "tests/cluster.h"
#include "worker/job_spec.h"
#include "worker/rank_lease.h"
#include "worker/rank_protocol.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

std::vector<v1::JobState> States(const std::vector<v1::JobEvent>& events) {
  std::vector<v1::JobState> states;
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change()) states.push_back(e.state_change().state());
  }
  return states;
}

std::string AllLogs(Cluster& c, const std::string& id) {
  std::string logs;
  c.client()
      .GetJobLogs(id, false, 0,
                  [&](const v1::LogEntry& l) {
                    absl::StrAppend(&logs, l.rank(), " ", l.stream(), " ", l.line(), "\n");
                    return true;
                  })
      .IgnoreError();
  return logs;
}

// The job's loss at `step` of its last attempt.
double LossAt(const std::vector<v1::JobEvent>& events, int64_t step) {
  double loss = -1;
  for (const v1::JobEvent& e : events) {
    if (e.has_job_step() && e.job_step().step() == step) loss = e.job_step().loss();
  }
  return loss;
}

// The learning rate the job's last attempt reported at `step`.
double LrAt(const std::vector<v1::JobEvent>& events, int64_t step) {
  double lr = -1;
  for (const v1::JobEvent& e : events) {
    if (e.has_job_step() && e.job_step().step() == step) lr = e.job_step().lr();
  }
  return lr;
}

absl::Time TimeOf(const google::protobuf::Timestamp& t) {
  return absl::FromUnixSeconds(t.seconds()) + absl::Nanoseconds(t.nanos());
}

TEST(FaultTest, LostWorkerFailsItsJobWithinTwoHeartbeatIntervals) {
  ClusterOptions o;
  o.heartbeat_ms = 500;
  o.worker_timeout_s = 0;  // the default: two heartbeat intervals
  Cluster c("lost", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 1)) << c.Logs();
  // A heartbeat the coordinator has had from the worker (its last one may
  // come later, up to the kill).
  auto workers = c.client().ListWorkers();
  ASSERT_TRUE(workers.ok() && workers->workers_size() == 1) << workers.status();
  const absl::Time beat = TimeOf(workers->workers(0).last_heartbeat());
  const absl::Time killed = absl::Now();
  c.worker()->Stop(SIGKILL);  // the agent; its ranks die with it
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::WORKER_LOST);
  EXPECT_THAT(job.state_reason(), HasSubstr("worker lost: worker-1"));
  // Not before two intervals without a heartbeat...
  EXPECT_GE(TimeOf(job.end_time()) - beat, absl::Milliseconds(2 * 500)) << "lost early";
  // ...and lost within two intervals of the kill (its last heartbeat came
  // at the latest then), plus the coordinator's 100 ms tick and 500 ms for a
  // loaded machine to run the tick and end the job.
  const absl::Duration after_kill = TimeOf(job.end_time()) - killed;
  EXPECT_LE(after_kill, absl::Milliseconds(2 * 500 + 100 + 500)) << after_kill;
  std::printf("worker killed -> job FAILED after %s (heartbeat 500 ms)\n", absl::FormatDuration(after_kill).c_str());
  EXPECT_THAT(AllLogs(c, id), HasSubstr("coordinator worker lost: worker-1 sent no heartbeat"));
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30)));
  // The killed agent left its job's spec file; the next agent of that work
  // dir removes it (its ranks died with the old one).
  const std::string spec_file = c.dir() + "/work-0/" + id + ".attempt-0.spec";
  ASSERT_TRUE(std::filesystem::exists(spec_file));
  c.StartWorker({"--work_dir=" + c.dir() + "/work-0"});
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(c.worker(1)->out(), "as worker-1 with"); })) << c.Logs();
  EXPECT_FALSE(std::filesystem::exists(spec_file));
}

TEST(FaultTest, LostWorkerRestartsFromTheLastCheckpointWithTheUninterruptedLoss) {
  ClusterOptions o;
  o.heartbeat_ms = 500;
  // Not the default two intervals: this test times no loss, and over two
  // 200-step runs on a loaded machine a heartbeat late by half a second
  // would lose the worker (and the uninterrupted run) for nothing.
  o.worker_timeout_s = 3;
  Cluster c("resume", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  // Long enough that the kill after step 25 lands mid-run: the kill comes
  // a watch, an RPC and a signal after the coordinator saw step 25, and a
  // loaded machine (a cold clean-clone CI run, 2026-12-05) once finished
  // all of 40 steps in that window, so the restart had nothing to run.
  constexpr int64_t kSteps = 200;
  auto spec_in = [&](const std::string& dir) {
    v1::JobSpec s = TinyJob(kSteps);
    s.mutable_checkpoint()->set_directory(c.dir() + "/" + dir);
    s.mutable_checkpoint()->set_every(10);
    s.set_max_restarts(1);
    return s;
  };
  // The uninterrupted run.
  auto a = c.client().SubmitJob(spec_in("ckpt-a"), false);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(c.WaitDone(a->job().id()).state(), v1::SUCCEEDED) << c.Logs();
  const std::vector<v1::JobEvent> events_a = c.AllEvents(a->job().id());

  // The same job with a second worker registered: the job's worker is
  // killed after step 25, and the attempt restarts on the one that remains.
  c.StartWorker();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(c.worker(1)->out(), "registered as worker-2"); }))
      << c.Logs();
  auto b = c.client().SubmitJob(spec_in("ckpt-b"), false);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string id = b->job().id();
  ASSERT_TRUE(c.WaitStep(id, 25)) << c.Logs();
  auto placed = c.client().GetJob(id);
  ASSERT_TRUE(placed.ok() && placed->placement_size() == 1) << placed.status();
  const int victim = placed->placement(0).worker_id() == "worker-1" ? 0 : 1;
  const std::vector<pid_t> killed_ranks = c.RankPids(id);
  ASSERT_EQ(killed_ranks.size(), 2u);
  c.worker(victim)->Stop(SIGKILL);
  // The checkpoint the restart must resume from: the newest on disk once
  // the killed ranks are gone (they die with their agent). It can be newer
  // than the last step the coordinator heard of, since the agent batches
  // step reports for 200 ms and died with its unsent batch. The second
  // attempt starts a second or more later (two missed heartbeats) and
  // writes its first checkpoint 10 steps after that, so this reads the
  // first attempt's.
  ASSERT_TRUE(WaitFor([&] {
    return std::all_of(killed_ranks.begin(), killed_ranks.end(), [](pid_t p) {
      const char state = ProcState(p);
      return state == 0 || state == 'Z';
    });
  })) << c.Logs();
  const int64_t resume_from = NewestCheckpointIn(c.dir() + "/ckpt-b");
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  ASSERT_EQ(job.placement_size(), 0);
  const std::vector<v1::JobEvent> events_b = c.AllEvents(id);
  const std::vector<v1::JobState> states = States(events_b);
  EXPECT_THAT(states, ::testing::Contains(v1::RESTARTING));
  bool lost = false;
  for (const v1::JobEvent& e : events_b) {
    lost = lost || (e.has_state_change() && e.state_change().state() == v1::RESTARTING &&
                    e.state_change().failure().kind() == v1::Failure::WORKER_LOST);
  }
  EXPECT_TRUE(lost);
  // The second attempt started from the newest checkpoint the first one
  // wrote (every 10 steps; the kill came after step 25, so at least 20)...
  int64_t last_of_attempt_0 = 0, first_of_attempt_1 = 0;
  for (const v1::JobEvent& e : events_b) {
    if (!e.has_job_step()) continue;
    if (e.job_step().attempt() == 0) last_of_attempt_0 = std::max(last_of_attempt_0, e.job_step().step());
    if (e.job_step().attempt() == 1 && first_of_attempt_1 == 0) first_of_attempt_1 = e.job_step().step();
  }
  EXPECT_GE(last_of_attempt_0, 25);
  ASSERT_LT(last_of_attempt_0, kSteps)
      << "the first attempt ran every step before the kill landed: nothing was left to resume";
  EXPECT_GE(resume_from, 20);
  EXPECT_EQ(first_of_attempt_1 - 1, resume_from);
  // ...and ended where the uninterrupted run did, to the bit.
  const double loss_a = LossAt(events_a, kSteps), loss_b = LossAt(events_b, kSteps);
  ASSERT_GT(loss_a, 0);
  EXPECT_EQ(loss_a, loss_b);
  for (int64_t step = first_of_attempt_1; step <= kSteps; ++step) EXPECT_EQ(LossAt(events_a, step), LossAt(events_b, step)) << step;
  // The final checkpoint, written by the second attempt in job b.
  const std::string last = absl::StrFormat("/step-%08d.safetensors", kSteps);
  const std::string ckpt_a = ReadFile(c.dir() + "/ckpt-a" + last), ckpt_b = ReadFile(c.dir() + "/ckpt-b" + last);
  ASSERT_GT(ckpt_a.size(), 1000u);
  EXPECT_TRUE(ckpt_a == ckpt_b) << "the final checkpoints differ";
  EXPECT_TRUE(c.RankPids(id).empty());
}

// A warm-up + cosine schedule across a crash: a rank is killed after step
// 15, the job restarts from its newest checkpoint (mid warm-up, W = 80) and
// runs on through the decay. Every step's learning rate and loss equal the
// uninterrupted job's to the bit, and are the schedule's
// (kernels/optimizer/lr_schedule.h) at that step.
TEST(FaultTest, ScheduledLearningRateContinuesAcrossARestartBitForBit) {
  Cluster c("lr-restart");
  ASSERT_TRUE(c.ready()) << c.Logs();
  // The kill comes a watch, an RPC and a signal after the coordinator saw
  // step 15, and a loaded machine can run tens of steps in that window (the
  // lost-worker test above once ran 15): the warm-up is long enough that
  // the newest checkpoint at the kill is still one of its own (at most step
  // 70 of 80), so the second attempt runs the warm-up's end again.
  constexpr int64_t kSteps = 120;
  constexpr int64_t kWarmup = 80;
  auto spec_in = [&](const std::string& dir) {
    v1::JobSpec s = TinyJob(kSteps);
    s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
    s.mutable_optimizer()->set_warmup_steps(kWarmup);
    s.mutable_optimizer()->set_min_lr(6e-4);
    s.mutable_checkpoint()->set_directory(c.dir() + "/" + dir);
    s.mutable_checkpoint()->set_every(10);
    s.set_max_restarts(1);
    return s;
  };
  auto options = ToTrainerOptions(spec_in("x"));
  ASSERT_TRUE(options.ok()) << options.status();
  const OptimizerConfig& opt = options->step.optimizer;
  auto a = c.client().SubmitJob(spec_in("ckpt-a"), false);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(c.WaitDone(a->job().id()).state(), v1::SUCCEEDED) << c.Logs();
  const std::vector<v1::JobEvent> events_a = c.AllEvents(a->job().id());

  auto b = c.client().SubmitJob(spec_in("ckpt-b"), false);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string id = b->job().id();
  ASSERT_TRUE(c.WaitStep(id, 15)) << c.Logs();
  const std::vector<pid_t> ranks = c.RankPids(id);
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(kill(ranks[0], SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  const std::vector<v1::JobEvent> events_b = c.AllEvents(id);
  int64_t first_of_attempt_1 = 0;
  for (const v1::JobEvent& e : events_b) {
    if (e.has_job_step() && e.job_step().attempt() == 1 && first_of_attempt_1 == 0) {
      first_of_attempt_1 = e.job_step().step();
    }
  }
  EXPECT_EQ((first_of_attempt_1 - 1) % 10, 0) << first_of_attempt_1;
  EXPECT_GE(first_of_attempt_1 - 1, 10);
  ASSERT_LT(first_of_attempt_1 - 1, kWarmup)
      << "the first attempt outran the kill past the warm-up's last checkpoint: the second attempt "
         "did not "
         "cross from the warm-up into the decay";
  for (int64_t step = 1; step <= kSteps; ++step) {
    EXPECT_EQ(LrAt(events_b, step), LrAt(events_a, step)) << step;
    EXPECT_EQ(LrAt(events_a, step), static_cast<double>(LearningRateF(opt, step))) << step;
    EXPECT_EQ(LossAt(events_b, step), LossAt(events_a, step)) << step;
  }
  EXPECT_EQ(LrAt(events_a, 1), 0.0);
  EXPECT_LT(LrAt(events_a, kWarmup), static_cast<double>(opt.lr));
  EXPECT_EQ(LrAt(events_a, kWarmup + 1), static_cast<double>(opt.lr));
  EXPECT_GT(LrAt(events_a, kSteps), 6e-4);
  EXPECT_EQ(job.lr(), LrAt(events_a, kSteps));
  EXPECT_TRUE(c.RankPids(id).empty());
}

TEST(FaultTest, HungRankIsDetectedKilledAndReported) {
  Cluster c("hung");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(1000000);
  spec.set_progress_timeout_s(4);
  const absl::Time submitted = absl::Now();
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 3)) << c.Logs();
  // The timeout is per step, not per job: a healthy job outlives it.
  absl::SleepFor(absl::Seconds(5) - (absl::Now() - submitted));
  auto running = c.client().GetJob(id);
  ASSERT_TRUE(running.ok());
  ASSERT_EQ(running->state(), v1::RUNNING) << running->DebugString();
  const pid_t rank1 = c.RankPid(id, 1);
  ASSERT_NE(rank1, 0);
  const absl::Time stopped = absl::Now();
  ASSERT_EQ(kill(rank1, SIGSTOP), 0);  // alive, making no progress
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::RANK_HUNG) << job.failure().DebugString();
  EXPECT_THAT(job.failure().message(), HasSubstr("no step progress for"));
  EXPECT_THAT(job.failure().message(), HasSubstr("progress timeout 4s"));
  // Rank 0 waits in a collective for the stopped rank 1 and is never blamed
  // alone: both are named when they stalled at the same step, rank 1 alone
  // when it was stopped after the step's last collective but before its
  // report (rank 0 then reported one step more).
  EXPECT_THAT(job.failure().message(), ::testing::Not(HasSubstr("rank 0 hung")));
  EXPECT_THAT(job.failure().message(), ::testing::AnyOf(HasSubstr("ranks 0, 1 hung: "), HasSubstr("rank 1 hung: ")));
  EXPECT_EQ(job.failure().worker_id(), "worker-1");
  // Detected after the timeout, and the ranks stopped within the grace
  // period (3 s) and a heartbeat or two.
  EXPECT_LE(TimeOf(job.end_time()) - stopped, absl::Seconds(4 + 3 + 3));
  std::printf("rank stopped -> job FAILED (RANK_HUNG) after %s (progress timeout 4 s, grace 3 s)\n",
              absl::FormatDuration(TimeOf(job.end_time()) - stopped).c_str());
  EXPECT_TRUE(c.RankPids(id).empty());
  EXPECT_NE(kill(rank1, 0), 0) << "the stopped rank still exists";
  const std::string logs = AllLogs(c, id);
  EXPECT_THAT(logs, HasSubstr("coordinator rank"));
  EXPECT_THAT(logs, HasSubstr("hung: no step progress"));
}

// A cluster whose worker runs the stand-in rank whose teardown hangs
// (tests/hung_teardown/plateau_rank) under --teardown_s.
ClusterOptions StandInRanks(int teardown_s) {
  ClusterOptions o;
  o.worker_flags = {"--rank_binary=tests/hung_teardown/plateau_rank", "--calibrate=false",
                    absl::StrCat("--teardown_s=", teardown_s)};
  return o;
}

// A rank whose teardown hangs after it reported its error (on a GPU:
// ncclCommAbort waiting on a peer stuck outside NCCL) is killed
// --teardown_s after it said it was exiting, and its error fails the job as
// its exit would have: in seconds, not at the progress timeout, and as
// INVALID (not restarted), not as a crash. The ranks are a stand-in
// (tests/hung_teardown/plateau_rank): a real rank's teardown does not hang
// on the CPU.
TEST(FaultTest, ARankWhoseTeardownHangsIsKilledAndItsErrorStands) {
  Cluster c("teardown", StandInRanks(1));
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(100);
  spec.set_max_restarts(2);
  spec.set_progress_timeout_s(60);  // what the job would have waited for
  const absl::Time submitted = absl::Now();
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  const absl::Duration took = TimeOf(job.end_time()) - submitted;
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::INVALID) << job.failure().DebugString();
  EXPECT_EQ(job.failure().exit_code(), kRankExitInvalidJob);
  EXPECT_EQ(job.attempt(), 0) << "restarted";
  EXPECT_THAT(job.failure().message(), HasSubstr("data.path: the stand-in refuses every job"));
  EXPECT_THAT(job.failure().message(), HasSubstr("then its teardown hung: its agent killed it"));
  // 1 s of teardown, a heartbeat or two, the agent's 200 ms report batches.
  EXPECT_LT(took, absl::Seconds(15));
  std::printf("submitted -> FAILED (INVALID) after %s with --teardown_s=1 (progress timeout 60 s)\n",
              absl::FormatDuration(took).c_str());
  EXPECT_TRUE(c.RankPids(id).empty());
  EXPECT_THAT(AllLogs(c, id), HasSubstr("is still tearing down (--teardown_s=1): SIGKILL"));
}

// A rank's output may be any bytes, but the API's strings are UTF-8:
// protobuf refuses a whole message with one string that is not. A line
// that is not UTF-8 arrives with U+FFFD for its bad bytes (the agent's whole
// report batch was refused, step reports and all), and a line longer than
// the coordinator keeps is cut between characters (a split character was
// stored, and every later read of the job's logs failed on that row).
TEST(FaultTest, ARanksOutputThatIsNotUtf8IsKeptReadable) {
  Cluster c("bad-utf8", StandInRanks(1));
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(100);
  spec.set_name("bad-utf8");  // the stand-in's script
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_THAT(job.failure().message(), HasSubstr("data.path: the stand-in refuses every job"));
  const std::string fffd = "\xEF\xBF\xBD";
  int latin1 = 0, bars = 0;
  absl::Status read = c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    if (l.line() == "caf" + fffd + " " + fffd + fffd + " on stdout") ++latin1;
    if (absl::StartsWith(l.line(), "bars ")) {
      ++bars;
      // 16,384 bytes would split the 5,460th character: it is left out.
      EXPECT_EQ(l.line().size(), 5u + 3 * 5459) << "rank " << l.rank();
      EXPECT_EQ(l.line().substr(l.line().size() - 3), "\xE2\x96\x88");
    }
    return true;
  });
  ASSERT_TRUE(read.ok()) << read;
  EXPECT_EQ(latin1, 2) << "one per rank; the agent's log:\n" << c.Logs();
  EXPECT_EQ(bars, 2);
}

// A rank that reported an out-of-memory and said its exit code, then hung
// in its teardown, is stopped by its agent when a sibling fails (here
// before --teardown_s runs out): its error still decides the attempt's
// failure. Counted as "stopped by its agent" it ranked below the sibling's
// crash, and the job was restarted to run out of memory again.
TEST(FaultTest, ARankStoppedInItsTeardownKeepsTheErrorItReported) {
  Cluster c("teardown-stopped", StandInRanks(600));
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(100);
  spec.set_name("out-of-memory sibling-crashes");  // the stand-in's script
  spec.set_max_restarts(2);
  const absl::Time submitted = absl::Now();
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::OUT_OF_MEMORY) << job.failure().DebugString();
  EXPECT_EQ(job.failure().rank(), 0);
  EXPECT_EQ(job.failure().live_set(), "activations");
  EXPECT_THAT(job.failure().message(), HasSubstr("the stand-in ran out of memory"));
  EXPECT_EQ(job.attempt(), 0) << "restarted";
  // Rank 1's exit after a second, then the SIGTERM: far below --teardown_s.
  EXPECT_LT(TimeOf(job.end_time()) - submitted, absl::Seconds(15));
  EXPECT_TRUE(c.RankPids(id).empty());
  EXPECT_THAT(AllLogs(c, id), HasSubstr("killed in its teardown (signal 15, the job was being stopped)"));
}

// An agent asked to stop (SIGTERM: systemd, Kubernetes, an operator) says
// so before it stops its ranks: the attempt fails as the worker having
// left, not as a rank's crash, and restarts on the worker that remains;
// nothing more is placed on the leaving one. Its ranks get SIGTERM from it
// (they used to die of SIGKILL first: their parent-death signal fired when
// the heartbeat thread that had spawned them ended).
TEST(FaultTest, AStoppedAgentsJobFailsAsLeftAndRestartsOnAnotherWorker) {
  Cluster c("leaving");
  ASSERT_TRUE(c.ready()) << c.Logs();
  c.StartWorker();
  ASSERT_TRUE(WaitFor([&] {  // either may register first
    auto workers = c.client().ListWorkers();
    return workers.ok() && workers->workers_size() == 2;
  })) << c.Logs();
  v1::JobSpec spec = TinyJob(1000000);
  spec.set_max_restarts(1);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 3)) << c.Logs();
  auto placed = c.client().GetJob(id);
  ASSERT_TRUE(placed.ok() && placed->placement_size() == 1) << placed.status();
  const std::string left = placed->placement(0).worker_id();
  const int victim = absl::StrContains(c.worker(0)->out(), "registered as " + left) ? 0 : 1;
  const std::vector<pid_t> first_ranks = c.RankPids(id);
  ASSERT_EQ(first_ranks.size(), 2u);
  c.worker(victim)->Stop(SIGTERM);
  ASSERT_TRUE(WaitFor([&] {
    auto j = c.client().GetJob(id);
    return j.ok() && j->attempt() == 1 && j->state() == v1::RUNNING;
  })) << c.Logs();
  auto restarted = c.client().GetJob(id);
  ASSERT_TRUE(restarted.ok());
  ASSERT_EQ(restarted->placement_size(), 1);
  EXPECT_NE(restarted->placement(0).worker_id(), left);
  for (pid_t p : first_ranks) {
    const char state = ProcState(p);
    EXPECT_TRUE(state == 0 || state == 'Z') << "rank " << p << " of the first attempt is still there";
  }
  const std::string logs = AllLogs(c, id);
  EXPECT_THAT(logs, HasSubstr("worker left: " + left + "'s agent is shutting down")) << logs;
  EXPECT_THAT(logs, HasSubstr("killed by signal 15")) << logs;
  EXPECT_THAT(logs, ::testing::Not(HasSubstr("killed by signal 9"))) << logs;
  ASSERT_TRUE(c.client().CancelJob(id).ok());
  EXPECT_EQ(c.WaitDone(id).state(), v1::CANCELLED);
  const std::vector<v1::JobEvent> events = c.AllEvents(id);  // ends with the job
  bool restarting_as_left = false;
  for (const v1::JobEvent& e : events) {
    if (e.has_state_change() && e.state_change().state() == v1::RESTARTING) {
      restarting_as_left = absl::StrContains(e.state_change().reason(), "worker left: " + left);
    }
  }
  EXPECT_TRUE(restarting_as_left) << logs;
}

// A long-lived client's channel still holds the killed coordinator's
// connection until something polls it; its next call went out on it and
// failed (UNAVAILABLE: "Socket closed" or "Broken pipe") although the
// coordinator was back.
// OpenChannel's retry policy for the read calls sends it again.
TEST(FaultTest, AClientsReadsSucceedRightAfterACoordinatorRestart) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("client-restart", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  for (int i = 0; i < 3; ++i) {
    auto sub = c.client().SubmitJob(TinyJob(5), false);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ASSERT_TRUE(c.client().GetJob(sub->job().id()).ok());
    c.KillCoordinator(SIGKILL);
    ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
    auto got = c.client().GetJob(sub->job().id());
    EXPECT_TRUE(got.ok()) << "restart " << i << ": " << got.status();
    auto listed = c.client().ListJobs(v1::ListJobsRequest());
    EXPECT_TRUE(listed.ok()) << "restart " << i << ": " << listed.status();
  }
}

TEST(FaultTest, CoordinatorKilledAndRestartedMidJobLosesNothing) {
  Cluster c("coordinator-restart");
  ASSERT_TRUE(c.ready()) << c.Logs();
  // Long enough that the ranks are still training 1.5 s after the kill on
  // a fast machine (CI ran the tiny job at ~20 ms a step).
  constexpr int64_t kSteps = 400;
  auto sub = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 10)) << c.Logs();
  const std::vector<pid_t> ranks = c.RankPids(id);
  ASSERT_EQ(ranks.size(), 2u);
  c.KillCoordinator(SIGKILL);
  // The ranks train on while nobody listens; the agent keeps what they say.
  absl::SleepFor(absl::Milliseconds(1500));
  for (pid_t p : ranks) EXPECT_EQ(kill(p, 0), 0) << "rank pid " << p << " died with the coordinator";
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  // The agent waits on its channel while the coordinator is away
  // (client/connection.h's PauseBeforeRetry), so it is back within gRPC's
  // reconnect backoff (at most 1 s) of the restart: 0.06-0.96 s measured,
  // under 0.9 s beside two busy loops. Retries that slept found the
  // restarted coordinator 2.2-3.1 s late here and 6.4 s late in a bare
  // restart, and one processwrapper run missed the 10 s re-attach window.
  const absl::Time restarted = absl::Now();
  ASSERT_TRUE(WaitFor([&] {
    auto w = c.client().ListWorkers();
    return w.ok() && w->workers_size() == 1 && w->workers(0).state() == "attached";
  })) << c.Logs();
  EXPECT_LT(absl::Now() - restarted, absl::Milliseconds(2500)) << c.Logs();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 0) << "re-attached, not restarted";
  EXPECT_EQ(job.progress().step(), kSteps);

  const std::vector<v1::JobEvent> events = c.AllEvents(id);
  ASSERT_EQ(static_cast<int64_t>(events.size()), job.event_count());
  // One event per step, none lost or repeated across the restart, each
  // over both ranks (the per-rank detail too).
  std::vector<int64_t> steps;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index(), static_cast<int64_t>(i));
    if (!events[i].has_job_step()) continue;
    steps.push_back(events[i].job_step().step());
    EXPECT_EQ(events[i].job_step().ranks_reported(), 2) << "step " << events[i].job_step().step();
  }
  std::vector<int64_t> want(kSteps);
  for (int64_t s = 0; s < kSteps; ++s) want[s] = s + 1;
  EXPECT_EQ(steps, want);
  std::map<int, std::set<int64_t>> reported;  // per rank
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    for (const v1::StepTelemetry& t : e.job_step().per_rank()) reported[t.rank()].insert(t.step());
    return true;
  }, /*per_rank=*/true).ok());
  for (int r : {0, 1}) EXPECT_EQ(reported[r].size(), static_cast<size_t>(kSteps)) << "rank " << r;
  // (PENDING may repeat with a new reason while the worker registers.)
  std::vector<v1::JobState> states = States(events);
  states.erase(std::unique(states.begin(), states.end()), states.end());
  EXPECT_EQ(states, (std::vector<v1::JobState>{v1::PENDING, v1::SCHEDULED, v1::RUNNING, v1::SUCCEEDED}));
  // Every line rank 0 printed, including those printed while the
  // coordinator was down.
  const std::string logs = AllLogs(c, id);
  // (Rank 0 prints every steps / 20 steps: worker/rank_main.cc.)
  for (int64_t s = kSteps / 20; s <= kSteps; s += kSteps / 20) {
    EXPECT_THAT(logs, HasSubstr(absl::StrCat("0 stderr step ", s, "/", kSteps, " loss"))) << s;
  }
  EXPECT_THAT(logs, HasSubstr("coordinator re-attached after the coordinator's restart: worker-1"));
  EXPECT_THAT(logs, HasSubstr(absl::StrCat("0 stderr finished ", kSteps, " steps")));
  EXPECT_THAT(logs, HasSubstr(absl::StrCat("1 stderr finished ", kSteps, " steps")));
  EXPECT_TRUE(c.RankPids(id).empty());
}

// A job far longer than any test (it is cancelled or fails first) on a
// ready cluster, trained `steps` steps: its id and its two ranks' pids.
void StartLongJob(Cluster& c, int64_t steps, std::string* id, std::vector<pid_t>* ranks) {
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  *id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(*id, steps)) << c.Logs();
  *ranks = c.RankPids(*id);
  ASSERT_EQ(ranks->size(), 2u);
}

// Whether, within `timeout`, every one of `ranks` is stopped ('T'), or
// with stopped = false none is.
bool WaitRanksStopped(const std::vector<pid_t>& ranks, bool stopped, absl::Duration timeout) {
  return WaitFor(
      [&] {
        return std::all_of(ranks.begin(), ranks.end(), [&](pid_t p) { return (ProcState(p) == 'T') == stopped; });
      },
      timeout);
}

std::string RankStates(const std::vector<pid_t>& ranks) {
  std::string out;
  for (pid_t p : ranks) out.push_back(ProcState(p));
  return out;
}

// The same rank processes (resumed, not replaced) train `steps` steps more;
// then the job is cancelled. Returns the job once done.
v1::Job SameRanksTrainOnThenCancel(Cluster& c, const std::string& id, std::vector<pid_t> ranks, int64_t steps) {
  // (The first call after the restart goes out on the killed coordinator's
  // connection; the client's retry policy sends it again.)
  auto resumed = c.client().GetJob(id);
  EXPECT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE(resumed.ok() && c.WaitStep(id, resumed->progress().step() + steps)) << c.Logs();
  std::vector<pid_t> now = c.RankPids(id);
  std::sort(now.begin(), now.end());
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(now, ranks) << "the ranks were replaced, not resumed";
  auto cancelled = c.client().CancelJob(id);
  EXPECT_TRUE(cancelled.ok()) << cancelled.status();
  return c.WaitDone(id);
}

TEST(FaultTest, WorkerDeclaredLostStopsItsRanksWhenItComesBack) {
  ClusterOptions o;
  o.heartbeat_ms = 500;
  o.worker_timeout_s = 0;
  Cluster c("partition", o);
  std::string id;
  std::vector<pid_t> ranks;
  ASSERT_NO_FATAL_FAILURE(StartLongJob(c, 2, &id, &ranks));
  // The agent freezes: to the coordinator it is a lost worker. Its ranks,
  // in their own process groups, are not frozen with it; they stop
  // themselves once its lease is a second overdue (worker/rank_lease.h).
  ASSERT_EQ(kill(c.worker()->pid(), SIGSTOP), 0);
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::WORKER_LOST);
  EXPECT_TRUE(WaitRanksStopped(ranks, true, absl::Seconds(20)))
      << "the frozen agent's ranks train on: " << RankStates(ranks);
  for (pid_t p : ranks) EXPECT_EQ(kill(p, 0), 0) << "the check below must be able to fail";
  ASSERT_EQ(kill(c.worker()->pid(), SIGCONT), 0);
  // Back, it registers again; its job is no longer live, so it stops it.
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30))) << c.Logs();
  EXPECT_THAT(c.worker()->out(), HasSubstr("registered again as worker-1"));
}

TEST(FaultTest, RanksFrozenByALapsedLeaseResumeWhenTheRestartedCoordinatorReattachesThem) {
  // The lease (docs/SERVICE.md "Partitions and fencing") is 3/4 of the
  // shorter of the worker and re-attach timeouts: 3 s here. A coordinator
  // down longer than that freezes the ranks; restarted, it re-attaches the
  // attempt, and the agent resumes them: the job trains on as attempt 0.
  // The job is far longer than the test (a short one finished before the
  // lease lapsed on a fast CI machine: nothing was left to freeze); once the
  // resumed ranks have trained on, the test cancels it.
  ClusterOptions o;
  o.worker_timeout_s = 4;
  o.coordinator_flags = {"--reattach_timeout_s=20"};
  Cluster c("lease-resume", o);
  std::string id;
  std::vector<pid_t> ranks;
  ASSERT_NO_FATAL_FAILURE(StartLongJob(c, 5, &id, &ranks));
  c.KillCoordinator(SIGKILL);
  const absl::Time killed = absl::Now();
  EXPECT_TRUE(WaitRanksStopped(ranks, true, absl::Seconds(20))) << "the ranks were not frozen: " << RankStates(ranks);
  EXPECT_GE(absl::Now() - killed, absl::Seconds(2)) << "frozen before the lease could have lapsed";
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  EXPECT_TRUE(WaitRanksStopped(ranks, false, absl::Seconds(30))) << "the ranks were not resumed";
  // Resumed, the same ranks train on: steps past the restart arrive.
  const v1::Job job = SameRanksTrainOnThenCancel(c, id, ranks, 5);
  ASSERT_EQ(job.state(), v1::CANCELLED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 0) << "re-attached and resumed, not restarted";
  const std::string logs = AllLogs(c, id);
  EXPECT_THAT(logs, HasSubstr("-1 agent fenced: no answer from the coordinator for"));
  EXPECT_THAT(logs, HasSubstr("-1 agent the coordinator answers again and kept the attempt: the ranks resume"));
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30))) << "cancelled ranks still run";
}

// A frozen agent freezes nothing; its ranks stop themselves once the lease
// is a second overdue (worker/rank_lease.h), and resume with the agent when
// it thaws before the coordinator gives up on it: the same ranks train on
// as attempt 0. The lease is 1.5 s (3/4 of the 2 s re-attach timeout), the
// worker timeout 20 s: the agent thaws well inside it.
TEST(FaultTest, AFrozenAgentsRanksStopThemselvesAndResumeWithIt) {
  ClusterOptions o;
  o.worker_timeout_s = 20;
  o.coordinator_flags = {"--reattach_timeout_s=2"};
  Cluster c("frozen-agent", o);
  std::string id;
  std::vector<pid_t> ranks;
  ASSERT_NO_FATAL_FAILURE(StartLongJob(c, 3, &id, &ranks));
  ASSERT_EQ(kill(c.worker()->pid(), SIGSTOP), 0);
  const absl::Time frozen = absl::Now();
  EXPECT_TRUE(WaitRanksStopped(ranks, true, absl::Seconds(15)))
      << "the frozen agent's ranks train on: " << RankStates(ranks);
  EXPECT_GE(absl::Now() - frozen, absl::Seconds(1)) << "stopped before the lease could have lapsed";
  ASSERT_EQ(kill(c.worker()->pid(), SIGCONT), 0);
  EXPECT_TRUE(WaitRanksStopped(ranks, false, absl::Seconds(15))) << "the ranks were not resumed";
  const v1::Job job = SameRanksTrainOnThenCancel(c, id, ranks, 3);
  ASSERT_EQ(job.state(), v1::CANCELLED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 0) << "resumed, not restarted";
  EXPECT_THAT(AllLogs(c, id), HasSubstr("stopped itself for"));
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30))) << "cancelled ranks still run";
}

// The agent resumes a rank that stopped itself whenever the lease holds,
// also when the renewal came before the agent's own fence could freeze the
// job (a short freeze of the agent: the rank stops itself a second after
// the lease's end; the agent, thawed, renews before its fence runs). Here
// the test plays that moment: it writes a lapsed end into rank 0's page
// (its descriptor 3, opened through /proc) while the agent's lease holds,
// until the rank stops itself; the agent resumes it (not frozen, not
// stopping: that path alone), says so, and the job trains on.
TEST(FaultTest, ARankThatStoppedItselfResumesWhileTheLeaseHolds) {
  ClusterOptions o;
  o.worker_timeout_s = 20;
  Cluster c("self-stopped", o);
  std::string id;
  std::vector<pid_t> ranks;
  ASSERT_NO_FATAL_FAILURE(StartLongJob(c, 2, &id, &ranks));
  const std::string page = absl::StrCat("/proc/", ranks[0], "/fd/", kRankLeaseFd);
  const int fd = open(page.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << page;
  auto lease = RankLease::Attach(fd);
  ASSERT_TRUE(lease.ok()) << lease.status();
  const std::string said = "had stopped itself (its lease lapsed while this agent did not answer)";
  // The agent rewrites the end at each heartbeat (200 ms): lapse it again
  // until the rank's watchdog (100 ms polls) has caught one.
  EXPECT_TRUE(WaitFor(
      [&] {
        (*lease)->SetEnd(MonotonicNanos() - int64_t{10'000'000'000});
        return absl::StrContains(AllLogs(c, id), said);
      },
      absl::Seconds(30)))
      << c.Logs();
  const v1::Job job = SameRanksTrainOnThenCancel(c, id, ranks, 3);
  ASSERT_EQ(job.state(), v1::CANCELLED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 0);
  EXPECT_THAT(AllLogs(c, id), HasSubstr("0 stderr plateau_rank: rank 0 stopped itself for"));
  EXPECT_TRUE(WaitFor([&] { return c.RankPids(id).empty(); }, absl::Seconds(30))) << "cancelled ranks still run";
}

}  // namespace
}  // namespace plateau
