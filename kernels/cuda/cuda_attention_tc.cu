// The tensor-core attention kernels; see cuda_attention_tc.h.
//
// Per warp, 16 rows: a score tile S [16 x 64] is 8 accumulator tiles of
// m16n8 (32 floats per lane); the output (or dQ, dK, dV) row block
// [16 x D] is D / 8 of them. Lanes own fixed (row, column) positions
// (mma::CElement), so the row max and row sum of the online softmax are a
// lane's own values and then two shuffles within its quad (the 4 lanes
// holding one row), in a fixed order: the same bits run to run.
//
// Products and sums outside the tensor cores round on their own
// (__fmul_rn/__fadd_rn beside --fmad=false), as the tiled kernels.
#include "kernels/cuda/cuda_attention_tc.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/mma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

using Bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kTcThreads = 32 * kWarps;
constexpr int kTile = kAttentionTcTileRows;  // 16 rows per warp
static_assert(kTile == 16 * kWarps, "one m16 row block per warp");
constexpr int kSTiles = kTile / mma::kN;   // accumulator tiles of one score row block
constexpr int kPSteps = kTile / mma::kK;   // k-steps over a tile's keys (or queries)
// Padding per shared row, in bf16: rows of 72 or 136 elements put the 8
// groups x 4 quads of a fragment load in 32 distinct banks.
constexpr int kPad = 8;
constexpr int kTransLd = kTile + kPad;  // the transposed tiles [D][kTile + kPad]

// Tile sizes (bf16 elements) and each kernel's dynamic shared memory (bytes)
// for head_dim D; static members, so device code may read them.
template <int D>
struct TcSmem {
  static constexpr int kRowTile = kTile * (D + kPad);  // [kTile][D + kPad]
  static constexpr int kTransTile = D * kTransLd;      // [D][kTile + kPad]
  static constexpr int kForward = (2 * kRowTile + kTransTile) * 2;
  static constexpr int kDq = (4 * kRowTile + kTransTile) * 2 + 2 * kTile * 4;
  static constexpr int kDkv = (4 * kRowTile + 2 * kTransTile) * 2 + 2 * kTile * 4;
};
static_assert(TcSmem<128>::kDkv <= 163 * 1024,
              "fits an sm_80 block's opt-in shared memory (sm_90: 227 KiB)");

__device__ __forceinline__ void Mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t Word(const Bf16* tile, int offset) {
  return *reinterpret_cast<const uint32_t*>(tile + offset);
}

// Two floats as one A/B register: lo in the low half (the lower k).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ float RoundBf16(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// A's registers for the k-step at k0 of a row-major tile; B's for the
// (k0, n0) block of an n-major tile (mma_layout.h).
__device__ __forceinline__ void LoadA(const Bf16* tile, int row0, int k0, int ld, uint32_t a[4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < mma::kARegs; ++r) a[r] = Word(tile, mma::AWordOffset(lane, r, row0, k0, ld));
}
__device__ __forceinline__ void LoadB(const Bf16* tile, int k0, int n0, int ld, uint32_t b[2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < mma::kBRegs; ++r) b[r] = Word(tile, mma::BWordOffset(lane, r, k0, n0, ld));
}

// k-step `kk` of an accumulator row block [16 x 64] passed on as A (P or dS
// of 16 keys or queries), rounded to bf16.
__device__ __forceinline__ void AccumulatorAsA(const float acc[kSTiles][4], int kk, uint32_t a[4]) {
#pragma unroll
  for (int r = 0; r < mma::kARegs; ++r) {
    const float* c = acc[2 * kk + mma::CTileOfA(r)];
    a[r] = PackBf16(c[mma::CFloatOfA(r, 0)], c[mma::CFloatOfA(r, 1)]);
  }
}

