#include "kernels/model/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "kernels/cpu_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PLATEAU_ATTENTION_AVX2 1
#endif
#if defined(PLATEAU_ATTENTION_AVX2) && defined(__GNUC__) && defined(__x86_64__)
// The build targets x86-64-v3 (AVX2); the AVX-512 tile kernel is compiled
// for AVX-512F alone and chosen at run time when the CPU has it.
#define PLATEAU_ATTENTION_AVX512 1
#endif

namespace plateau {
namespace {

// Tile products.
//
// The kernels read B as panels of kPanel columns: row p of panel q at
// panels + q * panel_stride + p * b_ps. A B that is the transpose of a tile
// (K^T for the scores, V^T for dP) is packed first (PackPanels: b_ps =
// kPanel, each panel contiguous), once per key tile for every query tile and
// head that meets it; a B that is a tile itself (V, dO, K, Q) is read in
// place (b_ps = its row stride, panel_stride = kPanel). A operands are read
// in place with a row stride and a step stride (a step stride > 1 reads A
// transposed, which is how the backward forms P^T dO and dS^T Q without
// transposing P or dS).
//
// Every element of C is one chain of fused multiply-adds over p in order
// from 0 (then scaled by alpha and added to C), in the AVX2 kernel, the
// AVX-512 kernel and the scalar column tail alike: a value depends neither
// on where the tile's edges fall nor on which kernel ran, so both instruction
// sets give the same bits (attention_test checks them against each other).
constexpr int64_t kPanel = 16;

std::atomic<int> g_tile_isa{static_cast<int>(AttentionTileIsa::kAuto)};

bool CpuHasAvx512() {
#ifdef PLATEAU_ATTENTION_AVX512
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

// Element (p, j) of the logical B [k x n]: B[p * ldb + j], or B[j * ldb + p]
// when `trans` (B is then read from the rows of a [n x k] matrix).
inline float BAt(const float* B, int64_t ldb, bool trans, int64_t p, int64_t j) {
  return trans ? B[j * ldb + p] : B[p * ldb + j];
}

#ifdef PLATEAU_ATTENTION_AVX2
// dst[j * ld + c] = src[c * src_ld + j] for an 8 x 8 block (8 rows of 8
// floats in, their columns out): moves only, so the values are untouched.
inline void Transpose8x8(const float* src, int64_t src_ld, float* dst, int64_t ld) {
  __m256 r[8], t[8], u[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * src_ld);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ld, _mm256_permute2f128_ps(u[j], u[4 + j], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ld, _mm256_permute2f128_ps(u[j], u[4 + j], 0x31));
  }
}
#endif

// Packs np panels of B^T, B [n x k] with row stride ldb, from column j0 of
// B^T (row j0 of B): panel q holds rows p < k of 16 floats B[j0 + 16q + c][p].
void PackPanels(const float* B, int64_t ldb, int64_t k, int64_t j0, int64_t np, float* dst) {
  for (int64_t q = 0; q < np; ++q) {
    float* panel = dst + q * k * kPanel;
    const float* rows = B + (j0 + q * kPanel) * ldb;
    int64_t p0 = 0;
#ifdef PLATEAU_ATTENTION_AVX2
    for (; p0 + 8 <= k; p0 += 8) {
      Transpose8x8(rows + p0, ldb, panel + p0 * kPanel, kPanel);
      Transpose8x8(rows + 8 * ldb + p0, ldb, panel + p0 * kPanel + 8, kPanel);
    }
#endif
    for (int64_t c = 0; c < kPanel; ++c) {
      const float* row = rows + c * ldb;
      for (int64_t p = p0; p < k; ++p) panel[p * kPanel + c] = row[p];
    }
  }
}

// Columns [j_begin, j_end) of C, one scalar chain per element (the tail
// narrower than a panel, and every column when no pack buffer fits).
void TileGemmColumns(int64_t m, int64_t j_begin, int64_t j_end, int64_t k, float alpha,
                     const float* A, int64_t a_rs, int64_t a_ps, const float* B, int64_t ldb,
                     bool trans, bool accumulate, float* C, int64_t ldc) {
  for (int64_t j = j_begin; j < j_end; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        acc = std::fma(A[i * a_rs + p * a_ps], BAt(B, ldb, trans, p, j), acc);
      }
      const float v = alpha * acc;
      C[i * ldc + j] = accumulate ? C[i * ldc + j] + v : v;
    }
  }
}

