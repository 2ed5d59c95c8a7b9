// The service end to end, with real processes over loopback: a coordinator
// (real SQLite in a temporary directory, real /metrics over HTTP), a worker
// agent spawning real rank processes, driven through the gRPC API and
// plateauctl (tests/cluster.h).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "plateau/v1/worker.grpc.pb.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

// The harness itself: a command that cannot start fails at once, saying
// why, and leaves the test's other children alone (waiting on pid 0 would
// have waited for any of them, here for the deadline).
TEST(ServiceTest, HarnessFailsFastOnACommandThatCannotStart) {
  const std::string dir = TempDir("harness");
  Process other({"/bin/sleep", "60"}, dir + "/sleep");
  ASSERT_TRUE(other.Running());
  Process missing({dir + "/no-such-binary"}, dir + "/missing");
  EXPECT_EQ(missing.pid(), 0);
  EXPECT_FALSE(missing.Running());
  EXPECT_THAT(missing.spawn_error(), HasSubstr("no-such-binary: No such file or directory"));
  const absl::Time start = absl::Now();
  Ran r = RunCommand({dir + "/no-such-binary", "--flag"}, dir + "/run");
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(r.code, -1);
  EXPECT_EQ(r.err, "cannot start " + dir + "/no-such-binary: No such file or directory");
  EXPECT_TRUE(other.Running()) << "RunCommand reaped another child";
}

// The harness finds a cluster's ranks by the cluster's directory, not by the
// job's id: two clusters each running their job-1 at the same time (as two
// tests do beside each other without a PID namespace) never see each
// other's ranks. b's directory starts with a's name ("own", "own2"): a
// directory is matched whole, not as a string prefix.
TEST(ServiceTest, HarnessFindsOnlyItsOwnClustersRanks) {
  Cluster a("own"), b("own2");
  ASSERT_TRUE(a.ready() && b.ready()) << a.Logs() << b.Logs();
  auto sa = a.client().SubmitJob(TinyJob(1000000), false);
  auto sb = b.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sa.ok() && sb.ok()) << sa.status() << sb.status();
  ASSERT_EQ(sa->job().id(), "job-1");
  ASSERT_EQ(sb->job().id(), "job-1");
  ASSERT_TRUE(a.WaitStep("job-1", 1)) << a.Logs();
  ASSERT_TRUE(b.WaitStep("job-1", 1)) << b.Logs();
  std::vector<pid_t> ra = a.RankPids("job-1"), rb = b.RankPids("job-1");
  ASSERT_EQ(ra.size(), 2u);
  ASSERT_EQ(rb.size(), 2u);
  for (pid_t p : ra) EXPECT_THAT(rb, ::testing::Not(::testing::Contains(p)));
  EXPECT_NE(a.RankPid("job-1", 1), b.RankPid("job-1", 1));
  EXPECT_NE(a.RankPid("job-1", 1), 0);
  ASSERT_TRUE(a.client().CancelJob("job-1").ok());
  ASSERT_EQ(a.WaitDone("job-1").state(), v1::CANCELLED) << a.Logs();
  EXPECT_TRUE(a.RankPids("job-1").empty());
  EXPECT_EQ(b.RankPids("job-1").size(), 2u) << "cancelling a's job-1 touched b's";
}

TEST(ServiceTest, SubmitRunSucceedsWithTelemetryInWatchAndMetrics) {
  Cluster c("succeed");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(6), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  EXPECT_EQ(id, "job-1");
  EXPECT_EQ(sub->plan().live_sets_size(), 8);

  std::vector<v1::JobEvent> events;
  absl::Status s = c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  });
  ASSERT_TRUE(s.ok()) << s << c.Logs();
  std::vector<v1::JobState> states;
  std::vector<int64_t> steps;  // one event per step of the whole job
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index(), static_cast<int64_t>(i));
    EXPECT_FALSE(events[i].has_step()) << "no per-rank events any more";
    if (events[i].has_state_change()) states.push_back(events[i].state_change().state());
    if (events[i].has_job_step()) {
      const v1::JobStepSummary& t = events[i].job_step();
      steps.push_back(t.step());
      EXPECT_GT(t.loss(), 0);
      EXPECT_EQ(t.tokens(), 4 * 32);
      EXPECT_GT(t.model_flops(), 0);
      EXPECT_GT(t.seconds(), 0);
      EXPECT_GE(t.slowest_seconds(), t.seconds());
      EXPECT_TRUE(t.slowest_rank() == 0 || t.slowest_rank() == 1);
      EXPECT_EQ(t.ranks(), 2);
      EXPECT_EQ(t.ranks_reported(), 2);
      EXPECT_EQ(t.peak_size(), 8);
      EXPECT_GT(t.peak(0).bytes(), 0) << "weights peak";
    }
  }
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(states.front(), v1::PENDING);
  EXPECT_EQ(states.back(), v1::SUCCEEDED) << c.Logs();
  EXPECT_THAT(states, ::testing::Contains(v1::RUNNING));
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));

  // Resuming from an index replays exactly the rest.
  std::vector<v1::JobEvent> rest;
  ASSERT_TRUE(c.client().WatchJob(id, 5, [&](const v1::JobEvent& e) {
    rest.push_back(e);
    return true;
  }).ok());
  ASSERT_EQ(rest.size(), events.size() - 5);
  EXPECT_EQ(rest[0].SerializeAsString(), events[5].SerializeAsString());

  auto job = c.client().GetJob(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::SUCCEEDED);
  EXPECT_EQ(job->progress().step(), 6);
  EXPECT_GT(job->progress().tokens_per_second(), 0);
  EXPECT_EQ(job->event_count(), static_cast<int64_t>(events.size()));

  std::string logs;
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    logs += absl::StrCat(l.rank(), " ", l.line(), "\n");
    return true;
  }).ok());
  EXPECT_THAT(logs, HasSubstr("0 finished 6 steps"));
  EXPECT_THAT(logs, HasSubstr("1 finished 6 steps"));

  const std::string m = Scrape(c.metrics());
  ASSERT_THAT(m, HasSubstr("200 OK"));
  EXPECT_EQ(Sample(m, "plateau_job_step{job_id=\"job-1\",rank=\"0\"}"), 6);
  EXPECT_EQ(Sample(m, "plateau_job_step{job_id=\"job-1\",rank=\"1\"}"), 6);
  // Each rank counts its half of the global batch.
  EXPECT_EQ(Sample(m, "plateau_job_tokens_total{job_id=\"job-1\",rank=\"0\"}"), 6 * 4 * 32 / 2);
  EXPECT_GT(Sample(m, "plateau_job_model_flops_total{job_id=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_job_loss{job_id=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_step_duration_seconds_count{job_id=\"job-1\",rank=\"0\"}"), 6);
  EXPECT_GT(Sample(m, "plateau_job_peak_bytes{job_id=\"job-1\",live_set=\"weights\",rank=\"0\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_job_peak_bytes{job_id=\"job-1\",live_set=\"dispatch\",rank=\"1\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_planned_bytes{job_id=\"job-1\",live_set=\"weights\",rank=\"0\"}"),
            sub->plan().live_sets(0).bytes());
  EXPECT_GT(Sample(m, "plateau_job_mfu_ratio{job_id=\"job-1\",rank=\"0\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_state{job_id=\"job-1\",state=\"SUCCEEDED\"}"), 1);
  EXPECT_EQ(Sample(m, "plateau_job_state{job_id=\"job-1\",state=\"RUNNING\"}"), 0);
  EXPECT_GT(Sample(m, "plateau_worker_last_heartbeat_timestamp_seconds{worker=\"worker-1\"}"), 1.7e9);
  EXPECT_TRUE(c.RankPids(id).empty());
}

TEST(ServiceTest, CancelMidRunLeavesNoRankProcess) {
  Cluster c("cancel");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const std::vector<pid_t> pids = c.RankPids(id);
  ASSERT_EQ(pids.size(), 2u) << "the check below must be able to fail";
  auto cancelled = c.client().CancelJob(id);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  EXPECT_EQ(cancelled->state(), v1::CANCELLING);
  const v1::Job job = c.WaitDone(id);
  EXPECT_EQ(job.state(), v1::CANCELLED) << job.DebugString() << c.Logs();
  EXPECT_FALSE(job.has_failure());
  // CANCELLED means no rank process is left: checked from the process table.
  EXPECT_TRUE(c.RankPids(id).empty());
  for (pid_t p : pids) EXPECT_NE(kill(p, 0), 0) << "pid " << p << " still exists";
  // SIGTERM stopped them (not the SIGKILL after the grace period).
  std::string logs;
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    logs += l.line() + "\n";
    return true;
  }).ok());
  for (pid_t p : pids) EXPECT_THAT(logs, HasSubstr("(pid " + std::to_string(p) + ") killed by signal 15"));
  // A second cancel (a retry whose first answer was lost) is answered OK
  // with the job, CANCELLED.
  absl::StatusOr<v1::Job> again = c.client().CancelJob(id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->state(), v1::CANCELLED);
}

TEST(ServiceTest, KilledRankFailsTheJobWithItsSignal) {
  Cluster c("crash");
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const pid_t rank1 = c.RankPid(id, 1);
  ASSERT_NE(rank1, 0);
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::RANK_CRASHED) << job.failure().DebugString();
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().signal(), SIGKILL);
  EXPECT_THAT(job.state_reason(), HasSubstr("signal 9"));
  EXPECT_TRUE(c.RankPids(id).empty());
}

TEST(ServiceTest, CrashedAttemptRestartsWhenRestartsAreLeft) {
  Cluster c("restart");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(300);
  spec.set_max_restarts(1);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  const std::vector<pid_t> first = c.RankPids(id);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(kill(first[0], SIGKILL), 0);
  const v1::Job job = c.WaitDone(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 1);
  std::vector<v1::JobState> states;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    if (e.has_state_change()) states.push_back(e.state_change().state());
    return true;
  }).ok());
  EXPECT_THAT(states, ::testing::Contains(v1::RESTARTING));
  EXPECT_EQ(std::count(states.begin(), states.end(), v1::RUNNING), 2);
}

TEST(ServiceTest, RankExitCodeAndMessageReachTheJob) {
  Cluster c("exitcode");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  spec.mutable_model()->set_vocab_size(256);
  spec.mutable_data()->mutable_text()->set_path("/nonexistent/plateau-test.txt");
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const v1::Job job = c.WaitDone(sub->job().id());
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::INVALID);
  EXPECT_EQ(job.failure().exit_code(), 4);
  EXPECT_EQ(job.failure().signal(), 0);
  EXPECT_THAT(job.failure().message(), HasSubstr("/nonexistent/plateau-test.txt"));
}

