// `auto` settings through the job spec: how a user writes them, what
// PlanJob chooses and shows, the spec the ranks then run, and the errors.
#include "worker/auto_spec.h"

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "worker/calibration.h"
#include "worker/job_spec.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The demo job with all four settings left to the chooser, as a user
// writes them.
v1::JobSpec AllAuto() {
  v1::JobSpec s = DemoJobSpec(2, 10);
  v1::ScheduleSpec* sc = s.mutable_schedule();
  sc->mutable_pipelined_llep()->clear_chunk_tokens();
  sc->mutable_offload_stream_adamw()->clear_bucket_params();
  sc->mutable_sco()->clear_host_budget_bytes();
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
    schedule {
      pipelined_llep { chunk_tokens_auto: true }
      ring_dtp { strip_auto: true }
      sco { host_budget_auto: true }
      offload_stream_adamw { bucket_params_auto: true }
    })pb", &s));
  return s;
}

TEST(AutoSpecTest, RequestFollowsTheFlags) {
  EXPECT_FALSE(HasAutoSettings(DemoJobSpec(2, 10)));
  const AutoRequest r = AutoRequestOf(AllAuto());
  EXPECT_TRUE(r.chunk_tokens && r.strip && r.host_budget && r.bucket_params);
  v1::JobSpec one = DemoJobSpec(2, 10);
  one.mutable_schedule()->mutable_sco()->set_host_budget_bytes(0);
  one.mutable_schedule()->mutable_sco()->set_host_budget_auto(true);
  const AutoRequest beta = AutoRequestOf(one);
  EXPECT_TRUE(beta.host_budget);
  EXPECT_FALSE(beta.chunk_tokens || beta.strip || beta.bucket_params);
}

TEST(AutoSpecTest, AutoBesideAValueIsRefusedNamingTheField) {
  struct Case {
    const char* text;
    const char* message;
  } cases[] = {
      {"schedule { pipelined_llep { chunk_tokens: 64 chunk_tokens_auto: true } }",
       "schedule.pipelined_llep.chunk_tokens: expected 0 (unset) beside chunk_tokens_auto: true, got 64"},
      {"schedule { ring_dtp { strip: 8 strip_auto: true } }",
       "schedule.ring_dtp.strip: expected 0 (unset) beside strip_auto: true, got 8"},
      {"schedule { sco { host_budget_bytes: 5 host_budget_auto: true } }",
       "schedule.sco.host_budget_bytes: expected 0 (unset) beside host_budget_auto: true, got 5"},
      {"schedule { offload_stream_adamw { bucket_params: 9 bucket_params_auto: true } }",
       "schedule.offload_stream_adamw.bucket_params: expected 0 (unset) beside bucket_params_auto: true, got 9"},
  };
  for (const Case& c : cases) {
    v1::JobSpec s = DemoJobSpec(2, 10);
    s.mutable_schedule()->clear_dispatch();
    s.mutable_schedule()->clear_checkpoints();
    s.mutable_schedule()->clear_optimizer_placement();
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(c.text, &s));
    const absl::Status st = ValidateJobSpec(s);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(st.message(), HasSubstr(c.message));
  }
}

