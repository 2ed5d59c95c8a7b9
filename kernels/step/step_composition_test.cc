// Every composition of the schedules against the all-baseline step: each
// of the 24 combinations of dispatch (standard EP, LLEP, PipelinedLLEP),
// projection (dense, Ring-DTP), checkpoints (all on device, SCO) and
// optimizer placement (device AdamW, OffloadStreamAdamW), each with its
// settings drawn from a seeded generator (chunk sizes, memberships,
// borrowing limits, strips, tiles, circulation modes, host budgets that cut
// between boundaries, buckets, staging slots, whether attention's forward is
// kept for the backward), at P = 1, 2 and 4, under the
// router's own routing and under routing skewed as far as it goes (router
// weights zero: every token picks experts 0..k-1, all on rank 0). Each run
// is a ForwardBackward, two optimizer steps and a validation pass
// (Evaluate) on one batch, in fp32 and in bf16 mixed precision. What must
// hold:
//   - the same values as the baseline of the same precision: bit for bit
//     where the schedules only move data (SCO, OffloadStreamAdamW: the loss
//     of every call, the gradients, the weights after both steps); where
//     they reorder sums (LLEP's and PipelinedLLEP's helpers and chunks,
//     Ring-DTP's strips), in fp32, the first loss and every gradient to
//     fp32 rounding (the tolerance the step holds against its double
//     reference, step_test), later calls being AdamW's amplification of
//     those roundings, not compared; in bf16, against the same composition
//     (the same drawn settings) run in fp32, the first loss within the
//     forward chain's bound and every gradient tensor within the gradient
//     chain's relative L2 bound (step_testing.h: step_bf16_test's
//     derivation, with the schedule's roundings), the bf16 baseline
//     likewise against the fp32 baseline; and every gradient tensor against
//     the bf16 baseline's within the schedule's own roundings and one
//     rounding gone the other way (ExpectNearBf16Baseline);
//   - every live set's measured peak within the plan on every rank, device
//     and host, through the recomputing backward, the updates and the
//     validation pass, and the peak of the total within the plan's total;
//     PipelinedLLEP's dispatch peak is its launch-sized bound whatever the
//     routing;
//   - the same bits run to run (the all-on composition, twice);
//   - attention's forward kept for the backward (keep_attention) changes no
//     bit of any composition, and the recompute then runs no attention
//     forward.
// Each composition's settings are printed in its failure message, so a
// failing draw can be run again by hand.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/model/precision.h"
#include "kernels/status_macros.h"
#include "kernels/step/step.h"
#include "kernels/step/step_testing.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/rank_slice.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using DispatchKind = DispatchOptions::Kind;

// Three layers (SCO can move up to two boundaries), eight experts (E/P = 2
// >= k at P = 4).
ModelConfig TestModel() {
  ModelConfig m = TinyModel();
  m.layers = 3;
  m.experts = 8;
  return m;
}

constexpr int64_t kBatch = 4;

struct Composition {
  DispatchKind dispatch = DispatchKind::kStandardEp;
  bool ring_dtp = false, sco = false, offload = false;

  // Whether the schedules only move data (the baseline's bits) rather than
  // reorder sums.
  bool Exact() const { return dispatch == DispatchKind::kStandardEp && !ring_dtp; }
};

std::vector<Composition> AllCompositions() {
  std::vector<Composition> all;
  for (DispatchKind d :
       {DispatchKind::kStandardEp, DispatchKind::kLlep, DispatchKind::kPipelinedLlep}) {
    for (bool ring : {false, true}) {
      for (bool sco : {false, true}) {
        for (bool offload : {false, true}) all.push_back({d, ring, sco, offload});
      }
    }
  }
  return all;
}

StepOptions BaseOptions(int P, Precision precision) {
  StepOptions o;
  o.model = TestModel();
  o.precision = precision;
  o.layout = {P, kBatch};
  o.seed = 6;
  o.optimizer.weight_decay = 0.1f;
  return o;
}

int64_t Uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}
template <typename T>
T OneOf(std::mt19937_64& rng, const std::vector<T>& values) {
  return values[static_cast<size_t>(Uniform(rng, 0, static_cast<int64_t>(values.size()) - 1))];
}

LlepOptions DrawBalance(std::mt19937_64& rng) {
  LlepOptions b;
  b.alpha = OneOf<double>(rng, {0.5, 1.1, 2.0});  // below 1 forces overflow onto helpers
  b.min_piece = OneOf<int64_t>(rng, {1, 2, 4});
  b.lambda = OneOf<double>(rng, {1.0, 1.5});
  b.max_borrowed = OneOf<int64_t>(rng, {0, 1, 2});
  return b;
}

