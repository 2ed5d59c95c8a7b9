#include "worker/job_spec.h"

#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/optimizer/lr_schedule.h"
#include "worker/auto_spec_testing.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The demo job with its one `auto` setting (the bucket) pinned to the value
// of RecallDemoJob, so that the admission and N_max cases below plan fixed
// settings (worker/auto_spec_test covers `auto`).
v1::JobSpec Good() {
  v1::JobSpec s = DemoJobSpec(2, 10);
  s.mutable_schedule()->mutable_offload_stream_adamw()->clear_bucket_params_auto();
  s.mutable_schedule()->mutable_offload_stream_adamw()->set_bucket_params(16384);
  return s;
}

// The demo job with every schedule at its baseline (standard EP, all
// boundaries and the optimizer state on the device): no host bytes, and
// standard EP's worst-case dispatch.
v1::JobSpec Baseline() {
  v1::JobSpec s = Good();
  s.mutable_schedule()->mutable_standard_ep();
  s.mutable_schedule()->mutable_full_checkpoints();
  s.mutable_schedule()->mutable_device_adamw();
  return s;
}

// A name in any script, with spaces and punctuation, is printable text.
TEST(JobSpecTest, NamesInAnyScriptAreAccepted) {
  for (const char* name :
       {"recall demo: lr=6e-3, 2 ranks", "caf\xc3\xa9 \xe2\x80\x94 \xe6\x97\xa5\xe6\x9c\xac",
        "nbsp\xc2\xa0"
        "and \xc2\xa9"}) {
    v1::JobSpec s = Good();
    s.set_name(name);
    EXPECT_TRUE(ValidateJobSpec(s).ok()) << name << ": " << ValidateJobSpec(s);
  }
}

TEST(JobSpecTest, DemoSpecIsValidAndMapsOntoTheDemoJob) {
  auto t = ToTrainerOptions(Good());
  ASSERT_TRUE(t.ok()) << t.status();
  const TrainerOptions want = RecallDemoJob(2);
  EXPECT_EQ(t->step.model.hidden, want.step.model.hidden);
  EXPECT_EQ(t->step.model.vocab_size, want.step.model.vocab_size);
  EXPECT_EQ(t->step.model.seq_len, want.step.model.seq_len);
  EXPECT_EQ(t->step.layout.ranks, 2);
  EXPECT_EQ(t->step.layout.batch, want.step.layout.batch);
  EXPECT_FLOAT_EQ(t->step.optimizer.lr, want.step.optimizer.lr);
  EXPECT_FLOAT_EQ(t->step.optimizer.beta2, want.step.optimizer.beta2);
  EXPECT_EQ(t->data.kind, DataOptions::Kind::kRecall);
  EXPECT_EQ(t->data.recall.pairs, want.data.recall.pairs);
  EXPECT_EQ(t->steps, 10);
  auto b = ToBackendOptions(Good());
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->kind, BackendKind::kCpu);
  EXPECT_EQ(b->device_memory_bytes, int64_t{256} << 20);
}

// The schedule's fields reach the optimizer's options; its end is the
// job's steps. Unset, the schedule is the constant default.
TEST(JobSpecTest, LearningRateSchedule) {
  v1::JobSpec s = Good();
  auto plain = ToTrainerOptions(s);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->step.optimizer.schedule.decay, LrSchedule::Decay::kConstant);
  EXPECT_EQ(plain->step.optimizer.schedule.warmup_steps, 0);
  s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
  s.mutable_optimizer()->set_warmup_steps(9);  // W = steps - 1: the last step runs at lr
  s.mutable_optimizer()->set_min_lr(6e-4);
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->step.optimizer.schedule.decay, LrSchedule::Decay::kCosine);
  EXPECT_EQ(t->step.optimizer.schedule.warmup_steps, 9);
  EXPECT_EQ(t->step.optimizer.schedule.total_steps, 10);
  EXPECT_EQ(t->step.optimizer.schedule.min_lr, 6e-4);
  s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_LINEAR);
  s.mutable_optimizer()->set_min_lr(s.optimizer().lr());  // the floor may equal lr
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->step.optimizer.schedule.decay, LrSchedule::Decay::kLinear);
}

// optimizer.warmup_steps == steps (a warm-up over the whole job: step 1 at
// 0, the last at lr (steps - 1) / steps) was accepted until 2026-12-07. A
// job stored then is converted again for every rank that starts and
// checked again at every placement: it must still convert, plan and place,
// and run the schedule it was accepted with. Only a new submit refuses it
// (the coordinator's SubmitJob).
TEST(JobSpecTest, AStoredSpecWithAWarmUpAsLongAsTheJobStillConvertsAndPlaces) {
  v1::JobSpec s = Good();  // 10 steps
  s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
  s.mutable_optimizer()->set_warmup_steps(10);
  // The rank (worker/rank_main.cc ToTrainerOptions).
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->step.optimizer.schedule.warmup_steps, 10);
  EXPECT_EQ(t->step.optimizer.schedule.total_steps, 10);
  const double lr = s.optimizer().lr();
  EXPECT_EQ(LearningRate(t->step.optimizer, 1), 0.0);
  EXPECT_DOUBLE_EQ(LearningRate(t->step.optimizer, 10), lr * 9 / 10);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  // Placement's plan of a fixed spec (the coordinator's Schedule).
  EXPECT_TRUE(AdmitJob(s).ok()) << AdmitJob(s).status();
  // With `auto` settings: placement's check on a worker's memory and the
  // context the settings are chosen again with.
  const v1::JobSpec a = WithAllAuto(s);
  v1::WorkerCapabilities caps;
  caps.set_backend(v1::BACKEND_CPU);
  caps.set_devices(2);
  caps.set_device_memory_bytes(int64_t{1} << 30);
  caps.set_host_memory_bytes(int64_t{16} << 30);
  EXPECT_TRUE(AutoFitsOnWorker(a, caps, 2).ok()) << AutoFitsOnWorker(a, caps, 2);
  auto context = PlacementAutoContext(a, {{"worker-1", caps}});
  ASSERT_TRUE(context.ok()) << context.status();
  EXPECT_TRUE(AdmitJob(a, *context).ok()) << AdmitJob(a, *context).status();
  // A new submit refuses it, naming the field and the range.
  const absl::Status now = ValidateNewJobSpec(s);
  EXPECT_EQ(now.code(), absl::StatusCode::kInvalidArgument) << now;
  EXPECT_THAT(now.message(), HasSubstr("optimizer.warmup_steps: expected 0 to steps - 1 = 9"));
  s.mutable_optimizer()->set_warmup_steps(9);
  EXPECT_TRUE(ValidateNewJobSpec(s).ok()) << ValidateNewJobSpec(s);
}

// Unset: the default (first step, then every 100th); 0 turns it off; any
// other value is the period.
TEST(JobSpecTest, MemoryTimelineEvery) {
  v1::JobSpec s = Good();
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->memory_timeline_every, kDefaultMemoryTimelineEvery);
  EXPECT_EQ(kDefaultMemoryTimelineEvery, 100);
  s.set_memory_timeline_every(0);
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->memory_timeline_every, 0);
  s.set_memory_timeline_every(7);
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->memory_timeline_every, 7);
  std::vector<int64_t> recorded;
  for (int64_t step = 1; step <= 22; ++step) {
    if (RecordsMemoryTimeline(step, 7)) recorded.push_back(step);
  }
  EXPECT_EQ(recorded, (std::vector<int64_t>{1, 7, 14, 21}));
  for (int64_t step = 1; step <= 300; ++step) EXPECT_FALSE(RecordsMemoryTimeline(step, 0));
  EXPECT_TRUE(RecordsMemoryTimeline(1, 100));
  EXPECT_FALSE(RecordsMemoryTimeline(2, 100));
  EXPECT_TRUE(RecordsMemoryTimeline(200, 100));
}

// checkpoint.keep_last reaches the trainer; unset it is 0 (every
// checkpoint stays), so a spec written before the field keeps all its
// checkpoints as it did. The range names the field.
TEST(JobSpecTest, CheckpointKeepLast) {
  v1::JobSpec s = Good();
  s.mutable_checkpoint()->set_directory("/tmp/ckpt");
  s.mutable_checkpoint()->set_every(10);
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->checkpoint_keep_last, 0);
  s.mutable_checkpoint()->set_keep_last(3);
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->checkpoint_keep_last, 3);
  s.mutable_checkpoint()->set_keep_last(-2);
  const absl::Status st = ValidateJobSpec(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("checkpoint.keep_last: expected 0 to 1099511627776, got -2"));
}

// Under SCO with a beta past every boundary, a deeper model pools whole
// records (L - 2 of them at most) and the plan's note counts them.
TEST(JobSpecTest, KeepAttentionUnderScoPoolsRecordsAndThePlanSaysHowMany) {
  v1::JobSpec s = Good();
  s.mutable_model()->set_layers(4);
  s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(int64_t{1} << 40);
  s.mutable_schedule()->set_keep_attention(true);
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(CheckpointPools(t->step).records.host_boundaries, 2);
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->notes(), ::testing::Contains(HasSubstr("4 attention records")));
  EXPECT_THAT(plan->notes(), ::testing::Contains(HasSubstr("2 of them in SCO's host pool")));
  EXPECT_EQ(plan->host_total_bytes(), PlanMemory(t->step)->host_total()) << "the records' pool counted on the host";
}

