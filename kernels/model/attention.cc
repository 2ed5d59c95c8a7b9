#include "kernels/model/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace plateau {
namespace {


#if defined(__AVX2__) && defined(__FMA__)
// Rows [i, i + R) x columns [j, j + 16) of C: 2R accumulators held in
// registers (R <= 6 fits AVX2's 16) while p runs over k.
template <int R>
inline void Block16(int64_t i, int64_t j, int64_t k, __m256 va, const float* A, int64_t lda,
                    const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  const float* a = A + i * lda;
  const float* b = B + j;
  for (int64_t p = 0; p < k; ++p, b += ldb) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + p);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* c = C + (i + r) * ldc + j;
    const __m256 v0 = _mm256_mul_ps(va, c0[r]), v1 = _mm256_mul_ps(va, c1[r]);
    _mm256_storeu_ps(c, accumulate ? _mm256_add_ps(_mm256_loadu_ps(c), v0) : v0);
    _mm256_storeu_ps(c + 8, accumulate ? _mm256_add_ps(_mm256_loadu_ps(c + 8), v1) : v1);
  }
}
#endif

// C[m x n] = (accumulate ? C : 0) + alpha * A[m x k] B[k x n], all row-major
// with row strides lda, ldb, ldc. Each element is one chain of fused
// multiply-adds over p in order (then scaled by alpha and added to C), in
// every row block and in the scalar column tail alike, so a value does not
// depend on where the tile's edges fall.
void TileGemm(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 va = _mm256_set1_ps(alpha);
  for (; j + 16 <= n; j += 16) {
    int64_t i = 0;
    for (; i + 6 <= m; i += 6) Block16<6>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc);
    switch (m - i) {
      case 5: Block16<5>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc); break;
      case 4: Block16<4>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc); break;
      case 3: Block16<3>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc); break;
      case 2: Block16<2>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc); break;
      case 1: Block16<1>(i, j, k, va, A, lda, B, ldb, accumulate, C, ldc); break;
      default: break;
    }
  }
#endif
  for (; j < n; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) acc = std::fma(A[i * lda + p], B[p * ldb + j], acc);
      const float v = alpha * acc;
      C[i * ldc + j] = accumulate ? C[i * ldc + j] + v : v;
    }
  }
}

// dst[c * ld + r] = src[r * src_ld + c] for r < rows, c < cols.
void Transpose(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst,
               int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = src[r * src_ld + c];
  }
}

// Keys of the block visible to the last row of the tile starting at i0
// (causal: key position <= query position), capped at kv_len.
int64_t VisibleKeys(const AttentionShape& s, int64_t i0, int64_t tq) {
  const int64_t last_query = s.q_pos0 + i0 + tq - 1;
  return std::clamp<int64_t>(last_query - s.kv_pos0 + 1, 0, s.kv_len);
}

// S[tq x nk] = scale * Q_tile K_tile^T for the key tile starting at j0, with
// causal masking (-inf). kt holds K_tile^T [d x kBk].
void TileScores(const AttentionShape& s, const float* q, int64_t qs, const float* kt, int64_t tq,
                int64_t nk, int64_t i0, int64_t j0, float* S) {
  const int64_t kBk = AttentionTileKeys(s);
  TileGemm(tq, nk, s.head_dim, s.scale, q, qs, kt, kBk, false, S, kBk);
  for (int64_t r = 0; r < tq; ++r) {
    const int64_t limit = s.q_pos0 + i0 + r - s.kv_pos0 - j0;  // last visible key in the tile
    for (int64_t c = std::max<int64_t>(0, limit + 1); c < nk; ++c) S[r * kBk + c] = -INFINITY;
  }
}

struct Slot {
  float* S;   // [kBq x kBk] scores, then probabilities
  float* dP;  // [kBq x kBk]
  float* kt;  // [d x kBk] K tile transposed
  float* vt;  // [d x kBk] V tile transposed
  float* t;   // [kBk x kBq] P^T or dS^T
};

Slot SlotAt(const AttentionShape& s, float* work, int slot) {
  const int64_t d = s.head_dim, kBq = AttentionTileQueries(s), kBk = AttentionTileKeys(s);
  float* base = work + slot * AttentionSlotFloats(s);
  return {base, base + kBq * kBk, base + 2 * kBq * kBk, base + 2 * kBq * kBk + d * kBk,
          base + 2 * kBq * kBk + 2 * d * kBk};
}

}  // namespace

