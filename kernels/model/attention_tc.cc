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

// The scores' scale in base-2 units: p = exp2(x c - m2) = exp(scale x - m)
// for the unscaled product x = q . k and m2 = m log2(e).
float ScaleLog2(const AttentionShape& s) { return s.scale * kAttentionTcLog2e; }

// 2^x, as the kernels' ex2.approx.ftz: a result below the smallest normal
// float is 0 (std::exp2 would keep it subnormal).
float Exp2(float x) {
  const float y = std::exp2(x);
  return y < std::numeric_limits<float>::min() ? 0.0f : y;
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
                     const Bf16* vc, float lse2, float delta) {
  const float p = Exp2(std::fma(Dot(qr, kc, s.head_dim), ScaleLog2(s), -lse2));
  const float dp = Dot(dor, vc, s.head_dim);
  return {p, p * (dp - delta)};
}

// A row's lse in base-2 units; +inf for a row that saw no key (lse = -inf),
// so that its p = exp2(-inf) = 0.
float Lse2(float lse) { return lse == -kInf ? kInf : lse * kAttentionTcLog2e; }

}  // namespace

void TensorCoreAttentionForward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                const Bf16* v, float* m, float* l, float* acc) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  const float c2 = ScaleLog2(s);
  float p[kAttentionTcTile];
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t r = 0; r < s.q_len; ++r) {
      for (int64_t h = 0; h < s.heads; ++h) {
        const int64_t row = (b * s.q_len + r) * s.heads + h;
        const Bf16* qr = q + (b * s.q_len + r) * qs + h * d;
        float* ar = acc + row * d;
        const int64_t kv0 = b * s.kv_len * ks + (h / group) * d;
        float m2 = m[row] * kAttentionTcLog2e;  // base-2 units within the call
        for (int64_t j0 = 0; j0 < s.kv_len; j0 += kAttentionTcTile) {
          const int64_t nk = std::min(kAttentionTcTile, s.kv_len - j0);
          float xmax = -kInf;
          for (int64_t c = 0; c < nk; ++c) {
            p[c] = Visible(s, r, j0 + c) ? Dot(qr, k + kv0 + (j0 + c) * ks, d) : -kInf;
            xmax = std::max(xmax, p[c]);
          }
          if (xmax == -kInf) continue;  // no visible key in this tile
          const float mnew = std::max(m2, xmax * c2);
          const float alpha = Exp2(m2 - mnew);  // 0 when m2 = -inf
          float sum = 0.0f;
          for (int64_t c = 0; c < nk; ++c) {
            p[c] = RoundToBf16(Exp2(std::fma(p[c], c2, -mnew)));  // exp2(-inf) = 0: masked
            sum += p[c];
          }
          l[row] = l[row] * alpha + sum;
          m2 = mnew;
          for (int64_t e = 0; e < d; ++e) {
            float pv = 0.0f;
            for (int64_t c = 0; c < nk; ++c) pv += p[c] * Ld(v[kv0 + (j0 + c) * ks + e]);
            ar[e] = ar[e] * alpha + pv;
          }
        }
        // Back to natural units, only where a tile raised the maximum: an
        // unchanged row keeps its m bit for bit.
        if (m2 != m[row] * kAttentionTcLog2e) m[row] = m2 * kAttentionTcLn2;
      }
    }
  }
}

void TensorCoreAttentionBackward(const AttentionShape& s, const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* dout,
                                 const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  // dq: query-major, as the dQ kernel (one row's sum, then one addition).
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
          const ProbGrad pg = ProbAndGrad(s, q + qoff, dout + qoff, kc, v + kv0 + key * ks,
                                          Lse2(lse[row]), delta[row]);
          const float ds = RoundToBf16(pg.ds);
          for (int64_t e = 0; e < d; ++e) dqa[e] += ds * Ld(kc[e]);
        }
        for (int64_t e = 0; e < d; ++e) {
          dq[qoff + e] += s.scale * dqa[e];
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
            const ProbGrad pg = ProbAndGrad(s, q + qoff, dout + qoff, k + koff, v + koff,
                                            Lse2(lse[row]), delta[row]);
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
