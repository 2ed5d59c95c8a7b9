// CUDA kernels of the model kernels; see cuda_model_ops.h.
//
// Where the CPU reference multiplies and then adds (StripDelta, GatherRows,
// CombineRows), the kernels use __fmul_rn/__fadd_rn so nvcc does not contract
// them into an FMA: the remaining differences are those of expf/logf against
// the host's libm and of the reduction order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/cuda_model_ops.h"

#include <cuda_bf16.h>

namespace plateau::cuda_model_ops {
namespace {

// kernels/model/config.h's kIgnoreIndex (checked by a static_assert in
// cuda_model_kernels.cc; that header is not nvcc's to include).
constexpr int32_t kIgnore = -1;

using cuda_device::BlockReduce;
using cuda_device::ElementwiseGrid;
using cuda_device::GlobalThread;
using cuda_device::GridThreads;
using cuda_device::kMaxGrid;
using cuda_device::kThreads;
using cuda_device::MaxOp;
using cuda_device::RowGrid;
using cuda_device::SumOp;

// bf16 mixed precision (kernels/bf16.h): the row kernels below are templates
// over the working element type T; Load is exact, StoreAs rounds once to
// nearest even. For T = float both are the identity (the fp32 kernels'
// expressions, unchanged).
using Bf16 = __nv_bfloat16;
__device__ __forceinline__ float Load(float x) { return x; }
__device__ __forceinline__ float Load(Bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T StoreAs(float x);
template <>
__device__ __forceinline__ float StoreAs<float>(float x) { return x; }
template <>
__device__ __forceinline__ Bf16 StoreAs<Bf16>(float x) { return __float2bfloat16_rn(x); }

__global__ void StripInitKernel(float* state, int64_t rows) {
  for (int64_t i = GlobalThread(); i < 3 * rows; i += GridThreads()) {
    state[i] = i < rows ? -INFINITY : 0.0f;
  }
}

// The online log-sum-exp step of one strip, fused: the row max, the rescale
// of the running sum, the new exp-sum and the target logit in one pass over
// the strip (two reads of the row, one launch). The exp-sum of a row
// accumulates in double per thread and in the tree, then rounds once.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    StripFoldKernel(const T* logits, int64_t rows, int64_t width,
                    int64_t col0, const int32_t* targets, float* m, float* s,
                    float* t) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t target = targets[r];
    if (target == kIgnore) continue;  // the same for the whole block
    const T* xr = logits + r * width;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      mx = fmaxf(mx, Load(xr[c]));
    }
    mx = BlockReduce(mx, MaxOp());
    const float mold = m[r];
    const float mnew = fmaxf(mold, mx);
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      sum += static_cast<double>(expf(Load(xr[c]) - mnew));
    }
    sum = BlockReduce(sum, SumOp());
    if (threadIdx.x == 0) {
      // exp(-inf) = 0 on the first strip, as on the CPU.
      s[r] = __fadd_rn(__fmul_rn(s[r], expf(mold - mnew)),
                       static_cast<float>(sum));
      m[r] = mnew;
      if (target >= col0 && target < col0 + width) t[r] = Load(xr[target - col0]);
    }
  }
}

// One block: thread i takes rows i, i + kThreads, ... in order, then a fixed
// tree; the same assignment for any GPU, so the same bits.
__global__ void __launch_bounds__(kThreads)
    StripFinishKernel(const float* m, const float* s, const float* t,
                      const int32_t* targets, int64_t rows, float* lse,
                      double* stats) {
  double loss = 0.0, count = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) {
    if (targets[r] == kIgnore) {
      lse[r] = 0.0f;
      continue;
    }
    const float l = m[r] + logf(s[r]);
    lse[r] = l;
    loss += static_cast<double>(l - t[r]);
    count += 1.0;
  }
  loss = BlockReduce(loss, SumOp());
  count = BlockReduce(count, SumOp());
  if (threadIdx.x == 0) {
    stats[0] += loss;
    stats[1] += count;
  }
}

// delta = scale * (softmax - onehot), fused into one elementwise pass.
template <typename T>
__global__ void StripDeltaKernel(T* x, int64_t rows, int64_t width,
                                 int64_t col0, const int32_t* targets,
                                 const float* lse, float scale) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const int64_t target = targets[r];
    if (target == kIgnore) {
      x[i] = StoreAs<T>(0.0f);
      continue;
    }
    float v = __fmul_rn(expf(Load(x[i]) - lse[r]), scale);
    if (target - col0 == c) v = __fsub_rn(v, scale);
    x[i] = StoreAs<T>(v);
  }
}

// Dense cross-entropy, pass 1: lse per row (0 for ignored rows).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyLseKernel(const T* logits, const int32_t* targets,
                          int64_t rows, int64_t vocab, float* lse) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (targets[r] == kIgnore) {
      if (threadIdx.x == 0) lse[r] = 0.0f;
      continue;
    }
    const T* xr = logits + r * vocab;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < vocab; c += kThreads) {
      mx = fmaxf(mx, Load(xr[c]));
    }
    mx = BlockReduce(mx, MaxOp());
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < vocab; c += kThreads) {
      sum += static_cast<double>(expf(Load(xr[c]) - mx));
    }
    sum = BlockReduce(sum, SumOp());
    if (threadIdx.x == 0) lse[r] = mx + logf(static_cast<float>(sum));
  }
}

// Pass 2, one block: the loss sum and count over the rows, as StripFinish.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    CrossEntropyLossKernel(const T* logits, const int32_t* targets,
                           int64_t rows, int64_t vocab, const float* lse,
                           double* stats) {
  double loss = 0.0, count = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) {
    const int64_t target = targets[r];
    if (target == kIgnore) continue;
    loss += static_cast<double>(lse[r] - Load(logits[r * vocab + target]));
    count += 1.0;
  }
  loss = BlockReduce(loss, SumOp());
  count = BlockReduce(count, SumOp());
  if (threadIdx.x == 0) {
    stats[0] += loss;
    stats[1] += count;
  }
}

template <typename T>
__global__ void EmbeddingKernel(const T* table, const int32_t* tokens,
                                int64_t rows, int64_t hidden, T* out) {
  const int64_t n = rows * hidden;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / hidden;
    out[i] = table[static_cast<int64_t>(tokens[r]) * hidden + (i - r * hidden)];
  }
}

