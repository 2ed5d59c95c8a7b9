// Many watchers on one job, against real processes (coordinator, worker
// agent, rank processes): 50 concurrent WatchJob streams from index 0, each
// on its own connection, one of them slow (it stops reading after its first
// event until the others are done) with a small HTTP/2 window so that the
// coordinator's writes to it back up. Every fast watcher must receive the
// job's whole event list while the slow one is still behind, the job
// must take about as long as without watchers, and the slow one must
// eventually receive every event too.
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "plateau/v1/job.grpc.pb.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

constexpr int kWatchers = 50;
constexpr int64_t kSteps = 100;  // one event per step of the whole job: ~105 events

// CPU seconds (user + system) the process has used, from /proc.
double CpuSeconds(pid_t pid) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ');
  double utime = 0, stime = 0;  // fields 14 and 15 of stat(5); f[0] is field 3
  if (f.size() < 13 || !absl::SimpleAtod(f[11], &utime) || !absl::SimpleAtod(f[12], &stime)) return 0;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

absl::Duration Ran(const v1::Job& j) {
  return absl::Seconds(j.end_time().seconds() - j.create_time().seconds()) +
         absl::Nanoseconds(j.end_time().nanos() - j.create_time().nanos());
}

// A stub on a connection of its own (gRPC would otherwise share one
// subchannel between channels to the same address).
std::unique_ptr<v1::JobService::Stub> OwnConnection(const std::string& address, bool small_window) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (small_window) {
    // A 1 KiB stream window without BDP growth: the server can have only a
    // few events in flight before its Write blocks on this reader.
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  return v1::JobService::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
}

struct Watched {
  std::vector<std::string> events;  // serialized, in arrival order
  grpc::Status status;
  absl::Time done;
};

TEST(WatchersTest, FiftyWatchersGetEveryEventAndASlowOneStallsNobody) {
  Cluster c("watchers");
  ASSERT_TRUE(c.ready()) << c.Logs();

  // The same job without watchers, for the time and the coordinator's CPU.
  double cpu0 = CpuSeconds(c.coordinator()->pid());
  auto base = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(base.ok()) << base.status();
  const v1::Job base_job = c.WaitDone(base->job().id());
  ASSERT_EQ(base_job.state(), v1::SUCCEEDED) << base_job.DebugString() << c.Logs();
  const double base_cpu = CpuSeconds(c.coordinator()->pid()) - cpu0;

  cpu0 = CpuSeconds(c.coordinator()->pid());
  auto sub = c.client().SubmitJob(TinyJob(kSteps), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();

  std::vector<Watched> got(kWatchers);
  std::atomic<int> fast_done{0};
  std::atomic<int64_t> slow_received{0};
  int64_t slow_when_fast_done = -1;  // written once by the last fast watcher
  absl::Mutex mu;
  auto watch = [&](int w) {
    const bool slow = w == 0;
    auto stub = OwnConnection(c.api(), slow);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(240));
    // Fifty channels connect at once: on a loaded machine one TCP connect may
    // fail and be retried by the channel. The test is about the events, so a
    // watcher waits for its channel instead of failing on the first attempt.
    ctx.set_wait_for_ready(true);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    req.set_from_index(0);
    auto reader = stub->WatchJob(&ctx, req);
    v1::JobEvent e;
    while (reader->Read(&e)) {
      got[w].events.push_back(e.SerializeAsString());
      if (slow) {
        slow_received = static_cast<int64_t>(got[w].events.size());
        // Stalled after its first event until every fast watcher has had
        // all of them (or 200 s, should they stall), however long the job
        // takes: its stream's window fills and the coordinator must go on
        // writing to the others. (A fixed pause per event left it behind
        // only while the job took under ~20 s.)
        if (got[w].events.size() == 1) {
          const absl::Time give_up = absl::Now() + absl::Seconds(200);
          while (fast_done.load() < kWatchers - 1 && absl::Now() < give_up)
            absl::SleepFor(absl::Milliseconds(10));
        }
      }
    }
    got[w].status = reader->Finish();
    got[w].done = absl::Now();
    if (!slow && ++fast_done == kWatchers - 1) {
      absl::MutexLock l(&mu);
      slow_when_fast_done = slow_received.load();
    }
  };
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int w = 0; w < kWatchers; ++w) threads.emplace_back(watch, w);
  const v1::Job job = c.WaitDone(id);
  const absl::Time job_done = absl::Now();
  for (std::thread& t : threads) t.join();
  const double watched_cpu = CpuSeconds(c.coordinator()->pid()) - cpu0;
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();

  // The job's whole event list, read once more after the end.
  std::vector<std::string> want;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    EXPECT_EQ(e.index(), static_cast<int64_t>(want.size()));
    want.push_back(e.SerializeAsString());
    return true;
  }).ok());
  ASSERT_EQ(static_cast<int64_t>(want.size()), job.event_count());
  int64_t step_events = 0;
  for (const std::string& bytes : want) {
    v1::JobEvent e;
    ASSERT_TRUE(e.ParseFromString(bytes));
    step_events += e.has_job_step();
  }
  ASSERT_EQ(step_events, kSteps) << "one event per step of the whole job";

  absl::Time last_fast = start;
  for (int w = 1; w < kWatchers; ++w) {
    EXPECT_TRUE(got[w].status.ok()) << "watcher " << w << ": " << got[w].status.error_message();
    EXPECT_EQ(got[w].events.size(), want.size()) << "watcher " << w;
    EXPECT_TRUE(got[w].events == want) << "watcher " << w << " received other bytes or another order";
    last_fast = std::max(last_fast, got[w].done);
  }
  // The fast ones finished with the job, while the slow one was far behind.
  EXPECT_LT(last_fast - job_done, absl::Seconds(10)) << "the fast watchers trailed the job";
  EXPECT_LT(last_fast, got[0].done);
  {
    absl::MutexLock l(&mu);
    // It held its first event only: the fast ones finished without it.
    EXPECT_EQ(slow_when_fast_done, 1)
        << "the fast watchers waited for the slow one, or were not all done in 200 s";
  }
  // ...and got every event in the end.
  EXPECT_TRUE(got[0].status.ok()) << got[0].status.error_message();
  EXPECT_EQ(got[0].events.size(), want.size());
  EXPECT_TRUE(got[0].events == want) << "the slow watcher received other bytes or another order";

  // The job is not held back by its watchers.
  std::printf("job without watchers %s (coordinator CPU %.2f s); with %d watchers %s (coordinator CPU %.2f s); "
              "%zu events; fast watchers done %s after the job, the slow one had %lld then\n",
              absl::FormatDuration(Ran(base_job)).c_str(), base_cpu, kWatchers,
              absl::FormatDuration(Ran(job)).c_str(), watched_cpu, want.size(),
              absl::FormatDuration(last_fast - job_done).c_str(), static_cast<long long>(slow_when_fast_done));
  EXPECT_LT(Ran(job), 3 * Ran(base_job) + absl::Seconds(10));
  // Nor is the coordinator: measured here (with one event per rank and
  // step), each stream wakes ~40 times (the agent's telemetry batches, every
  // 200 ms) and reads SQLite each time, ~12% of the reads finding nothing
  // new; the extra coordinator CPU was 0.6-1.0 s for 50 x 204 delivered
  // events, mostly serializing and writing them. 0.25 ms per delivered event
  // leaves room for a loaded machine and fails when the watchers poll
  // instead of waiting for a change (~4 s).
  const double delivered = static_cast<double>(kWatchers) * static_cast<double>(want.size());
  EXPECT_LT(watched_cpu - base_cpu, 0.25e-3 * delivered)
      << "the coordinator spends too much CPU per delivered event";
}