#ifdef PLATEAU_ATTENTION_AVX2
// Rows [i, i + R) x one panel (16 columns) of C: 2R accumulators in
// registers (R <= 6 fits AVX2's 16) while p runs over k.
template <int R>
inline void Block16(int64_t k, __m256 va, const float* a, int64_t a_rs, int64_t a_ps,
                    const float* panel, int64_t b_ps, bool accumulate, float* c, int64_t ldc) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p, panel += b_ps, a += a_ps) {
    const __m256 b0 = _mm256_loadu_ps(panel), b1 = _mm256_loadu_ps(panel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * a_rs);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    const __m256 v0 = _mm256_mul_ps(va, c0[r]), v1 = _mm256_mul_ps(va, c1[r]);
    _mm256_storeu_ps(cr, accumulate ? _mm256_add_ps(_mm256_loadu_ps(cr), v0) : v0);
    _mm256_storeu_ps(cr + 8, accumulate ? _mm256_add_ps(_mm256_loadu_ps(cr + 8), v1) : v1);
  }
}

void TileGemmPanelsAvx2(int64_t m, int64_t np, int64_t k, float alpha, const float* A,
                        int64_t a_rs, int64_t a_ps, const float* panels, int64_t panel_stride,
                        int64_t b_ps, bool accumulate, float* C, int64_t ldc) {
  const __m256 va = _mm256_set1_ps(alpha);
  for (int64_t q = 0; q < np; ++q) {
    const float* panel = panels + q * panel_stride;
    float* cq = C + q * kPanel;
    int64_t i = 0;
    for (; i + 6 <= m; i += 6) {
      Block16<6>(k, va, A + i * a_rs, a_rs, a_ps, panel, b_ps, accumulate, cq + i * ldc, ldc);
    }
    const float* a = A + i * a_rs;
    float* c = cq + i * ldc;
    switch (m - i) {
      case 5: Block16<5>(k, va, a, a_rs, a_ps, panel, b_ps, accumulate, c, ldc); break;
      case 4: Block16<4>(k, va, a, a_rs, a_ps, panel, b_ps, accumulate, c, ldc); break;
      case 3: Block16<3>(k, va, a, a_rs, a_ps, panel, b_ps, accumulate, c, ldc); break;
      case 2: Block16<2>(k, va, a, a_rs, a_ps, panel, b_ps, accumulate, c, ldc); break;
      case 1: Block16<1>(k, va, a, a_rs, a_ps, panel, b_ps, accumulate, c, ldc); break;
      default: break;
    }
  }
}
#endif  // PLATEAU_ATTENTION_AVX2

#ifdef PLATEAU_ATTENTION_AVX512
// Rows [i, i + R) x P panels (16 columns each, one zmm) of C: R * P
// accumulators (R = 8, P = 2: 16 of AVX-512's 32 registers).
template <int R, int P>
__attribute__((target("avx512f"))) inline void Block16Avx512(
    int64_t k, __m512 va, const float* a, int64_t a_rs, int64_t a_ps, const float* panel,
    int64_t panel_stride, int64_t b_ps, bool accumulate, float* c, int64_t ldc) {
  __m512 acc[R][P];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p, panel += b_ps, a += a_ps) {
    __m512 b[P];
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) b[q] = _mm512_loadu_ps(panel + q * panel_stride);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * a_rs]);
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_fmadd_ps(x, b[q], acc[r][q]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) {
      float* cr = c + r * ldc + q * kPanel;
      const __m512 v = _mm512_mul_ps(va, acc[r][q]);
      _mm512_storeu_ps(cr, accumulate ? _mm512_add_ps(_mm512_loadu_ps(cr), v) : v);
    }
  }
}

template <int P>
__attribute__((target("avx512f"))) void TileGemmPanelsAvx512Rows(
    int64_t m, int64_t k, __m512 va, const float* A, int64_t a_rs, int64_t a_ps,
    const float* panel, int64_t panel_stride, int64_t b_ps, bool accumulate, float* C,
    int64_t ldc) {
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    Block16Avx512<8, P>(k, va, A + i * a_rs, a_rs, a_ps, panel, panel_stride, b_ps,
                        accumulate, C + i * ldc, ldc);
  }
  const float* a = A + i * a_rs;
  float* c = C + i * ldc;
  switch (m - i) {
    case 7: Block16Avx512<7, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 6: Block16Avx512<6, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 5: Block16Avx512<5, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 4: Block16Avx512<4, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 3: Block16Avx512<3, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 2: Block16Avx512<2, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    case 1: Block16Avx512<1, P>(k, va, a, a_rs, a_ps, panel, panel_stride, b_ps, accumulate, c, ldc);
      break;
    default: break;
  }
}

