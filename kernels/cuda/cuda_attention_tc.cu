// The tensor-core attention kernels' launchers; the kernels themselves are
// cuda_attention_tc_kernels.inc (shared with the CPU emulation test). See
// cuda_attention_tc.h.
#include "kernels/cuda/cuda_attention_tc.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/mma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

#include "kernels/cuda/cuda_attention_tc_kernels.inc"

// The kernels with kStages buffers of their streamed tiles, as launched.
// (The shared-memory sizes are named apart: a template argument list's comma
// inside PLATEAU_KERNEL_LAUNCH's arguments would split them.)
template <int D, int kStages>
void LaunchForwardStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q,
                         const Bf16* k, const Bf16* v, float* m, float* l, float* acc) {
  constexpr int kSmem = TcSmem<D, kStages>::kForward;
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionForwardTcKernel<D, kStages>)(
      s, q, k, v, m, l, acc);
}
template <int D, int kStages>
void LaunchDqStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q, const Bf16* k, const Bf16* v,
                    const Bf16* dout, const float* lse, const float* delta, float* dq) {
  constexpr int kSmem = TcSmem<D, kStages>::kDq;
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionDqTcKernel<D, kStages>)(
      s, q, k, v, dout, lse, delta, dq);
}
template <int D, int kStages>
void LaunchDkvStages(cudaStream_t stream, dim3 grid, const AttentionDims& s, const Bf16* q,
                     const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse,
                     const float* delta, float* dk, float* dv) {
  constexpr int kSmem = TcSmem<D, kStages>::kDkv;
  PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSmem, stream, AttentionDkvTcKernel<D, kStages>)(
      s, q, k, v, dout, lse, delta, dk, dv);
}

template <int D>
cudaError_t LaunchForward(cudaStream_t stream, const AttentionDims& s,
                          const AttentionTcStages& stages, const Bf16* q, const Bf16* k,
                          const Bf16* v, float* m, float* l, float* acc) {
  dim3 grid;
  if (!TileGrid(s, s.q_len, s.heads, &grid)) return cudaErrorInvalidConfiguration;
  if (stages.forward == 2) {
    LaunchForwardStages<D, 2>(stream, grid, s, q, k, v, m, l, acc);
  } else {
    LaunchForwardStages<D, 1>(stream, grid, s, q, k, v, m, l, acc);
  }
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchBackward(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages, const Bf16* q,
                           const Bf16* k, const Bf16* v, const Bf16* dout, const float* lse, const float* delta,
                           float* dq, float* dk, float* dv) {
  dim3 qgrid, kgrid;
  if (!TileGrid(s, s.q_len, s.heads, &qgrid) || !TileGrid(s, s.kv_len, s.kv_heads, &kgrid)) {
    return cudaErrorInvalidConfiguration;
  }
  // The two kernels write disjoint outputs (dq; dk and dv) and only read the
  // rest, so their order on the stream does not matter.
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

// One kernel's two variants, for the stage choice and the opt-in.
struct Variants {
  const void* single;
  const void* twice;  // double-buffered
  int single_smem, twice_smem;
};
template <int D>
Variants ForwardVariants() {
  return {reinterpret_cast<const void*>(AttentionForwardTcKernel<D, 1>),
          reinterpret_cast<const void*>(AttentionForwardTcKernel<D, 2>), TcSmem<D, 1>::kForward,
          TcSmem<D, 2>::kForward};
}
template <int D>
Variants DqVariants() {
  return {reinterpret_cast<const void*>(AttentionDqTcKernel<D, 1>),
          reinterpret_cast<const void*>(AttentionDqTcKernel<D, 2>), TcSmem<D, 1>::kDq,
          TcSmem<D, 2>::kDq};
}
template <int D>
Variants DkvVariants() {
  return {reinterpret_cast<const void*>(AttentionDkvTcKernel<D, 1>),
          reinterpret_cast<const void*>(AttentionDkvTcKernel<D, 2>), TcSmem<D, 1>::kDkv,
          TcSmem<D, 2>::kDkv};
}

cudaError_t Stages(const Variants& v, int smem_optin, int* stages) {
  return ChooseKernelBuffers(v.single, v.single_smem, v.twice, v.twice_smem, smem_optin, stages);
}

template <int D>
cudaError_t ChooseStages(int smem_optin, AttentionTcStages* stages) {
  cudaError_t e = Stages(ForwardVariants<D>(), smem_optin, &stages->forward);
  if (e == cudaSuccess) e = Stages(DqVariants<D>(), smem_optin, &stages->dq);
  if (e == cudaSuccess) e = Stages(DkvVariants<D>(), smem_optin, &stages->dkv);
  return e;
}

const Bf16* AsBf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }

}  // namespace

