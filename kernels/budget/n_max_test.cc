// N_max is tight against the plan it is solved from: the answer fits, one
// step more does not, and on small shapes it is the largest that fits (a
// scan of every shape agrees). (kernels/step/step_n_max_test runs the step
// at N_max and one step beyond under the capped arena.)
#include "kernels/budget/n_max.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/checkpoints/checkpoints_plan.h"
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

// Every on/off combination of the four schedules (16), with small settings.
StepOptions Combination(int64_t ranks, int bits) {
  StepOptions o = Small(ranks);
  if (bits & 1) {
    o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
    o.dispatch.pipelined.chunk_tokens = 24;
    o.dispatch.pipelined.balance.min_piece = 4;
  }
  if (bits & 2) {
    o.projection.kind = ProjectionOptions::Kind::kRingDtp;
    o.projection.strip = 7;
    o.projection.row_tile = 16;
  }
  if (bits & 4) {
    o.checkpoints.kind = CheckpointOptions::Kind::kSco;
    o.checkpoints.host_budget_bytes = 4096;
  }
  if (bits & 8) {
    o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
    o.optimizer_placement.bucket_params = 500;
  }
  return o;
}

StepOptions WithBatch(StepOptions o, int64_t batch) {
  o.layout.batch = batch;
  return o;
}
StepOptions WithSeqLen(StepOptions o, int64_t seq_len) {
  o.model.seq_len = seq_len;
  return o;
}
bool FitsAt(const StepOptions& o, const FitCaps& caps) { return Fits(PlanMemory(o).value(), caps); }

// The largest x in [1, limit] whose shape fits, by scanning every x.
template <typename Shape>
int64_t Scan(const Shape& shape, int64_t limit, const FitCaps& caps) {
  int64_t best = 0;
  for (int64_t x = 1; x <= limit; ++x) {
    if (FitsAt(shape(x), caps)) best = x;
  }
  return best;
}

TEST(NMaxTest, TightAndTheLargestForEveryCombinationOfTheSchedules) {
  for (int64_t P : {1, 2, 4}) {
    for (int bits = 0; bits < 16; ++bits) {
      const StepOptions o = Combination(P, bits);
      SCOPED_TRACE(::testing::Message() << "P=" << P << " schedules=" << bits);
      // A cap that holds a batch of a few dozen sequences: the plan at
      // batch 40, less a little so that the boundary falls inside a step.
      const FitCaps caps{PlanMemory(WithBatch(o, 40)).value().total() - 100, 0};
      NMaxLimits limits;
      limits.max_batch = 256;
      limits.max_seq_len = 1024;
      auto n = SolveNMax(o, caps, limits);
      ASSERT_TRUE(n.ok()) << n.status();

      const NMaxAxis& b = n->batch;
      EXPECT_EQ(b.seq_len, o.model.seq_len);
      EXPECT_EQ(b.tokens_per_rank, b.batch * o.model.seq_len / P);
      EXPECT_EQ(b.limit, "device_memory_bytes");
      ASSERT_GE(b.batch, 1);
      EXPECT_TRUE(FitsAt(WithBatch(o, b.batch), caps));
      EXPECT_FALSE(FitsAt(WithBatch(o, b.batch + 1), caps));
      EXPECT_EQ(b.batch, Scan([&](int64_t x) { return WithBatch(o, x); }, limits.max_batch, caps));
      EXPECT_THAT(b.detail, HasSubstr(absl::StrCat("layout.batch ", b.batch + 1)));

      const NMaxAxis& c = n->context;
      EXPECT_EQ(c.batch, o.layout.batch);
      EXPECT_EQ(c.seq_len % P, 0);
      EXPECT_EQ(c.tokens_per_rank, o.layout.batch * c.seq_len / P);
      EXPECT_EQ(c.limit, "device_memory_bytes");
      ASSERT_GE(c.seq_len, P);
      EXPECT_TRUE(FitsAt(WithSeqLen(o, c.seq_len), caps));
      EXPECT_FALSE(FitsAt(WithSeqLen(o, c.seq_len + P), caps));
      EXPECT_EQ(c.seq_len, P * Scan([&](int64_t x) { return WithSeqLen(o, x * P); }, limits.max_seq_len / P, caps));
    }
  }
}

