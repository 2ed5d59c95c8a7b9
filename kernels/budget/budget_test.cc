// The budget is computed without a backend and is the sum of its parts: the
// step's launch list, the projection schedule's bound and the dispatch's
// worst case. (kernels/model/step_test holds the measured peaks to it.)
#include "kernels/budget/budget.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/model/params.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/projection/projection_plan.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

StepOptions Small(int64_t ranks) {
  StepOptions o;
  o.model = TinyModel();
  o.model.vocab_size = 40;
  o.model.layers = 3;
  o.model.seq_len = 32;
  o.layout = {ranks, 2};
  return o;
}

TEST(BudgetTest, PlanIsTheSumOfTheLaunchListAndTheSchedulesBounds) {
  for (int64_t P : {1, 2, 4}) {
    for (bool ring : {false, true}) {
      StepOptions o = Small(P);
      if (ring) o.projection.kind = ProjectionOptions::Kind::kRingDtp;
      auto plan = PlanMemory(o);
      ASSERT_TRUE(plan.ok()) << plan.status();
      std::array<int64_t, kNumLiveSets> launch{};
      std::set<std::string> names;
      for (const StepBufferSpec& b : StepLaunchBuffers(o)) {
        EXPECT_TRUE(names.insert(b.name).second) << "two launch buffers named " << b.name;
        EXPECT_GE(b.bytes, 0) << b.name;
        launch[static_cast<int>(b.set)] += b.bytes;
      }
      const int64_t N = TokensPerRank(o.model, o.layout);
      const int64_t projection =
          ring ? RingDtpBoundBytes(RingDtpConfigOf(o), P) : DenseProjectionBoundBytes(N, o.model.vocab_size);
      const int64_t S = N * o.model.top_k;
      const int64_t dispatch =
          StandardEpPeakBytes(o.model, S, StandardEpWorstCaseReceivedRows(o.model, P, N));
      for (int i = 0; i < kNumLiveSets; ++i) {
        const LiveSet s = static_cast<LiveSet>(i);
        const int64_t checkpoints = FullCheckpointsBytes(o.model.layers, N, o.model.hidden);
        const ParamLayout layout = LayoutOf(o);
        const int64_t optimizer = DeviceAdamWBytes(layout.shard_numel(), layout.owned_numel_per_rank());
        const int64_t extra = s == LiveSet::kProjection    ? projection
                              : s == LiveSet::kDispatch    ? dispatch
                              : s == LiveSet::kCheckpoints ? checkpoints
                              : s == LiveSet::kOptimizer   ? optimizer
                                                           : 0;
        EXPECT_EQ(plan->bytes[i], launch[i] + extra) << "P=" << P << " " << LiveSetName(s);
      }
      EXPECT_EQ(plan->dispatch_balanced_bytes, StandardEpPeakBytes(o.model, S, S));
      // The worst case receives every route of every rank that one rank can
      // hold: P * N * min(k, E/P).
      EXPECT_EQ(StandardEpWorstCaseReceivedRows(o.model, P, N), P * N * std::min<int64_t>(2, 4 / P));
      EXPECT_GE(plan->bytes[static_cast<int>(LiveSet::kDispatch)], plan->dispatch_balanced_bytes);
    }
  }
}

// Under Ring-DTP a rank holds only its vocabulary shard of lm_head. Growing
// V from 400 to 4000 at P = 4 (H = 16):
// - the embedding [V, H] is a ZeRO-sharded dense weight in both stacks: its
//   all-gathered working copy and full-size gradient cost 8 bytes per value
//   on every rank, its gradient shard, master and moments 16 / P;
// - an lm_head in the dense weights costs the same again;
// - a vocabulary-sharded lm_head costs 16 bytes per value of the largest
//   shard, ceil(V / P) x H (working weights, gradient, m, v), and nothing
//   per value of the other shards.
// (V x H is a multiple of P here, so the ZeRO padding does not change.)
TEST(BudgetTest, RingDtpPersistentTermsGrowWithTheVocabularyShardOnly) {
  const int64_t P = 4, H = Small(P).model.hidden;
  auto persistent = [&](int64_t vocab, bool ring) {
    StepOptions o = Small(P);
    o.model.vocab_size = vocab;
    if (ring) o.projection.kind = ProjectionOptions::Kind::kRingDtp;
    MemoryPlan plan = PlanMemory(o).value();
    return plan.bytes[static_cast<int>(LiveSet::kWeights)] + plan.bytes[static_cast<int>(LiveSet::kGrads)] +
           plan.bytes[static_cast<int>(LiveSet::kOptimizer)];
  };
  const int64_t embedding = (8 + 16 / P) * (4000 - 400) * H;
  EXPECT_EQ(persistent(4000, false) - persistent(400, false), 2 * embedding);
  EXPECT_EQ(persistent(4000, true) - persistent(400, true), embedding + 16 * (1000 - 100) * H);
}

// The plan with the layout given (what the N_max search reuses across
// shapes) is the plan; a layout of other options is refused.
TEST(BudgetTest, PlanWithTheLayoutGivenIsThePlan) {
  StepOptions o = Small(2);
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  const ParamLayout layout = LayoutOf(o);
  for (int64_t batch : {1, 2, 7}) {
    o.layout.batch = batch;
    EXPECT_EQ(PlanMemory(o, layout).value().bytes, PlanMemory(o).value().bytes);
  }
  StepOptions dense = o;
  dense.projection.kind = ProjectionOptions::Kind::kDense;
  EXPECT_EQ(PlanMemory(dense, layout).status().code(), absl::StatusCode::kInvalidArgument);
  StepOptions deeper = o;
  deeper.model.layers = 4;
  EXPECT_EQ(PlanMemory(deeper, layout).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BudgetTest, BadOptionsAreRefusedNamingTheSpecField) {
  StepOptions o = Small(2);
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.strip = 0;
  EXPECT_THAT(PlanMemory(o).status().message(), HasSubstr("projection.ring_dtp.strip"));
  o = Small(2);
  o.model.heads = 3;
  EXPECT_EQ(PlanMemory(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(PlanMemory(o).status().message(), HasSubstr("model.heads"));
}

}  // namespace
}  // namespace plateau