// `rows` rows of D bf16 at src (row stride `stride` elements) into a
// row-major tile [kTile][D + kPad] and/or a transposed one [D][kTransLd];
// rows past `rows` are zero (finite: masked products stay 0, never NaN).
// Consecutive threads take consecutive rows of one 16-byte column chunk, so
// the transposed stores of a warp fill 16 consecutive words.
template <int D>
__device__ __forceinline__ void LoadTile(const Bf16* src, int64_t stride, int rows, Bf16* tile,
                                         Bf16* trans) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kTile * kChunks; i += kTcThreads) {
    const int r = i % kTile, c = (i / kTile) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows) v = *reinterpret_cast<const uint4*>(src + r * stride + c);
    if (tile != nullptr) *reinterpret_cast<uint4*>(tile + r * (D + kPad) + c) = v;
    if (trans != nullptr) {
      const Bf16* e = reinterpret_cast<const Bf16*>(&v);
#pragma unroll
      for (int j = 0; j < 8; ++j) trans[(c + j) * kTransLd + r] = e[j];
    }
  }
}

// Keys of the block that any query of the tile [i0, i0 + tq) may see.
__device__ __forceinline__ int64_t VisibleKeys(const AttentionDims& s, int64_t i0, int64_t tq) {
  const int64_t last = s.q_pos0 + i0 + tq - 1 - s.kv_pos0 + 1;
  return last < 0 ? 0 : (last > s.kv_len ? s.kv_len : last);
}

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Block (query tile x, head y, sequence z). Its state rows (m, l, acc) are
// its own: read once, folded over the key tiles in order, written once.
template <int D>
__global__ void __launch_bounds__(kTcThreads)
    AttentionForwardTcKernel(AttentionDims s, const Bf16* q, const Bf16* k, const Bf16* v,
                             float* m, float* l, float* acc) {
  constexpr int ld = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* Qs = reinterpret_cast<Bf16*>(smem);
  Bf16* Ks = Qs + TcSmem<D>::kRowTile;
  Bf16* Vt = Ks + TcSmem<D>::kRowTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int tq = static_cast<int>(min(static_cast<int64_t>(kTile), s.q_len - i0));
  const int64_t tk = VisibleKeys(s, i0, tq);
  if (tk == 0) return;  // the whole K/V block lies after these queries
  const int64_t g = h / (s.heads / s.kv_heads);
  const int64_t qs = s.heads * D, ks = s.kv_heads * D;
  const int64_t row0 = b * s.q_len + i0;
  const int lane = threadIdx.x % 32, wr = (threadIdx.x / 32) * 16;

  LoadTile<D>(q + row0 * qs + h * D, qs, tq, Qs, nullptr);
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) LoadA(Qs, wr, kk * 16, ld, qf[kk]);

  // This lane's two rows (tile rows wr + lane / 4 and + 8: mma::CElement
  // with i / 2 = 0, 1) and its columns of the output rows.
  float mrow[2], lrow[2], o[D / 8][4];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = wr + lane / 4 + 8 * hr;
    mrow[hr] = row < tq ? m[(row0 + row) * s.heads + h] : -INFINITY;
    lrow[hr] = row < tq ? l[(row0 + row) * s.heads + h] : 0.0f;
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const mma::Coord at = mma::CElement(lane, i);
      const int row = wr + at.row;
      o[n][i] = row < tq ? acc[(row0 + row) * qs + h * D + n * 8 + at.col] : 0.0f;
    }
  }

  for (int64_t j0 = 0; j0 < tk; j0 += kTile) {
    const int nk = static_cast<int>(min(static_cast<int64_t>(kTile), tk - j0));
    const int64_t koff = (b * s.kv_len + j0) * ks + g * D;
    __syncthreads();  // every warp is done with the previous K and V tiles
    LoadTile<D>(k + koff, ks, nk, Ks, nullptr);
    LoadTile<D>(v + koff, ks, nk, nullptr, Vt);
    __syncthreads();

    float sc[kSTiles][4];
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
        uint32_t bw[2];
        LoadB(Ks, kk * 16, n * 8, ld, bw);
        Mma(sc[n], qf[kk], bw);
      }
    }
    // Scale, mask (keys past the block or after the query), row max.
    float rmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const mma::Coord at = mma::CElement(lane, i);
        const int row = wr + at.row, col = n * 8 + at.col;
        const bool visible =
            row < tq && col < nk && s.kv_pos0 + j0 + col <= s.q_pos0 + i0 + row;
        sc[n][i] = visible ? __fmul_rn(s.scale, sc[n][i]) : -INFINITY;
        rmax[i / 2] = fmaxf(rmax[i / 2], sc[n][i]);
      }
    }
    // The online-softmax step per row: a row that sees none of the tile's
    // keys keeps its state (alpha = 1, p = 0).
    float alpha[2], rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      rmax[hr] = QuadMax(rmax[hr]);
      alpha[hr] = 1.0f;
      if (rmax[hr] != -INFINITY) {
        const float mnew = fmaxf(mrow[hr], rmax[hr]);
        alpha[hr] = expf(mrow[hr] - mnew);  // 0 when m was -inf
        mrow[hr] = mnew;
      }
    }
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int hr = i / 2;
        const float p = rmax[hr] == -INFINITY
                            ? 0.0f
                            : RoundBf16(expf(__fsub_rn(sc[n][i], mrow[hr])));
        sc[n][i] = p;
        rsum[hr] = __fadd_rn(rsum[hr], p);
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      rsum[hr] = QuadSum(rsum[hr]);
      lrow[hr] = __fadd_rn(__fmul_rn(lrow[hr], alpha[hr]), rsum[hr]);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = __fmul_rn(o[n][i], alpha[i / 2]);
    }
    // o += P V: P (bf16) as A, V^T n-major as B.
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      uint32_t a[4];
      AccumulatorAsA(sc, kk, a);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t bw[2];
        LoadB(Vt, kk * 16, n * 8, kTransLd, bw);
        Mma(o[n], a, bw);
      }
    }
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = wr + lane / 4 + 8 * hr;
    if (row < tq && lane % 4 == 0) {
      m[(row0 + row) * s.heads + h] = mrow[hr];
      l[(row0 + row) * s.heads + h] = lrow[hr];
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const mma::Coord at = mma::CElement(lane, i);
      const int row = wr + at.row;
      if (row < tq) acc[(row0 + row) * qs + h * D + n * 8 + at.col] = o[n][i];
    }
  }
}

