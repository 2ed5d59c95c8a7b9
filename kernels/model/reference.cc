#include "kernels/model/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/model/init.h"

namespace plateau {
namespace {

// Index of each weight in ModelWeights() order.
struct LayerIdx {
  int attn_norm, wq, wk, wv, wo, moe_norm, router, w_gate, w_up, w_down;
};
constexpr int kEmbed = 0;
constexpr int kPerLayer = 10;
LayerIdx Layer(int64_t l) {
  int b = 1 + static_cast<int>(l) * kPerLayer;
  return {b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8, b + 9};
}
int FinalNorm(const ModelConfig& m) { return 1 + static_cast<int>(m.layers) * kPerLayer; }
int LmHead(const ModelConfig& m) { return FinalNorm(m) + 1; }

// C[M x N] (+)= A[M x K] @ B[K x N], all row-major; op flags transpose the
// stored matrix (A stored K x M when ta, B stored N x K when tb).
template <typename T>
void MatMul(const T* a, const T* b, T* c, int64_t M, int64_t N, int64_t K,
            bool ta, bool tb, bool accumulate) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      T s = 0;
      for (int64_t p = 0; p < K; ++p) {
        T av = ta ? a[p * M + i] : a[i * K + p];
        T bv = tb ? b[j * K + p] : b[p * N + j];
        s += av * bv;
      }
      c[i * N + j] = accumulate ? c[i * N + j] + s : s;
    }
  }
}

template <typename T>
void RmsNorm(const T* x, const T* w, T* y, T* rstd, int64_t rows, int64_t H, T eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T ss = 0;
    for (int64_t c = 0; c < H; ++c) ss += x[r * H + c] * x[r * H + c];
    T rs = T(1) / std::sqrt(ss / T(H) + eps);
    rstd[r] = rs;
    for (int64_t c = 0; c < H; ++c) y[r * H + c] = x[r * H + c] * rs * w[c];
  }
}

// dx += d/dx, dw += d/dw of y = rmsnorm(x, w), given dy.
template <typename T>
void RmsNormBack(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw,
                 int64_t rows, int64_t H) {
  for (int64_t r = 0; r < rows; ++r) {
    const T rs = rstd[r];
    T dot = 0;
    for (int64_t c = 0; c < H; ++c) dot += dy[r * H + c] * w[c] * x[r * H + c];
    for (int64_t c = 0; c < H; ++c) {
      dw[c] += dy[r * H + c] * x[r * H + c] * rs;
      dx[r * H + c] += rs * w[c] * dy[r * H + c] - x[r * H + c] * rs * rs * rs * dot / T(H);
    }
  }
}

// Rotates every head vector of `x` ([rows, heads, d]) in place; `inverse`
// applies the transpose rotation (the backward of the forward rotation).
template <typename T>
void Rope(T* x, int64_t batch, int64_t seq, int64_t heads, int64_t d, float theta,
          bool inverse) {
  const int64_t half = d / 2;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + ((b * seq + t) * heads + h) * d;
        for (int64_t j = 0; j < half; ++j) {
          const float freq = std::pow(theta, -2.0f * static_cast<float>(j) / static_cast<float>(d));
          const float angle = static_cast<float>(t) * freq;
          const T c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
          const T x1 = v[j], x2 = v[j + half];
          v[j] = x1 * c - x2 * s;
          v[j + half] = x2 * c + x1 * s;
        }
      }
    }
  }
}

template <typename T>
T Silu(T x) { return x / (T(1) + std::exp(-x)); }

// What one layer's forward keeps for its backward.
template <typename T>
struct LayerTape {
  std::vector<T> x, a, rstd_a, q, k, v, probs, o, h1, u, rstd_u, p;  // p: router softmax
  std::vector<int64_t> chosen;  // [rows, k]
  std::vector<T> gates;         // [rows, k] renormalised
  std::vector<T> gate_pre, up_pre, act, y;  // [rows, k, F] / [rows, k, H]
};

}  // namespace

template <typename T>
Tensors<T> InitWeights(const ModelConfig& m, uint64_t seed) {
  Tensors<T> out;
  for (const WeightSpec& w : ModelWeights(m)) {
    std::vector<T> v(w.numel());
    if (w.init_std == 0.0f) {
      std::fill(v.begin(), v.end(), T(1));
    } else {
      const uint64_t key = WeightKey(seed, w.name);
      for (int64_t i = 0; i < w.numel(); ++i) {
        v[i] = static_cast<T>(static_cast<float>(w.init_std * StandardNormal(key, i)));
      }
    }
    out.push_back(std::move(v));
  }
  return out;
}

template <typename T>
Tensors<T> ZerosLike(const Tensors<T>& t) {
  Tensors<T> z;
  for (const auto& v : t) z.emplace_back(v.size(), T(0));
  return z;
}

