#include "kernels/step/step.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/reference.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/rank_slice.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

ModelConfig TestModel() { return TinyModel(); }

// Rank p's slice [B, T/P] of a global batch.
void Slice(const GlobalBatch& g, int64_t B, int64_t T, int64_t p, int64_t P,
           std::vector<int32_t>* tok, std::vector<int32_t>* tgt) {
  *tok = RankSlice(g.tokens, B, T, p, P);
  *tgt = RankSlice(g.targets, B, T, p, P);
}

// Runs fn on P rank threads (kernels/testing/local_world.h); gtest
// assertions inside fn report as usual.
void RunRanks(int P, const std::function<void(int, Backend&, Communicator&)>& fn,
              int64_t device_bytes = 64 << 20) {
  absl::Status s = RunLocalWorld(P, device_bytes, FreshStoreDir("step"),
                                 [&](int r, Backend& be, Communicator& world) {
                                   fn(r, be, world);
                                   return absl::OkStatus();
                                 });
  ASSERT_TRUE(s.ok()) << s;
}

struct RankResult {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  StepStats stats;
};

RankResult RunForwardBackward(const ModelConfig& m, int P, int64_t B, const GlobalBatch& g,
                              const ProjectionOptions& projection = {}) {
  RankResult result;
  RunRanks(P, [&](int r, Backend& be, Communicator& world) {
    StepOptions o;
    o.model = m;
    o.layout = {P, B};
    o.seed = 5;
    o.projection = projection;
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    std::vector<int32_t> tok, tgt;
    Slice(g, B, m.seq_len, r, P, &tok, &tgt);
    auto stats = (*step)->ForwardBackward(tok, tgt);
    ASSERT_TRUE(stats.ok()) << stats.status();
    auto grads = (*step)->GatherGrads();
    ASSERT_TRUE(grads.ok()) << grads.status();
    if (r == 0) {
      result.loss = stats->loss;
      result.grads = std::move(*grads);
      result.stats = *stats;
    }
  });
  return result;
}

void ExpectGradsClose(const std::vector<std::vector<float>>& got,
                      const std::vector<std::vector<double>>& want, const ModelConfig& m,
                      double rel) {
  const std::vector<WeightSpec> specs = ModelWeights(m);
  ASSERT_EQ(got.size(), want.size());
  for (size_t t = 0; t < want.size(); ++t) {
    double scale = 0;
    for (double x : want[t]) scale = std::max(scale, std::abs(x));
    ASSERT_GT(scale, 0.0) << specs[t].name << " has no gradient at all";
    ASSERT_EQ(got[t].size(), want[t].size());
    for (size_t i = 0; i < want[t].size(); ++i) {
      ASSERT_NEAR(got[t][i], want[t][i], rel * scale) << specs[t].name << "[" << i << "]";
    }
  }
}

class StepVsReference : public ::testing::TestWithParam<int> {};

// The whole step's loss and every gradient, at P = 1, 2 and 4 ranks, equal
// the naive double reference on the same global batch (fp32 rounding).
TEST_P(StepVsReference, LossAndGradientsMatch) {
  const int P = GetParam();
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch g = MakeBatch(m, B, 11);
  Tensors<double> w = InitWeights<double>(m, 5);
  Tensors<double> want;
  const double loss = ReferenceLossAndGrads(m, w, g.tokens, g.targets, B, &want);
  RankResult got = RunForwardBackward(m, P, B, g);
  EXPECT_NEAR(got.loss, loss, 1e-5 * loss);
  ExpectGradsClose(got.grads, want, m, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Ranks, StepVsReference, ::testing::Values(1, 2, 4));

// The composed step with Ring-DTP as its projection gives the same loss and
// gradients as the baseline (the reference), in both circulation modes, with
// strips that do not divide the vocabulary shards (32 / P rows, strip 5).
class StepWithRingDtp : public ::testing::TestWithParam<std::tuple<int, RingDtpMode>> {};

TEST_P(StepWithRingDtp, MatchesTheReference) {
  const auto [P, mode] = GetParam();
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch g = MakeBatch(m, B, 11);
  Tensors<double> w = InitWeights<double>(m, 5);
  Tensors<double> want;
  const double loss = ReferenceLossAndGrads(m, w, g.tokens, g.targets, B, &want);
  ProjectionOptions proj;
  proj.kind = ProjectionOptions::Kind::kRingDtp;
  proj.mode = mode;
  proj.strip = 5;
  proj.row_tile = 7;
  proj.chunk_rows = mode == RingDtpMode::kActivations ? 5 : 0;
  RankResult got = RunForwardBackward(m, P, B, g, proj);
  EXPECT_NEAR(got.loss, loss, 1e-5 * loss);
  ExpectGradsClose(got.grads, want, m, 1e-4);
  // No N x V logits: the projection live set stays within Ring-DTP's bound.
  StepOptions o;
  o.model = m;
  o.layout = {P, B};
  o.projection = proj;
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok());
  EXPECT_LE(got.stats.device.peak_of(LiveSet::kProjection),
            plan->bytes[static_cast<int>(LiveSet::kProjection)]);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, StepWithRingDtp,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(RingDtpMode::kActivations, RingDtpMode::kWeights)));