__attribute__((target("avx512f"))) void TileGemmPanelsAvx512(
    int64_t m, int64_t np, int64_t k, float alpha, const float* A, int64_t a_rs, int64_t a_ps,
    const float* panels, int64_t panel_stride, int64_t b_ps, bool accumulate, float* C,
    int64_t ldc) {
  const __m512 va = _mm512_set1_ps(alpha);
  int64_t q = 0;
  for (; q + 2 <= np; q += 2) {
    TileGemmPanelsAvx512Rows<2>(m, k, va, A, a_rs, a_ps, panels + q * panel_stride,
                                panel_stride, b_ps, accumulate, C + q * kPanel, ldc);
  }
  if (q < np) {
    TileGemmPanelsAvx512Rows<1>(m, k, va, A, a_rs, a_ps, panels + q * panel_stride,
                                panel_stride, b_ps, accumulate, C + q * kPanel, ldc);
  }
}
#endif  // PLATEAU_ATTENTION_AVX512

// The ISA the tile products run with now (kAuto resolved).
AttentionTileIsa ActiveTileIsa() {
  auto want = static_cast<AttentionTileIsa>(g_tile_isa.load(std::memory_order_relaxed));
  if (want == AttentionTileIsa::kAvx512 && !CpuHasAvx512()) want = AttentionTileIsa::kAuto;
  if (want == AttentionTileIsa::kAuto) {
#ifdef PLATEAU_ATTENTION_AVX512
    if (CpuHasAvx512()) return AttentionTileIsa::kAvx512;
#endif
#ifdef PLATEAU_ATTENTION_AVX2
    return AttentionTileIsa::kAvx2;
#else
    return AttentionTileIsa::kScalar;
#endif
  }
  return want;
}

// C[m x 16 np] from np panels of B (see "Tile products" above).
void TileGemmPanels(int64_t m, int64_t np, int64_t k, float alpha, const float* A, int64_t a_rs,
                    int64_t a_ps, const float* panels, int64_t panel_stride, int64_t b_ps,
                    bool accumulate, float* C, int64_t ldc) {
  switch (ActiveTileIsa()) {
#ifdef PLATEAU_ATTENTION_AVX512
    case AttentionTileIsa::kAvx512:
      TileGemmPanelsAvx512(m, np, k, alpha, A, a_rs, a_ps, panels, panel_stride, b_ps,
                           accumulate, C, ldc);
      return;
#endif
#ifdef PLATEAU_ATTENTION_AVX2
    case AttentionTileIsa::kAvx2:
      TileGemmPanelsAvx2(m, np, k, alpha, A, a_rs, a_ps, panels, panel_stride, b_ps,
                         accumulate, C, ldc);
      return;
#endif
    default:
      break;
  }
  // Scalar: the same chains, read from the panels.
  for (int64_t q = 0; q < np; ++q) {
    TileGemmColumns(m, 0, kPanel, k, alpha, A, a_rs, a_ps, panels + q * panel_stride, b_ps,
                    false, accumulate, C + q * kPanel, ldc);
  }
}

// C[m x n] = (accumulate ? C : 0) + alpha * A B^T, B [n x k] (row stride
// ldb), with `packed` holding B^T's n / 16 whole panels (PackPanels with
// trans); the columns past them are read from B itself.
void TileGemmPackedT(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t a_rs,
                     int64_t a_ps, const float* packed, const float* B, int64_t ldb,
                     bool accumulate, float* C, int64_t ldc) {
  const int64_t np = n / kPanel;
  if (np > 0) {
    TileGemmPanels(m, np, k, alpha, A, a_rs, a_ps, packed, k * kPanel, kPanel, accumulate, C,
                   ldc);
  }
  TileGemmColumns(m, np * kPanel, n, k, alpha, A, a_rs, a_ps, B, ldb, true, accumulate, C, ldc);
}