template <typename T>
T ReferenceLossAndGrads(const ModelConfig& m, const Tensors<T>& W,
                        const std::vector<int32_t>& tokens,
                        const std::vector<int32_t>& targets, int64_t batch,
                        typename NonDeduced<Tensors<T>>::type* grads) {
  const int64_t S = m.seq_len, R = batch * S, H = m.hidden, d = m.head_dim(),
                nh = m.heads, nkv = m.kv_heads, E = m.experts, K = m.top_k,
                F = m.expert_ffn, V = m.vocab_size, group = nh / nkv;
  const T eps = static_cast<T>(m.norm_eps);
  const T scale = T(1) / std::sqrt(static_cast<T>(d));

  // ---- forward ----
  std::vector<T> h(R * H);
  for (int64_t r = 0; r < R; ++r) {
    std::copy_n(&W[kEmbed][tokens[r] * H], H, &h[r * H]);
  }
  std::vector<LayerTape<T>> tape(m.layers);
  for (int64_t l = 0; l < m.layers; ++l) {
    const LayerIdx L = Layer(l);
    LayerTape<T>& tp = tape[l];
    tp.x = h;
    tp.a.resize(R * H);
    tp.rstd_a.resize(R);
    RmsNorm(h.data(), W[L.attn_norm].data(), tp.a.data(), tp.rstd_a.data(), R, H, eps);
    tp.q.resize(R * nh * d);
    tp.k.resize(R * nkv * d);
    tp.v.resize(R * nkv * d);
    MatMul(tp.a.data(), W[L.wq].data(), tp.q.data(), R, nh * d, H, false, false, false);
    MatMul(tp.a.data(), W[L.wk].data(), tp.k.data(), R, nkv * d, H, false, false, false);
    MatMul(tp.a.data(), W[L.wv].data(), tp.v.data(), R, nkv * d, H, false, false, false);
    Rope(tp.q.data(), batch, S, nh, d, m.rope_theta, false);
    Rope(tp.k.data(), batch, S, nkv, d, m.rope_theta, false);
    // probs[b, head, t, s] for s <= t (zero above the diagonal).
    tp.probs.assign(batch * nh * S * S, T(0));
    tp.o.assign(R * nh * d, T(0));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t g = i / group;
        for (int64_t t = 0; t < S; ++t) {
          const T* q = &tp.q[((b * S + t) * nh + i) * d];
          T* pr = &tp.probs[((b * nh + i) * S + t) * S];
          T mx = -INFINITY;
          for (int64_t s = 0; s <= t; ++s) {
            const T* k = &tp.k[((b * S + s) * nkv + g) * d];
            T dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += q[c] * k[c];
            pr[s] = dot * scale;
            mx = std::max(mx, pr[s]);
          }
          T sum = 0;
          for (int64_t s = 0; s <= t; ++s) sum += (pr[s] = std::exp(pr[s] - mx));
          T* o = &tp.o[((b * S + t) * nh + i) * d];
          for (int64_t s = 0; s <= t; ++s) {
            pr[s] /= sum;
            const T* v = &tp.v[((b * S + s) * nkv + g) * d];
            for (int64_t c = 0; c < d; ++c) o[c] += pr[s] * v[c];
          }
        }
      }
    }
    tp.h1 = h;
    MatMul(tp.o.data(), W[L.wo].data(), tp.h1.data(), R, H, nh * d, false, false, true);
    tp.u.resize(R * H);
    tp.rstd_u.resize(R);
    RmsNorm(tp.h1.data(), W[L.moe_norm].data(), tp.u.data(), tp.rstd_u.data(), R, H, eps);
    // Router: softmax, top-k (ties to the lower index), renormalise.
    std::vector<T> logits(R * E);
    MatMul(tp.u.data(), W[L.router].data(), logits.data(), R, E, H, false, false, false);
    tp.p.resize(R * E);
    tp.chosen.resize(R * K);
    tp.gates.resize(R * K);
    for (int64_t r = 0; r < R; ++r) {
      T* p = &tp.p[r * E];
      T mx = *std::max_element(&logits[r * E], &logits[r * E] + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[r * E + e] - mx));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      std::vector<int64_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [p](int64_t x, int64_t y) { return p[x] > p[y]; });
      T total = 0;
      for (int64_t j = 0; j < K; ++j) total += p[order[j]];
      for (int64_t j = 0; j < K; ++j) {
        tp.chosen[r * K + j] = order[j];
        tp.gates[r * K + j] = p[order[j]] / total;
      }
    }
    // Experts: SwiGLU per (token, choice).
    tp.gate_pre.resize(R * K * F);
    tp.up_pre.resize(R * K * F);
    tp.act.resize(R * K * F);
    tp.y.resize(R * K * H);
    h = tp.h1;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = tp.chosen[r * K + j], rk = r * K + j;
        MatMul(&tp.u[r * H], &W[L.w_gate][e * H * F], &tp.gate_pre[rk * F], 1, F, H, false, false, false);
        MatMul(&tp.u[r * H], &W[L.w_up][e * H * F], &tp.up_pre[rk * F], 1, F, H, false, false, false);
        for (int64_t f = 0; f < F; ++f) {
          tp.act[rk * F + f] = Silu(tp.gate_pre[rk * F + f]) * tp.up_pre[rk * F + f];
        }
        MatMul(&tp.act[rk * F], &W[L.w_down][e * F * H], &tp.y[rk * H], 1, H, F, false, false, false);
        for (int64_t c = 0; c < H; ++c) h[r * H + c] += tp.gates[rk] * tp.y[rk * H + c];
      }
    }
  }
  std::vector<T> z(R * H), rstd_f(R);
  RmsNorm(h.data(), W[FinalNorm(m)].data(), z.data(), rstd_f.data(), R, H, eps);
  std::vector<T> logits(R * V);
  MatMul(z.data(), W[LmHead(m)].data(), logits.data(), R, V, H, false, true, false);
  int64_t valid = 0;
  for (int64_t r = 0; r < R; ++r) valid += targets[r] != kIgnoreIndex;
  T loss = 0;
  std::vector<T> dlogits(R * V, T(0));
  for (int64_t r = 0; r < R; ++r) {
    if (targets[r] == kIgnoreIndex) continue;
    const T* lg = &logits[r * V];
    T mx = *std::max_element(lg, lg + V), sum = 0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(lg[c] - mx);
    const T lse = mx + std::log(sum);
    loss += lse - lg[targets[r]];
    for (int64_t c = 0; c < V; ++c) {
      dlogits[r * V + c] = (std::exp(lg[c] - lse) - (c == targets[r] ? T(1) : T(0))) / T(valid);
    }
  }
  if (valid > 0) loss /= T(valid);
  if (grads == nullptr) return loss;

  // ---- backward ----
  Tensors<T>& G = *grads;
  G = ZerosLike(W);
  std::vector<T> dz(R * H), dh(R * H, T(0));
  MatMul(dlogits.data(), z.data(), G[LmHead(m)].data(), V, H, R, true, false, true);
  MatMul(dlogits.data(), W[LmHead(m)].data(), dz.data(), R, H, V, false, false, false);
  RmsNormBack(h.data(), W[FinalNorm(m)].data(), rstd_f.data(), dz.data(), dh.data(),
              G[FinalNorm(m)].data(), R, H);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    const LayerIdx L = Layer(l);
    LayerTape<T>& tp = tape[l];
    // MoE: dh flows to h1 through the residual and through the experts.
    std::vector<T> du(R * H, T(0)), dlog(R * E, T(0));
    for (int64_t r = 0; r < R; ++r) {
      std::vector<T> dgate(K);
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = tp.chosen[r * K + j], rk = r * K + j;
        T dg = 0;
        std::vector<T> dy(H);
        for (int64_t c = 0; c < H; ++c) {
          dg += dh[r * H + c] * tp.y[rk * H + c];
          dy[c] = tp.gates[rk] * dh[r * H + c];
        }
        dgate[j] = dg;
        std::vector<T> dact(F), dgp(F), dup(F);
        MatMul(dy.data(), &W[L.w_down][e * F * H], dact.data(), 1, F, H, false, true, false);
        MatMul(&tp.act[rk * F], dy.data(), &G[L.w_down][e * F * H], F, H, 1, true, false, true);
        for (int64_t f = 0; f < F; ++f) {
          const T gp = tp.gate_pre[rk * F + f], sg = T(1) / (T(1) + std::exp(-gp));
          dgp[f] = dact[f] * tp.up_pre[rk * F + f] * sg * (T(1) + gp * (T(1) - sg));
          dup[f] = dact[f] * gp * sg;
        }
        MatMul(&tp.u[r * H], dgp.data(), &G[L.w_gate][e * H * F], H, F, 1, true, false, true);
        MatMul(&tp.u[r * H], dup.data(), &G[L.w_up][e * H * F], H, F, 1, true, false, true);
        MatMul(dgp.data(), &W[L.w_gate][e * H * F], &du[r * H], 1, H, F, false, true, true);
        MatMul(dup.data(), &W[L.w_up][e * H * F], &du[r * H], 1, H, F, false, true, true);
      }
      // Renormalised gates g_j = p_j / S: dp_j = (dg_j - sum_i dg_i g_i) / S.
      T total = 0, gdot = 0;
      for (int64_t j = 0; j < K; ++j) {
        total += tp.p[r * E + tp.chosen[r * K + j]];
        gdot += dgate[j] * tp.gates[r * K + j];
      }
      std::vector<T> dp(E, T(0));
      for (int64_t j = 0; j < K; ++j) dp[tp.chosen[r * K + j]] = (dgate[j] - gdot) / total;
      T pdot = 0;
      for (int64_t e = 0; e < E; ++e) pdot += dp[e] * tp.p[r * E + e];
      for (int64_t e = 0; e < E; ++e) dlog[r * E + e] = tp.p[r * E + e] * (dp[e] - pdot);
    }
    MatMul(tp.u.data(), dlog.data(), G[L.router].data(), H, E, R, true, false, true);
    MatMul(dlog.data(), W[L.router].data(), du.data(), R, H, E, false, true, true);
    std::vector<T> dh1 = dh;  // residual
    RmsNormBack(tp.h1.data(), W[L.moe_norm].data(), tp.rstd_u.data(), du.data(), dh1.data(),
                G[L.moe_norm].data(), R, H);
    // Attention.
    std::vector<T> dO(R * nh * d);
    MatMul(tp.o.data(), dh1.data(), G[L.wo].data(), nh * d, H, R, true, false, true);
    MatMul(dh1.data(), W[L.wo].data(), dO.data(), R, nh * d, H, false, true, false);
    std::vector<T> dq(R * nh * d, T(0)), dk(R * nkv * d, T(0)), dv(R * nkv * d, T(0));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t g = i / group;
        for (int64_t t = 0; t < S; ++t) {
          const T* pr = &tp.probs[((b * nh + i) * S + t) * S];
          const T* dot_o = &dO[((b * S + t) * nh + i) * d];
          std::vector<T> dpr(t + 1);
          T sum = 0;
          for (int64_t s = 0; s <= t; ++s) {
            const T* v = &tp.v[((b * S + s) * nkv + g) * d];
            T* dvs = &dv[((b * S + s) * nkv + g) * d];
            T acc = 0;
            for (int64_t c = 0; c < d; ++c) {
              acc += dot_o[c] * v[c];
              dvs[c] += pr[s] * dot_o[c];
            }
            dpr[s] = acc;
            sum += acc * pr[s];
          }
          const T* q = &tp.q[((b * S + t) * nh + i) * d];
          T* dqt = &dq[((b * S + t) * nh + i) * d];
          for (int64_t s = 0; s <= t; ++s) {
            const T ds = pr[s] * (dpr[s] - sum) * scale;
            const T* k = &tp.k[((b * S + s) * nkv + g) * d];
            T* dks = &dk[((b * S + s) * nkv + g) * d];
            for (int64_t c = 0; c < d; ++c) {
              dqt[c] += ds * k[c];
              dks[c] += ds * q[c];
            }
          }
        }
      }
    }
    Rope(dq.data(), batch, S, nh, d, m.rope_theta, true);
    Rope(dk.data(), batch, S, nkv, d, m.rope_theta, true);
    std::vector<T> da(R * H, T(0));
    MatMul(tp.a.data(), dq.data(), G[L.wq].data(), H, nh * d, R, true, false, true);
    MatMul(tp.a.data(), dk.data(), G[L.wk].data(), H, nkv * d, R, true, false, true);
    MatMul(tp.a.data(), dv.data(), G[L.wv].data(), H, nkv * d, R, true, false, true);
    MatMul(dq.data(), W[L.wq].data(), da.data(), R, H, nh * d, false, true, true);
    MatMul(dk.data(), W[L.wk].data(), da.data(), R, H, nkv * d, false, true, true);
    MatMul(dv.data(), W[L.wv].data(), da.data(), R, H, nkv * d, false, true, true);
    dh = dh1;  // residual
    RmsNormBack(tp.x.data(), W[L.attn_norm].data(), tp.rstd_a.data(), da.data(), dh.data(),
                G[L.attn_norm].data(), R, H);
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < H; ++c) G[kEmbed][tokens[r] * H + c] += dh[r * H + c];
  }
  return loss;
}

template Tensors<float> InitWeights<float>(const ModelConfig&, uint64_t);
template Tensors<double> InitWeights<double>(const ModelConfig&, uint64_t);
template Tensors<float> ZerosLike<float>(const Tensors<float>&);
template Tensors<double> ZerosLike<double>(const Tensors<double>&);
template float ReferenceLossAndGrads<float>(const ModelConfig&, const Tensors<float>&,
                                            const std::vector<int32_t>&,
                                            const std::vector<int32_t>&, int64_t,
                                            NonDeduced<Tensors<float>>::type*);
template double ReferenceLossAndGrads<double>(const ModelConfig&, const Tensors<double>&,
                                              const std::vector<int32_t>&,
                                              const std::vector<int32_t>&, int64_t,
                                              NonDeduced<Tensors<double>>::type*);

}  // namespace plateau
