// `auto` settings through the job spec: how a user writes them, what
// PlanJob chooses and shows, the spec the ranks then run, and the errors.
#include "worker/auto_spec.h"

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "worker/calibration.h"
#include "worker/job_spec.h"
#include "worker/auto_spec_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The demo job with all four settings left to the chooser, as a user
// writes them.
v1::JobSpec AllAuto() {
  v1::JobSpec s = DemoJobSpec(2, 10);
  return WithAllAuto(std::move(s));
}

TEST(AutoSpecTest, RequestFollowsTheFlags) {
  // The demo job leaves its bucket `auto`.
  const AutoRequest demo = AutoRequestOf(DemoJobSpec(2, 10));
  EXPECT_TRUE(demo.bucket_params);
  EXPECT_FALSE(demo.chunk_tokens || demo.strip || demo.host_budget);
  const AutoRequest r = AutoRequestOf(AllAuto());
  EXPECT_TRUE(r.chunk_tokens && r.strip && r.host_budget && r.bucket_params);
  v1::JobSpec one = DemoJobSpec(2, 10);
  one.mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  EXPECT_FALSE(HasAutoSettings(one));
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

// A restart's plan at the earlier values: AdmitJob's at those values, the
// earlier rows kept; refused naming the cap where they do not fit the new
// workers' memory (the spec's cap 0), and where the earlier plan has none.
TEST(AutoSpecTest, TheEarlierValuesAreKeptWhereTheyFit) {
  v1::JobSpec spec = AllAuto();
  spec.set_backend(v1::BACKEND_CUDA);
  spec.set_device_memory_bytes(0);
  auto earlier = PlanJob(spec);  // no cap: the roomiest values
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  AutoContext same;
  same.device_memory_bytes = earlier->total_bytes();  // exactly enough
  auto kept = PlanAtEarlierAutoSettings(spec, *earlier, same);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->total_bytes(), earlier->total_bytes());
  ASSERT_EQ(kept->auto_settings_size(), earlier->auto_settings_size());
  for (int i = 0; i < kept->auto_settings_size(); ++i) {
    EXPECT_EQ(kept->auto_settings(i).value(), earlier->auto_settings(i).value());
  }
  EXPECT_THAT(kept->notes(), testing::Contains(HasSubstr("kept from the earlier attempt")));
  AutoContext smaller;
  smaller.device_memory_bytes = earlier->total_bytes() - 1;
  auto refused = PlanAtEarlierAutoSettings(spec, *earlier, smaller);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("device_memory_bytes"));
  // Chosen again there, something smaller fits.
  auto chosen = AdmitJob(spec, smaller);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_LE(chosen->total_bytes(), smaller.device_memory_bytes);
  v1::MemoryPlan none = *earlier;
  none.clear_auto_settings();
  EXPECT_EQ(PlanAtEarlierAutoSettings(spec, none, same).status().code(), absl::StatusCode::kFailedPrecondition);
}

// force_launch admits a plan whose routing-dependent dispatch (standard
// EP's worst case) is over the cap; it does not make kept values fit new
// workers: the whole plan must, as the chooser would have it.
TEST(AutoSpecTest, ForceLaunchDoesNotKeepValuesWhosePlanIsOverTheWorkers) {
  v1::JobSpec spec = AllAuto();
  spec.set_backend(v1::BACKEND_CUDA);
  spec.set_device_memory_bytes(0);
  spec.set_force_launch(true);
  spec.mutable_schedule()->mutable_standard_ep();  // the dispatch follows the routing
  auto earlier = PlanJob(spec);
  ASSERT_TRUE(earlier.ok()) << earlier.status();
  ASSERT_LT(earlier->launch_bytes(), earlier->total_bytes()) << "the dispatch must follow the routing";
  AutoContext between;  // room for the launch-sized state, not the whole plan
  between.device_memory_bytes = (earlier->launch_bytes() + earlier->total_bytes()) / 2;
  auto kept = PlanAtEarlierAutoSettings(spec, *earlier, between);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kResourceExhausted) << kept.status();
  EXPECT_THAT(kept.status().message(), HasSubstr("device_memory_bytes: at those values the plan is "));
}