// A checkpoint directory the ranks cannot create is the job's setting, not
// a crash: INVALID, with the directory and the reason, and not restarted.
TEST(ServiceTest, ACheckpointDirectoryThatCannotBeCreatedIsAnInvalidJob) {
  Cluster c("bad-ckpt-dir");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  spec.set_max_restarts(2);
  const std::string blocker = c.dir() + "/a-file";
  { std::ofstream(blocker) << "not a directory"; }
  spec.mutable_checkpoint()->set_directory(blocker + "/ckpt");
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const v1::Job job = c.WaitDone(sub->job().id());
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.failure().kind(), v1::Failure::INVALID) << job.failure().DebugString();
  EXPECT_EQ(job.attempt(), 0) << "restarted for a setting no restart changes";
  EXPECT_THAT(job.failure().message(),
              HasSubstr("checkpoint.directory=" + blocker + "/ckpt: cannot create it"));
}

TEST(ServiceTest, JobOverTheDeviceCapFailsNamingTheLiveSet) {
  Cluster c("oom");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(5);
  // Standard EP: the baseline whose receive buffers follow the routing (the
  // demo's PipelinedLLEP allocates its bound at launch).
  spec.mutable_schedule()->mutable_standard_ep();
  auto plan = c.client().PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int64_t dispatch = 0;
  for (const auto& ls : plan->plan().live_sets()) {
    if (ls.live_set() == "dispatch") dispatch = ls.bytes();
  }
  // Holds the launch-sized state but only a quarter of the balanced routes.
  const int64_t cap = plan->plan().total_bytes() - dispatch + plan->plan().dispatch_balanced_bytes() / 4;
  spec.set_device_memory_bytes(cap);
  spec.set_max_restarts(2);  // an out-of-memory would fail again: never restarted
  // Admission refuses a plan over the cap, naming the shortfall and how to
  // force it...
  auto refused = c.client().SubmitJob(spec, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), AllOf(HasSubstr("short by"), HasSubstr("force_launch")));
  // ...and launches it when forced; the step then runs out of memory by name.
  spec.set_force_launch(true);
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_FALSE(sub->plan().fits());
  const v1::Job job = c.WaitDone(sub->job().id());
  ASSERT_EQ(job.state(), v1::FAILED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.attempt(), 0);
  EXPECT_EQ(job.failure().kind(), v1::Failure::OUT_OF_MEMORY) << job.failure().DebugString();
  EXPECT_EQ(job.failure().live_set(), "dispatch");
  EXPECT_EQ(job.failure().exit_code(), 3);
  const v1::OutOfMemory& oom = job.failure().out_of_memory();
  EXPECT_EQ(oom.live_set(), v1::LIVE_SET_DISPATCH);
  EXPECT_EQ(oom.space(), "device");
  EXPECT_EQ(oom.cap_bytes(), cap);
  EXPECT_GT(oom.bytes_requested(), oom.bytes_free());
  EXPECT_THAT(
      job.state_reason(),
      AllOf(HasSubstr("live set 'dispatch'"), HasSubstr(absl::StrCat("asked for ", oom.bytes_requested(), " bytes")),
            HasSubstr(absl::StrCat(oom.bytes_free(), " bytes free")), HasSubstr("in use: ")));
  // Said once: the rank's message carries the numbers (the coordinator
  // said them again before it).
  const std::string asked = absl::StrCat("asked for ", oom.bytes_requested(), " bytes");
  const size_t first = job.state_reason().find(asked);
  EXPECT_EQ(job.state_reason().find(asked, first + 1), std::string::npos) << job.state_reason();
}

// JobSpec.host_memory_bytes reaches every rank's backend, and the host
// live sets are planned, admitted and measured through the whole service:
// the tiny job (2 layers, 64 tokens x H = 64 per rank) keeps SCO's pool
// (h_0, 16 KiB), OffloadStreamAdamW's master and moments and PipelinedLLEP's
// index staging in host memory. A cap one byte short of the host plan is
// refused at submit (plateauctl exits 5, the code for a plan that does not
// fit); at exactly the plan it runs, each rank logs the cap read back from
// its backend, every step's host peak is the plan, and /metrics carries it.
TEST(ServiceTest, HostLiveSetsArePlannedAdmittedAndMeasuredAgainstTheHostCap) {
  Cluster c("host-cap");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(3);
  ASSERT_EQ(spec.schedule().checkpoints_case(), v1::ScheduleSpec::kSco) << "the demo job turns SCO on";
  auto planned = c.client().PlanJob(spec);
  ASSERT_TRUE(planned.ok()) << planned.status();
  const int64_t kPool = planned->plan().host_total_bytes();
  for (const v1::LiveSetBytes& ls : planned->plan().host_live_sets()) {
    if (ls.live_set() == "checkpoints") {
      EXPECT_EQ(ls.bytes(), 64 * 64 * 4);
    }
  }
  auto write = [&](const v1::JobSpec& js, const std::string& name) {
    std::string text;
    EXPECT_TRUE(google::protobuf::TextFormat::PrintToString(js, &text));
    const std::string path = c.dir() + "/" + name + ".txtpb";
    std::ofstream(path) << text;
    return path;
  };
  spec.set_host_memory_bytes(kPool - 1);
  Ran short_by_one = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "submit",
                                 write(spec, "short")}, c.dir() + "/short");
  EXPECT_EQ(short_by_one.code, 5) << short_by_one.out << short_by_one.err;
  EXPECT_THAT(short_by_one.err, AllOf(HasSubstr("host_memory_bytes: the host plan does not fit"),
                                      HasSubstr("checkpoints=16384"), HasSubstr("optimizer="),
                                      HasSubstr("short by 1 bytes")));

  spec.set_host_memory_bytes(kPool);
  Ran p = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "plan", write(spec, "exact")},
                     c.dir() + "/plan");
  EXPECT_EQ(p.code, 0) << p.out << p.err;
  EXPECT_THAT(p.out, AllOf(HasSubstr("host bytes per live set"),
                           HasSubstr(absl::StrCat("of a host cap of ", kPool, " bytes"))));

  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ(sub->plan().host_memory_bytes(), kPool);
  EXPECT_EQ(sub->plan().host_total_bytes(), kPool);
  EXPECT_EQ(sub->plan().host_live_sets_size(), 8);
  EXPECT_TRUE(sub->plan().fits());
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  EXPECT_EQ(job.plan().host_memory_bytes(), kPool);

  std::set<int> capped;  // ranks whose backend holds the cap
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    if (absl::StrContains(l.line(), absl::StrCat("host memory cap ", kPool, " bytes;"))) capped.insert(l.rank());
    return true;
  }).ok());
  EXPECT_EQ(capped, (std::set<int>{0, 1})) << c.Logs();

  int steps = 0;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    if (!e.has_job_step()) return true;
    ++steps;
    EXPECT_EQ(e.job_step().host_peak_size(), 8);
    EXPECT_EQ(e.job_step().host_peak_total_bytes(), kPool);
    return true;
  }).ok());
  EXPECT_EQ(steps, static_cast<int>(job.spec().steps()));
  const std::string m = Scrape(c.metrics());
  EXPECT_EQ(Sample(m, "plateau_job_host_peak_bytes{job_id=\"" + id + "\",live_set=\"checkpoints\",rank=\"1\"}"),
            64 * 64 * 4);
  EXPECT_EQ(Sample(m, "plateau_job_host_peak_bytes{job_id=\"" + id + "\",live_set=\"total\",rank=\"1\"}"), kPool);
}

