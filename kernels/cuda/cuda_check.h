// CUDA runtime and cuBLAS return codes as absl::Status, with the failing call
// and its file and line. Nothing here exits or aborts: a daemon's training
// step reports the error and the job fails cleanly.
#ifndef PLATEAU_KERNELS_CUDA_CUDA_CHECK_H_
#define PLATEAU_KERNELS_CUDA_CUDA_CHECK_H_

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace plateau {

// A device fault (an illegal address, a failed launch, a kernel assert, an
// uncorrectable ECC error, ...) is sticky in CUDA: it poisons the whole
// context, so every later CUDA call of this process fails too and nothing
// short of a new process recovers the GPU. cudaDeviceReset() would destroy
// every stream, buffer and communicator the rest of the process still holds.
bool IsCudaDeviceFault(cudaError_t error);
// What a device fault's status says after the error itself.
inline constexpr char kDeviceFaultNote[] =
    "; a device fault: this process's CUDA context is unusable from now on, "
    "the process must exit and a new one take over the GPU";

// OK for cudaSuccess. Otherwise RESOURCE_EXHAUSTED for allocation failures,
// FAILED_PRECONDITION when there is no usable device or driver, INTERNAL for
// the rest; the message reads "file:line: call: cudaErrorName (description)",
// followed by kDeviceFaultNote for a device fault.
// Also clears the calling thread's last-error slot, so the error is not
// reported a second time by a later launch check.
absl::Status CudaStatus(cudaError_t error, const char* call, const char* file,
                        int line);
absl::Status CublasStatus(cublasStatus_t status, const char* call,
                          const char* file, int line);

}  // namespace plateau

#define PLATEAU_CUDA_RETURN_IF_ERROR(call)                               \
  do {                                                                   \
    const cudaError_t plateau_cuda_error_ = (call);                      \
    if (plateau_cuda_error_ != cudaSuccess) {                            \
      return ::plateau::CudaStatus(plateau_cuda_error_, #call, __FILE__, \
                                   __LINE__);                            \
    }                                                                    \
  } while (0)

#define PLATEAU_CUBLAS_RETURN_IF_ERROR(call)                                 \
  do {                                                                       \
    const cublasStatus_t plateau_cublas_status_ = (call);                    \
    if (plateau_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                   \
      return ::plateau::CublasStatus(plateau_cublas_status_, #call, __FILE__, \
                                     __LINE__);                              \
    }                                                                        \
  } while (0)

#endif  // PLATEAU_KERNELS_CUDA_CUDA_CHECK_H_
