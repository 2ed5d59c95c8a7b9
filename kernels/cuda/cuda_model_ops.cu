// CUDA kernels of the model kernels; see cuda_model_ops.h.
//
// Where the CPU reference multiplies and then adds (StripDelta, GatherRows,
// CombineRows), the kernels use __fmul_rn/__fadd_rn so nvcc does not contract
// them into an FMA: the remaining differences are those of expf/logf against
// the host's libm and of the reduction order.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/cuda_model_ops.h"

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

__global__ void StripInitKernel(float* state, int64_t rows) {
  for (int64_t i = GlobalThread(); i < 3 * rows; i += GridThreads()) {
    state[i] = i < rows ? -INFINITY : 0.0f;
  }
}

// The online log-sum-exp step of one strip, fused: the row max, the rescale
// of the running sum, the new exp-sum and the target logit in one pass over
// the strip (two reads of the row, one launch). The exp-sum of a row
// accumulates in double per thread and in the tree, then rounds once.
__global__ void __launch_bounds__(kThreads)
    StripFoldKernel(const float* logits, int64_t rows, int64_t width,
                    int64_t col0, const int32_t* targets, float* m, float* s,
                    float* t) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t target = targets[r];
    if (target == kIgnore) continue;  // the same for the whole block
    const float* xr = logits + r * width;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      mx = fmaxf(mx, xr[c]);
    }
    mx = BlockReduce(mx, MaxOp());
    const float mold = m[r];
    const float mnew = fmaxf(mold, mx);
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      sum += static_cast<double>(expf(xr[c] - mnew));
    }
    sum = BlockReduce(sum, SumOp());
    if (threadIdx.x == 0) {
      // exp(-inf) = 0 on the first strip, as on the CPU.
      s[r] = __fadd_rn(__fmul_rn(s[r], expf(mold - mnew)),
                       static_cast<float>(sum));
      m[r] = mnew;
      if (target >= col0 && target < col0 + width) t[r] = xr[target - col0];
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
__global__ void StripDeltaKernel(float* x, int64_t rows, int64_t width,
                                 int64_t col0, const int32_t* targets,
                                 const float* lse, float scale) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    const int64_t c = i - r * width;
    const int64_t target = targets[r];
    if (target == kIgnore) {
      x[i] = 0.0f;
      continue;
    }
    float v = __fmul_rn(expf(x[i] - lse[r]), scale);
    if (target - col0 == c) v = __fsub_rn(v, scale);
    x[i] = v;
  }
}

// Dense cross-entropy, pass 1: lse per row (0 for ignored rows).
__global__ void __launch_bounds__(kThreads)
    CrossEntropyLseKernel(const float* logits, const int32_t* targets,
                          int64_t rows, int64_t vocab, float* lse) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (targets[r] == kIgnore) {
      if (threadIdx.x == 0) lse[r] = 0.0f;
      continue;
    }
    const float* xr = logits + r * vocab;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < vocab; c += kThreads) {
      mx = fmaxf(mx, xr[c]);
    }
    mx = BlockReduce(mx, MaxOp());
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < vocab; c += kThreads) {
      sum += static_cast<double>(expf(xr[c] - mx));
    }
    sum = BlockReduce(sum, SumOp());
    if (threadIdx.x == 0) lse[r] = mx + logf(static_cast<float>(sum));
  }
}

// Pass 2, one block: the loss sum and count over the rows, as StripFinish.
__global__ void __launch_bounds__(kThreads)
    CrossEntropyLossKernel(const float* logits, const int32_t* targets,
                           int64_t rows, int64_t vocab, const float* lse,
                           double* stats) {
  double loss = 0.0, count = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) {
    const int64_t target = targets[r];
    if (target == kIgnore) continue;
    loss += static_cast<double>(lse[r] - logits[r * vocab + target]);
    count += 1.0;
  }
  loss = BlockReduce(loss, SumOp());
  count = BlockReduce(count, SumOp());
  if (threadIdx.x == 0) {
    stats[0] += loss;
    stats[1] += count;
  }
}

__global__ void EmbeddingKernel(const float* table, const int32_t* tokens,
                                int64_t rows, int64_t hidden, float* out) {
  const int64_t n = rows * hidden;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / hidden;
    out[i] = table[static_cast<int64_t>(tokens[r]) * hidden + (i - r * hidden)];
  }
}

__global__ void EmbeddingBackwardKernel(const float* dout,
                                        const int32_t* tokens, int64_t rows,
                                        int64_t hidden, float* dtable) {
  for (int64_t c = GlobalThread(); c < hidden; c += GridThreads()) {
    for (int64_t r = 0; r < rows; ++r) {
      float* d = dtable + static_cast<int64_t>(tokens[r]) * hidden + c;
      *d = __fadd_rn(*d, dout[r * hidden + c]);
    }
  }
}