TEST(ServiceTest, ValidateOnlyCreatesNothingAndBadSpecsNameTheField) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("validate", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto v = c.client().SubmitJob(TinyJob(5), /*validate_only=*/true);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE(v->has_job());
  EXPECT_EQ(v->plan().live_sets_size(), 8);
  const std::vector<std::pair<std::string, std::function<void(v1::JobSpec&)>>> bad = {
      {"model.heads", [](v1::JobSpec& s) { s.mutable_model()->set_heads(3); }},
      {"layout.nodes", [](v1::JobSpec& s) { s.mutable_layout()->set_nodes(5); }},
      {"optimizer.lr", [](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-1); }},
      {"data.recall.pairs", [](v1::JobSpec& s) { s.mutable_data()->mutable_recall()->set_pairs(0); }},
      {"steps", [](v1::JobSpec& s) { s.set_steps(0); }},
      {"backend", [](v1::JobSpec& s) { s.clear_backend(); }},
      {"host_memory_bytes", [](v1::JobSpec& s) { s.set_host_memory_bytes(-1); }},
  };
  for (bool validate_only : {true, false}) {
    for (const auto& [field, mutate] : bad) {
      v1::JobSpec s = TinyJob(5);
      mutate(s);
      auto r = c.client().SubmitJob(s, validate_only);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field << ": " << r.status();
      EXPECT_THAT(r.status().message(), HasSubstr(field + ":"));
    }
  }
  v1::JobSpec small = TinyJob(5);
  small.set_device_memory_bytes(1 << 16);
  auto r = c.client().SubmitJob(small, false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("device_memory_bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("weights="));
  auto list = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 0) << "nothing may have been created";
  EXPECT_EQ(c.client().GetJob("job-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.client().GetJob("banana").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServiceTest, ListJobsPagesAndFiltersOverMoreThanOnePage) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("list", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  std::vector<std::string> ids;
  for (int i = 0; i < 7; ++i) {
    auto sub = c.client().SubmitJob(TinyJob(5), false);
    ASSERT_TRUE(sub.ok()) << sub.status();
    ids.push_back(sub->job().id());
  }
  for (int i : {1, 3, 5}) {
    auto j = c.client().CancelJob(ids[i]);
    ASSERT_TRUE(j.ok());
    EXPECT_EQ(j->state(), v1::CANCELLED);
  }
  auto pending = c.client().GetJob(ids[0]);
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pending->state(), v1::PENDING);
  EXPECT_THAT(pending->state_reason(), HasSubstr("no worker is registered"));

  auto all_pages = [&](int page_size, std::vector<v1::JobState> states, std::vector<int>* sizes) {
    std::vector<std::string> got;
    v1::ListJobsRequest req;
    req.set_page_size(page_size);
    for (auto s : states) req.add_states(s);
    do {
      auto page = c.client().ListJobs(req);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      sizes->push_back(page->jobs_size());
      for (const auto& j : page->jobs()) {
        got.push_back(j.id());
        if (!states.empty()) {
          EXPECT_EQ(j.state(), states[0]);
        }
      }
      req.set_page_token(page->next_page_token());
    } while (!req.page_token().empty());
    return got;
  };
  std::vector<int> sizes;
  EXPECT_EQ(all_pages(3, {}, &sizes), ids);
  EXPECT_EQ(sizes, (std::vector<int>{3, 3, 1}));
  sizes.clear();
  EXPECT_EQ(all_pages(2, {v1::CANCELLED}, &sizes), (std::vector<std::string>{ids[1], ids[3], ids[5]}));
  EXPECT_EQ(sizes, (std::vector<int>{2, 1}));
  sizes.clear();
  EXPECT_EQ(all_pages(0, {v1::PENDING}, &sizes), (std::vector<std::string>{ids[0], ids[2], ids[4], ids[6]}));
  EXPECT_EQ(sizes, (std::vector<int>{4}));

  v1::ListJobsRequest bad;
  bad.set_page_token("not-a-token");
  EXPECT_THAT(c.client().ListJobs(bad).status().message(), HasSubstr("page_token"));
  bad.Clear();
  bad.set_page_size(5000);
  EXPECT_EQ(c.client().ListJobs(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// Lost workers, hung ranks and coordinator restarts: tests/fault_test.cc.

TEST(ServiceTest, PlateauctlSubmitWaitJsonAndErrors) {
  ClusterOptions options;
  // Jobs no worker can host are marked once the restart window is over.
  options.coordinator_flags = {"--reattach_timeout_s=0.5"};
  Cluster c("cli", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  // The coordinator started before this: its restart window ends by then.
  const absl::Time window_over = absl::Now() + absl::Milliseconds(600);
  const std::string spec_path = c.dir() + "/job.txtpb";
  {
    std::string text;
    google::protobuf::TextFormat::PrintToString(TinyJob(4), &text);
    std::ofstream(spec_path) << text;
  }
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  Ran r = RunCommand({ctl, coord, "submit", spec_path, "--wait"}, c.dir() + "/submit");
  EXPECT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("memory plan per rank"));
  EXPECT_THAT(r.out, HasSubstr("step     4/4"));
  EXPECT_THAT(r.out, HasSubstr("summary: job-1 SUCCEEDED"));
  EXPECT_THAT(r.out, HasSubstr("dispatch"));

  r = RunCommand({ctl, coord, "--output=json", "get", "job-1"}, c.dir() + "/get");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"state\":\"SUCCEEDED\""));

  r = RunCommand({ctl, coord, "submit", spec_path, "--validate-only"}, c.dir() + "/validate");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("nothing was created"));
  r = RunCommand({ctl, coord, "--output=json", "list"}, c.dir() + "/list");
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, HasSubstr("job-1"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("job-2")));

  std::ofstream(c.dir() + "/bad.txtpb") << "model { heads: 3 hidden: 64 }\nlayout { ranks: }\n";
  r = RunCommand({ctl, coord, "submit", c.dir() + "/bad.txtpb"}, c.dir() + "/bad");
  EXPECT_EQ(r.code, 2);
  // The file's fault, said as the command's (no status code: that reads as
  // the coordinator's refusal).
  EXPECT_THAT(r.err, HasSubstr("plateauctl submit: " + c.dir() + "/bad.txtpb:2:"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("INVALID_ARGUMENT")));
  r = RunCommand({ctl, coord, "plan", c.dir() + "/missing.txtpb"}, c.dir() + "/missing");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err,
              HasSubstr("plateauctl plan: " + c.dir() + "/missing.txtpb: cannot open (No such file or directory)"));
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("INVALID_ARGUMENT")));
  {
    v1::JobSpec s = TinyJob(4);
    s.mutable_model()->set_heads(3);
    std::string text;
    google::protobuf::TextFormat::PrintToString(s, &text);
    std::ofstream(c.dir() + "/invalid.txtpb") << text;
  }
  r = RunCommand({ctl, coord, "submit", c.dir() + "/invalid.txtpb"}, c.dir() + "/invalid");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: model.heads:"));

  // Two nodes with one worker: accepted, shown unschedulable with the reason
  // by submit, get and watch, and FAILED once its max_pending_s is up.
  {
    v1::JobSpec s = TinyJob(4);
    s.mutable_layout()->set_nodes(2);
    s.set_max_pending_s(3);
    std::string text;
    google::protobuf::TextFormat::PrintToString(s, &text);
    std::ofstream(c.dir() + "/two_nodes.txtpb") << text;
  }
  // Within the restart window a job is never newly marked (workers may still
  // be registering again); the steps above can finish inside it on a fast
  // machine.
  absl::SleepFor(std::max(absl::ZeroDuration(), window_over - absl::Now()));
  r = RunCommand({ctl, coord, "submit", c.dir() + "/two_nodes.txtpb"}, c.dir() + "/two_nodes");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("submitted job-2: PENDING (unschedulable: needs 2 worker(s)"));
  r = RunCommand({ctl, coord, "get", "job-2"}, c.dir() + "/get_unschedulable");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("only 1 registered worker(s) can host it (worker-1)"));
  EXPECT_THAT(r.out, HasSubstr("pending:  unschedulable since"));
  r = RunCommand({ctl, coord, "watch", "job-2"}, c.dir() + "/watch_unschedulable");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-2 PENDING: unschedulable: needs 2 worker(s)"));
  EXPECT_THAT(r.out, HasSubstr("summary: job-2 FAILED (UNSCHEDULABLE)"));

  // A coordinator that is not there: a clear message and its own exit code.
  const RefusedAddress refused;
  const std::string dead = refused.address();
  ASSERT_FALSE(dead.empty());
  r = RunCommand({ctl, "--coordinator=" + dead, "list"}, c.dir() + "/dead");
  EXPECT_EQ(r.code, 4);
  EXPECT_THAT(r.err, HasSubstr("cannot reach the coordinator at " + dead));
}

// Issue 16: plateauctl for scripts, run as the real binary against a real
// cluster: per-command help, labels, an idempotent submit, list filters,
// JSON of every command with zero values, JSON errors and the exit codes.

std::string WriteSpecFile(const Cluster& c, const std::string& name, const v1::JobSpec& spec) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(spec, &text);
  const std::string path = c.dir() + "/" + name + ".txtpb";
  std::ofstream(path) << text;
  return path;
}

// `json` read back by protobuf's own JSON parser as an M (so it is JSON, of
// that message, with nothing unknown in it).
template <typename M>
M FromJson(const std::string& json) {
  M m;
  auto s = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(s.ok()) << s << ": " << json;
  return m;
}

std::vector<std::string> Lines(const std::string& out) {
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  return lines;
}

// A JobService whose GetJob answers after `delay`: a coordinator slow to
// answer (a long ListJobs scan, a large delete), on cue.
class SlowJobs final : public v1::JobService::Service {
 public:
  explicit SlowJobs(absl::Duration delay) : delay_(delay) {}
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* req, v1::Job* out) override {
    absl::SleepFor(delay_);
    out->set_id(req->job_id());
    out->set_state(v1::SUCCEEDED);
    return grpc::Status::OK;
  }

 private:
  const absl::Duration delay_;
};

// plateauctl's --timeout is the deadline of each unary call (default 10 s):
// a call the coordinator answers later fails (exit 4) saying the deadline
// and the flag; a longer one gets the answer. (SERVICE.md tells a slow
// ListJobs scan to ask again with a longer deadline: there was no way to.)
// Its value is checked before anything is called, and --help shows it.
TEST(ServiceTest, PlateauctlTimeoutIsEachUnaryCallsDeadline) {
  SlowJobs jobs(absl::Milliseconds(1500));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&jobs);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string dir = TempDir("ctl-timeout");
  const std::string ctl = "client/plateauctl", coord = absl::StrCat("--coordinator=127.0.0.1:", port);

  absl::Time start = absl::Now();
  Ran r = RunCommand({ctl, coord, "--timeout=0.3", "get", "job-1"}, dir + "/short");
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(r.code, 4) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("no answer within 0.3 s (--timeout)")) << r.err;
  EXPECT_LT(took, absl::Milliseconds(1400)) << "not the 0.3 s deadline";
  r = RunCommand({ctl, coord, "get", "job-1", "--timeout", "5"}, dir + "/long");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1  SUCCEEDED"));

  for (const char* bad : {"0", "-1", "abc", "3601", "nan", "inf", ""}) {
    r = RunCommand({ctl, coord, absl::StrCat("--timeout=", bad), "get", "job-1"}, dir + "/bad");
    EXPECT_EQ(r.code, 2) << bad << ": " << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr(absl::StrCat("plateauctl: --timeout: expected seconds above 0, at most 3600, got '",
                                              bad, "'")));
  }
  r = RunCommand({ctl, "--help"}, dir + "/help");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("--timeout=SECONDS"));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