TEST(StepTest, SameBitsRunToRun) {
  const ModelConfig m = TestModel();
  const GlobalBatch g = MakeBatch(m, 2, 3);
  RankResult a = RunForwardBackward(m, 2, 2, g);
  RankResult b = RunForwardBackward(m, 2, 2, g);
  EXPECT_TRUE(SameBits(a.loss, b.loss)) << a.loss << " vs " << b.loss;
  EXPECT_TRUE(SameBits(a.grads, b.grads)) << "the gradients differ";
}

// One optimizer step equals torch.optim.AdamW with global-norm clipping,
// computed in double from the step's own gradient (AdamW's first step is
// ~lr * sign(g), so comparing against the double reference's gradient would
// amplify fp32 rounding of near-zero gradients; the gradient itself is
// checked against the reference above, and the norm here).
//
// Under both projections (the lm_head ZeRO-sharded in the dense weights, or
// owned by vocabulary shard under Ring-DTP) at P = 2 and 4, with V = 30 so
// that the vocabulary shards are uneven at P = 4 (8, 8, 7, 7 rows: ranks 2
// and 3 carry a zero padding row). The state gathered after the step loads
// into a fresh step and gathers back bit for bit.
class StepAdamW : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(StepAdamW, UpdateMatchesTheReference) {
  const auto [P, ring] = GetParam();
  ModelConfig m = TestModel();
  m.vocab_size = 30;
  const int64_t B = 2;
  const GlobalBatch g = MakeBatch(m, B, 21);
  Tensors<double> w = InitWeights<double>(m, 5);
  Tensors<double> grad;
  ReferenceLossAndGrads(m, w, g.tokens, g.targets, B, &grad);
  OptimizerConfig opt;
  opt.lr = 1e-2f;
  opt.weight_decay = 0.1f;
  opt.max_grad_norm = 0.5f;  // small enough to clip
  double norm = 0;
  for (const auto& t : grad) for (double x : t) norm += x * x;
  norm = std::sqrt(norm);
  ASSERT_GT(norm, opt.max_grad_norm) << "the test means to exercise clipping";
  const double clip = opt.max_grad_norm / (norm + 1e-6);
  std::vector<std::vector<float>> after, g32;
  RunRanks(P, [&](int r, Backend& be, Communicator& world) {
    StepOptions o;
    o.model = m;
    o.layout = {P, B};
    o.seed = 5;
    o.optimizer = opt;
    if (ring) {
      o.projection.kind = ProjectionOptions::Kind::kRingDtp;
      o.projection.strip = 3;
    }
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    std::vector<int32_t> tok, tgt;
    Slice(g, B, m.seq_len, r, P, &tok, &tgt);
    ASSERT_TRUE((*step)->ForwardBackward(tok, tgt).ok());
    auto grads = (*step)->GatherGrads();
    ASSERT_TRUE(grads.ok());
    if (r == 0) g32 = std::move(*grads);
    auto stats = (*step)->Step(tok, tgt);  // recomputes the same gradient
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_NEAR(stats->grad_norm, norm, 1e-4 * norm);
    EXPECT_EQ(stats->step, 1);
    auto weights = (*step)->GatherWeights();
    ASSERT_TRUE(weights.ok());
    if (r == 0) after = std::move(*weights);
    // Checkpoint round trip through the rank's layout.
    auto state = (*step)->GatherState();
    ASSERT_TRUE(state.ok()) << state.status();
    step->reset();
    auto fresh = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    ASSERT_TRUE((*fresh)->LoadState(*state).ok());
    auto again = (*fresh)->GatherState();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->weights, state->weights);
    EXPECT_EQ(again->m, state->m);
    EXPECT_EQ(again->v, state->v);
    EXPECT_EQ(again->step, 1);
  });
  double norm32 = 0;
  for (const auto& t : g32) for (float x : t) norm32 += double(x) * x;
  const double clip32 = opt.max_grad_norm / (std::sqrt(norm32) + 1e-6);
  EXPECT_NEAR(clip32, clip, 1e-4 * clip);
  // First AdamW step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected.
  for (size_t t = 0; t < w.size(); ++t) {
    for (size_t i = 0; i < w[t].size(); ++i) {
      const double gc = g32[t][i] * clip32;
      const double mh = (1 - opt.beta1) * gc / (1 - opt.beta1);
      const double vh = (1 - opt.beta2) * gc * gc / (1 - opt.beta2);
      const double p = w[t][i] * (1 - opt.lr * opt.weight_decay) - opt.lr * mh / (std::sqrt(vh) + opt.eps);
      ASSERT_NEAR(after[t][i], p, 1e-5 * opt.lr + 1e-6 * std::abs(p)) << t << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndProjections, StepAdamW,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat("P", std::get<0>(info.param),
                                               std::get<1>(info.param) ? "RingDtp" : "Dense");
                         });