// lse and delta of a tile's rows into shared memory; rows past `rows` get
// lse = -inf (p = 0: they contribute nothing) and delta = 0.
__device__ __forceinline__ void LoadRowStats(const float* lse, const float* delta, int64_t row0,
                                             int64_t heads, int64_t h, int rows, float* lse_s,
                                             float* delta_s) {
  for (int r = threadIdx.x; r < kTile; r += kTcThreads) {
    lse_s[r] = r < rows ? lse[(row0 + r) * heads + h] : -INFINITY;
    delta_s[r] = r < rows ? delta[(row0 + r) * heads + h] : 0.0f;
  }
}

// p = exp(scale s - lse) (0 where masked or where the row saw no key) and
// dS = p (dP - delta), in place: s becomes p, dp becomes dS.
__device__ __forceinline__ void ProbAndGradTc(float scale, bool visible, float lse, float delta,
                                              float* s, float* dp) {
  const float p = visible && lse != -INFINITY ? expf(__fsub_rn(__fmul_rn(scale, *s), lse)) : 0.0f;
  *s = p;
  *dp = __fmul_rn(p, __fsub_rn(*dp, delta));
}

// dQ: block (query tile x, head y, sequence z) owns its dq rows; key tiles
// in order; dq = bf16(dq + scale * sum) once at the end.
template <int D>
__global__ void __launch_bounds__(kTcThreads)
    AttentionDqTcKernel(AttentionDims s, const Bf16* q, const Bf16* k, const Bf16* v,
                        const Bf16* dout, const float* lse, const float* delta, Bf16* dq) {
  constexpr int ld = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* Qs = reinterpret_cast<Bf16*>(smem);
  Bf16* dOs = Qs + TcSmem<D>::kRowTile;
  Bf16* Ks = dOs + TcSmem<D>::kRowTile;
  Bf16* Vs = Ks + TcSmem<D>::kRowTile;
  Bf16* Kt = Vs + TcSmem<D>::kRowTile;
  float* lse_s = reinterpret_cast<float*>(Kt + TcSmem<D>::kTransTile);
  float* delta_s = lse_s + kTile;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int tq = static_cast<int>(min(static_cast<int64_t>(kTile), s.q_len - i0));
  const int64_t tk = VisibleKeys(s, i0, tq);
  if (tk == 0) return;
  const int64_t g = h / (s.heads / s.kv_heads);
  const int64_t qs = s.heads * D, ks = s.kv_heads * D;
  const int64_t row0 = b * s.q_len + i0;
  const int lane = threadIdx.x % 32, wr = (threadIdx.x / 32) * 16;

  LoadTile<D>(q + row0 * qs + h * D, qs, tq, Qs, nullptr);
  LoadTile<D>(dout + row0 * qs + h * D, qs, tq, dOs, nullptr);
  LoadRowStats(lse, delta, row0, s.heads, h, tq, lse_s, delta_s);
  float dqa[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dqa[n][i] = 0.0f;
  }

  for (int64_t j0 = 0; j0 < tk; j0 += kTile) {
    const int nk = static_cast<int>(min(static_cast<int64_t>(kTile), tk - j0));
    const int64_t koff = (b * s.kv_len + j0) * ks + g * D;
    __syncthreads();
    LoadTile<D>(k + koff, ks, nk, Ks, Kt);
    LoadTile<D>(v + koff, ks, nk, Vs, nullptr);
    __syncthreads();

    float sc[kSTiles][4], dp[kSTiles][4];
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[n][i] = dp[n][i] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t aq[4], ado[4];
      LoadA(Qs, wr, kk * 16, ld, aq);
      LoadA(dOs, wr, kk * 16, ld, ado);
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
        uint32_t bk[2], bv[2];
        LoadB(Ks, kk * 16, n * 8, ld, bk);
        LoadB(Vs, kk * 16, n * 8, ld, bv);
        Mma(sc[n], aq, bk);
        Mma(dp[n], ado, bv);
      }
    }