// schedule.keep_attention reaches the step with either checkpoint schedule,
// and the plan counts its records (the step's own plan, PlanMemory).
TEST(JobSpecTest, KeepAttentionReachesTheStepAndThePlan) {
  for (bool sco : {false, true}) {
    v1::JobSpec s = Good();
    if (sco) {
      s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(1 << 16);
    } else {
      s.mutable_schedule()->mutable_full_checkpoints();
    }
    auto before = PlanJob(s);
    ASSERT_TRUE(before.ok()) << before.status();
    s.mutable_schedule()->set_keep_attention(true);
    auto t = ToTrainerOptions(s);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(t->step.checkpoints.keep_attention);
    EXPECT_EQ(t->step.checkpoints.kind, sco ? CheckpointOptions::Kind::kSco : CheckpointOptions::Kind::kFull);
    auto plan = PlanJob(s);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const ModelConfig& m = t->step.model;
    const int64_t N = TokensPerRank(m, t->step.layout);
    EXPECT_EQ(plan->total_bytes() - before->total_bytes(), m.layers * N * (m.hidden + m.heads) * 4);
    EXPECT_EQ(plan->total_bytes(), PlanMemory(t->step)->total());
    const int64_t pooled = sco ? CheckpointPools(t->step).records.host_boundaries : 0;
    EXPECT_THAT(plan->notes(), ::testing::Contains(HasSubstr(absl::StrCat(
                                   "keep_attention: ", m.layers, " attention records (each layer's output and ",
                                   "log-sum-exp, fp32) of ", N * (m.hidden + m.heads) * 4, " bytes"))));
    EXPECT_THAT(plan->notes(),
                ::testing::Contains(HasSubstr(sco ? absl::StrCat(pooled, " of them in SCO's host pool")
                                                  : "fp32) of 139264 bytes (0.13 MiB) in checkpoints, on the device")));
    for (const std::string& n : before->notes()) EXPECT_THAT(n, ::testing::Not(HasSubstr("keep_attention")));
    // Every what-if row keeps it, and says so (its N_max pays for it).
    ASSERT_EQ(plan->what_if_size(), before->what_if_size());
    ASSERT_GT(plan->what_if_size(), 0);
    for (int i = 0; i < plan->what_if_size(); ++i) {
      const auto& row = plan->what_if(i);
      EXPECT_THAT(row.settings(row.settings_size() - 1), HasSubstr("keep_attention")) << row.schedules();
      for (const std::string& setting : before->what_if(i).settings()) {
        EXPECT_THAT(setting, ::testing::Not(HasSubstr("keep_attention"))) << row.schedules();
      }
    }
  }
}

// tools/demo submits this file; it must stay the demo job of RecallDemoJob.
TEST(JobSpecTest, FieldsOfANewerJobProtoAreRefusedNotIgnored) {
  // What a newer client's spec looks like to this build: an extra field on
  // the wire (number 999, varint), at the top and inside model.
  const std::string good = Good().SerializeAsString();
  std::string extra;
  extra.push_back(static_cast<char>(((999 << 3) & 0x7f) | 0x80));
  extra.push_back(static_cast<char>(999 >> 4));
  extra.push_back(1);
  v1::JobSpec top;
  ASSERT_TRUE(top.ParseFromString(good + extra));
  absl::Status s = ValidateJobSpec(top);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("spec: expected only fields of"));
  EXPECT_THAT(s.message(), HasSubstr("unknown field number 999"));

  v1::ModelSpec model = Good().model();
  v1::ModelSpec newer;
  ASSERT_TRUE(newer.ParseFromString(model.SerializeAsString() + extra));
  v1::JobSpec nested = Good();
  *nested.mutable_model() = newer;
  s = ValidateJobSpec(nested);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model: expected only fields of"));
  EXPECT_TRUE(ValidateJobSpec(Good()).ok());
}

TEST(JobSpecTest, DemoJobFileIsTheDemoJob) {
  std::ifstream in("tools/demo_job.txtpb");
  ASSERT_TRUE(in) << "tools/demo_job.txtpb missing from runfiles";
  std::stringstream text;
  text << in.rdbuf();
  v1::JobSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text.str(), &spec));
  v1::JobSpec want = DemoJobSpec(2, 200);
  EXPECT_EQ(spec.SerializeAsString(), want.SerializeAsString())
      << "file:\n" << spec.DebugString() << "want:\n" << want.DebugString();
}

TEST(JobSpecTest, PlanNamesEveryLiveSetAndMatchesTheStep) {
  auto plan = PlanJob(Good());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->live_sets_size(), kNumLiveSets);
  EXPECT_EQ(plan->live_sets(0).live_set(), "weights");
  auto t = ToTrainerOptions(Good());
  auto direct = PlanMemory(t->step);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(plan->total_bytes(), direct->total());
  EXPECT_TRUE(plan->fits());
  EXPECT_EQ(plan->tokens_per_rank(), 32 * 32 / 2);
}

// host_memory_bytes is the rank's host space cap: it reaches the backend's
// options as given (0: uncapped), as device_memory_bytes does.
TEST(JobSpecTest, HostCapReachesTheBackendOptions) {
  v1::JobSpec s = Good();
  auto b = ToBackendOptions(s);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host_memory_bytes, 0);
  s.set_host_memory_bytes(4096);
  b = ToBackendOptions(s);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host_memory_bytes, 4096);
  EXPECT_EQ(b->device_memory_bytes, int64_t{256} << 20);
  s.set_host_memory_bytes(-1);
  const absl::Status bad = ToBackendOptions(s).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), ::testing::StartsWith("host_memory_bytes: expected >= 0"));
  EXPECT_THAT(bad.message(), HasSubstr("got -1"));
}

// max_borrowed reaches the step's dispatch options (llep and
// pipelined_llep), and the planned dispatch bound shrinks with it.
TEST(JobSpecTest, MaxBorrowedReachesTheStepAndShrinksTheDispatchBound) {
  v1::JobSpec s = Good();
  auto uncapped = ToTrainerOptions(s);
  ASSERT_TRUE(uncapped.ok());
  EXPECT_EQ(uncapped->step.dispatch.pipelined.balance.max_borrowed, 0);
  s.mutable_schedule()->mutable_pipelined_llep()->set_max_borrowed(1);
  auto capped = ToTrainerOptions(s);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(capped->step.dispatch.pipelined.balance.max_borrowed, 1);
  auto a = PlanMemory(uncapped->step);
  auto b = PlanMemory(capped->step);
  ASSERT_TRUE(a.ok() && b.ok());
  const int d = static_cast<int>(LiveSet::kDispatch);
  EXPECT_LT(b->bytes[d], a->bytes[d]);
  s.mutable_schedule()->mutable_llep()->set_max_borrowed(2);
  auto llep = ToTrainerOptions(s);
  ASSERT_TRUE(llep.ok());
  EXPECT_EQ(llep->step.dispatch.kind, DispatchOptions::Kind::kLlep);
  EXPECT_EQ(llep->step.dispatch.llep.max_borrowed, 2);
}

// The plan carries the host space beside the device: every live set by name,
// the total and the job's host cap. The demo job puts three live sets in host
// memory: SCO's pool (h_0 of its 2 layers, N x H x 4 bytes), the optimizer's
// master and moments (OffloadStreamAdamW) and PipelinedLLEP's index staging.
TEST(JobSpecTest, PlanCarriesTheHostLiveSetsTotalAndCap) {
  v1::JobSpec s = Good();
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->step.checkpoints.kind, CheckpointOptions::Kind::kSco);
  EXPECT_EQ(t->step.dispatch.kind, DispatchOptions::Kind::kPipelinedLlep);
  EXPECT_EQ(t->step.optimizer_placement.kind, OptimizerPlacementOptions::Kind::kOffloadStream);
  auto direct = PlanMemory(t->step);
  ASSERT_TRUE(direct.ok());
  const int64_t host = direct->host_total();
  EXPECT_EQ(direct->host_bytes[static_cast<int>(LiveSet::kCheckpoints)], 512 * 64 * 4);  // N = 512, H = 64
  EXPECT_GT(direct->host_bytes[static_cast<int>(LiveSet::kOptimizer)], 0);
  EXPECT_GT(direct->host_bytes[static_cast<int>(LiveSet::kDispatch)], 0);
  s.set_host_memory_bytes(host);
  auto plan = AdmitJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->host_live_sets_size(), kNumLiveSets);
  for (int i = 0; i < kNumLiveSets; ++i) {
    EXPECT_EQ(plan->host_live_sets(i).live_set(), plan->live_sets(i).live_set());
    EXPECT_EQ(plan->host_live_sets(i).bytes(), direct->host_bytes[i]) << plan->host_live_sets(i).live_set();
  }
  EXPECT_EQ(plan->host_total_bytes(), host);
  EXPECT_EQ(plan->host_memory_bytes(), host);
  EXPECT_TRUE(plan->fits());
  // One byte less is refused, naming the cap.
  s.set_host_memory_bytes(host - 1);
  EXPECT_THAT(std::string(AdmitJob(s).status().message()), ::testing::StartsWith("host_memory_bytes: "));
  // With every schedule at its baseline the host holds nothing.
  v1::JobSpec b = Baseline();
  b.set_host_memory_bytes(4096);
  auto full = AdmitJob(b);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->host_total_bytes(), 0);
  for (const std::string& n : full->notes()) EXPECT_THAT(n, ::testing::Not(HasSubstr("host"))) << n;
}

// A budget plan with host terms (what SCO and OffloadStreamAdamW will
// produce), made by hand: `fits` holds only when both spaces fit.
MemoryPlan WithHost(const v1::JobSpec& spec, int64_t checkpoints, int64_t optimizer) {
  auto t = ToTrainerOptions(spec);
  EXPECT_TRUE(t.ok()) << t.status();
  MemoryPlan plan = *PlanMemory(t->step);
  plan.host_bytes[static_cast<int>(LiveSet::kCheckpoints)] = checkpoints;
  plan.host_bytes[static_cast<int>(LiveSet::kOptimizer)] = optimizer;
  return plan;
}