// The composition `c` at P ranks, its settings drawn from `rng`.
StepOptions Draw(const Composition& c, int P, Precision precision, std::mt19937_64& rng) {
  StepOptions o = BaseOptions(P, precision);
  const ModelConfig& m = o.model;
  const int64_t N = kBatch * m.seq_len / P;  // tokens per rank
  o.dispatch.kind = c.dispatch;
  if (c.dispatch == DispatchKind::kLlep) o.dispatch.llep = DrawBalance(rng);
  if (c.dispatch == DispatchKind::kPipelinedLlep) {
    o.dispatch.pipelined.chunk_tokens = Uniform(rng, 1, N);
    o.dispatch.pipelined.membership =
        OneOf<ChunkMembership>(rng, {ChunkMembership::kStrided, ChunkMembership::kContiguous});
    o.dispatch.pipelined.balance = DrawBalance(rng);
  }
  if (c.ring_dtp) {
    o.projection.kind = ProjectionOptions::Kind::kRingDtp;
    const int mode = static_cast<int>(Uniform(rng, 0, 2));  // unset, activations, weights
    if (mode == 1) o.projection.mode = RingDtpMode::kActivations;
    if (mode == 2) o.projection.mode = RingDtpMode::kWeights;
    o.projection.strip = Uniform(rng, 1, (m.vocab_size + P - 1) / P);
    o.projection.row_tile = Uniform(rng, 1, N);
    o.projection.chunk_rows = mode == 1 && Uniform(rng, 0, 1) == 1 ? Uniform(rng, 1, N) : 0;
  }
  if (c.sco) {
    // Whole boundaries (0 to L - 1 of them) and a part of one more, which
    // the pool must leave on the device.
    const int64_t boundary = N * m.hidden * ElementBytesOf(precision).working;
    o.checkpoints.kind = CheckpointOptions::Kind::kSco;
    o.checkpoints.host_budget_bytes =
        Uniform(rng, 0, m.layers - 1) * boundary + Uniform(rng, 0, boundary - 1);
  }
  if (c.offload) {
    o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
    // Log-uniform from 64 parameters (hundreds of buckets) to more than
    // the model (one bucket).
    o.optimizer_placement.bucket_params = static_cast<int64_t>(
        std::exp(std::uniform_real_distribution<double>(std::log(64.0), std::log(65536.0))(rng)));
    o.optimizer_placement.staging_slots = Uniform(rng, 1, 3);
  }
  return o;
}

std::string Describe(const StepOptions& o) {
  std::string s;
  switch (o.dispatch.kind) {
    case DispatchKind::kStandardEp:
      s = "standard_ep";
      break;
    case DispatchKind::kLlep:
      s = absl::StrCat("llep{alpha ", o.dispatch.llep.alpha, " min_piece ",
                       o.dispatch.llep.min_piece, " lambda ", o.dispatch.llep.lambda,
                       " max_borrowed ", o.dispatch.llep.max_borrowed, "}");
      break;
    case DispatchKind::kPipelinedLlep: {
      const PipelinedLlepOptions& p = o.dispatch.pipelined;
      s = absl::StrCat("pipelined_llep{chunk_tokens ", p.chunk_tokens, " ",
                       p.membership == ChunkMembership::kStrided ? "strided" : "contiguous",
                       " alpha ", p.balance.alpha, " min_piece ", p.balance.min_piece, " lambda ",
                       p.balance.lambda, " max_borrowed ", p.balance.max_borrowed, "}");
      break;
    }
  }
  if (o.projection.kind == ProjectionOptions::Kind::kRingDtp) {
    const char* mode = !o.projection.mode                                ? "unset"
                       : *o.projection.mode == RingDtpMode::kActivations ? "activations"
                                                                         : "weights";
    absl::StrAppend(&s, " ring_dtp{mode ", mode, " strip ", o.projection.strip, " row_tile ",
                    o.projection.row_tile, " chunk_rows ", o.projection.chunk_rows, "}");
  } else {
    absl::StrAppend(&s, " dense");
  }
  if (o.checkpoints.kind == CheckpointOptions::Kind::kSco) {
    absl::StrAppend(&s, " sco{host_budget_bytes ", o.checkpoints.host_budget_bytes, "}");
  } else {
    absl::StrAppend(&s, " full_checkpoints");
  }
  if (o.checkpoints.keep_attention) {
    absl::StrAppend(&s, " keep_attention{", CheckpointPools(o).records.host_boundaries, " records pooled}");
  }
  if (o.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream) {
    absl::StrAppend(&s, " offload_stream_adamw{bucket_params ", o.optimizer_placement.bucket_params,
                    " staging_slots ", o.optimizer_placement.staging_slots, "}");
  } else {
    absl::StrAppend(&s, " device_adamw");
  }
  return absl::StrCat(s, " P=", o.layout.ranks,
                      o.precision == Precision::kBf16Mixed ? " bf16" : " fp32");
}