// The gradient table, fp32 or bf16: each touched table row must be its
// loaded value plus the fp32 sum of its rows' gradients in row order, rounded
// once to T (the CPU twin's result, bit for bit: in fp32 the rounding is the
// identity, so this is the CPU's `dtable[tok] += dout[r]` row after row).
// With no scratch to hold an fp32 row per
// token, the row is owned by the block of its token's FIRST occurrence:
// block r (grid-stride over rows) first asks whether an earlier row has the
// same token (a block-wide scan of tokens[0, r), kThreads at a time,
// stopping at the first hit, so a repeated token costs little); if r is the
// first, the block keeps kEmbCols columns per thread in fp32 registers,
// scans rows r..rows-1 kThreads at a time, lists the rows with its token in
// row order (a ballot per warp, then the warps' counts in order) and adds
// them in that order, then rounds each column once. Every table row has one
// writer (no atomics) and every sum runs in row order: deterministic, and
// the CPU's order. (fp32 used to walk every row per column with one thread
// per column: `hidden` threads in all, about 1 s a step at 1M tokens.)
//
// Cost beyond the rows x hidden adds: token reads, kThreads
// per step of a block, up to r for each row's first-occurrence check and
// (rows - r) / kThreads x ceil(hidden / (kThreads x kEmbCols)) for each
// first occurrence's scan: O(rows x (rows + distinct tokens) / kThreads) steps
// at worst (all tokens distinct), from a tokens array that sits in L2. A
// sort-by-token version would need a rows-sized index scratch that the
// interface does not provide.
constexpr int kEmbCols = 8;
constexpr int kWarps = kThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    EmbeddingBackwardKernel(const T* dout, const int32_t* tokens, int64_t rows, int64_t hidden, T* dtable) {
  PLATEAU_SHARED_ARRAY(int64_t, match, kThreads);  // this step's rows with the token, in order
  PLATEAU_SHARED_ARRAY(int, warp_first, kWarps + 1);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t tok = tokens[r];
    bool seen = false;
    for (int64_t base = 0; base < r && !seen; base += kThreads) {
      const int64_t e = base + threadIdx.x;
      seen = __syncthreads_or(e < r && tokens[e] == tok) != 0;
    }
    if (seen) continue;  // the same for the whole block
    T* trow = dtable + static_cast<int64_t>(tok) * hidden;
    for (int64_t c0 = 0; c0 < hidden; c0 += int64_t{kThreads} * kEmbCols) {
      float acc[kEmbCols];
#pragma unroll
      for (int j = 0; j < kEmbCols; ++j) {
        const int64_t c = c0 + j * kThreads + threadIdx.x;
        acc[j] = c < hidden ? Load(trow[c]) : 0.0f;
      }
      for (int64_t base = r; base < rows; base += kThreads) {
        const int64_t e = base + threadIdx.x;
        const bool hit = e < rows && tokens[e] == tok;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_first[warp + 1] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
          warp_first[0] = 0;
          for (int w = 0; w < kWarps; ++w) warp_first[w + 1] += warp_first[w];
        }
        __syncthreads();
        if (hit) match[warp_first[warp] + __popc(ballot & ((1u << lane) - 1u))] = e;
        __syncthreads();
        const int count = warp_first[kWarps];
        for (int m = 0; m < count; ++m) {
          const T* drow = dout + match[m] * hidden;
#pragma unroll
          for (int j = 0; j < kEmbCols; ++j) {
            const int64_t c = c0 + j * kThreads + threadIdx.x;
            if (c < hidden) acc[j] = __fadd_rn(acc[j], Load(drow[c]));
          }
        }
        __syncthreads();  // match and warp_first are rewritten next step
      }
#pragma unroll
      for (int j = 0; j < kEmbCols; ++j) {
        const int64_t c = c0 + j * kThreads + threadIdx.x;
        if (c < hidden) trow[c] = StoreAs<T>(acc[j]);
      }
    }
  }
}

template <typename T>
__global__ void GatherRowsKernel(const T* src, const int32_t* index,
                                 const float* scales, int64_t rows,
                                 int64_t width, T* dst) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    const float v = Load(src[static_cast<int64_t>(index[r]) * width + (i - r * width)]);
    dst[i] = StoreAs<T>(scales == nullptr ? v : __fmul_rn(scales[r], v));
  }
}

// The indices are distinct, so every destination element has one writer.
template <typename T>
__global__ void ScatterRowsKernel(const T* src, int64_t rows,
                                  const int32_t* index, int64_t width,
                                  T* dst) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    dst[static_cast<int64_t>(index[r]) * width + (i - r * width)] = src[i];
  }
}

// Each output element is owned by one thread, which adds the k terms in j
// order (the CPU order).
// bf16: the sum is kept in an fp32 register and rounded once on the store.
template <typename T>
__global__ void CombineRowsKernel(const T* src, const int32_t* pos,
                                  const float* weights, int64_t tokens,
                                  int64_t k, int64_t width, T* out) {
  const int64_t n = tokens * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t t = i / width;
    const int64_t c = i - t * width;
    float o = Load(out[i]);
    for (int64_t j = 0; j < k; ++j) {
      const float w = weights == nullptr ? 1.0f : weights[t * k + j];
      const float v = Load(src[static_cast<int64_t>(pos[t * k + j]) * width + c]);
      o = __fadd_rn(o, __fmul_rn(w, v));
    }
    out[i] = StoreAs<T>(o);
  }
}

// One block per (token, j) pair; the products of two floats are exact in
// double, so only the order of the double sum differs from the CPU.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowDotsKernel(const T* a, const T* b, const int32_t* pos,
                  int64_t tokens, int64_t k, int64_t width, float* out) {
  for (int64_t p = blockIdx.x; p < tokens * k; p += gridDim.x) {
    const T* x = a + (p / k) * width;
    const T* y = b + static_cast<int64_t>(pos[p]) * width;
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      acc += static_cast<double>(Load(x[c])) * static_cast<double>(Load(y[c]));
    }
    acc = BlockReduce(acc, SumOp());
    if (threadIdx.x == 0) out[p] = static_cast<float>(acc);
  }
}