TEST(JobSpecTest, FitsOnlyWhenBothDeviceAndHostFit) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  v1::JobSpec s = Baseline();
  const MemoryPlan plan = WithHost(s, 3 * kMiB, kMiB);
  v1::MemoryPlan p = PlanToProto(s, plan);
  EXPECT_EQ(p.host_total_bytes(), 4 * kMiB);
  EXPECT_EQ(p.host_live_sets(static_cast<int>(LiveSet::kCheckpoints)).live_set(), "checkpoints");
  EXPECT_EQ(p.host_live_sets(static_cast<int>(LiveSet::kCheckpoints)).bytes(), 3 * kMiB);
  EXPECT_EQ(p.total_bytes(), plan.total());
  EXPECT_TRUE(p.fits()) << "no host cap: checked when scheduled";
  EXPECT_THAT(p.notes(p.notes_size() - 1), HasSubstr("host_memory_bytes 0"));
  s.set_host_memory_bytes(4 * kMiB);
  EXPECT_TRUE(PlanToProto(s, plan).fits());
  s.set_host_memory_bytes(4 * kMiB - 1);
  p = PlanToProto(s, plan);
  EXPECT_FALSE(p.fits()) << "the device fits, the host does not";
  EXPECT_EQ(p.host_memory_bytes(), 4 * kMiB - 1);
  s.set_host_memory_bytes(4 * kMiB);
  s.set_device_memory_bytes(plan.total() - 1);
  EXPECT_FALSE(PlanToProto(s, plan).fits()) << "the host fits, the device does not";
}

// A host plan over the cap is refused naming host_memory_bytes, the host
// live sets and the shortfall, and force_launch does not override it:
// every host live set is launch-sized, so each rank would refuse it.
TEST(JobSpecTest, AdmitRefusesAHostPlanOverTheHostCapEvenWhenForced) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  v1::JobSpec s = Baseline();
  const MemoryPlan plan = WithHost(s, 3 * kMiB, kMiB);
  s.set_host_memory_bytes(3 * kMiB);
  for (bool forced : {false, true}) {
    s.set_force_launch(forced);
    auto refused = AdmitPlan(s, PlanToProto(s, plan));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                AllOf(::testing::StartsWith("host_memory_bytes: the host plan does not fit: 4194304 bytes"),
                      HasSubstr("per rank (optimizer=1048576, checkpoints=3145728)"),
                      HasSubstr("against a cap of 3145728 bytes"), HasSubstr("short by 1048576 bytes"),
                      HasSubstr("force_launch does not apply")))
        << "forced: " << forced;
  }
  // Before the device's overridable refusal: forcing the device plan does
  // not hide the host's.
  s.set_device_memory_bytes(plan.total() - 1);
  auto both = AdmitPlan(s, PlanToProto(s, plan));
  EXPECT_THAT(std::string(both.status().message()), ::testing::StartsWith("host_memory_bytes: ")) << both.status();
  // At exactly the host plan, or without a host cap, it is admitted.
  s.set_device_memory_bytes(int64_t{256} << 20);
  s.set_force_launch(false);
  s.set_host_memory_bytes(4 * kMiB);
  auto exact = AdmitPlan(s, PlanToProto(s, plan));
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_TRUE(exact->fits());
  s.set_host_memory_bytes(0);
  EXPECT_TRUE(AdmitPlan(s, PlanToProto(s, plan)).ok());
}

TEST(JobSpecTest, AdmitRefusesACapBelowTheLaunchStateNamingLiveSets) {
  v1::JobSpec s = Good();
  s.set_device_memory_bytes(4096);
  auto plan = AdmitJob(s);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("device_memory_bytes"));
  EXPECT_THAT(plan.status().message(), HasSubstr("weights="));
  // PlanJob alone still plans it (plateauctl plan shows why it does not fit).
  auto p = PlanJob(s);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->fits());
}

// A plan over the cap is refused, naming every live set, the total, the cap
// and the shortfall, and saying how to launch anyway; force_launch admits it
// with a note (it must still hold the launch-sized state).
TEST(JobSpecTest, AdmitRefusesAPlanOverTheCapUnlessForced) {
  v1::JobSpec s = Baseline();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok());
  int64_t dispatch = 0;
  for (const auto& ls : plan->live_sets()) if (ls.live_set() == "dispatch") dispatch = ls.bytes();
  ASSERT_GT(dispatch, plan->dispatch_balanced_bytes());
  s.set_device_memory_bytes(plan->total_bytes() - dispatch / 2);
  auto refused = AdmitJob(s);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("device_memory_bytes: the plan does not fit"), HasSubstr("dispatch="),
                    HasSubstr("weights="), HasSubstr("short by"), HasSubstr("force_launch")));
  s.set_force_launch(true);
  auto admitted = AdmitJob(s);
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_FALSE(admitted->fits());
  EXPECT_THAT(admitted->notes(admitted->notes_size() - 1), HasSubstr("force_launch"));
  // At exactly the plan it fits, forced or not.
  s.set_force_launch(false);
  s.set_device_memory_bytes(plan->total_bytes());
  auto exact = AdmitJob(s);
  ASSERT_TRUE(exact.ok()) << exact.status();
  EXPECT_TRUE(exact->fits());
}

// PipelinedLLEP's dispatch buffers are its bound, allocated at launch:
// a cap below the plan is refused even when forced (the rank would refuse
// it too), and the plan's note says what the dispatch term is.
TEST(JobSpecTest, PipelinedLlepDispatchIsLaunchSizedAtAdmission) {
  v1::JobSpec s = Good();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->notes(0), HasSubstr("pipelined_llep's bound"));
  EXPECT_THAT(plan->notes(0), ::testing::Not(HasSubstr("when every rank receives")));
  EXPECT_EQ(plan->launch_bytes(), plan->total_bytes()) << "every byte is allocated at launch";
  auto baseline = PlanJob(Baseline());
  ASSERT_TRUE(baseline.ok());
  int64_t dispatch = 0;
  for (const auto& ls : baseline->live_sets()) if (ls.live_set() == "dispatch") dispatch = ls.bytes();
  EXPECT_EQ(baseline->launch_bytes(), baseline->total_bytes() - dispatch) << "standard EP's follows the routing";
  s.set_device_memory_bytes(plan->total_bytes() - 1);
  s.set_force_launch(true);
  auto refused = AdmitJob(s);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              AllOf(HasSubstr("cannot hold the step's launch-sized state"), HasSubstr("dispatch=")));
}

// With a device cap the plan carries N_max on both axes, tight against the
// plan itself: the spec at the largest batch (longest seq_len) fits, one
// sequence more (ranks tokens more of context) does not.
TEST(JobSpecTest, PlanCarriesNMaxTightAgainstThePlan) {
  const v1::JobSpec s = Good();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(plan->has_n_max());
  const v1::NMaxAxis& b = plan->n_max().batch();
  EXPECT_EQ(b.limit(), "device_memory_bytes") << b.detail();
  EXPECT_EQ(b.seq_len(), 32);
  EXPECT_EQ(b.tokens_per_rank(), b.batch() * 32 / 2);
  EXPECT_GT(b.batch(), 32);  // the demo's own batch fits its 256 MiB
  EXPECT_THAT(b.detail(), HasSubstr("against the cap of 256.00 MiB"));
  auto with = [&](int64_t batch, int64_t seq_len) {
    v1::JobSpec t = s;
    t.mutable_layout()->set_batch(batch);
    t.mutable_model()->set_seq_len(seq_len);
    auto p = PlanJob(t);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() && p->fits();
  };
  EXPECT_TRUE(with(b.batch(), 32));
  EXPECT_FALSE(with(b.batch() + 1, 32));
  const v1::NMaxAxis& c = plan->n_max().context();
  EXPECT_EQ(c.limit(), "device_memory_bytes") << c.detail();
  EXPECT_EQ(c.batch(), 32);
  EXPECT_EQ(c.tokens_per_rank(), 32 * c.seq_len() / 2);
  EXPECT_TRUE(with(32, c.seq_len()));
  EXPECT_FALSE(with(32, c.seq_len() + 2));
}

// The what-if rows: all off, each schedule alone, all on; the demo chose
// all four, so each runs with the spec's settings, and together they buy
// more context than any one alone.
TEST(JobSpecTest, PlanCarriesTheWhatIfTable) {
  auto plan = PlanJob(Good());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->what_if_size(), 6);
  const std::vector<std::string> names = {"all off", "pipelined_llep", "ring_dtp", "sco", "offload_stream_adamw",
                                          "all on"};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(plan->what_if(i).schedules(), names[i]);
  EXPECT_THAT(plan->what_if(1).settings(0), HasSubstr("chunk_tokens=128 min_piece=32 max_borrowed=no cap (the spec's)"));
  EXPECT_THAT(plan->what_if(2).settings(0), HasSubstr("(default)"));  // the demo's projection is dense
  EXPECT_THAT(plan->what_if(3).settings(0), HasSubstr("host_budget_bytes=1048576 (the spec's)"));
  EXPECT_THAT(plan->what_if(4).settings(0), HasSubstr("bucket_params=16384 staging_slots=2 (the spec's)"));
  EXPECT_EQ(plan->what_if(5).settings_size(), 4);
  const int64_t all_on = plan->what_if(5).n_max().context().tokens_per_rank();
  for (int i = 0; i < 5; ++i) {
    EXPECT_LT(plan->what_if(i).n_max().context().tokens_per_rank(), all_on) << names[i];
    EXPECT_GT(plan->what_if(i).n_max().context().tokens_per_rank(), 0) << names[i];
  }
}

