// A small emulation of CUDA's execution model on the CPU, for running the
// body of a kernel that cannot run here (no GPU) as g++ code: each block's
// threads are user-level contexts (ucontext) switched at the collectives
// (__syncthreads, the warp shuffles, a warp-wide instruction), one block at
// a time. What it catches that a plain C++ port would not:
//   - a missing barrier: threads run in a chosen order (Schedule), as far
//     as the barriers let them, so a read of shared memory another warp has
//     not written yet (or has overwritten already) changes the results
//     between schedules;
//   - a barrier not every thread reaches (deadlock) and warp collectives
//     the lanes of a warp disagree on;
//   - uninitialised shared memory: it starts as 0xFF bytes (NaN floats and
//     bf16), and writes past the kernel's size land in a guard that is
//     checked after each block.
// Not modelled: memory-model subtleties inside a barrier interval (a thread
// runs until its next collective), timing, and the hardware's own
// arithmetic (a warp-wide instruction is whatever the test defines).
//
// The shims below (the CUDA keywords, threadIdx, bf16 conversions, the
// rounding intrinsics) are what kernels/cuda/cuda_attention_tc_kernels.inc
// uses; kernels/cuda/emulated/ maps <cuda_runtime.h> and friends here.
//
// Single-threaded: one grid at a time in one process (the state is global).
#ifndef PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_
#define PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x) alignas(x)

typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
typedef struct CUstream_st* cudaStream_t;

struct SimtDim3 {
  unsigned x = 0, y = 0, z = 0;
};
extern SimtDim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

// bf16 as CUDA's cuda_bf16.h rounds it: to nearest even, NaN kept NaN.
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;  // x in the low half
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = uint32_t{b.bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
// -ffp-contract=off (.bazelrc): each of these rounds on its own, as on CUDA.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
using std::max;
using std::min;

void __syncthreads();
float __shfl_xor_sync(unsigned mask, float x, int lane_mask);

namespace plateau::simt {

// The order in which runnable threads are resumed: kInOrder (thread 0
// first: warp 0 runs ahead), kReversed (warp 3 ahead), kShuffled (a fixed
// random order).
enum class Schedule { kInOrder, kReversed, kShuffled };

// Runs `body` once per block of `grid` (x fastest), `threads` threads a
// block, with `smem_bytes` of dynamic shared memory (SharedMemory()).
// Returns "" or what went wrong (a deadlock, divergent warp collectives, a
// write past the shared memory); the first problem is kept.
std::string RunGrid(SimtDim3 grid, int threads, int smem_bytes, Schedule schedule,
                    const std::function<void()>& body);

// The running block's dynamic shared memory.
unsigned char* SharedMemory();

// A warp-wide rendezvous for a collective operation `kind` (each kind a
// distinct number): returns when all 32 lanes of the caller's warp have
// called it; a lane calling another kind at the same point is a failure.
// Between two rendezvous a collective may read what every lane left in
// WarpScratch().
void WarpRendezvous(int kind);
// 32 lanes x 8 words of per-warp scratch for the collectives.
uint32_t (*WarpScratch())[8];

}  // namespace plateau::simt

#endif  // PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_
