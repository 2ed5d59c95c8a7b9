// LLEP at P = 1, 2, 4 rank threads (Gloo over loopback) across the routing
// skew sweep: the output and every gradient against the double reference
// and against standard EP, the measured kDispatch peak against LlepPeakBytes
// of the realized sizes (exactly) and the worst case, determinism, ranks
// without tokens or without rows, and the refusals.
#include "kernels/dispatch/llep.h"

#include <algorithm>
#include <cctype>
#include <iostream>
#include <memory>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/model/step_options.h"
#include "kernels/dispatch/dispatch_testing.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/dispatch/standard_ep.h"
#include "kernels/model/config.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// 16 experts so that the 80%/16 profile exists; at P = 4 a rank owns 4.
ModelConfig SweepModel() {
  ModelConfig m = DispatchTestModel();
  m.experts = 16;
  return m;
}

// Small pieces so that the tiny shapes spill.
LlepOptions TestOptions() {
  LlepOptions o;
  o.alpha = 1.0;
  o.min_piece = 2;
  o.lambda = 1.0;
  return o;
}

std::vector<RoutingProfile> Sweep() {
  return {BalancedRouting(), HotRouting(50, 4), HotRouting(80, 16), HotRouting(100, 1)};
}

// Distinct N per rank.
std::vector<int64_t> Tokens(int P, int64_t base = 24) {
  std::vector<int64_t> n;
  for (int p = 0; p < P; ++p) n.push_back(base - 5 * p);
  return n;
}