TEST(StepTest, PeaksPerLiveSetAreReportedAndWithinThePlan) {
  const ModelConfig m = TestModel();
  const GlobalBatch g = MakeBatch(m, 2, 4);
  RankResult r = RunForwardBackward(m, 2, 2, g);
  StepOptions o;
  o.model = m;
  o.layout = {2, 2};
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok());
  for (LiveSet s : {LiveSet::kWeights, LiveSet::kGrads, LiveSet::kOptimizer, LiveSet::kCheckpoints,
                    LiveSet::kDispatch, LiveSet::kProjection, LiveSet::kActivations,
                    LiveSet::kWorkspace}) {
    const int64_t planned = plan->bytes[static_cast<int>(s)];
    EXPECT_GT(r.stats.device.peak_of(s), 0) << LiveSetName(s);
    EXPECT_LE(r.stats.device.peak_of(s), planned) << LiveSetName(s);
  }
  EXPECT_LE(r.stats.device.total_peak, plan->total());
  // Launch-sized sets are allocated exactly as planned.
  EXPECT_EQ(r.stats.device.peak_of(LiveSet::kWeights), plan->bytes[static_cast<int>(LiveSet::kWeights)]);
  EXPECT_EQ(r.stats.device.peak_of(LiveSet::kCheckpoints),
            plan->bytes[static_cast<int>(LiveSet::kCheckpoints)]);
  EXPECT_GT(r.stats.device.peak_of(LiveSet::kDispatch), 0);
}