// Without a device cap (CUDA, 0: the whole device) there is nothing to
// solve against until the job is scheduled: a note says so.
TEST(JobSpecTest, PlanWithoutADeviceCapSaysWhyThereIsNoNMax) {
  v1::JobSpec s = Good();
  s.set_backend(v1::BACKEND_CUDA);
  s.set_device_memory_bytes(0);
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->has_n_max());
  EXPECT_EQ(plan->what_if_size(), 0);
  bool noted = false;
  for (const std::string& n : plan->notes()) noted |= absl::StartsWith(n, "n_max: device_memory_bytes 0");
  EXPECT_TRUE(noted);
}

// The search stays within the spec's limits (CheckSize on every candidate)
// and is cheap on the RPC thread, for the deepest model the spec accepts.
// The time limits guard against a search gone linear in N (minutes), not a
// speed target: they hold on a loaded 2-core machine under AddressSanitizer
// (a clean-clone CI run measured 1.10 s and 1.74 s there; the four-`auto`
// plan takes 0.23 s in a plain build on a quiet machine).
TEST(JobSpecTest, NMaxOfTheDeepestModelIsQuick) {
  v1::JobSpec s = Good();
  s.mutable_model()->set_layers(4096);
  s.set_device_memory_bytes(int64_t{1} << 40);
  const absl::Time t0 = absl::Now();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GT(plan->n_max().batch().batch(), 0) << plan->n_max().batch().detail();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  // With all four settings `auto`, chosen again at every N searched (the
  // chooser plans each candidate): a few times that, still well inside an
  // RPC's deadline.
  {
    v1::JobSpec a = s;
    v1::ScheduleSpec* sc = a.mutable_schedule();
    sc->mutable_pipelined_llep()->set_chunk_tokens(0);
    sc->mutable_pipelined_llep()->set_chunk_tokens_auto(true);
    sc->mutable_ring_dtp()->set_strip_auto(true);
    sc->mutable_sco()->set_host_budget_bytes(0);
    sc->mutable_sco()->set_host_budget_auto(true);
    sc->mutable_offload_stream_adamw()->set_bucket_params(0);
    sc->mutable_offload_stream_adamw()->set_bucket_params_auto(true);
    sc->clear_dense();
    const absl::Time t1 = absl::Now();
    auto auto_plan = PlanJob(a);
    ASSERT_TRUE(auto_plan.ok()) << auto_plan.status();
    EXPECT_GT(auto_plan->n_max().batch().batch(), 0) << auto_plan->n_max().batch().detail();
    EXPECT_EQ(auto_plan->n_max().batch().auto_settings_size(), 4);
    const absl::Duration took = absl::Now() - t1;
    std::printf("4096 layers, four `auto` settings: PlanJob %s\n", absl::FormatDuration(took).c_str());
    EXPECT_LT(took, absl::Seconds(30));
  }
  // Huge caps: the spec's limits, not an overflow, end the search.
  s.mutable_model()->set_layers(2);
  s.set_device_memory_bytes(std::numeric_limits<int64_t>::max());
  plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const v1::NMaxAxis* a : {&plan->n_max().batch(), &plan->n_max().context()}) {
    EXPECT_THAT(a->limit(), ::testing::AnyOf("layout.batch", "model.seq_len", "refused")) << a->detail();
    EXPECT_GT(a->tokens_per_rank(), 0);
  }
}

// A job that checkpoints says in its plan what a checkpoint holds on the
// host beside the live sets (kernels/budget/budget.h): rank 0 its optimizer
// shard and one gathered chunk, the others their shard; a resume its shard.
// Nothing there scales with the full state on every rank.
TEST(JobSpecTest, APlanSaysWhatACheckpointHoldsOnTheHost) {
  v1::JobSpec s = Baseline();
  auto plain = PlanJob(s);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (const std::string& n : plain->notes()) EXPECT_THAT(n, ::testing::Not(HasSubstr("checkpoint:"))) << n;
  s.mutable_checkpoint()->set_directory("/var/lib/plateau/ckpt");
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const TrainerOptions t = ToTrainerOptions(s).value();
  const ParamLayout layout = LayoutOf(t.step);
  const int64_t rank0 = StreamStateHostBytes(t.step, layout, true), others = StreamStateHostBytes(t.step, layout, false);
  EXPECT_THAT(plan->notes(),
              ::testing::Contains(::testing::AllOf(
                  HasSubstr("checkpoint: streamed"), HasSubstr(absl::StrCat("holds ", rank0, " bytes")),
                  HasSubstr(absl::StrCat("ranks ", others, " bytes")),
                  HasSubstr(absl::StrCat("resume ", LoadStreamedStateHostBytes(layout), " bytes")))));
  int64_t full = 0;
  for (const WeightSpec& w : layout.weights()) full += 3 * 4 * w.numel();
  EXPECT_GT(rank0, others);
  EXPECT_LT(others, full);
  // And what the files take on disk: every one kept (keep_last 0), one per
  // `every` steps and the last; keep_last K holds K + 1 while a save is on.
  auto disk_note = [](const v1::MemoryPlan& p) {
    for (const std::string& n : p.notes()) {
      if (absl::StartsWith(n, "checkpoint disk: ")) return n;
    }
    return std::string("(none)");
  };
  EXPECT_THAT(disk_note(*plan), HasSubstr(absl::StrCat("each file ", full, " bytes")));
  EXPECT_THAT(disk_note(*plan), HasSubstr("writes 1, keeping every one"));
  s.set_steps(100);
  s.mutable_checkpoint()->set_every(30);  // steps 30, 60, 90 and 100
  plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(disk_note(*plan),
              HasSubstr(absl::StrCat("writes 4, keeping every one (keep_last 0): ~", 4 * full, " bytes")));
  s.mutable_checkpoint()->set_keep_last(2);
  plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(disk_note(*plan),
              HasSubstr(absl::StrCat("writes 4, at most 3 at once (keep_last 2): ~", 3 * full, " bytes")));
  // The longest job saved every step: more bytes than int64 holds, said
  // (it was an int64 product: undefined, caught by UBSan).
  s.set_steps(int64_t{1} << 40);
  s.mutable_checkpoint()->set_every(1);
  s.mutable_checkpoint()->set_keep_last(0);
  s.mutable_model()->set_expert_ffn(4096);
  plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(disk_note(*plan), HasSubstr("writes 1099511627776, keeping every one"));
  EXPECT_THAT(disk_note(*plan), ::testing::ContainsRegex("~[0-9.]+e\\+[0-9]+ bytes"));
}

// bf16 is planned on any backend (what the job would need) and runs on the
// cpu backend (its exact emulation of the CUDA bf16 kernels) with every
// schedule, the CPU-offload AdamW included; a shape the bf16 step cannot
// take is refused by validation and admission, naming its field.
TEST(JobSpecTest, Bf16IsPlannedEverywhereAndRefusedOnShapesItCannotTake) {
  v1::JobSpec s = Baseline();
  s.mutable_schedule()->mutable_dense();
  const int64_t fp32_total = PlanJob(s).value().total_bytes();
  s.set_precision(v1::PRECISION_BF16);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  EXPECT_TRUE(AdmitJob(s).ok()) << AdmitJob(s).status();
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LT(plan->total_bytes(), fp32_total);
  EXPECT_GT(plan->total_bytes(), fp32_total / 2);  // master and moments stay fp32
  EXPECT_THAT(plan->notes(), ::testing::Contains(::testing::HasSubstr("precision bf16")));
  // The step's options carry it.
  EXPECT_EQ(ToTrainerOptions(s).value().step.precision, Precision::kBf16Mixed);
  // The CPU-offload AdamW computes bf16 too (issue 17): validated,
  // admitted and planned with its state on the host (fp32 master, m, v and
  // the bf16 gradients: 14 bytes a parameter against fp32's 16), nothing of
  // it on the device.
  v1::JobSpec offload = s;
  offload.mutable_schedule()->mutable_cpu_offload_adamw();
  EXPECT_TRUE(ValidateJobSpec(offload).ok()) << ValidateJobSpec(offload);
  EXPECT_TRUE(AdmitJob(offload).ok()) << AdmitJob(offload).status();
  auto offload_plan = PlanJob(offload);
  ASSERT_TRUE(offload_plan.ok()) << offload_plan.status();
  EXPECT_LT(offload_plan->total_bytes(), plan->total_bytes());
  EXPECT_GT(offload_plan->host_total_bytes(), 0);
  v1::JobSpec offload32 = offload;
  offload32.set_precision(v1::PRECISION_FP32);
  EXPECT_EQ(offload_plan->host_total_bytes() * 16, PlanJob(offload32).value().host_total_bytes() * 14);
  // A shape the bf16 step cannot take (more experts than the hidden size:
  // the router's bf16 logit gradient borrows an [N, hidden] scratch):
  // planned, refused at submit naming model.experts, fine in fp32.
  v1::JobSpec wide = s;
  wide.mutable_model()->set_experts(2 * s.model().hidden());
  ASSERT_TRUE(PlanJob(wide).ok()) << PlanJob(wide).status();
  const absl::Status e = ValidateJobSpec(wide);
  EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(e.message(), "model.experts: ")) << e;
  EXPECT_EQ(AdmitJob(wide).status(), e);
  wide.set_precision(v1::PRECISION_FP32);
  EXPECT_TRUE(ValidateJobSpec(wide).ok()) << ValidateJobSpec(wide);
  // Explicit fp32 is the default's plan.
  s.set_precision(v1::PRECISION_FP32);
  EXPECT_TRUE(ValidateJobSpec(s).ok());
  EXPECT_EQ(PlanJob(s).value().total_bytes(), fp32_total);
  // On the cuda backend a bf16 spec validates too (that backend computes
  // bf16 as well).
  s.set_precision(v1::PRECISION_BF16);
  s.set_backend(v1::BACKEND_CUDA);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
}

