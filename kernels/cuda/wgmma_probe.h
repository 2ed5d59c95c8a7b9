// The wgmma probe: one small product through Hopper's warpgroup MMA
// (wgmma.mma_async m64n64k16, sm_90a) in every operand layout the kernels
// may use, so that the reading of the PTX ISA in wgmma_layout.h (fragments,
// the no-swizzle shared-memory layouts, the descriptor) and in the SIMT
// emulation (simt_emulator.cc, written apart) can be checked on an H100 or
// H200 (wgmma_probe_test, run by tools/device-check) before a kernel is
// built on them. Compiled for sm_90a only; other GPUs have no image of it.
#ifndef PLATEAU_KERNELS_CUDA_WGMMA_PROBE_H_
#define PLATEAU_KERNELS_CUDA_WGMMA_PROBE_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace plateau::cuda_wgmma {

// How the probe's B sits in shared memory (no swizzle, wgmma_layout.h):
// - kProbeBKMajor: K-major, copied from bt (core matrices N-fastest);
// - kProbeBMnMajor: MN-major, copied from b (N-fastest: SBO 128, LBO 1 KiB),
//   as the forward's V;
// - kProbeBMnKFastest: MN-major with the core matrices K-fastest (LBO 128,
//   SBO 512), as the wgmma dQ kernel reads its K-major K tile.
inline constexpr int kProbeBKMajor = 0, kProbeBMnMajor = 1, kProbeBMnKFastest = 2;
inline constexpr int kProbeBLayouts = 3;

// D[64][64] = A[64][32] B[32][64] (fp32 D; bf16 bits row-major; B^T is
// `bt`, [64][32], the same values), as two k-steps of 16, the second
// accumulating: A from registers or (a_in_smem) a K-major shared tile, B
// as `b_layout` says. One block of 128 threads on `stream`; 16-byte
// aligned pointers.
cudaError_t WgmmaProbe(cudaStream_t stream, bool a_in_smem, int b_layout, const uint16_t* a,
                       const uint16_t* b, const uint16_t* bt, float* d);

// Runs the probe in all six layouts on the current device, on fixed data,
// and compares each D with a double reference on the host (1e-5 relative:
// exact bf16 products summed in fp32): *agrees false names the first layout
// and element that differ in *why. The caller (CreateCudaModelKernels)
// takes the wgmma kernels only where it agrees. A device with no sm_90a
// image (not compute capability 9.0) is a disagreement, not an error; a
// fault is returned (the probe's shared memory has room for a misread
// descriptor's reads, so a misreading shows as wrong numbers, not a fault).
cudaError_t WgmmaProbeCheck(bool* agrees, std::string* why);

}  // namespace plateau::cuda_wgmma

#endif  // PLATEAU_KERNELS_CUDA_WGMMA_PROBE_H_