// Every live set's measured peak is within the plan on every rank, under
// balanced routing and under routing skewed as far as it goes: with the
// router's weights at zero every expert ties and each token picks experts
// 0..k-1, all on rank 0, which then receives every route of every rank. The
// plan's dispatch is that worst case, so rank 0 must reach it to the byte.
class StepPlanBound : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(StepPlanBound, MeasuredPeaksAreWithinThePlanOnEveryRank) {
  const auto [P, skewed] = GetParam();
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch g = MakeBatch(m, B, 31);
  StepOptions o;
  o.model = m;
  o.layout = {P, B};
  o.seed = 5;
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok());
  std::vector<MemoryStats> peaks(P), host_peaks(P);
  std::vector<int64_t> reserved(P, -1), reserved_before(P, -1), reserved_after(P, -1), host_reserved(P, -1);
  RunRanks(P, [&](int r, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    if (skewed) {
      auto state = (*step)->GatherState();
      ASSERT_TRUE(state.ok()) << state.status();
      const std::vector<WeightSpec> specs = ModelWeights(m);
      int zeroed = 0;
      for (size_t t = 0; t < specs.size(); ++t) {
        if (absl::StrContains(specs[t].name, "router.weight")) {
          std::fill(state->weights[t].begin(), state->weights[t].end(), 0.0f);
          ++zeroed;
        }
      }
      ASSERT_EQ(zeroed, m.layers);
      ASSERT_TRUE((*step)->LoadState(*state).ok());
    }
    std::vector<int32_t> tok, tgt;
    Slice(g, B, m.seq_len, r, P, &tok, &tgt);
    auto* device = dynamic_cast<HeapSpace*>(&be.device());
    auto* host = dynamic_cast<HeapSpace*>(&be.host());
    ASSERT_NE(device, nullptr);
    ASSERT_NE(host, nullptr);
    reserved_before[r] = device->reserved_peak_bytes();
    // A whole optimizer step: forward, backward with its recomputation, AdamW.
    auto stats = (*step)->Step(tok, tgt);
    ASSERT_TRUE(stats.ok()) << stats.status();
    peaks[r] = stats->device;
    host_peaks[r] = stats->host;
    // What the CPU backend's spaces held from the heap, freed blocks kept
    // for reuse included (memory.h, HeapSpace).
    reserved[r] = device->reserved_peak_bytes();
    host_reserved[r] = host->reserved_peak_bytes();
    // A checkpoint after the step (SaveCheckpoint's gather).
    auto state = (*step)->GatherState();
    ASSERT_TRUE(state.ok()) << state.status();
    reserved_after[r] = device->reserved_peak_bytes();
  });
  for (int r = 0; r < P; ++r) {
    for (int i = 0; i < kNumLiveSets; ++i) {
      EXPECT_LE(peaks[r].peak[i], plan->bytes[i])
          << "rank " << r << " " << LiveSetName(static_cast<LiveSet>(i));
    }
    EXPECT_LE(peaks[r].total_peak, plan->total()) << "rank " << r;
    // Host memory too (the baseline plans none: nothing may appear there
    // unplanned).
    for (int i = 0; i < kNumLiveSets; ++i) {
      EXPECT_LE(host_peaks[r].peak[i], plan->host_bytes[i])
          << "rank " << r << " host " << LiveSetName(static_cast<LiveSet>(i));
    }
    EXPECT_LE(host_peaks[r].total_peak, plan->host_total()) << "rank " << r;
    // The spaces' cache of freed blocks stays within the plan too: the run
    // takes the device's reserved bytes no higher than the plan's total.
    // Before the step (Create; in the skewed runs GatherState and LoadState)
    // only the launch-sized buffers were ever live: the checkpoint's gathers
    // chunk through one of them and allocate nothing. Nor does the
    // GatherState after the step.
    EXPECT_LE(reserved_before[r], plan->launch_total()) << "rank " << r;
    EXPECT_GE(reserved[r], peaks[r].total_peak) << "rank " << r;
    EXPECT_LE(reserved[r], plan->total()) << "rank " << r;
    EXPECT_EQ(reserved_after[r], reserved[r]) << "rank " << r;
    EXPECT_LE(host_reserved[r], plan->host_total()) << "rank " << r;
  }
  const int64_t planned_dispatch = plan->bytes[static_cast<int>(LiveSet::kDispatch)];
  if (skewed || P == 1) {  // at P = 1 every routing is the worst case
    EXPECT_EQ(peaks[0].peak_of(LiveSet::kDispatch), planned_dispatch);
  } else {
    // Balanced routing stays near the balanced estimate, far below the plan.
    for (int r = 0; r < P; ++r) EXPECT_LT(peaks[r].peak_of(LiveSet::kDispatch), planned_dispatch);
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndRouting, StepPlanBound,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()));

// A checkpoint and resume on a device capped at exactly the plan's total, at
// P = 1 and 2, fp32 and bf16 mixed: Create, Step, GatherState; the step
// destroyed, a fresh one Created, LoadState, Step, GatherState (the
// trainer's save and resume). The gathers take no device memory of their
// own (they chunk through the dense gradient buffer, idle between steps), so
// every call fits under the cap (before, GatherState allocated P x the
// owned weights of workspace per gathered vector, beyond it), and the
// device's reserved peak stays within the plan. The resumed run ends with
// the state, bit for bit, of the same two steps taken without the round
// trip (run after it, under the same cap).
class StepCheckpointUnderPlanCap : public ::testing::TestWithParam<std::tuple<int, Precision>> {};