// One thread per (row, j) pair of a half-split rotation; mul and sub/add
// rounded separately, as the CPU does.
template <typename T>
__global__ void RopeKernel(T* x, int64_t rows, int64_t len, int64_t heads,
                           int64_t head_dim, int64_t pos0, RopeFreqs freqs,
                           bool inverse) {
  const int64_t half = head_dim / 2;
  const int64_t n = rows * half;  // rows = batch * len * heads
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t row = i / half;
    const int64_t j = i - row * half;
    const int64_t t = (row / heads) % len;
    const float angle = __fmul_rn(static_cast<float>(pos0 + t), freqs.freq[j]);
    const float cs = cosf(angle);
    const float sn = inverse ? -sinf(angle) : sinf(angle);
    T* v = x + row * head_dim;
    const float x1 = Load(v[j]), x2 = Load(v[j + half]);
    v[j] = StoreAs<T>(__fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn)));
    v[j + half] = StoreAs<T>(__fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn)));
  }
}

__global__ void RouterKernel(const float* logits, int64_t rows,
                             int64_t experts, int64_t top_k, float* probs,
                             int32_t* chosen, float* gates) {
  for (int64_t r = GlobalThread(); r < rows; r += GridThreads()) {
    const float* lg = logits + r * experts;
    float* p = probs + r * experts;
    int32_t* ch = chosen + r * top_k;
    float mx = lg[0];
    for (int64_t e = 1; e < experts; ++e) mx = fmaxf(mx, lg[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = expf(lg[e] - mx);
      sum = __fadd_rn(sum, p[e]);
    }
    const float inv = __fdiv_rn(1.0f, sum);
    for (int64_t e = 0; e < experts; ++e) p[e] = __fmul_rn(p[e], inv);
    // Selection in the CPU's order: largest first, ties to the lower index.
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || ch[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      ch[j] = static_cast<int32_t>(best);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) total = __fadd_rn(total, p[ch[j]]);
    for (int64_t j = 0; j < top_k; ++j) {
      gates[r * top_k + j] = __fdiv_rn(p[ch[j]], total);
    }
  }
}

__global__ void RouterBackwardKernel(const float* probs, const int32_t* chosen,
                                     const float* gates, const float* dgates,
                                     int64_t rows, int64_t experts,
                                     int64_t top_k, float* dlogits) {
  for (int64_t r = GlobalThread(); r < rows; r += GridThreads()) {
    const float* p = probs + r * experts;
    const int32_t* ch = chosen + r * top_k;
    const float* g = gates + r * top_k;
    const float* dg = dgates + r * top_k;
    float* dl = dlogits + r * experts;  // holds dp until the last loop
    float total = 0.0f, gdot = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      total = __fadd_rn(total, p[ch[j]]);
      gdot = __fadd_rn(gdot, __fmul_rn(dg[j], g[j]));
    }
    for (int64_t e = 0; e < experts; ++e) dl[e] = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      dl[ch[j]] = __fdiv_rn(__fsub_rn(dg[j], gdot), total);
    }
    float pdot = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      pdot = __fadd_rn(pdot, __fmul_rn(dl[e], p[e]));
    }
    for (int64_t e = 0; e < experts; ++e) {
      dl[e] = __fmul_rn(p[e], __fsub_rn(dl[e], pdot));
    }
  }
}


// ---------------------------------------------------------------------------
// Attention. Tiles are T query rows x T key rows (T = AttentionTile(d));
// q/k/v/dout tiles sit in shared memory with a row stride of d + 1 floats, so
// that threads reading the same column of consecutive rows hit different
// banks. Every product and sum is rounded on its own (__fmul_rn/__fadd_rn,
// beside --fmad=false): the CPU twin's elementwise steps in the same order;
// only the dot products' summation order (the CPU's BLAS/tile GEMMs) and
// expf/logf differ.

constexpr int kAttnThreads = 128;

__device__ __forceinline__ int64_t VisibleKeysDev(const AttentionDims& s,
                                                  int64_t i0, int64_t tq) {
  const int64_t last = s.q_pos0 + i0 + tq - 1 - s.kv_pos0 + 1;
  return last < 0 ? 0 : (last > s.kv_len ? s.kv_len : last);
}

// rows x d elements of a [*, stride] row-major array into a tile with row
// stride d + 1. The tiles are fp32 whatever the source: a bf16 source loads
// exactly (Load), so the bf16 kernels run the fp32 kernels' arithmetic on
// the loaded values, operation for operation.
template <typename T>
__device__ __forceinline__ void LoadTile(const T* src, int64_t stride,
                                         int64_t rows, int64_t d, float* tile) {
  for (int64_t i = threadIdx.x; i < rows * d; i += blockDim.x) {
    const int64_t r = i / d, c = i - r * d;
    tile[r * (d + 1) + c] = Load(src[r * stride + c]);
  }
}

template <typename A, typename B>
__device__ __forceinline__ float TileDot(const A* a, const B* b, int64_t d) {
  float dot = 0.0f;
  for (int64_t p = 0; p < d; ++p) {
    dot = __fadd_rn(dot, __fmul_rn(Load(a[p]), Load(b[p])));
  }
  return dot;
}

__global__ void AttentionInitKernel(int64_t rows, int64_t d, float* m,
                                    float* l, float* acc) {
  for (int64_t i = GlobalThread(); i < rows * d; i += GridThreads()) {
    acc[i] = 0.0f;
    if (i < rows) {
      m[i] = -INFINITY;
      l[i] = 0.0f;
    }
  }
}