// C[m x n] = (accumulate ? C : 0) + alpha * A B, B [k x n] read in place.
void TileGemm(int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t a_rs,
              int64_t a_ps, const float* B, int64_t ldb, bool accumulate, float* C,
              int64_t ldc) {
  const int64_t np = n / kPanel;
  if (np > 0) {
    TileGemmPanels(m, np, k, alpha, A, a_rs, a_ps, B, kPanel, ldb, accumulate, C, ldc);
  }
  TileGemmColumns(m, np * kPanel, n, k, alpha, A, a_rs, a_ps, B, ldb, false, accumulate, C,
                  ldc);
}

// Keys of the block visible to the last row of the tile starting at i0
// (causal: key position <= query position), capped at kv_len.
int64_t VisibleKeys(const AttentionShape& s, int64_t i0, int64_t tq) {
  const int64_t last_query = s.q_pos0 + i0 + tq - 1;
  return std::clamp<int64_t>(last_query - s.kv_pos0 + 1, 0, s.kv_len);
}

// S[tq x nk] = scale * Q_tile K_tile^T for the key tile starting at j0, with
// causal masking (-inf). kp holds K_tile^T's whole panels (PackPanels of the
// K rows, transposed); kb is the K tile itself (for the column tail).
void TileScores(const AttentionShape& s, const float* q, int64_t qs, const float* kp,
                const float* kb, int64_t ks, int64_t tq, int64_t nk, int64_t i0, int64_t j0,
                float* S) {
  const int64_t kBk = AttentionTileKeys(s);
  TileGemmPackedT(tq, nk, s.head_dim, s.scale, q, qs, 1, kp, kb, ks, false, S, kBk);
  for (int64_t r = 0; r < tq; ++r) {
    const int64_t limit = s.q_pos0 + i0 + r - s.kv_pos0 - j0;  // last visible key in the tile
    for (int64_t c = std::max<int64_t>(0, limit + 1); c < nk; ++c) S[r * kBk + c] = -INFINITY;
  }
}

// One participant's scratch (AttentionSlotFloats: 2 tq tk + 2 d tk floats).
struct Slot {
  float* S;   // [kBq x kBk] scores, then probabilities
  float* dP;  // [kBq x kBk]
  float* kp;  // d x kBk: K tile^T, packed
  float* vp;  // d x kBk: V tile^T, packed (backward)
};

Slot SlotAt(const AttentionShape& s, float* work, int slot) {
  const int64_t d = s.head_dim, kBq = AttentionTileQueries(s), kBk = AttentionTileKeys(s);
  float* base = work + slot * AttentionSlotFloats(s);
  return {base, base + kBq * kBk, base + 2 * kBq * kBk, base + 2 * kBq * kBk + d * kBk};
}

}  // namespace