TEST_P(StepCheckpointUnderPlanCap, SaveAndResumeFitAndResumeBitForBit) {
  const auto [P, precision] = GetParam();
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch g1 = MakeBatch(m, B, 41), g2 = MakeBatch(m, B, 42);
  StepOptions o;
  o.model = m;
  o.layout = {P, B};
  o.seed = 5;
  o.precision = precision;
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<ModelState> resumed(P), straight(P);
  std::vector<int64_t> reserved(P, -1);
  RunRanks(
      P,
      [&](int r, Backend& be, Communicator& world) {
        ASSERT_EQ(be.device().cap_bytes(), plan->total());
        std::vector<int32_t> tok1, tgt1, tok2, tgt2;
        Slice(g1, B, m.seq_len, r, P, &tok1, &tgt1);
        Slice(g2, B, m.seq_len, r, P, &tok2, &tgt2);
        ModelState saved;
        {
          auto step = TrainingStep::Create(o, be, world);
          ASSERT_TRUE(step.ok()) << step.status();
          auto first = (*step)->Step(tok1, tgt1);
          ASSERT_TRUE(first.ok()) << first.status();
          // The trainer's streamed save under the cap too (its device side
          // is the same whether or not a rank receives).
          const absl::Status streamed = (*step)->StreamState(nullptr);
          ASSERT_TRUE(streamed.ok()) << streamed;
          auto state = (*step)->GatherState();
          ASSERT_TRUE(state.ok()) << state.status();
          saved = std::move(*state);
        }
        {
          auto step = TrainingStep::Create(o, be, world);
          ASSERT_TRUE(step.ok()) << step.status();
          const absl::Status loaded = (*step)->LoadState(saved);
          ASSERT_TRUE(loaded.ok()) << loaded;
          auto second = (*step)->Step(tok2, tgt2);
          ASSERT_TRUE(second.ok()) << second.status();
          auto state = (*step)->GatherState();
          ASSERT_TRUE(state.ok()) << state.status();
          resumed[r] = std::move(*state);
        }
        {
          auto step = TrainingStep::Create(o, be, world);
          ASSERT_TRUE(step.ok()) << step.status();
          ASSERT_TRUE((*step)->Step(tok1, tgt1).ok());
          ASSERT_TRUE((*step)->Step(tok2, tgt2).ok());
          auto state = (*step)->GatherState();
          ASSERT_TRUE(state.ok()) << state.status();
          straight[r] = std::move(*state);
        }
        auto* device = dynamic_cast<HeapSpace*>(&be.device());
        ASSERT_NE(device, nullptr);
        reserved[r] = device->reserved_peak_bytes();
      },
      plan->total());
  for (int r = 0; r < P; ++r) {
    EXPECT_LE(reserved[r], plan->total()) << "rank " << r;
    EXPECT_EQ(resumed[r].step, 2) << "rank " << r;
    EXPECT_EQ(straight[r].step, 2) << "rank " << r;
    EXPECT_TRUE(SameBits(resumed[r].weights, straight[r].weights)) << "rank " << r << ": weights differ";
    EXPECT_TRUE(SameBits(resumed[r].m, straight[r].m)) << "rank " << r << ": m differs";
    EXPECT_TRUE(SameBits(resumed[r].v, straight[r].v)) << "rank " << r << ": v differs";
    // Every rank gathers the same full state.
    EXPECT_TRUE(SameBits(resumed[r].weights, resumed[0].weights)) << "rank " << r;
  }
  // The state moved: the comparison is not of two initial states.
  ASSERT_FALSE(resumed[0].m.empty());
  double m_sum = 0;
  for (const auto& t : resumed[0].m) for (float x : t) m_sum += std::abs(x);
  EXPECT_GT(m_sum, 0.0);
}

INSTANTIATE_TEST_SUITE_P(RanksAndPrecisions, StepCheckpointUnderPlanCap,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Precision::kFp32, Precision::kBf16Mixed)),
                         [](const auto& info) {
                           return absl::StrCat("P", std::get<0>(info.param),
                                               std::get<1>(info.param) == Precision::kFp32 ? "Fp32" : "Bf16");
                         });