// bf16_attention reaches the step's options, and the plan says which
// arithmetic attention will run in: auto takes tensor cores on cuda only
// where their kernels take the head_dim (64, 128).
TEST(JobSpecTest, Bf16AttentionIsCarriedAndNamedInThePlan) {
  v1::JobSpec s = Baseline();
  s.set_precision(v1::PRECISION_BF16);
  auto note = [](const v1::JobSpec& spec) {
    auto plan = PlanJob(spec);
    EXPECT_TRUE(plan.ok()) << plan.status();
    for (const std::string& n : plan->notes()) {
      if (absl::StartsWith(n, "bf16 attention: ")) return n;
    }
    return std::string("no note");
  };
  EXPECT_EQ(ToTrainerOptions(s).value().step.bf16_attention, Bf16Attention::kAuto);
  EXPECT_EQ(note(s), "bf16 attention: auto: tiles");
  s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE);  // the cpu's reference: any head_dim
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  EXPECT_EQ(ToTrainerOptions(s).value().step.bf16_attention, Bf16Attention::kTensorCore);
  EXPECT_TRUE(ToTrainerOptions(s).value().step.attention_wgmma);
  EXPECT_THAT(note(s), ::testing::HasSubstr("scalar reference"));
  // mma.sync only: the same arithmetic, never wgmma (the cpu ignores it).
  s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  EXPECT_EQ(ToTrainerOptions(s).value().step.bf16_attention, Bf16Attention::kTensorCore);
  EXPECT_FALSE(ToTrainerOptions(s).value().step.attention_wgmma);
  EXPECT_THAT(note(s), ::testing::HasSubstr("scalar reference"));
  s.set_bf16_attention(v1::BF16_ATTENTION_TILES);
  EXPECT_EQ(ToTrainerOptions(s).value().step.bf16_attention, Bf16Attention::kTiles);
  s.set_backend(v1::BACKEND_CUDA);
  s.set_bf16_attention(v1::BF16_ATTENTION_AUTO);
  EXPECT_THAT(note(s), ::testing::HasSubstr("auto: tiles (head_dim 16 has no tensor-core kernel"));
  s.mutable_model()->set_hidden(128 * s.model().heads());  // head_dim 128
  EXPECT_THAT(note(s), ::testing::Eq("bf16 attention: auto: tensor cores (head_dim 128)"));
  s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  EXPECT_EQ(note(s), "bf16 attention: tensor cores (wgmma on an H100/H200 where its checks agree)");
  s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  EXPECT_EQ(note(s), "bf16 attention: tensor cores, mma.sync only (no wgmma)");
  EXPECT_FALSE(ToTrainerOptions(s).value().step.attention_wgmma);
  // No note in fp32, where it does not apply.
  s.set_precision(v1::PRECISION_FP32);
  s.clear_bf16_attention();
  EXPECT_EQ(note(s), "no note");
}

