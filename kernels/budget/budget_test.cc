// The budget is computed without a backend and is the sum of its parts: the
// step's launch list, the projection schedule's bound and the dispatch's
// worst case. (kernels/model/step_test holds the measured peaks to it.)
#include "kernels/budget/budget.h"

#include <set>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/budget/n_max.h"
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

// bf16 mixed precision, each live set by hand at the tiny model (V 32,
// H 16, L 2, 4 heads / 2 KV heads of dim 4, E 4 top-2, F 24, T 16) on P = 2
// ranks with B = 2 (N = 16 tokens per rank). Parameters: dense = embedding
// 512 + 2 layers x (norms 32, wq 256, wk 128, wv 128, wo 256, router 64)
// + final norm 16 + lm_head 512 = 2768, shard S = 1384; owned X = 2
// experts x 3 x 16 x 24 x 2 layers = 4608 per rank.
TEST(BudgetTest, Bf16MixedLiveSetsByHandAllOff) {
  StepOptions o;
  o.model = TinyModel();
  o.layout = {2, 2};
  o.precision = Precision::kBf16Mixed;
  const MemoryPlan plan = PlanMemory(o).value();
  auto at = [&](LiveSet s) { return plan.bytes[static_cast<int>(s)]; };
  // Working dense weights D and owned X in bf16.
  EXPECT_EQ(at(LiveSet::kWeights), (2768 + 4608) * 2);
  // Gradients D, shard S and owned X in bf16.
  EXPECT_EQ(at(LiveSet::kGrads), (2768 + 1384 + 4608) * 2);
  // fp32 master, m, v of the shard, and of the owned weights (which now
  // need their own master): 3 x (1384 + 4608) x 4.
  EXPECT_EQ(at(LiveSet::kOptimizer), 3 * (1384 + 4608) * 4);
  // Activations: int32 tokens, targets [N] and chosen [N k]: 64 words;
  // bf16: a, h1, u, z, dh, dh1, du, tmp [N H] (8 x 256), q, dO, dq [N 16]
  // (3 x 256), kv, dkv [2 N 8] (2 x 256), the two forward travellers
  // [2 x 2 N 8] (512) and the backward travellers' K, V (512): 4352 values;
  // fp32: 3 rstd [N] (48), m and l [N heads] x 2 (128), the running
  // attention output o [N 16] (256: online-softmax state, precision.h),
  // lse and delta (64 + 64), router logits, probs and their gradient [N E]
  // (3 x 64), gates and their gradient [N k] (2 x 32), the backward
  // travellers' dK, dV (512): 1328 values; and the attention scratch
  // (attention_shape.h): 4 slots (a task per sequence and K/V head, one
  // query tile each: 2 x 2 x 1) of two 8 x 8 tiles and the K, V tiles
  // transposed (2 x 4 x 8): 4 x 192 = 768 values.
  EXPECT_EQ(at(LiveSet::kActivations), 64 * 4 + 4352 * 2 + (1328 + 768) * 4);
  // L + 1 = 3 boundaries [N, H] in bf16.
  EXPECT_EQ(at(LiveSet::kCheckpoints), 3 * 16 * 16 * 2);
  // Dense logits [N, V] in bf16, the log-sum-exp [N] in fp32.
  EXPECT_EQ(at(LiveSet::kProjection), 16 * 32 * 2 + 16 * 4);
  // Standard EP's worst case, its backward: S = N k = 32 routes sent, R =
  // P N min(k, E/P) = 64 rows received; int32 indices 3S + 2R, fp32 gates
  // [S]; bf16 x, drecv, dy [R, H], six [R, F], returned and dsend [S, H].
  EXPECT_EQ(at(LiveSet::kDispatch), (3 * 32 + 2 * 64) * 4 + 32 * 4 +
                                        (3 * 64 * 16 + 6 * 64 * 24 + 2 * 32 * 16) * 2);
  EXPECT_EQ(at(LiveSet::kWorkspace), 2 * 8 + 2 * 4);
  EXPECT_EQ(plan.host_total(), 0);
  // The CPU-offload baseline: nothing on the device; on the host fp32
  // parameters (the dense and the owned weights' masters), m and v and the
  // bf16 gradients copied down (which carry the working copies back up),
  // per value of S + X. The step computes it in bf16 (issue 17).
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kCpuOffload;
  const MemoryPlan offload = PlanMemory(o).value();
  EXPECT_EQ(offload.bytes[static_cast<int>(LiveSet::kOptimizer)], 0);
  EXPECT_EQ(offload.host_bytes[static_cast<int>(LiveSet::kOptimizer)], (3 * 4 + 2) * (1384 + 4608));
  EXPECT_TRUE(CheckBf16Schedules(o).ok()) << CheckBf16Schedules(o);
}