// Evaluate, the forward alone (the validation loss's pass). At P = 1, 2 and
// 4, under the baseline and under SCO (whose host boundaries must come back
// and be dropped), its loss equals the naive double reference's on the same
// batch to fp32 rounding (as the step's own, LossAndGradientsMatch), and
// ForwardBackward's to the bit on the same weights; it changes nothing (a
// Step after it gives the bits of a Step without it; the step count stays);
// and its measured peaks, device and host, are within the training step's
// plan live set by live set.
class StepEvaluate : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(StepEvaluate, ForwardOnlyLossWithinThePlanChangingNothing) {
  const auto [P, sco] = GetParam();
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch held_out = MakeBatch(m, B, 17), train = MakeBatch(m, B, 18);
  StepOptions o;
  o.model = m;
  o.layout = {P, B};
  o.seed = 5;
  if (sco) {
    o.checkpoints.kind = CheckpointOptions::Kind::kSco;
    o.checkpoints.host_budget_bytes = (B * m.seq_len / P) * m.hidden * 4;  // one boundary on the host
  }
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (sco) {
    ASSERT_GT(plan->host_total(), 0);
  }
  Tensors<double> w = InitWeights<double>(m, 5);
  Tensors<double> unused;
  const double want = ReferenceLossAndGrads(m, w, held_out.tokens, held_out.targets, B, &unused);
  int64_t valid = 0;
  for (int32_t t : held_out.targets) valid += t != kIgnoreIndex;

  struct Seen {
    StepStats before, after, step, fb;
    std::vector<std::vector<float>> weights;
  };
  std::vector<Seen> with(P), without(P);
  // With: Evaluate, Step, Evaluate. Without: Step, ForwardBackward.
  for (bool evaluate : {true, false}) {
    RunRanks(P, [&, evaluate = evaluate](int r, Backend& be, Communicator& world) {
      auto step = TrainingStep::Create(o, be, world);
      ASSERT_TRUE(step.ok()) << step.status();
      std::vector<int32_t> tok, tgt, ttok, ttgt;
      Slice(held_out, B, m.seq_len, r, P, &tok, &tgt);
      Slice(train, B, m.seq_len, r, P, &ttok, &ttgt);
      Seen& seen = evaluate ? with[r] : without[r];
      if (evaluate) {
        auto e = (*step)->Evaluate(tok, tgt);
        ASSERT_TRUE(e.ok()) << e.status();
        seen.before = *e;
      }
      auto s = (*step)->Step(ttok, ttgt);
      ASSERT_TRUE(s.ok()) << s.status();
      seen.step = *s;
      if (evaluate) {
        auto e = (*step)->Evaluate(tok, tgt);
        ASSERT_TRUE(e.ok()) << e.status();
        seen.after = *e;
      } else {
        auto fb = (*step)->ForwardBackward(tok, tgt);
        ASSERT_TRUE(fb.ok()) << fb.status();
        seen.fb = *fb;
      }
      auto weights = (*step)->GatherWeights();
      ASSERT_TRUE(weights.ok()) << weights.status();
      seen.weights = std::move(*weights);
    });
  }
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_NEAR(with[r].before.loss, want, 1e-5 * want);
    EXPECT_EQ(with[r].before.valid_tokens, valid);
    EXPECT_EQ(with[r].before.step, 0);
    EXPECT_EQ(with[r].after.step, 1);
    EXPECT_EQ(with[r].step.loss, without[r].step.loss);
    EXPECT_EQ(with[r].step.grad_norm, without[r].step.grad_norm);
    EXPECT_EQ(with[r].weights, without[r].weights);
    EXPECT_EQ(with[r].after.loss, without[r].fb.loss);  // the same forward, to the bit
    EXPECT_NE(with[r].after.loss, with[r].before.loss);  // it saw the update
    for (const StepStats* e : {&with[r].before, &with[r].after}) {
      for (int i = 0; i < kNumLiveSets; ++i) {
        EXPECT_LE(e->device.peak[i], plan->bytes[i]) << LiveSetName(static_cast<LiveSet>(i));
        EXPECT_LE(e->host.peak[i], plan->host_bytes[i]) << "host " << LiveSetName(static_cast<LiveSet>(i));
      }
      EXPECT_LE(e->device.total_peak, plan->total());
      EXPECT_LE(e->host.total_peak, plan->host_total());
      // A forward holds no gradient of its own: nothing beyond the step's
      // launch-sized grads.
      EXPECT_LE(e->device.peak_of(LiveSet::kGrads), with[r].step.device.peak_of(LiveSet::kGrads));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndCheckpoints, StepEvaluate,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return absl::StrCat("P", std::get<0>(info.param),
                                               std::get<1>(info.param) ? "Sco" : "Full");
                         });