struct Case {
  std::string field;  // the error must name it
  std::function<void(v1::JobSpec&)> mutate;
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kI32Min = std::numeric_limits<int32_t>::min();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Every field of JobSpec and its sub-messages, each malformed in every way
// that applies: missing (where required), negative, zero, just past its
// bound, INT64_MAX/MIN (whose products would overflow the plan), NaN and
// infinities. Each must be refused with the canonical code, naming the field
// and saying what was expected, quickly, and the same way by PlanJob and
// AdmitJob (the coordinator's submit path).
std::vector<Case> MalformedFieldCases() {
  using S = v1::JobSpec;
  using M = v1::ModelSpec;
  std::vector<Case> cases = {
      {"name", [](S& s) { s.set_name(std::string(300, 'x')); }},
      {"labels.key", [](S& s) { (*s.mutable_labels())["-team"] = "nlp"; }},
      {"labels.key", [](S& s) { (*s.mutable_labels())[std::string(64, 'k')] = "nlp"; }},
      {"labels.key", [](S& s) { (*s.mutable_labels())["Example.com/team"] = "nlp"; }},
      {"labels.value", [](S& s) { (*s.mutable_labels())["team"] = "nlp team"; }},
      {"labels.value", [](S& s) { (*s.mutable_labels())["team"] = std::string(64, 'v'); }},
      {"priority", [](S& s) { s.set_priority(1001); }},
      {"priority", [](S& s) { s.set_priority(std::numeric_limits<int32_t>::min()); }},
      {"max_duration_s", [](S& s) { s.set_max_duration_s(-1); }},
      {"max_duration_s", [](S& s) { s.set_max_duration_s(std::numeric_limits<int64_t>::max()); }},
      {"model", [](S& s) { s.clear_model(); }},
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size(1); }},
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size(10); }},  // < recall's 18
      {"model.vocab_size", [](S& s) { s.mutable_model()->set_vocab_size((int64_t{1} << 31) + 1); }},
      {"model.hidden", [](S& s) { s.mutable_model()->set_hidden(int64_t{1} << 40); }},
      {"model.heads", [](S& s) { s.mutable_model()->set_heads(5); }},
      {"model.heads", [](S& s) { s.mutable_model()->set_heads(128); }},  // more heads than hidden
      {"model.heads", [](S& s) { s.mutable_model()->set_heads(64); }},   // odd head dimension (1)
      {"model.kv_heads", [](S& s) { s.mutable_model()->set_kv_heads(3); }},
      {"model.kv_heads", [](S& s) { s.mutable_model()->set_kv_heads(8); }},  // more than heads
      {"model.experts", [](S& s) { s.mutable_model()->set_experts(3); }},    // not a multiple of ranks
      {"model.top_k", [](S& s) { s.mutable_model()->set_top_k(5); }},        // > experts
      {"model.seq_len", [](S& s) { s.mutable_model()->set_seq_len(33); }},   // not a multiple of ranks
      {"model.seq_len", [](S& s) { s.mutable_model()->set_seq_len(16); }},   // too short for recall
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(0.5f); }},
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(1.0f); }},
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(-10000); }},
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(kNaN); }},
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(kInf); }},
      {"model.rope_theta", [](S& s) { s.mutable_model()->set_rope_theta(3e38f); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(0); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(-1e-5f); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(kNaN); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(kInf); }},
      {"model.norm_eps", [](S& s) { s.mutable_model()->set_norm_eps(2); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(kNaN); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(0); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(-0.02f); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(-kInf); }},
      {"model.init_std", [](S& s) { s.mutable_model()->set_init_std(1e30f); }},
      {"layout", [](S& s) { s.clear_layout(); }},
      {"layout.ranks", [](S& s) { s.mutable_layout()->set_ranks(1 << 20); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(3); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(4); }},  // more nodes than ranks
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(-1); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(kI64Max); }},
      {"layout.nodes", [](S& s) { s.mutable_layout()->set_nodes(kI64Min); }},
      {"layout.batch", [](S& s) { s.mutable_layout()->set_batch((int64_t{1} << 20) + 1); }},
      {"optimizer", [](S& s) { s.clear_optimizer(); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->clear_lr(); }},  // required
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(-1e-3f); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(kInf); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(kNaN); }},
      {"optimizer.lr", [](S& s) { s.mutable_optimizer()->set_lr(1e4f); }},
      {"optimizer.beta1", [](S& s) { s.mutable_optimizer()->set_beta1(1.0f); }},
      {"optimizer.beta1", [](S& s) { s.mutable_optimizer()->set_beta1(-0.1f); }},
      {"optimizer.beta1", [](S& s) { s.mutable_optimizer()->set_beta1(kNaN); }},
      {"optimizer.beta2", [](S& s) { s.mutable_optimizer()->set_beta2(-0.1f); }},
      {"optimizer.beta2", [](S& s) { s.mutable_optimizer()->set_beta2(1.0f); }},
      {"optimizer.beta2", [](S& s) { s.mutable_optimizer()->set_beta2(kInf); }},
      {"optimizer.eps", [](S& s) { s.mutable_optimizer()->set_eps(0); }},
      {"optimizer.eps", [](S& s) { s.mutable_optimizer()->set_eps(-1e-8f); }},
      {"optimizer.eps", [](S& s) { s.mutable_optimizer()->set_eps(kNaN); }},
      {"optimizer.eps", [](S& s) { s.mutable_optimizer()->set_eps(2); }},
      {"optimizer.weight_decay", [](S& s) { s.mutable_optimizer()->set_weight_decay(-1); }},
      {"optimizer.weight_decay", [](S& s) { s.mutable_optimizer()->set_weight_decay(1.5f); }},
      {"optimizer.weight_decay", [](S& s) { s.mutable_optimizer()->set_weight_decay(kNaN); }},
      {"optimizer.max_grad_norm", [](S& s) { s.mutable_optimizer()->set_max_grad_norm(kNaN); }},
      {"optimizer.max_grad_norm", [](S& s) { s.mutable_optimizer()->set_max_grad_norm(-1); }},
      {"optimizer.max_grad_norm", [](S& s) { s.mutable_optimizer()->set_max_grad_norm(kInf); }},
      // The learning-rate schedule (Good() has 10 steps, lr 6e-3).
      {"optimizer.warmup_steps", [](S& s) { s.mutable_optimizer()->set_warmup_steps(11); }},  // > steps
      {"optimizer.warmup_steps", [](S& s) { s.mutable_optimizer()->set_warmup_steps(-1); }},
      {"optimizer.warmup_steps", [](S& s) { s.mutable_optimizer()->set_warmup_steps(kI64Min); }},
      {"optimizer.min_lr", [](S& s) {
         s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
         s.mutable_optimizer()->set_min_lr(-1e-4);
       }},
      {"optimizer.min_lr", [](S& s) {
         s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_LINEAR);
         s.mutable_optimizer()->set_min_lr(1e-2);  // above lr
       }},
      {"optimizer.min_lr", [](S& s) {
         s.mutable_optimizer()->set_lr_decay(v1::OptimizerSpec::LR_DECAY_COSINE);
         s.mutable_optimizer()->set_min_lr(kNaN);
       }},
      {"optimizer.min_lr", [](S& s) { s.mutable_optimizer()->set_min_lr(1e-4); }},  // constant: no floor
      {"optimizer.lr_decay",
       [](S& s) { s.mutable_optimizer()->set_lr_decay(static_cast<v1::OptimizerSpec::LrDecay>(9)); }},
      {"data", [](S& s) { s.clear_data(); }},
      {"data.recall.pairs", [](S& s) { s.mutable_data()->mutable_recall()->set_pairs(9); }},  // > num_keys
      {"data.recall.queries", [](S& s) { s.mutable_data()->mutable_recall()->set_queries(5); }},  // > pairs
      {"data.recall.num_keys", [](S& s) { s.mutable_data()->mutable_recall()->set_num_keys(int64_t{1} << 21); }},
      {"data.text.path", [](S& s) { s.mutable_data()->mutable_text()->set_path(""); }},
      {"data.text.path", [](S& s) { s.mutable_data()->mutable_text(); }},  // missing
      {"data.text.path", [](S& s) {
         s.mutable_data()->mutable_text()->set_path("relative.txt");
         s.mutable_model()->set_vocab_size(256);
       }},
      {"data.text.path", [](S& s) {
         s.mutable_data()->mutable_text()->set_path("/" + std::string(5000, 'a'));
         s.mutable_model()->set_vocab_size(256);
       }},
      {"data.text.path", [](S& s) {
         s.mutable_data()->mutable_text()->set_path(std::string("/a\0b", 4));
         s.mutable_model()->set_vocab_size(256);
       }},
      {"data.text.path", [](S& s) {
         s.mutable_data()->mutable_text()->set_path("/data/\xff\xfe.txt");
         s.mutable_model()->set_vocab_size(256);
       }},
      {"name", [](S& s) { s.set_name("caf\xc3"); }},  // truncated UTF-8
      // Control characters a terminal acts on: ESC (a colour, or worse),
      // newline, DEL, C1 CSI (U+009B).
      {"name", [](S& s) { s.set_name("run \x1b[31mRED"); }},
      {"name", [](S& s) { s.set_name("two\nlines"); }},
      {"name", [](S& s) { s.set_name("del\x7f"); }},
      {"name", [](S& s) { s.set_name("csi\xc2\x9b" "31m"); }},
      {"model.vocab_size", [](S& s) { s.mutable_data()->mutable_text()->set_path("/etc/hostname"); }},
      {"data.shards.paths", [](S& s) { s.mutable_data()->mutable_shards(); }},
      {"data.shards.paths[0]", [](S& s) { s.mutable_data()->mutable_shards()->add_paths(""); }},
      {"data.shards.paths[1]", [](S& s) {
         s.mutable_data()->mutable_shards()->add_paths("/a.bin");
         s.mutable_data()->mutable_shards()->add_paths("b.bin");
       }},
      {"data.shards.paths[0]", [](S& s) {
         s.mutable_data()->mutable_shards()->add_paths(std::string("/a\0b", 4));
       }},
      {"steps", [](S& s) { s.clear_steps(); }},  // required
      {"steps", [](S& s) { s.set_steps((int64_t{1} << 40) + 1); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_directory("ckpt"); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_every(10); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_directory("/" + std::string(5000, 'c')); }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_directory("/ckpt/\xed\xa0\x80"); }},
      {"data.shards.paths[0]", [](S& s) { s.mutable_data()->mutable_shards()->add_paths("/\xc0\xaf"); }},
      {"checkpoint.every", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_every(-1);
       }},
      {"checkpoint.every", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_every(kI64Max);
       }},
      {"checkpoint.every", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_every(kI64Min);
       }},
      {"checkpoint.keep_last", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_keep_last(-1);
       }},
      {"checkpoint.keep_last", [](S& s) {
         s.mutable_checkpoint()->set_directory("/tmp/x");
         s.mutable_checkpoint()->set_keep_last(kI64Max);
       }},
      {"checkpoint.directory", [](S& s) { s.mutable_checkpoint()->set_keep_last(3); }},
      {"validation_every", [](S& s) { s.set_validation_every(-1); }},
      {"validation_every", [](S& s) { s.set_validation_every(kI64Max); }},
      {"data.held_out_sequences", [](S& s) { s.mutable_data()->set_held_out_sequences(-1); }},
      {"data.held_out_sequences", [](S& s) {  // too few distinct sequences to split: was refused by every rank
         v1::RecallData* r = s.mutable_data()->mutable_recall();
         r->set_num_keys(1);
         r->set_num_values(1);
         r->set_pairs(1);
         r->set_queries(1);
         s.mutable_model()->set_vocab_size(4);
         s.mutable_data()->set_held_out_sequences(s.layout().batch());
         s.set_validation_every(10);
       }},
      {"data.shards.paths", [](S& s) {  // each path within its limit, 4 MB in all
         for (int i = 0; i < 1040; ++i) s.mutable_data()->mutable_shards()->add_paths("/" + std::string(3999, 'p'));
       }},
      {"data.held_out_sequences", [](S& s) { s.set_validation_every(5); }},  // none held out
      {"data.held_out_sequences", [](S& s) {
         s.set_validation_every(5);
         s.mutable_data()->set_held_out_sequences(33);  // not whole batches of 32
       }},
      {"memory_timeline_every", [](S& s) { s.set_memory_timeline_every(-1); }},
      {"memory_timeline_every", [](S& s) { s.set_memory_timeline_every(kI64Min); }},
      {"memory_timeline_every", [](S& s) { s.set_memory_timeline_every((int64_t{1} << 40) + 1); }},
      {"max_restarts", [](S& s) { s.set_max_restarts(-1); }},
      {"max_restarts", [](S& s) { s.set_max_restarts(1000); }},
      {"max_restarts", [](S& s) { s.set_max_restarts(kI32Max); }},
      {"max_restarts", [](S& s) { s.set_max_restarts(kI32Min); }},
      {"progress_timeout_s", [](S& s) { s.set_progress_timeout_s(-1); }},
      {"progress_timeout_s", [](S& s) { s.set_progress_timeout_s(7 * 24 * 3600 + 1); }},
      {"progress_timeout_s", [](S& s) { s.set_progress_timeout_s(kI64Max); }},
      {"progress_timeout_s", [](S& s) { s.set_progress_timeout_s(kI64Min); }},
      {"max_pending_s", [](S& s) { s.set_max_pending_s(-1); }},
      {"max_pending_s", [](S& s) { s.set_max_pending_s(7 * 24 * 3600 + 1); }},
      {"max_pending_s", [](S& s) { s.set_max_pending_s(kI64Max); }},
      {"max_pending_s", [](S& s) { s.set_max_pending_s(kI64Min); }},
      {"backend", [](S& s) { s.set_backend(v1::BACKEND_UNSPECIFIED); }},
      {"backend", [](S& s) { s.set_backend(static_cast<v1::Backend>(7)); }},
      {"backend", [](S& s) { s.set_backend(static_cast<v1::Backend>(-1)); }},
      {"precision", [](S& s) { s.set_precision(static_cast<v1::Precision>(7)); }},
      {"precision", [](S& s) { s.set_precision(static_cast<v1::Precision>(-1)); }},
      {"bf16_attention", [](S& s) {
         s.set_precision(v1::PRECISION_BF16);
         s.set_bf16_attention(static_cast<v1::Bf16Attention>(7));
       }},
      {"bf16_attention", [](S& s) { s.set_bf16_attention(v1::BF16_ATTENTION_TILES); }},  // fp32 job
      {"bf16_attention", [](S& s) {  // no tensor-core kernel for the baseline's head_dim on cuda
         s.set_precision(v1::PRECISION_BF16);
         s.set_backend(v1::BACKEND_CUDA);
         s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE);
       }},
      {"bf16_attention", [](S& s) {  // nor on mma.sync only
         s.set_precision(v1::PRECISION_BF16);
         s.set_backend(v1::BACKEND_CUDA);
         s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC);
       }},
      {"bf16_attention", [](S& s) {  // an fp32 job
         s.set_bf16_attention(v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC);
       }},
      {"device_memory_bytes", [](S& s) { s.set_device_memory_bytes(0); }},  // required for cpu
      {"device_memory_bytes", [](S& s) { s.set_device_memory_bytes(-1); }},
      {"device_memory_bytes", [](S& s) { s.set_device_memory_bytes(kI64Min); }},
      {"device_memory_bytes", [](S& s) {
         s.set_backend(v1::BACKEND_CUDA);
         s.set_device_memory_bytes(-1);
       }},
      {"device_memory_bytes", [](S& s) {
         s.set_backend(v1::BACKEND_CUDA);
         s.set_device_memory_bytes(kI64Min);
       }},
      {"host_memory_bytes", [](S& s) { s.set_host_memory_bytes(-1); }},
      {"host_memory_bytes", [](S& s) { s.set_host_memory_bytes(kI64Min); }},
      {"host_memory_bytes", [](S& s) {
         s.set_backend(v1::BACKEND_CUDA);
         s.set_device_memory_bytes(0);
         s.set_host_memory_bytes(-1);
       }},
      // The schedules' fields (their values are checked by the budget,
      // which names them the same way).
      {"schedule.ring_dtp.strip", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_strip(-1); }},
      {"schedule.ring_dtp.strip", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_strip(33); }},  // > vocab
      {"schedule.ring_dtp.strip", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_strip(kI64Max); }},
      {"schedule.ring_dtp.strip", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_strip(kI64Min); }},
      {"schedule.ring_dtp.row_tile", [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_row_tile(-1); }},
      {"schedule.ring_dtp.row_tile",
       [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_row_tile(kI64Max); }},
      {"schedule.ring_dtp.row_tile",
       [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_row_tile(kI64Min); }},
      {"schedule.ring_dtp.chunk_rows",
       [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_chunk_rows(-5); }},
      {"schedule.ring_dtp.chunk_rows",
       [](S& s) { s.mutable_schedule()->mutable_ring_dtp()->set_chunk_rows(kI64Max); }},
      {"schedule.ring_dtp.mode", [](S& s) {
         s.mutable_schedule()->mutable_ring_dtp()->set_mode(
             static_cast<v1::RingDtpProjection::Mode>(9));
       }},
      {"schedule.ring_dtp.mode", [](S& s) {
         s.mutable_schedule()->mutable_ring_dtp()->set_mode(
             static_cast<v1::RingDtpProjection::Mode>(-1));
       }},
      {"model.vocab_size", [](S& s) {  // Ring-DTP gives every rank a vocabulary shard
         s.mutable_schedule()->mutable_ring_dtp();
         s.mutable_model()->set_vocab_size(30);
         s.mutable_model()->set_experts(32);
         s.mutable_layout()->set_ranks(32);
         s.mutable_layout()->set_nodes(1);
         s.mutable_data()->mutable_recall()->set_num_keys(4);
         s.mutable_data()->mutable_recall()->set_num_values(4);
         s.mutable_data()->mutable_recall()->set_pairs(2);
         s.mutable_data()->mutable_recall()->set_queries(1);
       }},
      {"schedule.pipelined_llep.chunk_tokens",
       [](S& s) { s.mutable_schedule()->mutable_pipelined_llep()->set_chunk_tokens(-1); }},
      {"schedule.pipelined_llep.alpha", [](S& s) {
         s.mutable_schedule()->mutable_pipelined_llep()->set_alpha(std::numeric_limits<double>::quiet_NaN());
       }},
      {"schedule.pipelined_llep.min_piece",
       [](S& s) { s.mutable_schedule()->mutable_pipelined_llep()->set_min_piece(kI64Min); }},
      {"schedule.pipelined_llep.membership", [](S& s) {
         s.mutable_schedule()->mutable_pipelined_llep()->set_membership(
             static_cast<v1::PipelinedLlepDispatch::Membership>(7));
       }},
      {"schedule.pipelined_llep.lambda",
       [](S& s) { s.mutable_schedule()->mutable_pipelined_llep()->set_lambda(0.5); }},
      {"schedule.llep.alpha", [](S& s) { s.mutable_schedule()->mutable_llep()->set_alpha(-1); }},
      {"schedule.llep.min_piece", [](S& s) { s.mutable_schedule()->mutable_llep()->set_min_piece(-3); }},
      {"schedule.llep.lambda", [](S& s) { s.mutable_schedule()->mutable_llep()->set_lambda(INFINITY); }},
      {"schedule.llep.max_borrowed",
       [](S& s) { s.mutable_schedule()->mutable_llep()->set_max_borrowed(-1); }},
      {"schedule.pipelined_llep.max_borrowed",
       [](S& s) { s.mutable_schedule()->mutable_pipelined_llep()->set_max_borrowed(kI64Min); }},
      {"schedule.sco.host_budget_bytes",
       [](S& s) { s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(-1); }},
      {"schedule.sco.host_budget_bytes",
       [](S& s) { s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(kI64Max); }},
      {"schedule.offload_stream_adamw.bucket_params",
       [](S& s) { s.mutable_schedule()->mutable_offload_stream_adamw()->set_bucket_params(-5); }},
      {"schedule.offload_stream_adamw.staging_slots",
       [](S& s) { s.mutable_schedule()->mutable_offload_stream_adamw()->set_staging_slots(kI32Min); }},
      {"schedule.offload_stream_adamw.staging_slots",
       [](S& s) { s.mutable_schedule()->mutable_offload_stream_adamw()->set_staging_slots(4); }},
  };
  // Every integer of the model: missing (0), negative, and the extremes.
  const std::vector<std::pair<std::string, void (M::*)(int64_t)>> model_ints = {
      {"vocab_size", &M::set_vocab_size}, {"hidden", &M::set_hidden},
      {"layers", &M::set_layers},         {"heads", &M::set_heads},
      {"kv_heads", &M::set_kv_heads},     {"experts", &M::set_experts},
      {"top_k", &M::set_top_k},           {"expert_ffn", &M::set_expert_ffn},
      {"seq_len", &M::set_seq_len}};
  for (const auto& [name, set] : model_ints) {
    for (int64_t v : {int64_t{0}, int64_t{-1}, kI64Min, kI64Max, (int64_t{1} << 20) + 2}) {
      if (name == "vocab_size" && v == (int64_t{1} << 20) + 2) continue;  // a valid vocabulary
      cases.push_back({"model." + name, [set = set, v](S& s) { (s.mutable_model()->*set)(v); }});
    }
  }
  using L = v1::LayoutSpec;
  for (const auto& [name, set] : std::vector<std::pair<std::string, void (L::*)(int64_t)>>{
           {"ranks", &L::set_ranks}, {"batch", &L::set_batch}}) {
    for (int64_t v : {int64_t{0}, int64_t{-1}, kI64Min, kI64Max}) {
      cases.push_back({"layout." + name, [set = set, v](S& s) { (s.mutable_layout()->*set)(v); }});
    }
  }
  using R = v1::RecallData;
  for (const auto& [name, set] : std::vector<std::pair<std::string, void (R::*)(int64_t)>>{
           {"num_keys", &R::set_num_keys}, {"num_values", &R::set_num_values},
           {"pairs", &R::set_pairs}, {"queries", &R::set_queries}}) {
    for (int64_t v : {int64_t{0}, int64_t{-1}, kI64Min, kI64Max}) {
      cases.push_back({"data.recall." + name, [set = set, v](S& s) {
                         (s.mutable_data()->mutable_recall()->*set)(v);
                       }});
    }
  }
  for (int64_t v : {int64_t{0}, int64_t{-5}, kI64Min, kI64Max}) {
    cases.push_back({"steps", [v](S& s) { s.set_steps(v); }});
  }
  for (float v : {-kInf, kInf, kNaN}) {  // each optional float, non-finite
    cases.push_back({"optimizer.beta1", [v](S& s) { s.mutable_optimizer()->set_beta1(v); }});
    cases.push_back({"optimizer.beta2", [v](S& s) { s.mutable_optimizer()->set_beta2(v); }});
    cases.push_back({"optimizer.eps", [v](S& s) { s.mutable_optimizer()->set_eps(v); }});
    cases.push_back({"optimizer.weight_decay", [v](S& s) { s.mutable_optimizer()->set_weight_decay(v); }});
    cases.push_back({"optimizer.max_grad_norm", [v](S& s) { s.mutable_optimizer()->set_max_grad_norm(v); }});
    cases.push_back({"optimizer.lr", [v](S& s) { s.mutable_optimizer()->set_lr(v); }});
    cases.push_back({"model.rope_theta", [v](S& s) { s.mutable_model()->set_rope_theta(v); }});
    cases.push_back({"model.norm_eps", [v](S& s) { s.mutable_model()->set_norm_eps(v); }});
    cases.push_back({"model.init_std", [v](S& s) { s.mutable_model()->set_init_std(v); }});
  }
  return cases;
}