#pragma unroll
    for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const mma::Coord at = mma::CElement(lane, i);
        const int row = wr + at.row, col = n * 8 + at.col;
        const bool visible = col < nk && s.kv_pos0 + j0 + col <= s.q_pos0 + i0 + row;
        ProbAndGradTc(s.scale, visible, lse_s[row], delta_s[row], &sc[n][i], &dp[n][i]);
      }
    }
    // dq += dS K: dS (bf16) as A, K^T n-major as B.
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      uint32_t a[4];
      AccumulatorAsA(dp, kk, a);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t bw[2];
        LoadB(Kt, kk * 16, n * 8, kTransLd, bw);
        Mma(dqa[n], a, bw);
      }
    }
  }

#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const mma::Coord at = mma::CElement(lane, i);
      const int row = wr + at.row;
      if (row < tq) {
        Bf16* out = dq + (row0 + row) * qs + h * D + n * 8 + at.col;
        *out = __float2bfloat16_rn(__fadd_rn(__bfloat162float(*out), __fmul_rn(s.scale, dqa[n][i])));
      }
    }
  }
}

// dK, dV: block (key tile x, K/V head y, sequence z) owns its dk/dv rows;
// walks the group's query heads, then the query tiles that see any of its
// keys, in that order; adds once at the end.
template <int D>
__global__ void __launch_bounds__(kTcThreads)
    AttentionDkvTcKernel(AttentionDims s, const Bf16* q, const Bf16* k, const Bf16* v,
                         const Bf16* dout, const float* lse, const float* delta, float* dk,
                         float* dv) {
  constexpr int ld = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  Bf16* Ks = reinterpret_cast<Bf16*>(smem);
  Bf16* Vs = Ks + TcSmem<D>::kRowTile;
  Bf16* Qs = Vs + TcSmem<D>::kRowTile;
  Bf16* dOs = Qs + TcSmem<D>::kRowTile;
  Bf16* Qt = dOs + TcSmem<D>::kRowTile;
  Bf16* dOt = Qt + TcSmem<D>::kTransTile;
  float* lse_s = reinterpret_cast<float*>(dOt + TcSmem<D>::kTransTile);
  float* delta_s = lse_s + kTile;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int nk = static_cast<int>(min(static_cast<int64_t>(kTile), s.kv_len - j0));
  // The first query row that sees key j0 (causal).
  const int64_t first_q = max(int64_t{0}, s.kv_pos0 + j0 - s.q_pos0);
  if (first_q >= s.q_len) return;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * D, ks = s.kv_heads * D;
  const int64_t koff = (b * s.kv_len + j0) * ks + g * D;
  const int lane = threadIdx.x % 32, wr = (threadIdx.x / 32) * 16;

  LoadTile<D>(k + koff, ks, nk, Ks, nullptr);
  LoadTile<D>(v + koff, ks, nk, Vs, nullptr);
  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dka[n][i] = dva[n][i] = 0.0f;
  }

  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t i0 = first_q / kTile * kTile; i0 < s.q_len; i0 += kTile) {
      const int tq = static_cast<int>(min(static_cast<int64_t>(kTile), s.q_len - i0));
      const int64_t row0 = b * s.q_len + i0;
      __syncthreads();  // every warp is done with the previous query tile
      LoadTile<D>(q + row0 * qs + h * D, qs, tq, Qs, Qt);
      LoadTile<D>(dout + row0 * qs + h * D, qs, tq, dOs, dOt);
      LoadRowStats(lse, delta, row0, s.heads, h, tq, lse_s, delta_s);
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T: rows are this warp's keys, columns
      // the tile's queries.
      float st[kSTiles][4], dpt[kSTiles][4];
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) st[n][i] = dpt[n][i] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ak[4], av[4];
        LoadA(Ks, wr, kk * 16, ld, ak);
        LoadA(Vs, wr, kk * 16, ld, av);