// Under bf16 every schedule runs; the one shape refused names its field,
// and fp32 takes it.
TEST(BudgetTest, CheckBf16SchedulesRefusesOnlyTooManyExperts) {
  StepOptions o;
  o.model = TinyModel();
  o.layout = {2, 2};
  o.precision = Precision::kBf16Mixed;
  using Kind = OptimizerPlacementOptions::Kind;
  for (Kind k : {Kind::kDevice, Kind::kOffloadStream, Kind::kCpuOffload}) {
    o.optimizer_placement.kind = k;
    EXPECT_TRUE(CheckBf16Schedules(o).ok()) << static_cast<int>(k);
  }
  o.model.experts = o.model.hidden + 2;
  const absl::Status s = CheckBf16Schedules(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "model.experts: ")) << s;
  o.precision = Precision::kFp32;
  EXPECT_TRUE(CheckBf16Schedules(o).ok());
}

// The same shape with all four schedules on. Under Ring-DTP the lm_head is
// owned by vocabulary shard: dense 2768 - 512 = 2256, S = 1128, owned X =
// 4608 + 16 rows x 16 = 4864.
TEST(BudgetTest, Bf16MixedLiveSetsByHandAllOn) {
  StepOptions o;
  o.model = TinyModel();
  o.layout = {2, 2};
  o.precision = Precision::kBf16Mixed;
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.chunk_tokens = 8;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.checkpoints.host_budget_bytes = 16 * 16 * 2;  // one bf16 boundary (half of an fp32 one)
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  o.optimizer_placement.bucket_params = 100;
  o.optimizer_placement.staging_slots = 2;
  const MemoryPlan plan = PlanMemory(o).value();
  auto at = [&](LiveSet s) { return plan.bytes[static_cast<int>(s)]; };
  auto host = [&](LiveSet s) { return plan.host_bytes[static_cast<int>(s)]; };
  EXPECT_EQ(at(LiveSet::kWeights), (2256 + 4864) * 2);
  EXPECT_EQ(at(LiveSet::kGrads), (2256 + 1128 + 4864) * 2);
  // Two staging slots of one bucket's fp32 master, m, v on the device; the
  // fp32 master, m, v of shard and owned weights on the host.
  EXPECT_EQ(at(LiveSet::kOptimizer), 2 * 3 * 100 * 4);
  EXPECT_EQ(host(LiveSet::kOptimizer), 3 * (1128 + 4864) * 4);
  // SCO: the 512-byte budget holds h_0 in bf16 (it would hold nothing in
  // fp32); the device keeps the other two.
  EXPECT_EQ(at(LiveSet::kCheckpoints), 2 * 16 * 16 * 2);
  EXPECT_EQ(host(LiveSet::kCheckpoints), 16 * 16 * 2);
  // Ring-DTP in activation mode (N = 16 <= V / P): the strip tile
  // min(N, 2048) x min(1024, ceil(V / P)) = 16 x 16 (a strip never spans
  // two shards) in bf16; three slots, each the larger of a traveller (X
  // [N, H] bf16 with its targets int32 and lse fp32: 640 bytes) and the
  // travelling dX accumulator ([N, H] fp32: 1,024 bytes); the running state
  // 2 x 3N and lse [N] in fp32; the home dW accumulator [ceil(V / P), H]
  // fp32.
  EXPECT_EQ(at(LiveSet::kProjection), 16 * 16 * 2 + 3 * 16 * 16 * 4 + (6 * 16 + 16) * 4 + 16 * 16 * 4);
  // PipelinedLLEP with c = 8: K = 2 chunks; counts int64 1 + (1 + P) K E =
  // 25; per slot n = 8 tokens, S = 16 routes, R = P S = 32 rows, nothing
  // borrowed (min_piece 1024 > 32); int32 indices 3S + 2R + n + S = 136;
  // fp32 gates 3S; bf16 send [S, H], recv, x, t [R, H], five [R, F], the
  // token rows [n, H]. The host stages both chunks' indices (int32) and
  // keeps each of the 2 layers' K and gathered counts [P][K][E] for its
  // recompute (int32, 1 + 2 x 2 x 4 = 17 words a layer); the planner holds
  // the layer's routes [N k] int32, the counts [P + 1][K][E] (everyone's and
  // its own) and one chunk's [P + 1][E] int64. With K > 1 under bf16, the
  // fp32 accumulators of the E_p = 2 own experts' three matrices and one
  // helper's matrix loaded at a time, (3 x 2 + 1) H F.
  EXPECT_EQ(at(LiveSet::kDispatch), 25 * 8 + 136 * 4 + 3 * 16 * 4 + (16 * 16 + 3 * 32 * 16 + 5 * 32 * 24 + 8 * 16) * 2 +
                                        (3 * 2 + 1) * 16 * 24 * 4);
  EXPECT_EQ(host(LiveSet::kDispatch), 2 * 136 * 4 + 2 * 17 * 4 + 16 * 2 * 4 + (3 * 2 * 4 + 3 * 4) * 8);
}

