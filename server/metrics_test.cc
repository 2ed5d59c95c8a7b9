#include "server/metrics.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster.h"

namespace plateau {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using testing_cluster::HttpGet;
using testing_cluster::HttpStatus;
using testing_cluster::Sample;

TEST(MetricsTest, ServesMetricsAndProbesOnOnePort) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  (*m)->OnJobState("job-7", v1::RUNNING);
  const std::string scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(HttpStatus(scrape), 200);
  EXPECT_THAT(scrape, HasSubstr("plateau_job_state{job_id=\"job-7\",state=\"RUNNING\"} 1"));
  EXPECT_EQ(scrape.substr(scrape.find("\r\n\r\n") + 4), (*m)->Text());
  EXPECT_EQ(HttpStatus(HttpGet(address, "/healthz")), 200);
  EXPECT_EQ(HttpStatus(HttpGet(address, "/")), 404);
}

TEST(MetricsTest, ReadyzFollowsSetReadinessInOneLine) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  std::string r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 503) << "not ready before anyone said so";
  EXPECT_THAT(r, EndsWith("\r\n\r\nnot ready: starting\n"));
  (*m)->SetReadiness(absl::UnavailableError("store\nbroken"));
  r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 503);
  EXPECT_THAT(r, EndsWith("\r\n\r\nnot ready: store broken\n"));
  EXPECT_EQ(HttpStatus(HttpGet(address, "/healthz")), 200) << "liveness does not follow readiness";
  (*m)->SetReadiness(absl::OkStatus());
  r = HttpGet(address, "/readyz");
  EXPECT_EQ(HttpStatus(r), 200);
  EXPECT_THAT(r, EndsWith("\r\n\r\nready\n"));
}

v1::StepTelemetry Step(int rank, int64_t step, int64_t device_checkpoints, int64_t host_checkpoints) {
  v1::StepTelemetry t;
  t.set_rank(rank);
  t.set_step(step);
  t.set_tokens(128);
  t.set_seconds(0.5);
  v1::LiveSetBytes* d = t.add_peak();
  d->set_live_set("checkpoints");
  d->set_bytes(device_checkpoints);
  t.set_peak_total_bytes(device_checkpoints + 100);
  v1::LiveSetBytes* h = t.add_host_peak();
  h->set_live_set("checkpoints");
  h->set_bytes(host_checkpoints);
  v1::LiveSetBytes* o = t.add_host_peak();
  o->set_live_set("optimizer");
  o->set_bytes(0);
  t.set_host_peak_total_bytes(host_checkpoints);
  return t;
}

// Host peaks are a gauge of their own, plateau_job_host_peak_bytes, with the
// device gauge's labels; the device gauge keeps its labels and its values.
// Like the device one it holds the largest peak so far, and ForgetJob
// removes it. Checked in a real scrape over HTTP.
TEST(MetricsTest, HostPeaksAreTheirOwnGaugeBesideTheDevicesInAScrape) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  (*m)->OnStep("job-7", 2, Step(1, 1, 1000, 4096));
  (*m)->OnStep("job-7", 2, Step(1, 2, 900, 2048));  // lower peaks: the gauges keep the largest
  std::string scrape = HttpGet(address, "/metrics");
  ASSERT_EQ(HttpStatus(scrape), 200);
  EXPECT_EQ(Sample(scrape, "plateau_job_host_peak_bytes{job_id=\"job-7\",live_set=\"checkpoints\",rank=\"1\"}"), 4096);
  EXPECT_EQ(Sample(scrape, "plateau_job_host_peak_bytes{job_id=\"job-7\",live_set=\"optimizer\",rank=\"1\"}"), 0);
  EXPECT_EQ(Sample(scrape, "plateau_job_host_peak_bytes{job_id=\"job-7\",live_set=\"total\",rank=\"1\"}"), 4096);
  EXPECT_EQ(Sample(scrape, "plateau_job_peak_bytes{job_id=\"job-7\",live_set=\"checkpoints\",rank=\"1\"}"), 1000);
  EXPECT_EQ(Sample(scrape, "plateau_job_peak_bytes{job_id=\"job-7\",live_set=\"total\",rank=\"1\"}"), 1100);
  EXPECT_THAT(scrape, HasSubstr("# TYPE plateau_job_host_peak_bytes gauge"));
  // No series of the device gauge gained a label.
  int device_series = 0;
  for (const std::string& line : std::vector<std::string>(absl::StrSplit(scrape, '\n'))) {
    if (!absl::StartsWith(line, "plateau_job_peak_bytes{")) continue;
    ++device_series;
    EXPECT_THAT(line, ::testing::MatchesRegex(R"(plateau_job_peak_bytes\{job_id="[^"]*",live_set="[^"]*",rank="[^"]*"\} .*)"));
  }
  EXPECT_EQ(device_series, 2);  // checkpoints and total
  (*m)->ForgetJob("job-7");
  scrape = HttpGet(address, "/metrics");
  EXPECT_THAT(scrape, ::testing::Not(HasSubstr("plateau_job_host_peak_bytes{")));
  // Its peaks went with it: the same id seen again starts afresh.
  (*m)->OnStep("job-7", 2, Step(1, 1, 10, 20));
  scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(Sample(scrape, "plateau_job_host_peak_bytes{job_id=\"job-7\",live_set=\"total\",rank=\"1\"}"), 20);
}