// Block (query tile x, head y, sequence z). Shared: Q, K, V tiles, the scores
// S [T x T], and per query row alpha, m, l. The state rows of this (sequence,
// head, query tile) belong to this block alone; key tiles fold in order.
// In = float or Bf16 (q, k, v); the state is fp32 either way.
template <typename In>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionForwardKernel(AttentionDims s, int T, const In* q,
                           const In* k, const In* v, float* m, float* l,
                           float* acc) {
  PLATEAU_DYNAMIC_SHARED(float, smem);
  const int64_t d = s.head_dim, ld = d + 1;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * T;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t tq = min(static_cast<int64_t>(T), s.q_len - i0);
  const int64_t tk = VisibleKeysDev(s, i0, tq);
  if (tk == 0) return;  // the whole K/V block lies after these queries
  const int64_t g = h / (s.heads / s.kv_heads);
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float* Qs = smem;
  float* Ks = Qs + T * ld;
  float* Vs = Ks + T * ld;
  float* S = Vs + T * ld;
  float* alpha_s = S + T * T;
  float* m_s = alpha_s + T;
  float* l_s = m_s + T;
  const int64_t row0 = b * s.q_len + i0;  // first state row (per head)
  LoadTile(q + row0 * qs + h * d, qs, tq, d, Qs);
  for (int64_t r = threadIdx.x; r < tq; r += blockDim.x) {
    m_s[r] = m[(row0 + r) * s.heads + h];
    l_s[r] = l[(row0 + r) * s.heads + h];
  }
  float* acct = acc + row0 * qs + h * d;
  for (int64_t j0 = 0; j0 < tk; j0 += T) {
    const int64_t nk = min(static_cast<int64_t>(T), tk - j0);
    const int64_t koff = (b * s.kv_len + j0) * ks + g * d;
    LoadTile(k + koff, ks, nk, d, Ks);
    LoadTile(v + koff, ks, nk, d, Vs);
    __syncthreads();
    // S = scale * (Q K^T), -inf where the key lies after the query.
    for (int64_t i = threadIdx.x; i < tq * nk; i += blockDim.x) {
      const int64_t r = i / nk, c = i - r * nk;
      const bool visible = s.kv_pos0 + j0 + c <= s.q_pos0 + i0 + r;
      S[r * T + c] = visible ? __fmul_rn(s.scale, TileDot(Qs + r * ld, Ks + c * ld, d))
                             : -INFINITY;
    }
    __syncthreads();
    // The online softmax step per row, as the CPU: a row that sees none of
    // the tile's keys keeps its state (alpha = 1, probabilities 0).
    for (int64_t r = threadIdx.x; r < tq; r += blockDim.x) {
      float* Sr = S + r * T;
      float rmax = -INFINITY;
      for (int64_t c = 0; c < nk; ++c) rmax = fmaxf(rmax, Sr[c]);
      if (rmax == -INFINITY) {
        for (int64_t c = 0; c < nk; ++c) Sr[c] = 0.0f;
        alpha_s[r] = 1.0f;
        continue;
      }
      const float mnew = fmaxf(m_s[r], rmax);
      const float alpha = expf(m_s[r] - mnew);  // 0 when m = -inf
      float sum = 0.0f;
      for (int64_t c = 0; c < nk; ++c) {
        Sr[c] = expf(Sr[c] - mnew);
        sum = __fadd_rn(sum, Sr[c]);
      }
      l_s[r] = __fadd_rn(__fmul_rn(l_s[r], alpha), sum);
      m_s[r] = mnew;
      alpha_s[r] = alpha;
    }
    __syncthreads();
    // acc = acc * alpha + P V: the CPU's rescale, then its GEMM's beta = 1.
    for (int64_t i = threadIdx.x; i < tq * d; i += blockDim.x) {
      const int64_t r = i / d, c = i - r * d;
      float pv = 0.0f;
      for (int64_t j = 0; j < nk; ++j) {
        pv = __fadd_rn(pv, __fmul_rn(S[r * T + j], Vs[j * ld + c]));
      }
      float* a = acct + r * qs + c;
      *a = __fadd_rn(__fmul_rn(*a, alpha_s[r]), pv);
    }
    __syncthreads();  // the tiles are reloaded next
  }
  for (int64_t r = threadIdx.x; r < tq; r += blockDim.x) {
    m[(row0 + r) * s.heads + h] = m_s[r];
    l[(row0 + r) * s.heads + h] = l_s[r];
  }
}

// One thread per element of o; the row's first also writes lse (logf: named
// in tools:fma_rule_test's --libm).
__global__ void AttentionFinalizeKernel(int64_t rows, int64_t d,
                                        const float* m, const float* l,
                                        float* o, float* lse) {
  for (int64_t i = GlobalThread(); i < rows * d; i += GridThreads()) {
    const int64_t r = i / d, c = i - r * d;
    const float lr = l[r];
    if (lr == 0.0f) {
      o[i] = 0.0f;
      if (c == 0) lse[r] = -INFINITY;
      continue;
    }
    o[i] = __fmul_rn(o[i], __fdiv_rn(1.0f, lr));
    if (c == 0) lse[r] = __fadd_rn(m[r], logf(lr));
  }
}

// dout = float or Bf16 (loaded exactly); o and delta are fp32.
template <typename In>
__global__ void AttentionDeltaKernel(int64_t rows, int64_t d, const float* o,
                                     const In* dout, float* delta) {
  for (int64_t r = GlobalThread(); r < rows; r += GridThreads()) {
    delta[r] = TileDot(o + r * d, dout + r * d, d);
  }
}

// The probability P and dS = P (dP - delta) of query row r (tile row) and key
// c (tile column), as the CPU: P = exp(scale q.k - lse), 0 for a masked key
// or a row that saw no key (lse = -inf); dP = dout.v.
__device__ __forceinline__ void ProbAndGrad(const AttentionDims& s,
                                            const float* Qr, const float* dOr,
                                            const float* Kc, const float* Vc,
                                            float lse, float delta,
                                            bool visible, float* p_out,
                                            float* ds_out) {
  const int64_t d = s.head_dim;
  float p = 0.0f;
  if (visible && lse != -INFINITY) {
    p = expf(__fsub_rn(__fmul_rn(s.scale, TileDot(Qr, Kc, d)), lse));
  }
  const float dp = TileDot(dOr, Vc, d);
  *p_out = p;
  *ds_out = __fmul_rn(p, __fsub_rn(dp, delta));
}

