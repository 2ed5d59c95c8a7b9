// The block pairs of tensor-core attention, forward and backward, on
// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a): the same interface,
// tiles, walk and arithmetic as AttentionForwardBlockTc and
// AttentionBackwardBlockTc (cuda_attention_tc.h), their operands read by
// the tensor cores straight from shared memory instead of through
// registers (cuda_attention_wgmma_kernels.inc says how). Built for sm_90a only: an
// H100 or H200 runs it, nothing else has an image of it, so the caller
// (CreateCudaModelKernels) takes it only on compute capability 9.0 and
// only where, on that device, the wgmma probe (wgmma_probe.h) agrees with
// its reference and these kernels with the mma.sync ones
// (wgmma_attention_check.h).
#ifndef PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_WGMMA_H_
#define PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_WGMMA_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_attention_tc.h"
#include "kernels/cuda/cuda_model_ops.h"

namespace plateau::cuda_model_ops {

// As AttentionForwardBlockTc, with `stages` buffers (1 or 2) of the K and
// V tiles. head_dim 64 or 128, 16-byte aligned pointers.
cudaError_t AttentionForwardBlockWg(cudaStream_t stream, const AttentionDims& s, int stages,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    float* m, float* l, float* acc);

// As AttentionBackwardBlockTc: the dQ kernel (`stages`.dq buffers), then
// the dK/dV kernel (`stages`.dkv), both on wgmma.
cudaError_t AttentionBackwardBlockWg(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout,
                                     const float* lse, const float* delta, float* dq, float* dk, float* dv);

// Loads the kernels' module and opts each in to its shared memory (at most
// 97 KiB, dK/dV double-buffered at head_dim 128: every sm_90 block may), on
// the current device.
cudaError_t LoadAttentionWgKernels(int smem_optin);
// Sets stages->forward, dq and dkv for the wgmma kernels at `head_dim`: the
// buffers as ChooseKernelBuffers picks them (1 where `double_buffer` is
// false).
cudaError_t ChooseAttentionWgStages(int64_t head_dim, int smem_optin, bool double_buffer,
                                    AttentionTcStages* stages);

}  // namespace plateau::cuda_model_ops

#endif  // PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_WGMMA_H_
