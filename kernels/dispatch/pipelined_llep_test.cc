// PipelinedLLEP at P = 2 and 4 rank threads (and P = 1) across the routing
// skew sweep: outputs and every gradient against the double reference and
// standard EP; the measured kDispatch peak against the bound in Forward and
// in Backward; the realized receiver rows per chunk against Eq. 1 (P c k) and
// the borrowed experts against their bound; K = 1 bitwise LLEP; strided and
// contiguous membership equal to fp32 rounding; determinism; ranks with
// different N, without tokens, sent nothing; and the refusals. In bf16 mixed
// precision on varied inputs: K = 1 bitwise LLEP, every output and gradient
// against the store-rounded double reference (DispatchReferenceBf16), the
// peaks at the bf16 bound, determinism, and the expert gradients' fp32 sum
// over K > 1 chunks.
#include "kernels/dispatch/pipelined_llep.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch/dispatch_testing.h"
#include "kernels/dispatch/llep.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/dispatch/standard_ep.h"
#include "kernels/model/config.h"
#include "kernels/model/step_options.h"
#include "kernels/status_macros.h"
#include "kernels/testing/counting_communicator.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

ModelConfig SweepModel() {
  ModelConfig m = DispatchTestModel();
  m.experts = 16;
  return m;
}

PipelinedLlepOptions TestOptions(int64_t chunk_tokens = 4,
                                 ChunkMembership membership = ChunkMembership::kStrided) {
  PipelinedLlepOptions o;
  o.chunk_tokens = chunk_tokens;
  o.membership = membership;
  o.balance.alpha = 1.0;
  o.balance.min_piece = 2;
  o.balance.lambda = 1.0;
  return o;
}

std::vector<RoutingProfile> Sweep() {
  return {BalancedRouting(), HotRouting(50, 4), HotRouting(80, 16), HotRouting(100, 1)};
}

std::vector<int64_t> Tokens(int P, int64_t base = 24) {
  std::vector<int64_t> n;
  for (int p = 0; p < P; ++p) n.push_back(base - 5 * p);
  return n;
}

int64_t MaxTokens(const DispatchProblem& pr) {
  return pr.n.empty() ? 0 : *std::max_element(pr.n.begin(), pr.n.end());
}

// `e`: kBf16MixedElements for a bf16 run (RunDispatchBf16).
DispatchFactory PipelinedFactory(const PipelinedLlepOptions& o, int64_t max_tokens,
                                 const ElementBytes& e = kFp32Elements) {
  return [o, max_tokens, e](int, const ModelConfig& m, Backend& be, ModelKernels& k, Communicator& world,
                            Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
    absl::StatusOr<std::unique_ptr<PipelinedLlep>> d =
        PipelinedLlep::Create(m, o, max_tokens, be, k, world, compute, comm, e);
    if (!d.ok()) return d.status();
    return std::unique_ptr<ExpertDispatch>(std::move(*d));
  };
}

DispatchFactory LlepFactory(const LlepOptions& o, const ElementBytes& e = kFp32Elements) {
  return [o, e](int, const ModelConfig& m, Backend& be, ModelKernels& k, Communicator& world, Stream& compute,
                Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
    absl::StatusOr<std::unique_ptr<Llep>> d = Llep::Create(m, o, be, k, world, compute, comm, e);
    if (!d.ok()) return d.status();
    return std::unique_ptr<ExpertDispatch>(std::move(*d));
  };
}

DispatchFactory StandardEpFactory() {
  return [](int, const ModelConfig& m, Backend& be, ModelKernels& k, Communicator& world,
            Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
    return std::make_unique<StandardEp>(m, be, k, world, compute, comm);
  };
}

struct PipelinedRun {
  DispatchGot got;
  std::vector<int64_t> chunks;
  std::vector<LlepChunkSizes> max_sizes, slots;
};
// `bf16`: in bf16 mixed precision (RunDispatchBf16; the problem's values
// must be bf16: RoundedToBf16).
PipelinedRun RunPipelined(const DispatchProblem& pr, const PipelinedLlepOptions& o, int64_t max_tokens,
                          bool bf16 = false) {
  PipelinedRun r;
  r.chunks.assign(pr.P, -1);
  r.max_sizes.resize(pr.P);
  r.slots.resize(pr.P);
  const DispatchObserver observe = [&](int p, ExpertDispatch& d) {
    const PipelinedLlep& pl = static_cast<PipelinedLlep&>(d);
    r.chunks[p] = pl.chunks();
    r.max_sizes[p] = pl.max_chunk_sizes();
    r.slots[p] = pl.slot_sizes();
  };
  r.got = bf16 ? RunDispatchBf16(pr, PipelinedFactory(o, max_tokens, kBf16MixedElements), observe)
               : RunDispatch(pr, PipelinedFactory(o, max_tokens), observe);
  return r;
}

using Params = std::tuple<int, int>;  // P, profile index
class PipelinedLlepSweepTest : public ::testing::TestWithParam<Params> {};

TEST_P(PipelinedLlepSweepTest, MatchesTheReferenceWithinTheBound) {
  const auto [P, which] = GetParam();
  const RoutingProfile profile = Sweep()[which];
  const ModelConfig m = SweepModel();
  const PipelinedLlepOptions o = TestOptions();
  const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), profile, 500 + 10 * P + which);
  const int64_t max_n = MaxTokens(pr);
  // The launch is sized above this batch: N may be below N_max.
  const int64_t launch_n = max_n + 5;
  const PipelinedRun run = RunPipelined(pr, o, launch_n);
  if (HasFatalFailure()) return;
  ExpectMatchesReference(run.got, DispatchReference(pr));
  ExpectNearRuns(run.got, RunDispatch(pr, StandardEpFactory()), kDispatchGradTol);

  const int64_t bound = PipelinedLlepBoundBytes(m, P, launch_n, o);
  const int64_t c = o.chunk_tokens, k = m.top_k;
  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    // Every buffer is a launch-sized slot: the peak is the bound, exactly,
    // in Forward and in Backward (the replay reuses the slots).
    EXPECT_LE(run.got.peak_forward[p], bound);
    EXPECT_LE(run.got.peak_backward[p], bound);
    EXPECT_EQ(run.got.peak_forward[p], bound);
    EXPECT_EQ(run.got.peak_backward[p], bound);
    EXPECT_EQ(run.got.after[p], bound);  // the slots are the schedule's
    EXPECT_EQ(run.chunks[p], (max_n + c - 1) / c);
    // Eq. 1 and the borrowed-expert bound, as realized.
    EXPECT_LE(run.max_sizes[p].rows, P * c * k);
    EXPECT_LE(run.max_sizes[p].borrowed,
              LlepMaxBorrowed(m, P, P * c * k, o.balance));
    EXPECT_LE(run.max_sizes[p].lent, LlepMaxLent(m, P, P * c * k, o.balance));
    EXPECT_EQ(run.slots[p].rows, P * c * k);
  }
  int64_t rows = 0, borrowed = 0;
  for (int p = 0; p < P; ++p) {
    rows = std::max(rows, run.max_sizes[p].rows);
    borrowed = std::max(borrowed, run.max_sizes[p].borrowed);
  }
  std::cout << profile.Name() << ", P = " << P << ", N = " << max_n << " (launch " << launch_n
            << "), c = " << c
            << ": peak = bound = " << bound << " B; most rows received in a chunk " << rows
            << " of Eq. 1's " << P * c * k << "; most experts borrowed " << borrowed << " of "
            << LlepMaxBorrowed(m, P, P * c * k, o.balance) << "\n";
}

