#include "kernels/dispatch/dispatch_testing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/memory.h"
#include "kernels/status_macros.h"
#include "kernels/testing/compare.h"
#include "kernels/testing/local_world.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {

ModelConfig DispatchTestModel() {
  ModelConfig m = TinyModel();
  m.experts = 8;
  return m;
}

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

namespace {

// Weights, gradients and per-rank tensors from `rng`; routes left empty.
DispatchProblem MakeDense(const ModelConfig& m, const std::vector<int64_t>& n,
                          std::mt19937_64& rng) {
  DispatchProblem pr;
  pr.m = m;
  pr.P = static_cast<int>(n.size());
  pr.n = n;
  const int64_t H = m.hidden, F = m.expert_ffn, E = m.experts;
  std::normal_distribution<float> normal(0.0f, 1.0f);
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
  for (int p = 0; p < pr.P; ++p) {
    std::vector<float> u, dout, out0, du0;
    fill(u, n[p] * H, 1.0f);
    fill(dout, n[p] * H, 1.0f);
    fill(out0, n[p] * H, 0.5f);
    fill(du0, n[p] * H, 0.5f);
    pr.u.push_back(std::move(u));
    pr.dout.push_back(std::move(dout));
    pr.out0.push_back(std::move(out0));
    pr.du0.push_back(std::move(du0));
  }
  return pr;
}

}  // namespace

DispatchProblem MakeDispatchProblem(const ModelConfig& m, int P, Routing routing, uint64_t seed) {
  const int64_t E = m.experts, K = m.top_k, Ep = E / P;
  std::vector<int64_t> n;
  for (int p = 0; p < P; ++p) {
    n.push_back(routing == Routing::kOneToken ? 1 : routing == Routing::kBalanced ? 5 + 3 * p : 6);
  }
  std::mt19937_64 rng(seed);
  DispatchProblem pr = MakeDense(m, n, rng);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  for (int p = 0; p < P; ++p) {
    std::vector<float> gates(n[p] * K);
    for (float& g : gates) g = unit(rng);
    // The experts a token may choose from.
    const int64_t pool_size = routing == Routing::kSkewed          ? K
                              : routing == Routing::kLastRankEmpty ? E - Ep
                                                                   : E;
    std::vector<int32_t> pool, chosen(n[p] * K);
    for (int64_t t = 0; t < n[p]; ++t) {
      pool.resize(pool_size);
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);  // distinct, in random order
      std::copy_n(pool.begin(), K, &chosen[t * K]);
    }
    pr.gates.push_back(std::move(gates));
    pr.chosen.push_back(std::move(chosen));
  }
  return pr;
}

DispatchProblem MakeProfileProblem(const ModelConfig& m, const std::vector<int64_t>& n,
                                   const RoutingProfile& profile, uint64_t seed) {
  std::mt19937_64 rng(seed);
  DispatchProblem pr = MakeDense(m, n, rng);
  for (int p = 0; p < pr.P; ++p) {
    absl::StatusOr<Routes> r = MakeRoutes(profile, m.experts, m.top_k, n[p], seed, p);
    EXPECT_TRUE(r.ok()) << r.status();
    pr.chosen.push_back(r.ok() ? r->chosen : std::vector<int32_t>(n[p] * m.top_k, 0));
    pr.gates.push_back(r.ok() ? r->gates : std::vector<float>(n[p] * m.top_k, 0.0f));
  }
  return pr;
}

// ---------------------------------------------------------------------------

namespace {

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// y = down(silu(x Wg) * (x Wu)) for one expert; keeps g and up for Backward.
void ExpertForward(const DispatchProblem& pr, int32_t e, const float* x, std::vector<double>* g,
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

}  // namespace

DispatchWant DispatchReference(const DispatchProblem& pr) {
  const int64_t H = pr.m.hidden, F = pr.m.expert_ffn, K = pr.m.top_k;
  DispatchWant w;
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

namespace {

template <typename T>
absl::StatusOr<Buffer> Upload(Backend& be, LiveSet set, const std::vector<T>& host) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, be.device().Allocate(set, host.size() * sizeof(T)));
  if (!host.empty()) std::memcpy(b.data(), host.data(), host.size() * sizeof(T));  // CPU device
  return b;
}

}  // namespace

