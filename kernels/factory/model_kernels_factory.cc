// ModelKernels::Create, defined above the CPU and CUDA model kernels so that
// both depend on the interface (kernels/model/model_kernels.h) only.
#include "kernels/cpu_backend.h"
#include "kernels/model/cpu_model_kernels.h"
#include "kernels/model/model_kernels.h"
#ifdef PLATEAU_WITH_CUDA
#include "kernels/cuda/cuda_model_kernels.h"
#endif

namespace plateau {

absl::StatusOr<std::unique_ptr<ModelKernels>> ModelKernels::Create(Backend& backend,
                                                                   const ModelKernelsOptions& options) {
  switch (backend.kind()) {
    case BackendKind::kCpu:
      return CreateCpuModelKernels(CpuBackendPool(backend), options);
    case BackendKind::kCuda:
#ifdef PLATEAU_WITH_CUDA
      return CreateCudaModelKernels(backend, options);
#else
      return absl::UnimplementedError(
          "model kernels: a cuda backend was given, but this build has no CUDA "
          "model kernels; rebuild with --config=cuda");
#endif
  }
  return absl::InvalidArgumentError("model kernels: unknown backend kind");
}

}  // namespace plateau