// Eq. 1 is reached, not only respected: with balancing off and every
// token's k routes to rank 0's experts, rank 0 receives exactly P c k rows
// in a full chunk (every rank sends its c tokens' k routes), in the slots
// sized for it, and the results are still the reference's.
TEST(PipelinedLlepTest, EqOneIsReachedWhenEveryRouteGoesToOneRank) {
  for (int P : {2, 4}) {
    SCOPED_TRACE(absl::StrCat("P = ", P));
    const ModelConfig m = SweepModel();
    // N = 6 tokens on every rank: chunks of c = 3 are full (K chunks take
    // N / K tokens each, whatever the membership).
    PipelinedLlepOptions o = TestOptions(/*chunk_tokens=*/3);
    o.balance.lambda = 1e9;  // never spill: rank 0 keeps every route
    const DispatchProblem pr = MakeDispatchProblem(m, P, Routing::kSkewed, 700 + P);
    ASSERT_GE(m.experts / P, m.top_k) << "rank 0 must own k experts";
    for (int64_t n : pr.n) ASSERT_EQ(n % o.chunk_tokens, 0) << "full chunks";
    const PipelinedRun run = RunPipelined(pr, o, MaxTokens(pr));
    if (HasFatalFailure()) return;
    ExpectMatchesReference(run.got, DispatchReference(pr));
    const int64_t c = o.chunk_tokens, k = m.top_k;
    EXPECT_EQ(run.max_sizes[0].rows, P * c * k);
    EXPECT_EQ(run.slots[0].rows, P * c * k);
    for (int p = 1; p < P; ++p) EXPECT_EQ(run.max_sizes[p].rows, 0) << "rank " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(All, PipelinedLlepSweepTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const ::testing::TestParamInfo<Params>& i) {
                           std::string name = Sweep()[std::get<1>(i.param)].Name();
                           std::replace_if(
                               name.begin(), name.end(),
                               [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); },
                               '_');
                           return absl::StrCat("P", std::get<0>(i.param), "_", name);
                         });

// max_borrowed = 1 across the sweep at P = 2 and 4: no rank borrows more
// than one expert in a chunk, the results are still standard EP's to fp32
// rounding, and the measured peak is the (smaller) capped bound in Forward
// and Backward. The sweep has chunks where an uncapped rank borrows two, so
// the cap changes assignments here.
TEST(PipelinedLlepTest, MaxBorrowedCapsTheBorrowedExpertsAndTheBound) {
  const ModelConfig m = SweepModel();
  int64_t uncapped_most = 0;
  for (int P : {2, 4}) {
    for (int which = 0; which < static_cast<int>(Sweep().size()); ++which) {
      const RoutingProfile profile = Sweep()[which];
      SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name()));
      const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), profile, 500 + 10 * P + which);
      PipelinedLlepOptions o = TestOptions();
      const PipelinedRun free = RunPipelined(pr, o, MaxTokens(pr));
      o.balance.max_borrowed = 1;
      const PipelinedRun run = RunPipelined(pr, o, MaxTokens(pr));
      if (HasFatalFailure()) return;
      ExpectMatchesReference(run.got, DispatchReference(pr));
      ExpectNearRuns(run.got, RunDispatch(pr, StandardEpFactory()), kDispatchGradTol);
      const int64_t bound = PipelinedLlepBoundBytes(m, P, MaxTokens(pr), o);
      o.balance.max_borrowed = 0;
      EXPECT_LT(bound, PipelinedLlepBoundBytes(m, P, MaxTokens(pr), o));
      for (int p = 0; p < P; ++p) {
        EXPECT_LE(run.max_sizes[p].borrowed, 1);
        EXPECT_LE(run.max_sizes[p].lent, P - 1);
        EXPECT_EQ(run.slots[p].borrowed, 1);
        EXPECT_LE(run.got.peak_forward[p], bound);
        EXPECT_LE(run.got.peak_backward[p], bound);
        EXPECT_EQ(run.got.peak(p), bound);  // launch-sized slots
        uncapped_most = std::max(uncapped_most, free.max_sizes[p].borrowed);
      }
    }
  }
  EXPECT_GE(uncapped_most, 2) << "the cap never bound: the test shows nothing";
}

// K = 1 (c >= N): the chunk is the layer, and every output and gradient is
// LLEP's bit for bit, expert-weight gradients included.
TEST(PipelinedLlepTest, OneChunkIsLlepBitForBit) {
  const ModelConfig m = SweepModel();
  for (int P : {2, 4}) {
    for (const RoutingProfile& profile : {HotRouting(50, 4), HotRouting(100, 1)}) {
      const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), profile, 61 + P);
      for (ChunkMembership mem : {ChunkMembership::kStrided, ChunkMembership::kContiguous}) {
        const PipelinedLlepOptions o = TestOptions(MaxTokens(pr), mem);
        const PipelinedRun run = RunPipelined(pr, o, MaxTokens(pr));
        EXPECT_EQ(run.chunks[0], 1);
        ExpectSameBits(run.got, RunDispatch(pr, LlepFactory(o.balance)),
                       absl::StrCat("P = ", P, ", ", profile.Name()));
        // The only chunk is every token in order, strided or not: no token
        // view is planned (it was, one [N, hidden] buffer too many), and
        // the run fits the smaller bound exactly.
        const int64_t bound = PipelinedLlepBoundBytes(m, P, MaxTokens(pr), o);
        EXPECT_EQ(bound, PipelinedLlepBoundBytes(m, P, MaxTokens(pr),
                                                 TestOptions(MaxTokens(pr), ChunkMembership::kContiguous)));
        for (int p = 0; p < P; ++p) {
          EXPECT_FALSE(run.slots[p].token_view);
          EXPECT_EQ(run.got.peak(p), bound);
        }
      }
    }
    // Two chunks: strided ones are scattered rows, gathered through the view.
    const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), HotRouting(50, 4), 61 + P);
    const int64_t c = (MaxTokens(pr) + 1) / 2;
    EXPECT_GT(PipelinedLlepBoundBytes(m, P, MaxTokens(pr), TestOptions(c, ChunkMembership::kStrided)),
              PipelinedLlepBoundBytes(m, P, MaxTokens(pr), TestOptions(c, ChunkMembership::kContiguous)));
    EXPECT_TRUE(RunPipelined(pr, TestOptions(c, ChunkMembership::kStrided), MaxTokens(pr)).slots[0].token_view);
  }
}

