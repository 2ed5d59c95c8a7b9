// What an operator sees, against real processes on loopback (coordinator
// with SQLite, worker agents, rank processes, plateauctl, a real scrape of
// /metrics): `plateauctl workers` (table and JSON), an agent restarted with
// its work dir listed once under its old id, a departed worker's series
// removed, the coordinator's own series and log after a real job, one watch
// event per step of the whole job, `plateauctl delete`, and --retention.
#include <signal.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

Ran Ctl(Cluster& c, const std::vector<std::string>& args, const std::string& name) {
  std::vector<std::string> argv = {"client/plateauctl", "--coordinator=" + c.api()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, c.dir() + "/ctl-" + name);
}

v1::ListWorkersResponse Workers(Cluster& c) {
  auto w = c.client().ListWorkers();
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *w : v1::ListWorkersResponse();
}

TEST(OpsTest, WorkersMetricsLogsDeleteAndRetention) {
  ClusterOptions o;
  o.worker_timeout_s = 2;
  o.coordinator_flags = {"--retention=4s"};
  o.worker_flags = {"--name=alpha"};
  Cluster c("ops", o);
  ASSERT_TRUE(c.ready()) << c.Logs();
  ASSERT_TRUE(WaitFor([&] { return Workers(c).workers_size() == 1; })) << c.Logs();
  const std::string w1 = Workers(c).workers(0).id();

  // --- plateauctl workers: the table and every field in JSON.
  Ran table = Ctl(c, {"workers"}, "workers");
  ASSERT_EQ(table.code, 0) << table.out << table.err;
  EXPECT_THAT(table.out, AllOf(HasSubstr("WORKER"), HasSubstr(w1), HasSubstr("alpha"), HasSubstr("127.0.0.1"),
                               HasSubstr("cpu"), HasSubstr("2/2 free"), HasSubstr("1024.00"), HasSubstr("s ago")));
  Ran json = Ctl(c, {"--output=json", "workers"}, "workers-json");
  ASSERT_EQ(json.code, 0) << json.out << json.err;
  v1::ListWorkersResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.out, &parsed).ok()) << json.out;
  ASSERT_EQ(parsed.workers_size(), 1);
  EXPECT_EQ(parsed.workers(0).name(), "alpha");
  EXPECT_EQ(parsed.workers(0).backend(), v1::BACKEND_CPU);
  EXPECT_EQ(parsed.workers(0).slots_total(), 2);
  EXPECT_EQ(parsed.workers(0).device_memory_bytes(), 1073741824);
  EXPECT_TRUE(parsed.workers(0).has_last_heartbeat());

  // --- A real job: one event per step of the whole job.
  constexpr int64_t kSteps = 20;
  auto sub = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  int step_events = 0, state_events = 0;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    step_events += e.has_job_step();
    state_events += e.has_state_change();
    return true;
  }).ok());
  EXPECT_EQ(step_events, kSteps) << "2 ranks x 20 steps: 20 step events";
  EXPECT_EQ(step_events + state_events, job.event_count());

  // --- The coordinator's own series, scraped as Prometheus does (the
  // gauges follow within a scheduler tick). The heartbeat count is waited
  // for too: the worker beats on its own clock, and a fast job can end
  // before the fifth.
  const std::string heartbeats_ok =
      "plateau_rpcs_total{code=\"OK\",method=\"Heartbeat\",service=\"plateau.v1.WorkerService\"}";
  std::string m;
  EXPECT_TRUE(WaitFor([&] {
    m = Scrape(c.metrics());
    return Sample(m, "plateau_jobs{state=\"SUCCEEDED\"}") == 1 && Sample(m, "plateau_slots_free") == 2 &&
           Sample(m, heartbeats_ok) >= 5;
  })) << m;
  EXPECT_EQ(Sample(m, "plateau_workers{state=\"attached\"}"), 1) << m;
  EXPECT_EQ(Sample(m, "plateau_workers{state=\"awaiting_reattach\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_slots_total"), 2);
  EXPECT_EQ(Sample(m, "plateau_slots_free"), 2);
  EXPECT_EQ(Sample(m, "plateau_queue_length"), 0);
  EXPECT_EQ(Sample(m, "plateau_jobs{state=\"SUCCEEDED\"}"), 1);
  EXPECT_EQ(Sample(m, "plateau_jobs{state=\"RUNNING\"}"), 0);
  EXPECT_EQ(Sample(m, "plateau_job_submissions_total"), 1);
  EXPECT_EQ(Sample(m, "plateau_job_cancels_total"), 0);
  EXPECT_EQ(Sample(m, "plateau_store_errors_total"), 0);
  EXPECT_EQ(Sample(m, "plateau_rpcs_total{code=\"OK\",method=\"SubmitJob\",service=\"plateau.v1.JobService\"}"), 1);
  EXPECT_GE(Sample(m, heartbeats_ok), 5);
  EXPECT_GE(Sample(m, "plateau_rpcs_total{code=\"OK\",method=\"ReportTelemetry\",service=\"plateau.v1.WorkerService\"}"),
            1);
  EXPECT_EQ(Sample(m, "plateau_rpc_duration_seconds_count{method=\"SubmitJob\",service=\"plateau.v1.JobService\"}"),
            1);
  EXPECT_GT(Sample(m, "plateau_rpc_duration_seconds_sum{method=\"SubmitJob\",service=\"plateau.v1.JobService\"}"),
            0);
  EXPECT_EQ(Sample(m, "plateau_job_planned_bytes{job_id=\"" + id + "\",live_set=\"total\",rank=\"0\"}"),
            static_cast<double>(job.plan().total_bytes()));
  // A refused call is counted with its code.
  EXPECT_FALSE(c.client().GetJob("job-999").ok());
  EXPECT_EQ(Sample(Scrape(c.metrics()),
                   "plateau_rpcs_total{code=\"NOT_FOUND\",method=\"GetJob\",service=\"plateau.v1.JobService\"}"),
            1);

  // --- Its log: what happened, one line per event, with the ids.
  const std::string log = c.coordinator()->out();
  EXPECT_THAT(log, AllOf(HasSubstr(w1 + " registered: name 'alpha', cpu, 2 slot(s)"),
                         HasSubstr(id + " submitted by 127.0.0.1: 2 rank(s), 20 step(s)"),
                         HasSubstr(id + " PENDING -> SCHEDULED (attempt 0): placed on " + w1),
                         HasSubstr(id + " SCHEDULED -> RUNNING"), HasSubstr(id + " RUNNING -> SUCCEEDED")))
      << log;

  // --- delete: refused for a live job, then the job and its series are gone.
  auto live = c.client().SubmitJob(TinyJob(1000000), false);
  ASSERT_TRUE(live.ok()) << live.status();
  const std::string live_id = live->job().id();
  ASSERT_TRUE(c.WaitStep(live_id, 1)) << c.Logs();
  EXPECT_TRUE(WaitFor([&] { return Sample(Scrape(c.metrics()), "plateau_slots_free") == 0; }));
  Ran refused = Ctl(c, {"delete", live_id}, "delete-live");
  EXPECT_EQ(refused.code, 2) << refused.out << refused.err;
  EXPECT_THAT(refused.err, AllOf(HasSubstr("FAILED_PRECONDITION"), HasSubstr(live_id + " is RUNNING"),
                                 HasSubstr("cancel it first")));
  ASSERT_TRUE(c.client().CancelJob(live_id).ok());
  ASSERT_EQ(c.WaitDone(live_id).state(), v1::CANCELLED);
  EXPECT_THAT(Scrape(c.metrics()), HasSubstr("job_id=\"" + live_id + "\""));
  Ran deleted = Ctl(c, {"delete", live_id}, "delete");
  EXPECT_EQ(deleted.code, 0) << deleted.out << deleted.err;
  EXPECT_THAT(deleted.out, HasSubstr(live_id + " deleted"));
  // The coordinator's log says who: the caller's host (no client certificate here).
  EXPECT_THAT(c.coordinator()->out(), HasSubstr(live_id + " deleted by 127.0.0.1 (CANCELLED, "));
  EXPECT_EQ(c.client().GetJob(live_id).status().code(), absl::StatusCode::kNotFound);
  std::string after_delete;
  EXPECT_TRUE(WaitFor([&] {
    after_delete = Scrape(c.metrics());
    return Sample(after_delete, "plateau_jobs{state=\"CANCELLED\"}") == 0;
  })) << after_delete;
  EXPECT_THAT(after_delete, Not(HasSubstr("job_id=\"" + live_id + "\"")));
  EXPECT_EQ(Sample(after_delete, "plateau_job_cancels_total"), 1);

  // --- retention (4 s here): the first job's events and logs go, the job stays.
  ASSERT_TRUE(WaitFor([&] {
    auto j = c.client().GetJob(id);
    return j.ok() && j->has_events_deleted_time();
  })) << c.Logs();
  // A stream of them is refused, naming why (it ended OK with nothing: a
  // client read that as a job that said nothing, without its final state).
  int left = 0;
  const absl::Status watched = c.client().WatchJob(id, 0, [&](const v1::JobEvent&) { return ++left > 0; });
  EXPECT_EQ(watched.code(), absl::StatusCode::kFailedPrecondition) << watched;
  EXPECT_THAT(watched.message(), AllOf(HasSubstr(id + "'s events from index 0 were removed (the coordinator's "
                                                      "retention"),
                                       HasSubstr("it is SUCCEEDED")));
  EXPECT_EQ(left, 0);
  const absl::Status logged = c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry&) { return ++left > 0; });
  EXPECT_EQ(logged.code(), absl::StatusCode::kFailedPrecondition) << logged;
  EXPECT_EQ(left, 0);
  // A client that had every event before the sweep ends as it would have.
  EXPECT_TRUE(c.client().WatchJob(id, job.event_count(), [&](const v1::JobEvent&) { return ++left > 0; }).ok());
  EXPECT_EQ(left, 0);
  Ran got = Ctl(c, {"get", id}, "get-swept");
  EXPECT_EQ(got.code, 0) << got.err;
  EXPECT_THAT(got.out, HasSubstr("SUCCEEDED"));
  // ...and says when its events went, and how many there were.
  EXPECT_THAT(got.out, HasSubstr("  events:   " + std::to_string(job.event_count()) + " deleted at ")) << got.out;
  // `logs` and `watch` print nothing of it, and say why on stderr.
  for (const char* command : {"logs", "watch"}) {
    Ran r = Ctl(c, {command, id}, absl::StrCat(command, "-swept"));
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_THAT(
        r.err, AllOf(HasSubstr(id + "'s " + (command == std::string("logs") ? "logs" : "events") + " were removed at "),
                     HasSubstr("--retention")))
        << command;
  }
  EXPECT_THAT(c.coordinator()->out(), HasSubstr(id + ": removed its " + std::to_string(job.event_count()) + " event(s)"));

  // --- A departed worker: listed no more, its heartbeat series gone.
  Process* beta = c.StartWorker({"--name=beta"});
  ASSERT_TRUE(WaitFor([&] { return Workers(c).workers_size() == 2; })) << c.Logs();
  std::string w2;
  const v1::ListWorkersResponse two = Workers(c);
  for (const v1::WorkerInfo& w : two.workers()) {
    if (w.name() == "beta") w2 = w.id();
  }
  ASSERT_FALSE(w2.empty());
  const std::string beat2 = "plateau_worker_last_heartbeat_timestamp_seconds{worker=\"" + w2 + "\"}";
  EXPECT_FALSE(std::isnan(Sample(Scrape(c.metrics()), beat2)));
  beta->Stop(SIGKILL);
  ASSERT_TRUE(WaitFor([&] { return Workers(c).workers_size() == 1; })) << c.Logs();
  EXPECT_TRUE(std::isnan(Sample(Scrape(c.metrics()), beat2))) << "a lost worker's heartbeat series stays";
  EXPECT_THAT(c.coordinator()->out(), HasSubstr(w2 + " lost: sent no heartbeat for"));

  // --- An agent restarted on its work dir: the same worker, listed once.
  c.worker()->Stop(SIGTERM);
  Process* again = c.StartWorker({"--work_dir=" + c.dir() + "/work-0", "--name=alpha"});
  ASSERT_NE(again, nullptr);
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(again->out(), "registered again as " + w1); }))
      << again->out() << again->err() << c.Logs();
  absl::SleepFor(absl::Seconds(3));  // past the worker timeout: nothing stale is left
  const v1::ListWorkersResponse now = Workers(c);
  ASSERT_EQ(now.workers_size(), 1) << now.DebugString();
  EXPECT_EQ(now.workers(0).id(), w1);
  EXPECT_EQ(now.workers(0).state(), "attached");
  std::string last;
  EXPECT_TRUE(WaitFor([&] {
    last = Scrape(c.metrics());
    return Sample(last, "plateau_workers{state=\"attached\"}") == 1;
  })) << last;
  EXPECT_FALSE(std::isnan(Sample(last, "plateau_worker_last_heartbeat_timestamp_seconds{worker=\"" + w1 + "\"}")));
  EXPECT_THAT(last, Not(HasSubstr("worker=\"" + w2 + "\"")));
}

}  // namespace
}  // namespace plateau