// With the dispatch counted at its balanced case, standard EP's fit uses
// dispatch_balanced_bytes in place of the worst case: tight against that
// sum, and longer than the worst case's answer. PipelinedLLEP's plan is
// its bound either way.
TEST(NMaxTest, BalancedDispatchCountsTheBalancedCase) {
  for (int64_t P : {2, 4}) {
    const StepOptions o = Small(P);
    FitCaps caps{PlanMemory(WithSeqLen(o, 64 * P)).value().total(), 0};
    NMaxLimits limits;
    limits.max_seq_len = 4096 * P;
    const NMaxAxis worst = SolveNMax(o, caps, limits).value().context;
    caps.balanced_dispatch = true;
    const NMaxAxis balanced = SolveNMax(o, caps, limits).value().context;
    SCOPED_TRACE(::testing::Message() << "P=" << P);
    EXPECT_GT(balanced.seq_len, worst.seq_len);
    auto balanced_total = [&](int64_t seq_len) {
      const MemoryPlan p = PlanMemory(WithSeqLen(o, seq_len)).value();
      EXPECT_EQ(DeviceBytesAgainstCap(p, caps),
                p.total() - p.bytes[static_cast<int>(LiveSet::kDispatch)] + p.dispatch_balanced_bytes);
      return DeviceBytesAgainstCap(p, caps);
    };
    EXPECT_LE(balanced_total(balanced.seq_len), caps.device_bytes);
    EXPECT_GT(balanced_total(balanced.seq_len + P), caps.device_bytes);
    EXPECT_THAT(balanced.detail, HasSubstr("balanced case"));
    StepOptions pipelined = o;
    pipelined.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
    const MemoryPlan pp = PlanMemory(pipelined).value();
    EXPECT_EQ(DeviceBytesAgainstCap(pp, caps), pp.total());
  }
}

TEST(NMaxTest, NothingFitsReturnsZeroWithTheReason) {
  const StepOptions o = Small(2);
  // Below the weights, gradients and optimizer state alone.
  auto n = SolveNMax(o, {1000, 0});
  ASSERT_TRUE(n.ok()) << n.status();
  for (const NMaxAxis* a : {&n->batch, &n->context}) {
    EXPECT_EQ(a->tokens_per_rank, 0);
    EXPECT_EQ(a->limit, "device_memory_bytes");
    EXPECT_THAT(a->detail, HasSubstr("nothing fits"));
    EXPECT_THAT(a->detail, HasSubstr("optimizer="));
  }
  EXPECT_EQ(n->batch.batch, 0);
  EXPECT_EQ(n->batch.seq_len, o.model.seq_len);
  EXPECT_EQ(n->context.seq_len, 0);
  EXPECT_EQ(n->context.batch, o.layout.batch);
}

// OffloadStreamAdamW's host state does not grow with N: with only a host cap
// the plan fits at every shape and the validation limit ends the search.
TEST(NMaxTest, AFlatPlanStopsAtTheValidationLimit) {
  StepOptions o = Small(2);
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  NMaxLimits limits;
  limits.max_batch = 1000;  // not a power of two: the doubling stops at it
  limits.max_seq_len = 3001;
  auto n = SolveNMax(o, {0, int64_t{1} << 30}, limits);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->batch.batch, 1000);
  EXPECT_EQ(n->batch.limit, "layout.batch");
  EXPECT_EQ(n->context.seq_len, 3000);  // the largest multiple of P = 2
  EXPECT_EQ(n->context.limit, "model.seq_len");
}

