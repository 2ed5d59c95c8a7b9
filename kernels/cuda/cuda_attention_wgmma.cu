// The wgmma kernels' launchers (forward, dQ, dK/dV); the kernels are in
// cuda_attention_wgmma_kernels.inc (shared with the CPU emulation test),
// which builds on cuda_attention_tc_kernels.inc. See cuda_attention_wgmma.h.
#include "kernels/cuda/cuda_attention_wgmma.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/cuda_attention_tc.h"
#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/mma_layout.h"
#include "kernels/cuda/wgmma_instructions.h"
#include "kernels/cuda/wgmma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

#include "kernels/cuda/cuda_attention_tc_kernels.inc"
#include "kernels/cuda/cuda_attention_wgmma_kernels.inc"

template <int D, int kStages>
void LaunchStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q,
                  const Bf16* k, const Bf16* v, float* m, float* l, float* acc) {
  constexpr int kSmem = WgSmem<D, kStages>::kForward;
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionForwardWgKernel<D, kStages>)(
      s, q, k, v, m, l, acc);
}

template <int D>
cudaError_t Launch(cudaStream_t stream, const AttentionDims& s, int stages, const Bf16* q,
                   const Bf16* k, const Bf16* v, float* m, float* l, float* acc) {
  dim3 grid;
  if (!TileGrid(s, s.q_len, s.heads, &grid)) return cudaErrorInvalidConfiguration;
  if (stages == 2) {
    LaunchStages<D, 2>(stream, grid, s, q, k, v, m, l, acc);
  } else {
    LaunchStages<D, 1>(stream, grid, s, q, k, v, m, l, acc);
  }
  return cudaGetLastError();
}

template <int D, int kStages>
void LaunchDqStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q, const Bf16* k, const Bf16* v,
                    const Bf16* dout, const float* lse, const float* delta, float* dq) {
  constexpr int kSmem = WgDqSmem<D, kStages>::kDq;  // (a macro argument holds no comma)
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionDqWgKernel<D, kStages>)(
      s, q, k, v, dout, lse, delta, dq);
}

template <int D, int kStages>
void LaunchDkvStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q,
                     const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse,
                     const float* delta, float* dk, float* dv) {
  constexpr int kSmem = WgDkvSmem<D, kStages>::kDkv;
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionDkvWgKernel<D, kStages>)(
      s, q, k, v, dout, lse, delta, dk, dv);
}

