#include "kernels/dispatch/dispatch_testing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <type_traits>

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

// The working precision's copy of host values (bf16: each value must be
// bf16 already), and back.
template <typename W>
std::vector<W> Working(const std::vector<float>& v) {
  if constexpr (std::is_same_v<W, float>) {
    return v;
  } else {
    std::vector<W> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      w[i] = FloatToBf16(v[i]);
      EXPECT_EQ(Bf16ToFloat(w[i]), v[i]) << "a value bf16 does not hold: RoundedToBf16 first";
    }
    return w;
  }
}
template <typename W>
float LoadedValue(W x) {
  if constexpr (std::is_same_v<W, float>) {
    return x;
  } else {
    return Bf16ToFloat(x);
  }
}

template <typename W>
DispatchGot RunDispatchT(const DispatchProblem& pr, const DispatchFactory& make, const DispatchObserver& after_forward,
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
          return Working<W>(std::vector<float>(v.begin() + p * Ep * mat, v.begin() + (p + 1) * Ep * mat));
        };
        PLATEAU_ASSIGN_OR_RETURN(Buffer u, Upload(be, LiveSet::kActivations, Working<W>(pr.u[p])));
        PLATEAU_ASSIGN_OR_RETURN(Buffer chosen, Upload(be, LiveSet::kActivations, pr.chosen[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer gates, Upload(be, LiveSet::kActivations, pr.gates[p]));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dout, Upload(be, LiveSet::kActivations, Working<W>(pr.dout[p])));
        PLATEAU_ASSIGN_OR_RETURN(Buffer out, Upload(be, LiveSet::kActivations, Working<W>(pr.out0[p])));
        PLATEAU_ASSIGN_OR_RETURN(Buffer du, Upload(be, LiveSet::kActivations, Working<W>(pr.du0[p])));
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
        const ExpertWeightsT<W> w{wg.as<W>(), wu.as<W>(), wd.as<W>()};
        const ExpertGradsT<W> g{gg.as<W>(), gu.as<W>(), gd.as<W>()};

        PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<ExpertDispatch> ep,
                                 make(p, m, be, *kernels, world, *compute, *comm));
        MemoryTracker& tracker = be.device().tracker();
        tracker.ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(ep->Forward(u.as<W>(), chosen.as<int32_t>(), gates.as<float>(), n, w, out.as<W>()));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        got.peak_forward[p] = tracker.peak(LiveSet::kDispatch);
        if (after_forward) after_forward(p, *ep);
        tracker.ResetPeaks();
        PLATEAU_RETURN_IF_ERROR(ep->Backward(dout.as<W>(), w, du.as<W>(), dgates.as<float>(), g));
        PLATEAU_RETURN_IF_ERROR(compute->Synchronize());
        PLATEAU_RETURN_IF_ERROR(comm->Synchronize());
        got.peak_backward[p] = tracker.peak(LiveSet::kDispatch);
        if (after_backward) after_backward(p, *ep);
        ep->Release();
        got.after[p] = tracker.current(LiveSet::kDispatch);

        for (int64_t i = 0; i < n * H; ++i) got.out[p].push_back(LoadedValue(out.as<W>()[i]));
        for (int64_t i = 0; i < n * H; ++i) got.du[p].push_back(LoadedValue(du.as<W>()[i]));
        got.dgates[p].assign(dgates.as<float>(), dgates.as<float>() + n * K);
        for (int64_t i = 0; i < Ep * mat; ++i) {
          got.gg[p * Ep * mat + i] = LoadedValue(gg.as<W>()[i]);
          got.gu[p * Ep * mat + i] = LoadedValue(gu.as<W>()[i]);
          got.gd[p * Ep * mat + i] = LoadedValue(gd.as<W>()[i]);
        }
        return absl::OkStatus();
      });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

}  // namespace

DispatchGot RunDispatch(const DispatchProblem& pr, const DispatchFactory& make, const DispatchObserver& after_forward,
                        const DispatchObserver& after_backward, int64_t device_bytes) {
  return RunDispatchT<float>(pr, make, after_forward, after_backward, device_bytes);
}

DispatchGot RunDispatchBf16(const DispatchProblem& pr, const DispatchFactory& make,
                            const DispatchObserver& after_forward, const DispatchObserver& after_backward,
                            int64_t device_bytes) {
  return RunDispatchT<Bf16>(pr, make, after_forward, after_backward, device_bytes);
}