// dQ: block (query tile x, head y, sequence z) owns its dq rows and folds the
// visible key tiles in order: dq += scale * (dS K) per key tile, in global
// memory. In = float or Bf16 (q, k, v, dout); dq is fp32 in both (under
// bf16 ring attention rounds it once, after its last hop), so the bf16
// kernel's dq is the fp32 kernel's on the loaded inputs, bit for bit.
template <typename In>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionBackwardDqKernel(AttentionDims s, int T, const In* q, const In* k, const In* v, const In* dout,
                              const float* lse, const float* delta, float* dq) {
  PLATEAU_DYNAMIC_SHARED(float, smem);
  const int64_t d = s.head_dim, ld = d + 1;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * T;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t tq = min(static_cast<int64_t>(T), s.q_len - i0);
  const int64_t tk = VisibleKeysDev(s, i0, tq);
  if (tk == 0) return;
  const int64_t g = h / (s.heads / s.kv_heads);
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float* Qs = smem;
  float* dOs = Qs + T * ld;
  float* Ks = dOs + T * ld;
  float* Vs = Ks + T * ld;
  float* dS = Vs + T * ld;
  float* lse_s = dS + T * T;
  float* delta_s = lse_s + T;
  const int64_t row0 = b * s.q_len + i0;
  LoadTile(q + row0 * qs + h * d, qs, tq, d, Qs);
  LoadTile(dout + row0 * qs + h * d, qs, tq, d, dOs);
  for (int64_t r = threadIdx.x; r < tq; r += blockDim.x) {
    lse_s[r] = lse[(row0 + r) * s.heads + h];
    delta_s[r] = delta[(row0 + r) * s.heads + h];
  }
  float* dqt = dq + row0 * qs + h * d;
  for (int64_t j0 = 0; j0 < tk; j0 += T) {
    const int64_t nk = min(static_cast<int64_t>(T), tk - j0);
    const int64_t koff = (b * s.kv_len + j0) * ks + g * d;
    LoadTile(k + koff, ks, nk, d, Ks);
    LoadTile(v + koff, ks, nk, d, Vs);
    __syncthreads();
    for (int64_t i = threadIdx.x; i < tq * nk; i += blockDim.x) {
      const int64_t r = i / nk, c = i - r * nk;
      float p;
      ProbAndGrad(s, Qs + r * ld, dOs + r * ld, Ks + c * ld, Vs + c * ld,
                  lse_s[r], delta_s[r],
                  s.kv_pos0 + j0 + c <= s.q_pos0 + i0 + r, &p, &dS[r * T + c]);
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < tq * d; i += blockDim.x) {
      const int64_t r = i / d, c = i - r * d;
      float sum = 0.0f;
      for (int64_t j = 0; j < nk; ++j) {
        sum = __fadd_rn(sum, __fmul_rn(dS[r * T + j], Ks[j * ld + c]));
      }
      float* out = dqt + r * qs + c;
      *out = __fadd_rn(*out, __fmul_rn(s.scale, sum));
    }
    __syncthreads();
  }
}

// dK, dV: block (key tile x, K/V head y, sequence z) owns its dk/dv rows. It
// walks the query heads of its group, then the query tiles that see any of
// its keys, in that fixed order: dv += P^T dout, dk += scale * (dS^T Q) per
// query tile. Summing a key's contributions over query tiles and heads inside
// one block (rather than with float atomics from the query-tile blocks, as
// FlashAttention-2 does) costs recomputing P and dS once more, and buys
// results that are the same bits run to run. In = float or Bf16 (q, k, v,
// dout); dk and dv travel the ring and stay fp32 in both precisions.
template <typename In>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionBackwardDkvKernel(AttentionDims s, int T, const In* q,
                               const In* k, const In* v,
                               const In* dout, const float* lse,
                               const float* delta, float* dk, float* dv) {
  PLATEAU_DYNAMIC_SHARED(float, smem);
  const int64_t d = s.head_dim, ld = d + 1;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * T;
  const int64_t g = blockIdx.y, b = blockIdx.z;
  const int64_t nk = min(static_cast<int64_t>(T), s.kv_len - j0);
  // The first query row that sees key j0 (causal).
  const int64_t first_q = max(int64_t{0}, s.kv_pos0 + j0 - s.q_pos0);
  if (first_q >= s.q_len) return;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t qs = s.heads * d, ks = s.kv_heads * d;
  float* Ks = smem;
  float* Vs = Ks + T * ld;
  float* Qs = Vs + T * ld;
  float* dOs = Qs + T * ld;
  float* P = dOs + T * ld;
  float* dS = P + T * T;
  float* lse_s = dS + T * T;
  float* delta_s = lse_s + T;
  const int64_t koff = (b * s.kv_len + j0) * ks + g * d;
  LoadTile(k + koff, ks, nk, d, Ks);
  LoadTile(v + koff, ks, nk, d, Vs);
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    for (int64_t i0 = first_q / T * T; i0 < s.q_len; i0 += T) {
      const int64_t tq = min(static_cast<int64_t>(T), s.q_len - i0);
      const int64_t row0 = b * s.q_len + i0;
      LoadTile(q + row0 * qs + h * d, qs, tq, d, Qs);
      LoadTile(dout + row0 * qs + h * d, qs, tq, d, dOs);
      for (int64_t r = threadIdx.x; r < tq; r += blockDim.x) {
        lse_s[r] = lse[(row0 + r) * s.heads + h];
        delta_s[r] = delta[(row0 + r) * s.heads + h];
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < tq * nk; i += blockDim.x) {
        const int64_t r = i / nk, c = i - r * nk;
        ProbAndGrad(s, Qs + r * ld, dOs + r * ld, Ks + c * ld, Vs + c * ld,
                    lse_s[r], delta_s[r],
                    s.kv_pos0 + j0 + c <= s.q_pos0 + i0 + r, &P[r * T + c],
                    &dS[r * T + c]);
      }
      __syncthreads();
      for (int64_t i = threadIdx.x; i < nk * d; i += blockDim.x) {
        const int64_t j = i / d, c = i - j * d;
        float sv = 0.0f, sk = 0.0f;
        for (int64_t r = 0; r < tq; ++r) {
          sv = __fadd_rn(sv, __fmul_rn(P[r * T + j], dOs[r * ld + c]));
          sk = __fadd_rn(sk, __fmul_rn(dS[r * T + j], Qs[r * ld + c]));
        }
        const int64_t at = koff + j * ks + c;
        dv[at] = __fadd_rn(dv[at], sv);
        dk[at] = __fadd_rn(dk[at], __fmul_rn(s.scale, sk));
      }
      __syncthreads();  // Q, dout, P, dS are reloaded next
    }
  }
}

// Shared memory of the kernels, in floats, for tile T.
int64_t ForwardSmemFloats(int64_t T, int64_t d) { return 3 * T * (d + 1) + T * T + 3 * T; }
int64_t DqSmemFloats(int64_t T, int64_t d) { return 4 * T * (d + 1) + T * T + 2 * T; }
int64_t DkvSmemFloats(int64_t T, int64_t d) { return 4 * T * (d + 1) + 2 * T * T + 2 * T; }

// 48 KiB: what any kernel may take without cudaFuncSetAttribute.
constexpr int64_t kSmemFloats = 48 * 1024 / 4;

