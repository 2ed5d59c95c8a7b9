// The SIMT emulation's stand-in for CUDA's <cuda_runtime_api.h>: the part of
// the CUDA runtime the backend uses, on the CPU (emulated/runtime.cc), so the
// CUDA backend's own host code and kernels run without a GPU under
// --config=cuda_emulated. Only targets built with that config see this
// folder (kernels/cuda/BUILD.bazel).
//
// What it models (see runtime.cc for the details):
//   - devices: the machine has PLATEAU_EMULATED_GPUS (default 1), each an
//     sm_90 "GPU" with its own memory count (PLATEAU_EMULATED_GPU_MIB,
//     default 4096); a process sees those CUDA_VISIBLE_DEVICES names
//     (indices only), in that order, and none if it names none (every call
//     then fails with cudaErrorNoDevice); the current device per host thread;
//   - streams run their work lazily, in order, only when the host looks (a
//     synchronise, a query, an event it depends on): a host read of a result
//     without synchronising sees the old bytes, and a stream that does not
//     wait for another's event may run before it. The exception is external
//     work (the emulated NCCL's collectives), which starts as soon as its
//     stream can reach it and blocks the stream until it is done;
//   - kernel launches check their configuration as CUDA does (block size,
//     grid limits, dynamic shared memory past 48 KiB only after
//     cudaFuncSetAttribute) and run on the SIMT emulation
//     (kernels/cuda/simt_emulator.h) when their stream runs;
//   - a kernel that fails there (a deadlock, a write past shared memory) is
//     a device fault: sticky, every later call returns cudaErrorLaunchFailure.
// Not modelled: concurrency between streams (one runs at a time), timing,
// the hardware's arithmetic (expf/logf are the host's libm), and device
// memory beyond its size (device pointers are host memory: an ASan build
// catches a kernel's out-of-bounds access).
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_API_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_API_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/simt_emulator.h"

typedef struct CUevent_st* cudaEvent_t;
typedef struct CUmemPoolHandle_st* cudaMemPool_t;

enum cudaStreamFlags_ { cudaStreamDefault = 0, cudaStreamNonBlocking = 1 };
#define cudaStreamLegacy ((cudaStream_t)0x1)
enum { cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2 };
enum { cudaHostAllocDefault = 0, cudaHostAllocPortable = 1 };

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};

enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
  cudaMemoryType type;
  int device;
  void* devicePointer;
  void* hostPointer;
};

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  size_t sharedMemPerBlockOptin;
  int major, minor;
  int multiProcessorCount;
  int maxThreadsPerBlock;
  int clockRate;
};

enum cudaDeviceAttr {
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrMemoryPoolsSupported = 115,
};

struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  int maxDynamicSharedSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

enum cudaMemAllocationType { cudaMemAllocationTypeInvalid = 0, cudaMemAllocationTypePinned = 1 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1 };
struct cudaMemLocation {
  cudaMemLocationType type;
  int id;
};
struct cudaMemPoolProps {
  cudaMemAllocationType allocType;
  int handleTypes;
  cudaMemLocation location;
  void* win32SecurityAttributes;
  size_t maxSize;
  unsigned char reserved[56];
};
enum cudaMemPoolAttr {
  cudaMemPoolAttrReleaseThreshold = 4,
  cudaMemPoolAttrReservedMemCurrent = 5,
  cudaMemPoolAttrReservedMemHigh = 6,
  cudaMemPoolAttrUsedMemCurrent = 7,
};

const char* cudaGetErrorName(cudaError_t error);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();

// The CUDA version (1000 major + 10 minor) the driver supports and the
// runtime is: the emulation answers 13.0 for both.
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaDeviceReset();
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p);

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t keep_bytes);
cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool,
                                    cudaStream_t stream);
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream);

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t* stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags);
cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device);

cudaError_t cudaEventCreate(cudaEvent_t* event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* fn);
cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value);
// How many blocks of `func` (blockSize threads, dynamicSMemSize bytes of
// dynamic shared memory) one multiprocessor of an sm_90 holds: 228 KiB of
// shared memory, 1 KiB of it reserved per block; 2048 threads; 32 blocks;
// 64K registers, where every thread is taken to use 255 (a g++-compiled
// kernel has no register count; 255 is the most a thread may have, and the
// tensor-core attention kernels take 136-255). 0 past the kernel's dynamic
// shared-memory limit, as CUDA. Static __shared__ arrays are not counted
// (the emulation sizes them at run time; the kernels that ask have none).
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func,
                                                          int blockSize, size_t dynamicSMemSize);

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_CUDA_RUNTIME_API_H_