cudaError_t ChooseKernelBuffers(const void* single, int single_smem, const void* twice,
                                int twice_smem, int smem_optin, int* stages) {
  *stages = 1;
  if (twice_smem > smem_optin) return cudaSuccess;
  int single_blocks = 0, twice_blocks = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&single_blocks, single, kTcThreads,
                                                                single_smem);
  if (e != cudaSuccess) return e;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&twice_blocks, twice, kTcThreads, twice_smem);
  if (e != cudaSuccess) return e;
  if (twice_blocks >= single_blocks && twice_blocks > 0) *stages = 2;
  return cudaSuccess;
}

int AttentionTcSmemBytes(int64_t head_dim) {
  // The instantiations: kernels/model/attention_tc.h's TensorCoreHeadDim.
  // Single-buffered, the dQ and dK/dV kernels take the same and the most.
  switch (head_dim) {
    case 64:
      return TcSmem<64, 1>::kDkv;
    case 128:
      return TcSmem<128, 1>::kDkv;
    default:
      return 0;
  }
}

cudaError_t AttentionForwardBlockTc(cudaStream_t stream, const AttentionDims& s,
                                    const AttentionTcStages& stages, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, float* m, float* l,
                                    float* acc) {
  switch (s.head_dim) {
    case 64:
      return LaunchForward<64>(stream, s, stages, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    case 128:
      return LaunchForward<128>(stream, s, stages, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t AttentionBackwardBlockTc(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout,
                                     const float* lse, const float* delta, float* dq, float* dk, float* dv) {
  switch (s.head_dim) {
    case 64:
      return LaunchBackward<64>(stream, s, stages, AsBf16(q), AsBf16(k), AsBf16(v), AsBf16(dout), lse, delta, dq, dk,
                                dv);
    case 128:
      return LaunchBackward<128>(stream, s, stages, AsBf16(q), AsBf16(k), AsBf16(v), AsBf16(dout), lse, delta, dq, dk,
                                 dv);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LoadAttentionTcKernels(int smem_optin) {
  const Variants kernels[] = {ForwardVariants<64>(), ForwardVariants<128>(), DqVariants<64>(),
                              DqVariants<128>(),     DkvVariants<64>(),      DkvVariants<128>()};
  for (const Variants& v : kernels) {
    cudaError_t e = OptInSharedMemory(v.single, v.single_smem, smem_optin);
    if (e == cudaSuccess) e = OptInSharedMemory(v.twice, v.twice_smem, smem_optin);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t OptInSharedMemory(const void* kernel, int smem, int smem_optin) {
  cudaFuncAttributes attributes;
  cudaError_t e = cudaFuncGetAttributes(&attributes, kernel);  // loads its module now
  if (e != cudaSuccess) return e;
  // Past the 48 KiB default: a host-side attribute of this device's
  // context, set once here rather than before every launch.
  if (smem > smem_optin) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

cudaError_t ChooseAttentionTcStages(int64_t head_dim, int smem_optin, bool double_buffer,
                                    AttentionTcStages* stages) {
  *stages = AttentionTcStages{};
  if (!double_buffer) return cudaSuccess;
  switch (head_dim) {
    case 64:
      return ChooseStages<64>(smem_optin, stages);
    case 128:
      return ChooseStages<128>(smem_optin, stages);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace plateau::cuda_model_ops