// The dQ kernel, then the dK/dV kernel: they write disjoint outputs (dq;
// dk and dv) and only read the rest, so their order does not matter.
template <int D>
cudaError_t LaunchBackward(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages, const Bf16* q,
                           const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse, const float* delta,
                           float* dq, float* dk, float* dv) {
  dim3 qgrid, kgrid;
  if (!TileGrid(s, s.q_len, s.heads, &qgrid) || !TileGrid(s, s.kv_len, s.kv_heads, &kgrid)) {
    return cudaErrorInvalidConfiguration;
  }
  if (stages.dq == 2) {
    LaunchDqStages<D, 2>(stream, qgrid, s, q, k, v, dout, lse, delta, dq);
  } else {
    LaunchDqStages<D, 1>(stream, qgrid, s, q, k, v, dout, lse, delta, dq);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (stages.dkv == 2) {
    LaunchDkvStages<D, 2>(stream, kgrid, s, q, k, v, dout, lse, delta, dk, dv);
  } else {
    LaunchDkvStages<D, 1>(stream, kgrid, s, q, k, v, dout, lse, delta, dk, dv);
  }
  return cudaGetLastError();
}

template <int D>
cudaError_t OptIn(int smem_optin) {
  const std::pair<const void*, int> kernels[] = {
      {reinterpret_cast<const void*>(AttentionForwardWgKernel<D, 1>), WgSmem<D, 1>::kForward},
      {reinterpret_cast<const void*>(AttentionForwardWgKernel<D, 2>), WgSmem<D, 2>::kForward},
      {reinterpret_cast<const void*>(AttentionDqWgKernel<D, 1>), WgDqSmem<D, 1>::kDq},
      {reinterpret_cast<const void*>(AttentionDqWgKernel<D, 2>), WgDqSmem<D, 2>::kDq},
      {reinterpret_cast<const void*>(AttentionDkvWgKernel<D, 1>), WgDkvSmem<D, 1>::kDkv},
      {reinterpret_cast<const void*>(AttentionDkvWgKernel<D, 2>), WgDkvSmem<D, 2>::kDkv}};
  for (auto [fn, smem] : kernels) {
    const cudaError_t e = OptInSharedMemory(fn, smem, smem_optin);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <int D>
cudaError_t Choose(int smem_optin, AttentionTcStages* stages) {
  cudaError_t e = ChooseKernelBuffers(
      reinterpret_cast<const void*>(AttentionForwardWgKernel<D, 1>), WgSmem<D, 1>::kForward,
      reinterpret_cast<const void*>(AttentionForwardWgKernel<D, 2>), WgSmem<D, 2>::kForward,
      smem_optin, &stages->forward);
  if (e != cudaSuccess) return e;
  e = ChooseKernelBuffers(reinterpret_cast<const void*>(AttentionDqWgKernel<D, 1>),
                          WgDqSmem<D, 1>::kDq,
                          reinterpret_cast<const void*>(AttentionDqWgKernel<D, 2>),
                          WgDqSmem<D, 2>::kDq, smem_optin, &stages->dq);
  if (e != cudaSuccess) return e;
  return ChooseKernelBuffers(reinterpret_cast<const void*>(AttentionDkvWgKernel<D, 1>),
                             WgDkvSmem<D, 1>::kDkv,
                             reinterpret_cast<const void*>(AttentionDkvWgKernel<D, 2>),
                             WgDkvSmem<D, 2>::kDkv, smem_optin, &stages->dkv);
}

}  // namespace

cudaError_t AttentionForwardBlockWg(cudaStream_t stream, const AttentionDims& s, int stages,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    float* m, float* l, float* acc) {
  const Bf16* bq = reinterpret_cast<const Bf16*>(q);
  const Bf16* bk = reinterpret_cast<const Bf16*>(k);
  const Bf16* bv = reinterpret_cast<const Bf16*>(v);
  switch (s.head_dim) {
    case 64:
      return Launch<64>(stream, s, stages, bq, bk, bv, m, l, acc);
    case 128:
      return Launch<128>(stream, s, stages, bq, bk, bv, m, l, acc);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t AttentionBackwardBlockWg(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout,
                                     const float* lse, const float* delta, float* dq, float* dk, float* dv) {
  const Bf16* bq = reinterpret_cast<const Bf16*>(q);
  const Bf16* bk = reinterpret_cast<const Bf16*>(k);
  const Bf16* bv = reinterpret_cast<const Bf16*>(v);
  const Bf16* bdo = reinterpret_cast<const Bf16*>(dout);
  switch (s.head_dim) {
    case 64:
      return LaunchBackward<64>(stream, s, stages, bq, bk, bv, bdo, lse, delta, dq, dk, dv);
    case 128:
      return LaunchBackward<128>(stream, s, stages, bq, bk, bv, bdo, lse, delta, dq, dk, dv);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LoadAttentionWgKernels(int smem_optin) {
  cudaError_t e = OptIn<64>(smem_optin);
  return e == cudaSuccess ? OptIn<128>(smem_optin) : e;
}

cudaError_t ChooseAttentionWgStages(int64_t head_dim, int smem_optin, bool double_buffer,
                                    AttentionTcStages* stages) {
  stages->forward = stages->dq = stages->dkv = 1;
  if (!double_buffer) return cudaSuccess;
  switch (head_dim) {
    case 64:
      return Choose<64>(smem_optin, stages);
    case 128:
      return Choose<128>(smem_optin, stages);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace plateau::cuda_model_ops