struct Outcome {
  // ForwardBackward, Step, Step, Evaluate.
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;    // of the ForwardBackward (rank 0's view)
  std::vector<std::vector<float>> weights;  // after both steps
  std::vector<MemoryStats> device, host;    // per rank: the largest peaks of the four calls
};

// `forward_backward_only`: the ForwardBackward and its gradients alone (the
// fp32 reference of a bf16 run; no peaks).
Outcome RunComposition(const StepOptions& o, bool skewed, const GlobalBatch& g, bool forward_backward_only = false) {
  const ModelConfig& m = o.model;
  const int P = o.layout.ranks;
  Outcome out;
  out.device.resize(P);
  out.host.resize(P);
  BackendOptions bo;
  bo.device_memory_bytes = 64 << 20;
  bo.host_memory_bytes = 16 << 20;
  const absl::Status s = RunLocalWorld(
      P, bo, FreshStoreDir("composition"), [&](int r, Backend& be, Communicator& world) {
        PLATEAU_ASSIGN_OR_RETURN(auto step, TrainingStep::Create(o, be, world));
        if (skewed) PLATEAU_RETURN_IF_ERROR(SkewRouting(*step, m));
        const std::vector<int32_t> tok = RankSlice(g.tokens, kBatch, m.seq_len, r, P);
        const std::vector<int32_t> tgt = RankSlice(g.targets, kBatch, m.seq_len, r, P);
        std::vector<StepStats> calls;
        PLATEAU_ASSIGN_OR_RETURN(StepStats fb, step->ForwardBackward(tok, tgt));
        calls.push_back(fb);
        PLATEAU_ASSIGN_OR_RETURN(auto grads, step->GatherGrads());
        // One attention forward per layer per pass, and one more per layer
        // in each backward's recompute unless the forward's was kept.
        const int64_t per_backward = o.checkpoints.keep_attention ? 1 : 2;
        if (forward_backward_only) {
          EXPECT_EQ(step->attention_forwards(), per_backward * m.layers) << Describe(o) << " rank " << r;
          if (r == 0) {
            out.losses.push_back(fb.loss);
            out.grads = std::move(grads);
          }
          return absl::OkStatus();
        }
        for (int k = 0; k < 2; ++k) {
          PLATEAU_ASSIGN_OR_RETURN(StepStats st, step->Step(tok, tgt));
          calls.push_back(st);
        }
        PLATEAU_ASSIGN_OR_RETURN(auto weights, step->GatherWeights());
        PLATEAU_ASSIGN_OR_RETURN(StepStats eval, step->Evaluate(tok, tgt));
        calls.push_back(eval);
        EXPECT_EQ(step->attention_forwards(), (3 * per_backward + 1) * m.layers) << Describe(o) << " rank " << r;
        for (const StepStats& c : calls) {
          out.device[r].KeepPeaks(c.device);
          out.host[r].KeepPeaks(c.host);
        }
        if (r == 0) {
          for (const StepStats& c : calls) out.losses.push_back(c.loss);
          out.grads = std::move(grads);
          out.weights = std::move(weights);
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(s.ok()) << Describe(o) << ": " << s;
  return out;
}

void ExpectSameBits(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_TRUE(SameBits(got.losses[i], want.losses[i]))
        << what << " call " << i << ": " << got.losses[i] << " vs " << want.losses[i];
  }
  EXPECT_TRUE(SameBits(got.grads, want.grads)) << what << ": the gradients differ";
  EXPECT_TRUE(SameBits(got.weights, want.weights)) << what << ": the weights after two steps differ";
}

// fp32 rounding: the tolerances the step holds against its double
// reference (step_test: loss 1e-5 relative, each gradient 1e-4 of its
// tensor's largest).
void ExpectRounding(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_FALSE(got.losses.empty()) << what;
  EXPECT_NEAR(got.losses[0], want.losses[0], 1e-5 * std::abs(want.losses[0])) << what;
  const std::vector<WeightSpec> specs = ModelWeights(TestModel());
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (size_t t = 0; t < want.grads.size(); ++t) {
    float scale = 0;
    for (float x : want.grads[t]) scale = std::max(scale, std::abs(x));
    ASSERT_EQ(got.grads[t].size(), want.grads[t].size()) << what;
    for (size_t i = 0; i < want.grads[t].size(); ++i) {
      ASSERT_NEAR(got.grads[t][i], want.grads[t][i], 1e-4f * scale)
          << what << ": " << specs[t].name << "[" << i << "]";
    }
  }
}

// bf16 against fp32, the same composition on the same batch and routing:
// the first loss (the ForwardBackward's) within the forward chain's bound
// (1 + 2^-8)^K_f - 1 relative, and each gradient tensor within the
// gradient chain's relative L2 bound with the schedule's roundings
// (step_testing.h's GradientChainBound: 45% at P = 2 here). Not
// step_bf16_test's tighter 16 x 2^-8, a threshold measured on its tiny
// model: this model's bf16 baseline exceeds it under the learned routing
// (8.5%, layers.2.moe_norm.weight, at P = 1, 2 and 4; 3.3% at most under
// the skewed routing, whose ties break the same way in either precision),
// and so does the double reference with only the weights rounded to bf16
// (6.1%): tokens whose k-th and (k+1)-th router probabilities are 0.1%
// apart swap experts. That is the model's sensitivity, not the schedules':
// ExpectNearBf16Baseline holds them to the bf16 baseline far more tightly.
void ExpectNearFp32(const Outcome& bf16, const Outcome& fp32, const StepOptions& o, const std::string& what) {
  ASSERT_FALSE(bf16.losses.empty()) << what;
  ASSERT_FALSE(fp32.losses.empty()) << what;
  const double loss_bound = RelativeBound(ForwardRoundings(o.model));
  const double loss_error = std::abs(bf16.losses[0] - fp32.losses[0]) / fp32.losses[0];
  std::printf("%s: loss relative error %.2e (bound %.2e)\n", what.c_str(), loss_error, loss_bound);
  EXPECT_LE(loss_error, loss_bound) << what << ": loss bf16 " << bf16.losses[0] << " fp32 " << fp32.losses[0];
  const TensorErrors e = ExpectEveryTensorNear(bf16.grads, fp32.grads, o.model, GradientChainBound(o), what);
  EXPECT_GT(e.worst, 0) << what << ": bf16 gradients equal to fp32's: the step did not compute bf16";
}

// A bf16 composition against the bf16 baseline, tensor by tensor: the two
// make the same roundings of the same values (the schedules move rows and
// reorder fp32 sums), except the roundings the schedule adds
// (ScheduleGradientRoundings: LLEP's and PipelinedLLEP's helpers), and
// where a reordered fp32 sum falls on the other side of a rounding
// boundary, which moves that stored value by one bf16 unit. This is a
// regression threshold, not a derived bound: such a flip changes what
// every later rounding of the backward sees, so a derived bound grows with
// the chain (K_g, as the comparison against fp32 above uses). The threshold
// counts the local difference only, as if nothing propagated:
// (1 + u)^(s + 2) - 1 relative L2 (0.78% without helpers, 2.4% with LLEP's
// at P = 4), against an observed worst of 0.43% (layers.2.attn.wk,
// Ring-DTP at P = 4): under 2x of margin. A change that trips it may be a
// benign reordering: check it against fp32 (the derived bound) before
// calling it a defect. It is here because the derived bound cannot see
// what this does: a helper's gradient added with the wrong sign or
// dropped, a strip or a chunk left out, tens of percent of its tensor
// (0.23-0.64 against 0.0078 for a dropped dW strip). The first loss
// likewise within (1 + u)^2 - 1 (the schedules add no rounding to the
// forward).
void ExpectNearBf16Baseline(const Outcome& got, const Outcome& base, const StepOptions& o, const std::string& what) {
  ASSERT_FALSE(got.losses.empty()) << what;
  EXPECT_LE(std::abs(got.losses[0] - base.losses[0]), RelativeBound(2) * base.losses[0])
      << what << ": loss " << got.losses[0] << ", the bf16 baseline's " << base.losses[0];
  ExpectEveryTensorNear(got.grads, base.grads, o.model, RelativeBound(ScheduleGradientRoundings(o) + 2),
                        what + " against the bf16 baseline");
}

// Within the plan, and at it: every live set but a data-dependent dispatch
// (standard EP's and LLEP's, sized by the routes) is sized at launch, so its
// peak is the plan's bytes exactly, on the device and the host, on every
// rank; an over-counted set fails as an under-counted one does. (Only
// "<=" was checked for all but PipelinedLLEP's dispatch, the weights and the
// checkpoints.)
void ExpectWithinPlan(const Outcome& got, const StepOptions& o, const std::string& what) {
  ExpectWithinPlan(got.device, got.host, o, what);
  auto plan = PlanMemory(o);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
  for (int r = 0; r < o.layout.ranks; ++r) {
    for (int i = 0; i < kNumLiveSets; ++i) {
      const LiveSet set = static_cast<LiveSet>(i);
      if (set == LiveSet::kDispatch && o.dispatch.kind != DispatchKind::kPipelinedLlep) continue;
      EXPECT_EQ(got.device[r].peak_of(set), plan->bytes[i])
          << what << " rank " << r << " device " << LiveSetName(set) << " is launch-sized";
      EXPECT_EQ(got.host[r].peak_of(set), plan->host_bytes[i])
          << what << " rank " << r << " host " << LiveSetName(set) << " is launch-sized";
    }
  }
}

class StepComposition : public ::testing::TestWithParam<std::tuple<int, bool, Precision>> {};

TEST_P(StepComposition, EveryCompositionIsTheBaselineWithinItsPlan) {
  const auto [P, skewed, precision] = GetParam();
  const bool bf16 = precision == Precision::kBf16Mixed;
  const GlobalBatch g = MakeBatch(TestModel(), kBatch, 31);
  const StepOptions base_options = BaseOptions(P, precision);
  const Outcome base = RunComposition(base_options, skewed, g);
  ASSERT_EQ(base.losses.size(), 4u);
  ExpectWithinPlan(base, base_options, "baseline");
  // The same options in fp32 (a bf16 run's reference).
  auto in_fp32 = [&](StepOptions o) {
    o.precision = Precision::kFp32;
    return RunComposition(o, skewed, g, /*forward_backward_only=*/true);
  };
  if (bf16) ExpectNearFp32(base, in_fp32(base_options), base_options, skewed ? "baseline skewed" : "baseline learned");
  // One stream of draws per parameter, so that each case's settings do not
  // depend on which other cases run.
  std::mt19937_64 rng(1000 * P + (skewed ? 1 : 0) + (bf16 ? 2 : 0));
  // Whether each keeps attention's forward, from a stream of its own (the
  // other settings are drawn as before it existed).
  std::mt19937_64 keep_rng(7000 + 1000 * P + (skewed ? 1 : 0) + (bf16 ? 2 : 0));
  int exact = 0, rounded = 0;
  for (const Composition& c : AllCompositions()) {
    StepOptions o = Draw(c, P, precision, rng);
    o.checkpoints.keep_attention = Uniform(keep_rng, 0, 1) == 1;
    if (c.sco && o.checkpoints.keep_attention && Uniform(keep_rng, 0, 1) == 1) {
      // A beta past every boundary that can leave: whole attention records
      // (0 to L - 2) and a part of one more (PlanScoPools).
      const ModelConfig& m = o.model;
      const int64_t N = TokensPerRank(m, o.layout);
      const int64_t boundary = N * m.hidden * ElementBytesOf(precision).working;
      const int64_t record = N * (m.heads * m.head_dim() + m.heads) * 4;
      o.checkpoints.host_budget_bytes =
          (m.layers - 1) * boundary + Uniform(keep_rng, 0, m.layers - 2) * record + Uniform(keep_rng, 0, record - 1);
    }
    const std::string what = absl::StrCat(Describe(o), skewed ? " skewed" : " learned");
    const Outcome got = RunComposition(o, skewed, g);
    if (got.losses.size() != base.losses.size()) continue;  // the run failed, reported above
    if (c.Exact()) {
      ExpectSameBits(got, base, what);
      ++exact;
    } else if (!bf16) {
      ExpectRounding(got, base, what);
      ++rounded;
    } else {
      // The same drawn settings in fp32 (an exact composition is the bf16
      // baseline's bits, compared with fp32 above), and the bf16 baseline.
      ExpectNearFp32(got, in_fp32(o), o, what);
      ExpectNearBf16Baseline(got, base, o, what);
      ++rounded;
    }
    ExpectWithinPlan(got, o, what);
  }
  EXPECT_EQ(exact, 4);
  EXPECT_EQ(rounded, 20);
}

INSTANTIATE_TEST_SUITE_P(RanksAndRouting, StepComposition,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool(),
                                            ::testing::Values(Precision::kFp32,
                                                              Precision::kBf16Mixed)),
                         [](const auto& info) {
                           return absl::StrCat(
                               "P", std::get<0>(info.param),
                               std::get<1>(info.param) ? "Skewed" : "Learned",
                               std::get<2>(info.param) == Precision::kFp32 ? "Fp32" : "Bf16");
                         });

// Keeping attention's forward for the backward only moves values: o and
// lse copied out after the forward and back before the layer's backward are
// the bits the recompute's attention forward would make, through the host
// pool too. The baseline, the all-on stack and SCO pooling every record it
// can, each with and without, at P = 1 (attention on one rank) and P = 2
// (ring attention: the kept o is the ring's whole output), in both
// precisions and under skewed routing; each within its plan.
TEST(StepCompositionTest, KeptAttentionIsTheRecomputeBitForBit) {
  const GlobalBatch g = MakeBatch(TestModel(), kBatch, 31);
  std::mt19937_64 rng(91);
  for (int P : {1, 2}) {
    for (Precision precision : {Precision::kFp32, Precision::kBf16Mixed}) {
      for (int stack : {0, 1, 2}) {  // the baseline, all on, SCO pooling every record it can
        const bool all_on = stack == 1;
        StepOptions o = all_on ? Draw({DispatchKind::kPipelinedLlep, true, true, true}, P, precision, rng)
                               : BaseOptions(P, precision);
        if (stack == 2) {
          o.checkpoints.kind = CheckpointOptions::Kind::kSco;
          o.checkpoints.host_budget_bytes = int64_t{1} << 40;
        }
        o.checkpoints.keep_attention = false;
        StepOptions kept = o;
        kept.checkpoints.keep_attention = true;
        const Outcome want = RunComposition(o, /*skewed=*/true, g);
        const Outcome got = RunComposition(kept, /*skewed=*/true, g);
        ASSERT_EQ(want.losses.size(), 4u) << Describe(o);
        ExpectSameBits(got, want, Describe(kept));
        ExpectWithinPlan(got, kept, Describe(kept));
        // The records are launch-sized: L x N x (heads d + heads) fp32, on
        // the device and in SCO's host pool together (L - 2 = 1 pooled
        // under the largest beta).
        const ModelConfig& m = o.model;
        const int64_t N = TokensPerRank(m, o.layout);
        const int64_t records = m.layers * N * (m.heads * m.head_dim() + m.heads) * 4;
        const int64_t pooled = stack == 2 ? records / m.layers : 0;
        EXPECT_EQ(got.device[0].peak_of(LiveSet::kCheckpoints) - want.device[0].peak_of(LiveSet::kCheckpoints),
                  records - pooled)
            << Describe(kept);
        EXPECT_EQ(got.host[0].peak_of(LiveSet::kCheckpoints) - want.host[0].peak_of(LiveSet::kCheckpoints), pooled)
            << Describe(kept);
      }
    }
  }
}

TEST(StepCompositionTest, AllOnIsTheSameBitsRunToRun) {
  const GlobalBatch g = MakeBatch(TestModel(), kBatch, 31);
  std::mt19937_64 rng(77);
  for (Precision precision : {Precision::kFp32, Precision::kBf16Mixed}) {
    StepOptions o = Draw({DispatchKind::kPipelinedLlep, true, true, true}, 2, precision, rng);
    o.checkpoints.keep_attention = true;  // as device-check's MFU ladder runs
    if (precision == Precision::kBf16Mixed) {
      // K > 1 chunks: the expert gradients' fp32 accumulators, summed over
      // the chunks and rounded once, are in what must repeat.
      ASSERT_TRUE(
          PipelinedLlepAccumulatesInFp32(TokensPerRank(o.model, o.layout), o.dispatch.pipelined, kBf16MixedElements))
          << Describe(o) << ": one chunk";
    }
    const Outcome a = RunComposition(o, /*skewed=*/true, g);
    const Outcome b = RunComposition(o, /*skewed=*/true, g);
    ASSERT_EQ(a.losses.size(), 4u);
    ExpectSameBits(a, b, Describe(o));
  }
}

}  // namespace
}  // namespace plateau