// Strided and contiguous chunks hold other tokens, so other pieces move and
// expert gradients sum in another order: equal to fp32 rounding. Each also
// equals LLEP (the K = 1 schedule) to rounding.
TEST(PipelinedLlepTest, StridedAndContiguousAgree) {
  const ModelConfig m = SweepModel();
  for (int P : {2, 4}) {
    // Scattered hot tokens, and hot tokens in runs (contiguous chunks then
    // hold all-hot and all-cold blocks; strided ones a share of each run).
    for (const RoutingProfile& profile : {HotRouting(80, 4), HotBlockRouting(50, 4, 2)}) {
      SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name()));
      const DispatchProblem pr = MakeProfileProblem(m, Tokens(P, 30), profile, 71 + P);
      const PipelinedRun strided = RunPipelined(pr, TestOptions(3), MaxTokens(pr));
      const PipelinedRun contiguous =
          RunPipelined(pr, TestOptions(3, ChunkMembership::kContiguous), MaxTokens(pr));
      EXPECT_EQ(strided.chunks[0], 10);
      ExpectNearRuns(strided.got, contiguous.got, kDispatchGradTol);
      ExpectNearRuns(strided.got, RunDispatch(pr, LlepFactory(TestOptions().balance)),
                     kDispatchGradTol);
    }
  }
}

// The step's recompute runs ForwardForBackward: PipelinedLLEP plans (the
// same collectives) but runs no chunk, and the Backward after it gives
// Backward-after-Forward's bits (the replay recomputes each chunk's expert
// forward either way), within the same bound. A caller's `out` is not
// touched.
class ForwardForBackwardOnly final : public WrappedDispatch {
 public:
  using WrappedDispatch::WrappedDispatch;
  absl::Status Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override {
    return inner().ForwardForBackward(u, chosen, gates, tokens, w, out);
  }
};

TEST(PipelinedLlepTest, ForwardForBackwardGivesTheSameBackward) {
  const ModelConfig m = SweepModel();
  for (int P : {1, 2, 4}) {
    for (const RoutingProfile& profile : {HotRouting(80, 4), HotRouting(100, 1)}) {
      SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name()));
      const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), profile, 131 + P);
      const PipelinedLlepOptions o = TestOptions(5);
      const DispatchFactory pipelined = PipelinedFactory(o, MaxTokens(pr));
      const DispatchGot full = RunDispatch(pr, pipelined);
      DispatchGot skip = RunDispatch(
          pr, [&](int p, const ModelConfig& mm, Backend& be, ModelKernels& k, Communicator& world,
                  Stream& compute,
                  Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
            absl::StatusOr<std::unique_ptr<ExpertDispatch>> d =
                pipelined(p, mm, be, k, world, compute, comm);
            if (!d.ok()) return d.status();
            return std::unique_ptr<ExpertDispatch>(new ForwardForBackwardOnly(std::move(*d)));
          });
      if (HasFatalFailure()) return;
      for (int p = 0; p < P; ++p) {
        EXPECT_EQ(skip.out[p], pr.out0[p]) << "rank " << p << ": out was written";
        EXPECT_EQ(skip.peak_backward[p], full.peak_backward[p]);
        EXPECT_EQ(skip.peak_backward[p], PipelinedLlepBoundBytes(m, P, MaxTokens(pr), o));
      }
      skip.out = full.out;  // compared above; the rest must be the same bits
      ExpectSameBits(skip, full, "ForwardForBackward + Backward against Forward + Backward");
    }
  }
}

TEST(PipelinedLlepTest, SameBitsRunToRun) {
  for (const RoutingProfile& profile : {BalancedRouting(), HotRouting(100, 1)}) {
    const DispatchProblem pr = MakeProfileProblem(SweepModel(), Tokens(4), profile, 78);
    ExpectSameBits(RunPipelined(pr, TestOptions(), MaxTokens(pr)).got,
                   RunPipelined(pr, TestOptions(), MaxTokens(pr)).got, profile.Name());
  }
}

// The point of the schedule: on a skewed layer LLEP's peak grows with the
// routes a rank is sent, PipelinedLLEP's stays at its bound, which does not
// grow with N (save 8 (P+1) E bytes of counts per chunk). min_piece = 8 keeps
// the borrowed-expert slots (min(E - E_p, P c k / min_piece) experts of 3HF
// floats each, for weights, gradients and lending) from dominating this tiny
// shape, where one expert's weights are as large as 7 rows' buffers.
TEST(PipelinedLlepTest, ItsPeakStaysFlatWhereLlepsGrows) {
  const ModelConfig m = SweepModel();
  const int P = 4;
  PipelinedLlepOptions o = TestOptions(4);
  o.balance.min_piece = 8;
  int64_t llep_peak[2] = {0, 0}, pl_peak[2] = {0, 0}, max_n[2] = {0, 0};
  for (int i : {0, 1}) {
    const DispatchProblem pr =
        MakeProfileProblem(m, Tokens(P, i == 0 ? 24 : 160), HotRouting(100, 1), 81);
    const DispatchGot llep = RunDispatch(pr, LlepFactory(o.balance));
    const PipelinedRun pl = RunPipelined(pr, o, MaxTokens(pr));
    if (HasFatalFailure()) return;
    ExpectNearRuns(pl.got, llep, kDispatchGradTol);
    int64_t rows = 0;
    for (int p = 0; p < P; ++p) {
      llep_peak[i] = std::max(llep_peak[i], llep.peak(p));
      pl_peak[i] = std::max(pl_peak[i], pl.got.peak(p));
      rows = std::max(rows, pl.max_sizes[p].rows);
    }
    max_n[i] = MaxTokens(pr);
    const int64_t bound = PipelinedLlepBoundBytes(m, P, max_n[i], o);
    EXPECT_EQ(pl_peak[i], bound);
    std::cout << "100%/1, P = " << P << ", N_max = " << max_n[i] << ", c = " << o.chunk_tokens
              << ", min_piece = " << o.balance.min_piece << ": LLEP peak " << llep_peak[i]
              << " B; PipelinedLLEP peak " << pl_peak[i] << " B = bound " << bound
              << " B; most rows a rank received in a chunk " << rows << " of Eq. 1's "
              << P * o.chunk_tokens * m.top_k << "\n";
  }
  EXPECT_GT(llep_peak[1], 4 * llep_peak[0]);
  EXPECT_LT(pl_peak[1], llep_peak[1] / 2);
  EXPECT_EQ(pl_peak[1] - pl_peak[0],
            8 * (P + 1) * m.experts *
                (PipelinedLlepChunks(max_n[1], 4) - PipelinedLlepChunks(max_n[0], 4)));
}

