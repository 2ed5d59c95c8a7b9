// StandardEp on its own, at P = 1, 2, 4 rank threads (Gloo over loopback):
// the forward output and Backward's du, dgates and expert weight gradients
// against a host reference in double (itself checked by central finite
// differences), the measured kDispatch peak against the plan, and
// determinism.
//
// Tolerances: fp32 rounding at these shapes (H = 16, F = 24, k = 2): values
// within 1e-5 and gradients within 1e-4 of the largest magnitude of the
// quantity compared.
#include "kernels/dispatch/standard_ep.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/status_macros.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;

// The tiny model with 8 experts, so that at P = 4 a rank owns E/P = 2 >= k
// and a token's k distinct experts can all live on rank 0.
ModelConfig TestModel() {
  ModelConfig m = TinyModel();
  m.experts = 8;
  return m;
}

enum class Routing {
  kBalanced,       // k distinct experts uniformly at random; N differs per rank
  kSkewed,         // every token chooses experts 0..k-1, all on rank 0
  kLastRankEmpty,  // no token chooses an expert of rank P-1
  kOneToken,       // N = 1 on every rank
};

std::string RoutingName(Routing r) {
  switch (r) {
    case Routing::kBalanced: return "Balanced";
    case Routing::kSkewed: return "Skewed";
    case Routing::kLastRankEmpty: return "LastRankEmpty";
    case Routing::kOneToken: return "OneToken";
  }
  return "?";
}
void PrintTo(Routing r, std::ostream* os) { *os << RoutingName(r); }

// One global problem. Weights are global [E, H, F] (gate, up) and
// [E, F, H] (down); rank p owns experts [p E/P, (p+1) E/P). out, du and the
// weight gradients start from nonzero values: they accumulate.
struct Problem {
  ModelConfig m;
  int P = 1;
  std::vector<int64_t> n;                  // tokens per rank
  std::vector<std::vector<float>> u;       // [N, H]
  std::vector<std::vector<int32_t>> chosen;  // [N, k]
  std::vector<std::vector<float>> gates;   // [N, k]
  std::vector<std::vector<float>> dout;    // [N, H]
  std::vector<std::vector<float>> out0;    // [N, H]
  std::vector<std::vector<float>> du0;     // [N, H]
  std::vector<float> wg, wu, wd;           // weights
  std::vector<float> gg0, gu0, gd0;        // gradients before Backward
};

Problem Make(const ModelConfig& m, int P, Routing routing, uint64_t seed) {
  Problem pr;
  pr.m = m;
  pr.P = P;
  const int64_t H = m.hidden, F = m.expert_ffn, E = m.experts, K = m.top_k, Ep = E / P;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  auto fill = [&](std::vector<float>& v, int64_t count, float scale) {
    v.resize(count);
    for (float& e : v) e = normal(rng) * scale;
  };
  fill(pr.wg, E * H * F, 0.3f);
  fill(pr.wu, E * H * F, 0.3f);
  fill(pr.wd, E * F * H, 0.3f);
  fill(pr.gg0, E * H * F, 0.1f);
  fill(pr.gu0, E * H * F, 0.1f);
  fill(pr.gd0, E * F * H, 0.1f);
  for (int p = 0; p < P; ++p) {
    int64_t n = routing == Routing::kOneToken ? 1 : routing == Routing::kBalanced ? 5 + 3 * p : 6;
    pr.n.push_back(n);
    std::vector<float> u, dout, out0, du0, gates(n * K);
    fill(u, n * H, 1.0f);
    fill(dout, n * H, 1.0f);
    fill(out0, n * H, 0.5f);
    fill(du0, n * H, 0.5f);
    for (float& g : gates) g = unit(rng);
    // The experts a token may choose from.
    std::vector<int32_t> pool;
    const int64_t pool_size = routing == Routing::kSkewed        ? K
                              : routing == Routing::kLastRankEmpty ? E - Ep
                                                                   : E;
    std::vector<int32_t> chosen(n * K);
    for (int64_t t = 0; t < n; ++t) {
      pool.resize(pool_size);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);  // distinct, in random order
      std::copy_n(pool.begin(), K, &chosen[t * K]);
    }
    pr.u.push_back(std::move(u));
    pr.dout.push_back(std::move(dout));
    pr.out0.push_back(std::move(out0));
    pr.du0.push_back(std::move(du0));
    pr.gates.push_back(std::move(gates));
    pr.chosen.push_back(std::move(chosen));
  }
  return pr;
}

// ---------------------------------------------------------------------------
// The reference in double: out = out0 + sum_j gate_j * expert_{e_j}(u);
// given dout, du = du0 + d/du, dgates, and gradients = g0 + d/dW of
// <dout, out>.