// force_launch with standard EP and a cap of the spec's own: the choice
// counts the dispatch at its balanced case, as admission counts only the
// launch-sized state. Counted at its worst case nothing fit, and the
// slowest settings (the smallest) ran though the fastest fit.
TEST(AutoSpecTest, ForceLaunchChoosesAgainstTheBalancedDispatch) {
  v1::JobSpec spec = AllAuto();
  spec.mutable_schedule()->mutable_standard_ep();  // the dispatch follows the routing
  spec.set_force_launch(true);
  auto free = PlanJob(spec);  // no cap: the fastest
  ASSERT_TRUE(free.ok()) << free.status();
  const int64_t dispatch = [&] {
    for (const v1::LiveSetBytes& ls : free->live_sets()) {
      if (ls.live_set() == "dispatch") return ls.bytes();
    }
    return int64_t{-1};
  }();
  ASSERT_GT(dispatch, free->dispatch_balanced_bytes()) << "the worst case must exceed the balanced one";
  // Room for the fastest with a balanced dispatch, not for its worst case.
  spec.set_device_memory_bytes(free->total_bytes() - dispatch + free->dispatch_balanced_bytes());
  auto capped = PlanJob(spec);
  ASSERT_TRUE(capped.ok()) << capped.status();
  ASSERT_EQ(capped->auto_settings_size(), free->auto_settings_size());
  for (int i = 0; i < free->auto_settings_size(); ++i) {
    EXPECT_EQ(capped->auto_settings(i).value(), free->auto_settings(i).value()) << free->auto_settings(i).field();
  }
  auto admitted = AdmitJob(spec);
  EXPECT_TRUE(admitted.ok()) << admitted.status();
  // Without force_launch the whole plan counts: the fastest does not fit.
  spec.set_force_launch(false);
  auto whole = PlanJob(spec);
  ASSERT_TRUE(whole.ok()) << whole.status();
  bool differs = false;
  for (int i = 0; i < free->auto_settings_size(); ++i) {
    differs |= whole->auto_settings(i).value() != free->auto_settings(i).value();
  }
  EXPECT_TRUE(differs || !whole->fits()) << whole->DebugString();
}

// Nothing fits: the plan is shown at the smallest settings, not fitting,
// with the reason; admission refuses it with that reason.
TEST(AutoSpecTest, NothingFitsIsPlannedAtTheSmallestAndRefusedAtAdmission) {
  v1::JobSpec spec = AllAuto();
  spec.set_device_memory_bytes(1 << 20);  // 1 MiB: the activations alone do not fit
  auto plan = PlanJob(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->fits());
  ASSERT_EQ(plan->auto_settings_size(), 4);
  for (const v1::AutoSetting& a : plan->auto_settings()) {
    EXPECT_EQ(a.fitting(), 0);
    EXPECT_THAT(a.why(), HasSubstr("no value fits the caps"));
  }
  // The smallest values: c and S and the bucket at their first candidate,
  // beta pooling every boundary that can leave (L - 1 = 1 of the demo's 2).
  EXPECT_EQ(plan->auto_settings(0).value(), 16);
  EXPECT_EQ(plan->auto_settings(2).value(), 512 * 64 * 4);
  EXPECT_EQ(plan->auto_settings(3).value(), 1024);
  auto resolved = ResolvedSpec(spec, *plan);
  ASSERT_TRUE(resolved.ok());
  auto direct = PlanJob(*resolved);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(direct->total_bytes(), plan->total_bytes());
  const absl::Status refused = AdmitJob(spec).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(),
              HasSubstr("device_memory_bytes: no value of the `auto` settings fits: at the smallest ("
                        "schedule.pipelined_llep.chunk_tokens=16, schedule.ring_dtp.strip="));
  EXPECT_THAT(refused.message(), HasSubstr("the largest live set is activations"));
  // force_launch: the usual admission decides (here: the launch-sized
  // state does not fit either).
  spec.set_force_launch(true);
  EXPECT_THAT(AdmitJob(spec).status().message(), HasSubstr("cannot hold the step's launch-sized state"));
}

}  // namespace
}  // namespace plateau
