// N_max is tight on the real step (issue 15): under a capped CPU arena (and
// a host cap), the step at N_max completes, and at N_max + one step
// TrainingStep::Create refuses it naming the live set. With PipelinedLLEP
// every live set is launch-sized, so Create sees the whole plan; the
// budget's own tightness (against PlanMemory, all 16 combinations) is
// kernels/budget/n_max_test.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/budget/auto_settings.h"
#include "kernels/budget/budget.h"
#include "kernels/budget/n_max.h"
#include "kernels/communicator.h"
#include "kernels/step/capped_step_testing.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 2;

StepOptions PipelinedOnly() {
  StepOptions o;
  o.model = TinyModel();
  o.model.vocab_size = 40;
  o.model.layers = 3;
  o.model.seq_len = 16;
  o.layout = {kRanks, 2};
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.chunk_tokens = 24;
  o.dispatch.pipelined.balance.min_piece = 4;
  return o;
}

StepOptions AllOn() {
  StepOptions o = PipelinedOnly();
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.strip = 7;
  o.projection.row_tile = 16;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.checkpoints.host_budget_bytes = 8192;
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  o.optimizer_placement.bucket_params = 500;
  return o;
}

// One optimizer step of `o` on kRanks rank threads under `caps`; the first
// rank's error, or OK.
absl::Status RunOneStep(const StepOptions& o, const FitCaps& caps) {
  return RunOneStepUnderCaps(o, kRanks, caps.device_bytes, caps.host_bytes, /*seed=*/5, "n_max");
}

void ExpectTightOnTheStep(const StepOptions& o, const FitCaps& caps) {
  NMaxLimits limits;
  limits.max_batch = 64;
  limits.max_seq_len = 512;
  auto n = SolveNMax(o, caps, limits);
  ASSERT_TRUE(n.ok()) << n.status();
  ASSERT_EQ(n->batch.limit, "device_memory_bytes") << n->batch.detail;
  ASSERT_EQ(n->context.limit, "device_memory_bytes") << n->context.detail;

  StepOptions at = o, over = o;
  at.layout.batch = n->batch.batch;
  over.layout.batch = n->batch.batch + 1;
  EXPECT_TRUE(RunOneStep(at, caps).ok()) << "batch " << at.layout.batch << ": " << RunOneStep(at, caps);
  absl::Status refused = RunOneStep(over, caps);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;

  at = o;
  over = o;
  at.model.seq_len = n->context.seq_len;
  over.model.seq_len = n->context.seq_len + kRanks;
  EXPECT_TRUE(RunOneStep(at, caps).ok()) << "seq_len " << at.model.seq_len << ": " << RunOneStep(at, caps);
  refused = RunOneStep(over, caps);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
}

TEST(StepNMaxTest, PipelinedLlepStepAtNMaxRunsAndOneStepMoreIsRefused) {
  const StepOptions o = PipelinedOnly();
  // A cap a little under the plan at batch 12: the boundary falls inside a
  // step of the batch.
  StepOptions at12 = o;
  at12.layout.batch = 12;
  ExpectTightOnTheStep(o, {PlanMemory(at12).value().total() - 64, 0});
}

TEST(StepNMaxTest, AllFourSchedulesUnderADeviceAndAHostCap) {
  const StepOptions o = AllOn();
  StepOptions at12 = o;
  at12.layout.batch = 12;
  const MemoryPlan plan = PlanMemory(at12).value();
  ExpectTightOnTheStep(o, {plan.total() - 64, 2 * plan.host_total()});
}

// The four settings left `auto`, chosen again at each N the search plans
// (auto_settings.h SolveNMaxAuto): at N_max the chooser's values run under
// both caps, and one step more is refused even at the settings with the
// smallest plan (no combination fits there).
TEST(StepNMaxTest, AutoSettingsChosenAtEachN) {
  const StepOptions o = AllOn();
  const AutoRequest all{true, true, true, true};
  const Calibration cal = DefaultCalibration(CalibrationBackend::kCpu);
  StepOptions at12 = o;
  at12.layout.batch = 12;
  const MemoryPlan plan = PlanMemory(at12).value();
  const FitCaps caps{plan.total() - 64, 2 * plan.host_total()};
  NMaxLimits limits;
  limits.max_batch = 64;
  limits.max_seq_len = 512;
  auto n = SolveNMaxAuto(o, all, cal, caps, limits);
  ASSERT_TRUE(n.ok()) << n.status();
  const ShapePlan chosen = AutoShapePlan(all, cal, caps);
  for (bool batch_axis : {true, false}) {
    const NMaxAxis& axis = batch_axis ? n->batch : n->context;
    SCOPED_TRACE(batch_axis ? "batch axis" : "context axis");
    ASSERT_NE(axis.limit, "layout.batch") << axis.detail;
    ASSERT_NE(axis.limit, "model.seq_len") << axis.detail;
    ASSERT_GT(axis.tokens_per_rank, 0) << axis.detail;
    StepOptions at = o;
    at.layout.batch = axis.batch;
    at.model.seq_len = axis.seq_len;
    ASSERT_TRUE(chosen(&at).ok());
    ASSERT_EQ(AutoValues(at, all), axis.auto_values);
    const absl::Status ran = RunOneStep(at, caps);
    EXPECT_TRUE(ran.ok()) << ran;
    StepOptions over = o;
    over.layout.batch = axis.batch + (batch_axis ? 1 : 0);
    over.model.seq_len = axis.seq_len + (batch_axis ? 0 : kRanks);
    ASSERT_FALSE(ChooseAutoSettings(over, all, cal, caps).ok());
    auto smallest = SmallestAutoSettings(over, all);
    ASSERT_TRUE(smallest.ok()) << smallest.status();
    const absl::Status refused = RunOneStep(*smallest, caps);
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  }
}

}  // namespace
}  // namespace plateau
