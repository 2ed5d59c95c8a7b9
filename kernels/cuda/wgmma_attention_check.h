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
// agree to rounding where the kernels are right, and differ by the
// outputs' own size where a descriptor, stride or fragment is misread. A
// disagreement keeps the backend on mma.sync (a few milliseconds, once per
// device in a process, buy that a misreading costs speed, never a wrong
// gradient).
#ifndef PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_
#define PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_attention_tc.h"

namespace plateau::cuda_model_ops {

// Runs the forward and backward block pairs of both families at `head_dim`
// (64 or 128; `mma` and `wgmma` the buffers each launches with) on the
// current device, on fixed data: a ring of two K/V blocks (an earlier one
// of three key tiles every query sees, then the queries' own causal
// block), 70 queries (a partial tile), GQA 2 over two K/V heads, batch 2,
// the running state carried from block to block and dq, dk, dv
// accumulated from nonzero starts. Compares m, l, o, dq (after each
// block), dk and dv, each row against its own largest value: m and l
// within 2^-16 (the data make S and dP exact in fp32: expected bit for
// bit), o, dq, dk, dv within 2^-10 (only the order of fp32 sums differs); a
// misread operand moves an output by its own size. Every buffer lies
// between 4 KiB guard bands, and a write into one (by either family) is a
// disagreement too, named by buffer and offset. *agrees false names the
// array and element in *why; so does a launch error that does not stick
// ("did not run"). A
// fault is returned, and leaves the process's CUDA context unusable (a
// misread address can fault: the kernels' shared memory has no slack, the
// probe's has). Needs the modules loaded and opted in
// (LoadAttentionTcKernels, LoadAttentionWgKernels).
cudaError_t CheckAttentionWgAgainstTc(int64_t head_dim, const AttentionTcStages& mma,
                                      const AttentionTcStages& wgmma, bool* agrees,
                                      std::string* why);

}  // namespace plateau::cuda_model_ops

#endif  // PLATEAU_KERNELS_CUDA_WGMMA_ATTENTION_CHECK_H_