// A rank's MFU is its own, against the peak of its step's precision; a rank
// that knows no such peak (a bf16 step on a card the table does not list,
// with only the fp32 flag set) reports 0 and the job has no MFU series,
// never one against a peak of another precision.
TEST(MetricsTest, TheMfuGaugeIsTheRanksOwnAndAbsentWithoutItsPeak) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  v1::StepTelemetry unknown = Step(0, 1, 10, 20);
  unknown.set_model_flops(4e12);  // 8e12 FLOP/s over the rank's 0.5 s
  (*m)->OnStep("job-5", 1, unknown);
  std::string scrape = HttpGet(address, "/metrics");
  ASSERT_EQ(HttpStatus(scrape), 200);
  EXPECT_THAT(scrape, ::testing::Not(HasSubstr("plateau_job_mfu_ratio{job_id=\"job-5\"")));
  v1::StepTelemetry known = Step(0, 2, 10, 20);
  known.set_model_flops(4e12);
  known.set_mfu(0.41);
  (*m)->OnStep("job-5", 1, known);
  scrape = HttpGet(address, "/metrics");
  EXPECT_DOUBLE_EQ(Sample(scrape, "plateau_job_mfu_ratio{job_id=\"job-5\",rank=\"0\"}"), 0.41);
}

// Each rank's model TFLOP/s of its latest step (StepTelemetry.tflops: per
// step time, as the MFU) is a gauge of its own, plateau_job_tflops, with the
// per-rank labels; a rank that reports none has no series, and ForgetJob
// removes it.
TEST(MetricsTest, EachRanksStepTflopsIsAGaugeRemovedWithTheJob) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  v1::StepTelemetry t = Step(0, 1, 10, 20);
  (*m)->OnStep("job-4", 2, t);  // tflops 0: not reported
  EXPECT_THAT((*m)->Text(), ::testing::Not(HasSubstr("plateau_job_tflops{")));
  t.set_tflops(312.5);
  (*m)->OnStep("job-4", 2, t);
  t.set_rank(1);
  t.set_tflops(298);
  (*m)->OnStep("job-4", 2, t);
  std::string text = (*m)->Text();
  EXPECT_THAT(text, HasSubstr("# TYPE plateau_job_tflops gauge"));
  EXPECT_EQ(Sample(text, "plateau_job_tflops{job_id=\"job-4\",rank=\"0\"}"), 312.5);
  EXPECT_EQ(Sample(text, "plateau_job_tflops{job_id=\"job-4\",rank=\"1\"}"), 298);
  (*m)->ForgetJob("job-4");
  EXPECT_THAT((*m)->Text(), ::testing::Not(HasSubstr("plateau_job_tflops{")));
}