struct Want {
  std::vector<std::vector<double>> out, du, dgates;
  std::vector<double> gg, gu, gd;
};

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// y = down(silu(x Wg) * (x Wu)) for one expert; keeps g and up for Backward.
void ExpertForward(const Problem& pr, int32_t e, const float* x, std::vector<double>* g,
                   std::vector<double>* up, std::vector<double>* y) {
  const int64_t H = pr.m.hidden, F = pr.m.expert_ffn;
  g->assign(F, 0.0);
  up->assign(F, 0.0);
  y->assign(H, 0.0);
  for (int64_t f = 0; f < F; ++f) {
    for (int64_t h = 0; h < H; ++h) {
      (*g)[f] += double(x[h]) * pr.wg[(e * H + h) * F + f];
      (*up)[f] += double(x[h]) * pr.wu[(e * H + h) * F + f];
    }
  }
  for (int64_t f = 0; f < F; ++f) {
    const double a = (*g)[f] * Sigmoid((*g)[f]) * (*up)[f];
    for (int64_t h = 0; h < H; ++h) (*y)[h] += a * pr.wd[(e * F + f) * H + h];
  }
}

Want Reference(const Problem& pr) {
  const int64_t H = pr.m.hidden, F = pr.m.expert_ffn, K = pr.m.top_k;
  Want w;
  w.gg.assign(pr.gg0.begin(), pr.gg0.end());
  w.gu.assign(pr.gu0.begin(), pr.gu0.end());
  w.gd.assign(pr.gd0.begin(), pr.gd0.end());
  std::vector<double> g, up, y;
  for (int p = 0; p < pr.P; ++p) {
    std::vector<double> out(pr.out0[p].begin(), pr.out0[p].end());
    std::vector<double> du(pr.du0[p].begin(), pr.du0[p].end());
    std::vector<double> dgates(pr.n[p] * K);
    for (int64_t t = 0; t < pr.n[p]; ++t) {
      const float* x = &pr.u[p][t * H];
      const float* d = &pr.dout[p][t * H];
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = pr.chosen[p][t * K + j];
        const double gate = pr.gates[p][t * K + j];
        ExpertForward(pr, e, x, &g, &up, &y);
        double dot = 0;
        for (int64_t h = 0; h < H; ++h) {
          out[t * H + h] += gate * y[h];
          dot += double(d[h]) * y[h];
        }
        dgates[t * K + j] = dot;
        // dy = gate dout; da = dy Wd^T; then through SwiGLU.
        for (int64_t f = 0; f < F; ++f) {
          const double s = Sigmoid(g[f]), a = g[f] * s * up[f];
          double da = 0;
          for (int64_t h = 0; h < H; ++h) {
            const double dy = gate * d[h];
            da += dy * pr.wd[(e * F + f) * H + h];
            w.gd[(e * F + f) * H + h] += a * dy;
          }
          const double dg = da * up[f] * s * (1.0 + g[f] * (1.0 - s));
          const double dup = da * g[f] * s;
          for (int64_t h = 0; h < H; ++h) {
            w.gg[(e * H + h) * F + f] += double(x[h]) * dg;
            w.gu[(e * H + h) * F + f] += double(x[h]) * dup;
            du[t * H + h] += dg * pr.wg[(e * H + h) * F + f] + dup * pr.wu[(e * H + h) * F + f];
          }
        }
      }
    }
    w.out.push_back(std::move(out));
    w.du.push_back(std::move(du));
    w.dgates.push_back(std::move(dgates));
  }
  return w;
}

// ---------------------------------------------------------------------------
// StandardEp on P rank threads.

struct Got {
  std::vector<std::vector<float>> out, du, dgates;
  std::vector<float> gg, gu, gd;  // global, assembled from the ranks' experts
  std::vector<int64_t> received, peak, after;  // per rank
};

template <typename T>
absl::StatusOr<Buffer> Upload(Backend& be, LiveSet set, const std::vector<T>& host) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, be.device().Allocate(set, host.size() * sizeof(T)));
  std::memcpy(b.data(), host.data(), host.size() * sizeof(T));  // CPU device memory
  return b;
}