DispatchProblem RoundedToBf16(DispatchProblem pr) {
  auto round = [](std::vector<float>& v) {
    for (float& x : v) x = RoundToBf16(x);
  };
  for (auto* rows : {&pr.u, &pr.dout, &pr.out0, &pr.du0}) {
    for (std::vector<float>& r : *rows) round(r);
  }
  for (std::vector<float>* v : {&pr.wg, &pr.wu, &pr.wd, &pr.gg0, &pr.gu0, &pr.gd0}) round(*v);
  return pr;
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

DispatchBf16Want DispatchReferenceBf16(const DispatchProblem& pr, int64_t chunks) {
  const int64_t H = pr.m.hidden, F = pr.m.expert_ffn, K = pr.m.top_k;
  const double f = std::ldexp(1.0, -24), u = kBf16UnitRoundoff;
  DispatchBf16Want w;
  w.gg.assign(pr.gg0.begin(), pr.gg0.end());
  w.gu.assign(pr.gu0.begin(), pr.gu0.end());
  w.gd.assign(pr.gd0.begin(), pr.gd0.end());
  // Per gradient element: the terms' magnitudes (with |g0|) and the
  // propagated bound.
  std::vector<double> gg_mag(pr.gg0.size()), gu_mag(pr.gu0.size()), gd_mag(pr.gd0.size());
  for (size_t i = 0; i < gg_mag.size(); ++i) gg_mag[i] = std::abs(pr.gg0[i]);
  for (size_t i = 0; i < gu_mag.size(); ++i) gu_mag[i] = std::abs(pr.gu0[i]);
  for (size_t i = 0; i < gd_mag.size(); ++i) gd_mag[i] = std::abs(pr.gd0[i]);
  std::vector<double> gg_prop(gg_mag.size(), 0.0), gu_prop(gu_mag.size(), 0.0), gd_prop(gd_mag.size(), 0.0);
  int64_t routes = 0;
  for (int64_t n : pr.n) routes += n * K;
  // A GEMM-like sum z = c + sum_i a_i b_i of stored values, the a_i each
  // within da_i of the schedule's (b exact): the stored result.
  auto dot = [&](double c, int64_t k, auto a, auto da, auto b) {
    double z = c, mag = std::abs(c), prop = 0;
    for (int64_t i = 0; i < k; ++i) {
      z += a(i) * b(i);
      mag += std::abs(a(i) * b(i));
      prop += da(i) * std::abs(b(i));
    }
    return StoreBf16(z, prop + (k + 3) * f * (mag + prop));
  };
  auto sigmoid = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  std::vector<StoredBf16> gate(F), up(F), act(F), y(H), dy(H), dact(F), dgate(F), dup(F), dx1(H);
  std::vector<std::vector<StoredBf16>> ys(K), dxs(K);
  for (int p = 0; p < pr.P; ++p) {
    std::vector<StoredBf16> out(pr.n[p] * H), du(pr.n[p] * H);
    std::vector<double> dgates(pr.n[p] * K), dgates_err(pr.n[p] * K);
    for (int64_t t = 0; t < pr.n[p]; ++t) {
      const float* x = &pr.u[p][t * H];
      const float* d = &pr.dout[p][t * H];
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = pr.chosen[p][t * K + j];
        const double g = pr.gates[p][t * K + j];
        auto xs = [&](int64_t h) { return double(x[h]); };
        auto zero = [](int64_t) { return 0.0; };
        // Forward.
        for (int64_t c = 0; c < F; ++c) {
          gate[c] = dot(0, H, xs, zero, [&](int64_t h) { return double(pr.wg[(e * H + h) * F + c]); });
          up[c] = dot(0, H, xs, zero, [&](int64_t h) { return double(pr.wu[(e * H + h) * F + c]); });
          const double gv = gate[c].value, uv = up[c].value, dg = gate[c].dev(), du_ = up[c].dev();
          const double silu = gv * sigmoid(gv), a = silu * uv;
          const double prop = 1.1 * dg * (std::abs(uv) + du_) + std::abs(silu) * du_;
          act[c] = StoreBf16(a, prop + 16 * f * (std::abs(a) + prop));
        }
        for (int64_t h = 0; h < H; ++h) {
          y[h] = dot(
              0, F, [&](int64_t c) { return act[c].value; }, [&](int64_t c) { return act[c].dev(); },
              [&](int64_t c) { return double(pr.wd[(e * F + c) * H + h]); });
        }
        ys[j] = y;
        // dgates: <dout, y> summed in double, one fp32 rounding.
        double dg = 0, mag = 0, prop = 0;
        for (int64_t h = 0; h < H; ++h) {
          dg += double(d[h]) * y[h].value;
          mag += std::abs(double(d[h]) * y[h].value);
          prop += std::abs(double(d[h])) * y[h].dev();
        }
        dgates[t * K + j] = dg;
        dgates_err[t * K + j] = prop + f * (std::abs(dg) + prop) + 1e-12 * mag;
        // Backward: dy = rn(g dout), its fp32 product rounded once first.
        for (int64_t h = 0; h < H; ++h) dy[h] = StoreBf16(g * d[h], f * std::abs(g * d[h]));
        for (int64_t c = 0; c < F; ++c) {
          dact[c] = dot(
              0, H, [&](int64_t h) { return dy[h].value; }, [&](int64_t h) { return dy[h].dev(); },
              [&](int64_t h) { return double(pr.wd[(e * F + c) * H + h]); });
          const double gv = gate[c].value, uv = up[c].value, dgv = gate[c].dev(), duv = up[c].dev();
          const double dv = dact[c].value, ddv = dact[c].dev();
          const double sg = sigmoid(gv), silu = gv * sg, silu_d = sg * (1.0 + gv * (1.0 - sg));
          const double a = std::abs(dv), b = std::abs(uv);
          // d gate = d up silu'(g): (d' - d) u' s' + d (u' - u) s' + d u (s' - s).
          const double pg = ddv * (b + duv) * 1.1 + a * duv * 1.1 + a * b * 0.5 * dgv;
          dgate[c] = StoreBf16(dv * uv * silu_d, pg + 32 * f * (a + ddv) * (b + duv) * (1 + std::abs(gv) + dgv));
          // d up = d silu(g).
          const double pu = ddv * (std::abs(silu) + 1.1 * dgv) + a * 1.1 * dgv;
          dup[c] = StoreBf16(dv * silu, pu + 16 * f * (std::abs(dv * silu) + pu));
        }
        for (int64_t h = 0; h < H; ++h) {
          dx1[h] = dot(
              0, F, [&](int64_t c) { return dgate[c].value; }, [&](int64_t c) { return dgate[c].dev(); },
              [&](int64_t c) { return double(pr.wg[(e * H + h) * F + c]); });
        }
        dxs[j].resize(H);
        for (int64_t h = 0; h < H; ++h) {
          // dx = rn(dx1 + d up Wu^T): the GEMM with beta 1 on the stored dx1.
          double z = dx1[h].value, mag = std::abs(z), prop = dx1[h].dev();
          for (int64_t c = 0; c < F; ++c) {
            const double wu = pr.wu[(e * H + h) * F + c];
            z += dup[c].value * wu;
            mag += std::abs(dup[c].value * wu);
            prop += dup[c].dev() * std::abs(wu);
          }
          dxs[j][h] = StoreBf16(z, prop + (F + 3) * f * (mag + prop));
        }
        // The expert's gradients: exact sums of the stored terms.
        for (int64_t c = 0; c < F; ++c) {
          for (int64_t h = 0; h < H; ++h) {
            const int64_t id = (e * F + c) * H + h;
            w.gd[id] += act[c].value * dy[h].value;
            gd_mag[id] += std::abs(act[c].value * dy[h].value);
            gd_prop[id] += act[c].dev() * std::abs(dy[h].value) + std::abs(act[c].value) * dy[h].dev() +
                           act[c].dev() * dy[h].dev();
            const int64_t iw = (e * H + h) * F + c;
            w.gg[iw] += double(x[h]) * dgate[c].value;
            gg_mag[iw] += std::abs(double(x[h]) * dgate[c].value);
            gg_prop[iw] += std::abs(double(x[h])) * dgate[c].dev();
            w.gu[iw] += double(x[h]) * dup[c].value;
            gu_mag[iw] += std::abs(double(x[h]) * dup[c].value);
            gu_prop[iw] += std::abs(double(x[h])) * dup[c].dev();
          }
        }
      }
      // The token's rows: out = rn(out0 + sum_j g_j y_j), du = rn(du0 +
      // sum_j dx_j), each one fp32 sum.
      for (int64_t h = 0; h < H; ++h) {
        double z = pr.out0[p][t * H + h], mag = std::abs(z), prop = 0;
        double zd = pr.du0[p][t * H + h], magd = std::abs(zd), propd = 0;
        for (int64_t j = 0; j < K; ++j) {
          const double g = pr.gates[p][t * K + j];
          z += g * ys[j][h].value;
          mag += std::abs(g * ys[j][h].value);
          prop += std::abs(g) * ys[j][h].dev();
          zd += dxs[j][h].value;
          magd += std::abs(dxs[j][h].value);
          propd += dxs[j][h].dev();
        }
        out[t * H + h] = StoreBf16(z, prop + (K + 3) * f * (mag + prop));
        du[t * H + h] = StoreBf16(zd, propd + (K + 3) * f * (magd + propd));
        w.loose += (out[t * H + h].lo != out[t * H + h].hi) + (du[t * H + h].lo != du[t * H + h].hi);
      }
    }
    w.out.push_back(std::move(out));
    w.du.push_back(std::move(du));
    w.dgates.push_back(std::move(dgates));
    w.dgates_err.push_back(std::move(dgates_err));
  }
  // The sums' own error: fp32 adds, and two bf16 roundings of the
  // magnitudes (the partial sums each rank stores, disjoint terms; and the
  // owner's one rounding of its fp32 sum of them, once per
  // Backend::kBf16AddRowsPerCall helpers). Helpers added in bf16 one at a
  // time would be P + 1.
  const int64_t per_call = Backend::kBf16AddRowsPerCall;
  const double rounding = std::pow(1.0 + u, 1 + std::max<int64_t>(1, (pr.P - 1 + per_call - 1) / per_call)) - 1.0;
  auto err = [&](const std::vector<double>& mag, const std::vector<double>& prop) {
    std::vector<double> e(mag.size());
    for (size_t i = 0; i < e.size(); ++i) {
      const double m = mag[i] + prop[i];
      e[i] = prop[i] + (routes + 3 * chunks * pr.P + 8) * f * m + rounding * m * (1 + 1e-3);
    }
    return e;
  };
  w.gg_err = err(gg_mag, gg_prop);
  w.gu_err = err(gu_mag, gu_prop);
  w.gd_err = err(gd_mag, gd_prop);
  return w;
}