TEST(ServiceTest, PlateauctlHelpExitCodesJsonLabelsAndIdempotentSubmit) {
  Cluster c("cli-api");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  auto ctl_run = [&](std::vector<std::string> args, const std::string& log) {
    args.insert(args.begin(), {ctl, coord});
    return RunCommand(args, c.dir() + "/" + log);
  };
  // A usage error: exit 2, `said` on stderr.
  auto usage_error = [&](std::vector<std::string> args, const std::string& log, const std::string& said) {
    const Ran u = ctl_run(std::move(args), log);
    EXPECT_EQ(u.code, 2) << u.out << u.err;
    EXPECT_THAT(u.err, HasSubstr(said));
  };

  // Help: per command, exit 0; an unknown command is a usage error, --help or not.
  Ran r = ctl_run({"submit", "--help"}, "help-submit");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("usage: plateauctl [GLOBAL FLAGS] submit SPEC"), HasSubstr("--request-id=ID"),
                           HasSubstr("--label=KEY=VALUE"), HasSubstr("7  the job had already finished")));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("memory JOB")));
  r = ctl_run({"help", "list"}, "help-list");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("list [FLAGS]"), HasSubstr("--newest-first"), HasSubstr("--label=SELECTOR")));
  r = ctl_run({"version", "--help"}, "help-version");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown command 'version'"));
  EXPECT_EQ(r.out, "");
  r = ctl_run({"version"}, "version");
  EXPECT_EQ(r.code, 2);
  usage_error({"list", "--bogus"}, "bogus", "plateauctl list: unknown flag --bogus");
  // Dashes or underscores, either spelling of every flag: the same flag
  // (so both given at once is a flag given twice), and the error names
  // the declared spelling.
  usage_error({"list", "--page-size=x"}, "dashed-underscore-flag", "--page_size: expected a number of jobs per page");
  usage_error({"list", "--newest_first", "--newest-first"}, "flag-both-spellings",
              "--newest-first given 2 times; expected once");
  usage_error({"--token-file", "/nonexistent/token", "--token_file", "/x", "list"}, "global-both-spellings",
              "--token_file given more than once");
  r = ctl_run({"list", "--page-size", "1", "--newest_first"}, "list-other-spellings");
  EXPECT_EQ(r.code, 0) << r.err;
  {
    // A global flag's value is skipped in either spelling when the command
    // is looked for (it took "/x/ca.pem" for a mistyped command).
    const Ran dashed = ctl_run({"--tls-ca-file", "/x/ca.pem"}, "global-dashed-no-command");
    const Ran underscored = ctl_run({"--tls_ca_file", "/x/ca.pem"}, "global-underscored-no-command");
    EXPECT_EQ(dashed.code, 2);
    EXPECT_EQ(dashed.out + dashed.err, underscored.out + underscored.err);
  }
  usage_error({"get"}, "get-no-arg", "expected 1 argument(s) (JOB), got 0");
  r = ctl_run({"--help"}, "help");
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, AllOf(HasSubstr("6  no such job (NOT_FOUND)"), HasSubstr("submit SPEC")));

  // Labels (both flag spellings) and a request id; the retry is the same job.
  const std::string spec = WriteSpecFile(c, "tiny", TinyJob(3));
  r = ctl_run({"submit", spec, "--label", "team=nlp", "--label=stage=dev", "--request-id=ci-run-41", "--wait"},
              "submit-1");
  ASSERT_EQ(r.code, 0) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, HasSubstr("submitted job-1: "));
  r = ctl_run({"--output", "json", "submit", spec, "--label=team=nlp", "--label=stage=dev",
               "--request-id", "ci-run-41"},
              "submit-retry");
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  ASSERT_EQ(Lines(r.out).size(), 1u) << r.out;
  const v1::SubmitJobResponse retried = FromJson<v1::SubmitJobResponse>(r.out);
  EXPECT_EQ(retried.job().id(), "job-1");
  EXPECT_EQ(retried.job().state(), v1::SUCCEEDED);
  EXPECT_EQ(retried.job().request_id(), "ci-run-41");
  EXPECT_THAT(r.out, AllOf(HasSubstr("\"attempt\":0"), HasSubstr("\"labels\":{"), HasSubstr("\"priority\":0")));
  // Same id, another spec: refused naming the job.
  r = ctl_run({"submit", spec, "--label=team=vision", "--request-id=ci-run-41"}, "submit-conflict");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, AllOf(HasSubstr("ALREADY_EXISTS"), HasSubstr("already created job-1")));
  // Without --request-id every invocation is a new job; a bad label is named.
  r = ctl_run({"submit", spec, "--label=team=vision", "--priority=3", "--quiet"}, "submit-2");
  EXPECT_EQ(r.code, 0) << r.err;
  // --quiet: the one line, without the plan.
  ASSERT_EQ(Lines(r.out).size(), 1u) << r.out;
  EXPECT_THAT(r.out, HasSubstr("submitted job-2: "));
  r = ctl_run({"submit", spec, "--label=team=vision"}, "submit-3");
  EXPECT_THAT(r.out, HasSubstr("submitted job-3: "));
  EXPECT_GT(Lines(r.out).size(), 1u) << "without --quiet, the plan first: " << r.out;
  r = ctl_run({"submit", spec, "--label=team=nlp team"}, "submit-bad-label");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("INVALID_ARGUMENT: labels.value: of the key 'team': expected an empty value"));
  r = ctl_run({"submit", spec, "--label=team"}, "submit-label-no-value");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--label: expected KEY=VALUE, got 'team'"));
  r = ctl_run({"submit", spec, "--label=team=nlp", "--label=team=vision"}, "submit-label-twice");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--label: the key 'team' is given twice; a label has one value"));
  // What goes to the coordinator must be UTF-8 (it failed with an empty
  // INTERNAL); a relative path against a removed current directory is
  // named (the CLI aborted on an exception).
  usage_error({"submit", spec, "--label=team=v\xff"}, "submit-label-not-utf8", "--label: expected UTF-8 text");
  usage_error({"get", "job-\xff"}, "get-not-utf8", "plateauctl get: JOB: expected UTF-8 text");
  {
    v1::JobSpec relative = TinyJob(3);
    relative.mutable_data()->mutable_text()->set_path("relative.txt");
    relative.mutable_model()->set_vocab_size(256);
    const std::string relative_spec = WriteSpecFile(c, "relative", relative);
    const std::string gone = c.dir() + "/gone";
    r = RunCommand({"/bin/sh", "-c", "mkdir \"$1\" && cd \"$1\" && rmdir \"$1\" && exec \"$2\" \"$3\" submit \"$4\"",
                    "sh", gone, std::filesystem::absolute(ctl).string(), coord, relative_spec},
                   c.dir() + "/submit-cwd-gone");
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("data.text.path: cannot make 'relative.txt' absolute"));
  }
  ASSERT_EQ(c.WaitDone("job-2").state(), v1::SUCCEEDED) << c.Logs();
  ASSERT_EQ(c.WaitDone("job-3").state(), v1::SUCCEEDED) << c.Logs();

  // list: label selector, state, newest first; JSON parses with zero values.
  r = ctl_run({"--output=json", "list", "--label", "team=vision", "--newest-first", "--state", "SUCCEEDED"}, "list-1");
  ASSERT_EQ(r.code, 0) << r.err;
  v1::ListJobsResponse listed = FromJson<v1::ListJobsResponse>(r.out);
  ASSERT_EQ(listed.jobs_size(), 2) << r.out;
  EXPECT_EQ(listed.jobs(0).id(), "job-3");
  EXPECT_EQ(listed.jobs(1).id(), "job-2");
  EXPECT_THAT(r.out, HasSubstr("\"next_page_token\":\"\""));
  // A switch given =false is off (it was on whatever its value); another value is refused.
  r = ctl_run({"--output=json", "list", "--label", "team=vision", "--newest-first=false", "--state", "SUCCEEDED"},
              "list-oldest");
  ASSERT_EQ(r.code, 0) << r.err;
  listed = FromJson<v1::ListJobsResponse>(r.out);
  ASSERT_EQ(listed.jobs_size(), 2) << r.out;
  EXPECT_EQ(listed.jobs(0).id(), "job-2");
  usage_error({"list", "--newest-first=no"}, "list-switch-bad",
              "plateauctl list: --newest-first: a switch; expected it bare, =true or =false, got 'no'");
  usage_error({"list", "--all="}, "list-switch-empty",
              "plateauctl list: --all: a switch; expected it bare, =true or =false, got ''");
  // A global flag twice (ctl_run gives --coordinator), or a flag without a command.
  usage_error({"--coordinator=127.0.0.1:1", "list"}, "coordinator-twice",
              "plateauctl: --coordinator given more than once; expected once");
  usage_error({"--version"}, "no-command-flag", "plateauctl: --version: not a global flag, and no command given");
  r = ctl_run({"list", "--label=stage", "--label=!frozen"}, "list-2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1"));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("job-2")));
  r = ctl_run({"list", "--label=team in (nlp)"}, "list-bad");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("label_selector: requirement 'team in (nlp)'"));
  r = ctl_run({"get", "job-1"}, "get-text");
  EXPECT_THAT(r.out, HasSubstr("labels:   stage=dev, team=nlp"));

  // watch and logs as JSON: one event per line, the first with index 0;
  // one event per step of the whole job (3 steps), attempt 0 printed.
  r = ctl_run({"--output=json", "watch", "job-1"}, "watch-json");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> events = Lines(r.out);
  ASSERT_GE(events.size(), 4u + 3);
  EXPECT_EQ(FromJson<v1::JobEvent>(events[0]).index(), 0);
  EXPECT_THAT(events[0], HasSubstr("\"index\":0"));
  int steps = 0;
  for (const std::string& line : events) {
    v1::JobEvent e = FromJson<v1::JobEvent>(line);
    if (e.has_job_step()) {
      ++steps;
      EXPECT_THAT(line, HasSubstr("\"attempt\":0"));
    }
  }
  EXPECT_EQ(steps, 3);
  r = ctl_run({"--output=json", "logs", "job-1"}, "logs-json");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_FALSE(Lines(r.out).empty());
  EXPECT_THAT(Lines(r.out)[0], HasSubstr("\"index\":0"));
  for (const std::string& line : Lines(r.out)) FromJson<v1::LogEntry>(line);
  // A command's flag before the command takes its value the same way
  // (--tail 1 logs: one line, not a command '1'), and "--" ends the flags.
  r = ctl_run({"--output=json", "--tail", "1", "logs", "job-1"}, "logs-flag-first");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out).size(), 1u) << r.out;
  r = ctl_run({"--output=json", "--label", "team=vision", "--state", "SUCCEEDED", "list"}, "list-flags-first");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(FromJson<v1::ListJobsResponse>(r.out).jobs_size(), 2) << r.out;
  r = ctl_run({"get", "--", "job-1"}, "get-after-dashes");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("job-1"));
  usage_error({"get", "--", "job-1", "--rank"}, "get-dashes-flag", "expected 1 argument(s) (JOB), got 2");
  usage_error({"--tail", "logs", "job-1"}, "tail-no-value", "plateauctl: --tail: expected a value");
  usage_error({"logs", "job-1", "--tail", "--", "5"}, "tail-dashes", "plateauctl: --tail: expected a value");
  usage_error({"lgos", "get", "job-1"}, "typo-before-command", "plateauctl: unknown command 'lgos'");
  usage_error({"--follow", "5", "logs", "job-1"}, "word-before-command", "plateauctl: unknown command '5'");
  usage_error({"--tial", "5", "logs", "job-1"}, "flag-typo-before-command", "plateauctl logs: unknown flag --tial");
  usage_error({"--tail", "5", "get", "job-1"}, "other-commands-flag", "plateauctl get: unknown flag --tail");
  r = ctl_run({"--output=json", "plan", spec}, "plan-json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(FromJson<v1::PlanJobResponse>(r.out).plan().fits());
  const int64_t planned = FromJson<v1::PlanJobResponse>(r.out).plan().total_bytes();
  // SPEC "-": the same spec through standard input plans the same.
  r = RunCommand({"/bin/sh", "-c", absl::StrCat(ctl, " ", coord, " --output=json plan - < ", spec)},
                 c.dir() + "/plan-stdin");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(FromJson<v1::PlanJobResponse>(r.out).plan().total_bytes(), planned);
  r = RunCommand({"/bin/sh", "-c", absl::StrCat("echo 'steps: x' | ", ctl, " ", coord, " plan -")},
                 c.dir() + "/plan-stdin-bad");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("<stdin>:1:8: steps (int64): "));
  r = ctl_run({"--output=json", "memory", "job-1"}, "memory-json");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(FromJson<v1::GetMemoryTimelineResponse>(r.out).job_id(), "job-1");
  EXPECT_EQ(FromJson<v1::GetMemoryTimelineResponse>(r.out).ranks_size(), 2) << r.out;
  // --rank picks one rank in JSON too; one without a timeline is refused as in text.
  r = ctl_run({"--output=json", "memory", "job-1", "--rank=1"}, "memory-json-rank");
  EXPECT_EQ(r.code, 0) << r.err;
  {
    const v1::GetMemoryTimelineResponse one = FromJson<v1::GetMemoryTimelineResponse>(r.out);
    ASSERT_EQ(one.ranks_size(), 1) << r.out;
    EXPECT_EQ(one.ranks(0).rank(), 1);
  }
  // A --rank without a timeline is the flag's fault: exit 2 and the code
  // that goes with it (NOT_FOUND is exit 6's: no such job).
  r = ctl_run({"--output=json", "memory", "job-1", "--rank=7"}, "memory-json-absent-rank");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, AllOf(HasSubstr("\"code\":\"INVALID_ARGUMENT\""), HasSubstr("no memory timeline of rank 7")));
  r = ctl_run({"--output=json", "memory", "job-1", "--png=" + c.dir() + "/m.png"}, "memory-json-png");
  EXPECT_EQ(r.code, 2);
  EXPECT_FALSE(std::filesystem::exists(c.dir() + "/m.png"));
  EXPECT_THAT(r.err, HasSubstr("--png draws a chart; --output json prints the timeline as data"));

  // Not found (6) and already finished (7), as text and as JSON on stderr.
  r = ctl_run({"get", "job-99"}, "get-missing");
  EXPECT_EQ(r.code, 6);
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND: job 'job-99' not found"));
  r = ctl_run({"--output=json", "watch", "job-99"}, "watch-missing");
  EXPECT_EQ(r.code, 6);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("{\"error\":{\"code\":\"NOT_FOUND\",\"message\":\"job 'job-99' not found\",\"exit_code\":6}}"));
  r = ctl_run({"cancel", "job-1"}, "cancel-done");
  EXPECT_EQ(r.code, 7);
  EXPECT_THAT(r.err, HasSubstr("FAILED_PRECONDITION: job job-1 is already SUCCEEDED"));
  r = ctl_run({"--output=json", "cancel", "job-1"}, "cancel-done-json");
  EXPECT_EQ(r.code, 7);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, AllOf(HasSubstr("\"code\":\"FAILED_PRECONDITION\""), HasSubstr("\"exit_code\":7")));
  r = ctl_run({"--output=json", "get", "job-x"}, "get-bad-id");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("{\"error\":{\"code\":\"INVALID_ARGUMENT\",\"message\":\"job_id: expected a job id"));
  r = ctl_run({"--output=json", "list", "--page_size=x"}, "usage-json");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, AllOf(HasSubstr("\"code\":\"INVALID_ARGUMENT\""), HasSubstr("--page_size: expected a number of jobs per page, 0 (the default, 50) to 1000"),
                           HasSubstr("\"exit_code\":2")));
  const RefusedAddress refused;
  ASSERT_FALSE(refused.address().empty());
  r = RunCommand({ctl, "--coordinator=" + refused.address(), "--output=json", "list"}, c.dir() + "/dead-json");
  EXPECT_EQ(r.code, 4);
  EXPECT_THAT(r.err, AllOf(HasSubstr("\"code\":\"UNAVAILABLE\""), HasSubstr("\"exit_code\":4")));
  // --validate-only=false creates the job (it used to validate only).
  r = ctl_run({"submit", spec, "--validate-only=false"}, "submit-not-validate-only");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("submitted job-4: "));
  ASSERT_EQ(c.WaitDone("job-4").state(), v1::SUCCEEDED) << c.Logs();
  // Exactly four jobs: the retry made none.
  auto all = c.client().ListJobs(v1::ListJobsRequest());
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->jobs_size(), 4);
}