// The count the watch scales by: 2 ranks x 200 steps are 200 step events
// (and the state changes), not 400; each rank's report is there on request
// (per_rank) under the same indices, and a watch resumed from an index gets
// exactly the rest.
TEST(WatchersTest, TwoRanksTimesTwoHundredStepsAreTwoHundredStepEvents) {
  Cluster c("watch_count");
  ASSERT_TRUE(c.ready()) << c.Logs();
  // Registered first, so that PENDING is not repeated with a new reason.
  ASSERT_TRUE(WaitFor([&] {
    auto w = c.client().ListWorkers();
    return w.ok() && w->workers_size() == 1;
  })) << c.Logs();
  constexpr int64_t kLong = 200;
  auto sub = c.client().SubmitJob(TinyJob(kLong), false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  std::vector<v1::JobEvent> events;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  }).ok()) << c.Logs();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  int64_t steps = 0, states = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].index(), static_cast<int64_t>(i));
    if (events[i].has_job_step()) {
      ++steps;
      EXPECT_EQ(events[i].job_step().step(), steps) << "in step order, none repeated";
      EXPECT_EQ(events[i].job_step().ranks_reported(), 2);
      EXPECT_EQ(events[i].job_step().per_rank_size(), 0) << "per-rank detail only on request";
    }
    states += events[i].has_state_change();
  }
  EXPECT_EQ(steps, kLong);
  EXPECT_EQ(states, 4);  // PENDING, SCHEDULED, RUNNING, SUCCEEDED
  EXPECT_EQ(static_cast<int64_t>(events.size()), kLong + 4);
  EXPECT_EQ(job.event_count(), kLong + 4);
  std::printf("2 ranks x %lld steps: %zu events (%lld steps, %lld state changes)\n", static_cast<long long>(kLong),
              events.size(), static_cast<long long>(steps), static_cast<long long>(states));

  // Per rank on request: the same events, each step with both ranks' reports.
  int64_t reports = 0;
  size_t seen = 0;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    EXPECT_EQ(e.index(), static_cast<int64_t>(seen));
    ++seen;
    for (int r = 0; r < e.job_step().per_rank_size(); ++r) {
      EXPECT_EQ(e.job_step().per_rank(r).rank(), r);
      EXPECT_EQ(e.job_step().per_rank(r).step(), e.job_step().step());
      ++reports;
    }
    return true;
  }, /*per_rank=*/true).ok());
  EXPECT_EQ(seen, events.size());
  EXPECT_EQ(reports, 2 * kLong);

  // Resumed from the middle: exactly the rest.
  std::vector<v1::JobEvent> rest;
  ASSERT_TRUE(c.client().WatchJob(id, 100, [&](const v1::JobEvent& e) {
    rest.push_back(e);
    return true;
  }).ok());
  ASSERT_EQ(rest.size(), events.size() - 100);
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_EQ(rest[i].SerializeAsString(), events[100 + i].SerializeAsString());
  }
}

}  // namespace
}  // namespace plateau
