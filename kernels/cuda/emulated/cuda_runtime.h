// The SIMT emulation's stand-in for CUDA's <cuda_runtime.h>: the runtime API
// (cuda_runtime_api.h) and the device-side language (simt_emulator.h). Only
// the emulated targets see this folder.
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_H_

#include "kernels/cuda/emulated/cuda_runtime_api.h"

// The C++ conveniences of the real header: typed allocation pointers.
template <class T>
inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T>
inline cudaError_t cudaHostAlloc(T** p, size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}
template <class T>
inline cudaError_t cudaMallocAsync(T** p, size_t bytes, cudaStream_t stream) {
  return cudaMallocAsync(reinterpret_cast<void**>(p), bytes, stream);
}

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_H_