void ExpectWithinBf16Reference(const DispatchGot& got, const DispatchBf16Want& want) {
  ASSERT_EQ(got.out.size(), want.out.size());
  int64_t differ = 0;  // stored values other than the reference's own (allowed within their interval)
  for (size_t p = 0; p < want.out.size(); ++p) {
    ASSERT_EQ(got.out[p].size(), want.out[p].size());
    ASSERT_EQ(got.du[p].size(), want.du[p].size());
    ASSERT_EQ(got.dgates[p].size(), want.dgates[p].size());
    for (const auto& [name, g, w] :
         {std::make_tuple("out", &got.out[p], &want.out[p]), std::make_tuple("du", &got.du[p], &want.du[p])}) {
      for (size_t i = 0; i < w->size(); ++i) {
        const StoredBf16& s = (*w)[i];
        differ += (*g)[i] != s.value;
        ASSERT_TRUE(s.Holds((*g)[i])) << name << " of rank " << p << " [" << i << "]: " << (*g)[i] << ", reference "
                                      << s.value << ", bounds [" << s.lo << ", " << s.hi << "]";
      }
    }
    for (size_t i = 0; i < want.dgates[p].size(); ++i) {
      ASSERT_LE(std::abs(got.dgates[p][i] - want.dgates[p][i]), want.dgates_err[p][i])
          << "dgates of rank " << p << " [" << i << "]: " << got.dgates[p][i] << ", reference " << want.dgates[p][i];
    }
  }
  double worst = 0;
  for (const auto& [name, g, w, e] : {std::make_tuple("d w_gate", &got.gg, &want.gg, &want.gg_err),
                                      std::make_tuple("d w_up", &got.gu, &want.gu, &want.gu_err),
                                      std::make_tuple("d w_down", &got.gd, &want.gd, &want.gd_err)}) {
    ASSERT_EQ(g->size(), w->size()) << name;
    for (size_t i = 0; i < w->size(); ++i) {
      const double d = std::abs((*g)[i] - (*w)[i]);
      ASSERT_LE(d, (*e)[i]) << name << " [" << i << "]: " << (*g)[i] << ", reference " << (*w)[i] << ", bound "
                            << (*e)[i];
      worst = std::max(worst, d / (*e)[i]);
    }
  }
  std::cout << "bf16 against the store-rounded reference: " << differ << " stored out / du values off the "
            << "reference's own (" << want.loose << " allowed a unit); expert gradients at most " << worst
            << " of their bound\n";
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