// Ranks with no tokens send nothing, yet run every chunk; a rank not needed
// as a helper and owning no chosen expert is sent nothing; nobody with
// tokens runs no chunk at all.
TEST(PipelinedLlepTest, EmptySendsAndARankSentNothing) {
  const ModelConfig m = SweepModel();
  {
    const DispatchProblem pr = MakeProfileProblem(m, {0, 13, 0, 9}, HotRouting(50, 4), 18);
    const PipelinedRun run = RunPipelined(pr, TestOptions(), 16);
    ExpectMatchesReference(run.got, DispatchReference(pr));
    EXPECT_EQ(run.chunks[0], 4);
    EXPECT_EQ(run.max_sizes[0].routes, 0);
  }
  {
    PipelinedLlepOptions o = TestOptions();
    o.balance.lambda = 1e9;
    const DispatchProblem pr = MakeProfileProblem(m, Tokens(4), HotRouting(100, 4), 19);
    const PipelinedRun run = RunPipelined(pr, o, MaxTokens(pr));
    ExpectMatchesReference(run.got, DispatchReference(pr));
    for (int p = 1; p < 4; ++p) EXPECT_EQ(run.max_sizes[p].rows, 0) << p;
  }
  {
    const DispatchProblem pr = MakeProfileProblem(m, {0, 0}, BalancedRouting(), 20);
    const PipelinedRun run = RunPipelined(pr, TestOptions(), 8);
    EXPECT_EQ(run.chunks[0], 0);
    EXPECT_EQ(run.chunks[1], 0);
  }
}

TEST(PipelinedLlepTest, BackwardWithoutForwardIsAFailedPrecondition) {
  ExpectBackwardNeedsForward(PipelinedFactory(TestOptions(), 6));
}