bool AttentionGridFits(const AttentionDims& s, int64_t tiles, int64_t heads) {
  return tiles <= 0x7fffffff && heads <= 65535 && s.batch <= 65535;
}

}  // namespace

cudaError_t Router(cudaStream_t stream, const float* logits, int64_t rows,
                   int64_t experts, int64_t top_k, float* probs,
                   int32_t* chosen, float* gates) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows), kThreads, 0, stream, RouterKernel)(
      logits, rows, experts, top_k, probs, chosen, gates);
  return cudaGetLastError();
}

cudaError_t RouterBackward(cudaStream_t stream, const float* probs,
                           const int32_t* chosen, const float* gates,
                           const float* dgates, int64_t rows, int64_t experts,
                           int64_t top_k, float* dlogits) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows), kThreads, 0, stream, RouterBackwardKernel)(
      probs, chosen, gates, dgates, rows, experts, top_k, dlogits);
  return cudaGetLastError();
}

cudaError_t Rope(cudaStream_t stream, float* x, int64_t batch, int64_t len,
                 int64_t heads, int64_t head_dim, int64_t pos0,
                 const RopeFreqs& freqs, bool inverse) {
  const int64_t rows = batch * len * heads;
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * (head_dim / 2)), kThreads, 0, stream, RopeKernel<float>)(
      x, rows, len, heads, head_dim, pos0, freqs, inverse);
  return cudaGetLastError();
}

cudaError_t StripInit(cudaStream_t stream, float* state, int64_t rows) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(3 * rows), kThreads, 0, stream, StripInitKernel)(
      state, rows);
  return cudaGetLastError();
}

cudaError_t StripFold(cudaStream_t stream, const float* logits, int64_t rows,
                      int64_t width, int64_t col0, const int32_t* targets,
                      float* state, int64_t stride) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, StripFoldKernel<float>)(
      logits, rows, width, col0, targets, state, state + stride, state + 2 * stride);
  return cudaGetLastError();
}

cudaError_t StripFinish(cudaStream_t stream, const float* state,
                        const int32_t* targets, int64_t rows, float* lse,
                        double* stats) {
  PLATEAU_KERNEL_LAUNCH(1, kThreads, 0, stream, StripFinishKernel)(
      state, state + rows, state + 2 * rows, targets, rows, lse, stats);
  return cudaGetLastError();
}

cudaError_t StripDelta(cudaStream_t stream, float* logits_to_delta,
                       int64_t rows, int64_t width, int64_t col0,
                       const int32_t* targets, const float* lse, float scale) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * width), kThreads, 0, stream, StripDeltaKernel<float>)(
      logits_to_delta, rows, width, col0, targets, lse, scale);
  return cudaGetLastError();
}

cudaError_t CrossEntropy(cudaStream_t stream, const float* logits,
                         const int32_t* targets, int64_t rows, int64_t vocab,
                         float* lse, double* stats) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, CrossEntropyLseKernel<float>)(
      logits, targets, rows, vocab, lse);
  PLATEAU_KERNEL_LAUNCH(1, kThreads, 0, stream, CrossEntropyLossKernel<float>)(
      logits, targets, rows, vocab, lse, stats);
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackward(cudaStream_t stream, float* logits_to_grad,
                                 const float* lse, const int32_t* targets,
                                 int64_t rows, int64_t vocab, float scale) {
  return StripDelta(stream, logits_to_grad, rows, vocab, 0, targets, lse,
                    scale);
}

cudaError_t Embedding(cudaStream_t stream, const float* table,
                      const int32_t* tokens, int64_t rows, int64_t hidden,
                      float* out) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * hidden), kThreads, 0, stream, EmbeddingKernel<float>)(
      table, tokens, rows, hidden, out);
  return cudaGetLastError();
}

cudaError_t EmbeddingBackward(cudaStream_t stream, const float* dout,
                              const int32_t* tokens, int64_t rows,
                              int64_t hidden, float* dtable) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, EmbeddingBackwardKernel<float>)
  (dout, tokens, rows, hidden, dtable);
  return cudaGetLastError();
}

cudaError_t GatherRows(cudaStream_t stream, const float* src,
                       const int32_t* index, const float* scales, int64_t rows,
                       int64_t width, float* dst) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * width), kThreads, 0, stream, GatherRowsKernel<float>)(
      src, index, scales, rows, width, dst);
  return cudaGetLastError();
}

cudaError_t ScatterRows(cudaStream_t stream, const float* src, int64_t rows,
                        const int32_t* index, int64_t width, float* dst) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * width), kThreads, 0, stream, ScatterRowsKernel<float>)(
      src, rows, index, width, dst);
  return cudaGetLastError();
}

cudaError_t CombineRows(cudaStream_t stream, const float* src,
                        const int32_t* pos, const float* weights,
                        int64_t tokens, int64_t k, int64_t width, float* out) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(tokens * width), kThreads, 0, stream, CombineRowsKernel<float>)(
      src, pos, weights, tokens, k, width, out);
  return cudaGetLastError();
}

cudaError_t RowDots(cudaStream_t stream, const float* a, const float* b,
                    const int32_t* pos, int64_t tokens, int64_t k,
                    int64_t width, float* out) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(tokens * k), kThreads, 0, stream, RowDotsKernel<float>)(
      a, b, pos, tokens, k, width, out);
  return cudaGetLastError();
}

// --- bf16 mixed precision ---------------------------------------------------

namespace {
const Bf16* AsBf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* AsBf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }
}  // namespace

cudaError_t EmbeddingBf16(cudaStream_t stream, const uint16_t* table, const int32_t* tokens,
                          int64_t rows, int64_t hidden, uint16_t* out) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows * hidden), kThreads, 0, stream, EmbeddingKernel<Bf16>)(
      AsBf16(table), tokens, rows, hidden, AsBf16(out));
  return cudaGetLastError();
}

cudaError_t EmbeddingBackwardBf16(cudaStream_t stream, const uint16_t* dout,
                                  const int32_t* tokens, int64_t rows, int64_t hidden,
                                  uint16_t* dtable) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, EmbeddingBackwardKernel<Bf16>)
  (AsBf16(dout), tokens, rows, hidden, AsBf16(dtable));
  return cudaGetLastError();
}