// PipelinedLLEP's host index staging grows with N: a host cap binds.
TEST(NMaxTest, AHostCapBinds) {
  StepOptions o = Combination(2, 1);
  const FitCaps caps{0, PlanMemory(WithBatch(o, 30)).value().host_total()};
  NMaxLimits limits;
  limits.max_batch = 4096;
  auto n = SolveNMax(o, caps, limits);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->batch.limit, "host_memory_bytes");
  EXPECT_GE(n->batch.batch, 30);
  EXPECT_TRUE(FitsAt(WithBatch(o, n->batch.batch), caps));
  EXPECT_FALSE(FitsAt(WithBatch(o, n->batch.batch + 1), caps));
  EXPECT_THAT(n->batch.detail, HasSubstr("dispatch="));
}

TEST(NMaxTest, TheCheckEndsTheSearchWithItsMessage) {
  NMaxLimits limits;
  limits.check = [](const StepOptions& o) {
    return o.layout.batch > 5 ? absl::InvalidArgumentError("model: the job is too large to plan") : absl::OkStatus();
  };
  auto n = SolveNMax(Small(2), {int64_t{1} << 40, 0}, limits);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->batch.batch, 5);
  EXPECT_EQ(n->batch.limit, "refused");
  EXPECT_THAT(n->batch.detail, HasSubstr("too large to plan"));
}

// The caller's stop (NMaxLimits::still_wanted: the coordinator's RPC
// caller gone or past its deadline) ends the search at once with its
// status, not as an answer: no shape is checked or planned after it, and
// the call fails instead of returning an N_max made of "refused" limits.
TEST(NMaxTest, TheCallersStopEndsTheSearchWithItsStatus) {
  int asked = 0, checked = 0;
  NMaxLimits limits;
  limits.check = [&](const StepOptions&) {
    ++checked;
    return absl::OkStatus();
  };
  limits.still_wanted = [&] {
    return ++asked > 3 ? absl::DeadlineExceededError("the caller's deadline passed") : absl::OkStatus();
  };
  auto n = SolveNMax(Small(2), {int64_t{1} << 40, 0}, limits);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kDeadlineExceeded) << n.status();
  EXPECT_THAT(n.status().message(), HasSubstr("the caller's deadline passed"));
  EXPECT_EQ(asked, 4);
  EXPECT_EQ(checked, 3) << "a shape was checked after the stop";
}

// The same for the what-if table: the stop ends the whole table with its
// status, whatever its code. (A row's own INVALID_ARGUMENT, a combination
// the model cannot run, is a row that says why; the caller's stop is not,
// even with that code.)
TEST(NMaxTest, TheCallersStopEndsTheWhatIfTableNotARow) {
  for (const absl::StatusCode code : {absl::StatusCode::kCancelled, absl::StatusCode::kInvalidArgument}) {
    SCOPED_TRACE(absl::StatusCodeToString(code));
    int asked = 0;
    NMaxLimits limits;
    limits.max_batch = 4096;
    limits.max_seq_len = 1 << 16;
    // Through the first row's shapes and into the second's.
    limits.still_wanted = [&] { return ++asked > 30 ? absl::Status(code, "the caller went away") : absl::OkStatus(); };
    StepOptions o = Small(2);
    auto rows = WhatIfNMax(o, {PlanMemory(WithBatch(o, 8)).value().total(), 0}, limits);
    EXPECT_EQ(rows.status().code(), code) << (rows.ok() ? absl::StrCat(rows->size(), " rows") : "");
    EXPECT_EQ(asked, 31) << "the table went on after the stop";
  }
}