// The wall-clock limit and the queue's priorities with real ranks: a job
// over its max_duration_s fails with its own reason and leaves no rank; with
// one slot (one worker, 2 devices, jobs of 2 ranks) a higher-priority job
// submitted later starts before an earlier one.
TEST(ServiceTest, MaxDurationFailsTheJobAndPrioritiesOrderTheQueue) {
  Cluster c("limits");
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string ctl = "client/plateauctl";
  const std::string coord = "--coordinator=" + c.api();
  const std::string endless = WriteSpecFile(c, "endless", TinyJob(1000000));
  Ran r = RunCommand({ctl, coord, "submit", endless, "--max-duration=2", "--wait"}, c.dir() + "/limited");
  EXPECT_EQ(r.code, 1) << r.out << r.err << c.Logs();
  EXPECT_THAT(r.out, AllOf(HasSubstr("summary: job-1 FAILED (MAX_DURATION_EXCEEDED)"),
                           HasSubstr("ran for its max_duration_s (2s from its first start")));
  v1::Job limited = c.WaitDone("job-1");
  EXPECT_EQ(limited.failure().kind(), v1::Failure::MAX_DURATION_EXCEEDED);
  EXPECT_EQ(limited.attempt(), 0);
  const absl::Duration ran = absl::FromUnixSeconds(limited.end_time().seconds()) -
                             absl::FromUnixSeconds(limited.start_time().seconds());
  EXPECT_GE(ran, absl::Seconds(1)) << limited.DebugString();  // whole seconds: 2 s can read as 1
  EXPECT_LT(ran, absl::Seconds(30)) << limited.DebugString();
  EXPECT_TRUE(c.RankPids("job-1").empty());

  // The slot is taken by job-2; job-3 (priority 0) then job-4 (priority 5) wait.
  auto busy = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(busy.ok()) << busy.status();
  ASSERT_TRUE(c.WaitStep("job-2", 1)) << c.Logs();
  r = RunCommand({ctl, coord, "submit", endless}, c.dir() + "/low");
  ASSERT_EQ(r.code, 0) << r.err;
  r = RunCommand({ctl, coord, "submit", endless, "--priority", "5"}, c.dir() + "/high");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(c.client().GetJob("job-3")->state(), v1::PENDING);
  EXPECT_EQ(c.client().GetJob("job-4")->state(), v1::PENDING);
  ASSERT_TRUE(c.client().CancelJob("job-2").ok());
  ASSERT_EQ(c.WaitDone("job-2").state(), v1::CANCELLED);
  ASSERT_TRUE(c.WaitStep("job-4", 1)) << c.Logs();
  EXPECT_EQ(c.client().GetJob("job-3")->state(), v1::PENDING) << "the earlier, lower-priority job started first";
  ASSERT_TRUE(c.client().CancelJob("job-4").ok());
  ASSERT_TRUE(c.WaitStep("job-3", 1)) << c.Logs();
  ASSERT_TRUE(c.client().CancelJob("job-3").ok());
  EXPECT_EQ(c.WaitDone("job-3").state(), v1::CANCELLED);
}

// The terminal columns of the widest line: ASCII takes one, a three-byte
// UTF-8 character two (these tests' only other text is Japanese).
size_t Widest(const std::string& out) {
  size_t w = 0;
  for (const std::string& line : Lines(out)) {
    size_t columns = 0;
    for (unsigned char b : line) columns += b < 0x80 ? 1 : (b & 0xF0) == 0xE0 ? 2 : 0;
    w = std::max(w, columns);
  }
  return w;
}

