// Launch geometry and the fixed-order block reduction shared by the CUDA
// kernel files (cuda_ops.cu, cuda_model_ops.cu). nvcc only.
#ifndef PLATEAU_KERNELS_CUDA_CUDA_DEVICE_UTILS_CUH_
#define PLATEAU_KERNELS_CUDA_CUDA_DEVICE_UTILS_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace plateau::cuda_device {

// Every kernel runs blocks of kThreads threads on at most kMaxGrid blocks;
// grid-stride loops cover any size.
constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 16;

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
  __shared__ T smem[kThreads];
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