__global__ void GatherRowsKernel(const float* src, const int32_t* index,
                                 const float* scales, int64_t rows,
                                 int64_t width, float* dst) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    const float v = src[static_cast<int64_t>(index[r]) * width + (i - r * width)];
    dst[i] = scales == nullptr ? v : __fmul_rn(scales[r], v);
  }
}

// The indices are distinct, so every destination element has one writer.
__global__ void ScatterRowsKernel(const float* src, int64_t rows,
                                  const int32_t* index, int64_t width,
                                  float* dst) {
  const int64_t n = rows * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t r = i / width;
    dst[static_cast<int64_t>(index[r]) * width + (i - r * width)] = src[i];
  }
}

// Each output element is owned by one thread, which adds the k terms in j
// order (the CPU order).
__global__ void CombineRowsKernel(const float* src, const int32_t* pos,
                                  const float* weights, int64_t tokens,
                                  int64_t k, int64_t width, float* out) {
  const int64_t n = tokens * width;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t t = i / width;
    const int64_t c = i - t * width;
    float o = out[i];
    for (int64_t j = 0; j < k; ++j) {
      const float w = weights == nullptr ? 1.0f : weights[t * k + j];
      const float v = src[static_cast<int64_t>(pos[t * k + j]) * width + c];
      o = __fadd_rn(o, __fmul_rn(w, v));
    }
    out[i] = o;
  }
}

// One block per (token, j) pair; the products of two floats are exact in
// double, so only the order of the double sum differs from the CPU.
__global__ void __launch_bounds__(kThreads)
    RowDotsKernel(const float* a, const float* b, const int32_t* pos,
                  int64_t tokens, int64_t k, int64_t width, float* out) {
  for (int64_t p = blockIdx.x; p < tokens * k; p += gridDim.x) {
    const float* x = a + (p / k) * width;
    const float* y = b + static_cast<int64_t>(pos[p]) * width;
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < width; c += kThreads) {
      acc += static_cast<double>(x[c]) * static_cast<double>(y[c]);
    }
    acc = BlockReduce(acc, SumOp());
    if (threadIdx.x == 0) out[p] = static_cast<float>(acc);
  }
}

// One thread per (row, j) pair of a half-split rotation; mul and sub/add
// rounded separately, as the CPU does.
__global__ void RopeKernel(float* x, int64_t rows, int64_t len, int64_t heads,
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
    float* v = x + row * head_dim;
    const float x1 = v[j], x2 = v[j + half];
    v[j] = __fsub_rn(__fmul_rn(x1, cs), __fmul_rn(x2, sn));
    v[j + half] = __fadd_rn(__fmul_rn(x2, cs), __fmul_rn(x1, sn));
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

}  // namespace

cudaError_t Router(cudaStream_t stream, const float* logits, int64_t rows,
                   int64_t experts, int64_t top_k, float* probs,
                   int32_t* chosen, float* gates) {
  RouterKernel<<<ElementwiseGrid(rows), kThreads, 0, stream>>>(
      logits, rows, experts, top_k, probs, chosen, gates);
  return cudaGetLastError();
}

cudaError_t RouterBackward(cudaStream_t stream, const float* probs,
                           const int32_t* chosen, const float* gates,
                           const float* dgates, int64_t rows, int64_t experts,
                           int64_t top_k, float* dlogits) {
  RouterBackwardKernel<<<ElementwiseGrid(rows), kThreads, 0, stream>>>(
      probs, chosen, gates, dgates, rows, experts, top_k, dlogits);
  return cudaGetLastError();
}

cudaError_t Rope(cudaStream_t stream, float* x, int64_t batch, int64_t len,
                 int64_t heads, int64_t head_dim, int64_t pos0,
                 const RopeFreqs& freqs, bool inverse) {
  const int64_t rows = batch * len * heads;
  RopeKernel<<<ElementwiseGrid(rows * (head_dim / 2)), kThreads, 0, stream>>>(
      x, rows, len, heads, head_dim, pos0, freqs, inverse);
  return cudaGetLastError();
}

cudaError_t StripInit(cudaStream_t stream, float* state, int64_t rows) {
  StripInitKernel<<<ElementwiseGrid(3 * rows), kThreads, 0, stream>>>(state,
                                                                     rows);
  return cudaGetLastError();
}