// More tokens than the launch sized the buffers for: every rank refuses, as
// every rank sees the same all-reduced N.
TEST(PipelinedLlepTest, MoreTokensThanTheLaunchIsRefusedEverywhere) {
  const ModelConfig m = SweepModel();
  const DispatchProblem pr = MakeProfileProblem(m, {6, 11}, BalancedRouting(), 21);
  absl::Status st = RunLocalWorld(
      2, 16 << 20, FreshStoreDir("pipelined_llep_over"),
      [&](int p, Backend& be, Communicator& world) -> absl::Status {
        auto compute = be.CreateStream("compute");
        auto comm = be.CreateStream("comm");
        auto kernels = ModelKernels::Create(be);
        if (!compute.ok() || !comm.ok() || !kernels.ok()) return absl::InternalError("setup");
        auto d = PipelinedLlep::Create(m, TestOptions(), 10, be, **kernels, world, **compute,
                                       **comm);
        if (!d.ok()) return d.status();
        absl::Status f =
            (*d)->Forward(nullptr, nullptr, nullptr, pr.n[p], ExpertWeights{}, nullptr);
        EXPECT_EQ(f.code(), absl::StatusCode::kInvalidArgument) << "rank " << p << ": " << f;
        EXPECT_THAT(f.message(), HasSubstr("11 tokens"));
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
}

// The same with one chunk at most (c >= the launch's tokens), where the
// group's N is read off the gathered counts instead of an all-reduce: the
// rank over the launch and the rank under it both refuse, naming the N.
TEST(PipelinedLlepTest, MoreTokensThanTheLaunchIsRefusedEverywhereWithOneChunk) {
  const ModelConfig m = SweepModel();
  const DispatchProblem pr = MakeProfileProblem(m, {6, 11}, BalancedRouting(), 21);
  absl::Status st = RunLocalWorld(
      2, 16 << 20, FreshStoreDir("pipelined_llep_over_one"),
      [&](int p, Backend& be, Communicator& world) -> absl::Status {
        auto compute = be.CreateStream("compute");
        auto comm = be.CreateStream("comm");
        auto kernels = ModelKernels::Create(be);
        if (!compute.ok() || !comm.ok() || !kernels.ok()) return absl::InternalError("setup");
        auto d = PipelinedLlep::Create(m, TestOptions(10), 10, be, **kernels, world, **compute,
                                       **comm);
        if (!d.ok()) return d.status();
        absl::Status f = (*d)->Forward(nullptr, pr.chosen[p].data(), nullptr, pr.n[p],
                                       ExpertWeights{}, nullptr);
        EXPECT_EQ(f.code(), absl::StatusCode::kInvalidArgument) << "rank " << p << ": " << f;
        EXPECT_THAT(f.message(), HasSubstr("11 tokens"));
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
}

// With one chunk at most (c >= the launch's tokens), Plan reads the group's
// largest N off the gathered counts instead of an all-reduce first: one
// host-blocking round trip fewer per Forward, the same gathers, and the same
// outputs (OneChunkIsLlepBitForBit checks those against LLEP).
TEST(PipelinedLlepTest, OneChunkPlansWithoutTheAllReduce) {
  const ModelConfig m = SweepModel();
  const DispatchProblem pr = MakeProfileProblem(m, {10, 7}, BalancedRouting(), 23);
  auto counted = [&](int64_t c) {
    std::vector<CountingCommunicator::Table> tables(pr.P);
    std::vector<std::unique_ptr<CountingCommunicator>> worlds(pr.P);
    const DispatchFactory pipelined = PipelinedFactory(TestOptions(c), MaxTokens(pr));
    RunDispatch(pr, [&](int p, const ModelConfig& mc, Backend& be, ModelKernels& k, Communicator& world,
                        Stream& compute, Stream& comm) {
      worlds[p] = std::make_unique<CountingCommunicator>(world, &tables[p]);
      return pipelined(p, mc, be, k, *worlds[p], compute, comm);
    });
    std::vector<CountingCommunicator::Counts> counts;
    for (auto& t : tables) counts.push_back(t.Read());
    return counts;
  };
  const auto one = counted(MaxTokens(pr));  // K = 1
  const auto three = counted(3);            // K = 4
  for (int p = 0; p < pr.P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    auto n = [](const CountingCommunicator::Counts& c, const char* op) {
      return c.count(op) ? c.at(op) : int64_t{0};
    };
    EXPECT_EQ(n(one[p], "all_reduce") + 1, n(three[p], "all_reduce")) << "one all-reduce fewer (Forward's K)";
    EXPECT_EQ(n(one[p], "all_gather"), n(three[p], "all_gather")) << "the counts are gathered either way";
    EXPECT_GT(n(one[p], "all_gather"), 0);
  }
}

// The step's order for a layer: Forward, then (the recompute)
// `recomputes` ForwardForBackward before the Backward, each naming layer 1
// when `named` (SetLayer). A second recompute finds nothing kept (used
// once), so it plans from collectives again; the Backward replays the last
// plan: the bits are checked with one recompute, so that the Backward
// replays the plan made from the kept counts.
class ForwardThenRecompute final : public WrappedDispatch {
 public:
  ForwardThenRecompute(std::unique_ptr<ExpertDispatch> d, bool named, int recomputes)
      : WrappedDispatch(std::move(d)), named_(named), recomputes_(recomputes) {}
  absl::Status Forward(const float* u, const int32_t* chosen, const float* gates, int64_t tokens,
                       const ExpertWeights& w, float* out) override {
    Name();
    PLATEAU_RETURN_IF_ERROR(inner().Forward(u, chosen, gates, tokens, w, out));
    inner().Release();
    for (int i = 0; i < recomputes_; ++i) {
      Name();
      PLATEAU_RETURN_IF_ERROR(inner().ForwardForBackward(u, chosen, gates, tokens, w, nullptr));
    }
    return absl::OkStatus();
  }

 private:
  void Name() {
    if (named_) inner().SetLayer(1);
  }
  const bool named_;
  const int recomputes_;
};

// The recompute of a named layer plans from the counts its Forward kept:
// one all-gather fewer (and with K > 1 one all-reduce fewer) than planning
// afresh, used once, and the same bits as Forward + Backward.
TEST(PipelinedLlepTest, TheRecomputeReusesTheForwardsCountsBitForBit) {
  const ModelConfig m = SweepModel();
  ASSERT_GE(m.layers, 2);
  for (int P : {2, 4}) {
    const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), HotRouting(80, 4), 141 + P);
    for (int64_t c : {MaxTokens(pr), int64_t{5}}) {  // one chunk; K = 5
      SCOPED_TRACE(absl::StrCat("P = ", P, ", c = ", c));
      const DispatchFactory pipelined = PipelinedFactory(TestOptions(c), MaxTokens(pr));
      const DispatchGot plain = RunDispatch(pr, pipelined);
      DispatchGot got[2], twice[2];  // one recompute; two (for the counts)
      CountingCommunicator::Counts counts[2];  // rank 0's, with two recomputes
      for (int named : {0, 1}) {
        got[named] = RunDispatch(
            pr, [&](int p, const ModelConfig& mc, Backend& be, ModelKernels& k, Communicator& world,
                    Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
              absl::StatusOr<std::unique_ptr<ExpertDispatch>> d = pipelined(p, mc, be, k, world, compute, comm);
              if (!d.ok()) return d.status();
              return std::unique_ptr<ExpertDispatch>(new ForwardThenRecompute(std::move(*d), named, 1));
            });
        std::vector<CountingCommunicator::Table> tables(pr.P);
        std::vector<std::unique_ptr<CountingCommunicator>> worlds(pr.P);
        twice[named] = RunDispatch(
            pr, [&](int p, const ModelConfig& mc, Backend& be, ModelKernels& k, Communicator& world,
                    Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
              worlds[p] = std::make_unique<CountingCommunicator>(world, &tables[p]);
              absl::StatusOr<std::unique_ptr<ExpertDispatch>> d =
                  pipelined(p, mc, be, k, *worlds[p], compute, comm);
              if (!d.ok()) return d.status();
              return std::unique_ptr<ExpertDispatch>(new ForwardThenRecompute(std::move(*d), named, 2));
            });
        counts[named] = tables[0].Read();
      }
      if (HasFatalFailure()) return;
      auto n = [](const CountingCommunicator::Counts& c, const char* op) {
        return c.count(op) ? c.at(op) : int64_t{0};
      };
      const bool one_chunk = c >= MaxTokens(pr);
      EXPECT_EQ(n(counts[0], "all_gather"), 3);  // Forward and both recomputes
      EXPECT_EQ(n(counts[1], "all_gather"), 2) << "the first recompute gathers nothing";
      EXPECT_EQ(n(counts[0], "all_reduce"), one_chunk ? 0 : 3);
      EXPECT_EQ(n(counts[1], "all_reduce"), one_chunk ? 0 : 2);
      EXPECT_EQ(n(counts[1], "all_to_all_v"), n(counts[0], "all_to_all_v"));
      EXPECT_GT(n(counts[1], "all_to_all_v"), 0);
      for (int p = 0; p < P; ++p) {
        EXPECT_EQ(got[1].peak_backward[p], PipelinedLlepBoundBytes(m, P, MaxTokens(pr), TestOptions(c)));
      }
      ExpectSameBits(got[0], plain, "planned afresh against Forward + Backward");
      ExpectSameBits(got[1], plain, "the kept counts against Forward + Backward");
      ExpectSameBits(twice[1], plain, "a second recompute, planned afresh");
    }
  }
}

// A recompute that routes otherwise than its forward (here: every route
// moved to the next expert, on every rank, so that every rank sees it
// before any collective) is INTERNAL naming the layer, never a plan from
// counts that are not the routes'. Without the layer named the same call
// plans afresh and succeeds: the check is what refuses.
TEST(PipelinedLlepTest, ARecomputeRoutedOtherwiseThanItsForwardIsInternal) {
  const ModelConfig m = SweepModel();
  const DispatchProblem pr = MakeProfileProblem(m, {6, 5}, HotRouting(50, 4), 29);
  for (int64_t c : {int64_t{6}, int64_t{2}}) {  // one chunk; K = 3
    for (bool named : {true, false}) {
      SCOPED_TRACE(absl::StrCat("c = ", c, named ? ", layer named" : ", no layer"));
      absl::Status st = RunLocalWorld(
          pr.P, 16 << 20, FreshStoreDir("pipelined_llep_reroute"),
          [&](int p, Backend& be, Communicator& world) -> absl::Status {
            PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
            PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
            PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
            const int64_t n = pr.n[p], H = m.hidden, K = m.top_k;
            const int64_t local = (m.experts / pr.P) * H * m.expert_ffn;
            // Zero rows and weights (the values do not matter here), on the
            // CPU backend's device.
            PLATEAU_ASSIGN_OR_RETURN(
                Buffer io, be.device().Allocate(LiveSet::kActivations, (2 * n * H + n * K) * sizeof(float)));
            PLATEAU_ASSIGN_OR_RETURN(Buffer ws, be.device().Allocate(LiveSet::kWeights, 3 * local * sizeof(float)));
            std::fill_n(io.as<float>(), 2 * n * H + n * K, 0.0f);
            std::fill_n(ws.as<float>(), 3 * local, 0.0f);
            const float* u = io.as<float>();
            float* out = io.as<float>() + n * H;
            const float* gates = out + n * H;
            const ExpertWeights w{ws.as<float>(), ws.as<float>() + local, ws.as<float>() + 2 * local};
            std::vector<int32_t> moved = pr.chosen[p];
            for (int32_t& e : moved) e = static_cast<int32_t>((e + 1) % m.experts);
            PLATEAU_ASSIGN_OR_RETURN(auto d, PipelinedLlep::Create(m, TestOptions(c), 6, be, *kernels, world,
                                                                   *compute, *comm));
            if (named) d->SetLayer(0);
            PLATEAU_RETURN_IF_ERROR(d->Forward(u, pr.chosen[p].data(), gates, n, w, out));
            d->Release();
            if (named) d->SetLayer(0);
            absl::Status again = d->ForwardForBackward(u, moved.data(), gates, n, w, nullptr);
            if (named) {
              EXPECT_EQ(again.code(), absl::StatusCode::kInternal) << "rank " << p << ": " << again;
              EXPECT_THAT(again.message(), HasSubstr("recompute of layer 0 routes differently"));
            } else {
              EXPECT_TRUE(again.ok()) << "rank " << p << ": " << again;
            }
            d->Release();
            PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
            return comm->Synchronize();
          });
      EXPECT_TRUE(st.ok()) << st;
    }
  }
}

// bf16 mixed: one rank's run of PipelinedLLEP on bf16 rows and weights,
// every token the same row routed to experts 0..k-1 with the same gates and
// output gradient, gradients starting at 0. Returns the global expert
// gradients [gate | up | down] as floats, and each rank's backward peak.
struct Bf16Run {
  std::vector<float> grads;
  std::vector<int64_t> peak_backward;
  std::vector<int64_t> borrowed, lent;  // per rank: the most experts a chunk borrowed / lent
};
Bf16Run RunSameTokensBf16(const ModelConfig& m, int P, int64_t n, const PipelinedLlepOptions& o) {
  const int64_t H = m.hidden, F = m.expert_ffn, K = m.top_k, Ep = m.experts / P, HF = H * F;
  Bf16Run r;
  r.grads.assign(3 * m.experts * HF, 0.0f);
  r.peak_backward.assign(P, -1);
  r.borrowed.assign(P, -1);
  r.lent.assign(P, -1);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const auto random_bf16 = [&](int64_t count, float scale) {
    std::vector<Bf16> v(count);
    for (Bf16& x : v) x = FloatToBf16(scale * uni(rng));
    return v;
  };
  const std::vector<Bf16> row = random_bf16(H, 1.0f), drow = random_bf16(H, 1.0f);
  const std::vector<Bf16> wg = random_bf16(m.experts * HF, 0.3f), wu = random_bf16(m.experts * HF, 0.3f),
                          wd = random_bf16(m.experts * HF, 0.3f);
  const absl::Status st = RunLocalWorld(
      P, 256 << 20, FreshStoreDir("pipelined_bf16"), [&](int p, Backend& be, Communicator& world) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
        const auto upload = [&](LiveSet set, const auto* host, int64_t count) -> absl::StatusOr<Buffer> {
          PLATEAU_ASSIGN_OR_RETURN(Buffer b, be.device().Allocate(set, count * sizeof(*host)));
          std::memcpy(b.data(), host, count * sizeof(*host));  // the CPU backend's device is host memory
          return b;
        };
        std::vector<Bf16> u(n * H), dout(n * H);
        for (int64_t t = 0; t < n; ++t) {
          std::copy(row.begin(), row.end(), u.begin() + t * H);
          std::copy(drow.begin(), drow.end(), dout.begin() + t * H);
        }
        std::vector<int32_t> chosen(n * K);
        std::vector<float> gates(n * K);
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t j = 0; j < K; ++j) {
            chosen[t * K + j] = static_cast<int32_t>(j);
            gates[t * K + j] = 1.0f / static_cast<float>(j + 2);
          }
        }
        const std::vector<Bf16> zeros(std::max(n * H, Ep * HF), Bf16{});
        PLATEAU_ASSIGN_OR_RETURN(Buffer bu, upload(LiveSet::kActivations, u.data(), n * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bdout, upload(LiveSet::kActivations, dout.data(), n * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bchosen, upload(LiveSet::kActivations, chosen.data(), n * K));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bgates, upload(LiveSet::kActivations, gates.data(), n * K));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bout, upload(LiveSet::kActivations, zeros.data(), n * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bdu, upload(LiveSet::kActivations, zeros.data(), n * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer bdg, upload(LiveSet::kActivations, gates.data(), n * K));
        std::vector<Buffer> w, g;
        for (const std::vector<Bf16>* all : {&wg, &wu, &wd}) {
          PLATEAU_ASSIGN_OR_RETURN(Buffer b, upload(LiveSet::kWeights, all->data() + p * Ep * HF, Ep * HF));
          w.push_back(std::move(b));
          PLATEAU_ASSIGN_OR_RETURN(Buffer z, upload(LiveSet::kGrads, zeros.data(), Ep * HF));
          g.push_back(std::move(z));
        }
        const ExpertWeightsT<Bf16> ew{w[0].as<Bf16>(), w[1].as<Bf16>(), w[2].as<Bf16>()};
        const ExpertGradsT<Bf16> eg{g[0].as<Bf16>(), g[1].as<Bf16>(), g[2].as<Bf16>()};
        PLATEAU_ASSIGN_OR_RETURN(
            std::unique_ptr<PipelinedLlep> d,
            PipelinedLlep::Create(m, o, n, be, *kernels, world, *compute, *comm, kBf16MixedElements));
        PLATEAU_RETURN_IF_ERROR(
            d->Forward(bu.as<Bf16>(), bchosen.as<int32_t>(), bgates.as<float>(), n, ew, bout.as<Bf16>()));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        r.borrowed[p] = d->max_chunk_sizes().borrowed;
        r.lent[p] = d->max_chunk_sizes().lent;
        be.device().tracker().ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(d->Backward(bdout.as<Bf16>(), ew, bdu.as<Bf16>(), bdg.as<float>(), eg));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        r.peak_backward[p] = be.device().tracker().peak(LiveSet::kDispatch);
        for (int part = 0; part < 3; ++part) {
          const Bf16* got = g[part].as<Bf16>();
          for (int64_t i = 0; i < Ep * HF; ++i) r.grads[part * m.experts * HF + p * Ep * HF + i] = Bf16ToFloat(got[i]);
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  return r;
}

// Under bf16 an own expert's weight gradient sums over K > 1 chunks in fp32
// and rounds once. Here every chunk adds the same terms (the same token
// everywhere), where a bf16 sum rounded at each chunk drifts furthest: at
// K = 64 it must still give the one-chunk gradient (K = 1: one GEMM over
// every token, LLEP's bits) to within two bf16 units, helpers included
// (P = 2: rank 1 helps with rank 0's hot experts). Rounded per chunk, the
// sums were off by up to 1/16 relative. The fp32 accumulators are part of
// the bound, which the measured backward peak meets.
TEST(PipelinedLlepTest, Bf16ExpertGradientsSumInFp32AcrossChunks) {
  const ModelConfig m = DispatchTestModel();
  const int P = 2;
  const int64_t n = 512;
  const Bf16Run one = RunSameTokensBf16(m, P, n, TestOptions(n));
  const PipelinedLlepOptions chunked = TestOptions(8);
  ASSERT_EQ(PipelinedLlepChunks(n, chunked.chunk_tokens), 64);
  const Bf16Run many = RunSameTokensBf16(m, P, n, chunked);
  ASSERT_EQ(one.grads.size(), many.grads.size());
  // Helpers took part: rank 1 borrowed rank 0's hot experts in some chunk
  // (their gradients came home through the fp32 accumulators' scratch).
  EXPECT_GT(many.borrowed[1], 0);
  EXPECT_GT(many.lent[0], 0);
  double worst = 0;
  int64_t nonzero = 0;
  for (size_t i = 0; i < one.grads.size(); ++i) {
    const double want = one.grads[i], got = many.grads[i];
    if (want == 0) {
      EXPECT_EQ(got, 0) << "element " << i;
      continue;
    }
    ++nonzero;
    worst = std::max(worst, std::abs(got - want) / std::abs(want));
  }
  EXPECT_GT(nonzero, 0);
  EXPECT_LE(worst, std::ldexp(1.0, -7)) << "K = 64 against K = 1, relative";
  std::cout << "bf16 expert gradients, K = 64 against K = 1: worst relative difference " << worst << "\n";
  EXPECT_TRUE(PipelinedLlepAccumulatesInFp32(n, chunked, kBf16MixedElements));
  EXPECT_FALSE(PipelinedLlepAccumulatesInFp32(n, TestOptions(n), kBf16MixedElements));
  EXPECT_FALSE(PipelinedLlepAccumulatesInFp32(n, chunked, kFp32Elements));
  const int64_t bound = PipelinedLlepBoundBytes(m, P, n, chunked, kBf16MixedElements);
  for (int p = 0; p < P; ++p) EXPECT_EQ(many.peak_backward[p], bound) << "rank " << p;
}

// bf16 mixed on varied inputs: MakeProfileProblem's rows, weights, output
// gradients and starting values (different on every rank, N = 24, 19
// (, 14, 9) tokens) rounded to bf16, its gates fp32, under hot routing
// (50% of the tokens to 4 hot experts) and skewed routing (every token to
// one hot expert), at P = 2 and 4.
std::vector<RoutingProfile> Bf16Profiles() { return {HotRouting(50, 4), HotRouting(100, 1)}; }

// K = 1 (c >= N): PipelinedLLEP is LLEP bit for bit in bf16 too, strided
// or contiguous, every output and gradient, helpers' included. The launch
// is sized for two chunks (N below N_max), so the fp32 gradient
// accumulators exist, and one chunk must still not use them (LLEP adds a
// helper's gradient in bf16). The peak is the bound at the bf16 element
// sizes, in Forward and Backward.
TEST(PipelinedLlepTest, Bf16OneChunkIsLlepBitForBit) {
  const ModelConfig m = SweepModel();
  int64_t borrowed = 0;
  for (int P : {2, 4}) {
    for (const RoutingProfile& profile : Bf16Profiles()) {
      const DispatchProblem pr = RoundedToBf16(MakeProfileProblem(m, Tokens(P), profile, 161 + P));
      const int64_t launch = MaxTokens(pr) + 5;
      for (ChunkMembership mem : {ChunkMembership::kStrided, ChunkMembership::kContiguous}) {
        SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name(),
                                  mem == ChunkMembership::kStrided ? ", strided" : ", contiguous"));
        const PipelinedLlepOptions o = TestOptions(MaxTokens(pr), mem);
        ASSERT_TRUE(PipelinedLlepAccumulatesInFp32(launch, o, kBf16MixedElements));
        const PipelinedRun run = RunPipelined(pr, o, launch, /*bf16=*/true);
        if (HasFatalFailure()) return;
        EXPECT_EQ(run.chunks[0], 1);
        ExpectSameBits(run.got, RunDispatchBf16(pr, LlepFactory(o.balance, kBf16MixedElements)), "bf16 against LLEP");
        for (int p = 0; p < P; ++p) borrowed = std::max(borrowed, run.max_sizes[p].borrowed);
        const int64_t bound = PipelinedLlepBoundBytes(m, P, launch, o, kBf16MixedElements);
        for (int p = 0; p < P; ++p) {
          EXPECT_LE(run.got.peak_forward[p], bound) << "rank " << p;
          EXPECT_LE(run.got.peak_backward[p], bound) << "rank " << p;
          EXPECT_EQ(run.got.peak(p), bound) << "rank " << p << ": launch-sized slots";
        }
      }
    }
  }
  EXPECT_GT(borrowed, 0) << "no rank borrowed an expert: the helpers' gradients were not compared";
}

// Every output and gradient against the double reference that rounds to
// bf16 where the schedule stores bf16, within the bounds that
// DispatchReferenceBf16 derives (dispatch_testing.h): out and du the
// reference's stored values except where a rounding boundary lies within
// the fp32 arithmetic's bound (there the next value either side), dgates
// within the propagated bound, the expert gradients within the propagated,
// fp32 and two bf16 roundings' bounds; at one chunk (LLEP's sums: the
// helpers' gradients added in one fp32 sum) and over K = 6 chunks (the
// fp32 accumulators). Helpers must take part, and the measured peak is the
// bound at the bf16 element sizes, in Forward and in Backward.
TEST(PipelinedLlepTest, Bf16WithinTheStoreRoundedReference) {
  const ModelConfig m = SweepModel();
  int64_t borrowed = 0;
  for (int P : {2, 4}) {
    for (const RoutingProfile& profile : Bf16Profiles()) {
      const DispatchProblem pr = RoundedToBf16(MakeProfileProblem(m, Tokens(P), profile, 171 + P));
      for (int64_t c : {MaxTokens(pr), int64_t{4}}) {
        SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name(), ", c = ", c));
        const PipelinedLlepOptions o = TestOptions(c);
        const PipelinedRun run = RunPipelined(pr, o, MaxTokens(pr), /*bf16=*/true);
        if (HasFatalFailure()) return;
        EXPECT_EQ(run.chunks[0], PipelinedLlepChunks(MaxTokens(pr), c));
        EXPECT_EQ(PipelinedLlepAccumulatesInFp32(MaxTokens(pr), o, kBf16MixedElements), run.chunks[0] > 1);
        ExpectWithinBf16Reference(run.got, DispatchReferenceBf16(pr, run.chunks[0]));
        const int64_t bound = PipelinedLlepBoundBytes(m, P, MaxTokens(pr), o, kBf16MixedElements);
        for (int p = 0; p < P; ++p) {
          EXPECT_LE(run.got.peak_forward[p], bound) << "rank " << p;
          EXPECT_LE(run.got.peak_backward[p], bound) << "rank " << p;
          EXPECT_EQ(run.got.peak_forward[p], bound) << "rank " << p << ": launch-sized slots";
          EXPECT_EQ(run.got.peak_backward[p], bound) << "rank " << p << ": launch-sized slots";
          borrowed = std::max(borrowed, run.max_sizes[p].borrowed);
        }
      }
    }
  }
  EXPECT_GT(borrowed, 0) << "no rank borrowed an expert: the helpers' gradients were not tested";
}