cudaError_t GatherRowsBf16(cudaStream_t stream, const uint16_t* src, const int32_t* index,
                           const float* scales, int64_t rows, int64_t width, uint16_t* dst) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows * width), kThreads, 0, stream, GatherRowsKernel<Bf16>)(
      AsBf16(src), index, scales, rows, width, AsBf16(dst));
  return cudaGetLastError();
}

cudaError_t ScatterRowsBf16(cudaStream_t stream, const uint16_t* src, int64_t rows,
                            const int32_t* index, int64_t width, uint16_t* dst) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * width), kThreads, 0, stream, ScatterRowsKernel<Bf16>)(
      AsBf16(src), rows, index, width, AsBf16(dst));
  return cudaGetLastError();
}

cudaError_t CombineRowsBf16(cudaStream_t stream, const uint16_t* src, const int32_t* pos,
                            const float* weights, int64_t tokens, int64_t k, int64_t width,
                            uint16_t* out) {
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(tokens * width), kThreads, 0, stream, CombineRowsKernel<Bf16>)(
      AsBf16(src), pos, weights, tokens, k, width, AsBf16(out));
  return cudaGetLastError();
}

cudaError_t RopeBf16(cudaStream_t stream, uint16_t* x, int64_t batch, int64_t len, int64_t heads,
                     int64_t head_dim, int64_t pos0, const RopeFreqs& freqs, bool inverse) {
  const int64_t rows = batch * len * heads;
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * (head_dim / 2)), kThreads, 0, stream, RopeKernel<Bf16>)(
      AsBf16(x), rows, len, heads, head_dim, pos0, freqs, inverse);
  return cudaGetLastError();
}

cudaError_t StripFoldBf16(cudaStream_t stream, const uint16_t* logits, int64_t rows,
                          int64_t width, int64_t col0, const int32_t* targets, float* state,
                          int64_t stride) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, StripFoldKernel<Bf16>)(
      AsBf16(logits), rows, width, col0, targets, state, state + stride, state + 2 * stride);
  return cudaGetLastError();
}

cudaError_t StripDeltaBf16(cudaStream_t stream, uint16_t* logits_to_delta, int64_t rows,
                           int64_t width, int64_t col0, const int32_t* targets, const float* lse,
                           float scale) {
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows * width), kThreads, 0, stream, StripDeltaKernel<Bf16>)(
      AsBf16(logits_to_delta), rows, width, col0, targets, lse, scale);
  return cudaGetLastError();
}

cudaError_t CrossEntropyBf16(cudaStream_t stream, const uint16_t* logits, const int32_t* targets,
                             int64_t rows, int64_t vocab, float* lse, double* stats) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(rows), kThreads, 0, stream, CrossEntropyLseKernel<Bf16>)(
      AsBf16(logits), targets, rows, vocab, lse);
  PLATEAU_KERNEL_LAUNCH(1, kThreads, 0, stream, CrossEntropyLossKernel<Bf16>)(
      AsBf16(logits), targets, rows, vocab, lse, stats);
  return cudaGetLastError();
}

cudaError_t CrossEntropyBackwardBf16(cudaStream_t stream, uint16_t* logits_to_grad,
                                     const float* lse, const int32_t* targets, int64_t rows,
                                     int64_t vocab, float scale) {
  return StripDeltaBf16(stream, logits_to_grad, rows, vocab, 0, targets, lse, scale);
}

cudaError_t RowDotsBf16(cudaStream_t stream, const uint16_t* a, const uint16_t* b,
                        const int32_t* pos, int64_t tokens, int64_t k, int64_t width,
                        float* out) {
  PLATEAU_KERNEL_LAUNCH(RowGrid(tokens * k), kThreads, 0, stream, RowDotsKernel<Bf16>)(
      AsBf16(a), AsBf16(b), pos, tokens, k, width, out);
  return cudaGetLastError();
}

int AttentionTile(int64_t head_dim) {
  for (int T = 32; T >= 1; T /= 2) {
    // The dK/dV kernel takes the most; the forward and dQ kernels fit
    // then. One tile for both precisions, so that the bf16 kernels are the
    // fp32 ones on the loaded values.
    if (DkvSmemFloats(T, head_dim) <= kSmemFloats) return T;
  }
  return 0;
}

cudaError_t AttentionInit(cudaStream_t stream, const AttentionDims& s,
                          float* m, float* l, float* acc) {
  const int64_t rows = s.batch * s.q_len * s.heads;
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * s.head_dim), kThreads, 0, stream, AttentionInitKernel)(
      rows, s.head_dim, m, l, acc);
  return cudaGetLastError();
}

namespace {

// The launchers' bodies for both precisions (In = float or Bf16).
template <typename In>
cudaError_t LaunchAttentionForward(cudaStream_t stream, const AttentionDims& s, const In* q,
                                   const In* k, const In* v, float* m, float* l, float* acc) {
  const int T = AttentionTile(s.head_dim);
  if (T == 0) return cudaErrorInvalidValue;
  const int64_t tiles = (s.q_len + T - 1) / T;
  if (!AttentionGridFits(s, tiles, s.heads)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(s.batch));
  PLATEAU_KERNEL_LAUNCH(
       grid, kAttnThreads, ForwardSmemFloats(T, s.head_dim) * sizeof(float), stream,
      AttentionForwardKernel<In>)(s, T, q, k, v, m, l, acc);
  return cudaGetLastError();
}

template <typename In>
cudaError_t LaunchAttentionDelta(cudaStream_t stream, const AttentionDims& s, const float* o,
                                 const In* dout, float* delta) {
  const int64_t rows = s.batch * s.q_len * s.heads;
  PLATEAU_KERNEL_LAUNCH(ElementwiseGrid(rows), kThreads, 0, stream, AttentionDeltaKernel<In>)(
      rows, s.head_dim, o, dout, delta);
  return cudaGetLastError();
}

template <typename In>
cudaError_t LaunchAttentionBackward(cudaStream_t stream, const AttentionDims& s, const In* q, const In* k, const In* v,
                                    const In* dout, const float* lse, const float* delta, float* dq, float* dk,
                                    float* dv) {
  const int T = AttentionTile(s.head_dim);
  if (T == 0) return cudaErrorInvalidValue;
  const int64_t qtiles = (s.q_len + T - 1) / T, ktiles = (s.kv_len + T - 1) / T;
  if (!AttentionGridFits(s, qtiles, s.heads) ||
      !AttentionGridFits(s, ktiles, s.kv_heads)) {
    return cudaErrorInvalidConfiguration;
  }
  // The two kernels write disjoint outputs (dq; dk and dv) and only read
  // the rest, so they may run in either order on the one stream.
  const dim3 qgrid(static_cast<unsigned>(qtiles), static_cast<unsigned>(s.heads),
                   static_cast<unsigned>(s.batch));
  PLATEAU_KERNEL_LAUNCH(qgrid, kAttnThreads, DqSmemFloats(T, s.head_dim) * sizeof(float), stream,
                        AttentionBackwardDqKernel<In>)
  (s, T, q, k, v, dout, lse, delta, dq);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 kgrid(static_cast<unsigned>(ktiles),
                   static_cast<unsigned>(s.kv_heads),
                   static_cast<unsigned>(s.batch));
  PLATEAU_KERNEL_LAUNCH(
       kgrid, kAttnThreads, DkvSmemFloats(T, s.head_dim) * sizeof(float), stream,
      AttentionBackwardDkvKernel<In>)(s, T, q, k, v, dout, lse, delta, dk, dv);
  return cudaGetLastError();
}

}  // namespace