DispatchGot RunDispatch(const DispatchProblem& pr, const DispatchFactory& make,
                        const DispatchObserver& after_forward,
                        const DispatchObserver& after_backward, int64_t device_bytes) {
  const ModelConfig& m = pr.m;
  const int64_t H = m.hidden, F = m.expert_ffn, K = m.top_k, Ep = m.experts / pr.P;
  const int64_t mat = H * F;
  DispatchGot got;
  got.out.resize(pr.P);
  got.du.resize(pr.P);
  got.dgates.resize(pr.P);
  got.gg.assign(pr.gg0.size(), 0.0f);
  got.gu.assign(pr.gu0.size(), 0.0f);
  got.gd.assign(pr.gd0.size(), 0.0f);
  got.peak_forward.assign(pr.P, -1);
  got.peak_backward.assign(pr.P, -1);
  got.after.assign(pr.P, -1);
  absl::Status st = RunLocalWorld(
      pr.P, device_bytes, FreshStoreDir("dispatch"),
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
        // dgates is overwritten: NaN shows an element the schedule missed.
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

        PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<ExpertDispatch> ep,
                                 make(p, m, be, *kernels, world, *compute, *comm));
        MemoryTracker& tracker = be.device().tracker();
        tracker.ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(ep->Forward(u.as<float>(), chosen.as<int32_t>(),
                                            gates.as<float>(), n, w, out.as<float>()));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        got.peak_forward[p] = tracker.peak(LiveSet::kDispatch);
        if (after_forward) after_forward(p, *ep);
        tracker.ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(
            ep->Backward(dout.as<float>(), w, du.as<float>(), dgates.as<float>(), g));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        got.peak_backward[p] = tracker.peak(LiveSet::kDispatch);
        if (after_backward) after_backward(p, *ep);
        ep->Release();
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

void ExpectBackwardNeedsForward(const DispatchFactory& make) {
  const ModelConfig m = DispatchTestModel();
  for (int P : {1, 2}) {
    const DispatchProblem pr = MakeDispatchProblem(m, P, Routing::kSkewed, 3);
    absl::Status st = RunLocalWorld(
        P, 16 << 20, FreshStoreDir("dispatch_pre"),
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
          PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<ExpertDispatch> ep,
                                   make(p, m, be, *kernels, world, *compute, *comm));
          absl::Status fresh = ep->Backward(dout, w, du, dgates, g);
          EXPECT_EQ(fresh.code(), absl::StatusCode::kFailedPrecondition)
              << "rank " << p << ": " << fresh;
          EXPECT_NE(fresh.message().find("Forward"), absl::string_view::npos) << fresh;
          PLATEAU_RETURN_IF_ERROR(ep->Forward(u.as<float>(), chosen.as<int32_t>(),
                                              gates.as<float>(), n, w, out));
          PLATEAU_RETURN_IF_ERROR(ep->Backward(dout, w, du, dgates, g));
          absl::Status again = ep->Backward(dout, w, du, dgates, g);
          EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition)
              << "rank " << p << ": " << again;
          PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
          return comm->Synchronize();
        });
    EXPECT_TRUE(st.ok()) << "P = " << P << ": " << st;
  }
}

void ExpectMatchesReference(const DispatchGot& got, const DispatchWant& want) {
  for (size_t p = 0; p < want.out.size(); ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    ExpectNearRelMax(got.out[p], want.out[p], kDispatchValueTol, "out");
    ExpectNearRelMax(got.dgates[p], want.dgates[p], kDispatchGradTol, "dgates");
    ExpectNearRelMax(got.du[p], want.du[p], kDispatchGradTol, "du");
  }
  ExpectNearRelMax(got.gg, want.gg, kDispatchGradTol, "d w_gate");
  ExpectNearRelMax(got.gu, want.gu, kDispatchGradTol, "d w_up");
  ExpectNearRelMax(got.gd, want.gd, kDispatchGradTol, "d w_down");
}

namespace {

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace

void ExpectNearRuns(const DispatchGot& a, const DispatchGot& b, double rel) {
  ASSERT_EQ(a.out.size(), b.out.size());
  for (size_t p = 0; p < b.out.size(); ++p) {
    SCOPED_TRACE(absl::StrCat("rank ", p));
    ExpectNearRelMax(a.out[p], ToDouble(b.out[p]), rel, "out");
    ExpectNearRelMax(a.dgates[p], ToDouble(b.dgates[p]), rel, "dgates");
    ExpectNearRelMax(a.du[p], ToDouble(b.du[p]), rel, "du");
  }
  ExpectNearRelMax(a.gg, ToDouble(b.gg), rel, "d w_gate");
  ExpectNearRelMax(a.gu, ToDouble(b.gu), rel, "d w_up");
  ExpectNearRelMax(a.gd, ToDouble(b.gd), rel, "d w_down");
}

void ExpectSameBits(const DispatchGot& a, const DispatchGot& b, const std::string& what) {
  ASSERT_EQ(a.out.size(), b.out.size()) << what;
  for (size_t p = 0; p < b.out.size(); ++p) {
    EXPECT_TRUE(SameBits(a.out[p], b.out[p])) << what << ": out of rank " << p;
    EXPECT_TRUE(SameBits(a.du[p], b.du[p])) << what << ": du of rank " << p;
    EXPECT_TRUE(SameBits(a.dgates[p], b.dgates[p])) << what << ": dgates of rank " << p;
  }
  EXPECT_TRUE(SameBits(a.gg, b.gg)) << what << ": d w_gate";
  EXPECT_TRUE(SameBits(a.gu, b.gu)) << what << ": d w_up";
  EXPECT_TRUE(SameBits(a.gd, b.gd)) << what << ": d w_down";
}

}  // namespace plateau