// Issue 16, the CLI: get before and after the first step (no zero
// progress, the placement), logs --rank/--tail, watch and list cut to the
// terminal width with elapsed and ETA, and a watch resumed with --from whose
// summary names the steps it covers and the job's first loss. The real
// plateauctl, as a user runs it.
TEST(ServiceTest, PlateauctlGetLogsWatchAndListFitTheTerminal) {
  ClusterOptions options;
  options.with_worker = false;  // job-1 stays PENDING until a worker comes
  Cluster c("cli-view", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  const std::string coord = "--coordinator=" + c.api();
  // `env` sets COLUMNS for one run only ("-u": none, whatever the test's own).
  auto ctl = [&](const std::string& columns, std::vector<std::string> args, const std::string& log) {
    std::vector<std::string> cmd = {"/usr/bin/env"};
    if (columns.empty()) {
      cmd.insert(cmd.end(), {"-u", "COLUMNS"});
    } else {
      cmd.push_back("COLUMNS=" + columns);
    }
    cmd.insert(cmd.end(), {"client/plateauctl", coord});
    cmd.insert(cmd.end(), args.begin(), args.end());
    return RunCommand(cmd, c.dir() + "/" + log);
  };

  // Before any step: no "loss 0.0000", no placement.
  v1::JobSpec labelled = TinyJob(1000000);
  (*labelled.mutable_labels())["team"] = "nlp";
  auto long_job = c.client().SubmitJob(labelled, false);
  ASSERT_TRUE(long_job.ok()) << long_job.status();
  Ran r = ctl("", {"get", "job-1"}, "get-pending");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("PENDING"), HasSubstr("progress: no step reported yet (of 1000000)"),
                           HasSubstr("placement: none")));
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("loss"))) << r.out;

  // Running: the progress, and the placement with the worker and its ranks.
  ASSERT_NE(c.StartWorker(), nullptr);
  ASSERT_TRUE(c.WaitStep("job-1", 2)) << c.Logs();
  auto workers = c.client().ListWorkers();
  ASSERT_TRUE(workers.ok() && workers->workers_size() == 1) << workers.status();
  r = ctl("", {"get", "job-1"}, "get-running");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("progress: step "), HasSubstr("/1000000, loss "), HasSubstr(", lr 0.006, "),
                           HasSubstr("placement: " + workers->workers(0).id() + " ranks 0,1")))
      << r.out;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("no step reported"))) << r.out;
  ASSERT_TRUE(c.client().CancelJob("job-1").ok());
  ASSERT_EQ(c.WaitDone("job-1").state(), v1::CANCELLED);

  // A short job to the end, then watched: every line within 60 columns,
  // each step line with its elapsed time and ETA.
  constexpr int64_t kSteps = 12;
  auto sub = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const v1::Job done = c.WaitDone("job-2");
  ASSERT_EQ(done.state(), v1::SUCCEEDED) << c.Logs();
  r = ctl("60", {"watch", "job-2"}, "watch-60");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_LE(Widest(r.out), 60u) << r.out;
  int step_lines = 0;
  for (const std::string& line : Lines(r.out)) {
    if (!absl::StartsWith(line, "step ")) continue;
    ++step_lines;
    EXPECT_THAT(line, AllOf(::testing::ContainsRegex("elapsed [0-9]+s"), ::testing::ContainsRegex("eta [0-9]+s")))
        << line;
  }
  EXPECT_GE(step_lines, 2) << r.out;
  EXPECT_THAT(r.out, HasSubstr("eta 0s")) << "the last step has none left: " << r.out;
  // --per-rank: every step's line, each rank's line under it (loss, time,
  // peak), and in JSON each step event with both ranks' reports.
  r = ctl("1000", {"watch", "job-2", "--per-rank"}, "watch-per-rank");
  ASSERT_EQ(r.code, 0) << r.err;
  {
    const std::vector<std::string> lines = Lines(r.out);
    int steps = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (!absl::StartsWith(lines[i], "step ")) continue;
      ++steps;
      EXPECT_THAT(lines[i], HasSubstr("  lr 0.006  ")) << "TinyJob's constant lr: " << lines[i];
      ASSERT_LT(i + 2, lines.size()) << r.out;
      EXPECT_THAT(lines[i + 1], AllOf(::testing::StartsWith("  rank   0  loss "), HasSubstr("device peak ")));
      EXPECT_THAT(lines[i + 2], ::testing::StartsWith("  rank   1  loss "));
    }
    EXPECT_EQ(steps, kSteps) << "every step, not every 20th: " << r.out;
  }
  r = ctl("", {"--output=json", "watch", "job-2", "--per-rank"}, "watch-per-rank-json");
  ASSERT_EQ(r.code, 0) << r.err;
  {
    int steps = 0;
    for (const std::string& line : Lines(r.out)) {
      const v1::JobEvent e = FromJson<v1::JobEvent>(line);
      if (!e.has_job_step()) continue;
      ++steps;
      // When the step ended, by the ranks: before the coordinator stored it.
      EXPECT_TRUE(e.job_step().has_end_time()) << line;
      EXPECT_GT(e.job_step().end_time().seconds(), 0) << line;
      EXPECT_LE(e.job_step().end_time().seconds(), e.time().seconds()) << line;
      ASSERT_EQ(e.job_step().per_rank_size(), 2) << line;
      EXPECT_EQ(e.job_step().per_rank(1).rank(), 1);
      EXPECT_EQ(e.job_step().per_rank(0).step(), e.job_step().step());
      EXPECT_EQ(e.job_step().lr(), e.job_step().per_rank(0).lr());
    }
    EXPECT_EQ(steps, kSteps);
  }
  // Without COLUMNS and without a terminal (a file, a CI log): whole lines,
  // every step's peaks (the lines are longer than 100 columns, where they
  // used to be cut).
  r = ctl("", {"watch", "job-2"}, "watch-default");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GT(Widest(r.out), 100u) << r.out;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("..."))) << r.out;
  EXPECT_THAT(r.out, HasSubstr("peak/plan MiB: ")) << r.out;
  // A narrow width cuts step lines but wraps the state changes: the final
  // state's whole reason is there, over several lines.
  r = ctl("20", {"watch", "job-2"}, "watch-narrow");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_LE(Widest(r.out), 20u) << r.out;
  EXPECT_THAT(r.out, HasSubstr("...")) << r.out;
  {
    std::string words;  // the output's words, as the wrap keeps them
    for (absl::string_view w : absl::StrSplit(r.out, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
      absl::StrAppend(&words, words.empty() ? "" : " ", w);
    }
    std::string reason;
    for (absl::string_view w : absl::StrSplit(done.state_reason(), ' ', absl::SkipEmpty())) {
      absl::StrAppend(&reason, reason.empty() ? "" : " ", w);
    }
    ASSERT_GT(reason.size(), 20u) << "the check needs a reason wider than the width: " << reason;
    EXPECT_THAT(words, HasSubstr("SUCCEEDED: " + reason)) << r.out;
  }

  // Resumed with --from at step 5's event: the summary names steps 5-12
  // and takes the first loss from the job (step 1, never seen here).
  r = ctl("", {"--output=json", "watch", "job-2"}, "watch-json");
  ASSERT_EQ(r.code, 0) << r.err;
  int64_t step5 = -1;
  for (const std::string& line : Lines(r.out)) {
    const v1::JobEvent e = FromJson<v1::JobEvent>(line);
    if (e.has_job_step() && e.job_step().step() == 5) step5 = e.index();
  }
  ASSERT_GE(step5, 0) << r.out;
  r = ctl("", {"watch", "job-2", "--from=" + std::to_string(step5)}, "watch-from");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string first_loss = absl::StrFormat("%.17g", done.progress().first_loss());
  EXPECT_THAT(r.out, AllOf(HasSubstr("summary: job-2 SUCCEEDED"), HasSubstr("loss " + first_loss + " -> "),
                           HasSubstr("(step 1 from the job)"), HasSubstr("this watch covers steps 5-12 of 12")))
      << r.out;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("step     1/"))) << r.out;

  // logs: --rank N only that rank's lines, -1 the agent's and coordinator's;
  // --tail N the last N of what exists; both together; with --follow on a
  // finished job the last N, then the end.
  r = ctl("", {"logs", "job-2"}, "logs-all");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> all = Lines(r.out);
  std::vector<std::string> rank1, agent;
  for (const std::string& l : all) {
    if (absl::StartsWith(l, "[rank 1] ")) rank1.push_back(l);
    if (absl::StartsWith(l, "[agent] ") || absl::StartsWith(l, "[coordinator] ")) agent.push_back(l);
  }
  ASSERT_GE(rank1.size(), 2u) << r.out;
  // (The agent's lines about a rank carry its rank: rank -1 may be none.)
  ASSERT_GT(all.size(), rank1.size() + 3) << "other ranks' lines, so that the filter can fail";
  // --timestamps: the same lines, each after its own time (the date too
  // on a line from another day: a run across midnight).
  r = ctl("", {"logs", "job-2", "--timestamps"}, "logs-timestamps");
  ASSERT_EQ(r.code, 0) << r.err;
  {
    const std::vector<std::string> stamped = Lines(r.out);
    ASSERT_EQ(stamped.size(), all.size()) << r.out;
    const std::regex time_first("^([0-9]{4}-[0-9]{2}-[0-9]{2} )?[0-9]{2}:[0-9]{2}:[0-9]{2} ");
    for (size_t i = 0; i < stamped.size(); ++i) {
      std::smatch m;
      ASSERT_TRUE(std::regex_search(stamped[i], m, time_first)) << stamped[i];
      EXPECT_EQ(m.suffix().str(), all[i]);
    }
  }
  r = ctl("", {"logs", "job-2", "--rank", "1"}, "logs-rank1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out), rank1);
  r = ctl("", {"logs", "job-2", "--rank=-1"}, "logs-agent");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out), agent);
  r = ctl("", {"logs", "job-2", "--tail=3"}, "logs-tail");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out), std::vector<std::string>(all.end() - 3, all.end()));
  r = ctl("", {"logs", "job-2", "--rank=1", "--tail", "2"}, "logs-rank-tail");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out), std::vector<std::string>(rank1.end() - 2, rank1.end()));
  r = ctl("", {"logs", "job-2", "--tail=2", "-f"}, "logs-tail-follow");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out), std::vector<std::string>(all.end() - 2, all.end()));
  r = ctl("", {"logs", "job-2", "--tail=-1"}, "logs-bad-tail");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("plateauctl logs: --tail: expected a number of lines from 0 to 9223372036854775807, "
                               "got '-1'"));
  r = ctl("", {"logs", "job-2", "--rank=x"}, "logs-bad-rank");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("plateauctl logs: --rank:"));
  r = ctl("", {"logs", "job-2", "--rank=99"}, "logs-absent-rank");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(
      r.err,
      HasSubstr("plateauctl logs: --rank: job-2 has ranks 0 to 1 (and -1 for the agent's and the "
                "coordinator's lines), got 99"));
  r = ctl("", {"logs", "--help"}, "logs-help");
  EXPECT_THAT(r.out, AllOf(HasSubstr("--rank=N"), HasSubstr("--tail=N")));

  // A name in a wide script: its cell is cut to 16 columns (2 per
  // character, "..." 3), never inside a character, and the columns after
  // it keep their place.
  v1::JobSpec wide = TinyJob(1000000);
  wide.set_name("\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x81\xa8\xe3\x81\xa6"
                "\xe3\x82\x82\xe9\x95\xb7\xe3\x81\x84\xe3\x82\xb8\xe3\x83\xa7\xe3\x83\x96");
  auto wide_job = c.client().SubmitJob(wide, false);
  ASSERT_TRUE(wide_job.ok()) << wide_job.status();
  ASSERT_TRUE(c.client().CancelJob(wide_job->job().id()).ok());
  ASSERT_EQ(c.WaitDone(wide_job->job().id()).state(), v1::CANCELLED);

  // list: rows cut to the width with "...", whole when it is wide enough.
  r = ctl("40", {"list"}, "list-40");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_LE(Widest(r.out), 40u) << r.out;
  EXPECT_THAT(r.out, HasSubstr("...")) << r.out;
  r = ctl("1000", {"list"}, "list-wide");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_GE(Lines(r.out).size(), 3u) << r.out;
  EXPECT_THAT(Lines(r.out)[1] + Lines(r.out)[2], ::testing::Not(HasSubstr("..."))) << r.out;
  EXPECT_THAT(r.out, HasSubstr(done.state_reason())) << r.out;
  // The labels column: job-1's label, "-" for job-2 (none).
  {
    const std::vector<std::string> rows = Lines(r.out);
    ASSERT_GE(rows.size(), 3u) << r.out;
    EXPECT_THAT(rows[0], HasSubstr(" LABELS "));
    EXPECT_THAT(rows[1], AllOf(::testing::StartsWith("job-1 "), HasSubstr(" team=nlp ")));
    EXPECT_THAT(rows[2], ::testing::ContainsRegex("^job-2 .* - +" + done.state_reason().substr(0, 8)));
    ASSERT_GE(rows.size(), 4u) << r.out;
    // "日本語のとて..." and one space: 16 columns, as the header's "NAME" and 12 spaces.
    EXPECT_THAT(rows[3], ::testing::StartsWith("job-3      CANCELLED   \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e"
                                               "\xe3\x81\xae\xe3\x81\xa8\xe3\x81\xa6...  "))
        << r.out;
    EXPECT_THAT(rows[0], ::testing::StartsWith("JOB        STATE       NAME             STEP"));
  }
}