TEST(NMaxTest, BadInputsAreRefusedNamingTheField) {
  EXPECT_THAT(SolveNMax(Small(2), {0, 0}).status().message(), HasSubstr("device_memory_bytes"));
  StepOptions o = Small(2);
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.strip = 0;
  const absl::Status s = SolveNMax(o, {1 << 20, 0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("projection.ring_dtp.strip"));
}

// A model whose dense projection (N x V logits) and boundaries (L + 1 of
// them) dominate the per-token bytes: Ring-DTP and SCO each buy context,
// all four on buy the most.
TEST(NMaxTest, WhatIfSaysWhichScheduleBuysHowMuch) {
  StepOptions o = Small(2);
  o.model.vocab_size = 1000;
  o.model.layers = 24;
  o.model.hidden = 64;
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.chunk_tokens = 64;
  o.dispatch.pipelined.balance.min_piece = 16;
  o.dispatch.pipelined.balance.max_borrowed = 2;
  const FitCaps caps{PlanMemory(WithBatch(o, 8)).value().total(), 0};
  NMaxLimits limits;
  limits.max_batch = 4096;
  limits.max_seq_len = 1 << 16;
  auto rows = WhatIfNMax(o, caps, limits);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 6u);
  const char* names[] = {"all off", "pipelined_llep", "ring_dtp", "sco", "offload_stream_adamw", "all on"};
  for (size_t i = 0; i < rows->size(); ++i) EXPECT_EQ((*rows)[i].schedules, names[i]);
  const WhatIfRow &off = (*rows)[0], &ring = (*rows)[2], &sco = (*rows)[3], &opt = (*rows)[4], &on = (*rows)[5];
  // The spec's own settings where it chose the schedule, defaults elsewhere.
  EXPECT_THAT((*rows)[1].settings[0], HasSubstr("chunk_tokens=64 min_piece=16 max_borrowed=2 (the spec's)"));
  EXPECT_THAT(ring.settings[0], HasSubstr("strip=1000"));  // min(1024, V)
  EXPECT_THAT(ring.settings[0], HasSubstr("(default)"));
  EXPECT_THAT(sco.settings[0], HasSubstr("every boundary that can leave (23 of 25)"));
  EXPECT_EQ(on.settings.size(), 4u);
  for (auto axis : {&NMax::batch, &NMax::context}) {
    EXPECT_GT((ring.n_max.*axis).tokens_per_rank, (off.n_max.*axis).tokens_per_rank);
    EXPECT_GT((sco.n_max.*axis).tokens_per_rank, (off.n_max.*axis).tokens_per_rank);
    EXPECT_GT((on.n_max.*axis).tokens_per_rank, (ring.n_max.*axis).tokens_per_rank);
    EXPECT_GT((on.n_max.*axis).tokens_per_rank, (sco.n_max.*axis).tokens_per_rank);
    EXPECT_GT((opt.n_max.*axis).tokens_per_rank, (off.n_max.*axis).tokens_per_rank);
  }
  // The SCO row's budget follows N: at its answer, every boundary that can
  // leave is in the host pool, and the plan so configured is tight.
  StepOptions s = WithBatch(o, sco.n_max.batch.batch);
  s.dispatch.kind = DispatchOptions::Kind::kStandardEp;
  s.checkpoints.kind = CheckpointOptions::Kind::kSco;
  auto every = [](StepOptions x) {
    x.checkpoints.host_budget_bytes =
        PlanSco(x.model.layers, TokensPerRank(x.model, x.layout), x.model.hidden, int64_t{1} << 62).host_bytes();
    return x;
  };
  EXPECT_TRUE(FitsAt(every(s), caps));
  EXPECT_FALSE(FitsAt(every(WithBatch(s, s.layout.batch + 1)), caps));
}

// A host cap limits SCO's default budget to what the cap holds beside the
// other host terms, so that the row's plans fit the host.
TEST(NMaxTest, WhatIfScoBudgetStaysWithinTheHostCap) {
  StepOptions o = Small(2);
  o.model.layers = 12;
  const int64_t host_cap = 20000;
  auto rows = WhatIfNMax(o, {PlanMemory(WithBatch(o, 8)).value().total(), host_cap});
  ASSERT_TRUE(rows.ok()) << rows.status();
  const WhatIfRow& sco = (*rows)[3];
  EXPECT_THAT(sco.settings[0], HasSubstr("within the host cap"));
  EXPECT_NE(sco.n_max.batch.limit, "host_memory_bytes");
  EXPECT_GE(sco.n_max.batch.batch, 1);
}

}  // namespace
}  // namespace plateau
