// `auto` settings through the whole service, with real processes over
// loopback (tests/cluster.h): before any worker registers the plan says it
// used the default curve; a worker registers with its calibration and the
// plan names it; a job with all four settings `auto` runs with the chosen
// values on every rank (their logs, and the launch-sized live sets' peaks
// at the plan made with those values); `plateauctl get` shows them; and a
// worker started again on the same work dir reads its calibration from the
// cache instead of measuring.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"
#include "worker/auto_spec_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

using namespace testing_cluster;  // NOLINT: the harness is this file's vocabulary

v1::JobSpec AllAuto() {
  v1::JobSpec s = TinyJob(4);
  s.set_name("auto");
  return WithAllAuto(std::move(s));
}

int64_t Bytes(const google::protobuf::RepeatedPtrField<v1::LiveSetBytes>& sets, const std::string& name) {
  for (const v1::LiveSetBytes& ls : sets) {
    if (ls.live_set() == name) return ls.bytes();
  }
  return -1;
}

TEST(AutoSettingsServiceTest, AJobWithAutoRunsTheChosenValuesAndGetShowsThem) {
  ClusterOptions options;
  options.with_worker = false;
  Cluster c("auto", options);
  ASSERT_TRUE(c.ready()) << c.Logs();
  const v1::JobSpec spec = AllAuto();

  // No worker yet: the default curve, and the plan says so.
  auto before = c.client().PlanJob(spec);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_THAT(before->plan().calibration(), HasSubstr("the default cpu curve"));
  EXPECT_EQ(before->plan().auto_settings_size(), 4);

  // A worker registers with its measured curves; the plan uses them.
  c.StartWorker();
  v1::MemoryPlan plan;
  ASSERT_TRUE(WaitFor([&] {
    auto p = c.client().PlanJob(spec);
    if (!p.ok()) return false;
    plan = p->plan();
    return absl::StartsWith(plan.calibration(), "measured on worker-");
  })) << plan.DebugString() << c.Logs();
  EXPECT_THAT(c.worker()->out(), HasSubstr("plateau_worker: calibration measured in"));
  ASSERT_EQ(plan.auto_settings_size(), 4);
  // Measured with one rank's share of the cores (its slots' ranks run at
  // once): cores / slots threads, not every core.
  auto workers = c.client().ListWorkers();
  ASSERT_TRUE(workers.ok() && workers->workers_size() == 1) << workers.status();
  const int share = std::max(
      1, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) / workers->workers(0).slots_total());
  EXPECT_THAT(plan.calibration(), HasSubstr(absl::StrCat("a pool of ", share, " threads"))) << plan.calibration();

  auto sub = c.client().SubmitJob(spec, false);
  ASSERT_TRUE(sub.ok()) << sub.status();
  const std::string id = sub->job().id();
  const v1::Job job = c.WaitDone(id);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << c.Logs();
  // The job keeps the choice (its spec keeps `auto`: what the user wrote).
  ASSERT_EQ(job.plan().auto_settings_size(), 4);
  EXPECT_TRUE(job.spec().schedule().pipelined_llep().chunk_tokens_auto());
  EXPECT_THAT(job.plan().calibration(), HasSubstr("measured on worker-"));
  std::map<std::string, int64_t> chosen;
  for (const v1::AutoSetting& a : job.plan().auto_settings()) chosen[a.field()] = a.value();
  const std::string want = absl::StrCat(
      "settings: pipelined_llep.chunk_tokens=", chosen["schedule.pipelined_llep.chunk_tokens"],
      " ring_dtp.strip=", chosen["schedule.ring_dtp.strip"],
      " sco.host_budget_bytes=", chosen["schedule.sco.host_budget_bytes"],
      " offload_stream_adamw.bucket_params=", chosen["schedule.offload_stream_adamw.bucket_params"]);

  // Every rank ran those values...
  std::set<int> ran;
  ASSERT_TRUE(c.client().GetJobLogs(id, false, 0, [&](const v1::LogEntry& l) {
    if (l.line() == want) ran.insert(l.rank());
    return true;
  }).ok());
  EXPECT_EQ(ran, (std::set<int>{0, 1})) << want << "\n" << c.Logs();
  // ... and the live sets they size, launch-sized, peak at the plan made
  // with them: PipelinedLLEP's dispatch slots (c), Ring-DTP's strips and
  // travellers (S), OffloadStreamAdamW's staging slots (the bucket) on the
  // device, SCO's pool (beta) on the host.
  int steps = 0;
  ASSERT_TRUE(c.client().WatchJob(id, 0, [&](const v1::JobEvent& e) {
    // Every rank's report (per_rank): each rank's peaks, not only their maximum.
    for (const v1::StepTelemetry& t : e.job_step().per_rank()) {
      ++steps;
      for (const char* set : {"dispatch", "projection", "optimizer"}) {
        EXPECT_EQ(Bytes(t.peak(), set), Bytes(job.plan().live_sets(), set)) << set;
      }
      EXPECT_EQ(Bytes(t.host_peak(), "checkpoints"), Bytes(job.plan().host_live_sets(), "checkpoints"));
    }
    return true;
  }, /*per_rank=*/true).ok());
  EXPECT_EQ(steps, 8);  // 4 steps x 2 ranks

  // `plateauctl get` shows each value and why.
  Ran got = RunCommand({"client/plateauctl", "--coordinator=" + c.api(), "get", id}, c.dir() + "/get");
  ASSERT_EQ(got.code, 0) << got.out << got.err;
  EXPECT_THAT(got.out, HasSubstr("auto settings (the least modelled time"));
  for (const v1::AutoSetting& a : job.plan().auto_settings()) {
    EXPECT_THAT(got.out, HasSubstr(a.field())) << got.out;
    EXPECT_THAT(got.out, HasSubstr(a.why())) << got.out;
  }

  // The same binaries on the same backend and work dir: the cache.
  c.worker(0)->Stop();
  Process* again = c.StartWorker({"--work_dir=" + c.dir() + "/work-0"});
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(again->out(), "plateau_worker: calibration"); }))
      << c.Logs();
  EXPECT_THAT(again->out(), HasSubstr("plateau_worker: calibration read from the cache"));
}

}  // namespace
}  // namespace plateau
