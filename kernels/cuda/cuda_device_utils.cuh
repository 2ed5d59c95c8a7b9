// Launch geometry, the fixed-order block reduction and the spellings of a
// launch and of shared memory shared by the CUDA kernel files (cuda_ops.cu,
// cuda_model_ops.cu, cuda_attention_tc.cu). Read by nvcc, and by g++ for the
// SIMT emulation (kernels/cuda/simt_emulator.h defines the macros there).
#ifndef PLATEAU_KERNELS_CUDA_CUDA_DEVICE_UTILS_CUH_
#define PLATEAU_KERNELS_CUDA_CUDA_DEVICE_UTILS_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

// A launch and shared memory, written so that the same source also compiles
// for the emulation (kernels/cuda/simt_emulator.h):
//   PLATEAU_KERNEL_LAUNCH(grid, block, smem, stream, Kernel<T>)(args...);
//   PLATEAU_SHARED_ARRAY(float, name, count);   // __shared__ float name[count]
//   PLATEAU_DYNAMIC_SHARED(float, name);        // extern __shared__ float name[]
#if defined(__CUDACC__)
#define PLATEAU_KERNEL_LAUNCH(grid, block, smem, stream, ...) \
  __VA_ARGS__<<<grid, block, smem, stream>>>
#define PLATEAU_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#define PLATEAU_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif

namespace plateau::cuda_device {

// Every kernel runs blocks of kThreads threads on at most kMaxGrid blocks;
// grid-stride loops cover any size, so the grid changes which thread does
// what, never a result. The SIMT emulation (no __CUDACC__) switches
// contexts per thread: it caps grids at 256 blocks, which keeps the twin
// tests' sizes fast there and runs the loops' wrap-around at small sizes.
constexpr int kThreads = 256;
#if defined(__CUDACC__)
constexpr int64_t kMaxGrid = int64_t{1} << 16;
#else
constexpr int64_t kMaxGrid = int64_t{1} << 8;
#endif

inline int ElementwiseGrid(int64_t n) {
  return static_cast<int>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxGrid));
}

// One block per row, up to kMaxGrid blocks (then blocks take several rows).
inline int RowGrid(int64_t rows) {
  return static_cast<int>(std::clamp<int64_t>(rows, 1, kMaxGrid));
}

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Combines one value from each of the block's kThreads threads in a fixed
// tree (the same pairs every run) and returns the result to every thread.
// The trailing barrier makes the shared array free for the next call.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op) {
  PLATEAU_SHARED_ARRAY(T, smem, kThreads);
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      smem[threadIdx.x] = op(smem[threadIdx.x], smem[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const T result = smem[0];
  __syncthreads();
  return result;
}

}  // namespace plateau::cuda_device

#endif  // PLATEAU_KERNELS_CUDA_CUDA_DEVICE_UTILS_CUH_
