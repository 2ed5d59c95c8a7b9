// StandardEp on its own, at P = 1, 2, 4 rank threads (Gloo over loopback):
// the forward output and Backward's du, dgates and expert weight gradients
// against a host reference in double (itself checked by central finite
// differences), the measured kDispatch peak against the plan, and
// determinism. The problem, the reference and the runner are shared with
// the LLEP tests (dispatch_testing.h).
#include "kernels/dispatch/standard_ep.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dispatch/dispatch_testing.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"

namespace plateau {
namespace {

using Problem = DispatchProblem;
ModelConfig TestModel() { return DispatchTestModel(); }

// StandardEp on every rank; `received` gets each rank's R_d after Forward.
DispatchGot RunEp(const Problem& pr, std::vector<int64_t>* received = nullptr) {
  if (received != nullptr) received->assign(pr.P, -1);
  return RunDispatch(
      pr,
      [](int, const ModelConfig& m, Backend& be, ModelKernels& k, Communicator& world,
         Stream& compute, Stream& comm) -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
        return std::make_unique<StandardEp>(m, be, k, world, compute, comm);
      },
      [&](int p, ExpertDispatch& d) {
        if (received != nullptr) (*received)[p] = static_cast<StandardEp&>(d).received_rows();
      });
}

using Params = std::tuple<int, Routing>;
class StandardEpTest : public ::testing::TestWithParam<Params> {};

TEST_P(StandardEpTest, MatchesTheReferenceAndThePlannedPeak) {
  const auto [P, routing] = GetParam();
  if (routing == Routing::kLastRankEmpty && P == 1) GTEST_SKIP() << "one rank owns every expert";
  const ModelConfig m = TestModel();
  const Problem pr = MakeDispatchProblem(m, P, routing, 1000 + 10 * P + static_cast<int>(routing));
  std::vector<int64_t> received;
  const DispatchGot got = RunEp(pr, &received);
  if (HasFatalFailure()) return;
  ExpectMatchesReference(got, DispatchReference(pr));

  // Every route lands somewhere; the routing decides where.
  int64_t routes = 0, max_n = 0;
  for (int64_t n : pr.n) routes += n * m.top_k, max_n = std::max(max_n, n);
  EXPECT_EQ(std::accumulate(received.begin(), received.end(), int64_t{0}), routes);
  if (routing == Routing::kSkewed) {
    EXPECT_EQ(received[0], routes);
    EXPECT_EQ(received[0], StandardEpWorstCaseReceivedRows(m, P, max_n));
  }
  if (routing == Routing::kLastRankEmpty) {
    EXPECT_EQ(received[P - 1], 0);
  }

  // The measured peak is the plan for the routes this rank saw, exactly, and
  // at most the plan for the worst routing; Backward leaves nothing behind.
  const int64_t worst =
      StandardEpPeakBytes(m, max_n * m.top_k, StandardEpWorstCaseReceivedRows(m, P, max_n));
  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    EXPECT_EQ(got.peak(p), StandardEpPeakBytes(m, pr.n[p] * m.top_k, received[p]));
    EXPECT_LE(got.peak(p), worst);
    EXPECT_EQ(got.after[p], 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, StandardEpTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(Routing::kBalanced, Routing::kSkewed,
                                         Routing::kLastRankEmpty, Routing::kOneToken)),
    [](const ::testing::TestParamInfo<Params>& i) {
      return absl::StrCat("P", std::get<0>(i.param), "_", RoutingName(std::get<1>(i.param)));
    });

TEST(StandardEpTest, SameBitsRunToRun) {
  for (Routing routing : {Routing::kBalanced, Routing::kSkewed}) {
    const Problem pr = MakeDispatchProblem(TestModel(), 4, routing, 77);
    ExpectSameBits(RunEp(pr), RunEp(pr), RoutingName(routing));
  }
}

// The reference's gradients are those of its forward: central differences in
// double of L = <dout, out> on a tiny problem (H = 4, F = 3, E = 4, N = 3).
TEST(StandardEpReferenceTest, GradientsMatchCentralDifferences) {
  ModelConfig m = TestModel();
  m.hidden = 4;
  m.expert_ffn = 3;
  m.experts = 4;
  Problem pr = MakeDispatchProblem(m, 1, Routing::kBalanced, 5);
  pr.n = {3};
  pr.u[0].resize(3 * 4);
  pr.dout[0].resize(3 * 4);
  pr.out0[0].assign(3 * 4, 0.0f);
  pr.du0[0].assign(3 * 4, 0.0f);
  pr.gates[0].resize(3 * 2);
  pr.chosen[0].resize(3 * 2);
  std::fill(pr.gg0.begin(), pr.gg0.end(), 0.0f);
  std::fill(pr.gu0.begin(), pr.gu0.end(), 0.0f);
  std::fill(pr.gd0.begin(), pr.gd0.end(), 0.0f);
  const DispatchWant want = DispatchReference(pr);

  auto loss = [&](const Problem& q) {
    const DispatchWant w = DispatchReference(q);
    double l = 0;
    for (size_t i = 0; i < w.out[0].size(); ++i) l += double(q.dout[0][i]) * w.out[0][i];
    return l;
  };
  // The inputs are floats: a step of 2^-10 keeps the O(eps^2) truncation
  // error far below the tolerance, and the difference is divided by the
  // step as actually taken in float.
  auto check = [&](std::vector<float> Problem::*field, bool per_rank_u,
                   const std::vector<double>& analytic, const std::string& what) {
    for (size_t i = 0; i < analytic.size(); ++i) {
      Problem q = pr;
      float* x = per_rank_u ? &q.u[0][i] : &(q.*field)[i];
      const float x0 = *x;
      const float eps = std::ldexp(1.0f, -10);
      *x = x0 + eps;
      const double xp = *x, lp = loss(q);
      *x = x0 - eps;
      const double xm = *x, lm = loss(q);
      const double fd = (lp - lm) / (xp - xm);
      EXPECT_NEAR(fd, analytic[i], 1e-5 * std::max(1.0, std::abs(analytic[i])))
          << what << "[" << i << "]";
    }
  };
  check(nullptr, true, want.du[0], "du");
  check(&Problem::wg, false, want.gg, "d w_gate");
  check(&Problem::wu, false, want.gu, "d w_up");
  check(&Problem::wd, false, want.gd, "d w_down");
  // L is linear in each gate: the difference is exact up to rounding.
  for (size_t i = 0; i < want.dgates[0].size(); ++i) {
    Problem q = pr;
    q.gates[0][i] += 0.25f;
    const double lp = loss(q);
    q.gates[0][i] -= 0.5f;
    const double lm = loss(q);
    EXPECT_NEAR((lp - lm) / 0.5, want.dgates[0][i], 1e-9) << "dgates[" << i << "]";
  }
}

// Backward needs the Forward's state: without it (on a fresh object, or a
// second time after one Forward) it is refused before any collective.
TEST(StandardEpTest, BackwardWithoutForwardIsAFailedPrecondition) {
  ExpectBackwardNeedsForward([](int, const ModelConfig& m, Backend& be, ModelKernels& k,
                                Communicator& world, Stream& compute, Stream& comm)
                                 -> absl::StatusOr<std::unique_ptr<ExpertDispatch>> {
    return std::make_unique<StandardEp>(m, be, k, world, compute, comm);
  });
}

}  // namespace
}  // namespace plateau