// The validation loss end to end: a job measuring it every 3 steps (and at
// its last) carries it in those steps' events only; `get` shows the latest
// value and step, `watch` a column on exactly those steps and the latest in
// its summary, its JSON the field, and /metrics plateau_job_validation_loss.
TEST(ServiceTest, ValidationLossInEventsWatchGetJsonAndMetrics) {
  Cluster c("validation");
  ASSERT_TRUE(c.ready()) << c.Logs();
  v1::JobSpec spec = TinyJob(7);
  spec.set_validation_every(3);
  spec.mutable_data()->set_held_out_sequences(8);  // 2 batches of TinyJob's 4
  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  std::vector<int64_t> validated;
  double last = -1;
  for (const v1::JobEvent& e : c.AllEvents(id)) {
    if (!e.has_job_step() || !e.job_step().has_validation_loss()) continue;
    validated.push_back(e.job_step().step());
    last = e.job_step().validation_loss();
    EXPECT_GT(last, 0);
  }
  EXPECT_EQ(validated, (std::vector<int64_t>{3, 6, 7}));
  ASSERT_TRUE(job.has_validation_loss());
  EXPECT_EQ(job.validation_loss(), last);
  EXPECT_EQ(job.validation_step(), 7);

  const std::string ctl = "client/plateauctl", coord = "--coordinator=" + c.api();
  Ran r = RunCommand({ctl, coord, "get", id}, c.dir() + "/get");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr(absl::StrFormat("validation: loss %.4f after step 7", last))) << r.out;
  r = RunCommand({"/usr/bin/env", "COLUMNS=1000", ctl, coord, "watch", id}, c.dir() + "/watch");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<int> with_column;
  for (const std::string& line : Lines(r.out)) {
    int step = 0;
    if (std::sscanf(line.c_str(), "step %d/", &step) == 1 && absl::StrContains(line, "  val ")) {
      with_column.push_back(step);
    }
  }
  EXPECT_EQ(with_column, (std::vector<int>{3, 6, 7})) << r.out;
  EXPECT_THAT(r.out, HasSubstr(absl::StrFormat("validation loss %.17g", last))) << r.out;
  r = RunCommand({ctl, coord, "--output=json", "watch", id}, c.dir() + "/watch-json");
  ASSERT_EQ(r.code, 0) << r.err;
  int in_json = 0;
  for (const std::string& line : Lines(r.out)) {
    const v1::JobEvent e = FromJson<v1::JobEvent>(line);
    in_json += e.has_job_step() && e.job_step().has_validation_loss();
  }
  EXPECT_EQ(in_json, 3);
  const std::string m = Scrape(c.metrics());
  // The exposition prints 16 significant digits (not the 17 that read back).
  EXPECT_NEAR(Sample(m, "plateau_job_validation_loss{job_id=\"" + id + "\",rank=\"0\"}"), last, 1e-14 * last) << m;
}

// A watch across a coordinator restart says "reconnecting..." on stderr
// and goes on from the next event: no step printed twice, none missed.
TEST(ServiceTest, PlateauctlWatchSaysReconnectingAcrossACoordinatorRestart) {
  Cluster c("cli-reconnect");
  ASSERT_TRUE(c.ready()) << c.Logs();
  constexpr int64_t kSteps = 150;
  auto sub = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  // Every step printed (a non-tty watch prints every 20th of the total).
  Process watch({"/usr/bin/env", "COLUMNS=200", "client/plateauctl", "--coordinator=" + c.api(), "watch", id},
                c.dir() + "/watch");
  ASSERT_TRUE(watch.spawn_error().empty()) << watch.spawn_error();
  // The same under --output json: the notice is a JSON object on stderr.
  Process json_watch({"client/plateauctl", "--coordinator=" + c.api(), "--output=json", "watch", id},
                     c.dir() + "/watch-json");
  ASSERT_TRUE(json_watch.spawn_error().empty()) << json_watch.spawn_error();
  ASSERT_TRUE(c.WaitStep(id, 5)) << c.Logs();
  c.KillCoordinator(SIGKILL);
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  ASSERT_TRUE(WaitFor([&] { return !watch.Running(); })) << watch.err();
  EXPECT_THAT(watch.err(), HasSubstr("reconnecting...")) << watch.err();
  ASSERT_TRUE(WaitFor([&] { return !json_watch.Running(); })) << json_watch.err();
  {
    const std::vector<std::string> err_lines = Lines(json_watch.err());
    ASSERT_FALSE(err_lines.empty()) << "no reconnecting notice";
    for (const std::string& line : err_lines) {
      const google::protobuf::Struct notice = FromJson<google::protobuf::Struct>(line);  // fails if not JSON
      ASSERT_TRUE(notice.fields().count("notice")) << line;
      const auto& f = notice.fields().at("notice").struct_value().fields();
      EXPECT_EQ(f.count("kind") ? f.at("kind").string_value() : "", "reconnecting") << line;
      EXPECT_TRUE(f.count("message") && f.at("message").has_string_value()) << line;
    }
    int steps = 0;
    for (const std::string& line : Lines(json_watch.out())) steps += FromJson<v1::JobEvent>(line).has_job_step();
    EXPECT_EQ(steps, kSteps) << "every step once";
  }
  const std::string out = watch.out();
  EXPECT_THAT(out, HasSubstr("summary: " + id + " SUCCEEDED")) << out << c.Logs();
  // Steps 1, every 7th (150/20) and the last, each once, in order.
  std::vector<int> printed;
  for (const std::string& line : Lines(out)) {
    int step = 0;
    if (std::sscanf(line.c_str(), "step %d/", &step) == 1) printed.push_back(step);
  }
  std::vector<int> want;
  for (int s = 1; s <= kSteps; ++s) {
    if (s % 7 == 0 || s == 1 || s == kSteps) want.push_back(s);
  }
  EXPECT_EQ(printed, want) << out;
}