#pragma unroll
        for (int n = 0; n < kSTiles; ++n) {
          uint32_t bq[2], bdo[2];
          LoadB(Qs, kk * 16, n * 8, ld, bq);
          LoadB(dOs, kk * 16, n * 8, ld, bdo);
          Mma(st[n], ak, bq);
          Mma(dpt[n], av, bdo);
        }
      }
#pragma unroll
      for (int n = 0; n < kSTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const mma::Coord at = mma::CElement(lane, i);
          const int key = wr + at.row, col = n * 8 + at.col;
          const bool visible = key < nk && s.kv_pos0 + j0 + key <= s.q_pos0 + i0 + col;
          ProbAndGradTc(s.scale, visible, lse_s[col], delta_s[col], &st[n][i], &dpt[n][i]);
        }
      }
      // dv += P^T dO and dk += dS^T Q: P^T, dS^T (bf16) as A over the
      // tile's queries, dO^T and Q^T n-major as B.
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) {
        uint32_t ap[4], ads[4];
        AccumulatorAsA(st, kk, ap);
        AccumulatorAsA(dpt, kk, ads);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          uint32_t bdo[2], bq[2];
          LoadB(dOt, kk * 16, n * 8, kTransLd, bdo);
          LoadB(Qt, kk * 16, n * 8, kTransLd, bq);
          Mma(dva[n], ap, bdo);
          Mma(dka[n], ads, bq);
        }
      }
    }
  }

#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const mma::Coord at = mma::CElement(lane, i);
      const int key = wr + at.row;
      if (key < nk) {
        const int64_t at_k = koff + key * ks + n * 8 + at.col;
        dv[at_k] = __fadd_rn(dv[at_k], dva[n][i]);
        dk[at_k] = __fadd_rn(dk[at_k], __fmul_rn(s.scale, dka[n][i]));
      }
    }
  }
}

bool GridFits(const AttentionDims& s, int64_t tiles, int64_t heads) {
  return tiles <= 0x7fffffff && heads <= 65535 && s.batch <= 65535;
}