// A job placed again (a restart, whose `auto` settings may plan smaller)
// starts its peaks again: the earlier attempt's peak is not held against
// the new plan, which read as a live set above its plan (the
// PlateauLiveSetAbovePlan alert, the dashboard's red cell).
TEST(MetricsTest, ANewPlanStartsTheJobsPeaksAgain) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*m)->port());
  v1::MemoryPlan plan;
  v1::LiveSetBytes* ls = plan.add_live_sets();
  ls->set_live_set("checkpoints");
  ls->set_bytes(1000);
  plan.set_total_bytes(1100);
  (*m)->OnPlan("job-3", 2, plan);
  (*m)->OnStep("job-3", 2, Step(1, 1, 1000, 4096));
  const std::string peak = "plateau_job_peak_bytes{job_id=\"job-3\",live_set=\"checkpoints\",rank=\"1\"}";
  const std::string host = "plateau_job_host_peak_bytes{job_id=\"job-3\",live_set=\"total\",rank=\"1\"}";
  std::string scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(Sample(scrape, peak), 1000);
  EXPECT_EQ(Sample(scrape, host), 4096);
  ls->set_bytes(600);
  plan.set_total_bytes(700);
  (*m)->OnPlan("job-3", 2, plan);
  scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(Sample(scrape, peak), 0);
  EXPECT_EQ(Sample(scrape, host), 0);
  EXPECT_EQ(Sample(scrape, "plateau_job_planned_bytes{job_id=\"job-3\",live_set=\"checkpoints\",rank=\"1\"}"), 600);
  (*m)->OnStep("job-3", 2, Step(1, 1, 500, 30));
  scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(Sample(scrape, peak), 500);
  EXPECT_EQ(Sample(scrape, host), 30);
  // Another job's peaks are not touched.
  (*m)->OnStep("job-30", 1, Step(0, 1, 9, 9));
  (*m)->OnPlan("job-3", 2, plan);
  scrape = HttpGet(address, "/metrics");
  EXPECT_EQ(Sample(scrape, "plateau_job_peak_bytes{job_id=\"job-30\",live_set=\"checkpoints\",rank=\"0\"}"), 9);
}

// A long-context step (1M tokens: ~70-140 s on an H200; longer on smaller
// cards) lands in a finite bucket of its own: with 120 s as the largest,
// histogram_quantile read every slower step as a flat 120 s.
TEST(MetricsTest, TheStepTimeHistogramResolvesStepsUpToAnHour) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  v1::StepTelemetry t = Step(0, 1, 10, 20);
  t.set_seconds(200);
  (*m)->OnStep("job-9", 1, t);
  t.set_step(2);
  t.set_seconds(2400);
  (*m)->OnStep("job-9", 1, t);
  const std::string text = (*m)->Text();
  auto bucket = [&](const std::string& le) {
    return Sample(text, "plateau_job_step_duration_seconds_bucket{job_id=\"job-9\",rank=\"0\",le=\"" + le + "\"}");
  };
  EXPECT_EQ(bucket("120"), 0) << text;
  EXPECT_EQ(bucket("300"), 1) << text;
  EXPECT_EQ(bucket("600"), 1) << text;
  EXPECT_EQ(bucket("1800"), 1) << text;
  EXPECT_EQ(bucket("3600"), 2) << text;
  EXPECT_EQ(bucket("+Inf"), 2) << text;
}

// Beside the device plan: the host plan per live set
// (plateau_job_host_planned_bytes, as plateau_job_host_peak_bytes is beside
// plateau_job_peak_bytes), the plan's caps where it has them, and the
// device's own view from each rank's step. Same labels as the other
// per-rank (and per-live-set) series, and ForgetJob removes them all.
TEST(MetricsTest, TheHostPlanTheCapsAndTheDevicesOwnViewLeaveWithTheJob) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  v1::MemoryPlan plan;
  v1::LiveSetBytes* d = plan.add_live_sets();
  d->set_live_set("checkpoints");
  d->set_bytes(1000);
  plan.set_total_bytes(1100);
  v1::LiveSetBytes* h = plan.add_host_live_sets();
  h->set_live_set("checkpoints");
  h->set_bytes(4096);
  h = plan.add_host_live_sets();
  h->set_live_set("optimizer");
  h->set_bytes(0);
  plan.set_host_total_bytes(4096);
  plan.set_device_memory_bytes(8000);  // no host cap
  (*m)->OnPlan("job-2", 2, plan);
  v1::StepTelemetry t = Step(1, 1, 1000, 4096);
  t.set_device_used_bytes(5000);
  t.set_device_pool_reserved_bytes(3000);
  (*m)->OnStep("job-2", 2, t);
  std::string text = (*m)->Text();
  for (const std::string rank : {"0", "1"}) {
    const std::string ranked = absl::StrCat("{job_id=\"job-2\",rank=\"", rank, "\"}");
    auto set = [&](const std::string& name, const std::string& live_set) {
      return Sample(text, absl::StrCat(name, "{job_id=\"job-2\",live_set=\"", live_set, "\",rank=\"", rank, "\"}"));
    };
    EXPECT_EQ(set("plateau_job_host_planned_bytes", "checkpoints"), 4096) << text;
    EXPECT_EQ(set("plateau_job_host_planned_bytes", "optimizer"), 0) << text;
    EXPECT_EQ(set("plateau_job_host_planned_bytes", "total"), 4096) << text;
    EXPECT_EQ(set("plateau_job_planned_bytes", "checkpoints"), 1000) << text;
    EXPECT_EQ(Sample(text, "plateau_job_device_cap_bytes" + ranked), 8000) << text;
  }
  EXPECT_THAT(text, ::testing::Not(HasSubstr("plateau_job_host_cap_bytes{"))) << "a cap of 0 is none";
  EXPECT_EQ(Sample(text, "plateau_job_device_used_bytes{job_id=\"job-2\",rank=\"1\"}"), 5000) << text;
  EXPECT_EQ(Sample(text, "plateau_job_device_pool_reserved_bytes{job_id=\"job-2\",rank=\"1\"}"), 3000) << text;
  // A new plan without the device cap and with a host cap: the old cap's
  // series goes.
  plan.set_device_memory_bytes(0);
  plan.set_host_memory_bytes(9000);
  (*m)->OnPlan("job-2", 2, plan);
  text = (*m)->Text();
  EXPECT_THAT(text, ::testing::Not(HasSubstr("plateau_job_device_cap_bytes{")));
  EXPECT_EQ(Sample(text, "plateau_job_host_cap_bytes{job_id=\"job-2\",rank=\"0\"}"), 9000) << text;
  (*m)->ForgetJob("job-2");
  text = (*m)->Text();
  EXPECT_THAT(text, ::testing::Not(HasSubstr("job_id=\"job-2\""))) << "a series outlived ForgetJob";
  for (const char* name : {"plateau_job_host_planned_bytes{", "plateau_job_host_cap_bytes{",
                           "plateau_job_device_used_bytes{", "plateau_job_device_pool_reserved_bytes{"}) {
    EXPECT_THAT(text, ::testing::Not(HasSubstr(name)));
  }
}