Got RunEp(const Problem& pr) {
  const ModelConfig& m = pr.m;
  const int64_t H = m.hidden, F = m.expert_ffn, K = m.top_k, Ep = m.experts / pr.P;
  const int64_t mat = H * F;
  Got got;
  got.out.resize(pr.P);
  got.du.resize(pr.P);
  got.dgates.resize(pr.P);
  got.gg.assign(pr.gg0.size(), 0.0f);
  got.gu.assign(pr.gu0.size(), 0.0f);
  got.gd.assign(pr.gd0.size(), 0.0f);
  got.received.assign(pr.P, -1);
  got.peak.assign(pr.P, -1);
  got.after.assign(pr.P, -1);
  absl::Status st = RunLocalWorld(
      pr.P, 64 << 20, FreshStoreDir("standard_ep"),
      [&](int p, Backend& be, Communicator& world) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
        const int64_t n = pr.n[p];
        auto slice = [&](const std::vector<float>& v) {
          return std::vector<float>(v.begin() + p * Ep * mat, v.begin() + (p + 1) * Ep * mat);
        };
        PLATEAU_ASSIGN_OR_RETURN(Buffer u, Upload(be, LiveSet::kActivations, pr.u[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer chosen, Upload(be, LiveSet::kActivations, pr.chosen[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer gates, Upload(be, LiveSet::kActivations, pr.gates[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dout, Upload(be, LiveSet::kActivations, pr.dout[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer out, Upload(be, LiveSet::kActivations, pr.out0[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer du, Upload(be, LiveSet::kActivations, pr.du0[p]));
        PLATEAU_ASSIGN_OR_RETURN(
            Buffer dgates,
            Upload(be, LiveSet::kActivations,
                   std::vector<float>(n * K, std::numeric_limits<float>::quiet_NaN())));
        PLATEAU_ASSIGN_OR_RETURN(Buffer wg, Upload(be, LiveSet::kWeights, slice(pr.wg)));
        PLATEAU_ASSIGN_OR_RETURN(Buffer wu, Upload(be, LiveSet::kWeights, slice(pr.wu)));
        PLATEAU_ASSIGN_OR_RETURN(Buffer wd, Upload(be, LiveSet::kWeights, slice(pr.wd)));
        PLATEAU_ASSIGN_OR_RETURN(Buffer gg, Upload(be, LiveSet::kGrads, slice(pr.gg0)));
        PLATEAU_ASSIGN_OR_RETURN(Buffer gu, Upload(be, LiveSet::kGrads, slice(pr.gu0)));
        PLATEAU_ASSIGN_OR_RETURN(Buffer gd, Upload(be, LiveSet::kGrads, slice(pr.gd0)));
        const ExpertWeights w{wg.as<float>(), wu.as<float>(), wd.as<float>()};
        const ExpertGrads g{gg.as<float>(), gu.as<float>(), gd.as<float>()};

        StandardEp ep(m, be, *kernels, world, *compute, *comm);
        MemoryTracker& tracker = be.device().tracker();
        tracker.ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(ep.Forward(u.as<float>(), chosen.as<int32_t>(),
                                           gates.as<float>(), n, w, out.as<float>()));
        got.received[p] = ep.received_rows();
        PLATEAU_RETURN_IF_ERROR(
            ep.Backward(dout.as<float>(), w, du.as<float>(), dgates.as<float>(), g));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        got.peak[p] = tracker.peak(LiveSet::kDispatch);
        got.after[p] = tracker.current(LiveSet::kDispatch);

        got.out[p].assign(out.as<float>(), out.as<float>() + n * H);
        got.du[p].assign(du.as<float>(), du.as<float>() + n * H);
        got.dgates[p].assign(dgates.as<float>(), dgates.as<float>() + n * K);
        std::copy_n(gg.as<float>(), Ep * mat, &got.gg[p * Ep * mat]);
        std::copy_n(gu.as<float>(), Ep * mat, &got.gu[p * Ep * mat]);
        std::copy_n(gd.as<float>(), Ep * mat, &got.gd[p * Ep * mat]);
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

constexpr double kValueTol = 1e-5, kGradTol = 1e-4;

using Params = std::tuple<int, Routing>;
class StandardEpTest : public ::testing::TestWithParam<Params> {};

TEST_P(StandardEpTest, MatchesTheReferenceAndThePlannedPeak) {
  const auto [P, routing] = GetParam();
  if (routing == Routing::kLastRankEmpty && P == 1) GTEST_SKIP() << "one rank owns every expert";
  const ModelConfig m = TestModel();
  const Problem pr = Make(m, P, routing, 1000 + 10 * P + static_cast<int>(routing));
  const Want want = Reference(pr);
  const Got got = RunEp(pr);
  if (HasFatalFailure()) return;

  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    ExpectNearRelMax(got.out[p], want.out[p], kValueTol, "out");
    ExpectNearRelMax(got.dgates[p], want.dgates[p], kGradTol, "dgates");
    ExpectNearRelMax(got.du[p], want.du[p], kGradTol, "du");
  }
  ExpectNearRelMax(got.gg, want.gg, kGradTol, "d w_gate");
  ExpectNearRelMax(got.gu, want.gu, kGradTol, "d w_up");
  ExpectNearRelMax(got.gd, want.gd, kGradTol, "d w_down");

  // Every route lands somewhere; the routing decides where.
  int64_t routes = 0, max_n = 0;
  for (int64_t n : pr.n) routes += n * m.top_k, max_n = std::max(max_n, n);
  EXPECT_EQ(std::accumulate(got.received.begin(), got.received.end(), int64_t{0}), routes);
  if (routing == Routing::kSkewed) {
    EXPECT_EQ(got.received[0], routes);
    EXPECT_EQ(got.received[0], StandardEpWorstCaseReceivedRows(m, P, max_n));
  }
  if (routing == Routing::kLastRankEmpty) EXPECT_EQ(got.received[P - 1], 0);

  // The measured peak is the plan for the routes this rank saw, exactly, and
  // at most the plan for the worst routing; Backward leaves nothing behind.
  const int64_t worst =
      StandardEpPeakBytes(m, max_n * m.top_k, StandardEpWorstCaseReceivedRows(m, P, max_n));
  for (int p = 0; p < P; ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    EXPECT_EQ(got.peak[p], StandardEpPeakBytes(m, pr.n[p] * m.top_k, got.received[p]));
    EXPECT_LE(got.peak[p], worst);
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
    const Problem pr = Make(TestModel(), 4, routing, 77);
    const Got a = RunEp(pr);
    const Got b = RunEp(pr);
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(a.du, b.du);
    EXPECT_EQ(a.dgates, b.dgates);
    EXPECT_EQ(a.gg, b.gg);
    EXPECT_EQ(a.gu, b.gu);
    EXPECT_EQ(a.gd, b.gd);
  }
}

// The reference's gradients are those of its forward: central differences in
// double of L = <dout, out> on a tiny problem (H = 4, F = 3, E = 4, N = 3).
TEST(StandardEpReferenceTest, GradientsMatchCentralDifferences) {
  ModelConfig m = TestModel();
  m.hidden = 4;
  m.expert_ffn = 3;
  m.experts = 4;
  Problem pr = Make(m, 1, Routing::kBalanced, 5);
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
  const Want want = Reference(pr);

  auto loss = [&](const Problem& q) {
    const Want w = Reference(q);
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
  const ModelConfig m = TestModel();
  for (int P : {1, 2}) {
    // Skewed routing: at P = 2, rank 1 receives no rows.
    const Problem pr = Make(m, P, Routing::kSkewed, 3);
    absl::Status st = RunLocalWorld(
        P, 16 << 20, FreshStoreDir("standard_ep_pre"),
        [&](int p, Backend& be, Communicator& world) -> absl::Status {
          PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
          PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
          PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
          const int64_t H = m.hidden, K = m.top_k, n = pr.n[p];
          const int64_t local = (m.experts / P) * H * m.expert_ffn;
          PLATEAU_ASSIGN_OR_RETURN(Buffer u, Upload(be, LiveSet::kActivations, pr.u[p]));
          PLATEAU_ASSIGN_OR_RETURN(Buffer chosen, Upload(be, LiveSet::kActivations, pr.chosen[p]));
          PLATEAU_ASSIGN_OR_RETURN(Buffer gates, Upload(be, LiveSet::kActivations, pr.gates[p]));
          PLATEAU_ASSIGN_OR_RETURN(Buffer io, Upload(be, LiveSet::kActivations,
                                                     std::vector<float>(3 * n * H + n * K, 0.0f)));
          PLATEAU_ASSIGN_OR_RETURN(Buffer ws, Upload(be, LiveSet::kWeights,
                                                     std::vector<float>(6 * local, 0.01f)));
          float* out = io.as<float>();
          float* dout = out + n * H;
          float* du = dout + n * H;
          float* dgates = du + n * H;
          const ExpertWeights w{ws.as<float>(), ws.as<float>() + local, ws.as<float>() + 2 * local};
          const ExpertGrads g{ws.as<float>() + 3 * local, ws.as<float>() + 4 * local,
                              ws.as<float>() + 5 * local};
          StandardEp ep(m, be, *kernels, world, *compute, *comm);
          absl::Status fresh = ep.Backward(dout, w, du, dgates, g);
          EXPECT_EQ(fresh.code(), absl::StatusCode::kFailedPrecondition) << "rank " << p << ": " << fresh;
          EXPECT_THAT(fresh.message(), HasSubstr("Forward"));
          PLATEAU_RETURN_IF_ERROR(ep.Forward(u.as<float>(), chosen.as<int32_t>(),
                                             gates.as<float>(), n, w, out));
          PLATEAU_RETURN_IF_ERROR(ep.Backward(dout, w, du, dgates, g));
          absl::Status again = ep.Backward(dout, w, du, dgates, g);
          EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << "rank " << p << ": " << again;
          PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
          return comm->Synchronize();
        });
    EXPECT_TRUE(st.ok()) << st;
  }
}

}  // namespace
}  // namespace plateau