// Sizes each within its own bound whose products would overflow int64 in
// the plan (tokens per rank x experts, routed rows x hidden, the sum of the
// live sets): refused as too large, naming the model, never overflowed (the
// ASan/UBSan build of the fuzz test checks the arithmetic itself).
std::vector<Case> OverflowProneCases() {
  using S = v1::JobSpec;
  auto big_batch = [](S& s) {  // N = B*T/P = 2^39 tokens per rank
    s.mutable_layout()->set_batch(int64_t{1} << 20);
    s.mutable_model()->set_seq_len(int64_t{1} << 20);
  };
  return {
      {"model",
       [&](S& s) {  // the logits, N x V
         big_batch(s);
         s.mutable_model()->set_vocab_size(int64_t{1} << 31);
       }},
      {"model",
       [&](S& s) {  // the router's N x E, three times
         big_batch(s);
         s.mutable_model()->set_experts(int64_t{1} << 20);
         s.mutable_model()->set_hidden(2);
         s.mutable_model()->set_heads(1);
         s.mutable_model()->set_kv_heads(1);
         s.mutable_model()->set_expert_ffn(1);
       }},
      {"model",
       [](S& s) {  // the routed rows N*k x hidden in dispatch
         s.mutable_layout()->set_batch(int64_t{1} << 10);
         s.mutable_model()->set_seq_len(int64_t{1} << 11);
         s.mutable_model()->set_hidden(int64_t{1} << 20);
         s.mutable_model()->set_experts(int64_t{1} << 20);
         s.mutable_model()->set_top_k(int64_t{1} << 20);
         s.mutable_model()->set_expert_ffn(1);
       }},
      {"model",
       [&](S& s) {  // the activations: N x hidden x layers
         big_batch(s);
         s.mutable_model()->set_hidden(int64_t{1} << 18);
         s.mutable_model()->set_layers(64);
       }},
      {"model",
       [](S& s) {  // the parameters: L x E x H x F
         s.mutable_model()->set_layers(int64_t{1} << 10);
         s.mutable_model()->set_experts(int64_t{1} << 20);
         s.mutable_model()->set_hidden(int64_t{1} << 16);
         s.mutable_model()->set_expert_ffn(int64_t{1} << 16);
       }},
      {"model",
       [](S& s) {  // the rows an expert rank may receive: P x N x min(k, E/P), x expert_ffn
         s.mutable_layout()->set_ranks(16);
         s.mutable_layout()->set_batch(int64_t{1} << 17);
         s.mutable_model()->set_seq_len(int64_t{1} << 19);
         s.mutable_model()->set_hidden(16);
         s.mutable_model()->set_heads(1);
         s.mutable_model()->set_kv_heads(1);
         s.mutable_model()->set_layers(1);
         s.mutable_model()->set_experts(128);
         s.mutable_model()->set_top_k(8);
         s.mutable_model()->set_expert_ffn(int64_t{1} << 20);
         s.mutable_model()->set_vocab_size(32);
       }},
      {"model",
       [](S& s) {  // LLEP's rows: P x N x k when k >= E/P, past standard EP's bound
         s.mutable_schedule()->mutable_llep();
         s.mutable_layout()->set_ranks(64);
         s.mutable_layout()->set_batch(int64_t{1} << 13);
         s.mutable_model()->set_seq_len(int64_t{1} << 20);
         s.mutable_model()->set_hidden(int64_t{1} << 20);
         s.mutable_model()->set_layers(1);
         s.mutable_model()->set_experts(64);
         s.mutable_model()->set_top_k(64);
         s.mutable_model()->set_expert_ffn(int64_t{1} << 20);
         s.mutable_model()->set_vocab_size(32);
       }},
      {"model.layers",
       [](S& s) {  // a layer count that only a typo makes
         s.mutable_model()->set_layers(int64_t{1} << 20);
       }},
  };
}