DispatchFactory LlepFactory(const LlepOptions& o) {
  return [o](int, const ModelConfig& m, Backend& be, ModelKernels& k, Communicator& world,
             Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
    absl::StatusOr<std::unique_ptr<Llep>> d = Llep::Create(m, o, be, k, world, compute, comm);
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

// LLEP with its realized sizes and assignment per rank.
struct LlepRun {
  DispatchGot got;
  std::vector<LlepChunkSizes> sizes;
  std::vector<LlepAssignment> assignment;
};
LlepRun RunLlep(const DispatchProblem& pr, const LlepOptions& o) {
  LlepRun r;
  r.sizes.resize(pr.P);
  r.assignment.resize(pr.P);
  r.got = RunDispatch(pr, LlepFactory(o), [&](int p, ExpertDispatch& d) {
    r.sizes[p] = static_cast<Llep&>(d).sizes();
    r.assignment[p] = static_cast<Llep&>(d).assignment();
  });
  return r;
}

using Params = std::tuple<int, int>;  // P, profile index
class LlepSweepTest : public ::testing::TestWithParam<Params> {};

TEST_P(LlepSweepTest, MatchesTheReferenceAndStandardEpAndItsPeak) {
  const auto [P, which] = GetParam();
  const RoutingProfile profile = Sweep()[which];
  const ModelConfig m = SweepModel();
  const LlepOptions o = TestOptions();
  const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), profile, 300 + 10 * P + which);
  const LlepRun run = RunLlep(pr, o);
  if (HasFatalFailure()) return;
  ExpectMatchesReference(run.got, DispatchReference(pr));
  // Standard EP on the same inputs: the same values to fp32 rounding (LLEP
  // sums an expert's weight gradient over its pieces in another order).
  const DispatchGot ep = RunDispatch(pr, StandardEpFactory());
  ExpectNearRuns(run.got, ep, kDispatchGradTol);

  const int64_t max_n = *std::max_element(pr.n.begin(), pr.n.end());
  const int64_t worst = LlepWorstCasePeakBytes(m, P, max_n, o);
  int64_t rows = 0, moved = 0;
  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    // Allocated in Forward at the realized sizes, held through Backward.
    EXPECT_EQ(run.got.peak_forward[p], LlepPeakBytes(m, P, run.sizes[p]));
    // ... which the routes' loads alone predict.
    const LlepChunkSizes planned = LlepSizesFor(m, P, p, pr.n[p], run.assignment[p]);
    EXPECT_EQ(LlepPeakBytes(m, P, planned), run.got.peak_forward[p]);
    EXPECT_EQ(planned.rows, run.sizes[p].rows);
    EXPECT_EQ(planned.borrowed, run.sizes[p].borrowed);
    EXPECT_EQ(planned.lent, run.sizes[p].lent);
    EXPECT_EQ(run.got.peak_backward[p], run.got.peak_forward[p]);
    EXPECT_LE(run.got.peak(p), worst);
    EXPECT_EQ(run.got.after[p], 0);
    EXPECT_EQ(run.sizes[p].rows, run.assignment[p].rank_rows[p]);
    // Every rank computed the same assignment from the same counts.
    EXPECT_EQ(run.assignment[p].rank_rows, run.assignment[0].rank_rows);
    EXPECT_EQ(run.assignment[p].capacity, run.assignment[0].capacity);
    EXPECT_LE(run.sizes[p].borrowed, LlepMaxBorrowed(m, P, run.sizes[p].rows, o));
    rows += run.sizes[p].rows;
    moved += run.sizes[p].borrowed;
  }
  EXPECT_EQ(rows, std::accumulate(pr.n.begin(), pr.n.end(), int64_t{0}) * m.top_k);
  // One hot expert is more than its home's capacity: its overflow moves.
  if (P > 1 && profile.hot_percent == 100.0) {
    EXPECT_GT(moved, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(All, LlepSweepTest,
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

// LLEP with max_borrowed = 1 across the sweep at P = 2 and 4: at most one
// borrowed expert per rank, standard EP's results to fp32 rounding, and the
// peak within the capped worst case (which is below the uncapped one).
TEST(LlepTest, MaxBorrowedCapsTheBorrowedExperts) {
  const ModelConfig m = SweepModel();
  int64_t uncapped_most = 0;
  for (int P : {2, 4}) {
    for (int which = 0; which < static_cast<int>(Sweep().size()); ++which) {
      const RoutingProfile profile = Sweep()[which];
      SCOPED_TRACE(absl::StrCat("P = ", P, ", ", profile.Name()));
      // Larger N than the sweep above, so that an uncapped rank borrows two.
      const DispatchProblem pr = MakeProfileProblem(m, Tokens(P, 40), profile, 900 + P + which);
      LlepOptions o = TestOptions();
      const LlepRun free = RunLlep(pr, o);
      o.max_borrowed = 1;
      const LlepRun run = RunLlep(pr, o);
      if (HasFatalFailure()) return;
      ExpectMatchesReference(run.got, DispatchReference(pr));
      ExpectNearRuns(run.got, RunDispatch(pr, StandardEpFactory()), kDispatchGradTol);
      const int64_t max_n = *std::max_element(pr.n.begin(), pr.n.end());
      const int64_t worst = LlepWorstCasePeakBytes(m, P, max_n, o);
      LlepOptions uncapped = o;
      uncapped.max_borrowed = 0;
      EXPECT_LT(worst, LlepWorstCasePeakBytes(m, P, max_n, uncapped));
      for (int p = 0; p < P; ++p) {
        EXPECT_LE(run.sizes[p].borrowed, 1);
        EXPECT_LE(run.sizes[p].lent, P - 1);
        EXPECT_EQ(run.got.peak_forward[p], LlepPeakBytes(m, P, run.sizes[p]));
        EXPECT_LE(run.got.peak(p), worst);
        uncapped_most = std::max(uncapped_most, free.sizes[p].borrowed);
      }
    }
  }
  EXPECT_GE(uncapped_most, 2) << "the cap never bound: the test shows nothing";
}

// The skew moves compute off the hot rank: its rows fall from standard EP's
// to about the capacity, and the busiest rank computes no more than that.
TEST(LlepTest, BalancesTheRowsOfAHotExpert) {
  const ModelConfig m = SweepModel();
  const int P = 4;
  const DispatchProblem pr = MakeProfileProblem(m, Tokens(P, 40), HotRouting(100, 1), 5);
  const LlepRun run = RunLlep(pr, TestOptions());
  if (HasFatalFailure()) return;
  const LlepAssignment& a = run.assignment[0];
  const int64_t max_rows = *std::max_element(a.rank_rows.begin(), a.rank_rows.end());
  int64_t hot_rank_ep = 0;  // standard EP: rank 0 gets every route to expert 0 and 1..3
  for (int p = 0; p < P; ++p) {
    for (int32_t e : pr.chosen[p]) hot_rank_ep += e < m.experts / P;
  }
  EXPECT_LT(max_rows, hot_rank_ep);
  // Not a guarantee in general (a remainder no helper has room for is
  // forced), but here every overflow finds room: each rank ends within a
  // piece of its capacity.
  EXPECT_LE(max_rows, a.capacity + TestOptions().min_piece);
  std::cout << "100%/1, P = 4: standard EP's busiest rank " << hot_rank_ep
            << " rows, LLEP's " << max_rows << " (capacity " << a.capacity << ")\n";
}

// Below lambda nothing moves, and LLEP is standard EP bit for bit: the same
// send order, groups and sums.
TEST(LlepTest, BelowLambdaItIsStandardEpBitForBit) {
  const ModelConfig m = SweepModel();
  LlepOptions o = TestOptions();
  o.lambda = 1e9;
  for (int P : {2, 4}) {
    const DispatchProblem pr = MakeProfileProblem(m, Tokens(P), HotRouting(80, 4), 41 + P);
    const LlepRun run = RunLlep(pr, o);
    EXPECT_FALSE(run.assignment[0].balanced);
    ExpectSameBits(run.got, RunDispatch(pr, StandardEpFactory()), absl::StrCat("P = ", P));
  }
}

TEST(LlepTest, SameBitsRunToRun) {
  for (const RoutingProfile& profile : {BalancedRouting(), HotRouting(100, 1)}) {
    const DispatchProblem pr = MakeProfileProblem(SweepModel(), Tokens(4), profile, 77);
    ExpectSameBits(RunLlep(pr, TestOptions()).got, RunLlep(pr, TestOptions()).got,
                   profile.Name());
  }
}

// Ranks without tokens send nothing; a rank that owns no chosen expert and
// is not needed as a helper receives nothing.
TEST(LlepTest, EmptySendsAndARankSentNothing) {
  const ModelConfig m = SweepModel();
  {
    const DispatchProblem pr = MakeProfileProblem(m, {0, 13, 0, 9}, HotRouting(50, 4), 8);
    const LlepRun run = RunLlep(pr, TestOptions());
    ExpectMatchesReference(run.got, DispatchReference(pr));
    EXPECT_EQ(run.sizes[0].routes, 0);
    EXPECT_EQ(run.sizes[2].routes, 0);
  }
  {
    // Every route to rank 0's experts; lambda keeps LLEP from moving any.
    LlepOptions o = TestOptions();
    o.lambda = 1e9;
    const DispatchProblem pr = MakeProfileProblem(m, Tokens(4), HotRouting(100, 4), 9);
    const LlepRun run = RunLlep(pr, o);
    ExpectMatchesReference(run.got, DispatchReference(pr));
    for (int p = 1; p < 4; ++p) EXPECT_EQ(run.sizes[p].rows, 0) << p;
  }
  {
    // Nobody has tokens.
    const DispatchProblem pr = MakeProfileProblem(m, {0, 0}, BalancedRouting(), 10);
    const LlepRun run = RunLlep(pr, TestOptions());
    for (int p = 0; p < 2; ++p) EXPECT_EQ(run.got.after[p], 0);
  }
}

TEST(LlepTest, BackwardWithoutForwardIsAFailedPrecondition) {
  ExpectBackwardNeedsForward(LlepFactory(TestOptions()));
}

TEST(LlepTest, CreateRefusesBadOptionsNamingTheField) {
  absl::Status st = RunLocalWorld(
      1, 1 << 20, FreshStoreDir("llep_create"),
      [](int, Backend& be, Communicator& world) -> absl::Status {
        auto compute = be.CreateStream("compute");
        auto comm = be.CreateStream("comm");
        auto kernels = ModelKernels::Create(be);
        if (!compute.ok() || !comm.ok() || !kernels.ok()) return absl::InternalError("setup");
        struct Case {
          LlepOptions o;
          ModelConfig m;
          const char* field;
        };
        LlepOptions alpha = TestOptions(), piece = TestOptions(), lambda = TestOptions();
        alpha.alpha = 0.0;
        piece.min_piece = 0;
        lambda.lambda = 0.9;
        ModelConfig k = SweepModel();
        k.top_k = 17;
        for (const Case& c : {Case{alpha, SweepModel(), "schedule.llep.alpha"},
                              Case{piece, SweepModel(), "schedule.llep.min_piece"},
                              Case{lambda, SweepModel(), "schedule.llep.lambda"},
                              Case{TestOptions(), k, "model.top_k"}}) {
          auto d = Llep::Create(c.m, c.o, be, **kernels, world, **compute, **comm);
          EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
          EXPECT_THAT(d.status().message(), HasSubstr(c.field));
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace plateau
