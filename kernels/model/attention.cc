#include "kernels/model/attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace plateau {
namespace {

// Query rows per panel. A panel meets all of its visible keys in one GEMM
// (scores [panel x visible keys]): large GEMMs keep the BLAS efficient and
// threaded, and the scratch stays linear in the sequence (panel x kv_len).
constexpr int64_t kPanel = kAttentionPanelRows;

// Keys of the block visible to the last row of the panel starting at i0
// (causal: key position <= query position), capped at kv_len.
int64_t VisibleKeys(const AttentionShape& s, int64_t i0, int64_t tq) {
  const int64_t last_query = s.q_pos0 + i0 + tq - 1;
  return std::clamp<int64_t>(last_query - s.kv_pos0 + 1, 0, s.kv_len);
}

// S[tq x tk] = scale * Q_panel K^T with causal masking (-inf).
void Scores(const AttentionShape& s, const float* q, const float* k, int64_t tq, int64_t tk,
            int64_t i0, float* S) {
  const int64_t qs = s.heads * s.head_dim, ks = s.kv_heads * s.head_dim;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tq, tk, s.head_dim, s.scale, q, qs, k, ks,
              0.0f, S, tk);
  for (int64_t r = 0; r < tq; ++r) {
    const int64_t limit = s.q_pos0 + i0 + r - s.kv_pos0;  // last visible key
    for (int64_t c = std::max<int64_t>(0, limit + 1); c < tk; ++c) S[r * tk + c] = -INFINITY;
  }
}

}  // namespace

void AttentionInitState(const AttentionShape& s, float* m, float* l, float* acc) {
  const int64_t rows = s.batch * s.q_len * s.heads;
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * s.head_dim, 0.0f);
}

void AttentionForwardBlock(const AttentionShape& s, const float* q, const float* k,
                           const float* v, float* m, float* l, float* acc, float* work) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float* S = work;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t g = h / group;
      const float* kb = k + b * s.kv_len * ks + g * d;
      const float* vb = v + b * s.kv_len * ks + g * d;
      for (int64_t i0 = 0; i0 < s.q_len; i0 += kPanel) {
        const int64_t tq = std::min(kPanel, s.q_len - i0);
        const int64_t tk = VisibleKeys(s, i0, tq);
        if (tk == 0) continue;  // the whole block lies after these queries
        const float* qt = q + (b * s.q_len + i0) * qs + h * d;
        float* acct = acc + (b * s.q_len + i0) * qs + h * d;
        float* mt = m + (b * s.q_len + i0) * s.heads + h;
        float* lt = l + (b * s.q_len + i0) * s.heads + h;
        Scores(s, qt, kb, tq, tk, i0, S);
        for (int64_t r = 0; r < tq; ++r) {
          float* Sr = &S[r * tk];
          float rmax = -INFINITY;
          for (int64_t c = 0; c < tk; ++c) rmax = std::max(rmax, Sr[c]);
          float& mr = mt[r * s.heads];
          float& lr = lt[r * s.heads];
          if (rmax == -INFINITY) {  // this row sees none of the block's keys
            std::fill(Sr, Sr + tk, 0.0f);
            continue;
          }
          const float mnew = std::max(mr, rmax);
          const float alpha = std::exp(mr - mnew);  // 0 when mr = -inf
          float sum = 0.0f;
          for (int64_t c = 0; c < tk; ++c) {
            Sr[c] = std::exp(Sr[c] - mnew);
            sum += Sr[c];
          }
          lr = lr * alpha + sum;
          mr = mnew;
          float* ar = acct + r * qs;
          for (int64_t c = 0; c < d; ++c) ar[c] *= alpha;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tq, d, tk, 1.0f, S, tk, vb, ks,
                    1.0f, acct, qs);
      }
    }
  }
}

