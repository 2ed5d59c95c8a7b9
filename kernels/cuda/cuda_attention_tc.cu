// The tensor-core attention kernels' launchers; the kernels themselves are
// cuda_attention_tc_kernels.inc (shared with the CPU emulation test). See
// cuda_attention_tc.h.
#include "kernels/cuda/cuda_attention_tc.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/cuda_device_utils.cuh"
#include "kernels/cuda/mma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

#include "kernels/cuda/cuda_attention_tc_kernels.inc"

bool GridFits(const AttentionDims& s, int64_t tiles, int64_t heads) {
  return tiles <= 0x7fffffff && heads <= 65535 && s.batch <= 65535;
}

// The kernels double-buffer their streamed tiles where the device lets a
// block take the shared memory, else single-buffer them (the same bits).
// (The shared-memory sizes are named first: a template argument list's comma
// inside PLATEAU_KERNEL_LAUNCH's arguments would split them.)
template <int D>
cudaError_t LaunchForward(cudaStream_t stream, const AttentionDims& s, int smem_optin,
                          const Bf16* q, const Bf16* k, const Bf16* v, float* m, float* l,
                          float* acc) {
  const int64_t tiles = (s.q_len + kTile - 1) / kTile;
  if (!GridFits(s, tiles, s.heads)) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(s.heads),
                  static_cast<unsigned>(s.batch));
  constexpr int kSingle = TcSmem<D, 1>::kForward, kDouble = TcSmem<D, 2>::kForward;
  if (kDouble <= smem_optin) {
    PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kDouble, stream, AttentionForwardTcKernel<D, 2>)(
        s, q, k, v, m, l, acc);
  } else {
    PLATEAU_KERNEL_LAUNCH(grid, kTcThreads, kSingle, stream, AttentionForwardTcKernel<D, 1>)(
        s, q, k, v, m, l, acc);
  }
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchBackward(cudaStream_t stream, const AttentionDims& s, int smem_optin,
                           const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* dout,
                           const float* lse, const float* delta, Bf16* dq, float* dk, float* dv) {
  const int64_t qtiles = (s.q_len + kTile - 1) / kTile, ktiles = (s.kv_len + kTile - 1) / kTile;
  if (!GridFits(s, qtiles, s.heads) || !GridFits(s, ktiles, s.kv_heads)) {
    return cudaErrorInvalidConfiguration;
  }
  // The two kernels write disjoint outputs (dq; dk and dv) and only read the
  // rest, so their order on the stream does not matter.
  const dim3 qgrid(static_cast<unsigned>(qtiles), static_cast<unsigned>(s.heads),
                   static_cast<unsigned>(s.batch));
  constexpr int kDqSingle = TcSmem<D, 1>::kDq, kDqDouble = TcSmem<D, 2>::kDq;
  if (kDqDouble <= smem_optin) {
    PLATEAU_KERNEL_LAUNCH(qgrid, kTcThreads, kDqDouble, stream, AttentionDqTcKernel<D, 2>)(
        s, q, k, v, dout, lse, delta, dq);
  } else {
    PLATEAU_KERNEL_LAUNCH(qgrid, kTcThreads, kDqSingle, stream, AttentionDqTcKernel<D, 1>)(
        s, q, k, v, dout, lse, delta, dq);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 kgrid(static_cast<unsigned>(ktiles), static_cast<unsigned>(s.kv_heads),
                   static_cast<unsigned>(s.batch));
  constexpr int kDkvSingle = TcSmem<D, 1>::kDkv, kDkvDouble = TcSmem<D, 2>::kDkv;
  if (kDkvDouble <= smem_optin) {
    PLATEAU_KERNEL_LAUNCH(kgrid, kTcThreads, kDkvDouble, stream, AttentionDkvTcKernel<D, 2>)(
        s, q, k, v, dout, lse, delta, dk, dv);
  } else {
    PLATEAU_KERNEL_LAUNCH(kgrid, kTcThreads, kDkvSingle, stream, AttentionDkvTcKernel<D, 1>)(
        s, q, k, v, dout, lse, delta, dk, dv);
  }
  return cudaGetLastError();
}

const Bf16* AsBf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* AsBf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }

}  // namespace

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

cudaError_t AttentionForwardBlockTc(cudaStream_t stream, const AttentionDims& s, int smem_optin,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    float* m, float* l, float* acc) {
  switch (s.head_dim) {
    case 64:
      return LaunchForward<64>(stream, s, smem_optin, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    case 128:
      return LaunchForward<128>(stream, s, smem_optin, AsBf16(q), AsBf16(k), AsBf16(v), m, l, acc);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t AttentionBackwardBlockTc(cudaStream_t stream, const AttentionDims& s, int smem_optin,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                     const uint16_t* dout, const float* lse, const float* delta,
                                     uint16_t* dq, float* dk, float* dv) {
  switch (s.head_dim) {
    case 64:
      return LaunchBackward<64>(stream, s, smem_optin, AsBf16(q), AsBf16(k), AsBf16(v),
                                AsBf16(dout), lse, delta, AsBf16(dq), dk, dv);
    case 128:
      return LaunchBackward<128>(stream, s, smem_optin, AsBf16(q), AsBf16(k), AsBf16(v),
                                 AsBf16(dout), lse, delta, AsBf16(dq), dk, dv);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LoadAttentionTcKernels(int smem_optin) {
  struct Kernel {
    const void* fn;
    int smem;  // what it launches with
  };
  const Kernel kernels[] = {
      {reinterpret_cast<const void*>(AttentionForwardTcKernel<64, 1>), TcSmem<64, 1>::kForward},
      {reinterpret_cast<const void*>(AttentionForwardTcKernel<64, 2>), TcSmem<64, 2>::kForward},
      {reinterpret_cast<const void*>(AttentionForwardTcKernel<128, 1>), TcSmem<128, 1>::kForward},
      {reinterpret_cast<const void*>(AttentionForwardTcKernel<128, 2>), TcSmem<128, 2>::kForward},
      {reinterpret_cast<const void*>(AttentionDqTcKernel<64, 1>), TcSmem<64, 1>::kDq},
      {reinterpret_cast<const void*>(AttentionDqTcKernel<64, 2>), TcSmem<64, 2>::kDq},
      {reinterpret_cast<const void*>(AttentionDqTcKernel<128, 1>), TcSmem<128, 1>::kDq},
      {reinterpret_cast<const void*>(AttentionDqTcKernel<128, 2>), TcSmem<128, 2>::kDq},
      {reinterpret_cast<const void*>(AttentionDkvTcKernel<64, 1>), TcSmem<64, 1>::kDkv},
      {reinterpret_cast<const void*>(AttentionDkvTcKernel<64, 2>), TcSmem<64, 2>::kDkv},
      {reinterpret_cast<const void*>(AttentionDkvTcKernel<128, 1>), TcSmem<128, 1>::kDkv},
      {reinterpret_cast<const void*>(AttentionDkvTcKernel<128, 2>), TcSmem<128, 2>::kDkv},
  };
  for (const Kernel& k : kernels) {
    cudaFuncAttributes attributes;
    cudaError_t e = cudaFuncGetAttributes(&attributes, k.fn);
    if (e != cudaSuccess) return e;
    // Past the 48 KiB default: a host-side attribute of this device's
    // context, set once here rather than before every launch.
    if (k.smem > smem_optin) continue;
    e = cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