void AttentionInitState(const AttentionShape& s, float* m, float* l, float* acc, CpuPool* pool) {
  const int64_t rows = s.batch * s.q_len * s.heads, d = s.head_dim;
  ParallelBlocks(pool, rows, RowsPerTask(d), [=](int64_t r0, int64_t r1) {
    std::fill(m + r0, m + r1, -INFINITY);
    std::fill(l + r0, l + r1, 0.0f);
    std::fill(acc + r0 * d, acc + r1 * d, 0.0f);
  });
}

void AttentionForwardBlock(const AttentionShape& s, const float* q, const float* k,
                           const float* v, float* m, float* l, float* acc, float* work,
                           CpuPool* pool) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  const int64_t kBq = AttentionTileQueries(s), kBk = AttentionTileKeys(s);
  const int64_t qtiles = (s.q_len + kBq - 1) / kBq;
  // One task per (sequence, head, query tile): its rows of m, l and acc are
  // its own, and it folds the key tiles in order, so the bits do not depend
  // on the pool.
  ParallelFor(pool, s.batch * s.heads * qtiles, [&](int64_t task, int slot) {
    const int64_t b = task / (s.heads * qtiles), h = task / qtiles % s.heads;
    const int64_t i0 = task % qtiles * kBq, tq = std::min(kBq, s.q_len - i0);
    const int64_t tk = VisibleKeys(s, i0, tq);
    const Slot w = SlotAt(s, work, slot);
    const int64_t g = h / group;
    const float* qt = q + (b * s.q_len + i0) * qs + h * d;
    float* acct = acc + (b * s.q_len + i0) * qs + h * d;
    float* mt = m + (b * s.q_len + i0) * s.heads + h;
    float* lt = l + (b * s.q_len + i0) * s.heads + h;
    for (int64_t j0 = 0; j0 < tk; j0 += kBk) {
      const int64_t nk = std::min(kBk, tk - j0);
      const float* kb = k + (b * s.kv_len + j0) * ks + g * d;
      const float* vb = v + (b * s.kv_len + j0) * ks + g * d;
      Transpose(kb, ks, nk, d, w.kt, kBk);
      TileScores(s, qt, qs, w.kt, tq, nk, i0, j0, w.S);
      for (int64_t r = 0; r < tq; ++r) {
        float* Sr = w.S + r * kBk;
        const float rmax = cpu::RowMax(Sr, nk);
        float& mr = mt[r * s.heads];
        float& lr = lt[r * s.heads];
        if (rmax == -INFINITY) {  // this row sees none of the tile's keys
          std::fill(Sr, Sr + nk, 0.0f);
          continue;
        }
        const float mnew = std::max(mr, rmax);
        const float alpha = cpu::Exp(mr - mnew);  // 0 when mr = -inf
        lr = lr * alpha + cpu::ExpShiftSum(Sr, mnew, Sr, nk);
        mr = mnew;
        float* ar = acct + r * qs;
        if (alpha != 1.0f) {
          for (int64_t c = 0; c < d; ++c) ar[c] *= alpha;
        }
      }
      TileGemm(tq, d, nk, 1.0f, w.S, kBk, vb, ks, true, acct, qs);
    }
  }, AttentionSlots(s));
}

void AttentionFinalize(const AttentionShape& s, const float* m, const float* l,
                       float* acc_to_o, float* lse, CpuPool* pool) {
  const int64_t rows = s.batch * s.q_len * s.heads, d = s.head_dim;
  ParallelBlocks(pool, rows, RowsPerTask(d), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
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
  });
}

void AttentionDelta(const AttentionShape& s, const float* o, const float* dout, float* delta,
                    CpuPool* pool) {
  const int64_t rows = s.batch * s.q_len * s.heads, d = s.head_dim;
  ParallelBlocks(pool, rows, RowsPerTask(d), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float acc = 0.0f;
      for (int64_t c = 0; c < d; ++c) acc += o[r * d + c] * dout[r * d + c];
      delta[r] = acc;
    }
  });
}