cudaError_t AttentionForwardBlock(cudaStream_t stream, const AttentionDims& s,
                                  const float* q, const float* k,
                                  const float* v, float* m, float* l,
                                  float* acc) {
  return LaunchAttentionForward<float>(stream, s, q, k, v, m, l, acc);
}

cudaError_t AttentionForwardBlockBf16(cudaStream_t stream, const AttentionDims& s,
                                      const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      float* m, float* l, float* acc) {
  return LaunchAttentionForward<Bf16>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
}

cudaError_t AttentionFinalize(cudaStream_t stream, const AttentionDims& s,
                              const float* m, const float* l, float* acc_to_o,
                              float* lse) {
  const int64_t rows = s.batch * s.q_len * s.heads;
  PLATEAU_KERNEL_LAUNCH(
      ElementwiseGrid(rows * s.head_dim), kThreads, 0, stream, AttentionFinalizeKernel)(
      rows, s.head_dim, m, l, acc_to_o, lse);
  return cudaGetLastError();
}

cudaError_t AttentionDelta(cudaStream_t stream, const AttentionDims& s,
                           const float* o, const float* dout, float* delta) {
  return LaunchAttentionDelta<float>(stream, s, o, dout, delta);
}

cudaError_t AttentionDeltaBf16(cudaStream_t stream, const AttentionDims& s, const float* o,
                               const uint16_t* dout, float* delta) {
  return LaunchAttentionDelta<Bf16>(stream, s, o, AsBf16(dout), delta);
}

cudaError_t AttentionBackwardBlock(cudaStream_t stream, const AttentionDims& s,
                                   const float* q, const float* k,
                                   const float* v, const float* dout,
                                   const float* lse, const float* delta,
                                   float* dq, float* dk, float* dv) {
  return LaunchAttentionBackward<float>(stream, s, q, k, v, dout, lse, delta, dq, dk, dv);
}

cudaError_t AttentionBackwardBlockBf16(cudaStream_t stream, const AttentionDims& s, const uint16_t* q,
                                       const uint16_t* k, const uint16_t* v, const uint16_t* dout, const float* lse,
                                       const float* delta, float* dq, float* dk, float* dv) {
  return LaunchAttentionBackward<Bf16>(stream, s, AsBf16(q), AsBf16(k), AsBf16(v), AsBf16(dout), lse, delta, dq, dk,
                                       dv);
}

cudaError_t LoadKernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(StripInitKernel),
      reinterpret_cast<const void*>(StripFoldKernel<float>),
      reinterpret_cast<const void*>(StripFoldKernel<Bf16>),
      reinterpret_cast<const void*>(StripFinishKernel),
      reinterpret_cast<const void*>(StripDeltaKernel<float>),
      reinterpret_cast<const void*>(StripDeltaKernel<Bf16>),
      reinterpret_cast<const void*>(CrossEntropyLseKernel<float>),
      reinterpret_cast<const void*>(CrossEntropyLseKernel<Bf16>),
      reinterpret_cast<const void*>(CrossEntropyLossKernel<float>),
      reinterpret_cast<const void*>(CrossEntropyLossKernel<Bf16>),
      reinterpret_cast<const void*>(EmbeddingKernel<float>),
      reinterpret_cast<const void*>(EmbeddingBackwardKernel<float>),
      reinterpret_cast<const void*>(EmbeddingBackwardKernel<Bf16>),
      reinterpret_cast<const void*>(GatherRowsKernel<float>),
      reinterpret_cast<const void*>(ScatterRowsKernel<float>),
      reinterpret_cast<const void*>(CombineRowsKernel<float>),
      reinterpret_cast<const void*>(RowDotsKernel<float>),
      reinterpret_cast<const void*>(EmbeddingKernel<Bf16>),
      reinterpret_cast<const void*>(GatherRowsKernel<Bf16>),
      reinterpret_cast<const void*>(ScatterRowsKernel<Bf16>),
      reinterpret_cast<const void*>(CombineRowsKernel<Bf16>),
      reinterpret_cast<const void*>(RowDotsKernel<Bf16>),
      reinterpret_cast<const void*>(RopeKernel<float>),
      reinterpret_cast<const void*>(RopeKernel<Bf16>),
      reinterpret_cast<const void*>(RouterKernel),
      reinterpret_cast<const void*>(RouterBackwardKernel),
      reinterpret_cast<const void*>(AttentionInitKernel),
      reinterpret_cast<const void*>(AttentionForwardKernel<float>),
      reinterpret_cast<const void*>(AttentionForwardKernel<Bf16>),
      reinterpret_cast<const void*>(AttentionFinalizeKernel),
      reinterpret_cast<const void*>(AttentionDeltaKernel<float>),
      reinterpret_cast<const void*>(AttentionDeltaKernel<Bf16>),
      reinterpret_cast<const void*>(AttentionBackwardDqKernel<float>),
      reinterpret_cast<const void*>(AttentionBackwardDqKernel<Bf16>),
      reinterpret_cast<const void*>(AttentionBackwardDkvKernel<float>),
      reinterpret_cast<const void*>(AttentionBackwardDkvKernel<Bf16>),
  };
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
