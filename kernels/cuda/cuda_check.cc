#include "kernels/cuda/cuda_check.h"

#include "absl/strings/str_cat.h"

namespace plateau {

bool IsCudaDeviceFault(cudaError_t error) {
  switch (error) {
    case cudaErrorECCUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorNvlinkUncorrectable:
    // What a broken context reports where the driver cannot say more (the
    // gVisor machines returned it for every call after a fault).
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

absl::Status CudaStatus(cudaError_t error, const char* call, const char* file,
                        int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Errors that are not sticky stay in the per-thread last-error slot;
  // clear it, since this one is now being reported.
  (void)cudaGetLastError();
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (error) {
    case cudaErrorMemoryAllocation:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInvalidDevice:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  return absl::Status(
      code, absl::StrCat(file, ":", line, ": ", call, ": ",
                         cudaGetErrorName(error), " (",
                         cudaGetErrorString(error), ")",
                         IsCudaDeviceFault(error) ? kDeviceFaultNote : ""));
}

absl::Status CublasStatus(cublasStatus_t status, const char* call,
                          const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code = status == CUBLAS_STATUS_ALLOC_FAILED
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat(file, ":", line, ": ", call, ": ",
                         cublasGetStatusName(status), " (",
                         cublasGetStatusString(status), ")"));
}

}  // namespace plateau
