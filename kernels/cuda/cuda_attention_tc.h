// Attention's bf16 block pairs on tensor cores: FlashAttention-2's schedule
// with mma.sync m16n8k16 (bf16 operands, fp32 accumulators; sm_80 and
// sm_90), behind the same block-pair interface as the tiled kernels of
// cuda_model_ops.h (ring attention's running state m, l, acc; lse, delta;
// dq, dk, dv fp32 accumulators, dk and dv travelling with the block).
//
// Why: the tiled kernels multiply in fp32 on CUDA cores, two shared-memory
// loads per multiply-add, a few TFLOP/s; attention is most of the long-context
// step's FLOPs, so issue 17's MFU target needs tensor cores.
//
// Arithmetic (what kernels/model/attention_tc.h computes on the CPU, up to
// the order of the sums and ex2.approx's ulps): x = q . k, exact bf16
// products accumulated in fp32 (a tensor core aligns and truncates inside
// one instruction rather than rounding each addition to nearest: far inside
// the twin test's tolerance); per 64-key tile of the block the online-softmax
// step in base 2 with the scale folded in, p = exp2(fma(x, scale log2(e),
// -m2)) (FlashAttention's form: one FFMA and one MUFU.EX2 a score), the
// probabilities rounded to bf16 (they are the next product's operand) and l
// summing the rounded values, so that o is exactly a convex combination of
// the rows of v under the weights used; m is kept in natural units between
// calls (m2 = m log2(e) inside one). Backward recomputes p = exp2(fma(x,
// scale log2(e), -lse log2(e))) in fp32, dS = p (dP - delta) in fp32, and
// rounds p (for dV = P^T dO) and dS (for dQ = dS K and dK = dS^T Q) to bf16
// as operands. dq adds scale * (its fp32 sum) to the fp32 dq once per call
// (ring attention rounds it to bf16 once, after its last hop); dk adds scale * (its fp32 sum over the group's heads and
// every query tile), dv its sum.
//
// Speed: the loops are written so that a warp issues few instructions
// beside its mma.sync (tools/sass-mix counts them from the machine code):
// only the tiles on the causal diagonal or past a sequence's end test the
// mask, full tiles copy without bounds tests, the exponent is one FFMA
// and one ex2, a warp whose rows kept their maxima skips o's rescale, and
// dK/dV loads each step's row statistics a step before storing them.
// BENCHMARKS.md ("On a GPU") has the counts. What still bounds
// them is shared memory: every B fragment passes through registers by
// ldmatrix (about one 512-byte LDSM per two HMMA, near half an H200's bf16
// rate by bandwidth alone). On an H100/H200 the three kernels
// all run on wgmma (cuda_attention_wgmma.h), which reads its operands from
// shared memory itself.
//
// Layout of the work: 128 threads (4 warps x 16 rows) per block of 64 query
// rows (forward, dQ) or 64 keys (dK/dV: the group's heads and the query tiles
// that see the keys, in a fixed order, so no atomics and the same bits run to
// run). K, V, Q, dO tiles pass through shared memory row-major, padded by 8
// bf16 per row (ldmatrix's eight 16-byte rows then fall in distinct banks):
// copied in by cp.async, double-buffered where the device allows it without
// fewer resident blocks (ChooseAttentionTcStages), read into
// fragments by ldmatrix (.trans for the operands used transposed: V, K, Q,
// dO as B of P V, dS K, dS^T Q, P^T dO), rows chosen by mma_layout.h.
//
// Takes head_dim 64 or 128 (kernels/model/attention_tc.h's
// TensorCoreHeadDim) and 16-byte aligned pointers
// (the tiles load 16 bytes at a time); the caller falls back to the tiled
// kernels otherwise. Shared memory per block at head_dim 128: 51 KiB
// (forward), 68.5 KiB (dQ, dK/dV) single-buffered; 85 KiB, 102.5 KiB, 103
// KiB double-buffered. LoadAttentionTcKernels opts the kernels in once per
// device, ChooseAttentionTcStages picks each kernel's buffering there
// (double where it fits and costs no resident block), and the caller checks
// the single-buffered need (AttentionTcSmemBytes).
#ifndef PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_TC_H_
#define PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_TC_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_model_ops.h"