// Keeping attention's forward (CheckpointOptions::keep_attention) adds its
// records to the device's kCheckpoints and nothing else: 2 layers x N = 16
// tokens x (o: heads d = 16, lse: heads = 4) fp32 = 2,560 bytes, in either
// precision (o and lse are fp32 in both); with 2 layers SCO can pool none
// (the last two records never leave the slots), whatever beta.
TEST(BudgetTest, KeptAttentionIsItsRecordsInCheckpoints) {
  for (Precision precision : {Precision::kFp32, Precision::kBf16Mixed}) {
    for (bool sco : {false, true}) {
      StepOptions o;
      o.model = TinyModel();
      o.layout = {2, 2};
      o.precision = precision;
      if (sco) {
        o.checkpoints.kind = CheckpointOptions::Kind::kSco;
        o.checkpoints.host_budget_bytes = int64_t{1} << 40;
      }
      const MemoryPlan recompute = PlanMemory(o).value();
      o.checkpoints.keep_attention = true;
      const MemoryPlan kept = PlanMemory(o).value();
      for (int i = 0; i < kNumLiveSets; ++i) {
        const int64_t added = static_cast<LiveSet>(i) == LiveSet::kCheckpoints ? 2 * 16 * (16 + 4) * 4 : 0;
        EXPECT_EQ(kept.bytes[i] - recompute.bytes[i], added) << LiveSetName(static_cast<LiveSet>(i)) << " sco " << sco;
        EXPECT_EQ(kept.host_bytes[i], recompute.host_bytes[i]) << LiveSetName(static_cast<LiveSet>(i));
      }
    }
  }
}

// Under SCO one beta pools the boundaries first, then whole attention
// records, at most L - 2 of them (PlanScoPools). L = 4, N = 16, H = 16: a
// bf16 boundary is 512 bytes, a record 16 x (16 + 4) x 4 = 1,280; beta
// covering the three boundaries that can leave and 1.5 records pools one
// record; enough for all pools two; the device keeps the other two records
// (the slots).
TEST(BudgetTest, ScoPoolsTheBoundariesFirstThenWholeAttentionRecords) {
  StepOptions o;
  o.model = TinyModel();
  o.model.layers = 4;
  o.layout = {2, 2};
  o.precision = Precision::kBf16Mixed;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.checkpoints.keep_attention = true;
  auto checkpoints = [&](int64_t beta) {
    o.checkpoints.host_budget_bytes = beta;
    const MemoryPlan p = PlanMemory(o).value();
    return std::make_pair(p.bytes[static_cast<int>(LiveSet::kCheckpoints)],
                          p.host_bytes[static_cast<int>(LiveSet::kCheckpoints)]);
  };
  const int64_t b = 16 * 16 * 2, r = 16 * 20 * 4;
  EXPECT_EQ(checkpoints(0), std::make_pair(5 * b + 4 * r, int64_t{0}));
  // A record's bytes (2.5 boundaries) pool two boundaries, no record: the
  // boundaries come first.
  EXPECT_EQ(checkpoints(r), std::make_pair(3 * b + 4 * r, 2 * b));
  EXPECT_EQ(checkpoints(3 * b + r + r / 2), std::make_pair(2 * b + 3 * r, 3 * b + r));
  EXPECT_EQ(checkpoints(int64_t{1} << 40), std::make_pair(2 * b + 2 * r, 3 * b + 2 * r));
  EXPECT_EQ(CheckpointPools(o).records.host_boundaries, 2);
}

// Halving the working bytes lengthens the context that fits: at a cap the
// fp32 plan fills, bf16 fits a longer one, with every schedule off and on.
TEST(BudgetTest, NMaxGrowsUnderBf16) {
  for (bool all_on : {false, true}) {
    StepOptions o = Small(2);
    if (all_on) {
      o.projection.kind = ProjectionOptions::Kind::kRingDtp;
      o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
      o.dispatch.pipelined.chunk_tokens = 8;
      o.checkpoints.kind = CheckpointOptions::Kind::kSco;
      o.checkpoints.host_budget_bytes = int64_t{1} << 20;
      o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
      o.optimizer_placement.bucket_params = 1000;
    }
    const FitCaps caps{int64_t{4} << 20, 0};
    NMaxLimits limits;
    limits.max_batch = limits.max_seq_len = int64_t{1} << 16;
    const NMax fp32 = SolveNMax(o, caps, limits).value();
    o.precision = Precision::kBf16Mixed;
    const NMax bf16 = SolveNMax(o, caps, limits).value();
    ASSERT_GT(fp32.context.tokens_per_rank, 0) << "all_on=" << all_on;
    EXPECT_EQ(fp32.context.limit, "device_memory_bytes") << "all_on=" << all_on;
    EXPECT_GT(bf16.context.seq_len, fp32.context.seq_len) << "all_on=" << all_on;
    EXPECT_GT(bf16.batch.batch, fp32.batch.batch) << "all_on=" << all_on;
  }
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