void AttentionBackwardBlock(const AttentionShape& s, const float* q, const float* k,
                            const float* v, const float* dout, const float* lse,
                            const float* delta, float* dq, float* dk, float* dv, float* work,
                            CpuPool* pool) {
  const int64_t d = s.head_dim, group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  const int64_t kBq = AttentionTileQueries(s), kBk = AttentionTileKeys(s);
  // One task per (sequence, K/V head): dK and dV of that head, and dQ of the
  // query heads that read it, are written by that task alone, in a fixed
  // order (key tiles, then heads of the group, then query tiles).
  ParallelFor(pool, s.batch * s.kv_heads, [&](int64_t task, int slot) {
    const int64_t b = task / s.kv_heads, g = task % s.kv_heads;
    const Slot w = SlotAt(s, work, slot);
    for (int64_t j0 = 0; j0 < s.kv_len; j0 += kBk) {
      const int64_t nk = std::min(kBk, s.kv_len - j0);
      const int64_t koff = (b * s.kv_len + j0) * ks + g * d;
      // The first query row that sees key j0 (causal).
      const int64_t first_q = std::max<int64_t>(0, s.kv_pos0 + j0 - s.q_pos0);
      if (first_q >= s.q_len) break;
      Transpose(k + koff, ks, nk, d, w.kt, kBk);
      Transpose(v + koff, ks, nk, d, w.vt, kBk);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i0 = first_q / kBq * kBq; i0 < s.q_len; i0 += kBq) {
          const int64_t tq = std::min(kBq, s.q_len - i0);
          const int64_t qoff = (b * s.q_len + i0) * qs + h * d;
          const float* lt = lse + (b * s.q_len + i0) * s.heads + h;
          const float* dt = delta + (b * s.q_len + i0) * s.heads + h;
          TileScores(s, q + qoff, qs, w.kt, tq, nk, i0, j0, w.S);
          for (int64_t r = 0; r < tq; ++r) {
            const float lr = lt[r * s.heads];
            float* Pr = w.S + r * kBk;
            if (lr == -INFINITY) {
              std::fill(Pr, Pr + nk, 0.0f);
            } else {
              cpu::ExpShiftScale(Pr, lr, 1.0f, Pr, nk);  // exp(-inf) = 0 for masked keys
            }
          }
          // dV += P^T dO.
          Transpose(w.S, kBk, tq, nk, w.t, kBq);
          TileGemm(nk, d, tq, 1.0f, w.t, kBq, dout + qoff, qs, true, dv + koff, ks);
          // dP = dO V^T; dS = P (dP - delta), in dP.
          TileGemm(tq, nk, d, 1.0f, dout + qoff, qs, w.vt, kBk, false, w.dP, kBk);
          for (int64_t r = 0; r < tq; ++r) {
            const float dr = dt[r * s.heads];
            const float* Pr = w.S + r * kBk;
            float* dPr = w.dP + r * kBk;
            for (int64_t c = 0; c < nk; ++c) dPr[c] = Pr[c] * (dPr[c] - dr);
          }
          // dQ += scale dS K; dK += scale dS^T Q.
          TileGemm(tq, d, nk, s.scale, w.dP, kBk, k + koff, ks, true, dq + qoff, qs);
          Transpose(w.dP, kBk, tq, nk, w.t, kBq);
          TileGemm(nk, d, tq, s.scale, w.t, kBq, q + qoff, qs, true, dk + koff, ks);
        }
      }
    }
  }, AttentionSlots(s));
}

void RopeApply(float* x, int64_t batch, int64_t len, int64_t heads,
               int64_t head_dim, int64_t pos0, float theta, bool inverse, CpuPool* pool) {
  const int64_t half = head_dim / 2;
  std::vector<float> freq(half);
  for (int64_t j = 0; j < half; ++j) {
    freq[j] = std::pow(theta, -2.0f * static_cast<float>(j) / static_cast<float>(head_dim));
  }
  // Positions split into tasks; each computes its own angles (the same
  // values as one loop would).
  ParallelBlocks(pool, len, 64, [&](int64_t t0, int64_t t1) {
    // On the stack for head_dim <= 512 (every model here), else on the heap.
    float cs_buf[256], sn_buf[256];
    std::vector<float> cs_heap(half > 256 ? half : 0), sn_heap(half > 256 ? half : 0);
    float* cs = half > 256 ? cs_heap.data() : cs_buf;
    float* sn = half > 256 ? sn_heap.data() : sn_buf;
    for (int64_t t = t0; t < t1; ++t) {
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
  });
}

}  // namespace plateau