// LLEP (K = 1) in bf16 where one expert is lent to every other rank and
// the helpers' terms are alike: P = 8, every token the same row, output
// gradient and gates, its first choice one hot expert of rank 0, the
// gradients starting at 0. Each rank stores its partial gradient of the hot
// expert once (alike values); the owner adds the seven helpers' in one fp32
// sum and rounds once: within the store-rounded reference's two roundings.
// Added one rounding at a time (until session 35) the sum lost up to a
// rounding of the growing total per helper, and fell outside.
TEST(PipelinedLlepTest, Bf16HelpersGradientsAddInOneFp32Sum) {
  const ModelConfig m = SweepModel();
  const int P = 8;
  DispatchProblem pr = MakeProfileProblem(m, std::vector<int64_t>(P, 24), HotRouting(100, 1), 181);
  const int64_t H = m.hidden;
  for (int p = 0; p < P; ++p) {
    for (int64_t t = 0; t < pr.n[p]; ++t) {
      std::copy_n(pr.u[0].begin(), H, pr.u[p].begin() + t * H);
      std::copy_n(pr.dout[0].begin(), H, pr.dout[p].begin() + t * H);
      std::copy_n(pr.gates[0].begin(), m.top_k, pr.gates[p].begin() + t * m.top_k);
    }
  }
  for (std::vector<float>* g : {&pr.gg0, &pr.gu0, &pr.gd0}) std::fill(g->begin(), g->end(), 0.0f);
  pr = RoundedToBf16(std::move(pr));
  LlepOptions o = TestOptions().balance;
  size_t holders = 0;  // the most ranks holding a piece of one expert
  const DispatchGot got = RunDispatchBf16(pr, LlepFactory(o, kBf16MixedElements), [&](int p, ExpertDispatch& d) {
    if (p != 0) return;
    for (const std::vector<LlepPiece>& pieces : static_cast<Llep&>(d).assignment().pieces) {
      std::set<int32_t> ranks;
      for (const LlepPiece& q : pieces) ranks.insert(q.rank);
      holders = std::max(holders, ranks.size());
    }
  });
  if (HasFatalFailure()) return;
  EXPECT_EQ(holders, static_cast<size_t>(P)) << "no expert was lent to every other rank";
  const DispatchBf16Want want = DispatchReferenceBf16(pr, 1);
  ExpectWithinBf16Reference(got, want);
  double diff = 0, mag = 0;  // the expert gradients' relative L1 error against the reference
  for (const auto& [g, w] :
       {std::make_pair(&got.gg, &want.gg), std::make_pair(&got.gu, &want.gu), std::make_pair(&got.gd, &want.gd)}) {
    for (size_t i = 0; i < w->size(); ++i) diff += std::abs((*g)[i] - (*w)[i]), mag += std::abs((*w)[i]);
  }
  std::cout << "bf16 LLEP, P = 8, one expert lent to every rank: expert gradients sum |got - ref| / sum |ref| = "
            << diff / mag << "\n";
}