// Every reason's failure and restart counter is there from 0 before the
// first event: Prometheus's increase() takes a series that first appears
// at 1 as no increase, so the first failure of a reason would not fire
// PlateauJobFailed (an increase of plateau_job_failures_total).
TEST(MetricsTest, FailureAndRestartCountersOfEveryReasonStartAtZero) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  std::string text = (*m)->Text();
  for (const char* reason : {"OUT_OF_MEMORY", "WORKER_LOST", "RANK_CRASHED", "INVALID", "RANK_HUNG", "UNSCHEDULABLE",
                             "MAX_DURATION_EXCEEDED", "STATE_CORRUPT"}) {
    EXPECT_EQ(Sample(text, absl::StrCat("plateau_job_failures_total{reason=\"", reason, "\"}")), 0) << reason;
    EXPECT_EQ(Sample(text, absl::StrCat("plateau_job_restarts_total{reason=\"", reason, "\"}")), 0) << reason;
  }
  (*m)->OnFailure("RANK_CRASHED");
  text = (*m)->Text();
  EXPECT_EQ(Sample(text, "plateau_job_failures_total{reason=\"RANK_CRASHED\"}"), 1);
  EXPECT_EQ(Sample(text, "plateau_job_failures_total{reason=\"OUT_OF_MEMORY\"}"), 0);
}

// What operators read in /metrics says what the figures count: model FLOPs
// without the step's recomputation, tokens processed (replayed steps
// again), and what the step time includes and excludes.
TEST(MetricsTest, HelpTextsSayWhatTheFiguresCount) {
  auto m = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(m.ok()) << m.status();
  v1::StepTelemetry t = Step(0, 1, 10, 20);
  t.set_mfu(0.4);  // a family without a series prints no HELP
  (*m)->OnStep("job-1", 1, t);
  const std::string text = (*m)->Text();
  auto help = [&](const std::string& name) {
    for (const std::string& line : std::vector<std::string>(absl::StrSplit(text, '\n'))) {
      if (absl::StartsWith(line, "# HELP " + name + " ")) return line;
    }
    return std::string();
  };
  EXPECT_THAT(help("plateau_job_model_flops_total"), HasSubstr("without recomputation"));
  EXPECT_THAT(help("plateau_job_model_flops_total"), HasSubstr("1.33-1.5x"));
  EXPECT_THAT(help("plateau_job_tokens_total"), HasSubstr("replayed after a restart count again"));
  EXPECT_THAT(help("plateau_job_step_duration_seconds"), HasSubstr("data loading"));
  EXPECT_THAT(help("plateau_job_step_duration_seconds"), HasSubstr("validation and checkpoint writes not"));
  EXPECT_THAT(help("plateau_job_mfu_ratio"), HasSubstr("recomputation not counted"));
}

TEST(MetricsTest, AnAddressItCannotListenOnIsAnError) {
  auto m = Metrics::Create("127.0.0.1:99999");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("--metrics_address=127.0.0.1:99999"));
}

}  // namespace
}  // namespace plateau