void AttentionFinalize(const AttentionShape& s, const float* m, const float* l,
                       float* acc_to_o, float* lse) {
  const int64_t rows = s.batch * s.q_len * s.heads, d = s.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    float* o = acc_to_o + r * d;
    if (l[r] == 0.0f) {
      std::fill(o, o + d, 0.0f);
      lse[r] = -INFINITY;
      continue;
    }
    const float inv = 1.0f / l[r];
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    lse[r] = m[r] + std::log(l[r]);
  }
}

void AttentionDelta(const AttentionShape& s, const float* o, const float* dout,
                    float* delta) {
  const int64_t rows = s.batch * s.q_len * s.heads, d = s.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (int64_t c = 0; c < d; ++c) acc += o[r * d + c] * dout[r * d + c];
    delta[r] = acc;
  }
}

void AttentionBackwardBlock(const AttentionShape& s, const float* q, const float* k,
                            const float* v, const float* dout, const float* lse,
                            const float* delta, float* dq, float* dk, float* dv, float* work) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float* P = work;
  float* dP = work + std::min(kPanel, s.q_len) * s.kv_len;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t g = h / group;
      const int64_t koff = b * s.kv_len * ks + g * d;
      for (int64_t i0 = 0; i0 < s.q_len; i0 += kPanel) {
        const int64_t tq = std::min(kPanel, s.q_len - i0);
        const int64_t tk = VisibleKeys(s, i0, tq);
        if (tk == 0) continue;
        const int64_t qoff = (b * s.q_len + i0) * qs + h * d;
        const float* lt = lse + (b * s.q_len + i0) * s.heads + h;
        const float* dt = delta + (b * s.q_len + i0) * s.heads + h;
        Scores(s, q + qoff, k + koff, tq, tk, i0, P);
        for (int64_t r = 0; r < tq; ++r) {
          const float lr = lt[r * s.heads];
          for (int64_t c = 0; c < tk; ++c) {
            float& p = P[r * tk + c];
            p = lr == -INFINITY ? 0.0f : std::exp(p - lr);  // exp(-inf) = 0
          }
        }
        // dV += P^T dO; dP = dO V^T.
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, tk, d, tq, 1.0f, P, tk, dout + qoff,
                    qs, 1.0f, dv + koff, ks);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, tq, tk, d, 1.0f, dout + qoff, qs,
                    v + koff, ks, 0.0f, dP, tk);
        // dS = P (dP - delta), in dP.
        for (int64_t r = 0; r < tq; ++r) {
          const float dr = dt[r * s.heads];
          for (int64_t c = 0; c < tk; ++c) dP[r * tk + c] = P[r * tk + c] * (dP[r * tk + c] - dr);
        }
        // dQ += scale dS K; dK += scale dS^T Q.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, tq, d, tk, s.scale, dP, tk,
                    k + koff, ks, 1.0f, dq + qoff, qs);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, tk, d, tq, s.scale, dP, tk, q + qoff,
                    qs, 1.0f, dk + koff, ks);
      }
    }
  }
}

void RopeApply(float* x, int64_t batch, int64_t len, int64_t heads,
               int64_t head_dim, int64_t pos0, float theta, bool inverse) {
  const int64_t half = head_dim / 2;
  std::vector<float> freq(half);
  for (int64_t j = 0; j < half; ++j) {
    freq[j] = std::pow(theta, -2.0f * static_cast<float>(j) / static_cast<float>(head_dim));
  }
  std::vector<float> cs(half), sn(half);
  for (int64_t t = 0; t < len; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(pos0 + t) * freq[j];
      cs[j] = std::cos(angle);
      sn[j] = inverse ? -std::sin(angle) : std::sin(angle);
    }
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + ((b * len + t) * heads + h) * head_dim;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = v[j], x2 = v[j + half];
          v[j] = x1 * cs[j] - x2 * sn[j];
          v[j + half] = x2 * cs[j] + x1 * sn[j];
        }
      }
    }
  }
}

}  // namespace plateau