void SetAttentionTileIsaForTesting(AttentionTileIsa isa) {
  g_tile_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

bool AttentionTileIsaAvailable(AttentionTileIsa isa) {
  switch (isa) {
    case AttentionTileIsa::kAuto:
    case AttentionTileIsa::kScalar:
      return true;
    case AttentionTileIsa::kAvx2:
#ifdef PLATEAU_ATTENTION_AVX2
      return true;
#else
      return false;
#endif
    case AttentionTileIsa::kAvx512:
      return CpuHasAvx512();
  }
  return false;
}

AttentionTileIsa AttentionActiveTileIsa() { return ActiveTileIsa(); }

namespace {
int64_t AttentionFlops(const AttentionShape& s, int64_t products) {
  return 2 * products * s.batch * s.heads * s.q_len * s.kv_len * s.head_dim;
}
}  // namespace

int64_t AttentionForwardFlops(const AttentionShape& s) { return AttentionFlops(s, 2); }
int64_t AttentionBackwardFlops(const AttentionShape& s) { return AttentionFlops(s, 5); }

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
  // One task per (sequence, K/V head, query tile), over the query heads that
  // read that K/V head, so a K/V tile is packed once for the group. Rows of
  // m, l and acc are the task's own, and each (head, query tile) folds the
  // key tiles in order, so the bits do not depend on the pool.
  // A small block (the tests' tiny models) runs on this thread: PoolFor.
  ParallelFor(PoolFor(pool, AttentionForwardFlops(s)), s.batch * s.kv_heads * qtiles, [&](int64_t task, int slot) {
    const int64_t b = task / (s.kv_heads * qtiles), g = task / qtiles % s.kv_heads;
    const int64_t i0 = task % qtiles * kBq, tq = std::min(kBq, s.q_len - i0);
    const int64_t tk = VisibleKeys(s, i0, tq);
    const Slot w = SlotAt(s, work, slot);
    for (int64_t j0 = 0; j0 < tk; j0 += kBk) {
      const int64_t nk = std::min(kBk, tk - j0);
      const float* kb = k + (b * s.kv_len + j0) * ks + g * d;
      const float* vb = v + (b * s.kv_len + j0) * ks + g * d;
      PackPanels(kb, ks, d, 0, nk / kPanel, w.kp);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qt = q + (b * s.q_len + i0) * qs + h * d;
        float* acct = acc + (b * s.q_len + i0) * qs + h * d;
        float* mt = m + (b * s.q_len + i0) * s.heads + h;
        float* lt = l + (b * s.q_len + i0) * s.heads + h;
        TileScores(s, qt, qs, w.kp, kb, ks, tq, nk, i0, j0, w.S);
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
        TileGemm(tq, d, nk, 1.0f, w.S, kBk, 1, vb, ks, true, acct, qs);
      }
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
  // order (key tiles, then heads of the group, then query tiles). A small
  // block runs on this thread (PoolFor).
  ParallelFor(PoolFor(pool, AttentionBackwardFlops(s)), s.batch * s.kv_heads, [&](int64_t task, int slot) {
    const int64_t b = task / s.kv_heads, g = task % s.kv_heads;
    const Slot w = SlotAt(s, work, slot);
    for (int64_t j0 = 0; j0 < s.kv_len; j0 += kBk) {
      const int64_t nk = std::min(kBk, s.kv_len - j0);
      const int64_t koff = (b * s.kv_len + j0) * ks + g * d;
      // The first query row that sees key j0 (causal).
      const int64_t first_q = std::max<int64_t>(0, s.kv_pos0 + j0 - s.q_pos0);
      if (first_q >= s.q_len) break;
      // K^T and V^T of the tile, packed once for every query tile and head.
      PackPanels(k + koff, ks, d, 0, nk / kPanel, w.kp);
      PackPanels(v + koff, ks, d, 0, nk / kPanel, w.vp);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i0 = first_q / kBq * kBq; i0 < s.q_len; i0 += kBq) {
          const int64_t tq = std::min(kBq, s.q_len - i0);
          const int64_t qoff = (b * s.q_len + i0) * qs + h * d;
          const float* lt = lse + (b * s.q_len + i0) * s.heads + h;
          const float* dt = delta + (b * s.q_len + i0) * s.heads + h;
          TileScores(s, q + qoff, qs, w.kp, k + koff, ks, tq, nk, i0, j0, w.S);
          for (int64_t r = 0; r < tq; ++r) {
            const float lr = lt[r * s.heads];
            float* Pr = w.S + r * kBk;
            if (lr == -INFINITY) {
              std::fill(Pr, Pr + nk, 0.0f);
            } else {
              cpu::ExpShiftScale(Pr, lr, 1.0f, Pr, nk);  // exp(-inf) = 0 for masked keys
            }
          }
          // dV += P^T dO (P read transposed in place).
          TileGemm(nk, d, tq, 1.0f, w.S, 1, kBk, dout + qoff, qs, true, dv + koff, ks);
          // dP = dO V^T; dS = P (dP - delta), in dP.
          TileGemmPackedT(tq, nk, d, 1.0f, dout + qoff, qs, 1, w.vp, v + koff, ks, false, w.dP,
                          kBk);
          for (int64_t r = 0; r < tq; ++r) {
            const float dr = dt[r * s.heads];
            const float* Pr = w.S + r * kBk;
            float* dPr = w.dP + r * kBk;
            for (int64_t c = 0; c < nk; ++c) dPr[c] = Pr[c] * (dPr[c] - dr);
          }
          // dQ += scale dS K; dK += scale dS^T Q (dS read transposed in place).
          TileGemm(tq, d, nk, s.scale, w.dP, kBk, 1, k + koff, ks, true, dq + qoff, qs);
          TileGemm(nk, d, tq, s.scale, w.dP, 1, kBk, q + qoff, qs, true, dk + koff, ks);
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