namespace plateau::cuda_model_ops {

// Query rows per block and keys per tile (kernels/model/attention_tc.h's
// kAttentionTcTile: the key tiles fix where the probabilities are rounded).
inline constexpr int kAttentionTcTileRows = 64;
// log2(e) and ln(2) as floats (kernels/model/attention_tc.h's, the twin's):
// the exponentials are base 2, see above.
inline constexpr float kAttentionTcLog2e = 1.44269504088896340736f;
inline constexpr float kAttentionTcLn2 = 0.69314718055994530942f;

// The most dynamic shared memory one of them takes single-buffered at this
// head_dim (the dQ and dK/dV kernels: 36.5 KiB at 64, 68.5 KiB at 128); 0
// when none exists. A device whose opt-in limit
// (cudaDevAttrMaxSharedMemoryPerBlockOptin) is below it cannot launch them;
// every sm_80+ device can.
int AttentionTcSmemBytes(int64_t head_dim);

// How many buffers of its streamed tiles each kernel uses (1 or 2: the same
// bits, see above).
struct AttentionTcStages {
  int forward = 1, dq = 1, dkv = 1;
  // The kernels on Hopper's wgmma (cuda_attention_wgmma.h, sm_90 only)
  // instead of mma.sync: what CreateCudaModelKernels chooses on an sm_90
  // device where the wgmma probe and wgmma_attention_check.h agree (the
  // counts above are then the wgmma kernels' buffers). The caller launches
  // AttentionForwardBlockWg and AttentionBackwardBlockWg then.
  bool wgmma = false;
};

// As AttentionForwardBlockBf16 (cuda_model_ops.h), in the arithmetic above,
// with `stages` (ChooseAttentionTcStages; single-buffered by default).
cudaError_t AttentionForwardBlockTc(cudaStream_t stream, const AttentionDims& s,
                                    const AttentionTcStages& stages, const uint16_t* q,
                                    const uint16_t* k, const uint16_t* v, float* m, float* l,
                                    float* acc);
// As AttentionBackwardBlockBf16: the dQ kernel, then the dK/dV kernel.
cudaError_t AttentionBackwardBlockTc(cudaStream_t stream, const AttentionDims& s, const AttentionTcStages& stages,
                                     const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* dout,
                                     const float* lse, const float* delta, float* dq, float* dk, float* dv);

// Loads the kernels' module now (backend creation; LoadKernels beside) and
// opts each kernel in to the shared memory it launches with, once, on the
// current device: those that fit `smem_optin` (the device's
// cudaDevAttrMaxSharedMemoryPerBlockOptin; the caller launches no other).
cudaError_t LoadAttentionTcKernels(int smem_optin);

// The stages for `head_dim` (64 or 128) on the current device, after
// LoadAttentionTcKernels(smem_optin): each kernel double-buffers where that
// fits `smem_optin` and keeps as many blocks resident per multiprocessor as
// single buffering (cudaOccupancyMaxActiveBlocksPerMultiprocessor). By
// ptxas's counts for sm_90 (126 to 240 registers a thread, 2026-12-07) a
// single-buffered kernel keeps 3 or 4 blocks of 128 threads where double
// buffering's shared memory leaves 2 or 3, so on an H100/H200 many choose
// single; the CPU emulation counts 255 registers (2 blocks either way) and
// chooses double, so the emulated tests' default path is not the H200's
// (both are tested: cuda_attention_tc_twin_test runs single buffering, and
// the two are bit for bit the same). An A100's 164 KiB would hold one
// double-buffered block at head_dim 128 against two single-buffered.
// `double_buffer` false: single everywhere.
cudaError_t ChooseAttentionTcStages(int64_t head_dim, int smem_optin, bool double_buffer,
                                    AttentionTcStages* stages);

// What LoadAttentionTcKernels does for one kernel (also for the wgmma
// kernels, cuda_attention_wgmma.h): loads its module, and opts it in to
// `smem` bytes of dynamic shared memory where that fits `smem_optin`.
cudaError_t OptInSharedMemory(const void* kernel, int smem, int smem_optin);

// The rule above for one kernel (also the wgmma kernels',
// cuda_attention_wgmma.h): *stages = 2 where the double-buffered variant
// `twice` fits `smem_optin` and keeps as many 128-thread blocks resident
// per multiprocessor as `single` (the runtime's occupancy: registers and
// shared memory), else 1.
cudaError_t ChooseKernelBuffers(const void* single, int single_smem, const void* twice,
                                int twice_smem, int smem_optin, int* stages);

}  // namespace plateau::cuda_model_ops

#endif  // PLATEAU_KERNELS_CUDA_CUDA_ATTENTION_TC_H_