// Opts the kernel in to `bytes` of dynamic shared memory (past the 48 KiB
// default; a host-side attribute of the current device, no sync) and clears
// the error it may leave, so the next launch is not blamed for it.
cudaError_t OptIn(const void* kernel, int bytes) {
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

template <int D>
cudaError_t LaunchForward(cudaStream_t stream, const AttentionDims& s, const Bf16* q,
                          const Bf16* k, const Bf16* v, float* m, float* l, float* acc) {
  const int64_t tiles = (s.q_len + kTile - 1) / kTile;
  if (!GridFits(s, tiles, s.heads)) return cudaErrorInvalidConfiguration;
  cudaError_t e = OptIn(reinterpret_cast<const void*>(AttentionForwardTcKernel<D>),
                        TcSmem<D>::kForward);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(s.batch));
  AttentionForwardTcKernel<D><<<grid, kTcThreads, TcSmem<D>::kForward, stream>>>(s, q, k, v, m,
                                                                                  l, acc);
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchBackward(cudaStream_t stream, const AttentionDims& s, const Bf16* q,
                           const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse,
                           const float* delta, Bf16* dq, float* dk, float* dv) {
  const int64_t qtiles = (s.q_len + kTile - 1) / kTile, ktiles = (s.kv_len + kTile - 1) / kTile;
  if (!GridFits(s, qtiles, s.heads) || !GridFits(s, ktiles, s.kv_heads)) {
    return cudaErrorInvalidConfiguration;
  }
  cudaError_t e =
      OptIn(reinterpret_cast<const void*>(AttentionDqTcKernel<D>), TcSmem<D>::kDq);
  if (e != cudaSuccess) return e;
  e = OptIn(reinterpret_cast<const void*>(AttentionDkvTcKernel<D>), TcSmem<D>::kDkv);
  if (e != cudaSuccess) return e;
  // The two kernels write disjoint outputs (dq; dk and dv) and only read the
  // rest, so their order on the stream does not matter.
  const dim3 qgrid(static_cast<unsigned>(qtiles), static_cast<unsigned>(s.heads),
                   static_cast<unsigned>(s.batch));
  AttentionDqTcKernel<D><<<qgrid, kTcThreads, TcSmem<D>::kDq, stream>>>(s, q, k, v, dout, lse,
                                                                          delta, dq);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 kgrid(static_cast<unsigned>(ktiles), static_cast<unsigned>(s.kv_heads),
                   static_cast<unsigned>(s.batch));
  AttentionDkvTcKernel<D><<<kgrid, kTcThreads, TcSmem<D>::kDkv, stream>>>(s, q, k, v, dout,
                                                                            lse, delta, dk, dv);
  return cudaGetLastError();
}

const Bf16* AsBf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* AsBf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }

}  // namespace

bool AttentionTcTakes(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

cudaError_t AttentionForwardBlockTc(cudaStream_t stream, const AttentionDims& s,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    float* m, float* l, float* acc) {
  switch (s.head_dim) {
    case 64:
      return LaunchForward<64>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    case 128:
      return LaunchForward<128>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t AttentionBackwardBlockTc(cudaStream_t stream, const AttentionDims& s,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                     const uint16_t* dout, const float* lse, const float* delta,
                                     uint16_t* dq, float* dk, float* dv) {
  switch (s.head_dim) {
    case 64:
      return LaunchBackward<64>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), AsBf16(dout), lse,
                                delta, AsBf16(dq), dk, dv);
    case 128:
      return LaunchBackward<128>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), AsBf16(dout), lse,
                                 delta, AsBf16(dq), dk, dv);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LoadAttentionTcKernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(AttentionForwardTcKernel<64>),
      reinterpret_cast<const void*>(AttentionForwardTcKernel<128>),
      reinterpret_cast<const void*>(AttentionDqTcKernel<64>),
      reinterpret_cast<const void*>(AttentionDqTcKernel<128>),
      reinterpret_cast<const void*>(AttentionDkvTcKernel<64>),
      reinterpret_cast<const void*>(AttentionDkvTcKernel<128>),
  };
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