// A per-rank watch reads --watch_reports_per_read reports' worth of events
// at a time (here 3: one step of 2 ranks): a finished job's stream still
// sends every event, and each step with both ranks' reports, before it ends.
TEST(ServiceTest, APerRankWatchBoundedByItsReportsSendsEveryEvent) {
  ClusterOptions o;
  o.coordinator_flags = {"--watch_reports_per_read=3"};
  Cluster c("per-rank-bounded", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(12), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << c.Logs();
  std::vector<int64_t> indices;
  int steps = 0;
  absl::Status watched = c.client().WatchJob(
      id, 0,
      [&](const v1::JobEvent& e) {
        indices.push_back(e.index());
        if (e.has_job_step()) {
          ++steps;
          EXPECT_EQ(e.job_step().per_rank_size(), 2) << "step " << e.job_step().step();
        }
        return true;
      },
      /*per_rank=*/true);
  ASSERT_TRUE(watched.ok()) << watched;
  EXPECT_EQ(steps, 12);
  ASSERT_EQ(static_cast<int64_t>(indices.size()), job.event_count());
  for (size_t i = 0; i < indices.size(); ++i) EXPECT_EQ(indices[i], static_cast<int64_t>(i));
}

// A coordinator that stops answering without closing its connections (a
// frozen process, a host gone from the network) no longer holds a watch
// forever: the client's keepalive pings go unanswered, the stream breaks,
// the watch says it is reconnecting and gives up after reconnect_for.
TEST(ServiceTest, AWatchOfAFrozenCoordinatorBreaksAndSaysSo) {
  auto reconnecting = std::make_shared<std::atomic<int>>(0);
  ClusterOptions o;
  o.client.connection.keepalive = absl::Seconds(1);
  o.client.reconnect_for = absl::Seconds(3);
  o.client.on_reconnecting = [reconnecting](const absl::Status&) { ++*reconnecting; };
  Cluster c("frozen-coordinator", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  ASSERT_TRUE(c.WaitStep(id, 2)) << c.Logs();
  absl::Status watched;
  absl::Notification done;
  std::atomic<int> events{0};
  std::thread watch([&] {
    watched = c.client().WatchJob(id, 0, [&](const v1::JobEvent&) {
      ++events;
      return true;
    });
    done.Notify();
  });
  ASSERT_TRUE(WaitFor([&] { return events.load() > 0; }));  // the stream is open
  const pid_t coordinator = c.coordinator()->pid();
  ASSERT_EQ(kill(coordinator, SIGSTOP), 0);
  const absl::Time frozen = absl::Now();
  const bool ended = done.WaitForNotificationWithTimeout(absl::Seconds(60));
  const absl::Duration took = absl::Now() - frozen;
  ASSERT_EQ(kill(coordinator, SIGCONT), 0);
  if (!ended) c.client().CancelJob(id).IgnoreError();  // ends the watch once it answers again
  watch.join();
  ASSERT_TRUE(ended) << "the watch still waits on the frozen coordinator after 60 s";
  EXPECT_EQ(watched.code(), absl::StatusCode::kUnavailable) << watched;
  // Once, unless a ping of the busy coordinator went unanswered for 1 s
  // before the freeze too.
  EXPECT_GE(reconnecting->load(), 1) << watched;
  std::printf("the watch broke %s after the coordinator froze (keepalive 1 s, reconnect_for 3 s)\n",
              absl::FormatDuration(took).c_str());
  // The client's channel reconnects to the thawed coordinator.
  EXPECT_TRUE(WaitFor([&] { return c.client().CancelJob(id).ok(); })) << c.Logs();
}

// SIGTERM with a stream open: the stream ends UNAVAILABLE saying so (the
// client resumes after the restart) and the coordinator exits at once.
// Before, every open stream spun through its wait (which returns at once
// once stopping) until the server's 2 s grace cancelled it, and the call
// ended CANCELLED "cancelled by the client".
TEST(ServiceTest, ASigtermEndsOpenStreamsUnavailableAtOnce) {
  ClusterOptions o;
  o.with_worker = false;  // the job waits: a quiet stream
  Cluster c("sigterm-streams", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(10), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto stub = v1::JobService::NewStub(grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::WatchJobRequest q;
  q.set_job_id(sub->job().id());
  std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader = stub->WatchJob(&ctx, q);
  v1::JobEvent e;
  ASSERT_TRUE(reader->Read(&e));  // open, its first event read
  const absl::Time term = absl::Now();
  ASSERT_EQ(kill(c.coordinator()->pid(), SIGTERM), 0);
  while (reader->Read(&e)) {
  }
  const grpc::Status s = reader->Finish();
  const absl::Duration ended = absl::Now() - term;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("the coordinator is shutting down; resume from index"));
  EXPECT_LT(ended, absl::Milliseconds(1500)) << "the stream waited out the server's 2 s grace";
  ASSERT_TRUE(WaitFor([&] { return !c.coordinator()->Running(); }, absl::Seconds(30)));
  const absl::Duration exited = absl::Now() - term;
  // Nothing is in flight once the stream ended: the coordinator does not
  // wait out its 2 s grace for the connection this test keeps open (it
  // did: gRPC's Shutdown(deadline) waits for idle connections too).
  EXPECT_LT(exited, absl::Milliseconds(1500)) << "the coordinator waited out its grace";
  std::printf("SIGTERM with a stream open: the stream ended after %s, the coordinator exited after %s\n",
              absl::FormatDuration(ended).c_str(), absl::FormatDuration(exited).c_str());
}

// A KvGet long poll whose caller went away (a rank killed during its
// rendezvous) ends with it, not after its whole wait: the call's duration,
// as the coordinator's metrics record it when the handler returns, is far
// under the 8 s asked for.
TEST(ServiceTest, AKvGetWhoseCallerWentAwayEndsWithIt) {
  ClusterOptions o;
  o.with_worker = false;
  Cluster c("kvget-cancel", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto stub = v1::WorkerService::NewStub(grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::KvGetRequest q;
  q.set_key("job-1/attempt-0/never-set");
  q.set_wait_ms(8000);
  v1::KvGetResponse r;
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(300));
    ctx.TryCancel();
  });
  const grpc::Status s = stub->KvGet(&ctx, q, &r);
  cancel.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  const std::string count = "plateau_rpc_duration_seconds_count{method=\"KvGet\",service=\"plateau.v1.WorkerService\"}";
  const std::string sum = "plateau_rpc_duration_seconds_sum{method=\"KvGet\",service=\"plateau.v1.WorkerService\"}";
  std::string m;
  EXPECT_TRUE(WaitFor(
      [&] {
        m = Scrape(c.metrics());
        return Sample(m, count) == 1;
      },
      absl::Seconds(4)))
      << "the handler still waits after its caller left";
  EXPECT_LT(Sample(m, sum), 2.0) << m;
}

// The client library's watch across a SIGTERM and a restart: the stream
// ends UNAVAILABLE, the client's retry may land while the coordinator
// shuts down (the server cancels it: CANCELLED), and the watch resumes
// after the restart to the job's end (it ended "CANCELLED: CANCELLED").
TEST(ServiceTest, AWatchResumesAcrossASigtermAndARestart) {
  ClusterOptions o;
  o.with_worker = false;
  o.client.reconnect_for = absl::Seconds(30);
  Cluster c("sigterm-resume", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(10), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  absl::Status watched;
  std::vector<v1::JobState> states;
  std::atomic<int> seen{0};
  std::thread watch([&] {
    watched = c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
      ++seen;
      if (e.has_state_change()) states.push_back(e.state_change().state());
      return !(e.has_state_change() && e.state_change().state() == v1::CANCELLED);
    });
  });
  ASSERT_TRUE(WaitFor([&] { return seen.load() > 0; }));
  for (int round = 0; round < 3; ++round) {  // the retry's timing varies: several restarts
    ASSERT_EQ(kill(c.coordinator()->pid(), SIGTERM), 0);
    ASSERT_TRUE(WaitFor([&] { return !c.coordinator()->Running(); }, absl::Seconds(30)));
    ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  }
  EXPECT_TRUE(WaitFor([&] { return c.client().CancelJob(id).ok(); })) << c.Logs();
  watch.join();
  EXPECT_TRUE(watched.ok()) << watched;
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(states.back(), v1::CANCELLED);
}

// A watch on which no event comes (a job waiting for a worker) resumes
// after a coordinator restart longer than the few seconds a coordinator
// never reached gets: the coordinator says a stream is open when it opens
// it (proto/streams.h), rows or not. Before, such a watch gave up 3 s into
// the restart.
TEST(ServiceTest, AQuietWatchResumesAcrossALongRestart) {
  ClusterOptions o;
  o.with_worker = false;
  o.client.reconnect_for = absl::Seconds(30);
  Cluster c("quiet-watch", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(10), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  // The job's first waiting reason is an event; the next comes after a
  // minute at the soonest, so the watch from here is quiet.
  ASSERT_TRUE(WaitFor([&] {
    auto j = c.client().GetJob(id);
    return j.ok() && !j->state_reason().empty();
  }));
  absl::SleepFor(absl::Milliseconds(500));
  auto job = c.client().GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  const int64_t from = job->event_count();
  absl::Status watched;
  std::vector<v1::JobEvent> events;
  std::thread watch([&] {
    watched = c.client().WatchJob(id, from, [&](const v1::JobEvent& e) {
      events.push_back(e);
      return true;
    });
  });
  // The stream opened: nothing says so to the test (no row comes), but a
  // local open takes milliseconds, even on a loaded machine.
  absl::SleepFor(absl::Seconds(3));
  c.KillCoordinator(SIGKILL);
  absl::SleepFor(absl::Seconds(5));
  ASSERT_TRUE(c.RestartCoordinator()) << c.Logs();
  ASSERT_TRUE(WaitFor([&] { return c.client().CancelJob(id).ok(); })) << c.Logs();
  watch.join();
  EXPECT_TRUE(watched.ok()) << watched;
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.front().index(), from) << "an event skipped or repeated";
  EXPECT_TRUE(events.back().has_state_change() && events.back().state_change().state() == v1::CANCELLED)
      << events.back().DebugString();
}

// A quiet watch's heartbeats (--watch_heartbeat_s, here 0.2 s) reach the
// wire, and no client shows or counts one: plateauctl watch prints the
// job's events only (under --output json too, where every event is a
// line), the C++ client never hands one to its caller, and each ends with
// the job as it would without them.
TEST(ServiceTest, AQuietWatchesHeartbeatsAreSkippedByPlateauctlAndTheClient) {
  ClusterOptions o;
  o.with_worker = false;  // the job stays PENDING: its watch is quiet
  o.coordinator_flags = {"--watch_heartbeat_s=0.2"};
  Cluster c("heartbeats", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(10), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const std::string ctl = "client/plateauctl";
  Process json_watch({ctl, "--coordinator=" + c.api(), "--output=json", "watch", id}, c.dir() + "/watch-json");
  ASSERT_TRUE(json_watch.spawn_error().empty()) << json_watch.spawn_error();
  Process text_watch({"/usr/bin/env", "COLUMNS=200", ctl, "--coordinator=" + c.api(), "watch", id},
                     c.dir() + "/watch-text");
  ASSERT_TRUE(text_watch.spawn_error().empty()) << text_watch.spawn_error();
  std::vector<v1::JobEvent> seen;
  absl::Status watched;
  std::thread client_watch([&] {
    watched = c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
      seen.push_back(e);
      return true;
    });
  });
  // The heartbeats are on the wire: a raw stream gets several.
  auto stub = v1::JobService::NewStub(grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::WatchJobRequest req;
  req.set_job_id(id);
  req.set_heartbeats(true);  // as plateauctl and Client::WatchJob ask
  auto raw = stub->WatchJob(&ctx, req);
  int beats = 0;
  v1::JobEvent e;
  while (beats < 5 && raw->Read(&e)) beats += e.has_heartbeat();
  ctx.TryCancel();
  raw->Finish();
  ASSERT_EQ(beats, 5) << c.Logs();
  ASSERT_TRUE(c.client().CancelJob(id).ok());
  client_watch.join();
  ASSERT_TRUE(WaitFor([&] { return !json_watch.Running(); })) << json_watch.err();
  ASSERT_TRUE(WaitFor([&] { return !text_watch.Running(); })) << text_watch.err();

  EXPECT_TRUE(watched.ok()) << watched;
  auto job = c.client().GetJob(id);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(static_cast<int64_t>(seen.size()), job->event_count()) << "every event once, nothing else";
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].index(), static_cast<int64_t>(i));
    EXPECT_FALSE(seen[i].has_heartbeat());
  }
  const std::vector<std::string> lines = Lines(json_watch.out());
  ASSERT_EQ(static_cast<int64_t>(lines.size()), job->event_count()) << json_watch.out();
  for (size_t i = 0; i < lines.size(); ++i) {
    const v1::JobEvent printed = FromJson<v1::JobEvent>(lines[i]);
    EXPECT_FALSE(printed.has_heartbeat()) << lines[i];
    EXPECT_EQ(printed.index(), static_cast<int64_t>(i)) << lines[i];
  }
  EXPECT_THAT(lines.back(), HasSubstr("CANCELLED"));
  // Text: a line per state change and the summary, nothing for a heartbeat.
  const std::string out = text_watch.out();
  EXPECT_THAT(out, HasSubstr("summary: " + id + " CANCELLED")) << out;
  for (const std::string& line : Lines(out)) {
    EXPECT_TRUE(absl::StartsWith(line, "[") || absl::StartsWith(line, "summary: ")) << line;
  }
}

// The same for a followed log: a pending job prints nothing, so
// `plateauctl logs --follow` (which asks for heartbeats, Client::GetJobLogs)
// gets one every 0.2 s. Under --output json it prints each line it is
// handed as a LogEntry: exactly the job's lines, indices 0.. without gaps,
// and no heartbeat; the text form prints only "[...]" lines.
TEST(ServiceTest, AQuietLogFollowsHeartbeatsAreSkippedByPlateauctl) {
  ClusterOptions o;
  o.with_worker = false;  // the job stays PENDING: its log is quiet
  o.coordinator_flags = {"--watch_heartbeat_s=0.2"};
  Cluster c("log-heartbeats", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  auto sub = c.client().SubmitJob(TinyJob(10), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const std::string ctl = "client/plateauctl";
  Process json_logs({ctl, "--coordinator=" + c.api(), "--output=json", "logs", "--follow", id}, c.dir() + "/logs-json");
  ASSERT_TRUE(json_logs.spawn_error().empty()) << json_logs.spawn_error();
  Process text_logs({ctl, "--coordinator=" + c.api(), "logs", "--follow", id}, c.dir() + "/logs-text");
  ASSERT_TRUE(text_logs.spawn_error().empty()) << text_logs.spawn_error();
  // The heartbeats are on the wire: a raw follow that asks gets several.
  auto stub = v1::JobService::NewStub(grpc::CreateChannel(c.api(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::GetJobLogsRequest req;
  req.set_job_id(id);
  req.set_follow(true);
  req.set_heartbeats(true);  // as plateauctl and Client::GetJobLogs ask
  auto raw = stub->GetJobLogs(&ctx, req);
  int beats = 0;
  v1::LogEntry l;
  while (beats < 5 && raw->Read(&l)) beats += l.has_heartbeat();
  ctx.TryCancel();
  raw->Finish();
  ASSERT_EQ(beats, 5) << c.Logs();
  ASSERT_TRUE(c.client().CancelJob(id).ok());
  ASSERT_TRUE(WaitFor([&] { return !json_logs.Running(); })) << json_logs.err();
  ASSERT_TRUE(WaitFor([&] { return !text_logs.Running(); })) << text_logs.err();

  std::vector<v1::LogEntry> stored;
  ASSERT_TRUE(c.client()
                  .GetJobLogs(id, /*follow=*/false, 0,
                              [&](const v1::LogEntry& e) {
                                stored.push_back(e);
                                return true;
                              })
                  .ok());
  const std::vector<std::string> lines = Lines(json_logs.out());
  ASSERT_EQ(lines.size(), stored.size()) << json_logs.out();
  for (size_t i = 0; i < lines.size(); ++i) {
    const v1::LogEntry printed = FromJson<v1::LogEntry>(lines[i]);
    EXPECT_FALSE(printed.has_heartbeat()) << lines[i];
    EXPECT_EQ(printed.index(), static_cast<int64_t>(i)) << lines[i];
  }
  const std::vector<std::string> text = Lines(text_logs.out());
  EXPECT_EQ(text.size(), stored.size()) << text_logs.out();
  for (const std::string& line : text) EXPECT_TRUE(absl::StartsWith(line, "[")) << line;
}

}  // namespace
}  // namespace plateau