// With no worker known, the default curve; the plan shows each value, and
// it is what the resolved spec plans to, byte for byte.
TEST(AutoSpecTest, PlanChoosesShowsAndTheResolvedSpecPlansTheSame) {
  const v1::JobSpec spec = AllAuto();
  auto plan = PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->auto_settings_size(), 4);
  EXPECT_EQ(plan->auto_settings(0).field(), "schedule.pipelined_llep.chunk_tokens");
  EXPECT_EQ(plan->auto_settings(1).field(), "schedule.ring_dtp.strip");
  EXPECT_EQ(plan->auto_settings(2).field(), "schedule.sco.host_budget_bytes");
  EXPECT_EQ(plan->auto_settings(3).field(), "schedule.offload_stream_adamw.bucket_params");
  for (const v1::AutoSetting& a : plan->auto_settings()) {
    EXPECT_GT(a.candidates(), 0);
    EXPECT_GT(a.fitting(), 0);
    EXPECT_LE(a.fitting(), a.candidates());
    EXPECT_THAT(a.why(), HasSubstr("modelled"));
  }
  EXPECT_THAT(plan->calibration(), HasSubstr("the default cpu curve (no worker of this backend"));
  bool noted = false;
  for (const std::string& n : plan->notes()) noted |= n.find("auto: 4 setting(s) chosen by least modelled time among the plans that fit; curves the default cpu curve") == 0;
  EXPECT_TRUE(noted);
  EXPECT_TRUE(plan->fits());
  auto resolved = ResolvedSpec(spec, *plan);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_FALSE(HasAutoSettings(*resolved));
  const v1::ScheduleSpec& s = resolved->schedule();
  EXPECT_EQ(s.pipelined_llep().chunk_tokens(), plan->auto_settings(0).value());
  EXPECT_EQ(s.ring_dtp().strip(), plan->auto_settings(1).value());
  EXPECT_EQ(s.sco().host_budget_bytes(), plan->auto_settings(2).value());
  EXPECT_EQ(s.offload_stream_adamw().bucket_params(), plan->auto_settings(3).value());
  auto again = PlanJob(*resolved);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->total_bytes(), plan->total_bytes());
  EXPECT_EQ(again->host_total_bytes(), plan->host_total_bytes());
  for (int i = 0; i < plan->live_sets_size(); ++i) {
    EXPECT_EQ(again->live_sets(i).bytes(), plan->live_sets(i).bytes());
    EXPECT_EQ(again->host_live_sets(i).bytes(), plan->host_live_sets(i).bytes());
  }
  EXPECT_EQ(again->auto_settings_size(), 0);
  EXPECT_EQ(again->calibration(), "");
  // A plan without the values cannot resolve the spec.
  v1::MemoryPlan none = *plan;
  none.clear_auto_settings();
  auto missing = ResolvedSpec(spec, none);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(),
              HasSubstr("schedule.pipelined_llep.chunk_tokens_auto: the job's plan has no chosen value"));
}

// A worker's calibration is what the plan names, and a spec without caps is
// chosen against that worker's memory.
TEST(AutoSpecTest, AWorkersCalibrationAndMemoryAreUsed) {
  v1::JobSpec spec = AllAuto();
  auto roomy = PlanJob(spec);
  ASSERT_TRUE(roomy.ok());
  AutoContext context;
  v1::Calibration c = CalibrationToProto(DefaultCalibration(CalibrationBackend::kCpu));
  c.set_backend("cpu (test)");
  c.set_measured_unix_seconds(1796280000);
  context.calibration = c;
  context.worker = "worker-7 (node-a)";
  spec.set_backend(v1::BACKEND_CUDA);  // where a cap of 0 means the whole device
  spec.set_device_memory_bytes(0);
  context.device_memory_bytes = roomy->total_bytes() - 1;  // the worker's device: just under
  auto plan = PlanJob(spec, context);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->calibration(), "measured on worker-7 (node-a) (cpu (test)) at 2026-12-03 06:40:00 UTC");
  EXPECT_LE(plan->total_bytes(), context.device_memory_bytes);
  bool noted = false;
  for (const std::string& n : plan->notes()) noted |= n.find("device_memory_bytes 0: chosen against that worker's") != std::string::npos;
  EXPECT_TRUE(noted);
  // A calibration that cannot be modelled names its field.
  context.calibration->clear_gemm();
  EXPECT_THAT(PlanJob(spec, context).status().message(), HasSubstr("calibration.gemm: expected at least one point"));
}

TEST(AutoSpecTest, NothingFitsIsRefusedAtPlanAndAdmission) {
  v1::JobSpec spec = AllAuto();
  spec.set_device_memory_bytes(1 << 20);  // 1 MiB: the activations alone do not fit
  auto plan = PlanJob(spec);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(),
              HasSubstr("device_memory_bytes: no value of the `auto` settings fits: at the smallest ("));
  EXPECT_EQ(AdmitJob(spec).status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace plateau