cudaError_t StripFold(cudaStream_t stream, const float* logits, int64_t rows,
                      int64_t width, int64_t col0, const int32_t* targets,
                      float* state, int64_t stride) {
  StripFoldKernel<<<RowGrid(rows), kThreads, 0, stream>>>(
      logits, rows, width, col0, targets, state, state + stride,
      state + 2 * stride);
  return cudaGetLastError();
}

cudaError_t StripFinish(cudaStream_t stream, const float* state,
                        const int32_t* targets, int64_t rows, float* lse,
                        double* stats) {
  StripFinishKernel<<<1, kThreads, 0, stream>>>(
      state, state + rows, state + 2 * rows, targets, rows, lse, stats);
  return cudaGetLastError();
}

cudaError_t StripDelta(cudaStream_t stream, float* logits_to_delta,
                       int64_t rows, int64_t width, int64_t col0,
                       const int32_t* targets, const float* lse, float scale) {
  StripDeltaKernel<<<ElementwiseGrid(rows * width), kThreads, 0, stream>>>(
      logits_to_delta, rows, width, col0, targets, lse, scale);
  return cudaGetLastError();
}

cudaError_t CrossEntropy(cudaStream_t stream, const float* logits,
                         const int32_t* targets, int64_t rows, int64_t vocab,
                         float* lse, double* stats) {
  CrossEntropyLseKernel<<<RowGrid(rows), kThreads, 0, stream>>>(
      logits, targets, rows, vocab, lse);
  CrossEntropyLossKernel<<<1, kThreads, 0, stream>>>(logits, targets, rows,
                                                     vocab, lse, stats);
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
  EmbeddingKernel<<<ElementwiseGrid(rows * hidden), kThreads, 0, stream>>>(
      table, tokens, rows, hidden, out);
  return cudaGetLastError();
}

cudaError_t EmbeddingBackward(cudaStream_t stream, const float* dout,
                              const int32_t* tokens, int64_t rows,
                              int64_t hidden, float* dtable) {
  EmbeddingBackwardKernel<<<ElementwiseGrid(hidden), kThreads, 0, stream>>>(
      dout, tokens, rows, hidden, dtable);
  return cudaGetLastError();
}

cudaError_t GatherRows(cudaStream_t stream, const float* src,
                       const int32_t* index, const float* scales, int64_t rows,
                       int64_t width, float* dst) {
  GatherRowsKernel<<<ElementwiseGrid(rows * width), kThreads, 0, stream>>>(
      src, index, scales, rows, width, dst);
  return cudaGetLastError();
}

cudaError_t ScatterRows(cudaStream_t stream, const float* src, int64_t rows,
                        const int32_t* index, int64_t width, float* dst) {
  ScatterRowsKernel<<<ElementwiseGrid(rows * width), kThreads, 0, stream>>>(
      src, rows, index, width, dst);
  return cudaGetLastError();
}

cudaError_t CombineRows(cudaStream_t stream, const float* src,
                        const int32_t* pos, const float* weights,
                        int64_t tokens, int64_t k, int64_t width, float* out) {
  CombineRowsKernel<<<ElementwiseGrid(tokens * width), kThreads, 0, stream>>>(
      src, pos, weights, tokens, k, width, out);
  return cudaGetLastError();
}

cudaError_t RowDots(cudaStream_t stream, const float* a, const float* b,
                    const int32_t* pos, int64_t tokens, int64_t k,
                    int64_t width, float* out) {
  RowDotsKernel<<<RowGrid(tokens * k), kThreads, 0, stream>>>(a, b, pos, tokens,
                                                              k, width, out);
  return cudaGetLastError();
}

cudaError_t LoadKernels() {
  const void* kernels[] = {
      reinterpret_cast<const void*>(StripInitKernel),
      reinterpret_cast<const void*>(StripFoldKernel),
      reinterpret_cast<const void*>(StripFinishKernel),
      reinterpret_cast<const void*>(StripDeltaKernel),
      reinterpret_cast<const void*>(CrossEntropyLseKernel),
      reinterpret_cast<const void*>(CrossEntropyLossKernel),
      reinterpret_cast<const void*>(EmbeddingKernel),
      reinterpret_cast<const void*>(EmbeddingBackwardKernel),
      reinterpret_cast<const void*>(GatherRowsKernel),
      reinterpret_cast<const void*>(ScatterRowsKernel),
      reinterpret_cast<const void*>(CombineRowsKernel),
      reinterpret_cast<const void*>(RowDotsKernel),
      reinterpret_cast<const void*>(RopeKernel),
      reinterpret_cast<const void*>(RouterKernel),
      reinterpret_cast<const void*>(RouterBackwardKernel),
  };
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
