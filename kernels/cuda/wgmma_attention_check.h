// The wgmma attention kernels (cuda_attention_wgmma.h) against the mma.sync
// ones (cuda_attention_tc.h) on the device itself, before a backend takes
// them: the second gate after the wgmma probe (wgmma_probe.h).
//
// Why: the probe checks the operand layouts in one small product, not the
// kernels' own strides, tiles and barriers at head_dim 64 and 128, and no
// machine without an H100/H200 can run the real instructions (the SIMT
// emulation checks the kernels against its own reading of the PTX ISA).
// Both families compute the same stated arithmetic (up to the order of the
// sums inside the tensor cores), so on small fixed inputs their outputs
// agree to a few bf16 units where the kernels are right, and differ by O(1)
// where a descriptor, stride or fragment is misread. A disagreement keeps
// the backend on mma.sync (a few milliseconds at backend creation buy
// that a misreading costs speed, never a wrong gradient).
#ifndef PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_
#define PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_attention_tc.h"

namespace plateau::cuda_model_ops {

// Runs the forward and backward block pairs of both families at `head_dim`
// (64 or 128; `mma` and `wgmma` the buffers each launches with) on the
// current device, on fixed data at two small shapes (a causal diagonal
// block of two key tiles, the second partial, and a block of queries that
// sees every key; two query heads per K/V head), and compares m, l, o, dq,
// dk and dv: each element within 2^-6 of the largest |value| of its array
// (the rounding of P and dS to bf16 is ~2^-8; a misread operand is O(1)).
// *agrees false names the array, shape and element in *why. Needs the
// modules loaded and opted in (LoadAttentionTcKernels,
// LoadAttentionWgKernels). A fault is returned.
cudaError_t CheckAttentionWgAgainstTc(int64_t head_dim, const AttentionTcStages& mma,
                                      const AttentionTcStages& wgmma, bool* agrees,
                                      std::string* why);

}  // namespace plateau::cuda_model_ops

#endif  // PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_