// The forward-only loss is the same on any rank count, to fp32 rounding:
// P = 1 against P = 2 on one batch (the reference check above bounds each
// by 1e-5; here the two against each other, to 2e-6: the ranks' GEMMs see
// other shapes, so the fp32 sums round differently, not more).
TEST(StepTest, EvaluateIsTheSameLossOnOneAndTwoRanks) {
  const ModelConfig m = TestModel();
  const int64_t B = 2;
  const GlobalBatch g = MakeBatch(m, B, 23);
  double loss[3] = {0, 0, 0};
  for (int P : {1, 2}) {
    RunRanks(P, [&](int r, Backend& be, Communicator& world) {
      StepOptions o;
      o.model = m;
      o.layout = {P, B};
      o.seed = 5;
      auto step = TrainingStep::Create(o, be, world);
      ASSERT_TRUE(step.ok()) << step.status();
      std::vector<int32_t> tok, tgt;
      Slice(g, B, m.seq_len, r, P, &tok, &tgt);
      auto e = (*step)->Evaluate(tok, tgt);
      ASSERT_TRUE(e.ok()) << e.status();
      if (r == 0) loss[P] = e->loss;
    });
  }
  ASSERT_GT(loss[1], 0);
  EXPECT_NEAR(loss[2], loss[1], 2e-6 * loss[1]);
}

TEST(StepTest, BadSpecsAreRefusedNamingTheField) {
  RunRanks(1, [&](int, Backend& be, Communicator& world) {
    StepOptions o;
    o.model = TestModel();
    o.layout = {1, 1};
    o.model.top_k = 5;
    EXPECT_THAT(TrainingStep::Create(o, be, world).status().message(), HasSubstr("model.top_k"));
    o.model = TestModel();
    o.layout = {2, 1};
    EXPECT_THAT(TrainingStep::Create(o, be, world).status().message(), HasSubstr("layout.ranks"));
    o.layout = {1, 1};
    o.optimizer.lr = -1.0f;
    EXPECT_THAT(TrainingStep::Create(o, be, world).status().message(), HasSubstr("optimizer."));
    o.optimizer = {};
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok());
    std::vector<int32_t> tok(16, 1), tgt(16, 1);
    tok[3] = 99;
    auto st = (*step)->ForwardBackward(tok, tgt);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.status().message(), HasSubstr("batch.tokens[3] = 99"));
    EXPECT_THAT((*step)->ForwardBackward({1, 2}, {1, 2}).status().message(),
                HasSubstr("expected 16 tokens"));
  });
  // A device that cannot hold the persistent state is refused before any
  // allocation, naming the cap and the live sets.
  RunRanks(1, [&](int, Backend& be, Communicator& world) {
    StepOptions o;
    o.model = TestModel();
    o.layout = {1, 1};
    auto st = TrainingStep::Create(o, be, world);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(st.status().message(), AllOf(HasSubstr("device_memory_bytes"), HasSubstr("weights=")));
    EXPECT_EQ(be.device().tracker().total_peak(), 0);
  }, /*device_bytes=*/64 * 1024);
}

// A device that holds the launch-sized state but not the routes is an
// out-of-memory error naming the dispatch live set, not a crash.
TEST(StepTest, DispatchOverTheCapIsAnErrorNamingTheLiveSet) {
  const ModelConfig m = TestModel();
  StepOptions o;
  o.model = m;
  o.layout = {1, 2};
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok());
  const int64_t launch = plan->total() - plan->bytes[static_cast<int>(LiveSet::kDispatch)];
  const GlobalBatch g = MakeBatch(m, 2, 8);
  RunRanks(1, [&](int, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    ASSERT_TRUE(step.ok()) << step.status();
    auto st = (*step)->ForwardBackward(g.tokens, g.targets);
    EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(st.status().message(), HasSubstr("live set 'dispatch'"));
  }, /*device_bytes=*/launch + 1024);
}

}  // namespace
}  // namespace plateau
