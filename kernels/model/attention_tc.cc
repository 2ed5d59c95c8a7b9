#include "kernels/model/attention_tc.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace plateau {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float Ld(Bf16 x) { return Bf16ToFloat(x); }

// The fp32 sum of exact bf16 products, in order (a tensor core's sum is in
// another order: within the stated tolerance).
float Dot(const Bf16* a, const Bf16* b, int64_t d) {
  float sum = 0.0f;
  for (int64_t i = 0; i < d; ++i) sum += Ld(a[i]) * Ld(b[i]);
  return sum;
}

// Causal: key `key` of the block is visible to query row `row`.
bool Visible(const AttentionShape& s, int64_t row, int64_t key) {
  return s.kv_pos0 + key <= s.q_pos0 + row;
}

// One (query row, key) of the backward: p (fp32) and ds = p (dp - delta).
struct ProbGrad {
  float p, ds;
};
ProbGrad ProbAndGrad(const AttentionShape& s, const Bf16* qr, const Bf16* dor, const Bf16* kc,
                     const Bf16* vc, float lse, float delta) {
  const float p = lse == -kInf ? 0.0f : std::exp(s.scale * Dot(qr, kc, s.head_dim) - lse);
  const float dp = Dot(dor, vc, s.head_dim);
  return {p, p * (dp - delta)};
}

}  // namespace

void TensorCoreAttentionForward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                const Bf16* v, float* m, float* l, float* acc) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float p[kAttentionTcTile];
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t r = 0; r < s.q_len; ++r) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t row = (b * s.q_len + r) * s.heads + h;
        const Bf16* qr = q + (b * s.q_len + r) * qs + h * d;
        float* ar = acc + row * d;
        const int64_t kv0 = b * s.kv_len * ks + (h / group) * d;
        for (int64_t j0 = 0; j0 < s.kv_len; j0 += kAttentionTcTile) {
          const int64_t nk = std::min(kAttentionTcTile, s.kv_len - j0);
          float rmax = -kInf;
          for (int64_t c = 0; c < nk; ++c) {
            p[c] = Visible(s, r, j0 + c) ? s.scale * Dot(qr, k + kv0 + (j0 + c) * ks, d) : -kInf;
            rmax = std::max(rmax, p[c]);
          }
          if (rmax == -kInf) continue;  // no visible key in this tile
          const float mnew = std::max(m[row], rmax);
          const float alpha = std::exp(m[row] - mnew);  // 0 when m = -inf
          float sum = 0.0f;
          for (int64_t c = 0; c < nk; ++c) {
            p[c] = RoundToBf16(std::exp(p[c] - mnew));  // exp(-inf) = 0: masked
            sum += p[c];
          }
          l[row] = l[row] * alpha + sum;
          m[row] = mnew;
          for (int64_t e = 0; e < d; ++e) {
            float pv = 0.0f;
            for (int64_t c = 0; c < nk; ++c) pv += p[c] * Ld(v[kv0 + (j0 + c) * ks + e]);
            ar[e] = ar[e] * alpha + pv;
          }
        }
      }
    }
  }
}

void TensorCoreAttentionBackward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                 const Bf16* v, const Bf16* dout, const float* lse,
                                 const float* delta, Bf16* dq, float* dk, float* dv, float* work) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  // dq: query-major, as the dQ kernel (one row's sum, then one rounding).
  float* dqa = work;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t r = 0; r < s.q_len; ++r) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t row = (b * s.q_len + r) * s.heads + h;
        const int64_t qoff = (b * s.q_len + r) * qs + h * d;
        const int64_t kv0 = b * s.kv_len * ks + (h / group) * d;
        std::fill(dqa, dqa + d, 0.0f);
        for (int64_t key = 0; key < s.kv_len && Visible(s, r, key); ++key) {
          const Bf16* kc = k + kv0 + key * ks;
          const ProbGrad pg =
              ProbAndGrad(s, q + qoff, dout + qoff, kc, v + kv0 + key * ks, lse[row], delta[row]);
          const float ds = RoundToBf16(pg.ds);
          for (int64_t e = 0; e < d; ++e) dqa[e] += ds * Ld(kc[e]);
        }
        for (int64_t e = 0; e < d; ++e) {
          dq[qoff + e] = FloatToBf16(Ld(dq[qoff + e]) + s.scale * dqa[e]);
        }
      }
    }
  }
  // dk, dv: key-major, as the dK/dV kernel (the group's heads, then the
  // queries that see the key; one addition at the end).
  float* dka = work;
  float* dva = work + d;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      for (int64_t key = 0; key < s.kv_len; ++key) {
        const int64_t first = std::max<int64_t>(0, s.kv_pos0 + key - s.q_pos0);
        if (first >= s.q_len) continue;
        const int64_t koff = (b * s.kv_len + key) * ks + g * d;
        std::fill(work, work + 2 * d, 0.0f);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t r = first; r < s.q_len; ++r) {
            const int64_t row = (b * s.q_len + r) * s.heads + h;
            const int64_t qoff = (b * s.q_len + r) * qs + h * d;
            const ProbGrad pg =
                ProbAndGrad(s, q + qoff, dout + qoff, k + koff, v + koff, lse[row], delta[row]);
            const float p = RoundToBf16(pg.p), ds = RoundToBf16(pg.ds);
            for (int64_t e = 0; e < d; ++e) {
              dva[e] += p * Ld(dout[qoff + e]);
              dka[e] += ds * Ld(q[qoff + e]);
            }
          }
        }
        for (int64_t e = 0; e < d; ++e) {
          dv[koff + e] += dva[e];
          dk[koff + e] += s.scale * dka[e];
        }
      }
    }
  }
}

}  // namespace plateau
