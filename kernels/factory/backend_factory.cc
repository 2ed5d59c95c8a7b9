// Backend::Create, defined above the CPU and CUDA backends so that both
// depend on the interface (kernels/backend.h) and not on each other.
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#ifdef PLATEAU_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace plateau {

absl::StatusOr<std::unique_ptr<Backend>> Backend::Create(
    const BackendOptions& options) {
  if (options.device_memory_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_memory_bytes: must be >= 0, got ",
                     options.device_memory_bytes));
  }
  if (options.host_memory_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_memory_bytes: must be >= 0, got ", options.host_memory_bytes));
  }
  if (options.copy_delay_us_for_testing < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy_delay_us_for_testing: must be >= 0, got ", options.copy_delay_us_for_testing));
  }
  switch (options.kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend(options);
    case BackendKind::kCuda:
#ifdef PLATEAU_WITH_CUDA
      return CreateCudaBackend(options);
#else
      return absl::FailedPreconditionError(
          "backend: cuda was asked for, but this build has no CUDA backend; "
          "rebuild with --config=cuda");
#endif
  }
  return absl::InvalidArgumentError("backend: unknown kind");
}

}  // namespace plateau
