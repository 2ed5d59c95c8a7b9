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

}  // namespace
}  // namespace plateau