// bf16, the same bits run to run (K = 6 chunks, helpers and the fp32
// accumulators in the run).
TEST(PipelinedLlepTest, Bf16SameBitsRunToRun) {
  for (const RoutingProfile& profile : {BalancedRouting(), HotRouting(100, 1)}) {
    const DispatchProblem pr = RoundedToBf16(MakeProfileProblem(SweepModel(), Tokens(4), profile, 78));
    ASSERT_TRUE(PipelinedLlepAccumulatesInFp32(MaxTokens(pr), TestOptions(), kBf16MixedElements));
    ExpectSameBits(RunPipelined(pr, TestOptions(), MaxTokens(pr), /*bf16=*/true).got,
                   RunPipelined(pr, TestOptions(), MaxTokens(pr), /*bf16=*/true).got, profile.Name());
  }
}

TEST(PipelinedLlepTest, CreateRefusesBadOptionsNamingTheField) {
  absl::Status st = RunLocalWorld(
      1, 1 << 20, FreshStoreDir("pipelined_llep_create"),
      [](int, Backend& be, Communicator& world) -> absl::Status {
        auto compute = be.CreateStream("compute");
        auto comm = be.CreateStream("comm");
        auto kernels = ModelKernels::Create(be);
        if (!compute.ok() || !comm.ok() || !kernels.ok()) return absl::InternalError("setup");
        struct Case {
          PipelinedLlepOptions o;
          int64_t max_tokens;
          const char* field;
        };
        PipelinedLlepOptions c0 = TestOptions(0), alpha = TestOptions(), piece = TestOptions(),
                             lambda = TestOptions();
        alpha.balance.alpha = -1.0;
        piece.balance.min_piece = 0;
        lambda.balance.lambda = 0.0;
        for (const Case& c : {Case{c0, 8, "schedule.pipelined_llep.chunk_tokens"},
                              Case{alpha, 8, "schedule.pipelined_llep.alpha"},
                              Case{piece, 8, "schedule.pipelined_llep.min_piece"},
                              Case{lambda, 8, "schedule.pipelined_llep.lambda"},
                              Case{TestOptions(), -1, "max_tokens"}}) {
          auto d = PipelinedLlep::Create(SweepModel(), c.o, c.max_tokens, be, **kernels, world,
                                         **compute, **comm);
          EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
          EXPECT_THAT(d.status().message(), HasSubstr(c.field));
        }
        // A launch too large for the device: the bound's allocation says so.
        auto d = PipelinedLlep::Create(SweepModel(), TestOptions(4096), 1 << 20, be, **kernels,
                                       world, **compute, **comm);
        EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
        EXPECT_THAT(d.status().message(), HasSubstr("dispatch"));
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace plateau