void ExpectRefused(const Case& c, const v1::JobSpec& s) {
  SCOPED_TRACE(c.field);
  const absl::Time t0 = absl::Now();
  absl::Status st = ValidateJobSpec(s);
  EXPECT_EQ(st.code(), c.code) << st;
  EXPECT_THAT(st.message(), HasSubstr(c.field + ":")) << st;
  if (c.code == absl::StatusCode::kInvalidArgument) {
    EXPECT_THAT(std::string(st.message()), ::testing::ContainsRegex("expected|too large")) << st;
  }
  // The plan and admission refuse it the same way, and never crash.
  EXPECT_EQ(PlanJob(s).status(), st);
  EXPECT_EQ(AdmitJob(s).status(), st);
  // Refusing is cheap: the coordinator does it on the RPC thread (a spec
  // of 2^20 layers once took 15 s; 3 s leaves room for ASan on 2 loaded
  // cores).
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << st;
}

TEST(JobSpecTest, EveryMalformedFieldIsRefusedNamingIt) {
  for (const Case& c : MalformedFieldCases()) {
    v1::JobSpec s = Good();
    c.mutate(s);
    ExpectRefused(c, s);
  }
}

void LeafFields(const google::protobuf::Descriptor* d, const std::string& prefix, std::vector<std::string>* out) {
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    const std::string name = prefix + f->name();
    if (f->message_type() != nullptr && f->message_type()->field_count() > 0) {
      LeafFields(f->message_type(), name + ".", out);
    } else {
      out->push_back(name);
    }
  }
}

// The table above covers every field JobSpec has: a field added to the
// proto fails here until it has a malformed case (or is listed below with
// the reason any value is valid).
TEST(JobSpecTest, TheTableCoversEveryFieldOfTheSpec) {
  const std::map<std::string, std::string> any_value_is_valid = {
      {"seed", "any uint64 seeds the initialisation"},
      {"force_launch", "a bool: both values are valid"},
      {"schedule.keep_attention", "a bool: both values are valid, with either checkpoint schedule"},
      {"optimizer.reschedule_on_resume", "a bool: both values are valid"},
      {"data.recall.seed", "any uint64 seeds the task"},
      {"schedule.standard_ep", "the baseline's empty marker"},
      {"schedule.dense", "the baseline's empty marker"},
      {"schedule.full_checkpoints", "the baseline's empty marker"},
      {"schedule.device_adamw", "the baseline's empty marker"},
      {"schedule.cpu_offload_adamw", "the CPU-offload baseline's empty marker"},
      // `auto` beside a value is refused naming the value's field (worker/auto_spec_test).
      {"schedule.pipelined_llep.chunk_tokens_auto", "a bool: both values are valid alone"},
      {"schedule.ring_dtp.strip_auto", "a bool: both values are valid alone"},
      {"schedule.sco.host_budget_auto", "a bool: both values are valid alone"},
      {"schedule.offload_stream_adamw.bucket_params_auto", "a bool: both values are valid alone"},
  };
  std::set<std::string> named;
  for (const Case& c : MalformedFieldCases()) named.insert(c.field.substr(0, c.field.find('[')));
  std::vector<std::string> leaves;
  LeafFields(v1::JobSpec::descriptor(), "", &leaves);
  for (const std::string& leaf : leaves) {
    EXPECT_TRUE(any_value_is_valid.count(leaf) || named.count(leaf))
        << leaf << " has no malformed case in MalformedFieldCases()";
  }
  EXPECT_GT(leaves.size(), 40u);
}

TEST(JobSpecTest, SizesWhoseProductsOverflowAreRefusedNotOverflowed) {
  for (const Case& c : OverflowProneCases()) {
    v1::JobSpec s = Good();
    c.mutate(s);
    ExpectRefused(c, s);
  }
}

// The largest job the bounds let through still plans without overflow: the
// live sets are non-negative and sum to the total.
TEST(JobSpecTest, TheLargestAdmissibleSizesPlanConsistently) {
  v1::JobSpec s = Good();
  s.mutable_model()->set_hidden(int64_t{1} << 16);
  s.mutable_model()->set_expert_ffn(int64_t{1} << 16);
  s.mutable_model()->set_experts(int64_t{1} << 10);
  s.mutable_model()->set_top_k(int64_t{1} << 10);
  s.mutable_model()->set_layers(8);
  s.mutable_layout()->set_batch(int64_t{1} << 10);
  s.mutable_model()->set_seq_len(int64_t{1} << 10);
  auto plan = PlanJob(s);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int64_t sum = 0;
  for (const auto& ls : plan->live_sets()) {
    EXPECT_GE(ls.bytes(), 0) << ls.live_set();
    sum += ls.bytes();
  }
  EXPECT_EQ(sum, plan->total_bytes());
  EXPECT_GT(plan->total_bytes(), int64_t{1} << 40);
  EXPECT_GT(plan->parameters(), 0);
  EXPECT_GT(plan->active_parameters(), 0);
  EXPECT_GT(plan->model_flops_per_step(), 0);
}

// Unset optional fields and the baseline schedules are valid: the table
// above refuses values, never the absence of an optional field.
TEST(JobSpecTest, OptionalFieldsAndBaselineSchedulesMayBeUnsetOrExplicit) {
  v1::JobSpec s = Good();
  s.clear_name();
  s.clear_schedule();
  s.clear_checkpoint();
  s.clear_seed();
  s.mutable_layout()->clear_nodes();
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_schedule()->mutable_standard_ep();
  s.mutable_schedule()->mutable_dense();
  s.mutable_schedule()->mutable_full_checkpoints();
  s.mutable_schedule()->mutable_device_adamw();
  s.set_seed(std::numeric_limits<uint64_t>::max());
  s.mutable_data()->mutable_recall()->set_seed(0);
  s.set_max_restarts(100);
  s.set_max_pending_s(7 * 24 * 3600);
  s.mutable_optimizer()->set_beta1(0);
  s.mutable_optimizer()->set_max_grad_norm(0);
  s.mutable_optimizer()->set_weight_decay(1);
  s.mutable_model()->set_rope_theta(500000);
  s.set_steps(int64_t{1} << 40);
  s.set_device_memory_bytes(kI64Max);
  s.set_host_memory_bytes(kI64Max);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.set_backend(v1::BACKEND_CUDA);
  s.set_device_memory_bytes(0);  // CUDA: the whole card
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
}

TEST(JobSpecTest, RingDtpBecomesTheStepsProjection) {
  v1::JobSpec s = Good();
  auto* r = s.mutable_schedule()->mutable_ring_dtp();
  r->set_mode(v1::RingDtpProjection::MODE_WEIGHTS);
  r->set_strip(8);
  auto t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->step.projection.kind, ProjectionOptions::Kind::kRingDtp);
  ASSERT_TRUE(t->step.projection.mode.has_value());
  EXPECT_EQ(*t->step.projection.mode, RingDtpMode::kWeights);
  EXPECT_EQ(t->step.projection.strip, 8);
  r->set_mode(v1::RingDtpProjection::MODE_UNSPECIFIED);
  r->set_strip(0);
  t = ToTrainerOptions(s);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->step.projection.mode.has_value());  // the smaller traveller
  EXPECT_GT(t->step.projection.strip, 0);
}

}  // namespace
}  // namespace plateau
